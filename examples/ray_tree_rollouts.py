"""Tree rollouts with Crab on a Ray cluster: one task sandbox is worked to a mid-trajectory
point (a git repository, an edit, a running process), that point is made durable, and N
rollouts are forked from it across the cluster's Crab nodes. Each rollout continues with its
own commands; the results are gathered and the branches' states checked distinct (and each
still has the task's history and its running process).

Setup (each machine of the cluster runs a Crab daemon; all daemons share one remote store)::

    # on every node
    crab daemon --remote s3://bucket/crab            # or file:///shared/dir; state in /var/lib/crab
    crab image build debian                          # once per node (or import it)
    # the head
    CRAB_STATE_DIR=/var/lib/crab ray start --head --resources '{"crab": 100}'
    # the others
    CRAB_STATE_DIR=/var/lib/crab ray start --address HEAD:6379 --resources '{"crab": 100}'
    # anywhere with the SDK (pip install ./python ray)
    python examples/ray_tree_rollouts.py --address HEAD:6379 --rollouts 8

A node offers Crab by the custom resource ``crab``; its actors find the daemon through the
raylet's ``CRAB_STATE_DIR``. A rollout placed on another node than the task is restored there
from the remote store (one download per node, then local forks); those on the task's node are
local forks. ``python/tests/test_ray.py`` runs ``main`` on a two-node cluster on loopback.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections import Counter
from typing import Any, Dict, List, Optional

import ray

from crab_sandbox.ray import create

# The task up to the fork point: a repository with a bug, a first edit, a process left running.
TASK = [
    "mkdir -p /work/repo && cd /work/repo && git init -q"
    " && printf 'def score(x):\\n    return x\\n' > m.py"
    " && git add m.py && git -c user.email=a@b -c user.name=agent commit -qm base",
    "cd /work/repo && printf '# notes\\n' > NOTES && (nohup sleep 99999 >/dev/null 2>&1 &)",
]


def rollout_cmd(i: int) -> str:
    """Rollout ``i``'s own continuation: a different edit, then a check of it."""
    return (
        f"cd /work/repo && sed -i 's/return x$/return x * {i + 2}/' m.py"
        f" && echo 'rollout {i}' >> NOTES"
        " && python3 -B -c 'import m; print(m.score(10))'"
    )


def main(rollouts: int = 8, address: Optional[str] = None, image: str = "debian", keep: bool = False) -> Dict[str, Any]:
    """Run the tree; returns what it saw (also printed): per rollout its node, output and state
    digest, the fork time, and whether every state is distinct."""
    if not ray.is_initialized():
        ray.init(address=address or "auto")
    task = create(image)
    branches: List[Any] = []
    try:
        for cmd in TASK:
            r = ray.get(task.exec.remote(cmd))
            assert r.exit_code == 0, f"task step failed: {cmd!r}: {r.stderr}"
        point = ray.get(task.checkpoint.remote(kind="full", durable=True))
        t0 = time.monotonic()
        branches = ray.get(task.fork.remote(rollouts, point, spread=True))
        fork_s = time.monotonic() - t0
        nodes = ray.get([b.node_id.remote() for b in branches])
        results = ray.get([b.exec.remote(rollout_cmd(i)) for i, b in enumerate(branches)])
        # The state of each branch: its edited file and notes, its history, its process.
        states = ray.get(
            [b.exec.remote("cd /work/repo && cat m.py NOTES && git log --format=%s && pgrep -c -x sleep") for b in branches]
        )
        rows = []
        for i, (node, r, st) in enumerate(zip(nodes, results, states)):
            assert r.exit_code == 0, f"rollout {i} failed: {r.stderr}"
            rows.append(
                {
                    "rollout": i,
                    "node": node,
                    "output": r.stdout.strip(),
                    "state": hashlib.sha256(st.stdout.encode()).hexdigest()[:12],
                    "history": st.stdout.split("\n")[-3:-1],  # the base commit, the process count
                }
            )
        task_state = ray.get(task.read_file.remote("/work/repo/m.py")).decode()
        report = {
            "rollouts": rows,
            "fork_s": round(fork_s, 2),
            "per_node": dict(Counter(nodes)),
            "distinct": len({r["state"] for r in rows}) == len(rows),
            "task_untouched": task_state == "def score(x):\n    return x\n",
        }
        print(f"fork({rollouts}, spread=True) from {point.ref}: {fork_s:.1f} s over {len(report['per_node'])} node(s)")
        for row in rows:
            print(f"  rollout {row['rollout']}  node {row['node'][:8]}  score(10)={row['output']:>4}  state {row['state']}")
        print(f"states distinct: {report['distinct']}; task sandbox untouched: {report['task_untouched']}")
        return report
    finally:
        if not keep:
            for h in branches + [task]:
                try:
                    ray.get(h.delete.remote())
                except Exception:  # noqa: BLE001 - best effort at the end
                    pass


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="the Ray cluster (default: auto)")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--image", default="debian")
    ap.add_argument("--keep", action="store_true", help="leave the sandboxes for inspection")
    a = ap.parse_args()
    rep = main(a.rollouts, a.address, a.image, a.keep)
    raise SystemExit(0 if rep["distinct"] and rep["task_untouched"] else 1)
