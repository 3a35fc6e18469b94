"""Training on what people said: stored chat trajectories replayed through SPEAR's interaction phase.

In deployment the interaction phase happens live, in ``fedspear chat``: a person asks, the model answers, the
person marks the answer right or wrong and types a hint, the model revises (paper Alg. 1 lines 5–22 with a human
as the feedback source). Each conversation is stored in the node's :class:`~fedspear.human.store.TraceStore`. When the
node is selected for a round, :func:`client_round` takes the closed, fully judged, unused trajectories, replays
their attempts through :func:`fedspear.interaction.interact` (``replay=``) with :class:`HumanFeedback` as the
feedback source — so the win / lose split and the α weights are exactly SPEAR's — trains the adapter with the
run's algorithm (``spear`` or ``feedback_sft``; the others need fresh samples and are refused), and marks the
trajectories used. Only the adapter and counters leave the node.

Core module: no flwr.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Sequence

from ..algorithms import ALGORITHMS
from ..tasks.base import Example
from .store import TraceStore, Trajectory

#: Algorithms that can learn from replayed human trajectories (the others sample afresh each round).
HUMAN_ALGORITHMS = ("spear", "feedback_sft")

#: The "task" of a chat prompt: the person's message is the whole user turn c0.
CHAT_TASK = SimpleNamespace(NAME="chat", MAX_NEW_TOKENS=256, prompt=lambda example: example.question)


def as_example(trajectory: Trajectory) -> Example:
    """A trajectory's prompt as an :class:`Example` (uid ``chat-<id>``; no labels: the person is the judge)."""
    return Example(uid=f"chat-{trajectory.id}", question=trajectory.prompt, labels=(), options=(), gold="")


class HumanFeedback:
    """The ``FeedbackSource`` of a human node: the verdicts and hints a person gave in ``fedspear chat``.

    Looks a completion up by ``(example uid, decoded text of its stored token ids)``, so it answers exactly for the
    attempts being replayed.

    Args:
        trajectories: the stored trajectories being replayed.
        decode: token ids → text, as the interaction phase decodes them (``tokenizer.decode(ids,
            skip_special_tokens=True)``).
    Raises (on lookup):
        KeyError: the completion is not a stored attempt of that trajectory, or (``feedback``) it has no hint.
    """

    def __init__(self, trajectories: Sequence[Trajectory], decode: Callable[[list[int]], str]) -> None:
        self._judged: dict[tuple[str, str], tuple[bool, str | None]] = {}
        for traj in trajectories:
            for attempt in traj.attempts:
                key = (f"chat-{traj.id}", decode(attempt.completion_ids))
                self._judged.setdefault(key, (bool(attempt.verdict), attempt.hint))

    def _lookup(self, example: Example, completion: str) -> tuple[bool, str | None]:
        try:
            return self._judged[(example.uid, completion)]
        except KeyError:
            raise KeyError(f"{example.uid}: no stored attempt with this completion ({completion[:60]!r})") from None

    def is_correct(self, example: Example, completion: str) -> bool:
        """The person's verdict."""
        return self._lookup(example, completion)[0]

    def feedback(self, example: Example, completion: str) -> str:
        """The hint the person typed for this wrong answer."""
        verdict, hint = self._lookup(example, completion)
        if verdict or hint is None:
            raise KeyError(f"{example.uid}: the person gave no hint for this answer")
        return hint


def client_round(worker, cfg, store: TraceStore, *, lr: float, seed: int, server_round: int,
                 max_prompts: int | None = None) -> dict[str, float]:
    """Train the worker's adapter on the node's unused human trajectories and mark them used.

    Args:
        worker: a :class:`fedspear.worker.Worker` with the round's global adapter set.
        cfg: the round's resolved settings; ``cfg.algorithm`` must be one of ``HUMAN_ALGORITHMS``,
            ``cfg.max_revisions`` caps the replayed revisions.
        store: the node's trace store.
        max_prompts: most trajectories per round (None: all trainable ones), oldest first.
    Returns:
        SPEAR's client metrics (``weight`` = |W|, ``num-wins``, ``num-losses``, counters) plus ``human-trajectories``
        (how many were used). With no trainable trajectory nothing trains and ``weight`` is 0 (the server's
        zero-win guard leaves this node out of the average).
    Raises:
        ValueError: the run's algorithm cannot learn from stored trajectories.
    """
    if cfg.algorithm not in HUMAN_ALGORITHMS:
        raise ValueError(f"algorithm {cfg.algorithm!r} cannot train on human trajectories (it samples afresh each "
                         f"round); use one of {', '.join(HUMAN_ALGORITHMS)}")
    trajectories = store.trajectories(trainable_only=True, limit=max_prompts)
    if not trajectories:
        return {"num-wins": 0, "num-losses": 0, "weight": 0, "prompts": 0, "human-trajectories": 0}

    def decode(ids: list[int]) -> str:
        return worker.tokenizer.decode(ids, skip_special_tokens=True)

    examples = [as_example(t) for t in trajectories]
    replay = [[a.completion_ids for a in t.attempts] for t in trajectories]
    metrics = ALGORITHMS[cfg.algorithm].client_round(
        worker, cfg, examples, lr=lr, seed=seed, feedback=HumanFeedback(trajectories, decode), task=CHAT_TASK,
        replay=replay)
    store.mark_used([t.id for t in trajectories], server_round)
    metrics["human-trajectories"] = len(trajectories)
    return metrics
