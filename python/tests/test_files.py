"""``sb.files`` against a real daemon: each call of the e2b-style handle (sync and async), the
typed errors, a non-root user's ownership, and a hostile sandbox's symlinks staying inside it."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib

import pytest

import crab_sandbox as cs
from crab_sandbox import AsyncDaemon, AsyncSandbox, Daemon, FileType, Sandbox

from conftest import unique


def test_files_handle(sandbox: Sandbox) -> None:
    f = sandbox.files
    info = f.write("/work/notes/a.txt", "alpha\n")
    assert (info.name, info.type, info.path, info.size) == ("a.txt", FileType.FILE, "/work/notes/a.txt", 6)
    assert info.owner == "root" and isinstance(info.modified_time, dt.datetime)
    assert f.read("/work/notes/a.txt") == "alpha\n"
    assert f.read("/work/notes/a.txt", format="bytes") == b"alpha\n"
    assert b"".join(f.read("/work/notes/a.txt", format="stream")) == b"alpha\n"
    f.write("/work/notes/b.bin", b"\x00\xff", mode=0o600)
    assert f.get_info("/work/notes/b.bin").mode == 0o600
    assert sorted(e.name for e in f.list("/work/notes")) == ["a.txt", "b.bin"]
    assert len(f.list("/work", depth=2)) == 3  # notes, notes/a.txt, notes/b.bin
    assert f.exists("/work/notes/a.txt") and not f.exists("/work/notes/nope")
    assert f.make_dir("/work/d1/d2") and not f.make_dir("/work/d1/d2")
    assert f.get_info("/work/d1/d2").type == FileType.DIR
    moved = f.rename("/work/notes/a.txt", "/work/d1/moved.txt")
    assert moved.path == "/work/d1/moved.txt" and not f.exists("/work/notes/a.txt")
    f.remove("/work/d1")
    assert not f.exists("/work/d1")
    # Relative and ~ paths are from the user's home.
    f.write("rel.txt", "r")
    assert sandbox.exec("cat /root/rel.txt").stdout == "r"
    assert f.read("~/rel.txt") == "r"


def test_file_errors_are_typed(sandbox: Sandbox) -> None:
    f = sandbox.files
    with pytest.raises(cs.PathNotFoundError) as e:
        f.read("/nope/none")
    assert "/nope/none" in e.value.message and e.value.hint
    with pytest.raises(cs.InvalidRequestError, match="is a directory"):
        f.read("/etc")
    with pytest.raises(cs.InvalidRequestError, match="not a directory"):
        f.list("/etc/hostname")
    with pytest.raises(cs.PathNotFoundError):
        f.remove("/nope")
    with pytest.raises(cs.InvalidRequestError, match="no user"):
        f.read("/etc/hostname", user="nosuchuser")
    with pytest.raises(cs.SandboxNotFoundError):
        Sandbox("no-such-sandbox-x", sandbox.daemon).files.read("/etc/hostname")


def test_a_user_owns_what_it_writes(sandbox: Sandbox) -> None:
    assert sandbox.exec("useradd -m alice").ok
    f = sandbox.files
    info = f.write("notes.txt", "mine", user="alice")
    assert info.path == "/home/alice/notes.txt" and (info.owner, info.group) == ("alice", "alice")
    assert sandbox.exec("stat -c %U /home/alice/notes.txt").stdout.strip() == "alice"
    with pytest.raises(cs.PermissionDeniedError):
        f.write("/root/x.txt", "no", user="alice")
    with pytest.raises(cs.PermissionDeniedError):
        f.read("/etc/shadow", user="alice")


def test_symlinks_stay_in_the_sandbox(sandbox: Sandbox) -> None:
    """A hostile sandbox's links resolve inside it: the host's files are neither read nor
    written (the sandbox's own /etc/hostname is its name, the host's is not)."""
    with open("/etc/hostname", "rb") as h:
        host_hostname = h.read()
    sandbox.exec("ln -s /etc/hostname /tmp/x; ln -s / /tmp/d")
    inside = sandbox.exec("cat /etc/hostname").stdout_bytes
    assert sandbox.files.read("/tmp/x", format="bytes") == inside
    assert sandbox.files.read("/tmp/d/etc/hostname", format="bytes") == inside
    sandbox.files.write("/tmp/d/tmp/written-through-link", "inside")
    assert sandbox.exec("cat /tmp/written-through-link").stdout == "inside"
    with open("/etc/hostname", "rb") as h:
        assert h.read() == host_hostname


def test_big_file_round_trips(sandbox: Sandbox) -> None:
    blob = hashlib.sha256(b"seed").digest() * (24 * 1024 * 1024 // 32)
    sandbox.files.write("/work/big.bin", blob)
    assert sandbox.exec("sha256sum /work/big.bin").stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    assert hashlib.sha256(sandbox.files.read("/work/big.bin", format="bytes")).digest() == hashlib.sha256(blob).digest()


def test_async_files(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncDaemon(daemon.socket) as d:
            async with await AsyncSandbox.create("debian", name=unique("pyf"), daemon=d) as sb:
                f = sb.files
                assert (await f.write("/work/x.txt", "async-file")).size == 10
                assert await f.read("/work/x.txt") == "async-file"
                assert [c async for c in await f.read("/work/x.txt", format="stream")] == [b"async-file"]
                assert [e.name for e in await f.list("/work")] == ["x.txt"]
                assert await f.exists("/work/x.txt") and not await f.exists("/work/y")
                assert await f.make_dir("/work/d") and not await f.make_dir("/work/d")
                assert (await f.rename("/work/x.txt", "/work/d/y.txt")).name == "y.txt"
                assert (await f.get_info("/work/d/y.txt")).type == FileType.FILE
                await f.remove("/work/d")
                with pytest.raises(cs.PathNotFoundError):
                    await f.get_info("/work/d")

    asyncio.run(main())
