"""fedspear's cache (``fedspear.runtime.cache``): exports named by the GGUF file, not its place; ``fedspear models
list`` shows what the cache holds and ``fedspear models clean`` removes only what this install cannot reach."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from fedspear.cli import app
from fedspear.runtime import model_zoo
from fedspear.runtime.model_zoo import ModelError, copies_dir, export_path

runner = CliRunner()
DEAD_PID = 4194305  # above Linux's largest pid_max (2^22): no process has it


def _gguf(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_an_export_is_named_by_the_gguf_file_not_by_where_it_is_installed(tmp_path, monkeypatch):
    """The same package installed in two environments (two paths, same bytes) resolves to one export; a file that
    differs in its last byte, or in size, to another. (Before, the export was named by the path: each new
    environment exported SmolLM2 again, 0.5 GiB each.)"""
    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "cache"))
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    a = _gguf(tmp_path / "env-a" / "site-packages" / "m.gguf", data)
    b = _gguf(tmp_path / "env-b" / "site-packages" / "m.gguf", data)
    c = _gguf(tmp_path / "env-c" / "m.gguf", data[:-1] + bytes([data[-1] ^ 1]))
    d = _gguf(tmp_path / "env-d" / "m.gguf", data + b"\0")
    assert export_path("m", a) == export_path("m", b)
    assert export_path("m", a).parent == tmp_path / "cache" / "models" and export_path("m", a).name.startswith("m-")
    assert len({export_path("m", p) for p in (a, c, d)}) == 3


def _copy(path, folder: str | None):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.zeros((4, 4), np.float32)}, str(path), metadata={"folder": folder} if folder else None)
    path.with_name(path.name + ".lock").touch()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache holding, beside this install's SmolLM2 export and its weight copy, what an older install left."""
    try:
        gguf = model_zoo.packaged_gguf("smollm2-135m")
    except ModelError as err:
        pytest.skip(f"needs the packaged SmolLM2 (make install): {err}")
    root = tmp_path / "cache"
    monkeypatch.setenv("FEDSPEAR_CACHE", str(root))
    current = export_path("smollm2-135m", gguf)
    old = root / "models" / "smollm2-135m-0123456789"
    local = tmp_path / "my-model"
    for folder in (current, old, local):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    stopped = root / "models" / f"smollm2-135m-ce4438ba53.{DEAD_PID}.tmp"
    stopped.mkdir()
    (stopped / "model.safetensors").write_bytes(b"\0" * 1000)
    keep = [current, _copy(copies_dir() / "smollm2-135m-a.safetensors", str(current)),
            _copy(copies_dir() / "my-model-b.safetensors", str(local))]
    drop = [old, stopped, _copy(copies_dir() / "smollm2-135m-c.safetensors", str(old)),
            _copy(copies_dir() / "gone-d.safetensors", str(tmp_path / "gone")),
            _copy(copies_dir() / "smollm2-135m-e.safetensors", None)]
    keep.append(_split(root, current=True))
    drop += [_split(root, current=False), _split(root, current=True, tmp=f".{DEAD_PID}.tmp")]
    return root, keep, drop


def _split(root, current: bool, tmp: str = ""):
    """A client split kept by ``fedspear.fl.partition``: computed with this install's libraries, or with another
    flwr-datasets; ``tmp``: its writer's temporary file (``.<name>.<pid>.tmp``) instead."""
    from fedspear.fl import partition

    key = partition.split_key((0, 1) * 4, 2, 1.0, 1 if tmp else 0, "inner_dirichlet")
    if not current:
        key["versions"] = {**key["versions"], "flwr-datasets": "0.0.1"}
    path = partition.split_path(key)
    partition._write_split(path, key, ((0, 2, 4, 6), (1, 3, 5, 7)))
    assert partition._read_split(path, key) == ((0, 2, 4, 6), (1, 3, 5, 7)) and path.parent == root / "splits"
    if tmp:
        path = path.rename(path.with_name(f".{path.name}{tmp}"))
    return path


def test_models_list_shows_the_cache_and_what_this_install_does_not_use(cache):
    root, keep, drop = cache
    out = runner.invoke(app, ["models", "list"])
    assert out.exit_code == 0, out.output
    assert f"cache {root}:" in out.output and "in 11 entries" in out.output
    def listed(path) -> bool:  # client splits are counted on one line per state, not listed one by one
        return not (path.parent.name == "splits" and path.suffix == ".json")

    for path in filter(listed, keep):
        line = next(line for line in out.output.splitlines() if str(path.relative_to(root)) + " " in line)
        assert line.endswith("(used)"), line
    for path in filter(listed, drop):
        line = next(line for line in out.output.splitlines() if str(path.relative_to(root)) + " " in line)
        assert "not used:" in line, line
    assert "client split splits/ × 1  (used)" in out.output
    assert "client split splits/ × 1  (not used: computed with other versions of flwr-datasets" in out.output
    assert "not used by this install:" in out.output and "in 7 entries (`fedspear models clean`" in out.output


def test_models_clean_removes_only_what_this_install_cannot_reach(cache):
    root, keep, drop = cache
    dry = runner.invoke(app, ["models", "clean", "--dry-run"])
    assert dry.exit_code == 0 and "would remove 7 entries" in dry.output
    assert all(p.exists() for p in keep + drop)

    done = runner.invoke(app, ["models", "clean"])
    assert done.exit_code == 0, done.output
    assert "removed 7 entries" in done.output
    assert all(p.exists() for p in keep)
    assert not any(p.exists() for p in drop)
    assert not any(p.with_name(p.name + ".lock").exists() for p in drop if p.suffix == ".safetensors")
    assert all(p.with_name(p.name + ".lock").exists() for p in keep if p.suffix == ".safetensors")
    again = runner.invoke(app, ["models", "clean"])
    assert again.exit_code == 0 and "nothing to remove" in again.output


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A split model of two 1 KiB parts in a cache at a path reached through a symlink; ``installed`` toggles whether
    its parts are there (``model_zoo.split_part_paths``)."""
    real = tmp_path / "real-cache"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "link"))
    monkeypatch.setattr(model_zoo, "PACKAGED_MODELS", {})
    monkeypatch.setattr(model_zoo, "SPLIT_MODELS", {"big": model_zoo.SplitModel(
        package="big-part{i}", parts=2, version="1", chunk="part{i}.bin", filename="big.gguf", licence="x")})
    import fedspear.runtime.cache as cache_module

    monkeypatch.setattr(cache_module, "PACKAGED_MODELS", {})
    monkeypatch.setattr(cache_module, "SPLIT_MODELS", model_zoo.SPLIT_MODELS)
    parts = [_gguf(tmp_path / "site" / f"part{i}.bin", b"\1" * 1024) for i in (1, 2)]
    state = {"installed": True}

    def part_paths(name):
        if not state["installed"]:
            raise ModelError("parts not installed")
        return parts

    monkeypatch.setattr(model_zoo, "split_part_paths", part_paths)
    return real, state


def test_a_split_models_export_and_gguf_are_used_while_its_parts_are_installed(split_model):
    """The export's name is known from the parts before the join (a missing joined GGUF does not orphan it); once the
    parts are gone, the export, the joined GGUF and the weight copy of that export are all unused in one pass, also
    when the cache is reached through a symlink (the copy names its folder's real path)."""
    from fedspear.runtime.cache import cache_entries

    real, state = split_model
    export = export_path("big")
    assert export.name.startswith("big-") and export.parent == real.parent / "link" / "models"
    (real / "models" / export.name).mkdir(parents=True)
    (real / "models" / export.name / "config.json").write_text("{}")
    _copy(copies_dir() / f"{export.name}-a.safetensors", str((real / "models" / export.name).resolve()))
    assert {e.kind: e.used for e in cache_entries()} == {"export": True, "weight copy": True}
    _gguf(real / "gguf" / "big.gguf", b"\1" * 2048)
    assert all(e.used for e in cache_entries())
    state["installed"] = False
    entries = cache_entries()
    assert {e.kind for e in entries} == {"export", "joined GGUF", "weight copy"} and not any(e.used for e in entries)


def test_clean_keeps_what_a_running_process_has_mapped_and_a_live_writers_temporary(cache, tmp_path):
    """An unused weight copy that another process maps (a run of an older install) is kept, naming that process;
    a temporary file whose writer is alive is kept; after the process ends the copy goes."""
    import os
    import subprocess
    import sys

    root, keep, drop = cache
    mapped = drop[2]
    live = copies_dir() / f".x.safetensors.{os.getpid()}.tmp"
    live.write_bytes(b"\0" * 10)
    reader = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
        "print('mapped', flush=True); sys.stdin.read()"), str(mapped)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert reader.stdout.readline().strip() == "mapped"
        done = runner.invoke(app, ["models", "clean"])
        assert done.exit_code == 0, done.output
        assert f"kept: in use by process {reader.pid}" in done.output and "removed 6 entries" in done.output
        assert mapped.exists() and live.exists() and all(p.exists() for p in keep)
    finally:
        reader.communicate("", timeout=30)
    assert "removed 1 entries" in runner.invoke(app, ["models", "clean"]).output and not mapped.exists()
