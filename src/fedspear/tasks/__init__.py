"""The four SPEAR benchmarks, one module each (API in ``fedspear.tasks.base``): a plain name → module dict.

>>> get_task("arc_challenge").EVAL_SPLIT
'test'
"""

from __future__ import annotations

from types import ModuleType

from fedspear.tasks import arc_challenge, hellaswag, math_mcqa, strategy_qa
from fedspear.tasks.base import DataError, Example

TASKS: dict[str, ModuleType] = {
    arc_challenge.NAME: arc_challenge,
    hellaswag.NAME: hellaswag,
    math_mcqa.NAME: math_mcqa,
    strategy_qa.NAME: strategy_qa,
}


def get_task(name: str) -> ModuleType:
    """The task module called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def load_split(cfg, split: str) -> tuple[list[Example], list[str]]:
    """A split of the run's task and the messages of the malformed records skipped (``skip_bad_records``).

    ``cfg`` is a ``fedspear.config.RunConfig`` (read: ``task``, ``data_dir``, ``data_source``, ``skip_bad_records``).

    Raises:
        DataError: a malformed record when ``skip_bad_records`` is off (names file, line and field).
    """
    task = get_task(cfg.task)
    skipped: list[str] | None = [] if cfg.skip_bad_records else None
    examples = task.load(split, data_dir=cfg.data_dir, source=cfg.data_source, skipped=skipped)
    return examples, skipped or []


def empty_split_error(cfg, split: str) -> DataError:
    """The error for a split of ``cfg``'s task that holds no usable record (an empty file, or every record skipped):
    an evaluation of it would score nothing, and a run report a blank accuracy."""
    source = f"data_dir {cfg.data_dir}" if cfg.data_dir else f"data_source {cfg.data_source}"
    return DataError(f"{cfg.task}'s {split} split ({source}) holds no usable record: nothing to evaluate")


def load_train_examples(cfg) -> list[Example]:
    """The task's train split (first ``train_size`` items when set), as every client sees it before partitioning."""
    examples, _ = load_split(cfg, get_task(cfg.task).TRAIN_SPLIT)
    return examples[: cfg.train_size] if cfg.train_size else examples


__all__ = ["TASKS", "DataError", "Example", "empty_split_error", "get_task", "load_split", "load_train_examples"]
