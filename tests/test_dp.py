"""Central differential privacy (``fedspear.fl.privacy``): clipping on both sides of the wire, the noise's standard
deviation, the ε the ledger reports, settings refused, resume of the ledger, and (slow) a tiny-model run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedspear.server.aggregation import fixed_denominator_mean
from fedspear.config import ConfigError, RunConfig
from fedspear.fl.privacy import STATE_FILE, PrivacyLedger, PrivateRounds, noise_rng, reply_norm_bound
from fedspear.fl.server_app import _count_unrecorded_release, _resume_ledger, _round_record
from fedspear.fl.records import LAYOUT_KEY, from_record, layout_of, to_record
from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.rundir import RunDir, RunDirError
from fedspear.server.server_opt import ServerOptState, fedadam_step
from fedspear.server.validation import update_norm

from helpers import error_reply, train_reply

pytestmark = pytest.mark.usefixtures("task_identity")
pytest.importorskip("dp_accounting", reason='the privacy accountant needs flwr[dp] (pip install "flwr[dp]")')

COUNTERS = {"num-losses": 0, "prompts": 4}


class FakeGrid:
    """What ``WinWeightedFedAvg.sample`` asks of a Grid: the connected node ids."""

    def __init__(self, n: int):
        self.nodes = list(range(100, 100 + n))

    def get_node_ids(self):
        return list(self.nodes)


def _cfg(**kw) -> RunConfig:
    base = dict(model="tiny-random", num_clients=8, clients_per_round=4, dp="server", dp_noise_multiplier=1.0,
                dp_clip_norm=1.0, dp_noise_seed=7)
    return RunConfig(**{**base, **kw})


def _private(cfg: RunConfig) -> tuple[WinWeightedFedAvg, PrivateRounds]:
    strategy = WinWeightedFedAvg(cfg.clients_per_round, cfg.num_clients, seed=cfg.seed, wait_seconds=0,
                                 max_update_norm=reply_norm_bound(cfg), dp_denominator=cfg.clients_per_round,
                                 dp_clip_norm=cfg.dp_clip_norm,
                                 server_opt=cfg.strategy if cfg.strategy in ("fedadam", "fedyogi") else None,
                                 server_lr=cfg.server_lr)
    return strategy, PrivateRounds(strategy, cfg)


def _configure(driver, theta: dict, server_round: int = 1, n_nodes: int = 8) -> list[Message]:
    config = ConfigRecord({"lr": 1e-3, LAYOUT_KEY: layout_of(theta)})
    return list(driver.configure_train(server_round, to_record(theta), config, FakeGrid(n_nodes)))


def _reply(node: int, arrays, wins: int = 1):
    return train_reply(node, arrays, {"weight": wins, "num-wins": wins, **COUNTERS})


THETA = {"a.lora_A": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "a.lora_B": np.zeros((4, 2), np.float32)}


def _shifted(theta: dict, direction: dict, norm: float) -> dict:
    """θ + Δ with Δ = ``direction`` scaled to L2 norm ``norm``."""
    length = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in direction.values()))
    return {k: (theta[k] + direction[k] * (norm / length)).astype(np.float32) for k in theta}


def _direction(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in THETA.items()}


# ---- settings ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "message"), [
    (dict(aggregation="median"), "calibrated for the mean of clipped updates only"),
    (dict(aggregation="trimmed_mean"), "calibrated for the mean of clipped updates only"),
    (dict(dp_delta=0.2), r"dp_delta = 0.2 is not below 1/num_clients = 0.125"),
    (dict(dp_clip_norm=0.0), "dp_clip_norm: 0.0 is out of range"),
    (dict(dp_noise_multiplier=-1.0), "dp_noise_multiplier: -1.0 is out of range"),
    (dict(dp="both"), "dp: 'both' is not allowed"),
])
def test_settings_that_void_the_guarantee_are_refused_with_the_reason(kw, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**kw)


def test_settings_without_dp_are_unchanged_and_compatible_ones_pass():
    RunConfig(aggregation="median", dp_delta=0.5)  # dp off: the DP keys are not consulted
    for kw in (dict(strategy="fedadam"), dict(strategy="fedyogi"), dict(strategy="fedprox"),
               dict(max_update_norm=5.0), dict(dp="client"), dict(dp_noise_multiplier=0.0)):
        _cfg(**kw)
    assert reply_norm_bound(_cfg(dp="client", dp_clip_norm=2.0)) == pytest.approx(2.002)  # C(1 + 1e-3)
    assert reply_norm_bound(_cfg(dp="client", dp_clip_norm=2.0, max_update_norm=1.5)) == 1.5
    assert reply_norm_bound(_cfg(dp="server")) is None  # the server clips; only max_update_norm would apply


# ---- the fixed-denominator mean --------------------------------------------------------------------------------------
def test_fixed_denominator_mean_by_hand():
    """θ = 0, three replies +1, +10, +100 with wins (1, 0, 3), m = 4 sampled (one did not reply):
    (1 + 100) / 4 = 25.25 — the zero-win client adds nothing, the silent one counts as a zero update, the
    denominator stays 4. The win-weighted mean would give (1 + 300) / 4 = 75.25."""
    theta = {"w": np.zeros((2, 3), np.float32)}
    clients = [{"w": theta["w"] + d} for d in (1.0, 10.0, 100.0)]
    out = fixed_denominator_mean(theta, clients, [1, 0, 3], 4)
    np.testing.assert_allclose(out["w"], 25.25)
    assert out["w"].dtype == np.float32
    out = fixed_denominator_mean(theta, clients, [0, 0, 0], 4)  # no zero-win guard needed: θ + 0
    np.testing.assert_array_equal(out["w"], theta["w"])
    with pytest.raises(ValueError, match="at least the 3 clients"):
        fixed_denominator_mean(theta, clients, [1, 1, 1], 2)


def test_fixed_denominator_mean_holds_every_update_to_c_itself():
    """C = 1, m = 2, θ = (1, 1): Δ = (3, 4) (norm 5) is scaled to (0.6, 0.8); Δ = (0.3, 0.4) (norm 0.5) is kept:
    θ + ((0.6, 0.8) + (0.3, 0.4)) / 2 = (1.45, 1.6). A reply 5e-4 over C (inside the server's slack) is scaled to
    exactly C, so one client moves the mean by at most C/m = 0.5."""
    theta = {"a": np.ones(1, np.float64), "b": np.ones(1, np.float64)}
    clients = [{"a": np.array([4.0]), "b": np.array([5.0])}, {"a": np.array([1.3]), "b": np.array([1.4])}]
    out = fixed_denominator_mean(theta, clients, [1, 1], 2, clip_norm=1.0)
    np.testing.assert_allclose([out["a"][0], out["b"][0]], [1.45, 1.6], rtol=1e-12)
    over = {"a": np.array([1.0 + 0.6 * 1.0005]), "b": np.array([1.0 + 0.8 * 1.0005])}
    moved = fixed_denominator_mean(theta, [over], [1], 2, clip_norm=1.0)
    assert math.hypot(moved["a"][0] - 1, moved["b"][0] - 1) == pytest.approx(0.5, rel=1e-12)
    with pytest.raises(ValueError, match="clip_norm must be positive"):
        fixed_denominator_mean(theta, clients, [1, 1], 2, clip_norm=0.0)


# ---- (a) clipping, checked where the server receives the replies -----------------------------------------------------
def test_server_side_clipping_bounds_every_update_the_strategy_receives():
    """dp = server, z = 0 (no noise, so the average is checked exactly): updates of norm 10, 3, 0.5 and C = 1. The
    replies the inner strategy aggregates (``last_replies``, after Flower's clipping) have ‖Δ_k‖ ≤ C; the first two
    are scaled to exactly C in their own direction, the third is untouched. Average = θ + (d1 + d2 + 0.5·d3)/4 where
    d_i are unit directions (m = 4: one sampled client did not reply)."""
    cfg = _cfg(dp="server", dp_noise_multiplier=0.0)
    strategy, private = _private(cfg)
    messages = _configure(private, THETA)
    assert len(messages) == 4
    dirs = [_direction(i) for i in range(3)]
    replies = [_reply(100 + i, _shifted(THETA, d, n)) for i, (d, n) in enumerate(zip(dirs, (10.0, 3.0, 0.5)))]
    out, rejected, dropped = private.aggregate_train(1, replies)
    assert rejected == {} and dropped == set() and strategy.last_aggregated
    layout = layout_of(THETA)
    received = [from_record(r.content["arrays"], layout) for r in strategy.last_replies]
    norms = [update_norm(THETA, r) for r in received]
    assert max(norms) <= cfg.dp_clip_norm * (1 + 1e-6)
    assert norms == pytest.approx([1.0, 1.0, 0.5], rel=1e-5)
    # the norms the round record logs per client are those the average used (after clipping)
    assert strategy.update_norms == pytest.approx({100: 1.0, 101: 1.0, 102: 0.5}, rel=1e-5)
    record = _round_record(1, 1e-3, replies, True, {}, strategy.update_norms)
    assert [c["update_norm"] for c in record["clients"]] == pytest.approx([1.0, 1.0, 0.5], rel=1e-5)
    unit = [_shifted({k: np.zeros_like(v) for k, v in THETA.items()}, d, 1.0) for d in dirs]
    expected = {k: THETA[k] + (unit[0][k] + unit[1][k] + 0.5 * unit[2][k]) / 4 for k in THETA}
    for k in THETA:
        np.testing.assert_allclose(out[k], expected[k], atol=1e-6)
    assert private.ledger.releases == 1


def test_client_side_clipping_happens_in_the_clientapp_and_the_server_checks_it(monkeypatch):
    """dp = client: the ClientApp (with its train-handler mod) receives C = 0.5 in the config and replies with an
    update of norm ≤ C although training moved it by 10; the server decodes the reply and finds ‖Δ‖ ≤ C. A reply
    that skipped the mod (norm 10) is rejected by the server's bound C(1 + 1e-3). The query handler still answers."""
    from fedspear.fl import client_app

    cfg = _cfg(dp="client", dp_clip_norm=0.5, dp_noise_multiplier=0.0)
    strategy, private = _private(cfg)
    direction = _direction(1)

    def fake_round(cfg_, node, arrays, server_round, lr):
        return _shifted(arrays, direction, 10.0), {"weight": 2, "num-wins": 2, **COUNTERS}

    monkeypatch.setattr(client_app._RUNNER, "round", fake_round)
    config = ConfigRecord({"lr": 1e-3, "server-round": 1, "fedspear-config": json.dumps(cfg.to_dict()),
                           LAYOUT_KEY: layout_of(THETA)})
    messages = list(private.configure_train(1, to_record(THETA), config, FakeGrid(8)))
    assert messages[0].content["config"]["clipping_norm"] == 0.5  # set by Flower's client-side wrapper
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply = client_app.app(messages[0], context)
    assert not reply.has_error()
    assert list(reply.content["arrays"].keys()) == ["adapter"]
    sent = from_record(messages[0].content["arrays"], layout_of(THETA))
    assert update_norm(sent, from_record(reply.content["arrays"], layout_of(THETA))) <= 0.5 * (1 + 1e-6)

    reply.metadata.__dict__["_src_node_id"] = 100
    unclipped = _reply(101, _shifted(THETA, direction, 10.0), wins=2)
    out, rejected, _ = private.aggregate_train(1, [reply, unclipped])
    assert list(rejected) == [101] and "exceeds the bound 0.5005" in rejected[101]
    received = [from_record(r.content["arrays"], layout_of(THETA)) for r in strategy.last_replies]
    assert len(received) == 1 and update_norm(THETA, received[0]) <= 0.5 * (1 + 1e-6)
    np.testing.assert_allclose(update_norm(THETA, out), 0.5 / 4, rtol=1e-4)  # one update of norm C, m = 4

    query = Message(content=RecordDict({"config": ConfigRecord({})}), dst_node_id=1, message_type=MessageType.QUERY)
    answer = client_app.app(query, context)
    assert not answer.has_error() and answer.content["metrics"]["partition-id"] == 0


def test_an_exact_zero_update_is_aggregated_not_crashed_on(monkeypatch):
    """Flower's flat clipping divides C by the update norm, so Δ = 0 (a client with nothing to train on) raised
    ZeroDivisionError in the mod and in the server-side wrapper. Client side: the ClientApp replies without error;
    server side: the zero reply counts as a zero update (z = 0: θ + Δ_1/4) and an all-zero round is still released."""
    from fedspear.fl import client_app

    cfg = _cfg(dp="client", dp_noise_multiplier=0.0)
    _, private = _private(cfg)
    monkeypatch.setattr(client_app._RUNNER, "round", lambda c, n, arrays, r, lr: (
        {k: v.copy() for k, v in arrays.items()}, {"weight": 0, "num-wins": 0, **COUNTERS}))
    config = ConfigRecord({"lr": 1e-3, "server-round": 1, "fedspear-config": json.dumps(cfg.to_dict()),
                           LAYOUT_KEY: layout_of(THETA)})
    message = list(private.configure_train(1, to_record(THETA), config, FakeGrid(8)))[0]
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply = client_app.app(message, context)
    assert not reply.has_error()
    assert update_norm(THETA, from_record(reply.content["arrays"], layout_of(THETA))) == 0

    strategy, private = _private(_cfg(dp="server", dp_noise_multiplier=0.0))
    _configure(private, THETA)
    moved = _shifted(THETA, _direction(3), 0.5)
    out, rejected, _ = private.aggregate_train(1, [_reply(100, dict(THETA)), _reply(101, moved)])
    assert rejected == {} and len(strategy.last_replies) == 2 and strategy.extra_replies == []
    for k in THETA:
        np.testing.assert_allclose(out[k], THETA[k] + (moved[k] - THETA[k]) / 4, atol=1e-7)
    _configure(private, THETA, server_round=2)
    out, _, _ = private.aggregate_train(2, [_reply(100, dict(THETA)), _reply(101, dict(THETA))])
    assert out is not None and private.ledger.releases == 2


def test_error_and_rejected_replies_are_excluded_before_the_wrapper_and_count_as_zero_updates():
    """Flower's wrapper skips a whole round when any reply is an error; fedspear removes such replies first, so the
    healthy reply is aggregated with the fixed denominator: θ + Δ/4 (z = 0), and the reasons are kept."""
    cfg = _cfg(dp="server", dp_noise_multiplier=0.0)
    strategy, private = _private(cfg)
    _configure(private, THETA)
    good = _shifted(THETA, _direction(2), 0.8)
    nan = {**THETA, "a.lora_A": np.full((3, 4), np.nan, np.float32)}
    out, rejected, dropped = private.aggregate_train(1, [_reply(100, good), error_reply(101), _reply(102, nan)])
    assert set(rejected) == {101, 102} and "injected crash" in rejected[101] and "non-finite" in rejected[102]
    assert dropped == {101}  # error code 0 (unknown) is not an exception raised by the client's code
    for k in THETA:
        np.testing.assert_allclose(out[k], THETA[k] + (good[k] - THETA[k]) / 4, atol=1e-7)
    assert private.ledger.releases == 1
    out, rejected, _ = private.aggregate_train(2, [error_reply(101)])  # nothing accepted: nothing released
    assert out is None and private.ledger.releases == 1 and not strategy.last_aggregated


# ---- (b) the noise -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["client", "server"])
def test_noise_has_std_z_c_over_m_and_is_absent_without_dp(side):
    """z = 1.5, C = 2, m = 4 → σ = 1.5·2/4 = 0.75, also when only 3 of the 4 sampled clients reply (m is fixed;
    σ over the replies would be 1.0). Every reply equals θ (zero update, so clipping is moot), so the
    released adapter minus θ is the noise alone: 200,000 values whose sample std must lie within 1% of σ (the
    sample std of n normals has relative standard error 1/√(2n) = 0.16%, so 1% is over 6 standard errors) and whose
    mean within 5σ/√n of 0. Without DP the same replies give θ exactly."""
    theta = {"w": np.zeros((400, 500), np.float32)}
    cfg = _cfg(dp=side, dp_noise_multiplier=1.5, dp_clip_norm=2.0, dp_noise_seed=11)
    strategy, private = _private(cfg)
    _configure(private, theta)
    replies = [_reply(100 + i, {"w": theta["w"].copy()}, wins=i) for i in range(3)]  # 3 of m = 4 replied
    out, _, _ = private.aggregate_train(1, replies)
    noise = out["w"].astype(np.float64).ravel()
    assert private.ledger.sigma == 0.75
    assert abs(noise.std() / 0.75 - 1) < 0.01
    assert abs(noise.mean()) < 5 * 0.75 / math.sqrt(noise.size)

    plain = WinWeightedFedAvg(4, 8, wait_seconds=0)
    _configure(plain, theta)
    record, _ = plain.aggregate_train(1, [_reply(100 + i, {"w": theta["w"].copy()}, wins=1) for i in range(4)])
    np.testing.assert_array_equal(from_record(record, layout_of(theta))["w"], theta["w"])


def test_noise_rng_is_secret_by_default_seeded_for_tests_and_leaves_numpy_alone():
    """Each round's noise comes from NumPy's global RNG (Flower's choice), reseeded inside ``noise_rng``: from OS
    entropy (two draws differ even after ``np.random.seed(0)``, which transformers' set_seed does) or, in tests,
    from (dp_noise_seed, round). The process's own global RNG stream is restored afterwards."""
    def draw(seed, server_round):
        np.random.seed(0)
        with noise_rng(seed, server_round):
            noise = np.random.normal(size=5)
        return noise, np.random.rand()

    (a, after_a), (b, after_b) = draw(None, 1), draw(None, 1)
    assert not np.array_equal(a, b)
    np.random.seed(0)
    assert after_a == after_b == np.random.rand()  # the outer stream continues as if nothing happened
    assert np.array_equal(draw(3, 1)[0], draw(3, 1)[0]) and not np.array_equal(draw(3, 1)[0], draw(3, 2)[0])


def test_server_optimiser_steps_on_the_noised_average():
    """FedAdam under DP = post-processing: the result equals fedadam_step(θ, noised average), where the noised
    average is what the same round gives without the optimiser (same noise seed)."""
    rng = np.random.default_rng(0)
    clients = [{k: (v + 0.1 * rng.normal(size=v.shape)).astype(np.float32) for k, v in THETA.items()} for _ in range(4)]

    def run(strategy_name):
        strategy, private = _private(_cfg(strategy=strategy_name, server_lr=0.01, dp_noise_multiplier=0.5))
        _configure(private, THETA)
        out, _, _ = private.aggregate_train(1, [_reply(100 + i, c) for i, c in enumerate(clients)])
        return out, strategy

    noised, _ = run("fedavg")
    out, strategy = run("fedadam")
    expected, state = fedadam_step(THETA, noised, ServerOptState(), eta=0.01, beta1=0.9, beta2=0.99, tau=0.005)
    for k in THETA:
        np.testing.assert_allclose(out[k], expected[k], rtol=1e-6, atol=1e-7)
    assert strategy.opt_state.step == state.step == 1


# ---- (c) accounting ------------------------------------------------------------------------------------------------
def test_epsilon_by_hand_for_one_gaussian_release():
    """q = 1 (no amplification), z = 1, T = 1, δ = 1e-5. The RDP of the Gaussian mechanism is α/(2z²) per release;
    dp-accounting converts with ε = min_α [Tα/(2z²) + ln(1 − 1/α) − (ln δ + ln α)/(α − 1)] over its order grid,
    whose best order is α = 5.4: 2.7 + ln(0.814815) − ln(5.4e-5)/4.4 = 2.7 − 0.204794 + 2.233301 = 4.728507."""
    ledger = PrivacyLedger(_cfg(dp_noise_multiplier=1.0, dp_delta=1e-5))
    assert ledger.epsilon == 0.0
    ledger.release()
    assert ledger.epsilon == pytest.approx(4.728507, abs=1e-6)
    alpha = 5.4
    assert 1 * alpha / 2 + math.log(1 - 1 / alpha) - (math.log(1e-5) + math.log(alpha)) / (alpha - 1) \
        == pytest.approx(4.728507, abs=1e-6)


def test_reported_epsilon_equals_the_accountant_and_survives_a_resume(tmp_path):
    """z = 0.8, N = 10, m = 2, δ = 1e-5: after each of T = 1…4 releases the ledger's ε equals a fresh
    RdpAccountant composed T times at once (no amplification), and it rises. The state saved beside the adapter
    restores the same ε; state from other settings or disagreeing with metrics.jsonl is refused."""
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod


    cfg = _cfg(num_clients=10, clients_per_round=2, dp_noise_multiplier=0.8)
    ledger, eps = PrivacyLedger(cfg), []
    for t in range(1, 5):
        ledger.release()
        reference = RdpAccountant(PrivacyConfig(1e-5, 10, NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                SamplingMethod.NO_AMPLIFICATION))
        reference.compose(GaussianPrivacyEvent(0.8, 2, 10), count=t)
        assert ledger.epsilon == reference.get_epsilon(1e-5)
        eps.append(ledger.record()["dp_epsilon"])
    assert eps == sorted(eps) and len(set(eps)) == 4

    run = RunDir(tmp_path)
    run.save_adapter(4, THETA, None, json_state={STATE_FILE: ledger.state_dict()})
    _, private = _private(cfg)
    _resume_ledger(private, run, 4, {"round": 4, "dp_releases": 4})
    assert private.ledger.epsilon == ledger.epsilon and private.ledger.releases == 4
    with pytest.raises(RunDirError, match="metrics.jsonl's round 4 says 3"):
        _resume_ledger(_private(cfg)[1], run, 4, {"round": 4, "dp_releases": 3})
    with pytest.raises(RunDirError, match="does not match"):
        _resume_ledger(_private(_cfg(num_clients=10, clients_per_round=2, dp_noise_multiplier=0.8,
                                     dp_delta=1e-6))[1], run, 4, {"round": 4, "dp_releases": 4})
    with pytest.raises(RunDirError, match="cannot resume without its privacy accountant state"):
        _resume_ledger(_private(cfg)[1], run, 3, {"round": 3, "dp_releases": 3})


def test_a_noised_adapter_saved_but_not_recorded_stays_counted(tmp_path):
    """A kill between saving round 5's noised adapter and appending its record: the resume redoes round 5, so the
    saved adapter's release must stay in the ledger (6 releases for 5 rounds afterwards); killed there twice, both
    stay. An orphan whose ledger state is behind the resumed one is refused; one level with it (an empty round:
    nothing released) or no orphan changes nothing."""

    cfg = _cfg(num_clients=10, clients_per_round=2, dp_noise_multiplier=0.8)
    ledger = PrivacyLedger(cfg)
    run = RunDir(tmp_path)
    for t in range(1, 6):
        ledger.release()
        run.save_adapter(t, THETA, None, json_state={STATE_FILE: ledger.state_dict()})
    _, private = _private(cfg)
    _resume_ledger(private, run, 4, {"round": 4, "dp_releases": 4})
    _count_unrecorded_release(private, run, 4)
    assert private.ledger.releases == 5 and private.ledger.epsilon == ledger.epsilon
    _, fresh = _private(cfg)
    _resume_ledger(fresh, run, 5, {"round": 5, "dp_releases": 5})
    _count_unrecorded_release(fresh, run, 5)  # no round 6 saved: unchanged
    assert fresh.ledger.releases == 5
    _, twice = _private(cfg)
    _resume_ledger(twice, run, 3, {"round": 3, "dp_releases": 3})
    _count_unrecorded_release(twice, run, 3)  # round 4's state, one ahead
    assert twice.ledger.releases == 4
    ledger.release()  # round 5 redone and saved again (6 releases), killed again before its record
    run.save_adapter(5, THETA, None, json_state={STATE_FILE: ledger.state_dict()})
    _, again = _private(cfg)
    _resume_ledger(again, run, 4, {"round": 4, "dp_releases": 4})
    _count_unrecorded_release(again, run, 4)
    assert again.ledger.releases == 6 and again.ledger.epsilon == ledger.epsilon
    for releases in (4, 3):  # round 5 saved with as many releases as round 4 (an empty round), or fewer
        saved = PrivacyLedger(cfg)
        for _ in range(releases):
            saved.release()
        run.save_adapter(5, THETA, None, json_state={STATE_FILE: saved.state_dict()})
        _, resumed = _private(cfg)
        _resume_ledger(resumed, run, 4, {"round": 4, "dp_releases": 4})
        if releases == 4:
            _count_unrecorded_release(resumed, run, 4)
            assert resumed.ledger.releases == 4
        else:
            with pytest.raises(RunDirError, match="without a matching privacy accountant state"):
                _count_unrecorded_release(resumed, run, 4)


def test_a_resumed_adapter_is_packed_in_the_models_order(tmp_path):
    """safetensors gives a saved adapter back in its own order; seeded noise is drawn over the flat buffer, so a
    resumed run must pack in the model's order to add the same noise to the same tensors as an uninterrupted one
    (found by the slow test below: before this, its round 2 differed after a resume)."""
    from fedspear.fl.server_app import in_model_order

    model = {"z.lora_A": np.zeros(2, np.float32), "a.lora_B": np.ones(3, np.float32)}
    run = RunDir(tmp_path)
    run.save_adapter(1, model, None)
    assert list(run.load_adapter(1)) == ["a.lora_B", "z.lora_A"]  # the file's order, not the model's
    loaded = in_model_order(run.load_adapter(1), model, "here")
    assert list(loaded) == ["z.lora_A", "a.lora_B"] and layout_of(loaded) == layout_of(model)
    with pytest.raises(RunDirError, match="tensors differ from the model's"):
        in_model_order({"z.lora_A": model["z.lora_A"]}, model, "here")


def test_zero_noise_reports_infinite_epsilon():
    ledger = PrivacyLedger(_cfg(dp_noise_multiplier=0.0))
    ledger.release()
    assert ledger.epsilon == math.inf and ledger.record()["dp_epsilon"] is None and ledger.record()["dp_sigma"] == 0


def test_report_shows_the_dp_settings_and_epsilon_per_round(tmp_path):
    """report.md names the clipping side, C, z, σ and the last ε; the per-round table gains an ε column (∞ for
    z = 0); without DP neither appears."""
    from fedspear.report import write_report

    def record(r, eps):
        return {"round": r, "lr": 1e-4, "prompts": 4, "wins": 1, "losses": 2, "revisions_successful": 0,
                "revisions_attempted": 1, "tokens_generated": 10, "initial_correct": 1, "initial_samples": 4,
                "seconds": {"generate_initial": 1.0, "generate_revisions": 0.5, "train": 1.0, "evaluate": 0.0,
                            "flower_overhead": 0.1, "round": 3.0},
                "eval": None, "wall_clock": 3.0 * r, "dp_epsilon": eps, "dp_delta": 1e-5, "dp_releases": r}
    zero = {"round": 0, "eval": {"n": 4, "acc_ll": 0.5, "acc_ll_low": 0.1, "acc_ll_high": 0.9}, "wall_clock": 0.0,
            "seconds": {"evaluate": 1.0}}
    cfg = _cfg(dp="client", num_clients=8, clients_per_round=4, dp_clip_norm=0.5, dp_noise_multiplier=2.0)
    text = write_report(tmp_path, [zero, record(1, 4.7285), record(2, 7.0774)], cfg, dtype="fp32").read_text()
    assert "**client-side clipping**, C = 0.5, z = 2, σ = z·C/4 = 0.25; **ε = 7.077 at δ = 1e-05** after 2" in text
    assert "| ε |" in text and "| 4.729 |" in text and "dp_noise_seed = 7" in text
    text = write_report(tmp_path, [zero, record(1, None)], _cfg(dp_noise_multiplier=0.0), dtype="fp32").read_text()
    assert "**ε = ∞ at δ = 1e-05**" in text and "| ∞ |" in text
    plain = write_report(tmp_path, [zero, {k: v for k, v in record(1, 1.0).items() if not k.startswith("dp_")}],
                         RunConfig(model="tiny-random"), dtype="fp32").read_text()
    assert "ε" not in plain and "differential privacy" not in plain


# ---- (d, e) end to end ---------------------------------------------------------------------------------------------
FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_dp_run_reports_rising_epsilon_and_a_kill_mid_round_resumes_to_the_same_adapter_and_epsilon(tmp_path):
    """dp = client on the tiny model (fp32) through the Flower simulation engine, 3 rounds of 2 clients with seeded
    noise: every round records ε (rising), σ = z·C/m, δ and its releases, and the terminal and report.md show ε.
    Then kill -9 of the whole run (CLI and Ray) while a client is at work on round 2 (as test_reliability's resume
    test), and the same command: the same final adapter as the run never interrupted (max |Δθ| ≤ 1e-6; same
    packing), the same ε and releases per round, and clipping that bit (every aggregated update has norm C = 1e-3;
    the flipped user makes every answer a win, so no update is zero; the zero-update path of ``dp_clipping_mod`` is
    test_an_exact_zero_update_is_aggregated_not_crashed_on's)."""
    from safetensors.numpy import load_file

    from helpers import kill_run_inside_round

    args = ["run", "--model", "tiny-random", "--rounds", "3", "--clients", "2", "--clients-per-round", "2",
            "--rollouts-per-round", "4", "--eval-size", "4", "--dtype", "fp32", "--set", "local_steps=2",
            "--set", "batch_size=2", "--set", "eval_every=3", "--set", "train_size=40", "--set", "max_new_tokens=8",
            "--set", "lr=0.001", "--set", "user_flip_prob=1.0", "--set", "dp=client", "--set", "dp_clip_norm=1e-3",
            "--set", "dp_noise_multiplier=1.0", "--set", "dp_noise_seed=5"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = subprocess.run([FEDSPEAR, *args, "-o", str(whole)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = _records(whole)[1:]
    assert [r["round"] for r in trained] == [1, 2, 3]
    assert all(r["clients_ok"] == 2 and r["aggregated"] for r in trained)
    assert 0 < trained[0]["dp_epsilon"] < trained[1]["dp_epsilon"] < trained[2]["dp_epsilon"]
    assert all(r["dp_sigma"] == pytest.approx(1.0 * 1e-3 / 2) and r["dp_delta"] == 1e-5 for r in trained)
    assert "ε" in proc.stderr and "ε = " in (whole / "report.md").read_text()
    assert (whole / "adapters" / "round_0003" / STATE_FILE).is_file()
    kill_run_inside_round([FEDSPEAR, *args, "-o", str(killed)], killed, server_round=2, env=env)
    assert [r["round"] for r in _records(killed)] == [0, 1]
    proc = subprocess.run([FEDSPEAR, *args, "-o", str(killed)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr

    a, b = (load_file(out / "adapters" / "round_0003" / "adapter_model.safetensors") for out in (whole, killed))
    assert set(a) == set(b) and max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6
    first, again = _records(whole)[1:], _records(killed)[1:]
    assert [(r["dp_releases"], r["dp_epsilon"]) for r in first] == [(r["dp_releases"], r["dp_epsilon"]) for r in again]
    assert ([r["dp_releases"] for r in first] == [1, 2, 3]
            and first[0]["dp_epsilon"] == pytest.approx(4.728507, abs=1e-6))
    norms = [c["update_norm"] for r in first for c in r["clients"]]
    assert len(norms) == 6 and all(n == pytest.approx(1e-3, rel=1e-3) for n in norms), norms
