"""``flwr run .`` as Flower users run it: the app bundle Flower builds from this repository, and a real run through a
local SuperLink (``scripts/flwr_run_local.sh``) whose streamed log carries the round lines."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_app_bundle_carries_code_and_data_only(tmp_path, file_module):
    """The bundle ``flwr run .`` builds from the checkout, and the deploy example's staged copy builds the same
    bytes (``examples/deploy-local/run.py``'s ``stage_app``)."""
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(REPO)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert {"pyproject.toml", "src/fedspear/fl/server_app.py", "src/fedspear/fl/client_app.py",
            "src/fedspear/data/arc_challenge/test.jsonl", "src/fedspear/data/strategy_qa/SOURCE.md"} <= set(names)
    assert not [n for n in names if n.startswith(("docs/", "tests/", "examples/", "runs/", "scripts/"))]
    example = file_module(REPO / "examples" / "deploy-local" / "run.py", "deploy_local_run")
    assert build_fab_from_disk(example.stage_app(tmp_path / "app")) == fab


@pytest.mark.slow
def test_flwr_run_streams_round_lines_into_an_absolute_run_dir(tmp_path):
    run_dir = tmp_path / "flwr-run"  # absolute, outside the repository
    settings = tmp_path / "small.toml"  # keys [tool.flwr.app.config] does not declare come in a config file
    settings.write_text('model = "tiny-random"\nmax_new_tokens = 4\nlocal_steps = 1\nbatch_size = 2\nlora_r = 4\n'
                        'train_size = 20\n')
    extra = f'config-file="{settings}" rounds=2 clients-per-round=1 rollouts-per-round=2 eval-size=4'

    env = {**os.environ, "VENV_BIN": str(Path(sys.executable).parent)}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "flwr_run_local.sh"), str(run_dir), "2", extra],
                          capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    # the ServerApp's own lines reach the stream: round 0, each round, the final accuracy and the report
    assert "round 0 (before training):" in out and "round 1: wins" in out and "round 2: wins" in out, out[-4000:]
    assert "final accuracy (round 2): generation" in out and f"report: {run_dir / 'report.md'}" in out
    assert not (REPO / str(run_dir).lstrip("/")).exists()  # not appended to the repository path


def test_a_failed_flwr_run_is_not_reported_as_success(tmp_path):
    """`flwr run --stream` exits 0 whatever the run's end, and so did the script: a run refused by the ServerApp
    (rounds = 0) now ends it with exit code 1 and the run's status and reason."""
    env = {**os.environ, "VENV_BIN": str(Path(sys.executable).parent)}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "flwr_run_local.sh"), str(tmp_path / "run"), "2",
                           "rounds=0"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "flwr run ended with status finished:failed Simulation failed with exception: rounds: 0 is out of " \
           "range" in proc.stderr
