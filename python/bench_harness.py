#!/usr/bin/env python3
"""Harness setup on Crab: per-sample (per-trial) setup time and whole-run wall time of an
Inspect eval and a Harbor job, each with samples forked from one base point (``fork=True``, the
default of both adapters) vs a fresh sandbox per sample (``fork=False``), side by side in one
run, interleaved round by round so machine noise hits both alike.

    python3 python/bench_harness.py --rounds 3 --samples 8 \\
        --inspect-python "$(scripts/install-python-sdk.sh --with-inspect | tail -n 1)" \\
        --harbor-python "$(scripts/install-harbor.sh | tail -n 1)"

Needs root and a running daemon (``$CRAB_STATE_DIR``, default /var/lib/crab) with the
``debian`` image (the Inspect eval's) and ``CRAB_INSECURE_REGISTRIES`` naming 127.0.0.1:5772
(the Harbor task's Dockerfile is ``FROM`` the ``shell`` fixture of scripts/test-images.sh in a
loopback registry this script starts there).

* Inspect: ``inspect_ai.eval`` of a task of ``--samples`` samples whose mock model
  (``mockllm/model``) runs bash in the sandbox twice per sample; setup = the provider's
  ``sample_init`` (a fork of the base point, or a create and a probe); wall = the ``eval`` call.
* Harbor: ``harbor run -a oracle -k SAMPLES -n 4`` of one task; setup = Harbor's own
  ``environment_setup`` span of each trial (``start()``: a fork, or a create with Harbor's
  directories); wall = the job's own span (harbor's process start-up excluded). A first job of
  each mode builds the image and, with fork, the base: it is run before the rounds and reported
  apart.

Prints a table (and what else was running); ``--json-out`` keeps the samples. Each harness
runs in its own venv (Harbor needs Python >= 3.12): this script runs itself there with
``--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "src"))
sys.path.insert(0, str(HERE / "tests"))

REGISTRY_PORT = 5772
REGISTRY = f"127.0.0.1:{REGISTRY_PORT}"
MODES = ("fork", "fresh")


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def busy() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"load {' '.join(load)}"


# --- workers (run in the harness's venv) -------------------------------------------------------


def inspect_worker(samples: int, fork: bool, socket: str) -> Dict[str, Any]:
    from inspect_ai import Task, eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import bash
    from inspect_ai.util import SandboxEnvironmentSpec

    from crab_sandbox.inspect import CrabSandboxConfig, CrabSandboxEnvironment

    setups: List[float] = []
    orig = CrabSandboxEnvironment.sample_init.__func__  # type: ignore[attr-defined]

    async def timed(cls: Any, task_name: str, config: Any, metadata: Any) -> Any:
        envs = await orig(cls, task_name, config, metadata)
        setups.append(envs["default"].setup_s * 1e3)
        return envs

    CrabSandboxEnvironment.sample_init = classmethod(timed)  # type: ignore[method-assign]

    def script(messages: List[Any], tools: Any, tool_choice: Any, config: Any) -> ModelOutput:
        n = str(messages[0].text).split()[-1]
        done = [m for m in messages if m.role == "tool"]
        if not done:
            out = ModelOutput.for_tool_call("mockllm/model", "bash", {"command": f"echo t-{n} > /tmp/s-{n}; ls /tmp"})
        elif len(done) == 1:
            out = ModelOutput.for_tool_call("mockllm/model", "bash", {"command": f"cat /tmp/s-{n}"})
        else:
            out = ModelOutput.from_content("mockllm/model", " ".join(str(m.text) for m in done))
        out.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
        return out

    cfg = CrabSandboxConfig(fork=fork, socket=socket)
    task = Task(
        dataset=[Sample(input=f"sample {i}", target=f"t-{i}") for i in range(samples)],
        solver=[use_tools([bash(timeout=60)]), generate()],
        scorer=includes(),
        sandbox=SandboxEnvironmentSpec("crab", cfg),
    )
    model = get_model("mockllm/model", custom_outputs=script)
    with tempfile.TemporaryDirectory() as logs:
        t0 = time.perf_counter()
        (log,) = inspect_eval(task, model=model, log_dir=logs, display="none", max_samples=4)
        wall = time.perf_counter() - t0
    if log.status != "success":
        raise SystemExit(f"the Inspect eval failed: {log.error}")
    acc = log.results.scores[0].metrics["accuracy"].value
    return {"setup_ms": setups, "wall_s": wall, "accuracy": acc}


def harbor_worker(samples: int, fork: bool, socket: str, task: str, jobs: str, job: str) -> Dict[str, Any]:
    harbor = Path(sys.executable).parent / "harbor"
    cmd = [
        str(harbor), "run", "-p", task, "--env", "crab_sandbox.harbor:CrabEnvironment", "-a", "oracle",
        "-k", str(samples), "-n", "4", "-o", jobs, "--job-name", job, "-y", "-q",
        "--ek", f"socket={socket}", "--ek", f"fork={str(fork).lower()}",
    ]  # fmt: skip
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", NO_COLOR="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"harbor run failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")

    def span(d: Dict[str, str]) -> float:
        a = datetime.fromisoformat(d["started_at"].replace("Z", "+00:00"))
        b = datetime.fromisoformat(d["finished_at"].replace("Z", "+00:00"))
        return (b - a).total_seconds()

    setups, rewards = [], []
    for r in sorted(Path(jobs, job).glob("*/result.json")):
        t = json.loads(r.read_text())
        if t.get("exception_info"):
            raise SystemExit(f"trial {r.parent.name} failed: {t['exception_info']}")
        setups.append(span(t["environment_setup"]) * 1e3)
        rewards.append((t.get("verifier_result") or {}).get("rewards", {}).get("reward"))
    job_result = json.loads(Path(jobs, job, "result.json").read_text())
    return {"setup_ms": setups, "wall_s": span(job_result), "rewards": rewards}


# --- the driver --------------------------------------------------------------------------------


def run_worker(py: str, samples: int, args: List[str]) -> Dict[str, Any]:
    cmd = [py, str(Path(__file__).resolve()), "--samples", str(samples), "--worker", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"worker {args[:2]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out: Dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--inspect-python", help="a python with inspect-ai (scripts/install-python-sdk.sh --with-inspect)")
    ap.add_argument("--harbor-python", help="a python with harbor (scripts/install-harbor.sh)")
    ap.add_argument("--json-out")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    state = os.environ.get("CRAB_STATE_DIR") or "/var/lib/crab"
    socket = os.path.join(state, "crab.sock")

    if a.worker:
        kind, mode, *rest = a.worker
        if kind == "inspect":
            r = inspect_worker(a.samples, mode == "fork", socket)
        else:
            r = harbor_worker(a.samples, mode == "fork", socket, *rest)
        print(json.dumps(r))
        return

    if not (a.inspect_python or a.harbor_python):
        ap.error("name --inspect-python and/or --harbor-python")
    results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    print(f"bench_harness: {a.rounds} rounds of {a.samples} samples, state {state}; before: {busy()}")
    if a.inspect_python:
        res = results.setdefault("inspect", {m: [] for m in MODES})
        for m in MODES:  # warm-up: the first eval of a process imports Inspect and makes the base
            run_worker(a.inspect_python, a.samples, ["inspect", m])
        for _ in range(a.rounds):
            for m in MODES:
                res[m].append(run_worker(a.inspect_python, a.samples, ["inspect", m]))
    if a.harbor_python:
        from harbor_fixture import make_task

        reg = Path(f"/tmp/crab-test-registry-{REGISTRY_PORT}")
        subprocess.run([ROOT / "scripts" / "test-registry.sh", "start", str(reg), str(REGISTRY_PORT)], check=True, capture_output=True)
        try:
            subprocess.run(
                [ROOT / "scripts" / "test-images.sh", "push", str(ROOT / "target" / "test-images"), REGISTRY],
                check=True,
                capture_output=True,
            )
            with tempfile.TemporaryDirectory() as tmp:
                task = str(make_task(Path(tmp), f"bench-{os.getpid()}", REGISTRY))
                jobs = os.path.join(tmp, "jobs")
                res = results.setdefault("harbor", {m: [] for m in MODES})
                first = results.setdefault("harbor-first", {m: [] for m in MODES})
                for m in MODES:
                    first[m].append(run_worker(a.harbor_python, a.samples, ["harbor", m, task, jobs, f"first-{m}"]))
                for i in range(a.rounds):
                    for m in MODES:
                        res[m].append(run_worker(a.harbor_python, a.samples, ["harbor", m, task, jobs, f"r{i}-{m}"]))
        finally:
            subprocess.run([ROOT / "scripts" / "test-registry.sh", "stop", str(reg), str(REGISTRY_PORT)], capture_output=True)

    print(f"after: {busy()}")
    print(f"{'harness':<14}{'mode':<8}{'setup p50 ms':>14}{'setup p95 ms':>14}{'wall p50 s':>12}  score")
    for h, per in results.items():
        for m in MODES:
            runs = per[m]
            setups = [x for r in runs for x in r["setup_ms"]]
            walls = [r["wall_s"] for r in runs]
            score = (
                f"accuracy {statistics.mean(r['accuracy'] for r in runs):.2f}"
                if h == "inspect"
                else f"rewards {sum(x == 1 for r in runs for x in r['rewards'])}/{sum(len(r['rewards']) for r in runs)}"
            )
            print(f"{h:<14}{m:<8}{pct(setups, 50):>14.1f}{pct(setups, 95):>14.1f}{statistics.median(walls):>12.2f}  {score}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
