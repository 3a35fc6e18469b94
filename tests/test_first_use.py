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
