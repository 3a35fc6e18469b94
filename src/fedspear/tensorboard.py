"""A run's per-round metrics as TensorBoard scalars, beside ``metrics.jsonl`` (``tensorboard = true``).

Written with torch's ``torch.utils.tensorboard.SummaryWriter`` into ``<run dir>/tensorboard/``, one step per round
(round 0 = before training), so ``tensorboard --logdir runs/`` (or a compare grid's ``cells/``) shows every run side
by side, as transformers/TRL users watch long runs. Needs the optional extra: ``pip install 'fedspear[tensorboard]'``.
metrics.jsonl stays the record; the event files are a view of it (a resumed run drops events from the rounds it
redoes, ``purge_step``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# metrics.jsonl key → TensorBoard tag, for the per-round numbers worth a curve
TAGS = {
    "wins": "interaction/wins", "losses": "interaction/losses", "initial_accuracy": "interaction/initial_accuracy",
    "revisions_attempted": "interaction/revisions_attempted",
    "revisions_successful": "interaction/revisions_successful", "tokens_generated": "interaction/tokens_generated",
    "clients_ok": "clients/ok", "clients_failed": "clients/failed", "lr": "train/lr", "margin": "train/margin_tau",
    "steps": "train/steps", "skipped_nonfinite": "train/skipped_nonfinite", "dp_epsilon": "privacy/epsilon",
    "wall_clock": "time/wall_clock_s",
    "bytes_to_clients": "wire/bytes_to_clients", "bytes_from_clients": "wire/bytes_from_clients",
}
EVAL_KEYS = ("acc_gen", "acc_ll", "parsed_gen", "cutoff_gen")
HEALTH_EVAL_KEYS = ("tokens_gen_mean", "tokens_gen_median", "reasoning_gen", "label_entropy_gen", "top_label_share_gen")
INSTALL_HINT = "tensorboard = true needs TensorBoard: pip install 'fedspear[tensorboard]'"
LOSS_TERMS = ("loss", "kl", "clip_fraction")  # and every "loss_<term>" (loss_win, loss_lose, loss_pg, …)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics.jsonl record, tag → value (missing, null and non-finite values left out)."""
    out: dict[str, float] = {}
    for key, tag in TAGS.items():
        out[tag] = record.get(key)
    for key, value in record.items():
        if key in LOSS_TERMS or key.startswith("loss_"):
            out[f"train/{key}"] = value
    for key in EVAL_KEYS:
        out[f"eval/{key}"] = (record.get("eval") or {}).get(key)
    for key, value in (record.get("seconds") or {}).items():
        out[f"time/{key}_s"] = value
    for key, value in (record.get("peak_rss_mb") or {}).items():
        out[f"memory/peak_rss_{key}_mb"] = value
    for key, value in (record.get("peak_tree_mb") or {}).items():
        out[f"memory/peak_tree_{key}_mb"] = value
    for key in HEALTH_EVAL_KEYS:  # learning health (fedspear.health): evaluation answers, then training answers
        out[f"health/eval_{key}"] = (record.get("eval") or {}).get(key)
    for key, value in (record.get("health") or {}).items():
        out[f"health/{key}"] = value
    return {tag: float(v) for tag, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class ScalarWriter:
    """Appends each round's scalars to ``<run dir>/tensorboard``.

    Args:
        run_dir: the run directory.
        first_round: the first round this process writes (earlier steps are kept, later ones purged on resume).
    Raises:
        ImportError: tensorboard is not installed (message says how to install it).
    """

    def __init__(self, run_dir: str | Path, first_round: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(INSTALL_HINT) from None
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=first_round)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["round"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
