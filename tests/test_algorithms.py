"""The client algorithms (SPEAR and the SPEC §5 baselines) on the tiny model with real ARC items."""

from __future__ import annotations


import numpy as np
import pytest

from fedspear.algorithms import ALGORITHMS, feedback_sft, grpo, opsd, rltf_sd, spear
from fedspear.worker import Worker
from fedspear.config import ConfigError, RunConfig
from fedspear.experiments.compare.grid import PRESETS
from fedspear.runtime.model import get_adapter
from fedspear.tasks import get_task

from helpers import ONE_ROUND_EXPECTED as EXPECTED, Alternate, make_worker, nonzero_start


def moved(worker: Worker, start: dict[str, np.ndarray]) -> float:
    now = get_adapter(worker.model)
    return max(float(np.abs(now[k] - start[k]).max()) for k in start)


def test_registry_names_every_algorithm():
    assert ALGORITHMS == {"spear": spear, "feedback_sft": feedback_sft, "grpo": grpo, "opsd": opsd, "rltf_sd": rltf_sd}
    for module in ALGORITHMS.values():
        assert callable(module.client_round) and callable(module.settings)
    with pytest.raises(ConfigError, match="algorithm: 'ppo' is not allowed; choose one of spear, feedback_sft"):
        RunConfig(algorithm="ppo")


def test_torch_free_table_agrees_with_the_modules_and_the_paper():
    """``fedspear.algorithm_defaults`` (what the run configuration reads without torch) names the registry's modules
    in order, and its per-task values are those the modules use and the paper's tables give (τ: SPEAR's table;
    G, β_KL: GRPO's)."""
    from fedspear import algorithm_defaults as D
    from fedspear.config import RunConfig as Config
    from fedspear.paper_settings import TABLES, TASK_COLUMNS

    assert tuple(ALGORITHMS) == D.ALGORITHM_NAMES
    assert dict(Config.__dataclass_fields__["algorithm"].metadata)["choices"] == list(ALGORITHMS)
    assert (spear.TAU, spear.MAX_LOSE_RATIO) == (D.TAU, D.MAX_LOSE_RATIO)
    spear_table, grpo_table = TABLES["tab:qwen1.5b_hparams"], TABLES["tab:qwen1.5b_grpo_hparams"]
    for column, task in enumerate(TASK_COLUMNS):
        assert D.TAU[task] == spear_table["tau"][column]
        assert D.GROUP_SIZE[task] == grpo_table["GRPO num. generations"][column]
        assert D.KL_BETA[task] == grpo_table["GRPO beta_KL"][column]
        cfg = Config(task=task).resolved()
        assert cfg.tau == D.TAU[task] and cfg.max_lose_ratio == D.MAX_LOSE_RATIO[task]
        assert (grpo.settings(cfg).group_size, grpo.settings(cfg).beta) == (D.GROUP_SIZE[task], D.KL_BETA[task])


def test_paper_table_defaults():
    """GRPO / RLTF-SD group size and β_KL per task, OPSD variants (paper appendix baseline tables; SPEC §5)."""
    for task, g, beta in [("arc_challenge", 4, 0.02), ("strategy_qa", 2, 0.1), ("hellaswag", 4, 0.02),
                          ("math_mcqa", 2, 0.02)]:
        cfg = RunConfig(task=task).resolved()
        assert (grpo.settings(cfg).group_size, grpo.settings(cfg).beta, grpo.settings(cfg).eps) == (g, beta, 0.2)
        r = rltf_sd.settings(cfg)
        assert (r.group_size, r.beta, r.gamma, r.sd_coef, r.rl_coef) == (g, beta, 1.0, 0.1, 1.0)
    cfg = RunConfig(group_size=3, kl_beta=0.0).resolved()
    assert (grpo.settings(cfg).group_size, grpo.settings(cfg).beta) == (3, 0.0)
    o = opsd.settings(RunConfig().resolved())
    assert (o.divergence, o.beta, o.temperature, o.teacher) == ("jsd", 0.5, 1.1, "base")
    o = opsd.settings(RunConfig(opsd_variant="authors").resolved())
    assert (o.divergence, o.temperature, o.teacher) == ("forward_kl", 2.0, "current")
    assert feedback_sft.settings(RunConfig().resolved()).lambda_l == 0.0


def test_spear_with_lambda_l_zero_equals_feedback_sft(arc_items, scripted):
    """Same traces and seed: SPEAR at λ_l = 0 and Feedback SFT give the identical update; SPEAR at λ_l = 0.1 does
    not (the lose set is non-empty, so the test can fail). The gate μ is set near 0: the random tiny model puts
    p ≈ 1/V on its tokens, so at the paper's μ = 0.3 no token would pass it and λ_l would not matter."""
    script = {arc_items[0].uid: [True], arc_items[1].uid: [False, True], arc_items[2].uid: [False, False, False]}
    items = arc_items[:3]
    results = {}
    for name, algo, lam in [("spear0", spear, 0.0), ("sft", feedback_sft, 0.1), ("spear", spear, 0.1)]:
        worker = make_worker(lambda_l=lam, max_revisions=2, mu=1e-9)
        start = nonzero_start(worker)
        metrics = algo.client_round(worker, worker.loaded, items, lr=1e-2, seed=7, feedback=scripted(script))
        assert metrics["num-wins"] == 2 and metrics["num-losses"] == 2 and metrics["weight"] == 2
        results[name] = (get_adapter(worker.model), start)
    a, b, c = results["spear0"][0], results["sft"][0], results["spear"][0]
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert max(float(np.abs(a[k] - c[k]).max()) for k in a) > 1e-6


def test_grpo_uniform_rewards_leave_the_adapter_unchanged(arc_items, always_right):
    """Every sample right → every group has zero advantage, so without the KL term (β = 0) the surrogate has zero
    gradient and the adapter does not move (with β > 0 the KL pulls it toward the base model). Counters: P·G."""
    worker = make_worker(algorithm="grpo", kl_beta=0.0)
    start = nonzero_start(worker)
    m = grpo.client_round(worker, worker.loaded, arc_items[:3], lr=1e-2, seed=1, feedback=always_right)
    assert m["generations"] == 3 * 4 and m["weight"] == 3 and m["zero_advantage_groups"] == 3
    assert m["steps"] == 2 and m["loss_pg"] == 0.0
    assert moved(worker, start) == 0.0
    worker = make_worker(algorithm="grpo")
    start = nonzero_start(worker)
    m = grpo.client_round(worker, worker.loaded, arc_items[:3], lr=1e-2, seed=1, feedback=always_right)
    assert m["loss_pg"] == 0.0 and m["kl"] > 0 and moved(worker, start) > 1e-5


def test_grpo_mixed_rewards_train(arc_items):
    worker = make_worker(algorithm="grpo")
    start = nonzero_start(worker)
    m = grpo.client_round(worker, worker.loaded, arc_items[:3], lr=1e-2, seed=1, feedback=Alternate())
    assert m["initial_correct"] == 6 and m["num-wins"] == 6 and m["zero_advantage_groups"] == 0
    # first answers are the 3 × G group samples, not the 3 prompts: an alternating reward is right on half of them
    assert m["initial_samples"] == 3 * grpo.settings(worker.loaded).group_size == 12 and m["prompts"] == 3
    assert m["steps"] == 2 and np.isfinite(m["loss"])
    assert moved(worker, start) > 1e-5


def test_opsd_privileged_context_and_training(arc_items, always_right):
    ex = arc_items[0]
    text = opsd.privileged_prompt(get_task("arc_challenge"), ex)
    assert f"the correct answer is {ex.gold}." in text and ex.question in text
    for variant in ("original", "authors"):
        worker = make_worker(algorithm="opsd", opsd_variant=variant)
        start = nonzero_start(worker)
        m = opsd.client_round(worker, worker.loaded, arc_items[:3], lr=1e-2, seed=2, feedback=always_right)
        assert m["generations"] == 3 and m["weight"] == 3 and m["steps"] == 2 and m["loss"] > 0
        assert moved(worker, start) > 1e-5


def test_rltf_sd_revises_only_wrong_samples(arc_items, scripted):
    """Sample 0 of each prompt right (early termination), the rest wrong: revisions = P·(N − 1)."""
    worker = make_worker(algorithm="rltf_sd")
    start = nonzero_start(worker)
    items = arc_items[:2]
    # is_correct call order: the P·N first-turn samples (prompt-major), then each revision
    script = {ex.uid: [True, False, False, False, True, False, False] for ex in items}
    m = rltf_sd.client_round(worker, worker.loaded, items, lr=1e-2, seed=3, feedback=scripted(script))
    assert m["initial_correct"] == 2 and m["revisions_attempted"] == 6 and m["revisions_successful"] == 2
    assert m["generations"] == 8 + 6 and m["weight"] == 2 and m["num-wins"] == 4
    assert m["initial_samples"] == 8 and m["prompts"] == 2  # 2 prompts × N = 4 first-turn samples
    assert m["steps"] == 2 and np.isfinite(m["loss"])
    assert moved(worker, start) > 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [name for name in ALGORITHMS if name not in PRESETS["tiny"].algorithms])
def test_one_round_per_algorithm_through_the_simulation_engine(algorithm, tmp_path):
    """``fedspear run --set algorithm=…`` with ``compare --preset tiny``'s settings (the tiny model): one round through
    Flower's simulation engine; the round record carries the algorithm's generations and aggregation weight (wins for
    SPEAR / SFT, prompts for the others), and the run's report is written. SPEAR's and GRPO's runs with these
    settings are the two cells of ``compare --preset tiny``
    (``tests/test_compare.py::test_compare_two_cells_end_to_end_and_resume``, the same checks against
    ``helpers.ONE_ROUND_EXPECTED``)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / algorithm
    settings = [f"{key}={value}" for key, value in {**PRESETS["tiny"].base, "algorithm": algorithm}.items()]
    cmd = [str(Path(sys.executable).with_name("fedspear")), "run", "-o", str(out),
           *(arg for setting in settings for arg in ("--set", setting))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    r1 = records[1]
    generations, weight = EXPECTED[algorithm]
    assert (r1["generations"], r1["weight"], r1["clients_ok"]) == (generations, weight, 1)
    assert r1["aggregated"] == (weight > 0)
    assert (out / "report.md").exists() and (out / "adapters" / "round_0001").is_dir()
