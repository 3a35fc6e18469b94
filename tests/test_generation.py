"""Batched generation: the shared prompt prefix computed once gives the same answers as plain generation."""

from __future__ import annotations

import torch
from helpers import with_random_adapter

from fedspear.interaction import render
from fedspear.tasks import arc_challenge


def test_shared_prefix_length():
    from fedspear.generation import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # each context keeps one token of its own
    assert shared_prefix_length([[7], [7, 8]]) == 0
    assert shared_prefix_length([[1, 2], [3, 2]]) == 0
    assert shared_prefix_length([]) == 0


def test_generation_with_the_shared_prefix_cached_matches_plain_generation(tiny, arc_items):
    """Greedy answers and first-step logits are those of plain left-padded generation when the shared prompt prefix
    is run once and its KV cache handed to every row (rows of different lengths, a non-identity adapter)."""
    import copy

    from fedspear.generation import generate

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
