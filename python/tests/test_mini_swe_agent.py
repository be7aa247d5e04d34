"""mini-swe-agent (PyPI, pinned in scripts/install-python-sdk.sh --with-agents) run for real
with its docker environment, ``environment.executable`` set to a ``crab-docker`` link and no
other change: the agent's own ``run -d``/``exec``/``stop`` calls go to ``crab docker``. The LLM
is mini-swe-agent's own scripted model (``DeterministicToolcallModel``: the replies of a
tool-calling model, in order), so the run is the real agent loop, the real docker environment
and the real sandbox; only the model's answers are fixed.

Asserted: the commands ran in a Crab sandbox (the files they wrote are there through
``crab exec``, not on the host; the trajectory holds the sandbox's answers), ``stop`` at the
agent's exit kept the sandbox and published a restore point, ``crab docker start`` brings the
files back, and a ``full`` checkpoint/restore gives back the files and the server the agent
left running after they were destroyed. ≈ 10 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import Cleanup, cannot_run, crab_bin, state_dir

from crab_sandbox import Daemon, Sandbox

# The agent's steps: fix a bug in a file it writes, leave a server running, submit.
STEPS = [
    "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && python3 -B -c 'import calc; print(calc.add(2, 3))'",
    "sed -i 's/a - b/a + b/' calc.py && python3 -B -c 'import calc; print(calc.add(2, 3))' && cat /proc/1/comm",
    "nohup python3 -m http.server 8765 >/dev/null 2>&1 & sleep 0.5; echo started",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]


def scripted_model() -> Dict[str, Any]:
    outputs = []
    for i, cmd in enumerate(STEPS):
        call = f"call_{i}"
        outputs.append(
            {
                "role": "assistant",
                "content": f"Step {i}.",
                "tool_calls": [
                    {"id": call, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": cmd})}}
                ],
                "extra": {"actions": [{"command": cmd, "tool_call_id": call}], "cost": 0.0},
            }
        )
    return {
        "model_name": "scripted",
        "model_class": "minisweagent.models.test_models.DeterministicToolcallModel",
        "outputs": outputs,
    }


def crab(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [crab_bin(), *args], capture_output=True, text=True, env={**os.environ, "CRAB_STATE_DIR": state_dir()}
    )
    if check:
        assert r.returncode == 0, f"crab {args} failed ({r.returncode}): {r.stdout}{r.stderr}"
    return r


def names(d: Daemon) -> List[str]:
    return [s["name"] for s in d.request("GET", "/v1/sandboxes")]


def test_mini_swe_agent_runs_in_a_crab_sandbox_via_crab_docker(daemon: Daemon, cleanup: Cleanup, tmp_path: Path) -> None:
    mini = Path(sys.executable).parent / "mini"
    if not mini.exists():
        cannot_run("mini-swe-agent is not in this venv: scripts/install-python-sdk.sh --with-agents")
    link = tmp_path / "crab-docker"
    link.symlink_to(crab_bin())
    # The environment as a user would write it for docker, plus the one change: the executable.
    config = {
        "agent": {"step_limit": 10},
        "environment": {"environment_class": "docker", "image": "debian", "cwd": "/testbed", "executable": str(link)},
        "model": scripted_model(),
    }
    (tmp_path / "run.yaml").write_text(json.dumps(config))  # JSON is YAML
    traj = tmp_path / "traj.json"
    before = set(names(daemon))
    env = {
        **os.environ,
        "CRAB_STATE_DIR": state_dir(),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"),
        "OPENAI_API_KEY": "x",
    }
    t0 = time.monotonic()
    run = subprocess.run(
        [str(mini), "-c", "mini.yaml", "-c", str(tmp_path / "run.yaml"), "-y", "--exit-immediately",
         "-t", "Fix add() in calc.py", "-o", str(traj)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    new = [n for n in names(daemon) if n not in before and n.startswith("minisweagent-")]
    for n in new:
        cleanup.add(Sandbox(n, daemon))
    assert run.returncode == 0, f"mini failed: {run.stdout[-3000:]}{run.stderr[-3000:]}"
    print(f"\nmini-swe-agent run through crab docker: {time.monotonic() - t0:.1f} s")
    assert len(new) == 1, f"expected one sandbox made by the agent's `run -d`, got {new}"
    name = new[0]

    # The trajectory: submitted, and the outputs are the sandbox's (the bug, then the fix, and
    # Crab's reaper as pid 1).
    t = json.loads(traj.read_text())
    assert t["info"]["exit_status"] == "Submitted", t["info"]
    outs = [m["extra"]["raw_output"] for m in t["messages"] if m.get("role") == "tool" and "raw_output" in m.get("extra", {})]
    assert outs[:3] == ["-1\n", "5\ninit\n", "started\n"], outs

    # mini's cleanup runs `crab-docker stop` in the background at exit: the sandbox stays, its
    # processes are gone, a restore point holds them.
    sb = Sandbox(name, daemon)
    deadline = time.monotonic() + 60
    while sb.info().state != "stopped":
        assert time.monotonic() < deadline, "the agent's `stop` did not stop the sandbox"
        time.sleep(0.2)
    points = json.loads(crab("--json", "checkpoints", name).stdout)
    assert points, "stop published no restore point"
    assert not Path("/testbed/calc.py").exists(), "the agent wrote on the host, not in the sandbox"

    # start: the files come back from stop's point, read through `crab exec`.
    crab("docker", "start", name)
    assert crab("exec", name, "--", "cat", "/testbed/calc.py").stdout == "def add(a, b):\n    return a + b\n"

    # A full checkpoint, then the agent's work destroyed; restoring gives back the files and
    # the server the agent left running.
    point = json.loads(crab("--json", "checkpoint", name, "--kind", "full").stdout)["point"]
    assert point["kind"] == "full", point
    pid = point["id"]
    crab("exec", name, "--", "sh", "-c", "pkill -f 'http[.]server'; rm -rf /testbed")
    up = "exec 3<>/dev/tcp/127.0.0.1/8765"
    assert crab("exec", name, "--", "test", "-e", "/testbed/calc.py", check=False).returncode != 0
    assert crab("exec", name, "--", "bash", "-c", up, check=False).returncode != 0, "the server survived pkill"
    crab("restore", name, pid)
    assert crab("exec", name, "--", "cat", "/testbed/calc.py").stdout.endswith("return a + b\n")
    deadline = time.monotonic() + 10
    while crab("exec", name, "--", "bash", "-c", up, check=False).returncode != 0:
        assert time.monotonic() < deadline, "the agent's server did not come back with the restore"
        time.sleep(0.2)
