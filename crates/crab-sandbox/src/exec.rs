//! Running a command inside a sandbox from the (async) daemon.
//!
//! The daemon starts the exec helper (`crab __nsexec`, see [`crate::spawn`]) with pipes for
//! stdout and stderr, streams what arrives as [`ExecFrame`]s, and ends with the exit code once
//! both pipes reach end-of-file and the helper has exited. Background processes that redirect
//! their output (`nohup srv >log 2>&1 &`) keep running after the exec returns. When the timeout
//! fires or the caller goes away, every process of the sandbox that still holds one of the
//! exec's pipes is killed, so no orphaned command keeps writing after its turn.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crab_common::api::{ExecFrame, ExecRequest};

use crate::cgroup::SandboxCgroup;
use crate::error::{Result, SandboxError};
use crate::runtime::Runtime;

/// Exit code the helper uses for its own failures (like `docker exec`'s 125).
pub const HELPER_FAILURE: i32 = 125;

fn pipe_inode(fd: &impl AsRawFd) -> Option<u64> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// SIGKILL every process of the sandbox that holds a pipe with one of `inodes`.
/// Returns how many were killed.
pub fn kill_pipe_holders(cg: &SandboxCgroup, inodes: &[u64]) -> usize {
    let wanted: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let mut killed = 0;
    for pid in cg.pids().unwrap_or_default() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .map(|t| wanted.iter().any(|w| t.as_os_str() == w.as_str()))
                .unwrap_or(false)
        });
        if holds {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            killed += 1;
        }
    }
    killed
}

/// Run `req` in sandbox `name`, sending frames to `tx`. The last frame is `Exit` or `Error`.
pub async fn run(rt: Arc<Runtime>, name: String, req: ExecRequest, tx: mpsc::Sender<ExecFrame>) {
    let frame = match run_inner(&rt, &name, &req, &tx).await {
        Ok(f) => f,
        Err(e) => ExecFrame::Error { error: e.into() },
    };
    let _ = tx.send(frame).await;
}

async fn run_inner(
    rt: &Arc<Runtime>,
    name: &str,
    req: &ExecRequest,
    tx: &mpsc::Sender<ExecFrame>,
) -> Result<ExecFrame> {
    let spec = rt.exec_spec(name, req)?;
    let stdin_data = match &req.stdin_b64 {
        Some(s) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| SandboxError::Invalid(format!("stdin_b64 is not base64: {e}")))?,
        ),
        None => None,
    };
    let json = serde_json::to_string(&spec).map_err(|e| SandboxError::Other(e.to_string()))?;
    let start = Instant::now();
    let mut child = tokio::process::Command::new(rt.helper_exe())
        .arg("__nsexec")
        .arg(json)
        .stdin(if stdin_data.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(SandboxError::io("run helper", rt.helper_exe()))?;
    let mut out =
        child.stdout.take().ok_or_else(|| SandboxError::Other("no stdout pipe".into()))?;
    let mut err =
        child.stderr.take().ok_or_else(|| SandboxError::Other("no stderr pipe".into()))?;
    let mut inodes: Vec<u64> = [pipe_inode(&out), pipe_inode(&err)].into_iter().flatten().collect();
    if let (Some(data), Some(mut stdin)) = (stdin_data, child.stdin.take()) {
        inodes.extend(pipe_inode(&stdin));
        tokio::spawn(async move {
            let _ = stdin.write_all(&data).await;
            let _ = stdin.shutdown().await;
        });
    }
    let deadline = req.timeout_s.map(|s| start + Duration::from_secs_f64(s.max(0.0)));
    let sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    let (mut out_open, mut err_open) = (true, true);
    let (mut obuf, mut ebuf) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let mut timed_out = false;
    let mut abandoned = false;
    let b64 = &base64::engine::general_purpose::STANDARD;
    while out_open || err_open {
        tokio::select! {
            r = out.read(&mut obuf), if out_open => match r {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => if tx.send(ExecFrame::Stdout { d: b64.encode(&obuf[..n]) }).await.is_err() {
                    abandoned = true;
                    break;
                },
            },
            r = err.read(&mut ebuf), if err_open => match r {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => if tx.send(ExecFrame::Stderr { d: b64.encode(&ebuf[..n]) }).await.is_err() {
                    abandoned = true;
                    break;
                },
            },
            _ = &mut sleep => { timed_out = true; break; }
            _ = tx.closed() => { abandoned = true; break; }
        }
    }
    if timed_out || abandoned {
        let cg = rt.cgroup(name);
        let _ = child.start_kill();
        // Whatever still holds the exec's pipes dies with it; repeat until nobody does.
        for _ in 0..50 {
            if kill_pipe_holders(&cg, &inodes) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tracing::info!(sandbox = name, timed_out, abandoned, "exec killed");
    }
    let status = child.wait().await.map_err(SandboxError::io("wait", rt.helper_exe()))?;
    let code = status.code().unwrap_or(137);
    if abandoned {
        return Err(SandboxError::Other("the client went away; the command was killed".into()));
    }
    Ok(ExecFrame::Exit { code, timed_out, duration_ms: start.elapsed().as_secs_f64() * 1e3 })
}
