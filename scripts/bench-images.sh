#!/usr/bin/env bash
# Images (issue 29), side by side in one run, on a state directory of its own:
#
#   * unpack: a 3-layer OCI image (the debian image's tree split in three, gzip layers, made by
#     umoci) imported by `crab image import` (verify + apply each layer once as btrfs snapshots)
#     vs `umoci unpack` of the same layout; with `crab image pull` built in, also a pull from a
#     loopback registry (Debian's docker-registry) vs `skopeo copy` + `umoci unpack`;
#   * create: `crab bench foundation` create p50 from that image vs from `debian`, alternated;
#   * disk: five images on that base (`umoci insert` of one small file each) — sum of their
#     sizes vs what the pool's usage grew by;
#   * build: a Dockerfile FROM that image (RUN + COPY), first build vs a cached rebuild.
#
#   scripts/bench-images.sh [BIN]     (default target/release/crab; ROUNDS=3)
#
# Needs root, umoci, skopeo, docker-registry (scripts/install-deps.sh) and the debian image in
# ${CRAB_STATE_DIR:-/var/lib/crab}. Removes its state and files afterwards.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(realpath "${1:-$HERE/../target/release/crab}")
ROUNDS=${ROUNDS:-3}
DEBIAN=${CRAB_STATE_DIR:-/var/lib/crab}/pool/images/debian
STATE=/var/lib/crab-bench-images WORK=/var/tmp/crab-bench-images
export CRAB_STATE_DIR=$STATE CRAB_PROXY_LISTEN=127.0.0.1:7592 CRAB_NAT_RANGE=10.233.0.0/16
unset CRAB_E2B_LISTEN CRAB_E2B_KEYS
REG_PID=
cleanup() {
    [ -n "$REG_PID" ] && kill "$REG_PID" 2>/dev/null || true
    "$HERE/daemon.sh" stop >/dev/null 2>&1 || true
    umount "$STATE/masked" 2>/dev/null || true
    umount "$STATE/pool" 2>/dev/null || true
    rm -rf "$STATE" "$WORK"
}
trap cleanup EXIT
cleanup
mkdir -p "$WORK"
ms() { date +%s%N; }
since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : int((a[NR/2]+a[NR/2+1])/2))}'; }
echo "bench images: $BIN, $ROUNDS rounds; load average at start: $(cut -d' ' -f1-3 /proc/loadavg);"
echo "  other heavy processes: $(ps -eo comm,pcpu --sort=-pcpu | awk 'NR>1 && $2>20 {printf "%s(%s%%) ", $1, $2}')"

# The fixture: the debian tree in three layers.
L=$WORK/layout
umoci init --layout "$L" && umoci new --image "$L:big"
umoci unpack --image "$L:big" "$WORK/b" >/dev/null
cp -a "$DEBIAN/." "$WORK/b/rootfs/" && rm -rf "$WORK/b/rootfs/.crab"
mv "$WORK/b/rootfs/usr/lib" "$WORK/lib" && mv "$WORK/b/rootfs/usr/share" "$WORK/share"
umoci repack --image "$L:big" "$WORK/b"
mv "$WORK/lib" "$WORK/b/rootfs/usr/lib" && umoci repack --image "$L:big" "$WORK/b"
mv "$WORK/share" "$WORK/b/rootfs/usr/share" && umoci repack --image "$L:big" "$WORK/b"
rm -rf "$WORK/b"
BLOBS=$(du -sb "$L/blobs" | cut -f1)
"$HERE/daemon.sh" restart "$BIN" >/dev/null
"$BIN" image import debian "$DEBIAN" >/dev/null

echo
echo "== unpack: the 3-layer image ($((BLOBS / 1048576)) MiB of gzip blobs), ms per round"
crab_t=() umoci_t=()
for r in $(seq "$ROUNDS"); do
    t=$(ms); "$BIN" image import big "$L" >/dev/null; crab_t+=("$(since "$t")")
    [ "$r" -lt "$ROUNDS" ] && "$BIN" image rm big >/dev/null
    rm -rf "$WORK/u"; sync
    t=$(ms); umoci unpack --image "$L:big" "$WORK/u" >/dev/null; umoci_t+=("$(since "$t")")
    rm -rf "$WORK/u"
done
c=$(printf '%s\n' "${crab_t[@]}" | median) u=$(printf '%s\n' "${umoci_t[@]}" | median)
echo "crab image import  p50 ${c} ms   (${crab_t[*]}; includes the user-namespace copy)"
echo "umoci unpack       p50 ${u} ms   (${umoci_t[*]})"
echo "ratio crab/umoci   $(awk -v a="$c" -v b="$u" 'BEGIN {printf "%.2f", a/b}')"

if "$BIN" image pull --help >/dev/null 2>&1; then
    echo
    echo "== pull: the same image from a loopback registry, ms per round"
    PORT=5591
    mkdir -p "$WORK/reg"
    cat >"$WORK/reg.yml" <<EOF
version: 0.1
storage: {filesystem: {rootdirectory: $WORK/reg}}
http: {addr: 127.0.0.1:$PORT}
EOF
    docker-registry serve "$WORK/reg.yml" >"$WORK/reg.log" 2>&1 &
    REG_PID=$!
    for _ in $(seq 50); do curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null && break; sleep 0.1; done
    skopeo copy --quiet --dest-tls-verify=false "oci:$L:big" "docker://127.0.0.1:$PORT/bench/big:1"
    # Nothing of it stored: each round downloads, verifies and applies every layer.
    "$BIN" image rm big >/dev/null
    pull_t=() sk_t=()
    for r in $(seq "$ROUNDS"); do
        "$BIN" image rm pulled >/dev/null 2>&1 || true
        rm -rf "$STATE/cache/blobs"; sync
        t=$(ms); "$BIN" image pull --insecure --name pulled "127.0.0.1:$PORT/bench/big:1" >/dev/null
        pull_t+=("$(since "$t")")
        rm -rf "$WORK/p" "$WORK/pu"; sync
        t=$(ms)
        skopeo copy --quiet --src-tls-verify=false "docker://127.0.0.1:$PORT/bench/big:1" "oci:$WORK/p:1"
        umoci unpack --image "$WORK/p:1" "$WORK/pu" >/dev/null
        sk_t+=("$(since "$t")")
        rm -rf "$WORK/p" "$WORK/pu"
    done
    c=$(printf '%s\n' "${pull_t[@]}" | median) s=$(printf '%s\n' "${sk_t[@]}" | median)
    echo "crab image pull          p50 ${c} ms   (${pull_t[*]}; download, verify, apply, userns copy)"
    echo "skopeo copy + umoci      p50 ${s} ms   (${sk_t[*]})"
    echo "ratio crab/(skopeo+umoci) $(awk -v a="$c" -v b="$s" 'BEGIN {printf "%.2f", a/b}')"
    "$BIN" image rm pulled >/dev/null
    "$BIN" image import big "$L" >/dev/null
fi

echo
echo "== create: sandbox create p50 (ms), alternating, 10 creates per batch"
d_all=() b_all=()
for r in $(seq "$ROUNDS"); do
    for img in debian big; do
        v=$("$BIN" --json bench foundation --image "$img" --creates 10 --execs 1 |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["create_ms"]["p50"])')
        if [ "$img" = debian ]; then d_all+=("$v"); else b_all+=("$v"); fi
    done
done
d=$(printf '%s\n' "${d_all[@]}" | sort -n | sed -n "$(( (ROUNDS + 1) / 2 ))p")
b=$(printf '%s\n' "${b_all[@]}" | sort -n | sed -n "$(( (ROUNDS + 1) / 2 ))p")
echo "from debian       p50 $d   (batches: ${d_all[*]})"
echo "from OCI image    p50 $b   (batches: ${b_all[*]})"
echo "ratio OCI/debian  $(awk -v a="$b" -v b="$d" 'BEGIN {printf "%.2f", a/b}')"

echo
echo "== disk: five images on the same base"
sync
used0=$(df --output=used -B1 "$STATE/pool" | tail -1)
for i in 1 2 3 4 5; do
    echo "variant $i" >"$WORK/variant"
    umoci insert --image "$L:big" --tag "v$i" "$WORK/variant" /variant >/dev/null
    # A layout of its own (the shared one holds several images by now).
    skopeo copy --quiet "oci:$L:v$i" "oci:$WORK/v$i:v$i"
    "$BIN" image import "v$i" "$WORK/v$i" >/dev/null
done
sync
used1=$(df --output=used -B1 "$STATE/pool" | tail -1)
sum=$("$BIN" --json image ls | python3 -c 'import json,sys; print(sum(i["size_bytes"] for i in json.load(sys.stdin) if i["name"].startswith("v")))')
echo "sum of the five images' sizes   $((sum / 1048576)) MiB"
echo "pool usage grew by              $(((used1 - used0) / 1048576)) MiB"

echo
echo "== build: a Dockerfile FROM that image, first build vs cached rebuild (ms)"
mkdir -p "$WORK/ctx"
echo payload >"$WORK/ctx/f"
printf 'FROM big\nRUN echo built > /built && python3 -c "print(1)"\nCOPY f /f\nENV A=b\n' >"$WORK/ctx/Dockerfile"
t=$(ms); "$BIN" image build -f "$WORK/ctx/Dockerfile" "$WORK/ctx" --name built >/dev/null; first=$(since "$t")
t=$(ms); "$BIN" image build -f "$WORK/ctx/Dockerfile" "$WORK/ctx" --name built >/dev/null; again=$(since "$t")
echo "first build  $first ms"
echo "cached       $again ms"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
