"""Run configuration: validation messages, TOML loading, task-dependent defaults, LR schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedspear.config import ConfigError, RunConfig, load_config, nearest_existing
from fedspear.server.schedule import lr_at_round


def test_defaults_are_valid_and_resolve_per_task():
    cfg = RunConfig()
    assert cfg.resolved().tau == 0  # paper: τ = 0 for ARC
    assert cfg.resolved().max_lose_ratio == 2
    assert RunConfig(task="strategy_qa").resolved().tau == 24
    assert RunConfig(task="math_mcqa").resolved().max_lose_ratio == 4


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"task": "mnist"}, "task: 'mnist' is not allowed"),
        ({"rounds": 0}, "rounds: 0 is out of range; it must be >= 1"),
        ({"mu": 1.0}, "mu: 1.0 is out of range; it must be < 1"),
        ({"mu": "high"}, "mu: expected a number"),
        ({"rounds": 2.5}, "rounds: expected an integer"),
        ({"lr": float("nan")}, "lr: must be finite"),
        ({"dtype": "fp16"}, "dtype: 'fp16' is not allowed; choose one of auto, bf16, fp32"),
        ({"clients_per_round": 5, "num_clients": 3}, "clients_per_round = 5 exceeds num_clients = 3"),
        ({"eval_generation": "yes"}, "eval_generation: expected true or false"),
        ({"colour": "red"}, "unknown config key 'colour'"),
    ],
)
def test_bad_values_name_the_key_and_range(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(**overrides)
    assert fragment in str(err.value)


def test_toml_file_round_trip(tmp_path):
    cfg = RunConfig(task="strategy_qa", rounds=7, lambda_l=0.0)
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    assert load_config(path, rounds=9).rounds == 9  # flags override the file


def test_toml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = -3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: rounds: -3 is out of range"):
        load_config(bad)
    # an error of a value given over the file (a flag, --set) is not blamed on the file
    ok = tmp_path / "ok.toml"
    ok.write_text("rounds = 1\n")
    with pytest.raises(ConfigError, match=r"^rounds: 0 is out of range"):
        load_config(ok, rounds=0)
    with pytest.raises(ConfigError, match=r"^clients_per_round = 2 exceeds num_clients = 1"):
        load_config(ok, num_clients=1)
    ok.write_text("num_clients = 1\n")  # the file's part in a cross-key error names it
    with pytest.raises(ConfigError, match=r"ok.toml: clients_per_round = 2 exceeds num_clients = 1"):
        load_config(ok)
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="is a folder; give a TOML file"):
        load_config(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'model = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"latin.toml: not UTF-8 text \(byte 12\)"):
        load_config(latin)


def test_a_fedspear_table_takes_every_key_or_none(tmp_path):
    """Keys in a ``[fedspear]`` table are read; a key or table beside it, once silently ignored, is refused."""
    table = tmp_path / "table.toml"
    table.write_text("[fedspear]\nrounds = 2\n")
    assert load_config(table).rounds == 2
    for extra in ("roundz = 3\n[fedspear]\nrounds = 2\n", "[fedspear]\nrounds = 2\n[other]\nx = 1\n"):
        table.write_text(extra)
        with pytest.raises(ConfigError, match=r"table.toml: (roundz|other) outside the \[fedspear\] table"):
            load_config(table)


def test_lr_schedule_warmup_then_cosine():
    """100 rounds, 10% warm-up: round 1 → lr/10, round 10 → lr, round 11 → lr (cosine start), round 100 → lr_min.

    Midway through the cosine (round 11 + 89/2 = 55.5) the rate is (lr + lr_min) / 2.
    """
    lr, lo = 5e-5, 1e-5
    assert lr_at_round(1, 100, lr, lo) == pytest.approx(5e-6)
    assert lr_at_round(10, 100, lr, lo) == pytest.approx(lr)
    assert lr_at_round(11, 100, lr, lo) == pytest.approx(lr)
    assert lr_at_round(100, 100, lr, lo) == pytest.approx(lo)
    mid = lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * 0.5))
    assert mid == pytest.approx((lr + lo) / 2)
    values = [lr_at_round(t, 100, lr, lo) for t in range(11, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay
    with pytest.raises(ValueError):
        lr_at_round(0, 100, lr, lo)


def test_nearest_existing_walks_up_to_the_part_that_exists(tmp_path):
    """The one walk-up behind every "X is a file, not a folder" check (cli, trace store, node worker)."""
    (tmp_path / "notes.txt").write_text("x")
    assert nearest_existing(tmp_path) == tmp_path
    assert nearest_existing(tmp_path / "a" / "b" / "c.json") == tmp_path
    assert nearest_existing(tmp_path / "notes.txt" / "run" / "x") == tmp_path / "notes.txt"  # a file in the way
    assert nearest_existing("/no-such-folder-anywhere/x") == Path("/")
