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

/// Replacing a sandbox by another sandbox's point is one host action under its lock: a bad
/// point is refused with the sandbox untouched; a good one brings that point's files and
/// processes into it in place (its name, hostname and record stay), with a first point of its
/// own equal to it; `fs_only` brings the files only.
#[test]
fn replace_by_another_sandboxs_point_in_place() {
    require_root!();
    let src = Sandbox::new("t-life-rsrc");
    src.sh_ok("echo from-src > /tmp/f; nohup sleep 1001 >/dev/null 2>&1 &");
    let t = json(&["--json", "checkpoint", &src.name, "--kind", "full"]);
    let point = t["point"]["id"].as_str().unwrap().to_string();
    let dst = Sandbox::new("t-life-rdst");
    dst.sh_ok("echo mine > /tmp/g; echo old > /tmp/f; nohup sleep 1002 >/dev/null 2>&1 &");
    let url = format!("/v1/sandboxes/{}/replace", dst.name);
    // A point that does not exist: refused, nothing touched.
    let bad = serde_json::json!({ "source": format!("{}@c999999", src.name) }).to_string();
    let o = common::api("POST", &url, &bad);
    assert_eq!(o["code"], "checkpoint_not_found", "{o}");
    assert_eq!(dst.sh_ok("cat /tmp/g"), "mine\n");
    assert!(dst.sh_ok("ps -eo args").contains("sleep 1002"), "the refused replace stopped it");
    // The point: its files and processes, in place.
    let body = serde_json::json!({ "source": format!("{}@{point}", src.name) }).to_string();
    let r = common::api("POST", &url, &body);
    assert_eq!(r["point"], point.as_str(), "{r}");
    assert_eq!(state(&dst), "running");
    assert_eq!(dst.sh_ok("cat /tmp/f"), "from-src\n");
    assert_eq!(dst.sh("cat /tmp/g").2, 1, "the replaced sandbox's own file is still there");
    let ps = dst.sh_ok("ps -eo args");
    assert!(ps.contains("sleep 1001") && !ps.contains("sleep 1002"), "{ps}");
    assert_eq!(dst.sh_ok("hostname").trim(), dst.name, "the processes kept the source's hostname");
    let points = json(&["--json", "checkpoints", &dst.name]);
    // Its first point of its own: the source's point (files and processes), in its store.
    let newest = points.as_array().unwrap().last().unwrap().clone();
    assert_eq!(newest["kind"], "full", "{points}");
    dst.sh_ok("echo later > /tmp/f");
    crab_ok(&["restore", &dst.name, newest["id"].as_str().unwrap()]);
    assert_eq!(dst.sh_ok("cat /tmp/f"), "from-src\n");
    // Files only.
    let body = serde_json::json!({ "source": format!("{}@{point}", src.name), "fs_only": true })
        .to_string();
    common::api("POST", &url, &body);
    assert_eq!(dst.sh_ok("cat /tmp/f"), "from-src\n");
    assert!(!dst.sh_ok("ps -eo args").contains("sleep 1001"), "fs_only brought processes");
}

/// The same from a point in the remote store (what Inspect's durable snapshots restore): the
/// point is fetched and checked against the sandbox it replaces before that is touched.
#[test]
fn replace_by_a_remote_point() {
    require_root!();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let store_dir = tmp.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let remote = format!("file://{}", store_dir.display());
    let d = OtherDaemon::start(
        &PathBuf::from("/var/lib").join(unique("crab-life-rremote")),
        &["--pool-size", "4G", "--remote", &remote],
        &[],
    );
    let img = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    d.crab_ok(&["image", "import", "debian", img.to_str().unwrap()]);
    let (src, dst) = (unique("t-rr-src"), unique("t-rr-dst"));
    d.crab_ok(&["sandbox", "create", "debian", "--name", &src]);
    d.crab_ok(&["exec", &src, "--", "sh", "-c", "echo durable > /tmp/f"]);
    let point = d.json(&["checkpoint", &src, "--kind", "fs", "--durable"])["point"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    d.crab_ok(&["sandbox", "create", "debian", "--name", &dst]);
    d.crab_ok(&["exec", &dst, "--", "sh", "-c", "echo mine > /tmp/f"]);
    let call = |body: serde_json::Value| -> serde_json::Value {
        let sock = d.state.join("crab.sock");
        let o = std::process::Command::new("curl")
            .args(["-s", "--unix-socket", sock.to_str().unwrap(), "-X", "POST"])
            .args(["-H", "content-type: application/json", "--data-binary", &body.to_string()])
            .arg(format!("http://crab/v1/sandboxes/{dst}/replace"))
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let o = call(serde_json::json!({ "source": format!("{src}@c999999"), "remote": true }));
    assert!(o["code"].is_string(), "an unknown remote point was accepted: {o}");
    assert_eq!(d.crab_ok(&["exec", &dst, "--", "cat", "/tmp/f"]), "mine\n");
    let r = call(serde_json::json!({ "source": format!("{src}@{point}"), "remote": true }));
    assert_eq!(r["point"], point.as_str(), "{r}");
    assert_eq!(d.crab_ok(&["exec", &dst, "--", "cat", "/tmp/f"]), "durable\n");
    assert_eq!(d.crab_ok(&["exec", &dst, "--", "hostname"]).trim(), dst);
}
