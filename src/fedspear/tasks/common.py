"""Helpers several task modules share: answer extraction, option rendering, hint words, data paths.

Two extraction rules (SPEC §2 "IsCorrect"):

- **Short-answer rule** (``extract_letter`` / ``extract_yes_no``; ARC-Challenge and HellaSwag, whose prompts ask for
  one letter and whose budget is 16 tokens): the last ``Answer: X`` wins, else the last standalone answer token,
  else no answer.
- **Explicit final answer** (``explicit_letter`` / ``explicit_yes_no``; MathMCQA and StrategyQA, whose prompts ask
  for reasoning that ends with "Answer: X"): only an answer stated explicitly counts — a final line that is only
  the label, else the last "Answer: X" / "The answer is X" of the completion with X standing alone; a letter or
  yes/no met inside the reasoning, or reasoning cut off before any answer statement, gives no answer. The accepted
  forms are listed in ``explicit_answer`` and in each task's docstring.

Both rules match letters case-SENSITIVELY (uppercase only), so the English article "a" is never read as option A;
yes/no is matched case-insensitively. Only labels of the example count: an "E" in a four-option item, or the
pronoun "I", is not an answer.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from fedspear.tasks.base import DataError, Example, collect, read_jsonl

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


# --- Explicit final answers (reasoning tasks) -------------------------------------------------------------------
# The final line (``final_line``) if it is a lone label; else the last answer keyword of the completion
# (``FINAL_KEYWORD_RE``), after which the rest of its line must be a lone label (``*_REST_RE``).

# A line with a letter or a digit: lines of bare decoration after the answer ("```", "---", "**", "$$") are skipped.
CONTENT_LINE_RE = re.compile(r"[^\W_]")
# The answer keyword, case-insensitive, within one line; its label follows it on the same line. Three forms:
# - "answer:" anywhere ("Answer: B", "**Answer:** B", "**Answer**: B", "Final answer: B", "Thinking... Answer: no").
#   A quoted '"Answer: no"' is the template quoted back (the feedback ends 'exactly: "Answer: yes" or "Answer:
#   no".'), not an answer;
# - "answer is" / "choice is" / "option is" opening a sentence (at a line start or after ". ", ": " ...), after an
#   optional connective, "the" and "final"/"correct" ("The answer is (B).", "So, the final answer is: no", "... 322
#   BC. Therefore, the answer is no.", "The correct choice is \(\boxed{B}\)."). "Whether the answer is yes" is no
#   keyword: no sentence opens there;
# - "\boxed" around a lone capital letter or yes/no ("the area of ABC is \(\boxed{D}\)."): the conventional mark of
#   a final answer in maths. A box around anything else ("\boxed{45}") is no keyword and is passed over.
FINAL_KEYWORD_RE = re.compile(
    r"(?i:(?<![\"'`“‘])\banswer\b[ \t*_]*:"
    r"|(?:^|(?<=[.!;:])[ \t])[ \t*_#>]*"
    r"(?:(?:so|thus|therefore|hence|overall|in[ \t]+conclusion|in[ \t]+summary)[ \t]*,?[ \t*_]*)?"
    r"(?:the[ \t]+)?(?:(?:final|correct)[ \t]+)?(?:answer|choice|option)[ \t*_]+is\b[ \t*_]*:?"
    r"|\\boxed[ \t]*(?=\{[ \t]*(?:(?-i:[A-Z])|yes|no)[ \t]*\}))",
    re.MULTILINE,
)
# What may open a label, repeated: markdown emphasis, quotes, brackets, "$", the LaTeX math delimiters "\(" and
# "\[", and LaTeX wrappers ("\boxed{", "\text{").
LABEL_OPEN = r"""(?:[ \t*_"'`(\[{$]|\\[(\[]|\\(?:boxed|text|textbf|mathrm|mathbf)[ \t]*\{)*"""
# What may close a label: the same marks mirrored ("\)" and "\]" included), and a full stop or "!" (not "?" nor
# ",": "yes?" asks, "no, but" goes on).
LABEL_CLOSE = r"""(?:[ \t*_"'`)\]}$.!]|\\[)\]])*"""
# A letter, optionally called "option B" / "choice B"; "tail" is whatever follows the letter and its closing marks
# on its line (allowed only when it is that option's own text, see ``explicit_letter``). The letter must stand
# alone: "Because" or "B12" is not B.
LETTER_REST_RE = re.compile(
    rf"{LABEL_OPEN}(?:(?i:option|choice)[ \t]*[ \t(]*)?(?P<label>[A-Z])(?![^\W_]){LABEL_CLOSE}(?P<tail>.*)"
)
# yes / no (any case); "tail" must be empty (``explicit_yes_no``).
YES_NO_REST_RE = re.compile(rf"{LABEL_OPEN}(?P<label>(?i:yes|no))(?![^\W_]){LABEL_CLOSE}(?P<tail>.*)")
# Separators between a letter and its option text: "B. 42", "B) 42", "(B) 42", "B: 42", "B - 42".
OPTION_SEPARATOR = " \t*_\"'`)]}$.:,-–—"
# Decoration around option text that does not change it ("**$42$**.").
OPTION_DECORATION = " \t*_\"'`$.!"


def final_line(completion: str) -> str:
    """The last line of ``completion`` that holds a letter or digit, stripped ("" if there is none).

    >>> final_line("Step 1.\\nAnswer: B\\n```\\n\\n")
    'Answer: B'
    """
    for line in reversed(completion.splitlines()):
        if CONTENT_LINE_RE.search(line):
            return line.strip()
    return ""


def explicit_answer(completion: str, rest_re: re.Pattern[str]) -> tuple[str, str, bool] | None:
    """The label an explicit final answer gives, as ``(label, tail, keyword)``, or None.

    Accepted forms, in this order:

    1. the final line (``final_line``) is a label with light decoration and nothing else ("B", "(B)", "**B**",
       "B.", "\\boxed{B}", "Yes."): ``keyword = False``, ``tail = ""``;
    2. else the LAST answer keyword of the whole completion (``FINAL_KEYWORD_RE``: "Answer:", "The answer is"),
       and the rest of its line must be a label that ``rest_re`` accepts: ``keyword = True``, ``tail`` = the text
       after the label and its closing marks on that line. Lines after it may hold anything but another keyword
       (an explanation, "I hope it is correct").

    The last keyword decides: if its label does not parse ("Answer: 3", "Answer: Because...", a keyword cut off
    at the end of the text), the result is None, and nothing falls back to an earlier keyword or to a label met
    elsewhere in the text.
    """
    line = final_line(completion)
    if not FINAL_KEYWORD_RE.search(line):
        match = rest_re.fullmatch(line)
        if match and not match["tail"].strip():
            return match["label"], "", False
    keywords = list(FINAL_KEYWORD_RE.finditer(completion))
    if not keywords:
        return None
    rest = completion[keywords[-1].end() :].split("\n", 1)[0].strip()
    match = rest_re.fullmatch(rest)
    return (match["label"], match["tail"].strip(), True) if match else None


#: Words (``\w+`` runs: words and numbers) an answer must hold before its final answer to count as reasoned: about
#: one sentence. A bare "Answer: no" has 0, "Rome had no octagon cage. Answer: no" 5, a step-by-step answer of the
#: base Qwen2.5-Coder-1.5B on StrategyQA 60–150.
MIN_REASONING_WORDS = 10
WORD_RE = re.compile(r"\w+")


def words_before_answer(completion: str) -> int:
    """How many words (``WORD_RE``) a completion writes before its final answer.

    The final answer starts at the last answer keyword (``FINAL_KEYWORD_RE``: "Answer:", "So the answer is",
    "\\boxed{"), else at the final line (``final_line``) when that line is short (≤ 3 words: a lone "No." or "B"),
    else nowhere: a completion without a final answer counts every word (it reasoned, or rambled, without
    concluding; whether an answer was read is the parse rate's business).

    >>> words_before_answer("Answer: no")
    0
    >>> words_before_answer("Aristotle died in 322 BC. Laptops came in the 1980s.\\nSo the answer is no.")
    10
    """
    keywords = list(FINAL_KEYWORD_RE.finditer(completion))
    if keywords:
        return len(WORD_RE.findall(completion[: keywords[-1].start()]))
    last = final_line(completion)
    if last and len(WORD_RE.findall(last)) <= 3:
        return len(WORD_RE.findall(completion[: completion.rfind(last)]))
    return len(WORD_RE.findall(completion))


def reasons_before_answer(completion: str, min_words: int = MIN_REASONING_WORDS) -> bool:
    """Whether a completion reasons before its final answer: at least ``min_words`` words before it
    (``words_before_answer``). The rule the task modules' ``reasons`` share.

    >>> reasons_before_answer("Answer: yes")
    False
    """
    return words_before_answer(completion) >= min_words


def explicit_letter(completion: str, labels: Sequence[str], options: Sequence[str] = (),
                    option_key: Callable[[str], str] | None = None) -> str | None:
    """The option letter of an explicit final answer (``explicit_answer``), or None.

    The letter must be one of ``labels`` (case-sensitive). After "Answer: B" the line may go on only with that
    option's own text ("Answer: B. 42", "Answer: (B) $\\frac{1}{2}$"), compared under ``option_key`` once the
    separator and decoration are stripped (default: ``alphanumeric``); anything else ("Answer: B is wrong",
    "Answer: B. 7" when B is 42) gives None. A bare final line may hold the letter alone, never option text (an
    echoed "B. 42" is not an answer).

    >>> explicit_letter("2+3 = 5, option B.\\nAnswer: **B**", ("A", "B", "C", "D"))
    'B'
    >>> explicit_letter("Let $ABC$ be a triangle and let $D$ be the foot of the altitude from", "ABCD") is None
    True
    """
    found = explicit_answer(completion, LETTER_REST_RE)
    if found is None or found[0] not in labels:
        return None
    label, tail, _ = found
    if not tail:
        return label
    if len(options) != len(labels):
        return None
    text = tail.lstrip(OPTION_SEPARATOR).strip(OPTION_DECORATION)
    option = options[list(labels).index(label)]
    key = option_key or alphanumeric
    return label if text and key(text) == key(option) else None


def explicit_yes_no(completion: str) -> str | None:
    """``"yes"`` / ``"no"`` (lower case) of an explicit final answer (``explicit_answer``), or None.

    Nothing may follow the word but closing marks: "Answer: no, because..." gives None.

    >>> explicit_yes_no("Laptops came 2,300 years later.\\nAnswer: No.")
    'no'
    >>> explicit_yes_no("There is no record of Aristotle using a laptop, so we must") is None
    True
    """
    found = explicit_answer(completion, YES_NO_REST_RE)
    return found[0].lower() if found and not found[1] else None


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


def option_hint_feedback(template: str, example: Example, predicted: str | None) -> str:
    """The oracle's feedback on a wrong option letter (ARC-Challenge, HellaSwag; SPEC §2 no-leak decision):
    ``template`` filled with the model's own letter (``?`` if none could be extracted), the opening words of the gold
    option (:func:`hint_words`: never the whole option) and the letters; never the gold letter.

    Raises:
        ValueError: ``predicted`` is the gold letter (feedback is only for wrong answers).
    """
    check_not_correct(predicted, example.gold, example.uid)
    return template.format(
        predicted_letter=shown_prediction(predicted),
        hint_words=hint_words(example.options[example.gold_index]),
        letters=letters_phrase(example.labels),
    )


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


def load_records(task: str, split: str, splits: Iterable[str], parse: Callable[..., Example], *,
                 data_dir: str | Path | None, source: str, skipped: list[str] | None, hub_id: str,
                 hub_config: str | None = None, file_name: str | None = None,
                 extra: Callable[[str, int], tuple] = lambda split, index: ()) -> list[Example]:
    """The body every task's ``load`` shares: check ``split``, read the hub split (``source="hub"``) or the offline
    JSON Lines file ``data_root(data_dir)/<task>/<file_name or split.jsonl>``, and parse each record with
    ``parse(record, where, *extra(split, index))`` (``where``: "file:line" or "hub_id[split]:index" for errors).

    Raises:
        ValueError: unknown split or source.
        DataError: missing file or malformed record (names file:line and field), unless ``skipped`` collects them.
    """
    check_split(split, splits, task)
    if source == "hub":
        rows = load_hub_split(hub_id, split, hub_config)
        return collect(parse, ((row, f"{hub_id}[{split}]:{i}", *extra(split, i)) for i, row in enumerate(rows)),
                       skipped)
    if source != "offline":
        raise ValueError(f"unknown source {source!r}; choose one of: offline, hub")
    path = data_root(data_dir) / task / (file_name or f"{split}.jsonl")
    records = read_jsonl(path, skipped)
    return collect(parse, ((record, f"{path}:{n}", *extra(split, n)) for n, record in records), skipped)


def load_hub_split(hub_id: str, split: str, config: str | None = None) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset split as plain dicts. ``datasets`` is imported here, only when asked for.

    Raises:
        DataError: ``datasets`` is not installed or the download failed (names the dataset and the fix).
    """
    try:
        import datasets  # noqa: PLC0415 - optional, heavy, online-only dependency
    except ImportError:
        raise DataError(
            f"{hub_id}: data_source = \"hub\" needs the 'datasets' package (pip install datasets); "
            "or use data_source = \"offline\" (the default)"
        ) from None
    try:
        args = (hub_id, config) if config else (hub_id,)
        rows = datasets.load_dataset(*args, split=split)
    except Exception as err:  # network, auth, missing split: one message the user can act on
        raise DataError(f"{hub_id}[{split}]: could not load from the Hugging Face hub ({err}); "
                        "use data_source = \"offline\" (the default) or data_dir") from err
    return [dict(row) for row in rows]
