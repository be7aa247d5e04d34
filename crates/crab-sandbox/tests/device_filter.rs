//! The cgroup-v2 device program alone (no cgroup-v1 `devices` controller involved): a shell
//! moved into a fresh cgroup2 group with the program attached cannot mknod or open a device
//! outside the allowlist, block devices included, and can use the allowed ones; the same
//! commands in a group without the program succeed, so the test can tell the difference.
//!
//! Needs root and a kernel with cgroup BPF (it fails, never skips, without them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use crab_sandbox::cgroup::Hierarchy;

/// A cgroup2 group of this test, removed on drop.
struct Group(PathBuf);

impl Group {
    fn new(tag: &str) -> Self {
        let h = Hierarchy::detect().expect("a cgroup2 hierarchy");
        let dir = h.v2.join(format!("crab-devtest-{tag}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        Group(dir)
    }

    /// Run `script` in `sh`, which first moves itself into this group: (exit code, output).
    fn sh(&self, script: &str) -> (i32, String) {
        let procs = self.0.join("cgroup.procs");
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("echo $$ > {} && {{ {script} ; }} 2>&1", procs.display()))
            .output()
            .unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Every shell has exited: the group is empty.
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// (case, script in a scratch directory `d`, allowed by the profile)
fn cases(d: &Path) -> Vec<(&'static str, String, bool)> {
    let d = d.display();
    vec![
        (
            "mknod+open kmsg (c 1:11)",
            format!("mknod {d}/kmsg c 1 11 && head -c0 < {d}/kmsg"),
            false,
        ),
        ("open the host's /dev/kmsg", "head -c0 < /dev/kmsg".into(), false),
        ("mknod loop0 (b 7:0)", format!("mknod {d}/loop b 7 0"), false),
        ("mknod mem (c 1:1)", format!("mknod {d}/mem c 1 1"), false),
        ("mknod+write null (c 1:3)", format!("mknod {d}/null c 1 3 && echo x > {d}/null"), true),
        ("read /dev/urandom", "head -c 4 /dev/urandom > /dev/null".into(), true),
        ("mknod pts (c 136:7)", format!("mknod {d}/pts7 c 136 7"), true),
    ]
}

#[test]
fn device_program_denies_what_the_profile_denies() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "needs root (CRAB_REQUIRE_PRIVILEGED)");
    let filtered = Group::new("bpf");
    crab_sandbox::devices::attach(&filtered.0).expect("attach the device program");
    // Attaching again replaces it (a restore reuses the group).
    crab_sandbox::devices::attach(&filtered.0).expect("re-attach the device program");
    let control = Group::new("none");
    let n = cases(Path::new("/")).len();
    for i in 0..n {
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (name, script, allowed) = cases(d1.path()).swap_remove(i);
        let (code, out) = filtered.sh(&script);
        if allowed {
            assert_eq!(code, 0, "{name}: refused under the program: {out}");
        } else {
            assert_ne!(code, 0, "{name}: allowed under the program: {out}");
            assert!(out.contains("Operation not permitted"), "{name}: {out}");
        }
        let (_, script, _) = cases(d2.path()).swap_remove(i);
        let (code, out) = control.sh(&script);
        assert_eq!(code, 0, "{name}: fails without the program too, so it proves nothing: {out}");
    }
}
