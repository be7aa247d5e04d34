//! A small replay against the real daemon (root): three bundled trajectories (an in-memory HTTP
//! counter service, a sqlite app, a python REPL in a persistent shell), one fault each, every
//! method, latency scaled to 5 %. Asserts what the replay benchmark exists to show: `crab` and
//! `full` recover correctly every time, `chat` does not on the service trajectory, `crab` writes
//! fewer checkpoint bytes than `full`, and the JSON report has every field.
//!
//! The daemon is the one on `$CRAB_STATE_DIR` (default `/var/lib/crab`); when none answers, the
//! workspace's `target/debug/crab` (or `$CRAB_BIN`) is started.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crab_bench::replay::{self, LlmLatency, Method, ReplayOptions};
use crab_client::Client;
use crab_common::NoProgress;

fn state_dir() -> PathBuf {
    PathBuf::from(std::env::var("CRAB_STATE_DIR").unwrap_or_else(|_| "/var/lib/crab".into()))
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

async fn ensure_daemon(client: &Client) {
    if replay::sandbox::version(client).await.is_ok() {
        return;
    }
    let bin = std::env::var("CRAB_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace().join("target/debug/crab"));
    std::fs::create_dir_all(state_dir().join("logs")).unwrap();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state_dir().join("logs/daemon.log"))
        .unwrap();
    let status = Command::new("setsid")
        .arg("-f")
        .arg(&bin)
        .args(["daemon", "--state-dir", state_dir().to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .status()
        .expect("start the daemon");
    assert!(status.success(), "starting {} failed", bin.display());
    let start = Instant::now();
    while replay::sandbox::version(client).await.is_err() {
        assert!(start.elapsed() < Duration::from_secs(30), "the daemon did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bundled_replay_with_faults() {
    let client = Client::new(state_dir().join("crab.sock"));
    ensure_daemon(&client).await;
    let traces = workspace().join("examples/traces");
    let opts = ReplayOptions {
        traces: ["counter-server", "sqlite-notes", "python-repl"]
            .iter()
            .map(|t| traces.join(format!("{t}.jsonl")))
            .collect(),
        methods: Method::ALL.to_vec(),
        sandboxes: 2,
        seed: 1,
        llm_latency: LlmLatency::Scale(0.05),
        faults: 1,
        llm_listen: "127.0.0.1:0".parse().unwrap(),
        ..ReplayOptions::default()
    };
    let report = replay::run(&opts, &client, &NoProgress).await.expect("replay");
    let table = report.table();
    let errors: Vec<_> = report.trials.iter().filter_map(|t| t.error.as_ref()).collect();
    assert!(errors.is_empty(), "runs failed: {errors:#?}\n{table}");

    let row = |m: Method| report.method(m).unwrap_or_else(|| panic!("no row for {m}\n{table}"));
    for m in [Method::Crab, Method::Full] {
        let r = row(m);
        let wrong: Vec<_> = report
            .trials
            .iter()
            .filter(|t| t.method == m && t.correct == Some(false))
            .map(|t| (&t.trajectory, &t.diff))
            .collect();
        assert_eq!(r.trials, 3, "{table}");
        assert_eq!(r.correct_pct, 100.0, "{m} recovered wrongly: {wrong:#?}\n{table}");
    }
    let chat_service = report
        .trials
        .iter()
        .find(|t| {
            t.method == Method::Chat
                && t.pass == "fault"
                && t.trajectory.ends_with("counter-server")
        })
        .expect("the chat trial of the service trajectory");
    assert_eq!(chat_service.correct, Some(false), "chat recovered the service?\n{table}");
    assert!(
        row(Method::Crab).checkpoint_bytes < row(Method::Full).checkpoint_bytes,
        "crab wrote no fewer checkpoint bytes than full\n{table}"
    );
    assert_eq!(row(Method::Restart).correct_pct, 100.0, "{table}");

    let json = serde_json::to_value(&report).unwrap();
    assert!(!json["trace_sources"].as_array().unwrap().is_empty());
    let methods = json["methods"].as_array().unwrap();
    assert_eq!(methods.len(), 6);
    for m in methods {
        for k in [
            "method",
            "trials",
            "correct",
            "correct_pct",
            "wall_ratio_vs_none",
            "overhead_no_fault_ratio",
            "checkpoints",
            "checkpoint_bytes",
            "exposed_ms",
            "restore_ms",
        ] {
            assert!(m.get(k).is_some(), "field {k} missing in {m}");
        }
        for k in ["skip", "fs", "process", "full"] {
            assert!(m["checkpoints"][k].is_u64(), "checkpoints.{k} missing in {m}");
        }
        for k in ["p50", "p95", "p99"] {
            assert!(m["exposed_ms"].get(k).is_some(), "exposed_ms.{k} missing in {m}");
        }
        for k in ["p50", "p95"] {
            assert!(m["restore_ms"].get(k).is_some(), "restore_ms.{k} missing in {m}");
        }
        if m["method"] != "none" {
            assert!(m["restore_ms"]["p50"].is_f64(), "no restore time for {}", m["method"]);
        }
    }
    let svg = report.svg().expect("the chart draws");
    // plotters writes a text element's content on its own line.
    let flat: String = svg.lines().map(str::trim).collect();
    assert!(svg.starts_with("<svg") && flat.contains(">crab</text>"), "no crab series label");
}
