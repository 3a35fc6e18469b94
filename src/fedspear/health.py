"""Learning health: what the answers look like round by round, and warnings when they degenerate (no ``flwr``,
no torch).

Accuracy alone can hide a model that stops reasoning: on a binary task a constant "no" scores near the base rate,
and SPEAR can learn bare labels from revisions that only flipped the label (``fedspear.interaction``, Decision on the
guard). So every round records, in ``metrics.jsonl`` (and from there ``report.md``, TensorBoard and ``fedspear
compare``'s summary):

- evaluation (``eval``; :func:`eval_health`): answer length in tokens (``tokens_gen_mean``, ``tokens_gen_median``),
  the share that reasons before its final answer (``reasoning_gen``, the task's ``reasons`` rule), the answer-label
  histogram (``pred_<label>``, unparsed answers not counted) against gold (``gold_<label>``), its entropy in bits
  over the parsed answers (``label_entropy_gen``), the largest label's share of all generated answers
  (``top_label_share_gen``), and the parse and cut-off rates (``parsed_gen``, ``cutoff_gen``);
- training (``health``; :func:`round_health`, SPEAR and Feedback SFT): length and reasoning share of the initial
  answers and of the revisions, the win set's composition (``wins_initial``, ``wins_revised``), the share of right
  revisions that are bare (``bare_share_revised``) and how many the guard dropped (``revisions_guarded``).

Warnings (:func:`warnings_for`; printed under the round's line on the CLI and at the top of ``report.md``):

- **label collapse**: more than ``COLLAPSE_SHARE`` (80%) of a round's generated evaluation answers carry one label;
- **reasoning lost**: the evaluation's reasoning share is below half of round 0's (checked only when round 0's share
  is at least ``MIN_REASONING_SHARE`` = 10%: on ARC / HellaSwag, whose prompts ask for a bare letter, there is
  nothing to lose).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

COLLAPSE_SHARE = 0.8
MIN_REASONING_SHARE = 0.1


def entropy_bits(counts: Sequence[int]) -> float:
    """Shannon entropy (bits) of a histogram; 0 for an empty or one-label histogram.

    >>> round(entropy_bits([1, 1]), 6), round(entropy_bits([3, 1]), 6), entropy_bits([5, 0])
    (1.0, 0.811278, 0.0)
    """
    total = sum(counts)
    if total == 0:
        return 0.0
    return -sum(c / total * math.log2(c / total) for c in counts if c) + 0.0


def eval_health(labels: Sequence[str], answers: Sequence[str | None], golds: Sequence[str],
                tokens: Sequence[int], reasoned: Sequence[bool]) -> dict[str, float]:
    """The evaluation's health figures (module docstring) from its generated answers, one entry per item.

    Args:
        labels: every label of the task (sorted; the histogram's bins).
        answers: the parsed label of each greedy answer (None: unparsed).
        golds: each item's gold label.
        tokens: each answer's length in tokens (EOS included when produced).
        reasoned: whether each answer reasons before its final answer (the task's ``reasons``).
    Returns:
        ``tokens_gen_mean``, ``tokens_gen_median``, ``reasoning_gen``, ``label_entropy_gen``, ``top_label_share_gen``
        and ``gold_<label>`` counts; {} without answers.
    """
    n = len(answers)
    if n == 0:
        return {}
    counts = [sum(a == label for a in answers) for label in labels]
    out: dict[str, float] = {
        "tokens_gen_mean": sum(tokens) / n,
        "tokens_gen_median": float(statistics.median(tokens)),
        "reasoning_gen": sum(map(bool, reasoned)) / n,
        "label_entropy_gen": entropy_bits(counts),
        "top_label_share_gen": max(counts) / n,
    }
    out.update({f"gold_{label}": sum(g == label for g in golds) for label in labels})
    return out


def fmt_count(v: float | None) -> str:
    """A token count or a count of answers for a table: "–" for None, whole numbers rounded; a value halfway between
    two whole numbers (a median of an even number of answers) keeps its ".5" rather than being rounded to the even
    neighbour as Python's ``format`` does.

    >>> fmt_count(None), fmt_count(146.354), fmt_count(132.5), fmt_count(150.0), fmt_count(0.5)
    ('–', '146', '132.5', '150', '0.5')
    """
    if v is None:
        return "–"
    x = float(v)
    return f"{x:.1f}" if (2 * x).is_integer() and not x.is_integer() else f"{x:.0f}"


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def round_health(clients: Sequence[dict[str, Any]]) -> dict[str, float | None] | None:
    """A round's training health from its accepted clients' counters (``fedspear.interaction.HEALTH``), or None when
    no client reported them (GRPO, OPSD, RLTF-SD, or records older than the counters).

    Means and shares are exact over the round's answers (sums of counts); a client sends no per-answer lengths, so
    ``tokens_*_median`` is the median of the clients' medians.
    """
    rows = [c for c in clients if "initial_tokens" in c]
    if not rows:
        return None

    def total(key: str) -> float:
        return sum(c.get(key, 0) for c in rows)

    def median_of(key: str, weight: str) -> float | None:
        values = [c[key] for c in rows if c.get(weight, 0) > 0 and key in c]
        return float(statistics.median(values)) if values else None

    initial, revisions = total("initial_samples"), total("revisions_attempted")
    successful, guarded = total("revisions_successful"), total("revisions_guarded")
    return {
        "tokens_initial_mean": _share(total("initial_tokens"), initial),
        "tokens_initial_median": median_of("initial_tokens_median", "initial_samples"),
        "tokens_revision_mean": _share(total("revision_tokens"), revisions),
        "tokens_revision_median": median_of("revision_tokens_median", "revisions_attempted"),
        "reasoning_initial": _share(total("initial_reasoned"), initial),
        "reasoning_revision": _share(total("revisions_reasoned"), revisions),
        "wins_initial": total("initial_correct"),
        "wins_revised": successful - guarded,
        "revised_wins_bare": total("revised_wins_bare"),
        "bare_share_revised": _share(total("revised_wins_bare"), successful),
        "revisions_guarded": guarded,
    }


def label_counts(ev: dict[str, Any], prefix: str = "pred_") -> dict[str, int]:
    """The ``pred_<label>`` (or ``gold_<label>``) counts of an evaluation, label → count."""
    return {k[len(prefix):]: int(v) for k, v in ev.items() if k.startswith(prefix)}


def warnings_for(ev: dict[str, Any] | None, server_round: int, round0: dict[str, Any] | None) -> list[str]:
    """The learning-health warnings of one evaluation (module docstring), as one-line messages; [] when healthy or
    not evaluated. ``round0`` is round 0's ``eval`` (the reasoning baseline)."""
    if not ev:
        return []
    out = []
    counts = label_counts(ev)
    n = ev.get("n_gen", ev.get("n", 0))
    if counts and n:
        label, top = max(counts.items(), key=lambda kv: kv[1])
        if top / n > COLLAPSE_SHARE:
            gold = label_counts(ev, "gold_").get(label)
            out.append(f"round {server_round}: answers collapse to one label — {100 * top / n:.0f}% of the {n} "
                       f"evaluation answers are '{label}'" + (f" (gold: {100 * gold / n:.0f}%)" if gold is not None
                                                              else ""))
    base = (round0 or {}).get("reasoning_gen")
    now = ev.get("reasoning_gen")
    if base is not None and now is not None and base >= MIN_REASONING_SHARE and now < base / 2:
        out.append(f"round {server_round}: answers stop reasoning — {100 * now:.0f}% of evaluation answers reason "
                   f"before their final answer, below half of round 0's {100 * base:.0f}%")
    return out
