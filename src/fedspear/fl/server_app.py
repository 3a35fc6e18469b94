"""Flower ServerApp: rounds of SPEAR with win-weighted FedAvg, central evaluation, checkpoints and resume.

``run_server`` drives the rounds itself with the strategy's ``configure_train`` / ``aggregate_train`` (rather than
``Strategy.start``) so that it can resume after the last completed round, time each phase, and write one metrics
line per round. The per-round learning rate (warm-up + cosine, ``fedspear.server.schedule.lr_at_round``) and the
adapter's layout travel in the train config. Under differential privacy (``dp`` = client / server) the rounds go through
Flower's fixed-clipping wrapper and the privacy ledger (``fedspear.fl.privacy.PrivateRounds``); each record then
carries ``dp_epsilon`` and the DP settings, and the accountant's state is saved with each round's adapter.
Each round also records the bytes every client's train message and reply take on the wire (``add_wire_bytes``).
Under secure aggregation (``secure_aggregation = "secaggplus"``) each round's messages are Flower's SecAgg+ stages,
sent by its workflow (``fedspear.fl.secagg.SecureRounds``); the record then carries ``secagg`` and no wire bytes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedspear import counters, progress
from fedspear.answers import copy_eval_answers, write_eval_answers
from fedspear.health import round_health, warnings_for
from fedspear.arrays import layout_mismatch
from fedspear.runtime.compiled import compiles_decode
from fedspear.runtime.memory import peak_rss_mb, release_memory, tree_peak
from fedspear.runtime.model import model_device
from fedspear.tasks import load_train_examples
from fedspear.config import ConfigError, RunConfig, load_config, snake_key
from fedspear.evaluation import Evaluator
from fedspear.fl.partition import dirichlet_partitions, partition_summary
from fedspear.fl.privacy import STATE_FILE, PrivateRounds, reply_norm_bound
from fedspear.fl.records import ENCODING_KEY, LAYOUT_KEY, from_record, layout_of, to_record, wire_bytes
from fedspear.fl.secagg import SecureRounds
from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.report import accuracy_text, round_text, unchanged_adapter_warning, write_report
from fedspear.rundir import EmptyRoundError, RunDir, RunDirError, initial_accuracy
from fedspear.server.server_opt import state_to_arrays
from fedspear.tensorboard import ScalarWriter
from fedspear.server.schedule import lr_at_round

log = logging.getLogger("fedspear")



# settings that decide the round-0 evaluation (the base model's answers on the fixed held-out subset)
# (and the batch the answers decode at: ``reused_round0`` compares the one each run used, not the setting)
ROUND0_KEYS = ("model", "dtype", "task", "data_dir", "data_source", "skip_bad_records", "eval_size",
               "eval_gen_size", "eval_generation", "max_new_tokens", "lora_r", "lora_alpha", "last_layers")


def _is_identity(arrays: dict[str, np.ndarray]) -> bool:
    """Whether a LoRA adapter leaves the base model unchanged (every ``lora_B`` is zero, peft's initialisation)."""
    b = [v for k, v in arrays.items() if "lora_B" in k]
    return bool(b) and all(not np.any(v) for v in b)


def reused_round0(cfg: RunConfig, arrays: dict[str, np.ndarray], dtype_used: str, device: str,
                  batch_rows: int | None = None) -> dict | None:
    """The round-0 evaluation of ``cfg.round0_from`` when it is provably the same measurement, else None.

    Same when the other run's resolved settings (its ``config.toml``) agree on ``ROUND0_KEYS`` and on whether the
    decode is compiled on this device (``compile_decode``, as ``runtime.compiled.compiles_decode`` resolves it), its
    answers decoded at ``batch_rows``, the batch this run's would (``Evaluator.batch_rows``; the other's record says,
    or for a record without it the number its config names; not compared where answers are not generated), its
    round 0 ran in
    the same precision on the same kind of device (the record's ``dtype`` and ``device`` against this run's resolved
    ``dtype_used`` and ``device``: ``dtype = "auto"`` resolves differently on other machines; a record without
    ``device`` predates the field and is taken as a CPU run, as every run of this project then was), and both start
    adapters are the identity: then both evaluate the same base model greedily on the same items. The other run's
    start is known from its round-0 adapter on disk or, for a copied result without adapters (committed grid cells),
    from its round-0 record's ``start_identity``, which the run wrote after checking that adapter. The reused record
    names its source.
    """
    if not cfg.round0_from or not _is_identity(arrays):
        return None
    other = RunDir(cfg.round0_from)
    try:
        if not other.serves_round0(dtype_used, device):  # config.toml, precision, device, a known identity start
            return None
        other_cfg = load_config(other.config_path).resolved()
        if other.adapter_dir(0).exists() and not _is_identity(other.load_adapter(0)):  # the adapter on disk decides
            return None
    except Exception:  # noqa: BLE001 - an unreadable source just means: evaluate here
        return None
    if any(getattr(other_cfg, k) != getattr(cfg, k) for k in ROUND0_KEYS):
        return None
    lent = other.records()[0]["eval"]
    if cfg.eval_generation and lent.get("batch_size", other_cfg.eval_batch_size) != batch_rows:
        return None  # answers decoded at another batch may differ by a token in bf16
    if compiles_decode(other_cfg.compile_decode, torch.device(device)) != compiles_decode(cfg.compile_decode,
                                                                                         torch.device(device)):
        return None  # a compiled and an eager greedy decode agree up to bf16 rounding only
    log.info("round-0 evaluation reused from %s (same base model, items and settings)", cfg.round0_from)
    return {**lent, "reused_from": str(cfg.round0_from)}


# loss terms the algorithms log (SPEAR: win / lose; GRPO: surrogate, KL; RLTF-SD: SD, RL0, RL1; all: loss)
LOSS_TERMS = ("loss", "loss_win", "loss_lose", "loss_pg", "kl", "clip_fraction", "loss_sd", "loss_rl0", "loss_rl1")


def _mean_of(clients: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the clients that report it (None when none does)."""
    values = [c[key] for c in clients if key in c]
    return float(np.mean(values)) if values else None


def _round_record(server_round: int, lr: float, replies, aggregated: bool, rejected: dict[int, str],
                  update_norms: dict[int, float] | None = None) -> dict:
    """Totals, means and per-client values of one round's accepted replies (the counters of SPEC §6).

    Excluded clients (error replies, failed checks) appear in ``clients`` with ``node_id`` and ``error``; accepted
    ones carry ``update_norm`` (‖θ_k − θ^(t)‖₂ as aggregated, from ``update_norms``) when it is known.
    """
    clients = []
    for msg in replies:
        node = msg.metadata.src_node_id
        if node in rejected:
            entry = {"node_id": node, "error": rejected[node]}
            if not msg.has_error() and msg.content.metric_records:
                entry["partition-id"] = next(iter(msg.content.metric_records.values())).get("partition-id")
            clients.append(entry)
            continue
        metrics = dict(next(iter(msg.content.metric_records.values())))
        metrics["node_id"] = node
        if update_norms and node in update_norms:
            metrics["update_norm"] = update_norms[node]
        clients.append(metrics)
    ok = [c for c in clients if "error" not in c]
    total = {k: sum(c.get(k, 0) for c in ok) for k in counters.SUMMED}
    trained = [c for c in ok if c.get("steps", 0) > 0]
    margins = [c["margin"] for c in ok if c.get("margin_pairs", 0) > 0 and c["margin"] == c["margin"]]
    record = {
        "round": server_round,
        "lr": lr,
        "clients_ok": len(ok),
        "clients_failed": len(clients) - len(ok),
        "aggregated": aggregated,
        **{snake_key(k): v for k, v in total.items()},
        "wins": total["num-wins"],
        "losses": total["num-losses"],
        "initial_accuracy": initial_accuracy(total),  # over first answers, not prompts: GRPO samples groups
        **{key: _mean_of(trained, key) for key in LOSS_TERMS},
        "margin": float(np.mean(margins)) if margins else None,
        "health": round_health(ok),  # answer lengths, reasoning, win-set composition (fedspear.health)
        "seconds": {
            "generate_initial": sum(c.get("seconds_generate_initial", 0.0) for c in ok),
            "generate_revisions": sum(c.get("seconds_generate_revisions", 0.0) for c in ok),
            "train": sum(c.get("seconds_train", 0.0) for c in ok),
        },
        "peak_rss_mb": {"client": max((c.get("peak_rss_mb", 0.0) for c in ok), default=0.0)},
        # what a client still holds once its round is over (after release_memory), the largest of the round's
        "rss_after_round_mb": {"client": max((c.get("rss_after_round_mb", 0.0) for c in ok), default=0.0)},
        "clients": clients,
    }
    del record["num_wins"], record["num_losses"]
    return record


def tree_record() -> dict:
    """``{"peak_tree_mb": {"rss": …, "pss": …}}``: the peak since the last record of the sums over the process tree
    this ServerApp runs in (a simulation: the server, Ray and its client actor; ``fedspear.runtime.memory.TreePeak``),
    MiB; empty where no sampler runs (a deployed ServerApp)."""
    peak = tree_peak(reset=True)
    return {"peak_tree_mb": peak} if peak else {}


def add_wire_bytes(record: dict, to_client: dict[int, int], from_client: dict[int, int]) -> None:
    """Put a round's wire bytes into its record (``fedspear.fl.records.wire_bytes``): per client entry
    ``bytes_to_client`` (its train message) and ``bytes_from_client`` (its reply, absent when none came), and the
    round's sums ``bytes_to_clients`` / ``bytes_from_clients``; keyed by node id."""
    for client in record["clients"]:
        client["bytes_to_client"] = to_client.get(client["node_id"], 0)
        if client["node_id"] in from_client:
            client["bytes_from_client"] = from_client[client["node_id"]]
    record["bytes_to_clients"] = sum(to_client.values())
    record["bytes_from_clients"] = sum(from_client.values())


def discover_partitions(grid: Grid, expected: int, timeout: float = 120.0) -> dict[int, int]:
    """Ask every connected node for its partition id (one query message each) → {node id: partition id}.

    Nodes that do not answer within ``timeout`` seconds are simply left out (they sort last when sampling), and so
    are replies without one metric record holding an integer ``partition-id`` (logged: not a fedspear ClientApp).

    Raises:
        ConfigError: two nodes answer with the same partition id (both would train it, and another none).
    """
    deadline = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
    messages = [Message(content=RecordDict({"config": ConfigRecord({})}), message_type=MessageType.QUERY,
                        dst_node_id=node) for node in grid.get_node_ids()]
    mapping = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        if reply.has_error():
            continue
        records = list(reply.content.metric_records.values())
        pid = records[0].get("partition-id") if len(records) == 1 else None
        if not isinstance(pid, int) or isinstance(pid, bool):
            log.warning("node %s answered the partition query without an integer partition-id; left out",
                        reply.metadata.src_node_id)
            continue
        if pid >= 0:
            mapping[reply.metadata.src_node_id] = pid
    claimed: dict[int, list[int]] = {}
    for node, pid in sorted(mapping.items()):
        claimed.setdefault(pid, []).append(node)
    twice = {pid: nodes for pid, nodes in sorted(claimed.items()) if len(nodes) > 1}
    if twice:
        raise ConfigError("; ".join(f"partition-id {pid} is set on nodes {', '.join(map(str, nodes))}"
                                    for pid, nodes in twice.items())
                          + ": give each SuperNode its own (--node-config 'partition-id=K', K in 0.."
                          f"{expected - 1})")
    return mapping


def record_partitions(run: RunDir, cfg: RunConfig) -> dict:
    """Compute the simulated clients' split (the one every client computes) and write ``partitions.json``.

    The file holds the rule, α, seed, the number of train items and, per partition id, its size and label counts
    (``fedspear.fl.partition.partition_summary``). Nodes with their own data (``data-dir`` in the node config) do
    not use this split.

    Raises:
        PartitionError: the split is impossible under ``cfg.partitioner`` (the message names the fix).
    """
    examples = load_train_examples(cfg)
    parts = dirichlet_partitions(examples, cfg.num_clients, cfg.dirichlet_alpha, cfg.seed, cfg.partitioner)
    summary = {"partitioner": cfg.partitioner, "dirichlet_alpha": cfg.dirichlet_alpha, "seed": cfg.seed,
               "num_clients": cfg.num_clients, "train_items": len(examples), **partition_summary(examples, parts)}
    run.write_json("partitions.json", summary)
    return summary


def empty_round_error(server_round: int, reasons: list[str], dropped: bool, streak: int,
                      cfg: RunConfig) -> EmptyRoundError | None:
    """The error that stops the run after a round with no accepted reply, or None when the round is tolerated.

    **Decision (2026-11-25, issue 16).** A round in which no reply is accepted cannot update the adapter; recording
    it as a completed round gave runs with flat curves whose only trace was ``clients_failed``. The run stops when
    every failure of the empty round was an error raised by the clients (exceptions, replies that fail the checks:
    the same code on the same data fails again), or when ``streak`` — consecutive empty rounds, this one included —
    exceeds ``max_empty_rounds`` (default 0: the first empty round stops the run). Only rounds where some sampled
    node dropped out (no reply in time, node unavailable, ClientApp process crashed) can be tolerated; a tolerated
    round keeps the adapter and is recorded with ``empty: true``.
    """
    if dropped and streak <= cfg.max_empty_rounds:
        return None
    why = ("every sampled client failed with an error raised by its own code" if not dropped else
           f"{streak} consecutive empty round(s), more than max_empty_rounds = {cfg.max_empty_rounds}")
    return EmptyRoundError(
        f"round {server_round}: no client reply was accepted ({why}), so no update could be aggregated. "
        f"Clients: {'; '.join(reasons)}. The run directory keeps rounds 0–{server_round - 1}; fix the cause "
        f"and re-run the same command to resume (max_empty_rounds tolerates rounds in which nodes dropped out)."
    )


def in_model_order(arrays: dict[str, np.ndarray], model_arrays: dict[str, np.ndarray], where) -> dict[str, np.ndarray]:
    """``arrays`` (a saved adapter; safetensors returns its own tensor order) in the model's tensor order.

    The order fixes the flat buffer that travels (``to_record``) and so which value each draw of Flower's DP noise
    lands on: a resumed run must pack as an uninterrupted one does for seeded noise to repeat (``dp_noise_seed``).

    Raises:
        RunDirError: the saved adapter's tensor names differ from the model's (names ``where``).
    """
    problem = layout_mismatch(model_arrays, arrays)
    if problem:
        raise RunDirError(f"{where}: the saved adapter's tensors differ from the model's ({problem}); cannot resume")
    return {name: arrays[name] for name in model_arrays}


def _load_ledger_state(private: PrivateRounds, state: dict, where) -> None:
    """``private.ledger.load_state_dict(state)``; a state of other settings raises RunDirError naming ``where``."""
    try:
        private.ledger.load_state_dict(state)
    except (ValueError, KeyError, TypeError) as err:
        raise RunDirError(f"{where}: {err}; cannot resume") from None


def _resume_ledger(private: PrivateRounds, run: RunDir, last: int, last_record: dict) -> None:
    """Continue the privacy ledger saved with round ``last``'s adapter (the ε of a resumed run continues).

    Raises:
        RunDirError: the state is missing, belongs to other DP settings, or disagrees with the last record's
            ``dp_releases`` (the run directory was edited or mixed).
    """
    state = run.load_json_state(last, STATE_FILE)
    where = run.adapter_dir(last) / STATE_FILE
    if state is None:
        raise RunDirError(f"{where}: missing; a DP run cannot resume without its privacy accountant state")
    _load_ledger_state(private, state, where)
    if last_record.get("dp_releases", 0) != private.ledger.releases:
        raise RunDirError(f"{where}: {private.ledger.releases} noised releases, but metrics.jsonl's round {last} "
                          f"says {last_record.get('dp_releases', 0)}; cannot resume")
    log.info("privacy ledger resumed: %d releases, ε = %.4g at δ = %g", private.ledger.releases,
             private.ledger.epsilon, private.ledger.delta)


def _count_unrecorded_release(private: PrivateRounds, run: RunDir, last: int) -> None:
    """Keep counting a noised adapter that was saved but never recorded (a kill between ``save_adapter`` and
    ``append``): it has left the process, so its release stays in the ledger, and the redone round adds another.

    Its saved ledger state (taken after that release) replaces the resumed one when it holds more releases: one more
    after one such kill (ε in later records is then that of ``last + 2`` releases), more after a redone round was
    killed in the same place again, each of whose releases left the process. One that holds as many (a round with no
    accepted reply releases nothing) changes nothing; one that holds fewer is refused.

    Raises:
        RunDirError: the orphan adapter has no ledger state, or one with fewer releases than the resumed ledger.
    """
    if not (run.adapter_dir(last + 1) / "adapter_model.safetensors").exists():
        return
    state = run.load_json_state(last + 1, STATE_FILE)
    where = run.adapter_dir(last + 1) / STATE_FILE
    releases = state.get("releases") if isinstance(state, dict) else None
    if not isinstance(releases, int) or releases < private.ledger.releases:
        raise RunDirError(f"{where}: round {last + 1}'s noised adapter was saved without a matching privacy "
                          f"accountant state; cannot account for it")
    if releases == private.ledger.releases:
        return  # nothing released since the recorded round
    _load_ledger_state(private, state, where)
    log.warning("round %d's noised adapter was saved but not recorded (the run stopped in between): its release "
                "stays counted; the redone round is a further one (ε = %.4g so far)", last + 1,
                private.ledger.epsilon)


def run_server(grid: Grid, cfg: RunConfig, on_round: Callable[[dict], None] | None = None) -> list[dict]:
    """Run (or resume) a SPEAR federation to ``cfg.rounds`` rounds; returns every round record.

    Writes the run directory described in ``fedspear.rundir``.

    Raises:
        ConfigError: the run directory holds a run with other settings.
        RunDirError: the run directory cannot be resumed as it is (``RunDir.verify``; a damaged privacy accountant
            state); its records and adapters are left as they are.
        PartitionError: the train split cannot be divided over ``num_clients`` (``fedspear.fl.partition``).
        EmptyRoundError: a round accepted no client reply and may not be tolerated (``empty_round_error``); the
            rounds before it stay saved and re-running resumes.
    """
    cfg = cfg.resolved()
    run = RunDir(cfg.output_dir)
    run.check_or_write_config(cfg)
    run.verify(cfg)  # again here: `flwr run` reaches this without fedspear run's preflight
    record_partitions(run, cfg)
    strategy = WinWeightedFedAvg(
        cfg.clients_per_round, cfg.num_clients, seed=cfg.seed, max_update_norm=reply_norm_bound(cfg),
        rule=cfg.aggregation, trim_beta=cfg.trim_beta,
        server_opt=cfg.strategy if cfg.strategy in ("fedadam", "fedyogi") else None, server_lr=cfg.server_lr,
        beta1=cfg.server_beta1, beta2=cfg.server_beta2, tau=cfg.server_tau,
        dp_denominator=cfg.clients_per_round if cfg.dp != "off" else None,
        dp_clip_norm=cfg.dp_clip_norm if cfg.dp != "off" else None,
    )
    # before the model loads: a missing privacy accountant (flwr[dp]) stops the run here, not after round 0
    private = PrivateRounds(strategy, cfg) if cfg.dp != "off" else None
    secure = SecureRounds(strategy, cfg, grid) if cfg.secure_aggregation != "off" else None  # fedspear.fl.secagg
    records = run.records()
    board = ScalarWriter(run.path, first_round=len(records)) if cfg.tensorboard else None  # before the model, too

    def emit(record: dict) -> None:
        if board is not None:
            board.write(record)
        if on_round:
            on_round(record)

    try:
        evaluator = Evaluator(run.evaluation_config(cfg))  # a resumed "auto" run keeps its evaluations' batch
        if records:
            last = records[-1]["round"]
            arrays = in_model_order(run.load_adapter(last), evaluator.initial_adapter(), run.adapter_dir(last))
            wall = records[-1].get("wall_clock", 0.0)
            log.info("resuming %s after round %d", cfg.output_dir, last)
        else:
            last, arrays = 0, evaluator.initial_adapter()
            t0 = time.perf_counter()
            progress.start("server", 0)
            device = model_device(evaluator.model).type
            answers: list[dict] = []
            rows = evaluator.batch_rows() if cfg.round0_from else None  # (renders every held-out prompt)
            metrics = reused_round0(cfg, arrays, evaluator.dtype_used, device, rows) or evaluator(arrays, answers)
            progress.finish()
            wall = time.perf_counter() - t0
            run.save_adapter(0, arrays, evaluator.peft_config())
            write_eval_answers(run.path, 0, answers) or copy_eval_answers(metrics.get("reused_from"), run.path, 0)
            record = {"round": 0, "eval": metrics, "seconds": {"evaluate": metrics["seconds_evaluate"]},
                      "start_identity": _is_identity(arrays), "wall_clock": wall, "dtype": evaluator.dtype_used,
                      "device": device,
                      "skipped_eval_records": len(evaluator.skipped),
                      "peak_rss_mb": {"server": peak_rss_mb()}, "rss_after_round_mb": {"server": release_memory()},
                      **tree_record(),
                      "health_warnings": warnings_for(metrics, 0, metrics)}
            run.append(record)
            records.append(record)
            emit(record)

        saved_state = run.server_opt_state(last) if last else None  # present for FedAdam / FedYogi (verify)
        if saved_state is not None:
            strategy.opt_state = saved_state
        if private is not None:
            if last:
                _resume_ledger(private, run, last, records[-1])
            _count_unrecorded_release(private, run, last)
        strategy.partition_of = discover_partitions(grid, cfg.num_clients)
        payload = json.dumps(cfg.to_dict())
        streak = 0  # consecutive empty rounds before this one (tolerated ones are recorded with empty: true)
        for r in reversed(records):
            if r["round"] == 0 or not r.get("empty"):
                break
            streak += 1
        for server_round in range(last + 1, cfg.rounds + 1):
            t_round = time.perf_counter()
            progress.start("server", server_round)
            lr = lr_at_round(server_round, cfg.rounds, cfg.lr, cfg.lr_min, cfg.warmup_ratio)
            layout = layout_of(arrays)
            config = ConfigRecord({"lr": lr, "fedspear-config": payload, **({LAYOUT_KEY: layout} if layout else {})})
            if cfg.update_encoding != "fp32":  # fp32 sends the adapter as ever: the config stays as it was
                config[ENCODING_KEY] = cfg.update_encoding
            driver = private or strategy  # under DP, Flower's wrapper around the strategy
            messages = [] if secure else list(driver.configure_train(server_round, to_record(arrays), config, grid))
            to_client = {m.metadata.dst_node_id: wire_bytes(m) for m in messages}
            t_send = time.perf_counter()
            with progress.phase("waiting for clients"):
                if secure is not None:  # SecAgg+: Flower's workflow sends and receives each of its stages itself
                    replies, secure_arrays, rejected, dropped = secure.round(server_round, arrays, config)
                else:
                    replies = list(grid.send_and_receive(messages, timeout=cfg.round_timeout))
            t_recv = time.perf_counter()
            # before decoding (aggregation); SecAgg+'s replies are its own stages' summaries, not counted
            from_client = {} if secure else {r.metadata.src_node_id: wire_bytes(r) for r in replies}
            silent = {m.metadata.dst_node_id for m in messages} - {r.metadata.src_node_id for r in replies}
            for node in sorted(silent):
                log.warning("round %d: node %d sent no reply within %g s (timed out or disconnected); dropped",
                            server_round, node, cfg.round_timeout)
            with progress.phase("aggregation"):
                if secure is not None:
                    new_arrays = secure_arrays
                elif private is not None:
                    new_arrays, rejected, dropped = private.aggregate_train(server_round, replies)
                else:
                    new_record, _ = strategy.aggregate_train(server_round, replies)
                    new_arrays = from_record(new_record, layout) if new_record is not None else None
                    rejected, dropped = strategy.rejected, strategy.dropped
            aggregated = strategy.last_aggregated
            if new_arrays is not None:
                arrays = new_arrays
            t_agg = time.perf_counter()
            record = _round_record(server_round, lr, replies, aggregated, rejected, strategy.update_norms)
            if private is not None:
                record.update(private.ledger.record())
            if secure is not None:
                record.update(secure.record())
            record["clients"] += [{"node_id": n, "error": f"no reply within {cfg.round_timeout:g} s"}
                                  for n in sorted(silent)]
            record["clients_failed"] += len(silent)
            if secure is None:
                add_wire_bytes(record, to_client, from_client)
            if record["clients_ok"] == 0:
                streak += 1
                reasons = [f"partition {strategy.partition_of.get(c['node_id'], '?')} (node {c['node_id']}): "
                           f"{c['error']}" for c in record["clients"]]
                error = empty_round_error(server_round, reasons, bool(silent or dropped), streak, cfg)
                if error is None and server_round == cfg.rounds and streak == server_round:
                    error = EmptyRoundError(f"round {server_round}: no round of this run accepted a client reply; "
                                            f"a run that never updated its adapter is not a result. Clients: "
                                            f"{'; '.join(reasons)}")
                if error is not None:
                    log.error("%s", error)
                    raise error
                log.warning("round %d: no reply accepted; tolerated (%d of max_empty_rounds = %d in a row)",
                            server_round, streak, cfg.max_empty_rounds)
                record["empty"] = True
            else:
                streak = 0
            client_seconds = sum(c.get("seconds_generate_initial", 0) + c.get("seconds_generate_revisions", 0)
                                 + c.get("seconds_train", 0) for c in record["clients"] if "error" not in c)
            record["seconds"]["aggregate"] = t_agg - t_recv
            record["seconds"]["clients_total"] = client_seconds
            record["seconds"]["flower_overhead"] = max(0.0, (t_recv - t_send) - client_seconds)
            if server_round % cfg.eval_every == 0 or server_round == cfg.rounds:
                answers = []
                record["eval"] = evaluator(arrays, answers)
                record["seconds"]["evaluate"] = record["eval"]["seconds_evaluate"]
                write_eval_answers(run.path, server_round, answers)  # before the record: a redone round rewrites it
                record["health_warnings"] = warnings_for(record["eval"], server_round, records[0].get("eval"))
            else:
                record["eval"] = None
                record["seconds"]["evaluate"] = 0.0
            record["seconds"]["round"] = time.perf_counter() - t_round
            wall += record["seconds"]["round"]
            record["wall_clock"] = wall
            record["peak_rss_mb"]["server"] = peak_rss_mb()
            record["rss_after_round_mb"]["server"] = release_memory()
            record.update(tree_record())
            state = state_to_arrays(strategy.opt_state) if strategy.server_opt else None
            json_state = {STATE_FILE: private.ledger.state_dict()} if private is not None else None
            run.save_adapter(server_round, arrays, evaluator.peft_config(), server_state=state, json_state=json_state)
            run.append(record)
            records.append(record)
            progress.finish()
            emit(record)
        write_report(run.path, records, cfg, dtype=evaluator.dtype_used)
        return records
    finally:  # an empty round, a failed evaluation or Ctrl-C: the event file is closed, the progress row cleared
        progress.finish()
        if board is not None:
            board.close()


# ---- `flwr run .` entry point -----------------------------------------------------------------------------------
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run .``: settings come from ``[tool.flwr.app.config]`` (``config-file`` plus flat overrides)."""
    run_config = dict(context.run_config)
    config_file = str(run_config.pop("config-file", "") or "") or None
    overrides = {snake_key(k): v for k, v in run_config.items()}
    overrides["output_dir"] = overrides.pop("run_dir", None)
    cfg = load_config(config_file, **overrides)
    # Flower streams this process's stdout to `flwr run --stream` / `flwr log`: one line per round, as `fedspear run`
    records = run_server(grid, cfg, on_round=lambda record: print(round_text(record), flush=True))
    last = next((r for r in reversed(records) if r.get("eval")), None)
    if last is not None and last["round"] > 0:
        print(f"final accuracy (round {last['round']}): {accuracy_text(last['eval'])}", flush=True)
    unchanged = unchanged_adapter_warning(records)
    if unchanged:
        print(f"warning: {unchanged}", flush=True)
    # absolute: a relative run-dir lies under the SuperLink's working folder, which the `flwr` user may not know
    print(f"report: {Path(cfg.output_dir).absolute() / 'report.md'}", flush=True)
