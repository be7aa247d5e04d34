//! `crab sandbox …`: create, list, inspect, update (checkpoint policy, deadline), pause,
//! resume, stop and remove sandboxes.

use std::process::ExitCode;

use clap::Subcommand;
use crab_client::{Client, Method};
use crab_common::api::{
    Lifecycle, Limits, NetMode, ResumeRequest, SandboxCreateRequest, SandboxInfo,
    SandboxUpdateRequest, StopRequest,
};
use crab_common::ApiError;

use super::{parse_size, print_json};
use crate::output::{age, human_bytes, table};

#[derive(Debug, Subcommand)]
// Parsed once per process from argv: the size of `Create` costs nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum SandboxCmd {
    /// Create and start a sandbox from an image, or from a remote restore point.
    Create {
        /// Image: a name (`crab image ls`), or a registry reference (`python:3.12`,
        /// `127.0.0.1:5000/app:1`) — the image pulled from it, pulled now if none is here and
        /// the daemon allows it (`crab daemon --pull`).
        #[arg(required_unless_present = "from_remote", conflicts_with = "from_remote")]
        image: Option<String>,
        /// Build it from a point in the daemon's --remote store: SB or SB@POINT (the newest
        /// when no point), with its files, processes and conversation. Its network, limits
        /// and name are this command's (--network, --memory, --pids, --cpus, --disk, --name)
        /// or the daemon's defaults, never the point's; a point asking for more (a privileged
        /// profile, a wider network, a looser limit) is refused.
        #[arg(long, value_name = "SB[@POINT]")]
        from_remote: Option<String>,
        /// With --from-remote: files and conversation only (a fresh init, no processes).
        #[arg(long, requires = "from_remote")]
        fs_only: bool,
        /// Sandbox name (generated when absent).
        #[arg(long)]
        name: Option<String>,
        /// Network: private (own namespace, lo up), nat (own namespace with a veth pair,
        /// an address from a private range and masqueraded egress; no access to the host,
        /// its loopback services or other sandboxes), none (lo down), or host.
        #[arg(long, visible_alias = "network", default_value = "private")]
        net: NetMode,
        /// With --network nat: the private IPv4 range (CIDR) to take the address from
        /// (default: the daemon's --nat-range).
        #[arg(long, value_name = "CIDR")]
        nat_range: Option<String>,
        /// Memory limit, e.g. 512M.
        #[arg(long, value_parser = parse_size)]
        memory: Option<u64>,
        /// Maximum number of tasks.
        #[arg(long)]
        pids: Option<u64>,
        /// CPU limit in cores, e.g. 0.5.
        #[arg(long)]
        cpus: Option<f64>,
        /// Disk quota, e.g. 10G: what the sandbox's own writes may hold in the pool (btrfs
        /// qgroup; past it, writes inside fail with EDQUOT). Default: the daemon's
        /// --default-disk.
        #[arg(long, value_parser = parse_size)]
        disk: Option<u64>,
        /// UNSAFE: run without the default security profile (all capabilities, no seccomp,
        /// no masked paths, no cgroup namespace, every device). Code in the sandbox can then
        /// take over the host. For trusted workloads and benchmarks only.
        #[arg(long)]
        privileged: bool,
        /// User namespace: `private` (the default: uid 0 inside is an unprivileged host uid of
        /// the daemon's range, `crab daemon --userns-base`) or `host` (UNSAFE: uid 0 inside is
        /// the host's root, as before Crab had user namespaces; for workloads that must share
        /// ids with host files; its non-root processes cannot be checkpointed with their
        /// processes on hosts whose root lacks CAP_SYS_RESOURCE). --privileged implies host.
        #[arg(long, value_name = "MODE", value_parser = ["private", "host"])]
        userns: Option<String>,
        /// What each turn boundary (an LLM request through the proxy, `crab turn`)
        /// checkpoints: auto (the inspector's verdict), full (files and processes every
        /// turn), fs (a filesystem snapshot every turn) or none (no checkpoint; the response
        /// is released at once). Change it later with `crab sandbox update`.
        #[arg(long, value_name = "POLICY", default_value = "auto", value_parser = ["auto", "full", "fs", "none"])]
        checkpoint_policy: String,
        /// Mark the sandbox's harness (an agent, a SWE-ReX server, a session shell running in
        /// it): a regular expression matched against each process's command line (argv
        /// joined by spaces). A process whose own exec gave it a matching command line never
        /// calls for a process dump by running alone; it is still in every dump taken for
        /// another reason. What it forks and execs is not harness. Repeatable.
        #[arg(long, value_name = "PATTERN")]
        harness_cmd: Vec<String>,
        /// A path inside the sandbox whose changes do not count for the verdict (the
        /// harness's own files: logs, caches). Still in every snapshot. Repeatable.
        #[arg(long, value_name = "PATH")]
        harness_path: Vec<String>,
        /// Its deadline: when this long has passed (e.g. 300, 90s, 5m, 2h; at most 24h) the
        /// daemon kills it, or pauses it with --on-timeout pause. Change it with `crab sandbox
        /// update --timeout`.
        #[arg(long, value_name = "DURATION", value_parser = parse_timeout)]
        timeout: Option<u64>,
        /// What the deadline does: kill (retired when it holds labelled points, else removed)
        /// or pause.
        #[arg(long, value_name = "ACTION", requires = "timeout", value_parser = ["kill", "pause"])]
        on_timeout: Option<String>,
        /// A label KEY=VALUE kept in its record (E2B's metadata). Repeatable.
        #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
        label: Vec<(String, String)>,
        /// Never park it at a turn boundary (`crab daemon --memory-budget`), e.g. when it
        /// holds a device or a client connection its point cannot restore (the label
        /// `crab.park=never`).
        #[arg(long)]
        no_park: bool,
        /// An environment variable KEY=VALUE every command in it gets. Repeatable.
        #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
        env: Vec<(String, String)>,
    },
    /// Change settings of a sandbox: its checkpoint policy (from its next turn on), its
    /// deadline.
    Update {
        /// Sandbox name.
        name: String,
        /// auto, full, fs or none (see `crab sandbox create --help`). Going back to auto from
        /// fs or none makes the next checkpoint full.
        #[arg(long, value_name = "POLICY", value_parser = ["auto", "full", "fs", "none"])]
        checkpoint_policy: Option<String>,
        /// A new deadline this long from now (e.g. 300, 5m; 0 clears it).
        #[arg(long, value_name = "DURATION", value_parser = parse_timeout_or_zero)]
        timeout: Option<u64>,
        /// What the new deadline does: kill or pause (default: what the sandbox's deadlines
        /// did so far, else kill).
        #[arg(long, value_name = "ACTION", requires = "timeout", value_parser = ["kill", "pause"])]
        on_timeout: Option<String>,
    },
    /// Pause a running sandbox: a full restore point of its files and processes, then every
    /// process is stopped (its memory freed). `crab sandbox resume` brings it back as it was.
    Pause {
        /// Sandbox name.
        name: String,
    },
    /// Park a running sandbox: a full restore point, then every process is stopped (its
    /// memory freed). Anything that needs it — an exec, a file, a checkpoint, its agent's LLM
    /// answer — wakes it first; `crab sandbox wake` wakes it now.
    Park {
        /// Sandbox name.
        name: String,
    },
    /// Wake a parked sandbox: its park point restored in place, its conversation kept.
    Wake {
        /// Sandbox name.
        name: String,
    },
    /// Resume a paused sandbox from its pause point, or start a stopped or dead one from its
    /// newest restore point.
    Resume {
        /// Sandbox name.
        name: String,
        /// Give it a new deadline this long from now.
        #[arg(long, value_name = "DURATION", value_parser = parse_timeout)]
        timeout: Option<u64>,
        /// What that deadline does: kill or pause.
        #[arg(long, value_name = "ACTION", requires = "timeout", value_parser = ["kill", "pause"])]
        on_timeout: Option<String>,
    },
    /// Stop a sandbox (`docker stop`): a restore point of what it holds now, then every
    /// process killed. Files, record and points stay; `crab sandbox resume` starts it again.
    Stop {
        /// Sandbox name.
        name: String,
        /// Kill at once, without a restore point first (`docker kill`).
        #[arg(long)]
        no_checkpoint: bool,
    },
    /// Say that the sandbox's declared harness changed its own state (a persistent shell's
    /// `cd`, `export`, job): its next `auto` checkpoint dumps the processes once.
    HarnessChanged {
        /// Sandbox name.
        name: String,
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

fn sandbox_rows(v: &[SandboxInfo]) -> Vec<Vec<String>> {
    v.iter()
        .map(|s| {
            vec![
                s.name.clone(),
                s.image.clone(),
                s.state.to_string(),
                age(s.created_at),
                s.processes.to_string(),
                s.bytes_written.map(human_bytes).unwrap_or_else(|| "-".into()),
                s.disk_limit_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
                s.checkpoint_policy.to_string(),
            ]
        })
        .collect()
}

const SANDBOX_HEADER: [&str; 8] =
    ["NAME", "IMAGE", "STATE", "AGE", "PROCS", "WRITTEN", "DISK", "CHECKPOINTS"];

pub(super) async fn run(client: &Client, c: SandboxCmd, json: bool) -> Result<ExitCode, ApiError> {
    match c {
        SandboxCmd::Create {
            image,
            from_remote,
            fs_only,
            name,
            net,
            nat_range,
            memory,
            pids,
            cpus,
            disk,
            privileged,
            userns,
            checkpoint_policy,
            harness_cmd,
            harness_path,
            timeout,
            on_timeout,
            mut label,
            no_park,
            env,
        } => {
            if no_park {
                label.push(("crab.park".into(), "never".into()));
            }
            if let Some(src) = from_remote {
                // The new sandbox's network and limits are this caller's (or the daemon's
                // defaults), never the remote point's.
                if privileged {
                    return Err(ApiError::invalid(
                        "--privileged does not apply to --from-remote",
                        "a sandbox built from a remote point always gets the default profile",
                    ));
                }
                let names = name.into_iter().collect();
                let grant = super::remote::Grant {
                    net: Some(net),
                    limits: Limits {
                        memory_bytes: memory,
                        pids_max: pids,
                        cpu_millis: cpus.map(|c| (c * 1000.0) as u64),
                        disk_bytes: disk,
                    },
                };
                return super::remote::from_remote(client, src, names, 1, fs_only, grant, json)
                    .await;
            }
            let req = SandboxCreateRequest {
                image: image.unwrap_or_default(),
                name,
                net,
                nat_range,
                limits: Limits {
                    memory_bytes: memory,
                    pids_max: pids,
                    cpu_millis: cpus.map(|c| (c * 1000.0) as u64),
                    disk_bytes: disk,
                },
                privileged,
                userns,
                checkpoint_policy: Some(checkpoint_policy),
                harness: crab_common::api::HarnessSpec { cmd: harness_cmd, paths: harness_path },
                labels: label.into_iter().collect(),
                env: env.into_iter().collect(),
                timeout_s: timeout,
                on_timeout,
                template: None,
            };
            let s: SandboxInfo = client.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
            if json {
                print_json(&s);
            } else {
                println!("{}", s.name);
            }
        }
        SandboxCmd::Update { name, checkpoint_policy, timeout, on_timeout } => {
            if checkpoint_policy.is_none() && timeout.is_none() {
                return Err(ApiError::invalid(
                    "nothing to update",
                    "give --checkpoint-policy and/or --timeout",
                ));
            }
            let req = SandboxUpdateRequest {
                checkpoint_policy,
                timeout_s: timeout,
                on_timeout,
                extend_only: false,
            };
            let s: SandboxInfo =
                client.call(Method::PATCH, &format!("/v1/sandboxes/{name}"), Some(&req)).await?;
            if json {
                print_json(&s);
            } else {
                println!(
                    "{}: checkpoint policy {}, {}",
                    s.name,
                    s.checkpoint_policy,
                    deadline_text(s.deadline)
                );
            }
        }
        SandboxCmd::Pause { name } => {
            let l: Lifecycle = client
                .call::<(), _>(Method::POST, &format!("/v1/sandboxes/{name}/pause"), None)
                .await?;
            if json {
                print_json(&l);
            } else {
                println!("{}: paused (point {})", l.sandbox, l.point.as_deref().unwrap_or("-"));
            }
        }
        SandboxCmd::Park { name } => {
            let l: Lifecycle = client
                .call::<(), _>(Method::POST, &format!("/v1/sandboxes/{name}/park"), None)
                .await?;
            if json {
                print_json(&l);
            } else {
                println!("{}: parked (point {})", l.sandbox, l.point.as_deref().unwrap_or("-"));
            }
        }
        SandboxCmd::Wake { name } => {
            let l: Lifecycle = client
                .call::<(), _>(Method::POST, &format!("/v1/sandboxes/{name}/wake"), None)
                .await?;
            if json {
                print_json(&l);
            } else {
                match &l.point {
                    Some(p) => println!("{}: {} (woke from point {p})", l.sandbox, l.state),
                    None => println!("{}: {} (was not parked)", l.sandbox, l.state),
                }
            }
        }
        SandboxCmd::Resume { name, timeout, on_timeout } => {
            let req =
                ResumeRequest { ensure: false, timeout_s: timeout, on_timeout, extend_only: false };
            let l: Lifecycle = client
                .call(Method::POST, &format!("/v1/sandboxes/{name}/resume"), Some(&req))
                .await?;
            if json {
                print_json(&l);
            } else {
                println!(
                    "{}: {} (from point {})",
                    l.sandbox,
                    l.state,
                    l.point.as_deref().unwrap_or("-")
                );
            }
        }
        SandboxCmd::Stop { name, no_checkpoint } => {
            let req = StopRequest { checkpoint: !no_checkpoint };
            let l: Lifecycle = client
                .call(Method::POST, &format!("/v1/sandboxes/{name}/stop"), Some(&req))
                .await?;
            if json {
                print_json(&l);
            } else {
                match &l.point {
                    Some(p) => println!("{}: {} (point {p})", l.sandbox, l.state),
                    None => println!("{}: {}", l.sandbox, l.state),
                }
            }
        }
        SandboxCmd::HarnessChanged { name } => {
            let v: serde_json::Value = client
                .call::<(), _>(Method::POST, &format!("/v1/sandboxes/{name}/harness/changed"), None)
                .await?;
            if json {
                print_json(&v);
            } else {
                println!("{name}: the next checkpoint dumps the processes");
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

/// `--timeout`: seconds, or a duration with a unit (90s, 5m, 2h), 1 s ..= 24 h.
fn parse_timeout(s: &str) -> Result<u64, String> {
    match parse_timeout_or_zero(s)? {
        0 => Err("a timeout is at least 1 second".into()),
        n => Ok(n),
    }
}

/// [`parse_timeout`], where 0 (clear the deadline) is allowed.
fn parse_timeout_or_zero(s: &str) -> Result<u64, String> {
    let secs = match s.parse::<u64>() {
        Ok(n) => n,
        Err(_) => humantime::parse_duration(s)
            .map_err(|e| format!("{s:?} is not a duration (e.g. 300, 90s, 5m, 2h): {e}"))?
            .as_secs(),
    };
    if secs > crab_common::life::MAX_TIMEOUT_S {
        return Err(format!("{s} is longer than 24 hours"));
    }
    Ok(secs)
}

/// `KEY=VALUE`.
fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// What a deadline is, for a line of output.
fn deadline_text(d: Option<crab_common::life::Deadline>) -> String {
    match d {
        None => "no deadline".into(),
        Some(d) => {
            let left = d.at_ms.saturating_sub(crab_common::clock::now_ms()) / 1000;
            format!("{} in {left} s", d.on)
        }
    }
}
