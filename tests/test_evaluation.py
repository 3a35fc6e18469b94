"""Held-out evaluation on a tiny random model: log-likelihood and generation accuracy, item order, batching."""

from __future__ import annotations

import pytest
import torch
from helpers import with_random_adapter

from fedspear.interaction import render
from fedspear.tasks import arc_challenge


def test_loglik_from_generation_equals_a_separate_forward(tiny, arc_items):
    """Log-likelihood scoring reuses generation's first-step logits; they must equal one plain forward per item."""
    from fedspear.evaluation import evaluate, label_token_ids, loglik_predictions
    from fedspear.runtime.generation import generate

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
    assert ev["correct_ll"] == only_ll["correct_ll"] and "acc_gen" in ev and "acc_gen" not in only_ll  # item by item


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
    # per-item outcomes: one character per item scored, in order, agreeing with the accuracies
    assert len(part["correct_ll"]) == len(arc_items) and len(part["correct_gen"]) == k
    assert part["correct_ll"] == whole["correct_ll"] and part["correct_gen"] == head["correct_gen"]
    for ev in (part, whole, head):
        for metric in ("ll", "gen"):
            assert ev[f"correct_{metric}"].count("1") / len(ev[f"correct_{metric}"]) == ev[f"acc_{metric}"]
    assert {key: v for key, v in part.items() if key.startswith("pred_")} == {
        key: v for key, v in head.items() if key.startswith("pred_")}


def test_the_evaluation_records_the_batch_it_decoded_at(tiny, arc_items, monkeypatch):
    """``batch_size = "auto"`` decodes 32 answers at a time on a CPU (``eval_batch_rows``), a number as many as it
    says; the evaluation returns the batch its generation was given."""
    from fedspear import evaluation

    model, tok = tiny
    given = []

    def spy(*args, **kwargs):
        given.append(kwargs["batch_size"])
        return generate(*args, **kwargs)

    generate = evaluation.generate
    monkeypatch.setattr(evaluation, "generate", spy)
    auto = evaluation.evaluate(model, tok, arc_items, arc_challenge, batch_size="auto", max_new_tokens=2)
    three = evaluation.evaluate(model, tok, arc_items, arc_challenge, batch_size=3, max_new_tokens=2)
    assert given == [32, 3] and (auto["batch_size"], three["batch_size"]) == (32, 3)
    only_ll = evaluation.evaluate(model, tok, arc_items, arc_challenge, generation=False)
    assert "batch_size" not in only_ll and given == [32, 3]  # no generation, no batch of answers


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


def test_prefix_cache_logits_equal_a_plain_forward_per_item(tiny, arc_items):
    """Reusing the shared prompt prefix's KV cache (right-padded tails) gives each item's plain next-token logits."""
    import copy

    from fedspear.evaluation import next_token_logits, shared_prefix_length

    model, tok = tiny
    model = with_random_adapter(copy.deepcopy(model), 0.5)  # a non-identity adapter, so the LoRA path counts too
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in arc_items]
    assert shared_prefix_length(contexts) > 10  # the chat template and instruction are shared
    assert len({len(c) for c in contexts}) > 1  # and the tails need padding
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([c])).logits[0, -1].float() for c in contexts])
    for reuse in (True, False):
        for batch_size in (1, 3):
            got = next_token_logits(model, tok, contexts, batch_size=batch_size, reuse_prefix=reuse)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    columns = [[i % 7, 100 + i, 3][: 1 + i % 3] for i in range(len(contexts))]  # per item the ids to keep: 1–3
    kept = next_token_logits(model, tok, contexts, batch_size=3, columns=columns)
    full = next_token_logits(model, tok, contexts, batch_size=3)  # [N, V]
    assert len(kept) == len(contexts)
    assert all(torch.equal(k, full[i, c].cpu()) and k.shape == (len(c),) and k.device.type == "cpu"
               for i, (k, c) in enumerate(zip(kept, columns)))
    assert next_token_logits(model, tok, [], columns=[]) == []
    with pytest.raises(ValueError, match="columns for 2 contexts, not 3"):
        next_token_logits(model, tok, contexts[:3], columns=columns[:2])


def test_wilson_interval_by_hand_and_always_holds_the_proportion():
    """The 95% Wilson interval (z = 1.959964): 1/4 → (0.0456, 0.6994) and 4/4 → (0.5101, 1) as in the usual tables;
    for every n ≤ 300 and every count the interval holds correct / n — in floats the formula's upper bound at 4/4 is
    0.9999999999999999, which once gave a negative error bar and failed a run at its plot (CI, 2026-11-27)."""
    from fedspear.evaluation import wilson_interval

    assert wilson_interval(1, 4) == pytest.approx((0.045587, 0.699358), abs=1e-6)
    assert wilson_interval(4, 4) == (pytest.approx(0.510109, abs=1e-6), 1.0)
    assert wilson_interval(0, 4) == (0.0, pytest.approx(0.489891, abs=1e-6))
    assert wilson_interval(0, 0) == (0.0, 1.0)
    for n in range(1, 301):
        for correct in range(n + 1):
            low, high = wilson_interval(correct, n)
            assert 0.0 <= low <= correct / n <= high <= 1.0, (correct, n)


def test_accuracy_plot_draws_a_bound_a_hair_inside_the_proportion(tmp_path):
    """A run recorded before the interval was held at p (acc 1.0, high 0.9999999999999999) still gets its plots."""
    from fedspear.report import plot_run

    ev = {"acc_gen": 1.0, "acc_gen_low": 0.51, "acc_gen_high": 0.9999999999999999,
          "acc_ll": 0.0, "acc_ll_low": 1e-17, "acc_ll_high": 0.49}
    later = {"round": 1, "eval": ev, "wins": 4, "losses": 0, "revisions_successful": 0, "wall_clock": 60.0}
    written = plot_run(tmp_path, [{"round": 0, "eval": ev, "wall_clock": 30.0}, later])
    assert (tmp_path / "plots" / "accuracy.png") in written and (tmp_path / "plots" / "accuracy.png").stat().st_size > 0
