"""FedAdam / FedYogi server optimisers and the FedProx term (SPEC §4): against the equations of Reddi et al. 2021
written out independently here, against Flower's own strategies, and against numbers worked out by hand."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import fedspear.baseline_losses
import fedspear.server.server_opt
from fedspear.server.server_opt import ServerOptState, arrays_to_state, fedadam_step, fedyogi_step, state_to_arrays
from fedspear.losses import fedprox_term

ETA, BETA1, BETA2, TAU = 0.1, 0.9, 0.99, 0.005  # paper's beta1, beta2, tau; eta is ours
NAMES = ("layer.0.lora_A.weight", "layer.0.lora_B.weight", "odd/name")


def _random_rounds(seed: int = 0, rounds: int = 3):
    """A float64 global adapter and, per round, the aggregated adapter ``theta + noise``."""
    rng = np.random.default_rng(seed)
    shapes = {NAMES[0]: (4, 3), NAMES[1]: (3, 4), NAMES[2]: (5,)}
    theta = {name: rng.normal(size=shape) for name, shape in shapes.items()}
    noises = [{name: rng.normal(scale=0.1, size=shape) for name, shape in shapes.items()} for _ in range(rounds)]
    return theta, noises


def _reddi_reference(theta, noises, rule: str, eta_schedule):
    """Reddi et al. 2021, Alg. 2, line by line on plain numpy lists (v_{-1} = m_{-1} = 0, as Flower):
        Delta_t = avg_t - x_t
        m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
        v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                        (FedAdam)
        v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)    (FedYogi)
        x_{t+1} = x_t + eta_t m_t / (sqrt(v_t) + tau)
    ``eta_schedule(t)`` gives eta_t for the 1-based round t. Returns the x after each round."""
    names = list(theta)
    x = [theta[n].copy() for n in names]
    m = [np.zeros_like(a) for a in x]
    v = [np.zeros_like(a) for a in x]
    history = []
    for t, noise in enumerate(noises, start=1):
        avg = [x[i] + noise[n] for i, n in enumerate(names)]
        for i in range(len(x)):
            d = avg[i] - x[i]
            m[i] = BETA1 * m[i] + (1 - BETA1) * d
            if rule == "adam":
                v[i] = BETA2 * v[i] + (1 - BETA2) * d * d
            else:
                v[i] = v[i] - (1 - BETA2) * d * d * np.sign(v[i] - d * d)
            x[i] = x[i] + eta_schedule(t) * m[i] / (np.sqrt(v[i]) + TAU)
        history.append(dict(zip(names, [a.copy() for a in x])))
    return history


def _run_ours(theta, noises, step):
    state, x, history = ServerOptState(), dict(theta), []
    for noise in noises:
        averaged = {n: x[n] + noise[n] for n in x}
        x, state = step(x, averaged, state)
        history.append(x)
    return history, state


def _assert_close(ours, reference, tol=1e-6):
    for got, want in zip(ours, reference, strict=True):
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=tol, err_msg=name)


# ----------------------------------------------------------------------------------------------------------------------
# Against the equations
# ----------------------------------------------------------------------------------------------------------------------


def test_fedadam_without_bias_correction_is_reddi_alg2():
    """3 rounds on random arrays: bias_correction=False is Alg. 2 as printed (eta_t = eta)."""
    theta, noises = _random_rounds()
    ours, state = _run_ours(theta, noises, lambda x, a, s: fedadam_step(x, a, s, ETA, BETA1, BETA2, TAU,
                                                                        bias_correction=False))
    _assert_close(ours, _reddi_reference(theta, noises, "adam", lambda t: ETA), tol=1e-12)
    assert state.step == 3


def test_fedadam_default_uses_flowers_bias_correction():
    """Default: eta_t = eta sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)) with Flower's round t = 1, 2, 3
    (fedadam.py: ``np.power(beta_2, server_round + 1.0)``). Round 1: 0.1 * sqrt(1 - 0.9801) / (1 - 0.81) =
    0.1 * 0.141067 / 0.19 = 0.0742460."""
    theta, noises = _random_rounds(seed=1)
    schedule = lambda t: ETA * math.sqrt(1 - BETA2 ** (t + 1)) / (1 - BETA1 ** (t + 1))  # noqa: E731
    assert schedule(1) == pytest.approx(0.0742460, abs=1e-7)
    ours, _ = _run_ours(theta, noises, lambda x, a, s: fedadam_step(x, a, s, ETA))
    _assert_close(ours, _reddi_reference(theta, noises, "adam", schedule), tol=1e-12)


def test_fedyogi_is_reddi_alg2():
    """3 rounds of FedYogi on random arrays against Alg. 2 (no bias correction, eta_t = eta)."""
    theta, noises = _random_rounds(seed=2)
    ours, _ = _run_ours(theta, noises, lambda x, a, s: fedyogi_step(x, a, s, ETA))
    _assert_close(ours, _reddi_reference(theta, noises, "yogi", lambda t: ETA), tol=1e-12)


def test_one_and_two_steps_by_hand():
    """Scalar theta = 0, avg = 1 (Delta = 1), fresh state:
        m = 0.1 * 1 = 0.1; FedAdam v = 0.01 * 1 = 0.01; FedYogi v = 0 - 0.01 * 1 * sign(0 - 1) = 0.01
        no bias correction: theta = 0 + 0.1 * 0.1 / (sqrt(0.01) + 0.005) = 0.01 / 0.105 = 0.0952381
        Flower's FedAdam round 1: x 0.742460 -> 0.0707105
    Second FedYogi step with Delta = 0 (avg = theta): m = 0.9 * 0.1 = 0.09; v - 0.01 * 0 * sign(.) = 0.01 unchanged;
        theta = 0.0952381 + 0.1 * 0.09 / 0.105 = 0.0952381 + 0.0857143 = 0.1809524 (momentum keeps moving it)."""
    zero, one = {"w": np.array([0.0])}, {"w": np.array([1.0])}
    x, _ = fedadam_step(zero, one, ServerOptState(), ETA, bias_correction=False)
    assert x["w"].item() == pytest.approx(0.0952381, abs=1e-7)
    x, _ = fedadam_step(zero, one, ServerOptState(), ETA)
    assert x["w"].item() == pytest.approx(0.0707105, abs=1e-7)
    x, state = fedyogi_step(zero, one, ServerOptState(), ETA)
    assert x["w"].item() == pytest.approx(0.0952381, abs=1e-7)
    assert state.m["w"].item() == pytest.approx(0.1) and state.v["w"].item() == pytest.approx(0.01)
    x, state = fedyogi_step(x, dict(x), state, ETA)
    assert x["w"].item() == pytest.approx(0.1809524, abs=1e-7)
    assert state.v["w"].item() == pytest.approx(0.01) and state.step == 2


def test_explicit_server_round_changes_only_the_bias_correction():
    """server_round=5 on a fresh state: eta_t = 0.1 sqrt(1 - 0.99^6) / (1 - 0.9^6) = 0.1 * 0.241909 / 0.468559
    = 0.0516282; update 0.0516282 * 0.1 / 0.105 = 0.0491698."""
    x, state = fedadam_step({"w": np.array([0.0])}, {"w": np.array([1.0])}, ServerOptState(), ETA, server_round=5)
    assert x["w"].item() == pytest.approx(0.0491698, abs=1e-7)
    assert state.step == 1
    with pytest.raises(ValueError, match="server_round"):
        fedadam_step({"w": np.array([0.0])}, {"w": np.array([1.0])}, ServerOptState(), ETA, server_round=0)


# ----------------------------------------------------------------------------------------------------------------------
# Against Flower's own strategies
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def flower_task_identity(monkeypatch):
    """Flower's Message constructor reads the process's run id, normally set by the SuperLink runtime."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


@pytest.mark.parametrize("rule", ["adam", "yogi"])
def test_matches_flower_strategies(rule, flower_task_identity):
    """Run Flower's FedAdam / FedYogi ``aggregate_train`` (server rounds 1, 2, 3) with one reply holding the
    aggregated adapter, setting ``current_arrays`` as ``configure_train`` would, and compare with ours."""
    pytest.importorskip("flwr.serverapp.strategy")
    from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAdam, FedYogi

    strategy = (FedAdam if rule == "adam" else FedYogi)(eta=ETA, beta_1=BETA1, beta_2=BETA2, tau=TAU)
    step = fedadam_step if rule == "adam" else fedyogi_step
    theta, noises = _random_rounds(seed=3)
    ours, state, flower = dict(theta), ServerOptState(), dict(theta)
    for server_round, noise in enumerate(noises, start=1):
        averaged = {n: ours[n] + noise[n] for n in ours}
        ours, state = step(ours, averaged, state, ETA, BETA1, BETA2, TAU)

        strategy.current_arrays = {n: np.array(a) for n, a in flower.items()}
        flower_avg = {n: flower[n] + noise[n] for n in flower}
        content = RecordDict({"arrays": ArrayRecord({n: Array(a) for n, a in flower_avg.items()}),
                              "metrics": MetricRecord({"num-examples": 1})})
        reply = Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)
        record, _ = strategy.aggregate_train(server_round, [reply])
        flower = {n: a.numpy() for n, a in record.items()}
        _assert_close([ours], [flower], tol=1e-10)


# ----------------------------------------------------------------------------------------------------------------------
# State, dtypes, checkpointing, errors
# ----------------------------------------------------------------------------------------------------------------------


def test_inputs_untouched_dtypes_kept_and_fresh_arrays():
    """float32 adapters stay float32 (Flower would hand back float64); inputs and the old state are not modified;
    the returned arrays share no memory with the inputs."""
    theta = {"a": np.ones((2, 2), dtype=np.float32)}
    avg = {"a": np.full((2, 2), 2.0, dtype=np.float32)}
    state0 = ServerOptState()
    x1, state1 = fedadam_step(theta, avg, state0, ETA)
    assert x1["a"].dtype == np.float32 and not np.shares_memory(x1["a"], theta["a"])
    assert np.all(theta["a"] == 1.0) and np.all(avg["a"] == 2.0)
    assert state0.m == {} and state0.step == 0 and state1.step == 1
    x2, state2 = fedadam_step(x1, avg, state1, ETA)
    assert state1.step == 1 and not np.shares_memory(state2.m["a"], state1.m["a"])


def test_state_checkpoint_round_trip_resumes_identically():
    """state -> named arrays ("m/<name>", "v/<name>", "step") -> state gives the same next update as the
    uninterrupted run, for names containing '/' and '.'."""
    theta, noises = _random_rounds(seed=4)
    avg1 = {n: theta[n] + noises[0][n] for n in theta}
    x1, state1 = fedyogi_step(theta, avg1, ServerOptState(), ETA)
    arrays = state_to_arrays(state1)
    assert set(arrays) == {"step"} | {f"m/{n}" for n in NAMES} | {f"v/{n}" for n in NAMES}
    assert arrays["step"].dtype == np.int64 and arrays["step"].tolist() == [1]  # 1 element: safetensors has no 0-d
    restored = arrays_to_state(arrays)
    avg2 = {n: x1[n] + noises[1][n] for n in x1}
    direct, _ = fedyogi_step(x1, avg2, state1, ETA)
    resumed, resumed_state = fedyogi_step(x1, avg2, restored, ETA)
    _assert_close([resumed], [direct], tol=0)
    assert resumed_state.step == 2


def test_errors_are_clear():
    theta = {"a": np.zeros(3), "b": np.zeros(2)}
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        fedadam_step(theta, {"a": np.zeros(3)}, ServerOptState(), ETA)
    with pytest.raises(ValueError, match="'b' has shape"):
        fedyogi_step(theta, {"a": np.zeros(3), "b": np.zeros(3)}, ServerOptState(), ETA)
    _, state = fedadam_step({"a": np.zeros(3)}, {"a": np.ones(3)}, ServerOptState(), ETA)
    with pytest.raises(ValueError, match="state m"):
        fedadam_step(theta, theta, state, ETA)
    for kwargs, name in (({"eta": 0.0}, "eta"), ({"eta": ETA, "beta1": 1.0}, "beta1"),
                         ({"eta": ETA, "beta2": -0.1}, "beta2"), ({"eta": ETA, "tau": 0.0}, "tau")):
        with pytest.raises(ValueError, match=name):
            fedadam_step(theta, theta, ServerOptState(), **kwargs)
    with pytest.raises(ValueError, match="ServerOptState"):
        fedadam_step(theta, theta, {}, ETA)
    with pytest.raises(ValueError, match="no 'step'"):
        arrays_to_state({"m/a": np.zeros(3), "v/a": np.zeros(3)})
    with pytest.raises(ValueError, match="unexpected key"):
        arrays_to_state({"step": np.int64(1), "a": np.zeros(3)})
    with pytest.raises(ValueError, match="missing"):
        arrays_to_state({"step": np.int64(1), "m/a": np.zeros(3)})


# ----------------------------------------------------------------------------------------------------------------------
# FedProx
# ----------------------------------------------------------------------------------------------------------------------


def test_fedprox_term_by_hand():
    """theta = ([1, 2], [3]), theta_g = ([0, 0], [1]): ||.||^2 = 1 + 4 + 4 = 9; mu = 1e-3 -> 1e-3 / 2 * 9 = 0.0045.
    Gradient mu (theta - theta_g) = [1e-3, 2e-3], [2e-3]; the global copy gets none."""
    p1 = torch.tensor([1.0, 2.0], requires_grad=True)
    p2 = torch.tensor([3.0], requires_grad=True)
    g1 = torch.tensor([0.0, 0.0], requires_grad=True)
    term = fedprox_term([p1, p2], [g1, np.array([1.0])], 1e-3)
    assert term.item() == pytest.approx(0.0045, abs=1e-9)
    term.backward()
    assert p1.grad.tolist() == pytest.approx([1e-3, 2e-3]) and p2.grad.tolist() == pytest.approx([2e-3])
    assert g1.grad is None


def test_fedprox_term_mappings_bf16_zero_mu_and_errors():
    """Name -> tensor mappings pair by name (order irrelevant); bf16 parameters are summed in float32;
    mu = 0 gives 0 with a working backward; mismatches are clear ValueErrors."""
    params = {"a": torch.ones(2, requires_grad=True), "b": torch.zeros(3, requires_grad=True)}
    glob = {"b": torch.ones(3), "a": torch.zeros(2)}
    assert fedprox_term(params, glob, 2.0).item() == pytest.approx(1.0 * (2 + 3))
    bf = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    out = fedprox_term([bf], [torch.zeros(4)], 1.0)
    assert out.dtype == torch.float32 and out.item() == pytest.approx(2.0)
    zero = fedprox_term(params, glob, 0.0)
    zero.backward()
    assert zero.item() == 0.0
    with pytest.raises(ValueError, match="mu_prox"):
        fedprox_term(params, glob, -1e-3)
    with pytest.raises(ValueError, match="pair up"):
        fedprox_term([bf], [], 1e-3)
    with pytest.raises(ValueError, match="missing"):
        fedprox_term(params, {"a": torch.zeros(2)}, 1e-3)
    with pytest.raises(ValueError, match="shape"):
        fedprox_term([bf], [torch.zeros(5)], 1e-3)
    with pytest.raises(ValueError, match="both be sequences"):
        fedprox_term(params, [torch.zeros(2)], 1e-3)


def test_core_modules_do_not_import_flower():
    """STYLE habit 4: the maths runs without flwr -- neither module imports it."""
    for module in (fedspear.server.server_opt, fedspear.baseline_losses):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] == "flwr" for name in imported), module.__name__
