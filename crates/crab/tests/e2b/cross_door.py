"""One sandbox's life seen through two doors (issue 27): the E2B SDK and Crab's own CLI read
and change the same host state. Steps, each run by crates/crab/tests/e2b.rs between CLI calls:

  e2b-pause          create a sandbox, pause it through E2B; print its id
  connect ID         connect() to a sandbox paused through `crab sandbox pause`; print a file
  ttl                create one with a 2 s timeout and auto-pause; print its id
"""

import sys

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
    elif step == "ttl":
        sb = Sandbox.create("base", timeout=2, lifecycle={"on_timeout": "pause"})
        print(sb.sandbox_id)
    else:
        raise SystemExit(f"unknown step {step}")
    print(f"ok {step}")


if __name__ == "__main__":
    main()
