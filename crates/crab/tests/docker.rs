//! `crab docker` through a `crab-docker` link, driven the way mini-swe-agent's docker
//! environment drives `docker` (see ../shared/agents.md): `run -d --name … -w … IMAGE sleep 2h`,
//! `exec -w … -e K=V… NAME bash -lc CMD` per action, `stop` at the end — then what a harness
//! does with the result: `ps`, `inspect -f`, `start`, `kill`, `rm`; and `cp` both ways (trees, `-`
//! tar streams, unsafe archives from stdin and from a hostile sandbox). Real daemon, real CRIU (root).
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

/// `run -d`'s command is a background process of the sandbox (tagged `docker-main`): `logs`
/// replays its output, `logs -f` follows it to its end, and it comes back with `start`.
#[test]
fn run_detached_keeps_the_main_process_and_its_logs() {
    ensure_daemon();
    let (_dir, d) = docker_link();
    let name = unique("t-dk-logs");
    let _guard = Sandbox { name: name.clone() };
    let script = "echo hello; echo oops >&2; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo bye";
    ok(&d, &["run", "-d", "--name", &name, "debian", "sh", "-c", script]);
    let hello = || String::from_utf8_lossy(&docker(&d, &["logs", &name], None).stdout) == "hello\n";
    assert!(wait_until(10.0, hello), "{:?}", docker(&d, &["logs", &name], None));
    let out = docker(&d, &["logs", &name], None);
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    let ps: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "ps", &name])).unwrap();
    assert_eq!(ps.len(), 1, "{ps:?}");
    assert_eq!(
        (ps[0]["tag"].as_str(), ps[0]["state"].as_str()),
        (Some("docker-main"), Some("running"))
    );
    // stop + start: the process comes back from the point, its output with it.
    ok(&d, &["stop", &name]);
    ok(&d, &["start", &name]);
    assert_eq!(ok(&d, &["logs", &name]), "hello\n");
    ok(&d, &["exec", &name, "touch", "/tmp/go"]);
    assert_eq!(ok(&d, &["logs", "-f", &name]), "hello\nbye\n");
    // A sandbox run without a command has no main process to show.
    let bare = unique("t-dk-bare");
    let _bare = Sandbox { name: bare.clone() };
    ok(&d, &["run", "-d", "--name", &bare, "debian"]);
    let out = docker(&d, &["logs", &bare], None);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no main process"), "{out:?}");
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

/// A tar with one member named exactly `name` (the tar crate's builder would refuse `..`).
fn raw_tar(name: &[u8], data: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, data).unwrap();
    b.into_inner().unwrap()
}

#[test]
fn cp_copies_files_and_trees_both_ways_and_refuses_unsafe_archives() {
    ensure_daemon();
    let (_dir, d) = docker_link();
    let name = unique("dk-cp");
    let _guard = Sandbox { name: name.clone() };
    ok(&d, &["run", "-d", "--name", &name, "debian", "sleep", "1h"]);
    let host = tempfile::tempdir().unwrap();
    let h = host.path();
    // A tree with a binary file, a subdirectory and a symlink.
    let proj = h.join("proj");
    std::fs::create_dir_all(proj.join("sub")).unwrap();
    std::fs::write(proj.join("a.txt"), "alpha\n").unwrap();
    let binary: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    std::fs::write(proj.join("sub/b.bin"), &binary).unwrap();
    std::os::unix::fs::symlink("a.txt", proj.join("link")).unwrap();
    let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
    let sb = |path: &str| format!("{name}:{path}");
    let in_sb = |script: &str| ok(&d, &["exec", &name, "sh", "-c", script]);

    // A directory onto a missing path becomes it; onto an existing directory goes into it.
    ok(&d, &["cp", &p(&proj), &sb("/work")]);
    assert_eq!(in_sb("cat /work/a.txt; readlink /work/link"), "alpha\na.txt\n");
    assert_eq!(
        in_sb("md5sum < /work/sub/b.bin").split_whitespace().next(),
        Some(md5(&binary).as_str())
    );
    ok(&d, &["cp", &p(&proj), &sb("/work")]);
    assert_eq!(in_sb("cat /work/proj/a.txt"), "alpha\n");
    // SRC/. copies the contents; a file gets the new name or lands in a directory.
    ok(&d, &["cp", &format!("{}/.", p(&proj)), &sb("/flat")]);
    assert_eq!(in_sb("ls /flat | sort | tr '\\n' ' '"), "a.txt link sub ");
    ok(&d, &["cp", &p(&proj.join("a.txt")), &sb("/work/renamed.txt")]);
    ok(&d, &["cp", &p(&proj.join("a.txt")), &sb("/work/sub")]);
    assert_eq!(in_sb("cat /work/renamed.txt /work/sub/a.txt"), "alpha\nalpha\n");

    // Out: a tree to a missing host path, a file into a host directory, a tar on stdout.
    in_sb("echo from-sandbox > /work/sub/new.txt");
    ok(&d, &["cp", &sb("/work/sub"), &p(&h.join("out"))]);
    assert_eq!(std::fs::read(h.join("out/b.bin")).unwrap(), binary);
    assert_eq!(std::fs::read_to_string(h.join("out/new.txt")).unwrap(), "from-sandbox\n");
    ok(&d, &["cp", &sb("/work/link"), &p(h)]);
    assert_eq!(std::fs::read_link(h.join("link")).unwrap(), std::path::Path::new("a.txt"));
    let out = docker(&d, &["cp", &sb("/work/renamed.txt"), "-"], None);
    assert!(out.status.success(), "{out:?}");
    let mut ar = tar::Archive::new(&out.stdout[..]);
    let names: Vec<String> =
        ar.entries().unwrap().map(|e| e.unwrap().path().unwrap().display().to_string()).collect();
    assert_eq!(names, vec!["renamed.txt"]);
    // In from a tar on stdin, into an existing directory.
    let out = docker(&d, &["cp", "-", &sb("/work")], Some(&raw_tar(b"piped.txt", b"piped\n")));
    assert!(out.status.success(), "{out:?}");
    assert_eq!(in_sb("cat /work/piped.txt"), "piped\n");

    // Refusals: an unsafe member on stdin (nothing extracted), a missing source, an unknown
    // sandbox, a missing parent, no sandbox side.
    let refused = |args: &[&str], stdin: Option<&[u8]>, needle: &str| {
        let out = docker(&d, args, stdin);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(125), "{args:?}: {out:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(err.contains("hint:"), "{args:?}: no hint in {err}");
    };
    refused(
        &["cp", "-", &sb("/work")],
        Some(&raw_tar(b"../../evil.txt", b"x")),
        "unsafe member \"../../evil.txt\"",
    );
    refused(&["cp", "-", &sb("/work")], Some(&raw_tar(b"/etc/evil.txt", b"x")), "absolute");
    assert!(
        docker(&d, &["exec", &name, "sh", "-c", "ls /evil.txt /etc/evil.txt"], None).status.code()
            != Some(0)
    );
    refused(&["cp", &sb("/nope"), &p(h)], None, "no such file or directory");
    refused(&["cp", &p(&h.join("nope")), &sb("/work")], None, "nope");
    refused(&["cp", &p(&proj), "no-such-sandbox-x:/work"], None, "no-such-sandbox-x");
    refused(&["cp", &p(&proj), &sb("/no/parent/here")], None, "does not exist");
    refused(&["cp", &p(&proj), &p(&h.join("x"))], None, "names a sandbox");

    // A hostile sandbox: its `tar` emits a member outside the copied name. The host refuses it
    // and writes nothing.
    let evil = raw_tar(b"../escaped.txt", b"pwned\n");
    let out = docker(&d, &["exec", "-i", &name, "sh", "-c", "cat > /evil.tar"], Some(&evil));
    assert!(out.status.success(), "{out:?}");
    in_sb("mv /usr/bin/tar /usr/bin/tar.real; printf '#!/bin/sh\\ncat /evil.tar\\n' > /usr/bin/tar; chmod +x /usr/bin/tar");
    let dest = h.join("hostile");
    std::fs::create_dir(&dest).unwrap();
    refused(&["cp", &sb("/work/a.txt"), &p(&dest)], None, "unsafe member");
    assert!(!h.join("escaped.txt").exists() && std::fs::read_dir(&dest).unwrap().next().is_none());
}

fn md5(data: &[u8]) -> String {
    let mut child =
        Command::new("md5sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}
