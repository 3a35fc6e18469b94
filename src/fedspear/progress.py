"""Progress inside a round: which phase, for which client, how far, so a terminal can show it (no ``flwr`` import).

The long loops report here: ``interaction.generate`` per decode step, ``training.optimise`` per micro-step,
``evaluation`` per log-likelihood batch. Each runs inside a named phase: on a client ``initial answers``,
``revision n`` (SPEAR) or ``revisions`` (baselines), ``training``; on the server ``waiting for clients``,
``aggregation``, ``evaluation: generation``, ``evaluation: log-likelihood``::

    with progress.phase("training", total=local_steps * grad_accum, unit="micro-steps"):
        for ...:
            progress.advance()

A phase opened inside another returns to it when it ends; a top-level phase returns to none (the row is hidden).

By default nothing is recorded (one ``None`` check per call). ``fedspear.fl.simulation`` sets ``FEDSPEAR_PROGRESS_DIR``
to ``<run dir>/progress`` before Ray starts, so the simulated clients (in the Ray actor) and the ServerApp (in the
CLI's process) each keep one small JSON file there, rewritten atomically at most every ``MIN_INTERVAL`` seconds and at
every phase change: ``{"who", "round", "phase", "done", "total", "unit", "phase_started", "updated"}`` (times in
seconds since the epoch). The CLI reads those files (``read``) and draws them with rich (``fedspear.cli``). A
SuperNode on another machine has no such directory and records nothing.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ENV = "FEDSPEAR_PROGRESS_DIR"
MIN_INTERVAL = 0.5  # seconds between two writes of the same file within a phase


class Reporter:
    """One process's progress file (``<dir>/<who>.json``) and the state it holds."""

    def __init__(self, folder: str | Path, who: str):
        self.path = Path(folder) / f"{who.replace(' ', '-')}.json"
        self.state: dict = {"who": who, "round": None, "phase": None, "done": 0, "total": 0, "unit": "",
                            "phase_started": None, "updated": None}
        self._written = 0.0

    def write(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._written < MIN_INTERVAL:
            return
        self.state["updated"] = now
        self._written = now
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.state), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:  # progress is a courtesy: a full disk or a removed run directory must not end a round
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


_reporter: Reporter | None = None


def start(who: str, server_round: int | None = None) -> None:
    """Record this process's progress as ``who`` (e.g. ``"client 3"``, ``"server"``) when ``FEDSPEAR_PROGRESS_DIR``
    is set; otherwise (and for every later call) do nothing."""
    global _reporter
    folder = os.environ.get(ENV)
    if not folder:
        _reporter = None
        return
    if _reporter is None or _reporter.state["who"] != who or _reporter.path.parent != Path(folder):
        _reporter = Reporter(folder, who)
    _reporter.state.update(round=server_round, phase=None, done=0, total=0, unit="", phase_started=None)
    _reporter.write(force=True)


def finish() -> None:
    """This process's part of the round is over (the file says ``done`` until the next ``start``)."""
    rep = _reporter
    if rep is not None:
        rep.state.update(phase="done", done=0, total=0, unit="", phase_started=None)
        rep.write(force=True)


def stop() -> None:
    """Stop recording in this process (the file stays until the run directory's ``progress/`` is cleared)."""
    global _reporter
    _reporter = None


@contextmanager
def phase(name: str, total: int = 0, unit: str = "") -> Iterator[None]:
    """Name what this process does until the block ends; ``total`` units expected (more may be added with
    ``expect``). The phase is written at its start and its end."""
    rep = _reporter
    if rep is None:
        yield
        return
    saved = {k: rep.state[k] for k in ("phase", "done", "total", "unit", "phase_started")}
    rep.state.update(phase=name, done=0, total=total, unit=unit, phase_started=time.time())
    rep.write(force=True)
    try:
        yield
    finally:
        rep.state["done"] = max(rep.state["done"], rep.state["total"])
        rep.write(force=True)
        rep.state.update(saved)  # back to the enclosing phase, or to none


def expect(units: int, unit: str | None = None) -> None:
    """Add ``units`` to the current phase's total (generation knows its decode steps only batch by batch)."""
    rep = _reporter
    if rep is not None and rep.state["phase"] is not None:
        rep.state["total"] += units
        if unit and not rep.state["unit"]:
            rep.state["unit"] = unit
        rep.write()


def advance(units: int = 1) -> None:
    """``units`` more of the current phase are done."""
    rep = _reporter
    if rep is not None and rep.state["phase"] is not None:
        rep.state["done"] += units
        rep.write()


def active() -> bool:
    """Whether this process records progress (callers skip work that only feeds it)."""
    return _reporter is not None


def read(folder: str | Path) -> list[dict]:
    """Every progress file in ``folder`` (a run's ``progress/``), sorted by who; unreadable files are skipped."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # being replaced: the next poll reads it
    return out


def describe(state: dict, now: float | None = None) -> str:
    """One line for a terminal: ``round 3 · client 7 · revision 1 · 120/512 tokens · 0:42 · ETA 1:10``."""
    now = time.time() if now is None else now
    parts = [f"round {state['round']}" if state.get("round") is not None else None, state.get("who"),
             state.get("phase") or "waiting"]
    done, total = state.get("done", 0), state.get("total", 0)
    if total:
        parts.append(f"{min(done, total)}/{total} {state.get('unit', '')}".rstrip())
    if state.get("phase_started") is not None:
        elapsed = max(0.0, now - state["phase_started"])
        parts.append(_clock(elapsed))
        if total and 0 < done < total:
            parts.append(f"ETA {_clock(elapsed * (total - done) / done)}")
    return " · ".join(p for p in parts if p)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
