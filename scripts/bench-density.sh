#!/usr/bin/env bash
# Density: exposed latency and wall time of `crab` (through the LLM proxy) against `none` at
# several sandbox counts, one `crab bench replay` per count, one table at the end (issue 15).
#
#   scripts/bench-density.sh [options] [-- extra `crab bench replay` options]
#     --crab PATH        the crab build (default target/release/crab; its daemon must be running
#                        with --upstream-openai pointing at --llm-listen)
#     --counts LIST      sandbox counts, comma-separated (default 1,4,8,16,32)
#     --traces DIR       trajectories (default ../shared/traces/intercode-bash/gpt4-fs1)
#     --min-trajs N      each count replays max(count, N) trajectories (default 4)
#     --methods LIST     methods besides none (default crab)
#     --out DIR          per-count JSON reports and the table (default /tmp/crab-density)
#     --proxy URL        the daemon's proxy (default http://127.0.0.1:7431)
#     --llm-listen ADDR  where the replay LLM listens (default 127.0.0.1:7571)
#
# The replays use `--llm-latency scale:0.25 --faults 1 --seed 1` unless overridden after `--`.
# Prints the load average before and after each count (what else was running).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CRAB="$HERE/../target/release/crab" COUNTS=1,4,8,16,32 MIN=4 METHODS=crab OUT=/tmp/crab-density
TRACES="$HERE/../../shared/traces/intercode-bash/gpt4-fs1"
PROXY=http://127.0.0.1:7431 LLM=127.0.0.1:7571
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --crab) CRAB=$2; shift 2 ;;
        --counts) COUNTS=$2; shift 2 ;;
        --traces) TRACES=$2; shift 2 ;;
        --min-trajs) MIN=$2; shift 2 ;;
        --methods) METHODS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --proxy) PROXY=$2; shift 2 ;;
        --llm-listen) LLM=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "error: unknown option $1 (see the head of $0)" >&2; exit 2 ;;
    esac
done
[ -x "$CRAB" ] || { echo "error: $CRAB is not an executable crab build (build it or pass --crab)" >&2; exit 2; }
[ -d "$TRACES" ] || { echo "error: no trajectory folder $TRACES (pass --traces)" >&2; exit 2; }
mkdir -p "$OUT"

IFS=, read -r -a NS <<<"$COUNTS"
for n in "${NS[@]}"; do
    limit=$(( n > MIN ? n : MIN ))
    echo "== $n sandboxes, $limit trajectories; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    "$CRAB" bench replay --traces "$TRACES" --limit "$limit" --methods "$METHODS" \
        --sandboxes "$n" --llm-latency scale:0.25 --faults 1 --seed 1 \
        --llm-listen "$LLM" --proxy "$PROXY" --json-out "$OUT/n$n.json" "${EXTRA[@]}" \
        >"$OUT/n$n.txt" 2>"$OUT/n$n.log"
    echo "   done; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done

python3 - "$OUT" "${NS[@]}" <<'PY' | tee "$OUT/table.md"
import json, sys
out, counts = sys.argv[1], sys.argv[2:]
print("| sandboxes | trajectories | method | correct | wall× | exposed ms p50/p95/p99 | p95 / median LLM wait | top stage at p95 (ms) |")
print("|---|---|---|---|---|---|---|---|")
for n in counts:
    r = json.load(open(f"{out}/n{n}.json"))
    wait = r["llm_wait_ms"]["p50"]
    for m in r["methods"]:
        e = m["exposed_ms"]
        stages = [b for b in m.get("exposed_breakdown", []) if b["total_ms"] > 0]
        top = max(stages, key=lambda b: b["ms"]["p95"] or 0, default=None)
        top_s = f'{top["stage"]} {top["ms"]["p95"]:.1f}' if top else "-"
        print(f'| {n} | {len(r["traces"])} | {m["method"]} | {m["correct"]}/{m["trials"]} '
              f'| {m["wall_ratio_vs_none"]:.3f} | {e["p50"]:.1f}/{e["p95"]:.1f}/{e["p99"]:.1f} '
              f'| {100 * e["p95"] / wait:.1f}% of {wait:.0f} | {top_s} |')
PY
