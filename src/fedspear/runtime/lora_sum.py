"""peft's LoRA linear layer with its update added inside the ``lora_B`` product (``FusedSumLinear``), installed by
``runtime.model.add_lora`` and the chat's adapter loading. Imported only where a LoRA model is built (it imports peft).
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import VARIANT_KWARG_KEYS, Linear

from .cpu_kernels import FastDropout


class FusedSumLinear(Linear):
    """peft's ``lora.Linear`` whose adapter update is added inside the ``lora_B`` product: ``result + (s·h) Bᵀ`` as one
    ``linear(s·h, B, bias=result)``, which is ``addmm`` (h = ``lora_A(dropout(x))``, ``[tokens, r]``; s = α / r),
    instead of peft's ``result + lora_B(h) * s``, which writes the ``[tokens, out_features]`` update, scales it and
    adds it in three passes over the output. Forward and backward alike: the backward no longer scales the
    ``[tokens, out_features]`` gradient element by element either (s scales the ``[tokens, r]`` product). The CPU's
    dropout (``cpu_kernels.FastDropout``) only zeroes the dropped inputs here, and its ``1 / (1 − p)`` joins s on the
    ``[tokens, r]`` product too: one pass fewer over the ``[tokens, in_features]`` input forward and over its
    gradient backward, with the same masks (in bf16 the product then rounds differently). B is the argument bf16
    autocast casts, so its bf16 copy is cached for an autocast block (a generate call) as for peft's ``lora_B(h)``; a
    cast of ``Bᵀ``, a view, would be made at every call (decode 12% slower at batch 8).

    The value is the same sum: in fp32 equal within rounding; in bf16 the update is
    rounded once, inside the sum, where peft rounds the product and then the sum (as close to an fp32 forward,
    ``tests/test_lora_sum.py``; greedy ARC answers and log-likelihood picks agree with fp32 on as many items). Dropout
    draws are those of peft's order (base layer, then the dropout). Any other case — the adapter disabled or merged,
    several adapters active, ``adapter_names``, a LoRA variant (DoRA, …), a ``lora_B`` bias, variant arguments —
    runs peft's own forward.

    Measured (SmolLM2-135M, bf16, `intel-f6m167-avx512bf16`, alternating, docs/performance.md): central evaluation of
    64 ARC items 11.9 → 9.9 s, prefill of 16 × 200 tokens 1.54 → 1.34 s, a training step of 8 × 220 tokens 3.80 →
    3.71 s, decode at batch 8 / 32 even; the reference client-round: no change beyond the machine's noise.
    Upstream: ``peft/tuners/lora/layer.py``, ``Linear.forward`` (peft 0.21).
    """

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = self.active_adapters
        name = active[0] if len(active) == 1 else None
        if (name is None or self.disable_adapters or self.merged or name not in self.lora_A
                or name in self.lora_variant or self.lora_B[name].bias is not None
                or kwargs.get("adapter_names") is not None or any(k in kwargs for k in VARIANT_KWARG_KEYS)):
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        result = self.base_layer(x, *args, **kwargs)  # [..., out_features]
        lora_a = self.lora_A[name]
        dropout = self.lora_dropout[name]
        x = self._cast_input_dtype(x, lora_a.weight.dtype)
        if isinstance(dropout, FastDropout):  # the CPU's: its 1 / (1 − p) scales the [tokens, r] product instead of x
            x, kept_scale = dropout.zero_dropped(x)
        else:
            x, kept_scale = dropout(x), 1.0
        h = lora_a(x)  # [..., r]
        h = h.reshape(-1, h.shape[-1])  # [tokens, r]
        scaling = self.scaling[name] * kept_scale
        if scaling != 1:
            h = h * scaling
        # linear with a [tokens, out] bias is addmm(bias, h, Bᵀ); B itself is the argument autocast casts, so its
        # bf16 copy is cached for the autocast block as for peft's lora_B(h) (a cast of Bᵀ would be made per call)
        out = torch.nn.functional.linear(h, self.lora_B[name].weight, result.reshape(-1, result.shape[-1]))
        return out.view(result.shape).to(result.dtype)


def fuse_lora_sums(model) -> int:
    """Make every peft ``lora.Linear`` of ``model`` a :class:`FusedSumLinear` (its class swapped in place: the same
    module, parameters and state dict); returns how many. Subclasses of ``lora.Linear`` (quantised layers, …) are
    left as they are."""
    layers = [m for m in model.modules() if type(m) is Linear]
    for layer in layers:
        layer.__class__ = FusedSumLinear
    return len(layers)
