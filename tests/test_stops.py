"""Clean stops (``fedspear.stops``) with real signals sent to real process groups, the process tree checked afterwards.

Every command under test starts in a new session (``start_new_session=True``) with SIGINT's default handler restored
(a background job of a non-interactive shell inherits SIGINT ignored), so ``os.killpg`` reaches it as a terminal's
Ctrl-C would; afterwards no process of that session may be alive (zombies waiting for a parent to reap them are dead
and do not count). The ``fedspear run`` cases are slow (tiny-random, 3 short rounds on the simulation engine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.numpy import load_file

from helpers import RESUME_ARGS, client_at_work, stable

FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))


def _default_signals() -> None:
    """SIGINT's and SIGHUP's default dispositions, whatever pytest's were (a background job inherits SIGINT ignored,
    ``nohup make test`` SIGHUP ignored, which the command would then keep)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``cmd`` in a session of its own, SIGINT and SIGHUP restored, output captured as text."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_signals, **kwargs)


def _live(sid: int) -> list[str]:
    """Live (non-zombie) processes of session ``sid`` now, as 'pid name'."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid} {proc.info['name']}")
        except (OSError, psutil.Error):
            continue
    return found


def session(sid: int, grace: float = 5.0) -> list[str]:
    """Processes of session ``sid`` still running ``grace`` seconds after the run exited, as 'pid name' (empty as
    soon as none is). The grace is for short-lived helpers that end by themselves: Flower's telemetry ``event``
    builds its payload even with telemetry off, and ``platform.architecture()`` in it runs ``file -b <python>`` from
    a daemon thread, which a stopped process may leave behind for a few milliseconds (seen once in CI: '32419
    file'). Something left running is still there after the grace."""
    deadline = time.monotonic() + grace
    while (found := _live(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def stop(proc: subprocess.Popen, signum: int, group: bool = True, limit: float = 10.0) -> tuple[int, str, float]:
    """Send ``signum`` to ``proc``'s process group (or to ``proc`` alone); (exit status, stderr, seconds to exit).
    Fails when it is not over within ``limit`` seconds (the process group is then killed)."""
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running {limit:.0f} s after {signal.Signals(signum).name}; stderr:\n{err[-3000:]}")
    return proc.returncode, err, time.monotonic() - t0


def wait_for(condition, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"ended ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {what} within {timeout:.0f} s")
        time.sleep(0.2)


# ---- the machinery, in a small program: a child that ignores SIGTERM (as Ray's agents do), a stuck section -------
PROGRAM = textwrap.dedent("""
    import subprocess, sys, time
    from fedspear import stops

    mode, deadline = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    with stops.Stops(lambda signum: f"stopped by {stops.signal_name(signum)} at step 3; resume with: again",
                     deadline=deadline):
        child = subprocess.Popen([sys.executable, "-c",
                                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
        print(child.pid, flush=True)
        if mode == "cooperative":  # the main thread does not notice: only the deadline ends it
            with stops.cooperative():
                time.sleep(600)
        else:
            time.sleep(600)
""")


@pytest.mark.parametrize("signum, mode, code, most", [
    (signal.SIGINT, "main", 130, 10.0), (signal.SIGTERM, "main", 143, 10.0), (signal.SIGHUP, "main", 129, 10.0),
    (signal.SIGTERM, "cooperative", 143, 10.0)])
def test_a_signal_ends_the_command_its_children_and_prints_one_line(tmp_path, signum, mode, code, most):
    """The child ignores SIGTERM and SIGINT: it is ended by SIGKILL after the grace. In a cooperative section that
    never looks at the stop, the deadline (3 s here) ends the process with the same line and status."""
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = start([sys.executable, str(script), mode], env=dict(os.environ))
    child = int(proc.stdout.readline())
    time.sleep(0.5)  # the child has set its handlers
    status, err, seconds = stop(proc, signum, limit=most)
    assert status == code, err
    assert err.strip().splitlines()[-1] == (f"stopped by {signal.Signals(signum).name} at step 3; "
                                            "resume with: again")
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert session(proc.pid) == []
    if mode == "cooperative":
        assert seconds >= 3.0  # it waited for the work to notice until the deadline


def _ignore_sighup() -> None:
    _default_signals()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_under_nohup_a_hang_up_is_ignored_and_ctrl_c_still_stops(tmp_path):
    """Started with SIGHUP ignored (as ``nohup`` starts a command), the command leaves it ignored: a hang-up to its
    process group changes nothing (the command and its child still run 1 s later); Ctrl-C then stops it as usual."""
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, str(script), "main"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_ignore_sighup, env=dict(os.environ))
    child = int(proc.stdout.readline())
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
    status, err, _ = stop(proc, signal.SIGINT)
    assert status == 130, err
    assert err.strip().splitlines()[-1] == "stopped by SIGINT at step 3; resume with: again"
    assert session(proc.pid) == []


def test_ending_processes_does_not_wait_for_a_zombie_nobody_reaps(tmp_path):
    """A killed process whose parent does not reap it stays a zombie (as Ray's workers do when their raylet is killed
    with them and PID 1 does not reap orphans): ``end_processes`` counts it as ended and returns at once, where
    waiting for its PID to vanish would take the whole 2 s allowed after SIGKILL at every stop."""
    from fedspear import stops

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "print(subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        grandchild = psutil.Process(int(parent.stdout.readline()))
        assert grandchild.ppid() == parent.pid  # not this process's child: nothing here can reap it
        ended = []
        worker = threading.Thread(target=lambda: ended.append(stops.end_processes([grandchild], kill_after=0)))
        worker.start()
        worker.join(timeout=1.0)
        assert ended == [[]], "still waiting 1 s after SIGKILL"
        assert grandchild.status() == psutil.STATUS_ZOMBIE  # ended, and still there for its parent to reap
    finally:
        parent.kill()
        parent.wait()


def test_a_second_signal_ends_the_command_at_once(tmp_path):
    """In a section that does not notice the stop, a second Ctrl-C ends it without waiting for the deadline (600 s
    here, so only the second signal can end it within ``stop``'s 10 s): status 130 (the first signal's), the line,
    the child killed."""
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = start([sys.executable, str(script), "cooperative", "600"], env=dict(os.environ))
    child = int(proc.stdout.readline())
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the first signal alone does not end a section that does not notice it
    status, err, _ = stop(proc, signal.SIGINT)
    assert status == 130 and err.strip().splitlines()[-1].startswith("stopped by SIGINT at step 3"), err
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert session(proc.pid) == []


# a simulation's stop without Ray: the section never looks at the stop, and the deadline is far away
SIMULATION = textwrap.dedent("""
    import time
    from fedspear import stops
    from fedspear.fl.simulation import stop_ray_workers

    with stops.Stops(lambda signum: f"stopped by {stops.signal_name(signum)}", deadline=600.0):
        with stops.cooperative(on_stop=stop_ray_workers):
            print("ready", flush=True)
            time.sleep(600)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_sigterm_or_a_hang_up_ends_a_simulation_at_once_and_ctrl_c_lets_it_wind_down(tmp_path, signum):
    """In a simulation's cooperative section (``on_stop=stop_ray_workers``) SIGTERM and SIGHUP end the command at
    once, with its line and status: with the deadline 600 s away, nothing else could end it within ``stop``'s 10 s
    (sent to the process group they also reach Ray's raylet, whose exit makes Ray end the process with status 1).
    SIGINT leaves the section to wind down: 1 s later it still runs, and a second Ctrl-C ends it."""
    script = tmp_path / "prog.py"
    script.write_text(SIMULATION)
    proc = start([sys.executable, str(script)], env=dict(os.environ))
    assert proc.stdout.readline().strip() == "ready"
    status, err, _ = stop(proc, signum)
    assert status == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"stopped by {signal.Signals(signum).name}"

    proc = start([sys.executable, str(script)], env=dict(os.environ))
    assert proc.stdout.readline().strip() == "ready"
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None
    status, err, _ = stop(proc, signal.SIGINT)
    assert status == 130 and err.strip().splitlines()[-1] == "stopped by SIGINT", err
    assert session(proc.pid) == []


# a library's thread that starts a process once the stop is under way, as Flower's simulation does from its
# ``finally`` (its exit event runs ``platform.architecture()``, hence the ``file`` command)
LATE = textwrap.dedent("""
    import subprocess, sys, threading, time
    from fedspear import stops

    def library():
        while not stops.requested():
            time.sleep(0.01)
        time.sleep(0.3)  # the tree is being ended: the SIGTERM-ignoring child holds that for KILL_AFTER (2 s)
        print(subprocess.Popen(["sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid, flush=True)

    with stops.Stops(lambda signum: "stopped", deadline=30.0):
        child = subprocess.Popen([sys.executable, "-c",
                                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
        print(child.pid, flush=True)
        threading.Thread(target=library, daemon=True).start()
        time.sleep(600)
""")


def test_a_child_a_library_starts_while_the_tree_is_ended_does_not_outlive_the_command(tmp_path):
    """Ctrl-C; 0.3 s later, while the first child's SIGTERM grace runs, a daemon thread starts ``sleep 30``: it is
    not among the processes the stop set out to end, yet when the command has exited it is gone too."""
    script = tmp_path / "late.py"
    script.write_text(LATE)
    proc = start([sys.executable, str(script)], env=dict(os.environ))
    int(proc.stdout.readline())
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    late = int(proc.stdout.readline())  # the thread did start its process before the command ended
    status, err, seconds = stop(proc, signal.SIGCONT)  # SIGCONT: harmless, only to wait for the exit
    assert status == 130 and err.strip().splitlines()[-1] == "stopped", err
    assert seconds < 10.0
    assert not psutil.pid_exists(late) or psutil.Process(late).status() == psutil.STATUS_ZOMBIE
    assert session(proc.pid) == []


def test_node_worker_stops_on_sigterm_with_its_line(tmp_path):
    key = tmp_path / "worker.key"
    proc = start([FEDSPEAR, "node-worker", "--address", "127.0.0.1:0", "--key-file", str(key)],
                 env=dict(os.environ))
    wait_for(key.exists, proc, 120, "key file")
    time.sleep(1.0)  # listening
    status, err, _ = stop(proc, signal.SIGTERM, group=False)
    assert status == 143, err
    assert err.strip().splitlines()[-1] == (f"stopped by SIGTERM; run it again with: fedspear node-worker --address "
                                            f"127.0.0.1:0 --key-file {key}")
    assert session(proc.pid) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hang-up"])
def test_chat_stops_on_ctrl_c_or_a_hang_up_with_its_line(tmp_path, signum):
    """uvicorn handles SIGINT itself (closes the server, then raises it again for fedspear's handler), and SIGHUP
    through fedspear's ``Server`` (``human.chat``): the same line, no traceback and no process left."""
    pytest.importorskip("uvicorn")
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    traces = tmp_path / "traces.db"
    proc = start([FEDSPEAR, "chat", "--model", "tiny-random", "--traces", str(traces), "--port", str(port)],
                 env=dict(os.environ))
    assert "fedspear chat" in proc.stdout.readline()
    assert "Ctrl-C stops" in proc.stdout.readline()

    def listening() -> bool:
        with __import__("socket").socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0
    wait_for(listening, proc, 60, "server")
    status, err, _ = stop(proc, signum)
    name = signal.Signals(signum).name
    assert status == 128 + signum, err
    assert err.strip().splitlines()[-1] == (f"stopped by {name}; run it again with: fedspear chat --model tiny-random "
                                            f"--traces {traces} --port {port}")
    assert "Traceback" not in err, err[-3000:]
    assert session(proc.pid) == []


def test_eval_stops_on_ctrl_c_mid_evaluation_and_writes_nothing(tmp_path):
    """Ctrl-C while ``fedspear eval`` generates (the tiny model over the whole ARC test split): exit 130 within 10 s,
    its one line with the command, no traceback, no results file, nothing of its session left."""
    out = tmp_path / "eval.json"
    args = ["eval", "--model", "tiny-random", "--dtype", "fp32", "--eval-size", "0", "--set", "max_new_tokens=64",
            "-o", str(out)]
    proc = start([FEDSPEAR, *args], env=dict(os.environ))

    def torch_loaded() -> bool:
        try:
            return "libtorch_cpu" in Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            return False
    wait_for(torch_loaded, proc, 120, "torch loaded")
    time.sleep(4.0)  # then the data and the model, and generating (the whole split takes minutes)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    status, err, _ = stop(proc, signal.SIGINT)
    assert status == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == f"stopped by SIGINT; run it again with: fedspear {' '.join(args)}"
    assert not out.exists()
    assert session(proc.pid) == []


def test_a_stop_before_the_first_round_prints_one_line_and_records_nothing(tmp_path):
    """Ctrl-C while ``fedspear run`` still checks its inputs (here: the packaged model's first export into an empty
    cache, ≈ 30 s): exit 130 within 10 s, one line and no traceback, no run folder."""
    cache = tmp_path / "cache"
    out = tmp_path / "run"
    proc = start([FEDSPEAR, "run", "--model", "smollm2-135m", "-o", str(out)],
                 env={**os.environ, "FEDSPEAR_CACHE": str(cache)})
    wait_for(lambda: (cache / "models").is_dir(), proc, 300, "the model's export")
    time.sleep(1.0)
    status, err, _ = stop(proc, signal.SIGINT)
    assert status == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGINT before the first round (nothing recorded); run it again with: fedspear run --model "
        f"smollm2-135m -o {out}")
    assert not out.exists()
    assert not any(p.name == "config.json" for p in (cache / "models").rglob("*") if ".tmp" not in str(p.parent))
    assert session(proc.pid) == []


# ---- fedspear run: a stop keeps the completed rounds, and the resumed run equals an uninterrupted one ---------------
def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _has_round(out: Path, server_round: int):
    def check() -> bool:
        path = out / "metrics.jsonl"
        return path.is_file() and any(f'"round": {server_round},' in line for line in path.read_text().splitlines())
    return check


def _wait_at_work(proc: subprocess.Popen, outs, server_round: int, timeout: float = 300) -> None:
    """Wait until a client of one of the runs in ``outs()`` (their output folders) is at work on ``server_round``
    (``helpers.client_at_work``, looked at every 20 ms); fails (killing ``proc``'s group) when ``proc`` ends first or
    none is seen within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not any(client_at_work(out, server_round) for out in outs()):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no client was seen at work on round {server_round} (exit {proc.poll()}): "
                        f"{proc.stderr.read()[-3000:]}")
        time.sleep(0.02)


def _stopped_run(out: Path, signum: int, after_round: int, group: bool = True) -> tuple[int, str, float]:
    """Start the run, wait for round ``after_round``'s record and then for a client at work on the next round
    (``helpers.client_at_work``, looked at every 20 ms: a tiny round can take well under a second, so a fixed wait
    could see the run end), send ``signum`` to its process group (or to the CLI alone); (status, stderr, seconds),
    stderr followed by the end of Ray's driver log where the status is not the stop's."""
    proc = start([FEDSPEAR, "run", *RESUME_ARGS, "-o", str(out)], env=dict(os.environ))
    wait_for(_has_round(out, after_round), proc, 600, f"round {after_round}")
    _wait_at_work(proc, lambda: [out], after_round + 1)
    status, err, seconds = stop(proc, signum, group=group)
    assert session(proc.pid) == [], "processes left running"
    if status != 128 + signum:  # the failure message shows what Ray's core in the run's process logged last
        err += _ray_driver_log(proc.pid)
    return status, err, seconds


def _ray_driver_log(pid: int, lines: int = 15) -> str:
    """The last ``lines`` lines of Ray's log of the core worker in process ``pid`` (the driver), where Ray writes
    why it ended a process itself (a run that ended with status 1 and no stop line, 2026-12-06); '' without one."""
    sessions = Path(os.environ.get("RAY_TMPDIR", "/tmp"), "ray")  # Ray's default place for its session logs
    logs = sorted(sessions.glob(f"session_*/logs/python-core-driver-*_{pid}.log"), key=lambda log: log.stat().st_mtime)
    if not logs:
        return ""
    return f"\n--- {logs[-1]}:\n" + "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, uninterrupted_run):
    """SIGINT to the process group while a client works on round 2: exit 130 within 10 s, nothing left running, the
    rounds finished so far kept (0–1, or 0–2 where the client's reply was already on its way), the line names the last
    of them and the command; re-running it resumes after that round and ends with the adapter, FedAdam moments and
    metrics of a run never interrupted (wall-clock, memory and node ids aside)."""
    whole, stopped = uninterrupted_run, tmp_path / "stopped"
    status, err, seconds = _stopped_run(stopped, signal.SIGINT, after_round=1)
    kept = [r["round"] for r in _records(stopped)]
    print(f"SIGINT: exit {status} after {seconds:.1f} s, rounds {kept} kept")
    assert status == 130, err[-3000:]
    assert kept in ([0, 1], [0, 1, 2]), kept  # stopped inside round 2, never after the run's end
    last = kept[-1]
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGINT after round {last} of 3 ({stopped} keeps rounds 0–{last}; the round in flight is redone); "
        f"resume with: fedspear run {' '.join(RESUME_ARGS)} -o {stopped}")
    assert "Traceback" not in err, err[-3000:]

    proc = subprocess.run([FEDSPEAR, "run", *RESUME_ARGS, "-o", str(stopped)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming after round {last}" in proc.stderr
    a, b = (load_file(str(out / "adapters" / "round_0003" / "adapter_model.safetensors")) for out in (whole, stopped))
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6
    moments = [load_file(str(out / "adapters" / "round_0003" / "server_state.safetensors")) for out in (whole, stopped)]
    assert all(np.array_equal(moments[0][k], moments[1][k]) for k in moments[0])
    assert stable(_records(whole)) == stable(_records(stopped))


@pytest.mark.slow
@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, True), (signal.SIGTERM, False), (signal.SIGHUP, True)],
                         ids=["sigterm-process-group", "sigterm-cli-only", "sighup-process-group"])
def test_sigterm_or_a_hang_up_stops_the_run_and_ray_with_it(tmp_path, signum, group):
    """SIGTERM to the process group reaches Ray's own services too (they block only SIGINT); ``kill <pid>`` reaches
    the CLI alone; SIGHUP to the process group is what a closed terminal sends. Each way: exit 128 + the signal
    (143, 129) within 10 s, no process of the session left (Ray's DashboardAgent and RuntimeEnvAgent included), the
    rounds finished so far kept and readable (round 0, and round 1 where the client's reply was already on its way)
    and named by the line."""
    out, name = tmp_path / "run", signal.Signals(signum).name
    status, err, seconds = _stopped_run(out, signum, after_round=0, group=group)
    kept = [r["round"] for r in _records(out)]
    print(f"{name} ({'group' if group else 'pid'}): exit {status} after {seconds:.1f} s, rounds {kept} kept")
    assert status == 128 + signum, err[-3000:]
    assert kept in ([0], [0, 1]), kept
    assert err.strip().splitlines()[-1].startswith(
        f"stopped by {name} after round {kept[-1]} of 3 ({out} keeps rounds 0–{kept[-1]}")


@pytest.mark.slow
def test_ctrl_c_stops_compare_and_the_cell_it_runs(tmp_path):
    """``fedspear compare`` runs each cell as a ``fedspear run`` in a process group of its own and passes the signal
    on once: exit 130 within 10 s, the cell's log ends with its run's stop line, compare's with where the grid
    stopped, and nothing of the session is left."""
    out = tmp_path / "grid"
    proc = start([FEDSPEAR, "compare", "--preset", "tiny", "--algorithms", "spear", "--set", "rounds=3",
                  "-o", str(out)], env=dict(os.environ))
    cell = out / "cells"
    wait_for(lambda: any(_has_round(c, 0)() for c in cell.glob("*")), proc, 600, "the cell's round 0")
    _wait_at_work(proc, lambda: list(cell.glob("*")), 1)
    status, err, seconds = stop(proc, signal.SIGINT)
    print(f"compare: exit {status} after {seconds:.1f} s")
    assert status == 130, err[-3000:]
    (name,) = [c.name for c in cell.glob("*")]
    assert err.strip().splitlines()[-1].startswith(f"stopped by SIGINT: 0 of 1 cells finished; stopped in cell {name} "
                                                   f"after its round ")
    assert err.strip().endswith(f"resume with: fedspear compare --preset tiny --algorithms spear --set rounds=3 "
                                f"-o {out}")
    log = (cell / name / "log.txt").read_text().strip().splitlines()
    assert log[-1].startswith("stopped by SIGINT after round "), log[-5:]
    assert session(proc.pid) == []
