//! Parking (issue 31): `crab sandbox park` stops a running sandbox's processes after a point
//! that holds them (its memory freed) and records it `parked`; anything that needs it running
//! — an exec, a file read, a background-process call — wakes it first (the caller waits, never
//! errors), its processes back as they were; `crab sandbox wake` wakes it alone; a wake whose
//! point is corrupt leaves it stopped with an error naming the point. (Surviving a daemon
//! restart: daemon_restart.rs.) Real daemon, real CRIU (root).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use common::{crab, crab_ok, wait_until, Sandbox};

fn json(args: &[&str]) -> serde_json::Value {
    let out = crab_ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn state(sb: &Sandbox) -> String {
    sb.info()["state"].as_str().unwrap().to_string()
}

fn procs(sb: &Sandbox) -> u64 {
    sb.info()["processes"].as_u64().unwrap()
}

/// A daemon of the test's own that parks by its policy (`--memory-budget 1`: always over
/// budget), its LLM a stub answering after `delay_ms`, with the debian image; `whole`: its
/// `--stream-whole-answers`.
fn policy_daemon(
    rt: &tokio::runtime::Runtime,
    delay_ms: u64,
    tag: &str,
    whole: &str,
) -> (crab_testkit::upstream::StubUpstream, common::OtherDaemon) {
    let stub = rt
        .block_on(crab_testkit::upstream::StubUpstream::start(crab_testkit::upstream::StubConfig {
            delay: std::time::Duration::from_millis(delay_ms),
            ..Default::default()
        }))
        .unwrap();
    let dir = std::path::PathBuf::from("/var/lib").join(common::unique(tag));
    let d = common::OtherDaemon::start(
        &dir,
        &[
            "--pool-size",
            "4G",
            "--memory-budget",
            "1",
            "--upstream-openai",
            &stub.url(),
            "--stream-whole-answers",
            whole,
        ],
        &[],
    );
    let img = crab_common::paths::StateDir::new(common::state_dir()).image_rootfs("debian");
    d.crab_ok(&["image", "import", "debian", img.to_str().unwrap()]);
    (stub, d)
}

/// A counter in a shell loop: its value lives only in that process's memory.
fn start_counter(sb: &Sandbox) {
    sb.sh_ok("nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &");
    assert!(wait_until(5.0, || count(sb) > 2));
}

fn count(sb: &Sandbox) -> u32 {
    sb.sh("cat /tmp/count").0.trim().parse().unwrap_or(0)
}

#[test]
fn an_exec_wakes_a_parked_sandbox_with_its_processes() {
    require_root!();
    let sb = Sandbox::new("t-park-exec");
    start_counter(&sb);
    let l = json(&["--json", "sandbox", "park", &sb.name]);
    assert_eq!(l["state"], "parked", "{l}");
    let point = l["point"].as_str().unwrap().to_string();
    // Parked: no process, in every listing.
    assert_eq!(state(&sb), "parked");
    assert_eq!(procs(&sb), 0, "a parked sandbox kept processes");
    assert!(crab_ok(&["sandbox", "ls"])
        .lines()
        .any(|l| l.starts_with(&sb.name) && l.contains("parked")));
    // Parking again answers the same point.
    let again = json(&["--json", "sandbox", "park", &sb.name]);
    assert_eq!(again["point"], point.as_str());
    // An exec wakes it: the caller gets its answer, the counter goes on from where it was.
    let before = std::fs::read_to_string(
        common::state_dir().join("pool/sandboxes").join(&sb.name).join("sandbox.json"),
    )
    .unwrap();
    assert!(before.contains("parked"), "{before}");
    let (out, _, code) = sb.sh("cat /tmp/count");
    assert_eq!(code, 0, "the exec on a parked sandbox failed");
    let at_wake: u32 = out.trim().parse().unwrap();
    assert_eq!(state(&sb), "running");
    assert!(wait_until(5.0, || count(&sb) > at_wake), "the counter did not come back");
    // Woken from the park point: no new point of its own, and `wake` now has nothing to do.
    let w = json(&["--json", "sandbox", "wake", &sb.name]);
    assert_eq!(w["state"], "running");
    assert!(w["point"].is_null(), "{w}");
    let top = json(&["--json", "top", "--once"]);
    assert!(top["parking"]["wakes"].as_u64().unwrap() >= 1, "{top}");
}

#[test]
fn files_and_background_calls_wake_it_and_wake_does_it_alone() {
    require_root!();
    let sb = Sandbox::new("t-park-files");
    sb.sh_ok("echo kept > /root/f");
    let id = crab_ok(&["exec", "-d", &sb.name, "--", "sleep", "100000"]).trim().to_string();
    crab_ok(&["sandbox", "park", &sb.name]);
    // A file read through the file service (`crab docker cp` out).
    let dir = std::env::temp_dir().join(common::unique("park-cp"));
    std::fs::create_dir_all(&dir).unwrap();
    let dst = dir.join("f");
    let o = crab(&["docker", "cp", &format!("{}:/root/f", sb.name), dst.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(&dst).unwrap(), "kept\n");
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(state(&sb), "running");
    // Parked again: the background process is listed (the call woke it) and still runs.
    crab_ok(&["sandbox", "park", &sb.name]);
    let ps = crab_ok(&["ps", &sb.name]);
    assert!(ps.contains(&id) && ps.contains("running"), "{ps}");
    assert_eq!(state(&sb), "running");
    // `wake` alone.
    crab_ok(&["sandbox", "park", &sb.name]);
    let w = json(&["--json", "sandbox", "wake", &sb.name]);
    assert_eq!(w["state"], "running", "{w}");
    assert!(w["point"].is_string(), "{w}");
    assert!(sb.sh_ok("pgrep -x sleep").trim().parse::<u32>().is_ok());
}

#[test]
fn a_wake_from_a_corrupt_point_leaves_it_stopped_and_says_so() {
    require_root!();
    let sb = Sandbox::new("t-park-corrupt");
    sb.sh_ok("nohup sleep 100000 >/dev/null 2>&1 &");
    let l = json(&["--json", "sandbox", "park", &sb.name]);
    let point = l["point"].as_str().unwrap().to_string();
    let pts = json(&["--json", "checkpoints", &sb.name]);
    let p = pts.as_array().unwrap().iter().find(|p| p["id"] == point.as_str()).unwrap().clone();
    let dir = crab_testkit::criu_images::proc_dir_of(&common::state_dir(), &sb.name, &p);
    crab_testkit::criu_images::corrupt_pages(&dir);
    let o = crab(&["exec", &sb.name, "--", "true"]);
    assert!(!o.status.success(), "an exec ran on a sandbox woken from a corrupt point");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("waking parked sandbox") && err.contains(&point), "{err}");
    assert_eq!(state(&sb), "stopped", "a failed wake left it {}", state(&sb));
    assert_eq!(procs(&sb), 0, "half-restored");
}

#[test]
fn only_a_running_sandbox_parks() {
    require_root!();
    let sb = Sandbox::new("t-park-stopped");
    crab_ok(&["sandbox", "stop", &sb.name]);
    let o = crab(&["sandbox", "park", &sb.name]);
    assert!(!o.status.success(), "a stopped sandbox parked");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot park") && err.contains("stopped"), "{err}");
    let o = crab(&["sandbox", "park", "no-such-sandbox-here"]);
    assert!(!o.status.success());
}

/// With `crab daemon --memory-budget` (1 byte here: always over), the engine parks a sandbox
/// at a turn boundary once its agent has shown waits longer than the wake cost by the margin;
/// it wakes ahead of the expected answer, and an answer that comes first is released only after
/// the wake, so the agent never finds it parked: its next command sees its processes as they
/// were. A `--no-park` sandbox beside it never parks, nor does one running a command through
/// the LLM wait (a client is connected to it: parking would cut the command off).
#[test]
fn the_engine_parks_at_the_turn_boundary_and_the_answer_wakes_it() {
    require_root!();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Whole answers asked of the upstream whole: the wake ahead of the answer, by the waits.
    let (stub, d) = policy_daemon(&rt, 1500, "crab-park-policy", "off");
    let (name, keep) = (common::unique("t-park-llm"), common::unique("t-park-never"));
    let busy = common::unique("t-park-busy");
    d.crab_ok(&["sandbox", "create", "debian", "--name", &name]);
    d.crab_ok(&["sandbox", "create", "debian", "--name", &keep, "--no-park"]);
    d.crab_ok(&["sandbox", "create", "debian", "--name", &busy]);
    for sb in [&name, &keep, &busy] {
        d.crab_ok(&["exec", sb, "--", "sh", "-c",
            "nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &"]);
    }
    let state_of = |sb: &str| -> String {
        let v = d.json(&["sandbox", "ls"]);
        let me = v.as_array().unwrap().iter().find(|s| s["name"] == sb).cloned().unwrap();
        me["state"].as_str().unwrap().to_string()
    };
    let turn = |sb: &str, i: u32| -> std::thread::JoinHandle<std::process::Output> {
        let url = format!("http://127.0.0.1:{}/s/{sb}/v1/chat/completions", d.port);
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"turn {i}"}}]}}"#);
        std::thread::spawn(move || {
            std::process::Command::new("curl")
                .args([
                    "-sS",
                    "-m",
                    "60",
                    "-H",
                    "content-type: application/json",
                    "-d",
                    &body,
                    &url,
                ])
                .output()
                .unwrap()
        })
    };
    // A command that runs through every turn's wait (until the file appears).
    std::thread::scope(|s| {
        let running = s.spawn(|| {
            d.crab(&[
                "exec",
                &busy,
                "--",
                "sh",
                "-c",
                "while [ ! -e /tmp/done ]; do sleep 0.1; done; cat /tmp/count",
            ])
        });
        let mut seen_parked = false;
        for i in 0..6 {
            let (a, b, c) = (turn(&name, i), turn(&keep, i), turn(&busy, i));
            while !a.is_finished() || !c.is_finished() {
                if state_of(&name) == "parked" {
                    seen_parked = true;
                }
                assert_ne!(state_of(&keep), "parked", "a --no-park sandbox parked");
                assert_ne!(state_of(&busy), "parked", "a sandbox running a command parked");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            assert!(c.join().unwrap().status.success());
            let out = a.join().unwrap();
            assert!(
                out.status.success() && String::from_utf8_lossy(&out.stdout).contains("sha256"),
                "turn {i}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(b.join().unwrap().status.success());
            // The answer is out: the sandbox runs, its counter goes on.
            assert_eq!(state_of(&name), "running", "turn {i}: the answer reached a parked sandbox");
            let c = |sb: &str| -> u32 {
                let o = d.crab(&["exec", sb, "--", "cat", "/tmp/count"]);
                String::from_utf8_lossy(&o.stdout).trim().parse().unwrap_or(0)
            };
            let c0 = c(&name);
            assert!(wait_until(5.0, || c(&name) > c0), "turn {i}: the counter stopped");
        }
        assert!(seen_parked, "never parked while its agent waited");
        d.crab_ok(&["exec", &busy, "--", "touch", "/tmp/done"]);
        let out = running.join().unwrap();
        assert!(out.status.success(), "the long command was cut off: {out:?}");
    });
    let top = d.json(&["top", "--once"]);
    let p = &top["parking"];
    // Woken by its answer, or ahead of it (at the expected wait less the wake cost).
    let woke = p["answer_wakes"].as_u64().unwrap() + p["prewakes"].as_u64().unwrap();
    assert!(p["parks"].as_u64().unwrap() >= 1 && woke >= 1, "{p}");
    assert_eq!(p["wake_failures"], 0, "{p}");
    drop(stub);
}

/// Answers that stream on well past their head: the engine parks the sandbox without a wake
/// ahead of the answer (on the first turn too: nothing is known yet, and the stream's end is
/// what waits for the wake) — the head and body flow, the head times the wake so that it
/// overlaps the rest of the stream — and the agent still gets the whole answer with the
/// sandbox running.
#[test]
fn a_streamed_answer_wakes_it_at_its_head() {
    require_root!();
    answers_wake_at_their_head(true);
}

/// The same for answers the agent asks for whole: the daemon, parking, asks the upstream for
/// a stream (`--stream-whole-answers auto`), so the answer's head times the wake just the
/// same, and the agent gets its whole answer, assembled, with the sandbox running.
#[test]
fn a_whole_answer_wakes_it_at_its_head_too() {
    require_root!();
    answers_wake_at_their_head(false);
}

fn answers_wake_at_their_head(stream: bool) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (stub, d) = policy_daemon(&rt, 1200, "crab-park-stream", "auto");
    let name = common::unique("t-park-stream");
    d.crab_ok(&["sandbox", "create", "debian", "--name", &name]);
    d.crab_ok(&["exec", &name, "--", "sh", "-c",
        "nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &"]);
    let url = format!("http://127.0.0.1:{}/s/{name}/v1/chat/completions", d.port);
    let c = |sb: &str| -> u32 {
        let o = d.crab(&["exec", sb, "--", "cat", "/tmp/count"]);
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap_or(0)
    };
    for i in 0..7 {
        let body = format!(
            r#"{{"model":"m","stream":{stream},"messages":[{{"role":"user","content":"turn {i}"}}]}}"#
        );
        // Generated over 1.5 s after the head: far longer than a wake.
        let out = std::process::Command::new("curl")
            .args([
                "-sS",
                "-N",
                "-m",
                "60",
                "-H",
                "content-type: application/json",
                "-H",
                "x-stub-stream-ms: 1500",
                "-d",
                &body,
                &url,
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if stream {
            assert!(out.status.success() && text.contains("[DONE]"), "turn {i}: {text}");
        } else {
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("turn {i}: not a whole answer ({e}): {text}"));
            assert_eq!(v["object"], "chat.completion", "turn {i}: {text}");
            let want = crab_testkit::upstream::stream_text(5);
            assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "turn {i}");
        }
        let v = d.json(&["sandbox", "ls"]);
        let me =
            v.as_array().unwrap().iter().find(|s| s["name"] == name.as_str()).cloned().unwrap();
        assert_eq!(me["state"], "running", "turn {i}: the answer reached a parked sandbox");
        let c0 = c(&name);
        assert!(wait_until(5.0, || c(&name) > c0), "turn {i}: the counter stopped");
    }
    let asked: Vec<serde_json::Value> =
        stub.requests().iter().map(|r| serde_json::from_slice(&r.body).unwrap()).collect();
    assert!(asked.iter().all(|b| b["stream"] == true), "the upstream was asked for streams");
    let top = d.json(&["top", "--once"]);
    let p = &top["parking"];
    assert!(p["head_parks"].as_u64().unwrap() >= 1, "never left a wake to the answer's head: {p}");
    // A wake timed from the head finishes before the end: not every end waited for one.
    assert!(p["answer_wakes"].as_u64().unwrap() < p["head_parks"].as_u64().unwrap(), "{p}");
    assert_eq!(p["wake_failures"], 0, "{p}");
    drop(stub);
}
