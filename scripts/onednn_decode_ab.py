"""fp32 decode steps' linears through MKL (``nn.Linear``) and through oneDNN (``cpu_kernels.DecodeLinear``), in one
process on one model: the decode tokens/s of each and whether greedy answers agree.

The model is loaded as ``load_base`` loads it on an AMD CPU in fp32 (every ``nn.Linear`` a ``DecodeLinear``, the
weights as PyTorch holds them), with a LoRA adapter whose ``lora_B`` is non-zero (merged for generation, as fp32
generation runs). The two ways swap the layers' class in place: the same weights. First the greedy answers to
``--prompts`` ARC-Challenge prompts (16 new tokens, batches of 16) each way; then decode at batch 8 and 32 timed by
``fedspear bench``'s own ``decode_tokens_per_s`` (200-token prompts, 16 new tokens), ``--pairs`` alternating pairs,
with the median of the per-pair ratios. oneDNN's instruction set can be capped to emulate a CPU without AVX-512
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``; docs/performance.md).

    .venv/bin/python scripts/onednn_decode_ab.py [--pairs 6] [--prompts 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from fedspear.experiments.bench import decode_tokens_per_s
from fedspear.interaction import render
from fedspear.runtime.cpu_kernels import DecodeLinear, use_onednn_decode
from fedspear.runtime.generation import generate
from fedspear.runtime.model import LoraSettings, add_lora, load_base
from fedspear.tasks import arc_challenge

WAYS = {"mkl": torch.nn.Linear, "onednn": DecodeLinear}
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    base, tok, dtype_used = load_base(args.model, "fp32", "cpu")
    layers = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
    if not any(type(m) is DecodeLinear for m in layers):
        use_onednn_decode(base)  # not an AMD CPU: load_base left nn.Linear; the comparison still runs
    model = add_lora(base, LoraSettings(), seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a trained-looking adapter, so the merge changes the weights
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.02)

    def way(name: str) -> None:
        for layer in layers:
            layer.__class__ = WAYS[name]

    contexts = [render(tok, [arc_challenge.prompt(item)]) for item in arc_challenge.load("test")[: args.prompts]]
    answers = {}
    for name in WAYS:
        way(name)
        answers[name] = generate(model, tok, contexts, max_new_tokens=16, do_sample=False, batch_size=16)
    same = sum(a == b for a, b in zip(answers["mkl"], answers["onednn"]))
    isa = {v: os.environ[v] for v in ISA_VARIABLES if v in os.environ}
    print(f"{len(layers)} linears; torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
          f"{'; ' + ', '.join(f'{k}={v}' for k, v in isa.items()) if isa else ''}", flush=True)
    print(f"greedy answers (ARC-Challenge, 16 new tokens, adapter merged): {same} of {len(contexts)} the same",
          flush=True)
    rates: dict[str, dict[int, list[float]]] = {name: {8: [], 32: []} for name in WAYS}
    for name in WAYS:  # warm-up
        way(name)
        decode_tokens_per_s(model, tok, dtype_used, 8, 200, 4, repeats=1)
    for i in range(args.pairs):
        line = []
        for name in (list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]):
            way(name)
            for batch in (8, 32):
                rate = decode_tokens_per_s(model, tok, dtype_used, batch, 200, 16, repeats=1)[0]
                rates[name][batch].append(rate)
                line.append(f"{name} batch {batch} {rate:.0f}")
        print(f"pair {i}: " + ", ".join(line) + " tokens/s", flush=True)
    summary = {}
    for batch in (8, 32):
        ratios = [o / m for o, m in zip(rates["onednn"][batch], rates["mkl"][batch])]
        summary[batch] = {"mkl": statistics.median(rates["mkl"][batch]),
                          "onednn": statistics.median(rates["onednn"][batch]),
                          "ratio": statistics.median(ratios), "faster": sum(r > 1 for r in ratios)}
        print(f"batch {batch}: MKL {summary[batch]['mkl']:.0f}, oneDNN {summary[batch]['onednn']:.0f} tokens/s "
              f"(medians); oneDNN / MKL per pair: median {summary[batch]['ratio']:.3f} "
              f"({min(ratios):.3f}–{max(ratios):.3f}), oneDNN faster in {summary[batch]['faster']} of {len(ratios)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "isa": isa, "capability": torch.backends.cpu.get_cpu_capability(),
                       "greedy_same": same, "prompts": len(contexts), "tokens_per_s": rates,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
