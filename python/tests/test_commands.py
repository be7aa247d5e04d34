"""``sb.commands`` against a real daemon: foreground results, background handles (wait,
iterate, stdin, kill), list, connect with replay, a process kept by a checkpoint and back
after a restore, and the asyncio twin."""

from __future__ import annotations

import asyncio

import pytest

import crab_sandbox as cs
from crab_sandbox import AsyncDaemon, AsyncSandbox, Daemon, Sandbox

from conftest import unique


def test_foreground_run(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo $A; echo e >&2; exit 3", envs={"A": "1"}, cwd="/tmp")
    assert (r.stdout, r.stderr, r.exit_code) == ("1\n", "e\n", 3)
    sandbox.exec("useradd -m pyuser 2>/dev/null || true")
    r = sandbox.commands.run("id -un; echo $B", user="pyuser", envs={"B": "2"})
    assert r.stdout == "pyuser\n2\n"
    with pytest.raises(cs.CommandTimeoutError):
        sandbox.commands.run("sleep 30", timeout=0.5)
    # The existing exec keeps working alongside.
    assert sandbox.exec("echo still").stdout == "still\n"


def test_background_handle(sandbox: Sandbox) -> None:
    h = sandbox.commands.run(
        "echo one; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo two >&2; exit 4",
        background=True,
        tag="bg1",
    )
    assert len(h.pid) == 16
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert listed[h.pid].running and listed[h.pid].tag == "bg1"
    first = next(iter(h))
    assert (first.kind, first.text) == ("stdout", "one\n")
    # Another handle replays from the start.
    again = sandbox.commands.connect(h.pid)
    assert again.output().stdout == "one\n"
    with pytest.raises(cs.CommandTimeoutError):
        h.wait(timeout=0.5)
    sandbox.exec("touch /tmp/go")
    seen = []
    r = h.wait(on_stderr=seen.append)
    assert (r.stdout, r.stderr, r.exit_code) == ("one\n", "two\n", 4)
    assert seen == ["two\n"]
    assert not sandbox.commands.list()[0].running
    assert sandbox.commands.connect(h.pid).wait().exit_code == 4
    with pytest.raises(cs.ProcessNotFoundError):
        sandbox.commands.connect("0123456789abcdef")


def test_stdin_and_kill(sandbox: Sandbox) -> None:
    h = sandbox.commands.run("read a; echo got $a; cat; echo end", background=True, stdin=True)
    h.send_stdin("hello\n")
    sandbox.commands.send_stdin(h.pid, b"more\n")
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "got hello\nmore\nend\n"
    k = sandbox.commands.run(["sleep", "1000"], background=True)
    assert sandbox.commands.kill(k.pid)
    assert k.wait().exit_code == 137
    assert not sandbox.commands.kill(k.pid), "an ended process was killed again"


def test_background_process_survives_restore(sandbox: Sandbox) -> None:
    if not sandbox.restores_processes:
        pytest.skip("this daemon keeps files only")
    h = sandbox.commands.run("echo up; while [ ! -e /tmp/go ]; do sleep 0.05; done; exit 6", background=True)
    assert next(iter(h)).text == "up\n"
    p = sandbox.checkpoint(kind="full")
    sandbox.exec("touch /tmp/go")
    assert h.wait().exit_code == 6
    sandbox.restore(p)
    back = sandbox.commands.connect(h.pid)
    assert back.info().running
    sandbox.exec("touch /tmp/go")
    r = back.wait()
    assert (r.stdout, r.exit_code) == ("up\n", 6)


def test_async_commands(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncDaemon(daemon.socket) as d:
            async with await AsyncSandbox.create("debian", name=unique("pyc"), daemon=d) as sb:
                r = await sb.commands.run("echo fg")
                assert r.stdout == "fg\n"
                h = await sb.commands.run("read x; echo got $x", background=True, stdin=True)
                assert [p.pid for p in await sb.commands.list()] == [h.pid]
                await h.send_stdin("y\n")
                r = await h.wait()
                assert (r.stdout, r.exit_code) == ("got y\n", 0)
                k = await sb.commands.run("sleep 1000", background=True)
                with pytest.raises(cs.CommandTimeoutError):
                    await k.wait(timeout=0.3)
                assert await sb.commands.kill(k.pid)
                assert (await (await sb.commands.connect(k.pid)).wait()).exit_code == 137

    asyncio.run(main())
