//! Cross-host restore through a real S3 server (root): SeaweedFS on loopback
//! (`scripts/s3-test-server.sh`), daemon A (its own state dir, pool, proxy port) exports a
//! full checkpoint (`crab checkpoint --durable`), is stopped and its state dir deleted; daemon
//! B (another state dir, pool, port) builds a sandbox from the remote point with
//! `crab sandbox create --from-remote` (which draws its stages) and finds the file, two hard-linked names of one file
//! with its `user.*` extended attribute, and the running process again.
//! The image daemon A needs is imported from the test daemon's state dir (`make test` builds it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::path::Path;
use std::process::Command;

use common::OtherDaemon;

#[test]
fn restore_on_a_second_host_from_s3_after_the_first_is_gone() {
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let base = 19000 + (std::process::id() % 400) as u16 * 2;
    let out =
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/s3-test-server.sh"))
            .arg(tmp.path().join("weed"))
            .arg(base.to_string())
            .output()
            .unwrap();
    assert!(out.status.success(), "S3 server: {}", String::from_utf8_lossy(&out.stderr));
    let mut env = Vec::new();
    let mut weed_pid = 0;
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let (k, v) = l.split_once('=').unwrap();
        if k == "WEED_PID" {
            weed_pid = v.parse().unwrap();
        } else {
            env.push((k.to_string(), v.to_string()));
        }
    }
    let remote = format!("s3://crab/xhost-{}", std::process::id());
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(
        image.is_dir(),
        "no debian image in the test daemon's state dir ({}): run `crab image build debian`",
        image.display()
    );

    let a = OtherDaemon::start(
        &tmp.path().join("host-a"),
        &["--pool-size", "8G", "--remote", &remote],
        &env,
    );
    a.crab_ok(&["image", "import", "debian", image.to_str().unwrap()]);
    let name = common::unique("t-xhost");
    a.crab_ok(&["sandbox", "create", "debian", "--name", &name]);
    a.crab_ok(&[
        "exec",
        &name,
        "--",
        "sh",
        "-c",
        "echo from-host-a > /root/state.txt; echo linked > /root/l1; ln /root/l1 /root/l2; \
         python3 -c \"import os; os.setxattr('/root/l1', 'user.crab', b'carried')\"; \
         nohup sleep 4242 >/dev/null 2>&1 &",
    ]);
    let taken: serde_json::Value = serde_json::from_str(&a.crab_ok(&[
        "--json",
        "checkpoint",
        &name,
        "--kind",
        "full",
        "--durable",
    ]))
    .unwrap();
    assert!(taken["durable"]["uploaded_bytes"].as_u64().unwrap() > 1_000_000, "{taken}");
    let listed = a.crab_ok(&["checkpoints", &name]);
    assert!(listed.contains("durable"), "{listed}");
    a.crab_ok(&["sandbox", "rm", "--force", &name]);
    a.destroy();
    assert!(!a.state.exists());

    let b = OtherDaemon::start(
        &tmp.path().join("host-b"),
        &["--pool-size", "8G", "--remote", &remote],
        &env,
    );
    let ls = b.crab_ok(&["remote", "ls"]);
    assert!(ls.contains(&name), "{ls}");
    let copy = common::unique("t-xcopy");
    let o = b.crab(&["sandbox", "create", "--from-remote", &name, "--name", &copy]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Its stages, drawn as lines on a stderr that is not a terminal.
    let err = String::from_utf8_lossy(&o.stderr);
    let stages: Vec<&str> = err.lines().filter_map(|l| l.strip_prefix("==> ")).collect();
    assert_eq!(stages, ["load_point", "materialize", "verify", "branches"], "{err}");
    let file = b.crab_ok(&["exec", &copy, "--", "cat", "/root/state.txt"]);
    assert_eq!(file, "from-host-a\n");
    // Two hard-linked names, one inode, its user.* extended attribute.
    let links = b.crab_ok(&[
        "exec",
        &copy,
        "--",
        "python3",
        "-c",
        "import os; a, b = os.stat('/root/l1'), os.stat('/root/l2'); \
         print(a.st_ino == b.st_ino, a.st_nlink, os.getxattr('/root/l2', 'user.crab'))",
    ]);
    assert_eq!(links, "True 2 b'carried'\n");
    let ps = b.crab_ok(&["exec", &copy, "--", "sh", "-c", "ps -eo args || ls /proc"]);
    assert!(ps.contains("sleep 4242"), "the process did not come back: {ps}");
    b.crab_ok(&["remote", "check"]);
    let _ = b.crab(&["sandbox", "rm", "--force", &copy]);
    b.destroy();
    // The server this test started (its own process group).
    let _ = Command::new("kill").args(["-9", "--", &format!("-{weed_pid}")]).status();
    let _ = Command::new("kill").args(["-9", &weed_pid.to_string()]).status();
}
