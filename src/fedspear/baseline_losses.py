"""Losses of the baselines (SPEC §5): GRPO, OPSD-style distillation and RLTF-SD, as pure torch functions.

Like :mod:`fedspear.losses`, nothing here knows about models, tokenizers or Flower: the caller runs the model(s),
aligns positions so that ``logits[:, i]`` predicts completion token ``i`` (see :func:`fedspear.losses.token_logprobs`),
and passes per-token tensors with ``[B, T]`` boolean completion masks.

Shapes: ``B`` sequences in a batch, ``T`` token positions, ``V`` vocabulary size, ``G`` samples per prompt (GRPO
group), ``N`` samples per prompt (RLTF-SD), ``P`` prompts.

GRPO (Shao et al. 2024, "DeepSeekMath", §4.1; SPEC §5)
    - :func:`grpo_advantages` -- group-normalised outcome advantages ``(r - mean) / (std + 1e-4)``.
    - :func:`ppo_clip_loss` -- per-token clipped surrogate ``-min(r A, clip(r, 1 - eps, 1 + eps) A)``.
    - :func:`k3_kl` -- per-token k3 estimator of ``KL(pi || pi_ref)`` (Schulman 2020, "Approximating KL divergence").
    - :func:`grpo_loss` -- surrogate + ``beta`` * k3, mean over sequences of per-sequence token means.

Distillation (OPSD, Zhao et al. 2026; SPEC §5)
    - :func:`kl_divergence`, :func:`scaled_kl_divergence` -- ``KL(P_T || P_S)`` at temperature ``T`` (and ``T^2``
      times it, Hinton et al. 2015).
    - :func:`generalized_jsd` -- the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, "On-policy
      distillation of language models").
    - :func:`distill_loss` -- either divergence over the full vocabulary, mean over completion tokens.

RLTF-SD (Song et al. 2026, "Expanding the capabilities of reinforcement learning via text feedback"; SPEC §5)
    - :func:`rltf_sd_advantages` -- ``(A_RL0, A_RL1, A_sd)`` from first- and second-turn rewards.
    - :func:`rltf_sd_loss` -- ``sd_coef * SD + rl_coef * (RL0 + RL1)``, each RL term a GRPO-style loss with k3 KL.

Paper values (appendix baseline tables): GRPO clip ``eps = 0.2``; ``beta_KL = 0.02`` (0.1 for StrategyQA); group size
2 / 4 / 2 / 4 for MathMCQA / ARC / StrategyQA / HellaSwag. OPSD: generalised JSD ``beta = 0.5`` at temperature 1.1.
RLTF-SD: ``gamma = 1``, SD coefficient 0.1, RL coefficient 1.0, early termination on. They live in the algorithm
configs, not here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .losses import _as_mask, _at_least_float32, _check_2d  # shared argument checks

GRPO_STD_EPS = 1e-4
"""Added to the group standard deviation in :func:`grpo_advantages` (SPEC §5; TRL's GRPOTrainer uses the same)."""

DIVERGENCES = ("jsd", "forward_kl")


# ----------------------------------------------------------------------------------------------------------------------
# Argument checks (clear messages instead of tracebacks from deep inside torch)
# ----------------------------------------------------------------------------------------------------------------------


def _shape(x) -> object:
    return tuple(x.shape) if torch.is_tensor(x) else type(x).__name__




def _check_same_2d(reference_name: str, reference: torch.Tensor, name: str, x: torch.Tensor) -> None:
    _check_2d(name, x)
    if x.shape != reference.shape:
        raise ValueError(f"{name} must have the same [B, T] shape as {reference_name}, got {tuple(x.shape)} and "
                         f"{tuple(reference.shape)}")






def _as_float_tensor(name: str, x, like: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (tensor, list, numpy array) as a floating tensor; integer/bool rewards become float32."""
    try:
        t = x if torch.is_tensor(x) else torch.as_tensor(x, device=like.device if like is not None else None)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be numbers (a tensor, list or array), got {type(x).__name__}") from exc
    if like is not None:
        return t.to(dtype=like.dtype, device=like.device)
    return t if t.is_floating_point() else t.float()


def _check_number(name: str, value, low: float, high: float, *, low_open: bool, high_open: bool, why: str) -> float:
    """``value`` as a float inside the stated interval, else a ValueError that names ``name`` and ``why``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number ({why}), got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval} ({why}), got {value!r}")
    return value


def _check_eps(eps) -> float:
    return _check_number("eps", eps, 0.0, 1.0, low_open=True, high_open=True,
                         why="PPO clip range; the paper uses 0.2")


def _check_beta_kl(beta) -> float:
    return _check_number("beta", beta, 0.0, math.inf, low_open=False, high_open=True,
                         why="KL weight; the paper uses 0.02, 0.1 for StrategyQA")


def _check_temperature(temperature) -> float:
    return _check_number("temperature", temperature, 0.0, math.inf, low_open=True, high_open=True,
                         why="softmax temperature; OPSD uses 1.1")


def _check_jsd_beta(beta) -> float:
    return _check_number("beta", beta, 0.0, 1.0, low_open=True, high_open=True,
                         why="generalised-JSD mixture weight; OPSD uses 0.5; for beta -> 0 or 1 use forward_kl")


def _sequence_mean_of_token_means(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_b (sum_t x_bt m_bt / sum_t m_bt)`` over rows with a non-empty mask; 0 (attached) if there are none.

    ``per_token`` must already be 0 (and finite) at masked-out positions: callers sanitise their inputs with
    ``torch.where`` first, so padding holding ``-inf`` cannot produce NaN values or gradients.
    """
    counts = mask.sum(-1)  # [B]
    per_row = per_token.sum(-1) / counts.clamp(min=1)  # [B]  empty rows -> 0 ...
    return per_row.sum() / (counts > 0).sum().clamp(min=1)  # ... and are not counted


# ----------------------------------------------------------------------------------------------------------------------
# GRPO (Shao et al. 2024)
# ----------------------------------------------------------------------------------------------------------------------


def grpo_advantages(rewards) -> torch.Tensor:
    """Group-relative advantages ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)`` (Shao et al. 2024 §4.1.2; SPEC §5).

    ``std`` is Bessel-corrected (divides by ``G - 1``, as ``torch.std`` and TRL's GRPOTrainer). A group whose
    rewards are all equal (including a group of one, where the Bessel std is undefined) gets advantage exactly 0:
    it carries no learning signal, and the explicit zero keeps round-off in ``r - mean`` from being multiplied by
    ``1 / 1e-4``.

    Args:
        rewards: ``[G]`` (one group) or ``[P, G]`` (one group per row); tensor, list or numpy array. Integer or
            boolean rewards (e.g. ``IsCorrect``) are converted to float32.

    Returns:
        Same shape as ``rewards``, floating point (float32 unless ``rewards`` is float64), no gradient path needed.

    Example (SPEC §8): ``[1, 0, 0, 1]`` -> mean 0.5, std ``sqrt(1/3) = 0.577350`` ->
    ``+-0.5 / 0.577450 = +-0.865875``.

    Raises:
        ValueError: ``rewards`` is not 1-D or 2-D, is empty along ``G``, or holds non-finite values.
    """
    r = _as_float_tensor("rewards", rewards)
    if r.dim() not in (1, 2) or r.shape[-1] == 0:
        raise ValueError(f"rewards must have shape [G] or [P, G] with G >= 1, got {tuple(r.shape)}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    grouped = r.unsqueeze(0) if r.dim() == 1 else r  # [P, G]
    constant = grouped.amax(-1, keepdim=True) == grouped.amin(-1, keepdim=True)  # [P, 1]
    mean = grouped.mean(-1, keepdim=True)  # [P, 1]
    if grouped.shape[-1] > 1:
        std = grouped.std(-1, keepdim=True, correction=1)  # [P, 1]
    else:
        std = torch.zeros_like(mean)  # [P, 1]  a group of one is constant anyway
    adv = torch.where(constant, torch.zeros_like(grouped), (grouped - mean) / (std + GRPO_STD_EPS))  # [P, G]
    return adv.reshape(r.shape)


def ppo_clip_loss(ratio: torch.Tensor, advantage: torch.Tensor, eps: float = 0.2) -> torch.Tensor:
    """Per-token PPO clipped surrogate, negated for minimisation: ``-min(r A, clip(r, 1 - eps, 1 + eps) A)``.

    (Schulman et al. 2017, Eq. 7; the GRPO objective of Shao et al. 2024, Eq. 3, uses it per token.)

    Args:
        ratio: ``r = pi_theta / pi_old`` per token, any shape (usually ``[B, T]``, from ``exp(logp - old_logp)``).
        advantage: broadcastable to ``ratio`` (``[B, 1]`` for one advantage per sequence, or ``[B, T]``).
        eps: clip range in ``(0, 1)`` (paper: 0.2).

    Returns:
        The broadcast shape; differentiable w.r.t. ``ratio`` (zero gradient where the clipped branch is the min).

    Examples (SPEC §8, eps = 0.2): ``r = 1.5, A = -1`` -> ``-min(-1.5, -1.2) = 1.5``; ``r = 0.5, A = -1`` ->
    ``-min(-0.5, -0.8) = 0.8``; ``r = 1.5, A = +1`` -> ``-min(1.5, 1.2) = -1.2``.

    Raises:
        ValueError: ``eps`` outside ``(0, 1)``, non-tensor ``ratio``, or shapes that do not broadcast.
    """
    eps = _check_eps(eps)
    if not torch.is_tensor(ratio):
        raise ValueError(f"ratio must be a tensor, got {type(ratio).__name__}")
    advantage = _as_float_tensor("advantage", advantage, like=ratio)
    try:
        torch.broadcast_shapes(ratio.shape, advantage.shape)
    except RuntimeError as exc:
        raise ValueError(f"advantage of shape {tuple(advantage.shape)} does not broadcast to ratio of shape "
                         f"{tuple(ratio.shape)} (use [B, 1] for one advantage per sequence)") from exc
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps) * advantage
    return -torch.minimum(unclipped, clipped)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of ``KL(pi_theta || pi_ref)`` (Schulman 2020; Shao et al. 2024, Eq. 4).

    With ``x = log pi_ref - log pi_theta`` (the log of ``pi_ref / pi_theta``): ``k3 = exp(x) - x - 1 >= 0``,
    unbiased for ``KL(pi_theta || pi_ref)`` when the token was sampled from ``pi_theta``, 0 iff the log-probs agree.
    SPEC §8 states it in terms of ``d = log pi_theta - log pi_ref = -x``: ``k3 = exp(-d) + d - 1``, so
    ``d = 0.1 -> 0.0048374`` and ``d = 0.5 -> 0.1065307`` (the other direction, ``exp(d) - d - 1``, would give
    0.0051709 and 0.1487213 -- not what the spec, TRL or GRPO use).

    Gradient w.r.t. ``logp``: ``1 - pi_ref / pi_theta``. Not clamped: ``exp(x)`` overflows float32 only when the
    reference is ``e^88`` times more likely than the policy, which a token sampled from the policy does not reach
    in practice; positions the caller masks out should be sanitised first (as :func:`grpo_loss` does).

    Args:
        logp: policy token log-probabilities, any shape (usually ``[B, T]``).
        ref_logp: reference-model log-probabilities, same shape (the base model with the adapter disabled).

    Returns:
        Same shape, in ``logp``'s dtype (at least float32). Differentiable w.r.t. both arguments; callers pass a
        detached ``ref_logp``.

    Raises:
        ValueError: shapes differ or an argument is not a tensor.
    """
    if not torch.is_tensor(logp) or not torch.is_tensor(ref_logp) or logp.shape != ref_logp.shape:
        raise ValueError(f"logp and ref_logp must be tensors of the same shape, got {_shape(logp)} and "
                         f"{_shape(ref_logp)}")
    logp = _at_least_float32(logp)
    x = ref_logp.to(logp.dtype) - logp  # log(pi_ref / pi_theta)
    return torch.exp(x) - x - 1.0


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    advantages,
    eps: float,
    beta: float,
) -> dict[str, torch.Tensor]:
    """GRPO loss (Shao et al. 2024, Eq. 3, negated; SPEC §5): clipped surrogate plus ``beta`` times k3 KL.

    Per token ``l_bt = -min(r_bt A_b, clip(r_bt, 1 - eps, 1 + eps) A_b) + beta * k3_bt`` with
    ``r_bt = exp(logp_bt - old_logp_bt)``; the loss is the **mean over sequences of per-sequence token means**,
    ``mean_b (1/|o_b|) sum_t l_bt`` -- the original GRPO normalisation (TRL's ``loss_type="grpo"``), not the
    DAPO/Dr.GRPO token-level sum.

    Args:
        logp: ``[B, T]`` token log-probabilities under the current policy (differentiable).
        old_logp: ``[B, T]`` log-probabilities of the policy that sampled the completions, or ``None`` for a single
            on-policy step (then ``old_logp = logp.detach()``, ratio 1, and the surrogate's gradient is
            ``-A grad(logp)``). Detached here.
        ref_logp: ``[B, T]`` reference log-probabilities (base model, adapter disabled), detached here; ``None``
            allowed only with ``beta = 0``.
        mask: ``[B, T]`` completion tokens (EOS included); bool or 0/1.
        advantages: ``[B]``, one per sequence (:func:`grpo_advantages` of the prompt's group, flattened).
        eps: clip range in ``(0, 1)`` (paper: 0.2).
        beta: KL weight ``>= 0`` (paper: 0.02; 0.1 for StrategyQA).

    Returns:
        ``{"loss", "pg", "kl", "clip_fraction"}``: the total (differentiable); the surrogate and the k3 KL, each
        averaged the same way (un-weighted; ``loss = pg + beta * kl``); the fraction of completion tokens where
        the clipped branch is the min (``r > 1 + eps`` with ``A > 0`` or ``r < 1 - eps`` with ``A < 0``: their
        gradient is 0; TRL's ``clip_ratio``), no grad. Rows with an empty mask are ignored; an empty batch
        gives 0 attached to ``logp``'s graph. Masked-out positions may hold anything (``-inf`` included).

    Raises:
        ValueError: shapes differ (names given), ``advantages`` is not ``[B]``, bad ``eps`` / ``beta``, or
            ``ref_logp`` is None with ``beta > 0``.
    """
    eps, beta = _check_eps(eps), _check_beta_kl(beta)
    _check_2d("logp", logp)
    mask = _as_mask("mask", mask)  # [B, T]
    _check_same_2d("logp", logp, "mask", mask)
    logp = _at_least_float32(logp)  # [B, T]
    old_logp = logp.detach() if old_logp is None else old_logp
    _check_same_2d("logp", logp, "old_logp", old_logp)
    if ref_logp is None and beta > 0:
        raise ValueError(f"ref_logp is required when beta > 0 (got beta = {beta}); pass beta = 0 to train without "
                         f"the KL term")
    if ref_logp is not None:
        _check_same_2d("logp", logp, "ref_logp", ref_logp)
    adv = _as_float_tensor("advantages", advantages, like=logp)
    if adv.shape != (logp.shape[0],):
        raise ValueError(f"advantages must have shape [B] = ({logp.shape[0]},) (one per sequence), got "
                         f"{tuple(adv.shape)}")

    zeros = torch.zeros_like(logp)
    logp_s = torch.where(mask, logp, zeros)  # [B, T]  where, not *, so -inf padding cannot give NaN gradients
    old_s = torch.where(mask, old_logp.detach().to(logp.dtype), zeros)  # [B, T]
    ratio = torch.exp(logp_s - old_s)  # [B, T]  1 at masked positions
    pg_tok = torch.where(mask, ppo_clip_loss(ratio, adv.unsqueeze(-1), eps), zeros)  # [B, T]
    pg = _sequence_mean_of_token_means(pg_tok, mask)
    if ref_logp is not None:
        ref_s = torch.where(mask, ref_logp.detach().to(logp.dtype), zeros)  # [B, T]
        kl_tok = torch.where(mask, k3_kl(logp_s, ref_s), zeros)  # [B, T]
        kl = _sequence_mean_of_token_means(kl_tok, mask)
    else:
        kl = torch.zeros_like(pg)
    with torch.no_grad():
        a = adv.unsqueeze(-1)  # [B, 1]
        clipped = mask & (((ratio < 1.0 - eps) & (a < 0)) | ((ratio > 1.0 + eps) & (a > 0)))  # [B, T]
        clip_fraction = clipped.sum().to(logp.dtype) / mask.sum().clamp(min=1)
    return {"loss": pg + beta * kl, "pg": pg, "kl": kl, "clip_fraction": clip_fraction}


# ----------------------------------------------------------------------------------------------------------------------
# Distillation (OPSD, Zhao et al. 2026; GKD, Agarwal et al. 2024)
# ----------------------------------------------------------------------------------------------------------------------


def _check_logits_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if not torch.is_tensor(student_logits) or not torch.is_tensor(teacher_logits) or student_logits.dim() < 1:
        raise ValueError(f"student_logits and teacher_logits must be tensors [..., V], got {_shape(student_logits)} "
                         f"and {_shape(teacher_logits)}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits and teacher_logits must have the same shape [..., V] (same positions, same "
                         f"vocabulary), got {tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")


def _softened_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(z / T)`` over the last dimension, in float32 at least."""
    return torch.log_softmax(_at_least_float32(logits) / temperature, dim=-1)


def _kl_from_logprobs(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q) = sum_v p_v (log p_v - log q_v)`` over the last dimension; terms with ``p_v = 0`` are 0."""
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))  # 0 log 0 = 0 (never -inf - -inf = NaN)
    return (p * diff).sum(-1)


def kl_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Forward KL ``KL(P_T || P_S) = sum_v P_T(v) (log P_T(v) - log P_S(v))`` with ``P = softmax(z / T)``.

    The teacher is the target (mode-covering: the student is pushed to put mass wherever the teacher does). The
    teacher logits are **detached** -- in OPSD's ``teacher = current`` variant the teacher is the student's own
    network given privileged context, and the gradient must not flow through it.

    Args:
        student_logits, teacher_logits: ``[..., V]``, same shape; any float dtype (computed in float32 at least).
        temperature: ``T > 0``, applied to both.

    Returns:
        ``[...]`` (the vocabulary dimension summed out), ``>= 0``.

    Example (SPEC §8): ``z_S = [2, 0, -1]``, ``z_T = [0, 1, 0]`` -> 0.982577 at ``T = 1``, 0.258889 at ``T = 2``.

    Raises:
        ValueError: shapes differ, ``temperature <= 0``.
    """
    _check_logits_pair(student_logits, teacher_logits)
    temperature = _check_temperature(temperature)
    log_s = _softened_logprobs(student_logits, temperature)  # [..., V]
    log_t = _softened_logprobs(teacher_logits.detach(), temperature).to(log_s.dtype)  # [..., V]
    return _kl_from_logprobs(log_t, log_s)  # [...]


def scaled_kl_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``T^2 * KL(P_T || P_S)`` (Hinton et al. 2015, §2): the ``T^2`` keeps the gradient magnitude of softened
    targets comparable across temperatures. SPEC §8: 0.258889 at ``T = 2`` -> ``4 * 0.258889 = 1.035556``.
    Arguments and errors as :func:`kl_divergence`."""
    temperature = _check_temperature(temperature)
    return temperature**2 * kl_divergence(student_logits, teacher_logits, temperature)


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024), per position, over the full vocabulary.

    ``M = beta P_T + (1 - beta) P_S`` and ``JSD_beta = beta KL(P_T || M) + (1 - beta) KL(P_S || M)``, with
    ``P = softmax(z / T)`` for both. Bounded by ``-(beta log beta + (1 - beta) log(1 - beta))`` (``log 2`` at
    ``beta = 0.5``, where it is the ordinary, symmetric JSD). The mixture is formed in log space
    (``logsumexp``), as TRL's ``GKDTrainer.generalized_jsd_loss``; the teacher logits are detached. No ``T^2``
    factor (neither GKD nor TRL applies one).

    Args:
        student_logits, teacher_logits: ``[..., V]``, same shape, finite.
        beta: mixture weight in ``(0, 1)`` (OPSD: 0.5). The limits are degenerate (``JSD -> 0``); use
            :func:`kl_divergence` for a plain KL.
        temperature: ``T > 0`` (OPSD: 1.1).

    Returns:
        ``[...]``, ``>= 0``.

    Example (SPEC §8): ``z_S = [2, 0, -1]``, ``z_T = [0, 1, 0]``, ``beta = 0.5``, ``T = 1.1`` -> 0.187228.

    Raises:
        ValueError: shapes differ, ``beta`` outside ``(0, 1)``, ``temperature <= 0``.
    """
    _check_logits_pair(student_logits, teacher_logits)
    beta, temperature = _check_jsd_beta(beta), _check_temperature(temperature)
    log_s = _softened_logprobs(student_logits, temperature)  # [..., V]
    log_t = _softened_logprobs(teacher_logits.detach(), temperature).to(log_s.dtype)  # [..., V]
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log1p(-beta)]), dim=0)  # [..., V]
    return beta * _kl_from_logprobs(log_t, log_m) + (1.0 - beta) * _kl_from_logprobs(log_s, log_m)  # [...]


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    divergence: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    *,
    t2_scaling: bool = False,
) -> torch.Tensor:
    """OPSD distillation loss (SPEC §5): a per-token divergence over the full vocabulary, mean over completion tokens.

    ``sum_{b,t} m_bt D_bt / sum_{b,t} m_bt`` (a token mean over the whole batch, as TRL's GKD trainer with
    ``reduction="batchmean"`` over completion tokens), with ``D`` = :func:`generalized_jsd` (``"jsd"``, OPSD's
    default: ``beta = 0.5``, ``T = 1.1``) or :func:`kl_divergence` (``"forward_kl"``, ``KL(teacher || student)``; the
    SPEAR authors' variant uses ``T = 2``, ``t2_scaling=True`` and the current model as the teacher).

    The student and teacher logits must be aligned on the same completion positions: the teacher sees the
    privileged context (gold answer, solution or facts) and the student only the prompt, so the caller slices
    each model's logits to the positions predicting the completion tokens. Processed one batch row at a time, so
    the float32 intermediates alive at once are ``[T, V]`` rather than ``[B, T, V]``.

    Args:
        student_logits, teacher_logits: ``[B, T, V]``, same shape; the teacher is detached.
        mask: ``[B, T]`` completion tokens (EOS included).
        divergence: ``"jsd"`` or ``"forward_kl"``.
        beta: mixture weight for ``"jsd"`` (ignored by ``"forward_kl"``).
        temperature: ``T > 0`` for both models.
        t2_scaling: multiply by ``T^2`` (Hinton et al. 2015). Off by default, as in GKD / TRL and SPEC §8's JSD
            value; on for the SPEAR authors' forward-KL variant (SPEC §5/§8: ``4 * 0.258889 = 1.035556`` at
            ``T = 2``; ``fedspear.algorithms.opsd.VARIANTS["authors"]``).

    Returns:
        Scalar tensor; 0 attached to the graph for an empty batch or an all-empty mask.

    Raises:
        ValueError: unknown divergence, shapes that differ, bad ``beta`` / ``temperature``.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    temperature = _check_temperature(temperature)
    if divergence == "jsd":
        beta = _check_jsd_beta(beta)
    if not torch.is_tensor(student_logits) or student_logits.dim() != 3:
        raise ValueError(f"student_logits must be a [B, T, V] tensor, got {_shape(student_logits)}")
    _check_logits_pair(student_logits, teacher_logits)
    mask = _as_mask("mask", mask)  # [B, T]
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(f"mask must have shape [B, T] = {tuple(student_logits.shape[:2])} to match the logits "
                         f"{tuple(student_logits.shape)}, got {tuple(mask.shape)}")

    dtype = student_logits.dtype if student_logits.dtype in (torch.float32, torch.float64) else torch.float32
    total = torch.zeros((), dtype=dtype, device=student_logits.device)  # (no [B, T, V] float32 copy)
    if student_logits.shape[0] == 0:
        total = total + student_logits.sum() * 0.0  # stay attached to the graph
    for row_s, row_t, row_m in zip(student_logits, teacher_logits, mask):  # [T, V], [T, V], [T]
        if not bool(row_m.any()):
            total = total + row_s.sum() * 0.0
            continue
        if divergence == "jsd":
            per_token = generalized_jsd(row_s, row_t, beta, temperature)  # [T]
        else:
            per_token = kl_divergence(row_s, row_t, temperature)  # [T]
        total = total + torch.where(row_m, per_token, torch.zeros_like(per_token)).sum()
    loss = total / mask.sum().clamp(min=1)
    return temperature**2 * loss if t2_scaling else loss


# ----------------------------------------------------------------------------------------------------------------------
# RLTF-SD (Song et al. 2026), as the SPEAR authors ran it
# ----------------------------------------------------------------------------------------------------------------------


def rltf_sd_advantages(
    r0, r1, continued, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLTF-SD advantages ``(A_RL0, A_RL1, A_sd)`` for each group of ``N`` samples of one prompt (SPEC §5).

    Two-turn rollout: ``y0 ~ pi(.|x0)`` with reward ``r0``; a sample whose ``y0`` is wrong is *continued* with one
    feedback revision ``y1 ~ pi(.|x1)``, ``x1 = x0 || y0 || feedback``, reward ``r1``. **Early termination**
    (paper tables: on): a sample whose ``y0`` is right is not revised and gets ``y1 := y0``, so ``r1 := r0``. Then,
    with every mean over the ``N`` samples of the prompt (terminated ones included)::

        R      = r0 + gamma * r1            (return of the two-turn episode)
        A_RL0  = R  - mean(R)               (first turn, credited with the whole episode)
        A_RL1  = r1 - mean(r1)              (second turn)
        A_sd   = r1 - mean(r0)              (self-distillation: y1 judged against the first-turn baseline)

    No division by a standard deviation (unlike :func:`grpo_advantages`). ``A_sd`` is Song et al.'s first-turn
    baseline ``A(y1^i) = R(x0, y1^i) - (1/N) sum_j R(x0, y0^j)``: a revision is worth distilling into
    ``pi(.|x0)`` when it beats what the model achieves without feedback.

    SPEC §8 example (the text and the numbers agree): ``N = 4``, ``r0 = [1, 0, 0, 0]``; sample 0 is terminated, the
    continued samples 1, 2, 3 get ``r1 = [1, 0, 1]``, so the full ``r1 = [1, 1, 0, 1]`` (``r1[0] := r0[0] = 1``).
    ``R = [2, 1, 0, 1]``, ``mean R = 1`` -> ``A_RL0 = [1, 0, -1, 0]``; ``mean r1 = 0.75`` ->
    ``A_RL1 = [0.25, 0.25, -0.75, 0.25]``; ``mean r0 = 0.25`` -> ``A_sd = [0.75, 0.75, -0.25, 0.75]``.
    (The only subtlety is that the terminated sample counts in every mean, with ``r1 = r0``; leaving it out of
    ``mean r1`` would give ``A_RL1 = [., 1/3, -2/3, 1/3]`` instead.)

    Args:
        r0: ``[N]`` or ``[P, N]`` first-turn rewards (numbers; bools/ints accepted).
        r1: second-turn rewards, either the same shape as ``r0`` (entries of terminated samples are ignored and
            replaced by ``r0``) or, for a single group (``r0`` of shape ``[N]``), only the continued samples'
            rewards in order, shape ``[continued.sum()]`` -- the form SPEC §8 uses.
        continued: same shape as ``r0``, bool (0/1 accepted): True where ``y0`` was revised. With early
            termination this is ``r0`` wrong; it is taken as given, not recomputed.
        gamma: discount of the second-turn reward in ``R`` (paper: 1.0), finite and ``>= 0``.

    Returns:
        ``(A_RL0, A_RL1, A_sd)``, each the shape of ``r0``, floating point (float32 unless ``r0`` is float64).

    Raises:
        ValueError: wrong shapes (named), non-finite rewards, bad ``gamma``.
    """
    gamma = _check_number("gamma", gamma, 0.0, math.inf, low_open=False, high_open=True,
                          why="discount of the second-turn reward; the paper uses 1.0")
    r0 = _as_float_tensor("r0", r0)
    if r0.dim() not in (1, 2) or r0.shape[-1] == 0:
        raise ValueError(f"r0 must have shape [N] or [P, N] with N >= 1, got {tuple(r0.shape)}")
    cont = torch.as_tensor(continued, device=r0.device)
    if cont.shape != r0.shape:
        raise ValueError(f"continued must have the shape of r0 {tuple(r0.shape)}, got {tuple(cont.shape)}")
    cont = cont if cont.dtype == torch.bool else cont != 0
    r1 = _as_float_tensor("r1", r1, like=r0)
    n_continued = int(cont.sum())
    if r1.shape != r0.shape:
        if r0.dim() == 1 and r1.shape == (n_continued,):
            full = r0.clone()
            full[cont] = r1  # scatter the continued samples' rewards in order
            r1 = full
        else:
            raise ValueError(f"r1 must have the shape of r0 {tuple(r0.shape)}, or (for one group) one reward per "
                             f"continued sample, ({n_continued},); got {tuple(r1.shape)}")
    if not (bool(torch.isfinite(r0).all()) and bool(torch.isfinite(r1).all())):
        raise ValueError(f"rewards must be finite, got r0 = {r0.tolist()}, r1 = {r1.tolist()}")
    r1 = torch.where(cont, r1, r0)  # early termination: y1 := y0, so r1 := r0
    ret = r0 + gamma * r1  # R
    a_rl0 = ret - ret.mean(-1, keepdim=True)
    a_rl1 = r1 - r1.mean(-1, keepdim=True)
    a_sd = r1 - r0.mean(-1, keepdim=True)
    return a_rl0, a_rl1, a_sd


def rltf_sd_loss(
    logp0: torch.Tensor,
    mask0: torch.Tensor,
    logp1: torch.Tensor,
    mask1: torch.Tensor,
    logp_sd: torch.Tensor,
    mask_sd: torch.Tensor,
    advantages: Sequence,
    *,
    beta: float,
    eps: float = 0.2,
    old_logp0: torch.Tensor | None = None,
    old_logp1: torch.Tensor | None = None,
    ref_logp0: torch.Tensor | None = None,
    ref_logp1: torch.Tensor | None = None,
    sd_coef: float = 0.1,
    rl_coef: float = 1.0,
) -> dict[str, torch.Tensor]:
    """RLTF-SD objective as the SPEAR authors ran it (SPEC §5): ``sd_coef * SD + rl_coef * (RL0 + RL1)``.

    Three views of each of the ``N`` samples (rows in the same order as the advantages):

    - **RL0** -- first turn ``pi(y0 | x0)``: :func:`grpo_loss` with ``A_RL0`` (clipped surrogate + ``beta`` k3 KL).
    - **RL1** -- second turn ``pi(y1 | x1)``: :func:`grpo_loss` with ``A_RL1``. For an early-terminated sample
      ``y1 = y0`` and there is no feedback context, so its row is ``pi(y0 | x0)`` again.
    - **SD** -- self-distillation ``-A_sd log pi(y1 | x0)``: the revision scored under the *first-turn* context
      (no feedback), the advantage-weighted regression of Song et al. 2026. No ratio, no clipping, no KL.

    Averaging (**Decision**, consistent with :func:`grpo_loss` and SPEC §5's GRPO): each term is the mean over
    sequences of per-sequence token means, so ``SD = mean_i(-A_sd_i * mean_t log pi(y1_it | x0, y1_<t))``. The KL
    enters through the RL terms, ``RLk = PGk + beta * KLk``; with the paper's ``rl_coef = 1`` this is the SPEC's
    ``L = 0.1 SD + 1.0 (RL0 + RL1)`` "with beta k3 KL".

    Args:
        logp0, mask0: ``[N, T0]`` log pi(y0 | x0) and its completion mask.
        logp1, mask1: ``[N, T1]`` log pi(y1 | x1) and its completion mask.
        logp_sd, mask_sd: ``[N, T1']`` log pi(y1 | x0) and its completion mask (the same tokens as ``y1``; the
            length may differ from ``T1`` with padding).
        advantages: ``(A_RL0, A_RL1, A_sd)``, each ``[N]`` -- the output of :func:`rltf_sd_advantages` (flattened if
            it was ``[P, N]``).
        beta: k3 KL weight ``>= 0`` (``ref_logp0`` / ``ref_logp1`` required when ``> 0``).
        eps: PPO clip range (0.2).
        old_logp0, old_logp1: sampling-time log-probs for the ratio; ``None`` = on-policy (see :func:`grpo_loss`).
            The paper's "batch rollout" collects all rollouts before several gradient steps, so later steps pass them.
        ref_logp0, ref_logp1: reference (adapter disabled) log-probs of the same tokens.
        sd_coef, rl_coef: non-negative weights (paper tables: 0.1 and 1.0).

    Returns:
        ``{"loss", "sd", "rl0", "rl1", "kl"}``: the total (differentiable); the un-weighted SD term; each RL term
        including its ``beta * KL``; and ``kl = KL0 + KL1`` (un-weighted, for logging).

    Raises:
        ValueError: as :func:`grpo_loss`; advantages not three ``[N]`` vectors; negative coefficients.
    """
    for name, value in (("sd_coef", sd_coef), ("rl_coef", rl_coef)):
        _check_number(name, value, 0.0, math.inf, low_open=False, high_open=True,
                      why="loss weight; the paper uses sd_coef = 0.1, rl_coef = 1.0")
    if isinstance(advantages, torch.Tensor) or len(advantages) != 3:
        raise ValueError("advantages must be the triple (A_RL0, A_RL1, A_sd) returned by rltf_sd_advantages")
    a_rl0, a_rl1, a_sd = advantages
    rl0 = grpo_loss(logp0, old_logp0, ref_logp0, mask0, a_rl0, eps, beta)
    rl1 = grpo_loss(logp1, old_logp1, ref_logp1, mask1, a_rl1, eps, beta)

    _check_2d("logp_sd", logp_sd)
    mask_sd = _as_mask("mask_sd", mask_sd)  # [N, T]
    _check_same_2d("logp_sd", logp_sd, "mask_sd", mask_sd)
    logp_sd = _at_least_float32(logp_sd)  # [N, T]
    a_sd = _as_float_tensor("A_sd", a_sd, like=logp_sd)
    if a_sd.shape != (logp_sd.shape[0],):
        raise ValueError(f"A_sd must have shape [N] = ({logp_sd.shape[0]},), got {tuple(a_sd.shape)}")
    logp_sd = torch.where(mask_sd, logp_sd, torch.zeros_like(logp_sd))  # [N, T]  -inf padding -> 0 first
    sd_tok = torch.where(mask_sd, -a_sd.unsqueeze(-1) * logp_sd, torch.zeros_like(logp_sd))  # [N, T]
    sd = _sequence_mean_of_token_means(sd_tok, mask_sd)

    loss = sd_coef * sd + rl_coef * (rl0["loss"] + rl1["loss"])
    return {"loss": loss, "sd": sd, "rl0": rl0["loss"], "rl1": rl1["loss"], "kl": rl0["kl"] + rl1["kl"]}
