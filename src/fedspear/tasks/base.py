"""What every task module shares: the example record, loading JSON Lines with clear errors, and answer helpers.

Each task lives in its own module (``arc_challenge``, ``hellaswag``, ``strategy_qa``, ``math_mcqa``) and exposes the
same plain functions and constants; ``fedspear.tasks.get_task(name)`` returns the module. No class hierarchy.

A task module provides:

- ``NAME`` (str), ``HUB_ID`` (str, the Hugging Face dataset id used when loading online), ``TRAIN_SPLIT`` /
  ``EVAL_SPLIT`` (split names), ``MAX_NEW_TOKENS`` (int, generation budget per attempt, tokens),
  ``MAX_LOSE_RATIO`` (int, SPEC §3), ``MULTIPLE_CHOICE`` (bool: log-likelihood accuracy over the label tokens is
  meaningful and reported; False for MathMCQA although it has options, as its prompt asks for reasoning first).
- ``load(split, data_dir=None, source="offline", skipped=None) -> list[Example]``; with a ``skipped`` list, malformed
  records are skipped and their messages (file:line and field) appended to it instead of raising.
- ``prompt(example) -> str``: the initial user message c0 (paper appendix "Prompt Format").
- ``feedback(example, completion) -> str``: the oracle's partial feedback for a wrong completion (SPEC §2).
- ``extract_answer(completion, example) -> str | None``: the final answer label, or None (SPEC §2 IsCorrect: the
  short-answer rule for ARC-Challenge / HellaSwag, only an explicit final answer for MathMCQA / StrategyQA).
- ``is_correct(example, completion) -> bool``: ``extract_answer(...) == example.gold`` (the argument order of
  ``FeedbackSource.is_correct`` and ``feedback(example, completion)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping


class DataError(ValueError):
    """A data file or record is missing or malformed. The message names the file, the line and the field."""


@dataclass(frozen=True)
class Example:
    """One benchmark item in the form every task shares.

    Attributes:
        uid: stable identifier (the dataset's id, or ``"<split>-<line>"``).
        question: the question / context / problem text.
        labels: the answer labels the model may give, e.g. ``("A", "B", "C", "D")`` or ``("yes", "no")``.
        options: option texts aligned with ``labels`` (empty for yes/no tasks).
        gold: the correct label, one of ``labels``.
        extra: task-specific fields the feedback needs (``facts`` for StrategyQA, ``solution`` for MathMCQA).
    """

    uid: str
    question: str
    labels: tuple[str, ...]
    options: tuple[str, ...]
    gold: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gold_index(self) -> int:
        """Index of ``gold`` in ``labels`` (the class used for the Dirichlet partition)."""
        return self.labels.index(self.gold)


def read_jsonl(path: Path, skipped: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each non-empty line of a JSON Lines file (1-based line numbers).

    Args:
        skipped: if a list is given, lines that are not JSON objects are skipped and their error messages appended
            to it instead of raising.
    Raises:
        DataError: the file is missing, or (without ``skipped``) a line is not UTF-8 or not a JSON object (names file
            and line).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    # bytes that are not UTF-8 are kept as surrogates, so that such a line is named like any malformed one
    with path.open(encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as err:
                record = DataError(f"{path}:{lineno}: not UTF-8 text (character {err.start + 1} of the line)")
            else:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    record = DataError(f"{path}:{lineno}: not valid JSON ({err.msg})")
            if not isinstance(record, (dict, DataError)):
                record = DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if isinstance(record, DataError):
                if skipped is None:
                    raise record
                skipped.append(str(record))
                continue
            yield lineno, record


def collect(parse: Callable[..., Example], rows: Iterable[tuple], skipped: list[str] | None = None) -> list[Example]:
    """``[parse(*args) for args in rows]``; with a ``skipped`` list, a record raising DataError is skipped and its
    message appended to ``skipped`` (so a caller can count and report bad records) instead of raising."""
    out = []
    for args in rows:
        try:
            out.append(parse(*args))
        except DataError as err:
            if skipped is None:
                raise
            skipped.append(str(err))
    return out


def require(record: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """Return ``record[key]`` after checking it exists, has type ``kind`` and (for str/list) is not empty.

    Raises:
        DataError: naming ``where`` (``"file:line"``) and the field.
    """
    if key not in record:
        raise DataError(f"{where}: missing field '{key}'")
    value = record[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int,))):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field '{key}' should be {expected}, got {type(value).__name__}")
    if isinstance(value, (str, list)) and not value:
        raise DataError(f"{where}: field '{key}' is empty")
    return value
