"""An adapter as it is stored and travels: ``name → array`` (numpy arrays or torch tensors), and the one check that
two of them have the same layout (names, then shapes) — used where the model loads one, where the server checks a
reply and averages, and where a run resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def layout_mismatch(reference: Mapping[str, Any], other: Mapping[str, Any], limit: int = 5) -> str | None:
    """How ``other`` differs from ``reference``, as one line; None when both hold the same names with the same shapes.

    Names first (``"missing [...], unexpected [...]"``, at most ``limit`` of each, sorted, ``...`` when cut), then the
    first shape that differs (``"tensor 'x' has shape (3, 2), expected (2, 3)"``). Dtypes and values are not compared.
    """
    missing = sorted(set(reference) - set(other))
    extra = sorted(set(other) - set(reference))
    if missing or extra:
        cut = lambda names: f"{names[:limit]}{' ...' if len(names) > limit else ''}"  # noqa: E731
        return f"missing {cut(missing)}, unexpected {cut(extra)}"
    for name, ref in reference.items():
        shape, expected = tuple(np.shape(other[name])), tuple(np.shape(ref))
        if shape != expected:
            return f"tensor {name!r} has shape {shape}, expected {expected}"
    return None
