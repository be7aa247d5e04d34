"""The blocking SDK against a real daemon: create, exec, files, checkpoint, restore, fork,
turns, errors, capability flags."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

import crab_sandbox as cs
from crab_sandbox import Daemon, Sandbox

from conftest import Cleanup, unique


def test_create_connect_info_kill(daemon: Daemon) -> None:
    name = unique("py-life")
    with Sandbox.create("debian", name=name, memory="256M", cpus=0.5, network="none", daemon=daemon) as sb:
        assert sb.name == name
        info = sb.info()
        assert info.state == "running" and info.net == "none" and info.image == "debian"
        assert info.raw["profile"]["name"] == "default"
        again = Sandbox.connect(name, daemon=daemon)
        assert again == sb
        assert name in [s.name for s in daemon.sandboxes()]
        # The limits reached the cgroup (memory.max on v2, else v1's limit_in_bytes).
        limit = sb.exec(
            "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || echo none"
        )
        assert limit.exit_code == 0
    # The context manager removed it.
    with pytest.raises(cs.SandboxNotFoundError):
        Sandbox.connect(name, daemon=daemon)


def test_user_namespace_modes(daemon: Daemon) -> None:
    # Default: root inside is an unprivileged uid of the daemon's range outside (issue 28).
    with Sandbox.create("debian", daemon=daemon) as sb:
        first, host, count = sb.exec("cat /proc/self/uid_map").stdout.split()
        assert (first, count) == ("0", "65536") and int(host) > 0
        assert sb.exec("id -u").stdout == "0\n"
        assert host in sb.info().raw["profile"]["user_namespace"]
    # userns="host": the host's ids (uid 0 is the host's root).
    with Sandbox.create("debian", userns="host", daemon=daemon) as sb:
        assert sb.exec("cat /proc/self/uid_map").stdout.split() == ["0", "0", "4294967295"]
    with pytest.raises(cs.InvalidRequestError) as e:
        Sandbox.create("debian", userns="shared", daemon=daemon)
    assert "private" in str(e.value) and "host" in str(e.value)


def test_exec(sandbox: Sandbox) -> None:
    r = sandbox.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert not r.ok and r.duration_ms > 0
    r = sandbox.exec(["sh", "-c", 'printf "%s|%s|%s" "$A" "$B" "$(pwd)"'], cwd="/tmp", env={"A": "1", "B": "x y"})
    assert r.stdout == "1|x y|/tmp"
    r = sandbox.exec(["wc", "-c"], stdin=b"\x00" * 1000)
    assert r.stdout.strip() == "1000"
    # A non-UTF-8 byte survives in stdout_bytes.
    r = sandbox.exec(["printf", "\\377"])
    assert r.stdout_bytes == b"\xff"


def test_exec_stream_arrives_live_and_close_kills(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    events = []
    for ev in sandbox.exec_stream("echo a; sleep 0.5; echo b >&2; exit 3"):
        events.append((ev.kind, ev.data, round(time.monotonic() - t0, 1)))
        last = ev
    kinds = [e[0] for e in events]
    # Two pipes: their frames arrive in either order; the exit comes last.
    assert sorted(kinds[:-1]) == ["stderr", "stdout"] and kinds[-1] == "exit", kinds
    assert events[0][1] == b"a\n" and events[1][1] == b"b\n"
    assert events[0][2] < 0.4, f"the first line arrived only at the end: {events}"
    assert last.exit_code == 3
    # Leaving the stream early kills the command (the daemon sees the connection close).
    marker = unique("sleeper")
    # bash: dash's `exec` has no `-a` (it failed at once, racing its error against "started").
    gen = sandbox.exec_stream(["bash", "-c", f"echo started; exec -a {marker} sleep 60"])
    first = next(gen)
    assert first.kind == "stdout" and first.data == b"started\n", first
    assert marker in sandbox.exec("ps -eo args").stdout, "the command is not running"
    gen.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if marker not in sandbox.exec("ps -eo args").stdout:
            break
        time.sleep(0.1)
    else:
        pytest.fail("closing the stream did not kill the command")


def test_exec_timeout(sandbox: Sandbox) -> None:
    with pytest.raises(cs.CommandTimeoutError) as ei:
        sandbox.exec("echo before; sleep 30", timeout=0.5)
    e = ei.value
    assert isinstance(e, TimeoutError) and e.code == "timeout" and e.hint
    assert e.result is not None and e.result.timed_out and e.result.stdout == "before\n"
    assert e.result.duration_ms < 10_000


def test_files(sandbox: Sandbox, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 512
    sandbox.write_file("/work/deep/dir/blob.bin", blob, mode=0o750)
    assert sandbox.read_file("/work/deep/dir/blob.bin") == blob
    assert sandbox.exec("stat -c %a /work/deep/dir/blob.bin").stdout.strip() == "750"
    sandbox.write_file("/work/t.txt", "héllo\n")
    assert sandbox.read_file("/work/t.txt").decode() == "héllo\n"
    with pytest.raises(cs.PathNotFoundError) as ei:
        sandbox.read_file("/work/missing")
    assert "/work/missing" in ei.value.message and ei.value.hint
    assert isinstance(ei.value, FileNotFoundError) and ei.value.code == "not_found"

    # upload/download of a tree, with a symlink and an executable bit
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(src / "sub" / "run.sh", 0o755)
    (src / "link").symlink_to("a.txt")
    sandbox.upload(src, "/work/tree")
    assert sandbox.exec("/work/tree/sub/run.sh").stdout == "ran\n"
    assert sandbox.exec("readlink /work/tree/link").stdout.strip() == "a.txt"
    sandbox.exec("echo made-inside > /work/tree/inside.txt")
    back = tmp_path / "back"
    sandbox.download("/work/tree", back)
    assert (back / "a.txt").read_text() == "A"
    assert (back / "inside.txt").read_text() == "made-inside\n"
    assert os.access(back / "sub" / "run.sh", os.X_OK)
    assert os.readlink(back / "link") == "a.txt"
    # single files both ways
    one = tmp_path / "one.bin"
    one.write_bytes(b"\x01\x02")
    sandbox.upload(one, "/work/one.bin")
    sandbox.download("/work/one.bin", tmp_path / "one-back.bin")
    assert (tmp_path / "one-back.bin").read_bytes() == b"\x01\x02"


def test_checkpoint_restore_files_and_processes(sandbox: Sandbox) -> None:
    assert sandbox.restores_processes, "this daemon reports no CRIU: process restore untested"
    sandbox.write_file("/work/state.txt", "v1")
    # A long-lived process with state only in memory: a counter it prints on demand.
    sandbox.exec(
        ["sh", "-c", "python3 -c 'import time\nn=41\nwhile True: time.sleep(0.05)' >/dev/null 2>&1 & echo $! > /work/pid"]
    )
    pid = sandbox.read_file("/work/pid").decode().strip()
    p = sandbox.checkpoint(kind="full")
    assert p.kind == "full" and p.restores_processes and p.sandbox == sandbox.name
    assert p.id in [q.id for q in sandbox.points()]
    sandbox.write_file("/work/state.txt", "v2")
    sandbox.exec(f"kill -9 {pid}")
    # Killed, then reaped by the sandbox's init (until then a zombie still answers `kill -0`).
    gone = sandbox.exec(f"for i in $(seq 100); do kill -0 {pid} 2>/dev/null || exit 0; sleep 0.05; done; exit 1")
    assert gone.exit_code == 0, "the killed process is still there after 5 s"
    rep = sandbox.restore(p)
    assert rep.point == p.id and rep.processes_restored
    assert sandbox.read_file("/work/state.txt") == b"v1"
    assert sandbox.exec(f"kill -0 {pid}").exit_code == 0, "the process did not come back"
    # auto: the inspector decides; nothing changed since the restore -> no new parts needed.
    q = sandbox.checkpoint()
    assert q.kind in ("skip", "fs", "process", "full") and "verdict" in q.raw
    # restore(None) = the newest
    sandbox.write_file("/work/state.txt", "v3")
    assert sandbox.restore().point == q.id
    assert sandbox.read_file("/work/state.txt") == b"v1"


def test_fork(sandbox: Sandbox, cleanup: Cleanup) -> None:
    sandbox.write_file("/work/f.txt", "base")
    p = sandbox.checkpoint(kind="fs")
    assert not p.restores_processes and p.parts.startswith("f")
    sandbox.write_file("/work/f.txt", "after")
    names = [unique("py-br"), unique("py-br")]
    branches = sandbox.fork(2, p, names=names)
    cleanup.add(*branches)
    assert [b.name for b in branches] == names
    for i, b in enumerate(branches):
        assert b.read_file("/work/f.txt") == b"base"
        b.write_file("/work/f.txt", f"branch{i}")
    assert [b.read_file("/work/f.txt") for b in branches] == [b"branch0", b"branch1"]
    assert sandbox.read_file("/work/f.txt") == b"after"
    # fork of the newest point by default, generated names
    more = sandbox.fork(1)
    cleanup.add(*more)
    assert more[0].name != sandbox.name and more[0].read_file("/work/f.txt") == b"base"


def test_turn_and_conversation(sandbox: Sandbox) -> None:
    t1 = sandbox.turn()
    sandbox.exec("echo x > /work/turned")
    t2 = sandbox.turn()
    assert t2.turn > t1.turn and t2.checkpoint != t1.checkpoint
    assert t2.checkpoint in [p.id for p in sandbox.points()]
    # No LLM traffic went through the proxy: the conversation is empty.
    assert sandbox.conversation() == []


def test_llm_base_url_reaches_the_proxy(daemon: Daemon, sandbox: Sandbox) -> None:
    listen = daemon.version()["proxy_listen"]
    assert sandbox.llm_base_url == f"http://{listen}/s/{sandbox.name}/v1"
    assert cs.IN_SANDBOX_LLM_BASE_URL == "http://127.0.0.1:7431/v1"
    # The proxy knows the sandbox (an unknown one is a 404 naming it); the request itself
    # goes nowhere (no upstream here) and fails with the proxy's own status.
    known = httpx.post(sandbox.llm_base_url + "/chat/completions", content=b"{", timeout=30)
    unknown = httpx.post(f"http://{listen}/s/{unique('nope')}/v1/chat/completions", content=b"{", timeout=30)
    assert unknown.status_code == 404
    assert known.status_code == 400, known.text  # malformed body, seen by the proxy for this sandbox


def test_errors_carry_code_and_hint(daemon: Daemon, sandbox: Sandbox) -> None:
    with pytest.raises(cs.SandboxNotFoundError) as ei:
        Sandbox.connect(unique("missing"), daemon=daemon)
    assert ei.value.code == "sandbox_not_found" and ei.value.hint and ei.value.status == 404
    assert isinstance(ei.value, cs.NotFoundError) and isinstance(ei.value, LookupError)
    with pytest.raises(cs.ImageNotFoundError):
        Sandbox.create("no-such-image", daemon=daemon)
    with pytest.raises(cs.NameConflictError):
        Sandbox.create("debian", name=sandbox.name, daemon=daemon)
    with pytest.raises(cs.InvalidRequestError):
        Sandbox.create("debian", name="Bad Name!", daemon=daemon)
    with pytest.raises(cs.InvalidRequestError) as ei2:
        sandbox.checkpoint(kind="bogus")
    assert "auto" in ei2.value.hint
    with pytest.raises(cs.CheckpointNotFoundError):
        sandbox.restore("c999999")
    # Bad input left the sandbox intact.
    assert sandbox.exec("true").exit_code == 0
    # No remote store: durable=True fails closed, before any point is taken.
    before = len(sandbox.points())
    if not sandbox.durable:
        with pytest.raises(cs.CapabilityError):
            sandbox.checkpoint(durable=True)
        assert len(sandbox.points()) == before
    with pytest.raises(cs.DaemonUnavailableError) as ei3:
        Sandbox.connect("x", socket="/nonexistent/crab.sock")
    assert "/nonexistent/crab.sock" in str(ei3.value) and "crab daemon" in ei3.value.hint


def test_unknown_code_maps_to_base_class() -> None:
    e = cs.errors.error_from_body({"code": "brand_new", "message": "m", "hint": "h"}, 418)
    assert type(e) is cs.CrabError and e.code == "brand_new" and str(e) == "m (hint: h)"
    for code, cls in cs.errors.ERROR_CLASSES.items():
        assert isinstance(cs.errors.error_from_body({"code": code, "message": ""}), cls)


def test_every_daemon_error_code_has_a_class() -> None:
    """The daemon's codes (crates/crab-common/src/error.rs, ErrorCode::as_str) all map to a class."""
    import re

    from conftest import ROOT

    src = (ROOT / "crates" / "crab-common" / "src" / "error.rs").read_text()
    body = src[src.index("pub fn as_str") :]
    body = body[: body.index("\n    }\n")]
    codes = set(re.findall(r'=> "([a-z_]+)"', body))
    assert codes and codes == set(cs.errors.ERROR_CLASSES), codes ^ set(cs.errors.ERROR_CLASSES)


def test_capabilities(daemon: Daemon) -> None:
    caps = daemon.capabilities(refresh=True)
    v = daemon.version()
    assert caps.restores_processes == v["features"]["criu"]["available"]
    assert caps.durable == v["features"]["remote"]["available"]
    assert caps.proxy_listen == v["proxy_listen"]
