#!/usr/bin/env bash
# test-registry.sh start|stop DIR PORT [--auth USER:PASS] — a loopback OCI registry for tests.
#
# start: Debian's `docker-registry` (the CNCF distribution server, installed by
# scripts/install-deps.sh) on 127.0.0.1:PORT, plain http (clients name it --insecure), its
# storage in DIR/storage, a config generated in DIR/config.yml, its log in DIR/registry.log
# (one line per request: tests count the blob downloads there), with --auth basic auth from an
# htpasswd file made with `htpasswd -Bbn`. Waits until /v2/ answers, then prints
# `REGISTRY=127.0.0.1:PORT` and `REGISTRY_PID=<pid>` (also in DIR/registry.pid).
# stop: kills the registry started in DIR (storage kept; `rm -rf DIR` to drop it).
set -euo pipefail
usage() { echo "usage: $0 start|stop DIR PORT [--auth USER:PASS]" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
CMD=$1 DIR=$2 PORT=$3
shift 3
AUTH=
while [[ $# -gt 0 ]]; do
    case $1 in
        --auth) AUTH=$2; shift 2 ;;
        *) usage ;;
    esac
done

stop() {
    if [[ -f "$DIR/registry.pid" ]]; then
        local pid
        pid=$(cat "$DIR/registry.pid")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$DIR/registry.pid"
    fi
}

case $CMD in
    stop) stop; exit 0 ;;
    start) ;;
    *) usage ;;
esac

command -v docker-registry >/dev/null || {
    echo "test-registry: docker-registry is not installed; run scripts/install-deps.sh" >&2
    exit 1
}
stop
mkdir -p "$DIR/storage"
AUTH_YAML=
if [[ -n "$AUTH" ]]; then
    htpasswd -Bbn "${AUTH%%:*}" "${AUTH#*:}" >"$DIR/htpasswd"
    AUTH_YAML="auth:
  htpasswd:
    realm: crab-test
    path: $DIR/htpasswd"
fi
cat >"$DIR/config.yml" <<YAML
version: 0.1
log:
  level: info
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: $DIR/storage
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$PORT
$AUTH_YAML
YAML
setsid docker-registry serve "$DIR/config.yml" >>"$DIR/registry.log" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$DIR/registry.pid"
for _ in $(seq 1 150); do
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "test-registry: docker-registry exited; its log:" >&2
        tail -n 30 "$DIR/registry.log" >&2
        exit 1
    fi
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v2/" || true)
    if [[ "$code" == 200 || "$code" == 401 ]]; then
        echo "REGISTRY=127.0.0.1:$PORT"
        echo "REGISTRY_PID=$PID"
        exit 0
    fi
    sleep 0.2
done
echo "test-registry: no answer on 127.0.0.1:$PORT after 30 s; log in $DIR/registry.log" >&2
kill "$PID" 2>/dev/null || true
exit 1
