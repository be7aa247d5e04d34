//! Issue 28: root inside is nobody outside. Every sandbox (unless `--userns host`) runs in a
//! user namespace of the daemon's range; these tests check it from both sides, with the real
//! daemon, CRIU and kernel:
//!
//! * `root_inside_is_an_unprivileged_host_uid`: `id` says 0 inside while the host's
//!   `/proc/<pid>/status` says the range's base; image files keep their in-image owners (the
//!   shifted image) and set-id bits; files the sandbox writes are the range's on the host.
//! * `non_root_processes_checkpoint_restore_fork_and_pause`: a uid-1000 server with state only
//!   in memory comes back from a full point (restore in place), in a fork branch, and from a
//!   pause — on this host, whose root lacks `CAP_SYS_RESOURCE` — keeping its uid inside and
//!   its host uid outside, and the namespace's maps.
//! * `what_a_user_namespace_makes_newly_relevant_fails`: nested `unshare -U`, writing
//!   `uid_map`, a set-uid binary of the image, a set-uid file the sandbox's root makes, and
//!   files of ids outside the range — fresh, restored and forked.
//! * `userns_host_keeps_the_old_mode`: `--userns host` is uid 0 on the host too, its profile
//!   says so, and its non-root processes still get `host_capability_missing` here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use common::{crab, crab_ok, Sandbox};

const BASE: u32 = crab_common::api::IdRange::DEFAULT_BASE;

/// Real, effective, saved and filesystem uid of host pid `pid`.
fn host_uids(pid: u32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().skip(1).map(|x| x.parse().unwrap()).collect()
}

/// Host pids of the sandbox's processes whose command is `comm`.
fn host_pids_of(sb: &Sandbox, comm: &str) -> Vec<u32> {
    let init = init_pid(sb);
    // Every process of the sandbox is in the init's pid namespace; find them by NSpid there.
    let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        if std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok().as_ref() != Some(&ns) {
            continue;
        }
        let c = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if c.trim() == comm {
            out.push(pid);
        }
    }
    out
}

fn init_pid(sb: &Sandbox) -> u32 {
    sb.info()["init_pid"].as_u64().unwrap() as u32
}

#[test]
fn root_inside_is_an_unprivileged_host_uid() {
    require_root!();
    let sb = Sandbox::new("t-uns-id");
    assert_eq!(sb.sh_ok("id -u; id -g"), "0\n0\n");
    assert_eq!(host_uids(init_pid(&sb)), vec![BASE; 4]);
    assert_eq!(
        sb.sh_ok("cat /proc/self/uid_map /proc/self/gid_map")
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["0", &BASE.to_string(), "65536", "0", &BASE.to_string(), "65536"]
    );
    // The image as built: root's files are root's, the E2B user's home is 1000's, set-id bits
    // kept through the shift.
    assert_eq!(sb.sh_ok("stat -c '%u %g' /usr/bin/ls /etc/passwd"), "0 0\n0 0\n");
    assert_eq!(sb.sh_ok("stat -c '%u %g' /home/user"), "1000 1000\n");
    assert_eq!(sb.sh_ok("stat -c %a /usr/bin/su"), "4755\n");
    // Hard links (one inode, two names) are root's too, not shifted twice into `nobody`.
    assert_eq!(
        sb.sh_ok("stat -c '%h %u %g' /usr/bin/perl /usr/bin/gunzip"),
        "2 0 0\n2 0 0\n",
        "hard-linked files"
    );
    // What the sandbox writes is the range's on the host.
    sb.sh_ok("echo x > /root/made-inside && chown 1000:1000 /root/made-inside");
    let root = common::state_dir().join("pool/sandboxes").join(&sb.name).join("rootfs");
    let m = std::fs::metadata(root.join("root/made-inside")).unwrap();
    assert_eq!((m.uid(), m.gid()), (BASE + 1000, BASE + 1000));
    let m = std::fs::metadata(root.join("etc/hostname")).unwrap();
    assert_eq!((m.uid(), m.gid()), (BASE, BASE), "the daemon's own files belong to the range");
    // The profile says so.
    let prof = sb.info()["profile"].clone();
    assert!(prof.to_string().contains(&BASE.to_string()), "{prof}");
}

/// A counter server: state only in memory.
const COUNTER: &str = r#"
import http.server as h, itertools
c = itertools.count(1)
class H(h.BaseHTTPRequestHandler):
    def do_GET(s):
        b = str(next(c)).encode(); s.send_response(200); s.end_headers(); s.wfile.write(b)
    def log_message(s, *a): pass
h.HTTPServer(('127.0.0.1', 8003), H).serve_forever()
"#;

/// The counter server as uid 1000, started in `sb`; returns the command that reads it.
fn start_counter(sb: &Sandbox) -> &'static str {
    sb.sh_ok(&format!(
        "cat > /tmp/srv.py <<'EOF'{COUNTER}EOF\n\
         nohup setpriv --reuid=1000 --regid=1000 --init-groups python3 /tmp/srv.py >/dev/null 2>&1 &"
    ));
    "for i in $(seq 50); do curl -sf localhost:8003 && exit 0; sleep 0.1; done; exit 1"
}

fn assert_server_is_1000(sb: &Sandbox, when: &str) {
    assert_eq!(sb.sh_ok("ps -o uid= -C python3").trim(), "1000", "{when}");
    let pids = host_pids_of(sb, "python3");
    assert_eq!(pids.len(), 1, "{when}: {pids:?}");
    assert_eq!(host_uids(pids[0]), vec![BASE + 1000; 4], "{when}");
    assert_eq!(host_uids(init_pid(sb)), vec![BASE; 4], "{when}");
    assert!(sb.sh_ok("cat /proc/self/uid_map").contains(&BASE.to_string()), "{when}");
}

#[test]
fn non_root_processes_checkpoint_restore_fork_and_pause() {
    require_root!();
    let sb = Sandbox::new("t-uns-cr");
    let hit = start_counter(&sb);
    assert_eq!(sb.sh_ok(hit), "1");
    assert_server_is_1000(&sb, "fresh");
    let v: serde_json::Value =
        serde_json::from_str(&crab_ok(&["--json", "checkpoint", &sb.name, "--kind", "full"]))
            .unwrap();
    assert_eq!(v["point"]["kind"], "full", "{v}");
    let point = v["point"]["id"].as_str().unwrap().to_string();
    assert_eq!(sb.sh_ok(hit), "2");
    // Restore in place: the memory of the point (1 served).
    crab_ok(&["restore", &sb.name, &point]);
    assert_eq!(sb.sh_ok(hit), "2", "restored: the server's memory");
    assert_server_is_1000(&sb, "restored");
    // A fork branch of the point.
    let branch = Sandbox { name: common::unique("t-uns-cr-b") };
    crab_ok(&["fork", &sb.name, &point, "--count", "1", "--names", &branch.name]);
    assert_eq!(branch.sh_ok(hit), "2", "forked: the server's memory");
    assert_server_is_1000(&branch, "forked");
    // Pause and resume.
    assert_eq!(sb.sh_ok(hit), "3");
    crab_ok(&["sandbox", "pause", &sb.name]);
    assert_eq!(sb.info()["state"], "paused");
    crab_ok(&["sandbox", "resume", &sb.name]);
    assert_eq!(sb.sh_ok(hit), "4", "resumed: the server's memory");
    assert_server_is_1000(&sb, "resumed");
    // And a point taken after all that restores again.
    crab_ok(&["checkpoint", &sb.name, "--kind", "full"]);
    crab_ok(&["restore", &sb.name]);
    assert_eq!(sb.sh_ok(hit), "5");
}

/// Each probe exits 0 only when the attack worked.
const PROBES: &[(&str, &str)] = &[
    ("nested unshare -U", "unshare -U true"),
    ("nested unshare -Ur", "unshare -Ur id -u"),
    ("write own uid_map", "echo '0 0 1' > /proc/self/uid_map"),
    (
        "set-uid copy made by root",
        "cp /usr/bin/id /tmp/id-suid && chmod 4755 /tmp/id-suid && \
         [ \"$(setpriv --reuid=1000 --regid=1000 --clear-groups /tmp/id-suid -u)\" = 0 ]",
    ),
    ("chown to an unmapped id", "touch /tmp/u && chown 70000 /tmp/u"),
    ("chown a file of an unmapped id", "chown 0 /root/foreign"),
    ("write a file of an unmapped id", "echo x >> /root/foreign"),
];

fn run_probes(sb: &Sandbox, when: &str) {
    for (name, script) in PROBES {
        let (o, e, c) = sb.sh(script);
        assert_ne!(c, 0, "{when}: {name} worked: {o}{e}");
    }
    // A file owned by an id outside the range is the namespace's nobody inside.
    assert_eq!(sb.sh_ok("stat -c '%u %g' /root/foreign"), "65534 65534\n", "{when}");
}

#[test]
fn what_a_user_namespace_makes_newly_relevant_fails() {
    require_root!();
    let sb = Sandbox::new("t-uns-probe");
    // A file of host uid/gid 5 (outside the range), mode 0644, put there from the host.
    let root = common::state_dir().join("pool/sandboxes").join(&sb.name).join("rootfs");
    let f = root.join("root/foreign");
    std::fs::write(&f, "host's\n").unwrap();
    std::os::unix::fs::chown(&f, Some(5), Some(5)).unwrap();
    run_probes(&sb, "fresh");
    crab_ok(&["checkpoint", &sb.name, "--kind", "full"]);
    crab_ok(&["restore", &sb.name]);
    run_probes(&sb, "restored");
    let branch = Sandbox { name: common::unique("t-uns-probe-b") };
    crab_ok(&["fork", &sb.name, "--count", "1", "--names", &branch.name]);
    run_probes(&branch, "forked");
}

#[test]
fn userns_host_keeps_the_old_mode() {
    require_root!();
    let sb = Sandbox::with_args("t-uns-host", &["--userns", "host"]);
    assert_eq!(sb.sh_ok("id -u"), "0\n");
    assert_eq!(host_uids(init_pid(&sb)), vec![0; 4]);
    let prof = sb.info()["profile"].to_string();
    assert!(prof.contains("host"), "{prof}");
    // A bad mode is refused naming the choices.
    let o = crab(&["sandbox", "create", "debian", "--userns", "bogus"]);
    assert!(!o.status.success());
    // Its non-root processes need CAP_SYS_RESOURCE (which this host's root lacks).
    sb.sh_ok("nohup setpriv --reuid 1000 sleep 1000 >/dev/null 2>&1 &");
    assert!(common::wait_until(5.0, || sb.sh("pgrep -u 1000 -x sleep").2 == 0));
    let caps = std::fs::read_to_string("/proc/self/status").unwrap();
    let cap_eff = caps.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim().to_string();
    let has = u64::from_str_radix(&cap_eff, 16).unwrap() & (1 << 24) != 0;
    let o = crab(&["--json", "checkpoint", &sb.name, "--kind", "full"]);
    let out =
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if has {
        assert!(o.status.success(), "{out}");
    } else {
        assert!(out.contains("host_capability_missing") && out.contains("--userns"), "{out}");
    }
}
