//! A daemon killed with SIGKILL and started again adopts its running sandboxes (root), keeps a
//! parked one parked until a call wakes it (issue 31), and
//! reconciles `nat` networking: a live sandbox keeps its host interface and its address in the
//! daemon's nftables table; a stray interface of this daemon's prefix is deleted.
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
    let parked = Sandbox::new("t-adopt-parked");
    parked.sh_ok("echo 7 > /tmp/n; nohup sh -c 'while :; do sleep 0.2; done' >/dev/null 2>&1 &");
    common::crab_ok(&["sandbox", "park", &parked.name]);
    let nat = Sandbox::with_args("t-adopt-nat", &["--network", "nat"]);
    let rec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(state_dir().join("pool/sandboxes").join(&nat.name).join("sandbox.json"))
            .unwrap(),
    )
    .unwrap();
    let host_if = rec["nat"]["host_if"].as_str().unwrap().to_string();
    let addr = rec["nat"]["addr"].as_str().unwrap().to_string();
    // A leftover of this daemon (as a crash in the middle of wiring a sandbox would leave).
    let stray = format!("{}dead0", &host_if[..8]);
    let st = std::process::Command::new("ip")
        .args(["link", "add", &stray, "type", "veth", "peer", "name", &format!("{stray}p")])
        .status()
        .unwrap();
    assert!(st.success());
    let pid: i32 =
        std::fs::read_to_string(state_dir().join("daemon.pid")).unwrap().trim().parse().unwrap();
    nix_kill(pid);
    assert!(wait_until(5.0, || !common::daemon_up()));
    // Gone, not only deaf: a SIGKILLed process holds its pid-file lock until its exit is done
    // (slow on a loaded machine), and a daemon started before that refuses the state dir.
    assert!(wait_until(20.0, || !std::path::Path::new(&format!("/proc/{pid}")).exists()));
    // Down: the CLI says so clearly.
    let o = crab(&["sandbox", "ls"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("daemon is not running"));
    common::start_daemon();
    let info = sb.info();
    assert_eq!(info["state"], "running");
    // Parked across the restart, and woken by the first call.
    assert_eq!(parked.info()["state"], "parked");
    assert_eq!(
        parked.sh("cat /tmp/n; pgrep -c sleep >/dev/null && echo looping").0,
        "7\nlooping\n"
    );
    assert_eq!(parked.info()["state"], "running");
    assert_eq!(sb.sh("curl -sf http://127.0.0.1:8001/index.html").0, "adopted\n");
    let net = std::path::Path::new("/sys/class/net");
    assert!(net.join(&host_if).exists(), "the live nat sandbox lost its host interface");
    assert!(!net.join(&stray).exists(), "the stray interface {stray} was not deleted");
    let table = common::cgroup_parent();
    let set = std::process::Command::new("nft")
        .args(["list", "set", "inet", &table, "sandboxes"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&set.stdout).contains(&addr), "table {table} lost {addr}");
    assert_eq!(nat.info()["address"], addr.as_str());
    drop(nat);
    assert!(!net.join(&host_if).exists(), "rm left the host interface");
}

fn nix_kill(pid: i32) {
    let st = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(st.success());
}
