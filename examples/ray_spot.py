"""A rollout that survives losing its node (a spot preemption) with Crab on a Ray cluster.

A rollout sandbox works turn by turn; after every ``durable_every``-th turn it takes a ``full``
checkpoint and waits until it is durable in the remote store. Mid-run its node is lost — the
rollout's processes, the node's Crab daemon (SIGKILL) and its whole state directory (sandboxes
and local restore points) are gone. ``CrabSandbox.recover`` brings the rollout back on another
Crab node from its newest durable point — files, processes and all — and it finishes there,
having lost only the turns after that point, which it redoes.

Setup: as in ``examples/ray_tree_rollouts.py`` (every node: a Crab daemon with the same
``--remote`` store, ``CRAB_STATE_DIR=... ray start ... --resources '{"crab": 100}'``), at least
two Crab nodes. The loss is simulated for real on the rollout's node by a Ray task pinned there:
it removes the rollout's sandbox (its processes would die with the machine), SIGKILLs the node's
daemon and deletes that daemon's state directory. That destroys everything Crab kept on that
node, so the script refuses to run without ``--destroy-node-state``::

    python examples/ray_spot.py --address HEAD:6379 --destroy-node-state

``python/tests/test_ray.py`` runs ``main`` on a two-node cluster on loopback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from crab_sandbox import Sandbox
from crab_sandbox.ray import CrabSandbox, create


def turn_cmd(t: int) -> str:
    """Turn ``t`` of the rollout: one more line of work, and (turn 1) a process that keeps
    state in memory — a counter the restore must bring back running."""
    cmd = f"mkdir -p /work && echo 'turn {t}' >> /work/log && echo {t} > /work/turn"
    if t == 1:
        cmd += " && (nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /work/ticks; sleep 0.2; done' >/dev/null 2>&1 &)"
    return cmd


@ray.remote(num_cpus=0, max_retries=0)
def _lose_this_node(sandbox: str) -> str:
    """On the node it is pinned to: what a lost machine takes with it, for real."""
    state = Path(os.environ.get("CRAB_STATE_DIR") or "/var/lib/crab")
    Sandbox.connect(sandbox).kill()  # its processes, files and local points
    pid = int((state / "daemon.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        try:
            os.kill(pid, 0)
            time.sleep(0.05)
        except ProcessLookupError:
            break
    # The daemon's mounts in its state dir: the pool and the empty read-only tmpfs that masked
    # paths are bound from.
    for mount in (state / "pool", state / "masked"):
        if os.path.ismount(mount):
            if subprocess.run(["umount", str(mount)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(mount)], check=False)
    shutil.rmtree(state, ignore_errors=True)
    return str(state)


def lose_node(node: str, sandbox: str) -> None:
    """The default loss: :func:`_lose_this_node` on ``node``."""
    pin = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    ray.get(_lose_this_node.options(scheduling_strategy=pin).remote(sandbox))


def main(
    turns: int = 5,
    lose_after: int = 3,
    durable_every: int = 2,
    node: Optional[str] = None,
    address: Optional[str] = None,
    image: str = "debian",
    destroy_node_state: bool = False,
    lose: Callable[[str, str], None] = lose_node,
) -> Dict[str, Any]:
    """Run the rollout; returns what happened (also printed): the nodes before and after, the
    last durable turn, the turns lost and redone, the recovery time and the final log."""
    if not destroy_node_state:
        raise SystemExit(
            "ray_spot.py kills the rollout node's Crab daemon and deletes its state directory: "
            "pass destroy_node_state=True (--destroy-node-state) on a cluster you can lose a node of"
        )
    if not 1 <= durable_every <= lose_after <= turns:
        raise ValueError("need 1 <= durable_every <= lose_after <= turns")
    if not ray.is_initialized():
        ray.init(address=address or "auto")
    rollout = create(image, node=node)
    back = None
    lost = False
    try:
        home = ray.get(rollout.node_id.remote())
        name = ray.get(rollout.name.remote())
        durable_turn = 0
        for t in range(1, lose_after + 1):
            r = ray.get(rollout.exec.remote(turn_cmd(t)))
            assert r.exit_code == 0, f"turn {t}: {r.stderr}"
            if t % durable_every == 0:
                ray.get(rollout.checkpoint.remote(kind="full", durable=True))
                durable_turn = t
        print(f"rollout {name} on node {home[:8]}: {lose_after} turns done, last durable after turn {durable_turn}")

        lose(home, name)
        lost = True
        print(f"node {home[:8]} lost (daemon killed, state directory removed)")
        t0 = time.monotonic()
        back = CrabSandbox.recover(name, avoid=home)
        where = ray.get(back.node_id.remote())
        recover_s = time.monotonic() - t0
        resumed = int(ray.get(back.read_file.remote("/work/turn")).decode())
        ticks0 = int(ray.get(back.read_file.remote("/work/ticks")).decode())
        time.sleep(0.6)
        ticks1 = int(ray.get(back.read_file.remote("/work/ticks")).decode())
        for t in range(resumed + 1, turns + 1):
            r = ray.get(back.exec.remote(turn_cmd(t)))
            assert r.exit_code == 0, f"turn {t} after recovery: {r.stderr}"
        log: List[str] = ray.get(back.read_file.remote("/work/log")).decode().splitlines()
        report = {
            "sandbox": name,
            "recovered_as": ray.get(back.name.remote()),
            "node_before": home,
            "node_after": where,
            "durable_turn": durable_turn,
            "resumed_after_turn": resumed,
            "turns_lost": lose_after - resumed,
            "process_running_after_recovery": ticks1 > ticks0,
            "recover_s": round(recover_s, 2),
            "log": log,
        }
        print(
            f"recovered on node {where[:8]} in {recover_s:.1f} s from turn {resumed}: "
            f"{report['turns_lost']} turn(s) lost and redone; the turn-1 process "
            f"{'kept counting' if report['process_running_after_recovery'] else 'did NOT come back'}"
        )
        print("final log: " + " | ".join(log))
        return report
    finally:
        if back is not None:
            try:
                ray.get(back.delete.remote())
            except Exception:  # noqa: BLE001 - best effort at the end
                pass
        if not lost:
            try:
                ray.get(rollout.delete.remote())
            except Exception:  # noqa: BLE001 - best effort at the end
                pass
        ray.kill(rollout)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="the Ray cluster (default: auto)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--lose-after", type=int, default=3, help="the node is lost after this turn")
    ap.add_argument("--durable-every", type=int, default=2)
    ap.add_argument("--image", default="debian")
    ap.add_argument("--destroy-node-state", action="store_true", help="really kill the rollout node's daemon and delete its state dir")
    a = ap.parse_args()
    rep = main(a.turns, a.lose_after, a.durable_every, None, a.address, a.image, a.destroy_node_state)
    ok = rep["log"] == [f"turn {t}" for t in range(1, a.turns + 1)] and rep["process_running_after_recovery"]
    raise SystemExit(0 if ok else 1)
