//! envd's `process.Process` RPCs as a codec over the host's one background-process service
//! (`crab_sandbox::procs`, reached through [`Backend`]'s `proc_*` calls): `Start` starts a
//! detached process (the call's user, cwd, tag, stdin; the sandbox's environment is the
//! host's) and streams its output; `Connect` follows a running one from now on (or tells how
//! an ended one ended); `List`, `SendInput`, `CloseStdin`, `SendSignal` are one call each. The
//! front door keeps nothing about a process: its pid is the supervisor's pid in the sandbox
//! (`pid:N` selects it), its state lives in the sandbox, so a daemon restart, a pause and a
//! resume, a fork all keep it.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine;
use crab_common::api::{ExecFrame, ProcInfo, ProcStartRequest, ProcState, SandboxState};
use crab_common::{ApiError, ErrorCode};
use tokio::sync::mpsc;

use crate::backend::Backend;
use crate::connect::{self, CallKind, Code, ConnectError};
use crate::envd::{self, DataEvent, EndEvent, EventResponse, ProcessEvent};
use crate::server::{api_to_connect, call_user, dead_error, envd_sandbox, unsupported, Shared};
use crate::user;

/// `POST /process.Process/{method}`.
pub async fn process<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let stream = connect::call_kind(&headers) == Some(CallKind::Stream);
    let r = match method.as_str() {
        "Start" | "Connect" if stream => process_stream(&e2b, &method, &headers, &raw).await,
        "Start" | "Connect" => Err(unsupported(&method, &headers)),
        _ if stream => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{method} (a streaming call) is not supported by Crab's E2B front door"),
        )),
        _ => process_unary(&e2b, &method, &headers, &raw).await,
    };
    match r {
        Ok(r) => r,
        Err(e) if stream => e.stream_response(),
        Err(e) => e.unary_response(),
    }
}

/// The service's selector for envd's (`pid:N` or `tag:T`).
fn selector(sel: Option<&envd::ProcessSelector>) -> Result<String, ConnectError> {
    match sel {
        Some(envd::ProcessSelector { pid: Some(pid), .. }) => Ok(format!("pid:{pid}")),
        Some(envd::ProcessSelector { tag: Some(tag), .. }) => Ok(format!("tag:{tag}")),
        _ => Err(ConnectError::new(
            Code::InvalidArgument,
            "process selector (pid or tag) is required",
        )),
    }
}

/// The service's error as envd tells it: an unknown process is `not_found`, one that cannot
/// take the call (ended, no stdin) `failed_precondition` (SendInput) or `not_found`.
fn proc_error(e: ApiError, what: &str) -> ConnectError {
    match e.code {
        ErrorCode::ProcessNotFound => ConnectError::new(Code::NotFound, e.message),
        ErrorCode::Conflict if what == "SendInput" || what == "CloseStdin" => ConnectError::new(
            Code::FailedPrecondition,
            format!(
                "{}: start it with stdin=True (its stdin is closed once close_stdin is called)",
                e.message
            ),
        ),
        ErrorCode::Conflict => ConnectError::new(Code::NotFound, e.message),
        _ => api_to_connect(e),
    }
}

fn config_of(p: &ProcInfo) -> envd::ProcessConfig {
    envd::ProcessConfig {
        cmd: p.cmd.first().cloned().unwrap_or_default(),
        args: p.cmd.iter().skip(1).cloned().collect(),
        envs: p
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.into(), v.into()))
            .collect(),
        cwd: p.cwd.clone(),
    }
}

async fn process_unary<B: Backend>(
    e2b: &Shared<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    if connect::call_kind(headers) != Some(CallKind::Unary) {
        return Err(unsupported(method, headers));
    }
    let id = envd_sandbox(e2b, headers).await?;
    let b = &e2b.backend;
    match method {
        "List" => {
            let mut processes: Vec<envd::ProcessInfo> = b
                .proc_list(id.clone())
                .await
                .map_err(api_to_connect)?
                .iter()
                .filter(|p| p.state == ProcState::Running)
                .filter_map(|p| {
                    Some(envd::ProcessInfo {
                        config: config_of(p),
                        pid: p.pid?,
                        tag: p.tag.clone(),
                    })
                })
                .collect();
            processes.sort_by_key(|p| p.pid);
            Ok(connect::unary_ok(&envd::ListResponse { processes }))
        }
        "SendSignal" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            let sig = match req.signal {
                Some(9) => "KILL",
                Some(15) => "TERM",
                other => {
                    return Err(ConnectError::new(
                        Code::InvalidArgument,
                        format!("signal {other:?} is not supported; use SIGKILL or SIGTERM"),
                    ))
                }
            };
            let sel = selector(req.process.as_ref())?;
            b.proc_signal(id, sel, sig.into()).await.map_err(|e| proc_error(e, method))?;
            Ok(connect::unary_ok(&serde_json::json!({})))
        }
        "SendInput" | "CloseStdin" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            let sel = selector(req.process.as_ref())?;
            let r = if method == "SendInput" {
                let data = input_bytes(req.input.as_ref())?;
                b.proc_stdin(id, sel, data).await
            } else {
                b.proc_close_stdin(id, sel).await
            };
            r.map_err(|e| proc_error(e, method))?;
            Ok(connect::unary_ok(&serde_json::json!({})))
        }
        "Update" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            b.proc_get(id, selector(req.process.as_ref())?)
                .await
                .map_err(|e| proc_error(e, method))?;
            Err(ConnectError::new(
                Code::Unimplemented,
                "process.Process/Update (a PTY's size) is not supported: Crab runs E2B commands without a PTY",
            ))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not supported by Crab's E2B front door"),
        )),
    }
}

/// `SendInput`'s bytes: `{"input": {"stdin": base64}}` (a `pty` input is refused).
fn input_bytes(input: Option<&serde_json::Value>) -> Result<Vec<u8>, ConnectError> {
    let bad = |m: &str| ConnectError::new(Code::InvalidArgument, m.to_string());
    let v = input.ok_or_else(|| bad("input is required"))?;
    if v.get("pty").is_some() {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "PTY input is not supported: Crab runs E2B commands without a PTY",
        ));
    }
    let s = v
        .get("stdin")
        .and_then(|s| s.as_str())
        .ok_or_else(|| bad("input.stdin (base64) is required"))?;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| bad(&format!("input.stdin is not base64: {e}")))
}

/// How a process that exited with `code` ended, as Go's envd says it: a signal the service
/// sent (and that killed it) is `signal: killed`/`terminated` with exit code -1.
pub fn end_of(code: i32, signalled: Option<&str>) -> EndEvent {
    let signum = |s: &str| match s {
        "KILL" => Some((9, "killed")),
        "TERM" => Some((15, "terminated")),
        "INT" => Some((2, "interrupt")),
        "HUP" => Some((1, "hangup")),
        _ => None,
    };
    match signalled.and_then(signum) {
        Some((n, word)) if code == 128 + n || code == 255 => EndEvent {
            exit_code: -1,
            exited: false,
            status: format!("signal: {word}"),
            error: None,
        },
        _ => EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
    }
}

/// The end of a process killed with its sandbox.
fn killed_end() -> EndEvent {
    EndEvent { exit_code: -1, exited: false, status: "signal: killed".into(), error: None }
}

/// `Start`: the command starts under the service's supervisor; the start event goes out with
/// its pid, then its output, then its end. `Connect`: a running process's output from now on,
/// or, for one that ended, its end.
async fn process_stream<B: Backend>(
    e2b: &Shared<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    let id = envd_sandbox(e2b, headers).await?;
    let b = &e2b.backend;
    let (p, offsets) = if method == "Start" {
        let req: envd::StartRequest = connect::decode_stream_request(raw)?;
        if req.pty.is_some() {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "PTYs are not supported by Crab's E2B front door; use commands.run",
            ));
        }
        let config = req
            .process
            .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "process is required"))?;
        if config.cmd.is_empty() {
            return Err(ConnectError::new(Code::InvalidArgument, "process.cmd is empty"));
        }
        let user = call_user(headers)?;
        let mut env: Vec<String> = config.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        env.sort();
        let mut cmd = vec![config.cmd.clone()];
        cmd.extend(config.args.iter().cloned());
        let start = ProcStartRequest {
            cmd,
            env,
            cwd: Some(
                config
                    .cwd
                    .clone()
                    .filter(|c| !c.is_empty())
                    .unwrap_or_else(|| user::home_of(&user)),
            ),
            // Always named (root too): without one, a process runs as the image's `User`.
            user: Some(user),
            tag: req.tag.clone(),
            stdin: req.stdin == Some(true),
        };
        let p = b.proc_start(id.clone(), start).await.map_err(|e| match e.code {
            ErrorCode::InvalidRequest => ConnectError::new(Code::InvalidArgument, e.message),
            _ => api_to_connect(e),
        })?;
        (p, (0, 0))
    } else {
        let req: envd::SelectRequest = connect::decode_stream_request(raw)?;
        let p = b
            .proc_get(id.clone(), selector(req.process.as_ref())?)
            .await
            .map_err(|e| proc_error(e, method))?;
        let from_now = (p.stdout_bytes, p.stderr_bytes);
        (p, from_now)
    };
    let pid = p.pid.ok_or_else(|| {
        ConnectError::new(Code::Internal, "the process has no pid in the sandbox")
    })?;
    // A `Connect` to an ended process is told how it ended; a `Start` always streams its
    // output from the start (a quick command may have ended before its start answered).
    let events = match p.state {
        ProcState::Exited if method != "Start" => {
            let (tx, rx) = mpsc::channel(1);
            let _ = tx.try_send(Ok(ProcessEvent::End(end_of(
                p.exit_code.unwrap_or(-1),
                p.signalled.as_deref(),
            ))));
            rx
        }
        _ => {
            let frames = b
                .proc_output(id.clone(), p.id.clone(), offsets, true)
                .await
                .map_err(|e| proc_error(e, method))?;
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(translate(e2b.clone(), id, p.id.clone(), frames, tx));
            rx
        }
    };
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs);
    let deadline = connect::timeout_ms(headers).map(Duration::from_millis);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(stream_events(pid, events, tx, keepalive, deadline));
    Ok(connect::stream_head(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))))
}

type Events = mpsc::Receiver<Result<ProcessEvent, ConnectError>>;

/// The service's output frames of process `pid_id` as envd events. A follow that ends without
/// an exit status means the sandbox stopped under it: paused (the process lives on in the
/// pause point: after `connect()` it is listed and followed again), killed, or dead.
async fn translate<B: Backend>(
    e2b: Shared<B>,
    sandbox: String,
    proc_id: String,
    mut frames: mpsc::Receiver<ExecFrame>,
    tx: mpsc::Sender<Result<ProcessEvent, ConnectError>>,
) {
    while let Some(f) = frames.recv().await {
        let ev = match f {
            ExecFrame::Stdout { d } => Ok(ProcessEvent::Data(DataEvent::Stdout(d))),
            ExecFrame::Stderr { d } => Ok(ProcessEvent::Data(DataEvent::Stderr(d))),
            ExecFrame::Exit { code, .. } => {
                let signalled = e2b
                    .backend
                    .proc_get(sandbox.clone(), proc_id.clone())
                    .await
                    .ok()
                    .and_then(|p| p.signalled);
                let _ = tx.send(Ok(ProcessEvent::End(end_of(code, signalled.as_deref())))).await;
                return;
            }
            ExecFrame::Error { error } => {
                let _ = tx.send(stopped_under(&e2b, &sandbox, error).await).await;
                return;
            }
        };
        if tx.send(ev).await.is_err() {
            return;
        }
    }
}

/// What a follow that lost its process says, once the lifecycle step that stopped it settled
/// (the host records `paused` a moment after the processes stop).
async fn stopped_under<B: Backend>(
    e2b: &Shared<B>,
    sandbox: &str,
    error: ApiError,
) -> Result<ProcessEvent, ConnectError> {
    for _ in 0..20 {
        match e2b.backend.status(sandbox.to_string()).await {
            Ok(SandboxState::Paused) => {
                return Err(ConnectError::new(
                    Code::Unavailable,
                    format!(
                        "sandbox {sandbox} was paused; the process is kept in its pause point: after Sandbox.connect() commands.list() shows it again and commands.connect(pid) follows it"
                    ),
                ))
            }
            Ok(SandboxState::Retired) => return Ok(ProcessEvent::End(killed_end())),
            Err(e) if e.code == ErrorCode::SandboxNotFound => {
                return Ok(ProcessEvent::End(killed_end()))
            }
            Ok(SandboxState::Running) if error.code != ErrorCode::Conflict => {
                return Err(api_to_connect(error))
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    match e2b.backend.status(sandbox.to_string()).await {
        Ok(SandboxState::Dead | SandboxState::Stopped) => Err(dead_error(sandbox)),
        _ => Err(api_to_connect(error)),
    }
}

/// Forward a process's events to one client stream: the start event, then what happens, until
/// the end event (or an error end of stream), the deadline, or the client leaving.
async fn stream_events(
    pid: u32,
    mut events: Events,
    tx: mpsc::Sender<Result<Bytes, std::convert::Infallible>>,
    keepalive: Option<Duration>,
    deadline: Option<Duration>,
) {
    let send = |ev: ProcessEvent| connect::message(&EventResponse { event: ev });
    if tx.send(Ok(send(ProcessEvent::Start { pid }))).await.is_err() {
        return;
    }
    let sleep = tokio::time::sleep(deadline.unwrap_or(Duration::from_secs(u64::MAX / 4)));
    tokio::pin!(sleep);
    let mut ping = tokio::time::interval(keepalive.unwrap_or(Duration::from_secs(3600)));
    ping.tick().await;
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(Ok(ev)) => {
                    let end = matches!(ev, ProcessEvent::End(_));
                    if tx.send(Ok(send(ev))).await.is_err() {
                        return;
                    }
                    if end {
                        let _ = tx.send(Ok(connect::end_stream(None))).await;
                        return;
                    }
                }
                Some(Err(e)) => {
                    let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                    return;
                }
                None => {
                    let e = ConnectError::new(Code::Unavailable, "the process's output stream ended (the sandbox was paused or killed)");
                    let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                    return;
                }
            },
            _ = ping.tick(), if keepalive.is_some() => {
                if tx.send(Ok(send(ProcessEvent::Keepalive {}))).await.is_err() {
                    return;
                }
            }
            _ = &mut sleep, if deadline.is_some() => {
                let e = ConnectError::new(Code::DeadlineExceeded, "the stream's timeout passed; the process keeps running (connect to it again by pid)");
                let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                return;
            }
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_are_told_as_go_envd_tells_them() {
        assert_eq!(end_of(3, None).status, "exit status 3");
        assert_eq!(end_of(137, None).exit_code, 137, "a command's own exit 137 is an exit");
        let k = end_of(137, Some("KILL"));
        assert_eq!((k.exit_code, k.exited, k.status.as_str()), (-1, false, "signal: killed"));
        assert_eq!(end_of(143, Some("TERM")).status, "signal: terminated");
        assert_eq!(end_of(0, Some("TERM")).status, "exit status 0", "it trapped the signal");
    }
}
