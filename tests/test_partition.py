"""The client split (fedspear.fl.partition): complete, disjoint, deterministic, skewed for small α, and feasible at the
paper's federations — 50 clients Dir(1.0) and the appendix's 100 clients Dir(0.3) — on every task's shipped train
split and on the full copies in shared/data, for seeds 0–4."""

from __future__ import annotations


import numpy as np
import pytest

from fedspear.fl.partition import PartitionError, dirichlet_partitions, partition_summary
from fedspear.tasks import TASKS, arc_challenge
from shared_dir import SHARED, shared_marks

SHARED_DATA = SHARED / "data"


def test_partition_is_complete_disjoint_and_deterministic():
    items = arc_challenge.load("train")
    for rule in ("inner_dirichlet", "dirichlet"):
        parts = dirichlet_partitions(items, 10, alpha=1.0, seed=3, partitioner=rule)
        flat = [i for p in parts for i in p]
        assert sorted(flat) == list(range(len(items)))
        assert parts == dirichlet_partitions(items, 10, alpha=1.0, seed=3, partitioner=rule)
        assert parts != dirichlet_partitions(items, 10, alpha=1.0, seed=4, partitioner=rule)


@pytest.mark.parametrize("rule", ["inner_dirichlet", "dirichlet"])
def test_small_alpha_skews_label_proportions(rule):
    items = arc_challenge.load("train")

    def spread(alpha):
        parts = dirichlet_partitions(items, 5, alpha=alpha, seed=0, partitioner=rule)
        shares = []
        for p in parts:
            labels = [items[i].gold_index for i in p]
            shares.append(max(np.bincount(labels, minlength=5)) / max(1, len(labels)))
        return float(np.mean(shares))

    assert spread(0.1) > spread(100.0) + 0.1


def _sources():
    out = [(name, None) for name in sorted(TASKS)]
    out += [pytest.param(name, str(SHARED_DATA), marks=shared_marks("data")) for name in sorted(TASKS)]
    return out


@pytest.mark.parametrize("task,data_dir", _sources(), ids=lambda v: "full" if v == str(SHARED_DATA) else str(v))
def test_paper_federations_partition_every_task_for_seeds_0_to_4(task, data_dir):
    """50 clients Dir(1.0) and 100 clients Dir(0.3): every client gets ⌊n/K⌋ or ⌈n/K⌉ items (≥ 10 on every split
    here), all items used once. The 'dirichlet' rule, the one before 2026-11-25, fails on the shipped ARC split."""
    module = TASKS[task]
    items = module.load(module.TRAIN_SPLIT, data_dir=data_dir)
    n = len(items)
    for clients, alpha in ((50, 1.0), (100, 0.3)):
        for seed in range(5):
            parts = dirichlet_partitions(items, clients, alpha, seed)
            sizes = sorted(len(p) for p in parts)
            assert sizes[0] == n // clients and sizes[-1] == -(-n // clients), (clients, alpha, seed, sizes[:3])
            assert sizes[0] >= 10
            assert sorted(i for p in parts for i in p) == list(range(n))


def test_the_old_rule_fails_at_50_clients_with_a_message_naming_the_fix():
    items = arc_challenge.load("train")
    with pytest.raises(PartitionError, match="inner_dirichlet"):
        dirichlet_partitions(items, 50, 1.0, 0, partitioner="dirichlet")
    with pytest.raises(PartitionError, match="cannot be split"):
        dirichlet_partitions(items[:5], 6, 1.0, 0)
    with pytest.raises(ValueError, match="partitioner must be one of"):
        dirichlet_partitions(items, 5, 1.0, 0, partitioner="iid")


def test_the_old_rule_is_flwr_datasets_dirichlet_partitioner_as_before():
    """'dirichlet' is exactly DirichletPartitioner(min_partition_size = min(10, n // 2K)) over the gold label, so
    runs made before 2026-11-25 (cpu-small, cpu-qwen1.5b) get the same clients' data."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    items = arc_challenge.load("train")
    part = DirichletPartitioner(num_partitions=10, partition_by="label", alpha=1.0, min_partition_size=10,
                                self_balancing=False, shuffle=True, seed=1)
    part.dataset = Dataset.from_dict({"idx": list(range(len(items))), "label": [x.gold_index for x in items]})
    expected = [list(part.load_partition(i)["idx"]) for i in range(10)]
    assert dirichlet_partitions(items, 10, 1.0, 1, partitioner="dirichlet") == expected


def test_partition_summary_counts_sizes_and_labels():
    items = arc_challenge.load("train")[:200]
    parts = dirichlet_partitions(items, 7, 0.5, 2)
    summary = partition_summary(items, parts)
    assert summary["sizes"] == [len(p) for p in parts] and sum(summary["sizes"]) == 200
    assert [sum(row) for row in summary["label_counts"]] == summary["sizes"]
    golds = [items[i].gold for i in parts[3]]
    assert summary["label_counts"][3] == [golds.count(label) for label in summary["labels"]]
    assert summary["min"] == min(summary["sizes"]) and summary["max"] == max(summary["sizes"])


def _split_in_a_process(cache, labels, *args) -> dict:
    """Run ``_partition(labels, *args)`` in a fresh Python with ``FEDSPEAR_CACHE=cache``: its split and whether it
    imported flwr-datasets."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys; from fedspear.fl.partition import _partition; "
            f"parts = _partition(tuple({list(labels)!r}), *{args!r}); "
            "print(json.dumps({'parts': parts, 'flwr_datasets': 'flwr_datasets' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FEDSPEAR_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_split_is_kept_in_the_cache_and_later_processes_read_it_without_flwr_datasets(tmp_path):
    """The first process computes the split with flwr-datasets and keeps it (``$FEDSPEAR_CACHE/splits``); a second
    process gets the same split without importing flwr-datasets; both equal flwr-datasets' split computed here."""
    from fedspear.fl.partition import _flwr_partition

    labels = [x.gold_index for x in arc_challenge.load("train")[:60]]
    args = (4, 0.5, 7, "inner_dirichlet")
    first = _split_in_a_process(tmp_path, labels, *args)
    assert first["flwr_datasets"] and len(list((tmp_path / "splits").glob("*.json"))) == 1
    second = _split_in_a_process(tmp_path, labels, *args)
    assert not second["flwr_datasets"]
    expected = [list(p) for p in _flwr_partition(tuple(labels), *args)]
    assert first["parts"] == second["parts"] == expected


def test_a_cached_split_is_keyed_by_its_inputs_and_library_versions(tmp_path, monkeypatch):
    """Another seed, K, α, rule, label or library version is another cache file."""
    from fedspear.fl import partition

    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path))
    labels = (0, 1, 2, 3) * 5
    base = partition.split_path(partition.split_key(labels, 4, 1.0, 0, "inner_dirichlet"))
    assert base.parent == tmp_path / "splits"
    others = [partition.split_key(labels, 4, 1.0, 1, "inner_dirichlet"),
              partition.split_key(labels, 5, 1.0, 0, "inner_dirichlet"),
              partition.split_key(labels, 4, 0.5, 0, "inner_dirichlet"),
              partition.split_key(labels, 4, 1.0, 0, "dirichlet"),
              partition.split_key((1, 0, 2, 3) + labels[4:], 4, 1.0, 0, "inner_dirichlet")]
    monkeypatch.setattr(partition, "split_versions", lambda: {"flwr-datasets": "0.0.1", "datasets": "1",
                                                              "numpy": "1"})
    others.append(partition.split_key(labels, 4, 1.0, 0, "inner_dirichlet"))
    assert len({base, *map(partition.split_path, others)}) == 1 + len(others)


@pytest.mark.parametrize("kept", ["truncated", "another key", "not every index", "duplicate index", "not json"])
def test_a_cached_file_that_is_not_the_split_is_computed_again_and_replaced(kept, tmp_path, monkeypatch):
    """A cache file that is not a complete split of these labels for this key (an interrupted writer, an edit, a
    file of another key) is ignored: the split is flwr-datasets' and the file is rewritten with it."""
    import json

    from fedspear.fl import partition

    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path))
    labels, args = (0, 1, 2) * 6, (3, 1.0, 2, "inner_dirichlet")
    key = partition.split_key(labels, *args)
    path = partition.split_path(key)
    path.parent.mkdir(parents=True)
    expected = partition._flwr_partition(labels, *args)
    good = json.dumps({"key": key, "parts": [list(p) for p in expected]})
    bad = {"truncated": good[: len(good) // 2],
           "another key": json.dumps({"key": {**key, "seed": 3}, "parts": [list(p) for p in expected]}),
           "not every index": json.dumps({"key": key, "parts": [list(p) for p in expected[:2]] + [[]]}),
           "duplicate index": json.dumps({"key": key, "parts": [[0, *expected[0][1:]], *map(list, expected[1:])]}),
           "not json": "\0\1"}[kept]
    path.write_text(bad)
    assert partition._partition.__wrapped__(labels, *args) == expected
    assert json.loads(path.read_text()) == json.loads(good)


def test_a_failed_split_is_not_kept_and_an_unwritable_cache_still_splits(tmp_path, monkeypatch):
    from fedspear.fl import partition

    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "cache"))
    items = arc_challenge.load("train")
    with pytest.raises(PartitionError):
        partition._partition.__wrapped__(tuple(x.gold_index for x in items), 50, 1.0, 0, "dirichlet")
    assert not (tmp_path / "cache" / "splits").exists() or not list((tmp_path / "cache" / "splits").iterdir())
    (tmp_path / "file").write_text("a file where the cache folder would be")
    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "file"))
    labels = (0, 1) * 10
    assert partition._partition.__wrapped__(labels, 2, 1.0, 0, "inner_dirichlet") == \
        partition._flwr_partition(labels, 2, 1.0, 0, "inner_dirichlet")
