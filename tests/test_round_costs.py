"""scripts/round_costs.py: seconds per round over the rounds kept, and the Welch interval, checked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "round_costs.py"


@pytest.fixture(scope="module")
def costs(file_module):
    return file_module(SCRIPT, "round_costs")


def write_cell(grid: Path, name: str, rounds: list[tuple[float, float]]) -> None:
    """A cell whose round r (1…) took ``rounds[r-1] = (seconds.round, seconds.evaluate)``, after a round-0 record."""
    cell = grid / "cells" / name
    cell.mkdir(parents=True)
    records = [{"round": 0, "eval": {"n": 4}}]
    records += [{"round": r, "tokens_generated": 100 * r,
                 "seconds": {"round": total, "evaluate": ev, "generate_initial": 1.0, "generate_revisions": 2.0,
                             "train": 3.0}} for r, (total, ev) in enumerate(rounds, start=1)]
    (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_welch_by_hand(costs):
    # a: mean 20, variance 100 over 3; b: mean 10, variance 0 over 4 → se = √(100/3) = 5.7735, df = 2, t = 4.3027
    diff, low, high = costs.welch([10.0, 20.0, 30.0], [10.0, 10.0, 10.0, 10.0])
    assert diff == pytest.approx(10.0)
    assert low == pytest.approx(10.0 - 4.302653 * 5.773503, abs=1e-4)
    assert high == pytest.approx(10.0 + 4.302653 * 5.773503, abs=1e-4)
    assert all(math.isnan(x) for x in costs.welch([1.0], [2.0, 3.0])[1:])


def test_exclusions_and_evaluation_are_left_out(costs, tmp_path):
    # SPEAR s0 rounds: 100 s, 200 s + 50 s of evaluation (→ 150), 900 s (shared with other work, excluded)
    write_cell(tmp_path, "arc_challenge-spear-s0", [(100.0, 0.0), (200.0, 50.0), (900.0, 0.0)])
    write_cell(tmp_path, "arc_challenge-spear-s1", [(80.0, 0.0)])
    write_cell(tmp_path, "arc_challenge-opsd_authors-s0", [(60.0, 0.0), (70.0, 0.0)])
    write_cell(tmp_path, "arc_challenge-grpo-s0", [(1.0, 0.0)])  # excluded whole (another machine kind)
    kept = costs.read_rounds(tmp_path, ["arc_challenge-spear-s0:3", "arc_challenge-grpo-s0"])
    assert sorted(kept) == ["opsd_authors", "spear"]
    assert [costs.training_seconds(r) for r in kept["spear"]] == [100.0, 150.0, 80.0]
    text = costs.report(kept, "spear")
    assert "| rounds counted | 3 | 2 |" in text
    assert "| s / round, mean (median) | 110 (100) | 65 (65) |" in text
    assert "| range | 80–150 | 60–70 |" in text
    assert "| tokens generated per round | 133 | 150 |" in text  # SPEAR rounds 1, 2, 1: (100 + 200 + 100) / 3
    assert "| OPSD (authors) | +45 |" in text


@pytest.mark.parametrize("exclude, message", [
    (["arc_challenge-spear-s9"], "names no cell"),
    (["arc_challenge-spear-s0:7"], "rounds the cells do not have"),
    (["arc_challenge-spear-s0:x"], "expected <cell> or <cell>:<round>"),
])
def test_bad_exclusions_are_refused(costs, tmp_path, exclude, message):
    write_cell(tmp_path, "arc_challenge-spear-s0", [(100.0, 0.0)])
    with pytest.raises(SystemExit, match=message):
        costs.read_rounds(tmp_path, exclude)


def test_no_cells_and_unknown_reference_are_refused(costs, tmp_path):
    with pytest.raises(SystemExit, match="holds no cell"):
        costs.read_rounds(tmp_path, [])
    write_cell(tmp_path, "arc_challenge-grpo-s0", [(10.0, 0.0)])
    with pytest.raises(SystemExit, match="--reference spear"):
        costs.report(costs.read_rounds(tmp_path, []), "spear")
