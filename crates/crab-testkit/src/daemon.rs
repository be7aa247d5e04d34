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

/// A second daemon on a state directory of its own (`/var/lib/<prefix>-<random>`), with its
/// own proxy port and `extra` arguments; it gets none of the `CRAB_E2B_*` variables (only the
/// main test daemon serves E2B from the environment: pass `--e2b-listen` in `extra`). It can
/// be stopped and started again on the same state; on drop its sandboxes are removed, the
/// daemon stopped and its state directory deleted.
#[derive(Debug)]
pub struct OtherDaemon {
    pub state: PathBuf,
    args: Vec<String>,
}

/// A free-looking loopback port in 20000..40000 (random; tests run in parallel).
pub fn random_port() -> u16 {
    let mut b = [0u8; 2];
    getrandom(&mut b);
    20000 + u16::from_ne_bytes(b) % 20000
}

impl OtherDaemon {
    /// Start one with a `pool_size` pool and `extra` daemon arguments.
    pub fn start(prefix: &str, pool_size: &str, extra: &[&str]) -> OtherDaemon {
        let state = PathBuf::from("/var/lib").join(unique(prefix));
        std::fs::create_dir_all(state.join("logs")).unwrap();
        let mut args: Vec<String> = vec!["--pool-size".into(), pool_size.into()];
        args.extend(["--proxy-listen".into(), format!("127.0.0.1:{}", random_port())]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let d = OtherDaemon { state, args };
        d.up();
        d
    }

    /// Start the daemon process (again) and wait until it answers.
    pub fn up(&self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.join("logs/daemon.log"))
            .unwrap();
        let status = Command::new("setsid")
            .arg("-f")
            .arg(bin())
            .args(["daemon", "--state-dir", self.state.to_str().unwrap()])
            .args(&self.args)
            .env_remove("CRAB_E2B_LISTEN")
            .env_remove("CRAB_E2B_KEYS")
            .env_remove("CRAB_PROXY_LISTEN")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .status()
            .unwrap();
        assert!(status.success());
        let start = Instant::now();
        while !self.crab(&["version"]).status.success() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the daemon on {} did not come up: {}",
                self.state.display(),
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stop the daemon (SIGTERM) and wait until its process is gone; sandboxes keep running.
    pub fn down(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.state.join("daemon.pid")) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
                let start = Instant::now();
                while std::path::Path::new(&format!("/proc/{pid}")).exists()
                    && start.elapsed() < Duration::from_secs(20)
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.state.join("logs/daemon.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub fn crab(&self, args: &[&str]) -> Output {
        Command::new(bin())
            .args(["--state-dir", self.state.to_str().unwrap()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    pub fn crab_ok(&self, args: &[&str]) -> String {
        let o = self.crab(args);
        assert!(
            o.status.success(),
            "crab {args:?} on {} failed: {}{}",
            self.state.display(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Import the main test daemon's `debian` image (`make test` builds it) as `debian`.
    pub fn import_debian(&self) {
        let src = crab_common::paths::StateDir::new(state_dir()).image_rootfs("debian");
        assert!(
            src.is_dir(),
            "no debian image in the test daemon's state dir ({}): run `crab image build debian`",
            src.display()
        );
        self.crab_ok(&["image", "import", "debian", src.to_str().unwrap()]);
    }
}

impl Drop for OtherDaemon {
    fn drop(&mut self) {
        let names = self.crab(&["sandbox", "ls", "--json"]);
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&names.stdout) {
            for sb in v.as_array().into_iter().flatten() {
                if let Some(n) = sb["name"].as_str() {
                    let _ = self.crab(&["sandbox", "rm", "--force", n]);
                }
            }
        }
        self.down();
        let _ = Command::new("umount").arg("-l").arg(self.state.join("pool")).status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}
