"""A client's prompt stream (fedspear.worker.round_prompts): no item twice in one client-round (issue 16 §4)."""

from __future__ import annotations

import random
from collections import Counter

from fedspear.worker import derived_seed, round_prompts
from fedspear.config import RunConfig


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{"seed": 0, **kw})


def test_no_item_twice_when_the_partition_is_smaller_than_the_rollouts():
    """The paper's 80 rollouts on a 22-item client (ARC at 50 clients): each item once per round, all of them."""
    part = list(range(500, 522))
    for server_round in range(1, 6):
        idx = round_prompts(part, _cfg(rollouts_per_round=80), partition_id=7, server_round=server_round)
        assert len(idx) == 22 and sorted(idx) == part


def test_rounds_read_the_seeded_stream_in_order_and_wrap_between_rounds():
    """rollouts ≤ |D_k|: round r takes stream positions (r−1)·R … r·R − 1 mod |D_k| — the rule before issue 16, so
    runs whose rollouts fit their partitions ask the same prompts as before."""
    part = list(range(30))
    cfg = _cfg(rollouts_per_round=4)
    order = list(part)
    random.Random(derived_seed(0, "stream", 2)).shuffle(order)
    seen = [i for r in range(1, 8) for i in round_prompts(part, cfg, 2, r)]
    assert seen == order[:28] and len(set(seen)) == 28
    assert round_prompts(part, cfg, 2, 8) == [order[28], order[29], order[0], order[1]]
    assert round_prompts(part, cfg, 3, 1) != round_prompts(part, cfg, 2, 1)  # each client its own stream


def test_repeat_prompts_restores_asking_an_item_several_times_in_a_round():
    part = list(range(22))
    idx = round_prompts(part, _cfg(rollouts_per_round=160, repeat_prompts=True), 0, 1)
    assert len(idx) == 160 and set(Counter(idx).values()) == {7, 8}


def test_an_empty_partition_asks_nothing():
    assert round_prompts([], _cfg(rollouts_per_round=8), 0, 1) == []
