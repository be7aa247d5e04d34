"""``sb.files``: the sandbox's files, e2b-style, over the daemon's one file service.

Every call is one request to ``/v1/sandboxes/{name}/files…`` (``docs/api.md``); the daemon runs
the operation *inside* the sandbox as ``user`` (default ``root``; a named account owns what it
writes), so a path is resolved by the sandbox's own view and nothing on the host is followed.
Paths are absolute, ``~/…``, or relative to the user's home. :class:`Files` is the blocking
handle (``Sandbox.files``), :class:`AsyncFiles` the asyncio one (``AsyncSandbox.files``); both
build their requests with the same helpers, so they cannot drift apart.
"""

from __future__ import annotations

import datetime as _dt
import io
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, AsyncIterator, Dict, Iterable, Iterator, List, Optional, Union

import httpx

from . import _common as c
from .errors import AlreadyExistsError, PathNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from ._async import AsyncSandbox
    from ._sync import Sandbox

__all__ = ["AsyncFiles", "EntryInfo", "FileType", "Files"]

#: What a file write takes: text, bytes, a binary file object or an iterable of bytes chunks
#: (the last two stream as they are read).
Data = Union[str, bytes, bytearray, IO[bytes], Iterable[bytes]]


class FileType(str, Enum):
    """What a path is (a symlink: what it points at)."""

    FILE = "file"
    DIR = "dir"
    OTHER = "other"


@dataclass(frozen=True)
class EntryInfo:
    """One path inside the sandbox (e2b's ``EntryInfo``)."""

    name: str
    type: FileType
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: _dt.datetime
    symlink_target: Optional[str] = None
    is_symlink: bool = False

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "EntryInfo":
        kind = str(d.get("kind", "other"))
        return cls(
            name=str(d.get("name", "")),
            type=FileType(kind) if kind in ("file", "dir") else FileType.OTHER,
            path=str(d.get("path", "")),
            size=int(d.get("size", 0)),
            mode=int(d.get("mode", 0)),
            permissions=str(d.get("permissions", "")),
            owner=str(d.get("owner", "")),
            group=str(d.get("group", "")),
            modified_time=_dt.datetime.fromtimestamp(float(d.get("modified_s", 0.0)), tz=_dt.timezone.utc),
            symlink_target=d.get("symlink_target"),
            is_symlink=bool(d.get("is_symlink", False)),
        )


def _params(path: str, user: Optional[str], **extra: Any) -> Dict[str, str]:
    p = {"path": path}
    if user:
        p["user"] = user
    for k, v in extra.items():
        if v is None:
            continue
        p[k] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return p


def _body(data: Data) -> Union[bytes, IO[bytes]]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    return data


def _check(r: httpx.Response) -> Any:
    return c.check_response(r.status_code, r.content)


def _decode(data: bytes, format: str) -> Union[str, bytes]:
    if format == "text":
        return data.decode("utf-8", "replace")
    if format == "bytes":
        return data
    raise ValueError(f"format={format!r}: use 'text', 'bytes' or 'stream'")


def tar_of_dir(local: Path) -> bytes:
    """The contents of a local directory as an in-memory tar (names relative to it)."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for child in sorted(local.iterdir()):
            tf.add(str(child), arcname=child.name)
    return buf.getvalue()


def untar_into(data: bytes, dest: Path) -> None:
    """Extract a tar from the sandbox into ``dest``: the ``data`` filter refuses absolute names,
    ``..``, links out of ``dest`` and device files, so a hostile sandbox writes nothing else."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        tf.extractall(str(dest), filter="data")


class Files:
    """The files of a :class:`~crab_sandbox.Sandbox` (``sb.files``)."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sb = sandbox

    def _send(self, method: str, route: str, params: Dict[str, str], content: Any = None) -> httpx.Response:
        d = self._sb.daemon
        try:
            return d._http.request(method, f"{self._sb._base}/files{route}", params=params, content=content)
        except httpx.TransportError as e:
            raise c.unavailable(d.socket, e) from e

    def read(self, path: str, format: str = "text", user: Optional[str] = None) -> Any:
        """A file's content: ``str`` (``format="text"``), ``bytes`` (``"bytes"``) or an iterator
        of ``bytes`` chunks (``"stream"``)."""
        if format == "stream":
            return self._stream("", _params(path, user))
        return _decode(self._bytes("", _params(path, user)), format)

    def _bytes(self, route: str, params: Dict[str, str]) -> bytes:
        r = self._send("GET", route, params)
        if r.status_code >= 300:
            _check(r)
        return r.content

    def _stream(self, route: str, params: Dict[str, str]) -> Iterator[bytes]:
        d = self._sb.daemon
        try:
            with d._http.stream("GET", f"{self._sb._base}/files{route}", params=params) as r:
                if r.status_code >= 300:
                    c.check_response(r.status_code, r.read())
                yield from r.iter_bytes()
        except httpx.TransportError as e:
            raise c.unavailable(d.socket, e) from e

    def write(self, path: str, data: Data, user: Optional[str] = None, mode: Optional[int] = None) -> EntryInfo:
        """Write ``data`` (str, bytes, a binary file object or an iterable of bytes) to ``path``
        (parents made; an existing file is overwritten); ``mode`` e.g. ``0o755``. Owned by
        ``user``. A file object or an iterable streams as it is read, so any size up to the
        daemon's ``--max-upload`` (default 4 GiB) goes through; a larger body raises
        :class:`TooLargeError` naming that flag."""
        p = _params(path, user, mode=None if mode is None else format(mode & 0o7777, "o"))
        return EntryInfo.from_json(_check(self._send("PUT", "", p, _body(data))))

    def list(self, path: str, depth: int = 1, user: Optional[str] = None) -> List[EntryInfo]:
        """The entries of a directory, ``depth`` levels deep."""
        r = _check(self._send("GET", "/list", _params(path, user, depth=depth)))
        return [EntryInfo.from_json(e) for e in r]

    def get_info(self, path: str, user: Optional[str] = None) -> EntryInfo:
        """Describe a path (a symlink itself, with what it points at)."""
        return EntryInfo.from_json(_check(self._send("GET", "/stat", _params(path, user))))

    def exists(self, path: str, user: Optional[str] = None) -> bool:
        """Whether the path exists."""
        try:
            self.get_info(path, user)
            return True
        except PathNotFoundError:
            return False

    def make_dir(self, path: str, user: Optional[str] = None) -> bool:
        """Make a directory and its parents; ``False`` when it exists already."""
        try:
            _check(self._send("POST", "/mkdir", _params(path, user)))
            return True
        except AlreadyExistsError:
            return False

    def remove(self, path: str, user: Optional[str] = None) -> None:
        """Remove a file or a tree."""
        _check(self._send("DELETE", "", _params(path, user)))

    def rename(self, old_path: str, new_path: str, user: Optional[str] = None) -> EntryInfo:
        """Rename (the destination's parents are made); the new path's entry."""
        return EntryInfo.from_json(_check(self._send("POST", "/rename", _params(old_path, user, to=new_path))))

    def tar_out(self, path: str, contents: bool = False, user: Optional[str] = None) -> bytes:
        """A tar of ``path`` (its top member named after it), or of a directory's contents."""
        return self._bytes("/tar", _params(path, user, contents=contents))

    def tar_in(self, directory: str, tar: bytes, user: Optional[str] = None) -> None:
        """Extract a tar under ``directory`` (made when missing)."""
        _check(self._send("PUT", "/tar", _params(directory, user), tar))


class AsyncFiles:
    """The files of an :class:`~crab_sandbox.AsyncSandbox` (``sb.files``): :class:`Files`'
    methods as coroutines."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def _send(self, method: str, route: str, params: Dict[str, str], content: Any = None) -> httpx.Response:
        d = self._sb.daemon
        try:
            return await d._http.request(method, f"{self._sb._base}/files{route}", params=params, content=content)
        except httpx.TransportError as e:
            raise c.unavailable(d.socket, e) from e

    async def _bytes(self, route: str, params: Dict[str, str]) -> bytes:
        r = await self._send("GET", route, params)
        if r.status_code >= 300:
            _check(r)
        return r.content

    async def _stream(self, route: str, params: Dict[str, str]) -> AsyncIterator[bytes]:
        d = self._sb.daemon
        try:
            async with d._http.stream("GET", f"{self._sb._base}/files{route}", params=params) as r:
                if r.status_code >= 300:
                    c.check_response(r.status_code, await r.aread())
                async for chunk in r.aiter_bytes():
                    yield chunk
        except httpx.TransportError as e:
            raise c.unavailable(d.socket, e) from e

    async def read(self, path: str, format: str = "text", user: Optional[str] = None) -> Any:
        """See :meth:`Files.read` (``"stream"`` gives an async iterator)."""
        if format == "stream":
            return self._stream("", _params(path, user))
        return _decode(await self._bytes("", _params(path, user)), format)

    async def write(self, path: str, data: Data, user: Optional[str] = None, mode: Optional[int] = None) -> EntryInfo:
        """See :meth:`Files.write`."""
        p = _params(path, user, mode=None if mode is None else format(mode & 0o7777, "o"))
        body: Any = _body(data)
        if hasattr(body, "read"):
            # A file object streams as it is read (at most a chunk of it in memory).
            body = c.aiter_body(c._file_chunks(body))
        elif not isinstance(body, bytes):
            body = c.aiter_body(body)
        return EntryInfo.from_json(_check(await self._send("PUT", "", p, body)))

    async def list(self, path: str, depth: int = 1, user: Optional[str] = None) -> List[EntryInfo]:
        """See :meth:`Files.list`."""
        r = _check(await self._send("GET", "/list", _params(path, user, depth=depth)))
        return [EntryInfo.from_json(e) for e in r]

    async def get_info(self, path: str, user: Optional[str] = None) -> EntryInfo:
        """See :meth:`Files.get_info`."""
        return EntryInfo.from_json(_check(await self._send("GET", "/stat", _params(path, user))))

    async def exists(self, path: str, user: Optional[str] = None) -> bool:
        """See :meth:`Files.exists`."""
        try:
            await self.get_info(path, user)
            return True
        except PathNotFoundError:
            return False

    async def make_dir(self, path: str, user: Optional[str] = None) -> bool:
        """See :meth:`Files.make_dir`."""
        try:
            _check(await self._send("POST", "/mkdir", _params(path, user)))
            return True
        except AlreadyExistsError:
            return False

    async def remove(self, path: str, user: Optional[str] = None) -> None:
        """See :meth:`Files.remove`."""
        _check(await self._send("DELETE", "", _params(path, user)))

    async def rename(self, old_path: str, new_path: str, user: Optional[str] = None) -> EntryInfo:
        """See :meth:`Files.rename`."""
        return EntryInfo.from_json(_check(await self._send("POST", "/rename", _params(old_path, user, to=new_path))))

    async def tar_out(self, path: str, contents: bool = False, user: Optional[str] = None) -> bytes:
        """See :meth:`Files.tar_out`."""
        return await self._bytes("/tar", _params(path, user, contents=contents))

    async def tar_in(self, directory: str, tar: bytes, user: Optional[str] = None) -> None:
        """See :meth:`Files.tar_in`."""
        _check(await self._send("PUT", "/tar", _params(directory, user), tar))

