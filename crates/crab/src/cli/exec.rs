//! `crab exec`: run a command in a sandbox, streaming its output (flags as `docker exec`).

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
    /// Pass standard input through.
    #[arg(short = 'i', long = "interactive")]
    interactive: bool,
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
    let stdin_b64 = if a.interactive {
        match stdin_b64() {
            Ok(s) => Some(s),
            Err(e) => {
                print_error(&e);
                return ExitCode::from(125);
            }
        }
    } else {
        None
    };
    let req = ExecRequest {
        cmd: a.cmd,
        env: a.env,
        workdir: a.workdir,
        timeout_s: a.timeout,
        stdin_b64,
        stdin_session: None,
    };
    exec_streaming(client, &a.sandbox, req, json).await
}

/// Read all of standard input as base64 (for `-i`).
pub(super) fn stdin_b64() -> Result<String, ApiError> {
    let mut buf = Vec::new();
    std::io::stdin()
        .read_to_end(&mut buf)
        .map_err(|e| ApiError::invalid(format!("reading stdin: {e}"), ""))?;
    Ok(base64::engine::general_purpose::STANDARD.encode(buf))
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
