//! Cross-host restore through a real S3 server (root): SeaweedFS on loopback
//! (`scripts/s3-test-server.sh`), daemon A (its own state dir, pool, proxy port) exports a
//! full checkpoint (`crab checkpoint --durable`), is stopped and its state dir deleted; daemon
//! B (another state dir, pool, port) builds a sandbox from the remote point with
//! `crab sandbox create --from-remote` and finds the file and the running process again.
//! The image daemon A needs is imported from the test daemon's state dir (`make test` builds it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Host {
    state: PathBuf,
    env: Vec<(String, String)>,
}

impl Host {
    fn crab(&self, args: &[&str]) -> Output {
        Command::new(common::bin())
            .args(["--state-dir", self.state.to_str().unwrap()])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .expect("run crab")
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.crab(args);
        assert!(
            o.status.success(),
            "crab {args:?} on {}: {}{}",
            self.state.display(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    fn start(state: &Path, port: u16, remote: &str, env: &[(String, String)]) -> Host {
        std::fs::create_dir_all(state.join("logs")).unwrap();
        let log = std::fs::File::create(state.join("logs/daemon.log")).unwrap();
        let st = Command::new("setsid")
            .arg("-f")
            .arg(common::bin())
            .args(["daemon", "--state-dir", state.to_str().unwrap(), "--pool-size", "8G"])
            .args(["--proxy-listen", &format!("127.0.0.1:{port}"), "--remote", remote])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            // Only the main test daemon serves the E2B API (make test exports its address).
            .env_remove("CRAB_E2B_LISTEN")
            .env_remove("CRAB_E2B_KEYS")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .status()
            .unwrap();
        assert!(st.success());
        let h = Host { state: state.to_path_buf(), env: env.to_vec() };
        let t0 = Instant::now();
        while !h.crab(&["version"]).status.success() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "daemon on {} did not come up",
                state.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        h
    }

    fn stop(&self) {
        let pid = std::fs::read_to_string(self.state.join("daemon.pid")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<i32>() {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            let t0 = Instant::now();
            while self.crab(&["version"]).status.success() && t0.elapsed() < Duration::from_secs(20)
            {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Stop the daemon and delete everything of this "host".
    fn destroy(&self) {
        self.stop();
        let _ = Command::new("umount").arg("-l").arg(self.state.join("pool")).status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

#[test]
fn restore_on_a_second_host_from_s3_after_the_first_is_gone() {
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let base = 19000 + (std::process::id() % 400) as u16 * 2;
    let out =
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/s3-test-server.sh"))
            .arg(tmp.path().join("weed"))
            .arg(base.to_string())
            .output()
            .unwrap();
    assert!(out.status.success(), "S3 server: {}", String::from_utf8_lossy(&out.stderr));
    let mut env = Vec::new();
    let mut weed_pid = 0;
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let (k, v) = l.split_once('=').unwrap();
        if k == "WEED_PID" {
            weed_pid = v.parse().unwrap();
        } else {
            env.push((k.to_string(), v.to_string()));
        }
    }
    let remote = format!("s3://crab/xhost-{}", std::process::id());
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(
        image.is_dir(),
        "no debian image in the test daemon's state dir ({}): run `crab image build debian`",
        image.display()
    );

    let a = Host::start(&tmp.path().join("host-a"), base + 20, &remote, &env);
    a.ok(&["image", "import", "debian", image.to_str().unwrap()]);
    let name = common::unique("t-xhost");
    a.ok(&["sandbox", "create", "debian", "--name", &name]);
    a.ok(&[
        "exec",
        &name,
        "--",
        "sh",
        "-c",
        "echo from-host-a > /root/state.txt; nohup sleep 4242 >/dev/null 2>&1 &",
    ]);
    let taken: serde_json::Value = serde_json::from_str(&a.ok(&[
        "--json",
        "checkpoint",
        &name,
        "--kind",
        "full",
        "--durable",
    ]))
    .unwrap();
    assert!(taken["durable"]["uploaded_bytes"].as_u64().unwrap() > 1_000_000, "{taken}");
    let listed = a.ok(&["checkpoints", &name]);
    assert!(listed.contains("durable"), "{listed}");
    a.ok(&["sandbox", "rm", "--force", &name]);
    a.destroy();
    assert!(!a.state.exists());

    let b = Host::start(&tmp.path().join("host-b"), base + 22, &remote, &env);
    let ls = b.ok(&["remote", "ls"]);
    assert!(ls.contains(&name), "{ls}");
    let copy = common::unique("t-xcopy");
    b.ok(&["sandbox", "create", "--from-remote", &name, "--name", &copy]);
    let file = b.ok(&["exec", &copy, "--", "cat", "/root/state.txt"]);
    assert_eq!(file, "from-host-a\n");
    let ps = b.ok(&["exec", &copy, "--", "sh", "-c", "ps -eo args || ls /proc"]);
    assert!(ps.contains("sleep 4242"), "the process did not come back: {ps}");
    b.ok(&["remote", "check"]);
    let _ = b.crab(&["sandbox", "rm", "--force", &copy]);
    b.destroy();
    // The server this test started (its own process group).
    let _ = Command::new("kill").args(["-9", "--", &format!("-{weed_pid}")]).status();
    let _ = Command::new("kill").args(["-9", &weed_pid.to_string()]).status();
}
