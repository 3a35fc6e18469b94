"""The shared weight copy (fedspear.runtime.shared_copy): one converted file on disk, mapped by every process that
loads the model on a bf16 CPU, holding exactly what the in-process conversion gives."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedspear.runtime.cpu_kernels import store_linear_weights_bf16
from fedspear.runtime.model import autocast, load_base, tiny_model
from fedspear.runtime.shared_copy import copy_path, map_copy


def tiny_qwen2(tokenizer):
    """A 2-layer Qwen2 (q/k/v biases, untied output embedding), random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id))


@pytest.fixture(params=["llama-tied", "qwen2-untied-biases"])
def folder(request, tmp_path, monkeypatch):
    """A local transformers folder (the tiny Llama with tied embeddings, or a tiny Qwen2 with biases and its own
    output embedding) and an empty fedspear cache."""
    model, tokenizer = tiny_model()  # its tokenizer from the usual cache (an empty one would export SmolLM2 again)
    if request.param.startswith("qwen2"):
        model = tiny_qwen2(tokenizer)
    out = tmp_path / "tiny"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "cache"))
    return out


def converted(folder: Path):
    """The reference: the folder's model converted in this process, as load_base did before the shared copy."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    store_linear_weights_bf16(ref)
    return ref


def lives_in(tensor: torch.Tensor, path: Path) -> bool:
    """Whether ``tensor``'s data lie in a mapping of the file ``path``."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return len(fields) == 6 and fields[5] == str(path)
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_the_copy_holds_exactly_the_conversion_and_is_mapped(folder):
    base, tokenizer, dtype = load_base(str(folder), dtype="bf16", device="cpu")
    ref = converted(folder)
    path = copy_path(folder)
    assert dtype == "bf16" and path.exists()
    mine, theirs = dict(base.named_parameters()), dict(ref.named_parameters())
    assert set(mine) == set(theirs) and "lm_head.weight" in mine  # a tied output embedding has its own bf16 copy
    for name, tensor in mine.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
        assert lives_in(tensor, path), f"{name} is not a view of the shared copy"
    assert base.lm_head.weight.dtype == torch.bfloat16 and base.model.embed_tokens.weight.dtype == torch.float32
    biases = [name for name in mine if name.endswith("_proj.bias")]
    assert all(mine[name].dtype == torch.bfloat16 for name in biases)  # Qwen2's q/k/v biases, as linears'
    assert bool(biases) == (base.config.model_type == "qwen2")
    ids = tokenizer(["The capital of France is", "Two and two make"], return_tensors="pt", padding=True)
    with torch.no_grad(), autocast("bf16"):
        assert torch.equal(base(**ids).logits, ref(**ids).logits)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_a_second_process_maps_the_same_file_and_writes_nothing(folder):
    load_base(str(folder), dtype="bf16", device="cpu")
    path = copy_path(folder)
    stamp = path.stat().st_mtime_ns
    code = ("import sys; from fedspear.runtime.model import load_base; "
            "from fedspear.runtime.shared_copy import copy_path; "
            "base, _, _ = load_base(sys.argv[1], dtype='bf16', device='cpu'); "
            "maps = open('/proc/self/maps').read(); print(maps.count(str(copy_path(sys.argv[1]))) > 0)")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300,
                          env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
    assert path.stat().st_mtime_ns == stamp  # mapped as it was, not written again
    assert sorted(p.name for p in path.parent.glob("*.safetensors")) == [path.name]


def test_a_write_into_a_mapped_weight_stays_in_this_process(folder):
    base, _, _ = load_base(str(folder), dtype="bf16", device="cpu")
    path = copy_path(folder)
    before = path.read_bytes()
    weight = base.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        weight.add_(1.0)  # copy-on-write: this process's page changes, the file does not
    assert path.read_bytes() == before
    again, _, _ = load_base(str(folder), dtype="bf16", device="cpu")
    assert not torch.equal(again.model.layers[0].self_attn.q_proj.weight, weight)


def test_a_changed_export_gets_a_new_copy_and_a_wrong_copy_is_written_again(folder, caplog):
    first = copy_path(folder)
    load_base(str(folder), dtype="bf16", device="cpu")
    os.utime(folder / "config.json")  # the export changed (its files' times are part of the name)
    os.utime(folder / "model.safetensors", ns=(1, 1))
    second = copy_path(folder)
    assert second != first
    load_base(str(folder), dtype="bf16", device="cpu")  # the new copy replaces the old one of the same folder
    assert second.exists() and not first.exists()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(second))  # a copy that is not this model's: one tensor of another shape
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(second), metadata={"fedspear_format": "1"})
    with caplog.at_level(logging.WARNING, logger="fedspear.runtime.shared_copy"):
        base, _, _ = load_base(str(folder), dtype="bf16", device="cpu")
    assert "does not match the model" in caplog.text
    ref = converted(folder)
    assert all(torch.equal(t, dict(ref.named_parameters())[n]) for n, t in base.named_parameters())


def test_map_copy_refuses_a_copy_of_another_model_and_changes_nothing(folder, tmp_path):
    load_base(str(folder), dtype="bf16", device="cpu")
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="does not match the model"):
        map_copy(other, copy_path(folder))
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied, still fp32
    assert other.model.layers[0].mlp.up_proj.weight.dtype == torch.float32


def test_an_unwritable_cache_converts_in_this_process(folder, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FEDSPEAR_CACHE", str(blocker))  # <file>/shared cannot be made
    with caplog.at_level(logging.WARNING, logger="fedspear.runtime.shared_copy"):
        base, _, _ = load_base(str(folder), dtype="bf16", device="cpu")
    assert "converting in this process" in caplog.text
    ref = converted(folder)
    assert all(torch.equal(t, dict(ref.named_parameters())[n]) for n, t in base.named_parameters())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_processes_starting_together_write_one_copy_and_map_it(folder):
    """Three processes loading the model at once (a simulation's server and client actor start together): one writes
    the copy under the lock, every one maps that same file, and no temporary file stays."""
    code = ("import sys; from fedspear.runtime.model import load_base; "
            "from fedspear.runtime.shared_copy import copy_path; "
            "base, _, _ = load_base(sys.argv[1], dtype='bf16', device='cpu'); "
            "print(str(copy_path(sys.argv[1])) in open('/proc/self/maps').read())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
    assert [out.strip().splitlines()[-1] for out, _ in outs] == ["True"] * 3
    path = copy_path(folder)
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.name + ".lock"])


@pytest.mark.parametrize("damage", ["cut-short", "dtype-swapped"])
def test_a_damaged_or_wrong_dtype_copy_is_written_again(folder, damage, caplog):
    """A copy cut short (a crash while it was written elsewhere) or holding a tensor in another dtype (a conversion
    that changed without a new format) is not mapped: it is written again, and the model is the conversion's."""
    from safetensors.torch import load_file, save_file

    load_base(str(folder), dtype="bf16", device="cpu")
    path = copy_path(folder)
    if damage == "cut-short":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        tensors = load_file(str(path))
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].float()
        save_file(tensors, str(path), metadata={"fedspear_format": "1", "kind": "cpu-bf16-linears"})
    with caplog.at_level(logging.WARNING, logger="fedspear.runtime.shared_copy"):
        base, _, _ = load_base(str(folder), dtype="bf16", device="cpu")
    assert "writing it again" in caplog.text
    ref = converted(folder)
    theirs = dict(ref.named_parameters())
    assert all(t.dtype == theirs[n].dtype and torch.equal(t, theirs[n]) for n, t in base.named_parameters())
    assert all(lives_in(t, path) for t in base.parameters())


def test_a_hub_id_is_converted_in_this_process(monkeypatch, tmp_path):
    """A model named by a hub id has no folder of ours: converted as before, nothing written to the cache."""
    from fedspear.runtime.shared_copy import shared_bf16_weights

    model, _ = tiny_model()
    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "cache"))
    assert shared_bf16_weights(model, "someorg/some-model") is None
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.embed_tokens.weight.dtype == torch.float32
    assert not (tmp_path / "cache").exists()  # nothing written (the tokenizer was read before the cache was set)


def test_what_a_stopped_writer_left_is_removed(folder):
    """``.<copy>.<pid>.tmp`` of a writer that is gone is removed by the next load."""
    path = copy_path(folder)
    path.parent.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = path.with_name(f".{path.name}.{gone.stdout.strip()}.tmp")
    left.write_bytes(b"half a copy")
    load_base(str(folder), dtype="bf16", device="cpu")
    assert not left.exists() and path.exists()
