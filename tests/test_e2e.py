"""End to end: ``fedspear run`` with the packaged SmolLM2-135M on real ARC-Challenge data, through Flower's
simulation engine (Ray on 127.0.0.1), 2 rounds at tiny sizes; then a crash-style truncation and a resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ARGS = ["--rounds", "2", "--clients", "2", "--clients-per-round", "1", "--rollouts-per-round", "4",
        "--eval-size", "8", "--set", "local_steps=2", "--set", "eval_every=1", "--set", "batch_size=2",
        "--set", "train_size=40", "--set", "tensorboard=true"]


def _fedspear(out: Path) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("fedspear")), "run", *ARGS, "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _ray_addresses_since(start: float) -> set[str]:
    """IPv4 addresses in ip:port form (and 'address ip') in the logs of Ray sessions started after ``start``."""
    found: set[str] = set()
    for session in Path("/tmp/ray").glob("session_2*"):
        if session.stat().st_mtime < start:
            continue
        for log in (session / "logs").glob("*"):
            if log.is_file():
                text = log.read_text(errors="ignore")
                found |= set(re.findall(r"\b(\d{1,3}(?:\.\d{1,3}){3}):\d+", text))
                found |= set(re.findall(r"address:? (\d{1,3}(?:\.\d{1,3}){3})", text))
    return found


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_metrics_report_plots_and_resumes(tmp_path):
    out = tmp_path / "run"
    start = time.time() - 1
    proc = _fedspear(out)
    # piped, not a terminal: whole lines (no wrapping at 80 columns), no bars — fedspear's or the libraries'
    header = next(line for line in proc.stderr.splitlines() if line.startswith("fedspear spear"))
    assert " · 2 rounds · " in header and f"→ {out}" in header
    assert "━" not in proc.stderr and "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr
    addresses = _ray_addresses_since(start)
    assert addresses and all(a.startswith("127.") for a in addresses), addresses  # Ray stays on loopback
    assert "round-0 accuracy: generation" in proc.stdout and "final accuracy (round 2)" in proc.stdout
    assert f"report: {out / 'report.md'}" in proc.stdout

    records = _records(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    r0 = records[0]["eval"]
    assert r0["n"] == 8 and 0 <= r0["acc_gen"] <= 1 and r0["acc_gen_low"] <= r0["acc_gen"] <= r0["acc_gen_high"]
    assert 0 <= r0["acc_ll"] <= 1 and r0["acc_ll_low"] <= r0["acc_ll"] <= r0["acc_ll_high"]
    assert r0["batch_size"] == 32  # eval_batch_size = "auto" on a CPU
    assert records[0]["dtype"] in ("bf16", "fp32")
    for r in records[1:]:
        assert r["prompts"] == 4 and r["clients_ok"] == 1 and r["clients_failed"] == 0
        assert r["wins"] == r["initial_correct"] + r["revisions_successful"]
        assert r["losses"] == r["prompts"] - r["initial_correct"]
        assert r["revisions_successful"] <= r["revisions_attempted"] <= 2 * (r["prompts"] - r["initial_correct"])
        assert r["tokens_generated"] >= r["generations"] >= r["prompts"]
        assert r["initial_samples"] == 4 and r["initial_accuracy"] == pytest.approx(r["initial_correct"] / 4)
        s = r["seconds"]
        assert s["generate_initial"] > 0 and s["round"] > 0 and s["evaluate"] > 0
        assert s["train"] > 0 if r["wins"] else s["train"] >= 0
        assert set(s) >= {"generate_revisions", "aggregate", "flower_overhead", "clients_total"}
        assert r["eval"]["n"] == 8 and r["wall_clock"] > records[0]["wall_clock"]
        assert r["peak_rss_mb"]["client"] > 100 and r["peak_rss_mb"]["server"] > 100
        # the process tree (server, Ray, client actor) together holds more than either process alone
        tree = r["peak_tree_mb"]
        assert tree["rss"] >= tree["pss"] > max(r["peak_rss_mb"].values()) * 0.5
        assert tree["rss"] > r["peak_rss_mb"]["client"] + 100
        for who in ("client", "server"):  # what a process holds after the round: at most its peak
            assert 100 < r["rss_after_round_mb"][who] <= r["peak_rss_mb"][who]
        if r["wins"]:
            assert r["loss_win"] > 0 and r["steps"] == 2
    for t in (0, 1, 2):
        adapter = out / "adapters" / f"round_{t:04d}"
        assert (adapter / "adapter_model.safetensors").stat().st_size > 1000
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16
    # the saved adapter loads with peft as-is and holds the global adapter's values
    from peft import PeftModel
    from safetensors.numpy import load_file

    from fedspear.runtime.model import get_adapter, load_base

    base, _, _ = load_base("smollm2-135m", "fp32")
    loaded = get_adapter(PeftModel.from_pretrained(base, out / "adapters" / "round_0002"))
    saved = load_file(str(out / "adapters" / "round_0002" / "adapter_model.safetensors"))
    assert set(loaded) == set(saved) and all(np.array_equal(loaded[k], saved[k]) for k in saved)
    report = (out / "report.md").read_text()
    assert "## Accuracy" in report and "| round 0 |" in report and "## Per round" in report
    for name in ("accuracy", "wall_clock", "interaction"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same rounds as TensorBoard scalars (read with TensorBoard's own reader)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert [(e.step, round(e.value, 6)) for e in board.Scalars("eval/acc_ll")] == [
        (r["round"], round(r["eval"]["acc_ll"], 6)) for r in records]
    assert [e.step for e in board.Scalars("interaction/wins")] == [1, 2]

    # `fedspear eval` scores the last adapter with the run's own evaluation code and items: round 2's answers
    cmd = [str(Path(sys.executable).with_name("fedspear")), "eval", str(out), "-o", str(tmp_path / "eval.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((tmp_path / "eval.json").read_text())
    assert again["round"] == 2 and again["metrics"]["n"] == 8
    for key in ("correct_gen", "correct_ll", "acc_gen", "acc_ll", "parsed_gen", "cutoff_gen"):
        assert again["metrics"][key] == records[2]["eval"][key], key

    # a crash after round 1: the round-2 line never got written → the next invocation redoes round 2 only
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    proc = _fedspear(out)
    assert "resuming after round 1" in proc.stderr, proc.stderr[:3000]
    assert "line 3: torn last line dropped" in proc.stderr and "round 2 will be redone" in proc.stderr
    resumed = _records(out)
    assert [r["round"] for r in resumed] == [0, 1, 2]
    assert resumed[1] == records[1]  # the completed round is untouched


def test_resume_refuses_other_settings(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text('task = "arc_challenge"\nrounds = 3\n')
    cmd = [str(Path(sys.executable).with_name("fedspear")), "run", "--rounds", "2", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "rounds: saved 3 vs now 2" in proc.stderr
