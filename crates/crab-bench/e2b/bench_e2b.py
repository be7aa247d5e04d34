"""`crab bench e2b`: the e2b SDK through Crab's E2B API vs Crab's own CLI, interleaved.

Per round, in alternating order: (a) `Sandbox.create()` + `commands.run("true")` + `kill()`
through the unmodified e2b SDK; (b) `crab sandbox create` + `crab exec SB -- true` +
`crab sandbox rm -f SB` through the CLI. Then, for the restore paths: create from a `full`
snapshot (SDK) vs `crab fork --count 1` of the same point (CLI), and `fork(count=8)` (SDK,
which takes a fresh full point first) vs `crab checkpoint --kind full` + `crab fork --count 8`.
Prints one JSON object on stdout; the Rust side renders the table.

Env: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, CRAB_BIN, CRAB_STATE_DIR, ROUNDS, FORK_ROUNDS,
IMAGE.
"""

import json
import os
import subprocess
import time

from e2b import Sandbox

CRAB = os.environ["CRAB_BIN"]
STATE = os.environ["CRAB_STATE_DIR"]
ROUNDS = int(os.environ.get("ROUNDS", "20"))
FORK_ROUNDS = int(os.environ.get("FORK_ROUNDS", "3"))
IMAGE = os.environ.get("IMAGE", "debian")


def crab(*args):
    r = subprocess.run([CRAB, "--state-dir", STATE, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"crab {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def ms(t0):
    return (time.perf_counter() - t0) * 1000.0


def sdk_round(out):
    t0 = time.perf_counter()
    sb = Sandbox.create(IMAGE)
    t1 = time.perf_counter()
    sb.commands.run("true")
    t2 = time.perf_counter()
    sb.kill()
    t3 = time.perf_counter()
    out["create"].append((t1 - t0) * 1e3)
    out["run_true"].append((t2 - t1) * 1e3)
    out["kill"].append((t3 - t2) * 1e3)
    out["total"].append((t3 - t0) * 1e3)


def cli_round(out, i):
    name = f"bench-e2b-cli-{os.getpid()}-{i}"
    t0 = time.perf_counter()
    crab("sandbox", "create", IMAGE, "--name", name)
    t1 = time.perf_counter()
    crab("exec", name, "--", "true")
    t2 = time.perf_counter()
    crab("sandbox", "rm", "-f", name)
    t3 = time.perf_counter()
    out["create"].append((t1 - t0) * 1e3)
    out["run_true"].append((t2 - t1) * 1e3)
    out["kill"].append((t3 - t2) * 1e3)
    out["total"].append((t3 - t0) * 1e3)


def series():
    return {"create": [], "run_true": [], "kill": [], "total": []}


def main():
    sdk, cli = series(), series()
    # Warm-up of both paths (first create pays page-cache misses).
    sdk_round(series())
    cli_round(series(), -1)
    for i in range(ROUNDS):
        if i % 2 == 0:
            sdk_round(sdk)
            cli_round(cli, i)
        else:
            cli_round(cli, i)
            sdk_round(sdk)
    # Restore paths, from one source sandbox with a running process.
    src = Sandbox.create(IMAGE)
    # As root: CRIU cannot dump another uid's task where the host lacks CAP_SYS_RESOURCE.
    src.commands.run("nohup sleep 100000 >/dev/null 2>&1 &", user="root")
    try:
        restore = restore_paths(src)
    finally:
        # A snapshot outlives its sandbox: delete them, or the killed source stays a holder.
        for sn in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items():
            Sandbox.delete_snapshot(sn.snapshot_id)
        src.kill()
    print(json.dumps({"rounds": ROUNDS, "fork_rounds": FORK_ROUNDS, "sdk": sdk, "cli": cli, "restore": restore}))


def restore_paths(src):
    snap = src.create_snapshot()
    point = snap.snapshot_id.split(":", 1)[1]
    restore = {"sdk_create_from_snapshot": [], "cli_fork_1": [], "sdk_fork_8": [], "cli_checkpoint_fork_8": []}
    for i in range(FORK_ROUNDS):
        t0 = time.perf_counter()
        c = Sandbox.create(snap.snapshot_id)
        restore["sdk_create_from_snapshot"].append(ms(t0))
        c.kill()
        name = f"bench-e2b-fork-{os.getpid()}-{i}"
        t0 = time.perf_counter()
        crab("fork", src.sandbox_id, point, "--names", name)
        restore["cli_fork_1"].append(ms(t0))
        crab("sandbox", "rm", "-f", name)
        t0 = time.perf_counter()
        kids = src.fork(count=8)
        restore["sdk_fork_8"].append(ms(t0))
        for k in kids:
            k.kill()
        names = ",".join(f"bench-e2b-f8-{os.getpid()}-{i}-{j}" for j in range(8))
        t0 = time.perf_counter()
        crab("checkpoint", src.sandbox_id, "--kind", "full")
        crab("fork", src.sandbox_id, "--count", "8", "--names", names)
        restore["cli_checkpoint_fork_8"].append(ms(t0))
        crab("sandbox", "rm", "-f", *names.split(","))
    return restore


if __name__ == "__main__":
    main()
