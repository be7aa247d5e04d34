#!/usr/bin/env bash
# The export cache across a daemon restart (issue 32): a sandbox of the debian image writes
# 20 MB, an `fs` point is exported to a file:// remote, the daemon restarts, one small file is
# written and the next point exported; the daemon's `point exported` log lines say what each
# export read. `drop` deletes the saved cache before the restart (the behaviour before it was
# kept), `keep` keeps it; run both in one go for the side-by-side figures:
#
#   scripts/bench-export-cache.sh [BIN]        (default target/debug/crab)
#
# Uses its own state directory and remote under /var/tmp and removes them afterwards; needs
# root and the debian image in ${CRAB_STATE_DIR:-/var/lib/crab}.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(realpath "${1:-$HERE/../target/debug/crab}")
IMAGE=${CRAB_STATE_DIR:-/var/lib/crab}/pool/images/debian
STATE=/var/lib/crab-bench-export REMOTE=/var/tmp/crab-bench-export-remote
export CRAB_STATE_DIR=$STATE CRAB_REMOTE=file://$REMOTE CRAB_PROXY_LISTEN=127.0.0.1:7591
unset CRAB_E2B_LISTEN CRAB_E2B_KEYS
cleanup() {
    "$HERE/daemon.sh" stop >/dev/null 2>&1 || true
    umount "$STATE/masked" 2>/dev/null || true
    umount "$STATE/pool" 2>/dev/null || true
    rm -rf "$STATE" "$REMOTE"
}
trap cleanup EXIT
cleanup
mkdir -p "$REMOTE"
echo "bench export-cache: $BIN; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
exported() { # exported SB N: wait for the Nth export of SB, print its log line
    for _ in $(seq 240); do
        [ "$(grep 'point exported' "$STATE/logs/daemon.log" | grep -c "\"$1\"")" -ge "$2" ] && break
        sleep 0.5
    done
    grep 'point exported' "$STATE/logs/daemon.log" | grep "\"$1\"" | sed -n "$2p" |
        sed 's/\x1b\[[0-9;]*m//g; s/.*point exported //'
}
for mode in drop keep; do
    "$HERE/daemon.sh" restart "$BIN" >/dev/null
    "$BIN" image ls | grep -qw debian || "$BIN" image import debian "$IMAGE" >/dev/null
    sb=bench-export-$mode
    "$BIN" sandbox create debian --name "$sb" >/dev/null
    "$BIN" exec "$sb" -- sh -c 'head -c 20000000 /dev/urandom > /root/data'
    "$BIN" checkpoint "$sb" --kind fs >/dev/null
    echo "$mode, first export:          $(exported "$sb" 1)"
    "$HERE/daemon.sh" stop >/dev/null
    [ "$mode" = drop ] && find "$STATE" -name export-cache.json -delete
    "$HERE/daemon.sh" restart "$BIN" >/dev/null
    "$BIN" exec "$sb" -- sh -c 'echo one > /root/small'
    "$BIN" checkpoint "$sb" --kind fs >/dev/null
    echo "$mode, export after restart:  $(exported "$sb" 2)"
    "$BIN" sandbox rm -f "$sb" >/dev/null
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
