//! The host owns a sandbox's life (issue 27): `crab sandbox pause|resume|stop`, the transition
//! checks (`conflict` for an impossible step), deadlines fired by the host's one watchdog
//! (`--timeout/--on-timeout`), labelled points that outlive a kill, and the migration of an
//! older daemon's E2B front-door files into the records. Real daemon, real sandboxes (root).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use common::{crab, crab_ok, unique, wait_until, OtherDaemon, Sandbox};

fn state(sb: &Sandbox) -> String {
    sb.info()["state"].as_str().unwrap().to_string()
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = crab_ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn pause_resume_and_impossible_steps() {
    require_root!();
    let sb = Sandbox::new("t-life-pause");
    sb.sh_ok("echo kept > /tmp/f; nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &");
    assert!(wait_until(5.0, || sb.sh("cat /tmp/count").0.trim().parse::<u32>().unwrap_or(0) > 2));
    // Resume of a running sandbox: conflict, nothing changed.
    let o = crab(&["sandbox", "resume", &sb.name]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot resume") && err.contains("running"), "{err}");
    let l = json(&["--json", "sandbox", "pause", &sb.name]);
    assert_eq!(l["state"], "paused");
    let point = l["point"].as_str().unwrap().to_string();
    // One field, read by every door: inspect, ls, the cheap status.
    assert_eq!(state(&sb), "paused");
    assert_eq!(sb.info()["pause_point"], point.as_str());
    let ls = json(&["--json", "sandbox", "ls"]);
    let me = ls.as_array().unwrap().iter().find(|s| s["name"] == sb.name.as_str()).unwrap();
    assert_eq!(me["state"], "paused");
    assert!(crab_ok(&["sandbox", "ls"])
        .lines()
        .any(|l| l.starts_with(&sb.name) && l.contains("paused")));
    // Paused: no command runs, a second pause is a conflict naming the way back.
    let o = crab(&["exec", &sb.name, "--", "true"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("paused"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = crab(&["sandbox", "pause", &sb.name]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("already paused"));
    // Resume: the pause point, processes included (the counter goes on from where it was).
    let l = json(&["--json", "sandbox", "resume", &sb.name]);
    assert_eq!(l["state"], "running");
    assert_eq!(l["point"], point.as_str());
    assert_eq!(state(&sb), "running");
    assert!(sb.info()["pause_point"].is_null());
    assert_eq!(sb.sh_ok("cat /tmp/f"), "kept\n");
    let a: u32 = sb.sh_ok("cat /tmp/count").trim().parse().unwrap();
    assert!(wait_until(5.0, || sb.sh("cat /tmp/count").0.trim().parse::<u32>().unwrap_or(0) > a));
    // Stop, then resume from the newest point.
    let l = json(&["--json", "sandbox", "stop", &sb.name]);
    assert_eq!(l["state"], "stopped");
    assert_eq!(state(&sb), "stopped");
    let o = crab(&["sandbox", "pause", &sb.name]);
    assert!(!o.status.success(), "a stopped sandbox paused");
    let l = json(&["--json", "sandbox", "resume", &sb.name]);
    assert_eq!(l["state"], "running");
    assert_eq!(sb.sh_ok("cat /tmp/f"), "kept\n");
}

#[test]
fn a_deadline_pauses_or_kills() {
    require_root!();
    // Pause at the deadline: the host's watchdog, whichever door set it.
    let sb = Sandbox::with_args("t-life-ttl", &["--timeout", "2", "--on-timeout", "pause"]);
    let d = sb.info()["deadline"].clone();
    assert_eq!(d["on"], "pause", "{d}");
    sb.sh_ok("echo before > /tmp/f");
    assert!(
        wait_until(15.0, || state(&sb) == "paused"),
        "the deadline did not pause it: {}",
        sb.info()
    );
    // Fired once: a paused sandbox has no deadline; what its deadlines do stays.
    assert!(sb.info()["deadline"].is_null());
    crab_ok(&["sandbox", "resume", &sb.name, "--timeout", "1h"]);
    assert_eq!(sb.sh_ok("cat /tmp/f"), "before\n");
    let d = sb.info()["deadline"].clone();
    assert_eq!(d["on"], "pause", "{d}");
    // Cleared with 0; set again later, to kill.
    crab_ok(&["sandbox", "update", &sb.name, "--timeout", "0"]);
    assert!(sb.info()["deadline"].is_null());
    crab_ok(&["sandbox", "update", &sb.name, "--timeout", "1", "--on-timeout", "kill"]);
    let name = sb.name.clone();
    assert!(
        wait_until(15.0, || !crab(&["sandbox", "inspect", &name]).status.success()),
        "the deadline did not kill (remove) it"
    );
    // Bad values are refused naming the flag.
    let o = crab(&["sandbox", "create", "debian", "--timeout", "25h"]);
    assert!(!o.status.success());
    let o = crab(&["sandbox", "update", &unique("t-life-none"), "--timeout", "5"]);
    assert!(!o.status.success());
}

#[test]
fn labelled_points_outlive_a_kill() {
    require_root!();
    let sb = Sandbox::new("t-life-label");
    sb.sh_ok("echo snap > /tmp/f");
    let t = json(&["--json", "checkpoint", &sb.name, "--kind", "fs"]);
    let point = t["point"]["id"].as_str().unwrap().to_string();
    let label = unique("t-life-lbl");
    let body = serde_json::json!({ "labels": [label] }).to_string();
    let o = common::api(
        "POST",
        &format!("/v1/sandboxes/{}/checkpoints/{point}/labels", sb.name),
        &body,
    );
    assert_eq!(o[0]["labels"][0], label.as_str(), "{o}");
    // The same label on another point: name_conflict.
    let other = Sandbox::new("t-life-label2");
    let t2 = json(&["--json", "checkpoint", &other.name, "--kind", "fs"]);
    let p2 = t2["point"]["id"].as_str().unwrap();
    let o = common::api(
        "POST",
        &format!("/v1/sandboxes/{}/checkpoints/{p2}/labels", other.name),
        &body,
    );
    assert_eq!(o["code"], "name_conflict", "{o}");
    // Kill: retired (its labelled point outlives it), not removed.
    let k = common::api("POST", &format!("/v1/sandboxes/{}/kill", sb.name), "");
    assert_eq!(k["state"], "retired", "{k}");
    assert_eq!(state(&sb), "retired");
    // A fork of the labelled point still works.
    let branch = unique("t-life-br");
    crab_ok(&["fork", &sb.name, &point, "--count", "1", "--names", &branch]);
    assert_eq!(crab_ok(&["exec", &branch, "--", "cat", "/tmp/f"]), "snap\n");
    crab_ok(&["sandbox", "rm", "-f", &branch]);
    // Deleting its last label removes the retired sandbox.
    let d = common::api("DELETE", &format!("/v1/labels/{label}"), "");
    assert_eq!(d["sandbox_removed"], true, "{d}");
    assert!(!crab(&["sandbox", "inspect", &sb.name]).status.success());
    let d = common::api("DELETE", &format!("/v1/labels/{label}"), "");
    assert_eq!(d["code"], "checkpoint_not_found", "{d}");
}

/// A state directory written by the previous version: its E2B front door kept the sandbox's
/// life in `<state>/e2b/sandboxes/<id>.json` (format 2). The new daemon hands it to the host
/// once: the sandbox is paused in `crab sandbox ls`, its metadata, environment, deadline and
/// snapshots are the record's, and it resumes from its pause point.
#[test]
fn an_older_e2b_state_is_migrated() {
    require_root!();
    let dir = PathBuf::from("/var/lib").join(unique("crab-life-migrate"));
    let d = OtherDaemon::start(&dir, &["--pool-size", "4G"], &[]);
    // Its image: the main daemon's, imported (no debootstrap here).
    let img = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    d.crab_ok(&["image", "import", "debian", img.to_str().unwrap()]);
    let id = "e2b-0123456789abcdef";
    d.crab_ok(&["sandbox", "create", "debian", "--name", id]);
    d.crab_ok(&[
        "exec",
        id,
        "--",
        "sh",
        "-c",
        "echo old > /tmp/f; nohup sleep 1000 >/dev/null 2>&1 &",
    ]);
    let full: serde_json::Value = d.json(&["checkpoint", id, "--kind", "full"]);
    let point = full["point"]["id"].as_str().unwrap().to_string();
    // As the old front door paused it: a full point, then the processes stopped (its record,
    // rewritten by this daemon, says stopped; the old E2B file says paused).
    d.crab_ok(&["sandbox", "stop", id, "--no-checkpoint"]);
    let end_at = crab_common::clock::now_ms() + 3_600_000;
    let file = serde_json::json!({
        "format": 2, "id": id, "template": "base",
        "metadata": {"suite": "old"}, "envs": {"OLD": "1"},
        "started_at_ms": 1_700_000_000_000u64, "end_at_ms": end_at, "auto_pause": true,
        "state": "paused", "pause_point": point,
        "snapshots": [{"id": format!("{id}:{point}"), "point": point, "fs_only": false, "names": ["old-snap"]}],
        "processes": [], "gc": []
    });
    let e2b = d.state.join("e2b/sandboxes");
    std::fs::create_dir_all(&e2b).unwrap();
    std::fs::write(e2b.join(format!("{id}.json")), file.to_string()).unwrap();
    d.stop();
    d.restart();
    let info = d.json(&["sandbox", "inspect", id]);
    let log = std::fs::read_to_string(d.state.join("logs/daemon.log")).unwrap_or_default();
    let said: Vec<&str> =
        log.lines().filter(|l| l.contains("E2B") || l.contains("migrat")).collect();
    assert_eq!(info["state"], "paused", "{info}\nthe daemon said: {said:#?}");
    assert_eq!(info["pause_point"], point.as_str());
    assert_eq!(info["labels"]["suite"], "old");
    assert_eq!(info["env"]["OLD"], "1");
    assert_eq!(info["template"], "base");
    assert_eq!(
        info["point_labels"][&point],
        serde_json::json!([format!("{id}:{point}"), "old-snap"])
    );
    // Its file is gone (migrated once): the front door keeps none.
    assert!(!e2b.join(format!("{id}.json")).exists(), "the migrated E2B file was kept");
    // It resumes from its pause point, its environment in every command.
    d.crab_ok(&["sandbox", "resume", id]);
    assert_eq!(d.crab_ok(&["exec", id, "--", "cat", "/tmp/f"]), "old\n");
    assert_eq!(d.crab_ok(&["exec", id, "--", "sh", "-c", "echo $OLD"]), "1\n");
    assert!(d.crab_ok(&["exec", id, "--", "ps", "-eo", "args"]).contains("sleep 1000"));
}
