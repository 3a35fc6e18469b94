"""Milliseconds per decode step spent drawing the sampled token: transformers' warpers against fedspear's sampler.

A sampled decode step of ``generate`` ends by turning the step's logits ``[B, V]`` into one token per row. Timed
here on random logits rounded to bf16 as a bf16 model's are (the cost depends on the shape and on how often values
tie, little on the rest), per batch B and vocabulary V:

- ``transformers``: ``TemperatureLogitsWarper`` → ``TopKLogitsWarper(50)`` → ``TopPLogitsWarper`` → softmax →
  ``torch.multinomial``, what ``generate(do_sample=True, temperature, top_p)`` ran before 2026-11-28;
- ``fedspear``: ``runtime.sampling.NucleusSampler`` and the greedy argmax ``generate`` takes of its output.

Both at temperature 0.8, top-p 0.95 (SPEC §2). Vocabularies: SmolLM2's 49,152 and Qwen2.5's 151,936 by default.
Median of ``--repeats`` timed calls after one untimed; on a GPU each call is synchronised.

    .venv/bin/python scripts/sampling_cost.py [--device cpu|cuda] [--batches 8 32] [--vocab 49152 151936]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedspear.runtime.sampling import TOP_K, NucleusSampler  # noqa: E402


def transformers_draw(temperature: float, top_p: float):
    """transformers' own sampled step: its three warpers, softmax, multinomial (``generation/utils.py``)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(TOP_K),
                                 TopPLogitsWarper(top_p)])
    return lambda ids, scores: torch.multinomial(chain(ids, scores).softmax(-1), 1)


def fedspear_draw(temperature: float, top_p: float):
    """fedspear's sampled step: ``NucleusSampler`` and the argmax greedy decoding takes of what it returns."""
    sampler = NucleusSampler(temperature, top_p)
    return lambda ids, scores: sampler(ids, scores).argmax(-1)


def milliseconds(draw, batch: int, vocab: int, device: str, repeats: int) -> float:
    """Median milliseconds of one ``draw`` over random ``[batch, vocab]`` logits (bf16 values held in fp32)."""
    scores = (torch.randn(batch, vocab, device=device) * 3).bfloat16().float()  # a bf16 model's logits: ties
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        draw(ids, scores)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU")
    rows = []
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "ms per decode step, median of", args.repeats)
    print(f"{'batch':>5} {'vocab':>7} {'transformers':>13} {'fedspear':>9} {'ratio':>6}")
    for vocab in args.vocab:
        for batch in args.batches:
            theirs = milliseconds(transformers_draw(0.8, 0.95), batch, vocab, args.device, args.repeats)
            ours = milliseconds(fedspear_draw(0.8, 0.95), batch, vocab, args.device, args.repeats)
            rows.append({"batch": batch, "vocab": vocab, "transformers_ms": theirs, "fedspear_ms": ours})
            print(f"{batch:>5} {vocab:>7} {theirs:>13.2f} {ours:>9.2f} {theirs / ours:>5.1f}×")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
