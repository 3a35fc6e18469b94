"""How often reasoning answers are cut off by the token budget, and how often they parse under the old and new rule.

Issue 16 (parts 2 and 3): MathMCQA and StrategyQA answers were judged by a lenient fallback (the last standalone
capital letter / any yes/no word), and their budgets (256 / 128 new tokens) cut step-by-step answers before their
final line. This script measures both, on 100 fixed test items per task:

    .venv/bin/python scripts/parse_rates.py generate --model smollm2-135m --task math_mcqa
    .venv/bin/python scripts/parse_rates.py generate --model smollm2-135m --task strategy_qa
    .venv/bin/python scripts/parse_rates.py generate --model qwen2.5-coder-1.5b --task math_mcqa
    .venv/bin/python scripts/parse_rates.py generate --model qwen2.5-coder-1.5b --task strategy_qa
    .venv/bin/python scripts/parse_rates.py report

``generate`` draws the items with ``random.Random(seed).sample`` (seed 0) from the task's evaluation split as
shipped, renders each prompt and generates greedily exactly as the central evaluation does
(``fedspear.interaction.render`` + ``fedspear.runtime.generation.generate(..., do_sample=False)``, the task's prompt,
the model's chat template, dtype "auto"), at a large budget (MathMCQA 1024, StrategyQA 512 new tokens), and writes the
token ids to ``docs/results/parse-rates/generations/<model>__<task>.jsonl`` (one line per item, appended batch by
batch, so an interrupted run resumes at the next batch).

``report`` cuts each stored generation at the budgets 128 / 256 / 512 / 1024 and reports per budget:

- cut-off rate: share of answers with no EOS within the budget (the answer was stopped by the budget);
- parse rate and accuracy under the OLD rule (``common.extract_letter`` / ``common.extract_yes_no``, the lenient
  fallback that ARC-Challenge and HellaSwag keep), the NEW rule (the task's ``extract_answer``: only an explicit
  final answer counts, see the task module docstrings), and the new rule given only the final line (a stricter
  variant, for comparison: it drops an answer statement followed by more lines);
- old-only wins: items judged correct under the old rule but not under the new one (the false wins the issue
  describes, or parses the new rule rejects);
- cut off yet parsed: answers with no EOS within the budget from which a rule still reads an answer (the rules see
  text only; see the "Known limit" in the task docstrings).

**Assumption (prefix):** greedy decoding is deterministic and each step depends only on the tokens before it, so
the answer a run with budget B would produce is the first B tokens of the run with the larger budget (same batch,
same padding). Cutting the stored ids at B therefore gives the budget-B answer without generating again; a budget
larger than the stored one is not reported.

``report`` writes ``results.json`` and ``results.md`` beside the generations. README.md there has the date, the
machine and the commit.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fedspear.tasks import get_task  # noqa: E402
from fedspear.tasks.common import extract_letter, extract_yes_no, final_line  # noqa: E402

OUT_DIR = ROOT / "docs" / "results" / "parse-rates"
GEN_DIR = OUT_DIR / "generations"
TASKS = ("math_mcqa", "strategy_qa")
MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b")
#: The stored (largest) budget per task, tokens: twice the authors' 512 / 256 so the authors' budget can be judged.
LARGE_BUDGET = {"math_mcqa": 1024, "strategy_qa": 512}
#: Budgets reported: the old fedspear defaults (256 / 128), the authors' (512 / 256) and the stored one.
BUDGETS = (128, 256, 512, 1024)
N_ITEMS = 100
SEED = 0


def sample_items(task, n: int = N_ITEMS, seed: int = SEED):
    """``n`` items of the task's evaluation split (as shipped), drawn with ``random.Random(seed)``, in draw order."""
    examples = task.load(task.EVAL_SPLIT)
    return random.Random(seed).sample(examples, n)


def old_rule(task_name: str, text: str, example) -> str | None:
    """The lenient rule these tasks used before issue 16 (still the ARC-Challenge / HellaSwag rule)."""
    return extract_yes_no(text) if task_name == "strategy_qa" else extract_letter(text, example.labels)


def generation_path(model: str, task_name: str) -> Path:
    return GEN_DIR / f"{model}__{task_name}.jsonl"


def cmd_generate(args: argparse.Namespace) -> None:
    """Greedy answers at the large budget, appended batch by batch (resumes after the last complete batch)."""
    import torch

    from fedspear.experiments.bench import machine
    from fedspear.runtime.generation import generate
    from fedspear.interaction import render
    from fedspear.runtime.model import load_base

    task = get_task(args.task)
    budget = args.max_new_tokens or LARGE_BUDGET[args.task]
    items = sample_items(task, args.n, args.seed)
    path = generation_path(args.model, args.task)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for _ in path.open()) if path.exists() else 0
    if done % args.batch_size and done < len(items):
        raise SystemExit(f"{path} holds {done} lines, not a whole number of batches of {args.batch_size}; "
                         "delete it or pass the batch size it was written with")
    model, tokenizer, dtype_used = load_base(args.model, "auto")
    meta = {"model": args.model, "task": args.task, "n": args.n, "seed": args.seed, "max_new_tokens": budget,
            "batch_size": args.batch_size, "dtype": "auto", "dtype_used": dtype_used,
            "eos_token_id": tokenizer.eos_token_id, "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "torch_threads": torch.get_num_threads()}
    meta_path = path.with_suffix(".meta.json")
    if done == 0:
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    for start in range(done, len(items), args.batch_size):
        batch = items[start : start + args.batch_size]
        contexts = [render(tokenizer, [task.prompt(ex)]) for ex in batch]
        t0 = time.perf_counter()
        completions = generate(model, tokenizer, contexts, max_new_tokens=budget, dtype_used=dtype_used,
                               do_sample=False, batch_size=len(batch))
        seconds = time.perf_counter() - t0
        with path.open("a") as fh:
            for ex, ids in zip(batch, completions):
                eos = bool(ids) and ids[-1] == tokenizer.eos_token_id
                fh.write(json.dumps({"uid": ex.uid, "gold": ex.gold, "eos": eos, "completion_ids": ids}) + "\n")
        print(f"{args.model} {args.task}: items {start + len(batch)}/{len(items)}, batch {seconds:.0f} s, "
              f"longest {max(len(c) for c in completions)} tokens", flush=True)
    stored = json.loads(meta_path.read_text())
    stored["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    meta_path.write_text(json.dumps(stored, indent=1) + "\n")


RULES = ("old", "new", "final_line")
RULE_NAMES = {"old": "old rule", "new": "new rule", "final_line": "new rule on the final line only"}


def judge(task_name: str, task, text: str, example) -> dict[str, str | None]:
    """The answer each rule reads: ``old`` (lenient), ``new`` (the task's ``extract_answer``) and ``final_line``
    (the new rule given only the final line: the stricter variant that ignores an answer followed by more lines)."""
    return {"old": old_rule(task_name, text, example), "new": task.extract_answer(text, example),
            "final_line": task.extract_answer(final_line(text), example)}


def analyse(model: str, task_name: str) -> dict | None:
    """Per-budget cut-off, parse and accuracy figures for one stored generation file (None if absent/partial)."""
    from transformers import AutoTokenizer

    from fedspear.runtime.model_zoo import resolve_model_dir

    path = generation_path(model, task_name)
    if not path.exists():
        return None
    meta = json.loads(path.with_suffix(".meta.json").read_text())
    rows = [json.loads(line) for line in path.open()]
    task = get_task(task_name)
    by_uid = {ex.uid: ex for ex in sample_items(task, meta["n"], meta["seed"])}
    if len(rows) < len(by_uid):
        return None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model))
    eos = meta["eos_token_id"]
    out = {"model": model, "task": task_name, "n": len(rows), "stored_budget": meta["max_new_tokens"],
           "dtype_used": meta["dtype_used"], "torch_threads": meta.get("torch_threads"),
           "lengths": sorted(len(r["completion_ids"]) for r in rows), "budgets": {}}
    for budget in (b for b in BUDGETS if b <= meta["max_new_tokens"]):
        counts = {"cut": 0, "old_only_wins": 0}
        for rule in RULES:
            counts.update({f"parsed_{rule}": 0, f"correct_{rule}": 0, f"cut_parsed_{rule}": 0})
        for row in rows:
            example = by_uid[row["uid"]]
            ids = row["completion_ids"][:budget]
            cut = eos not in ids
            answers = judge(task_name, task, tokenizer.decode(ids, skip_special_tokens=True), example)
            counts["cut"] += cut
            for rule, answer in answers.items():
                counts[f"parsed_{rule}"] += answer is not None
                counts[f"correct_{rule}"] += answer == example.gold
                counts[f"cut_parsed_{rule}"] += cut and answer is not None
            counts["old_only_wins"] += answers["old"] == example.gold and answers["new"] != example.gold
        out["budgets"][str(budget)] = counts
    return out


def per_rule(counts: dict[str, int], key: str) -> str:
    """``"old / new / final_line"`` counts of ``key`` (a table cell)."""
    return " / ".join(str(counts[f"{key}_{rule}"]) for rule in RULES)


def markdown(results: list[dict]) -> str:
    lines = ["| model | task | budget | cut off | parsed: old / new / final line only | "
             "correct: old / new / final line only | old-only wins | cut off yet parsed: old / new / final line only |",
             "|---|---|---:|---:|---|---|---:|---|"]
    for r in results:
        for budget, c in r["budgets"].items():
            lines.append(f"| {r['model']} | {r['task']} | {budget} | {c['cut']} | {per_rule(c, 'parsed')} | "
                         f"{per_rule(c, 'correct')} | {c['old_only_wins']} | {per_rule(c, 'cut_parsed')} |")
    lines.append("")
    lines.append(f"Counts out of n = {results[0]['n'] if results else 0} items per row. Completion length (tokens, "
                 "EOS included; an answer cut off at the stored budget counts as that budget): median / 90th "
                 "percentile / max:")
    lines.append("")
    for r in results:
        lengths = r["lengths"]
        lines.append(f"- {r['model']} {r['task']}: {lengths[len(lengths) // 2]} / "
                     f"{lengths[int(0.9 * (len(lengths) - 1))]} / {lengths[-1]}")
    return "\n".join(lines) + "\n"


def cmd_report(args: argparse.Namespace) -> None:
    results = [r for m in MODELS for t in TASKS if (r := analyse(m, t)) is not None]
    (OUT_DIR / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT_DIR / "results.md").write_text(markdown(results))
    print(markdown(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy answers at the large budget for one model and task")
    gen.add_argument("--model", required=True)
    gen.add_argument("--task", required=True, choices=TASKS)
    gen.add_argument("--n", type=int, default=N_ITEMS)
    gen.add_argument("--seed", type=int, default=SEED)
    gen.add_argument("--max-new-tokens", type=int, default=0, help="default: MathMCQA 1024, StrategyQA 512")
    gen.add_argument("--batch-size", type=int, default=10)
    sub.add_parser("report", help="cut-off and parse rates per budget from the stored generations")
    args = parser.parse_args()
    {"generate": cmd_generate, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
