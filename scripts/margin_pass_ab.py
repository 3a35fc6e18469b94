"""The margin pass after local training (``fedspear.training.pair_margin``), before and after it scored each context
once: both ways on the same traces, alternating, on the packaged model and real ARC prompts.

The traces are one interaction phase over the first ``--prompts`` ARC-Challenge train items (the exact oracle, a
random adapter so it counts); "packed" is the way before 2026-12-05 (kept here: the pairs' wins packed into one
forward and their losses into another, each over context and completion, so each pair ran its context twice),
"shared" is ``pair_margin`` now (``shared_context_logprobs``: each context once). Prints the margin both ways
(τ = 0 and 16) and each way's seconds, median of ``--reps`` alternating runs.

    .venv/bin/python scripts/margin_pass_ab.py --dtype auto
    .venv/bin/python scripts/margin_pass_ab.py --dtype fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedspear import losses as L  # noqa: E402
from fedspear.feedback import OracleFeedback  # noqa: E402
from fedspear.interaction import interact  # noqa: E402
from fedspear.runtime.model import LoraSettings, add_lora, load_base, model_device, pad_id  # noqa: E402
from fedspear.tasks import arc_challenge  # noqa: E402
from fedspear.training import completion_logprobs, pack, pair_margin  # noqa: E402


@torch.no_grad()
def packed_pair_margin(model, wins, losses, pad: int, tau: int, dtype_used: str) -> tuple[float, int]:
    """``pair_margin`` as it was before 2026-12-05: every pair's win and loss packed, two forwards."""
    by_uid = {t.uid: t for t in wins}
    pairs = [(by_uid[t.uid], t) for t in losses if t.uid in by_uid]
    model.eval()
    device = model_device(model)
    win_batch, lose_batch = pack([w for w, _ in pairs], pad, device), pack([l for _, l in pairs], pad, device)
    win_logp = completion_logprobs(model, win_batch, dtype_used)
    lose_logp = completion_logprobs(model, lose_batch, dtype_used)
    m = L.margin(win_logp, win_batch.completion_mask, lose_logp, L.tail_mask(lose_batch.tail_base, tau))
    return float(m.mean()), len(pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8, help="traces per forward (2 × the batch size; default 2 × 4)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    base, tokenizer, dtype_used = load_base(dtype=args.dtype)
    model = add_lora(base, LoraSettings(), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    items = arc_challenge.load("train")[: args.prompts]
    res = interact(model, tokenizer, items, arc_challenge, OracleFeedback(arc_challenge),
                   max_new_tokens=args.max_new_tokens, dtype_used=dtype_used, seed=0)
    wins, losses, pad = res.wins, res.losses, pad_id(tokenizer)
    traces = wins + losses
    print(f"{dtype_used}: {len(wins)} wins, {len(losses)} losses; tokens per trace: context "
          f"{statistics.mean(len(t.prompt_ids) for t in traces):.0f}, completion "
          f"{statistics.mean(len(t.completion_ids) for t in traces):.0f} (means)")
    ways = {"packed": lambda tau: packed_pair_margin(model, wins, losses, pad, tau, dtype_used),
            "shared": lambda tau: pair_margin(model, wins, losses, pad, tau, dtype_used, rows=args.rows)}
    for tau in (0, 16):
        (a, pairs), (b, _) = ways["packed"](tau), ways["shared"](tau)
        print(f"τ = {tau}: margin packed {a:.5f}, shared {b:.5f} over {pairs} pairs (|difference| {abs(a - b):.1e})")
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.reps):
        for name in (ways if rep % 2 == 0 else reversed(list(ways))):
            t0 = time.perf_counter()
            ways[name](0)
            seconds[name].append(time.perf_counter() - t0)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s ({' '.join(f'{v:.3f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
