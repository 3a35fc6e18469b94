"""Where feedback on a wrong answer comes from: the ``FeedbackSource`` protocol and the simulated user.

SPEC §2 (paper Alg. 1, lines 5–11): after each attempt the client asks ``is_correct``; for a wrong attempt it asks
``feedback`` and appends the text to the conversation. In simulation the source is ``OracleFeedback``: a user who
knows the gold answer and writes the appendix feedback templates without ever revealing it (SPEC §2 no-leak
decision). ``NoisyFeedback`` is that user made unreliable (the paper's stated limitation): it flips the verdict
with probability p and gives an irrelevant hint with probability q. In deployment, anything with the same two
methods fits: ``fedspear.human.replay.HumanFeedback`` replays what a person said in ``fedspear chat``.

Core module: no torch, no flwr.
"""

from __future__ import annotations

import hashlib
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
        return self.task.is_correct(example, completion)

    def feedback(self, example: Example, completion: str) -> str:
        """The task's feedback template for a wrong completion.

        Raises:
            ValueError: ``completion`` is correct (feedback is only given for wrong answers).
        """
        return self.task.feedback(example, completion)


#: Hints a careless user might type that say nothing about the question at hand (NoisyFeedback's irrelevant hints).
IRRELEVANT_HINTS = (
    "Think about it again.",
    "Remember that water boils at 100 degrees Celsius at sea level.",
    "Read it more slowly this time.",
    "My cousin would know this one.",
    "The answer is probably simpler than you think.",
    "Consider what happened in the 18th century.",
    "Try to be more confident.",
    "Don't forget about the weather.",
)


class NoisyFeedback:
    """A simulated user who is sometimes wrong: the oracle of SPEC §2 with verdict flips and irrelevant hints.

    Each judgement is a seeded function of ``(seed, example uid, completion text)``, so the same answer always gets the
    same verdict and hint (the user is consistent within and across calls; no state to checkpoint).

    - ``is_correct``: the oracle's verdict, flipped with probability ``flip_prob`` (p).
    - ``feedback``: with probability ``irrelevant_prob`` (q) — and always when the answer was in fact right but the
      flipped verdict called it wrong (no honest hint exists then) — one of ``IRRELEVANT_HINTS``; otherwise the
      oracle's hint.

    ``counts`` tallies ``user_flips`` and ``user_irrelevant_hints`` (reported as client metrics).

    Args:
        task: a task module. flip_prob: p in [0, 1]. irrelevant_prob: q in [0, 1]. seed: the user's seed.
    Raises:
        ValueError: p or q outside [0, 1].

    >>> from fedspear.tasks import get_task
    >>> user = NoisyFeedback(get_task("strategy_qa"), flip_prob=1.0, irrelevant_prob=0.0)
    >>> isinstance(user, FeedbackSource)
    True
    """

    def __init__(self, task: ModuleType, flip_prob: float = 0.0, irrelevant_prob: float = 0.0, seed: int = 0) -> None:
        for name, value in (("flip_prob", flip_prob), ("irrelevant_prob", irrelevant_prob)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"NoisyFeedback: {name} = {value} must lie in [0, 1]")
        self.oracle = OracleFeedback(task)
        self.flip_prob, self.irrelevant_prob, self.seed = flip_prob, irrelevant_prob, seed
        self.counts = {"user_flips": 0, "user_irrelevant_hints": 0}

    def __repr__(self) -> str:
        return f"NoisyFeedback({self.oracle.task.NAME}, p={self.flip_prob}, q={self.irrelevant_prob}, seed={self.seed})"

    def _uniform(self, purpose: str, example: Example, completion: str) -> float:
        """A uniform draw in [0, 1) fixed by (seed, purpose, uid, completion)."""
        key = f"{self.seed}\x00{purpose}\x00{example.uid}\x00{completion}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64

    def _flipped(self, example: Example, completion: str) -> bool:
        return self._uniform("flip", example, completion) < self.flip_prob

    def is_correct(self, example: Example, completion: str) -> bool:
        """The oracle's verdict, flipped with probability p."""
        verdict = self.oracle.is_correct(example, completion)
        if self._flipped(example, completion):
            self.counts["user_flips"] += 1
            return not verdict
        return verdict

    def feedback(self, example: Example, completion: str) -> str:
        """A hint for an answer this user called wrong: irrelevant with probability q (or when it was right)."""
        truly_correct = self.oracle.is_correct(example, completion)
        if truly_correct or self._uniform("hint", example, completion) < self.irrelevant_prob:
            self.counts["user_irrelevant_hints"] += 1
            pick = int(self._uniform("which", example, completion) * len(IRRELEVANT_HINTS))
            return IRRELEVANT_HINTS[pick]
        return self.oracle.feedback(example, completion)


def make_feedback(task: ModuleType, flip_prob: float = 0.0, irrelevant_prob: float = 0.0,
                  seed: int = 0) -> FeedbackSource:
    """The simulated user a run asks for: the exact oracle when p = q = 0, else ``NoisyFeedback``."""
    if flip_prob == 0.0 and irrelevant_prob == 0.0:
        return OracleFeedback(task)
    return NoisyFeedback(task, flip_prob, irrelevant_prob, seed)
