"""The noisy simulated user (issue: the paper's stated limitation): verdict flips with probability p, irrelevant hints
with probability q, seeded and consistent; selectable in runs and compare grids."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fedspear.experiments.compare.grid import Grid
from fedspear.config import ConfigError, RunConfig
from fedspear.feedback import IRRELEVANT_HINTS, NoisyFeedback, OracleFeedback, make_feedback
from fedspear.tasks import get_task

ARC = get_task("arc_challenge")


@pytest.fixture(scope="module")
def items():
    return ARC.load("train")[:200]


def wrong_label(ex) -> str:
    return next(label for label in ex.labels if label != ex.gold)


def answers(items):
    """Each item answered right and wrong: 400 (example, completion) pairs with a known true verdict."""
    for ex in items:
        yield ex, f"The answer is {ex.gold}.", True
        yield ex, f"The answer is {wrong_label(ex)}.", False


def test_p_and_q_zero_is_the_exact_oracle(items):
    assert isinstance(make_feedback(ARC), OracleFeedback)
    quiet = NoisyFeedback(ARC, 0.0, 0.0, seed=3)
    oracle = OracleFeedback(ARC)
    for ex, completion, truth in answers(items):
        assert quiet.is_correct(ex, completion) is truth
        if not truth:
            assert quiet.feedback(ex, completion) == oracle.feedback(ex, completion)
    assert quiet.counts == {"user_flips": 0, "user_irrelevant_hints": 0}


def test_p_one_flips_every_verdict(items):
    user = make_feedback(ARC, flip_prob=1.0)
    assert isinstance(user, NoisyFeedback)
    pairs = list(answers(items))
    assert all(user.is_correct(ex, c) is (not truth) for ex, c, truth in pairs)
    assert user.counts["user_flips"] == len(pairs) == 400


def test_flip_rate_matches_p_and_is_seeded(items):
    """p = 0.3 over 400 judgements: the flip count lies within 4 binomial σ of 120 (σ = √(400·0.3·0.7) ≈ 9.2);
    the same seed repeats every verdict, another seed changes some."""
    pairs = list(answers(items))
    flips = [NoisyFeedback(ARC, 0.3, 0.0, seed=1).is_correct(ex, c) != t for ex, c, t in pairs]
    again = [NoisyFeedback(ARC, 0.3, 0.0, seed=1).is_correct(ex, c) != t for ex, c, t in pairs]
    other = [NoisyFeedback(ARC, 0.3, 0.0, seed=2).is_correct(ex, c) != t for ex, c, t in pairs]
    assert abs(sum(flips) - 120) < 4 * math.sqrt(400 * 0.3 * 0.7)
    assert flips == again and flips != other


def test_the_same_answer_always_gets_the_same_verdict(items):
    user = NoisyFeedback(ARC, 0.5, 0.5, seed=0)
    for ex, c, _ in list(answers(items))[:50]:
        assert len({user.is_correct(ex, c) for _ in range(3)}) == 1
        assert len({user.feedback(ex, c) for _ in range(3)}) == 1


def test_irrelevant_hints_at_rate_q(items):
    """q = 1: every hint comes from IRRELEVANT_HINTS; q = 0.25: about a quarter do (4σ band on 200 wrong answers)."""
    wrong = [(ex, c) for ex, c, t in answers(items) if not t]
    always = NoisyFeedback(ARC, 0.0, 1.0)
    assert all(always.feedback(ex, c) in IRRELEVANT_HINTS for ex, c in wrong)
    assert always.counts["user_irrelevant_hints"] == 200
    some = NoisyFeedback(ARC, 0.0, 0.25, seed=5)
    n = sum(some.feedback(ex, c) in IRRELEVANT_HINTS for ex, c in wrong)
    assert abs(n - 50) < 4 * math.sqrt(200 * 0.25 * 0.75)
    assert len({always.feedback(ex, c) for ex, c in wrong}) > 1  # not one fixed sentence


def test_a_right_answer_called_wrong_gets_an_irrelevant_hint_not_an_error(items):
    """The oracle refuses feedback on a correct answer; a user who wrongly rejected it just says something useless."""
    user = NoisyFeedback(ARC, 1.0, 0.0)
    ex = items[0]
    right = f"The answer is {ex.gold}."
    assert user.is_correct(ex, right) is False
    assert user.feedback(ex, right) in IRRELEVANT_HINTS
    with pytest.raises(ValueError):
        OracleFeedback(ARC).feedback(ex, right)


@pytest.mark.parametrize("p,q", [(-0.1, 0.0), (0.0, 1.5), (float("nan"), 0.0)])
def test_bad_probabilities_are_refused(p, q):
    with pytest.raises(ValueError, match="must lie in"):
        NoisyFeedback(ARC, p, q)


def test_config_keys_are_validated_and_are_compare_axes(tmp_path):
    with pytest.raises(ConfigError, match="user_flip_prob"):
        RunConfig(user_flip_prob=1.5)
    with pytest.raises(ConfigError, match="user_irrelevant_prob"):
        RunConfig(user_irrelevant_prob=-0.2)
    grid = Grid(tasks=["strategy_qa"], algorithms=["spear"], seeds=[0], axes={"user_flip_prob": [0.0, 0.2]})
    assert [c.config.user_flip_prob for c in grid.cells(tmp_path)] == [0.0, 0.2]


def test_a_client_round_reports_the_users_mistakes():
    """Worker.round (tiny model, N = 1): with p = 1 every verdict flips, so user_flips = generations (each attempt
    judged once); with p = 0.5 and q = 1 some answers are called wrong and revised, and every hint given is an
    irrelevant one, so user_irrelevant_hints = revisions_attempted > 0."""
    from fedspear.worker import Worker
    from fedspear.runtime.model import get_adapter

    cfg = RunConfig(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=8, local_steps=1,
                    batch_size=2, max_new_tokens=4, lora_r=4, lora_alpha=8, lora_dropout=0.0, train_size=40,
                    max_revisions=1, user_flip_prob=1.0)
    worker = Worker.load(cfg)
    _, metrics = worker.round(cfg, get_adapter(worker.model), list(range(20)), 0, 1, lr=1e-3)
    assert metrics["user_flips"] == metrics["generations"] > 0
    cfg = dataclasses.replace(cfg, user_flip_prob=0.5, user_irrelevant_prob=1.0)
    _, metrics = worker.round(cfg, get_adapter(worker.model), list(range(20)), 0, 1, lr=1e-3)
    assert 0 < metrics["user_flips"] < metrics["generations"]
    assert metrics["user_irrelevant_hints"] == metrics["revisions_attempted"] > 0
