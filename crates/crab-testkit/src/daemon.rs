//! The real-daemon test harness: run the real `crab` binary against the daemon of
//! `CRAB_STATE_DIR` (started here if none answers), and sandboxes that remove themselves when a
//! test ends, pass or fail. The binary is `$CRAB_BIN`, or the `crab` next to the test binary's
//! `deps/` directory (where cargo puts it for the package's own integration tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A Python HTTP server on 127.0.0.1:9000 whose every GET answers the next value of an
/// in-memory counter: a process whose state only a process checkpoint keeps.
pub const COUNTER_PY: &str = r#"
import http.server, socketserver
n = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global n
        n += 1
        self.send_response(200); self.end_headers(); self.wfile.write(str(n).encode())
    def log_message(self, *a): pass
socketserver.TCPServer(("127.0.0.1", 9000), H).serve_forever()
"#;

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

/// One call of the main test daemon's API over its socket (`curl --unix-socket`): the JSON it
/// answers, an error's body included (`{"code", "message", "hint"}`).
pub fn api(method: &str, path: &str, body: &str) -> serde_json::Value {
    let sock = state_dir().join("crab.sock");
    let mut c = Command::new("curl");
    c.args(["-s", "--unix-socket", sock.to_str().unwrap(), "-X", method]);
    if !body.is_empty() {
        c.args(["-H", "content-type: application/json", "--data-binary", body]);
    }
    let o = c.arg(format!("http://crab{path}")).output().unwrap();
    assert!(o.status.success(), "curl {method} {path}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// A second daemon ("another host") on its own state directory, pool and proxy port, for
/// tests that need a daemon of their own (hostile neighbours, cross-host restores, crashes).
/// It never reads the main test daemon's `CRAB_E2B_*` variables. On drop it removes its
/// sandboxes, stops, unmounts its pool and deletes its state directory.
#[derive(Debug)]
pub struct OtherDaemon {
    /// Its state directory.
    pub state: PathBuf,
    /// Its LLM proxy port.
    pub port: u16,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The `crab` binary it runs (and its CLI calls use).
    bin: PathBuf,
}

impl OtherDaemon {
    /// [`OtherDaemon::start`] with the `crab` binary at `bin` (e.g. a copy, with its
    /// `crab-nsexec` beside it) instead of the one under test.
    pub fn start_from(
        bin: &std::path::Path,
        state: &std::path::Path,
        args: &[&str],
        env: &[(String, String)],
    ) -> OtherDaemon {
        // A port of its own (tests run in parallel; 0 is refused by the proxy's loopback check).
        let port = 20000 + (u32::from_str_radix(&unique("p")[2..], 16).unwrap() % 20000) as u16;
        let d = OtherDaemon {
            state: state.to_path_buf(),
            port,
            args: args.iter().map(|s| s.to_string()).collect(),
            env: env.to_vec(),
            bin: bin.to_path_buf(),
        };
        d.launch();
        d
    }

    /// Start `crab daemon --state-dir STATE --proxy-listen 127.0.0.1:<free port> ARGS…` with
    /// `env` added, and wait until it answers.
    pub fn start(state: &std::path::Path, args: &[&str], env: &[(String, String)]) -> OtherDaemon {
        Self::start_from(std::path::Path::new(bin()), state, args, env)
    }

    fn launch(&self) {
        std::fs::create_dir_all(self.state.join("logs")).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.join("logs/daemon.log"))
            .unwrap();
        let status = Command::new("setsid")
            .arg("-f")
            .arg(&self.bin)
            .args(["daemon", "--state-dir", self.state.to_str().unwrap()])
            .args(["--proxy-listen", &format!("127.0.0.1:{}", self.port)])
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            // Only the main test daemon serves the E2B API (make test exports its address).
            .env_remove("CRAB_E2B_LISTEN")
            .env_remove("CRAB_E2B_KEYS")
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
                "daemon on {} did not come up (log {}/logs/daemon.log)",
                self.state.display(),
                self.state.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Run the CLI against this daemon.
    pub fn crab(&self, args: &[&str]) -> Output {
        Command::new(&self.bin)
            .args(["--state-dir", self.state.to_str().unwrap()])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Like [`OtherDaemon::crab`], asserting success and returning stdout.
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

    /// `crab --json ARGS…` parsed.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        serde_json::from_str(&self.crab_ok(&a)).unwrap()
    }

    /// Its pid, while it runs.
    pub fn pid(&self) -> Option<i32> {
        let pid = std::fs::read_to_string(self.state.join("daemon.pid")).ok()?;
        let pid: i32 = pid.trim().parse().ok()?;
        std::path::Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
    }

    fn wait_gone(&self, pid: i32) {
        let start = Instant::now();
        while std::path::Path::new(&format!("/proc/{pid}")).exists()
            && start.elapsed() < Duration::from_secs(20)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stop it (SIGTERM) and wait until it is gone; its sandboxes keep running.
    pub fn stop(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            self.wait_gone(pid);
        }
    }

    /// Kill it with SIGKILL (a crash: nothing runs on the way out).
    pub fn kill9(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            self.wait_gone(pid);
        }
    }

    /// Start it again with the same arguments (after [`OtherDaemon::stop`] or a crash).
    pub fn restart(&self) {
        self.launch();
    }

    /// Remove its sandboxes, stop it, unmount its pool and delete its state directory.
    pub fn destroy(&self) {
        if self.pid().is_some() {
            let names = self.crab(&["sandbox", "ls", "--json"]);
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&names.stdout) {
                for sb in v.as_array().into_iter().flatten() {
                    if let Some(n) = sb["name"].as_str() {
                        let _ = self.crab(&["sandbox", "rm", "--force", n]);
                    }
                }
            }
        }
        self.stop();
        // The daemon's mounts in its state dir: the pool and the empty read-only tmpfs that
        // masked paths are bound from (either may never have been mounted, or be gone already:
        // umount's complaint about that is not the caller's output).
        for m in ["pool", "masked"] {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.state.join(m))
                .stderr(std::process::Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

impl Drop for OtherDaemon {
    fn drop(&mut self) {
        if self.state.exists() {
            self.destroy();
        }
    }
}
