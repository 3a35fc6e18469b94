"""Where a client's memory goes (issue 19, item 3): one process loads the model as a client does, runs SPEAR
client-rounds of the performance reference configuration, and samples its memory every 20 ms.

Each sample reads ``/proc/self/status``: ``RssAnon`` (private memory: tensors, malloc heaps), ``RssFile`` (file
pages mapped, e.g. the model's safetensors when loaded by mmap: shared with every process mapping the same file and
reclaimable, yet counted in the resident size and in ``ru_maxrss``, which ``peak_rss_mb`` reports), ``RssShmem``
(shared memory: Ray's object store when run under Ray). Samples are tagged with the phase fedspear's progress
reporting is in (``load``, ``initial answers``, ``revision n``, ``training``, ``release``). Printed per phase: the
peak of each kind (MiB) and the resident size at the phase's end.

    .venv/bin/python scripts/memory_profile.py --model smollm2-135m --rounds 2
    .venv/bin/python scripts/memory_profile.py --model qwen2.5-coder-1.5b --rounds 1 --output /tmp/mem-qwen.json
    .venv/bin/python scripts/memory_profile.py --model smollm2-135m --checkpointing on

Memory figures do not depend on what else runs on the machine (speed does); they do depend on torch's and glibc's
allocators, so the process is the same one a simulated client runs in, without Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def status() -> dict[str, float]:
    """This process's memory by kind, MiB (the fields of ``FIELDS``)."""
    from fedspear.runtime.memory import status as memory_status

    return {key: value for key, value in memory_status().items() if key in FIELDS}


class Sampler(threading.Thread):
    """Samples ``status()`` every ``interval`` seconds, tagged with ``self.label`` or fedspear's progress phase."""

    def __init__(self, interval: float = 0.02):
        super().__init__(daemon=True)
        self.interval, self.label, self.samples, self.running = interval, "start", [], True

    def current(self) -> str:
        from fedspear import progress

        rep = progress._reporter
        phase = rep.state.get("phase") if rep is not None else None
        return phase if phase and phase != "done" else self.label

    def run(self) -> None:
        while self.running:
            self.samples.append((self.current(), status()))
            time.sleep(self.interval)

    def mark(self, label: str) -> None:
        self.samples.append((self.current(), status()))
        self.label = label


def summary(samples: list[tuple[str, dict]]) -> list[dict]:
    """Per phase in order of first appearance: peak of each kind and the last sample's resident size (MiB)."""
    rows: dict[str, dict] = {}
    for label, s in samples:
        row = rows.setdefault(label, {"phase": label, **{f"peak_{k}": 0.0 for k in FIELDS}})
        for k in FIELDS:
            row[f"peak_{k}"] = max(row[f"peak_{k}"], s.get(k, 0.0))
        row["end_VmRSS"] = s.get("VmRSS", 0.0)
    return list(rows.values())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--checkpointing", default="auto", help="gradient_checkpointing: auto | on | off")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    sampler = Sampler()
    sampler.start()
    sampler.mark("import")
    os.environ["FEDSPEAR_PROGRESS_DIR"] = tempfile.mkdtemp(prefix="fedspear-memprof-")
    import numpy as np

    from fedspear import progress
    from fedspear.config import RunConfig
    from fedspear.runtime.memory import peak_rss_mb, release_memory
    from fedspear.runtime.model import get_adapter
    from fedspear.worker import Worker

    sampler.mark("load")
    cfg = RunConfig(task="arc_challenge", model=args.model, dtype=args.dtype, num_clients=10, clients_per_round=3,
                    rollouts_per_round=16, max_revisions=2, max_new_tokens=16, local_steps=2, batch_size=4,
                    rounds=args.rounds, gradient_checkpointing=args.checkpointing)
    worker = Worker.load(cfg)
    sampler.mark("after load")
    arrays = get_adapter(worker.model)
    parts = np.array_split(np.arange(len(worker.examples)), cfg.num_clients)
    for r in range(1, args.rounds + 1):
        for pid in range(3):
            progress.start(f"client {pid}", r)
            arrays_out, _ = worker.round(worker.loaded, arrays, [int(i) for i in parts[pid]], pid, r, cfg.lr)
            progress.finish()
        sampler.mark(f"release after round {r}")
        release_memory()
        sampler.mark(f"idle after round {r}")
    time.sleep(0.1)
    sampler.running = False
    sampler.join()
    rows = summary(sampler.samples)
    out = {"model": args.model, "dtype": worker.dtype_used, "checkpointing": args.checkpointing,
           "ru_maxrss_mib": peak_rss_mb(), "phases": rows}
    print(f"{args.model} ({worker.dtype_used}): ru_maxrss {out['ru_maxrss_mib']:.0f} MiB")
    print("| phase | peak VmRSS | peak RssAnon | peak RssFile | peak RssShmem | VmRSS at end |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} | " + " | ".join(f"{row[f'peak_{k}']:.0f}" for k in FIELDS)
              + f" | {row['end_VmRSS']:.0f} |")
    if args.output:
        args.output.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
