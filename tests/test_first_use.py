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
