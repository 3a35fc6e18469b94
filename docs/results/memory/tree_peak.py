"""Run a command; sample its process tree's summed RSS / PSS / USS every 0.5 s (psutil; each sample reads every
process's PSS in full, which ``fedspear.runtime.memory.TreePeak`` does more rarely inside a run); print the peaks
(MiB) as JSON and write them with the series.

    python docs/results/memory/tree_peak.py OUT.json COMMAND [ARG ...]

Used for the figures in README.md here: the run before the shared weight copy predates the tree peak that fedspear
now records itself (``peak_tree_mb`` in metrics.jsonl).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil


def main(out: str, cmd: list[str], interval: float = 0.5) -> dict:
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak = {"rss": 0, "pss": 0, "uss": 0, "procs": 0}
    series = []
    t0 = time.time()
    while proc.poll() is None:
        sums = {"rss": 0, "pss": 0, "uss": 0}
        per = []
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                info = p.memory_full_info()
                name = (p.cmdline() or [""])[0][:40]
            except psutil.Error:
                continue
            for key in sums:
                sums[key] += getattr(info, key)
            per.append((p.pid, name, info.rss >> 20, info.pss >> 20))
        if sums["pss"] > peak["pss"]:
            peak["at_pss"] = sorted(per, key=lambda row: -row[3])[:4]  # the largest processes at the PSS peak
        for key, value in sums.items():
            peak[key] = max(peak[key], value)
        peak["procs"] = max(peak["procs"], len(per))
        series.append((round(time.time() - t0, 1), sums["rss"] >> 20, sums["pss"] >> 20))
        time.sleep(interval)
    result = {key: (value >> 20 if key in ("rss", "pss", "uss") else value) for key, value in peak.items()}
    result.update(rc=proc.returncode, wall_s=round(time.time() - t0))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"peak_mib": result, "series": series}, fh)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])))
