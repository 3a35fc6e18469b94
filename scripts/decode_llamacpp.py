"""Decode candidate for issue 19: llama.cpp (through llama-cpp-python's low-level API) with the client's LoRA adapter
applied at run time, against fedspear's torch generation, on one machine.

The pattern TRL and OpenRLHF use with vLLM on GPUs: rollouts by an inference engine, training in torch, the round's
adapter handed to the engine. This script measures what the engine would buy before anything is built on it:

1. the model is converted to GGUF once (llama.cpp's ``convert_hf_to_gguf.py``; f32 for fp32, bf16 for bf16) and a
   non-zero LoRA adapter (``decode_candidates.adapter_model``: r 16, all seven projections, B ~ N(0, 0.02²)) is
   saved by peft and converted with ``convert_lora_to_gguf.py`` — what a client would do once per round;
2. greedy answers (16 new tokens) to the first ``--check`` ARC-Challenge test prompts, llama.cpp with the adapter
   against fedspear's torch path (``decode_candidates.greedy_answers``, eager), compared up to the end of turn;
3. decode tokens/s at each ``--batches`` size: ``--prompt`` random tokens per sequence, one llama.cpp sequence per
   row, greedy, exactly ``--new`` tokens, timed from the first new token's logits to the last (the prefill excluded,
   as ``fedspear.experiments.bench.StepClock`` times torch), median of ``--repeats`` after a warm-up; with and
   without the adapter, and with ``--torch`` fedspear's own decode (``bench.decode_tokens_per_s``) in the same
   process. Share of the bound: tokens/s ÷ (batch × copy bandwidth ÷ bytes of the torch model's weights).

llama-cpp-python is a source distribution on PyPI: installing it builds llama.cpp (≈ 15 min on 2 cores). Not a
dependency of fedspear; to run this script (version measured: 0.3.36, 2026-11-26)::

    .venv/bin/pip download llama-cpp-python==0.3.36 --no-deps -d /tmp/llcpp
    tar xzf /tmp/llcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/llcpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install --no-deps /tmp/llcpp/llama_cpp_python-0.3.36.tar.gz
    .venv/bin/pip install diskcache sentencepiece /tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
    .venv/bin/python scripts/decode_llamacpp.py --llama-cpp /tmp/llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --dtype fp32 --torch --output /tmp/ll-fp32.json

Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

_QUIET = None  # llama.cpp's log callback, kept alive


def convert(llama_cpp: Path, work: Path, model, name: str, outtype: str) -> tuple[Path, Path]:
    """The base model's GGUF (converted once, kept in ``work``) and the adapter's (converted on every call)."""
    from fedspear.runtime.model_zoo import resolve_model_dir

    source = str(resolve_model_dir(name))
    base = work / f"{name}-{outtype}.gguf"
    if not base.exists():
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), source, "--outtype", outtype,
                        "--outfile", str(base)], check=True, capture_output=True)
    peft_dir = work / f"adapter-{name}-{outtype}"
    model.save_pretrained(peft_dir)
    adapter = work / f"adapter-{name}-{outtype}.gguf"
    subprocess.run([sys.executable, str(llama_cpp / "convert_lora_to_gguf.py"), str(peft_dir), "--base", source,
                    "--outtype", outtype, "--outfile", str(adapter)], check=True, capture_output=True)
    return base, adapter


class Engine:
    """One llama.cpp context for ``n_seq`` sequences of up to ``per_seq`` positions, 2 threads, optionally with a
    LoRA adapter (scale 1: peft's α/r is folded in by the conversion)."""

    def __init__(self, gguf: Path, n_seq: int, per_seq: int, adapter: Path | None, kv_f32: bool):
        import llama_cpp as L

        global _QUIET
        self.L = L
        if _QUIET is None:
            _QUIET = L.llama_log_callback(lambda level, text, user: None)
            L.llama_log_set(_QUIET, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = n_seq * per_seq
        cp.n_ubatch = min(cp.n_ctx, 2048)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = 2
        cp.no_perf = True
        if kv_f32:
            cp.type_k = cp.type_v = 0  # GGML_TYPE_F32, as torch's fp32 cache (default: f16)
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(cp.n_ctx, 0, 1)
        self.adapter = None
        if adapter is not None:
            self.adapter = L.llama_adapter_lora_init(self.model, str(adapter).encode())
            adapters = (L.llama_adapter_lora_p_ctypes * 1)(self.adapter)
            if L.llama_set_adapters_lora(self.ctx, adapters, 1, (ctypes.c_float * 1)(1.0)) != 0:
                raise RuntimeError(f"llama.cpp refused the adapter {adapter}")

    def close(self):
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        if self.adapter is not None:
            self.L.llama_adapter_lora_free(self.adapter)
        self.L.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """rows of (token, position, sequence, logits wanted) → the wanted rows' logits, [n wanted, vocab]."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want)
            b.seq_id[i][0] = seq
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        wanted = sum(r[3] for r in rows)
        return np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(wanted, self.n_vocab))

    def greedy(self, prompts: list[list[int]], new: int, times: list[float] | None = None) -> list[list[int]]:
        """Greedy continuation of each prompt (one sequence each), exactly ``new`` tokens; ``times`` gets the time
        after each new token's logits."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        logits = self._decode([(t, p, s, p == len(c) - 1) for s, c in enumerate(prompts) for p, t in enumerate(c)])
        out = [[t] for t in logits.argmax(-1).tolist()]
        if times is not None:
            times.append(time.perf_counter())
        for step in range(1, new):
            logits = self._decode([(out[s][-1], len(c) + step - 1, s, True) for s, c in enumerate(prompts)])
            for s, t in enumerate(logits.argmax(-1).tolist()):
                out[s].append(t)
            if times is not None:
                times.append(time.perf_counter())
        return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="llama.cpp's source tree (its convert_*.py), e.g. the sdist's vendor/llama.cpp")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/fedspear/llamacpp",
                        help="where the GGUF files go")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", type=int, default=16, help="ARC prompts whose greedy answers are compared")
    parser.add_argument("--torch", action="store_true", help="also time fedspear's torch decode, same process")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if not (args.llama_cpp / "convert_lora_to_gguf.py").exists():
        parser.error(f"{args.llama_cpp} holds no convert_lora_to_gguf.py: give llama.cpp's source tree")

    from decode_candidates import adapter_model, greedy_answers, step_weight_bytes

    from fedspear.experiments.bench import decode_tokens_per_s, machine, memory_bandwidth
    from fedspear.interaction import render
    from fedspear.tasks import arc_challenge

    model, tokenizer, dtype_used = adapter_model(args.model, args.dtype)
    outtype = {"fp32": "f32", "bf16": "bf16"}[dtype_used]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    base_gguf, adapter = convert(args.llama_cpp, args.work_dir, model, args.model, outtype)
    weight_bytes = step_weight_bytes(model)
    bandwidth = memory_bandwidth(256, 1.5)
    bound = lambda batch: batch * bandwidth / weight_bytes  # noqa: E731
    kv_f32 = dtype_used == "fp32"
    out = {"machine": machine(), "model": args.model, "dtype": dtype_used, "bandwidth_bytes_per_s": bandwidth,
           "weight_bytes": weight_bytes, "prompt": args.prompt, "new": args.new, "rates": {}, "check": {}}
    print(f"{out['machine']['kind']} · {args.model} · {dtype_used} · bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

    if args.check:
        items = arc_challenge.load("test")[: args.check]
        contexts = [render(tokenizer, [arc_challenge.prompt(e)]) for e in items]
        end = {tokenizer.eos_token_id, tokenizer.pad_token_id}

        def cut(seq):  # up to the end of turn: generate pads a finished row, llama.cpp goes on
            return next((seq[: i + 1] for i, t in enumerate(seq) if t in end), seq)

        reference = [cut(a) for a in greedy_answers(model, tokenizer, dtype_used, "eager", contexts, 16)]
        engine = Engine(base_gguf, len(contexts), max(map(len, contexts)) + 16, adapter, kv_f32)
        got = [cut(a) for a in engine.greedy(contexts, 16)]
        engine.close()
        same = sum(a == b for a, b in zip(got, reference))
        out["check"] = {"same": same, "of": len(contexts), "differ": [
            {"torch": tokenizer.decode(b), "llamacpp": tokenizer.decode(a)} for a, b in zip(got, reference) if a != b]}
        print(f"greedy answers, llama.cpp ({outtype}, adapter at run time) vs torch: {same} of {len(contexts)} "
              "identical", flush=True)

    rng = np.random.default_rng(0)
    for batch in args.batches:
        prompts = [rng.integers(100, 1000, args.prompt).tolist() for _ in range(batch)]
        for with_adapter in (True, False):
            engine = Engine(base_gguf, batch, args.prompt + args.new, adapter if with_adapter else None, kv_f32)
            runs = []
            for _ in range(args.repeats + 1):
                times: list[float] = []
                engine.greedy(prompts, args.new, times)
                runs.append(batch * (len(times) - 1) / (times[-1] - times[0]))
            engine.close()
            rate = statistics.median(runs[1:])
            key = f"llamacpp{'' if with_adapter else '-no-adapter'}/batch_{batch}"
            out["rates"][key] = {"tokens_per_s": rate, "runs": runs[1:], "utilisation": rate / bound(batch)}
            print(f"{key:28s} {rate:7.0f} tokens/s = {rate / bound(batch):.0%} of the bound", flush=True)
        if args.torch:
            runs = decode_tokens_per_s(model, tokenizer, dtype_used, batch, args.prompt, args.new,
                                       repeats=args.repeats)
            rate = statistics.median(runs)
            key = f"torch/batch_{batch}"
            out["rates"][key] = {"tokens_per_s": rate, "runs": runs, "utilisation": rate / bound(batch)}
            print(f"{key:28s} {rate:7.0f} tokens/s = {rate / bound(batch):.0%} of the bound", flush=True)
    if args.output:
        args.output.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
