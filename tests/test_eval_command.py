"""``fedspear eval``: the base model, a saved adapter or a run's last adapter, scored by the run's own evaluation code.

A run directory is built by hand with the tiny random model (config.toml + adapters/round_NNNN, as ``run_server``
writes them); the command's answers must equal ``Evaluator`` called directly on the same adapter. The real run with
SmolLM2 is checked against its own metrics.jsonl in ``test_e2e``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedspear.cli import app
from fedspear.config import load_config
from fedspear.evaluation import Evaluator, eval_items
from fedspear.rundir import RunDir
from fedspear.tasks import arc_challenge

runner = CliRunner()

SETTINGS = dict(model="tiny-random", lora_r=4, lora_alpha=8, eval_size=6, eval_gen_size=3, max_new_tokens=6,
                eval_batch_size=4)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory holding round 0 (the identity adapter) and round 2 (every LoRA value perturbed)."""
    path = tmp_path_factory.mktemp("eval") / "run"
    cfg = load_config(**SETTINGS, output_dir=str(path))
    run = RunDir(path)
    run.check_or_write_config(cfg.resolved())
    evaluator = Evaluator(cfg)
    start = evaluator.initial_adapter()
    rng = np.random.default_rng(0)
    trained = {k: (v + rng.normal(0, 0.5, v.shape)).astype(v.dtype) for k, v in start.items()}
    run.save_adapter(0, start, evaluator.peft_config())
    run.save_adapter(2, trained, evaluator.peft_config())
    for r in range(3):  # the rounds metrics.jsonl says were completed
        run.append({"round": r})
    # a crash mid-write of round 3's adapter: neither picked as the last adapter nor misread as a round
    (path / "adapters" / "round_0003.tmp").mkdir()
    (path / "adapters" / "round_0003.tmp" / "adapter_model.safetensors").write_bytes(b"half")
    expected = {}
    for r, arrays in ((0, start), (2, trained)):
        answers: list = []
        expected[r] = (evaluator(arrays, answers=answers), answers)
    assert expected[0][1] != expected[2][1]  # the two adapters answer differently: picking the wrong one shows
    return path, expected


def _eval(*args):
    return runner.invoke(app, ["eval", *map(str, args)])


def _strip(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "seconds_evaluate"}


def test_run_directory_scores_its_last_adapter_with_the_runs_settings(run_dir, tmp_path):
    path, expected = run_dir
    out = tmp_path / "last.json"
    result = _eval(path, "-o", out)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    metrics, answers = expected[2]
    assert saved["round"] == 2 and saved["adapter"].endswith("round_0002")
    assert _strip(saved["metrics"]) == _strip(metrics)
    assert saved["metrics"]["n"] == 6 and saved["metrics"]["n_gen"] == 3  # the run's subset, not the CLI default
    # per item: the fixed subset in evaluation order, with the answers and their verdicts
    order = eval_items(arc_challenge.load("test"), 6, 3)
    assert [i["uid"] for i in saved["items"]] == [ex.uid for ex in order]
    assert [{k: i[k] for k in ("uid", "gold", "answer_ll")} for i in saved["items"]] == [
        {k: a[k] for k in ("uid", "gold", "answer_ll")} for a in answers]
    assert "".join("1" if i["correct_ll"] else "0" for i in saved["items"]) == metrics["correct_ll"]
    assert "".join("1" if i["correct_gen"] else "0" for i in saved["items"][:3]) == metrics["correct_gen"]
    assert all("answer_gen" not in i for i in saved["items"][3:])  # generation covered the first 3 only
    line = result.output.splitlines()[0]
    assert line.startswith("arc_challenge test, round 2 of ") and f"log-likelihood {metrics['acc_ll']:.3f}" in line
    assert "(n=6)" in line and "(n=3)" in line


def test_adapter_folder_and_round_option_pick_that_adapter(run_dir, tmp_path):
    path, expected = run_dir
    for args in ([path / "adapters" / "round_0000"], [path, "--round", "0"]):
        out = tmp_path / "r0.json"
        result = _eval(*args, "-o", out)
        assert result.exit_code == 0, result.output
        saved = json.loads(out.read_text())
        assert saved["round"] == 0 and _strip(saved["metrics"]) == _strip(expected[0][0])
    # without -o: into the run directory's eval/, outside adapters/ (which a redone round replaces)
    result = _eval(path / "adapters" / "round_0002")
    assert result.exit_code == 0, result.output
    assert (path / "eval" / "eval-round_0002-arc_challenge-test.json").is_file()
    # an adapter saved after the last completed round (the run died before recording it) is not "the last"
    import shutil

    shutil.copytree(path / "adapters" / "round_0002", path / "adapters" / "round_0004")
    try:
        out = tmp_path / "last.json"
        assert _eval(path, "-o", out).exit_code == 0 and json.loads(out.read_text())["round"] == 2
    finally:
        shutil.rmtree(path / "adapters" / "round_0004")


def test_an_adapter_folder_named_from_inside_it_is_that_round(run_dir, tmp_path, monkeypatch):
    """`fedspear eval .` inside adapters/round_0002 read the name of `.` (empty): no round, and a default output
    refused as lying in the run; now it is round 2, as by its absolute path."""
    path, expected = run_dir
    monkeypatch.chdir(path / "adapters" / "round_0002")
    out = tmp_path / "dot.json"
    result = _eval(".", "-o", out)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["round"] == 2 and _strip(saved["metrics"]) == _strip(expected[2][0])


def test_base_model_and_overrides(run_dir, tmp_path):
    path, expected = run_dir
    out = tmp_path / "base.json"
    result = _eval("--model", "tiny-random", "--set", "lora_r=4", "--eval-size", "6", "--eval-gen-size", "3",
                   "--set", "max_new_tokens=6", "--set", "eval_batch_size=4", "-o", out)
    assert result.exit_code == 0, result.output
    assert _strip(json.loads(out.read_text())["metrics"]) == _strip(expected[0][0])  # the base model = round 0
    # another split and size of the same run: a different item set, the run's adapter
    out = tmp_path / "train.json"
    result = _eval(path, "--split", "train", "--eval-size", "5", "--eval-gen-size", "0", "-o", out)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["split"] == "train" and saved["metrics"]["n"] == 5 and "n_gen" not in saved["metrics"]
    assert [i["uid"] for i in saved["items"]] == [ex.uid for ex in eval_items(arc_challenge.load("train"), 5, 0)]
    # --limit N (lm-eval's meaning): the split's first N records in file order; the run's eval_size (6) then keeps
    # all 5 and --eval-gen-size picks the generation items among them
    out = tmp_path / "limit.json"
    result = _eval(path, "--limit", "5", "--eval-gen-size", "2", "-o", out)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    first5 = arc_challenge.load("test")[:5]
    assert saved["limit"] == 5 and saved["metrics"]["n"] == 5 and saved["metrics"]["n_gen"] == 2
    assert [i["uid"] for i in saved["items"]] == [ex.uid for ex in eval_items(first5, 6, 2)]
    assert sorted(i["uid"] for i in saved["items"]) == sorted(ex.uid for ex in first5)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["{run}/nothing-here"], "no such run directory or adapter folder"),
        (["{run}/adapters"], "neither a run directory (config.toml) nor an adapter folder"),
        (["{run}", "--round", "1"], "no adapter saved for round 1 (saved: 0…2)"),
        (["{run}", "--model", "smollm2-135m"], "model: the adapter was trained with model = 'tiny-random'"),
        (["{run}", "--set", "lora_r=8"], "lora_r: the adapter was trained with lora_r = 4"),
        (["{run}", "--config", "{run}/config.toml"], "a run directory brings its own config.toml"),
        (["{run}", "--split", "dev"], "--split 'dev': arc_challenge has train, test"),
        (["{run}/adapters/round_0000", "--round", "0"], "--round needs a run directory, not an adapter folder"),
        (["--round", "3"], "--round needs a run directory"),
        (["{run}", "--task", "mnist"], "task: 'mnist' is not allowed"),
        # the result would replace the run's own records (a resume then failed on metrics.jsonl)
        (["{run}", "-o", "{run}/metrics.jsonl"], "is in the run directory"),
        (["{run}", "-o", "{run}/adapters/x.json"], "is in the run directory"),
        (["{run}", "-o", "{run}/config.toml"], "would replace a config file"),
    ],
)
def test_bad_input_exits_2_with_a_named_field(run_dir, args, fragment):
    path, _ = run_dir
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    result = _eval(*[a.replace("{run}", str(path)) for a in args])
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "Traceback" not in result.output
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before  # nothing of the run changed


def test_bare_adapter_takes_r_and_alpha_from_its_config(run_dir, tmp_path):
    import shutil

    path, expected = run_dir
    bare = tmp_path / "my-adapter"
    shutil.copytree(path / "adapters" / "round_0002", bare)
    out = tmp_path / "bare.json"
    result = _eval(bare, "--model", "tiny-random", "--eval-size", "6", "--eval-gen-size", "3",
                   "--set", "max_new_tokens=6", "--set", "eval_batch_size=4", "-o", out)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["round"] is None and _strip(saved["metrics"]) == _strip(expected[2][0])
    # a model the adapter does not fit: named, not a traceback
    result = _eval(bare, "--model", "tiny-random", "--set", "lora_r=8", "--eval-size", "2")
    assert (result.exit_code == 2 and "does not match the model's LoRA layout" in result.output
            and "has shape (4, 64), expected (8, 64)" in result.output)
    # no --model and no base model folder named in adapter_config.json: asked for, not guessed
    result = _eval(bare, "--eval-size", "2")
    assert result.exit_code == 2 and "a bare adapter needs --model" in result.output
    # nor by a --config that names no model (it would have fallen back to the default model); one that does names it
    config = tmp_path / "eval.toml"
    config.write_text("eval_size = 2\nmax_new_tokens = 4\n")
    result = _eval(bare, "--config", config)
    assert result.exit_code == 2 and "a bare adapter needs --model" in result.output, result.output
    config.write_text('model = "tiny-random"\neval_size = 2\neval_gen_size = 1\nmax_new_tokens = 4\n')
    result = _eval(bare, "--config", config, "-o", tmp_path / "from-config.json")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "from-config.json").read_text())["model"] == "tiny-random"
    # an unwritable output: a message before the evaluation, not a traceback
    result = _eval(bare, "--model", "tiny-random", "--eval-size", "2", "-o",
                   bare / "adapter_model.safetensors" / "x.json")
    assert result.exit_code == 2 and "adapter_model.safetensors is a file, not a folder" in result.output


@pytest.mark.parametrize(("args", "fragment"), [
    (["--harness", "lm-eval", "--model", "tiny-random"], "tiny-random exists only in memory"),
    (["--harness", "lm-eval", "--task", "strategy_qa"], "strategy_qa has no lm-eval task here"),
    (["--harness", "lm-eval", "--split", "train"], "scores arc_challenge's test split only"),
    (["--harness", "helm"], "--harness 'helm': choose fedspear or lm-eval"),
    (["--harness", "lm-eval", "--eval-size", "50", "--eval-gen-size", "5"],
     "--eval-size, --eval-gen-size: not used by --harness lm-eval"),
    (["--limit", "0"], "--limit"),
])
def test_harness_bad_input(args, fragment):
    result = _eval(*args)
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "Traceback" not in result.output


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arc_challenge", "hellaswag"])
def test_lm_eval_harness_scores_the_shipped_data_offline_with_the_adapter(tmp_path, task, monkeypatch):
    """lm-eval's own task config on the packaged SmolLM2, first 6 documents, no network: the identity adapter scores
    as the base model; a perturbed adapter is what gets scored (its per-item log-likelihood choices differ)."""
    from fedspear.experiments.harness import evaluate_lm_eval
    from fedspear.runtime.model import resolve_dtype
    from fedspear.runtime.model_zoo import resolve_model_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(model="smollm2-135m", task=task, output_dir=str(tmp_path / "run"))
    run = RunDir(tmp_path / "run")
    run.check_or_write_config(cfg.resolved())
    evaluator = Evaluator(cfg)
    start = evaluator.initial_adapter()
    rng = np.random.default_rng(0)
    run.save_adapter(0, start, evaluator.peft_config())
    run.save_adapter(1, {k: (v + rng.normal(0, 0.3, v.shape)).astype(v.dtype) for k, v in start.items()},
                     evaluator.peft_config())
    run.append({"round": 0})
    run.append({"round": 1})
    outs = {}
    for name, args in (("base", ["--model", "smollm2-135m", "--task", task]),
                       ("r0", [tmp_path / "run", "--round", "0"]), ("r1", [tmp_path / "run"])):
        out = tmp_path / f"{name}.json"
        result = _eval(*args, "--harness", "lm-eval", "--limit", "6", "-o", out)
        assert result.exit_code == 0, result.output
        outs[name] = json.loads(out.read_text())
        assert f"{task} " in result.output and "by lm-eval" in result.output and "acc_norm" in result.output
    base = outs["base"]
    assert (base["harness"] == "lm-eval" and base["metrics"]["n"] == 6
            and [i["doc_id"] for i in base["items"]] == list(range(6)))
    assert base["metrics"]["acc"] == pytest.approx(sum(i["acc"] for i in base["items"]) / 6)
    assert all(len(i["logliks"]) == 4 and all(v < 0 for v in i["logliks"]) for i in base["items"])
    # LoRA B = 0: the base model's choices, and its scores up to float rounding (peft's extra path adds exact zeros;
    # allowed: 1e-2 nats on sums of ≈ 100)
    for a, b in zip(outs["r0"]["items"], base["items"]):
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
        assert a["logliks"] == pytest.approx(b["logliks"], abs=1e-2)
    # the perturbed adapter is applied: every document's scores move by far more than that rounding
    assert all(max(abs(x - y) for x, y in zip(a["logliks"], b["logliks"])) > 0.1
               for a, b in zip(outs["r1"]["items"], base["items"]))
    if task == "arc_challenge":  # the CLI's path into the harness is the same for every task: checked on one
        direct = evaluate_lm_eval(resolve_model_dir("smollm2-135m"), task, tmp_path / "run" / "adapters" /
                                  "round_0001", limit=6, batch_size=cfg.eval_batch_size,  # the CLI's batch, precision
                                  dtype=resolve_dtype("auto"))
        assert direct["items"] == outs["r1"]["items"]


def test_an_empty_split_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """`fedspear eval` of a split with no record printed a blank accuracy and exit 0."""
    from fedspear.runtime import model as runtime_model

    data = tmp_path / "data" / "arc_challenge"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("\n")
    monkeypatch.setattr(runtime_model, "load_base", lambda *a, **k: pytest.fail("loaded the model for no data"))
    result = _eval("--model", "tiny-random", "--set", f"data_dir={tmp_path / 'data'}", "-o", tmp_path / "e.json")
    assert result.exit_code == 2, result.output
    assert "arc_challenge's test split (data_dir" in result.output and "holds no usable record" in result.output
    assert not (tmp_path / "e.json").exists()


def test_only_a_run_directory_keeps_outputs_out(tmp_path, monkeypatch):
    """What counts as a run directory for outputs (`check_outside_runs`): a config.toml with a run's records, not a
    user's project folder holding its own config.toml and plots/; a relative adapter folder named from inside
    adapters/ still has its run's eval/ as default output."""
    from fedspear.cli import check_outside_runs, default_eval_output
    from fedspear.config import ConfigError

    project = tmp_path / "proj"
    (project / "plots").mkdir(parents=True)
    (project / "config.toml").write_text('model = "tiny-random"\n')
    check_outside_runs(project / "eval-tiny-random-arc_challenge-test.json", "the default output")  # accepted
    run = project / "runs" / "x"
    (run / "adapters" / "round_0001").mkdir(parents=True)
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text("")
    for bad, folder in ((run / "partitions.json", False), (run / "adapters" / "e.json", False), (run, True),
                        (run / "eval" / "cmp", True)):
        with pytest.raises(ConfigError, match=f"is in the run directory {run}"):
            check_outside_runs(bad, "--output", folder=folder)
    check_outside_runs(run / "eval" / "e.json", "-o")  # a run's own eval/ folder: where eval writes by default
    monkeypatch.chdir(run / "adapters")
    cfg = load_config(**SETTINGS)
    assert default_eval_output(cfg, Path("round_0001"), 1, "eval", "test").resolve() == \
        (run / "eval" / "eval-round_0001-arc_challenge-test.json").resolve()
    monkeypatch.chdir(run / "adapters" / "round_0001")  # `fedspear eval .` from inside the round's folder
    assert default_eval_output(cfg, Path("."), 1, "eval", "test").resolve() == \
        (run / "eval" / "eval-round_0001-arc_challenge-test.json").resolve()
