"""Flower ClientApp: unpack the message, run one SPEAR client-round, pack a reply with a *copy* of the adapter.

The base model is loaded once per process (module-level ``_RUNNER``): in the simulation engine that is one Ray
actor holding one base model for every simulated client it plays; rounds never reload weights. A SuperNode starts
a fresh ClientApp process per message, so there the node config names a long-lived node worker
(``worker-address``, ``worker-key``) and the round runs in it (``fedspear.fl.node_worker``, which also lists every
node-config key read here). Every reply's metrics carry ``model_loads`` and ``worker_pid``.
The reply carries only LoRA tensors and counters (``weight`` is the aggregation weight) — never prompts,
answers or feedback text. The adapter arrives as one flat Array whose layout is in the train config
(``fedspear.fl.records.LAYOUT_KEY``); the reply packs the trained adapter in that same layout, so it holds the
same single Array. Under ``dp = "client"`` Flower's ``fixedclipping_mod`` clips the reply's update before it leaves
(``fedspear.fl.privacy.dp_clipping_mod``, on the train handler only); after it, ``encode_update_mod`` sends the update
in the encoding the server asked for (``update_encoding``, ``fedspear.fl.records``).

Under ``secure_aggregation = "secaggplus"`` the server's rounds are the four stages of Flower's SecAgg+ workflow, sent
as train messages that carry Flower's ``secaggplus_configs`` record; the train handler hands those to SecAgg+'s legacy
ClientApp (``fedspear.fl.secagg.client_app``, with ``secaggplus_mod``), which runs the same client round. One
ClientApp thus serves both, in the simulation and in a deployment (`flwr run` starts the ClientApp pyproject.toml
names; a Flower app names one).

A node started with ``--node-config "partition-id=K trace-db=/path/traces.db"`` is a *human* node: instead of the
dataset oracle it trains on the conversations people had in ``fedspear chat`` (``fedspear.human.replay``), which stay in
that SQLite file on the node.

Fault injection (resilience tests only): ``FEDSPEAR_INJECT_FAULTS="P:KIND,..."`` makes the client with partition id P
misbehave in every round — KIND is ``raise`` (crash mid-round), ``nan`` (non-finite adapter), ``shape`` (a tensor of
the wrong shape), ``norm`` (a huge update) or ``negative`` (a negative aggregation weight). Unset in normal use.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import numpy as np

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS as SECAGG_RECORD

from fedspear.config import RunConfig
from fedspear.fl.node_worker import NodeRunner, NodeSettings, partition_indices, remote_round
from fedspear.fl.privacy import dp_clipping_mod
from fedspear.fl.records import LAYOUT_KEY, encode_update_mod, from_record, to_record

if TYPE_CHECKING:  # torch and the model code load with the first round run here (not in a SecAgg+ stage or a
    from fedspear.worker import Worker  # round forwarded to the node worker)

app = ClientApp()

_RUNNER = NodeRunner()


def get_worker(cfg: RunConfig) -> Worker:
    """The process's worker, (re)loaded only when the model, data or LoRA shape changes."""
    return _RUNNER.worker_for(cfg)[0]


def partition_of(context: Context, cfg: RunConfig, worker: Worker) -> tuple[int, list[int]]:
    """This node's partition id and train indices (``partition-id`` and optional ``data-dir`` from the node config).

    Raises:
        ValueError: the node config lacks ``partition-id`` or it is outside 0..num_clients-1.
    """
    node = NodeSettings.from_node_config(context.node_config, cfg.num_clients)
    return node.partition_id, partition_indices(worker.examples, cfg, node.partition_id, bool(node.data_dir))


@app.train(mods=[encode_update_mod, dp_clipping_mod])  # the first listed sees the reply last: clip, then encode
def train(msg: Message, context: Context) -> Message:
    """Set adapter → interaction → local training → reply with the adapter copy, ``weight`` and counters.

    Raises:
        ValueError: bad node config (see ``NodeSettings``); the trained adapter's tensors differ from the broadcast
            ones.
        ConnectionError / RuntimeError: the node worker is not running or failed (the server drops this client).
    """
    if SECAGG_RECORD in msg.content.config_records:  # a SecAgg+ stage (module docstring); no "config" record, so
        from fedspear.fl import secagg  # the mods above pass it through untouched

        return secagg.client_app(msg, context)
    config = msg.content["config"]
    cfg = RunConfig(**json.loads(str(config["fedspear-config"])))
    node = NodeSettings.from_node_config(context.node_config, cfg.num_clients)
    layout = str(config[LAYOUT_KEY]) if LAYOUT_KEY in config else None
    global_arrays = from_record(msg.content["arrays"], layout)
    server_round, lr = int(config["server-round"]), float(config["lr"])
    if node.worker_address:
        arrays, metrics = remote_round(node, cfg, global_arrays, server_round, lr)
    else:
        arrays, metrics = _RUNNER.round(cfg, node, global_arrays, server_round, lr)
    pid = node.partition_id
    metrics["partition-id"] = pid
    arrays, metrics = _inject_fault(pid, arrays, metrics)
    metric_record = MetricRecord({k: _metric(v) for k, v in metrics.items()})
    if set(arrays) != set(global_arrays):
        raise ValueError(f"the trained adapter's tensors differ from the broadcast ones "
                         f"({sorted(set(arrays) ^ set(global_arrays))[:3]})")
    # the broadcast order: the server decodes the reply with the layout it sent, and Flower's clipping mod pairs
    # the reply's Arrays with the sent ones by position
    reply = RecordDict({"arrays": to_record({name: arrays[name] for name in global_arrays}),
                        "metrics": metric_record})
    return Message(content=reply, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server this node's partition id (so it can sample clients in a stable order); no data, no model."""
    pid = int(context.node_config.get("partition-id", -1))
    return Message(content=RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)


def _inject_fault(pid: int, arrays: dict, metrics: dict) -> tuple[dict, dict]:
    """Apply ``FEDSPEAR_INJECT_FAULTS`` to this client's reply (see the module docstring)."""
    faults = dict(item.split(":", 1) for item in os.environ.get("FEDSPEAR_INJECT_FAULTS", "").split(",") if ":" in item)
    kind = faults.get(str(pid))
    if kind is None:
        return arrays, metrics
    name = next(iter(arrays))
    if kind == "raise":
        raise RuntimeError(f"injected crash in client {pid}")
    if kind == "nan":
        arrays[name] = np.full_like(arrays[name], np.nan)
    elif kind == "shape":
        arrays[name] = np.zeros((1, 1), dtype=arrays[name].dtype)
    elif kind == "norm":
        arrays = {k: v + 1e6 for k, v in arrays.items()}
    elif kind == "negative":
        metrics["weight"] = -5
    return arrays, metrics


def _metric(value) -> int | float:
    """MetricRecord values must be int or float; NaN stays a float NaN (written as null in metrics.jsonl)."""
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, int) else float(value)
