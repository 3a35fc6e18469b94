"""Is SPEAR's margin over each baseline larger on one task than on another? (issue 17, statement 4)

Reads two ``fedspear compare`` results (their ``comparison.json``), takes SPEAR minus each baseline on a metric —
the item-paired interval of ``comparison.md``'s "SPEAR minus each baseline" table (each item's difference averaged
over the seeds) — and gives the gap between the two margins with a 95% interval
(``fedspear.experiments.compare.stats.margin_gap``: the two grids share no item, so the half-widths add in
quadrature). A baseline in only one grid (e.g. OPSD's authors' variant, which the ARC grid does not run) is listed
without a gap.

    .venv/bin/python scripts/margins_across_tasks.py <StrategyQA grid>/comparison.json \\
        docs/results/cpu-qwen1.5b/comparison.json --metric acc_gen

The grids differ in more than the task (rounds, revisions, learning rate, evaluation items); the gap answers "is the
margin larger there", not "because of the task".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedspear.experiments.compare.stats import margin_gap  # noqa: E402


def margins(path: Path, metric: str) -> tuple[str, dict[str, dict]]:
    """(task, {baseline: spear_minus row}) of one comparison.json; one task per grid."""
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = [r for r in data["table"]["spear_minus"] if r["metric"] == metric and not r.get("variant")]
    tasks = {r["task"] for r in rows}
    if len(tasks) != 1:
        raise SystemExit(f"{path}: expected one task with SPEAR-minus rows for {metric}, found {sorted(tasks)}")
    return tasks.pop(), {r["baseline"]: r for r in rows}


def pp(x: float) -> str:
    return f"{100 * x:+.1f}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path, help="comparison.json of the task whose margin may be larger")
    parser.add_argument("second", type=Path, help="comparison.json of the task to compare with")
    parser.add_argument("--metric", default="acc_gen")
    args = parser.parse_args(argv)
    task1, m1 = margins(args.first, args.metric)
    task2, m2 = margins(args.second, args.metric)
    lines = [f"SPEAR minus each baseline ({args.metric}, pp; 95% interval over items, seeds averaged per item): "
             f"{task1} against {task2}", "",
             f"| baseline | {task1} | {task2} | gap ({task1} − {task2}) | seeds |", "|---|---|---|---|---|"]
    if task1 == task2:
        print(f"warning: both grids are on {task1}; their items overlap, so the gap's interval (which assumes "
              "independent items) is not valid", file=sys.stderr)
    for baseline in [*m1, *(b for b in m2 if b not in m1)]:
        a, b = m1.get(baseline), m2.get(baseline)
        # a row without per-item outcomes has no item interval (NaN in comparison.json): shown, not compared
        a, b = (r if r and math.isfinite(r["item_low"]) and math.isfinite(r["item_high"]) else None for r in (a, b))
        cell = [f"{pp(r['diff'])} [{pp(r['item_low'])}, {pp(r['item_high'])}]" if r else "–" for r in (a, b)]
        if a and b:  # the item interval's own centre (the seed mean can differ from it by rounding)
            gap, low, high = margin_gap(*(((r["item_low"] + r["item_high"]) / 2, r["item_low"], r["item_high"])
                                          for r in (a, b)))
            cell.append(f"{pp(gap)} [{pp(low)}, {pp(high)}]")
        else:
            cell.append("–")
        seeds = " / ".join(str(r["pairs"]) if r else "–" for r in (a, b))
        lines.append(f"| {baseline} | " + " | ".join(cell) + f" | {seeds} |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
