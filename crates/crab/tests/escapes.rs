//! The second red-team round (issue 33), one test per finding of the sandbox side: the exec
//! helper cannot be overwritten from inside (the runc CVE-2019-5736 pattern, against a copy
//! of the binaries), btrfs subvolumes cannot be made inside a sandbox, a leftover nested
//! subvolume neither keeps the daemon from starting nor a sandbox from being removed, a full
//! point taken after a restore restores, sandboxes have default limits, and a fork interrupted
//! by `kill -9` of the daemon leaves no dead branches. Each runs fresh, after a restore and in
//! a fork branch where the finding could differ there.
//!
//! Needs root, CRIU and a btrfs pool like every daemon test; the tests that need a daemon of
//! their own start one on a fresh state directory and remove it at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{crab, crab_ok, unique, OtherDaemon, Sandbox};

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().to_owned()
}

/// A copy of `crab` and `crab-nsexec` in a directory of their own, so an attack that wins
/// overwrites the copy, never the build under test.
fn copy_binaries(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let crab = PathBuf::from(common::bin());
    for name in ["crab", "crab-nsexec"] {
        let src = crab.with_file_name(name);
        assert!(src.exists(), "{} is missing: build with `cargo build -p crab`", src.display());
        std::fs::copy(&src, dir.join(name)).unwrap();
        std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    dir.join("crab")
}

/// An image holding only the attacker (static) and a `#!/proc/self/exe` script.
fn attack_image(d: &OtherDaemon) -> String {
    let src = d.state.join("attack-root");
    std::fs::create_dir_all(src.join("tmp")).unwrap();
    let c = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/escapes/overwrite_helper.c");
    let out = Command::new("gcc")
        .args(["-static", "-O2", "-o"])
        .arg(src.join("overwrite_helper"))
        .arg(&c)
        .output()
        .expect("gcc (install-deps installs gcc and libc6-dev)");
    assert!(out.status.success(), "gcc: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(src.join("x"), "#!/proc/self/exe\n").unwrap();
    std::fs::set_permissions(src.join("x"), std::fs::Permissions::from_mode(0o755)).unwrap();
    d.crab_ok(&["image", "import", "attack", src.to_str().unwrap()]);
    "attack".into()
}

/// Run the attacker in `sb` (detached, for 6 s) while the daemon runs its helper there 40 times
/// (a plain exec and the deterministic `#!/proc/self/exe` variant, alternately); returns the
/// attacker's report.
fn attack(d: &OtherDaemon, sb: &str) -> String {
    d.crab_ok(&["exec", sb, "--", "/overwrite_helper", "start", "6"]);
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..40 {
        if i % 2 == 0 {
            // Not asserted: once an attack has won, the helper is the attacker's payload.
            let _ = d.crab(&["exec", sb, "--", "/overwrite_helper", "noop"]);
        } else {
            // The helper itself runs inside (it prints its usage and exits 2, or, with a
            // sealed helper, the same from the memfd): only what it leaves behind matters.
            let _ = d.crab(&["exec", sb, "--", "/x"]);
        }
    }
    let out = d.crab(&["exec", sb, "--", "/overwrite_helper", "report"]);
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A directory removed when the test ends, pass or fail.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_exec_helper_cannot_be_overwritten_from_inside_fresh_restored_forked() {
    let base = PathBuf::from("/var/lib").join(unique("crab-esc-helper"));
    // Declared before the daemon, so it is dropped after it (the daemon stops first).
    let _remove = RemoveOnDrop(base.clone());
    let crab_bin = copy_binaries(&base.join("bin"));
    let before = (sha256(&base.join("bin/crab")), sha256(&base.join("bin/crab-nsexec")));
    let d = OtherDaemon::start_from(&crab_bin, &base.join("state"), &["--pool-size", "2G"], &[]);
    let image = attack_image(&d);
    let sb = unique("t-esc-helper");
    d.crab_ok(&["sandbox", "create", &image, "--name", &sb]);
    let check = |target: &str, when: &str| {
        let report = attack(&d, target);
        let after = (sha256(&base.join("bin/crab")), sha256(&base.join("bin/crab-nsexec")));
        assert_eq!(after, before, "{when}: the helper binaries on the host changed: {report}");
        assert!(
            !report.contains("WROTE") && !report.contains("TRUNCATED"),
            "{when}: a write through /proc/<pid>/exe landed: {report}"
        );
        assert!(report.contains("done:"), "{when}: the attacker did not run to its end: {report}");
        // The helper's inode is reachable only as the sealed memfd, never as the host file.
        assert!(
            !report.contains(base.to_str().unwrap()),
            "{when}: the host binary was reachable: {report}"
        );
    };
    check(&sb, "fresh");
    d.crab_ok(&["checkpoint", &sb, "--kind", "full"]);
    d.crab_ok(&["restore", &sb]);
    check(&sb, "restored");
    let branch = format!("{sb}-b");
    d.crab_ok(&["fork", &sb, "--count", "1", "--names", &branch]);
    check(&branch, "forked");
}

/// The btrfs requests a sandbox must not make, tried with Python's ctypes (raw `ioctl`, also
/// with bits set in the request's upper half, which the kernel ignores).
const SUBVOL_PROBE: &str = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fd = os.open("/tmp", os.O_RDONLY)
root = os.open("/", os.O_RDONLY)
results = []
for name, req, arg_fd in [("subvol_create", 0x5000940e, 0), ("snap_create", 0x50009401, root),
                          ("snap_create_v2", 0x50009417, root), ("subvol_create_v2", 0x50009418, 0),
                          ("high_bits", 0xdead00005000940e, 0)]:
    buf = ctypes.create_string_buffer(4096)
    ctypes.c_int64.from_buffer(buf, 0).value = arg_fd
    nm = ("nested-" + name).encode()
    off = 8 if req & 0xff in (0x01, 0x0e) else 56
    ctypes.memmove(ctypes.addressof(buf) + off, nm, len(nm))
    r = libc.syscall(16, fd, ctypes.c_ulong(req), buf)
    results.append(f"{name}={'ok' if r == 0 else os.strerror(ctypes.get_errno())}")
flags = ctypes.c_uint64(1)
r = libc.syscall(16, root, ctypes.c_ulong(0x4008941a), ctypes.byref(flags))
results.append(f"setflags_ro={'ok' if r == 0 else os.strerror(ctypes.get_errno())}")
print(";".join(results))
print("nested:", sorted(n for n in os.listdir("/tmp") if n.startswith("nested-")))
"#;

fn assert_no_subvolumes(sb: &Sandbox, when: &str) {
    sb.sh_ok(&format!("cat > /tmp/probe.py <<'EOF'\n{SUBVOL_PROBE}\nEOF"));
    let out = sb.sh_ok("python3 /tmp/probe.py");
    let first = out.lines().next().unwrap_or("");
    assert_eq!(first.split(';').count(), 6, "{when}: {out}");
    for part in first.split(';') {
        assert!(
            part.ends_with("=Operation not permitted"),
            "{when}: {part} was not refused: {out}"
        );
    }
    assert!(out.contains("nested: []"), "{when}: a nested subvolume exists: {out}");
    // The root is still writable (SUBVOL_SETFLAGS did not make it read-only).
    sb.sh_ok("touch /tmp/still-writable");
}

#[test]
fn sandboxes_cannot_make_btrfs_subvolumes_fresh_restored_forked() {
    let sb = Sandbox::new("t-esc-subvol");
    assert_no_subvolumes(&sb, "fresh");
    crab_ok(&["checkpoint", &sb.name, "--kind", "full"]);
    crab_ok(&["restore", &sb.name]);
    assert_no_subvolumes(&sb, "restored");
    let branch = Sandbox { name: format!("{}-b", sb.name) };
    crab_ok(&["fork", &sb.name, "--count", "1", "--names", &branch.name]);
    assert_no_subvolumes(&branch, "forked");
}

/// A daemon of its own on `state` with a pool of `pool_size` and an image `empty` holding
/// nothing but the init.
fn daemon_with_empty_image(state: &Path, pool_size: &str) -> OtherDaemon {
    let d = OtherDaemon::start(state, &["--pool-size", pool_size], &[]);
    let src = state.join("empty-root");
    std::fs::create_dir_all(&src).unwrap();
    d.crab_ok(&["image", "import", "empty", src.to_str().unwrap()]);
    d
}

/// A root holding a nested subvolume (made from the host, as a sandbox of an older daemon or
/// an image could hold one): the daemon starts although a replaced root with one inside is
/// left from a restore, deletes that root, and removes the sandbox.
#[test]
fn a_nested_subvolume_never_stops_the_daemon_or_a_removal() {
    let state = PathBuf::from("/var/lib").join(unique("crab-esc-nested"));
    let d = daemon_with_empty_image(&state, "1G");
    let name = unique("t-esc-nested");
    d.crab_ok(&["sandbox", "create", "empty", "--name", &name]);
    let dir = state.join("pool/sandboxes").join(&name);
    crab_sandbox::btrfs::create_subvolume(&dir.join("rootfs/nested")).unwrap();
    d.kill9();
    // What an interrupted restore leaves when the sandbox had made a subvolume.
    let old = dir.join("rootfs.old");
    crab_sandbox::btrfs::create_subvolume(&old).unwrap();
    std::fs::create_dir_all(old.join("a/b")).unwrap();
    crab_sandbox::btrfs::create_subvolume(&old.join("a/b/nested")).unwrap();
    crab_sandbox::btrfs::create_subvolume(&old.join("a/b/nested/deeper")).unwrap();
    std::os::unix::fs::symlink("/etc", old.join("a/etc-link")).unwrap();
    d.restart();
    assert!(d.crab(&["version"]).status.success(), "the daemon did not start");
    assert!(!old.exists(), "the replaced root with nested subvolumes is still there");
    assert!(Path::new("/etc/passwd").exists(), "the walk followed a symlink out");
    d.crab_ok(&["sandbox", "rm", "--force", &name]);
    assert!(!dir.exists(), "the removed sandbox's directory is still there");
}

/// Issue 33 #8: a restore puts the init in a new time namespace; commands exec'd afterwards
/// join it, so a full point of processes started after a restore restores again.
#[test]
fn full_points_taken_after_a_restore_restore() {
    let sb = Sandbox::new("t-esc-timens");
    sb.sh_ok("sleep 1000 >/dev/null 2>&1 &");
    crab_ok(&["checkpoint", &sb.name, "--kind", "full"]);
    crab_ok(&["restore", &sb.name]);
    sb.sh_ok("sleep 2000 >/dev/null 2>&1 &");
    let ns = sb.sh_ok("readlink /proc/1/ns/time /proc/self/ns/time");
    let ns: Vec<&str> = ns.lines().collect();
    assert_eq!(ns[0], ns[1], "an exec after a restore runs outside the init's time namespace");
    crab_ok(&["checkpoint", &sb.name, "--kind", "full"]);
    crab_ok(&["restore", &sb.name]);
    let ps = sb.sh_ok("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done");
    assert!(ps.contains("sleep 1000") && ps.contains("sleep 2000"), "{ps}");
    // And once more, with everything now restored twice.
    crab_ok(&["checkpoint", &sb.name, "--kind", "full"]);
    crab_ok(&["restore", &sb.name]);
}

/// Issue 33 #12: default limits, shown by `inspect`, raisable per sandbox; a fork bomb stops
/// at the pids limit.
#[test]
fn sandboxes_have_default_limits() {
    let sb = Sandbox::new("t-esc-limits");
    let limits = sb.info()["limits"].clone();
    let d = crab_sandbox::runtime::DEFAULT_LIMITS;
    assert_eq!(limits["pids_max"], d.pids_max.unwrap(), "{limits}");
    assert_eq!(limits["memory_bytes"], d.memory_bytes.unwrap(), "{limits}");
    if sb.info()["bytes_written"].is_u64() {
        assert_eq!(limits["disk_bytes"], d.disk_bytes.unwrap(), "{limits}");
    }
    let pids = d.pids_max.unwrap();
    // A fork bomb (its shell dies when fork fails): counted from the host, since nothing more
    // can start inside while it holds every pid.
    let _ = sb.sh(&format!(
        "for i in $(seq {}); do sleep 20 >/dev/null 2>&1 & done 2>/dev/null",
        pids + 200
    ));
    let n = sb.info()["processes"].as_u64().unwrap();
    assert!(n <= pids, "{n} processes run in a sandbox limited to {pids}");
    assert!(n > pids / 2, "only {n} processes started: the bomb did not run");
    let big = Sandbox::with_args("t-esc-limits-big", &["--pids", "4096", "--memory", "8G"]);
    let limits = big.info()["limits"].clone();
    assert_eq!(
        (limits["pids_max"].as_u64(), limits["memory_bytes"].as_u64()),
        (Some(4096), Some(8 << 30))
    );
}

/// Issue 33 #13: `kill -9` of the daemon in the middle of a fork leaves no `dead` branch: at
/// start the daemon removes the branches that never ran.
#[test]
fn a_fork_interrupted_by_kill9_leaves_no_dead_branches() {
    let state = PathBuf::from("/var/lib").join(unique("crab-esc-fork"));
    let d = daemon_with_empty_image(&state, "2G");
    let name = unique("t-esc-fork");
    d.crab_ok(&["sandbox", "create", "empty", "--name", &name]);
    d.crab_ok(&["checkpoint", &name, "--kind", "full"]);
    let sandboxes = state.join("pool/sandboxes");
    let prefix = format!("{name}-");
    let mut fork = Command::new(common::bin())
        .args(["--state-dir", state.to_str().unwrap(), "fork", &name, "--count", "6"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill the daemon as soon as a branch has claimed its name.
    let start = Instant::now();
    let claimed = loop {
        let n = std::fs::read_dir(&sandboxes)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .count()
            })
            .unwrap_or(0);
        if n > 0 || start.elapsed() > Duration::from_secs(20) {
            break n;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(claimed > 0, "no branch appeared");
    d.kill9();
    let _ = fork.wait();
    d.restart();
    let ls = d.json(&["sandbox", "ls"]);
    for sb in ls.as_array().unwrap() {
        assert_ne!(sb["state"], "dead", "a branch of the interrupted fork is dead: {ls}");
    }
    // Every branch left either runs or is gone with its directory; the name can be used again.
    d.crab_ok(&["fork", &name, "--count", "1", "--names", &format!("{name}-again")]);
}

#[test]
fn crab_daemon_help_names_the_default_limits() {
    let out = crab(&["daemon", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--default-memory", "--default-pids", "--default-disk"] {
        assert!(help.contains(flag), "{flag} missing from `crab daemon --help`");
    }
}
