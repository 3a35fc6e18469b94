"""Secure aggregation for fedspear rounds: Flower's SecAgg+ (``secure_aggregation = "secaggplus"``), so that the
server only ever learns the win-weighted mean of the sampled clients' updates, not one client's adapter. One
exception: when a single client of the round has wins (a nonzero weight), the win-weighted mean *is* its update, and
the weights travel in the clear (below), so the server knows whose it is.

Flower 1.41 and 1.42 have secure aggregation on their *legacy* strategy API only (no Message-API workflow;
flwrlabs/flower#4615 is open), so this module runs fedspear's rounds through Flower's own legacy pieces, and no
cryptography of its own:

- server: ``SecAggPlusWorkflow`` (``flwr/server/workflow/secure_aggregation/secaggplus_workflow.py``) with a
  ``LegacyContext`` holding ``SecAggStrategy``, a legacy ``Strategy`` for fedspear's sampling and aggregation, and a
  ``ClientManager`` kept up to date by Flower's ``start_update_client_manager_thread``;
- client: a legacy ``ClientApp(client_fn=..., mods=[secaggplus_mod])`` (``client_app``) whose ``NumPyClient.fit``
  runs ``Worker.round`` exactly as the Message-API ClientApp does (``fedspear.fl.client_app``).

A round has Flower's four stages (setup → share keys → collect masked vectors → unmask). Each sampled client trains in
the third and uploads ``[q_k, q_k/Q · Δ_k]`` quantised and masked (``secaggplus_mod``), q_k = round(w_k/max_weight·Q);
the server sums the masked vectors, removes the masks from the shares it collects in the fourth stage, and divides:
``Σ_k q_k Δ_k / Σ_k q_k``. With w_k = the reply's ``weight`` (|W_k| for SPEAR, SPEC §4) that is the win-weighted
FedAvg of ``fedspear.server.aggregation.win_weighted_average`` up to the quantisation error below.

**Why not ``DefaultWorkflow``'s loop.** ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` numbers rounds from
1 and re-initialises the parameters each time it is called, so it cannot resume after round t, and it evaluates
and records through the legacy ``History``. fedspear's ServerApp keeps its own round loop (resume, central evaluation,
checkpoints, one metrics line per round) and calls the fit workflow once per round exactly as
``DefaultWorkflow.__call__`` does: it sets ``CURRENT_ROUND`` and the parameters in the LegacyContext's state, starts
Flower's client-manager thread, and calls ``SecAggPlusWorkflow(grid, context)`` (``SecureRounds.round``).

**Decision (what travels: the update).** A client uploads Δ_k = θ_k − θ^(t) (float64), not θ_k; the server adds
θ^(t) back. Updates are orders of magnitude smaller than LoRA values, so a small ``secagg_clipping_range`` c fits
them and the quantisation step 2c/Q is small too (docs/results/secagg). Σ_k q_k θ^(t) / Σ_k q_k = θ^(t) exactly, so
the result is the same weighted mean of the θ_k.

**Decision (quantisation error and the range check).** Flower's client clips every value of (q_k/Q)·Δ_k to [−c, c]
*silently* before quantising; a clipped value would bias the mean without a trace. So the client checks first and
refuses the round (an error reply naming the value and ``secagg_clipping_range``) when any value is outside the
range; such a client counts as dropped for the protocol. Within the range, Flower's stochastic rounding is unbiased
and each client adds an error below one step 2c/Q per value; the server scales the sum by Q/Σ_k q_k, so the mean's
error per value is below ``n · 2c/Q · max_weight / Σ_k w_k`` (n clients that uploaded), and about √n times less
typically. ``max_weight`` (default ``rollouts_per_round``, the largest weight any client-round can have: one win per
prompt) must hold every weight: a client whose weight exceeds it refuses the round too (Flower only warns, and the
masked sum may overflow). Measured on real SmolLM2-135M updates (docs/results/secagg/README.md: 4 clients,
updates up to 4e-4 per value): at the defaults c = 0.01, Q = 2^22, max_weight = 16 the error is at most 5.7e-9 per
value, 6e-6 of the mean update's norm, about the float32 rounding of the adapter itself; Flower's example defaults
on full parameters (c = 8, max_weight = 1000) would give 29%. c = 0.01 leaves 33× headroom over those updates; it
must grow with lr × local steps (Adam moves a value by about lr per step).

**Decision (clients with no win, w = 0).** A client with no win still takes part in every stage (leaving early would
look like a drop and cost the threshold): q_k = 0, so its masked vector adds exactly 0 to both sums. When every
uploaded weight is 0 the unmasked ratio is 0/0 (Flower divides by Σ q_k = 0 and gets NaN); ``SecAggStrategy`` then
keeps θ^(t), the zero-win guard of SPEC §4, decided from the weights, which travel in the clear (below).

**Decision (dropped clients).** SecAgg+ tolerates clients that leave after sharing their keys: the server rebuilds
their pairwise masks from the shares of the others. A round needs t = max(2, round(``secagg_threshold``·m)) of the m
sampled clients (every client is every other's neighbour: ``num_shares`` = all sampled clients) to the end. Each
client's two secrets (its mask seed and its key) are shared t-of-m and the server asks for one or the other,
never both, per client; ``config.py`` requires t > m/2 (t itself, after Flower's rounding, for m =
``clients_per_round``) so that a server that follows the protocol cannot collect t shares of both; against a server
that lies about who dropped, Bonawitz et al. (2017, "Practical secure aggregation", CCS) need t > 2m/3, so raise
``secagg_threshold`` until t exceeds 2m/3 when that is the threat (the default 0.67 gives t = 2 for m = 3, not above
2m/3: 1.0 does). A client that raises (its own checks
included) or does not answer within ``round_timeout`` at any stage is dropped from that stage on and recorded with
the stage; if fewer than t remain, Flower halts the round, no aggregate exists, and the round is an empty round
with every client's reason naming the stage, the survivors and t (``fedspear.fl.server_app.empty_round_error``:
the run stops unless ``max_empty_rounds`` tolerates rounds with drop-outs). SecAgg+ needs m ≥ 3 (``config.py``):
with m = 2 the server and either client learn the other's update from the sum, and t = 2 allows no drop-out.

**Decision (what the server still sees).** The weight w_k and the round's counters (wins, losses, prompts, tokens,
loss values, ``partition-id``) travel in the clear beside the masked vector, as they do without SecAgg+ (Flower's
``FitRes.num_examples`` and ``metrics``); they are logged in ``metrics.jsonl``. The adapter values and the update
norm do not: ``update_norm`` is absent from SecAgg+ records.

**Decision (validation: what is lost and what replaces it).** The server cannot run ``check_reply`` on one update
(names, shapes, dtypes, finite values, ``max_update_norm``), nor exclude one client from the mean. Instead:
(1) each client runs the same ``check_reply`` on its own update against θ^(t) *before masking*, plus the range and
weight checks above, and refuses the round when one fails; the layout is fixed by the server's own θ^(t), and the
values are integers mod 2^32 after quantisation, so a buggy client cannot send NaN or a wrong shape; (2) the server
checks the unmasked mean: finite, and ‖mean Δ‖₂ ≤ ``max_update_norm`` plus the quantisation bound (a convex
combination of updates within the bound is within it); a failed aggregate check rejects the whole round (every
client, since the server cannot tell which one) and the run stops as after any empty round. This guards against
faulty clients, not hostile ones: a client that skips its checks can still move each value of the mean by up to
c·w_k/Σ w (its clipped range) and lie about w_k within ``max_weight``; SecAgg+ has no proof that inputs are in range.
Robust rules (median, trimmed mean) need every update and are refused (``config.py``).

**Decision (server optimisers).** FedAdam / FedYogi step on the unmasked mean exactly as without SecAgg+
(``WinWeightedFedAvg.server_step``): they only ever needed the average.

**Refused (with differential privacy).** ``dp = "server"`` clips each update on the server, which never sees one.
``dp = "client"`` would need, with Flower's pieces, the legacy ``DifferentialPrivacyClientSideFixedClipping`` around
``SecAggStrategy`` and the legacy ``fixedclipping_mod`` inside ``secaggplus_mod``; that wrapper (1) noises whatever
the inner strategy returns with σ = z·C/m, calibrated for the equal-weight mean of updates clipped to C, but the
SecAgg+ mean is win-weighted (one client holding most wins moves it by up to ~2C, ``fedspear.fl.privacy``), and
(2) releases nothing in any round with a failure (``if failures: return None, {}``), so every drop-out would void
a round. fedspear's fixed-denominator DP mean could be had from SecAgg+ (weights in {0, 1}, ``max_weight`` = 1, then
the server rescales the mean by n₊/m with n₊ the clients with a win), but that is fedspear's own estimator and
accounting, not Flower's wrapper, and is not built; ``config.py`` refuses the combination with this reason.

**Decision (one ClientApp).** ``flwr run`` starts the one ClientApp pyproject.toml names, and a Flower ClientApp
cannot have both a ``client_fn`` and ``@app.train``. So the Message-API ClientApp (``fedspear.fl.client_app``) stays
the app: its train handler hands every message that carries Flower's ``secaggplus_configs`` record (each of the four
stages does) to ``client_app`` below, with the node's Context, whose state keeps ``secaggplus_mod``'s keys and
shares between stages (a SuperNode keeps a run's Context across its ClientApp processes). Partition ids come from
the Message-API ``query`` handler (``fedspear.fl.server_app.discover_partitions``), as without SecAgg+. The same
app runs in the simulation and in ``examples/deploy-local --secure-aggregation`` (three SuperNodes over TLS).
"""

from __future__ import annotations

import json
import logging
import math
import timeit
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import (
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server import ServerConfig
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.app_utils import start_update_client_manager_thread
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from fedspear.config import RunConfig, secagg_threshold_count
from fedspear.fl.records import LAYOUT_KEY, PACKED_KEY, from_record
from fedspear.fl.strategy import CLIENT_ERRORS, WEIGHT_KEY, WinWeightedFedAvg
from fedspear.server.validation import check_reply

log = logging.getLogger("fedspear")

STAGES = ("setup", "share keys", "collect masked vectors", "unmask")  # SecAggPlusWorkflow's order
MODULUS = 2**32  # Flower's default modulus_range, kept


# ---- settings ------------------------------------------------------------------------------------------------------
def max_weight(cfg: RunConfig) -> float:
    """``secagg_max_weight``, or ``rollouts_per_round`` when it is 0 (the largest weight a client-round can have)."""
    return float(cfg.secagg_max_weight or cfg.rollouts_per_round)


def threshold(cfg: RunConfig, sampled: int) -> int:
    """The reconstruction threshold t for ``sampled`` clients (``fedspear.config.secagg_threshold_count``)."""
    return secagg_threshold_count(cfg.secagg_threshold, sampled)


def error_bound(cfg: RunConfig, uploaded: int, total_weight: float) -> float:
    """Worst-case error per value of the unmasked mean update: ``uploaded · 2c/Q · max_weight / total_weight``.

    Each client's stochastic rounding errs by less than one step 2c/Q on (q_k/Q)·Δ_k; the server scales the sum of
    ``uploaded`` such values by Q/Σ q_k ≈ max_weight/Σ w_k (module docstring). Infinite when ``total_weight`` is 0.
    """
    if total_weight <= 0:
        return math.inf
    step = 2 * cfg.secagg_clipping_range / cfg.secagg_quantization_range
    return uploaded * step * max_weight(cfg) / total_weight


def make_workflow(cfg: RunConfig) -> SecAggPlusWorkflow:
    """Flower's SecAgg+ fit workflow with fedspear's settings (every sampled client holds a share of every other's
    secrets: ``num_shares`` = 1.0; replies awaited at most ``round_timeout`` seconds per stage)."""
    return SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=float(cfg.secagg_threshold),
                              max_weight=max_weight(cfg), clipping_range=float(cfg.secagg_clipping_range),
                              quantization_range=int(cfg.secagg_quantization_range), modulus_range=MODULUS,
                              timeout=cfg.round_timeout)


# ---- the update a client masks -------------------------------------------------------------------------------------
def flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The adapter as one flat float64 vector, in ``arrays``' order (the layout's order)."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in arrays.values()])


def masked_input(cfg: RunConfig, global_arrays: dict[str, np.ndarray], arrays: dict[str, np.ndarray],
                 metrics: dict) -> tuple[np.ndarray, int]:
    """``(Δ_k, w_k)`` to hand to ``secaggplus_mod`` after the client-side checks that replace the server's
    (module docstring, **validation**): ``check_reply`` against θ^(t) with ``max_update_norm``, the weight within
    ``max_weight``, and every value of (q_k/Q)·Δ_k within ``secagg_clipping_range`` (Flower would clip it silently).

    Returns:
        Δ_k = θ_k − θ^(t) as one flat float64 vector [P] and the integer weight w_k.

    Raises:
        ValueError: a check failed (the message names it and the key to change); the client then drops out of
            this round's secure aggregation.
    """
    reason = check_reply(global_arrays, arrays, metrics, cfg.max_update_norm)
    if reason:
        raise ValueError(f"SecAgg+: update refused before masking: {reason}")
    weight = metrics.get(WEIGHT_KEY)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0 or weight != int(weight):
        raise ValueError(f"SecAgg+: the weight {weight!r} is not a non-negative integer")
    weight, cap = int(weight), max_weight(cfg)
    if weight > cap:
        raise ValueError(f"SecAgg+: weight {weight} exceeds secagg_max_weight = {cap:g}; raise secagg_max_weight")
    delta = flat({name: arrays[name] for name in global_arrays}) - flat(global_arrays)  # [P], by name
    q = cfg.secagg_quantization_range
    scaled = np.abs(delta).max(initial=0.0) * round(weight / cap * q) / q  # the largest |(q_k/Q)·Δ_k|, as Flower scales
    if scaled > cfg.secagg_clipping_range:
        raise ValueError(f"SecAgg+: an update value of {scaled:.4g} (after the weight factor) exceeds "
                         f"secagg_clipping_range = {cfg.secagg_clipping_range:g}; raise secagg_clipping_range")
    return delta, weight


# ---- client ----------------------------------------------------------------------------------------------------------
TrainFn = Callable[[RunConfig, Context, dict[str, np.ndarray], int, float], tuple[dict, dict]]


def _worker_round(cfg: RunConfig, context: Context, global_arrays: dict[str, np.ndarray], server_round: int,
                  lr: float) -> tuple[dict, dict]:
    """One client round as the Message-API ClientApp runs it (its process-wide worker, or the node worker), with
    its fault injection (``FEDSPEAR_INJECT_FAULTS``) for the resilience tests."""
    from fedspear.fl.client_app import _RUNNER, _inject_fault
    from fedspear.fl.node_worker import NodeSettings, remote_round

    node = NodeSettings.from_node_config(context.node_config, cfg.num_clients)
    if node.worker_address:
        arrays, metrics = remote_round(node, cfg, global_arrays, server_round, lr)
    else:
        arrays, metrics = _RUNNER.round(cfg, node, global_arrays, server_round, lr)
    metrics["partition-id"] = node.partition_id
    return _inject_fault(node.partition_id, arrays, metrics)


class SpearClient(NumPyClient):
    """The legacy client: ``fit`` runs one client round and returns Δ_k with its weight for ``secaggplus_mod`` to
    mask (the server learns each node's partition id from the Message-API ``query`` handler, as without SecAgg+)."""

    def __init__(self, context: Context, train: TrainFn):
        self.context, self.train = context, train

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar]) -> tuple[list[np.ndarray], int, dict]:
        """θ^(t) (one flat Array, decoded with the config's layout) → train → ``([Δ_k], w_k, metrics)``.

        Raises:
            ValueError: a client-side check failed (``masked_input``).
        """
        cfg = RunConfig(**json.loads(str(config["fedspear-config"])))
        global_arrays = from_record(ArrayRecord({PACKED_KEY: Array(parameters[0])}), str(config[LAYOUT_KEY]))
        arrays, metrics = self.train(cfg, self.context, global_arrays, int(config["server-round"]),
                                     float(config["lr"]))
        delta, weight = masked_input(cfg, global_arrays, arrays, metrics)
        return [delta], weight, {k: _scalar(v) for k, v in metrics.items()}


def _scalar(value) -> int | float:
    """A metric as Flower's legacy Scalar (bools as ints; NaN stays a float)."""
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, int) else float(value)


def make_client_app(train: TrainFn = _worker_round) -> ClientApp:
    """Flower's legacy ``ClientApp(client_fn=..., mods=[secaggplus_mod])`` around ``SpearClient`` (``train``: the
    round to run; tests pass a stand-in)."""

    def client_fn(context: Context):
        return SpearClient(context, train).to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


client_app = make_client_app()


# ---- server ----------------------------------------------------------------------------------------------------------
class SecAggStrategy(Strategy):
    """fedspear's sampling and aggregation as a legacy Strategy for ``SecAggPlusWorkflow``.

    ``configure_fit`` samples like ``WinWeightedFedAvg.sample`` (seeded, over nodes in partition order) and sends
    θ^(t) with the round's config. ``aggregate_fit`` receives, for every client that uploaded, a FitRes whose
    parameters Flower has replaced by the unmasked mean update Σ q_k Δ_k / Σ q_k, and whose ``num_examples`` is that
    client's weight; it applies the zero-win guard, the aggregate check and the server optimiser, and keeps the new
    adapter in ``result``.
    """

    def __init__(self, core: WinWeightedFedAvg, cfg: RunConfig):
        self.core, self.cfg = core, cfg
        self.grid: Any = None
        self.reference: dict[str, np.ndarray] = {}
        self.fit_config: dict[str, Scalar] = {}
        self.result: dict[str, np.ndarray] | None = None
        self.uploaded: list[tuple[int, int]] = []  # (node id, weight) of the clients in the mean
        self.aggregate_error: str | None = None
        self.called = False

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None  # fedspear's ServerApp holds θ^(t) itself

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        proxies = {proxy.node_id: proxy for proxy in client_manager.all().values()}
        nodes = self.core.sample(self.grid, server_round)
        return [(proxies[node], FitIns(parameters, dict(self.fit_config))) for node in nodes if node in proxies]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """θ^(t) + the unmasked mean update (θ^(t) when every weight is 0), after the aggregate check."""
        self.called = True
        self.uploaded = [(proxy.node_id, int(res.num_examples)) for proxy, res in results]
        self.core.last_aggregated = False
        total = sum(w for _, w in self.uploaded)
        if not results or total == 0:
            log.warning("round %d: no client that uploaded has a win; global adapter kept unchanged", server_round)
            self.result = {k: v.copy() for k, v in self.reference.items()}
            return None, {}
        mean = parameters_to_ndarrays(results[0][1].parameters)[0].astype(np.float64)  # [P], the same in every FitRes
        self.aggregate_error = self._check(mean, len(results), total)
        if self.aggregate_error:
            log.error("round %d: the secure aggregate was rejected: %s", server_round, self.aggregate_error)
            return None, {}
        averaged, start = {}, 0
        for name, ref in self.reference.items():
            size = int(np.prod(np.shape(ref)))
            averaged[name] = (np.asarray(ref, np.float64) + mean[start:start + size].reshape(np.shape(ref))
                              ).astype(np.asarray(ref).dtype)
            start += size
        self.core.last_aggregated = True
        self.result = self.core.server_step(self.reference, averaged)
        return ndarrays_to_parameters([flat(self.result)]), {}

    def _check(self, mean: np.ndarray, uploaded: int, total: int) -> str | None:
        """Why the unmasked mean update is unacceptable, or None (module docstring, **validation**)."""
        size = sum(int(np.prod(np.shape(v))) for v in self.reference.values())
        if mean.shape != (size,):
            return f"the aggregate holds {mean.size} values, the adapter {size}"
        if not np.all(np.isfinite(mean)):
            return f"{int(mean.size - np.isfinite(mean).sum())} non-finite values in the aggregate"
        if self.cfg.max_update_norm is not None:
            slack = error_bound(self.cfg, uploaded, total) * math.sqrt(size)
            norm = float(np.linalg.norm(mean))
            if norm > self.cfg.max_update_norm + slack:
                return (f"‖mean update‖₂ = {norm:.4g} exceeds max_update_norm = {self.cfg.max_update_norm:g} "
                        f"(+ {slack:.2g} quantisation slack): some client sent an update above the bound")
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []  # central evaluation only (fedspear.evaluation)

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class RecordingGrid:
    """A Grid that forwards every call to ``grid`` and keeps each ``send_and_receive``'s messages and replies
    (one entry per SecAgg+ stage): what the server received, for the round record and for inspection."""

    def __init__(self, grid):
        self._grid = grid
        self.exchanges: list[tuple[list[Message], list[Message]]] = []

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.exchanges.append((messages, replies))
        return replies

    def __getattr__(self, name):
        return getattr(self._grid, name)


@dataclass
class _Content:
    metric_records: dict


@dataclass
class _Error:
    code: int
    reason: str


@dataclass
class ClientReply:
    """One sampled client's outcome in the shape ``fedspear.fl.server_app._round_record`` reads from a Message:
    ``metadata.src_node_id``, ``has_error()``, ``error.reason`` and ``content.metric_records`` (its counters)."""

    node_id: int
    metrics: dict = field(default_factory=dict)
    error: _Error | None = None

    @property
    def metadata(self):
        return _Metadata(self.node_id)

    @property
    def content(self) -> _Content:
        return _Content({"metrics": self.metrics} if self.metrics else {})

    def has_error(self) -> bool:
        return self.error is not None


@dataclass
class _Metadata:
    src_node_id: int


class SecureRounds:
    """Runs one fedspear round through ``SecAggPlusWorkflow`` (see the module docstring) and reports it in the
    terms of ``run_server``'s round record.

    Args:
        core: the ServerApp's ``WinWeightedFedAvg`` (sampling, partition order, server optimiser and its state).
        cfg: the run's settings (``secure_aggregation = "secaggplus"``).
        grid: the ServerApp's Grid.
    """

    def __init__(self, core: WinWeightedFedAvg, cfg: RunConfig, grid):
        self.cfg, self.core = cfg, core
        self.grid = RecordingGrid(grid)
        self.strategy = SecAggStrategy(core, cfg)
        self.strategy.grid = self.grid
        self.workflow = make_workflow(cfg)
        base = Context(run_id=self.grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
        self.context = LegacyContext(base, config=ServerConfig(num_rounds=cfg.rounds), strategy=self.strategy)
        self.last: dict = {}

    def record(self) -> dict:
        """The ``secagg`` entry of the last round's record: clients sampled, threshold t, clients in the mean, their
        total weight, the worst-case quantisation error per value of the mean update (``error_bound``), and
        ``array_values_received``: how many values the clients' replies carried in ArrayRecords over the four stages
        — 0, since the masked vectors travel as ``secaggplus_mod``'s bytes and the stage-3 FitRes holds no
        parameters; a plain adapter arriving as Arrays would show here."""
        return {"secagg": dict(self.last)}

    def round(self, server_round: int, arrays: dict[str, np.ndarray], config: ConfigRecord
              ) -> tuple[list, dict[str, np.ndarray] | None, dict[int, str], set[int]]:
        """One round: Flower's four SecAgg+ stages with every sampled client, then fedspear's aggregation.

        Returns:
            ``(replies, new_arrays, rejected, dropped)``: one ``ClientReply`` per sampled client that answered at
            least once (counters for those in the mean, the reason otherwise), the new adapter (None when the round
            produced none), {node id: reason} for the clients not in the mean, and the nodes among them that
            dropped out rather than raised.
        """
        strategy = self.strategy
        strategy.reference = {k: np.array(v, copy=True) for k, v in arrays.items()}
        strategy.fit_config = {**{k: v for k, v in config.items()}, "server-round": server_round}
        strategy.result, strategy.called, strategy.aggregate_error, strategy.uploaded = None, False, None, []
        self.core.last_aggregated = False
        self.core.update_norms = {}  # the server cannot measure one client's update
        self.context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: server_round, WorkflowKey.START_TIME: timeit.default_timer()})
        self.context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            ndarrays_to_parameters([flat(arrays).astype(next(iter(arrays.values())).dtype)]), keep_input=True)
        self.grid.exchanges.clear()
        # a fresh manager each round: Flower's thread registers every node it has not registered itself, and wraps
        # the manager's methods; DefaultWorkflow starts it once per call, as this does once per round
        self.context.client_manager = SimpleClientManager()
        thread, stop, ready = start_update_client_manager_thread(self.grid, self.context.client_manager)
        ready.wait()
        try:
            self.workflow(self.grid, self.context)
        finally:
            stop.set()
            thread.join()
        return self._outcome(server_round)

    def _outcome(self, server_round: int):
        """Sort the sampled clients by what they reached (see ``round``): in the mean (uploaded in stage 3 of 4;
        a later drop does not take them out: the others' shares unmask them), or left at a stage with its reason."""
        exchanges = self.grid.exchanges
        sampled = [m.metadata.dst_node_id for m in exchanges[0][0]] if exchanges else []
        counters: dict[int, dict] = {}
        left: dict[int, tuple[str, int]] = {}  # node → (reason, error code; 0 = no reply), first stage it failed
        for stage, (sent, got) in enumerate(exchanges):
            answered = {m.metadata.src_node_id for m in got}
            for msg in got:
                node = msg.metadata.src_node_id
                if msg.has_error():
                    left.setdefault(node, (f"left SecAgg+ at stage '{STAGES[stage]}': {msg.error.reason}",
                                           msg.error.code))
                elif stage == 2:
                    counters[node] = dict(msg.content.config_records["fitres.metrics"])
            for m in sent:
                if m.metadata.dst_node_id not in answered:
                    left.setdefault(m.metadata.dst_node_id, (f"left SecAgg+ at stage '{STAGES[stage]}': no reply "
                                                             f"within {self.cfg.round_timeout:g} s", 0))
        strategy = self.strategy
        in_mean = {node for node, _ in strategy.uploaded}
        rejected = {n: why for n, (why, _) in left.items() if n not in in_mean}
        dropped = {n for n, (_, code) in left.items() if n not in in_mean and code not in CLIENT_ERRORS}
        for node, (why, _) in sorted(left.items()):
            log.warning("round %d: node %d %s%s", server_round, node, why,
                        " (its upload is in the mean)" if node in in_mean else "")
        if not strategy.called:  # Flower halted the round: too few clients left to unmask
            t = threshold(self.cfg, len(sampled))
            stage = STAGES[len(exchanges) - 1] if exchanges else STAGES[0]
            why = (f"SecAgg+ halted at stage '{stage}': {len(sampled) - len(left)} of the {len(sampled)} sampled "
                   f"clients left, fewer than the reconstruction threshold t = {t} (secagg_threshold = "
                   f"{self.cfg.secagg_threshold:g}), so no aggregate can be unmasked")
            log.error("round %d: %s", server_round, why)
            rejected = {n: f"{rejected[n]}; {why}" if n in rejected else why for n in sampled}
        elif strategy.aggregate_error:
            why = f"the secure aggregate was rejected ({strategy.aggregate_error}); the server cannot tell whose update"
            rejected.update({node: why for node in in_mean})
        replies = [ClientReply(n, metrics=counters.get(n, {}),
                               error=_Error(left.get(n, ("", 0))[1], rejected[n]) if n in rejected else None)
                   for n in sampled]
        result = strategy.result if strategy.called and not strategy.aggregate_error else None
        total = sum(w for _, w in strategy.uploaded)
        bound = error_bound(self.cfg, len(strategy.uploaded), total)
        arrays = [array for _, got in exchanges for msg in got if not msg.has_error()
                  for record in msg.content.array_records.values() for array in record.values()]
        self.last = {"sampled": len(sampled), "threshold": threshold(self.cfg, len(sampled)),
                     "uploaded": len(strategy.uploaded), "weight_total": total,
                     "error_bound": bound if math.isfinite(bound) else None,
                     "array_values_received": sum(int(np.prod(array.shape)) for array in arrays)}
        return replies, result, rejected, dropped


class LoopbackGrid:
    """A Grid in one process, for tests and ``docs/results/secagg/measure.py``: each message is handed, as a deep
    copy (nothing shared with the server, as on the wire), to ``app`` (``fedspear.fl.client_app.app`` in the tests,
    whose train handler passes SecAgg+'s stages to ``client_app``) with the destination node's own Context
    (``partition-id`` = its index in ``nodes``; the Context's state persists, as on a SuperNode), and the replies
    come back. A client that raises gets the error reply Flower's ClientApp runner would send. ``silent`` =
    {node: call index} makes a node send no reply from that ``send_and_receive`` call on (a node that disconnected;
    calls count from 0). Every reply is kept in ``received``.
    """

    def __init__(self, app: ClientApp, nodes: list[int], silent: dict[int, int] | None = None):
        from types import SimpleNamespace

        self.app, self.nodes, self.silent = app, list(nodes), silent or {}
        self.run = SimpleNamespace(run_id=1)
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i}, state=RecordDict(),
                                    run_config={}) for i, n in enumerate(nodes)}
        self.calls = 0
        self.received: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        import copy

        from flwr.app import Error
        from flwr.common.constant import ErrorCode

        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.silent and self.calls >= self.silent[node]:
                continue
            sent = Message(content=copy.deepcopy(msg.content), dst_node_id=node,
                           message_type=msg.metadata.message_type, group_id=msg.metadata.group_id)
            try:
                reply = self.app(sent, self.contexts[node])
            except Exception as err:  # noqa: BLE001 - what Flower's ClientApp runner turns into an error reply
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                      reason=f"{type(err).__name__}: {err}"), reply_to=sent)
            replies.append(copy.deepcopy(reply))
        self.calls += 1
        self.received += replies
        return replies
