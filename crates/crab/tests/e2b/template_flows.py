"""E2B template builds through the unmodified `e2b` SDK against Crab's E2B front door.

Run by crates/crab/tests/e2b.rs (`sdk_template_builds`) against a daemon of its own. Each check
prints `ok NAME`; any failure raises (non-zero exit). Checks (all by default, or those named
in CRAB_E2B_ONLY, comma-separated):

- chain: `Template().from_image("debian")` with run_cmd, copy (a file uploaded through the
  front door's upload URL), set_envs, set_workdir, run_cmd as another user →
  `Template.build(…, on_build_logs=…)`: the logs arrive (the RUN's own output among them), the
  build ends ready, `Sandbox.create(name)` shows every step's effect. Building it again uses the
  cache (the files already present, the steps cached); `skip_cache=True` runs the steps again.
- dockerfile: `Template().from_dockerfile(TEXT)` with RUN, COPY, ENV, WORKDIR: the same; a RUN
  printing 250 lines reaches `on_build_logs` whole and in order (the status pages by 100).
- base: `Template().from_base_image()` (E2B's `e2bdev/base`) builds on the daemon's default
  image.
- async: `AsyncTemplate.build` and `AsyncSandbox.create` of it.
- failing: a RUN that exits 3 → the SDK raises BuildException naming the step; the command's
  output is in the logs; no template (Sandbox.create answers not found).
- refused: set_start_cmd → the SDK raises BuildException naming what Crab does not support.
- hostile: the upload URL without its token (401), an upload over the daemon's --max-upload
  (CRAB_E2B_MAX_UPLOAD bytes; 413 at once when declared, 413 once passed when chunked, nothing
  kept), and a tar whose entry climbs out with `..` (the build fails naming it; nothing is
  written outside).

`template_flows.py restart-before STATE.json` starts a long build in the background
(`Template.build_in_background`) and writes its ids to STATE.json; after the daemon was
restarted, `template_flows.py restart-after STATE.json` reads its status: `error`, saying the
daemon restarted during the build.
"""

import io
import json
import tarfile
import time

import httpx

import os
import sys
import tempfile
import uuid

from e2b import Sandbox, Template
from e2b.exceptions import BuildException, NotFoundException, SandboxException

ONLY = [c for c in os.environ.get("CRAB_E2B_ONLY", "").split(",") if c]
TAG = uuid.uuid4().hex[:8]


def want(name):
    return not ONLY or name in ONLY


def build(template, name):
    logs = []
    Template.build(template, name, on_build_logs=lambda e: logs.append(str(e.message)))
    return logs


def sh(sb, cmd, user="root"):
    r = sb.commands.run(cmd, user=user, timeout=60)
    return r.stdout


def chain(ctx):
    with open(os.path.join(ctx, "file.txt"), "w") as f:
        f.write("copied-through-e2b\n")
    os.makedirs(os.path.join(ctx, "tree/sub"), exist_ok=True)
    with open(os.path.join(ctx, "tree/sub/deep.txt"), "w") as f:
        f.write("deep\n")
    name = f"tpl-chain-{TAG}"
    t = (
        Template(file_context_path=ctx)
        .from_image("debian")
        # The run's tag makes the step new (the step cache is the host's, shared by builds).
        .run_cmd(f"echo built > /built && echo the-run-printed-$((6*7)) # {TAG}")
        .copy("file.txt", "/app/file.txt")
        .copy("tree", "/app/tree")
        .set_envs({"GREETING": "hello world", "QUOTED": 'a "b" $c'})
        .set_workdir("/app")
        .run_cmd("id -un > /tmp/who", user="nobody")
        .run_cmd("pwd > /app/pwd")
    )
    assert not Template.exists(name)
    logs = build(t, name)
    assert Template.exists(name)
    text = "\n".join(logs)
    # The RUN's own output (not its command line, which holds no "42").
    assert "the-run-printed-42" in logs, text
    assert any("Uploaded" in l for l in logs), text
    sb = Sandbox.create(name, timeout=120)
    try:
        assert sh(sb, "cat /built") == "built\n"
        assert sh(sb, "cat /app/file.txt") == "copied-through-e2b\n"
        assert sh(sb, "cat /app/tree/sub/deep.txt") == "deep\n"
        assert sh(sb, "cat /app/pwd") == "/app\n", sh(sb, "cat /app/pwd")
        assert sh(sb, "cat /tmp/who") == "nobody\n", sh(sb, "cat /tmp/who")
        env = sh(sb, "cat /proc/1/environ | tr '\\0' '\\n'; env")
        assert "GREETING=hello world" in env, env
        assert 'QUOTED=a "b" $c' in env, env
    finally:
        sb.kill()
    # Again: the files are already here, the steps cached.
    logs = build(t, name)
    text = "\n".join(logs)
    assert any("already cached" in l for l in logs), text
    assert "cached" in logs and "the-run-printed-42" not in logs, text
    # skip_cache=True runs every step again.
    logs = []
    Template.build(t, name, skip_cache=True, on_build_logs=lambda e: logs.append(str(e.message)))
    assert "the-run-printed-42" in logs, "\n".join(logs)
    print("ok chain", flush=True)


DOCKERFILE = """FROM debian
RUN echo from-dockerfile > /df-built # TAG
COPY app.sh /opt/app.sh
ENV MODE=production
WORKDIR /srv
RUN pwd > /srv/where && sh /opt/app.sh > /srv/out
RUN for i in $(seq 1 250); do echo "line-$i"; done
"""


def dockerfile(ctx):
    with open(os.path.join(ctx, "app.sh"), "w") as f:
        f.write("echo app-ran-with-$MODE\n")
    name = f"tpl-df-{TAG}"
    text = DOCKERFILE.replace("TAG", TAG)
    logs = build(Template(file_context_path=ctx).from_dockerfile(text), name)
    # 250 lines of one RUN arrive whole and in order, over the 100-entry pages of the status.
    lines = [l for l in logs if l.startswith("line-")]
    assert lines == [f"line-{i}" for i in range(1, 251)], lines[:5] + lines[-5:]
    sb = Sandbox.create(name, timeout=120)
    try:
        assert sh(sb, "cat /df-built") == "from-dockerfile\n"
        assert sh(sb, "cat /srv/where") == "/srv\n"
        assert sh(sb, "cat /srv/out") == "app-ran-with-production\n"
        assert sh(sb, "cat /opt/app.sh") == "echo app-ran-with-$MODE\n"
        assert "MODE=production" in sh(sb, "env"), sh(sb, "env")
    finally:
        sb.kill()
    print("ok dockerfile", flush=True)


def base(ctx):
    # E2B's base image is the daemon's default image (debian, with E2B's `user`).
    name = f"tpl-base-{TAG}"
    build(Template(file_context_path=ctx).from_base_image().run_cmd("echo on-base > /b"), name)
    sb = Sandbox.create(name, timeout=120)
    try:
        assert sh(sb, "cat /b") == "on-base\n"
        assert sh(sb, "id -u", user="user") == "1000\n"
    finally:
        sb.kill()
    print("ok base", flush=True)


def async_build(ctx):
    import asyncio

    from e2b import AsyncSandbox, AsyncTemplate

    async def go():
        name = f"tpl-async-{TAG}"
        logs = []
        t = AsyncTemplate(file_context_path=ctx).from_image("debian").run_cmd("echo async > /a")
        await AsyncTemplate.build(t, name, on_build_logs=lambda e: logs.append(str(e.message)))
        sb = await AsyncSandbox.create(name, timeout=120)
        try:
            r = await sb.commands.run("cat /a", user="root")
            assert r.stdout == "async\n", r
        finally:
            await sb.kill()

    asyncio.run(go())
    print("ok async", flush=True)


def failing(ctx):
    name = f"tpl-fail-{TAG}"
    t = (
        Template(file_context_path=ctx)
        .from_image("debian")
        .run_cmd("echo before-the-failure")
        .run_cmd("echo the-failing-step-said-this; exit 3")
    )
    logs = []
    try:
        Template.build(t, name, on_build_logs=lambda e: logs.append(str(e.message)))
        raise AssertionError("a failing RUN built")
    except BuildException as e:
        msg = str(e)
        # The step as the SDK numbers it (1: the first after the base), and the exit code.
        assert msg.startswith("E2B step 2: ") and "code 3" in msg, msg
    text = "\n".join(logs)
    assert "the-failing-step-said-this" in text, text
    try:
        Sandbox.create(name, timeout=60).kill()
        raise AssertionError("a failed build left a template")
    except (NotFoundException, SandboxException) as e:
        assert "not found" in str(e), str(e)
    print("ok failing", flush=True)


def refused(ctx):
    t = (
        Template(file_context_path=ctx)
        .from_image("debian")
        .run_cmd("true")
        .set_start_cmd("sleep infinity", "true")
    )
    try:
        Template.build(t, f"tpl-start-{TAG}")
        raise AssertionError("a start command was accepted")
    except BuildException as e:
        assert "set_start_cmd" in str(e), str(e)
    print("ok refused", flush=True)


def restart_before(ctx, state):
    t = Template(file_context_path=ctx).from_image("debian").run_cmd("sleep 600")
    info = Template.build_in_background(t, f"tpl-restart-{TAG}")
    st = Template.get_build_status(info, logs_offset=0)
    assert st.status.value == "building", st
    with open(state, "w") as f:
        json.dump({"template": info.template_id, "build": info.build_id}, f)
    print("ok restart-before", flush=True)


def restart_after(state):
    from e2b.template.types import BuildInfo

    with open(state) as f:
        made = json.load(f)
    info = BuildInfo(
        template_id=made["template"], build_id=made["build"], alias=made["template"],
        name=made["template"], tags=[],
    )
    st = Template.get_build_status(info, logs_offset=0)
    assert st.status.value == "error", st
    assert "restarted during the build" in st.reason.message, st.reason
    try:
        Sandbox.create(made["template"], timeout=60).kill()
        raise AssertionError("an interrupted build left a template")
    except (NotFoundException, SandboxException) as e:
        assert "not found" in str(e), str(e)
    print("ok restart-after", flush=True)


API = os.environ.get("E2B_API_URL", "")
KEY = os.environ.get("E2B_API_KEY", "")


def rest(method, path, **kw):
    return httpx.request(method, API + path, headers={"X-API-Key": KEY}, timeout=60, **kw)


def hostile(ctx):
    limit = int(os.environ["CRAB_E2B_MAX_UPLOAD"])
    r = rest("POST", "/v3/templates", json={"name": f"tpl-hostile-{TAG}"})
    assert r.status_code == 202, r.text
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    # The files link needs the API key; the upload URL its token.
    assert httpx.get(f"{API}/templates/{tid}/files/00aa").status_code == 401
    h = "ab" * 32
    r = rest("GET", f"/templates/{tid}/files/{h}")
    assert r.status_code == 201 and r.json()["present"] is False, r.text
    url = r.json()["url"]
    assert url.startswith(API + "/"), url
    bad = url.split("token=")[0] + "token=" + "0" * 48
    r = httpx.put(bad, content=b"x")
    assert r.status_code == 401, (r.status_code, r.text)
    # Over the limit, declared: refused at once.
    r = httpx.put(url, content=b"\0" * (limit + 1), timeout=60)
    assert r.status_code == 413 and "--max-upload" in r.text, (r.status_code, r.text)
    # Over the limit, chunked (no Content-Length): refused once passed.
    def chunks():
        for _ in range(limit // 65536 + 2):
            yield b"\0" * 65536
    try:
        r = httpx.put(url, content=chunks(), timeout=60)
        assert r.status_code == 413, (r.status_code, r.text)
    except httpx.HTTPError:
        pass  # the server may close the connection mid-body
    r = rest("GET", f"/templates/{tid}/files/{h}")
    assert r.json()["present"] is False, "a refused upload was kept"
    # A tar whose entry climbs out of its destination.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        data = b"escaped"
        info = tarfile.TarInfo(f"../../../../tmp/crab-e2b-escape-{TAG}")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    r = httpx.put(url, content=buf.getvalue())
    assert r.status_code == 200, (r.status_code, r.text)
    steps = [{"type": "COPY", "args": ["x", "/x", "", ""], "filesHash": h, "force": False}]
    r = rest("POST", f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": "debian", "steps": steps})
    assert r.status_code == 202, r.text
    deadline = time.time() + 120
    while True:
        st = rest("GET", f"/templates/{tid}/builds/{bid}/status?logsOffset=0").json()
        if st["status"] != "building":
            break
        assert time.time() < deadline, st
        time.sleep(0.2)
    assert st["status"] == "error", st
    assert "climbs out" in st["reason"]["message"], st["reason"]
    assert st["reason"]["step"] == "1", st["reason"]
    assert not os.path.exists(f"/tmp/crab-e2b-escape-{TAG}")
    # A COPY whose files never came, and an unknown build.
    steps[0]["filesHash"] = "cd" * 32
    r = rest("POST", f"/v2/templates/{tid}/builds/b{TAG}", json={"fromImage": "debian", "steps": steps})
    assert r.status_code == 400 and "never uploaded" in r.text, r.text
    r = rest("GET", f"/templates/{tid}/builds/bnone{TAG}/status")
    assert r.status_code == 404, r.text
    print("ok hostile", flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "restart-before":
        with tempfile.TemporaryDirectory() as ctx:
            restart_before(ctx, sys.argv[2])
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "restart-after":
        restart_after(sys.argv[2])
        return 0
    with tempfile.TemporaryDirectory() as ctx:
        for name, f in [("chain", chain), ("dockerfile", dockerfile), ("base", base), ("async", async_build), ("failing", failing), ("refused", refused), ("hostile", hostile)]:
            if want(name):
                f(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
