"""One read-only copy of a model's CPU weights on disk, memory-mapped by every process that loads the model.

On a CPU computing in bf16, ``load_base`` holds the linear weights in bf16 and the rest in fp32
(``cpu_kernels.store_linear_weights_bf16``). Converted in each process, those are private memory: a simulation's server
(evaluation) and its client actor each held their own ≈ 4 GB of Qwen2.5-Coder-1.5B (issue 42 §3). Here the converted
tensors are written once to a safetensors file in fedspear's cache (``$FEDSPEAR_CACHE/shared``), and every process
maps that file instead (safetensors' ``safe_open``: each tensor a view of a private, copy-on-write file mapping), so
the kernel holds one copy in its page cache for all of them; loading also reads the bf16 file (≈ 4 GB for Qwen)
instead of converting the fp32 export (≈ 6 GB). The values are those the conversion gives, bit for bit (a test
compares every tensor and the logits).

The file is named by a digest of the model folder's files (path, names, sizes, modification times), of the conversion
(``store_linear_weights_bf16``'s source, torch's version) and of this module's ``FORMAT``: a changed export or
conversion gets a new copy, and a copy whose tensors' names, shapes or dtypes are not the ones the conversion gives is
written again. The first process to need it writes it under an exclusive ``flock`` (to a temporary name, synced, then
renamed; what a stopped writer left is removed by the next); the others wait for it and map the same file. Where the
copy cannot be written or read (a read-only cache, a full disk, a damaged file), the process converts in its own
memory, as before, with a warning. Hub ids (no local folder) are converted in the process too.

Nothing writes into a base weight in fedspear (LoRA trains its own tensors; generation merges an adapter into the
weights only in fp32, where no copy is used). A write would not reach the file: the mapping is private, so the
written pages become this process's own copy (and are no longer shared).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from pathlib import Path

import torch

from .model_zoo import copies_dir, left_by_a_dead_process

log = logging.getLogger(__name__)

FORMAT = 1  # raise when what the copy holds changes: every copy is written again
KIND = "cpu-bf16-linears"


def copy_path(model_dir: str | Path) -> Path:
    """Where the shared copy of the model in ``model_dir`` (an exported or local transformers folder) lives:
    ``<cache>/shared/<folder name>-<digest>.safetensors``; the digest covers the folder's real path, its weight and
    config files' names, sizes and modification times, the conversion's source, torch's version, ``FORMAT`` and
    ``KIND``.

    Raises:
        OSError: ``model_dir`` cannot be listed (not a folder).
    """
    from .cpu_kernels import store_linear_weights_bf16

    folder = Path(model_dir).resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    key = json.dumps({"format": FORMAT, "kind": KIND, "folder": str(folder), "torch": torch.__version__,
                      "conversion": inspect.getsource(store_linear_weights_bf16),
                      "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]})
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return copies_dir() / f"{folder.name}-{digest}.safetensors"


def _untie_output(base) -> bool:
    """Give a tied output embedding a parameter of its own (a placeholder, replaced by the caller), so that
    ``named_parameters`` lists ``lm_head.weight`` apart from the input embedding; True if it was tied."""
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        return True
    return False


def _tensors(base) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``base`` (the objects, not their data) by its state-dict name; a tied
    output embedding is listed once, under the input embedding's name."""
    state_names = set(base.state_dict(keep_vars=True))
    out = dict(base.named_parameters())
    out.update({name: b for name, b in base.named_buffers() if name in state_names})
    return out


def write_copy(base, path: str | Path, folder: str | Path = "") -> None:
    """Write ``base``'s converted tensors (after ``store_linear_weights_bf16``) to ``path`` as safetensors, atomically
    (a temporary file, synced, then renamed), noting the model ``folder`` it was made from; the caller holds the
    lock.

    Raises:
        OSError, safetensors.SafetensorError: the file could not be written (the temporary file is removed).
    """
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {name: t.data.contiguous() for name, t in _tensors(base).items()}
    try:
        save_file(tensors, str(tmp), metadata={"fedspear_format": str(FORMAT), "kind": KIND, "folder": str(folder)})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())  # a crash after the rename must not leave a renamed, unwritten file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale(path: Path) -> None:
    """Remove what writers of ``path`` that are gone left behind (``.<name>.<pid>.tmp``); the caller holds the lock."""
    for left in path.parent.glob(f".{path.name}.*.tmp"):
        if left_by_a_dead_process(left):
            left.unlink(missing_ok=True)


def _remove_superseded(path: Path, folder: Path) -> list[Path]:
    """Remove the older copies of the same model ``folder`` (an earlier export, conversion or torch: another digest)
    once ``path`` replaces them; returns what was removed. A process still mapping one keeps reading it (a removed
    file lives on while mapped)."""
    from .cache import copy_source

    gone = []
    for other in path.parent.glob(f"{folder.name}-*.safetensors"):
        if other != path and copy_source(other) == str(folder):
            other.unlink(missing_ok=True)
            other.with_name(other.name + ".lock").unlink(missing_ok=True)
            gone.append(other)
    return gone


def map_copy(base, path: str | Path) -> int:
    """Point every parameter and persistent buffer of ``base`` (loaded in fp32, not yet converted) at the tensors of
    the shared copy at ``path`` (views of a private mapping of the file); returns how many tensors.

    Raises:
        ValueError: the copy does not hold exactly ``base``'s tensors with the shapes and dtypes the conversion gives
            (the model or the conversion changed); nothing of ``base`` is changed then.
        OSError, safetensors.SafetensorError: the file cannot be read (damaged or cut short).
    """
    from safetensors import safe_open

    targets = _tensors(base)
    out, inp = base.get_output_embeddings(), base.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    expected = {name: (tuple(t.shape), _converted_dtype(base, name, t)) for name, t in targets.items()}
    if tied:  # the conversion gives the tied output embedding a bf16 parameter of its own
        name = next(n for n, p in base.named_parameters(remove_duplicate=False) if p is out.weight and n not in targets)
        expected[name] = (tuple(out.weight.shape), torch.bfloat16)
    with safe_open(str(path), framework="pt") as fh:
        if (fh.metadata() or {}).get("fedspear_format") != str(FORMAT) or set(fh.keys()) != set(expected):
            raise ValueError(f"the shared weight copy {path} does not match the model (other tensors or format)")
        mapped = {name: fh.get_tensor(name) for name in expected}
    wrong = [name for name, t in mapped.items() if (tuple(t.shape), t.dtype) != expected[name]]
    if wrong:
        raise ValueError(f"the shared weight copy {path} does not match the model (e.g. {wrong[0]}: "
                         f"{tuple(mapped[wrong[0]].shape)} {mapped[wrong[0]].dtype}, expected "
                         f"{expected[wrong[0]][0]} {expected[wrong[0]][1]})")
    if tied:
        _untie_output(base)
        targets = _tensors(base)
    for name, tensor in mapped.items():
        targets[name].data = tensor
    return len(mapped)


def _converted_dtype(base, name: str, tensor: torch.Tensor) -> torch.dtype:
    """The dtype ``store_linear_weights_bf16`` gives the tensor ``name`` of ``base``: bf16 for the weights and biases
    of plain ``nn.Linear`` modules, the tensor's own otherwise."""
    module_name, _, attr = name.rpartition(".")
    module = base.get_submodule(module_name) if module_name else base
    if type(module) is torch.nn.Linear and attr in ("weight", "bias"):
        return torch.bfloat16
    return tensor.dtype


def shared_bf16_weights(base, model_dir: str | Path) -> Path | None:
    """Hold ``base``'s weights as ``store_linear_weights_bf16`` would, but as views of the shared copy of
    ``model_dir`` (written first if missing or not this model's, by the first process to get the lock); returns the
    copy's path, or None when there is none to use (a hub id; a cache that cannot be written or read: the conversion
    then runs in this process, as before, with a warning)."""
    from safetensors import SafetensorError

    from .cpu_kernels import store_linear_weights_bf16

    if not Path(model_dir).is_dir():  # a hub id: transformers' own cache, no folder of ours to name the copy by
        store_linear_weights_bf16(base)
        return None
    try:
        import fcntl

        path = copy_path(model_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a+")
    except (OSError, ImportError) as err:
        log.warning("no shared weight copy (%s): converting in this process", err)
        store_linear_weights_bf16(base)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; a second process waits for the copy
        _remove_stale(path)
        if path.exists():
            try:
                map_copy(base, path)
                return path
            except (ValueError, OSError, SafetensorError) as err:
                log.warning("%s; writing it again", err)
        store_linear_weights_bf16(base)
        folder = Path(model_dir).resolve()
        try:
            write_copy(base, path, folder)
        except (OSError, SafetensorError) as err:
            log.warning("cannot write the shared weight copy %s (%s): this process keeps its own", path, err)
            path.unlink(missing_ok=True)
            return None
        log.info("wrote the shared weight copy %s (%.2f GB)", path, path.stat().st_size / 1e9)
        _remove_superseded(path, folder)
        map_copy(base, path)  # the converted tensors in this process are dropped for the mapped ones
        return path
