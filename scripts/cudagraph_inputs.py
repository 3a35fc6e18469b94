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
(copied into the graph's buffers on every replay). A mutated non-static input would make a GPU skip CUDA graphs.

What a CPU cannot tell: the device checks (on the CPU inductor disables CUDA graphs for the device itself, so the
"disabled" reason printed is the CPU's), and anything decided when a graph is recorded on a GPU. It reads inductor's
private ``CompiledFxGraph`` (torch 2.13), so another torch may need another hook.

    .venv/bin/python scripts/cudagraph_inputs.py
    PYTHONPATH=<a transformers 5.17 copy> .venv/bin/python scripts/cudagraph_inputs.py   # the GPU machine's version
"""

from __future__ import annotations

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
    static = set(static_input_idxs or ())
    mutated = sorted(self.mutated_input_idxs)
    print(f"graph: {len(names)} inputs, {len(static)} static; disabled here: {disabled!r}")
    print("  mutated inputs (name, static):", [(names[i], i in static) for i in mutated])
    print("  non-static inputs:", [names[i] for i in range(len(names)) if i not in static])
    if any(i not in static for i in mutated):
        print("  → a GPU would skip CUDA graphs for this graph (a mutated input is not static)")


def main() -> None:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    output_code.CompiledFxGraph.__init__ = _report
    base, tokenizer = tiny_model()
    bf16_parameters(base)
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.05), seed=0)
    use_compiled_decode(model, "on", backend="inductor", mode="reduce-overhead")
    contexts = [[1, 2, 3, 4, 5, 6, 7, 8][: 3 + i % 5] for i in range(16)]
    for rows in (16, 7):  # buckets 16 and 8: a static graph, then one with the batch symbolic
        start = time.perf_counter()
        generate(model, tokenizer, contexts[:rows], max_new_tokens=6, dtype_used="bf16", do_sample=True)
        print(f"{rows} contexts decoded in {time.perf_counter() - start:.1f} s (compiling included)")


if __name__ == "__main__":
    main()
