"""Would inductor replay fedspear's compiled decode step as a CUDA graph? What can be read on a CPU.

With ``mode="reduce-overhead"`` inductor replays a compiled graph as a CUDA graph unless, among other reasons, the
graph mutates an input that is not *static* (a parameter, a buffer, or a tensor marked with
``torch._dynamo.mark_static_address``: one whose address never changes); such a graph then runs kernel by kernel,
launched from Python (``torch/_inductor/cudagraph_utils.py``: ``check_for_mutation``). The decode step writes the
new token's keys and values into the static KV cache, so every cache tensor it writes must be static.

This script compiles the tiny model's decode (``runtime.compiled.use_compiled_decode``, inductor in
reduce-overhead mode, bf16 parameters as on a GPU, a LoRA adapter) on the CPU, through
``runtime.generation.generate`` with sampling, at batch buckets 16 then 8, and prints for each graph inductor builds:
its inputs, how many are static, which inputs it mutates and whether each is static, and the non-static inputs
with their shapes or symbols (copied into the graph's buffers on every replay). A mutated non-static input would make
a GPU skip CUDA graphs; so would a symbol whose value changes from step to step (CUDA graphs are recorded once per
distinct value, so each step would run unrecorded).

Then it compiles the decode once more with torch's default device set to ``meta`` and a backend that only looks at
the graph dynamo captured: a tensor the traced code makes without naming a device shows there as a meta node. On a
GPU machine it would be a CPU tensor, and inductor skips CUDA graphs for a graph holding one
(``check_multiple_devices_or_any_cpu_nodes``: "skipping cudagraphs due to cpu device").

What a CPU cannot tell: the device checks (on the CPU inductor disables CUDA graphs for the device itself, so the
"disabled" reason printed is the CPU's), and anything decided when a graph is recorded on a GPU. It reads inductor's
private ``CompiledFxGraph`` (torch 2.13), so another torch may need another hook.

    .venv/bin/python scripts/cudagraph_inputs.py [--qwen2]   # --qwen2: a 2-layer Qwen2 (the GPU model's architecture)
    PYTHONPATH=<a transformers 5.17 copy> .venv/bin/python scripts/cudagraph_inputs.py   # the GPU machine's version
"""

from __future__ import annotations

import sys
import time

import torch
import transformers
from torch._inductor import output_code

from fedspear.runtime.compiled import use_compiled_decode
from fedspear.runtime.generation import generate
from fedspear.runtime.model import LoraSettings, add_lora, bf16_parameters, tiny_model

_init = output_code.CompiledFxGraph.__init__


def _report(self, current_callable, graph, gm, output_strides, disabled, metrics_deltas, counter_deltas, cudagraphs,
            example_inputs, static_input_idxs, *args, **kwargs):
    """``CompiledFxGraph.__init__``, then a report of the graph's inputs."""
    _init(self, current_callable, graph, gm, output_strides, disabled, metrics_deltas, counter_deltas, cudagraphs,
          example_inputs, static_input_idxs, *args, **kwargs)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    static = set(static_input_idxs or ())
    mutated = sorted(self.mutated_input_idxs)
    print(f"graph: {len(names)} inputs, {len(static)} static; disabled here: {disabled!r}")
    print("  mutated inputs (name, static):", [(names[i], i in static) for i in mutated])
    print("  non-static inputs (name, shape or symbol):",
          [(names[i], tuple(values[i].shape) if hasattr(values[i], "shape") else str(values[i]))
           for i in range(len(names)) if i not in static])
    if any(i not in static for i in mutated):
        print("  → a GPU would skip CUDA graphs for this graph (a mutated input is not static)")


def off_device_nodes(gm, example_inputs):
    """A torch.compile backend that prints the nodes of dynamo's graph whose tensor is not on the CPU (the model's
    device here) and runs the graph as it is."""
    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        for v in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                trace = (node.meta.get("stack_trace") or "").strip().splitlines()
                found.append((node.op, str(node.target)[:60], v.device.type, tuple(v.shape), trace[-1:]))
    print(f"graph of {len(gm.graph.nodes)} nodes, made with the default device set to meta: "
          f"{len(found)} nodes not on the model's device")
    for item in found[:20]:
        print("  ", item)
    return gm.forward


def model(qwen2: bool):
    """The tiny model (a 2-layer Llama) or a 2-layer Qwen2 of the same size, bf16, with a LoRA adapter."""
    base, tokenizer = tiny_model()
    if qwen2:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
        torch.manual_seed(0)
        base = Qwen2ForCausalLM(config)
        base.generation_config.pad_token_id = tokenizer.pad_token_id
    bf16_parameters(base)
    return add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.05), seed=0), tokenizer


def main() -> None:
    qwen2 = "--qwen2" in sys.argv[1:]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {'Qwen2' if qwen2 else 'Llama'}")
    contexts = [[1, 2, 3, 4, 5, 6, 7, 8][: 3 + i % 5] for i in range(16)]
    output_code.CompiledFxGraph.__init__ = _report
    lm, tokenizer = model(qwen2)
    use_compiled_decode(lm, "on", backend="inductor", mode="reduce-overhead")
    for rows in (16, 7):  # buckets 16 and 8: a static graph, then one with the batch symbolic
        start = time.perf_counter()
        generate(lm, tokenizer, contexts[:rows], max_new_tokens=6, dtype_used="bf16", do_sample=True)
        print(f"{rows} contexts decoded in {time.perf_counter() - start:.1f} s (compiling included)")
    output_code.CompiledFxGraph.__init__ = _init
    lm, tokenizer = model(qwen2)
    use_compiled_decode(lm, "on", backend=off_device_nodes)
    with torch.device("meta"):
        for rows in (16, 7):
            generate(lm, tokenizer, contexts[:rows], max_new_tokens=6, dtype_used="bf16", do_sample=True)


if __name__ == "__main__":
    main()
