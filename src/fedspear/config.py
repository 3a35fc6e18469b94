"""The run configuration: one flat, typed, validated dataclass, loadable from TOML and the CLI.

Run the embedded defaults (what ``make run`` does)::

    fedspear run --output-dir runs/default

Defaults follow the paper's appendix table "Hyperparameter Settings (SPEAR)" (Qwen2.5-1.5B, ARC-Challenge) where
the work fits this 2-core CPU, and are scaled down where it does not; each departure is marked *CPU default*.
Task-dependent values left as ``None`` (τ, max new tokens, max lose ratio) take the task's value
(``resolve()``). Every key is checked on construction; an error names the key, the value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .algorithm_defaults import ALGORITHM_NAMES, MAX_LOSE_RATIO, TAU
from .tasks import TASKS, get_task



class ConfigError(ValueError):
    """A configuration key is unknown or its value is out of range. The message names the key and the range."""


def nearest_existing(path: str | Path) -> Path:
    """``path`` itself when it exists, else its nearest parent that does: where the folders an output needs would be
    made. A caller refusing an output whose folder lies under a file checks ``.is_dir()`` on it; the file system's
    root always exists, so the walk ends there."""
    place = Path(path)
    while not place.exists() and place != place.parent:
        place = place.parent
    return place


def snake_key(name: str) -> str:
    """A key as Flower and the command line write it (``max-revisions``, ``num-wins``) → its Python name
    (``max_revisions``, ``num_wins``): the one place kebab-case becomes snake_case."""
    return name.strip().replace("-", "_")


def parse_assignments(items: list[str], what: str = "--set") -> dict[str, Any]:
    """``key=value`` strings → ``{key: value}``, keys through :func:`snake_key`, values parsed as TOML scalars
    (numbers, booleans, quoted strings); a value TOML cannot read stays the bare string, and so does any value of a
    key whose setting is a string (``output_dir=2024`` is the folder "2024", not the number; ``=2024-01-01`` not a
    date).

    Raises:
        ConfigError: an item has no ``=`` (the message names ``what`` and the item).
    """
    text_keys = {f.name for f in fields(RunConfig) if f.type in ("str", "str | None")}
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{what} expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = snake_key(key)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[key] = raw if key in text_keys and not isinstance(value, str) else value
    return out


def _meta(help: str, **check) -> dict:
    return {"help": help, **check}


@dataclass
class RunConfig:
    """Every setting of a ``fedspear run`` (flat keys; TOML files and CLI flags use the same names)."""

    # what to learn
    task: str = field(
        default="arc_challenge",
        metadata=_meta(
            "benchmark: " + ", ".join(sorted(TASKS)),
            choices=sorted(TASKS),
        ),
    )
    model: str = field(
        default="smollm2-135m",
        metadata=_meta(
            "packaged model name, local HF folder or hub id",
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_meta(
            "auto (bf16 where the device computes in it: a CPU with bf16 units, a CUDA GPU with bf16), bf16 or fp32",
            choices=["auto", "bf16", "fp32"],
        ),
    )
    device: str = field(
        default="auto",
        metadata=_meta(
            "where the model runs (clients and server evaluation): auto (a CUDA GPU when torch sees one, else the "
            "CPU), cpu or cuda; adapters travel as CPU arrays either way",
            choices=["auto", "cpu", "cuda"],
        ),
    )
    seed: int = field(
        default=0,
        metadata=_meta(
            "seed for partition, client sampling, generation and training",
            min=0,
            max=2**64 - 1,  # what torch.manual_seed takes
        ),
    )
    algorithm: str = field(
        default="spear",
        metadata=_meta(
            "client algorithm: spear (paper), or the baselines feedback_sft, grpo, opsd, rltf_sd (paper §5)",
            choices=list(ALGORITHM_NAMES),
        ),
    )
    # federation
    rounds: int = field(
        default=4,
        metadata=_meta(
            "FL rounds (paper 100 for ARC; CPU default 4)",
            min=1,
            max=100000,
        ),
    )
    num_clients: int = field(
        default=10,
        metadata=_meta(
            "simulated clients (paper 50; CPU default 10)",
            min=1,
            max=10000,
        ),
    )
    clients_per_round: int = field(
        default=2,
        metadata=_meta(
            "clients sampled each round (paper 3 for ARC; CPU default 2)",
            min=1,
        ),
    )
    dirichlet_alpha: float = field(
        default=1.0,
        metadata=_meta(
            "Dirichlet α of the label split (paper 1.0)",
            gt=0,
        ),
    )
    partitioner: str = field(
        default="inner_dirichlet",
        metadata=_meta(
            "how the train split is divided (fedspear.fl.partition): inner_dirichlet (equal sizes, Dir(α) label mix "
            "per client; always feasible) or dirichlet (each label split over clients by Dir(α); fails at 50+ "
            "clients here; the rule before 2026-11-25)",
            choices=["inner_dirichlet", "dirichlet"],
        ),
    )
    max_empty_rounds: int = field(
        default=0,
        metadata=_meta(
            "consecutive rounds with no accepted reply tolerated when sampled nodes dropped out (no reply, node "
            "unavailable); a round whose failures are all errors raised by the clients always stops the run",
            min=0,
        ),
    )
    # interaction (SPEC §2)
    rollouts_per_round: int = field(
        default=16,
        metadata=_meta(
            "prompts each client answers per round, at most its partition size unless repeat_prompts (CPU default 16)",
            min=1,
        ),
    )
    repeat_prompts: bool = field(
        default=False,
        metadata=_meta(
            "let a client ask the same prompt more than once in one round when rollouts_per_round exceeds its "
            "partition (the rule before 2026-11-25)",
        ),
    )
    max_revisions: int = field(
        default=2,
        metadata=_meta(
            "N, revision attempts per wrong answer (paper 2)",
            min=0,
            max=10,
        ),
    )
    revised_wins: str = field(
        default="all",
        metadata=_meta(
            "which right revisions join the win set: all (the paper) | reasoned (only those that reason before "
            "their final answer, the task's `reasons` rule; a bare right revision is dropped, y0 still joins the "
            "lose set: fedspear.interaction)",
            choices=["all", "reasoned"],
        ),
    )
    keep_traces: str = field(
        default="auto",
        metadata=_meta(
            "write each client-round's answers, revisions, feedback and win/lose as traces/round_NNNN/"
            "client_PPPP.jsonl.gz on the client (simulation: in the run directory; a SuperNode: its node-config "
            "trace-dir): on | off | auto (on while rounds × clients_per_round × rollouts_per_round ≤ 2000 "
            "prompts, ≤ ≈ 2 MB for StrategyQA; fedspear.answers); fedspear compare sets on",
            choices=["auto", "on", "off"],
        ),
    )
    temperature: float = field(
        default=0.8,
        metadata=_meta(
            "sampling temperature (paper 0.8)",
            gt=0,
            max=5,
        ),
    )
    top_p: float = field(
        default=0.95,
        metadata=_meta(
            "nucleus sampling p (over the 50 likeliest tokens: runtime.sampling)",
            gt=0,
            max=1,
        ),
    )
    max_new_tokens: int | None = field(
        default=None,
        metadata=_meta(
            "tokens per attempt (None: the task's default)",
            min=1,
            max=4096,
        ),
    )
    # local training (SPEC §3)
    mu: float = field(
        default=0.3,
        metadata=_meta(
            "μ, unlikelihood confidence gate (paper 0.3)",
            gt=0,
            lt=1,
        ),
    )
    tau: int | None = field(
        default=None,
        metadata=_meta(
            "τ, tail tokens (0 = whole completion; None: paper value per task)",
            min=0,
        ),
    )
    lambda_w: float = field(
        default=1.0,
        metadata=_meta(
            "λ_w, win NLL weight (paper 1.0)",
            min=0,
        ),
    )
    lambda_l: float = field(
        default=0.1,
        metadata=_meta(
            "λ_l, unlikelihood weight (paper 0.1)",
            min=0,
        ),
    )
    normalization: str = field(
        default="token",
        metadata=_meta(
            "loss normalisation (SPEC §3)",
            choices=["token", "sequence"],
        ),
    )
    lr: float = field(
        default=2e-4,
        metadata=_meta(
            "peak learning rate (paper 5e-5 for ARC over 100 rounds; CPU default 2e-4 for 4 rounds)",
            gt=0,
            max=1,
        ),
    )
    lr_min: float = field(
        default=1e-5,
        metadata=_meta(
            "cosine floor (paper 1e-5)",
            min=0,
            max=1,
        ),
    )
    warmup_ratio: float = field(
        default=0.1,
        metadata=_meta(
            "share of rounds with linear warm-up (paper 0.1)",
            min=0,
            max=1,
        ),
    )
    local_steps: int = field(
        default=2,
        metadata=_meta(
            "local optimiser steps per round (paper 5 for ARC; CPU default 2)",
            min=1,
        ),
    )
    batch_size: int = field(
        default=4,
        metadata=_meta(
            "traces per win batch and per lose batch (paper 16; CPU default 4)",
            min=1,
        ),
    )
    grad_accum: int = field(
        default=1,
        metadata=_meta(
            "gradient accumulation micro-batches (paper 1 for ARC)",
            min=1,
        ),
    )
    max_lose_ratio: int | None = field(
        default=None,
        metadata=_meta(
            "cap |L| ≤ ratio·|W| (None: 2 ARC/HellaSwag, 4 Math/StrategyQA)",
            min=0,
        ),
    )
    lora_r: int = field(
        default=16,
        metadata=_meta(
            "LoRA rank (paper 16)",
            min=1,
            max=1024,
        ),
    )
    lora_alpha: int = field(
        default=32,
        metadata=_meta(
            "LoRA α (paper 32)",
            min=1,
        ),
    )
    lora_dropout: float = field(
        default=0.1,
        metadata=_meta(
            "LoRA dropout (paper 0.1)",
            min=0,
            lt=1,
        ),
    )
    last_layers: int = field(
        default=0,
        metadata=_meta(
            "adapt only the last H layers (0 = all)",
            min=0,
        ),
    )
    gradient_checkpointing: str = field(
        default="auto",
        metadata=_meta(
            "recompute activations in the backward pass to save memory (auto: on a GPU when the training "
            "activations would not fit its free memory, on the CPU for models over 1B parameters)",
            choices=["auto", "on", "off"],
        ),
    )
    compile_decode: str = field(
        default="auto",
        metadata=_meta(
            "decode with a compiled step over a static KV cache (torch.compile; compiled once per process, kept "
            "across rounds and adapters): auto (on a CUDA GPU), on or off",
            choices=["auto", "on", "off"],
        ),
    )
    compile_training: str = field(
        default="off",
        metadata=_meta(
            "train with the LoRA model's forward and backward compiled (torch.compile, every input size symbolic; "
            "compiled once per process, kept across rounds and adapters): on or off",
            choices=["on", "off"],
        ),
    )
    client_gpus: float = field(
        default=1.0,
        metadata=_meta(
            "simulation on a GPU: the share of a GPU each simulated client holds (0.25: four clients of a round run "
            "side by side on one GPU, each with its own copy of the model)",
            gt=0,
            max=1,
        ),
    )
    # baselines (SPEC §5; defaults from the paper's appendix baseline tables, see fedspear.algorithms)
    group_size: int | None = field(
        default=None,
        metadata=_meta(
            "GRPO / RLTF-SD samples per prompt (None: the paper's table, 2 Math/StrategyQA, 4 ARC/HellaSwag)",
            min=1,
            max=64,
        ),
    )
    kl_beta: float | None = field(
        default=None,
        metadata=_meta(
            "GRPO / RLTF-SD k3 KL weight β (None: the paper's table, 0.02; 0.1 StrategyQA)",
            min=0,
        ),
    )
    clip_eps: float = field(
        default=0.2,
        metadata=_meta(
            "GRPO / RLTF-SD PPO clip range ε (paper 0.2)",
            gt=0,
            lt=1,
        ),
    )
    opsd_variant: str = field(
        default="original",
        metadata=_meta(
            "OPSD: original (JSD β 0.5, T 1.1, base-model teacher) or authors (forward KL, T 2, current-model "
            "teacher)",
            choices=["original", "authors"],
        ),
    )
    rltf_gamma: float = field(
        default=1.0,
        metadata=_meta(
            "RLTF-SD γ, weight of the second-turn reward (paper 1.0)",
            min=0,
        ),
    )
    rltf_sd_coef: float = field(
        default=0.1,
        metadata=_meta(
            "RLTF-SD self-distillation coefficient (paper 0.1)",
            min=0,
        ),
    )
    rltf_rl_coef: float = field(
        default=1.0,
        metadata=_meta(
            "RLTF-SD RL coefficient (paper 1.0)",
            min=0,
        ),
    )
    # aggregation and robustness (SPEC §4)
    strategy: str = field(
        default="fedavg",
        metadata=_meta(
            "FL strategy: fedavg (paper), fedprox, fedadam, fedyogi",
            choices=["fedavg", "fedprox", "fedadam", "fedyogi"],
        ),
    )
    mu_prox: float = field(
        default=1e-3,
        metadata=_meta(
            "FedProx proximal weight μ_prox (paper 1e-3)",
            min=0,
        ),
    )
    server_lr: float = field(
        default=1e-3,
        metadata=_meta(
            "FedAdam/FedYogi server learning rate η (paper silent; fedspear default)",
            gt=0,
        ),
    )
    server_beta1: float = field(
        default=0.9,
        metadata=_meta(
            "FedAdam/FedYogi β1 (paper 0.9)",
            min=0,
            lt=1,
        ),
    )
    server_beta2: float = field(
        default=0.99,
        metadata=_meta(
            "FedAdam/FedYogi β2 (paper 0.99)",
            min=0,
            lt=1,
        ),
    )
    server_tau: float = field(
        default=0.005,
        metadata=_meta(
            "FedAdam/FedYogi adaptivity τ (paper 0.005)",
            gt=0,
        ),
    )
    aggregation: str = field(
        default="fedavg",
        metadata=_meta(
            "fedavg (win-weighted, paper), or the robust median / trimmed_mean",
            choices=["fedavg", "median", "trimmed_mean"],
        ),
    )
    trim_beta: float = field(
        default=0.2,
        metadata=_meta(
            "share cut at each end by trimmed_mean",
            min=0,
            lt=0.5,
        ),
    )
    max_update_norm: float | None = field(
        default=None,
        metadata=_meta(
            "reject a client update with ‖θ_k − θ‖₂ above this (None: no bound)",
            gt=0,
        ),
    )
    # differential privacy (central DP with fixed clipping, Flower's wrappers; fedspear.fl.privacy)
    dp: str = field(
        default="off",
        metadata=_meta(
            "central differential privacy: off, client (each client clips its update, Flower's fixedclipping_mod) or"
            " server (the server clips every update); both add Gaussian noise σ = z·C/clients_per_round to the "
            "average and report ε per round (fedspear.fl.privacy)",
            choices=["off", "client", "server"],
        ),
    )
    dp_noise_multiplier: float = field(
        default=1.0,
        metadata=_meta(
            "DP noise multiplier z: noise std σ = z·C/clients_per_round (McMahan et al. 2018; Flower recommends ≥ 1;"
            " 0 = clipping only, no guarantee)",
            min=0,
            max=1000,
        ),
    )
    dp_clip_norm: float = field(
        default=1.0,
        metadata=_meta(
            "DP clipping norm C: each client update θ_k − θ^(t) is scaled to L2 norm ≤ C (fedspear default; pick it "
            "from the update norms of a run without DP)",
            gt=0,
        ),
    )
    dp_delta: float = field(
        default=1e-5,
        metadata=_meta(
            "DP δ at which ε is reported; must be below 1/num_clients (1e-5: below 1/N for every N this config "
            "allows)",
            gt=0,
            lt=1,
        ),
    )
    dp_noise_seed: int | None = field(
        default=None,
        metadata=_meta(
            "TESTS ONLY: seed of the DP noise. None (default) draws it from the OS's entropy every round; a seed "
            "written in config.toml makes the noise predictable and voids the guarantee",
            min=0,
            max=2**32 - 1,  # numpy's seeds are 32-bit (fl/privacy.py: np.random.seed([seed, round]))
        ),
    )
    # what a client sends back (fedspear.fl.records)
    update_encoding: str = field(
        default="fp32",
        metadata=_meta(
            "how clients send their update: fp32 (the trained adapter, exact), fp16 (θ_k − θ in half precision, "
            "half the bytes) or int8 (θ_k − θ blockwise int8 with one scale per 64 values, ≈ 27% of the bytes); "
            "applied after DP clipping, decoded by the server before its checks and aggregation",
            choices=["fp32", "fp16", "int8"],
        ),
    )
    # secure aggregation (Flower's SecAgg+ on its legacy strategy API; fedspear.fl.secagg)
    secure_aggregation: str = field(
        default="off",
        metadata=_meta(
            "off, or secaggplus: the server only ever sees the masked sum of the clients' updates, not one client's "
            "adapter — unless that client is the only one of the round with wins, whose win-weighted mean is then "
            "its update (Flower's SecAggPlusWorkflow + secaggplus_mod; needs clients_per_round ≥ 3; "
            "fedspear.fl.secagg)",
            choices=["off", "secaggplus"],
        ),
    )
    secagg_threshold: float = field(
        default=0.67,
        metadata=_meta(
            "SecAgg+ reconstruction threshold as a share of the m sampled clients: t = max(2, round(value·m)) must "
            "stay to the end of a round (m − t may drop out); t must exceed m/2 (checked for m = clients_per_round) "
            "so that a server following the protocol learns no single update, and t > 2m/3 against one that lies "
            "about who dropped (Bonawitz et al. 2017; e.g. 1.0 for m = 3)",
            gt=0.5,
            max=1,
        ),
    )
    secagg_clipping_range: float = field(
        default=0.01,
        metadata=_meta(
            "SecAgg+ range c: each value of w/max_weight·(θ_k − θ^(t)) must lie in [−c, c] (a client whose update "
            "exceeds it refuses the round with the value); quantisation step 2c/quantization_range "
            "(docs/results/secagg)",
            gt=0,
        ),
    )
    secagg_quantization_range: int = field(
        default=2**22,
        metadata=_meta(
            "SecAgg+ quantisation levels Q (Flower's default 2^22); clients_per_round·Q must stay below 2^32",
            min=2,
        ),
    )
    secagg_max_weight: float = field(
        default=0.0,
        metadata=_meta(
            "SecAgg+ largest aggregation weight a client may send; 0 = rollouts_per_round, the most a client-round "
            "can weigh (one win per prompt; the baselines weigh by prompts). Larger values coarsen the quantisation",
            min=0,
        ),
    )
    # evaluation (SPEC §6)
    eval_every: int = field(
        default=2,
        metadata=_meta(
            "evaluate every k rounds (and at round 0 and the last)",
            min=1,
        ),
    )
    eval_size: int = field(
        default=100,
        metadata=_meta(
            "held-out items evaluated (0 = the whole split; CPU default 100)",
            min=0,
        ),
    )
    eval_gen_size: int = field(
        default=0,
        metadata=_meta(
            "items of the evaluated set also answered by generation (0 = all); log-likelihood scores all",
            min=0,
        ),
    )
    round0_from: str | None = field(
        default=None,
        metadata=_meta(
            "run directory whose round-0 evaluation is reused when model, task, data and evaluation settings match "
            "and both start adapters are the identity (LoRA B = 0); `fedspear compare` sets it",
            path=True,
        ),
    )
    eval_generation: bool = field(
        default=True,
        metadata=_meta(
            "also measure greedy-generation accuracy",
        ),
    )
    eval_batch_size: int | str = field(
        default="auto",
        metadata=_meta(
            "held-out items generated (or scored) together: auto = 32 on a CPU and, on a GPU, as many as a KV cache"
            " of 1/16 of its memory holds (a power of two up to 256; runtime.generation.eval_batch_rows); a"
            " different batch may shift a bf16 answer by a token",
            min=1,
            max=1024,
            auto=True,
        ),
    )
    # data and output
    train_size: int = field(
        default=0,
        metadata=_meta(
            "train items partitioned over clients (0 = the whole split)",
            min=0,
        ),
    )
    data_dir: str | None = field(
        default=None,
        metadata=_meta(
            "folder with full offline copies (laid out like src/fedspear/data; README: Data)",
            path=True,
        ),
    )
    skip_bad_records: bool = field(
        default=False,
        metadata=_meta(
            "skip (and count) malformed data records instead of stopping",
        ),
    )
    data_source: str = field(
        default="offline",
        metadata=_meta(
            "offline (shipped / data_dir) or hub",
            choices=["offline", "hub"],
        ),
    )
    output_dir: str = field(
        default="runs/default",
        metadata=_meta(
            "run directory (re-running into it resumes)",
            path=True,
        ),
    )
    tensorboard: bool = field(
        default=False,
        metadata=_meta(
            "also write each round's metrics as TensorBoard scalars into <output_dir>/tensorboard (needs the extra "
            "fedspear[tensorboard])",
        ),
    )
    user_flip_prob: float = field(
        default=0.0,
        metadata=_meta(
            "noisy simulated user: probability p of flipping the verdict (0 = the exact oracle)",
            min=0,
            max=1,
        ),
    )
    user_irrelevant_prob: float = field(
        default=0.0,
        metadata=_meta(
            "noisy simulated user: probability q of an irrelevant hint",
            min=0,
            max=1,
        ),
    )
    round_timeout: float = field(
        default=3600.0,
        metadata=_meta(
            "seconds the server waits for a round's replies",
            gt=0,
        ),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f, getattr(self, f.name))
            value = getattr(self, f.name)
            if f.metadata.get("path") and isinstance(value, str) and value.startswith("~"):
                # as a shell would: a TOML file or --set passes "~/runs/x" to no shell
                setattr(self, f.name, os.path.expanduser(value))
        if self.clients_per_round > self.num_clients:
            raise ConfigError(
                f"clients_per_round = {self.clients_per_round} exceeds num_clients = {self.num_clients}"
            )
        if self.lr_min > self.lr:
            raise ConfigError(f"lr_min = {self.lr_min} exceeds lr = {self.lr}")
        if self.dp != "off":
            _check_dp(self)
        if self.secure_aggregation != "off":
            _check_secagg(self)

    # -- derived values -------------------------------------------------------------------------------------------
    def resolved(self) -> "RunConfig":
        """A copy with task-dependent ``None`` values filled in (τ, max new tokens, max lose ratio)."""
        task = get_task(self.task)
        return dataclasses.replace(
            self,
            tau=TAU[self.task] if self.tau is None else self.tau,
            max_new_tokens=self.max_new_tokens or task.MAX_NEW_TOKENS,
            max_lose_ratio=MAX_LOSE_RATIO[self.task] if self.max_lose_ratio is None else self.max_lose_ratio,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """TOML text holding every key (``None`` values are written as comments: ``(task default)`` for the keys a
        task or algorithm fills in, ``TASK_DEFAULT_KEYS``, else ``(not set)``)."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                lines.append(f"# {f.name} = " + ("(task default)" if f.name in TASK_DEFAULT_KEYS else "(not set)"))
            else:
                lines.append(f"{f.name} = {json.dumps(value)}")
        return "\n".join(lines) + "\n"


#: keys whose ``None`` means "the task's (or the algorithm's per-task) value": ``resolved()`` and the algorithm
#: modules fill them in (``fedspear.algorithm_defaults``, each task's ``MAX_NEW_TOKENS``).
TASK_DEFAULT_KEYS = frozenset({"tau", "max_new_tokens", "max_lose_ratio", "group_size", "kl_beta"})


def unknown_keys_error(unknown: list[str], where: str) -> ConfigError:
    """The error for keys ``RunConfig`` does not have: names where they came from (a file, ``--set``) and, for each,
    the nearest known key (difflib, or the key's initials: ``learning_rate`` → ``lr``), instead of listing them all.
    """
    import difflib

    known = [f.name for f in fields(RunConfig)]
    parts = []
    for key in unknown:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        if not near:  # learning_rate → lr: an abbreviation difflib's ratio misses; try the key's initials
            initials = "".join(word[0] for word in key.split("_") if word)
            near = [k for k in known if k == initials]
        parts.append(f"'{key}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    noun = "key" if len(unknown) == 1 else "keys"
    return ConfigError(f"{where}: unknown config {noun} {', '.join(parts)}; a run's config.toml and "
                       "src/fedspear/config.py list every key")


def _check_dp(cfg: RunConfig) -> None:
    """Refuse settings whose combination with central DP would give no valid guarantee (fedspear.fl.privacy).

    Raises:
        ConfigError: the message names the conflicting keys and why.
    """
    if cfg.aggregation != "fedavg":
        raise ConfigError(
            f"dp = {cfg.dp!r} with aggregation = {cfg.aggregation!r}: the noise σ = z·C/clients_per_round is "
            "calibrated for the mean of clipped updates only; one client can move a median or trimmed mean of "
            "a few updates by up to about C, so the guarantee would not hold. Use aggregation = \"fedavg\" with dp")
    if cfg.dp_delta >= 1 / cfg.num_clients:
        raise ConfigError(
            f"dp_delta = {cfg.dp_delta:g} is not below 1/num_clients = {1 / cfg.num_clients:g}: a mechanism that "
            "publishes one whole client's update with probability δ would satisfy the guarantee; use e.g. 1e-5")


def secagg_threshold_count(share: float, sampled: int) -> int:
    """The SecAgg+ reconstruction threshold t for ``sampled`` clients and ``secagg_threshold = share``, as Flower's
    ``SecAggPlusWorkflow.setup_stage`` computes it from a float ``reconstruction_threshold`` when every sampled
    client holds a share (``num_shares`` = 1.0): max(2, round(share · sampled))."""
    return max(round(share * sampled), 2)


def _check_secagg(cfg: RunConfig) -> None:
    """Refuse settings that SecAgg+ cannot serve (fedspear.fl.secagg says why for each).

    Raises:
        ConfigError: the message names the conflicting keys and the fix.
    """
    key = f"secure_aggregation = {cfg.secure_aggregation!r}"
    if cfg.clients_per_round < 3:
        raise ConfigError(f"{key} needs clients_per_round ≥ 3 (got {cfg.clients_per_round}): with 2 clients the "
                          "server and either client together learn the other's update, and none could drop out")
    if cfg.aggregation != "fedavg":
        raise ConfigError(f"{key} with aggregation = {cfg.aggregation!r}: the server only learns the weighted sum "
                          "of the updates, so it cannot take a median or trimmed mean; use aggregation = \"fedavg\"")
    if cfg.dp != "off":
        raise ConfigError(f"{key} with dp = {cfg.dp!r} is not supported: dp = \"server\" clips each update on the "
                          "server, which never sees one; dp = \"client\" would noise the win-weighted SecAgg+ mean, "
                          "whose sensitivity is not the C/clients_per_round Flower's noise is calibrated for "
                          "(fedspear.fl.secagg). Use one of the two")
    if cfg.update_encoding != "fp32":
        raise ConfigError(f"{key} with update_encoding = {cfg.update_encoding!r}: SecAgg+ quantises the masked "
                          "update itself (secagg_quantization_range), so a client cannot encode it as well; use "
                          "update_encoding = \"fp32\"")
    m = cfg.clients_per_round
    t = secagg_threshold_count(cfg.secagg_threshold, m)
    if 2 * t <= m:
        raise ConfigError(f"secagg_threshold = {cfg.secagg_threshold:g} with clients_per_round = {m} gives the "
                          f"reconstruction threshold t = {t}, not above m/2: a server could collect t shares of both "
                          f"secrets of a client and unmask its update; raise secagg_threshold to at least "
                          f"{(m // 2 + 1) / m:.2f}")
    if cfg.clients_per_round * cfg.secagg_quantization_range >= 2**32:
        raise ConfigError(f"secagg_quantization_range = {cfg.secagg_quantization_range} with clients_per_round = "
                          f"{cfg.clients_per_round}: the masked sum of up to clients_per_round·Q must stay below "
                          "Flower's modulus 2^32; lower secagg_quantization_range")


def _check(f: dataclasses.Field, value: Any) -> None:
    """Validate one field against its type and the range in its metadata."""
    name, meta = f.name, f.metadata
    if value is None:
        if "None" in str(f.type):
            return
        raise ConfigError(f"{name}: a value is required")
    if meta.get("auto") and value == "auto":
        return
    kind = str(f.type).replace(" | None", "")
    if meta.get("auto"):  # an integer, or the string "auto"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer or \"auto\", got {value!r}")
        kind = "int"
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if meta.get("path") and isinstance(value, str) and not value.strip():
        raise ConfigError(f"{name}: empty; give a folder")  # Path("") is the current folder
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{name}: {value!r} is not allowed; choose one of {', '.join(meta['choices'])}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{name}: must be finite, got {value!r}")
        bounds = [("min", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
                  ("max", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
        for key, sign, ok in bounds:
            if key in meta and not ok(value, meta[key]):
                raise ConfigError(f"{name}: {value!r} is out of range; it must be {sign} {meta[key]}")


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict.

    Raises:
        ConfigError: the file is missing or a folder (named as ``what``), is not UTF-8 text or is not valid TOML.
    """
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; give a TOML file")
    if not path.is_file():
        raise ConfigError(f"{what} {path} not found")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None


def config_file_values(path: str | Path) -> dict[str, Any]:
    """The run keys a TOML config file sets (at its top level or in a ``[fedspear]`` table), unvalidated values.

    Raises:
        ConfigError: the file is missing or not TOML, a key is unknown, or keys sit beside a ``[fedspear]`` table.
    """
    path = Path(path)
    values = read_toml(path, "config file")
    if isinstance(values.get("fedspear"), dict):  # the keys in a [fedspear] table: nothing may sit beside it
        beside = sorted(set(values) - {"fedspear"})
        if beside:
            raise ConfigError(f"{path}: {', '.join(beside)} outside the [fedspear] table would be ignored; put "
                              "every key inside it, or drop the table header")
        values = values["fedspear"]
    known = {f.name for f in fields(RunConfig)}
    if set(values) - known:
        raise unknown_keys_error(sorted(set(values) - known), str(path))
    return values


def load_config(path: str | Path | None = None, preset: str | None = None, **overrides: Any) -> RunConfig:
    """Build a ``RunConfig`` from a preset, an optional TOML file, then keyword overrides, each over the one before
    (``None`` overrides are ignored).

    Args:
        preset: ``"paper"``: the paper's appendix tables for the chosen task and algorithm
            (``fedspear.paper_settings``); the file and the overrides may still change any key.
    Raises:
        ConfigError: the file is missing or not TOML, a key is unknown, a value is invalid, or the preset is unknown.
    """
    file_values = config_file_values(path) if path else {}
    values = dict(file_values)
    known = {f.name for f in fields(RunConfig)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if preset is not None:  # "" is a preset name too, and refused: not silently "no preset"
        from .paper_settings import preset_settings

        defaults = RunConfig.__dataclass_fields__
        try:
            values = {**preset_settings(preset, values.get("task", defaults["task"].default),
                                        values.get("algorithm", defaults["algorithm"].default)), **values}
        except ValueError as err:
            raise ConfigError(f"--preset {preset}: {err}") from None
    unknown = sorted(set(values) - known)
    if unknown:
        raise unknown_keys_error(unknown, "--set" if not preset or set(unknown) & set(overrides) else "--preset")
    try:
        return RunConfig(**values)
    except ConfigError as err:
        # the file is named only where a key the error names came from it (not from a flag or --set over it)
        given = {k for k, v in overrides.items() if v is not None}
        named = set(re.findall(r"[a-z][a-z0-9_]*", str(err))) & (set(file_values) - given)
        raise ConfigError(f"{path}: {err}" if named else str(err)) from None
