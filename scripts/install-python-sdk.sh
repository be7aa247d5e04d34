#!/usr/bin/env bash
# install-python-sdk.sh — the venv the Python SDK's tests (python/tests, `make test`) run in,
# from PyPI with pip's own configuration.
#
#   httpx    the SDK's one dependency (unix-socket HTTP)
#   pytest   the test runner
#   setuptools, wheel   the SDK's build backend, so a test can `pip install ./python` offline
#            from the venv (--no-build-isolation) and check what the package ships
#
# Installs into ${CRAB_PY_VENV:-/opt/crab/python-sdk/venv} and prints the venv's python on its
# last line. The SDK itself is not installed there: the tests import it from the checkout
# (python/src), so one venv serves every checkout. Idempotent: a second run only compares the
# stamp with the pins below (≈ 0.01 s). Needs python3 with the venv module
# (scripts/install-deps.sh). `--with-ray` adds the pinned Ray for the Ray integration tests.
set -euo pipefail

PINS=(httpx==0.28.1 pytest==9.2.0 setuptools==80.9.0 wheel==0.45.1)
RAY_PINS=(ray==2.60.0)
VENV=${CRAB_PY_VENV:-/opt/crab/python-sdk/venv}

want=("${PINS[@]}")
if [[ "${1:-}" == "--with-ray" ]]; then
    want+=("${RAY_PINS[@]}")
fi
STAMP=$VENV/.crab-pins
if [[ -x "$VENV/bin/python" && -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "${want[*]}" || "$(cat "$STAMP")" == "${want[*]} ${RAY_PINS[*]}" ]]; then
    echo "$VENV/bin/python"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${want[@]}" >&2
"$VENV/bin/python" -c 'import httpx, pytest' >&2
echo "${want[*]}" >"$STAMP"
echo "$VENV/bin/python"
