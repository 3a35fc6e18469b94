"""``fedspear bench``: what this machine can do, what fedspear does with it, and full SPEAR rounds.

Three parts, each printed next to its bound as a utilisation ratio:

1. **Bounds** (a few seconds of micro-benchmarks): matrix-multiply FLOP/s in bf16 and fp32 (square matmuls with
   torch) and memory bandwidth (a large tensor copy: bytes read + bytes written per second).
2. **Throughputs** on the model: prefill tokens/s (one forward over a batch of prompts), decode tokens/s at batch
   1 / 8 / 32 (greedy, fixed length, KV cache), LoRA training tokens/s (forward + backward; 8 rows of 220 tokens
   on the CPU, 32 on a GPU: a paper-preset micro-step's wins and losses), central-evaluation items/s.
   Utilisation: achieved FLOP/s ÷ the matmul bound, counting the FLOPs the work needs (``prefill_flops``: 2 per
   weight per token, the LM head only where logits are kept, causal attention; training ≈ 2 × that, as
   frozen weights need activation gradients but no weight gradients — the issue's "≈ 4 × trainable-path
   parameters × tokens"); decode: tokens/s ÷ (batch × bandwidth ÷ bytes of the weights a step multiplies with),
   i.e. how close each decode step is to streaming the weights once.
3. **Three SPEAR rounds** through Flower's simulation engine on the issue's reference configuration
   (ARC-Challenge, 10 clients, 3 per round, 16 rollouts per client-round, up to 2 revisions, 16 new tokens, 2 local
   steps of batch 4, LoRA r16 on all layers), with seconds per phase and peak memory, read back from the run's
   ``metrics.jsonl``; the round with the median seconds per client-round is reported.

With a CUDA GPU (``device = auto`` or ``cuda``) the same three parts run on it: its matmul FLOP/s and memory
bandwidth, the model's throughputs against them, and the rounds with the model on the GPU.

Every result names its machine kind (:func:`machine_kind`, e.g. ``zen5-avx512bf16``) and fedspear's commit
(:func:`source_commit`), and is judged against issue 19's targets (:func:`targets`; the client-round against the
authors' code timed on the same machine kind, ``AUTHORS_REFERENCES``, or "no same-kind reference"); ``--results-dir``
files it under that name.

Figures are measurements of this machine at this moment: run it on an otherwise idle machine.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from transformers import LogitsProcessor

from ..config import RunConfig
from ..runtime.memory import release_memory, reset_peak
from ..runtime.model import autocast, model_device


def _amd_core(family: int, model: int) -> str | None:
    """AMD's core generation from ``/proc/cpuinfo``'s family and model, by the Linux kernel's table
    (``arch/x86/kernel/cpu/amd.c``, ``bsp_init_amd``); None for a model outside it."""
    ranges = {
        0x17: {"zen1": ((0x00, 0x2F), (0x50, 0x5F)), "zen2": ((0x30, 0x4F), (0x60, 0x7F), (0x90, 0x91), (0xA0, 0xAF))},
        0x19: {"zen3": ((0x00, 0x0F), (0x20, 0x5F)), "zen4": ((0x10, 0x1F), (0x60, 0xAF))},
        0x1A: {"zen5": ((0x00, 0x2F), (0x40, 0x4F), (0x60, 0x7F))},
    }
    for core, spans in ranges.get(family, {}).items():
        if any(low <= model <= high for low, high in spans):
            return core
    return None


def machine_kind(info: dict[str, Any]) -> str:
    """A short name for what decides fedspear's speed here — the core generation and the vector units torch can use —
    e.g. ``zen5-avx512bf16``, ``zen4-avx2`` (a Zen 4 whose AVX-512 the virtual machine hides: bf16 is emulated and
    ``auto`` picks fp32) or ``cuda-nvidia-a100-sxm4-40gb``; used in file names under ``docs/results/bench/``.

    ``info`` is :func:`machine`'s dict (``vendor``, ``family``, ``model_number``, ``flags``, ``gpu``).
    """
    if info.get("gpu"):
        return "cuda-" + "-".join("".join(c if c.isalnum() else " " for c in info["gpu"].lower()).split())
    flags = set(info.get("flags", ()))
    isa = ("avx512bf16" if "avx512_bf16" in flags else "avx512" if "avx512f" in flags
           else "avx2" if "avx2" in flags else (platform.machine() or "cpu").lower())
    family, model = info.get("family"), info.get("model_number")
    core = None
    if info.get("vendor") == "AuthenticAMD" and family is not None and model is not None:
        core = _amd_core(family, model)
    if core is None:
        vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(info.get("vendor") or "", "cpu")
        core = f"{vendor}-f{family}m{model}" if family is not None else vendor
    return f"{core}-{isa}"


def machine(gpu: bool = False) -> dict[str, Any]:
    """What the figures were measured on: CPU model, vendor, family and model number and its flags
    (``/proc/cpuinfo``), the CUDA GPU when ``gpu`` (the figures are the GPU's), threads torch uses, torch, fedspear's
    commit (:func:`source_commit`) and the ``kind`` (:func:`machine_kind`)."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                            "torch": torch.__version__}
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's block
            if not line.strip() and fields:
                break
            if ":" in line:
                key, value = line.split(":", 1)
                fields.setdefault(key.strip(), value.strip())
        info["cpu"] = f"{fields.get('model name', info['cpu'])} (family {fields.get('cpu family', '?')}, model " \
                      f"{fields.get('model', '?')})"
        info["vendor"] = fields.get("vendor_id")
        if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
            info["family"], info["model_number"] = int(fields["cpu family"]), int(fields["model"])
        flags = fields.get("flags", "").split()
        info["avx512_bf16"] = "avx512_bf16" in flags
        info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    if gpu:
        info["gpu"] = torch.cuda.get_device_name(0)
    info["kind"] = machine_kind(info)
    info["fedspear_commit"] = source_commit()
    return info


UNKNOWN_COMMIT = "unknown (installed package)"


def source_commit(package: Path | None = None) -> str:
    """fedspear's own commit: that of the git checkout its source lies in, with ``+changes`` appended when the
    package's tracked files differ from it; ``UNKNOWN_COMMIT`` when the package is not in such a checkout.

    ``package`` is the ``fedspear`` package folder (this one by default). A checkout counts only when its top level
    holds this very folder as ``src/fedspear`` and tracks it: a copy of the source inside another repository (the
    2026-11-27 GPU run started from one) would otherwise report that repository's commit. Installed from a wheel, or
    copied without ``.git``, it is unknown.
    """
    import subprocess

    package = (package or Path(__file__).resolve().parents[1]).resolve()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() / "src" / "fedspear" != package:
            return UNKNOWN_COMMIT
        if git("ls-files", "--error-unmatch", "--", "__init__.py").returncode != 0:
            return UNKNOWN_COMMIT
        commit = git("rev-parse", "--short", "HEAD")
        if commit.returncode != 0:
            return UNKNOWN_COMMIT
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".")
        return commit.stdout.strip() + ("+changes" if changed.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN_COMMIT


def _sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a CUDA GPU runs asynchronously; the CPU needs nothing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, min_seconds: float, device: torch.device | str = "cpu") -> tuple[float, int]:
    """Run ``fn`` once to warm up, then repeatedly for at least ``min_seconds`` → (seconds per call, calls); on a
    GPU each call is waited for."""
    fn()
    _sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        _sync(device)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls, calls


def matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0, device: str = "cpu") -> float:
    """Dense matmul FLOP/s for ``n × n`` operands of ``dtype`` on ``device`` (2n³ FLOPs per product)."""
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    per_call, _ = _timed(lambda: torch.mm(a, b), seconds, device)
    return 2 * n**3 / per_call


def memory_bandwidth(megabytes: int = 256, seconds: float = 1.0, device: str = "cpu") -> float:
    """Bytes/s of a large float32 tensor copy on ``device`` (each byte counted once read, once written)."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    per_call, _ = _timed(lambda: dst.copy_(src), seconds, device)
    return 2 * n * 4 / per_call


def flop_counts(model) -> dict[str, int]:
    """Parameter counts that set the FLOPs of one token (embedding lookups cost none).

    Returns ``{"body": …, "head": …, "lora": …, "layers": …, "width": …}``: ``body`` = every frozen parameter but the
    input and output embeddings (the transformer blocks), ``head`` = the LM head's weights (run only where logits are
    kept), ``lora`` = the adapters' trainable parameters, ``layers`` / ``width`` for the attention term.
    """
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    head = out.numel()
    body = total - lora - inp.numel() - (head if out is not inp else 0)
    config = model.config
    return {"body": body, "head": head, "lora": lora, "layers": config.num_hidden_layers, "width": config.hidden_size}


def prefill_flops(counts: dict[str, int], batch: int, length: int, kept: int = 1) -> float:
    """FLOPs of one forward over ``batch × length`` tokens with logits kept for the last ``kept`` positions:
    2 per weight per token (body and LoRA), 2 per head weight per kept position, and causal attention
    (QKᵀ and PV: 2 · 2 · width per attended position, on average ``length / 2`` of them, per layer)."""
    tokens = batch * length
    attention = 2 * counts["layers"] * counts["width"] * length * tokens  # 4 · width · length/2 per token per layer
    return 2 * (counts["body"] + counts["lora"]) * tokens + 2 * counts["head"] * batch * kept + attention


def train_flops(counts: dict[str, int], batch: int, length: int, kept: int) -> float:
    """FLOPs of forward + backward: the forward of :func:`prefill_flops`, its activation gradients (as much again),
    and weight gradients for the LoRA parameters only (2 per trainable weight per token); frozen weights get none."""
    return 2 * prefill_flops(counts, batch, length, kept) + 2 * counts["lora"] * batch * length


@torch.no_grad()
def prefill_tokens_per_s(model, dtype_used: str, batch: int, length: int, seconds: float) -> float:
    """One forward over ``batch × length`` random tokens, logits at the last position → tokens/s."""
    device = model_device(model)
    ids = torch.randint(100, 1000, (batch, length), device=device)
    model.eval()

    def run():
        with autocast(dtype_used, device.type):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    per_call, _ = _timed(run, seconds, device)
    return batch * length / per_call


class StepClock(LogitsProcessor):
    """A logits processor (for ``generate``'s ``logits_processor`` list) that only notes the time: ``generate``
    calls it once per new token, right after that token's forward, so the first and last marks span the decode
    steps alone (the prefill's forward comes before the first call; merging an adapter, tokenising and the like come
    before or after).

    On the CPU a mark is ``time.perf_counter()`` (``times``). On a CUDA GPU it is a CUDA event recorded on the
    current stream (``events``), which the host does not wait for: the span is the GPU's own timeline from the
    first step's logits to the last's, so a step costs what it costs in a run, where the host prepares the next
    step while the GPU computes this one (``runtime.compiled``, "Stop checks"). Waiting for the GPU at every mark,
    as this clock did until 2026-12-07, made host and GPU take turns: a step then cost the host's time plus the
    GPU's (the H200's figures of 2026-11-28 were taken that way).

    Subtracting a 1-token ``generate`` call's time from a ``new``-token one (the bench's method until 2026-11-26)
    mixes two prefills of several seconds into a decode of a few seconds: two runs of the same decode differed by up
    to 1.7× on one machine.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.times: list[float] = []  # CPU: perf_counter seconds, one per new token
        self.events: list = []  # CUDA: one torch.cuda.Event per new token

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.times.append(time.perf_counter())
        return scores

    def marks(self) -> int:
        """How many new tokens were marked."""
        return len(self.events) or len(self.times)

    def seconds(self) -> float:
        """Seconds from the first mark to the last (on a GPU, waits for the last event); nan with fewer than 2."""
        if self.marks() < 2:
            return float("nan")
        if self.events:
            self.events[-1].synchronize()
            return self.events[0].elapsed_time(self.events[-1]) / 1e3
        return self.times[-1] - self.times[0]

    def tokens_per_s(self, batch: int) -> float:
        """Decode tokens per second over the steps after the first (``batch`` rows each); nan with fewer than 2."""
        if self.marks() < 2:
            return float("nan")
        return batch * (self.marks() - 1) / max(1e-9, self.seconds())


def decode_cache(model, cache: str, capacity: int) -> dict:
    """``generate``'s cache keyword for ``cache``: ``{"past_key_values": ...}`` with fedspear generation's KV cache
    written in place for up to ``capacity`` positions (``"fedspear"``, ``cpu_kernels.preallocated_cache``; empty when
    the model's attention needs transformers' own), or nothing: transformers' default (``"transformers"``).

    Raises:
        ValueError: another ``cache``.
    """
    from ..runtime.cpu_kernels import preallocated_cache

    if cache not in ("fedspear", "transformers"):
        raise ValueError(f"cache must be 'fedspear' or 'transformers' (got {cache!r})")
    kv = preallocated_cache(model, capacity) if cache == "fedspear" else None
    return {"past_key_values": kv} if kv is not None else {}


@torch.no_grad()
def decode_tokens_per_s(model, tokenizer, dtype_used: str, batch: int, prompt: int, new: int, repeats: int = 3,
                        merge: bool | None = None, cache: str = "fedspear", per_call: Callable[[], dict] | None = None,
                        first_call: list[float] | None = None, run: Callable | None = None,
                        **generate_kwargs) -> list[float]:
    """Greedy decoding of exactly ``new`` tokens per row after a ``prompt``-token prefill, timed step by step
    (``StepClock``: the prefill excluded): decode tokens/s of each of ``repeats`` calls after a warm-up call. No
    end-of-sequence token stops a row (``eos_token_id=None``; until 2026-12-07 ``min_new_tokens``, whose logits
    processor masks the EOS column of every row's scores at every step, work a run's decode does not do: 1.6 ms a
    step at batch 32 over SmolLM2's vocabulary on the Zen 4 CPU, 4.9 ms over Qwen2.5's). The
    adapter is merged into the weights when fedspear's generation would merge it (``merges_adapter``) unless
    ``merge`` says otherwise; the KV cache is fedspear generation's (``cache = "fedspear"``: written in place,
    ``cpu_kernels.preallocated_cache``) or transformers' default (``"transformers"``); ``generate_kwargs`` go to
    ``generate`` (e.g. a static cache, with ``cache = "transformers"``); ``per_call()``, when given, returns more of
    them afresh for every call (a compiled decode's zeroed static cache: ``CompiledDecode.generate_kwargs``).
    ``first_call``, when given, gets the warm-up call's wall seconds appended (a compiled step's compilation).
    ``run(call)``, when given, makes every call (a compiled decode's ``CompiledDecode.decode``).

    Raises:
        ValueError: ``new`` < 2 (no decode step to time).
    """
    from transformers import LogitsProcessorList

    from ..runtime.cpu_kernels import decoding
    from ..runtime.generation import merges_adapter
    from ..runtime.model import merged_adapter

    if new < 2:
        raise ValueError(f"decode needs at least 2 new tokens to time a step (got {new})")
    device = model_device(model)
    ids = torch.randint(100, 1000, (batch, prompt), device=device)
    model.eval()
    merge = merges_adapter(model, dtype_used) if merge is None else merge
    rates = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        clock = StepClock(device)

        def call():
            extra = dict(generate_kwargs, **decode_cache(model, cache, prompt + new),
                         **(per_call() if per_call else {}))
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  eos_token_id=None, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                  use_cache=True, logits_processor=LogitsProcessorList([clock]), **extra)
        with autocast(dtype_used, device.type), merged_adapter(model, enabled=merge), decoding():
            run(call) if run else call()
        rates.append(clock.tokens_per_s(batch))
        if i == 0 and first_call is not None:
            first_call.append(time.perf_counter() - start)
    return rates[1:]


def timed_decode(model, tokenizer, dtype_used: str, batch: int, prompt: int, new: int,
                 repeats: int) -> tuple[float, list[float]]:
    """``decode_tokens_per_s`` the way ``model`` decodes in a round: through its compiled step (a zeroed static
    cache per call, no merging, a warm bucket's guards skipped as in a round) where it has one
    (``runtime.compiled.use_compiled_decode``), else eagerly → (the warm-up call's wall seconds, decode tokens/s of
    each of the ``repeats`` calls after it)."""
    from ..runtime.compiled import compiled_decode

    compiled, first = compiled_decode(model), []
    timing = {} if compiled is None else dict(
        merge=False, cache="transformers", per_call=lambda: compiled.generate_kwargs(model, batch, prompt + new),
        run=lambda call: compiled.decode(model, batch, prompt + new, dtype_used, call, steps=lambda _: new - 1))
    runs = decode_tokens_per_s(model, tokenizer, dtype_used, batch, prompt, new, repeats=repeats, first_call=first,
                               **timing)
    return first[0], runs


def train_tokens_per_s(model, dtype_used: str, batch: int, length: int, seconds: float, kept: int = 16) -> float:
    """Forward + backward over ``batch × length`` tokens with logits for the last ``kept`` positions (the completion
    window of a SPEAR batch); LoRA parameters only get gradients. Dropout as configured (training mode). The forward
    is the one training runs (``runtime.compiled_training.training_forward``: compiled where
    ``use_compiled_training`` turned it on; its first call, the compilation, is the untimed warm-up)."""
    device = model_device(model)
    ids = torch.randint(100, 1000, (batch, length), device=device)
    model.train()
    per_call, _ = _timed(lambda: _train_step(model, ids, dtype_used, kept), seconds, device)
    model.eval()
    return batch * length / per_call


def _train_step(model, ids: torch.Tensor, dtype_used: str, kept: int) -> None:
    """One forward + backward of ``train_tokens_per_s`` over ``ids`` ``[B, L]`` (the model in training mode), its
    gradients dropped."""
    from ..runtime.compiled_training import training_forward

    with autocast(dtype_used, ids.device.type):
        logits = training_forward(model)(input_ids=ids, use_cache=False, logits_to_keep=kept).logits
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)


def _compiled_train_rate(model, dtype_used: str, setting: str, batch: int, length: int, seconds: float, kept: int,
                         flops_per_token: float, peak: float, say: Callable[[str], None]) -> dict[str, Any]:
    """LoRA training throughput with the forward and backward compiled (``compile_training``,
    ``runtime.compiled_training``) where ``setting`` is on: as ``train_tokens_per_s``, with the first micro-step
    (the compilation) timed apart → ``{"tokens_per_s", "flops", "utilisation", "first_call_seconds"}``; {} where it
    is off. The model trains eagerly again afterwards."""
    from ..runtime.compiled_training import use_compiled_training

    if not use_compiled_training(model, setting):
        return {}
    say("training throughput, compiled")
    device = model_device(model)
    try:
        model.train()
        _sync(device)
        start = time.perf_counter()
        _train_step(model, torch.randint(100, 1000, (batch, length), device=device), dtype_used, kept)
        _sync(device)
        first = time.perf_counter() - start
        rate = train_tokens_per_s(model, dtype_used, batch, length, seconds, kept)
    finally:
        use_compiled_training(model, "off")
        model.eval()
    return {"tokens_per_s": rate, "flops": rate * flops_per_token, "utilisation": rate * flops_per_token / peak,
            "first_call_seconds": first}


def run_bench(model: str = "smollm2-135m", dtype: str = "auto", quick: bool = False, round_: bool = True,
              output_dir: str | None = None, progress: Callable[[str], None] | None = None,
              device: str = "auto", gradient_checkpointing: str = "auto",
              compile_decode: str = "auto", compile_training: str = "off") -> dict[str, Any]:
    """Measure everything (see the module docstring) → a JSON-able dict.

    ``quick`` shrinks every size (for tests); ``round_=False`` skips the SPEAR round. ``progress(text)`` is called
    before each measurement and after each SPEAR round. ``device`` (auto | cpu | cuda): where the bounds, the
    throughputs and the rounds are measured (``auto``: a CUDA GPU when torch sees one). ``gradient_checkpointing``
    (auto | on | off, as in ``RunConfig``) applies to the training throughput and the rounds: it trades training
    time for the memory of the activations. ``compile_decode`` (auto | on | off, as in ``RunConfig``): where it
    compiles (``auto``: on a GPU, as runs do), decode is timed a second time through the step compiled once per
    process (``runtime.compiled``) → ``throughput["decode_compiled"]``, each batch with its first call's seconds
    (the compilation for that batch's bucket) beside the timed ones. ``compile_training`` (on | off, as in
    ``RunConfig``): on, training is timed a second time with the forward and backward compiled
    (``runtime.compiled_training``) → ``throughput["train_compiled"]``, with its first micro-step's seconds.

    Raises:
        ModelError: the model cannot be loaded, or ``device = cuda`` without a GPU.
        ValueError: ``compile_decode`` is not auto, on or off, or ``compile_training`` not on or off.
    """
    say = progress or (lambda text: None)
    from ..evaluation import evaluate
    from ..runtime.compiled import compiles_decode
    from ..runtime.compiled_training import check_setting
    from ..runtime.model import LoraSettings, add_lora, load_base, resolve_device, use_gradient_checkpointing
    from ..tasks import arc_challenge

    s = 0.2 if quick else 1.5  # seconds per micro-benchmark
    where = resolve_device(device)
    compiles_decode(compile_decode, torch.device(where))  # a bad setting fails here, before any measurement
    check_setting(compile_training)
    out: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(gpu=where == "cuda"),
        "model": model,
        "device": where,
    }
    gpu = where == "cuda"
    say(f"this machine's bounds on the {where.upper()} (matmul bf16 / fp32, memory bandwidth)")
    n = (1024 if quick else 8192) if gpu else (256 if quick else 1024)  # a GPU needs large products to fill up
    bounds = {
        "matmul_flops_bf16": matmul_flops(torch.bfloat16, n, s, where),
        "matmul_flops_fp32": matmul_flops(torch.float32, n, s, where),
        "memory_bandwidth_bytes_per_s": memory_bandwidth((256 if quick else 2048) if gpu else (16 if quick else 256),
                                                         s, where),
    }
    out["bounds"] = bounds
    base, tokenizer, dtype_used = load_base(model, dtype, where)
    out["gradient_checkpointing_setting"] = gradient_checkpointing
    out["gradient_checkpointing"] = use_gradient_checkpointing(base, gradient_checkpointing)
    peft = add_lora(base, LoraSettings())
    out["dtype"] = dtype_used
    counts = flop_counts(peft)
    # bytes a decode step must read: every weight it multiplies with (body, LM head, adapters), as stored
    lookup_only = peft.get_input_embeddings().weight  # read a row per token, unless it doubles as the LM head
    if lookup_only is peft.get_output_embeddings().weight:
        lookup_only = None
    weight_bytes = sum(p.numel() * p.element_size() for p in peft.parameters() if p is not lookup_only)
    peak = bounds["matmul_flops_bf16" if dtype_used == "bf16" else "matmul_flops_fp32"]
    out["flop_counts"] = counts
    out["weight_bytes_per_decode_step"] = weight_bytes
    # prefill and training at a SPEAR micro-step's rows: on a GPU 2 × a paper-preset batch of 16 (wins and losses
    # in one forward); on the CPU 8, as measured since issue 19
    batch, length, kept = (2 if quick else (32 if gpu else 8)), (32 if quick else 220), 16
    say(f"prefill and training throughput ({model}, {dtype_used})")
    prefill = prefill_tokens_per_s(peft, dtype_used, batch, length, s)
    train = train_tokens_per_s(peft, dtype_used, batch, length, s, kept)
    prefill_flop_s = prefill * prefill_flops(counts, batch, length) / (batch * length)
    train_per_token = train_flops(counts, batch, length, kept) / (batch * length)
    train_flop_s = train * train_per_token
    train_compiled = _compiled_train_rate(peft, dtype_used, compile_training, batch, length, s, kept,
                                          train_per_token, peak, say)
    decode = {}
    for b in (1, 8, 32):
        say(f"decode at batch {b}")
        runs = decode_tokens_per_s(peft, tokenizer, dtype_used, b, 16 if quick else 200, 4 if quick else 32,
                                   repeats=1 if quick else 3)
        tps = statistics.median(runs)
        bound = b * bounds["memory_bandwidth_bytes_per_s"] / weight_bytes
        decode[f"batch_{b}"] = {"tokens_per_s": tps, "runs": runs, "bound_tokens_per_s": bound,
                                "utilisation": tps / bound}
    decode_compiled = _compiled_decode_rates(peft, tokenizer, dtype_used, compile_decode, where, quick, bounds,
                                             weight_bytes, say)
    items = arc_challenge.load("test")[: 8 if quick else 64]
    say(f"evaluation of {len(items)} ARC-Challenge items")
    t0 = time.perf_counter()
    evaluate(peft, tokenizer, items, arc_challenge, dtype_used=dtype_used)
    eval_items = len(items) / (time.perf_counter() - t0)
    out["throughput"] = {
        "prefill": {"tokens_per_s": prefill, "flops": prefill_flop_s, "utilisation": prefill_flop_s / peak,
                    "batch": batch, "length": length},
        "train": {"tokens_per_s": train, "flops": train_flop_s, "utilisation": train_flop_s / peak,
                  "batch": batch, "length": length, "logits_kept": kept},
        **({"train_compiled": train_compiled} if train_compiled else {}),
        "decode": decode,
        **({"decode_compiled": decode_compiled} if decode_compiled else {}),
        "evaluate": {"items_per_s": eval_items},
    }
    out["compile_decode"] = compile_decode
    out["compile_training"] = compile_training
    del peft, base
    if round_:
        # the rounds' server runs in this process: its peak should be the server's, not the throughputs' above
        release_memory()
        reset_peak()
        out["round"] = spear_round(model, dtype, quick, output_dir, progress=say, device=where,
                                   gradient_checkpointing=gradient_checkpointing)
    return out


def _compiled_decode_rates(model, tokenizer, dtype_used: str, setting: str, where: str, quick: bool,
                           bounds: dict, weight_bytes: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Decode at batch 1 / 8 / 32 through the compiled step where ``setting`` compiles on ``where``
    (``compiled.compiles_decode``), as ``run_bench``'s eager decode but with a zeroed static cache per call; {} where
    it does not compile. The model decodes eagerly again afterwards."""
    from ..runtime.compiled import compiles_decode, use_compiled_decode

    if not compiles_decode(setting, torch.device(where)):
        return {}
    use_compiled_decode(model, setting)
    prompt, new = (16, 4) if quick else (200, 32)
    out = {}
    try:
        for b in (1, 8, 32):
            say(f"decode at batch {b}, compiled")
            first, runs = timed_decode(model, tokenizer, dtype_used, b, prompt, new, repeats=1 if quick else 3)
            tps = statistics.median(runs)
            bound = b * bounds["memory_bandwidth_bytes_per_s"] / weight_bytes
            out[f"batch_{b}"] = {"tokens_per_s": tps, "runs": runs, "bound_tokens_per_s": bound,
                                 "utilisation": tps / bound, "first_call_seconds": first}
    finally:
        use_compiled_decode(model, "off")
    return out


def spear_round(model: str, dtype: str, quick: bool, output_dir: str | None, rounds: int = 3,
                progress: Callable[[str], None] | None = None, device: str = "cpu",
                gradient_checkpointing: str = "auto") -> dict[str, Any]:
    """SPEAR rounds on the reference configuration through the simulation engine; seconds per phase.

    Runs ``rounds`` rounds (evaluation only at round 0 and after the last, and subtracted) and reports the round with
    the median seconds per client-round — the issue's "median of 3" — next to every round's figure. The first round
    also pays the one-time start of the client actor and its model load (in its Flower overhead).
    """

    from ..fl.simulation import simulate
    from ..rundir import RunDir, training_seconds

    out_dir = output_dir or tempfile.mkdtemp(prefix="fedspear-bench-")
    cfg = RunConfig(
        task="arc_challenge", model=model, dtype=dtype, device=device, rounds=rounds,
        num_clients=10 if not quick else 2,
        clients_per_round=3 if not quick else 1, rollouts_per_round=16 if not quick else 2, max_revisions=2,
        max_new_tokens=16 if not quick else 4, local_steps=2, batch_size=4, eval_size=100 if not quick else 4,
        eval_every=rounds, eval_generation=True, output_dir=str(Path(out_dir) / "run"),
        gradient_checkpointing=gradient_checkpointing,
    )
    t0 = time.perf_counter()
    if progress:
        progress(f"{rounds} SPEAR rounds on the reference configuration (simulation, round 0 = evaluation)")
    simulate(cfg, on_round=(lambda r: progress(f"round {r['round']} of {rounds} done ({r['wall_clock']:.0f} s so far)"))
             if progress else None)
    wall = time.perf_counter() - t0
    all_records = RunDir(cfg.output_dir).records()
    records = all_records[1:]

    def per_client_round(r: dict) -> float:
        return training_seconds(r) / max(1, r["clients_ok"])

    each = [per_client_round(r) for r in records]
    median = statistics.median_low(each)
    r1 = records[each.index(median)]
    sec = r1["seconds"]
    per_client = {k: sec[k] / max(1, r1["clients_ok"]) for k in ("generate_initial", "generate_revisions", "train")}
    round_wo_eval = training_seconds(r1)
    return {
        "config": {k: getattr(cfg, k) for k in ("num_clients", "clients_per_round", "rollouts_per_round",
                                                "max_revisions", "max_new_tokens", "local_steps", "batch_size")},
        "rounds": len(records),
        "median_round": r1["round"],
        "seconds": sec,
        "seconds_per_client_round": median,
        "seconds_per_client_round_each": each,
        "seconds_per_client_phase": per_client,
        "flower_overhead_share": sec["flower_overhead"] / max(1e-9, round_wo_eval),
        "flower_overhead_share_each": [r["seconds"]["flower_overhead"] / max(1e-9, training_seconds(r))
                                       for r in records],
        "peak_rss_mb": records[-1]["peak_rss_mb"],
        # the sums over the process tree (server, Ray, client actor), the largest of any round (round 0 included)
        "peak_tree_mb": {key: max((r.get("peak_tree_mb", {}).get(key, 0.0) for r in all_records), default=0.0)
                         for key in ("rss", "pss")},
        "rss_after_round_mb": records[-1].get("rss_after_round_mb", {}),
        "wall_seconds_including_startup": wall,
        "counters": {k: r1[k] for k in ("prompts", "wins", "losses", "revisions_attempted", "revisions_successful",
                                        "tokens_generated")},
    }


SCALING_AXES = {  # the reference configuration's value is the middle one
    "rollouts_per_round": [8, 16, 32],
    "max_revisions": [0, 1, 2, 3],
    "max_new_tokens": [8, 16, 32],
    "clients_per_round": [1, 3, 5],
}
QUICK_SCALING_AXES = {"rollouts_per_round": [1, 2], "max_revisions": [0, 1], "max_new_tokens": [2, 4],
                      "clients_per_round": [1, 2]}


def scaling(model: str = "smollm2-135m", dtype: str = "auto", quick: bool = False,
            output_dir: str | None = None, progress=None, device: str = "auto") -> dict[str, Any]:
    """How a round's cost grows with rollouts, revisions, new tokens and clients (docs/performance.md).

    Rollouts, revisions and new tokens change one client-round: each size runs the SPEAR client round
    (``Worker.round``, the model loaded once) for clients 0, 1, 2 of the reference configuration at round 1 and
    reports the median seconds per phase. Clients per round change the round itself: each size runs two rounds
    through Flower's simulation engine and reports round 2 (round 1 pays the actor's start). ``quick`` shrinks
    every size (for tests). ``progress(text)`` is called before each measurement.

    Returns:
        ``{"reference": {…}, "axes": {axis: [{"value": v, "seconds": {phase: s}, "counters": {…}}, …]}}``.
    """
    import dataclasses

    from ..fl.simulation import simulate
    from ..runtime.model import get_adapter, resolve_device
    from ..rundir import RunDir, training_seconds
    from ..worker import Worker

    axes = QUICK_SCALING_AXES if quick else SCALING_AXES
    where = resolve_device(device)
    ref = dict(task="arc_challenge", model=model, dtype=dtype, device=where, num_clients=10 if not quick else 2,
               clients_per_round=3 if not quick else 1, rollouts_per_round=16 if not quick else 2, max_revisions=2,
               max_new_tokens=16 if not quick else 4, local_steps=2, batch_size=4)
    out: dict[str, Any] = {"date": _dt.datetime.now().isoformat(timespec="seconds"),
                           "machine": machine(gpu=where == "cuda"), "reference": ref, "axes": {}}
    worker = Worker.load(RunConfig(**ref, rounds=1))
    cfg = worker.loaded  # resolved: the task's defaults filled in
    out["dtype"] = worker.dtype_used
    identity = get_adapter(worker.model)
    parts = np.array_split(np.arange(len(worker.examples)), cfg.num_clients)
    phases = ("generate_initial", "generate_revisions", "train")
    for axis, values in axes.items():
        if axis == "clients_per_round":
            continue
        rows = []
        for value in values:
            if progress:
                progress(f"{axis} = {value}")
            varied = dataclasses.replace(cfg, **{axis: value})
            per_client = []
            for pid in range(min(3, cfg.num_clients)):
                t0 = time.perf_counter()
                _, metrics = worker.round(varied, identity, [int(i) for i in parts[pid]], pid, 1, cfg.lr)
                per_client.append({**{k: metrics[f"seconds_{k}"] for k in phases},
                                   "client_round": time.perf_counter() - t0,
                                   "tokens_generated": metrics["tokens_generated"],
                                   "revisions_attempted": metrics["revisions_attempted"]})
            rows.append({"value": value, "seconds": {k: statistics.median(c[k] for c in per_client)
                                                     for k in (*phases, "client_round")},
                         "counters": {k: statistics.median(c[k] for c in per_client)
                                      for k in ("tokens_generated", "revisions_attempted")}})
        out["axes"][axis] = rows
    del worker
    release_memory(full=True)  # its model, frozen with the survivors of its rounds, before the simulations below
    base_dir = Path(output_dir or tempfile.mkdtemp(prefix="fedspear-scaling-"))
    rows = []
    for value in axes["clients_per_round"]:
        if progress:
            progress(f"clients_per_round = {value} (simulation)")
        run_cfg = RunConfig(**{**ref, "clients_per_round": value}, rounds=2, eval_every=2,
                            eval_size=4, eval_generation=False, output_dir=str(base_dir / f"clients-{value}"))
        simulate(run_cfg)
        r2 = RunDir(run_cfg.output_dir).records()[-1]
        sec = r2["seconds"]
        rows.append({"value": value, "seconds": {**{k: sec[k] for k in (*phases, "aggregate", "flower_overhead")},
                                                 "round": training_seconds(r2)},
                     "counters": {"tokens_generated": r2["tokens_generated"],
                                  "revisions_attempted": r2["revisions_attempted"]}})
    out["axes"]["clients_per_round"] = rows
    return out


def render_scaling(result: dict[str, Any]) -> str:
    """Markdown tables of :func:`scaling`'s result (one per axis)."""
    m = result.get("machine", {})
    lines = [f"# fedspear bench --scaling — {result['reference']['model']}, {result.get('date', '')}", "",
             f"Machine kind: **{m.get('kind', '?')}** — {m.get('cpu', '?')}, {m.get('threads', '?')} threads, torch "
             f"{m.get('torch', '?')}"
             + (f", fedspear {m['fedspear_commit']}" if m.get("fedspear_commit") else "") + ".",
             *([f"Command: `{result['command']}`"] if result.get("command") else []), "",
             f"Reference: {json.dumps(result['reference'])}", ""]
    for axis, rows in result["axes"].items():
        cols = list(rows[0]["seconds"])
        unit = "seconds per round (round 2)" if axis == "clients_per_round" else \
            "seconds per client-round (median of 3 clients)"
        lines += [f"**{axis}** — {unit}", "",
                  f"| {axis} | " + " | ".join(c.replace("_", " ") for c in cols) + " | tokens generated | "
                  "revision contexts |",
                  "|" + "---|" * (len(cols) + 3)]
        for row in rows:
            lines.append(f"| {row['value']} | " + " | ".join(f"{row['seconds'][c]:.1f}" for c in cols)
                         + f" | {row['counters']['tokens_generated']:.0f} | "
                           f"{row['counters']['revisions_attempted']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot_scaling(result: dict[str, Any], path: Path) -> Path:
    """One panel per axis: seconds per phase (stacked) against the axis value; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = result["axes"]
    fig, panels = plt.subplots(1, len(axes), figsize=(4 * len(axes), 3.4))
    for ax, (axis, rows) in zip(np.atleast_1d(panels), axes.items()):
        xs = [r["value"] for r in rows]
        bottom = np.zeros(len(rows))
        for phase in ("generate_initial", "generate_revisions", "train"):
            ys = np.array([r["seconds"][phase] for r in rows])
            ax.bar([str(x) for x in xs], ys, bottom=bottom, label=phase.replace("_", " "))
            bottom += ys
        ax.set_xlabel(axis.replace("_", " "))
        ax.set_ylabel("seconds per round" if axis == "clients_per_round" else "seconds per client-round")
        ax.grid(axis="y", alpha=0.3)
    np.atleast_1d(panels)[0].legend(fontsize=8)
    fig.suptitle(f"How a SPEAR round's cost grows ({result['reference']['model']}, this machine)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def result_stem(result: dict[str, Any], scaling: bool = False) -> str:
    """File stem for a result under ``docs/results/bench/``: ``<machine kind>-<model>-<dtype>[-scaling]``, e.g.
    ``zen5-avx512bf16-smollm2-135m-bf16`` (the model's last path component when it is a folder or hub id), with
    ``-checkpointing`` when gradient checkpointing was forced on."""
    model = str(result.get("model") or result.get("reference", {}).get("model", "model")).rstrip("/").split("/")[-1]
    dtype = result.get("dtype") or result.get("reference", {}).get("dtype", "auto")
    checkpointing = "-checkpointing" if result.get("gradient_checkpointing_setting") == "on" else ""
    kind = result["machine"].get("kind", "unknown")
    return f"{kind}-{model}-{dtype}{checkpointing}" + ("-scaling" if scaling else "")


# The SPEAR authors' code (github.com/lee3296/SPEAR at 16be04c; no licence, so compared by figures only) timed on the
# performance reference configuration (issue 19: ARC-Challenge, SmolLM2-135M fp32, 10 clients, 3 per round, 3 rounds,
# 16 rollouts, N = 2, 16 new tokens, 2 local steps of 4 + 4, LoRA r16 on all seven projections, their gradient
# checkpointing, 2 threads, fp32: their CPU path has no bf16), seconds per client-round, per machine kind
# (:func:`machine_kind`), each measured back to back with fedspear on one machine of that kind (a kind measured on
# several machines lists the others under ``other_machines``). Source: the project's reference-timing notes of
# 2026-11-25 / 2026-11-27 / 2026-12-01 / 2026-12-02 / 2026-12-05 / 2026-12-06 (issue 40 item 6). A ratio is given
# only against the references of the kind measured: one kind's figure divided by another's compares two machines, not
# two programs.
AUTHORS_REFERENCES: dict[str, dict[str, Any]] = {
    "zen4-avx2": {
        "machine": "2-core AMD EPYC Zen 4, AVX2 only (no AVX-512, no bf16 units)", "date": "2026-11-25",
        "seconds_per_client_round": 66.5,  # median of rounds 1/2/3: 69.3 / 66.5 / 61.8
        "fedspear_same_machine": "fp32 49.5 s per client-round (2df42ef): 0.74 ×",
    },
    "intel-f6m167-avx512bf16": {
        "machine": "Intel Xeon (family 6, model 167), AVX-512 BF16 + AMX", "date": "2026-11-27",
        "seconds_per_client_round": 41.1,  # mean of two runs' medians: A 40.7/39.1/39.5 (39.5), B 46.5/42.0/42.7 (42.7)
        "fedspear_same_machine": "fp32 34.4 s (0.84 ×), bf16 30.4 s (0.74 ×) per client-round (ea2bbe6)",
        "other_machines": [{
            "date": "2026-12-06",
            "seconds_per_client_round": 38.8,  # mean of three runs' medians: 42.0/45.8/41.5 (42.0), 37.7/38.9/37.5
                                               # (37.7), 35.6/39.4/36.6 (36.6)
            "fedspear_same_machine": "bf16 25.1 / 21.2 s (0.65 / 0.55 ×), fp32 23.6 / 25.1 s (0.61 / 0.65 ×) per "
                                     "client-round (fad7a06)",
        }],
    },
    "intel-f6m106-avx512": {
        "machine": "2-core Intel Xeon (family 6, model 106), AVX-512 without BF16 or AMX (fp32)", "date": "2026-12-01",
        "seconds_per_client_round": 72.6,  # mean of two runs' medians: A 62.1/75.2/67.9 (67.9), B 77.5/77.4/65.9 (77.4)
        "fedspear_same_machine": "fp32 46.0 s per client-round (7b5ba43): 0.63 ×",
    },
    "zen4-avx512bf16": {
        "machine": "2-core AMD EPYC Zen 4 (family 25, model 17), AVX-512 BF16", "date": "2026-12-02",
        "seconds_per_client_round": 65.6,  # mean of two runs' medians: A 70.5/64.6/64.4 (64.6), B 70.5/64.4/66.6 (66.6)
        "fedspear_same_machine": "bf16 39.3 s (0.60 ×), fp32 50.7 s (0.77 ×) per client-round (9cdd9c4)",
        # another machine of this kind, 20% faster for the authors' code: one kind's machines differ (_round_row)
        "other_machines": [{
            "date": "2026-12-05",
            "seconds_per_client_round": 52.4,  # mean of three runs' medians: 49.4/55.9/53.0 (53.0), 49.1/58.1/52.5
                                               # (52.5), 48.6/54.5/51.6 (51.6)
            "fedspear_same_machine": "bf16 24.0 / 23.8 s (0.46 ×, a495836); 26.3 / 27.3 / 27.5 / 28.3 s (0.50–0.54 ×, "
                                     "83d862d)",
        }],
    },
    "zen5-avx512bf16": {
        "machine": "2-core AMD EPYC Zen 5 (family 26, model 2), AVX-512 BF16", "date": "2026-12-02",
        "seconds_per_client_round": 42.2,  # mean of two runs' medians: A 42.5/45.5/42.4 (42.5), B 42.3/41.8/39.3 (41.8)
        "fedspear_same_machine": "bf16 17.5 s (0.41 ×), fp32 29.0 s (0.69 ×) per client-round (a13f4a8)",
    },
}
DECODE_TARGET = 0.30  # of the bandwidth bound, at batch 8 and 32
ROUND_TARGET = 0.5  # of the authors' seconds per client-round on the same machine kind
# peak resident memory, MiB, per model (the reference configuration; issue 19 item 3)
MEMORY_TARGETS_MIB = {"smollm2-135m": {"client": 2.5 * 1024, "server": 2 * 1024},
                      "qwen2.5-coder-1.5b": {"client": 10 * 1024}}


def decode_limit(result: dict[str, Any], name: str) -> str | None:
    """What holds decode at ``name`` (e.g. ``"batch_32"``) where it is, from the result's own figures, per decode step:
    streaming the weights once (``weight_bytes_per_decode_step`` ÷ bandwidth), their matmuls at the matmul bound of
    the result's dtype (batch × 2 × (body + head + LoRA) FLOPs ÷ that bound; attention left out) and the measured
    step (batch ÷ tokens/s). When the matmuls alone cannot reach the decode target (``DECODE_TARGET`` of the bandwidth
    bound) decode is compute-bound on this machine in this dtype; otherwise the step's time beyond streaming and
    matmuls is overhead (op dispatch, attention, the KV cache, matmuls far below their bound with few rows).
    None when the result lacks a figure.
    """
    d = result.get("throughput", {}).get("decode", {}).get(name)
    counts, weight_bytes = result.get("flop_counts"), result.get("weight_bytes_per_decode_step")
    bounds, dtype = result.get("bounds", {}), result.get("dtype")
    peak = bounds.get("matmul_flops_bf16" if dtype == "bf16" else "matmul_flops_fp32")
    bandwidth = bounds.get("memory_bandwidth_bytes_per_s")
    if d is None or not counts or not weight_bytes or not peak or not bandwidth or not d.get("tokens_per_s"):
        return None
    batch = int(name.rsplit("_", 1)[1])
    matmul = batch * 2 * (counts["body"] + counts["head"] + counts["lora"]) / peak
    needed = DECODE_TARGET * d["bound_tokens_per_s"]
    if batch / matmul < needed:
        return (f"compute-bound: the weights' matmuls alone take {matmul * 1e3:.1f} ms per step at the {dtype} matmul "
                f"bound ({peak / 1e9:.0f} GFLOP/s): ≤ {batch / matmul:.0f} tokens/s, below the {needed:.0f} needed")
    step, stream = batch / d["tokens_per_s"], weight_bytes / bandwidth
    return (f"a step takes {step * 1e3:.1f} ms against {stream * 1e3:.1f} ms to stream the weights and "
            f"{matmul * 1e3:.1f} ms for their matmuls at the {dtype} matmul bound ({peak / 1e9:.0f} GFLOP/s): the rest "
            "is per-step overhead (op dispatch, attention, the KV cache, matmuls with few rows far below their bound)")


def _round_row(seconds: float, kind: str, references: list[dict[str, Any]]) -> dict[str, Any]:
    """The client-round target's row against the authors' figures for ``kind``: the ratio against each machine it was
    measured on, met where it is met against every one, missed where against none, and undecided (``met`` None)
    where the machines disagree (two 2-core Zen 4 with AVX-512 BF16: 65.6 and 52.4 s) — then only the authors' code
    timed on this machine decides (``scripts/authors_reference.py``)."""
    refs = sorted(references, key=lambda r: r["seconds_per_client_round"])
    low, high = refs[0]["seconds_per_client_round"], refs[-1]["seconds_per_client_round"]
    met = [seconds / r["seconds_per_client_round"] <= ROUND_TARGET for r in refs]
    if len(refs) == 1:
        span, ratios, slowest = f"{low} s", f"{seconds / low:.3f} ×", ""
        where = f"the authors' code on this kind ({kind}, {refs[0]['date']})"
    else:
        span, ratios, slowest = f"{low}–{high} s", f"{seconds / high:.3f}–{seconds / low:.3f} ×", " against the slowest"
        where = f"the authors' code on {len(refs)} machines of this kind ({kind}, " + ", ".join(
            f"{r['date']}: {r['seconds_per_client_round']} s" for r in refs) + ")"
    if all(met):
        note = where
    elif not any(met):
        note = (f"missed: needs ≤ {ROUND_TARGET * high:.2f} s{slowest}, {seconds - ROUND_TARGET * high:.2f} s more; "
                f"{where}")
    else:
        note = (f"undecided: met against the authors' {high} s, not against their {low} s (≤ {ROUND_TARGET * low:.2f} "
                f"s); machines of one kind differ: time the authors' code on this machine "
                f"(scripts/authors_reference.py); {where}")
    return {"target": f"SPEAR client-round ≤ {ROUND_TARGET} × the authors' {span}",
            "measured": f"{seconds:.2f} s = {ratios}",
            "met": True if all(met) else False if not any(met) else None, "note": note}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 19's targets against a :func:`run_bench` result: one row each with ``target``, ``measured`` (text),
    ``met`` (bool) and ``note`` (by how much a missed target is missed, what limits it where the result's figures
    tell — :func:`decode_limit`; for memory, how much stays resident after the round — and the bound or reference
    it is judged against). Targets whose measurement the result lacks (``--no-round``, another model) are left out.

    Decode: tokens/s ≥ 30% of the bandwidth bound at batch 8 and 32. Client-round: ≤ 0.5 × the authors' seconds per
    client-round measured on the same machine kind (``AUTHORS_REFERENCES``); on a kind without one the row gives the
    seconds, ``met`` None and "no same-kind reference". Memory: peak RSS of the client and the server per
    ``MEMORY_TARGETS_MIB``.
    """
    rows: list[dict[str, Any]] = []
    kind = result.get("machine", {}).get("kind", "?")
    for name in ("batch_8", "batch_32"):
        d = result.get("throughput", {}).get("decode", {}).get(name)
        if d is None:
            continue
        met = d["utilisation"] >= DECODE_TARGET
        note = "" if met else f"missed by {DECODE_TARGET - d['utilisation']:.0%} of the bound " \
                              f"(needs {DECODE_TARGET * d['bound_tokens_per_s']:.0f} tokens/s)"
        limit = None if met else decode_limit(result, name)
        rows.append({
            "target": f"decode {name.replace('_', ' ')} ≥ {DECODE_TARGET:.0%} of the bandwidth bound",
            "measured": f"{d['utilisation']:.0%} ({d['tokens_per_s']:.0f} of {d['bound_tokens_per_s']:.0f} tokens/s)",
            "met": met, "note": note + (f"; limit: {limit}" if limit else ""),
        })
    r = result.get("round")
    if r is not None:
        seconds = r["seconds_per_client_round"]
        reference = AUTHORS_REFERENCES.get(kind)
        if reference is None:
            rows.append({
                "target": f"SPEAR client-round ≤ {ROUND_TARGET} × the authors' code on the same machine kind",
                "measured": f"{seconds:.2f} s", "met": None,
                "note": f"no same-kind reference: the authors' code was timed on {', '.join(AUTHORS_REFERENCES)}, "
                        f"not on {kind}",
            })
        else:  # the machine the kind was first timed on, and any other timed since
            rows.append(_round_row(seconds, kind, [reference, *reference.get("other_machines", [])]))
        memory = {} if result.get("device") == "cuda" else MEMORY_TARGETS_MIB.get(result.get("model", ""), {})
        for who, limit in memory.items():  # host RSS: the CPU clients' targets (a GPU run's memory is the GPU's)
            peak = r.get("peak_rss_mb", {}).get(who)
            if peak is None:
                continue
            after = r.get("rss_after_round_mb", {}).get(who)
            note = "" if peak <= limit else f"missed by {(peak - limit) / 1024:.2f} GiB"
            if note and after is not None:
                note += (f"; {after / 1024:.2f} GiB stay resident after a round (the model and what the allocator "
                         f"keeps), the round's working memory adds {(peak - after) / 1024:.2f} GiB")
            rows.append({
                "target": f"peak RSS of the {who} ≤ {limit / 1024:.1f} GiB",
                "measured": f"{peak / 1024:.2f} GiB",
                "met": peak <= limit, "note": note,
            })
    return rows


def _met(met: bool | None) -> str:
    """A target row's verdict: yes, **no**, or – where there is nothing to judge against."""
    return "–" if met is None else "yes" if met else "**no**"


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a bench result."""
    b, t = result["bounds"], result["throughput"]
    g = 1e9
    lines = [
        f"# fedspear bench — {result['model']} ({result['dtype']}"
        f"{', gradient checkpointing' if result.get('gradient_checkpointing') else ''}), {result['date']}",
        "",
        f"Machine kind: **{result['machine'].get('kind', '?')}** — {result['machine']['cpu']}"
        + (f", GPU {result['machine']['gpu']}" if result['machine'].get('gpu') else "")
        + f", {result['machine']['threads']} threads, torch "
        f"{result['machine']['torch']}" + (f", fedspear {result['machine']['fedspear_commit']}"
                                             if result['machine'].get('fedspear_commit') else "") + ".",
        *([f"Command: `{result['command']}`"] if result.get("command") else []),
        "",
        "| bound | value |",
        "|---|---|",
        f"| matmul bf16 | {b['matmul_flops_bf16'] / g:.1f} GFLOP/s |",
        f"| matmul fp32 | {b['matmul_flops_fp32'] / g:.1f} GFLOP/s |",
        f"| memory bandwidth | {b['memory_bandwidth_bytes_per_s'] / g:.1f} GB/s |",
        "",
        "| throughput | measured | utilisation of bound |",
        "|---|---|---|",
        f"| prefill | {t['prefill']['tokens_per_s']:.0f} tokens/s ({t['prefill']['flops'] / g:.1f} GFLOP/s) | "
        f"{t['prefill']['utilisation']:.0%} of matmul |",
        f"| LoRA training (fwd + bwd) | {t['train']['tokens_per_s']:.0f} tokens/s ({t['train']['flops'] / g:.1f}"
        f" GFLOP/s) | {t['train']['utilisation']:.0%} of matmul |",
        *([f"| LoRA training, compiled (first micro-step {t['train_compiled']['first_call_seconds']:.1f} s) | "
           f"{t['train_compiled']['tokens_per_s']:.0f} tokens/s ({t['train_compiled']['flops'] / g:.1f} GFLOP/s) | "
           f"{t['train_compiled']['utilisation']:.0%} of matmul |"] if "train_compiled" in t else []),
    ]
    for name, d in t["decode"].items():
        lines.append(f"| decode {name.replace('_', ' ')} | {d['tokens_per_s']:.0f} tokens/s (bound "
                     f"{d['bound_tokens_per_s']:.0f}) | {d['utilisation']:.0%} of bandwidth |")
    for name, d in t.get("decode_compiled", {}).items():
        lines.append(f"| decode {name.replace('_', ' ')}, compiled (first call {d['first_call_seconds']:.1f} s) | "
                     f"{d['tokens_per_s']:.0f} tokens/s (bound {d['bound_tokens_per_s']:.0f}) | "
                     f"{d['utilisation']:.0%} of bandwidth |")
    lines.append(f"| central evaluation | {t['evaluate']['items_per_s']:.2f} items/s | – |")
    if "round" in result:
        r = result["round"]
        s = r["seconds"]
        lines += [
            "",
            f"SPEAR rounds ({json.dumps(r['config'])}): {r.get('rounds', 1)} rounds, seconds per client-round "
            f"{', '.join(f'{x:.1f}' for x in r.get('seconds_per_client_round_each', [r['seconds_per_client_round']]))}"
            f" (round 1 includes the client actor's start and model load); phases of the median round "
            f"({r.get('median_round', 1)}):",
            "",
            "| phase | seconds (all sampled clients) |",
            "|---|---|",
            *[f"| {k.replace('_', ' ')} | {s[k]:.1f} |" for k in ("generate_initial", "generate_revisions", "train",
                                                                 "aggregate", "flower_overhead", "evaluate", "round")],
            "",
            f"Seconds per client-round (round without evaluation ÷ clients, median): "
            f"**{r['seconds_per_client_round']:.1f}**;"
            f" Flower overhead {r['flower_overhead_share']:.1%} of the round; peak RSS client "
            f"{r['peak_rss_mb'].get('client', 0):.0f} MiB, server {r['peak_rss_mb'].get('server', 0):.0f} MiB; "
            f"resident after the round (freed memory returned) client "
            f"{r.get('rss_after_round_mb', {}).get('client', float('nan')):.0f} MiB, server "
            f"{r.get('rss_after_round_mb', {}).get('server', float('nan')):.0f} MiB; all processes together "
            f"(server, Ray, client actor: peak of the summed PSS, RSS sum in brackets) "
            f"{r.get('peak_tree_mb', {}).get('pss', 0):.0f} MiB ({r.get('peak_tree_mb', {}).get('rss', 0):.0f}).",
        ]
    rows = targets(result)
    if rows:
        lines += ["", "Targets (issue 19):", "", "| target | measured | met | note |", "|---|---|---|---|",
                  *[f"| {t['target']} | {t['measured']} | {_met(t['met'])} | {t['note']} |"
                    for t in rows]]
    return "\n".join(lines) + "\n"
