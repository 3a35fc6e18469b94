"""A long-lived process per SuperNode that keeps the base model loaded, so deployment rounds never reload weights.

Why it exists: a Flower 1.41–1.42 SuperNode runs every message in a fresh ``flwr-clientapp`` process. With
``--isolation subprocess`` (the default) the SuperNode starts ``flower-superexec``
(``flwr/supernode/start_client_internal.py``), whose ``SubprocessExecutor.launch``
(``flwr/supercore/superexec/executor/subprocess_executor.py``) starts one ``flwr-clientapp --token <t>`` per task;
``flwr/supernode/runtime/run_clientapp.py`` pulls that one message, runs the ClientApp, pushes the reply and exits.
``--isolation process`` only moves the same SuperExec out of the SuperNode. A model held at module level in the
ClientApp (``_WORKER``, which is what keeps it loaded in the simulation engine's long-lived Ray actor) would be
loaded again for every round. So on a SuperNode the ClientApp forwards the round to this worker and only packs
the reply::

    fedspear node-worker --address 127.0.0.1:9301 --key-file node-0/worker.key
    flower-supernode ... --node-config 'partition-id=0 worker-address="127.0.0.1:9301" \\
        worker-key="/abs/node-0/worker.key"'

This module and the ClientApp import torch and the model code only where a ``Worker`` is loaded (``NodeRunner``):
a ClientApp process that forwards its round here, or runs a SecAgg+ stage (four per round), starts without them —
1.8 s → 0.4 s to import the ClientApp on a 2-core Zen 5 (2026-12-02).

Node config keys the ClientApp reads (``NodeSettings``): ``partition-id`` (required), ``data-dir`` (this node's own
data, laid out like ``shared/data``: the node trains on its whole train split instead of a Dirichlet slice),
``trace-db`` (a ``fedspear chat`` trace store: the node trains on people's conversations, ``fedspear.human.replay``),
``trace-dir`` (where the node keeps its training traces, ``fedspear.answers``; none kept without it),
``worker-address`` and ``worker-key`` (both or neither).

The wire between ClientApp and worker: ``multiprocessing.connection`` over TCP on the loopback interface, opened
with an HMAC challenge on the shared key (the key file: 64 hex characters, mode 0600, created by the worker);
after that only bytes travel — a JSON header and the arrays as ``np.savez`` read back with
``allow_pickle=False``. Nothing is ever unpickled, and the worker refuses to listen on a non-loopback address.

Every round's metrics carry ``model_loads`` (base-model loads by the process that ran the round, since it
started), ``worker_pid`` and ``seconds_load_model`` (load time spent in this round), so ``metrics.jsonl`` shows
loads per round on each node: 1 in the node's first round, 0 afterwards.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import ipaddress
import json
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import AuthenticationError, Client, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from fedspear.answers import trace_dir
from fedspear.config import RunConfig, nearest_existing
from fedspear.fl.partition import dirichlet_partitions
from fedspear.human.store import TraceStore
from fedspear.runtime.memory import release_memory

if TYPE_CHECKING:  # imported where a model is loaded: a ClientApp process that only forwards a round, or runs a
    from fedspear.worker import Worker  # SecAgg+ stage, starts without torch (module docstring)

log = logging.getLogger("fedspear.node_worker")

PROTOCOL = 1


#: the node config keys fedspear's ClientApp reads (module docstring); ``num-partitions`` is the one Flower's
#: simulation engine sets beside ``partition-id``
NODE_KEYS = ("partition-id", "num-partitions", "data-dir", "trace-db", "trace-dir", "worker-address", "worker-key")


@dataclass(frozen=True)
class NodeSettings:
    """What a SuperNode's ``--node-config`` tells its ClientApp (keys written with '-', see the module docstring)."""

    partition_id: int
    data_dir: str | None = None
    worker_address: str | None = None
    worker_key: str | None = None
    trace_db: str | None = None
    trace_dir: str | None = None

    @classmethod
    def from_node_config(cls, node: Mapping[str, Any], num_clients: int) -> "NodeSettings":
        """Read and check the node config against the run's ``num_clients``.

        Raises:
            ValueError: a key that is not one of ``NODE_KEYS`` (a misspelt ``trace_db`` would train on the Dirichlet
            slice instead of people's conversations), no ``partition-id``, or one that is not an integer in
            0..num_clients-1, only one of ``worker-address`` / ``worker-key`` set, or a ``trace-dir`` that is a file
            or lies under one (each message names the key and the fix).
        """
        unknown = sorted(set(node) - set(NODE_KEYS))
        if unknown:
            raise ValueError(f"node config key(s) {', '.join(map(repr, unknown))} not known; fedspear's ClientApp "
                             f"reads {', '.join(NODE_KEYS)}")
        if "partition-id" not in node:
            raise ValueError("node config has no 'partition-id' "
                             "(start the SuperNode with --node-config 'partition-id=K')")
        pid = node["partition-id"]
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise ValueError(f"node config partition-id must be an integer, got {pid!r}")
        if not 0 <= pid < num_clients:
            raise ValueError(f"partition-id {pid} is outside 0..{num_clients - 1} (num_clients = {num_clients})")
        address, key = node.get("worker-address"), node.get("worker-key")
        if bool(address) != bool(key):
            raise ValueError("node config sets only one of 'worker-address' and 'worker-key'; set both or neither")
        data_dir, trace_db = node.get("data-dir"), node.get("trace-db")
        if node.get("trace-dir"):
            where = Path(str(node["trace-dir"])).expanduser()
            above = nearest_existing(where)
            if not above.is_dir():
                raise ValueError(f"node config trace-dir {where}: {above} is a file, not a folder; give a folder")
        return cls(pid, str(data_dir) if data_dir else None, str(address) if address else None,
                   str(key) if key else None, str(trace_db) if trace_db else None,
                   str(node["trace-dir"]) if node.get("trace-dir") else None)


def partition_indices(examples: list, cfg: RunConfig, partition_id: int, local_data: bool) -> list[int]:
    """This node's train indices: all of them for a node with its own data, else its Dirichlet slice (SPEC §1).

    Raises:
        ValueError: fewer train examples than clients (Dirichlet case).
    """
    if local_data:
        return list(range(len(examples)))
    return dirichlet_partitions(examples, cfg.num_clients, cfg.dirichlet_alpha, cfg.seed, cfg.partitioner)[partition_id]


class NodeRunner:
    """One node's ``Worker`` (base model + LoRA + train data), loaded once and counted."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.loads = 0

    def worker_for(self, cfg: RunConfig) -> tuple[Worker, float]:
        """The worker for ``cfg`` and the seconds spent loading it now (0.0 when the loaded one fits)."""
        seconds = 0.0
        if self.worker is None or not self.worker.compatible(cfg):
            t0 = time.perf_counter()
            if self.worker is not None:  # free the old model before loading the new one (a cycle: the collector's)
                self.worker = None
                release_memory(full=True)
            from fedspear.worker import Worker

            self.worker = Worker.load(cfg)
            seconds = time.perf_counter() - t0
            self.loads += 1
            log.info("pid %d: base model %s loaded in %.1f s (load %d of this process)", os.getpid(), cfg.model,
                     seconds, self.loads)
        return self.worker, seconds

    def round(self, cfg: RunConfig, node: NodeSettings, arrays: dict[str, np.ndarray], server_round: int,
              lr: float) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """One client round (``Worker.round``) as partition ``node.partition_id``; metrics gain the load counters."""
        if node.data_dir:
            cfg = dataclasses.replace(cfg, data_dir=node.data_dir)
        worker, seconds = self.worker_for(cfg)
        if node.trace_db:  # people give feedback on this node: train on their stored conversations (fedspear chat)
            out, metrics = worker.human_round(cfg, arrays, TraceStore(node.trace_db), node.partition_id,
                                              server_round, lr)
        else:
            indices = partition_indices(worker.examples, cfg, node.partition_id, local_data=bool(node.data_dir))
            out, metrics = worker.round(cfg, arrays, indices, node.partition_id, server_round, lr,
                                        trace_dir=trace_dir(node.trace_dir))
        metrics.update(model_loads=self.loads, worker_pid=os.getpid(), seconds_load_model=seconds)
        return out, metrics


# ---- wire format: [8-byte header length][JSON header][np.savez bytes] -------------------------------------------
def pack(header: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    """Header and arrays as bytes (array names go in the header, so any name is fine)."""
    arrays = arrays or {}
    header = {**header, "names": list(arrays)}
    buf = io.BytesIO()
    if arrays:
        np.savez(buf, *arrays.values())
    head = json.dumps(header, default=_plain).encode()
    return struct.pack(">Q", len(head)) + head + buf.getvalue()


def _plain(value: Any) -> Any:
    """numpy scalars (counters and timings in the metrics) as plain Python numbers for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def unpack(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """Inverse of ``pack``; arrays are read with ``allow_pickle=False``.

    Raises:
        ValueError: the bytes are not a message of this protocol.
    """
    if len(data) < 8:
        raise ValueError("truncated node-worker message")
    (n,) = struct.unpack(">Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = header.pop("names", [])
    arrays: dict[str, np.ndarray] = {}
    if names:
        with np.load(io.BytesIO(data[8 + n:]), allow_pickle=False) as npz:
            arrays = {name: npz[f"arr_{i}"] for i, name in enumerate(names)}
    return header, arrays


def _split_address(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port).

    Raises:
        ValueError: not ``host:port``, or the host is not a loopback address (the worker serves its own machine).
    """
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit():
        raise ValueError(f"worker address must be host:port (got {address!r})")
    if int(port) > 65535:
        raise ValueError(f"worker address {address!r}: the port must be in 0..65535 (0: any free one)")
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ValueError(f"worker address {address!r} is not on the loopback interface (use 127.0.0.1:PORT)")
    if ":" in host:  # multiprocessing.connection speaks AF_INET only
        raise ValueError(f"worker address {address!r}: IPv6 is not supported; use 127.0.0.1:PORT")
    return host, int(port)


def load_key(path: str | Path, create: bool = False) -> bytes:
    """The shared key in ``path``; with ``create``, a new random one is written first when the file is missing.

    Raises:
        FileNotFoundError: the file is missing and ``create`` is off (names the file and who writes it).
        ValueError: the path is a folder, or lies under a file; the file holds fewer than 32 characters.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"node-worker key {path} is a folder; give a file path, e.g. {path / 'worker.key'}")
    above = nearest_existing(path.parent)
    if not above.is_dir():
        raise ValueError(f"node-worker key {path}: {above} is a file, not a folder")
    if create and not path.exists():
        # Written whole under a temporary name, then linked in: a reader never sees an empty or half-written key
        # and an existing key is never replaced (link fails when the name exists).
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    if not path.is_file():
        raise FileNotFoundError(f"node-worker key {path} not found "
                                f"(`fedspear node-worker --key-file {path}` writes it)")
    try:
        key = path.read_text(encoding="ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"node-worker key {path} is not a key file (expected 64 hex characters)") from None
    if len(key) < 32:
        raise ValueError(f"node-worker key {path} is too short (expected 64 hex characters)")
    return key.encode()


def request(address: str, key_file: str | Path, header: dict, arrays: dict[str, np.ndarray] | None = None
            ) -> tuple[dict, dict[str, np.ndarray]]:
    """Send one request to the node worker and return its reply.

    Raises:
        ConnectionError: no worker listens at ``address``, or it refused the key (the message says how to start it).
        RuntimeError: the worker failed while serving the request (its error message is passed on).
    """
    host, port = _split_address(address)
    key = load_key(key_file)
    try:
        conn = Client((host, port), family="AF_INET", authkey=key)
    except ConnectionRefusedError:
        raise ConnectionError(f"no node worker listens at {address} (start it on this machine with "
                              f"`fedspear node-worker --address {address} --key-file {key_file}`)") from None
    except AuthenticationError:
        raise ConnectionError(f"the node worker at {address} refused the key in {key_file}") from None
    with conn:
        conn.send_bytes(pack({"protocol": PROTOCOL, **header}, arrays))
        reply, out = unpack(conn.recv_bytes())
    if not reply.get("ok"):
        raise RuntimeError(f"node worker at {address}: {reply.get('error', 'unknown error')}")
    return reply, out


def remote_round(node: NodeSettings, cfg: RunConfig, arrays: dict[str, np.ndarray], server_round: int, lr: float
                 ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``NodeRunner.round`` run by the node's worker process (what the ClientApp calls on a SuperNode)."""
    local = {"partition_id": node.partition_id, "data_dir": node.data_dir, "trace_db": node.trace_db,
             "trace_dir": node.trace_dir}
    reply, out = request(node.worker_address, node.worker_key,
                         {"op": "round", "config": cfg.to_dict(), "node": local, "server_round": server_round,
                          "lr": lr}, arrays)
    return out, reply["metrics"]


def ping(address: str, key_file: str | Path) -> dict:
    """The worker's pid and ``model_loads`` so far (no model work); used to wait for it and to count loads."""
    reply, _ = request(address, key_file, {"op": "ping"})
    return {"pid": reply["pid"], "model_loads": reply["model_loads"]}


def _handle(runner: NodeRunner, data: bytes) -> bytes:
    """Serve one request; any error becomes an ``ok: false`` reply (the worker keeps running)."""
    try:
        header, arrays = unpack(data)
        if header.get("protocol") != PROTOCOL:
            raise ValueError(f"protocol {header.get('protocol')} not supported (this worker speaks {PROTOCOL})")
        if header.get("op") == "ping":
            return pack({"ok": True, "pid": os.getpid(), "model_loads": runner.loads})
        if header.get("op") != "round":
            raise ValueError(f"unknown op {header.get('op')!r}")
        cfg = RunConfig(**header["config"])
        node = NodeSettings(**header["node"])
        out, metrics = runner.round(cfg, node, arrays, int(header["server_round"]), float(header["lr"]))
        return pack({"ok": True, "metrics": metrics}, out)
    except Exception as err:  # noqa: BLE001 - reported to the ClientApp, which fails the round for this node
        log.exception("request failed")
        return pack({"ok": False, "error": f"{type(err).__name__}: {err}"})


def serve(address: str, key_file: str | Path) -> None:
    """Listen on ``address`` (loopback only) and serve rounds one at a time until the process is stopped.

    Raises:
        ValueError: ``address`` is not a loopback ``host:port``.
        OSError: the port is taken.
    """
    host, port = _split_address(address)
    key = load_key(key_file, create=True)
    runner = NodeRunner()
    try:
        listener = Listener((host, port), family="AF_INET", authkey=key)
    except OSError as err:
        raise OSError(f"node worker cannot listen on {address}: {err.strerror or err}"
                      + (" (another process holds the port; give another --address)"
                         if err.errno == errno.EADDRINUSE else "")) from None
    with listener:
        bound = "%s:%d" % listener.address  # port 0 asks for any free one: this is the one to give the SuperNode
        log.info("node worker pid %d listening on %s", os.getpid(), bound)
        while True:
            try:
                conn = listener.accept()
            except (AuthenticationError, EOFError, ConnectionError) as err:
                log.warning("refused a connection (%s: %s)", type(err).__name__, err)
                continue
            with conn:
                try:
                    data = conn.recv_bytes()
                except (EOFError, ConnectionError):
                    continue
                reply = _handle(runner, data)
                try:
                    conn.send_bytes(reply)
                except (BrokenPipeError, ConnectionError) as err:
                    log.warning("could not send the reply (%s); the ClientApp has gone", err)
