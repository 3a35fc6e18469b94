"""Deployment: certificates and keys Flower accepts, the per-node worker that keeps the model loaded, and (slow)
``examples/deploy-local`` end to end — a TLS SuperLink with SuperNode auth, 2 SuperNodes, a refused unregistered
node, 2 rounds with the packaged SmolLM2-135M, and nothing left running."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fedspear.config import RunConfig
from fedspear.fl.certs import make_node_keys, make_server_certificates, verify_server_certificate

REPO = Path(__file__).resolve().parents[1]


# ---- certificates and keys ---------------------------------------------------------------------------------------
def test_server_certificate_chains_to_the_ca_and_names_the_hosts(tmp_path):
    from cryptography import x509

    paths = make_server_certificates(tmp_path, hosts=["10.0.0.5", "superlink.lan"])
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if the signature or issuer does not match
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for host in ("127.0.0.1", "localhost", "10.0.0.5", "superlink.lan"):
        verify_server_certificate(paths.ca_cert, paths.server_cert, host)
    with pytest.raises(ValueError, match="does not name 10.0.0.6"):
        verify_server_certificate(paths.ca_cert, paths.server_cert, "10.0.0.6")
    for key in (paths.ca_key, paths.server_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # a certificate from another CA does not verify against this one
    other = make_server_certificates(tmp_path / "other")
    with pytest.raises(ValueError, match="not issued by|does not verify"):
        verify_server_certificate(paths.ca_cert, other.server_cert, "127.0.0.1")
    # re-running keeps what exists (certificates already copied to nodes stay valid)
    before = paths.server_cert.read_bytes()
    assert make_server_certificates(tmp_path).server_cert.read_bytes() == before


def test_existing_certificates_are_never_replaced_by_accident(tmp_path):
    """Without --overwrite: a host the kept certificate lacks is refused (not a silent success), a missing file is
    refused (new files would replace the CA every SuperNode holds), and nothing changes; a bad host or validity is
    refused before anything is written."""
    paths = make_server_certificates(tmp_path, hosts=["superlink.lan", "*.lab.example", "0:0:0:0:0:0:0:2"])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert make_server_certificates(tmp_path, hosts=["superlink.lan"]) == paths  # already named: kept
    assert make_server_certificates(tmp_path, hosts=["SuperLink.lan.", "::2", "0:0:0:0:0:0:0:2"]) == paths  # the same
    with pytest.raises(ValueError, match="does not name other.org; kept as it is. --overwrite"):
        make_server_certificates(tmp_path, hosts=["other.org"])
    paths.server_key.unlink()
    with pytest.raises(ValueError, match="holds ca.pem, ca.key, server.pem but not server.key"):
        make_server_certificates(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {k: v for k, v in before.items()
                                                                    if k != "server.key"}
    renewed = make_server_certificates(tmp_path, hosts=["other.org"], overwrite=True)
    verify_server_certificate(renewed.ca_cert, renewed.server_cert, "other.org")
    for hosts, days, message in ((["not a host!!"], 365, "neither an IP address nor a DNS name"),
                                 (["-lead.example"], 365, "neither an IP address nor a DNS name"),
                                 (["10.0.0.256"], 365, "neither an IP address nor a DNS name"),  # a mistyped IP
                                 (["1.2.3"], 365, "neither an IP address nor a DNS name"),
                                 ([], 36500000, "reaches past the year 9999")):
        with pytest.raises(ValueError, match=message):
            make_server_certificates(tmp_path / "new", hosts=hosts, days=days)
        assert not (tmp_path / "new").exists()


def test_node_keys_are_what_flower_loads(tmp_path):
    """The private key loads the way ``flower-supernode --auth-supernode-private-key`` loads it (OpenSSH, EC), and
    ``flwr supernode register``'s own loader accepts the public key (EC on a NIST curve)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    keys = make_node_keys(tmp_path, "node-0")
    private = serialization.load_ssh_private_key(keys.private_key.read_bytes(), password=None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert stat.S_IMODE(keys.private_key.stat().st_mode) == 0o600
    assert try_load_public_key(keys.public_key) == public_key_to_bytes(private.public_key())
    assert make_node_keys(tmp_path, "node-1").public_key.read_bytes() != keys.public_key.read_bytes()
    with pytest.raises(ValueError, match="plain file name"):
        make_node_keys(tmp_path, "../x")


def test_node_names_are_checked_before_anything_is_written(tmp_path):
    """``check_node_name`` is what ``fedspear certs`` runs on every --node before it writes the CA: a path, an empty
    name or a control character (a line break would split the public key's one line) is refused, and
    ``make_node_keys`` writes nothing for such a name."""
    from fedspear.fl.certs import check_node_name

    check_node_name("node-0")
    for name in ("../evil", "a/b", "", "node\n0", "nul\0"):
        with pytest.raises(ValueError, match="a node key name must be a plain file name"):
            check_node_name(name)
        with pytest.raises(ValueError, match="a node key name must be a plain file name"):
            make_node_keys(tmp_path / "keys", name)
    assert not (tmp_path / "keys").exists()


# ---- node worker -------------------------------------------------------------------------------------------------
def test_wire_format_round_trips_without_pickle():
    from fedspear.fl.node_worker import pack, unpack

    arrays = {"base_model.a.lora_A.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2)}
    header, out = unpack(pack({"op": "x", "n": np.int64(3), "s": np.float32(0.5)}, arrays))
    assert header == {"op": "x", "n": 3, "s": 0.5}
    assert list(out) == list(arrays) and all(np.array_equal(out[k], arrays[k]) for k in arrays)
    # an array that would need unpickling (dtype=object) is refused on read, not executed
    pickled = pack({"op": "x"}, {"o": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="allow_pickle=False"):
        unpack(pickled)


def test_a_key_being_written_is_never_read_half_written(tmp_path, monkeypatch):
    # CI once failed here: a ClientApp read the worker's key between its creation and its write (empty → "too
    # short"). While the key text is being produced, a reader must still find no key, never a partial one.
    from fedspear.fl import node_worker

    path, seen = tmp_path / "node-0" / "worker.key", []
    token_hex = node_worker.secrets.token_hex

    def token_hex_while_reading(n):
        try:
            node_worker.load_key(path)
            seen.append("read a key before it was written")
        except FileNotFoundError:
            seen.append("no key yet")
        return token_hex(n)

    monkeypatch.setattr(node_worker.secrets, "token_hex", token_hex_while_reading)
    key = node_worker.load_key(path, create=True)
    assert seen and set(seen) == {"no key yet"}
    assert len(key) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["worker.key"]  # no temporary file left behind
    # an existing key is kept, never replaced
    assert node_worker.load_key(path, create=True) == key
    path.write_text("abc\n")
    with pytest.raises(ValueError, match="too short"):
        node_worker.load_key(path)
    path.write_bytes(b"\xff" * 64)  # the codec's own error named no file
    with pytest.raises(ValueError, match=f"node-worker key {path} is not a key file"):
        node_worker.load_key(path)
    with pytest.raises(ValueError, match="is a folder; give a file path"):
        node_worker.load_key(tmp_path, create=True)
    with pytest.raises(ValueError, match="worker.key is a file, not a folder"):
        node_worker.load_key(path / "k", create=True)


@pytest.mark.parametrize(("address", "message"), [("127.0.0.1:99999", "the port must be in 0..65535"),
                                                  ("127.0.0.1", "must be host:port"),
                                                  ("10.0.0.5:9301", "not on the loopback interface"),
                                                  ("[::1]:9301", "IPv6 is not supported; use 127.0.0.1:PORT")])
def test_worker_addresses_are_checked(address, message):
    from fedspear.fl.node_worker import _split_address

    with pytest.raises(ValueError, match=message):
        _split_address(address)
    assert _split_address("localhost:9301") == ("localhost", 9301)


def test_node_settings_are_checked():
    from fedspear.fl.node_worker import NodeSettings

    node = NodeSettings.from_node_config({"partition-id": 1, "worker-address": "127.0.0.1:1", "worker-key": "k"}, 2)
    assert node.partition_id == 1 and node.worker_address == "127.0.0.1:1" and node.data_dir is None
    with pytest.raises(ValueError, match="no 'partition-id'"):
        NodeSettings.from_node_config({}, 2)
    with pytest.raises(ValueError, match="outside 0..1"):
        NodeSettings.from_node_config({"partition-id": 2}, 2)
    with pytest.raises(ValueError, match="set both or neither"):
        NodeSettings.from_node_config({"partition-id": 0, "worker-address": "127.0.0.1:1"}, 2)
    # Flower parses --node-config values: 1.5 and true were taken as partition 1, "abc" failed in int()
    for value in (1.5, True, "abc"):
        with pytest.raises(ValueError, match=f"partition-id must be an integer, got {value!r}"):
            NodeSettings.from_node_config({"partition-id": value}, 2)
    # a misspelt key was ignored: the node trained on its Dirichlet slice instead of its own data
    with pytest.raises(ValueError, match=r"key\(s\) 'data_dir', 'trace_db' not known; fedspear's ClientApp reads "
                                         r"partition-id, num-partitions, data-dir"):
        NodeSettings.from_node_config({"partition-id": 0, "trace_db": "/t.db", "data_dir": "/d"}, 2)
    assert NodeSettings.from_node_config({"partition-id": 1, "num-partitions": 2}, 2).partition_id == 1  # simulation


def test_a_trace_dir_under_a_file_is_refused_before_the_round(tmp_path):
    """``trace-dir`` under a file failed after the round's generation and training, with a NotADirectoryError that
    named no key."""
    from fedspear.fl.node_worker import NodeSettings

    (tmp_path / "afile").write_text("keep")
    for where in (tmp_path / "afile", tmp_path / "afile" / "traces"):
        with pytest.raises(ValueError, match=f"trace-dir {where}: {tmp_path / 'afile'} is a file, not a folder"):
            NodeSettings.from_node_config({"partition-id": 0, "trace-dir": str(where)}, 2)
    node = NodeSettings.from_node_config({"partition-id": 0, "trace-dir": str(tmp_path / "new" / "traces")}, 2)
    assert node.trace_dir == str(tmp_path / "new" / "traces") and (tmp_path / "afile").read_text() == "keep"


def test_a_node_with_its_own_data_trains_on_all_of_it(tmp_path, monkeypatch, always_right):
    """``data-dir`` in the node config: the node reads its train split from there and uses every item (no Dirichlet
    slice), whatever the run's own ``data_dir``."""
    import shutil

    import fedspear.worker as client_module
    from fedspear.fl.node_worker import NodeRunner, NodeSettings
    from fedspear.runtime.model import LoraSettings, add_lora, get_adapter, load_base
    from fedspear.tasks.common import PACKAGE_DATA_DIR

    monkeypatch.setattr(client_module, "make_feedback", lambda task, *args, **kwargs: always_right)
    local = tmp_path / "node-data" / "arc_challenge"
    local.mkdir(parents=True)
    lines = (PACKAGE_DATA_DIR / "arc_challenge" / "train.jsonl").read_text().splitlines()[:7]
    (local / "train.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(PACKAGE_DATA_DIR / "arc_challenge" / "test.jsonl", local / "test.jsonl")
    node = NodeSettings.from_node_config({"partition-id": 1, "data-dir": str(local.parent)}, num_clients=4)
    cfg = RunConfig(model="tiny-random", num_clients=4, clients_per_round=1, rollouts_per_round=2, local_steps=1,
                    batch_size=2, max_new_tokens=3, lora_r=4, lora_alpha=8)
    base, _, _ = load_base("tiny-random")
    arrays = get_adapter(add_lora(base, LoraSettings(4, 8, cfg.lora_dropout), seed=cfg.seed))
    runner = NodeRunner()
    _, metrics = runner.round(cfg, node, arrays, server_round=1, lr=1e-3)
    assert metrics["partition-size"] == 7 and metrics["prompts"] == 2 and metrics["model_loads"] == 1
    assert runner.worker.loaded.data_dir == str(local.parent)


def test_a_new_worker_is_loaded_after_the_old_model_is_freed(monkeypatch):
    """A node whose run needs another model (here another LoRA rank) drops its worker and frees the old model — a
    reference cycle that ``release_memory`` had frozen with the other survivors of a round — before loading the new
    one, so the two are never held together."""
    import gc
    import weakref

    from fedspear.fl.node_worker import NodeRunner
    from fedspear.runtime.memory import release_memory
    from fedspear.worker import Worker

    cfg = RunConfig(model="tiny-random", num_clients=4, lora_r=4, lora_alpha=8)
    runner = NodeRunner()
    first, _ = runner.worker_for(cfg)
    freed = []
    weakref.finalize(first.model, freed.append, "old model")
    del first
    release_memory()  # a round's end: the loaded worker is frozen with the survivors
    assert gc.get_freeze_count() > 0
    load = Worker.load

    def load_checking(new_cfg):
        assert freed == ["old model"], "the old model was still held when the new one began to load"
        return load(new_cfg)

    monkeypatch.setattr(Worker, "load", staticmethod(load_checking))
    second, seconds = runner.worker_for(RunConfig(model="tiny-random", num_clients=4, lora_r=8, lora_alpha=16))
    assert second.loaded.lora_r == 8 and seconds > 0 and runner.loads == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("task_identity")
def test_client_app_rounds_run_in_the_node_worker_and_load_the_model_once(tmp_path, monkeypatch, always_right):
    """Two ClientApp train calls with a node config naming a worker: both run in the worker (its pid), which loads
    the model once; a wrong key and a non-loopback address are refused with a clear message."""
    import fedspear.worker as client_module
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

    from fedspear.fl import client_app, node_worker
    from fedspear.fl.records import LAYOUT_KEY, from_record, layout_of, to_record

    monkeypatch.setattr(client_module, "make_feedback", lambda task, *args, **kwargs: always_right)
    address, key = f"127.0.0.1:{_free_port()}", tmp_path / "worker.key"
    threading.Thread(target=node_worker.serve, args=(address, key), daemon=True).start()
    for _ in range(100):
        try:
            assert node_worker.ping(address, key) == {"pid": os.getpid(), "model_loads": 0}
            break
        except (ConnectionError, FileNotFoundError):
            threading.Event().wait(0.1)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600

    cfg = RunConfig(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=2, local_steps=1,
                    batch_size=2, max_new_tokens=3, lora_r=4, lora_alpha=8)
    context = Context(run_id=1, node_id=1, state=RecordDict(), run_config={},
                      node_config={"partition-id": 0, "worker-address": address, "worker-key": str(key)})
    arrays = None
    for server_round in (1, 2):
        if arrays is None:
            from fedspear.runtime.model import LoraSettings, add_lora, get_adapter, load_base

            base, _, _ = load_base("tiny-random")
            arrays = get_adapter(add_lora(base, LoraSettings(4, 8, cfg.lora_dropout), seed=cfg.seed))
        msg = Message(content=RecordDict({
            "arrays": to_record(arrays),
            "config": ConfigRecord({"server-round": server_round, "lr": 1e-3,
                                    "fedspear-config": json.dumps(cfg.to_dict()), LAYOUT_KEY: layout_of(arrays)})}),
            dst_node_id=1, message_type=MessageType.TRAIN)
        reply = client_app.train(msg, context)
        metrics = dict(reply.content["metrics"])
        assert metrics["worker_pid"] == os.getpid() and metrics["model_loads"] == 1
        assert metrics["partition-id"] == 0 and metrics["prompts"] == 2
        assert (metrics["seconds_load_model"] > 0) == (server_round == 1)
        arrays = from_record(reply.content["arrays"], layout_of(arrays))
        assert all(np.isfinite(v).all() for v in arrays.values())
    assert node_worker.ping(address, key)["model_loads"] == 1

    wrong = tmp_path / "wrong.key"
    wrong.write_text("0" * 64)
    with pytest.raises(ConnectionError, match="refused the key"):
        node_worker.ping(address, wrong)
    with pytest.raises(ConnectionError, match="no node worker listens"):
        node_worker.ping(f"127.0.0.1:{_free_port()}", key)
    with pytest.raises(ValueError, match="not on the loopback interface"):
        node_worker.serve("0.0.0.0:9301", key)


# ---- the example, end to end ------------------------------------------------------------------------------------
def _processes_mentioning(path: Path) -> list[int]:
    """PIDs of live processes whose environment or command line mentions ``path`` (FLWR_HOME is under it)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and (
                    any(str(path) in v for v in p.environ().values()) or any(str(path) in a for a in p.cmdline())):
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


# seconds the whole example may take; raise it on a machine whose cores are busy with other work
BOUND = float(os.environ.get("FEDSPEAR_DEPLOY_TEST_SECONDS", 900))


def _run_example(out: Path, args: list[str]) -> tuple[dict, str]:
    """Run ``examples/deploy-local/run.py --output-dir out *args``, bounded to ``BOUND`` s; its summary and log.
    Fails the test when it times out (after stopping it), exits non-zero or reports an error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    log = out.with_name(out.name + ".log")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "deploy-local" / "run.py"),
                                 "--output-dir", str(out), *args, "--timeout", str(BOUND - 120)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=BOUND)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the example's SIGTERM handler stops everything it started, then exits
            proc.wait(timeout=120)
            pytest.fail(f"examples/deploy-local took longer than {BOUND:.0f} s:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, log.read_text()[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "error" not in summary
    return summary, log.read_text()


@pytest.mark.slow
def test_deploy_local_example(tmp_path):
    """``examples/deploy-local/run.py`` with the packaged model at tiny sizes, bounded to ``BOUND`` s (15 min): 2
    rounds over TLS with both registered SuperNodes, the unregistered one refused, each node's model loaded once, a
    finite aggregated adapter, and no process left behind."""
    out = tmp_path / "deploy"
    summary, _ = _run_example(out, ["--rounds", "2", "--rollouts-per-round", "2", "--eval-size", "4",
                                    "--local-steps", "1", "--max-new-tokens", "8", "--train-size", "20"])

    # TLS on the SuperLink; both nodes registered; the unregistered node refused by the SuperLink
    link_log = (out / "logs" / "superlink.log").read_text()
    assert "Uvicorn running on https://127.0.0.1:" in link_log
    assert set(summary["registered"]) == {"node-0", "node-1"}
    assert {summary["supernodes"][str(i)] for i in summary["registered"].values()} == {"online"}
    assert len(summary["supernodes"]) == 2  # the unregistered node never became one
    intruder = summary["intruder"]
    assert intruder["refused"] and intruder["exit_code"] not in (None, 0)
    assert any("No SuperNode found with the given public key" in line for line in intruder["superlink_log"])

    # 2 rounds, both nodes answered every round; the aggregated adapter is finite and has round 0's tensors
    assert summary["run_status"] == "finished:completed"
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert all(r["clients_ok"] == 2 and set(r["nodes"]) == {"0", "1"} for r in summary["rounds"])
    from fedspear.rundir import RunDir

    run = RunDir(out / "run")
    start, final = run.load_adapter(0), run.load_adapter(2)
    assert set(final) == set(start) and all(final[k].shape == start[k].shape for k in start)
    assert all(np.isfinite(v).all() for v in final.values())

    # the base model is loaded once per node: in round 1, by the node's worker, and never again
    first, second = summary["rounds"]
    for node in ("0", "1"):
        assert first["nodes"][node]["model_loads_this_round"] == 1
        assert second["nodes"][node]["model_loads_this_round"] == 0
        assert first["nodes"][node]["worker_pid"] == second["nodes"][node]["worker_pid"]
    assert {w["model_loads"] for w in summary["worker_loads"].values()} == {1}

    # everything started was stopped
    assert summary["leftover_pids"] == []
    assert _processes_mentioning(out) == []


@pytest.mark.slow
def test_deploy_local_example_with_client_side_dp(tmp_path):
    """``run.py --dp client`` on the tiny model, over TLS: the simulated user flips every verdict
    (``--set user_flip_prob=1.0``), so the tiny model's wrong answers count as wins and its SPEAR updates are not
    zero; the nodes' ClientApps clip them with Flower's ``fixedclipping_mod`` to C = 1e-4 (far below their
    norm), the ServerApp noises the average (σ = z·C/2) and records ε after every round: 4.728507 after round 1 at
    z = 1, δ = 1e-5 (by hand in test_dp) and 7.077392 after round 2: the RDP bound at T = 2, best order α = 4.2:
    2·4.2/2 + ln(1 − 1/4.2) − (ln 1e-5 + ln 4.2)/3.2 = 4.2 − 0.271934 + 3.149325 = 7.077391."""
    out = tmp_path / "deploy-dp"
    summary, log = _run_example(out, [
        "--model", "tiny-random", "--rounds", "2", "--rollouts-per-round", "2", "--eval-size", "4", "--local-steps",
        "1", "--max-new-tokens", "8", "--train-size", "20", "--set", "user_flip_prob=1.0",
        "--dp", "client", "--dp-noise-multiplier", "1.0", "--dp-clip-norm", "1e-4"])
    assert [r["clients_ok"] for r in summary["rounds"]] == [2, 2]
    assert summary["leftover_pids"] == [] and _processes_mentioning(out) == []

    from fedspear.config import load_config
    from fedspear.rundir import RunDir

    run = RunDir(out / "run")
    cfg = load_config(run.config_path).resolved()
    assert (cfg.dp, cfg.dp_noise_multiplier, cfg.dp_clip_norm, cfg.user_flip_prob) == ("client", 1.0, 1e-4, 1.0)
    records = [r for r in run.records() if r["round"] > 0]
    clients = [c for r in records for c in r["clients"]]
    assert all(c["num-wins"] > 0 for c in clients)  # flipped verdicts: every client trained on wins
    # every update the server aggregated was clipped on the node: norm C (theirs were far larger), never above
    assert all(c["update_norm"] == pytest.approx(1e-4, rel=1e-3) for c in clients), [c["update_norm"] for c in clients]
    assert [r["dp_epsilon"] for r in summary["rounds"]] == pytest.approx([4.728507, 7.077392], abs=1e-6)
    assert all(r["dp_sigma"] == pytest.approx(1.0 * 1e-4 / 2) for r in records)
    assert all(np.isfinite(v).all() for v in run.load_adapter(2).values())
    assert "ε 4.729" in log


@pytest.mark.slow
def test_deploy_local_example_with_secure_aggregation(tmp_path):
    """``run.py --secure-aggregation`` on the tiny model: three registered SuperNodes over TLS, every round through
    Flower's SecAgg+ (four stages through the SuperLink, each a fresh ClientApp process whose SecAgg+ keys live in
    the node's Context). With every verdict flipped each client has 2 wins, so all three uploads enter the mean
    (t = 2 of 3); the server received no client values as Arrays, logged no per-client update norm, and the
    adapter moved (Adam moves each value by about lr = 2e-4 per step) and stayed finite."""
    out = tmp_path / "deploy-secagg"
    summary, log = _run_example(out, [
        "--secure-aggregation", "--model", "tiny-random", "--rounds", "2", "--rollouts-per-round", "2",
        "--eval-size", "4", "--local-steps", "1", "--max-new-tokens", "8", "--train-size", "20",
        "--set", "user_flip_prob=1.0"])
    assert set(summary["registered"]) == {"node-0", "node-1", "node-2"} and summary["intruder"]["refused"]
    assert summary["leftover_pids"] == [] and _processes_mentioning(out) == []
    assert "SecAgg+ 3 of 3 in the mean (t = 2)" in log

    from fedspear.config import load_config
    from fedspear.rundir import RunDir

    run = RunDir(out / "run")
    assert load_config(run.config_path).secure_aggregation == "secaggplus"
    records = [r for r in run.records() if r["round"] > 0]
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert r["aggregated"] and r["clients_ok"] == 3
        assert {k: r["secagg"][k] for k in ("sampled", "threshold", "uploaded", "weight_total",
                                            "array_values_received")} == {
            "sampled": 3, "threshold": 2, "uploaded": 3, "weight_total": 6, "array_values_received": 0}
        assert sorted(c["partition-id"] for c in r["clients"]) == [0, 1, 2]
        assert all("update_norm" not in c for c in r["clients"])
    before, after = run.load_adapter(0), run.load_adapter(2)
    moved = max(float(np.abs(after[k] - before[k]).max()) for k in before)
    assert 1e-5 < moved < 1e-3 and all(np.isfinite(v).all() for v in after.values())


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGHUP"], ids=["ctrl-c", "hang-up"])
def test_deploy_local_example_stops_on_ctrl_c_or_a_hang_up(tmp_path, signame):
    """Ctrl-C or a closed terminal (SIGINT or SIGHUP to the example's process group, as a terminal sends them) once
    round 0 is recorded: the example ends within 10 s with exit code 130 or 129 and one last line saying where the
    run stopped, and stops every process it started, the SuperLink and SuperNodes in sessions of their own included
    (``summary.json``'s ``leftover_pids``, and no process of its session left)."""
    import re
    import signal
    import time

    signum = signal.Signals[signame]

    import psutil

    out = tmp_path / "deploy-stop"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "deploy-local" / "run.py"), "--output-dir",
                             str(out), "--model", "tiny-random", "--rounds", "3", "--rollouts-per-round", "2",
                             "--eval-size", "4", "--local-steps", "1", "--max-new-tokens", "8", "--train-size", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                                        for s in (signal.SIGINT, signal.SIGHUP)])
    metrics = out / "run" / "metrics.jsonl"
    deadline = time.monotonic() + BOUND
    while not (metrics.is_file() and metrics.read_text().endswith("\n")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("round 0 never recorded")
        time.sleep(0.5)
    time.sleep(2.0)
    t0 = time.monotonic()
    os.killpg(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running 10 s after {signame}: {proc.communicate()[1][-3000:]}")
    print(f"deploy-local {signame}: exit {proc.returncode} after {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 128 + signum, err[-3000:]
    # two seconds after round 0's record: inside round 1, or a later round where the rounds are that quick
    assert re.match(rf"stopped by {signame} after round [012] of 3 ", err.strip().splitlines()[-1]), err[-3000:]
    assert json.loads((out / "summary.json").read_text())["leftover_pids"] == []
    left = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(p.pid) == proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (OSError, psutil.Error):
            continue
    assert left == [] and _processes_mentioning(out) == []


@pytest.fixture
def example(file_module):
    """``examples/deploy-local/run.py`` imported as a module (its functions, without running a deployment)."""
    return file_module(REPO / "examples" / "deploy-local" / "run.py", "deploy_local_run")


def test_deploy_local_settings_are_what_the_server_app_will_build(tmp_path, monkeypatch, capsys, example):
    """The example's settings file plus its run config, merged as the ServerApp merges them (``load_config``: the
    run config wins), give the options' values with ``--set`` over them; what the ServerApp would refuse is refused
    before any process starts (exit 2, nothing written): a run-config key in ``--set``, an unknown key (with the
    near one), SecAgg+ on 2 nodes whatever ``--set`` says."""
    from fedspear.config import ConfigError, load_config

    run = example
    parse = lambda *argv: run.argparse.Namespace(  # noqa: E731 - the parsed options main() passes on
        model="tiny-random", local_steps=1, batch_size=2, train_size=20, seed=0, timeout=600.0, max_new_tokens=0,
        dp="off", dp_noise_multiplier=1.0, dp_clip_norm=1.0, secure_aggregation=True, nodes=3, rounds=2,
        rollouts_per_round=2, eval_size=4, set=[run.key_value(a) for a in argv])
    args = parse("secagg_clipping_range=0.05", "local_steps=3", "user_flip_prob=1.0")
    path = tmp_path / "run-settings.toml"
    run.write_run_settings(path, run.run_settings(args))
    values = run.run_config_values(args)
    cfg = load_config(str(path), **values)
    assert (cfg.secure_aggregation, cfg.secagg_clipping_range, cfg.local_steps, cfg.user_flip_prob) == (
        "secaggplus", 0.05, 3, 1.0)
    assert (cfg.num_clients, cfg.clients_per_round, cfg.rounds, cfg.round_timeout) == (3, 3, 2, 600.0)
    with pytest.raises(ConfigError, match="--set clients_per_round: set it with --nodes"):
        run.run_settings(parse("clients_per_round=3"))
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rate' \(did you mean 'lr'\?\)"):
        run.run_settings(parse("learning_rate=0.1"))
    # a string setting stays a string, as with `fedspear run --set` (2024 was the number, refused by RunConfig)
    assert run.run_settings(parse("data_dir=2024", "user_flip_prob=0.5"))["data_dir"] == "2024"

    out = tmp_path / "never"
    for argv, words in ((["--nodes", "2", "--secure-aggregation"], "needs clients_per_round ≥ 3"),
                        (["--set", "num_clients=3"], "set it with --nodes"),
                        (["--secure-aggregation", "--dp", "client"], "is not supported"),
                        # these started every process and then failed with an IndexError, a traceback, or a
                        # message naming round_timeout
                        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
                        (["--timeout", "-5"], "--timeout must be > 0 seconds, got -5")):
        monkeypatch.setattr(sys, "argv", ["run.py", "--output-dir", str(out), *argv])
        assert run.main() == 2
        assert words in capsys.readouterr().err and not out.exists()
    (tmp_path / "afile").write_text("keep")
    monkeypatch.setattr(sys, "argv", ["run.py", "--model", "tiny-random", "--output-dir",
                                      str(tmp_path / "afile" / "x")])
    assert run.main() == 2
    assert f"--output-dir {tmp_path / 'afile' / 'x'}: Not a directory" in capsys.readouterr().err


def test_certs_checks_every_node_name_before_writing(tmp_path):
    """`fedspear certs DIR --node ../evil` refused the name only after writing the CA and server certificate."""
    from typer.testing import CliRunner

    from fedspear.cli import app

    result = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--node", "ok", "--node", "../evil"])
    assert result.exit_code == 2 and "a node key name must be a plain file name" in result.output
    assert not (tmp_path / "c").exists()
    # a node named ca or server: its key pair replaced the CA's or the SuperLink's private key
    for name in ("ca", "server"):
        result = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--node", name])
        assert result.exit_code == 2 and f"a node key name cannot be '{name}'" in result.output
        assert not (tmp_path / "c").exists()


def test_node_worker_says_which_address_it_cannot_take_and_which_port_it_took(tmp_path, caplog):
    """A port in use was "[Errno 98] Address already in use" with no address; with port 0 the log said
    "listening on 127.0.0.1:0", so no SuperNode could be pointed at the worker."""
    from fedspear.fl import node_worker

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        with pytest.raises(OSError, match=f"node worker cannot listen on {address}: .*another process holds the "
                                          "port; give another --address"):
            node_worker.serve(address, tmp_path / "worker.key")
    listening = threading.Event()

    class Stop(Exception):
        pass

    def accept_once(self):  # the first accept: note the address logged, then end serve()
        listening.set()
        raise Stop

    import multiprocessing.connection as mpc

    original = mpc.Listener.accept
    mpc.Listener.accept = accept_once
    try:
        with caplog.at_level("INFO", logger="fedspear"), pytest.raises(Stop):
            node_worker.serve("127.0.0.1:0", tmp_path / "worker.key")
    finally:
        mpc.Listener.accept = original
    assert listening.is_set()
    bound = re.search(r"listening on 127\.0\.0\.1:(\d+)", caplog.text)
    assert bound and int(bound.group(1)) > 0

