"""Shared fixtures: a tiny random Llama (2 layers, real tokenizer) and a few real ARC-Challenge items."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def file_module():
    """Import a Python file outside the package (``scripts/``, ``examples/``) as a module: ``(path, name) → module``,
    its functions without running its ``__main__`` part."""
    def load(path: Path, name: str):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests run where torch sees a CUDA GPU; elsewhere they are skipped and pytest's summary says why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA GPU; torch sees none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_frozen_objects_between_tests():
    """``runtime.memory.release_memory`` freezes what survives it (``gc.freeze``), as a long-lived client should; a
    test that ran rounds must not leave the next test's garbage out of the collector's reach."""
    import gc

    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny():
    """``(peft model, tokenizer)``: a randomly initialised 2-layer Llama wrapped with a fresh LoRA adapter."""
    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model

    base, tokenizer = tiny_model(seed=0)
    return add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0), tokenizer


@pytest.fixture(scope="session")
def arc_items():
    from fedspear.tasks import arc_challenge

    return arc_challenge.load("train")[:6]


class ScriptedFeedback:
    """A feedback source whose verdicts follow a script: ``script[uid]`` lists verdicts for y0, y1, y2, …"""

    def __init__(self, script: dict[str, list[bool]]):
        self.script = script
        self.calls: dict[str, int] = {}
        self.feedback_calls = 0

    def is_correct(self, example, completion: str) -> bool:
        n = self.calls.get(example.uid, 0)
        self.calls[example.uid] = n + 1
        verdicts = self.script.get(example.uid, [])
        return verdicts[n] if n < len(verdicts) else False

    def feedback(self, example, completion: str) -> str:
        self.feedback_calls += 1
        return "Incorrect. Hint: think again."


class AlwaysRight:
    """Every answer is right: every prompt becomes a win (drives training on a model that cannot answer)."""

    def is_correct(self, example, completion: str) -> bool:
        return True

    def feedback(self, example, completion: str) -> str:  # pragma: no cover - never asked
        raise AssertionError("feedback asked for a correct answer")


@pytest.fixture
def scripted():
    return ScriptedFeedback


@pytest.fixture
def always_right():
    return AlwaysRight()


@pytest.fixture
def task_identity():
    """Outside a running ServerApp, Flower needs the process's task identity set to build messages."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory):
    """``fedspear run`` with ``helpers.RESUME_ARGS``, never interrupted (its output folder): what the stopped, killed
    and resumed runs of test_stops and test_reliability must end equal to. Run once per session (≈ 20 s)."""
    import subprocess
    import sys

    from helpers import RESUME_ARGS

    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = subprocess.run([str(Path(sys.executable).with_name("fedspear")), "run", *RESUME_ARGS, "-o", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
