"""Baseline losses (SPEC §5) -- GRPO, distillation, RLTF-SD -- against numbers worked out by hand (SPEC §8)."""

from __future__ import annotations

import math

import pytest
import torch

from fedspear.baseline_losses import (
    distill_loss,
    generalized_jsd,
    grpo_advantages,
    grpo_loss,
    k3_kl,
    kl_divergence,
    ppo_clip_loss,
    rltf_sd_advantages,
    rltf_sd_loss,
    scaled_kl_divergence,
)

TOL = 1e-5
F64 = torch.float64


def _t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _mask(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------------------------------
# GRPO advantages
# ----------------------------------------------------------------------------------------------------------------------


def test_grpo_advantages_four_samples():
    """r = [1, 0, 0, 1]: mean = 0.5; Bessel variance = 4 * 0.25 / 3 = 1/3, std = 0.577350;
    A = +-0.5 / (0.577350 + 0.0001) = +-0.5 / 0.577450 = +-0.865875."""
    adv = grpo_advantages([1, 0, 0, 1])
    assert adv.tolist() == pytest.approx([0.865875, -0.865875, -0.865875, 0.865875], abs=TOL)


def test_grpo_advantages_two_samples():
    """r = [1, 0]: mean = 0.5; Bessel variance = (0.25 + 0.25) / 1 = 0.5, std = 0.707107;
    A = +-0.5 / 0.707207 = +-0.707007 (the 1e-4 is what makes it differ from 1/sqrt(2) = 0.707107)."""
    adv = grpo_advantages(torch.tensor([1.0, 0.0], dtype=F64))
    assert adv.tolist() == pytest.approx([0.707007, -0.707007], abs=TOL)
    assert adv.dtype == F64


def test_grpo_advantages_zero_variance_groups_are_zero():
    """[1, 1, 1, 1] -> std 0 -> A = 0 exactly. Also [0, 0], a group of one (Bessel std undefined) and a constant
    float group [0.1, 0.1, 0.1] (whose mean may differ from 0.1 by round-off) are exactly 0."""
    for rewards in ([1, 1, 1, 1], [0, 0], [1], [0.1, 0.1, 0.1]):
        adv = grpo_advantages(rewards)
        assert torch.equal(adv, torch.zeros_like(adv)), rewards


def test_grpo_advantages_per_row_for_several_prompts():
    """[P, G] = [[1, 0, 0, 1], [1, 1, 1, 1], [True, False, ...]]: each row normalised on its own
    (row 0 -> +-0.865875, row 1 -> 0); booleans (IsCorrect) are accepted."""
    adv = grpo_advantages(torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]]).bool())
    assert adv.shape == (3, 4)
    assert adv[0].tolist() == pytest.approx([0.865875, -0.865875, -0.865875, 0.865875], abs=TOL)
    assert adv[1].tolist() == [0.0] * 4
    assert adv[2].tolist() == pytest.approx([-0.865875, 0.865875, 0.865875, -0.865875], abs=TOL)


def test_grpo_advantages_errors():
    for bad in ([], [[[1.0]]], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="rewards"):
            grpo_advantages(bad)


# ----------------------------------------------------------------------------------------------------------------------
# PPO clipped surrogate and k3 KL
# ----------------------------------------------------------------------------------------------------------------------


def test_ppo_clip_spec_values():
    """eps = 0.2, clip range [0.8, 1.2], loss = -min(r A, clip(r) A):
        r = 1.5, A = -1: -min(-1.5, -1.2) = 1.5   (pessimistic: the unclipped, worse value)
        r = 0.5, A = -1: -min(-0.5, -0.8) = 0.8   (clipped)
        r = 1.5, A = +1: -min( 1.5,  1.2) = -1.2  (clipped)"""
    loss = ppo_clip_loss(_t(1.5, 0.5, 1.5), _t(-1.0, -1.0, 1.0), eps=0.2)
    assert loss.tolist() == pytest.approx([1.5, 0.8, -1.2], abs=TOL)


def test_ppo_clip_gradient_only_through_unclipped_branch():
    """d/dr: case 1 takes the unclipped branch -> -A = 1; cases 2 and 3 take the clipped (constant) branch -> 0."""
    ratio = _t(1.5, 0.5, 1.5).requires_grad_(True)
    ppo_clip_loss(ratio, _t(-1.0, -1.0, 1.0), eps=0.2).sum().backward()
    assert ratio.grad.tolist() == [1.0, 0.0, 0.0]


def test_ppo_clip_broadcasts_and_checks():
    """One advantage per sequence as [B, 1] broadcasts over [B, T]; a bad eps or shape is a clear ValueError."""
    out = ppo_clip_loss(torch.ones(2, 3), torch.tensor([[2.0], [-1.0]]))
    assert out.tolist() == [[-2.0] * 3, [1.0] * 3]
    for eps in (0.0, 1.0, -0.1, True):
        with pytest.raises(ValueError, match="eps"):
            ppo_clip_loss(torch.ones(2), torch.ones(2), eps=eps)
    with pytest.raises(ValueError, match="does not broadcast"):
        ppo_clip_loss(torch.ones(2, 3), torch.ones(2))


def test_k3_kl_spec_values_and_direction():
    """d = log pi - log pi_ref; k3 = exp(ref - logp) - (ref - logp) - 1 = exp(-d) + d - 1:
        d = 0.1: exp(-0.1) = 0.9048374 -> 0.9048374 + 0.1 - 1 = 0.0048374
        d = 0.5: exp(-0.5) = 0.6065307 -> 0.6065307 + 0.5 - 1 = 0.1065307
    (the other direction, exp(d) - d - 1, would give 0.0051709 and 0.1487213.)"""
    logp = _t(0.1, 0.5) - 2.0
    ref = _t(0.0, 0.0) - 2.0
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.0048374, 0.1065307], abs=1e-7)
    assert k3_kl(ref, logp).tolist() == pytest.approx([0.0051709, 0.1487213], abs=1e-7)


def test_k3_kl_zero_at_equality_nonnegative_and_gradient():
    """k3 = 0 where logp = ref; >= 0 everywhere; d k3 / d logp = 1 - exp(ref - logp) = 1 - exp(-d):
    d = 0.1 -> 1 - 0.904837 = 0.095163."""
    torch.manual_seed(0)
    a, b = torch.randn(50, dtype=F64), torch.randn(50, dtype=F64)
    assert bool((k3_kl(a, b) >= 0).all()) and torch.equal(k3_kl(a, a), torch.zeros(50, dtype=F64))
    logp = _t(0.1).requires_grad_(True)
    k3_kl(logp, _t(0.0)).backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.1), abs=1e-12)
    assert logp.grad.item() == pytest.approx(0.095163, abs=TOL)
    with pytest.raises(ValueError, match="same shape"):
        k3_kl(torch.zeros(2), torch.zeros(3))


# ----------------------------------------------------------------------------------------------------------------------
# GRPO loss
# ----------------------------------------------------------------------------------------------------------------------

# Row 0: two completion tokens + one padding position (holding -inf); d = logp - ref = [0.1, 0.5].
# Row 1: three completion tokens; d = [0, 0, 0.1].
GRPO_REF = _t([-1.0, -2.0, -1.0], [-0.5, -0.5, -3.0])
GRPO_LOGP = GRPO_REF + _t([0.1, 0.5, 0.0], [0.0, 0.0, 0.1])
GRPO_LOGP[0, 2] = -math.inf
GRPO_MASK = _mask([1, 1, 0], [1, 1, 1])
GRPO_ADV = _t(0.5, -1.0)


def test_grpo_loss_on_policy_by_hand():
    """On-policy (old_logp None -> ratio 1): per-token surrogate = -A.
        pg  = mean over rows of token means = mean(-0.5, +1.0) = 0.25
        kl  : row 0 = (0.0048374 + 0.1065307) / 2 = 0.0556840; row 1 = (0 + 0 + 0.0048374) / 3 = 0.0016125
              mean = (0.0556840 + 0.0016125) / 2 = 0.0286483
        loss = 0.25 + 0.02 * 0.0286483 = 0.2505730; clip fraction 0.
    The -inf at the padding position changes nothing."""
    out = grpo_loss(GRPO_LOGP, None, GRPO_REF, GRPO_MASK, GRPO_ADV, 0.2, 0.02)
    assert set(out) == {"loss", "pg", "kl", "clip_fraction"}
    assert out["pg"].item() == pytest.approx(0.25, abs=1e-12)
    assert out["kl"].item() == pytest.approx(0.0286483, abs=TOL)
    assert out["loss"].item() == pytest.approx(0.2505730, abs=TOL)
    assert out["clip_fraction"].item() == 0.0


def test_grpo_loss_gradient_by_hand():
    """d loss / d logp_bt = (1/B)(1/|o_b|)(-A_b + beta (1 - exp(-d_bt))) on completion tokens, 0 on padding:
        [0, 0]: (1/2)(1/2)(-0.5 + 0.02 * 0.0951626) = -0.1245242
        [0, 1]: (1/2)(1/2)(-0.5 + 0.02 * 0.3934693) = -0.1230327
        [1, 0]: (1/2)(1/3)(1.0 + 0)                 =  0.1666667
        [1, 2]: (1/2)(1/3)(1.0 + 0.02 * 0.0951626) =  0.1669839
    and the -inf padding gets a gradient of exactly 0 (no NaN)."""
    logp = GRPO_LOGP.clone().requires_grad_(True)
    grpo_loss(logp, None, GRPO_REF, GRPO_MASK, GRPO_ADV, 0.2, 0.02)["loss"].backward()
    g = logp.grad
    assert bool(torch.isfinite(g).all()) and g.shape == (2, 3)
    assert g[0].tolist() == pytest.approx([-0.1245242, -0.1230327, 0.0], abs=TOL)
    assert g[1].tolist() == pytest.approx([0.1666667, 0.1666667, 0.1669839], abs=TOL)


def test_grpo_loss_off_policy_clipping():
    """One sequence, A = +1, ratios exp(logp - old) = [1.5, 0.5]:
        token 0: -min(1.5, 1.2) = -1.2 (clipped); token 1: -min(0.5, 0.8) = -0.5 (unclipped)
        pg = (-1.2 - 0.5) / 2 = -0.85; the clipped branch is active for token 0 only -> clip fraction 1/2
        (token 1 lies outside [0.8, 1.2] too, but with A > 0 a low ratio is not clipped).
    Gradient: token 0 clipped -> 0; token 1 -> -(1/2) A r = -0.25 (d r / d logp = r = 0.5)."""
    old = _t([-1.0, -1.0])
    logp = (old + torch.log(_t([1.5, 0.5]))).requires_grad_(True)
    out = grpo_loss(logp, old, None, _mask([1, 1]), [1.0], 0.2, 0.0)
    assert out["pg"].item() == pytest.approx(-0.85, abs=1e-12)
    assert out["kl"].item() == 0.0 and out["clip_fraction"].item() == 0.5
    out["loss"].backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.25], abs=1e-12)


def test_grpo_loss_empty_rows_and_batch():
    """A row with an empty mask is ignored (not averaged in as 0); an empty batch gives 0 with a working backward."""
    out = grpo_loss(GRPO_LOGP[:1].expand(2, 3), None, None, _mask([1, 1, 0], [0, 0, 0]), [0.5, 7.0], 0.2, 0.0)
    assert out["loss"].item() == pytest.approx(-0.5, abs=1e-12)
    logp = torch.zeros(0, 4, requires_grad=True)
    out = grpo_loss(logp, None, None, torch.zeros(0, 4, dtype=torch.bool), torch.zeros(0), 0.2, 0.0)
    out["loss"].backward()
    assert out["loss"].item() == 0.0 and logp.grad.shape == (0, 4)


def test_grpo_loss_argument_errors():
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
        grpo_loss(GRPO_LOGP, None, GRPO_REF, GRPO_MASK, [1.0], 0.2, 0.02)
    with pytest.raises(ValueError, match="ref_logp is required"):
        grpo_loss(GRPO_LOGP, None, None, GRPO_MASK, GRPO_ADV, 0.2, 0.02)
    with pytest.raises(ValueError, match=r"mask must have the same \[B, T\] shape"):
        grpo_loss(GRPO_LOGP, None, GRPO_REF, _mask([1, 1]), GRPO_ADV, 0.2, 0.02)
    with pytest.raises(ValueError, match="beta"):
        grpo_loss(GRPO_LOGP, None, GRPO_REF, GRPO_MASK, GRPO_ADV, 0.2, -0.1)
    with pytest.raises(ValueError, match="eps"):
        grpo_loss(GRPO_LOGP, None, GRPO_REF, GRPO_MASK, GRPO_ADV, 1.5, 0.02)
    with pytest.raises(ValueError, match=r"\[B, T\] tensor"):
        grpo_loss(torch.zeros(3), None, None, torch.ones(3), [1.0], 0.2, 0.0)


# ----------------------------------------------------------------------------------------------------------------------
# Distillation
# ----------------------------------------------------------------------------------------------------------------------

Z_S = _t(2.0, 0.0, -1.0)
Z_T = _t(0.0, 1.0, 0.0)


def test_kl_teacher_student_at_t1():
    """P_S = softmax([2, 0, -1]) = [7.389056, 1, 0.367879] / 8.756935 = [0.843795, 0.114195, 0.042010]
    P_T = softmax([0, 1, 0])  = [1, 2.718282, 1] / 4.718282          = [0.211942, 0.576117, 0.211942]
    KL(T||S) = sum P_T log(P_T / P_S)
             = 0.211942 ln(0.251177) + 0.576117 ln(5.045018) + 0.211942 ln(5.045018)
             = -0.292818 + 0.932388 + 0.343006 = 0.982577."""
    assert torch.softmax(Z_S, -1).tolist() == pytest.approx([0.843795, 0.114195, 0.042010], abs=TOL)
    assert torch.softmax(Z_T, -1).tolist() == pytest.approx([0.211942, 0.576117, 0.211942], abs=TOL)
    assert kl_divergence(Z_S, Z_T, 1.0).item() == pytest.approx(0.982577, abs=TOL)


def test_kl_at_t2_and_t_squared():
    """T = 2: P_S = softmax([1, 0, -0.5]) = [0.628532, 0.231224, 0.140244];
    P_T = softmax([0, 0.5, 0]) = [0.274069, 0.451863, 0.274069];
    KL = 0.274069 ln(0.436046) + 0.451863 ln(1.954222) + 0.274069 ln(1.954222)
       = -0.227479 + 0.302744 + 0.183624 = 0.258889;  x T^2 = 4 * 0.258889 = 1.035556."""
    assert kl_divergence(Z_S, Z_T, 2.0).item() == pytest.approx(0.258889, abs=TOL)
    assert scaled_kl_divergence(Z_S, Z_T, 2.0).item() == pytest.approx(1.035556, abs=TOL)


def test_generalized_jsd_spec_value():
    """beta = 0.5, T = 1.1: P_S = softmax([1.818182, 0, -0.909091]) = [0.814519, 0.132213, 0.053267],
    P_T = softmax([0, 0.909091, 0]) = [0.223111, 0.553777, 0.223111]; M = (P_T + P_S) / 2 =
    [0.518815, 0.342995, 0.138189];
    KL(P_T||M) = 0.223111 ln(0.430040) + 0.553777 ln(1.614533) + 0.223111 ln(1.614533)
               = -0.188279 + 0.265285 + 0.106881 = 0.183887
    KL(P_S||M) = 0.814519 ln(1.569960) + 0.132213 ln(0.385467) + 0.053267 ln(0.385467) = 0.190570
    JSD = 0.5 * 0.183887 + 0.5 * 0.190570 = 0.187228 (no T^2 factor)."""
    assert generalized_jsd(Z_S, Z_T, beta=0.5, temperature=1.1).item() == pytest.approx(0.187228, abs=TOL)


def test_divergence_properties():
    """D(P, P) = 0; JSD_0.5 is symmetric and <= ln 2; for beta != 0.5 swapping the arguments and beta gives the
    same value (beta KL(T||M) + (1-beta) KL(S||M) with M = beta T + (1-beta) S); works on [B, T, V] batches."""
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 7, dtype=F64) * 3, torch.randn(2, 5, 7, dtype=F64) * 3
    assert kl_divergence(s, s).abs().max().item() < 1e-12
    assert generalized_jsd(s, s).abs().max().item() < 1e-12
    jsd = generalized_jsd(s, t, 0.5, 1.0)
    assert jsd.shape == (2, 5)
    assert torch.allclose(jsd, generalized_jsd(t, s, 0.5, 1.0), atol=1e-12)
    assert bool((jsd >= 0).all()) and bool((jsd <= math.log(2) + 1e-12).all())
    assert torch.allclose(generalized_jsd(s, t, 0.3), generalized_jsd(t, s, 0.7), atol=1e-12)


def test_distillation_gradients_reach_student_only():
    """Gradients w.r.t. the student logits are finite and sum to 0 over the vocabulary (softmax invariance to a
    constant shift); the teacher is detached (no grad)."""
    torch.manual_seed(1)
    s = torch.randn(2, 3, 11, requires_grad=True)
    t = torch.randn(2, 3, 11, requires_grad=True)
    for divergence in ("jsd", "forward_kl"):
        s.grad = None
        distill_loss(s, t, torch.ones(2, 3), divergence, 0.5, 1.1).backward()
        assert s.grad.shape == (2, 3, 11) and bool(torch.isfinite(s.grad).all())
        assert s.grad.sum(-1).abs().max().item() < 1e-6
        assert s.grad.abs().sum().item() > 0 and t.grad is None


def test_distill_loss_is_a_mean_over_completion_tokens():
    """Batch of 2 rows x 3 positions; the SPEC pair (z_S, z_T) at positions [0, 0] and [1, 2], identical
    student/teacher logits (divergence 0) at [0, 1] and [1, 0], and a wildly different pair at the masked-out
    [0, 2] and [1, 1]. Mask has 4 completion tokens:
        jsd (beta 0.5, T 1.1):  (0.187228 + 0 + 0 + 0.187228) / 4 = 0.093614
        forward_kl, T = 2:      (0.258889 * 2) / 4 = 0.129445;  with T^2: 0.517778
    and a bf16 copy of the logits gives the same to bf16 precision."""
    same = _t(0.3, -0.2, 0.1)
    far_s, far_t = _t(50.0, -50.0, 0.0), _t(-50.0, 50.0, 0.0)
    student = torch.stack([torch.stack([Z_S, same, far_s]), torch.stack([same, far_s, Z_S])])  # [2, 3, 3]
    teacher = torch.stack([torch.stack([Z_T, same, far_t]), torch.stack([same, far_t, Z_T])])  # [2, 3, 3]
    mask = _mask([1, 1, 0], [1, 0, 1])
    assert distill_loss(student, teacher, mask, "jsd", 0.5, 1.1).item() == pytest.approx(0.093614, abs=TOL)
    assert distill_loss(student, teacher, mask, "forward_kl", temperature=2.0).item() == pytest.approx(
        0.129445, abs=TOL)
    assert distill_loss(student, teacher, mask, "forward_kl", temperature=2.0, t2_scaling=True).item() == (
        pytest.approx(0.517778, abs=TOL))
    bf16 = distill_loss(student.bfloat16(), teacher.bfloat16(), mask, "jsd", 0.5, 1.1)
    assert bf16.dtype == torch.float32 and bf16.item() == pytest.approx(0.093614, abs=2e-2)


def test_distill_loss_empty_mask_and_errors():
    """All-empty mask or empty batch -> 0 with a working backward; bad arguments are clear ValueErrors."""
    s = torch.randn(2, 3, 5, requires_grad=True)
    loss = distill_loss(s, torch.randn(2, 3, 5), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(s.grad, torch.zeros(2, 3, 5))
    empty = torch.zeros(0, 3, 5, requires_grad=True)
    distill_loss(empty, torch.zeros(0, 3, 5), torch.zeros(0, 3)).backward()
    t = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="divergence must be one of"):
        distill_loss(s, t, torch.ones(2, 3), "reverse_kl")
    for beta in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="beta"):
            distill_loss(s, t, torch.ones(2, 3), "jsd", beta=beta)
    with pytest.raises(ValueError, match="temperature"):
        distill_loss(s, t, torch.ones(2, 3), "forward_kl", temperature=0.0)
    with pytest.raises(ValueError, match="same shape"):
        distill_loss(s, torch.randn(2, 3, 6), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask must have shape"):
        distill_loss(s, t, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        distill_loss(s[0], t[0], torch.ones(3))


# ----------------------------------------------------------------------------------------------------------------------
# RLTF-SD
# ----------------------------------------------------------------------------------------------------------------------

R0 = [1.0, 0.0, 0.0, 0.0]
CONTINUED = [False, True, True, True]
A_RL0 = [1.0, 0.0, -1.0, 0.0]
A_RL1 = [0.25, 0.25, -0.75, 0.25]
A_SD = [0.75, 0.75, -0.25, 0.75]


def test_rltf_sd_advantages_spec_example():
    """N = 4, r0 = [1, 0, 0, 0]. Sample 0 is right -> early termination, y1 := y0, so r1[0] := r0[0] = 1;
    samples 1, 2, 3 are revised with r1 = [1, 0, 1] -> full r1 = [1, 1, 0, 1]. gamma = 1:
        R = r0 + r1 = [2, 1, 0, 1], mean R = 1        -> A_RL0 = [1, 0, -1, 0]
        mean r1 = 3/4 = 0.75                          -> A_RL1 = [0.25, 0.25, -0.75, 0.25]
        A_sd = r1 - mean r0, mean r0 = 1/4 = 0.25     -> A_sd  = [0.75, 0.75, -0.25, 0.75]
    The compact r1 (continued samples only, SPEC §8's form) and the full-length r1 give the same; in the full form
    the terminated sample's entry is ignored (here a deliberately wrong 0)."""
    for r1 in ([1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]):
        a_rl0, a_rl1, a_sd = rltf_sd_advantages(R0, r1, CONTINUED, gamma=1.0)
        assert a_rl0.tolist() == pytest.approx(A_RL0, abs=TOL)
        assert a_rl1.tolist() == pytest.approx(A_RL1, abs=TOL)
        assert a_sd.tolist() == pytest.approx(A_SD, abs=TOL)


def test_rltf_sd_advantages_gamma_and_batches():
    """gamma = 0.5: R = r0 + 0.5 r1 = [1.5, 0.5, 0, 0.5], mean = 2.5 / 4 = 0.625
    -> A_RL0 = [0.875, -0.125, -0.625, -0.125] (A_RL1, A_sd do not involve gamma).
    [P, N] input: each row uses its own means (row 1: all wrong, r1 = [0, 0, 0, 1] -> A_RL1 = [-.25, -.25, -.25, .75],
    A_sd = r1 - 0 = r1, R = r1 -> A_RL0 = A_RL1)."""
    a_rl0, a_rl1, a_sd = rltf_sd_advantages(R0, [1.0, 0.0, 1.0], CONTINUED, gamma=0.5)
    assert a_rl0.tolist() == pytest.approx([0.875, -0.125, -0.625, -0.125], abs=TOL)
    assert a_rl1.tolist() == pytest.approx(A_RL1, abs=TOL) and a_sd.tolist() == pytest.approx(A_SD, abs=TOL)
    r0 = torch.tensor([R0, [0.0, 0.0, 0.0, 0.0]])
    r1 = torch.tensor([[9.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    cont = torch.tensor([CONTINUED, [True] * 4])
    a_rl0, a_rl1, a_sd = rltf_sd_advantages(r0, r1, cont)
    assert a_rl0.shape == a_rl1.shape == a_sd.shape == (2, 4)
    assert a_rl0.flatten().tolist() == pytest.approx(A_RL0 + [-0.25, -0.25, -0.25, 0.75], abs=TOL)
    assert a_rl1.flatten().tolist() == pytest.approx(A_RL1 + [-0.25, -0.25, -0.25, 0.75], abs=TOL)
    assert a_sd.flatten().tolist() == pytest.approx(A_SD + [0.0, 0.0, 0.0, 1.0], abs=TOL)


def test_rltf_sd_advantages_errors():
    with pytest.raises(ValueError, match="r1 must have the shape of r0"):
        rltf_sd_advantages(R0, [1.0, 0.0], CONTINUED)
    with pytest.raises(ValueError, match="continued must have the shape"):
        rltf_sd_advantages(R0, [1.0, 0.0, 1.0], [True, True])
    with pytest.raises(ValueError, match="gamma"):
        rltf_sd_advantages(R0, [1.0, 0.0, 1.0], CONTINUED, gamma=-1.0)
    with pytest.raises(ValueError, match="finite"):
        rltf_sd_advantages(R0, [1.0, float("inf"), 1.0], CONTINUED)


def test_rltf_sd_loss_by_hand():
    """N = 4 one-token sequences, the SPEC advantages, on-policy (ratios 1), all log-probs ln 0.5:
        RL0 = mean(-A_RL0) = 0 and RL1 = mean(-A_RL1) = 0 (mean-centred advantages);
        SD  = mean(-A_sd * ln 0.5) = -mean(A_sd) ln 0.5 = -(2.0 / 4)(-0.693147) = 0.346574;
        beta = 0.1 with logp0 - ref0 = 0.1 everywhere (k3 = 0.0048374) and ref1 = logp1 (k3 = 0):
        RL0 = 0 + 0.1 * 0.0048374 = 0.00048374, kl = 0.0048374;
        loss = 0.1 * 0.346574 + 1.0 * (0.00048374 + 0) = 0.0351411.
    Gradients: d/d logp0_i = (1/4)(-A_RL0_i + 0.1 (1 - e^-0.1)) = -A_RL0_i / 4 + 0.0023791;
               d/d logp_sd_i = 0.1 (-A_sd_i) / 4 = [-0.01875, -0.01875, 0.00625, -0.01875]."""
    half = torch.full((4, 1), math.log(0.5), dtype=F64)
    logp0, logp1, logp_sd = (half.clone().requires_grad_(True) for _ in range(3))
    ones = torch.ones(4, 1, dtype=torch.bool)
    adv = rltf_sd_advantages(R0, [1.0, 0.0, 1.0], CONTINUED)
    out = rltf_sd_loss(logp0, ones, logp1, ones, logp_sd, ones, adv, beta=0.1,
                       ref_logp0=half - 0.1, ref_logp1=half)
    assert set(out) == {"loss", "sd", "rl0", "rl1", "kl"}
    assert out["sd"].item() == pytest.approx(0.346574, abs=TOL)
    assert out["rl0"].item() == pytest.approx(0.00048374, abs=1e-7)
    assert out["rl1"].item() == pytest.approx(0.0, abs=1e-12)
    assert out["kl"].item() == pytest.approx(0.0048374, abs=1e-7)
    assert out["loss"].item() == pytest.approx(0.0351411, abs=TOL)
    out["loss"].backward()
    assert logp0.grad.flatten().tolist() == pytest.approx([-0.25 + 0.0023791, 0.0023791, 0.25 + 0.0023791,
                                                           0.0023791], abs=TOL)
    assert logp_sd.grad.flatten().tolist() == pytest.approx([-0.01875, -0.01875, 0.00625, -0.01875], abs=1e-12)
    assert logp1.grad.flatten().tolist() == pytest.approx([-a / 4 for a in A_RL1], abs=1e-12)


def test_rltf_sd_loss_masks_and_errors():
    """Padding holding -inf in the SD stream gives finite values and gradients; the advantages must be the triple."""
    logp_sd = torch.tensor([[-0.5, -math.inf]] * 4, dtype=F64, requires_grad=True)
    mask_sd = _mask(*[[1, 0]] * 4)
    zeros = torch.zeros(4, 1, dtype=F64, requires_grad=True)
    ones = torch.ones(4, 1, dtype=torch.bool)
    adv = rltf_sd_advantages(R0, [1.0, 0.0, 1.0], CONTINUED)
    out = rltf_sd_loss(zeros, ones, zeros, ones, logp_sd, mask_sd, adv, beta=0.0)
    out["loss"].backward()
    assert out["sd"].item() == pytest.approx(0.5 * 0.5, abs=1e-12)  # -mean(A_sd) * (-0.5) = 0.5 * 0.5
    assert bool(torch.isfinite(logp_sd.grad).all()) and logp_sd.grad[:, 1].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="triple"):
        rltf_sd_loss(zeros, ones, zeros, ones, zeros, ones, adv[:2], beta=0.0)
    with pytest.raises(ValueError, match="sd_coef"):
        rltf_sd_loss(zeros, ones, zeros, ones, zeros, ones, adv, beta=0.0, sd_coef=-1.0)
    with pytest.raises(ValueError, match=r"A_sd must have shape"):
        rltf_sd_loss(zeros, ones, zeros, ones, zeros[:3], ones[:3], adv, beta=0.0)
