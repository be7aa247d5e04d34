#!/usr/bin/env bash
# install-deps.sh — install the Debian packages Crab needs to build and test.
#
# Idempotent and fast: one dpkg-query call decides whether anything is missing;
# when everything is installed it exits without touching apt (≈ 30-70 ms warm;
# ≈ 15 s cold on a fresh bookworm minbase chroot, 29 packages).
# Only when something is missing does it run `apt-get update` and
# `apt-get install --no-install-recommends` for exactly the missing packages.
# Non-interactive; needs root (or passwordless sudo) only when installing.
#
# CRIU is NOT installed from here (Debian 12's criu 3.17 does not work on the
# kernels we run); scripts/install-criu.sh puts CRIU 4.2.1 in /opt/crab/criu.
#
# Usage: scripts/install-deps.sh [--list]   (--list: print the package list)
set -euo pipefail

# One package per line, with why Crab needs it.
PACKAGES=(
    # eBPF inspector: BPF C programs are built by clang 14 via libbpf-cargo;
    # libbpf-sys builds libbpf and needs libelf + zlib + pkg-config.
    clang llvm libelf-dev zlib1g-dev pkg-config
    libbpf-dev   # <bpf/bpf_helpers.h> & co. for the BPF C sources
    bpftool      # `bpftool btf dump file /sys/kernel/btf/vmlinux format c` → vmlinux.h
    libseccomp-dev  # the default seccomp profile is compiled with libseccomp (crab-sandbox)
    # local tier: btrfs on a loop-mounted sparse file
    btrfs-progs util-linux kmod
    # CRIU private install (scripts/install-criu.sh)
    patchelf debian-archive-keyring gpgv
    # sandbox rootfs + networking (CRIU dumps need --network-lock nftables)
    debootstrap nftables iproute2
    # native builds
    make gcc libc6-dev
    # tools used by scripts and tests
    procps psmisc curl ca-certificates python3 python3-venv xz-utils zstd sqlite3
    # OCI images (issue 29): a loopback registry for tests (Debian's CNCF distribution
    # server), htpasswd for its basic-auth variant, and other tools that make and read images
    docker-registry apache2-utils skopeo umoci buildah
)

if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${PACKAGES[@]}"
    exit 0
fi

# Which packages are not fully installed? dpkg-query prints a line for every
# known package and complains (stderr, exit 1) about unknown ones, so compare
# against the full list rather than trusting its exit status.
installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null \
    | awk '$2 == "install" && $3 == "ok" && $4 == "installed" { print $1 }' || true)
missing=()
for p in "${PACKAGES[@]}"; do
    if ! grep -qxF -- "$p" <<<"$installed"; then
        missing+=("$p")
    fi
done

if ((${#missing[@]} == 0)); then
    echo "deps: all ${#PACKAGES[@]} Debian packages present"
    exit 0
fi

SUDO=()
if ((EUID != 0)); then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "deps: ERROR: missing packages (${missing[*]}) and not root; re-run as root: sudo $0" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp /tmp/crab-install-deps.XXXXXX.log)
run() {
    if ! "${SUDO[@]}" "$@" >>"$log" 2>&1; then
        echo "deps: ERROR: '$*' failed; last lines of $log:" >&2
        tail -n 15 "$log" >&2
        echo "deps: fix the apt problem above (network? sources in /etc/apt?) and re-run $0" >&2
        exit 1
    fi
}

echo "deps: installing ${#missing[@]} missing package(s): ${missing[*]}"
run apt-get update -q
run apt-get install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"
rm -f "$log"
echo "deps: done"
