#!/usr/bin/env bash
# Before/after benchmark of two crab builds, side by side in one run (issue 11's budget:
# create, exec and checkpoint within 1.1x of the code before it).
#
#   scripts/bench-before-after.sh [options] BEFORE_CRAB AFTER_CRAB
#     --rounds N            alternations of the two daemons (default 3; the order flips each round)
#     --creates N --execs N per round, passed to each build's own `crab bench foundation`
#     --lifecycle-rounds N  per round, `AFTER_CRAB bench lifecycle` against each daemon (API only,
#                           so the same client measures both; 0 skips it)
#     --image-from DIR      root filesystem both state dirs import as `debian` when they lack it
#                           (default: the debian image of ${CRAB_STATE_DIR:-/var/lib/crab})
#     --json FILE           every per-round report and the summary, as JSON
#   AFTER_PRIVILEGED=1      the after build also measures `--privileged` sandboxes, interleaved
#                           (for a BEFORE older than the default security profile)
#
# Each build gets its own state directory ($BA_STATE-before, $BA_STATE-after; BA_STATE defaults to
# /var/lib/crab-ba) and its own proxy port, because an older daemon need not read a newer one's
# records. Only one daemon runs at a time. The foundation figures come from each build's own
# client (its `crab exec` is part of what is measured); the checkpoint figures from one client.
# Prints what else was running (load average) at the start and the end.
set -euo pipefail

ROUNDS=3 CREATES=20 EXECS=60 LROUNDS=3 JSON_OUT="" IMAGE_FROM=""
while [ $# -gt 2 ]; do
    case "$1" in
        --rounds) ROUNDS=$2; shift 2 ;;
        --creates) CREATES=$2; shift 2 ;;
        --execs) EXECS=$2; shift 2 ;;
        --lifecycle-rounds) LROUNDS=$2; shift 2 ;;
        --image-from) IMAGE_FROM=$2; shift 2 ;;
        --json) JSON_OUT=$2; shift 2 ;;
        *) echo "error: unknown option $1 (see the head of $0)" >&2; exit 2 ;;
    esac
done
[ $# -eq 2 ] || { echo "usage: $0 [options] BEFORE_CRAB AFTER_CRAB" >&2; exit 2; }
BEFORE=$(realpath "$1") AFTER=$(realpath "$2")
for b in "$BEFORE" "$AFTER"; do
    [ -x "$b" ] || { echo "error: $b is not an executable crab build" >&2; exit 2; }
done
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BA_STATE:-/var/lib/crab-ba}
IMAGE_FROM=${IMAGE_FROM:-${CRAB_STATE_DIR:-/var/lib/crab}/pool/images/debian}
WORK=$(mktemp -d)
trap 'for s in before after; do CRAB_STATE_DIR=$BASE-$s "$HERE/daemon.sh" stop || true; done; rm -rf "$WORK"' EXIT

start() { # start SIDE BIN PORT
    CRAB_STATE_DIR=$BASE-$1 CRAB_PROXY_LISTEN=127.0.0.1:$3 env -u CRAB_E2B_LISTEN \
        "$HERE/daemon.sh" restart "$2" >/dev/null
}
stop() { CRAB_STATE_DIR=$BASE-$1 "$HERE/daemon.sh" stop; }

echo "bench before/after: before $BEFORE, after $AFTER; $ROUNDS rounds x ($CREATES creates, $EXECS execs, $LROUNDS lifecycle rounds)"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
port=7491
for side in before after; do
    bin=$BEFORE; [ $side = after ] && bin=$AFTER
    start $side "$bin" $port
    if ! "$bin" --state-dir "$BASE-$side" image ls 2>/dev/null | grep -qw debian; then
        [ -d "$IMAGE_FROM" ] || { echo "error: no image at $IMAGE_FROM (build one: crab image build debian, or pass --image-from)" >&2; exit 1; }
        echo "importing $IMAGE_FROM as debian into $BASE-$side ..."
        "$bin" --state-dir "$BASE-$side" image import debian "$IMAGE_FROM" >/dev/null
    fi
    stop $side
    port=$((port + 1))
done

for r in $(seq 1 "$ROUNDS"); do
    order="before after"; [ $((r % 2)) -eq 0 ] && order="after before"
    for side in $order; do
        bin=$BEFORE port=7491; [ $side = after ] && bin=$AFTER port=7492
        start $side "$bin" $port
        echo "round $r: $side (load $(cut -d' ' -f1 /proc/loadavg))" >&2
        # The after build also measures `--privileged` sandboxes (no security profile) in the
        # same run, when BEFORE predates the profile (AFTER_PRIVILEGED=1): then the profile's
        # own cost (issue 10) and the rest of the change can be told apart.
        extra=(); [ $side = after ] && [ "${AFTER_PRIVILEGED:-0}" = 1 ] && extra=(--privileged)
        "$bin" --state-dir "$BASE-$side" --json bench foundation --creates "$CREATES" --execs "$EXECS" "${extra[@]}" \
            >"$WORK/foundation-$side-$r.json"
        # The bench leaves its sandboxes; remove them so every round starts alike.
        for n in $("$bin" --state-dir "$BASE-$side" --json sandbox ls | python3 -c 'import json,sys; print(" ".join(s["name"] for s in json.load(sys.stdin)))'); do
            "$bin" --state-dir "$BASE-$side" sandbox rm --force "$n" >/dev/null 2>&1 || true
        done
        if [ "$LROUNDS" -gt 0 ]; then
            "$AFTER" --state-dir "$BASE-$side" --json bench lifecycle --rounds "$LROUNDS" --fork 2 "${extra[@]}" \
                >"$WORK/lifecycle-$side-$r.json"
        fi
        stop $side
    done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$WORK" "$ROUNDS" "$JSON_OUT" <<'EOF'
import json, os, statistics, sys
work, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(kind, side):
    rs = []
    for r in range(1, rounds + 1):
        p = os.path.join(work, f"{kind}-{side}-{r}.json")
        if os.path.exists(p):
            with open(p) as f:
                rs.append(json.load(f))
    return rs
# (name, report kind, key path): the before figure and the after one read the same path; a row
# with `twin` reads the after build's --privileged twin (`privileged.<path>`) instead.
rows = [
    ("sandbox create p50", "foundation", ["create_ms", "p50"], False),
    ("crab exec true p50", "foundation", ["exec_true_ms", "p50"], False),
    ("host true p50", "foundation", ["host_true_ms", "p50"], False),
    ("checkpoint fs p50", "lifecycle", ["checkpoint_fs_ms", "p50"], False),
    ("checkpoint full p50", "lifecycle", ["checkpoint_full_ms", "p50"], False),
    ("restore p50", "lifecycle", ["restore_ms", "p50"], False),
    ("fork of 2", "lifecycle", ["fork_ms"], False),
    ("sandbox create p50, after --privileged", "foundation", ["create_ms", "p50"], True),
    ("crab exec true p50, after --privileged", "foundation", ["exec_true_ms", "p50"], True),
    ("checkpoint fs p50, after --privileged", "lifecycle", ["checkpoint_fs_ms", "p50"], True),
    ("checkpoint full p50, after --privileged", "lifecycle", ["checkpoint_full_ms", "p50"], True),
    ("restore p50, after --privileged", "lifecycle", ["restore_ms", "p50"], True),
]
def get(j, path):
    for k in path:
        j = j.get(k) if isinstance(j, dict) else None
    return j
summary = {}
print(f"{'measure (ms; median of the rounds)':40} {'before':>9} {'after':>9} {'after/before':>13}")
for name, kind, path, twin in rows:
    b = [v for v in (get(j, path) for j in load(kind, "before")) if v is not None]
    apath = ["privileged"] + path if twin else path
    a = [v for v in (get(j, apath) for j in load(kind, "after")) if v is not None]
    if not b or not a:
        continue
    mb, ma = statistics.median(b), statistics.median(a)
    summary[name] = {"before": b, "after": a, "ratio": ma / mb}
    print(f"{name:40} {mb:9.2f} {ma:9.2f} {ma / mb:12.3f}x")
if out:
    with open(out, "w") as f:
        json.dump({"summary": summary,
                   "reports": {k: {s: load(k, s) for s in ("before", "after")} for k in ("foundation", "lifecycle")}},
                  f, indent=1)
EOF
