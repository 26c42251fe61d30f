#!/usr/bin/env bash
# The README's first command. On a fresh machine: set up .venv, write a small demo checkpoint tree
# with real torch FSDP (CPU), start Dagster (webserver + daemon on 127.0.0.1) with the
# new-checkpoint sensor on, wait until the sensor's runs have merged the demo checkpoint, print the
# URL to open, and serve until Ctrl-C.
#
#   bash scripts/demo.sh          serve until Ctrl-C
#   bash scripts/demo.sh --once   stop once the demo merge succeeded (also MERGE_PIPELINE_DEMO_ONCE=1)
#
# Environment (defaults in brackets): DAGSTER_PORT [3000], DAGSTER_HOME [./.dagster_home],
# MERGE_PIPELINE_CHECKPOINT_ROOTS [./demo/checkpoints], MERGE_PIPELINE_OUTPUT_ROOT [./demo/merged],
# MERGE_PIPELINE_SETTLE_SECONDS [20], MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS [5], MERGE_PIPELINE_SKIP_SETUP [0].
# See docs/DAGSTER.md; without the demo, `dagster dev` (or `dg dev`) in the project root is all it takes.
set -euo pipefail
cd "$(dirname "$0")/.."

ONCE=${MERGE_PIPELINE_DEMO_ONCE:-0}
for arg in "$@"; do
    case "$arg" in
        --once) ONCE=1 ;;
        *) echo "usage: bash scripts/demo.sh [--once]" >&2; exit 2 ;;
    esac
done

if [ "${MERGE_PIPELINE_SKIP_SETUP:-0}" != 1 ]; then  # skip: .venv already set up
    echo "setting up .venv (scripts/setup.sh): this project with torch 2.13 (CPU), transformers, dagster,"
    echo "megatron-core, deepspeed and the test tools, about 1.6 GB: 3-4 minutes the first time, seconds after"
    bash scripts/setup.sh
fi
PY=.venv/bin/python

export DAGSTER_HOME=${DAGSTER_HOME:-$PWD/.dagster_home}
export MERGE_PIPELINE_CHECKPOINT_ROOTS=${MERGE_PIPELINE_CHECKPOINT_ROOTS:-$PWD/demo/checkpoints}
export MERGE_PIPELINE_OUTPUT_ROOT=${MERGE_PIPELINE_OUTPUT_ROOT:-$PWD/demo/merged}
export MERGE_PIPELINE_SETTLE_SECONDS=${MERGE_PIPELINE_SETTLE_SECONDS:-20}
export MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS=${MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS:-5}
# `telemetry: enabled: false` in dagster.yaml leaves the webserver's and daemon's upload thread
# running; it would send whatever lies in $DAGSTER_HOME/logs/ to Dagster. This stops it.
export DAGSTER_DISABLE_TELEMETRY=1
URL=http://127.0.0.1:${DAGSTER_PORT:-3000}
mkdir -p "$DAGSTER_HOME/server_logs"
cp dagster.yaml "$DAGSTER_HOME/dagster.yaml"

# The demo trainer run, in the first watched root: step 1 with an actor and a critic, then the
# tracker file, written last as verl does. Kept between demos; delete demo/ to start over.
RUN_DIR=${MERGE_PIPELINE_CHECKPOINT_ROOTS%%:*}/demo_run
if [ ! -f "$RUN_DIR/latest_checkpointed_iteration.txt" ]; then
    echo "writing a demo checkpoint with torch FSDP (2 ranks, gloo, CPU) into $RUN_DIR/global_step_1"
    rm -rf "$RUN_DIR/global_step_1"
    "$PY" -m merge_pipeline_samples.fsdp "$RUN_DIR/global_step_1/actor" --world-size 2
    "$PY" -m merge_pipeline_samples.fsdp "$RUN_DIR/global_step_1/critic" --world-size 2 --arch llama --critic
    printf 1 > "$RUN_DIR/latest_checkpointed_iteration.txt"
fi

# The instance's sqlite storage is created here, once: the webserver and the daemon creating it at
# the same moment can corrupt its schema version table.
.venv/bin/dagster instance migrate >/dev/null

# Job control puts each server in its own process group, so stop() can shut each down with
# everything it started. The servers get SIGINT at its default disposition: a script started in the
# background passes an ignored SIGINT on to its children, and Dagster would then ignore stop()'s.
set -m
with_default_sigint() {
    exec "$PY" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' "$@"
}
with_default_sigint .venv/bin/dagster-webserver -w workspace.yaml -h 127.0.0.1 -p "${URL##*:}" >"$DAGSTER_HOME/server_logs/webserver.log" 2>&1 &
WEBSERVER=$!
with_default_sigint .venv/bin/dagster-daemon run -w workspace.yaml >"$DAGSTER_HOME/server_logs/daemon.log" 2>&1 &
DAEMON=$!
WAITER=

stop() {
    trap - EXIT INT TERM
    echo "stopping Dagster"
    if [ -n "$WAITER" ]; then
        kill "$WAITER" 2>/dev/null || true
        wait "$WAITER" 2>/dev/null || true
    fi
    kill -INT -- "-$WEBSERVER" "-$DAEMON" 2>/dev/null || true
    for _ in $(seq 60); do
        kill -0 -- "-$WEBSERVER" 2>/dev/null || kill -0 -- "-$DAEMON" 2>/dev/null || return 0
        sleep 0.5
    done
    kill -KILL -- "-$WEBSERVER" "-$DAEMON" 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

echo "starting Dagster at $URL (logs: $DAGSTER_HOME/server_logs/); the sensor merges the demo checkpoint"
# The wait runs in the background so that Ctrl-C or SIGTERM reaches this script's traps at once.
read -r -d '' WAIT_FOR_DEMO <<'EOF' || true
"""Wait until the sensor's run for each demo partition succeeded (asking the webserver's GraphQL API)."""
import json, os, sys, time, urllib.request
from pathlib import Path

url, output, pids, keys = sys.argv[1], Path(sys.argv[2]), [int(p) for p in sys.argv[3:5]], sys.argv[5:]
RUNS = "query($f: RunsFilter) { runsOrError(filter: $f) { ... on Runs { results { status } } } }"
LOCATIONS = "{ workspaceOrError { ... on Workspace { locationEntries { locationOrLoadError { __typename ... on PythonError { message } } } } } }"

def ask(query, variables=None):
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{url}/graphql", body, {"Content-Type": "application/json"}), timeout=10) as response:
        return json.load(response)["data"]

deadline, pending = time.monotonic() + 900, list(keys)
while pending:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(f"a Dagster process exited; see {os.environ['DAGSTER_HOME']}/server_logs/")
    if time.monotonic() > deadline:
        sys.exit(f"no successful run for {pending} after 15 minutes: see {url}/runs")
    time.sleep(1)
    try:
        locations = ask(LOCATIONS)["workspaceOrError"]["locationEntries"]
    except OSError:
        continue  # the webserver is still starting
    for entry in locations:
        if (entry["locationOrLoadError"] or {}).get("__typename") == "PythonError":
            sys.exit(f"the code location failed to load: {entry['locationOrLoadError']['message'].strip()}")
    for key in list(pending):
        found = [run["status"] for run in ask(RUNS, {"f": {"tags": [{"key": "dagster/partition", "value": key}]}})["runsOrError"]["results"]]
        if "SUCCESS" in found or (not found and (output / key).is_dir()):  # or merged by an earlier demo
            pending.remove(key)
            print(f"merged {key} -> {output / key}")
        elif found and found[0] in ("FAILURE", "CANCELED"):
            sys.exit(f"the run for {key} ended {found[0]}: see {url}/runs")
EOF
"$PY" -c "$WAIT_FOR_DEMO" "$URL" "$MERGE_PIPELINE_OUTPUT_ROOT" "$WEBSERVER" "$DAEMON" demo_run/global_step_1/actor demo_run/global_step_1/critic &
WAITER=$!
wait "$WAITER"
WAITER=

# The step to drop next: one past the newest there, so a second demo adds a step instead of moving
# the tracker backwards.
NEXT=$(($(find "$RUN_DIR" -maxdepth 1 -name 'global_step_*' -printf '%f\n' | sed 's/^global_step_//' | sort -n | tail -1) + 1))
cat <<EOF

The demo checkpoint is merged. Open:
    $URL/locations/merge_pipeline/asset-groups/merge
In another shell, to reach merge-pipeline, dg and this demo's instance (docs/DAGSTER.md, "After the demo"):
    cd $PWD && source .venv/bin/activate && export DAGSTER_HOME=$DAGSTER_HOME
Drop another checkpoint into the watched root; the sensor merges it within a minute:
    $PY -m merge_pipeline_samples.fsdp $RUN_DIR/global_step_$NEXT/actor --trained-steps $((NEXT - 1)) && printf $NEXT > $RUN_DIR/latest_checkpointed_iteration.txt
Merged folders land in $MERGE_PIPELINE_OUTPUT_ROOT.
EOF

if [ "$ONCE" = 1 ]; then
    exit 0
fi
echo "Serving until Ctrl-C."
wait -n "$WEBSERVER" "$DAEMON"  # either one stopping ends the demo (and stop() the other)
