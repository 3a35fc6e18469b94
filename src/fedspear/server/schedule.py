"""The client learning rate the server sends each round: linear warm-up, then cosine decay (paper appendix
"Hyperparameter Settings (SPEAR)").
"""

from __future__ import annotations

import math


def lr_at_round(server_round: int, total_rounds: int, lr: float, lr_min: float, warmup_ratio: float = 0.1) -> float:
    """Learning rate for ``server_round`` (1-based): linear warm-up, then cosine decay to ``lr_min``.

    Warm-up covers the first ``ceil(warmup_ratio · total_rounds)`` rounds, reaching ``lr`` at its last one; the
    cosine then runs from ``lr`` (the round after warm-up) to ``lr_min`` (the last round).

    Raises:
        ValueError: ``server_round`` outside 1..total_rounds.
    """
    if not 1 <= server_round <= total_rounds:
        raise ValueError(f"server_round must be in 1..{total_rounds} (got {server_round})")
    warmup = math.ceil(warmup_ratio * total_rounds)
    if server_round <= warmup:
        return lr * server_round / warmup
    span = total_rounds - warmup
    if span <= 1:
        return lr
    progress = (server_round - warmup - 1) / (span - 1)
    return lr_min + 0.5 * (lr - lr_min) * (1 + math.cos(math.pi * progress))
