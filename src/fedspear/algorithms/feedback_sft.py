"""Feedback SFT (SPEC §5): SPEAR's interaction phase unchanged, then NLL on the win set only (λ_l = 0).

The paper's ablation of the unlikelihood term ("feedback-based supervised fine-tuning variant without unlikelihood
loss considerations", §5 Baselines). Aggregation weight: the win count |W|. Every other setting is SPEAR's
(appendix table "Hyperparameter Settings (SPEAR)").
"""

from __future__ import annotations

from typing import Sequence

from ..feedback import FeedbackSource
from ..tasks.base import Example
from ..training import TrainSettings
from . import spear

Settings = TrainSettings
KEEPS_TRACES = True  # client_round accepts log (SPEAR's traces)


def settings(cfg) -> TrainSettings:
    """SPEAR's settings with ``lambda_l = 0`` (no lose-set term)."""
    return TrainSettings.from_config(cfg, lambda_l=0.0)


def client_round(worker, cfg, examples: Sequence[Example], *, lr: float, seed: int,
                 feedback: FeedbackSource, task=None, replay=None, log: list | None = None) -> dict[str, float]:
    """One Feedback-SFT client-round (same traces as SPEAR for the same seed; only the loss differs)."""
    return spear.client_round(worker, cfg, examples, lr=lr, seed=seed, feedback=feedback, train=settings(cfg),
                              task=task, replay=replay, log=log)
