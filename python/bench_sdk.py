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
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"samples_ms": samples, "daemon_ms": inner, "fork_ms": fork_ms}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
