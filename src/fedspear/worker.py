"""One client's round of SPEAR without any federated engine: set adapter → interaction → local training → copy out.

``fedspear.fl.client_app`` only unpacks Flower messages, calls ``Worker.round`` and packs the reply; this module
never imports ``flwr``. A ``Worker`` holds the base model for the life of its process (one per simulation actor or
per SuperNode), so rounds never reload weights.
"""

from __future__ import annotations

import hashlib
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from . import progress
from .answers import keeps_traces, write_traces
from .config import RunConfig
from .feedback import FeedbackSource, make_feedback
from .algorithms import ALGORITHMS
from .runtime.compiled import use_compiled_decode
from .runtime.compiled_training import use_compiled_training
from .runtime.model import (TRAIN_PROMPT_TOKENS, LoraSettings, add_lora, get_adapter, load_base, set_adapter,
                            use_gradient_checkpointing)
from .runtime.memory import peak_rss_mb, release_memory
from .tasks import get_task, load_train_examples
from .tasks.base import Example

log = logging.getLogger(__name__)


def derived_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (same inputs → same seed across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def round_prompts(partition: Sequence[int], cfg: RunConfig, partition_id: int, server_round: int) -> list[int]:
    """The indices a client answers in ``server_round``: the next stretch of its private prompt stream.

    The stream is a seeded permutation of the client's partition, read in order round after round and wrapping
    around from one round to the next (an evolving stream of prompts, SPEC §1).

    **Decision (2026-11-25, issue 16): no item twice in one client-round.** A round takes
    k = min(``rollouts_per_round``, |D_k|) prompts, so with fewer items than rollouts each item is asked once,
    as the authors' code caps rollouts at min(|D_k|, steps). Asking the same prompt several times in a round (what
    the wrap-around did before: 7–8 times per round at the paper's 80–160 rollouts and ≈ 22 ARC items per client
    at 50 clients) inflates |W|, the aggregation weight, and over-trains those items. ``repeat_prompts = true``
    restores the old rule (k = ``rollouts_per_round``, wrapping within the round). When k = ``rollouts_per_round``
    both rules give the same prompts.

    Returns:
        k indices into the train split, distinct unless ``cfg.repeat_prompts``; ``[]`` for an empty partition.
    """
    if not partition:
        return []
    order = list(partition)
    random.Random(derived_seed(cfg.seed, "stream", partition_id)).shuffle(order)
    k = cfg.rollouts_per_round if cfg.repeat_prompts else min(cfg.rollouts_per_round, len(order))
    start = (server_round - 1) * k
    return [order[(start + i) % len(order)] for i in range(k)]


@dataclass
class Worker:
    """The base model with its LoRA adapter, the tokenizer and the train data, loaded once per process.

    ``loaded`` holds the settings they were loaded with (``compatible`` compares a round's settings with it); each
    round's own settings are passed to :meth:`round`, never stored here.
    """

    loaded: RunConfig
    model: object
    tokenizer: object
    dtype_used: str
    examples: list[Example]

    @classmethod
    def load(cls, cfg: RunConfig) -> "Worker":
        cfg = cfg.resolved()
        base, tokenizer, dtype_used = load_base(cfg.model, cfg.dtype, cfg.device)
        lora = LoraSettings(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.last_layers)
        # a micro-step trains on at most batch_size wins and batch_size losses of prompt + completion tokens
        use_gradient_checkpointing(base, cfg.gradient_checkpointing, rows=2 * cfg.batch_size,
                                   length=TRAIN_PROMPT_TOKENS + cfg.max_new_tokens, window=cfg.max_new_tokens,
                                   gpu_share=cfg.client_gpus)
        model = add_lora(base, lora, seed=cfg.seed)
        use_compiled_decode(model, cfg.compile_decode)
        use_compiled_training(model, cfg.compile_training)
        return cls(cfg, model, tokenizer, dtype_used, load_train_examples(cfg))

    def compatible(self, cfg: RunConfig) -> bool:
        """Whether this worker's model can serve ``cfg``: the same model, dtype and device, LoRA shape, the ways it was
        prepared to run (gradient checkpointing, ``compile_decode``, ``compile_training``, ``client_gpus``), task, data
        and seed. Otherwise the process loads the model again (``NodeRunner.worker_for``)."""
        keys = ("model", "dtype", "device", "lora_r", "lora_alpha", "lora_dropout", "last_layers",
                "gradient_checkpointing", "compile_decode", "compile_training", "client_gpus", "task", "data_dir",
                "data_source", "train_size", "seed")
        return all(getattr(self.loaded, k) == getattr(cfg, k) for k in keys)

    @property
    def task(self):
        return get_task(self.loaded.task)

    def round(
        self,
        cfg: RunConfig,
        global_arrays: dict[str, np.ndarray],
        partition: Sequence[int],
        partition_id: int,
        server_round: int,
        lr: float,
        feedback_source: FeedbackSource | None = None,
        trace_dir: str | Path | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Run the configured algorithm (``cfg.algorithm``; SPEAR = paper Alg. 1) on this client for one round.

        Args:
            cfg: this round's settings (resolved here; must be ``compatible`` with the loaded ones).
            global_arrays: the broadcast LoRA tensors θ^(t) (name → array).
            partition: indices of this client's train examples.
            lr: learning rate for this round (the server's schedule).
            feedback_source: who judges answers (default: the dataset oracle of SPEC §2, made noisy by
                ``user_flip_prob`` / ``user_irrelevant_prob``).
            trace_dir: where this client keeps its training traces when the run keeps them
                (``fedspear.answers.keeps_traces``; SPEAR and Feedback SFT): ``<trace_dir>/round_NNNN/client_PPPP
                .jsonl.gz``, written here on the client; None keeps none.
        Returns:
            ``(adapter copy, metrics)``; metrics hold ``weight`` (the aggregation weight: |W| for SPEAR and Feedback
            SFT, the number of prompts for the other baselines), ``num-wins``, ``num-losses`` and the counters of
            SPEC §6.
        """
        if not self.compatible(cfg):
            raise ValueError("this worker was loaded for other model, data or LoRA settings (see Worker.compatible)")
        cfg = cfg.resolved()
        set_adapter(self.model, global_arrays)
        examples = [self.examples[i] for i in round_prompts(partition, cfg, partition_id, server_round)]
        seed = derived_seed(cfg.seed, "client-round", partition_id, server_round)
        algorithm = ALGORITHMS[cfg.algorithm]
        if feedback_source is None:
            feedback_source = make_feedback(self.task, cfg.user_flip_prob, cfg.user_irrelevant_prob,
                                            seed=derived_seed(cfg.seed, "user", partition_id))
        keep = trace_dir is not None and getattr(algorithm, "KEEPS_TRACES", False) and keeps_traces(cfg)
        extra = {"log": []} if keep else {}
        progress.start(f"client {partition_id}", server_round)
        try:
            metrics = algorithm.client_round(self, cfg, examples, lr=lr, seed=seed, feedback=feedback_source, **extra)
        finally:
            progress.finish()
        if keep:  # raw answers stay on the client (fedspear.answers)
            write_traces(trace_dir, server_round, partition_id, extra["log"])
        metrics.update(getattr(feedback_source, "counts", {}))
        metrics["partition-size"] = len(partition)
        metrics["peak_rss_mb"] = peak_rss_mb()
        arrays = get_adapter(self.model)
        metrics["rss_after_round_mb"] = release_memory()
        return arrays, metrics

    def _save_global(self, folder: Path) -> None:
        """The federation's current adapter in peft format beside the trace store (``fedspear chat --adapter``);
        written to a temp folder and renamed, so chat never reads half a file."""
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)

    def human_round(
        self, cfg: RunConfig, global_arrays: dict[str, np.ndarray], store, partition_id: int, server_round: int,
        lr: float,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """One client-round on what people said in ``fedspear chat`` (``fedspear.human.replay.client_round``).

        Trains on at most ``rollouts_per_round`` unused trajectories of ``store`` (a ``TraceStore``), oldest
        first, and marks them used. Returns ``(adapter copy, metrics)`` as :meth:`round` does.

        Raises:
            ValueError: the run's algorithm cannot learn from stored trajectories.
        """
        from .human.replay import client_round

        cfg = cfg.resolved()
        set_adapter(self.model, global_arrays)
        self._save_global(Path(store.path).parent / "global_adapter")
        seed = derived_seed(cfg.seed, "client-round", partition_id, server_round)
        metrics = client_round(self, cfg, store, lr=lr, seed=seed, server_round=server_round,
                               max_prompts=cfg.rollouts_per_round)
        metrics["peak_rss_mb"] = peak_rss_mb()
        arrays = get_adapter(self.model)
        metrics["rss_after_round_mb"] = release_memory()
        return arrays, metrics
