"""The CPU speed patches change nothing but speed and rounding: dropout's distribution, bf16 weights, weights held
by column, decode steps' linears through oneDNN, decode attention (fedspear.runtime.cpu_kernels)."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch
from helpers import OpCounts, with_random_adapter

from fedspear.interaction import render
from fedspear.tasks import arc_challenge


def test_fast_dropout_has_dropouts_distribution():
    """FastDropout: zeroes a share p of elements (within 5 σ), scales the rest so the mean is kept (1/(1 − p_eff),
    p_eff = round(p·2¹⁶)/2¹⁶), is the identity in eval mode or at p = 0, repeats under the same seed, passes the
    gradient through the same mask, and draws independent masks for odd sizes too."""
    from fedspear.runtime.cpu_kernels import FastDropout

    n, p = 400_001, 0.1
    drop = FastDropout(p).train()
    assert drop.p_eff == 6554 / 65536 and abs(drop.p_eff - p) <= 2**-17
    x = torch.ones(n, requires_grad=True)
    torch.manual_seed(3)
    y = drop(x)
    zero = (y == 0).float().mean().item()
    assert abs(zero - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - drop.p_eff)))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d/dx of mask · x / (1 - p_eff)
    torch.manual_seed(3)
    assert torch.equal(drop(torch.ones(n)), y.detach())
    quarters = (y.detach()[: n - 1].view(-1, 4) == 0).float().mean(0)  # the four 16-bit draws of each word
    assert ((quarters - p).abs() < 5 * math.sqrt(p * (1 - p) / (n // 4))).all(), quarters
    big = FastDropout(0.5).train()(torch.ones(200_000))
    assert abs((big == 0).float().mean().item() - 0.5) < 5 * math.sqrt(0.25 / 200_000)
    assert drop.eval()(x) is x and FastDropout(0.0).train()(x) is x
    for bad in (-0.1, 1.0, 0.999995):
        with pytest.raises(ValueError, match="dropout p"):
            FastDropout(bad)


def test_zero_dropped_is_fast_dropout_without_its_scaling():
    """``zero_dropped``: the same draws as ``forward`` from the same seed, so ``factor · zeroed`` is ``forward(x)``
    bit for bit (fp32 and bf16), its gradient is the 0/1 mask; in eval mode or at p = 0 it returns ``(x, 1.0)``.
    ``x`` has no zeros, so the zeros of the output are the dropped elements (torch 2.11's ``randn`` in bf16 gives
    exact zeros: 4 of these 693)."""
    from fedspear.runtime.cpu_kernels import FastDropout

    drop = FastDropout(0.1).train()
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.rand(3, 7, 33) + 0.5).to(dtype).requires_grad_()  # 693 elements in [0.5, 1.5): not a multiple of 4
        torch.manual_seed(5)
        scaled = drop(x)
        torch.manual_seed(5)
        zeroed, factor = drop.zero_dropped(x)
        assert factor == drop.scale and zeroed.dtype == dtype
        assert torch.equal(zeroed * factor, scaled)
        assert torch.equal(zeroed == 0, scaled == 0) and 0 < (zeroed == 0).sum() < x.numel() // 4
        zeroed.sum().backward()
        assert torch.equal(x.grad, (zeroed != 0).to(dtype))
    x = torch.randn(5)
    for off in (drop.eval(), FastDropout(0.0).train()):
        out, factor = off.zero_dropped(x)
        assert out is x and factor == 1.0


def test_zero_where_dropped_is_masked_fill_bit_for_bit_and_keeps_only_the_mask():
    """``zero_where_dropped(x, kept)`` equals ``x.masked_fill(~kept, 0)`` bit for bit — NaN, ±inf and −0 kept where
    kept, +0 where dropped — for bf16, fp16, fp32 and fp64, on a transposed (non-contiguous) ``x`` and with a
    non-contiguous incoming gradient; its gradient equals ``masked_fill``'s; what autograd keeps for the backward is
    the bool mask alone (1 byte per element, as for ``masked_fill``)."""
    from fedspear.runtime.cpu_kernels import zero_where_dropped

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        base = torch.randn(41, 37).to(dtype)
        base[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
        kept = torch.rand(37, 41) >= 0.3
        kept[:4, 0] = True  # the specials pass where kept …
        kept[4:8, 0] = False  # … and are cleared where dropped
        base[0, 4:8] = torch.tensor([float("nan"), float("inf"), -0.0, -3.0], dtype=dtype)
        grad = torch.randn(41, 37).to(dtype).t()  # non-contiguous, like x
        outs, grads = [], []
        for way in ("masked_fill", "ours"):
            x = base.t().detach().requires_grad_()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                y = x.masked_fill(~kept, 0) if way == "masked_fill" else zero_where_dropped(x, kept)
            y.backward(grad)
            outs.append(y.detach().contiguous().view(torch.uint8))  # the bytes: NaN payloads and signs compared too
            grads.append(x.grad.contiguous().view(torch.uint8))
            if way == "ours":
                assert [(t.dtype, t.shape) for t in saved] == [(torch.bool, kept.shape)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), dtype
        assert (zero_where_dropped(base.t(), kept)[~kept] == 0).all()
        assert not torch.signbit(zero_where_dropped(base.t(), kept)[~kept]).any()  # +0, as masked_fill writes


def test_bf16_norm_outputs_keep_the_forward_bitwise_and_gradients_to_bf16_rounding():
    """bf16 linear weights under bf16 autocast, with and without the norms' bf16 outputs (``bf16_norm_outputs``):
    eval logits and the training loss (dropout 0.1, the same seed) are bitwise the same; against an fp32 model the
    adapter's gradients are off by bf16 rounding as much as without it (mean relative error ≤ 1.5 × that, each
    ≤ 5%; on the Intel AMX kind 2.05% against 2.10%, max 3.4% both). One hook per norm however often it is called;
    none for another model type; outside bf16 autocast the output is left in fp32."""
    from fedspear.runtime.cpu_kernels import NORM_HOOKED, bf16_norm_outputs, store_linear_weights_bf16
    from fedspear.runtime.model import TINY_LAYERS, LoraSettings, add_lora, autocast, tiny_model

    def model(stored: bool, hooked: bool):
        base, _ = tiny_model(seed=0)
        if stored:
            store_linear_weights_bf16(base)
        if hooked:
            assert bf16_norm_outputs(base) == bf16_norm_outputs(base) == 2 * TINY_LAYERS
            norms = [m for m in base.modules() if getattr(m, NORM_HOOKED, False)]
            assert len(norms) == 2 * TINY_LAYERS and all(len(m._forward_hooks) == 1 for m in norms)
        lora = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1), seed=0)
        torch.manual_seed(1)
        return with_random_adapter(lora, 0.3)

    ids = torch.randint(0, 1000, (3, 17), generator=torch.Generator().manual_seed(0))

    def run(lora, dtype: str):
        lora.eval()
        with torch.no_grad(), autocast(dtype):
            logits = lora(input_ids=ids).logits.float()
        lora.train()
        torch.manual_seed(2)
        with autocast(dtype):
            loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        return logits, loss.detach(), {n: p.grad for n, p in lora.named_parameters() if p.grad is not None}

    fp32 = run(model(False, False), "fp32")
    plain = run(model(True, False), "bf16")
    hooked_model = model(True, True)
    hooked = run(hooked_model, "bf16")
    assert torch.equal(hooked[0], plain[0]) and torch.equal(hooked[1], plain[1])
    assert not torch.equal(hooked[0], fp32[0])  # bf16 is in use
    rel = {way: [((g[n] - fp32[2][n]).norm() / fp32[2][n].norm()).item() for n in fp32[2]]
           for way, g in (("hooked", hooked[2]), ("plain", plain[2]))}
    assert len(rel["hooked"]) == 2 * 7 * TINY_LAYERS  # A and B of seven projections per layer
    assert sum(rel["hooked"]) <= 1.5 * sum(rel["plain"]) and max(rel["hooked"]) <= 0.05, rel
    assert any(not torch.equal(hooked[2][n], plain[2][n]) for n in plain[2])  # the sums did run in bf16
    norm = hooked_model.base_model.model.model.layers[0].input_layernorm
    hidden = torch.randn(2, norm.weight.shape[0])
    with autocast("bf16"):
        assert norm(hidden).dtype == torch.bfloat16
    assert norm(hidden).dtype == torch.float32  # outside autocast: as it was
    other, _ = tiny_model(seed=0)
    other.config.model_type = "gemma"
    assert bf16_norm_outputs(other) == 0


def test_add_lora_draws_dropout_with_fast_dropout_on_the_cpu_only():
    """On the CPU the adapter's dropout is FastDropout; a model on another device (``meta`` standing in for a GPU)
    keeps peft's nn.Dropout, which a GPU runs as one fused kernel."""
    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model

    kinds = lambda m: {type(d).__name__ for mod in m.modules() if isinstance(getattr(mod, "lora_dropout", None),
                                                                             torch.nn.ModuleDict)
                       for d in mod.lora_dropout.values()}
    assert kinds(add_lora(tiny_model(seed=0)[0], LoraSettings(r=4, alpha=8, dropout=0.1))) == {"FastDropout"}
    assert kinds(add_lora(tiny_model(seed=0)[0], LoraSettings(r=4, alpha=8, dropout=0.0))) == {"Identity"}
    elsewhere = tiny_model(seed=0)[0].to("meta")
    assert kinds(add_lora(elsewhere, LoraSettings(r=4, alpha=8, dropout=0.1))) == {"Dropout"}


def test_bf16_linear_weights_give_autocasts_outputs_and_gradients_bitwise():
    """Storing the linears' weights in bf16 is what bf16 autocast computes with anyway: same logits, same LoRA
    gradients, bit for bit; embeddings stay fp32 and the tied output embedding gets its own bf16 copy."""
    from fedspear.runtime.cpu_kernels import store_linear_weights_bf16
    from fedspear.runtime.model import LoraSettings, add_lora, autocast, tiny_model

    models = []
    for stored in (False, True):
        base, tok = tiny_model(seed=0)
        if stored:
            assert store_linear_weights_bf16(base) > 0
            assert base.get_input_embeddings().weight.dtype == torch.float32
            assert base.get_output_embeddings().weight.dtype == torch.bfloat16
        model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
        torch.manual_seed(1)
        with_random_adapter(model, 0.3)
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
        models.append(model)
    ids = torch.randint(0, len(tok), (3, 17))
    out = []
    for model in models:
        with autocast("bf16"):
            logits = model(input_ids=ids).logits  # [3, 17, V]
            loss = logits.float().log_softmax(-1)[..., 0].mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((logits.detach(), grads))
    assert torch.equal(out[0][0], out[1][0])
    assert out[0][1].keys() == out[1][1].keys() and len(out[0][1]) > 0
    for name in out[0][1]:
        assert torch.equal(out[0][1][name], out[1][1][name]), name


def test_column_weights_give_the_same_outputs_gradients_and_answers(arc_items):
    """Linear weights held by column keep their shapes and values (a tied output embedding stays tied): logits and
    LoRA gradients equal the row layout's to fp32 rounding, greedy answers are the same, and generation's merged
    copy of each weight is held by column too, with the base weights put back bitwise after it."""
    from fedspear.runtime.cpu_kernels import store_linear_weights_by_column
    from fedspear.runtime.generation import generate
    from fedspear.runtime.model import LoraSettings, add_lora, merged_adapter, tiny_model

    models = []
    for by_column in (False, True):
        base, tok = tiny_model(seed=0)
        linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
        before = [m.weight.detach().clone() for m in linears]
        tied = base.get_output_embeddings().weight is base.get_input_embeddings().weight
        if by_column:
            assert store_linear_weights_by_column(base) == len({id(m.weight) for m in linears}) > 0
            assert store_linear_weights_by_column(base) == 0  # already by column
            for module, old in zip(linears, before):
                assert module.weight.t().is_contiguous() and not module.weight.is_contiguous()
                assert torch.equal(module.weight, old)
            assert (base.get_output_embeddings().weight is base.get_input_embeddings().weight) == tied
        model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
        torch.manual_seed(1)
        models.append(with_random_adapter(model, 0.3))
    ids = torch.randint(0, len(tok), (3, 17))
    out = []
    for model in models:
        logits = model(input_ids=ids).logits  # [3, 17, V]
        logits.log_softmax(-1)[..., 0].mean().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-5)
    assert out[0][1].keys() == out[1][1].keys() and len(out[0][1]) > 0
    for name in out[0][1]:
        torch.testing.assert_close(out[0][1][name], out[1][1][name], atol=1e-5, rtol=1e-4, msg=name)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    answers = [generate(m, tok, contexts, max_new_tokens=8, do_sample=False, merge=True) for m in models]
    assert answers[0] == answers[1]
    by_column = models[1].eval()
    layers = [m.get_base_layer() for m in by_column.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    held = [(layer.weight.data_ptr(), layer.weight.detach().clone()) for layer in layers]
    with merged_adapter(by_column):
        for layer, (address, weight) in zip(layers, held):
            assert layer.weight.data_ptr() != address and layer.weight.t().is_contiguous()
            assert not torch.equal(layer.weight, weight)  # the merged copy: W + s·B·A
    for layer, (address, weight) in zip(layers, held):
        assert layer.weight.data_ptr() == address and torch.equal(layer.weight, weight)


def test_column_weights_are_taken_for_fp32_on_an_intel_cpu_only(monkeypatch):
    """``column_weights_pay`` says yes for fp32 on an Intel CPU and nowhere else; ``load_base`` holds the linear
    weights by column exactly when it says yes."""
    import fedspear.runtime.cpu_kernels as kernels
    import fedspear.runtime.model as model_module
    from fedspear.runtime.model import load_base

    for vendor, dtype, device, pays in (("GenuineIntel", "fp32", "cpu", True), ("GenuineIntel", "bf16", "cpu", False),
                                        ("AuthenticAMD", "fp32", "cpu", False), (None, "fp32", "cpu", False),
                                        ("GenuineIntel", "fp32", "cuda", False)):
        monkeypatch.setattr(kernels, "cpu_vendor", lambda v=vendor: v)
        assert kernels.column_weights_pay(dtype, device) is pays, (vendor, dtype, device)
    monkeypatch.undo()
    vendor = kernels.cpu_vendor()
    if Path("/proc/cpuinfo").exists():
        assert f"vendor_id\t: {vendor}" in Path("/proc/cpuinfo").read_text()
    for pays in (True, False):
        monkeypatch.setattr(model_module, "column_weights_pay", lambda dtype_used, p=pays: p)
        base = load_base("tiny-random", "fp32", "cpu")[0]
        up = base.model.layers[0].mlp.up_proj.weight
        assert up.t().is_contiguous() is pays and up.is_contiguous() is not pays


needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                        and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                                   reason="this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")


def _linear_ops(fn) -> dict[str, int]:
    """The ATen ops ``fn()`` dispatches, counted by name (``mm``, ``addmm``, ``_linear_pointwise``, …)."""
    with OpCounts() as ops:
        fn()
    return ops.counts


@needs_onednn
def test_decode_linear_multiplies_decode_steps_through_onednn_and_nothing_else():
    """``DecodeLinear``: inside ``decoding()`` an fp32 ``[B, 1, in]`` input without autograd goes to oneDNN's linear
    (bias included) and equals ``F.linear`` to fp32 rounding; outside it, with autograd, with several positions per
    row, in bf16 or as a 2-D input it is ``nn.Linear``'s own forward, bitwise."""
    from fedspear.runtime.cpu_kernels import DecodeLinear, decoding

    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160)
    layer.__class__ = DecodeLinear
    step = torch.randn(5, 1, 96)
    with torch.no_grad(), decoding():
        got = layer(step)
        ops = _linear_ops(lambda: layer(step))
    assert "_linear_pointwise" in ops and "addmm" not in ops and "mm" not in ops, ops
    assert got.shape == (5, 1, 160)
    torch.testing.assert_close(got, torch.nn.functional.linear(step, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # outside generation: nn.Linear's product
        ops = _linear_ops(lambda: layer(step))
        assert "_linear_pointwise" not in ops and ("addmm" in ops or "mm" in ops), ops
        assert torch.equal(layer(step), torch.nn.functional.linear(step, layer.weight, layer.bias))
    layer.bias = None
    with torch.no_grad(), decoding():
        torch.testing.assert_close(layer(step), torch.nn.functional.linear(step, layer.weight), atol=1e-5, rtol=1e-5)
    others = [(torch.randn(5, 1, 96, requires_grad=True), True), (torch.randn(5, 3, 96), False),
              (torch.randn(5, 96), False)]
    with decoding():
        for x, grad in others:
            with torch.set_grad_enabled(grad):
                ops = _linear_ops(lambda x=x: layer(x))
                assert "_linear_pointwise" not in ops and ("addmm" in ops or "mm" in ops), (x.shape, grad, ops)
                assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
        half = layer.to(torch.bfloat16)
        with torch.no_grad():
            x = step.to(torch.bfloat16)
            assert "_linear_pointwise" not in _linear_ops(lambda: half(x))


@needs_onednn
def test_onednn_decode_keeps_greedy_answers_and_leaves_training_and_scoring_alone(arc_items):
    """A model whose linears are ``DecodeLinear``s (the tiny model with a non-zero adapter, fp32, the adapter merged
    for generation as fp32 generation does and not): the same greedy answers and first-step logits (to fp32
    rounding) as with ``nn.Linear``, its decode steps through oneDNN; its log-probabilities and LoRA gradients are
    ``nn.Linear``'s bitwise, a forward of one position per row outside generation (as the margin pass runs) too."""
    from fedspear.runtime.cpu_kernels import DecodeLinear, use_onednn_decode
    from fedspear.runtime.generation import generate
    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model

    models = []
    for onednn in (False, True):
        base, tok = tiny_model(seed=0)
        if onednn:
            linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
            assert use_onednn_decode(base) == len(linears) > 0
            assert all(type(m) is DecodeLinear for m in linears) and use_onednn_decode(base) == 0
        model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
        torch.manual_seed(1)
        models.append(with_random_adapter(model, 0.3))
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    for merge in (True, False):
        runs = []
        for model in models:
            ops = _linear_ops(lambda m=model: generate(m, tok, contexts[:2], max_new_tokens=3, do_sample=False,
                                                       merge=merge))
            assert ("_linear_pointwise" in ops) is (model is models[1]), merge
            first: list = []
            runs.append((generate(model, tok, contexts, max_new_tokens=8, do_sample=False, merge=merge,
                                  first_logits=first), torch.stack(first)))
        assert runs[0][0] == runs[1][0], merge
        torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-5)
    ids = torch.randint(0, len(tok), (3, 17))
    out = []
    for model in models:
        model.train()
        logits = model(input_ids=ids).logits  # [3, 17, V]
        logits.log_softmax(-1)[..., 0].mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            scored = model(input_ids=ids).logits.log_softmax(-1)
            one = model(input_ids=ids[:, :1], logits_to_keep=1).logits  # [3, 1, V]: one position per row
        out.append((logits.detach(), grads, scored, one))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][2], out[1][2]) and torch.equal(out[0][3], out[1][3])
    assert out[0][1].keys() == out[1][1].keys() and len(out[0][1]) > 0
    assert all(torch.equal(out[0][1][n], out[1][1][n]) for n in out[0][1])


def test_onednn_decode_is_taken_for_fp32_on_an_amd_cpu_only(monkeypatch):
    """``onednn_decode_pays`` says yes for fp32 on an AMD CPU (with oneDNN's linear in torch, ``ONEDNN_DECODE``
    on) and nowhere else; ``load_base`` makes the linears ``DecodeLinear``s exactly when it says yes."""
    import fedspear.runtime.cpu_kernels as kernels
    import fedspear.runtime.model as model_module
    from fedspear.runtime.model import load_base

    has = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    for vendor, dtype, device, pays in (("AuthenticAMD", "fp32", "cpu", has), ("AuthenticAMD", "bf16", "cpu", False),
                                        ("GenuineIntel", "fp32", "cpu", False), (None, "fp32", "cpu", False),
                                        ("AuthenticAMD", "fp32", "cuda", False)):
        monkeypatch.setattr(kernels, "cpu_vendor", lambda v=vendor: v)
        assert kernels.onednn_decode_pays(dtype, device) is pays, (vendor, dtype, device)
    monkeypatch.setattr(kernels, "ONEDNN_DECODE", False)
    assert kernels.onednn_decode_pays("fp32", "cpu") is False
    monkeypatch.undo()
    for pays in (True, False):
        monkeypatch.setattr(model_module, "column_weights_pay", lambda dtype_used: False)
        monkeypatch.setattr(model_module, "onednn_decode_pays", lambda dtype_used, p=pays: p)
        base = load_base("tiny-random", "fp32", "cpu")[0]
        kinds = {type(m) for m in base.modules() if isinstance(m, torch.nn.Linear)}
        assert kinds == ({kernels.DecodeLinear} if pays else {torch.nn.Linear}), kinds


@needs_onednn
def test_the_onednn_decode_script_times_both_ways_and_compares_answers(tmp_path):
    """``scripts/onednn_decode_ab.py`` (its figures are in ``onednn_decode_pays``' docstring) runs on the tiny model,
    times decode at batch 8 and 32 both ways in alternating pairs, and counts the greedy answers the two ways share
    (the tiny model's are the same: ``test_onednn_decode_keeps_greedy_answers_and_leaves_training_and_scoring_alone``).
    """
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "onednn_decode_ab.py"
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(script), "--model", "tiny-random", "--pairs", "2", "--prompts", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert (figures["prompts"], figures["greedy_same"]) == (3, 3)
    for way in ("mkl", "onednn"):
        for batch in ("8", "32"):
            assert len(figures["tokens_per_s"][way][batch]) == 2 and min(figures["tokens_per_s"][way][batch]) > 0
    for batch in ("8", "32"):  # the summary is the median of the per-pair ratios
        rates = figures["tokens_per_s"]
        ratios = [o / m for o, m in zip(rates["onednn"][batch], rates["mkl"][batch])]
        assert figures["summary"][batch]["ratio"] == pytest.approx(sum(ratios) / 2)
        assert figures["summary"][batch]["faster"] == sum(r > 1 for r in ratios)
    assert "greedy answers" in proc.stdout and "oneDNN faster in" in proc.stdout


def test_decode_attention_is_sdpa_in_fp32_for_one_query_row():
    """A decode step's attention (one query row, grouped query heads, padding mask) equals transformers' SDPA in
    fp32; under bf16 autocast it stays fp32 (closer to the fp32 result than bf16 SDPA); longer queries are SDPA's."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fedspear.runtime.cpu_kernels import decode_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    b, h, kv, length, d = 4, 6, 2, 9, 8
    k, v = torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    mask[0, :, :, :3] = False  # left padding of row 0
    q = torch.randn(b, h, 1, d)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)  # [B, 1, H, D]
    got, _ = decode_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    assert got.shape == ref.shape == (b, 1, h, d)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_bf16, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
        ours, _ = decode_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    assert ours.dtype == torch.float32 and in_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    assert (in_bf16.float() - ref).abs().max() > 1e-4  # bf16 SDPA really is less precise
    q3 = torch.randn(b, h, 3, d)  # a prefill: handed to transformers' SDPA unchanged
    torch.testing.assert_close(decode_attention_forward(module, q3, k, v, None, scaling=d**-0.5)[0],
                               sdpa_attention_forward(module, q3, k, v, None, scaling=d**-0.5)[0])


def test_models_decode_with_the_fp32_decode_attention_as_with_sdpa(tiny, arc_items):
    """The loaded model uses the decode attention; greedy answers and first-step logits equal plain SDPA's."""
    import copy

    from fedspear.runtime.cpu_kernels import DECODE_ATTENTION
    from fedspear.runtime.generation import generate
    from fedspear.runtime.model import load_base

    assert load_base("tiny-random", "fp32")[0].config._attn_implementation == DECODE_ATTENTION
    model, tok = tiny
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    runs = []
    for impl in ("sdpa", DECODE_ATTENTION):
        m = copy.deepcopy(model)
        m.base_model.model.set_attn_implementation(impl)
        first: list = []
        runs.append((generate(m, tok, contexts, max_new_tokens=6, do_sample=False, first_logits=first),
                     torch.stack(first)))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_page_out_drops_a_mapped_tensors_pages_and_keeps_its_values():
    """A tensor viewing the mapped checkpoint file: once read, its pages count in the process's resident memory;
    page_out hands them back (RssFile falls by about its size) and the values read afterwards are the same. Tensors
    in anonymous memory are left alone (0 bytes advised)."""
    from transformers import AutoModelForCausalLM

    from fedspear.runtime.memory import file_mappings, page_out, status
    from fedspear.runtime.model_zoo import resolve_model_dir

    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2-135m"), dtype=torch.float32)
    weight = base.get_input_embeddings().weight.data  # [49152, 576] fp32, 108 MiB of the file
    size_mb = weight.numel() * 4 / 2**20
    before = weight.double().sum().item()  # reads every page
    resident = status()["RssFile"]
    advised = page_out(weight)
    assert advised >= weight.numel() * 4
    assert status()["RssFile"] < resident - 0.8 * size_mb
    assert weight.double().sum().item() == before
    assert page_out(weight.clone()) == 0 and page_out(torch.ones(4)[::2]) == 0
    mappings = file_mappings()  # read once, as store_linear_weights_bf16 does: the same advice; none without them
    assert any(start <= weight.data_ptr() < end for start, end in mappings)
    assert page_out(weight, mappings) == advised and page_out(weight, []) == 0
    del base, weight
    gc.collect()  # unmap the file: the kernel pages out only pages no other process maps (next test)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_bf16_loading_peaks_at_the_bf16_model_not_the_whole_file():
    """Loading in bf16 converts the mapped fp32 checkpoint tensor by tensor; paging out each converted tensor keeps
    the file's pages from piling up beside the bf16 copies. Measured in fresh processes (peak resident memory during
    load_base, SmolLM2-135M: ≈ 1,280 MiB without paging out, ≈ 790 MiB with, Zen 5). The conversion in the process
    is what is measured: the shared weight copy, which a load maps instead once it exists, is switched off here (with
    it both loads map the same copy and grow alike, ≈ 190 MiB: the test then failed wherever the copy existed)."""
    import subprocess
    import sys

    from fedspear.runtime.model_zoo import resolve_model_dir

    # resident memory sampled every 5 ms (the kernel's high-water mark misses pages reclaimed by a page-out, and a
    # child's ru_maxrss starts from its parent's)
    script = (
        "import sys, threading, time\n"
        "import fedspear.runtime.memory as memory\n"
        "if sys.argv[1] == 'off': memory.page_out = lambda tensor, mappings=None: 0\n"
        "import torch, transformers\n"
        "import fedspear.runtime.model as model\n"
        "from fedspear.runtime.cpu_kernels import store_linear_weights_bf16\n"
        "model.shared_bf16_weights = lambda base, where: store_linear_weights_bf16(base)\n"
        "from fedspear.runtime.model import load_base\n"
        "peak, done = [0.0], []\n"
        "def sample():\n"
        "    while not done:\n"
        "        peak[0] = max(peak[0], memory.status()['VmRSS']); time.sleep(0.005)\n"
        "start = memory.status()['VmRSS']; sampler = threading.Thread(target=sample, daemon=True); sampler.start()\n"
        "try:\n"
        "    load_base('smollm2-135m', 'bf16', 'cpu')\n"
        "finally:\n"
        "    done.append(1); sampler.join()\n"
        "print(peak[0] - start)\n"
    )
    gc.collect()  # no mapping of the file left in this process: the kernel skips pages two processes map
    target = str(Path(resolve_model_dir("smollm2-135m")).resolve())
    assert not any(target in line for line in Path("/proc/self/maps").read_text().splitlines())
    grown = {}
    for setting in ("off", "on"):
        done = subprocess.run([sys.executable, "-c", script, setting], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        grown[setting] = float(done.stdout.split()[-1])
    # the fp32 linears' file pages: ≈ 400 MiB of the 513 MiB file
    assert grown["on"] < grown["off"] - 300, grown


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_bf16_loading_releases_the_mapped_checkpoint_file():
    """transformers maps the checkpoint file and hands out views of it; once the linears are bf16 copies and the
    fp32 rest is copied out, nothing refers to the mapping, so the file (and the pages the conversion read, counted
    in the process's resident memory) is no longer mapped. In fp32 the weights are the mapping itself."""

    from fedspear.runtime.model import load_base
    from fedspear.runtime.model_zoo import resolve_model_dir

    def mapped() -> bool:
        target = str(Path(resolve_model_dir("smollm2-135m")).resolve())
        return any(target in line for line in Path("/proc/self/maps").read_text().splitlines())

    base, _, dtype_used = load_base("smollm2-135m", "bf16", "cpu")
    gc.collect()
    assert dtype_used == "bf16" and not mapped()
    del base
    base, _, _ = load_base("smollm2-135m", "fp32", "cpu")
    gc.collect()
    assert mapped()  # the check can see a mapping: fp32 weights are views of the file
