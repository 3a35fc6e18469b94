"""What a GPU run decides without needing a GPU to decide it: bf16 parameters with an fp32 adapter
(``runtime.model.bf16_parameters``), when ``gradient_checkpointing = "auto"`` checkpoints (``needs_checkpointing``, a
pure function of parameter count, activations estimate and free memory), and how many simulated clients share a GPU
(``fl.simulation.backend_config``, counted by Flower's own ``pool_size_from_resources``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedspear.config import ConfigError, RunConfig
from fedspear.runtime.model import (ACTIVATION_SHARE, CHECKPOINTING_ABOVE, LoraSettings, add_lora, autocast,
                                    bf16_parameters, contiguous_head_input, get_adapter, load_base,
                                    needs_checkpointing, tiny_model,
                                    training_activation_bytes, use_gradient_checkpointing)

QWEN_1_5B = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, head_dim=128, vocab_size=151936)


def test_bf16_parameters_keep_buffers_ties_and_an_fp32_adapter():
    """Every parameter bf16, RoPE's inverse frequencies (a buffer) untouched, the tied output embedding still the
    input one; peft's adapter on top is fp32, gets fp32 gradients under bf16 autocast, and travels as fp32 arrays."""
    base, _ = tiny_model()
    buffers = {n: b.clone() for n, b in base.named_buffers()}
    assert bf16_parameters(base) == len(list(base.parameters()))
    assert {p.dtype for p in base.parameters()} == {torch.bfloat16}
    assert all(torch.equal(b, buffers[n]) and b.dtype == buffers[n].dtype for n, b in base.named_buffers())
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1), seed=0)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n and p.dtype == torch.float32 for n, p in lora.items())
    for name, p in lora.items():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.train()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with autocast("bf16", "cpu"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in lora.values())
    assert {a.dtype for a in get_adapter(model).values()} == {np.dtype("float32")}


class _Casts(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls by (from dtype, to dtype)."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            key = (args[0].dtype, kwargs.get("dtype"))
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


def _casting(model, enabled: bool) -> None:
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = enabled


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_an_adapter_over_bf16_weights_takes_its_input_in_bf16_with_the_same_outputs_and_gradients(dropout):
    """Over bf16 weights (as a GPU holds them) peft's cast of each LoRA input to fp32, which autocast casts back, is
    off: 2 layers × 7 projections = 14 fewer casts each way per forward, lora_A sees bf16, and the logits and the
    adapter's gradients are bitwise those with the casts (bf16 → fp32 → bf16 is exact), with the CPU's dropout too
    (``FastDropout``'s masks for a seed do not depend on the dtype). Over fp32 weights nothing is changed."""
    base, _ = tiny_model()
    bf16_parameters(base)
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=dropout), seed=0)
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert len(layers) == 14 and not any(m.cast_input_dtype_enabled for m in layers)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    seen: list = []
    hooks = [m.lora_A["default"].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
             for m in layers]
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = {}
    for casting in (True, False):
        _casting(model, casting)
        casts = _Casts()
        model.eval()
        with torch.no_grad(), autocast("bf16", "cpu"), casts:
            logits = model(input_ids=ids).logits
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the dropout's masks
        with autocast("bf16", "cpu"):
            model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs[casting] = (casts.counts, logits, grads, list(seen))
        seen.clear()
    for hook in hooks:
        hook.remove()
    (cast_counts, cast_logits, cast_grads, cast_seen), (counts, logits, grads, inputs) = runs[True], runs[False]
    assert set(cast_seen) == {torch.float32} and set(inputs) == {torch.bfloat16} and len(inputs) == 2 * 14
    assert cast_counts[(torch.bfloat16, torch.float32)] - counts.get((torch.bfloat16, torch.float32), 0) == 14
    assert cast_counts[(torch.float32, torch.bfloat16)] - counts[(torch.float32, torch.bfloat16)] == 14
    assert torch.equal(logits, cast_logits)
    assert grads.keys() == cast_grads.keys() and all(torch.equal(grads[n], cast_grads[n]) for n in grads)
    fp32 = add_lora(tiny_model()[0], LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    assert all(m.cast_input_dtype_enabled for m in fp32.modules() if hasattr(m, "cast_input_dtype_enabled"))


class _Products(TorchDispatchMode):
    """Records the matrix products (``mm`` / ``bmm``) with a ``[H, V]`` operand, V the tiny model's vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.calls = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm") and args[1].shape[-1] == self.vocab:
            self.calls.append((name, tuple(args[1].shape), args[1].stride()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_lm_head_multiplies_the_last_positions_as_one_product_not_one_per_row(dtype):
    """``logits_to_keep = 1`` slices ``hidden[:, -1:, :]``; torch's matmul would run that as ``bmm`` against the head
    weight expanded to one copy per row (stride 0). With ``load_base``'s pre-hook it is one ``mm`` — with bf16
    activations (every parameter bf16, as on a GPU) and with fp32 ones — and the logits are those of every position's,
    sliced."""
    model, _, _ = load_base("tiny-random", "fp32", "cpu")
    if dtype == "bf16":
        bf16_parameters(model)
    model.requires_grad_(False)  # frozen, as under an adapter (a weight needing its gradient makes matmul fold)
    assert contiguous_head_input(model) and len(model.get_output_embeddings()._forward_pre_hooks) == 1  # once
    vocab = model.config.vocab_size
    ids = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(0))
    model.eval()
    for hooked in (True, False):
        products = _Products(vocab)
        head = model.get_output_embeddings()
        saved = dict(head._forward_pre_hooks)
        if not hooked:
            head._forward_pre_hooks.clear()
        with torch.no_grad(), autocast(dtype, "cpu"):
            with products:
                last = model(input_ids=ids, logits_to_keep=1).logits
            every = model(input_ids=ids).logits
        head._forward_pre_hooks.update(saved)
        assert last.shape == (3, 1, vocab)
        torch.testing.assert_close(last, every[:, -1:], rtol=0, atol=1e-2 if dtype == "bf16" else 1e-5)
        names = [name for name, _, _ in products.calls]
        if hooked:
            assert names == ["mm"]
        else:  # what the hook prevents: one product per row against a stride-0 copy of the head (torch 2.13's rule;
            # should a later torch fold such inputs itself, this arm fails and the hook can go)
            assert names == ["bmm"] and products.calls[0][1][0] == 3 and products.calls[0][2][0] == 0


def test_the_activations_estimate_by_hand():
    """Qwen2.5-1.5B per token and layer: 44·1536 + 4·(2·128) + 11·8960 = 67,584 + 1,024 + 98,560 = 167,168 bytes.
    One row of 100 tokens, 28 layers: 100 · 28 · 167,168 = 468,070,400; its logits over a window of 9 (+1 = 10
    positions): 10 · 151,936 · 10 = 15,193,600; sum 483,264,000."""
    assert training_activation_bytes(QWEN_1_5B, rows=1, length=100, window=9) == 483_264_000
    tiny = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=10)  # no head_dim: 64 / 4 = 16, kv = 32
    assert training_activation_bytes(tiny, rows=2, length=3, window=0) == 2 * 3 * 2 * (44 * 64 + 4 * 32 + 11 * 128) \
        + 2 * 1 * 10 * 10


def test_gradient_checkpointing_auto_decides_by_memory_on_a_gpu_and_by_size_on_the_cpu():
    """On the CPU: more than 1B parameters. On a GPU: activations over 0.7 of the memory left, whatever the size —
    the paper preset's micro-step (32 rows of 512 + 256 tokens) needs it on an 80 GB card, the bench's does not."""
    assert ACTIVATION_SHARE == 0.7
    assert needs_checkpointing(CHECKPOINTING_ABOVE + 1, "cpu") and not needs_checkpointing(CHECKPOINTING_ABOVE, "cpu")
    gib = 2**30
    assert not needs_checkpointing(10**10, "cuda", activation_bytes=7 * gib, memory_bytes=10 * gib)  # 7 ≤ 0.7·10
    assert needs_checkpointing(10**6, "cuda", activation_bytes=7.1 * gib, memory_bytes=10 * gib)
    free_h100 = 75 * gib  # an 80 GB card with a 1.5B model in bf16 loaded
    paper = training_activation_bytes(QWEN_1_5B, rows=32, length=768, window=256)
    bench = training_activation_bytes(QWEN_1_5B, rows=8, length=220, window=16)
    assert paper > 100e9 and needs_checkpointing(1_780_000_000, "cuda", paper, free_h100)
    assert bench < 10e9 and not needs_checkpointing(1_780_000_000, "cuda", bench, free_h100)


def test_gradient_checkpointing_auto_leaves_a_small_cpu_model_alone():
    base, _ = tiny_model()
    assert use_gradient_checkpointing(base, "auto", rows=64, length=4096) is False


@pytest.mark.parametrize(("gpus", "share", "actors"), [(0, 1.0, 1), (1, 1.0, 1), (1, 0.5, 2), (1, 0.25, 4),
                                                       (1, 0.2, 5), (1, 0.3, 3), (2, 0.5, 4), (1, 0.9, 1)])
def test_client_gpus_sets_how_many_clients_share_a_gpu(gpus, share, actors, monkeypatch):
    """Flower's own count of actors (``pool_size_from_resources``, one Ray node with the init resources) from the
    backend config: ⌊1 / client_gpus⌋ per GPU, one in all on the CPU (which ignores client_gpus)."""
    import ray
    from flwr.simulation.ray_transport.ray_actor import pool_size_from_resources

    from fedspear.fl.simulation import backend_config

    config = backend_config(RunConfig(client_gpus=share), cpus=2, gpus=gpus)
    init = config["init_args"]
    monkeypatch.setattr(ray, "nodes", lambda: [{"Resources": {"CPU": float(init["num_cpus"]),
                                                              "GPU": float(init["num_gpus"])}}])
    assert pool_size_from_resources(config["client_resources"]) == actors
    assert config["client_resources"]["num_gpus"] == (share if gpus else 0.0)
    assert init["_node_ip_address"] == "127.0.0.1"


@pytest.mark.parametrize("value", [0, -0.5, 1.5])
def test_client_gpus_out_of_range_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="client_gpus"):
        RunConfig(client_gpus=value)


def _card(monkeypatch, mib: int):
    """Make ``eval_batch_rows`` see a CUDA device of ``mib`` MiB of memory (no GPU needed: it reads only the
    device's type and its total memory)."""
    from fedspear.runtime import generation

    monkeypatch.setattr(generation, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=mib * 2**20))


def _shaped(config, dtype=torch.bfloat16):
    """A stand-in for a model of ``config``'s shape with its embeddings in ``dtype`` (what ``eval_batch_rows``
    reads: the config and the element size)."""
    embeddings = SimpleNamespace(weight=torch.empty(0, dtype=dtype))
    return SimpleNamespace(config=config, get_input_embeddings=lambda: embeddings)


def test_the_kv_cache_of_a_row_by_hand():
    """Qwen2.5-1.5B: 2 (keys, values) · 28 layers · 2 key/value heads · 128 · 2 bytes = 28,672 B a position; a
    row of 768: 22,020,096 B. A config without head_dim takes hidden / heads (tiny: 64 / 4 = 16)."""
    from fedspear.runtime.generation import kv_cache_bytes

    assert kv_cache_bytes(QWEN_1_5B, 1) == 28_672
    assert kv_cache_bytes(QWEN_1_5B, 768) == 22_020_096
    assert kv_cache_bytes(QWEN_1_5B, 768, value_bytes=4) == 44_040_192
    tiny = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert kv_cache_bytes(tiny, 10) == 2 * 2 * 2 * 16 * 2 * 10


@pytest.mark.parametrize(("mib", "positions", "dtype", "rows"), [
    (81_559, 300, torch.bfloat16, 256),   # H100, StrategyQA-like: cache of 512 positions, 5.35 GB / 14.7 MB = 364
    (81_559, 600, torch.bfloat16, 128),   # 768 positions: 242
    (81_559, 1_000, torch.bfloat16, 128),  # 1,024 positions: 182
    (81_559, 600, torch.float32, 64),     # fp32 cache: 121
    (143_771, 600, torch.bfloat16, 256),  # H200: 427, capped at 256
    (16_384, 600, torch.bfloat16, 32),    # a 16 GiB card: 1 GiB / 22.0 MB = 48
    (256, 600, torch.bfloat16, 1),        # 16 MiB for a 22 MB row: fewer than 1, still 1
])
def test_eval_batch_auto_on_a_gpu_sizes_the_kv_cache_to_a_sixteenth_of_the_card(monkeypatch, mib, positions, dtype,
                                                                                rows):
    """``eval_batch_size = "auto"`` on a GPU: the largest power of two up to 256 whose KV cache over the compiled
    decode's cache length (positions rounded up to 256) fits in 1/16 of the card's memory, at least 1."""
    from fedspear.runtime.generation import GPU_CACHE_SHARE, GPU_EVAL_BATCH_MAX, eval_batch_rows

    assert (GPU_CACHE_SHARE, GPU_EVAL_BATCH_MAX) == (1 / 16, 256)
    _card(monkeypatch, mib)
    assert eval_batch_rows("auto", _shaped(QWEN_1_5B, dtype), positions) == rows
    assert eval_batch_rows(24, _shaped(QWEN_1_5B, dtype), positions) == 24  # a number is kept as it is, GPU or not


def test_eval_batch_auto_on_the_cpu_is_the_default_before_auto():
    """On a CPU ``"auto"`` is 32, what every run and committed result used before it; a number stays; anything
    else is refused by name."""
    from fedspear.runtime.generation import CPU_EVAL_BATCH, eval_batch_rows

    model, _ = tiny_model()
    assert CPU_EVAL_BATCH == 32
    assert eval_batch_rows("auto", model, 10_000) == 32
    assert eval_batch_rows(7, model, 10) == 7
    for bad in (0, -1, "max", 2.0, True):
        with pytest.raises(ValueError, match="eval_batch_size"):
            eval_batch_rows(bad, model, 10)


def test_eval_batch_size_takes_auto_or_a_number_in_range():
    assert RunConfig().eval_batch_size == "auto"
    assert RunConfig(eval_batch_size=64).eval_batch_size == 64
    for bad, message in ((0, "out of range"), (1025, "out of range"), ("max", 'integer or "auto"'),
                         (32.0, 'integer or "auto"'), (True, 'integer or "auto"')):
        with pytest.raises(ConfigError, match=f"eval_batch_size.*{message}"):
            RunConfig(eval_batch_size=bad)


@pytest.mark.gpu
def test_an_evaluation_on_a_gpu_records_the_batch_auto_chose():
    """On a real GPU the tiny model's evaluation decodes at the batch ``eval_batch_rows`` picks for the card, a power
    of two up to 256 (the tiny model's cache is a few KB a row, so any card holds the cap), and records it."""
    from fedspear.evaluation import evaluate
    from fedspear.runtime.generation import eval_batch_rows
    from fedspear.tasks import get_task, load_split

    model, tok = tiny_model()
    model = add_lora(model.to("cuda"), LoraSettings(r=4, alpha=8, dropout=0.0))
    task = get_task("arc_challenge")
    items, _ = load_split(RunConfig(task="arc_challenge", device="cuda"), "test")
    out = evaluate(model, tok, items[:40], task, dtype_used="bf16", batch_size="auto", max_new_tokens=4)
    assert out["batch_size"] == eval_batch_rows("auto", model, 4_000) == 256
    assert out["n"] == 40


def test_eval_batch_auto_counts_the_logits_generate_keeps_for_scoring(monkeypatch):
    """Where log-likelihood scoring reads every step's logits (a generation config that adds a logits processor),
    a row also holds max_new_tokens × vocabulary × 4 bytes: the tiny model (49,152 entries) at 256 new tokens
    50.3 MB a row, so an H100's 1/16 holds 106 rows → 64; without such a processor its KV cache alone → 256."""
    from fedspear.evaluation import generation_rows
    from fedspear.runtime.generation import eval_batch_rows
    from fedspear.tasks import arc_challenge, strategy_qa

    _card(monkeypatch, 81_559)
    model, _ = tiny_model()
    contexts = [[1] * 200, [1] * 120]
    assert generation_rows(model, contexts, arc_challenge, "auto", 256) == 256
    model.generation_config.repetition_penalty = 1.1  # a processor before fedspear's: every step's logits kept
    assert generation_rows(model, contexts, arc_challenge, "auto", 256) == 64
    assert generation_rows(model, contexts, arc_challenge, "auto", 256, loglik=False) == 256  # not scored
    assert generation_rows(model, contexts, strategy_qa, "auto", 256) == 256  # no log-likelihood on StrategyQA
    assert generation_rows(model, contexts, arc_challenge, 48, 256) == 48
    assert eval_batch_rows("auto", _shaped(QWEN_1_5B), 300, row_bytes=256 * 151_936 * 4) == 16  # 5.3 GB / 170 MB
