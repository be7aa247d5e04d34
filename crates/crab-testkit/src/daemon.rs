//! The real-daemon test harness: run the real `crab` binary against the daemon of
//! `CRAB_STATE_DIR` (started here if none answers), and sandboxes that remove themselves when a
//! test ends, pass or fail. The binary is `$CRAB_BIN`, or the `crab` next to the test binary's
//! `deps/` directory (where cargo puts it for the package's own integration tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn state_dir() -> PathBuf {
    PathBuf::from(std::env::var("CRAB_STATE_DIR").unwrap_or_else(|_| "/var/lib/crab".into()))
}

/// The cgroup (relative to a hierarchy root) that holds the test daemon's sandboxes.
pub fn cgroup_parent() -> String {
    crab_common::paths::StateDir::new(state_dir()).cgroup_parent()
}

/// The `crab` binary under test.
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(b) = std::env::var_os("CRAB_BIN") {
            return b.to_string_lossy().into_owned();
        }
        let exe = std::env::current_exe().expect("locating the test binary");
        let dir = exe.parent().expect("test binary has a directory");
        let dir = if dir.ends_with("deps") { dir.parent().unwrap_or(dir) } else { dir };
        let crab = dir.join("crab");
        assert!(
            crab.exists(),
            "no crab binary at {} (build it: cargo build -p crab, or set CRAB_BIN)",
            crab.display()
        );
        crab.to_string_lossy().into_owned()
    })
}

pub fn crab(args: &[&str]) -> Output {
    Command::new(bin())
        .args(["--state-dir", state_dir().to_str().unwrap()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run crab")
}

pub fn crab_ok(args: &[&str]) -> String {
    let out = crab(args);
    assert!(
        out.status.success(),
        "crab {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn daemon_up() -> bool {
    crab(&["version"]).status.success()
}

/// Start the daemon unless one answers; wait until it does.
pub fn ensure_daemon() {
    if daemon_up() {
        return;
    }
    start_daemon();
}

pub fn start_daemon() {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state_dir().join("logs/daemon.log"))
        .or_else(|_| std::fs::File::create("/tmp/crab-test-daemon.log"))
        .unwrap();
    let mut cmd = Command::new("setsid");
    cmd.arg("-f")
        .arg(bin())
        .args(["daemon", "--state-dir", state_dir().to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    assert!(cmd.status().expect("start daemon").success());
    let start = Instant::now();
    while !daemon_up() {
        assert!(start.elapsed() < Duration::from_secs(20), "daemon did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn unique(prefix: &str) -> String {
    let mut b = [0u8; 4];
    getrandom(&mut b);
    format!("{prefix}-{:08x}", u32::from_ne_bytes(b))
}

fn getrandom(b: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom").unwrap().read_exact(b).unwrap();
}

/// A sandbox created from the default image, removed (forcefully) on drop.
#[derive(Debug)]
pub struct Sandbox {
    pub name: String,
}

impl Sandbox {
    pub fn new(prefix: &str) -> Self {
        Self::with_args(prefix, &[])
    }

    pub fn with_args(prefix: &str, extra: &[&str]) -> Self {
        ensure_daemon();
        let name = unique(prefix);
        let mut args = vec!["sandbox", "create", "debian", "--name", &name];
        args.extend_from_slice(extra);
        crab_ok(&args);
        Sandbox { name }
    }

    /// `sh -c script` inside; returns (stdout, stderr, exit code).
    pub fn sh(&self, script: &str) -> (String, String, i32) {
        let out = crab(&["exec", &self.name, "--", "sh", "-c", script]);
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out.status.code().unwrap_or(-1),
        )
    }

    /// Like `sh`, asserting success and returning stdout.
    pub fn sh_ok(&self, script: &str) -> String {
        let (o, e, c) = self.sh(script);
        assert_eq!(c, 0, "{script:?} exited {c}: {o}{e}");
        o
    }

    pub fn info(&self) -> serde_json::Value {
        serde_json::from_str(&crab_ok(&["sandbox", "inspect", &self.name])).unwrap()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = crab(&["sandbox", "rm", "--force", &self.name]);
    }
}

/// Poll `f` until it returns true or `secs` pass.
pub fn wait_until(secs: f64, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs_f64(secs) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}
