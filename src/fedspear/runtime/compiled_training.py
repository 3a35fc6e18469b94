"""The training forward compiled once per process (``compile_training``; off by default).

What is compiled: the LoRA model's forward as the local training runs it — every forward through
``training.completion_logits`` while gradients are recorded and the model is in training mode (SPEAR's micro-steps
and every baseline's), with ``torch.compile(model)``; AOTAutograd compiles the backward with it, so the adapter's
gradients come from the compiled graph too. On a GPU inductor is expected to fuse what runs element by element
between the matmuls — each adapted projection's dropout (its update's scaling and sum are already inside the
``lora_B`` product in eager mode: ``runtime.lora_sum``), RMSNorm and SiLU — the memory traffic a bf16 training step
pays besides its matmuls (issue 40 item 2: "fused or compiled LoRA dropout if it gains"). The reference and "old"
log-probabilities (GRPO's and RLTF-SD's), OPSD's teacher and the margin pass run without gradients and stay eager,
so where fused kernels round differently (bf16 on a GPU) a ratio against them is 1, and a KL 0, at the start of a
round only up to that rounding.

Why off by default (decision, 2026-12-06): on the 2-core Zen 4 CPU it is slower, and on a GPU it is not measured yet.
SmolLM2-135M in bf16, a micro-step of 16 × 220 tokens as the runs pack it (``scripts/compiled_training_ab.py``;
``docs/results/bench/2026-12-06/``): eager 366 → compiled 298 tokens/s (0.82×, medians of three alternating pairs;
0.78× in an earlier run), after a first micro-step of 267 s with inductor's cache cold (35 s with it warm).
gpu_check's ``train-compiled`` step runs the same script on a GPU: the compilation's seconds, warm tokens/s both
ways, the graphs compiled, and the gradients against eager ones (in bf16 they differ by rounding: on that CPU 2.3%
by norm, where eager bf16 gradients are 1.8% and compiled ones 1.6% from fp32 ones).

Shapes: every micro-step has its own batch (wins + losses), length and completion window. Every size of the
forward's inputs (token ids, attention mask, positions, the kept positions) is marked dynamic before each call
(``torch._dynamo.maybe_mark_dynamic``), so the first compilation is symbolic in them and serves every later shape,
except one with a size of one (a batch of one row, a one-token window), which torch specialises (one more graph).
Not ``torch.compile(dynamic=True)``: that makes the modules' float attributes (LoRA's scaling, the norms' epsilon)
symbolic too, graph inputs instead of constants, and torch 2.13 then restarts the first compilation to turn them
into tensors (it compiled twice). Training with dropout off (``TrainSettings.dropout`` False: GRPO, RLTF-SD) is one
more graph, the dropout modules' mode being guarded; with gradient checkpointing on, transformers' hook that marks
the input embeddings as needing a gradient (``requires_grad_``, which dynamo does not trace) breaks the graph in
three, with the same gradients. ``tests/test_compiled_training.py`` counts them. The adapter's values never cause a
compilation: dynamo treats parameters as graph inputs (guarded on shape, dtype and device), and ``set_adapter`` and
the optimiser write them in place.

Randomness: inductor draws dropout masks with its own Philox generator, seeded from torch's default generator: a
seeded run repeats itself, but its masks are not those of the eager forward (the same distribution, not the same
draws). ``FastDropout`` (the CPU's) traces as ``torch.nn.functional.dropout`` for the same reason: its
``Tensor.random_`` would break the graph at every adapted projection.

A copy of the model (``copy.deepcopy``, pickling) trains eagerly until ``use_compiled_training`` is called on it:
the compiled forward belongs to the model it was made for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

COMPILE_TRAINING = ("on", "off")
BACKEND = "inductor"  # torch.compile backend (tests may use "aot_eager" or a counting backend)
ATTRIBUTE = "fedspear_compiled_training"  # where a model keeps its CompiledTraining


@dataclass
class CompiledTraining:
    """A model's compiled training forward: ``forward`` (what ``torch.compile`` returned for the model; kept for the
    model's life, so a process compiles once) and the ``backend`` it compiled with. Not copied with the model: a
    deep copy or an unpickled model holds None in its place (module docstring)."""

    forward: Callable
    backend: object

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return _nothing, ()


def _nothing() -> None:
    """What an unpickled ``CompiledTraining`` becomes."""
    return None


def check_setting(setting: str) -> None:
    """Refuse a ``compile_training`` value other than on or off.

    Raises:
        ValueError: ``setting`` is not on or off.
    """
    if setting not in COMPILE_TRAINING:
        raise ValueError(f"compile_training must be on or off (got {setting!r})")


def use_compiled_training(model, setting: str = "off", *, backend=None) -> bool:
    """Make ``training.completion_logits`` run ``model``'s forward compiled (``"on"``) or eagerly (``"off"``) when it
    records gradients in training mode; returns whether compiled. Called once after the adapter is added
    (``Worker.load``); calling it again with the same setting and backend keeps the compiled forward. ``backend``
    (default ``BACKEND``) goes to ``torch.compile``.

    Raises:
        ValueError: ``setting`` is not on or off.
    """
    check_setting(setting)
    if setting == "off":
        model.__dict__.pop(ATTRIBUTE, None)
        return False
    backend = backend or BACKEND
    current = compiled_training(model)
    if current is None or current.backend != backend:
        # kept in the instance's __dict__: as a module attribute the compiled wrapper would become a submodule
        model.__dict__[ATTRIBUTE] = CompiledTraining(torch.compile(model, backend=backend), backend)
    return True


def compiled_training(model) -> CompiledTraining | None:
    """``model``'s compiled training forward (``use_compiled_training``), or None: it trains eagerly."""
    return model.__dict__.get(ATTRIBUTE)


def training_forward(model) -> Callable:
    """What to call for ``model``'s forward now: its compiled training forward while gradients are recorded and the
    model is in training mode, else the model itself (no gradients, eval mode, or not compiled). The call takes and
    returns what the model's forward does.

    Raises:
        RuntimeError: (from the returned call) compiling the forward failed; the message names the setting that turns
            it off. AOTAutograd compiles the backward with the forward, but where that fails torch tries again in
            ``backward()`` and raises its own error there.
    """
    compiled = compiled_training(model)
    if compiled is None or not (torch.is_grad_enabled() and model.training):
        return model

    def call(*args, **kwargs):
        for tensor in (*args, *kwargs.values()):  # every size symbolic from the first call (module docstring)
            if isinstance(tensor, torch.Tensor):
                for dim in range(tensor.dim()):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            return compiled.forward(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            raise RuntimeError(f"the compiled training forward failed ({type(err).__name__}: {err}); "
                               "compile_training = \"off\" trains without compiling") from err
    return call
