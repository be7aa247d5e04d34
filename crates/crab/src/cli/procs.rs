//! Background processes from the command line: `crab exec -d` starts one (prints its id),
//! `crab ps SB` lists them, `crab logs SB ID [-f]` replays a process's output and follows it
//! (exiting with its exit code once it ended), `crab signal SB ID [--signal TERM]` signals it.
//! Every string here came back from the sandbox: it is shown with control characters escaped.

use std::io::Write;
use std::process::ExitCode;

use base64::Engine;
use clap::Args;
use crab_client::Client;
use crab_common::api::{ExecFrame, ProcInfo, ProcStartRequest, ProcState};
use crab_common::ApiError;

use super::print_json;
use crate::output::{age, human_bytes, print_error, table};

#[derive(Debug, Args)]
pub(super) struct PsArgs {
    /// Sandbox name.
    sandbox: String,
}

#[derive(Debug, Args)]
pub(super) struct LogsArgs {
    /// Follow the output until the process ends (then exit with its exit code).
    #[arg(short = 'f', long)]
    follow: bool,
    /// Sandbox name.
    sandbox: String,
    /// Process id (from `crab exec -d` or `crab ps`).
    id: String,
}

#[derive(Debug, Args)]
pub(super) struct SignalArgs {
    /// Signal name (TERM, KILL, INT, HUP, USR1, ...) or number.
    #[arg(short = 's', long, default_value = "TERM")]
    signal: String,
    /// Sandbox name.
    sandbox: String,
    /// Process id.
    id: String,
}

/// Text from the sandbox made safe for a terminal.
fn shown(s: &str) -> String {
    s.chars()
        .flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] })
        .collect()
}

fn state(p: &ProcInfo) -> String {
    match (p.state, p.exit_code) {
        (ProcState::Running, _) => "running".into(),
        (ProcState::Exited, Some(c)) => format!("exited ({c})"),
        (ProcState::Exited, None) => "exited".into(),
        (ProcState::Lost, _) => "lost".into(),
    }
}

/// `crab exec -d`: start `req` in the background and print its id.
pub(super) async fn exec_detached(
    client: &Client,
    sandbox: &str,
    req: ProcStartRequest,
    json: bool,
) -> ExitCode {
    match client.proc_start(sandbox, &req).await {
        Ok(p) => {
            if json {
                print_json(&p);
            } else {
                println!("{}", p.id);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            if json {
                print_json(&e);
            }
            print_error(&e);
            ExitCode::from(125)
        }
    }
}

/// `crab ps SB`.
pub(super) async fn ps(client: &Client, a: PsArgs, json: bool) -> Result<ExitCode, ApiError> {
    let v = client.proc_list(&a.sandbox).await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = v
        .iter()
        .map(|p| {
            vec![
                p.id.clone(),
                p.pid.map(|x| x.to_string()).unwrap_or_else(|| "-".into()),
                state(p),
                age(p.started_at),
                human_bytes(p.stdout_bytes + p.stderr_bytes),
                p.tag.as_deref().map(shown).unwrap_or_default(),
                shown(&p.cmd.join(" ")),
            ]
        })
        .collect();
    table(&["ID", "PID", "STATE", "STARTED", "OUTPUT", "TAG", "COMMAND"], &rows);
    Ok(ExitCode::SUCCESS)
}

/// `crab logs SB ID [-f]`: the output so far (and with `-f` until it ends); the exit code is
/// the process's once it ended, 0 while it runs.
pub(super) async fn logs(client: &Client, a: LogsArgs, json: bool) -> Result<ExitCode, ApiError> {
    let exit = print_output(client, &a.sandbox, &a.id, a.follow, json).await?;
    Ok(ExitCode::from(exit.unwrap_or(0).clamp(0, 255) as u8))
}

/// Copy the output of process `id` of `sandbox` to ours (replayed from its start; with
/// `follow` until it ends); its exit code once it ended.
pub(super) async fn print_output(
    client: &Client,
    sandbox: &str,
    id: &str,
    follow: bool,
    json: bool,
) -> Result<Option<i32>, ApiError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut exit: Option<i32> = None;
    let mut failure: Option<ApiError> = None;
    client
        .proc_output(sandbox, id, (0, 0), follow, |f| match f {
            ExecFrame::Stdout { d } => {
                let bytes = b64.decode(d).unwrap_or_default();
                if json {
                    out.extend_from_slice(&bytes);
                } else {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&bytes);
                    let _ = o.flush();
                }
            }
            ExecFrame::Stderr { d } => {
                let bytes = b64.decode(d).unwrap_or_default();
                if json {
                    err.extend_from_slice(&bytes);
                } else {
                    let mut o = std::io::stderr().lock();
                    let _ = o.write_all(&bytes);
                    let _ = o.flush();
                }
            }
            ExecFrame::Exit { code, .. } => exit = Some(code),
            ExecFrame::Error { error } => failure = Some(error),
        })
        .await?;
    if let Some(e) = failure {
        return Err(e);
    }
    if json {
        print_json(&serde_json::json!({
            "stdout": String::from_utf8_lossy(&out),
            "stderr": String::from_utf8_lossy(&err),
            "exit_code": exit,
        }));
    }
    Ok(exit)
}

/// `crab signal SB ID [--signal SIG]`.
pub(super) async fn signal(
    client: &Client,
    a: SignalArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let p = client.proc_signal(&a.sandbox, &a.id, &a.signal).await?;
    if json {
        print_json(&p);
    } else {
        println!("{}", p.id);
    }
    Ok(ExitCode::SUCCESS)
}
