"""The limits users hit (issue 28), through the SDK against a real daemon: a command line and an
environment of 200 KiB and more, one argument past the kernel's 128 KiB refused naming the
limit, a 1 GiB file write and a 1 GiB stdin streamed with the daemon's memory bounded (its
``VmHWM`` measured before and after), and a body over ``--max-upload`` refused naming the flag.

The 1 GiB bodies are generated as they are sent (``os.urandom`` chunks, hashed on the way), so
neither the test nor the daemon holds them whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
from typing import Iterator, List

import pytest

from conftest import state_dir

from crab_sandbox import AsyncSandbox, InvalidRequestError, Sandbox, TooLargeError

GIB = 1 << 30
CHUNK = 1 << 20
#: What the daemon may grow by while 1 GiB passes through it (it holds a few MiB of it at a
#: time; a daemon that buffered the body would grow by 1 GiB or more).
RSS_GROWTH_MAX = 256 << 20


class Source:
    """``size`` random bytes as an iterator of chunks, hashed as they are produced."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sha = hashlib.sha256()
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        left = self.size
        while left > 0:
            b = os.urandom(min(CHUNK, left))
            self.sha.update(b)
            self.sent += len(b)
            left -= len(b)
            yield b


def daemon_hwm_kib() -> int:
    """The daemon's peak resident memory (``VmHWM``), KiB."""
    pid = open(os.path.join(state_dir(), "daemon.pid")).read().strip()
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def record(what: str, before: int, after: int) -> None:
    print(f"daemon VmHWM {what}: {before} KiB before, {after} KiB after")


def test_a_200k_command_line_and_a_200k_environment_reach_the_command(sandbox: Sandbox) -> None:
    args: List[str] = [chr(ord("a") + i) * 100_000 for i in range(10)]  # 1 MB in 10 arguments
    r = sandbox.exec(["sh", "-c", 'printf %s "$*" | sha256sum; echo $#', "sh", *args])
    assert r.exit_code == 0, r.stderr
    digest, count = r.stdout.split("\n")[0].split()[0], r.stdout.split("\n")[1]
    assert digest == hashlib.sha256(" ".join(args).encode()).hexdigest()
    assert count == "10"
    env = {"BIG1": "x" * 100_000, "BIG2": "y" * 100_000}
    r = sandbox.exec('printf %s "$BIG1$BIG2" | wc -c', env=env)
    assert r.exit_code == 0 and r.stdout.strip() == "200000", (r.stdout, r.stderr)


def test_one_argument_past_128k_is_refused_naming_the_limit(sandbox: Sandbox) -> None:
    with pytest.raises(InvalidRequestError) as e:
        sandbox.exec(["echo", "z" * 200_000])
    assert "MAX_ARG_STRLEN" in str(e.value) and "stdin" in str(e.value), e.value
    with pytest.raises(InvalidRequestError) as e:
        sandbox.exec("true", env={"HUGE": "z" * 200_000})
    assert "environment variable HUGE" in str(e.value), e.value


def test_a_1g_file_write_streams_with_the_daemon_bounded(sandbox: Sandbox) -> None:
    before = daemon_hwm_kib()
    src = Source(GIB)
    info = sandbox.files.write("/root/big", iter(src))
    after = daemon_hwm_kib()
    record("1 GiB write_file", before, after)
    assert info.size == GIB and src.sent == GIB
    r = sandbox.exec("sha256sum /root/big && rm /root/big")
    assert r.stdout.split()[0] == src.sha.hexdigest(), r
    assert (after - before) * 1024 < RSS_GROWTH_MAX, f"the daemon grew by {after - before} KiB"


def test_a_1g_stdin_streams_with_the_daemon_bounded(sandbox: Sandbox) -> None:
    before = daemon_hwm_kib()
    src = Source(GIB)
    r = sandbox.exec("sha256sum; echo read", stdin=iter(src))
    after = daemon_hwm_kib()
    record("1 GiB exec stdin", before, after)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == [src.sha.hexdigest(), "-", "read"], r.stdout
    assert (after - before) * 1024 < RSS_GROWTH_MAX, f"the daemon grew by {after - before} KiB"


def test_stdin_over_1m_as_bytes_and_a_file_object_streams(sandbox: Sandbox, tmp_path) -> None:
    data = os.urandom(3 << 20)
    r = sandbox.exec("sha256sum", stdin=data)
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
    p = tmp_path / "in.bin"
    p.write_bytes(data)
    with p.open("rb") as f:
        r = sandbox.exec("wc -c", stdin=f)
    assert r.stdout.strip() == str(len(data))
    # A command that stops reading early ends; the rest of its stdin goes nowhere.
    r = sandbox.exec("head -c 5 >/dev/null; echo stopped", stdin=iter(Source(64 << 20)))
    assert r.exit_code == 0 and r.stdout == "stopped\n", r


def test_async_stdin_and_file_write_stream(sandbox: Sandbox) -> None:
    async def go() -> None:
        a = await AsyncSandbox.connect(sandbox.name)
        src = Source(32 << 20)
        r = await a.exec("sha256sum", stdin=iter(src))
        assert r.stdout.split()[0] == src.sha.hexdigest()
        src = Source(32 << 20)
        info = await a.files.write("/root/a", iter(src))
        assert info.size == 32 << 20
        r = await a.exec("sha256sum /root/a")
        assert r.stdout.split()[0] == src.sha.hexdigest()

    asyncio.run(go())


def test_a_body_over_max_upload_is_refused_naming_the_flag(sandbox: Sandbox, tmp_path) -> None:
    # A sparse file larger than the default --max-upload (4 GiB): its length is declared, so
    # the daemon refuses it before reading a byte.
    big = tmp_path / "sparse"
    subprocess.run(["truncate", "-s", "5G", str(big)], check=True)
    with big.open("rb") as f:
        with pytest.raises(TooLargeError) as e:
            sandbox.files.write("/root/never", f)
    assert "--max-upload" in str(e.value) and "4294967296" in str(e.value), e.value
    assert not sandbox.files.exists("/root/never")
    with big.open("rb") as f:
        with pytest.raises(TooLargeError) as e:
            sandbox.exec("cat >/dev/null", stdin=f)
    assert "--max-upload" in str(e.value), e.value
