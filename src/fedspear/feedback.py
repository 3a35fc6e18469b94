"""Where feedback on a wrong answer comes from: the ``FeedbackSource`` protocol and the simulated user.

SPEC §2 (paper Alg. 1, lines 5–11): after each attempt the client asks ``is_correct``; for a wrong attempt it asks
``feedback`` and appends the text to the conversation. In simulation the source is ``OracleFeedback``: a user who
knows the gold answer and writes the appendix feedback templates without ever revealing it (SPEC §2 no-leak
decision). In deployment, anything with the same two methods (a real user, a grader, a unit-test runner) fits.

Core module: no torch, no flwr.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol, runtime_checkable

from fedspear.tasks.base import Example


@runtime_checkable
class FeedbackSource(Protocol):
    """Judges a completion and, when it is wrong, says something helpful about it."""

    def is_correct(self, example: Example, completion: str) -> bool:
        """True when ``completion`` answers ``example`` correctly."""
        ...

    def feedback(self, example: Example, completion: str) -> str:
        """Partial feedback on a wrong ``completion`` (a user message); must not give the answer away."""
        ...


class OracleFeedback:
    """The simulated user of SPEC §2: judges with the task's ``is_correct`` and writes the task's ``feedback``.

    Args:
        task: a task module (``fedspear.tasks.get_task(name)``).

    >>> from fedspear.tasks import get_task
    >>> isinstance(OracleFeedback(get_task("strategy_qa")), FeedbackSource)
    True
    """

    def __init__(self, task: ModuleType) -> None:
        self.task = task

    def __repr__(self) -> str:
        return f"OracleFeedback({self.task.NAME})"

    def is_correct(self, example: Example, completion: str) -> bool:
        """The task's IsCorrect: the extracted final answer equals the gold label."""
        return self.task.is_correct(completion, example)

    def feedback(self, example: Example, completion: str) -> str:
        """The task's feedback template for a wrong completion.

        Raises:
            ValueError: ``completion`` is correct (feedback is only given for wrong answers).
        """
        return self.task.feedback(example, completion)
