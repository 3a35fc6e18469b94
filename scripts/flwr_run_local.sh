#!/usr/bin/env bash
# `flwr run .` on this machine: start a local SuperLink in simulation mode on 127.0.0.1, submit this app to it,
# stream its logs, and stop the SuperLink (by its PID) when done.
#
#   scripts/flwr_run_local.sh [RUN_DIR] [NUM_SUPERNODES] [extra `--run-config` string]
#   e.g. scripts/flwr_run_local.sh runs/flwr 4 "rounds=2 rollouts-per-round=4 eval-size=16"
#
# Settings come from [tool.flwr.app.config] in pyproject.toml; `--run-config` overrides any of them (keys are the
# RunConfig names with '-' for '_'). The run directory gets config.toml, metrics.jsonl, adapters, report.md, plots.
# Exits 1, with the run's status and reason, when the run does not complete.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/flwr}
NODES=${2:-4}
EXTRA=${3:-}
VENV_BIN=$(cd "${VENV_BIN:-.venv/bin}" && pwd)
export PATH="$VENV_BIN:$PATH"  # the SuperLink spawns flower-superexec / flwr-simulation from PATH
mkdir -p "$RUN_DIR"
RUN_ABS=$(cd "$RUN_DIR" && pwd)  # RUN_DIR as given, relative (to the repository) or absolute
export FLWR_HOME="$RUN_ABS/.flwr"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export RAY_USAGE_STATS_ENABLED=0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray binds to 127.0.0.1 only (not a cluster node)
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-39091}
export FLWR_LOCAL_CONTROL_API_PORT=${FLWR_LOCAL_CONTROL_API_PORT:-39093}
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = ":local:"
TOML

"$VENV_BIN/flower-superlink" --insecure --simulation --isolation subprocess \
  --control-api-address "127.0.0.1:$FLWR_LOCAL_CONTROL_API_PORT" --host 127.0.0.1 \
  --port "$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT" --database "$FLWR_HOME/state.db" \
  > "$FLWR_HOME/superlink.log" 2>&1 &
SUPERLINK_PID=$!
descendants() { local p; for p in $(pgrep -P "$1"); do descendants "$p"; echo "$p"; done; }
stop() {  # the SuperLink and everything it spawned (SuperExec, simulation, Ray), by PID
  local pids; pids="$(descendants "$SUPERLINK_PID") $SUPERLINK_PID"
  kill $pids 2>/dev/null || true
  wait "$SUPERLINK_PID" 2>/dev/null || true
}
trap stop EXIT
for _ in $(seq 1 60); do
  "$VENV_BIN/python" -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT/health', timeout=1).is_success else 1)" 2>/dev/null && break
  kill -0 "$SUPERLINK_PID" 2>/dev/null || { echo "SuperLink exited; see $FLWR_HOME/superlink.log" >&2; exit 1; }
  sleep 1
done
CONFIG="run-dir=\"$RUN_ABS\" num-clients=$NODES"
[ -n "$EXTRA" ] && CONFIG="$CONFIG $EXTRA"
"$VENV_BIN/flwr" run . local --stream --run-config "$CONFIG" \
  --federation-config "num-supernodes=$NODES"
# `flwr run --stream` exits 0 whatever the run's end: exit 1 unless the run's status says it completed
"$VENV_BIN/flwr" ls local --format json > "$FLWR_HOME/ls.json" 2>&1 || true
STATUS=$("$VENV_BIN/python" - "$FLWR_HOME/ls.json" <<'PY'
import json, sys
try:
    runs = json.load(open(sys.argv[1])).get("runs") or []
except ValueError:
    runs = []
last = max(runs, key=lambda r: r.get("pending-at") or "") if runs else {}  # this invocation's: the newest
print(last.get("status", "unknown"), last.get("status-details") or "")
PY
)
case "$STATUS" in
  *completed*) ;;
  *) echo "flwr run ended with status $STATUS (the SuperLink's log: $FLWR_HOME/superlink.log)" >&2; exit 1 ;;
esac
