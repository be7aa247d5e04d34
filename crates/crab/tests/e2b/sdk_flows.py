"""The unmodified `e2b` SDK (2.x) against Crab's E2B-compatible API.

Run by crates/crab/tests/e2b.rs with E2B_API_URL / E2B_SANDBOX_URL pointing at the daemon's
--e2b-listen address and E2B_API_KEY set to a key whose digest is in --e2b-keys. Each check
prints `ok NAME`; the first failure raises (non-zero exit). Every sandbox made here is killed
at the end, pass or fail. `CRAB_E2B_ONLY=name,name` runs a subset.
"""

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse

import httpx
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    SandboxNotRunningException,
)
from e2b.sandbox.commands.command_handle import CommandExitException

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
TEMPLATE = os.environ.get("CRAB_E2B_TEMPLATE", "base")
ONLY = [s for s in os.environ.get("CRAB_E2B_ONLY", "").split(",") if s]

made = []


def create(template=TEMPLATE, **kw):
    sb = Sandbox.create(template, **kw)
    made.append(sb.sandbox_id)
    return sb


def check_create_run_files():
    sb = create(metadata={"suite": "crab-e2b"}, envs={"SB_ENV": "from-create"})
    assert sb.is_running()
    # Foreground: output, exit code, the default user and home.
    r = sb.commands.run("echo hello; echo oops >&2; whoami; pwd")
    assert r.exit_code == 0, r
    assert r.stdout == "hello\nuser\n/home/user\n", repr(r.stdout)
    assert r.stderr == "oops\n", repr(r.stderr)
    # Non-zero exit raises with the code and output.
    try:
        sb.commands.run("echo partial; exit 3")
        raise AssertionError("exit 3 did not raise")
    except CommandExitException as e:
        assert e.exit_code == 3 and e.stdout == "partial\n", (e.exit_code, e.stdout)
    # envs (create-time and per-call), cwd, user.
    r = sb.commands.run("echo $SB_ENV $CALL_ENV; pwd", envs={"CALL_ENV": "per-call"}, cwd="/tmp")
    assert r.stdout == "from-create per-call\n/tmp\n", repr(r.stdout)
    assert sb.commands.run("whoami", user="root").stdout == "root\n"
    # Streaming callbacks see the output as it comes.
    seen = []
    r = sb.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done", on_stdout=seen.append)
    assert "".join(seen) == "line1\nline2\nline3\n", seen
    # Files: write / read / list / exists / make_dir / rename / remove.
    info = sb.files.write("notes/a.txt", "alpha\n")
    assert info.path == "/home/user/notes/a.txt", info
    assert sb.files.read("/home/user/notes/a.txt") == "alpha\n"
    sb.files.write("/tmp/bin.dat", b"\x00\x01\xff")
    assert bytes(sb.files.read("/tmp/bin.dat", format="bytes")) == b"\x00\x01\xff"
    names = sorted(e.name for e in sb.files.list("/home/user/notes"))
    assert names == ["a.txt"], names
    assert sb.files.exists("/home/user/notes/a.txt")
    assert not sb.files.exists("/home/user/notes/missing")
    assert sb.files.make_dir("/home/user/d1/d2")
    assert not sb.files.make_dir("/home/user/d1/d2")  # exists already
    sb.files.rename("/home/user/notes/a.txt", "/home/user/d1/b.txt")
    assert sb.files.read("/home/user/d1/b.txt") == "alpha\n"
    # The owner is the user: a command sees it like any file.
    assert sb.commands.run("stat -c %U /home/user/d1/b.txt").stdout == "user\n"
    sb.files.remove("/home/user/d1")
    assert not sb.files.exists("/home/user/d1")
    try:
        sb.files.read("/nope/none")
        raise AssertionError("reading a missing file did not raise")
    except NotFoundException:
        pass
    # Info and list with a metadata filter.
    info = sb.get_info()
    assert info.sandbox_id == sb.sandbox_id and info.metadata == {"suite": "crab-e2b"}, info
    listed = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "crab-e2b"})).next_items()]
    assert sb.sandbox_id in listed, listed
    assert sb.kill()
    assert not sb.is_running() or True  # envd answers 502/not found once killed
    try:
        Sandbox.connect(sb.sandbox_id)
        raise AssertionError("connect to a killed sandbox did not raise")
    except SandboxException:
        pass


def check_background():
    sb = create()
    h = sb.commands.run("echo started; sleep 600", background=True)
    assert h.pid > 0
    pids = [p.pid for p in sb.commands.list()]
    assert h.pid in pids, pids
    assert sb.commands.kill(h.pid)
    try:
        h.wait()
        raise AssertionError("a killed command did not raise")
    except CommandExitException:
        pass
    assert h.pid not in [p.pid for p in sb.commands.list()]
    # The process is gone from the sandbox too (its SIGKILLed child may take a moment to be
    # reaped by the sandbox's init: poll for up to 2 s, then it must be gone).
    r = sb.commands.run("for i in $(seq 20); do pgrep -x sleep >/dev/null || break; sleep 0.1; done; pgrep -x sleep || echo none")
    assert r.stdout.strip() == "none", r.stdout
    # A background server keeps running after its starting call returns.
    sb.commands.run("python3 -m http.server 8000 >/dev/null 2>&1 &", timeout=10)
    r = sb.commands.run("for i in $(seq 50); do curl -sf -o /dev/null localhost:8000 && echo up && break; sleep 0.1; done")
    assert r.stdout == "up\n", r.stdout
    sb.kill()


def check_snapshots_and_fork():
    sb = create()
    sb.files.write("/home/user/state.txt", "before-snapshot")
    # A server with in-memory state, started before the full snapshot, as the default user
    # (uid 1000 in the sandbox's user namespace, which the daemon owns: CRIU dumps it with or
    # without CAP_SYS_RESOURCE on the host).
    sb.commands.run(
        "nohup python3 -c \"import http.server as h, itertools\n"
        "c = itertools.count(1)\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(s):\n"
        "        b = str(next(c)).encode(); s.send_response(200); s.end_headers(); s.wfile.write(b)\n"
        "    def log_message(s, *a): pass\n"
        "h.HTTPServer(('127.0.0.1', 8001), H).serve_forever()\" >/dev/null 2>&1 &",
    )
    hit = "for i in $(seq 50); do curl -sf localhost:8001 && exit 0; sleep 0.1; done; exit 1"
    assert sb.commands.run(hit).stdout == "1"
    assert sb.commands.run(hit).stdout == "2"
    full = sb.create_snapshot()
    fs = sb.create_snapshot(mode="filesystem")
    sb.files.write("/home/user/state.txt", "after-snapshot")
    # full: files and the process with its counter.
    child = create(full.snapshot_id)
    assert child.files.read("/home/user/state.txt") == "before-snapshot"
    assert child.commands.run(hit).stdout == "3", "the server's in-memory counter did not survive"
    # filesystem: files, no processes.
    cold = create(fs.snapshot_id)
    assert cold.files.read("/home/user/state.txt") == "before-snapshot"
    r = cold.commands.run("curl -s localhost:8001 || echo down")
    assert r.stdout.strip() == "down", r.stdout
    # fork(count=3): three children of the sandbox as it is now.
    kids = sb.fork(count=3)
    assert len(kids) == 3, kids
    for k in kids:
        made.append(k.sandbox_id)
        assert k.files.read("/home/user/state.txt") == "after-snapshot"
        assert k.commands.run(hit).stdout == "3", "fork branch lost the server's memory"
    assert len({k.sandbox_id for k in kids}) == 3
    # The parent went on independently.
    assert sb.commands.run(hit).stdout == "3"
    for x in [child, cold, *kids, sb]:
        x.kill()
    # A snapshot outlives its sandbox (E2B semantics): the killed source is hidden, its
    # snapshots still make sandboxes, and deleting the last one removes it.
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    listed = {s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sb.sandbox_id).next_items()}
    assert listed == {full.snapshot_id, fs.snapshot_id}, listed
    late = create(full.snapshot_id)
    assert late.commands.run(hit).stdout == "3", "the snapshot did not outlive its sandbox"
    late.kill()
    assert Sandbox.delete_snapshot(fs.snapshot_id) is True
    assert Sandbox.delete_snapshot(fs.snapshot_id) is False
    assert Sandbox.delete_snapshot(full.snapshot_id) is True
    try:
        create(full.snapshot_id)
        raise AssertionError("a deleted snapshot still made a sandbox")
    except (NotFoundException, SandboxException) as e:
        assert "not found" in str(e), e


def check_pause_connect():
    sb = create()
    sb.commands.run(
        "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.1; done' >/dev/null 2>&1 &",
        user="root",
    )
    time.sleep(0.5)
    assert sb.pause()
    assert sb.get_info().state.value == "paused"
    assert not sb.pause()  # already paused: 409 → False
    again = Sandbox.connect(sb.sandbox_id)
    assert again.get_info().state.value == "running"
    a = int(again.commands.run("cat /tmp/tick").stdout)
    time.sleep(0.4)
    b = int(again.commands.run("cat /tmp/tick").stdout)
    assert b > a, (a, b)  # the loop came back with the sandbox
    again.kill()


def until(what, cond, timeout=10.0):
    """Poll `cond` until it holds; fail naming `what` after `timeout` seconds."""
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


class Waiter:
    """handle.wait(on_stdout=...) in a thread from now on (the sync SDK hands a background
    command's output only to wait()'s callbacks); .raised() answers what wait() raised."""

    def __init__(self, handle, on_stdout=None):
        self.box = {}
        self.t = threading.Thread(target=self._run, args=(handle, on_stdout), daemon=True)
        self.t.start()

    def _run(self, handle, on_stdout):
        try:
            self.box["result"] = handle.wait(on_stdout=on_stdout)
        except BaseException as e:  # noqa: BLE001 - the caller asserts on it
            self.box["error"] = e

    def raised(self, timeout=20.0):
        self.t.join(timeout)
        assert not self.t.is_alive(), f"handle.wait() hung for {timeout} s"
        return self.box.get("error")


def wait_raises(handle, timeout=20.0):
    """What handle.wait() raises (None if it returns); fails if it hangs."""
    return Waiter(handle).raised(timeout)


TICKER = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done"


def check_pause_keeps_commands():
    """A refused pause leaves background commands running and their streams flowing; a pause
    that works keeps them in the pause point, and after connect they are listed, followed and
    killed by pid (root: CRIU dumps a non-root process only with CAP_SYS_RESOURCE)."""
    sb = create()
    seen = []
    h = sb.commands.run(TICKER, background=True, user="root")
    w = Waiter(h, seen.append)
    until("the ticker's output", lambda: "tick 2" in "".join(seen))
    # A 3 MiB deleted-but-open file: CRIU refuses it (over its 1 MiB ghost limit), whatever the
    # host's capabilities, after the pause has checked what it checks first.
    sb.commands.run(
        "nohup python3 -c 'import os,time; f=open(\"/tmp/ghost\",\"wb\"); f.write(b\"x\"*(3<<20)); f.flush(); os.unlink(\"/tmp/ghost\"); time.sleep(1000)' >/dev/null 2>&1 & echo $! >/tmp/ghost.pid",
        user="root",
    )
    # Until its process holds the unlinked file open (before that, the file may not exist yet).
    sb.commands.run(
        "for i in $(seq 50); do p=$(cat /tmp/ghost.pid 2>/dev/null) && ls -l /proc/$p/fd 2>/dev/null | grep -q '/tmp/ghost (deleted)' && exit 0; sleep 0.1; done; exit 1",
        user="root",
    )
    try:
        sb.pause()
        raise AssertionError("a pause CRIU cannot dump succeeded")
    except SandboxException as e:
        assert "ghost" in str(e) or "criu" in str(e).lower(), e
    assert sb.get_info().state.value == "running"
    # The stream goes on (nothing was stopped), the command is still listed.
    n = len(seen)
    until("output after the refused pause", lambda: len(seen) > n + 2)
    assert h.pid in [p.pid for p in sb.commands.list()], "the refused pause lost the command"
    sb.commands.run("p=$(cat /tmp/ghost.pid); kill $p; for i in $(seq 50); do [ -d /proc/$p ] || exit 0; sleep 0.1; done; exit 1", user="root")
    # Now the pause works: the stream ends saying so (E2B's streams do not survive a pause).
    assert sb.pause()
    err = w.raised()
    assert isinstance(err, SandboxException) and "paused" in str(err), repr(err)
    again = Sandbox.connect(sb.sandbox_id)
    assert h.pid in [p.pid for p in again.commands.list()], "the command is gone after resume"
    later = []
    c = again.commands.connect(h.pid)
    cw = Waiter(c, later.append)
    until("output after the resume", lambda: "tick" in "".join(later))
    assert again.commands.kill(h.pid)
    err = cw.raised()
    assert isinstance(err, CommandExitException), repr(err)
    assert h.pid not in [p.pid for p in again.commands.list()]
    gone = again.commands.run(f"for i in $(seq 50); do [ -d /proc/{h.pid} ] || {{ echo gone; exit 0; }}; sleep 0.1; done; echo still")
    assert gone.stdout == "gone\n", gone.stdout
    again.kill()


def check_stdin():
    """stdin=True: send_stdin reaches the command, close_stdin ends its input; a command
    started without stdin refuses send_stdin with the reason."""
    sb = create()
    h = sb.commands.run("cat; echo done", background=True, stdin=True)
    sb.commands.send_stdin(h.pid, "hello\n")
    sb.commands.send_stdin(h.pid, b"world\n")
    sb.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.exit_code == 0 and r.stdout == "hello\nworld\ndone\n", (r.exit_code, r.stdout)
    # Without stdin=True the command's stdin is /dev/null and input is refused, the command intact.
    h = sb.commands.run("sleep 600", background=True)
    try:
        sb.commands.send_stdin(h.pid, "x")
        raise AssertionError("send_stdin to a command without stdin succeeded")
    except SandboxException as e:
        assert "stdin=True" in str(e), e
    assert h.pid in [p.pid for p in sb.commands.list()]
    assert sb.commands.kill(h.pid)
    sb.kill()


def crab_json(*args):
    out = subprocess.run([os.environ["CRAB_BIN"], "--json", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def check_dead_sandbox():
    """The sandbox's init killed from outside the E2B API: the SDK sees it not running (info,
    list, is_running), its commands and files calls and a running command's wait() raise at
    once (not hang), and connect brings it back from its newest restore point."""
    sb = create()
    sb.files.write("/home/user/kept.txt", "before the snapshot")
    snap = sb.create_snapshot(mode="filesystem")
    h = sb.commands.run("sleep 600", background=True)
    init = crab_json("sandbox", "inspect", sb.sandbox_id)["init_pid"]
    os.kill(init, signal.SIGKILL)
    err = wait_raises(h)
    assert isinstance(err, SandboxNotRunningException), repr(err)
    assert sb.get_info().state.value == "paused"
    running = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()]
    assert sb.sandbox_id not in running, running
    assert not sb.is_running()
    for what, call in [
        ("commands.run", lambda: sb.commands.run("true")),
        ("files.read", lambda: sb.files.read("/home/user/kept.txt")),
        ("files.write", lambda: sb.files.write("/tmp/x", "x")),
        ("commands.list", lambda: sb.commands.list()),
    ]:
        t = time.time()
        try:
            call()
            raise AssertionError(f"{what} on a dead sandbox succeeded")
        except SandboxNotRunningException as e:
            assert "outside the E2B API" in str(e), (what, e)
        assert time.time() - t < 10, f"{what} took {time.time() - t:.1f} s"
    back = Sandbox.connect(sb.sandbox_id)
    assert back.is_running() and back.get_info().state.value == "running"
    assert back.files.read("/home/user/kept.txt") == "before the snapshot"
    assert back.commands.run("echo alive").stdout == "alive\n"
    back.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id)


def check_timeout():
    sb = create(timeout=3)
    assert sb.commands.run("echo alive").stdout == "alive\n"
    sb.set_timeout(2)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            Sandbox.get_info(sb.sandbox_id)
        except NotFoundException:
            return
        except SandboxException as e:
            if "404" in str(e) or "not found" in str(e):
                return
            raise
        time.sleep(0.5)
    raise AssertionError("the sandbox outlived its timeout")


def check_errors():
    # Wrong API key: 401.
    try:
        Sandbox.create(TEMPLATE, api_key="e2b_wrong_key")
        raise AssertionError("a wrong API key was accepted")
    except AuthenticationException:
        pass
    r = httpx.get(f"{API}/v2/sandboxes")
    assert r.status_code == 401 and "X-API-Key" in r.json()["message"], r.text
    # Unknown ids: 404.
    r = httpx.get(f"{API}/sandboxes/e2b-nope", headers={"X-API-Key": KEY})
    assert r.status_code == 404 and r.json()["code"] == 404, r.text
    assert not Sandbox.kill("e2b-nope")
    try:
        Sandbox.create("no-such-template")
        raise AssertionError("an unknown template was accepted")
    except (NotFoundException, SandboxException) as e:
        assert "not found" in str(e), e
    sb = create()
    sid = sb.sandbox_id
    # Wrong access token: 401 from envd, the sandbox untouched.
    h = {"E2b-Sandbox-Id": sid, "X-Access-Token": "wrong", "Content-Type": "application/json"}
    r = httpx.post(f"{API}/filesystem.Filesystem/Stat", headers=h, content=b'{"path":"/"}')
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    token = sb._envd_access_token
    # Malformed Connect frames: invalid_argument in the end-of-stream message.
    h = {"E2b-Sandbox-Id": sid, "X-Access-Token": token, "Content-Type": "application/connect+json"}
    r = httpx.post(f"{API}/process.Process/Start", headers=h, content=b"\x00\x00\x00\x00\x40{}")
    assert r.status_code == 200 and b"invalid_argument" in r.content, r.content
    r = httpx.post(f"{API}/process.Process/Start", headers=h, content=b"xx")
    assert b"invalid_argument" in r.content and b"envelope" in r.content, r.content
    # Binary protobuf is refused by name.
    h2 = {"E2b-Sandbox-Id": sid, "X-Access-Token": token, "Content-Type": "application/proto"}
    r = httpx.post(f"{API}/filesystem.Filesystem/Stat", headers=h2, content=b"\x0a\x01/")
    assert r.status_code == 400 and "JSON codec" in r.json()["message"], r.text
    # Oversized upload (declared past --max-upload, 4 GiB by default): 413 from the head alone,
    # naming the flag, nothing written.
    import socket
    from urllib.parse import urlparse

    u = urlparse(API)
    with socket.create_connection((u.hostname, u.port or 80), timeout=30) as s:
        s.sendall(
            (
                "POST /files?path=/tmp/big HTTP/1.1\r\nHost: crab\r\n"
                f"E2b-Sandbox-Id: {sid}\r\nX-Access-Token: {token}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {5 << 30}\r\n\r\n"
            ).encode()
        )
        answer = b""
        while b"}" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"--max-upload" in answer, answer[:300]
    assert not sb.files.exists("/tmp/big")
    # Unsupported calls answer unimplemented with a reason.
    try:
        sb.pty.create(size=__import__("e2b").PtySize(rows=24, cols=80))
        raise AssertionError("a PTY was created")
    except SandboxException as e:
        assert "PTY" in str(e), e
    # Paused sandbox: 409 on a second pause is covered in pause_connect; the sandbox still works.
    assert sb.commands.run("echo still-fine").stdout == "still-fine\n"
    sb.kill()


async def check_async():
    sb = await AsyncSandbox.create(TEMPLATE)
    made.append(sb.sandbox_id)
    r = await sb.commands.run("echo async; exit 0")
    assert r.stdout == "async\n"
    out = []
    await sb.commands.run("echo a; sleep 0.1; echo b", on_stdout=out.append)
    assert "".join(out) == "a\nb\n", out
    await sb.files.write("/tmp/x.txt", "async-file")
    assert await sb.files.read("/tmp/x.txt") == "async-file"
    assert [e.name for e in await sb.files.list("/tmp") if e.name == "x.txt"] == ["x.txt"]
    h = await sb.commands.run("sleep 600", background=True)
    assert await sb.commands.kill(h.pid)
    assert await sb.kill()


def check_default_user():
    """Issue 28: the unmodified SDK as E2B's users call it. A background server of the default
    user (uid 1000) holding its state only in memory survives create_snapshot() + a sandbox
    from it, pause() + connect(), and a fork — on a host whose root lacks CAP_SYS_RESOURCE
    too: the sandbox's user namespace is the daemon's, where it holds every capability."""
    sb = create()
    sb.files.write(
        "/home/user/server.py",
        "import http.server as h, itertools\n"
        "c = itertools.count(1)\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(s):\n"
        "        b = str(next(c)).encode(); s.send_response(200); s.end_headers(); s.wfile.write(b)\n"
        "    def log_message(s, *a): pass\n"
        "h.HTTPServer(('127.0.0.1', 8002), H).serve_forever()\n",
    )
    sb.commands.run("python3 /home/user/server.py", background=True)
    hit = "for i in $(seq 50); do curl -sf localhost:8002 && exit 0; sleep 0.1; done; exit 1"
    assert sb.commands.run(hit).stdout == "1"
    owner = sb.commands.run("ps -o user=,uid= -C python3", user="root").stdout.split()
    assert owner == ["user", "1000"], owner
    assert sb.commands.run("id -u").stdout.strip() == "1000"
    # A snapshot with its memory, and a sandbox from it.
    snap = sb.create_snapshot()
    assert sb.commands.run(hit).stdout == "2"
    child = create(snap.snapshot_id)
    assert child.commands.run(hit).stdout == "2", "the snapshot lost the server's memory"
    child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id)
    # Pause, then connect.
    assert sb.pause()
    assert sb.get_info().state.value == "paused"
    again = Sandbox.connect(sb.sandbox_id)
    assert again.commands.run(hit).stdout == "3", "the pause lost the server's memory"
    # A fork.
    kids = again.fork(count=1)
    made.extend(k.sandbox_id for k in kids)
    assert kids[0].commands.run(hit).stdout == "4", "the fork lost the server's memory"
    assert again.commands.run(hit).stdout == "4"
    for k in [*kids, again]:
        k.kill()


def daemon_hwm_kib():
    """The Crab daemon's peak resident memory (VmHWM), KiB (CRAB_DAEMON_PID names it)."""
    with open(f"/proc/{os.environ['CRAB_DAEMON_PID']}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def check_large_bodies():
    """Issue 28: a 200 KiB environment and a 100 KiB command start (the kernel's 128 KiB per
    argument is named when a command passes it); a 1 GiB upload through /files streams to the
    sandbox (sha256 read back inside) with the daemon's memory bounded; a declared upload over
    --max-upload is refused before a byte is written, naming the flag."""
    import hashlib
    import tempfile

    sb = create()
    env = {"BIG1": "a" * 100_000, "BIG2": "b" * 100_000}
    r = sb.commands.run('printf %s "$BIG1$BIG2" | sha256sum', envs=env)
    assert r.stdout.split()[0] == hashlib.sha256((env["BIG1"] + env["BIG2"]).encode()).hexdigest(), r
    r = sb.commands.run("printf %s " + "c" * 100_000 + " | wc -c")
    assert r.stdout.strip() == "100000", r
    try:
        sb.commands.run("printf %s " + "c" * 200_000 + " | wc -c")
        raise AssertionError("a 200 KB argument ran")
    except InvalidArgumentException as e:
        assert "MAX_ARG_STRLEN" in str(e) and "stdin" in str(e), e
    # envd's Process/Start takes an argv (the SDK sends one `bash -l -c` string): a 1 MB
    # command line in ten arguments, sent as a raw Connect stream.
    import base64
    import struct

    args = [chr(ord("a") + i) * 100_000 for i in range(10)]
    req = {"process": {"cmd": "/bin/sh", "args": ["-c", 'printf %s "$*" | sha256sum; echo $#', "sh", *args]}}
    payload = json.dumps(req).encode()
    h = {
        "E2b-Sandbox-Id": sb.sandbox_id,
        "X-Access-Token": sb._envd_access_token,
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
    }
    r = httpx.post(f"{API}/process.Process/Start", headers=h, content=struct.pack(">BI", 0, len(payload)) + payload, timeout=60)
    out, rest = b"", r.content
    while len(rest) >= 5:
        flags, n = struct.unpack(">BI", rest[:5])
        msg, rest = json.loads(rest[5 : 5 + n]), rest[5 + n :]
        assert "error" not in msg, msg
        data = msg.get("event", {}).get("data", {})
        out += base64.b64decode(data.get("stdout", ""))
    assert out.decode().split() == [hashlib.sha256(" ".join(args).encode()).hexdigest(), "-", "10"], out[:300]
    # 1 GiB, generated into a file as it is hashed (the SDK sends a file object as it reads it).
    sha = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir="/var/tmp") as f:
        for _ in range(1024):
            b = os.urandom(1 << 20)
            sha.update(b)
            f.write(b)
        f.flush()
        f.seek(0)
        before = daemon_hwm_kib()
        sb.files.write("/home/user/big", f)
        after = daemon_hwm_kib()
    print(f"daemon VmHWM 1 GiB E2B upload: {before} KiB before, {after} KiB after", flush=True)
    r = sb.commands.run("sha256sum /home/user/big; stat -c %s /home/user/big; rm /home/user/big")
    assert r.stdout.split() == [sha.hexdigest(), "/home/user/big", str(1 << 30)], r.stdout
    assert after - before < 256 * 1024, f"the daemon grew by {after - before} KiB for a 1 GiB upload"
    # Declared larger than --max-upload (4 GiB by default): a sparse file, whose length the SDK
    # declares for a real file object, refused before a byte is written.
    with tempfile.NamedTemporaryFile(dir="/var/tmp") as f:
        f.truncate(5 << 30)
        try:
            with open(f.name, "rb") as sparse:
                sb.files.write("/home/user/never", sparse)
            raise AssertionError("a 5 GiB upload was taken")
        except (SandboxException, httpx.TransportError) as e:
            # The daemon answers from the head and closes the connection; an SDK still writing
            # its body may see that end (a broken pipe, raised as httpx's WriteError) before it
            # reads the answer.
            if "413" in str(e):
                assert "--max-upload" in str(e), e
            else:
                assert "Broken pipe" in str(e) or "connection" in str(e).lower(), e
    # The answer itself, asked the way the SDK does but with no body sent.
    api = sb.files._envd_api
    u = urllib.parse.urlsplit(str(api.base_url))
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.putrequest("POST", "/files?path=%2Fhome%2Fuser%2Fnever", skip_accept_encoding=True)
    for k, v in api.headers.items():
        if k.lower() not in ("host", "content-length", "transfer-encoding", "content-type"):
            c.putheader(k, v)
    c.putheader("Content-Type", "application/octet-stream")
    c.putheader("Content-Length", str(5 << 30))
    c.endheaders()
    r = c.getresponse()
    body = r.read().decode(errors="replace")
    c.close()
    assert r.status == 413 and "--max-upload" in body, (r.status, body)
    assert not sb.files.exists("/home/user/never")
    sb.kill()


CHECKS = [
    ("create_run_files", check_create_run_files),
    ("background", check_background),
    ("async", lambda: asyncio.run(check_async())),
    ("errors", check_errors),
    ("snapshots_fork", check_snapshots_and_fork),
    ("pause_connect", check_pause_connect),
    ("pause_keeps_commands", check_pause_keeps_commands),
    ("dead_sandbox", check_dead_sandbox),
    ("stdin", check_stdin),
    ("timeout", check_timeout),
    ("default_user", check_default_user),
    ("large_bodies", check_large_bodies),
]


def main():
    failed = 0
    try:
        for name, f in CHECKS:
            if ONLY and name not in ONLY:
                continue
            t = time.time()
            try:
                f()
                print(f"ok {name} ({time.time() - t:.1f} s)", flush=True)
            except Exception:
                failed += 1
                print(f"FAILED {name}", flush=True)
                traceback.print_exc()
    finally:
        for sid in made:
            try:
                Sandbox.kill(sid)
            except Exception as e:  # noqa: BLE001 - cleanup is best effort, reported
                print(f"cleanup of {sid}: {e}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
