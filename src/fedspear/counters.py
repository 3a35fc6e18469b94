"""The names a client's reply carries (SPEC §6): one list for the algorithms that fill them, the checks that validate
them and the server that sums them per round. Flower metric names are kebab-case where the paper's symbols are
(``num-wins`` = |W|, ``num-losses`` = |L|); ``fedspear.config.snake_key`` gives their metrics.jsonl names.
"""

from __future__ import annotations

#: counted during the interaction phase; zeroed at the start of every client-round
#: (``fedspear.interaction.new_counters``)
INTERACTION = ("prompts", "initial_samples", "initial_correct", "revisions_attempted", "revisions_successful",
               "generations", "tokens_generated")
#: counted by the local training loop (``fedspear.training.local_train`` / ``optimise``)
TRAINING = ("steps", "skipped_nonfinite", "active_tokens", "lose_used")
#: what the server averages with: the aggregation weight (|W|, or the prompts for GRPO, OPSD and RLTF-SD) and the
#: win / lose counts
AGGREGATION = ("weight", "num-wins", "num-losses")

#: a reply without these is refused (``fedspear.server.validation.check_reply``)
REQUIRED = ("weight", "num-wins", "num-losses", "prompts")
#: these must be non-negative integers in a reply
INTEGER = (*REQUIRED, *INTERACTION[1:], "steps", "skipped_nonfinite")
#: summed over a round's clients into its metrics record (``fedspear.fl.server_app``)
SUMMED = (*INTERACTION[:5], "num-wins", "num-losses", "weight", *INTERACTION[5:], "skipped_nonfinite", "active_tokens",
          "lose_used", "steps")
