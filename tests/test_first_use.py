"""What a new user meets first (issue 43): commands that answer at once, libraries' progress bars kept quiet, and bad
input that ends in one line, before any work, with nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import fedspear

SRC = os.path.dirname(os.path.dirname(fedspear.__file__))
HEAVY = ("torch", "transformers", "peft", "flwr", "numpy")


def _cli(*args: str, env: dict | None = None, cwd=None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``fedspear <args>`` in a fresh interpreter; also return which of ``HEAVY`` it imported."""
    code = ("import sys\nfrom fedspear.cli import app\n"
            f"sys.argv = ['fedspear', *{list(args)!r}]\n"
            "try:\n    app()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            f"print('IMPORTED', sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})), file=sys.stderr)\n"
            "sys.exit(code)\n")
    environ = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=cwd,
                          timeout=300)
    line = [ln for ln in done.stderr.splitlines() if ln.startswith("IMPORTED ")][-1]
    return done, json.loads(line.removeprefix("IMPORTED ").replace("'", '"'))


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["eval", "--help"], ["compare", "--help"],
                                  ["run", "--set", "colour=red"], ["run", "--task", "mnist"]])
def test_help_and_bad_config_answer_without_torch(args):
    """``--help`` and a config error need none of the model code: torch, transformers, peft, Flower and numpy stay
    unimported (STYLE habit 14; ``farm-bench`` gives the seconds)."""
    done, imported = _cli(*args)
    assert done.returncode == (0 if "--help" in args else 2), done.stderr
    assert imported == [], imported


def test_unknown_key_names_the_file_and_the_near_key(tmp_path):
    """One line naming the file and the key it was probably meant to be, not the 70 known keys."""
    from fedspear.config import ConfigError, load_config

    path = tmp_path / "my.toml"
    path.write_text('learning_rate = 1e-4\nnum_client = 3\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: unknown config keys 'learning_rate' (did you mean 'lr'?), 'num_client' "
                              "(did you mean 'num_clients'?)")
    assert "\n" not in message and "aggregation" not in message and len(message) - len(str(path)) < 200
    with pytest.raises(ConfigError, match=r"^--set: unknown config key 'colour'; "):
        load_config(path=None, colour="red")


def test_config_toml_labels_only_task_defaults_as_such():
    """``None`` is "(task default)" only for the keys a task fills in; ``data_dir``, ``round0_from`` and the other
    plain optional keys are "(not set)"."""
    from fedspear.config import TASK_DEFAULT_KEYS, RunConfig

    text = RunConfig().to_toml()
    assert "# tau = (task default)" in text and "# group_size = (task default)" in text
    assert "# data_dir = (not set)" in text and "# round0_from = (not set)" in text
    resolved = RunConfig(task="strategy_qa").resolved()
    assert {k for k in TASK_DEFAULT_KEYS if getattr(resolved, k) is None} == {"group_size", "kl_beta"}
    assert "tau = 24" in resolved.to_toml()


def _invoke(*args):
    from typer.testing import CliRunner

    from fedspear.cli import app

    return CliRunner().invoke(app, list(args))


def _one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output


TINY = ["--model", "tiny-random", "--rounds", "1", "--clients", "2", "--set", "clients_per_round=1"]


def test_output_dir_that_is_a_file_is_one_line_and_keeps_the_file(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    _one_line_error(_invoke("run", *TINY, "-o", str(target)), f"output_dir {target} is an existing file")
    assert target.read_text() == "mine\n"
    _one_line_error(_invoke("run", *TINY, "-o", str(target / "run")), f"{target} is a file, not a folder")


def test_output_dir_on_a_read_only_place_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """A read-only file system answers ``access(W_OK)`` with EROFS; simulated here for ``tmp_path`` (tests run as
    root, whom file modes do not stop)."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(tmp_path)) and mode & os.W_OK
                        else real(p, mode, **kw))
    _one_line_error(_invoke("run", *TINY, "-o", str(tmp_path / "a" / "run")),
                    f"cannot write in {tmp_path} (read-only file system or no permission)")
    assert list(tmp_path.iterdir()) == []


def test_eval_output_that_is_a_folder_fails_before_the_evaluation(tmp_path, monkeypatch):
    import fedspear.evaluation

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the evaluation ran before the output was checked")

    monkeypatch.setattr(fedspear.evaluation.Evaluator, "__init__", no_evaluation)
    _one_line_error(_invoke("eval", "--model", "tiny-random", "-o", str(tmp_path)), f"-o {tmp_path} is a folder")
    monkeypatch.chdir(tmp_path)  # the default output, ./eval-<model>-<task>-<split>.json, as a folder
    (tmp_path / "eval-tiny-random-arc_challenge-test.json").mkdir()
    _one_line_error(_invoke("eval", "--model", "tiny-random"), "eval-tiny-random-arc_challenge-test.json is a folder")


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable", "unknown"])
def test_unknown_hub_id_fails_at_once_and_writes_nothing(tmp_path, monkeypatch, how):
    """Not in the cache: with HF_HUB_OFFLINE set, or a Hub that cannot be reached or does not know the id, the run
    stops in the preflight with one line (no retries) and no run folder."""
    import httpx
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    asked = []

    def model_info(model, timeout=None):
        asked.append((model, timeout))
        if how == "unknown":
            url = f"https://huggingface.co/api/models/{model}"
            raise RepositoryNotFoundError("404 Client Error",
                                          response=httpx.Response(404, request=httpx.Request("GET", url)))
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", how == "HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    run = tmp_path / "run"
    expected = {"HF_HUB_OFFLINE": "is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
                "unreachable": "is not in the Hugging Face cache and the Hub cannot be reached (OSError)",
                "unknown": "no such model on the Hugging Face Hub"}[how]
    result = _invoke("run", "--model", "nobody/no-such-model", "-o", str(run))
    _one_line_error(result, f"model 'nobody/no-such-model' {expected}".replace("' no such", "': no such"))
    assert not run.exists()
    assert asked == ([] if how == "HF_HUB_OFFLINE" else [("nobody/no-such-model", 10)])


@pytest.mark.parametrize("command", ["eval", "eval-lm-eval", "bench", "chat"])
def test_every_command_that_loads_a_model_fails_at_once_on_an_unreachable_hub_id(tmp_path, monkeypatch, command):
    """eval (both harnesses), bench and chat check a hub id as run does: one line, before any work, nothing written
    (no evaluation file, no trace store, no bench result)."""
    import huggingface_hub
    from huggingface_hub import constants

    asked = []

    def model_info(model, timeout=None):
        asked.append((model, timeout))
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.chdir(tmp_path)
    model = ["--model", "nobody/no-such-model"]
    args = {"eval": ["eval", *model, "-o", "out.json"],
            "eval-lm-eval": ["eval", *model, "--harness", "lm-eval", "-o", "out.json"],
            "bench": ["bench", *model, "--quick", "--no-round", "--output", "out.json"],
            "chat": ["chat", *model, "--traces", "traces.db"]}[command]
    _one_line_error(_invoke(*args), "model 'nobody/no-such-model' is not in the Hugging Face cache and the Hub "
                                    "cannot be reached (OSError)")
    assert asked == [("nobody/no-such-model", 10)]
    assert list(tmp_path.iterdir()) == []


def test_device_cuda_without_a_gpu_writes_no_config(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA GPU here: device = cuda is valid")
    run = tmp_path / "run"
    _one_line_error(_invoke("run", *TINY, "--set", "device=cuda", "-o", str(run)), "device = cuda, but torch")
    assert not run.exists()


def _commands():
    import typer

    from fedspear.cli import app

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(typer.main.get_command(app), []))


def test_every_help_text_survives_rich_markup():
    """Help is rendered as rich markup: a literal ``[`` must be written ``\\[`` or rich takes ``[harness]`` for a
    style and drops it ("extra )"). Every command's and parameter's help, rendered, keeps its text."""
    from rich.text import Text

    eaten = []
    for path, command in _commands():
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        for text in texts:
            if Text.from_markup(text).plain != text.replace("\\[", "["):
                eaten.append((" ".join(path), text))
    assert eaten == []


def test_help_shows_brackets_and_positional_arguments():
    """``eval --harness`` keeps "extra [harness]", ``compare --grid`` its "[axes], [base], [per_task.<task>]", and
    each positional argument's help is printed (typer 0.20 under click 8.5 dropped it;
    ``fedspear.cli._keep_argument_help``)."""
    wide = {"COLUMNS": "250"}
    out, _ = _cli("eval", "--help", env=wide)
    assert "extra [harness])" in out.stdout
    assert "a run directory (its last round's adapter)" in out.stdout
    assert "note, [axes], [base], [per_task.<task>])" in _cli("compare", "--help", env=wide)[0].stdout
    assert "an opt-in model, e.g. qwen2.5-coder-1.5b" in _cli("models", "install", "--help", env=wide)[0].stdout
    assert "folder for ca.pem" in _cli("certs", "--help", env=wide)[0].stdout


def test_libraries_progress_bars_are_silenced_by_their_own_switch(tmp_path, monkeypatch, capfd):
    """transformers' "Writing model shards" and "Loading weights" bars (what ``make run`` printed between fedspear's
    lines while exporting and loading SmolLM2) show with the libraries' defaults and not after
    ``quiet_libraries()`` — which the CLI runs for every command and whose environment switch the engine's workers
    inherit; fedspear's own progress (rich) is not tqdm and stays."""
    import huggingface_hub
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedspear.cli import quiet_libraries

    def save_and_load(folder):
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2)
        LlamaForCausalLM(config).save_pretrained(folder)
        LlamaForCausalLM.from_pretrained(folder)
        return capfd.readouterr().err

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    transformers.utils.logging.enable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()
    try:
        loud = save_and_load(tmp_path / "a")
        assert "Writing model shards" in loud and "Loading weights" in loud
        quiet_libraries()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # what the engine's workers inherit
        quiet = save_and_load(tmp_path / "b")
        assert "Writing model shards" not in quiet and "Loading weights" not in quiet
    finally:
        transformers.utils.logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()


def test_console_without_a_terminal_keeps_lines_whole():
    """Piped to a file, a 200-character line stays one line (rich would wrap it at 80 columns mid-field)."""
    import io

    from fedspear.cli import rounds_text, stderr_console

    console = stderr_console()
    console.file = io.StringIO()
    assert not console.is_terminal and console.soft_wrap
    line = "round 1: " + " ".join(f"field_{i}=0.123" for i in range(20))
    console.print(line, markup=False)
    assert console.file.getvalue() == line + "\n"
    assert (rounds_text(1), rounds_text(0), rounds_text(4)) == ("1 round", "0 rounds", "4 rounds")


def test_log_records_print_above_live_bars_not_onto_them(monkeypatch):
    """In a terminal, a warning logged while the bars are live goes through rich's console (printed above the bars,
    on a line of its own) rather than straight onto the terminal's current row."""
    import io
    import logging

    from rich.console import Console
    from rich.progress import Progress

    from fedspear.cli import LogsAboveBars

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)  # the process's stderr: what a StreamHandler made now holds
    handler = logging.StreamHandler()
    logger = logging.getLogger("fedspear.test-bars")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        console = Console(file=terminal, force_terminal=True, width=60)
        with Progress(console=console, transient=False) as bars:  # without it: glued onto the bar's row
            bars.add_task("federated rounds", total=2)
            logger.warning("client 2 dropped")
        assert "\x1b[0mclient 2 dropped\n" in terminal.getvalue()
        with Progress(console=console, transient=False) as bars, LogsAboveBars() as moved:
            bars.add_task("federated rounds", total=2)
            assert [h for h, _ in moved.moved] == [handler] and handler.stream is sys.stderr
            logger.warning("client 3 dropped")
        assert handler.stream is terminal  # pointed back
    finally:
        logger.removeHandler(handler)
    # rich erased the bar's row (ESC[2K) and printed the record on it, then redrew the bar below
    assert "\r\x1b[2Kclient 3 dropped\n" in terminal.getvalue()


def test_models_list_names_tiny_random():
    done, _ = _cli("models", "list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tiny-random ") and "built-in" in lines[0]
    assert any(line.startswith("smollm2-135m ") for line in lines)
