"""CPU speed patches for transformers models: the decode attention kernel, bf16 linear weights, bf16 norm outputs
and a cheaper LoRA dropout (docs/performance.md measures each). None changes what the model computes beyond rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import torch


def bf16_supported() -> bool:
    """True when this CPU has native bf16 matrix instructions (AVX-512 BF16 or AMX), where bf16 autocast pays."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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


def preallocated_cache(model, capacity: int):
    """A transformers ``DynamicCache`` for ``model`` whose layers are ``PreallocatedLayer`` layers growing up to
    ``capacity`` positions (prompt + new tokens) without a copy per step, or None when the model's cache has other
    layer kinds (sliding windows, shared layers): pass it as ``generate``'s ``past_key_values``."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [preallocated_layer_class()(capacity) for _ in cache.layers]
    return cache


@functools.cache
def preallocated_layer_class():
    """The :class:`PreallocatedLayer` class (defined on first use: transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """transformers' ``DynamicLayer`` with its keys and values kept in buffers with room to grow: a decode step
        writes its token in place instead of concatenating a copy of the whole cache (``torch.cat`` per layer per
        step: ≈ 20% of an fp32 SmolLM2 decode step at batch 32, docs/performance.md). ``keys``/``values`` are views
        ``[B, KV, L, D]`` of buffers ``[B, KV, room, D]``, so attention reads the same values. A buffer holds
        what is cached plus ``max(GROW, a quarter)`` positions, up to ``capacity`` (prompt + token budget) — not the
        whole budget at once, which an evaluation with a long budget and short answers would never fill — and is
        replaced by a larger one when full (a copy every few dozen steps instead of every step); a cache repeated,
        cropped or reordered by transformers (new tensors) is copied into fresh buffers at the next update."""

        GROW = 64  # positions added at least when a buffer is (re)allocated

        def __init__(self, capacity: int = 0, **kwargs):
            super().__init__(**kwargs)
            self.capacity = capacity
            self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

        def _holds(self, keys: torch.Tensor) -> bool:
            buf = self._buffers[0] if self._buffers is not None else None
            return (buf is not None and keys.dim() == 4 and keys.data_ptr() == buf.data_ptr()
                    and keys.shape[:2] == buf.shape[:2] and keys.dtype == buf.dtype)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            total = held + key_states.shape[-2]
            if not self._holds(self.keys) or total > self._buffers[0].shape[-2]:
                room = total + max(self.GROW, total // 4)
                if total <= self.capacity:
                    room = min(room, self.capacity)
                fresh = []
                for old, new in ((self.keys, key_states), (self.values, value_states)):
                    batch, heads, _, dim = new.shape
                    buf = torch.empty(batch, heads, room, dim, dtype=new.dtype, device=new.device)
                    if held:
                        buf[:, :, :held] = old
                    fresh.append(buf)
                self._buffers = (fresh[0], fresh[1])
            keys, values = self._buffers
            keys[:, :, held:total] = key_states
            values[:, :, held:total] = value_states
            self.keys, self.values = keys[:, :, :total], values[:, :, :total]
            return self.keys, self.values

        def reset(self) -> None:
            self._buffers = None
            super().reset()

    return PreallocatedLayer


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


def cpu_vendor() -> str | None:
    """``vendor_id`` of this machine's first processor in ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``), or
    None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def column_weights_pay(dtype_used: str, device_type: str = "cpu") -> bool:
    """Whether ``load_base`` stores the linear weights by column (:func:`store_linear_weights_by_column`):
    fp32 on an Intel CPU, the kind where it was measured to pay (docs/performance.md, "What was changed").

    On a 2-core Intel Xeon (family 6, model 106; MKL 2024.2, torch 2.13) ``F.linear`` with an fp32 weight held as
    PyTorch stores it (``[out, in]``, row by row) runs 1.2–2.8× slower at 8–32 input rows — a decode step's —
    than with the same weight held by column; at prefill and training sizes (64–1,200 rows, forward and backward)
    the row layout took 0.83–1.19× the column layout's time. On an AMD EPYC Zen 4 (``zen4-avx512bf16``, 2026-12-07;
    SmolLM2-135M in fp32, the two layouts alternating in one process, 6 pairs) it did not pay: decode steps at batch
    8 ran at 0.93× the tokens/s by column, at batch 32 at 1.07×, prefill and training at 1.02×, so AMD CPUs keep
    PyTorch's layout (their decode steps go through oneDNN instead, :func:`onednn_decode_pays`); bf16 weights go
    through oneDNN's kernels and keep it too.
    """
    return device_type == "cpu" and dtype_used == "fp32" and cpu_vendor() == "GenuineIntel"


def store_linear_weights_by_column(base) -> int:
    """Hold every ``nn.Linear`` weight of ``base`` by column, in place (before ``add_lora``: those are the weights
    LoRA freezes); returns how many weights were moved.

    A weight keeps its shape ``[out, in]`` and its values; its storage becomes that of its transpose (strides
    ``(1, out)``: ``weight.t()`` is contiguous), so ``F.linear(x, weight)``'s matrix product reads the weight in the
    order of an ``[in, out]`` matrix. On the Intel CPU measured, a SmolLM2-135M decode step in fp32 with the
    adapter merged went from 145–220 to 88–120 ms at batch 16 (docs/performance.md); the logits of a 1,920-token
    forward were bitwise equal there, and greedy answers, logits and LoRA gradients are tested equal (to fp32
    rounding). A tied output
    embedding stays tied: the embedding then gathers its rows from the transposed storage. Clones made by
    ``torch.clone`` keep the layout (``preserve_format``), so peft's merged copy of a weight
    (``model.merged_adapter``) is held by column too. A weight read from the checkpoint's file mapping has its pages
    paged out once copied (``memory.page_out``, as ``store_linear_weights_bf16`` does). Call before ``add_lora``.
    """
    from fedspear.runtime.memory import file_mappings, page_out

    mappings = file_mappings()
    done = 0
    seen: set[int] = set()
    for module in base.modules():
        weight = module.weight if isinstance(module, torch.nn.Linear) else None
        if weight is None or id(weight) in seen or weight.t().is_contiguous():
            continue
        seen.add(id(weight))
        mapped = weight.data
        weight.data = mapped.t().contiguous().t()
        page_out(mapped, mappings)
        done += 1
    return done


def store_linear_weights_bf16(base) -> int:
    """Store the frozen ``nn.Linear`` weights and biases of ``base`` in bf16, in place; returns how many linears.

    Under bf16 autocast every linear casts its fp32 weight to bf16 (round to nearest even) on every call, and backward
    uses that cast copy; storing the cast once gives the same values, so outputs and LoRA gradients are bitwise those
    of autocast over fp32 weights — for half the weight memory and no cast per call (per decode step it is a full
    pass over the weights). Embeddings, norms and every other non-matmul op keep fp32, as under autocast; a tied
    output embedding (SmolLM2, Qwen2.5-1.5B) gets its own bf16 copy so the input embedding stays fp32. Call before
    ``add_lora``: the adapter's A/B matrices stay fp32. Only meaningful with ``autocast("bf16")``.

    The fp32 tensors left (embeddings, norms) are copied out of the checkpoint file, which transformers maps into
    memory (its tensors are views of the mapping): once no tensor refers to it the mapping is released, and with it
    the file pages the bf16 conversion read — resident memory counted against the process (SmolLM2-135M: ≈ 0.6 GB,
    Qwen2.5-Coder-1.5B exported in fp32: ≈ 6 GB; issue 19 item 3). Until then each converted tensor's file pages are
    paged out as soon as it is converted (``memory.page_out``), so the peak while loading is the bf16 model
    plus one fp32 tensor, not plus the whole file.
    """
    from fedspear.runtime.memory import file_mappings, page_out

    mappings = file_mappings()  # the checkpoint's mapping stays while its tensors are converted
    out = base.get_output_embeddings()
    inp = base.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = torch.nn.Parameter(inp.weight.detach().to(torch.bfloat16), requires_grad=False)
    linears = [module for module in base.modules() if type(module) is torch.nn.Linear]
    in_linears = {id(t) for module in linears for t in (module.weight, module.bias) if t is not None}
    for tensor in [*base.parameters(), *base.buffers()]:
        if id(tensor) not in in_linears and tensor.dtype != torch.bfloat16:
            mapped = tensor.data
            tensor.data = mapped.clone()
            page_out(mapped, mappings)
    for module in linears:
        for tensor in (module.weight, module.bias):
            if tensor is not None and tensor.dtype != torch.bfloat16:
                mapped = tensor.data
                tensor.data = mapped.to(torch.bfloat16)
                page_out(mapped, mappings)
    return len(linears)


NORM_HOOKED = "fedspear_bf16_output"  # marks a norm whose output hook is installed
BF16_NORM_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # decoder layers whose two norms feed linears only


def bf16_norm_outputs(base) -> int:
    """Under bf16 autocast, let each decoder layer's ``input_layernorm`` and ``post_attention_layernorm`` return its
    output in bf16 (a forward hook on each, installed once); returns how many norms carry it. Only for the model
    types in ``BF16_NORM_MODEL_TYPES``, whose decoder layers feed those norms' outputs to nothing but the q, k, v and
    the gate, up projections (transformers' ``LlamaDecoderLayer.forward`` and its copies); 0 for any other. Call on
    the CPU's bf16 path (``load_base``), where norms and the residual stream stay fp32.

    Why: every linear under bf16 autocast casts its fp32 input to bf16. A norm's output feeds three projections
    (q, k, v) or two (gate, up), and with a LoRA adapter their ``lora_A`` products too: up to six casts of the same
    ``[tokens, hidden]`` tensor, and in training the adapter's dropout masks it in fp32 first. Cast once, in the
    hook, those linears multiply the same bf16 values, so the forward is bitwise the same (logits, greedy answers,
    log-likelihoods: ``tests/test_cpu_kernels.py``) and the dropout runs over half the bytes. The backward changes
    by rounding only: the projections' input gradients are summed in bf16 (as on a GPU, where the whole model is
    bf16) before one cast back to fp32, where autocast summed their fp32 casts. Outside bf16 autocast (fp32
    weights) the hook passes the output as it is.

    Measured on ``intel-f6m167-avx512bf16`` together with ``FastDropout.zero_dropped`` (SmolLM2-135M, bf16, in one
    process, alternating; docs/performance.md): training 1.085× the tokens/s (8 × 220 tokens), prefill 1.06×, decode
    1.00× (batch 8) and 1.04× (32); the reference client-round 20.6 → 19.2 s (0.93×).
    """
    if getattr(getattr(base, "config", None), "model_type", None) not in BF16_NORM_MODEL_TYPES:
        return 0
    done = 0
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm"):
            if not getattr(module, NORM_HOOKED, False):
                module.register_forward_hook(_bf16_output)
                setattr(module, NORM_HOOKED, True)
            done += 1
    return done


def _bf16_output(module, args, output):
    """``bf16_norm_outputs``' forward hook: a bf16 copy of an fp32 ``output`` under bf16 autocast, else None (the
    output as it is)."""
    if (output.dtype == torch.float32 and torch.is_autocast_enabled(output.device.type)
            and torch.get_autocast_dtype(output.device.type) == torch.bfloat16):
        return output.to(torch.bfloat16)
    return None


ONEDNN_DECODE = True  # fp32 decode steps' linears through oneDNN on AMD CPUs (onednn_decode_pays); False: never


def onednn_decode_pays(dtype_used: str, device_type: str = "cpu") -> bool:
    """Whether ``load_base`` routes decode steps' linears through oneDNN (:func:`use_onednn_decode`): fp32 on an AMD
    CPU, the kind where it was measured to pay, when this torch has oneDNN's linear (``torch.ops.mkldnn``).

    On a 2-core AMD EPYC Zen 4 (``zen4-avx512bf16``; torch 2.13, MKL and oneDNN 3.12 as its CPU wheel ships them), an
    fp32 ``F.linear`` of 8 rows — a decode step at batch 8 — ran through MKL at 6–13 GB/s of weights read, against
    the machine's 35 GB/s: 1,536 × 576 in 338–495 µs, SmolLM2's 49,152-row LM head in 17.9 ms; oneDNN's linear took
    285 µs and 7.8 ms for the same weights, unpacked (docs/performance.md); decode 1.375× / 1.24× the tokens/s at
    batch 8 / 32, and 1.18× / 1.21× with every library capped to AVX2 (``scripts/onednn_decode_ab.py`` under
    ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``: the fp32-only AMD kind's
    instruction set, emulated). bf16 linears already run on oneDNN;
    Intel CPUs hold fp32 weights by column instead (:func:`column_weights_pay`), where MKL is the fast one.
    """
    return (ONEDNN_DECODE and device_type == "cpu" and dtype_used == "fp32" and cpu_vendor() == "AuthenticAMD"
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_DECODING = contextvars.ContextVar("fedspear_decoding", default=False)  # set by ``decoding()``


@contextlib.contextmanager
def decoding():
    """Within the block (this thread or task), :class:`DecodeLinear` layers multiply inputs of one position per row
    through oneDNN: ``generation.generate`` and the bench's decode timing wrap their ``generate`` calls in it, so
    decode steps (and the prefill's last-position logits) take the path and nothing outside generation does."""
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


class DecodeLinear(torch.nn.Linear):
    """``nn.Linear`` whose decode steps multiply through oneDNN: inside :func:`decoding` (generation), an fp32 CPU
    input of one position per row (``[B, 1, in]``) without autograd goes to ``torch.ops.mkldnn._linear_pointwise``
    (the weight as it is, unpacked); everything else — prefill, training, log-probabilities and the margin pass
    (outside generation, even where they run one position per row), bf16, a compiled graph — to
    ``nn.Linear.forward``.

    The same product in another summation order: equal to fp32 rounding (a few units in the last place), not bitwise.
    What sees it: the tokens generation picks and the first-step logits it hands out (``first_logits``: evaluation's
    log-likelihood scoring); greedy answers to 32 ARC prompts with SmolLM2 were the same (docs/performance.md), and
    the tiny model's are tested. No training log-probability or gradient does: GRPO's and RLTF-SD's old and reference
    log-probabilities are computed outside generation, the same way as the live forward they are compared with.
    Shapes: ``[B, 1, in]`` → ``[B, 1, out]``. Upstream: ``aten/src/ATen/native/mkldnn/Linear.cpp``
    (``mkldnn_linear_pointwise``, torch 2.13), what inductor's CPU backend calls for linears.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (not torch.compiler.is_compiling() and _DECODING.get() and input.dim() == 3 and input.shape[1] == 1
                and input.dtype == torch.float32 and self.weight.dtype == torch.float32
                and input.device.type == "cpu" and not torch.is_grad_enabled()):
            return torch.ops.mkldnn._linear_pointwise(input.contiguous(), self.weight, self.bias, "none", [], "")
        return super().forward(input)


def use_onednn_decode(base) -> int:
    """Make every ``nn.Linear`` of ``base`` a :class:`DecodeLinear` (its class swapped in place: the same module,
    parameters and state dict); returns how many. Call before ``add_lora`` (the LoRA layers then wrap them)."""
    layers = [m for m in base.modules() if type(m) is torch.nn.Linear]
    for layer in layers:
        layer.__class__ = DecodeLinear
    return len(layers)


class FastDropout(torch.nn.Module):
    """Inverted dropout for LoRA inputs whose keep-mask is cut from 64-bit random words instead of ``bernoulli_``.

    Each element gets a uniform 16-bit draw (four per ``int64`` word from ``torch.Tensor.random_``, the full 64-bit
    range) and is zeroed when the draw falls below ``cut = round(p · 2¹⁶)``: the drop probability is
    ``p_eff = cut / 2¹⁶`` (|p_eff − p| ≤ 2⁻¹⁷, e.g. 0.1000061 for 0.1), and kept elements are scaled by
    ``1 / (1 − p_eff)`` so the expectation is exactly the input, as with ``nn.Dropout``. peft draws one mask per adapted
    projection (210 for SmolLM2-135M); on this project's CPU that costs 4.3 ns per element with ``bernoulli_`` and
    1.3 ns here (docs/performance.md); the mask is applied by ``zero_where_dropped`` (an integer product on the
    values' bits, 2–3× faster than ``masked_fill`` each way, bit for bit the same). Draws come from torch's default
    generator, so ``torch.manual_seed`` and gradient checkpointing's RNG replay apply. Traced by torch.compile
    (``runtime.compiled_training``) it is ``torch.nn.functional.dropout`` at ``p_eff``: ``random_`` would break the
    graph, and a compiled graph fuses its own masks.

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
        if torch.compiler.is_compiling():  # Tensor.random_ breaks a compiled graph (runtime.compiled_training)
            return torch.nn.functional.dropout(x, self.p_eff, training=True)
        return zero_where_dropped(x * self.scale, self._kept(x))

    def zero_dropped(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The dropout without its scaling: ``(x with the dropped elements zeroed, factor)``, where ``factor · zeroed``
        is ``forward(x)`` (the same draws from the same generator state). For a caller that multiplies the result by
        a matrix and can scale the smaller product instead (``runtime.lora_sum``: the ``[tokens, r]`` one), which
        saves a pass over ``x`` forward and one over its gradient backward. ``(x, 1.0)`` where ``forward`` would
        return ``x``; while compiling, ``(forward(x), 1.0)``."""
        if not self.training or self.cut == 0:
            return x, 1.0
        if torch.compiler.is_compiling():
            return torch.nn.functional.dropout(x, self.p_eff, training=True), 1.0
        return zero_where_dropped(x, self._kept(x)), self.scale

    def _kept(self, x: torch.Tensor) -> torch.Tensor:
        """Where ``x``'s elements are kept: a bool tensor of ``x``'s shape, from fresh draws."""
        n = x.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        draws = words.view(torch.int16)[:n].view(x.shape)  # uniform on −2¹⁵ … 2¹⁵ − 1
        return draws >= self.cut - 2 ** (self.BITS - 1)

    def extra_repr(self) -> str:
        return f"p={self.p}"


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size in bytes → integer dtype


class _ZeroWhereDropped(torch.autograd.Function):
    """``x`` with its dropped elements set to +0, forward and backward by an integer product on the values' bits
    (``zero_where_dropped``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(kept)
        return _times_kept(x, kept)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (kept,) = ctx.saved_tensors
        return _times_kept(grad, kept), None


def _times_kept(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The bits of ``x`` times the 0/1 ``kept`` as integers of ``x``'s width: each element's bits or all zero bits."""
    as_int = _SAME_WIDTH_INT[x.element_size()]
    return (x.view(as_int) * kept).view(x.dtype)


def zero_where_dropped(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``x.masked_fill(~kept, 0)`` bit for bit, forward and backward (the gradient is zeroed where dropped), for
    floating ``x`` of 2, 4 or 8 bytes per element: each value's bits multiplied as an integer by the bool ``kept``
    (same shape) instead. On the CPU that is 2–3× faster than ``masked_fill`` each way (bf16 and fp32, 1,760 × 576
    elements; ``masked_fill``'s bf16 backward is slower still), and it keeps what the backward needs as
    ``masked_fill`` does: the 1-byte mask. Kept elements pass unchanged (NaN, ±inf, −0 included), dropped ones are
    +0. Any other element size falls back to ``masked_fill``.

    Measured (SmolLM2-135M, bf16, a training step of 8 × 220 tokens, docs/performance.md): 1.06× the tokens/s of
    ``masked_fill`` on ``intel-f6m167-avx512bf16`` (fp32: 1.035×), 1.064× on ``zen4-avx512bf16``.
    """
    if x.element_size() not in _SAME_WIDTH_INT:
        return x.masked_fill(~kept, 0)
    return _ZeroWhereDropped.apply(x, kept)
