"""SPEAR losses (Eqs. 4-7) and Theorem 1 against numbers worked out by hand (SPEC §8)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedspear.losses import (
    PROB_CLAMP,
    gated_unlikelihood,
    h_mu,
    margin,
    margin_lower_bound,
    spear_loss,
    tail_mask,
    token_logprobs,
    win_nll,
)

TOL = 1e-5


def _logp(*rows: list[float]) -> torch.Tensor:
    """``log p`` for rows of probabilities of equal length, float64, ``[B, T]``."""
    return torch.tensor(rows, dtype=torch.float64).log()


def _mask(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def _positions(mask: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in mask]


# ----------------------------------------------------------------------------------------------------------------------
# Eq. 6: gated unlikelihood, SPEC §8 values
# ----------------------------------------------------------------------------------------------------------------------

# One lose trace, alpha = 1, mu = 0.3, tail p = [0.9, 0.2, 0.5, 0.31].
P1 = [0.9, 0.2, 0.5, 0.31]
# Second trace, alpha = 0.5, p = [0.95, 0.1], right-padded to length 4 (padding outside the tail).
P2 = [0.95, 0.1, 0.5, 0.5]
TAIL_2 = _mask([1, 1, 1, 1], [1, 1, 0, 0])


def test_unlikelihood_single_trace_sequence():
    """u = 1[p > 0.3] * -log(1 - p):
        0.9  -> -log 0.1  = 2.302585
        0.2  -> gated out = 0
        0.5  -> -log 0.5  = 0.693147
        0.31 -> -log 0.69 = 0.371064
    "sequence": alpha * sum u = 1 * 3.366796 over one trace = 3.366796."""
    loss = gated_unlikelihood(_logp(P1), _mask([1, 1, 1, 1]), [1.0], mu=0.3, normalization="sequence")
    assert loss.item() == pytest.approx(3.366796, abs=TOL)


def test_unlikelihood_single_trace_token():
    """"token": alpha * sum u / |T| = 3.366796 / 4 = 0.841699 (the gated-out 0.2 still counts in |T|)."""
    loss = gated_unlikelihood(_logp(P1), _mask([1, 1, 1, 1]), [1.0], mu=0.3, normalization="token")
    assert loss.item() == pytest.approx(0.841699, abs=TOL)


def test_unlikelihood_per_token_terms():
    """Each term on its own (one-token tails): u = [2.302585, 0, 0.693147, 0.371064]."""
    expected = [2.302585, 0.0, 0.693147, 0.371064]
    for p, u in zip(P1, expected):
        loss = gated_unlikelihood(_logp([p]), _mask([1]), [1.0], mu=0.3, normalization="sequence")
        assert loss.item() == pytest.approx(u, abs=TOL)


def test_unlikelihood_two_traces_sequence():
    """Add a trace with alpha = 0.5, p = [0.95, 0.1]: u = [-log 0.05, 0] = [2.995732, 0].
    "sequence": mean(1 * 3.366796, 0.5 * 2.995732) = (3.366796 + 1.497866) / 2 = 2.432331."""
    loss = gated_unlikelihood(_logp(P1, P2), TAIL_2, [1.0, 0.5], mu=0.3, normalization="sequence")
    assert loss.item() == pytest.approx(2.432331, abs=TOL)


def test_unlikelihood_two_traces_token_and_authors_mean_alpha():
    """"token": (1 * 3.366796 + 0.5 * 2.995732) / (4 + 2) = 4.864662 / 6 = 0.810777.

    The authors' code multiplies the unweighted token mean by the batch-mean alpha instead:
    mean(alpha) = (1 + 0.5) / 2 = 0.75; unweighted mean = (3.366796 + 2.995732) / 6 = 6.362528 / 6 = 1.060421;
    0.75 * 1.060421 = 0.795316 -- SPEC §8's "authors' value". We keep per-trace alpha (Eq. 6)."""
    logp = _logp(P1, P2)
    ours = gated_unlikelihood(logp, TAIL_2, [1.0, 0.5], mu=0.3, normalization="token")
    assert ours.item() == pytest.approx(0.810777, abs=TOL)
    unweighted = gated_unlikelihood(logp, TAIL_2, [1.0, 1.0], mu=0.3, normalization="token")
    assert unweighted.item() == pytest.approx(6.362528 / 6, abs=TOL)
    authors = torch.tensor([1.0, 0.5]).mean().item() * unweighted.item()
    assert authors == pytest.approx(0.795316, abs=TOL)


def test_unlikelihood_gradient_wrt_logits():
    """z = [2, 0, -1], y = 0. softmax: e^2 = 7.389056, e^0 = 1, e^-1 = 0.367879, sum = 8.756935
    -> p = [0.843795, 0.114195, 0.042010]. With mu = 0.5 < p_y the gate is open and
    d(-log(1 - p_y))/dz_j = p_y (delta_jy - p_j) / (1 - p_y):
        j = 0: p_y (1 - p_y) / (1 - p_y)          = p_y                  = 0.843795
        j = 1: -0.843795 * 0.114195 / 0.156205    = -0.616863
        j = 2: -0.843795 * 0.042010 / 0.156205    = -0.226931
    (the three sum to 0, as any gradient of a softmax function of z must)."""
    z = torch.tensor([[[2.0, 0.0, -1.0]]], requires_grad=True)  # [1, 1, 3]
    logp = token_logprobs(z, torch.tensor([[0]]))  # [1, 1]
    assert logp.exp().item() == pytest.approx(0.843795, abs=TOL)
    assert torch.softmax(z, -1).flatten().tolist() == pytest.approx([0.843795, 0.114195, 0.042010], abs=TOL)
    loss = gated_unlikelihood(logp, _mask([1]), [1.0], mu=0.5, normalization="token")
    loss.backward()
    assert z.grad.flatten().tolist() == pytest.approx([0.843795, -0.616863, -0.226931], abs=TOL)


def test_unlikelihood_nothing_above_mu_is_zero_with_zero_gradient():
    """p = [0.2, 0.1, 0.29] all <= mu = 0.3 -> every gate closed -> l_lose = 0, and the gradient w.r.t. the
    logits is exactly 0 (the indicator is not differentiated)."""
    probs = torch.tensor([0.2, 0.1, 0.29], dtype=torch.float64)
    # Two-token vocabulary: logits [log p, log(1 - p)] make softmax(z)[0] = p exactly.
    z = torch.stack([probs.log(), (1 - probs).log()], -1).unsqueeze(0).requires_grad_(True)  # [1, 3, 2]
    logp = token_logprobs(z, torch.zeros(1, 3, dtype=torch.long))  # [1, 3]
    for normalization in ("token", "sequence"):
        loss = gated_unlikelihood(logp, _mask([1, 1, 1]), [1.0], mu=0.3, normalization=normalization)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, z, retain_graph=True)
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_unlikelihood_alpha_half_halves_the_loss(normalization):
    """alpha enters linearly: alpha = 0.5 gives exactly half of alpha = 1 (3.366796 -> 1.683398 in "sequence")."""
    logp = _logp(P1)
    full = gated_unlikelihood(logp, _mask([1, 1, 1, 1]), [1.0], mu=0.3, normalization=normalization)
    half = gated_unlikelihood(logp, _mask([1, 1, 1, 1]), [0.5], mu=0.3, normalization=normalization)
    assert half.item() == pytest.approx(0.5 * full.item(), abs=1e-12)


def test_unlikelihood_only_tail_positions_count():
    """Same p = [0.9, 0.2, 0.5, 0.31] with tail = last two positions: u = 0.693147 + 0.371064 = 1.064211
    ("sequence"); the 0.9 at position 0 is outside the tail and ignored."""
    tail = tail_mask(_mask([1, 1, 1, 1]), 2)
    loss = gated_unlikelihood(_logp(P1), tail, [1.0], mu=0.3, normalization="sequence")
    assert loss.item() == pytest.approx(1.064211, abs=TOL)


def test_unlikelihood_is_finite_at_probability_one():
    """p = 1 would give -log 0 = inf; the clamp p <= 1 - 1e-6 gives -log(1e-6) = 13.815511 instead."""
    loss = gated_unlikelihood(torch.zeros(1, 1), _mask([1]), [1.0], mu=0.3, normalization="sequence")
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(-math.log(1 - PROB_CLAMP), rel=1e-3)
    assert loss.item() == pytest.approx(13.815511, rel=1e-3)


def test_unlikelihood_empty_batch_is_zero_and_backpropagates():
    """No lose traces (B = 0) or an all-empty tail: 0, and backward() still runs (zero gradient)."""
    logp = torch.zeros(0, 5, requires_grad=True)
    loss = gated_unlikelihood(logp, torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0), mu=0.3)
    assert loss.item() == 0.0
    loss.backward()
    logp = torch.zeros(2, 3, requires_grad=True)
    loss = gated_unlikelihood(logp, torch.zeros(2, 3, dtype=torch.bool), [1.0, 1.0], mu=0.3, normalization="sequence")
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))


# ----------------------------------------------------------------------------------------------------------------------
# Eq. 5: tail set
# ----------------------------------------------------------------------------------------------------------------------


def test_tail_mask_tau_3_of_5():
    """|y| = 5 (positions 0..4), tau = 3 -> {5 - min(3, 5), ..., 4} = {2, 3, 4}."""
    assert _positions(tail_mask(_mask([1, 1, 1, 1, 1]), 3)) == [[2, 3, 4]]


@pytest.mark.parametrize("tau", [0, 5, 6, 100])
def test_tail_mask_whole_completion(tau):
    """tau = 0 (Eq. 5's second case) or tau >= |y| = 5 (min(tau, 5) = 5) -> all positions {0, ..., 4}."""
    assert _positions(tail_mask(_mask([1, 1, 1, 1, 1]), tau)) == [[0, 1, 2, 3, 4]]


def test_tail_mask_with_padding_and_prompt_positions():
    """tau = 3 on four rows of length 8:
        right padding, |y| = 5 at 0..4          -> {2, 3, 4}
        left padding,  |y| = 5 at 3..7          -> {5, 6, 7}
        prompt 0..1, completion 2..5, padding   -> |y| = 4 -> {3, 4, 5}
        |y| = 2 at 6..7 (shorter than tau)      -> {6, 7}
    and an empty row stays empty."""
    mask = _mask(
        [1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0],
    )
    assert _positions(tail_mask(mask, 3)) == [[2, 3, 4], [5, 6, 7], [3, 4, 5], [6, 7], []]
    assert torch.equal(tail_mask(mask, 0), mask)


def test_tail_mask_accepts_integer_masks_and_rejects_bad_tau():
    """An attention-style 0/1 long mask works like a bool one; tau must be an int >= 0."""
    assert _positions(tail_mask(torch.tensor([[1, 1, 1, 1, 1]]), 3)) == [[2, 3, 4]]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="tau"):
            tail_mask(_mask([1, 1]), bad)


# ----------------------------------------------------------------------------------------------------------------------
# Eq. 4: win NLL
# ----------------------------------------------------------------------------------------------------------------------

# Row 0: p = [0.5, 0.25] + 2 padding -> -sum log p = ln 2 + 2 ln 2 = 3 ln 2 = 2.079442 (2 tokens)
# Row 1: p = [0.5, 0.5, 0.5, 0.5]    -> 4 ln 2 = 2.772589 (4 tokens)
# Row 2: empty mask.
WIN_LOGP = _logp([0.5, 0.25, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3])
WIN_MASK = _mask([1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0])


def test_win_nll_token():
    """"token": (3 ln 2 + 4 ln 2) / (2 + 4) = 7 ln 2 / 6 = 0.808672 (padding and the empty row add nothing)."""
    assert win_nll(WIN_LOGP, WIN_MASK, "token").item() == pytest.approx(7 * math.log(2) / 6, abs=1e-12)
    assert win_nll(WIN_LOGP, WIN_MASK, "token").item() == pytest.approx(0.808672, abs=TOL)


def test_win_nll_sequence():
    """"sequence": mean over non-empty rows of per-row sums = (3 ln 2 + 4 ln 2) / 2 = 3.5 ln 2 = 2.426015
    (the empty row 2 is ignored, not counted as a zero)."""
    assert win_nll(WIN_LOGP, WIN_MASK, "sequence").item() == pytest.approx(2.426015, abs=TOL)


def test_win_nll_empty_and_neg_inf_padding():
    """Empty batch -> 0 with a working backward(). Padding positions holding -inf log-probs (e.g. a masked vocab)
    do not turn the loss into NaN: the mask is applied with where, not multiplication."""
    logp = torch.zeros(0, 3, requires_grad=True)
    loss = win_nll(logp, torch.zeros(0, 3, dtype=torch.bool), "sequence")
    loss.backward()
    assert loss.item() == 0.0
    logp = torch.tensor([[math.log(0.5), -math.inf]])
    assert win_nll(logp, _mask([1, 0]), "token").item() == pytest.approx(math.log(2), abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Eq. 7 and argument checks
# ----------------------------------------------------------------------------------------------------------------------


def test_spear_loss_combines_terms():
    """lambda_w = 1, lambda_l = 0.1, mu = 0.3, "token": win = 0.808672 (above), lose = 0.841699 (P1),
    loss = 1 * 0.808672 + 0.1 * 0.841699 = 0.892842; active tokens: 0.9, 0.5, 0.31 pass the gate -> 3."""
    out = spear_loss(WIN_LOGP, WIN_MASK, _logp(P1), _mask([1, 1, 1, 1]), [1.0],
                     lambda_w=1.0, lambda_l=0.1, mu=0.3, normalization="token")
    assert set(out) == {"loss", "win", "lose", "active_tokens"}
    assert out["win"].item() == pytest.approx(0.808672, abs=TOL)
    assert out["lose"].item() == pytest.approx(0.841699, abs=TOL)
    assert out["loss"].item() == pytest.approx(0.892842, abs=TOL)
    assert out["active_tokens"].item() == 3


def test_spear_loss_without_lose_batch():
    """No lose batch (all None): loss = lambda_w * win = 0.808672, lose = 0, active = 0."""
    out = spear_loss(WIN_LOGP, WIN_MASK, None, None, None, lambda_w=1.0, lambda_l=0.1, mu=0.3)
    assert out["loss"].item() == pytest.approx(0.808672, abs=TOL)
    assert out["lose"].item() == 0.0 and out["active_tokens"].item() == 0
    with pytest.raises(ValueError, match="together"):
        spear_loss(WIN_LOGP, WIN_MASK, _logp(P1), None, None, lambda_w=1.0, lambda_l=0.1, mu=0.3)


def test_argument_errors_are_clear():
    """Unknown normalisation, mu outside (0, 1), mismatched shapes (both named), bad alpha, negative lambda."""
    logp, tail = _logp(P1), _mask([1, 1, 1, 1])
    with pytest.raises(ValueError, match="normalization must be one of"):
        win_nll(logp, tail, "mean")
    for mu in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(ValueError, match=r"mu .* \(0, 1\)"):
            gated_unlikelihood(logp, tail, [1.0], mu=mu)
    with pytest.raises(ValueError, match=r"\(1, 4\) and \(1, 3\)"):
        gated_unlikelihood(logp, _mask([1, 1, 1]), [1.0], mu=0.3)
    with pytest.raises(ValueError, match="alpha must have shape"):
        gated_unlikelihood(logp, tail, [1.0, 0.5], mu=0.3)
    with pytest.raises(ValueError, match="non-negative"):
        gated_unlikelihood(logp, tail, [-1.0], mu=0.3)
    with pytest.raises(ValueError, match="lambda_l"):
        spear_loss(logp, tail, logp, tail, [1.0], lambda_w=1.0, lambda_l=-0.1, mu=0.3)
    with pytest.raises(ValueError, match="labels must have shape"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------------------------
# token_logprobs
# ----------------------------------------------------------------------------------------------------------------------


def test_token_logprobs_matches_log_softmax_in_float32_for_bf16():
    """bf16 logits -> float32 result equal to log_softmax of the (upcast) logits gathered at the labels;
    labels = -100 (ignore index) at a padding position do not crash."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 4))
    labels[1, 3] = -100
    out = token_logprobs(logits, labels)
    assert out.dtype == torch.float32 and out.shape == (2, 4)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-6)


def _autograd_token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same operations as ``token_logprobs``, differentiated by autograd (the way it was computed before its own
    backward)."""
    rows = []
    for row, index in zip(logits, labels.clamp(min=0)):
        row = row if row.dtype in (torch.float32, torch.float64) else row.float()
        rows.append(row.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_token_logprobs_values_and_gradient_equal_autograds(dtype):
    """Values and the gradient w.r.t. the logits equal (``torch.equal``: a zero's sign aside, which autograd's sum
    with ``gather``'s zero-filled gradient drops) those of autograd through the same operations
    (``g · (onehot(y) − softmax)``, the softmax as ``exp(x − lse)``, ``g`` added at ``y``), for a non-contiguous
    slice of the logits as training passes it, an ignore-index label and an upstream gradient with zeros (masked
    positions) and both signs; the result is float32 (float64 for float64 logits)."""
    torch.manual_seed(0)
    full = torch.randn(3, 6, 50, dtype=torch.float64).mul(4).to(dtype)  # [B, T + 1, V]
    labels = torch.randint(0, 50, (3, 5))
    labels[2, 0] = -100
    weights = torch.randn(3, 5, dtype=torch.float64)
    weights[0, :2] = 0.0
    results = []
    for fn in (token_logprobs, _autograd_token_logprobs):
        logits = full.clone().requires_grad_(True)
        out = fn(logits[:, :-1], labels)  # [B, T] from a [B, T, V] view, as completion_logits returns it
        (out * weights.to(out.dtype)).sum().backward()
        results.append((out.detach(), logits.grad))
    (out, grad), (ref_out, ref_grad) = results
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and grad.dtype == dtype
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    assert grad[:, -1].abs().sum() == 0  # the position past the window gets no gradient


def test_token_logprobs_keeps_no_float32_copy_of_bf16_logits_for_the_backward():
    """What the backward keeps of a ``[B, T, V]`` bf16 forward is the logits themselves (2 bytes a value) plus the
    labels and ``[B, T]`` log-normalisers; autograd through the same operations keeps each row's float32 copy
    instead (4 bytes a value: twice as much)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 8, 1000).to(torch.bfloat16).requires_grad_(True)  # [B, T, V]
    labels = torch.randint(0, 1000, (4, 8))

    def saved_bytes(fn) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(logits, labels)
        return sum(seen.values())

    values = logits.numel()
    assert saved_bytes(token_logprobs) <= 2 * values + 12 * 4 * 8
    assert saved_bytes(_autograd_token_logprobs) >= 4 * values


# ----------------------------------------------------------------------------------------------------------------------
# Theorem 1: margin M_tau, h(mu), and the bound
# ----------------------------------------------------------------------------------------------------------------------


def test_margin_by_hand():
    """Win p = [0.5, 0.25]: mean log p = (-ln 2 - 2 ln 2) / 2 = -1.039721.
    Lose tail p = [0.9, 0.5] (tail of [0.2, 0.9, 0.5], tau = 2): mean = (ln 0.9 + ln 0.5) / 2 = -0.399254.
    M = -1.039721 - (-0.399254) = -0.640467. An empty tail gives NaN."""
    win_logp, win_mask = _logp([0.5, 0.25]), _mask([1, 1])
    lose_logp = _logp([0.2, 0.9, 0.5])
    m = margin(win_logp, win_mask, lose_logp, tail_mask(_mask([1, 1, 1]), 2))
    assert m.tolist() == pytest.approx([-0.640467], abs=TOL)
    assert math.isnan(margin(win_logp, win_mask, lose_logp, _mask([0, 0, 0])).item())


def test_h_mu_cases():
    """h(mu) = log 4 = 1.386294 for mu <= 1/2; log(1 / (mu (1 - mu))) above: h(0.9) = -log 0.09 = 2.407946.
    (The paper's "log 1/max(1/4, mu(1-mu))" would be log 4 everywhere since mu(1-mu) <= 1/4 -- a typo.)"""
    assert h_mu(0.3) == pytest.approx(math.log(4), abs=1e-12)
    assert h_mu(0.5) == pytest.approx(1.386294, abs=TOL)
    assert h_mu(0.9) == pytest.approx(2.407946, abs=TOL)
    assert h_mu(0.51) > h_mu(0.5)
    with pytest.raises(ValueError):
        h_mu(1.0)


def _logits_for(probs: list[float], vocab: int = 4) -> torch.Tensor:
    """``[1, T, V]`` float64 logits whose softmax puts exactly ``p`` on token 0 (the rest spread evenly)."""
    p = torch.tensor(probs, dtype=torch.float64)  # [T]
    rest = ((1 - p) / (vocab - 1)).log().unsqueeze(-1).expand(-1, vocab - 1)  # [T, V - 1]
    return torch.cat([p.log().unsqueeze(-1), rest], -1).unsqueeze(0)  # [1, T, V]


unit = st.floats(0.01, 0.99, allow_nan=False)


@settings(max_examples=200, deadline=None, database=None)
@given(
    mu=unit,
    win_probs=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=6),
    lose_len=st.integers(1, 8),
    tau=st.integers(0, 10),
    tail_fracs=st.lists(unit, min_size=8, max_size=8),
    head_probs=st.lists(st.floats(0.001, 0.999), min_size=8, max_size=8),
    alpha=st.sampled_from([0.5, 1.0]) | st.floats(0.05, 2.0),
    lambda_w=st.floats(0.05, 2.0),
    lambda_l=st.floats(0.05, 2.0),
)
def test_theorem_1_margin_bound(mu, win_probs, lose_len, tau, tail_fracs, head_probs, alpha, lambda_w, lambda_l):
    """Theorem 1 on one (win, lose) pair, "sequence" normalisation (Assumption 2: single sample).

    Assumption 1 by construction: tail tokens get p = mu + (1 - mu) * f with f in [0.01, 0.99], so
    mu < p <= 0.9999 < 1 - 1e-6 (below the clamp too); tokens before the tail get any p. Logits are built so the
    softmax gives those p, and the whole chain token_logprobs -> spear_loss -> margin is exercised.
    With eps = l_SPEAR: M_tau >= h(mu) - eps (1 / (lambda_w |y+|) + 1 / (lambda_l alpha |T_tau|))."""
    tail = tail_mask(torch.ones(1, lose_len, dtype=torch.bool), tau)  # [1, L]
    lose_probs = [mu + (1 - mu) * tail_fracs[i] if tail[0, i] else head_probs[i] for i in range(lose_len)]
    win_logp = token_logprobs(_logits_for(win_probs), torch.zeros(1, len(win_probs), dtype=torch.long))
    lose_logp = token_logprobs(_logits_for(lose_probs), torch.zeros(1, lose_len, dtype=torch.long))
    win_mask = torch.ones_like(win_logp, dtype=torch.bool)

    out = spear_loss(win_logp, win_mask, lose_logp, tail, [alpha],
                     lambda_w=lambda_w, lambda_l=lambda_l, mu=mu, normalization="sequence")
    assert out["active_tokens"].item() == int(tail.sum())  # Assumption 1 holds
    m = margin(win_logp, win_mask, lose_logp, tail).item()
    bound = margin_lower_bound(out["loss"].item(), mu, lambda_w, lambda_l, alpha, len(win_probs), int(tail.sum()))
    assert m >= bound - 1e-9 * (1 + abs(bound))


@pytest.mark.parametrize("mu, tail_p", [(0.3, 0.5), (0.5, 0.5 + 1e-9), (0.8, 0.8 + 1e-9)])
def test_theorem_1_bound_is_tight(mu, tail_p):
    """Near-equality case, so the property test above is not passing a bound that is merely loose.

    Equality needs Lemma 1's equality (tail p = 1/2 when mu < 1/2, p -> mu+ otherwise), a perfect win (p = 1:
    l_win = 0, win mean log p = 0) and a vanishing share of eps charged to the win side, eps / (lambda_w |y+|) -> 0,
    here lambda_w = 1e6 (the win term is 0, so eps does not grow with lambda_w). E.g. mu = 0.3, three tail tokens
    at 1/2, alpha = 1, lambda_l = 0.1, |y+| = 2: eps = 0.1 * 3 ln 2 = 0.207944;
    bound = ln 4 - 0.207944 (1 / 2e6 + 1 / 0.3) = ln 4 - ln 2 - 1.0e-7 = 0.693147 - 1e-7; M = 0 - ln(1/2) = 0.693147.
    For mu = 0.8: h = -ln 0.16, eps / 0.3 = -ln 0.2, bound ~= -ln 0.8 = M."""
    lambda_w, lambda_l = 1e6, 0.1
    win_logp, win_mask = torch.zeros(1, 2, dtype=torch.float64), _mask([1, 1])
    lose_logp, tail = _logp([tail_p] * 3), _mask([1, 1, 1])
    out = spear_loss(win_logp, win_mask, lose_logp, tail, [1.0], lambda_w=lambda_w, lambda_l=lambda_l, mu=mu,
                     normalization="sequence")
    m = margin(win_logp, win_mask, lose_logp, tail).item()
    bound = margin_lower_bound(out["loss"].item(), mu, lambda_w, lambda_l, 1.0, 2, 3)
    assert m == pytest.approx(-math.log(max(mu, 0.5)), abs=1e-7)
    assert 0.0 <= m - bound < 1e-6


def test_losses_module_is_pure_torch():
    """losses.py imports torch, numpy and the standard library only -- no model, transformers or flwr
    (STYLE.md habit 1)."""
    import ast
    import inspect

    import fedspear.losses as module

    tree = ast.parse(inspect.getsource(module))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {name.split(".")[0] for name in imported} <= {"__future__", "math", "collections", "numpy", "torch"}
