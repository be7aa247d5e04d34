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
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{crab, crab_ok, unique, OtherDaemon, Sandbox};

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

/// A second daemon on its own state directory and a small pool, removed on drop.
fn other_daemon(pool_size: &str) -> OtherDaemon {
    let state = PathBuf::from("/var/lib").join(unique("crab-hostile"));
    OtherDaemon::start(&state, &["--pool-size", pool_size], &[])
}

/// An image with nothing but the init the daemon installs.
fn empty_image(d: &OtherDaemon) -> String {
    let src = d.state.join("empty-root");
    std::fs::create_dir_all(&src).unwrap();
    d.crab_ok(&["image", "import", "empty", src.to_str().unwrap()]);
    "empty".into()
}

fn info(d: &OtherDaemon, name: &str) -> serde_json::Value {
    serde_json::from_str(&d.crab_ok(&["sandbox", "inspect", name])).unwrap()
}

#[test]
fn two_daemons_with_the_same_sandbox_name_never_touch_each_other() {
    let mine = Sandbox::new("t-hostile-twin");
    mine.sh_ok("sleep 1000 >/dev/null 2>&1 &");
    let other = other_daemon("512M");
    let image = empty_image(&other);
    other.crab_ok(&["sandbox", "create", &image, "--name", &mine.name]);
    // Different cgroups for the same name.
    let a = mine.info()["cgroup_id"].as_u64().unwrap();
    let b = info(&other, &mine.name)["cgroup_id"].as_u64().unwrap();
    assert_ne!(a, b, "both daemons put sandbox {} in one cgroup", mine.name);
    other.crab_ok(&["sandbox", "rm", "--force", &mine.name]);
    let info = mine.info();
    assert_eq!(info["state"], "running", "the other daemon's rm killed ours: {info}");
    assert!(info["processes"].as_u64().unwrap() >= 2, "{info}");
    assert_eq!(mine.sh_ok("echo alive").trim(), "alive");
}

#[test]
fn restore_with_a_full_pool_leaves_the_sandbox_running() {
    let other = other_daemon("512M");
    let image = empty_image(&other);
    let name = unique("t-hostile-full");
    other.crab_ok(&["sandbox", "create", &image, "--name", &name]);
    other.crab_ok(&["checkpoint", &name, "--kind", "fs"]);
    let before = info(&other, &name);
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
    let after = info(&other, &name);
    assert_eq!(after["state"], "running", "restore left the sandbox dead: {after}");
    assert_eq!(after["init_pid"], before["init_pid"], "the sandbox's processes were stopped");
    let _ = std::fs::remove_file(&filler);
    // With room again, the same restore works.
    other.crab_ok(&["restore", &name]);
    assert_eq!(info(&other, &name)["state"], "running");
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

/// Run inside a sandbox: open `N` connections to the in-sandbox proxy, send a partial request
/// head on the first `L` and a byte more on each every second (slow loris), hold them `H`
/// seconds, then report how the proxy treated them. Bounded: it stops by itself.
const FLOOD: &str = r#"
import json, socket, sys, time
n, loris, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
socks, failed = [], 0
for i in range(n):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", 7431))
        socks.append(s)
    except OSError:
        failed += 1
for s in socks[:loris]:
    try: s.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    except OSError: pass
open("/tmp/flooded", "w").write(str(len(socks)))
t0 = time.time()
while time.time() - t0 < hold:
    for s in socks[:loris]:
        try: s.send(b"x")
        except OSError: pass
    time.sleep(1)
refused = closed = still_open = 0
for s in socks:
    s.setblocking(False)
    try:
        d = s.recv(4096)
        if d.startswith(b"HTTP/1.1 503") and b'"code":"busy"' in d: refused += 1
        else: closed += 1
    except BlockingIOError: still_open += 1
    except OSError: closed += 1
print(json.dumps({"connected": len(socks), "connect_failed": failed, "refused": refused,
                  "closed": closed, "open": still_open}))
"#;

fn daemon_fds() -> usize {
    let pid = std::fs::read_to_string(common::state_dir().join("daemon.pid")).unwrap();
    std::fs::read_dir(format!("/proc/{}/fd", pid.trim())).unwrap().count()
}

/// `curl` inside a sandbox against its own proxy endpoint with a 40 MB body announced: the
/// answer is the JSON 413.
fn assert_proxy_413(sb: &Sandbox) {
    let t = Instant::now();
    let out = sb.sh_ok(
        "curl -s -m 5 -X POST -H 'content-type: application/json' -H 'content-length: 40000000' \
         -w '\\n%{http_code}' http://127.0.0.1:7431/v1/chat/completions",
    );
    let (body, code) = out.trim().rsplit_once('\n').unwrap();
    assert_eq!(code, "413", "{out}");
    let e: crab_common::ApiError = serde_json::from_str(body).unwrap();
    assert_eq!(e.code, crab_common::ErrorCode::TooLarge, "{body}");
    assert!(t.elapsed() < Duration::from_secs(2), "the proxy took {:?}", t.elapsed());
}

#[test]
fn a_connection_flood_from_inside_leaves_the_cli_and_other_sandboxes_answering() {
    let attacker = Sandbox::new("t-hostile-flood");
    let other = Sandbox::new("t-hostile-bystander");
    let fds_before = daemon_fds();
    let name = attacker.name.clone();
    // 3000 connections, 300 of them slow-loris heads, held 13 s (past the 10 s header timeout).
    let flood = std::thread::spawn(move || {
        crab(&["exec", &name, "--", "python3", "-c", FLOOD, "3000", "300", "13"])
    });
    assert!(
        common::wait_until(60.0, || attacker.sh("test -f /tmp/flooded").2 == 0),
        "the flood never got going"
    );
    // While it holds: the daemon holds at most the per-sandbox cap of connections for it.
    let fds_during = daemon_fds();
    assert!(
        fds_during < fds_before + 256 + 64,
        "the daemon's descriptors grew from {fds_before} to {fds_during}: the flood is not capped"
    );
    // The CLI, another sandbox's exec and another sandbox's proxy answer at once.
    for _ in 0..3 {
        let t = Instant::now();
        assert_eq!(other.sh_ok("echo up").trim(), "up");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "exec took {:?} during the flood",
            t.elapsed()
        );
    }
    crab_ok(&["sandbox", "ls"]);
    assert_proxy_413(&other);
    let out = flood.join().unwrap();
    assert!(out.status.success(), "flood: {}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let connected = r["connected"].as_u64().unwrap();
    assert!(connected >= 2900, "the flood could not even connect: {r}");
    // Past the cap, connections were refused with the JSON 503 (most of them: while the
    // daemon works through its accept queue, the first admitted ones may already have been cut
    // off, freeing places); the admitted ones (idle or slow-loris) were cut off by the header
    // timeout: none is still open.
    assert!(r["refused"].as_u64().unwrap() >= connected / 2, "{r}");
    assert_eq!(r["open"], 0, "connections outlived the header timeout: {r}");
    // And the attacker's own endpoint works again.
    assert_proxy_413(&attacker);
}

/// Fill `/root/fill` with up to 200 MiB; returns dd's output and exit code.
fn fill(sb: &Sandbox) -> (String, i32) {
    let (out, err, code) =
        sb.sh("dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; rc=$?; sync; exit $rc");
    (format!("{out}{err}"), code)
}

#[test]
fn a_sandbox_at_its_disk_quota_gets_edquot_and_its_checkpoints_restores_and_forks_keep_the_quota() {
    const DISK: u64 = 96 << 20;
    let full = Sandbox::with_args("t-hostile-quota", &["--disk", "96M"]);
    let other = Sandbox::new("t-hostile-quota-other");
    assert_eq!(full.info()["disk_limit_bytes"], DISK, "{}", full.info());
    let ls = crab_ok(&["sandbox", "ls"]);
    assert!(ls.lines().any(|l| l.contains(&full.name) && l.contains("96.0 MiB")), "{ls}");
    full.sh_ok("echo keep > /root/keep");
    crab_ok(&["checkpoint", &full.name, "--kind", "full"]);
    // Filling the quota: ENOSPC/EDQUOT inside, the sandbox keeps running.
    let (out, code) = fill(&full);
    assert_ne!(code, 0, "200 MiB fit in a 96 MiB quota: {out}");
    assert!(out.contains("quota") || out.contains("space"), "{out}");
    let written: u64 = full.sh_ok("stat -c %s /root/fill").trim().parse().unwrap();
    assert!(written <= DISK, "{written} bytes written past the quota");
    assert_eq!(full.info()["state"], "running");
    let (_, err, code) = full.sh("echo more > /root/more");
    assert_ne!(code, 0, "a write past the quota succeeded");
    assert!(err.contains("quota") || err.contains("space"), "{err}");
    // Another sandbox writes past that size and checkpoints as usual.
    other.sh_ok("dd if=/dev/zero of=/root/x bs=1M count=150 status=none && sync");
    crab_ok(&["checkpoint", &other.name, "--kind", "fs"]);
    // The full sandbox itself still checkpoints, and a restore while full works and leaves it
    // running with the point's files.
    crab_ok(&["checkpoint", &full.name, "--kind", "full"]);
    crab_ok(&["restore", &full.name, "1"]);
    assert_eq!(full.info()["state"], "running");
    assert_eq!(full.sh_ok("cat /root/keep").trim(), "keep");
    full.sh_ok("test ! -e /root/fill");
    // The quota followed the sandbox onto its new root.
    assert_eq!(full.info()["disk_limit_bytes"], DISK);
    let (out, code) = fill(&full);
    assert_ne!(code, 0, "after restore the quota is gone: {out}");
    // And a fork branch has it too.
    let branch = unique("t-hostile-quota-branch");
    crab_ok(&["fork", &full.name, "1", "--names", &branch]);
    let branch = Sandbox { name: branch };
    assert_eq!(branch.info()["disk_limit_bytes"], DISK, "{}", branch.info());
    let (out, code) = fill(&branch);
    assert_ne!(code, 0, "the fork branch has no quota: {out}");
    assert_eq!(branch.info()["state"], "running");
}

#[test]
fn a_disk_quota_out_of_range_is_refused_naming_the_field() {
    common::ensure_daemon();
    let name = unique("t-hostile-disk");
    let o = crab(&["sandbox", "create", "debian", "--name", &name, "--disk", "1M"]);
    let _cleanup = Sandbox { name: name.clone() };
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "--disk 1M was accepted");
    assert!(err.contains("disk_bytes") && err.contains("allowed"), "{err}");
}

/// Delete cgroup id `id` from every inspector `cgmap` on this host (only the daemon that
/// attached it has the key), as a process with `bpf(2)` could.
fn delete_from_cgmaps(id: u64) -> usize {
    let out = Command::new("bpftool").args(["-j", "map", "show"]).output().unwrap();
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
    let maps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let key: Vec<String> = id.to_ne_bytes().iter().map(|b| format!("0x{b:02x}")).collect();
    let mut deleted = 0;
    for m in maps.as_array().unwrap() {
        if m["name"] != "cgmap" {
            continue;
        }
        let mid = m["id"].as_u64().unwrap().to_string();
        let o = Command::new("bpftool")
            .args(["map", "delete", "id", &mid, "key"])
            .args(&key)
            .stderr(Stdio::null())
            .output()
            .unwrap();
        if o.status.success() {
            deleted += 1;
        }
    }
    deleted
}

#[test]
fn a_tampered_inspector_map_makes_the_next_checkpoint_full() {
    let sb = Sandbox::new("t-hostile-tamper");
    crab_ok(&["checkpoint", &sb.name]);
    let id = sb.info()["cgroup_id"].as_u64().unwrap();
    assert_eq!(delete_from_cgmaps(id), 1, "the daemon's cgmap had no entry for {id}");
    // Unseen by the inspector now: a file and a server — settled before the checkpoint (a
    // background process still starting when the point is taken runs in the next turn, which
    // is then rightly not `fs`).
    sb.sh_ok(
        "echo secret > /root/after && (sleep 1000 >/dev/null 2>&1 &) && until pgrep -x sleep >/dev/null; do sleep 0.05; done && sleep 0.3",
    );
    let out = crab_ok(&["--json", "checkpoint", &sb.name]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["verdict"]["kind"], "full", "a tampered registration gave {v}");
    assert_eq!(v["point"]["kind"], "full", "{v}");
    let reasons = v["verdict"]["reasons"].to_string();
    assert!(reasons.contains("registration"), "no reason given: {v}");
    // Repaired: the next turn is tracked again (a file change is seen).
    sb.sh_ok("echo again > /root/again");
    let out = crab_ok(&["--json", "checkpoint", &sb.name]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["verdict"]["kind"], "fs", "tracking did not resume: {v}");
    // And what the tampered turn did is in its restore point.
    sb.sh_ok("rm /root/after /root/again");
    crab_ok(&["restore", &sb.name, "2"]);
    assert_eq!(sb.sh_ok("cat /root/after").trim(), "secret");
    assert!(sb.sh_ok("ps -eo args").contains("sleep 1000"), "the server was lost");
}
