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
        /// Run the same rounds on a `--privileged` twin, interleaved, to measure what the
        /// default security profile costs checkpoints and restores.
        #[arg(long)]
        privileged: bool,
    },
    /// The e2b SDK through the daemon's E2B API (`Sandbox.create` + `commands.run("true")` +
    /// `kill`) vs the same through the crab CLI, interleaved; create-from-snapshot and
    /// fork(8). Needs a daemon with --e2b-listen and the SDK venv
    /// (scripts/install-test-servers.sh).
    E2b {
        /// The daemon's E2B API.
        #[arg(long, env = "CRAB_E2B_LISTEN", default_value = "127.0.0.1:3000")]
        listen: String,
        /// An API key whose digest is in the daemon's --e2b-keys.
        #[arg(long, env = "E2B_API_KEY")]
        key: String,
        /// Rounds of each arm.
        #[arg(long, default_value_t = 20)]
        rounds: usize,
        /// Rounds of the restore paths (create from snapshot, fork of 8).
        #[arg(long, default_value_t = 3)]
        fork_rounds: usize,
        /// Image (E2B template) to create from.
        #[arg(long, default_value = "debian")]
        image: String,
        /// Python with the `e2b` SDK.
        #[arg(long, default_value = "/opt/crab/test-servers/venv/bin/python")]
        python: std::path::PathBuf,
    },
    /// Bytes the durable tier uploads for real trajectories: turn-aware points through the
    /// content-addressed store (`crab`) vs a `full` point every turn through the same store
    /// (`full-dedup`) vs that point uploaded whole as tar + zstd (`full-export`), in one run;
    /// and the export rate vs the turn rate of N agents.
    Remote {
        /// Trajectory files (*.jsonl) or folders of them.
        #[arg(long, num_args = 1.., default_value = "../shared/traces/mini-swe-agent")]
        traces: Vec<std::path::PathBuf>,
        /// At most this many trajectories (0 = all).
        #[arg(long, default_value_t = 4)]
        limit: usize,
        /// Concurrent sandboxes.
        #[arg(long, default_value_t = 8)]
        sandboxes: usize,
        /// Image of the sandboxes.
        #[arg(long, default_value = "debian")]
        image: String,
        /// New location for the two repositories (`<url>/crab`, `<url>/full`): `file:///dir`
        /// or `s3://bucket/prefix` (AWS_* variables). Default: a fresh directory under
        /// /var/tmp, deleted afterwards.
        #[arg(long)]
        remote: Option<String>,
        /// Do not build the stand-in /testbed for SWE-bench trajectories.
        #[arg(long)]
        no_testbed: bool,
    },
    /// The verdict mix of an agent running inside its sandbox (a scripted stand-in for
    /// mini-swe-agent there: a Python process keeping its conversation in memory and running
    /// each command of the trajectories in a fresh bash), with and without `--harness-cmd`
    /// naming it, side by side on the same turns (`POST .../turns` at each boundary).
    HarnessAgent {
        /// Trajectory files (*.jsonl) or folders of them.
        #[arg(long, num_args = 1.., value_delimiter = ',', default_value = "../shared/traces/mini-swe-agent")]
        traces: Vec<std::path::PathBuf>,
        /// At most this many trajectories (0 = all).
        #[arg(long, default_value_t = 4)]
        limit: usize,
        /// At most this many turns of each (0 = all).
        #[arg(long, default_value_t = 0)]
        max_turns: usize,
        /// Image of the sandboxes.
        #[arg(long, default_value = "debian")]
        image: String,
    },
    /// Restore from the durable tier vs a local restore of the same point, in one run: local
    /// in-place restore and forks on a host of its own, `sandbox create --from-remote` and
    /// `fork --from-remote --count N` on fresh hosts (cold cache) from a `file://` remote and
    /// from a SeaweedFS S3 server it starts on loopback (scripts/s3-test-server.sh).
    RemoteRestore {
        /// Image of the sandbox (from the running daemon's state directory).
        #[arg(long, default_value = "debian")]
        image: String,
        /// Rounds of the restore and create arms.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Rounds of the fork arms.
        #[arg(long, default_value_t = 3)]
        fork_rounds: usize,
        /// Branches of a fork.
        #[arg(long = "fork", default_value_t = 8)]
        fork_count: usize,
        /// MiB of touched memory held by the sandbox's process.
        #[arg(long, default_value_t = 10)]
        mib: usize,
        /// The S3 test server script (default: scripts/s3-test-server.sh of the checkout).
        #[arg(long)]
        s3_script: Option<std::path::PathBuf>,
        /// Measure only receiving hosts that have the image (skip the bare ones, which
        /// download the whole tree: tens of seconds per call).
        #[arg(long)]
        no_bare: bool,
        /// A `crab` binary of an earlier build (with its `crab-nsexec` beside it): the S3
        /// receiving hosts with the image also run it, interleaved, for a before/after.
        #[arg(long)]
        baseline_bin: Option<std::path::PathBuf>,
    },
    /// E2B's `/health` for one sandbox with 1 sandbox on the host vs N, beside what the old
    /// front door asked the host for the same answer (every sandbox listed). Needs a daemon
    /// with --e2b-listen and no sandboxes.
    E2bHealth {
        /// Image to create sandboxes from.
        #[arg(long, default_value = "debian")]
        image: String,
        /// Sandboxes in the "many" arm.
        #[arg(long, default_value_t = 64)]
        sandboxes: usize,
        /// Calls per series.
        #[arg(long, default_value_t = 300)]
        calls: usize,
        /// The daemon's E2B address.
        #[arg(long, env = "CRAB_E2B_LISTEN", default_value = "127.0.0.1:3000")]
        e2b: String,
    },
    /// Parking's density (issue 31, `--memory`): sandboxes holding a resident process replay
    /// real trajectories' LLM latencies on a daemon of the bench's own, with no parking, an
    /// E2B-style idle timer, and Crab's turn-boundary parking side by side: memory (mean,
    /// peak, sandboxes per GiB), the agent-visible overhead per turn, wall time, correctness,
    /// restore-point bytes, and the least memory a wake from the answer's head allows.
    Density {
        /// Measure memory density with parking (the only density measured here; the exposed
        /// latency at 1–32 sandboxes is scripts/bench-density.sh).
        #[arg(long)]
        memory: bool,
        /// Trajectories with LLM latencies (mini-swe-agent's).
        #[arg(long, default_value = "../shared/traces/mini-swe-agent")]
        traces: Vec<std::path::PathBuf>,
        /// Sandboxes per mode.
        #[arg(long, default_value_t = 6)]
        sandboxes: usize,
        /// Turns replayed per sandbox.
        #[arg(long, default_value_t = 8)]
        turns: usize,
        /// LLM latency scales, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,0.25")]
        llm_scale: Vec<f64>,
        /// Resident memory of each sandbox's process, MiB.
        #[arg(long, default_value_t = 200)]
        resident_mb: u64,
        /// The timer baseline's idle time before it parks a sandbox, s.
        #[arg(long, default_value_t = 10.0)]
        idle_s: f64,
        /// Answers stream (SSE): each turn's recorded latency splits into the time to the
        /// first byte and the generation of its output (the step's thought and action, four
        /// characters a token, at --stream-tps).
        #[arg(long)]
        stream: bool,
        /// Tokens per second an answer is generated at: a streamed one spreads its output
        /// over that time after its head; a whole one comes after its head and that time.
        #[arg(long, default_value_t = 50.0)]
        stream_tps: f64,
        /// The bench daemon's `--stream-whole-answers`: `auto` (on: it parks) or `off` (whole
        /// answers asked of the stub whole).
        #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
        stream_whole_answers: String,
        /// Image of the sandboxes.
        #[arg(long, default_value = "debian")]
        image: String,
        /// Also write each mode's raw figures to this directory, for analysing the policy:
        /// `MODE-SCALE.json` (every memory sample of every sandbox and every turn's times)
        /// and the bench daemon's log, `daemon.log`.
        #[arg(long)]
        raw: Option<std::path::PathBuf>,
    },
    /// OCI images side by side with other tools in one run (issue 29): import vs `umoci
    /// unpack`, pull vs `skopeo copy` + `umoci unpack` from a loopback `docker-registry`,
    /// create from an OCI image vs from the base image, the disk of five images on one base,
    /// a first vs a cached Dockerfile build. Needs umoci, skopeo, docker-registry.
    Images {
        /// Rounds of each side-by-side measurement.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=50))]
        rounds: u64,
        /// The image split into the 3-layer fixture (and the create baseline).
        #[arg(long, default_value = "debian")]
        base: String,
        /// Loopback port of the bench's own registry.
        #[arg(long, default_value_t = 5591)]
        registry_port: u16,
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
        /// Pause this long (ms) before each create and exec, as an agent's commands are
        /// spaced: back-to-back loops hide costs that return after a quiet moment (RCU grace
        /// periods of cgroup migrations).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
        gap_ms: u64,
        /// Also measure every create and exec with cgroup2's `favordynmods` off, interleaved
        /// (remounts this host's cgroup2 between calls; its state is restored afterwards).
        #[arg(long)]
        favordynmods_ab: bool,
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
    /// --upstream-openai must point at the replay LLM, http://127.0.0.1:7439). Every method then
    /// goes through the proxy, its sandbox created with the method's --checkpoint-policy
    /// (crab: auto, full, fs; none, chat, restart: none), so exposed latency compares like for
    /// like; without it methods checkpoint through the API beside a direct LLM request.
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
            let drawer = ProgressDrawer::new(json);
            let r = crab_bench::replay::run(&opts, client, &drawer).await?;
            drawer.draw(&ProgressFrame::Done { result: serde_json::Value::Null });
            if let Some(path) = &a.json_out {
                let text = serde_json::to_string_pretty(&r)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                std::fs::write(path, text)
                    .map_err(|e| ApiError::internal(format!("writing {}: {e}", path.display())))?;
            }
            if let Some(path) = &a.svg {
                let svg = r.svg().map_err(|e| ApiError::internal(e.to_string()))?;
                std::fs::write(path, svg)
                    .map_err(|e| ApiError::internal(format!("writing {}: {e}", path.display())))?;
            }
            if json {
                print_json(&r);
            } else {
                print!("{}", r.table());
            }
        }
        BenchCmd::Density {
            memory,
            traces,
            sandboxes,
            turns,
            llm_scale,
            resident_mb,
            idle_s,
            stream,
            stream_tps,
            stream_whole_answers,
            image,
            raw,
        } => {
            if !memory {
                return Err(ApiError::invalid(
                    "crab bench density measures memory density only: add --memory",
                    "the exposed latency at 1-32 sandboxes is scripts/bench-density.sh",
                ));
            }
            eprintln!(
                "bench density --memory: {sandboxes} sandboxes x {turns} turns, scales {llm_scale:?}, {}; load average {}",
                if stream { format!("streamed answers at {stream_tps} tokens/s") } else { format!("whole answers (generated at {stream_tps} tokens/s; --stream-whole-answers {stream_whole_answers})") },
                std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
            );
            let opts = crab_bench::density_memory::DensityMemoryOptions {
                traces,
                sandboxes,
                turns,
                scales: llm_scale,
                resident_mb,
                idle_s,
                stream,
                tps: stream_tps,
                stream_whole_answers,
                image,
                main_state: state.root().to_path_buf(),
                raw,
            };
            let r = crab_bench::density_memory::run(&opts).await?;
            if json {
                print_json(&r);
            } else {
                print!("{}", r.table());
            }
        }
        BenchCmd::Images { rounds, base, registry_port } => {
            eprintln!(
                "bench images: {rounds} rounds on {base}; load average {}",
                std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
            );
            let opts = crab_bench::images::ImagesOptions {
                rounds: rounds as usize,
                base,
                registry_port,
                work: std::env::temp_dir()
                    .join(format!("crab-bench-images-{}", std::process::id())),
            };
            let r = crab_bench::images::run(client, &exe, state.root(), &opts).await?;
            if json {
                print_json(&r);
            } else {
                println!(
                    "fixture: 3 layers, {:.0} MiB of gzip blobs; busy at start: {}",
                    r.fixture_blob_bytes as f64 / 1048576.0,
                    if r.other_busy.is_empty() { "nothing" } else { &r.other_busy }
                );
                latency_table(
                    &[
                        ("crab image import", &r.import_ms),
                        ("umoci unpack", &r.umoci_unpack_ms),
                        ("crab image pull", &r.pull_ms),
                        ("skopeo copy + umoci unpack", &r.skopeo_umoci_ms),
                    ],
                    0,
                );
                println!("import / umoci unpack (p50): {:.2}x", r.import_ratio_p50);
                println!("pull / (skopeo + umoci) (p50): {:.2}x", r.pull_ratio_p50);
                println!(
                    "create p50 per batch: base {:?} ms, OCI image {:?} ms; OCI / base {:.2}x",
                    r.create_base_ms, r.create_oci_ms, r.create_ratio_p50
                );
                println!(
                    "five images on one base: sizes sum {:.0} MiB, pool grew {:.1} MiB",
                    r.five_images_sum_bytes as f64 / 1048576.0,
                    r.five_images_pool_growth_bytes as f64 / 1048576.0
                );
                println!(
                    "Dockerfile build: first {:.0} ms, cached {:.0} ms",
                    r.build_first_ms, r.build_cached_ms
                );
                println!("load average: start {}, end {}", r.loadavg.0, r.loadavg.1);
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
        BenchCmd::Lifecycle { image, rounds, fork_count, big_mib, privileged } => {
            eprintln!("bench lifecycle: {rounds} rounds, a fork of {fork_count} ...");
            let opts = crab_bench::lifecycle::LifecycleOptions {
                image,
                rounds,
                fork_count,
                big_mib,
                compare_privileged: privileged,
            };
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
                if let Some(p) = &r.privileged {
                    latency_table(
                        &[
                            ("checkpoint fs --privileged", &p.checkpoint_fs_ms),
                            ("checkpoint full --privileged", &p.checkpoint_full_ms),
                            ("restore --privileged", &p.restore_ms),
                        ],
                        1,
                    );
                    println!(
                        "default profile vs --privileged (p50): full checkpoint {:.3}x, restore {:.3}x",
                        p.full_ratio_p50, p.restore_ratio_p50
                    );
                }
            }
        }
        BenchCmd::E2b { listen, key, rounds, fork_rounds, image, python } => {
            bench_e2b(&exe, state, &listen, &key, rounds, fork_rounds, &image, &python, json)?;
        }
        BenchCmd::Remote { traces, limit, sandboxes, image, remote, no_testbed } => {
            bench_remote(client, traces, limit, sandboxes, image, remote, no_testbed, json).await?;
        }
        BenchCmd::HarnessAgent { traces, limit, max_turns, image } => {
            let opts =
                crab_bench::harness_agent::HarnessAgentOptions { traces, limit, max_turns, image };
            eprintln!("bench harness-agent: {limit} trajectories, agent inside each sandbox, declared as harness or not ...");
            let r = crab_bench::harness_agent::run(client, &opts).await?;
            if json {
                print_json(&r);
            } else {
                let row = |label: &str, c: &crab_bench::replay::report::Counts| {
                    vec![
                        label.to_string(),
                        c.skip.to_string(),
                        c.fs.to_string(),
                        c.process.to_string(),
                        c.full.to_string(),
                    ]
                };
                let rows = vec![
                    row("agent declared (--harness-cmd)", &r.excluded),
                    row("agent not declared", &r.included),
                ];
                table(&["arm", "skip", "fs", "process", "full"], &rows);
                println!("{} trajectories, {:.0} s", r.runs.len(), r.wall_s);
            }
        }
        BenchCmd::RemoteRestore {
            image,
            rounds,
            fork_rounds,
            fork_count,
            mib,
            s3_script,
            no_bare,
            baseline_bin,
        } => {
            let opts = crab_bench::remote_restore::RemoteRestoreOptions {
                image,
                rounds,
                fork_rounds,
                fork_count,
                mib,
                s3_script,
                no_bare,
                baseline_bin,
            };
            eprintln!("bench remote-restore: {rounds} rounds, {fork_rounds} fork rounds of {fork_count} ...");
            let r = crab_bench::remote_restore::run(client, &opts).await?;
            if json {
                print_json(&r);
            } else {
                let n = fork_count;
                let labels: Vec<(String, &crab_common::stats::Summary)> = [
                    ("local restore (in place)".to_string(), &r.local_restore_ms),
                    ("local fork 1".to_string(), &r.local_fork1_ms),
                    (format!("local fork {n}"), &r.local_fork_ms),
                ]
                .into_iter()
                .chain(r.remotes.iter().flat_map(|b| {
                    let scheme = b.url.split(':').next().unwrap_or("?");
                    let host = match (b.with_image, b.warm, b.standby, b.baseline) {
                        (true, _, true, _) => "standby following it",
                        (true, _, _, true) => "fresh image, baseline build",
                        (true, true, _, _) => "warm image",
                        (true, false, _, _) => "fresh image",
                        _ => "bare",
                    };
                    [
                        (format!("{scheme} create --from-remote ({host} host)"), &b.create_ms),
                        ("  of which fetch".to_string(), &b.create_fetch_ms),
                        (format!("{scheme} fork {n} --from-remote ({host} host)"), &b.fork_ms),
                        ("  of which fetch".to_string(), &b.fork_fetch_ms),
                    ]
                }))
                .collect();
                let rows: Vec<(&str, &crab_common::stats::Summary)> =
                    labels.iter().map(|(l, s)| (l.as_str(), *s)).collect();
                latency_table(&rows, 1);
                for b in r.remotes.iter().filter(|b| b.with_image) {
                    println!(
                        "{} ({} host): {} of the restores patched the local image; image hash once per host: p50 {:.0} ms",
                        b.url,
                        match (b.warm, b.standby, b.baseline) {
                            (_, true, _) => "standby",
                            (_, _, true) => "baseline build, fresh",
                            (true, _, _) => "warm",
                            _ => "fresh",
                        },
                        b.patched_from_image,
                        b.image_hash_ms.p50
                    );
                    let stages: Vec<String> = b
                        .create_stages_ms
                        .iter()
                        .map(|(n, v)| format!("{n} {:.1}", v.p50))
                        .collect();
                    println!("  create --from-remote by stage, p50 ms: {}", stages.join(", "));
                }
                println!(
                    "point {}: {:.1} MiB of process images, {:.1} MiB of files",
                    r.point,
                    r.proc_bytes as f64 / 1048576.0,
                    r.fs_bytes as f64 / 1048576.0
                );
                println!(
                    "s3 create / local restore (p50, budget 2x): {:.2}x on a warm host with the image, {:.2}x on a fresh daemon with the image, {:.2}x on a bare host; s3 create / local fork 1: {:.2}x; s3 fork {n} / local fork {n}: {:.2}x",
                    r.s3_create_warm_vs_local_restore,
                    r.s3_create_vs_local_restore,
                    r.s3_create_cold_vs_local_restore,
                    r.s3_create_vs_local_fork1,
                    r.s3_fork_vs_local_fork
                );
                println!(
                    "failover on a standby following the sandbox: create / local restore {:.2}x (budget 1.2x), fork {n} / local fork {n} {:.2}x",
                    r.s3_standby_create_vs_local_restore, r.s3_standby_fork_vs_local_fork
                );
                if r.options.baseline_bin.is_some() {
                    println!(
                        "baseline build on the receiving hosts: s3 create / local restore {:.2}x, s3 fork {n} / local fork {n} {:.2}x",
                        r.baseline_s3_create_vs_local_restore, r.baseline_s3_fork_vs_local_fork
                    );
                }
                println!(
                    "load before {} after {}; also running: {}",
                    r.load_before,
                    r.load_after,
                    r.others.join(", ")
                );
            }
        }
        BenchCmd::E2bHealth { image, sandboxes, calls, e2b } => {
            eprintln!("bench e2b-health: {calls} calls per series, 1 vs {sandboxes} sandboxes ...");
            let opts = crab_bench::e2b_health::HealthOptions {
                image: &image,
                sandboxes: sandboxes.max(2),
                calls: calls.max(1),
                e2b: &e2b,
            };
            let r = crab_bench::e2b_health::run(client, &opts).await?;
            if json {
                print_json(&r);
            } else {
                let many = format!("{} sandboxes", r.sandboxes);
                latency_table(
                    &[
                        ("E2B /health, 1 sandbox", &r.health_1_ms),
                        (&format!("E2B /health, {many}"), &r.health_n_ms),
                        ("E2B /health, 1 sandbox again", &r.health_1_after_ms),
                        ("/health between list-alls, 1 sandbox", &r.health_1_mixed_ms),
                        (&format!("/health between list-alls, {many}"), &r.health_n_mixed_ms),
                        ("list all (old liveness), 1 sandbox", &r.list_1_ms),
                        (&format!("list all (old liveness), {many}"), &r.list_n_ms),
                    ],
                    3,
                );
                println!(
                    "p50 ratio {many} / 1: /health {:.2}x, list-all {:.2}x",
                    r.health_ratio_p50, r.list_ratio_p50
                );
            }
        }
        BenchCmd::Foundation { image, creates, execs, privileged, gap_ms, favordynmods_ab } => {
            eprintln!(
                "bench foundation: {creates} creates, {execs} exec/host pairs, {gap_ms} ms apart ..."
            );
            let hier = crab_sandbox::cgroup::Hierarchy::detect()
                .map_err(|e| ApiError::internal(format!("cgroup hierarchy: {e}")))?;
            let switch = |on: bool| hier.set_favordynmods(on).map(drop);
            let was_on = if favordynmods_ab {
                Some(hier.set_favordynmods(true).map_err(ApiError::internal)?)
            } else {
                None
            };
            let opts = crab_bench::foundation::FoundationOptions {
                image: &image,
                creates,
                execs,
                compare_privileged: privileged,
                gap: std::time::Duration::from_millis(gap_ms),
                favordynmods: favordynmods_ab.then_some(&switch as _),
            };
            let r = crab_bench::foundation::run(client, &exe, state.root(), &opts).await;
            if let Some(was) = was_on {
                if let Err(e) = hier.set_favordynmods(was) {
                    eprintln!("warning: could not put cgroup2 favordynmods back to {was}: {e}");
                }
            }
            let r = r?;
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
                if let Some(f) = &r.favordynmods_off {
                    latency_table(
                        &[
                            ("create, favordynmods off", &f.create_ms),
                            ("exec true, favordynmods off", &f.exec_true_ms),
                        ],
                        2,
                    );
                    println!(
                        "favordynmods off vs on (p50): create {:.3}x, exec {:+.2} ms",
                        f.create_ratio_p50, f.exec_delta_p50_ms
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `crab bench remote`: run it, print the table (or JSON).
#[allow(clippy::too_many_arguments)]
async fn bench_remote(
    client: &Client,
    traces: Vec<std::path::PathBuf>,
    limit: usize,
    sandboxes: usize,
    image: String,
    remote: Option<String>,
    no_testbed: bool,
    json: bool,
) -> Result<(), ApiError> {
    let d = crab_bench::replay::ReplayOptions::default();
    let opts = crab_bench::remote::RemoteBenchOptions {
        traces,
        limit,
        sandboxes,
        image,
        remote,
        testbed: !no_testbed,
        cache_dir: d.cache_dir,
        exec_timeout_s: d.exec_timeout_s,
    };
    let drawer = ProgressDrawer::new(json);
    let r = crab_bench::remote::run(&opts, client, &drawer).await?;
    drawer.draw(&ProgressFrame::Done { result: serde_json::Value::Null });
    if json {
        print_json(&r);
        return Ok(());
    }
    let kinds = |m: &crab_bench::remote::MethodBytes| {
        m.kinds.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
    };
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1048576.0);
    table(
        &["METHOD", "POINTS", "KINDS", "UPLOADED", "VS FULL-EXPORT"],
        &[
            vec![
                "crab".into(),
                r.crab.points.to_string(),
                kinds(&r.crab),
                mib(r.crab.uploaded_bytes),
                format!("{:.2} %", 100.0 * r.crab_vs_full_export),
            ],
            vec![
                "full-dedup".into(),
                r.full.points.to_string(),
                kinds(&r.full),
                mib(r.full.uploaded_bytes),
                format!("{:.2} %", 100.0 * r.full_dedup_vs_full_export),
            ],
            vec![
                "full-export".into(),
                r.full.points.to_string(),
                kinds(&r.full),
                mib(r.full.full_export_bytes),
                "100 %".into(),
            ],
        ],
    );
    println!(
        "crab exports: {:.2} points/s (p50 {:.0} ms, p95 {:.0} ms per point) vs {:.2} points/s produced by {} agents at the recorded median turn of {:.1} s",
        r.crab_export_points_per_s,
        r.crab.export_ms.as_ref().map_or(f64::NAN, |s| s.p50),
        r.crab.export_ms.as_ref().map_or(f64::NAN, |s| s.p95),
        r.demand_points_per_s,
        sandboxes,
        r.recorded_turn_s
    );
    println!("{} trajectories; {}", r.trajectories.len(), r.load);
    for e in r.crab.errors.iter().chain(&r.full.errors) {
        println!("error: {e}");
    }
    Ok(())
}

/// A table of latency summaries (ms) with `decimals` digits.
/// The SDK side of `crab bench e2b` (it also drives the CLI arm, so both interleave).
const BENCH_E2B_PY: &str = include_str!("../../../crab-bench/e2b/bench_e2b.py");

#[allow(clippy::too_many_arguments)]
fn bench_e2b(
    exe: &std::path::Path,
    state: &StateDir,
    listen: &str,
    key: &str,
    rounds: usize,
    fork_rounds: usize,
    image: &str,
    python: &std::path::Path,
    json: bool,
) -> Result<(), ApiError> {
    use crab_common::stats::Summary;
    let script = std::env::temp_dir().join(format!("crab-bench-e2b-{}.py", std::process::id()));
    std::fs::write(&script, BENCH_E2B_PY)
        .map_err(|e| ApiError::internal(format!("writing {}: {e}", script.display())))?;
    eprintln!(
        "bench e2b: {rounds} rounds per arm, {fork_rounds} restore rounds, image {image} ..."
    );
    let url = format!("http://{listen}");
    let out = std::process::Command::new(python)
        .arg(&script)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", key)
        .env("CRAB_BIN", exe)
        .env("CRAB_STATE_DIR", state.root())
        .env("ROUNDS", rounds.to_string())
        .env("FORK_ROUNDS", fork_rounds.to_string())
        .env("IMAGE", image)
        .stderr(std::process::Stdio::inherit())
        .output();
    let _ = std::fs::remove_file(&script);
    let out = out.map_err(|e| {
        ApiError::invalid(
            format!("running {}: {e}", python.display()),
            "install the SDK venv with scripts/install-test-servers.sh or pass --python",
        )
    })?;
    if !out.status.success() {
        return Err(ApiError::internal(format!("the e2b benchmark failed ({})", out.status)));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| ApiError::internal(format!("the e2b benchmark printed no JSON: {e}")))?;
    if json {
        print_json(&v);
        return Ok(());
    }
    let series = |path: &[&str]| -> Summary {
        let mut x = &v;
        for p in path {
            x = &x[*p];
        }
        let s: Vec<f64> =
            x.as_array().map(|a| a.iter().filter_map(|n| n.as_f64()).collect()).unwrap_or_default();
        Summary::of(&s)
    };
    let rows: Vec<(&str, Summary)> = vec![
        ("e2b SDK Sandbox.create", series(&["sdk", "create"])),
        ("crab sandbox create", series(&["cli", "create"])),
        ("e2b SDK commands.run(true)", series(&["sdk", "run_true"])),
        ("crab exec -- true", series(&["cli", "run_true"])),
        ("e2b SDK kill", series(&["sdk", "kill"])),
        ("crab sandbox rm -f", series(&["cli", "kill"])),
        ("e2b SDK create+run+kill", series(&["sdk", "total"])),
        ("crab CLI create+exec+rm", series(&["cli", "total"])),
        ("e2b SDK create(snapshot)", series(&["restore", "sdk_create_from_snapshot"])),
        ("crab fork --count 1", series(&["restore", "cli_fork_1"])),
        ("e2b SDK fork(count=8)", series(&["restore", "sdk_fork_8"])),
        ("crab checkpoint+fork 8", series(&["restore", "cli_checkpoint_fork_8"])),
    ];
    let refs: Vec<(&str, &Summary)> = rows.iter().map(|(n, s)| (*n, s)).collect();
    latency_table(&refs, 1);
    let (a, b) = (series(&["sdk", "total"]).p50, series(&["cli", "total"]).p50);
    println!("e2b SDK / crab CLI, create+run+kill p50: {:.2}x ({a:.1} ms vs {b:.1} ms)", a / b);
    Ok(())
}

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
