"""Quantisation error of SecAgg+ on real SmolLM2-135M LoRA updates (secure_aggregation = "secaggplus").

    PYTHONPATH=src python docs/results/secagg/measure.py --out docs/results/secagg/error.json

1. Real client updates: SPEAR's client round (``fedspear.algorithms.spear.client_round``: win / lose sets, local
   training) on the packaged SmolLM2-135M-Instruct with fedspear's CPU defaults (ARC-Challenge, LoRA r 16 on every
   linear layer, lr schedule from 2e-4, 2 local steps, 16 prompts per client-round) except batches of 2 wins + 2
   losses instead of 4 + 4 (Adam's step size does not scale with the batch; half the cost on this shared machine),
   seed 0, 10 clients, ``--rounds`` rounds (default 1) of 4 clients (0–3, then 4–7, …), each round starting from
   the plain win-weighted FedAvg of the one before. The answers are *replayed* instead of sampled (the ``replay``
   path people's chats use), so that no generation runs on this shared 2-core machine: on prompt j of client k,
   (j + k) mod 4 = 0 answers the gold letter at once (a win), 1 or 2 answers a wrong letter then the gold one (a win
   and a loss), 3 answers wrong and stops (nothing). Cached in ``--cache`` (npz).
2. For each setting, the round's clients go through Flower's real SecAgg+ protocol in one process
   (``fedspear.fl.secagg.SecureRounds`` over ``LoopbackGrid``: SecAggPlusWorkflow + secaggplus_mod, masks and all),
   and the unmasked result is compared with ``fedspear.server.aggregation.win_weighted_average`` of the same
   adapters: max |error|, RMS error, and ‖error‖₂ / ‖mean update‖₂. Flower's stochastic rounding draws from NumPy's
   global RNG, seeded 0 here.
3. A wider sweep of settings with the same arithmetic without the masks (Flower's quantize / dequantize and the
   weight factor; the masks cancel exactly mod 2^32, as the protocol rows show), and for comparison Flower's
   documented defaults applied to full parameters θ_k (what Flower's own examples send: clipping_range 8,
   max_weight 1000).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def collect(cache: Path, num_rounds: int) -> list[dict]:
    """[{theta, clients, weights}] per round (see the module docstring), from ``cache`` when present."""
    if cache.exists():
        data = np.load(cache, allow_pickle=True)
        return list(data["rounds"])
    from fedspear.config import RunConfig
    from fedspear.fl.node_worker import partition_indices
    from fedspear.runtime.model import get_adapter
    from fedspear.server.aggregation import win_weighted_average
    from fedspear.server.schedule import lr_at_round
    from fedspear.algorithms import spear
    from fedspear.feedback import make_feedback
    from fedspear.runtime.model import set_adapter
    from fedspear.worker import Worker, derived_seed, round_prompts

    cfg = RunConfig(num_clients=10, clients_per_round=4, seed=0, rounds=10, batch_size=2)
    worker = Worker.load(cfg)
    theta = get_adapter(worker.model)
    rounds = []
    for server_round in range(1, num_rounds + 1):
        pids = [(4 * (server_round - 1) + i) % cfg.num_clients for i in range(4)]
        lr = lr_at_round(server_round, cfg.rounds, cfg.lr, cfg.lr_min, cfg.warmup_ratio)
        clients, weights = [], []
        for pid in pids:
            t0 = time.perf_counter()
            examples = [worker.examples[i] for i in round_prompts(partition_indices(worker.examples, cfg, pid, False),
                                                                  cfg, pid, server_round)]
            replay = []
            for j, example in enumerate(examples):
                right = _ids(worker.tokenizer, f"The answer is {example.gold}.")
                wrong = _ids(worker.tokenizer, f"The answer is {next(x for x in example.labels if x != example.gold)}.")
                kind = (j + pid) % 4
                replay.append([right] if kind == 0 else [wrong, right] if kind < 3 else [wrong])
            set_adapter(worker.model, theta)
            metrics = spear.client_round(worker, cfg.resolved(), examples, lr=lr,
                                         seed=derived_seed(cfg.seed, "client-round", pid, server_round),
                                         feedback=make_feedback(worker.task), replay=replay)
            arrays = get_adapter(worker.model)
            clients.append(arrays)
            weights.append(int(metrics["weight"]))
            print(f"round {server_round} client {pid}: weight {weights[-1]}, {time.perf_counter() - t0:.0f} s",
                  flush=True)
        rounds.append({"theta": theta, "clients": clients, "weights": weights, "lr": lr})
        theta, _ = win_weighted_average(theta, clients, weights)
    np.savez(cache, rounds=np.array(rounds, dtype=object))
    return rounds


def _flat(arrays: dict) -> np.ndarray:
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in arrays.values()])


def protocol_row(data: dict, clipping_range: float, quantization_range: int, max_weight: float) -> dict:
    """One SecAgg+ round through Flower's protocol with these settings; the error against plain FedAvg. Both are
    float32 adapters, so the error includes float32 rounding (≤ 1 ulp: 7.5e-9 for values below 0.125)."""
    from flwr.app import ConfigRecord

    from fedspear.config import RunConfig
    from fedspear.fl.records import LAYOUT_KEY, layout_of
    from fedspear.fl.secagg import LoopbackGrid, SecureRounds, error_bound, make_client_app
    from fedspear.fl.strategy import WinWeightedFedAvg
    from fedspear.server.aggregation import win_weighted_average

    from flwr.supercore.task_identity import TaskIdentity

    # outside a running ServerApp Flower needs the task identity set to build messages (as tests/conftest.py does)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    theta, clients, weights = data["theta"], data["clients"], data["weights"]
    n = len(clients)
    cfg = RunConfig(num_clients=n, clients_per_round=n, secure_aggregation="secaggplus",
                    secagg_clipping_range=clipping_range, secagg_quantization_range=quantization_range,
                    secagg_max_weight=max_weight, round_timeout=60.0)

    def train(cfg_, context, global_arrays, server_round, lr):
        pid = int(context.node_config["partition-id"])
        return ({k: v.copy() for k, v in clients[pid].items()},
                {"weight": weights[pid], "num-wins": weights[pid], "num-losses": 0, "prompts": 16})

    grid = LoopbackGrid(make_client_app(train), [11 + i for i in range(n)])
    core = WinWeightedFedAvg(n, n, seed=0)
    secure = SecureRounds(core, cfg, grid)
    core.partition_of = {node: k for k, node in enumerate(grid.get_node_ids())}  # LoopbackGrid: node k, partition k
    config = ConfigRecord({"lr": 1e-4, "fedspear-config": json.dumps(cfg.to_dict()), LAYOUT_KEY: layout_of(theta)})
    t0 = time.perf_counter()
    _, new, rejected, _ = secure.round(1, theta, config)
    seconds = time.perf_counter() - t0
    row = {"encoding": "update (fedspear)", "clipping_range": clipping_range, "quantization_range": quantization_range,
           "max_weight": max_weight, "seconds_contended": round(seconds, 1)}
    if new is None or rejected:
        return {**row, "refused": sorted(set(rejected.values()))}
    plain, _ = win_weighted_average(theta, clients, weights)
    return {**row, **_errors(_flat(new) - _flat(plain), _flat(plain) - _flat(theta)),
            "bound_max_abs": error_bound(cfg, n, sum(weights))}


def arithmetic_row(data: dict, clipping_range: float, quantization_range: int, max_weight: float,
                   encoding: str = "update") -> dict:
    """Flower's mod and unmask arithmetic without the masks (they cancel exactly mod 2^32): each client's values
    (its update Δ_k as fedspear sends it, or its parameters θ_k as Flower's examples send them) times q_k/Q,
    quantised with Flower's ``quantize``, summed, ``dequantize``d, offset and scaled by Q/Σ q_k."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from fedspear.server.aggregation import win_weighted_average

    theta, clients, weights = data["theta"], data["clients"], data["weights"]
    q, base = quantization_range, _flat(theta)
    total, q_total, clipped = None, 0, 0
    for arrays, w in zip(clients, weights):
        q_ratio = round(w / max_weight * q)  # secaggplus_mod._collect_masked_vectors
        x = (_flat(arrays) - (base if encoding == "update" else 0.0)) * (q_ratio / q)
        clipped += int(np.sum(np.abs(x) > clipping_range))
        quantized = quantize([x], clipping_range, q)[0].astype(np.int64)
        total = quantized if total is None else total + quantized
        q_total += q_ratio
    mean = dequantize([total], clipping_range, q)[0]  # SecAggPlusWorkflow.unmask_stage
    mean = (mean - (len(clients) - 1) * clipping_range) * (q / q_total) + (base if encoding == "update" else 0.0)
    wide = [{k: np.asarray(v, np.float64) for k, v in c.items()} for c in clients]  # the exact mean, in float64
    plain, _ = win_weighted_average({k: np.asarray(v, np.float64) for k, v in theta.items()}, wide, weights)
    return {"encoding": f"{encoding} (arithmetic)" if encoding == "update" else "parameters (Flower's examples)",
            "clipping_range": clipping_range, "quantization_range": q, "max_weight": max_weight,
            "values_clipped": clipped, **_errors(mean - _flat(plain), _flat(plain) - base)}


def _errors(err: np.ndarray, update: np.ndarray) -> dict:
    return {"max_abs_error": float(np.abs(err).max()), "rms_error": float(np.sqrt(np.mean(err ** 2))),
            "relative_error": float(np.linalg.norm(err) / np.linalg.norm(update)),
            "mean_update_max_abs": float(np.abs(update).max()), "mean_update_rms": float(np.sqrt(np.mean(update ** 2)))}


def table(path: Path) -> str:
    """The markdown table of README.md from a results file."""
    lines = ["| round | encoding | c | Q | max_weight | max abs error | RMS error | ‖error‖ / ‖mean update‖ | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for info in json.loads(path.read_text())["rounds"]:
        for row in info["rows"]:
            q = int(row["quantization_range"])
            exceeded = sum("exceeds secagg_clipping_range" in r for r in row.get("refused", []))
            note = f"{exceeded} of 4 clients refused (update beyond c), round halted" if "refused" in row else (
                f"bound {row['bound_max_abs']:.2g}" if "bound_max_abs" in row else
                f"{row.get('values_clipped', 0)} values clipped")
            errors = ("—", "—", "—") if "refused" in row else (
                f"{row['max_abs_error']:.2g}", f"{row['rms_error']:.2g}", f"{row['relative_error']:.2g}")
            lines.append(f"| {info['round']} | {row['encoding']} | {row['clipping_range']:g} | 2^{int(math.log2(q))} | "
                         f"{row['max_weight']:g} | {' | '.join(errors)} | {note} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("error.json"))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fedspear-secagg-adapters.npz"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--table", action="store_true", help="print README.md's table from --out and stop")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return
    rounds = collect(args.cache, args.rounds)
    results = []
    for r, data in enumerate(rounds, start=1):
        deltas = [_flat(c) - _flat(data["theta"]) for c in data["clients"]]
        info = {"round": r, "weights": data["weights"], "values": int(deltas[0].size),
                "client_update_max_abs": [float(np.abs(d).max()) for d in deltas],
                "client_update_norm": [float(np.linalg.norm(d)) for d in deltas],
                "theta_max_abs": float(np.abs(_flat(data["theta"])).max()), "rows": []}
        for c, q, w in ((0.01, 2**22, 16.0), (0.01, 2**16, 16.0), (0.001, 2**22, 16.0)):  # Flower's protocol
            np.random.seed(0)
            row = protocol_row(data, c, q, w)
            print(json.dumps(row), flush=True)
            info["rows"].append(row)
        grid = [(c, q, 16.0) for c in (0.1, 0.01, 0.001) for q in (2**16, 2**20, 2**22, 2**24)]
        grid += [(0.01, 2**22, 100.0), (0.01, 2**22, 1000.0)]
        for c, q, w in grid:
            np.random.seed(0)
            info["rows"].append(arithmetic_row(data, c, q, w))
            print(json.dumps(info["rows"][-1]), flush=True)
        for c, q, w in ((8.0, 2**22, 1000.0), (8.0, 2**22, 16.0), (1.0, 2**22, 16.0)):
            np.random.seed(0)
            info["rows"].append(arithmetic_row(data, c, q, w, encoding="parameters"))
            print(json.dumps(info["rows"][-1]), flush=True)
        results.append(info)
    args.out.write_text(json.dumps({"command": "PYTHONPATH=src python docs/results/secagg/measure.py",
                                    "model": "smollm2-135m", "rounds": results}, indent=1,
                                   default=lambda v: None if isinstance(v, float) and math.isnan(v) else v) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
