"""fedspear's evaluation protocol against EleutherAI's lm-evaluation-harness, base model vs a trained SPEAR adapter.

    python scripts/eval_agreement.py OUT RUN_DIR [RUN_DIR ...] [--limit N]

For each run directory (a SPEAR run on arc_challenge or hellaswag), the model of the run is scored at round 0 (the
base model) and at its last round, on the run's task and evaluation split, by

- ``fedspear eval`` (SPEC §6: options in the prompt, log-likelihood over the option letters, greedy generation), and
- ``fedspear eval --harness lm-eval`` (lm-eval's own task config: each option's text scored as a continuation,
  ``acc`` and ``acc_norm``),

on the whole split or its first N documents with ``--limit`` (both protocols the same N, in file order), in the
precision ``auto`` picks on the machine for both. The
JSON of every evaluation goes to ``OUT/<run name>/``; ``OUT/agreement.md`` / ``agreement.json`` tabulate accuracy
at round 0 and at the end per protocol, the change (item-paired 95% interval), whether the protocols move in the
same direction, and how often they agree item by item. Evaluations already present in ``OUT`` are reused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from fedspear.experiments.compare.stats import item_paired_diff
from fedspear.evaluation import wilson_interval
from fedspear.rundir import RunDir
from fedspear.tasks import get_task

FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))


def _evaluate(out: Path, run: Path, round_: int, harness: str, limit: int | None, n_items: int) -> dict:
    """One evaluation's JSON (``fedspear eval`` run unless ``out`` exists)."""
    if not out.is_file():
        cmd = [FEDSPEAR, "eval", str(run), "--round", str(round_), "-o", str(out), "--harness", harness]
        cmd += ["--limit", str(limit)] if limit else []
        if harness == "fedspear":  # every item (of the first N) by log-likelihood and by generation
            cmd += ["--eval-size", "0", "--eval-gen-size", "0"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    result = json.loads(out.read_text())
    if len(result["items"]) != n_items:
        raise SystemExit(f"{out}: {len(result['items'])} items, expected {n_items}; delete it to score again")
    return result


def _outcomes(result: dict, key: str, order: list[str]) -> str:
    """0/1 per document in file order (``order``: the uids in file order)."""
    if "doc_id" in result["items"][0]:
        return "".join("1" if i[key] else "0" for i in sorted(result["items"], key=lambda i: i["doc_id"]))
    by_uid = {i["uid"]: i for i in result["items"]}
    return "".join("1" if by_uid[u][key] else "0" for u in order)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    rows = []
    for run in args.runs:
        cfg = RunDir(run).saved_config()
        last = RunDir(run).last_round()
        split = get_task(cfg.task).EVAL_SPLIT
        order = [ex.uid for ex in get_task(cfg.task).load(split, data_dir=cfg.data_dir)]
        if args.limit:
            order = order[: args.limit]
        folder = args.out / run.name
        folder.mkdir(parents=True, exist_ok=True)
        res = {(h, r): _evaluate(folder / f"{h}-round{r}.json", run, r, h, args.limit, len(order))
               for h in ("fedspear", "lm-eval") for r in (0, last)}
        measures = {"fedspear log-likelihood (letters)": ("fedspear", "correct_ll"),
                    "fedspear generation": ("fedspear", "correct_gen"),
                    "lm-eval acc": ("lm-eval", "acc"), "lm-eval acc_norm": ("lm-eval", "acc_norm")}
        outcome = {(name, r): _outcomes(res[(h, r)], key, order) for name, (h, key) in measures.items()
                   for r in (0, last)}
        for name in measures:
            before, after = outcome[(name, 0)], outcome[(name, last)]
            n = len(before)
            diff, low, high = item_paired_diff([after], [before])
            rows.append({"model": cfg.model, "task": cfg.task, "run": run.name, "rounds": last, "measure": name,
                         "n": n, "round0": before.count("1") / n, "round0_ci": wilson_interval(before.count("1"), n),
                         "final": after.count("1") / n, "final_ci": wilson_interval(after.count("1"), n),
                         "change": diff, "change_ci": (low, high)})
        # item by item: how often fedspear's letter choice and lm-eval's continuation choice are both right or both
        # wrong (chance agreement for two independent 25%-accurate choosers: 62.5%)
        for r in (0, last):
            a, b = outcome[("fedspear log-likelihood (letters)", r)], outcome[("lm-eval acc", r)]
            rows[-1].setdefault("agreement_ll_vs_acc", {})[r] = sum(x == y for x, y in zip(a, b)) / len(a)
    (args.out / "agreement.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| model | task | measure | n | round 0, % | after training, % | change, pp (item-paired 95% CI) |",
             "|---|---|---|---:|---|---|---|"]
    pct = lambda v, ci: f"{100 * v:.1f} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"
    for r in rows:
        lines.append(f"| {r['model']} | {r['task']} (run {r['run']}, {r['rounds']} rounds) | {r['measure']} | {r['n']} "
                     f"| {pct(r['round0'], r['round0_ci'])} | {pct(r['final'], r['final_ci'])} "
                     f"| {100 * r['change']:+.2f} [{100 * r['change_ci'][0]:+.2f}, {100 * r['change_ci'][1]:+.2f}] |")
    agree = [f"- {r['model']} {r['task']}: fedspear's letter choice and lm-eval's `acc` choice are both right or both "
             f"wrong on {', '.join(f'{100 * v:.1f}% (round {k})' for k, v in r['agreement_ll_vs_acc'].items())} "
             f"of the items" for r in rows if "agreement_ll_vs_acc" in r]
    (args.out / "agreement.md").write_text("\n".join(lines + [""] + agree) + "\n")
    print("\n".join(lines + [""] + agree))


if __name__ == "__main__":
    main()
