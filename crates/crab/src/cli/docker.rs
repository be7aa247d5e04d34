//! `crab docker …` (also `crab-docker`, a link to `crab`): a docker-CLI front for harnesses that
//! shell out to `docker`, translated to the same daemon calls as the rest of the CLI.
//!
//! A container is a sandbox; its name is its id. `run` creates a sandbox from an image (and
//! starts its command as a background process with `-d`), `exec` is `crab exec`, `stop` publishes a restore
//! point and then kills the sandbox's processes (files and points stay; `start` restores the
//! newest point), `kill` stops without a checkpoint, `rm` removes (with `-f` also a running
//! one), `ps` and `inspect` describe, `logs` prints the output of `run -d`'s command (a background
//! process of the sandbox, tagged `docker-main`), `cp` copies files and trees in and out (`docker_cp.rs`).
//! Exit codes follow docker's: the command's own, 125 when Crab failed.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use crab_client::{Client, Method};
use crab_common::api::{
    ExecRequest, Limits, NetMode, ProcStartRequest, SandboxCreateRequest, SandboxInfo,
    SandboxState, VersionInfo,
};
use crab_common::ApiError;

use super::exec::exec_with_stdin;
use super::{parse_size, print_json};
use crate::output::{age, print_error, table};

#[path = "docker_cp.rs"]
mod cp;

/// The tag of a container's main process (`run -d`), which `logs` prints.
const MAIN_TAG: &str = "docker-main";

#[derive(Debug, Subcommand)]
pub(super) enum DockerCmd {
    /// Create a sandbox from an image and run a command in it (`-d`: detached; prints the name).
    Run(RunArgs),
    /// Run a command in a running sandbox.
    Exec(DockerExecArgs),
    /// Print the output of a container's main process (`run -d`); `-f` follows it.
    Logs {
        /// Follow the output until the process ends.
        #[arg(short = 'f', long = "follow")]
        follow: bool,
        /// Sandbox name.
        name: String,
    },
    /// Publish a restore point, then kill every process (files and restore points stay).
    Stop {
        /// Accepted for compatibility; there is no grace period (the checkpoint keeps the state).
        #[arg(short = 't', long = "time")]
        time: Option<u64>,
        /// Sandbox names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Start stopped sandboxes again from their newest restore point.
    Start {
        /// Sandbox names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Kill every process at once, without a checkpoint (files and restore points stay).
    Kill {
        /// Only KILL is supported.
        #[arg(short = 's', long = "signal")]
        signal: Option<String>,
        /// Sandbox names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Remove sandboxes and their restore points (`-f`: also running ones).
    Rm {
        /// Remove a running sandbox too.
        #[arg(short = 'f', long = "force")]
        force: bool,
        /// Accepted for compatibility (a sandbox has no volumes).
        #[arg(short = 'v', long = "volumes")]
        volumes: bool,
        /// Sandbox names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// List running sandboxes (`-a`: all).
    Ps {
        /// Show stopped ones too.
        #[arg(short = 'a', long = "all")]
        all: bool,
        /// Names only.
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        /// Accepted for compatibility.
        #[arg(long = "no-trunc")]
        no_trunc: bool,
    },
    /// Describe sandboxes as `docker inspect` does (a JSON array; `-f '{{.State.Running}}'`).
    Inspect {
        /// A Go-template subset: `{{.Path.To.Field}}` and `{{json .Path}}`.
        #[arg(short = 'f', long = "format")]
        format: Option<String>,
        /// Sandbox names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Copy files and directory trees between the host and a sandbox: `cp SRC NAME:DST`,
    /// `cp NAME:SRC DST`; `-` is a tar stream on stdin (extracted into the directory DST) or
    /// stdout. `SRC/.` copies a directory's contents.
    Cp {
        /// Keep the archive's owners (uid/gid); without it copied files belong to root.
        #[arg(short = 'a', long = "archive")]
        archive: bool,
        /// Follow symlinks in SRC (copy what they point at).
        #[arg(short = 'L', long = "follow-link")]
        follow_link: bool,
        /// Accepted for compatibility (no progress is printed).
        #[arg(short = 'q', long = "quiet")]
        quiet: bool,
        /// Source: a host path, `NAME:PATH` or `-`.
        src: String,
        /// Destination: a host path, `NAME:PATH` or `-`.
        dst: String,
    },
    /// Client and daemon versions.
    Version,
}

#[derive(Debug, Args)]
pub(super) struct RunArgs {
    /// Detached: start the command in the background and print the sandbox's name.
    #[arg(short = 'd', long = "detach")]
    detach: bool,
    /// Sandbox name (generated when absent).
    #[arg(long)]
    name: Option<String>,
    /// Working directory (created) for the command.
    #[arg(short = 'w', long = "workdir")]
    workdir: Option<String>,
    /// Environment variable KEY=VALUE, or KEY to pass ours (repeatable).
    #[arg(short = 'e', long = "env")]
    env: Vec<String>,
    /// Without -d: remove the sandbox when the command ends. With -d it is kept on `stop`
    /// (its restore points are the point of Crab); `rm -f` removes it.
    #[arg(long)]
    rm: bool,
    /// Pass standard input through (without -d).
    #[arg(short = 'i', long = "interactive")]
    interactive: bool,
    /// Accepted for compatibility (no terminal is allocated).
    #[arg(short = 't', long = "tty")]
    tty: bool,
    /// Network: private (the default: own namespace, loopback only), bridge or nat
    /// (masqueraded egress, as docker's bridge), none, or host.
    #[arg(long = "network", visible_alias = "net", default_value = "private")]
    network: String,
    /// Memory limit, e.g. 512m.
    #[arg(short = 'm', long = "memory", value_parser = parse_size)]
    memory: Option<u64>,
    /// CPU limit in cores.
    #[arg(long)]
    cpus: Option<f64>,
    /// Maximum number of tasks.
    #[arg(long = "pids-limit")]
    pids_limit: Option<u64>,
    /// UNSAFE: no security profile (see `crab sandbox create --privileged`).
    #[arg(long)]
    privileged: bool,
    /// User namespace, as Docker's `--userns`: `host` (UNSAFE: uid 0 inside is the host's
    /// root) or `private` (the default: Crab's user namespace; see `crab sandbox create
    /// --userns`).
    #[arg(long, value_name = "MODE", value_parser = ["private", "host"])]
    userns: Option<String>,
    /// Accepted for compatibility (the sandbox's pid 1 is always Crab's reaper).
    #[arg(long)]
    init: bool,
    /// The account the command runs as (default: the image's `User`, else root).
    #[arg(short = 'u', long = "user")]
    user: Option<String>,
    /// Override the image's entrypoint (`""` clears it).
    #[arg(long)]
    entrypoint: Option<String>,
    /// Bind mounts are not supported: copy files in with `crab docker cp` instead.
    #[arg(short = 'v', long = "volume")]
    volume: Vec<String>,
    /// Image.
    image: String,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    cmd: Vec<String>,
}

#[derive(Debug, Args)]
pub(super) struct DockerExecArgs {
    /// Pass standard input through.
    #[arg(short = 'i', long = "interactive")]
    interactive: bool,
    /// Accepted for compatibility (no terminal is allocated).
    #[arg(short = 't', long = "tty")]
    tty: bool,
    /// Working directory inside the sandbox.
    #[arg(short = 'w', long = "workdir")]
    workdir: Option<String>,
    /// Environment variable KEY=VALUE, or KEY to pass ours (repeatable).
    #[arg(short = 'e', long = "env")]
    env: Vec<String>,
    /// Only root (the sandbox's one user) is supported.
    #[arg(short = 'u', long = "user")]
    user: Option<String>,
    /// Sandbox name.
    name: String,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    cmd: Vec<String>,
}

/// docker's `-e KEY` passes the caller's value of KEY (nothing when it is unset).
fn env_pairs(env: Vec<String>) -> Vec<String> {
    env.into_iter()
        .filter_map(|e| {
            if e.contains('=') {
                Some(e)
            } else {
                std::env::var(&e).ok().map(|v| format!("{e}={v}"))
            }
        })
        .collect()
}

fn net_mode(s: &str) -> Result<NetMode, ApiError> {
    match s {
        "private" => Ok(NetMode::Private),
        "bridge" | "nat" => Ok(NetMode::Nat),
        "none" => Ok(NetMode::None),
        "host" => Ok(NetMode::Host),
        other => Err(ApiError::invalid(
            format!("unsupported --network {other:?}"),
            "use private (own namespace, loopback only), bridge (= nat: masqueraded egress), none or host",
        )),
    }
}

/// Entry point: the exit code follows docker's (125 when Crab failed).
pub(super) async fn run(client: &Client, c: DockerCmd, json: bool) -> ExitCode {
    match dispatch(client, c, json).await {
        Ok(code) => code,
        Err(e) => {
            print_error(&e);
            ExitCode::from(125)
        }
    }
}

async fn dispatch(client: &Client, c: DockerCmd, json: bool) -> Result<ExitCode, ApiError> {
    match c {
        DockerCmd::Run(a) => run_container(client, a, json).await,
        DockerCmd::Exec(a) => {
            let _ = a.tty;
            let req = ExecRequest {
                cmd: a.cmd,
                env: env_pairs(a.env),
                workdir: a.workdir,
                user: a.user,
                timeout_s: None,
                stdin_b64: None,
                stdin_session: None,
            };
            Ok(exec_with_stdin(client, &a.name, req, a.interactive, json).await)
        }
        DockerCmd::Logs { follow, name } => {
            let p = client.proc_get(&name, &format!("tag:{MAIN_TAG}")).await.map_err(|e| {
                if e.code == crab_common::ErrorCode::ProcessNotFound {
                    ApiError::invalid(
                        format!("{name} has no main process to show the logs of"),
                        "`docker logs` shows the output of the command given to `run -d`",
                    )
                } else {
                    e
                }
            })?;
            super::procs::print_output(client, &name, &p.id, follow, json).await?;
            Ok(ExitCode::SUCCESS)
        }
        DockerCmd::Stop { time: _, names } => lifecycle(client, names, "stop", Some(true)).await,
        DockerCmd::Kill { signal, names } => {
            if let Some(s) = signal.as_deref().filter(|s| !matches!(*s, "KILL" | "SIGKILL" | "9")) {
                return Err(ApiError::invalid(
                    format!("signal {s:?} is not supported"),
                    "only KILL (the default); to signal one process use `crab exec NAME kill -s SIG PID`",
                ));
            }
            lifecycle(client, names, "stop", Some(false)).await
        }
        DockerCmd::Start { names } => lifecycle(client, names, "start", None).await,
        DockerCmd::Rm { force, volumes: _, names } => {
            for name in names {
                let state = get(client, &name).await?.state;
                if !force && matches!(state, SandboxState::Running | SandboxState::Parked) {
                    return Err(ApiError::new(
                        crab_common::ErrorCode::Conflict,
                        format!("cannot remove running sandbox {name:?}"),
                        "stop it first (`crab docker stop`), or use `rm -f`",
                    ));
                }
                let _: serde_json::Value = client
                    .call::<(), _>(
                        Method::DELETE,
                        &format!("/v1/sandboxes/{name}?force=true"),
                        None,
                    )
                    .await?;
                println!("{name}");
            }
            Ok(ExitCode::SUCCESS)
        }
        DockerCmd::Ps { all, quiet, no_trunc: _ } => {
            let v: Vec<SandboxInfo> =
                client.call::<(), _>(Method::GET, "/v1/sandboxes", None).await?;
            let shown: Vec<&SandboxInfo> = v
                .iter()
                .filter(|s| all || matches!(s.state, SandboxState::Running | SandboxState::Parked))
                .collect();
            if json {
                print_json(&shown);
            } else if quiet {
                for s in shown {
                    println!("{}", s.name);
                }
            } else {
                let rows: Vec<Vec<String>> = shown
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            s.image.clone(),
                            age(s.created_at),
                            status(s).to_string(),
                            s.name.clone(),
                        ]
                    })
                    .collect();
                table(&["CONTAINER ID", "IMAGE", "CREATED", "STATUS", "NAMES"], &rows);
            }
            Ok(ExitCode::SUCCESS)
        }
        DockerCmd::Inspect { format, names } => {
            let mut docs = Vec::new();
            for name in &names {
                docs.push(inspect_doc(&get(client, name).await?));
            }
            match format {
                Some(f) => {
                    for d in &docs {
                        println!("{}", render_template(&f, d));
                    }
                }
                None => print_json(&docs),
            }
            Ok(ExitCode::SUCCESS)
        }
        DockerCmd::Cp { archive, follow_link, quiet: _, src, dst } => {
            cp::cp(client, &src, &dst, cp::CpOpts { archive, follow: follow_link }).await
        }
        DockerCmd::Version => {
            let v: VersionInfo = client.call::<(), _>(Method::GET, "/v1/version", None).await?;
            let doc = serde_json::json!({
                "Client": {"Version": env!("CARGO_PKG_VERSION"), "Platform": {"Name": "crab docker"}},
                "Server": {"Version": v.version, "ApiVersion": v.api.to_string(), "StateDir": v.state_dir},
            });
            if json {
                print_json(&doc);
            } else {
                println!("Client: crab docker {}", env!("CARGO_PKG_VERSION"));
                println!(
                    "Server: crab daemon {} (API {}), state {}",
                    v.version, v.api, v.state_dir
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn get(client: &Client, name: &str) -> Result<SandboxInfo, ApiError> {
    client.call::<(), _>(Method::GET, &format!("/v1/sandboxes/{name}"), None).await
}

/// `stop`/`kill` (`checkpoint` Some) or `start` (None): one call per name, printing each.
async fn lifecycle(
    client: &Client,
    names: Vec<String>,
    verb: &str,
    checkpoint: Option<bool>,
) -> Result<ExitCode, ApiError> {
    for name in names {
        let path = format!("/v1/sandboxes/{name}/{verb}");
        let _: serde_json::Value = match checkpoint {
            Some(c) => {
                let body = serde_json::json!({ "checkpoint": c });
                client.call(Method::POST, &path, Some(&body)).await?
            }
            None => client.call::<(), _>(Method::POST, &path, None).await?,
        };
        println!("{name}");
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_container(client: &Client, a: RunArgs, json: bool) -> Result<ExitCode, ApiError> {
    if !a.volume.is_empty() {
        return Err(ApiError::invalid(
            format!("bind mounts are not supported (-v {})", a.volume.join(", -v ")),
            "copy files in after `run -d` with `crab docker cp SRC NAME:DIR`",
        ));
    }
    let _ = (a.tty, a.init);
    let req = SandboxCreateRequest {
        name: a.name,
        net: net_mode(&a.network)?,
        limits: Limits {
            memory_bytes: a.memory,
            pids_max: a.pids_limit,
            cpu_millis: a.cpus.map(|c| (c * 1000.0) as u64),
            ..Default::default()
        },
        privileged: a.privileged,
        userns: a.userns,
        ..SandboxCreateRequest::new(a.image)
    };
    // An image given as a registry reference is the local image pulled from it (on first use).
    let s: SandboxInfo = client.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
    let name = s.name.clone();
    // The image's entrypoint and command, as `docker run` composes them.
    let images: Vec<crab_common::api::ImageInfo> =
        client.call::<(), _>(Method::GET, "/v1/images", None).await?;
    let mut config =
        images.into_iter().find(|i| i.name == s.image).map(|i| i.config).unwrap_or_default();
    if let Some(e) = &a.entrypoint {
        config.entrypoint = if e.is_empty() { Vec::new() } else { vec![e.clone()] };
        if a.cmd.is_empty() {
            config.cmd.clear(); // docker: --entrypoint resets the image's CMD
        }
    }
    let argv = config.run_argv(&a.cmd);
    let env = env_pairs(a.env);
    if let Some(w) = &a.workdir {
        let mk = ExecRequest {
            cmd: vec!["mkdir".into(), "-p".into(), "--".into(), w.clone()],
            user: Some("root".into()),
            ..Default::default()
        };
        let code = exec_quiet(client, &name, mk).await?;
        if code != 0 {
            return Err(ApiError::invalid(
                format!("could not create the working directory {w:?} (mkdir exited {code})"),
                "pick a path the image can hold",
            ));
        }
    }
    if a.detach {
        if !argv.is_empty() {
            // The container's main process: a background process of the sandbox tagged
            // `MAIN_TAG` (its output kept for `docker logs`, its exit status kept too).
            let req = ProcStartRequest {
                cmd: argv,
                env,
                cwd: a.workdir,
                user: a.user,
                tag: Some(MAIN_TAG.into()),
                ..Default::default()
            };
            client.proc_start(&name, &req).await?;
        }
        if json {
            print_json(&s);
        } else {
            println!("{name}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let cmd = if argv.is_empty() { vec!["sh".to_string()] } else { argv };
    let req = ExecRequest {
        cmd,
        env,
        workdir: a.workdir,
        user: a.user,
        timeout_s: None,
        stdin_b64: None,
        stdin_session: None,
    };
    let code = exec_with_stdin(client, &name, req, a.interactive, json).await;
    if a.rm {
        let _: serde_json::Value = client
            .call::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{name}?force=true"), None)
            .await?;
    }
    Ok(code)
}

/// Run a helper command, discarding its output; its exit code.
async fn exec_quiet(client: &Client, name: &str, req: ExecRequest) -> Result<i32, ApiError> {
    let mut code = None;
    let mut failure = None;
    client
        .stream(&format!("/v1/sandboxes/{name}/exec"), &req, |f: crab_common::api::ExecFrame| {
            match f {
                crab_common::api::ExecFrame::Exit { code: c, .. } => code = Some(c),
                crab_common::api::ExecFrame::Error { error } => failure = Some(error),
                _ => {}
            }
        })
        .await?;
    if let Some(e) = failure {
        return Err(e);
    }
    code.ok_or_else(|| ApiError::internal("the daemon ended the exec without an exit status"))
}

fn status(s: &SandboxInfo) -> &'static str {
    match s.state {
        SandboxState::Running => "Up",
        SandboxState::Parked => "Up (parked)",
        SandboxState::Paused => "Paused",
        SandboxState::Dead | SandboxState::Stopped | SandboxState::Retired => "Exited",
    }
}

/// The `docker inspect` document of a sandbox (the fields harnesses read, plus `Crab`: the
/// daemon's own description).
fn inspect_doc(s: &SandboxInfo) -> serde_json::Value {
    // Parked is running to a docker client: its next exec wakes it.
    let running = matches!(s.state, SandboxState::Running | SandboxState::Parked);
    let created = std::time::UNIX_EPOCH + std::time::Duration::from_secs(s.created_at);
    serde_json::json!({
        "Id": s.name,
        "Name": format!("/{}", s.name),
        "Created": humantime::format_rfc3339_seconds(created).to_string(),
        "Image": s.image,
        "State": {
            "Status": if running { "running" } else { "exited" },
            "Running": running,
            "Paused": s.state == SandboxState::Paused,
            "Pid": if running { s.init_pid } else { 0 },
            "ExitCode": 0,
        },
        "Config": {"Image": s.image, "Hostname": s.hostname},
        "HostConfig": {"NetworkMode": match s.net {
            NetMode::Private => "private",
            NetMode::Nat => "bridge",
            NetMode::None => "none",
            NetMode::Host => "host",
        }},
        "Crab": s,
    })
}

/// A subset of Go templates: literal text, `{{.A.B}}` and `{{json .A}}`.
fn render_template(t: &str, doc: &serde_json::Value) -> String {
    let mut out = String::new();
    let mut rest = t;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let Some(len) = rest[start..].find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let expr = rest[start + 2..start + len].trim();
        let (as_json, path) = match expr.strip_prefix("json ") {
            Some(p) => (true, p.trim()),
            None => (false, expr),
        };
        let mut v = Some(doc);
        for key in path.trim_start_matches('.').split('.').filter(|k| !k.is_empty()) {
            v = v.and_then(|x| x.get(key));
        }
        match v {
            None => out.push_str("<no value>"),
            Some(serde_json::Value::String(s)) if !as_json => out.push_str(s),
            Some(x) => out.push_str(&x.to_string()),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_render_paths_and_json() {
        let d = serde_json::json!({"State": {"Running": true, "Status": "running"}, "Name": "/x"});
        assert_eq!(render_template("{{.State.Running}}", &d), "true");
        assert_eq!(render_template("{{ .State.Status }}:{{.Name}}", &d), "running:/x");
        assert_eq!(
            render_template("{{json .State}}", &d),
            r#"{"Running":true,"Status":"running"}"#
        );
        assert_eq!(render_template("{{.Nope}}", &d), "<no value>");
    }

    #[test]
    fn env_passes_ours_for_bare_keys() {
        std::env::set_var("CRAB_DOCKER_TEST_K", "v");
        let e = env_pairs(vec!["A=1".into(), "CRAB_DOCKER_TEST_K".into(), "CRAB_UNSET_X".into()]);
        assert_eq!(e, vec!["A=1".to_string(), "CRAB_DOCKER_TEST_K=v".to_string()]);
    }
}
