"""The decode step compiled once per process, over a static KV cache (``compile_decode``; on by default on a GPU).

What is compiled: the model's forward for one new token per row (a decode step), through transformers' own machinery
— ``generate`` given a ``StaticCache`` and a ``CompileConfig`` compiles ``model.__call__`` with ``torch.compile`` and
uses it for every step after the prefill (``GenerationMixin.get_compiled_call``); the prefill (the prompt, any length)
stays eager. On a CUDA GPU the backend is inductor in mode ``"reduce-overhead"`` (CUDA graphs: a step is replayed as
one graph, not launched kernel by kernel from Python; transformers' default for a compiled decode. Qwen2.5-1.5B's
shape in bf16 with a LoRA adapter at batch 32: 53.6 ms per step eager, 14.0 ms compiled with a static cache, in the
2026-11-27 H100 probe of issue 40, where the weights stream in 2.1 ms). Sampling, stopping and
every logits processor are ``generate``'s own, unchanged: greedy answers are the eager ones (up to rounding, see
``tests/test_compiled_decode.py``) and sampled answers are the current policy's.

Why the adapter can change without a recompile: torch.compile treats a module's parameters as inputs of the graph
(guarded on shape, dtype and device, not values), and CUDA graphs read them at fixed addresses. ``set_adapter``
(``peft.set_peft_model_state_dict`` → ``load_state_dict``, which ``copy_``s into each parameter), the optimiser's
steps and ``Evaluator``'s loads all write the LoRA tensors in place, so every round's adapter is read by the same
graph. Merging the adapter into the base weights (``model.merged_adapter``) would replace tensors, so the compiled
path never merges.

Static shapes, bucketed (decisions, 2026-11-27):

- **batch**: a chunk of n contexts runs as ``batch_bucket(n)`` rows, the next power of two (1, 2, 4, … 64): the
  extra rows repeat the last context and are stopped after their first token (``generation.generate``), their
  answers dropped. A padded row costs little on a GPU (the probe's eager step: 49.6 ms at batch 8, 53.6 at 32).
- **cache length**: prompt (left padded to the longest context of the ``generate`` call, every batch of the call
  alike, so that an evaluation's batches hold one cache) + ``max_new_tokens``, rounded up to a multiple of
  ``CACHE_STEP`` = 256 positions. Attention reads the whole static cache (masked), so a coarser step would cost
  bandwidth on every step.
- One ``StaticCache`` per (batch, length) bucket is kept for the life of the model and zeroed before each use, so
  its tensors keep their addresses (what CUDA graphs need) and a new round allocates nothing. Memory:
  2 · layers · kv_heads · head_dim · length · batch values per bucket (Qwen2.5-1.5B, batch 32, 768 positions, bf16:
  0.7 GB).
- ``dynamic=None`` (torch's and transformers' default, "automatic dynamic"): the first bucket compiles a static
  graph; the first bucket with another batch compiles once more with the batch symbolic, the first with another
  cache length once more with the length symbolic, and later buckets reuse that graph (a batch of 1 is always its
  own graph). So a process compiles at most four graphs whatever the mix of batches and prompt lengths (counted on
  the CPU with the tiny model, static caches of (batch, length) (4, 64), (8, 64), (16, 64), (8, 128), (16, 192),
  (2, 64), (1, 64) in turn: 1, 2, 2, 3, 3, 3, 4 graphs in all), and CUDA graphs are recorded once per bucket.
  Within a bucket nothing recompiles (a new prompt length, a new batch size of the same bucket, a new adapter):
  ``tests/test_compiled_decode.py`` counts it.

Guards (decision, 2026-11-29): before each call of a compiled graph dynamo checks its guards — that every input,
parameter and module attribute the graph was traced with still looks as it did. For a model of Qwen2.5-1.5B's
depth with a LoRA adapter that is hundreds of parameters and module attributes on every decode step: 2.6–3.9 ms per
step on the Zen 4 CPU (a 28-layer, 64-wide Qwen2 with an r-16 adapter, inductor, ``bench.timed_decode``, all guards
→ the kept ones, medians of 12 timings in 6 alternating pairs: batch 32 26.2 → 23.6 and 30.9 → 27.3 ms per step,
batch 8 21.3 → 17.4 ms), host time a GPU step pays as well. So once a (batch, cache length, dtype) bucket has
decoded with every guard checked — any graph it needs compiled then — its later ``generate`` calls run under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (``CompiledDecode.decode``): dynamo then checks only the
guards that tell this process's compiled graphs apart — every input tensor that is not a parameter (token ids,
positions, mask, the static cache) and whatever guard once failed and caused a recompilation — and skips those on
the parameters and the modules. What it skips cannot change between calls of one bucket: ``generate`` always
decodes in eval mode with the adapter enabled, and the adapter's values are written in place (the tensors the graph
reads). What the stance leaves unchecked is module state — training mode, peft's adapter flags, merged weights,
hooks — so a ``generate`` that changed any of it would need every guard again; fedspear's does not (training mode is
checked, and the compiled path never merges). torch calls the stance unsafe because a call needing a graph not yet
compiled could run a wrong one; a bucket first runs with all guards for that reason, and in torch 2.13 a warm call
that finds no graph raises rather than running another (``CompiledDecode.decode`` then runs it again with every
guard). ``SKIP_WARM_GUARDS = False`` turns this off.

Stop checks (decision, 2026-11-29): after each step transformers' ``generate`` asks whether every row has stopped,
``bool(unfinished_sequences.max() == 0)`` — a device value read on the host, which on a GPU waits until the GPU
has finished the step. The host then prepares the next step (guards, the generate loop's own tensor work, the
CUDA-graph replay) while the GPU idles, and the GPU runs it while the host waits: host time and GPU time add up on
every step. transformers ships the remedy, ``DeferredStopCheck`` (``generation/utils.py``, 5.17 and later): the flag
is copied to the host asynchronously and read one step later, so the host queues step n + 1 while the GPU runs step
n; when every row stopped early, one extra step runs and is undone (its token dropped, the cache's position counter
moved back: ``OneDtypeStaticLayer.crop``). transformers enables it on Apple's ``mps`` only ("we should enable it for
cuda if we observe perf gains") and only for a cache it may crop. This module enables it for the compiled decode's
own static caches on a CUDA GPU (``defer_stop_checks``, installed once per process by ``use_compiled_decode``;
other callers' ``generate`` keep transformers' choice): those caches are zeroed before every use, so nothing reads
what the undone step left. Deferring gains only where nothing else on a step reads the device: where it is on,
``generate`` has the sampler draw without reading anything back (``runtime.sampling``, ``sync_free``), the bucket's
padding rows and progress counting read nothing, and transformers checks the ``max_new_tokens`` bound on the host
(never deferred, so the extra step stays inside the static cache). Greedy answers are the same with and without
(``tests/test_compiled_decode.py``, on the CPU with a stand-in for the GPU's event: CPU tensors have none); sampled
answers are drawn from the same distribution, but the undone step of a batch that stopped early has drawn random
numbers too, so for a given seed the draws after it differ. ``DEFER_STOP_CHECK = False`` turns it off. What it saves
on a GPU is not measured yet (``scripts/gpu_check.sh`` times the decode both ways).

Not compiled: the prefill, training, log-likelihood scoring and evaluation's forwards (eager; their shapes vary).
Prefix sharing (``generate``'s ``reuse_prefix``, a CPU saving) is off on this path: the static cache is filled by
one prefill of the padded batch.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

COMPILE_DECODE = ("auto", "on", "off")
CACHE_STEP = 256  # positions; static cache lengths are multiples of this
CUDA_MODE = "reduce-overhead"  # torch.compile mode on a CUDA GPU: inductor with CUDA graphs
BACKEND = "inductor"  # torch.compile backend (tests may use "aot_eager": same kernels as eager, compiles in seconds)
ATTRIBUTE = "fedspear_compiled_decode"  # where a model keeps its CompiledDecode
SKIP_WARM_GUARDS = True  # a bucket's calls after its first check only the guards that tell graphs apart (docstring)
DEFER_STOP_CHECK = True  # on a GPU, generate reads "every row stopped" one step late (docstring, "Stop checks")
DEFER_DEVICES = ("cuda",)  # device types it is enabled on (transformers' DeferredStopCheck needs a torch.Event there)
DEFERS = "fedspear_defers_stop_check"  # the attribute that marks a static cache of this module's
T = TypeVar("T")


def compiles_decode(setting: str, device: torch.device) -> bool:
    """Whether ``compile_decode = setting`` compiles the decode step of a model on ``device``: ``"on"`` yes,
    ``"off"`` no, ``"auto"`` on a CUDA GPU only: on this project's 2-core Zen 4 CPU the compiled step decodes
    SmolLM2-135M 1.25–1.5× faster than the eager one with ``cpu_kernels``' cache, but a process first spends
    1.5–2.5 minutes compiling, repaid after thousands of decode steps (``docs/performance.md``, "Decode: the
    candidates measured"): ``"on"`` is for long runs with long answers.

    Raises:
        ValueError: ``setting`` is not auto, on or off.
    """
    if setting not in COMPILE_DECODE:
        raise ValueError(f"compile_decode must be auto, on or off (got {setting!r})")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def batch_bucket(n: int) -> int:
    """Rows a chunk of ``n`` contexts runs as: the next power of two ≥ ``n`` (1 → 1, 3 → 4, 5 → 8, 32 → 32)."""
    if n < 1:
        raise ValueError(f"a batch needs at least one row (got {n})")
    return 1 << (n - 1).bit_length()


def cache_bucket(positions: int) -> int:
    """Static cache length for ``positions`` (prompt + new tokens): rounded up to a multiple of ``CACHE_STEP``."""
    return max(1, -(-positions // CACHE_STEP)) * CACHE_STEP


@dataclass
class CompiledDecode:
    """A model's compiled decode: the ``CompileConfig`` ``generate`` compiles its forward with (one object for the
    model's life, so transformers compiles once: ``get_compiled_call`` keeps the compiled forward while the config
    is equal), its static KV caches by (batch, length) bucket, and the (batch, length, dtype) buckets that have
    decoded once with every guard checked (``warm``)."""

    compile_config: object
    caches: dict = field(default_factory=dict)
    warm: set = field(default_factory=set)

    def decode(self, model, rows: int, positions: int, dtype_used: str, call: Callable[[], T],
               steps: Callable[[T], int]) -> T:
        """``call()`` — one ``generate`` call of ``rows`` rows (a batch bucket) and up to ``positions`` positions
        under ``dtype_used`` — with the guards of module docstring's "Guards": all of them until the bucket has run
        a compiled step (``steps(result)``: how many the call kept; a call whose rows all stopped after their first
        token kept none, though with the stop check deferred it ran one and undid it), then only those that tell this
        process's graphs apart. Where a warm call finds no graph
        for its inputs, torch refuses to compile under that stance ("Recompilation triggered with
        skip_guard_eval_unsafe stance"): the call runs again with every guard (it may compile) and the bucket is
        warm again only after. Every guard is checked whenever ``SKIP_WARM_GUARDS`` is off, the model is in
        training mode (``generate`` puts it in eval mode: a graph traced in one mode must not serve the other) or
        this torch has no such stance.

        Returns:
            What ``call()`` returned.
        """
        key = (rows, cache_bucket(positions), dtype_used)
        if key in self.warm and SKIP_WARM_GUARDS and not model.training and _stance_skips_guards():
            try:
                with torch.compiler.set_stance(_current_stance(), skip_guard_eval_unsafe=True):
                    return call()
            except RuntimeError as err:
                if "skip_guard_eval_unsafe" not in str(err):
                    raise
                self.warm.discard(key)
        result = call()
        if steps(result) > 0:
            self.warm.add(key)
        return result

    def cache(self, model, batch: int, length: int):
        """The ``StaticCache`` of bucket (``batch``, ``length``) for ``model``, zeroed (made on first use, on the
        model's device: its position counter is a tensor made at construction)."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        from .model import model_device

        key = (batch, length)
        if key not in self.caches:
            with model_device(model):
                cache = StaticCache(config=model.config, max_cache_len=length)
                if all(type(layer) is StaticLayer for layer in cache.layers):
                    cache.layers = [one_dtype_layer_class()(max_cache_len=length) for _ in cache.layers]
                    setattr(cache, DEFERS, True)  # its layers can undo a step (OneDtypeStaticLayer.crop)
            self.caches[key] = cache
        cache = self.caches[key]
        cache.reset()
        return cache

    def generate_kwargs(self, model, rows: int, positions: int) -> dict:
        """What transformers' ``generate`` needs to decode ``rows`` sequences of up to ``positions`` tokens (prompt
        + new) with the compiled step: ``past_key_values`` (the bucket's static cache, zeroed) and
        ``compile_config``. Ask again for every ``generate`` call: a cache holds one call's tokens. ``rows`` is the
        batch ``generate`` is given; pad it to ``batch_bucket(rows)`` to share graphs and caches between batch
        sizes (``generation.generate`` does; a benchmark at batch 1, 8 or 32 is a bucket already)."""
        return {"past_key_values": self.cache(model, rows, cache_bucket(positions)),
                "compile_config": self.compile_config}


def _current_stance() -> str:
    """torch.compile's stance now (``"default"`` unless a caller set another, e.g. ``"force_eager"``), kept when the
    guards are skipped."""
    stance = getattr(getattr(torch._dynamo, "eval_frame", None), "_stance", None)
    return getattr(stance, "stance", "default")


@functools.cache
def _stance_skips_guards() -> bool:
    """Whether this torch's ``torch.compiler.set_stance`` takes ``skip_guard_eval_unsafe`` (torch ≥ 2.6)."""
    return "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


@functools.cache
def one_dtype_layer_class():
    """The :class:`OneDtypeStaticLayer` class (defined on first use: transformers is imported lazily)."""
    from transformers.cache_utils import StaticLayer

    class OneDtypeStaticLayer(StaticLayer):
        """transformers' ``StaticLayer`` holding keys and values in one dtype, the wider of the two it is given.

        ``StaticLayer`` allocates both in the keys' dtype. On the CPU's bf16 path (bf16 linear weights, fp32
        residual stream, ``cpu_kernels.store_linear_weights_bf16``) RoPE turns the keys fp32 while the values leave
        ``v_proj`` in bf16, and writing them fails; a bf16 value widened to fp32 is exact, so attention reads what
        the eager path reads. Where both come in one dtype (a model held in bf16 on a GPU) nothing changes.
        """

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            dtype = torch.promote_types(key_states.dtype, value_states.dtype)
            return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

        is_croppable = True

        def crop(self, tokens_to_remove: int) -> None:
            """Undo the last ``-tokens_to_remove`` positions (transformers' convention: a count ≤ 0; what
            ``DeferredStopCheck`` asks after its extra step): the position counter moves back, in place (a CUDA
            graph reads it where it is); the keys and values written there stay, unread, like every position past
            the counter.

            Raises:
                ValueError: ``tokens_to_remove`` > 0 (transformers' legacy "absolute length" form).
            """
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes minus the number of positions to drop (got {tokens_to_remove})")
            if tokens_to_remove and self.is_initialized:
                self.cumulative_length.sub_(-tokens_to_remove)

    return OneDtypeStaticLayer


def use_compiled_decode(model, setting: str = "auto", *, backend: str | None = None, mode: str | None = None) -> bool:
    """Make ``runtime.generation.generate`` decode ``model`` with a compiled step (``compiles_decode``), or
    eagerly; returns whether compiled. Called once after the adapter is added (``Worker.load``, ``Evaluator``);
    calling it again with the same answer keeps the compiled step and its caches.

    ``backend`` (default ``BACKEND``) and ``mode`` (default ``CUDA_MODE`` on a GPU, torch's default elsewhere) go
    to ``torch.compile``.

    Raises:
        ValueError: ``setting`` is not auto, on or off.
    """
    from transformers import CompileConfig

    from .model import model_device

    device = model_device(model)
    if not compiles_decode(setting, device):
        if compiled_decode(model) is not None:
            delattr(model, ATTRIBUTE)
        return False
    gpu = device.type == "cuda"
    config = CompileConfig(fullgraph=False, dynamic=None, backend=backend or BACKEND,
                           mode=mode or (CUDA_MODE if gpu else "default"))
    if not gpu:
        config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    current = compiled_decode(model)
    if current is None or current.compile_config != config:
        setattr(model, ATTRIBUTE, CompiledDecode(config))
    defer_stop_checks()
    return True


def stop_checks_deferred(device: torch.device) -> bool:
    """Whether a compiled decode's ``generate`` on ``device`` reads the stop check one step late (module docstring,
    "Stop checks"): ``DEFER_STOP_CHECK`` on, a device type of ``DEFER_DEVICES``, and a transformers that has
    ``DeferredStopCheck`` (``defer_stop_checks``)."""
    return DEFER_STOP_CHECK and torch.device(device).type in DEFER_DEVICES and defer_stop_checks()


def defers_stop_check(cache, device: torch.device) -> bool:
    """Whether ``generate`` decoding into ``cache`` on ``device`` reads the stop check one step late: where
    ``stop_checks_deferred(device)`` and ``cache`` is one of this module's that can undo a step (``DEFERS``: every
    layer a ``StaticLayer``; a model with sliding-window layers gets transformers' own choice, not deferred on CUDA)."""
    return stop_checks_deferred(device) and bool(getattr(cache, DEFERS, False))


def defer_stop_checks() -> bool:
    """Let transformers' ``generate`` check for stopped rows one step late (``DeferredStopCheck``; module docstring,
    "Stop checks") when it decodes into a static cache of this module's on a device of ``DEFER_DEVICES`` while
    ``DEFER_STOP_CHECK`` is on; every other ``generate`` call keeps transformers' own choice. Installed once per
    process (later calls change nothing).

    Returns:
        Whether this transformers has ``DeferredStopCheck`` (5.17 and later): without it stop checks stay as they are.
    """
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:
        return False
    current = DeferredStopCheck.__dict__.get("is_supported")
    original = getattr(current, "__func__", None)
    if original is None:
        return False
    if getattr(original, "fedspear", False):
        return True
    signature = inspect.signature(original)

    def is_supported(*args, **kwargs) -> bool:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError:
            given = {}
        device, cache = given.get("device"), given.get("cache")
        if (DEFER_STOP_CHECK and getattr(cache, DEFERS, False) and not given.get("is_assistant", True)
                and getattr(device, "type", None) in DEFER_DEVICES):
            return True
        return original(*args, **kwargs)

    is_supported.fedspear = True
    is_supported.__doc__ = original.__doc__
    DeferredStopCheck.is_supported = staticmethod(is_supported)
    return True


def compiled_decode(model) -> CompiledDecode | None:
    """``model``'s compiled decode (``use_compiled_decode``), or None: it decodes eagerly."""
    return model.__dict__.get(ATTRIBUTE)
