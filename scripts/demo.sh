#!/usr/bin/env bash
# The demo of `make demo`: a sandbox from the default image, a few commands (one starts a
# background HTTP server that a later command queries), `crab sandbox ls`, removal.
set -euo pipefail
CRAB=${1:-crab}
name=demo-$$
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }
run() { step "$*"; "$@"; }

run "$CRAB" sandbox create debian --name "$name"
trap '"$CRAB" sandbox rm --force "$name" >/dev/null 2>&1 || true' EXIT
run "$CRAB" exec "$name" -- sh -c 'hostname; id -un; cat /etc/os-release | head -1'
run "$CRAB" exec "$name" -- ps -e -o pid,comm
run "$CRAB" exec -w /tmp "$name" -- sh -c 'echo "hello from $(hostname)" > index.html && nohup python3 -m http.server 8000 >/tmp/http.log 2>&1 &'
sleep 0.5
run "$CRAB" exec "$name" -- curl -s http://127.0.0.1:8000/index.html
run "$CRAB" sandbox ls
run "$CRAB" sandbox rm --force "$name"
trap - EXIT
echo
echo "demo done"
