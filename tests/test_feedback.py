"""The oracle feedback (SPEC §2): template wording, and NO LEAKS on every shipped record of every task.

Each feedback text is matched against its task's template (fixed wording + fields), so the only free text is in
the fields; the fields are then checked:

- predicted letter / answer: the model's own wrong label or "?", never the gold;
- ARC / HellaSwag hint words: a prefix of the gold option that never carries all of its letters and digits, and the
  gold option text appears nowhere in the feedback unless the fixed wording itself contains it (e.g. "a");
- MathMCQA hint: a prefix of the solution with boxes removed, ≤ 3 lines and ≤ 300 characters, not containing the
  gold answer (whitespace ignored);
- StrategyQA facts: 1..max(1, ⌊n/2⌋) of the record's facts, none with a standalone "yes"/"no".
"""

from __future__ import annotations

import re
import string

import pytest

from fedspear.feedback import FeedbackSource, OracleFeedback
from fedspear.tasks import TASKS, get_task, math_mcqa, strategy_qa
from fedspear.tasks.base import Example
from fedspear.tasks.common import STANDALONE_YES_NO_RE, alphanumeric, fact_count, letters_phrase

SPLITS = [(name, split) for name, task in TASKS.items() for split in (task.TRAIN_SPLIT, task.EVAL_SPLIT)]
NO_ANSWER_COMPLETION = "I am not sure."


def template_regex(template: str) -> re.Pattern[str]:
    """The template as a full-match regex: fixed text escaped, each ``{field}`` a named group."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(f"(?P<{field}>.*?)")
    return re.compile("".join(parts), re.DOTALL)


def fixed_text(template: str) -> str:
    """The template's fixed wording (every field empty)."""
    return template.format(**{f: "" for _, f, _, _ in string.Formatter().parse(template) if f})


def wrong_completions(example: Example) -> list[tuple[str, str]]:
    """(completion, the prediction the feedback should name) for every wrong label, plus one without an answer."""
    return [(f"Answer: {label}", label) for label in example.labels if label != example.gold] + [
        (NO_ANSWER_COMPLETION, "?")
    ]


def check_choice_hint(example: Example, fields: dict, fixed: str, text: str) -> None:
    gold_option = example.options[example.gold_index]
    hint = fields["hint_words"]
    assert gold_option.startswith(hint), (example.uid, hint)
    assert alphanumeric(hint) != alphanumeric(gold_option), (example.uid, hint)
    assert gold_option not in text or gold_option in fixed, example.uid


def check_math_hint(example: Example, fields: dict) -> None:
    hint = fields["hint_lines"]
    solution = math_mcqa.remove_boxed(example.extra["solution"])
    assert solution.lstrip().startswith(hint), example.uid
    assert len(hint) <= 300 and hint.count("\n") <= 2, example.uid
    no_space = re.sub(r"\s+", "", hint)
    assert re.sub(r"\s+", "", example.extra["answer_text"]) not in no_space, example.uid
    assert re.sub(r"\s+", "", math_mcqa.last_boxed(example.extra["solution"])) not in no_space, example.uid


def check_facts(example: Example, fields: dict) -> None:
    lines = fields["facts"].split("\n")
    facts = example.extra["facts"]
    assert 1 <= len(lines) <= fact_count(len(facts)), example.uid
    for line in lines:
        assert line.startswith("- "), example.uid
        assert line[2:] in facts or strategy_qa.MASK in line, example.uid
        assert not STANDALONE_YES_NO_RE.search(line[2:]), (example.uid, line)  # neither gold nor the other word


@pytest.mark.parametrize(("name", "split"), SPLITS)
def test_no_leak_on_every_shipped_record(name, split):
    task = get_task(name)
    oracle = OracleFeedback(task)
    pattern, fixed = template_regex(task.FEEDBACK_TEMPLATE), fixed_text(task.FEEDBACK_TEMPLATE)
    examples = task.load(split)
    assert examples
    for example in examples:
        for completion, predicted in wrong_completions(example):
            assert not oracle.is_correct(example, completion)
            text = oracle.feedback(example, completion)
            match = pattern.fullmatch(text)
            assert match, (example.uid, text)
            fields = match.groupdict()
            shown = fields.get("predicted_letter", fields.get("predicted_answer"))
            assert shown == predicted and shown != example.gold, example.uid
            if "letters" in fields:
                assert fields["letters"] == letters_phrase(example.labels)
            if "hint_words" in fields:
                check_choice_hint(example, fields, fixed, text)
            if "hint_lines" in fields:
                check_math_hint(example, fields)
            if "facts" in fields:
                check_facts(example, fields)
        assert oracle.is_correct(example, f"Answer: {example.gold}"), example.uid


FIXED_LINES = {
    "arc_challenge": ["Incorrect. '", "' is wrong.\n\nHint: Consider an answer that starts with \"",
                      "...\"\nConsider the underlying scientific principle.\n\n"
                      "Answer with exactly one letter: A, B, C, or D.\nDO NOT choose the answer you used previously."],
    "hellaswag": ["Incorrect. '", "' is wrong.\n\nHint: Consider an answer that starts with \"",
                  "...\"\nChoose the most natural continuation.\n\n"
                  "Answer with exactly one letter: A, B, C, or D.\nDO NOT choose the answer you used previously."],
    "math_mcqa": ["Incorrect. Your answer '", "' is wrong.\n\nHint --- consider these opening steps of the solution:\n",
                  "\n\nReason step by step, then end your response with exactly:\n"
                  "\"Answer: X\" where X is A, B, C, or D.\nDO NOT repeat the letter you used previously."],
    "strategy_qa": ["Incorrect. '", "' is not the right answer.\n\nHint --- consider these relevant facts:\n",
                    "\n\nReason through the question step by step, then end your response with\n"
                    "exactly: \"Answer: yes\" or \"Answer: no\".\nDO NOT repeat the answer you gave previously."],
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_feedback_has_the_appendix_wording(name):
    task = get_task(name)
    example = next(e for e in task.load(task.EVAL_SPLIT) if len(e.labels) in (2, 4))
    wrong = next(label for label in example.labels if label != example.gold)
    text = task.feedback(example, f"Answer: {wrong}")
    position = 0
    for piece in FIXED_LINES[name]:
        found = text.find(piece, position)
        assert found >= position, (piece, text)
        position = found + len(piece)
    assert text.endswith(FIXED_LINES[name][-1])
    assert text.startswith(FIXED_LINES[name][0] + wrong + FIXED_LINES[name][1])


def test_arc_feedback_example():
    example = get_task("arc_challenge").load("train")[0]  # gold A = "dry palms"
    assert OracleFeedback(get_task("arc_challenge")).feedback(example, "Answer: C") == (
        "Incorrect. 'C' is wrong.\n"
        "\n"
        'Hint: Consider an answer that starts with "dry..."\n'
        "Consider the underlying scientific principle.\n"
        "\n"
        "Answer with exactly one letter: A, B, C, or D.\n"
        "DO NOT choose the answer you used previously."
    )


def test_strategy_qa_facts_with_yes_or_no_are_skipped_symmetrically():
    facts = ("There is no record of it.", "Rome fell in 476.", "Yes-men are common.", "Iron rusts.")
    for gold in ("yes", "no"):
        example = Example(uid="s", question="q?", labels=("yes", "no"), options=(), gold=gold, extra={"facts": facts})
        wrong = "no" if gold == "yes" else "yes"
        text = strategy_qa.feedback(example, f"Answer: {wrong}")
        assert "- Rome fell in 476.\n- Yes-men are common.\n\n" in text  # "Yes-men" is not the word "yes"
        assert "There is no record" not in text
    only = Example(uid="t", question="q?", labels=("yes", "no"), options=(), gold="no",
                   extra={"facts": ("No, it is not.", "Yes it is.")})
    assert "- [...], it is not.\n\n" in strategy_qa.feedback(only, "Answer: yes")


def test_feedback_for_a_correct_completion_is_refused():
    task = get_task("hellaswag")
    example = task.load("validation")[0]
    with pytest.raises(ValueError, match="correct completion"):
        OracleFeedback(task).feedback(example, f"Answer: {example.gold}")


def test_feedback_source_protocol():
    assert all(isinstance(OracleFeedback(task), FeedbackSource) for task in TASKS.values())

    class Grader:
        def is_correct(self, example, completion):
            return True

        def feedback(self, example, completion):
            return "try again"

    class Judge:
        def is_correct(self, example, completion):
            return True

    assert isinstance(Grader(), FeedbackSource)
    assert not isinstance(Judge(), FeedbackSource)
