"""ARC-Challenge: grade-school science multiple choice (Clark et al. 2018), as SPEAR uses it.

Sources: prompt and feedback wording from the paper appendix "Prompt Format" (Prompt Template --- ARC-Challenge);
feedback and extraction rules from SPEC §2; splits and evaluation from SPEC §6 (train 1119, test 1172).

A raw record (hub schema ``allenai/ai2_arc``, config ``ARC-Challenge``; the shipped copy is exact)::

    {"id": "Mercury_SC_415702",
     "question":
         "George wants to warm his hands quickly by rubbing them. Which skin surface will produce the most heat?",
     "choices": {"text": ["dry palms", "wet palms", "palms covered with oil", "palms covered with lotion"],
                 "label": ["A", "B", "C", "D"]},
     "answerKey": "A"}

Labels: 44 items use numeric labels 1–4 (one test item 1–3); they become A–D (A–C) and ``answerKey`` is mapped the
same way, so the model always answers with a letter. A few items have 3 or 5 options and keep their own letters
(A–C / A–E); for them the template's "(A, B, C, or D)" and "A, B, C, or D" list the item's actual letters
("(A, B, or C)", "A, B, C, D, or E"). Four-option items get the appendix wording verbatim.
"""

from __future__ import annotations

from pathlib import Path

from fedspear.tasks.base import DataError, Example, require
from fedspear.tasks.common import (
    reasons_before_answer,
    LETTERS,
    extract_letter,
    format_options,
    letters_phrase,
    load_records,
    numeric_to_letters,
    option_hint_feedback,
)

NAME = "arc_challenge"
HUB_ID = "allenai/ai2_arc"
HUB_CONFIG = "ARC-Challenge"
TRAIN_SPLIT = "train"
EVAL_SPLIT = "test"
SPLITS = (TRAIN_SPLIT, EVAL_SPLIT)
#: Generation budget per attempt (tokens). A fedspear default: the paper does not state it; the prompt asks for a
#: single letter.
MAX_NEW_TOKENS = 16
MULTIPLE_CHOICE = True

PROMPT_TEMPLATE = (
    "Answer the multiple-choice question by choosing the best option.\n"
    "Respond with ONLY the letter ({letters}).\n"
    "\n"
    "[QUESTION]\n"
    "{question}\n"
    "\n"
    "[OPTIONS]\n"
    "{options}\n"
    "\n"
    "Answer:"
)

FEEDBACK_TEMPLATE = (
    "Incorrect. '{predicted_letter}' is wrong.\n"
    "\n"
    'Hint: Consider an answer that starts with "{hint_words}..."\n'
    "Consider the underlying scientific principle.\n"
    "\n"
    "Answer with exactly one letter: {letters}.\n"
    "DO NOT choose the answer you used previously."
)


def load(split: str, data_dir: str | Path | None = None, source: str = "offline",
         skipped: list[str] | None = None) -> list[Example]:
    """The ARC-Challenge ``split`` ("train" or "test") as Examples.

    Args:
        split: "train" or "test".
        data_dir: a folder laid out like ``shared/data`` (reads ``data_dir/arc_challenge/<split>.jsonl``); None =
            the copy shipped in ``fedspear/data/arc_challenge`` (complete, exact).
        source: "offline" (files) or "hub" (``datasets.load_dataset("allenai/ai2_arc", "ARC-Challenge")``).

    Raises:
        ValueError: unknown split or source.
        DataError: missing file or malformed record (names file:line and field).
    """
    return load_records(NAME, split, SPLITS, parse_record, data_dir=data_dir, source=source, skipped=skipped,
                        hub_id=HUB_ID, hub_config=HUB_CONFIG)


def parse_record(record: dict, where: str) -> Example:
    """One hub-schema record → Example, numeric labels mapped to letters. ``where`` = "file:line" for errors."""
    uid = require(record, "id", str, where)
    question = require(record, "question", str, where).strip()
    choices = require(record, "choices", dict, where)
    texts = require(choices, "text", list, f"{where}: choices")
    labels = require(choices, "label", list, f"{where}: choices")
    answer_key = require(record, "answerKey", str, where)
    if not question:
        raise DataError(f"{where}: field 'question' is empty")
    if len(texts) != len(labels) or not 2 <= len(labels) <= len(LETTERS):
        raise DataError(f"{where}: field 'choices' needs as many labels as texts (got {len(labels)} and {len(texts)})")
    if not all(isinstance(t, str) and t.strip() for t in texts):
        raise DataError(f"{where}: field 'choices.text' has an empty or non-string option")
    if not all(isinstance(label, str) for label in labels):
        raise DataError(f"{where}: field 'choices.label' has a non-string label")
    if answer_key not in labels:
        raise DataError(f"{where}: field 'answerKey' {answer_key!r} is not among the choice labels {labels}")
    letters = numeric_to_letters(labels)
    if letters is None:
        if labels != list(LETTERS[: len(labels)]):
            raise DataError(f"{where}: field 'choices.label' should be A, B, ... or 1, 2, ... in order, got {labels}")
        letters = tuple(labels)
    gold = letters[labels.index(answer_key)]
    return Example(uid=uid, question=question, labels=letters, options=tuple(t.strip() for t in texts), gold=gold)


def prompt(example: Example) -> str:
    """The initial user message c0 (appendix "Prompt Template --- ARC-Challenge")."""
    return PROMPT_TEMPLATE.format(
        letters=letters_phrase(example.labels),
        question=example.question,
        options=format_options(example.labels, example.options),
    )


def extract_answer(completion: str, example: Example) -> str | None:
    """The option letter of ``completion`` (SPEC §2 IsCorrect; rules in ``common.extract_letter``), or None."""
    return extract_letter(completion, example.labels)


def is_correct(example: Example, completion: str) -> bool:
    """True when the extracted letter is the gold letter."""
    return extract_answer(completion, example) == example.gold


def reasons(completion: str) -> bool:
    """Whether ``completion`` reasons before its final answer (``common.reasons_before_answer``: ≥ 10 words before
    it). The prompt asks for one letter within 16 tokens, so a share near 0 is expected and healthy here; it is
    reported for every task alike (``fedspear.health``)."""
    return reasons_before_answer(completion)


def feedback(example: Example, completion: str) -> str:
    """The oracle's feedback for a wrong completion (appendix template; SPEC §2 no-leak decision).

    Names the model's own letter (``?`` if none could be extracted) and the opening words of the gold option
    (``common.hint_words``: never the whole option). Never names the gold letter.

    Raises:
        ValueError: the completion is correct (feedback is only for wrong answers).
    """
    return option_hint_feedback(FEEDBACK_TEMPLATE, example, extract_answer(completion, example))
