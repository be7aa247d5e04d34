//! Concurrent checkpoint / restore / fork of real sandboxes (root, btrfs pool, CRIU 4.2.1),
//! the way a daemon runs them, while a second "process" works on the same state directory.
//!
//! Four sandboxes each run ten rounds of full, fs and process checkpoints, a rollback to the
//! round's full point and a fork of two branches from it, all at once through one
//! [`Checkpointer`] (as in the daemon). Meanwhile an interferer does what another process on
//! the same state directory does (a restarted daemon, a second tool, another test binary):
//! startup recovery of these sandboxes through a [`Checkpointer`] of its own (which would
//! discard staged parts it took for leftovers), and what opening a [`Runtime`] does (discard
//! the sandbox directories that have no record), restricted to this test's sandboxes. Every operation must succeed and every restored
//! sandbox must hold the files and processes of its point.
//!
//! Like `real_flows.rs`, it uses `CRAB_STATE_DIR` (default `/var/lib/crab`, with a `debian`
//! image) and the `crab` binary as namespace helper (`CRAB_BIN`, default `target/debug/crab`).
//! Its sandboxes are named `ckc-<pid>-...` and removed at the end; the interferer recovers only
//! those. Not run as root, it is skipped with a note on stderr.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crab_checkpoint::{CheckpointRequest, Checkpointer, Config};
use crab_common::api::{ExecRequest, NetMode, SandboxCreateRequest};
use crab_common::paths::StateDir;
use crab_common::{CheckpointKind, NoProgress};
use crab_sandbox::{Runtime, RuntimeConfig};

const SANDBOXES: usize = 4;
const ROUNDS: usize = 10;
const BRANCHES: usize = 2;

fn config() -> RuntimeConfig {
    let state = StateDir::new(
        std::env::var_os("CRAB_STATE_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(crab_common::paths::DEFAULT_STATE_DIR)),
    );
    let helper = std::env::var_os("CRAB_BIN").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/debug/crab"))
    });
    assert!(helper.exists(), "{} missing: build the workspace (make build)", helper.display());
    assert!(
        state.image_rootfs("debian").exists(),
        "no debian image in {}: run `make test` (it builds it)",
        state.root().display()
    );
    RuntimeConfig { state, pool_size: crab_sandbox::pool::DEFAULT_POOL_SIZE, helper_exe: helper }
}

/// `sh -c script` in sandbox `name`: (exit code, trimmed stdout).
fn sh(rt: &Runtime, name: &str, script: &str) -> (i32, String) {
    let req =
        ExecRequest { cmd: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() };
    let spec = match rt.exec_spec(name, &req) {
        Ok(s) => s,
        Err(e) => return (-1, format!("exec_spec: {e}")),
    };
    let out = Command::new(rt.helper_exe())
        .arg("__nsexec")
        .arg(serde_json::to_string(&spec).unwrap())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A counter process that bumps `/tmp/c` every 20 ms: alive iff the value moves.
const TICKER: &str = "setsid sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/c.t; mv /tmp/c.t /tmp/c; sleep 0.02; done' </dev/null >/dev/null 2>&1 &
    for i in $(seq 100); do [ -s /tmp/c ] && break; sleep 0.02; done";

/// The state a point must give back: `/root/round` and a running ticker.
fn check(rt: &Runtime, name: &str, round: &str) -> Result<(), String> {
    let (code, got) = sh(rt, name, "cat /root/round");
    if code != 0 || got != round {
        return Err(format!("{name}: /root/round is {got:?} (exit {code}), expected {round:?}"));
    }
    let read = |rt: &Runtime| sh(rt, name, "cat /tmp/c").1.parse::<u64>().unwrap_or(0);
    let before = read(rt);
    let start = Instant::now();
    while read(rt) <= before {
        if start.elapsed() > Duration::from_secs(5) {
            return Err(format!("{name}: the ticker does not run after the restore"));
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    Ok(())
}

fn req(kind: CheckpointKind) -> CheckpointRequest {
    CheckpointRequest { kind, turn: None, conversation_offset: None }
}

/// One sandbox's rounds; errors are collected rather than panicking in a thread.
fn rounds(rt: &Runtime, ck: &Checkpointer, name: &str, ops: &AtomicUsize) -> Result<(), String> {
    let e = |what: &'static str, r: usize| {
        move |err: crab_checkpoint::CheckpointError| format!("{name} round {r}: {what}: {err}")
    };
    for r in 0..ROUNDS {
        let mark = format!("r{r}");
        let (code, out) = sh(rt, name, &format!("echo {mark} > /root/round"));
        if code != 0 {
            return Err(format!("{name} round {r}: write failed: {out}"));
        }
        let full =
            ck.checkpoint(name, req(CheckpointKind::Full)).map_err(e("full checkpoint", r))?;
        sh(rt, name, "echo later > /root/round");
        ck.checkpoint(name, req(CheckpointKind::Fs)).map_err(e("fs checkpoint", r))?;
        ck.checkpoint(name, req(CheckpointKind::Process)).map_err(e("process checkpoint", r))?;
        ck.checkpoint(name, req(CheckpointKind::Skip)).map_err(e("skip checkpoint", r))?;
        ops.fetch_add(4, Ordering::Relaxed);

        ck.restore(name, Some(&full.id.to_string()), &NoProgress).map_err(e("restore", r))?;
        check(rt, name, &mark).map_err(|m| format!("round {r}, after the restore: {m}"))?;

        let names: Vec<String> = (0..BRANCHES).map(|b| format!("{name}-r{r}b{b}")).collect();
        let branches = ck
            .fork(name, Some(&full.id.to_string()), BRANCHES, Some(names.clone()), &NoProgress)
            .map_err(e("fork", r))?;
        let mut result = Ok(());
        for b in &branches {
            if let Err(m) = check(rt, &b.sandbox, &mark) {
                result = Err(format!("round {r}, fork branch: {m}"));
            }
        }
        for n in &names {
            let _ = rt.remove(n, true);
            let _ = ck.remove_all(n);
        }
        result?;
        if r % 3 == 2 {
            ck.prune(name, 3).map_err(e("prune", r))?;
        }
        ops.fetch_add(2, Ordering::Relaxed);
    }
    Ok(())
}

#[test]
fn concurrent_checkpoint_restore_fork_beside_another_process() {
    crab_testkit::require_root!();
    let cfg = config();
    let rt = Arc::new(Runtime::open(cfg.clone()).unwrap());
    let ck = Checkpointer::new(rt.clone(), Config::default());
    let prefix = format!("ckc-{}", std::process::id());
    let names: Vec<String> = (0..SANDBOXES).map(|i| format!("{prefix}-{i}")).collect();
    for n in &names {
        rt.create(&SandboxCreateRequest {
            name: Some(n.clone()),
            net: NetMode::Private,
            ..SandboxCreateRequest::new("debian")
        })
        .unwrap();
        let (code, out) = sh(&rt, n, TICKER);
        assert_eq!(code, 0, "{out}");
    }

    let stop = AtomicBool::new(false);
    let interfered = AtomicUsize::new(0);
    let discarded = AtomicUsize::new(0);
    let ops = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|s| {
        // The other process. Its startup recovery of our sandboxes runs through a
        // Checkpointer of its own (locks and stores of its own, as in another process), and
        // what its `Runtime::open` would do to our sandboxes is done here, restricted to them
        // (opening a real second runtime would also discard sandboxes other tests on this
        // state directory are creating): a sandbox directory without a record is a
        // half-created sandbox, whose cgroup, root and directory are discarded.
        s.spawn(|| {
            let ck2 = Checkpointer::new(rt.clone(), Config::default());
            let sandboxes = cfg.state.sandboxes();
            while !stop.load(Ordering::Relaxed) {
                for entry in std::fs::read_dir(&sandboxes).unwrap().flatten() {
                    let n = entry.file_name().to_string_lossy().into_owned();
                    if n.starts_with(&prefix) && !cfg.state.sandbox_record(&n).exists() {
                        discarded.fetch_add(1, Ordering::Relaxed);
                        let _ = rt.cgroup(&n).destroy();
                        let _ = crab_sandbox::btrfs::remove_tree(&cfg.state.sandbox_rootfs(&n));
                        let _ = std::fs::remove_dir_all(entry.path());
                    }
                }
                for n in rt.names().iter().filter(|n| n.starts_with(&prefix)) {
                    if let Err(e) = ck2.recover_sandbox(n) {
                        errors.lock().unwrap().push(format!("recovery of {n}: {e}"));
                    }
                }
                interfered.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let workers: Vec<_> = names
            .iter()
            .map(|n| {
                let (rt, ck, ops, errors) = (&rt, &ck, &ops, &errors);
                s.spawn(move || {
                    if let Err(m) = rounds(rt, ck, n, ops) {
                        errors.lock().unwrap().push(m);
                    }
                })
            })
            .collect();
        for w in workers {
            let _ = w.join();
        }
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!(
        "{} operations in {:.1} s beside {} recoveries ({} half-created sandboxes discarded)",
        ops.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
        interfered.load(Ordering::Relaxed),
        discarded.load(Ordering::Relaxed)
    );
    for n in &names {
        let _ = rt.remove(n, true);
        let _ = ck.remove_all(n);
    }
    // Nothing of ours may stay behind (a recovery must not recreate the store of a branch
    // being removed).
    let stores = cfg.state.pool().join("checkpoints");
    let left: Vec<String> = std::fs::read_dir(&stores)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    for n in &left {
        let _ = ck.remove_all(n);
    }
    let errors = errors.into_inner().unwrap();
    assert!(errors.is_empty(), "{} failures:\n{}", errors.len(), errors.join("\n"));
    assert!(interfered.load(Ordering::Relaxed) > 0);
    assert!(left.is_empty(), "restore points of removed sandboxes left behind: {left:?}");
}
