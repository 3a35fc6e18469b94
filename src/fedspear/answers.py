"""Answers kept: every evaluation's per-item answers and the clients' training traces, as gzip-compressed JSON Lines
(no ``flwr``, no torch).

Files (one per evaluated round, one per client-round)::

    <run dir>/answers/round_NNNN.jsonl.gz      the server's evaluation of round NNNN (round 0 = the base model), one
                                               line per held-out item in evaluation order: uid, gold, and for the
                                               greedy answer text, answer_gen (the task's parsed label, null when
                                               none), correct_gen, tokens, cutoff (no EOS within the budget),
                                               reasons (the task's ``reasons`` rule); for multiple choice answer_ll,
                                               correct_ll
    <trace dir>/round_NNNN/client_PPPP.jsonl.gz  what client PPPP saw and said in round NNNN, one line per prompt:
                                               uid, gold, attempts (text, answer, correct, tokens, eos, reasons,
                                               feedback), outcome, alpha (``fedspear.interaction.interact``'s log)

**Where the traces are written.** Raw data stays with the client that produced it: the file is written by the
client process, never sent to the server. In simulation the clients share this machine and write under the run
directory (``fedspear.fl.simulation`` sets ``FEDSPEAR_TRACE_DIR`` = ``<run dir>/traces`` for the Ray actor, as it
sets the progress folder); a SuperNode writes under its own ``trace-dir`` node-config key, and keeps none without
it. Only SPEAR and Feedback SFT keep traces (their interaction phase is the paper's Alg. 1; the baselines sample
groups without revisions).

**Decision (which runs keep traces, ``keep_traces``).** ``auto`` (default) keeps them while a run answers at most
``AUTO_TRACE_PROMPTS`` = 2000 prompts in all (rounds × clients_per_round × rollouts_per_round). Sizes, measured by
writing Qwen2.5-Coder-1.5B's committed StrategyQA answers (``docs/results/parse-rates/generations``, 100 items cut to
256 tokens: 162 tokens on average) with :func:`write_jsonl_gz`: 229 bytes per answer compressed (1.4 bytes per
token), so an evaluation of 500 items takes ≈ 115 KB and a prompt's trace at most ≈ 1 KB (three distinct answers
and two feedback texts of ≈ 150 bytes each compressed), ≈ 0.6 KB on average when half the first answers are right.
2000 prompts are then ≈ 1–2 MB: every CPU preset of this project (cpu-qwen1.5b-sqa: 32 prompts per cell) keeps them,
while the paper's settings (≈ 25,000–80,000 prompts per run, ≈ 15–80 MB) do not unless asked (``on``).
``fedspear compare`` sets ``on`` for its cells: their traces are what shows how a learning curve came about.
Evaluation answers are always kept (one file per evaluated round).

**Rejected client rounds.** A client writes its traces before the server checks its update, so a client-round the
server rejected (its ``metrics.jsonl`` entry carries the ``error``) keeps its traces: they still show what the model
said. ``read_traces(..., records=RunDir(run).records())`` marks each trace ``accepted`` (or not) from those entries.

**Resume.** Each file is written whole (temp file, then rename) before the round's metrics line; a round redone
after a stop rewrites its files, so a resumed run neither duplicates nor loses records, and a file of a round that
was never recorded is replaced when that round is redone.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

#: where the simulated clients write their traces (set by ``fedspear.fl.simulation``; a SuperNode uses its
#: ``trace-dir`` node-config key)
TRACE_ENV = "FEDSPEAR_TRACE_DIR"
#: ``keep_traces = "auto"`` keeps traces while rounds × clients_per_round × rollouts_per_round is at most this
AUTO_TRACE_PROMPTS = 2000


def write_jsonl_gz(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write ``records`` as gzip-compressed JSON Lines, atomically (temp file, then rename); returns the path.

    The gzip header carries no time stamp, so the same records give the same bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as fh:
        for record in records:
            fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
    return path


def read_jsonl_gz(path: str | Path) -> list[dict[str, Any]]:
    """The records of a file written by ``write_jsonl_gz``.

    Raises:
        ValueError: the file is not gzip-compressed JSON Lines (names it).
    """
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a gzip-compressed JSON Lines file ({err})") from None


def eval_answers_path(run_dir: str | Path, server_round: int) -> Path:
    """``<run dir>/answers/round_NNNN.jsonl.gz``."""
    return Path(run_dir) / "answers" / f"round_{server_round:04d}.jsonl.gz"


def write_eval_answers(run_dir: str | Path, server_round: int, items: list[dict[str, Any]]) -> Path | None:
    """Keep the per-item answers of round ``server_round``'s evaluation (``fedspear.evaluation.evaluate``'s
    ``answers``); nothing when ``items`` is empty."""
    return write_jsonl_gz(eval_answers_path(run_dir, server_round), items) if items else None


def copy_eval_answers(source_run: str | Path | None, run_dir: str | Path, server_round: int) -> Path | None:
    """Copy round ``server_round``'s answers from ``source_run`` (a reused round-0 evaluation, ``round0_from``) when
    it kept them; None when there is nothing to copy."""
    if not source_run or not eval_answers_path(source_run, server_round).is_file():
        return None
    target = eval_answers_path(run_dir, server_round)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    shutil.copyfile(eval_answers_path(source_run, server_round), tmp)
    os.replace(tmp, target)
    return target


def keeps_traces(cfg) -> bool:
    """Whether a run keeps its clients' training traces (``keep_traces``; module docstring, Decision)."""
    mode = getattr(cfg, "keep_traces", "auto")
    if mode == "auto":
        return cfg.rounds * cfg.clients_per_round * cfg.rollouts_per_round <= AUTO_TRACE_PROMPTS
    return mode == "on"


def trace_dir(node_trace_dir: str | None = None) -> Path | None:
    """Where this client writes traces: its node's ``trace-dir``, else the simulation's ``FEDSPEAR_TRACE_DIR``, else
    nowhere (None)."""
    where = node_trace_dir or os.environ.get(TRACE_ENV)
    return Path(where) if where else None


def trace_path(folder: str | Path, server_round: int, partition_id: int) -> Path:
    """``<folder>/round_NNNN/client_PPPP.jsonl.gz``."""
    return Path(folder) / f"round_{server_round:04d}" / f"client_{partition_id:04d}.jsonl.gz"


def write_traces(folder: str | Path, server_round: int, partition_id: int, records: list[dict[str, Any]]) -> Path:
    """Keep one client-round's traces (``fedspear.interaction.interact``'s ``log``)."""
    return write_jsonl_gz(trace_path(folder, server_round, partition_id), records)


def read_traces(folder: str | Path, server_round: int | None = None,
                records: Iterable[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every kept trace under ``folder`` (one round's with ``server_round``), by round then client, each record with
    its ``round`` and ``partition_id`` added.

    Args:
        records: the run's round records (``RunDir.records()``, the server's ``metrics.jsonl``). With them each trace
            also gets ``accepted``: True when the server aggregated that client's update in that round; False when
            it did not (the record lists the client with an ``error``, such as an update over ``max_update_norm``,
            or the round aggregated nothing), so the trace shows what the client said but the federation did not
            learn from it; None when the round has no record (the round in flight when a run stopped: redone, and
            its files replaced, on resume).
    """
    accepted = None if records is None else _accepted_partitions(records)
    pattern = f"round_{server_round:04d}/client_*.jsonl.gz" if server_round is not None else "round_*/client_*.gz"
    out = []
    for path in sorted(Path(folder).glob(pattern)):
        r, p = int(path.parent.name[6:]), int(path.name[7:11])
        extra = {} if accepted is None else {"accepted": p in accepted[r] if r in accepted else None}
        out += [{**record, "round": r, "partition_id": p, **extra} for record in read_jsonl_gz(path)]
    return out


def _accepted_partitions(records: Iterable[dict[str, Any]]) -> dict[int, set[int]]:
    """Round → partition ids whose update the server aggregated (``fedspear.fl.server_app``'s ``clients`` entries
    without ``error``; none when the round's ``aggregated`` is false)."""
    return {r["round"]: {int(c["partition-id"]) for c in r.get("clients", [])
                         if "error" not in c and "partition-id" in c} if r.get("aggregated", True) else set()
            for r in records if "round" in r}
