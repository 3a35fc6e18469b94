"""Shared test helpers (plain functions and classes; fixtures live in conftest.py): a tiny-model worker, a LoRA start
that receives gradients, and a feedback source with mixed rewards."""

from __future__ import annotations

import numpy as np

from fedspear.client import Worker
from fedspear.config import RunConfig
from fedspear.model import get_adapter, set_adapter

TINY_WORKER = dict(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=3, local_steps=2,
                   batch_size=2, lr=1e-2, max_new_tokens=4, lora_r=4, lora_alpha=8, lora_dropout=0.0, train_size=40)


def make_worker(**overrides) -> Worker:
    """A tiny-random-model worker with a resolved config: ``TINY_WORKER`` settings, ``overrides`` on top."""
    worker = Worker.load(RunConfig(**{**TINY_WORKER, **overrides}))
    worker.cfg = worker.cfg.resolved()
    return worker


def nonzero_start(worker: Worker) -> dict[str, np.ndarray]:
    """Perturb every LoRA tensor by 0.05·N(0, 1) (seed 0) and return the start adapter: B = 0 at initialisation
    would make the LoRA path, its dropout and A's gradient inert."""
    rng = np.random.default_rng(0)
    start = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in get_adapter(worker.model).items()}
    set_adapter(worker.model, start)
    return start


class Alternate:
    """Feedback source where every other sampled answer is right (every GRPO group of 4 has mixed rewards, so the
    surrogate has a gradient)."""

    def __init__(self):
        self.n = 0

    def is_correct(self, example, completion):
        self.n += 1
        return self.n % 2 == 0

    def feedback(self, example, completion):
        return "Incorrect. Hint: think again."
