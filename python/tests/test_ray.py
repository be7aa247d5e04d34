"""crab_sandbox.ray on a real two-node Ray cluster on loopback: `ray start --head` (127.0.0.2)
and `ray start --address` (127.0.0.3), each "node" bound to its own Crab daemon (own state
dir, pool and proxy port) and both daemons sharing one file:// remote store — the shape of two
hosts. Rollouts fork across the nodes (the SDK's own test, then examples/ray_tree_rollouts.py);
a rollout whose node is lost — its daemon killed, its state dir deleted, its Ray node stopped —
finishes on the other from its last durable point (examples/ray_spot.py; runs last).

Cost (debug build, loaded 2-core machine): ≈ 2 min — the image is imported into both daemons
(≈ 20 s each), the rest is forks, restores from the store and Ray's own start-up. The daemons'
state dirs (under $CRAB_RAY_TEST_DIR, default /var/lib/crab-pyray) are made fresh for every run
and deleted afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from conftest import ROOT, cannot_run, crab_bin, start_daemon, state_dir, unique, wait_up

try:
    import ray
except ImportError:  # the venv without --with-ray
    ray = None

from crab_sandbox import Daemon, Sandbox  # noqa: E402

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
BASE = Path(os.environ.get("CRAB_RAY_TEST_DIR", "/var/lib/crab-pyray"))


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


class Node:
    """One `ray start --block` in its own session, so it and its children stop together."""

    def __init__(self, args: List[str], env: Dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [ray_bin(), "start", "--block", "--disable-usage-stats", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # stragglers of the group (workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def own_daemon(state: Path, remote: str) -> Daemon:
    d = Daemon(state / "crab.sock")
    if not wait_up(d, 0.1):
        start_daemon(str(state), "--pool-size", "8G", "--remote", remote, "--proxy-listen", "127.0.0.1:0")
        if not wait_up(d, 60):
            cannot_run(f"the test daemon on {state} did not come up; see {state}/logs/daemon.log")
    return d


def stop_daemon(state: Path) -> None:
    try:
        pid = int((state / "daemon.pid").read_text().split()[0])
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(400):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def wipe(state: Path) -> None:
    """Stop the test daemon on ``state`` and delete the state dir (its mounts unmounted first):
    every run starts from fresh daemons, so a pool left broken by an earlier run (host disk
    full) cannot fail this one, and nothing stays on the host's disk afterwards."""
    stop_daemon(state)
    # The daemon's mounts in its state dir: the pool and the empty read-only tmpfs that masked
    # paths are bound from.
    for mount in (state / "pool", state / "masked"):
        if os.path.ismount(mount):
            subprocess.run(["umount", str(mount)], check=False)
            if os.path.ismount(mount):
                subprocess.run(["umount", "-l", str(mount)], check=False)
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(daemon: Daemon) -> Iterator[Dict[str, object]]:
    if ray is None:
        cannot_run("ray is not installed in this venv: scripts/install-python-sdk.sh --with-ray")
    store = Path(f"{BASE}-remote")
    remote = f"file://{store}"
    a_state, b_state = Path(f"{BASE}-a"), Path(f"{BASE}-b")
    for st in (a_state, b_state):
        wipe(st)
    # The shared remote starts empty too (it grew by every earlier run's points).
    shutil.rmtree(store, ignore_errors=True)
    da, db = own_daemon(a_state, remote), own_daemon(b_state, remote)
    # Both nodes have the image (the spot example starts its rollout on B).
    for d, st in ((da, a_state), (db, b_state)):
        if "debian" not in [i["name"] for i in d.request("GET", "/v1/images")]:
            src = Path(state_dir()) / "pool" / "images" / "debian"
            subprocess.run(
                [crab_bin(), "--state-dir", str(st), "image", "import", "debian", str(src)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    tmp = Path(f"/tmp/crab-pyray-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port(HEAD_IP)
    env = dict(os.environ)
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": str(ROOT / "python" / "src"),
        }
    )
    resources = '{"crab": 100}'
    head = Node(
        [
            "--head",
            f"--node-ip-address={HEAD_IP}",
            f"--port={port}",
            "--num-cpus=1",
            f"--resources={resources}",
            "--include-dashboard=false",
            f"--temp-dir={tmp}",
        ],
        {**env, "CRAB_STATE_DIR": str(a_state)},
        tmp / "head.log",
    )
    nodes = [head]
    try:
        address = f"{HEAD_IP}:{port}"
        deadline = time.monotonic() + 120
        while subprocess.run(
            [ray_bin(), "status", f"--address={address}"], capture_output=True
        ).returncode != 0:
            if time.monotonic() > deadline or head.proc.poll() is not None:
                pytest.fail(f"the Ray head did not come up: {(tmp / 'head.log').read_text()[-2000:]}")
            time.sleep(1)
        worker = Node(
            [f"--address={address}", f"--node-ip-address={WORKER_IP}", "--num-cpus=1", f"--resources={resources}"],
            {**env, "CRAB_STATE_DIR": str(b_state)},
            tmp / "worker.log",
        )
        nodes.append(worker)
        ray.init(address=address, _node_ip_address=HEAD_IP, log_to_driver=False)
        from crab_sandbox.ray import crab_nodes

        deadline = time.monotonic() + 120
        while len(crab_nodes()) < 2:
            if time.monotonic() > deadline:
                pytest.fail(f"the second Ray node did not join: {(tmp / 'worker.log').read_text()[-2000:]}")
            time.sleep(0.5)
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        yield {"a": by_ip[HEAD_IP], "b": by_ip[WORKER_IP], "da": da, "db": db, "worker": worker, "b_state": b_state}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for n in reversed(nodes):
            n.stop()
        for st in (a_state, b_state):
            wipe(st)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


def test_fork_spreads_branches_across_nodes_with_their_processes(cluster: Dict[str, object]) -> None:
    from crab_sandbox.ray import CrabSandbox, create

    a, b, da, db = cluster["a"], cluster["b"], cluster["da"], cluster["db"]
    assert isinstance(da, Daemon) and isinstance(db, Daemon)
    made: List[Sandbox] = []
    try:
        # The task sandbox on node A, mid-trajectory: files and a live process.
        task = create("debian", name=unique("ray-task"), node=a)
        assert ray.get(task.node_id.remote()) == a
        made.append(Sandbox(ray.get(task.name.remote()), da))
        r = ray.get(task.exec.remote("mkdir -p /work && echo base > /work/f && (nohup sleep 999 >/dev/null 2>&1 &)"))
        assert r.exit_code == 0, r
        assert ray.get(task.capabilities.remote()) == {"restores_processes": True, "durable": True}
        p = ray.get(task.checkpoint.remote(kind="full", durable=True))
        assert p.durable and p.restores_processes

        # Two rollouts from the point, spread: one lands on node B (from the remote store), one
        # on A (a local fork). Each continues differently; the states stay distinct.
        t0 = time.monotonic()
        branches = ray.get(task.fork.remote(2, p, spread=True))
        homes = ray.get([br.node_id.remote() for br in branches])
        fork_s = time.monotonic() - t0
        assert sorted(homes) == sorted([a, b]), homes
        names = ray.get([br.name.remote() for br in branches])
        for n, home in zip(names, homes):
            made.append(Sandbox(n, da if home == a else db))
        outs = ray.get(
            [br.exec.remote(f"cat /work/f; echo rollout-{i} >> /work/f; pgrep -c -x sleep") for i, br in enumerate(branches)]
        )
        for o in outs:
            assert o.exit_code == 0, o
            first, count = o.stdout.split()
            assert first == "base" and count == "1", o.stdout  # files and the process came along
        states = ray.get([br.read_file.remote("/work/f") for br in branches])
        assert states[0] != states[1] and all(s.startswith(b"base\n") for s in states), states
        assert ray.get(task.read_file.remote("/work/f")) == b"base\n"
        print(f"\nfork(2, spread) across 2 nodes: {fork_s:.1f} s (one branch from the remote store)")
    finally:
        for sb in made:
            try:
                sb.kill()
            except Exception:  # noqa: BLE001 - best effort, the daemon may be gone
                pass


def example(name: str):
    """``examples/NAME.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_ray_tree_rollouts(cluster: Dict[str, object]) -> None:
    """examples/ray_tree_rollouts.py's main as the issue has it: 8 rollouts, 4 per node (those
    on node B from one restore from the store)."""
    a, b = cluster["a"], cluster["b"]
    rep = example("ray_tree_rollouts").main(rollouts=8)
    rows = rep["rollouts"]
    assert len(rows) == 8
    assert rep["per_node"] == {a: 4, b: 4}, rep["per_node"]
    # Each continued its own way: score(10) = 10 * (i + 2); the states differ; every branch
    # kept the task's history and its running process; the task itself is untouched.
    assert [r["output"] for r in rows] == [str(10 * (i + 2)) for i in range(8)], rows
    assert rep["distinct"], rows
    assert all(r["history"] == ["base", "1"] for r in rows), rows
    assert rep["task_untouched"]


def test_inspect_strategy_resumes_on_another_node_from_the_store(cluster: Dict[str, object]) -> None:
    """crab_sandbox.inspect's durable path: attempt 1 snapshots on node A (durable in the shared
    store); attempt 2 runs on node B — a fresh sandbox there, a strategy on B's daemon, the refs
    adopted — and restore brings checkpoint 1's files and process into it from the store."""
    import asyncio
    from types import SimpleNamespace

    from crab_sandbox import AsyncDaemon, AsyncSandbox
    from crab_sandbox.inspect import CrabSnapshotStrategy

    da, db = cluster["da"], cluster["db"]
    assert isinstance(da, Daemon) and isinstance(db, Daemon)
    base = Path(f"/tmp/crab-inspect-ray-{os.getpid()}")
    sub = "sandboxes/default/crab"
    c1 = SimpleNamespace(sandbox_name="default", storage_dir=str(base / "a1" / sub), resuming=False)
    c2 = SimpleNamespace(sandbox_name="default", storage_dir=str(base / "a2" / sub), resuming=True)

    async def go() -> None:
        async with AsyncDaemon(da.socket) as a, AsyncDaemon(db.socket) as b:
            first = await AsyncSandbox.create("debian", name=unique("insp-a"), daemon=a)
            fresh = await AsyncSandbox.create("debian", name=unique("insp-b"), daemon=b)
            try:
                s1 = CrabSnapshotStrategy("full", daemon=a)
                await s1.setup(first, c1)
                await first.exec("mkdir -p /work && echo one > /work/n && (nohup sleep 4242 >/dev/null 2>&1 &)")
                ref = await s1.snapshot(first, None, 1, c1)
                assert ref.durable and ref.restores_processes, ref
                s2 = CrabSnapshotStrategy("full", daemon=b)
                await s2.setup(fresh, c2)
                await s2.adopt(SimpleNamespace(sample_checkpoints_dir=str(base / "a1"), storage_subpath=sub), c2)
                await s2.discard_orphans(1, c2)
                await s2.restore(fresh, s2.refs(c2)[-1], c2)
                r = await fresh.exec("cat /work/n; pgrep -c -x sleep")
                assert r.stdout.split() == ["one", "1"], r
            finally:
                for sb in (first, fresh):
                    try:
                        await sb.kill()
                    except Exception:  # noqa: BLE001 - best effort
                        pass

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_example_ray_spot(cluster: Dict[str, object]) -> None:
    """examples/ray_spot.py's main, node B lost for real mid-run: the example's own loss (the
    rollout's sandbox removed, B's daemon SIGKILLed, its state directory deleted), then B's Ray
    node stopped too. The rollout finishes on A from its last durable point. Runs last: B is
    gone afterwards."""
    a, b, worker, b_state = cluster["a"], cluster["b"], cluster["worker"], cluster["b_state"]
    spot = example("ray_spot")
    assert isinstance(b_state, Path)

    def lose(node: str, sandbox: str) -> None:
        assert node == b
        spot.lose_node(node, sandbox)
        assert not b_state.exists(), "the lost node's state directory is still there"
        worker.stop()  # type: ignore[attr-defined]

    with pytest.raises(SystemExit):  # refuses without being told it may destroy a node
        spot.main(node=b)
    rep = spot.main(turns=4, lose_after=3, durable_every=2, node=b, destroy_node_state=True, lose=lose)
    assert (rep["node_before"], rep["node_after"]) == (b, a), rep
    assert rep["resumed_after_turn"] == 2 and rep["turns_lost"] == 1, rep
    assert rep["log"] == ["turn 1", "turn 2", "turn 3", "turn 4"], rep["log"]
    assert rep["process_running_after_recovery"], rep
    print(f"\nrecover after node loss (ray_spot): {rep['recover_s']:.1f} s")
