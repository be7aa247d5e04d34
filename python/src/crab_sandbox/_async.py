"""The asyncio client: :class:`AsyncDaemon` and :class:`AsyncSandbox`, the same API as the
blocking one (``_sync``) with coroutines, built on the same helpers (``_common``).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Sequence, Type, TypeVar, Union

import httpx

from . import _common as c
from .errors import CapabilityError, NotFoundError
from .files import Data, AsyncFiles, FileType, tar_of_dir, untar_into
from .models import Capabilities, ExecEvent, ExecResult, Point, RestoreReport, SandboxInfo, Turn

if TYPE_CHECKING:  # pragma: no cover
    from .commands import AsyncCommands

__all__ = ["AsyncDaemon", "AsyncSandbox", "default_async_daemon"]

PointRef = Union[None, str, Point]
S = TypeVar("S", bound="AsyncSandbox")


def _point_id(point: PointRef) -> Optional[str]:
    return point.id if isinstance(point, Point) else point


class AsyncDaemon:
    """A connection to one Crab daemon over its unix socket, for one event loop."""

    def __init__(self, socket: Optional[c.PathLike] = None) -> None:
        self.socket = c.socket_path(socket)
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket),
            base_url=c.BASE_URL,
            timeout=c.HTTP_TIMEOUT,
        )
        self._caps: Optional[Capabilities] = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Optional[Mapping[str, Any]] = None,
    ) -> Any:
        """One API call; returns the decoded JSON answer or raises the daemon's error."""
        try:
            r = await self._http.request(method, path, json=body, params=params)
        except httpx.TransportError as e:
            raise c.unavailable(self.socket, e) from e
        return c.check_response(r.status_code, r.content)

    async def frames(
        self, path: str, body: Any, on_open: Optional[Callable[[], None]] = None
    ) -> AsyncIterator[Dict[str, Any]]:
        """A streamed (NDJSON) call: yields each frame; closing early kills a running command.
        ``on_open`` runs once the daemon accepted the call, before the first frame."""
        try:
            async with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 300:
                    c.check_response(r.status_code, await r.aread())
                if on_open is not None:
                    on_open()
                async for line in r.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as e:
            raise c.unavailable(self.socket, e) from e

    async def version(self) -> Dict[str, Any]:
        v: Dict[str, Any] = await self.request("GET", "/v1/version")
        return v

    async def capabilities(self, refresh: bool = False) -> Capabilities:
        """What the daemon can do (cached after the first call)."""
        if self._caps is None or refresh:
            self._caps = Capabilities.from_version(await self.version())
        return self._caps

    async def sandboxes(self) -> List[SandboxInfo]:
        return [SandboxInfo.from_json(v) for v in await self.request("GET", "/v1/sandboxes")]

    async def progress(self, path: str, body: Any, on_progress: c.ProgressCallback = None) -> Any:
        """See :meth:`crab_sandbox.Daemon.progress`."""
        fold = c.ProgressResult(on_progress)
        async for frame in self.frames(path, body):
            fold.feed(frame)
        return fold.value()

    async def images(self) -> List[Dict[str, Any]]:
        v: List[Dict[str, Any]] = await self.request("GET", "/v1/images")
        return v

    async def build_image(
        self,
        dockerfile: c.PathLike,
        name: str,
        *,
        context: Optional[c.PathLike] = None,
        build_args: Optional[Mapping[str, str]] = None,
        no_cache: bool = False,
        on_progress: c.ProgressCallback = None,
    ) -> Dict[str, Any]:
        """See :meth:`crab_sandbox.Daemon.build_image`."""
        body = c.build_body(dockerfile, name, context, build_args, no_cache)
        r: Dict[str, Any] = await self.progress("/v1/images/build", body, on_progress)
        return r

    async def pull_image(
        self,
        reference: str,
        name: Optional[str] = None,
        *,
        platform: Optional[str] = None,
        insecure: bool = False,
        on_progress: c.ProgressCallback = None,
    ) -> Dict[str, Any]:
        """See :meth:`crab_sandbox.Daemon.pull_image`."""
        body = c.pull_body(reference, name, platform, insecure)
        r: Dict[str, Any] = await self.progress("/v1/images/pull", body, on_progress)
        return r

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncDaemon":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_defaults: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[str, AsyncDaemon]]" = weakref.WeakKeyDictionary()


def default_async_daemon(socket: Optional[c.PathLike] = None) -> AsyncDaemon:
    """The :class:`AsyncDaemon` of the running event loop for a socket (created on first use)."""
    loop = asyncio.get_running_loop()
    path = c.socket_path(socket)
    per_loop = _defaults.setdefault(loop, {})
    d = per_loop.get(path)
    if d is None:
        d = per_loop[path] = AsyncDaemon(path)
    return d


def _pick(socket: Optional[c.PathLike], daemon: Optional[AsyncDaemon]) -> AsyncDaemon:
    return daemon if daemon is not None else default_async_daemon(socket)


class AsyncSandbox:
    """The asyncio twin of :class:`crab_sandbox.Sandbox` (same methods, awaited; the
    capability flags and ``llm_base_url`` are coroutines because they may ask the daemon)."""

    def __init__(self, name: str, daemon: AsyncDaemon) -> None:
        self.name = name
        self.daemon = daemon

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.name!r})"

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{c.seg(self.name)}"

    @property
    def commands(self) -> "AsyncCommands":
        """Foreground and background commands, e2b-style (:mod:`crab_sandbox.commands`)."""
        from .commands import AsyncCommands

        return AsyncCommands(self)

    @classmethod
    async def create(
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
        daemon: Optional[AsyncDaemon] = None,
    ) -> S:
        """See :meth:`crab_sandbox.Sandbox.create`."""
        d = _pick(socket, daemon)
        body = c.create_body(
            image, name, memory, cpus, network, pids, privileged, timeout, on_timeout, labels, envs, userns
        )
        info = await d.request("POST", "/v1/sandboxes", body)
        return cls(str(info["name"]), d)

    @classmethod
    async def connect(
        cls: Type[S], name: str, *, socket: Optional[c.PathLike] = None, daemon: Optional[AsyncDaemon] = None
    ) -> S:
        d = _pick(socket, daemon)
        await d.request("GET", f"/v1/sandboxes/{c.seg(name)}")
        return cls(name, d)

    @classmethod
    async def from_remote(
        cls: Type[S],
        ref: Union[str, Point],
        *,
        name: Optional[str] = None,
        fs_only: bool = False,
        socket: Optional[c.PathLike] = None,
        daemon: Optional[AsyncDaemon] = None,
    ) -> S:
        d = _pick(socket, daemon)
        source = ref.ref if isinstance(ref, Point) else ref
        # The daemon's generated names (SB-cN-1) repeat when one point is restored twice on a
        # host; generate a fresh one.
        name = name or c.fresh_name(source)
        body = {"source": source, "names": [name], "count": 1, "fs_only": fs_only}
        v = await d.request("POST", "/v1/remote/restore", body)
        return cls(str(v["branches"][0]["sandbox"]), d)

    async def info(self) -> SandboxInfo:
        return SandboxInfo.from_json(await self.daemon.request("GET", self._base))

    async def restores_processes(self) -> bool:
        return (await self.daemon.capabilities()).restores_processes

    async def durable(self) -> bool:
        return (await self.daemon.capabilities()).durable

    async def llm_base_url(self) -> str:
        listen = (await self.daemon.capabilities()).proxy_listen or "127.0.0.1:7431"
        return f"http://{listen}/s/{self.name}/v1"

    async def exec_stream(
        self,
        cmd: c.Cmd,
        cwd: Optional[str] = None,
        env: c.Env = None,
        timeout: Optional[float] = None,
        *,
        stdin: c.Stdin = None,
        user: Optional[str] = None,
    ) -> AsyncIterator[ExecEvent]:
        """See :meth:`Sandbox.exec_stream` (``stdin`` may also be an async iterable of bytes)."""
        inline, streamed = c.plan_stdin(stdin)
        if streamed is None:
            async for frame in self.daemon.frames(f"{self._base}/exec", c.exec_body(cmd, cwd, env, timeout, inline, user=user)):
                yield c.event_of(frame)
            return
        session = c.session_name()
        failed: List[Exception] = []
        route = f"{self._base}/exec/{c.seg(session)}/stdin"

        async def feed() -> None:
            http = self.daemon._http
            try:
                r = await http.post(
                    route,
                    params={"eof": "true"},
                    content=c.aiter_body(streamed),
                    headers={"content-type": "application/octet-stream"},
                )
                e = c.stdin_failure(r.status_code, r.content)
            except httpx.TransportError as te:
                e = c.unavailable(self.daemon.socket, te)
            if e is not None:
                failed.append(e)
                try:
                    await http.post(route, json={"d": "", "eof": True})
                except httpx.TransportError:
                    pass

        tasks: List["asyncio.Task[None]"] = []
        body = c.exec_body(cmd, cwd, env, timeout, None, session=session, user=user)
        try:
            async for frame in self.daemon.frames(
                f"{self._base}/exec", body, on_open=lambda: tasks.append(asyncio.ensure_future(feed()))
            ):
                ev = c.event_of(frame)
                if ev.kind == "exit" and failed:
                    raise failed[0]
                yield ev
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    async def exec(
        self,
        cmd: c.Cmd,
        cwd: Optional[str] = None,
        env: c.Env = None,
        timeout: Optional[float] = None,
        *,
        stdin: c.Stdin = None,
        user: Optional[str] = None,
    ) -> ExecResult:
        col = c.Collector()
        async for ev in self.exec_stream(cmd, cwd, env, timeout, stdin=stdin, user=user):
            col.feed(ev)
        return col.result()

    @property
    def files(self) -> AsyncFiles:
        """The sandbox's files, e2b-style: ``read``, ``write``, ``list``, ``exists``,
        ``get_info``, ``make_dir``, ``remove``, ``rename`` (and ``tar_out``/``tar_in``)."""
        return AsyncFiles(self)

    async def write_file(self, path: str, data: "Data", mode: Optional[int] = None) -> None:
        """Write ``data`` (bytes, str or a binary file object, streamed) to ``path`` in the
        sandbox (parents created; ``mode`` e.g. ``0o755``)."""
        await self.files.write(path, data, mode=mode)

    async def read_file(self, path: str) -> bytes:
        """The bytes of a file in the sandbox."""
        return await self.files.read(path, format="bytes")

    async def upload(self, local: c.PathLike, remote: str) -> None:
        """Copy a local file or directory tree to ``remote`` in the sandbox."""
        src = Path(local)
        if src.is_dir():
            await self.files.tar_in(remote, tar_of_dir(src))
        else:
            with src.open("rb") as f:
                await self.files.write(remote, f, mode=src.stat().st_mode & 0o7777)

    async def download(self, remote: str, local: c.PathLike) -> None:
        """Copy a file or directory tree from the sandbox to ``local`` (a tree through a tar
        checked on the way in: nothing lands outside ``local``)."""
        dest = Path(local)
        if (await self.files.get_info(remote)).type == FileType.DIR:
            untar_into(await self.files.tar_out(remote, contents=True), dest)
        else:
            data = await self.files.read(remote, format="bytes")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)

    async def checkpoint(self, kind: str = "auto", durable: bool = False, *, durable_timeout: float = 600.0) -> Point:
        if durable and not await self.durable():
            raise CapabilityError(
                "durable=True, but this daemon has no remote store",
                "start the daemon with `crab daemon --remote file:///DIR` (or s3://...)",
            )
        v = await self.daemon.request("POST", f"{self._base}/checkpoints", {"kind": kind})
        raw = dict(v["point"])
        raw.update({k: v[k] for k in ("verdict", "reasons", "queue_ms") if k in v})
        p = Point.from_json(self.name, raw)
        if durable:
            await self.daemon.request(
                "GET",
                "/v1/remote/wait",
                params={"sandbox": self.name, "point": p.id, "timeout_s": int(durable_timeout)},
            )
            return p.with_remote_state("durable")
        return p

    async def wait_durable(self, point: PointRef = None, timeout: float = 600.0) -> Point:
        """Wait until ``point`` (the newest when None) is in the daemon's ``--remote`` store."""
        pid = _point_id(point)
        if pid is None:
            pts = await self.points()
            if not pts:
                raise CapabilityError("the sandbox has no restore point to wait for", "take one with checkpoint()")
            pid = pts[-1].id
        await self.daemon.request(
            "GET", "/v1/remote/wait", params={"sandbox": self.name, "point": pid, "timeout_s": int(timeout)}
        )
        for p in await self.points():
            if p.id == pid:
                return p.with_remote_state("durable")
        raise CapabilityError(f"point {pid} is durable but no longer listed locally", "list points()")

    async def points(self) -> List[Point]:
        return [Point.from_json(self.name, v) for v in await self.daemon.request("GET", f"{self._base}/checkpoints")]

    async def restore(self, point: PointRef = None) -> RestoreReport:
        v = await self.daemon.request("POST", f"{self._base}/restore", {"checkpoint": _point_id(point)})
        return RestoreReport.from_json(v)

    async def fork(
        self,
        count: int,
        point: PointRef = None,
        *,
        names: Optional[Sequence[str]] = None,
        labels: Optional[Mapping[str, str]] = None,
    ) -> List["AsyncSandbox"]:
        body = c.fork_body(_point_id(point), count, names, labels)
        v = await self.daemon.request("POST", f"{self._base}/fork", body)
        return [type(self)(str(b["sandbox"]), self.daemon) for b in v]

    async def conversation(self, at: PointRef = None) -> List[Dict[str, Any]]:
        at_id = _point_id(at)
        params = {"at": at_id} if at_id else None
        v: List[Dict[str, Any]] = await self.daemon.request("GET", f"{self._base}/conversation", params=params)
        return v

    async def turn(self) -> Turn:
        v = await self.daemon.request("POST", f"{self._base}/turns")
        return Turn(turn=int(v["turn"]), checkpoint=str(v["checkpoint"]))

    # --- its life ------------------------------------------------------------------------------

    async def status(self) -> str:
        """Its state: ``running``, ``parked``, ``paused``, ``stopped``, ``dead`` or ``retired`` (cheap)."""
        v = await self.daemon.request("GET", f"{self._base}/status")
        return str(v["state"])

    async def pause(self) -> str:
        """Pause: a full restore point of files and processes, then every process stopped
        (memory freed). Returns the pause point's id. Raises :class:`ConflictError` unless it
        runs."""
        v = await self.daemon.request("POST", f"{self._base}/pause")
        return str(v["point"])

    async def park(self) -> str:
        """Park: every process stopped (memory freed) after a full restore point; anything
        that needs it running (an exec, a file, its agent's LLM answer) wakes it first.
        Returns the park point's id."""
        v = await self.daemon.request("POST", f"{self._base}/park")
        return str(v["point"])

    async def wake(self) -> Optional[str]:
        """Wake a parked sandbox now (its park point restored in place, its conversation kept).
        Returns the point it woke from, or None when it was not parked."""
        v = await self.daemon.request("POST", f"{self._base}/wake")
        return None if v.get("point") is None else str(v["point"])

    async def resume(self, timeout: Optional[float] = None, on_timeout: Optional[str] = None) -> Optional[str]:
        """Resume a paused sandbox from its pause point (a stopped or dead one from its newest
        point), optionally with a new deadline. Returns the point it came back from.
        Raises :class:`ConflictError` when it runs already."""
        body = c.timeout_body(timeout, on_timeout)
        v = await self.daemon.request("POST", f"{self._base}/resume", body)
        return None if v.get("point") is None else str(v["point"])

    async def set_timeout(self, timeout: float, on_timeout: Optional[str] = None) -> None:
        """A new deadline ``timeout`` seconds from now (``0`` clears it): the daemon then kills
        or pauses it (``on_timeout``; default: what its deadlines did so far, else kill)."""
        body = {"timeout_s": max(0, int(round(timeout)))}
        if on_timeout is not None:
            body.update(c.timeout_body(None, on_timeout))
        await self.daemon.request("PATCH", self._base, body)


    async def kill(self) -> None:
        await self.daemon.request("DELETE", self._base, params={"force": "true"})

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        except NotFoundError:
            pass
