"""SPEAR's training losses (paper Eqs. 4-7) and Theorem 1's margin, as pure functions of log-probabilities and masks.

Nothing here knows about models, tokenizers or Flower: the caller runs the model, shifts logits and labels so that
``logits[:, i]`` predicts ``labels[:, i]``, and passes per-token tensors restricted to (or masked to) the completion.

Shapes: ``B`` traces in a batch, ``T`` token positions, ``V`` vocabulary size. Masks are ``[B, T]`` booleans.

- :func:`token_logprobs` -- ``log p(y_i | c, y_<i)`` from logits, in float32 at least.
- :func:`tail_mask` -- the tail set ``T_tau(y)`` (Eq. 5).
- :func:`win_nll` -- the win NLL (Eq. 4).
- :func:`gated_unlikelihood` -- the confidence-gated tail unlikelihood (Eq. 6).
- :func:`spear_loss` -- ``lambda_w * l_win + lambda_l * l_lose`` (Eq. 7).
- :func:`margin`, :func:`h_mu`, :func:`margin_lower_bound` -- the log-probability margin ``M_tau`` (Eq. 8) and the
  bound of Theorem 1 (Eqs. 9-10, paper §4), used as a per-round diagnostic and in a property test.

Normalisation (SPEC §3, **Decision**): ``"token"`` (default) is what produced the paper's numbers in the authors' code
-- token means over the batch; ``"sequence"`` is the paper's equations as written -- per-trace sums averaged over
traces. Theorem 1 is stated for the ``"sequence"`` form with one win and one lose trace.

Paper defaults (appendix hyper-parameter tables, identical for Qwen2.5-1.5B and Llama-3.2-3B): ``lambda_w = 1.0``,
``lambda_l = 0.1``, ``mu = 0.3``, ``tau = 32 / 0 / 24 / 0`` for MathMCQA / ARC-Challenge / StrategyQA / HellaSwag
(the tables' column order). They live in the algorithm config, not here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

NORMALIZATIONS = ("token", "sequence")

PROB_CLAMP = 1.0 - 1e-6
"""Upper bound on ``p`` inside ``-log(1 - p)`` (Eq. 6), so the unlikelihood term stays finite (at most
``log(1e6) ~= 13.8`` per token). Above the clamp the term is constant, so its gradient is zero there."""


# ----------------------------------------------------------------------------------------------------------------------
# Argument checks (clear messages instead of tracebacks from deep inside torch)
# ----------------------------------------------------------------------------------------------------------------------


def _check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def _check_mu(mu: float) -> None:
    if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0.0 < float(mu) < 1.0:
        raise ValueError(f"mu (the unlikelihood confidence threshold, Eq. 6) must be a number in (0, 1), got {mu!r}")


def _check_2d(name: str, x: torch.Tensor) -> None:
    if not torch.is_tensor(x) or x.dim() != 2:
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        raise ValueError(f"{name} must be a [B, T] tensor, got {shape}")


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    _check_2d(name_a, a)
    _check_2d(name_b, b)
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same [B, T] shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")


def _as_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """A boolean view of ``mask``; integer/float 0-1 masks (e.g. a tokenizer's attention mask) are accepted."""
    _check_2d(name, mask)
    return mask if mask.dtype == torch.bool else mask != 0


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half/bfloat16 to float32 (exp/log1p in bf16 lose ~3 significant digits); keep float32/float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _alpha_vector(alpha: torch.Tensor | Sequence[float], batch: int, like: torch.Tensor) -> torch.Tensor:
    alpha = torch.as_tensor(alpha, dtype=like.dtype, device=like.device)
    if alpha.shape != (batch,):
        raise ValueError(f"alpha must have shape [B] = ({batch},) (one confidence weight per lose trace), got "
                         f"{tuple(alpha.shape)}")
    if bool((alpha < 0).any()) or not bool(torch.isfinite(alpha).all()):
        raise ValueError(f"alpha must be finite and non-negative (paper: 1.0 or 0.5), got {alpha.tolist()}")
    return alpha


def _check_positive(name: str, value) -> None:
    if torch.is_tensor(value):
        if bool((value <= 0).any()):
            raise ValueError(f"{name} must be positive, got {value.tolist()}")
    elif not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Per-token quantities
# ----------------------------------------------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p_theta(y_i | c, y_<i)`` for every position: ``log_softmax(logits)`` gathered at ``labels``.

    Args:
        logits: ``[B, T, V]``, already shifted so that ``logits[:, i]`` predicts ``labels[:, i]``; any float dtype.
        labels: ``[B, T]`` token ids. Positions the caller masks out may hold anything in ``[-100, V)`` (e.g. the
            Hugging Face ignore index ``-100``): negative ids are read as 0 and the value returned there is
            meaningless -- mask it.

    Returns:
        ``[B, T]`` log-probabilities, float32 (float64 if ``logits`` is float64), differentiable w.r.t. ``logits``.

    Computed as ``logits[y] - logsumexp(logits)`` in float32 even for bf16/fp16 logits (bf16 log-probabilities are
    off by ~1e-2), one batch row at a time (:class:`_TokenLogprobs`): the float32 copy alive at once is ``[T, V]``
    rather than ``[B, T, V]`` -- the vocabulary of a modern LLM makes that the largest tensor of a training step --
    in the backward pass too, where autograd through the same operations would keep every row's float32 copy from
    the forward. The gradient, ``g · (onehot(y) − softmax)``, has the same values as autograd's (a zero may keep its
    minus sign, which autograd's sum with ``gather``'s zero-filled gradient drops); it is not differentiable again
    (no ``create_graph`` second pass).

    Raises:
        ValueError: ``logits`` is not 3-D or ``labels`` is not ``logits.shape[:2]``.
    """
    if not torch.is_tensor(logits) or logits.dim() != 3:
        raise ValueError(f"logits must be a [B, T, V] tensor, got {tuple(getattr(logits, 'shape', ()))}")
    if not torch.is_tensor(labels) or labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape [B, T] = {tuple(logits.shape[:2])} to match logits "
                         f"{tuple(logits.shape)}, got {tuple(getattr(labels, 'shape', ()))}")
    if logits.shape[0] == 0:  # empty batch: [0, T] zeros, still attached to the graph
        return _at_least_float32(logits).sum(-1) * 0.0
    return _TokenLogprobs.apply(logits, labels.long().clamp(min=0))  # [B, T]


class _TokenLogprobs(torch.autograd.Function):
    """``logits[y] − logsumexp(logits)`` row by row (:func:`token_logprobs`), with a backward that keeps only the
    logits as given and the ``[B, T]`` log-normalisers.

    Autograd through ``row.float()``, ``gather`` and ``logsumexp`` would save each row's float32 copy (``logsumexp``'s
    input) until the backward, and there take ≈ 11 passes over ``[T, V]`` float32 tensors per row (the shift, exp
    and scaling of ``logsumexp``'s gradient, ``gather``'s zero-filled gradient, their sum, the cast back). Here the
    backward remakes one row's float32 copy at a time and turns it into the gradient in place: ``exp(x − lse)``
    (the same operations as ``logsumexp``'s backward, so the same values), times ``−g``, plus ``g`` at ``y`` (the
    same addition autograd makes). Gradient w.r.t. the labels: none. Once differentiable: the backward works in
    place on tensors a second pass would need.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [B, T, V], [B, T] → [B, T]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(index.shape, dtype=dtype, device=logits.device)  # [B, T]
        lse = torch.empty_like(out)  # [B, T]
        row = torch.empty(logits.shape[1:], dtype=dtype, device=logits.device)  # [T, V], one buffer for every row
        for b in range(logits.shape[0]):
            row.copy_(logits[b])
            torch.logsumexp(row, dim=-1, out=lse[b])
            torch.sub(row.gather(-1, index[b].unsqueeze(-1)).squeeze(-1), lse[b], out=out[b])
        ctx.save_for_backward(logits, index, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # [B, T] → [B, T, V], None
        logits, index, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # [B, T, V] in the logits' dtype
        grad = grad.to(lse.dtype)
        row = torch.empty(logits.shape[1:], dtype=lse.dtype, device=logits.device)  # [T, V], a copy of each row
        for b in range(logits.shape[0]):
            row.copy_(logits[b])
            row.sub_(lse[b].unsqueeze(-1)).exp_()  # softmax
            row.mul_(grad[b].neg().unsqueeze(-1))
            row.scatter_add_(-1, index[b].unsqueeze(-1), grad[b].unsqueeze(-1))
            grad_logits[b].copy_(row)
        return grad_logits, None


def tail_mask(completion_mask: torch.Tensor, tau: int) -> torch.Tensor:
    """The tail set ``T_tau(y)`` of Eq. 5: per row, the last ``min(tau, n)`` True positions of ``completion_mask``.

    ``n`` is the row's number of True positions (``|y|``); ``tau = 0`` selects all of them. Works with left or right
    padding and with prompt positions in the mask: only the order of the True positions matters.

    Callers pass a completion mask that already **excludes EOS** (SPEC §3): the unlikelihood term must not push the
    model away from ending its answer, and Eq. 5's ``|y|`` counts the completion's own tokens.

    Args:
        completion_mask: ``[B, T]`` bool (0/1 integer masks are accepted).
        tau: number of tail tokens, ``>= 0``.

    Returns:
        ``[B, T]`` bool, a subset of ``completion_mask``.

    Vectorised: a reverse cumulative sum counts, at each position, the True positions at or after it; a position is
    in the tail when that count is ``<= tau``.

    Raises:
        ValueError: ``tau`` is not a non-negative integer or the mask is not 2-D.
    """
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise ValueError(f"tau (tail length, Eq. 5) must be an integer >= 0 (0 = whole completion), got {tau!r}")
    mask = _as_mask("completion_mask", completion_mask)  # [B, T]
    if tau == 0:
        return mask.clone()
    from_right = mask.flip(-1).long().cumsum(-1).flip(-1)  # [B, T] True positions at index >= i
    return mask & (from_right <= tau)  # [B, T]


# ----------------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------------


def win_nll(logp: torch.Tensor, mask: torch.Tensor, normalization: str = "token") -> torch.Tensor:
    """Win negative log-likelihood, Eq. 4: ``-sum_i log p(y_i | c0, y_<i)`` over the win completions.

    Args:
        logp: ``[B, T]`` token log-probabilities of the win traces (:func:`token_logprobs`).
        mask: ``[B, T]`` bool, the completion tokens **including EOS** (SPEC §3: the model must learn to stop).
        normalization: ``"token"`` -- ``sum(-logp * mask) / sum(mask)`` over the whole batch (authors' code, default);
            ``"sequence"`` -- per-row sums averaged over rows (Eq. 4 as written); rows with an empty mask are ignored.

    Returns:
        Scalar tensor. An empty batch (or all-empty masks) gives ``0`` that is still attached to ``logp``'s graph, so
        ``backward()`` works and yields zero gradients.

    Raises:
        ValueError: unknown normalisation, or ``logp`` / ``mask`` shapes differ (both shapes are named).
    """
    _check_normalization(normalization)
    _check_same_shape("win logp", logp, "win mask", mask)
    mask = _as_mask("win mask", mask)  # [B, T]
    logp = _at_least_float32(logp)  # [B, T]
    nll = torch.where(mask, -logp, torch.zeros_like(logp))  # [B, T]  (where, not *, so -inf padding cannot give NaN)
    if normalization == "token":
        return nll.sum() / mask.sum().clamp(min=1)
    per_row = nll.sum(-1)  # [B]  empty rows contribute 0 ...
    return per_row.sum() / mask.any(-1).sum().clamp(min=1)  # ... and are not counted


def _unlikelihood_terms(logp: torch.Tensor, tail: torch.Tensor, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``u = 1[p > mu] * -log(1 - p)`` on ``tail`` (0 elsewhere) and the boolean gate, both ``[B, T]``."""
    p = _at_least_float32(logp).exp().clamp(max=PROB_CLAMP)  # [B, T]
    gate = tail & (p.detach() > mu)  # [B, T]  an indicator: not differentiated
    u = torch.where(gate, -torch.log1p(-p), torch.zeros_like(p))  # [B, T]
    return u, gate


def gated_unlikelihood(
    logp: torch.Tensor,
    tail: torch.Tensor,
    alpha: torch.Tensor | Sequence[float],
    mu: float,
    normalization: str = "token",
) -> torch.Tensor:
    """Confidence-gated tail unlikelihood, Eq. 6.

    For lose trace ``b`` and tail position ``i``: ``u_bi = 1[p_bi > mu] * (-log(1 - p_bi))``, with
    ``p_bi = exp(logp_bi)`` clamped to at most ``1 - 1e-6`` (:data:`PROB_CLAMP`) so the term stays finite when the
    model is (numerically) certain; ``-log(1 - p)`` is computed as ``-log1p(-p)`` for accuracy when ``p`` is small.
    The gate is an indicator and is not differentiated: the gradient flows only through ``-log(1 - p)`` of the
    active tokens (``d/dz_j = p_y (delta_jy - p_j) / (1 - p_y)`` w.r.t. the logits).

    Args:
        logp: ``[B, T]`` token log-probabilities of the lose traces.
        tail: ``[B, T]`` bool, the tail set from :func:`tail_mask` (EOS already excluded).
        alpha: ``[B]`` confidence weight per lose trace (paper: 1.0 if a revision succeeded, else 0.5).
        mu: confidence threshold in ``(0, 1)`` (paper default 0.3).
        normalization: ``"token"`` -- ``sum_b alpha_b sum_i u_bi / sum_b |T_b|`` (authors' code, default; the
            denominator counts all tail tokens, gated or not); ``"sequence"`` -- ``mean_b(alpha_b sum_i u_bi)``
            (Eq. 6 as written), rows with an empty tail ignored.

    Returns:
        Scalar tensor; ``0`` attached to the graph when no tail token exceeds ``mu`` or the batch is empty.

    Departure from the authors' code: they weight the token mean by the batch-mean ``alpha``; here each trace keeps
    its own ``alpha_b`` as Eq. 6 says (SPEC §8 gives both values for a worked example).

    Raises:
        ValueError: unknown normalisation, ``mu`` outside ``(0, 1)``, shapes that differ, bad ``alpha``.
    """
    _check_normalization(normalization)
    _check_mu(mu)
    _check_same_shape("lose logp", logp, "lose tail", tail)
    tail = _as_mask("lose tail", tail)  # [B, T]
    alpha = _alpha_vector(alpha, logp.shape[0], _at_least_float32(logp))  # [B]
    u, _ = _unlikelihood_terms(logp, tail, mu)  # [B, T]
    per_row = alpha * u.sum(-1)  # [B]
    if normalization == "token":
        return per_row.sum() / tail.sum().clamp(min=1)
    return per_row.sum() / tail.any(-1).sum().clamp(min=1)


def spear_loss(
    win_logp: torch.Tensor,
    win_mask: torch.Tensor,
    lose_logp: torch.Tensor | None,
    lose_tail: torch.Tensor | None,
    alpha: torch.Tensor | Sequence[float] | None,
    *,
    lambda_w: float,
    lambda_l: float,
    mu: float,
    normalization: str = "token",
) -> dict[str, torch.Tensor]:
    """SPEAR objective, Eq. 7: ``lambda_w * l_win + lambda_l * l_lose``.

    The win and lose batches are separate (SPEC §3: drawn separately each step), so their ``B`` and ``T`` may differ.

    Args:
        win_logp, win_mask: ``[Bw, Tw]``, see :func:`win_nll` (mask includes EOS).
        lose_logp, lose_tail, alpha: ``[Bl, Tl]``, ``[Bl, Tl]``, ``[Bl]``, see :func:`gated_unlikelihood`. Pass all
            three as ``None`` when the step has no lose batch (no lose traces, or Feedback SFT): the lose term is 0.
        lambda_w, lambda_l: non-negative weights (paper: 1.0 and 0.1).
        mu: confidence threshold in ``(0, 1)``.
        normalization: ``"token"`` or ``"sequence"``, used for both terms.

    Returns:
        ``{"loss", "win", "lose", "active_tokens"}``: the total (differentiable); the un-weighted ``l_win`` and
        ``l_lose`` (differentiable, ``.item()`` them for logging); the number of tail tokens that passed the gate
        ``p > mu`` (int64, no grad).

    Raises:
        ValueError: as :func:`win_nll` and :func:`gated_unlikelihood`; negative lambdas; only some lose inputs None.
    """
    _check_normalization(normalization)
    _check_mu(mu)
    for name, value in (("lambda_w", lambda_w), ("lambda_l", lambda_l)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    win = win_nll(win_logp, win_mask, normalization)
    lose_inputs = (lose_logp, lose_tail, alpha)
    if all(x is None for x in lose_inputs):
        lose = torch.zeros_like(win)
        active = torch.zeros((), dtype=torch.long, device=win.device)
    elif any(x is None for x in lose_inputs):
        raise ValueError("lose_logp, lose_tail and alpha must be given together (or all None for no lose batch)")
    else:
        lose = gated_unlikelihood(lose_logp, lose_tail, alpha, mu, normalization)
        with torch.no_grad():
            _, gate = _unlikelihood_terms(lose_logp, _as_mask("lose tail", lose_tail), mu)  # [Bl, Tl]
            active = gate.sum()
    return {"loss": lambda_w * win + lambda_l * lose, "win": win, "lose": lose, "active_tokens": active}


# ----------------------------------------------------------------------------------------------------------------------
# Theorem 1 (paper §4): the SPEAR log-probability margin
# ----------------------------------------------------------------------------------------------------------------------


def margin(
    win_logp: torch.Tensor, win_mask: torch.Tensor, lose_logp: torch.Tensor, lose_tail: torch.Tensor
) -> torch.Tensor:
    """SPEAR log-probability margin ``M_tau`` (paper §4, Eq. 8), one value per (win, lose) pair.

    ``M_tau = (1/|y+|) sum_i log p(y+_i) - (1/|T_tau(y-)|) sum_{i in T_tau} log p(y-_i)``: the win's mean token
    log-probability minus the lose tail's mean token log-probability. Row ``b`` of the win tensors is paired with
    row ``b`` of the lose tensors (both traces share the context ``c0``).

    Args:
        win_logp, win_mask: ``[P, Tw]``; the mask is the one used for the win NLL (EOS included).
        lose_logp, lose_tail: ``[P, Tl]``; the tail from :func:`tail_mask` (EOS excluded).

    Returns:
        ``[P]``; ``NaN`` for a pair whose win mask or lose tail is empty (the mean is undefined).

    Raises:
        ValueError: shapes differ, or the two sides have different numbers of rows.
    """
    _check_same_shape("win logp", win_logp, "win mask", win_mask)
    _check_same_shape("lose logp", lose_logp, "lose tail", lose_tail)
    if win_logp.shape[0] != lose_logp.shape[0]:
        raise ValueError(f"margin pairs row b of the win batch with row b of the lose batch, but they have "
                         f"{win_logp.shape[0]} and {lose_logp.shape[0]} rows")
    win_mask = _as_mask("win mask", win_mask)  # [P, Tw]
    lose_tail = _as_mask("lose tail", lose_tail)  # [P, Tl]
    win_logp, lose_logp = _at_least_float32(win_logp), _at_least_float32(lose_logp)
    win_mean = torch.where(win_mask, win_logp, 0.0).sum(-1) / win_mask.sum(-1)  # [P]  (0/0 = NaN)
    lose_mean = torch.where(lose_tail, lose_logp, 0.0).sum(-1) / lose_tail.sum(-1)  # [P]
    return win_mean - lose_mean  # [P]


def h_mu(mu: float) -> float:
    """Confidence-amplified margin constant of Theorem 1 (Eq. 10): ``log 4`` if ``mu <= 1/2`` else
    ``log(1 / (mu (1 - mu)))``.

    This is ``inf_{p > mu} log(1 / (p (1 - p)))`` (Lemma 1 in the paper's appendix). The paper's closed form
    ``log(1 / max(1/4, mu (1 - mu)))`` is a typo -- ``mu (1 - mu) <= 1/4`` always, so it would be ``log 4`` for every
    ``mu``; the case form printed next to it, and the proof, give the expression used here.

    Raises:
        ValueError: ``mu`` outside ``(0, 1)``.
    """
    _check_mu(mu)
    mu = float(mu)
    return math.log(4.0) if mu <= 0.5 else -math.log(mu * (1.0 - mu))


def margin_lower_bound(
    eps: float | torch.Tensor,
    mu: float,
    lambda_w: float,
    lambda_l: float,
    alpha: float | torch.Tensor,
    win_len: int | torch.Tensor,
    tail_len: int | torch.Tensor,
) -> float | torch.Tensor:
    """Theorem 1's bound (Eq. 9): ``M_tau >= h(mu) - eps (1 / (lambda_w |y+|) + 1 / (lambda_l alpha |T_tau(y-)|))``.

    Valid when ``l_SPEAR <= eps`` for a single (win, lose) pair under the ``"sequence"`` normalisation (Eqs. 4 and 6
    as written) and every tail token has ``p > mu`` (Assumption 1). Also requires ``p <= 1 - 1e-6`` on the tail
    for ``mu`` close to 1, since :data:`PROB_CLAMP` caps each unlikelihood term at ``log(1e6)``.

    Args:
        eps: the loss value ``l_SPEAR`` (float or tensor).
        mu, lambda_w, lambda_l: as in :func:`spear_loss`; the lambdas must be positive.
        alpha: the lose trace's confidence weight (positive).
        win_len: ``|y+|``, win completion tokens (EOS included, as in the win NLL).
        tail_len: ``|T_tau(y-)|``, tail tokens of the lose completion.

    Returns:
        The bound, as a float or a tensor if any argument is one (elementwise over pairs).
    """
    for name, value in (("lambda_w", lambda_w), ("lambda_l", lambda_l), ("alpha", alpha), ("win_len", win_len),
                        ("tail_len", tail_len)):
        _check_positive(name, value)
    return h_mu(mu) - eps * (1.0 / (lambda_w * win_len) + 1.0 / (lambda_l * alpha * tail_len))


def fedprox_term(
    params: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    global_params: Sequence[torch.Tensor | np.ndarray] | Mapping[str, torch.Tensor | np.ndarray],
    mu_prox: float,
) -> torch.Tensor:
    """FedProx proximal term (Li et al. 2020, Eq. 2): ``(mu_prox / 2) * sum_k ||theta_k - theta_g,k||^2``.

    Added to each client's local loss so its adapter stays near the broadcast one (SPEC §4; paper ``mu_prox =
    1e-3``). Only the trainable (LoRA) tensors are passed -- the frozen base weights never move. The global
    tensors are detached copies taken at the start of the round; the gradient w.r.t. ``theta`` is
    ``mu_prox (theta - theta_g)``.

    Args:
        params: the live trainable tensors, a sequence or a name -> tensor mapping.
        global_params: ``theta^(t)`` in the same structure (same order, or same names), tensors or numpy arrays;
            moved to each parameter's device.
        mu_prox: ``>= 0``.

    Returns:
        Scalar tensor (float32 at least, on the first parameter's device), differentiable w.r.t. ``params``;
        0 (still attached) when ``mu_prox = 0``.

    Raises:
        ValueError: ``mu_prox`` negative or not finite; the two structures differ in length, names or shapes.
    """
    if isinstance(mu_prox, bool) or not isinstance(mu_prox, (int, float)) or not math.isfinite(mu_prox) or mu_prox < 0:
        raise ValueError(f"mu_prox must be a finite number >= 0 (paper: 1e-3), got {mu_prox!r}")
    if isinstance(params, Mapping) != isinstance(global_params, Mapping):
        raise ValueError("params and global_params must both be sequences or both be name -> tensor mappings")
    if isinstance(params, Mapping):
        missing = sorted(set(params) - set(global_params))
        extra = sorted(set(global_params) - set(params))
        if missing or extra:
            raise ValueError(f"global_params does not hold the same tensors as params: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        pairs = [(name, params[name], global_params[name]) for name in params]
    else:
        params, global_params = list(params), list(global_params)
        if len(params) != len(global_params):
            raise ValueError(f"got {len(params)} parameters but {len(global_params)} global tensors; they pair up one "
                             f"to one")
        pairs = [(str(i), p, g) for i, (p, g) in enumerate(zip(params, global_params))]
    if not pairs:
        raise ValueError("fedprox_term needs at least one parameter tensor")

    total = None
    for name, p, g in pairs:
        if not torch.is_tensor(p):
            raise ValueError(f"parameter {name!r} must be a torch tensor, got {type(p).__name__}")
        p = p if p.dtype in (torch.float32, torch.float64) else p.float()
        g = torch.as_tensor(g).detach().to(device=p.device, dtype=p.dtype)
        if g.shape != p.shape:
            raise ValueError(f"tensor {name!r}: parameter has shape {tuple(p.shape)}, global copy has "
                             f"{tuple(g.shape)}")
        sq = (p - g).pow(2).sum()
        total = sq if total is None else total + sq.to(total.dtype)
    return 0.5 * float(mu_prox) * total
