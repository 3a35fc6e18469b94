"""Seconds per round of each algorithm of a ``fedspear compare`` grid, over the rounds a timing may be read from
(issue 17, statement 5: the paper's Fig. 2 claim that SPEAR is the fastest per round).

``comparison.md``'s cost table averages every round of every cell. A grid that ran for days shares some rounds with
other work (a test beside it) or ran some cells on another machine kind; their seconds are not comparable. This
script leaves out what ``--exclude`` names — a whole cell (``strategy_qa-spear-s0``) or one round of it
(``strategy_qa-grpo-s0:2``) — and gives per algorithm, over the remaining rounds 1… of all its seeds:

- seconds per round without the central evaluation (``seconds.round − seconds.evaluate``: the sampled clients'
  initial answers, revisions and training, aggregation and Flower), mean, median and range;
- the initial answers / revisions / training share of it and the tokens generated per round (means);
- the reference algorithm (``--reference``, default SPEAR) minus each other one, with a 95% Welch interval, the
  rounds as units (unequal variances; the t quantile at the Welch–Satterthwaite degrees of freedom, scipy).

    .venv/bin/python scripts/round_costs.py docs/results/cpu-qwen1.5b-sqa \\
        --exclude strategy_qa-spear-s0 strategy_qa-grpo-s0:2 strategy_qa-grpo-s1:1

Cells are read from ``<grid>/cells/<task>-<algorithm>-s<seed>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from scipy.stats import t as student_t

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedspear.experiments.compare.grid import NAMES  # noqa: E402
from fedspear.rundir import RunDir, training_seconds  # noqa: E402

PHASES = ("generate_initial", "generate_revisions", "train")


def parse_exclusions(specs: list[str]) -> tuple[set[str], set[tuple[str, int]]]:
    """``["cell", "cell:3"]`` → (whole cells, (cell, round) pairs). Raises SystemExit on a round that is no integer."""
    cells, rounds = set(), set()
    for spec in specs:
        name, _, rnd = spec.partition(":")
        if not rnd:
            cells.add(name)
        elif rnd.isdigit():
            rounds.add((name, int(rnd)))
        else:
            raise SystemExit(f"--exclude {spec!r}: expected <cell> or <cell>:<round>")
    return cells, rounds


def read_rounds(grid: Path, exclude: list[str]) -> dict[str, list[dict]]:
    """{algorithm: [round records kept]} of every cell under ``grid/cells``, in cell-name order.

    Raises SystemExit when there are no cells or an exclusion names no cell or round of the grid (a typo would
    silently keep what it meant to leave out).
    """
    skip_cells, skip_rounds = parse_exclusions(exclude)
    cell_dirs = sorted(d for d in (grid / "cells").glob("*-s*") if (d / "metrics.jsonl").is_file())
    if not cell_dirs:
        raise SystemExit(f"{grid}/cells holds no cell with a metrics.jsonl")
    names = {d.name for d in cell_dirs}
    unknown = sorted(skip_cells - names) + sorted(f"{c}:{r}" for c, r in skip_rounds if c not in names)
    if unknown:
        raise SystemExit(f"--exclude names no cell of {grid}: {', '.join(unknown)}")
    kept: dict[str, list[dict]] = {}
    seen_rounds = set()
    for cell in cell_dirs:
        _task, algorithm, _seed = cell.name.rsplit("-", 2)
        for record in RunDir(cell).records():
            if record.get("round", 0) < 1 or "seconds" not in record:
                continue
            seen_rounds.add((cell.name, record["round"]))
            if cell.name in skip_cells or (cell.name, record["round"]) in skip_rounds:
                continue
            kept.setdefault(algorithm, []).append(record)
    missing = sorted(f"{c}:{r}" for c, r in skip_rounds - seen_rounds)
    if missing:
        raise SystemExit(f"--exclude names rounds the cells do not have: {', '.join(missing)}")
    return kept


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) − mean(b) with a 95% Welch interval → ``(diff, low, high)``; nan bounds when a side has < 2 values."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = student_t.ppf(0.975, df) * se
    return diff, diff - half, diff + half


def report(kept: dict[str, list[dict]], reference: str) -> str:
    """The markdown tables: one column per algorithm, then the reference minus each other algorithm."""
    if reference not in kept:
        raise SystemExit(f"--reference {reference}: no rounds of it are kept (algorithms: {', '.join(kept)})")
    order = [reference, *(a for a in kept if a != reference)]
    secs = {a: [training_seconds(r) for r in kept[a]] for a in order}
    ref_mean = statistics.fmean(secs[reference])
    ref_name = NAMES.get(reference, reference)
    head = "| | " + " | ".join(NAMES.get(a, a) for a in order) + " |"
    rows = [
        ("rounds counted", lambda a: str(len(secs[a]))),
        ("s / round, mean (median)", lambda a: f"{statistics.fmean(secs[a]):.0f} ({statistics.median(secs[a]):.0f})"),
        ("range", lambda a: f"{min(secs[a]):.0f}–{max(secs[a]):.0f}"),
        ("initial answers / revisions / training, s per round", lambda a: " / ".join(
            f"{statistics.fmean(r['seconds'].get(p, 0.0) for r in kept[a]):.0f}" for p in PHASES)),
        ("tokens generated per round",
         lambda a: f"{statistics.fmean(r.get('tokens_generated', 0) for r in kept[a]):,.0f}"),
        (f"relative to {ref_name} (mean)", lambda a: f"{statistics.fmean(secs[a]) / ref_mean:.2f}"),
    ]
    lines = [head, "|---" * (len(order) + 1) + "|"]
    lines += ["| " + label + " | " + " | ".join(cell(a) for a in order) + " |" for label, cell in rows]
    lines += ["", f"| {ref_name} minus | s / round | 95% Welch interval (rounds as units) |",
              "|---|---|---|"]
    for a in order[1:]:
        diff, low, high = welch(secs[reference], secs[a])
        lines.append(f"| {NAMES.get(a, a)} | {diff:+.0f} | [{low:+.0f}, {high:+.0f}] |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="a fedspear compare output directory (holding cells/)")
    parser.add_argument("--exclude", nargs="*", default=[], metavar="CELL[:ROUND]",
                        help="cells or rounds whose seconds are not comparable (shared cores, other machine kind)")
    parser.add_argument("--reference", default="spear", help="the algorithm the others are subtracted from")
    args = parser.parse_args(argv)
    text = report(read_rounds(args.grid, args.exclude), args.reference)
    print(text)
    return text


if __name__ == "__main__":
    main()
