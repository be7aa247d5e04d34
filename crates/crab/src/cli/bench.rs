//! `crab bench …`: benchmarks run against the running daemon (built with the `bench` feature;
//! without it the subcommand says how to get it).

use std::process::ExitCode;

use clap::{Args, Subcommand};
use crab_client::Client;
use crab_common::api::ProgressFrame;
use crab_common::paths::StateDir;
use crab_common::ApiError;

use super::print_json;
use crate::output::{table, ProgressDrawer};

#[derive(Debug, Subcommand)]
pub(super) enum BenchCmd {
    /// Replay agent trajectories in real sandboxes with fault injection, all methods side by
    /// side (none, crab, full, fs, chat, restart).
    Replay(ReplayArgs),
    /// LLM proxy overhead per request vs a direct call to a stub upstream, interleaved.
    Proxy {
        /// Measured requests per arm.
        #[arg(long, default_value_t = 2000)]
        iterations: usize,
    },
    /// Exposed latency of 16 simulated agents (trace LLM latencies, simulated checkpoint
    /// costs) through a real proxy and engine.
    Turns {
        /// Concurrent sandboxes.
        #[arg(long, default_value_t = 16)]
        sandboxes: usize,
        /// Turns per sandbox.
        #[arg(long, default_value_t = 8)]
        turns: usize,
        /// Time scale of LLM latencies (1 = recorded).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        /// Directory of traces to draw LLM latencies from.
        #[arg(long, default_value = "../shared/traces/mini-swe-agent")]
        traces: std::path::PathBuf,
    },
    /// Checkpoint (fs, full), in-place restore and a fork of N through the daemon, on a
    /// sandbox running an HTTP server and a counter loop (state checked after each).
    Lifecycle {
        /// Image of the sandboxes.
        #[arg(long, default_value = "debian")]
        image: String,
        /// Measured rounds (fs checkpoint, full checkpoint, restore each).
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        /// Branches of the fork.
        #[arg(long = "fork", default_value_t = 8)]
        fork_count: usize,
        /// Also checkpoint a process holding this many MiB (0 = no).
        #[arg(long, default_value_t = 0)]
        big_mib: usize,
    },
    /// Sandbox create latency and `crab exec true` vs host `true`, side by side.
    Foundation {
        /// Image to create sandboxes from.
        #[arg(long, default_value = "debian")]
        image: String,
        /// Number of sandbox creations.
        #[arg(long, default_value_t = 30)]
        creates: usize,
        /// Number of exec/host pairs.
        #[arg(long, default_value_t = 200)]
        execs: usize,
        /// Also create and exec in `--privileged` sandboxes, interleaved, to measure the
        /// default security profile's cost side by side.
        #[arg(long)]
        privileged: bool,
    },
}

#[derive(Debug, Args)]
pub(super) struct ReplayArgs {
    /// Trajectory files (*.jsonl) or folders of them.
    #[arg(long = "traces", default_value = "examples/traces", num_args = 1.., value_delimiter = ',')]
    traces: Vec<std::path::PathBuf>,
    /// Methods, comma-separated (none is always run as the reference).
    #[arg(long, default_value = "none,crab,full,fs,chat,restart")]
    methods: String,
    /// Concurrent sandboxes.
    #[arg(long, default_value_t = 2)]
    sandboxes: usize,
    /// At most this many trajectories (0 = all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Seed of fault turns and drawn latencies.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// LLM latency: recorded, fixed:SECONDS or scale:FACTOR.
    #[arg(long, default_value = "recorded")]
    llm_latency: String,
    /// Faults per trajectory.
    #[arg(long, default_value_t = 1)]
    faults: usize,
    /// Also kill -9 the daemon at each fault.
    #[arg(long)]
    fault_daemon: bool,
    /// Image of the sandboxes.
    #[arg(long, default_value = "debian")]
    image: String,
    /// Reach the replay LLM through Crab's LLM proxy at this base URL (the daemon's
    /// --upstream-openai must point at the replay LLM, http://127.0.0.1:7439).
    #[arg(long)]
    proxy: Option<String>,
    /// Do not build the stand-in /testbed for SWE-bench trajectories.
    #[arg(long)]
    no_testbed: bool,
    /// Where the replay LLM listens.
    #[arg(long, default_value = "127.0.0.1:7439")]
    llm_listen: std::net::SocketAddr,
    /// Write the JSON report here.
    #[arg(long = "json-out", value_name = "FILE")]
    json_out: Option<std::path::PathBuf>,
    /// Write an SVG chart of the table here.
    #[arg(long, value_name = "FILE")]
    svg: Option<std::path::PathBuf>,
}

pub(super) async fn run(
    client: &Client,
    state: &StateDir,
    b: BenchCmd,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let exe =
        std::env::current_exe().map_err(|e| ApiError::internal(format!("locating crab: {e}")))?;
    match b {
        BenchCmd::Replay(a) => {
            let d = crab_bench::replay::ReplayOptions::default();
            let opts = crab_bench::replay::ReplayOptions {
                traces: a.traces,
                methods: crab_bench::replay::Method::parse_list(&a.methods)?,
                sandboxes: a.sandboxes,
                limit: a.limit,
                seed: a.seed,
                llm_latency: a.llm_latency.parse()?,
                faults: a.faults,
                fault_daemon: a.fault_daemon,
                image: a.image,
                proxy: a.proxy,
                testbed: !a.no_testbed,
                llm_listen: a.llm_listen,
                ..d
            };
            let drawer = ProgressDrawer::new();
            let progress = DrawProgress(&drawer);
            let r = crab_bench::replay::run(&opts, client, &progress).await?;
            drawer.draw(&ProgressFrame::Done { result: serde_json::Value::Null });
            if let Some(path) = &a.json_out {
                let text = serde_json::to_string_pretty(&r)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                std::fs::write(path, text)
                    .map_err(|e| ApiError::internal(format!("writing {}: {e}", path.display())))?;
            }
            if let Some(path) = &a.svg {
                std::fs::write(path, r.svg())
                    .map_err(|e| ApiError::internal(format!("writing {}: {e}", path.display())))?;
            }
            if json {
                print_json(&r);
            } else {
                print!("{}", r.table());
            }
        }
        BenchCmd::Proxy { iterations } => {
            let opts = crab_bench::proxy::ProxyBenchOptions { iterations, ..Default::default() };
            let r = crab_bench::proxy::bench_proxy(opts)
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?;
            if json {
                print_json(&r);
            } else {
                latency_table(
                    &[
                        ("direct", &r.direct),
                        ("proxied (fsync)", &r.proxied),
                        ("proxied (no fsync)", &r.proxied_no_fsync),
                        ("proxied, bounds off", &r.proxied_unbounded),
                    ],
                    3,
                );
                println!(
                    "proxy overhead p50: {:.3} ms (no fsync {:.3} ms); budget {} ms: {}",
                    r.overhead_p50_ms,
                    r.overhead_no_fsync_p50_ms,
                    r.budget_p50_ms,
                    if r.within_budget { "met" } else { "MISSED" }
                );
                println!(
                    "bounded / bounds-off p50 ratio: {:.3} (budget {}x): {}",
                    r.bounds_ratio_p50,
                    r.bounds_budget_ratio,
                    if r.bounds_within_budget { "met" } else { "MISSED" }
                );
            }
        }
        BenchCmd::Turns { sandboxes, turns, time_scale, traces } => {
            let lat = crab_bench::proxy::load_llm_latencies(&traces).unwrap_or_default();
            let opts = crab_bench::proxy::TurnBenchOptions {
                sandboxes,
                turns,
                llm_latency_ms: lat,
                time_scale,
                ..Default::default()
            };
            let r = crab_bench::proxy::bench_turns(opts)
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?;
            if json {
                print_json(&r);
            } else {
                println!(
                    "{} sandboxes x {} turns, {} latency samples, scale {}: exposed p50 {:.1} ms p95 {:.1} ms p99 {:.1} ms max {:.1} ms; held {:.1} % of turns; wall {:.1} s",
                    r.sandboxes, r.turns, r.latency_samples, r.time_scale, r.exposed.p50, r.exposed.p95, r.exposed.p99, r.exposed.max,
                    100.0 * r.held_fraction, r.wall_s
                );
            }
        }
        BenchCmd::Lifecycle { image, rounds, fork_count, big_mib } => {
            eprintln!("bench lifecycle: {rounds} rounds, a fork of {fork_count} ...");
            let opts =
                crab_bench::lifecycle::LifecycleOptions { image, rounds, fork_count, big_mib };
            let r = crab_bench::lifecycle::run(client, &opts).await?;
            if json {
                print_json(&r);
            } else {
                latency_table(
                    &[
                        ("checkpoint fs", &r.checkpoint_fs_ms),
                        ("checkpoint full", &r.checkpoint_full_ms),
                        ("restore (full point)", &r.restore_ms),
                    ],
                    1,
                );
                println!(
                    "full point: {} bytes; fork of {}: {:.1} ms",
                    r.full_point_bytes, fork_count, r.fork_ms
                );
                if let Some(b) = r.big_full_ms {
                    println!("full checkpoint of a {big_mib} MiB process: {b:.1} ms");
                }
            }
        }
        BenchCmd::Foundation { image, creates, execs, privileged } => {
            eprintln!("bench foundation: {creates} creates, {execs} exec/host pairs ...");
            let r = crab_bench::foundation::run(
                client,
                &exe,
                state.root(),
                &image,
                creates,
                execs,
                privileged,
            )
            .await?;
            if json {
                print_json(&r);
            } else {
                latency_table(
                    &[
                        ("sandbox create", &r.create_ms),
                        ("crab exec true", &r.exec_true_ms),
                        ("host true", &r.host_true_ms),
                    ],
                    2,
                );
                println!("exec overhead over host (p50): {:.2} ms", r.exec_overhead_p50_ms);
                if let Some(p) = &r.privileged {
                    latency_table(
                        &[
                            ("create --privileged", &p.create_ms),
                            ("exec true --privileged", &p.exec_true_ms),
                        ],
                        2,
                    );
                    println!(
                        "default profile vs --privileged (p50): create {:.3}x, exec {:+.2} ms",
                        p.create_ratio_p50, p.exec_delta_p50_ms
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

struct DrawProgress<'a>(&'a ProgressDrawer);

impl crab_common::Progress for DrawProgress<'_> {
    fn stage(&self, name: &str, total: Option<u64>) {
        self.0.draw(&ProgressFrame::Stage { name: name.to_string(), total });
    }
    fn advance(&self, done: u64) {
        self.0.draw(&ProgressFrame::Advance { done });
    }
    fn message(&self, line: &str) {
        self.0.draw(&ProgressFrame::Message { line: line.to_string() });
    }
}

/// A table of latency summaries (ms) with `decimals` digits.
fn latency_table(rows: &[(&str, &crab_common::stats::Summary)], decimals: usize) {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|(name, s)| {
            let f = |v: f64| format!("{v:.decimals$}");
            vec![name.to_string(), s.n.to_string(), f(s.p50), f(s.p95), f(s.p99)]
        })
        .collect();
    table(&["MEASURE (ms)", "N", "P50", "P95", "P99"], &rows);
}
