"""The plots of a comparison (paper Figs. 2–5): accuracy per round, cumulative wall-clock, revisions.
"""

from __future__ import annotations

from pathlib import Path

from .grid import NAMES, Grid
from .stats import mean_std


def plot_comparison(grid: Grid, rows: list[dict], folder: Path) -> list[Path]:
    """Accuracy vs round, cumulative wall-clock (Fig. 2), successful revisions and samples needing revision
    (Figs. 3–5), one panel per task, mean over seeds per algorithm (and variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not rows:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in grid.tasks if any(r["task"] == t for r in rows)]
    groups = sorted({(r["algorithm"], r["variant"]) for r in rows},
                    key=lambda g: (grid.algorithms.index(g[0]), g[1]))

    def label(g):
        return NAMES.get(g[0], g[0]) + (f" ({g[1]})" if g[1] else "")

    def mean_series(series: list[list[float]]) -> list[float]:
        n = min(len(s) for s in series)
        return [sum(s[i] for s in series) / len(series) for i in range(n)]

    paths = []

    def panel_figure(name: str, title: str, ylabel: str, xlabel: str, draw) -> None:
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for g in groups:
                draw(ax, task, g)
            ax.set_title(task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for key, label_text in (("acc_gen", "generation"), ("acc_ll", "log-likelihood")):
        if not any(r["acc"].get(key) is not None for r in rows):
            continue
        idx = 1 if key == "acc_gen" else 2

        def draw_acc(ax, task, g, idx=idx):
            rs = [r for r in rows if r["task"] == task and (r["algorithm"], r["variant"]) == g]
            if not rs:
                return
            xs = [c[0] for c in rs[0]["curve"]]
            series = [[100 * (c[idx] or 0) for c in r["curve"]] for r in rs]
            ys = mean_series(series)
            line, = ax.plot(xs[: len(ys)], ys, marker="o", label=label(g))
            if len(rs) > 1:  # ± std over seeds
                sd = [mean_std([s[i] for s in series])[1] for i in range(len(ys))]
                ax.fill_between(xs[: len(ys)], [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)],
                                color=line.get_color(), alpha=0.12, linewidth=0)

        panel_figure(f"accuracy_{key}", f"Held-out accuracy ({label_text}), mean ± std over seeds", "accuracy (%)",
                     "round", draw_acc)

    def draw_wall(ax, task, g):
        rs = [r for r in rows if r["task"] == task and (r["algorithm"], r["variant"]) == g]
        if rs:
            ys = mean_series([r["cumulative_seconds"] for r in rs])
            ax.plot(range(1, len(ys) + 1), [y / 60 for y in ys], marker="o", label=label(g))

    panel_figure("wall_clock", "Cumulative wall-clock without evaluation (paper Fig. 2)", "minutes", "round",
                 draw_wall)

    def draw_rev(ax, task, g, key):
        rs = [r for r in rows if r["task"] == task and (r["algorithm"], r["variant"]) == g]
        if rs and any(sum(r["revisions_successful"]) or g[0] in ("spear", "feedback_sft", "rltf_sd") for r in rs):
            ys = mean_series([r[key] for r in rs])
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=label(g))

    panel_figure("revisions_successful", "Successful revisions per round (paper Figs. 3–5)", "revisions", "round",
                 lambda ax, t, g: draw_rev(ax, t, g, "revisions_successful"))
    panel_figure("needing_revision", "Samples needing revision per round (wrong first answers; paper Figs. 3–5)",
                 "samples", "round", lambda ax, t, g: draw_rev(ax, t, g, "needing_revision"))
    return paths
