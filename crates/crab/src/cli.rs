//! The command-line interface: argument parsing and one thin API call per command.
//!
//! Every command accepts `--json` (machine-readable output on stdout) and `--state-dir`
//! (`CRAB_STATE_DIR`). Errors print as `error: …` and `hint: …` and exit 1; `crab exec` exits
//! with the command's own code (125 when Crab itself failed, like `docker exec`).

use std::io::{Read, Write};
use std::process::ExitCode;

use base64::Engine;
use clap::{Args, Parser, Subcommand};
use crab_client::Method;
use serde::Serialize;

use crab_common::api::{
    CheckpointCreateRequest, ExecFrame, ExecRequest, ForkRequest, ImageBuildRequest,
    ImageImportRequest, ImageInfo, Limits, NetMode, ProgressFrame, PruneRequest, RestoreRequest,
    SandboxCreateRequest, SandboxInfo, VersionInfo,
};
use crab_common::paths::{StateDir, DEFAULT_STATE_DIR};
use crab_common::ApiError;

use crate::daemon::{self, DaemonOptions};
use crate::output::{age, human_bytes, print_error, table, ProgressDrawer};
use crab_client::Client;

#[derive(Debug, Parser)]
#[command(name = "crab", version, about = "Checkpoint/restore runtime for AI-agent sandboxes")]
struct Cli {
    /// State directory of the daemon.
    #[arg(long, global = true, env = "CRAB_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: String,
    /// Print machine-readable JSON on stdout.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the daemon (as root) in the foreground.
    Daemon(DaemonArgs),
    /// Manage images.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Run a command in a sandbox (flags as `docker exec`).
    Exec(ExecArgs),
    /// Take a checkpoint of a sandbox (publishes a new restore point).
    Checkpoint {
        /// Sandbox name.
        sandbox: String,
        /// auto (ask the inspector), fs, process, full or skip.
        #[arg(long, default_value = "auto")]
        kind: String,
    },
    /// List a sandbox's restore points, or prune them.
    Checkpoints(CheckpointsArgs),
    /// Restore a sandbox in place to a restore point (the newest by default).
    Restore {
        /// Sandbox name.
        sandbox: String,
        /// Restore point id (c000007, c7 or 7).
        checkpoint: Option<String>,
    },
    /// Create new sandboxes from a restore point of a sandbox.
    Fork {
        /// Sandbox name.
        sandbox: String,
        /// Restore point id (the newest when absent).
        checkpoint: Option<String>,
        /// Number of branches.
        #[arg(long, default_value_t = 1)]
        count: usize,
        /// Names of the branches, comma-separated (one per branch).
        #[arg(long, value_delimiter = ',')]
        names: Vec<String>,
    },
    /// Print a sandbox's conversation (as recorded by the LLM proxy), up to a restore point.
    Conversation {
        /// Sandbox name.
        sandbox: String,
        /// Restore point id: the conversation as it was at that point.
        #[arg(long)]
        at: Option<String>,
    },
    /// Mark a turn boundary explicitly (for frameworks that do not go through the LLM proxy);
    /// returns once the turn's restore point is published.
    Turn {
        /// Sandbox name.
        sandbox: String,
    },
    /// Live per-sandbox view: turns, verdict mix, held time, queue.
    Top {
        /// Refresh interval in seconds.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Print one snapshot and exit.
        #[arg(long)]
        once: bool,
    },
    /// Show the current turn's OS effects in a sandbox, as the eBPF inspector sees them.
    Inspect {
        /// Sandbox name.
        sandbox: String,
        /// Also close the turn (as a checkpoint at a turn boundary does).
        #[arg(long)]
        close: bool,
    },
    /// Show the daemon's version and state directory.
    Version,
    /// Run a benchmark against the running daemon.
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
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
struct DaemonArgs {
    /// Size of the sparse btrfs pool file created when the state dir is not on btrfs.
    #[arg(long, default_value = "32G", value_parser = parse_size)]
    pool_size: u64,
    /// Where the LLM proxy listens (loopback only unless --proxy-allow-remote).
    #[arg(long, env = "CRAB_PROXY_LISTEN", default_value = crab_coordinator::DEFAULT_LISTEN)]
    proxy_listen: std::net::SocketAddr,
    /// Let the LLM proxy listen beyond loopback (it carries API keys).
    #[arg(long)]
    proxy_allow_remote: bool,
    /// OpenAI-style upstream base URL, without /v1.
    #[arg(long, env = "CRAB_UPSTREAM_OPENAI", default_value = "https://api.openai.com")]
    upstream_openai: String,
    /// Anthropic-style upstream base URL, without /v1.
    #[arg(long, env = "CRAB_UPSTREAM_ANTHROPIC", default_value = "https://api.anthropic.com")]
    upstream_anthropic: String,
    /// Process dumps (CRIU) running at once, host-wide.
    #[arg(long, default_value_t = 1)]
    max_concurrent_dumps: usize,
    /// Checkpoint disk bandwidth budget, bytes per second (e.g. 200M); unlimited by default.
    #[arg(long, value_parser = parse_size)]
    disk_bandwidth: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum ImageCmd {
    /// Build an image from a recipe (only `debian`: bookworm minbase + python3, git, ...).
    Build {
        /// Recipe.
        distro: String,
        /// Image name (default: the recipe's name).
        #[arg(long)]
        name: Option<String>,
        /// Extra packages, comma-separated.
        #[arg(long, value_delimiter = ',')]
        include: Vec<String>,
    },
    /// Import a root filesystem from a directory or a tar archive.
    Import {
        /// Image name.
        name: String,
        /// Directory or .tar / .tar.gz.
        path: String,
    },
    /// List images.
    Ls,
    /// Remove an image.
    Rm {
        /// Image name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum SandboxCmd {
    /// Create and start a sandbox from an image.
    Create {
        /// Image.
        image: String,
        /// Sandbox name (generated when absent).
        #[arg(long)]
        name: Option<String>,
        /// Network: private (own namespace, lo up), host, or none.
        #[arg(long, default_value = "private")]
        net: NetMode,
        /// Memory limit, e.g. 512M.
        #[arg(long, value_parser = parse_size)]
        memory: Option<u64>,
        /// Maximum number of tasks.
        #[arg(long)]
        pids: Option<u64>,
        /// CPU limit in cores, e.g. 0.5.
        #[arg(long)]
        cpus: Option<f64>,
        /// UNSAFE: run without the default security profile (all capabilities, no seccomp,
        /// no masked paths, no cgroup namespace, every device). Code in the sandbox can then
        /// take over the host. For trusted workloads and benchmarks only.
        #[arg(long)]
        privileged: bool,
    },
    /// List sandboxes.
    Ls,
    /// Show one sandbox.
    Inspect {
        /// Sandbox name.
        name: String,
    },
    /// Remove a sandbox.
    Rm {
        /// Sandbox names.
        #[arg(required = true)]
        names: Vec<String>,
        /// Kill whatever runs in it.
        #[arg(short, long)]
        force: bool,
    },
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
struct CheckpointsArgs {
    #[command(subcommand)]
    cmd: Option<CheckpointsCmd>,
    /// Sandbox name.
    sandbox: Option<String>,
}

#[derive(Debug, Subcommand)]
enum CheckpointsCmd {
    /// Remove old restore points (parts still referenced by kept points are kept).
    Prune {
        /// Sandbox name.
        sandbox: String,
        /// How many of the newest points to keep.
        #[arg(long)]
        keep_last: usize,
    },
}

#[derive(Debug, Args)]
struct ReplayArgs {
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

#[derive(Debug, Args)]
struct ExecArgs {
    /// Seconds after which the command (and whatever holds its output) is killed.
    #[arg(long)]
    timeout: Option<f64>,
    /// Working directory inside the sandbox.
    #[arg(short = 'w', long = "workdir")]
    workdir: Option<String>,
    /// Environment variable KEY=VALUE (repeatable).
    #[arg(short = 'e', long = "env")]
    env: Vec<String>,
    /// Pass standard input through.
    #[arg(short = 'i', long = "interactive")]
    interactive: bool,
    /// Sandbox name.
    sandbox: String,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    cmd: Vec<String>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        Some('T' | 't') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size like 512M or 32G"))?;
    Ok((n * mult as f64) as u64)
}

/// Entry point of the CLI (after helper dispatch).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(run(cli))
}

fn print_json<T: Serialize>(v: &T) {
    if let Ok(s) = serde_json::to_string_pretty(v) {
        println!("{s}");
    }
}

async fn run(cli: Cli) -> ExitCode {
    let state = StateDir::new(&cli.state_dir);
    if let Cmd::Daemon(a) = cli.cmd {
        init_tracing();
        let proxy = crab_coordinator::ProxyConfig {
            listen: a.proxy_listen,
            allow_remote: a.proxy_allow_remote,
            upstream_openai: a.upstream_openai,
            upstream_anthropic: a.upstream_anthropic,
            ..Default::default()
        };
        let engine = crab_engine::EngineConfig {
            max_concurrent_dumps: a.max_concurrent_dumps.max(1),
            disk_bytes_per_sec: a.disk_bandwidth,
            ..Default::default()
        };
        let opts = DaemonOptions { state, pool_size: a.pool_size, proxy, engine };
        return match daemon::run(opts).await {
            // Exit at once: nothing is left to flush, and waiting for idle blocking threads or
            // the kernel's teardown of BPF links would only delay a restart.
            Ok(()) => std::process::exit(0),
            Err(e) => {
                tracing::error!("{e:#}");
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let client = Client::new(state.socket());
    let json = cli.json;
    let res = match cli.cmd {
        Cmd::Daemon(_) => Ok(ExitCode::SUCCESS),
        Cmd::Version => {
            client.call::<(), VersionInfo>(Method::GET, "/v1/version", None).await.map(|v| {
                if json {
                    print_json(&v);
                } else {
                    println!(
                        "crab {} (API {}), daemon pid {}, state {}",
                        v.version, v.api, v.pid, v.state_dir
                    );
                }
                ExitCode::SUCCESS
            })
        }
        Cmd::Image(c) => image_cmd(&client, c, json).await,
        Cmd::Sandbox(c) => sandbox_cmd(&client, c, json).await,
        Cmd::Exec(a) => return exec_cmd(&client, a, json).await,
        Cmd::Bench(b) => bench_cmd(&client, &state, b, json).await,
        Cmd::Inspect { sandbox, close } => inspect_cmd(&client, &sandbox, close, json).await,
        Cmd::Checkpoint { sandbox, kind } => checkpoint_cmd(&client, &sandbox, kind, json).await,
        Cmd::Checkpoints(a) => checkpoints_cmd(&client, a, json).await,
        Cmd::Conversation { sandbox, at } => conversation_cmd(&client, &sandbox, at, json).await,
        Cmd::Turn { sandbox } => turn_cmd(&client, &sandbox, json).await,
        Cmd::Top { interval, once } => top_cmd(&client, interval, once, json).await,
        Cmd::Restore { sandbox, checkpoint } => {
            restore_cmd(&client, &sandbox, checkpoint, json).await
        }
        Cmd::Fork { sandbox, checkpoint, count, names } => {
            fork_cmd(&client, &sandbox, checkpoint, count, names, json).await
        }
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            if json {
                print_json(&e);
            }
            print_error(&e);
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CRAB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Run a streamed long operation, drawing progress, and return its result document.
async fn long_op<B: Serialize>(
    client: &Client,
    path: &str,
    body: &B,
    json: bool,
) -> Result<serde_json::Value, ApiError> {
    let drawer = ProgressDrawer::new();
    let mut result: Option<Result<serde_json::Value, ApiError>> = None;
    client
        .stream(path, body, |f: ProgressFrame| {
            if !json {
                drawer.draw(&f);
            }
            match f {
                ProgressFrame::Done { result: r } => result = Some(Ok(r)),
                ProgressFrame::Error { error } => result = Some(Err(error)),
                _ => {}
            }
        })
        .await?;
    result.unwrap_or_else(|| {
        Err(ApiError::internal("the daemon ended the operation without a result"))
    })
}

fn image_rows(images: &[ImageInfo]) -> Vec<Vec<String>> {
    images
        .iter()
        .map(|i| {
            vec![i.name.clone(), human_bytes(i.size_bytes), age(i.created_at), i.source.clone()]
        })
        .collect()
}

async fn image_cmd(client: &Client, c: ImageCmd, json: bool) -> Result<ExitCode, ApiError> {
    let show_one = |v: serde_json::Value| -> Result<ExitCode, ApiError> {
        let info: ImageInfo =
            serde_json::from_value(v).map_err(|e| ApiError::internal(e.to_string()))?;
        if json {
            print_json(&info);
        } else {
            table(&["NAME", "SIZE", "AGE", "SOURCE"], &image_rows(std::slice::from_ref(&info)));
        }
        Ok(ExitCode::SUCCESS)
    };
    match c {
        ImageCmd::Build { distro, name, include } => {
            let req = ImageBuildRequest { distro, name, include };
            show_one(long_op(client, "/v1/images/build", &req, json).await?)
        }
        ImageCmd::Import { name, path } => {
            let abs = std::fs::canonicalize(&path).map_err(|e| {
                ApiError::invalid(
                    format!("cannot read {path}: {e}"),
                    "give an existing directory or tar archive",
                )
            })?;
            let req = ImageImportRequest { name, path: abs.display().to_string() };
            show_one(long_op(client, "/v1/images/import", &req, json).await?)
        }
        ImageCmd::Ls => {
            let v: Vec<ImageInfo> = client.call::<(), _>(Method::GET, "/v1/images", None).await?;
            if json {
                print_json(&v);
            } else {
                table(&["NAME", "SIZE", "AGE", "SOURCE"], &image_rows(&v));
            }
            Ok(ExitCode::SUCCESS)
        }
        ImageCmd::Rm { name } => {
            let v: serde_json::Value =
                client.call::<(), _>(Method::DELETE, &format!("/v1/images/{name}"), None).await?;
            if json {
                print_json(&v);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn sandbox_rows(v: &[SandboxInfo]) -> Vec<Vec<String>> {
    v.iter()
        .map(|s| {
            vec![
                s.name.clone(),
                s.image.clone(),
                format!("{:?}", s.state).to_lowercase(),
                age(s.created_at),
                s.processes.to_string(),
                s.bytes_written.map(human_bytes).unwrap_or_else(|| "-".into()),
            ]
        })
        .collect()
}

const SANDBOX_HEADER: [&str; 6] = ["NAME", "IMAGE", "STATE", "AGE", "PROCS", "WRITTEN"];

async fn sandbox_cmd(client: &Client, c: SandboxCmd, json: bool) -> Result<ExitCode, ApiError> {
    match c {
        SandboxCmd::Create { image, name, net, memory, pids, cpus, privileged } => {
            let req = SandboxCreateRequest {
                image,
                name,
                net,
                limits: Limits {
                    memory_bytes: memory,
                    pids_max: pids,
                    cpu_millis: cpus.map(|c| (c * 1000.0) as u64),
                },
                privileged,
            };
            let s: SandboxInfo = client.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
            if json {
                print_json(&s);
            } else {
                println!("{}", s.name);
            }
        }
        SandboxCmd::Ls => {
            let v: Vec<SandboxInfo> =
                client.call::<(), _>(Method::GET, "/v1/sandboxes", None).await?;
            if json {
                print_json(&v);
            } else {
                table(&SANDBOX_HEADER, &sandbox_rows(&v));
            }
        }
        SandboxCmd::Inspect { name } => {
            let s: SandboxInfo =
                client.call::<(), _>(Method::GET, &format!("/v1/sandboxes/{name}"), None).await?;
            print_json(&s);
        }
        SandboxCmd::Rm { names, force } => {
            for name in names {
                let _: serde_json::Value = client
                    .call::<(), _>(
                        Method::DELETE,
                        &format!("/v1/sandboxes/{name}?force={force}"),
                        None,
                    )
                    .await?;
                if json {
                    print_json(&serde_json::json!({"removed": name}));
                } else {
                    println!("{name}");
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Serialize)]
struct ExecResult {
    stdout: String,
    stderr: String,
    code: i32,
    timed_out: bool,
    duration_ms: f64,
}

async fn exec_cmd(client: &Client, a: ExecArgs, json: bool) -> ExitCode {
    let stdin_b64 = if a.interactive {
        let mut buf = Vec::new();
        if let Err(e) = std::io::stdin().read_to_end(&mut buf) {
            print_error(&ApiError::invalid(format!("reading stdin: {e}"), ""));
            return ExitCode::from(125);
        }
        Some(base64::engine::general_purpose::STANDARD.encode(buf))
    } else {
        None
    };
    let req =
        ExecRequest { cmd: a.cmd, env: a.env, workdir: a.workdir, timeout_s: a.timeout, stdin_b64 };
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut res = ExecResult {
        stdout: String::new(),
        stderr: String::new(),
        code: 125,
        timed_out: false,
        duration_ms: 0.0,
    };
    let mut failure: Option<ApiError> = None;
    let mut got_exit = false;
    let streamed = client
        .stream(&format!("/v1/sandboxes/{}/exec", a.sandbox), &req, |f: ExecFrame| match f {
            ExecFrame::Stdout { d } => {
                let bytes = b64.decode(d).unwrap_or_default();
                if json {
                    res.stdout.push_str(&String::from_utf8_lossy(&bytes));
                } else {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&bytes);
                    let _ = o.flush();
                }
            }
            ExecFrame::Stderr { d } => {
                let bytes = b64.decode(d).unwrap_or_default();
                if json {
                    res.stderr.push_str(&String::from_utf8_lossy(&bytes));
                } else {
                    let mut o = std::io::stderr().lock();
                    let _ = o.write_all(&bytes);
                    let _ = o.flush();
                }
            }
            ExecFrame::Exit { code, timed_out, duration_ms } => {
                got_exit = true;
                res.code = code;
                res.timed_out = timed_out;
                res.duration_ms = duration_ms;
            }
            ExecFrame::Error { error } => failure = Some(error),
        })
        .await;
    if let Err(e) = streamed {
        failure = Some(e);
    }
    if let Some(e) = failure {
        if json {
            print_json(&e);
        }
        print_error(&e);
        return ExitCode::from(125);
    }
    if !got_exit {
        print_error(&ApiError::internal("the daemon ended the exec without an exit status"));
        return ExitCode::from(125);
    }
    if json {
        print_json(&res);
    } else if res.timed_out {
        eprintln!("crab: command timed out after {:.1} s and was killed", res.duration_ms / 1e3);
    }
    ExitCode::from(res.code.clamp(0, 255) as u8)
}

async fn bench_cmd(
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
            let opts =
                crab_coordinator::bench::ProxyBenchOptions { iterations, ..Default::default() };
            let r = crab_coordinator::bench::bench_proxy(opts)
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
            }
        }
        BenchCmd::Turns { sandboxes, turns, time_scale, traces } => {
            let lat = crab_coordinator::bench::load_llm_latencies(&traces).unwrap_or_default();
            let opts = crab_coordinator::bench::TurnBenchOptions {
                sandboxes,
                turns,
                llm_latency_ms: lat,
                time_scale,
                ..Default::default()
            };
            let r = crab_coordinator::bench::bench_turns(opts)
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

async fn inspect_cmd(
    client: &Client,
    sandbox: &str,
    close: bool,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let path = format!("/v1/sandboxes/{sandbox}/inspect");
    let method = if close { Method::POST } else { Method::GET };
    let v: crab_inspector::Verdict = client.call::<(), _>(method, &path, None).await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let kind = serde_json::to_value(v.kind)
        .ok()
        .and_then(|k| k.as_str().map(str::to_string))
        .unwrap_or_default();
    println!(
        "sandbox {} turn {}: {kind}{}",
        v.sandbox,
        v.turn,
        if v.conservative { " (conservative)" } else { "" }
    );
    let rows: Vec<Vec<String>> = v
        .changeset
        .iter()
        .map(|c| {
            let op = match &c.op {
                crab_inspector::ChangeOp::Rename { from } => format!("rename from {from}"),
                other => serde_json::to_value(other)
                    .ok()
                    .and_then(|o| o.get("op").and_then(|x| x.as_str()).map(str::to_string))
                    .unwrap_or_default(),
            };
            vec![op, c.path.clone()]
        })
        .collect();
    if !rows.is_empty() {
        table(&["CHANGE", "PATH"], &rows);
    }
    let p = &v.processes;
    if p.any() {
        println!("processes: born {:?} died {:?} ran {:?}", p.born, p.died, p.ran);
    }
    for r in &v.reasons {
        println!("reason: {r}");
    }
    Ok(ExitCode::SUCCESS)
}

fn ms_ago(created_at_ms: u64) -> String {
    age(created_at_ms / 1000)
}

async fn checkpoint_cmd(
    client: &Client,
    sandbox: &str,
    kind: String,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let req = CheckpointCreateRequest { kind: Some(kind), turn: None, conversation_offset: None };
    let v: serde_json::Value = client
        .call(Method::POST, &format!("/v1/sandboxes/{sandbox}/checkpoints"), Some(&req))
        .await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let p = &v["point"];
    println!(
        "{} turn {} {} ({}, {}, {:.1} ms)",
        p["id"].as_str().unwrap_or("?"),
        p["turn"],
        p["kind"].as_str().unwrap_or("?"),
        p["parts"].as_str().unwrap_or(""),
        human_bytes(p["size_bytes"].as_u64().unwrap_or(0)),
        p["took_ms"].as_f64().unwrap_or(0.0)
    );
    if let Some(rs) = v["reasons"].as_array() {
        for r in rs {
            println!("reason: {}", r.as_str().unwrap_or(""));
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn checkpoints_cmd(
    client: &Client,
    a: CheckpointsArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    if let Some(CheckpointsCmd::Prune { sandbox, keep_last }) = a.cmd {
        let v: serde_json::Value = client
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{sandbox}/checkpoints/prune"),
                Some(&PruneRequest { keep_last }),
            )
            .await?;
        if json {
            print_json(&v);
        } else {
            let n = |k: &str| v[k].as_array().map(|a| a.len()).unwrap_or(0);
            println!(
                "removed {} restore points, {} process images, {} filesystem snapshots",
                n("points"),
                n("procs"),
                n("fs")
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let sandbox =
        a.sandbox.ok_or_else(|| ApiError::invalid("which sandbox?", "crab checkpoints SANDBOX"))?;
    let v: Vec<crab_checkpoint::PointSummary> = client
        .call::<(), _>(Method::GET, &format!("/v1/sandboxes/{sandbox}/checkpoints"), None)
        .await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = v
        .iter()
        .map(|p| {
            vec![
                p.id.clone(),
                p.turn.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
                p.kind.clone(),
                p.parts.clone(),
                human_bytes(p.size_bytes),
                p.took_ms.map(|t| format!("{t:.1} ms")).unwrap_or_else(|| "-".into()),
                ms_ago(p.created_at_ms),
                p.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    table(&["ID", "TURN", "KIND", "PARTS", "SIZE", "TOOK", "AGE", "ERROR"], &rows);
    Ok(ExitCode::SUCCESS)
}

async fn restore_cmd(
    client: &Client,
    sandbox: &str,
    checkpoint: Option<String>,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let v: crab_checkpoint::RestoreReport = client
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{sandbox}/restore"),
            Some(&RestoreRequest { checkpoint }),
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        println!(
            "restored {} to {} in {:.1} ms ({})",
            v.sandbox,
            v.point,
            v.total_ms,
            if v.processes_restored {
                "files and processes"
            } else {
                "files; processes started fresh"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn fork_cmd(
    client: &Client,
    sandbox: &str,
    checkpoint: Option<String>,
    count: usize,
    names: Vec<String>,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let req =
        ForkRequest { checkpoint, count, names: if names.is_empty() { None } else { Some(names) } };
    let v: Vec<crab_checkpoint::ForkBranch> =
        client.call(Method::POST, &format!("/v1/sandboxes/{sandbox}/fork"), Some(&req)).await?;
    if json {
        print_json(&v);
    } else {
        for b in &v {
            println!("{}", b.sandbox);
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn conversation_cmd(
    client: &Client,
    sandbox: &str,
    at: Option<String>,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let path = match &at {
        Some(a) => format!("/v1/sandboxes/{sandbox}/conversation?at={a}"),
        None => format!("/v1/sandboxes/{sandbox}/conversation"),
    };
    let v: Vec<crab_coordinator::LogRecord> =
        client.call::<(), _>(Method::GET, &path, None).await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    for r in &v {
        println!("--- turn {} {} {} -> {}", r.turn, r.method, r.path, r.status);
        println!(">>> {}", r.request);
        if let Some(resp) = &r.response {
            println!("<<< {resp}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn top_cmd(
    client: &Client,
    interval: f64,
    once: bool,
    json: bool,
) -> Result<ExitCode, ApiError> {
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
                "engine: {} urgent, {} normal queued; {} running ({} dumps)",
                e["queued_urgent"], e["queued_normal"], e["running"], e["running_dumps"]
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
        }
        if once {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(std::time::Duration::from_secs_f64(interval.max(0.1))).await;
    }
}

async fn turn_cmd(client: &Client, sandbox: &str, json: bool) -> Result<ExitCode, ApiError> {
    let v: serde_json::Value =
        client.call::<(), _>(Method::POST, &format!("/v1/sandboxes/{sandbox}/turns"), None).await?;
    if json {
        print_json(&v);
    } else {
        println!("turn {} published as {}", v["turn"], v["checkpoint"].as_str().unwrap_or("?"));
    }
    Ok(ExitCode::SUCCESS)
}

/// Draws a library's progress (the replay's) with the CLI's drawer.
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
