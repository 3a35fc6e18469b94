"""HellaSwag: choose the most plausible continuation (Zellers et al. 2019), as SPEAR uses it.

Sources: prompt and feedback wording from the paper appendix "Prompt Format" (Prompt Template --- HellaSwag);
feedback and extraction rules from SPEC §2; evaluation on the validation split (SPEC §6); data notes in
``shared/data/hellaswag/SOURCE.md`` (SPEC §7).

A raw validation record (hub schema ``Rowan/hellaswag``; the label is a string)::

    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he",
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "source_id": "activitynet~v_-JhWjGDPHMY", "split": "val", "split_type": "indomain", "label": "3"}

A train record (``train_olmes_preprocessed.jsonl``: the only offline copy of the train split, already in OLMES form)::

    {"ind": 4, "activity_label": "Removing ice from car",
     "ctx": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes
             smiles. Then",
     "endings": [", the man adds wax to the windshield and cuts it.", "...", "...",
                 ", the man continues removing the snow on his car."], "label": "3"}

Same look for train and eval: records with ``ctx_a``/``ctx_b`` (validation, and every hub record) go through the
OLMES / lm-eval-harness preprocessing that produced the train file (``olmes_preprocess``): context =
``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())`` with the ``activity_label: `` prefix cut
off again, endings = ``preprocess(ending)``; preprocess = strip, " [title]" → ". ", drop every "[...]" tag, double
space → one, ".. " → ". ". Without this, WikiHow items would show "[header]"/"[step]" tags at evaluation only.
Labels A–D over ``endings``; gold = ``int(label)``. The prompt's context is the context alone (no activity label).
"""

from __future__ import annotations

import re
from pathlib import Path

from fedspear.tasks.base import DataError, Example, require
from fedspear.tasks.common import (
    reasons_before_answer,
    LETTERS,
    extract_letter,
    format_options,
    letters_phrase,
    load_records,
    option_hint_feedback,
)

NAME = "hellaswag"
HUB_ID = "Rowan/hellaswag"
TRAIN_SPLIT = "train"
EVAL_SPLIT = "validation"
SPLITS = (TRAIN_SPLIT, EVAL_SPLIT)
#: File per split under ``<data_dir>/hellaswag/``. There is no exact offline train split, only the OLMES form.
SPLIT_FILES = {TRAIN_SPLIT: "train_olmes_preprocessed.jsonl", EVAL_SPLIT: "validation.jsonl"}
#: Generation budget per attempt (tokens). A fedspear default: the paper does not state it; the prompt asks for a
#: single letter.
MAX_NEW_TOKENS = 16
MULTIPLE_CHOICE = True
N_ENDINGS = 4

# WikiHow markup tags such as "[header]", "[step]", "[substeps]" (non-greedy: one tag at a time).
BRACKET_TAG_RE = re.compile(r"\[.*?\]")

PROMPT_TEMPLATE = (
    "Choose the best continuation of the context.\n"
    "Respond with ONLY the letter ({letters}).\n"
    "\n"
    "[CONTEXT]\n"
    "{context}\n"
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
    "Choose the most natural continuation.\n"
    "\n"
    "Answer with exactly one letter: {letters}.\n"
    "DO NOT choose the answer you used previously."
)


def olmes_preprocess(text: str) -> str:
    """The OLMES / lm-eval-harness HellaSwag text clean-up (see module docstring and the data SOURCE.md).

    The leading space a removed leading tag leaves is kept, as upstream does (``parse_record`` strips afterwards).

    >>> olmes_preprocess("[header] How to tie a tie [title] Cross the ends. [step] Pull.. Done")
    ' How to tie a tie. Cross the ends. Pull. Done'
    """
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = BRACKET_TAG_RE.sub("", text)
    text = text.replace("  ", " ")
    text = text.replace(".. ", ". ")
    return text


def load(split: str, data_dir: str | Path | None = None, source: str = "offline",
         skipped: list[str] | None = None) -> list[Example]:
    """The HellaSwag ``split`` ("train" or "validation") as Examples.

    Args:
        split: "train" (offline: ``train_olmes_preprocessed.jsonl``) or "validation" (``validation.jsonl``).
        data_dir: a folder laid out like ``shared/data``; None = the samples shipped in ``fedspear/data/hellaswag``
            (1200 train and 800 validation records drawn with a fixed seed; pass ``data_dir`` for all of them).
        source: "offline" (files) or "hub" (``datasets.load_dataset("Rowan/hellaswag")``, preprocessed on load).

    Raises:
        ValueError: unknown split or source.
        DataError: missing file or malformed record (names file:line and field).
    """
    return load_records(NAME, split, SPLITS, parse_record, data_dir=data_dir, source=source, skipped=skipped,
                        hub_id=HUB_ID, file_name=SPLIT_FILES.get(split), extra=lambda split, index: (split,))


def parse_record(record: dict, where: str, split: str) -> Example:
    """One record → Example. Raw hub records (with ``ctx_a``) are OLMES-preprocessed; preprocessed ones kept.

    The uid is ``"<split>-<ind>-<activity_label>"``: ``ind`` alone is not unique (ActivityNet and WikiHow items are
    numbered separately), the pair is unique in both full splits, and it is the same in the shipped sample.
    """
    ind = require(record, "ind", int, where)
    activity_label = require(record, "activity_label", str, where)
    endings = require(record, "endings", list, where)
    label = require(record, "label", (str, int), where)
    if len(endings) != N_ENDINGS or not all(isinstance(e, str) for e in endings):
        raise DataError(f"{where}: field 'endings' should be a list of {N_ENDINGS} strings")
    if "ctx_a" in record:
        ctx_a, ctx_b = record["ctx_a"], record.get("ctx_b", "")
        if not isinstance(ctx_a, str) or not isinstance(ctx_b, str):
            raise DataError(f"{where}: fields 'ctx_a' and 'ctx_b' should be str")
        query = olmes_preprocess(f"{activity_label}: {ctx_a} {ctx_b.capitalize()}")
        context = query.split(": ", 1)[1] if ": " in query else query
        endings = [olmes_preprocess(e) for e in endings]
    else:
        context = require(record, "ctx", str, where)
    context, endings = context.strip(), [e.strip() for e in endings]
    if not context:
        raise DataError(f"{where}: field 'ctx' is empty")
    if not all(endings):
        raise DataError(f"{where}: field 'endings' has an empty ending")
    if str(label) not in {str(i) for i in range(N_ENDINGS)}:
        raise DataError(f"{where}: field 'label' {label!r} is not among the ending indices 0-{N_ENDINGS - 1}")
    labels = tuple(LETTERS[:N_ENDINGS])
    uid = f"{split}-{ind}-{activity_label}"
    return Example(uid=uid, question=context, labels=labels, options=tuple(endings), gold=labels[int(label)])


def prompt(example: Example) -> str:
    """The initial user message c0 (appendix "Prompt Template --- HellaSwag")."""
    return PROMPT_TEMPLATE.format(
        letters=letters_phrase(example.labels),
        context=example.question,
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

    Names the model's own letter (``?`` if none could be extracted) and the opening words of the gold ending
    (``common.hint_words``: never the whole ending). Never names the gold letter.

    Raises:
        ValueError: the completion is correct (feedback is only for wrong answers).
    """
    return option_hint_feedback(FEEDBACK_TEMPLATE, example, extract_answer(completion, example))
