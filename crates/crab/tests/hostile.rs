//! The hostile-sandbox regression suite: a sandbox (or an image) is an attacker, and nothing it
//! does may make the daemon write host files, touch another daemon's sandboxes, or leave a
//! sandbox dead after a failed restore.
//!
//! Runs against the daemon on `$CRAB_STATE_DIR` (started if none answers, like the other
//! integration tests); the tests that need a second daemon start one on a fresh state directory
//! with a small pool, and stop it and unmount its pool when they end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{crab, crab_ok, unique, Sandbox};

/// Host files a hostile sandbox points its symlinks at; checked untouched at the end.
struct Canary {
    dir: PathBuf,
}

impl Canary {
    fn new() -> Canary {
        let dir = PathBuf::from("/var/tmp").join(unique("crab-canary"));
        std::fs::create_dir_all(dir.join("dir")).unwrap();
        std::fs::set_permissions(dir.join("dir"), std::fs::Permissions::from_mode(0o750)).unwrap();
        std::fs::write(dir.join("file"), "canary\n").unwrap();
        Canary { dir }
    }
    fn file(&self) -> String {
        self.dir.join("file").display().to_string()
    }
    fn subdir(&self) -> String {
        self.dir.join("dir").display().to_string()
    }
    fn assert_untouched(&self, when: &str) {
        assert_eq!(
            std::fs::read_to_string(self.dir.join("file")).unwrap(),
            "canary\n",
            "host file overwritten at {when}"
        );
        let mode = std::fs::metadata(self.dir.join("dir")).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o750, "host directory chmod-ed at {when}");
        let entries: Vec<_> = std::fs::read_dir(self.dir.join("dir")).unwrap().flatten().collect();
        assert!(entries.is_empty(), "host directory written at {when}: {entries:?}");
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Inside the sandbox: point the names the daemon writes at the canary on the host.
fn plant_links(sb: &Sandbox, c: &Canary) {
    sb.sh_ok(&format!(
        "ln -sfn {f} /etc/hostname && ln -sfn {f} /etc/machine-id && rm -rf /tmp && ln -s {d} /tmp \
         && rm -rf /.crab && ln -s {d} /.crab",
        f = c.file(),
        d = c.subdir()
    ));
}

#[test]
fn sandbox_made_symlinks_never_reach_the_host_at_fork_or_restore() {
    let c = Canary::new();
    let sb = Sandbox::new("t-hostile-links");
    plant_links(&sb, &c);
    crab_ok(&["checkpoint", &sb.name, "--kind", "fs"]);
    c.assert_untouched("checkpoint");
    let branch = unique("t-hostile-branch");
    crab_ok(&["fork", &sb.name, "--names", &branch]);
    let branch_sb = Sandbox { name: branch.clone() };
    c.assert_untouched("fork");
    // The branch got its own files instead of writes through the links.
    assert_eq!(branch_sb.sh_ok("cat /etc/hostname").trim(), branch);
    assert!(branch_sb.sh_ok("test -f /.crab/init && echo ok").contains("ok"));
    crab_ok(&["restore", &sb.name]);
    c.assert_untouched("restore");
    assert!(sb.sh_ok("test -f /.crab/init && echo ok").contains("ok"));
}

#[test]
fn image_made_symlinks_never_reach_the_host_at_create() {
    let c = Canary::new();
    let src = PathBuf::from("/var/tmp").join(unique("crab-hostile-image"));
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::os::unix::fs::symlink(c.file(), src.join("etc/hostname")).unwrap();
    std::os::unix::fs::symlink(c.file(), src.join("etc/machine-id")).unwrap();
    std::os::unix::fs::symlink(c.subdir(), src.join("tmp")).unwrap();
    std::os::unix::fs::symlink(c.subdir(), src.join(".crab")).unwrap();
    std::os::unix::fs::symlink(c.subdir(), src.join("proc")).unwrap();
    let image = unique("t-hostile-img");
    common::ensure_daemon();
    crab_ok(&["image", "import", &image, src.to_str().unwrap()]);
    c.assert_untouched("image import");
    let name = unique("t-hostile-imgsb");
    let out = crab(&["sandbox", "create", &image, "--name", &name]);
    let _sb = Sandbox { name: name.clone() };
    assert!(out.status.success(), "create failed: {}", String::from_utf8_lossy(&out.stderr));
    c.assert_untouched("create");
    drop(_sb);
    let _ = crab(&["image", "rm", &image]);
    let _ = std::fs::remove_dir_all(&src);
}

/// A second daemon on its own state directory and a small pool, stopped on drop.
struct OtherDaemon {
    state: PathBuf,
}

impl OtherDaemon {
    fn start(pool_size: &str) -> OtherDaemon {
        let state = PathBuf::from("/var/lib").join(unique("crab-hostile"));
        std::fs::create_dir_all(state.join("logs")).unwrap();
        let log = std::fs::File::create(state.join("logs/daemon.log")).unwrap();
        // A port of its own (tests run in parallel; 0 is refused by the proxy's loopback check).
        let port = 20000 + u32::from_str_radix(&unique("p")[2..], 16).unwrap() % 20000;
        let status = Command::new("setsid")
            .arg("-f")
            .arg(common::bin())
            .args(["daemon", "--state-dir", state.to_str().unwrap(), "--pool-size", pool_size])
            .args(["--proxy-listen", &format!("127.0.0.1:{port}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .status()
            .unwrap();
        assert!(status.success());
        let d = OtherDaemon { state };
        let start = Instant::now();
        while !d.crab(&["version"]).status.success() {
            assert!(start.elapsed() < Duration::from_secs(30), "second daemon did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    fn crab(&self, args: &[&str]) -> Output {
        Command::new(common::bin())
            .args(["--state-dir", self.state.to_str().unwrap()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn crab_ok(&self, args: &[&str]) -> String {
        let o = self.crab(args);
        assert!(
            o.status.success(),
            "crab {args:?} on {} failed: {}",
            self.state.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// An image with nothing but the init the daemon installs.
    fn empty_image(&self) -> String {
        let src = self.state.join("empty-root");
        std::fs::create_dir_all(&src).unwrap();
        self.crab_ok(&["image", "import", "empty", src.to_str().unwrap()]);
        "empty".into()
    }

    fn info(&self, name: &str) -> serde_json::Value {
        serde_json::from_str(&self.crab_ok(&["sandbox", "inspect", name])).unwrap()
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
        if let Ok(pid) = std::fs::read_to_string(self.state.join("daemon.pid")) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
                let start = Instant::now();
                while Path::new(&format!("/proc/{pid}")).exists()
                    && start.elapsed() < Duration::from_secs(10)
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        let _ = Command::new("umount").arg(self.state.join("pool")).status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

#[test]
fn two_daemons_with_the_same_sandbox_name_never_touch_each_other() {
    let mine = Sandbox::new("t-hostile-twin");
    mine.sh_ok("sleep 1000 >/dev/null 2>&1 &");
    let other = OtherDaemon::start("512M");
    let image = other.empty_image();
    other.crab_ok(&["sandbox", "create", &image, "--name", &mine.name]);
    // Different cgroups for the same name.
    let a = mine.info()["cgroup_id"].as_u64().unwrap();
    let b = other.info(&mine.name)["cgroup_id"].as_u64().unwrap();
    assert_ne!(a, b, "both daemons put sandbox {} in one cgroup", mine.name);
    other.crab_ok(&["sandbox", "rm", "--force", &mine.name]);
    let info = mine.info();
    assert_eq!(info["state"], "running", "the other daemon's rm killed ours: {info}");
    assert!(info["processes"].as_u64().unwrap() >= 2, "{info}");
    assert_eq!(mine.sh_ok("echo alive").trim(), "alive");
}

#[test]
fn restore_with_a_full_pool_leaves_the_sandbox_running() {
    let other = OtherDaemon::start("512M");
    let image = other.empty_image();
    let name = unique("t-hostile-full");
    other.crab_ok(&["sandbox", "create", &image, "--name", &name]);
    other.crab_ok(&["checkpoint", &name, "--kind", "fs"]);
    let before = other.info(&name);
    // Fill the pool from the host side until it refuses.
    let filler = other.state.join("pool/tmp/filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "status=none"])
        .stderr(Stdio::null())
        .arg(format!("of={}", filler.display()))
        .status();
    let out = other.crab(&["--json", "restore", &name]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "restore into a full pool succeeded?");
    assert!(err.contains("free") || err.contains("full"), "error does not say why: {err}");
    // The runtime's code survives the checkpointer and the host: `pool_full`, not `internal`.
    let json = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(json.contains("\"pool_full\""), "a full pool is not reported as pool_full: {json}");
    let after = other.info(&name);
    assert_eq!(after["state"], "running", "restore left the sandbox dead: {after}");
    assert_eq!(after["init_pid"], before["init_pid"], "the sandbox's processes were stopped");
    let _ = std::fs::remove_file(&filler);
    // With room again, the same restore works.
    other.crab_ok(&["restore", &name]);
    assert_eq!(other.info(&name)["state"], "running");
}

#[test]
fn limits_and_timeouts_out_of_range_are_refused_naming_the_field() {
    common::ensure_daemon();
    for (flag, value, field) in [
        ("--memory", "1", "memory_bytes"),
        ("--pids", "0", "pids_max"),
        ("--cpus", "0", "cpu_millis"),
    ] {
        let name = unique("t-hostile-limit");
        let o = crab(&["sandbox", "create", "debian", "--name", &name, flag, value]);
        let _cleanup = Sandbox { name: name.clone() };
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flag} {value} was accepted");
        assert!(err.contains(field) && err.contains("allowed"), "{flag} {value}: {err}");
        assert!(!err.contains("internal"), "{flag} {value} is an internal error: {err}");
    }
    let sb = Sandbox::new("t-hostile-timeout");
    let o = crab(&["exec", "--timeout=-1", &sb.name, "--", "true"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a negative timeout ran the command");
    assert!(err.contains("timeout"), "{err}");
}

#[test]
fn init_death_shows_at_once() {
    let sb = Sandbox::new("t-hostile-initdeath");
    let pid = sb.info()["init_pid"].as_u64().unwrap();
    Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    // No grace period: the next look says dead.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(sb.info()["state"], "dead");
}

#[test]
fn a_mount_criu_refuses_still_publishes_the_filesystem() {
    let sb = Sandbox::new("t-hostile-bpffs");
    // A sandbox that mounts bpffs (CRIU refuses to dump it) and writes a file.
    let (_, err, code) = sb.sh("mkdir -p /mnt/bpf && mount -t bpf bpf /mnt/bpf");
    if code != 0 {
        // Isolation refuses the mount: the hostile state cannot arise. Say so and stop.
        assert!(err.contains("ermission") || err.contains("not permitted"), "{err}");
        return;
    }
    sb.sh_ok("echo kept > /root/file");
    let out = crab_ok(&["--json", "checkpoint", &sb.name, "--kind", "full"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["point"]["kind"], "fs", "{v}");
    let why = v["point"]["procs_missing"].as_str().unwrap_or("");
    assert!(why.contains("CRIU"), "no reason for the missing processes: {v}");
    sb.sh_ok("rm /root/file");
    crab_ok(&["restore", &sb.name]);
    assert_eq!(sb.sh_ok("cat /root/file").trim(), "kept");
}
