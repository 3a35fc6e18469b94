"""``fedspear compare``: a grid of runs (algorithms × seeds × any settings), fairly matched, resumable, summarised in
the layout of the paper's Table 1 with the plots of its Figures 2–5.

Every cell is an ordinary ``fedspear run`` (its own run directory under ``<output>/cells/<name>``, run in a child
process so each cell starts its own Flower simulation) that differs from the others only in the grid's axes. Cells
with the same task, seed and axes therefore see the identical data partition, client sampling and prompt streams
(all derived from the seed). A cell whose run directory already holds every round is skipped; an interrupted one
resumes after its last completed round (``fedspear run``'s own resume). The round-0 evaluation — the base model on
the fixed held-out subset — is computed once per task and reused by the other cells (``round0_from``; checked, see
:func:`fedspear.fl.server_app.reused_round0`), also from a finished cell copied in without its adapters (a committed
result: ``config.toml`` and a ``metrics.jsonl`` whose round 0 recorded ``start_identity``; ``RunDir.serves_round0``).

A grid row may be an algorithm variant (``VARIANTS``: ``opsd_authors`` is OPSD with ``opsd_variant = "authors"``),
so both OPSD formulations sit in one table.

Outputs in ``<output>``: ``grid.toml`` (the grid; a re-run with another grid is refused, except one that only adds seeds
or algorithms to it: the finished cells stay and the new ones run; ``--summary-only`` summarises only the grid saved
there, ``summary.check_summarisable``), ``cells/``, ``comparison.md`` and ``plots/`` (accuracy vs round, cumulative
wall-clock per algorithm as in the paper's Fig. 2, successful revisions and samples needing revision per round as in
Figs. 3–5), ``comparison.json`` (every figure in the table). Every cell keeps its answers: the evaluation's per item
(``answers/``) and, unless the grid's base sets ``keep_traces``, its clients' training traces (``traces/``;
``fedspear.answers``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ... import stops
from ...algorithms import ALGORITHMS
from ...config import ConfigError, RunConfig, load_config, parse_assignments, read_toml, snake_key, unknown_keys_error
from ...paper_settings import PRESETS as RUN_PRESETS
from ...paper_settings import preset_settings
from ...rundir import LEGACY_DEFAULTS, RunDir
from ...runtime.model import resolve_device, resolve_dtype

PARTITIONER_DEFAULT = RunConfig.__dataclass_fields__["partitioner"].default

# the settings the paper's ablations and robustness studies vary (SPEC §5, issue "compare"); "centralized" is
# shorthand for one client holding all the data
AXES = ("mu", "tau", "lambda_l", "max_revisions", "strategy", "num_clients", "dirichlet_alpha", "last_layers",
        "centralized", "user_flip_prob", "user_irrelevant_prob", "dp", "dp_noise_multiplier", "dp_clip_norm",
        "update_encoding", "revised_wins")

NAMES = {"spear": "SPEAR", "feedback_sft": "Feedback SFT", "grpo": "GRPO", "opsd": "OPSD", "rltf_sd": "RLTF-SD",
         "opsd_authors": "OPSD (authors)"}
#: Grid rows that run an algorithm with fixed settings: row name → (algorithm, settings). ``opsd_authors``: the SPEAR
#: authors' OPSD (forward KL, T 2, current-model teacher; ``fedspear.algorithms.opsd``) beside the original.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"opsd_authors": ("opsd", {"opsd_variant": "authors"})}
ROWS = (*ALGORITHMS, *VARIANTS)


@dataclass
class Grid:
    """A comparison grid.

    Attributes:
        tasks: benchmarks (one table column each).
        algorithms: client algorithms (``fedspear.algorithms``) or variants of them (``VARIANTS``), one table row
            each.
        seeds: seeds every cell is repeated with (mean ± std over them).
        axes: other settings to vary, ``{key: [values]}`` with keys from ``AXES``.
        base: settings every cell shares (any ``RunConfig`` key; ``task``/``algorithm``/``seed``/``output_dir``
            are set per cell).
        per_task: settings for one task's cells only, ``{task: {key: value}}`` (applied after ``base``).
        settings: ``"paper"`` gives each cell the paper's appendix-table values for its task and algorithm
            (``fedspear.paper_settings``) under ``base`` and ``per_task``; ``""`` (default) none.
        note: free text printed at the top of comparison.md (a preset's rationale).
    """

    tasks: list[str]
    algorithms: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    seeds: list[int] = field(default_factory=lambda: [0])
    axes: dict[str, list[Any]] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)
    per_task: dict[str, dict[str, Any]] = field(default_factory=dict)
    settings: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        self._check_types()
        if not self.tasks:
            raise ConfigError("grid: tasks is empty")
        for name in self.algorithms:
            if name not in ROWS:
                raise ConfigError(f"grid: unknown algorithm {name!r}; choose from {', '.join(ROWS)}")
        if not self.algorithms or not self.seeds:
            raise ConfigError("grid: algorithms and seeds must not be empty")
        for key, values in self.axes.items():
            if key not in AXES:
                raise ConfigError(f"grid: {key!r} cannot be an axis; choose from {', '.join(AXES)}")
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid: axis {key} needs a non-empty list of values, got {values!r}")
        # a repeat names the same cell twice: it would run once and count twice in comparison.md's means
        for key, values in (("tasks", self.tasks), ("algorithms", self.algorithms), ("seeds", self.seeds),
                            *((f"axis {k}", v) for k, v in self.axes.items())):
            repeated = [v for i, v in enumerate(values) if v in values[:i]]
            if repeated:
                raise ConfigError(f"grid: {key} repeats {repeated[0]}; give each once")
        for where, values in [("base", self.base), *((f"per_task.{t}", v) for t, v in self.per_task.items())]:
            unknown = sorted(set(values) - set(RunConfig.__dataclass_fields__))
            if unknown:
                raise unknown_keys_error(unknown, f"grid {where}")
            reserved = {"task", "algorithm", "seed", "output_dir"} & set(values)
            if reserved:
                raise ConfigError(f"grid: {where} may not set {', '.join(sorted(reserved))} (the grid sets them per "
                                  f"cell)")
        if self.settings not in ("", *RUN_PRESETS):
            raise ConfigError(f"grid: settings must be one of {', '.join(RUN_PRESETS)} (got {self.settings!r})")
        unknown = set(self.per_task) - set(self.tasks)
        if unknown:
            raise ConfigError(f"grid: per_task names task(s) not in tasks: {', '.join(sorted(unknown))}")
        for cell in self.cells(Path("check")):  # every cell must be a valid run config
            cell.config

    def _check_types(self) -> None:
        """Each key's type, so a grid file's ``tasks = "arc_challenge"`` is refused by name, not read letter by letter.

        Raises:
            ConfigError: naming the key and the type it needs.
        """
        def is_list(value, kind) -> bool:
            return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)

        for key, value, ok, wanted in (
                ("tasks", self.tasks, is_list(self.tasks, str), "a list of task names"),
                ("algorithms", self.algorithms, is_list(self.algorithms, str), "a list of algorithm names"),
                ("seeds", self.seeds, is_list(self.seeds, int), "a list of integers"),
                ("axes", self.axes, isinstance(self.axes, dict), "a table {key = [values]}"),
                ("base", self.base, isinstance(self.base, dict), "a table of run settings"),
                ("per_task", self.per_task, isinstance(self.per_task, dict)
                 and all(isinstance(v, dict) for v in self.per_task.values()), "a table {task = {settings}}"),
                ("settings", self.settings, isinstance(self.settings, str), "a string"),
                ("note", self.note, isinstance(self.note, str), "a string")):
            if not ok:
                raise ConfigError(f"grid: {key} must be {wanted}, got {value!r}")

    def cells(self, root: Path) -> list["Cell"]:
        keys = list(self.axes)
        out = []
        # seed-major within a task and variant: a grid stopped part-way has every algorithm for the first seeds
        for task, values, seed, algorithm in itertools.product(
            self.tasks, itertools.product(*(self.axes[k] for k in keys)), self.seeds, self.algorithms
        ):
            preset = preset_settings(self.settings, task, algorithm_of(algorithm)) if self.settings else {}
            out.append(Cell(root, task, algorithm, seed, dict(zip(keys, values)),
                            {**preset, **self.base, **self.per_task.get(task, {})}))
        return out

    def overridden(self, *, tasks: str | None = None, algorithms: str | None = None, seeds: str | None = None,
                   vary: list[str] = (), settings: list[str] = ()) -> "Grid":
        """This grid with ``fedspear compare``'s command-line overrides: comma-separated ``tasks`` /
        ``algorithms`` / ``seeds`` replace the grid's, each ``vary`` item (``key=v1,v2``) adds or replaces an axis,
        each ``settings`` item (``key=value``) joins ``base``.

        ``None`` leaves the grid's list; a given one that names nothing (``--seeds ''``) is refused, not read as
        absent.

        Raises:
            ConfigError: a list names nothing, a seed is not an integer, an item lacks ``=``, or the result is not a
                valid grid (a repeated seed, task or algorithm among them).
        """
        changes: dict[str, Any] = {}
        for option, text, what in (("tasks", tasks, "task"), ("algorithms", algorithms, "algorithm"),
                                   ("seeds", seeds, "seed")):
            if text is None:
                continue
            items = [t.strip() for t in text.split(",") if t.strip()]
            if not items:
                raise ConfigError(f"--{option}: {text!r} names no {what}; give comma-separated {option} or leave "
                                  f"the option out for the grid's")
            changes[option] = items
        if "seeds" in changes:
            try:
                changes["seeds"] = [int(s) for s in changes["seeds"]]
            except ValueError:
                raise ConfigError(f"--seeds expects integers, got {seeds!r}") from None
        axes = dict(self.axes)
        for item in vary:
            if "=" not in item:
                raise ConfigError(f"--vary expects key=v1,v2, got {item!r}")
            key, raw = item.split("=", 1)
            axes[snake_key(key)] = [parse_assignments([f"v={v}"])["v"] for v in raw.split(",")]
        base = {**self.base, **parse_assignments(list(settings))}
        return Grid(**{**self.to_dict(), "settings": self.settings, **changes, "axes": axes, "base": base})

    def to_dict(self) -> dict[str, Any]:
        out = {"tasks": self.tasks, "algorithms": self.algorithms, "seeds": self.seeds, "axes": self.axes,
               "base": self.base, "per_task": self.per_task, "note": self.note}
        if self.settings:  # only when set, so grid.toml files written before the key still match
            out["settings"] = self.settings
        return out


def algorithm_of(row: str) -> str:
    """The ``RunConfig.algorithm`` a grid row runs (``row`` itself unless it is one of ``VARIANTS``)."""
    return VARIANTS[row][0] if row in VARIANTS else row


@dataclass
class Cell:
    root: Path
    task: str
    algorithm: str
    seed: int
    axes: dict[str, Any]
    base: dict[str, Any]

    @property
    def variant(self) -> str:
        """The axes part of the name (``""`` without axes)."""
        return ",".join(f"{k}={v}" for k, v in self.axes.items())

    @property
    def name(self) -> str:
        extra = "".join(f"-{k}={v}" for k, v in self.axes.items())
        return f"{self.task}-{self.algorithm}{extra}-s{self.seed}"

    @property
    def path(self) -> Path:
        return self.root / "cells" / self.name

    @property
    def config(self) -> RunConfig:
        values = {"keep_traces": "on", **self.base}  # a cell keeps its clients' traces unless the grid says not
        axes = dict(self.axes)
        if axes.pop("centralized", False):
            values.update(num_clients=1, clients_per_round=1)
        values.update(axes)
        algorithm, fixed = VARIANTS.get(self.algorithm, (self.algorithm, {}))
        values.update(fixed)
        values.update(task=self.task, algorithm=algorithm, seed=self.seed, output_dir=str(self.path))
        try:
            return RunConfig(**values)
        except ConfigError as err:
            raise ConfigError(f"grid cell {self.name}: {err}") from None

    def last_round(self) -> int | None:
        """The last round this cell's metrics.jsonl records (0 = initial evaluation), None before any."""
        return RunDir(self.path).last_round() if (self.path / "metrics.jsonl").exists() else None

    def done(self) -> bool:
        last = self.last_round()
        return last is not None and last >= self.config.rounds


# ---- presets ----------------------------------------------------------------------------------------------------
PRESETS: dict[str, Grid] = {}


def _preset(name: str, grid: Grid) -> None:
    PRESETS[name] = grid


_preset("cpu-small", Grid(
    tasks=["arc_challenge", "strategy_qa"],
    algorithms=list(ALGORITHMS),
    seeds=[0, 1, 2],
    base=dict(rounds=2, num_clients=10, clients_per_round=2, rollouts_per_round=4, max_revisions=1,
              local_steps=2, batch_size=4, lr=2e-4, eval_size=100, eval_every=2, partitioner="dirichlet"),
    per_task={"strategy_qa": dict(max_new_tokens=64)},
    note=("Sized so all five algorithms × 3 seeds × 2 tasks (30 cells) finish in well under 2.5 h on a 2-core CPU "
          "with the packaged SmolLM2-135M-Instruct: 2 rounds × 2 of 10 clients × 4 prompts per client-round, one "
          "revision, 2 local steps of batch 4 (GRPO / RLTF-SD: G = N = 4 on ARC, 2 on StrategyQA, as in the paper's "
          "tables), 16 new tokens per attempt on ARC and 64 on StrategyQA (its default, 256, would take four times "
          "the tokens), "
          "evaluation on a fixed 100-item test subset at rounds 0 and 2. Far below the paper's budget (100 rounds, "
          "50 clients): it compares the algorithms' cost and first steps, not their converged accuracy."),
))

_preset("cpu-qwen1.5b", Grid(
    tasks=["arc_challenge"],
    algorithms=list(ALGORITHMS),
    seeds=[0, 1, 2],  # seed 2 added by issue 17, which extended the grid of seeds 0–1 (docs/results/cpu-qwen1.5b)
    base=dict(model="qwen2.5-coder-1.5b", rounds=10, num_clients=10, clients_per_round=2, rollouts_per_round=4,
              max_revisions=1, local_steps=2, batch_size=4, lr=2e-4, eval_size=0, eval_gen_size=100,
              eval_every=10, partitioner="dirichlet"),
    note=("Fidelity run on a model that can move (issue 7): the opt-in Qwen2.5-Coder-1.5B-Instruct (`fedspear models "
          "install qwen2.5-coder-1.5b`), ARC-Challenge, all five algorithms × 3 seeds (15 cells), sized for a few "
          "hours of a 2-core CPU (measured per client-round: SPEAR ≈ 26 s, GRPO ≈ 34 s, RLTF-SD ≈ 140 s). "
          "Log-likelihood accuracy on the whole ARC-Challenge test split (1,172 questions, one forward each, "
          "≈ 7 min) at round 0 (computed once, reused by every cell) and after the last round; generation accuracy "
          "on a fixed 100-question subset. Training: 10 rounds × 2 of 10 clients × 4 prompts per client-round, one "
          "revision, 2 local steps of batch 4 with gradient checkpointing (on by default above 1B parameters). "
          "That is 80 prompts and 40 client optimiser steps per run — about a hundredth of the paper's budget "
          "(100 rounds × 3 of 50 clients), so it measures first steps, not converged accuracy."),
))

_preset("cpu-qwen1.5b-sqa", Grid(
    tasks=["strategy_qa"],
    algorithms=["spear", "feedback_sft", "grpo", "opsd", "opsd_authors", "rltf_sd"],
    seeds=[0, 1, 2],
    base=dict(model="qwen2.5-coder-1.5b", rounds=4, num_clients=10, clients_per_round=2, rollouts_per_round=4,
              max_revisions=2, local_steps=2, batch_size=4, lr=1e-4, lr_min=5e-5, tau=24, temperature=0.8,
              max_new_tokens=256, eval_size=500, eval_every=4, eval_batch_size=64,
              partitioner="inner_dirichlet"),
    note=("Does SPEAR's margin grow on a reasoning task (issue 17)? StrategyQA on the opt-in Qwen2.5-Coder-1.5B-"
          "Instruct, SPEAR, Feedback SFT, GRPO, OPSD (original and the SPEAR authors' variant) and RLTF-SD × 3 seeds "
          "(18 cells). The paper's StrategyQA settings where a 2-core CPU allows them: N = 2 revisions, lr 1e-4 → "
          "5e-5, τ = 24, temperature 0.8, 256 new tokens (the authors' budget), GRPO/RLTF-SD G = 2 and β 0.1 from "
          "the tables; scaled down: 10 clients (Dirichlet α = 1, equal sizes), 4 rounds × 2 clients × 4 prompts, "
          "2 local steps of batch 4. Measured on a Zen 4 with AVX-512 BF16 (seconds per round, 2 clients): SPEAR "
          "≈ 410, Feedback SFT ≈ 265, GRPO ≈ 505 (see docs/results/cpu-qwen1.5b-sqa). Evaluation: greedy generation "
          "on a fixed 500-item subset of the 687 test questions (95% interval ≈ ±4.4 points), at round 0 (shared) "
          "and after round 4, batch 64 (≈ 28 min for the base model's long answers here); per-item outcomes, "
          "parse and cut-off rates per cell."),
))

_preset("paper", Grid(
    tasks=["math_mcqa", "arc_challenge", "strategy_qa", "hellaswag"],
    algorithms=list(ALGORITHMS),
    seeds=[0, 1, 2],
    settings="paper",
    note=("The paper's own settings (appendix tables, Qwen2.5-1.5B; fedspear.paper_settings): 50 clients, "
          "Dirichlet α = 1, 50–100 rounds of 3–5 clients, each algorithm's learning rate, batch × accumulation, "
          "τ, G and β per task, 3 seeds. Pass the model with --set model=… . Sized for GPUs: on a 2-core CPU one "
          "client-round of a 1.5B model takes minutes (docs/performance.md), the grid weeks."),
))

_preset("tiny", Grid(
    tasks=["arc_challenge"],
    algorithms=["spear", "grpo"],
    seeds=[0],
    base=dict(model="tiny-random", rounds=1, num_clients=2, clients_per_round=1, rollouts_per_round=2,
              max_revisions=1, local_steps=1, batch_size=2, max_new_tokens=3, lora_r=4, lora_alpha=8,
              eval_size=4, train_size=20, dtype="fp32"),
    note="Tiny random model: checks the machinery (used by the tests), measures nothing.",
))


def load_grid(path: Path) -> Grid:
    """A grid from a TOML file (keys: tasks, algorithms, seeds, settings, note, [axes], [base], [per_task.<task>];
    ``Grid``'s fields).

    Raises:
        ConfigError: the file is missing, not TOML, has unknown keys or an invalid cell.
    """
    data = read_toml(path, "grid file")
    unknown = set(data) - {"tasks", "algorithms", "seeds", "axes", "base", "per_task", "settings", "note"}
    if unknown:
        raise ConfigError(f"{path}: unknown grid key(s) {', '.join(sorted(unknown))}")
    try:
        return Grid(**data)
    except (TypeError, ConfigError) as err:
        raise ConfigError(f"{path}: {err}") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def grid_toml(grid: Grid) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in grid.to_dict().items() if k not in ("axes", "base", "per_task")]
    lines += ["", "[axes]"] + [f"{k} = {_toml_value(v)}" for k, v in grid.axes.items()]
    lines += ["", "[base]"] + [f"{k} = {_toml_value(v)}" for k, v in grid.base.items()]
    for task, values in grid.per_task.items():
        lines += ["", f"[per_task.{task}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def pinned(grid: Grid) -> Grid:
    """``grid`` with its client split named (``base.partitioner``), as ``grid.toml`` records it."""
    return Grid(**{**grid.to_dict(), "base": {"partitioner": PARTITIONER_DEFAULT, **grid.base}})


def saved_difference(grid: Grid, output: Path) -> tuple[dict[str, Any], list[str]] | None:
    """How ``grid`` differs from the grid saved in ``<output>/grid.toml`` → (the saved grid as ``Grid.to_dict()``,
    the keys that differ, sorted; ``note`` is prose and never differs); None when no grid is saved there.

    A ``grid.toml`` written before the ``partitioner`` key existed ran under the rule of then
    (``LEGACY_DEFAULTS``), so it is compared as naming that.

    Raises:
        ConfigError: ``grid.toml`` is not a valid grid (file and reason).
    """
    saved = output / "grid.toml"
    if not saved.exists():
        return None
    old = load_grid(saved).to_dict()
    old["base"] = {"partitioner": LEGACY_DEFAULTS["partitioner"], **old["base"]}
    new = pinned(grid).to_dict()
    return old, sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "note")


# ---- running ----------------------------------------------------------------------------------------------------
def run_grid(grid: Grid, output: Path, on_event: Callable[[str, Cell, float], None] | None = None,
             verbose: bool = False) -> list[Cell]:
    """Run every unfinished cell of ``grid`` under ``output`` (in order; finished cells are skipped).

    Each cell runs as ``python -m fedspear.cli run --config <cell>/cell.toml`` with its log in ``<cell>/log.txt``.
    ``on_event(kind, cell, seconds)`` is called with kind ``"skip"``, ``"start"`` or ``"done"``.

    A saved grid that differs only by having fewer seeds or algorithms (each a subset of the new one's) or in its
    note is extended: ``grid.toml`` is rewritten, its finished cells are skipped and the new ones run.

    Raises:
        ConfigError: ``output`` holds a different grid.
        RuntimeError: a cell failed (its log path and last lines are in the message); finished cells stay.
    """
    output.mkdir(parents=True, exist_ok=True)
    saved = output / "grid.toml"
    differs = saved_difference(grid, output)
    grid = pinned(grid)  # grid.toml names the client split explicitly
    if differs is not None:
        old, diff = differs
        new = grid.to_dict()
        extends = set(diff) <= {"seeds", "algorithms"} and all(set(old[k]) <= set(new[k]) for k in diff)
        if not extends:
            raise ConfigError(f"{output} holds another grid (differs in: {', '.join(diff)}); use another "
                              f"--output-dir or delete it")
        if old != new:  # more seeds / algorithms, a new note: the finished cells keep their place
            saved.write_text(grid_toml(grid), encoding="utf-8")
    else:
        saved.write_text(grid_toml(grid), encoding="utf-8")
    cells = grid.cells(output)
    first_of_task: dict[str, Path] = {}
    for cell in cells:
        if cell.done():
            # a copied result without config.toml and start record cannot; nor one from another precision / device
            done_cfg = cell.config
            if RunDir(cell.path).serves_round0(resolve_dtype(done_cfg.dtype, done_cfg.device),
                                               resolve_device(done_cfg.device)):
                first_of_task.setdefault(cell.task, cell.path)
            if on_event:
                on_event("skip", cell, 0.0)
            continue
        cfg = cell.config
        if cell.task in first_of_task:
            cfg = load_config(None, **{**cfg.to_dict(), "round0_from": str(first_of_task[cell.task])})
        cell.path.mkdir(parents=True, exist_ok=True)
        (cell.path / "cell.toml").write_text(cfg.to_toml(), encoding="utf-8")
        if on_event:
            on_event("start", cell, 0.0)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "fedspear.cli", "run", "--config", str(cell.path / "cell.toml")]
        if verbose:
            cmd.append("--verbose")
        with open(cell.path / "log.txt", "a", encoding="utf-8") as log:
            # at SIGINT / SIGTERM the cell's run gets the signal, stops and keeps its rounds (fedspear.stops)
            code = stops.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        if code != 0 or not cell.done():
            tail = (cell.path / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            raise RuntimeError(f"cell {cell.name} failed (exit {code}); log {cell.path / 'log.txt'}:\n"
                               + "\n".join(tail))
        first_of_task.setdefault(cell.task, cell.path)
        if on_event:
            on_event("done", cell, time.perf_counter() - t0)
    return cells
