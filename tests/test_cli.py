"""Bad input on the command line: non-zero exit and one message naming the field or file (no traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedspear.cli import app
from fedspear.config import ConfigError
from fedspear.tasks.common import PACKAGE_DATA_DIR

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["run", *args])


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--task", "mnist"], "task: 'mnist' is not allowed"),
        (["--set", "lr=abc"], "lr: expected a number, got 'abc'"),
        (["--rounds", "0"], "rounds: 0 is out of range; it must be >= 1"),
        (["--set", "colour=red"], "--set: unknown config key 'colour'"),
        (["--model", "/nonexistent/model-dir"], "model path /nonexistent/model-dir does not exist"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--data-dir", "/nonexistent/data"], "data_dir: /nonexistent/data is not a directory"),
        (["--config", "/nonexistent/run.toml"], "config file /nonexistent/run.toml not found"),
        (["-o", ""], "output_dir: empty; give a folder"),
        (["--rounds", "1", "--set", "rounds=3"], "--set rounds: also given as --rounds 1; give it once"),
        (["--clients", "4", "--set", "num_clients=5"], "--set num_clients: also given as --clients 4"),
        (["--set", "round0_from=/nonexistent/run"], "round0_from /nonexistent/run: not a fedspear run directory"),
        (["--data-dir", " "], "data_dir: empty; give a folder"),
        (["--preset", ""], "unknown preset ''"),  # not "no preset": a full default run started
        (["--model", ""], "model: empty; give a packaged name"),  # was "model directory . has no config.json"
        (["--model", __file__], "is a file; give a Hugging Face model folder"),
        (["--seed", str(2**64)], "seed: 18446744073709551616 is out of range; it must be <= 18446744073709551615"),
        (["--set", "dp_noise_seed=4294967296"], "dp_noise_seed: 4294967296 is out of range; it must be <= 4294967295"),
        (["--model", "tiny-random", "--set", "last_layers=3"], "last_layers: 3 is out of range for tiny-random, "
                                                              "which has 2 layers; it must be in 1..2"),
    ],
)
def test_bad_input_exits_2_with_a_named_field(args, fragment, tmp_path, monkeypatch):
    # from an empty folder: the default output folder (runs/default) must not be a run that `make run` finished in
    # the checkout, which a resumed command would report as done before it reads round0_from
    monkeypatch.chdir(tmp_path)
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output


def test_malformed_data_record_names_file_and_line(tmp_path):
    data = tmp_path / "data" / "arc_challenge"
    data.mkdir(parents=True)
    shutil.copy(PACKAGE_DATA_DIR / "arc_challenge" / "test.jsonl", data / "test.jsonl")
    lines = (PACKAGE_DATA_DIR / "arc_challenge" / "train.jsonl").read_text().splitlines()[:20]
    record = json.loads(lines[2])
    del record["answerKey"]
    lines[2] = json.dumps(record)
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    result = _run("--data-dir", str(tmp_path / "data"), "-o", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert "train.jsonl:3" in result.output and "answerKey" in result.output


def test_a_data_line_that_is_not_utf8_is_named(tmp_path):
    data = tmp_path / "data" / "arc_challenge"
    data.mkdir(parents=True)
    shutil.copy(PACKAGE_DATA_DIR / "arc_challenge" / "test.jsonl", data / "test.jsonl")
    lines = (PACKAGE_DATA_DIR / "arc_challenge" / "train.jsonl").read_bytes().splitlines()[:20]
    lines[4] = b"\xff\xfe\x00"
    (data / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = _run("--model", "tiny-random", "--data-dir", str(tmp_path / "data"), "-o", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert "train.jsonl:5: not UTF-8 text (character 1 of the line)" in result.output


def test_an_empty_evaluation_split_is_refused(tmp_path):
    """Every round would have scored 0 held-out items and the run "finished" with a blank accuracy."""
    data = tmp_path / "data" / "arc_challenge"
    data.mkdir(parents=True)
    shutil.copy(PACKAGE_DATA_DIR / "arc_challenge" / "train.jsonl", data / "train.jsonl")
    (data / "test.jsonl").write_text("\n")
    result = _run("--model", "tiny-random", "--data-dir", str(tmp_path / "data"), "-o", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    assert "arc_challenge's test split (data_dir" in result.output and "holds no usable record" in result.output
    assert not (tmp_path / "run").exists()


def test_a_folder_that_is_not_a_run_is_left_as_it_is(tmp_path):
    """`-o` naming a folder without config.toml (not a run directory) that holds files a run's start would delete
    (its *.tmp leftovers) or read as its own (metrics.jsonl, adapters/) is refused before anything in it is written or
    deleted. (Other files may sit beside a run: `fedspear compare` puts cell.toml and log.txt there first.)"""
    folder = tmp_path / "mine"
    (folder / "build.tmp").mkdir(parents=True)
    (folder / "build.tmp" / "keep.txt").write_text("keep")
    (folder / "notes.tmp").write_text("keep")
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    result = _run("--model", "tiny-random", "-o", str(folder))
    assert result.exit_code == 2, result.output
    assert "holds build.tmp, notes.tmp but no config.toml: not a fedspear run directory" in result.output
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before


@pytest.mark.parametrize("names", [("report.md", "plots/accuracy.png", "partitions.json"), ("progress/notes.txt",),
                                   ("answers/a.txt", "eval/e.json"), ("config.toml/mine.txt",)])
def test_a_folder_holding_what_a_run_would_write_is_left_as_it_is(tmp_path, names):
    """A folder without config.toml holding a file or folder of a name a run writes (its report, plots, partitions,
    answers, the progress folder it deletes at its start…) is refused: a run there replaced the user's files."""
    folder = tmp_path / "mydocs"
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("mine")
    result = _run("--model", "tiny-random", "-o", str(folder))
    assert result.exit_code == 2, result.output
    assert ("but no config.toml: not a fedspear run directory" in result.output
            or "its config.toml is a folder, not a run's config" in result.output)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(names)
    assert all((folder / name).read_text() == "mine" for name in names)


def test_certs_refuses_keys_only_without_a_node_and_a_file_for_its_folder(tmp_path):
    """`fedspear certs --keys-only` with no --node made nothing and said nothing; a file given as the folder gave
    "[Errno 17] File exists"."""
    result = runner.invoke(app, ["certs", str(tmp_path / "c"), "--keys-only"])
    assert result.exit_code == 2 and "name at least one --node" in result.output
    (tmp_path / "afile.txt").write_text("keep")
    result = runner.invoke(app, ["certs", str(tmp_path / "afile.txt")])
    assert result.exit_code == 2 and "is an existing file, not a folder" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt"]


def test_a_first_start_killed_while_writing_its_config_starts_again(tmp_path):
    """A folder holding only config.toml.tmp (a first start killed between writing and renaming it) is the run's own:
    the next start proceeds (its leftover removed, config.toml written); and round0_from is checked only until
    round 0 is recorded, so a resume does not depend on the lending run still being there."""
    from fedspear.cli import preflight
    from fedspear.config import RunConfig

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml.tmp").write_text("half")
    preflight(RunConfig(model="tiny-random", output_dir=str(run)))
    assert sorted(p.name for p in run.iterdir()) == ["config.toml"]
    lent = RunConfig(model="tiny-random", output_dir=str(run), round0_from=str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match="round0_from .*gone: not a fedspear run directory"):
        preflight(lent)
    (run / "metrics.jsonl").write_text("")  # as if round 0 were recorded: the lender is no longer read
    preflight(lent)


def test_too_many_clients_for_the_data():
    result = _run("--train-size", "5", "--clients", "10")
    assert result.exit_code == 2
    assert "num_clients = 10 exceeds the 5 train examples" in result.output


@pytest.mark.parametrize(("args", "fragment"), [
    (["--output", "{tmp}/bench.md"], "give a .json path, e.g. {tmp}/bench.json"),  # the .md would overwrite the JSON
    (["--output", "{tmp}"], "is a folder; give a file path, e.g. {tmp}/bench.json"),
    (["--results-dir", "{tmp}/file.txt"], "is an existing file, not a folder"),
    (["--dtype", "bf17"], "dtype must be one of auto, bf16, fp32"),
    (["--gradient-checkpointing", "maybe"], "--gradient-checkpointing must be auto, on or off"),
    (["--compile-decode", "yes"], "--compile-decode must be auto, on or off"),
    (["--compile-training", "auto"], "--compile-training must be on or off"),
])
def test_bench_refuses_bad_input_before_measuring(args, fragment, tmp_path, monkeypatch):
    """A bad value or output path stops `fedspear bench` before it measures (minutes), not after; nothing written."""
    from fedspear.experiments import bench

    (tmp_path / "file.txt").write_text("keep")
    monkeypatch.setattr(bench, "run_bench", lambda **kwargs: pytest.fail("measured despite bad input"))
    result = runner.invoke(app, ["bench", "--model", "tiny-random", "--quick", "--no-round",
                                 *[a.format(tmp=tmp_path) for a in args]])
    assert result.exit_code == 2, result.output
    assert fragment.format(tmp=tmp_path) in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_bench_refuses_a_folder_where_its_markdown_goes(tmp_path, monkeypatch):
    """The .md written beside --output after the measuring: a folder there was an IsADirectoryError at the end."""
    from fedspear.experiments import bench

    (tmp_path / "q.md").mkdir()
    monkeypatch.setattr(bench, "run_bench", lambda **kwargs: pytest.fail("measured despite bad input"))
    result = runner.invoke(app, ["bench", "--model", "tiny-random", "--quick", "--no-round",
                                 "--output", str(tmp_path / "q.json")])
    assert result.exit_code == 2, result.output
    assert f"the md file goes beside it as {tmp_path / 'q.md'}, which is a folder" in result.output


def test_bench_quick_prints_every_figure(tmp_path):
    """`fedspear bench --quick` on the tiny model: the JSON has every bound, throughput and round phase (speed is
    not asserted; the figures for this machine are in docs/results/bench)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "bench.json"
    cmd = [str(Path(sys.executable).with_name("fedspear")), "bench", "--model", "tiny-random", "--quick", "--json",
           "--output", str(out), "--results-dir", str(tmp_path / "results")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["bounds"]) == {"matmul_flops_bf16", "matmul_flops_fp32", "memory_bandwidth_bytes_per_s"}
    assert all(v > 0 for v in result["bounds"].values())
    t = result["throughput"]
    assert t["prefill"]["tokens_per_s"] > 0 and 0 < t["train"]["utilisation"]
    assert set(t["decode"]) == {"batch_1", "batch_8", "batch_32"} and t["evaluate"]["items_per_s"] > 0
    assert "decode_compiled" not in t and result["compile_decode"] == "auto"  # auto compiles on a GPU only
    r = result["round"]
    assert set(r["seconds"]) >= {"generate_initial", "generate_revisions", "train", "aggregate", "evaluate",
                                 "flower_overhead", "round"}
    assert r["seconds_per_client_round"] > 0 and r["counters"]["prompts"] == 2
    assert r["rounds"] == 3 and len(r["seconds_per_client_round_each"]) == 3
    assert r["seconds_per_client_round"] == sorted(r["seconds_per_client_round_each"])[1]  # the median of 3
    assert "| prefill |" in out.with_suffix(".md").read_text()
    # the same figures under the machine kind's name, with the targets judged
    kind = result["machine"]["kind"]
    named = tmp_path / "results" / f"{kind}-tiny-random-{result['dtype']}.json"
    assert json.loads(named.read_text()) == result
    markdown = named.with_suffix(".md").read_text()
    assert f"Machine kind: **{kind}**" in markdown and "| decode batch 32 ≥ 30% of the bandwidth bound |" in markdown
    assert "| SPEAR client-round ≤ 0.5 × the authors' " in markdown  # their figure of this kind, or none
    # progress on stderr, phase by phase, so a long benchmark is never silent
    for line in ("measuring this machine's bounds", "measuring decode at batch 32", "measuring 3 SPEAR rounds",
                 "measuring round 0 of 3 done", "measuring round 3 of 3 done"):
        assert line in proc.stderr, proc.stderr[-2000:]


@pytest.mark.gpu
def test_bench_on_a_gpu_reports_its_bounds(tmp_path):
    """`fedspear bench --device cuda` measures the GPU's matmul and bandwidth and runs the model there."""
    import subprocess
    import sys
    from pathlib import Path

    cmd = [str(Path(sys.executable).with_name("fedspear")), "bench", "--model", "tiny-random", "--quick", "--json",
           "--device", "cuda", "--no-round"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["device"] == "cuda" and result["machine"]["kind"].startswith("cuda-")
    assert all(v > 0 for v in result["bounds"].values())
    assert result["throughput"]["decode"]["batch_8"]["tokens_per_s"] > 0
    compiled = result["throughput"]["decode_compiled"]  # auto compiles there, as runs do
    assert set(compiled) == {"batch_1", "batch_8", "batch_32"} and compiled["batch_32"]["first_call_seconds"] > 0


def test_bench_scaling_quick_measures_every_axis(tmp_path):
    """`fedspear bench --scaling --quick`: every axis at every size, phases in seconds, a plot; no revision is
    attempted at max_revisions = 0 and some are at 1 (the tiny random model is never right)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "scaling.json"
    cmd = [str(Path(sys.executable).with_name("fedspear")), "bench", "--scaling", "--model", "tiny-random",
           "--quick", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    from fedspear.experiments.bench import QUICK_SCALING_AXES

    assert {k: [r["value"] for r in rows] for k, rows in result["axes"].items()} == QUICK_SCALING_AXES
    for axis, rows in result["axes"].items():
        for row in rows:
            assert all(v >= 0 for v in row["seconds"].values()) and max(row["seconds"].values()) > 0, (axis, row)
    revisions = {r["value"]: r["counters"]["revisions_attempted"] for r in result["axes"]["max_revisions"]}
    assert revisions[0] == 0 and revisions[1] > 0
    assert out.with_suffix(".png").stat().st_size > 0 and "**max_new_tokens**" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("command", [["compare", "--preset", "tiny", "--output-dir", "{run}"],
                                     ["bench", "--model", "tiny-random", "--quick", "--no-round", "--output",
                                      "{run}/partitions.json"],
                                     ["bench", "--model", "tiny-random", "--quick", "--no-round", "--results-dir",
                                      "{run}"]])
def test_outputs_of_other_commands_stay_out_of_a_run_directory(tmp_path, command):
    """`fedspear compare -o <run>` wrote grid.toml, cells/ and plots/ among the run's files; `bench --output
    <run>/partitions.json` replaced the run's partitions; `bench --results-dir <run>` put its files among them."""
    run = tmp_path / "run"
    run.mkdir()
    for name, text in (("config.toml", ""), ("metrics.jsonl", ""), ("partitions.json", "{}")):
        (run / name).write_text(text)
    result = runner.invoke(app, [a.format(run=run) for a in command])
    assert result.exit_code == 2, result.output
    assert f"is in the run directory {run}" in result.output
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "metrics.jsonl", "partitions.json"]
    assert (run / "partitions.json").read_text() == "{}"


def test_a_tilde_in_a_path_is_the_home_folder(tmp_path, monkeypatch):
    """`-o '~/x'` (quoted, or in a TOML file or --set, where no shell expands it) made a folder named `~` in the
    working folder; path settings and path options now expand it as a shell would."""
    from fedspear.config import RunConfig, load_config

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert RunConfig(output_dir="~/runs/x").output_dir == str(home / "runs" / "x")
    assert RunConfig(data_dir="~/data").data_dir == str(home / "data")
    assert RunConfig(round0_from="~/runs/lender").round0_from == str(home / "runs" / "lender")
    (work / "my.toml").write_text('output_dir = "~/runs/y"\n')
    assert load_config(work / "my.toml").output_dir == str(home / "runs" / "y")
    result = runner.invoke(app, ["certs", "~/deploy", "--host", "127.0.0.1"])
    assert result.exit_code == 0, result.output
    assert (home / "deploy" / "ca.pem").is_file() and list(work.iterdir()) == [work / "my.toml"]


def test_a_resume_into_folders_it_cannot_write_is_refused_before_the_round(tmp_path, monkeypatch):
    """A resumed run whose adapters/ (or metrics.jsonl) cannot be written failed with a PermissionError traceback
    after a round's work; preflight now refuses it. (Permission bits do not bind root, so os.access is made to say
    what it says on a read-only folder.)"""
    import os

    from fedspear.cli import preflight
    from fedspear.config import RunConfig

    run = tmp_path / "run"
    cfg = RunConfig(model="tiny-random", output_dir=str(run))
    preflight(cfg)
    for folder in ("adapters", "eval", "tensorboard"):
        (run / folder).mkdir()
    for name in ("metrics.jsonl", "partitions.json"):
        (run / name).write_text("")
    real = os.access
    for locked in (run / "adapters", run / "metrics.jsonl"):
        monkeypatch.setattr(os, "access", lambda p, mode, locked=locked: Path(p) != locked and real(p, mode))
        with pytest.raises(ConfigError, match=f"{locked}.*(cannot write|read-only)"):
            preflight(cfg)
    # what a resume does not write, or replaces by a rename in the run's folder: eval/ (fedspear eval's),
    # tensorboard/ with tensorboard off, partitions.json
    for locked in (run / "eval", run / "tensorboard", run / "partitions.json"):
        monkeypatch.setattr(os, "access", lambda p, mode, locked=locked: Path(p) != locked and real(p, mode))
        preflight(cfg)
