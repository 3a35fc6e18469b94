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


__all__ = ["TASKS", "DataError", "Example", "get_task"]
