"""The node's trace store: every conversation a person had with the model in ``fedspear chat``, kept in SQLite.

A *trajectory* is one prompt and its attempts y0, y1, …: each attempt's text and sampled token ids, the person's
verdict (right / wrong), the hint they typed for a wrong answer, and timestamps, plus the version of the model that
answered. It is the human counterpart of one prompt of SPEAR's interaction phase (paper Alg. 1 lines 5–22): the
ClientApp later replays stored trajectories through the same win / lose split (``fedspear.human.replay``) and marks them
used. The file lives on the node and never leaves it; only the adapter trained on it does.

Rules the store enforces (and refuses with :class:`TraceStoreError` naming the trajectory and field):

- a prompt is non-empty text; an attempt's token ids are non-negative integers;
- an attempt is judged once; a hint is given only with a "wrong" verdict;
- a new attempt (a revision) follows only a wrong, hinted last attempt of an open trajectory;
- a "right" verdict, a "wrong" verdict without a hint, or ``close`` ends the trajectory.

The tables carry the same rules as SQL ``CHECK`` constraints, so rows written around this class are refused too;
rows that are malformed anyway (a foreign or damaged file) are reported on read with table, row and column.

Timestamps are seconds since the Unix epoch (UTC). Core module: no torch, no flwr.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from ..config import nearest_existing

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt        TEXT    NOT NULL CHECK (typeof(prompt) = 'text' AND length(trim(prompt)) > 0),
    model_version TEXT    NOT NULL CHECK (typeof(model_version) = 'text'),
    created_at    REAL    NOT NULL CHECK (created_at > 0),
    closed_at     REAL    CHECK (closed_at IS NULL OR closed_at >= created_at),
    used_in_round INTEGER CHECK (used_in_round IS NULL OR used_in_round >= 0),
    used_at       REAL
);
CREATE TABLE IF NOT EXISTS attempts (
    trajectory_id  INTEGER NOT NULL REFERENCES trajectories(id),
    n              INTEGER NOT NULL CHECK (n >= 0),
    completion     TEXT    NOT NULL CHECK (typeof(completion) = 'text'),
    completion_ids TEXT    NOT NULL CHECK (json_valid(completion_ids) AND json_type(completion_ids) = 'array'),
    has_eos        INTEGER NOT NULL CHECK (has_eos IN (0, 1)),
    answered_at    REAL    NOT NULL CHECK (answered_at > 0),
    verdict        INTEGER CHECK (verdict IS NULL OR verdict IN (0, 1)),
    hint           TEXT    CHECK (hint IS NULL OR (verdict = 0 AND length(trim(hint)) > 0)),
    judged_at      REAL    CHECK ((verdict IS NULL) = (judged_at IS NULL)),
    PRIMARY KEY (trajectory_id, n)
);
"""


class TraceStoreError(ValueError):
    """A trace-store operation or row breaks the store's rules; the message names the trajectory and field."""


@dataclass
class Attempt:
    """One answer of the model and the person's judgement of it.

    Attributes:
        completion: the answer text shown to the person.
        completion_ids: the sampled token ids (EOS included when ``has_eos``), what training uses.
        has_eos: whether the model stopped by itself (the unlikelihood tail excludes EOS, SPEC §3).
        answered_at / judged_at: seconds since the epoch (``judged_at`` None until judged).
        verdict: True right, False wrong, None not judged yet.
        hint: the person's partial feedback on a wrong answer (None otherwise).
    """

    completion: str
    completion_ids: list[int]
    has_eos: bool
    answered_at: float
    verdict: bool | None = None
    hint: str | None = None
    judged_at: float | None = None


@dataclass
class Trajectory:
    """A prompt and its attempts (y0 first). ``closed_at`` is None while the person may still revise."""

    id: int
    prompt: str
    model_version: str
    created_at: float
    attempts: list[Attempt] = field(default_factory=list)
    closed_at: float | None = None
    used_in_round: int | None = None

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    @property
    def solved(self) -> bool:
        """Some attempt was judged right."""
        return any(a.verdict for a in self.attempts)

    @property
    def trainable(self) -> bool:
        """Closed, not used yet, and every attempt judged (what a training round may consume)."""
        return (self.closed and self.used_in_round is None and bool(self.attempts)
                and all(a.verdict is not None for a in self.attempts))


class TraceStore:
    """The SQLite file of a node's trajectories (created on first use; safe for the chat app and the ClientApp to
    use at the same time: WAL journal, one connection per call, 30 s busy timeout).

    Args:
        path: the database file (its folder is created).
    Raises:
        TraceStoreError: the path is a folder or lies under a file; the file is not a fedspear trace store (another
            application's tables, or a newer schema version), refused before anything is written to it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        _check_place(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise TraceStoreError(f"{self.path}: trace store schema {version} is newer than this fedspear "
                                      f"understands ({SCHEMA_VERSION})")
            foreign = _foreign_tables(conn)
            if foreign:
                raise TraceStoreError(f"{self.path}: not a fedspear trace store (it holds tables that are not the "
                                      f"store's: {', '.join(foreign)}); give another file")
            try:
                conn.executescript(_SCHEMA)
            except sqlite3.DatabaseError as err:
                raise TraceStoreError(f"{self.path}: not a fedspear trace store ({err})") from None
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("PRAGMA journal_mode = WAL")

    def __repr__(self) -> str:
        return f"TraceStore({str(self.path)!r})"

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as err:
            raise TraceStoreError(f"{self.path}: cannot open the trace store ({err})") from None
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            yield conn
        except sqlite3.IntegrityError as err:
            raise TraceStoreError(f"{self.path}: row refused by the store's constraints ({err})") from None
        except sqlite3.DatabaseError as err:
            raise TraceStoreError(f"{self.path}: not a usable trace store ({err})") from None
        finally:
            conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # -- writing ------------------------------------------------------------------------------------------------------
    def open(self, prompt: str, model_version: str, now: float | None = None) -> int:
        """Start a trajectory for ``prompt`` answered by ``model_version``; returns its id.

        Raises:
            TraceStoreError: the prompt is not non-empty text.
        """
        if not isinstance(prompt, str) or not prompt.strip():
            raise TraceStoreError("new trajectory: prompt must be non-empty text")
        if not isinstance(model_version, str):
            raise TraceStoreError("new trajectory: model_version must be text")
        with self._transaction() as conn:
            cur = conn.execute("INSERT INTO trajectories (prompt, model_version, created_at) VALUES (?, ?, ?)",
                               (prompt, model_version, now or time.time()))
            return int(cur.lastrowid)

    def add_attempt(self, trajectory_id: int, completion: str, completion_ids: Sequence[int], has_eos: bool,
                    now: float | None = None) -> int:
        """Record the model's next answer; returns its index n (0 for y0).

        Raises:
            TraceStoreError: unknown or closed trajectory; the last attempt is not judged wrong with a hint;
                malformed text or token ids.
        """
        where = f"trajectory {trajectory_id}"
        if not isinstance(completion, str):
            raise TraceStoreError(f"{where}: completion must be text")
        ids = list(completion_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise TraceStoreError(f"{where}: completion_ids must be non-negative integers")
        with self._transaction() as conn:
            traj = self._get(conn, trajectory_id)
            if traj.closed:
                raise TraceStoreError(f"{where}: is closed; it takes no more attempts")
            if traj.attempts:
                last = traj.attempts[-1]
                if last.verdict is not False or last.hint is None:
                    raise TraceStoreError(f"{where}: a revision follows only a wrong answer with a hint "
                                          f"(attempt {len(traj.attempts) - 1} is "
                                          f"{'not judged' if last.verdict is None else 'right'})")
            n = len(traj.attempts)
            conn.execute("INSERT INTO attempts (trajectory_id, n, completion, completion_ids, has_eos, answered_at) "
                         "VALUES (?, ?, ?, ?, ?, ?)",
                         (trajectory_id, n, completion, json.dumps(ids), int(bool(has_eos)), now or time.time()))
            return n

    def judge(self, trajectory_id: int, correct: bool, hint: str | None = None, now: float | None = None) -> None:
        """The person's verdict on the last attempt. Right, or wrong without a hint, closes the trajectory.

        Raises:
            TraceStoreError: unknown or closed trajectory; no attempt, or the last one already judged; a hint with a
                "right" verdict or an empty hint; ``correct`` not a bool.
        """
        where = f"trajectory {trajectory_id}"
        if not isinstance(correct, bool):
            raise TraceStoreError(f"{where}: verdict must be true or false, got {correct!r}")
        if hint is not None and (not isinstance(hint, str) or not hint.strip()):
            raise TraceStoreError(f"{where}: hint must be non-empty text")
        if correct and hint is not None:
            raise TraceStoreError(f"{where}: a hint is only given with a 'wrong' verdict")
        now = now or time.time()
        with self._transaction() as conn:
            traj = self._get(conn, trajectory_id)
            if traj.closed:
                raise TraceStoreError(f"{where}: is closed; its verdicts are final")
            if not traj.attempts or traj.attempts[-1].verdict is not None:
                raise TraceStoreError(f"{where}: no unjudged attempt to judge")
            n = len(traj.attempts) - 1
            conn.execute("UPDATE attempts SET verdict = ?, hint = ?, judged_at = ? WHERE trajectory_id = ? AND n = ?",
                         (int(correct), hint, now, trajectory_id, n))
            if correct or hint is None:
                conn.execute("UPDATE trajectories SET closed_at = ? WHERE id = ?", (now, trajectory_id))

    def close(self, trajectory_id: int, now: float | None = None) -> None:
        """End a trajectory (the person gives up, or the revision budget N is spent). Closing twice is a no-op.

        Raises:
            TraceStoreError: unknown trajectory.
        """
        with self._transaction() as conn:
            traj = self._get(conn, trajectory_id)
            if not traj.closed:
                conn.execute("UPDATE trajectories SET closed_at = ? WHERE id = ?", (now or time.time(), trajectory_id))

    def mark_used(self, ids: Sequence[int], server_round: int, now: float | None = None) -> None:
        """Record that round ``server_round`` trained on these trajectories (they are not offered again).

        Raises:
            TraceStoreError: an id is unknown or was already used.
        """
        with self._transaction() as conn:
            for tid in ids:
                traj = self._get(conn, tid)
                if traj.used_in_round is not None:
                    raise TraceStoreError(f"trajectory {tid}: already used in round {traj.used_in_round}")
                conn.execute("UPDATE trajectories SET used_in_round = ?, used_at = ? WHERE id = ?",
                             (int(server_round), now or time.time(), tid))

    # -- reading ------------------------------------------------------------------------------------------------------
    def get(self, trajectory_id: int) -> Trajectory:
        """The trajectory with this id.

        Raises:
            TraceStoreError: unknown id, or a malformed row (names table, row and column).
        """
        with self._connect() as conn:
            return self._get(conn, trajectory_id)

    def trajectories(self, trainable_only: bool = False, limit: int | None = None) -> list[Trajectory]:
        """All trajectories, oldest first (or only the closed, fully judged, unused ones), at most ``limit``.

        Raises:
            TraceStoreError: a malformed row (names table, row and column).
        """
        with self._connect() as conn:
            ids = [r[0] for r in conn.execute("SELECT id FROM trajectories ORDER BY id")]
            out = []
            for tid in ids:
                traj = self._get(conn, tid)
                if trainable_only and not traj.trainable:
                    continue
                out.append(traj)
                if limit is not None and len(out) >= limit:
                    break
            return out

    def counts(self) -> dict[str, int]:
        """Numbers of trajectories: ``total``, ``open``, ``trainable`` (closed, judged, unused) and ``used``."""
        return count(self.trajectories())

    def _get(self, conn: sqlite3.Connection, trajectory_id: int) -> Trajectory:
        if isinstance(trajectory_id, bool) or not isinstance(trajectory_id, int):
            raise TraceStoreError(f"trajectory id must be an integer, got {trajectory_id!r}")
        row = conn.execute("SELECT id, prompt, model_version, created_at, closed_at, used_in_round FROM trajectories "
                           "WHERE id = ?", (trajectory_id,)).fetchone()
        if row is None:
            raise TraceStoreError(f"trajectory {trajectory_id}: not in {self.path}")
        tid, prompt, version, created, closed, used = row
        where = f"{self.path}: trajectories row {tid}"
        _expect(isinstance(prompt, str) and prompt.strip(), where, "prompt", prompt)
        _expect(isinstance(created, (int, float)), where, "created_at", created)
        traj = Trajectory(tid, prompt, version, float(created), [], closed, used)
        rows = conn.execute("SELECT n, completion, completion_ids, has_eos, answered_at, verdict, hint, judged_at "
                            "FROM attempts WHERE trajectory_id = ? ORDER BY n", (tid,)).fetchall()
        for k, (n, text, ids, eos, answered, verdict, hint, judged) in enumerate(rows):
            where = f"{self.path}: attempts row ({tid}, {n})"
            _expect(n == k, where, "n", n)
            try:
                token_ids = json.loads(ids)
            except (TypeError, json.JSONDecodeError):
                token_ids = None
            _expect(isinstance(token_ids, list) and all(isinstance(t, int) and t >= 0 for t in token_ids), where,
                    "completion_ids", ids)
            _expect(isinstance(text, str), where, "completion", text)
            _expect(verdict in (None, 0, 1), where, "verdict", verdict)
            traj.attempts.append(Attempt(text, token_ids, bool(eos), float(answered),
                                         None if verdict is None else bool(verdict), hint, judged))
        return traj


def _check_place(path: Path) -> None:
    """Refuse a store path that is a folder, or whose folder would have to be made where a file is (the wording of
    ``fedspear.cli.check_output``, which the core does not import)."""
    if path.is_dir():
        raise TraceStoreError(f"{path} is a folder; give a file path, e.g. {path / 'traces.db'}")
    place = nearest_existing(path.parent)  # where the folders go
    if not place.is_dir():
        raise TraceStoreError(f"{path}: {place} is a file, not a folder; give another path")


def _foreign_tables(conn: sqlite3.Connection) -> list[str]:
    """Tables of the open database that are not the trace store's: another name, or one of its names with other
    columns (SQLite's own ``sqlite_*`` tables aside). Empty for a new file and for a store made earlier (schema 1,
    the only one so far: a schema 2 that migrates older stores must accept their columns here)."""
    with closing(sqlite3.connect(":memory:")) as ours:
        ours.executescript(_SCHEMA)
        expected = {t: _columns(ours, t) for t in ("trajectories", "attempts")}
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                         "AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name")]
    return [t for t in tables if expected.get(t) != _columns(conn, t)]


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute("SELECT * FROM pragma_table_info(?)", (table,))]


def count(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """``TraceStore.counts`` of trajectories already read (no second pass over the file)."""
    return {"total": len(trajectories), "open": sum(not t.closed for t in trajectories),
            "trainable": sum(t.trainable for t in trajectories),
            "used": sum(t.used_in_round is not None for t in trajectories)}


def _expect(ok: object, where: str, column: str, value: object) -> None:
    if not ok:
        raise TraceStoreError(f"{where}: malformed {column} ({value!r:.80})")
