#!/usr/bin/env bash
# Start, restart or stop the crab daemon for `make demo` / `make test`.
#   scripts/daemon.sh restart BIN   stop any daemon on $CRAB_STATE_DIR, start BIN daemon, wait for it
#   scripts/daemon.sh stop          stop the daemon (sandboxes keep running)
# The daemon logs to $CRAB_STATE_DIR/logs/daemon.log.
set -euo pipefail
STATE=${CRAB_STATE_DIR:-/var/lib/crab}
PIDFILE=$STATE/daemon.pid

stop() {
    local pid
    pid=$(cat "$PIDFILE" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q crab "/proc/$pid/cmdline" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 400); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.05; done
        echo "crab daemon $pid ignored SIGTERM for 20 s; killing it" >&2
        kill -9 "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    fi
}

case "${1:-}" in
    stop) stop ;;
    restart)
        BIN=${2:?usage: daemon.sh restart BIN}
        stop
        mkdir -p "$STATE/logs"
        setsid "$BIN" daemon --state-dir "$STATE" >>"$STATE/logs/daemon.log" 2>&1 </dev/null &
        for _ in $(seq 200); do
            if "$BIN" --state-dir "$STATE" version >/dev/null 2>&1; then
                echo "crab daemon up (pid $(cat "$PIDFILE"), log $STATE/logs/daemon.log)"
                exit 0
            fi
            sleep 0.05
        done
        echo "error: the crab daemon did not come up; last lines of $STATE/logs/daemon.log:" >&2
        tail -n 20 "$STATE/logs/daemon.log" >&2
        exit 1
        ;;
    *) echo "usage: $0 restart BIN | stop" >&2; exit 2 ;;
esac
