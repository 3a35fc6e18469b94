"""Learning health (issue 41): the task-level reasoning rule on written answers, the ``revised_wins`` guard on
hand-made traces, the health figures worked out by hand, the warnings (a constructed collapse fires, a healthy run
does not), and the answer files (``fedspear.answers``)."""

from __future__ import annotations

import gzip
import json

import pytest

from fedspear.answers import (AUTO_TRACE_PROMPTS, eval_answers_path, keeps_traces, read_jsonl_gz, read_traces,
                              write_eval_answers, write_jsonl_gz, write_traces)
from fedspear.config import ConfigError, RunConfig
from fedspear.feedback import make_feedback
from fedspear.health import entropy_bits, eval_health, fmt_count, round_health, warnings_for
from fedspear.interaction import interact
from fedspear.report import round_text
from fedspear.tasks import arc_challenge, math_mcqa, strategy_qa
from fedspear.tasks.base import Example

REASONED_NO = ("Aristotle lived from 384 to 322 BC. The first laptop computers were sold in the 1980s, more than "
               "two thousand years later.\nAnswer: no")
REASONED_YES = ("Hydrogen has atomic number 1 and is the first element of the periodic table, and one is a "
                "perfect square.\nAnswer: yes")


@pytest.mark.parametrize(("task", "text", "expected"), [
    (strategy_qa, "Answer: no", False),
    (strategy_qa, "No.", False),
    (strategy_qa, "**Answer:** Yes", False),
    (strategy_qa, "Rome had no octagon cage. Answer: no", False),  # 5 words: a claim, not reasoning
    (strategy_qa, REASONED_NO, True),
    (strategy_qa, "Aristotle lived from 384 to 322 BC and laptops came in the 1980s, so the answer is no.", True),
    (strategy_qa, "Aristotle lived from 384 to 322 BC; laptops came 2,300 years later.\nNo", True),
    # reasoning cut off before any answer still reasons (it is unparsed, which the parse rate reports)
    (strategy_qa, "Let us think. Aristotle lived in ancient Greece, long before any electronic device was", True),
    (strategy_qa, "The answer is yes. The answer is yes. The answer is yes.", False),  # a loop: 8 words before
    (math_mcqa, "2 + 3 = 5 and 5 * 4 = 20, so dividing by 10 gives 2, which is option B.\nAnswer: B", True),
    (math_mcqa, "Answer: B", False),
    (math_mcqa, "\\boxed{C}", False),
    (arc_challenge, "Answer: B", False),
    (arc_challenge, "B", False),
])
def test_reasons_rule_on_written_answers(task, text, expected):
    """Each task's ``reasons``: ≥ 10 words (words and numbers) before the final answer statement, or before a short
    final line holding the lone answer; a completion without a final answer counts all its words."""
    assert task.reasons(text) is expected


def _sqa(uid: str, gold: str) -> Example:
    return Example(uid, f"Question {uid}?", ("yes", "no"), (), gold,
                   {"facts": ("Fact one about it.", "Fact two about it.")})


def _guard_run(tokenizer, revised_wins: str, log: list | None = None):
    """Four StrategyQA prompts, replayed attempts written by hand (y0, y1, …), judged by the dataset oracle:

    - p0 (gold no): y0 = bare "Answer: no", right → win from the initial answer (not guarded: on-policy);
    - p1 (gold yes): y0 = "Answer: no" wrong, y1 = bare "Answer: yes" right → a bare right revision;
    - p2 (gold yes): y0 wrong, y1 = reasoned "…Answer: yes" right → a reasoned right revision;
    - p3 (gold no): y0 wrong, y1 = "Answer: yes" wrong, y2 = bare "Answer: no" right → bare right at n = 2.
    """
    examples = [_sqa("p0", "no"), _sqa("p1", "yes"), _sqa("p2", "yes"), _sqa("p3", "no")]
    attempts = [["Answer: no"], ["Answer: no", "Answer: yes"], ["Answer: no", REASONED_YES],
                ["Answer: yes", "Answer: yes", "Answer: no"]]
    replay = [[tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in a] for a in attempts]
    oracle = make_feedback(strategy_qa, 0.0, 0.0, seed=0)
    return interact(None, tokenizer, examples, strategy_qa, oracle, max_revisions=2, replay=replay,
                    revised_wins=revised_wins, log=log)


def test_guard_drops_bare_right_revisions_and_keeps_the_rest(tiny):
    """With "all" (the paper) the wins are p0 (y0), p1 (y1), p2 (y1), p3 (y2) and y0 of p1, p2, p3 is lost with
    α = 1. With "reasoned" the bare right revisions of p1 and p3 are dropped: wins p0 (initial, bare but on-policy)
    and p2 (reasoned revision); the lose set is unchanged (y0 of p1, p2, p3 with α = 1: a right answer was reached,
    so y0 is confidently wrong; a right bare answer is never put in the lose set). Counters: 3 right revisions of
    which 2 bare, 2 guarded; wins = initial_correct + revisions_successful − revisions_guarded = 1 + 3 − 2 = 2."""
    _, tok = tiny
    paper = _guard_run(tok, "all")
    guarded = _guard_run(tok, "reasoned")
    assert [w.uid for w in paper.wins] == ["p0", "p1", "p2", "p3"]
    assert [w.uid for w in guarded.wins] == ["p0", "p2"]
    lose = sorted((t.uid, t.alpha) for t in paper.losses)
    assert lose == sorted((t.uid, t.alpha) for t in guarded.losses) == [("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]
    # the lose traces are y0, never the right revision
    assert all(tok.decode(t.completion_ids, skip_special_tokens=True) in ("Answer: no", "Answer: yes")
               and t.completion_ids == next(w for w in paper.losses if w.uid == t.uid).completion_ids
               for t in guarded.losses)
    p2_win = next(w for w in guarded.wins if w.uid == "p2")
    assert tok.decode(p2_win.completion_ids, skip_special_tokens=True) == REASONED_YES
    for res, dropped in ((paper, 0), (guarded, 2)):
        c = res.counters
        assert (c["initial_correct"], c["revisions_attempted"], c["revisions_successful"]) == (1, 4, 3)
        assert (c["revised_wins_bare"], c["revisions_guarded"]) == (2, dropped)
        assert len(res.wins) == c["initial_correct"] + c["revisions_successful"] - c["revisions_guarded"]
        # health counters: y0 all bare (0 of 4 reason); revisions: p1 y1, p2 y1, p3 y1, p3 y2 → only p2's reasons
        assert (c["initial_reasoned"], c["revisions_reasoned"]) == (0, 1)


def test_guard_log_records_attempts_feedback_and_outcomes(tiny):
    """The trace log: one record per prompt with every attempt, the feedback before each revision, the outcome."""
    _, tok = tiny
    log: list = []
    _guard_run(tok, "reasoned", log)
    assert [(r["uid"], r["outcome"], r["alpha"]) for r in log] == [
        ("p0", "win_initial", None), ("p1", "guarded", 1.0), ("p2", "win_revised", 1.0), ("p3", "guarded", 1.0)]
    p3 = log[3]["attempts"]
    assert [a["answer"] for a in p3] == ["yes", "yes", "no"] and [a["correct"] for a in p3] == [False, False, True]
    assert "feedback" not in p3[0] and p3[1]["feedback"].startswith("Incorrect. 'yes' is not the right answer.")
    assert all(a["eos"] and a["tokens"] == len(tok.encode(a["text"], add_special_tokens=False)) + 1 for a in p3)
    assert log[2]["attempts"][1]["reasons"] and not log[1]["attempts"][1]["reasons"]
    with pytest.raises(ValueError, match="revised_wins"):
        _guard_run(tok, "some")


def test_revised_wins_is_a_checked_config_key():
    assert RunConfig().revised_wins == "all" and RunConfig(revised_wins="reasoned").revised_wins == "reasoned"
    with pytest.raises(ConfigError, match="revised_wins"):
        RunConfig(revised_wins="bare")


def test_round_health_by_hand():
    """Two clients: initial answers 4 + 4 with 400 + 200 tokens, 3 + 1 reasoning → mean 75, reasoning 50%;
    revisions 2 + 0 with 100 tokens, 1 reasoning → mean 50, 50%; right revisions 2 (1 bare, 1 guarded) → wins
    revised 1, bare share 50%; medians: of the clients' medians (90, 40) → 65; revision median only from the client
    that revised (50)."""
    a = dict(initial_samples=4, initial_tokens=400, initial_reasoned=3, initial_tokens_median=90, initial_correct=2,
             revisions_attempted=2, revision_tokens=100, revisions_reasoned=1, revision_tokens_median=50,
             revisions_successful=2, revised_wins_bare=1, revisions_guarded=1)
    b = dict(initial_samples=4, initial_tokens=200, initial_reasoned=1, initial_tokens_median=40, initial_correct=4,
             revisions_attempted=0, revision_tokens=0, revisions_reasoned=0, revision_tokens_median=0,
             revisions_successful=0, revised_wins_bare=0, revisions_guarded=0)
    h = round_health([a, b])
    assert h == {"tokens_initial_mean": 75.0, "tokens_initial_median": 65.0, "tokens_revision_mean": 50.0,
                 "tokens_revision_median": 50.0, "reasoning_initial": 0.5, "reasoning_revision": 0.5,
                 "wins_initial": 6, "wins_revised": 1, "revised_wins_bare": 1, "bare_share_revised": 0.5,
                 "revisions_guarded": 1}
    assert round_health([{"prompts": 4}]) is None  # a baseline's reply: no health counters


def test_eval_health_by_hand():
    """Answers yes, yes, no, None (gold yes, no, no, yes); tokens 10, 20, 30, 100; reasoning T, F, T, F.
    Mean 40, median 25, reasoning 0.5; parsed labels yes 2, no 1 → entropy −(2/3 log2 2/3 + 1/3 log2 1/3) =
    0.918296 bits; top label share 2/4; gold yes 2, no 2."""
    h = eval_health(["no", "yes"], ["yes", "yes", "no", None], ["yes", "no", "no", "yes"], [10, 20, 30, 100],
                    [True, False, True, False])
    assert h["tokens_gen_mean"] == 40 and h["tokens_gen_median"] == 25 and h["reasoning_gen"] == 0.5
    assert h["label_entropy_gen"] == pytest.approx(0.918296, abs=1e-6) and h["top_label_share_gen"] == 0.5
    assert (h["gold_yes"], h["gold_no"]) == (2, 2)
    assert entropy_bits([4, 0]) == 0.0 and entropy_bits([1, 1, 1, 1]) == 2.0


def test_tables_keep_a_median_halfway_between_two_counts():
    """Tokens 10, 20, 31, 100: median (20 + 31) / 2 = 25.5, shown as 25.5 (Python's format rounds half to even:
    25.5 → 26 but 132.5 → 132); mean 161 / 4 = 40.25 shown as 40; whole counts stay whole."""
    h = eval_health(["no", "yes"], ["yes", "no", "no", "yes"], ["yes", "no", "no", "yes"], [10, 20, 31, 100],
                    [True] * 4)
    assert h["tokens_gen_median"] == 25.5 and f"{132.5:.0f}" == "132"
    assert (fmt_count(h["tokens_gen_mean"]), fmt_count(h["tokens_gen_median"])) == ("40", "25.5")
    assert (fmt_count(132.5), fmt_count(150.0), fmt_count(3), fmt_count(2.7), fmt_count(None)) == (
        "132.5", "150", "3", "3", "–")


def _eval(yes: int, no: int, reasoning: float, n: int = 100) -> dict:
    return {"n": n, "pred_no": no, "pred_yes": yes, "gold_no": 52, "gold_yes": 48, "reasoning_gen": reasoning}


def test_warning_fires_on_a_constructed_collapse_and_not_on_a_healthy_run():
    """Collapse: 97 of 100 answers "no" (> 80%) and reasoning 4% < half of round 0's 90% → two warnings, on the CLI
    line and in the record; healthy: 45 / 50 with reasoning 85% → none. ARC-like round 0 without reasoning (5%):
    the reasoning check stays silent."""
    round0 = _eval(30, 66, 0.9)
    collapsed = warnings_for(_eval(0, 97, 0.04), 4, round0)
    assert len(collapsed) == 2
    assert "97% of the 100 evaluation answers are 'no' (gold: 52%)" in collapsed[0]
    assert "4% of evaluation answers reason" in collapsed[1] and "round 0's 90%" in collapsed[1]
    assert warnings_for(_eval(45, 50, 0.85), 4, round0) == []
    assert warnings_for(_eval(45, 50, 0.0), 4, _eval(30, 66, 0.05)) == []
    assert warnings_for(_eval(81, 19, 0.9), 0, None)[0].startswith("round 0: answers collapse")
    assert warnings_for(None, 3, round0) == []
    record = {"round": 4, "wins": 3, "losses": 1, "revisions_successful": 1, "revisions_attempted": 2,
              "initial_correct": 2, "initial_samples": 4, "seconds": {"round": 10.0}, "eval": _eval(0, 97, 0.04),
              "health_warnings": collapsed}
    lines = round_text(record).splitlines()
    assert lines[0].startswith("round 4: wins 3") and lines[1].startswith("WARNING (learning health): round 4")


def test_a_run_whose_adapter_never_changed_says_so():
    """No round after 0 aggregated (zero wins everywhere, or empty rounds): one warning, at the top of report.md's
    warnings; a single round that aggregated, or a run that has only round 0, gives none."""
    from fedspear.report import _health_warning_lines, unchanged_adapter_warning

    kept = [{"round": 0}, {"round": 1, "aggregated": False}, {"round": 2, "aggregated": False, "empty": True}]
    warning = unchanged_adapter_warning(kept)
    assert warning.startswith("no round of this run changed the global adapter (rounds 1–2:")
    assert _health_warning_lines(kept) == [f"- **WARNING: {warning}**"]
    assert unchanged_adapter_warning([*kept, {"round": 3, "aggregated": True}]) is None
    assert unchanged_adapter_warning([{"round": 0}]) is None and unchanged_adapter_warning([]) is None


def test_answer_files_roundtrip_and_overwrite(tmp_path):
    """Files are gzip JSON Lines, written whole; writing a round again replaces it (a redone round after a resume
    neither duplicates nor loses records); the same records give the same bytes."""
    items = [{"uid": "a", "text": "Answer: no", "correct_gen": True}, {"uid": "b", "text": "ü", "tokens": 3}]
    path = write_eval_answers(tmp_path, 2, items)
    assert path == eval_answers_path(tmp_path, 2) == tmp_path / "answers" / "round_0002.jsonl.gz"
    assert read_jsonl_gz(path) == items
    first = path.read_bytes()
    write_eval_answers(tmp_path, 2, items)
    assert path.read_bytes() == first and read_jsonl_gz(path) == items
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        assert [json.loads(line)["uid"] for line in fh] == ["a", "b"]
    write_traces(tmp_path / "traces", 1, 3, [{"uid": "x"}])
    write_traces(tmp_path / "traces", 1, 3, [{"uid": "y"}])  # the redone round replaces the file
    write_traces(tmp_path / "traces", 2, 0, [{"uid": "z"}])
    assert read_traces(tmp_path / "traces") == [{"uid": "y", "round": 1, "partition_id": 3},
                                                {"uid": "z", "round": 2, "partition_id": 0}]
    assert not list(tmp_path.rglob("*.tmp"))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="bad.jsonl.gz"):
        read_jsonl_gz(tmp_path / "bad.jsonl.gz")
    assert write_jsonl_gz(tmp_path / "empty.jsonl.gz", []).stat().st_size > 0


def test_traces_of_a_rejected_client_round_are_marked_not_accepted(tmp_path):
    """Round 1 aggregates partition 3 and rejects partition 5 (an ``error`` entry, as ``fedspear.fl.server_app``
    writes it); round 2 aggregates nothing; round 3 has no record (the round in flight at a stop)."""
    for r, p in ((1, 3), (1, 5), (2, 0), (3, 1)):
        write_traces(tmp_path / "traces", r, p, [{"uid": f"{r}-{p}"}])
    records = [{"round": 0},
               {"round": 1, "aggregated": True, "clients": [
                   {"partition-id": 3, "node_id": 11, "num-wins": 2},
                   {"node_id": 12, "error": "update norm 9.1 over max_update_norm 5.0", "partition-id": 5}]},
               {"round": 2, "aggregated": False, "clients": [{"partition-id": 0, "node_id": 10, "num-wins": 0}]}]
    marked = read_traces(tmp_path / "traces", records=records)
    assert [(t["uid"], t["accepted"]) for t in marked] == [("1-3", True), ("1-5", False), ("2-0", False),
                                                           ("3-1", None)]
    assert "accepted" not in read_traces(tmp_path / "traces")[0]  # without records nothing is claimed
    assert [t["uid"] for t in read_traces(tmp_path / "traces", 1, records=records)] == ["1-3", "1-5"]


def test_keep_traces_auto_threshold():
    """auto: on while rounds × clients_per_round × rollouts_per_round ≤ 2000 prompts."""
    small = RunConfig(rounds=4, num_clients=10, clients_per_round=2, rollouts_per_round=4)  # 32 prompts
    large = RunConfig(rounds=100, num_clients=50, clients_per_round=5, rollouts_per_round=80)  # 40,000
    assert keeps_traces(small) and not keeps_traces(large) and AUTO_TRACE_PROMPTS == 2000
    assert keeps_traces(RunConfig(rounds=100, num_clients=50, clients_per_round=5, rollouts_per_round=80,
                                  keep_traces="on"))
    assert not keeps_traces(RunConfig(keep_traces="off"))


def test_a_tiny_run_keeps_answers_traces_and_health_and_a_resume_duplicates_nothing(tmp_path):
    """``fedspear run`` with the tiny random model on StrategyQA (Flower simulation), 2 rounds, guard on: the run
    directory holds round 0's and round 2's answers per item, each client-round's traces, and the health figures in
    metrics.jsonl, report.md and TensorBoard. Then round 2's metrics line is torn (a crash): the resumed run redoes
    round 2 and rewrites its files, so the answers and traces hold the same records, none twice."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    cmd = [str(Path(sys.executable).with_name("fedspear")), "run", "--model", "tiny-random", "--task", "strategy_qa",
           "--rounds", "2", "--clients", "2", "--clients-per-round", "1", "--rollouts-per-round", "3",
           "--eval-size", "6", "--set", "local_steps=1", "--set", "batch_size=2", "--set", "train_size=20",
           "--set", "max_new_tokens=8", "--set", "lora_r=4", "--set", "lora_alpha=8", "--set", "dtype=fp32",
           "--set", "tensorboard=true", "--set", "revised_wins=reasoned", "-o", str(out)]

    def run():
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def kept():
        answers = {p.name: read_jsonl_gz(p) for p in sorted((out / "answers").glob("*.gz"))}
        return answers, read_traces(out / "traces")

    run()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    answers, traces = kept()
    assert sorted(answers) == ["round_0000.jsonl.gz", "round_0002.jsonl.gz"]  # evaluated rounds (eval_every 2: 0 and 2)
    for items in answers.values():
        assert len(items) == 6 and len({i["uid"] for i in items}) == 6
        assert all({"uid", "gold", "text", "answer_gen", "correct_gen", "tokens", "cutoff", "reasons"} <= set(i)
                   for i in items)
        assert all(1 <= i["tokens"] <= 8 for i in items)
    assert [(t["round"], t["partition_id"]) for t in traces].count((1, traces[0]["partition_id"])) == 3
    assert len(traces) == 6 and all(t["attempts"] and t["outcome"] in ("win_initial", "win_revised", "guarded", "lose")
                                    for t in traces)
    # no client is rejected here: each trace is accepted exactly when its round aggregated (the partition ids the
    # clients report match their trace files')
    marked = read_traces(out / "traces", records=records)
    assert [t["accepted"] for t in marked] == [records[t["round"]]["aggregated"] for t in marked]
    for r in records:
        ev = r.get("eval")
        if ev:
            assert {"tokens_gen_mean", "tokens_gen_median", "reasoning_gen", "label_entropy_gen", "gold_yes",
                    "gold_no", "pred_yes", "parsed_gen", "cutoff_gen"} <= set(ev)
            assert ev["tokens_gen_mean"] == sum(i["tokens"] for i in answers[f"round_{r['round']:04d}.jsonl.gz"]) / 6
            assert r["health_warnings"] == []  # a tiny model parses nothing: no label to collapse to
        if r["round"] > 0:
            h = r["health"]
            assert h["tokens_initial_mean"] == sum(t["attempts"][0]["tokens"] for t in traces
                                                   if t["round"] == r["round"]) / 3
            assert h["wins_initial"] + h["wins_revised"] == r["wins"] and h["revisions_guarded"] >= 0
    report = (out / "report.md").read_text()
    assert "## Learning health" in report and "| 2 | " in report.split("## Learning health")[1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("health/tokens_initial_mean")] == [1, 2]
    assert [e.step for e in board.Scalars("health/eval_tokens_gen_mean")] == [0, 2]

    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    run()
    again_answers, again_traces = kept()
    assert again_answers == answers  # round 2 redone with the same seeds: the same answers, once
    assert [(t["round"], t["partition_id"], t["uid"]) for t in again_traces] == [
        (t["round"], t["partition_id"], t["uid"]) for t in traces]


def test_health_reaches_tensorboard_tags_and_the_compare_summary():
    """The record's health figures become ``health/*`` scalars, and compare's summary lists them per cell and round
    with the cell's warnings first; ``revised_wins`` is a grid axis and every cell keeps its traces."""
    from pathlib import Path

    from fedspear.experiments.compare.grid import AXES, PRESETS
    from fedspear.experiments.compare.summary import health_lines
    from fedspear.tensorboard import scalars

    ev = {**_eval(0, 97, 0.04), "tokens_gen_mean": 6.0, "tokens_gen_median": 5.0, "label_entropy_gen": 0.0,
          "top_label_share_gen": 0.97, "parsed_gen": 0.97, "cutoff_gen": 0.0}
    health = {"tokens_initial_mean": 30.0, "reasoning_initial": 0.25, "wins_initial": 3, "wins_revised": 2,
              "bare_share_revised": 0.5, "revisions_guarded": 1, "tokens_revision_mean": None}
    tags = scalars({"round": 4, "eval": ev, "health": health})
    assert tags["health/eval_tokens_gen_mean"] == 6.0 and tags["health/eval_top_label_share_gen"] == 0.97
    assert tags["health/tokens_initial_mean"] == 30.0 and tags["health/revisions_guarded"] == 1
    assert "health/tokens_revision_mean" not in tags  # None is left out
    row = {"cell": "strategy_qa-spear-s0", "health_warnings": ["round 4: answers collapse to one label — …"],
           "health": [{"round": 4, **ev, "labels": {"no": 97, "yes": 0}, "gold": {"no": 52, "yes": 48}, **health}]}
    text = "\n".join(health_lines([row]))
    assert text.startswith("## Learning health")
    assert "- **WARNING strategy_qa-spear-s0: round 4: answers collapse" in text
    assert "| strategy_qa-spear-s0 | 4 | 6 / 5 | 4 | no 97 (52), yes 0 (48) | 0.00 | 97 | 97 | 0 | 30 | 25 | – | – " \
           "| 3 + 2 | 50 | 1 |" in text
    assert health_lines([{"cell": "x", "health_warnings": [], "health": [{"round": 0}]}]) == []
    assert "revised_wins" in AXES
    grid = PRESETS["cpu-qwen1.5b-sqa"].overridden(algorithms="spear", vary=["revised_wins=all,reasoned"])
    cells = grid.cells(Path("runs/x"))
    assert [(c.config.revised_wins, c.config.seed) for c in cells] == [
        ("all", 0), ("all", 1), ("all", 2), ("reasoned", 0), ("reasoned", 1), ("reasoned", 2)]
    assert all(c.config.keep_traces == "on" for c in cells)
