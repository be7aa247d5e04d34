//! End-to-end checkpoint, restore and fork through the real CLI, daemon and CRIU (root).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use common::{cgroup_parent, crab, crab_ok, wait_until, Sandbox};

use common::COUNTER_PY as COUNTER;

fn start_counter(sb: &Sandbox) {
    let script = COUNTER.replace('\'', "'\\''");
    sb.sh_ok(&format!("printf '%s' '{script}' > /root/counter.py"));
    sb.sh_ok("cd /root && nohup python3 counter.py >/dev/null 2>&1 &");
    // Probe with a bare TCP connect: every GET would count.
    let listening = || sb.sh("bash -c 'exec 3<>/dev/tcp/127.0.0.1/9000'").2 == 0;
    assert!(wait_until(10.0, listening), "counter did not start");
}

fn hit(sb: &Sandbox) -> String {
    sb.sh("curl -sf localhost:9000").0
}

fn checkpoint(sb: &Sandbox, kind: &str) -> serde_json::Value {
    let out = crab_ok(&["--json", "checkpoint", &sb.name, "--kind", kind]);
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["point"].clone()
}

#[test]
fn counter_survives_checkpoint_kill_restore() {
    let sb = Sandbox::new("t-ck-counter");
    start_counter(&sb);
    assert_eq!(hit(&sb), "1");
    assert_eq!(hit(&sb), "2");
    let p = checkpoint(&sb, "full");
    assert_eq!(p["kind"], "full");
    assert_eq!(hit(&sb), "3");
    // kill -9 every process of the sandbox (its init too, through the cgroup).
    let pids = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/unified/{}/{}/cgroup.procs",
        cgroup_parent(),
        sb.name
    ))
    .unwrap();
    for pid in pids.lines() {
        let _ = std::process::Command::new("kill").args(["-9", pid]).status();
    }
    assert!(wait_until(5.0, || sb.info()["state"] == "dead"));
    crab_ok(&["restore", &sb.name]);
    assert_eq!(sb.info()["state"], "running");
    // The in-memory count is the one at the checkpoint.
    assert_eq!(hit(&sb), "3");
}

#[test]
fn rollback_restores_files() {
    let sb = Sandbox::new("t-ck-files");
    sb.sh_ok("echo keep > /root/keep && echo gone > /root/deleted-later");
    let p = checkpoint(&sb, "auto");
    let id = p["id"].as_str().unwrap().to_string();
    sb.sh_ok(
        "echo new > /root/created-later && rm /root/deleted-later && echo changed > /root/keep",
    );
    checkpoint(&sb, "auto");
    crab_ok(&["restore", &sb.name, &id]);
    assert_eq!(sb.sh_ok("cat /root/keep /root/deleted-later"), "keep\ngone\n");
    assert_ne!(
        sb.sh("test -e /root/created-later").2,
        0,
        "a file created after the point survived"
    );
    // The list shows the points, newest last.
    let list: Vec<serde_json::Value> =
        serde_json::from_str(&crab_ok(&["--json", "checkpoints", &sb.name])).unwrap();
    assert!(list.len() >= 2);
    assert!(list.iter().any(|p| p["id"] == id.as_str()));
}

#[test]
fn forks_diverge() {
    let sb = Sandbox::new("t-ck-fork");
    start_counter(&sb);
    assert_eq!(hit(&sb), "1");
    let p = checkpoint(&sb, "full");
    let out = crab_ok(&["--json", "fork", &sb.name, p["id"].as_str().unwrap(), "--count", "3"]);
    let branches: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(branches.len(), 3);
    let forks: Vec<Sandbox> =
        branches.iter().map(|b| Sandbox { name: b["sandbox"].as_str().unwrap().into() }).collect();
    let mut ids = std::collections::HashSet::new();
    for (i, f) in forks.iter().enumerate() {
        // Each branch serves from the restored count and diverges independently.
        for _ in 0..i {
            hit(f);
        }
        assert_eq!(hit(f), (2 + i).to_string(), "branch {}", f.name);
        ids.insert(f.sh_ok("cat /etc/machine-id; hostname"));
    }
    assert_eq!(ids.len(), 3, "branches share a machine-id or hostname");
    assert_eq!(hit(&sb), "2", "the source sandbox was affected by its forks");
    // A second unnamed fork of the same point picks names the first did not take.
    let out = crab_ok(&["--json", "fork", &sb.name, p["id"].as_str().unwrap(), "--count", "2"]);
    let again: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let again: Vec<Sandbox> =
        again.iter().map(|b| Sandbox { name: b["sandbox"].as_str().unwrap().into() }).collect();
    assert_eq!(again.len(), 2);
    for a in &again {
        assert!(forks.iter().all(|f| f.name != a.name), "{} reused a branch name", a.name);
        assert_eq!(hit(a), "2", "branch {}", a.name);
    }
}

#[test]
fn corrupt_image_file_is_refused() {
    let sb = Sandbox::new("t-ck-corrupt");
    sb.sh_ok("nohup sleep 100000 >/dev/null 2>&1 &");
    let p = checkpoint(&sb, "full");
    let dir = crab_testkit::criu_images::proc_dir_of(&common::state_dir(), &sb.name, &p);
    let img = crab_testkit::criu_images::corrupt_pages(&dir);
    sb.sh_ok("echo after > /root/after");
    let o = crab(&["restore", &sb.name]);
    assert!(!o.status.success(), "a corrupt checkpoint was restored");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(img.file_name().unwrap().to_str().unwrap()), "{err}");
    // The sandbox is left as it was.
    assert_eq!(sb.sh_ok("cat /root/after"), "after\n");
    assert_eq!(sb.info()["state"], "running");
}

#[test]
fn fs_only_point_restores_with_fresh_processes() {
    let sb = Sandbox::new("t-ck-fsonly");
    sb.sh_ok("echo data > /root/f");
    let p = checkpoint(&sb, "fs");
    assert_eq!(p["kind"], "fs");
    sb.sh_ok("rm /root/f");
    let out = crab_ok(&["--json", "restore", &sb.name]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(sb.sh_ok("cat /root/f"), "data\n");
    assert_eq!(sb.info()["state"], "running");
    let _ = r;
}

#[test]
fn unknown_names_get_clear_errors() {
    common::ensure_daemon();
    let o = crab(&["restore", "no-such-sandbox"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no sandbox named"));
    let sb = Sandbox::new("t-ck-unknown");
    let o = crab(&["restore", &sb.name]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no restore points"), "{:?}", o);
    let o = crab(&["restore", &sb.name, "c999"]);
    assert!(!o.status.success());
    let o = crab(&["checkpoint", &sb.name, "--kind", "bogus"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown checkpoint kind"));
}

/// The newest restore point's kind and how many points `sb` has.
fn points(sb: &Sandbox) -> (usize, String) {
    let v: serde_json::Value =
        serde_json::from_str(&crab_ok(&["--json", "checkpoints", &sb.name])).unwrap();
    let v = v.as_array().unwrap().clone();
    let kind = v.last().map(|p| p["kind"].as_str().unwrap().to_string()).unwrap_or_default();
    (v.len(), kind)
}

/// A raw API call on the daemon's socket: (HTTP status, body).
fn api(method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let sock = common::state_dir().join("crab.sock");
    let out = std::process::Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "--unix-socket"])
        .arg(&sock)
        .args(["-X", method, "-H", "content-type: application/json", "-d", body])
        .arg(format!("http://crab{path}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), serde_json::from_str(body).unwrap_or_default())
}

#[test]
fn checkpoint_policy_decides_what_each_turn_takes() {
    let sb = Sandbox::with_args("t-ck-policy", &["--checkpoint-policy", "none"]);
    assert_eq!(sb.info()["checkpoint_policy"], "none");
    let ls = crab_ok(&["sandbox", "ls"]);
    let row = ls.lines().find(|l| l.starts_with(&sb.name)).unwrap();
    assert!(row.trim_end().ends_with("none"), "{ls}");
    // none: a turn boundary takes nothing and answers at once.
    sb.sh_ok("echo one > /root/f");
    let out = crab_ok(&["turn", &sb.name]);
    assert!(out.contains("no checkpoint"), "{out}");
    assert_eq!(points(&sb).0, 0);
    // fs: a filesystem snapshot every turn, also when nothing changed.
    let out = crab_ok(&["sandbox", "update", &sb.name, "--checkpoint-policy", "fs"]);
    assert!(out.contains("checkpoint policy fs"), "{out}");
    assert_eq!(sb.info()["checkpoint_policy"], "fs");
    crab_ok(&["turn", &sb.name]);
    crab_ok(&["turn", &sb.name]);
    assert_eq!(points(&sb), (2, "fs".into()));
    // full: files and processes every turn.
    crab_ok(&["sandbox", "update", &sb.name, "--checkpoint-policy", "full"]);
    crab_ok(&["turn", &sb.name]);
    assert_eq!(points(&sb), (3, "full".into()));
    // Back to auto from fs: the next checkpoint is full (the newest process image may be
    // stale), whatever the verdict.
    crab_ok(&["sandbox", "update", &sb.name, "--checkpoint-policy", "fs"]);
    crab_ok(&["sandbox", "update", &sb.name, "--checkpoint-policy", "auto"]);
    crab_ok(&["turn", &sb.name]);
    assert_eq!(points(&sb), (4, "full".into()));
    crab_ok(&["turn", &sb.name]);
    assert_eq!(points(&sb), (5, "skip".into()), "nothing changed: the verdict decides again");

    // Bad values are refused naming the field and the accepted values, and change nothing.
    let (code, e) =
        api("PATCH", &format!("/v1/sandboxes/{}", sb.name), r#"{"checkpoint_policy":"often"}"#);
    assert_eq!(code, 400, "{e}");
    let msg = format!("{} {}", e["message"], e["hint"]);
    assert!(msg.contains("checkpoint_policy") && msg.contains("auto, full, fs or none"), "{msg}");
    assert_eq!(sb.info()["checkpoint_policy"], "auto");
    let name = common::unique("t-ck-policy-bad");
    let body = format!(r#"{{"image":"debian","name":"{name}","checkpoint_policy":"process"}}"#);
    let (code, e) = api("POST", "/v1/sandboxes", &body);
    assert_eq!(code, 400, "{e}");
    let msg = format!("{} {}", e["message"], e["hint"]);
    assert!(msg.contains("checkpoint_policy") && msg.contains("auto, full, fs or none"), "{msg}");
    assert!(!crab(&["sandbox", "inspect", &name]).status.success(), "no sandbox was created");
    // The record keeps the policy (since format 2), and a daemon reading it sees it.
    let rec = crab_common::paths::StateDir::new(common::state_dir()).sandbox_record(&sb.name);
    let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(&rec).unwrap()).unwrap();
    assert_eq!(rec["format"], crab_sandbox::runtime::RECORD_FORMAT);
    assert_eq!(rec["checkpoint_policy"], "auto");
}

/// The `==> STAGE` lines `crab` drew on a non-terminal stderr.
fn stage_lines(o: &std::process::Output) -> Vec<String> {
    let err = String::from_utf8_lossy(&o.stderr);
    err.lines().filter_map(|l| l.strip_prefix("==> ")).map(str::to_string).collect()
}

/// `crab restore` and `crab fork` draw the stages the daemon streams (asked with
/// `?progress=true`): on a stderr that is not a terminal, a line per stage; under `--json`
/// nothing is drawn and the answer is the same document as the plain API call's, which clients
/// that do not ask for progress (the SDK, scripts) still get as one JSON answer.
#[test]
fn restore_and_fork_report_their_stages() {
    let sb = Sandbox::new("t-ck-progress");
    let p = checkpoint(&sb, "full");
    let id = p["id"].as_str().unwrap();

    let o = crab(&["restore", &sb.name, id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(stage_lines(&o), ["verify", "filesystem", "processes"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with(&format!("restored {} to {id} in ", sb.name)), "{out}");

    let o = crab(&["--json", "restore", &sb.name, id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stage_lines(&o).is_empty(), "--json draws nothing");
    let cli: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (code, plain) = api(
        "POST",
        &format!("/v1/sandboxes/{}/restore", sb.name),
        &format!(r#"{{"checkpoint":"{id}"}}"#),
    );
    assert_eq!(code, 200, "{plain}");
    let keys = |v: &serde_json::Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&cli), keys(&plain), "the same document either way");
    assert_eq!((&cli["sandbox"], &cli["point"]), (&plain["sandbox"], &plain["point"]));
    assert_eq!(cli["processes_restored"], true);

    let o = crab(&["fork", &sb.name, id, "--count", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let forks: Vec<Sandbox> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| Sandbox { name: l.trim().to_string() })
        .collect();
    assert_eq!(forks.len(), 2, "{}", String::from_utf8_lossy(&o.stdout));
    assert_eq!(stage_lines(&o), ["verify", "branches"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("    2/2"), "one step per branch up");
    for f in &forks {
        assert_eq!(f.info()["state"], "running", "{}", f.name);
    }

    // The stream itself: NDJSON frames, the stages, then `done` with the answer.
    let sock = common::state_dir().join("crab.sock");
    let out = std::process::Command::new("curl")
        .args(["-s", "--unix-socket"])
        .arg(&sock)
        .args(["-X", "POST", "-H", "content-type: application/json"])
        .args(["-d", &format!(r#"{{"checkpoint":"{id}"}}"#)])
        .arg(format!("http://crab/v1/sandboxes/{}/restore?progress=true", sb.name))
        .output()
        .unwrap();
    let frames: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let stages: Vec<&str> =
        frames.iter().filter(|f| f["t"] == "stage").map(|f| f["name"].as_str().unwrap()).collect();
    assert_eq!(stages, ["verify", "filesystem", "processes"]);
    let last = frames.last().unwrap();
    assert_eq!(last["t"], "done", "{last}");
    assert_eq!(keys(&last["result"]), keys(&plain));
    // A failure arrives as the stream's last frame, with its code.
    let (_, e) = api("POST", "/v1/sandboxes/no-such-sandbox/restore?progress=true", "{}");
    assert_eq!(e["t"], "error", "{e}");
    assert_eq!(e["error"]["code"], "sandbox_not_found", "{e}");
}
