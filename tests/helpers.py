"""Shared test helpers (plain functions and classes; fixtures live in conftest.py): a tiny-model worker, a LoRA start
that receives gradients, a feedback source with mixed rewards, and killing a whole run mid-round."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedspear.worker import Worker
from fedspear.config import RunConfig
from fedspear.runtime.model import get_adapter, set_adapter

if TYPE_CHECKING:
    from flwr.app import Message

# ``fedspear run``'s tiny one-round settings (``compare --preset tiny``'s base; test_algorithms' runs): generations and
# aggregation weight per client-round with P = 2 prompts and the tiny model (never right): SPEAR / SFT 1 + N revisions
# each, GRPO G, OPSD 1, RLTF-SD N first turns + N revisions (G = N = 4 on ARC)
ONE_ROUND_EXPECTED = {"spear": (2 * 2, 0), "feedback_sft": (2 * 2, 0), "grpo": (2 * 4, 2), "opsd": (2, 2),
                      "rltf_sd": (2 * 4 * 2, 2)}

TINY_WORKER = dict(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=3, local_steps=2,
                   batch_size=2, lr=1e-2, max_new_tokens=4, lora_r=4, lora_alpha=8, lora_dropout=0.0, train_size=40)


def make_worker(**overrides) -> Worker:
    """A tiny-random-model worker with a resolved config: ``TINY_WORKER`` settings, ``overrides`` on top."""
    worker = Worker.load(RunConfig(**{**TINY_WORKER, **overrides}))
    return worker


def nonzero_start(worker: Worker) -> dict[str, np.ndarray]:
    """Perturb every LoRA tensor by 0.05·N(0, 1) (seed 0) and return the start adapter: B = 0 at initialisation
    would make the LoRA path, its dropout and A's gradient inert."""
    rng = np.random.default_rng(0)
    start = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in get_adapter(worker.model).items()}
    set_adapter(worker.model, start)
    return start


class Alternate:
    """Feedback source where every other sampled answer is right (every GRPO group of 4 has mixed rewards, so the
    surrogate has a gradient)."""

    def __init__(self):
        self.n = 0

    def is_correct(self, example, completion):
        self.n += 1
        return self.n % 2 == 0

    def feedback(self, example, completion):
        return "Incorrect. Hint: think again."


#: record fields that differ between any two runs of the same settings: wall-clock, memory, which process ran a client
#: (and its history), node ids, and a message's size on the wire (it holds its node and run ids, whose encoded length
#: differs between runs)
VOLATILE = {"seconds", "wall_clock", "peak_rss_mb", "peak_tree_mb", "rss_after_round_mb", "node_id",
            "seconds_generate_initial", "seconds_generate_revisions", "seconds_train", "seconds_evaluate",
            "worker_pid", "model_loads", "seconds_load_model", "bytes_to_client", "bytes_from_client",
            "bytes_to_clients", "bytes_from_clients"}


def stable(value):
    """A run record (or list of them) without the ``VOLATILE`` fields, for comparing two runs."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, …) from /proc: Ray's workers included."""
    children: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            children.setdefault(int(fields["PPid"]), []).append(int(fields["Pid"]))
        except (OSError, KeyError, ValueError):
            continue
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


#: a tiny FedAdam run (3 rounds, one client of two per round, fp32) whose rounds train: the simulated user flips half
#: the verdicts (seeded per client), so the random model's answers make both wins and losses. The stop and kill -9
#: tests resume it and compare with the same run never interrupted (the ``uninterrupted_run`` fixture).
RESUME_ARGS = ["--model", "tiny-random", "--rounds", "3", "--clients", "2", "--clients-per-round", "1",
               "--rollouts-per-round", "4", "--eval-size", "4", "--dtype", "fp32", "--set", "local_steps=2",
               "--set", "batch_size=2", "--set", "eval_every=3", "--set", "train_size=40", "--set", "max_new_tokens=8",
               "--set", "lr=0.001", "--set", "strategy=fedadam", "--set", "user_flip_prob=0.5"]


def client_at_work(out: Path, server_round: int) -> bool:
    """Whether a client's progress file (``<out>/progress/client-*.json``, ``fedspear.progress``) says it is inside a
    phase of round ``server_round`` (answering, revising or training): its reply, so the round's record, is not
    sent yet."""
    for path in (out / "progress").glob("client-*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced between the listing and the read
            continue
        if state.get("round") == server_round and state.get("phase") not in (None, "done"):
            return True
    return False


def kill_run_inside_round(cmd: list[str], out: Path, server_round: int, timeout: float = 600,
                          env: dict[str, str] | None = None) -> None:
    """Start ``cmd`` (a ``fedspear run`` on the simulation engine writing to ``out``), wait until a client is at work
    on round ``server_round`` (``client_at_work``, looked at every 20 ms), and kill -9 the whole run at once: its
    process group and every descendant (Ray's processes too). The round's record is then not written: the group is
    stopped (SIGSTOP) the moment the client is seen, so the server cannot record the round while the descendants are
    looked up.

    Raises:
        AssertionError: no client was seen at work on that round within ``timeout`` s (the run ended, or the round
            went by between two looks).
    """
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.time() + timeout
    while not client_at_work(out, server_round):
        if run.poll() is not None or time.time() > deadline:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
            raise AssertionError(f"no client was seen at work on round {server_round} (exit {run.poll()})")
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGSTOP)
    family = descendants(run.pid)
    os.killpg(run.pid, signal.SIGKILL)
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run.wait()


def train_reply(node: int, arrays: dict[str, np.ndarray], metrics: dict) -> Message:
    """A client's train reply as the strategy receives it: ``arrays`` packed (``to_record``) and ``metrics``,
    with ``node`` as its source node id."""
    from flwr.app import Message, MessageType, MetricRecord, RecordDict

    from fedspear.fl.records import to_record

    msg = Message(content=RecordDict({"arrays": to_record(arrays), "metrics": MetricRecord(metrics)}),
                  dst_node_id=0, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_src_node_id"] = node  # as if it came from that node
    return msg


def error_reply(node: int) -> Message:
    """An error reply from ``node`` (the client raised: "RuntimeError: injected crash")."""
    from flwr.app import Error, Message, MessageType, RecordDict

    msg = Message(content=RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN)
    msg = Message(error=Error(code=0, reason="RuntimeError: injected crash"), reply_to=msg)
    msg.metadata.__dict__["_src_node_id"] = node
    return msg


def with_random_adapter(model, scale: float = 0.5):
    """``model`` (a peft model) with its LoRA B matrices set to N(0, scale²) in place, so the adapter path counts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * scale)
    return model


class OpCounts(TorchDispatchMode):
    """A dispatch mode counting the ATen ops run inside it, by name (``func.overloadpacket.__name__``: ``mm``,
    ``addmm``, ``_linear_pointwise``, …): ``with OpCounts() as ops: …``, then ``ops.counts``."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
