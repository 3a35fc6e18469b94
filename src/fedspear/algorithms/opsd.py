"""OPSD, on-policy self-distillation (Zhao et al. 2026; SPEC §5) as a federated client.

Per prompt one on-policy sample y ~ π_θ(·|x) from the plain prompt. The teacher is the same network given
*privileged context* — the prompt followed by the gold answer and, where the task has them, the StrategyQA facts or
the MATH solution — scoring the student's own tokens y. The loss is a divergence between the teacher's and the
student's next-token distributions over the full vocabulary at every completion position, mean over completion
tokens (:func:`fedspear.baseline_losses.distill_loss`). Aggregation weight: the number of prompts.

Variants (``opsd_variant``):

- ``original`` (default; Zhao et al.): generalised JSD, β = 0.5, temperature 1.1, teacher = the base model
  (adapter disabled).
- ``authors`` (how the SPEAR authors ran it, SPEC §5): forward KL(teacher ‖ student) at temperature 2, multiplied
  by T² = 4 (Hinton et al. 2015; SPEC §8: 0.258889 × 4 = 1.035556), teacher = the current model (adapter on, no
  gradient). The T² keeps the loss and its gradient on the scale of a T = 1 loss; without it both are 4× smaller,
  and gradient clipping at norm 1.0 then acts on a different gradient.

Training settings (steps, batch, learning rate) follow the paper's appendix table "Training and federated learning
hyperparameters for OPSD" through :class:`fedspear.config.RunConfig`. OPSD checks no answer for correctness; the
``initial_correct`` counter records how often the student's sample was right, for comparison only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import baseline_losses as B
from ..feedback import FeedbackSource
from ..interaction import Trace, make_trace, render
from ..runtime.model import model_device
from ..tasks.base import Example
from ..training import TrainSettings, completion_logits, pack
from . import common

VARIANTS = {
    "original": dict(divergence="jsd", beta=0.5, temperature=1.1, teacher="base", t2_scaling=False),
    "authors": dict(divergence="forward_kl", beta=0.5, temperature=2.0, teacher="current", t2_scaling=True),
}


@dataclass
class Settings:
    """OPSD settings (``VARIANTS``).

    Attributes:
        divergence: ``"jsd"`` (generalised JSD) or ``"forward_kl"`` (KL(teacher ‖ student)).
        beta: JSD mixture weight (ignored by ``"forward_kl"``).
        temperature: softmax temperature T of both models.
        teacher: ``"base"`` (adapter disabled) or ``"current"`` (adapter on, no gradient).
        t2_scaling: multiply the divergence by T² (the ``authors`` variant; SPEC §5/§8).
        train: the shared optimiser settings.
    """

    divergence: str = "jsd"
    beta: float = 0.5
    temperature: float = 1.1
    teacher: str = "base"
    t2_scaling: bool = False
    train: TrainSettings = None  # type: ignore[assignment]


def settings(cfg) -> Settings:
    return Settings(**VARIANTS[cfg.opsd_variant], train=TrainSettings.from_config(cfg))


def loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, s: Settings) -> torch.Tensor:
    """The OPSD loss of one micro-batch under settings ``s``: :func:`fedspear.baseline_losses.distill_loss` with
    the variant's divergence, β, T and T² scaling. Logits ``[B, C, V]``, mask ``[B, C]`` → scalar."""
    return B.distill_loss(student_logits, teacher_logits, mask, s.divergence, s.beta, s.temperature,
                          t2_scaling=s.t2_scaling)


def privileged_prompt(task, example: Example) -> str:
    """The teacher's user message: the task prompt, then the gold answer and any solution or facts.

    This is the privileged information OPSD assumes (SPEC §5); it never reaches the student's context or a reply.
    """
    gold = example.gold
    if example.options:
        gold = f"{gold}. {example.options[example.labels.index(gold)]}"
    parts = [task.prompt(example), f"Reference information: the correct answer is {gold}."]
    if example.extra.get("facts"):
        parts.append("Facts:\n" + "\n".join(f"- {f}" for f in example.extra["facts"]))
    if example.extra.get("solution"):
        parts.append("Solution:\n" + str(example.extra["solution"]))
    return "\n\n".join(parts)


def client_round(worker, cfg, examples: Sequence[Example], *, lr: float, seed: int,
                 feedback: FeedbackSource) -> dict[str, float]:
    """One OPSD client-round (``feedback`` only fills the ``initial_correct`` counter)."""
    s, model, tok = settings(cfg), worker.model, worker.tokenizer
    eos, pad, counters, c0 = common.start_round(worker, examples, seed)
    completions = common.sample(worker, cfg, c0, counters, "initial")
    correct = [feedback.is_correct(ex, common.text(worker, y)) for ex, y in zip(examples, completions)]
    counters["initial_correct"] = sum(correct)
    students = [make_trace(ex.uid, c, y, eos) for ex, c, y in zip(examples, c0, completions)]
    teachers = [Trace(t.uid, render(tok, [privileged_prompt(worker.task, ex)]), t.completion_ids, t.has_eos)
                for ex, t in zip(examples, students)]

    t0 = time.perf_counter()
    device = model_device(model)
    queue = iter(common.draw_batches(len(students), s.train.batch_size, s.train.local_steps * s.train.grad_accum,
                                     seed))

    def micro_step() -> dict[str, torch.Tensor]:
        idx = next(queue)
        student = pack([students[i] for i in idx], pad, device)
        teacher = pack([teachers[i] for i in idx], pad, device)  # same completions → same window C
        with torch.no_grad():
            was_training = model.training
            model.eval()
            if s.teacher == "base":
                with model.disable_adapter():
                    teacher_logits = completion_logits(model, teacher, worker.dtype_used).float()  # [B, C, V]
            else:
                teacher_logits = completion_logits(model, teacher, worker.dtype_used).float()
            model.train(was_training)
        student_logits = completion_logits(model, student, worker.dtype_used)  # [B, C, V]
        return {"loss": loss(student_logits, teacher_logits, student.completion_mask, s)}

    wins = int(sum(correct))
    return common.finish_round(worker, micro_step, s.train, lr=lr, seed=seed, started=t0, counters=counters,
                               **{"num-wins": wins, "num-losses": len(correct) - wins, "weight": len(examples)})
