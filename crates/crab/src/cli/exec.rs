//! `crab exec`: run a command in a sandbox, streaming its output (flags as `docker exec`); with
//! `-d` it starts a background process instead ([`super::procs`]).

use std::io::{Read, Write};
use std::process::ExitCode;

use base64::Engine;
use clap::Args;
use crab_client::Client;
use crab_common::api::{ExecFrame, ExecRequest};
use crab_common::ApiError;
use serde::Serialize;

use super::print_json;
use crate::output::print_error;

#[derive(Debug, Args)]
pub(super) struct ExecArgs {
    /// Seconds after which the command (and whatever holds its output) is killed.
    #[arg(long)]
    timeout: Option<f64>,
    /// Working directory inside the sandbox.
    #[arg(short = 'w', long = "workdir")]
    workdir: Option<String>,
    /// Environment variable KEY=VALUE (repeatable).
    #[arg(short = 'e', long = "env")]
    env: Vec<String>,
    /// Pass standard input through (with `-d`: give the process a stdin fed through the API).
    #[arg(short = 'i', long = "interactive")]
    interactive: bool,
    /// Run it in the background (detached, kept across daemon restarts, restores and forks);
    /// prints its id for `crab logs`, `crab ps`, `crab signal`.
    #[arg(short = 'd', long = "detach")]
    detach: bool,
    /// The account to run as: `name`, `uid`, `name:group` or `uid:gid` (default: the image's
    /// `User`, else root).
    #[arg(short = 'u', long = "user")]
    user: Option<String>,
    /// With `-d`: a tag to find the process by.
    #[arg(long, requires = "detach")]
    tag: Option<String>,
    /// Sandbox name.
    sandbox: String,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    cmd: Vec<String>,
}

#[derive(Debug, Serialize)]
struct ExecResult {
    stdout: String,
    stderr: String,
    code: i32,
    timed_out: bool,
    duration_ms: f64,
}

pub(super) async fn run(client: &Client, a: ExecArgs, json: bool) -> ExitCode {
    if a.detach {
        if a.timeout.is_some() {
            print_error(&ApiError::invalid(
                "--timeout does not apply to `crab exec -d`",
                "stop a background process with `crab signal SB ID`",
            ));
            return ExitCode::from(125);
        }
        let req = crab_common::api::ProcStartRequest {
            cmd: a.cmd,
            env: a.env,
            cwd: a.workdir,
            user: a.user,
            tag: a.tag,
            stdin: a.interactive,
        };
        return super::procs::exec_detached(client, &a.sandbox, req, json).await;
    }
    // With -i, stdin streams to the command as it arrives (an exec session), not read whole
    // first: `crab exec -i SB -- cat` answers line by line, and any size goes through.
    let req = ExecRequest {
        cmd: a.cmd,
        env: a.env,
        workdir: a.workdir,
        user: a.user,
        timeout_s: a.timeout,
        stdin_b64: None,
        stdin_session: None,
    };
    exec_with_stdin(client, &a.sandbox, req, a.interactive, json).await
}

/// Run `req` in `sandbox`, our stdin streamed to it through an exec session when `interactive`
/// (as it arrives, any size: `crab exec -i`, `crab docker exec -i`).
pub(super) async fn exec_with_stdin(
    client: &Client,
    sandbox: &str,
    mut req: ExecRequest,
    interactive: bool,
    json: bool,
) -> ExitCode {
    let session = interactive.then(|| {
        let mut b = [0u8; 6];
        let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
        let tag: String = b.iter().map(|x| format!("{x:02x}")).collect();
        format!("cli-{}-{tag}", std::process::id())
    });
    req.stdin_session = session.clone();
    let pump = session.map(|s| tokio::spawn(pump_stdin(client.clone(), sandbox.to_string(), s)));
    let code = exec_streaming(client, sandbox, req, json).await;
    if let Some(p) = pump {
        p.abort();
    }
    code
}

/// Copy our stdin to exec session `session` of `sandbox` as it arrives (raw bodies, each what
/// one read gave, up to 1 MiB), then close it.
async fn pump_stdin(client: Client, sandbox: String, session: String) {
    // A thread of its own reads stdin: a blocking read (a terminal, an idle pipe) must not keep
    // the runtime from shutting down when the command is done.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = stdin.read(&mut buf).unwrap_or(0);
            if tx.blocking_send(buf[..n].to_vec()).is_err() || n == 0 {
                return;
            }
        }
    });
    loop {
        let chunk = rx.recv().await.unwrap_or_default();
        let n = chunk.len();
        // The session is registered when the exec request reaches the daemon; this may be
        // sent first.
        let mut tries = 0;
        loop {
            match client.exec_stdin(&sandbox, &session, chunk.clone(), n == 0).await {
                Ok(_) => break,
                Err(e) if tries < 100 && e.message.contains("no open exec session") => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                // The command stopped reading or ended: the rest of stdin goes nowhere.
                Err(_) => return,
            }
        }
        if n == 0 {
            return;
        }
    }
}

/// Run one exec request, copying its output to ours as it arrives; the exit code is the
/// command's (125 when Crab itself failed).
pub(super) async fn exec_streaming(
    client: &Client,
    sandbox: &str,
    req: ExecRequest,
    json: bool,
) -> ExitCode {
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
        .stream(&format!("/v1/sandboxes/{sandbox}/exec"), &req, |f: ExecFrame| match f {
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
