"""Plain result types of the SDK (frozen dataclasses built from the daemon's JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

__all__ = [
    "ExecResult",
    "ExecEvent",
    "Point",
    "RestoreReport",
    "Turn",
    "Capabilities",
    "SandboxInfo",
]


@dataclass(frozen=True)
class ExecResult:
    """What a command did: its exit code, its output, and its wall time in ms.

    ``exit_code`` is 128+signal when the command was killed by a signal (shell convention).
    """

    exit_code: int
    stdout: str
    stderr: str
    duration_ms: float
    timed_out: bool = False
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        """``exit_code == 0``."""
        return self.exit_code == 0


@dataclass(frozen=True)
class ExecEvent:
    """One event of a streamed exec: ``kind`` is ``stdout``, ``stderr`` or ``exit``.

    ``data`` holds the bytes of an output event; ``exit_code``, ``timed_out`` and
    ``duration_ms`` are set on the final ``exit`` event.
    """

    kind: str
    data: bytes = b""
    exit_code: Optional[int] = None
    timed_out: bool = False
    duration_ms: Optional[float] = None

    @property
    def text(self) -> str:
        """``data`` decoded as UTF-8 (invalid bytes replaced)."""
        return self.data.decode("utf-8", "replace")


@dataclass(frozen=True)
class Point:
    """A restore point ``C_i`` of a sandbox.

    Attributes:
        id: the point's id (``c000007``); pass it (or the Point) to ``restore``/``fork``.
        sandbox: the sandbox it belongs to.
        kind: what it newly captured: ``skip``, ``fs``, ``process``, ``full``, ``restore``.
        parts: its parts, ``p000002+f000003`` (``f...`` only: no processes).
        restores_processes: restoring it brings processes back (it has a process image);
            False means files only, a fresh init.
        durable: the daemon's ``--remote`` store holds it (survives the loss of this host).
        remote_state: ``local``, ``exporting``, ``durable`` or ``failed`` with ``--remote``;
            None without.
    """

    id: str
    sandbox: str
    kind: str
    parts: str
    turn: Optional[int] = None
    size_bytes: int = 0
    created_at_ms: int = 0
    took_ms: Optional[float] = None
    error: Optional[str] = None
    procs_missing: Optional[str] = None
    remote_state: Optional[str] = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def restores_processes(self) -> bool:
        return any(p.startswith("p") for p in self.parts.split("+") if p)

    @property
    def durable(self) -> bool:
        return self.remote_state == "durable"

    @property
    def ref(self) -> str:
        """``sandbox@point``: what :meth:`Sandbox.from_remote` takes."""
        return f"{self.sandbox}@{self.id}"

    @classmethod
    def from_json(cls, sandbox: str, v: Mapping[str, Any]) -> "Point":
        remote = v.get("remote")
        state = remote.get("state") if isinstance(remote, Mapping) else None
        return cls(
            id=str(v["id"]),
            sandbox=sandbox,
            kind=str(v.get("kind", "")),
            parts=str(v.get("parts", "")),
            turn=v.get("turn"),
            size_bytes=int(v.get("size_bytes") or 0),
            created_at_ms=int(v.get("created_at_ms") or 0),
            took_ms=v.get("took_ms"),
            error=v.get("error"),
            procs_missing=v.get("procs_missing"),
            remote_state=state,
            raw=dict(v),
        )

    def with_remote_state(self, state: str) -> "Point":
        d = dict(self.__dict__)
        d["remote_state"] = state
        return Point(**d)


@dataclass(frozen=True)
class RestoreReport:
    """What a restore in place did."""

    sandbox: str
    point: str
    marker: str
    processes_restored: bool
    total_ms: float
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, v: Mapping[str, Any]) -> "RestoreReport":
        return cls(
            sandbox=str(v["sandbox"]),
            point=str(v["point"]),
            marker=str(v.get("marker", "")),
            processes_restored=bool(v.get("processes_restored")),
            total_ms=float(v.get("total_ms") or 0.0),
            raw=dict(v),
        )


@dataclass(frozen=True)
class Turn:
    """An explicit turn boundary: the turn number and the restore point published for it."""

    turn: int
    checkpoint: str


@dataclass(frozen=True)
class Capabilities:
    """What the daemon can do, so a harness can fail closed.

    Attributes:
        restores_processes: CRIU works on the daemon's host: process/full points hold
            processes, and restoring them brings the processes back.
        durable: the daemon exports points to a ``--remote`` store (``checkpoint(durable=True)``
            and ``Sandbox.from_remote`` work).
        proxy_listen: the LLM proxy's host-side address (``127.0.0.1:7431``), if known.
        version: the daemon's version.
    """

    restores_processes: bool
    durable: bool
    proxy_listen: Optional[str]
    version: str
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_version(cls, v: Mapping[str, Any]) -> "Capabilities":
        features = v.get("features") or {}
        criu = features.get("criu") if isinstance(features, Mapping) else None
        remote = features.get("remote") if isinstance(features, Mapping) else None
        return cls(
            restores_processes=bool(isinstance(criu, Mapping) and criu.get("available")),
            durable=bool(isinstance(remote, Mapping) and remote.get("available")),
            proxy_listen=v.get("proxy_listen"),
            version=str(v.get("version", "")),
            raw=dict(v),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the daemon describes it (``GET /v1/sandboxes/{name}``)."""

    name: str
    image: str
    state: str
    init_pid: int
    processes: int
    net: str
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, v: Mapping[str, Any]) -> "SandboxInfo":
        return cls(
            name=str(v["name"]),
            image=str(v.get("image", "")),
            state=str(v.get("state", "")),
            init_pid=int(v.get("init_pid") or 0),
            processes=int(v.get("processes") or 0),
            net=str(v.get("net", "")),
            raw=dict(v),
        )


def points_from_json(sandbox: str, v: List[Mapping[str, Any]]) -> List[Point]:
    return [Point.from_json(sandbox, p) for p in v]
