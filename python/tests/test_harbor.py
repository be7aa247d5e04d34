"""Harbor's ``--env crab_sandbox.harbor:CrabEnvironment`` run for real: the pinned ``harbor``
(Python >= 3.12, its own venv from scripts/install-harbor.sh, named by ``$CRAB_HARBOR_PY``)
runs ``harbor run`` on a local task in Harbor's task format whose Dockerfile is ``FROM`` an
image in a loopback registry (scripts/test-registry.sh, the ``shell`` fixture of
scripts/test-images.sh; the daemon reaches it through ``CRAB_INSECURE_REGISTRIES``, as
``make test`` sets it):

* the oracle agent solves it and the verifier's reward is 1 in Harbor's own result files, for
  two trials forked from one base sandbox (``fork=true``), and for a trial of its own
  (the default);
* the nop agent leaves it unsolved: reward 0 (the verifier can fail);
* ``checkpoint=exec`` with ``--no-delete``: the kept trial sandbox holds a restore point per
  command, and restoring the one before the solution undoes it;
* a ``docker-compose.yaml`` task is refused naming the file, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from conftest import ROOT, cannot_run, state_dir, unique
from harbor_fixture import make_task
from crab_sandbox import Daemon, Sandbox

REGISTRY_PORT = 5772  # the Rust tests use 5761-5764, the Inspect test 5771
REGISTRY = f"127.0.0.1:{REGISTRY_PORT}"
ENV = "crab_sandbox.harbor:CrabEnvironment"


@pytest.fixture(scope="module")
def harbor_py() -> str:
    py = os.environ.get("CRAB_HARBOR_PY")
    if not py or not os.access(py, os.X_OK):
        cannot_run("needs Harbor: set CRAB_HARBOR_PY to the python of scripts/install-harbor.sh (make test-python does)")
    return str(py)


@pytest.fixture(scope="module")
def registry() -> object:
    reg = Path(f"/tmp/crab-test-registry-{REGISTRY_PORT}")
    scripts = ROOT / "scripts"
    try:
        subprocess.run([scripts / "test-registry.sh", "start", str(reg), str(REGISTRY_PORT)], check=True, capture_output=True)
        subprocess.run(
            [scripts / "test-images.sh", "push", str(ROOT / "target" / "test-images"), REGISTRY],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        cannot_run(f"no loopback registry (scripts/test-registry.sh, test-images.sh): {e}")
    yield REGISTRY
    subprocess.run([scripts / "test-registry.sh", "stop", str(reg), str(REGISTRY_PORT)], capture_output=True)


def harbor(harbor_py: str, task: Path, jobs: Path, job: str, agent: str, *extra: str) -> "subprocess.CompletedProcess[str]":
    """``harbor run`` of one local task."""
    sock = os.path.join(state_dir(), "crab.sock")
    bindir = Path(harbor_py).parent
    cmd = [
        str(bindir / "harbor"), "run", "-p", str(task), "--env", ENV, "-a", agent,
        "-o", str(jobs), "--job-name", job, "--ek", f"socket={sock}", "-y", "-q", *extra,
    ]  # fmt: skip
    # LiteLLM (a Harbor dependency) would fetch its model price list from the internet.
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}", NO_COLOR="1", COLUMNS="500", LITELLM_LOCAL_MODEL_COST_MAP="True")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def harbor_run(harbor_py: str, task: Path, jobs: Path, job: str, agent: str, *extra: str) -> Dict[str, dict]:
    """``harbor run`` of one local task, which must succeed; the trials' result.json by trial name."""
    p = harbor(harbor_py, task, jobs, job, agent, *extra)
    assert p.returncode == 0, f"harbor run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    trials = {}
    for r in (jobs / job).glob("*/result.json"):
        trials[r.parent.name] = json.loads(r.read_text())
    assert trials, f"no trial results under {jobs / job}: {p.stdout[-2000:]} {p.stderr[-2000:]}"
    return trials


def reward(result: dict) -> object:
    vr = result.get("verifier_result") or {}
    return (vr.get("rewards") or {}).get("reward")


def exception(result: dict) -> str:
    return json.dumps(result.get("exception_info") or "")


@pytest.fixture(autouse=True)
def no_task_images_left(daemon: Daemon) -> Iterator[None]:
    """The images the adapter built for this test's tasks (``harbor-<task>-<digest>``, kept
    for reuse across trials) are removed once it is done, so runs do not pile them up."""
    before = {i["name"] for i in daemon.request("GET", "/v1/images")}
    yield
    for i in daemon.request("GET", "/v1/images"):
        if i["name"].startswith("harbor-") and i["name"] not in before:
            daemon.request("DELETE", f"/v1/images/{i['name']}")


def harbor_sandboxes(d: Daemon, env_slug: str) -> List[str]:
    return [
        s.name for s in d.sandboxes() if (s.raw.get("labels") or {}).get("crab.harbor.env") == env_slug
    ]


def test_oracle_trials_fork_one_base_and_score(daemon: Daemon, harbor_py: str, registry: str, tmp_path: Path) -> None:
    name = unique("hb-oracle")
    task = make_task(tmp_path, name, registry)
    trials = harbor_run(harbor_py, task, tmp_path / "jobs", "fork", "oracle", "-k", "2", "-n", "2", "--ek", "fork=true")
    assert len(trials) == 2, trials.keys()
    for t, r in trials.items():
        assert reward(r) == 1, f"{t}: {exception(r)} {r.get('verifier_result')}"
    # The base and the trials are gone once harbor exits.
    assert harbor_sandboxes(daemon, name) == []

    (fresh,) = harbor_run(harbor_py, task, tmp_path / "jobs", "fresh", "oracle").values()
    assert reward(fresh) == 1, exception(fresh)
    assert harbor_sandboxes(daemon, name) == []


def test_nop_agent_scores_zero(daemon: Daemon, harbor_py: str, registry: str, tmp_path: Path) -> None:
    name = unique("hb-nop")
    task = make_task(tmp_path, name, registry)
    (r,) = harbor_run(harbor_py, task, tmp_path / "jobs", "nop", "nop").values()
    assert reward(r) == 0, f"{exception(r)} {r.get('verifier_result')}"
    assert harbor_sandboxes(daemon, name) == []


def test_checkpoint_per_command_restores_before_the_solution(
    daemon: Daemon, harbor_py: str, registry: str, tmp_path: Path
) -> None:
    name = unique("hb-points")
    task = make_task(tmp_path, name, registry)
    (r,) = harbor_run(
        harbor_py, task, tmp_path / "jobs", "points", "oracle", "--ek", "checkpoint=exec", "--ek", "fork=true", "--no-delete"
    ).values()
    assert reward(r) == 1, exception(r)
    (kept,) = harbor_sandboxes(daemon, name)
    sb = Sandbox(kept, daemon)
    try:
        assert sb.read_file("/app/answer.txt") == b"42\n"
        points = sb.points()
        assert len(points) >= 4, [p.id for p in points]  # one per command, and the fork's origin
        # The newest point without the answer: before the oracle's solve.sh ran.
        before = None
        for p in points:
            sb.restore(p)
            if sb.exec(["test", "-e", "/app/answer.txt"]).exit_code != 0:
                before = p
        assert before is not None, "no point before the solution"
        sb.restore(before)
        assert sb.exec(["test", "-e", "/app/answer.txt"]).exit_code != 0
        assert sb.read_file("/app/built.txt") == b"built by crab\n"
    finally:
        sb.kill()


def test_compose_task_is_refused_naming_the_file(daemon: Daemon, harbor_py: str, registry: str, tmp_path: Path) -> None:
    name = unique("hb-compose")
    task = make_task(tmp_path, name, registry, compose=True)
    p = harbor(harbor_py, task, tmp_path / "jobs", "compose", "oracle")
    # Harbor draws the error in a box (COLUMNS is wide, so it does not fold the path).
    out = " ".join(re.sub("[│╭╮╰╯─]", " ", p.stdout + p.stderr).split())
    assert p.returncode != 0, out[-2000:]
    assert "docker-compose.yaml declares Docker Compose services" in out, out[-3000:]
    assert harbor_sandboxes(daemon, name) == []


def test_harbor_venv_is_pinned() -> None:
    """The Harbor the tests ran is the pinned one (scripts/install-harbor.sh)."""
    py = os.environ.get("CRAB_HARBOR_PY")
    if not py:
        cannot_run("needs CRAB_HARBOR_PY")
    out = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('harbor'))"], capture_output=True, text=True)
    pins = (ROOT / "scripts" / "install-harbor.sh").read_text()
    assert f"harbor=={out.stdout.strip()}" in pins, out
    assert shutil.which("harbor", path=str(Path(py).parent))
