"""The client algorithms' names and per-task defaults, without torch: the run configuration reads them here, so
``fedspear --help``, a bad flag or a bad config answers without loading the model code (STYLE habit 14).

The algorithm modules (``fedspear.algorithms``) take their per-task tables from this module, and
``fedspear.algorithms.ALGORITHMS`` holds the modules in the order of ``ALGORITHM_NAMES``;
``tests/test_algorithms.py`` checks both.
"""

from __future__ import annotations

#: the ``algorithm`` run key's values; the order is the order of every comparison table's rows.
ALGORITHM_NAMES = ("spear", "feedback_sft", "grpo", "opsd", "rltf_sd")

#: SPEAR's τ, the unlikelihood tail length per task (paper appendix table "Hyperparameter Settings (SPEAR)": Math 32,
#: ARC 0, StrategyQA 24, HellaSwag 0; 0 = the whole completion). ``RunConfig.tau = None`` takes it.
TAU = {"math_mcqa": 32, "arc_challenge": 0, "strategy_qa": 24, "hellaswag": 0}
#: SPEAR's |L| ≤ ratio · |W| per task (SPEC §3: 2 for the letter-answer tasks, 4 where answers are reasoned).
#: ``RunConfig.max_lose_ratio = None`` takes it.
MAX_LOSE_RATIO = {"math_mcqa": 4, "arc_challenge": 2, "strategy_qa": 4, "hellaswag": 2}

#: GRPO's G and β_KL per task: paper appendix tables "... GRPO hyperparameters ..." (tab:qwen1.5b_grpo_hparams,
#: tab:llama3b_grpo_hparams). ``RunConfig.group_size`` / ``kl_beta = None`` take them.
GROUP_SIZE = {"math_mcqa": 2, "arc_challenge": 4, "strategy_qa": 2, "hellaswag": 4}
KL_BETA = {"math_mcqa": 0.02, "arc_challenge": 0.02, "strategy_qa": 0.1, "hellaswag": 0.02}
