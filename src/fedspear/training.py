"""Phase 2 of SPEAR — local training on the win and lose sets (paper Eqs. 4–7, Alg. 1 lines 26–31; SPEC §3).

Each local step draws a win batch and a lose batch (B traces each, seeded, cycling through each set), runs one
forward over both (left padded so every completion ends at the last position: logits are computed only for the
completion window via ``logits_to_keep``, never for the whole prompt), and minimises
λ_w ℓ_win + λ_l ℓ_lose (``fedspear.losses.spear_loss``). AdamW is fresh per client-round (weight decay 0),
gradients are clipped to norm 1.0, and a step whose gradient is not finite is skipped and counted.

The learning rate is constant within a round: linear warm-up over the first ``warmup_ratio`` of the rounds, then
cosine decay to ``lr_min`` (paper appendix "Hyperparameter Settings (SPEAR)"; ``lr_at_round``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from . import losses as L
from . import progress
from .interaction import Trace
from .runtime.compiled_training import training_forward
from .runtime.cpu_kernels import FastDropout
from .runtime.model import autocast, model_device, pad_id
from .losses import fedprox_term


@dataclass
class TrainSettings:
    """Local-training hyper-parameters (paper appendix table "Hyperparameter Settings (SPEAR)").

    Attributes:
        local_steps: optimiser steps per client-round (E; paper 5 for ARC).
        batch_size: traces per win batch and per lose batch (B).
        grad_accum: micro-batches accumulated per step.
        lambda_w / lambda_l: loss weights (Eq. 7; paper 1.0 / 0.1).
        mu: unlikelihood confidence gate μ (Eq. 6; paper 0.3).
        tau: tail length τ (Eq. 5; 0 = whole completion).
        normalization: "token" (default) or "sequence" (SPEC §3).
        max_lose_ratio: cap |L| ≤ ratio · |W| by seeded subsampling (SPEC §3).
        max_grad_norm: gradient clipping norm.
        prox_mu: FedProx proximal weight μ_prox (0 = plain local training; Li et al. 2020, Eq. 2).
        dropout: apply the adapter's dropout (``lora_dropout``, paper 0.1) in the local steps. True for SPEAR and
            Feedback SFT; False for the ratio-based baselines (GRPO, RLTF-SD), whose sampling-time and reference
            log-probabilities are computed without dropout (see :func:`dropout_modules`).
    """

    local_steps: int = 5
    batch_size: int = 4
    grad_accum: int = 1
    lambda_w: float = 1.0
    lambda_l: float = 0.1
    mu: float = 0.3
    tau: int = 0
    normalization: str = "token"
    max_lose_ratio: int = 2
    max_grad_norm: float = 1.0
    prox_mu: float = 0.0
    dropout: bool = True

    @classmethod
    def from_config(cls, cfg, **changes) -> "TrainSettings":
        """The local-training settings of a resolved ``RunConfig`` (SPEAR's; a baseline passes its ``changes``,
        e.g. ``dropout=False``). ``prox_mu`` is the run's ``mu_prox`` under the FedProx strategy, else 0."""
        values = dict(
            local_steps=cfg.local_steps,
            batch_size=cfg.batch_size,
            grad_accum=cfg.grad_accum,
            lambda_w=cfg.lambda_w,
            lambda_l=cfg.lambda_l,
            mu=cfg.mu,
            tau=cfg.tau,
            normalization=cfg.normalization,
            max_lose_ratio=cfg.max_lose_ratio,
            prox_mu=cfg.mu_prox if cfg.strategy == "fedprox" else 0.0,
        )
        return cls(**{**values, **changes})


@dataclass
class Batch:
    """A left-padded batch whose completions all end at the last position.

    Shapes: ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, L]``; ``labels``, ``completion_mask``,
    ``tail_base`` ``[B, C]`` where C is the longest completion. ``tail_base`` is the completion mask without a
    trailing EOS (Eq. 5's tail set excludes it).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    completion_mask: torch.Tensor
    tail_base: torch.Tensor
    traces: tuple = ()
    pad_id: int = 0

    @property
    def window(self) -> int:
        return self.labels.shape[1]


def pack(traces: Sequence[Trace], pad_id: int, device: torch.device | str | None = None) -> Batch:
    """Left-pad ``prompt ‖ completion`` for each trace so completions end at the last column; every tensor on
    ``device`` (the model's, ``fedspear.runtime.model.model_device``; None: torch's default device)."""
    seqs = [t.prompt_ids + t.completion_ids for t in traces]
    width = max(len(s) for s in seqs)
    window = max(len(t.completion_ids) for t in traces)
    n = len(traces)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)  # [B, L]
    attention = torch.zeros((n, width), dtype=torch.long, device=device)  # [B, L]
    completion = torch.zeros((n, window), dtype=torch.bool, device=device)  # [B, C]
    tail_base = torch.zeros((n, window), dtype=torch.bool, device=device)  # [B, C]
    for i, (seq, t) in enumerate(zip(seqs, traces)):
        input_ids[i, width - len(seq) :] = torch.tensor(seq, device=device)
        attention[i, width - len(seq) :] = 1
        c = len(t.completion_ids)
        completion[i, window - c :] = True
        tail_base[i, window - c : window - int(t.has_eos)] = True
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)  # [B, L]
    labels = input_ids[:, width - window :].clone()  # [B, C]
    return Batch(input_ids, attention, position_ids, labels, completion, tail_base, tuple(traces), pad_id)


def length_buckets(lengths: Sequence[int], min_saving: float = 0.1) -> list[list[int]]:
    """Row indices in one group, or in two groups by length when that saves at least ``min_saving`` of the tokens a
    single left-padded batch computes (shortest rows first; indices sorted by length within a group).

    One batch of n rows costs n · max(len) token positions; splitting the length-sorted rows after the k-th costs
    k · len_(k) + (n − k) · len_(n). The best k is taken. ARC traces with SmolLM2 (113–270 tokens) waste 19% of a
    batch of 8 on padding, 9% when split in two (docs/performance.md).
    """
    n = len(lengths)
    order = sorted(range(n), key=lambda i: lengths[i])
    ordered = [lengths[i] for i in order]
    full = n * ordered[-1] if n else 0
    best_k, best = 0, full
    for k in range(1, n):
        cost = k * ordered[k - 1] + (n - k) * ordered[-1]
        if cost < best:
            best_k, best = k, cost
    if not best_k or best > (1 - min_saving) * full:
        return [list(range(n))]
    return [order[:best_k], order[best_k:]]


def completion_logits(model, batch: Batch, dtype_used: str) -> torch.Tensor:
    """Raw logits at the positions predicting each completion-window token → ``[B, C, V]`` (autocast dtype).

    Only those C positions get logits (``logits_to_keep`` as the positions' indices: the C before the last);
    position j predicts token j + 1. Keeping the last C + 1 and dropping the last would cost a ``[B, C + 1, V]``
    zero-filled gradient and a copy into it in the backward pass.

    Raises:
        ValueError: the window is not shorter than the rows (a completion needs a token before it).
        RuntimeError: the compiled training forward failed (``compile_training = "on"``; the message names the
            setting that turns it off).
    """
    length = batch.input_ids.shape[1]
    if batch.window >= length:
        raise ValueError(f"a completion window of {batch.window} tokens needs rows of more than {batch.window} "
                         f"tokens (got {length})")
    keep = torch.arange(length - batch.window - 1, length - 1, device=batch.input_ids.device)  # [C]
    with autocast(dtype_used, batch.input_ids.device.type):
        out = training_forward(model)(  # compiled where compile_training is on and gradients are recorded
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=keep,
            use_cache=False,
        )
    return out.logits  # [B, C, V]


def completion_logprobs(model, batch: Batch, dtype_used: str) -> torch.Tensor:
    """log p_θ(y_i | c0, y_<i) at every completion-window position → ``[B, C]`` float32.

    A batch made by :func:`pack` whose rows differ much in length runs as two forwards over length buckets
    (:func:`length_buckets`), each padded only to its own longest row; the rows' log-probs are put back in batch order
    and right-aligned in the window (a row's completion always ends at the last column), so the result — and its
    gradient — is the single forward's, without computing the padding.
    """
    groups = length_buckets([len(t.prompt_ids) + len(t.completion_ids) for t in batch.traces]) \
        if batch.traces else [list(range(batch.input_ids.shape[0]))]
    if len(groups) == 1:
        return L.token_logprobs(completion_logits(model, batch, dtype_used), batch.labels)  # [B, C]
    parts, rows = [], []
    for group in groups:
        sub = pack([batch.traces[i] for i in group], batch.pad_id, batch.input_ids.device)
        logp = L.token_logprobs(completion_logits(model, sub, dtype_used), sub.labels)  # [b, c]
        parts.append(torch.nn.functional.pad(logp, (batch.window - sub.window, 0)))  # [b, C]
        rows += group
    device = batch.input_ids.device
    inverse = torch.empty(len(rows), dtype=torch.long, device=device)
    inverse[torch.tensor(rows, device=device)] = torch.arange(len(rows), device=device)
    return torch.cat(parts)[inverse]  # [B, C] in batch order


class Cycler:
    """Draws batches of ``size`` from ``items``, reshuffling (seeded) after each full pass; a batch never holds an
    item twice unless ``items`` is shorter than ``size`` (then it is the whole list, each once)."""

    def __init__(self, items: Sequence, size: int, rng: random.Random):
        self.items, self.size, self.rng, self.order = list(items), size, rng, []

    def next(self) -> list:
        batch = []
        while len(batch) < min(self.size, len(self.items)):
            if not self.order:
                self.order = list(range(len(self.items)))
                self.rng.shuffle(self.order)
            batch.append(self.items[self.order.pop()])
        return batch


def cap_losses(losses: Sequence[Trace], num_wins: int, ratio: int, seed: int) -> list[Trace]:
    """Subsample the lose set to at most ``ratio · num_wins`` traces (seeded; SPEC §3 ``max_lose_ratio``)."""
    cap = ratio * num_wins
    if len(losses) <= cap:
        return list(losses)
    return random.Random(seed).sample(list(losses), cap)


def dropout_modules(model) -> list[torch.nn.Module]:
    """Every dropout module of ``model``: torch's ``nn.Dropout`` family and the adapter's :class:`FastDropout`.

    Putting them in eval mode turns dropout off while the model stays in train mode (so gradient checkpointing,
    which transformers runs only in train mode, still applies, and its recomputed forward is the same as the
    first). Attention-probability dropout is a functional call governed by the config's ``attention_dropout``,
    0 in the packaged models (SmolLM2, Qwen2.5, Llama 3.2).
    """
    return [m for m in model.modules() if isinstance(m, (torch.nn.modules.dropout._DropoutNd, FastDropout))]


def optimise(model, micro_step, settings: TrainSettings, *, lr: float, seed: int) -> dict[str, float]:
    """The local optimisation loop every algorithm shares (SPEC §3 "Optimiser").

    ``settings.local_steps`` AdamW steps (fresh optimiser, weight decay 0) over the trainable (LoRA) parameters;
    each step accumulates ``settings.grad_accum`` calls of ``micro_step() -> {"loss": tensor, ...}`` (every other
    entry is logged), clips the gradient to ``settings.max_grad_norm`` and skips (and counts) a step whose gradient
    is not finite. With ``settings.prox_mu > 0`` the FedProx term (μ/2)‖θ − θ^(t)‖² is added to every loss,
    θ^(t) being the parameters at entry (Li et al. 2020, Eq. 2). Seeds torch (LoRA dropout) with ``seed``. With
    ``settings.dropout`` False every dropout module stays in eval mode for the whole loop (:func:`dropout_modules`).

    Returns:
        ``steps``, ``skipped_nonfinite`` and, for each logged term, its mean over steps (``<term>``) — the
        ``active_tokens`` term is summed instead (``active_tokens_sum``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if settings.prox_mu else None  # θ^(t) for FedProx
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)  # LoRA dropout
    model.train()
    no_dropout = [] if settings.dropout else dropout_modules(model)
    out: dict[str, float] = {"steps": 0, "skipped_nonfinite": 0}
    sums: dict[str, float] = {}
    with progress.phase("training", total=settings.local_steps * settings.grad_accum, unit="micro-steps"):
        for _ in range(settings.local_steps):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(settings.grad_accum):
                for module in no_dropout:  # again each time: a micro-step may have called model.train()
                    module.eval()
                terms = micro_step()
                loss = terms["loss"]
                if anchor is not None:
                    loss = loss + fedprox_term(params, anchor, settings.prox_mu)
                (loss / settings.grad_accum).backward()
                for key, value in terms.items():
                    value = float(value.detach()) if torch.is_tensor(value) else float(value)
                    if key == "active_tokens":
                        sums["active_tokens_sum"] = sums.get("active_tokens_sum", 0.0) + value
                    else:
                        sums[key] = sums.get(key, 0.0) + value / settings.grad_accum
                progress.advance()
            norm = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            if not torch.isfinite(norm):
                out["skipped_nonfinite"] += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.step()
            out["steps"] += 1
    n = max(1, settings.local_steps)
    out.update({k: (v if k == "active_tokens_sum" else v / n) for k, v in sums.items()})
    return out


def local_train(
    model,
    tokenizer,
    wins: Sequence[Trace],
    losses: Sequence[Trace],
    settings: TrainSettings,
    *,
    lr: float,
    dtype_used: str = "fp32",
    seed: int = 0,
) -> dict[str, float]:
    """Train the LoRA parameters of ``model`` on one client's win and lose sets (Eq. 7).

    No wins → no local steps (SPEC §3): the adapter is returned untouched and ``steps`` is 0.

    Returns:
        Metrics: steps, skipped_nonfinite, loss, loss_win, loss_lose (means over steps), active_tokens (gated
        tail tokens, summed), lose_used (after the cap), lr, seconds_train, margin (mean M_τ over (win, lose)
        pairs sharing a context, after training; NaN when there is no pair), margin_pairs.
    """
    t0 = time.perf_counter()
    stats = dict(steps=0, skipped_nonfinite=0, loss=0.0, loss_win=0.0, loss_lose=0.0, active_tokens=0,
                 lose_used=0, lr=lr, seconds_train=0.0, margin=float("nan"), margin_pairs=0)
    if not wins:
        return stats
    use_lose = settings.lambda_l != 0 and bool(losses)
    losses = cap_losses(losses, len(wins), settings.max_lose_ratio, seed) if use_lose else []
    stats["lose_used"] = len(losses)
    rng = random.Random(seed)
    win_draw, lose_draw = Cycler(wins, settings.batch_size, rng), Cycler(losses, settings.batch_size, rng)
    pad = pad_id(tokenizer)
    device = model_device(model)

    def micro_step() -> dict[str, torch.Tensor]:
        wb = win_draw.next()
        lb = lose_draw.next() if losses else []
        batch = pack(wb + lb, pad, device)
        logp = completion_logprobs(model, batch, dtype_used)  # [Bw + Bl, C]
        nw = len(wb)
        lose_tail = L.tail_mask(batch.tail_base[nw:], settings.tau)  # [Bl, C]
        alpha = torch.tensor([t.alpha for t in lb], dtype=torch.float32, device=device)  # [Bl]
        terms = L.spear_loss(
            logp[:nw], batch.completion_mask[:nw], logp[nw:], lose_tail, alpha,
            lambda_w=settings.lambda_w, lambda_l=settings.lambda_l if lb else 0.0, mu=settings.mu,
            normalization=settings.normalization,
        )
        return {"loss": terms["loss"], "loss_win": terms["win"], "loss_lose": terms["lose"],
                "active_tokens": terms["active_tokens"]}

    stats.update(optimise(model, micro_step, settings, lr=lr, seed=seed))
    stats["active_tokens"] = int(stats.pop("active_tokens_sum"))
    stats["margin"], stats["margin_pairs"] = pair_margin(model, wins, losses, pad, settings.tau, dtype_used,
                                                         rows=2 * settings.batch_size)  # a micro-step's rows
    stats["seconds_train"] = time.perf_counter() - t0
    model.eval()
    return stats


@torch.no_grad()
def pair_margin(model, wins, losses, pad: int, tau: int, dtype_used: str, rows: int = 16) -> tuple[float, int]:
    """Mean SPEAR margin M_τ (paper §4, Eq. 8) over (win, lose) pairs that share a context.

    A win pairs with every loss of its ``uid`` (SPEAR's interaction gives a prompt at most one of each); the two
    traces of a pair share their context's forward (:func:`shared_context_logprobs`, ``rows`` traces per forward).

    Returns:
        ``(mean margin in nats per token, number of pairs)``; ``(nan, 0)`` without pairs.
    """
    by_uid = {t.uid: t for t in wins}
    pairs = [(by_uid[t.uid], t) for t in losses if t.uid in by_uid]
    if not pairs:
        return float("nan"), 0
    device = model_device(model)
    scored = list({id(t): t for pair in pairs for t in pair}.values())
    logp = dict(zip(map(id, scored), shared_context_logprobs(model, scored, pad, dtype_used, rows)))

    def right_padded(traces, drop_eos: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max(len(t.completion_ids) for t in traces))
        values = torch.zeros((len(traces), width), device=device)  # [P, C]
        mask = torch.zeros((len(traces), width), dtype=torch.bool, device=device)  # [P, C]
        for i, t in enumerate(traces):
            n = len(t.completion_ids)
            values[i, :n] = logp[id(t)]
            mask[i, : max(0, n - int(drop_eos and t.has_eos))] = True
        return values, mask

    win_logp, win_mask = right_padded([w for w, _ in pairs], drop_eos=False)
    lose_logp, lose_base = right_padded([l for _, l in pairs], drop_eos=True)
    m = L.margin(win_logp, win_mask, lose_logp, L.tail_mask(lose_base, tau))  # [P]
    return float(m.mean()), len(pairs)


@torch.no_grad()
def shared_context_logprobs(model, traces: Sequence[Trace], pad: int, dtype_used: str,
                            rows: int = 16) -> list[torch.Tensor]:
    """log p_θ(y_i | c0, y_<i) of every completion token of each trace → one ``[len(y)]`` float32 tensor per trace,
    on the model's device (no gradient; the model in eval mode meanwhile: no dropout, a KV cache even where
    gradient checkpointing is on).

    Traces that share a context (a prompt's rollouts and its revision: the same ``prompt_ids``) share its forward:
    the distinct contexts run once, left padded, keeping their KV cache and the logits of their last position (which
    predict each completion's first token); the cache's rows are then repeated per trace (``Cache.reorder_cache``)
    and the completions run after it, right padded, with positions continuing each context's. What
    :func:`completion_logprobs` over each trace gives, without computing a context more than once. Contexts whose
    lengths (with their longest completion) differ much run in two length buckets (:func:`length_buckets`), and a
    forward holds at most ``rows`` traces, or the traces of one context where it has more (they stay together): its
    ``[rows, C, V]`` logits are bounded as a training micro-step's (``rows`` = 2 × its batch size).
    """
    was_training = model.training
    model.eval()
    try:
        return _shared_context_logprobs(model, traces, pad, dtype_used, rows)
    finally:
        model.train(was_training)


def _shared_context_logprobs(model, traces, pad: int, dtype_used: str, rows: int) -> list[torch.Tensor]:
    device = model_device(model)
    out: list[torch.Tensor | None] = [None] * len(traces)
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(traces):
        by_context.setdefault(tuple(t.prompt_ids), []).append(i)
    groups = list(by_context.items())
    longest = [len(c) + max(len(traces[i].completion_ids) for i in g) for c, g in groups]
    for bucket in length_buckets(longest):  # contexts of very different lengths: two forwards, each padded less
        chunk: list[tuple[tuple[int, ...], list[int]]] = []
        for k, j in enumerate(bucket):
            chunk.append(groups[j])
            if k + 1 == len(bucket) or sum(len(g) for _, g in chunk) + len(groups[bucket[k + 1]][1]) > rows:
                _score_contexts(model, traces, chunk, pad, dtype_used, device, out)
                chunk = []
    return out  # type: ignore[return-value]


def _score_contexts(model, traces, chunk, pad: int, dtype_used: str, device, out: list) -> None:
    """``shared_context_logprobs`` for one forward: ``chunk`` is ``[(context ids, indices of its traces)]``; the
    results go to ``out[index]``."""
    contexts = [c for c, _ in chunk]
    index = [i for _, group in chunk for i in group]  # trace indices, row order
    row_context = [k for k, (_, group) in enumerate(chunk) for _ in group]
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long, device=device)  # [U, P]
    attention = torch.zeros((len(contexts), width), dtype=torch.long, device=device)  # [U, P]
    for k, c in enumerate(contexts):
        ids[k, width - len(c):] = torch.tensor(c, device=device)
        attention[k, width - len(c):] = 1
    lengths = [len(traces[i].completion_ids) for i in index]
    window = max(lengths)
    if window == 0:
        for i in index:
            out[i] = torch.zeros(0, device=device)
        return
    completions = torch.full((len(index), window), pad, dtype=torch.long, device=device)  # [T, C]
    filled = torch.zeros((len(index), window), dtype=torch.long, device=device)  # [T, C]
    for r, i in enumerate(index):
        completions[r, : lengths[r]] = torch.tensor(traces[i].completion_ids, device=device)
        filled[r, : lengths[r]] = 1
    select = torch.tensor(row_context, device=device)  # [T]
    with autocast(dtype_used, device.type):
        out_context = model(input_ids=ids, attention_mask=attention,
                            position_ids=(attention.cumsum(1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
    first = out_context.logits[select, -1:]  # [T, 1, V]: a context's last position predicts its completions' first
    rest = None
    if window > 1:  # the completions but their last token (whose logits would predict nothing scored)
        cache = out_context.past_key_values
        del out_context
        cache.reorder_cache(select)
        context_attention = attention[select]  # [T, P]
        positions = context_attention.sum(1, keepdim=True) + torch.arange(window - 1, device=device)  # [T, C-1]
        with autocast(dtype_used, device.type):
            rest = model(input_ids=completions[:, :-1], position_ids=positions, past_key_values=cache,
                         attention_mask=torch.cat([context_attention, filled[:, :-1]], 1), use_cache=True).logits
        del cache  # [T, C-1, V] logits kept, not the cache
    parts = [L.token_logprobs(first, completions[:, :1])]  # [T, 1]
    if rest is not None:
        parts.append(L.token_logprobs(rest, completions[:, 1:]))  # [T, C-1]
    logp = torch.cat(parts, 1)  # [T, C]: column j is completion token j's
    for r, i in enumerate(index):
        out[i] = logp[r, : lengths[r]]
