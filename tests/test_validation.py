"""Server-side checks on client replies, and the robust aggregation rules, through the strategy code path."""

from __future__ import annotations

import numpy as np
import pytest

from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.fl.records import from_record, layout_of, to_record
from fedspear.server.validation import check_reply, update_norm

from helpers import error_reply, train_reply

G = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}
OK = {"weight": 3, "num-wins": 3, "num-losses": 1, "prompts": 4, "tokens_generated": 40}

pytestmark = pytest.mark.usefixtures("task_identity")


def test_a_well_formed_reply_passes():
    assert check_reply(G, {k: v + 0.5 for k, v in G.items()}, OK) is None


@pytest.mark.parametrize(
    ("arrays", "metrics", "bound", "reason"),
    [
        ({"a": G["a"]}, OK, None, "adapter layout differs from the global adapter's: missing ['b'], unexpected []"),
        ({**G, "c": G["b"]}, OK, None, "missing [], unexpected ['c']"),
        ({**G, "a": np.zeros((3, 2), np.float32)}, OK, None, "tensor 'a' has shape (3, 2), expected (2, 3)"),
        ({**G, "a": np.zeros((2, 3), np.float64)}, OK, None, "tensor a: dtype float64, expected float32"),
        ({**G, "b": np.array([1, np.nan, np.inf, 1], np.float32)}, OK, None, "tensor b: 2 non-finite values"),
        (G, {**OK, "num-wins": -1}, None, "counter num-wins = -1 is not a non-negative integer"),
        (G, {**OK, "num-wins": 2.5}, None, "counter num-wins = 2.5 is not a non-negative integer"),
        (G, {**OK, "tokens_generated": float("nan")}, None, "counter tokens_generated = nan"),
        (G, {"weight": 3, "num-losses": 1, "prompts": 4}, None, "counter num-wins missing"),
        (G, {"num-wins": 3, "num-losses": 1, "prompts": 4}, None, "counter weight missing"),
        ({k: v + 1.0 for k, v in G.items()}, OK, 3.0, "update norm 3.162 exceeds the bound 3"),
    ],
)
def test_each_fault_has_a_named_reason(arrays, metrics, bound, reason):
    assert reason in (check_reply(G, arrays, metrics, bound) or "")


def test_update_norm_by_hand():
    """+1 on 10 entries → √10 = 3.1623."""
    assert update_norm(G, {k: v + 1.0 for k, v in G.items()}) == pytest.approx(np.sqrt(10))


def _reply(node: int, arrays, wins: int = 1):
    return train_reply(node, arrays, {**OK, "weight": wins, "num-wins": wins})


def test_bad_replies_are_excluded_and_the_round_goes_on():
    strategy = WinWeightedFedAvg(clients_per_round=5, min_available_nodes=5, max_update_norm=100.0)
    strategy.current_arrays, strategy.current_layout = to_record(G), layout_of(G)
    good = {k: v + 2.0 for k, v in G.items()}
    replies = [
        _reply(1, good, wins=2),
        _reply(2, {**G, "a": np.full((2, 3), np.nan, np.float32)}),
        _reply(3, {**G, "a": np.zeros((1, 1), np.float32)}),
        _reply(4, {k: v + 1e6 for k, v in G.items()}),
        error_reply(5),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    out = from_record(arrays, layout_of(G))
    np.testing.assert_allclose(out["a"], good["a"])  # only the healthy client counts
    assert set(strategy.rejected) == {2, 3, 4, 5}
    assert "non-finite" in strategy.rejected[2] and "shape" in strategy.rejected[3]
    assert "update norm" in strategy.rejected[4] and "injected crash" in strategy.rejected[5]
    assert metrics["num-wins"] == 2 and strategy.last_aggregated


def test_nothing_accepted_gives_no_new_adapter():
    strategy = WinWeightedFedAvg(clients_per_round=1, min_available_nodes=1)
    strategy.current_arrays, strategy.current_layout = to_record(G), layout_of(G)
    assert strategy.aggregate_train(1, [error_reply(7)]) == (None, None)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_robust_rules_match_numpy(rule):
    """Five clients, one outlier (+1000): the median / 20%-trimmed mean ignore it; weights play no part."""
    deltas = [1.0, 2.0, 3.0, 4.0, 1000.0]
    strategy = WinWeightedFedAvg(clients_per_round=5, min_available_nodes=5, rule=rule, trim_beta=0.2)
    strategy.current_arrays, strategy.current_layout = to_record(G), layout_of(G)
    replies = [_reply(i, {k: v + d for k, v in G.items()}, wins=i + 1) for i, d in enumerate(deltas)]
    out = from_record(strategy.aggregate_train(1, replies)[0], layout_of(G))
    stacked = np.stack([G["a"] + d for d in deltas])
    trimmed = np.sort(stacked, axis=0)[1:-1].mean(axis=0)  # cut int(0.2 · 5) = 1 from each end
    expected = np.median(stacked, axis=0) if rule == "median" else trimmed
    np.testing.assert_allclose(out["a"], expected, rtol=1e-6)
    assert out["a"].dtype == np.float32


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="aggregation rule must be one of fedavg, median, trimmed_mean"):
        WinWeightedFedAvg(clients_per_round=1, min_available_nodes=1, rule="krum")
