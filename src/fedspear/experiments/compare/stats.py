"""Statistics of a comparison: seed means, seed-paired and item-paired 95% intervals (Wilson / normal / t).

An accuracy's normal interval over items is cut at 0 and 1 (with 2 of 4 items right it read 50.0 [-6.6, 106.6] %).
Cutting keeps at least the coverage: the true value lies within the range, so the part cut off never held it; with
the hundreds of items of a real evaluation nothing is cut. Intervals of differences are left symmetric (mean ±
half-width), as ``margin_gap`` and ``scripts/margins_across_tasks.py`` read them back.
"""

from __future__ import annotations

import math

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def paired_ci(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences with a 95% t interval over the pairs → ``(mean, low, high)``.

    One pair has no interval (``low = high = nan``).
    """
    m, s = mean_std(diffs)
    n = len(diffs)
    if n < 2:
        return m, math.nan, math.nan
    half = T_975.get(n - 1, 1.96) * s / math.sqrt(n)
    return m, m - half, m + half


def item_mean_ci(outcomes: list[str], z: float = 1.959964) -> tuple[float, float, float]:
    """Accuracy over the same items answered in several runs (one "1"/"0" string per run, ``evaluate``'s
    ``correct_<metric>``), with a 95% normal interval over items → ``(mean, low, high)``, within [0, 1].

    Each item's score is its mean over the runs (seeds); the interval is mean ± z · sd / √n over the n items, cut to
    [0, 1], so it measures how much the figure would move on other items, not how it would move with other seeds.

    Raises:
        ValueError: no strings, strings of different lengths, empty strings or characters other than 0/1.
    """
    return _items_ci([[int(c) for c in _check_outcomes(o, outcomes)] for o in outcomes], z, cut=True)


def paired_gain(before: str, after: list[str], z: float = 1.959964) -> tuple[float, float, float]:
    """Gain in accuracy of ``after`` (one outcome string per seed) over ``before`` on the same items, paired by item,
    with a 95% normal interval over items → ``(gain, low, high)`` (fractions; × 100 for points).

    Item i contributes d_i = mean over seeds of after_s[i] − before[i] ∈ [−1, 1]; gain = mean d_i, interval
    gain ± z · sd(d) / √n. Pairing removes the between-item variance that two separate Wilson intervals would count.

    Raises:
        ValueError: as :func:`item_mean_ci`, including ``before`` of another length.
    """
    _check_outcomes(before, [before, *after])
    return item_paired_diff(after, [before] * len(after), z)


def item_paired_diff(a: list[str], b: list[str], z: float = 1.959964) -> tuple[float, float, float]:
    """Accuracy of runs ``a`` minus runs ``b`` on the same items, ``a[s]`` paired with ``b[s]`` (same seed: same
    partition, prompts and evaluation items) and item by item, with a 95% normal interval over items →
    ``(diff, low, high)`` (fractions).

    Item i contributes d_i = mean over s of a_s[i] − b_s[i]; diff = mean d_i, interval diff ± z · sd(d) / √n. With
    one or two seeds this is the only interval available; it covers the choice of questions, not of seeds.

    Raises:
        ValueError: ``a`` and ``b`` of different lengths, or outcomes as in :func:`item_mean_ci`.
    """
    if len(a) != len(b):
        raise ValueError(f"item_paired_diff: {len(a)} runs against {len(b)}; pair them seed by seed")
    group = [*a, *b]
    rows = [[int(x) - int(y) for x, y in zip(_check_outcomes(sa, group), _check_outcomes(sb, group))]
            for sa, sb in zip(a, b)]
    return _items_ci(rows, z, cut=False)


def margin_gap(first: tuple[float, float, float], second: tuple[float, float, float]) -> tuple[float, float, float]:
    """How much larger a margin is in one experiment than in another on different items (e.g. SPEAR minus a
    baseline on StrategyQA against the same on ARC-Challenge): ``first`` and ``second`` are ``(diff, low, high)``
    95% normal intervals such as :func:`item_paired_diff` gives; the two are independent (no item in common), so
    the gap ``first − second`` has half-width √(h₁² + h₂²), each h = (high − low) / 2 → ``(gap, low, high)``.

    Raises:
        ValueError: an interval that does not contain its own estimate, or is not finite.
    """
    halves = []
    for diff, low, high in (first, second):
        if not all(math.isfinite(x) for x in (diff, low, high)) or not low <= diff <= high:
            raise ValueError(f"margin_gap: ({diff}, {low}, {high}) is not a finite interval around its estimate")
        halves.append((high - low) / 2)
    gap = first[0] - second[0]
    half = math.hypot(*halves)
    return gap, gap - half, gap + half


def _check_outcomes(outcome: str, group: list[str]) -> str:
    if not group or not outcome or any(len(o) != len(outcome) for o in group) or set(outcome) - {"0", "1"}:
        raise ValueError("per-item outcomes must be non-empty strings of 0/1 of one length (the same items)")
    return outcome


def _items_ci(rows: list[list[int]], z: float, cut: bool) -> tuple[float, float, float]:
    """Mean of the items' scores (each its mean over ``rows``) ± z · sd / √n; ``cut``: within [0, 1] (accuracies)."""
    if not rows:
        raise ValueError("per-item outcomes must be non-empty strings of 0/1 of one length (the same items)")
    n = len(rows[0])
    scores = [sum(col) / len(rows) for col in zip(*rows)]
    m = sum(scores) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in scores) / (n - 1)) if n > 1 else math.nan
    half = z * sd / math.sqrt(n)
    if not cut:
        return m, m - half, m + half
    return m, max(m - half, 0.0), min(m + half, 1.0)  # a nan half-width (one item) stays nan: max / min return it
