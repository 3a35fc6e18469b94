"""`fedspear bench`'s arithmetic, checked by hand."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import pytest


def test_bench_flop_counts_by_hand():
    """The tiny Llama (hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16, tied 49152-row embedding) with
    LoRA r 4 on all seven projections, counted by hand."""
    from fedspear.experiments.bench import flop_counts, prefill_flops, train_flops
    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model

    base, tok = tiny_model(seed=0)
    assert len(tok) == 49152
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1))
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64  # q, o; k, v; gate, up, down; two norms
    lora_per_layer = (4 * 64 + 64 * 4) * 2 + (4 * 64 + 32 * 4) * 2 + (4 * 64 + 128 * 4) * 2 + (4 * 128 + 64 * 4)
    counts = flop_counts(model)
    assert counts == {"body": 2 * per_layer + 64, "head": 49152 * 64, "lora": 2 * lora_per_layer, "layers": 2,
                      "width": 64}
    assert counts["body"] == 74_048 and counts["lora"] == 8_192
    # 2 rows × 10 tokens, logits at the last position: 2·(body + lora)·20 + 2·head·2 + 2·layers·width·10·20
    assert prefill_flops(counts, 2, 10) == 2 * 82_240 * 20 + 2 * 3_145_728 * 2 + 2 * 2 * 64 * 10 * 20 == 15_923_712
    assert train_flops(counts, 2, 10, 1) == 2 * 15_923_712 + 2 * 8_192 * 20


@pytest.mark.parametrize(("info", "kind"), [
    ({"vendor": "AuthenticAMD", "family": 26, "model_number": 2, "flags": ["avx2", "avx512f", "avx512_bf16"]},
     "zen5-avx512bf16"),  # this project's faster machine
    ({"vendor": "AuthenticAMD", "family": 25, "model_number": 17, "flags": ["avx2", "avx512f", "avx512_bf16"]},
     "zen4-avx512bf16"),  # EPYC 9004 (Genoa): model 0x11
    ({"vendor": "AuthenticAMD", "family": 25, "model_number": 17, "flags": ["avx", "avx2", "fma"]},
     "zen4-avx2"),  # the same part with AVX-512 hidden by the VM: the fp32-only reference machine
    ({"vendor": "AuthenticAMD", "family": 25, "model_number": 1, "flags": ["avx2"]}, "zen3-avx2"),  # Milan
    ({"vendor": "AuthenticAMD", "family": 25, "model_number": 0x90, "flags": ["avx2"]}, "zen4-avx2"),  # 0x60–0xAF
    ({"vendor": "AuthenticAMD", "family": 23, "model_number": 0x31, "flags": ["avx2"]}, "zen2-avx2"),  # Rome
    ({"vendor": "AuthenticAMD", "family": 23, "model_number": 0x50, "flags": ["avx2"]}, "zen1-avx2"),
    ({"vendor": "AuthenticAMD", "family": 26, "model_number": 0x50, "flags": ["avx2"]}, "amd-f26m80-avx2"),  # not Zen 5
    ({"vendor": "GenuineIntel", "family": 6, "model_number": 143, "flags": ["avx2", "avx512f"]}, "intel-f6m143-avx512"),
    ({"gpu": "NVIDIA A100-SXM4-40GB", "vendor": "AuthenticAMD", "family": 25, "model_number": 1},
     "cuda-nvidia-a100-sxm4-40gb"),
])
def test_machine_kind_names_the_core_and_its_vector_units(info, kind):
    from fedspear.experiments.bench import machine_kind

    assert machine_kind(info) == kind


def _result(kind="zen4-avx2", model="smollm2-135m", per_client_round=40.0, client_mb=3000.0, server_mb=1800.0):
    decode = {"batch_8": {"utilisation": 0.45, "tokens_per_s": 450.0, "bound_tokens_per_s": 1000.0},
              "batch_32": {"utilisation": 0.10, "tokens_per_s": 400.0, "bound_tokens_per_s": 4000.0}}
    return {"machine": {"kind": kind}, "model": model, "dtype": "fp32", "throughput": {"decode": decode},
            "round": {"seconds_per_client_round": per_client_round,
                      "peak_rss_mb": {"client": client_mb, "server": server_mb}}}


def _rendered() -> dict:
    """What ``render`` needs beside the targets' figures (bounds, prefill, training, evaluation)."""
    return {"date": "d", "bounds": {"matmul_flops_bf16": 1e9, "matmul_flops_fp32": 1e11,
                                    "memory_bandwidth_bytes_per_s": 3e10},
            "throughput": {**_result()["throughput"],
                           "prefill": {"tokens_per_s": 1, "flops": 1e9, "utilisation": 0.5},
                           "train": {"tokens_per_s": 1, "flops": 1e9, "utilisation": 0.5},
                           "evaluate": {"items_per_s": 1.0}}}


def test_targets_judged_by_hand():
    """Issue 19's targets on made-up figures: decode 45% / 10% of the bound (30% needed: 1,200 of 4,000 tokens/s at
    batch 32, 20 points short); 40 s per client-round = 40 / 66.5 = 0.6015 × (33.25 s needed, 6.75 s more); client
    3,000 MiB = 2.93 GiB (≤ 2.5: 0.43 GiB over), server 1,800 MiB = 1.76 GiB (≤ 2: met)."""
    from fedspear.experiments.bench import render, result_stem, targets

    rows = {t["target"]: t for t in targets(_result())}
    assert [t["met"] for t in rows.values()] == [True, False, False, False, True]
    d32 = rows["decode batch 32 ≥ 30% of the bandwidth bound"]
    assert d32["measured"] == "10% (400 of 4000 tokens/s)"
    assert d32["note"] == "missed by 20% of the bound (needs 1200 tokens/s)"
    r = rows["SPEAR client-round ≤ 0.5 × the authors' 66.5 s"]
    assert r["measured"] == "40.00 s = 0.602 ×" and r["note"] == (
        "missed: needs ≤ 33.25 s, 6.75 s more; the authors' code on this kind (zen4-avx2, 2026-11-25)")
    assert rows["peak RSS of the client ≤ 2.5 GiB"]["note"] == "missed by 0.43 GiB"
    assert rows["peak RSS of the server ≤ 2.0 GiB"]["met"]
    # the limit named, from the result's own figures: 130 M weights per token (body 100 M + head 25 M + LoRA 5 M),
    # 260 MB per step at 32.5 GB/s (bound 32 × 32.5e9 / 260e6 = 4,000 tokens/s at batch 32: 1,200 needed).
    # fp32 at 100 GFLOP/s: 32 × 2 × 130e6 / 100e9 = 83.2 ms of matmul per step, ≤ 384.6 tokens/s — compute-bound.
    # bf16 at 1 TFLOP/s: 8.3 ms of matmul, 8.0 ms of streaming, against a measured 32 / 400 = 80.0 ms step.
    figures = {"flop_counts": {"body": 100e6, "head": 25e6, "lora": 5e6}, "weight_bytes_per_decode_step": 260e6,
               "bounds": {"matmul_flops_fp32": 100e9, "matmul_flops_bf16": 1e12,
                          "memory_bandwidth_bytes_per_s": 32.5e9}}
    fp32 = {t["target"]: t for t in targets({**_result(), **figures})}
    assert fp32["decode batch 32 ≥ 30% of the bandwidth bound"]["note"] == (
        "missed by 20% of the bound (needs 1200 tokens/s); limit: compute-bound: the weights' matmuls alone take "
        "83.2 ms per step at the fp32 matmul bound (100 GFLOP/s): ≤ 385 tokens/s, below the 1200 needed")
    assert fp32["decode batch 8 ≥ 30% of the bandwidth bound"]["note"] == ""  # met: no limit given
    bf16 = {t["target"]: t for t in targets({**_result(), **figures, "dtype": "bf16"})}
    assert bf16["decode batch 32 ≥ 30% of the bandwidth bound"]["note"] == (
        "missed by 20% of the bound (needs 1200 tokens/s); limit: a step takes 80.0 ms against 8.0 ms to stream the "
        "weights and 8.3 ms for their matmuls at the bf16 matmul bound (1000 GFLOP/s): the rest is per-step overhead "
        "(op dispatch, attention, the KV cache, matmuls with few rows far below their bound)")
    # memory: what stays resident after the round, and what the round adds (3,000 − 1,024 MiB = 1.93 GiB)
    after = _result()
    after["round"]["rss_after_round_mb"] = {"client": 1024.0, "server": 900.0}
    assert {t["target"]: t for t in targets(after)}["peak RSS of the client ≤ 2.5 GiB"]["note"] == (
        "missed by 0.43 GiB; 1.00 GiB stay resident after a round (the model and what the allocator keeps), the "
        "round's working memory adds 1.93 GiB")
    # the Intel AMX kind has its own references, two machines (41.1 s, 2026-11-27; 38.8 s, 2026-12-06), not the Zen
    # 4's 66.5 s: 21.2 s / 41.1 = 0.516 ×, / 38.8 = 0.546 ×, missed against both (≤ 0.5 × 41.1 = 20.55 s; 0.65 s more)
    intel = {t["target"]: t for t in targets(_result(kind="intel-f6m167-avx512bf16", per_client_round=21.2))}
    r = intel["SPEAR client-round ≤ 0.5 × the authors' 38.8–41.1 s"]
    assert r["met"] is False and r["measured"] == "21.20 s = 0.516–0.546 ×"
    assert r["note"] == ("missed: needs ≤ 20.55 s against the slowest, 0.65 s more; the authors' code on 2 machines "
                         "of this kind (intel-f6m167-avx512bf16, 2026-12-06: 38.8 s, 2026-11-27: 41.1 s)")
    # the fp32-only Intel kind (AVX-512 without BF16) too: 46.0 s / 72.6 s = 0.634 ×
    ice = {t["target"]: t for t in targets(_result(kind="intel-f6m106-avx512", per_client_round=46.0))}
    r = ice["SPEAR client-round ≤ 0.5 × the authors' 72.6 s"]
    assert not r["met"] and r["measured"] == "46.00 s = 0.634 ×"
    assert r["note"].startswith("missed: needs ≤ 36.30 s, 9.70 s more; ")
    # the Zen 4 AVX-512 BF16 kind, timed on two machines (65.6 and 52.4 s): 39.3 s is 0.599–0.750 ×, missed against
    # both (≤ 0.5 × the slower is ≤ 32.80 s, 6.50 s less); 24.0 s is 0.366–0.458 ×, met against both; 30.0 s is
    # 0.457–0.573 ×, met against one only: undecided, only the authors' code on that machine tells
    rows = {s: {t["target"]: t for t in targets(_result(kind="zen4-avx512bf16", per_client_round=s))}
            for s in (39.3, 24.0, 30.0)}
    target = "SPEAR client-round ≤ 0.5 × the authors' 52.4–65.6 s"
    where = "the authors' code on 2 machines of this kind (zen4-avx512bf16, 2026-12-05: 52.4 s, 2026-12-02: 65.6 s)"
    assert rows[39.3][target] == {"target": target, "measured": "39.30 s = 0.599–0.750 ×", "met": False,
                                  "note": f"missed: needs ≤ 32.80 s against the slowest, 6.50 s more; {where}"}
    assert rows[24.0][target] == {"target": target, "measured": "24.00 s = 0.366–0.458 ×", "met": True, "note": where}
    r = rows[30.0][target]
    assert r["met"] is None and r["measured"] == "30.00 s = 0.457–0.573 ×"
    assert r["note"] == ("undecided: met against the authors' 65.6 s, not against their 52.4 s (≤ 26.20 s); machines "
                         "of one kind differ: time the authors' code on this machine (scripts/authors_reference.py); "
                         + where)
    # the Zen 5 kind meets it: 17.5 s / 42.2 s = 0.415 × (≤ 0.5 × is ≤ 21.10 s); a met row has no "missed" note
    zen5 = {t["target"]: t for t in targets(_result(kind="zen5-avx512bf16", per_client_round=17.5))}
    r = zen5["SPEAR client-round ≤ 0.5 × the authors' 42.2 s"]
    assert r == {"target": "SPEAR client-round ≤ 0.5 × the authors' 42.2 s", "measured": "17.50 s = 0.415 ×",
                 "met": True, "note": "the authors' code on this kind (zen5-avx512bf16, 2026-12-02)"}
    # ... and its fp32 figure does not: 29.0 s / 42.2 s = 0.687 ×, 7.90 s above 21.10 s
    r = {t["target"]: t for t in targets(_result(kind="zen5-avx512bf16", per_client_round=29.0))}[r["target"]]
    assert not r["met"] and r["note"].startswith("missed: needs ≤ 21.10 s, 7.90 s more; ")
    # a kind without a reference gets no ratio at all
    other = targets(_result(kind="zen3-avx2", per_client_round=16.0))
    r = next(t for t in other if "client-round" in t["target"])
    assert r == {"target": "SPEAR client-round ≤ 0.5 × the authors' code on the same machine kind",
                 "measured": "16.00 s", "met": None,
                 "note": "no same-kind reference: the authors' code was timed on zen4-avx2, intel-f6m167-avx512bf16, "
                         "intel-f6m106-avx512, zen4-avx512bf16, zen5-avx512bf16, not on zen3-avx2"}
    other = {**_result(kind="zen3-avx2", per_client_round=16.0), **_rendered()}
    other["machine"] = {"kind": "zen3-avx2", "cpu": "c", "threads": 2, "torch": "t"}
    other["round"] = {**other["round"], "config": {}, "seconds": dict.fromkeys(
        ("generate_initial", "generate_revisions", "train", "aggregate", "flower_overhead", "evaluate", "round"), 1.0),
        "flower_overhead_share": 0.1}
    assert "| 16.00 s | – | no same-kind reference" in render(other)
    # Qwen: only the client has a memory target (10 GiB = 10,240 MiB)
    qwen = targets(_result(model="qwen2.5-coder-1.5b", client_mb=11_059.2))
    assert [t["target"] for t in qwen if "RSS" in t["target"]] == ["peak RSS of the client ≤ 10.0 GiB"]
    assert qwen[-1]["note"] == "missed by 0.80 GiB"
    # on a GPU the resident memory is the host's, not what the targets are about: no memory rows
    assert not [t for t in targets({**_result(), "device": "cuda"}) if "RSS" in t["target"]]
    assert result_stem(_result()) == "zen4-avx2-smollm2-135m-fp32"
    forced_on = {**_result(), "gradient_checkpointing_setting": "on"}
    assert result_stem(forced_on) == "zen4-avx2-smollm2-135m-fp32-checkpointing"
    assert result_stem({"machine": {"kind": "zen4-avx2"}, "reference": {"model": "/m/Qwen", "dtype": "auto"},
                        "dtype": "bf16"}, scaling=True) == "zen4-avx2-Qwen-bf16-scaling"
    bench_only = {k: v for k, v in _result().items() if k != "round"}  # `fedspear bench --no-round`: decode only
    text = render({**bench_only, **_rendered(),
                   "machine": {"kind": "zen4-avx2", "cpu": "c", "threads": 2, "torch": "t"}})
    assert "Machine kind: **zen4-avx2** — c, 2 threads, torch t." in text
    assert "| decode batch 32 ≥ 30% of the bandwidth bound | 10% (400 of 4000 tokens/s) | **no** | missed by 20% " \
           "of the bound (needs 1200 tokens/s) |" in text and "client-round" not in text


def _git(cwd: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_commit_named_is_fedspears_own(tmp_path):
    """A real checkout whose ``src/fedspear`` is the package names its commit (``+changes`` once a tracked file of the
    package differs); the same source copied into another repository (as the 2026-11-27 GPU run had it) or into a
    folder outside git is "unknown (installed package)", never the surrounding repository's commit."""
    from fedspear.experiments.bench import UNKNOWN_COMMIT, source_commit

    repo = tmp_path / "fedspear"
    package = repo / "src" / "fedspear"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert source_commit(package) == head
    (package / "__init__.py").write_text("x = 1\n")
    assert source_commit(package) == head + "+changes"

    other = tmp_path / "other"
    copied = other / ".devbundle" / "fedspear" / "src" / "fedspear"
    copied.mkdir(parents=True)
    (copied / "__init__.py").write_text("")
    (other / "README").write_text("another project")
    _git(other, "init", "-q")
    _git(other, "add", "README")
    _git(other, "commit", "-qm", "other")
    assert source_commit(copied) == UNKNOWN_COMMIT
    _git(other, "add", ".")  # tracked there, but its top level is not the package's checkout
    _git(other, "commit", "-qm", "with the copy")
    assert source_commit(copied) == UNKNOWN_COMMIT

    outside = tmp_path / "plain" / "src" / "fedspear"
    outside.mkdir(parents=True)
    assert source_commit(outside) == UNKNOWN_COMMIT
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("this copy of the project is not a git checkout: no commit of its own to name")
    assert source_commit(repo / "src" / "fedspear") != UNKNOWN_COMMIT


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_reset_peak_makes_a_later_peak_its_own():
    """After a large allocation is freed, ``reset_peak`` brings the reported peak down to the present size, so the
    rounds' server (in the bench's own process) is not charged with the throughput measurements' peak."""
    from fedspear.runtime.memory import peak_rss_mb, release_memory, reset_peak, status

    block = np.ones(400 * 2**20 // 8)  # 400 MiB, touched
    high = peak_rss_mb()
    assert abs(status()["VmHWM"] - high) < 1  # ru_maxrss is the kernel's high-water mark
    del block
    now = release_memory()
    assert reset_peak()
    assert peak_rss_mb() < high - 300 and peak_rss_mb() <= now + 50


def test_release_memory_frees_new_cycles_and_scans_frozen_objects_every_nth_call(monkeypatch):
    """A reference cycle dropped since the last call is freed by the next one; a cycle that was alive at a call is
    frozen with the survivors and freed by the next full pass (every ``FULL_COLLECTION_EVERY``-th call), not before
    (conftest unfreezes after the test)."""
    import gc
    import weakref

    from fedspear.runtime import memory

    class Node:
        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

    monkeypatch.setattr(memory, "FULL_COLLECTION_EVERY", 3)
    monkeypatch.setattr(memory, "_releases", 0)
    freed: list[str] = []
    memory.release_memory()  # call 1
    young = Node()
    weakref.finalize(young, freed.append, "young")
    del young
    memory.release_memory()  # call 2: scans what was allocated since call 1
    assert freed == ["young"]
    old = Node()
    weakref.finalize(old, freed.append, "old")
    memory.release_memory()  # call 3, a full pass: old is alive, so it is frozen with the survivors after it
    assert gc.get_freeze_count() > 0
    del old
    memory.release_memory()  # call 4: old is frozen, not scanned
    memory.release_memory()  # call 5
    assert freed == ["young"]
    memory.release_memory()  # call 6: a full pass
    assert freed == ["young", "old"]


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/<pid>/smaps_rollup")
def test_tree_peak_sums_children_and_counts_a_shared_mapping_once(tmp_path):
    """TreePeak sums the whole process tree: a child holding 300 MiB of its own raises the RSS and PSS sums by about
    that much; a 300 MiB file both processes map and read is counted twice in the RSS sum and once in the PSS sum."""
    import mmap
    import subprocess
    import sys
    import time

    from fedspear.runtime.memory import TreePeak

    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\1" * (300 * 2**20))
    child_code = (
        "import mmap, sys, time\n"
        "own = bytearray(b'\\2' * (300 * 2**20))\n"
        "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "total = sum(m[i] for i in range(0, len(m), 4096))\n"
        "print('ready', flush=True); time.sleep(60)\n")
    tree = TreePeak()
    before = tree.sample()
    with open(blob, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        assert sum(mapped[i] for i in range(0, len(mapped), 4096)) == 300 * 2**20 // 4096  # every page resident
        child = subprocess.Popen([sys.executable, "-c", child_code, str(blob)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.2)
            now = tree.sample()
        finally:
            child.kill()
            child.wait()
            mapped.close()
    assert now["processes"] == before["processes"] + 1
    assert tree.full_readings == 2  # the child was new: every PSS read again
    # the child: 300 MiB private + 300 MiB mapped (+ an interpreter); the parent: the same 300 MiB mapped
    assert now["rss"] - before["rss"] > 300 + 300 + 300 - 50
    assert 300 + 300 - 50 < now["pss"] - before["pss"] < now["rss"] - before["rss"] - 250
    assert tree.peak()["pss"] >= now["pss"] - 0.1 and tree.peak(reset=True)["rss"] >= now["rss"] - 0.1
    assert tree.peak() == {}


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/<pid>/smaps_rollup")
def test_tree_peak_reads_pss_in_full_only_when_shared_pages_move_and_follows_private_memory_between(tmp_path):
    """Between full readings TreePeak takes a process's PSS as its anonymous RSS now plus its file-backed PSS at the
    last full reading: 200 MiB of private memory allocated and freed move the PSS sum by 200 MiB without a full
    reading, and the estimate is the kernel's PSS; a 100 MiB file mapped and read (file-backed pages) calls for a
    full reading; ``refresh = 0`` reads in full every time."""
    import mmap

    import psutil

    from fedspear.runtime.memory import TreePeak

    def true_pss() -> float:  # MiB, the kernel's reading of this process (the tree of a test process is itself)
        return psutil.Process().memory_full_info().pss / 2**20

    tree = TreePeak(refresh=3600)
    base = tree.sample()
    assert tree.full_readings == 1 and base["processes"] == 1
    own = bytearray(b"\2" * (200 * 2**20))  # written: resident, private
    grown = tree.sample()
    truth = true_pss()
    assert tree.full_readings == 1
    assert 200 - 20 < grown["pss"] - base["pss"] < 200 + 20
    assert abs(grown["pss"] - truth) < 10
    del own
    shrunk = tree.sample()
    assert tree.full_readings == 1 and abs(shrunk["pss"] - base["pss"]) < 20

    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\1" * (100 * 2**20))
    with open(blob, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            assert sum(mapped[i] for i in range(0, len(mapped), 4096)) == 100 * 2**20 // 4096
            read = tree.sample()
            truth = true_pss()
            assert tree.full_readings == 2  # its file-backed pages moved by 100 MiB
            assert 100 - 20 < read["pss"] - shrunk["pss"] < 100 + 20 and abs(read["pss"] - truth) < 10
        finally:
            mapped.close()

    every = TreePeak(refresh=0)
    every.sample()
    every.sample()
    assert every.full_readings == 2


def test_tree_peak_leaves_out_a_process_it_cannot_read_and_counts_rss_where_there_is_no_pss(monkeypatch):
    """A process whose full reading fails (not ours) is left out of the sums without calling for a full reading at
    every sample; where psutil gives no PSS and no ``shared`` field (not Linux), the PSS sum is the RSS sum and full
    readings come only every ``refresh`` seconds."""
    import collections
    import subprocess
    import sys

    import psutil

    from fedspear.runtime.memory import TreePeak

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real_full = psutil.Process.memory_full_info

    def refuse_child(self):
        if self.pid == child.pid:
            raise psutil.AccessDenied(self.pid)
        return real_full(self)

    try:
        monkeypatch.setattr(psutil.Process, "memory_full_info", refuse_child)
        tree = TreePeak(refresh=3600)
        first, second = tree.sample(), tree.sample()
        assert tree.full_readings == 1 and first["processes"] == second["processes"] == 1

        Mem = collections.namedtuple("Mem", "rss vms")  # psutil's fields on a system without statm's shared
        monkeypatch.setattr(psutil.Process, "memory_info", lambda self: Mem(100 * 2**20, 200 * 2**20))
        monkeypatch.setattr(psutil.Process, "memory_full_info", lambda self: Mem(100 * 2**20, 200 * 2**20))
        bare = TreePeak(refresh=3600)
        readings = [bare.sample() for _ in range(3)]
        assert bare.full_readings == 1
        assert all(r["pss"] == r["rss"] == 100 * r["processes"] for r in readings) and readings[0]["processes"] == 2
    finally:
        child.kill()
        child.wait()


def test_decode_is_timed_step_by_step_without_the_prefill():
    """generate calls the step clock once per new token, after that token's forward: ``new`` times, so the decode
    rate spans ``new − 1`` steps and no prefill; a 1-token decode has no step to time."""
    from transformers import LogitsProcessorList

    from fedspear.experiments.bench import StepClock, decode_tokens_per_s
    from fedspear.runtime.model import tiny_model

    model, tok = tiny_model(seed=0)
    clock = StepClock()
    ids = torch.randint(100, 1000, (3, 7))
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                       do_sample=False, pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([clock]))
    assert len(clock.times) == 5 and clock.times == sorted(clock.times)
    assert clock.tokens_per_s(3) == pytest.approx(3 * 4 / (clock.times[-1] - clock.times[0]))
    runs = decode_tokens_per_s(model, tok, "fp32", batch=2, prompt=6, new=4, repeats=2)
    assert len(runs) == 2 and all(0 < r < float("inf") for r in runs)
    with pytest.raises(ValueError, match="at least 2 new tokens"):
        decode_tokens_per_s(model, tok, "fp32", batch=2, prompt=6, new=1)
    with pytest.raises(ValueError, match="cache must be"):
        decode_tokens_per_s(model, tok, "fp32", batch=2, prompt=6, new=4, cache="static")


def test_a_timed_decode_runs_on_past_an_end_of_sequence(monkeypatch):
    """The bench decodes exactly ``new`` tokens per row even where the model would end every answer at once (EOS is
    the greedy choice at every step), without the min-length logits processor (a run's decode has none)."""
    from transformers.generation import logits_process

    from fedspear.experiments import bench
    from fedspear.runtime.model import tiny_model

    model, tok = tiny_model(seed=0)
    eos = torch.tensor([tok.eos_token_id])
    model.lm_head.register_forward_hook(lambda module, args, out: out.index_fill(-1, eos, 1e4))
    ids = torch.randint(100, 1000, (2, 6))
    with torch.no_grad():  # the hook works: a plain call stops after one token
        assert model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                              pad_token_id=tok.pad_token_id).shape[1] == 6 + 1
    clocks, masked = [], []

    class Clock(bench.StepClock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            clocks.append(self)

    monkeypatch.setattr(bench, "StepClock", Clock)
    monkeypatch.setattr(logits_process.MinNewTokensLengthLogitsProcessor, "__call__",
                        lambda self, input_ids, scores: masked.append(1) or scores)
    runs = bench.decode_tokens_per_s(model, tok, "fp32", batch=2, prompt=6, new=4, repeats=1)
    assert len(runs) == 1 and [c.marks() for c in clocks] == [4, 4] and masked == []


def test_the_step_clock_never_waits_for_a_gpu(monkeypatch):
    """On a CUDA device the clock records one event per new token and the host never waits for the GPU while
    ``generate`` runs (it prepares the next step while the GPU computes this one, as in a run): the span is the
    events' elapsed time, waited for once when it is read. Fake events here (10 ms apart on the GPU's timeline)."""
    from fedspear.experiments.bench import StepClock

    waits = []

    class Event:
        recorded = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at_ms = None

        def record(self):
            self.at_ms = 10.0 * Event.recorded
            Event.recorded += 1

        def synchronize(self):
            waits.append("event")

        def elapsed_time(self, end):
            return end.at_ms - self.at_ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: waits.append("device"))
    clock, scores = StepClock("cuda"), torch.zeros(3, 8)
    for _ in range(5):
        assert clock(None, scores) is scores
    assert waits == [] and clock.times == [] and clock.marks() == 5
    assert clock.seconds() == pytest.approx(0.040) and clock.tokens_per_s(3) == pytest.approx(3 * 4 / 0.040)
    assert waits == ["event", "event"]
    one = StepClock("cuda")
    one(None, scores)
    assert np.isnan(one.tokens_per_s(3)) and np.isnan(StepClock("cpu").seconds())


@pytest.mark.gpu
def test_the_step_clock_times_a_gpu_decode_without_waiting(monkeypatch):
    """A real greedy decode on the GPU (the tiny model): one event per new token, no more ``torch.cuda.synchronize``
    calls while ``generate`` runs than the same call makes without the clock, and a decode span within the call's
    wall time."""
    from transformers import LogitsProcessorList

    from fedspear.experiments.bench import StepClock
    from fedspear.runtime.model import tiny_model

    model, tok = tiny_model(seed=0)
    model.to("cuda")
    ids = torch.randint(100, 1000, (3, 7), device="cuda")
    waits, synchronize = [], torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: waits.append(1) or synchronize(*a, **k))

    def decode(processors: list) -> tuple[int, float]:
        synchronize()
        waits.clear()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                           do_sample=False, pad_token_id=tok.pad_token_id,
                           logits_processor=LogitsProcessorList(processors))
        count = len(waits)
        synchronize()
        return count, time.perf_counter() - start

    without, _ = decode([])
    clock = StepClock("cuda")
    with_clock, wall = decode([clock])
    assert with_clock == without and clock.marks() == 5 and clock.times == []
    assert 0 < clock.seconds() <= wall and 0 < clock.tokens_per_s(3) < float("inf")


def test_compiled_training_is_timed_when_asked(monkeypatch):
    """``compile_training = on`` times training a second time with the forward and backward compiled (here
    ``aot_eager``), the first micro-step (the compilation) apart, as a share of the matmul bound by the same FLOP
    count, and leaves the model training eagerly; ``off`` times nothing more; a bad setting fails before any
    measurement. The rendered table has its row."""
    from fedspear.experiments import bench
    from fedspear.runtime import compiled_training
    from fedspear.runtime.compiled_training import compiled_training as compiled_of
    from fedspear.runtime.model import add_lora, LoraSettings, tiny_model

    monkeypatch.setattr(compiled_training, "BACKEND", "aot_eager")
    model, _ = tiny_model(seed=0)
    model = add_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    said = []
    out = bench._compiled_train_rate(model, "fp32", "on", 2, 24, 0.05, 8, 1e6, 1e12, said.append)
    assert out["tokens_per_s"] > 0 and out["first_call_seconds"] > 0
    assert out["flops"] == pytest.approx(out["tokens_per_s"] * 1e6)
    assert out["utilisation"] == pytest.approx(out["flops"] / 1e12)
    assert said == ["training throughput, compiled"]
    assert compiled_of(model) is None and not model.training  # eager again afterwards
    assert bench._compiled_train_rate(model, "fp32", "off", 2, 24, 0.05, 8, 1e6, 1e12, said.append) == {}
    with pytest.raises(ValueError, match="compile_training must be on or off"):
        bench.run_bench("tiny-random", quick=True, round_=False, device="cpu", compile_training="auto")
    row = {"tokens_per_s": 120.0, "flops": 3e9, "utilisation": 0.25, "first_call_seconds": 40.0}
    bench_only = {k: v for k, v in _result().items() if k != "round"}
    rendered = _rendered()
    rendered["throughput"]["train_compiled"] = row
    lines = bench.render({**bench_only, **rendered, "machine": {"kind": "zen4-avx2", "cpu": "c", "threads": 2,
                                                                 "torch": "t"}}).splitlines()
    assert "| LoRA training, compiled (first micro-step 40.0 s) | 120 tokens/s (3.0 GFLOP/s) | 25% of matmul |" in lines


def test_compiled_decode_is_timed_where_it_compiles(monkeypatch):
    """``compile_decode = on`` times decode at batch 1 / 8 / 32 through the compiled step (here torch.compile's
    ``aot_eager``: the same graphs, eager kernels, seconds to compile) with each batch's first call apart, and leaves
    the model decoding eagerly; ``auto`` on the CPU and ``off`` time nothing more; a bad setting fails before any
    measurement."""
    from fedspear.experiments import bench
    from fedspear.runtime import compiled
    from fedspear.runtime.compiled import compiled_decode
    from fedspear.runtime.model import add_lora, LoraSettings, tiny_model

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model, tok = tiny_model(seed=0)
    model = add_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    bounds = {"memory_bandwidth_bytes_per_s": 1e10}
    said = []
    out = bench._compiled_decode_rates(model, tok, "fp32", "on", "cpu", True, bounds, 10**6, said.append)
    assert set(out) == {"batch_1", "batch_8", "batch_32"}
    for b, d in ((1, out["batch_1"]), (32, out["batch_32"])):
        assert d["tokens_per_s"] > 0 and d["first_call_seconds"] > 0 and len(d["runs"]) == 1
        assert d["bound_tokens_per_s"] == pytest.approx(b * 1e10 / 1e6)
        assert d["utilisation"] == pytest.approx(d["tokens_per_s"] / d["bound_tokens_per_s"])
    assert said == [f"decode at batch {b}, compiled" for b in (1, 8, 32)]
    assert compiled_decode(model) is None  # eager again afterwards
    for setting in ("auto", "off"):
        assert bench._compiled_decode_rates(model, tok, "fp32", setting, "cpu", True, bounds, 10**6, said.append) == {}
    with pytest.raises(ValueError, match="auto, on or off"):
        bench.run_bench("tiny-random", quick=True, round_=False, device="cpu", compile_decode="yes")
