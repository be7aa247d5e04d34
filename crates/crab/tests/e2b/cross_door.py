"""One sandbox's life seen through two doors (issue 27): the E2B SDK and Crab's own CLI read
and change the same host state. Steps, each run by crates/crab/tests/e2b.rs between CLI calls:

  e2b-pause          create a sandbox, pause it through E2B; print its id
  connect ID         connect() to a sandbox paused through `crab sandbox pause`; print a file
  ttl                create one with a 2 s timeout and auto-pause; print its id
  park-run CRAB      create one with a background counter, park it with `CRAB sandbox park`
                     (issue 31), then run a command through E2B: it wakes it, the counter
                     goes on; print its id
"""

import subprocess
import sys
import time

from e2b import Sandbox


def main() -> None:
    step = sys.argv[1]
    if step == "e2b-pause":
        sb = Sandbox.create("base", timeout=300, metadata={"door": "e2b"})
        sb.commands.run("echo through-e2b > /tmp/door")
        assert sb.pause()
        print(sb.sandbox_id)
    elif step == "connect":
        sb = Sandbox.connect(sys.argv[2])
        print(sb.commands.run("cat /tmp/door", user="root").stdout.strip())
        assert sb.get_info().state.value == "running"
    elif step == "park-run":
        sb = Sandbox.create("base", timeout=300)
        sb.commands.run("nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/n; sleep 0.1; done' >/dev/null 2>&1 &", user="root")
        time.sleep(0.5)
        out = subprocess.run([sys.argv[2], "--json", "sandbox", "park", sb.sandbox_id], capture_output=True, text=True)
        assert out.returncode == 0 and '"parked"' in out.stdout, (out.stdout, out.stderr)
        # E2B sees it running (a call wakes it), and a command does wake it.
        assert sb.is_running()
        n1 = int(sb.commands.run("cat /tmp/n", user="root").stdout)
        time.sleep(0.5)
        n2 = int(sb.commands.run("cat /tmp/n", user="root").stdout)
        assert n2 > n1 > 0, (n1, n2)
        print(sb.sandbox_id)
    elif step == "ttl":
        sb = Sandbox.create("base", timeout=2, lifecycle={"on_timeout": "pause"})
        print(sb.sandbox_id)
    else:
        raise SystemExit(f"unknown step {step}")
    print(f"ok {step}")


if __name__ == "__main__":
    main()
