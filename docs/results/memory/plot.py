"""Plot the process tree's summed PSS over a run, before and after the shared weight copy (the series
``tree_peak.py`` wrote): ``python docs/results/memory/plot.py`` → ``docs/results/memory/tree.png``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, label in (("base", "before (each process converts its own weights)"),
                        ("after", "after (one shared, memory-mapped copy)")):
        series = json.loads((HERE / f"{name}-tree.json").read_text())["series"]
        ax.plot([t / 60 for t, _, _ in series], [pss / 1024 for _, _, pss in series], label=label, lw=1)
    ax.axhline(16, color="grey", ls="--", lw=0.8, label="16 GiB")
    ax.set_xlabel("minutes into the run (round-0 evaluation, 2 client-rounds, final evaluation)")
    ax.set_ylabel("summed PSS of the process tree, GiB")
    ax.set_title("Qwen2.5-Coder-1.5B SPEAR simulation, StrategyQA settings, 1 round, bf16 CPU")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = HERE / "tree.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main())
