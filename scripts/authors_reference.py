"""Time the SPEAR authors' code on this CPU, on the performance reference configuration.

The authors' code (github.com/lee3296/SPEAR, 16be04c; no licence, so it is not in this repository) is imported from
a checkout of it and run with only what a CPU without network needs changed: ARC-Challenge comes from a local copy
(the hub schema, ``../shared/data/arc_challenge`` or fedspear's packaged copy) instead of ``datasets.load_dataset``,
the model from a local folder, the global evaluation is left out (their per-round seconds exclude it anyway), and
torch uses ``--threads`` threads. Everything else is theirs: their seeds, partition, prompts, generation, SPEAR loss
and FedAvg.

The configuration is fedspear's performance reference (``fedspear bench``): ARC-Challenge, SmolLM2-135M-Instruct in
fp32 with its chat template (their prompting applies it when the model folder's name says "Instruct"), 10 clients,
3 per round, 3 rounds, 16 rollouts per client-round, up to 2 revisions, 16 new tokens per attempt, 2 local steps of
4 wins + 4 losses, LoRA r 16 / α 32 on every linear layer of all 30 layers, gradient checkpointing on (their
default), seed 44, on top of their ``configs/arc_challenge_qwen1.5b_spear.yaml``.

Prints and writes (``--out``/``result.json``) seconds per client-round for each round: the round's ``seconds`` in
their ``history.json`` (clients + aggregation, evaluation excluded) ÷ clients per round.

Usage::

    git clone <mirror of lee3296/SPEAR> /tmp/authors/SPEAR
    ln -s ~/.cache/fedspear/models/smollm2-135m-<hash> /tmp/authors/SmolLM2-135M-Instruct
    .venv/bin/python scripts/authors_reference.py --repo /tmp/authors/SPEAR \
        --model /tmp/authors/SmolLM2-135M-Instruct --out /tmp/authors/run-a
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA_DIRS = [HERE.parent.parent / "shared" / "data" / "arc_challenge",
             HERE.parent / "src" / "fedspear" / "data" / "arc_challenge"]


def arc_rows(split: str, data_dir: Path | None):
    """The ARC-Challenge ``split`` as a ``datasets.Dataset`` in the hub schema, from a local JSONL copy."""
    import datasets

    dirs = [data_dir] if data_dir else DATA_DIRS
    for d in dirs:
        path = Path(d) / f"{split}.jsonl"
        if path.exists():
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            return datasets.Dataset.from_list(rows)
    raise SystemExit(f"no ARC-Challenge {split}.jsonl in {', '.join(map(str, dirs))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True, type=Path, help="a checkout of lee3296/SPEAR (16be04c)")
    ap.add_argument("--model", required=True, type=Path,
                    help="SmolLM2-135M-Instruct's folder (a name containing 'Instruct': their chat-template switch)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.repo.resolve()))
    from spear_fl import config as their_config, data as their_data, federated as their_federated

    def load_dataset(name, config_name=None, split="train", **_kw):
        if (name, config_name) != ("ai2_arc", "ARC-Challenge"):
            raise SystemExit(f"only ARC-Challenge is shimmed, not {name} {config_name}")
        return arc_rows(split, args.data_dir)

    their_data.load_dataset = load_dataset
    their_federated.evaluate_global = lambda *a, **k: None  # evaluation excluded, as from their round seconds

    cfg = their_config.load_config(str(args.repo / "configs" / "arc_challenge_qwen1.5b_spear.yaml"))
    cfg.output_dir = str(args.out)
    cfg.model.model_name = str(args.model)
    cfg.model.dtype = "fp32"  # their CPU path has no bf16
    cfg.model.device_map = "cpu"
    cfg.model.gradient_checkpointing = True
    cfg.lora.r, cfg.lora.alpha, cfg.lora.last_n_layers = 16, 32, 30
    cfg.data.num_clients, cfg.data.seed = 10, 44
    cfg.fl.rounds, cfg.fl.clients_per_round = args.rounds, 3
    cfg.fl.local_rollout_steps, cfg.fl.local_train_steps = 16, 2
    cfg.gen.max_new_tokens_y0 = cfg.gen.max_new_tokens_y1 = 16
    cfg.gen.num_revisions = 2
    cfg.optim.batch_size = 4
    cfg.hf.offline = True

    start = time.time()
    their_federated.run_federated(cfg)
    history = json.loads((args.out / "history.json").read_text())["history"]
    per_client = [h["seconds"] / len(h["selected_clients"]) for h in history]
    result = {
        "authors_commit": os.popen(f"git -C {args.repo} rev-parse --short HEAD").read().strip(),
        "threads": args.threads, "torch": torch.__version__,
        "seconds_per_client_round": per_client, "median": statistics.median(per_client),
        "clients": [h["selected_clients"] for h in history],
        "wins": [[c["n_eff"] for c in h["client_logs"]] for h in history],  # their FedAvg weight: max(1, wins)
        "wall_seconds": time.time() - start,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
