"""Server optimisers FedAdam / FedYogi (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2) on named numpy
arrays, and the FedProx proximal term (Li et al. 2020) in torch. No Flower import (SPEC §4; STYLE habit 4).

The federated layer aggregates the clients' adapters (:func:`fedspear.server.aggregation.win_weighted_average`), then
calls :func:`fedadam_step` / :func:`fedyogi_step` with the broadcast adapter ``theta^(t)`` and the average; the server
optimiser treats ``Delta = avg - theta^(t)`` as a pseudo-gradient (an ascent direction) and returns
``theta^(t+1)``. When aggregation reports ``aggregated=False`` (no client won anything, SPEC §4 **Decision**) the
caller keeps the adapter and skips the server step, so the moments are not decayed towards a zero update.

Update (per tensor, elementwise), exactly as Flower 1.x implements it (``flwr/serverapp/strategy/fedopt.py``,
``fedadam.py``, ``fedyogi.py``)::

    Delta = avg - theta
    m     = beta1 * m + (1 - beta1) * Delta                                  (m starts at 0)
    v     = beta2 * v + (1 - beta2) * Delta**2                               FedAdam   (v starts at 0)
    v     = v - (1 - beta2) * Delta**2 * sign(v - Delta**2)                  FedYogi
    theta = theta + eta_t * m / (sqrt(v) + tau)

- ``tau`` is added to ``sqrt(v)`` (Reddi et al.'s "degree of adaptivity"), not inside the square root.
- FedAdam: ``eta_t = eta * sqrt(1 - beta2**(round + 1)) / (1 - beta1**(round + 1))``, Adam's bias correction
  (Kingma & Ba 2015, the line before §2.1) as Flower applies it -- with Flower's exponent ``server_round + 1``
  where ``server_round`` starts at 1, i.e. one step ahead of Kingma & Ba's ``t`` (the first update is scaled by
  ``sqrt(1 - 0.99**2) / (1 - 0.9**2) = 0.742460``, not 1). ``bias_correction=False`` gives Reddi et al.'s Alg. 2,
  which has none (``eta_t = eta``).
- FedYogi: no bias correction (Flower and Reddi et al. agree), ``eta_t = eta``.
- Both moments start at 0 (Flower), where Reddi et al.'s Alg. 2 allows ``v_{-1} >= tau**2``.

Departures from Flower, all numerical only: the update is computed in float64 and each new tensor is cast back to the
global tensor's dtype (Flower returns float64 arrays for float32 inputs under NumPy 2 promotion rules and keeps its
moments in the input dtype); the moments are stored in float64. Results agree with Flower to float32 round-off for
float32 adapters and exactly (1e-12) for float64 ones -- ``tests/test_server_opt.py`` runs Flower's own strategies.

Paper values (appendix, FL-strategy paragraph): ``beta1 = 0.9``, ``beta2 = 0.99``, ``tau = 0.005``; FedProx
``mu_prox = 1e-3``. The server learning rate ``eta`` is not given in the paper and is configurable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .aggregation import check_same_layout

Arrays = Mapping[str, np.ndarray]

STEP_KEY = "step"
M_PREFIX = "m/"
V_PREFIX = "v/"


@dataclass
class ServerOptState:
    """Server-optimiser state: first and second moments per named tensor, and the number of updates taken.

    Attributes:
        m: name -> first moment (float64, the global tensor's shape). Empty before the first update (then zeros).
        v: name -> second moment, same names and shapes as ``m``.
        step: updates taken so far (0 before the first). FedAdam's bias correction uses ``step + 1`` as Flower's
            ``server_round`` unless a round is given explicitly.

    Checkpoint it with :func:`state_to_arrays` and restore with :func:`arrays_to_state`.
    """

    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)
    step: int = 0


# ----------------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------------


def _check_hyper(eta, beta1, beta2, tau) -> None:
    checks = (
        ("eta", eta, lambda x: x > 0, "> 0 (the server learning rate)"),
        ("beta1", beta1, lambda x: 0 <= x < 1, "in [0, 1) (paper: 0.9)"),
        ("beta2", beta2, lambda x: 0 <= x < 1, "in [0, 1) (paper: 0.99)"),
        ("tau", tau, lambda x: x > 0, "> 0 (the adaptivity constant; paper: 0.005)"),
    )
    for name, value, ok, why in checks:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"{name} must be a finite number {why}, got {value!r}")


def _moments(state: ServerOptState, global_arrays: Arrays) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The state's moments as float64 arrays, zeros if the state is fresh; ValueError if they do not fit."""
    if not isinstance(state, ServerOptState):
        raise ValueError(f"state must be a ServerOptState (ServerOptState() for a fresh one), got "
                         f"{type(state).__name__}")
    if not state.m and not state.v:
        zeros = {name: np.zeros(np.shape(x), dtype=np.float64) for name, x in global_arrays.items()}
        return zeros, {name: z.copy() for name, z in zeros.items()}
    check_same_layout(global_arrays, state.m, "server optimiser state m")
    check_same_layout(global_arrays, state.v, "server optimiser state v")
    m = {name: np.asarray(state.m[name], dtype=np.float64) for name in global_arrays}
    v = {name: np.asarray(state.v[name], dtype=np.float64) for name in global_arrays}
    return m, v


def _server_step(
    rule: str,
    global_arrays: Arrays,
    averaged: Arrays,
    state: ServerOptState,
    eta: float,
    beta1: float,
    beta2: float,
    tau: float,
    server_round: int | None,
    bias_correction: bool,
) -> tuple[dict[str, np.ndarray], ServerOptState]:
    _check_hyper(eta, beta1, beta2, tau)
    check_same_layout(global_arrays, averaged, "averaged adapter")
    m, v = _moments(state, global_arrays)
    if server_round is None:
        server_round = state.step + 1
    if isinstance(server_round, bool) or not isinstance(server_round, (int, np.integer)) or server_round < 1:
        raise ValueError(f"server_round must be an integer >= 1 (Flower counts rounds from 1), got {server_round!r}")

    if rule == "adam" and bias_correction:
        t = float(server_round) + 1.0  # Flower's exponent: server_round + 1
        eta_t = eta * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
    else:
        eta_t = eta

    new_arrays, new_m, new_v = {}, {}, {}
    for name, theta in global_arrays.items():
        theta64 = np.asarray(theta, dtype=np.float64)
        delta = np.asarray(averaged[name], dtype=np.float64) - theta64  # pseudo-gradient (ascent direction)
        m_k = beta1 * m[name] + (1.0 - beta1) * delta
        if rule == "adam":
            v_k = beta2 * v[name] + (1.0 - beta2) * delta**2
        else:  # yogi
            v_k = v[name] - (1.0 - beta2) * delta**2 * np.sign(v[name] - delta**2)
        new_arrays[name] = (theta64 + eta_t * m_k / (np.sqrt(v_k) + tau)).astype(np.asarray(theta).dtype)
        new_m[name], new_v[name] = m_k, v_k
    return new_arrays, ServerOptState(m=new_m, v=new_v, step=state.step + 1)


# ----------------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------------


def fedadam_step(
    global_arrays: Arrays,
    averaged: Arrays,
    state: ServerOptState,
    eta: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    tau: float = 0.005,
    *,
    server_round: int | None = None,
    bias_correction: bool = True,
) -> tuple[dict[str, np.ndarray], ServerOptState]:
    """One FedAdam server update (Reddi et al. 2021, Alg. 2; Flower's ``FedAdam.aggregate_train``).

    Args:
        global_arrays: ``theta^(t)``, the adapter broadcast this round (name -> array); fixes names, shapes, dtypes.
        averaged: the aggregated client adapters, same names and shapes.
        state: the moments from the previous call, or ``ServerOptState()`` for the first round. Not modified.
        eta: server learning rate ``> 0`` (Flower's default 0.1; not given in the paper).
        beta1, beta2, tau: paper values 0.9, 0.99, 0.005 (see the module docstring for where ``tau`` enters).
        server_round: Flower's 1-based round number for the bias correction; default ``state.step + 1`` (equal to
            Flower's when every round aggregates). Pass the real round if some rounds skipped the server step and you
            want Flower's schedule exactly.
        bias_correction: Flower's ``eta_t = eta sqrt(1 - beta2^(round+1)) / (1 - beta1^(round+1))`` (default); False
            for Reddi et al.'s Alg. 2 as printed (``eta_t = eta``).

    Returns:
        ``(new_arrays, new_state)``: fresh arrays in the global dtypes (computed in float64) and a new state with
        float64 moments and ``step + 1``.

    Raises:
        ValueError: names/shapes of ``averaged`` or the state differ from ``global_arrays`` (the tensor is named); a
            hyper-parameter is out of range; ``server_round < 1``.
    """
    return _server_step("adam", global_arrays, averaged, state, eta, beta1, beta2, tau, server_round,
                        bias_correction)


def fedyogi_step(
    global_arrays: Arrays,
    averaged: Arrays,
    state: ServerOptState,
    eta: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    tau: float = 0.005,
) -> tuple[dict[str, np.ndarray], ServerOptState]:
    """One FedYogi server update (Reddi et al. 2021, Alg. 2; Flower's ``FedYogi.aggregate_train``).

    ``v = v - (1 - beta2) Delta^2 sign(v - Delta^2)`` (Yogi, Zaheer et al. 2018): ``v`` moves towards ``Delta^2``
    additively, so it grows like Adam's but shrinks more slowly. No bias correction (``eta_t = eta``).
    Arguments, returns and errors as :func:`fedadam_step` (Flower's FedYogi default ``eta`` is 0.01).
    """
    return _server_step("yogi", global_arrays, averaged, state, eta, beta1, beta2, tau, None, False)


def state_to_arrays(state: ServerOptState) -> dict[str, np.ndarray]:
    """The state as named arrays for a checkpoint: ``"m/<name>"``, ``"v/<name>"`` (float64 copies) and ``"step"``
    (a 1-element int64 array: safetensors stores no 0-d tensors). Tensor names may contain ``/`` and ``.``: only the
    first prefix is structural."""
    if not isinstance(state, ServerOptState):
        raise ValueError(f"state must be a ServerOptState, got {type(state).__name__}")
    if set(state.m) != set(state.v):
        raise ValueError(f"state.m and state.v must name the same tensors, got {sorted(state.m)[:5]} and "
                         f"{sorted(state.v)[:5]}")
    out: dict[str, np.ndarray] = {STEP_KEY: np.asarray([state.step], dtype=np.int64)}
    for name in state.m:
        out[M_PREFIX + name] = np.array(state.m[name], dtype=np.float64, copy=True)
        out[V_PREFIX + name] = np.array(state.v[name], dtype=np.float64, copy=True)
    return out


def arrays_to_state(arrays: Mapping[str, np.ndarray]) -> ServerOptState:
    """Inverse of :func:`state_to_arrays` (copies the arrays).

    Raises:
        ValueError: no ``"step"`` entry or a negative / non-integer one; a key without the ``m/`` or ``v/`` prefix;
            ``m`` and ``v`` naming different tensors or with different shapes.
    """
    if STEP_KEY not in arrays:
        raise ValueError(f"server optimiser checkpoint has no {STEP_KEY!r} entry (keys: {sorted(arrays)[:5]})")
    step = np.asarray(arrays[STEP_KEY])
    if step.shape == (1,):
        step = step.reshape(())
    if step.shape != () or not np.issubdtype(step.dtype, np.integer) or int(step) < 0:
        raise ValueError(f"server optimiser checkpoint: {STEP_KEY!r} must be a non-negative integer scalar, got "
                         f"{step!r}")
    m, v = {}, {}
    for key, value in arrays.items():
        if key == STEP_KEY:
            continue
        if key.startswith(M_PREFIX):
            m[key[len(M_PREFIX):]] = np.array(value, dtype=np.float64, copy=True)
        elif key.startswith(V_PREFIX):
            v[key[len(V_PREFIX):]] = np.array(value, dtype=np.float64, copy=True)
        else:
            raise ValueError(f"server optimiser checkpoint: unexpected key {key!r} (expected 'step', 'm/<name>' or "
                             f"'v/<name>')")
    check_same_layout(m, v, "server optimiser checkpoint: v", against="its m")
    return ServerOptState(m=m, v=v, step=int(step))
