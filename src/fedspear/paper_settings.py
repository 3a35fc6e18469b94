"""The paper's own settings per task and algorithm (``--preset paper``): a transcription of its appendix tables.

    fedspear run --preset paper --task strategy_qa                   # SPEAR at the paper's StrategyQA settings
    fedspear run --preset paper --task arc_challenge --set algorithm=grpo
    fedspear compare --preset paper                                   # 4 tasks × 5 algorithms × 3 seeds

Source: SPEAR (arXiv 2605.07977), appendix "Detailed Hyperparameter Setup", the Qwen2.5-1.5B tables —
``tab:qwen1.5b_hparams`` (SPEAR; Feedback SFT has no table of its own and runs SPEAR's, as it shares SPEAR's
interaction), ``tab:qwen1.5b_grpo_hparams``, ``tab:qwen1.5b_opsd_hparams`` and ``tab:qwen1.5b_rltfsd_hparams``.
``TABLES`` holds them row by row in the paper's own row names and column order; ``paper_settings`` maps rows to
``RunConfig`` keys (``ROW_KEYS``). ``tests/test_paper_settings.py`` reads the tables out of a verbatim copy of their
LaTeX (``tests/data/paper_tables.tex``; checked against the paper's source where it is present) and checks both.
The Llama-3.2-3B tables differ only in batch size × accumulation (ARC-Challenge and HellaSwag: 8 × 2 for SPEAR and
OPSD) and are not a preset.

What the tables do not say, and what fedspear takes (**Decision**, 2026-11-25, issue 16):

- *Max sequence length* (2048; StrategyQA 1024 for SPEAR, 1400 for the baselines) is not a fedspear setting:
  nothing is truncated; the generation budget per attempt is ``max_new_tokens``, the authors' 512 (MathMCQA) and
  256 (StrategyQA) and the task default (16) for the one-letter tasks.
- *Prompts per client-round* (``rollouts_per_round``) is not in the paper: local steps × batch size × gradient
  accumulation of SPEAR's table (80 for MathMCQA, ARC-Challenge and StrategyQA, 160 for HellaSwag), the same for
  every algorithm of a task so that all see the same interaction budget (SPEC §5); a client with fewer items asks
  each once (``fedspear.worker.round_prompts``).
- *Revisions* N = 2 (paper §5 default); the client split is ``inner_dirichlet`` (``fedspear.fl.partition``).
- The model stays the user's choice (the paper: Qwen2.5-1.5B and Llama-3.2-3B; ``--model``).
"""

from __future__ import annotations

from typing import Any

# column order of every table: Math MCQA, ARC-Challenge, StrategyQA, HellaSwag
TASK_COLUMNS = ("math_mcqa", "arc_challenge", "strategy_qa", "hellaswag")

_FL_ROWS = {
    "Number of clients": (50, 50, 50, 50),
    "Dirichlet alpha": (1.0, 1.0, 1.0, 1.0),
    "Number of FL rounds": (50, 100, 100, 50),
    "Clients per round aggregated": (3, 3, 5, 5),
    "Local training steps per round": (5, 5, 5, 10),
}
_LORA_ROWS = {"LoRA rank": (16, 16, 16, 16), "LoRA alpha": (32, 32, 32, 32), "LoRA dropout": (0.1, 0.1, 0.1, 0.1)}
_LR = (5.05e-5, 5.0e-5, 1.0e-4, 5.0e-5)
_LR_MIN = (1.0e-5, 1.0e-5, 5.0e-5, 1.0e-5)

#: The four Qwen2.5-1.5B tables, row name → values in ``TASK_COLUMNS`` order (verbatim from the appendix).
TABLES: dict[str, dict[str, tuple]] = {
    "tab:qwen1.5b_hparams": {
        "Max sequence length": (2048, 2048, 1024, 2048),
        **_LORA_ROWS, **_FL_ROWS,
        "Ratio of rounds to warmup": (0.1, 0.1, 0.1, 0.1),
        "Generation temperature": (0.8, 0.8, 0.8, 0.8),
        "Lambda win weight": (1.0, 1.0, 1.0, 1.0),
        "Lambda loss weight": (0.1, 0.1, 0.1, 0.1),
        "Unlikelihood threshold": (0.3, 0.3, 0.3, 0.3),
        "tau": (32, 0, 24, 0),
        "Learning rate": _LR,
        "Batch size": (4, 16, 16, 16),
        "Grad accumulation steps": (4, 1, 1, 1),
        "Linear warmup ratio": (0.1, 0.1, 0.1, 0.1),
        "Minimum LR for cosine decay": _LR_MIN,
    },
    "tab:qwen1.5b_grpo_hparams": {
        "Max sequence length": (2048, 2048, 1400, 2048),
        **_LORA_ROWS, **_FL_ROWS,
        "Ratio of rounds to warmup": (0.1, 0.1, 0.1, 0.1),
        "Learning rate": _LR,
        "Batch size": (2, 4, 4, 4),
        "Grad accumulation steps": (8, 4, 4, 4),
        "Linear warmup ratio": (0.1, 0.1, 0.1, 0.1),
        "Minimum LR for cosine decay": _LR_MIN,
        "GRPO beta_KL": (0.02, 0.02, 0.1, 0.02),
        "GRPO clip range": (0.2, 0.2, 0.2, 0.2),
        "GRPO num. generations": (2, 4, 2, 4),
    },
    "tab:qwen1.5b_opsd_hparams": {
        "Max sequence length": (2048, 2048, 1400, 2048),
        **_LORA_ROWS, **_FL_ROWS,
        "Learning rate": _LR,
        "Batch size": (4, 16, 4, 8),
        "Grad accumulation steps": (4, 1, 4, 2),
        "Linear warmup ratio": (0.1, 0.1, 0.1, 0.1),
        "Minimum LR for cosine decay": _LR_MIN,
    },
    "tab:qwen1.5b_rltfsd_hparams": {
        "Max sequence length": (2048, 2048, 1400, 2048),
        **_LORA_ROWS, **_FL_ROWS,
        "Ratio of rounds to warmup": (0.1, 0.1, 0.1, 0.1),
        "Learning rate": _LR,
        "Batch size": (2, 4, 4, 4),
        "Grad accumulation steps": (8, 4, 4, 4),
        "Linear warmup ratio": (0.1, 0.1, 0.1, 0.1),
        "Minimum LR for cosine decay": _LR_MIN,
        "RLTF-SD gamma": (1.0, 1.0, 1.0, 1.0),
        "RLTF-SD SD Coefficient": (0.1, 0.1, 0.1, 0.1),
        "RLTF-SD RL Coefficient": (1.0, 1.0, 1.0, 1.0),
        "RLTF-SD Early Termination": (True, True, True, True),
    },
}

#: Which table each algorithm runs (Feedback SFT: SPEAR's, see the module docstring).
ALGORITHM_TABLE = {"spear": "tab:qwen1.5b_hparams", "feedback_sft": "tab:qwen1.5b_hparams",
                   "grpo": "tab:qwen1.5b_grpo_hparams", "opsd": "tab:qwen1.5b_opsd_hparams",
                   "rltf_sd": "tab:qwen1.5b_rltfsd_hparams"}

#: Table row → RunConfig key. Rows mapped to None are not fedspear settings (module docstring); "Ratio of rounds to
#: warmup" and "Linear warmup ratio" are the same quantity (both 0.1 everywhere) and set ``warmup_ratio``.
ROW_KEYS: dict[str, str | None] = {
    "Max sequence length": None,
    "LoRA rank": "lora_r", "LoRA alpha": "lora_alpha", "LoRA dropout": "lora_dropout",
    "Number of clients": "num_clients", "Dirichlet alpha": "dirichlet_alpha", "Number of FL rounds": "rounds",
    "Clients per round aggregated": "clients_per_round", "Local training steps per round": "local_steps",
    "Ratio of rounds to warmup": "warmup_ratio", "Linear warmup ratio": "warmup_ratio",
    "Generation temperature": "temperature", "Lambda win weight": "lambda_w", "Lambda loss weight": "lambda_l",
    "Unlikelihood threshold": "mu", "tau": "tau", "Learning rate": "lr", "Batch size": "batch_size",
    "Grad accumulation steps": "grad_accum", "Minimum LR for cosine decay": "lr_min",
    "GRPO beta_KL": "kl_beta", "GRPO clip range": "clip_eps", "GRPO num. generations": "group_size",
    "RLTF-SD gamma": "rltf_gamma", "RLTF-SD SD Coefficient": "rltf_sd_coef", "RLTF-SD RL Coefficient": "rltf_rl_coef",
    "RLTF-SD Early Termination": None,  # always on in fedspear's RLTF-SD (SPEC §5)
}

#: Generation budget per attempt where the authors' code sets one (tokens); other tasks keep the task default.
AUTHORS_MAX_NEW_TOKENS = {"math_mcqa": 512, "strategy_qa": 256}
PAPER_MAX_REVISIONS = 2


def paper_settings(task: str, algorithm: str) -> dict[str, Any]:
    """The ``RunConfig`` values of the paper's tables for ``task`` and ``algorithm`` (module docstring).

    Returns:
        ``{key: value}``: every mapped row of the algorithm's table, plus ``rollouts_per_round``,
        ``max_revisions``, ``partitioner`` and (MathMCQA, StrategyQA) ``max_new_tokens``.
    Raises:
        ValueError: unknown task or algorithm (names the known ones).
    """
    if task not in TASK_COLUMNS:
        raise ValueError(f"the paper's tables have no task {task!r}; choose one of {', '.join(TASK_COLUMNS)}")
    if algorithm not in ALGORITHM_TABLE:
        raise ValueError(f"no paper table for algorithm {algorithm!r}; choose one of {', '.join(ALGORITHM_TABLE)}")
    column = TASK_COLUMNS.index(task)
    values: dict[str, Any] = {}
    for row, per_task in TABLES[ALGORITHM_TABLE[algorithm]].items():
        key = ROW_KEYS[row]
        if key is not None:
            values[key] = per_task[column]
    spear = {ROW_KEYS[row]: v[column] for row, v in TABLES["tab:qwen1.5b_hparams"].items() if ROW_KEYS[row]}
    values["rollouts_per_round"] = spear["local_steps"] * spear["batch_size"] * spear["grad_accum"]
    values["max_revisions"] = PAPER_MAX_REVISIONS
    values["partitioner"] = "inner_dirichlet"
    if task in AUTHORS_MAX_NEW_TOKENS:
        values["max_new_tokens"] = AUTHORS_MAX_NEW_TOKENS[task]
    return values


PRESETS = ("paper",)


def preset_settings(preset: str, task: str, algorithm: str) -> dict[str, Any]:
    """The settings of a named run preset for one task and algorithm (today only ``"paper"``).

    Raises:
        ValueError: unknown preset, task or algorithm.
    """
    if preset != "paper":
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return paper_settings(task, algorithm)
