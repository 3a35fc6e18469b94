"""Batched generation: the shared prompt prefix computed once gives the same answers as plain generation."""

from __future__ import annotations

import torch
from helpers import with_random_adapter

from fedspear.interaction import render
from fedspear.tasks import arc_challenge


def test_shared_prefix_length():
    from fedspear.runtime.generation import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # each context keeps one token of its own
    assert shared_prefix_length([[7], [7, 8]]) == 0
    assert shared_prefix_length([[1, 2], [3, 2]]) == 0
    assert shared_prefix_length([]) == 0


def test_generation_with_the_shared_prefix_cached_matches_plain_generation(tiny, arc_items):
    """Greedy answers and first-step logits are those of plain left-padded generation when the shared prompt prefix
    is run once and its KV cache handed to every row (rows of different lengths, a non-identity adapter)."""
    import copy

    from fedspear.runtime.generation import generate

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    runs = {}
    for reuse in (False, True):
        first: list = []
        runs[reuse] = generate(model, tok, contexts, max_new_tokens=6, do_sample=False, first_logits=first,
                               reuse_prefix=reuse), torch.stack(first)
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # and each row's first logits are those of the prompt alone
        alone = torch.stack([model(input_ids=torch.tensor([c])).logits[0, -1].float() for c in contexts])
    torch.testing.assert_close(runs[True][1], alone, atol=1e-4, rtol=1e-4)
    torch.manual_seed(5)
    sampled = generate(model, tok, contexts, max_new_tokens=6, do_sample=True)
    assert len(sampled) == len(contexts) and all(0 < len(s) <= 6 for s in sampled)


def test_merged_adapter_computes_the_unmerged_model_and_puts_the_very_base_weights_back(tiny, arc_items):
    """Inside ``merged_adapter`` the LoRA branches are gone (merged) and the logits are the unmerged model's up to
    fp32 rounding; after it the base weights are the same tensors, bitwise unchanged, and the adapter applies again."""
    import copy

    from fedspear.runtime.model import merged_adapter

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5).eval()
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    before = [(m.get_base_layer().weight, m.get_base_layer().weight.data.clone()) for m in layers]
    ids = torch.tensor([render(tok, [arc_challenge.prompt(arc_items[0])])])
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        with model.disable_adapter():
            base_only = model(input_ids=ids).logits
        with merged_adapter(model):
            assert all(m.merged for m in layers)
            merged = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not (unmerged - base_only).abs().max() < 1e-3  # the adapter matters, so the comparison below can fail
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)  # fp32 rounding of the merged sums
    assert not any(m.merged for m in layers)
    for m, (weight, copy_before) in zip(layers, before):
        assert m.get_base_layer().weight is weight  # the same parameter, its values bitwise those before
        assert torch.equal(weight.data, copy_before)  # (put back, not merged and unmerged again)
    assert torch.equal(after, unmerged)


def test_merged_adapter_leaves_training_mode_and_disabled_calls_alone_and_restores_after_an_error(tiny):
    import copy

    import pytest

    from fedspear.runtime.model import merged_adapter

    model, _ = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    weights = [(m.get_base_layer().weight.data_ptr(), m.get_base_layer().weight.data.clone()) for m in layers]
    model.train()
    with merged_adapter(model):
        assert not any(m.merged for m in layers)  # training needs the LoRA branch: never merged
    model.eval()
    with merged_adapter(model, enabled=False):
        assert not any(m.merged for m in layers)
    with pytest.raises(RuntimeError, match="boom"), merged_adapter(model):
        assert all(m.merged for m in layers)
        raise RuntimeError("boom")
    assert not any(m.merged for m in layers)
    for m, (pointer, values) in zip(layers, weights):  # the same storage again, unchanged
        assert m.get_base_layer().weight.data_ptr() == pointer and torch.equal(m.get_base_layer().weight.data, values)


def test_fp32_generation_merges_the_adapter_and_gives_the_unmerged_greedy_answers(tiny, arc_items, monkeypatch):
    """``generate`` merges the adapter for fp32 (``merge=None``), not for bf16; greedy answers are those of the
    unmerged model on these prompts, and the base weights are unchanged after."""
    import copy

    from fedspear.runtime import generation

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}
    answers = {m: generation.generate(model, tok, contexts, max_new_tokens=8, do_sample=False, merge=m)
               for m in (False, True)}
    assert answers[True] == answers[False]
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if "lora" not in n)
    seen = []
    real = generation.merged_adapter
    monkeypatch.setattr(generation, "merged_adapter", lambda m, enabled: seen.append(enabled) or real(m, enabled))
    for dtype_used in ("fp32", "bf16"):
        generation.generate(model, tok, contexts[:2], max_new_tokens=2, do_sample=False, dtype_used=dtype_used)
    assert seen == [True, False]


def test_preallocated_cache_layer_holds_what_concatenation_would():
    """A PreallocatedLayer returns exactly the concatenated keys/values after a prefill, decode steps, a repeat over
    the batch (transformers' new tensors are copied into fresh buffers), a crop and a buffer that fills up; its
    buffers hold what is cached plus GROW positions, up to the capacity, not the whole budget at once."""
    from fedspear.runtime.cpu_kernels import preallocated_layer_class

    torch.manual_seed(0)
    layer, keys, values = preallocated_layer_class()(capacity=7), [], []

    def step(n: int, batch: int = 2):
        k, v = torch.randn(batch, 3, n, 4), torch.randn(batch, 3, n, 4)
        keys.append(k)
        values.append(v)
        return layer.update(k, v)

    out = step(5)  # prefill
    for _ in range(2):
        out = step(1)  # decode steps: written in place, no new buffer
    assert torch.equal(out[0], torch.cat(keys, dim=-2)) and torch.equal(out[1], torch.cat(values, dim=-2))
    assert out[0].data_ptr() == layer._buffers[0].data_ptr() and layer._buffers[0].shape[-2] == 7
    layer.batch_repeat_interleave(2)  # a new, contiguous [4, 3, 7, 4] tensor
    keys, values = [torch.cat(keys, -2).repeat_interleave(2, 0)], [torch.cat(values, -2).repeat_interleave(2, 0)]
    out = step(1, batch=4)  # 8 > capacity 7: re-buffered with GROW more
    assert layer._buffers[0].shape == (4, 3, 8 + layer.GROW, 4) and layer.get_seq_length() == 8
    assert torch.equal(out[0], torch.cat(keys, dim=-2)) and torch.equal(out[1], torch.cat(values, dim=-2))
    big = preallocated_layer_class()(capacity=1000)
    big.update(torch.randn(2, 3, 100, 4), torch.randn(2, 3, 100, 4))
    assert big._buffers[0].shape[-2] == 100 + big.GROW  # not 1000
    big.update(torch.randn(2, 3, 400, 4), torch.randn(2, 3, 400, 4))
    assert big._buffers[0].shape[-2] == 500 + 500 // 4 and big.get_seq_length() == 500
    layer.crop(-3)
    keys, values = [torch.cat(keys, -2)[..., :5, :]], [torch.cat(values, -2)[..., :5, :]]
    out = step(1, batch=4)
    assert torch.equal(out[0], torch.cat(keys, dim=-2)) and torch.equal(out[1], torch.cat(values, dim=-2))


def test_generation_with_the_preallocated_cache_gives_the_same_answers(tiny, arc_items, monkeypatch):
    """Greedy answers, first-step logits and seeded samples are the same whether the KV cache grows by
    concatenation (transformers' DynamicLayer) or is written in place (fedspear's PreallocatedLayer), with and
    without the shared prefix; a model whose cache has other layer kinds gets transformers' own cache."""
    import copy

    import fedspear.runtime.generation as generation
    from fedspear.runtime.cpu_kernels import preallocated_cache

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    assert preallocated_cache(model, 10) is not None
    runs = {}
    for cache in ("preallocated", "concatenated"):
        if cache == "concatenated":
            monkeypatch.setattr(generation, "preallocated_cache", lambda model, capacity: None)
        for reuse in (False, True):
            first: list = []
            greedy = generation.generate(model, tok, contexts, max_new_tokens=6, do_sample=False, first_logits=first,
                                         reuse_prefix=reuse)
            torch.manual_seed(5)
            sampled = generation.generate(model, tok, contexts, max_new_tokens=6, do_sample=True, reuse_prefix=reuse)
            runs[cache, reuse] = greedy, torch.stack(first), sampled
    for reuse in (False, True):
        a, b = runs["preallocated", reuse], runs["concatenated", reuse]
        assert a[0] == b[0] and a[2] == b[2]
        torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)
    sliding = copy.deepcopy(model.config)
    sliding.sliding_window = 4
    assert preallocated_cache(type("M", (), {"config": sliding})(), 10) is None
