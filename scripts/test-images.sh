#!/usr/bin/env bash
# test-images.sh build CACHE | push CACHE REGISTRY — OCI test images made by other tools.
#
# build: makes the fixtures of the registry tests (crates/crab/tests/images_pull.rs) without
# network, with Debian's umoci, GNU tar and buildah, into CACHE/<hash of this script>/ (made
# again only when this script changes; older hashes are removed). The base root is a tiny tree
# of this host's own files: dash as /bin/sh, coreutils' stat/ls/cat/id/readlink/head and the
# libraries they load. Prints the fixture directory.
#   layout (an OCI layout), tags:
#     base     one layer (umoci repack): the tiny tree, /etc/gone, /opaque/{old1,old2}
#     layers   base + a umoci layer (files owned by 1000:1000 with modes, a hard-link pair,
#              a user.* xattr, /etc/gone deleted: a whiteout, /data/link -> real, a symlinked
#              dir) + a GNU tar layer added with `umoci raw add-layer` (an opaque dir
#              /opaque, an explicit whiteout of /etc/gone-too, /data/link now a real dir),
#              config by `umoci config`: User 1000:1000, Env, WorkingDir /app, Entrypoint,
#              Cmd, a label, an exposed port
#     shell    base + a umoci layer of this host's bash, tar, gzip, grep, sed, find and
#              coreutils (what a task's scripts and Harbor's commands use), PATH set
#     tamper   base + one layer of random bytes (its own blob, for the tampered-blob test)
#     resume   base + a small layer + an 8 MiB random layer (the interrupted-pull test)
#     multi-amd64 / multi-arm64  base with config architecture amd64 / arm64 and a label
#   multi (an OCI layout): an index of multi-amd64 and multi-arm64 made with
#     `buildah manifest create/add --arch`, tag `multi`
# push: builds if needed, then `skopeo copy --dest-tls-verify=false` of each to
# docker://REGISTRY/<tag>:1 (the index with --all as multi:1). Prints the fixture directory.
set -euo pipefail
usage() { echo "usage: $0 build CACHE | push CACHE REGISTRY" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
CMD=$1 CACHE=$2
SELF=$(readlink -f "${BASH_SOURCE[0]}")
HASH=$(sha256sum "$SELF" | cut -c1-16)
OUT=$CACHE/$HASH
TAGS=(base layers shell tamper resume multi-amd64 multi-arm64)

for t in umoci skopeo buildah tar; do
    command -v $t >/dev/null || { echo "test-images: $t is not installed; run scripts/install-deps.sh" >&2; exit 1; }
done

# add_bins TREE BIN… — this host's BINs and the libraries they load, into TREE (merged /usr).
add_bins() {
    local T=$1
    shift
    for b in "$@"; do cp -L "$(command -v "$b")" "$T/usr/bin/$b"; done
    for lib in $(for b in "$@"; do ldd "$(command -v "$b")"; done |
        awk '$3 ~ /^\// {print $3} $1 ~ /^\/lib64\/ld-linux/ {print $1}' | sort -u); do
        case $lib in
            */ld-linux-x86-64.so.2) cp -L "$lib" "$T/usr/lib64/" ;;
            *) cp -L "$lib" "$T/usr/lib/x86_64-linux-gnu/" ;;
        esac
    done
}

build() {
    local W=$OUT.tmp.$$
    rm -rf "$W"
    mkdir -p "$W"
    trap 'rm -rf "$W"' RETURN
    local L=$W/layout T=$W/tree
    # The tiny root: this host's dash and coreutils with their libraries (merged /usr).
    mkdir -p "$T"/usr/bin "$T"/usr/lib/x86_64-linux-gnu "$T"/usr/lib64 "$T"/etc "$T"/tmp \
        "$T"/proc "$T"/dev "$T"/sys "$T"/root "$T"/opaque
    ln -s usr/bin "$T/bin"
    ln -s usr/lib "$T/lib"
    ln -s usr/lib64 "$T/lib64"
    add_bins "$T" dash stat ls cat id readlink head
    ln -s dash "$T/usr/bin/sh"
    printf 'root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/app:/bin/sh\n' >"$T/etc/passwd"
    printf 'root:x:0:\napp:x:1000:\n' >"$T/etc/group"
    echo "gone" >"$T/etc/gone"
    echo "gone too" >"$T/etc/gone-too"
    echo old1 >"$T/opaque/old1"
    echo old2 >"$T/opaque/old2"
    chmod 1777 "$T/tmp"

    umoci init --layout "$L"
    umoci new --image "$L:base"
    umoci unpack --image "$L:base" "$W/b1" >/dev/null
    cp -a "$T/." "$W/b1/rootfs/"
    umoci repack --image "$L:base" "$W/b1"

    # layers: a umoci layer on base ...
    umoci unpack --image "$L:base" "$W/b2" >/dev/null
    local R=$W/b2/rootfs
    mkdir -p "$R/app/sub" "$R/data/real"
    echo "hello from layers" >"$R/app/hello"
    echo "secret" >"$R/app/secret"
    chmod 0600 "$R/app/secret"
    echo "linked" >"$R/app/hl1"
    ln "$R/app/hl1" "$R/app/hl2"
    echo "xattr" >"$R/app/xattr-file"
    python3 -c 'import os,sys; os.setxattr(sys.argv[1], "user.crab", b"test-value")' "$R/app/xattr-file"
    chmod 2775 "$R/app/sub"
    chown -R 1000:1000 "$R/app"
    echo "real" >"$R/data/real/file"
    ln -s real "$R/data/link"
    rm "$R/etc/gone"
    umoci repack --image "$L:layers" "$W/b2"
    # ... and a GNU tar layer: opaque dir, explicit whiteout, the symlinked dir made a dir.
    local S=$W/l3
    mkdir -p "$S/opaque" "$S/etc" "$S/data/link"
    : >"$S/opaque/.wh..wh..opq"
    echo new >"$S/opaque/new"
    : >"$S/etc/.wh.gone-too"
    echo inside >"$S/data/link/inside"
    tar --numeric-owner --owner=0 --group=0 --sort=name -C "$S" -cf "$W/l3.tar" opaque etc data
    umoci raw add-layer --image "$L:layers" "$W/l3.tar"
    umoci config --image "$L:layers" --config.user 1000:1000 --config.env A=b \
        --config.env PATH=/usr/bin:/bin --config.workingdir /app \
        --config.entrypoint /bin/sh --config.entrypoint -c --config.cmd 'echo hi' \
        --config.label fixture=layers --config.exposedports 8080/tcp

    # shell: base + a layer with bash and the tools task scripts use (a Harbor task's FROM).
    umoci unpack --image "$L:base" "$W/b7" >/dev/null
    add_bins "$W/b7/rootfs" bash tar gzip grep sed mkdir chmod chown rm cp mv touch env sleep \
        find tee wc ln dirname basename mktemp setpriv setsid mkfifo uname date
    umoci repack --image "$L:shell" "$W/b7"
    umoci config --image "$L:shell" --config.env PATH=/usr/local/bin:/usr/bin:/bin \
        --config.label fixture=shell

    # tamper: its own random layer.
    mkdir -p "$W/l4/rand"
    head -c 1048576 /dev/urandom >"$W/l4/rand/bytes"
    tar --numeric-owner --owner=0 --group=0 -C "$W/l4" -cf "$W/l4.tar" rand
    umoci config --image "$L:base" --tag tamper --config.label fixture=tamper
    umoci raw add-layer --image "$L:tamper" "$W/l4.tar"

    # resume: a small layer and a big (incompressible) one.
    mkdir -p "$W/l5/small" "$W/l6/big"
    echo small >"$W/l5/small/file"
    head -c 8388608 /dev/urandom >"$W/l6/big/bytes"
    tar --numeric-owner --owner=0 --group=0 -C "$W/l5" -cf "$W/l5.tar" small
    tar --numeric-owner --owner=0 --group=0 -C "$W/l6" -cf "$W/l6.tar" big
    umoci config --image "$L:base" --tag resume --config.label fixture=resume
    umoci raw add-layer --image "$L:resume" "$W/l5.tar"
    umoci raw add-layer --image "$L:resume" "$W/l6.tar"

    # multi: two platforms of base, then an index of them by buildah.
    umoci config --image "$L:base" --tag multi-amd64 --architecture amd64 --os linux \
        --config.label platform=amd64
    umoci config --image "$L:base" --tag multi-arm64 --architecture arm64 --os linux \
        --config.label platform=arm64
    umoci gc --layout "$L"
    local B=(buildah --root "$W/buildah/root" --runroot "$W/buildah/run" --storage-driver vfs)
    "${B[@]}" manifest create crab-multi >/dev/null
    "${B[@]}" manifest add --arch amd64 --os linux crab-multi "oci:$L:multi-amd64" >/dev/null
    "${B[@]}" manifest add --arch arm64 --os linux crab-multi "oci:$L:multi-arm64" >/dev/null
    "${B[@]}" manifest push --all --quiet crab-multi "oci:$W/multi:multi"
    "${B[@]}" rmi --all --force >/dev/null 2>&1 || true
    chmod -R u+w "$W/buildah" 2>/dev/null || true
    rm -rf "$W/buildah" "$W/b1" "$W/b2" "$W/b7" "$W/tree" "$W"/l[3-6] "$W"/l[3-6].tar

    mkdir -p "$CACHE"
    find "$CACHE" -mindepth 1 -maxdepth 1 ! -name "$HASH*" -exec rm -rf {} +
    rm -rf "$OUT"
    mv "$W" "$OUT"
    touch "$OUT/done"
}

# One builder at a time per cache (tests run in parallel threads and processes).
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
[[ -f "$OUT/done" ]] || build >&2

case $CMD in
    build) ;;
    push)
        [[ $# -ge 3 ]] || usage
        REG=$3
        for t in "${TAGS[@]}"; do
            skopeo copy --quiet --dest-tls-verify=false "oci:$OUT/layout:$t" "docker://$REG/$t:1" >&2
        done
        skopeo copy --quiet --all --dest-tls-verify=false "oci:$OUT/multi:multi" "docker://$REG/multi:1" >&2
        ;;
    *) usage ;;
esac
echo "$OUT"
