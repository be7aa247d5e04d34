"""Ray integration: :data:`CrabSandbox`, a Ray actor per sandbox, pinned to a node that runs a
Crab daemon and talking to that node's daemon over its socket.

A node offers Crab by a custom resource (``ray start --resources '{"crab": 100}'``, name in
:data:`NODE_RESOURCE`) and finds its daemon through the raylet's environment
(``CRAB_STATE_DIR=/var/lib/crab ray start ...``; workers inherit it). Give every daemon of the
cluster the same ``--remote`` store: branches and recoveries on another node are restored from
there, without the source node.

The actor has the method names of ``ray.experimental.sandbox``'s ``Sandbox`` — ``exec``,
``write_file``, ``read_file``, ``upload_file``, ``download_file``, ``get_status``, ``delete`` —
plus ``checkpoint``, ``restore``, ``points`` and ``fork``::

    import ray
    from crab_sandbox.ray import CrabSandbox, create, recover

    sb = create("debian")                                   # on some Crab node
    ray.get(sb.exec.remote("git clone ... /work/repo"))
    p = ray.get(sb.checkpoint.remote(durable=True))
    branches = ray.get(sb.fork.remote(8, p, spread=True))   # across the cluster's Crab nodes
    outs = ray.get([b.exec.remote(f"run-variant {i}") for i, b in enumerate(branches)])
    # the node of `sb` is lost:
    sb2 = CrabSandbox.recover(p.sandbox)                    # its newest durable point, elsewhere

Importing this module needs ``ray`` (``pip install ray``); the rest of the SDK does not.
"""

from __future__ import annotations

import secrets
from typing import Any, Dict, List, Optional, Sequence, Union

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("crab_sandbox.ray needs Ray: pip install ray") from e

from ._common import fresh_name
from ._sync import Daemon, Sandbox
from .errors import CapabilityError, CrabError, NotFoundError
from .models import ExecResult, Point, RestoreReport

__all__ = ["NODE_RESOURCE", "CrabSandbox", "crab_nodes", "create", "recover", "connect"]

#: The custom node resource a Crab node advertises.
NODE_RESOURCE = "crab"
#: How much of it one sandbox actor takes (so a node with ``{"crab": 100}`` runs 100 of them).
PER_SANDBOX = 1.0


def crab_nodes() -> List[str]:
    """Ids of the alive Ray nodes that run a Crab daemon (advertise :data:`NODE_RESOURCE`)."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE)]


def _pinned(node: str) -> Dict[str, Any]:
    return {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        "resources": {NODE_RESOURCE: PER_SANDBOX},
    }


def _branch_name(source: str) -> str:
    return fresh_name(source)


class _CrabSandboxActor:
    """The actor's body: one sandbox on this node's daemon."""

    def __init__(
        self,
        image: str = "debian",
        name: Optional[str] = None,
        *,
        attach: Optional[str] = None,
        from_remote: Optional[str] = None,
        fs_only: bool = False,
        socket: Optional[str] = None,
        memory: Union[None, int, str] = None,
        cpus: Optional[float] = None,
        network: str = "private",
    ) -> None:
        self._daemon = Daemon(socket)
        if attach is not None:
            self._sb = Sandbox.connect(attach, daemon=self._daemon)
        elif from_remote is not None:
            self._sb = Sandbox.from_remote(from_remote, name=name, fs_only=fs_only, daemon=self._daemon)
        else:
            self._sb = Sandbox.create(image, name=name, memory=memory, cpus=cpus, network=network, daemon=self._daemon)
        self._deleted = False

    # --- identity -----------------------------------------------------------------------------

    def name(self) -> str:
        return self._sb.name

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def socket(self) -> str:
        return self._daemon.socket

    # --- ray.experimental.sandbox's methods ---------------------------------------------------

    def exec(
        self,
        command: Union[str, Sequence[str]],
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> ExecResult:
        return self._sb.exec(command, cwd=cwd, env=env, timeout=timeout)

    def write_file(self, path: str, content: Union[str, bytes]) -> None:
        self._sb.write_file(path, content)

    def read_file(self, path: str) -> bytes:
        return self._sb.read_file(path)

    def upload_file(self, local_path: str, remote_path: str) -> None:
        """``local_path`` is on this actor's node."""
        self._sb.upload(local_path, remote_path)

    def download_file(self, remote_path: str, local_path: str) -> None:
        """``local_path`` is on this actor's node."""
        self._sb.download(remote_path, local_path)

    def get_status(self) -> str:
        """``running``, ``dead`` (its processes are gone; ``restore`` it) or ``deleted``."""
        if self._deleted:
            return "deleted"
        try:
            return self._sb.info().state
        except NotFoundError:
            return "deleted"

    def delete(self) -> None:
        """Remove the sandbox and its restore points (the actor stays until killed)."""
        if not self._deleted:
            try:
                self._sb.kill()
            except NotFoundError:
                pass
            self._deleted = True

    # --- Crab's -------------------------------------------------------------------------------

    def capabilities(self) -> Dict[str, bool]:
        return {"restores_processes": self._sb.restores_processes, "durable": self._sb.durable}

    def checkpoint(self, kind: str = "auto", durable: bool = False) -> Point:
        return self._sb.checkpoint(kind=kind, durable=durable)

    def points(self) -> List[Point]:
        return self._sb.points()

    def restore(self, point: Union[None, str, Point] = None) -> RestoreReport:
        return self._sb.restore(point)

    def fork_here(self, count: int, point: Union[None, str, Point] = None) -> List[str]:
        """Local fork on this node's daemon: the branches' names."""
        return [b.name for b in self._sb.fork(count, point)]

    def fork(self, count: int, point: Union[None, str, Point] = None, spread: bool = True) -> List[Any]:
        """``count`` branches from ``point`` (the newest when None), each its own actor.

        ``spread=False``: all on this node (a local fork). ``spread=True``: round-robin over the
        cluster's Crab nodes, other nodes first; branches elsewhere are restored from the remote
        store, so the point must be durable there (a point that is not yet is waited for; None
        takes a durable checkpoint now). Raises :class:`CapabilityError` when spreading is asked
        of a daemon without a remote store.
        """
        here = self.node_id()
        nodes = crab_nodes()
        others = [n for n in nodes if n != here]
        if not spread or not others:
            return [
                CrabSandbox.options(**_pinned(here)).remote(attach=n, socket=self._daemon.socket)
                for n in self.fork_here(count, point)
            ]
        if not self._sb.durable:
            raise CapabilityError(
                "fork(spread=True) needs the remote store: this node's daemon has none",
                "start every node's daemon with the same `--remote URL`, or pass spread=False",
            )
        if point is None:
            p = self._sb.checkpoint(durable=True)
        else:
            pid = point.id if isinstance(point, Point) else point
            p = self._sb.wait_durable(pid)
        order = others + [here]
        placement = [order[i % len(order)] for i in range(count)]
        local = self.fork_here(placement.count(here), p) if here in placement else []
        # One restore from the store per other node (the point's tree is materialized once
        # there, then forked locally into that node's share), all nodes at once.
        shares = {n: [_branch_name(self._sb.name) for _ in range(placement.count(n))] for n in others if n in placement}
        restored = dict(
            zip(
                shares,
                ray.get(
                    [
                        _restore_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(
                            p.ref, names
                        )
                        for n, names in shares.items()
                    ]
                ),
            )
        )
        handles = []
        for node in placement:
            if node == here:
                handles.append(CrabSandbox.options(**_pinned(here)).remote(attach=local.pop(0), socket=self._daemon.socket))
            else:
                handles.append(CrabSandbox.options(**_pinned(node)).remote(attach=restored[node].pop(0)))
        return handles


@ray.remote(num_cpus=0, max_retries=0)
def _restore_here(source: str, names: List[str], fs_only: bool = False) -> List[str]:
    """On the node it is pinned to: ``len(names)`` sandboxes from ``source`` in the remote store
    (one download and materialization, then local forks); their names."""
    v = Daemon().request(
        "POST", "/v1/remote/restore", {"source": source, "names": names, "count": len(names), "fs_only": fs_only}
    )
    return [str(b["sandbox"]) for b in v["branches"]]


#: The actor class. Every instance holds a slot of :data:`NODE_RESOURCE`; pin it with
#: :func:`create` (or ``CrabSandbox.options(**...)``).
CrabSandbox = ray.remote(num_cpus=0, max_restarts=0)(_CrabSandboxActor)


def create(image: str = "debian", name: Optional[str] = None, *, node: Optional[str] = None, **kw: Any) -> Any:
    """A :data:`CrabSandbox` actor with a new sandbox, on ``node`` (a node id) or any Crab node."""
    if node is None:
        nodes = crab_nodes()
        if not nodes:
            raise CrabError(
                "no alive Ray node advertises the 'crab' resource",
                "start Crab nodes with `CRAB_STATE_DIR=DIR ray start ... --resources '{\"crab\": 100}'`",
                code="host_unsupported",
            )
        node = nodes[secrets.randbelow(len(nodes))]
    return CrabSandbox.options(**_pinned(node)).remote(image, name, **kw)


def connect(name: str, node: str) -> Any:
    """A :data:`CrabSandbox` actor for an existing sandbox on ``node``."""
    return CrabSandbox.options(**_pinned(node)).remote(attach=name)


def recover(ref: Union[str, Point], *, avoid: Optional[str] = None, fs_only: bool = False) -> Any:
    """Bring a sandbox back from the remote store on an alive Crab node (not ``avoid``, the
    lost one, when another exists): ``ref`` is ``SB`` (its newest durable point), ``SB@c7`` or
    a :class:`Point`. The new sandbox has that point's files, processes and conversation;
    whatever happened after it is lost."""
    source = ref.ref if isinstance(ref, Point) else ref
    nodes = [n for n in crab_nodes() if n != avoid] or crab_nodes()
    if not nodes:
        raise CrabError("no alive Crab node to recover on", "start one (see crab_sandbox.ray)", code="host_unsupported")
    node = nodes[secrets.randbelow(len(nodes))]
    base = source.split("@", 1)[0]
    return CrabSandbox.options(**_pinned(node)).remote(from_remote=source, name=_branch_name(base), fs_only=fs_only)


# `CrabSandbox.recover(ref)`, as the actor class's own entry point.
CrabSandbox.recover = recover  # type: ignore[attr-defined]
