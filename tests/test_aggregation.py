"""Win-weighted FedAvg and the server pseudo-gradient (paper Alg. 2; SPEC §4 and §8)."""

from __future__ import annotations

import numpy as np
import pytest

from fedspear.server.aggregation import pseudo_gradient, win_weighted_average


def _setup(dtype=np.float32):
    """A global adapter with two tensors and three clients that add +1, +10, +100 to every entry."""
    rng = np.random.default_rng(0)
    global_arrays = {
        "layer.0.lora_A.weight": rng.standard_normal((2, 3)).astype(dtype),
        "layer.0.lora_B.weight": rng.standard_normal((3, 2)).astype(dtype),
    }
    clients = [{name: (a + delta).astype(dtype) for name, a in global_arrays.items()} for delta in (1, 10, 100)]
    return global_arrays, clients


def _delta(new, old):
    return {name: new[name].astype(np.float64) - old[name].astype(np.float64) for name in old}


def test_equal_wins_give_plus_37():
    """w = (1, 1, 1): (1 * 1 + 1 * 10 + 1 * 100) / 3 = 111 / 3 = +37 (the reference code's aliasing gives +100)."""
    global_arrays, clients = _setup()
    new, aggregated = win_weighted_average(global_arrays, clients, [1, 1, 1])
    assert aggregated
    for d in _delta(new, global_arrays).values():
        np.testing.assert_allclose(d, 37.0, atol=1e-5)


def test_weighted_wins_give_plus_75_25():
    """w = (1, 0, 3): (1 * 1 + 0 * 10 + 3 * 100) / (1 + 0 + 3) = 301 / 4 = +75.25."""
    global_arrays, clients = _setup()
    new, aggregated = win_weighted_average(global_arrays, clients, [1, 0, 3])
    assert aggregated
    for d in _delta(new, global_arrays).values():
        np.testing.assert_allclose(d, 75.25, atol=1e-5)


def test_no_wins_keep_global_unchanged():
    """w = (0, 0, 0): sum w = 0 -> the global adapter unchanged, flag False (Decision, SPEC §4), as copies.
    No clients at all behaves the same."""
    global_arrays, clients = _setup()
    for args in ((clients, [0, 0, 0]), ([], [])):
        new, aggregated = win_weighted_average(global_arrays, *args)
        assert not aggregated
        for name, a in global_arrays.items():
            np.testing.assert_array_equal(new[name], a)
            assert not np.shares_memory(new[name], a)


def test_results_are_fresh_arrays():
    """Mutating the inputs after aggregation does not change the result (no views, no aliasing)."""
    global_arrays, clients = _setup()
    new, _ = win_weighted_average(global_arrays, clients, [1, 1, 1])
    snapshot = {name: a.copy() for name, a in new.items()}
    for arrays in [global_arrays, *clients]:
        for a in arrays.values():
            a += 1000.0
    for name in new:
        np.testing.assert_array_equal(new[name], snapshot[name])


def test_single_client_result_is_a_copy():
    """One client with w = 2: the average is that client's tensor (2 * x / 2), and still a different buffer."""
    global_arrays, clients = _setup(np.float64)
    new, _ = win_weighted_average(global_arrays, clients[:1], [2])
    for name, a in clients[0].items():
        np.testing.assert_array_equal(new[name], a)
        assert not np.shares_memory(new[name], a)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtype_preserved(dtype):
    """Each output keeps its global dtype (half-precision adapters stay half), and equals the float64 mean of the
    client tensors rounded once to that dtype: for float16, (x+1 + x+10 + x+100) / 3 is not rounded per partial sum."""
    global_arrays, clients = _setup(dtype)
    new, _ = win_weighted_average(global_arrays, clients, [1, 1, 1])
    for name, a in global_arrays.items():
        assert new[name].dtype == a.dtype
        expected = np.mean([c[name].astype(np.float64) for c in clients], axis=0).astype(dtype)
        np.testing.assert_array_equal(new[name], expected)


def test_mismatched_inputs_raise():
    """Names, shapes, lengths and negative weights are checked, with the offending client / tensor named."""
    global_arrays, clients = _setup()
    bad_name = [clients[0], clients[1], {"other": np.zeros(1)}]
    with pytest.raises(ValueError, match="client 2"):
        win_weighted_average(global_arrays, bad_name, [1, 1, 1])
    bad_shape = [dict(c) for c in clients]
    bad_shape[1]["layer.0.lora_A.weight"] = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"client 1.*lora_A.*\(3, 2\)"):
        win_weighted_average(global_arrays, bad_shape, [1, 1, 1])
    with pytest.raises(ValueError, match="3 client updates but 2 win counts"):
        win_weighted_average(global_arrays, clients, [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        win_weighted_average(global_arrays, clients, [1, -1, 1])


def test_pseudo_gradient():
    """Delta = avg - theta: with w = (1, 1, 1) every entry is +37; dtype kept; shape mismatch raises."""
    global_arrays, clients = _setup()
    new, _ = win_weighted_average(global_arrays, clients, [1, 1, 1])
    delta = pseudo_gradient(global_arrays, new)
    for name, d in delta.items():
        assert d.dtype == np.float32
        np.testing.assert_allclose(d, 37.0, atol=1e-5)
    with pytest.raises(ValueError, match="averaged adapter"):
        pseudo_gradient(global_arrays, {"layer.0.lora_A.weight": np.zeros((2, 3))})
