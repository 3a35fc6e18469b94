"""The node's trace store (SQLite): the conversation rules, rows kept across a restart, malformed rows refused."""

from __future__ import annotations

import sqlite3

import pytest

from fedspear.human.store import SCHEMA_VERSION, TraceStore, TraceStoreError


def conversation(store: TraceStore) -> int:
    """y0 wrong + hint, y1 wrong + hint, y2 right: a solved trajectory with two revisions."""
    tid = store.open("Which gas do plants take in?", "smollm2-135m", now=100.0)
    store.add_attempt(tid, "Oxygen.", [1, 2, 3], has_eos=True, now=101.0)
    store.judge(tid, False, "Think about photosynthesis.", now=102.0)
    store.add_attempt(tid, "Nitrogen.", [4, 5], has_eos=False, now=103.0)
    store.judge(tid, False, "It has carbon in it.", now=104.0)
    store.add_attempt(tid, "Carbon dioxide.", [6, 7, 2], has_eos=True, now=105.0)
    store.judge(tid, True, now=106.0)
    return tid


def test_a_conversation_round_trips_with_every_field(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    tid = conversation(store)
    traj = store.get(tid)
    assert traj.prompt == "Which gas do plants take in?" and traj.model_version == "smollm2-135m"
    assert [a.completion for a in traj.attempts] == ["Oxygen.", "Nitrogen.", "Carbon dioxide."]
    assert [a.completion_ids for a in traj.attempts] == [[1, 2, 3], [4, 5], [6, 7, 2]]
    assert [a.has_eos for a in traj.attempts] == [True, False, True]
    assert [a.verdict for a in traj.attempts] == [False, False, True]
    assert [a.hint for a in traj.attempts] == ["Think about photosynthesis.", "It has carbon in it.", None]
    assert [(a.answered_at, a.judged_at) for a in traj.attempts] == [(101.0, 102.0), (103.0, 104.0), (105.0, 106.0)]
    assert traj.created_at == 100.0 and traj.closed_at == 106.0 and traj.solved and traj.trainable


def test_rows_survive_a_restart_and_used_marks_persist(tmp_path):
    path = tmp_path / "node" / "traces.db"
    tid = conversation(TraceStore(path))
    open_tid = TraceStore(path).open("Still thinking?", "v1")
    again = TraceStore(path)  # a new process would do exactly this
    assert [t.id for t in again.trajectories()] == [tid, open_tid]
    assert [t.id for t in again.trajectories(trainable_only=True)] == [tid]
    again.mark_used([tid], server_round=3)
    reopened = TraceStore(path)
    assert reopened.get(tid).used_in_round == 3
    assert reopened.trajectories(trainable_only=True) == []
    assert reopened.counts() == {"total": 2, "open": 1, "trainable": 0, "used": 1}
    with pytest.raises(TraceStoreError, match="already used in round 3"):
        reopened.mark_used([tid], server_round=4)


def test_conversation_rules(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    with pytest.raises(TraceStoreError, match="prompt must be non-empty"):
        store.open("   ", "v")
    tid = store.open("Q?", "v")
    with pytest.raises(TraceStoreError, match="no unjudged attempt"):
        store.judge(tid, False, "hint")
    store.add_attempt(tid, "A.", [1], False)
    with pytest.raises(TraceStoreError, match="revision follows only a wrong answer with a hint"):
        store.add_attempt(tid, "B.", [2], False)
    with pytest.raises(TraceStoreError, match="only given with a 'wrong' verdict"):
        store.judge(tid, True, "this hint makes no sense")
    with pytest.raises(TraceStoreError, match="verdict must be true or false"):
        store.judge(tid, 1)
    with pytest.raises(TraceStoreError, match="hint must be non-empty"):
        store.judge(tid, False, "  ")
    store.judge(tid, False)  # wrong, no hint: the person stops here
    assert store.get(tid).closed and store.get(tid).trainable and not store.get(tid).solved
    with pytest.raises(TraceStoreError, match="is closed"):
        store.add_attempt(tid, "C.", [3], False)
    with pytest.raises(TraceStoreError, match="is closed"):
        store.judge(tid, True)
    with pytest.raises(TraceStoreError, match="not in"):
        store.get(999)
    with pytest.raises(TraceStoreError, match="non-negative integers"):
        store.add_attempt(store.open("Q2?", "v"), "A.", [1, -2], False)


def test_sql_constraints_refuse_malformed_rows_written_around_the_class(tmp_path):
    """Someone writing to the file directly meets the same rules as CHECK constraints."""
    store = TraceStore(tmp_path / "t.db")
    tid = store.open("Q?", "v")
    conn = sqlite3.connect(store.path)
    bad_rows = [
        ("INSERT INTO trajectories (prompt, model_version, created_at) VALUES ('', 'v', 1.0)", "empty prompt"),
        ("INSERT INTO attempts (trajectory_id, n, completion, completion_ids, has_eos, answered_at) "
         f"VALUES ({tid}, 0, 'A', 'not json', 0, 1.0)", "token ids not JSON"),
        ("INSERT INTO attempts (trajectory_id, n, completion, completion_ids, has_eos, answered_at, verdict, hint, "
         f"judged_at) VALUES ({tid}, 0, 'A', '[1]', 0, 1.0, 1, 'a hint on a right answer', 2.0)", "hint on right"),
        ("INSERT INTO attempts (trajectory_id, n, completion, completion_ids, has_eos, answered_at, verdict) "
         f"VALUES ({tid}, 0, 'A', '[1]', 0, 1.0, 7)", "verdict 7"),
        ("INSERT INTO attempts (trajectory_id, n, completion, completion_ids, has_eos, answered_at, verdict) "
         f"VALUES ({tid}, 0, 'A', '[1]', 0, 1.0, 0)", "verdict without judged_at"),
    ]
    for sql, what in bad_rows:
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(sql)
            pytest.fail(f"accepted: {what}")
    conn.close()
    assert store.counts()["total"] == 1


def test_damaged_rows_are_reported_on_read_with_table_row_and_column(tmp_path):
    """A row that slipped past the constraints (written with them switched off) is refused when read."""
    store = TraceStore(tmp_path / "t.db")
    tid = store.open("Q?", "v")
    store.add_attempt(tid, "A.", [1, 2], True)
    conn = sqlite3.connect(store.path)
    conn.execute("PRAGMA ignore_check_constraints = ON")
    conn.execute("UPDATE attempts SET completion_ids = '[1, \"x\"]' WHERE trajectory_id = ?", (tid,))
    conn.commit()
    conn.close()
    with pytest.raises(TraceStoreError, match=rf"attempts row \({tid}, 0\): malformed completion_ids"):
        store.get(tid)


def test_foreign_and_future_files_are_refused(tmp_path):
    text = tmp_path / "notes.db"
    text.write_text("not a database at all, just some text " * 50)
    with pytest.raises(TraceStoreError, match="notes.db"):
        TraceStore(text)
    newer = tmp_path / "newer.db"
    conn = sqlite3.connect(newer)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(TraceStoreError, match="newer than this fedspear understands"):
        TraceStore(newer)


def test_a_database_of_another_application_is_refused_and_left_unchanged(tmp_path):
    """A SQLite file holding tables that are not the trace store's (another application's database, or a table of
    the store's name with other columns) is refused before anything is written; an empty file and a store made
    earlier open."""
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('Ada')")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    with pytest.raises(TraceStoreError, match=r"other.db: not a fedspear trace store \(it holds tables that are not "
                                              r"the store's: customers\); give another file"):
        TraceStore(other)
    assert other.read_bytes() == before
    lookalike = tmp_path / "lookalike.db"
    conn = sqlite3.connect(lookalike)
    conn.execute("CREATE TABLE attempts (id INTEGER, score REAL)")
    conn.close()
    with pytest.raises(TraceStoreError, match=r"lookalike.db: not a fedspear trace store .*attempts"):
        TraceStore(lookalike)

    empty = tmp_path / "empty.db"
    empty.touch()
    assert TraceStore(empty).counts()["total"] == 0
    conversation(TraceStore(tmp_path / "t.db"))
    assert TraceStore(tmp_path / "t.db").counts() == {"total": 1, "open": 0, "trainable": 1, "used": 0}


def test_a_store_path_through_a_file_or_at_a_folder_is_refused(tmp_path):
    (tmp_path / "ok.toml").write_text("x")
    with pytest.raises(TraceStoreError, match=r"ok.toml/sub/x.db: .*ok.toml is a file, not a folder; give another"):
        TraceStore(tmp_path / "ok.toml" / "sub" / "x.db")
    with pytest.raises(TraceStoreError, match=r"is a folder; give a file path, e.g. .*/traces.db"):
        TraceStore(tmp_path)
