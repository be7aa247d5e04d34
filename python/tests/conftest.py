"""Test support: a real Crab daemon (the one on ``$CRAB_STATE_DIR``, started from ``$CRAB_BIN``
when none answers) and sandboxes that are removed when a test ends, pass or fail.

The tests need root, a daemon and the ``debian`` image. When they cannot run they skip — unless
``CRAB_REQUIRE_PRIVILEGED=1`` (``make test``, CI), which turns every such skip into a failure.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "src"))

import crab_sandbox  # noqa: E402
from crab_sandbox import Daemon, Sandbox  # noqa: E402


def must_run() -> bool:
    return os.environ.get("CRAB_REQUIRE_PRIVILEGED") == "1"


def cannot_run(why: str) -> None:
    if must_run():
        pytest.fail(f"cannot run, and CRAB_REQUIRE_PRIVILEGED=1 says it must: {why}", pytrace=False)
    pytest.skip(why)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def state_dir() -> str:
    return os.environ.get("CRAB_STATE_DIR") or "/var/lib/crab"


def crab_bin() -> str:
    return os.environ.get("CRAB_BIN") or str(ROOT / "target" / "debug" / "crab")


def _up(d: Daemon) -> bool:
    try:
        d.version()
        return True
    except crab_sandbox.DaemonUnavailableError:
        return False


def start_daemon(state: str, *extra: str) -> None:
    """Start ``crab daemon`` on ``state`` (detached, logging to its logs/daemon.log).

    Only the main test daemon serves the E2B API (``make test`` exports CRAB_E2B_LISTEN for
    it): a second daemon must not try to bind the same address, so it gets no E2B variables.
    """
    os.makedirs(os.path.join(state, "logs"), exist_ok=True)
    log = open(os.path.join(state, "logs", "daemon.log"), "ab")
    env = dict(os.environ)
    if state != state_dir():
        env.pop("CRAB_E2B_LISTEN", None)
        env.pop("CRAB_E2B_KEYS", None)
    subprocess.Popen(
        ["setsid", "-f", crab_bin(), "daemon", "--state-dir", state, *extra],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        close_fds=True,
    ).wait()


def wait_up(d: Daemon, secs: float = 30.0) -> bool:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if _up(d):
            return True
        time.sleep(0.05)
    return _up(d)


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        cannot_run("needs root (the daemon's socket is root-only)")
    d = Daemon(os.path.join(state_dir(), "crab.sock"))
    if not _up(d):
        if not os.path.exists(crab_bin()):
            cannot_run(f"no daemon on {state_dir()} and no crab binary at {crab_bin()} (set CRAB_BIN)")
        start_daemon(state_dir())
        if not wait_up(d):
            cannot_run(f"the daemon on {state_dir()} did not come up; see {state_dir()}/logs/daemon.log")
    images = [i["name"] for i in d.request("GET", "/v1/images")]
    if "debian" not in images:
        cannot_run(f"no 'debian' image on {state_dir()}: run `crab image build debian`")
    yield d
    d.close()


class Cleanup:
    """Sandboxes to remove at the end of a test."""

    def __init__(self) -> None:
        self.sandboxes: List[Sandbox] = []

    def add(self, *sbs: Sandbox) -> None:
        self.sandboxes.extend(sbs)

    def run(self) -> None:
        for sb in self.sandboxes:
            try:
                sb.kill()
            except crab_sandbox.CrabError:
                pass


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    c = Cleanup()
    yield c
    c.run()


@pytest.fixture
def sandbox(daemon: Daemon, cleanup: Cleanup) -> Sandbox:
    sb = Sandbox.create("debian", name=unique("py"), daemon=daemon)
    cleanup.add(sb)
    return sb
