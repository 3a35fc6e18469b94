"""Phase 1 (paper Alg. 1 lines 3–25) on a tiny random model: the win and lose sets and their counters."""

from __future__ import annotations



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
