"""Dirichlet partition over the gold label (flwr-datasets): complete, disjoint, deterministic, skewed for small α."""

from __future__ import annotations

import numpy as np

from fedspear.fl.partition import dirichlet_partitions
from fedspear.tasks import arc_challenge


def test_partition_is_complete_disjoint_and_deterministic():
    items = arc_challenge.load("train")
    parts = dirichlet_partitions(items, 10, alpha=1.0, seed=3)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(items)))
    assert parts == dirichlet_partitions(items, 10, alpha=1.0, seed=3)
    assert parts != dirichlet_partitions(items, 10, alpha=1.0, seed=4)


def test_small_alpha_skews_label_proportions():
    items = arc_challenge.load("train")
    def spread(alpha):
        parts = dirichlet_partitions(items, 5, alpha=alpha, seed=0)
        shares = []
        for p in parts:
            labels = [items[i].gold_index for i in p]
            shares.append(max(np.bincount(labels, minlength=5)) / max(1, len(labels)))
        return float(np.mean(shares))
    assert spread(0.1) > spread(100.0)
