"""The sampler draws from transformers' temperature → top-k → top-p distribution (``runtime.sampling``)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from fedspear.runtime.sampling import TOP_K, NucleusSampler, draw


def transformers_probs(scores: torch.Tensor, temperature: float, top_p: float, top_k: int | None = TOP_K
                       ) -> torch.Tensor:
    """[B, V] probabilities of transformers' own chain (what ``generate`` with ``do_sample`` samples from)."""
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    out = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k is not None:
        out = TopKLogitsWarper(top_k)(ids, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(ids, out)
    return out.softmax(-1)


def host_reads(fn, *args) -> tuple[object, int]:
    """``fn(*args)`` and how many device values it read on the host on the way (``aten._local_scalar_dense``:
    ``.item()``, ``bool()`` of a tensor; on a GPU each waits for the GPU). Reads made inside an ATen kernel (such as
    ``torch.multinomial``'s checks) do not pass through Python's dispatch and are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn(*args)
    return out, Count.reads


def sampler_probs(scores: torch.Tensor, sampler: NucleusSampler) -> torch.Tensor:
    """[B, V] probabilities of the sampler's kept tokens, scattered back to vocabulary positions."""
    logits, ids = sampler.kept(scores)
    return torch.zeros_like(scores).scatter_(-1, ids, logits.softmax(-1))


@pytest.mark.parametrize("sync_free", [False, True])  # the CPU's way (top 2k, widened) and the GPU's (whole row)
@pytest.mark.parametrize("temperature, top_p", [(0.8, 0.95), (1.0, 0.5), (0.3, 0.99), (1.3, 1.0)])
@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat (top-k binds) … peaked (top-p binds on a few tokens)
def test_the_kept_tokens_and_probabilities_are_transformers(temperature, top_p, spread, sync_free):
    torch.manual_seed(0)
    scores = torch.randn(16, 3000) * spread  # distinct values: no ties
    sampler = NucleusSampler(temperature, top_p, sync_free=sync_free)
    ours, theirs = sampler_probs(scores, sampler), transformers_probs(scores, temperature, top_p)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    if spread == 12.0 and top_p < 1:  # a case where the nucleus is narrower than top-k ...
        assert (theirs > 0).sum(-1).float().mean() < TOP_K / 2
    if spread == 0.5:  # ... and one where top-k binds: 50 kept, though the nucleus would hold more
        assert ((theirs > 0).sum(-1) <= TOP_K).all() and (theirs > 0).sum(-1).float().mean() > TOP_K * top_p - 5


@pytest.mark.parametrize("top_k", [None, 5, 3000])
def test_another_top_k_or_none_is_transformers_too(top_k):
    torch.manual_seed(2)
    scores = torch.randn(8, 3000) * 3
    sampler = NucleusSampler(0.8, 0.95, top_k)
    ours, theirs = sampler_probs(scores, sampler), transformers_probs(scores, 0.8, 0.95, top_k)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    if top_k == 5:
        assert ((ours > 0).sum(-1) <= 5).all()


def test_the_sampler_follows_the_models_generation_config(tiny):
    """transformers' default top-k 50 where the model's generation config sets none (the packaged models), the
    config's own top_k where it sets one (0: none), and no sampler where it sets a warper the sampler lacks."""
    import copy

    from fedspear.runtime.sampling import sampler_for

    model, _ = tiny
    model = copy.deepcopy(model)
    assert sampler_for(model, 0.8, 0.95).top_k == TOP_K
    model.generation_config.top_k = 20
    assert sampler_for(model, 0.8, 0.95).top_k == 20
    model.generation_config.top_k = 0
    assert sampler_for(model, 0.8, 0.95).top_k is None
    model.generation_config.min_p = 0.05
    assert sampler_for(model, 0.8, 0.95) is None


def test_ties_at_the_kth_value_are_all_kept_as_transformers_keeps_them():
    """bf16 logits tie often: transformers keeps every token ≥ the 50th largest, so more than 50 with a tie there —
    also when the tie runs past the 2k entries the sampler takes first (it widens)."""
    scores = torch.arange(1000, dtype=torch.float32).repeat(5, 1)  # row 0: distinct values
    scores[1, 900:960] = 955.0  # 40 values above 955 (960 … 999), 955 tied 60 times: the 50th largest, 100 kept
    scores[2, 700:960] = 955.0  # the same tied 260 times: 300 kept, past 2k = 100 and past 200
    scores[3, :] = 1.0  # all tied
    scores[4, :] = torch.linspace(0, 1, 1000).to(torch.bfloat16).float()  # bf16 rounding makes its own ties
    theirs = transformers_probs(scores, 1.0, 1.0)
    for sync_free in (False, True):  # widening the top 2k on the host, or the whole row
        (logits, ids), reads = host_reads(NucleusSampler(1.0, 1.0, sync_free=sync_free).kept, scores)
        ours = torch.zeros_like(scores).scatter_(-1, ids, logits.softmax(-1))
        assert (ours > 0).sum(-1).tolist() == (theirs > 0).sum(-1).tolist()
        assert (ours > 0).sum(-1)[:4].tolist() == [50, 100, 300, 1000]
        assert (ours > 0).sum(-1)[4] > 50
        assert torch.equal(ours > 0, theirs > 0)
        torch.testing.assert_close(ours, theirs)
        assert (reads == 0) if sync_free else (reads >= 2)  # rows 2 and 3 needed two widenings


def test_the_sync_free_draw_is_torch_multinomials_and_reads_nothing_on_the_host():
    """``draw`` is ``torch.multinomial(probs, 1)`` without its host-side checks: for the same seed the same index,
    bit for bit, in 40 cases (rows of the sampler's width and of a vocabulary, with impossible entries); and a
    sync-free step of the sampler reads no device value on the host, where the CPU's way reads one through Python's
    dispatch (the widening test; ``torch.multinomial``'s own reads happen inside ATen and are not counted here: the
    next test shows the sync-free way does not call it)."""
    for case in range(40):
        g = torch.Generator().manual_seed(case)
        logits = torch.randn(8, 100 if case % 2 else 20_000, generator=g) * (1 + case % 5)
        if case % 3 == 0:
            logits[:, logits.shape[1] // 2 :] = float("-inf")  # dropped tokens: probability 0
        probs = logits.softmax(-1)
        torch.manual_seed(case)
        expected = torch.multinomial(probs, 1)
        torch.manual_seed(case)
        assert torch.equal(draw(probs), expected)
    scores = torch.randn(4, 3000) * 3
    for sync_free, most in ((True, 0), (False, 1)):
        sampler = NucleusSampler(0.8, 0.95, sync_free=sync_free)
        out, reads = host_reads(sampler, None, scores)
        assert reads == most
        assert (torch.isfinite(out).sum(-1) == 1).all()
        sampler.check()  # finite scores: nothing to say


def test_the_sync_free_sampler_never_calls_multinomial(monkeypatch):
    """``torch.multinomial``'s own host reads happen inside ATen, out of ``host_reads``' sight: the sync-free way
    must not call it at all (here it would raise), where the CPU's way does."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.multinomial called")

    monkeypatch.setattr(torch, "multinomial", refuse)
    scores = torch.randn(4, 3000) * 3
    assert (torch.isfinite(NucleusSampler(0.8, 0.95, sync_free=True)(None, scores)).sum(-1) == 1).all()
    with pytest.raises(AssertionError, match="multinomial called"):
        NucleusSampler(0.8, 0.95, sync_free=False)(None, scores)


def test_nan_logits_are_an_error_both_ways():
    """NaN logits (a broken model): the CPU's way raises at once (``torch.multinomial``'s check); the sync-free
    sampler draws on and ``check`` — which ``generate`` calls after each batch — raises, once."""
    scores = torch.randn(4, 3000)
    scores[2, 7] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        NucleusSampler(0.8, 0.95, sync_free=False)(None, scores)
    sampler = NucleusSampler(0.8, 0.95, sync_free=True)
    sampler(None, scores[:2])
    sampler(None, scores)
    sampler(None, scores[:2])
    with pytest.raises(RuntimeError, match="contain NaN"):
        sampler.check()
    sampler.check()  # reported once


@pytest.mark.parametrize("sync_free", [False, True])
def test_draws_follow_the_kept_probabilities(sync_free):
    """Frequencies of 20,000 draws per row are within sampling error of the kept probabilities (and never outside the
    kept set)."""
    torch.manual_seed(1)
    scores = torch.randn(2, 500) * 4
    sampler = NucleusSampler(0.8, 0.9, sync_free=sync_free)
    expected = transformers_probs(scores, 0.8, 0.9)
    draws = 20_000
    counts = torch.zeros_like(scores)
    for _ in range(draws // 1000):
        out = sampler(None, scores.repeat_interleave(1000, 0))  # [2000, V]
        assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(2000, dtype=torch.long))
        tokens = out.argmax(-1).view(2, 1000)
        counts.scatter_add_(-1, tokens, torch.ones_like(tokens, dtype=counts.dtype))
    freq = counts / draws
    assert torch.equal(freq > 0, expected > 0) or bool(((freq > 0) <= (expected > 0)).all())
    sd = (expected * (1 - expected) / draws).sqrt()
    assert ((freq - expected).abs() <= 5 * sd + 1e-9).all()  # 5 standard errors per token
    assert (freq - expected).abs().sum(-1).max() < 0.05  # total variation distance below 2.5%


def test_a_draw_is_the_greedy_choice_of_the_processed_scores_and_the_seed_repeats_it():
    scores = torch.randn(8, 1000) * 2
    torch.manual_seed(3)
    first = NucleusSampler(0.8, 0.95)(None, scores)
    torch.manual_seed(3)
    again = NucleusSampler(0.8, 0.95)(None, scores)
    assert torch.equal(first, again)
    assert (first.argmax(-1) == first.isfinite().nonzero()[:, 1]).all()
    assert (first.max(-1).values == 0).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0, top_p=0.9), "temperature"), (dict(temperature=0.8, top_p=0.0), "top_p"),
    (dict(temperature=0.8, top_p=1.5), "top_p"), (dict(temperature=0.8, top_p=0.9, top_k=0), "top_k"),
    (dict(temperature=0.8, top_p=0.9, top_k=2.5), "top_k"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NucleusSampler(**kwargs)


def test_generate_samples_with_it_and_answers_stay_in_the_kept_set(tiny, arc_items, monkeypatch):
    """``generate(do_sample=True)`` draws every token through the sampler (counted: one call per decode step): with
    top-p tiny, each token is the argmax (the nucleus holds only the largest), so sampling equals greedy decoding;
    with the defaults, the seed repeats the answers. A model whose generation config asks for another warper samples
    through transformers' chain instead (the sampler is not called)."""
    import copy

    from fedspear.interaction import render
    from fedspear.runtime import sampling
    from fedspear.runtime.generation import generate
    from fedspear.tasks import arc_challenge

    calls = []
    draw = sampling.NucleusSampler.__call__
    monkeypatch.setattr(sampling.NucleusSampler, "__call__",
                        lambda self, ids, scores: calls.append(scores.shape) or draw(self, ids, scores))
    model, tok = tiny
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items[:4]]
    greedy = generate(model, tok, contexts, max_new_tokens=8, do_sample=False, batch_size=4)
    assert calls == []
    assert generate(model, tok, contexts, max_new_tokens=8, do_sample=True, top_p=1e-6, batch_size=4) == greedy
    assert len(calls) == max(map(len, greedy)) and calls[0][0] == 4
    torch.manual_seed(7)
    first = generate(model, tok, contexts, max_new_tokens=8, do_sample=True)
    torch.manual_seed(7)
    assert generate(model, tok, contexts, max_new_tokens=8, do_sample=True) == first
    assert first != greedy
    other = copy.deepcopy(model)
    other.generation_config.min_p = 0.05
    calls.clear()
    assert len(generate(other, tok, contexts, max_new_tokens=8, do_sample=True)) == 4 and calls == []


def test_the_cost_script_times_both_samplers(tmp_path):
    """``scripts/sampling_cost.py`` (its figures are in the sampler's docstring) runs and writes a row per shape."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sampling_cost.py"
    out = tmp_path / "sampling.json"
    proc = subprocess.run([sys.executable, str(script), "--batches", "2", "4", "--vocab", "1000", "--repeats", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["vocab"]) for r in rows] == [(2, 1000), (4, 1000)]
    assert all(r["transformers_ms"] > 0 and r["fedspear_ms"] > 0 for r in rows)
    assert "transformers" in proc.stdout and "fedspear" in proc.stdout
