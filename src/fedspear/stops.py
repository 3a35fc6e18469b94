"""Clean stops: SIGINT (Ctrl-C), SIGTERM and SIGHUP (a closed terminal or SSH session) end a command within seconds,
with every process it started, one line saying where it stopped and how to go on, and exit code 128 + the signal's
number (130, 143, 129). No ``flwr`` import.

``fedspear run``, ``compare``, ``eval``, ``node-worker`` and ``chat`` run inside ``Stops`` (a context manager)::

    with Stops(lambda signum: f"stopped; resume with: {command_line()}"):
        ...

**Decisions (2026-11-27, issue 42).**

- *Handlers.* ``Stops`` installs one handler for the three signals (``signal.signal``, main thread), but leaves
  SIGHUP ignored where it was (``nohup``: the command then outlives its terminal, as asked; decision 2026-12-05).
  Python's default for SIGHUP ends the process at once, leaving Ray's processes behind and the round in flight
  unsaid; handled, a hang-up stops the command as SIGTERM does. The first signal sets
  ``requested()``; in the main thread it then raises ``Stopped`` where the command is, as Ctrl-C raises
  KeyboardInterrupt — enough for commands whose work runs in the main thread (eval, compare, node-worker, chat).
- *Cooperative sections.* ``fedspear run``'s main thread sits inside Flower's simulation engine while the ServerApp
  thread drives the rounds; an exception there would leave that thread waiting (up to ``round_timeout``) and the
  process hanging. Inside ``cooperative(on_stop)`` the handler raises nothing: the ``on_stop`` callbacks run (the
  simulation stops its Ray workers), the ServerApp's waits (``StoppableGrid``) raise ``Stopped`` in its own thread,
  and Flower's engine winds down as after any ServerApp error (its ``RayBackend.terminate``: ``ray.shutdown()``).
  Libraries that install their own SIGTERM handler (``ray.init`` does) are followed by ``reinstall()``.
- *SIGTERM and SIGHUP during a simulation* (2026-12-06). They end ``fedspear run`` at once, as the deadline would
  (``fl.simulation.stop_ray_workers``): sent to the process group they reach Ray's raylet and GCS, and once the
  raylet has gone Ray's core ends the process with status 1 and no line (seen once in CI). SIGINT, which Ray's
  services block, winds down through Flower's engine.
- *Deadline.* If the command has not ended ``deadline`` seconds after the first signal (the server was evaluating,
  a library call did not return), or when a second signal comes, the process tree is killed, the line printed and
  the process ended at once (``os._exit``). Run records are written atomically (``fedspear.rundir``), so this costs
  at most the round in flight, which a resume redoes.
- *Child processes.* The tree below this process is recorded when it matters (``remember_children``: after Ray
  started; at the signal) because Ray's DashboardAgent and RuntimeEnvAgent ignore SIGTERM and are re-parented to PID
  1 once their raylet is gone: found by the record, not by the tree. When the command ends, every recorded or
  current descendant still alive gets SIGTERM, then SIGKILL after ``KILL_AFTER`` seconds (without a stop, only the
  recorded ones). Only processes that were
  descendants of this one are ever signalled (``psutil.Process`` checks the start time, so a reused PID is safe).
- *Late children* (2026-12-02). A library thread can start a process while the tree is being ended: Flower's
  simulation sends its exit event from a ``finally`` on a daemon thread, which runs ``platform.architecture()``
  and so the ``file`` command, even with ``FLWR_TELEMETRY_ENABLED=0``; ended by ``os._exit``, such a child
  outlived the command (seen once in CI). So the last thing before ``os._exit`` is one more look at the tree, and
  whatever was born since is killed at once (``_exit``).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import psutil

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
KILL_AFTER = 2.0  # seconds between SIGTERM and SIGKILL for processes left behind
DEADLINE = 6.0  # seconds after the first signal before the command is ended at once


class Stopped(BaseException):
    """The command was asked to stop by ``signum`` (SIGINT, SIGTERM or SIGHUP); ``code`` is the exit status to end
    with.

    A ``BaseException``, as KeyboardInterrupt is: code that catches ``Exception`` to report a failure and go on (a
    node worker's request, Flower's engine) must not take a stop for one."""

    def __init__(self, signum: int):
        self.signum = signum
        self.code = 128 + signum
        super().__init__(f"stopped by {signal_name(signum)}")


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def command_line() -> str:
    """This invocation as a ``fedspear …`` command to paste (arguments quoted for a POSIX shell)."""
    return shlex.join(["fedspear", *sys.argv[1:]])


_event = threading.Event()
_state: dict[str, Any] = {"signum": None, "cooperative": 0, "on_stop": [], "remembered": {}, "active": None}


def requested() -> bool:
    """Whether a stop was asked for (in this process, since the command began)."""
    return _event.is_set()


def stop_signal() -> int | None:
    """The signal that asked for the stop (SIGINT, SIGTERM or SIGHUP); None before one."""
    return _state["signum"] if _event.is_set() else None


def check() -> None:
    """Raise ``Stopped`` when a stop was asked for."""
    if _event.is_set():
        raise Stopped(_state["signum"])


def wait(seconds: float) -> None:
    """Sleep ``seconds``, or raise ``Stopped`` as soon as a stop is asked for."""
    if _event.wait(seconds):
        raise Stopped(_state["signum"])


def children() -> list[psutil.Process]:
    """The current descendants of this process."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def remember_children(besides: Iterable[psutil.Process] = ()) -> None:
    """Record every current descendant of this process but ``besides`` (those that were there before the work that
    started the others), to end it when the command ends (see the module docstring)."""
    known = {p.pid for p in besides}
    for proc in children():
        if proc.pid not in known:
            _state["remembered"].setdefault(proc.pid, proc)


def end_processes(procs: Iterable[psutil.Process], kill_after: float = KILL_AFTER) -> list[psutil.Process]:
    """SIGTERM to each live process of ``procs``, SIGKILL to those alive ``kill_after`` s later (at once when
    ``kill_after`` is 0). Returns the processes still alive afterwards (normally none)."""
    running = [p for p in procs if alive(p)]
    if kill_after > 0:
        for proc in running:
            _signal(proc, signal.SIGTERM)
        running = _wait_gone(running, kill_after)
    kill_now(running)
    return _wait_gone(running, 2.0)


def kill_now(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL to each live process of ``procs``, not waiting for them to go."""
    for proc in procs:
        if alive(proc):
            _signal(proc, signal.SIGKILL)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each of ``procs`` has ended, at most ``timeout`` s; returns those still running. An ended process
    whose parent has not reaped it yet (a zombie) counts as ended: those of this process are reaped here, but one
    orphaned with its parent (Ray's workers when their raylet is killed with them) waits for PID 1, which in a
    container may never reap it (``psutil.wait_procs`` would then wait out the whole ``timeout``: 2 s of every
    stop that kills a tree)."""
    deadline = time.monotonic() + timeout
    while True:
        psutil.wait_procs(procs, timeout=0)  # reaps the ended children of this process
        running = [p for p in procs if alive(p)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.02)


def _signal(proc: psutil.Process, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except psutil.Error:
        pass


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants() -> list[psutil.Process]:
    """Recorded and current descendants of this process."""
    return list({**_state["remembered"], **{p.pid: p for p in children()}}.values())


def handled_signals() -> tuple[int, ...]:
    """The signals a ``Stops`` block takes now: ``SIGNALS``, less SIGHUP where this process ignores it (started
    under ``nohup``, or by a parent that ignores it: an ignored signal stays ignored across ``exec``)."""
    return tuple(s for s in SIGNALS if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN))


class Stops:
    """Handle SIGINT, SIGTERM and SIGHUP (``handled_signals``) for one command (see the module docstring).

    ``line(signum)`` is the one line printed (to stderr) when the command stops: where it stopped and how to go on.
    Leaving the block by ``Stopped`` (or normally after a stop was asked for) ends the remaining child processes,
    prints the line and ends the process with status 128 + signum (``_exit``); leaving it otherwise only ends the
    recorded ones (``remember_children``: Ray's) that are left behind.
    """

    def __init__(self, line: Callable[[int], str], deadline: float = DEADLINE):
        self.line, self.deadline = line, deadline
        self._saved: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "Stops":
        _event.clear()
        _state.update(signum=None, cooperative=0, on_stop=[], remembered={}, active=self)
        self._saved = {s: signal.signal(s, self._handle) for s in handled_signals()}
        return self

    def reinstall(self) -> None:
        """Take the signals back from a library that installed its own handlers (``ray.init`` sets SIGTERM's)."""
        for s in self._saved:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if _event.is_set():  # a second signal: no more waiting
            self._end_now()
        _state["signum"] = signum
        _event.set()
        remember_children()
        for callback in list(_state["on_stop"]):
            try:
                callback()
            except Exception:  # noqa: BLE001 - stopping goes on whatever one callback does
                pass
        self._timer = threading.Timer(self.deadline, self._end_now)
        self._timer.daemon = True
        self._timer.start()
        if not _state["cooperative"]:
            raise Stopped(signum)

    def _say(self) -> str:
        signum = _state["signum"]
        try:
            return self.line(signum)
        except Exception as err:  # noqa: BLE001 - the line must not hide the stop itself
            return f"stopped by {signal_name(signum)} ({type(err).__name__}: {err})"

    def _end_now(self) -> None:
        """The deadline passed, a second signal came, or the work asked for it (``end_now``): SIGKILL to the tree,
        print the line, end the process, without waiting for the killed processes to go (they end within
        milliseconds, and Ray's core may end this process with status 1 meanwhile: ``fl.simulation.stop_ray_workers``).
        Takes no lock another thread may hold (an interrupted logging call or write): the line goes straight to fd 2."""
        kill_now(_descendants())
        _exit(128 + (_state["signum"] or signal.SIGTERM), self._say(), flush=False)

    def __exit__(self, exc_type, exc, tb) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        _state["active"] = None
        # after a stop, any way out of the block is the stop: the work may end in its own error once its processes
        # are gone (Flower's engine: "Simulation Runtime crashed")
        stopped = isinstance(exc, Stopped) or _event.is_set()
        # after a stop every descendant goes; otherwise only those recorded (Ray's), not a caller's other children
        left = end_processes(_descendants() if stopped else remembered())
        if self._timer is not None:
            self._timer.cancel()
        _event.clear()  # later work in this process (tests, a benchmark) starts unstopped
        if not stopped:
            return
        line = self._say()
        if left:
            line = f"could not end processes {', '.join(str(p.pid) for p in left)}\n{line}"
        _exit(128 + _state["signum"], line)


def _exit(code: int, line: str, flush: bool = True) -> None:
    """Write ``line`` to stderr and end the process now (with ``flush``, Python's buffered output first).

    Everything worth keeping is on disk by then (run records are written atomically and fsynced; Ray is shut down
    and the children ended; any child started since, by a library's thread, is killed here): the interpreter's own
    finalisation is skipped, which after a stopped ``fedspear run`` spent 8 s in native threads, and whose exit
    handlers can wait forever on a lock an interrupted call left held (both seen on a contended 2-core machine)."""
    if flush:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    try:
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass
    kill_now(children())  # born while the tree was being ended (module docstring: late children)
    os._exit(code)


@contextmanager
def cooperative(on_stop: Callable[[], None] | None = None) -> Iterator[None]:
    """A section in which a signal raises nothing in the main thread: the work notices ``requested()`` itself, and
    ``on_stop`` (if given) runs at the signal. Raises ``Stopped`` at its end when a stop was asked for."""
    _state["cooperative"] += 1
    if on_stop is not None:
        _state["on_stop"].append(on_stop)
    try:
        yield
    finally:
        _state["cooperative"] -= 1
        if on_stop is not None:
            _state["on_stop"].remove(on_stop)
    check()


def remembered() -> list[psutil.Process]:
    """The processes ``remember_children`` recorded since the command began."""
    return list(_state["remembered"].values())


def end_now() -> None:
    """End the active command at once (``Stops``' deadline path); nothing outside one."""
    if _state["active"] is not None:
        _state["active"]._end_now()


def reinstall() -> None:
    """``Stops.reinstall`` of the active command (nothing outside one)."""
    if _state["active"] is not None:
        _state["active"].reinstall()


class StoppableGrid:
    """A Flower ``Grid`` whose ``send_and_receive`` ends with ``Stopped`` as soon as a stop is asked for.

    The same push-then-pull loop as Flower's own (``flwr/server/superlink/grid/inmemory_grid.py``), waiting on the
    stop event instead of ``time.sleep``; replies that arrive after a stop are not returned (a round is recorded
    only from replies that came before it). Everything else is the wrapped grid's.
    """

    def __init__(self, grid: Any):
        self._grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> list[Any]:
        check()
        pending = set(self._grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Any] = []
        while pending and (end is None or time.monotonic() < end):
            got = list(self._grid.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if pending:
                wait(getattr(self._grid, "pull_interval", 0.1))
        check()
        return replies


def stoppable(line: Callable[[int], str] | None = None, deadline: float = DEADLINE) -> Callable:
    """Decorator: run a command inside ``Stops(line)``; without ``line``, the line says the command stopped and
    gives it again (``command_line``)."""
    def default(signum: int) -> str:
        return f"stopped by {signal_name(signum)}; run it again with: {command_line()}"

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with Stops(line or default, deadline):
                return fn(*args, **kwargs)
        return inner
    return wrap


def call(cmd: list[str], wait_after_stop: float = DEADLINE + 2.5, **popen: Any) -> int:
    """``subprocess.call`` for a child that handles stops itself (a ``fedspear run``): it runs in its own process
    group, so a terminal's Ctrl-C reaches it once, through this process; at a stop it gets the same signal and up to
    ``wait_after_stop`` seconds to end, then it and its tree are killed, and ``Stopped`` goes on. Returns its exit
    status."""
    proc = subprocess.Popen(cmd, process_group=0, **popen)
    try:
        return proc.wait()
    except Stopped as stop:
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        proc.send_signal(stop.signum)
        try:
            proc.wait(timeout=wait_after_stop)
        except subprocess.TimeoutExpired:
            pass
        end_processes(tree, kill_after=0)
        proc.wait()
        raise
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def last_recorded_round(run_dir: str | Path) -> int | None:
    """The last round in ``<run_dir>/metrics.jsonl`` (None without one), read without repairing anything: it may be
    called while the run still writes."""
    path = Path(run_dir) / "metrics.jsonl"
    last = None
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            last = json.loads(line)["round"]
        except (ValueError, TypeError, KeyError):
            continue
    return last


def run_line(run_dir: str | Path, rounds: int) -> Callable[[int], str]:
    """The line ``fedspear run`` ends with at a stop: the last completed round and the command that resumes."""
    def line(signum: int) -> str:
        last = last_recorded_round(run_dir)
        if last is None:
            where = "before round 0 was recorded (nothing to keep yet)"
        else:
            where = f"after round {last} of {rounds} ({run_dir} keeps rounds 0–{last}; the round in flight is redone)"
        return f"stopped by {signal_name(signum)} {where}; resume with: {command_line()}"
    return line


def compare_line(cells: list[Any]) -> Callable[[int], str]:
    """The line ``fedspear compare`` ends with at a stop: finished cells, the cell it stopped in, how to resume."""
    def line(signum: int) -> str:
        done = [c for c in cells if c.done()]
        running = next((c for c in cells if not c.done()), None)
        where = ""
        if running is not None:
            last = last_recorded_round(running.path)
            where = f"; stopped in cell {running.name} " + (f"after its round {last}" if last is not None
                                                             else "before its round 0")
        return (f"stopped by {signal_name(signum)}: {len(done)} of {len(cells)} cells finished{where}; "
                f"resume with: {command_line()}")
    return line
