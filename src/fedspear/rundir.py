"""The run directory: resolved config, per-round metrics, adapters, resume (no ``flwr`` import).

Layout::

    <output_dir>/
      config.toml              resolved run config (every key)
      metrics.jsonl            one JSON line per completed round (round 0 = evaluation before training)
      adapters/round_NNNN/     adapter_model.safetensors + adapter_config.json (loadable with peft); beside them
                               the server optimiser's moments (server_state.safetensors, FedAdam / FedYogi) and the
                               privacy accountant's state (privacy_accountant.json, dp = client / server)
      partitions.json          the simulated clients' split: rule, α, seed, size and label counts per partition
      answers/round_NNNN.jsonl.gz  each evaluated round's answers per item; traces/round_NNNN/client_PPPP.jsonl.gz
                               the simulated clients' training traces (``fedspear.answers``)
      report.md, plots/*.png   written at the end (and on every resume)

A round counts as completed when its metrics line is written; the adapter is written (atomically: temp folder,
then rename) *before* that line, so a crash at any point costs at most the round in flight. A line torn by a
crash (only ever the last) is dropped with a warning; an unreadable line anywhere else stops with the file, the line
and how to recover, and the file is left as it is. Re-running into the directory resumes after the last completed
round; a config that differs from the saved one is refused, naming the
keys, because resuming under other settings would silently mix two experiments.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import ConfigError, RunConfig, load_config, read_toml

if TYPE_CHECKING:
    from .server.server_opt import ServerOptState

log = logging.getLogger("fedspear")


def initial_samples(record: dict[str, Any]) -> int:
    """How many first answers a round's ``initial_correct`` counts: one per prompt for SPEAR, Feedback SFT and OPSD,
    a group per prompt for GRPO and RLTF-SD. Read from the ``initial_samples`` counter; records written before it
    existed (fedspear ≤ ef129e1) give it as ``generations − revisions_attempted`` (every sampled completion is
    counted once in ``generations``, and revision attempts are the only other samples)."""
    if record.get("initial_samples") is not None:
        return int(record["initial_samples"])
    if "generations" in record:
        return int(record["generations"]) - int(record.get("revisions_attempted", 0))
    return int(record.get("prompts", 0))


def initial_accuracy(record: dict[str, Any]) -> float | None:
    """Share of a round's first answers (its clients' initial samples) that were correct; None without samples.

    Records of fedspear ≤ ef129e1 stored ``initial_correct / prompts``, above 1 for GRPO and RLTF-SD (G samples
    per prompt); this recomputes it from the counters."""
    n = initial_samples(record)
    return record.get("initial_correct", 0) / n if n > 0 else None


def training_seconds(record: dict[str, Any]) -> float:
    """Wall-clock seconds of a round without its central evaluation (``seconds.round − seconds.evaluate``): the
    clients' work, aggregation and Flower's overhead — what a round of the algorithm costs (``metrics.jsonl``
    record; ``evaluate`` is 0 or absent in rounds that did not evaluate)."""
    return record["seconds"]["round"] - record["seconds"].get("evaluate", 0.0)


class RunDirError(ValueError):
    """A run directory is damaged beyond repair (the message says what is wrong and what to do)."""


# keys that may change between invocations without changing the experiment (compile_decode and compile_training: how
# decoding and training run, as device is where; a run whose compiled decode fails on a machine resumes there with
# compile_decode = "off";
# eval_batch_size: how many held-out answers decode together, which in bf16 may shift an answer by a token as another
# device may, and which each evaluation records; a run saved with 32, the default before "auto", resumes under it)
#: what a run writes in its directory besides config.toml (and Flower's ``.flwr`` home): a folder without config.toml
#: that holds one of these is refused as output_dir (``RunDir.check_or_write_config``), so nobody's file is replaced
RUN_FILES = frozenset({"metrics.jsonl", "adapters", "partitions.json", "report.md", "plots", "answers", "traces",
                       "progress", "tensorboard", "eval"})
#: what tells a run directory from any folder that holds a config.toml (a user's own project folder may): the records
#: a run writes from its first round on
RUN_RECORDS = ("metrics.jsonl", "adapters", "partitions.json")
#: the server optimiser's state (FedAdam / FedYogi moments) beside each round's adapter
SERVER_STATE = "server_state.safetensors"


def enclosing_run(path: str | Path) -> Path | None:
    """The run directory that ``path`` is or lies in: the nearest of it and the folders above it holding a
    ``config.toml`` and one of ``RUN_RECORDS``; None when there is none."""
    where = Path(path).resolve()
    for folder in (where, *where.parents):
        if (folder / "config.toml").is_file() and any((folder / name).exists() for name in RUN_RECORDS):
            return folder
    return None


RESUME_FREE_KEYS = {"output_dir", "round_timeout", "data_dir", "round0_from", "max_empty_rounds", "tensorboard",
                    "device", "keep_traces", "compile_decode", "compile_training", "eval_batch_size"}

# Keys added with a default that differs from what runs did before them: a saved config.toml without the key was
# made under the old behaviour, so resuming it under the new default must be refused, not silently mixed.
LEGACY_DEFAULTS = {"partitioner": "dirichlet"}


class EmptyRoundError(RuntimeError):
    """A round accepted no client reply (SPEC §4 decision of 2026-11-25): the run stops instead of recording a
    round that cannot update the adapter. The message names each sampled client's reason and how to resume."""


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN/inf → None, numpy scalars → Python numbers."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDir:
    """Reads and writes one run directory (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.config_path = self.path / "config.toml"

    # -- config ---------------------------------------------------------------------------------------------------
    def check_or_write_config(self, cfg: RunConfig) -> None:
        """Write ``config.toml`` for a new run; for an existing one, refuse a config that differs.

        A folder without ``config.toml`` (a run directory has one from its first start on) may hold other files
        (``fedspear compare`` puts ``cell.toml`` and ``log.txt`` in a cell's folder first), but none that ``verify``
        would delete (``*.tmp``; ``config.toml.tmp`` is a run's own: its first start was killed while writing it) and
        none of the names a run writes (``RUN_FILES``: it would read them as its own, or replace or delete them).

        Raises:
            ConfigError: the saved config differs in keys other than ``RESUME_FREE_KEYS`` (names them), or the folder
                is not a run directory and holds such files or a folder named config.toml (nothing in it is changed).
        """
        if self.config_path.exists() and not self.config_path.is_file():
            raise ConfigError(f"output_dir {self.path}: its config.toml is a folder, not a run's config; give a new "
                              "or empty folder (nothing in it was changed)")
        if self.path.is_dir() and not self.config_path.exists():
            theirs = sorted(p.name for p in self.path.iterdir()
                            if (p.suffix == ".tmp" and p.name != f"{self.config_path.name}.tmp")
                            or p.name in RUN_FILES)
            if theirs:
                raise ConfigError(f"output_dir {self.path} holds {', '.join(theirs[:3])} but no config.toml: not a "
                                  "fedspear run directory; give a new or empty folder (nothing in it was changed)")
        self.path.mkdir(parents=True, exist_ok=True)
        if self.config_path.is_file():
            saved = self.saved_config()
            differ = [k for k, v in cfg.to_dict().items()
                      if k not in RESUME_FREE_KEYS and saved.to_dict().get(k) != v]
            if differ:
                details = ", ".join(f"{k}: saved {saved.to_dict()[k]!r} vs now {cfg.to_dict()[k]!r}" for k in differ)
                unused = "" if self.records() or self.saved_rounds() else \
                    f"; it recorded no round, so deleting {self.path} loses nothing"
                raise ConfigError(
                    f"{self.path} holds a run with other settings ({details}); "
                    f"use another --output-dir or the saved settings to resume{unused}"
                )
            return
        _atomic_write(self.config_path, cfg.to_toml())

    def saved_config(self, **overrides: Any) -> RunConfig:
        """The run's ``config.toml`` (keys added since it was written take their old behaviour, ``LEGACY_DEFAULTS``),
        with ``overrides`` applied.

        Raises:
            ConfigError: the file is missing or not a valid config (names it).
        """
        if not self.config_path.is_file():
            raise ConfigError(f"{self.path}: no config.toml; not a fedspear run directory")
        raw = read_toml(self.config_path, "saved config")
        raw = raw.get("fedspear", raw)
        legacy = {k: v for k, v in LEGACY_DEFAULTS.items() if k not in raw}
        return load_config(self.config_path, **{**legacy, **overrides})

    def eval_batch_used(self) -> int | None:
        """The batch the run's last evaluation decoded its answers at: that record's ``eval.batch_size``, else the
        number config.toml names (a run of a fedspear before ``eval_batch_size = "auto"``, whose records do not
        say); None where neither does (no evaluation with answers yet under ``"auto"``)."""
        for record in reversed(self.records()):
            used = (record.get("eval") or {}).get("batch_size")  # a round without evaluation records "eval": null
            if used is not None:
                return int(used)
        saved = self.saved_config().eval_batch_size if self.config_path.is_file() else None
        return saved if isinstance(saved, int) else None

    def evaluation_config(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` for evaluating this run: under ``eval_batch_size = "auto"`` with the batch the run's evaluations
        used already (``eval_batch_used``), so a resumed run evaluates every round at one batch size and
        ``fedspear eval`` reproduces its answers, on whatever machine (a different batch may shift a bf16 answer by
        a token); otherwise ``cfg`` itself."""
        used = self.eval_batch_used() if cfg.eval_batch_size == "auto" else None
        return cfg if used is None else dataclasses.replace(cfg, eval_batch_size=used)

    def write_json(self, name: str, value: Any) -> None:
        """Write ``<run dir>/<name>`` as indented JSON (atomically: temp file, then rename)."""
        self.path.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.path / name, json.dumps(_clean(value), indent=1) + "\n")

    # -- metrics --------------------------------------------------------------------------------------------------
    def records(self, repair: bool = False) -> list[dict[str, Any]]:
        """Completed round records in order (blank lines are skipped).

        A torn last line (the process died while writing it) is left out. With ``repair`` (a resume: ``verify``) it
        is also dropped from the file, with a warning that names the file, the line and the round that will be
        redone, and a last line that is whole but lacks its newline gets one (the next record would otherwise be
        glued to it); without it the file is only read (``fedspear eval``, summaries: a read-only run stays
        readable, and a run being written is not raced).

        Raises:
            RunDirError: a line other than the last cannot be read. Nothing is rewritten then: the message names the
                file and line, the records after it, and how to recover.
        """
        if not self.metrics_path.is_file():
            return []
        text = self.metrics_path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
        records = []
        for i, (n, line) in enumerate(numbered):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not a record")
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                if i + 1 < len(numbered):
                    raise RunDirError(damaged_line_message(self.metrics_path, n, err, len(numbered) - i - 1)) from None
                if repair:
                    log.warning("%s, line %d: torn last line dropped (the run stopped while writing it; round %s will "
                                "be redone on resume)", self.metrics_path, n, records[-1].get("round", -1) + 1
                                if records else 0)
                    _atomic_write(self.metrics_path, "".join(l + "\n" for _, l in numbered[:i]))
                return records
            records.append(record)
        if repair and text and not text.endswith("\n"):  # whole, but the newline was not written
            _atomic_write(self.metrics_path, "".join(l + "\n" for _, l in numbered))
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Append one round record (a single write of one line, flushed and fsynced)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(_clean(record)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def verify(self, cfg: RunConfig | None = None) -> int | None:
        """Check that the directory can be resumed; repair what is safe to repair. Returns the last completed round.

        Repairs: a torn last metrics line (dropped with a warning: that round is redone), leftover ``*.tmp`` files
        and folders. Refuses (``RunDirError``, before anything is repaired but the ``*.tmp`` leftovers): an
        unreadable metrics line before the last (``records``), rounds in metrics.jsonl that are not 0, 1, 2, … in
        order, a missing or unreadable adapter for the last completed round, adapters saved for rounds after the
        one that follows it (metrics.jsonl lost records: resuming would redo those rounds over them, and under DP
        count fewer noised releases than left the server), and, when ``cfg`` runs FedAdam or FedYogi, a missing or
        unreadable server-optimiser state for the last round after round 0 (the moments would restart at zero).
        """
        for tmp in list(self.path.glob("*.tmp")) + list((self.path / "adapters").glob("*.tmp")):
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        records = self.records()
        rounds = [r.get("round") for r in records]
        if rounds != list(range(len(rounds))):
            raise RunDirError(f"{self.metrics_path}: rounds {rounds[:8]} are not 0, 1, 2, … in order; "
                              "the run directory was edited or mixed with another run; use a new --output-dir")
        last = rounds[-1] if rounds else None
        beyond = [r for r in self.saved_rounds() if r > (-1 if last is None else last) + 1]
        if beyond:
            recorded = f"the last round metrics.jsonl records is {last}" if last is not None else \
                "metrics.jsonl records no round"
            raise RunDirError(
                f"{self.path}: adapters are saved for round(s) {', '.join(map(str, beyond))}, but {recorded}: "
                f"metrics.jsonl lost records; nothing was changed. Restore its lines (from a backup) and re-run to "
                f"resume; a run without dp may instead redo those rounds: delete "
                f"{self.adapter_dir(beyond[0]).name} and the adapter folders after it, then re-run")
        records = self.records(repair=True)
        if not records:
            return None
        try:
            self.load_adapter(last)
        except (FileNotFoundError, OSError, ValueError) as err:
            raise RunDirError(f"{self.path}: cannot resume after round {last}: {err}") from None
        if cfg is not None and cfg.strategy in ("fedadam", "fedyogi") and last \
                and self.server_opt_state(last) is None:
            raise RunDirError(f"{self.adapter_dir(last) / SERVER_STATE}: missing; a {cfg.strategy} run cannot "
                              "resume without its server-optimiser state (its moments would restart at zero)")
        return last

    def last_round(self) -> int | None:
        """The last completed round (0 = initial evaluation done), or None for a new run."""
        records = self.records()
        return records[-1]["round"] if records else None

    # -- adapters -------------------------------------------------------------------------------------------------
    def adapter_dir(self, server_round: int) -> Path:
        return self.path / "adapters" / f"round_{server_round:04d}"

    def serves_round0(self, dtype_used: str | None = None, device: str | None = None) -> bool:
        """Whether this finished run can lend its round-0 evaluation (``round0_from``): it has its ``config.toml``
        and its start adapter is known to be the identity — on disk (``adapters/round_0000``) or, for a copied result
        without adapters such as a committed grid cell, recorded as ``start_identity`` in its round-0 record — and,
        when given, its round 0 ran in precision ``dtype_used`` on ``device`` (a record without ``device`` is a CPU
        run). The borrowing run re-checks all of it (``fedspear.fl.server_app.reused_round0``)."""
        if not self.config_path.is_file():
            return False
        records = self.records()
        if not records or records[0].get("round") != 0:
            return False
        first = records[0]
        if dtype_used is not None and first.get("dtype") != dtype_used:
            return False
        if device is not None and first.get("device", "cpu") != device:
            return False
        return self.adapter_dir(0).exists() or first.get("start_identity") is True

    def saved_rounds(self) -> list[int]:
        """Rounds whose adapter folder is complete (``adapters/round_NNNN/adapter_model.safetensors``), ascending;
        a ``round_NNNN.tmp`` left by a crash mid-write is not one."""
        folders = (self.path / "adapters").glob("round_*")
        return sorted(int(f.name[6:]) for f in folders
                      if f.name[6:].isdigit() and (f / "adapter_model.safetensors").is_file())

    def save_adapter(self, server_round: int, arrays: dict[str, np.ndarray], peft_config: dict | None,
                     server_state: dict[str, np.ndarray] | None = None,
                     json_state: dict[str, Any] | None = None) -> Path:
        """Write the global adapter of ``server_round`` in peft's format, atomically, with the server-optimiser
        state (FedAdam / FedYogi moments, ``server_state.safetensors``) and any JSON state (file name → value, e.g.
        the privacy accountant's) in the same folder when given."""
        from safetensors.numpy import save_file

        target = self.adapter_dir(server_round)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp / "adapter_model.safetensors"))
        if server_state:
            save_file({k: np.ascontiguousarray(v) for k, v in server_state.items()}, str(tmp / SERVER_STATE))
        for name, value in (json_state or {}).items():
            (tmp / name).write_text(json.dumps(value, indent=1), encoding="utf-8")
        if peft_config is not None:
            (tmp / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, default=_json_default))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target

    def load_server_state(self, server_round: int) -> dict[str, np.ndarray] | None:
        """The server-optimiser state saved with round ``server_round`` (``server_state.safetensors``), or None when
        there is none.

        Raises:
            RunDirError: the file is damaged (names it).
        """
        from safetensors.numpy import load_file

        path = self.adapter_dir(server_round) / SERVER_STATE
        if not path.is_file():
            return None
        try:
            return dict(load_file(str(path)))
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise RunDirError(f"{path}: server-optimiser state unreadable ({err}); cannot resume") from None

    def server_opt_state(self, server_round: int) -> ServerOptState | None:
        """The FedAdam / FedYogi moments saved with round ``server_round``, parsed
        (``fedspear.server.server_opt.arrays_to_state``), or None when the round saved none.

        Raises:
            RunDirError: the file is damaged or holds no server-optimiser state (names it).
        """
        from .server.server_opt import arrays_to_state

        state = self.load_server_state(server_round)
        if state is None:
            return None
        try:
            return arrays_to_state(state)
        except ValueError as err:
            raise RunDirError(f"{self.adapter_dir(server_round) / SERVER_STATE}: {err}; cannot resume") from None

    def load_json_state(self, server_round: int, name: str) -> Any:
        """The JSON state ``name`` saved with round ``server_round``'s adapter, or None when there is none.

        Raises:
            RunDirError: the file exists but is not valid JSON.
        """
        path = self.adapter_dir(server_round) / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise RunDirError(f"{path}: unreadable ({err}); cannot resume") from None

    def load_adapter(self, server_round: int) -> dict[str, np.ndarray]:
        """The saved global adapter of ``server_round``.

        Raises:
            RunDirError: no adapter was saved for that round, or the file is damaged (names the path).
        """
        return load_adapter_folder(self.adapter_dir(server_round), f"adapter of round {server_round}",
                                   "; cannot resume")


def load_adapter_folder(folder: str | Path, what: str = "adapter", consequence: str = "") -> dict[str, np.ndarray]:
    """The tensors of a peft adapter folder (``adapter_model.safetensors``), name → array.

    Raises:
        RunDirError: the file is missing or damaged (names the path).
    """
    from safetensors.numpy import load_file

    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise RunDirError(f"{path}: {what} missing{consequence}")
    try:
        return dict(load_file(str(path)))
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise RunDirError(f"{path}: {what} unreadable ({err}){consequence}") from None


def damaged_line_message(path: Path, line: int, err: Exception, after: int) -> str:
    """What ``RunDir.records`` says about an unreadable line ``line`` of ``path`` with ``after`` records after it."""
    return (f"{path}, line {line}: not a readable round record ({err}), and {after} record(s) follow it; nothing was "
            f"changed. Restore that line (from a backup or by hand) and re-run to resume; or, to redo the rounds from "
            f"there instead (not under dp: the noised releases of the rounds dropped would go uncounted), keep only "
            f"the lines before it (head -n {line - 1} {path} > {path}.new && mv {path}.new {path}), delete the "
            f"adapter folders of the rounds dropped and re-run")


def _json_default(value: Any) -> Any:
    """peft configs hold sets (``target_modules``): write them as sorted lists, as peft's own save does."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
