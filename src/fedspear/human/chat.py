"""``fedspear chat``: a person asks, judges the answer and types hints; every conversation lands in the trace store.

A small FastAPI app (one HTML page, a JSON API) served on 127.0.0.1 by uvicorn. The flow is SPEAR's interaction
phase (paper Alg. 1 lines 5–22) with the person as the feedback source:

1. ``POST /api/ask {"prompt"}``: the model samples y0 for the prompt (temperature 0.8, top-p 0.95, as in rollouts),
   a trajectory is opened in the :class:`~fedspear.human.store.TraceStore` with the model version.
2. ``POST /api/judge {"trajectory_id", "correct", "hint"?}``: the verdict on the last attempt. Right → closed.
   Wrong with a hint → the model revises from c_n = c0 ‖ y_prev ‖ hint (the same rendering as simulation) and the
   reply carries the new attempt, up to N revisions; wrong without a hint, or after the N-th revision → closed.
3. ``POST /api/close {"trajectory_id"}``: the person stops revising. ``GET /api/trajectories``: the stored
   conversations (for the person's own review; the page lists them).

Errors: 404 unknown trajectory, 409 an action the trajectory's state forbids (the message says why), 422 malformed
input (FastAPI's validation). The text never leaves the machine: the server binds 127.0.0.1 unless told otherwise.
No flwr here.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

try:  # the [ui] extra
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse
    from pydantic import BaseModel, Field
except ImportError as err:
    raise ImportError(f"fedspear chat needs the [ui] extra: pip install 'fedspear[ui]' ({err})") from err

from ..runtime.generation import generate
from ..interaction import render
from .store import TraceStore, TraceStoreError, Trajectory, count

DEFAULT_PORT = 8765
STARTUP_FAILURE = 3  # exit status when the server could not start (uvicorn.main.STARTUP_FAILURE)


@dataclass
class ChatModel:
    """The node's model as a chat responder: base model (+ the federation's adapter, if given), sampling settings.

    Attributes:
        version: names the model that answered (stored with each trajectory): ``<model>`` or
            ``<model>+<adapter folder>@<sha256 of its weights, 12 hex>``.
    """

    model: object
    tokenizer: object
    dtype_used: str
    version: str
    max_new_tokens: int = 256
    temperature: float = 0.8
    top_p: float = 0.95

    @classmethod
    def load(cls, model: str = "smollm2-135m", dtype: str = "auto", adapter: str | Path | None = None,
             max_new_tokens: int = 256) -> "ChatModel":
        """Load the base model and, optionally, a peft adapter folder (e.g. ``runs/x/adapters/round_0004``).

        Raises:
            fedspear.runtime.model_zoo.ModelError: the model cannot be loaded.
            FileNotFoundError: no adapter at ``adapter``.
        """
        from ..runtime.model import load_base, ready_lora_layers

        base, tokenizer, dtype_used = load_base(model, dtype)
        version = model
        if adapter is not None:
            from peft import PeftModel

            folder = Path(adapter)
            weights = folder / "adapter_model.safetensors"
            if not weights.is_file():
                raise FileNotFoundError(f"no peft adapter at {folder} (expected {weights.name})")
            base = PeftModel.from_pretrained(base, folder)
            ready_lora_layers(base)  # as add_lora does: bf16 inputs as they come, updates summed in lora_B
            version += f"+{folder.name}@{hashlib.sha256(weights.read_bytes()).hexdigest()[:12]}"
        base.eval()
        return cls(base, tokenizer, dtype_used, version, max_new_tokens)

    def answer(self, turns: list[str], seed: int) -> tuple[str, list[int], bool]:
        """Sample the next assistant turn for a conversation ``[user, assistant, user, …]``.

        Returns:
            ``(text, token ids, has_eos)``; the text is what the interaction phase decodes from the ids.
        """
        torch.manual_seed(seed)
        ids = generate(self.model, self.tokenizer, [render(self.tokenizer, turns)],
                       max_new_tokens=self.max_new_tokens, dtype_used=self.dtype_used,
                       temperature=self.temperature, top_p=self.top_p)[0]
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode(ids, skip_special_tokens=True), ids, bool(ids) and ids[-1] == eos


class AskRequest(BaseModel):
    prompt: str = Field(min_length=1, max_length=20000, description="the person's question")


class JudgeRequest(BaseModel):
    trajectory_id: int = Field(ge=1)
    correct: bool
    hint: str | None = Field(default=None, max_length=5000, description="partial feedback on a wrong answer")


class CloseRequest(BaseModel):
    trajectory_id: int = Field(ge=1)


def _view(traj: Trajectory) -> dict:
    return {
        "trajectory_id": traj.id, "prompt": traj.prompt, "model_version": traj.model_version,
        "closed": traj.closed, "used_in_round": traj.used_in_round,
        "attempts": [{"n": n, "answer": a.completion, "verdict": a.verdict, "hint": a.hint}
                     for n, a in enumerate(traj.attempts)],
    }


def create_app(store: TraceStore, responder: ChatModel, max_revisions: int = 2) -> FastAPI:
    """The chat web app over ``store`` answering with ``responder``; N = ``max_revisions`` (paper default 2).

    Raises:
        ValueError: ``max_revisions`` is negative.
    """
    if max_revisions < 0:
        raise ValueError(f"max_revisions must be ≥ 0, got {max_revisions}")
    app = FastAPI(title="fedspear chat", docs_url=None, redoc_url=None)
    lock = threading.Lock()  # one generation at a time (one model, two cores)

    def seed_of(tid: int, n: int) -> int:
        digest = hashlib.sha256(f"{store.path}:{tid}:{n}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def get(tid: int) -> Trajectory:
        try:
            return store.get(tid)
        except TraceStoreError as err:
            raise HTTPException(404, str(err)) from None

    def attempt(traj: Trajectory, turns: list[str]) -> dict:
        n = len(traj.attempts)
        with lock:
            text, ids, eos = responder.answer(turns, seed_of(traj.id, n))
        store.add_attempt(traj.id, text, ids, eos)
        return {"trajectory_id": traj.id, "n": n, "answer": text, "closed": False,
                "revisions_left": max_revisions - n}

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.replace("{{VERSION}}", responder.version).replace("{{N}}", str(max_revisions))

    @app.post("/api/ask")
    def ask(req: AskRequest) -> dict:
        if not req.prompt.strip():
            raise HTTPException(422, "prompt is empty")
        tid = store.open(req.prompt, responder.version)
        return attempt(store.get(tid), [req.prompt])

    @app.post("/api/judge")
    def judge(req: JudgeRequest) -> dict:
        traj = get(req.trajectory_id)
        hint = req.hint.strip() if req.hint and req.hint.strip() else None
        if req.correct:
            hint = None
        try:
            store.judge(traj.id, req.correct, hint)
        except TraceStoreError as err:
            raise HTTPException(409, str(err)) from None
        traj = store.get(traj.id)
        if req.correct or hint is None:
            return {"trajectory_id": traj.id, "closed": True}
        if len(traj.attempts) > max_revisions:  # y0 + N revisions spent
            store.close(traj.id)
            return {"trajectory_id": traj.id, "closed": True}
        turns = [traj.prompt, traj.attempts[-1].completion, hint]
        return attempt(traj, turns)

    @app.post("/api/close")
    def close(req: CloseRequest) -> dict:
        get(req.trajectory_id)
        store.close(req.trajectory_id)
        return {"trajectory_id": req.trajectory_id, "closed": True}

    @app.get("/api/trajectories")
    def trajectories() -> dict:
        trajs = store.trajectories()
        return {"counts": count(trajs), "trajectories": [_view(t) for t in reversed(trajs)]}

    return app


def check_bind(host: str, port: int) -> None:
    """Refuse, before the model loads and the URL is printed, an address the server could not listen on: bind a
    socket to ``host:port`` the way uvicorn's asyncio server does (every address ``host`` resolves to,
    ``SO_REUSEADDR``, so a port only in TIME_WAIT passes) and close it at once. The messages name ``fedspear chat``'s
    ``--host`` / ``--port`` and the value.

    Raises:
        ValueError: ``host`` does not resolve or is not an address of this machine; ``port`` is in use or needs
            privileges.
    """
    import errno
    import socket

    where = f"--host {host}: not an address of this machine"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"{where} ({err.strerror}); keep 127.0.0.1 or give one of its addresses") from None
    made = 0
    for family, kind, proto, _, address in addresses:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # an address family this machine lacks (IPv6 switched off): asyncio skips it too
            continue
        made += 1
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio binds it: IPv6 only, the IPv4 address has its own entry
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise ValueError(f"--port {port}: {host}:{port} is already in use (another fedspear chat?); stop "
                                     "what listens there or give another --port") from None
                if err.errno == errno.EACCES:
                    raise ValueError(f"--port {port}: not allowed to listen there ({err.strerror}); give a port "
                                     "above 1023") from None
                raise ValueError(f"{where} ({err.strerror}); keep 127.0.0.1 or give one of its addresses") from None
    if not made:
        raise ValueError(f"{where} (no socket of its address family can be made here); keep 127.0.0.1")


def serve(store_path: str | Path, responder: ChatModel, *, max_revisions: int = 2, host: str = "127.0.0.1",
          port: int = DEFAULT_PORT) -> None:
    """Run the chat app with uvicorn until interrupted (Ctrl-C or SIGTERM).

    Raises:
        ImportError: uvicorn is missing (the message names the [ui] extra).
    """
    try:
        import uvicorn
    except ImportError as err:
        raise ImportError(f"fedspear chat needs the [ui] extra: pip install 'fedspear[ui]' ({err})") from err

    app = create_app(TraceStore(store_path), responder, max_revisions)
    # SIGINT / SIGTERM / SIGHUP: uvicorn closes the server (an answer being generated gets 3 s), then raises the
    # signal again for fedspear's handler, which prints the stop line and ends the command (``fedspear.stops``)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)
    server = _server_class(uvicorn)(config)
    server.run()
    if not server.started:  # as uvicorn.run ends where startup failed (it logged why; a port in use exits 1 itself)
        raise SystemExit(STARTUP_FAILURE)


def _server_class(uvicorn):
    """``uvicorn.Server`` that also closes on SIGHUP (a closed terminal), as it does on SIGINT and SIGTERM
    (``uvicorn/server.py``: ``capture_signals`` takes only those two; a SIGHUP reaching ``fedspear.stops``' handler
    inside uvicorn's loop would end the command with uvicorn's traceback). Where SIGHUP is ignored (``nohup``) it
    stays ignored."""
    import signal
    from contextlib import contextmanager

    from ..stops import handled_signals

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):
            with super().capture_signals():
                if (threading.current_thread() is not threading.main_thread()
                        or signal.SIGHUP not in handled_signals()):
                    yield
                    return
                previous = signal.signal(signal.SIGHUP, self.handle_exit)
                try:
                    yield
                finally:  # back before uvicorn raises the signals it caught again, SIGHUP among them
                    signal.signal(signal.SIGHUP, previous)

    return Server


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fedspear chat</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
 textarea, input[type=text] { width: 100%; box-sizing: border-box; font: inherit; padding: .4rem; }
 button { font: inherit; padding: .35rem .9rem; margin: .3rem .3rem .3rem 0; cursor: pointer; }
 .turn { border-radius: .5rem; padding: .5rem .8rem; margin: .4rem 0; white-space: pre-wrap; }
 .user { background: #eef3ff; } .model { background: #f4f4f4; } .hint { background: #fff4e0; }
 .meta { color: #777; font-size: .85rem; }
 #judge, #hintbox { display: none; }
</style></head>
<body>
<h1>fedspear chat</h1>
<p class="meta">Model <code>{{VERSION}}</code>; up to {{N}} revisions. Your questions, the answers and your hints stay
on this machine; only the trained adapter is shared with the federation.</p>
<div id="log"></div>
<div id="judge">
  <button id="right">&#128077; Right</button><button id="wrong">&#128078; Wrong</button>
</div>
<div id="hintbox">
  <input type="text" id="hint" placeholder="A hint (not the answer) — what is wrong, what to look at">
  <button id="revise">Revise</button><button id="giveup">Stop here</button>
</div>
<div id="askbox">
  <textarea id="prompt" rows="3" placeholder="Ask something"></textarea>
  <button id="ask">Ask</button>
</div>
<p id="status" class="meta"></p>
<h2>Stored conversations</h2><div id="stored" class="meta"></div>
<script>
let current = null;
const $ = (id) => document.getElementById(id);
function turn(cls, text, id) {
  const d = document.createElement('div'); d.className = 'turn ' + cls; d.textContent = text;
  if (id) d.id = id; $('log').appendChild(d);
}
function show(mode) {
  $('judge').style.display = mode === 'judge' ? 'block' : 'none';
  $('hintbox').style.display = mode === 'hint' ? 'block' : 'none';
  $('askbox').style.display = mode === 'ask' ? 'block' : 'none';
}
async function call(path, body) {
  $('status').textContent = 'thinking…';
  const r = await fetch(path, {method: 'POST', headers: {'Content-Type': 'application/json'},
                               body: JSON.stringify(body)});
  const data = await r.json();
  if (!r.ok) { $('status').textContent = 'error: ' + JSON.stringify(data.detail); throw new Error(r.status); }
  $('status').textContent = '';
  return data;
}
function answered(data) {
  current = data.trajectory_id;
  turn('model', data.answer, 'answer-' + data.n);
  show('judge');
}
function closed() {
  $('status').textContent = 'saved conversation ' + current;
  current = null; show('ask'); refresh();
}
$('ask').onclick = async () => {
  const prompt = $('prompt').value.trim(); if (!prompt) return;
  $('log').innerHTML = ''; turn('user', prompt); $('prompt').value = '';
  answered(await call('/api/ask', {prompt}));
};
$('right').onclick = async () => { await call('/api/judge', {trajectory_id: current, correct: true}); closed(); };
$('wrong').onclick = () => { show('hint'); $('hint').focus(); };
$('revise').onclick = async () => {
  const hint = $('hint').value.trim(); if (!hint) { $('hint').focus(); return; }
  turn('hint', hint); $('hint').value = '';
  const data = await call('/api/judge', {trajectory_id: current, correct: false, hint});
  if (data.closed) { closed(); } else { answered(data); }
};
$('giveup').onclick = async () => {
  await call('/api/judge', {trajectory_id: current, correct: false}); closed();
};
async function refresh() {
  const r = await fetch('/api/trajectories'); const data = await r.json();
  const c = data.counts;
  $('stored').textContent = `${c.total} stored, ${c.trainable} waiting for the next round, ${c.used} used in training`;
}
show('ask'); refresh();
</script>
</body></html>
"""
