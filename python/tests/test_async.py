"""The asyncio SDK against a real daemon: the same flows, awaited, and concurrency."""

from __future__ import annotations

import asyncio
import time

import pytest

import crab_sandbox as cs
from crab_sandbox import AsyncDaemon, AsyncSandbox, Daemon

from conftest import unique


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_async_flow(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncDaemon(daemon.socket) as d:
            async with await AsyncSandbox.create("debian", name=unique("pya"), daemon=d) as sb:
                r = await sb.exec("echo hi; exit 2", env={"X": "1"})
                assert (r.exit_code, r.stdout) == (2, "hi\n")
                seen = [ev.kind async for ev in sb.exec_stream("echo a; echo b >&2")]
                # Two pipes: their frames arrive in either order; the exit comes last.
                assert sorted(seen[:-1]) == ["stderr", "stdout"] and seen[-1] == "exit", seen
                await sb.write_file("/work/a", b"one")
                assert await sb.read_file("/work/a") == b"one"
                assert await sb.restores_processes()
                p = await sb.checkpoint(kind="fs")
                assert p.id in [q.id for q in await sb.points()]
                await sb.write_file("/work/a", b"two")
                rep = await sb.restore(p)
                assert rep.point == p.id and await sb.read_file("/work/a") == b"one"
                (br,) = await sb.fork(1, p)
                try:
                    assert await br.read_file("/work/a") == b"one"
                finally:
                    await br.kill()
                t = await sb.turn()
                assert t.checkpoint in [q.id for q in await sb.points()]
                assert (await sb.llm_base_url()).endswith(f"/s/{sb.name}/v1")
                with pytest.raises(cs.CommandTimeoutError):
                    await sb.exec("sleep 30", timeout=0.3)
                with pytest.raises(cs.CheckpointNotFoundError):
                    await sb.restore("c999999")
                name = sb.name
            with pytest.raises(cs.SandboxNotFoundError) as ei:
                await AsyncSandbox.connect(name, daemon=d)
            assert ei.value.hint

    run(main())


def test_async_execs_run_concurrently(daemon: Daemon) -> None:
    async def main() -> float:
        sb = await AsyncSandbox.create("debian", name=unique("pyc"), socket=daemon.socket)
        try:
            t0 = time.monotonic()
            rs = await asyncio.gather(*(sb.exec(f"sleep 1; echo {i}") for i in range(4)))
            dt = time.monotonic() - t0
            assert [r.stdout for r in rs] == [f"{i}\n" for i in range(4)]
            return dt
        finally:
            await sb.kill()

    dt = run(main())
    # Four 1 s sleeps in parallel: well under the 4 s they would take one after another.
    assert dt < 3.0, f"4 concurrent execs took {dt:.2f} s"


def test_async_daemon_unavailable() -> None:
    async def main() -> None:
        with pytest.raises(cs.DaemonUnavailableError):
            await AsyncSandbox.create("debian", socket="/nonexistent/crab.sock")

    run(main())
