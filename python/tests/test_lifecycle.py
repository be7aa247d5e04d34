"""A sandbox's life through the SDK is the host's (issue 27): pause and resume, the cheap
status, a deadline set from the SDK fired by the daemon's one watchdog (the same as one set
through E2B or the CLI), and the conflicts of impossible steps — sync and asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

import crab_sandbox as cs
from crab_sandbox import AsyncSandbox, Daemon, Sandbox

from conftest import Cleanup, unique


def wait_for(f, secs: float) -> bool:
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if f():
            return True
        time.sleep(0.2)
    return False


def test_pause_resume_and_conflicts(sandbox: Sandbox) -> None:
    sandbox.exec("echo kept > /tmp/f; nohup sleep 1000 >/dev/null 2>&1 &")
    assert sandbox.status() == "running"
    with pytest.raises(cs.ConflictError):
        sandbox.resume()
    point = sandbox.pause()
    assert sandbox.status() == "paused"
    assert sandbox.info().state == "paused" and sandbox.info().raw["pause_point"] == point
    with pytest.raises(cs.ConflictError):
        sandbox.pause()
    with pytest.raises(cs.CrabError):
        sandbox.exec("true")
    assert sandbox.resume() == point
    assert sandbox.status() == "running"
    assert sandbox.exec("cat /tmp/f").stdout == "kept\n"
    assert "sleep 1000" in sandbox.exec("ps -eo args").stdout


def test_a_deadline_from_the_sdk_fires(daemon: Daemon, cleanup: Cleanup) -> None:
    sb = Sandbox.create(
        "debian",
        name=unique("py-ttl"),
        timeout=2,
        on_timeout="pause",
        labels={"suite": "py"},
        envs={"FROM_SDK": "yes"},
        daemon=daemon,
    )
    cleanup.add(sb)
    info = sb.info().raw
    assert info["deadline"]["on"] == "pause" and info["labels"] == {"suite": "py"}
    assert sb.exec("echo $FROM_SDK").stdout == "yes\n"
    assert wait_for(lambda: sb.status() == "paused", 15), sb.info().raw
    sb.resume(timeout=3600)
    assert sb.info().raw["deadline"]["on"] == "pause"
    # Later: kill at the deadline (the sandbox is removed: it holds no labelled point).
    sb.set_timeout(1, on_timeout="kill")
    assert wait_for(lambda: sb.name not in [s.name for s in daemon.sandboxes()], 15)
    with pytest.raises(ValueError):
        Sandbox.create("debian", timeout=5, on_timeout="stop", daemon=daemon)


def test_async_pause_resume(daemon: Daemon, cleanup: Cleanup) -> None:
    async def go() -> None:
        sb = await AsyncSandbox.create("debian", name=unique("py-apause"), socket=daemon.socket)
        cleanup.add(Sandbox.connect(sb.name, daemon=daemon))
        await sb.exec("echo a > /tmp/f")
        await sb.pause()
        assert await sb.status() == "paused"
        await sb.resume(timeout=60)
        assert (await sb.exec("cat /tmp/f")).stdout == "a\n"

    asyncio.run(go())
