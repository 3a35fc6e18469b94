"""Run a fedspear federation on Flower's simulation engine, on this machine only (127.0.0.1).

On the CPU one Ray actor holds one base model and plays every simulated client in turn (``client-resources.num-cpus``
equals the CPUs Ray may use, so exactly one actor fits); on a GPU, ``client_gpus`` sets how many actors share it
(``backend_config``). The ServerApp runs in this process and does the central
evaluation. Flower and Ray keep their state under ``<output_dir>/.flwr`` and ``/tmp/ray``; telemetry, update checks
and runtime dependency installation are off. SIGINT, SIGTERM and SIGHUP stop the run cleanly (``start_ray``,
``stop_ray_workers``, ``fedspear.stops``).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

from fedspear.config import RunConfig
from fedspear import progress, stops
from fedspear.progress import ENV as PROGRESS_ENV
from fedspear.answers import TRACE_ENV


def flower_environment(run_dir: str | Path) -> None:
    """Set the environment Flower and Ray read: state inside the run directory, no telemetry, loopback only."""
    flwr_home = Path(run_dir).resolve() / ".flwr"
    flwr_home.mkdir(parents=True, exist_ok=True)
    os.environ["FLWR_HOME"] = str(flwr_home)
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    # the simulated clients (Ray actor) and the ServerApp say where they are in each round (``fedspear.progress``)
    os.environ[PROGRESS_ENV] = str(Path(run_dir).resolve() / "progress")
    # ... and the simulated clients keep their training traces in it (``fedspear.answers``)
    os.environ[TRACE_ENV] = str(Path(run_dir).resolve() / "traces")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray picks the machine's outward address for its workers unless told it is not a cluster node; with this
    # (read when ray is imported) every Ray process binds and talks to 127.0.0.1 only.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # the worker process must find fedspear even when it runs from a source checkout
    src = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join([src, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def start_ray(backend_config: dict) -> None:
    """Start Ray as Flower's engine would (its own ``RayBackend``, whose ``init_ray`` the engine then skips), so that
    the SIGTERM handler ``ray.init`` installs (``sys.exit``; its node's kills Ray's processes and exits with 1) is
    replaced by fedspear's before the rounds begin (``fedspear.stops``), and Ray's processes are recorded to be
    ended with the command."""
    import copy

    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    before = stops.children()
    try:
        RayBackend(copy.deepcopy(backend_config))
    finally:  # also when its start was cut short: whatever Ray started is ended with the command
        stops.reinstall()
        stops.remember_children(besides=before)


def stop_ray_workers() -> None:
    """At a stop: after SIGTERM or SIGHUP, end the run at once (``stops.end_now``: the process tree killed, the stop
    line, exit 143 or 129); after SIGINT, SIGTERM to Ray's worker processes (the client actor,
    ``ray::ClientAppActor``; idle workers), so the engine's threads waiting on them return and Flower winds down
    (``RayBackend.terminate``, ``ray.shutdown``). Ray's own services are then left to ``ray.shutdown``; a watcher
    thread ends the run at once (what the stop's deadline would do later) when, 1.5 s on, they are gone or a
    terminated worker sits idle (the comments below say why). The engine's error logs about the stopped workers are
    silenced."""
    import signal
    import threading

    import psutil

    # SIGTERM or SIGHUP sent to the process group reaches Ray's raylet and GCS too (they block only SIGINT), and they
    # shut down. Once its node is gone, Ray's core in this process tries to recover the objects this process put in
    # the node's object store, finds the store's socket closed and ends the process with status 1, no stop line:
    # ≈ 0.1 s after the raylet took the signal (seen once in CI, 2026-12-06: "The connection to the plasma store is
    # failed. Terminate the process." in Ray's python-core-driver-<pid>.log). Nothing would wind down anyway (below),
    # and a SIGTERM to this process alone cannot be told apart, so both end now; the rounds recorded so far are kept
    # (written atomically), as at the deadline.
    if stops.stop_signal() in (signal.SIGTERM, signal.SIGHUP):
        stops.end_now()
    logging.getLogger("flwr").setLevel(logging.CRITICAL)
    workers = []
    for proc in psutil.Process().children(recursive=True):
        try:
            title = (proc.cmdline() or [""])[0]
            if title.startswith("ray::") and not title.endswith("Agent"):
                proc.terminate()
                workers.append(proc)
        except psutil.Error:
            continue
    # The engine cannot wind down without Ray's services, nor while a worker given SIGTERM sleeps instead of exiting
    # (both seen when SIGTERM and SIGHUP took this path: a SIGHUP to the group ended the raylet and GCS; a SIGTERM
    # started their own shutdown, during which the actor, raylet and GCS were all still there 5.6 s later, Ray 2.55 on
    # 2 cores). So 1.5 s on, either sign ends the run at once, as the deadline would: a service gone (also where
    # ray.shutdown ended it: the run is ending then anyway), or a terminated worker alive and idle (< 0.2 s of CPU in
    # those 1.5 s). A worker still computing is left alone: Ray's SIGTERM handler runs once its thread is back in
    # Python (a backward pass on the CPU can take seconds), and the stop's deadline still bounds the wait.
    services = [p for p in stops.remembered() if _name(p) in ("raylet", "gcs_server")]
    started = {w.pid: _cpu_seconds(w) for w in workers}

    def watch() -> None:
        gone, _ = psutil.wait_procs(services, timeout=1.5)
        idle = [w for w in workers if stops.alive(w) and _cpu_seconds(w) - started[w.pid] < 0.2]
        if gone or idle:
            stops.end_now()

    if services:
        threading.Thread(target=watch, name="fedspear-ray-watch", daemon=True).start()


def _cpu_seconds(proc) -> float:
    """CPU seconds ``proc`` has used (user + system); 0 where it cannot be read (gone)."""
    try:
        times = proc.cpu_times()
        return times.user + times.system
    except Exception:  # noqa: BLE001 - psutil.Error: gone or not ours to read
        return 0.0


def _name(proc) -> str:
    try:
        return proc.name()
    except Exception:  # noqa: BLE001 - psutil.Error: gone or not ours to read
        return ""


def backend_config(cfg: RunConfig, cpus: int, gpus: int, verbose: bool = False) -> dict:
    """Flower's simulation ``backend_config`` for ``cfg`` on a machine where Ray may use ``cpus`` CPUs and ``gpus``
    GPUs (0 on a CPU run).

    Flower builds as many client actors (each a process holding one model) as the resources allow:
    ``min(num_cpus / client num_cpus, num_gpus / client num_gpus)`` (``flwr/simulation/ray_transport/ray_actor.py``,
    ``pool_size_from_resources``). On the CPU one actor takes every CPU, so the simulated clients take turns in it.
    On a GPU each actor asks for ``client_gpus`` of one (Ray hides every GPU from an actor that asks for none), so
    ``gpus · ⌊1 / client_gpus⌋`` clients of a round run side by side, each with its own copy of the model; Ray's
    CPUs are then counted as at least one per actor (Ray's CPU count is for placing actors; it also sets an actor's
    ``OMP_NUM_THREADS`` to its share, which bounds torch's CPU threads there, not the GPU's work).
    ``client_gpus = 1`` is one actor per GPU, taking turns.
    """
    if gpus:
        actors = gpus * int(1 / cfg.client_gpus + 1e-9)  # ⌊1 / share⌋ per GPU; 1e-9: 1 / 0.2 is 5, not 4.99…
        ray_cpus = max(cpus, actors)
        client = {"num_cpus": ray_cpus // actors, "num_gpus": cfg.client_gpus}
    else:
        ray_cpus = cpus
        client = {"num_cpus": cpus, "num_gpus": 0.0}
    return {
        "client_resources": client,
        "init_args": {
            "num_cpus": ray_cpus,
            "num_gpus": gpus,
            "_node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "logging_level": logging.INFO if verbose else logging.WARNING,
            "log_to_driver": verbose,
        },
    }


def simulate(cfg: RunConfig, on_round: Callable[[dict], None] | None = None, verbose: bool = False) -> None:
    """Run (or resume) ``cfg`` on the simulation engine; the run directory receives every output.

    Raises:
        RuntimeError: the ServerApp failed (its error is logged by Flower; the run directory keeps the completed
        rounds, and re-running resumes).
        fedspear.stops.Stopped: SIGINT, SIGTERM or SIGHUP under ``fedspear.stops.Stops`` (nothing is recorded after
        it; the round in flight is redone on resume).
    """
    flower_environment(cfg.output_dir)
    shutil.rmtree(Path(cfg.output_dir) / "progress", ignore_errors=True)  # a previous invocation's last state
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    import torch

    from fedspear.fl.client_app import app as client_app  # serves SecAgg+'s stages too (fedspear.fl.secagg)
    from fedspear.fl.server_app import run_server
    from fedspear.runtime.model import resolve_device

    outcome: dict[str, object] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            outcome["records"] = run_server(stops.StoppableGrid(grid), cfg, on_round=on_round)
        except stops.Stopped as err:  # ends the ServerApp as a finished one does: Flower's engine winds down
            outcome["error"] = err
        except BaseException as err:  # surfaced to the caller below, after Flower shuts down cleanly
            outcome["error"] = err
            raise

    flwr_logger = logging.getLogger("flwr")
    flwr_logger.propagate = False  # Flower prints through its own handler
    if not verbose:
        flwr_logger.setLevel(logging.ERROR)
    cpus = max(1, min(2, os.cpu_count() or 1))
    gpus = torch.cuda.device_count() if resolve_device(cfg.device) == "cuda" else 0
    backend = backend_config(cfg, cpus, gpus, verbose)
    from fedspear.runtime import memory

    memory.watch_tree()  # the peak over this process and Ray's, recorded per round by the ServerApp
    try:
        # cooperative from Ray's start on: a signal raises nothing inside ray.init (whose fork hooks would swallow
        # it), the start completes and the stop is taken right after it
        with stops.cooperative(on_stop=stop_ray_workers):
            start_ray(backend)
            stops.check()
            run_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.num_clients,
                           backend_config=backend, verbose_logging=verbose)
    finally:  # later work in this process (another run, a benchmark) records no progress into this run's folder
        os.environ.pop(PROGRESS_ENV, None)
        os.environ.pop(TRACE_ENV, None)
        progress.stop()
        memory.unwatch_tree()
        # Flower's engine shuts Ray down, but not when the run failed or stopped before the engine began (Ray's
        # start cut short after ray.init included); Ray is not imported just to ask
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        memory.release_memory(full=True)  # the run's server-side models, frozen by its rounds' releases
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    if "records" not in outcome:
        raise RuntimeError("the Flower simulation ended before the ServerApp finished (see the log above)")
