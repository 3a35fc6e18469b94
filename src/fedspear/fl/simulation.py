"""Run a fedspear federation on Flower's simulation engine, on this machine only (127.0.0.1).

One Ray actor holds one base model and plays every simulated client in turn (``client-resources.num-cpus`` equals
the CPUs Ray may use, so exactly one actor fits); the ServerApp runs in this process and does the central
evaluation. Flower and Ray keep their state under ``<output_dir>/.flwr`` and ``/tmp/ray``; telemetry, update checks
and runtime dependency installation are off.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from fedspear.config import RunConfig
from fedspear import progress
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


def simulate(cfg: RunConfig, on_round: Callable[[dict], None] | None = None, verbose: bool = False) -> None:
    """Run (or resume) ``cfg`` on the simulation engine; the run directory receives every output.

    Raises:
        RuntimeError: the ServerApp failed (its error is logged by Flower; the run directory keeps the completed
        rounds, and re-running resumes).
    """
    flower_environment(cfg.output_dir)
    shutil.rmtree(Path(cfg.output_dir) / "progress", ignore_errors=True)  # a previous invocation's last state
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    import torch

    from fedspear.fl.client_app import app as client_app
    from fedspear.fl.server_app import run_server
    from fedspear.runtime.model import resolve_device

    outcome: dict[str, object] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            outcome["records"] = run_server(grid, cfg, on_round=on_round)
        except BaseException as err:  # surfaced to the caller below, after Flower shuts down cleanly
            outcome["error"] = err
            raise

    flwr_logger = logging.getLogger("flwr")
    flwr_logger.propagate = False  # Flower prints through its own handler
    if not verbose:
        flwr_logger.setLevel(logging.ERROR)
    cpus = max(1, min(2, os.cpu_count() or 1))
    # Ray hides every GPU from an actor that asks for none (CUDA_VISIBLE_DEVICES=""): on a CUDA run the client actor
    # asks for one whole GPU, so clients take turns on it as they do on the CPU cores
    gpus = torch.cuda.device_count() if resolve_device(cfg.device) == "cuda" else 0
    backend_config = {
        "client_resources": {"num_cpus": cpus, "num_gpus": 1.0 if gpus else 0.0},
        "init_args": {
            "num_cpus": cpus,
            "num_gpus": gpus,
            "_node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "logging_level": logging.INFO if verbose else logging.WARNING,
            "log_to_driver": verbose,
        },
    }
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.num_clients,
                       backend_config=backend_config, verbose_logging=verbose)
    finally:  # later work in this process (another run, a benchmark) records no progress into this run's folder
        os.environ.pop(PROGRESS_ENV, None)
        progress.stop()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    if "records" not in outcome:
        raise RuntimeError("the Flower simulation ended before the ServerApp finished (see the log above)")
