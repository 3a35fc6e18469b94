"""Dirichlet partition of the train set over the gold answer label, with flwr-datasets (SPEC §1).

Every client computes the same split from the same seed, so no data or index list ever travels.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from fedspear.tasks.base import Example


def dirichlet_partitions(examples: Sequence[Example], num_partitions: int, alpha: float, seed: int) -> list[list[int]]:
    """Split ``examples`` into ``num_partitions`` lists of indices, label proportions drawn from Dirichlet(α).

    Uses ``flwr_datasets.partitioner.DirichletPartitioner`` over the gold label index (``Example.gold_index``).
    ``min_partition_size`` is relaxed to what the data allows (at most 1 item per client when data is scarce).

    Raises:
        ValueError: fewer examples than partitions.
    """
    if len(examples) < num_partitions:
        raise ValueError(f"{len(examples)} train examples cannot be split over {num_partitions} clients")
    return [list(p) for p in _partition(tuple(ex.gold_index for ex in examples), num_partitions, alpha, seed)]


@lru_cache(maxsize=8)
def _partition(labels: tuple[int, ...], num_partitions: int, alpha: float, seed: int) -> tuple[tuple[int, ...], ...]:
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    dataset = Dataset.from_dict({"idx": list(range(len(labels))), "label": list(labels)})
    min_size = max(0, min(10, len(labels) // (2 * num_partitions)))
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions, partition_by="label", alpha=alpha, min_partition_size=min_size,
        self_balancing=False, shuffle=True, seed=seed,
    )
    partitioner.dataset = dataset
    return tuple(tuple(partitioner.load_partition(i)["idx"]) for i in range(num_partitions))
