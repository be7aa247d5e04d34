//! The E2B-compatible API driven by the real, unmodified `e2b` Python SDK (installed from PyPI
//! by scripts/install-test-servers.sh): `tests/e2b/sdk_flows.py` runs against the daemon's
//! `--e2b-listen` address (CRAB_E2B_LISTEN, with CRAB_E2B_KEYS holding the test key's digest —
//! `make test` sets both). Needs root and a daemon serving E2B: under
//! CRAB_REQUIRE_PRIVILEGED=1 it fails when it cannot run, otherwise it says why and passes.
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
    let script = repo().join("crates/crab/tests/e2b/sdk_flows.py");
    // A hung SDK call must fail the test, not hang `make test`.
    let out = Command::new("timeout")
        .args(["--kill-after=10", "600"])
        .arg(&python)
        .arg(&script)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", TEST_KEY)
        .env("CRAB_E2B_ONLY", only)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(out.status.success(), "the e2b SDK flows failed ({}):\n{stdout}\n{stderr}", out.status);
    for name in only.split(',') {
        assert!(stdout.contains(&format!("ok {name}")), "check {name} did not pass:\n{stdout}");
    }
}

#[test]
fn sdk_create_run_files_kill() {
    run_flows("create_run_files,background,async");
}

#[test]
fn sdk_snapshots_fork_pause() {
    run_flows("snapshots_fork,pause_connect");
}

#[test]
fn sdk_errors_and_timeout() {
    run_flows("errors,timeout");
}
