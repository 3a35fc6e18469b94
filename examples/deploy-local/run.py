"""A real Flower deployment on one machine: 1 SuperLink + N SuperNodes on 127.0.0.1, TLS and SuperNode auth, 2 rounds.

    nice -n 19 .venv/bin/python examples/deploy-local/run.py --output-dir runs/deploy-local

What it does, in order (every process it starts gets its own log under ``<output>/logs/``):

1. makes a CA, the SuperLink's certificate (127.0.0.1, localhost) and a key pair per SuperNode (``--nodes``: 2, or
   3 with ``--secure-aggregation``) plus one for an intruder (``fedspear.fl.certs``);
2. starts ``flower-superlink`` with TLS and ``--enable-supernode-auth``;
3. registers the public keys of ``node-0`` … ``node-<N-1>`` with ``flwr supernode register`` (not ``intruder``'s);
4. starts one node worker per node (``fedspear node-worker``: holds the base model across rounds) and the N
   SuperNodes (``--node-config 'partition-id=K worker-address=… worker-key=…'``);
5. meanwhile, one more SuperNode with the unregistered key, and checks the SuperLink refused it (its exit code and
   log, and the SuperLink's log line, go to ``summary.json``);
6. submits the app with ``flwr run <output>/app deploy-local`` (``<output>/app``: a copy of the checkout's files the
   app bundle carries, the same bundle Flower builds from the checkout) and waits (``flwr ls``) until the run
   finishes or ``--timeout`` seconds pass;
7. prints seconds per round and base-model loads per node per round, writes ``summary.json``;
8. stops every process it started, and their children, by PID — also on error, Ctrl-C, SIGTERM and SIGHUP (a closed
   terminal; left ignored under ``nohup``) — and reports any left; after a signal it ends with one line saying where
   the run stopped, and exit code 130 (SIGINT) / 143 (SIGTERM) / 129 (SIGHUP).

Exit code 0 only when the run completed every round, the intruder was refused and nothing is left running.
``--no-worker`` leaves the node workers out, so each fresh ClientApp process loads the model itself (to measure
what the worker saves). ``--secure-aggregation`` runs every round through Flower's SecAgg+ (``fedspear.fl.secagg``):
three SuperNodes (``--nodes``, SecAgg+ needs at least 3), each round's four stages through the SuperLink, the server
seeing only the masked sum; ``summary.json`` then holds each round's ``secagg`` record.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

try:
    import psutil
except ImportError:
    raise SystemExit("this example needs the [deploy] extra: pip install 'fedspear[deploy]' (psutil)") from None

from fedspear.config import ConfigError, RunConfig, parse_assignments, unknown_keys_error
from fedspear.runtime.model_zoo import TINY_MODEL, ModelError, resolve_model_dir
from fedspear.fl.certs import make_node_keys, make_server_certificates
from fedspear.fl.node_worker import ping
from fedspear.report import epsilon_text
from fedspear.stops import handled_signals

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode, flwr live beside this Python
CONNECTION = "deploy-local"
TAG_VAR = "FEDSPEAR_DEPLOY_TAG"  # set in every process started here, to find strays by PID at the end


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Every process this script starts, each with a log file; ``stop`` ends them and their children by PID."""

    def __init__(self, logs: Path, env: dict[str, str]):
        self.logs, self.env = logs, env
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                cwd=self.logs.parent)
        log.close()
        self.started[name] = proc
        return proc

    def log_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def tagged(self) -> list[psutil.Process]:
        """Live processes carrying this deployment's tag (children started by Flower inherit the environment)."""
        tag = self.env[TAG_VAR]
        found = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def _wait(self, procs, timeout: float) -> bool:
        """Poll (and reap our own children) until none of ``procs`` is alive; False if ``timeout`` s pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for popen in self.started.values():
                popen.poll()
            if not any(_alive(p) for p in procs):
                return True
            time.sleep(0.2)
        return False

    def stop(self, grace: float = 15.0) -> list[int]:
        """SIGTERM to every started process and its descendants (leaves first), SIGKILL after ``grace`` s.

        The tree is collected before anything is signalled (a SuperLink's SuperExec runs in its own session and
        would otherwise be re-parented out of sight); processes with this run's tag are added. Returns the PIDs
        still alive afterwards (empty when all stopped).
        """
        procs: dict[int, psutil.Process] = {}
        for popen in self.started.values():
            try:
                root = psutil.Process(popen.pid)
                for p in [*root.children(recursive=True)[::-1], root]:
                    procs[p.pid] = p
            except psutil.Error:
                pass
        for p in self.tagged():
            procs.setdefault(p.pid, p)
        for p in procs.values():
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        if not self._wait(procs.values(), grace):
            for p in procs.values():
                try:
                    if _alive(p):
                        p.kill()
                except psutil.Error:
                    pass
            self._wait(procs.values(), 5.0)
        return sorted(p.pid for p in self.tagged())


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def flwr(procs: Processes, home: Path, *args: str, timeout: float = 120) -> dict:
    """Run a ``flwr`` CLI command with ``--format json`` against the deployment; its JSON answer.

    Raises:
        RuntimeError: the command failed (its output is in the message).
    """
    out = subprocess.run([str(BIN / "flwr"), *args, "--format", "json"], capture_output=True, text=True,
                         env={**procs.env, "FLWR_HOME": str(home)}, timeout=timeout, cwd=REPO)
    try:
        answer = json.loads(out.stdout)
    except json.JSONDecodeError:
        answer = {}
    if out.returncode != 0 or not answer.get("success"):
        raise RuntimeError(f"flwr {' '.join(args)} failed ({out.returncode}): "
                           f"{out.stdout[-2000:]} {out.stderr[-2000:]}")
    return answer


def stage_app(dest: Path) -> Path:
    """A copy of what ``flwr run`` packages from this checkout (``pyproject.toml``'s ``fab-include``: ``src/``'s code
    and shipped data, README.md; plus ``pyproject.toml`` and ``.gitignore``), so that Flower builds the same app bundle
    without walking the checkout's ``.venv``: ``flwr run`` resolves every file under the app's folder before it
    filters them (``collect_files`` in ``flwr/cli/utils.py``), ≈ 74,000 files and 4–5 s with the virtual environment
    beside ``src/``."""
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(REPO / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", ".gitignore"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def wait_for_port(proc: subprocess.Popen, port: int, what: str, timeout: float = 120) -> None:
    """Until something accepts TCP connections on 127.0.0.1:port. Raises RuntimeError if ``proc`` exits or time
    is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening; see its log")
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def wait_for_worker(proc: subprocess.Popen, address: str, key: Path, timeout: float = 120) -> dict:
    """Until the node worker answers a ping (it has written its key and listens). Raises RuntimeError otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node worker {address} exited with code {proc.returncode}; see its log")
        try:
            return ping(address, key)
        except (ConnectionError, FileNotFoundError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"node worker {address} did not answer within {timeout:.0f} s")


# settings that travel in `flwr run --run-config` (they win over the settings file there): set by these options only
RUN_CONFIG_OPTIONS = {"num_clients": "--nodes", "clients_per_round": "--nodes", "rounds": "--rounds",
                      "rollouts_per_round": "--rollouts-per-round", "eval_size": "--eval-size",
                      "output_dir": "--output-dir"}


def run_settings(args: argparse.Namespace) -> dict:
    """The run's fedspear settings beyond the run config: the options' values, then ``--set``'s, which override them.

    Raises:
        ConfigError: ``--set`` names a run-config setting (``RUN_CONFIG_OPTIONS``: use its option).
    """
    settings = {"model": args.model, "local_steps": args.local_steps, "batch_size": args.batch_size,
                "train_size": args.train_size, "eval_every": 1, "seed": args.seed,
                "round_timeout": float(args.timeout)}
    if args.max_new_tokens:
        settings["max_new_tokens"] = args.max_new_tokens
    if args.dp != "off":
        settings.update(dp=args.dp, dp_noise_multiplier=args.dp_noise_multiplier, dp_clip_norm=args.dp_clip_norm)
    if args.secure_aggregation:
        settings["secure_aggregation"] = "secaggplus"
    unknown = [key for key, _ in args.set if key not in RunConfig.__dataclass_fields__]
    if unknown:
        raise unknown_keys_error(unknown, "--set")
    for key, value in args.set:
        if key in RUN_CONFIG_OPTIONS:
            raise ConfigError(f"--set {key}: set it with {RUN_CONFIG_OPTIONS[key]}")
        settings.update(parse_assignments([f"{key}={value}"]))  # as `fedspear run --set`: a string setting stays one
    return settings


def run_config_values(args: argparse.Namespace) -> dict:
    """The settings ``flwr run --run-config`` carries (every node is sampled every round)."""
    return {"num_clients": args.nodes, "clients_per_round": args.nodes, "rounds": args.rounds,
            "rollouts_per_round": args.rollouts_per_round, "eval_size": args.eval_size}


def write_run_settings(path: Path, settings: dict) -> None:
    """The settings file the ServerApp reads (``config-file`` in the run config); JSON values are TOML values here."""
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))


def key_value(text: str) -> tuple[str, str]:
    """``--set KEY=VALUE`` as (key, value); argparse reports anything else as a usage error."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def read_records(run_dir: Path) -> list[dict]:
    """The rounds in ``metrics.jsonl`` so far (a line still being written is left for the next look)."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


ANSI = re.compile(r"\x1b\[[0-9;]*m")
PEM = re.compile(r"b'-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----\\n'")


def summarise(records: list[dict]) -> list[dict]:
    """Per round: seconds, accuracy, and per node (partition id) the worker pid and model loads in that round."""
    rounds, last_loads = [], {}
    for r in records:
        if r["round"] == 0:
            continue
        nodes = {}
        for c in sorted(r["clients"], key=lambda c: (c.get("partition-id", 1 << 30), c["node_id"])):
            if "error" in c:
                nodes[str(c.get("partition-id", c["node_id"]))] = {"error": c["error"]}
                continue
            pid, worker, loads = c["partition-id"], c["worker_pid"], c["model_loads"]
            before = last_loads.get(pid, (None, 0))
            nodes[str(pid)] = {"worker_pid": worker, "model_loads_total": loads,
                               "model_loads_this_round": loads - before[1] if before[0] == worker else loads,
                               "seconds_load_model": c.get("seconds_load_model", 0.0)}
            last_loads[pid] = (worker, loads)
        rounds.append({"round": r["round"], "seconds": r["seconds"]["round"], "clients_ok": r["clients_ok"],
                       "acc_gen": (r.get("eval") or {}).get("acc_gen"), "nodes": nodes,
                       **({k: r[k] for k in ("dp_epsilon", "dp_releases")} if "dp_releases" in r else {}),
                       **({"secagg": r["secagg"]} if "secagg" in r else {})})
    return rounds


def deploy(args: argparse.Namespace, procs: Processes, out: Path, summary: dict) -> None:
    """Steps 1–7 of the module docstring; fills ``summary`` as it goes. Raises RuntimeError on any failure."""
    certs = out / "certs"
    paths = make_server_certificates(certs)
    nodes = [f"node-{k}" for k in range(args.nodes)]
    keys = {name: make_node_keys(certs, name) for name in (*nodes, "intruder")}
    link_port = free_port()
    link_home, cli_home = out / "superlink", out / "cli"
    for home in (link_home, cli_home):
        home.mkdir(parents=True, exist_ok=True)

    link = procs.start("superlink", [
        str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(paths.ca_cert),
        "--ssl-certfile", str(paths.server_cert),
        "--ssl-keyfile", str(paths.server_key), "--enable-supernode-auth", "--host", "127.0.0.1",
        "--port", str(link_port), "--database", str(link_home / "state.db"),
        "--disable-runtime-dependency-installation"], env={"FLWR_HOME": str(link_home)})
    wait_for_port(link, link_port, "SuperLink")
    (cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{link_port}"\n'
        f'root-certificates = "{paths.ca_cert}"\n')
    summary["superlink"] = f"127.0.0.1:{link_port}"
    summary["registered"] = {name: flwr(procs, cli_home, "supernode", "register", str(keys[name].public_key),
                                        CONNECTION)["node-id"] for name in nodes}
    print(f"SuperLink on 127.0.0.1:{link_port} (TLS, SuperNode auth); registered {summary['registered']}", flush=True)

    # the unregistered SuperNode: same CA, valid key pair, but its public key was never registered; it is refused
    # while the node workers load (its retries are mostly waiting), and checked before the run is submitted
    t0 = time.monotonic()
    intruder = procs.start("intruder", [
        str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{link_port}",
        "--root-certificates", str(paths.ca_cert), "--auth-supernode-private-key", str(keys["intruder"].private_key),
        "--node-config", "partition-id=0", "--host", "127.0.0.1",
        "--port", str(free_port()),
        "--max-retries", "2", "--max-wait-time", "60"], env={"FLWR_HOME": str(out / "intruder")})

    # the nodes share this machine's cores (on real machines each has its own): split them, not oversubscribe
    threads = max(1, (os.cpu_count() or 1) // len(nodes))
    for k, name in enumerate(nodes):
        home = out / name
        home.mkdir(exist_ok=True)
        node_config = f"partition-id={k}"
        if not args.no_worker:
            address, key = f"127.0.0.1:{free_port()}", home / "worker.key"
            worker = procs.start(f"{name}-worker", [sys.executable, "-m", "fedspear.cli", "node-worker",
                                                    "--address", address, "--key-file", str(key)],
                                 env={"OMP_NUM_THREADS": str(threads)})
            wait_for_worker(worker, address, key)
            summary.setdefault("workers", {})[name] = {"address": address, "key": str(key)}
            node_config += f' worker-address="{address}" worker-key="{key}"'
        procs.start(name, [
            str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{link_port}",
            "--root-certificates", str(paths.ca_cert), "--auth-supernode-private-key", str(keys[name].private_key),
            "--node-config", node_config, "--host", "127.0.0.1", "--port", str(free_port())],
            env={"FLWR_HOME": str(home / ".flwr"), "OMP_NUM_THREADS": str(threads)})

    try:
        code = intruder.wait(timeout=180)
    except subprocess.TimeoutExpired:
        code = None
    node_log = ANSI.sub("", procs.log_text("intruder"))
    link_lines = [line for line in ANSI.sub("", procs.log_text("superlink")).splitlines()
                  if "activate-node" in line and ("No SuperNode found" in line or " 412" in line)]
    summary["intruder"] = {
        "exit_code": code, "seconds": round(time.monotonic() - t0, 1),
        "refused": code not in (None, 0) and "Failed to activate SuperNode" in node_log and bool(link_lines),
        "supernode_log": [line for line in node_log.splitlines()
                          if "ERROR" in line or "code:" in line or "Failed" in line],
        "superlink_log": [PEM.sub("<public key>", line) for line in link_lines],
    }
    print(f"unregistered SuperNode: exit code {code}, refused = {summary['intruder']['refused']}", flush=True)
    if not summary["intruder"]["refused"]:
        raise RuntimeError("the unregistered SuperNode was not refused (see logs/intruder.log, logs/superlink.log)")

    run_dir = out / "run"
    settings = out / "run-settings.toml"
    write_run_settings(settings, run_settings(args))
    run_config = " ".join([f'run-dir="{run_dir}"', f'config-file="{settings}"',
                           *(f"{key.replace('_', '-')}={value}" for key, value in run_config_values(args).items())])
    started = time.monotonic()
    app = stage_app(out / "app")
    run_id = int(flwr(procs, cli_home, "run", str(app), CONNECTION, "--run-config", run_config)["run-id"])
    summary["run_id"] = run_id
    print(f"run {run_id} submitted: {run_config}", flush=True)

    status, shown, asked = "", 0, 0.0
    deadline = started + args.timeout
    while time.monotonic() < deadline:
        records = read_records(run_dir)
        for r in records[shown:]:
            print(f"  round {r['round']} done at {time.monotonic() - started:.0f} s "
                  f"({r['seconds'].get('round', r['seconds'].get('evaluate', 0)):.1f} s)", flush=True)
        done = len(records) > args.rounds
        if done or time.monotonic() - asked > 30:  # each `flwr ls` is a Python start-up: ask every 30 s
            status, asked = flwr(procs, cli_home, "ls", "--run-id", str(run_id))["runs"][0]["status"], time.monotonic()
            if status.startswith("finished"):
                break
        shown = len(records)
        for name, proc in procs.started.items():
            if name != "intruder" and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during the run; see logs/{name}.log")
        time.sleep(1)  # reading the records is cheap: a round shows within a second of its end
    summary["run_status"] = status
    summary["run_seconds"] = round(time.monotonic() - started, 1)
    if not status.startswith("finished"):
        raise RuntimeError(f"run {run_id} still '{status}' after {args.timeout} s")
    summary["supernodes"] = {n["node-id"]: n["status"] for n in flwr(procs, cli_home, "supernode", "list")["nodes"]}
    records = read_records(run_dir)
    if status != "finished:completed" and not records:  # nothing to summarise: say why the ServerApp stopped
        details = flwr(procs, cli_home, "ls", "--run-id", str(run_id))["runs"][0].get("status-details") or ""
        raise RuntimeError(f"run {run_id} ended '{status}' before round 0 was recorded: {details} (see "
                           "logs/superlink.log and `flwr log`)")
    summary["rounds"] = summarise(records)
    summary["round0_seconds"] = records[0]["seconds"].get("evaluate")
    if not args.no_worker:
        summary["worker_loads"] = {name: ping(w["address"], w["key"]) for name, w in summary["workers"].items()}
    if status != "finished:completed" or len(summary["rounds"]) != args.rounds:
        raise RuntimeError(f"run {run_id} ended '{status}' with {len(summary['rounds'])} of {args.rounds} rounds "
                           "(see logs/superlink.log and `flwr log`)")


STOP = {"signum": None}


def _interrupted(signum, frame) -> None:
    """SIGINT / SIGTERM / SIGHUP: the first raises KeyboardInterrupt where the script is; later ones are only noted,
    so that stopping what was started is not itself interrupted."""
    if STOP["signum"] is None:
        STOP["signum"] = signum
        raise KeyboardInterrupt


def stop_line(signum: int, out: Path, rounds: int) -> str:
    """The one line the script ends with after a signal: where the run stopped (its last recorded round)."""
    records = read_records(out / "run")
    where = (f"after round {records[-1]['round']} of {rounds} ({out / 'run'} keeps rounds 0–{records[-1]['round']})"
             if records else "before round 0 was recorded")
    return (f"stopped by {signal.Signals(signum).name} {where}; every process it started is stopped; the example "
            f"starts a new deployment each time: run it again with another --output-dir")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/deploy-local", help="certificates, logs, run directory")
    parser.add_argument("--model", default="smollm2-135m", help="packaged name, local HF folder or hub id")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rollouts-per-round", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0 = the task's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the run may take once submitted")
    parser.add_argument("--no-worker", action="store_true", help="no node workers: each ClientApp loads the model")
    parser.add_argument("--dp", choices=["off", "client", "server"], default="off",
                        help="central DP: client = each node clips its update (Flower's fixedclipping_mod), "
                             "server = the ServerApp clips; Gaussian noise on the average either way")
    parser.add_argument("--dp-noise-multiplier", type=float, default=1.0, help="DP noise multiplier z")
    parser.add_argument("--dp-clip-norm", type=float, default=1.0, help="DP clipping norm C")
    parser.add_argument("--secure-aggregation", action="store_true",
                        help="Flower's SecAgg+: the server sees only the masked sum of the updates (needs ≥ 3 nodes)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="registered SuperNodes, each a client sampled every round (default 2; 3 with "
                             "--secure-aggregation)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="any other run setting (as `fedspear run --set`), e.g. user_flip_prob=0.2; repeatable")
    args = parser.parse_args()

    args.nodes = args.nodes if args.nodes is not None else (3 if args.secure_aggregation else 2)
    try:  # bad settings stop here, before any process starts: the ServerApp's own merge (run config wins)
        if args.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1, got {args.nodes}")
        if not args.timeout > 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
        RunConfig(**{**run_settings(args), **run_config_values(args)})
        if args.model != TINY_MODEL:  # an unknown model: said here, not by every node's ClientApp after the start
            resolve_model_dir(args.model)
    except (TypeError, ConfigError, ModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.output_dir).expanduser().resolve()
    if (out / "run" / "metrics.jsonl").exists():
        print(f"error: {out} already holds a run; remove it or choose another --output-dir", file=sys.stderr)
        return 2
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"error: --output-dir {out}: {err.strerror or err}", file=sys.stderr)
        return 2
    env = {**os.environ, TAG_VAR: uuid.uuid4().hex, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONUNBUFFERED": "1",
           # each SuperExec (the SuperLink's, for the ServerApp, and every SuperNode's, for each message's ClientApp)
           # asks for new work every 0.2 s instead of Flower's 1 s (flwr/supercore/superexec/run_superexec.py)
           "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2"),
           # Flower starts flower-superexec / flwr-serverapp / flwr-clientapp from PATH
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
           # every process imports the same fedspear as this script (a source checkout works too)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__import__("fedspear").__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    procs = Processes(out / "logs", env)
    summary: dict = {"output_dir": str(out), "worker": not args.no_worker, "rounds_wanted": args.rounds}
    ok = False
    for signum in handled_signals():  # Ctrl-C, `kill <pid>`, a closed terminal: everything started is stopped
        signal.signal(signum, _interrupted)
    try:
        deploy(args, procs, out, summary)
        ok = True
    except KeyboardInterrupt:
        STOP["signum"] = STOP["signum"] or signal.SIGINT
        summary["error"] = f"interrupted by {signal.Signals(STOP['signum']).name}"
    except Exception as err:  # noqa: BLE001 - reported, then everything is stopped
        summary["error"] = f"{type(err).__name__}: {err}"
    finally:
        summary["pids_started"] = {name: p.pid for name, p in procs.started.items()}
        try:  # after a signal the processes get 3 s to end (SIGKILL then): all is over within 10 s
            summary["leftover_pids"] = procs.stop(grace=3.0 if STOP["signum"] else 15.0)
        except Exception as err:  # noqa: BLE001 - still write what we know
            summary["leftover_pids"], summary["stop_error"] = None, f"{type(err).__name__}: {err}"
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        print_summary(summary)
        if STOP["signum"]:
            print(stop_line(STOP["signum"], out, args.rounds), file=sys.stderr, flush=True)
    except OSError:  # the terminal is gone (SIGHUP after it closed): summary.json holds what it would say
        if not STOP["signum"]:
            raise
    if STOP["signum"]:
        return 128 + STOP["signum"]
    return 0 if ok and summary["leftover_pids"] == [] else 1


def print_summary(s: dict) -> None:
    print(f"\nsummary ({s['output_dir']}/summary.json)")
    if "error" in s:
        print(f"  FAILED: {s['error']}")
    for r in s.get("rounds", []):
        loads = ", ".join(f"node {k}: {v.get('model_loads_this_round', v.get('error'))}" for k, v in r["nodes"].items())
        eps = f", ε {epsilon_text(r)}" if "dp_releases" in r else ""
        secure = (f", SecAgg+ {r['secagg']['uploaded']} of {r['secagg']['sampled']} in the mean "
                  f"(t = {r['secagg']['threshold']})" if "secagg" in r else "")
        print(f"  round {r['round']}: {r['seconds']:.1f} s, accuracy {r['acc_gen']}{eps}{secure}, "
              f"model loads this round: {loads}")
    if "worker_loads" in s:
        print(f"  node workers at the end: {s['worker_loads']}")
    if "intruder" in s:
        print(f"  unregistered SuperNode refused: {s['intruder']['refused']} (exit code {s['intruder']['exit_code']})")
    print(f"  processes left running: {s['leftover_pids'] or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
