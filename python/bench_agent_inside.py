#!/usr/bin/env python3
"""The verdict mix of a real mini-swe-agent running *inside* its sandbox, with and without
harness exclusion (issue 16), side by side on the same commands.

    CRAB_STATE_DIR=/var/lib/crab CRAB_UPSTREAM_OPENAI=http://127.0.0.1:7571 scripts/daemon.sh restart target/release/crab
    python3 python/bench_agent_inside.py --crab target/release/crab --limit 4 --max-turns 20

The agent is mini-swe-agent itself (PyPI, the version ``scripts/install-python-sdk.sh`` pins),
installed into each sandbox at ``/opt/mini`` (a virtualenv built on the host into the sandbox's
root: host and image are both Debian 12, so the interpreter is the same), run with its
``local`` environment (each command a fresh ``bash -c`` in the sandbox) and its real LiteLLM
model, whose base URL is the sandbox's own LLM endpoint ``http://127.0.0.1:7431/v1``: each of
its LLM requests is a turn boundary Crab's proxy checkpoints with the sandbox's ``auto`` policy
and gates the answer on. The "LLM" behind the daemon (``--upstream-openai``, which must be this
script's ``--llm-listen``) answers the n-th request of a run with the n-th command of a real
mini-swe-agent trajectory from ``../shared/traces`` as a ``bash`` tool call (then
``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``), after ``--llm-latency`` seconds.

Two sandboxes per trajectory run the same commands at the same time: one declares the agent as
its harness (``--harness-cmd '^/opt/mini/bin/python -m minisweagent'``, ``--harness-path
/opt/mini-run``, where the agent writes its trajectory), one does not. Printed: each arm's
checkpoint kinds over all its turn boundaries. Needs root and a running daemon with the
``debian`` image. Without ``/testbed`` most SWE-bench commands fail the same way in both arms.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

MINI_PIN = "mini-swe-agent==2.4.6"
HARNESS_CMD = r"^/opt/mini/bin/python -m minisweagent"
HARNESS_PATH = "/opt/mini-run"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
KINDS = ("skip", "fs", "process", "full")


def busy() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3]
    return "load average " + " ".join(load)


class Crab:
    def __init__(self, binary: str, state_dir: str) -> None:
        self.bin, self.state = binary, state_dir

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [self.bin, "--state-dir", self.state, *args], capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            sys.exit(f"error: crab {' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}")
        return r

    def json(self, *args: str):
        return json.loads(self.run("--json", *args).stdout)


def commands(path: Path, max_turns: int) -> List[str]:
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        step = json.loads(line)
        if step.get("kind") == "submit" or "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in step["action"]:
            continue
        out.append(step["action"])
        if max_turns and len(out) >= max_turns:
            break
    return out


class Llm(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, scripts: Dict[str, List[str]], latency: float) -> None:
        super().__init__(addr, LlmHandler)
        self.scripts, self.latency, self.requests = scripts, latency, 0


class LlmHandler(http.server.BaseHTTPRequestHandler):
    server: Llm

    def log_message(self, *a) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        run = body.get("user") or self.headers.get("x-crab-replay-run") or ""
        script = self.server.scripts.get(run)
        if script is None or not self.path.endswith("/chat/completions"):
            print(f"llm: no run for {self.path} (user {run!r}, keys {sorted(body)})", file=sys.stderr)
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "unknown run or path"}}')
            return
        n = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        cmd = script[n] if n < len(script) else SUBMIT
        self.server.requests += 1
        time.sleep(self.server.latency)
        reply = {
            "id": f"chatcmpl-{run}-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "x"),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": f"Step {n}.",
                        "tool_calls": [
                            {
                                "id": f"call_{n}",
                                "type": "function",
                                "function": {"name": "bash", "arguments": json.dumps({"command": cmd})},
                            }
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def install_mini(root: Path, cache: Path) -> None:
    """mini-swe-agent into ``<root>/opt/mini``: a venv of ``/usr/bin/python3`` built once at
    ``cache`` (run as ``/opt/mini/bin/python -m``, it needs no path of its own), copied into
    each root."""
    if not (cache / "ok").exists():
        if cache.exists():
            shutil.rmtree(cache)
        # The image's interpreter path: the venv's bin/python links to it, inside as outside
        # (not sys.executable, which may be a pyenv or venv interpreter the sandbox lacks).
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(cache)], check=True)
        subprocess.run(
            [str(cache / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", MINI_PIN],
            check=True,
        )
        (cache / "ok").write_text("")
    dst = root / "opt" / "mini"
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", "--reflink=auto", str(cache), str(dst)], check=True)


def run_arm(crab: Crab, name: str, task: str, env: Dict[str, str], results: Dict[str, dict]) -> None:
    envs = [f"{k}={v}" for k, v in env.items()]
    t0 = time.monotonic()
    r = crab.run(
        "exec", name, "-w", "/root", "--", "env", *envs,
        "/opt/mini/bin/python", "-m", "minisweagent.run.mini",
        "-c", "mini.yaml", "-c", f"{HARNESS_PATH}/run.yaml", "-y", "--exit-immediately",
        "-t", task, "-o", f"{HARNESS_PATH}/traj.json",
        check=False, timeout=3600,
    )
    results[name] = {"rc": r.returncode, "s": time.monotonic() - t0, "tail": (r.stdout + r.stderr)[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crab", default="target/release/crab")
    ap.add_argument("--state-dir", default=os.environ.get("CRAB_STATE_DIR", "/var/lib/crab"))
    ap.add_argument("--traces", default="../shared/traces/mini-swe-agent/deepseek_chat_dev")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=20)
    ap.add_argument("--llm-listen", default="127.0.0.1:7571", help="must be the daemon's --upstream-openai")
    ap.add_argument("--llm-latency", type=float, default=0.5, help="seconds each answer takes")
    ap.add_argument("--image", default="debian")
    ap.add_argument("--cache", default="/var/tmp/crab-bench-mini-venv", help="where the agent's venv is built once")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: needs root (the sandboxes' roots are written from the host)")
    crab = Crab(args.crab, args.state_dir)
    crab.run("version")
    traces = sorted(p for p in Path(args.traces).glob("*.jsonl"))[: args.limit or None]
    if not traces:
        sys.exit(f"error: no *.jsonl trajectories in {args.traces}")
    print(f"# {busy()} at start; {len(traces)} trajectories x 2 arms, {args.max_turns} turns each")
    host, port = args.llm_listen.rsplit(":", 1)
    scripts: Dict[str, List[str]] = {}
    llm = Llm((host, int(port)), scripts, args.llm_latency)
    threading.Thread(target=llm.serve_forever, daemon=True).start()
    tag = f"{os.getpid() % 100000:05d}"
    rows = []
    made: List[str] = []
    try:
        for i, trace in enumerate(traces):
            cmds = commands(trace, args.max_turns)
            arms = {"declared": f"ai-{tag}-{i}-on", "undeclared": f"ai-{tag}-{i}-off"}
            for arm, name in arms.items():
                extra = ["--harness-cmd", HARNESS_CMD, "--harness-path", HARNESS_PATH] if arm == "declared" else []
                crab.run("sandbox", "create", args.image, "--name", name, "--checkpoint-policy", "auto", *extra)
                made.append(name)
                root = Path(args.state_dir) / "pool" / "sandboxes" / name / "rootfs"
                install_mini(root, Path(args.cache))
                run_dir = root / HARNESS_PATH.lstrip("/")
                run_dir.mkdir(parents=True, exist_ok=True)
                config = {
                    "agent": {"step_limit": len(cmds) + 3},
                    "environment": {"environment_class": "local", "cwd": "/root", "timeout": 60},
                    "model": {
                        "model_name": "openai/crab-bench",
                        # the run key as a header (LiteLLM drops `user` here); it passes
                        # through Crab's proxy untouched
                        "model_kwargs": {
                            "api_base": "http://127.0.0.1:7431/v1",
                            "extra_headers": {"x-crab-replay-run": name},
                        },
                        "cost_tracking": "ignore_errors",
                    },
                }
                (run_dir / "run.yaml").write_text(json.dumps(config))
                scripts[name] = cmds
            env = {
                "MSWEA_CONFIGURED": "true",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "MSWEA_GLOBAL_CONFIG_DIR": f"{HARNESS_PATH}/config",
                "OPENAI_API_KEY": "x",
                "HOME": "/root",
            }
            results: Dict[str, dict] = {}
            threads = [
                threading.Thread(target=run_arm, args=(crab, n, f"Trajectory {trace.stem}", env, results))
                for n in arms.values()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for arm, name in arms.items():
                res = results[name]
                if res["rc"] != 0:
                    print(f"error: the agent in {name} exited {res['rc']}:\n{res['tail']}", file=sys.stderr)
                points = crab.json("checkpoints", name)
                counts = {k: 0 for k in KINDS}
                for p in points:
                    kind = p["point"]["kind"] if "point" in p else p.get("kind")
                    if kind in counts:
                        counts[kind] += 1
                rows.append({"trajectory": trace.stem, "arm": arm, "sandbox": name, "commands": len(cmds),
                             "agent_rc": res["rc"], "agent_s": round(res["s"], 1), **counts})
                print(f"{trace.stem:40} {arm:10} rc={res['rc']} {res['s']:6.1f} s  "
                      + " ".join(f"{k}={counts[k]}" for k in KINDS), flush=True)
            for name in arms.values():
                crab.run("sandbox", "rm", "-f", name, check=False)
                made.remove(name)
    finally:
        for name in made:
            crab.run("sandbox", "rm", "-f", name, check=False)
        llm.shutdown()
    print(f"# {busy()} at end; {llm.requests} LLM requests answered")
    print("| arm | skip | fs | process | full | agent exit codes |")
    print("|---|---|---|---|---|---|")
    for arm in ("declared", "undeclared"):
        rs = [r for r in rows if r["arm"] == arm]
        tot = {k: sum(r[k] for r in rs) for k in KINDS}
        codes = ",".join(str(r["agent_rc"]) for r in rs)
        print(f"| {arm} | {tot['skip']} | {tot['fs']} | {tot['process']} | {tot['full']} | {codes} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "llm_requests": llm.requests}, indent=1))
    if any(r["agent_rc"] != 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
