"""StrategyQA: yes/no questions that need implicit multi-step reasoning (Geva et al. 2021), as SPEAR uses it.

Sources: prompt and feedback wording from the paper appendix "Prompt Format" (Prompt Template --- StrategyQA);
feedback and extraction rules from SPEC §2; splits from SPEC §6/§7 (ChilleD/StrategyQA: train 1603, test 687).

A raw record (``ChilleD/StrategyQA`` split, official StrategyQA fields; ``shared/data/strategy_qa/SOURCE.md``)::

    {"qid": "4b82bd6ced332e84006e", "term": "Mixed martial arts", "description": "full contact combat sport",
     "question": "Is Mixed martial arts totally original from Roman Colosseum games?", "answer": false,
     "facts": ["Mixed Martial arts in the UFC takes place in an enclosed structure called The Octagon.",
               "The Roman Colosseum games were fought in enclosed arenas where combatants would fight until the last
                man was standing.",
               "..."],
     "decomposition": ["What are the major features of UFC's Mixed martial arts?", "..."]}

Labels ("yes", "no"), gold "yes" iff ``answer`` is true; ``extra["facts"]`` holds the facts for the feedback.

No-leak handling of facts (SPEC §2 Decision): a fact that contains "yes" or "no" as a standalone word (e.g. "There
is no evidence ...") is skipped, whichever of the two is the gold answer — skipping only gold-word facts would
itself reveal the gold through which facts are missing. The hint shows the first k = max(1, ⌊len(facts)/2⌋) of the
remaining facts (k counted over all facts; fewer if fewer remain). If every fact contains such a word, the first k
facts are shown with the words "yes"/"no" replaced by "[...]". On the shipped data 17 of 2290 questions have such a
fact among their first k, and none has only such facts.

**Decision (IsCorrect, 2026-11-25, issue 16):** only an explicit final answer counts; the rule is
``common.explicit_yes_no`` and the same function judges training (the oracle's ``is_correct``) and evaluation
(``acc_gen``, through ``extract_answer``). Accepted, in this order:

1. a final line that is only "yes" or "no" (any case), lightly decorated ("Yes", "No.", "**no**", "(yes)") — the
   final line being the last line holding a letter or digit (bare markdown such as "```" or "---" after it is
   skipped);
2. else the LAST answer statement of the completion: "Answer:" ("Answer: no", "**Answer:** Yes", "**Answer:
   No**", "Final answer: yes", "... laptops came 2,300 years later. Answer: no") or a sentence opening with "The
   answer is" ("The answer is no.", "Therefore, the answer is: yes"), whose line goes on with "yes" or "no" and
   then nothing but closing marks ("No.", "**yes**", "'no'"). Lines after it may explain it.

Anything else is unparsed (``None``, shown as "?" in the feedback) and wrong: a yes/no met inside the reasoning
("There is no record of Aristotle using a laptop, so we must"), reasoning cut off before any answer statement, a
justification on the answer's line ("Answer: no, because..."; the prompt asks for exactly "Answer: no"), "Answer:
yes/no", "Answer: maybe", the template quoted back ('exactly: "Answer: yes" or "Answer: no".'), "whether the answer
is yes" (no sentence opens there), and a last statement that does not parse even if an earlier one did: the last
statement decides, nothing falls back. Why this strict: a false win enters NLL training and gives α = 1 to a lose
trace that was never fixed, while a missed parse only costs a revision. Known limit: the rule reads text only, so
an answer the budget cut off after its statement, or a repetition loop ("The answer is yes. The answer is yes.
The ...") cut by the budget, still counts; telling those apart needs the caller to say whether the completion
ended with EOS (measured in docs/results/parse-rates). Before 2026-11-25 the fallback took the last standalone
yes/no word anywhere in the text.
"""

from __future__ import annotations

from pathlib import Path

from fedspear.tasks.base import DataError, Example, require
from fedspear.tasks.common import (
    reasons_before_answer,
    STANDALONE_YES_NO_RE,
    check_not_correct,
    explicit_yes_no,
    fact_count,
    load_records,
    shown_prediction,
)

NAME = "strategy_qa"
HUB_ID = "ChilleD/StrategyQA"
TRAIN_SPLIT = "train"
EVAL_SPLIT = "test"
SPLITS = (TRAIN_SPLIT, EVAL_SPLIT)
#: Generation budget per attempt (tokens): the SPEAR authors' 256 (their code; the paper's max sequence length is
#: 1024). The earlier 128 cut step-by-step answers before their final "Answer: yes/no" (issue 16; measured in
#: docs/results/parse-rates).
MAX_NEW_TOKENS = 256
MULTIPLE_CHOICE = False
LABELS = ("yes", "no")
MASK = "[...]"

PROMPT_TEMPLATE = (
    "Answer the following yes/no question by reasoning step by step.\n"
    "Think through the question carefully, then end your response with\n"
    'exactly: "Answer: yes" or "Answer: no" on the final line.\n'
    "\n"
    "[QUESTION]\n"
    "{question}"
)

FEEDBACK_TEMPLATE = (
    "Incorrect. '{predicted_answer}' is not the right answer.\n"
    "\n"
    "Hint --- consider these relevant facts:\n"
    "{facts}\n"
    "\n"
    "Reason through the question step by step, then end your response with\n"
    'exactly: "Answer: yes" or "Answer: no".\n'
    "DO NOT repeat the answer you gave previously."
)


def load(split: str, data_dir: str | Path | None = None, source: str = "offline",
         skipped: list[str] | None = None) -> list[Example]:
    """The StrategyQA ``split`` ("train" or "test", the ChilleD split) as Examples.

    Args:
        split: "train" or "test".
        data_dir: a folder laid out like ``shared/data`` (reads ``data_dir/strategy_qa/<split>.jsonl``); None =
            the copy shipped in ``fedspear/data/strategy_qa`` (complete).
        source: "offline" (files) or "hub" (``datasets.load_dataset("ChilleD/StrategyQA")``).

    Raises:
        ValueError: unknown split or source.
        DataError: missing file or malformed record (names file:line and field).
    """
    return load_records(NAME, split, SPLITS, parse_record, data_dir=data_dir, source=source, skipped=skipped,
                        hub_id=HUB_ID)


def parse_record(record: dict, where: str) -> Example:
    """One record → Example with gold "yes"/"no" and ``extra["facts"]``. ``where`` = "file:line" for errors."""
    uid = require(record, "qid", str, where)
    question = require(record, "question", str, where).strip()
    answer = require(record, "answer", bool, where)
    facts = require(record, "facts", list, where)
    if not question:
        raise DataError(f"{where}: field 'question' is empty")
    if not all(isinstance(fact, str) and fact.strip() for fact in facts):
        raise DataError(f"{where}: field 'facts' has an empty or non-string fact")
    return Example(
        uid=uid,
        question=question,
        labels=LABELS,
        options=(),
        gold="yes" if answer else "no",
        extra={"facts": tuple(fact.strip() for fact in facts)},
    )


def prompt(example: Example) -> str:
    """The initial user message c0 (appendix "Prompt Template --- StrategyQA"). The facts are not shown."""
    return PROMPT_TEMPLATE.format(question=example.question)


def extract_answer(completion: str, example: Example) -> str | None:
    """``"yes"``/``"no"`` of an explicit final answer (module docstring, Decision on IsCorrect), or None.

    >>> example = Example("x", "Did Aristotle use a laptop?", LABELS, (), "no")
    >>> extract_answer("He died in 322 BC; laptops came in the 1980s.\\nAnswer: No", example)
    'no'
    >>> extract_answer("There is no record of Aristotle using a laptop, so we must", example) is None
    True
    """
    return explicit_yes_no(completion)


def is_correct(example: Example, completion: str) -> bool:
    """True when the extracted yes/no is the gold one (an unparsed answer is wrong)."""
    return extract_answer(completion, example) == example.gold


def reasons(completion: str) -> bool:
    """Whether ``completion`` reasons before its final answer: ≥ 10 words before the last answer statement or the
    lone yes/no final line (``common.reasons_before_answer``). The prompt asks for step-by-step reasoning, so a
    bare "Answer: no" is what the guard ``revised_wins = "reasoned"`` keeps out of the win set.

    >>> reasons("Answer: no")
    False
    >>> reasons("Aristotle died in 322 BC, and the first laptops were sold in the 1980s.\\nAnswer: no")
    True
    """
    return reasons_before_answer(completion)


def hint_facts(facts: tuple[str, ...]) -> list[str]:
    """The facts the hint shows (module docstring: skip facts with a standalone yes/no word, keep the first k)."""
    k = fact_count(len(facts))
    clean = [fact for fact in facts if not STANDALONE_YES_NO_RE.search(fact)]
    if clean:
        return clean[:k]
    return [STANDALONE_YES_NO_RE.sub(MASK, fact) for fact in facts[:k]]


def feedback(example: Example, completion: str) -> str:
    """The oracle's feedback for a wrong completion (appendix template; SPEC §2 no-leak decision).

    Names the model's own answer (``?`` if none could be extracted) and lists facts as ``- fact`` lines
    (``hint_facts``). Outside the template's fixed "Answer: yes" / "Answer: no" it never says yes or no.

    Raises:
        ValueError: the completion is correct (feedback is only for wrong answers).
    """
    predicted = extract_answer(completion, example)
    check_not_correct(predicted, example.gold, example.uid)
    return FEEDBACK_TEMPLATE.format(
        predicted_answer=shown_prediction(predicted),
        facts="\n".join(f"- {fact}" for fact in hint_facts(example.extra["facts"])),
    )
