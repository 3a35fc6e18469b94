#!/usr/bin/env bash
# `flwr run .` on this machine: start a local SuperLink in simulation mode on 127.0.0.1, submit this app to it,
# stream its logs, and stop the SuperLink (by its PID) when done.
#
#   scripts/flwr_run_local.sh [RUN_DIR] [NUM_SUPERNODES] [extra `--run-config` string]
#   e.g. scripts/flwr_run_local.sh runs/flwr 4 "rounds=2 rollouts-per-round=4 eval-size=16"
#
# Settings come from [tool.flwr.app.config] in pyproject.toml; `--run-config` overrides any of them (keys are the
# RunConfig names with '-' for '_'). The run directory gets config.toml, metrics.jsonl, adapters, report.md, plots.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/flwr}
NODES=${2:-4}
EXTRA=${3:-}
VENV_BIN=${VENV_BIN:-.venv/bin}
mkdir -p "$RUN_DIR"
export FLWR_HOME="$(cd "$RUN_DIR" && pwd)/.flwr"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export RAY_USAGE_STATS_ENABLED=0
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-39091}
export FLWR_LOCAL_CONTROL_API_PORT=${FLWR_LOCAL_CONTROL_API_PORT:-39093}
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = ":local:"
options.num-supernodes = $NODES
options.backend.client-resources.num-cpus = 2
options.backend.client-resources.num-gpus = 0.0
options.backend.init-args.num-cpus = 2
options.backend.init-args.num-gpus = 0
options.backend.init-args._node_ip_address = "127.0.0.1"
options.backend.init-args.include-dashboard = false
TOML

"$VENV_BIN/flower-superlink" --insecure --simulation --isolation subprocess \
  --control-api-address "127.0.0.1:$FLWR_LOCAL_CONTROL_API_PORT" --host 127.0.0.1 \
  --port "$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT" --database "$FLWR_HOME/state.db" \
  > "$FLWR_HOME/superlink.log" 2>&1 &
SUPERLINK_PID=$!
stop() { kill "$SUPERLINK_PID" 2>/dev/null || true; wait "$SUPERLINK_PID" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq 1 60); do
  (echo > "/dev/tcp/127.0.0.1/$FLWR_LOCAL_CONTROL_API_PORT") 2>/dev/null && break
  sleep 1
done
CONFIG="run-dir=\"$(pwd)/$RUN_DIR\" num-clients=$NODES"
[ -n "$EXTRA" ] && CONFIG="$CONFIG $EXTRA"
"$VENV_BIN/flwr" run . local --stream --run-config "$CONFIG"
