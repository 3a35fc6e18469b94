"""Decode-speed candidates for issue 19 ("generation near its bound"), measured side by side on one machine.

The 135M model's decode is dispatch-bound (thousands of small ops per step); the issue asks to measure the
candidates and keep what wins. Each candidate decodes exactly ``--new`` tokens greedily for a batch of random
``--prompt``-token contexts with the LoRA adapter of a SPEAR client attached (r 16, all seven projections), as
``fedspear bench`` does; decode tokens/s is timed step by step (the prefill excluded), median of 3 calls, and set
against the bandwidth bound (batch × copy bandwidth ÷ bytes of the weights a step reads):

- ``eager``: transformers' ``generate`` with its dynamic KV cache (concatenated at every step);
- ``static``: the same with a static (pre-allocated) KV cache, not compiled;
- ``compiled``: static cache + ``torch.compile`` of the decode step (transformers' ``CompileConfig``, inductor,
  ``mode="default"``, static shapes), compiled at the first call of each batch shape and reused after; the first
  call's seconds are reported as compile time;
- ``frozen``: the same with inductor's ``freezing`` (its CPU inference setting: weights become constants of the
  graph and are pre-packed for oneDNN). The adapter is frozen into the graph too, so a client would recompile after
  every adapter update;
- ``prealloc``: eager, with fedspear's KV cache written in place (``fedspear.runtime.cpu_kernels.preallocated_cache``;
  what fedspear's generation uses) instead of concatenated at every step;
- ``merged``: eager, with the LoRA adapter merged into the base weights for the call
  (``fedspear.runtime.model.merged_adapter``): the 210 LoRA branches of SmolLM2 (5–6 small ops each) disappear from a
  decode step. With bf16 weights the merged update is rounded to bf16, i.e. quantised (compare its greedy answers).

``--profile``: one more decode run per candidate at the largest batch under ``torch.profiler`` (from the first new
token on: the prefill is not profiled), printing the ops that take most of a step (self CPU time, top 15), to see
whether a step is the matmuls, the KV cache's copies or the dispatch of small ops.

Then ``--check N``: greedy answers to the first N ARC-Challenge test prompts, each candidate against ``eager``
(tokens equal?), with a random non-zero adapter so LoRA is exercised.

    .venv/bin/python scripts/decode_candidates.py --model smollm2-135m --dtype fp32
    .venv/bin/python scripts/decode_candidates.py --model smollm2-135m --dtype bf16 --output /tmp/dc.json

Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

CANDIDATES = ("eager", "prealloc", "static", "compiled", "frozen", "merged")


def generate_kwargs(candidate: str) -> dict:
    """Extra ``generate`` arguments of a candidate (``prealloc``'s cache is made per call: ``cache_of``)."""
    if candidate in ("eager", "merged", "prealloc"):
        return {}
    if candidate == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    if candidate == "compiled":
        from transformers.generation.configuration_utils import CompileConfig

        config = CompileConfig(fullgraph=False, dynamic=False, backend="inductor", mode="default")
        config._compile_all_devices = True  # transformers compiles on GPUs only unless told
        return {"cache_implementation": "static", "compile_config": config}
    if candidate == "frozen":
        from transformers.generation.configuration_utils import CompileConfig

        config = CompileConfig(fullgraph=False, dynamic=False, backend="inductor", mode=None,
                               options={"freezing": True})
        config._compile_all_devices = True
        return {"cache_implementation": "static", "compile_config": config}
    raise ValueError(candidate)


def cache_of(candidate: str) -> str:
    """``decode_tokens_per_s``'s ``cache``: fedspear's preallocated one for ``prealloc``, transformers' otherwise."""
    return "fedspear" if candidate == "prealloc" else "transformers"


def _with_cache(model, candidate: str, capacity: int) -> dict:
    """``generate``'s keywords for ``candidate``: its own (``generate_kwargs``) and its cache, chosen as the bench
    chooses it (``fedspear.experiments.bench.decode_cache``)."""
    from fedspear.experiments.bench import decode_cache

    return dict(generate_kwargs(candidate), **decode_cache(model, cache_of(candidate), capacity))


def _merged(model, candidate: str):
    """The ``merged`` candidate's context: ``fedspear.runtime.model.merged_adapter`` (base weights put back exactly
    after)."""
    from fedspear.runtime.model import merged_adapter

    return merged_adapter(model, enabled=candidate == "merged")


@torch.no_grad()
def decode_rate(model, tokenizer, dtype_used: str, candidate: str, batch: int, prompt: int, new: int,
                repeats: int = 3) -> dict:
    """Seconds of the first call (compile included) and decode tokens/s, median of ``repeats`` later calls timed
    step by step (``fedspear.experiments.bench.decode_tokens_per_s``: prefill excluded)."""
    import statistics

    from fedspear.experiments.bench import decode_tokens_per_s
    from fedspear.runtime.model import autocast

    ids = torch.randint(100, 1000, (batch, prompt))
    t0 = time.perf_counter()
    with autocast(dtype_used), _merged(model, candidate):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                       **_with_cache(model, candidate, prompt + new))
    first = time.perf_counter() - t0
    runs = decode_tokens_per_s(model, tokenizer, dtype_used, batch, prompt, new, repeats=repeats,
                               merge=candidate == "merged", cache=cache_of(candidate), **generate_kwargs(candidate))
    return {"first_call_s": first, "tokens_per_s": statistics.median(runs), "runs": runs}


@torch.no_grad()
def decode_profile(model, tokenizer, dtype_used: str, candidate: str, batch: int, prompt: int, new: int,
                   top: int = 15) -> list[dict]:
    """The ``top`` ops by self CPU time over the decode steps of one ``generate`` call of ``new`` tokens (the
    profiler starts after the prefill's forward, at the first token's logits), with their share of the steps' total
    self CPU time (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LogitsProcessor, LogitsProcessorList

    from fedspear.runtime.model import autocast

    prof = profile(activities=[ProfilerActivity.CPU])

    class StartAtFirstToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not getattr(self, "started", False):
                prof.start()
                self.started = True
            return scores

    ids = torch.randint(100, 1000, (batch, prompt))
    with autocast(dtype_used), _merged(model, candidate):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                       logits_processor=LogitsProcessorList([StartAtFirstToken()]),
                       **_with_cache(model, candidate, prompt + new))
    prof.stop()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in rows]


@torch.no_grad()
def greedy_answers(model, tokenizer, dtype_used: str, candidate: str, contexts: list[list[int]], new: int) -> list:
    from fedspear.runtime.model import autocast

    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        mask[i, width - len(c):] = 1
    with autocast(dtype_used), _merged(model, candidate):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, use_cache=True,
                             **_with_cache(model, candidate, width + new))
    return out[:, width:].tolist()


def adapter_model(name: str, dtype: str):
    """fedspear's model on the CPU with a non-zero LoRA adapter (r 16, all seven projections, B ~ N(0, 0.02²), seed
    0), so the LoRA path changes the answers → (peft model, tokenizer, dtype used)."""
    from fedspear.runtime.model import LoraSettings, add_lora, load_base

    base, tokenizer, dtype_used = load_base(name, dtype, "cpu")
    model = add_lora(base, LoraSettings())
    model.eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model, tokenizer, dtype_used


def step_weight_bytes(model) -> int:
    """Bytes of the weights a decode step multiplies with: every parameter but an untied input embedding (a lookup)."""
    lookup = model.get_input_embeddings().weight
    lookup = None if lookup is model.get_output_embeddings().weight else lookup
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not lookup)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--check", type=int, default=16, help="ARC prompts whose greedy answers are compared")
    parser.add_argument("--profile", action="store_true", help="top ops of a decode run per candidate")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    from fedspear.experiments.bench import machine, memory_bandwidth
    from fedspear.interaction import render
    from fedspear.tasks import arc_challenge

    model, tokenizer, dtype_used = adapter_model(args.model, args.dtype)
    weight_bytes = step_weight_bytes(model)
    bandwidth = memory_bandwidth(256, 1.5)
    out = {"machine": machine(), "model": args.model, "dtype": dtype_used, "bandwidth_bytes_per_s": bandwidth,
           "weight_bytes": weight_bytes, "prompt": args.prompt, "new": args.new, "rates": {}, "check": {}}
    print(f"{out['machine']['kind']} · {args.model} · {dtype_used} · bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    for candidate in args.candidates:
        for batch in args.batches:
            r = decode_rate(model, tokenizer, dtype_used, candidate, batch, args.prompt, args.new)
            r["utilisation"] = r["tokens_per_s"] / (batch * bandwidth / weight_bytes)
            out["rates"][f"{candidate}/batch_{batch}"] = r
            print(f"{candidate:9s} batch {batch:3d}: {r['tokens_per_s']:7.0f} tokens/s = {r['utilisation']:.0%} of "
                  f"the bound; first call {r['first_call_s']:.1f} s", flush=True)
    if args.profile:
        out["profile"] = {}
        for candidate in args.candidates:
            rows = decode_profile(model, tokenizer, dtype_used, candidate, max(args.batches), args.prompt, args.new)
            out["profile"][candidate] = rows
            print(f"{candidate}, batch {max(args.batches)}, {args.new} new tokens: top ops by self CPU time")
            for row in rows:
                print(f"  {row['share']:6.1%} {row['self_ms']:9.1f} ms {row['calls']:7d} calls  {row['op']}")
    if args.check:
        items = arc_challenge.load("test")[: args.check]
        contexts = [render(tokenizer, [arc_challenge.prompt(e)]) for e in items]
        reference = greedy_answers(model, tokenizer, dtype_used, "eager", contexts, 16)
        for candidate in args.candidates:
            if candidate == "eager":
                continue
            got = greedy_answers(model, tokenizer, dtype_used, candidate, contexts, 16)
            same = sum(a == b for a, b in zip(got, reference))
            out["check"][candidate] = {"same": same, "of": len(contexts)}
            print(f"greedy answers, {candidate} vs eager: {same} of {len(contexts)} identical", flush=True)
    if args.output:
        args.output.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
