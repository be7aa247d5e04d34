//! `crab docker` through a `crab-docker` link, driven the way mini-swe-agent's docker
//! environment drives `docker` (see ../shared/agents.md): `run -d --name … -w … IMAGE sleep 2h`,
//! `exec -w … -e K=V… NAME bash -lc CMD` per action, `stop` at the end — then what a harness
//! does with the result: `ps`, `inspect -f`, `start`, `kill`, `rm`. Real daemon, real CRIU (root).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use common::{crab_ok, ensure_daemon, state_dir, unique, wait_until, Sandbox};

/// A `crab-docker` link to the test binary, in a fresh directory.
fn docker_link() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("crab-docker");
    std::os::unix::fs::symlink(common::bin(), &link).unwrap();
    (dir, link)
}

fn docker(link: &PathBuf, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(link)
        .args(args)
        .env("CRAB_STATE_DIR", state_dir())
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(data) = stdin {
        child.stdin.take().unwrap().write_all(data).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn ok(link: &PathBuf, args: &[&str]) -> String {
    let out = docker(link, args, None);
    assert!(
        out.status.success(),
        "crab-docker {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn mini_swe_agent_call_sequence_and_lifecycle() {
    ensure_daemon();
    let (_dir, d) = docker_link();
    let name = unique("minisweagent");
    // Removed at the end whatever happens.
    let _guard = Sandbox { name: name.clone() };

    // docker run -d --name N -w CWD IMAGE sleep 2h: prints the container's id (here the name).
    let out = ok(&d, &["run", "-d", "--name", &name, "-w", "/testbed", "debian", "sleep", "2h"]);
    assert_eq!(out.trim(), name);
    assert!(ok(&d, &["exec", &name, "ps", "-eo", "args"]).contains("sleep 2h"));

    // One action: exec -w CWD -e K=V … NAME bash -lc CMD, output and exit code passed through.
    let action = "echo \"$PAGER $MANPAGER\"; pwd; printf 'x\\n' > a.txt; \
                  nohup python3 -m http.server 9000 >/dev/null 2>&1 & sleep 0.5; exit 3";
    let out = docker(
        &d,
        &[
            "exec",
            "-w",
            "/testbed",
            "-e",
            "PAGER=cat",
            "-e",
            "MANPAGER=cat",
            &name,
            "bash",
            "-lc",
            action,
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "cat cat\n/testbed\n");
    // -i passes stdin through.
    let out = docker(&d, &["exec", "-i", &name, "sh", "-c", "cat > /testbed/in.txt"], Some(b"fed"));
    assert!(out.status.success(), "{out:?}");
    assert_eq!(ok(&d, &["exec", &name, "cat", "/testbed/in.txt"]), "fed");

    assert!(ok(&d, &["ps", "-q"]).lines().any(|l| l == name));
    assert_eq!(ok(&d, &["inspect", "-f", "{{.State.Running}}", &name]).trim(), "true");
    let doc: serde_json::Value = serde_json::from_str(&ok(&d, &["inspect", &name])).unwrap();
    assert_eq!(doc[0]["Name"], format!("/{name}"));
    assert_eq!(doc[0]["Config"]["Image"], "debian");

    // stop (mini's cleanup): a restore point, then no process runs; nothing is lost.
    assert_eq!(ok(&d, &["stop", &name]).trim(), name);
    assert_eq!(ok(&d, &["inspect", "-f", "{{.State.Status}}", &name]).trim(), "exited");
    assert!(!ok(&d, &["ps", "-q"]).lines().any(|l| l == name));
    assert!(ok(&d, &["ps", "-a", "-q"]).lines().any(|l| l == name));
    let points: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "checkpoints", &name])).unwrap();
    assert!(!points.is_empty(), "stop published no restore point");
    let out = docker(&d, &["exec", &name, "true"], None);
    assert_eq!(out.status.code(), Some(125), "exec in a stopped sandbox: {out:?}");
    // A second stop is a no-op, like docker's.
    ok(&d, &["stop", &name]);

    // start: files and processes come back from the point stop published.
    ok(&d, &["start", &name]);
    assert_eq!(ok(&d, &["exec", &name, "cat", "/testbed/a.txt"]), "x\n");
    let up = || {
        docker(&d, &["exec", &name, "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9000"], None)
            .status
            .success()
    };
    assert!(wait_until(10.0, up), "the http.server did not come back with start");
    assert!(ok(&d, &["exec", &name, "ps", "-eo", "args"]).contains("sleep 2h"));

    // rm refuses a running sandbox; kill stops it without a checkpoint; then rm removes.
    let n_points = points.len();
    let out = docker(&d, &["rm", &name], None);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rm -f"), "{out:?}");
    ok(&d, &["kill", &name]);
    assert_eq!(ok(&d, &["inspect", "-f", "{{.State.Running}}", &name]).trim(), "false");
    let after: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "checkpoints", &name])).unwrap();
    // start published a restore marker; kill took nothing.
    assert_eq!(after.len(), n_points + 1, "{after:?}");
    ok(&d, &["rm", &name]);
    let out = docker(&d, &["inspect", &name], None);
    assert_eq!(out.status.code(), Some(125), "removed sandbox still inspectable: {out:?}");
}

#[test]
fn run_in_the_foreground_with_rm_and_refusals() {
    ensure_daemon();
    let (_dir, d) = docker_link();
    let name = unique("dk-fg");
    let _guard = Sandbox { name: name.clone() };
    let out = docker(
        &d,
        &["run", "--rm", "--name", &name, "-e", "X=y", "debian", "sh", "-c", "echo $X; exit 4"],
        None,
    );
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "y\n");
    assert!(!ok(&d, &["ps", "-a", "-q"]).lines().any(|l| l == name), "--rm left the sandbox");

    // Unsupported docker features are refused, naming the fix, and create nothing.
    let out = docker(&d, &["run", "-d", "--name", &name, "-v", "/a:/b", "debian"], None);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bind mounts"), "{out:?}");
    assert!(!ok(&d, &["ps", "-a", "-q"]).lines().any(|l| l == name));
    let out = docker(&d, &["run", "-d", "no-such-image"], None);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("hint:"), "{out:?}");
    // `crab docker` is the same front as the link.
    assert!(crab_ok(&["docker", "version"]).contains("crab daemon"));
}
