"""``fedspear compare``: grid building, validation, paired statistics, and a real 2-cell run that resumes."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedspear.experiments.compare.grid import PRESETS, Grid, load_grid
from fedspear.experiments.compare.stats import item_mean_ci, item_paired_diff, mean_std, paired_ci, paired_gain
from fedspear.config import ConfigError


def test_grid_cells_share_everything_but_their_axes(tmp_path):
    grid = Grid(tasks=["arc_challenge"], algorithms=["spear", "grpo"], seeds=[0, 1],
                axes={"mu": [0.1, 0.3], "centralized": [False, True]}, base={"rounds": 2})
    cells = grid.cells(tmp_path)
    assert len(cells) == 1 * 4 * 2 * 2
    names = {c.name for c in cells}
    assert len(names) == len(cells) and "arc_challenge-grpo-mu=0.3-centralized=True-s1" in names
    central = next(c for c in cells if c.axes["centralized"])
    assert (central.config.num_clients, central.config.clients_per_round) == (1, 1)
    a, b = cells[0].config.to_dict(), cells[2].config.to_dict()
    assert {k for k in a if a[k] != b[k]} == {"seed", "output_dir"}
    assert [(c.algorithm, c.seed) for c in cells[:4]] == [("spear", 0), ("grpo", 0), ("spear", 1), ("grpo", 1)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tasks=[]), "tasks is empty"),
    (dict(tasks=["arc_challenge"], algorithms=["ppo"]), "unknown algorithm 'ppo'"),
    (dict(tasks=["arc_challenge"], axes={"lr": [1e-4]}), "'lr' cannot be an axis"),
    (dict(tasks=["arc_challenge"], axes={"mu": []}), "axis mu needs a non-empty list"),
    (dict(tasks=["arc_challenge"], base={"seed": 3}), "base may not set seed"),
    (dict(tasks=["arc_challenge"], axes={"mu": [1.5]}), "cell arc_challenge-spear-mu=1.5-s0: mu: 1.5 is out of range"),
    (dict(tasks=["nope"]), "task: 'nope' is not allowed"),
])
def test_bad_grids_are_rejected_with_the_reason(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Grid(**kwargs)


@pytest.mark.parametrize("key, values, repeated", [
    ("seeds", [0, 1, 0], "0"), ("tasks", ["arc_challenge", "arc_challenge"], "arc_challenge"),
    ("algorithms", ["spear", "grpo", "spear"], "spear"), ("axes", {"mu": [0.1, 0.1]}, "0.1"),
])
def test_a_repeated_seed_task_algorithm_or_axis_value_is_refused(tmp_path, key, values, repeated):
    """``--seeds 0,0`` ran one cell and comparison.md counted it twice ("seeds 0, 0", "2 × 4", "± 0.00")."""
    grid = {"tasks": ["arc_challenge"], key: values}
    with pytest.raises(ConfigError, match=f"grid: {'axis mu' if key == 'axes' else key} repeats {repeated}; "):
        Grid(**grid)
    with pytest.raises(ConfigError, match="seeds repeats 0"):
        PRESETS["tiny"].overridden(seeds="0,0")
    path = tmp_path / "grid.toml"
    path.write_text('tasks = ["arc_challenge"]\nseeds = [0, 0]\n')
    with pytest.raises(ConfigError, match="grid.toml: grid: seeds repeats 0"):
        load_grid(path)


@pytest.mark.parametrize("option", ["tasks", "algorithms", "seeds"])
@pytest.mark.parametrize("text", ["", " , "])
def test_an_empty_list_on_the_command_line_is_refused(option, text):
    """``--seeds ''`` ran the preset's seeds, as if the option were not given: an empty list is not a grid."""
    with pytest.raises(ConfigError, match=f"--{option}: {re.escape(repr(text))} names no"):
        PRESETS["tiny"].overridden(**{option: text})
    from typer.testing import CliRunner

    from fedspear.cli import app

    result = CliRunner().invoke(app, ["compare", "--preset", "tiny", f"--{option}", text, "--summary-only"])
    assert result.exit_code == 2 and f"--{option}: {text!r} names no" in result.output, result.output


def _saved_grid(out: Path, grid: Grid, monkeypatch) -> None:
    """``out`` as ``fedspear compare`` leaves it when its first cell fails: grid.toml written, no finished cell."""
    import fedspear.experiments.compare.grid as compare_module

    monkeypatch.setattr(compare_module.stops, "call", lambda *a, **k: 1)
    with pytest.raises(RuntimeError, match="failed"):
        compare_module.run_grid(grid, out)


def test_summary_only_refuses_a_grid_other_than_the_one_that_ran(tmp_path, monkeypatch):
    """``--summary-only --set lr=1e-3`` (or other seeds) wrote a comparison.md claiming settings its cells never ran
    with; without ``--summary-only`` the same change was refused. Now both refuse it, and the summary is unchanged;
    the grid that ran (its note aside) is still summarised."""
    from typer.testing import CliRunner

    from fedspear.cli import app
    from fedspear.experiments.compare.summary import summarise
    from fedspear.rundir import RunDirError

    out = tmp_path / "c2"
    _saved_grid(out, PRESETS["tiny"].overridden(algorithms="spear"), monkeypatch)
    cmd = ["compare", "--preset", "tiny", "--algorithms", "spear", "-o", str(out), "--summary-only"]
    for extra, differs in ((["--set", "lr=1e-3"], "base.lr: saved None vs now 0.001"),
                           (["--seeds", "0,1"], "seeds: saved [0] vs now [0, 1]"),
                           (["--algorithms", "spear,grpo"], "algorithms: saved ['spear'] vs now ['spear', 'grpo']")):
        result = CliRunner().invoke(app, cmd + extra)
        assert result.exit_code == 2, result.output
        assert f"{out} holds another grid ({differs})" in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output
        assert not (out / "comparison.md").exists()
    with pytest.raises(RunDirError, match="holds another grid"):
        summarise(PRESETS["tiny"], out)
    same = Grid(**{**PRESETS["tiny"].overridden(algorithms="spear").to_dict(), "note": "reworded"})
    assert summarise(same, out) == out / "comparison.md"


def test_summary_only_without_a_comparison_says_so(tmp_path):
    """``--summary-only`` on a folder with no grid and no cells ended in a FileNotFoundError traceback."""
    from typer.testing import CliRunner

    from fedspear.cli import app

    for out in (tmp_path / "c1", tmp_path):  # absent, and a folder that holds no comparison
        result = CliRunner().invoke(app, ["compare", "--preset", "tiny", "-o", str(out), "--summary-only"])
        assert result.exit_code == 2, result.output
        assert f"{out}: no comparison to summarise" in result.output and "Traceback" not in result.output
        assert not (out / "comparison.md").exists()


def test_grid_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_grid(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("tasks = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_grid(bad)
    bad.write_text('tasks = ["arc_challenge"]\nrounds = 3\n')
    with pytest.raises(ConfigError, match="unknown grid key"):
        load_grid(bad)
    # a wrong type is refused by the key's name (was read letter by letter, or failed with a traceback at the end)
    for text, message in (('tasks = "arc_challenge"', "tasks must be a list of task names"),
                          ('algorithms = "spear"', "algorithms must be a list of algorithm names"),
                          ("seeds = [0.5]", "seeds must be a list of integers"),
                          ("axes = [1]", "axes must be a table"), ("base = 5", "base must be a table"),
                          ("note = 5", "note must be a string"),
                          ("[per_task]\narc_challenge = 3", "per_task must be a table"),
                          ("[base]\nroundz = 3", "grid base: unknown config key 'roundz' (did you mean 'rounds'?)")):
        lines = text if text.startswith("tasks") else f'tasks = ["arc_challenge"]\n{text}'
        bad.write_text(lines + "\n")
        with pytest.raises(ConfigError, match=f"bad.toml: (grid: )?{re.escape(message)}"):
            load_grid(bad)


def test_presets_are_valid_and_cpu_small_has_the_issue_shape():
    grid = PRESETS["cpu-small"]
    assert grid.tasks == ["arc_challenge", "strategy_qa"]
    assert grid.algorithms == ["spear", "feedback_sft", "grpo", "opsd", "rltf_sd"] and grid.seeds == [0, 1, 2]
    assert len(grid.cells(Path("x"))) == 30


def test_cpu_qwen_preset_has_the_issue_shape():
    """Issue 7: ARC, all five algorithms (3 seeds since issue 17); log-likelihood on the whole test split at round 0
    and the end, generation on a fixed subset; the 1.5B model with gradient checkpointing."""
    grid = PRESETS["cpu-qwen1.5b"]
    cells = grid.cells(Path("x"))
    assert grid.tasks == ["arc_challenge"] and len(cells) == 15 and grid.seeds == [0, 1, 2]  # issue 17: 3 seeds
    assert {c.algorithm for c in cells} == {"spear", "feedback_sft", "grpo", "opsd", "rltf_sd"}
    cfg = cells[0].config
    assert cfg.model == "qwen2.5-coder-1.5b" and cfg.eval_size == 0 and 0 < cfg.eval_gen_size <= 200
    assert cfg.eval_every == cfg.rounds  # evaluated at round 0 and after the last round only
    assert cfg.gradient_checkpointing == "auto"


def test_mean_std_and_paired_interval_by_hand():
    assert mean_std([0.2, 0.4, 0.6]) == pytest.approx((0.4, 0.2))
    m, lo, hi = paired_ci([0.02, 0.04, 0.06])  # mean 0.04, s 0.02, t(2) 4.303 → half 0.04969
    assert (m, lo, hi) == pytest.approx((0.04, 0.04 - 0.049687, 0.04 + 0.049687), abs=1e-6)
    m, lo, hi = paired_ci([0.1])
    assert m == 0.1 and math.isnan(lo) and math.isnan(hi)


def test_item_paired_gain_and_accuracy_interval_by_hand():
    """Round 0 "1100", two seeds "1110" and "1010": per-item gains (0, −½, 1, 0) → mean 0.125, sd 0.629153,
    half-width 1.959964 · sd / 2; per-item final scores (1, ½, 1, 0) → 0.625, sd 0.478714, half-width 0.469131:
    0.625 + 0.469131 = 1.094131 is cut to 1 (no accuracy exceeds 100%)."""
    assert paired_gain("1100", ["1110", "1010"]) == pytest.approx((0.125, 0.125 - 0.616558, 0.125 + 0.616558),
                                                                   abs=1e-6)
    assert item_mean_ci(["1110", "1010"]) == pytest.approx((0.625, 0.625 - 0.469131, 1.0), abs=1e-6)
    assert paired_gain("0101", ["0101"]) == (0.0, 0.0, 0.0)  # the same answers: no gain, no spread
    for before, after in (("110", ["1110"]), ("1100", []), ("11x0", ["1100"]), ("", [""])):
        with pytest.raises(ValueError, match="same items"):
            paired_gain(before, after)


def test_item_paired_difference_between_two_algorithms_by_hand():
    """SPEAR "1100", "1010" against a baseline "0100", "1011" (seeds 0, 1): per-seed item differences (1, 0, 0, 0)
    and (0, 0, 0, −1) → item means (½, 0, 0, −½): mean 0, sd √(0.5 / 3) = 0.408248, half-width 1.959964 · sd / 2."""
    assert item_paired_diff(["1100", "1010"], ["0100", "1011"]) == pytest.approx((0.0, -0.400076, 0.400076),
                                                                                 abs=1e-6)
    assert item_paired_diff(["1100"], ["0100"]) == pytest.approx((0.25, 0.25 - 0.489991, 0.25 + 0.489991), abs=1e-6)
    with pytest.raises(ValueError, match="seed by seed"):
        item_paired_diff(["1100", "1010"], ["0100"])
    with pytest.raises(ValueError, match="same items"):
        item_paired_diff(["1100"], ["010"])


def test_accuracy_intervals_stay_within_their_range():
    """An audit found 50.0 [-6.6, 106.6] for one run right on 2 of 4 items: the normal interval 0.5 ± 1.959964 ·
    0.577350 / 2 = 0.5 ± 0.565792, now cut to [0, 1]; 3 of 4: 0.75 ± 1.959964 · 0.5 / 2 = 0.75 ± 0.489991 →
    [0.260009, 1]. Intervals of differences stay symmetric (margin_gap reads their half-width back): item
    differences (1, 1, 1, 0) → 0.75 ± 0.489991 = [0.260009, 1.239991]."""
    assert item_mean_ci(["1100"]) == pytest.approx((0.5, 0.0, 1.0), abs=1e-6)
    assert item_mean_ci(["1110"]) == pytest.approx((0.75, 0.260009, 1.0), abs=1e-6)
    assert item_paired_diff(["1111"], ["0001"]) == pytest.approx((0.75, 0.260009, 1.239991), abs=1e-6)
    assert paired_gain("0001", ["1111"]) == pytest.approx((0.75, 0.260009, 1.239991), abs=1e-6)


def test_margin_gap_between_two_tasks_by_hand():
    """SPEAR − baseline +8 [+2, +14] pp on one task, +3 [−1, +7] on another: gap 5, half-width √(6² + 4²) = 7.2111."""
    from fedspear.experiments.compare.stats import margin_gap

    assert margin_gap((0.08, 0.02, 0.14), (0.03, -0.01, 0.07)) == pytest.approx((0.05, -0.022111, 0.122111), abs=1e-6)
    with pytest.raises(ValueError, match="not a finite interval"):
        margin_gap((0.08, 0.09, 0.14), (0.03, -0.01, 0.07))
    with pytest.raises(ValueError, match="not a finite interval"):
        margin_gap((0.08, float("nan"), 0.14), (0.03, -0.01, 0.07))


@pytest.mark.slow
def test_compare_two_cells_end_to_end_and_resume(tmp_path):
    """The tiny preset (SPEAR and GRPO, 1 round each) through the CLI: comparison.md, comparison.json and the plots;
    the second cell reuses the first's round-0 evaluation; a re-run skips both cells."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "fedspear.cli", "compare", "--preset", "tiny", "--output-dir", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    text = (out / "comparison.md").read_text()
    assert "| SPEAR |" in text and "| GRPO |" in text and "SPEAR minus each baseline" in text
    assert "## Gain over round 0" in text and "| acc_ll | arc_challenge | – | GRPO |" in text
    assert "## Parsed and cut-off answers (generation)" in text and "| arc_challenge-grpo-s0 | " in text
    for name in ("accuracy_acc_gen", "accuracy_acc_ll", "wall_clock", "revisions_successful", "needing_revision"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
    data = json.loads((out / "comparison.json").read_text())
    assert {c["algorithm"] for c in data["cells"]} == {"spear", "grpo"}
    grpo_cell = out / "cells" / "arc_challenge-grpo-s0"
    round0 = json.loads((grpo_cell / "metrics.jsonl").read_text().splitlines()[0])
    assert round0["eval"]["reused_from"].endswith("arc_challenge-spear-s0")
    spear0 = json.loads((out / "cells" / "arc_challenge-spear-s0" / "metrics.jsonl").read_text().splitlines()[0])
    assert {k: v for k, v in round0["eval"].items() if k not in ("reused_from",)} == spear0["eval"]
    assert spear0["start_identity"] is True and round0["start_identity"] is True  # either may lend round 0 later
    assert spear0["device"] == round0["device"] == "cpu" and spear0["dtype"] == round0["dtype"]
    grpo_round = json.loads((grpo_cell / "metrics.jsonl").read_text().splitlines()[1])
    assert grpo_round["initial_samples"] == 8 and 0 <= grpo_round["initial_accuracy"] <= 1
    # each cell's round as test_algorithms checks the other algorithms' runs of the same settings: generations and
    # aggregation weight; the tiny model is never right, so SPEAR has no win and aggregates nothing
    from helpers import ONE_ROUND_EXPECTED as EXPECTED

    for algorithm in PRESETS["tiny"].algorithms:
        cell = out / "cells" / f"arc_challenge-{algorithm}-s0"
        r1 = json.loads((cell / "metrics.jsonl").read_text().splitlines()[1])
        generations, weight = EXPECTED[algorithm]
        assert (r1["round"], r1["generations"], r1["weight"], r1["clients_ok"]) == (1, generations, weight, 1)
        assert r1["aggregated"] == (weight > 0)
        assert (cell / "report.md").exists() and (cell / "adapters" / "round_0001").is_dir()
    # SPEAR − GRPO with an interval over the shared evaluation items (one seed: none over seeds)
    assert "95% CI over items" in text
    diffs = {d["metric"]: d for d in data["table"]["spear_minus"]}
    assert diffs["acc_ll"]["pairs"] == 1 and diffs["acc_ll"]["item_low"] <= diffs["acc_ll"]["diff"] \
        <= diffs["acc_ll"]["item_high"]

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already finished, skipped") == 2 and "running" not in again.stderr

    # --summary-only rewrites the summary naming the command that ran the cells and when the last cell ended
    assert f"Command: `fedspear compare --preset tiny --output-dir {out}`" in text
    run_line = next(line for line in text.splitlines() if line.startswith("Run: "))
    for metrics in (out / "cells").glob("*/metrics.jsonl"):
        os.utime(metrics, (0, datetime.datetime(2031, 1, 2, 3, 4).timestamp()))
    summary = subprocess.run(cmd + ["--summary-only"], capture_output=True, text=True, timeout=300)
    assert summary.returncode == 0, summary.stderr[-3000:]
    text = (out / "comparison.md").read_text()
    assert f"Command: `fedspear compare --preset tiny --output-dir {out}`" in text
    assert f"{run_line.split(' → ')[0]} → 2031-01-02 03:04" in text

    other = subprocess.run(cmd + ["--seeds", "5"], capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "holds another grid" in other.stderr

    # an interrupted cell is named and left out of the tables, not summarised from its last evaluation as final
    metrics = out / "cells" / "arc_challenge-grpo-s0" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole.splitlines(keepends=True)[0])  # stopped after round 0
    cut = subprocess.run(cmd + ["--summary-only"], capture_output=True, text=True, timeout=300)
    assert cut.returncode == 0, cut.stderr[-3000:]
    text = (out / "comparison.md").read_text()
    assert "**Not finished, left out of every table:** arc_challenge-grpo-s0 (round 0 of 1)." in text
    assert "| GRPO | – | – |" in text and "| SPEAR | – | – |" not in text
    assert {c["algorithm"] for c in json.loads((out / "comparison.json").read_text())["cells"]} == {"spear"}
    metrics.write_text(whole)

    # a cell's damaged record before its last line ends --summary-only with the file and line, not a traceback
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("{damaged\n" + "".join(lines[1:]))
    damaged = subprocess.run(cmd + ["--summary-only"], capture_output=True, text=True, timeout=300)
    assert damaged.returncode == 2 and "Traceback" not in damaged.stderr, damaged.stderr[-3000:]
    assert f"{metrics}, line 1" in " ".join(damaged.stderr.split())


def test_paper_grid_gives_each_cell_its_tables_values(tmp_path):
    """``compare --preset paper``: 4 tasks × 5 algorithms × 3 seeds, each cell with its own table's values."""
    from fedspear.paper_settings import paper_settings

    grid = PRESETS["paper"]
    cells = grid.cells(tmp_path)
    assert len(cells) == 4 * 5 * 3
    for cell in cells:
        cfg = cell.config
        for key, value in paper_settings(cell.task, cell.algorithm).items():
            assert getattr(cfg, key) == value, (cell.name, key)
    by_name = {c.name: c.config for c in cells}
    assert by_name["strategy_qa-grpo-s0"].kl_beta == 0.1 and by_name["strategy_qa-spear-s0"].lr_min == 5e-5
    assert by_name["arc_challenge-opsd-s1"].batch_size == 16 and by_name["arc_challenge-grpo-s1"].batch_size == 4
    # a --set lands in base and overrides the tables
    grid2 = Grid(**{**grid.to_dict(), "base": {"rounds": 1}})
    assert all(c.config.rounds == 1 for c in grid2.cells(tmp_path))
    assert load_grid_roundtrip(grid, tmp_path).to_dict() == grid.to_dict()


def load_grid_roundtrip(grid: Grid, tmp_path: Path) -> Grid:
    from fedspear.experiments.compare.grid import grid_toml

    path = tmp_path / "grid.toml"
    path.write_text(grid_toml(grid), encoding="utf-8")
    return load_grid(path)


def test_a_grid_toml_written_before_the_partitioner_key_matches_its_preset(tmp_path, monkeypatch):
    """A grid.toml written before the ``partitioner`` key existed (the cpu-qwen1.5b grid of 2026-11-25 was one: the
    committed one without that line) ran under the old rule, which the preset now pins, so resuming or extending it
    is allowed; a grid under the new default is refused."""
    import re

    import fedspear.experiments.compare.grid as compare_module

    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu-qwen1.5b" / "grid.toml"
    old_text = re.sub(r"(?m)^partitioner = .*\n", "", committed.read_text(encoding="utf-8"))
    assert "partitioner" not in old_text
    out = tmp_path / "grid"
    out.mkdir()
    (out / "grid.toml").write_text(old_text, encoding="utf-8")
    grid = PRESETS["cpu-qwen1.5b"]
    assert grid.base["partitioner"] == "dirichlet"
    calls = []
    monkeypatch.setattr(compare_module.stops, "call", lambda *a, **k: calls.append(a) or 1)
    with pytest.raises(RuntimeError, match="failed"):
        compare_module.run_grid(grid, out)  # the grid check passed: it went on to (fail to) run the first cell
    assert len(calls) == 1
    newer = Grid(**{**grid.to_dict(), "base": {**grid.base, "partitioner": "inner_dirichlet"}})
    with pytest.raises(ConfigError, match="another grid"):
        compare_module.run_grid(newer, out)


def test_opsd_authors_is_a_row_of_its_own(tmp_path):
    """Issue 17: both OPSD formulations in one grid; the variant row runs ``opsd`` with ``opsd_variant = authors``
    and otherwise the same settings (the paper preset's OPSD table included)."""
    grid = Grid(tasks=["strategy_qa"], algorithms=["opsd", "opsd_authors"], seeds=[0], settings="paper")
    original, authors = grid.cells(tmp_path)
    assert (original.name, authors.name) == ("strategy_qa-opsd-s0", "strategy_qa-opsd_authors-s0")
    a, b = original.config.to_dict(), authors.config.to_dict()
    assert (a["algorithm"], a["opsd_variant"]) == ("opsd", "original")
    assert (b["algorithm"], b["opsd_variant"]) == ("opsd", "authors")
    assert {k for k in a if a[k] != b[k]} == {"opsd_variant", "output_dir"}
    assert load_grid_roundtrip(grid, tmp_path).algorithms == ["opsd", "opsd_authors"]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_finished_grid_gains_a_seed_without_rerunning_its_cells(tmp_path, monkeypatch, precision):
    """Issue 17 (a third ARC seed, then any further one): the committed three-seed cpu-qwen1.5b results, extended to
    seeds 0–3, skip their 15 finished cells and start the first seed-3 cell. Its round 0 is lent by the first
    finished cell that can lend it: the committed cells of 2026-11-25 cannot (no ``config.toml``), GRPO seed 0 of
    2026-11-27 can (``config.toml`` and ``start_identity``; bf16 on CPU), but only where ``auto`` resolves to its
    precision: under fp32 the new cell evaluates its own round 0. Removing a seed is still refused."""
    import shutil

    import fedspear.experiments.compare.grid as compare_module

    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "cpu-qwen1.5b"
    out = tmp_path / "grid"
    shutil.copytree(committed, out, ignore=shutil.ignore_patterns("plots", "*.md", "*.json"))
    calls = []
    monkeypatch.setattr(compare_module.stops, "call", lambda *a, **k: calls.append(a[0]) or 1)
    monkeypatch.setattr(compare_module, "resolve_dtype", lambda *a: precision)  # this machine's `auto`, pinned
    grid = Grid(**{**PRESETS["cpu-qwen1.5b"].to_dict(), "seeds": [0, 1, 2, 3]})
    events = []
    with pytest.raises(RuntimeError, match="arc_challenge-spear-s3 failed"):
        compare_module.run_grid(grid, out, on_event=lambda kind, cell, _: events.append((kind, cell.name)))
    assert [e for e in events if e[0] == "skip"] == [("skip", c.name) for c in grid.cells(out)[:15]]
    assert events[-1] == ("start", "arc_challenge-spear-s3") and len(calls) == 1
    assert load_grid(out / "grid.toml").seeds == [0, 1, 2, 3]
    cell_toml = (out / "cells" / "arc_challenge-spear-s3" / "cell.toml").read_text()
    lender = f'\nround0_from = "{out / "cells" / "arc_challenge-grpo-s0"}"'
    assert (lender in cell_toml) == (precision == "bf16")
    assert cell_toml.count("\nround0_from =") == (precision == "bf16")
    with pytest.raises(ConfigError, match=r"another grid \(differs in: seeds\)"):
        compare_module.run_grid(Grid(**{**grid.to_dict(), "seeds": [0, 2]}), out)


def test_cpu_qwen_sqa_preset_has_the_issue_shape():
    """Issue 17: StrategyQA, six rows (both OPSD variants), seeds 0–2, N = 2, the paper's StrategyQA lr 1e-4 → 5e-5,
    τ 24, temperature 0.8, the authors' 256 tokens, generation on ≥ 500 fixed test items at round 0 and the end."""
    grid = PRESETS["cpu-qwen1.5b-sqa"]
    cells = grid.cells(Path("x"))
    assert grid.tasks == ["strategy_qa"] and grid.seeds == [0, 1, 2] and len(cells) == 18
    assert {(c.config.algorithm, c.config.opsd_variant) for c in cells if c.algorithm.startswith("opsd")} == {
        ("opsd", "original"), ("opsd", "authors")}
    for cell in cells:
        cfg = cell.config
        assert cfg.model == "qwen2.5-coder-1.5b" and cfg.max_revisions == 2
        assert (cfg.lr, cfg.lr_min, cfg.tau, cfg.temperature, cfg.max_new_tokens) == (1e-4, 5e-5, 24, 0.8, 256)
        assert cfg.eval_size >= 500 and cfg.eval_every == cfg.rounds and cfg.eval_generation
    from fedspear.algorithms import grpo

    settings = grpo.settings(next(c.config for c in cells if c.algorithm == "grpo"))
    assert (settings.group_size, settings.beta) == (2, 0.1)  # the paper's StrategyQA GRPO table


@pytest.mark.slow
def test_dp_settings_are_grid_axes_and_the_summary_gives_epsilon(tmp_path):
    """Issue 18: ``dp`` as a grid axis (off vs client-side clipping with z = 1, C = 0.5) on the tiny model, 2 rounds.
    The two cells differ only in ``dp``; the DP cell records ε per round and comparison.md/json give its final ε —
    the accountant's after 2 noised releases (4.728507 after 1 at z = 1, δ = 1e-5, by hand in test_dp); the
    cell without DP has none."""
    from fedspear.experiments.compare.grid import PRESETS
    from fedspear.config import RunConfig
    from fedspear.fl.privacy import PrivacyLedger

    base = {**PRESETS["tiny"].base, "rounds": 2, "dp_noise_multiplier": 1.0, "dp_clip_norm": 0.5,
            "user_flip_prob": 1.0}  # flipped verdicts: the tiny model's answers count as wins, updates are not zero
    grid = Grid(tasks=["arc_challenge"], algorithms=["spear"], seeds=[0], axes={"dp": ["off", "client"]}, base=base)
    plain, private = grid.cells(tmp_path)
    a, b = plain.config.to_dict(), private.config.to_dict()
    assert {k for k in a if a[k] != b[k]} == {"dp", "output_dir"}
    (tmp_path / "grid.toml").write_text(
        'tasks = ["arc_challenge"]\nalgorithms = ["spear"]\nseeds = [0]\n\n[axes]\ndp = ["off", "client"]\n\n[base]\n'
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in base.items()))
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "fedspear.cli", "compare", "--grid", str(tmp_path / "grid.toml"), "--output-dir",
           str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    ledger = PrivacyLedger(RunConfig(**{**base, "dp": "client"}).resolved())
    ledger.release()
    assert ledger.epsilon == pytest.approx(4.728507, abs=1e-6)
    ledger.release()
    assert ledger.epsilon == pytest.approx(7.077392, abs=1e-6)  # by hand in test_deploy's DP test
    data = json.loads((out / "comparison.json").read_text())
    by_name = {c["cell"]: c for c in data["cells"]}
    assert by_name["arc_challenge-spear-dp=off-s0"]["privacy"] is None
    spent = by_name["arc_challenge-spear-dp=client-s0"]["privacy"]
    assert spent["dp_releases"] == 2 and spent["dp_epsilon"] == pytest.approx(ledger.epsilon, rel=1e-12)
    text = (out / "comparison.md").read_text()
    assert "## Privacy spent" in text
    assert f"| arc_challenge-spear-dp=client-s0 | 1 | 0.5 | 2 | {ledger.epsilon:.3f} | 1e-05 |" in text
    assert "| arc_challenge-spear-dp=off-s0 |" not in text.split("## Privacy spent")[1].split("##")[0]
