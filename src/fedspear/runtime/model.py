"""Load the base model and tokenizer, wrap it with a LoRA adapter (peft), and move adapter weights in and out.

Where the weights come from is ``model_zoo`` (packaged GGUF files, exported once); the CPU speed patches
``load_base`` installs are ``cpu_kernels``; ``shared_copy`` keeps the converted CPU weights in one file that every
process maps. ``resolve_device`` / ``resolve_dtype`` decide where and in which precision everything runs.
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
    bf16_norm_outputs,
    bf16_supported,
    column_weights_pay,
    onednn_decode_pays,
    store_linear_weights_bf16,
    store_linear_weights_by_column,
    use_decode_attention,
    use_onednn_decode,
)
from .model_zoo import DEFAULT_MODEL, TINY_MODEL, ModelError, resolve_model_dir
from .shared_copy import shared_bf16_weights

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
    """Load tokenizer and base causal LM on ``device`` for computing in ``dtype`` (bf16 under autocast, see
    ``autocast``). On the CPU the weights are loaded in fp32, then the linear weights stored in bf16, the decoder
    layers' norms made to hand their linears bf16 (``bf16_norm_outputs``) and the decode attention kernel installed
    (CPU speed patches, ``cpu_kernels``; in fp32 on an Intel CPU the linear weights are held by column instead,
    ``store_linear_weights_by_column``, and on an AMD CPU decode steps' linears run through oneDNN,
    ``use_onednn_decode``); with bf16, the converted weights are views of one shared file that every
    process maps (``shared_copy``), not each process's own memory. On a CUDA GPU with
    bf16, every parameter is held in bf16 (``bf16_parameters``; buffers such as RoPE frequencies stay as they are),
    as transformers loads a model with ``dtype=torch.bfloat16``: no fp32 copy is read on each step (a decode step at
    batch 32 of Qwen2.5-1.5B: 145 ms with fp32 weights under autocast, 54 ms with bf16 weights, issue 40's probe);
    the LoRA adapter ``add_lora`` adds stays fp32 (peft's ``autocast_adapter_dtype``), trained under autocast.

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
            gpu_bf16 = where_to == "cuda" and dtype_used == "bf16"  # read straight into bf16: no fp32 copy in RAM
            base = AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16 if gpu_bf16 else torch.float32)
        except (OSError, ValueError, KeyError) as err:  # missing files; a config or tokenizer transformers cannot use
            said = " ".join(str(err).split()) or type(err).__name__  # transformers' message, on one line
            raise ModelError(f"could not load model '{model}' from {where}: {said}") from None
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        base.generation_config.pad_token_id = tokenizer.pad_token_id
    contiguous_head_input(base)
    if where_to == "cuda":
        if dtype_used == "bf16":
            bf16_parameters(base)
        return base.to(where_to), tokenizer, dtype_used
    if dtype_used == "bf16" and model != TINY_MODEL:
        shared_bf16_weights(base, where)  # one copy on disk, mapped by the server and the client actor alike
    elif dtype_used == "bf16":
        store_linear_weights_bf16(base)
    elif column_weights_pay(dtype_used):
        store_linear_weights_by_column(base)  # fp32 on an Intel CPU: faster decode-sized products
    elif onednn_decode_pays(dtype_used):
        use_onednn_decode(base)  # fp32 on an AMD CPU: decode steps' products through oneDNN instead of MKL
    if dtype_used == "bf16":
        bf16_norm_outputs(base)  # one cast per norm instead of one per linear that reads it
    use_decode_attention(base)
    return base, tokenizer, dtype_used


HEAD_HOOKED = "fedspear_contiguous_input"  # marks a head whose pre-hook is installed


def contiguous_head_input(base) -> bool:
    """Make the LM head's input contiguous before it multiplies (a forward pre-hook on ``base``'s output
    embedding, installed once); returns whether ``base`` has one. A contiguous input passes unchanged.

    Why: ``logits_to_keep = k`` (``generate``'s prefill asks for 1, the margin pass for 1, the bench's training for
    16) slices the last k positions, ``hidden[:, -k:, :]``, a ``[B, k, H]`` view whose rows are a whole sequence
    apart. ``F.linear`` hands such a non-contiguous 3-D input to ``torch.matmul``, which folds it into one
    ``[B·k, H] × [H, V]`` product only when its leading dimensions are contiguous or the weight needs a gradient
    (ATen's ``should_fold``, LinearAlgebra.cpp; torch 2.13); for a frozen head it runs ``bmm`` against the weight
    expanded to B copies, reading the whole ``[V, H]`` head once per row. On this project's Zen 4 CPU
    (``zen4-avx512bf16``), batch 32, k = 1, bmm against one product: SmolLM2's head 232 against 48 ms in fp32, 1.5 s
    against 7 ms in bf16; Qwen2.5-1.5B's 1.07 against 0.24 s in fp32, 52 s against 52 ms in bf16. The copy of
    ``[B, k, H]`` costs next to nothing. Under bf16 autocast with fp32 activations (the CPU's bf16 path) autocast's
    cast already made a contiguous copy; bf16 activations (a GPU) and fp32 ones (``dtype = fp32``) were left to
    ``bmm``.
    """
    head = base.get_output_embeddings()
    if head is None:
        return False
    if not getattr(head, HEAD_HOOKED, False):
        head.register_forward_pre_hook(_contiguous_input)
        setattr(head, HEAD_HOOKED, True)
    return True


def _contiguous_input(module, args):
    if not args:  # called with keywords only: left as it is
        return None
    return (args[0].contiguous(), *args[1:])


def bf16_parameters(base) -> int:
    """Hold every floating-point parameter of ``base`` in bf16, in place (buffers, such as RoPE's inverse
    frequencies, keep their dtype, as in a model transformers loads with ``dtype=torch.bfloat16``); returns how many
    parameters were converted. A tied output embedding stays tied (one tensor). Call before ``add_lora``: peft then
    makes the adapter's A/B matrices fp32 (``get_peft_model``'s ``autocast_adapter_dtype``)."""
    converted = 0
    for param in base.parameters():
        if param.is_floating_point() and param.dtype != torch.bfloat16:
            param.data = param.data.to(torch.bfloat16)
            converted += 1
    return converted


CHECKPOINTING_ABOVE = 1_000_000_000  # parameters; on the CPU, "auto" turns gradient checkpointing on above this
ACTIVATION_SHARE = 0.7  # on a GPU, "auto" checkpoints when the activations estimate exceeds this share of its memory
TRAIN_PROMPT_TOKENS = 512  # a bound on a task prompt (chat template included) for the activations estimate


def training_activation_bytes(config, rows: int, length: int, window: int) -> float:
    """Estimated bytes a LoRA training forward keeps for the backward without gradient checkpointing, for ``rows``
    sequences of ``length`` tokens with logits over the last ``window`` (+1) positions (``training.pack``), bf16
    weights under bf16 autocast and LoRA on the seven projections of every layer.

    Per token and layer, in bytes (h hidden size, kv the key/value width ``num_key_value_heads · head_dim``, i the
    MLP width), counting what autograd saves: the two RMSNorms 8h each (fp32 input, bf16 normalised copy and output);
    the q/k/v input 2h; attention's q, k, v and output 2·(2h + 2kv); o_proj's input 2h; gate/up's input 2h; the
    MLP's gate, up and SiLU outputs 6i and down's input 2i; and LoRA 3d per projection of input width d (the dropout
    mask, 1 byte, and the bf16 input of ``lora_A``): 3·(5h + h + i) for q, k, v, gate, up, o and down. Sum:
    44h + 4kv + 11i. The logits of the window add 10 bytes per vocabulary entry (bf16 logits, fp32 log-softmax
    input and output). Qwen2.5-1.5B (h 1536, kv 256, i 8960, 28 layers): 167,168 B per token per layer, 4.68 MB per
    token; a paper-preset micro-step (32 rows of 768 tokens, window 256) ≈ 115 GB + 12.5 GB of logits, so it is
    checkpointed on an 80 GB GPU, while the bench's 8 × 220 tokens, window 16 (8.4 GB) is not.
    """
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token_layer = 44 * h + 4 * kv * head_dim + 11 * i
    return rows * length * layers * per_token_layer + rows * (window + 1) * config.vocab_size * 10


def needs_checkpointing(parameters: int, device_type: str, activation_bytes: float = 0.0,
                        memory_bytes: float = 0.0) -> bool:
    """``gradient_checkpointing = "auto"``'s decision: on a CUDA GPU, when the training activations
    (``training_activation_bytes``) exceed ``ACTIVATION_SHARE`` of ``memory_bytes``, the GPU memory this process
    may use once the model is loaded (``gpu_memory_for_training``; the rest is margin for the KV caches, the
    allocator and the estimate's error); elsewhere (the CPU, whose memory is the machine's RAM and whose time
    matters more) when the model has more than ``CHECKPOINTING_ABOVE`` parameters (Qwen2.5-1.5B in bf16 training
    peaks near 20 GB without it and about 11 GB with it).
    """
    if device_type == "cuda":
        return activation_bytes > ACTIVATION_SHARE * memory_bytes
    return parameters > CHECKPOINTING_ABOVE


def gpu_memory_for_training(device: torch.device, share: float = 1.0) -> float:
    """Bytes of GPU memory left for training on ``device``: the free memory (``torch.cuda.mem_get_info``), and at
    most ``share`` of the card less what this process already holds (several simulated clients on one GPU each get
    their share, ``client_gpus``)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, min(free, share * total - torch.cuda.memory_reserved(device)))


def use_gradient_checkpointing(model, setting: str = "auto", *, rows: int = 8,
                               length: int = TRAIN_PROMPT_TOKENS + 256, window: int = 256,
                               gpu_share: float = 1.0) -> bool:
    """Turn gradient checkpointing on for ``model`` when ``setting`` is ``"on"``, or ``"auto"`` and
    ``needs_checkpointing`` says so for a training micro-step of ``rows`` sequences of ``length`` tokens and a
    logits ``window`` (``Worker.load`` passes the run's: 2 · ``batch_size`` rows, prompt bound + ``max_new_tokens``).
    On a GPU the decision reads its free memory, so call it with the model on its device. Non-reentrant
    checkpointing, so the frozen inputs need no ``requires_grad``.

    Returns:
        Whether checkpointing is on.
    Raises:
        ValueError: ``setting`` is not auto, on or off.
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"gradient_checkpointing must be auto, on or off (got {setting!r})")
    on = setting == "on"
    if setting == "auto":
        device = model_device(model)
        gpu = device.type == "cuda"
        on = needs_checkpointing(
            sum(p.numel() for p in model.parameters()), device.type,
            training_activation_bytes(model.config, rows, length, window) if gpu else 0.0,
            gpu_memory_for_training(device, gpu_share) if gpu else 0.0)
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return on


def add_lora(base, settings: LoraSettings, seed: int = 0):
    """Wrap ``base`` with a fresh LoRA adapter on q,k,v,o,gate,up,down projections (peft).

    ``seed`` fixes the adapter's initialisation (A random, B zero, so the initial adapter is the identity). On the
    CPU the adapter's dropout is ``cpu_kernels.FastDropout`` (its masks cost a third of ``nn.Dropout``'s there); on
    any other device peft's ``nn.Dropout``, which a GPU runs as one fused kernel where ``FastDropout`` takes four.

    Over bf16 base weights (a GPU's ``bf16_parameters``, the CPU's bf16 linear weights) every forward runs under bf16
    autocast (``autocast``), and the adapter's input is left in its dtype (``bf16_lora_inputs``): peft would cast it
    to the fp32 adapter's dtype, only for autocast to cast it back to bf16 for ``lora_A``. Each adapted projection
    adds its update in its ``lora_B`` product (``fuse_lora_sums``); both by ``ready_lora_layers``.
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
    ready_lora_layers(model)
    if model_device(base).type != "cpu":  # a GPU's nn.Dropout is one fused kernel: FastDropout would add passes
        return model
    for module in model.modules():  # peft's nn.Dropout → FastDropout: p to 2⁻¹⁷, masks ≈ 3× cheaper on CPU
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for key, drop in drops.items():
                if isinstance(drop, torch.nn.Dropout):
                    drops[key] = FastDropout(drop.p)
    return model


def ready_lora_layers(model) -> None:
    """What every LoRA model fedspear builds or loads gets (``add_lora``, the chat's adapter loading): over bf16
    weights the adapter takes its input as it comes (``bf16_lora_inputs``), and each adapted projection adds its
    update in its ``lora_B`` product (``lora_sum.fuse_lora_sums``)."""
    from .lora_sum import fuse_lora_sums

    bf16_lora_inputs(model)
    fuse_lora_sums(model)


def bf16_lora_inputs(model) -> int:
    """Let ``model``'s LoRA layers over bf16 base weights take their input as it comes (peft's
    ``cast_input_dtype_enabled = False``, the switch ``peft.helpers.disable_input_dtype_casting`` sets); returns how
    many layers. Layers over fp32 weights are left as peft made them.

    peft's ``lora.Linear.forward`` casts its input to the adapter's dtype before the dropout and ``lora_A``
    (``BaseTunerLayer._cast_input_dtype``). With bf16 activations (every parameter bf16 on a GPU) and an fp32 adapter
    that is a ``[tokens, in_features]`` fp32 copy per adapted projection — seven per layer — which the dropout then
    runs over in fp32 and bf16 autocast casts straight back to bf16 for the ``lora_A`` product, and as many casts
    again in the backward. bf16 → fp32 → bf16 is exact, so without it ``lora_A`` multiplies the same values: the same
    outputs, and the same gradients for the same dropout mask (``tests/test_gpu_settings.py``; the dropout scales
    its kept elements in the input's dtype). On a GPU, torch's fused dropout assigns its random numbers to elements
    by the input's dtype (up to 8 bf16 or 4 fp32 values per thread: ``get_vector_size``,
    aten/src/ATen/native/cuda/Dropout.cu), so for a given seed a GPU's masks differ from those drawn before this
    change: the same distribution, not the same draws. ``FastDropout`` (the CPU's) draws by element count, whatever
    the dtype.

    The catch: the adapter's fp32 matrices then multiply a bf16 input, which only autocast allows — over bf16
    weights a forward outside bf16 autocast raises (mismatched dtypes). Every forward of fedspear runs under it
    (``autocast``), and on the CPU the bf16 base layers could not take its fp32 activations without it either.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)
              and getattr(m.get_base_layer(), "weight", None) is not None
              and m.get_base_layer().weight.dtype == torch.bfloat16]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


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


TINY_LAYERS = 2  # decoder layers of the tiny test model


def model_layers(model: str) -> int | None:
    """Decoder layers of ``model`` (a packaged name, local folder, hub id or the tiny test model), read from its
    ``config.json`` without loading the weights; None where that config cannot be read here (a hub id not in the
    cache: loading the model reports why)."""
    from transformers import AutoConfig

    if model == TINY_MODEL:
        return TINY_LAYERS
    try:
        return AutoConfig.from_pretrained(resolve_model_dir(model)).num_hidden_layers
    except Exception:  # noqa: BLE001 - whatever keeps the config from being read here, the load reports it
        return None


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
        num_hidden_layers=TINY_LAYERS,
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
