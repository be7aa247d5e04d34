"""The blocking client: :class:`Daemon` (one daemon's socket) and :class:`Sandbox`.

Every method is one or two calls of the daemon's HTTP API (``docs/api.md``); the daemon does
the work. File helpers (``sb.files``, ``upload``, ``download``) go through the daemon's file
service (``files``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Type, TypeVar, Union

import httpx

from . import _common as c
from .errors import CapabilityError, NotFoundError
from .files import Data, Files, FileType, tar_of_dir, untar_into
from .models import Capabilities, ExecEvent, ExecResult, Point, RestoreReport, SandboxInfo, Turn

if TYPE_CHECKING:  # pragma: no cover
    from .commands import Commands

__all__ = ["Daemon", "Sandbox", "default_daemon"]

PointRef = Union[None, str, Point]
S = TypeVar("S", bound="Sandbox")


def _point_id(point: PointRef) -> Optional[str]:
    return point.id if isinstance(point, Point) else point


class Daemon:
    """A connection to one Crab daemon over its unix socket (thread-safe; reuse it).

    Args:
        socket: the daemon's socket; default ``$CRAB_STATE_DIR/crab.sock``, else
            ``/var/lib/crab/crab.sock``.
    """

    def __init__(self, socket: Optional[c.PathLike] = None) -> None:
        self.socket = c.socket_path(socket)
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=self.socket),
            base_url=c.BASE_URL,
            timeout=c.HTTP_TIMEOUT,
        )
        self._caps: Optional[Capabilities] = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Optional[Mapping[str, Any]] = None,
    ) -> Any:
        """One API call; returns the decoded JSON answer or raises the daemon's error."""
        try:
            r = self._http.request(method, path, json=body, params=params)
        except httpx.TransportError as e:
            raise c.unavailable(self.socket, e) from e
        return c.check_response(r.status_code, r.content)

    def frames(self, path: str, body: Any, on_open: Optional[Callable[[], None]] = None) -> Iterator[Dict[str, Any]]:
        """A streamed (NDJSON) call: yields each frame. Closing the iterator early closes the
        connection, which makes the daemon kill a running command. ``on_open`` runs once the
        daemon accepted the call (its answer's head arrived), before the first frame."""
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 300:
                    c.check_response(r.status_code, r.read())
                if on_open is not None:
                    on_open()
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as e:
            raise c.unavailable(self.socket, e) from e

    def version(self) -> Dict[str, Any]:
        """``GET /v1/version``."""
        v: Dict[str, Any] = self.request("GET", "/v1/version")
        return v

    def capabilities(self, refresh: bool = False) -> Capabilities:
        """What the daemon can do (cached after the first call)."""
        if self._caps is None or refresh:
            self._caps = Capabilities.from_version(self.version())
        return self._caps

    def sandboxes(self) -> List[SandboxInfo]:
        """Every sandbox of the daemon."""
        return [SandboxInfo.from_json(v) for v in self.request("GET", "/v1/sandboxes")]

    def progress(self, path: str, body: Any, on_progress: c.ProgressCallback = None) -> Any:
        """A long operation answered as a progress stream: its result (``on_progress`` gets
        each ``stage``/``advance``/``message`` frame); an ``error`` frame raises."""
        fold = c.ProgressResult(on_progress)
        for frame in self.frames(path, body):
            fold.feed(frame)
        return fold.value()

    def images(self) -> List[Dict[str, Any]]:
        """``GET /v1/images``: every image (``ImageInfo``)."""
        v: List[Dict[str, Any]] = self.request("GET", "/v1/images")
        return v

    def build_image(
        self,
        dockerfile: c.PathLike,
        name: str,
        *,
        context: Optional[c.PathLike] = None,
        build_args: Optional[Mapping[str, str]] = None,
        no_cache: bool = False,
        on_progress: c.ProgressCallback = None,
    ) -> Dict[str, Any]:
        """Build a Dockerfile into image ``name`` (``crab image build -f``; steps cached, an
        unchanged rebuild left as is). Returns the ``ImageBuildReport``."""
        body = c.build_body(dockerfile, name, context, build_args, no_cache)
        r: Dict[str, Any] = self.progress("/v1/images/build", body, on_progress)
        return r

    def pull_image(
        self,
        reference: str,
        name: Optional[str] = None,
        *,
        platform: Optional[str] = None,
        insecure: bool = False,
        on_progress: c.ProgressCallback = None,
    ) -> Dict[str, Any]:
        """Pull an image from an OCI registry (``crab image pull``; the same reference and
        digest again is returned as is). Returns its ``ImageInfo``."""
        r: Dict[str, Any] = self.progress("/v1/images/pull", c.pull_body(reference, name, platform, insecure), on_progress)
        return r

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_defaults: Dict[str, Daemon] = {}
_defaults_lock = threading.Lock()


def default_daemon(socket: Optional[c.PathLike] = None) -> Daemon:
    """The process-wide :class:`Daemon` for a socket (created on first use)."""
    path = c.socket_path(socket)
    with _defaults_lock:
        d = _defaults.get(path)
        if d is None:
            d = _defaults[path] = Daemon(path)
        return d


def _pick(socket: Optional[c.PathLike], daemon: Optional[Daemon]) -> Daemon:
    return daemon if daemon is not None else default_daemon(socket)


class Sandbox:
    """A Crab sandbox: run commands, move files, checkpoint, restore and fork it.

    Get one with :meth:`create`, :meth:`connect`, :meth:`from_remote` or :meth:`fork`. As a
    context manager it is removed (with its restore points) on exit.
    """

    def __init__(self, name: str, daemon: Daemon) -> None:
        self.name = name
        self.daemon = daemon

    def __repr__(self) -> str:
        return f"Sandbox({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.name == self.name and other.daemon.socket == self.daemon.socket

    def __hash__(self) -> int:
        return hash((self.name, self.daemon.socket))

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{c.seg(self.name)}"

    @property
    def commands(self) -> "Commands":
        """Foreground and background commands, e2b-style (:mod:`crab_sandbox.commands`)."""
        from .commands import Commands

        return Commands(self)

    # --- getting one --------------------------------------------------------------------------

    @classmethod
    def create(
        cls: Type[S],
        image: str = "debian",
        name: Optional[str] = None,
        memory: Union[None, int, str] = None,
        cpus: Optional[float] = None,
        network: str = "private",
        *,
        pids: Optional[int] = None,
        privileged: bool = False,
        timeout: Optional[float] = None,
        on_timeout: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        envs: Optional[Mapping[str, str]] = None,
        userns: Optional[str] = None,
        socket: Optional[c.PathLike] = None,
        daemon: Optional[Daemon] = None,
    ) -> S:
        """Create and start a sandbox from an image.

        Args:
            image: a daemon image (``crab image ls``), or a registry reference
                (``"python:3.12"``) the daemon pulls on first use (``crab daemon --pull``).
            name: the sandbox's name; generated when None.
            memory: memory limit, bytes or ``"512M"``.
            cpus: CPU limit in cores (``0.5``).
            network: ``private`` (own namespace, lo up), ``nat`` (masqueraded egress), ``none`` or ``host``.
            pids: maximum number of tasks.
            privileged: UNSAFE, no security profile (see ``crab sandbox create --privileged``).
            timeout: seconds until the daemon kills it (or pauses it, ``on_timeout="pause"``);
                the daemon's watchdog fires it, whichever client set it.
            on_timeout: ``"kill"`` (the default) or ``"pause"``.
            labels: labels kept in its record (E2B's metadata).
            envs: environment every command in it gets.
            userns: ``"private"`` (the default: root inside is an unprivileged host uid) or
                ``"host"`` (UNSAFE: uid 0 inside is the host's root; ``crab sandbox create --userns``).
        """
        d = _pick(socket, daemon)
        body = c.create_body(
            image, name, memory, cpus, network, pids, privileged, timeout, on_timeout, labels, envs, userns
        )
        info = d.request("POST", "/v1/sandboxes", body)
        return cls(str(info["name"]), d)

    @classmethod
    def connect(cls: Type[S], name: str, *, socket: Optional[c.PathLike] = None, daemon: Optional[Daemon] = None) -> S:
        """An existing sandbox (raises :class:`SandboxNotFoundError` if there is none)."""
        d = _pick(socket, daemon)
        d.request("GET", f"/v1/sandboxes/{c.seg(name)}")
        return cls(name, d)

    @classmethod
    def from_remote(
        cls: Type[S],
        ref: Union[str, Point],
        *,
        name: Optional[str] = None,
        fs_only: bool = False,
        socket: Optional[c.PathLike] = None,
        daemon: Optional[Daemon] = None,
    ) -> S:
        """A new sandbox from a point of the daemon's ``--remote`` store: ``ref`` is ``SB`` (its
        newest point), ``SB@c7`` or a durable :class:`Point`. Works on any daemon sharing the
        store, without the original host. ``fs_only``: files and conversation, a fresh init."""
        d = _pick(socket, daemon)
        source = ref.ref if isinstance(ref, Point) else ref
        # The daemon's generated names (SB-cN-1) repeat when one point is restored twice on a
        # host; generate a fresh one.
        name = name or c.fresh_name(source)
        body = {"source": source, "names": [name], "count": 1, "fs_only": fs_only}
        v = d.request("POST", "/v1/remote/restore", body)
        return cls(str(v["branches"][0]["sandbox"]), d)

    # --- state --------------------------------------------------------------------------------

    def info(self) -> SandboxInfo:
        """The daemon's description of the sandbox."""
        return SandboxInfo.from_json(self.daemon.request("GET", self._base))

    @property
    def restores_processes(self) -> bool:
        """Restore points of this daemon hold processes (CRIU works on its host). False: a
        restore gives back files only, with a fresh init. See also :attr:`Point.restores_processes`."""
        return self.daemon.capabilities().restores_processes

    @property
    def durable(self) -> bool:
        """The daemon exports points to a ``--remote`` store (``checkpoint(durable=True)``)."""
        return self.daemon.capabilities().durable

    @property
    def llm_base_url(self) -> str:
        """The LLM proxy's base URL for an agent on the host working in this sandbox: its
        requests become this sandbox's turn boundaries. (An agent *inside* the sandbox uses
        :data:`crab_sandbox.IN_SANDBOX_LLM_BASE_URL`.)"""
        listen = self.daemon.capabilities().proxy_listen or "127.0.0.1:7431"
        return f"http://{listen}/s/{self.name}/v1"

    # --- commands -----------------------------------------------------------------------------

    def exec_stream(
        self,
        cmd: c.Cmd,
        cwd: Optional[str] = None,
        env: c.Env = None,
        timeout: Optional[float] = None,
        *,
        stdin: c.Stdin = None,
        user: Optional[str] = None,
    ) -> Iterator[ExecEvent]:
        """Run a command, yielding its output as it arrives and, last, an ``exit`` event.
        Stopping early (``break``, closing the generator) kills the command. ``stdin``: bytes
        or text, a binary file object or an iterable of bytes; above 1 MiB (or not bytes) it
        streams to the command as it is read, any size up to the daemon's ``--max-upload``."""
        inline, streamed = c.plan_stdin(stdin)
        if streamed is None:
            for frame in self.daemon.frames(f"{self._base}/exec", c.exec_body(cmd, cwd, env, timeout, inline, user=user)):
                yield c.event_of(frame)
            return
        session = c.session_name()
        failed: List[Exception] = []

        def feed() -> None:
            http = self.daemon._http
            route = f"{self._base}/exec/{c.seg(session)}/stdin"
            try:
                r = http.post(
                    route,
                    params={"eof": "true"},
                    content=streamed,
                    headers={"content-type": "application/octet-stream"},
                )
                e = c.stdin_failure(r.status_code, r.content)
            except httpx.TransportError as te:
                e = c.unavailable(self.daemon.socket, te)
            if e is not None:
                failed.append(e)
                # Close the command's stdin, so it ends and the failure is raised.
                try:
                    http.post(route, json={"d": "", "eof": True})
                except httpx.TransportError:
                    pass

        feeder = threading.Thread(target=feed, name=f"crab-stdin-{session}", daemon=True)
        body = c.exec_body(cmd, cwd, env, timeout, None, session=session, user=user)
        try:
            for frame in self.daemon.frames(f"{self._base}/exec", body, on_open=feeder.start):
                ev = c.event_of(frame)
                if ev.kind == "exit" and failed:
                    raise failed[0]
                yield ev
        finally:
            if feeder.is_alive():
                feeder.join(timeout=5)

    def exec(
        self,
        cmd: c.Cmd,
        cwd: Optional[str] = None,
        env: c.Env = None,
        timeout: Optional[float] = None,
        *,
        stdin: c.Stdin = None,
        user: Optional[str] = None,
    ) -> ExecResult:
        """Run a command to its end. A string runs through ``sh -c``; a list is the argv.
        A non-zero exit is *not* an error (see ``ExecResult.exit_code``); a timeout raises
        :class:`CommandTimeoutError` with the output so far in ``e.result``."""
        col = c.Collector()
        for ev in self.exec_stream(cmd, cwd, env, timeout, stdin=stdin, user=user):
            col.feed(ev)
        return col.result()

    # --- files --------------------------------------------------------------------------------

    @property
    def files(self) -> Files:
        """The sandbox's files, e2b-style: ``read``, ``write``, ``list``, ``exists``,
        ``get_info``, ``make_dir``, ``remove``, ``rename`` (and ``tar_out``/``tar_in``)."""
        return Files(self)

    def write_file(self, path: str, data: "Data", mode: Optional[int] = None) -> None:
        """Write ``data`` (bytes, str or a binary file object, streamed) to ``path`` in the
        sandbox (parents created; ``mode`` e.g. ``0o755``)."""
        self.files.write(path, data, mode=mode)

    def read_file(self, path: str) -> bytes:
        """The bytes of a file in the sandbox."""
        return self.files.read(path, format="bytes")

    def upload(self, local: c.PathLike, remote: str) -> None:
        """Copy a local file or directory tree to ``remote`` in the sandbox."""
        src = Path(local)
        if src.is_dir():
            self.files.tar_in(remote, tar_of_dir(src))
        else:
            with src.open("rb") as f:
                self.files.write(remote, f, mode=src.stat().st_mode & 0o7777)

    def download(self, remote: str, local: c.PathLike) -> None:
        """Copy a file or directory tree from the sandbox to ``local`` (a tree through a tar
        checked on the way in: nothing lands outside ``local``)."""
        dest = Path(local)
        if (self.files.get_info(remote)).type == FileType.DIR:
            untar_into(self.files.tar_out(remote, contents=True), dest)
        else:
            data = self.files.read(remote, format="bytes")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)

    # --- checkpoints --------------------------------------------------------------------------

    # --- checkpoints --------------------------------------------------------------------------

    def checkpoint(self, kind: str = "auto", durable: bool = False, *, durable_timeout: float = 600.0) -> Point:
        """Publish a restore point. ``kind``: ``auto`` (the inspector decides from what the turn
        changed), ``skip``, ``fs``, ``process`` or ``full``. ``durable=True`` returns only once
        the point is in the daemon's ``--remote`` store (raises :class:`CapabilityError` at once,
        before checkpointing, when the daemon has no store)."""
        if durable and not self.durable:
            raise CapabilityError(
                "durable=True, but this daemon has no remote store",
                "start the daemon with `crab daemon --remote file:///DIR` (or s3://...)",
            )
        v = self.daemon.request("POST", f"{self._base}/checkpoints", {"kind": kind})
        raw = dict(v["point"])
        raw.update({k: v[k] for k in ("verdict", "reasons", "queue_ms") if k in v})
        p = Point.from_json(self.name, raw)
        if durable:
            self.daemon.request(
                "GET",
                "/v1/remote/wait",
                params={"sandbox": self.name, "point": p.id, "timeout_s": int(durable_timeout)},
            )
            return p.with_remote_state("durable")
        return p

    def wait_durable(self, point: PointRef = None, timeout: float = 600.0) -> Point:
        """Wait until ``point`` (the newest when None) is in the daemon's ``--remote`` store."""
        pid = _point_id(point)
        if pid is None:
            pts = self.points()
            if not pts:
                raise CapabilityError("the sandbox has no restore point to wait for", "take one with checkpoint()")
            pid = pts[-1].id
        self.daemon.request(
            "GET", "/v1/remote/wait", params={"sandbox": self.name, "point": pid, "timeout_s": int(timeout)}
        )
        for p in self.points():
            if p.id == pid:
                return p.with_remote_state("durable")
        raise CapabilityError(f"point {pid} is durable but no longer listed locally", "list points()")

    def points(self) -> List[Point]:
        """The sandbox's restore points, oldest first."""
        return [Point.from_json(self.name, v) for v in self.daemon.request("GET", f"{self._base}/checkpoints")]

    def restore(self, point: PointRef = None) -> RestoreReport:
        """Roll the sandbox back in place to a point (the newest when None): files, processes
        (when the point has them) and the conversation."""
        v = self.daemon.request("POST", f"{self._base}/restore", {"checkpoint": _point_id(point)})
        return RestoreReport.from_json(v)

    def fork(
        self,
        count: int,
        point: PointRef = None,
        *,
        names: Optional[Sequence[str]] = None,
        labels: Optional[Mapping[str, str]] = None,
    ) -> List["Sandbox"]:
        """``count`` new sandboxes from a point (the newest when None), each with the point's
        files, processes and conversation; ``labels`` instead of this sandbox's."""
        body = c.fork_body(_point_id(point), count, names, labels)
        v = self.daemon.request("POST", f"{self._base}/fork", body)
        return [type(self)(str(b["sandbox"]), self.daemon) for b in v]

    def conversation(self, at: PointRef = None) -> List[Dict[str, Any]]:
        """The conversation the LLM proxy recorded for this sandbox, up to point ``at`` (all
        when None); records as in ``docs/conversation-log.md``."""
        at_id = _point_id(at)
        params = {"at": at_id} if at_id else None
        v: List[Dict[str, Any]] = self.daemon.request("GET", f"{self._base}/conversation", params=params)
        return v

    def turn(self) -> Turn:
        """Mark a turn boundary explicitly (for harnesses that do not go through the LLM
        proxy); returns once the turn's restore point is published."""
        v = self.daemon.request("POST", f"{self._base}/turns")
        return Turn(turn=int(v["turn"]), checkpoint=str(v["checkpoint"]))

    # --- its life ------------------------------------------------------------------------------

    def status(self) -> str:
        """Its state: ``running``, ``parked``, ``paused``, ``stopped``, ``dead`` or ``retired`` (cheap)."""
        v = self.daemon.request("GET", f"{self._base}/status")
        return str(v["state"])

    def pause(self) -> str:
        """Pause: a full restore point of files and processes, then every process stopped
        (memory freed). Returns the pause point's id. Raises :class:`ConflictError` unless it
        runs."""
        v = self.daemon.request("POST", f"{self._base}/pause")
        return str(v["point"])

    def park(self) -> str:
        """Park: every process stopped (memory freed) after a full restore point; anything
        that needs it running (an exec, a file, its agent's LLM answer) wakes it first.
        Returns the park point's id."""
        v = self.daemon.request("POST", f"{self._base}/park")
        return str(v["point"])

    def wake(self) -> Optional[str]:
        """Wake a parked sandbox now (its park point restored in place, its conversation kept).
        Returns the point it woke from, or None when it was not parked."""
        v = self.daemon.request("POST", f"{self._base}/wake")
        return None if v.get("point") is None else str(v["point"])

    def resume(self, timeout: Optional[float] = None, on_timeout: Optional[str] = None) -> Optional[str]:
        """Resume a paused sandbox from its pause point (a stopped or dead one from its newest
        point), optionally with a new deadline. Returns the point it came back from.
        Raises :class:`ConflictError` when it runs already."""
        body = c.timeout_body(timeout, on_timeout)
        v = self.daemon.request("POST", f"{self._base}/resume", body)
        return None if v.get("point") is None else str(v["point"])

    def set_timeout(self, timeout: float, on_timeout: Optional[str] = None) -> None:
        """A new deadline ``timeout`` seconds from now (``0`` clears it): the daemon then kills
        or pauses it (``on_timeout``; default: what its deadlines did so far, else kill)."""
        body = {"timeout_s": max(0, int(round(timeout)))}
        if on_timeout is not None:
            body.update(c.timeout_body(None, on_timeout))
        self.daemon.request("PATCH", self._base, body)

    # --- the end ------------------------------------------------------------------------------

    def kill(self) -> None:
        """Remove the sandbox: kill its processes, delete its files and restore points."""
        self.daemon.request("DELETE", self._base, params={"force": "true"})

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        except NotFoundError:
            pass
