"""``losses.token_logprobs`` (its own backward) against autograd through the same operations, in one process.

A training micro-step's completion log-probabilities, ``logits[y] − logsumexp(logits)`` over ``[B, T, V]`` logits
sliced from ``[B, T + 1, V]``: forward and backward seconds (medians of ``--repeats`` alternating pairs), the bytes
the backward keeps (every tensor saved for it), on a CUDA GPU the peak memory a call allocates, and whether values
and gradients are equal (bit for bit, or up to the sign of zero). The paper preset's micro-step on Qwen2.5-1.5B is
``--rows 32 --positions 256 --vocab 151936`` (1.2 G logits: 2.5 GB in bf16).

    .venv/bin/python scripts/token_logprobs_ab.py [--rows 16 --positions 256 --vocab 49152 --dtype bf16]
        [--device cpu|cuda] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedspear.losses import token_logprobs


def autograd_token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same operations differentiated by autograd: each row's float32 copy kept for the backward."""
    rows = []
    for row, index in zip(logits, labels.clamp(min=0)):
        row = row if row.dtype in (torch.float32, torch.float64) else row.float()
        rows.append(row.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


def saved_bytes(fn, logits, labels) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits[:, :-1], labels)
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device, dtype = torch.device(args.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gpu = device.type == "cuda"
    torch.manual_seed(0)
    base = torch.randn(args.rows, args.positions + 1, args.vocab, device=device).to(dtype)  # [B, T + 1, V]
    labels = torch.randint(0, args.vocab, (args.rows, args.positions), device=device)
    weights = torch.randn(args.rows, args.positions, device=device)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def once(fn, keep: bool = False) -> tuple:
        """(forward s, backward s, peak GiB allocated above what was allocated before the call[, out, grad])."""
        logits = base.clone().requires_grad_(True)
        sync()
        if gpu:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = fn(logits[:, :-1], labels)
        sync()
        mid = time.perf_counter()
        (out * weights).sum().backward()
        sync()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if gpu else float("nan")
        timing = (mid - start, time.perf_counter() - mid, peak)
        return (*timing, out.detach(), logits.grad) if keep else timing  # nothing kept past the call otherwise

    ways = {"autograd": autograd_token_logprobs, "token_logprobs": token_logprobs}
    runs: dict[str, list] = {name: [] for name in ways}
    once(token_logprobs)  # warm-up
    for _ in range(args.repeats):
        for name, fn in ways.items():
            runs[name].append(once(fn))
    print(f"[{args.rows}, {args.positions}, {args.vocab}] {args.dtype} logits on {device}, medians of {args.repeats}:")
    for name, fn in ways.items():
        fwd, bwd, peak = (statistics.median(r[i] for r in runs[name]) for i in (0, 1, 2))
        kept = saved_bytes(fn, base.clone().requires_grad_(True), labels) / 2**30
        more = f", peak {peak:.2f} GiB allocated by the call (its copy of the logits included)" if gpu else ""
        print(f"  {name:15s} forward {fwd:.3f} s, backward {bwd:.3f} s, kept for the backward {kept:.2f} GiB{more}")
    _, _, _, a, grad_a = once(autograd_token_logprobs, keep=True)
    _, _, _, b, grad_b = once(token_logprobs, keep=True)
    zeros = "" if torch.equal(grad_a.view(torch.uint8), grad_b.view(torch.uint8)) else " (up to the sign of zero)"
    print(f"  values equal: {torch.equal(a, b)}, gradients equal: {torch.equal(grad_a, grad_b)}{zeros}")


if __name__ == "__main__":
    main()
