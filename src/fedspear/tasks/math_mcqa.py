"""math_mcqa (offline: a 4-choice set derived from MATH, not stellaathena/math_mcqa).

SPEAR's "MathMCQA" is the Hugging Face dataset ``stellaathena/math_mcqa`` (MATH problems with 4 choices). That
dataset is not available offline (SPEC §7), so:

- ``source="hub"`` loads the real ``stellaathena/math_mcqa`` (fields problem, choices, answer int 0–3, solution).
- ``source="offline"`` (the default) uses a DIFFERENT, locally derived 4-choice set built from the MATH dataset
  (Hendrycks et al. 2021) by ``derive_split``; the package ships a sample of it (``fedspear/data/math_mcqa``,
  made by ``scripts/build_package_data.py``). Its numbers are not comparable with the paper's MathMCQA numbers.

Derivation (SPEC §7), per split, from ``hendrycks_math/<split>.jsonl``:

- gold = content of the last ``\\boxed{...}`` of ``solution`` (balanced braces; the two solutions written
  ``\\boxed 2`` count too), whitespace runs collapsed to one space;
- skipped: the two "Level ?" problems and the two whose boxed answer is empty (train 7500 → 7496; test 5000);
- 3 distractors = boxed answers of other problems of the same ``type`` in the same split, distinct from the gold
  and from each other under ``answer_key`` (whitespace removed, ``\\dfrac``/``\\tfrac`` → ``\\frac``, ``\\left``/
  ``\\right``/``$``/thin spaces dropped), drawn with ``random.Random(seed)``, seed = the first 8 bytes of
  sha256("fedspear-math_mcqa:" + unique_id) — stable across runs, machines and Python versions;
- the gold position is drawn from the same generator, so it is uniform over A–D and fixed per problem.

A raw MATH record (``shared/data/hendrycks_math``)::

    {"problem": "If $A=2+i$, $O=-4$, $P=-i$, and $S=2+4i$, find $A-O+P+S$.", "level": "Level 3",
     "type": "Algebra", "solution": "Adding real parts and imaginary parts separately, we have
     $(2-(-4)+0+2)+(1+0-1+4)i=\\boxed{8+4i}$.", "unique_id": "train/algebra/1.json"}

and the derived record (the ``stellaathena/math_mcqa`` field names plus level, type, unique_id)::

    {"problem": "...", "choices": ["...", "8+4i", "...", "..."], "answer": 1, "solution": "...",
     "level": "Level 3", "type": "Algebra", "unique_id": "train/algebra/1.json"}

Prompt and feedback wording: paper appendix "Prompt Format" (Prompt Template --- MathMCQA). Feedback (SPEC §2):
the hint is the first three lines or 300 characters of the solution, whichever is shorter, with every ``\\boxed{...}``
removed and cut before the first occurrence of the final answer (``hint_lines``), so it never contains the answer.

**Decision (IsCorrect, 2026-11-25, issue 16):** only an explicit final answer counts; the rule is
``common.explicit_letter`` and the same function judges training (the oracle's ``is_correct``) and evaluation
(``acc_gen``, through ``extract_answer``). Accepted, in this order:

1. a final line that is only the letter, lightly decorated ("B", "(B)", "**B**", "B.", "\\boxed{B}") — the final
   line being the last line holding a letter or digit (bare markdown such as "```" or "---" after it is skipped);
2. else the LAST answer statement of the completion: "Answer:" ("Answer: B", "**Answer:** B", "**Answer: B**",
   "Final answer: (B)", "... so x = 5. Answer: B") or a sentence opening with "The answer is" ("The answer is
   (B).", "So the final answer is $\\boxed{B}$."), whose line goes on with one of the item's letters standing alone
   ("(B)", "**B**", "B.", "\\boxed{B}", "option B") and then nothing, or only that option's own text ("Answer: B.
   42", "Answer: (B) $\\frac{1}{2}$", compared under ``answer_key``). Lines after it may explain it.

Anything else is unparsed (``None``, shown as "?" in the feedback) and wrong: a letter met inside the reasoning
("Let $ABC$ be a triangle and let $D$ be the foot of the altitude from", "Option A says 5, option C says 7.
Computing: 2+3 ="), reasoning cut off before any answer statement, "Answer: 3" (a number where a letter is asked),
"Answer: E" (not an option), "Answer: B is wrong because...", "Answer: B, since...", option text that is not that
letter's ("Answer: B. 7" when B is 42), lower-case "answer: b", the template quoted back ('"Answer: X"'), and a last
statement whose letter does not parse even if an earlier one did ("Answer: B ... To check the answer: compute"):
the last statement decides, nothing falls back. Why this strict: a false win enters NLL training and gives α = 1 to
a lose trace that was never fixed, while a missed parse only costs a revision. Known limit: the rule reads text
only, so an answer the budget cut off after its statement, or a repetition loop ("The answer is B. The answer is
B. The ...") cut by the budget, still counts; telling those apart needs the caller to say whether the completion
ended with EOS (measured in docs/results/parse-rates). Before 2026-11-25 the fallback took the last standalone
capital letter anywhere in the text.

**Decision (no log-likelihood accuracy, issue 16):** ``MULTIPLE_CHOICE = False`` here although the items have
options. Log-likelihood accuracy scores the first answer token, but the prompt asks for reasoning first, so that
token is the start of the reasoning, not a choice; the number would not measure the model's answer. Only the
accuracy of the final generated answer is reported.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from fedspear.tasks.base import DataError, Example, collect, read_jsonl, require
from fedspear.tasks.common import (
    reasons_before_answer,
    LETTERS,
    check_not_correct,
    check_split,
    data_root,
    explicit_letter,
    format_options,
    letters_phrase,
    load_records,
    shown_prediction,
)

NAME = "math_mcqa"
HUB_ID = "stellaathena/math_mcqa"
#: The MATH folder (under ``data_dir``) the offline set is derived from when no ``math_mcqa`` folder is there.
MATH_DIR = "hendrycks_math"
TRAIN_SPLIT = "train"
EVAL_SPLIT = "test"
SPLITS = (TRAIN_SPLIT, EVAL_SPLIT)
#: Generation budget per attempt (tokens): the SPEAR authors' 512 (their code; the paper's max sequence length is
#: 2048). The earlier 256 cut step-by-step answers before their final "Answer: X" (issue 16; measured in
#: docs/results/parse-rates).
MAX_NEW_TOKENS = 512
#: False: log-likelihood accuracy is not reported for this task (module docstring, second Decision).
MULTIPLE_CHOICE = False
N_CHOICES = 4
LABELS = tuple(LETTERS[:N_CHOICES])
SEED_SALT = "fedspear-math_mcqa"
#: Hint length limits (SPEC §2): first three lines or 300 characters, whichever is shorter.
HINT_MAX_LINES = 3
HINT_MAX_CHARS = 300
SKIPPED_LEVEL = "Level ?"

# "\boxed" followed by "{...}" or, as in two MATH solutions, a single token ("\boxed 2").
BOXED_RE = re.compile(r"\\boxed(?![A-Za-z])\s*")
LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
WHITESPACE_RE = re.compile(r"\s+")
# Spellings that do not change an answer, dropped when comparing choices (``answer_key``).
NEUTRAL_LATEX_RE = re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[,;!]|\\ |\$")
FRAC_VARIANT_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")

PROMPT_TEMPLATE = (
    "Solve the math problem step by step, then choose the correct answer.\n"
    'Show your reasoning, then end with exactly: "Answer: X"\n'
    "where X is the letter {letters}.\n"
    "\n"
    "[PROBLEM]\n"
    "{problem}\n"
    "\n"
    "[OPTIONS]\n"
    "{options}"
)

FEEDBACK_TEMPLATE = (
    "Incorrect. Your answer '{predicted_letter}' is wrong.\n"
    "\n"
    "Hint --- consider these opening steps of the solution:\n"
    "{hint_lines}\n"
    "\n"
    "Reason step by step, then end your response with exactly:\n"
    '"Answer: X" where X is {letters}.\n'
    "DO NOT repeat the letter you used previously."
)


# ---------------------------------------------------------------------------------------------------------------
# Boxed answers


def boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """Every ``\\boxed`` in ``text`` as (start, end, content); an unbalanced ``\\boxed{`` runs to the end of text.

    >>> boxed_spans(r"so $x=\\boxed{\\frac{1}{2}}$ or \\boxed 9.")
    [(6, 25, '\\\\frac{1}{2}'), (30, 38, '9')]
    """
    spans = []
    pos = 0
    while (match := BOXED_RE.search(text, pos)) is not None:
        start, i = match.start(), match.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    spans.append((start, j + 1, text[i + 1 : j]))
                    break
            else:
                spans.append((start, len(text), text[i + 1 :]))
        elif command := LATEX_COMMAND_RE.match(text, i):
            spans.append((start, command.end(), command.group()))
        elif i < len(text):
            spans.append((start, i + 1, text[i]))
        pos = spans[-1][1] if spans and spans[-1][0] == start else match.end()
    return spans


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, whitespace runs collapsed; None if there is none."""
    spans = boxed_spans(text)
    return " ".join(spans[-1][2].split()) if spans else None


def remove_boxed(text: str) -> str:
    """``text`` with every ``\\boxed{...}`` (command and content) removed."""
    pieces, pos = [], 0
    for start, end, _ in boxed_spans(text):
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces)


def answer_key(answer: str) -> str:
    """The form under which two answers count as the same choice (see module docstring).

    >>> answer_key(r"\\dfrac{1}{2}") == answer_key(r"$\\frac{1} {2}$")
    True
    """
    key = FRAC_VARIANT_RE.sub(r"\\frac", answer)
    key = NEUTRAL_LATEX_RE.sub("", key)
    return WHITESPACE_RE.sub("", key)


# ---------------------------------------------------------------------------------------------------------------
# Deriving the offline 4-choice set


def problem_seed(unique_id: str) -> int:
    """A 64-bit seed from the problem's id (sha256, so it does not depend on PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{SEED_SALT}:{unique_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def derive_split(records: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """MATH records → 4-choice records (math_mcqa field names), in input order.

    Args:
        records: ``(where, record)`` pairs, ``where`` = "file:line" for error messages; MATH schema (problem,
            level, type, solution, unique_id).

    Returns:
        dicts with problem, choices (4 str), answer (gold index 0–3), solution, level, type, unique_id.

    Raises:
        DataError: a malformed record, or fewer than 4 distinct answers in a subject.
    """
    kept = []
    for where, record in records:
        problem = require(record, "problem", str, where)
        level = require(record, "level", str, where)
        subject = require(record, "type", str, where)
        solution = require(record, "solution", str, where)
        unique_id = require(record, "unique_id", str, where)
        gold = last_boxed(solution)
        if level == SKIPPED_LEVEL or not gold:
            continue
        kept.append((where, {"problem": problem, "solution": solution, "level": level, "type": subject,
                             "unique_id": unique_id}, gold))
    pools: dict[str, dict[str, str]] = defaultdict(dict)  # type → answer_key → first answer text with that key
    for _, record, gold in kept:
        pools[record["type"]].setdefault(answer_key(gold), gold)
    pool_lists = {subject: list(pool.values()) for subject, pool in pools.items()}
    derived = []
    for where, record, gold in kept:
        pool = pool_lists[record["type"]]
        if len(pool) < N_CHOICES:
            raise DataError(f"{where}: type {record['type']!r} has fewer than {N_CHOICES} distinct answers")
        rng = random.Random(problem_seed(record["unique_id"]))
        gold_key = answer_key(gold)
        distractors = [a for a in rng.sample(pool, N_CHOICES) if answer_key(a) != gold_key][: N_CHOICES - 1]
        position = rng.randrange(N_CHOICES)
        choices = distractors[:position] + [gold] + distractors[position:]
        derived.append({"problem": record["problem"], "choices": choices, "answer": position,
                        "solution": record["solution"], "level": record["level"], "type": record["type"],
                        "unique_id": record["unique_id"]})
    return derived


# ---------------------------------------------------------------------------------------------------------------
# The task API


def load(split: str, data_dir: str | Path | None = None, source: str = "offline",
         skipped: list[str] | None = None) -> list[Example]:
    """The ``split`` ("train" or "test") as Examples.

    Args:
        split: "train" or "test".
        data_dir: a folder laid out like ``shared/data``. Reads ``data_dir/math_mcqa/<split>.jsonl`` if present
            (math_mcqa field names: an already derived set, or the real dataset converted to JSON Lines), else
            derives the offline set from ``data_dir/hendrycks_math/<split>.jsonl`` (all of it: train 7496,
            test 5000). None = the derived sample shipped in ``fedspear/data/math_mcqa``.
        source: "offline" (files) or "hub" (``datasets.load_dataset("stellaathena/math_mcqa")``, the real one).

    Raises:
        ValueError: unknown split or source.
        DataError: missing files or a malformed record (names file:line and field).
    """
    root = data_root(data_dir)
    path = root / NAME / f"{split}.jsonl"
    if source != "offline" or path.is_file() or data_dir is None:
        return load_records(NAME, split, SPLITS, parse_record, data_dir=data_dir, source=source, skipped=skipped,
                            hub_id=HUB_ID, extra=lambda split, index: (f"{split}-{index}",))
    check_split(split, SPLITS, NAME)
    math_path = root / MATH_DIR / f"{split}.jsonl"
    if not math_path.is_file():
        raise DataError(f"{path}: data file not found (nor {math_path} to derive it from)")
    derived = derive_split((f"{math_path}:{lineno}", record) for lineno, record in read_jsonl(math_path, skipped))
    return collect(parse_record, ((record, f"{math_path} ({record['unique_id']})", record["unique_id"])
                                  for record in derived), skipped)


def parse_record(record: dict, where: str, default_uid: str) -> Example:
    """One math_mcqa-schema record → Example (labels A–D). ``where`` = "file:line" for errors.

    ``extra`` holds ``solution`` (for the hint) and ``answer_text`` (the gold choice, cut out of the hint).
    """
    problem = require(record, "problem", str, where).strip()
    choices = require(record, "choices", list, where)
    answer = require(record, "answer", int, where)
    solution = require(record, "solution", str, where)
    uid = record.get("unique_id") if isinstance(record.get("unique_id"), str) else default_uid
    if not problem:
        raise DataError(f"{where}: field 'problem' is empty")
    if len(choices) != N_CHOICES or not all(isinstance(c, str) and c.strip() for c in choices):
        raise DataError(f"{where}: field 'choices' should be {N_CHOICES} non-empty strings")
    if not 0 <= answer < N_CHOICES:
        raise DataError(f"{where}: field 'answer' {answer} is not among the choice indices 0-{N_CHOICES - 1}")
    options = tuple(" ".join(c.split()) for c in choices)
    return Example(
        uid=uid,
        question=problem,
        labels=LABELS,
        options=options,
        gold=LABELS[answer],
        extra={"solution": solution, "answer_text": options[answer]},
    )


def prompt(example: Example) -> str:
    """The initial user message c0 (appendix "Prompt Template --- MathMCQA")."""
    return PROMPT_TEMPLATE.format(
        letters=letters_phrase(example.labels),
        problem=example.question,
        options=format_options(example.labels, example.options),
    )


def extract_answer(completion: str, example: Example) -> str | None:
    """The option letter of an explicit final answer (module docstring, first Decision), or None.

    >>> example = Example("x", "1+1?", LABELS, ("1", "2", "3", "4"), "B")
    >>> extract_answer("1+1 = 2, which is option B.\\nAnswer: B", example)
    'B'
    >>> extract_answer("Answer: (B) 2", example), extract_answer("Answer: (B) 3", example)
    ('B', None)
    >>> extract_answer("Let $ABC$ be a triangle and let $D$ be the foot of the altitude from", example) is None
    True
    """
    return explicit_letter(completion, example.labels, example.options, answer_key)


def is_correct(example: Example, completion: str) -> bool:
    """True when the extracted letter is the gold letter (an unparsed answer is wrong)."""
    return extract_answer(completion, example) == example.gold


def reasons(completion: str) -> bool:
    """Whether ``completion`` reasons before its final answer: ≥ 10 words (numbers count) before the last answer
    statement or the lone letter on the final line (``common.reasons_before_answer``)."""
    return reasons_before_answer(completion)


def loose_pattern(answer: str) -> re.Pattern[str]:
    """Matches ``answer`` with any whitespace between its characters ("x + 1" finds "x+1" and "x +1")."""
    return re.compile(r"\s*".join(re.escape(ch) for ch in WHITESPACE_RE.sub("", answer)))


def hint_lines(solution: str, answers: Iterable[str]) -> str:
    """The opening of ``solution`` the hint shows; it contains none of ``answers`` (whitespace ignored).

    Every ``\\boxed{...}`` is removed, the text is cut before the first occurrence of any answer, then the first
    three lines or 300 characters are kept, whichever is shorter (both are prefixes: the shorter wins). Removing
    first and cutting only prefixes means no occurrence can be created by the cuts. May be empty when the
    solution opens with the answer.
    """
    text = remove_boxed(solution)
    cut = len(text)
    for answer in answers:
        if WHITESPACE_RE.sub("", answer) and (match := loose_pattern(answer).search(text)):
            cut = min(cut, match.start())
    text = text[:cut]
    three_lines = "\n".join(text.split("\n")[:HINT_MAX_LINES])
    return text[: min(len(three_lines), HINT_MAX_CHARS)].strip()


def feedback(example: Example, completion: str) -> str:
    """The oracle's feedback for a wrong completion (appendix template; SPEC §2 no-leak decision).

    Names the model's own letter (``?`` if none could be extracted) and the opening of the solution
    (``hint_lines``), which never contains the gold answer text nor the solution's last boxed answer.

    Raises:
        ValueError: the completion is correct (feedback is only for wrong answers).
    """
    predicted = extract_answer(completion, example)
    check_not_correct(predicted, example.gold, example.uid)
    solution = example.extra["solution"]
    answers = [example.extra["answer_text"]] + [a for a in [last_boxed(solution)] if a]
    return FEEDBACK_TEMPLATE.format(
        predicted_letter=shown_prediction(predicted),
        hint_lines=hint_lines(solution, answers),
        letters=letters_phrase(example.labels),
    )
