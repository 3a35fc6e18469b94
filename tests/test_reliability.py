"""Crashes, dead and hostile clients through the real Flower simulation engine (subprocess runs of the CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import RESUME_ARGS, kill_run_inside_round, stable

pytestmark = pytest.mark.slow

FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _adapter(out: Path, server_round: int) -> dict[str, np.ndarray]:
    return load_file(str(out / "adapters" / f"round_{server_round:04d}" / "adapter_model.safetensors"))


def test_faulty_clients_are_excluded_with_reasons_and_the_round_completes(tmp_path):
    """Five clients in one round: 0 crashes, 1 sends NaN, 2 a wrong shape, 3 a huge update; 4 is healthy."""
    out = tmp_path / "run"
    env = dict(os.environ, FEDSPEAR_INJECT_FAULTS="0:raise,1:nan,2:shape,3:norm")
    cmd = [FEDSPEAR, "run", "--model", "tiny-random", "--rounds", "1", "--clients", "5", "--clients-per-round", "5",
           "--rollouts-per-round", "2", "--eval-size", "4", "--set", "max_update_norm=1000", "--set",
           "max_new_tokens=4", "--set", "train_size=50", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r1 = _records(out)[1]
    assert r1["clients_ok"] == 1 and r1["clients_failed"] == 4
    reasons = {c["partition-id"] if "partition-id" in c else "crash": c["error"] for c in r1["clients"] if "error" in c}
    assert any("injected crash in client 0" in r for r in reasons.values())
    assert "non-finite" in reasons[1] and "shape" in reasons[2] and "update norm" in reasons[3]
    assert "excluded" in proc.stderr  # each exclusion is logged with node id and reason
    final = _adapter(out, 1)
    assert all(np.isfinite(v).all() for v in final.values())
    start = _adapter(out, 0)
    assert all(np.array_equal(final[k], start[k]) for k in start)  # the healthy client had no win: θ kept


def test_sigkill_mid_round_then_resume_equals_an_uninterrupted_run(tmp_path, uninterrupted_run):
    """FedAdam, fp32, rounds that train (``helpers.RESUME_ARGS``): kill -9 the whole run (CLI and Ray) while its
    client is at work on round 2, resume, and compare with the same run never interrupted: the same final adapter
    (max |Δθ| ≤ 1e-6), the same server-optimiser moments, the same metrics (wall-clock, memory and node ids aside)."""
    whole, killed = uninterrupted_run, tmp_path / "killed"
    kill_run_inside_round([FEDSPEAR, "run", *RESUME_ARGS, "-o", str(killed)], killed, server_round=2)
    assert [r["round"] for r in _records(killed)] == [0, 1]

    proc = subprocess.run([FEDSPEAR, "run", *RESUME_ARGS, "-o", str(killed)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming after round 1" in proc.stderr, proc.stderr[:3000]

    a, b = _adapter(whole, 3), _adapter(killed, 3)
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    print(f"resume equality: max |Δθ| = {diff:.3g}")
    assert diff <= 1e-6
    assert not all(np.array_equal(a[k], _adapter(whole, 0)[k]) for k in a)  # training did move the adapter
    assert stable(_records(whole)) == stable(_records(killed))
    # FedAdam's moments were restored from the round-1 checkpoint, not restarted: 3 server steps in both runs
    states = [load_file(str(out / "adapters" / "round_0003" / "server_state.safetensors")) for out in (whole, killed)]
    assert states[0]["step"].tolist() == states[1]["step"].tolist() == [
        sum(r["aggregated"] for r in _records(whole)[1:])]
    assert all(np.array_equal(states[0][k], states[1][k]) for k in states[0])
