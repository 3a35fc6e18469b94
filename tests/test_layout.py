"""The package's rooms keep their boundaries (STYLE.md habit 4): only ``fedspear.fl`` imports Flower, and the light
core (tasks, feedback, certificates) imports no torch either. Every module is walked, including the algorithm modules
and those the CLI imports inside its commands, so a new module cannot slip past."""

from __future__ import annotations

import ast
import re
import os
import subprocess
import sys
from pathlib import Path

import fedspear

PACKAGE = Path(fedspear.__file__).parent
FLOWER = ("flwr", "flwr_datasets")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, package: str, module_level: bool = False) -> set[str]:
    """Every module ``path`` imports, anywhere in it (or only at module level), relative ones resolved."""
    names = set()
    tree = ast.parse(path.read_text())
    for node in (tree.body if module_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}  # `from . import x` imports module x
    return names


def test_walk_finds_every_room():
    modules = _modules()
    assert len(modules) > 40
    for room in ("fedspear.algorithms.spear", "fedspear.server.aggregation", "fedspear.human.chat",
                 "fedspear.experiments.compare.grid", "fedspear.fl.strategy", "fedspear.tasks.arc_challenge"):
        assert room in modules


def test_only_fl_imports_flower():
    """No module outside ``fedspear.fl`` imports flwr or flwr_datasets; none imports ``fedspear.fl`` either, except
    the rooms above it — the CLI and ``fedspear.experiments``, which run federations — inside their functions."""
    bad = []
    for name, path in _modules().items():
        if name == "fedspear.fl" or name.startswith("fedspear.fl."):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = _imports(path, package)
        bad += [f"{name} imports {m}" for m in imported if m.split(".")[0] in FLOWER]
        above = name == "fedspear.cli" or name.startswith("fedspear.experiments")
        edge = _imports(path, package, module_level=True) if above else imported
        bad += [f"{name} imports {m}" for m in edge if m == "fedspear.fl" or m.startswith("fedspear.fl.")]
    assert not bad, bad


def test_every_module_outside_fl_loads_without_flower():
    """The same, by running it: import every module outside ``fedspear.fl`` and look at what got loaded."""
    names = [n for n in _modules() if not (n == "fedspear.fl" or n.startswith("fedspear.fl."))]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FLOWER!r})\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def test_light_core_imports_no_torch():
    """Tasks, feedback and the deployment certificates load without torch, Flower or datasets (a SuperLink host or a
    feedback service needs none of them)."""
    code = ("import sys, fedspear.feedback, fedspear.tasks, fedspear.fl.certs\n"
            "bad = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'flwr', 'flwr_datasets', 'datasets'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


def _env() -> dict[str, str]:
    src = str(PACKAGE.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def test_readme_layout_names_every_module():
    """README's layout table lists every module (``tasks/*`` and ``algorithms/*`` stand for their folders) and
    nothing that is gone."""
    readme = (PACKAGE.parents[1] / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in section.splitlines():
        if row.startswith("|") and row.count("|") >= 4:
            named |= set(re.findall(r"`([a-z_/]+\*?)`", row.split("|")[2]))
    packages = {"", "fl", "server", "human", "runtime", "experiments", "experiments/compare", "tasks", "algorithms"}
    expected = set()
    for name in _modules():
        rel = name.removeprefix("fedspear").lstrip(".").replace(".", "/")
        folder = rel.split("/")[0]
        if folder in ("tasks", "algorithms"):
            expected.add(f"{folder}/*")
        elif rel not in packages:
            expected.add(rel)
    assert expected - named == set(), f"modules missing from README's layout: {sorted(expected - named)}"
    assert named - expected == set(), f"README's layout names modules that do not exist: {sorted(named - expected)}"
