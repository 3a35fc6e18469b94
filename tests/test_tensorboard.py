"""TensorBoard scalars beside metrics.jsonl (``tensorboard = true``): which numbers become which curves, read back
with TensorBoard's own reader, and a resumed run that redoes a round keeps one value per step."""

from __future__ import annotations

import pytest

from fedspear.tensorboard import ScalarWriter, scalars

RECORD = {"round": 3, "lr": 1e-4, "wins": 5, "losses": 2, "initial_accuracy": 0.5, "aggregated": True,
          "loss": 0.25, "loss_win": 0.5, "loss_pg": None, "margin": float("nan"), "dp_epsilon": 19.05,
          "eval": {"acc_gen": 0.4, "acc_ll": 0.6, "n": 100, "correct_gen": "0110"},
          "seconds": {"round": 12.5, "train": 3.0}, "peak_rss_mb": {"client": 900.0, "server": 800.0},
          "clients": [{"num-wins": 5}], "wall_clock": 100.0}


def test_scalars_by_hand():
    assert scalars(RECORD) == {
        "interaction/wins": 5.0, "interaction/losses": 2.0, "interaction/initial_accuracy": 0.5, "train/lr": 1e-4,
        "privacy/epsilon": 19.05, "time/wall_clock_s": 100.0, "train/loss": 0.25, "train/loss_win": 0.5,
        "eval/acc_gen": 0.4, "eval/acc_ll": 0.6, "time/round_s": 12.5, "time/train_s": 3.0,
        "memory/peak_rss_client_mb": 900.0, "memory/peak_rss_server_mb": 800.0,
    }  # None, NaN, booleans, strings and per-client lists are left out
    assert scalars({"round": 0, "eval": None}) == {}


def _read(folder):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(folder))
    mux.Reload()
    out = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            for event in mux.Scalars(run, tag):
                out.setdefault(tag, {})[event.step] = pytest.approx(event.value)
    return out


def test_written_scalars_read_back_and_resume_purges_redone_rounds(tmp_path):
    board = ScalarWriter(tmp_path, first_round=0)
    for r in range(3):
        board.write({**RECORD, "round": r, "wins": 10 + r})
    board.close()
    # killed after round 1 was recorded; round 2 is redone with another result
    board = ScalarWriter(tmp_path, first_round=2)
    board.write({**RECORD, "round": 2, "wins": 99})
    board.close()
    curves = _read(tmp_path / "tensorboard")
    assert curves["interaction/wins"] == {0: 10.0, 1: 11.0, 2: 99.0}
    assert curves["eval/acc_ll"] == {0: 0.6, 1: 0.6, 2: 0.6}
