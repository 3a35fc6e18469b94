"""The StrategyQA guard comparison (issue 41 item 4): SPEAR with ``revised_wins = all`` (the paper's) against
``revised_wins = reasoned`` (the guard), per seed, from a ``fedspear compare`` output directory:

    .venv/bin/python scripts/guard_summary.py runs/compare-sqa-guard --copy docs/results/sqa-guard

prints the figures as markdown tables and the first answers of each cell; ``--copy DIR`` also copies each finished
cell's ``metrics.jsonl``, ``cell.toml``, ``config.toml``, kept answers (``answers/``) and training traces
(``traces/``) to ``DIR/cells/<cell>/`` (no adapters) and writes the figures to ``DIR/summary.json``. A cell counts
when it has finished: its last record is its configured last round (``config.toml``'s ``rounds``) with an
evaluation.

Figures, all from the cells' own records (``fedspear.health``'s fields, ``fedspear.answers``' files):

- evaluation (round 0 and final): accuracy with its Wilson interval, parse and cut-off rates, answer length in tokens
  (mean / median), reasoning share (the task's ``reasons`` rule), label histogram against gold and the largest
  label's share, the run's health warnings;
- training, per round: initial answers' and revisions' length and reasoning share, the win set's composition
  (initial / revised), the share of right revisions that are bare and how many the guard dropped;
- the guard minus SPEAR, paired by item (each item's difference averaged over the seeds present; 95% normal
  interval over items, ``fedspear.experiments.compare.stats.item_paired_diff``).

Verdicts, by rules fixed before the guard cells and seeds 1–2 ran (SPEAR s0's rounds 0–3 had run), with the
project's own warning rule for "reasoning lost":

1. *SPEAR's reasoning collapses at this budget*: a seed collapses when its final evaluation's reasoning share is
   below half of round 0's (``fedspear.health``'s "reasoning lost" warning, which needs round 0's share ≥ 10%) or
   one label takes more than 80% of all the answers, unparsed ones included ("label collapse"). Supported when
   every one of 3 seeds collapses, not supported when none does, undecided otherwise and while fewer than 3 seeds
   have finished.
2. *The guard prevents it*: among the seeds where SPEAR collapses, the guard's cell does not. Supported when it holds
   in every such seed of 3, not supported when it holds in none, undecided otherwise / with fewer seeds.
3. *Without costing accuracy*: the guard minus SPEAR, pooled over the seeds by item: costs accuracy (supported)
   when the interval lies below 0; does not cost (supported) when its lower end is above −3 points, a
   non-inferiority margin set with the rules (one 500-item evaluation's interval is ±4.4 points); undecided
   otherwise and while fewer than 3 seeds are paired.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from fedspear.answers import read_jsonl_gz
from fedspear.config import ConfigError
from fedspear.evaluation import wilson_interval
from fedspear.experiments.compare.stats import item_paired_diff
from fedspear.health import COLLAPSE_SHARE, MIN_REASONING_SHARE, fmt_count
from fedspear.rundir import RunDir

SEEDS_NEEDED = 3
MARGIN = 0.03  # non-inferiority margin for verdict 3 (fraction)
ARMS = ("all", "reasoned")


def load_cells(root: Path) -> dict[tuple[str, int], Path]:
    """(revised_wins, seed) → cell folder, for the finished cells (a final evaluation recorded) under ``root``."""
    out = {}
    for cell in sorted((root / "cells").glob("strategy_qa-spear-revised_wins=*-s*")):
        arm, seed = cell.name.split("revised_wins=")[1].rsplit("-s", 1)
        records = RunDir(cell).records()
        if records and records[-1].get("eval") and records[-1]["round"] == planned_rounds(cell):
            out[(arm, int(seed))] = cell
    return out


def planned_rounds(cell: Path) -> int | None:
    """The cell's configured number of rounds (its ``config.toml``); None when it has none that reads."""
    try:
        return RunDir(cell).saved_config().rounds
    except ConfigError:
        return None


def eval_row(ev: dict) -> dict:
    """The evaluation figures of one record's ``eval``."""
    correct = ev["correct_gen"].count("1")
    low, high = wilson_interval(correct, ev["n"])
    answered = ev.get("pred_yes", 0) + ev.get("pred_no", 0)
    return {"acc": correct / ev["n"], "low": low, "high": high, "parsed": ev["parsed_gen"], "cutoff": ev["cutoff_gen"],
            "tokens_mean": ev.get("tokens_gen_mean"), "tokens_median": ev.get("tokens_gen_median"),
            "reasoning": ev.get("reasoning_gen"), "yes": ev.get("pred_yes", 0), "no": ev.get("pred_no", 0),
            "unparsed": ev["n"] - answered, "gold_yes": ev.get("gold_yes"), "gold_no": ev.get("gold_no"),
            "top_share": ev.get("top_label_share_gen"), "outcomes": ev["correct_gen"],
            "seconds": ev.get("seconds_evaluate")}


def collapsed(final: dict, round0: dict) -> list[str]:
    """Verdict 1's rule for one cell: the reasons it counts as collapsed ([] if it does not)."""
    why = []
    if (round0["reasoning"] or 0) >= MIN_REASONING_SHARE and final["reasoning"] is not None \
            and final["reasoning"] < round0["reasoning"] / 2:
        why.append(f"reasoning share {round0['reasoning']:.0%} → {final['reasoning']:.0%}")
    if final["top_share"] is not None and final["top_share"] > COLLAPSE_SHARE:
        why.append(f"one label on {final['top_share']:.0%} of answers")
    return why


def summarise(root: Path) -> dict:
    cells = load_cells(root)
    out: dict = {"cells": {}, "pairs": {}}
    for (arm, seed), cell in cells.items():
        records = RunDir(cell).records()
        round0, final = eval_row(records[0]["eval"]), eval_row(records[-1]["eval"])
        out["cells"][cell.name] = {
            "arm": arm, "seed": seed, "round0": round0, "final": final, "final_round": records[-1]["round"],
            "collapsed": collapsed(final, round0),
            "warnings": [w for r in records for w in r.get("health_warnings") or []],
            "training": [{"round": r["round"], "wins": r.get("wins"), "losses": r.get("losses"),
                          "initial_accuracy": r.get("initial_accuracy"), **(r.get("health") or {})}
                         for r in records[1:]],
        }
    seeds = sorted({s for (_, s) in cells if all((a, s) in cells for a in ARMS)})
    by = {(c["arm"], c["seed"]): c for c in out["cells"].values()}
    for seed in seeds:
        a, b = by[("reasoned", seed)]["final"]["outcomes"], by[("all", seed)]["final"]["outcomes"]
        out["pairs"][str(seed)] = item_paired_diff([a], [b])
    if seeds:
        out["pairs"]["pooled"] = item_paired_diff([by[("reasoned", s)]["final"]["outcomes"] for s in seeds],
                                                  [by[("all", s)]["final"]["outcomes"] for s in seeds])
    out["seeds_paired"] = seeds
    out["verdicts"] = verdicts(by, seeds, out["pairs"].get("pooled"))
    return out


def verdicts(by: dict, seeds: list[int], pooled) -> dict[str, str]:
    spear = [s for (arm, s) in by if arm == "all"]
    fell = [s for s in spear if by[("all", s)]["collapsed"]]
    if len(spear) >= SEEDS_NEEDED and len(fell) == len(spear):
        v1 = "supported"
    elif len(spear) >= SEEDS_NEEDED and not fell:
        v1 = "not supported"
    else:
        v1 = "undecided"
    v1 += f" ({len(fell)} of {len(spear)} SPEAR seeds collapsed)"
    guarded = [s for s in fell if s in seeds]
    kept = [s for s in guarded if not by[("reasoned", s)]["collapsed"]]
    if len(seeds) >= SEEDS_NEEDED and guarded and len(kept) == len(guarded):
        v2 = "supported"
    elif len(seeds) >= SEEDS_NEEDED and guarded and not kept:
        v2 = "not supported"
    else:
        v2 = "undecided"
    v2 += f" (the guard kept reasoning in {len(kept)} of {len(guarded)} paired seeds where SPEAR collapsed)"
    if pooled is None:
        v3 = "undecided (no pair finished)"
    else:
        diff, low, high = pooled
        if len(seeds) < SEEDS_NEEDED:
            v3 = "undecided"
        elif high < 0:
            v3 = "costs accuracy: supported"
        elif low > -MARGIN:
            v3 = "does not cost accuracy: supported"
        else:
            v3 = "undecided"
        v3 += (f" (guard − SPEAR {diff * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}] points"
               f" over {len(seeds)} seed(s))")
    return {"collapse": v1, "guard_prevents": v2, "accuracy_cost": v3}


def tables(s: dict) -> str:
    lines = ["| cell | round | accuracy % [Wilson] | parsed | cut off | tokens mean / median | reasoning | "
             "yes / no / unparsed (gold yes / no) | largest label | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in sorted(s["cells"].items(), key=lambda kv: (kv[1]["seed"], kv[1]["arm"])):
        for label, e in (("0", c["round0"]), (str(c["final_round"]), c["final"])):
            lines.append(
                f"| {c['arm']} s{c['seed']} | {label} "
                f"| {e['acc'] * 100:.1f} [{e['low'] * 100:.1f}, {e['high'] * 100:.1f}] "
                f"| {e['parsed']:.1%} | {e['cutoff']:.1%} "
                f"| {fmt_count(e['tokens_mean'])} / {fmt_count(e['tokens_median'])} "
                f"| {e['reasoning']:.1%} | {e['yes']} / {e['no']} / {e['unparsed']} ({e['gold_yes']} / {e['gold_no']}) "
                f"| {e['top_share']:.0%} | {'; '.join(c['collapsed']) if label != '0' else ''} |")
    lines += ["", "| cell | round | wins (initial / revised) | initial acc | initial tokens mean | initial reasoning | "
              "revision tokens mean | revision reasoning | bare share of right revisions | dropped by the guard |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for name, c in sorted(s["cells"].items(), key=lambda kv: (kv[1]["seed"], kv[1]["arm"])):
        for t in c["training"]:
            lines.append(
                f"| {c['arm']} s{c['seed']} | {t['round']} | {t.get('wins')} ({t.get('wins_initial')} / "
                f"{t.get('wins_revised')}) | {fmt(t.get('initial_accuracy'), '.0%')} "
                f"| {fmt_count(t.get('tokens_initial_mean'))} "
                f"| {fmt(t.get('reasoning_initial'), '.0%')} | {fmt_count(t.get('tokens_revision_mean'))} "
                f"| {fmt(t.get('reasoning_revision'), '.0%')} | {fmt(t.get('bare_share_revised'), '.0%')} "
                f"| {t.get('revisions_guarded', 0)} |")
    lines += ["", "| guard − SPEAR, paired by item | points, 95% CI |", "|---|---|"]
    for key, (d, lo, hi) in s["pairs"].items():
        lines.append(f"| {'seed ' + key if key != 'pooled' else 'pooled over seeds ' + str(s['seeds_paired'])} "
                     f"| {d * 100:+.1f} [{lo * 100:+.1f}, {hi * 100:+.1f}] |")
    lines += ["", *[f"- **{k}**: {v}" for k, v in s["verdicts"].items()]]
    return "\n".join(lines)


def examples(cell: Path, final_round: int, k: int = 4, width: int = 400) -> str:
    """The first ``k`` items' answers at round 0 and at the final round of one cell (kept answers), text cut at
    ``width`` characters."""
    a0 = read_jsonl_gz(cell / "answers" / "round_0000.jsonl.gz")
    a1 = {r["uid"]: r for r in read_jsonl_gz(cell / "answers" / f"round_{final_round:04d}.jsonl.gz")}
    out = []
    for r in a0[:k]:
        f = a1[r["uid"]]
        out.append(f"- item {r['uid']} (gold {r['gold']}):\n"
                   f"  - round 0 ({r['tokens']} tokens, {r['answer_gen']}): {json.dumps(r['text'][:width])}\n"
                   f"  - round {final_round} ({f['tokens']} tokens, {f['answer_gen']}): "
                   f"{json.dumps(f['text'][:width])}")
    return "\n".join(out)


def copy_cells(root: Path, target: Path, cells: dict) -> None:
    for cell in cells.values():
        dest = target / "cells" / cell.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "cell.toml", "config.toml"):
            if (cell / name).is_file():
                shutil.copy2(cell / name, dest / name)
        for folder in ("answers", "traces"):
            if (cell / folder).is_dir():
                shutil.copytree(cell / folder, dest / folder, dirs_exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the fedspear compare output directory")
    parser.add_argument("--copy", type=Path, help="results folder to copy the cells and summary.json into")
    args = parser.parse_args(argv)
    if not (args.root / "cells").is_dir():
        print(f"{args.root}: no cells/ folder; not a fedspear compare output directory", file=sys.stderr)
        return 2
    s = summarise(args.root)
    if not s["cells"]:
        print(f"{args.root}: no finished cell yet", file=sys.stderr)
        return 1
    print(tables(s))
    for name, c in s["cells"].items():
        print(f"\n### {name}: answers at round 0 and round {c['final_round']}\n")
        print(examples(args.root / "cells" / name, c["final_round"]))
    if args.copy:
        copy_cells(args.root, args.copy, load_cells(args.root))
        args.copy.mkdir(parents=True, exist_ok=True)
        (args.copy / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
