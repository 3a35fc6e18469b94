"""scripts/guard_summary.py: the StrategyQA guard comparison's verdict rules and paired differences, on hand-made
cells whose figures are checked by hand."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "guard_summary.py"


@pytest.fixture(scope="module")
def gs(file_module):
    return file_module(SCRIPT, "guard_summary")


def _eval(outcomes: str, reasoning: float, top: float, yes: int) -> dict:
    n = len(outcomes)
    return {"n": n, "correct_gen": outcomes, "parsed_gen": 1.0, "cutoff_gen": 0.0, "pred_yes": yes, "pred_no": n - yes,
            "tokens_gen_mean": 50.0, "tokens_gen_median": 40.0, "reasoning_gen": reasoning,
            "top_label_share_gen": top, "gold_yes": 5, "gold_no": 5}


def _cell(root: Path, arm: str, seed: int, final: dict, rounds: int = 2) -> Path:
    cell = root / "cells" / f"strategy_qa-spear-revised_wins={arm}-s{seed}"
    (cell / "answers").mkdir(parents=True)
    records = [{"round": 0, "eval": _eval("1111100000", 1.0, 0.5, 5)}]
    records += [{"round": r, "wins": 3, "health": {"wins_initial": 2, "wins_revised": 1, "bare_share_revised": 1.0,
                                                    "revisions_guarded": int(arm == "reasoned")}}
                for r in range(1, rounds)]
    records.append({"round": rounds, "eval": final, "health": {"wins_initial": 2, "wins_revised": 1}})
    (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (cell / "config.toml").write_text(f'task = "strategy_qa"\nrounds = {rounds}\n')
    for r in (0, rounds):
        with gzip.open(cell / "answers" / f"round_{r:04d}.jsonl.gz", "wt") as f:
            for i in range(10):
                row = {"uid": f"u{i}", "gold": "yes", "answer_gen": "yes", "text": "t", "tokens": 3}
                f.write(json.dumps(row) + "\n")
    return cell


def test_collapse_rule_reads_reasoning_share_and_label_share(gs):
    round0 = gs.eval_row(_eval("1111100000", 0.8, 0.5, 5))
    assert gs.collapsed(gs.eval_row(_eval("1111100000", 0.41, 0.5, 5)), round0) == []  # 0.41 ≥ 0.8 / 2
    assert gs.collapsed(gs.eval_row(_eval("1111100000", 0.39, 0.5, 5)), round0) == ["reasoning share 80% → 39%"]
    assert gs.collapsed(gs.eval_row(_eval("1111100000", 0.8, 0.9, 9)), round0) == ["one label on 90% of answers"]
    assert gs.collapsed(gs.eval_row(_eval("1111100000", 0.8, 0.8, 8)), round0) == []  # more than 80% is needed
    # as fedspear.health: no reasoning to lose when round 0 reasons on under 10% (a task that asks for a bare letter)
    assert gs.collapsed(gs.eval_row(_eval("1111100000", 0.0, 0.5, 5)), gs.eval_row(_eval("11", 0.09, 0.5, 1))) == []


@pytest.mark.parametrize("items", [100, 10])
def test_three_seeds_collapsed_and_guarded_give_supported_verdicts(gs, tmp_path, items):
    # SPEAR collapses in every seed (reasoning 100% → 20%); the guard keeps 90%. Outcomes per seed: the guard is
    # right on one more item (item 5) than SPEAR in seeds 0 and 1, the same in seed 2 → item 5 scores 2/3, every
    # other item 0: difference 2/3 / items, sd over items by hand.
    base = "11111" + "0" * (items - 5)
    for seed in range(3):
        _cell(tmp_path, "all", seed, _eval(base, 0.2, 0.6, 6))
        guard = "111111" + "0" * (items - 6) if seed < 2 else base
        _cell(tmp_path, "reasoned", seed, _eval(guard, 0.9, 0.6, 6))
    s = gs.summarise(tmp_path)
    assert s["seeds_paired"] == [0, 1, 2]
    assert s["pairs"]["0"][0] == pytest.approx(1 / items) and s["pairs"]["2"][0] == pytest.approx(0.0)
    diff, low, high = s["pairs"]["pooled"]
    m = 2 / 3 / items
    sd = (((2 / 3 - m) ** 2 + (items - 1) * m ** 2) / (items - 1)) ** 0.5
    assert diff == pytest.approx(m)
    assert (high - low) / 2 == pytest.approx(1.959964 * sd / items ** 0.5)
    v = s["verdicts"]
    assert v["collapse"].startswith("supported (3 of 3")
    assert v["guard_prevents"].startswith("supported (the guard kept reasoning in 3 of 3")
    if items == 100:  # lower end −0.6 points, above the −3-point margin: no cost beyond the margin
        assert low > -gs.MARGIN and v["accuracy_cost"].startswith("does not cost accuracy: supported")
    else:  # 10 items: the interval reaches −6.4 points, past the margin, and does not lie below 0
        assert low < -gs.MARGIN < 0 < high and v["accuracy_cost"].startswith("undecided")


def test_the_evaluation_table_shows_two_bare_answers_of_500(gs, tmp_path):
    # 498 of 500 answers reason: 99.6%, which a whole-percent format would print as 100% and hide the two bare ones
    for arm in ("all", "reasoned"):
        _cell(tmp_path, arm, 0, _eval("1111100000", 498 / 500, 0.6, 6))
    evaluation = gs.tables(gs.summarise(tmp_path)).split("\n\n")[0]  # the first table; training follows
    final_rows = [r for r in evaluation.splitlines() if r.startswith("| all s0 | 2 ")]
    assert len(final_rows) == 1 and "| 99.6% |" in final_rows[0]


def test_an_interval_below_zero_is_a_cost(gs, tmp_path):
    for seed in range(3):
        _cell(tmp_path, "all", seed, _eval("1" * 50 + "0" * 50, 0.2, 0.6, 6))
        _cell(tmp_path, "reasoned", seed, _eval("1" * 20 + "0" * 80, 0.9, 0.6, 6))
    diff, low, high = gs.summarise(tmp_path)["pairs"]["pooled"]
    assert diff == pytest.approx(-0.3) and high < 0
    assert gs.summarise(tmp_path)["verdicts"]["accuracy_cost"].startswith("costs accuracy: supported")


def test_fewer_seeds_leave_every_verdict_undecided(gs, tmp_path):
    _cell(tmp_path, "all", 0, _eval("0000000000", 0.1, 1.0, 10))
    _cell(tmp_path, "reasoned", 0, _eval("1111100000", 0.9, 0.5, 5))
    _cell(tmp_path, "all", 1, _eval("1111100000", 1.0, 0.5, 5))  # no guard cell for seed 1 yet
    s = gs.summarise(tmp_path)
    assert s["seeds_paired"] == [0]
    assert s["pairs"]["0"][0] == pytest.approx(0.5)
    assert s["cells"]["strategy_qa-spear-revised_wins=all-s0"]["collapsed"] == [
        "reasoning share 100% → 10%", "one label on 100% of answers"]
    assert all(v.startswith("undecided") for v in s["verdicts"].values()), s["verdicts"]
    assert "1 of 2 SPEAR seeds collapsed" in s["verdicts"]["collapse"]


def test_unfinished_cells_are_left_out_and_the_command_says_so(gs, tmp_path, capsys):
    cell = tmp_path / "cells" / "strategy_qa-spear-revised_wins=all-s0"
    cell.mkdir(parents=True)
    (cell / "metrics.jsonl").write_text(json.dumps({"round": 0, "eval": _eval("10", 1.0, 0.5, 1)}) + "\n")
    assert gs.load_cells(tmp_path) == {}
    # a mid-run evaluation (round 2 of 4, eval_every = 2) is not a final one
    mid = _cell(tmp_path, "reasoned", 0, _eval("10", 1.0, 0.5, 1), rounds=2)
    (mid / "config.toml").write_text('task = "strategy_qa"\nrounds = 4\n')
    assert gs.load_cells(tmp_path) == {}
    assert gs.main([str(tmp_path)]) == 1
    assert "no finished cell" in capsys.readouterr().err
    assert gs.main([str(tmp_path / "nowhere")]) == 2


def test_copy_keeps_records_answers_and_traces_but_not_adapters(gs, tmp_path):
    root = tmp_path / "run"
    for arm in ("all", "reasoned"):
        cell = _cell(root, arm, 0, _eval("1111100000", 0.9, 0.5, 5))
        (cell / "adapters" / "round_0001").mkdir(parents=True)
        (cell / "traces" / "round_0001").mkdir(parents=True)
        (cell / "traces" / "round_0001" / "client_0001.jsonl.gz").write_bytes(b"x")
    out = tmp_path / "page"
    assert gs.main([str(root), "--copy", str(out)]) == 0
    kept = out / "cells" / "strategy_qa-spear-revised_wins=reasoned-s0"
    assert (kept / "metrics.jsonl").is_file() and (kept / "answers" / "round_0002.jsonl.gz").is_file()
    assert (kept / "traces" / "round_0001" / "client_0001.jsonl.gz").is_file() and not (kept / "adapters").exists()
    assert json.loads((out / "summary.json").read_text())["seeds_paired"] == [0]
