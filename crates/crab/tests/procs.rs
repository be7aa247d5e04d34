//! The background-process service end to end (root): `crab exec -d`, `crab ps`, `crab logs`,
//! `crab signal` and the API's stdin routes against the real daemon; a process survives a
//! SIGKILLed daemon (a daemon of its own), an in-place restore of a full checkpoint, and a fork;
//! supervisor files forged by the sandbox break neither the listing nor a follow; one sandbox
//! keeps at most `MAX_PROCS` processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use common::{crab, crab_ok, wait_until, OtherDaemon, Sandbox};

fn start(sb: &str, args: &[&str]) -> String {
    let mut a = vec!["exec", "-d", sb, "--"];
    a.extend_from_slice(args);
    let id = crab_ok(&a).trim().to_string();
    assert_eq!(id.len(), 16, "not an id: {id:?}");
    id
}

fn ps(sb: &str) -> Vec<serde_json::Value> {
    serde_json::from_str(&crab_ok(&["--json", "ps", sb])).unwrap()
}

fn proc_of(sb: &str, id: &str) -> serde_json::Value {
    ps(sb).into_iter().find(|p| p["id"] == id).unwrap_or_else(|| panic!("{id} not listed in {sb}"))
}

/// `crab logs` (with `-f` when `follow`): (stdout, stderr, exit code).
fn logs(sb: &str, id: &str, follow: bool) -> (String, String, i32) {
    let mut a = vec!["logs", sb, id];
    if follow {
        a.push("-f");
    }
    let o = crab(&a);
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        o.status.code().unwrap_or(-1),
    )
}

/// A script that prints `started`, waits for `/tmp/<flag>`, prints `stopped` and exits 5.
fn waiter(flag: &str) -> String {
    format!("echo started; while [ ! -e /tmp/{flag} ]; do sleep 0.05; done; echo stopped; exit 5")
}

#[test]
fn start_list_follow_with_replay_and_exit_status() {
    require_root!();
    let sb = Sandbox::new("t-procs");
    let id = start(
        &sb.name,
        &["sh", "-c", "echo one; echo err1 >&2; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo two; exit 7"],
    );
    assert!(wait_until(10.0, || logs(&sb.name, &id, false).0 == "one\n"));
    let p = proc_of(&sb.name, &id);
    assert_eq!(p["state"], "running", "{p}");
    assert_eq!(p["cmd"][0], "sh");
    assert!(p["pid"].as_u64().is_some(), "{p}");
    // Without -f: what it printed so far, and 0 (it runs).
    let (o, e, c) = logs(&sb.name, &id, false);
    assert_eq!((o.as_str(), e.as_str(), c), ("one\n", "err1\n", 0));
    sb.sh_ok("touch /tmp/go");
    // -f replays from the start, then follows to the end: the process's exit code.
    let (o, e, c) = logs(&sb.name, &id, true);
    assert_eq!((o.as_str(), e.as_str(), c), ("one\ntwo\n", "err1\n", 7));
    let p = proc_of(&sb.name, &id);
    assert_eq!((p["state"].as_str(), p["exit_code"].as_i64()), (Some("exited"), Some(7)), "{p}");
    // A follow from an offset replays only what comes after it (the API's offsets).
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client =
        crab_client::Client::new(crab_common::paths::StateDir::new(common::state_dir()).socket());
    let mut out = Vec::new();
    let mut exit = None;
    rt.block_on(client.proc_output(&sb.name, &id, (4, 0), true, |f| match f {
        crab_common::api::ExecFrame::Stdout { d } => {
            use base64::Engine;
            out.extend(base64::engine::general_purpose::STANDARD.decode(d).unwrap())
        }
        crab_common::api::ExecFrame::Exit { code, .. } => exit = Some(code),
        _ => {}
    }))
    .unwrap();
    assert_eq!((String::from_utf8_lossy(&out).as_ref(), exit), ("two\n", Some(7)));
    // JSON: the same, as a document.
    let o = crab(&["--json", "logs", &sb.name, &id]);
    assert_eq!(o.status.code(), Some(7));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["stdout"], "one\ntwo\n");
    assert_eq!(j["exit_code"], 7);
    // Unknown ids are refused clearly; env, cwd and user reach the command.
    let o = crab(&["logs", &sb.name, "0123456789abcdef"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no background process"), "{o:?}");
    sb.sh_ok("useradd -m procuser 2>/dev/null || true");
    let id2 = crab_ok(&[
        "exec",
        "-d",
        "-e",
        "GREETING=hi",
        "-w",
        "/tmp",
        "-u",
        "procuser",
        "--tag",
        "t1",
        &sb.name,
        "--",
        "sh",
        "-c",
        "echo $GREETING $(pwd) $(id -un)",
    ])
    .trim()
    .to_string();
    let (o, _, c) = logs(&sb.name, &id2, true);
    assert_eq!((o.as_str(), c), ("hi /tmp procuser\n", 0));
    assert_eq!(proc_of(&sb.name, &id2)["tag"], "t1");
    // E2B's selectors: by tag and by the supervisor's pid in the sandbox.
    assert_eq!(logs(&sb.name, "tag:t1", true).0, "hi /tmp procuser\n");
    let pid = proc_of(&sb.name, &id2)["pid"].as_u64().unwrap();
    assert_eq!(logs(&sb.name, &format!("pid:{pid}"), true).0, "hi /tmp procuser\n");
    let o = crab(&["exec", "-d", "-w", "/nonexistent", &sb.name, "--", "true"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("working directory"), "{o:?}");
    // argv and env past 64 KiB start (the meta reaches the launcher on its stdin, issue 28);
    // what the kernel refuses (one string past 128 KiB) is named in tests/limits.rs.
    let big = format!("BIG={}", "x".repeat(70_000));
    let id3 = crab_ok(&[
        "exec",
        "-d",
        "-e",
        &big,
        &sb.name,
        "--",
        "sh",
        "-c",
        "printf %s \"$BIG\" | wc -c",
    ]);
    let id3 = id3.trim();
    assert_eq!(logs(&sb.name, id3, true), ("70000\n".to_string(), String::new(), 0));
}

#[test]
fn stdin_then_close_stdin() {
    require_root!();
    let sb = Sandbox::new("t-procs-in");
    let id = crab_ok(&[
        "exec",
        "-d",
        "-i",
        &sb.name,
        "--",
        "sh",
        "-c",
        "read a; echo got:$a; cat; echo end",
    ])
    .trim()
    .to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client =
        crab_client::Client::new(crab_common::paths::StateDir::new(common::state_dir()).socket());
    rt.block_on(client.proc_stdin(&sb.name, &id, b"hello\n", false)).unwrap();
    assert!(wait_until(10.0, || logs(&sb.name, &id, false).0 == "got:hello\n"));
    rt.block_on(client.proc_stdin(&sb.name, &id, b"more\n", false)).unwrap();
    let p = rt.block_on(client.proc_close_stdin(&sb.name, &id)).unwrap();
    assert_eq!(p.id, id);
    let (o, _, c) = logs(&sb.name, &id, true);
    assert_eq!((o.as_str(), c), ("got:hello\nmore\nend\n", 0));
    // Closed (and ended): more input is refused with a reason.
    let e = rt.block_on(client.proc_stdin(&sb.name, &id, b"late", false)).unwrap_err();
    assert!(e.message.contains("no open stdin"), "{e:?}");
    // A process started without -i has none.
    let id2 = start(&sb.name, &["sleep", "100"]);
    let e = rt.block_on(client.proc_stdin(&sb.name, &id2, b"x", false)).unwrap_err();
    assert!(e.message.contains("no open stdin"), "{e:?}");
    crab_ok(&["signal", &sb.name, &id2, "--signal", "KILL"]);
}

#[test]
fn signals_reach_the_command() {
    require_root!();
    let sb = Sandbox::new("t-procs-sig");
    let id = start(
        &sb.name,
        &["sh", "-c", "trap 'echo termed; exit 3' TERM; echo ready; while :; do sleep 0.05; done"],
    );
    assert!(wait_until(10.0, || logs(&sb.name, &id, false).0 == "ready\n"));
    crab_ok(&["signal", &sb.name, &id]);
    let (o, _, c) = logs(&sb.name, &id, true);
    assert_eq!((o.as_str(), c), ("ready\ntermed\n", 3));
    let id = start(&sb.name, &["sleep", "1000"]);
    let pid = proc_of(&sb.name, &id)["pid"].as_u64().unwrap();
    crab_ok(&["signal", &sb.name, &format!("pid:{pid}"), "-s", "9"]);
    assert_eq!(logs(&sb.name, &id, true).2, 137);
    // An ended process is not signalled; a bad signal is refused.
    let o = crab(&["signal", &sb.name, &id]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not running"), "{o:?}");
    let id = start(&sb.name, &["sleep", "1000"]);
    let o = crab(&["signal", &sb.name, &id, "-s", "NOPE"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown signal"), "{o:?}");
    crab_ok(&["signal", &sb.name, &id, "-s", "KILL"]);
}

/// The daemon holds nothing about a process: SIGKILLed and started again, it lists the
/// process as running, replays its output and signals it.
#[test]
fn survives_a_daemon_restart() {
    require_root!();
    common::ensure_daemon();
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(image.is_dir(), "no debian image in the test daemon: run `crab image build debian`");
    let d = OtherDaemon::start(
        &std::path::PathBuf::from("/var/lib").join(common::unique("crab-procs-restart")),
        &["--pool-size", "4G"],
        &[],
    );
    d.crab_ok(&["image", "import", "debian", image.to_str().unwrap()]);
    let name = common::unique("t-procs-rs");
    d.crab_ok(&["sandbox", "create", "debian", "--name", &name]);
    let id = d.crab_ok(&["exec", "-d", &name, "--", "sh", "-c", &waiter("go")]).trim().to_string();
    assert!(wait_until(10.0, || d.crab_ok(&["logs", &name, &id]) == "started\n"));
    d.kill9();
    d.restart();
    let v = d.json(&["ps", &name]);
    let p = v.as_array().unwrap().iter().find(|p| p["id"] == id.as_str()).unwrap().clone();
    assert_eq!(p["state"], "running", "{v}");
    d.crab_ok(&["exec", &name, "--", "touch", "/tmp/go"]);
    let o = d.crab(&["logs", &name, &id, "-f"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "started\nstopped\n");
    assert_eq!(o.status.code(), Some(5));
    d.destroy();
}

/// A full checkpoint dumps the supervisor; an in-place restore and a fork bring the process
/// back under the same id: listed, followed (its earlier output replayed) and still running.
#[test]
fn comes_back_after_restore_and_in_a_fork() {
    require_root!();
    let sb = Sandbox::new("t-procs-ck");
    let id = start(&sb.name, &["sh", "-c", &waiter("go")]);
    assert!(wait_until(10.0, || logs(&sb.name, &id, false).0 == "started\n"));
    let pid = proc_of(&sb.name, &id)["pid"].clone();
    let p: serde_json::Value =
        serde_json::from_str(&crab_ok(&["--json", "checkpoint", &sb.name, "--kind", "full"]))
            .unwrap();
    let point = p["point"]["id"].as_str().unwrap().to_string();
    // The process ends after the checkpoint; the restore brings back the running one.
    sb.sh_ok("touch /tmp/go");
    assert_eq!(logs(&sb.name, &id, true).2, 5);
    crab_ok(&["restore", &sb.name, &point]);
    let p = proc_of(&sb.name, &id);
    assert_eq!((p["state"].as_str(), &p["pid"]), (Some("running"), &pid), "{p}");
    assert_eq!(logs(&sb.name, &id, false).0, "started\n");
    sb.sh_ok("touch /tmp/go");
    let (o, _, c) = logs(&sb.name, &id, true);
    assert_eq!((o.as_str(), c), ("started\nstopped\n", 5));
    // The branch of a fork has it too, running on its own.
    let out = crab_ok(&["--json", "fork", &sb.name, &point]);
    let branches: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let fork = Sandbox { name: branches[0]["sandbox"].as_str().unwrap().into() };
    let p = proc_of(&fork.name, &id);
    assert_eq!(p["state"], "running", "{p}");
    assert_eq!(proc_of(&sb.name, &id)["state"], "exited");
    fork.sh_ok("touch /tmp/go");
    let (o, _, c) = logs(&fork.name, &id, true);
    assert_eq!((o.as_str(), c), ("started\nstopped\n", 5));
}

/// A sandbox that forges supervisor files (garbage, huge, FIFOs, symlinks to host paths, a
/// directory full of junk) lies only about itself: listing answers, a follow of a forged
/// process ends, the real process is listed and followed as before, the daemon lives on.
#[test]
fn forged_supervisor_files_do_not_hurt_the_daemon() {
    require_root!();
    let sb = Sandbox::new("t-procs-forge");
    let id = start(&sb.name, &["sh", "-c", &waiter("go")]);
    assert!(wait_until(10.0, || logs(&sb.name, &id, false).0 == "started\n"));
    sb.sh_ok(
        "set -e; cd /run/crab-procs; \
         mkdir -p aaaaaaaaaaaaaaa1 aaaaaaaaaaaaaaa2 aaaaaaaaaaaaaaa3; \
         head -c 20000000 /dev/zero | tr '\\0' x > aaaaaaaaaaaaaaa1/meta.json; \
         echo notapid > aaaaaaaaaaaaaaa1/pid; echo 99999999999999999999999 > aaaaaaaaaaaaaaa1/exit; \
         mkfifo aaaaaaaaaaaaaaa1/out; mkfifo aaaaaaaaaaaaaaa1/err; \
         ln -s /etc/shadow aaaaaaaaaaaaaaa2/meta.json; ln -s /proc/1/environ aaaaaaaaaaaaaaa2/out; \
         echo 1 > aaaaaaaaaaaaaaa2/pid; ln -s /dev/zero aaaaaaaaaaaaaaa2/err; \
         printf '{\"cmd\":[\"\\u001b[31mred\"],\"tag\":\"x\"}' > aaaaaaaaaaaaaaa3/meta.json; \
         echo 42 > aaaaaaaaaaaaaaa3/exit; ln -s ../../../../etc/passwd aaaaaaaaaaaaaaa3/out; \
         mkfifo ../crab-procs/bbbbbbbbbbbbbbbb; \
         for i in $(seq 1 3000); do mkdir junk$i; done",
    );
    let v = ps(&sb.name);
    let real = v.iter().find(|p| p["id"] == id.as_str()).unwrap();
    assert_eq!(real["state"], "running", "{v:?}");
    assert!(v.len() <= 1 + 3, "{v:?}");
    // Ten well-formed metas of 2 MB each: one listing reads at most 16 MiB of them (64 of 2.5
    // MiB would be 160 MiB at once); the ones past that are listed without a command line.
    sb.sh_ok(
        "set -e; cd /run/crab-procs; rm -rf junk*; for i in 0 1 2 3 4 5 6 7 8 9; do \
         d=cccccccccccccc0$i; mkdir $d; { printf '{\"cmd\":[\"'; \
         head -c 2000000 /dev/zero | tr '\\000' y; \
         printf '\"],\"started_at\":1}'; } > $d/meta.json; echo 7 > $d/exit; done",
    );
    let v = ps(&sb.name);
    let forged: Vec<&serde_json::Value> =
        v.iter().filter(|p| p["id"].as_str().is_some_and(|i| i.starts_with("cccc"))).collect();
    assert_eq!(forged.len(), 10, "every forged process is listed");
    let cmd_len = |p: &serde_json::Value| {
        p["cmd"].as_array().map_or(0, |a| a.iter().map(|s| s.as_str().map_or(0, str::len)).sum())
    };
    let listed: usize = v.iter().map(cmd_len).sum();
    assert!(listed <= 16 << 20, "{listed} bytes of command lines in one listing");
    assert!(forged.iter().filter(|p| cmd_len(p) == 2_000_000).count() >= 7, "within the budget");
    assert!(forged.iter().any(|p| cmd_len(p) == 0), "past the budget: no command line");
    let f1 = v.iter().find(|p| p["id"] == "aaaaaaaaaaaaaaa1").unwrap();
    assert_eq!(f1["state"], "lost", "{f1}");
    // The table view escapes what the sandbox wrote.
    let table = crab_ok(&["ps", &sb.name]);
    assert!(!table.contains('\u{1b}'), "{table}");
    // Follows of the forged ones end (no FIFO blocks, no link leaves the root).
    let (o, _, _) = logs(&sb.name, "aaaaaaaaaaaaaaa1", true);
    assert!(o.is_empty(), "{o}");
    let (o, _, c) = logs(&sb.name, "aaaaaaaaaaaaaaa3", true);
    assert!(!o.contains("root:x:0:0"), "a link was followed on the host: {o}");
    assert_eq!(c, 42);
    let (o, _, _) = logs(&sb.name, "aaaaaaaaaaaaaaa2", true);
    assert!(!o.contains("PATH="), "a link was followed on the host: {o}");
    sb.sh_ok("touch /tmp/go");
    let (o, _, c) = logs(&sb.name, &id, true);
    assert_eq!((o.as_str(), c), ("started\nstopped\n", 5));
    assert!(common::daemon_up());
}

/// One sandbox keeps at most 64 processes: the next start is refused while they all run,
/// and an ended one makes room (it is removed).
#[test]
fn processes_per_sandbox_are_capped() {
    require_root!();
    let sb = Sandbox::new("t-procs-cap");
    let ids: Vec<String> = (0..64).map(|_| start(&sb.name, &["sleep", "1000"])).collect();
    let o = crab(&["exec", "-d", &sb.name, "--", "sleep", "1000"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("64 background processes"), "{err}");
    crab_ok(&["signal", &sb.name, &ids[0], "-s", "KILL"]);
    assert_eq!(logs(&sb.name, &ids[0], true).2, 137);
    let newer = start(&sb.name, &["true"]);
    let v = ps(&sb.name);
    assert_eq!(v.len(), 64);
    assert!(v.iter().all(|p| p["id"] != ids[0].as_str()), "the ended one was not removed");
    assert!(v.iter().any(|p| p["id"] == newer.as_str()));
}

/// A follow of a process whose sandbox stops under it ends, saying the process was lost; the
/// listing says `lost` too.
#[test]
fn a_follow_ends_when_its_sandbox_stops() {
    require_root!();
    let sb = Sandbox::new("t-procs-lost");
    let id = start(&sb.name, &["sleep", "1000"]);
    let mut f = std::process::Command::new(common::bin())
        .args(["--state-dir", common::state_dir().to_str().unwrap()])
        .args(["logs", "-f", &sb.name, &id])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    crab_ok(&["docker", "kill", &sb.name]);
    assert!(wait_until(30.0, || f.try_wait().unwrap().is_some()), "the follow did not end");
    let out = f.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("was lost"), "{out:?}");
    assert_eq!(proc_of(&sb.name, &id)["state"], "lost");
    // Nothing starts in, or is signalled in, a stopped sandbox (a conflict, not a failure).
    let o = crab(&["--json", "exec", "-d", &sb.name, "--", "true"]);
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(e["code"], "conflict", "{o:?}");
    let o = crab(&["signal", &sb.name, &id]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("lost"), "{o:?}");
}
