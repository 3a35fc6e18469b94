"""One read-only copy of a model's CPU weights on disk, memory-mapped by every process that loads the model.

On a CPU computing in bf16, ``load_base`` holds the linear weights in bf16 and the rest in fp32
(``cpu_kernels.store_linear_weights_bf16``). Converted in each process, those are private memory: a simulation's server
(evaluation) and its client actor each held their own ≈ 4 GB of Qwen2.5-Coder-1.5B (issue 42 §3). Here the converted
tensors are written once to a safetensors file in fedspear's cache (``$FEDSPEAR_CACHE/shared``), and every process
maps that file instead (safetensors' ``safe_open``: each tensor a view of a private, read-only file mapping), so the
kernel holds one copy in its page cache for all of them; loading also reads the bf16 file (≈ 4 GB for Qwen) instead of
converting the fp32 export (≈ 6 GB). The values are those the conversion gives, bit for bit (a test compares every
tensor and the logits).

The file is named by a digest of the model folder's weights (path, names, sizes, modification times) and of this
module's ``FORMAT``: a changed export gets a new copy. The first process to need it writes it under an exclusive
``flock`` (to a temporary name, then renamed); the others wait for it and map the same file.

Nothing writes into a base weight in fedspear (LoRA trains its own tensors; generation merges an adapter into the
weights only in fp32, where no copy is used), and a write would touch this process's private pages only: the file
never changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from .model_zoo import cache_root

log = logging.getLogger(__name__)

FORMAT = 1  # raise when what the copy holds changes: every copy is written again
KIND = "cpu-bf16-linears"


def copy_path(model_dir: str | Path) -> Path:
    """Where the shared copy of the model in ``model_dir`` (an exported or local transformers folder) lives:
    ``<cache>/shared/<folder name>-<digest>.safetensors``; the digest covers the folder's real path, its weight and
    config files' names, sizes and modification times, ``FORMAT`` and ``KIND``."""
    folder = Path(model_dir).resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    key = json.dumps({"format": FORMAT, "kind": KIND, "folder": str(folder),
                      "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]})
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "shared" / f"{folder.name}-{digest}.safetensors"


def _untie_output(base) -> bool:
    """Give a tied output embedding a parameter of its own (a placeholder, replaced by the caller), so that
    ``named_parameters`` lists ``lm_head.weight`` apart from the input embedding; True if it was tied."""
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        return True
    return False


def _tensors(base) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``base`` by its state-dict name (a tied output embedding already has
    its own parameter, ``store_linear_weights_bf16``)."""
    state_names = set(base.state_dict(keep_vars=True))
    out = {name: p.data for name, p in base.named_parameters()}
    out.update({name: b.data for name, b in base.named_buffers() if name in state_names})
    return out


def write_copy(base, path: str | Path) -> None:
    """Write ``base``'s converted tensors (after ``store_linear_weights_bf16``) to ``path`` as safetensors, atomically
    (a temporary file renamed); the caller holds the lock."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {name: t.contiguous() for name, t in _tensors(base).items()}
    save_file(tensors, str(tmp), metadata={"fedspear_format": str(FORMAT), "kind": KIND})
    os.replace(tmp, path)


def map_copy(base, path: str | Path) -> int:
    """Point every parameter and persistent buffer of ``base`` (loaded in fp32, not yet converted) at the tensors of
    the shared copy at ``path`` (views of a read-only mapping of the file); returns how many tensors.

    Raises:
        ValueError: the copy does not hold exactly ``base``'s tensors with their shapes (the model changed); nothing
            of ``base`` is changed then.
    """
    from safetensors import safe_open

    untied = _untie_output(base)
    targets = {name: p for name, p in base.named_parameters()}
    state_names = set(base.state_dict(keep_vars=True))
    targets.update({name: b for name, b in base.named_buffers() if name in state_names})
    with safe_open(str(path), framework="pt") as fh:
        names = set(fh.keys())
        mapped = {name: fh.get_tensor(name) for name in names} if names == set(targets) else {}
    wrong = sorted(set(targets) ^ names) or sorted(
        name for name, t in mapped.items()
        if tuple(t.shape) != tuple(targets[name].shape) and not (untied and targets[name].numel() == 0))
    if wrong:
        if untied:
            inp = base.get_input_embeddings()
            base.get_output_embeddings().weight = inp.weight
        raise ValueError(f"the shared weight copy {path} does not match the model (e.g. {wrong[0]})")
    for name, tensor in mapped.items():
        targets[name].data = tensor
    return len(mapped)


def shared_bf16_weights(base, model_dir: str | Path) -> Path | None:
    """Hold ``base``'s weights as ``store_linear_weights_bf16`` would, but as views of the shared copy of
    ``model_dir`` (written first if missing, by the first process to get the lock); returns the copy's path, or None
    when the cache cannot be written (the conversion then runs in this process, as before, with a warning).

    Raises:
        OSError: reading an existing copy failed (a damaged file: delete it and it is written again).
    """
    from .cpu_kernels import store_linear_weights_bf16

    path = copy_path(model_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a+")
    except OSError as err:
        log.warning("cannot write the shared weight copy in %s (%s): converting in this process", path.parent, err)
        store_linear_weights_bf16(base)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; a second process waits for the copy
        if path.exists():
            try:
                map_copy(base, path)
                return path
            except ValueError as err:
                log.warning("%s; writing it again", err)
        store_linear_weights_bf16(base)
        try:
            write_copy(base, path)
        except OSError as err:
            log.warning("cannot write the shared weight copy %s (%s): this process keeps its own", path, err)
            return None
        log.info("wrote the shared weight copy %s (%.2f GB)", path, path.stat().st_size / 1e9)
        map_copy(base, path)  # the converted tensors in this process are dropped for the mapped ones
        return path
