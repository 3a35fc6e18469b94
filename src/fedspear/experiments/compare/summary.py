"""comparison.md and comparison.json of a grid: the paper's Table 1 layout, gains over round 0 and between rows.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

from ...config import ConfigError
from ...report import epsilon_text
from ...health import fmt_count, label_counts
from ...rundir import RunDir, RunDirError, initial_accuracy, initial_samples, training_seconds
from .grid import NAMES, Cell, Grid, pinned, saved_difference
from .plots import plot_comparison
from .stats import item_mean_ci, item_paired_diff, mean_std, paired_ci, paired_gain


def cell_summary(cell: Cell) -> dict[str, Any] | None:
    """Figures of one finished cell (None when it has not run all its rounds: an interrupted cell's last evaluation
    is not its final accuracy)."""
    run = RunDir(cell.path)
    if not run.metrics_path.exists() or not cell.done():
        return None
    records = run.records()
    rounds = [r for r in records if r["round"] > 0]
    if not rounds:
        return None
    first = records[0]["eval"]
    last = next(r for r in reversed(records) if r.get("eval"))
    train_seconds = [training_seconds(r) for r in rounds]
    privacy = ({k: rounds[-1][k] for k in ("dp_epsilon", "dp_delta", "dp_noise_multiplier", "dp_clip_norm",
                                           "dp_releases")} if "dp_epsilon" in rounds[-1] else None)
    return {
        "cell": cell.name, "task": cell.task, "algorithm": cell.algorithm, "seed": cell.seed, "variant": cell.variant,
        "final_round": last["round"],
        "acc0": {k: first.get(k) for k in ("acc_gen", "acc_ll")},
        "acc": {k: last["eval"].get(k) for k in ("acc_gen", "acc_ll")},
        "outcomes0": {k: first.get("correct_" + k[4:]) for k in ("acc_gen", "acc_ll")},
        "outcomes": {k: last["eval"].get("correct_" + k[4:]) for k in ("acc_gen", "acc_ll")},
        "answers": {k: (first.get(k), last["eval"].get(k)) for k in ("parsed_gen", "cutoff_gen")},
        "n": last["eval"]["n"],
        "n_gen": last["eval"].get("n_gen", last["eval"]["n"]),
        "curve": [(r["round"], r["eval"].get("acc_gen"), r["eval"].get("acc_ll")) for r in records if r.get("eval")],
        "seconds_per_round": sum(train_seconds) / len(train_seconds),
        "cumulative_seconds": list(itertools.accumulate(train_seconds)),
        "tokens_generated": sum(r.get("tokens_generated", 0) for r in rounds),
        "generations": sum(r.get("generations", 0) for r in rounds),
        "revisions_successful": [r.get("revisions_successful", 0) for r in rounds],
        "needing_revision": [initial_samples(r) - r.get("initial_correct", 0) for r in rounds],
        "initial_accuracy": [initial_accuracy(r) for r in rounds],
        "phase_seconds": {k: sum(r["seconds"].get(k, 0.0) for r in rounds)
                          for k in ("generate_initial", "generate_revisions", "train", "aggregate",
                                    "flower_overhead")},
        "privacy": privacy,
        "health": [{"round": r["round"], **{k: (r.get("eval") or {}).get(k) for k in HEALTH_EVAL},
                    "labels": label_counts(r.get("eval") or {}), "gold": label_counts(r.get("eval") or {}, "gold_"),
                    **(r.get("health") or {})} for r in records if r.get("eval") or r.get("health")],
        "health_warnings": [w for r in records for w in r.get("health_warnings") or []],
    }


def _progress(cell: Cell) -> str:
    """``cell`` with how far it ran, e.g. ``spear-s0 (round 1 of 2)``."""
    last = cell.last_round()
    return f"{cell.name} (" + ("no round" if last is None else f"round {last} of {cell.config.rounds}") + ")"


HEALTH_EVAL = ("tokens_gen_mean", "tokens_gen_median", "reasoning_gen", "label_entropy_gen", "top_label_share_gen",
               "parsed_gen", "cutoff_gen")


def health_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The "Learning health" section: each cell's health warnings, then per cell and round the evaluation's answer
    length, reasoning share, label entropy and largest-label share, and the training answers' length and reasoning
    share, win-set composition and bare share of right revisions (``fedspear.health``); [] when no cell has them."""
    cells = [r for r in rows if any(h.get("tokens_gen_mean") is not None or "tokens_initial_mean" in h
                                    for h in r["health"])]
    if not cells:
        return []

    def pct(v):
        return "–" if v is None else f"{100 * v:.0f}"

    num = fmt_count  # whole counts, a median's .5 kept
    lines = ["## Learning health", ""]
    warned = [(r["cell"], w) for r in cells for w in r["health_warnings"]]
    lines += [f"- **WARNING {cell}: {w}**" for cell, w in warned] + ([""] if warned else [])
    lines += ["Per cell and round: evaluation answers' tokens (mean / median), % that reason before the final "
              "answer, answers per label (gold in brackets), label entropy (bits) and % carrying the most frequent "
              "label; training: initial answers' and revisions' tokens (mean) and % reasoning, wins from initial "
              "answers + revisions, % of right revisions that are bare, revisions dropped by the guard "
              "(`revised_wins = \"reasoned\"`).", "",
              "| Cell | round | eval tokens | eval reasons % | labels (gold) | entropy | top label % | parsed % "
              "| cut off % | initial tokens | initial reasons % | revision tokens | revision reasons % "
              "| wins init + rev | bare % of right rev. | guarded |", "|" + "---|" * 16]
    for r in cells:
        for h in r["health"]:
            ent = h.get("label_entropy_gen")
            labels = ", ".join(f"{k} {v}" + (f" ({h['gold'][k]})" if k in h["gold"] else "")
                               for k, v in h["labels"].items()) or "–"
            lines.append(
                f"| {r['cell']} | {h['round']} | {num(h.get('tokens_gen_mean'))} / {num(h.get('tokens_gen_median'))} "
                f"| {pct(h.get('reasoning_gen'))} | {labels} | {'–' if ent is None else f'{ent:.2f}'} | "
                f"{pct(h.get('top_label_share_gen'))} | {pct(h.get('parsed_gen'))} | {pct(h.get('cutoff_gen'))} | "
                f"{num(h.get('tokens_initial_mean'))} | {pct(h.get('reasoning_initial'))} | "
                f"{num(h.get('tokens_revision_mean'))} | {pct(h.get('reasoning_revision'))} | "
                + ("–" if "wins_initial" not in h else f"{num(h['wins_initial'])} + {num(h['wins_revised'])}")
                + f" | {pct(h.get('bare_share_revised'))} | {num(h.get('revisions_guarded'))} |")
    return lines + [""]


def _fmt_pct(m: float | None, s: float | None = None) -> str:
    if m is None:
        return "–"
    return f"{100 * m:.2f}" + (f" ± {100 * s:.2f}" if s is not None else "")


def _md_table(title: str, intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown section: ``## title``, an introductory paragraph, a table with ``header`` and ``rows``."""
    return [f"## {title}", "", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def check_summarisable(grid: Grid, output: Path) -> None:
    """Refuse to summarise ``output`` as ``grid`` unless its cells ran that grid: a summary of another one (other
    settings, seeds or algorithms; ``fedspear compare --summary-only`` with changed options) would claim settings
    its cells never ran with. ``note`` may differ (prose); a folder with cells but no ``grid.toml`` (written before
    it existed) is taken as it is.

    Raises:
        RunDirError: ``output`` holds no comparison (no ``grid.toml``, no ``cells/``), holds another grid (naming
            the keys that differ), or a ``grid.toml`` that is not a grid. RunDirError, as for a cell's damaged
            record: the folder does not hold what the command names.
    """
    try:
        differs = saved_difference(grid, output)
    except ConfigError as err:  # a damaged grid.toml
        raise RunDirError(str(err)) from None
    if differs is None and not (output / "cells").is_dir():
        raise RunDirError(f"{output}: no comparison to summarise (no grid.toml, no cells/); run the grid there "
                          f"without --summary-only first")
    if differs and differs[1]:
        saved, now = differs[0], pinned(grid).to_dict()
        details = []
        for key in differs[1]:
            if key == "base":  # name the settings and their values: a grid.toml from before a key existed reads as
                details += [f"base.{k}: saved {saved['base'].get(k)!r} vs now {now['base'].get(k)!r}"  # its old
                            for k in sorted(set(saved["base"]) | set(now["base"]))  # default (partitioner)
                            if saved["base"].get(k) != now["base"].get(k)]
            else:
                details.append(f"{key}: saved {saved.get(key)!r} vs now {now.get(key)!r}")
        raise RunDirError(f"{output} holds another grid ({'; '.join(details)}); --summary-only summarises the grid "
                          "its cells ran (its grid.toml): give the same options (--set key=value for a base setting)")


def summarise(grid: Grid, output: Path, command: str = "", started: str = "") -> Path:
    """Write ``comparison.md``, ``comparison.json`` and ``plots/`` for the finished cells of ``grid``.

    Raises:
        RunDirError: ``output`` holds no comparison of ``grid`` (:func:`check_summarisable`; nothing is written), or
            a cell's record is damaged.
    """
    check_summarisable(grid, output)
    cells = grid.cells(output)
    rows = [s for s in (cell_summary(c) for c in cells) if s]
    unfinished = [c for c in cells if c.path.is_dir() and not c.done()]
    variants = sorted({r["variant"] for r in rows}, key=lambda v: [c.variant for c in cells].index(v))
    metric_keys = [k for k in ("acc_gen", "acc_ll") if any(r["acc"].get(k) is not None for r in rows)]
    table: dict[str, Any] = {}
    lines = ["# fedspear comparison", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if started:
        lines += [f"Run: {started}", ""]
    if grid.note:
        lines += [grid.note, ""]
    lines += [f"Grid: tasks {', '.join(grid.tasks)} · algorithms {', '.join(grid.algorithms)} · seeds "
              f"{', '.join(map(str, grid.seeds))}" + (f" · axes {grid.axes}" if grid.axes else "") + ".",
              f"Shared settings: `{json.dumps(grid.base)}`"
              + "".join(f"; {t} only: `{json.dumps(v)}`" for t, v in grid.per_task.items()) + ".", ""]
    if unfinished:
        lines += [f"**Not finished, left out of every table:** {', '.join(_progress(c) for c in unfinished)}.", ""]
    lines += ["Accuracy in % on the fixed held-out subset (n per cell below), mean ± std over seeds, at the last "
              "evaluated round; round 0 is the base model (the same for every algorithm). *Gen* = accuracy of the "
              "final answer of a greedy generation (the paper's metric); *LL* = log-likelihood over the option "
              "letters (multiple choice only).", ""]
    for key, label in (("acc_gen", "generation"), ("acc_ll", "log-likelihood")):
        if key not in metric_keys:
            continue
        for variant in variants:
            title = f"## Final accuracy ({label})" + (f" — {variant}" if variant else "")
            lines += [title, "", "| Algorithm | " + " | ".join(grid.tasks) + " | Avg. |",
                      "|---|" + "---|" * (len(grid.tasks) + 1)]
            base_row = []
            for task in grid.tasks:
                r0 = next((r for r in rows if r["task"] == task), None)
                base_row.append(r0["acc0"].get(key) if r0 else None)
            vals = [v for v in base_row if v is not None]
            lines.append("| Round 0 (base model) | " + " | ".join(_fmt_pct(v) for v in base_row)
                         + f" | {_fmt_pct(sum(vals) / len(vals)) if vals else '–'} |")
            for algorithm in grid.algorithms:
                cellsv, means = [], []
                for task in grid.tasks:
                    vs = [r["acc"][key] for r in rows if r["task"] == task and r["algorithm"] == algorithm
                          and r["variant"] == variant and r["acc"].get(key) is not None]
                    if vs:
                        m, s = mean_std(vs)
                        cellsv.append(_fmt_pct(m, s) + ("" if len(vs) == len(grid.seeds) else f" ({len(vs)} seeds)"))
                        means.append(m)
                        table.setdefault(key, {}).setdefault(variant, {}).setdefault(algorithm, {})[task] = {
                            "mean": m, "std": s, "seeds": len(vs)}
                    else:
                        cellsv.append("–")
                avg = _fmt_pct(sum(means) / len(means)) if len(means) == len(grid.tasks) else "–"
                lines.append(f"| {NAMES.get(algorithm, algorithm)} | " + " | ".join(cellsv) + f" | {avg} |")
            lines.append("")
    answer_rows = [r for r in rows if any(v is not None for pair in r["answers"].values() for v in pair)]
    if answer_rows:
        lines += _md_table(
            "Parsed and cut-off answers (generation)",
            "Share of the evaluated greedy answers (%) from which the task's rule reads an answer (*parsed*) and that "
            "the token budget stopped before EOS (*cut off*), round 0 → last evaluated round.",
            ["Cell", "parsed", "cut off"],
            [[r["cell"], *(" → ".join("–" if v is None else f"{100 * v:.1f}" for v in r["answers"][k])
                           for k in ("parsed_gen", "cutoff_gen"))] for r in answer_rows])
    lines += health_lines(rows)
    private_rows = [r for r in rows if r["privacy"]]
    if private_rows:
        lines += _md_table(
            "Privacy spent",
            "Client-level (ε, δ) after the last round (Flower's RDP accountant, no amplification by sampling; "
            "`fedspear.fl.privacy`); ∞ = clipping without noise.",
            ["Cell", "z", "C", "noised rounds", "ε", "δ"],
            [[r["cell"], f"{p['dp_noise_multiplier']:g}", f"{p['dp_clip_norm']:g}", str(p["dp_releases"]),
              epsilon_text(p), f"{p['dp_delta']:g}"] for r in private_rows for p in [r["privacy"]]])
    if "spear" in grid.algorithms and len(grid.algorithms) > 1:
        lines += ["## SPEAR minus each baseline", "",
                  "Difference in final accuracy (percentage points), paired by task and seed (same partition, "
                  "prompts and evaluation items), mean with a 95% t interval over the pairs; and a 95% interval "
                  "over the evaluated items, each item paired with itself (`item_paired_diff`: how much Δ would move "
                  "on other questions, not with other seeds).", "",
                  "| Metric | Task | Variant | Baseline | Δ (pp) | 95% CI over seeds | 95% CI over items | pairs |",
                  "|---|---|---|---|---|---|---|---|"]
        diffs_out = []
        for key in metric_keys:
            for task in grid.tasks:
                for variant in variants:
                    spear_rows = {r["seed"]: r for r in rows if r["task"] == task and r["variant"] == variant
                                  and r["algorithm"] == "spear" and r["acc"].get(key) is not None}
                    for algorithm in grid.algorithms:
                        if algorithm == "spear":
                            continue
                        other_rows = {r["seed"]: r for r in rows if r["task"] == task
                                      and r["variant"] == variant and r["algorithm"] == algorithm
                                      and r["acc"].get(key) is not None}
                        seeds = sorted(set(spear_rows) & set(other_rows))
                        if not seeds:
                            continue
                        m, lo, hi = paired_ci([spear_rows[s]["acc"][key] - other_rows[s]["acc"][key] for s in seeds])
                        ci = "–" if math.isnan(lo) else f"[{100 * lo:+.2f}, {100 * hi:+.2f}]"
                        a = [spear_rows[s].get("outcomes", {}).get(key) for s in seeds]
                        b = [other_rows[s].get("outcomes", {}).get(key) for s in seeds]
                        item = (math.nan,) * 3
                        if all(a) and all(b) and len({len(o) for o in a + b}) == 1:
                            item = item_paired_diff(a, b)
                        item_ci = "–" if math.isnan(item[1]) else f"[{100 * item[1]:+.2f}, {100 * item[2]:+.2f}]"
                        lines.append(f"| {key} | {task} | {variant or '–'} | {NAMES.get(algorithm, algorithm)} | "
                                     f"{100 * m:+.2f} | {ci} | {item_ci} | {len(seeds)} |")
                        diffs_out.append({"metric": key, "task": task, "variant": variant, "baseline": algorithm,
                                          "diff": m, "low": lo, "high": hi, "pairs": len(seeds),
                                          "item_low": item[1], "item_high": item[2]})
        table["spear_minus"] = diffs_out
        lines.append("")
    gain_lines, gains = gain_table(grid, rows, variants, metric_keys)
    lines += gain_lines
    table["gain_over_round0"] = gains
    lines += ["## Cost", "",
              "Seconds per round exclude the central evaluation (interaction + training + aggregation + Flower), "
              "summed over the round's clients' wall-clock as the server saw it; mean over seeds and rounds.", "",
              "| Task | Variant | Algorithm | s / round | final wall-clock (s) | generations | tokens generated |"
              " gen. initial (s) | gen. revisions (s) | train (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    cost = []
    for task in grid.tasks:
        for variant in variants:
            for algorithm in grid.algorithms:
                rs = [r for r in rows if r["task"] == task and r["variant"] == variant and r["algorithm"] == algorithm]
                if not rs:
                    continue
                spr = mean_std([r["seconds_per_round"] for r in rs])[0]
                wall = mean_std([r["cumulative_seconds"][-1] for r in rs])[0]
                gens = mean_std([r["generations"] for r in rs])[0]
                toks = mean_std([r["tokens_generated"] for r in rs])[0]
                ph = {k: mean_std([r["phase_seconds"][k] for r in rs])[0] for k in rs[0]["phase_seconds"]}
                lines.append(f"| {task} | {variant or '–'} | {NAMES.get(algorithm, algorithm)} | {spr:.1f} | "
                             f"{wall:.0f} | {gens:.0f} | {toks:.0f} | {ph['generate_initial']:.0f} | "
                             f"{ph['generate_revisions']:.0f} | {ph['train']:.0f} |")
                cost.append({"task": task, "variant": variant, "algorithm": algorithm, "seconds_per_round": spr,
                             "wall_clock": wall, "generations": gens, "tokens_generated": toks, "phases": ph})
    table["cost"] = cost
    n_eval = sorted({(r["n"], r.get("n_gen", r["n"])) for r in rows})
    shown = ", ".join(str(n) if g == n else f"{n} (generation on {g} of them)" for n, g in n_eval)
    lines += ["", f"Evaluation items per cell: {shown}. Cells finished: {len(rows)} of {len(cells)}.", ""]
    plots = plot_comparison(grid, rows, output / "plots")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    lines += ["## Cells", "", "| Cell | final round | " + " | ".join(f"{k} r0 → final" for k in metric_keys)
              + " | s / round |", "|---|---|" + "---|" * (len(metric_keys) + 1)]
    for r in rows:
        accs = " | ".join(f"{_fmt_pct(r['acc0'].get(k))} → {_fmt_pct(r['acc'].get(k))}" for k in metric_keys)
        lines.append(f"| {r['cell']} | {r['final_round']} | {accs} | {r['seconds_per_round']:.1f} |")
    out = output / "comparison.md"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (output / "comparison.json").write_text(json.dumps({"grid": grid.to_dict(), "table": table, "cells": rows},
                                                       indent=1, default=str) + "\n", encoding="utf-8")
    return out


def gain_table(grid: Grid, rows: list[dict], variants: list[str], metric_keys: list[str]
               ) -> tuple[list[str], list[dict[str, Any]]]:
    """The "gain over round 0" section: per algorithm, round-0 and final accuracy with 95% intervals over items
    and the item-paired gain (:func:`paired_gain`), pooled over seeds. Cells without per-item outcomes (runs from
    before they were recorded) are left out; no section when none has them."""
    out, lines = [], []
    for key in metric_keys:
        for task in grid.tasks:
            for variant in variants:
                for algorithm in grid.algorithms:
                    rs = [r for r in rows if r["task"] == task and r["variant"] == variant
                          and r["algorithm"] == algorithm and r.get("outcomes", {}).get(key)
                          and r.get("outcomes0", {}).get(key)]
                    before = {r["outcomes0"][key] for r in rs}
                    if not rs or len(before) != 1 or any(len(r["outcomes"][key]) != len(next(iter(before)))
                                                         for r in rs):
                        continue  # round 0 must be one and the same measurement of the same items
                    before = before.pop()
                    after = [r["outcomes"][key] for r in rs]
                    r0, final, gain = item_mean_ci([before]), item_mean_ci(after), paired_gain(before, after)
                    out.append({"metric": key, "task": task, "variant": variant, "algorithm": algorithm,
                                "round0": r0, "final": final, "gain": gain, "seeds": len(rs), "items": len(before)})
    if not out:
        return [], []
    lines += ["## Gain over round 0", "",
              "Accuracy in % with a 95% interval over the evaluated items (each item scored by its mean over the "
              "seeds; a normal interval, cut to 0–100), and the gain over the base model paired item by item (the "
              "same items at round 0 and at the end). The intervals say how much a figure would move on other "
              "questions; with this few seeds they do not include the spread between seeds (the ± std in the tables "
              "above).", "",
              "| Metric | Task | Variant | Algorithm | round 0 | final | gain (pp) | seeds × items |",
              "|---|---|---|---|---|---|---|---|"]

    def fmt(t):
        return f"{100 * t[0]:.1f} [{100 * t[1]:.1f}, {100 * t[2]:.1f}]"

    for g in out:
        gm, glo, ghi = (100 * x for x in g["gain"])
        lines.append(f"| {g['metric']} | {g['task']} | {g['variant'] or '–'} | "
                     f"{NAMES.get(g['algorithm'], g['algorithm'])} | {fmt(g['round0'])} | {fmt(g['final'])} | "
                     f"{gm:+.1f} [{glo:+.1f}, {ghi:+.1f}] | {g['seeds']} × {g['items']} |")
    return lines + [""], out
