"""``fedspear chat``: the JSON API (FastAPI's test client) and the page in a real headless Chromium (Playwright),
with every conversation checked in the SQLite trace store. The tiny random model answers (its words are noise;
the flow is what is tested)."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import threading
import time

import pytest
from fastapi.testclient import TestClient

from fedspear.human.chat import ChatModel, create_app
from fedspear.human.store import TraceStore


@pytest.fixture(scope="module")
def responder():
    from fedspear.runtime.model import tiny_model

    model, tokenizer = tiny_model(seed=0)
    model.eval()
    return ChatModel(model, tokenizer, "fp32", "tiny-random", max_new_tokens=6)


def test_ask_judge_revise_and_store(responder, tmp_path):
    store = TraceStore(tmp_path / "traces.db")
    client = TestClient(create_app(store, responder, max_revisions=2))
    first = client.post("/api/ask", json={"prompt": "Why is the sky blue?"}).json()
    tid = first["trajectory_id"]
    assert first["n"] == 0 and first["revisions_left"] == 2 and isinstance(first["answer"], str)
    second = client.post("/api/judge", json={"trajectory_id": tid, "correct": False,
                                             "hint": "Think about scattering."}).json()
    assert second["n"] == 1 and not second["closed"]
    third = client.post("/api/judge", json={"trajectory_id": tid, "correct": False, "hint": "Shorter waves."}).json()
    assert third["n"] == 2 and third["revisions_left"] == 0
    done = client.post("/api/judge", json={"trajectory_id": tid, "correct": False, "hint": "Still no."}).json()
    assert done["closed"]  # y0 + N = 2 revisions spent: closed, no third revision
    traj = store.get(tid)
    assert traj.closed and len(traj.attempts) == 3 and traj.model_version == "tiny-random"
    assert [a.verdict for a in traj.attempts] == [False, False, False]
    assert [a.hint for a in traj.attempts] == ["Think about scattering.", "Shorter waves.", "Still no."]
    assert [a.completion for a in traj.attempts] == [first["answer"], second["answer"], third["answer"]]
    assert all(a.completion_ids for a in traj.attempts)

    right = client.post("/api/ask", json={"prompt": "Say hi."}).json()
    assert client.post("/api/judge", json={"trajectory_id": right["trajectory_id"], "correct": True}).json()["closed"]
    listing = client.get("/api/trajectories").json()
    assert listing["counts"] == {"total": 2, "open": 0, "trainable": 2, "used": 0}
    assert listing["trajectories"][0]["prompt"] == "Say hi."


def test_bad_requests_get_clear_errors(responder, tmp_path):
    store = TraceStore(tmp_path / "traces.db")
    client = TestClient(create_app(store, responder, max_revisions=1))
    assert client.post("/api/ask", json={"prompt": ""}).status_code == 422
    assert client.post("/api/ask", json={"question": "wrong field"}).status_code == 422
    assert client.post("/api/ask", json={"prompt": "   "}).status_code == 422
    missing = client.post("/api/judge", json={"trajectory_id": 42, "correct": True})
    assert missing.status_code == 404 and "trajectory 42" in missing.json()["detail"]
    tid = client.post("/api/ask", json={"prompt": "Q?"}).json()["trajectory_id"]
    assert client.post("/api/judge", json={"trajectory_id": tid, "correct": "maybe"}).status_code == 422
    client.post("/api/judge", json={"trajectory_id": tid, "correct": True})
    closed = client.post("/api/judge", json={"trajectory_id": tid, "correct": False, "hint": "h"})
    assert closed.status_code == 409 and "closed" in closed.json()["detail"]
    assert store.counts()["total"] == 1
    with pytest.raises(ValueError, match="max_revisions"):
        create_app(store, responder, max_revisions=-1)


def _chromium() -> str:
    path = os.environ.get("FEDSPEAR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("the browser test needs Chromium: `make test` installs Debian's chromium "
                    "(or set FEDSPEAR_CHROMIUM)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(responder, tmp_path):
    """The app served by uvicorn on 127.0.0.1 in a thread; stopped after the test."""
    import uvicorn

    store = TraceStore(tmp_path / "traces.db")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(store, responder, max_revisions=2), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/", store
    server.should_exit = True
    thread.join(timeout=10)


def test_a_person_asks_marks_wrong_types_a_hint_and_sees_the_revision(served):
    """In headless Chromium: ask, 👎, type a hint, Revise → the revision appears; 👍 → saved. Then the trajectory
    is in SQLite (read with plain sqlite3, as a person inspecting the file would) with both attempts, the verdicts,
    the hint and timestamps."""
    from playwright.sync_api import expect, sync_playwright

    url, store = served
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            page.goto(url)
            page.fill("#prompt", "Which planet is known as the red planet?")
            page.click("#ask")
            expect(page.locator("#answer-0")).to_be_visible(timeout=60_000)
            first = page.locator("#answer-0").inner_text()
            page.click("#wrong")
            page.fill("#hint", "Think about the colour of rust.")
            page.click("#revise")
            expect(page.locator("#answer-1")).to_be_visible(timeout=60_000)
            expect(page.locator(".turn.hint")).to_have_text("Think about the colour of rust.")
            second = page.locator("#answer-1").inner_text()
            page.click("#right")
            expect(page.locator("#status")).to_contain_text("saved conversation", timeout=30_000)
            expect(page.locator("#stored")).to_contain_text("1 stored, 1 waiting for the next round")
        finally:
            browser.close()

    conn = sqlite3.connect(store.path)
    (tid, prompt, version, closed_at), = conn.execute(
        "SELECT id, prompt, model_version, closed_at FROM trajectories").fetchall()
    rows = conn.execute("SELECT n, completion, verdict, hint, answered_at, judged_at FROM attempts "
                        "WHERE trajectory_id = ? ORDER BY n", (tid,)).fetchall()
    conn.close()
    assert prompt == "Which planet is known as the red planet?" and version == "tiny-random" and closed_at
    assert [(n, v, h) for n, _, v, h, _, _ in rows] == [(0, 0, "Think about the colour of rust."), (1, 1, None)]
    assert [r[1].strip() for r in rows] == [first.strip(), second.strip()]
    assert all(a and j and j >= a for *_, a, j in rows)


def test_chat_command_refuses_a_file_that_is_not_a_trace_store(tmp_path):
    from typer.testing import CliRunner

    from fedspear.cli import app

    notes = tmp_path / "notes.db"
    notes.write_text("my shopping list, not a database " * 40)
    result = CliRunner().invoke(app, ["chat", "--traces", str(notes)])
    assert result.exit_code == 2
    assert "notes.db" in result.output and "trace store" in result.output
    missing = CliRunner().invoke(app, ["chat", "--traces", str(tmp_path / "t.db"), "--adapter", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "no peft adapter" in missing.output


def test_without_the_ui_extra_chat_says_which_extra_to_install(tmp_path):
    """fastapi / uvicorn are the [ui] extra: without them `fedspear chat` stops with the pip command, no traceback."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = None\n"  # what Python does for a package that is not installed
            "from fedspear.cli import app\n"
            f"app(['chat', '--traces', {str(tmp_path / 'traces.db')!r}])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "fedspear chat needs the [ui] extra: pip install 'fedspear[ui]'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "traces.db").exists()


def test_chat_command_refuses_a_store_path_through_a_file_or_another_database(tmp_path):
    """One line, exit 2, before the model loads: a --traces path under a file, and another application's SQLite
    database (left as it was)."""
    from typer.testing import CliRunner

    from fedspear.cli import app

    no_adapter = ["--model", "tiny-random", "--adapter", str(tmp_path / "none")]  # were the store accepted: exit 2
    (tmp_path / "ok.toml").write_text("x")
    result = CliRunner().invoke(app, ["chat", "--traces", str(tmp_path / "ok.toml" / "x.db"), *no_adapter])
    assert result.exit_code == 2 and "ok.toml is a file, not a folder" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.commit()
    conn.close()
    before = other.read_bytes()
    result = CliRunner().invoke(app, ["chat", "--traces", str(other), *no_adapter])
    assert result.exit_code == 2 and "other.db: not a fedspear trace store" in result.output
    assert other.read_bytes() == before


def test_the_address_is_checked_before_the_server_starts():
    """A port in use and a host that is not this machine's are refused with the flag and the value (what the chat
    command checks before loading the model and printing the URL); a free port passes and stays free."""
    from fedspear.human.chat import check_bind

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--port {port}: 127.0.0.1:{port} is already in use"):
            check_bind("127.0.0.1", port)
    check_bind("127.0.0.1", port)
    check_bind("127.0.0.1", port)  # the check's own socket is closed
    host = "192.0.2.1"  # an address of another machine (TEST-NET-1; numeric: no name lookup)
    with pytest.raises(ValueError, match=rf"--host {host}: not an address of this machine"):
        check_bind(host, port)


def test_the_address_check_skips_an_address_family_the_machine_lacks(monkeypatch):
    """With IPv6 switched off, "localhost" may still resolve to ::1 as well, and making an IPv6 socket fails: asyncio
    (uvicorn) skips that address and serves on 127.0.0.1, so the check skips it too instead of a traceback."""
    from fedspear.human import chat

    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    both = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: both)
    monkeypatch.setattr(socket, "socket", no_ipv6)
    chat.check_bind("localhost", 0)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: both[:1])
    with pytest.raises(ValueError, match="no socket of its address family can be made here"):
        chat.check_bind("localhost", 0)


def test_chat_command_checks_its_address_before_anything_else(tmp_path):
    """A port in use: exit 2 naming --port, before the URL is printed and before the store is created."""
    import socket

    from typer.testing import CliRunner

    from fedspear.cli import app

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = CliRunner().invoke(app, ["chat", "--traces", str(tmp_path / "t.db"), "--model", "tiny-random",
                                          "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"--port {port}" in result.output and "already in use" in result.output
    assert "open http" not in result.output and not (tmp_path / "t.db").exists()
