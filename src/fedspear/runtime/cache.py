"""What fedspear's cache (``$FEDSPEAR_CACHE`` or ``~/.cache/fedspear``) holds, and which of it this install uses.

Four kinds of entries, all made on first use and never downloaded:

- ``models/<model>-<digest>``: a packaged model's export (``fedspear.runtime.model_zoo.export_path``: SmolLM2-135M
  ≈ 0.5 GiB, Qwen2.5-Coder-1.5B ≈ 6.6 GiB, fp32 safetensors);
- ``gguf/<file>``: a split model's joined GGUF (Qwen2.5-Coder-1.5B: 1.04 GiB);
- ``shared/<folder>-<digest>.safetensors``: a model folder's converted weights, mapped by every process of a run
  (``fedspear.runtime.shared_copy``; Qwen2.5-Coder-1.5B ≈ 3.7 GiB), with its ``.lock``;
- ``splits/<digest>.json``: a client split computed with flwr-datasets (``fedspear.fl.partition``: a few KiB to
  0.3 MiB), kept so that later processes need not import it.

An entry is *not used by this install* when nothing this install loads can reach it: an export other than the one
each installed model resolves to (an older package, or SmolLM2 exported by an older fedspear, which named exports
by the GGUF's path, one per environment), a split model's export and joined GGUF once its parts are uninstalled, a
weight copy of a folder that is gone or is such an export (or that does not name its folder), and temporary files of
writers that are gone. Such an entry is still *in use* while a running process has one of its files open or mapped
(another fedspear install's run, say): ``fedspear models clean`` keeps it then, and removes the rest — a weight
copy only while holding its lock, so no writer is between the lock and the rename. A split is not used by this
install when it was computed with other versions of ``SPLIT_LIBRARIES`` than those installed (or cannot be read).
Another install re-creates what it needs on its next run (time, not data). Nothing here imports torch.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .model_zoo import (PACKAGED_MODELS, SPLIT_MODELS, ModelError, cache_root, copies_dir, export_path,
                        left_by_a_dead_process)


SPLIT_LIBRARIES = ("flwr-datasets", "datasets", "numpy")  # whose versions a cached client split depends on


def splits_dir() -> Path:
    """Where client splits are kept: ``<cache>/splits`` (``fedspear.fl.partition``)."""
    return cache_root() / "splits"


def split_versions() -> dict[str, str | None]:
    """{library: installed version, or None} for each of ``SPLIT_LIBRARIES``."""
    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {name: installed(name) for name in SPLIT_LIBRARIES}


@dataclass(frozen=True)
class CacheEntry:
    """One file or folder of the cache: ``kind`` (export | joined GGUF | weight copy | client split | temporary),
    its path, its size in bytes (a weight copy with its lock file), whether this install uses it, and why not (or
    which process has it open when it is kept for that)."""

    kind: str
    path: Path
    size: int
    used: bool
    why: str = ""


def _size(path: Path) -> int:
    """Bytes under ``path``; files that vanish while counted (a writer renaming its temporary) count 0."""
    def one(p: Path) -> int:
        try:
            return p.stat().st_size if p.is_file() else 0
        except OSError:
            return 0
    return one(path) if not path.is_dir() else sum(one(p) for p in path.rglob("*"))


def installed_models() -> dict[str, Path]:
    """{model: its export folder (made or not)} for every packaged model this install can load: its package, or all
    of a split model's parts (the joined GGUF need not exist yet)."""
    current = {}
    for model in (*PACKAGED_MODELS, *SPLIT_MODELS):
        try:
            current[model] = export_path(model).resolve()
        except (ModelError, OSError):
            continue
    return current


def open_paths() -> dict[Path, int]:
    """{path: pid} of every file a running process of this user has open or mapped (psutil; processes it may not
    read are skipped)."""
    import psutil

    found: dict[Path, int] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            for item in [*proc.memory_maps(grouped=True), *proc.open_files()]:
                if item.path.startswith("/"):
                    found.setdefault(Path(item.path), proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def copy_source(path: Path) -> str | None:
    """The model folder a weight copy was made from (its safetensors metadata), or None when unreadable or unnamed."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            return (fh.metadata() or {}).get("folder") or None
    except (OSError, SafetensorError):
        return None


def cache_entries() -> list[CacheEntry]:
    """Every entry of the cache with its size and whether this install uses it (the module docstring): exports,
    joined GGUFs, weight copies, client splits, then temporary files, each sorted by path. An absent cache has
    none."""
    root = cache_root().resolve()
    installed = installed_models()
    exports, ggufs, shared = root / "models", root / "gguf", copies_dir().resolve()
    current = set(installed.values())
    joined = {SPLIT_MODELS[m].filename for m in installed if m in SPLIT_MODELS}
    entries: list[CacheEntry] = []
    temporary: list[Path] = []
    for path in sorted(exports.iterdir()) if exports.is_dir() else []:
        if path.name.endswith(".tmp"):
            temporary.append(path)
        else:
            entries.append(CacheEntry("export", path, _size(path), path in current,
                                      "" if path in current else "no installed model resolves to it"))
    for path in sorted(ggufs.iterdir()) if ggufs.is_dir() else []:
        if path.name.endswith(".tmp"):
            temporary.append(path)
        else:
            entries.append(CacheEntry("joined GGUF", path, _size(path), path.name in joined,
                                      "" if path.name in joined else "its model's parts are not installed"))
    for path in sorted(shared.glob("*.safetensors")) if shared.is_dir() else []:
        lock = path.with_name(path.name + ".lock")
        source = copy_source(path)
        folder = Path(source).resolve() if source else None
        if folder is None:
            why = "unreadable, or made before copies named their folder"
        elif not folder.is_dir():
            why = f"its folder {source} is gone"
        elif folder.parent == exports and folder not in current:
            why = "its folder is an export no installed model resolves to"
        else:
            why = ""
        entries.append(CacheEntry("weight copy", path, _size(path) + _size(lock), not why, why))
    temporary += sorted(shared.glob(".*.tmp")) if shared.is_dir() else []
    splits, versions = splits_dir().resolve(), split_versions()
    for path in sorted(splits.glob("*.json")) if splits.is_dir() else []:
        try:
            made_with = json.loads(path.read_text(encoding="utf-8"))["key"]["versions"]
        except (OSError, ValueError, KeyError, TypeError):
            made_with = None
        why = "" if made_with == versions else ("unreadable" if made_with is None else "computed with other "
                                                f"versions of {', '.join(SPLIT_LIBRARIES)} than those installed")
        entries.append(CacheEntry("client split", path, _size(path), not why, why))
    temporary += sorted(splits.glob(".*.tmp")) if splits.is_dir() else []
    for path in temporary:
        dead = left_by_a_dead_process(path)
        entries.append(CacheEntry("temporary", path, _size(path), not dead, "left by a writer that is gone" if dead
                                  else ""))
    return _in_use(entries) if any(not e.used for e in entries) else entries


def _in_use(entries: list[CacheEntry]) -> list[CacheEntry]:
    """Mark the unused entries a running process has a file of open or mapped as used, naming that process."""
    opened = open_paths()
    marked = []
    for e in entries:
        pid = next((pid for path, pid in opened.items() if path == e.path or e.path in path.parents), None)
        if not e.used and pid is not None:
            e = CacheEntry(e.kind, e.path, e.size, True, f"in use by process {pid}")
        marked.append(e)
    return marked


def remove(entries: list[CacheEntry]) -> int:
    """Remove the entries this install does not use; returns the bytes freed.

    A weight copy goes with its lock file, while holding that lock (a copy whose lock another process holds, a writer
    or a reader checking it, is left for the next clean); a process that still maps a removed copy keeps reading it.

    Raises:
        OSError: an entry could not be removed (the ones before it are gone).
    """
    freed = 0
    for entry in entries:
        if entry.used or not entry.path.exists():
            continue
        if entry.kind == "weight copy":
            if not _remove_copy(entry.path):
                continue
        elif entry.path.is_dir():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink(missing_ok=True)
        freed += entry.size
    return freed


def _remove_copy(path: Path) -> bool:
    """Unlink a weight copy and then its lock while holding the lock (``shared_copy``'s writers take it); False when
    another process holds it."""
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    return True


def human_size(size: int) -> str:
    """Bytes as ``512 MiB`` / ``6.6 GiB``."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.1f} GiB"
    return f"{size / (1 << 20):.0f} MiB"
