#!/usr/bin/env python3
"""SDK overhead: ``exec(["true"])`` through the Python SDK (sync and asyncio) vs ``crab exec
NAME -- true`` (the CLI, a process per call), side by side in one run, interleaved round by
round so machine noise hits every method alike; plus ``fork(8)`` within one daemon.

    CRAB_STATE_DIR=/var/lib/crab python3 python/bench_sdk.py --rounds 30 [--crab target/release/crab]

Needs root, a running daemon with the ``debian`` image, and httpx (the SDK's one dependency).
Prints a table and, with ``--json-out``, the raw samples. ``daemon ms`` is the exec's own wall
time as the daemon measured it (spawning the namespace helper and ``true``): the rest of each
figure is the client's path (connection, request, frames; for the CLI also process start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "src"))

from crab_sandbox import AsyncDaemon, AsyncSandbox, Daemon, Sandbox  # noqa: E402


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def busy() -> str:
    """What else runs: the load average and the busiest other processes."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    try:
        ps = subprocess.run(
            ["ps", "-eo", "pcpu,comm", "--sort=-pcpu", "--no-headers"], capture_output=True, text=True, check=True
        ).stdout.splitlines()[:5]
    except (OSError, subprocess.CalledProcessError):
        ps = []
    top = ", ".join(" ".join(line.split()[::-1]) + "%" for line in ps)
    return f"load {' '.join(load)}; busiest: {top}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (one call of each method per round)")
    ap.add_argument("--crab", default=str(HERE.parent / "target" / "release" / "crab"), help="the crab binary for the CLI side")
    ap.add_argument("--fork", type=int, default=8, help="branches of the fork measurement (0: skip)")
    ap.add_argument("--json-out", help="write the samples here")
    ap.add_argument("--across", metavar="DIR", help="also measure fork within vs across two daemons and recovery (see above)")
    ap.add_argument("--across-rounds", type=int, default=2)
    a = ap.parse_args()
    if not os.path.exists(a.crab):
        alt = HERE.parent / "target" / "debug" / "crab"
        print(f"bench_sdk: no {a.crab}; using {alt}", file=sys.stderr)
        a.crab = str(alt)
    state = os.environ.get("CRAB_STATE_DIR") or "/var/lib/crab"
    d = Daemon()
    print(f"bench_sdk: daemon {d.socket}, crab {a.crab}, {a.rounds} rounds")
    print(f"before: {busy()}")

    sb = Sandbox.create("debian", name=f"bench-sdk-{os.getpid()}", daemon=d)
    loop = asyncio.new_event_loop()
    ad = AsyncDaemon(d.socket)
    asb = AsyncSandbox(sb.name, ad)
    samples: Dict[str, List[float]] = {"sdk sync": [], "sdk async": [], "crab exec (CLI)": []}
    inner: Dict[str, List[float]] = {k: [] for k in samples}

    def sdk_sync() -> float:
        return sb.exec(["true"]).duration_ms

    def sdk_async() -> float:
        return loop.run_until_complete(asb.exec(["true"])).duration_ms

    def cli() -> float:
        out = subprocess.run(
            [a.crab, "--state-dir", state, "--json", "exec", sb.name, "--", "true"],
            capture_output=True,
            check=True,
        )
        return float(json.loads(out.stdout)["duration_ms"])

    methods: Dict[str, Callable[[], float]] = {"sdk sync": sdk_sync, "sdk async": sdk_async, "crab exec (CLI)": cli}
    try:
        for f in methods.values():  # warm-up: connection pools, page cache
            f()
        names = list(methods)
        for r in range(a.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                t0 = time.perf_counter()
                daemon_ms = methods[n]()
                samples[n].append((time.perf_counter() - t0) * 1e3)
                inner[n].append(daemon_ms)
        fork_ms = None
        if a.fork:
            p = sb.checkpoint(kind="full")
            t0 = time.perf_counter()
            branches = sb.fork(a.fork, p)
            fork_ms = (time.perf_counter() - t0) * 1e3
            for b in branches:
                b.kill()
    finally:
        loop.run_until_complete(ad.aclose())
        loop.close()
        sb.kill()

    print(f"after:  {busy()}")
    print()
    print(f"{'exec true':<18} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8} {'daemon ms':>10} {'client ms':>10}")
    base = statistics.median(samples["crab exec (CLI)"])
    for n, xs in samples.items():
        med, dmed = statistics.median(xs), statistics.median(inner[n])
        print(f"{n:<18} {med:>10.2f} {pct(xs, 90):>8.2f} {statistics.mean(xs):>8.2f} {dmed:>10.2f} {med - dmed:>10.2f}")
    print()
    print(f"sdk sync / CLI = {statistics.median(samples['sdk sync']) / base:.3f}, "
          f"sdk async / CLI = {statistics.median(samples['sdk async']) / base:.3f}")
    if fork_ms is not None:
        print(f"fork({a.fork}) of a full point within one daemon: {fork_ms:.0f} ms ({fork_ms / a.fork:.0f} ms/branch)")
    across = None
    if a.across:
        across = two_nodes(a.crab, state, Path(a.across), a.fork or 8, a.across_rounds)
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps({"samples_ms": samples, "daemon_ms": inner, "fork_ms": fork_ms, "across": across}, indent=1)
        )
    return 0


def start_daemon(crab: str, state: Path, remote: str) -> Daemon:
    (state / "logs").mkdir(parents=True, exist_ok=True)
    log = open(state / "logs" / "daemon.log", "ab")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRAB_E2B")}
    subprocess.Popen(
        ["setsid", "-f", crab, "daemon", "--state-dir", str(state), "--pool-size", "8G", "--remote", remote,
         "--proxy-listen", "127.0.0.1:0"],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    ).wait()
    d = Daemon(state / "crab.sock")
    for _ in range(1200):
        try:
            d.version()
            return d
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    raise SystemExit(f"bench_sdk: the daemon on {state} did not come up; see {state}/logs/daemon.log")


def lose(state: Path) -> None:
    """SIGKILL the daemon on ``state`` and delete the state dir (its pool unmounted first)."""
    import shutil
    import signal

    try:
        pid = int((state / "daemon.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            os.kill(pid, 0)
            time.sleep(0.05)
    except (OSError, ValueError):
        pass
    for mount in (state / "pool", state / "masked"):  # the daemon's mounts in its state dir
        if os.path.ismount(mount) and subprocess.run(["umount", str(mount)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)])
    shutil.rmtree(state, ignore_errors=True)


def two_nodes(crab: str, state: str, base: Path, count: int, rounds: int) -> Dict[str, object]:
    """fork(count) within node A vs on node B from the shared store; then recovery after A's loss."""
    import shutil

    if base.exists():
        raise SystemExit(f"bench_sdk: --across {base} exists; give a fresh directory (it is deleted afterwards)")
    a_state, b_state, c_state, store = base / "a", base / "b", base / "c", base / "store"
    store.mkdir(parents=True)
    remote = f"file://{store}"
    res: Dict[str, object] = {"count": count, "within_ms": [], "across_ms": [], "order": []}
    try:
        da, db = start_daemon(crab, a_state, remote), start_daemon(crab, b_state, remote)
        src = Path(state) / "pool" / "images" / "debian"
        subprocess.run([crab, "--state-dir", str(a_state), "image", "import", "debian", str(src)], check=True,
                       stdout=subprocess.DEVNULL)
        sb = Sandbox.create("debian", name=f"bench-x-{os.getpid()}", daemon=da)
        sb.exec("mkdir -p /work && echo base > /work/f && (nohup sleep 99999 >/dev/null 2>&1 &)")
        t0 = time.perf_counter()
        p = sb.checkpoint(kind="full", durable=True)
        res["first_export_ms"] = (time.perf_counter() - t0) * 1e3
        print(f"\nacross: a full point made durable in an empty store in {res['first_export_ms']:.0f} ms (includes the image)")
        for r in range(rounds):
            order = ["within", "across"] if r % 2 == 0 else ["across", "within"]
            for what in order:
                t0 = time.perf_counter()
                if what == "within":
                    made = [b.name for b in sb.fork(count, p)]
                    dd = da
                else:
                    names = [f"{sb.name}-r{r}-{i}" for i in range(count)]
                    v = db.request("POST", "/v1/remote/restore", {"source": p.ref, "names": names, "count": count})
                    made = [str(b["sandbox"]) for b in v["branches"]]
                    dd = db
                ms = (time.perf_counter() - t0) * 1e3
                res[f"{what}_ms"].append(ms)  # type: ignore[union-attr]
                res["order"].append(what)  # type: ignore[union-attr]
                ok = Sandbox(made[-1], dd).exec("cat /work/f; pgrep -c -x sleep").stdout.split()
                assert ok == ["base", "1"], ok
                for n in made:
                    Sandbox(n, dd).kill()
        name = sb.name
        sb.exec("echo after-point > /work/f")  # lost with the node: after the newest durable point
        t0 = time.perf_counter()
        Sandbox(name, da).kill()
        lose(a_state)
        res["lose_ms"] = (time.perf_counter() - t0) * 1e3
        def recover(daemon, key):
            """Bring the lost sandbox back on `daemon` from its newest durable point, timed."""
            t0 = time.perf_counter()
            back = Sandbox.from_remote(name, daemon=daemon)
            res[key] = (time.perf_counter() - t0) * 1e3
            got = back.exec("cat /work/f; pgrep -c -x sleep").stdout.split()
            assert got == ["base", "1"], got
            back.kill()

        recover(db, "recover_ms")
        # B had materialized the point for the forks: a warm recovery. A node that never saw
        # it (C, started now) has to fetch and materialize the whole tree: a cold one.
        recover(start_daemon(crab, c_state, remote), "recover_cold_ms")
        print(f"after:  {busy()}")
        w, x = res["within_ms"], res["across_ms"]
        print(f"fork({count}) of a durable full point, per round ({rounds} rounds, alternating order):")
        print(f"  within node A (local fork):             {', '.join(f'{v:.0f}' for v in w)} ms")  # type: ignore[union-attr]
        print(f"  on node B from the store (count={count}):   {', '.join(f'{v:.0f}' for v in x)} ms")  # type: ignore[union-attr]
        print(f"recover after A's loss (newest durable point, files + processes): on B (had the point's tree "
              f"from the forks) {res['recover_ms']:.0f} ms; on a fresh node C {res['recover_cold_ms']:.0f} ms")
        return res
    finally:
        for st in (a_state, b_state, c_state):
            lose(st)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
