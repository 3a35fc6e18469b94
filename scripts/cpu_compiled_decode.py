"""The compiled decode step on a CPU: SmolLM2-135M (``dtype = auto``), decode tokens/s eager against compiled
(inductor, ``compile_decode = on``: the same step a round decodes with, a warm bucket's guards skipped), alternating
in one process after both batch buckets have compiled: 4 pairs at batch 8 and 32, 200-token prompts, 32 new tokens,
each timed step by step as ``fedspear bench`` times decode (``bench.timed_decode``).

    .venv/bin/python scripts/cpu_compiled_decode.py

Prints the seconds of each bucket's first two calls (the warm-up, compilation included, and one timed call) and each
way's tokens/s per call, with the median.
"""

from __future__ import annotations

import statistics
import time


def main() -> None:
    from fedspear.experiments.bench import timed_decode
    from fedspear.runtime.compiled import ATTRIBUTE, compiled_decode, use_compiled_decode
    from fedspear.runtime.model import LoraSettings, add_lora, load_base

    base, tok, dtype_used = load_base("smollm2-135m", "auto", "cpu")
    model = add_lora(base, LoraSettings())
    use_compiled_decode(model, "on")
    step = compiled_decode(model)
    for batch in (8, 32):
        t0 = time.perf_counter()
        timed_decode(model, tok, dtype_used, batch, 200, 32, repeats=1)
        print(f"batch {batch}: compilation and first calls {time.perf_counter() - t0:.0f} s", flush=True)
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(4):
        for batch in (8, 32):
            for way in ("eager", "compiled"):
                if way == "eager":
                    delattr(model, ATTRIBUTE)  # no compiled step: generate decodes eagerly
                _, runs = timed_decode(model, tok, dtype_used, batch, 200, 32, repeats=1)
                rates.setdefault((batch, way), []).extend(runs)
                setattr(model, ATTRIBUTE, step)  # the same compiled step and caches back
    for (batch, way), runs in sorted(rates.items()):
        print(f"batch {batch}, {way}: median {statistics.median(runs):.0f} tokens/s;",
              " ".join(f"{r:.0f}" for r in runs))


if __name__ == "__main__":
    main()
