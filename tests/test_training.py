"""Phase 1 and Phase 2 on a tiny random model: win/lose bookkeeping, batch layout, one round of training.

No Flower here: the core must run without it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from fedspear import losses as L
from fedspear.interaction import Trace, interact, render
from fedspear.model import get_adapter, set_adapter
from fedspear.tasks import arc_challenge
from fedspear.training import TrainSettings, completion_logprobs, local_train, pack


def test_interaction_builds_win_and_lose_sets_as_in_alg1(tiny, arc_items, scripted):
    """Alg. 1: item 0 right at once → win (c0, y0); item 1 wrong then right at revision 1 → win (c0, y1) and
    lose (c0, y0, α = 1); item 2 wrong at y0, y1, y2 → lose (c0, y0, α = 0.5). Revisions tried: 1 + 2 = 3."""
    model, tok = tiny
    items = arc_items[:3]
    script = {items[0].uid: [True], items[1].uid: [False, True], items[2].uid: [False, False, False]}
    fb = scripted(script)
    res = interact(model, tok, items, arc_challenge, fb, max_revisions=2, max_new_tokens=4, seed=1)
    c = res.counters
    assert (c["prompts"], c["initial_correct"], c["revisions_attempted"], c["revisions_successful"]) == (3, 1, 3, 1)
    assert c["generations"] == 3 + 2 + 1  # y0 for all, then 2 pending, then 1 pending
    assert fb.feedback_calls == 3
    assert [w.uid for w in res.wins] == [items[0].uid, items[1].uid]
    assert sorted((l.uid, l.alpha) for l in res.losses) == sorted([(items[1].uid, 1.0), (items[2].uid, 0.5)])
    c0 = render(tok, [arc_challenge.prompt(items[1])])
    win1 = res.wins[1]
    assert win1.prompt_ids == c0  # the revised answer is learnt from the *original* context
    lose1 = next(l for l in res.losses if l.uid == items[1].uid)
    assert lose1.prompt_ids == c0
    assert all(1 <= len(t.completion_ids) <= 4 for t in res.wins + res.losses)
    assert c["tokens_generated"] > 0 and c["seconds_generate_initial"] > 0


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


def test_completion_logprobs_match_an_unpadded_full_forward(tiny):
    """The windowed, left-padded log-probs equal log_softmax of a plain forward over each sequence alone."""
    model, _ = tiny
    model.eval()
    traces = [Trace("a", [5, 6, 7, 8], [9, 10, 11], True), Trace("b", [12], [13, 14], False)]
    batch = pack(traces, pad_id=0)
    got = completion_logprobs(model, batch, "fp32")  # [2, 3]
    for row, t in enumerate(traces):
        ids = torch.tensor([t.prompt_ids + t.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # [n, V]
        n_c = len(t.completion_ids)
        ref = torch.log_softmax(logits[-n_c - 1 : -1].float(), -1).gather(-1, torch.tensor(t.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(got[row, -n_c:], ref, atol=1e-4, rtol=1e-4)


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
    stats = local_train(model, tok, res.wins, losses, TrainSettings(local_steps=2, batch_size=3, mu=0.01), lr=1e-2, seed=0)
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


def test_core_runs_without_flower():
    """Habit 4 of STYLE.md: only fedspear.fl imports flwr."""
    code = ("import sys, fedspear.client, fedspear.training, fedspear.interaction, fedspear.evaluation, "
            "fedspear.aggregation, fedspear.losses, fedspear.rundir, fedspear.report, fedspear.validation, "
            "fedspear.server_opt, fedspear.baseline_losses, fedspear.bench; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flwr', 'flwr_datasets')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loglik_from_generation_equals_a_separate_forward(tiny, arc_items):
    """Log-likelihood scoring reuses generation's first-step logits; they must equal one plain forward per item."""
    from fedspear.evaluation import evaluate, label_token_ids, loglik_predictions
    from fedspear.interaction import generate

    model, tok = tiny
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    first: list = []
    generate(model, tok, contexts, max_new_tokens=2, do_sample=False, first_logits=first)
    for ctx, logits in zip(contexts, first):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    from_generation = [ex.labels[int(l[label_token_ids(tok, ex.labels)].argmax())] for l, ex in zip(first, arc_items)]
    assert from_generation == loglik_predictions(model, tok, arc_items, arc_challenge)
    ev = evaluate(model, tok, arc_items, arc_challenge, generation=True)
    only_ll = evaluate(model, tok, arc_items, arc_challenge, generation=False)
    assert ev["acc_ll"] == only_ll["acc_ll"] and "acc_gen" in ev and "acc_gen" not in only_ll


def test_generation_on_a_subset_log_likelihood_on_all(tiny, arc_items):
    """eval_gen_size: generation answers the first k items only, log-likelihood still scores every item."""
    from fedspear.evaluation import evaluate

    model, tok = tiny
    k = len(arc_items) // 2
    whole = evaluate(model, tok, arc_items, arc_challenge, generation=True, max_new_tokens=3)
    part = evaluate(model, tok, arc_items, arc_challenge, generation=True, max_new_tokens=3, generation_size=k)
    head = evaluate(model, tok, arc_items[:k], arc_challenge, generation=True, max_new_tokens=3)
    assert part["n"] == len(arc_items) and part["n_gen"] == k and "n_gen" not in whole
    assert part["acc_ll"] == whole["acc_ll"]  # every item scored, half from the generation prefill
    assert part["acc_gen"] == head["acc_gen"] and part["parsed_gen"] == head["parsed_gen"]
    assert {key: v for key, v in part.items() if key.startswith("pred_")} == {
        key: v for key, v in head.items() if key.startswith("pred_")}


def test_length_sorted_loglik_batches_keep_the_item_order(tiny):
    """Batches are formed by prompt length; each prediction still belongs to its own item. A stand-in model
    prefers the label given by the prompt's real length (mod 4), so any mix-up of rows changes the answers."""
    from types import SimpleNamespace

    from fedspear.evaluation import label_token_ids, loglik_predictions
    from fedspear.tasks import arc_challenge as arc

    _, tok = tiny
    label_ids = label_token_ids(tok, ["A", "B", "C", "D"])

    class Cache:  # stands in for the prefix's KV cache
        def batch_repeat_interleave(self, n):
            pass

    class Decoder(torch.nn.Module):  # hidden state at each position: one-hot of how many real tokens it has seen
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            seen = attention_mask.cumsum(1)[:, -input_ids.shape[1]:]  # [B, S]
            hidden = torch.nn.functional.one_hot(seen % 4, 4).float()  # [B, S, 4]
            return SimpleNamespace(last_hidden_state=hidden, past_key_values=Cache() if use_cache else None)

    class LengthModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder, self.head = Decoder(), torch.nn.Linear(4, len(tok), bias=False)
            self.head.weight.data.zero_()
            for k, label in enumerate(label_ids):
                self.head.weight.data[label, k] = 1.0

        def get_decoder(self):
            return self.decoder

        def get_output_embeddings(self):
            return self.head

    items = [ex for ex in arc.load("train") if tuple(ex.labels) == ("A", "B", "C", "D")][:24]
    lengths = [len(render(tok, [arc.prompt(ex)])) for ex in items]
    assert lengths != sorted(lengths)  # the sort really reorders
    expected = ["ABCD"[n % 4] for n in lengths]
    assert len(set(expected)) > 1
    for batch_size in (1, 5, 32):
        for reuse in (True, False):
            assert loglik_predictions(LengthModel(), tok, items, arc, batch_size=batch_size,
                                      reuse_prefix=reuse) == expected


def test_shared_prefix_length():
    from fedspear.evaluation import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # each context keeps one token of its own
    assert shared_prefix_length([[7], [7, 8]]) == 0
    assert shared_prefix_length([[1, 2], [3, 2]]) == 0
    assert shared_prefix_length([]) == 0


def test_prefix_cache_logits_equal_a_plain_forward_per_item(tiny, arc_items):
    """Reusing the shared prompt prefix's KV cache (right-padded tails) gives each item's plain next-token logits."""
    from fedspear.evaluation import next_token_logits, shared_prefix_length

    import copy

    model, tok = tiny
    model = copy.deepcopy(model)  # a non-identity adapter, so the LoRA path counts too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    assert shared_prefix_length(contexts) > 10  # the chat template and instruction are shared
    assert len({len(c) for c in contexts}) > 1  # and the tails need padding
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([c])).logits[0, -1].float() for c in contexts])
    for reuse in (True, False):
        for batch_size in (1, 3):
            got = next_token_logits(model, tok, contexts, batch_size=batch_size, reuse_prefix=reuse)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
