//! Harness exclusion end to end (root, real daemon, BPF and CRIU): a sandbox created with
//! `--harness-cmd` / `--harness-path` whose harness (a loop that touches 16 MiB and appends to
//! a log under its declared path) runs every turn gets `skip` turns while only the harness ran,
//! where the same harness without the declaration makes every turn a dump; a turn where a
//! non-harness process ran too is a process (or full) checkpoint, and restoring it brings back
//! both, each with its memory. A harness that says its own state changed (`crab sandbox
//! harness-changed`) gets one dump at the next decided checkpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use common::{cgroup_parent, crab_ok, wait_until, Sandbox};

const HARNESS: &str = r#"
import time
b = bytearray(16 << 20)
i = 0
while True:
    for j in range(0, len(b), 4096):
        b[j] = (b[j] + 1) & 255
    i += 1
    with open('/opt/h/log', 'a') as f:
        f.write(f'{i}\n')
    time.sleep(0.05)
"#;

use common::COUNTER_PY as COUNTER;

fn put(sb: &Sandbox, path: &str, text: &str) {
    let t = text.replace('\'', "'\\''");
    sb.sh_ok(&format!("mkdir -p $(dirname {path}) && printf '%s' '{t}' > {path}"));
}

fn start_harness(sb: &Sandbox) {
    put(sb, "/opt/h/h.py", HARNESS);
    sb.sh_ok("setsid python3 /opt/h/h.py >/dev/null 2>&1 </dev/null &");
    assert!(wait_until(10.0, || sb.sh("test -s /opt/h/log").2 == 0), "harness did not start");
}

fn log_lines(sb: &Sandbox) -> usize {
    sb.sh_ok("wc -l < /opt/h/log").trim().parse().unwrap()
}

fn checkpoint(sb: &Sandbox, kind: &str) -> serde_json::Value {
    let out = crab_ok(&["--json", "checkpoint", &sb.name, "--kind", kind]);
    serde_json::from_str(&out).unwrap()
}

fn kind_of(v: &serde_json::Value) -> String {
    v["point"]["kind"].as_str().unwrap().to_string()
}

fn hit(sb: &Sandbox) -> String {
    sb.sh("curl -sf localhost:9000").0
}

#[test]
fn a_busy_harness_alone_is_skipped_and_dumped_with_the_rest() {
    crab_testkit::require_root!();
    let harness = ["--harness-cmd", r"^python3 /opt/h/h\.py$", "--harness-path", "/opt/h"];
    let sb = Sandbox::with_args("t-harness", &harness);
    assert_eq!(sb.info()["harness"]["cmd"][0], r"^python3 /opt/h/h\.py$");
    let plain = Sandbox::new("t-harness-off");
    for s in [&sb, &plain] {
        start_harness(s);
        assert_eq!(kind_of(&checkpoint(s, "full")), "full");
    }
    // Turns in which only the harness ran (and wrote under its path).
    for turn in 0..2 {
        let before = log_lines(&sb);
        std::thread::sleep(std::time::Duration::from_millis(700));
        assert!(log_lines(&sb) > before, "the harness did not run in turn {turn}");
        let v = checkpoint(&sb, "auto");
        assert_eq!(kind_of(&v), "skip", "turn {turn} with only the harness running: {v}");
        let off = checkpoint(&plain, "auto");
        assert_ne!(kind_of(&off), "skip", "the undeclared harness made no change? {off}");
    }

    // The harness says its own state changed: the next decided checkpoint dumps, once.
    let marked = crab_ok(&["--json", "sandbox", "harness-changed", &sb.name]);
    let marked: serde_json::Value = serde_json::from_str(&marked).unwrap();
    assert_eq!(marked["next_checkpoint_dumps"], true, "{marked}");
    let v = checkpoint(&sb, "auto");
    assert_eq!(kind_of(&v), "process", "after a harness change: {v}");
    assert!(v.to_string().contains("harness said its state changed"), "{v}");
    let v = checkpoint(&sb, "auto");
    assert_eq!(kind_of(&v), "skip", "the mark is consumed by one checkpoint: {v}");
    let out = common::crab(&["sandbox", "harness-changed", "t-harness-nope"]);
    assert!(!out.status.success(), "an unknown sandbox is refused: {out:?}");

    // A non-harness process: its birth, then its running, call for dumps.
    put(&sb, "/root/counter.py", COUNTER);
    sb.sh_ok("cd /root && setsid python3 counter.py >/dev/null 2>&1 </dev/null &");
    let listening = || sb.sh("bash -c 'exec 3<>/dev/tcp/127.0.0.1/9000'").2 == 0;
    assert!(wait_until(10.0, listening), "counter did not start");
    assert_eq!(hit(&sb), "1");
    let born = checkpoint(&sb, "auto");
    assert!(["process", "full"].contains(&kind_of(&born).as_str()), "{born}");
    assert_eq!(hit(&sb), "2");
    let ran = checkpoint(&sb, "auto");
    assert!(["process", "full"].contains(&kind_of(&ran).as_str()), "{ran}");
    assert_eq!(hit(&sb), "3");
    let at_point = log_lines(&sb);

    // Kill everything; the restore brings back both, each with its memory.
    let procs = format!("/sys/fs/cgroup/unified/{}/{}/cgroup.procs", cgroup_parent(), sb.name);
    for pid in std::fs::read_to_string(procs).unwrap().lines() {
        let _ = std::process::Command::new("kill").args(["-9", pid]).status();
    }
    assert!(wait_until(5.0, || sb.info()["state"] == "dead"));
    crab_ok(&["restore", &sb.name]);
    assert_eq!(hit(&sb), "3", "the counter's memory is the checkpoint's");
    assert!(
        sb.sh("pgrep -f '^python3 /opt/h/h.py'").2 == 0,
        "the harness did not come back with the restore"
    );
    let restored = log_lines(&sb);
    assert!(
        wait_until(5.0, || log_lines(&sb) > restored),
        "the restored harness does not run (log at point {at_point}, after restore {restored})"
    );
}
