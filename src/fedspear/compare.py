"""``fedspear compare``: a grid of runs (algorithms × seeds × any settings), fairly matched, resumable, summarised in
the layout of the paper's Table 1 with the plots of its Figures 2–5.

Every cell is an ordinary ``fedspear run`` (its own run directory under ``<output>/cells/<name>``, run in a child
process so each cell starts its own Flower simulation) that differs from the others only in the grid's axes. Cells
with the same task, seed and axes therefore see the identical data partition, client sampling and prompt streams
(all derived from the seed). A cell whose run directory already holds every round is skipped; an interrupted one
resumes after its last completed round (``fedspear run``'s own resume). The round-0 evaluation — the base model on
the fixed held-out subset — is computed once per task and reused by the other cells (``round0_from``; checked, see
:func:`fedspear.fl.server_app.reused_round0`).

A grid row may be an algorithm variant (``VARIANTS``: ``opsd_authors`` is OPSD with ``opsd_variant = "authors"``),
so both OPSD formulations sit in one table.

Outputs in ``<output>``: ``grid.toml`` (the grid; a re-run with another grid is refused, except one that only adds
seeds or algorithms to it: the finished cells stay and the new ones run), ``cells/``,
``comparison.md`` and ``plots/`` (accuracy vs round, cumulative wall-clock per algorithm as in the paper's Fig. 2,
successful revisions and samples needing revision per round as in Figs. 3–5), ``comparison.json`` (every figure
in the table).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .config import ALGORITHMS, ConfigError, RunConfig, load_config, read_toml
from .paper_settings import PRESETS as RUN_PRESETS, preset_settings
from .rundir import LEGACY_DEFAULTS, RunDir, initial_accuracy, initial_samples
from .report import epsilon_text

PARTITIONER_DEFAULT = RunConfig.__dataclass_fields__["partitioner"].default

# the settings the paper's ablations and robustness studies vary (SPEC §5, issue "compare"); "centralized" is
# shorthand for one client holding all the data
AXES = ("mu", "tau", "lambda_l", "max_revisions", "strategy", "num_clients", "dirichlet_alpha", "last_layers",
        "centralized", "user_flip_prob", "user_irrelevant_prob", "dp", "dp_noise_multiplier", "dp_clip_norm")

NAMES = {"spear": "SPEAR", "feedback_sft": "Feedback SFT", "grpo": "GRPO", "opsd": "OPSD", "rltf_sd": "RLTF-SD",
         "opsd_authors": "OPSD (authors)"}
#: Grid rows that run an algorithm with fixed settings: row name → (algorithm, settings). ``opsd_authors``: the SPEAR
#: authors' OPSD (forward KL, T 2, current-model teacher; ``fedspear.algorithms.opsd``) beside the original.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"opsd_authors": ("opsd", {"opsd_variant": "authors"})}
ROWS = (*ALGORITHMS, *VARIANTS)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


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
        for where, values in [("base", self.base), *((f"per_task.{t}", v) for t, v in self.per_task.items())]:
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
        values = dict(self.base)
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

    def done(self) -> bool:
        last = RunDir(self.path).last_round() if (self.path / "metrics.jsonl").exists() else None
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
          "tables), 16 new tokens per attempt on ARC and 64 on StrategyQA (its default 128 would triple the cost), "
          "evaluation on a fixed 100-item test subset at rounds 0 and 2. Far below the paper's budget (100 rounds, "
          "50 clients): it compares the algorithms' cost and first steps, not their converged accuracy."),
))

_preset("cpu-qwen1.5b", Grid(
    tasks=["arc_challenge"],
    algorithms=list(ALGORITHMS),
    seeds=[0, 1, 2],  # seed 2 added by issue 17 (the committed results' grid.toml, seeds 0–1, is extended)
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
    """A grid from a TOML file (keys: tasks, algorithms, seeds, note, [axes], [base]).

    Raises:
        ConfigError: the file is missing, not TOML, has unknown keys or an invalid cell.
    """
    data = read_toml(path, "grid file")
    unknown = set(data) - {"tasks", "algorithms", "seeds", "axes", "base", "per_task", "settings", "note"}
    if unknown:
        raise ConfigError(f"{path}: unknown grid key(s) {', '.join(sorted(unknown))}")
    try:
        return Grid(**data)
    except TypeError as err:
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
    # grid.toml names the client split explicitly; one written before the key existed used the rule of then
    grid = Grid(**{**grid.to_dict(), "base": {"partitioner": PARTITIONER_DEFAULT, **grid.base}})
    if saved.exists():
        old = load_grid(saved).to_dict()
        old["base"] = {"partitioner": LEGACY_DEFAULTS["partitioner"], **old["base"]}
        new = grid.to_dict()
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "note")  # note: prose
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
            if RunDir(cell.path).adapter_dir(0).exists():  # reusable (a copied result without adapters is not)
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
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        if code != 0 or not cell.done():
            tail = (cell.path / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
            raise RuntimeError(f"cell {cell.name} failed (exit {code}); log {cell.path / 'log.txt'}:\n"
                               + "\n".join(tail))
        first_of_task.setdefault(cell.task, cell.path)
        if on_event:
            on_event("done", cell, time.perf_counter() - t0)
    return cells


# ---- summary ----------------------------------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def paired_ci(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences with a 95% t interval over the pairs → ``(mean, low, high)``.

    One pair has no interval (``low = high = nan``).
    """
    m, s = mean_std(diffs)
    n = len(diffs)
    if n < 2:
        return m, math.nan, math.nan
    half = T_975.get(n - 1, 1.96) * s / math.sqrt(n)
    return m, m - half, m + half


def item_mean_ci(outcomes: list[str], z: float = 1.959964) -> tuple[float, float, float]:
    """Accuracy over the same items answered in several runs (one "1"/"0" string per run, ``evaluate``'s
    ``correct_<metric>``), with a 95% normal interval over items → ``(mean, low, high)``.

    Each item's score is its mean over the runs (seeds); the interval is mean ± z · sd / √n over the n items, so it
    measures how much the figure would move on other items, not how it would move with other seeds.

    Raises:
        ValueError: no strings, strings of different lengths, empty strings or characters other than 0/1.
    """
    return _items_ci([[int(c) for c in _check_outcomes(o, outcomes)] for o in outcomes], z)


def paired_gain(before: str, after: list[str], z: float = 1.959964) -> tuple[float, float, float]:
    """Gain in accuracy of ``after`` (one outcome string per seed) over ``before`` on the same items, paired by item,
    with a 95% normal interval over items → ``(gain, low, high)`` (fractions; × 100 for points).

    Item i contributes d_i = mean over seeds of after_s[i] − before[i] ∈ [−1, 1]; gain = mean d_i, interval
    gain ± z · sd(d) / √n. Pairing removes the between-item variance that two separate Wilson intervals would count.

    Raises:
        ValueError: as :func:`item_mean_ci`, including ``before`` of another length.
    """
    _check_outcomes(before, [before, *after])
    return item_paired_diff(after, [before] * len(after), z)


def item_paired_diff(a: list[str], b: list[str], z: float = 1.959964) -> tuple[float, float, float]:
    """Accuracy of runs ``a`` minus runs ``b`` on the same items, ``a[s]`` paired with ``b[s]`` (same seed: same
    partition, prompts and evaluation items) and item by item, with a 95% normal interval over items →
    ``(diff, low, high)`` (fractions).

    Item i contributes d_i = mean over s of a_s[i] − b_s[i]; diff = mean d_i, interval diff ± z · sd(d) / √n. With
    one or two seeds this is the only interval available; it covers the choice of questions, not of seeds.

    Raises:
        ValueError: ``a`` and ``b`` of different lengths, or outcomes as in :func:`item_mean_ci`.
    """
    if len(a) != len(b):
        raise ValueError(f"item_paired_diff: {len(a)} runs against {len(b)}; pair them seed by seed")
    group = [*a, *b]
    rows = [[int(x) - int(y) for x, y in zip(_check_outcomes(sa, group), _check_outcomes(sb, group))]
            for sa, sb in zip(a, b)]
    return _items_ci(rows, z)


def _check_outcomes(outcome: str, group: list[str]) -> str:
    if not group or not outcome or any(len(o) != len(outcome) for o in group) or set(outcome) - {"0", "1"}:
        raise ValueError("per-item outcomes must be non-empty strings of 0/1 of one length (the same items)")
    return outcome


def _items_ci(rows: list[list[int]], z: float) -> tuple[float, float, float]:
    if not rows:
        raise ValueError("per-item outcomes must be non-empty strings of 0/1 of one length (the same items)")
    n = len(rows[0])
    scores = [sum(col) / len(rows) for col in zip(*rows)]
    m = sum(scores) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in scores) / (n - 1)) if n > 1 else math.nan
    half = z * sd / math.sqrt(n)
    return m, m - half, m + half


def cell_summary(cell: Cell) -> dict[str, Any] | None:
    """Figures of one finished cell (None when it has not run)."""
    run = RunDir(cell.path)
    if not run.metrics_path.exists():
        return None
    records = run.records()
    rounds = [r for r in records if r["round"] > 0]
    if not rounds:
        return None
    first = records[0]["eval"]
    last = next(r for r in reversed(records) if r.get("eval"))
    train_seconds = [r["seconds"]["round"] - r["seconds"].get("evaluate", 0.0) for r in rounds]
    privacy = ({k: rounds[-1][k] for k in ("dp_epsilon", "dp_delta", "dp_noise_multiplier", "dp_clip_norm",
                                           "dp_releases")} if "dp_epsilon" in rounds[-1] else None)
    return {
        "cell": cell.name, "task": cell.task, "algorithm": cell.algorithm, "seed": cell.seed, "variant": cell.variant,
        "final_round": last["round"],
        "acc0": {k: first.get(k) for k in ("acc_gen", "acc_ll")},
        "acc": {k: last["eval"].get(k) for k in ("acc_gen", "acc_ll")},
        "outcomes0": {k: first.get("correct_" + k[4:]) for k in ("acc_gen", "acc_ll")},
        "outcomes": {k: last["eval"].get("correct_" + k[4:]) for k in ("acc_gen", "acc_ll")},
        "answers": {k: (first.get(k), last["eval"].get(k)) for k in ("parsed_gen", "cutoff_gen")},
        "n": last["eval"]["n"],
        "n_gen": last["eval"].get("n_gen", last["eval"]["n"]),
        "curve": [(r["round"], r["eval"].get("acc_gen"), r["eval"].get("acc_ll")) for r in records if r.get("eval")],
        "seconds_per_round": sum(train_seconds) / len(train_seconds),
        "cumulative_seconds": list(itertools.accumulate(train_seconds)),
        "tokens_generated": sum(r.get("tokens_generated", 0) for r in rounds),
        "generations": sum(r.get("generations", 0) for r in rounds),
        "revisions_successful": [r.get("revisions_successful", 0) for r in rounds],
        "needing_revision": [initial_samples(r) - r.get("initial_correct", 0) for r in rounds],
        "initial_accuracy": [initial_accuracy(r) for r in rounds],
        "phase_seconds": {k: sum(r["seconds"].get(k, 0.0) for r in rounds)
                          for k in ("generate_initial", "generate_revisions", "train", "aggregate",
                                    "flower_overhead")},
        "privacy": privacy,
    }


def _fmt_pct(m: float | None, s: float | None = None) -> str:
    if m is None:
        return "–"
    return f"{100 * m:.2f}" + (f" ± {100 * s:.2f}" if s is not None else "")


def _md_table(title: str, intro: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown section: ``## title``, an introductory paragraph, a table with ``header`` and ``rows``."""
    return [f"## {title}", "", intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def summarise(grid: Grid, output: Path, command: str = "", started: str = "") -> Path:
    """Write ``comparison.md``, ``comparison.json`` and ``plots/`` for the finished cells of ``grid``."""
    cells = grid.cells(output)
    rows = [s for s in (cell_summary(c) for c in cells) if s]
    variants = sorted({r["variant"] for r in rows}, key=lambda v: [c.variant for c in cells].index(v))
    metric_keys = [k for k in ("acc_gen", "acc_ll") if any(r["acc"].get(k) is not None for r in rows)]
    table: dict[str, Any] = {}
    lines = ["# fedspear comparison", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if started:
        lines += [f"Run: {started}", ""]
    if grid.note:
        lines += [grid.note, ""]
    lines += [f"Grid: tasks {', '.join(grid.tasks)} · algorithms {', '.join(grid.algorithms)} · seeds "
              f"{', '.join(map(str, grid.seeds))}" + (f" · axes {grid.axes}" if grid.axes else "") + ".",
              f"Shared settings: `{json.dumps(grid.base)}`"
              + "".join(f"; {t} only: `{json.dumps(v)}`" for t, v in grid.per_task.items()) + ".", ""]
    lines += ["Accuracy in % on the fixed held-out subset (n per cell below), mean ± std over seeds, at the last "
              "evaluated round; round 0 is the base model (the same for every algorithm). *Gen* = accuracy of the "
              "final answer of a greedy generation (the paper's metric); *LL* = log-likelihood over the option "
              "letters (multiple choice only).", ""]
    for key, label in (("acc_gen", "generation"), ("acc_ll", "log-likelihood")):
        if key not in metric_keys:
            continue
        for variant in variants:
            title = f"## Final accuracy ({label})" + (f" — {variant}" if variant else "")
            lines += [title, "", "| Algorithm | " + " | ".join(grid.tasks) + " | Avg. |",
                      "|---|" + "---|" * (len(grid.tasks) + 1)]
            base_row = []
            for task in grid.tasks:
                r0 = next((r for r in rows if r["task"] == task), None)
                base_row.append(r0["acc0"].get(key) if r0 else None)
            vals = [v for v in base_row if v is not None]
            lines.append("| Round 0 (base model) | " + " | ".join(_fmt_pct(v) for v in base_row)
                         + f" | {_fmt_pct(sum(vals) / len(vals)) if vals else '–'} |")
            for algorithm in grid.algorithms:
                cellsv, means = [], []
                for task in grid.tasks:
                    vs = [r["acc"][key] for r in rows if r["task"] == task and r["algorithm"] == algorithm
                          and r["variant"] == variant and r["acc"].get(key) is not None]
                    if vs:
                        m, s = mean_std(vs)
                        cellsv.append(_fmt_pct(m, s) + ("" if len(vs) == len(grid.seeds) else f" ({len(vs)} seeds)"))
                        means.append(m)
                        table.setdefault(key, {}).setdefault(variant, {}).setdefault(algorithm, {})[task] = {
                            "mean": m, "std": s, "seeds": len(vs)}
                    else:
                        cellsv.append("–")
                avg = _fmt_pct(sum(means) / len(means)) if len(means) == len(grid.tasks) else "–"
                lines.append(f"| {NAMES.get(algorithm, algorithm)} | " + " | ".join(cellsv) + f" | {avg} |")
            lines.append("")
    answer_rows = [r for r in rows if any(v is not None for pair in r["answers"].values() for v in pair)]
    if answer_rows:
        lines += _md_table(
            "Parsed and cut-off answers (generation)",
            "Share of the evaluated greedy answers (%) from which the task's rule reads an answer (*parsed*) and that "
            "the token budget stopped before EOS (*cut off*), round 0 → last evaluated round.",
            ["Cell", "parsed", "cut off"],
            [[r["cell"], *(" → ".join("–" if v is None else f"{100 * v:.1f}" for v in r["answers"][k])
                           for k in ("parsed_gen", "cutoff_gen"))] for r in answer_rows])
    private_rows = [r for r in rows if r["privacy"]]
    if private_rows:
        lines += _md_table(
            "Privacy spent",
            "Client-level (ε, δ) after the last round (Flower's RDP accountant, no amplification by sampling; "
            "`fedspear.fl.privacy`); ∞ = clipping without noise.",
            ["Cell", "z", "C", "noised rounds", "ε", "δ"],
            [[r["cell"], f"{p['dp_noise_multiplier']:g}", f"{p['dp_clip_norm']:g}", str(p["dp_releases"]),
              epsilon_text(p), f"{p['dp_delta']:g}"] for r in private_rows for p in [r["privacy"]]])
    if "spear" in grid.algorithms and len(grid.algorithms) > 1:
        lines += ["## SPEAR minus each baseline", "",
                  "Difference in final accuracy (percentage points), paired by task and seed (same partition, "
                  "prompts and evaluation items), mean with a 95% t interval over the pairs; and a 95% interval "
                  "over the evaluated items, each item paired with itself (`item_paired_diff`: how much Δ would move "
                  "on other questions, not with other seeds).", "",
                  "| Metric | Task | Variant | Baseline | Δ (pp) | 95% CI over seeds | 95% CI over items | pairs |",
                  "|---|---|---|---|---|---|---|---|"]
        diffs_out = []
        for key in metric_keys:
            for task in grid.tasks:
                for variant in variants:
                    spear_rows = {r["seed"]: r for r in rows if r["task"] == task and r["variant"] == variant
                                  and r["algorithm"] == "spear" and r["acc"].get(key) is not None}
                    for algorithm in grid.algorithms:
                        if algorithm == "spear":
                            continue
                        other_rows = {r["seed"]: r for r in rows if r["task"] == task
                                      and r["variant"] == variant and r["algorithm"] == algorithm
                                      and r["acc"].get(key) is not None}
                        seeds = sorted(set(spear_rows) & set(other_rows))
                        if not seeds:
                            continue
                        m, lo, hi = paired_ci([spear_rows[s]["acc"][key] - other_rows[s]["acc"][key] for s in seeds])
                        ci = "–" if math.isnan(lo) else f"[{100 * lo:+.2f}, {100 * hi:+.2f}]"
                        a = [spear_rows[s].get("outcomes", {}).get(key) for s in seeds]
                        b = [other_rows[s].get("outcomes", {}).get(key) for s in seeds]
                        item = (math.nan,) * 3
                        if all(a) and all(b) and len({len(o) for o in a + b}) == 1:
                            item = item_paired_diff(a, b)
                        item_ci = "–" if math.isnan(item[1]) else f"[{100 * item[1]:+.2f}, {100 * item[2]:+.2f}]"
                        lines.append(f"| {key} | {task} | {variant or '–'} | {NAMES.get(algorithm, algorithm)} | "
                                     f"{100 * m:+.2f} | {ci} | {item_ci} | {len(seeds)} |")
                        diffs_out.append({"metric": key, "task": task, "variant": variant, "baseline": algorithm,
                                          "diff": m, "low": lo, "high": hi, "pairs": len(seeds),
                                          "item_low": item[1], "item_high": item[2]})
        table["spear_minus"] = diffs_out
        lines.append("")
    gain_lines, gains = gain_table(grid, rows, variants, metric_keys)
    lines += gain_lines
    table["gain_over_round0"] = gains
    lines += ["## Cost", "",
              "Seconds per round exclude the central evaluation (interaction + training + aggregation + Flower), "
              "summed over the round's clients' wall-clock as the server saw it; mean over seeds and rounds.", "",
              "| Task | Variant | Algorithm | s / round | final wall-clock (s) | generations | tokens generated |"
              " gen. initial (s) | gen. revisions (s) | train (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    cost = []
    for task in grid.tasks:
        for variant in variants:
            for algorithm in grid.algorithms:
                rs = [r for r in rows if r["task"] == task and r["variant"] == variant and r["algorithm"] == algorithm]
                if not rs:
                    continue
                spr = mean_std([r["seconds_per_round"] for r in rs])[0]
                wall = mean_std([r["cumulative_seconds"][-1] for r in rs])[0]
                gens = mean_std([r["generations"] for r in rs])[0]
                toks = mean_std([r["tokens_generated"] for r in rs])[0]
                ph = {k: mean_std([r["phase_seconds"][k] for r in rs])[0] for k in rs[0]["phase_seconds"]}
                lines.append(f"| {task} | {variant or '–'} | {NAMES.get(algorithm, algorithm)} | {spr:.1f} | "
                             f"{wall:.0f} | {gens:.0f} | {toks:.0f} | {ph['generate_initial']:.0f} | "
                             f"{ph['generate_revisions']:.0f} | {ph['train']:.0f} |")
                cost.append({"task": task, "variant": variant, "algorithm": algorithm, "seconds_per_round": spr,
                             "wall_clock": wall, "generations": gens, "tokens_generated": toks, "phases": ph})
    table["cost"] = cost
    n_eval = sorted({(r["n"], r.get("n_gen", r["n"])) for r in rows})
    shown = ", ".join(str(n) if g == n else f"{n} (generation on {g} of them)" for n, g in n_eval)
    lines += ["", f"Evaluation items per cell: {shown}. Cells finished: {len(rows)} of {len(cells)}.", ""]
    plots = plot_comparison(grid, rows, output / "plots")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    lines += ["## Cells", "", "| Cell | final round | " + " | ".join(f"{k} r0 → final" for k in metric_keys)
              + " | s / round |", "|---|---|" + "---|" * (len(metric_keys) + 1)]
    for r in rows:
        accs = " | ".join(f"{_fmt_pct(r['acc0'].get(k))} → {_fmt_pct(r['acc'].get(k))}" for k in metric_keys)
        lines.append(f"| {r['cell']} | {r['final_round']} | {accs} | {r['seconds_per_round']:.1f} |")
    out = output / "comparison.md"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (output / "comparison.json").write_text(json.dumps({"grid": grid.to_dict(), "table": table, "cells": rows},
                                                       indent=1, default=str) + "\n", encoding="utf-8")
    return out


def gain_table(grid: Grid, rows: list[dict], variants: list[str], metric_keys: list[str]
               ) -> tuple[list[str], list[dict[str, Any]]]:
    """The "gain over round 0" section: per algorithm, round-0 and final accuracy with 95% intervals over items
    and the item-paired gain (:func:`paired_gain`), pooled over seeds. Cells without per-item outcomes (runs from
    before they were recorded) are left out; no section when none has them."""
    out, lines = [], []
    for key in metric_keys:
        for task in grid.tasks:
            for variant in variants:
                for algorithm in grid.algorithms:
                    rs = [r for r in rows if r["task"] == task and r["variant"] == variant
                          and r["algorithm"] == algorithm and r.get("outcomes", {}).get(key)
                          and r.get("outcomes0", {}).get(key)]
                    before = {r["outcomes0"][key] for r in rs}
                    if not rs or len(before) != 1 or any(len(r["outcomes"][key]) != len(next(iter(before)))
                                                         for r in rs):
                        continue  # round 0 must be one and the same measurement of the same items
                    before = before.pop()
                    after = [r["outcomes"][key] for r in rs]
                    r0, final, gain = item_mean_ci([before]), item_mean_ci(after), paired_gain(before, after)
                    out.append({"metric": key, "task": task, "variant": variant, "algorithm": algorithm,
                                "round0": r0, "final": final, "gain": gain, "seeds": len(rs), "items": len(before)})
    if not out:
        return [], []
    lines += ["## Gain over round 0", "",
              "Accuracy in % with a 95% interval over the evaluated items (each item scored by its mean over the "
              "seeds), and the gain over the base model paired item by item (the same items at round 0 and at the "
              "end). The intervals say how much a figure would move on other questions; with this few seeds they "
              "do not include the spread between seeds (the ± std in the tables above).", "",
              "| Metric | Task | Variant | Algorithm | round 0 | final | gain (pp) | seeds × items |",
              "|---|---|---|---|---|---|---|---|"]

    def fmt(t):
        return f"{100 * t[0]:.1f} [{100 * t[1]:.1f}, {100 * t[2]:.1f}]"

    for g in out:
        gm, glo, ghi = (100 * x for x in g["gain"])
        lines.append(f"| {g['metric']} | {g['task']} | {g['variant'] or '–'} | "
                     f"{NAMES.get(g['algorithm'], g['algorithm'])} | {fmt(g['round0'])} | {fmt(g['final'])} | "
                     f"{gm:+.1f} [{glo:+.1f}, {ghi:+.1f}] | {g['seeds']} × {g['items']} |")
    return lines + [""], out


def plot_comparison(grid: Grid, rows: list[dict], folder: Path) -> list[Path]:
    """Accuracy vs round, cumulative wall-clock (Fig. 2), successful revisions and samples needing revision
    (Figs. 3–5), one panel per task, mean over seeds per algorithm (and variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not rows:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in grid.tasks if any(r["task"] == t for r in rows)]
    groups = sorted({(r["algorithm"], r["variant"]) for r in rows},
                    key=lambda g: (grid.algorithms.index(g[0]), g[1]))

    def label(g):
        return NAMES.get(g[0], g[0]) + (f" ({g[1]})" if g[1] else "")

    def mean_series(series: list[list[float]]) -> list[float]:
        n = min(len(s) for s in series)
        return [sum(s[i] for s in series) / len(series) for i in range(n)]

    paths = []

    def panel_figure(name: str, title: str, ylabel: str, xlabel: str, draw) -> None:
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for g in groups:
                draw(ax, task, g)
            ax.set_title(task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for key, label_text in (("acc_gen", "generation"), ("acc_ll", "log-likelihood")):
        if not any(r["acc"].get(key) is not None for r in rows):
            continue
        idx = 1 if key == "acc_gen" else 2

        def draw_acc(ax, task, g, idx=idx):
            rs = [r for r in rows if r["task"] == task and (r["algorithm"], r["variant"]) == g]
            if not rs:
                return
            xs = [c[0] for c in rs[0]["curve"]]
            series = [[100 * (c[idx] or 0) for c in r["curve"]] for r in rs]
            ys = mean_series(series)
            line, = ax.plot(xs[: len(ys)], ys, marker="o", label=label(g))
            if len(rs) > 1:  # ± std over seeds
                sd = [mean_std([s[i] for s in series])[1] for i in range(len(ys))]
                ax.fill_between(xs[: len(ys)], [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)],
                                color=line.get_color(), alpha=0.12, linewidth=0)

        panel_figure(f"accuracy_{key}", f"Held-out accuracy ({label_text}), mean ± std over seeds", "accuracy (%)",
                     "round", draw_acc)

    def draw_wall(ax, task, g):
        rs = [r for r in rows if r["task"] == task and (r["algorithm"], r["variant"]) == g]
        if rs:
            ys = mean_series([r["cumulative_seconds"] for r in rs])
            ax.plot(range(1, len(ys) + 1), [y / 60 for y in ys], marker="o", label=label(g))

    panel_figure("wall_clock", "Cumulative wall-clock without evaluation (paper Fig. 2)", "minutes", "round",
                 draw_wall)

    def draw_rev(ax, task, g, key):
        rs = [r for r in rows if r["task"] == task and (r["algorithm"], r["variant"]) == g]
        if rs and any(sum(r["revisions_successful"]) or g[0] in ("spear", "feedback_sft", "rltf_sd") for r in rs):
            ys = mean_series([r[key] for r in rs])
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=label(g))

    panel_figure("revisions_successful", "Successful revisions per round (paper Figs. 3–5)", "revisions", "round",
                 lambda ax, t, g: draw_rev(ax, t, g, "revisions_successful"))
    panel_figure("needing_revision", "Samples needing revision per round (wrong first answers; paper Figs. 3–5)",
                 "samples", "round", lambda ax, t, g: draw_rev(ax, t, g, "needing_revision"))
    return paths
