"""The compiled training forward (``fedspear.runtime.compiled_training``, ``compile_training``): the eager forward's
loss and adapter gradients, one compilation for every micro-step shape and for every round's adapter, and the
eager forward wherever no gradient is recorded.

On the CPU the tiny model compiles with torch.compile's ``aot_eager`` backend (dynamo's capture, guards and
recompilation and AOTAutograd's joint forward-backward graph, run with eager kernels: what these tests are about,
in seconds), counted by ``Counting``: each graph it is handed is one compilation. With eager kernels the compiled
forward and backward compute what the eager ones compute: fp32 losses and gradients are compared to a relative
1e-6 (measured: equal, or apart by the last bit where AOTAutograd sums a gradient in another order). The ``gpu``
test runs inductor on a CUDA GPU in bf16, where fused kernels round differently (tolerance there).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fedspear.interaction import Trace
from fedspear.runtime import compiled_training
from fedspear.runtime.compiled_training import compiled_training as compiled_of
from fedspear.runtime.compiled_training import training_forward, use_compiled_training
from fedspear.runtime.cpu_kernels import FastDropout
from fedspear.runtime.model import LoraSettings, add_lora, get_adapter, set_adapter, tiny_model
from fedspear.training import completion_logprobs, dropout_modules, pack, pair_margin

# micro-steps of other batch sizes, lengths and completion windows, as a round's wins and losses make them
SHAPES = ((4, 40, 10), (4, 57, 12), (6, 33, 9), (3, 70, 20))


class Counting:
    """A torch.compile backend that counts the graphs handed to it (``compiles``); ``aot_eager`` does the work."""

    def __init__(self):
        self.compiles = 0

    def __call__(self, graph, example_inputs):
        self.compiles += 1
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)


@pytest.fixture
def counting():
    torch._dynamo.reset()  # graphs of earlier tests are not this test's
    yield Counting()
    torch._dynamo.reset()


def _model(dropout: float = 0.0, seed: int = 0):
    """The tiny model with an r-4 adapter whose B is nonzero (B = 0 would leave A without a gradient)."""
    base, tokenizer = tiny_model()
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=dropout), seed=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model, tokenizer


def _traces(rows: int, length: int, window: int, seed: int) -> list[Trace]:
    """``rows`` traces of ``length`` tokens, ``window`` of them the completion, the first row 3 tokens shorter (left
    padding in the batch)."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        n = length - (3 if i == 0 else 0)
        ids = [rng.randrange(5, 1000) for _ in range(n)]
        out.append(Trace(f"u{i}", ids[: n - window], ids[n - window :], False))
    return out


def _loss_and_grads(model, traces, dropout: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
    """One micro-step's forward and backward through ``completion_logprobs`` (fp32): the mean log-probability of
    the completions as the loss, and every LoRA gradient. ``dropout=False``: the dropout modules in eval mode, as
    ``optimise`` puts them for ``TrainSettings.dropout = False``."""
    model.train()
    for module in ([] if dropout else dropout_modules(model)):
        module.eval()
    model.zero_grad(set_to_none=True)
    batch = pack(traces, 0)
    logp = completion_logprobs(model, batch, "fp32")  # [B, C]
    loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        scale = b[name].abs().max().item()
        assert scale > 0, name  # every LoRA tensor gets a gradient
        assert (a[name] - b[name]).abs().max().item() <= rtol * scale, name


def test_every_micro_step_shape_runs_one_graph_with_the_eager_gradients(counting):
    """Four micro-steps of other batch sizes, lengths and windows: one compilation (the shapes are symbolic), and
    each step's loss and LoRA gradients are those of the eager forward."""
    model, _ = _model()
    assert use_compiled_training(model, "on", backend=counting)
    for i, shape in enumerate(SHAPES):
        traces = _traces(*shape, seed=i)
        loss, grads = _loss_and_grads(model, traces)
        assert counting.compiles == 1, shape
        use_compiled_training(model, "off")
        eager_loss, eager_grads = _loss_and_grads(model, traces)
        assert compiled_of(model) is None and counting.compiles == 1
        use_compiled_training(model, "on", backend=counting)  # the same backend again: a new wrapper, no new graph
        assert loss == pytest.approx(eager_loss, rel=1e-6)
        _assert_close(grads, eager_grads, 1e-6)


def test_a_new_adapter_compiles_nothing(counting):
    """The adapter's values are graph inputs: another round's adapter (``set_adapter``, in place) reuses the graph
    (the optimiser's steps, in place too: ``test_client_rounds_compute_the_eager_gradients``)."""
    model, _ = _model()
    use_compiled_training(model, "on", backend=counting)
    traces = _traces(4, 40, 10, seed=0)
    first, _ = _loss_and_grads(model, traces)
    adapter = get_adapter(model)
    rng = np.random.default_rng(1)
    set_adapter(model, {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in adapter.items()})
    second, _ = _loss_and_grads(model, traces)
    assert second != first and counting.compiles == 1


def test_no_gradient_or_eval_mode_runs_the_eager_forward(counting):
    """The passes without gradients never reach the compiled forward: GRPO's and RLTF-SD's reference log-probs under
    the base model (``common.logprobs_of`` with the adapter disabled, eval mode), the live policy's, OPSD's teacher
    pattern (no gradient while the model is in training mode) and the margin pass over (win, lose) pairs. Nothing
    compiles for them; a micro-step then does."""
    from fedspear.algorithms import common

    model, _ = _model()
    use_compiled_training(model, "on", backend=counting)
    model.train()
    assert training_forward(model) is not model
    with torch.no_grad():
        assert training_forward(model) is model
    model.eval()
    assert training_forward(model) is model
    traces = _traces(4, 40, 10, seed=0)
    for adapter in (False, True):
        assert len(common.logprobs_of(model, traces, 0, "fp32", adapter=adapter)) == 4
    model.train()
    with torch.no_grad():
        completion_logprobs(model, pack(traces, 0), "fp32")
    wins = traces[:2]
    losses = [Trace(w.uid, w.prompt_ids, t.completion_ids, False) for w, t in zip(wins, traces[2:])]  # pairs
    margin, pairs = pair_margin(model, wins, losses, 0, tau=4, dtype_used="fp32")
    assert pairs == 2 and np.isfinite(margin)
    assert counting.compiles == 0
    _loss_and_grads(model, traces)
    assert counting.compiles == 1


def test_fast_dropout_compiles_without_a_graph_break(counting):
    """The CPU's ``FastDropout`` (p = 0.1) traces as ``torch.nn.functional.dropout``: one graph, where its
    ``Tensor.random_`` would break the graph at every adapted projection; seeded, the compiled step repeats itself;
    the dropout is applied (another loss than without it); and with the dropout modules in eval mode a second graph
    drops nothing (the eager loss)."""
    model, _ = _model(dropout=0.1)
    assert any(isinstance(m, FastDropout) for m in model.modules())
    torch._dynamo.utils.counters.clear()
    use_compiled_training(model, "on", backend=counting)
    traces = _traces(4, 40, 10, seed=0)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(_loss_and_grads(model, traces)[0])
    assert counting.compiles == 1 and runs[0] == runs[1]
    torch.manual_seed(5)
    undropped = _loss_and_grads(model, traces, dropout=False)[0]  # dropout off: one more graph
    assert counting.compiles == 2 and undropped != runs[0]
    assert not torch._dynamo.utils.counters["graph_break"]
    use_compiled_training(model, "off")
    assert _loss_and_grads(model, traces, dropout=False)[0] == pytest.approx(undropped, rel=1e-6)


@pytest.mark.parametrize("algorithm", ["spear", "grpo", "opsd"])
def test_client_rounds_compute_the_eager_gradients(algorithm, counting, monkeypatch):
    """Two client-rounds of a worker with ``compile_training = "on"`` and of one with it off (dropout 0, fp32, the
    same start and seeds), for SPEAR, GRPO (ratios and KL against "old" and reference log-probs computed eagerly)
    and OPSD (its teacher's logits without gradients in between): one compilation serves both rounds' micro-steps
    (the optimiser writes the adapter in place), and the gradients of the first optimiser step, taken from the same
    adapter on the same answers, are the eager ones to fp32 rounding (1e-5 by norm).

    Later steps are not compared entry by entry: Adam scales each entry's step by its gradient's size, so rounding
    in a gradient entry near zero moves that entry by a fraction of the learning rate, and GRPO's group-normalised
    advantages and OPSD's teacher-student differences make many such entries (measured over two rounds at a learning
    rate of 0.1: SPEAR's adapters within a relative 1e-5, GRPO's apart by up to 6.8e-4, OPSD's by up to 0.064)."""
    from helpers import Alternate, make_worker, nonzero_start

    monkeypatch.setattr(compiled_training, "BACKEND", counting)
    clip = torch.nn.utils.clip_grad_norm_
    seen: list[list[torch.Tensor]] = []

    def recording(params, *args, **kwargs):  # optimise clips just before each optimiser step
        params = list(params)
        seen.append([p.grad.detach().clone() for p in params])
        return clip(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    first = {}
    for setting in ("on", "off"):
        worker = make_worker(algorithm=algorithm, compile_training=setting, dtype="fp32", max_revisions=1,
                             rollouts_per_round=3)
        assert (compiled_of(worker.model) is not None) == (setting == "on")
        arrays = nonzero_start(worker)
        seen.clear()
        for r in (1, 2):
            torch.manual_seed(r)
            arrays, metrics = worker.round(worker.loaded, arrays, list(range(6)), 0, r, 1e-1,
                                           feedback_source=Alternate())
            assert metrics["steps"] >= 1
        first[setting] = seen[0]
        assert len(seen) >= 2
    assert counting.compiles == 1
    difference = sum(float(((a - b) ** 2).sum()) for a, b in zip(first["on"], first["off"])) ** 0.5
    norm = sum(float((b ** 2).sum()) for b in first["off"]) ** 0.5
    assert norm > 0 and difference <= 1e-5 * norm


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_with_the_compiled_decode_neither_compiles_again(checkpointing, counting, monkeypatch):
    """A worker with both the decode (``compile_decode = "on"``) and the training forward compiled, as a GPU run
    with both on has them, with gradient checkpointing off and on (on, the training graph breaks and dynamo compiles
    the model's inner forwards as frames of their own, the decode's among them): round 2 compiles nothing for either,
    and both rounds' answers come through the compiled decode."""
    from helpers import Alternate, make_worker, nonzero_start
    from test_compiled_decode import Counting as DecodeCounting

    from fedspear.runtime import compiled

    decoding = DecodeCounting()
    monkeypatch.setattr(compiled, "BACKEND", decoding)
    monkeypatch.setattr(compiled_training, "BACKEND", counting)
    worker = make_worker(compile_decode="on", compile_training="on", dtype="fp32", max_revisions=1,
                         rollouts_per_round=3, gradient_checkpointing=checkpointing)
    assert worker.model.is_gradient_checkpointing == (checkpointing == "on")
    arrays = nonzero_start(worker)
    arrays, metrics = worker.round(worker.loaded, arrays, list(range(6)), 0, 1, 1e-1, feedback_source=Alternate())
    assert metrics["steps"] >= 1 and decoding.compiles >= 1 and counting.compiles >= 1
    decoded, trained, calls = decoding.compiles, counting.compiles, decoding.calls
    worker.round(worker.loaded, arrays, list(range(6)), 0, 2, 1e-1, feedback_source=Alternate())
    assert decoding.compiles == decoded and decoding.calls > calls and counting.compiles == trained


def test_gradient_checkpointing_keeps_the_eager_gradients(counting):
    """With gradient checkpointing on (what ``gradient_checkpointing = auto`` turns on when the activations would
    not fit): the compiled forward breaks its graph where transformers' hook marks the input embeddings as needing
    a gradient (``requires_grad_``, which dynamo does not trace: three graphs instead of one, for every shape), and
    the losses and gradients are still the eager ones; with dropout on, a seeded step repeats itself (the
    recomputed forward draws the masks the first one drew)."""
    model, _ = _model(dropout=0.1)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    use_compiled_training(model, "on", backend=counting)
    traces = _traces(*SHAPES[0], seed=0)
    dropped = []
    for _ in range(2):
        torch.manual_seed(5)
        dropped.append(_loss_and_grads(model, traces))
    assert dropped[0][0] == dropped[1][0]
    _assert_close(dropped[0][1], dropped[1][1], 0.0)
    torch._dynamo.reset()  # a fresh count for the model below
    counting.compiles = 0
    model = _model()[0]  # dropout 0 from here on: eager and compiled gradients comparable
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_compiled_training(model, "on", backend=counting)
    for i, shape in enumerate(SHAPES[:2]):
        traces = _traces(*shape, seed=i)
        loss, grads = _loss_and_grads(model, traces)
        use_compiled_training(model, "off")
        eager_loss, eager_grads = _loss_and_grads(model, traces)
        use_compiled_training(model, "on", backend=counting)
        assert loss == pytest.approx(eager_loss, rel=1e-6)
        _assert_close(grads, eager_grads, 1e-6)
    assert counting.compiles == 3


def test_a_failing_compilation_names_the_setting(monkeypatch):
    """A backend that fails: the micro-step raises a ``RuntimeError`` that says ``compile_training = "off"`` trains
    without compiling."""

    def failing(graph, example_inputs):
        raise OSError("no compiler here")

    torch._dynamo.reset()
    model, _ = _model()
    use_compiled_training(model, "on", backend=failing)
    with pytest.raises(RuntimeError, match='compile_training = "off"'):
        _loss_and_grads(model, _traces(4, 40, 10, seed=0))
    torch._dynamo.reset()


def test_a_copy_trains_eagerly():
    """A deep copy or a pickled and loaded model holds no compiled forward (it would run the original's): it trains
    eagerly until ``use_compiled_training`` is called on it; the original keeps its own."""
    import copy
    import pickle

    model, _ = _model()
    use_compiled_training(model, "on", backend="aot_eager")
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert compiled_of(twin) is None and training_forward(twin) is twin
        assert use_compiled_training(twin, "on", backend="aot_eager") and compiled_of(twin) is not None
    assert compiled_of(model) is not None


def test_settings():
    """``use_compiled_training`` takes on or off (``RunConfig.compile_training``: off by default, refused by name
    otherwise) and keeps one compiled forward per model; the wrapper is no submodule of the model."""
    model, _ = _model()
    with pytest.raises(ValueError, match="compile_training must be on or off"):
        use_compiled_training(model, "auto")
    assert not use_compiled_training(model, "off") and compiled_of(model) is None
    assert use_compiled_training(model, "on")
    compiled = compiled_of(model)
    assert use_compiled_training(model, "on") and compiled_of(model) is compiled  # kept: one compile per process
    # the compiled wrapper is no submodule of the model: its parameters and state dict are the model's alone
    assert not any("_orig_mod" in name for name, _ in model.named_parameters())
    assert not any("_orig_mod" in key for key in model.state_dict())
    from fedspear.config import ConfigError, RunConfig, load_config

    assert RunConfig().compile_training == "off"
    with pytest.raises(ConfigError, match="compile_training"):
        load_config(compile_training="auto")


@pytest.mark.gpu
def test_inductor_on_a_gpu_trains_within_bf16_rounding():
    """On a CUDA GPU, inductor (fused kernels) with the model as ``load_base`` and ``add_lora`` make it there: base
    weights in bf16, the adapter in fp32 taking its bf16 input as it comes, dropout 0.1. With the dropout modules in
    eval mode, for every shape the loss within 2% of eager's and the LoRA gradients within 5% of eager ones by norm
    (in bf16 both are rounding's: on the CPU eager and compiled bf16 gradients are 1.8% and 1.6% from fp32 ones and
    2.0% from each other); one compilation for every shape. With dropout on, a seeded step repeats itself and drops
    (another loss than without dropout)."""
    from fedspear.runtime.model import bf16_parameters

    torch._dynamo.reset()
    base, _ = tiny_model()
    bf16_parameters(base)
    base.cuda()
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1), seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    compiles = []

    def counting_inductor(graph, example_inputs):
        compiles.append(1)
        return torch._inductor.compile(graph, example_inputs)

    def step(traces, dropout: bool):
        model.train()
        for module in ([] if dropout else dropout_modules(model)):
            module.eval()
        model.zero_grad(set_to_none=True)
        batch = pack(traces, 0, "cuda")
        logp = completion_logprobs(model, batch, "bf16")
        loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
        loss.backward()
        return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}

    for i, shape in enumerate(SHAPES):
        traces = _traces(*shape, seed=i)
        use_compiled_training(model, "off")
        eager_loss, eager_grads = step(traces, dropout=False)
        use_compiled_training(model, "on", backend=counting_inductor)
        loss, grads = step(traces, dropout=False)
        assert loss == pytest.approx(eager_loss, rel=2e-2)
        difference = sum(float(((grads[n] - g) ** 2).sum()) for n, g in eager_grads.items()) ** 0.5
        assert difference <= 5e-2 * sum(float((g ** 2).sum()) for g in eager_grads.values()) ** 0.5
    assert len(compiles) == 1
    dropped = []
    for _ in range(2):
        torch.manual_seed(5)
        dropped.append(step(_traces(*SHAPES[0], seed=0), dropout=True)[0])
    assert dropped[0] == dropped[1] and dropped[0] != pytest.approx(step(_traces(*SHAPES[0], seed=0), False)[0],
                                                                    rel=1e-6)
    torch._dynamo.reset()
