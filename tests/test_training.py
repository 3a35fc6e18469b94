"""Phase 2 (paper Eqs. 4–7, Alg. 1 lines 26–31) on a tiny random model: batch layout, completion log-probabilities,
one round of local training, non-finite steps, length buckets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import with_random_adapter

from fedspear import losses as L
from fedspear.interaction import Trace, interact, render
from fedspear.runtime.model import get_adapter, set_adapter
from fedspear.tasks import arc_challenge
from fedspear.training import (TrainSettings, completion_logprobs, local_train, pack, pair_margin,
                               shared_context_logprobs)


def test_pack_left_pads_so_completions_end_together():
    t1 = Trace("a", [1, 2, 3], [7, 8, 0], has_eos=True)
    t2 = Trace("b", [4], [9], has_eos=False)
    b = pack([t1, t2], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 7, 8, 0], [0, 0, 0, 0, 4, 9]]
    assert b.attention_mask.tolist() == [[1] * 6, [0, 0, 0, 0, 1, 1]]
    assert b.position_ids.tolist()[1][-2:] == [0, 1]
    assert b.labels.tolist() == [[7, 8, 0], [0, 4, 9]]  # masked columns keep prompt ids; the mask hides them
    assert b.completion_mask.tolist() == [[True, True, True], [False, False, True]]
    assert b.tail_base.tolist() == [[True, True, False], [False, False, True]]  # EOS excluded from the tail


def _alone_logprobs(model, t: Trace) -> torch.Tensor:
    """log p of ``t``'s completion tokens from a plain forward over the trace alone → ``[len(completion)]``."""
    ids = torch.tensor([t.prompt_ids + t.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]  # [n, V]
    n_c = len(t.completion_ids)
    completion = torch.tensor(t.completion_ids)[:, None]  # [n_c, 1]
    return torch.log_softmax(logits[-n_c - 1 : -1].float(), -1).gather(-1, completion)[:, 0]


def test_completion_logprobs_match_an_unpadded_full_forward(tiny):
    """The windowed, left-padded log-probs equal log_softmax of a plain forward over each sequence alone."""
    model, _ = tiny
    model.eval()
    traces = [Trace("a", [5, 6, 7, 8], [9, 10, 11], True), Trace("b", [12], [13, 14], False)]
    batch = pack(traces, pad_id=0)
    got = completion_logprobs(model, batch, "fp32")  # [2, 3]
    for row, t in enumerate(traces):
        torch.testing.assert_close(got[row, -len(t.completion_ids):], _alone_logprobs(model, t), atol=1e-4, rtol=1e-4)


def test_a_completion_without_a_token_before_it_is_refused(tiny):
    """A row whose completion fills it (no prompt token to predict its first token from) is a clear error, not the
    logits of wrong positions."""
    model, _ = tiny
    batch = pack([Trace("a", [], [9, 10, 11], False)], pad_id=0)
    with pytest.raises(ValueError, match="completion window of 3 tokens needs rows of more than 3 tokens"):
        completion_logprobs(model, batch, "fp32")


def test_pair_margin_is_eq8_averaged_over_the_pairs(tiny):
    """M_τ (Eq. 8) by hand from forwards over each trace alone: the win's mean log p over its completion (EOS
    included) minus the mean over the lose's last τ tokens (EOS excluded), averaged over the pairs; a win pairs with
    every loss of its context, and a loss without a win of its context is no pair."""
    model, _ = tiny
    model.eval()
    win_a = Trace("a", [5, 6, 7, 8], [9, 10, 11], True)
    win_b = Trace("b", [12], [13, 14], False)
    lose_a1 = Trace("a", [5, 6, 7, 8], [20, 21, 22, 23, 2], True, 0.5)
    lose_a2 = Trace("a", [5, 6, 7, 8], [30, 31], False, 0.5)
    lose_b = Trace("b", [12], [40, 41, 42], False, 0.5)
    lose_c = Trace("c", [50, 51], [52], False, 0.5)
    tau = 2
    alone = {id(t): _alone_logprobs(model, t) for t in (win_a, win_b, lose_a1, lose_a2, lose_b)}
    def expected(win, lose):
        tail = alone[id(lose)][: len(lose.completion_ids) - int(lose.has_eos)][-tau:]
        return float(alone[id(win)].mean() - tail.mean())
    want = np.mean([expected(win_a, lose_a1), expected(win_a, lose_a2), expected(win_b, lose_b)])
    got, pairs = pair_margin(model, [win_a, win_b], [lose_a1, lose_a2, lose_b, lose_c], 0, tau, "fp32")
    assert pairs == 3
    assert got == pytest.approx(want, abs=1e-4)
    assert pair_margin(model, [win_a], [lose_c], 0, tau, "fp32") == (pytest.approx(float("nan"), nan_ok=True), 0)


@pytest.fixture(scope="module")
def tiny_trained():
    """A tiny random Llama with a LoRA adapter whose B matrices are random (so the adapter counts) and dropout 0.1."""
    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model

    base, _ = tiny_model(seed=0)
    return with_random_adapter(add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1), seed=0))


@pytest.mark.parametrize("rows, forwards", [
    (16, [(3, 6), (5, 4), (1, 40), (1, 1)]),
    (2, [(2, 6), (2, 1), (1, 4), (3, 4), (1, 40), (1, 1)]),
    (1, [(1, 1), (1, 1), (1, 4), (3, 4), (1, 40), (1, 1)]),
])
def test_shared_context_logprobs_equal_a_forward_over_each_trace_alone(tiny_trained, rows, forwards):
    """Each distinct context runs once and its KV cache serves every completion of it (three traces of context
    ``a``, of different lengths, one with EOS; one of ``b``; an empty completion ``c``; a context ten times longer,
    ``d``): every trace's log-probs equal a plain forward over it alone in eval mode, in the order given, and the
    model is left in train mode as it came.

    The forwards, by hand: the contexts with their longest completion are 9, 3, 42 and 6 tokens, so ``d`` runs in a
    length bucket of its own (``length_buckets``: 3 · 9 + 42 < 4 · 42 · 0.9); in each bucket the contexts run
    (left padded to the longest) and then the completions but their last token (a one-token completion needs no
    second forward, an empty one none at all). ``rows`` traces at most per forward, a context's traces together:
    with 2, ``b`` and ``c`` share one and ``a`` takes its three; with 1, each context runs alone."""
    model = tiny_trained
    model.train()
    traces = [Trace("a", [5, 6, 7, 8], [9, 10, 11], True), Trace("b", [12], [13, 14], False),
              Trace("a", [5, 6, 7, 8], [20, 21, 22, 23, 2], True), Trace("a", [5, 6, 7, 8], [30], False),
              Trace("d", list(range(60, 100)), [101, 102], False), Trace("c", [40, 41, 42, 43, 44, 45], [], False)]
    calls = []
    hook = model.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                       with_kwargs=True)
    try:
        got = shared_context_logprobs(model, traces, 0, "fp32", rows=rows)
    finally:
        hook.remove()
    assert model.training
    assert [tuple(g.shape) for g in got] == [(3,), (2,), (5,), (1,), (2,), (0,)]
    assert [tuple(c) for c in calls] == forwards
    model.eval()
    for g, t in zip(got[:5], traces):
        torch.testing.assert_close(g, _alone_logprobs(model, t), atol=1e-5, rtol=1e-5)


def test_no_wins_means_no_local_steps(tiny):
    model, tok = tiny
    before = get_adapter(model)
    stats = local_train(model, tok, [], [Trace("x", [1, 2], [3], False, 0.5)], TrainSettings(), lr=1e-2)
    assert stats["steps"] == 0
    after = get_adapter(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_one_round_changes_every_lora_tensor_and_returns_copies(tiny, arc_items, always_right):
    """Two local steps (B starts at zero, so A's gradient is zero on the first step and moves on the second)."""
    model, tok = tiny
    start = get_adapter(model)
    res = interact(model, tok, arc_items, arc_challenge, always_right, max_new_tokens=4, seed=0)
    assert len(res.wins) == len(arc_items) and not res.losses
    losses = [Trace(w.uid, w.prompt_ids, w.completion_ids, w.has_eos, 0.5) for w in res.wins[:2]]
    stats = local_train(model, tok, res.wins, losses, TrainSettings(local_steps=2, batch_size=3, mu=0.01),
                        lr=1e-2, seed=0)
    assert stats["steps"] == 2 and stats["skipped_nonfinite"] == 0
    assert stats["margin_pairs"] == 2 and np.isfinite(stats["margin"])
    out = get_adapter(model)
    unchanged = [k for k in start if np.array_equal(start[k], out[k])]
    assert not unchanged, f"LoRA tensors that did not move: {unchanged[:3]}"
    # the reply holds copies: changing the live model afterwards leaves them as they were
    snapshot = {k: v.copy() for k, v in out.items()}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    assert all(np.array_equal(snapshot[k], out[k]) for k in out)
    set_adapter(model, start)  # leave the session fixture as it was


def test_nonfinite_gradient_skips_the_step(tiny, arc_items, always_right, monkeypatch):
    model, tok = tiny
    start = get_adapter(model)
    res = interact(model, tok, arc_items[:2], arc_challenge, always_right, max_new_tokens=3, seed=0)

    real = L.spear_loss

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(L, "spear_loss", nan_loss)
    stats = local_train(model, tok, res.wins, [], TrainSettings(local_steps=2), lr=1e-2)
    assert stats["skipped_nonfinite"] == 2 and stats["steps"] == 0
    after = get_adapter(model)
    assert all(np.array_equal(start[k], after[k]) for k in start)


























def test_length_buckets_by_hand():
    # lengths 10, 100, 12, 98: one batch computes 4 · 100 = 400 positions; split after the 2 shortest: 2·12 + 2·100
    from fedspear.training import length_buckets

    assert length_buckets([10, 100, 12, 98]) == [[0, 2], [3, 1]]
    assert length_buckets([100, 99, 100, 98]) == [[0, 1, 2, 3]]  # best split saves 0.5%: not worth a second forward
    assert length_buckets([50]) == [[0]] and length_buckets([]) == [[]]


def test_length_bucketed_logprobs_and_gradients_equal_one_padded_forward(tiny, arc_items):
    """Traces of very different lengths: the two-bucket forward gives the single left-padded forward's log-probs
    and LoRA gradients (rows back in batch order, completions right-aligned)."""
    import copy

    from fedspear.interaction import Trace
    from fedspear.training import completion_logprobs, length_buckets, pack

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.3)
    traces = []
    for i, ex in enumerate(arc_items[:4]):
        prompt = render(tok, [arc_challenge.prompt(ex)])
        prompt = prompt[: 12 + 40 * (i % 2)] if i < 2 else prompt  # two short rows, two long ones
        completion = tok.encode(" The answer is B", add_special_tokens=False)[: 2 + i]
        traces.append(Trace(ex.uid, prompt, completion, has_eos=False))
    batch = pack(traces, tok.pad_token_id)
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in traces]
    assert len(length_buckets(lengths)) == 2
    results = []
    for bucketed in (False, True):
        model.zero_grad(set_to_none=True)
        b = batch if bucketed else pack(traces, tok.pad_token_id).__class__(
            *[getattr(batch, f) for f in ("input_ids", "attention_mask", "position_ids", "labels", "completion_mask",
                                          "tail_base")])  # no traces: one forward
        logp = completion_logprobs(model, b, "fp32")  # [4, C]
        (logp * batch.completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), grads))
    mask = batch.completion_mask
    torch.testing.assert_close(results[1][0][mask], results[0][0][mask], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-4)
