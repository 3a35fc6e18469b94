"""Phase 1 and Phase 2 on a tiny random model: win/lose bookkeeping, batch layout, one round of training.

No Flower here: the core must run without it.
"""

from __future__ import annotations

import math
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



def with_random_adapter(model, scale: float = 0.5):
    """``model`` (a peft model) with its LoRA B matrices set to N(0, scale²) in place, so the adapter path counts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * scale)
    return model

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
    # per-item outcomes: one character per item scored, in order, agreeing with the accuracies
    assert len(part["correct_ll"]) == len(arc_items) and len(part["correct_gen"]) == k
    assert part["correct_ll"] == whole["correct_ll"] and part["correct_gen"] == head["correct_gen"]
    for ev in (part, whole, head):
        for metric in ("ll", "gen"):
            assert ev[f"correct_{metric}"].count("1") / len(ev[f"correct_{metric}"]) == ev[f"acc_{metric}"]
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


def test_fast_dropout_has_dropouts_distribution():
    """FastDropout: zeroes a share p of elements (within 5 σ), scales the rest so the mean is kept (1/(1 − p_eff),
    p_eff = round(p·2¹⁶)/2¹⁶), is the identity in eval mode or at p = 0, repeats under the same seed, passes the
    gradient through the same mask, and draws independent masks for odd sizes too."""
    from fedspear.model import FastDropout

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


def test_add_lora_draws_dropout_with_fast_dropout():
    from fedspear.model import LoraSettings, add_lora, tiny_model

    kinds = lambda m: {type(d).__name__ for mod in m.modules() if isinstance(getattr(mod, "lora_dropout", None),
                                                                             torch.nn.ModuleDict)
                       for d in mod.lora_dropout.values()}
    assert kinds(add_lora(tiny_model(seed=0)[0], LoraSettings(r=4, alpha=8, dropout=0.1))) == {"FastDropout"}
    assert kinds(add_lora(tiny_model(seed=0)[0], LoraSettings(r=4, alpha=8, dropout=0.0))) == {"Identity"}


def test_bf16_linear_weights_give_autocasts_outputs_and_gradients_bitwise():
    """Storing the linears' weights in bf16 is what bf16 autocast computes with anyway: same logits, same LoRA
    gradients, bit for bit; embeddings stay fp32 and the tied output embedding gets its own bf16 copy."""
    from fedspear.model import LoraSettings, add_lora, autocast, store_linear_weights_bf16, tiny_model

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


def test_generation_with_the_shared_prefix_cached_matches_plain_generation(tiny, arc_items):
    """Greedy answers and first-step logits are those of plain left-padded generation when the shared prompt prefix
    is run once and its KV cache handed to every row (rows of different lengths, a non-identity adapter)."""
    import copy

    from fedspear.interaction import generate

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


def test_decode_attention_is_sdpa_in_fp32_for_one_query_row():
    """A decode step's attention (one query row, grouped query heads, padding mask) equals transformers' SDPA in
    fp32; under bf16 autocast it stays fp32 (closer to the fp32 result than bf16 SDPA); longer queries are SDPA's."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fedspear.model import decode_attention_forward

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

    from fedspear.interaction import generate
    from fedspear.model import DECODE_ATTENTION, load_base

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


def test_bench_flop_counts_by_hand():
    """The tiny Llama (hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16, tied 49152-row embedding) with
    LoRA r 4 on all seven projections, counted by hand."""
    from fedspear.bench import flop_counts, prefill_flops, train_flops
    from fedspear.model import LoraSettings, add_lora, tiny_model

    base, tok = tiny_model(seed=0)
    assert len(tok) == 49152
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1))
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64  # q, o; k, v; gate, up, down; two norms
    lora_per_layer = (4 * 64 + 64 * 4) * 2 + (4 * 64 + 32 * 4) * 2 + (4 * 64 + 128 * 4) * 2 + (4 * 128 + 64 * 4)
    counts = flop_counts(model)
    assert counts == {"body": 2 * per_layer + 64, "head": 49152 * 64, "lora": 2 * lora_per_layer, "layers": 2,
                      "width": 64}
    assert counts["body"] == 74_048 and counts["lora"] == 8_192
    # 2 rows × 10 tokens, logits at the last position: 2·(body + lora)·20 + 2·head·2 + 2·layers·width·10·20
    assert prefill_flops(counts, 2, 10) == 2 * 82_240 * 20 + 2 * 3_145_728 * 2 + 2 * 2 * 64 * 10 * 20 == 15_923_712
    assert train_flops(counts, 2, 10, 1) == 2 * 15_923_712 + 2 * 8_192 * 20


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
