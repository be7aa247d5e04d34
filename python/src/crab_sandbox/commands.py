"""``sb.commands``: commands in the foreground and background processes, e2b-style.

A background command (``sb.commands.run(cmd, background=True)``) is a process of the daemon's
background-process service (``docs/api.md``, "Background processes"): it runs detached under a
supervisor inside the sandbox, so it outlives this client, a daemon restart, a checkpoint and
a restore, and a fork's branches have it too. Its handle (:class:`CommandHandle`) waits for it,
iterates its output, feeds its stdin and kills it; ``sb.commands.connect(pid)`` gets a handle
again later (its output is replayed from the start). The ``pid`` of this module is the
service's process id (16 hex digits), the one ``crab ps`` lists.

A foreground command (``background=False``) runs through ``exec`` and returns a
:class:`CommandResult`; a non-zero exit is not an error (see ``exit_code``), a timeout raises
:class:`~crab_sandbox.errors.CommandTimeoutError`.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Union

import httpx

from . import _common as c
from .errors import CommandTimeoutError, ConflictError, NotFoundError
from .models import ExecEvent, ExecResult

if TYPE_CHECKING:  # pragma: no cover
    from ._async import AsyncSandbox
    from ._sync import Sandbox

__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "CommandHandle",
    "CommandInfo",
    "CommandResult",
    "Commands",
]

#: A foreground command's result (the same as :class:`~crab_sandbox.models.ExecResult`).
CommandResult = ExecResult

OutputCallback = Optional[Callable[[str], Any]]


@dataclass(frozen=True)
class CommandInfo:
    """A background process as the daemon lists it (read back from the sandbox).

    ``state`` is ``running``, ``exited`` (``exit_code`` says how; 128+N for signal N) or
    ``lost`` (the sandbox stopped under it).
    """

    pid: str
    cmd: List[str]
    state: str
    exit_code: Optional[int] = None
    tag: Optional[str] = None
    envs: Dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    user: Optional[str] = None
    stdin: bool = False
    started_at: int = 0
    sandbox_pid: Optional[int] = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0

    @classmethod
    def from_json(cls, v: Dict[str, Any]) -> "CommandInfo":
        envs = dict(kv.split("=", 1) for kv in v.get("env") or [] if isinstance(kv, str) and "=" in kv)
        return cls(
            pid=str(v["id"]),
            cmd=[str(x) for x in v.get("cmd") or []],
            state=str(v.get("state", "lost")),
            exit_code=v.get("exit_code"),
            tag=v.get("tag"),
            envs=envs,
            cwd=v.get("cwd"),
            user=v.get("user"),
            stdin=bool(v.get("stdin")),
            started_at=int(v.get("started_at") or 0),
            sandbox_pid=v.get("pid"),
            stdout_bytes=int(v.get("stdout_bytes") or 0),
            stderr_bytes=int(v.get("stderr_bytes") or 0),
        )

    @property
    def running(self) -> bool:
        return self.state == "running"


def _start_body(
    cmd: c.Cmd,
    envs: c.Env,
    cwd: Optional[str],
    user: Optional[str],
    tag: Optional[str],
    stdin: bool,
) -> Dict[str, Any]:
    return {
        "cmd": c.argv(cmd),
        "env": [f"{k}={v}" for k, v in (envs or {}).items()],
        "cwd": cwd,
        "user": user,
        "tag": tag,
        "stdin": stdin,
    }


def _as_user(cmd: c.Cmd, user: Optional[str], envs: c.Env) -> c.Cmd:
    """A foreground command run as ``user`` (``setpriv`` with a fresh login environment)."""
    if user is None or user == "root":
        return cmd
    kv = [f"{k}={v}" for k, v in (envs or {}).items()]
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--reset-env", "--", "env", *kv, *c.argv(cmd)]


def _stdin_body(data: Union[bytes, str], eof: bool = False) -> Dict[str, Any]:
    if isinstance(data, str):
        data = data.encode()
    return {"d": base64.b64encode(data).decode("ascii"), "eof": eof}


class _Output:
    """What a handle has seen of its process: output bytes per stream, and the end."""

    def __init__(self) -> None:
        self.out: List[bytes] = []
        self.err: List[bytes] = []
        self.offsets = [0, 0]
        self.exit_code: Optional[int] = None

    def feed(self, ev: ExecEvent, on_stdout: OutputCallback, on_stderr: OutputCallback) -> None:
        if ev.kind == "stdout":
            self.out.append(ev.data)
            self.offsets[0] += len(ev.data)
            if on_stdout:
                on_stdout(ev.text)
        elif ev.kind == "stderr":
            self.err.append(ev.data)
            self.offsets[1] += len(ev.data)
            if on_stderr:
                on_stderr(ev.text)
        elif ev.kind == "exit":
            self.exit_code = ev.exit_code

    def params(self, follow: bool) -> Dict[str, Any]:
        return {"follow": "true" if follow else "false", "stdout_offset": self.offsets[0], "stderr_offset": self.offsets[1]}

    def result(self) -> CommandResult:
        o, e = b"".join(self.out), b"".join(self.err)
        return ExecResult(
            exit_code=-1 if self.exit_code is None else int(self.exit_code),
            stdout=o.decode("utf-8", "replace"),
            stderr=e.decode("utf-8", "replace"),
            duration_ms=0.0,
            stdout_bytes=o,
            stderr_bytes=e,
        )


def _timed_out(pid: str, timeout: float, r: CommandResult) -> CommandTimeoutError:
    return CommandTimeoutError(
        f"background command {pid} did not end within {timeout} s",
        "it keeps running: wait again, or kill it (handle.kill())",
        result=r,
    )


# --- blocking ---------------------------------------------------------------------------------


class CommandHandle:
    """A background command: wait for it, iterate its output, feed its stdin, kill it.

    Iterating yields :class:`~crab_sandbox.models.ExecEvent` s (``stdout``/``stderr``, then
    ``exit``) as they arrive; :meth:`wait` consumes the rest and returns the result. Output
    seen once is not sent again (the handle keeps its offsets).
    """

    def __init__(self, sandbox: "Sandbox", pid: str) -> None:
        self.sandbox = sandbox
        self.pid = pid
        self._seen = _Output()

    def __repr__(self) -> str:
        return f"CommandHandle({self.sandbox.name!r}, {self.pid!r})"

    @property
    def _base(self) -> str:
        return f"{self.sandbox._base}/procs/{c.seg(self.pid)}"

    @property
    def stdout(self) -> str:
        """The stdout received so far."""
        return b"".join(self._seen.out).decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        """The stderr received so far."""
        return b"".join(self._seen.err).decode("utf-8", "replace")

    @property
    def exit_code(self) -> Optional[int]:
        """Its exit code once an iteration or :meth:`wait` saw it end."""
        return self._seen.exit_code

    def _events(
        self,
        follow: bool,
        on_stdout: OutputCallback = None,
        on_stderr: OutputCallback = None,
        deadline: Optional[float] = None,
    ) -> Iterator[ExecEvent]:
        d = self.sandbox.daemon
        try:
            timeout = httpx.Timeout(None, connect=c.CONNECT_TIMEOUT_S)
            if deadline is not None:
                timeout = httpx.Timeout(max(deadline - time.monotonic(), 0.01), connect=c.CONNECT_TIMEOUT_S)
            with d._http.stream("GET", f"{self._base}/output", params=self._seen.params(follow), timeout=timeout) as r:
                if r.status_code >= 300:
                    c.check_response(r.status_code, r.read())
                for line in r.iter_lines():
                    if line.strip():
                        ev = c.event_of(json.loads(line))
                        self._seen.feed(ev, on_stdout, on_stderr)
                        yield ev
        except httpx.TimeoutException:
            raise _timed_out(self.pid, 0 if deadline is None else deadline, self._seen.result()) from None
        except httpx.TransportError as e:
            raise c.unavailable(d.socket, e) from e

    def __iter__(self) -> Iterator[ExecEvent]:
        if self._seen.exit_code is not None:
            return iter(())
        return self._events(True)

    def output(self) -> CommandResult:
        """What it printed so far (without waiting); ``exit_code`` is -1 while it runs."""
        for _ in self._events(False):
            pass
        return self._seen.result()

    def wait(
        self,
        timeout: Optional[float] = None,
        on_stdout: OutputCallback = None,
        on_stderr: OutputCallback = None,
    ) -> CommandResult:
        """Wait until it ends; its whole output and exit code. With ``timeout`` (seconds),
        :class:`CommandTimeoutError` when it runs longer (it keeps running)."""
        if self._seen.exit_code is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                for _ in self._events(True, on_stdout, on_stderr, deadline):
                    if deadline is not None and time.monotonic() > deadline:
                        raise _timed_out(self.pid, timeout or 0, self._seen.result())
            except CommandTimeoutError:
                raise _timed_out(self.pid, timeout or 0, self._seen.result()) from None
        return self._seen.result()

    def info(self) -> CommandInfo:
        """How the daemon lists it now."""
        return CommandInfo.from_json(self.sandbox.daemon.request("GET", self._base))

    def send_stdin(self, data: Union[bytes, str]) -> None:
        """Write to its stdin (it must have been started with ``stdin=True``)."""
        self.sandbox.daemon.request("POST", f"{self._base}/stdin", _stdin_body(data))

    def close_stdin(self) -> None:
        """Close its stdin (it reads the end of file after what was sent)."""
        self.sandbox.daemon.request("POST", f"{self._base}/close-stdin")

    def kill(self, signal: str = "KILL") -> bool:
        """Send it ``signal`` (KILL by default); False when it was not running."""
        try:
            self.sandbox.daemon.request("POST", f"{self._base}/signal", {"signal": signal})
            return True
        except (ConflictError, NotFoundError):
            return False

    def disconnect(self) -> None:
        """Stop following it (it keeps running); nothing to do: each call is a request."""


class Commands:
    """``sb.commands``: run commands, and list, connect to, feed and kill background ones."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self.sandbox = sandbox

    def run(
        self,
        cmd: c.Cmd,
        background: bool = False,
        envs: c.Env = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
        *,
        stdin: bool = False,
        tag: Optional[str] = None,
        on_stdout: OutputCallback = None,
        on_stderr: OutputCallback = None,
    ) -> Any:
        """Run ``cmd`` (a string runs through ``sh -c``; a list is the argv).

        In the foreground: its :class:`CommandResult` (``stdout``, ``stderr``, ``exit_code``);
        ``timeout`` kills it and raises :class:`CommandTimeoutError`. With ``background=True``:
        a :class:`CommandHandle` at once (``stdin=True`` gives it a stdin for
        :meth:`CommandHandle.send_stdin`; ``tag`` names it; ``timeout`` does not apply).
        """
        if background:
            body = _start_body(cmd, envs, cwd, user, tag, stdin)
            v = self.sandbox.daemon.request("POST", f"{self.sandbox._base}/procs", body)
            return CommandHandle(self.sandbox, str(v["id"]))
        col = c.Collector()
        run = _as_user(cmd, user, envs)
        env = envs if user in (None, "root") else None
        for ev in self.sandbox.exec_stream(run, cwd, env, timeout):
            col.feed(ev)
            if ev.kind == "stdout" and on_stdout:
                on_stdout(ev.text)
            elif ev.kind == "stderr" and on_stderr:
                on_stderr(ev.text)
        return col.result()

    def list(self) -> List[CommandInfo]:
        """Every background process of the sandbox (running, exited, lost), oldest first."""
        return [CommandInfo.from_json(v) for v in self.sandbox.daemon.request("GET", f"{self.sandbox._base}/procs")]

    def connect(self, pid: str) -> CommandHandle:
        """A handle of background process ``pid`` (``tag:NAME`` finds it by tag); its output
        is replayed from the start."""
        v = self.sandbox.daemon.request("GET", f"{self.sandbox._base}/procs/{c.seg(pid)}")
        return CommandHandle(self.sandbox, str(v["id"]))

    def kill(self, pid: str, signal: str = "KILL") -> bool:
        """Signal background process ``pid``; False when it was not running or is unknown."""
        return CommandHandle(self.sandbox, pid).kill(signal)

    def send_stdin(self, pid: str, data: Union[bytes, str]) -> None:
        """Write to the stdin of background process ``pid``."""
        CommandHandle(self.sandbox, pid).send_stdin(data)

    def close_stdin(self, pid: str) -> None:
        """Close the stdin of background process ``pid``."""
        CommandHandle(self.sandbox, pid).close_stdin()


# --- asyncio ----------------------------------------------------------------------------------


class AsyncCommandHandle:
    """The asyncio twin of :class:`CommandHandle` (``async for ev in handle``)."""

    def __init__(self, sandbox: "AsyncSandbox", pid: str) -> None:
        self.sandbox = sandbox
        self.pid = pid
        self._seen = _Output()

    def __repr__(self) -> str:
        return f"AsyncCommandHandle({self.sandbox.name!r}, {self.pid!r})"

    @property
    def _base(self) -> str:
        return f"{self.sandbox._base}/procs/{c.seg(self.pid)}"

    @property
    def stdout(self) -> str:
        return b"".join(self._seen.out).decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return b"".join(self._seen.err).decode("utf-8", "replace")

    @property
    def exit_code(self) -> Optional[int]:
        return self._seen.exit_code

    async def _events(
        self,
        follow: bool,
        on_stdout: OutputCallback = None,
        on_stderr: OutputCallback = None,
    ) -> AsyncIterator[ExecEvent]:
        d = self.sandbox.daemon
        try:
            async with d._http.stream("GET", f"{self._base}/output", params=self._seen.params(follow)) as r:
                if r.status_code >= 300:
                    c.check_response(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if line.strip():
                        ev = c.event_of(json.loads(line))
                        self._seen.feed(ev, on_stdout, on_stderr)
                        yield ev
        except httpx.TransportError as e:
            raise c.unavailable(d.socket, e) from e

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self._events(True)

    async def output(self) -> CommandResult:
        async for _ in self._events(False):
            pass
        return self._seen.result()

    async def wait(
        self,
        timeout: Optional[float] = None,
        on_stdout: OutputCallback = None,
        on_stderr: OutputCallback = None,
    ) -> CommandResult:
        """See :meth:`CommandHandle.wait`."""
        import asyncio

        if self._seen.exit_code is None:

            async def drain() -> None:
                async for _ in self._events(True, on_stdout, on_stderr):
                    pass

            try:
                await asyncio.wait_for(drain(), timeout)
            except asyncio.TimeoutError:
                raise _timed_out(self.pid, timeout or 0, self._seen.result()) from None
        return self._seen.result()

    async def info(self) -> CommandInfo:
        return CommandInfo.from_json(await self.sandbox.daemon.request("GET", self._base))

    async def send_stdin(self, data: Union[bytes, str]) -> None:
        await self.sandbox.daemon.request("POST", f"{self._base}/stdin", _stdin_body(data))

    async def close_stdin(self) -> None:
        await self.sandbox.daemon.request("POST", f"{self._base}/close-stdin")

    async def kill(self, signal: str = "KILL") -> bool:
        try:
            await self.sandbox.daemon.request("POST", f"{self._base}/signal", {"signal": signal})
            return True
        except (ConflictError, NotFoundError):
            return False

    async def disconnect(self) -> None:
        """Stop following it (it keeps running)."""


class AsyncCommands:
    """The asyncio twin of :class:`Commands`."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self.sandbox = sandbox

    async def run(
        self,
        cmd: c.Cmd,
        background: bool = False,
        envs: c.Env = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[float] = None,
        *,
        stdin: bool = False,
        tag: Optional[str] = None,
        on_stdout: OutputCallback = None,
        on_stderr: OutputCallback = None,
    ) -> Any:
        """See :meth:`Commands.run`."""
        if background:
            body = _start_body(cmd, envs, cwd, user, tag, stdin)
            v = await self.sandbox.daemon.request("POST", f"{self.sandbox._base}/procs", body)
            return AsyncCommandHandle(self.sandbox, str(v["id"]))
        col = c.Collector()
        run = _as_user(cmd, user, envs)
        env = envs if user in (None, "root") else None
        async for ev in self.sandbox.exec_stream(run, cwd, env, timeout):
            col.feed(ev)
            if ev.kind == "stdout" and on_stdout:
                on_stdout(ev.text)
            elif ev.kind == "stderr" and on_stderr:
                on_stderr(ev.text)
        return col.result()

    async def list(self) -> List[CommandInfo]:
        v = await self.sandbox.daemon.request("GET", f"{self.sandbox._base}/procs")
        return [CommandInfo.from_json(x) for x in v]

    async def connect(self, pid: str) -> AsyncCommandHandle:
        v = await self.sandbox.daemon.request("GET", f"{self.sandbox._base}/procs/{c.seg(pid)}")
        return AsyncCommandHandle(self.sandbox, str(v["id"]))

    async def kill(self, pid: str, signal: str = "KILL") -> bool:
        return await AsyncCommandHandle(self.sandbox, pid).kill(signal)

    async def send_stdin(self, pid: str, data: Union[bytes, str]) -> None:
        await AsyncCommandHandle(self.sandbox, pid).send_stdin(data)

    async def close_stdin(self, pid: str) -> None:
        await AsyncCommandHandle(self.sandbox, pid).close_stdin()
