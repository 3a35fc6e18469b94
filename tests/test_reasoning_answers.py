"""Reasoning tasks (MathMCQA, StrategyQA): only an explicit final answer counts (SPEC §2 IsCorrect, issue 16).

The tables list tricky completions and the answer the rule must read (None = unparsed, hence wrong). The rule is in
the task modules' docstrings (Decision of 2026-11-25) and ``fedspear.tasks.common.explicit_answer``. The last tests
check that training judgement (the oracle's ``is_correct`` inside the interaction phase) and evaluation
(``fedspear.evaluation.evaluate``) read the same answer from every string of the tables, with a byte tokenizer and
the generations scripted, and that MathMCQA reports no log-likelihood accuracy.
"""

from __future__ import annotations

import pytest
import torch

from fedspear import evaluation
from fedspear.feedback import OracleFeedback
from fedspear.interaction import interact
from fedspear.tasks import arc_challenge, hellaswag, math_mcqa, strategy_qa
from fedspear.tasks.base import Example
from fedspear.tasks.common import extract_letter, extract_yes_no

# Options of the MathMCQA example every row is judged against: B is 42, C a fraction, D an expression.
MATH_OPTIONS = ("5", "42", r"\frac{1}{2}", "x+1")
MATH = Example(uid="m", question="What is 6 * 7?", labels=math_mcqa.LABELS, options=MATH_OPTIONS, gold="B",
               extra={"solution": r"$6 \cdot 7 = \boxed{42}$", "answer_text": "42"})
SQA = Example(uid="s", question="Did Aristotle use a laptop?", labels=strategy_qa.LABELS, options=(), gold="no",
              extra={"facts": ("Aristotle died in 322 BC.", "The first laptop was made in 1981.")})

MATH_TABLE = [
    # --- the issue's strings: a letter inside the reasoning is not an answer
    ("Let $ABC$ be a triangle and let $D$ be the foot of the altitude from", None),
    ("Option A says 5, option C says 7. Computing: 2+3 =", None),
    # --- the form the prompt asks for, and its markdown spellings
    ("Answer: B", "B"),
    ("6 * 7 = 42, which is option B.\nAnswer: B", "B"),
    ("**Answer:** B", "B"),
    ("**Answer: B**", "B"),
    ("**Answer**: C", "C"),
    ("> **Answer:** D", "D"),
    ("answer: B", "B"),  # the keyword is case-insensitive ...
    ("ANSWER: D", "D"),
    ("Answer: b", None),  # ... the letter is not ("a" is an article)
    ("Final answer: (B)", "B"),
    ("Answer: Option B", "B"),
    ("Answer: B.", "B"),
    ("Answer: \\boxed{C}", "C"),
    ("Thus x = 5. Answer: A", "A"),  # one-paragraph reasoning, the answer closes the line
    # --- "The answer is" opening a sentence
    ("The answer is (B).", "B"),
    ("So the final answer is $\\boxed{B}$.", "B"),
    ("6 * 7 = 42. Therefore, the correct answer is B.", "B"),
    ("The final answer is: **D**", "D"),
    ("We must decide whether the answer is B", None),  # no sentence opens with "the answer is"
    ("Is the answer B?", None),
    ("I think the answer is B, but let me check: 6*7 = 4", None),
    ("the answer is B or C", None),
    # --- LaTeX as Qwen2.5 writes it: "\\(", "\\[" delimiters and a boxed letter
    ("The value is 48. The correct answer is:\n\\[\n\\boxed{A}\n\\]", "A"),
    ("The correct answer is \\(\\boxed{C}\\).", "C"),
    ("so \\( x \\) is \\(\\boxed{42}\\). The correct choice is \\(\\boxed{B}\\).", "B"),
    ("Therefore, the area of \\(\\triangle ABC\\) is \\(\\boxed{D}\\).", "D"),  # a boxed letter is an answer
    ("Therefore, \\( x = \\boxed{42} \\).", None),  # a boxed number is not a letter
    ("The correct answer is B.\nSo the value is \\(\\boxed{42}\\).", "B"),  # a boxed number is passed over
    ("The correct answer is B. So the value is \\(\\boxed{42}\\).", None),  # more words on the answer's line
    ("\\boxed{\\text{B}}", "B"),
    ("The first option is A", None),  # only the final / correct option is a statement
    # --- a number, a non-option, or more words where a lone letter is asked
    ("Answer: 3", None),
    ("Answer: 42", None),  # B's text without the letter
    ("Answer: E", None),
    ("Answer: X", None),  # the template's placeholder
    ("Answer: B12", None),
    ("Answer: Because $x = 5$, A", None),  # the short-answer rule reads A here
    ("Answer: B is wrong because 6*7 is not 41", None),
    ("Answer: B, since 6 * 7 = 42", None),
    ("Answer: B?", None),
    ("Answer: $x+1$", None),
    # --- a letter followed by its own option text, and only its own
    ("Answer: B. 42", "B"),
    ("Answer: (B) $42$", "B"),
    ("Answer: B) 42.", "B"),
    ("Answer: C. \\dfrac{1}{2}", "C"),  # same choice under answer_key
    ("**Answer:** D. $x + 1$", "D"),
    ("Answer: B. 7", None),  # B is 42: contradictory
    # --- several Answer: lines, and lines after the answer
    ("Answer: A\nWait, 6*7 is not 5.\nAnswer: C", "C"),
    ("Answer: A\nAnswer: D\n", "D"),
    ("Answer: A. Answer: C", "C"),  # the last keyword of the final line
    ("Answer: The answer is D.", "D"),
    ("Answer: B\nBecause 6*7 = 42.", "B"),  # lines after the last answer line may explain it
    ("Answer: B\n\nI hope it is correct.", "B"),
    ("Answer: B\nWait, let me check 6*7 again: 6*7 = 4", "B"),  # the text reads only what was stated
    ("Answer: B\nTo check the answer: compute 6*7", None),  # the last keyword decides, and gives no letter
    ('Answer: B\nEnd with exactly: "Answer: X" where X is A, B, C, or D.', "B"),  # a quoted keyword is no answer
    ('Reason step by step, then end your response with exactly:\n"Answer: X" where X is A, B, C, or D.', None),
    # --- a final line that is only the letter
    ("6 * 7 = 42\nB", "B"),
    ("(D)", "D"),
    ("**C**", "C"),
    ("B.", "B"),
    ("$\\boxed{A}$", "A"),
    ("# Answer\n\nB", "B"),
    ("Answer:\n(B)", "B"),
    ("B. 42", None),  # option text on a bare line reads like an echoed option list
    ("A. 5\nB. 42\nC. \\frac{1}{2}\nD. x+1", None),
    # --- truncated reasoning and formulas
    ("Step 1: the area of triangle $ABC$ is 42.\nStep 2: point D lies on", None),
    ("The point D is the midpoint of $BC$.\nAnswer:", None),
    ("Since $f(x) = Ax + B$ and $f(1) = C$, we get", None),
    ("X-ray, Vitamin-A and B12 matter", None),
    # --- whitespace and trailing decoration
    ("Answer: B  \n\n  \n", "B"),
    ("Answer: **B**\n\n```\n", "B"),
    ("Answer: C\n---", "C"),
    ("", None),
]

SQA_TABLE = [
    # --- the issue's string: a yes/no inside the reasoning is not an answer
    ("There is no record of Aristotle using a laptop, so we must", None),
    # --- the form the prompt asks for, and its markdown spellings
    ("Answer: no", "no"),
    ("Answer: No", "no"),
    ("Answer: YES", "yes"),
    ("answer: Yes.", "yes"),
    ("Answer: No!", "no"),
    ("**Answer:** Yes", "yes"),
    ("**Answer: No**", "no"),
    ("**Answer**: no", "no"),
    ("Final answer: no.", "no"),
    ("Answer: \\boxed{no}", "no"),
    ("So the answer is \\(\\boxed{\\text{yes}}\\)", "yes"),
    ("Aristotle died in 322 BC. Laptops came in the 1980s.\nAnswer: no", "no"),
    ("Thinking... Answer: No", "no"),
    ("Yes, but actually no. Answer: yes", "yes"),
    ("No, wait. **Answer:** Yes", "yes"),
    # --- "The answer is" opening a sentence
    ("Therefore, the answer is yes.", "yes"),
    ("The answer is 'no'.", "no"),
    ("So, the final answer is: yes", "yes"),
    ("No one knows whether the answer is yes", None),
    ("Is the answer yes?", None),
    ("The answer is no, since laptops did not exist.", None),
    ("The answer is yes or no depending on the year", None),
    # --- more than the word on the answer line
    ("Answer: no, because laptops did not exist.", None),
    ("Answer: yes/no", None),
    ("Answer: maybe", None),
    ("Answer: no wait yes", None),
    ("Answer: Noah", None),
    ("Answer: Yes-men", None),
    ("Answer: (B)", None),
    # --- several Answer: lines, and lines after the answer
    ("Answer: yes\nWait, that is wrong.\nAnswer: no", "no"),
    ("Answer: yes\nAnswer: no\nAnswer: yes", "yes"),
    ("Answer: no\nHe died long before laptops.", "no"),  # lines after the last answer line may explain it
    ("Answer: No.\n**Explanation:** he lived before laptops.", "no"),
    ("Therefore, the answer is: no\nSoylent does not use pea protein.", "no"),
    ("Answer: no\nTo check the answer: laptops came later", None),  # the last keyword decides
    ('exactly: "Answer: yes" or "Answer: no".', None),  # the feedback's instruction quoted back
    ('Laptops came later.\n"Answer: no"', None),  # a quotation, not a statement (strict: missed, not a false win)
    # known limit (text only): a loop cut off by the budget still states an answer (see the module docstring)
    ("The answer is yes.\n\nThe answer is yes.\n\nThe", "yes"),
    # --- a final line that is only yes / no
    ("Let me think.\nyes", "yes"),
    ("No.", "no"),
    ("**no**", "no"),
    ("(yes)", "yes"),
    ("Yes?", None),
    # --- truncated reasoning, yes/no inside words or sentences
    ("Step 1: Aristotle lived in ancient Greece. No laptops existed then. So", None),
    ("1. Aristotle: 384-322 BC.\n2. Laptops: 1980s.\n3. So no", None),
    ("Nobody knows; yesterday it rained.", None),
    ("Yes, laptops are portable computers. No, Aristotle", None),
    ("Answer:", None),
    # --- whitespace and trailing decoration
    ("Answer: no  \n\n", "no"),
    ("Answer: no\n\n---\n", "no"),
    ("Answer: yes\n```", "yes"),
    ("", None),
]


def test_tables_have_30_strings_per_task():
    assert len(MATH_TABLE) >= 30 and len(SQA_TABLE) >= 30
    assert len({c for c, _ in MATH_TABLE}) == len(MATH_TABLE) and len({c for c, _ in SQA_TABLE}) == len(SQA_TABLE)


@pytest.mark.parametrize(("completion", "expected"), MATH_TABLE)
def test_math_mcqa_reads_only_an_explicit_final_answer(completion, expected):
    assert math_mcqa.extract_answer(completion, MATH) == expected
    assert math_mcqa.is_correct(MATH, completion) == (expected == MATH.gold)


@pytest.mark.parametrize(("completion", "expected"), SQA_TABLE)
def test_strategy_qa_reads_only_an_explicit_final_answer(completion, expected):
    assert strategy_qa.extract_answer(completion, SQA) == expected
    assert strategy_qa.is_correct(SQA, completion) == (expected == SQA.gold)


def test_the_issue_strings_were_false_answers_under_the_short_answer_rule():
    """The lenient rule, kept for ARC-Challenge and HellaSwag, reads D, C and "no" from these; the new rule nothing."""
    cases = [("Let $ABC$ be a triangle and let $D$ be the foot of the altitude from", "D"),
             ("Option A says 5, option C says 7. Computing: 2+3 =", "C")]
    for text, lenient in cases:
        assert extract_letter(text, MATH.labels) == lenient
        assert arc_challenge.extract_answer(text, MATH) == hellaswag.extract_answer(text, MATH) == lenient
        assert math_mcqa.extract_answer(text, MATH) is None
    aristotle = "There is no record of Aristotle using a laptop, so we must"
    assert extract_yes_no(aristotle) == "no" and strategy_qa.extract_answer(aristotle, SQA) is None


def test_unparsed_answers_show_a_question_mark_in_the_feedback():
    text = "Let $ABC$ be a triangle and let $D$ be the foot of the altitude from"
    assert math_mcqa.feedback(MATH, text).startswith("Incorrect. Your answer '?' is wrong.")
    assert strategy_qa.feedback(SQA, "There is no record of it, so").startswith("Incorrect. '?' is not the right")
    assert math_mcqa.feedback(MATH, "Answer: C").startswith("Incorrect. Your answer 'C' is wrong.")


def test_budgets_are_the_authors():
    """Issue 16: the authors' 512 (MathMCQA) and 256 (StrategyQA) new tokens; no log-likelihood accuracy for
    MathMCQA (its first answer token is the start of the reasoning)."""
    assert (math_mcqa.MAX_NEW_TOKENS, strategy_qa.MAX_NEW_TOKENS) == (512, 256)
    assert not math_mcqa.MULTIPLE_CHOICE and not strategy_qa.MULTIPLE_CHOICE
    assert arc_challenge.MULTIPLE_CHOICE and hellaswag.MULTIPLE_CHOICE


# --- training judgement and evaluation read the same answer -----------------------------------------------------


class ByteTokenizer:
    """Bytes are tokens (0–255), EOS = 256; no chat template. Decoding gives back exactly the text encoded."""

    chat_template = None
    eos_token_id = pad_token_id = 256

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8")


def scripted_generate(texts: list[str]):
    """A stand-in for ``fedspear.runtime.generation.generate`` that returns ``texts`` (+ EOS) in order."""
    tok = ByteTokenizer()

    def generate(model, tokenizer, contexts, **kwargs):
        assert len(contexts) == len(texts)
        return [tok.encode(t) + [tok.eos_token_id] for t in texts]

    return generate


@pytest.mark.parametrize(("task", "template", "table"), [(math_mcqa, MATH, MATH_TABLE),
                                                         (strategy_qa, SQA, SQA_TABLE)])
@pytest.mark.parametrize("gold_is_expected", [True, False])
def test_training_judgement_and_evaluation_agree_on_the_whole_table(task, template, table, gold_is_expected,
                                                                    monkeypatch):
    """One example per row. With gold = the expected answer, exactly the parsed rows are wins in the interaction
    phase (the oracle's verdict on y0) and correct in evaluation (``correct_gen``); with gold = another label,
    none is."""
    tok = ByteTokenizer()
    examples = []
    for i, (_, expected) in enumerate(table):
        other = next(label for label in template.labels if label != expected)
        gold = expected if gold_is_expected and expected is not None else other
        examples.append(Example(f"{task.NAME}-{i}", template.question, template.labels, template.options, gold,
                                template.extra))
    texts = [completion for completion, _ in table]
    monkeypatch.setattr(evaluation, "generate", scripted_generate(texts))
    evaluated = evaluation.evaluate(None, tok, examples, task, loglik=True)
    result = interact(None, tok, examples, task, OracleFeedback(task), max_revisions=0,
                      replay=[[tok.encode(t) + [tok.eos_token_id]] for t in texts])
    trained = "".join("1" if ex.uid in {w.uid for w in result.wins} else "0" for ex in examples)
    expected = "".join("1" if gold_is_expected and e is not None else "0" for _, e in table)
    assert evaluated["correct_gen"] == trained == expected
    assert evaluated["parsed_gen"] == pytest.approx(sum(e is not None for _, e in table) / len(table))
    assert evaluated["cutoff_gen"] == 0  # every scripted answer ends with EOS
    assert "acc_ll" not in evaluated  # neither task reports log-likelihood accuracy


def test_evaluation_reports_the_share_of_answers_cut_off_by_the_budget(monkeypatch):
    """``cutoff_gen``: answers with no EOS (stopped by the budget), here 2 of 4; a cut answer whose text states an
    answer still counts (the text-only limit of the module docstrings) while a cut reasoning does not parse."""
    tok = ByteTokenizer()
    texts = ["Answer: no", "Laptops came later. So the answer", "Answer: no", "The answer is no.\nThe answer is no."]
    ends = [[tok.eos_token_id], [], [tok.eos_token_id], []]
    monkeypatch.setattr(evaluation, "generate",
                        lambda model, tokenizer, contexts, **kw: [tok.encode(t) + e for t, e in zip(texts, ends)])
    examples = [Example(f"s{i}", SQA.question, SQA.labels, (), "no", SQA.extra) for i in range(4)]
    out = evaluation.evaluate(None, tok, examples, strategy_qa, loglik=False)
    assert out["cutoff_gen"] == 0.5 and out["parsed_gen"] == 0.75 and out["correct_gen"] == "1011"


@pytest.mark.parametrize(("task", "loglik", "wants_logits"), [(strategy_qa, True, False), (math_mcqa, True, False),
                                                              (arc_challenge, True, True),
                                                              (arc_challenge, False, False)])
def test_evaluation_asks_for_first_step_logits_only_when_it_scores_them(task, loglik, wants_logits, monkeypatch):
    """Generation keeps every step's logits when asked for the first ones: only log-likelihood scoring asks, and
    the batch size reaches the generator."""
    tok = ByteTokenizer()
    seen = {}

    def generate(model, tokenizer, contexts, *, first_logits=None, first_columns=None, batch_size=None, **kwargs):
        seen.update(first_logits=first_logits, batch_size=batch_size)
        assert (first_columns is None) == (first_logits is None)  # label tokens only, when scored
        if first_logits is not None:
            first_logits.extend(torch.zeros(len(columns)) for columns in first_columns)
        return [tok.encode("Answer: A") + [tok.eos_token_id] for _ in contexts]

    monkeypatch.setattr(evaluation, "generate", generate)
    example = MATH if task is not strategy_qa else SQA
    out = evaluation.evaluate(None, tok, [example], task, loglik=loglik, batch_size=7)
    assert (seen["first_logits"] is not None) == wants_logits and seen["batch_size"] == 7
    assert ("acc_ll" in out) == wants_logits
