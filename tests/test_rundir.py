"""The run directory: atomic adapters, torn metrics lines repaired, damaged runs refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedspear.config import ConfigError, RunConfig
from fedspear.rundir import RunDir, RunDirError

A = {"base_model.model.layer.lora_A.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}


def _run(tmp_path, rounds=2) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.check_or_write_config(RunConfig().resolved())
    for t in range(rounds + 1):
        run.save_adapter(t, {k: v + t for k, v in A.items()}, {"r": 16})
        run.append({"round": t, "loss": float("nan") if t == 1 else 0.5})
    return run


def test_round_trip_and_nan_written_as_null(tmp_path):
    run = _run(tmp_path)
    assert run.verify() == 2
    np.testing.assert_array_equal(run.load_adapter(2)[next(iter(A))], A[next(iter(A))] + 2)
    assert run.records()[1]["loss"] is None
    assert json.loads((run.adapter_dir(0) / "adapter_config.json").read_text()) == {"r": 16}


def test_torn_last_line_is_dropped_and_the_file_repaired(tmp_path):
    run = _run(tmp_path)
    with run.metrics_path.open("a") as fh:
        fh.write('{"round": 3, "lo')  # the process died mid-write
    (run.path / "adapters" / "round_0003.tmp").mkdir()  # and mid-way through saving the adapter
    assert run.verify() == 2
    assert run.metrics_path.read_text().count("\n") == 3
    assert not (run.path / "adapters" / "round_0003.tmp").exists()


def test_missing_or_damaged_adapter_is_refused(tmp_path):
    run = _run(tmp_path)
    (run.adapter_dir(2) / "adapter_model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(RunDirError, match="adapter of round 2 unreadable"):
        run.verify()
    (run.adapter_dir(2) / "adapter_model.safetensors").unlink()
    with pytest.raises(RunDirError, match="adapter of round 2 missing"):
        run.verify()


def test_rounds_out_of_order_are_refused(tmp_path):
    run = _run(tmp_path)
    run.append({"round": 7})
    with pytest.raises(RunDirError, match=r"rounds \[0, 1, 2, 7\] are not 0, 1, 2"):
        run.verify()


def test_other_settings_are_refused(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(ConfigError, match="lambda_l: saved 0.1 vs now 0.0"):
        run.check_or_write_config(RunConfig(lambda_l=0.0).resolved())
    run.check_or_write_config(RunConfig(output_dir="elsewhere").resolved())  # where it lives may change
