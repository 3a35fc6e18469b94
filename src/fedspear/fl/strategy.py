"""Win-weighted FedAvg on Flower's message API, with the zero-win guard (paper Alg. 2; SPEC §4).

θ^(t+1) = Σ_k |W_k| θ_k / Σ_k |W_k| with the reply metric ``num-wins`` as the weight. The strategy is Flower's
``FedAvg`` (sampling, message construction, reply checks); the averaging itself is ``fedspear.aggregation.
win_weighted_average`` (float64 accumulation, fresh arrays). **Decision (SPEC §4):** when every sampled client has
zero wins, Flower's FedAvg would divide by zero; we keep the global adapter unchanged instead.

Client sampling is seeded per round over the *sorted* node ids so a run is reproducible.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedspear.aggregation import win_weighted_average

WEIGHT_KEY = "num-wins"
log = logging.getLogger("fedspear")


def to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord holding *copies* of ``arrays`` (name → ndarray), in order."""
    return ArrayRecord({k: Array(np.array(v, copy=True)) for k, v in arrays.items()})


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """name → ndarray copies of an ArrayRecord."""
    return {k: np.array(v.numpy(), copy=True) for k, v in record.items()}


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
    """

    def __init__(self, clients_per_round: int, min_available_nodes: int, seed: int = 0, wait_seconds: float = 300):
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
        self.current_arrays: ArrayRecord | None = None
        self.last_replies: list[Message] = []

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
        rng = random.Random(self.seed * 1_000_003 + server_round)
        return rng.sample(nodes, self.clients_per_round)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per sampled node carrying θ^(t) and the round's config; remembers θ^(t)."""
        self.current_arrays = arrays
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, self.sample(grid, server_round), MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Win-weighted average of the replies' adapters; θ^(t) unchanged when no sampled client won anything."""
        self.last_replies = list(replies)
        valid, _ = self._check_and_log_replies(self.last_replies, is_train=True)
        if not valid:
            return None, None
        contents = [msg.content for msg in valid]
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        wins = [int(next(iter(c.metric_records.values()))[WEIGHT_KEY]) for c in contents]
        clients = [from_record(next(iter(c.array_records.values()))) for c in contents]
        reference = from_record(self.current_arrays) if self.current_arrays is not None else clients[0]
        averaged, aggregated = win_weighted_average(reference, clients, wins)
        if not aggregated:
            log.warning("round %d: no sampled client has a win; global adapter kept unchanged", server_round)
        return to_record(averaged), metrics
