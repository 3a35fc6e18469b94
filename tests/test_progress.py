"""Progress inside a round (``fedspear.progress``): what a client and the evaluation record, in which order and how
far, and how the CLI draws it. Off unless ``FEDSPEAR_PROGRESS_DIR`` is set (the simulation sets it)."""

from __future__ import annotations

import io
import json

import pytest

from fedspear import progress
from fedspear.progress import ENV, describe, read

from helpers import make_worker, nonzero_start


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """Every state written, in order (the file itself only keeps the last)."""
    monkeypatch.setenv(ENV, str(tmp_path / "progress"))
    monkeypatch.setattr(progress, "MIN_INTERVAL", 0.0)  # keep every intermediate state
    states: list[dict] = []
    original = progress.Reporter.write

    def write(self, force=False):
        original(self, force)
        states.append(dict(self.state))

    monkeypatch.setattr(progress.Reporter, "write", write)
    yield states
    progress.stop()


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)

    def never(self, force=False):
        raise AssertionError("a progress file was written with FEDSPEAR_PROGRESS_DIR unset")

    monkeypatch.setattr(progress.Reporter, "write", never)
    progress.start("client 0", 1)
    with progress.phase("training", total=3):
        progress.advance()
    progress.finish()
    assert not progress.active()


def test_an_unwritable_folder_never_ends_a_round(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(ENV, str(tmp_path / "file" / "progress"))  # below a regular file: every write fails
    progress.start("client 0", 1)
    with progress.phase("training", total=2):
        progress.advance()
        progress.expect(3)
    progress.finish()
    progress.stop()
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # and no temp file left behind


def test_a_top_level_phase_returns_to_none(recorded):
    progress.start("server", 2)
    with progress.phase("aggregation"):
        pass
    progress.advance(5)  # outside any phase: counted nowhere
    with progress.phase("evaluation: generation", total=4):
        with progress.phase("inner", total=1):
            progress.advance()
        progress.advance(2)
    assert recorded[-1]["phase"] == "evaluation: generation" and recorded[-1]["done"] == 4  # ends at its total
    # starts at 0 (the 5 outside any phase went nowhere); the inner phase's unit is not its parent's
    assert [s["done"] for s in recorded if s["phase"] == "evaluation: generation"] == [0, 2, 4]
    assert progress._reporter.state["phase"] is None


def test_client_round_reports_each_phase_up_to_its_total(recorded, tmp_path, always_right, scripted):
    worker = make_worker(max_revisions=1)
    start = nonzero_start(worker)
    # 3 prompts: the first right at once, the other two wrong then revised (one right): wins and losses to train on
    items = [worker.examples[i] for i in range(3)]
    script = {items[0].uid: [True], items[1].uid: [False, True], items[2].uid: [False, False]}
    worker.round(worker.loaded, start, [0, 1, 2], partition_id=1, server_round=4, lr=1e-3,
                 feedback_source=scripted(script))

    phases = [s["phase"] for s in recorded]
    order = [p for i, p in enumerate(phases) if p and (i == 0 or phases[i - 1] != p)]
    assert order == ["initial answers", "revision 1", "training", "done"]
    assert all(s["who"] == "client 1" and s["round"] == 4 for s in recorded)
    assert all(s["done"] <= s["total"] for s in recorded if s["phase"] not in (None, "done"))
    last = {p: [s for s in recorded if s["phase"] == p][-1] for p in order[:-1]}
    # generation: one batch per phase, its whole token budget (4) done at the end; training: 2 steps × 1 micro-step
    assert (last["initial answers"]["done"], last["initial answers"]["total"]) == (4, 4)
    assert (last["initial answers"]["unit"] == "tokens"
            and (last["revision 1"]["done"], last["revision 1"]["total"]) == (4, 4))
    assert (last["training"]["done"], last["training"]["total"], last["training"]["unit"]) == (2, 2, "micro-steps")
    # tokens are counted as they are decoded, not only at the end
    assert any(0 < s["done"] < 4 for s in recorded if s["phase"] == "initial answers")
    assert read(tmp_path / "progress")[0]["phase"] == "done"  # the file keeps the last state


def test_evaluation_reports_generation_batches_and_loglik_items(recorded, tiny, arc_items):
    from fedspear.evaluation import evaluate
    from fedspear.tasks import arc_challenge

    progress.start("server", 0)
    model, tokenizer = tiny
    evaluate(model, tokenizer, arc_items, arc_challenge, max_new_tokens=3, batch_size=4, generation_size=5)
    gen = [s for s in recorded if s["phase"] == "evaluation: generation"]
    ll = [s for s in recorded if s["phase"] == "evaluation: log-likelihood"]
    # 5 items in batches of 4: 2 batches × 3 decode steps, the whole total known before the first step (for the ETA)
    assert {s["total"] for s in gen if s["total"]} == {6} and (gen[-1]["done"], gen[-1]["total"]) == (6, 6)
    assert (ll[-1]["done"], ll[-1]["total"], ll[-1]["unit"]) == (1, 1, "items")  # the 6th by one forward


def test_describe_by_hand():
    state = {"who": "client 7", "round": 3, "phase": "revision 1", "done": 120, "total": 480, "unit": "tokens",
             "phase_started": 1000.0}
    assert describe(state, now=1042.0) == "round 3 · client 7 · revision 1 · 120/480 tokens · 0:42 · ETA 2:06"
    assert describe({"who": "server", "round": 0, "phase": "evaluation: generation", "done": 0, "total": 0,
                     "phase_started": 0.0}, now=3725.0) == "round 0 · server · evaluation: generation · 1:02:05"


def test_watcher_draws_one_row_per_busy_process(tmp_path):
    from rich.console import Console
    from rich.progress import Progress

    from fedspear.cli import PhaseWatcher

    folder = tmp_path / "progress"
    folder.mkdir()
    busy = {"who": "client 2", "round": 1, "phase": "training", "done": 1, "total": 4, "unit": "micro-steps",
            "phase_started": 0.0}
    (folder / "client-2.json").write_text(json.dumps(busy))
    (folder / "client-5.json").write_text(json.dumps({**busy, "who": "client 5", "phase": "done"}))
    (folder / "server.json").write_text("{torn")  # mid-replace: skipped this time
    bars = Progress(console=Console(file=io.StringIO(), force_terminal=True))
    watcher = PhaseWatcher(bars, folder)
    watcher.refresh()
    tasks = {t.description: t for t in bars.tasks}
    assert len(tasks) == 1
    (text, task), = tasks.items()
    assert text.startswith("round 1 · client 2 · training · 1/4 micro-steps") and (task.completed, task.total) == (1, 4)
    (folder / "client-2.json").write_text(json.dumps({**busy, "phase": "done"}))
    watcher.refresh()
    assert not bars.tasks  # a finished client's row goes away
    # a client left in round 1 (dropped mid-round) while the server is in round 2: no stale row
    (folder / "client-2.json").write_text(json.dumps(busy))
    (folder / "server.json").write_text(json.dumps({**busy, "who": "server", "round": 2,
                                                    "phase": "waiting for clients"}))
    watcher.refresh()
    assert [t.description.split(" · ")[1] for t in bars.tasks] == ["server"]


def test_watcher_thread_draws_while_the_run_goes_on(tmp_path):
    import time

    from rich.console import Console
    from rich.progress import Progress

    from fedspear.cli import PhaseWatcher

    folder = tmp_path / "progress"
    folder.mkdir()
    bars = Progress(console=Console(file=io.StringIO(), force_terminal=True))
    with PhaseWatcher(bars, folder) as watcher:
        (folder / "client-0.json").write_text(json.dumps({"who": "client 0", "round": 1, "phase": "training",
                                                          "done": 1, "total": 2, "phase_started": time.time()}))
        (folder / "bad.json").write_text("[1, 2]")  # not a state: ignored, the thread goes on
        deadline = time.time() + 10
        while not bars.tasks and time.time() < deadline:
            time.sleep(0.1)
        assert [t.completed for t in bars.tasks] == [1]
        assert watcher._thread.is_alive()
    assert not watcher._thread.is_alive() and not bars.tasks  # stopped, rows removed
    # not a terminal (CI, nohup): no thread at all
    with PhaseWatcher(Progress(console=Console(file=io.StringIO())), folder) as quiet:
        assert quiet._thread is None
