"""Property tests: any malformed record or config gives a clear error (or a counted skip), never a traceback from deep
inside a library."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedspear.config import ConfigError, RunConfig, load_config
from fedspear.tasks import arc_challenge, hellaswag, strategy_qa
from fedspear.tasks.base import DataError

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=8)

ARC_FIELDS = ["id", "question", "choices", "answerKey"]
SQA_FIELDS = ["qid", "question", "answer", "facts"]
HS_FIELDS = ["ind", "activity_label", "ctx", "endings", "label"]


def _good_arc(i: int) -> dict:
    return {"id": f"q{i}", "question": "Which is hard?", "answerKey": "B",
            "choices": {"text": ["wool", "a rock", "milk", "air"], "label": ["A", "B", "C", "D"]}}


def mutated(fields: list[str], good):
    """A good record with some fields dropped or replaced by arbitrary JSON values; or a non-object line."""
    def build(draw_data):
        i, drop, replace = draw_data
        record = good(i)
        for f in drop:
            record.pop(f, None)
        record.update(replace)
        return record
    records = st.tuples(st.integers(0, 9), st.lists(st.sampled_from(fields), max_size=2),
                        st.dictionaries(st.sampled_from(fields + ["text", "label"]), values, max_size=2)).map(build)
    return st.one_of(records, records.map(json.dumps), st.text(max_size=20), values.map(json.dumps))




def _check_load(task, split, filename, lines):
    root = Path(tempfile.mkdtemp())
    (root / task.NAME).mkdir()
    text = "\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n"
    (root / task.NAME / filename).write_text(text)
    with (root / task.NAME / filename).open(encoding="utf-8") as fh:  # count lines exactly as the loader reads them
        nonblank = sum(1 for line in fh if line.strip())
    try:
        examples = task.load(split, data_dir=root)
    except DataError as err:
        assert f"{root / task.NAME / filename}:" in str(err)  # names the file (and line)
        examples = None
    skipped: list[str] = []
    kept = task.load(split, data_dir=root, skipped=skipped)  # never raises with skipping on
    assert len(kept) + len(skipped) == nonblank
    assert all(str(root) in s for s in skipped)
    if examples is not None:
        assert not skipped and len(examples) == nonblank
    for ex in kept:
        assert ex.gold in ex.labels and ex.question.strip()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated(ARC_FIELDS, _good_arc), min_size=1, max_size=5))
def test_arc_records(lines):
    _check_load(arc_challenge, "train", "train.jsonl", lines)


def _good_sqa(i: int) -> dict:
    return {"qid": f"s{i}", "question": "Is ice cold?", "answer": True, "facts": ["Ice is frozen water."]}


@settings(max_examples=100, deadline=None)
@given(st.lists(mutated(SQA_FIELDS, _good_sqa), min_size=1, max_size=5))
def test_strategy_qa_records(lines):
    _check_load(strategy_qa, "train", "train.jsonl", lines)


def _good_hs(i: int) -> dict:
    return {"ind": i, "activity_label": "Baking", "ctx": "A chef", "label": "2",
            "endings": ["sings.", "runs.", "bakes bread.", "sleeps."]}


@settings(max_examples=100, deadline=None)
@given(st.lists(mutated(HS_FIELDS, _good_hs), min_size=1, max_size=5))
def test_hellaswag_records(lines):
    _check_load(hellaswag, "validation", "validation.jsonl", lines)


KEYS = sorted(RunConfig.__dataclass_fields__)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS + ["bogus_key"]), values, max_size=4))
def test_any_config_is_accepted_or_refused_by_name(overrides):
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        cfg = load_config(**overrides)
    except ConfigError as err:  # a key named as a whole word ("mu" is not in "must", nor "strategy" in "strategy_qa")
        assert any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(k)}(?![A-Za-z0-9_])", str(err)) for k in overrides), \
            (overrides, str(err))
        return
    assert isinstance(cfg, RunConfig)
    cfg.resolved()


def test_a_model_folder_transformers_cannot_load_is_a_model_error(tmp_path):
    """A folder with a config.json but no usable tokenizer or weights: a ModelError naming the folder (the run's
    one-line error), not transformers' ValueError as a traceback after the run had started."""
    import pytest

    from fedspear.runtime.model import load_base
    from fedspear.runtime.model_zoo import ModelError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=f"could not load model '{tmp_path}' from {tmp_path}: "):
        load_base(str(tmp_path), "fp32", "cpu")


def test_set_keeps_a_string_setting_a_string():
    """`--set output_dir=2024` was refused as "expected a string, got 2024" (TOML read it as a number; a date
    likewise), while `-o 2024` worked."""
    from fedspear.config import parse_assignments

    parsed = parse_assignments(["output_dir=2024", "data_dir=2024-01-01", "model=\"a b\"", "lr=1e-3", "rounds=3"])
    assert parsed == {"output_dir": "2024", "data_dir": "2024-01-01", "model": "a b", "lr": 0.001, "rounds": 3}
    assert load_config(None, **parsed).output_dir == "2024"
