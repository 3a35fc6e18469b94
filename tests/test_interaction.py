"""Phase 1 (paper Alg. 1 lines 3–25) on a tiny random model: the win and lose sets and their counters."""

from __future__ import annotations

from fedspear import interaction
from fedspear.interaction import interact, render
from fedspear.tasks import arc_challenge


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


def test_revisions_reuse_the_kv_cache_of_the_prompts_they_revise(tiny, arc_items, scripted, monkeypatch):
    """The initial call keeps each prompt's KV cache (c0 ‖ y0); each revision call gets, for every pending prompt in
    order, that prompt's row, whose tokens begin its revision context with c0 (all but possibly c0's last token,
    which the template may merge with the answer that follows). Prompts answered right drop out."""
    from fedspear.runtime.generation import reusable_length

    model, tok = tiny
    items = arc_items[:4]
    script = {items[0].uid: [True], items[1].uid: [False, True], items[2].uid: [False, False, False],
              items[3].uid: [False, False, True]}
    calls = []
    generate = interaction.generate

    def spy(model, tokenizer, contexts, **kwargs):
        answers = generate(model, tokenizer, contexts, **kwargs)
        calls.append((contexts, kwargs.get("keep"), kwargs.get("cached")))
        return answers

    monkeypatch.setattr(interaction, "generate", spy)
    res = interact(model, tok, items, arc_challenge, scripted(script), max_revisions=2, max_new_tokens=4, seed=1)
    assert res.counters["revisions_attempted"] == 3 + 2
    (c0, kept, none), (first, _, rows1), (second, _, rows2) = calls
    assert none is None and len(kept) == 4 and [len(c) for c in (first, second)] == [3, 2]
    assert [id(r) for r in rows1] == [id(r) for r in kept[1:]]  # items 1, 2, 3 pending
    assert [id(r) for r in rows2] == [id(r) for r in kept[2:]]  # then 2 and 3
    for contexts, rows, pending in ((first, rows1, [1, 2, 3]), (second, rows2, [2, 3])):
        for context, row, i in zip(contexts, rows, pending):
            assert row.tokens[: len(c0[i])] == tuple(c0[i])
            assert reusable_length(context, row) >= len(c0[i]) - 1
    without = interact(model, tok, items, arc_challenge, scripted(script), max_revisions=0, max_new_tokens=4, seed=1)
    assert without.counters["revisions_attempted"] == 0 and calls[3][1] is None  # nothing kept without revisions
