#!/usr/bin/env bash
# install-criu.sh — install CRIU 4.2.1 into the private prefix /opt/crab/criu.
#
# Why: Debian 12's criu 3.17 fails on our kernels (vdso layout) and 4.1.1 cannot
# dump inet sockets on kernels >= 6.16; Debian forky/sid's `criu 4.2.1-1` works
# (see /work/shared/DESIGN.md, "Facts about the machines here").
#
# How (nothing outside the two prefixes is changed — /etc/apt, the system's
# dpkg database and the system's apt lists/cache are never written):
#   * a private apt setup in /opt/crab/criu-apt: its own apt.conf (loaded via
#     APT_CONFIG; it inherits only the host's Acquire::* network settings such
#     as proxies and Check-Valid-Until), its own sources.list for Debian's
#     archive, empty sources.list.d / apt.conf.d / preferences.d, its own lists
#     and cache and an empty dpkg status file, APT::Sandbox::User=root;
#   * `apt-get download` of exactly the package=version pins in
#     scripts/criu-packages.lock (the dependency closure of criu);
#   * `dpkg -x` of every .deb into /opt/crab/criu/root;
#   * a copy of usr/sbin/criu patched with patchelf to use the private ld.so and
#     libraries (DT_RPATH, so it covers the whole library tree) at
#     /opt/crab/criu/bin/criu.
# The install is built in a temp dir next to the prefix, verified there
# (`criu --version`, `criu check` → "Looks good.", an RPC round trip through
# `criu swrk`), and only then renamed into place with a stamp file naming the
# lock's hash — an interrupted run never leaves a half install that looks done.
#
# Idempotent: if /opt/crab/criu/bin/criu reports 4.2.1 and the stamp matches the
# lock, it exits immediately.
# Measured here (2 cores, kernel 6.18, the host's configured Debian archive): cold (no /opt/crab at
# all) 2.5-4 s, most of it `apt-get update` of forky's Packages index (~10 MB);
# reinstall with cached lists/debs ≈ 1.7 s; warm no-op ≈ 10 ms.
# Disk: 30 MB in /opt/crab/criu + ~30 MB in /opt/crab/criu-apt (lists + .debs).
#
# Usage:
#   scripts/install-criu.sh                 install from the lock (needs root)
#   scripts/install-criu.sh --refresh-lock  re-resolve the closure against the
#       archive, rewrite scripts/criu-packages.lock, then install from it
#   scripts/install-criu.sh --force         reinstall even if up to date
# Environment (rarely needed):
#   CRAB_CRIU_PREFIX   (default /opt/crab/criu)
#   CRAB_CRIU_APT_DIR  (default <prefix>-apt)
#   CRAB_CRIU_SUITE    suite used by --refresh-lock (default forky; sid also works)
#   CRAB_DEBIAN_MIRROR (default: the Debian archive in the host's own apt sources,
#                       as `apt-get indextargets` lists it)
set -euo pipefail

CRIU_VERSION=4.2.1
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOCK_FILE="$SCRIPT_DIR/criu-packages.lock"
PREFIX=${CRAB_CRIU_PREFIX:-/opt/crab/criu}
PREFIX=${PREFIX%/}
APT_DIR=${CRAB_CRIU_APT_DIR:-$PREFIX-apt}
# The Debian archive: the host's own apt configuration decides (both sources.list styles, via
# apt itself), preferring the repository that serves the host's bookworm suite.
host_debian_mirror() {
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' 2>/dev/null | awk '
        $3 != "deb" || $1 !~ /^https?:\/\// { next }
        { sub(/\/$/, "", $1) }
        $2 == "bookworm" { print $1; found = 1; exit }
        !any && $2 ~ /^(bullseye|trixie|forky|sid|oldstable|stable|testing|unstable)$/ { any = $1 }
        END { if (!found && any) print any }'
}
MIRROR=${CRAB_DEBIAN_MIRROR:-$(host_debian_mirror)}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
LIBDIR_REL=usr/lib/x86_64-linux-gnu

REFRESH=0
FORCE=0
for arg in "$@"; do
    case "$arg" in
    --refresh-lock) REFRESH=1 ;;
    --force) FORCE=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "criu: ERROR: unknown argument '$arg' (try --help)" >&2
        exit 2
        ;;
    esac
done

T0=$EPOCHREALTIME
elapsed() { # seconds since start, one decimal
    awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'
}
step() { echo "criu: $*"; }
die() {
    echo "criu: ERROR: $*" >&2
    exit 1
}

lock_hash() { sha256sum "$LOCK_FILE" | cut -c1-64; }
stamp_text() { echo "criu $CRIU_VERSION lock-sha256 $(lock_hash) prefix $PREFIX"; }

# Fast path: already installed from this very lock.
is_installed() {
    [[ -x "$PREFIX/bin/criu" && -f "$PREFIX/.crab-stamp" && -f "$LOCK_FILE" ]] || return 1
    [[ "$(<"$PREFIX/.crab-stamp")" == "$(stamp_text)" ]] || return 1
    [[ "$("$PREFIX/bin/criu" --version 2>/dev/null | head -n 1)" == "Version: $CRIU_VERSION" ]]
}
if ((!REFRESH && !FORCE)) && is_installed; then
    step "CRIU $CRIU_VERSION already installed at $PREFIX/bin/criu"
    exit 0
fi

# ---------------------------------------------------------------- preflight
((EUID == 0)) || die "must run as root (it writes $PREFIX and runs 'criu check'): sudo $0 $*"
[[ "$(uname -m)" == x86_64 ]] || die "only x86_64 is supported (this is $(uname -m))"
for tool in apt-get apt-cache apt-config dpkg dpkg-deb patchelf flock sha256sum python3 gpgv; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "'$tool' not found; run scripts/install-deps.sh first"
done
[[ -r "$KEYRING" ]] || die "$KEYRING missing; run scripts/install-deps.sh (package debian-archive-keyring)"
if ((!REFRESH)) && [[ ! -f "$LOCK_FILE" ]]; then
    die "$LOCK_FILE missing; create it with: sudo $0 --refresh-lock"
fi

mkdir -p "$(dirname "$PREFIX")" "$APT_DIR"
# One installer at a time (the lock lives next to the prefix, not in it).
exec 9>"$(dirname "$PREFIX")/.$(basename "$PREFIX").install-lock"
flock 9
if ((!REFRESH && !FORCE)) && is_installed; then # someone else just finished
    step "CRIU $CRIU_VERSION already installed at $PREFIX/bin/criu"
    exit 0
fi
# Leftovers of an interrupted run (we hold the lock, so nobody else owns them).
rm -rf "$(dirname "$PREFIX")/.$(basename "$PREFIX").stage."* "$PREFIX.old."*

LOG="$APT_DIR/install.log"
: >"$LOG"
# Run a command with its output in the log; on failure show the log's tail.
run() {
    echo "+ $*" >>"$LOG"
    if ! "$@" >>"$LOG" 2>&1; then
        echo "criu: ERROR: '$*' failed; last lines of $LOG:" >&2
        tail -n 15 "$LOG" | sed 's/^/    /' >&2
        return 1
    fi
}

# ------------------------------------------------- private apt configuration
if ((REFRESH)); then
    SUITE=${CRAB_CRIU_SUITE:-forky}
else
    SUITE=$(sed -n 's/^suite: *//p' "$LOCK_FILE")
    [[ -n "$SUITE" ]] || die "$LOCK_FILE has no 'suite:' line; regenerate it with: sudo $0 --refresh-lock"
fi

write_apt_config() {
    local etc="$APT_DIR/etc"
    [[ -n "$MIRROR" ]] || die "no Debian archive in this host's apt sources (apt-get indextargets lists no deb repository for a Debian suite); add one to /etc/apt/sources.list(.d) or set CRAB_DEBIAN_MIRROR"
    mkdir -p "$etc/sources.list.d" "$etc/apt.conf.d" "$etc/preferences.d" "$etc/trusted.gpg.d" \
        "$APT_DIR/state/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/log" "$APT_DIR/debs"
    [[ -f "$APT_DIR/state/status" ]] || : >"$APT_DIR/state/status"
    echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$etc/sources.list"
    {
        echo "// Generated by scripts/install-criu.sh — private apt setup for the CRIU prefix."
        echo "// Host network settings (Acquire::*, e.g. proxies, Check-Valid-Until):"
        # The host's config is read with APT_CONFIG unset; index targets (DEP-11
        # etc.) and all hooks (APT::Update::Post-Invoke…, DPkg::…) stay behind.
        env -u APT_CONFIG apt-config dump 2>/dev/null |
            grep -E '^Acquire::' | grep -vE '^Acquire::IndexTargets' || true
        cat <<EOF
// Private locations: nothing under /etc/apt, /var/lib/apt, /var/lib/dpkg or /var/cache/apt is used.
Dir::Etc::main "/dev/null";
Dir::Etc::Parts "$etc/apt.conf.d";
Dir::Etc::SourceList "$etc/sources.list";
Dir::Etc::SourceParts "$etc/sources.list.d";
Dir::Etc::Preferences "$etc/preferences";
Dir::Etc::PreferencesParts "$etc/preferences.d";
Dir::Etc::Trusted "$etc/trusted.gpg";
Dir::Etc::TrustedParts "$etc/trusted.gpg.d";
Dir::State "$APT_DIR/state";
Dir::State::Lists "$APT_DIR/state/lists";
Dir::State::status "$APT_DIR/state/status";
Dir::Cache "$APT_DIR/cache";
Dir::Cache::srcpkgcache "";
Dir::Log "$APT_DIR/log";
APT::Sandbox::User "root";
APT::Install-Recommends "false";
Acquire::Languages "none";
EOF
    } >"$etc/apt.conf"
    export APT_CONFIG="$etc/apt.conf"
}

apt_update() {
    step "apt-get update (Debian $SUITE, private lists in $APT_DIR)"
    if ! run apt-get -q update; then
        grep -q 'is expired' "$LOG" &&
            die "the mirror's $SUITE Release file is expired (a frozen/snapshot mirror?). If that is expected here, add
    Acquire::Check-Valid-Until \"false\"; to a file in /etc/apt/apt.conf.d/ (this script inherits the host's Acquire::* settings)"
        die "apt-get update for $MIRROR $SUITE failed (network? mirror reachable? CRAB_DEBIAN_MIRROR to use another); see $LOG"
    fi
    UPDATED=1
}

# ------------------------------------------------------------- lock refresh
refresh_lock() {
    apt_update
    local cand
    cand=$(apt-cache policy criu | sed -n 's/^ *Candidate: *//p')
    [[ "$cand" == "$CRIU_VERSION"-* ]] ||
        die "Debian $SUITE has criu '${cand:-none}', not $CRIU_VERSION-*; try CRAB_CRIU_SUITE=sid (or forky), or test the new version and update CRIU_VERSION in $0"
    local pkgs
    mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances criu 2>>"$LOG" | grep -E '^[a-z0-9]' | sort -u)
    ((${#pkgs[@]} > 0)) || die "could not compute the dependency closure of criu; see $LOG"
    local tmp="$LOCK_FILE.tmp.$$"
    {
        echo "# Package pins for the private CRIU install (scripts/install-criu.sh)."
        echo "# Generated by 'scripts/install-criu.sh --refresh-lock' on $(date -u +%Y-%m-%dT%H:%MZ); do not edit."
        echo "# Closure: apt-cache depends --recurse --no-recommends --no-suggests ... criu"
        echo "suite: $SUITE"
        apt-cache show --no-all-versions "${pkgs[@]}" 2>>"$LOG" |
            awk '/^Package: /{p=$2} /^Version: /{print p "=" $2}' | sort -u
    } >"$tmp"
    local n
    n=$(grep -cE '^[a-z0-9][^=]*=' "$tmp" || true)
    ((n == ${#pkgs[@]})) || {
        rm -f "$tmp"
        die "closure has ${#pkgs[@]} packages but only $n versions resolved; see $LOG"
    }
    mv "$tmp" "$LOCK_FILE"
    step "wrote $LOCK_FILE ($n packages from $SUITE); test, then commit it"
}

# ------------------------------------------------------------------ install
write_apt_config
UPDATED=0
if ((REFRESH)); then
    refresh_lock
fi

mapfile -t PINS < <(grep -E '^[a-z0-9][^=]*=' "$LOCK_FILE")
((${#PINS[@]} > 0)) || die "$LOCK_FILE lists no packages; regenerate it with: sudo $0 --refresh-lock"
grep -qE '^criu='"$CRIU_VERSION"'-' "$LOCK_FILE" ||
    die "$LOCK_FILE does not pin criu=$CRIU_VERSION-*; regenerate it with: sudo $0 --refresh-lock"

vanished() { # pins the current lists do not have (apt-cache show exits 0 even then)
    local have
    have=$(apt-cache show --no-all-versions "${PINS[@]}" 2>/dev/null |
        awk '/^Package: /{p=$2} /^Version: /{print p "=" $2}')
    printf '%s\n' "${PINS[@]}" | grep -vxF -f <(printf '%s\n' "$have") || true
}
pins_known() { [[ -z "$(vanished)" ]]; }
report_vanished() {
    local gone
    gone=$(vanished | tr '\n' ' ')
    die "pinned package version(s) no longer in Debian $SUITE at $MIRROR: ${gone:-(download failed, see $LOG)}
    The archive moved on. Refresh the lock (re-resolves the closure, then installs and verifies it):
        sudo $0 --refresh-lock
    then commit scripts/criu-packages.lock."
}

if ! pins_known; then
    ((UPDATED)) || apt_update
    pins_known || report_vanished
fi

step "downloading ${#PINS[@]} pinned packages"
# The .deb cache survives reinstalls; apt-get download skips files it already has.
cd "$APT_DIR/debs"
if ! run apt-get -q download "${PINS[@]}"; then
    ((UPDATED)) && report_vanished
    apt_update # stale lists pointing at files the mirror has dropped
    pins_known || report_vanished
    run apt-get -q download "${PINS[@]}" || report_vanished
fi
# Map pins to files by their control fields (file names escape epochs).
declare -A DEB_OF=()
for f in *.deb; do
    # shellcheck disable=SC2016 # ${Package} is a dpkg-deb format field
    key=$(dpkg-deb --show --showformat='${Package}=${Version}' "$f" 2>/dev/null) || {
        rm -f "$f"
        continue
    }
    DEB_OF[$key]=$f
done
DEBS=()
for p in "${PINS[@]}"; do
    [[ -n "${DEB_OF[$p]:-}" ]] || die "downloaded files do not include $p; see $LOG"
    DEBS+=("$APT_DIR/debs/${DEB_OF[$p]}")
done
for key in "${!DEB_OF[@]}"; do # drop cached debs the lock no longer wants
    printf '%s\n' "${PINS[@]}" | grep -qxF -- "$key" || rm -f "${DEB_OF[$key]}"
done
cd /

step "unpacking into a staging dir"
STAGE=$(mktemp -d "$(dirname "$PREFIX")/.$(basename "$PREFIX").stage.XXXXXX")
cleanup() { rm -rf "$STAGE" "$PREFIX.old.$$"; }
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
for deb in "${DEBS[@]}"; do
    run dpkg -x "$deb" "$STAGE/root" || die "dpkg -x $deb failed; see $LOG"
done
[[ -x "$STAGE/root/usr/sbin/criu" ]] || die "no usr/sbin/criu in the unpacked packages; is criu pinned in $LOCK_FILE?"
[[ -e "$STAGE/root/$LIBDIR_REL/ld-linux-x86-64.so.2" ]] || die "no private ld.so in the unpacked packages (libc6 missing from $LOCK_FILE?)"

# patch <binary> <root>: point the binary at <root>'s loader and libraries.
patch_criu() {
    run patchelf --set-interpreter "$2/$LIBDIR_REL/ld-linux-x86-64.so.2" \
        --force-rpath --set-rpath "$2/$LIBDIR_REL" "$1" || die "patchelf on $1 failed; see $LOG"
}
# verify <binary> <root>: right version, every library from <root>, criu check, swrk RPC.
verify_criu() {
    local bin=$1 root=$2 out
    out=$("$bin" --version 2>&1 | head -n 1) || true
    [[ "$out" == "Version: $CRIU_VERSION" ]] || die "$bin --version says '$out', expected 'Version: $CRIU_VERSION'"
    out=$(LD_TRACE_LOADED_OBJECTS=1 "$bin" 2>&1 | grep '=>' | grep -v "=> $root/" || true)
    [[ -z "$out" ]] || die "$bin resolves libraries outside $root (a package is missing from $LOCK_FILE?):
$out"
    out=$("$bin" check 2>&1) || true
    grep -q '^Looks good' <<<"$out" || die "'$bin check' did not say 'Looks good':
$out"
    python3 - "$bin" <<'PY' || die "'$bin swrk' RPC round trip failed (see message above)"
import socket, subprocess, sys
# criu_req{type=VERSION(10)} -> expect criu_resp{type=VERSION, success=true, ...}
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
p = subprocess.Popen([sys.argv[1], "swrk", str(b.fileno())], pass_fds=[b.fileno()])
b.close()
a.settimeout(10)
a.send(b"\x08\x0a")
resp = a.recv(4096)
a.close()
p.wait(timeout=10)
if not resp.startswith(b"\x08\x0a\x10\x01"):
    sys.exit("criu swrk answered %r to a VERSION request" % resp)
PY
}

step "patching and verifying (criu check, criu swrk)"
mkdir -p "$STAGE/bin"
cp "$STAGE/root/usr/sbin/criu" "$STAGE/bin/criu.staged"
patch_criu "$STAGE/bin/criu.staged" "$STAGE/root"
verify_criu "$STAGE/bin/criu.staged" "$STAGE/root"
rm -f "$STAGE/bin/criu.staged"
cp "$STAGE/root/usr/sbin/criu" "$STAGE/bin/criu"
patch_criu "$STAGE/bin/criu" "$PREFIX/root"
cp "$LOCK_FILE" "$STAGE/criu-packages.lock"
stamp_text >"$STAGE/.crab-stamp" # written last: marks the stage complete
chmod 755 "$STAGE"

# Swap into place. Between the two renames there is no $PREFIX at all, so a
# crash there leads to a clean reinstall, never to a half install.
if [[ -e "$PREFIX" ]]; then
    mv "$PREFIX" "$PREFIX.old.$$"
fi
mv "$STAGE" "$PREFIX"
rm -rf "$PREFIX.old.$$"

out=$("$PREFIX/bin/criu" --version 2>&1 | head -n 1) || true
if [[ "$out" != "Version: $CRIU_VERSION" ]]; then
    rm -f "$PREFIX/.crab-stamp"
    die "$PREFIX/bin/criu does not run after the move ('$out'); see $LOG"
fi
# The binary package cache (~45 MB) is rebuilt on demand; keep only lists + debs.
rm -f "$APT_DIR/cache/pkgcache.bin" "$APT_DIR/cache/srcpkgcache.bin"
size=$(du -sm "$PREFIX" | cut -f1)
step "installed CRIU $CRIU_VERSION at $PREFIX/bin/criu (${#PINS[@]} packages from $SUITE, ${size} MB) in $(elapsed) s"
