"""Server-side aggregation maths on named numpy arrays (paper Alg. 2; SPEC §4). No Flower import.

The federated layer unpacks Flower messages into ``dict[str, np.ndarray]`` (the LoRA A/B tensors, by name), calls
these functions and packs the result. Keeping the maths here means it is tested without Flower and that every
returned array is a fresh copy -- never a view of a client's or the global model's buffer (the reference code
aggregated through aliased tensors, which turns the +1/+10/+100 example below into +100 instead of +37).

- :func:`win_weighted_average` -- FedAvg weighted by win count, ``theta = sum_k |W_k| theta_k / sum_k |W_k|``.
- :func:`pseudo_gradient` -- ``Delta = avg - theta`` for server optimisers (FedAdam / FedYogi, Reddi et al. 2021).
- :func:`fixed_denominator_mean` -- the mean of clipped updates under differential privacy,
  ``theta + (1/m) sum_k [w_k > 0] (theta_k - theta)`` with ``m`` fixed (McMahan et al. 2018; ``fedspear.fl.privacy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..arrays import layout_mismatch

Arrays = Mapping[str, np.ndarray]


def check_same_layout(reference: Arrays, other: Arrays, what: str, against: str = "the global adapter") -> None:
    """Raise ValueError naming the first difference between two named-array dicts (``fedspear.arrays.layout_mismatch``:
    names, then shapes), ``what`` and ``against`` saying which two."""
    problem = layout_mismatch(reference, other)
    if problem:
        raise ValueError(f"{what} does not match {against}: {problem}")


def win_weighted_average(
    global_arrays: Arrays, client_arrays: Sequence[Arrays], num_wins: Sequence[int]
) -> tuple[dict[str, np.ndarray], bool]:
    """FedAvg weighted by each client's win count (paper Alg. 2): ``theta = sum_k w_k theta_k / sum_k w_k``.

    Args:
        global_arrays: the broadcast adapter ``theta^(t)``, name -> array. Fixes the names, shapes and dtypes.
        client_arrays: one dict per client, ``theta_k^(t)``, with exactly the global names and shapes.
        num_wins: ``|W_k^(t)|`` per client, non-negative (a client with 0 wins contributes nothing).

    Returns:
        ``(arrays, aggregated)``. ``arrays`` are new arrays in the global order and dtypes; the sum is taken in
        float64 and cast back once (so fp16/bf16 adapters are not averaged in half precision). ``aggregated`` is
        False when ``sum_k w_k = 0`` (no client won anything, or no clients): **Decision** (SPEC §4), the global
        adapter is kept -- returned as copies -- where Flower's FedAvg would divide by zero.

    Raises:
        ValueError: ``len(client_arrays) != len(num_wins)``; a weight is negative or not finite; a client's tensor
            names or shapes differ from the global ones (the message names the client and tensor).
    """
    if len(client_arrays) != len(num_wins):
        raise ValueError(f"got {len(client_arrays)} client updates but {len(num_wins)} win counts; they pair up "
                         f"one to one")
    weights = np.asarray(num_wins, dtype=np.float64).reshape(-1)  # [K]
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError(f"win counts must be finite and >= 0, got {list(num_wins)}")
    for k, arrays in enumerate(client_arrays):
        check_same_layout(global_arrays, arrays, f"client {k}'s update")

    total = float(weights.sum())
    if total == 0.0:
        return {name: np.array(value, copy=True) for name, value in global_arrays.items()}, False

    averaged = {}
    for name, reference in global_arrays.items():
        acc = np.zeros(np.shape(reference), dtype=np.float64)
        for w, arrays in zip(weights, client_arrays):
            if w:
                acc += w * np.asarray(arrays[name], dtype=np.float64)
        averaged[name] = (acc / total).astype(np.asarray(reference).dtype)  # astype copies: a fresh array
    return averaged, True


def pseudo_gradient(global_arrays: Arrays, averaged: Arrays) -> dict[str, np.ndarray]:
    """Server pseudo-gradient ``Delta = avg - theta^(t)`` (SPEC §4; Reddi et al. 2021, FedAdam / FedYogi).

    The sign follows SPEC §4 (an *ascent* direction: the server steps ``theta + eta * f(Delta)``). Computed in
    float64 and returned in each global array's dtype, as fresh arrays.

    Raises:
        ValueError: names or shapes of ``averaged`` differ from ``global_arrays``.
    """
    check_same_layout(global_arrays, averaged, "averaged adapter")
    return {
        name: (np.asarray(averaged[name], dtype=np.float64) - np.asarray(theta, dtype=np.float64)).astype(
            np.asarray(theta).dtype
        )
        for name, theta in global_arrays.items()
    }


def fixed_denominator_mean(
    global_arrays: Arrays, client_arrays: Sequence[Arrays], weights: Sequence[float], denominator: int,
    clip_norm: float | None = None,
) -> dict[str, np.ndarray]:
    """``theta + (1/m) sum_k [w_k > 0] (theta_k - theta)``: equal weights, fixed denominator ``m`` (DP mode).

    The estimator whose sensitivity to one client is ``C/m`` when every update ``theta_k - theta`` has L2 norm at
    most ``C`` (McMahan et al. 2018, arXiv:1710.06963, the "fixed-denominator" estimator with weights in {0, 1}):
    adding or removing one client changes the sum by at most ``C`` and the result by at most ``C/m``, whatever the
    others sent. So Flower's noise ``sigma = z C / m`` is calibrated for it, whereas a win-weighted mean or a mean
    over the replies that arrived is not. A client whose weight (win count) is 0 contributes nothing, as in the
    win-weighted mean; the decision uses that client's own reply only, so it keeps the bound. Clients that did not
    reply count as zero updates: the denominator stays ``m``.

    With ``clip_norm`` C every update is scaled by min(1, C/‖theta_k − theta‖₂) here, in float64, before it is
    summed: the bound then holds exactly whatever rounding or slack let a reply through (a client-clipped reply may
    exceed C by float32 rounding; ``fedspear.fl.privacy.NORM_SLACK``). Honest replies are within C and unchanged
    up to that rounding.

    Args:
        global_arrays: ``theta^(t)`` as broadcast, name -> array (fixes names, shapes, dtypes).
        client_arrays: each accepted client's ``theta_k``.
        weights: each client's aggregation weight; only ``> 0`` matters.
        denominator: ``m``, the number of clients sampled this round (``clients_per_round``), at least
            ``len(client_arrays)``.
        clip_norm: C, the L2 bound each update is held to (None: updates are taken as they are).

    Returns:
        New arrays in the global order and dtypes (float64 accumulation, cast back once).

    Raises:
        ValueError: lengths differ, a weight is negative or not finite, ``denominator < len(client_arrays)`` or not
            positive, ``clip_norm`` is not positive, or a client's names or shapes differ from the global ones.
    """
    if len(client_arrays) != len(weights):
        raise ValueError(f"got {len(client_arrays)} client updates but {len(weights)} weights; they pair up one to one")
    w = np.asarray(weights, dtype=np.float64).reshape(-1)  # [K]
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    if denominator < max(1, len(client_arrays)):
        raise ValueError(f"denominator {denominator} must be positive and at least the {len(client_arrays)} clients")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    for k, arrays in enumerate(client_arrays):
        check_same_layout(global_arrays, arrays, f"client {k}'s update")
    scale = np.ones(len(client_arrays))  # [K]
    if clip_norm is not None:
        norms = np.sqrt([sum(float(np.sum((np.asarray(arrays[n], np.float64) - np.asarray(ref, np.float64)) ** 2))
                             for n, ref in global_arrays.items()) for arrays in client_arrays])
        scale = np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))
    out = {}
    for name, reference in global_arrays.items():
        theta = np.asarray(reference, dtype=np.float64)
        acc = np.zeros(np.shape(reference), dtype=np.float64)
        for wk, sk, arrays in zip(w, scale, client_arrays):
            if wk > 0:
                acc += sk * (np.asarray(arrays[name], dtype=np.float64) - theta)
        out[name] = (theta + acc / denominator).astype(np.asarray(reference).dtype)
    return out
