"""What the baseline client loops share: grouped sampling, no-grad log-probabilities, batches drawn over a round.

Nothing here imports ``flwr``.
"""

from __future__ import annotations

import random
import time
from typing import Sequence

import torch

from .. import progress
from ..interaction import Trace, decode, new_counters, render, sample_counted
from ..runtime.model import model_device, pad_id
from ..tasks.base import Example
from ..training import Cycler, TrainSettings, completion_logprobs, optimise, pack


def sample(worker, cfg, contexts: Sequence[list[int]], counters: dict, phase: str, **reuse) -> list[list[int]]:
    """One sampled completion per context (``cfg``'s temperature / top-p / token budget), counted and timed.

    ``phase`` is ``"initial"`` or ``"revisions"`` (which ``seconds_generate_*`` counter the time goes to); ``reuse``:
    ``generate``'s ``keep`` or ``cached`` (a revision reusing its initial answer's KV cache,
    ``fedspear.runtime.generation``).
    """
    t = time.perf_counter()
    with progress.phase("initial answers" if phase == "initial" else "revisions"):
        ids = sample_counted(worker.model, worker.tokenizer, contexts, counters, max_new_tokens=cfg.max_new_tokens,
                             dtype_used=worker.dtype_used, temperature=cfg.temperature, top_p=cfg.top_p, **reuse)
    counters[f"seconds_generate_{phase}"] += time.perf_counter() - t
    return ids


def prompt_ids(worker, examples: Sequence[Example]) -> list[list[int]]:
    """c0 for each example: the task's prompt in the chat template (no feedback, no facts)."""
    task = worker.task
    return [render(worker.tokenizer, [task.prompt(ex)]) for ex in examples]


def text(worker, ids: list[int]) -> str:
    return decode(worker.tokenizer, ids)


@torch.no_grad()
def logprobs_of(model, traces: Sequence[Trace], pad: int, dtype_used: str, *, adapter: bool = True,
                batch_size: int = 16) -> list[torch.Tensor]:
    """Per-trace completion log-probabilities (float32 ``[len(completion)]`` each), no grad, eval mode.

    ``adapter=False`` scores under the base model (peft's ``disable_adapter``): the GRPO / RLTF-SD reference policy.
    Eval mode means no dropout: the live forward these are compared with must run without it too
    (``TrainSettings.dropout = False``; :mod:`fedspear.algorithms.grpo`, **Decision (dropout)**).
    """
    was_training = model.training
    model.eval()
    device = model_device(model)
    out: list[torch.Tensor] = []
    for start in range(0, len(traces), batch_size):
        chunk = list(traces[start : start + batch_size])
        batch = pack(chunk, pad, device)
        if adapter:
            logp = completion_logprobs(model, batch, dtype_used)
        else:
            with model.disable_adapter():
                logp = completion_logprobs(model, batch, dtype_used)
        for i, t in enumerate(chunk):
            n = len(t.completion_ids)
            out.append(logp[i, batch.window - n :].float().clone())
    model.train(was_training)
    return out


def aligned(values: Sequence[torch.Tensor], window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-trace vectors right-aligned in a packed completion window of width C → ``[len(values), C]`` on ``device``
    (the batch's; None: torch's default device), 0 elsewhere."""
    out = torch.zeros((len(values), window), dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        if len(v):
            out[i, window - len(v) :] = v
    return out


def draw_batches(n_items: int, batch_size: int, count: int, seed: int) -> list[list[int]]:
    """``count`` batches of up to ``batch_size`` indices into ``n_items`` items, cycling through seeded permutations.

    All batches of a round are drawn up front, so the sampling-time ("old") and reference log-probabilities can be
    computed before the first optimiser step for exactly the items that will be used.
    """
    draw = Cycler(range(n_items), batch_size, random.Random(seed))
    return [draw.next() for _ in range(count)]


def start_round(worker, examples: Sequence[Example], seed: int) -> tuple[int, int, dict[str, float], list[list[int]]]:
    """Seed torch's sampler and return ``(eos id, pad id, zeroed counters, c0 token ids per example)``."""
    torch.manual_seed(seed)
    tok = worker.tokenizer
    return tok.eos_token_id, pad_id(tok), new_counters(len(examples)), prompt_ids(worker, examples)


def finish_round(worker, micro_step, train: TrainSettings, *, lr: float, seed: int, started: float,
                 counters: dict[str, float], **extra: float) -> dict[str, float]:
    """Run the local steps (:func:`fedspear.training.optimise`) and merge counters, training metrics and ``extra``.

    ``started`` is the ``time.perf_counter()`` at which the training phase began (its pre-passes included).
    """
    stats = optimise(worker.model, micro_step, train, lr=lr, seed=seed)
    worker.model.eval()
    stats["seconds_train"] = time.perf_counter() - started
    return {**counters, **stats, "lr": lr, **extra}
