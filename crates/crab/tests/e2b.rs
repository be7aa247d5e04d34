//! The E2B-compatible API driven by the real, unmodified `e2b` Python SDK (installed from PyPI
//! by scripts/install-test-servers.sh): `tests/e2b/sdk_flows.py` runs against the daemon's
//! `--e2b-listen` address (CRAB_E2B_LISTEN, with CRAB_E2B_KEYS holding the test key's digest —
//! `make test` sets both). Needs root and a daemon serving E2B: under
//! CRAB_REQUIRE_PRIVILEGED=1 it fails when it cannot run, otherwise it says why and passes.
//! `sdk_state_survives_a_daemon_restart` runs `tests/e2b/restart_flows.py` against a second
//! daemon of its own (its own state dir, proxy port and `--e2b-listen` port), which it restarts
//! between the script's two phases; the shared test daemon is never restarted.
//! `sdk_template_builds` runs `tests/e2b/template_flows.py` (E2B template builds) against a
//! daemon of its own too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::path::PathBuf;
use std::process::Command;

/// The key whose SHA-256 is in `tests/e2b/test-keys`.
const TEST_KEY: &str = "e2b_crab_test_key";

use crab_testkit::privilege::cannot_run;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv python with `e2b` importable (installing it if needed; fast when present).
fn sdk_python() -> Result<PathBuf, String> {
    let out = Command::new(repo().join("scripts/install-test-servers.sh"))
        .output()
        .map_err(|e| format!("running scripts/install-test-servers.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/install-test-servers.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let root =
        std::env::var("CRAB_TEST_SERVERS").unwrap_or_else(|_| "/opt/crab/test-servers".into());
    Ok(PathBuf::from(root).join("venv/bin/python"))
}

/// Run the SDK `script` with `args` against the E2B API at `url`; answers its stdout, failing
/// the test (with both outputs) when it fails.
fn run_sdk(
    python: &PathBuf,
    url: &str,
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> String {
    let script = repo().join("crates/crab/tests/e2b").join(script);
    // A hung SDK call must fail the test, not hang `make test`.
    let out = Command::new("timeout")
        .args(["--kill-after=10", "600"])
        .arg(python)
        .arg(&script)
        .args(args)
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", TEST_KEY)
        .envs(env.iter().copied())
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "the e2b SDK script {} {args:?} failed ({}):\n{stdout}\n{stderr}",
        script.display(),
        out.status
    );
    stdout
}

/// The effective capability mask (hex) of the daemon on `state`.
fn daemon_cap_eff(state: &std::path::Path) -> String {
    let pid = std::fs::read_to_string(state.join("daemon.pid")).expect("the daemon's pid file");
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid.trim())).unwrap();
    status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim().to_string()
}

fn run_flows(only: &str) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return cannot_run("needs root");
    }
    let Ok(listen) = std::env::var("CRAB_E2B_LISTEN") else {
        return cannot_run(
            "CRAB_E2B_LISTEN is not set (run the daemon with --e2b-listen ADDR --e2b-keys \
             crates/crab/tests/e2b/test-keys and export CRAB_E2B_LISTEN=ADDR; `make test` does)",
        );
    };
    common::ensure_daemon();
    let url = format!("http://{listen}");
    let health =
        Command::new("curl").args(["-sf", "-o", "/dev/null", &format!("{url}/health")]).status();
    if !health.map(|s| s.success()).unwrap_or(false) {
        return cannot_run(&format!(
            "no E2B API answers on {url}: the daemon must run with --e2b-listen {listen} \
             --e2b-keys crates/crab/tests/e2b/test-keys"
        ));
    }
    let python = match sdk_python() {
        Ok(p) => p,
        Err(e) => return cannot_run(&e),
    };
    let caps = daemon_cap_eff(&common::state_dir());
    let pid = std::fs::read_to_string(common::state_dir().join("daemon.pid")).unwrap_or_default();
    let stdout = run_sdk(
        &python,
        &url,
        "sdk_flows.py",
        &[],
        &[
            ("CRAB_E2B_ONLY", only),
            ("CRAB_DAEMON_CAPEFF", &caps),
            ("CRAB_BIN", common::bin()),
            ("CRAB_DAEMON_PID", pid.trim()),
        ],
    );
    for name in only.split(',') {
        assert!(stdout.contains(&format!("ok {name}")), "check {name} did not pass:\n{stdout}");
    }
}

#[test]
fn sdk_create_run_files_kill() {
    run_flows("create_run_files,background,async,stdin");
}

/// Issue 28's limits through the unmodified SDK: a 200 KiB environment, a 100 KiB command, a
/// 200 KB argument refused naming the kernel's limit, a 1 GiB upload streamed (sha256 read
/// back in the sandbox, the daemon's VmHWM bounded), a 5 GiB one refused naming the flag.
#[test]
fn sdk_large_bodies() {
    run_flows("large_bodies");
}

#[test]
fn sdk_snapshots_fork_pause() {
    run_flows("snapshots_fork,pause_connect");
}

#[test]
fn sdk_errors_and_timeout() {
    run_flows("errors,timeout");
}

/// envd processes and pauses: a refused pause (CRIU cannot dump the sandbox) leaves a
/// background command running with its stream flowing; a pause that works keeps it in the
/// pause point, and after connect it is listed, followed by pid and killed by pid.
#[test]
fn sdk_pause_keeps_background_commands() {
    run_flows("pause_keeps_commands");
}

/// A sandbox whose init is killed outside the E2B API: not running through the SDK (info,
/// list, is_running); commands, files and a running command's wait() raise at once;
/// connect brings it back from its newest restore point.
#[test]
fn sdk_dead_sandbox_is_not_running() {
    run_flows("dead_sandbox");
}

/// Issue 28: the default user's (uid 1000) background server, with state only in memory,
/// survives a snapshot, a pause and a fork through the unmodified SDK — on this host, whose
/// root lacks CAP_SYS_RESOURCE.
#[test]
fn sdk_default_user_processes_checkpoint() {
    run_flows("default_user");
}

#[test]
fn crab_api_names_the_missing_capability() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return cannot_run("needs root");
    }
    // Only a sandbox in the host's user namespace can hit it (issue 28).
    let sb = common::Sandbox::with_args("t-cap", &["--userns", "host"]);
    sb.sh_ok("nohup setpriv --reuid 1000 sleep 1000 >/dev/null 2>&1 &");
    assert!(common::wait_until(5.0, || sb.sh("pgrep -u 1000 -x sleep").2 == 0));
    let caps = u64::from_str_radix(&daemon_cap_eff(&common::state_dir()), 16).unwrap();
    let before = common::crab_ok(&["--json", "checkpoints", &sb.name]);
    let o = common::crab(&["checkpoint", &sb.name, "--kind", "full"]);
    let err = String::from_utf8_lossy(&o.stderr);
    if caps & (1 << 24) != 0 {
        assert!(o.status.success(), "with CAP_SYS_RESOURCE the dump must work: {err}");
        return;
    }
    assert!(!o.status.success());
    assert!(err.contains("CAP_SYS_RESOURCE") && err.contains("uid 1000"), "{err}");
    assert!(err.contains("--kind fs"), "the hint names no fix: {err}");
    // The JSON API's code, and nothing was touched: no point, the process still runs.
    let o = common::crab(&["--json", "checkpoint", &sb.name, "--kind", "full"]);
    let out =
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("host_capability_missing"), "{out}");
    assert_eq!(common::crab_ok(&["--json", "checkpoints", &sb.name]), before);
    assert_eq!(sb.sh("pgrep -u 1000 -x sleep >/dev/null && echo up").0, "up\n");
    assert_eq!(sb.info()["state"], "running");
}

/// Front-door state survives a restart of the daemon: tokens, metadata, envs, the absolute
/// timeout (the watchdog fires it after the restart), a pause (connect resumes it), and a
/// snapshot of a sandbox killed before the restart (docs/e2b.md). About 35 s.
#[test]
fn sdk_state_survives_a_daemon_restart() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return cannot_run("needs root");
    }
    let python = match sdk_python() {
        Ok(p) => p,
        Err(e) => return cannot_run(&e),
    };
    common::ensure_daemon();
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(
        image.is_dir(),
        "no debian image in the test daemon's state dir ({}): run `crab image build debian`",
        image.display()
    );
    let port = 20000 + (u32::from_str_radix(&common::unique("p")[2..], 16).unwrap() % 20000);
    let listen = format!("127.0.0.1:{port}");
    let keys = repo().join("crates/crab/tests/e2b/test-keys");
    let d = common::OtherDaemon::start(
        &PathBuf::from("/var/lib").join(common::unique("crab-e2b-restart")),
        &["--pool-size", "4G", "--e2b-listen", &listen, "--e2b-keys", keys.to_str().unwrap()],
        &[],
    );
    d.crab_ok(&["image", "import", "debian", image.to_str().unwrap()]);
    let url = format!("http://{listen}");
    let state = d.state.join("restart-flows.json");
    let st = state.to_str().unwrap();
    let out = run_sdk(&python, &url, "restart_flows.py", &["before", st], &[]);
    assert!(out.contains("ok before"), "{out}");
    // The killed source of a live snapshot is a stopped snapshot holder on the host.
    let made: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    let source = made["source"].as_str().unwrap();
    let ls = d.crab_ok(&["sandbox", "ls"]);
    let row = ls.lines().find(|l| l.starts_with(source)).unwrap_or_else(|| panic!("{ls}"));
    assert!(row.contains("retired"), "{ls}");
    let info = d.crab_ok(&["sandbox", "inspect", source]);
    assert!(info.contains("\"held\"") && info.contains("delete_snapshot"), "{info}");
    d.crab_ok(&["sandbox", "rm", "--force", made["doomed"].as_str().unwrap()]);
    d.stop();
    // While the daemon is down, one background command of the worker ends (exit 7): the
    // restarted front door must report it ended, not running.
    let root = crab_common::paths::StateDir::new(&d.state)
        .sandbox_rootfs(made["worker"].as_str().unwrap());
    std::fs::write(root.join("tmp/stop-now"), b"").unwrap();
    let ended = || {
        std::fs::read_dir(root.join("run/crab-procs"))
            .unwrap()
            .flatten()
            .any(|e| std::fs::read_to_string(e.path().join("exit")).is_ok_and(|c| c.trim() == "7"))
    };
    assert!(common::wait_until(10.0, ended), "the stopper did not end while the daemon was down");
    d.restart();
    let out = run_sdk(&python, &url, "restart_flows.py", &["after", st], &[]);
    assert!(out.contains("ok after"), "{out}");
    // The front door keeps no file per sandbox (only its token secret).
    let left = std::fs::read_dir(d.state.join("e2b/sandboxes")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "E2B state files left behind");
    // Everything the script made is gone from the host too.
    let ls: serde_json::Value =
        serde_json::from_str(&d.crab_ok(&["sandbox", "ls", "--json"])).unwrap();
    assert_eq!(ls.as_array().map(Vec::len), Some(0), "left behind: {ls}");
}

/// One life, two doors (issue 27): a sandbox paused through E2B is `paused` in `crab sandbox
/// ls`; one paused with `crab sandbox pause` comes back through the SDK's `connect()`; an E2B
/// timeout with auto-pause is fired by the host's watchdog like a `--timeout` of the CLI.
#[test]
fn sdk_and_cli_share_one_lifecycle() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return cannot_run("needs root");
    }
    let Ok(listen) = std::env::var("CRAB_E2B_LISTEN") else {
        return cannot_run("CRAB_E2B_LISTEN is not set (`make test` sets it)");
    };
    common::ensure_daemon();
    let python = match sdk_python() {
        Ok(p) => p,
        Err(e) => return cannot_run(&e),
    };
    let url = format!("http://{listen}");
    let state = |id: &str| -> String {
        let ls: serde_json::Value =
            serde_json::from_str(&common::crab_ok(&["--json", "sandbox", "ls"])).unwrap();
        ls.as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == id)
            .map(|s| s["state"].as_str().unwrap().to_string())
            .unwrap_or_else(|| "absent".into())
    };
    // Paused through E2B: one state, read by the CLI.
    let out = run_sdk(&python, &url, "cross_door.py", &["e2b-pause"], &[]);
    let id = out.lines().next().unwrap().trim().to_string();
    assert_eq!(state(&id), "paused");
    let info: serde_json::Value =
        serde_json::from_str(&common::crab_ok(&["sandbox", "inspect", &id])).unwrap();
    assert_eq!(info["labels"]["door"], "e2b", "{info}");
    // Resumed by the CLI, paused by it again, brought back by the SDK's connect.
    common::crab_ok(&["sandbox", "resume", &id]);
    common::crab_ok(&["sandbox", "pause", &id]);
    let out = run_sdk(&python, &url, "cross_door.py", &["connect", &id], &[]);
    assert!(out.starts_with("through-e2b\n"), "{out}");
    assert_eq!(state(&id), "running");
    common::crab_ok(&["sandbox", "rm", "-f", &id]);
    // Parked by the CLI (issue 31): an E2B command wakes it, its processes as they were.
    let out = run_sdk(&python, &url, "cross_door.py", &["park-run", common::bin()], &[]);
    let id = out.lines().next().unwrap().trim().to_string();
    assert!(out.contains("ok park-run"), "{out}");
    assert_eq!(state(&id), "running");
    common::crab_ok(&["sandbox", "rm", "-f", &id]);
    // An E2B timeout with auto-pause: the host's watchdog pauses it.
    let out = run_sdk(&python, &url, "cross_door.py", &["ttl"], &[]);
    let id = out.lines().next().unwrap().trim().to_string();
    let info: serde_json::Value =
        serde_json::from_str(&common::crab_ok(&["sandbox", "inspect", &id])).unwrap();
    assert_eq!(info["deadline"]["on"], "pause", "{info}");
    assert!(
        common::wait_until(15.0, || state(&id) == "paused"),
        "the E2B timeout did not pause it"
    );
    common::crab_ok(&["sandbox", "rm", "-f", &id]);
}

/// Issue 30's E2B template builds through the unmodified SDK, on a daemon of its own: a
/// `Template()` chain (RUN, COPY of an uploaded file and tree, ENV, WORKDIR, RUN as another
/// user) and a Dockerfile (`from_dockerfile`) build, stream their logs, end ready, and
/// `Sandbox.create(name)` shows every step's effect; a rebuild is cached; a failing RUN raises
/// the SDK's BuildException with its output in the logs and leaves no image; a start command
/// is refused naming it; hostile uploads (no token, over `--max-upload`, a tar climbing out with
/// `..`) are refused and write nothing; a build running when the daemon restarts answers `error` ("the daemon
/// restarted during the build") and leaves no image or build sandbox. About 60 s.
#[test]
fn sdk_template_builds() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return cannot_run("needs root");
    }
    let python = match sdk_python() {
        Ok(p) => p,
        Err(e) => return cannot_run(&e),
    };
    common::ensure_daemon();
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(
        image.is_dir(),
        "no debian image in the test daemon's state dir ({}): run `crab image build debian`",
        image.display()
    );
    let port = 20000 + (u32::from_str_radix(&common::unique("p")[2..], 16).unwrap() % 20000);
    let listen = format!("127.0.0.1:{port}");
    let keys = repo().join("crates/crab/tests/e2b/test-keys");
    let d = common::OtherDaemon::start(
        &PathBuf::from("/var/lib").join(common::unique("crab-e2b-tpl")),
        &[
            "--pool-size",
            "4G",
            "--e2b-listen",
            &listen,
            "--e2b-keys",
            keys.to_str().unwrap(),
            "--max-upload",
            "8M",
        ],
        &[],
    );
    d.crab_ok(&["image", "import", "debian", image.to_str().unwrap()]);
    let url = format!("http://{listen}");
    let max = (8u64 << 20).to_string();
    let out = run_sdk(&python, &url, "template_flows.py", &[], &[("CRAB_E2B_MAX_UPLOAD", &max)]);
    for check in ["chain", "dockerfile", "base", "async", "failing", "refused", "hostile"] {
        assert!(out.contains(&format!("ok {check}")), "check {check} did not pass:\n{out}");
    }
    // The templates are Crab images; the failed build made none.
    let images = d.crab_ok(&["image", "ls"]);
    assert!(["tpl-chain-", "tpl-df-", "tpl-base-"].iter().all(|t| images.contains(t)), "{images}");
    assert!(!images.contains("tpl-fail-") && !images.contains("tpl-start-"), "{images}");
    // A build the daemon's restart interrupts.
    let state = d.state.join("template-restart.json");
    let st = state.to_str().unwrap();
    let out = run_sdk(&python, &url, "template_flows.py", &["restart-before", st], &[]);
    assert!(out.contains("ok restart-before"), "{out}");
    d.stop();
    d.restart();
    let out = run_sdk(&python, &url, "template_flows.py", &["restart-after", st], &[]);
    assert!(out.contains("ok restart-after"), "{out}");
    let images = d.crab_ok(&["image", "ls"]);
    assert!(!images.contains("tpl-restart-"), "{images}");
    // The interrupted build's sandbox is gone (the builder's recovery at start).
    let ls: serde_json::Value =
        serde_json::from_str(&d.crab_ok(&["sandbox", "ls", "--json"])).unwrap();
    assert!(
        common::wait_until(10.0, || {
            let ls: serde_json::Value =
                serde_json::from_str(&d.crab_ok(&["sandbox", "ls", "--json"])).unwrap();
            ls.as_array().is_some_and(|a| a.is_empty())
        }),
        "left behind: {ls}"
    );
}
