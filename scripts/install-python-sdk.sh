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
# (scripts/install-deps.sh). Extras, in any combination:
#   --with-ray      the pinned Ray for the Ray integration tests (python/tests/test_ray.py)
#   --with-agents   the pinned mini-swe-agent, run for real through `crab docker`
#                   (python/tests/test_mini_swe_agent.py; ≈ 1 min and ≈ 700 MB the first time)
#   --with-inspect  the pinned Inspect AI, for the `sandbox="crab"` provider's tests
#                   (python/tests/test_inspect_provider.py: Inspect's own conformance checks
#                   and a mockllm eval)
set -euo pipefail

PINS=(httpx==0.28.1 pytest==9.2.0 setuptools==80.9.0 wheel==0.45.1)
RAY_PINS=(ray==2.60.0)
AGENT_PINS=(mini-swe-agent==2.4.6)
INSPECT_PINS=(inspect-ai==0.3.285)
VENV=${CRAB_PY_VENV:-/opt/crab/python-sdk/venv}

want=("${PINS[@]}")
for arg in "$@"; do
    case "$arg" in
        --with-ray) want+=("${RAY_PINS[@]}") ;;
        --with-agents) want+=("${AGENT_PINS[@]}") ;;
        --with-inspect) want+=("${INSPECT_PINS[@]}") ;;
        *) echo "usage: $0 [--with-ray] [--with-agents] [--with-inspect]" >&2; exit 2 ;;
    esac
done
STAMP=$VENV/.crab-pins
# The stamp lists every pin installed so far; nothing to do when it holds all of ours.
have=()
if [[ -x "$VENV/bin/python" && -f "$STAMP" ]]; then
    read -r -a have <"$STAMP" || true
fi
missing=0
for p in "${want[@]}"; do
    found=0
    for h in "${have[@]}"; do [[ "$h" == "$p" ]] && found=1 && break; done
    ((found)) || missing=1
done
if ((!missing)); then
    echo "$VENV/bin/python"
    exit 0
fi
# Keep what an earlier run installed (another extra), unless we pin that package differently.
for h in "${have[@]}"; do
    dup=0
    for p in "${want[@]}"; do [[ "${h%%==*}" == "${p%%==*}" ]] && dup=1 && break; done
    ((dup)) || want+=("$h")
done

mkdir -p "$(dirname "$VENV")"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${want[@]}" >&2
"$VENV/bin/python" -c 'import httpx, pytest' >&2
echo "${want[*]}" >"$STAMP"
echo "$VENV/bin/python"
