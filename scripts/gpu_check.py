"""The Python steps of ``scripts/gpu_check.sh`` (read that script's header first): one sub-command per step.

    python scripts/gpu_check.py prepare --bundle .gpu-bundle          # on the CPU machine, before the GPU one
    python scripts/gpu_check.py random-model --from DIR --out DIR [--tiny]
    python scripts/gpu_check.py round --model DIR --rounds 2 --out round.json [--set KEY=VALUE ...] [--small]
    python scripts/gpu_check.py clients --model DIR --clients 5 --rounds 2 --out clients.json [--set ...] [--small]
    python scripts/gpu_check.py flwr-install --wheels .gpu-bundle/wheels   # make `import flwr` work, or say why not
    python scripts/gpu_check.py summary --dir RESULTS --kind KIND --out gpu-check   # .json + .md of every step

``prepare`` collects what a bare GPU machine lacks into the bundle folder (git-ignored): the config and tokenizer
files of the packaged SmolLM2 and Qwen2.5-Coder-1.5B exports, no weights (``exports/<name>/``, read through
``$FEDSPEAR_EXPORTS``); Flower's wheel and the wheels of its dependencies for CPython 3.12 on x86-64 Linux
(``wheels/``; not ``uv``, which Flower uses only to install a FAB's own dependencies, switched off here); the
fedspear commit it was made from (``COMMIT``). ``round`` is a SPEAR client-round at the paper's preset through
fedspear's ``Worker`` (no Flower), feedback alternating right / wrong so a random-weight model still has wins to train
on — the cost of a real round at the token budget (every answer of a random model runs to it). ``clients`` runs
that round in ``--clients`` processes at once on the one GPU, each with its own model and its own share of the
prompts, each round started together in all of them: what Flower's simulation does with ``client_gpus = 1 /
clients`` (one Ray actor per client, each asking for that share of the GPU), without Ray, which cannot be carried.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2, QWEN = "smollm2-135m", "qwen2.5-coder-1.5b"
WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt")
# Flower's dependencies (and theirs) that the GPU image has in a version Flower accepts, or that are large and never
# imported by the SuperLink / SuperNode path: left out of the bundle. pip still checks each one there.
PRESENT = {"numpy", "uv", "pygments", "typing-extensions", "idna", "certifi", "urllib3", "charset-normalizer",
           "markupsafe", "pyyaml", "sniffio", "anyio", "h11", "httpcore", "mdurl", "markdown-it-py", "shellingham",
           "uvloop", "annotated-doc"}
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")


def _say(text: str) -> None:
    print(text, flush=True)


def _export_files(source: Path, target: Path) -> int:
    """Copy an export's files but its weights; returns the bytes copied."""
    target.mkdir(parents=True, exist_ok=True)
    size = 0
    for f in sorted(source.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHTS):
            shutil.copy(f, target / f.name)
            size += f.stat().st_size
    return size


def _qwen_source(qwen_from: str | None, scratch: Path) -> Path | None:
    """A folder with Qwen2.5-Coder-1.5B's config.json and tokenizer: ``--qwen-from``, the cached export, or (parts
    installed, not exported) the config and tokenizer transformers reads from the joined GGUF — the same files the
    export would hold, without de-quantising 1.5 B weights. None when the model is not installed."""
    from fedspear.runtime.model_zoo import ModelError, cache_root, join_split_gguf

    if qwen_from:
        return Path(qwen_from)
    cached = sorted(cache_root().glob(f"models/{QWEN}-*/config.json"), key=lambda f: f.stat().st_mtime)
    if cached:
        return cached[-1].parent  # the newest export (a folder's name ends in a hash, not a date)
    try:
        gguf = join_split_gguf(QWEN)
    except ModelError as err:
        _say(f"Qwen2.5-Coder-1.5B: {err}")
        return None
    from transformers import AutoConfig, AutoTokenizer

    out = scratch / QWEN
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def _closure(root: str) -> dict[str, str]:
    """``root`` and everything it requires (extras named in a requirement followed, ``extra ==`` lines of its own
    not), as installed in this Python: name → version; names in ``PRESENT`` left out."""
    from importlib import metadata

    from packaging.requirements import Requirement

    out: dict[str, str] = {}
    todo = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        key = name.lower().replace("_", "-")
        if key in PRESENT or (key in out and not extras):
            continue
        dist = metadata.distribution(name)
        out[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython"}
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return out


def prepare(args) -> int:
    """Fill the bundle (see the module docstring); prints what went in and its size."""
    bundle = Path(args.bundle).resolve()
    scratch = bundle / ".scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    from fedspear.runtime.model_zoo import resolve_model_dir

    sources = {SMOLLM2: Path(resolve_model_dir(SMOLLM2)), QWEN: _qwen_source(args.qwen_from, scratch)}
    for name, source in sources.items():
        target = bundle / "exports" / name
        if source is not None and source.resolve() == target:
            _say(f"exports/{name}: kept as it is (--qwen-from names it)")
            continue
        shutil.rmtree(target, ignore_errors=True)
        if source is None:
            _say(f"exports/{name}: not made — the GPU check will skip the Qwen-shaped steps "
                 f"(install it here: fedspear models install {QWEN}, then prepare again)")
            continue
        size = _export_files(source, target)
        _say(f"exports/{name}: config and tokenizer from {source}, {size / 2**20:.1f} MiB")
    shutil.rmtree(scratch, ignore_errors=True)

    wheels = bundle / "wheels"
    if args.no_wheels:
        shutil.rmtree(wheels, ignore_errors=True)
        _say("wheels: none (--no-wheels): the GPU check will skip the Flower run")
    else:
        try:
            wanted = _closure("flwr")
        except Exception as err:  # noqa: BLE001 - no Flower here: say so, carry none
            wanted = {}
            _say(f"wheels: none — Flower is not installed in this Python ({err})")
        wheels.mkdir(exist_ok=True)
        have = {p.name.split("-")[0].lower().replace("_", "-"): p for p in wheels.glob("*.whl")}
        for p in wheels.glob("*.whl"):  # a version this Python does not have any more
            name, version = p.name.split("-")[:2]
            if wanted.get(name.lower().replace("_", "-")) != version:
                p.unlink()
                have.pop(name.lower().replace("_", "-"), None)
        missing = [f"{k}=={v}" for k, v in sorted(wanted.items()) if k not in have]
        for spec in missing:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels), spec]
            for platform in PLATFORMS:
                cmd += ["--platform", platform]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                _say(f"wheels: could not download {spec} for CPython 3.12 ({proc.stderr.strip()[-300:]})")
        got = sorted(wheels.glob("*.whl"))
        _say(f"wheels: {len(got)} ({sum(p.stat().st_size for p in got) / 2**20:.1f} MiB) — flwr and its "
             f"dependencies but {', '.join(sorted(PRESENT))}")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", "src",
                            "scripts"],
                           capture_output=True, text=True)
    (bundle / "COMMIT").write_text((commit.stdout.strip() or "unknown") + ("+changes" if dirty.stdout.strip() else "")
                                   + "\n")
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    tree = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True).stdout.split(b"\0")
    tracked = sum((REPO / os.fsdecode(f)).stat().st_size for f in tree if f and (REPO / os.fsdecode(f)).is_file())
    _say(f"bundle {bundle}: {total / 2**20:.1f} MiB; with the working tree ({tracked / 2**20:.1f} MiB) "
         f"{(total + tracked) / 2**20:.1f} MiB of the 64 MiB a device run carries")
    return 0 if (total + tracked) <= 64 * 2**20 else 1


def random_model(args) -> int:
    """A model of ``--from``'s config.json with random weights (seed 0), saved with that folder's tokenizer files.

    ``--tiny`` keeps the vocabulary and the architecture's kind but shrinks it to 2 layers of width 64 (the CPU
    dry run: the same code path in seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(args.source)
    if args.tiny:
        config.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:2]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(args.out)
    model.save_pretrained(out)
    for f in Path(args.source).iterdir():
        if f.is_file() and f.name not in ("config.json", "generation_config.json") and not f.name.endswith(WEIGHTS):
            shutil.copy(f, out / f.name)
    params = sum(p.numel() for p in model.parameters())
    _say(f"random model of {args.source}'s shape{' (tiny)' if args.tiny else ''}: {params / 1e9:.3f} B parameters, "
         f"{config.num_hidden_layers} layers, built and saved in {time.perf_counter() - start:.1f} s")
    return 0


class Alternate:
    """Every other answer is judged right, so a random-weight model still has wins to train on."""

    def __init__(self):
        self.n = 0

    def is_correct(self, example, completion):
        self.n += 1
        return self.n % 2 == 0

    def feedback(self, example, completion):
        return "Incorrect. Hint: think again about the key fact."


def client_round(args) -> int:
    """``--rounds`` SPEAR client-rounds at ``--preset paper`` (one client's share of the preset's partition) →
    ``--out`` JSON: per round its seconds, peak GPU memory and the round's metrics. ``--set`` keys go on top of the
    preset; an unknown key exits 3 with a line saying so (the step is then skipped, not failed)."""
    import torch

    from fedspear.config import ConfigError, load_config, parse_assignments
    from fedspear.runtime.model import get_adapter
    from fedspear.worker import Worker

    overrides = parse_assignments(args.set)
    if args.small:  # the CPU dry run: the same path, a few tokens
        overrides = {"max_new_tokens": 8, "local_steps": 1, "batch_size": 4, **overrides}
    try:
        cfg = load_config(preset="paper", task=args.task, model=args.model, device="auto", dtype="auto",
                          **overrides)
    except ConfigError as err:
        _say(f"skipped: {err}")
        return 3
    start = time.perf_counter()
    worker = Worker.load(cfg)
    load_s = time.perf_counter() - start
    items = 4 if args.small else len(worker.examples) // cfg.num_clients  # one client's share at the preset's size
    prompts = list(range(args.client * items, (args.client + 1) * items))  # client i: the i-th share
    _say(f"{args.task} at --preset paper {overrides or ''}: {items} prompts, N = {cfg.max_revisions}, "
         f"{cfg.max_new_tokens} new tokens, {cfg.local_steps} steps × {cfg.batch_size}; model loaded in {load_s:.1f} s "
         f"({worker.dtype_used})")
    gpu = torch.cuda.is_available() and str(cfg.device) != "cpu"
    arrays, rounds = get_adapter(worker.model), []
    last_training = _keep_last_training()  # the rounds' last local_train call, profiled after them

    def write(decode: dict | None) -> None:  # after every round: a step stopped by its time limit keeps its rounds
        tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")  # then renamed: a kill never leaves half a file
        tmp.write_text(json.dumps({
            "task": args.task, "preset": "paper", "overrides": overrides, "prompts": items, "client": args.client,
            "load_seconds": load_s,
            "dtype": worker.dtype_used, "device": torch.cuda.get_device_name() if gpu else "cpu", "rounds": rounds,
            "decode": decode,
            "config": {k: str(getattr(cfg, k)) for k in cfg.__dataclass_fields__}}, indent=1) + "\n")
        os.replace(tmp, args.out)

    for r in range(1, args.rounds + 1):
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if args.barrier:
            wait_for_parties(Path(args.barrier), r, args.client, args.parties)
        started, t = time.time(), time.perf_counter()
        arrays, metrics = worker.round(worker.loaded, arrays, prompts, 0, r, cfg.lr,
                                       feedback_source=Alternate())
        if gpu:
            torch.cuda.synchronize()
        row = {"round": r, "seconds": time.perf_counter() - t, "started": started, "ended": time.time(),
               "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
               **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        rounds.append(row)
        _say(f"round {r}: {row['seconds']:.1f} s (generation {row.get('seconds_generate_initial', 0):.1f} + "
             f"{row.get('seconds_generate_revisions', 0):.1f} s, training {row.get('seconds_train', 0):.1f} s), "
             f"{row.get('tokens_generated', 0):.0f} tokens generated"
             + (f", peak GPU memory {row['peak_gpu_gib']:.1f} GiB" if gpu else ""))
        write(None)
    decode = None
    if not args.no_decode:
        decode = decode_step(worker, args.decode_batch, 8 if args.small else 200, 8 if args.small else 64)
        write(decode)
    if args.eval_items:
        try:  # a diagnostic after the rounds: never fails the step
            decode = {**(decode or {}), "evaluation": evaluation_batches(worker, cfg, args.eval_items)}
            write(decode)
        except Exception as err:  # noqa: BLE001 - say why and go on
            _say(f"evaluation not timed: {type(err).__name__}: {err}")
    if last_training and not args.barrier:  # not in the processes of a side-by-side round
        try:  # a diagnostic after the rounds: never fails the step
            decode = {**(decode or {}), "training_profile": profile_training(*last_training)}
            write(decode)
        except Exception as err:  # noqa: BLE001 - say why and go on
            _say(f"training profile not taken: {type(err).__name__}: {err}")
    return 0


def _keep_last_training() -> list:
    """Make SPEAR's client-round keep the arguments of its ``local_train`` call (the latest round's win and lose
    sets) in the returned list, as ``[args, kwargs]``; the call itself is unchanged."""
    from fedspear.algorithms import spear

    kept: list = []
    train = spear.local_train

    def keeping(*args, **kwargs):
        kept[:] = [args, kwargs]
        return train(*args, **kwargs)

    spear.local_train = keeping
    return kept


def profile_training(args: tuple, kwargs: dict) -> dict:
    """The rounds' last ``local_train`` (their local steps and the margin pass, Eq. 8) run again on the same win and
    lose sets, after the rounds (it trains the adapter further; nothing is timed after it): once under
    ``torch.profiler`` — its wall time, the margin pass's share of it, the GPU's kernel time and count, the ten
    kernels and the ten host operations with the most time — then, on a GPU, once with torch's CUDA sync debug mode
    warning at each wait for the GPU (how many, and the lines of Python that caused the most). Kernel time far below
    the wall time means training waits on the host. → ``{"wall_s", "margin_s", "steps", "kernel_s", "kernels",
    "top_kernels": [[name, ms]], "top_host_ops": [[name, ms]], "syncs", "syncs_where": [[file:line, count]]}``."""

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fedspear import training

    model = args[0]
    gpu = torch.cuda.is_available() and next(model.parameters()).is_cuda
    margin = training.pair_margin
    margin_s: list[float] = []

    def timed_margin(*a, **k):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return margin(*a, **k)
        finally:
            if gpu:
                torch.cuda.synchronize()
            margin_s.append(time.perf_counter() - start)

    training.pair_margin = timed_margin
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            start = time.perf_counter()
            stats = training.local_train(*args, **kwargs)
            if gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        training.pair_margin = margin
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total,
                  reverse=True)[:10]
    out = {"wall_s": wall, "margin_s": sum(margin_s), "steps": stats.get("steps"),
           "kernel_s": sum(map(device_us, kernels)) / 1e6, "kernels": sum(e.count for e in kernels),
           "top_kernels": [[e.key[:120], device_us(e) / 1e3] for e in sorted(kernels, key=device_us,
                                                                               reverse=True)[:10]],
           "top_host_ops": [[e.key[:120], e.self_cpu_time_total / 1e3] for e in host]}
    if gpu:
        syncs = synchronisations(lambda: training.local_train(*args, **kwargs))
        out["syncs"], out["syncs_where"] = len(syncs), sync_sites(syncs)
    _say(f"training profiled ({out['steps']} steps): {wall:.2f} s of wall time (the margin pass {out['margin_s']:.2f} "
         f"s), {out['kernel_s']:.2f} s of it in {out['kernels']} GPU kernels"
         + (f"; {out['syncs']} host synchronisations" if "syncs" in out else ""))
    return out


def evaluation_batches(worker, cfg, items: int) -> list[dict]:
    """The server's evaluation on ``worker``'s model (the rounds' process: the compiled decode warm) — greedy answers
    to the first ``items`` held-out items of ``eval_items``' order under the run's token budget, once with
    ``eval_batch_size = 32`` (the default before ``"auto"``) and once with ``"auto"`` (on a GPU sized by its memory,
    ``runtime.generation.eval_batch_rows``; the first call at a new batch also records its CUDA graph) → per call
    ``{"setting", "batch_size", "seconds", "tokens"}``. A random model's answers run to the budget: the worst case."""
    from fedspear.evaluation import eval_items, evaluate
    from fedspear.tasks import get_task, load_split

    task = get_task(cfg.task)
    examples = eval_items(load_split(cfg, task.EVAL_SPLIT)[0], items, 0)
    rows = []
    for setting in (32, "auto"):
        answers: list = []
        metrics = evaluate(worker.model, worker.tokenizer, examples, task, dtype_used=worker.dtype_used,
                           loglik=False, batch_size=setting, max_new_tokens=cfg.max_new_tokens, answers=answers)
        rows.append({"setting": setting, "batch_size": metrics["batch_size"], "seconds": metrics["seconds_evaluate"],
                     "tokens": sum(a["tokens"] for a in answers)})
        _say(f"evaluation of {len(examples)} {cfg.task} items, eval_batch_size = {setting}: batches of "
             f"{metrics['batch_size']}, {metrics['seconds_evaluate']:.1f} s, {rows[-1]['tokens']} tokens")
    return rows


def wait_for_parties(folder: Path, round_: int, client: int, parties: int, timeout: float = 900.0) -> None:
    """A barrier between processes: say that ``client`` is ready for round ``round_`` (a file in ``folder``) and
    wait until all ``parties`` are, so the processes' rounds start together.

    Raises:
        TimeoutError: not every party was ready within ``timeout`` seconds (one failed or is far behind).
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"round-{round_}-client-{client}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob(f"round-{round_}-client-*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {round_}: not all {parties} clients ready after {timeout:.0f} s")
        time.sleep(0.05)


def clients(args) -> int:
    """``--clients`` processes of ``round`` at once (``--client`` 0 … K − 1, a barrier before each round, no decode
    timing after) → ``--out`` JSON: per round that every client finished, the wall time from the first start to the
    last end, each client's seconds and peak GPU memory, and each process's own record (``per_client``).

    The processes are stopped (SIGTERM, then SIGKILL 10 s later) at ``--deadline`` seconds (default: ``$STEP_LIMIT``
    less 30 s, the step's own limit; none without it) or when this process is sent SIGTERM, so none is left on the
    GPU; the rounds all of them finished are kept. Exit 1 if a process failed (its log's tail is printed) or no round
    was finished by all, 3 if ``round`` skipped (an unknown ``--set`` key)."""
    import signal

    limit = args.deadline if args.deadline is not None else (
        float(os.environ["STEP_LIMIT"]) - 30 if os.environ.get("STEP_LIMIT") else None)
    deadline = None if limit is None else time.monotonic() + limit
    scratch = Path(args.out).with_suffix(".d")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    procs = []
    for i in range(args.clients):
        command = [sys.executable, __file__, "round", "--model", args.model, "--task", args.task, "--rounds",
                   str(args.rounds), "--client", str(i), "--barrier", str(scratch / "barrier"), "--parties",
                   str(args.clients), "--no-decode", "--out", str(scratch / f"client-{i}.json"),
                   *[f"--set={kv}" for kv in args.set], *(["--small"] if args.small else [])]
        log = open(scratch / f"client-{i}.log", "w")
        procs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))

    def stop(*_):
        for proc, _log in procs:
            if proc.poll() is None:
                proc.terminate()
        end = time.monotonic() + 10
        for proc, _log in procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(1)))
    timed_out = False
    try:
        while any(proc.poll() is None for proc, _ in procs):
            if deadline is not None and time.monotonic() > deadline:
                _say(f"stopping the clients: {limit:.0f} s are up")
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        stop()
        signal.signal(signal.SIGTERM, previous)
        for _proc, log in procs:
            log.close()
    codes = [proc.returncode for proc, _ in procs]

    def say_failures():
        for i, code in enumerate(codes):
            if code:
                tail = (scratch / f"client-{i}.log").read_text(errors="replace")[-1500:]
                _say(f"client {i} exited {code}:\n{tail}")

    if any(codes) and not timed_out:
        say_failures()
        return 3 if all(c == 3 for c in codes) else 1
    files = [scratch / f"client-{i}.json" for i in range(args.clients)]
    per_client = [json.loads(f.read_text()) if f.exists() else {"rounds": []} for f in files]
    finished = min(len(c["rounds"]) for c in per_client)
    if not finished:
        say_failures()
        _say(f"no round finished by all {args.clients} clients")
        return 1
    rounds = []
    for r in range(finished):
        rows = [c["rounds"][r] for c in per_client]
        wall = max(x["ended"] for x in rows) - min(x["started"] for x in rows)
        rounds.append({"round": rows[0]["round"], "wall_seconds": wall,
                       "client_seconds": [x["seconds"] for x in rows],
                       "peak_gpu_gib": [x.get("peak_gpu_gib") for x in rows],
                       "tokens_generated": sum(x.get("tokens_generated", 0) for x in rows)})
        _say(f"round {rounds[-1]['round']}: {args.clients} client-rounds side by side in {wall:.1f} s "
             f"({wall / args.clients:.1f} s per client-round; each took "
             f"{', '.join(f'{x:.1f}' for x in rounds[-1]['client_seconds'])} s)")
    if finished < args.rounds:
        _say(f"{finished} of {args.rounds} rounds finished by all {args.clients} clients before the deadline")
    Path(args.out).write_text(json.dumps({"clients": args.clients, "prompts": per_client[0]["prompts"],
                                          "stopped_at_deadline": timed_out,
                                          "overrides": per_client[0]["overrides"], "rounds": rounds,
                                          "per_client": per_client}, indent=1) + "\n")
    return 0


def decode_step(worker, batch: int, prompt: int, new: int) -> dict:
    """The round's own decode, timed step by step on ``worker``'s model after its rounds: greedy, ``batch`` rows of a
    ``prompt``-token random prompt, ``new`` tokens each (``bench.timed_decode``: the prefill excluded; two
    timed calls after a first, untimed one) — through the compiled step and its static cache where the worker
    compiles its decode (the bucket the round used at batch 32, so no new graph), else eagerly as the round decodes.
    A compiled decode is then timed in two alternating pairs of calls, with every dynamo guard checked on every
    step (``SKIP_WARM_GUARDS`` off: ``all_guards_ms_per_step``) and as rounds decode (``warm_guards_ms_per_step``),
    then in two more with the stop check read on every step (``DEFER_STOP_CHECK`` off:
    ``every_step_stop_check_ms_per_step``) and one step late, as rounds decode (``deferred_stop_check_ms_per_step``;
    greedy like every call here, so the sampler's cost is not in these: the ``sampling`` step times it).
    Then ``host_syncs`` counts a sampled call's waits for the GPU, and ``profile_decode`` profiles a step.
    → ``{"batch", "compiled", "ms_per_step", "runs_ms_per_step", "first_call_seconds", ["all_guards_ms_per_step",
    "warm_guards_ms_per_step", "every_step_stop_check_ms_per_step", "deferred_stop_check_ms_per_step"],
    "host_syncs", "profile"}``."""
    from fedspear.experiments.bench import timed_decode
    from fedspear.runtime.compiled import compiled_decode

    first, rates = timed_decode(worker.model, worker.tokenizer, worker.dtype_used, batch, prompt, new, repeats=2)
    runs = [1e3 * batch / r for r in rates]
    out = {"batch": batch, "compiled": compiled_decode(worker.model) is not None, "prompt": prompt, "new_tokens": new,
           "ms_per_step": statistics.median(runs), "runs_ms_per_step": runs, "first_call_seconds": first}
    _say(f"decode at batch {batch} ({'compiled' if out['compiled'] else 'eager'}): {out['ms_per_step']:.1f} ms per "
         f"step (runs {', '.join(f'{r:.1f}' for r in runs)}; first call {first:.1f} s)")
    if out["compiled"]:  # again, alternating: with and without each of the compiled decode's two host-time savings
        def alternating(flag: str) -> tuple[float, float]:
            """Median ms per step with ``runtime.compiled.<flag>`` off and on: two pairs of calls, alternating."""
            from fedspear.runtime import compiled

            keep, times = getattr(compiled, flag), {True: [], False: []}
            try:
                for _ in range(2):
                    for value in (False, True):
                        setattr(compiled, flag, value)
                        _, rates = timed_decode(worker.model, worker.tokenizer, worker.dtype_used, batch, prompt,
                                                new, repeats=1)
                        times[value] += [1e3 * batch / r for r in rates]
            finally:
                setattr(compiled, flag, keep)
            return statistics.median(times[False]), statistics.median(times[True])

        out["all_guards_ms_per_step"], out["warm_guards_ms_per_step"] = alternating("SKIP_WARM_GUARDS")
        _say(f"decode at batch {batch}, alternating: {out['warm_guards_ms_per_step']:.1f} ms per step with a warm "
             f"bucket's guards skipped, {out['all_guards_ms_per_step']:.1f} ms with every guard checked")
        # the stop check read on every step (transformers' default) or one step late (as rounds decode)
        out["every_step_stop_check_ms_per_step"], out["deferred_stop_check_ms_per_step"] = alternating(
            "DEFER_STOP_CHECK")
        _say(f"decode at batch {batch}, alternating: {out['deferred_stop_check_ms_per_step']:.1f} ms per step with "
             f"the stop check deferred, {out['every_step_stop_check_ms_per_step']:.1f} ms with it read every step")
    try:  # how often a sampled call, as rounds make them, waits for the GPU; never fails the step
        out["host_syncs"] = host_syncs(worker, batch, prompt, new)
    except Exception as err:  # noqa: BLE001 - a diagnostic: say why and go on
        _say(f"host synchronisations not counted: {type(err).__name__}: {err}")
    try:  # where a step's time goes; never fails the step
        out["profile"] = profile_decode(worker, batch, prompt, new)
    except Exception as err:  # noqa: BLE001 - a diagnostic: say why and go on
        _say(f"decode profile not taken: {type(err).__name__}: {err}")
    return out


def host_syncs(worker, batch: int, prompt: int, new: int) -> dict:
    """Sampled ``generate`` calls as a round makes them (``runtime.generation.generate``: ``batch`` random prompts
    of ``prompt`` tokens, temperature 0.8, top-p 0.95), ``new`` new tokens and, with prompts longer by ``new`` −
    ``new`` // 2 (the same static cache, so no new graph), ``new`` // 2, with torch's CUDA sync
    debug mode warning at every operation that makes the host wait for the GPU: how many in each call, how many per
    decode step (the difference of the two over the difference of their steps: what a call does once — uploading
    prompts, downloading answers — cancels; 0 means host and GPU no longer take turns at every step, 1 or more that
    they do: ``runtime.compiled``, "Stop checks"), and the lines of Python that caused them in the longer call (most
    first). A random model's sampled answer may end early at an EOS, which lowers the count. With the stop check
    deferred, its wait for the step before last (``DeferredStopCheck``: ``copy_done_before.synchronize()``) may be
    counted too, once per step, though the GPU then has the next step queued: ``where`` tells it apart.
    → ``{"syncs", "syncs_half", "per_step", "where": [[file:line, count], ...]}``; ``{}`` without a GPU."""

    import torch

    from fedspear.runtime.generation import generate

    if not (torch.cuda.is_available() and next(worker.model.parameters()).is_cuda):
        return {}
    contexts = torch.randint(100, 1000, (batch, prompt + new)).tolist()
    # the shorter call's prompt is longer by what it decodes less: both fill the same static cache (no new graph)
    calls = {new // 2: [c[: prompt + new - new // 2] for c in contexts], new: [c[:prompt] for c in contexts]}
    generate(worker.model, worker.tokenizer, calls[new], max_new_tokens=new, dtype_used=worker.dtype_used)  # warm
    torch.cuda.synchronize()

    def counted(tokens: int) -> list:
        return synchronisations(lambda: generate(worker.model, worker.tokenizer, calls[tokens], max_new_tokens=tokens,
                                                 dtype_used=worker.dtype_used))

    half, syncs = counted(new // 2), counted(new)
    out = {"syncs": len(syncs), "syncs_half": len(half), "per_step": (len(syncs) - len(half)) / (new - new // 2),
           "where": sync_sites(syncs)}
    _say(f"sampled calls at batch {batch}: {out['syncs_half']} host synchronisations with {new // 2} new tokens, "
         f"{out['syncs']} with {new}: {out['per_step']:.2f} per decode step; where: "
         + ", ".join(f"{k} ×{v}" for k, v in out["where"][:5]))
    return out


def synchronisations(call) -> list:
    """``call()`` under torch's CUDA sync debug mode → the warnings it raised, one per operation that made the host
    wait for the GPU."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [w for w in caught if "synchroniz" in str(w.message)]


def sync_sites(syncs: list) -> list[list]:
    """The lines of Python behind ``synchronisations``' warnings → ``[[file:line, count], ...]``, the ten with the
    most first."""
    where: dict[str, int] = {}
    for w in syncs:
        key = f"{Path(w.filename).name}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    return sorted(([k, v] for k, v in where.items()), key=lambda kv: -kv[1])[:10]


def profile_decode(worker, batch: int, prompt: int, new: int) -> dict:
    """One more such ``generate`` call under ``torch.profiler`` (CPU, and CUDA where there is a GPU): its wall time,
    the time the GPU spent in kernels and how many it ran, per new token (the call's one prefill included: ≈ 1/``new``
    of it), and the ten kernels that took longest. Kernel time far below the wall time means a step waits on the host
    (Python, launches, synchronisation), not on the GPU. → ``{"wall_ms_per_step", "kernel_ms_per_step",
    "kernels_per_step", "top_kernels": [[name, ms per step], ...], "top_host_ops": [[name, ms per step], ...]}``
    (host ops: the ten operations with the most CPU time of their own, e.g. the CUDA-graph replay, sampling, the
    generate loop's own tensor work; where a step waits on the host, these say on what)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fedspear.experiments.bench import timed_decode

    gpu = torch.cuda.is_available() and next(worker.model.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        timed_decode(worker.model, worker.tokenizer, worker.dtype_used, batch, prompt, new, repeats=0)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    top = sorted(kernels, key=device_us, reverse=True)[:10]
    host = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                  key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    out = {"wall_ms_per_step": 1e3 * wall / new, "kernel_ms_per_step": sum(map(device_us, kernels)) / 1e3 / new,
           "kernels_per_step": sum(e.count for e in kernels) / new,
           "top_kernels": [[e.key[:120], device_us(e) / 1e3 / new] for e in top],
           "top_host_ops": [[e.key[:120], e.self_cpu_time_total / 1e3 / new] for e in host]}
    _say(f"decode profile at batch {batch}: {out['wall_ms_per_step']:.1f} ms per step of wall time (profiled), "
         f"{out['kernel_ms_per_step']:.2f} ms of GPU kernels in {out['kernels_per_step']:.0f} kernels per step")
    return out


def flwr_install(args) -> int:
    """Make ``import flwr`` and its command-line tools work in this Python: nothing when it already imports; else the
    bundle's wheels through pip with no index (flwr itself without its requirement on ``uv``, then every other
    requirement of it, pip keeping what is installed and satisfies them). Exit 0 ready, 3 with a line saying why not.
    """
    import importlib.util

    if importlib.util.find_spec("flwr") is not None:
        _say("flwr: already installed")
        return 0
    wheels = Path(args.wheels)
    flwr = sorted(wheels.glob("flwr-*.whl"))
    if not flwr:
        _say(f"skipped: flwr is not installed and {wheels} holds no flwr wheel (run scripts/gpu_check.sh --prepare)")
        return 3
    import zipfile

    with zipfile.ZipFile(flwr[-1]) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:") and "extra ==" not in line]
    requires = [r for r in requires if not re.match(r"uv\b", r)]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--find-links", str(wheels)]
    for cmd in (pip + ["--no-deps", str(flwr[-1])], pip + requires):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            _say(f"skipped: installing Flower from the carried wheels failed: {proc.stderr.strip()[-600:]}")
            return 3
    _say(f"flwr: installed from {len(list(wheels.glob('*.whl')))} carried wheels (pip kept what was there)")
    return 0


def targets(out: dict) -> list[tuple[str, str, str, bool]]:
    """Issue 40's targets against the gathered figures → ``(target, baseline, measured, met)`` rows, each only where
    its figure was measured: decode at batch 32 ≤ 12 ms per step (from the bench), the warm client-round (the last
    round; the compiled one where it ran) ≤ 12 s, LoRA training ≥ 25% (the bench's, and the compiled forward's where
    train-compiled ran) and prefill ≥ 40% of the bf16 matmul bound."""
    rows = []
    bench = out.get("bench", {}).get("throughput", {})
    for name in ("round-compiled", "round-eager"):  # the decode a round uses, timed after it
        d = out.get(name, {}).get("decode") or {}
        if d.get("batch") == 32:
            ms = d["ms_per_step"]
            rows.append((f"decode at batch 32 ≤ 12 ms per step ({'compiled' if d['compiled'] else 'eager'})",
                         "55.7 ms", f"{ms:.1f} ms", ms <= 12))
    d32 = bench.get("decode", {}).get("batch_32")
    if d32:
        ms = 1e3 * 32 / d32["tokens_per_s"]
        rows.append(("decode at batch 32 ≤ 12 ms per step (bench: transformers' eager generate)", "55.7 ms",
                     f"{ms:.1f} ms", ms <= 12))
    for name in ("round-compiled", "round-eager"):
        rounds = out.get(name, {}).get("rounds", [])
        if len(rounds) > 1:
            warm = rounds[-1]["seconds"]
            rows.append((f"paper-preset StrategyQA client-round ≤ 12 s warm ({name})", "55.3 s", f"{warm:.1f} s",
                         warm <= 12))
            break
    for key, target, base in (("train", 0.25, "4%"), ("prefill", 0.40, "14%")):
        if key in bench:
            u = bench[key]["utilisation"]
            rows.append((f"{'LoRA training' if key == 'train' else 'prefill'} ≥ {target:.0%} of the bf16 matmul bound",
                         base, f"{u:.0%}", u >= target))
    compiled = out.get("train-compiled", {}).get("utilisation", {}).get("compiled")
    if compiled is not None:
        rows.append(("LoRA training ≥ 25% of the bf16 matmul bound (compile_training = on)", "4%", f"{compiled:.0%}",
                     compiled >= 0.25))
    return rows


def summary(args) -> int:
    """``--out``.json and .md: every step's result file under ``--dir`` gathered (bench, rounds, Flower run, the
    sampled token's cost, the LoRA input casts' A/B, the compiled training forward's A/B)."""
    folder = Path(args.dir)
    out: dict = {"kind": args.kind, "commit": args.commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "steps": json.loads(Path(args.steps).read_text()) if args.steps and Path(args.steps).exists() else {}}
    for name in ("bench", "round-eager", "round-compiled", "clients", "flwr-run", "sampling", "casts",
                 "train-compiled"):
        path = folder / f"{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    out["dry_run"] = args.dry_run
    lines = [f"# scripts/gpu_check.sh{' --dry-run' if args.dry_run else ''} — {args.kind}, {out['date']}", "",
             *(["A dry run: every step's path at toy sizes on a CPU; its figures measure nothing.", ""]
               if args.dry_run else []),
             f"fedspear {args.commit}; steps (status, seconds):", "", "| step | status | seconds |", "|---|---|---|",
             *[f"| {k} | {v['status']} | {v['seconds']} |" for k, v in out["steps"].items()], ""]
    for name in ("round-eager", "round-compiled"):
        rounds = out.get(name, {}).get("rounds", [])
        if rounds:
            lines.append(f"{name}: {out[name]['prompts']} prompts, " + "; ".join(
                f"round {r['round']} {r['seconds']:.1f} s (generation "
                f"{r.get('seconds_generate_initial', 0) + r.get('seconds_generate_revisions', 0):.1f} s, training "
                f"{r.get('seconds_train', 0):.1f} s, {r.get('tokens_generated', 0):.0f} tokens"
                + (f", peak {r['peak_gpu_gib']:.1f} GiB" if r.get("peak_gpu_gib") else "") + ")" for r in rounds))
            d = out[name].get("decode")
            if d and "ms_per_step" in d:
                how = "compiled" if d["compiled"] else "eager"
                lines.append(f"{name} decode afterwards at batch {d['batch']}: {d['ms_per_step']:.1f} ms per step "
                             f"({how}; first call {d['first_call_seconds']:.1f} s)"
                             + (f"; alternating, {d['warm_guards_ms_per_step']:.1f} ms with a warm bucket's guards "
                                f"skipped, {d['all_guards_ms_per_step']:.1f} ms with every guard checked"
                                if d.get("all_guards_ms_per_step") else "")
                             + (f"; alternating, {d['deferred_stop_check_ms_per_step']:.1f} ms with the stop check "
                                f"deferred, {d['every_step_stop_check_ms_per_step']:.1f} ms with it read every step"
                                if d.get("deferred_stop_check_ms_per_step") else ""))
                syncs = d.get("host_syncs")
                if syncs:
                    lines.append(f"{name} sampled calls: {syncs['syncs_half']} and {syncs['syncs']} host "
                                 f"synchronisations, {syncs['per_step']:.2f} per decode step (" + ", ".join(
                                     f"{k} ×{v}" for k, v in syncs["where"][:5]) + ")")
            for e in (d or {}).get("evaluation", []):
                lines.append(f"{name} evaluation, eval_batch_size = {e['setting']}: batches of {e['batch_size']}, "
                             f"{e['seconds']:.1f} s for {e['tokens']} tokens")
            train = (d or {}).get("training_profile")
            if train:
                lines.append(f"{name} training profiled ({train['steps']} steps, run again after the rounds): "
                             f"{train['wall_s']:.2f} s of wall time, the margin pass {train['margin_s']:.2f} s of it; "
                             f"{train['kernel_s']:.2f} s in {train['kernels']} GPU kernels"
                             + (f"; {train['syncs']} host synchronisations (" + ", ".join(
                                 f"{k} ×{v}" for k, v in train["syncs_where"][:5]) + ")" if "syncs" in train else ""))
                lines.append(f"{name} training's host time, most first: " + ", ".join(
                    f"{op} {ms:.0f} ms" for op, ms in train["top_host_ops"][:5]))
            prof = (d or {}).get("profile")
            if prof:
                lines.append(f"{name} decode profiled: {prof['wall_ms_per_step']:.1f} ms of wall time per step, "
                             f"{prof['kernel_ms_per_step']:.2f} ms of it in {prof['kernels_per_step']:.0f} GPU kernels")
                if prof.get("top_host_ops"):
                    lines.append(f"{name} decode's host time per step, most first: " + ", ".join(
                        f"{op} {ms:.2f} ms" for op, ms in prof["top_host_ops"][:5]))
            lines.append("")
    side = out.get("clients")
    if side:
        alone = out.get("round-compiled", {}).get("rounds", [])
        lines += [f"clients: {side['clients']} client-rounds side by side on the GPU (one process each, "
                  f"{side['prompts']} prompts each, {side['overrides'] or 'no overrides'}): " + "; ".join(
                      f"round {r['round']} {r['wall_seconds']:.1f} s in all, "
                      f"{r['wall_seconds'] / side['clients']:.1f} s per client-round" for r in side["rounds"])
                  + (f" (one client alone, warm: {alone[-1]['seconds']:.1f} s)" if len(alone) > 1 else ""), ""]
    bench = out.get("bench", {}).get("throughput", {})
    if bench:
        decode = bench.get("decode", {})
        lines.append("bench: " + ", ".join(
            [f"prefill {bench['prefill']['utilisation']:.0%} of matmul", f"training {bench['train']['utilisation']:.0%}"
             " of matmul"] + [f"decode {k.replace('_', ' ')} {1e3 * int(k.split('_')[1]) / v['tokens_per_s']:.1f} "
                              f"ms/step ({v['utilisation']:.0%} of bandwidth)" for k, v in decode.items()]))
    sampling = out.get("sampling", {}).get("rows", [])
    if sampling:
        lines += ["", "sampled token, ms per decode step (transformers' warpers → fedspear's sampler): " + ", ".join(
            f"batch {r['batch']} × {r['vocab']:,} {r['transformers_ms']:.2f} → {r['fedspear_ms']:.2f}"
            for r in sampling)]
    casts = out.get("casts", {}).get("tokens_per_s", {})
    if len(casts) == 2:
        (cast, with_cast), (_, without) = casts.items()
        lines += ["", f"LoRA inputs at batch {out['casts']['batch']} × {out['casts']['length']}, tokens/s ({cast} → "
                  f"none, medians of {out['casts']['repeats']} alternating pairs): " + ", ".join(
                      f"{what} {with_cast[what]:.0f} → {without[what]:.0f} ({without[what] / with_cast[what]:.2f}×)"
                      for what in ("prefill", "train"))
                  + f"; same prefill logits: {'yes' if out['casts']['same_prefill_logits'] else 'no'}"]
    trained = out.get("train-compiled")
    if trained and len(trained.get("tokens_per_s", {})) == 2:
        rate, share = trained["tokens_per_s"], trained["utilisation"]
        lines += ["", f"training forward compiled (compile_training = on), {trained['batch']} × {trained['length']} "
                  f"(window {trained['window']}), tokens/s (eager → compiled, medians of alternating pairs): "
                  f"{rate['eager']:.0f} → {rate['compiled']:.0f} ({rate['compiled'] / rate['eager']:.2f}×; "
                  f"{share['eager']:.0%} → {share['compiled']:.0%} of the matmul bound); first micro-step "
                  f"{trained['compile_s']['first']:.1f} s, a second shape's {trained['compile_s']['second shape']:.1f} "
                  f"s; {trained['graphs']} graph(s) for both shapes"
                  + (f", {trained['graphs_after']} in all; LoRA gradients (dropout off) "
                     f"{trained['gradients']['norm_relative_difference']:.1e} from eager ones by norm, at most "
                     f"{trained['gradients']['max_relative_difference']:.1e} of a tensor's largest entry"
                     if "gradients" in trained else "")]
    rows = [] if args.dry_run else targets(out)
    if rows:
        lines += ["", "Targets (issue 40; baseline: one H100, fedspear ea2bbe6, 2026-11-27):", "",
                  "| target | baseline | measured | met |", "|---|---|---|---|",
                  *[f"| {t} | {b} | {m} | {'yes' if ok else '**no**'} |" for t, b, m, ok in rows]]
    out["targets"] = [{"target": t, "baseline": b, "measured": m, "met": ok} for t, b, m, ok in rows]
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    _say("\n".join(lines))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--bundle", default=str(REPO / ".gpu-bundle"))
    p.add_argument("--qwen-from", help="a folder with Qwen2.5-Coder-1.5B's config.json and tokenizer files")
    p.add_argument("--no-wheels", action="store_true")
    p = sub.add_parser("random-model")
    p.add_argument("--from", dest="source", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    rounds = argparse.ArgumentParser(add_help=False)  # what round and clients share
    rounds.add_argument("--model", required=True)
    rounds.add_argument("--task", default="strategy_qa")
    rounds.add_argument("--rounds", type=int, default=2)
    rounds.add_argument("--out", required=True)
    rounds.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    rounds.add_argument("--small", action="store_true")
    p = sub.add_parser("round", parents=[rounds])
    p.add_argument("--decode-batch", type=int, default=32, help="rows of the decode timed after the rounds")
    p.add_argument("--no-decode", action="store_true", help="no decode timing after the rounds")
    p.add_argument("--eval-items", type=int, default=0,
                   help="then time an evaluation of this many held-out items at batch 32 and at eval_batch_size=auto")
    p.add_argument("--client", type=int, default=0, help="which share of the prompts (0: the first)")
    p.add_argument("--barrier", help="a folder: start each round together with --parties processes")
    p.add_argument("--parties", type=int, default=1)
    p = sub.add_parser("clients", parents=[rounds])
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--deadline", type=float, help="seconds; default $STEP_LIMIT - 30 where set")
    p = sub.add_parser("flwr-install")
    p.add_argument("--wheels", required=True)
    p = sub.add_parser("summary")
    p.add_argument("--dir", required=True)
    p.add_argument("--kind", required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--steps")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="figures of a toy-sized CPU run: no targets judged")
    args = parser.parse_args()
    return {"prepare": prepare, "random-model": random_model, "round": client_round, "clients": clients,
            "flwr-install": flwr_install, "summary": summary}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
