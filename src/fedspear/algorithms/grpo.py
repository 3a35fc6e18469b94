"""GRPO (Shao et al. 2024; SPEC §5) as a federated client: G samples per prompt, binary reward, group-normalised
advantages, PPO-clipped surrogate with a k3 KL to the base model. No feedback and no facts reach the prompt.

Per round a client answers its ``rollouts_per_round`` prompts G times each (the same prompts SPEAR sees: equal
interaction budget in prompts, G× the generations), scores each sample with the task's IsCorrect, and computes
``A = (r − mean_G r) / (std_G r + 1e-4)`` per group (:func:`fedspear.baseline_losses.grpo_advantages`). All rollouts
are collected before the local steps ("batch rollout"), so later steps use the importance ratio against the
sampling-time log-probabilities; each step draws ``batch_size`` sequences (× ``grad_accum``) from the round's
rollouts. Loss: :func:`fedspear.baseline_losses.grpo_loss` (mean over sequences of token means).
Aggregation weight: the number of prompts (SPEC §5).

**Decision (dropout):** the local steps run with LoRA dropout off (``TrainSettings.dropout = False``), like the
sampling-time ("old") and reference log-probabilities, which are computed in eval mode. The importance ratio
π_θ/π_old and the k3 KL then compare the same deterministic function of the parameters: at the first step, before
any update, the ratio is exactly 1 (up to float round-off) and the surrogate's gradient is the on-policy
−A ∇log π. With dropout on in the live forward only, the first step's per-token ratios were 0.95–1.06 (issue 16):
noise from the dropout mask, not a policy change, multiplying each token's surrogate gradient. Recomputing the old
log-probs with dropout on would not help (a different mask each forward). Same choice as TRL's ``disable_dropout``
("prevents the model from generating different logprobs for the same input") and its DPO/GKD defaults; the cost
is that the paper's LoRA dropout 0.1 does not regularise GRPO. SPEAR, Feedback SFT and OPSD keep it.

Defaults — paper appendix table "Training, federated learning, and GRPO hyperparameters" (Qwen2.5-1.5B and
Llama-3.2-3B, identical): β_KL 0.02 (0.1 StrategyQA), clip range 0.2, generations 2 / 4 / 2 / 4 for MathMCQA /
ARC-Challenge / StrategyQA / HellaSwag.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import baseline_losses as B
from ..algorithm_defaults import GROUP_SIZE, KL_BETA
from ..feedback import FeedbackSource
from ..interaction import make_trace
from ..runtime.model import model_device
from ..tasks.base import Example
from ..training import TrainSettings, completion_logprobs, pack
from . import common


@dataclass
class Settings:
    """GRPO settings (paper appendix GRPO tables).

    Attributes:
        group_size: G, samples per prompt.
        beta: k3 KL weight β_KL.
        eps: PPO clip range ε.
        train: the shared optimiser settings (steps, batch size in sequences, grad accumulation, FedProx μ), with
            ``dropout = False`` (module docstring, **Decision**).
    """

    group_size: int = 4
    beta: float = 0.02
    eps: float = 0.2
    train: TrainSettings = None  # type: ignore[assignment]


def settings(cfg) -> Settings:
    """GRPO settings from a resolved ``RunConfig`` (``group_size`` / ``kl_beta`` None → the task's table value)."""
    return Settings(
        group_size=cfg.group_size or GROUP_SIZE[cfg.task],
        beta=KL_BETA[cfg.task] if cfg.kl_beta is None else cfg.kl_beta,
        eps=cfg.clip_eps,
        train=TrainSettings.from_config(cfg, dropout=False),  # ratio against dropout-free old log-probs
    )


def client_round(worker, cfg, examples: Sequence[Example], *, lr: float, seed: int,
                 feedback: FeedbackSource) -> dict[str, float]:
    """One GRPO client-round. ``feedback`` is used only as the reward (its ``is_correct``); no feedback text."""
    s, model = settings(cfg), worker.model
    eos, pad, counters, c0 = common.start_round(worker, examples, seed)
    contexts = [c for c in c0 for _ in range(s.group_size)]  # prompt-major: [P·G]
    completions = common.sample(worker, cfg, contexts, counters, "initial")
    rewards = [float(feedback.is_correct(examples[k // s.group_size], common.text(worker, y)))
               for k, y in enumerate(completions)]
    counters["initial_correct"], counters["initial_samples"] = sum(rewards), len(rewards)
    device = model_device(model)
    advantages = B.grpo_advantages(torch.tensor(rewards, device=device).view(len(examples), s.group_size)).flatten()
    traces = [make_trace(examples[k // s.group_size].uid, ctx, y, eos)
              for k, (ctx, y) in enumerate(zip(contexts, completions))]

    t0 = time.perf_counter()
    batches = common.draw_batches(len(traces), s.train.batch_size, s.train.local_steps * s.train.grad_accum, seed)
    used = sorted({i for b in batches for i in b})
    old = dict(zip(used, common.logprobs_of(model, [traces[i] for i in used], pad, worker.dtype_used)))
    ref = (dict(zip(used, common.logprobs_of(model, [traces[i] for i in used], pad, worker.dtype_used,
                                              adapter=False))) if s.beta > 0 else None)
    queue = iter(batches)

    def micro_step() -> dict[str, torch.Tensor]:
        idx = next(queue)
        batch = pack([traces[i] for i in idx], pad, device)
        logp = completion_logprobs(model, batch, worker.dtype_used)  # [B, C]
        terms = B.grpo_loss(
            logp, common.aligned([old[i] for i in idx], batch.window, device),
            common.aligned([ref[i] for i in idx], batch.window, device) if ref is not None else None,
            batch.completion_mask, advantages[idx], s.eps, s.beta,
        )
        return {"loss": terms["loss"], "loss_pg": terms["pg"], "kl": terms["kl"],
                "clip_fraction": terms["clip_fraction"]}

    wins = int(sum(rewards))
    return common.finish_round(
        worker, micro_step, s.train, lr=lr, seed=seed, started=t0, counters=counters, **{
            "num-wins": wins, "num-losses": len(rewards) - wins, "weight": len(examples), "group_size": s.group_size,
            "zero_advantage_groups": int((advantages.view(len(examples), -1).abs().sum(1) == 0).sum())})
