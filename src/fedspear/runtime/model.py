"""Load the base model and tokenizer, wrap it with a LoRA adapter (peft), and move adapter weights in and out.

Where the weights come from is ``model_zoo`` (packaged GGUF files, exported once); the CPU speed patches
``load_base`` installs are ``cpu_kernels``. ``resolve_device`` / ``resolve_dtype`` decide where and in
which precision everything runs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..arrays import layout_mismatch
from .cpu_kernels import (
    FastDropout,
    bf16_supported,
    store_linear_weights_bf16,
    use_decode_attention,
)
from .model_zoo import DEFAULT_MODEL, TINY_MODEL, ModelError, resolve_model_dir

log = logging.getLogger(__name__)

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    current = get_peft_model_state_dict(model)
    problem = layout_mismatch(current, arrays)
    if problem:
        raise ValueError(f"adapter does not match the model's LoRA layout: {problem}")
    state = {name: torch.tensor(np.asarray(arrays[name]), dtype=ref.dtype, device=ref.device)
             for name, ref in current.items()}
    set_peft_model_state_dict(model, state)


@contextmanager
def merged_adapter(model, enabled: bool = True):
    """Within the block, ``model``'s LoRA adapter is merged into its base weights (fewer, larger ops per step:
    SmolLM2 has 210 adapted projections whose LoRA branch is 5–6 small ops each); after it, the base weights are the
    very tensors they were before (bitwise) and the adapter is applied unmerged again.

    peft's ``merge_adapter(safe_merge=True)`` writes W + s·B·A into a *new* tensor per projection; the originals are
    kept by reference and put back, so nothing drifts (peft's ``unmerge_adapter`` alone subtracts s·B·A again, which
    rounds). Costs one copy of the adapted projections' weights while the block runs. The merged weight has the base
    weight's dtype: in fp32 it differs from the unmerged sum by rounding only; bf16 weights would round the update to
    bf16 (quantise it), so callers merge for fp32 models only (``generation.generate``). A model without a
    LoRA adapter, a model in training mode or ``enabled=False`` runs unchanged.

    Raises:
        ValueError: peft's check found a non-finite merged weight (a broken adapter); nothing is changed then.
    """
    layers = [] if not enabled or model.training or not hasattr(model, "merge_adapter") else [
        m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    if not layers:
        yield model
        return
    originals = [(m.get_base_layer(), m.get_base_layer().weight.data) for m in layers]
    try:
        model.merge_adapter(safe_merge=True)
        yield model
    finally:
        if any(m.merged for m in layers):
            model.unmerge_adapter()
        for base_layer, weight in originals:
            base_layer.weight.data = weight


def pad_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else its EOS (``load_base`` sets one; a bare tokenizer may
    not)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


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
