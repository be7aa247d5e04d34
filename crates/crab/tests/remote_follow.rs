//! Standbys and the restore's local copies (issue 32), against daemons of their own (root)
//! sharing a `file://` remote: host B follows a sandbox of host A (`--follow`), holds each
//! newest point as A exports it (older copies dropped, the pool flushed), and once A is gone
//! a failover `create --from-remote` is a fork of the local copy (nothing downloaded) with the
//! files and processes back; `crab remote follow` lists, stops and keeps its set across a
//! restart. A local copy whose `unflushed` marker names another boot (the host went down before
//! it reached the disk), or whose images no longer match their manifest, is fetched again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{unique, OtherDaemon};

fn host(tmp: &Path, tag: &str, remote: &str, extra: &[&str]) -> OtherDaemon {
    let mut args = vec!["--pool-size", "8G", "--remote", remote];
    args.extend_from_slice(extra);
    let d = OtherDaemon::start(&tmp.join(tag), &args, &[]);
    let image = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    assert!(image.is_dir(), "no debian image in the test daemon's state dir: run `make image`");
    d.crab_ok(&["image", "import", "debian", image.to_str().unwrap()]);
    d
}

fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what} within {secs} s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Host A on `remote`, running a sandbox (named after `tag`) with a `sleep 4243` in it.
fn source_host(tmp: &Path, remote: &str, tag: &str) -> (OtherDaemon, String) {
    let a = host(tmp, "host-a", remote, &[]);
    let sb = unique(tag);
    a.crab_ok(&["sandbox", "create", "debian", "--name", &sb]);
    a.crab_ok(&["exec", &sb, "--", "sh", "-c", "nohup sleep 4243 >/dev/null 2>&1 &"]);
    (a, sb)
}

/// A durable `full` point of `sb` on `a` after writing `text` to /root/state.txt.
fn durable_point(a: &OtherDaemon, sb: &str, text: &str) -> String {
    a.crab_ok(&["exec", sb, "--", "sh", "-c", &format!("echo {text} > /root/state.txt")]);
    let v = a.json(&["checkpoint", sb, "--kind", "full", "--durable"]);
    v["point"]["id"].as_str().unwrap().to_string()
}

/// The point B's follower holds for `sb`.
fn held(b: &OtherDaemon, sb: &str) -> Option<String> {
    let v = b.json(&["remote", "follow"]);
    v["sandboxes"]
        .as_array()?
        .iter()
        .find(|s| s["sandbox"] == sb)
        .and_then(|s| s["point"].as_str().map(str::to_string))
}

/// Names in B's local copies of `sb`'s points with `suffix`.
fn copies(b: &OtherDaemon, sb: &str, suffix: &str) -> Vec<String> {
    let dir = crab_common::paths::StateDir::new(&b.state).remote_points(sb).join("points");
    let mut out: Vec<String> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.strip_suffix(suffix).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn check_copy(b: &OtherDaemon, copy: &str, text: &str) {
    assert_eq!(b.crab_ok(&["exec", copy, "--", "cat", "/root/state.txt"]), format!("{text}\n"));
    let ps = b.crab_ok(&["exec", copy, "--", "sh", "-c", "ps -eo args"]);
    assert!(ps.contains("sleep 4243"), "the process did not come back: {ps}");
}

#[test]
fn a_standby_holds_the_newest_point_and_fails_over_to_a_local_fork() {
    require_root!();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let remote = format!("file://{}", tmp.path().join("remote").display());
    let (a, sb) = source_host(tmp.path(), &remote, "t-follow");
    let p1 = durable_point(&a, &sb, "one");

    let b = host(tmp.path(), "host-b", &remote, &["--follow", &sb]);
    wait_for(120, "the standby holding the first point", || held(&b, &sb) == Some(p1.clone()));
    let p2 = durable_point(&a, &sb, "two");
    wait_for(120, "the standby holding the newer point", || held(&b, &sb) == Some(p2.clone()));
    // Only the newest copy is kept, and it was flushed (no marker left).
    assert_eq!(copies(&b, &sb, ".manifest"), std::slice::from_ref(&p2));
    wait_for(30, "the follower's flush", || copies(&b, &sb, ".unflushed").is_empty());
    let listed = b.crab_ok(&["remote", "follow"]);
    assert!(listed.contains(&sb) && listed.contains("up to date"), "{listed}");

    // Host A goes away; the failover is a fork of the copy B holds.
    a.crab_ok(&["sandbox", "rm", "--force", &sb]);
    a.destroy();
    let copy = unique("t-failover");
    let v = b.json(&["sandbox", "create", "--from-remote", &sb, "--name", &copy]);
    assert_eq!(v["source"], format!("{sb}@{p2}"), "{v}");
    assert_eq!(v["downloaded"], false, "the failover downloaded the point again: {v}");
    check_copy(&b, &copy, "two");

    // Stopping is saved; a restarted standby keeps its (now empty) set.
    b.crab_ok(&["remote", "follow", "--stop", &sb]);
    b.restart();
    let v = b.json(&["remote", "follow"]);
    assert_eq!(v["sandboxes"].as_array().map(Vec::len), Some(0), "{v}");
    let e = b.crab(&["remote", "follow", "--stop"]);
    assert!(!e.status.success(), "--stop with nothing named was accepted");
    let _ = b.crab(&["sandbox", "rm", "--force", &copy]);
    b.destroy();
}

#[test]
fn a_local_copy_that_may_be_torn_or_no_longer_matches_is_fetched_again() {
    require_root!();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let remote = format!("file://{}", tmp.path().join("remote").display());
    let (a, sb) = source_host(tmp.path(), &remote, "t-copy");
    let p = durable_point(&a, &sb, "kept");
    let b = OtherDaemon::start(
        &tmp.path().join("host-b"),
        &["--pool-size", "8G", "--remote", &remote],
        &[],
    );
    let source = format!("{sb}@{p}");
    let create = |tag: &str| {
        let copy = unique(tag);
        let v = b.json(&["sandbox", "create", "--from-remote", &source, "--name", &copy]);
        check_copy(&b, &copy, "kept");
        b.crab_ok(&["sandbox", "rm", "--force", &copy]);
        v["downloaded"].as_bool().unwrap()
    };
    assert!(create("t-c1"), "the first restore did not download the point");
    assert!(copies(&b, &sb, ".unflushed").is_empty(), "the fork did not clear the marker");
    assert!(!create("t-c2"), "a flushed local copy was downloaded again");

    // The host "went down" before the copy reached the disk: its marker names another boot.
    let points = crab_common::paths::StateDir::new(&b.state).remote_points(&sb).join("points");
    std::fs::write(points.join(format!("{p}.unflushed")), "an-earlier-boot").unwrap();
    assert!(create("t-c3"), "a copy from before a crash was used");
    assert!(copies(&b, &sb, ".unflushed").is_empty());

    // One byte of an image changed on disk: the fork's check refuses the copy, which is
    // discarded and fetched once more.
    let procs = crab_common::paths::StateDir::new(&b.state).remote_points(&sb).join("procs");
    crab_testkit::criu_images::corrupt_pages(&procs);
    assert!(create("t-c4"), "a corrupt copy was not fetched again");
    a.destroy();
    b.destroy();
}
