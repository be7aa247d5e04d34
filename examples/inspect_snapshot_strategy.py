"""Crab as an Inspect AI sandbox snapshot strategy: ``crab_sandbox.inspect.CrabSnapshotStrategy``
driven the way Inspect's checkpointing core drives a ``SandboxSnapshotStrategy`` (see that
module's docstring for whose Protocol this is and what each kind restores).

The script plays the core's part for one sample on the local daemon (``$CRAB_STATE_DIR``):

1. fresh sample: ``setup``; the agent works; checkpoint 1 fires (``snapshot``) and commits;
2. the agent works on; checkpoint 2 captures but the run dies before committing it (an orphan);
3. a retry attempt: a *fresh* sandbox, then ``setup`` → ``adopt`` (the prior attempt's storage
   area) → ``discard_orphans(1)`` → ``restore`` of checkpoint 1;

and reports what came back: the files of checkpoint 1 (not those of the orphan), and — with
``--kind full`` — the server the agent had started, still serving.

    python examples/inspect_snapshot_strategy.py --kind full      # or --kind fs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional

from crab_sandbox import AsyncDaemon, AsyncSandbox
from crab_sandbox.inspect import CrabSnapshotStrategy

SERVER_UP = "exec 3<>/dev/tcp/127.0.0.1/8765"


def ctx(root: Path, attempt: str, resuming: bool) -> SimpleNamespace:
    """The core's ``SnapshotContext`` for sandbox ``default`` of one attempt."""
    sub = "sandboxes/default/crab"
    return SimpleNamespace(
        sandbox_name="default",
        storage_dir=str(root / attempt / sub),
        storage_subpath=sub,
        secret="unused-by-crab",
        resuming=resuming,
    )


async def run(kind: str = "full", image: str = "debian", socket: Optional[str] = None) -> Dict[str, Any]:
    async with AsyncDaemon(socket) as d:
        strategy = CrabSnapshotStrategy(kind, daemon=d)
        root = Path(tempfile.mkdtemp(prefix="crab-inspect-"))
        first = await AsyncSandbox.create(image, daemon=d)
        fresh: Optional[AsyncSandbox] = None
        try:
            # Attempt 1: a fresh sample.
            c1 = ctx(root, "attempt-1", resuming=False)
            await strategy.setup(first, c1)
            await first.exec(
                "mkdir -p /work && echo 'step 1' > /work/notes && cd /work"
                " && (nohup python3 -m http.server 8765 >/dev/null 2>&1 &) && sleep 0.5"
            )
            committed = await strategy.snapshot(first, None, 1, c1)
            (root / "attempt-1" / "ckpt-00001.json").write_text(json.dumps(committed.to_dict()))  # the core's commit
            await first.exec("echo 'step 2' >> /work/notes && echo orphan > /work/orphan")
            await strategy.snapshot(first, None, 2, c1)  # captured; the run dies before the commit

            # Attempt 2: the core makes a fresh sandbox and resumes into it.
            fresh = await AsyncSandbox.create(image, daemon=d)
            c2 = ctx(root, "attempt-2", resuming=True)
            await strategy.setup(fresh, c2)
            await strategy.adopt(SimpleNamespace(sample_checkpoints_dir=str(root / "attempt-1"), storage_subpath=c1.storage_subpath), c2)
            adopted = [r["checkpoint_id"] for r in strategy.refs(c2)]
            await strategy.discard_orphans(1, c2)
            kept = [r["checkpoint_id"] for r in strategy.refs(c2)]
            ref = json.loads((root / "attempt-1" / "ckpt-00001.json").read_text())
            await strategy.restore(fresh, ref, c2)

            notes = (await fresh.read_file("/work/notes")).decode()
            orphan = (await fresh.exec("test -e /work/orphan")).exit_code == 0
            server = False
            for _ in range(20):
                if (await fresh.exec(["bash", "-c", SERVER_UP])).exit_code == 0:
                    server = True
                    break
                await asyncio.sleep(0.25)
            report = {
                "kind": kind,
                "snapshot_id": committed.snapshot_id,
                "point_kind": committed.kind,
                "restores_processes": committed.restores_processes,
                "durable": committed.durable,
                "refs_adopted": adopted,
                "refs_after_discard": kept,
                "restored_into": fresh.name,
                "notes": notes,
                "orphan_files_present": orphan,
                "server_running": server,
            }
            print(json.dumps(report, indent=2))
            await strategy.cleanup(c2)
            return report
        finally:
            for sb in (first, fresh):
                if sb is not None:
                    try:
                        await sb.kill()
                    except Exception:  # noqa: BLE001 - best effort at the end
                        pass
            shutil.rmtree(root, ignore_errors=True)  # the core's sample dirs of this run


def main(kind: str = "full", image: str = "debian", socket: Optional[str] = None) -> Dict[str, Any]:
    return asyncio.run(run(kind, image, socket))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["fs", "full", "auto"], default="full")
    ap.add_argument("--image", default="debian")
    a = ap.parse_args()
    main(a.kind, a.image)
