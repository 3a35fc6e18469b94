"""Each adapted projection adds its LoRA update inside the ``lora_B`` product (``runtime.lora_sum.FusedSumLinear``):
the values and gradients of peft's ``result + lora_B(h) · s`` (fp32: equal within rounding; bf16: as close to an
fp32 forward as peft's), in fewer passes, with peft's own forward wherever the adapter is off, merged or mixed."""

from __future__ import annotations

import copy
import pickle

import torch
from helpers import OpCounts
from peft.tuners.lora.layer import Linear as PeftLinear

from fedspear.runtime.lora_sum import FusedSumLinear, fuse_lora_sums
from fedspear.runtime.model import LoraSettings, add_lora, autocast, bf16_parameters, merged_adapter, tiny_model

IDS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def _lora_model(bf16: bool = False, dropout: float = 0.1):
    base, _ = tiny_model(seed=0)
    if bf16:
        bf16_parameters(base)
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=dropout), seed=0)
    for name, p in model.named_parameters():  # B = 0 would make every update zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def _set_class(model, cls) -> None:
    for m in model.modules():
        if isinstance(m, PeftLinear):
            m.__class__ = cls


def _run(model, dtype: str, seed: int = 1):
    """(eval logits, training loss, the adapter's gradients) for ``IDS``; the dropout's masks from ``seed``."""
    model.eval()
    with torch.no_grad(), autocast(dtype, "cpu"):
        logits = model(input_ids=IDS).logits.float()
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with autocast(dtype, "cpu"):
        loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    return logits, loss.detach().float(), grads


def test_add_lora_makes_every_adapted_projection_a_fused_sum_with_peft_state():
    """2 layers × 7 projections become ``FusedSumLinear`` (a second call finds none left), the state dict's keys are
    peft's, and the model deep-copies and pickles (the class is importable)."""
    model = _lora_model()
    layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert len(layers) == 14 and all(type(m) is FusedSumLinear for m in layers)
    assert fuse_lora_sums(model) == 0
    keys = set(model.state_dict())
    _set_class(model, PeftLinear)
    assert set(model.state_dict()) == keys
    _set_class(model, FusedSumLinear)
    twin = copy.deepcopy(model)
    assert type(twin.base_model.model.model.layers[0].self_attn.q_proj) is FusedSumLinear
    assert type(pickle.loads(pickle.dumps(model)).base_model.model.model.layers[1].mlp.down_proj) is FusedSumLinear


def test_in_fp32_the_fused_sum_gives_peft_logits_loss_and_gradients():
    """fp32, dropout 0.1 drawn from the same seed: logits, loss and every adapter gradient equal peft's within fp32
    rounding (the products' summation order and where the dropout's 1 / (1 − p) multiplies differ); per adapted
    projection one ``addmm`` replaces peft's ``mm`` and ``add``, its ``mul`` by s is over ``[tokens, r]``, and in
    training the dropout's scaling joins it there (one ``mul`` fewer, the same draws)."""
    model = _lora_model()
    fused = _run(model, "fp32")
    ops = OpCounts()
    with ops, torch.no_grad():
        model(input_ids=IDS)
    _set_class(model, PeftLinear)
    peft = _run(model, "fp32")
    peft_ops = OpCounts()
    with peft_ops, torch.no_grad():
        model(input_ids=IDS)
    assert ops.counts.get("addmm", 0) - peft_ops.counts.get("addmm", 0) == 14
    assert peft_ops.counts["mm"] - ops.counts["mm"] == 14 and peft_ops.counts["add"] - ops.counts["add"] == 14
    assert ops.counts["mul"] == peft_ops.counts["mul"]  # s scales the [tokens, r] product instead of [tokens, out]
    model.train()  # with dropout, FastDropout's 1 / (1 − p) joins s on the [tokens, r] product: 14 passes fewer
    counted = {}
    for cls in (FusedSumLinear, PeftLinear):
        _set_class(model, cls)
        counted[cls] = OpCounts()
        with counted[cls], torch.no_grad():
            model(input_ids=IDS)
    assert counted[PeftLinear].counts["mul"] - counted[FusedSumLinear].counts["mul"] == 14
    assert counted[PeftLinear].counts["random_"] == counted[FusedSumLinear].counts["random_"] == 14
    model.eval()
    torch.testing.assert_close(fused[0], peft[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], peft[1], rtol=1e-6, atol=1e-6)
    assert fused[2].keys() == peft[2].keys() and len(fused[2]) == 28
    for name in peft[2]:
        torch.testing.assert_close(fused[2][name], peft[2][name], rtol=1e-4, atol=1e-6)
    assert any(g.abs().max() > 0 for g in fused[2].values())


def test_in_bf16_the_fused_sum_is_as_close_to_fp32_as_peft():
    """bf16 weights under bf16 autocast (as the CPU's and a GPU's bf16 runs): the fused sum rounds the update once,
    peft twice. Against the same model in fp32, the fused logits' mean error is no larger than 1.5 × peft's and far
    below the update's own size (the update is neither lost nor doubled); the loss's error too; the adapter's
    gradients are off by bf16 rounding as peft's are (mean relative error ≤ 1.5 × peft's, each ≤ 5%). On the Intel
    AMX kind: logits 0.79e-3 against 0.84e-3, gradients 1.06% against 0.96% (max 2.3% against 1.9%)."""
    fp32 = _run(_lora_model(dropout=0.0), "fp32")
    model = _lora_model(bf16=True, dropout=0.0)
    fused = _run(model, "bf16")
    _set_class(model, PeftLinear)
    peft = _run(model, "bf16")
    with torch.no_grad():
        no_update = tiny_model(seed=0)[0].eval()(input_ids=IDS).logits.float()  # the base model alone
    err = lambda a, b: (a - b).abs().mean().item()
    assert err(fused[0], fp32[0]) <= 1.5 * err(peft[0], fp32[0])
    assert err(fused[0], fp32[0]) < 0.1 * err(no_update, fp32[0])
    assert abs(fused[1] - fp32[1]) <= 1.5 * abs(peft[1] - fp32[1]) + 1e-4
    rel = {run: [((g[name] - fp32[2][name]).norm() / fp32[2][name].norm()).item() for name in fp32[2]]
           for run, g in (("fused", fused[2]), ("peft", peft[2]))}
    assert sum(rel["fused"]) <= 1.5 * sum(rel["peft"]) and max(rel["fused"]) <= 0.05, rel


def test_a_disabled_or_merged_adapter_runs_peft_forward():
    """``disable_adapter`` gives the base model's logits, and generation's ``merged_adapter`` (fp32) the unmerged
    logits: both through peft's forward, which the fused class falls back to."""
    model = _lora_model(dropout=0.0).eval()
    with torch.no_grad():
        live = model(input_ids=IDS).logits
        with model.disable_adapter():
            off = model(input_ids=IDS).logits
        with merged_adapter(model):
            merged = model(input_ids=IDS).logits
    assert not torch.allclose(live, off, atol=1e-3)  # the update is there
    torch.testing.assert_close(merged, live, rtol=1e-4, atol=1e-4)
    plain = tiny_model(seed=0)[0].eval()
    with torch.no_grad():
        torch.testing.assert_close(off, plain(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
