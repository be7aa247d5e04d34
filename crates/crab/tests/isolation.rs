//! The escape corpus: every attack of issue 10, each one small shell case run inside a real
//! sandbox, must fail — in a fresh sandbox, after a full checkpoint and restore in place, and in
//! a fork branch. Each case exits 0 only when the attack worked. A `--privileged` sandbox runs
//! a few harmless cases as the control: there they must succeed, which shows the cases can
//! detect an escape. Also checks that every process's CapEff/CapBnd/Seccomp/NoNewPrivs are the
//! same after restore and in a fork as before the dump.
//!
//! Needs root, CRIU and the default image (as every test of this crate).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;

use common::{crab_ok, state_dir, wait_until, Sandbox};

/// Helper for the syscall-level attacks, written into the sandbox; exits 0 when the syscall
/// succeeded.
const ATTACKS_PY: &str = r#"
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(*a):
    r = libc.syscall(*a)
    print("ret", r, "errno", ctypes.get_errno())
    sys.exit(0 if r >= 0 else 1)
what = sys.argv[1]
if what == "bpf_map":  # BPF_MAP_CREATE, array map
    attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + bytes(112))
    sc(321, 0, attr, 128)
elif what == "bpf_next_id":  # BPF_PROG_GET_NEXT_ID from 0
    attr = ctypes.create_string_buffer(bytes(128))
    sc(321, 11, attr, 128)
elif what == "keyctl":  # KEYCTL_GET_KEYRING_ID of the user keyring
    sc(250, 0, ctypes.c_long(-4), 1)
elif what == "add_key":
    sc(248, b"user", b"crab-escape", b"x", 1, ctypes.c_long(-4))
elif what == "perf":  # PERF_TYPE_SOFTWARE / cpu-clock, this task, any cpu
    attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 128, 0) + bytes(112))
    sc(298, attr, 0, -1, -1, 0)
elif what == "ptrace":  # PTRACE_ATTACH
    sc(101, 16, int(sys.argv[2]), 0, 0)
elif what == "userfaultfd":
    sc(323, 0)
elif what == "open_by_handle":
    sc(304, -100, ctypes.create_string_buffer(16), 0)
elif what == "clone_newuser":  # raw clone(CLONE_NEWUSER|SIGCHLD)
    r = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)
    if r == 0:
        os._exit(0)
    print("ret", r, "errno", ctypes.get_errno())
    if r > 0:
        os.waitpid(r, 0)
    sys.exit(0 if r > 0 else 1)
elif what == "connect":
    import socket
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((sys.argv[2], int(sys.argv[3]))); print("connected"); sys.exit(0)
    except OSError as e:
        print(e); sys.exit(1)
"#;

/// What the attacks need to know about the host (what an attacker would guess or find).
struct Targets {
    /// Host path of the attacking sandbox's root, for release_agent.
    host_root: String,
    /// Canary the release_agent payload would create on the host.
    canary: String,
    /// Another sandbox to attack.
    victim: String,
    /// (major, minor) of the pool's loop device and of the host's root disk.
    loop_dev: (u64, u64),
    disk_dev: (u64, u64),
    /// A server on the host's loopback and one on a host address.
    loopback_port: u16,
    host_addr: Option<String>,
    /// Host pid of a process outside the sandbox (the test itself).
    outside_pid: u32,
}

fn dev_of(path: &str) -> (u64, u64) {
    let d = std::fs::metadata(path).unwrap().dev();
    (libc::major(d) as u64, libc::minor(d) as u64)
}

fn root_disk() -> (u64, u64) {
    let src = std::process::Command::new("findmnt").args(["-no", "SOURCE", "/"]).output().unwrap();
    let src = String::from_utf8_lossy(&src.stdout).trim().to_string();
    let r = std::fs::metadata(&src).unwrap().rdev();
    (libc::major(r) as u64, libc::minor(r) as u64)
}

fn host_addr() -> Option<String> {
    let out = std::process::Command::new("hostname").arg("-I").output().ok()?;
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().map(str::to_string)
}

/// The corpus: (case, script). A script exits 0 only when the attack worked.
fn corpus(t: &Targets) -> Vec<(&'static str, String)> {
    let (lma, lmi) = t.loop_dev;
    let (dma, dmi) = t.disk_dev;
    let mnt = |fs: &str, opts: &str| {
        format!("mkdir -p /tmp/m-{fs} && mount -t {fs} {opts} none /tmp/m-{fs}")
    };
    let mut v = vec![
        (
            "cgroup1 release_agent",
            format!(
                "mkdir -p /tmp/cg && mount -t cgroup -o memory none /tmp/cg && mkdir -p /tmp/cg/x \
                 && printf '#!/bin/sh\\ntouch {canary}\\n' > /payload && chmod +x /payload \
                 && echo 1 > /tmp/cg/x/notify_on_release && echo {root}/payload > /tmp/cg/release_agent \
                 && sh -c 'echo $$ > /tmp/cg/x/cgroup.procs' && sleep 0.5",
                canary = t.canary,
                root = t.host_root
            ),
        ),
        (
            "sysctl write",
            "v=$(cat /proc/sys/vm/overcommit_ratio) && echo $v > /proc/sys/vm/overcommit_ratio"
                .into(),
        ),
        ("sysrq-trigger write", "test -e /proc/sysrq-trigger && echo h > /proc/sysrq-trigger".into()),
        ("mount cgroup1", mnt("cgroup", "-o pids")),
        ("mount cgroup2", mnt("cgroup2", "")),
        ("mount debugfs", mnt("debugfs", "")),
        ("mount tracefs", mnt("tracefs", "")),
        ("mount bpffs", mnt("bpf", "")),
        ("mount proc", mnt("proc", "")),
        ("mount sysfs", mnt("sysfs", "")),
        ("mount tmpfs", mnt("tmpfs", "")),
        (
            "move into a host cgroup",
            "mkdir -p /tmp/c2 && mount -t cgroup2 none /tmp/c2 && echo $$ > /tmp/c2/cgroup.procs"
                .into(),
        ),
        (
            "cgroup.kill another sandbox",
            format!(
                "mkdir -p /tmp/c3 && mount -t cgroup2 none /tmp/c3 && \
                 echo 1 > $(find /tmp/c3 -path '*{}/cgroup.kill' | head -1)",
                t.victim
            ),
        ),
        (
            "leave limits via own cgroupfs",
            "for f in $(find / -xdev -name cgroup.procs 2>/dev/null); do echo $$ > $f && exit 0; done; exit 1"
                .into(),
        ),
        (
            "mknod+read pool loop device",
            format!("rm -f /tmp/lo && mknod /tmp/lo b {lma} {lmi} ; head -c 512 /tmp/lo > /dev/null"),
        ),
        (
            "mknod+read host disk",
            format!("rm -f /tmp/sd && mknod /tmp/sd b {dma} {dmi} ; head -c 512 /tmp/sd > /dev/null"),
        ),
        ("read /dev/mem class device", "rm -f /tmp/mem && mknod /tmp/mem c 1 1 ; head -c 1 /tmp/mem >/dev/null".into()),
        ("bpf map create", "python3 /root/attacks.py bpf_map".into()),
        ("bpf prog get next id", "python3 /root/attacks.py bpf_next_id".into()),
        ("unshare -U", "unshare -U true".into()),
        ("unshare -m", "unshare -m true".into()),
        ("unshare -n", "unshare -n true".into()),
        ("raw clone CLONE_NEWUSER", "python3 /root/attacks.py clone_newuser".into()),
        ("keyctl user keyring", "python3 /root/attacks.py keyctl".into()),
        ("add_key", "python3 /root/attacks.py add_key".into()),
        ("perf_event_open", "python3 /root/attacks.py perf".into()),
        ("userfaultfd", "python3 /root/attacks.py userfaultfd".into()),
        ("open_by_handle_at", "python3 /root/attacks.py open_by_handle".into()),
        (
            "kallsyms addresses",
            "grep -v '^0000000000000000' /proc/kallsyms | head -1 | grep -q .".into(),
        ),
        ("read /proc/kcore", "head -c 1 /proc/kcore | grep -q .".into()),
        ("read /proc/timer_list", "head -c 1 /proc/timer_list | grep -q .".into()),
        ("read /proc/keys", "head -c 1 /proc/keys | grep -q .".into()),
        // The masked directories stay empty and read-only, also as the daemon's read-only
        // binds that a restore or fork puts there (profile::MASKED_MOUNT_KEY).
        ("list masked /proc/acpi", "test -d /proc/acpi && ls -A /proc/acpi | grep -q .".into()),
        ("write into masked /proc/acpi", "test -d /proc/acpi && touch /proc/acpi/x".into()),
        // /dev/shm is a directory of /dev's tmpfs bound with nosuid,nodev,noexec.
        ("exec from /dev/shm", "cp /bin/true /dev/shm/t && /dev/shm/t".into()),
        (
            "device node in /dev/shm",
            "mknod /dev/shm/z c 1 5 && head -c 1 /dev/shm/z | wc -c | grep -q 1".into(),
        ),
        ("ptrace a process outside", format!("python3 /root/attacks.py ptrace {}", t.outside_pid)),
        (
            "reach host loopback",
            format!("python3 /root/attacks.py connect 127.0.0.1 {}", t.loopback_port),
        ),
        (
            "host cgroup visible",
            "grep -q crab /proc/self/cgroup || grep -q crab /proc/1/cgroup".into(),
        ),
        ("write a host sysfs file", "test -d /sys/kernel && echo 1 > /sys/kernel/mm/ksm/run".into()),
    ];
    if let Some(a) = &t.host_addr {
        v.push((
            "reach host address",
            format!("python3 /root/attacks.py connect {a} {}", t.loopback_port),
        ));
    }
    v.push(("reach another sandbox", "python3 /root/attacks.py connect 127.0.0.1 9000".into()));
    v
}

fn prepare(sb: &Sandbox) {
    let script = ATTACKS_PY.replace('\'', "'\\''");
    sb.sh_ok(&format!("printf '%s' '{script}' > /root/attacks.py"));
}

fn targets(attacker: &Sandbox, victim: &Sandbox, port: u16) -> Targets {
    let root = state_dir().join("pool/sandboxes").join(&attacker.name).join("rootfs");
    Targets {
        host_root: root.display().to_string(),
        canary: format!("/tmp/crab-escape-canary-{}", attacker.name),
        victim: victim.name.clone(),
        loop_dev: dev_of(state_dir().join("pool").to_str().unwrap()),
        disk_dev: root_disk(),
        loopback_port: port,
        host_addr: host_addr(),
        outside_pid: std::process::id(),
    }
}

/// Run every case in `sb`; returns the cases that escaped, with their output.
fn run_corpus(sb: &Sandbox, t: &Targets) -> Vec<String> {
    let mut escaped = Vec::new();
    for (name, script) in corpus(t) {
        let (o, e, code) = sb.sh(&format!("( {script} ) </dev/null"));
        if code == 0 {
            escaped.push(format!("{name}: {o}{e}"));
        }
    }
    // The release_agent payload would run on the host: check the host side too.
    if std::path::Path::new(&t.canary).exists() {
        escaped.push(format!("release_agent payload ran on the host ({})", t.canary));
        let _ = std::fs::remove_file(&t.canary);
    }
    escaped
}

/// pid -> "CapEff CapBnd Seccomp NoNewPrivs" of every process in the sandbox.
fn creds(sb: &Sandbox) -> BTreeMap<String, String> {
    let out = sb.sh_ok(
        "for p in /proc/[0-9]*; do n=${p#/proc/}; c=$(cat $p/comm 2>/dev/null) || continue; \
         case $c in sh|cat|grep|tr) continue;; esac; \
         echo \"$n $c $(grep -E '^(CapEff|CapBnd|Seccomp|NoNewPrivs):' $p/status | tr -s '\\t\\n' '  ')\"; done",
    );
    out.lines()
        .filter_map(|l| l.split_once(' ').map(|(p, rest)| (p.to_string(), rest.to_string())))
        .collect()
}

fn assert_default_creds(c: &BTreeMap<String, String>, when: &str) {
    assert!(c.len() >= 3, "{when}: too few processes: {c:?}");
    for (pid, s) in c {
        assert!(s.contains("CapEff: 00000000a80405fb"), "{when}: pid {pid}: {s}");
        assert!(s.contains("CapBnd: 00000000a80405fb"), "{when}: pid {pid}: {s}");
        assert!(s.contains("Seccomp: 2"), "{when}: pid {pid}: {s}");
        assert!(s.contains("NoNewPrivs: 1"), "{when}: pid {pid}: {s}");
    }
}

fn start_servers(sb: &Sandbox) {
    sb.sh_ok("nohup python3 -m http.server 9000 --bind 127.0.0.1 >/dev/null 2>&1 & nohup sleep 100000 >/dev/null 2>&1 &");
    let up = || sb.sh("bash -c 'exec 3<>/dev/tcp/127.0.0.1/9000'").2 == 0;
    assert!(wait_until(10.0, up), "server did not start in {}", sb.name);
}

#[test]
fn escape_corpus_fails_fresh_restored_and_forked() {
    crab_testkit::require_root!();
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let victim = Sandbox::new("t-iso-victim");
    start_servers(&victim);
    let sb = Sandbox::new("t-iso");
    prepare(&sb);
    sb.sh_ok(
        "nohup sleep 100000 >/dev/null 2>&1 & \
         nohup python3 -c 'import time; time.sleep(1e6)' >/dev/null 2>&1 &",
    );
    let t = targets(&sb, &victim, port);

    // The profile is what inspect reports.
    let info = sb.info();
    assert_eq!(info["profile"]["name"], "default", "{info}");
    assert_eq!(info["profile"]["no_new_privs"], true);

    let escaped = run_corpus(&sb, &t);
    assert!(escaped.is_empty(), "fresh sandbox: attacks succeeded:\n{}", escaped.join("\n"));
    assert_eq!(victim.info()["state"], "running", "the victim sandbox was killed");
    let before = creds(&sb);
    assert_default_creds(&before, "before dump");

    // Full checkpoint, restore in place: same creds per process, corpus still fails.
    let out = crab_ok(&["--json", "checkpoint", &sb.name, "--kind", "full"]);
    let point: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = point["point"]["id"].as_str().unwrap().to_string();
    crab_ok(&["restore", &sb.name]);
    let after = creds(&sb);
    assert_eq!(before, after, "creds changed across checkpoint/restore");
    let escaped = run_corpus(&sb, &t);
    assert!(escaped.is_empty(), "after restore: attacks succeeded:\n{}", escaped.join("\n"));

    // A fork branch: same creds, corpus still fails.
    let out = crab_ok(&["--json", "fork", &sb.name, &id, "--count", "1"]);
    let branches: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let branch = Sandbox { name: branches[0]["sandbox"].as_str().unwrap().to_string() };
    let forked = creds(&branch);
    assert_eq!(
        before.values().collect::<Vec<_>>(),
        forked.values().collect::<Vec<_>>(),
        "creds differ in the fork branch"
    );
    let tb = targets(&branch, &victim, port);
    let escaped = run_corpus(&branch, &tb);
    assert!(escaped.is_empty(), "fork branch: attacks succeeded:\n{}", escaped.join("\n"));
    assert_eq!(victim.info()["state"], "running", "the victim sandbox was killed");
    drop(listener);
}

/// The control: in a `--privileged` sandbox the same harmless cases succeed, so the corpus can
/// tell an escape from a refusal; and a privileged sandbox's exec runs unrestricted.
#[test]
fn privileged_sandbox_opts_out() {
    crab_testkit::require_root!();
    let sb = Sandbox::with_args("t-iso-priv", &["--privileged"]);
    prepare(&sb);
    assert_eq!(sb.info()["profile"]["name"], "privileged");
    for (name, script) in [
        ("mount tmpfs", "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m"),
        ("bpf map create", "python3 /root/attacks.py bpf_map"),
        ("unshare -U", "unshare -U true"),
        ("kallsyms addresses", "grep -v '^0000000000000000' /proc/kallsyms | head -1 | grep -q ."),
        (
            "sysctl write",
            "v=$(cat /proc/sys/vm/overcommit_ratio) && echo $v > /proc/sys/vm/overcommit_ratio",
        ),
    ] {
        let (o, e, code) = sb.sh(script);
        assert_eq!(code, 0, "control case {name} failed in a privileged sandbox: {o}{e}");
    }
    let s = sb.sh_ok("grep -E '^(CapEff|Seccomp):' /proc/self/status");
    assert!(s.contains("Seccomp:\t0"), "{s}");
    assert!(!s.contains("00000000a80405fb"), "{s}");
}
