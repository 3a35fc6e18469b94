"""``fedspear bench``: what this machine can do, what fedspear does with it, and one full SPEAR round.

Three parts, each printed next to its bound as a utilisation ratio:

1. **Bounds** (a few seconds of micro-benchmarks): matrix-multiply FLOP/s in bf16 and fp32 (square matmuls with
   torch) and memory bandwidth (a large tensor copy: bytes read + bytes written per second).
2. **Throughputs** on the model: prefill tokens/s (one forward over a batch of prompts), decode tokens/s at batch
   1 / 8 / 32 (greedy, fixed length, KV cache), LoRA training tokens/s (forward + backward), central-evaluation
   items/s. Utilisation: prefill FLOP/s ÷ bound with 2 × params FLOPs per token; training with ≈ 4 × params per
   token (forward 2, activation gradients 2; frozen weights need no weight gradients); decode: tokens/s ÷ (batch ×
   bandwidth ÷ weight bytes), i.e. how close each decode step is to streaming the weights once.
3. **One SPEAR round** through Flower's simulation engine on the issue's reference configuration (ARC-Challenge,
   10 clients, 3 per round, 16 rollouts per client-round, up to 2 revisions, 16 new tokens, 2 local steps of batch 4,
   LoRA r16 on all layers), with seconds per phase and peak memory, read back from the run's ``metrics.jsonl``.

Figures are measurements of this machine at this moment: run it on an otherwise idle machine.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .config import RunConfig
from .model import autocast


def _timed(fn, min_seconds: float) -> tuple[float, int]:
    """Run ``fn`` once to warm up, then repeatedly for at least ``min_seconds`` → (seconds per call, calls)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls, calls


def matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0) -> float:
    """Dense matmul FLOP/s for ``n × n`` operands of ``dtype`` (2n³ FLOPs per product)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    per_call, _ = _timed(lambda: torch.mm(a, b), seconds)
    return 2 * n**3 / per_call


def memory_bandwidth(megabytes: int = 256, seconds: float = 1.0) -> float:
    """Bytes/s of a large float32 tensor copy (each byte counted once read, once written)."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    per_call, _ = _timed(lambda: dst.copy_(src), seconds)
    return 2 * n * 4 / per_call


def _params(model) -> int:
    """Parameters on the compute path of one token (embedding lookup excluded; the LM head counted)."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return total - emb + (emb if tied else 0)


@torch.no_grad()
def prefill_tokens_per_s(model, dtype_used: str, batch: int, length: int, seconds: float) -> float:
    ids = torch.randint(100, 1000, (batch, length))
    model.eval()

    def run():
        with autocast(dtype_used):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    per_call, _ = _timed(run, seconds)
    return batch * length / per_call


@torch.no_grad()
def decode_tokens_per_s(model, tokenizer, dtype_used: str, batch: int, prompt: int, new: int) -> float:
    """Greedy decoding of exactly ``new`` tokens per row after a ``prompt``-token prefill; prefill time excluded."""
    ids = torch.randint(100, 1000, (batch, prompt))
    model.eval()

    def gen(n):
        with autocast(dtype_used):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    gen(2)
    t0 = time.perf_counter()
    gen(1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen(new)
    total = time.perf_counter() - t0
    return batch * (new - 1) / max(1e-9, total - prefill)


def train_tokens_per_s(model, dtype_used: str, batch: int, length: int, seconds: float) -> float:
    """Forward + backward over ``batch × length`` tokens (LoRA parameters only get gradients)."""
    ids = torch.randint(100, 1000, (batch, length))
    model.train()

    def step():
        with autocast(dtype_used):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=16).logits
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
    per_call, _ = _timed(step, seconds)
    model.eval()
    return batch * length / per_call


def run_bench(model: str = "smollm2-135m", dtype: str = "auto", quick: bool = False, round_: bool = True,
              output_dir: str | None = None) -> dict[str, Any]:
    """Measure everything (see the module docstring) → a JSON-able dict.

    ``quick`` shrinks every size (for tests); ``round_=False`` skips the SPEAR round.
    """
    from .evaluation import evaluate
    from .model import LoraSettings, add_lora, load_base
    from .tasks import arc_challenge

    s = 0.2 if quick else 1.5  # seconds per micro-benchmark
    out: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": model,
    }
    bounds = {
        "matmul_flops_bf16": matmul_flops(torch.bfloat16, 256 if quick else 1024, s),
        "matmul_flops_fp32": matmul_flops(torch.float32, 256 if quick else 1024, s),
        "memory_bandwidth_bytes_per_s": memory_bandwidth(16 if quick else 256, s),
    }
    out["bounds"] = bounds
    base, tokenizer, dtype_used = load_base(model, dtype)
    peft = add_lora(base, LoraSettings())
    out["dtype"] = dtype_used
    params = _params(base)
    weight_bytes = sum(p.numel() * (2 if dtype_used == "bf16" else 4) for p in base.parameters())
    peak = bounds["matmul_flops_bf16" if dtype_used == "bf16" else "matmul_flops_fp32"]
    out["model_params_compute_path"] = params
    length = 32 if quick else 220
    prefill = prefill_tokens_per_s(peft, dtype_used, 2 if quick else 8, length, s)
    train = train_tokens_per_s(peft, dtype_used, 2 if quick else 8, length, s)
    decode = {}
    for b in (1, 8, 32):
        tps = decode_tokens_per_s(peft, tokenizer, dtype_used, b, 16 if quick else 200, 4 if quick else 32)
        bound = b * bounds["memory_bandwidth_bytes_per_s"] / weight_bytes
        decode[f"batch_{b}"] = {"tokens_per_s": tps, "bound_tokens_per_s": bound, "utilisation": tps / bound}
    items = arc_challenge.load("test")[: 8 if quick else 64]
    t0 = time.perf_counter()
    evaluate(peft, tokenizer, items, arc_challenge, dtype_used=dtype_used)
    eval_items = len(items) / (time.perf_counter() - t0)
    out["throughput"] = {
        "prefill": {"tokens_per_s": prefill, "flops": prefill * 2 * params,
                    "utilisation": prefill * 2 * params / peak},
        "train": {"tokens_per_s": train, "flops": train * 4 * params, "utilisation": train * 4 * params / peak},
        "decode": decode,
        "evaluate": {"items_per_s": eval_items},
    }
    del peft, base
    if round_:
        out["round"] = spear_round(model, dtype, quick, output_dir)
    return out


def spear_round(model: str, dtype: str, quick: bool, output_dir: str | None) -> dict[str, Any]:
    """One SPEAR round on the reference configuration through the simulation engine; seconds per phase."""
    from .fl.simulation import simulate
    from .rundir import RunDir

    out_dir = output_dir or tempfile.mkdtemp(prefix="fedspear-bench-")
    cfg = RunConfig(
        task="arc_challenge", model=model, dtype=dtype, rounds=1, num_clients=10 if not quick else 2,
        clients_per_round=3 if not quick else 1, rollouts_per_round=16 if not quick else 2, max_revisions=2,
        max_new_tokens=16 if not quick else 4, local_steps=2, batch_size=4, eval_size=100 if not quick else 4,
        eval_every=1, eval_generation=True, output_dir=str(Path(out_dir) / "run"),
    )
    t0 = time.perf_counter()
    simulate(cfg)
    wall = time.perf_counter() - t0
    r1 = RunDir(cfg.output_dir).records()[1]
    sec = r1["seconds"]
    per_client = {k: sec[k] / max(1, r1["clients_ok"]) for k in ("generate_initial", "generate_revisions", "train")}
    round_wo_eval = sec["round"] - sec["evaluate"]
    return {
        "config": {k: getattr(cfg, k) for k in ("num_clients", "clients_per_round", "rollouts_per_round",
                                                "max_revisions", "max_new_tokens", "local_steps", "batch_size")},
        "seconds": sec,
        "seconds_per_client_round": round_wo_eval / max(1, r1["clients_ok"]),
        "seconds_per_client_phase": per_client,
        "flower_overhead_share": sec["flower_overhead"] / max(1e-9, round_wo_eval),
        "peak_rss_mb": r1["peak_rss_mb"],
        "wall_seconds_including_startup": wall,
        "counters": {k: r1[k] for k in ("prompts", "wins", "losses", "revisions_attempted", "revisions_successful",
                                        "tokens_generated")},
    }


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a bench result."""
    b, t = result["bounds"], result["throughput"]
    g = 1e9
    lines = [
        f"# fedspear bench — {result['model']} ({result['dtype']}), {result['date']}",
        "",
        f"Machine: {result['machine']['cpu']}, {result['machine']['threads']} threads, torch "
        f"{result['machine']['torch']}.",
        "",
        "| bound | value |",
        "|---|---|",
        f"| matmul bf16 | {b['matmul_flops_bf16'] / g:.1f} GFLOP/s |",
        f"| matmul fp32 | {b['matmul_flops_fp32'] / g:.1f} GFLOP/s |",
        f"| memory bandwidth | {b['memory_bandwidth_bytes_per_s'] / g:.1f} GB/s |",
        "",
        "| throughput | measured | utilisation of bound |",
        "|---|---|---|",
        f"| prefill | {t['prefill']['tokens_per_s']:.0f} tokens/s ({t['prefill']['flops'] / g:.1f} GFLOP/s) | "
        f"{t['prefill']['utilisation']:.0%} of matmul |",
        f"| LoRA training (fwd + bwd) | {t['train']['tokens_per_s']:.0f} tokens/s ({t['train']['flops'] / g:.1f}"
        f" GFLOP/s) | {t['train']['utilisation']:.0%} of matmul |",
    ]
    for name, d in t["decode"].items():
        lines.append(f"| decode {name.replace('_', ' ')} | {d['tokens_per_s']:.0f} tokens/s (bound "
                     f"{d['bound_tokens_per_s']:.0f}) | {d['utilisation']:.0%} of bandwidth |")
    lines.append(f"| central evaluation | {t['evaluate']['items_per_s']:.2f} items/s | – |")
    if "round" in result:
        r = result["round"]
        s = r["seconds"]
        lines += [
            "",
            f"One SPEAR round ({json.dumps(r['config'])}):",
            "",
            "| phase | seconds (all sampled clients) |",
            "|---|---|",
            *[f"| {k.replace('_', ' ')} | {s[k]:.1f} |" for k in ("generate_initial", "generate_revisions", "train",
                                                                 "aggregate", "flower_overhead", "evaluate", "round")],
            "",
            f"Seconds per client-round (round without evaluation ÷ clients): **{r['seconds_per_client_round']:.1f}**;"
            f" Flower overhead {r['flower_overhead_share']:.1%} of the round; peak RSS client "
            f"{r['peak_rss_mb'].get('client', 0):.0f} MiB, server {r['peak_rss_mb'].get('server', 0):.0f} MiB.",
        ]
    return "\n".join(lines) + "\n"
