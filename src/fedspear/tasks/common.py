"""Helpers several task modules share: answer extraction, option rendering, hint words, data paths.

The extraction rules follow SPEC §2 "IsCorrect": the last ``Answer: X`` wins, else the last standalone answer token,
else no answer. Letters are matched case-SENSITIVELY (uppercase only), so the English article "a" is never read as
option A; yes/no is matched case-insensitively. Only labels of the example count: an "E" in a four-option item, or
the pronoun "I", is not an answer.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from fedspear.tasks.base import DataError

#: The folder of the data files shipped with the package; laid out like ``shared/data`` (one folder per task).
PACKAGE_DATA_DIR = Path(__file__).resolve().parent.parent / "data"

#: Option letters in order; labels of an n-option item are ``LETTERS[:n]``.
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: How an unextractable prediction is shown in feedback ("Incorrect. '?' is wrong."): neutral, names no label.
NO_ANSWER = "?"

# "Answer: B", "**Answer:** B", "answer is (B)", "Final answer - B." The keyword is case-insensitive, the letter is
# not. The letter must stand alone: not followed by a word character or hyphen ("Answer: Because" gives no match).
ANSWER_LETTER_RE = re.compile(r"(?i:\banswer\b)(?:\s*\**\s*(?i:is)\b)?[\s*_:=\-]*[(\[]?\s*([A-Z])(?![\w-])")
# A standalone capital letter: "B", "(B)", "B.", "B)", "'B'", "**B**", "{B}" — not part of a word, a number or a
# hyphenated token ("X-ray", "B12", "Vitamin-A").
STANDALONE_LETTER_RE = re.compile(r"(?<![\w-])([A-Z])(?![\w-])")
# "Answer: yes", "**Answer:** No", "the answer is 'yes'" — all case-insensitive.
ANSWER_YES_NO_RE = re.compile(r"\banswer\b(?:\s*\**\s*is\b)?[\s*_:=\-\"'(\[]*(yes|no)(?![\w-])", re.IGNORECASE)
# A standalone yes/no word ("no.", "Yes,"), not part of "nobody", "no-one" or "yesterday".
STANDALONE_YES_NO_RE = re.compile(r"(?<![\w-])(yes|no)(?![\w-])", re.IGNORECASE)


def extract_letter(completion: str, labels: Sequence[str]) -> str | None:
    """The option letter a completion answers with, or None.

    The last ``Answer: X`` whose X is one of ``labels`` wins; else the last standalone capital letter that is one of
    ``labels``; else None.

    >>> extract_letter("I think B. Answer: C.", ("A", "B", "C", "D"))
    'C'
    >>> extract_letter("a rock is hard", ("A", "B", "C", "D")) is None
    True
    """
    for pattern in (ANSWER_LETTER_RE, STANDALONE_LETTER_RE):
        found = [m.group(1) for m in pattern.finditer(completion) if m.group(1) in labels]
        if found:
            return found[-1]
    return None


def extract_yes_no(completion: str) -> str | None:
    """``"yes"`` / ``"no"`` (lower case) from the last ``Answer: yes/no``, else the last standalone yes/no word.

    >>> extract_yes_no("No, wait. **Answer:** Yes")
    'yes'
    """
    for pattern in (ANSWER_YES_NO_RE, STANDALONE_YES_NO_RE):
        found = pattern.findall(completion)
        if found:
            return found[-1].lower()
    return None


def format_options(labels: Sequence[str], options: Sequence[str]) -> str:
    """One option per line as ``A. text`` (the ``{options}`` field of the appendix templates)."""
    return "\n".join(f"{label}. {text}" for label, text in zip(labels, options))


def letters_phrase(labels: Sequence[str]) -> str:
    """The labels as the templates list them: ``"A, B, C, or D"``; ``"A, B, or C"`` for three options.

    >>> letters_phrase(("A", "B", "C", "D", "E"))
    'A, B, C, D, or E'
    """
    if len(labels) == 1:
        return labels[0]
    return ", ".join(labels[:-1]) + ", or " + labels[-1]


def numeric_to_letters(labels: Sequence[str]) -> tuple[str, ...] | None:
    """Map labels ``"1".."n"`` to ``"A"..`` (ARC's numeric items); None if the labels are not exactly 1..n."""
    if list(labels) == [str(i) for i in range(1, len(labels) + 1)]:
        return tuple(LETTERS[: len(labels)])
    return None


def hint_words(option: str) -> str:
    """The opening of the gold option shown as ``Hint: Consider an answer that starts with "{hint_words}..."``.

    The paper gives "the first 2–3 words" of the correct option (SPEC §2 fixes 3). Under the no-leak decision the
    hint must never be the whole option, so short options get less:

    - 4 words or more: the first 3 words;
    - 2 or 3 words: all words but the last (= the first ⌈n/2⌉ words);
    - 1 word: its first ⌊m/2⌋ characters, m = its length without trailing punctuation ("23" → "2",
      "mitochondria" → "mitoch");
    - a 1-character option ("7", "K."): the empty string — any prefix would be the answer itself;
    - and always shorter still if the hint would hold every letter and digit of the option ("0%" → "").

    >>> hint_words("palms covered with oil")
    'palms covered with'
    >>> hint_words("a rock")
    'a'
    >>> hint_words("7")
    ''
    """
    words = option.split()
    if len(words) >= 4:
        hint = " ".join(words[:3])
    elif len(words) >= 2:
        hint = " ".join(words[:-1])
    else:
        core = option.strip().rstrip(".,;:!?")
        hint = core[: len(core) // 2]
    # Safety net for punctuation: "0%" → "0" or "4 ." → "4" would carry every letter and digit of the answer.
    while hint and alphanumeric(hint) == alphanumeric(option):
        hint = hint[: len(hint) // 2].rstrip()
    return hint


def alphanumeric(text: str) -> str:
    """Lower-cased letters and digits of ``text`` only: how the no-leak check compares a hint with an option."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


def shown_prediction(predicted: str | None) -> str:
    """The prediction as the feedback names it: the label, or ``NO_ANSWER`` (``"?"``) when none was extracted."""
    return NO_ANSWER if predicted is None else predicted


def check_not_correct(predicted: str | None, gold: str, uid: str) -> None:
    """Feedback is only for wrong completions (Alg. 1 line 9); telling a correct answer it is wrong would lie.

    Raises:
        ValueError: ``predicted == gold``.
    """
    if predicted == gold:
        raise ValueError(f"feedback() called for a correct completion of example {uid!r}; only wrong ones get feedback")


def fact_count(n_facts: int) -> int:
    """How many facts the StrategyQA hint shows: max(1, ⌊n/2⌋) (SPEC §2)."""
    return max(1, math.floor(n_facts / 2))


def check_split(split: str, allowed: Iterable[str], task: str) -> None:
    """Raises ValueError naming the allowed splits when ``split`` is not one of them."""
    allowed = tuple(allowed)
    if split not in allowed:
        raise ValueError(f"unknown split {split!r} for task {task}; choose one of: {', '.join(allowed)}")


def data_root(data_dir: str | Path | None) -> Path:
    """``data_dir`` as a Path, or the package's shipped data folder when None."""
    return PACKAGE_DATA_DIR if data_dir is None else Path(data_dir)


def load_hub_split(hub_id: str, split: str, config: str | None = None) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset split as plain dicts. ``datasets`` is imported here, only when asked for.

    Raises:
        DataError: ``datasets`` is not installed or the download failed (names the dataset and the fix).
    """
    try:
        import datasets  # noqa: PLC0415 - optional, heavy, online-only dependency
    except ImportError:
        raise DataError(
            f"{hub_id}: source='hub' needs the 'datasets' package (pip install datasets); "
            "or use source='offline' (the default)"
        ) from None
    try:
        args = (hub_id, config) if config else (hub_id,)
        rows = datasets.load_dataset(*args, split=split)
    except Exception as err:  # network, auth, missing split: one message the user can act on
        raise DataError(f"{hub_id}[{split}]: could not load from the Hugging Face hub ({err}); "
                        "use source='offline' or pass data_dir") from err
    return [dict(row) for row in rows]
