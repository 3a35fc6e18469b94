"""Where the tests find the folder beside the checkout that a public clone does not have: ``../shared`` (the paper's
LaTeX, the full data copies), or the folder ``$FEDSPEAR_SHARED`` names. Every test that reads it carries
:func:`shared_marks` — the ``shared`` marker and a skip, with the reason, where the file is absent — so a clone
without it passes; ``tests/test_clone.py`` runs them against a missing folder to prove it. Stdlib + pytest only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("FEDSPEAR_SHARED") or Path(__file__).resolve().parents[2] / "shared")


def shared_marks(*parts: str) -> list:
    """Marks for a test that reads ``SHARED/<parts>``: ``shared`` and a skip where that path is absent."""
    path = SHARED.joinpath(*parts)
    return [pytest.mark.shared,
            pytest.mark.skipif(not path.exists(), reason=f"{path} not present (a clone without ../shared)")]


def needs_shared(*parts: str):
    """Decorator form of :func:`shared_marks`."""
    def mark(test):
        for m in shared_marks(*parts):
            test = m(test)
        return test
    return mark
