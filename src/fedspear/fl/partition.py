"""Dirichlet partition of the train set over the gold answer label, with flwr-datasets (SPEC §1).

Every client computes the same split from the same seed, so no data or index list ever travels. The label of an item
is its gold answer (``Example.gold_index``: the option letter, or yes/no), as in the paper's "Dirichlet alpha".

**Decision (2026-11-25, issue 16): which Dirichlet split.** The paper gives only "50 clients, Dirichlet α = 1.0"
(appendix hyper-parameter tables) and "100 clients, Dirichlet(0.3)" (appendix Table "100 total clients"). Two
flwr-datasets partitioners read that:

- ``partitioner = "inner_dirichlet"`` (**default**): ``InnerDirichletPartitioner`` (Acar et al. 2021, FedDyn's
  split). Every client gets ⌊n/K⌋ or ⌈n/K⌉ items (the first ``n mod K`` clients one more); the label mix *within*
  each client is drawn from Dir(α) over the labels, and a label that runs out is dropped from the remaining draws.
  Always feasible when n ≥ K: ARC-Challenge's 1,119 train items give 22–23 per client at K = 50 and 11–12 at
  K = 100, for any α and seed. Heterogeneity is in the labels only, which is what α controls.
- ``partitioner = "dirichlet"``: ``DirichletPartitioner`` (Hsu et al. 2019): each label's items are split over the
  clients in Dir(α) proportions, so client sizes vary as well. It needs a minimum size per client, min(10, ⌊n/2K⌋)
  here, and flwr-datasets gives up after 10 draws below it — which happened for 5 of 5 seeds of ARC-Challenge at
  K = 50, α = 1 (a minimum of 1 does not help at K = 100, α = 0.3: about one client in ten draws no item at all).
  It was the only rule before 2026-11-25 and stays for reproducing results made with it (the ``cpu-small`` and
  ``cpu-qwen1.5b`` presets pin it); when it cannot split, :class:`PartitionError` says so and names the fix.

``partition_summary`` gives the sizes and label counts a run directory records (``partitions.json``).

**Decision (2026-12-03): splits are kept in fedspear's cache.** Computing a split means importing flwr-datasets, whose
package imports its plotting and metrics modules (seaborn, scipy.stats) and ``datasets``: ≈ 1.9 s on a 2-core Zen 5
with torch already loaded, paid by the command that checks the split before a run and again by every client process,
for a computation of milliseconds. So a split, once computed, is written to ``$FEDSPEAR_CACHE/splits/<digest>.json``
(``split_path``): the key is a SHA-256 of the labels, K, α, the seed, the rule and the versions of flwr-datasets,
``datasets`` and numpy, so a cached split is the one those inputs and libraries give, and another version computes
and keeps its own. A file that cannot be read back as a split of those labels (an interrupted writer, another
format) is computed again and replaced; a cache that cannot be written costs the import, nothing else. Errors
(``PartitionError``) are never kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from fedspear.runtime.cache import split_versions, splits_dir
from fedspear.tasks.base import Example

log = logging.getLogger(__name__)

PARTITIONERS = ("inner_dirichlet", "dirichlet")


class PartitionError(ValueError):
    """The train split cannot be divided over the clients under the chosen rule; the message names the fix."""


def dirichlet_partitions(examples: Sequence[Example], num_partitions: int, alpha: float, seed: int,
                         partitioner: str = "inner_dirichlet") -> list[list[int]]:
    """Split ``examples`` into ``num_partitions`` lists of indices (module docstring: the two rules).

    Args:
        examples: the train split every client loads (same order everywhere).
        num_partitions: K, the number of clients.
        alpha: Dirichlet concentration α (> 0); small α = skewed labels.
        seed: the run's seed (same seed → same split on every machine).
        partitioner: ``"inner_dirichlet"`` (equal sizes, Dir(α) label mix per client) or ``"dirichlet"``.
    Returns:
        K lists of indices into ``examples``: disjoint, together every index once.
    Raises:
        PartitionError: fewer examples than partitions, or ``"dirichlet"`` found no split meeting its minimum size.
        ValueError: unknown ``partitioner``.
    """
    if partitioner not in PARTITIONERS:
        raise ValueError(f"partitioner must be one of {', '.join(PARTITIONERS)} (got {partitioner!r})")
    if len(examples) < num_partitions:
        raise PartitionError(f"{len(examples)} train examples cannot be split over {num_partitions} clients")
    labels = tuple(ex.gold_index for ex in examples)
    return [list(p) for p in _partition(labels, num_partitions, float(alpha), seed, partitioner)]


def partition_summary(examples: Sequence[Example], parts: Sequence[Sequence[int]]) -> dict:
    """Sizes and per-label counts of a split, as ``partitions.json`` records them.

    Returns:
        ``{"sizes": [n_k], "labels": [...], "label_counts": [[count of each label] per client], "min", "max",
        "mean"}`` (sizes in items).
    """
    labels = sorted({ex.gold for ex in examples})
    counts = [[sum(1 for i in p if examples[i].gold == label) for label in labels] for p in parts]
    sizes = [len(p) for p in parts]
    return {"sizes": sizes, "labels": labels, "label_counts": counts, "min": min(sizes), "max": max(sizes),
            "mean": sum(sizes) / len(sizes)}


def split_key(labels: Sequence[int], num_partitions: int, alpha: float, seed: int, partitioner: str) -> dict:
    """What a split depends on (module docstring, "splits are kept"): the labels in train order (their number and
    the SHA-256 of their list), K, α, seed, rule and the installed versions of flwr-datasets, ``datasets`` and numpy
    (``runtime.cache.split_versions``)."""
    digest = hashlib.sha256(json.dumps([int(x) for x in labels]).encode()).hexdigest()
    return {"items": len(labels), "labels": digest, "num_partitions": num_partitions, "alpha": float(alpha),
            "seed": seed, "partitioner": partitioner, "versions": split_versions()}


def split_path(key: dict) -> Path:
    """The cache file of the split ``key`` names (``split_key``): ``<cache>/splits/<sha256 of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return splits_dir() / f"{digest}.json"


def _read_split(path: Path, key: dict) -> tuple[tuple[int, ...], ...] | None:
    """The split kept at ``path`` for ``key``, or None when absent, unreadable, for another key or not a split of
    ``key``'s labels into K parts (every index once)."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key:
        return None
    parts = kept.get("parts")
    if (not isinstance(parts, list) or len(parts) != key["num_partitions"]
            or not all(isinstance(p, list) and all(type(i) is int for i in p) for p in parts)
            or sorted(i for p in parts for i in p) != list(range(key["items"]))):
        return None
    return tuple(tuple(p) for p in parts)


def _write_split(path: Path, key: dict, parts: tuple[tuple[int, ...], ...]) -> None:
    """Keep ``parts`` at ``path`` (written to ``.<name>.<pid>.tmp``, then renamed: readers see all or nothing); a
    cache that cannot be written is logged and skipped."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "parts": [list(p) for p in parts]}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        log.debug("split not kept in the cache (%s)", err)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


@lru_cache(maxsize=8)
def _partition(labels: tuple[int, ...], num_partitions: int, alpha: float, seed: int,
               partitioner: str) -> tuple[tuple[int, ...], ...]:
    """The split of ``labels``: from fedspear's cache, else computed with flwr-datasets and kept there."""
    key = split_key(labels, num_partitions, alpha, seed, partitioner)
    path = split_path(key)
    parts = _read_split(path, key)
    if parts is None:
        parts = _flwr_partition(labels, num_partitions, alpha, seed, partitioner)
        _write_split(path, key, parts)
    return parts


def _flwr_partition(labels: tuple[int, ...], num_partitions: int, alpha: float, seed: int,
                    partitioner: str) -> tuple[tuple[int, ...], ...]:
    """The split flwr-datasets' partitioner for ``partitioner`` draws (module docstring), as index tuples.

    Raises:
        PartitionError: ``"dirichlet"`` found no split meeting its minimum size.
    """
    import warnings

    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, InnerDirichletPartitioner

    # InnerDirichletPartitioner indexes classes 0..C-1: rank the labels that occur (ARC's rare "E" may be absent)
    ranks = {label: r for r, label in enumerate(sorted(set(labels)))}
    dataset = Dataset.from_dict({"idx": list(range(len(labels))), "label": [ranks[x] for x in labels]})
    n = len(labels)
    if partitioner == "inner_dirichlet":
        sizes = [n // num_partitions + (1 if k < n % num_partitions else 0) for k in range(num_partitions)]
        part = InnerDirichletPartitioner(partition_sizes=sizes, partition_by="label", alpha=alpha, shuffle=True,
                                         seed=seed)
    else:
        min_size = max(0, min(10, n // (2 * num_partitions)))
        part = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                    min_partition_size=min_size, self_balancing=False, shuffle=True, seed=seed)
    part.dataset = dataset
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flwr-datasets warns on every failed draw; the error below says it all
            return tuple(tuple(part.load_partition(i)["idx"]) for i in range(num_partitions))
    except ValueError as err:
        if partitioner != "dirichlet":
            raise
        raise PartitionError(
            f"partitioner 'dirichlet' could not split {n} train items over {num_partitions} clients with "
            f"Dirichlet α = {alpha} and at least {min_size} items each (flwr-datasets: {err}); use "
            "partitioner = \"inner_dirichlet\" (equal sizes, Dir(α) label mix per client; fedspear.fl.partition)"
        ) from None
