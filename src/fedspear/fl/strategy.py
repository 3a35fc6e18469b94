"""Win-weighted FedAvg on Flower's message API, with the zero-win guard (paper Alg. 2; SPEC §4).

θ^(t+1) = Σ_k |W_k| θ_k / Σ_k |W_k| with the reply metric ``weight`` as the weight
(|W_k| for SPEAR and Feedback SFT; the number of prompts for the other baselines, SPEC §5). The strategy is Flower's
``FedAvg`` (sampling, message construction, reply checks); the averaging itself is ``fedspear.server.aggregation.
win_weighted_average`` (float64 accumulation, fresh arrays). **Decision (SPEC §4):** when every sampled client has
zero wins, Flower's FedAvg would divide by zero; we keep the global adapter unchanged instead.

Before aggregation every reply is checked (``fedspear.server.validation.check_reply``: names, shapes, dtypes, finite
values, non-negative integer counters, optional update-norm bound); a failing reply is excluded and logged with its
node id and reason, and the round goes on. For untrusted populations the unweighted robust rules of Flower's FedMedian
and FedTrimmedAvg (``flwr.server.strategy.aggregate``) can replace the weighted mean.

Adapters travel packed: one flat float Array per message (``to_record``), not one Array per tensor; its layout
(names and shapes) travels in the train message's ConfigRecord (``LAYOUT_KEY``) and the server decodes replies with
the layout it sent. An ArrayRecord therefore holds adapter values only, which Flower's DP clipping and noise need
(they scale and perturb every Array of the record; ``fedspear.fl.privacy``). A reply holding an encoded update
(``update_encoding`` fp16 / int8) is decoded against θ^(t) first, in the message itself, so every check, Flower's
DP wrapper and the aggregation see the plain adapter (``fedspear.fl.records.decode_update``).

Under differential privacy (``dp_denominator`` set) the average is the fixed-denominator mean of
``fedspear.server.aggregation.fixed_denominator_mean`` instead of the win-weighted one, there is no zero-win guard, and
the server optimiser is not applied here but by the caller after the noise (``server_step``); ``fedspear.fl.privacy``
says why.

Client sampling is seeded per round over the nodes ordered by their partition id (learnt once through a query
message), so a resumed run samples the same clients as an uninterrupted one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from flwr.common.constant import ErrorCode
from flwr.server.strategy.aggregate import aggregate_median, aggregate_trimmed_avg

from fedspear.server.aggregation import fixed_denominator_mean, win_weighted_average
from fedspear.server.server_opt import ServerOptState, fedadam_step, fedyogi_step
from fedspear.server.validation import check_reply, update_norm
from .records import LAYOUT_KEY, decode_update, encoding_of, from_record, to_record

RULES = ("fedavg", "median", "trimmed_mean")

WEIGHT_KEY = "weight"
# Error replies raised by the client's own code, its mods' included (a DP clipping mod's failed precondition). Every
# other error code (node or message unavailable, the ClientApp process crashed, unknown) means the node dropped out:
# a deployment may tolerate that (``max_empty_rounds``).
CLIENT_ERRORS = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION, ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                 ErrorCode.MOD_FAILED_PRECONDITION)
log = logging.getLogger("fedspear")


def sum_metrics(records: list[RecordDict], weighting_metric_name: str) -> MetricRecord:
    """Sum each numeric metric over the replies (counters add up; per-client values are kept elsewhere)."""
    total: dict[str, float] = {}
    for record in records:
        for metrics in record.metric_records.values():
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    total[key] = total.get(key, 0) + value
    return MetricRecord(total)


class WinWeightedFedAvg(FedAvg):
    """FedAvg weighted by each client's win count, sampling ``clients_per_round`` nodes per round.

    Args:
        clients_per_round: K_t, nodes sampled each round.
        min_available_nodes: nodes that must be connected before sampling.
        seed: seeds the per-round node sample.
        wait_seconds: how long to wait for enough nodes before raising (never forever).
        max_update_norm: reject a reply whose ‖θ_k − θ^(t)‖₂ exceeds this (None: no bound).
        dp_denominator: under differential privacy, ``m`` of the fixed-denominator mean (``clients_per_round``);
            None: the win-weighted mean of the paper. See the module docstring and ``fedspear.fl.privacy``.
        dp_clip_norm: under differential privacy, C: the fixed-denominator mean holds every update to L2 norm ≤ C
            itself (``fixed_denominator_mean``'s ``clip_norm``), after Flower's clipping.
    """

    def __init__(self, clients_per_round: int, min_available_nodes: int, seed: int = 0, wait_seconds: float = 300,
                 max_update_norm: float | None = None, rule: str = "fedavg", trim_beta: float = 0.2,
                 server_opt: str | None = None, server_lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.99,
                 tau: float = 0.005, dp_denominator: int | None = None, dp_clip_norm: float | None = None):
        if rule not in RULES:
            raise ValueError(f"aggregation rule must be one of {', '.join(RULES)} (got {rule!r})")
        if dp_denominator is not None and rule != "fedavg":
            raise ValueError(f"differential privacy needs the fixed-denominator mean, not {rule!r}")
        super().__init__(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=clients_per_round,
            min_available_nodes=min_available_nodes,
            weighted_by_key=WEIGHT_KEY,
            train_metrics_aggr_fn=sum_metrics,
        )
        self.clients_per_round = clients_per_round
        self.seed = seed
        self.wait_seconds = wait_seconds
        self.max_update_norm = max_update_norm
        self.rule = rule
        self.trim_beta = trim_beta
        self.dp_denominator = dp_denominator
        self.dp_clip_norm = dp_clip_norm
        self.partition_of: dict[int, int] = {}  # node id → partition id (see ``discover_partitions``)
        self.current_arrays: ArrayRecord | None = None
        self.current_layout: str | None = None  # layout of ``current_arrays`` and of every reply (``layout_of``)
        # replies the caller vouches for, aggregated beside the ones passed to aggregate_train (DP, server side:
        # exact-zero updates, which Flower's clipping cannot take: it divides by their norm; fedspear.fl.privacy)
        self.extra_replies: list[Message] = []
        self.last_replies: list[Message] = []
        self.rejected: dict[int, str] = {}  # node id → reason, for the last round
        self.dropped: set[int] = set()  # nodes of ``rejected`` that dropped out rather than raised (``CLIENT_ERRORS``)
        # node id → ‖θ_k − θ^(t)‖₂ of each accepted reply of the last check, as aggregated (clipped under DP);
        # logged per client so that a DP clipping norm can be chosen from a run without DP
        self.update_norms: dict[int, float] = {}
        if server_opt not in (None, "fedadam", "fedyogi"):
            raise ValueError(f"server optimiser must be fedadam or fedyogi (got {server_opt!r})")
        self.server_opt = server_opt
        self.server_hyper = dict(eta=server_lr, beta1=beta1, beta2=beta2, tau=tau)
        self.opt_state = ServerOptState()  # FedAdam / FedYogi moments; checkpointed with each round's adapter
        self.last_aggregated = False

    def sample(self, grid: Grid, server_round: int) -> list[int]:
        """Seeded sample of ``clients_per_round`` node ids; waits at most ``wait_seconds`` for enough nodes.

        Raises:
            RuntimeError: fewer than ``min_available_nodes`` nodes connected after ``wait_seconds``.
        """
        deadline = time.monotonic() + self.wait_seconds
        while len(nodes := sorted(grid.get_node_ids())) < self.min_available_nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(nodes)} of the {self.min_available_nodes} required nodes connected after "
                    f"{self.wait_seconds:.0f} s"
                )
            log.info("waiting for nodes: %d connected, %d required", len(nodes), self.min_available_nodes)
            time.sleep(1)
        nodes.sort(key=lambda n: (self.partition_of.get(n, float("inf")), n))
        rng = random.Random(self.seed * 1_000_003 + server_round)
        return rng.sample(nodes, self.clients_per_round)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per sampled node carrying θ^(t) and the round's config (with θ^(t)'s layout under
        ``LAYOUT_KEY``); remembers θ^(t) and its layout to decode and check the replies."""
        self.current_arrays = arrays
        self.current_layout = str(config[LAYOUT_KEY]) if LAYOUT_KEY in config else None
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, self.sample(grid, server_round), MessageType.TRAIN)

    def reference(self) -> dict[str, np.ndarray] | None:
        """θ^(t) as sent by ``configure_train``, decoded (None before any round)."""
        return from_record(self.current_arrays, self.current_layout) if self.current_arrays is not None else None

    def _check_replies(self, replies: list[Message], reference: dict[str, np.ndarray] | None):
        """``(accepted, rejected, dropped)``: accepted = [(message, arrays, metrics)] that pass every check
        (``check_reply``) against ``reference`` = θ^(t), rejected = {node id: reason}, dropped = nodes whose error
        means they dropped out."""
        accepted, rejected, dropped = [], {}, set()
        self.update_norms = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                rejected[node] = f"client error: {msg.error.reason}"
                if msg.error.code not in CLIENT_ERRORS:
                    dropped.add(node)
            elif len(msg.content.array_records) != 1 or len(msg.content.metric_records) != 1:
                rejected[node] = "reply must hold exactly one ArrayRecord and one MetricRecord"
            else:
                try:
                    key, record = next(iter(msg.content.array_records.items()))
                    if encoding_of(record) != "fp32":  # an encoded update: θ^(t) + Δ̂, in place (records.py)
                        msg.content[key] = record = decode_update(self.current_arrays, record)
                    arrays = from_record(record, self.current_layout)
                except ValueError as err:
                    rejected[node] = str(err)
                    continue
                metrics = dict(next(iter(msg.content.metric_records.values())))
                reason = check_reply(reference if reference is not None else arrays, arrays, metrics,
                                     self.max_update_norm)
                if reason:
                    rejected[node] = reason
                else:
                    accepted.append((msg, arrays, metrics))
                    if reference is not None:
                        self.update_norms[node] = update_norm(reference, arrays)
        return accepted, rejected, dropped

    def screen(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies that pass every check, in order; the others are logged and kept in ``rejected`` / ``dropped``.

        Differential privacy calls this before Flower's wrapper, which must see error-free, well-formed replies
        only (``fedspear.fl.privacy``); ``aggregate_train`` runs the same checks itself.
        """
        accepted, self.rejected, self.dropped = self._check_replies(list(replies), self.reference())
        for node, reason in self.rejected.items():
            log.warning("round %d: reply of node %d excluded: %s", server_round, node, reason)
        return [msg for msg, _, _ in accepted]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check each reply, then aggregate the accepted ones (θ^(t) unchanged when none has a win).

        Error replies (the client raised or timed out) and rejected replies are excluded and logged; their node ids
        and reasons are in ``self.rejected``. Returns ``(None, None)`` when nothing is left to aggregate.
        """
        self.last_replies = list(replies) + self.extra_replies
        self.last_aggregated = False
        reference = self.reference()
        accepted, self.rejected, self.dropped = self._check_replies(self.last_replies, reference)
        for node, reason in self.rejected.items():
            log.warning("round %d: reply of node %d excluded: %s", server_round, node, reason)
        if not accepted:
            return None, None
        metrics = self.train_metrics_aggr_fn([msg.content for msg, _, _ in accepted], self.weighted_by_key)
        clients = [a for _, a, _ in accepted]
        wins = [int(m[WEIGHT_KEY]) for _, _, m in accepted]
        if reference is None:
            reference = clients[0]
        if self.dp_denominator is not None:  # DP: no zero-win guard, server optimiser after the noise (caller)
            self.last_aggregated = True
            return to_record(fixed_denominator_mean(reference, clients, wins, self.dp_denominator,
                                                                 self.dp_clip_norm)), metrics
        if sum(wins) == 0:
            log.warning("round %d: no accepted client has a win; global adapter kept unchanged", server_round)
            return to_record(reference), metrics
        self.last_aggregated = True
        if self.rule == "fedavg":
            averaged, _ = win_weighted_average(reference, clients, wins)
        else:
            names = list(reference)
            lists = [([a[n] for n in names], 1) for a in clients]
            robust = aggregate_median(lists) if self.rule == "median" else aggregate_trimmed_avg(lists, self.trim_beta)
            averaged = {n: np.asarray(v, dtype=reference[n].dtype) for n, v in zip(names, robust)}
        return to_record(self.server_step(reference, averaged)), metrics

    def server_step(self, reference: dict[str, np.ndarray], averaged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """FedAdam / FedYogi (Reddi et al. 2021): the average is a pseudo-gradient step from ``reference`` = θ^(t);
        updates ``opt_state``. Without a server optimiser, ``averaged`` unchanged."""
        if not self.server_opt:
            return averaged
        step = fedadam_step if self.server_opt == "fedadam" else fedyogi_step
        out, self.opt_state = step(reference, averaged, self.opt_state, **self.server_hyper)
        return out
