"""Checks on every client reply before it may touch the global adapter (no ``flwr`` import).

A federated run lasts long and clients misbehave: a crashed or hostile client must not wreck θ. The server checks
each reply against the global adapter it broadcast: same tensor names, shapes and dtypes, every value finite, the
counters non-negative integers, and (optionally) the update norm ‖θ_k − θ^(t)‖₂ within a bound. A reply that fails
is excluded from the round's aggregation with the reason logged; the round goes on with the rest.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from .. import counters
from ..arrays import layout_mismatch


def update_norm(global_arrays: Mapping[str, np.ndarray], client_arrays: Mapping[str, np.ndarray]) -> float:
    """‖θ_k − θ^(t)‖₂ over all tensors (float64 accumulation)."""
    total = 0.0
    for name, ref in global_arrays.items():
        diff = np.asarray(client_arrays[name], dtype=np.float64) - np.asarray(ref, dtype=np.float64)
        total += float(np.sum(diff * diff))
    return math.sqrt(total)


def check_reply(
    global_arrays: Mapping[str, np.ndarray],
    client_arrays: Mapping[str, np.ndarray],
    metrics: Mapping[str, object],
    max_update_norm: float | None = None,
) -> str | None:
    """Why a client reply must be rejected, or None when it is acceptable.

    Args:
        global_arrays: θ^(t) as broadcast (name → array).
        client_arrays: the client's returned adapter.
        metrics: the client's reply metrics (must hold ``fedspear.counters.REQUIRED``).
        max_update_norm: reject when ‖θ_k − θ^(t)‖₂ exceeds this (None: no bound).
    Returns:
        A one-line reason naming the tensor or counter at fault, or None.
    """
    problem = layout_mismatch(global_arrays, client_arrays)
    if problem:
        return f"adapter layout differs from the global adapter's: {problem}"
    for name, ref in global_arrays.items():
        value = np.asarray(client_arrays[name])
        if value.dtype != np.asarray(ref).dtype:
            return f"tensor {name}: dtype {value.dtype}, expected {np.asarray(ref).dtype}"
        if not np.all(np.isfinite(value)):
            return f"tensor {name}: {int(np.size(value) - np.isfinite(value).sum())} non-finite values"
    for key in counters.REQUIRED:
        if key not in metrics:
            return f"counter {key} missing"
    for key in counters.INTEGER:
        if key in metrics:
            value = metrics[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or float(value) != int(value):
                return f"counter {key} = {value!r} is not a non-negative integer"
    if max_update_norm is not None:
        norm = update_norm(global_arrays, client_arrays)
        if norm > max_update_norm:
            return f"update norm {norm:.4g} exceeds the bound {max_update_norm:.4g}"
    return None
