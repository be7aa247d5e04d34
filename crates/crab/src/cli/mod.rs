//! The command-line interface: argument parsing and one thin API call per command.
//!
//! Every command accepts `--json` (machine-readable output on stdout) and `--state-dir`
//! (`CRAB_STATE_DIR`). Errors print as `error: …` and `hint: …` and exit 1; `crab exec` exits
//! with the command's own code (125 when Crab itself failed, like `docker exec`).

#[cfg(feature = "bench")]
mod bench;
mod checkpoint;
mod conversation;
mod daemon;
mod docker;
mod exec;
mod image;
mod image_pull;
mod image_push;
mod procs;
mod remote;
mod sandbox;
mod top;
mod turn;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use crab_client::{Client, Method};
use serde::Serialize;

use crab_common::api::{ProgressFrame, VersionInfo};
use crab_common::paths::{StateDir, DEFAULT_STATE_DIR};
use crab_common::ApiError;

use crate::output::{print_error, ProgressDrawer};

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
    Daemon(daemon::DaemonArgs),
    /// Manage images.
    #[command(subcommand)]
    Image(image::ImageCmd),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCmd),
    /// Run a command in a sandbox (flags as `docker exec`; `-d` starts it in the background).
    Exec(exec::ExecArgs),
    /// List a sandbox's background processes (`crab exec -d`).
    Ps(procs::PsArgs),
    /// Print a background process's output from its start; `-f` follows it until it ends.
    /// Exits with the process's exit code once it ended (0 while it runs).
    Logs(procs::LogsArgs),
    /// Send a signal to a background process (TERM by default).
    Signal(procs::SignalArgs),
    /// Take a checkpoint of a sandbox (publishes a new restore point).
    Checkpoint(checkpoint::CheckpointArgs),
    /// List a sandbox's restore points, or prune them.
    Checkpoints(checkpoint::CheckpointsArgs),
    /// Restore a sandbox in place to a restore point (the newest by default).
    Restore(checkpoint::RestoreArgs),
    /// Create new sandboxes from a restore point of a sandbox.
    Fork(checkpoint::ForkArgs),
    /// Print a sandbox's conversation (as recorded by the LLM proxy), up to a restore point.
    Conversation(conversation::ConversationArgs),
    /// Mark a turn boundary explicitly (for frameworks that do not go through the LLM proxy);
    /// returns once the turn's restore point is published.
    Turn(turn::TurnArgs),
    /// Live per-sandbox view: turns, verdict mix, held time, queue.
    Top(top::TopArgs),
    /// Show the current turn's OS effects in a sandbox, as the eBPF inspector sees them.
    Inspect(turn::InspectArgs),
    /// The durable tier (the daemon's --remote): list, check, prune.
    #[command(subcommand)]
    Remote(remote::RemoteCmd),
    /// Show the daemon's version and state directory.
    Version,
    /// Run a benchmark against the running daemon.
    #[cfg(feature = "bench")]
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Run a benchmark (this crab was built without them: `--features bench`).
    #[cfg(not(feature = "bench"))]
    Bench {
        /// The benchmark and its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// A docker-CLI front for harnesses that shell out to `docker` (run, exec, stop, start,
    /// kill, rm, ps, inspect, logs, cp); also reached as `crab-docker`, a link to this binary.
    #[command(subcommand)]
    Docker(docker::DockerCmd),
}

pub(super) fn parse_size(s: &str) -> Result<u64, String> {
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

/// Entry point of the CLI (after helper dispatch). Called as `crab-docker` (a link), the
/// arguments are those of `crab docker`.
pub fn main() -> ExitCode {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let invoked_as = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned());
    if invoked_as.as_deref() == Some("crab-docker") {
        args.insert(1, "docker".into());
    }
    let cli = Cli::parse_from(args);
    // The daemon and the benchmarks run many tasks at once; every other command is one
    // request, for which a single-threaded runtime starts faster (no worker threads, no CPU
    // count read from cgroup files): `crab exec` runs once per agent command.
    let mut builder = match cli.cmd {
        Cmd::Daemon(_) | Cmd::Bench { .. } => tokio::runtime::Builder::new_multi_thread(),
        _ => {
            // A client command whose reader went away (`crab sandbox ls | head`) ends quietly
            // as other Unix tools do, not with a "failed printing to stdout" panic: the Rust
            // runtime ignores SIGPIPE, so restore its default. (The daemon keeps ignoring it: a
            // peer that hangs up is an error on that connection only.)
            // SAFETY: setting a signal's disposition to SIG_DFL installs no handler, and this
            // runs before any other thread exists.
            unsafe {
                let _ = nix::sys::signal::signal(
                    nix::sys::signal::Signal::SIGPIPE,
                    nix::sys::signal::SigHandler::SigDfl,
                );
            }
            tokio::runtime::Builder::new_current_thread()
        }
    };
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(run(cli))
}

pub(super) fn print_json<T: Serialize>(v: &T) {
    if let Ok(s) = serde_json::to_string_pretty(v) {
        println!("{s}");
    }
}

async fn run(cli: Cli) -> ExitCode {
    let state = StateDir::new(&cli.state_dir);
    if let Cmd::Daemon(a) = cli.cmd {
        init_tracing();
        return daemon::run(a, state).await;
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
                    if let Some(sd) = &v.features.soft_dirty {
                        let on = if sd.available { "available" } else { "unavailable" };
                        println!("soft-dirty page tracking: {on} ({})", sd.reason);
                    }
                    if let Some(f) = &v.features.cgroup_favordynmods {
                        let on = if f.available { "on" } else { "off" };
                        println!("cgroup2 favordynmods: {on} ({})", f.reason);
                    }
                    if let Some(f) = &v.features.namespace_helper {
                        let which = if f.available { "small crab-nsexec" } else { "crab itself" };
                        println!("namespace helpers: {which} ({})", f.reason);
                    }
                }
                ExitCode::SUCCESS
            })
        }
        Cmd::Image(c) => image::run(&client, c, json).await,
        Cmd::Sandbox(c) => sandbox::run(&client, c, json).await,
        Cmd::Exec(a) => return exec::run(&client, a, json).await,
        Cmd::Ps(a) => procs::ps(&client, a, json).await,
        Cmd::Logs(a) => procs::logs(&client, a, json).await,
        Cmd::Signal(a) => procs::signal(&client, a, json).await,
        Cmd::Docker(c) => return docker::run(&client, c, json).await,
        #[cfg(feature = "bench")]
        Cmd::Bench(b) => bench::run(&client, &state, b, json).await,
        #[cfg(not(feature = "bench"))]
        Cmd::Bench { .. } => Err(ApiError::invalid(
            "this crab binary was built without the benchmarks",
            "build it with `cargo build --release -p crab --features bench` (or `make bench`)",
        )),
        Cmd::Inspect(a) => turn::inspect(&client, a, json).await,
        Cmd::Checkpoint(a) => checkpoint::checkpoint(&client, a, json).await,
        Cmd::Checkpoints(a) => checkpoint::checkpoints(&client, a, json).await,
        Cmd::Conversation(a) => conversation::run(&client, a, json).await,
        Cmd::Turn(a) => turn::turn(&client, a, json).await,
        Cmd::Top(a) => top::run(&client, a, json).await,
        Cmd::Restore(a) => checkpoint::restore(&client, a, json).await,
        Cmd::Fork(a) => checkpoint::fork(&client, a, json).await,
        Cmd::Remote(c) => remote::run(&client, c, json).await,
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

/// A long action that reports its stages (restore, fork, remote restore): asked with
/// `?progress=true` and its stages drawn on stderr (bars on a terminal, lines otherwise) —
/// except under `--json`, where it is one plain call and nothing is drawn. The answer is the
/// same document either way.
pub(super) async fn staged_op<B: Serialize, T: serde::de::DeserializeOwned>(
    client: &Client,
    path: &str,
    body: &B,
    json: bool,
) -> Result<T, ApiError> {
    let v: serde_json::Value = if json {
        client.call(Method::POST, path, Some(body)).await?
    } else {
        long_op(client, &format!("{path}?progress=true"), body, false).await?
    };
    serde_json::from_value(v)
        .map_err(|e| ApiError::internal(format!("undecodable answer from the daemon: {e}")))
}

/// Run a streamed long operation, drawing progress, and return its result document.
pub(super) async fn long_op<B: Serialize>(
    client: &Client,
    path: &str,
    body: &B,
    json: bool,
) -> Result<serde_json::Value, ApiError> {
    let drawer = ProgressDrawer::new(json);
    let mut result: Option<Result<serde_json::Value, ApiError>> = None;
    client
        .stream(path, body, |f: ProgressFrame| {
            drawer.draw(&f);
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
