"""What a round costs on the wire (issue 43 item 4): bytes per client-round of SmolLM2-135M under fp32 / fp16 / int8,
the aggregation error of fp16 / int8 against fp32 on real client adapters, and the bytes of a Qwen2.5-Coder-1.5B
round computed from its LoRA shapes at the cpu-qwen1.5b preset (not run).

    fedspear run --rounds 1 --rollouts-per-round 4 --eval-size 4 --set max_revisions=1 -o runs/wire-fp32
    .venv/bin/python scripts/wire_costs.py replay runs/wire-fp32 --out runs/wire-replay
    .venv/bin/python scripts/wire_costs.py report runs/wire-fp32 runs/wire-replay --out docs/results/wire

``fedspear run`` (default settings — SmolLM2-135M, ARC-Challenge, SPEAR, 2 of 10 clients per round, LoRA r 16 on
all layers, ``update_encoding = fp32`` — except 4 rollouts per client-round, 1 revision and 4 evaluated items, so
that it fits a shared 2-core machine; those change only a few digits of the settings each train message carries,
not the adapter, its layout or the reply's keys) records every client's bytes per round in ``metrics.jsonl``
(``bytes_to_client`` / ``bytes_from_client``, counted by the ServerApp with ``fedspear.fl.records.wire_bytes``).

``replay`` redoes that run's round 1 in this process with the same code: θ^(0) (checked against the run's saved
round-0 adapter), the clients the run sampled (the strategy's seeded sample), the train messages the strategy builds,
and the real ClientApp train handler (SmolLM2, seeded client rounds). Each fp32 reply is then encoded by the
ClientApp's own ``encode_update_mod`` as fp16 and as int8 (what a run with that ``update_encoding`` sends: the
client's training does not depend on the encoding), every message is counted with ``wire_bytes``, and the
strategy decodes and aggregates each encoding's replies. It saves the three averages and the byte counts (a run per
encoding would give the same figures at three times the client work).

``report`` checks that the replay's fp32 average equals the run's round-1 adapter (the replay reproduced the run's
clients), then computes the aggregation error of each encoding = ‖θ^(1)_enc − θ^(1)_fp32‖₂ relative to the round's
update ‖θ^(1)_fp32 − θ^(0)‖₂ (and to ‖θ^(1)_fp32‖₂), beside the bound the encoding guarantees:
``ENCODING_ERROR``·Σ_k w_k‖Δ_k‖ / Σ_k w_k. For Qwen2.5-Coder-1.5B it uses its LoRA shapes (hidden 1536, MLP 8960, 28
layers, 12 query and 2 key/value heads of 128: the model's config.json) at the cpu-qwen1.5b preset's r = 16 on the
seven projections of every layer, builds a train message and a reply as fedspear builds them (the preset's config,
the adapter's layout, the SmolLM2 run's client metrics as the reply's counters) with random values (no repeated
chunks, as after round 1) and counts them with ``wire_bytes``; the same construction for SmolLM2 with the default
settings is set beside the measured figures. Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from flwr.app import (ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord,  # noqa: E402
                      RecordDict)
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedspear.config import RunConfig, load_config  # noqa: E402
from fedspear.experiments.compare.grid import PRESETS  # noqa: E402
from fedspear.fl.records import (ENCODING_ERROR, ENCODING_KEY, LAYOUT_KEY, encode_update, encode_update_mod,  # noqa
                                 from_record, layout_of, to_record, wire_breakdown, wire_bytes)
from fedspear.rundir import RunDir  # noqa: E402
from fedspear.server.schedule import lr_at_round  # noqa: E402

ENCODINGS = ("fp32", "fp16", "int8")
QWEN = dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, head_dim=128)


class _Grid:
    """What the strategy's sample asks of a Grid: node ids (here node id = partition id)."""

    def __init__(self, n: int):
        self.nodes = list(range(n))

    def get_node_ids(self):
        return list(self.nodes)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _norm(arrays: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in arrays.values()))


def replay(run: Path, out: Path) -> None:
    """Round 1 of ``run`` again, in this process, with each encoding (module docstring); writes ``out``."""
    from safetensors.numpy import save_file

    from fedspear.fl import client_app
    from fedspear.fl.strategy import WinWeightedFedAvg
    from fedspear.runtime.model import get_adapter

    cfg = load_config(run / "config.toml").resolved()
    theta0 = get_adapter(client_app.get_worker(cfg).model)  # the fresh adapter, seeded as the run's
    strategy = WinWeightedFedAvg(cfg.clients_per_round, cfg.num_clients, seed=cfg.seed, wait_seconds=0)
    strategy.partition_of = {n: n for n in range(cfg.num_clients)}
    lr = lr_at_round(1, cfg.rounds, cfg.lr, cfg.lr_min, cfg.warmup_ratio)
    config = ConfigRecord({"lr": lr, "fedspear-config": json.dumps(cfg.to_dict()), LAYOUT_KEY: layout_of(theta0)})
    messages = list(strategy.configure_train(1, to_record(theta0), config, _Grid(cfg.num_clients)))
    sent = strategy.current_arrays
    result: dict = {"run": str(run), "partitions": [m.metadata.dst_node_id for m in messages], "clients": {}}
    replies: dict[str, list[Message]] = {e: [] for e in ENCODINGS}
    for msg in messages:
        pid = msg.metadata.dst_node_id
        context = Context(run_id=1, node_id=pid, node_config={"partition-id": pid}, state=RecordDict(),
                          run_config={})
        t0 = time.perf_counter()
        reply = client_app.app(msg, context)  # fp32: no encoding key, the mods pass the reply through
        if reply.has_error():
            raise RuntimeError(f"partition {pid}: {reply.error.reason}")
        seconds = time.perf_counter() - t0
        entry = {"seconds_contended": seconds, "metrics": dict(reply.content["metrics"]), "bytes": {}}
        for encoding in ENCODINGS:
            asked = Message(content=RecordDict({"arrays": msg.content["arrays"],
                                                "config": ConfigRecord(dict(msg.content["config"]))}),
                            dst_node_id=pid, message_type=MessageType.TRAIN)
            if encoding != "fp32":
                asked.content["config"][ENCODING_KEY] = encoding
            fresh = Message(content=RecordDict({"arrays": ArrayRecord(copy.deepcopy(dict(reply.content["arrays"]))),
                                                "metrics": reply.content["metrics"]}), reply_to=asked)
            encoded = encode_update_mod(asked, context, lambda _m, _c, fresh=fresh: fresh)
            encoded.metadata.__dict__["_src_node_id"] = pid
            entry["bytes"][encoding] = {"to_client": wire_bytes(asked), "to_client_parts": wire_breakdown(asked),
                                        "from_client": wire_bytes(encoded),
                                        "from_client_parts": wire_breakdown(encoded)}
            replies[encoding].append(encoded)
        result["clients"][pid] = entry
        print(f"partition {pid}: {seconds:.0f} s, wins {entry['metrics'].get('num-wins')}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for encoding in ENCODINGS:
        strategy.current_arrays = sent
        averaged, _ = strategy.aggregate_train(1, replies[encoding])
        if strategy.rejected:
            raise RuntimeError(f"{encoding}: replies rejected: {strategy.rejected}")
        arrays = from_record(averaged, layout_of(theta0))
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(out / f"average_{encoding}.safetensors"))
        result.setdefault("update_norms", {})[encoding] = {str(n): v for n, v in strategy.update_norms.items()}
    save_file({k: np.ascontiguousarray(v) for k, v in theta0.items()}, str(out / "theta0.safetensors"))
    (out / "replay.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def qwen_shapes(r: int) -> dict[str, tuple[int, ...]]:
    """peft's LoRA tensor names and shapes for Qwen2.5-Coder-1.5B, rank r on the seven projections of every layer."""
    q = QWEN
    kv = q["kv_heads"] * q["head_dim"]
    dims = {"self_attn.q_proj": (q["hidden"], q["heads"] * q["head_dim"]), "self_attn.k_proj": (q["hidden"], kv),
            "self_attn.v_proj": (q["hidden"], kv), "self_attn.o_proj": (q["heads"] * q["head_dim"], q["hidden"]),
            "mlp.gate_proj": (q["hidden"], q["intermediate"]), "mlp.up_proj": (q["hidden"], q["intermediate"]),
            "mlp.down_proj": (q["intermediate"], q["hidden"])}
    shapes = {}
    for layer in range(q["layers"]):
        for module, (d_in, d_out) in dims.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            shapes[f"{stem}.lora_A.weight"] = (r, d_in)
            shapes[f"{stem}.lora_B.weight"] = (d_out, r)
    return shapes


def constructed_bytes(cfg, shapes: dict[str, tuple[int, ...]], metrics: dict, seed: int = 0) -> dict:
    """Wire bytes of a train message and of its reply per encoding, built as ``run_server`` and the ClientApp build
    them, for an adapter of ``shapes`` with random values."""
    cfg = cfg.resolved()  # as run_server sends it
    rng = np.random.default_rng(seed)
    theta = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    trained = {k: (v + 1e-4 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in theta.items()}
    sent = to_record(theta)
    out = {"values": int(sum(v.size for v in theta.values()))}
    for encoding in ENCODINGS:
        config = ConfigRecord({"lr": cfg.lr, "fedspear-config": json.dumps(cfg.to_dict()),
                               LAYOUT_KEY: layout_of(theta), "server-round": 1})
        if encoding != "fp32":
            config[ENCODING_KEY] = encoding
        train = Message(content=RecordDict({"arrays": sent, "config": config}), dst_node_id=1,
                        message_type=MessageType.TRAIN)
        reply = Message(content=RecordDict({"arrays": encode_update(sent, to_record(trained), encoding),
                                            "metrics": MetricRecord(metrics)}), dst_node_id=0,
                        message_type=MessageType.TRAIN)
        down, up = wire_breakdown(train), wire_breakdown(reply)
        out[encoding] = {"to_client": sum(down.values()), "to_client_parts": down,
                         "from_client": sum(up.values()), "from_client_parts": up}
    return out


def report(run: Path, replayed: Path, out: Path) -> None:
    """Compare the replay with the run and write ``out/results.json`` (module docstring)."""
    from safetensors.numpy import load_file

    done = RunDir(run)
    replay_json = json.loads((replayed / "replay.json").read_text())
    theta0 = load_file(str(replayed / "theta0.safetensors"))
    averages = {e: load_file(str(replayed / f"average_{e}.safetensors")) for e in ENCODINGS}
    exact = averages["fp32"]
    measured, checks = None, {"run_finished_round_1": done.adapter_dir(1).exists()}
    if done.adapter_dir(0).exists():
        checks["theta0_equals_run"] = all(np.array_equal(theta0[k], v) for k, v in done.load_adapter(0).items())
    if checks["run_finished_round_1"]:  # the replay against what the run itself measured and aggregated
        exact_run, round1 = done.load_adapter(1), records(run)[1]
        measured = {"to_client": [c["bytes_to_client"] for c in round1["clients"]],
                    "from_client": [c.get("bytes_from_client") for c in round1["clients"]],
                    "partitions": [c.get("partition-id") for c in round1["clients"]]}
        checks["partitions_equal_run"] = sorted(measured["partitions"]) == sorted(replay_json["partitions"])
        checks["fp32_average_equals_run_bit_for_bit"] = all(np.array_equal(exact_run[k], exact[k]) for k in exact)
        checks["fp32_average_vs_run_relative_l2"] = (
            _norm({k: exact[k].astype(np.float64) - exact_run[k] for k in exact})
            / max(_norm({k: exact_run[k].astype(np.float64) - theta0[k] for k in exact}), 1e-30))
    step = {k: exact[k].astype(np.float64) - theta0[k] for k in exact}
    clients = list(replay_json["clients"].values())
    wins = [c["metrics"]["weight"] for c in clients]
    norms = [replay_json["update_norms"]["fp32"][str(p)] for p in replay_json["clients"]]
    mean_norm = sum(w * n for w, n in zip(wins, norms)) / max(sum(wins), 1)
    errors = {}
    for encoding in ("fp16", "int8"):
        err = {k: averages[encoding][k].astype(np.float64) - exact[k] for k in exact}
        errors[encoding] = {"relative_to_update": _norm(err) / _norm(step) if _norm(step) else None,
                            "relative_to_adapter": _norm(err) / _norm(exact),
                            "max_abs": max(float(np.abs(v).max()) for v in err.values()),
                            "error_norm": _norm(err), "update_norm": _norm(step),
                            "bound_error_norm": ENCODING_ERROR[encoding] * mean_norm}
    bytes_replay = {e: {"to_client": [c["bytes"][e]["to_client"] for c in clients],
                        "from_client": [c["bytes"][e]["from_client"] for c in clients],
                        "to_client_parts": clients[0]["bytes"][e]["to_client_parts"],
                        "from_client_parts": clients[0]["bytes"][e]["from_client_parts"]} for e in ENCODINGS}
    cfg = RunConfig()  # the defaults (output_dir runs/default)
    metrics = clients[0]["metrics"]
    smol_shapes = {k: v.shape for k, v in theta0.items()}
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    smol = constructed_bytes(cfg, smol_shapes, metrics)
    qwen_cfg = dataclasses.replace(cfg, **PRESETS["cpu-qwen1.5b"].base, task="arc_challenge", algorithm="spear",
                                   seed=0, output_dir="runs/qwen")
    qwen = constructed_bytes(qwen_cfg, qwen_shapes(qwen_cfg.lora_r), metrics)
    result = {
        "smollm2_135m": {"values": int(sum(v.size for v in theta0.values())), "run_round1_measured": measured,
                         "replay": bytes_replay, "checks": checks, "client_weights": wins,
                         "client_update_norms": norms, "aggregation_error": errors, "constructed": smol},
        "qwen2.5_coder_1.5b": {"preset": "cpu-qwen1.5b", "lora_r": qwen_cfg.lora_r,
                               "last_layers": qwen_cfg.last_layers, "shapes_from": QWEN, "constructed": qwen,
                               "arc_accuracy_int8_vs_fp32": "not measured (a cell pair of about 3.5 h each on a 2-core"
                                                            " CPU)"},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"checks": checks, "measured": measured, "errors": errors}, indent=1))
    for e in ENCODINGS:
        print(f"SmolLM2 {e}: replay to {bytes_replay[e]['to_client']} from {bytes_replay[e]['from_client']}; "
              f"constructed {smol[e]['to_client']} / {smol[e]['from_client']}; Qwen {qwen[e]['to_client']} / "
              f"{qwen[e]['from_client']} ({qwen['values']} values)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="redo a run's round 1 with each encoding")
    p.add_argument("run", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("report", help="compare the replay with the run; write results.json")
    p.add_argument("run", type=Path)
    p.add_argument("replay", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "wire")
    args = parser.parse_args()
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # Message() outside a Flower app
    if args.command == "replay":
        replay(args.run, args.out)
    else:
        report(args.run, args.replay, args.out)


if __name__ == "__main__":
    main()
