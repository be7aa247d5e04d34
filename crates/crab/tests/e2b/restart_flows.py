"""The unmodified `e2b` SDK across a restart of the daemon that serves it.

Run by crates/crab/tests/e2b.rs (`sdk_state_survives_a_daemon_restart`) against a second daemon of
its own, in two phases: `restart_flows.py before STATE.json` (before the restart: makes sandboxes
and a snapshot, writes what it made to STATE.json) and `restart_flows.py after STATE.json` (after
it: the same sandboxes answer). Prints `ok PHASE`; any failure raises (non-zero exit).
"""

import json
import os
import sys
import threading
import time

import httpx
from e2b import Sandbox
from e2b.exceptions import NotFoundException, SandboxException
from e2b.sandbox.commands.command_handle import CommandExitException

API = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
# Seconds the timeout sandbox lives (made at the end of phase 1): it must outlive the restart.
TIMEOUT_S = int(os.environ.get("CRAB_E2B_RESTART_TIMEOUT", "20"))


def rest(method, path, **kw):
    return httpx.request(method, API + path, headers={"X-API-Key": KEY}, timeout=60, **kw)


def detail(sid):
    r = rest("GET", f"/sandboxes/{sid}")
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def envd_stat(sid, token, path):
    """An envd call with a token handed out before the restart (as an old SDK handle sends it)."""
    return httpx.post(
        API + "/filesystem.Filesystem/Stat",
        headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token, "Content-Type": "application/json"},
        json={"path": path},
        timeout=30,
    )


def gone(sid):
    try:
        Sandbox.get_info(sid)
        return False
    except NotFoundException:
        return True
    except SandboxException as e:
        if "404" in str(e) or "not found" in str(e):
            return True
        raise


def swallow(f):
    try:
        f()
    except Exception:  # noqa: BLE001 - the stream ends with the daemon; that is the point
        pass


def until(what, cond, timeout=10.0):
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def before(state_path):
    worker = Sandbox.create("base", metadata={"role": "worker"}, envs={"FROM_CREATE": "kept"})
    worker.files.write("/home/user/notes.txt", "written before the restart")
    worker.commands.run("echo 41 > /tmp/counter")
    # Background commands across the restart: one keeps running (and printing), one ends while
    # the daemon is down (the test creates /tmp/stop-now in its root from the host).
    seen = []
    ticker = worker.commands.run(
        "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done", background=True
    )
    # The sync SDK hands a background command's output only to wait()'s callbacks.
    threading.Thread(target=lambda: swallow(lambda: ticker.wait(on_stdout=seen.append)), daemon=True).start()
    until("the ticker's output", lambda: "tick 1" in "".join(seen))
    stopper = worker.commands.run(
        "while [ ! -e /tmp/stop-now ]; do sleep 0.1; done; echo bye; exit 7", background=True
    )
    listed = [p.pid for p in worker.commands.list()]
    assert ticker.pid in listed and stopper.pid in listed, listed
    # Paused before the restart, resumed after it (its pause point is persisted).
    sleeper = Sandbox.create("base")
    sleeper.commands.run(
        "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.1; done' >/dev/null 2>&1 &",
        user="root",
    )
    time.sleep(0.3)
    assert sleeper.pause()
    source = Sandbox.create("base")
    source.files.write("/home/user/snap.txt", "in the snapshot")
    # A process with in-memory state, dumped into the full snapshot (as root: see docs/e2b.md).
    source.commands.run("nohup sleep 1000 >/dev/null 2>&1 &", user="root")
    snap = source.create_snapshot()
    # E2B semantics: a snapshot outlives its sandbox.
    source.kill()
    assert gone(source.sandbox_id), "a killed sandbox is still listed"
    assert source.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    child = Sandbox.create(snap.snapshot_id)
    assert child.files.read("/home/user/snap.txt") == "in the snapshot"
    assert child.commands.run("pgrep -x sleep >/dev/null && echo up").stdout == "up\n"
    child.kill()
    # Removed through the CLI by the test before the restart: the E2B API must forget it.
    doomed = Sandbox.create("base")
    # Last, so its timeout only has to outlive the restart.
    timer = Sandbox.create("base", timeout=TIMEOUT_S)
    state = {
        "worker": worker.sandbox_id,
        "worker_token": detail(worker.sandbox_id)["envdAccessToken"],
        "timer": timer.sandbox_id,
        "timer_end": detail(timer.sandbox_id)["endAt"],
        "source": source.sandbox_id,
        "sleeper": sleeper.sandbox_id,
        "doomed": doomed.sandbox_id,
        "snapshot": snap.snapshot_id,
        "ticker": ticker.pid,
        "stopper": stopper.pid,
    }
    with open(state_path, "w") as f:
        json.dump(state, f)
    print("ok before", flush=True)


def after(state_path):
    with open(state_path) as f:
        st = json.load(f)
    # Removed through the CLI: gone from the E2B API too, its state file with it.
    assert gone(st["doomed"]), "a sandbox removed with crab sandbox rm is still known"
    # The timeout sandbox is still there, with the deadline it had (absolute, not re-armed).
    assert not gone(st["timer"]), "the timeout sandbox was forgotten (or expired early)"
    assert detail(st["timer"])["endAt"] == st["timer_end"], "the deadline moved across the restart"
    # The worker: the token handed out before the restart still opens envd, connect works, and
    # so do commands (with the create-time envs) and files.
    d = detail(st["worker"])
    assert d["envdAccessToken"] == st["worker_token"], "the access token changed"
    assert d["metadata"] == {"role": "worker"}, d["metadata"]
    r = envd_stat(st["worker"], st["worker_token"], "/home/user/notes.txt")
    assert r.status_code == 200, (r.status_code, r.text)
    assert envd_stat(st["worker"], "wrong", "/home/user").status_code == 401
    sb = Sandbox.connect(st["worker"])
    assert sb.files.read("/home/user/notes.txt") == "written before the restart"
    r = sb.commands.run("cat /tmp/counter; echo $FROM_CREATE")
    assert r.stdout == "41\nkept\n", repr(r.stdout)
    # The envd process table came back: the ticker still runs (listed, followed by pid, killed
    # by pid); the stopper ended while the daemon was down: not listed, and connecting to it
    # by pid tells its exit status.
    listed = [p.pid for p in sb.commands.list()]
    assert st["ticker"] in listed and st["stopper"] not in listed, (listed, st)
    try:
        sb.commands.connect(st["stopper"]).wait()
        raise AssertionError("the stopper's exit 7 was not reported")
    except CommandExitException as e:
        assert e.exit_code == 7, e.exit_code
    seen, box = [], {}
    t = sb.commands.connect(st["ticker"])

    def wait():
        try:
            t.wait(on_stdout=seen.append)
        except Exception as e:  # noqa: BLE001 - asserted below
            box["error"] = e

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    until("the ticker's output after the restart", lambda: "tick" in "".join(seen))
    assert sb.commands.kill(st["ticker"])
    waiter.join(20)
    assert not waiter.is_alive(), "wait() of a killed command hung"
    assert isinstance(box.get("error"), CommandExitException), box
    assert st["ticker"] not in [p.pid for p in sb.commands.list()]
    left = sb.commands.run(
        f"for i in $(seq 50); do [ -d /proc/{st['ticker']} ] || {{ echo gone; exit 0; }}; sleep 0.1; done; echo still"
    )
    assert left.stdout == "gone\n", left.stdout
    listed = [s.sandbox_id for s in Sandbox.list().next_items()]
    assert st["worker"] in listed and st["timer"] in listed, listed
    # The paused one is still paused, and connect resumes it with its process.
    assert detail(st["sleeper"])["state"] == "paused"
    woke = Sandbox.connect(st["sleeper"])
    assert woke.get_info().state.value == "running"
    a = int(woke.commands.run("cat /tmp/tick").stdout)
    time.sleep(0.4)
    assert int(woke.commands.run("cat /tmp/tick").stdout) > a, "the loop did not come back"
    woke.kill()
    # The snapshot taken before the kill still makes sandboxes after the restart; its killed
    # source stays hidden.
    assert st["source"] not in listed and gone(st["source"])
    child = Sandbox.create(st["snapshot"])
    assert child.files.read("/home/user/snap.txt") == "in the snapshot"
    assert child.commands.run("pgrep -x sleep >/dev/null && echo up").stdout == "up\n"
    child.kill()
    snaps = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=st["source"]).next_items()]
    assert snaps == [st["snapshot"]], snaps
    # Deleting the last snapshot removes the killed source for good (the test checks the host).
    assert Sandbox.delete_snapshot(st["snapshot"]) is True
    assert Sandbox.delete_snapshot(st["snapshot"]) is False
    assert Sandbox.list_snapshots(sandbox_id=st["source"]).next_items() == []
    # The watchdog resumed with the persisted deadline: the timer dies on time.
    end = time.time() + TIMEOUT_S + 10
    while not gone(st["timer"]):
        assert time.time() < end, "the timeout did not fire after the restart"
        time.sleep(0.5)
    sb.kill()
    print("ok after", flush=True)


if __name__ == "__main__":
    {"before": before, "after": after}[sys.argv[1]](sys.argv[2])
