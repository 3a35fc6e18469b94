"""``report.md`` and PNG plots for a run directory (matplotlib, headless).

Plots: ``plots/accuracy.png`` (held-out accuracy vs round with 95% intervals), ``plots/wall_clock.png``
(cumulative wall-clock seconds vs round), ``plots/interaction.png`` (wins, losses and successful revisions per
round).
"""

from __future__ import annotations

import datetime as _dt
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .config import RunConfig
from .rundir import initial_accuracy


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _acc(ev: dict | None, key: str) -> str:
    if not ev or key not in ev:
        return "–"
    return f"{ev[key]:.3f} [{ev[key + '_low']:.3f}, {ev[key + '_high']:.3f}]"


def _label_prior(first: dict | None, last: dict | None) -> str:
    """One line comparing the greedy answers' label distribution (a small model moves its prior before its skill)."""
    def dist(record):
        ev = (record or {}).get("eval") or {}
        counts = {k[5:]: v for k, v in ev.items() if k.startswith("pred_")}
        return ", ".join(f"{k} {v}" for k, v in counts.items()) if counts else "–"
    if not first:
        return ""
    return (f"Greedy answers by label — round 0: {dist(first)}; round {last['round'] if last else '–'}: "
            f"{dist(last)} (parsed: {_fmt((first.get('eval') or {}).get('parsed_gen'), 2)} → "
            f"{_fmt(((last or {}).get('eval') or {}).get('parsed_gen'), 2)}).")


def unchanged_adapter_warning(records: Sequence[dict]) -> str | None:
    """The warning for a run none of whose rounds (1 and later) changed the global adapter — every round empty, or
    no accepted client with a win (the zero-win guard kept θ) — so that every evaluation measures the starting
    adapter; None when some round aggregated, or before round 1."""
    rounds = [r for r in records if r.get("round", 0) > 0]
    if not rounds or any(r.get("aggregated") for r in rounds):
        return None
    return (f"no round of this run changed the global adapter (rounds 1–{rounds[-1]['round']}: no accepted client "
            "had a win, or no reply was accepted): every evaluation measures the starting adapter")


def _health_warning_lines(records: Sequence[dict]) -> list[str]:
    """The run's warnings, bold, one bullet each; [] when none: first ``unchanged_adapter_warning``'s, then the
    learning-health warnings of its rounds (``fedspear.health``)."""
    unchanged = unchanged_adapter_warning(records)
    return ([f"- **WARNING: {unchanged}**"] if unchanged else []) + \
        [f"- **WARNING (learning health): {w}**" for r in records for w in r.get("health_warnings") or []]


def _health_section(records: Sequence[dict]) -> list[str]:
    """The "Learning health" table: per round, the evaluation's answers (length, reasoning, label histogram against
    gold, entropy, parse and cut-off rates) and the training answers (length and reasoning of initial answers and
    revisions, win-set composition, bare share of right revisions, guarded revisions); ``fedspear.health``."""
    from .health import fmt_count as num, label_counts

    rows = [r for r in records if (r.get("eval") or {}).get("tokens_gen_mean") is not None or r.get("health")]
    if not rows:
        return []

    def pct(v):
        return "–" if v is None else f"{100 * v:.0f}%"

    lines = ["## Learning health", "",
             "Evaluation answers: tokens (mean / median), share that reasons before the final answer, labels "
             "answered (gold in brackets) with their entropy in bits, parsed and cut-off shares. Training: tokens "
             "and reasoning share of initial answers and revisions (median: of the clients' medians), wins from "
             "initial answers + revisions, the share of right revisions that are bare, and revisions the guard "
             "dropped (`revised_wins`).", "",
             "| round | eval tokens | eval reasons | eval labels (gold) | entropy | parsed / cut off | initial tokens "
             "| initial reasons | revision tokens | revision reasons | wins init + rev | bare share of right rev. "
             "| guarded |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ev, h = r.get("eval") or {}, r.get("health") or {}
        pred, gold = label_counts(ev), label_counts(ev, "gold_")
        labels = ", ".join(f"{k} {v}" + (f" ({gold[k]})" if k in gold else "") for k, v in pred.items()) or "–"
        lines.append(
            f"| {r['round']} | {num(ev.get('tokens_gen_mean'))} / {num(ev.get('tokens_gen_median'))} | "
            f"{pct(ev.get('reasoning_gen'))} | {labels} | {_fmt(ev.get('label_entropy_gen'), 2)} | "
            f"{pct(ev.get('parsed_gen'))} / {pct(ev.get('cutoff_gen'))} | "
            f"{num(h.get('tokens_initial_mean'))} / {num(h.get('tokens_initial_median'))} | "
            f"{pct(h.get('reasoning_initial'))} | "
            f"{num(h.get('tokens_revision_mean'))} / {num(h.get('tokens_revision_median'))} | "
            f"{pct(h.get('reasoning_revision'))} | {num(h.get('wins_initial'))} + {num(h.get('wins_revised'))} | "
            f"{pct(h.get('bare_share_revised'))} | {num(h.get('revisions_guarded'))} |")
    return lines + [""]


def plot_run(path: Path, records: Sequence[dict]) -> list[Path]:
    """Write the three plots of a run; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = path / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    evals = [(r["round"], r["eval"]) for r in records if r.get("eval")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("acc_gen", "generation (greedy)"), ("acc_ll", "log-likelihood")):
        pts = [(t, e) for t, e in evals if key in e]
        if pts:
            xs = [t for t, _ in pts]
            ys = [e[key] for _, e in pts]
            # ≥ 0: records written before wilson_interval held p at its ends can have a bound a hair inside it
            lo = [max(0.0, e[key] - e[key + "_low"]) for _, e in pts]
            hi = [max(0.0, e[key + "_high"] - e[key]) for _, e in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("held-out accuracy (95% CI)")
    ax.set_title("Accuracy vs round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)
    written.append(out / "accuracy.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["round"] for r in records], [r.get("wall_clock", 0.0) / 60 for r in records], marker="o")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative wall-clock (minutes)")
    ax.set_title("Cumulative wall-clock")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "wall_clock.png", dpi=120)
    plt.close(fig)
    written.append(out / "wall_clock.png")

    rounds = [r for r in records if r["round"] > 0]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rounds:
        xs = [r["round"] for r in rounds]
        width = 0.27
        ax.bar([x - width for x in xs], [r["wins"] for r in rounds], width, label="wins")
        ax.bar(xs, [r["losses"] for r in rounds], width, label="losses")
        ax.bar([x + width for x in xs], [r["revisions_successful"] for r in rounds], width,
               label="successful revisions")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("traces (all sampled clients)")
    ax.set_title("Wins, losses and successful revisions per round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "interaction.png", dpi=120)
    plt.close(fig)
    written.append(out / "interaction.png")
    return written


def _partitions_line(path: Path, cfg: RunConfig) -> str:
    """The clients' split as ``partitions.json`` records it (one line; empty when the file is absent)."""
    import json

    try:
        parts = json.loads((path / "partitions.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"- client split: {cfg.partitioner}, Dirichlet α = {cfg.dirichlet_alpha}"
    return (f"- client split: {parts['partitioner']}, Dirichlet α = {parts['dirichlet_alpha']}, "
            f"{parts['train_items']} train items, {parts['min']}–{parts['max']} per client "
            f"(mean {parts['mean']:.1f}; `partitions.json`)")


def _empty_rounds_line(rounds: Sequence[dict]) -> str:
    """A warning naming the rounds that accepted no reply and were tolerated (``max_empty_rounds``)."""
    empty = [str(r["round"]) for r in rounds if r.get("empty")]
    return (f"- **{len(empty)} round(s) accepted no client reply** (tolerated: max_empty_rounds; adapter kept): "
            f"{', '.join(empty)}") if empty else ""


def _dp_line(cfg: RunConfig, rounds: Sequence[dict]) -> str:
    """The differential-privacy settings and the ε spent by the last round (empty without DP)."""
    if cfg.dp == "off":
        return ""
    last = next((r for r in reversed(rounds) if "dp_releases" in r), None)
    spent = "–" if last is None else epsilon_text(last)
    seeded = (f" **dp_noise_seed = {cfg.dp_noise_seed}: the noise is reproducible from this config, so this run has "
              f"no privacy guarantee (tests only).**" if cfg.dp_noise_seed is not None else "")
    return (f"- differential privacy: **{cfg.dp}-side clipping**, C = {cfg.dp_clip_norm:g}, z = "
            f"{cfg.dp_noise_multiplier:g}, σ = z·C/{cfg.clients_per_round} = "
            f"{cfg.dp_noise_multiplier * cfg.dp_clip_norm / cfg.clients_per_round:.4g}; **ε = {spent} at δ = "
            f"{cfg.dp_delta:g}** after {last['dp_releases'] if last else 0} noised rounds (RDP, no amplification; "
            f"client counters and update norms in `metrics.jsonl` are not covered; `fedspear.fl.privacy`).{seeded}")


def wire_section(cfg: RunConfig, rounds: Sequence[dict]) -> list[str]:
    """``report.md``'s "On the wire" section: per round, the bytes sent to and received from the sampled clients
    (MB = 10⁶ bytes; ``bytes_*`` in ``metrics.jsonl``, counted with Flower's serialisation: ``fedspear.fl.records``).
    Empty for records without byte counts (runs made before they were recorded)."""
    counted = [r for r in rounds if "bytes_to_clients" in r]
    if not counted:
        return []
    lines = ["## On the wire", "",
             f"Updates sent as **{cfg.update_encoding}** (`update_encoding`); the broadcast adapter is fp32. "
             "Bytes of Flower's serialised messages per round (MB = 10⁶ bytes).", "",
             "| round | clients | server → clients MB | clients → server MB | per client ↓ / ↑ MB |",
             "|---|---|---|---|---|"]
    for r in counted:
        down = [c["bytes_to_client"] for c in r["clients"] if "bytes_to_client" in c]
        up = [c["bytes_from_client"] for c in r["clients"] if "bytes_from_client" in c]
        mean = lambda xs: f"{sum(xs) / len(xs) / 1e6:.3f}" if xs else "–"  # noqa: E731
        lines.append(f"| {r['round']} | {len(down)} | {r['bytes_to_clients'] / 1e6:.3f} | "
                     f"{r['bytes_from_clients'] / 1e6:.3f} | {mean(down)} / {mean(up)} |")
    return lines + [""]


def accuracy_text(ev: dict) -> str:
    """An evaluation as the CLI prints it: each accuracy with its 95% interval and n, then the parse and cut-off
    rates of the generated answers, e.g. ``generation 0.410 [0.319, 0.508] (n=100), log-likelihood 0.562 [0.534,
    0.590] (n=1172); parsed 0.98, cut off 0.02``."""
    parts = [f"{name} {ev[k]:.3f} [{ev[k + '_low']:.3f}, {ev[k + '_high']:.3f}] (n={ev.get(n_key, ev['n'])})"
             for k, name, n_key in (("acc_gen", "generation", "n_gen"), ("acc_ll", "log-likelihood", "n"))
             if k in ev]
    rates = [f"{name} {ev[k]:.2f}" for k, name in (("parsed_gen", "parsed"), ("cutoff_gen", "cut off")) if k in ev]
    return ", ".join(parts) + (f"; {', '.join(rates)}" if rates else "")


def round_text(record: dict) -> str:
    """A round's line as ``fedspear run`` and ``flwr run`` print it (round 0: the held-out accuracy before training;
    later rounds: wins, losses, revisions, initial accuracy, evaluated accuracies, seconds, ε under DP), then one
    ``WARNING (learning health): …`` line per health warning of the round (``fedspear.health``)."""
    from .rundir import initial_accuracy

    ev = record.get("eval") or {}
    acc = " ".join(f"{k} {ev[k]:.3f}" for k in ("acc_gen", "acc_ll") if k in ev)
    warn = "".join(f"\nWARNING (learning health): {w}" for w in record.get("health_warnings") or [])
    if record["round"] == 0:
        return f"round 0 (before training): {acc}  [{ev.get('n', 0)} held-out items]" + warn
    return (f"round {record['round']}: wins {record['wins']} losses {record['losses']} revisions "
            f"{record['revisions_successful']}/{record['revisions_attempted']} initial acc "
            f"{(initial_accuracy(record) or 0):.2f}  {acc}  ({record['seconds']['round']:.0f} s)"
            + (f"  ε {epsilon_text(record)} (δ {record['dp_delta']:g})" if "dp_releases" in record else "") + warn)


def epsilon_text(record: dict) -> str:
    """A round's ε as shown in reports and on the CLI: 3 decimals, ∞ when no noise was added (z = 0; stored as
    null), – for records without DP (no ``dp_releases``)."""
    if "dp_releases" not in record:
        return "–"
    return "∞" if record.get("dp_epsilon") is None else f"{record['dp_epsilon']:.3f}"


def write_report(path: str | Path, records: Sequence[dict], cfg: RunConfig, dtype: str,
                 command: str | None = None) -> Path:
    """Write ``report.md`` and the plots for the run at ``path``; returns the report's path."""
    path = Path(path)
    plot_run(path, records)
    command = command or "fedspear run --config " + shlex.quote(str(path / "config.toml"))
    first = next((r for r in records if r["round"] == 0), None)
    last_eval = next((r for r in reversed(records) if r.get("eval")), None)
    rounds = [r for r in records if r["round"] > 0]
    peak_client = max((r.get("peak_rss_mb", {}).get("client", 0) for r in rounds), default=0)
    peak_server = max((r.get("peak_rss_mb", {}).get("server", 0) for r in records), default=0)
    peak_tree = max((r.get("peak_tree_mb", {}).get("pss", 0) for r in records), default=0)
    dp = cfg.dp != "off"
    lines = [
        f"# fedspear run — {cfg.algorithm}, {cfg.task}, {cfg.model}",
        "",
        f"Reproduce: `{command}` (seed {cfg.seed}). Written {_dt.datetime.now().isoformat(timespec='seconds')}"
        f" by fedspear on Python {sys.version.split()[0]}.",
        "",
        f"- algorithm **{cfg.algorithm}**, strategy {cfg.strategy}, aggregation weight: "
        + ("equal, fixed denominator clients_per_round (differential privacy)" if dp else
           f"{'wins' if cfg.algorithm in ('spear', 'feedback_sft') else 'prompts'}"),
        _dp_line(cfg, rounds),
        f"- rounds {cfg.rounds}, clients {cfg.num_clients} ({cfg.clients_per_round} per round), "
        f"rollouts per client-round {cfg.rollouts_per_round}, max revisions N = {cfg.max_revisions}",
        _partitions_line(path, cfg),
        _empty_rounds_line(rounds),
        f"- μ = {cfg.mu}, τ = {cfg.tau}, λ_w = {cfg.lambda_w}, λ_l = {cfg.lambda_l}, lr = {cfg.lr} → "
        f"{cfg.lr_min}, {cfg.local_steps} local steps × batch {cfg.batch_size}, normalisation {cfg.normalization}",
        f"- compute dtype: **{dtype}**; held-out items evaluated: {first['eval']['n'] if first else '–'}"
        + (f" (generation on {first['eval']['n_gen']})" if first and "n_gen" in first["eval"] else ""),
        f"- peak memory (RSS): server {peak_server:.0f} MiB, client worker {peak_client:.0f} MiB"
        + (f"; all processes together (PSS sum) {peak_tree:.0f} MiB" if peak_tree else ""),
        f"- wall-clock: {records[-1].get('wall_clock', 0) / 60:.1f} min over {len(rounds)} rounds"
        if records else "",
        *_health_warning_lines(records),
        "",
        "## Accuracy (held-out, 95% Wilson interval)",
        "",
        "| | generation | log-likelihood |",
        "|---|---|---|",
        f"| round 0 | {_acc(first and first['eval'], 'acc_gen')} | {_acc(first and first['eval'], 'acc_ll')} |",
        f"| round {last_eval['round'] if last_eval else '–'} | {_acc(last_eval and last_eval['eval'], 'acc_gen')}"
        f" | {_acc(last_eval and last_eval['eval'], 'acc_ll')} |",
        "",
        _label_prior(first, last_eval),
        "",
        "![accuracy](plots/accuracy.png)",
        "",
        "## Per round",
        "",
        "| round | lr | prompts | initial acc | wins | losses | revisions (ok / tried) | tokens | "
        "loss win (or total) / lose "
        "| margin M_τ | gen s | train s | eval s | overhead s | round s |" + (" ε |" if dp else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if dp else ""),
    ]
    for r in rounds:
        s = r["seconds"]
        lines.append(
            f"| {r['round']} | {r['lr']:.2e} | {r['prompts']} | {_fmt(initial_accuracy(r))} | {r['wins']} | "
            f"{r['losses']} | {r['revisions_successful']} / {r['revisions_attempted']} | {r['tokens_generated']} | "
            f"{_fmt(r['loss_win'] if r.get('loss_win') is not None else r.get('loss'))} / {_fmt(r.get('loss_lose'))} | "
            f"{_fmt(r.get('margin'))} | "
            f"{s['generate_initial'] + s['generate_revisions']:.1f} | {s['train']:.1f} | {s['evaluate']:.1f} | "
            f"{s['flower_overhead']:.1f} | {s['round']:.1f} |" + (f" {epsilon_text(r)} |" if dp else "")
        )
    lines += ["", "![interaction](plots/interaction.png)", "", "![wall-clock](plots/wall_clock.png)", ""]
    lines += wire_section(cfg, rounds)
    lines += _health_section(records)
    report = path / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report
