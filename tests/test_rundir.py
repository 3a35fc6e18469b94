"""The run directory: atomic adapters, torn metrics lines repaired, damaged runs refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedspear.config import ConfigError, RunConfig
from fedspear.rundir import RunDir, RunDirError, initial_accuracy, initial_samples, training_seconds

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


def test_torn_last_line_is_dropped_with_a_warning_and_the_file_repaired(tmp_path, caplog):
    run = _run(tmp_path)
    with run.metrics_path.open("a") as fh:
        fh.write('{"round": 3, "lo')  # the process died mid-write
    (run.path / "adapters" / "round_0003.tmp").mkdir()  # and mid-way through saving the adapter
    with caplog.at_level("WARNING", logger="fedspear"):
        assert run.verify() == 2
    assert f"{run.metrics_path}, line 4: torn last line dropped" in caplog.text
    assert "round 3 will be redone" in caplog.text
    assert run.metrics_path.read_text().count("\n") == 3
    assert not (run.path / "adapters" / "round_0003.tmp").exists()
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedspear"):
        assert run.verify() == 2  # repaired once: no second message
    assert caplog.text == ""


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path):
    """A write cut between the record and its newline: the record is whole and counts; the newline is added so the
    next append does not glue two records together."""
    run = _run(tmp_path)
    run.metrics_path.write_text(run.metrics_path.read_text().rstrip("\n"))
    assert run.verify() == 2
    run.append({"round": 3})
    assert [r["round"] for r in run.records()] == [0, 1, 2, 3]


@pytest.mark.parametrize("damage", ['{"round": 1, "lo', "\x00\x00\x00", "[1, 2]"])
def test_a_damaged_line_before_the_last_stops_and_keeps_every_line(tmp_path, damage):
    """Line 2 of 3 (round 1) is unreadable: round 2 after it is intact, so nothing is dropped or rewritten; the
    error names the file, the line, how many records follow and how to recover."""
    run = _run(tmp_path)
    lines = run.metrics_path.read_text().splitlines()
    lines[1] = damage
    text = "\n".join(lines) + "\n"
    run.metrics_path.write_text(text)
    for call in (run.records, run.verify, run.last_round):
        with pytest.raises(RunDirError, match=r"metrics.jsonl, line 2: not a readable round record .* 1 record\(s\) "
                                              r"follow it; nothing was changed. Restore that line .*head -n 1 "):
            call()
    assert run.metrics_path.read_text() == text


def test_blank_lines_are_skipped_not_taken_for_damage(tmp_path):
    run = _run(tmp_path)
    run.metrics_path.write_text(run.metrics_path.read_text().replace("\n", "\n\n", 1))
    assert [r["round"] for r in run.records()] == [0, 1, 2]
    assert run.verify() == 2


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
    with pytest.raises(ConfigError, match="lambda_l: saved 0.1 vs now 0.0") as refused:
        run.check_or_write_config(RunConfig(lambda_l=0.0).resolved())
    assert "recorded no round" not in str(refused.value)  # three rounds would be lost
    fresh = RunDir(tmp_path / "never-ran")  # a run that stopped before its first round: deleting it loses nothing
    fresh.check_or_write_config(RunConfig().resolved())
    with pytest.raises(ConfigError, match=r"it recorded no round, so deleting .*never-ran loses nothing"):
        fresh.check_or_write_config(RunConfig(lambda_l=0.0).resolved())
    run.check_or_write_config(RunConfig(output_dir="elsewhere").resolved())  # where it lives may change
    # how it decodes may change too: a run whose compiled decode fails resumes with it off, as the error says
    run.check_or_write_config(RunConfig(compile_decode="off").resolved())
    run.check_or_write_config(RunConfig(compile_training="on").resolved())  # and how it trains
    # and how many held-out answers decode together: a run saved with 32 (the default before "auto") resumes under
    # the new default, and evaluates at the 32 it used (evaluation_config), as fedspear eval reproduces it
    saved = RunDir(tmp_path / "before-auto")
    saved.check_or_write_config(RunConfig(eval_batch_size=32).resolved())
    saved.append({"round": 0, "eval": {"n": 8}})  # a record of then: it does not say its batch
    saved.check_or_write_config(RunConfig().resolved())
    assert saved.eval_batch_used() == 32 and saved.evaluation_config(RunConfig()).eval_batch_size == 32


def test_an_auto_run_keeps_evaluating_at_the_batch_it_used(tmp_path):
    """Under eval_batch_size = "auto" a run's evaluations decode at the batch its last evaluation with answers
    recorded (another machine would pick another, and a bf16 answer may shift with it); a number asked for wins;
    with no evaluation yet "auto" stays for the evaluator to decide."""
    run = RunDir(tmp_path / "auto")
    run.check_or_write_config(RunConfig().resolved())
    assert run.eval_batch_used() is None and run.evaluation_config(RunConfig()).eval_batch_size == "auto"
    run.append({"round": 0, "eval": {"n": 8, "batch_size": 128}})
    run.append({"round": 1, "eval": {"n": 8, "acc_ll": 0.5}})  # log-likelihood only: no batch of answers
    run.append({"round": 2, "eval": None})  # a round without evaluation (eval_every > 1), as the server writes it
    assert run.eval_batch_used() == 128
    assert run.evaluation_config(RunConfig()).eval_batch_size == 128
    assert run.evaluation_config(RunConfig(eval_batch_size=16)).eval_batch_size == 16


def test_initial_accuracy_counts_first_answers_not_prompts():
    """GRPO samples a group of G per prompt: 12 of 32 first answers right is 0.375, not 12 / 8 = 1.5 (what records
    of fedspear ≤ ef129e1 stored). Records without ``initial_samples`` get it as generations − revision attempts."""
    grpo_new = {"prompts": 8, "initial_samples": 32, "initial_correct": 12, "generations": 32, "revisions_attempted": 0}
    grpo_old = {k: v for k, v in grpo_new.items() if k != "initial_samples"} | {"initial_accuracy": 1.5}
    spear_old = {"prompts": 8, "initial_correct": 5, "generations": 11, "revisions_attempted": 3}
    rltf_old = {"prompts": 2, "initial_correct": 2, "generations": 14, "revisions_attempted": 6}
    assert initial_samples(grpo_new) == initial_samples(grpo_old) == 32
    assert initial_accuracy(grpo_new) == initial_accuracy(grpo_old) == 0.375
    assert initial_samples(spear_old) == 8 and initial_accuracy(spear_old) == 5 / 8
    assert initial_samples(rltf_old) == 8 and initial_accuracy(rltf_old) == 0.25
    assert initial_accuracy({"prompts": 0, "initial_samples": 0, "initial_correct": 0}) is None  # no client answered


def test_training_seconds_leave_out_the_central_evaluation():
    """A round's cost is its wall-clock without the server's evaluation: 1,000 s with 874 s of evaluation is 126 s;
    a round that did not evaluate records 0.0 there, or (older records) no key."""
    assert training_seconds({"seconds": {"round": 1000.0, "evaluate": 874.0, "train": 90.0}}) == 126.0
    assert training_seconds({"seconds": {"round": 109.5, "evaluate": 0.0}}) == 109.5
    assert training_seconds({"seconds": {"round": 74.0}}) == 74.0


def test_reading_a_torn_last_line_leaves_the_file_as_it_is(tmp_path):
    """``records()`` without ``repair`` (fedspear eval, summaries) leaves the torn line out and writes nothing, so a
    read-only run stays readable; the resume (``verify``) repairs it."""
    run = _run(tmp_path)
    with run.metrics_path.open("a") as fh:
        fh.write('{"round": 3, "lo')
    text = run.metrics_path.read_text()
    assert [r["round"] for r in run.records()] == [0, 1, 2] and run.last_round() == 2
    assert run.metrics_path.read_text() == text
    assert run.verify() == 2 and run.metrics_path.read_text() == text[:text.rindex("\n") + 1]


@pytest.mark.parametrize("kept", [0, 1])
def test_adapters_saved_after_the_rounds_recorded_are_refused(tmp_path, kept):
    """metrics.jsonl lost records (deleted, or cut by hand after a damaged line) while the adapters of later rounds
    stay: resuming would redo those rounds over them (under DP counting fewer noised releases than were saved), so
    it is refused and nothing is changed. Round ``last + 1`` alone is a round saved but not recorded (a kill between
    the two writes): that one is redone."""
    run = _run(tmp_path)
    lines = run.metrics_path.read_text().splitlines(keepends=True)
    run.metrics_path.write_text("".join(lines[:kept]))
    before = sorted(p.relative_to(run.path) for p in run.path.rglob("*"))
    expected = (r"round\(s\) 1, 2, but metrics.jsonl records no round: .*delete round_0001 " if kept == 0 else
                r"round\(s\) 2, but the last round metrics.jsonl records is 0: .*delete round_0002 ")
    with pytest.raises(RunDirError, match=r"adapters are saved for " + expected + "and the adapter folders after it"):
        run.verify()
    assert sorted(p.relative_to(run.path) for p in run.path.rglob("*")) == before
    assert run.metrics_path.read_text() == "".join(lines[:kept])
    run.metrics_path.write_text("".join(lines[:2]))  # round 2 saved, not recorded: redone on resume
    assert run.verify() == 1


def test_a_fedadam_run_resumes_only_with_its_optimiser_state(tmp_path):
    """FedAdam / FedYogi keep their moments beside each round's adapter: missing after round 0 (round 0 has none),
    the resume would restart them at zero, and a damaged file is named; FedAvg needs none."""
    run = RunDir(tmp_path / "run")
    cfg = RunConfig(strategy="fedadam").resolved()
    run.check_or_write_config(cfg)
    run.save_adapter(0, A, {"r": 16})
    run.append({"round": 0})
    assert run.verify(cfg) == 0  # no state before the first update
    state = {"step": np.asarray([1], dtype=np.int64), "m/x": np.zeros(2), "v/x": np.zeros(2)}
    run.save_adapter(1, A, {"r": 16}, server_state=state)
    run.append({"round": 1})
    assert run.verify(cfg) == 1 and set(run.load_server_state(1)) == set(state)
    path = run.adapter_dir(1) / "server_state.safetensors"
    run.save_adapter(1, A, {"r": 16}, server_state={"m/x": np.zeros(2), "v/x": np.zeros(2)})  # a file, not a state
    with pytest.raises(RunDirError, match="server_state.safetensors: server optimiser checkpoint has no 'step'"):
        run.verify(cfg)
    run.save_adapter(1, A, {"r": 16}, server_state=state)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(RunDirError, match="server_state.safetensors: server-optimiser state unreadable"):
        run.verify(cfg)
    path.unlink()
    with pytest.raises(RunDirError, match="server_state.safetensors: missing; a fedadam run cannot resume"):
        run.verify(cfg)
    assert run.verify(RunConfig().resolved()) == 1 and run.verify() == 1
