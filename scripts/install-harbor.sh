#!/usr/bin/env bash
# install-harbor.sh — the venv Harbor (PyPI `harbor`, the harness of Terminal-Bench 2) runs in
# for the tests and the benchmark of `--env crab_sandbox.harbor:CrabEnvironment`
# (python/tests/test_harbor.py, python/bench_harness.py), from PyPI with pip's own configuration.
#
# Harbor needs Python >= 3.12, newer than the SDK's venv (scripts/install-python-sdk.sh), so it
# has a venv of its own: ${CRAB_HARBOR_VENV:-/opt/crab/harbor/venv}, made with the first of
# $CRAB_PYTHON312, python3.13/python3.12 on PATH, or pyenv's newest 3.12/3.13. The Crab SDK is
# installed into it from this checkout (python/), editable, so it is the code under test.
# Prints the venv's python on its last line. Idempotent: a second run compares a stamp of the
# pins and the checkout's path (≈ 0.01 s).
set -euo pipefail

PINS=(harbor==0.26.0 httpx==0.28.1)
VENV=${CRAB_HARBOR_VENV:-/opt/crab/harbor/venv}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAMP=$VENV/.crab-pins
WANT="${PINS[*]} sdk=$ROOT/python"

if [[ -x "$VENV/bin/python" && "$(cat "$STAMP" 2>/dev/null)" == "$WANT" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

# A python >= 3.12 that runs (pyenv's shims exist for versions that are not selected).
find_python() {
    local root c
    root=$( (pyenv root 2>/dev/null) || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    for c in "${CRAB_PYTHON312:-}" $(command -v python3.13 python3.12 2>/dev/null) \
        $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -rV | sed 's|$|/bin/python3|'); do
        if [[ -n "$c" && -x "$c" ]] &&
            "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

if [[ ! -x "$VENV/bin/python" ]]; then
    PY=$(find_python) || {
        echo "install-harbor: Harbor needs Python >= 3.12 and none was found (set CRAB_PYTHON312, or install one with pyenv)" >&2
        exit 1
    }
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$ROOT/python" >&2
"$VENV/bin/python" -c 'import harbor, crab_sandbox.harbor' >&2
echo "$WANT" >"$STAMP"
echo "$VENV/bin/python"
