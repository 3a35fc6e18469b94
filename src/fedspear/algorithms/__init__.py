"""The client algorithms: SPEAR and the baselines of SPEC §5, one module each, sharing one interface.

Every module exposes a typed ``Settings`` dataclass (defaults from the paper's appendix tables, cited there), a
``settings(cfg) -> Settings`` built from a :class:`fedspear.config.RunConfig`, and::

    client_round(worker, cfg, examples, *, lr, seed, feedback) -> metrics

which trains ``worker.model``'s adapter in place on one client's prompts for one round, with the round's resolved
settings ``cfg`` (passed down, never stored on the worker), and returns the metrics the server logs. Every algorithm
reports the same counters (``prompts``, ``initial_samples`` (first answers sampled: one per prompt, or a group per
prompt for GRPO and RLTF-SD), ``initial_correct``, ``revisions_attempted``, ``revisions_successful``, ``generations``,
``tokens_generated``, ``seconds_generate_initial``, ``seconds_generate_revisions``, ``seconds_train``, ``steps``) plus
``weight`` — its aggregation weight (SPEC §5: the win count for SPEAR and Feedback SFT, the number of prompts for GRPO,
OPSD and RLTF-SD) — and ``num-wins`` / ``num-losses`` (correct / wrong traces it trained on or sampled).

The shared ClientApp (:mod:`fedspear.fl.client_app`), data partition, evaluation and strategy are the same for all.
"""

from __future__ import annotations

from types import ModuleType

from . import feedback_sft, grpo, opsd, rltf_sd, spear

#: name (the ``algorithm`` run key) → its module, in the order of ``fedspear.algorithm_defaults.ALGORITHM_NAMES``
#: (the torch-free list the run configuration reads; tests/test_algorithms.py checks they agree).
ALGORITHMS: dict[str, ModuleType] = {
    "spear": spear,
    "feedback_sft": feedback_sft,
    "grpo": grpo,
    "opsd": opsd,
    "rltf_sd": rltf_sd,
}
