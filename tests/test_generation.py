"""Batched generation: the shared prompt prefix computed once gives the same answers as plain generation."""

from __future__ import annotations

import numpy as np
import pytest
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


def test_reusable_length_by_hand():
    """The common prefix of a context and a kept row, never the whole context (one token must still run)."""
    from fedspear.runtime.generation import CachedRow, reusable_length

    row = CachedRow((1, 2, 3, 4, 5), [], [])
    assert reusable_length([1, 2, 3, 9, 9], row) == 3
    assert reusable_length([1, 2, 3, 4, 5, 6, 7], row) == 5  # the whole row
    assert reusable_length([1, 2, 3], row) == 2  # the whole context but its last token
    assert reusable_length([7, 1, 2], row) == 0 and reusable_length([1, 2], None) == 0


def _revision_contexts(tok, items, answers):
    """SPEAR's revision contexts c0 ‖ y ‖ f (``interaction.render``) for answers ``answers``."""
    return [render(tok, [arc_challenge.prompt(ex), tok.decode(y, skip_special_tokens=True), "Wrong. Think again."])
            for ex, y in zip(items, answers)]


@pytest.mark.parametrize("merge", [False, True])
def test_kept_rows_hold_each_contexts_own_keys_and_values(tiny, arc_items, merge):
    """``keep``: per context, its tokens and answer and, per layer, the keys and values a forward over that sequence
    alone computes (fp32; merged or not), read from the right columns of a left-padded batch with a shared prefix."""
    import copy

    from fedspear.runtime.generation import generate

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    kept: list = []
    answers = generate(model, tok, contexts, max_new_tokens=5, do_sample=False, keep=kept, merge=merge)
    assert len(kept) == len(contexts)
    layers = model.config.num_hidden_layers
    for context, answer, row in zip(contexts, answers, kept):
        n = min(len(answer), 4)  # the last of 5 new tokens was never run
        assert row.tokens == tuple(context) + tuple(answer[:n])
        with torch.no_grad():
            past = model(input_ids=torch.tensor([list(row.tokens)]), use_cache=True).past_key_values
        assert len(row.keys) == len(row.values) == layers
        for layer in range(layers):
            torch.testing.assert_close(row.keys[layer], past.layers[layer].keys[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(row.values[layer], past.layers[layer].values[0], atol=1e-4, rtol=1e-4)


def test_revisions_reusing_the_initial_calls_cache_match_plain_generation(tiny, arc_items):
    """``cached``: revision contexts c0 ‖ y0 ‖ f reuse c0's keys and values from the initial call; greedy answers and
    first-step logits are those of running every token (fp32), the rows reusing different lengths. A batch that
    would reuse fewer than ``MIN_REUSED`` tokens runs as usual, and rows for another number of contexts are refused."""
    import copy

    from fedspear.runtime import generation
    from fedspear.runtime.generation import generate, reusable_length

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    c0 = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    kept: list = []
    y0 = generate(model, tok, c0, max_new_tokens=6, do_sample=False, keep=kept)
    contexts = _revision_contexts(tok, arc_items, y0)
    reused = [reusable_length(c, r) for c, r in zip(contexts, kept)]
    assert all(n >= len(c) - 1 for n, c in zip(reused, c0)) and len(set(reused)) > 1  # c0 at least
    runs, shapes = {}, []
    hook = model.get_base_model().register_forward_pre_hook(  # [rows, width] of every forward
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        for rows in (None, kept):
            first: list = []
            shapes.clear()
            answers = generate(model, tok, contexts, max_new_tokens=6, do_sample=False, first_logits=first,
                               cached=rows)
            prefill = max(width for batch, width in shapes if batch == len(contexts))  # the batch's widest forward
            runs[rows is None] = answers, torch.stack(first), prefill
    finally:
        hook.remove()
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], atol=1e-4, rtol=1e-4)
    # the plain call ran every row past the shared prefix; the reusing one only what follows each row's c0
    assert runs[False][2] == max(len(c) - n for c, n in zip(contexts, reused)) < runs[True][2] - 50
    # in batches of 4 (the rows follow their contexts into each batch)
    assert generate(model, tok, contexts, max_new_tokens=6, do_sample=False, cached=kept, batch_size=4) == runs[True][0]
    calls = []
    original = generation._filled_cache
    try:
        generation._filled_cache = lambda *a: calls.append(a) or original(*a)
        generate(model, tok, contexts, max_new_tokens=2, do_sample=False, cached=kept)
        assert len(calls) == 1
        short = [generation.CachedRow(r.tokens[:3], [k[:, :3] for k in r.keys], [v[:, :3] for v in r.values])
                 for r in kept[:2]]  # 2 rows × 3 tokens = 6 < MIN_REUSED
        assert generate(model, tok, contexts[:2], max_new_tokens=6, do_sample=False, cached=short) == runs[True][0][:2]
        assert len(calls) == 1
    finally:
        generation._filled_cache = original
    with pytest.raises(ValueError, match="cached holds rows for 2 contexts, not 6"):
        generate(model, tok, contexts, max_new_tokens=2, cached=kept[:2])


def test_kept_rows_take_each_rows_real_columns_and_the_answer_tokens_that_ran():
    """``_kept_rows`` by hand on a 1-layer cache whose entry at column j is j: row 0 is left-padded (its context in
    columns 2–4), row 1 fills columns 0–4; 3 new tokens, so 2 steps ran a forward (columns 5 and 6). Row 0 stopped
    at EOS after 1 token (its column 6 holds a pad step's), row 1 ran all 3 (the last one's never ran)."""
    from types import SimpleNamespace

    from fedspear.runtime.generation import _kept_rows

    keys = torch.arange(7.0).view(1, 1, 7, 1).expand(2, 1, 7, 1).clone()  # [B, KV, L, D]
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=keys, values=-keys)])
    rows = _kept_rows(cache, [[7, 8, 9], [1, 2, 3, 4, 5]], [np.array([2, 3, 4]), np.arange(5)], [[0], [10, 11, 12]], 2)
    assert [r.tokens for r in rows] == [(7, 8, 9, 0), (1, 2, 3, 4, 5, 10, 11)]
    assert rows[0].keys[0].flatten().tolist() == [2, 3, 4, 5]
    assert rows[0].values[0].flatten().tolist() == [-2, -3, -4, -5]
    assert rows[1].keys[0].flatten().tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_a_cache_of_other_layer_kinds_keeps_no_rows(tiny, arc_items, monkeypatch):
    """Where the model's cache is not plain per-layer keys and values (``preallocated_cache`` None: sliding windows,
    shared layers), nothing is kept (None per context) and the answers are as usual."""
    from fedspear.runtime import generation

    model, tok = tiny
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    plain = generation.generate(model, tok, contexts, max_new_tokens=4, do_sample=False)
    monkeypatch.setattr(generation, "preallocated_cache", lambda model, capacity: None)
    kept: list = []
    assert generation.generate(model, tok, contexts, max_new_tokens=4, do_sample=False, keep=kept) == plain
    assert kept == [None] * len(contexts)


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


def test_first_logits_come_from_the_first_step_without_keeping_every_steps_logits(tiny, arc_items, monkeypatch):
    """``first_logits`` with a plain generation config: copied by a processor that runs first — bit for bit what
    ``output_logits`` gives (that way forced), sampled or greedy — and ``generate`` is not asked to keep every
    step's logits. Under a repetition penalty (a processor transformers runs before the caller's) the logits read
    are still the raw ones: a first processor would see penalised ones."""
    import copy

    from fedspear.runtime import generation

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items[:6]]
    asked: list = []
    real_generate = model.generate

    def spy(**kwargs):
        asked.append(kwargs["output_logits"])
        out = real_generate(**kwargs)
        assert out.scores is None and out.attentions is None  # nor every step's scores, whatever the config says
        return out

    monkeypatch.setattr(model, "generate", spy)

    def run(**kwargs) -> tuple[list, torch.Tensor]:
        first: list = []
        kwargs = {"do_sample": False, **kwargs}
        answers = generation.generate(model, tok, contexts, max_new_tokens=4, batch_size=4, first_logits=first,
                                      **kwargs)
        return answers, torch.stack(first)  # [6, V]

    model.generation_config.output_scores = True  # kept per step by return_dict_in_generate, unless turned off
    assert generation.first_processor_sees_raw_logits(model)
    copied = run()
    assert asked == [False, False]  # 2 batches, neither keeping every step's logits
    torch.manual_seed(0)
    sampled = run(do_sample=True)
    assert asked[-2:] == [False, False] and torch.equal(sampled[1], copied[1])  # the sampler runs after the copy
    with monkeypatch.context() as m:
        m.setattr(generation, "first_processor_sees_raw_logits", lambda model: False)
        kept = run()
    assert asked[-2:] == [True, True] and kept[0] == copied[0] and torch.equal(kept[1], copied[1])

    model.generation_config.repetition_penalty = 1.5
    assert not generation.first_processor_sees_raw_logits(model)
    penalised_config = run()
    assert asked[-2:] == [True, True]
    assert torch.equal(penalised_config[1], copied[1])  # raw: the penalty is not in them
    with monkeypatch.context() as m:
        m.setattr(generation, "first_processor_sees_raw_logits", lambda model: True)
        assert not torch.allclose(run()[1], copied[1], atol=1e-3)  # a copy after the penalty would differ


def test_first_columns_keep_only_those_logits_on_the_host(tiny, arc_items, monkeypatch):
    """``first_columns``: each context's chosen columns of its first-step logits, as a float32 CPU tensor — equal to
    the full row at those columns, whichever way the row was read (copied first, or from ``output_logits``), with
    rows of a batch asking for different numbers of columns; a columns list of the wrong length is refused."""
    from fedspear.runtime import generation

    model, tok = tiny
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items[:5]]
    columns = [[3, 7, 1], [0], [5, 5, 9, 2], [11, 4], [6, 8, 10]]
    rows: list = []
    generation.generate(model, tok, contexts, max_new_tokens=2, do_sample=False, batch_size=3, first_logits=rows)
    for raw in (True, False):
        with monkeypatch.context() as m:
            m.setattr(generation, "first_processor_sees_raw_logits", lambda model: raw)
            kept: list = []
            generation.generate(model, tok, contexts, max_new_tokens=2, do_sample=False, batch_size=3,
                                first_logits=kept, first_columns=columns)
        assert len(kept) == len(contexts)
        for got, row, cols in zip(kept, rows, columns):
            assert got.device.type == "cpu" and got.dtype == torch.float32 and got.shape == (len(cols),)
            assert torch.equal(got, row[cols].cpu())
    none: list = []  # a batch whose rows keep no column at all
    generation.generate(model, tok, contexts[:2], max_new_tokens=2, do_sample=False, first_logits=none,
                        first_columns=[[], []])
    assert [t.shape for t in none] == [(0,), (0,)]
    with pytest.raises(ValueError, match="columns for 4 contexts, not 5"):
        generation.generate(model, tok, contexts, max_new_tokens=2, do_sample=False, first_logits=[],
                            first_columns=columns[:4])


def test_which_generation_configs_leave_the_first_processor_the_raw_logits(tiny):
    """Token ids and sampling settings add no processor to a generate call that does not sample, nor do a
    repetition penalty of 1, an n-gram size or minimum length of 0; a real repetition penalty, a minimum length or
    suppressed tokens do, and so would any setting not known to be plain."""
    import copy

    from fedspear.runtime.generation import first_processor_sees_raw_logits

    model, _ = tiny
    assert first_processor_sees_raw_logits(model)
    for setting, value, raw in [("temperature", 0.7, True), ("top_p", 0.8, True), ("top_k", 20, True),
                                ("repetition_penalty", 1.1, False), ("min_new_tokens", 3, False),
                                ("suppress_tokens", [5], False), ("no_repeat_ngram_size", 2, False),
                                ("repetition_penalty", 1.0, True), ("no_repeat_ngram_size", 0, True),
                                ("min_new_tokens", 0, True), ("guidance_scale", 1.0, True)]:
        other = copy.deepcopy(model)
        setattr(other.generation_config, setting, value)
        assert first_processor_sees_raw_logits(other) is raw, setting


def test_a_failed_generate_puts_the_training_mode_back(tiny, arc_items, monkeypatch):
    """``generate`` decodes in eval mode and restores the caller's mode, also when decoding raises."""
    import copy

    from fedspear.runtime import generation

    model, tok = tiny
    model = copy.deepcopy(model)
    model.train()

    def fail(**kwargs):
        assert not model.training
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(model, "generate", fail)
    with pytest.raises(RuntimeError, match="decoding failed"):
        generation.generate(model, tok, [render(tok, [arc_challenge.prompt(arc_items[0])])], max_new_tokens=2)
    assert model.training
