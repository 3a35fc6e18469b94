#!/usr/bin/env bash
# fedspear on a bare GPU machine, in one command: does the CUDA path work, and what does a paper-scale client-round
# cost there? Issue 40 item 4. Three modes:
#
#   scripts/gpu_check.sh --prepare   on the CPU machine, first: fills .gpu-bundle/ (git-ignored) with what the GPU
#                                    machine lacks — SmolLM2's and Qwen2.5-Coder-1.5B's config + tokenizer files (no
#                                    weights; FEDSPEAR_EXPORTS points fedspear at them), Flower's wheel and its
#                                    dependencies' for CPython 3.12 (no uv), the commit — and prints its size
#   scripts/gpu_check.sh             on the GPU machine (its python3 with torch, transformers, peft, pytest, numpy,
#                                    typer, rich; no network): the steps below, in order of value, within $BUDGET s
#   scripts/gpu_check.sh --dry-run   on a CPU: every step end to end at toy sizes (the Qwen-shaped model shrunk to
#                                    2 layers, 8 new tokens), GPU-only parts skipped; results under .gpu-bundle/dry-run
#
# Steps, in order of value (each prints "=== <time> <step>", ends with "--- <step>: ok | failed | skipped: why" and
# is bounded):
#   1. env          GPU, driver, torch / transformers / peft versions, bf16
#   2. setup        fedspear from src/ (PYTHONPATH), exports from the bundle, a `fedspear` command beside python3
#                   (the tests call it there) when there is none
#   3. model        a random-weight model of Qwen2.5-Coder-1.5B's shape (the export's config.json, from_config)
#   4. round-compiled  two SPEAR client-rounds at `--preset paper --task strategy_qa` (32 prompts, N = 2, 256 tokens,
#                   5 steps × 16) with compile_decode = on (round 1 includes compiling, round 2 is warm), then their
#                   decode step timed at batch 32 (again with every dynamo guard checked on every step) and
#                   profiled (kernel time against wall time per step; torch's graph-break, recompile and CUDA-graph
#                   hints in the log), then an evaluation of EVAL_ITEMS (default 128; 0: none) held-out items at
#                   eval_batch_size 32 and "auto" (≈ 20 s on a GPU), then the last round's local training run again
#                   under torch.profiler (wall, margin-pass and GPU-kernel time, host synchronisations); skipped
#                   where fedspear has no such key
#   5. clients      a 5-client round: the same two rounds in 5 processes at once on the one GPU, each its own model
#                   and share of the prompts, each round started together (what Flower's simulation does with
#                   client_gpus = 0.2, without Ray, which cannot be carried); compile_decode = on, inductor's cache
#                   warm from round-compiled. CLIENTS=n for another count
#   6. bench        `fedspear bench --device cuda --no-round` on it (no Flower needed without the round)
#      sampling     ms per decode step to draw the sampled token, transformers' warpers against fedspear's sampler
#                   (scripts/sampling_cost.py, batch 8 and 32, SmolLM2's and Qwen2.5's vocabularies), in the log
#      logprobs     a training micro-step's completion log-probabilities (32 × 256 positions of Qwen2.5's vocabulary):
#                   seconds, bytes kept for the backward and peak memory, fedspear's own backward against autograd's
#                   (scripts/token_logprobs_ab.py), in the log
#      casts        prefill and LoRA training tokens/s at the bench's 32 × 220 with peft's cast of each LoRA input to
#                   fp32 and without it (fedspear's way over bf16 weights), alternating (scripts/lora_casts_ab.py)
#      train-compiled  a LoRA training micro-step (the runs' path: pack, completion_logprobs, backward) at the
#                   bench's 32 × 220 with compile_training = on and off: the compilation's seconds, a second shape's
#                   first step (no new graph expected), warm tokens/s both ways, alternating, as shares of the matmul
#                   bound, and the gradients' difference (scripts/compiled_training_ab.py); it compiles two graphs
#                   of the whole model (dropout on, and off for the gradients): give it a call of its own or little
#                   company, e.g. ONLY="model train-compiled casts"
#   7. tests        the `gpu`-marked tests and tests/test_device.py
#   8. round-eager  the same rounds and decode timing with compile_decode = off (the same-machine baseline)
#   9. flwr-run     a real `fedspear` federation through Flower's deployment engine (examples/deploy-local: a TLS
#                   SuperLink, 2 SuperNodes, 1 round, tiny-random model on the GPU): Flower installed from the
#                   carried wheels when missing; skipped, saying why, when they cannot be installed
#  10. summary      <kind>-gpu-check.json / .md (kind = the GPU's name, e.g. cuda-nvidia-h100-80gb-hbm3) and .log,
#                   and the bench's <kind>-<model>-bf16.json / .md, written to docs/results/bench/ and copied to $OUT
#
# With the `run` tool of this workplace (a copy of the checkout; carried paths travel beside it, 64 MiB in all;
# results come back from $OUT). First, here: `scripts/gpu_check.sh --prepare` (prints the size), then:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu-bundle"], timeout_s=600)
# and copy the files it returns (files_at) into docs/results/bench/. The script stops starting steps once
# $BUDGET (default 540 s) is spent, so it ends inside the 600 s; a skipped step says so. ONLY="model bench flwr-run"
# runs just those steps (setup always; bench and the rounds need model), e.g. in a second call for what was skipped.
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=gpu
case "${1:-}" in
  "") ;;
  --prepare) MODE=prepare ;;  # [--qwen-from DIR] [--no-wheels]
  --dry-run) MODE=dry ;;
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
  *) echo "usage: scripts/gpu_check.sh [--prepare | --dry-run]  (got '$1')" >&2; exit 2 ;;
esac
BUNDLE=${GPU_BUNDLE:-$REPO/.gpu-bundle}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3); fi
export PY BUNDLE MODE
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1

if [ "$MODE" = prepare ]; then
  shift; exec "$PY" scripts/gpu_check.py prepare --bundle "$BUNDLE" "$@"   # e.g. --qwen-from DIR
fi

START=$(date +%s)
BUDGET=${BUDGET:-$([ "$MODE" = dry ] && echo 1800 || echo 540)}  # seconds; a CPU is slower
S=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")     # scratch: the random model, caches, run folders
RES=$S/results; mkdir -p "$RES"
trap 'rm -rf "$S"' EXIT   # the random model (7 GB on a GPU machine), caches, run folders; results are copied out
LOG=$RES/gpu-check.log
export FEDSPEAR_CACHE=$S/cache FEDSPEAR_EXPORTS=$BUNDLE/exports S RES
exec > >(tee "$LOG") 2>&1
STEPS=$RES/steps.json; echo "{}" > "$STEPS"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { if [ "$MODE" = dry ]; then echo $(( $1 * 2 )); else echo "$1"; fi; }  # a CPU at toy sizes is slower still
# step NAME CAP COMMAND...: run COMMAND bounded by min(CAP, what is left of the budget); record its status
step() {
  local name=$1 cap=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " setup $ONLY " != *" $name "* ]]; then skip "$name" "not asked for (ONLY=$ONLY)"; return 1; fi
  local limit; limit=$(left); [ "$cap" -lt "$limit" ] && limit=$cap
  echo; echo "=== $(date +%T) $name (at most ${limit} s)"
  local t0 status rc; t0=$(date +%s)
  export STEP_LIMIT=$limit
  if [ "$limit" -lt 20 ]; then
    status="skipped: out of the ${BUDGET} s budget"
  else
    timeout --kill-after=10 "$limit" "$@"; rc=$?
    case $rc in
      0) status=ok ;;
      3) status="skipped (see above)" ;;
      124|137) status="failed: timed out after ${limit} s" ;;
      *) status="failed: exit code $rc" ;;
    esac
  fi
  echo "--- $name: $status"
  "$PY" - "$STEPS" "$name" "$status" $(( $(date +%s) - t0 )) <<'EOF'
import json, sys
path, name, status, seconds = sys.argv[1:]
steps = json.load(open(path)); steps[name] = {"status": status, "seconds": int(seconds)}
json.dump(steps, open(path, "w"))
EOF
  [ "$status" = ok ]
}
skip() { echo; echo "=== $(date +%T) $1"; echo "--- $1: skipped: $2"
  "$PY" -c "import json,sys; p=sys.argv[1]; s=json.load(open(p)); s[sys.argv[2]]={'status': 'skipped: '+sys.argv[3], 'seconds': 0}; json.dump(s, open(p,'w'))" "$STEPS" "$1" "$2"; }

# 1. env
echo "=== $(date +%T) env ($MODE mode, python $PY, scratch $S)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, peft; c = torch.cuda.is_available(); print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, '| cuda', c, torch.cuda.get_device_name() if c else '', '| bf16', torch.cuda.is_bf16_supported() if c else '-')"
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$MODE" = gpu ] && [ "$CUDA" != 1 ]; then
  echo "this machine has no CUDA GPU torch can see: run scripts/gpu_check.sh --dry-run on a CPU" >&2; exit 2
fi
KIND=$("$PY" -c "from fedspear.experiments.bench import machine; print(machine(gpu=$CUDA == 1)['kind'])")
# fedspear's commit: the checkout's own where it has its history (a dry run here), else the one the bundle was made
# from (a device machine gets the working tree without .git: prepare the bundle again after committing)
if COMMIT=$(git -C "$(dirname "$0")/.." rev-parse --short HEAD 2>/dev/null); then
  [ -n "$(git -C "$(dirname "$0")/.." status --porcelain --untracked-files=no -- src scripts)" ] && COMMIT="$COMMIT+changes"
  FROM="this checkout"
else
  COMMIT=$(cat "$BUNDLE/COMMIT" 2>/dev/null || echo unknown)
  FROM="the bundle's record: prepared from it"
fi
echo "machine kind $KIND; fedspear $COMMIT ($FROM; exports: $(ls "$BUNDLE/exports" 2>/dev/null | tr '\n' ' '))"
[ -d "$BUNDLE/exports/smollm2-135m" ] || { echo "no $BUNDLE/exports/smollm2-135m: run scripts/gpu_check.sh --prepare first (and carry .gpu-bundle)" >&2; exit 2; }

# 2. setup: the tests run `fedspear` from beside the interpreter (Path(sys.executable).with_name("fedspear"))
FEDSPEAR_CMD=$(dirname "$PY")/fedspear
if [ ! -x "$FEDSPEAR_CMD" ]; then
  if [ "$MODE" = gpu ]; then
    printf '#!%s\nfrom fedspear.cli import app\napp()\n' "$PY" > "$FEDSPEAR_CMD" && chmod +x "$FEDSPEAR_CMD"
    echo "wrote $FEDSPEAR_CMD (a throwaway machine; the tests call it there)"
  else
    echo "no $FEDSPEAR_CMD: the tests that call the command will fail (install fedspear into that Python)"
  fi
fi
step setup 120 "$PY" -c "from fedspear.runtime.model import load_base; m, t, d = load_base('tiny-random'); print('tiny-random on', next(m.parameters()).device, d, '| tokenizer', t.name_or_path)"

# 4. model: Qwen2.5-Coder-1.5B's shape, random weights (on the CPU: shrunk to 2 layers)
QWEN_EXPORT=$BUNDLE/exports/qwen2.5-coder-1.5b
MODEL=$S/qwen2.5-1.5b-shape-random
if [ -f "$QWEN_EXPORT/config.json" ]; then
  step model 120 "$PY" scripts/gpu_check.py random-model --from "$QWEN_EXPORT" --out "$MODEL" \
    $([ "$MODE" = dry ] && echo --tiny) || MODEL=""
else
  skip model "no Qwen export in the bundle (scripts/gpu_check.sh --prepare on a machine with qwen2.5-coder-1.5b)"
  MODEL=""
fi

# 5. the paper-preset client-rounds with compile_decode = on (the path a GPU takes by default), then the decode step
#    they use timed at batch 32
HAS_COMPILE=$("$PY" -c "from fedspear.config import RunConfig; print(int('compile_decode' in RunConfig.__dataclass_fields__))")
export HAS_COMPILE  # flwr_run reads it in its own shell
SMALL=$([ "$MODE" = dry ] && echo --small)
if [ -n "$MODEL" ] && [ "$HAS_COMPILE" = 1 ]; then
  TORCH_LOGS=${TORCH_LOGS:-graph_breaks,recompiles,perf_hints} \
    step round-compiled 350 "$PY" scripts/gpu_check.py round --model "$MODEL" --task strategy_qa --rounds 2 $SMALL \
    --set compile_decode=on --eval-items "${EVAL_ITEMS:-$([ "$MODE" = dry ] && echo 8 || echo 128)}" \
    --out "$RES/round-compiled.json" || true
elif [ -n "$MODEL" ]; then
  skip round-compiled "this fedspear has no compile_decode key (the compiled decode is not merged yet)"
else
  skip round-compiled "no model (step model)"
fi

# 5b. a 5-client round: the same rounds in CLIENTS processes at once on the GPU (on a CPU dry run: 2, eager decode)
if [ -n "$MODEL" ] && [ "$HAS_COMPILE" = 1 ]; then
  NCLIENTS=${CLIENTS:-$([ "$MODE" = dry ] && echo 2 || echo 5)}
  step clients 300 "$PY" scripts/gpu_check.py clients --model "$MODEL" --task strategy_qa --clients "$NCLIENTS" \
    --rounds 2 $SMALL --set compile_decode=$([ "$MODE" = dry ] && echo off || echo on) --out "$RES/clients.json" \
    || true
else
  skip clients "no model (step model) or no compile_decode key"
fi

# 6. bench on that model (no round: that needs Flower's simulation, i.e. Ray, which cannot be carried)
if [ -n "$MODEL" ]; then
  DEVICE=$([ "$MODE" = gpu ] && echo cuda || echo cpu)
  # --compile-decode off: the compiled decode is timed by round-compiled, whose process has compiled it already
  step bench 150 "$PY" -c "from fedspear.cli import app; app()" bench --model "$MODEL" --device "$DEVICE" --no-round \
    --compile-decode off \
    $([ "$MODE" = dry ] && echo --quick) --output "$RES/bench.json" --results-dir "$RES" || true
else
  skip bench "no model (step model)"
fi

# 6b. the sampled token's cost per decode step: transformers' warpers against fedspear's sampler (scripts/sampling_cost.py;
#     printed to the log)
step sampling 60 "$PY" scripts/sampling_cost.py --device "$([ "$MODE" = gpu ] && echo cuda || echo cpu)" \
  $([ "$MODE" = dry ] && echo "--batches 32 --vocab 151936 --repeats 3") --json "$RES/sampling.json" || true

# 6c. a training micro-step's completion log-probabilities at Qwen2.5-1.5B's paper-preset size: token_logprobs' own
#     backward against autograd through the same operations (scripts/token_logprobs_ab.py; printed to the log)
step logprobs 60 "$PY" scripts/token_logprobs_ab.py --device "$([ "$MODE" = gpu ] && echo cuda || echo cpu)" \
  $([ "$MODE" = dry ] && echo "--rows 2 --positions 16 --vocab 1000" || echo "--rows 32 --positions 256 --vocab 151936") || true

# 6d. prefill and training throughput with peft's cast of each LoRA input to fp32 and without it (fedspear's way over
#     bf16 weights: runtime.model.bf16_lora_inputs), alternating (scripts/lora_casts_ab.py; printed to the log)
if [ -n "$MODEL" ]; then
  step casts 90 "$PY" scripts/lora_casts_ab.py --model "$MODEL" --device "$([ "$MODE" = gpu ] && echo cuda || echo cpu)" \
    $([ "$MODE" = dry ] && echo "--batch 4 --length 32 --seconds 0.3 --repeats 2") --json "$RES/casts.json" || true
else
  skip casts "no model (step model)"
fi

# 6e. a training micro-step with the LoRA model's forward compiled and eager (compile_training; inductor; on a CPU
#     aot_eager, which compiles in seconds), alternating (scripts/compiled_training_ab.py; printed to the log)
if [ -n "$MODEL" ] && [ -f src/fedspear/runtime/compiled_training.py ]; then
  step train-compiled 300 "$PY" scripts/compiled_training_ab.py --model "$MODEL" \
    --device "$([ "$MODE" = gpu ] && echo cuda || echo cpu)" \
    $([ "$MODE" = dry ] && echo "--batch 4 --length 40 --window 8 --seconds 0.3 --repeats 2 --backend aot_eager") \
    --json "$RES/train-compiled.json" || true
elif [ -n "$MODEL" ]; then
  skip train-compiled "this fedspear has no compile_training (runtime/compiled_training.py)"
else
  skip train-compiled "no model (step model)"
fi

# 7. tests: tests/test_device.py whole, and the `gpu`-marked tests of the other files (skipped, with that reason,
#    where torch sees no GPU); only these files are collected: the others may import Flower, absent there
run_tests() {
  local rc=0 others
  local some=(); [ "$MODE" = dry ] && some=(-k "not client_round_creates or spear-0.5")  # a CPU: one algorithm
  "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfEs tests/test_device.py "${some[@]}" || rc=1
  others=$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v "tests/test_device.py")
  if [ -n "$others" ]; then
    "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfEs -m gpu $others || rc=1
  fi
  return $rc
}
export -f run_tests
step tests "$(cap 300)" bash -c run_tests || true

# 8. the same rounds with compile_decode = off (eager decode: the baseline on the same machine)
if [ -n "$MODEL" ]; then
  EAGER=(); [ "$HAS_COMPILE" = 1 ] && EAGER=(--set compile_decode=off)
  step round-eager 260 "$PY" scripts/gpu_check.py round --model "$MODEL" --task strategy_qa --rounds 2 $SMALL \
    "${EAGER[@]}" --out "$RES/round-eager.json" || true
else
  skip round-eager "no model (step model)"
fi

# 9. a real federation through Flower's deployment engine (no Ray): 1 round, tiny-random on the GPU; decoded eagerly
#    (the compiled decode is timed above; compiling it in each of the run's three processes would take most of the
#    step's time: on 2026-11-28 the run, submitted, did not end within the 81 s left to it)
flwr_run() {
  "$PY" scripts/gpu_check.py flwr-install --wheels "$BUNDLE/wheels" || return 3
  local eager=(); [ "$HAS_COMPILE" = 1 ] && eager=(--set compile_decode=off)
  "$PY" examples/deploy-local/run.py --output-dir "$S/deploy" --model tiny-random --rounds 1 \
    --rollouts-per-round 2 --eval-size 4 --local-steps 1 --max-new-tokens 8 --train-size 20 "${eager[@]}" \
    --timeout $(( STEP_LIMIT > 200 ? STEP_LIMIT - 150 : 50 ))   # from the run's submission, after ≤ 100 s of start
  local rc=$?
  [ -f "$S/deploy/summary.json" ] && cp "$S/deploy/summary.json" "$RES/flwr-run.json"
  return $rc
}
export -f flwr_run
step flwr-run "$(cap 240)" bash -c flwr_run || true

# 10. summary, named by machine kind
echo; echo "=== $(date +%T) summary"
if [ "$MODE" = gpu ]; then DEST=$REPO/docs/results/bench; else DEST=$BUNDLE/dry-run; fi
mkdir -p "$DEST"
"$PY" scripts/gpu_check.py summary --dir "$RES" --kind "$KIND" --commit "$COMMIT" --steps "$STEPS" \
  --out "$DEST/$KIND-gpu-check" $([ "$MODE" = dry ] && echo --dry-run)
for f in "$RES"/*-bf16*.json "$RES"/*-bf16*.md "$RES"/*-fp32*.json "$RES"/*-fp32*.md; do
  [ -f "$f" ] && cp "$f" "$DEST/"
done
echo "results: $DEST/$KIND-gpu-check.{json,md,log}$([ -n "${OUT:-}" ] && echo " (and in \$OUT)"); $(( $(date +%s) - START )) s in all"
sleep 1  # the log's last lines through tee
cp "$LOG" "$DEST/$KIND-gpu-check.log"
if [ -n "${OUT:-}" ]; then  # the run tool brings back what is under $OUT (8 files at most)
  cp "$DEST/$KIND-gpu-check".{json,md,log} "$OUT/" 2>/dev/null
  for f in "$RES"/*-bf16*.json "$RES"/*-bf16*.md "$RES"/round-*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
fi
