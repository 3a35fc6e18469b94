"""Task modules: answer extraction, prompt templates, loading and validation, the offline math_mcqa derivation.

Stdlib + pytest only. Tests that read the full copies in ``shared/data`` skip when that folder is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedspear.tasks import TASKS, arc_challenge, get_task, hellaswag, math_mcqa, strategy_qa
from fedspear.tasks.base import DataError, Example
from fedspear.tasks.common import PACKAGE_DATA_DIR, extract_letter, extract_yes_no, hint_words
from shared_dir import SHARED, needs_shared

SHARED_DATA = SHARED / "data"

ABCD = ("A", "B", "C", "D")


# --- extraction ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("completion", "labels", "expected"),
    [
        ("a rock is hard", ABCD, None),  # the article "a" is never option A
        ("Answer: B. Because the others are wrong", ABCD, "B"),
        ("Answer: B, since friction heats them", ABCD, "B"),
        ("**Answer:** C", ABCD, "C"),
        ("Final answer: **B**", ABCD, "B"),
        ("Answer: A\nOn reflection that is wrong.\nAnswer: D", ABCD, "D"),  # last Answer wins
        ("The answer is (D)", ABCD, "D"),
        ("the answer is B", ABCD, "B"),
        ("B", ABCD, "B"),
        (" B", ABCD, "B"),  # the prompt ends with "Answer:" so completions often start with a space
        ("(B)", ABCD, "B"),
        ("B.", ABCD, "B"),
        ("B)", ABCD, "B"),
        ("'B' is wrong, so 'C'", ABCD, "C"),
        ("I think it is C.", ABCD, "C"),  # "I" is not a label
        ("A. dry palms\nB. wet palms\nAnswer: B", ABCD, "B"),
        ("Answer: Because of friction, A", ABCD, "A"),  # "Because" is not the letter B
        ("Answer: E", ABCD, None),  # a letter outside the labels is not an answer
        ("Answer: E. Otherwise B", ABCD, "B"),
        ("Answer: E", ("A", "B", "C", "D", "E"), "E"),
        ("Answer: D", ("A", "B", "C"), None),
        ("answer: b", ABCD, None),  # letters are case-sensitive
        ("X-ray, Vitamin-A and B12 matter", ABCD, None),
        ("\\boxed{C}", ABCD, "C"),
        ("", ABCD, None),
    ],
)
def test_extract_letter(completion, labels, expected):
    assert extract_letter(completion, labels) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("answer: Yes", "yes"),
        ("no.", "no"),
        ("NO", "no"),
        ("**Answer:** No", "no"),
        ("Yes, but actually no. Answer: yes", "yes"),  # the Answer line beats an earlier bare "no"
        ("Answer: yes\nWait, that is wrong.\nAnswer: no", "no"),
        ("The answer is 'yes'.", "yes"),
        ("Answer: yes. No doubt about it.", "yes"),  # Answer line wins over a later bare "No"
        ("Nobody knows; yesterday it rained.", None),
        ("I am not sure", None),
        ("", None),
    ],
)
def test_extract_yes_no(completion, expected):
    assert extract_yes_no(completion) == expected


def test_is_correct_uses_the_example_labels():
    example = Example(uid="x", question="q", labels=("A", "B", "C"), options=("a", "b", "c"), gold="C")
    assert arc_challenge.is_correct(example, "Answer: C")
    assert not arc_challenge.is_correct(example, "Answer: D")
    sqa = Example(uid="y", question="q", labels=("yes", "no"), options=(), gold="no")
    assert strategy_qa.is_correct(sqa, "Thinking... Answer: No")
    assert not strategy_qa.is_correct(sqa, "Answer: yes")


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("palms covered with lotion", "palms covered with"),  # >= 4 words: first 3 (SPEC §2)
        ("The refrigerator door is smooth.", "The refrigerator door"),
        ("a rock", "a"),  # 2-3 words: all but the last
        ("wet dry palms", "wet dry"),
        ("mitochondria", "mitoch"),  # 1 word: half its characters
        ("23", "2"),
        ("7", ""),  # nothing can be shown without showing everything
        ("K.", ""),
        ("0%", ""),  # "0" would carry every letter and digit of the option
    ],
)
def test_hint_words_never_the_whole_option(option, expected):
    assert hint_words(option) == expected


# --- ARC labels ------------------------------------------------------------------------------------------------

def test_arc_numeric_labels_map_to_letters_on_a_real_record():
    raw = [json.loads(line) for line in (PACKAGE_DATA_DIR / "arc_challenge" / "train.jsonl").open(encoding="utf-8")]
    index = next(i for i, r in enumerate(raw) if r["choices"]["label"] == ["1", "2", "3", "4"])
    record = raw[index]
    example = arc_challenge.load("train")[index]
    assert example.uid == record["id"]
    assert example.labels == ABCD
    assert example.gold == "ABCD"[int(record["answerKey"]) - 1]
    assert example.options[example.gold_index] == record["choices"]["text"][int(record["answerKey"]) - 1].strip()
    assert "A. " + example.options[0] in arc_challenge.prompt(example)
    assert "1. " not in arc_challenge.prompt(example).split("[OPTIONS]")[1]


def test_arc_three_and_five_option_items_keep_their_letters():
    test = arc_challenge.load("test")
    three = next(e for e in test if len(e.labels) == 3)
    five = next(e for e in test if len(e.labels) == 5)
    assert three.labels == ("A", "B", "C") and five.labels == ("A", "B", "C", "D", "E")
    assert "Respond with ONLY the letter (A, B, or C)." in arc_challenge.prompt(three)
    assert "Respond with ONLY the letter (A, B, C, D, or E)." in arc_challenge.prompt(five)
    wrong = next(label for label in three.labels if label != three.gold)
    assert "Answer with exactly one letter: A, B, or C." in arc_challenge.feedback(three, f"Answer: {wrong}")
    assert arc_challenge.extract_answer("Answer: E", five) == "E"
    assert arc_challenge.extract_answer("Answer: D", three) is None


def test_arc_numeric_three_option_record_maps_to_abc():
    record = {"id": "x", "question": "Q?", "choices": {"text": ["one", "two", "three"], "label": ["1", "2", "3"]},
              "answerKey": "3"}
    example = arc_challenge.parse_record(record, "t:1")
    assert example.labels == ("A", "B", "C") and example.gold == "C"


# --- prompts (paper appendix "Prompt Format") -------------------------------------------------------------------

def test_arc_prompt_is_the_appendix_template():
    example = arc_challenge.load("train")[0]
    assert arc_challenge.prompt(example) == (
        "Answer the multiple-choice question by choosing the best option.\n"
        "Respond with ONLY the letter (A, B, C, or D).\n"
        "\n"
        "[QUESTION]\n"
        "George wants to warm his hands quickly by rubbing them. Which skin surface will produce the most heat?\n"
        "\n"
        "[OPTIONS]\n"
        "A. dry palms\n"
        "B. wet palms\n"
        "C. palms covered with oil\n"
        "D. palms covered with lotion\n"
        "\n"
        "Answer:"
    )


def test_hellaswag_prompt_wording():
    text = hellaswag.prompt(hellaswag.load("validation")[0])
    assert text.startswith("Choose the best continuation of the context.\n"
                           "Respond with ONLY the letter (A, B, C, or D).")
    assert "\n[CONTEXT]\n" in text and "\n[OPTIONS]\nA. " in text and text.endswith("\n\nAnswer:")


def test_strategy_qa_prompt_wording():
    example = strategy_qa.load("train")[0]
    assert strategy_qa.prompt(example) == (
        "Answer the following yes/no question by reasoning step by step.\n"
        "Think through the question carefully, then end your response with\n"
        'exactly: "Answer: yes" or "Answer: no" on the final line.\n'
        "\n"
        "[QUESTION]\n"
        "Is Mixed martial arts totally original from Roman Colosseum games?"
    )


def test_math_prompt_wording():
    example = math_mcqa.load("test")[0]
    text = math_mcqa.prompt(example)
    assert text.startswith(
        "Solve the math problem step by step, then choose the correct answer.\n"
        'Show your reasoning, then end with exactly: "Answer: X"\n'
        "where X is the letter A, B, C, or D.\n\n[PROBLEM]\n" + example.question + "\n\n[OPTIONS]\nA. "
    )
    assert text.endswith("D. " + example.options[3])


# --- loading ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "split", "count"),
    [
        ("arc_challenge", "train", 1119),
        ("arc_challenge", "test", 1172),
        ("strategy_qa", "train", 1603),
        ("strategy_qa", "test", 687),
        ("hellaswag", "train", 1200),
        ("hellaswag", "validation", 800),
        ("math_mcqa", "train", 1000),
        ("math_mcqa", "test", 400),
    ],
)
def test_shipped_counts(name, split, count):
    examples = get_task(name).load(split)
    assert len(examples) == count
    assert len({e.uid for e in examples}) == count
    assert all(e.gold in e.labels for e in examples)


def test_task_constants():
    from fedspear.algorithms import spear

    expected = {"arc_challenge": (16, 2, 0, True), "hellaswag": (16, 2, 0, True),
                "strategy_qa": (256, 4, 24, False), "math_mcqa": (512, 4, 32, False)}  # budgets: issue 16
    assert set(spear.TAU) == set(spear.MAX_LOSE_RATIO) == set(TASKS)
    for name, task in TASKS.items():
        assert task.NAME == name
        assert (task.MAX_NEW_TOKENS, spear.MAX_LOSE_RATIO[name], spear.TAU[name],
                task.MULTIPLE_CHOICE) == expected[name]
        assert task.TRAIN_SPLIT != task.EVAL_SPLIT


def test_unknown_task_names_the_choices():
    expected = r"unknown task 'x'; choose one of: arc_challenge, hellaswag, math_mcqa, strategy_qa"
    with pytest.raises(ValueError, match=expected):
        get_task("x")


@pytest.mark.parametrize(("name", "allowed"), [("arc_challenge", "train, test"), ("hellaswag", "train, validation"),
                                               ("strategy_qa", "train, test"), ("math_mcqa", "train, test")])
def test_unknown_split_names_the_allowed_ones(name, allowed):
    with pytest.raises(ValueError, match=f"choose one of: {allowed}"):
        get_task(name).load("dev")


def test_unknown_source():
    with pytest.raises(ValueError, match="offline, hub"):
        arc_challenge.load("train", source="web")


def test_missing_data_dir_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        strategy_qa.load("train", data_dir=tmp_path)
    with pytest.raises(DataError, match="hendrycks_math"):
        math_mcqa.load("test", data_dir=tmp_path)


ARC_OK = {"id": "q1", "question": "Which is a metal?", "choices": {"text": ["iron", "wood", "glass", "paper"],
                                                                   "label": ["A", "B", "C", "D"]}, "answerKey": "A"}
SQA_OK = {"qid": "s1", "question": "Is iron a metal?", "answer": True, "facts": ["Iron is a metal."]}
HS_OK = {"ind": 1, "activity_label": "Cooking", "ctx": "A man cooks. He",
         "endings": ["eats.", "runs.", "sits.", "flies."], "label": "0"}
MATH_OK = {"problem": "1+1?", "choices": ["2", "3", "4", "5"], "answer": 0, "solution": "$1+1=\\boxed{2}$"}


def _write(tmp_path: Path, task: str, filename: str, records: list) -> Path:
    folder = tmp_path / task
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _with(record: dict, **changes) -> dict:
    out = json.loads(json.dumps(record))
    for key, value in changes.items():
        if value is ...:
            del out[key]
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    ("task", "filename", "bad", "field"),
    [
        ("arc_challenge", "train.jsonl", _with(ARC_OK, question=...), "question"),
        ("arc_challenge", "train.jsonl", _with(ARC_OK, question=7), "question"),
        ("arc_challenge", "train.jsonl", _with(ARC_OK, question="  "), "question"),
        ("arc_challenge", "train.jsonl", _with(ARC_OK, answerKey="E"), "answerKey"),
        ("arc_challenge", "train.jsonl", _with(ARC_OK, choices={"text": ["a", "", "c", "d"],
                                                                "label": ["A", "B", "C", "D"]}), "choices.text"),
        ("arc_challenge", "train.jsonl", "{not json", "JSON"),
        ("strategy_qa", "train.jsonl", _with(SQA_OK, answer="yes"), "answer"),
        ("strategy_qa", "train.jsonl", _with(SQA_OK, facts=[]), "facts"),
        ("strategy_qa", "train.jsonl", _with(SQA_OK, qid=...), "qid"),
        ("hellaswag", "train_olmes_preprocessed.jsonl", _with(HS_OK, label="4"), "label"),
        ("hellaswag", "train_olmes_preprocessed.jsonl", _with(HS_OK, endings=["a", "b", "c"]), "endings"),
        ("hellaswag", "train_olmes_preprocessed.jsonl", _with(HS_OK, ctx=""), "ctx"),
        ("math_mcqa", "train.jsonl", _with(MATH_OK, answer=4), "answer"),
        ("math_mcqa", "train.jsonl", _with(MATH_OK, answer=True), "answer"),
        ("math_mcqa", "train.jsonl", _with(MATH_OK, solution=...), "solution"),
    ],
)
def test_malformed_record_names_file_line_and_field(tmp_path, task, filename, bad, field):
    good = {"arc_challenge": ARC_OK, "strategy_qa": SQA_OK, "hellaswag": HS_OK, "math_mcqa": MATH_OK}[task]
    path = _write(tmp_path, task, filename, [good, good, bad])
    with pytest.raises(DataError) as info:
        get_task(task).load("train", data_dir=tmp_path)
    assert f"{path}:3:" in str(info.value)
    assert field in str(info.value)


def test_well_formed_temp_records_load(tmp_path):
    _write(tmp_path, "arc_challenge", "test.jsonl", [ARC_OK])
    _write(tmp_path, "strategy_qa", "test.jsonl", [SQA_OK])
    (example,) = arc_challenge.load("test", data_dir=tmp_path)
    assert example.gold == "A" and example.options[0] == "iron"
    (sqa,) = strategy_qa.load("test", data_dir=tmp_path)
    assert sqa.gold == "yes" and sqa.extra["facts"] == ("Iron is a metal.",)


def test_hellaswag_validation_records_get_the_olmes_preprocess(tmp_path):
    raw = {"ind": 9, "activity_label": "Tying a tie", "ctx_a": "[header] How to tie a tie [title] Cross the ends.",
           "ctx_b": "", "ctx": "unused", "endings": ["[substeps] Pull it.. Then stop.", "b", "c", "d"], "label": "2"}
    _write(tmp_path, "hellaswag", "validation.jsonl", [raw])
    (example,) = hellaswag.load("validation", data_dir=tmp_path)
    assert example.question == "How to tie a tie. Cross the ends."
    assert example.options[0] == "Pull it. Then stop."
    assert example.gold == "C" and example.uid == "validation-9-Tying a tie"


# --- math_mcqa: boxed answers and the offline derivation -------------------------------------------------------

def test_boxed_helpers():
    solution = r"So $\log_24=\boxed{2}$ and the answer is $\boxed{\frac{1}{2}}$."
    assert math_mcqa.last_boxed(solution) == r"\frac{1}{2}"
    assert math_mcqa.remove_boxed(solution) == r"So $\log_24=$ and the answer is $$."
    assert math_mcqa.last_boxed(r"so $x = \boxed 9$.") == "9"
    assert math_mcqa.last_boxed("no box") is None


def test_hint_lines_cut_before_the_answer_and_limited():
    solution = "First, note x+1 = 5.\nSo x = 4.\nHence\nthe answer is $\\boxed{4}$."
    assert math_mcqa.hint_lines(solution, ["4"]) == "First, note x+1 = 5.\nSo x ="
    assert math_mcqa.hint_lines(solution, ["x + 1"]) == "First, note"  # whitespace-insensitive
    long = "\n".join(["a" * 50] * 10)
    assert math_mcqa.hint_lines(long, ["zzz"]) == "\n".join(["a" * 50] * 3)  # three lines < 300 characters
    assert len(math_mcqa.hint_lines("b" * 1000, ["zzz"])) == 300


def _math_raw(i: int, answer: str, subject: str = "Algebra", level: str = "Level 2") -> dict:
    return {"problem": f"Problem {i}?", "level": level, "type": subject,
            "solution": f"Work.\nSo it is $\\boxed{{{answer}}}$.", "unique_id": f"train/algebra/{i}.json"}


def test_math_derivation_is_deterministic_and_well_formed():
    raws = [_math_raw(i, a) for i, a in enumerate(["1", "2", "3", "4", "5", "2", " 5 ", "\\dfrac{1}{2}", "\\frac12"])]
    raws.append(_math_raw(100, "9", level="Level ?"))  # skipped
    raws.append(_math_raw(101, ""))  # empty boxed answer: skipped
    pairs = [(f"t:{i}", r) for i, r in enumerate(raws)]
    first, second = math_mcqa.derive_split(pairs), math_mcqa.derive_split(pairs)
    assert first == second
    assert len(first) == 9
    for raw, derived in zip(raws, first):
        choices = derived["choices"]
        assert len(choices) == 4
        assert choices[derived["answer"]] == " ".join(math_mcqa.last_boxed(raw["solution"]).split())
        assert len({math_mcqa.answer_key(c) for c in choices}) == 4


def test_math_derivation_needs_four_distinct_answers_per_type():
    pairs = [(f"t:{i}", _math_raw(i, a)) for i, a in enumerate(["1", "2", "1 "])]
    with pytest.raises(DataError, match="fewer than 4 distinct"):
        math_mcqa.derive_split(pairs)


@pytest.mark.parametrize("split", ["train", "test"])
def test_shipped_math_mcqa_records_are_valid(split):
    examples = math_mcqa.load(split)
    golds = [e.gold for e in examples]
    assert set(golds) == set(ABCD)  # the gold position is spread over A-D
    for example in examples:
        assert len({math_mcqa.answer_key(o) for o in example.options}) == 4
        assert example.options[example.gold_index] == math_mcqa.last_boxed(example.extra["solution"])
        assert example.extra["answer_text"] == example.options[example.gold_index]


@needs_shared("data")
def test_shipped_math_mcqa_is_a_sample_of_the_derivation():
    for split in ("train", "test"):
        full = {e.uid: e for e in math_mcqa.load(split, data_dir=SHARED_DATA)}
        assert len(full) == {"train": 7496, "test": 5000}[split]
        for example in math_mcqa.load(split):
            assert full[example.uid] == example


@needs_shared("data")
def test_shipped_files_match_shared_data():
    for name in ("arc_challenge", "strategy_qa"):
        for split in ("train", "test"):
            assert get_task(name).load(split) == get_task(name).load(split, data_dir=SHARED_DATA)
    full = {e.uid: e for e in hellaswag.load("validation", data_dir=SHARED_DATA)}
    assert len(full) == 10042
    assert all(full[e.uid] == e for e in hellaswag.load("validation"))
