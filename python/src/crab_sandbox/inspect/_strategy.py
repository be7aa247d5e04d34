"""An Inspect-AI-shaped snapshot strategy: :class:`CrabSnapshotStrategy`.

Shaped after the ``SandboxSnapshotStrategy`` Protocol of Inspect AI's pluggable checkpoint
snapshots — the design ``design/checkpoint-snapshot-strategy.md`` and its Protocol in
``meridianlabs-ai/inspect_ai`` (proposed upstream as ``UKGovernmentBEIS/inspect_ai#4601``). That
Protocol is not in an ``inspect_ai`` release yet, so this module does not import ``inspect_ai``:
it has the Protocol's attribute and methods with the same arguments — ``name``,
``setup(env, ctx)``, ``snapshot(env, paths, checkpoint_id, ctx)``, ``restore(env, ref, ctx)``,
``adopt(prior, ctx)``, ``discard_orphans(latest_committed_id, ctx)``, plus the design's
``cleanup(ctx)`` — and reads only the fields it uses from the core's objects (``ctx``:
``sandbox_name``, ``storage_dir``, ``resuming``; ``prior``: ``sample_checkpoints_dir``,
``storage_subpath``; ``ref``: ``snapshot_id`` and the ``extra`` fields this strategy wrote).

``env`` is the sample's sandbox: a :class:`~crab_sandbox.AsyncSandbox` (or
:class:`~crab_sandbox.Sandbox`), or any object with a ``crab_sandbox`` attribute naming one
(:class:`crab_sandbox.inspect.CrabSandboxEnvironment`, Inspect's ``sandbox="crab"``, has it);
pass ``resolve=`` to map other objects.

**What each kind restores** (honest about the contract's §4.3, "captured paths byte-identical
in a fresh sandbox"):

* ``kind="fs"``: the sandbox's whole filesystem (a superset of ``paths``), owners and modes
  included; processes are not captured — the restored sandbox starts with a fresh init, as the
  Protocol expects.
* ``kind="full"``: the filesystem *and* every process (CRIU): open files, sockets, memory — a
  restored sample continues where the agent left it, servers and shells included. More than
  the contract asks; ``setup`` fails closed (:class:`~crab_sandbox.CapabilityError`) when the
  daemon's points cannot hold processes.
* ``kind="auto"``: Crab's inspector picks per checkpoint (``fs`` when no process changed state
  that matters, else ``process``/``full``); each ref records what it holds
  (``restores_processes``).

``restore`` *replaces* the fresh sandbox it is given: it removes that sandbox (which holds none
of the agent's state) and makes a new one under the same name from the point — from the
``--remote`` store when the point is durable (another host may restore it), else by a local fork
(the source sandbox must still be on this daemon). Nothing is injected into the sandbox (Crab
captures it from outside), so the Protocol's in-sandbox tooling and secret rules hold trivially.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .._async import AsyncDaemon, AsyncSandbox
from .._sync import Sandbox
from ..errors import CapabilityError, CheckpointNotFoundError, InvalidRequestError

__all__ = ["CrabSnapshotStrategy", "CrabSnapshotDetails"]

STRATEGY_NAME = "crab"
KINDS = ("auto", "fs", "full")


@dataclass(frozen=True)
class CrabSnapshotDetails:
    """What :meth:`CrabSnapshotStrategy.snapshot` returns, in the fields of Inspect's
    ``SnapshotDetails`` the design names: ``snapshot_id`` (opaque: ``SB@c7``), ``size_bytes``
    (bytes this point added), ``files`` (None: Crab does not list changed files), and the extra
    ``strategy`` field; plus what a harness needs to fail closed (``restores_processes``,
    ``durable``, ``kind``). ``to_dict()`` is the JSON the core can store (``extra="allow"``)."""

    snapshot_id: str
    size_bytes: int
    kind: str
    restores_processes: bool
    durable: bool
    checkpoint_id: int
    strategy: str = STRATEGY_NAME
    files: Optional[List[str]] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "strategy": self.strategy,
            "kind": self.kind,
            "restores_processes": self.restores_processes,
            "durable": self.durable,
            "checkpoint_id": self.checkpoint_id,
        }


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name``, else ``obj[name]``, else the ``extra``/``model_extra`` dicts' (a pydantic
    ``SnapshotDetails`` keeps unknown fields there)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    if hasattr(obj, name):
        return getattr(obj, name)
    for extra in ("model_extra", "extra"):
        d = getattr(obj, extra, None)
        if isinstance(d, dict) and name in d:
            return d[name]
    return default


class CrabSnapshotStrategy:
    """Crab restore points as an Inspect sandbox snapshot strategy (see the module docstring).

    Args:
        kind: ``fs`` (files; the Protocol's contract), ``full`` (files and processes) or
            ``auto`` (Crab's inspector decides per snapshot).
        durable: wait until each point is in the daemon's ``--remote`` store before
            ``snapshot`` returns (the Protocol's "durable before commit" across hosts). None:
            when the daemon has a store. True on a daemon without one: ``setup`` raises.
        resolve: maps the core's ``env`` to a Crab sandbox name (default: see the module).
        daemon: the :class:`~crab_sandbox.AsyncDaemon` (default: ``$CRAB_STATE_DIR``'s).
    """

    name = STRATEGY_NAME

    def __init__(
        self,
        kind: str = "fs",
        *,
        durable: Optional[bool] = None,
        resolve: Optional[Callable[[Any], str]] = None,
        daemon: Optional[AsyncDaemon] = None,
    ) -> None:
        if kind not in KINDS:
            raise InvalidRequestError(f"unknown snapshot kind {kind!r}", f"use one of {', '.join(KINDS)}")
        self.kind = kind
        self.durable = durable
        self._resolve = resolve
        self._daemon = daemon

    # --- plumbing -----------------------------------------------------------------------------

    def _d(self) -> AsyncDaemon:
        if self._daemon is None:
            self._daemon = AsyncDaemon()
        return self._daemon

    def _name_of(self, env: Any) -> str:
        if self._resolve is not None:
            return self._resolve(env)
        if isinstance(env, (AsyncSandbox, Sandbox)):
            return env.name
        inner = getattr(env, "crab_sandbox", None)
        if isinstance(inner, (AsyncSandbox, Sandbox)):
            return inner.name
        if isinstance(inner, str):
            return inner
        raise InvalidRequestError(
            f"cannot tell which Crab sandbox {type(env).__name__} is",
            "pass an AsyncSandbox, an object with a `crab_sandbox` attribute, or resolve=",
        )

    def _sb(self, env: Any) -> AsyncSandbox:
        return AsyncSandbox(self._name_of(env), self._d())

    @staticmethod
    def _ref_path(ctx: Any, checkpoint_id: int) -> Path:
        return Path(_field(ctx, "storage_dir")) / f"ckpt-{checkpoint_id:05d}.json"

    async def _durable(self) -> bool:
        caps = await self._d().capabilities()
        if self.durable is None:
            return caps.durable
        return self.durable

    # --- the Protocol's methods ---------------------------------------------------------------

    async def setup(self, env: Any, ctx: Any) -> None:
        """Fail closed on what the daemon cannot give; make the storage area. Nothing goes into
        the sandbox."""
        caps = await self._d().capabilities(refresh=True)
        if self.kind == "full" and not caps.restores_processes:
            raise CapabilityError(
                "kind='full' needs points that hold processes; this daemon's hold files only (no CRIU)",
                "use kind='fs', or install CRIU on the daemon's host (scripts/install-criu.sh)",
            )
        if self.durable and not caps.durable:
            raise CapabilityError(
                "durable=True, but this daemon has no remote store",
                "start every daemon with the same `crab daemon --remote URL`, or pass durable=None",
            )
        await self._sb(env).info()  # the sandbox exists (SandboxNotFoundError otherwise)
        Path(_field(ctx, "storage_dir")).mkdir(parents=True, exist_ok=True)

    async def snapshot(self, env: Any, paths: Any, checkpoint_id: int, ctx: Any) -> CrabSnapshotDetails:
        """A Crab restore point of the whole sandbox (``paths`` is covered: Crab captures the
        whole filesystem), durable first when configured; its ref is written to the storage
        area (``ckpt-NNNNN.json``) before returning."""
        sb = self._sb(env)
        durable = await self._durable()
        p = await sb.checkpoint(kind=self.kind, durable=durable)
        d = CrabSnapshotDetails(
            snapshot_id=f"{sb.name}@{p.id}",
            size_bytes=p.size_bytes,
            kind=p.kind,
            restores_processes=p.restores_processes,
            durable=durable,
            checkpoint_id=checkpoint_id,
        )
        ref = self._ref_path(ctx, checkpoint_id)
        tmp = ref.with_suffix(".tmp")
        tmp.write_text(json.dumps(d.to_dict()))
        os.replace(tmp, ref)  # a ref is there whole or not at all (interruption tolerance)
        return d

    async def restore(self, env: Any, ref: Any, ctx: Any) -> None:
        """Replace the fresh sandbox ``env`` names by one made from the snapshot ``ref``."""
        if ref is None:
            raise CheckpointNotFoundError(
                "restore() got no snapshot to restore", "the core passes the latest committed snapshot's details"
            )
        sid = _field(ref, "snapshot_id")
        if _field(ref, "strategy", STRATEGY_NAME) != STRATEGY_NAME or not isinstance(sid, str) or "@" not in sid:
            raise InvalidRequestError(
                f"snapshot {sid!r} was not written by the {STRATEGY_NAME!r} strategy",
                "resume with the strategy that took the sample's snapshots",
            )
        source, point = sid.split("@", 1)
        fs_only = not bool(_field(ref, "restores_processes", True))
        target = self._name_of(env)
        d = self._d()
        if _field(ref, "durable", False):
            pts = await d.request("GET", "/v1/remote/points", params={"sandbox": source})
            if not any(_field(r, "point") == point or _field(r, "id") == point for r in pts):
                raise CheckpointNotFoundError(
                    f"{sid} is not in the remote store", "check the daemon's --remote is the one the sample used"
                )
            # One host action under the target's lock: nothing of it is touched before the
            # point is fetched and checked.
            await d.request("POST", f"/v1/sandboxes/{target}/replace", {"source": sid, "remote": True, "fs_only": fs_only})
        else:
            src = AsyncSandbox(source, d)
            if point not in [p.id for p in await src.points()]:
                raise CheckpointNotFoundError(
                    f"{sid} is not on this daemon", "take durable snapshots (durable=True) to restore elsewhere"
                )
            await d.request("POST", f"/v1/sandboxes/{target}/replace", {"source": sid, "fs_only": fs_only})

    async def adopt(self, prior: Any, ctx: Any) -> None:
        """Copy the prior attempt's refs into this attempt's storage area. The points they name
        stay where they are (this daemon, or the shared ``--remote`` store when durable)."""
        base = str(_field(prior, "sample_checkpoints_dir"))
        if "://" in base:
            raise InvalidRequestError(
                f"adopting from {base} is not supported (local directories only)",
                "copy the prior attempt's storage area to a local directory first",
            )
        src = Path(base) / str(_field(prior, "storage_subpath"))
        dst = Path(_field(ctx, "storage_dir"))
        dst.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.glob("ckpt-*.json")):
            (dst / f.name).write_bytes(f.read_bytes())

    async def discard_orphans(self, latest_committed_id: int, ctx: Any) -> None:
        """Drop refs of snapshots after the latest committed checkpoint (their Crab points stay
        until ``crab checkpoints prune``)."""
        for f in Path(_field(ctx, "storage_dir")).glob("ckpt-*.json"):
            try:
                n = int(f.stem.split("-", 1)[1])
            except ValueError:
                continue
            if n > latest_committed_id:
                f.unlink()

    async def cleanup(self, ctx: Any) -> None:
        """Delete the storage area's refs (the design's eval-end ``retention="delete"``)."""
        for f in Path(_field(ctx, "storage_dir")).glob("ckpt-*.json"):
            f.unlink()

    def refs(self, ctx: Any) -> List[Dict[str, Any]]:
        """The refs in the storage area, oldest first."""
        out: List[Dict[str, Any]] = []
        for f in sorted(Path(_field(ctx, "storage_dir")).glob("ckpt-*.json")):
            out.append(json.loads(f.read_text()))
        return out

