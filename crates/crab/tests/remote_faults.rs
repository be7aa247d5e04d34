//! Faults of the durable tier, against daemons of their own (root) with a `file://` remote:
//! the daemon killed with SIGKILL in the middle of an export, a remote that runs out of space
//! and then has room again, and a prune on another host racing an export. In each: no
//! published local point is lost, nothing half-written is listed as durable, exports retry
//! and resume by themselves, and `crab remote check` passes afterwards. And a sandbox made
//! again under a removed one's name: its points are its own, the first one's stay.
//!
//! The sandboxes use an image with nothing but the daemon's init, and their data is a file of
//! random bytes put into the sandbox's root from the host (there is no shell to write it
//! with), so an export is a few packs that `--remote-bandwidth` stretches to seconds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{unique, OtherDaemon};

/// Bytes of random data per sandbox: three 8 MiB packs, ~10 s at 2 MB/s.
const DATA: usize = 20 << 20;

fn host(tmp: &Path, tag: &str, remote: &str, extra: &[&str]) -> OtherDaemon {
    let mut args = vec!["--pool-size", "2G", "--remote", remote];
    args.extend_from_slice(extra);
    OtherDaemon::start(&tmp.join(tag), &args, &[])
}

/// A sandbox of the init-only image with `DATA` random bytes at `/data.bin`.
fn sandbox_with_data(d: &OtherDaemon) -> String {
    let src = d.state.join("empty-root");
    std::fs::create_dir_all(&src).unwrap();
    if !d.crab_ok(&["image", "ls"]).contains("empty") {
        d.crab_ok(&["image", "import", "empty", src.to_str().unwrap()]);
    }
    let name = unique("t-rfault");
    d.crab_ok(&["sandbox", "create", "empty", "--name", &name]);
    let root = crab_common::paths::StateDir::new(&d.state).sandbox_rootfs(&name);
    let mut f = std::fs::File::create(root.join("data.bin")).unwrap();
    let mut rng = std::fs::File::open("/dev/urandom").unwrap();
    let mut buf = vec![0u8; DATA];
    std::io::Read::read_exact(&mut rng, &mut buf).unwrap();
    f.write_all(&buf).unwrap();
    f.sync_all().unwrap();
    name
}

/// `(point id, remote state)` of every local point of `sb`.
fn states(d: &OtherDaemon, sb: &str) -> Vec<(String, String)> {
    let v = d.json(&["checkpoints", sb]);
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["id"].as_str().unwrap().to_string(),
                p["remote"]["state"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect()
}

fn state_of(d: &OtherDaemon, sb: &str, point: &str) -> String {
    states(d, sb).into_iter().find(|(p, _)| p == point).map(|(_, s)| s).unwrap_or_default()
}

/// Points the remote lists for `sb`.
fn remote_points(d: &OtherDaemon, sb: &str) -> Vec<String> {
    let v = d.json(&["remote", "ls", sb]);
    v.as_array().unwrap().iter().map(|r| r["point"].as_str().unwrap().to_string()).collect()
}

fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what} within {secs} s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn checkpoint(d: &OtherDaemon, sb: &str, kind: &str) -> String {
    d.json(&["checkpoint", sb, "--kind", kind])["point"]["id"].as_str().unwrap().to_string()
}

fn tmpdir() -> tempfile::TempDir {
    tempfile::tempdir_in("/var/tmp").unwrap()
}

#[test]
fn daemon_killed_mid_export_loses_no_point_and_the_export_resumes() {
    require_root!();
    let tmp = tmpdir();
    let remote = format!("file://{}", tmp.path().join("store").display());
    std::fs::create_dir_all(tmp.path().join("store")).unwrap();
    let d = host(tmp.path(), "host", &remote, &["--remote-bandwidth", "2M"]);
    let sb = sandbox_with_data(&d);
    let point = checkpoint(&d, &sb, "full");
    wait_for(20, "the export to start", || state_of(&d, &sb, &point) == "exporting");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(state_of(&d, &sb, &point), "exporting", "the export ended before the kill");
    d.kill9();

    d.restart();
    // The published local point is still there, and nothing half-written is durable.
    let after = states(&d, &sb);
    assert!(after.iter().any(|(p, _)| p == &point), "point {point} lost: {after:?}");
    assert_ne!(state_of(&d, &sb, &point), "durable", "a half export is listed as durable");
    assert!(!remote_points(&d, &sb).contains(&point), "the remote lists a half-written point");
    // The restarted exporter finishes it by itself.
    wait_for(90, "the export to resume and finish", || state_of(&d, &sb, &point) == "durable");
    assert_eq!(remote_points(&d, &sb), vec![point.clone()]);
    d.crab_ok(&["remote", "check"]);
    // The sandbox (its init) survived the crash, and its point still restores locally.
    d.crab_ok(&["restore", &sb]);
    assert_eq!(d.json(&["sandbox", "inspect", &sb])["state"], "running");
}

/// A tmpfs of `size` at `dir`, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs at {}", dir.display());
        Tmpfs(dir.to_path_buf())
    }

    fn resize(&self, size: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(st.success());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_remote_fails_exports_clearly_keeps_local_points_and_recovers_when_it_has_room() {
    require_root!();
    let tmp = tmpdir();
    let store = Tmpfs::mount(&tmp.path().join("store"), "4M");
    let remote = format!("file://{}", store.0.display());
    let d = host(tmp.path(), "host", &remote, &[]);
    let sb = sandbox_with_data(&d);
    let first = checkpoint(&d, &sb, "fs");
    wait_for(30, "the export to fail", || state_of(&d, &sb, &first) == "failed");
    let v = d.json(&["checkpoints", &sb]);
    let err = v.as_array().unwrap().iter().find(|p| p["id"] == first.as_str()).unwrap()["remote"]
        ["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        err.to_lowercase().contains("no space"),
        "the error does not say the remote is full: {err}"
    );
    assert!(remote_points(&d, &sb).is_empty(), "a failed export is listed in the remote");
    let local = states(&d, &sb).len();
    // --durable gives up with a clear error; the point stays local and restorable.
    let o = d.crab(&["checkpoint", &sb, "--kind", "fs", "--durable"]);
    assert!(!o.status.success(), "--durable succeeded on a full remote");
    let msg = String::from_utf8_lossy(&o.stderr);
    assert!(msg.contains("not durable") && msg.to_lowercase().contains("no space"), "{msg}");
    assert_eq!(states(&d, &sb).len(), local + 1, "a local point was lost");
    d.crab_ok(&["restore", &sb, &first]);
    // Room again: the retries (exponential backoff) make both points durable unprompted.
    store.resize("256M");
    wait_for(60, "the retried exports to finish", || {
        states(&d, &sb).iter().all(|(_, s)| s == "durable")
    });
    let mut want: Vec<String> = states(&d, &sb).into_iter().map(|(p, _)| p).collect();
    let mut got = remote_points(&d, &sb);
    want.sort();
    got.sort();
    assert_eq!(got, want, "the remote does not hold exactly the local points");
    d.crab_ok(&["remote", "check"]);
    drop(d);
}

#[test]
fn prune_on_another_host_during_an_export_never_breaks_it() {
    require_root!();
    let tmp = tmpdir();
    let remote = format!("file://{}", tmp.path().join("store").display());
    std::fs::create_dir_all(tmp.path().join("store")).unwrap();
    let a = host(tmp.path(), "host-a", &remote, &["--remote-bandwidth", "2M"]);
    let b = host(tmp.path(), "host-b", &remote, &[]);
    let sb = sandbox_with_data(&a);
    let point = checkpoint(&a, &sb, "full");
    wait_for(20, "the export to start", || state_of(&a, &sb, &point) == "exporting");
    // Host B prunes while host A uploads: refused for the lock, or done without touching
    // anything A's export needs.
    let o = b.crab(&["remote", "prune", "--keep-last", "1"]);
    if !o.status.success() {
        let msg = String::from_utf8_lossy(&o.stderr);
        assert!(msg.to_lowercase().contains("lock"), "prune failed for another reason: {msg}");
    }
    wait_for(90, "the export to finish", || state_of(&a, &sb, &point) == "durable");
    b.crab_ok(&["remote", "check"]);
    // The point is whole: host B builds a sandbox from it.
    let copy = unique("t-rfault-copy");
    b.crab_ok(&["sandbox", "create", "--from-remote", &format!("{sb}@{point}"), "--name", &copy]);
    let a_root = crab_common::paths::StateDir::new(&a.state).sandbox_rootfs(&sb);
    let b_root = crab_common::paths::StateDir::new(&b.state).sandbox_rootfs(&copy);
    assert!(
        std::fs::read(a_root.join("data.bin")).unwrap()
            == std::fs::read(b_root.join("data.bin")).unwrap(),
        "the copy's data differs"
    );
    // A prune once no exporter holds a lock (either host's exporter may still be uploading a
    // later point, e.g. the copy's first one) keeps the newest point and the store whole.
    let mut pruned = b.crab(&["remote", "prune", "--keep-last", "1"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    while !pruned.status.success()
        && String::from_utf8_lossy(&pruned.stderr).contains("is locked by")
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(500));
        pruned = b.crab(&["remote", "prune", "--keep-last", "1"]);
    }
    assert!(
        pruned.status.success(),
        "prune with no export running failed: {}",
        String::from_utf8_lossy(&pruned.stderr)
    );
    b.crab_ok(&["remote", "check"]);
}

#[test]
fn a_sandbox_made_again_under_a_name_never_takes_the_remote_points_of_the_first() {
    require_root!();
    let tmp = tmpdir();
    let remote = format!("file://{}", tmp.path().join("store").display());
    std::fs::create_dir_all(tmp.path().join("store")).unwrap();
    let d = host(tmp.path(), "host", &remote, &[]);
    let sb = sandbox_with_data(&d);
    let first = checkpoint(&d, &sb, "fs");
    wait_for(60, "the first sandbox's point to be durable", || {
        state_of(&d, &sb, &first) == "durable"
    });
    let record = |p: &str| -> serde_json::Value {
        let v = d.json(&["remote", "ls", &sb]);
        v.as_array().unwrap().iter().find(|r| r["point"] == p).cloned().unwrap_or_default()
    };
    let before = record(&first);
    d.crab_ok(&["sandbox", "rm", "--force", &sb]);
    // The same name again, in the same daemon's life and after a restart.
    d.crab_ok(&["sandbox", "create", "empty", "--name", &sb]);
    let second = checkpoint(&d, &sb, "fs");
    assert_ne!(second, first, "the new sandbox took the removed one's point id");
    wait_for(60, "the new sandbox's point to be durable", || {
        state_of(&d, &sb, &second) == "durable"
    });
    assert_eq!(record(&first)["created_at_ms"], before["created_at_ms"], "overwritten");
    assert_eq!(remote_points(&d, &sb), vec![first.clone(), second.clone()]);
    d.restart();
    let third = checkpoint(&d, &sb, "fs");
    assert!(![first.as_str(), second.as_str()].contains(&third.as_str()), "{third}");
    wait_for(60, "the third point to be durable", || state_of(&d, &sb, &third) == "durable");
    assert_eq!(record(&first)["created_at_ms"], before["created_at_ms"], "overwritten");
    d.crab_ok(&["remote", "check"]);
}
