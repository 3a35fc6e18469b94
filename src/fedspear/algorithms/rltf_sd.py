"""RLTF-SD (Song et al. 2026) as the SPEAR authors ran it (SPEC §5), as a federated client.

Per prompt N samples y0 ~ π(·|x0), reward r0 = IsCorrect. A wrong y0 gets one feedback revision: the feedback
source's partial feedback f, x1 = x0 ‖ y0 ‖ f (the same rendering as SPEAR's revisions), y1 ~ π(·|x1), reward r1.
Early termination: a correct y0 is not revised (y1 := y0, x1 := x0). Advantages
(:func:`fedspear.baseline_losses.rltf_sd_advantages`): A_RL0 = R − mean R with R = r0 + γ r1, A_RL1 = r1 − mean r1,
A_sd = r1 − mean r0. Loss (:func:`fedspear.baseline_losses.rltf_sd_loss`):
0.1 · (−A_sd log π(y1|x0)) + 1.0 · (RL0 + RL1), each RL term a clipped surrogate plus β k3 KL to the base model.
Rollouts are collected before the local steps ("batch rollout", paper §5), so later steps use importance ratios
against the sampling-time log-probabilities. Aggregation weight: the number of prompts.

**Decision (dropout):** as GRPO (:mod:`fedspear.algorithms.grpo`), the local steps run with LoRA dropout off
(``TrainSettings.dropout = False``, inherited from ``grpo.settings``), like the eval-mode sampling-time and
reference log-probabilities, so the RL terms' ratios are exactly 1 at the first step and the KL compares like with
like. The SD term (−A_sd log π(y1|x0)) shares the same forward, so it runs without dropout too.

Defaults — paper appendix table "Training, federated learning, and RLTF-SD hyperparameters": γ 1.0, SD coefficient
0.1, RL coefficient 1.0, early termination on. The table gives no group size or KL weight; like the authors' code
(GRPO-based group generation, §5 "Wall-clock Time Comparison") they are GRPO's table values (N = 4 ARC/HellaSwag,
2 MathMCQA/StrategyQA; β 0.02, 0.1 StrategyQA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import baseline_losses as B
from ..feedback import FeedbackSource
from ..interaction import make_trace, render
from ..runtime.model import model_device
from ..tasks.base import Example
from ..training import TrainSettings, completion_logprobs, pack
from . import common, grpo


@dataclass
class Settings:
    """RLTF-SD settings (paper appendix RLTF-SD tables; N, β and ``train`` — dropout off — from GRPO's)."""

    group_size: int = 4
    beta: float = 0.02
    eps: float = 0.2
    gamma: float = 1.0
    sd_coef: float = 0.1
    rl_coef: float = 1.0
    train: TrainSettings = None  # type: ignore[assignment]


def settings(cfg) -> Settings:
    g = grpo.settings(cfg)
    return Settings(group_size=g.group_size, beta=g.beta, eps=g.eps, gamma=cfg.rltf_gamma, sd_coef=cfg.rltf_sd_coef,
                    rl_coef=cfg.rltf_rl_coef, train=g.train)


def client_round(worker, cfg, examples: Sequence[Example], *, lr: float, seed: int,
                 feedback: FeedbackSource) -> dict[str, float]:
    """One RLTF-SD client-round."""
    s, model, tok, task = settings(cfg), worker.model, worker.tokenizer, worker.task
    n, p = s.group_size, len(examples)
    eos, pad, counters, c0 = common.start_round(worker, examples, seed)
    x0 = [c for c in c0 for _ in range(n)]  # prompt-major [P·N]
    kept: list = []  # each sample's KV cache (x0 ‖ y0): a revision context x0 ‖ y0 ‖ f starts with x0
    y0 = common.sample(worker, cfg, x0, counters, "initial", keep=kept)
    ex_of = [examples[k // n] for k in range(p * n)]
    r0 = [float(feedback.is_correct(ex, common.text(worker, y))) for ex, y in zip(ex_of, y0)]
    counters["initial_correct"], counters["initial_samples"] = sum(r0), len(r0)
    wrong = [k for k in range(p * n) if r0[k] == 0.0]
    kept = [kept[k] for k in wrong]  # only the samples to revise
    x1, y1, r1 = list(x0), list(y0), list(r0)  # early termination: y1 := y0 for correct samples
    if wrong:
        contexts = []
        for k in wrong:
            f = feedback.feedback(ex_of[k], common.text(worker, y0[k]))
            contexts.append(render(tok, [task.prompt(ex_of[k]), common.text(worker, y0[k]), f]))
        counters["revisions_attempted"] = len(wrong)
        revised = common.sample(worker, cfg, contexts, counters, "revisions", cached=kept)
        for k, ctx, y in zip(wrong, contexts, revised):
            x1[k], y1[k] = ctx, y
            r1[k] = float(feedback.is_correct(ex_of[k], common.text(worker, y)))
        counters["revisions_successful"] = int(sum(r1[k] for k in wrong))
    del kept
    device = model_device(model)
    continued = torch.zeros(p * n, dtype=torch.bool, device=device)
    continued[wrong] = True
    a_rl0, a_rl1, a_sd = (a.flatten() for a in B.rltf_sd_advantages(
        torch.tensor(r0, device=device).view(p, n), torch.tensor(r1, device=device).view(p, n),
        continued.view(p, n), s.gamma))
    first = [make_trace(ex.uid, x, y, eos) for ex, x, y in zip(ex_of, x0, y0)]
    second = [make_trace(ex.uid, x, y, eos) for ex, x, y in zip(ex_of, x1, y1)]
    distil = [make_trace(ex.uid, x, y, eos) for ex, x, y in zip(ex_of, x0, y1)]  # y1 under x0

    t0 = time.perf_counter()
    batches = common.draw_batches(p * n, s.train.batch_size, s.train.local_steps * s.train.grad_accum, seed)
    used = sorted({i for b in batches for i in b})
    both = [first[i] for i in used] + [second[i] for i in used]
    old_all = common.logprobs_of(model, both, pad, worker.dtype_used)
    ref_all = common.logprobs_of(model, both, pad, worker.dtype_used, adapter=False) if s.beta > 0 else None
    m = len(used)
    old0, old1 = dict(zip(used, old_all[:m])), dict(zip(used, old_all[m:]))
    ref0 = dict(zip(used, ref_all[:m])) if ref_all else None
    ref1 = dict(zip(used, ref_all[m:])) if ref_all else None
    queue = iter(batches)

    def micro_step() -> dict[str, torch.Tensor]:
        idx = next(queue)
        k = len(idx)
        batch = pack([first[i] for i in idx] + [second[i] for i in idx] + [distil[i] for i in idx], pad, device)
        logp = completion_logprobs(model, batch, worker.dtype_used)  # [3B, C]
        mask = batch.completion_mask
        rows = lambda part: slice(part * k, (part + 1) * k)  # noqa: E731
        terms = B.rltf_sd_loss(
            logp[rows(0)], mask[rows(0)], logp[rows(1)], mask[rows(1)], logp[rows(2)], mask[rows(2)],
            (a_rl0[idx], a_rl1[idx], a_sd[idx]), beta=s.beta, eps=s.eps,
            old_logp0=common.aligned([old0[i] for i in idx], batch.window, device),
            old_logp1=common.aligned([old1[i] for i in idx], batch.window, device),
            ref_logp0=common.aligned([ref0[i] for i in idx], batch.window, device) if ref0 else None,
            ref_logp1=common.aligned([ref1[i] for i in idx], batch.window, device) if ref1 else None,
            sd_coef=s.sd_coef, rl_coef=s.rl_coef,
        )
        return {"loss": terms["loss"], "loss_sd": terms["sd"], "loss_rl0": terms["rl0"], "loss_rl1": terms["rl1"],
                "kl": terms["kl"]}

    wins = int(sum(r1))
    return common.finish_round(worker, micro_step, s.train, lr=lr, seed=seed, started=t0, counters=counters,
                               **{"num-wins": wins, "num-losses": p * n - wins, "weight": p, "group_size": n})

