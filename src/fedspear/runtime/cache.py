"""What fedspear's cache (``$FEDSPEAR_CACHE`` or ``~/.cache/fedspear``) holds, and which of it this install uses.

Three kinds of entries, all made on first use and never downloaded:

- ``models/<model>-<digest>``: a packaged model's export (``fedspear.runtime.model_zoo.export_path``: SmolLM2-135M
  ≈ 0.5 GiB, Qwen2.5-Coder-1.5B ≈ 6.7 GiB, fp32 safetensors);
- ``gguf/<file>``: a split model's joined GGUF (Qwen2.5-Coder-1.5B: 1.04 GiB);
- ``shared/<folder>-<digest>.safetensors``: a model folder's converted weights, mapped by every process of a run
  (``fedspear.runtime.shared_copy``; Qwen2.5-Coder-1.5B ≈ 3.7 GiB), with its ``.lock``.

An entry is *not used by this install* when nothing this install loads can reach it: an export other than the one
each installed packaged model resolves to (an older package or an older fedspear, whose exports were named by the
GGUF's path), a joined GGUF of a model whose parts are gone, a weight copy of a folder that is gone or is such an
export, and temporary files of writers that are gone. ``fedspear models clean`` removes those. Another fedspear
install on the same machine may still use one: it exports or copies again what it needs (time, not data).
Nothing here imports torch.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .model_zoo import (PACKAGED_MODELS, SPLIT_MODELS, ModelError, cache_root, export_path, left_by_a_dead_process,
                        packaged_gguf, split_part_paths)


@dataclass(frozen=True)
class CacheEntry:
    """One file or folder of the cache: ``kind`` (export | joined GGUF | weight copy | temporary), its path, its
    size in bytes (with a weight copy's lock file), whether this install uses it, and why not."""

    kind: str
    path: Path
    size: int
    used: bool
    why: str = ""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def current_exports() -> dict[Path, str]:
    """{export folder: model} for every packaged model this install can load (its package or its parts, joined)."""
    current = {}
    for model in PACKAGED_MODELS:
        try:
            current[export_path(model, packaged_gguf(model))] = model
        except (ModelError, OSError):
            continue
    for model, split in SPLIT_MODELS.items():
        joined = cache_root() / "gguf" / split.filename
        if joined.is_file():
            current[export_path(model, joined)] = model
    return current


def _copy_source(path: Path) -> str | None:
    """The model folder a weight copy was made from (its safetensors metadata), or None when unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            return (fh.metadata() or {}).get("folder")
    except (OSError, SafetensorError):
        return None


def cache_entries() -> list[CacheEntry]:
    """Every entry of the cache with its size and whether this install uses it (the module docstring): exports,
    joined GGUFs, weight copies, then temporary files, each sorted by path. An absent cache has none."""
    root = cache_root()
    current = current_exports()
    entries: list[CacheEntry] = []
    exports = root / "models"
    for path in sorted(exports.iterdir()) if exports.is_dir() else []:
        if path.name.endswith(".tmp"):
            entries.append(_temporary(path))
        elif path in current:
            entries.append(CacheEntry("export", path, _size(path), True))
        else:
            entries.append(CacheEntry("export", path, _size(path), False, "no installed package resolves to it"))
    ggufs = root / "gguf"
    installed = set()
    for model, split in SPLIT_MODELS.items():
        try:
            split_part_paths(model)
            installed.add(split.filename)
        except ModelError:
            continue
    for path in sorted(ggufs.iterdir()) if ggufs.is_dir() else []:
        if path.name.endswith(".tmp"):
            entries.append(_temporary(path))
        else:
            entries.append(CacheEntry("joined GGUF", path, _size(path), path.name in installed,
                                      "" if path.name in installed else "its model's parts are not installed"))
    shared = root / "shared"
    for path in sorted(shared.glob("*.safetensors")) if shared.is_dir() else []:
        lock = path.with_name(path.name + ".lock")
        size = _size(path) + (_size(lock) if lock.exists() else 0)
        source = _copy_source(path)
        if source is None:
            why = "unreadable or made before copies named their folder"
        elif not Path(source).is_dir():
            why = f"its folder {source} is gone"
        elif Path(source).parent == exports and Path(source) not in current:
            why = "its folder is an export no installed package resolves to"
        else:
            why = ""
        entries.append(CacheEntry("weight copy", path, size, not why, why))
    for path in sorted(shared.glob(".*.tmp")) if shared.is_dir() else []:
        entries.append(_temporary(path))
    return entries


def _temporary(path: Path) -> CacheEntry:
    if left_by_a_dead_process(path):
        return CacheEntry("temporary", path, _size(path), False, "left by a writer that is gone")
    return CacheEntry("temporary", path, _size(path), True, "")


def remove(entries: list[CacheEntry]) -> int:
    """Remove the entries this install does not use (a weight copy with its lock); returns the bytes freed.

    A process that still maps a removed weight copy keeps reading it (the file lives on while mapped).

    Raises:
        OSError: an entry could not be removed (the ones before it are gone).
    """
    freed = 0
    for entry in entries:
        if entry.used:
            continue
        if entry.path.is_dir():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink(missing_ok=True)
            if entry.kind == "weight copy":
                entry.path.with_name(entry.path.name + ".lock").unlink(missing_ok=True)
        freed += entry.size
    return freed


def human_size(size: int) -> str:
    """Bytes as ``512 MiB`` / ``6.7 GiB``."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.1f} GiB"
    return f"{size / (1 << 20):.0f} MiB"
