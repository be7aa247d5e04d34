//! `crab top`: live per-sandbox view of turns, verdicts, held time and the engine queue, and
//! where the agents' waits went (the exposed-latency breakdown, stage by stage).

use std::process::ExitCode;

use clap::Args;
use crab_client::{Client, Method};
use crab_common::ApiError;

use super::print_json;
use crate::output::table;

#[derive(Debug, Args)]
pub(super) struct TopArgs {
    /// Refresh interval in seconds.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Print one snapshot and exit.
    #[arg(long)]
    once: bool,
}

pub(super) async fn run(client: &Client, a: TopArgs, json: bool) -> Result<ExitCode, ApiError> {
    let TopArgs { interval, once } = a;
    loop {
        let v: serde_json::Value = client.call::<(), _>(Method::GET, "/v1/top", None).await?;
        if json {
            print_json(&v);
        } else {
            if !once {
                print!("\x1b[2J\x1b[H");
            }
            let e = &v["engine"];
            println!(
                "engine: {} urgent, {} normal queued; {} running ({} dumps); exports: {} running, {} waiting, {} paused for urgent work",
                e["queued_urgent"],
                e["queued_normal"],
                e["running"],
                e["running_dumps"],
                e["background_running"].as_u64().unwrap_or(0),
                e["background_waiting"].as_u64().unwrap_or(0),
                e["background_yields"].as_u64().unwrap_or(0)
            );
            let mut rows = Vec::new();
            let empty = Vec::new();
            for p in v["proxy"].as_array().unwrap_or(&empty) {
                let name = p["sandbox"].as_str().unwrap_or("");
                let view =
                    e["sandboxes"].as_array().and_then(|a| a.iter().find(|s| s["sandbox"] == name));
                let mix = view
                    .map(|s| {
                        let sub = &s["stats"]["submitted"];
                        ["skip", "fs", "process", "full"]
                            .iter()
                            .map(|k| sub[k].as_u64().unwrap_or(0).to_string())
                            .collect::<Vec<_>>()
                            .join("/")
                    })
                    .unwrap_or_else(|| "-".into());
                let queue = view
                    .map(|s| {
                        let q = s["queued"].as_str().unwrap_or("-");
                        let r = s["running"].as_str().unwrap_or("-");
                        format!("{q}/{r}")
                    })
                    .unwrap_or_else(|| "-/-".into());
                rows.push(vec![
                    name.to_string(),
                    p["turns"].to_string(),
                    mix,
                    format!("{}", p["held"]),
                    format!("{:.1}", p["held_ms_total"].as_f64().unwrap_or(0.0)),
                    format!("{:.1}", p["held_ms_max"].as_f64().unwrap_or(0.0)),
                    queue,
                    p["checkpoint_failures"].to_string(),
                ]);
            }
            table(
                &[
                    "SANDBOX",
                    "TURNS",
                    "SKIP/FS/PROC/FULL",
                    "HELD",
                    "HELD MS",
                    "MAX MS",
                    "QUEUED/RUNNING",
                    "FAILED",
                ],
                &rows,
            );
            // Where the agents' waits went (newest turns, every sandbox): per stage.
            let stages = v["held_stages"].as_array().cloned().unwrap_or_default();
            if !stages.is_empty() {
                println!();
                let f = |x: &serde_json::Value| format!("{:.2}", x.as_f64().unwrap_or(f64::NAN));
                let rows: Vec<Vec<String>> = stages
                    .iter()
                    .map(|s| {
                        vec![
                            s["stage"].as_str().unwrap_or("").to_string(),
                            s["turns"].to_string(),
                            f(&s["ms"]["p50"]),
                            f(&s["ms"]["p95"]),
                            f(&s["ms"]["p99"]),
                            format!("{:.1}", s["total_ms"].as_f64().unwrap_or(0.0)),
                            format!("{:.0}%", 100.0 * s["share"].as_f64().unwrap_or(0.0)),
                        ]
                    })
                    .collect();
                table(
                    &["HELD BY", "TURNS", "P50 MS", "P95 MS", "P99 MS", "TOTAL MS", "SHARE"],
                    &rows,
                );
            }
            // Parking: how many are parked, and what waking them cost.
            let pk = &v["parking"];
            if pk.is_object()
                && (pk["parks"].as_u64().unwrap_or(0) > 0 || pk["parked"].as_u64().unwrap_or(0) > 0)
            {
                let f = |x: &serde_json::Value| format!("{:.1}", x.as_f64().unwrap_or(f64::NAN));
                let mib = pk["freed_bytes"].as_u64().unwrap_or(0) as f64 / 1048576.0;
                println!(
                    "\nparked {} ({mib:.0} MiB freed)  parks {}  wakes {} (failed {})  wake ms p50 {} p95 {}",
                    pk["parked"],
                    pk["parks"],
                    pk["wakes"],
                    pk["wake_failures"],
                    f(&pk["wake_ms"]["p50"]),
                    f(&pk["wake_ms"]["p95"]),
                );
                println!(
                    "wakes ahead of the answer {}  parks waking at the answer's head {}  answers held for a wake {}",
                    pk["prewakes"], pk["head_parks"], pk["answer_wakes"],
                );
                if let Some(d) = pk["declined"].as_object().filter(|d| !d.is_empty()) {
                    let why: Vec<String> = d.iter().map(|(k, n)| format!("{k} {n}")).collect();
                    println!("turn boundaries left running: {}", why.join("  "));
                }
            }
        }
        if once {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(std::time::Duration::from_secs_f64(interval.max(0.1))).await;
    }
}
