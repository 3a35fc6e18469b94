"""SPEAR (paper Alg. 1; SPEC §2–3): interaction with partial-feedback revisions, then NLL on the win set plus the
confidence-gated tail unlikelihood on the lose set. Aggregation weight: the win count |W| (SPEC §4).

Defaults: the paper's appendix table "Hyperparameter Settings (SPEAR)" (λ_w 1.0, λ_l 0.1, μ 0.3, τ per task, N 2),
carried by :class:`fedspear.config.RunConfig` where the CPU defaults are marked.

``revised_wins = "reasoned"`` (opt-in; default "all" = the paper) keeps right revisions that do not reason out of
the win set: the decision and its reasons are in :mod:`fedspear.interaction` (Decision on the guard).
"""

from __future__ import annotations

from typing import Sequence

from ..algorithm_defaults import MAX_LOSE_RATIO, TAU  # noqa: F401 - τ and |L|/|W| per task, read as spear.TAU
from ..feedback import FeedbackSource
from ..interaction import interact
from ..tasks.base import Example
from ..training import TrainSettings, local_train

Settings = TrainSettings
#: ``client_round`` accepts ``log`` (the client's training traces, ``fedspear.answers``)
KEEPS_TRACES = True


def settings(cfg) -> TrainSettings:
    """SPEAR's local-training settings from a resolved ``RunConfig``."""
    return TrainSettings.from_config(cfg)


def client_round(worker, cfg, examples: Sequence[Example], *, lr: float, seed: int, feedback: FeedbackSource,
                 train: TrainSettings | None = None, task=None, replay=None, log: list | None = None
                 ) -> dict[str, float]:
    """One SPEAR client-round: interaction (Alg. 1 lines 3–25), then local training (lines 26–31).

    ``task`` (default: the run's task) renders the prompts; ``replay`` passes attempts a person already judged (see
    :func:`fedspear.interaction.interact`; ``fedspear.human.replay``) instead of sampling new ones. ``log``, when a
    list, receives each prompt's attempts and outcome (``interact``'s ``log``).

    Returns the interaction counters, the training metrics of :func:`fedspear.training.local_train`, ``num-wins``,
    ``num-losses`` and ``weight`` = |W|.
    """
    result = interact(
        worker.model, worker.tokenizer, examples, task or worker.task, feedback,
        max_revisions=cfg.max_revisions, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, dtype_used=worker.dtype_used, seed=seed, replay=replay,
        revised_wins=getattr(cfg, "revised_wins", "all"), log=log,
    )
    stats = local_train(worker.model, worker.tokenizer, result.wins, result.losses, train or settings(cfg),
                        lr=lr, dtype_used=worker.dtype_used, seed=seed)
    metrics: dict[str, float] = {"num-wins": len(result.wins), "num-losses": len(result.losses),
                                 "weight": len(result.wins)}
    metrics.update(result.counters)
    metrics.update(stats)
    return metrics
