"""Running the model: where its weights come from (``model_zoo``), loading it with a LoRA adapter in the chosen device
and precision (``model``; the adapter's update summed inside its ``lora_B`` product, ``lora_sum``), batched decoding
(``generation``), the CPU speed patches (``cpu_kernels``) and process memory (``memory``). Nothing here knows about
tasks, feedback or Flower."""
