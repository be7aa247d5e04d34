"""What the sync and async clients share: the socket's location, request bodies and frame
decoding (the file helpers are in ``files``, over the daemon's file service).

Nothing here does I/O with the daemon; ``_sync`` and ``_async`` do, with the same helpers, so
the two front ends cannot drift apart.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
from typing import IO, Any, AsyncIterator, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import httpx

from .errors import (
    CommandTimeoutError,
    CrabError,
    DaemonUnavailableError,
    InternalError,
    error_from_body,
)
from .models import ExecEvent, ExecResult

DEFAULT_STATE_DIR = "/var/lib/crab"
#: Where an agent *inside* a sandbox reaches the LLM proxy (its own network namespace).
IN_SANDBOX_LLM_BASE_URL = "http://127.0.0.1:7431/v1"
#: Seconds to wait for the socket to accept a connection; operations themselves have no limit
#: (a fork or a restore from a remote store may take minutes; pass ``timeout=`` to exec).
CONNECT_TIMEOUT_S = 10.0
HTTP_TIMEOUT = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
BASE_URL = "http://crab"

Cmd = Union[str, Sequence[str]]
Env = Optional[Mapping[str, str]]
PathLike = Union[str, "os.PathLike[str]"]


def socket_path(socket: Optional[PathLike] = None) -> str:
    """The daemon's socket: ``socket`` if given, else ``$CRAB_STATE_DIR/crab.sock``, else
    ``/var/lib/crab/crab.sock``."""
    if socket is not None:
        return os.fspath(socket)
    state = os.environ.get("CRAB_STATE_DIR") or DEFAULT_STATE_DIR
    return os.path.join(state, "crab.sock")


def unavailable(socket: str, e: BaseException) -> DaemonUnavailableError:
    if not os.path.exists(socket):
        why = f"no daemon socket at {socket}"
    else:
        why = f"cannot talk to the daemon at {socket}: {e}"
    return DaemonUnavailableError(
        why,
        "start it (as root) with `crab daemon --state-dir DIR`, or pass socket= / set CRAB_STATE_DIR",
    )


def seg(name: str) -> str:
    """A path segment (sandbox names are validated by the daemon; quote anyway)."""
    return quote(name, safe="")


def check_response(status: int, content: bytes) -> Any:
    """The decoded JSON body of a 2xx answer; otherwise raise the daemon's error."""
    try:
        body = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    if 200 <= status < 300:
        return body
    raise error_from_body(body, status)


def parse_memory(memory: Union[None, int, str]) -> Optional[int]:
    """``512M`` / ``2G`` / a byte count -> bytes."""
    if memory is None or isinstance(memory, int):
        return memory
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KkMmGgTt]?)i?[Bb]?\s*", memory)
    if not m:
        raise CrabError(
            f"memory={memory!r} is not a size", "pass bytes or a size like '512M' or '2G'", code="invalid_request"
        )
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def create_body(
    image: str,
    name: Optional[str],
    memory: Union[None, int, str],
    cpus: Optional[float],
    network: str,
    pids: Optional[int],
    privileged: bool,
    timeout: Optional[float] = None,
    on_timeout: Optional[str] = None,
    labels: Optional[Mapping[str, str]] = None,
    envs: Optional[Mapping[str, str]] = None,
    userns: Optional[str] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {
        "image": image,
        "name": name,
        "net": network,
        "limits": {
            "memory_bytes": parse_memory(memory),
            "pids_max": pids,
            "cpu_millis": None if cpus is None else int(round(cpus * 1000)),
        },
        "privileged": privileged,
    }
    body.update(timeout_body(timeout, on_timeout))
    if labels:
        body["labels"] = dict(labels)
    if envs:
        body["env"] = dict(envs)
    if userns is not None:
        body["userns"] = userns
    return body


def timeout_body(timeout: Optional[float], on_timeout: Optional[str]) -> Dict[str, Any]:
    """The ``timeout_s``/``on_timeout`` fields of a request: whole seconds (at least 1, when
    given); ``on_timeout`` is ``"kill"`` or ``"pause"``."""
    body: Dict[str, Any] = {}
    if timeout is not None:
        body["timeout_s"] = max(1, int(round(timeout)))
    if on_timeout is not None:
        if on_timeout not in ("kill", "pause"):
            raise ValueError(f"on_timeout must be 'kill' or 'pause', not {on_timeout!r}")
        body["on_timeout"] = on_timeout
    return body


def fresh_name(source: str) -> str:
    """A new sandbox name derived from ``SB[@POINT]``: ``SB-<8 hex>``."""
    return f"{source.split('@', 1)[0][:40]}-{secrets.token_hex(4)}"


def argv(cmd: Cmd) -> List[str]:
    """A string runs through ``sh -c``; a sequence is the argv itself."""
    if isinstance(cmd, str):
        return ["sh", "-c", cmd]
    out = [str(c) for c in cmd]
    if not out:
        raise CrabError("empty command", "pass a string (run by sh -c) or a non-empty argv list", code="invalid_request")
    return out


#: What an exec's ``stdin=`` may be: bytes or text, a binary file object, or an iterable of
#: bytes chunks (streamed as they come).
Stdin = Union[None, bytes, bytearray, str, IO[bytes], Iterable[bytes]]

#: Stdin up to this size travels inside the exec request (base64); larger, a file object or an
#: iterable streams through an exec session's stdin (``POST .../exec/{session}/stdin`` with a raw
#: body), so any size up to the daemon's ``--max-upload`` goes through without being held whole
#: by the daemon.
INLINE_STDIN = 1 << 20
#: Chunk size of a streamed stdin read from a file object.
STDIN_CHUNK = 1 << 20


def plan_stdin(stdin: Stdin) -> Tuple[Optional[bytes], Any]:
    """``(inline, streamed)``: stdin sent inside the exec request, or a body (bytes, file object
    or iterable of bytes) to stream through a session; at most one is not ``None``."""
    if stdin is None:
        return None, None
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        data = bytes(stdin)
        return (data, None) if len(data) <= INLINE_STDIN else (None, data)
    if hasattr(stdin, "read"):
        return None, _file_chunks(stdin)
    return None, stdin


def _file_chunks(f: Any) -> Iterator[bytes]:
    while True:
        b = f.read(STDIN_CHUNK)
        if not b:
            return
        yield b


async def aiter_body(body: Any) -> AsyncIterator[bytes]:
    """A streamed stdin body (bytes or a sync/async iterable of bytes) as an async iterator, for
    the asyncio client."""
    if isinstance(body, bytes):
        for i in range(0, len(body), STDIN_CHUNK):
            yield body[i : i + STDIN_CHUNK]
    elif hasattr(body, "__aiter__"):
        async for b in body:
            yield bytes(b)
    else:
        for b in body:
            yield bytes(b)


def session_name() -> str:
    """A fresh exec-session name for a streamed stdin."""
    return f"sdk-{secrets.token_hex(8)}"


def exec_body(
    cmd: Cmd,
    cwd: Optional[str] = None,
    env: Env = None,
    timeout: Optional[float] = None,
    stdin: Optional[bytes] = None,
    session: Optional[str] = None,
    user: Optional[str] = None,
) -> Dict[str, Any]:
    """An ``ExecRequest``. ``user``: ``name``, ``uid``, ``name:group`` or ``uid:gid`` (the
    daemon's own account switch; default the image's ``User``, else root)."""
    if isinstance(stdin, str):
        stdin = stdin.encode()
    body = {
        "cmd": argv(cmd),
        "env": [f"{k}={v}" for k, v in (env or {}).items()],
        "workdir": cwd,
        "timeout_s": timeout,
        "stdin_b64": None if stdin is None else base64.b64encode(stdin).decode("ascii"),
        "stdin_session": session,
    }
    if user is not None:
        body["user"] = user
    return body


#: Called with each frame of a progress stream (``stage``, ``advance``, ``message``).
ProgressCallback = Optional[Callable[[Mapping[str, Any]], Any]]


class ProgressResult:
    """Folds a progress stream (``docs/api.md``, "Streams"): hands each frame to ``on_progress``
    and keeps the ``done`` frame's result; an ``error`` frame raises the daemon's error."""

    def __init__(self, on_progress: ProgressCallback = None) -> None:
        self.on_progress = on_progress
        self.result: Any = None
        self.done = False

    def feed(self, frame: Mapping[str, Any]) -> None:
        t = frame.get("t")
        if t == "done":
            self.result, self.done = frame.get("result"), True
        elif t == "error":
            raise error_from_body(frame.get("error"))
        elif self.on_progress is not None:
            self.on_progress(frame)

    def value(self) -> Any:
        if not self.done:
            raise InternalError("the daemon ended a progress stream without a result", "see the daemon's log")
        return self.result


def build_body(
    dockerfile: PathLike, name: str, context: Optional[PathLike], build_args: Optional[Mapping[str, str]], no_cache: bool
) -> Dict[str, Any]:
    """An ``ImageBuildRequest`` for a Dockerfile build (paths made absolute: the daemon reads
    them on its host)."""
    # `distro` is the request's required field of the debootstrap recipe; a Dockerfile build ignores it.
    body: Dict[str, Any] = {"distro": "debian", "dockerfile": os.path.abspath(os.fspath(dockerfile)), "name": name, "no_cache": no_cache}
    if context is not None:
        body["context"] = os.path.abspath(os.fspath(context))
    if build_args:
        body["build_args"] = dict(build_args)
    return body


def pull_body(reference: str, name: Optional[str], platform: Optional[str], insecure: bool) -> Dict[str, Any]:
    """An ``ImagePullRequest``."""
    return {"reference": reference, "name": name, "platform": platform, "insecure": insecure}


def fork_body(
    point: Optional[str], count: int, names: Optional[Sequence[str]], labels: Optional[Mapping[str, str]]
) -> Dict[str, Any]:
    """A ``ForkRequest``; ``labels`` replace the source's on the branches."""
    body: Dict[str, Any] = {"checkpoint": point, "count": count, "names": list(names) if names else None}
    if labels is not None:
        body["labels"] = dict(labels)
    return body


def stdin_failure(status: int, content: bytes) -> Optional[Exception]:
    """The error of a streamed stdin's answer, or ``None``: success, or the command stopped
    reading (its stdin is closed — as a pipe's writer, the rest goes nowhere)."""
    if status < 300:
        return None
    try:
        check_response(status, content)
    except Exception as e:  # noqa: BLE001 — the daemon's typed error, returned to raise later
        if "its stdin is closed" in str(e) or "no open exec session" in str(e):
            return None
        return e
    return None


def event_of(frame: Mapping[str, Any]) -> ExecEvent:
    """One exec frame as an event; an ``error`` frame raises the daemon's error."""
    t = frame.get("t")
    if t in ("stdout", "stderr"):
        return ExecEvent(kind=str(t), data=base64.b64decode(frame.get("d", "")))
    if t == "exit":
        return ExecEvent(
            kind="exit",
            exit_code=int(frame.get("code", -1)),
            timed_out=bool(frame.get("timed_out")),
            duration_ms=float(frame.get("duration_ms") or 0.0),
        )
    if t == "error":
        raise error_from_body(frame.get("error"))
    raise InternalError(f"unknown exec frame from the daemon: {frame!r:.200}")


class Collector:
    """Accumulates exec events into an :class:`ExecResult`."""

    def __init__(self) -> None:
        self.out: List[bytes] = []
        self.err: List[bytes] = []
        self.exit: Optional[ExecEvent] = None

    def feed(self, ev: ExecEvent) -> None:
        if ev.kind == "stdout":
            self.out.append(ev.data)
        elif ev.kind == "stderr":
            self.err.append(ev.data)
        elif ev.kind == "exit":
            self.exit = ev

    def result(self, raise_on_timeout: bool = True) -> ExecResult:
        if self.exit is None:
            raise InternalError("the daemon ended the exec without an exit status", "see the daemon's log")
        o, e = b"".join(self.out), b"".join(self.err)
        r = ExecResult(
            exit_code=int(self.exit.exit_code if self.exit.exit_code is not None else -1),
            stdout=o.decode("utf-8", "replace"),
            stderr=e.decode("utf-8", "replace"),
            duration_ms=float(self.exit.duration_ms or 0.0),
            timed_out=self.exit.timed_out,
            stdout_bytes=o,
            stderr_bytes=e,
        )
        if r.timed_out and raise_on_timeout:
            raise CommandTimeoutError(
                f"the command ran past its timeout ({r.duration_ms / 1e3:.1f} s) and was killed",
                "raise timeout=, or run it in the background; the output so far is in e.result",
                result=r,
            )
        return r
