"""A round in which no client reply is accepted stops the run with the clients' reasons (issue 16 §1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedspear.config import RunConfig
from fedspear.fl.server_app import empty_round_error
from fedspear.rundir import EmptyRoundError

FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))
REASONS = ["partition 0 (node 11): client error: boom", "partition 1 (node 12): no reply within 60 s"]


@pytest.mark.parametrize("dropped,streak,tolerated,stops", [
    (False, 1, 0, True),   # every failure raised by the clients' code: always stops
    (False, 1, 5, True),   # … whatever max_empty_rounds says
    (True, 1, 0, True),    # default 0: the first empty round stops, also when nodes dropped out
    (True, 1, 2, False),   # nodes dropped out: tolerated up to max_empty_rounds in a row
    (True, 2, 2, False),
    (True, 3, 2, True),
])
def test_which_empty_rounds_stop_the_run(dropped, streak, tolerated, stops):
    error = empty_round_error(4, REASONS, dropped, streak, RunConfig(max_empty_rounds=tolerated))
    assert (error is not None) == stops
    if stops:
        assert isinstance(error, EmptyRoundError)
        text = str(error)
        assert "round 4" in text and "client error: boom" in text and "no reply within 60 s" in text
        assert "rounds 0–3" in text and "re-run" in text


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_run_whose_clients_all_fail_stops_with_their_reasons_and_resumes_once_fixed(tmp_path):
    """Fault injection through the Flower simulation engine: both sampled clients raise in round 1. The run exits
    1 naming both reasons, records nothing for round 1, and the same command without the fault resumes there."""
    out = tmp_path / "run"
    cmd = [FEDSPEAR, "run", "--model", "tiny-random", "--rounds", "2", "--clients", "2", "--clients-per-round", "2",
           "--rollouts-per-round", "2", "--eval-size", "4", "--set", "max_new_tokens=4", "--set", "train_size=40",
           "-o", str(out)]
    env = dict(os.environ, FEDSPEAR_INJECT_FAULTS="0:raise,1:raise")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "round 1: no client reply was accepted" in proc.stderr
    assert "injected crash in client 0" in proc.stderr and "injected crash in client 1" in proc.stderr
    assert [r["round"] for r in _records(out)] == [0]
    partitions = json.loads((out / "partitions.json").read_text())
    assert partitions["sizes"] == [20, 20] and partitions["partitioner"] == "inner_dirichlet"

    env.pop("FEDSPEAR_INJECT_FAULTS")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = _records(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["clients_ok"] == 2 and r["clients_failed"] == 0 for r in records[1:])


@pytest.mark.slow
def test_rounds_where_nodes_dropped_out_are_tolerated_up_to_max_empty_rounds(tmp_path):
    """A round timeout far below a client's round makes the sampled node drop out of every round. With
    max_empty_rounds = 2, rounds 1 and 2 are recorded as empty (adapter kept) and round 3 stops the run; with a
    normal timeout the same directory resumes at round 3 (round_timeout and max_empty_rounds may change on resume)."""
    out = tmp_path / "run"
    cmd = [FEDSPEAR, "run", "--model", "tiny-random", "--rounds", "3", "--clients", "2", "--clients-per-round", "1",
           "--rollouts-per-round", "2", "--eval-size", "4", "--set", "max_new_tokens=4", "--set", "train_size=40",
           "--set", "max_empty_rounds=2", "-o", str(out)]
    proc = subprocess.run(cmd + ["--set", "round_timeout=0.05"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "round 3: no client reply was accepted (3 consecutive empty round(s)" in proc.stderr
    records = _records(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(r["empty"] and r["clients_ok"] == 0 and not r["aggregated"] for r in records[1:])
    assert "no reply within 0.05 s" in records[1]["clients"][0]["error"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = _records(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3] and records[3]["clients_ok"] == 1
    assert "2 round(s) accepted no client reply" in (out / "report.md").read_text()
