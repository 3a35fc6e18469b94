"""Is SPEAR's margin over each baseline larger on one task than on another? (issue 17, statement 4)

Reads two ``fedspear compare`` results (their ``comparison.json``), takes SPEAR minus each baseline on a metric —
the item-paired interval of ``comparison.md``'s "SPEAR minus each baseline" table (each item's difference averaged
over the seeds) — and gives the gap between the two margins with a 95% interval
(``fedspear.experiments.compare.stats.margin_gap``: the two grids share no item, so the half-widths add in
quadrature). A baseline in only one grid (e.g. OPSD's authors' variant, which the ARC grid does not run) is listed
without a gap.

    .venv/bin/python scripts/margins_across_tasks.py docs/results/cpu-qwen1.5b-sqa/comparison.json \\
        docs/results/cpu-qwen1.5b/comparison.json --metric acc_gen

The grids differ in more than the task (rounds, revisions, learning rate, evaluation items); the gap answers "is the
margin larger there", not "because of the task".
"""

from __future__ import annotations

import argparse
import json
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
    for baseline in [*m1, *(b for b in m2 if b not in m1)]:
        a, b = m1.get(baseline), m2.get(baseline)
        cell = [f"{pp(r['diff'])} [{pp(r['item_low'])}, {pp(r['item_high'])}]" if r else "–" for r in (a, b)]
        if a and b:
            gap, low, high = margin_gap((a["diff"], a["item_low"], a["item_high"]),
                                        (b["diff"], b["item_low"], b["item_high"]))
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
