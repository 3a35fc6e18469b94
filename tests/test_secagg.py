"""Secure aggregation (``secure_aggregation = "secaggplus"``, ``fedspear.fl.secagg``): Flower's SecAgg+ workflow and
mod, run in this process over a loopback grid (every message copied as it would be on the wire; each node keeps its
own Context, as a SuperNode does), and once end to end through the simulation engine.

The clients' updates here are LoRA-sized values (θ^(t) ~ 0.03·N(0, 1), Δ_k ~ 1e-3·N(0, 1)), so the error of the
unmasked mean can be compared with ``error_bound`` at the default settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message

from fedspear.config import ConfigError, RunConfig
from fedspear.fl.records import LAYOUT_KEY, layout_of
from fedspear.fl import client_app, secagg
from fedspear.fl.secagg import LoopbackGrid, SecureRounds, error_bound, make_client_app, threshold
from fedspear.fl.server_app import discover_partitions
from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.server.aggregation import win_weighted_average

pytestmark = pytest.mark.usefixtures("task_identity")

FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))
SHAPES = {"layer.lora_A": (4, 32), "layer.lora_B": (32, 4), "head.lora_A": (4, 16)}


def _theta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.03 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _clients(theta: dict, n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in theta.items()}
            for _ in range(n)]


def _cfg(**kw) -> RunConfig:
    base = dict(model="tiny-random", num_clients=4, clients_per_round=4, rollouts_per_round=8,
                secure_aggregation="secaggplus", round_timeout=30.0)
    return RunConfig(**{**base, **kw})


def _run(cfg: RunConfig, adapters: list[dict], weights: list[int], theta: dict, fail: dict[int, str] | None = None,
         silent: dict[int, int] | None = None, server_round: int = 1, server_opt: str | None = None):
    """One SecAgg+ round over 4 (or len(adapters)) loopback nodes; partition k trains to ``adapters[k]`` with
    weight ``weights[k]``; ``fail`` = {partition: message} makes that client raise in training."""
    fail = fail or {}

    def train(cfg_, context, global_arrays, server_round_, lr):
        pid = int(context.node_config["partition-id"])
        if pid in fail:
            raise RuntimeError(fail[pid])
        for k, v in global_arrays.items():  # every client received θ^(t) exactly
            np.testing.assert_array_equal(v, theta[k])
        return ({k: v.copy() for k, v in adapters[pid].items()},
                {"weight": weights[pid], "num-wins": weights[pid], "num-losses": 0, "prompts": 8,
                 "partition-id": pid})

    nodes = [101 + 7 * i for i in range(len(adapters))]
    # the ClientApp a node runs (deployed or simulated), its SecAgg+ stages served by a legacy app around ``train``
    grid = LoopbackGrid(client_app.app, nodes, silent)
    core = WinWeightedFedAvg(cfg.clients_per_round, cfg.num_clients, seed=cfg.seed, server_opt=server_opt,
                             server_lr=1e-2)
    secure = SecureRounds(core, cfg, grid)
    config = ConfigRecord({"lr": 1e-3, "fedspear-config": json.dumps(cfg.to_dict()), LAYOUT_KEY: layout_of(theta)})
    legacy = make_client_app(train)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secagg, "client_app", legacy)
        core.partition_of = discover_partitions(grid, len(nodes), timeout=1)
        assert core.partition_of == {n: i for i, n in enumerate(nodes)}
        replies, new, rejected, dropped = secure.round(server_round, theta, config)
    return SimpleNamespace(replies=replies, new=new, rejected=rejected, dropped=dropped, grid=grid, core=core,
                           secure=secure, legacy=legacy, node_of={i: n for i, n in enumerate(nodes)})


def _max_error(new: dict, expected: dict) -> float:
    return max(float(np.abs(new[k].astype(np.float64) - expected[k].astype(np.float64)).max()) for k in expected)


def _all_bytes(msg: Message) -> bytes:
    """Every payload byte of a reply: its arrays' buffers, and its config records' bytes and numbers."""
    out = []
    for record in msg.content.array_records.values():
        out += [a.data for a in record.values()]
    for record in msg.content.config_records.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                out.append(item if isinstance(item, bytes) else str(item).encode())
    return b"".join(out)


def test_the_server_receives_no_plain_update_and_the_mean_is_win_weighted_fedavg():
    """4 clients with wins (3, 0, 5, 1): the unmasked result equals win_weighted_average within ``error_bound``
    (4 · 2·0.01/2^22 · 8/9 ≈ 1.7e-8 per value at the defaults), and no reply the server received holds any client's
    adapter θ_k or update Δ_k in float32 or float64, nor any ArrayRecord values at all."""
    cfg, theta = _cfg(), _theta()
    adapters, weights = _clients(theta, 4), [3, 0, 5, 1]
    out = _run(cfg, adapters, weights, theta)
    expected, _ = win_weighted_average(theta, adapters, weights)
    bound = error_bound(cfg, 4, sum(weights))
    assert bound == pytest.approx(4 * 2 * 0.01 / 2**22 * 8 / 9)
    assert out.rejected == {} and out.core.last_aggregated
    # both sides are rounded to float32: at most one ulp of values below 0.125 (7.5e-9) apart
    assert _max_error(out.new, expected) <= bound + 1e-8
    assert _max_error(out.new, theta) > 100 * bound  # the round moved the adapter
    received = b"".join(_all_bytes(m) for m in out.grid.received)
    assert received  # the masked vectors, keys and shares did arrive
    for adapter in adapters:
        for k, v in adapter.items():
            delta = v.astype(np.float64) - theta[k].astype(np.float64)
            for plain in (v, v.astype(np.float64), delta, delta.astype(np.float32)):
                assert plain.tobytes()[:64] not in received
    stage2 = [m for m in out.grid.received if "fitres.metrics" in m.content.config_records]
    assert len(stage2) == 4 and all(len(r) == 0 for m in stage2 for r in m.content.array_records.values())
    assert out.secure.record()["secagg"] == {"sampled": 4, "threshold": 3, "uploaded": 4, "weight_total": 9,
                                             "error_bound": bound, "array_values_received": 0}
    assert sorted(r.metrics["partition-id"] for r in out.replies) == [0, 1, 2, 3]


def test_a_second_round_on_the_same_nodes_runs_again():
    """The nodes keep their Context (SecAgg+ state) and the server its LegacyContext across rounds, as in a run:
    round 2 starts the protocol again from the setup stage and aggregates the new updates."""
    cfg, theta = _cfg(), _theta()
    adapters, weights = _clients(theta, 4), [3, 1, 5, 1]
    out = _run(cfg, adapters, weights, theta)
    config = ConfigRecord({"lr": 1e-3, "fedspear-config": json.dumps(cfg.to_dict()), LAYOUT_KEY: layout_of(theta)})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secagg, "client_app", out.legacy)
        replies, new, rejected, _ = out.secure.round(2, theta, config)
    expected, _ = win_weighted_average(theta, adapters, weights)
    assert rejected == {} and _max_error(new, expected) <= error_bound(cfg, 4, 10) + 1e-8


@pytest.mark.parametrize("rule", ["fedadam", "fedyogi"])
def test_server_optimisers_step_on_the_unmasked_mean(rule):
    """FedAdam / FedYogi (η = 1e-2) take the same step from the SecAgg+ mean as from the plain win-weighted mean
    (``WinWeightedFedAvg.server_step`` on either): the step's sensitivity to its input is at most
    η·(1 − β1)/τ = 0.2, so the quantisation error (< 2e-8) moves it by < 4e-9, below float32 rounding."""
    cfg, theta = _cfg(), _theta()
    adapters, weights = _clients(theta, 4), [3, 2, 5, 1]
    out = _run(cfg, adapters, weights, theta, server_opt=rule)
    plain = WinWeightedFedAvg(4, 4, server_opt=rule, server_lr=1e-2)
    expected = plain.server_step(theta, win_weighted_average(theta, adapters, weights)[0])
    assert out.core.opt_state.step == plain.opt_state.step == 1
    assert _max_error(out.new, expected) <= 1e-8
    assert _max_error(out.new, theta) > 1e-4  # the server step moved the adapter


def test_no_win_anywhere_keeps_the_adapter():
    """Every weight 0: Flower's unmasked ratio is 0/0; the zero-win guard (SPEC §4) keeps θ^(t) exactly."""
    theta = _theta()
    out = _run(_cfg(), _clients(theta, 4), [0, 0, 0, 0], theta)
    assert out.rejected == {} and not out.core.last_aggregated
    for k in theta:
        np.testing.assert_array_equal(out.new[k], theta[k])


def test_a_client_dropping_after_sharing_its_keys_is_tolerated_down_to_the_threshold():
    """4 clients, t = round(0.67·4) = 3: client 2 raises while training (after the key exchange) and client 3 goes
    silent from stage 3 (collect masked vectors) on; each alone leaves 3 ≥ t and the mean of the rest."""
    cfg, theta = _cfg(), _theta()
    adapters, weights = _clients(theta, 4), [3, 2, 5, 1]
    assert threshold(cfg, 4) == 3
    for fail, silent, gone in (({2: "node lost"}, None, 2), (None, {3}, 3)):
        out = _run(cfg, adapters, weights, theta, fail=fail,
                   silent={101 + 7 * 3: 3} if silent else None)  # calls: 0 discovery, 1 setup, 2 keys, 3 collect
        keep = [i for i in range(4) if i != gone]
        expected, _ = win_weighted_average(theta, [adapters[i] for i in keep], [weights[i] for i in keep])
        assert _max_error(out.new, expected) <= error_bound(cfg, 3, sum(weights[i] for i in keep)) + 1e-8
        node = out.node_of[gone]
        assert list(out.rejected) == [node] and "stage 'collect masked vectors'" in out.rejected[node]
        assert out.dropped == (set() if fail else {node})  # a raise is the client's error; silence is a drop-out


def test_below_the_threshold_the_round_fails_clearly():
    """Two of 4 clients leave after the key exchange: 2 < t = 3, Flower halts, no adapter, and every client's
    reason names the stage, the survivors and t."""
    theta = _theta()
    out = _run(_cfg(), _clients(theta, 4), [3, 2, 5, 1], theta, fail={1: "gone", 2: "gone"})
    assert out.new is None and not out.core.last_aggregated
    assert len(out.rejected) == 4
    assert all("2 of the 4 sampled clients left, fewer than the reconstruction threshold t = 3" in why
               for why in out.rejected.values())


def test_a_client_leaving_before_it_shared_its_keys_fails_the_round_in_flower_1_41():
    """Flower 1.41's unmask stage counts a client that left during 'share keys' as dead and asks the others for
    its key shares, which they never received (KeyError in ``secaggplus_mod._unmask``): the round halts with that
    reason on every client. Documented in ``fedspear.fl.secagg`` (dropped clients)."""
    theta = _theta()
    out = _run(_cfg(), _clients(theta, 4), [3, 2, 5, 1], theta, silent={101 + 7 * 3: 2})
    assert out.new is None and len(out.rejected) == 4
    assert out.rejected[101 + 7 * 3].startswith("left SecAgg+ at stage 'share keys': no reply")
    assert all("stage 'unmask': KeyError" in out.rejected[n] for n in (101, 108, 115))


def test_client_side_checks_refuse_before_masking():
    """Checks that replace the server's per-reply validation run on the client: a non-finite adapter, an update
    outside secagg_clipping_range (Flower would clip it silently) and a weight above secagg_max_weight are refused
    with the key to change; the round goes on with the others (3 of 4 = t)."""
    cfg, theta = _cfg(), _theta()
    for bad, weight, words in (("nan", 1, "non-finite"), ("big", 8, "exceeds secagg_clipping_range = 0.01"),
                               ("ok", 9, "exceeds secagg_max_weight = 8")):
        adapters = _clients(theta, 4)
        if bad == "nan":
            adapters[0]["layer.lora_A"][0, 0] = np.nan
        elif bad == "big":
            adapters[0]["layer.lora_B"][1, 1] += 0.02
        out = _run(cfg, adapters, [weight, 1, 1, 1], theta)
        node = out.node_of[0]
        assert list(out.rejected) == [node] and words in out.rejected[node], out.rejected
        assert out.new is not None


@pytest.mark.parametrize(("kw", "words"), [
    (dict(clients_per_round=2), "clients_per_round ≥ 3"),
    (dict(aggregation="median"), "cannot take a median"),
    (dict(dp="client"), "is not supported"),
    (dict(dp="server", dp_delta=1e-5), "is not supported"),
    (dict(num_clients=2000, clients_per_round=1024), r"below Flower's modulus 2\^32"),
    (dict(update_encoding="int8"), "quantises the masked update itself"),
    # t = max(2, round(0.55 · 4)) = 2 = m/2: not above it, whatever the fraction says
    (dict(num_clients=8, clients_per_round=4, secagg_threshold=0.55), "gives the reconstruction threshold t = 2, "
                                                                      "not above m/2.*at least 0.75"),
])
def test_settings_secaggplus_cannot_serve_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(**kw)


def test_every_accepted_threshold_is_above_half_the_clients():
    """For every client count and threshold the config accepts, Flower's t (``threshold``) exceeds m/2."""
    from fedspear.fl.secagg import threshold

    for m in range(3, 40):
        for share in [0.51 + i / 100 for i in range(50)]:
            try:
                cfg = _cfg(num_clients=max(m, 10), clients_per_round=m, secagg_threshold=share)
            except ConfigError:
                continue
            assert 2 * threshold(cfg, m) > m, (m, share)


@pytest.mark.slow
def test_a_tiny_secaggplus_run_through_the_simulation_engine(tmp_path):
    """Two rounds of GRPO (weight = prompts, so every client weighs 2) on the tiny model, 3 of 3 clients, through
    Flower's simulation engine with fedspear's ClientApp (its train handler passing the stages to the legacy
    one): both rounds run all four SecAgg+ stages (the second on
    nodes that kept their SecAgg+ state) and aggregate 3 uploads; no record carries a per-client update norm."""
    out = tmp_path / "run"
    cmd = [FEDSPEAR, "run", "--model", "tiny-random", "--rounds", "2", "--clients", "3", "--clients-per-round", "3",
           "--rollouts-per-round", "2", "--eval-size", "4", "-o", str(out), "--set", "algorithm=grpo",
           "--set", "secure_aggregation=secaggplus", "--set", "secagg_clipping_range=1.0", "--set", "max_new_tokens=4",
           "--set", "train_size=40", "--set", "lr=0.01", "--set", "group_size=2", "--set", "local_steps=1",
           "--set", "eval_generation=false"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["secagg"]["uploaded"] == 3 and r["secagg"]["threshold"] == 2 and r["aggregated"]
        assert r["secagg"]["array_values_received"] == 0
        assert r["clients_ok"] == 3 and all("update_norm" not in c for c in r["clients"])
