#!/usr/bin/env bash
# The demo of `make demo`: a short tour of a sandbox, then the main job — the replay benchmark
# on the bundled trajectories (examples/traces: an HTTP counter service, a sqlite app, a python
# REPL, a build), one fault each, every method side by side, with a table and an SVG chart.
set -euo pipefail
CRAB=${1:-crab}
OUT=${CRAB_DEMO_OUT:-target/demo}
mkdir -p "$OUT"
name=demo-$$
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }
run() { step "$*"; "$@"; }

echo "== 1. a sandbox: create, run, a background service, a checkpoint, a rollback"
run "$CRAB" sandbox create debian --name "$name"
trap '"$CRAB" sandbox rm --force "$name" >/dev/null 2>&1 || true' EXIT
run "$CRAB" exec "$name" -- sh -c 'hostname; cat /etc/os-release | head -1'
run "$CRAB" exec -w /tmp "$name" -- sh -c 'echo "hello from $(hostname)" > index.html && nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 &'
sleep 0.5
run "$CRAB" exec "$name" -- curl -s http://127.0.0.1:8000/index.html
run "$CRAB" checkpoint "$name"
run "$CRAB" exec "$name" -- sh -c 'rm /tmp/index.html; pkill -x python3; echo oops: file deleted, server killed'
run "$CRAB" restore "$name"
run "$CRAB" exec "$name" -- curl -s http://127.0.0.1:8000/index.html
run "$CRAB" sandbox ls
run "$CRAB" sandbox rm --force "$name"
trap - EXIT

echo
echo "== 2. the replay benchmark: bundled trajectories, one fault each, all methods"
run "$CRAB" bench replay --traces examples/traces --llm-latency "${CRAB_DEMO_LATENCY:-scale:0.1}" \
    --sandboxes 2 --faults 1 --seed 1 --llm-listen "${CRAB_DEMO_LLM:-127.0.0.1:7439}" --json-out "$OUT/replay.json" --svg "$OUT/replay.svg"
echo
echo "report: $OUT/replay.json, chart: $OUT/replay.svg"
