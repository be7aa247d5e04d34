//! A daemon killed with SIGKILL and started again adopts its running sandboxes (root).
//! Kept in its own test binary: it takes the daemon down, which would disturb other tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use common::{crab, state_dir, wait_until, Sandbox};

#[test]
fn sigkilled_daemon_adopts_running_sandboxes() {
    let sb = Sandbox::new("t-adopt");
    sb.sh_ok("cd /tmp && echo adopted > index.html && nohup python3 -m http.server 8001 >/dev/null 2>&1 &");
    assert!(
        wait_until(10.0, || sb.sh("curl -sf http://127.0.0.1:8001/index.html").0 == "adopted\n")
    );
    let pid: i32 =
        std::fs::read_to_string(state_dir().join("daemon.pid")).unwrap().trim().parse().unwrap();
    nix_kill(pid);
    assert!(wait_until(5.0, || !common::daemon_up()));
    // Down: the CLI says so clearly.
    let o = crab(&["sandbox", "ls"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("daemon is not running"));
    common::start_daemon();
    let info = sb.info();
    assert_eq!(info["state"], "running");
    assert_eq!(sb.sh("curl -sf http://127.0.0.1:8001/index.html").0, "adopted\n");
}

fn nix_kill(pid: i32) {
    let st = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(st.success());
}
