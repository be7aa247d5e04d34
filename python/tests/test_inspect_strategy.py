"""crab_sandbox.inspect.CrabSnapshotStrategy against a real daemon, driven in the Inspect
checkpointing core's call order by examples/inspect_snapshot_strategy.py: a committed
snapshot, an orphan, a retry into a fresh sandbox (setup → adopt → discard_orphans → restore).
Per kind: `full` gives back files and the running server; `fs` files only, a fresh init."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import pytest

from conftest import ROOT, Cleanup, unique

from crab_sandbox import AsyncDaemon, AsyncSandbox, CapabilityError, Daemon, InvalidRequestError, Sandbox
from crab_sandbox.inspect import CrabSnapshotStrategy


def example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("inspect_snapshot_strategy", ROOT / "examples" / "inspect_snapshot_strategy.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind", ["full", "fs"])
def test_resume_into_a_fresh_sandbox(daemon: Daemon, kind: str) -> None:
    before = {s.name for s in daemon.sandboxes()}
    rep = example().main(kind, socket=daemon.socket)
    assert rep["refs_adopted"] == [1, 2] and rep["refs_after_discard"] == [1], rep
    # Checkpoint 1's files, not the orphan's; the fresh sandbox's name now holds them.
    assert rep["notes"] == "step 1\n" and not rep["orphan_files_present"], rep
    if kind == "full":
        assert rep["point_kind"] == "full" and rep["restores_processes"], rep
        assert rep["server_running"], "a full snapshot did not bring the agent's server back"
    else:
        assert rep["point_kind"] == "fs" and not rep["restores_processes"], rep
        assert not rep["server_running"], "an fs snapshot is files only: no process should run"
    assert not rep["durable"]  # the test daemon has no --remote
    assert {s.name for s in daemon.sandboxes()} == before, "the example left sandboxes behind"


def test_fails_closed_and_refuses_foreign_refs(daemon: Daemon, cleanup: Cleanup, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sb = Sandbox.create("debian", name=unique("pyinsp"), daemon=daemon)
    cleanup.add(sb)
    ctx = SimpleNamespace(sandbox_name="default", storage_dir=str(tmp_path / "s"), resuming=False)

    async def go() -> None:
        async with AsyncDaemon(daemon.socket) as d:
            env = AsyncSandbox(sb.name, d)
            # durable=True on a daemon without a remote store: refused before anything is taken.
            with pytest.raises(CapabilityError) as e:
                await CrabSnapshotStrategy("fs", durable=True, daemon=d).setup(env, ctx)
            assert "--remote" in e.value.hint
            assert sb.points() == []
            with pytest.raises(InvalidRequestError):
                CrabSnapshotStrategy("bogus")
            s = CrabSnapshotStrategy("fs", daemon=d)
            with pytest.raises(InvalidRequestError):
                await s.setup(object(), ctx)  # not a Crab sandbox
            # A ref from another strategy is refused and leaves the sandbox alone.
            with pytest.raises(InvalidRequestError):
                await s.restore(env, {"snapshot_id": "abc", "strategy": "restic-incremental"}, ctx)
            assert (await env.info()).state == "running"
            # An object carrying the sandbox (as a Crab-backed Inspect environment would) works.
            await s.setup(SimpleNamespace(crab_sandbox=sb.name), ctx)

    asyncio.run(go())
