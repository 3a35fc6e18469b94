"""A clone without ``../shared`` passes its own tests: every test that reads that folder carries the ``shared`` marker
(``tests/shared_dir.py``), and run against a folder that does not exist, each one skips with a reason and none fails.

One subprocess runs only the marked tests (``pytest -m shared``, a few seconds), with ``$FEDSPEAR_SHARED`` pointed at
a missing folder, so CI's own run proves it whether or not ``../shared`` is beside its checkout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).parent
#: a test file that builds a path into the shared folder itself (not through shared_dir) would escape the marker
READS_SHARED = re.compile(r"""/\s*["']shared["']|["'](?:\.\./|/work/)shared\b""")


def _readers() -> list[Path]:
    return sorted(p for p in TESTS.glob("test_*.py") if "shared_dir" in p.read_text(encoding="utf-8"))


def test_every_test_that_reads_shared_goes_through_shared_dir():
    stray = [p.name for p in TESTS.glob("*.py")
             if p.name != "shared_dir.py" and READS_SHARED.search(p.read_text(encoding="utf-8"))]
    assert stray == [], f"build paths into ../shared with tests/shared_dir.py (SHARED, shared_marks): {stray}"
    assert {p.name for p in _readers()} >= {"test_paper_settings.py", "test_tasks.py", "test_partition.py"}


def test_shared_tests_skip_with_a_reason_without_shared(tmp_path):
    report = tmp_path / "junit.xml"
    env = {**os.environ, "FEDSPEAR_SHARED": str(tmp_path / "no-shared-here")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "shared", "-p", "no:cacheprovider",
                           f"--junitxml={report}", *map(str, _readers())],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {}
    for case in cases:
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (
            "failed" if failed else "skipped" if skipped is not None else "passed",
            skipped.get("message", "") if skipped is not None else "")
    assert len(outcomes) >= 4 + 4 + 2  # the LaTeX copies, the full-data partitions, the full-data task checks
    for name, (outcome, reason) in outcomes.items():
        assert outcome == "skipped", (name, outcome)
        assert "no-shared-here" in reason and "not present" in reason, (name, reason)
