//! Running a command inside a sandbox from the (async) daemon.
//!
//! The daemon starts the exec helper (`crab __nsexec`, see [`crate::spawn`]) with pipes for
//! stdout and stderr, streams what arrives as [`ExecFrame`]s, and ends with the exit code once
//! both pipes reach end-of-file and the helper has exited. Background processes that redirect
//! their output (`nohup srv >log 2>&1 &`) keep running after the exec returns. When the timeout
//! fires or the caller goes away, every process of the sandbox that still holds one of the
//! exec's pipes is killed, so no orphaned command keeps writing after its turn.
//!
//! An exec with `stdin_session` keeps its stdin open as a pipe the daemon holds and feeds with
//! what [`Sessions::write`] is given (`POST .../exec/{session}/stdin`), until `eof` or the end
//! of the command: a shell held this way runs command after command without a file of its
//! own in the sandbox (the replay's persistent session, `crab exec -i`).

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

/// What a session's stdin is fed with.
#[derive(Debug)]
struct StdinChunk {
    data: Vec<u8>,
    eof: bool,
    done: tokio::sync::oneshot::Sender<std::io::Result<usize>>,
}

/// The open exec sessions of a runtime: (sandbox, session) → the feed of its stdin.
#[derive(Debug, Default)]
pub struct Sessions {
    open: std::sync::Mutex<std::collections::HashMap<(String, String), mpsc::Sender<StdinChunk>>>,
}

/// The stdin side of a registered session, handed to [`run`].
#[derive(Debug)]
pub struct SessionStdin {
    key: (String, String),
    rx: mpsc::Receiver<StdinChunk>,
}

impl Sessions {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::HashMap<(String, String), mpsc::Sender<StdinChunk>>,
    > {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register session `session` of sandbox `sandbox` (before its exec starts, so a write
    /// sent as soon as the exec's stream answers finds it). Refused when the name is taken.
    pub fn register(&self, sandbox: &str, session: &str) -> Result<SessionStdin> {
        crab_common::names::validate("exec session", session)
            .map_err(|e| SandboxError::Invalid(e.message))?;
        let key = (sandbox.to_string(), session.to_string());
        let mut open = self.lock();
        if open.get(&key).is_some_and(|tx| !tx.is_closed()) {
            return Err(SandboxError::Conflict(format!(
                "sandbox {sandbox} already has an open exec session {session:?}; pick another stdin_session name"
            )));
        }
        let (tx, rx) = mpsc::channel(16);
        open.insert(key.clone(), tx);
        Ok(SessionStdin { key, rx })
    }

    fn forget(&self, key: &(String, String)) {
        let mut open = self.lock();
        if open.get(key).is_some_and(|tx| tx.is_closed()) {
            open.remove(key);
        }
    }

    /// Write `data` to the stdin of session `session` of `sandbox` (then close it when `eof`);
    /// answers once the bytes are in the pipe. Unknown or ended sessions are a 404-style error.
    pub async fn write(
        &self,
        sandbox: &str,
        session: &str,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<usize> {
        let tx = self.lock().get(&(sandbox.to_string(), session.to_string())).cloned();
        let gone = || {
            SandboxError::Conflict(format!(
                "no open exec session {session:?} in sandbox {sandbox} (it ended, or was never started with stdin_session)"
            ))
        };
        let tx = tx.ok_or_else(gone)?;
        let (done, answer) = tokio::sync::oneshot::channel();
        tx.send(StdinChunk { data, eof, done }).await.map_err(|_| gone())?;
        match answer.await {
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(SandboxError::Conflict(format!(
                "exec session {session:?} of sandbox {sandbox}: its stdin is closed ({e}); the command stopped reading"
            ))),
            Err(_) => Err(gone()),
        }
    }
}

/// Feed a session's stdin from its channel until eof, the channel's end or a write error.
async fn feed(
    mut stdin: tokio::process::ChildStdin,
    first: Option<Vec<u8>>,
    mut rx: mpsc::Receiver<StdinChunk>,
) {
    if let Some(d) = first {
        if stdin.write_all(&d).await.is_err() {
            return;
        }
    }
    while let Some(c) = rx.recv().await {
        let r = stdin.write_all(&c.data).await.map(|()| c.data.len());
        let failed = r.is_err();
        let _ = c.done.send(r);
        if failed || c.eof {
            break;
        }
    }
    let _ = stdin.shutdown().await;
}

/// Run `req` in sandbox `name`, sending frames to `tx`. The last frame is `Exit` or `Error`.
/// `session`: the stdin feed registered for `req.stdin_session`.
pub async fn run(
    rt: Arc<Runtime>,
    name: String,
    req: ExecRequest,
    tx: mpsc::Sender<ExecFrame>,
    session: Option<SessionStdin>,
) {
    let key = session.as_ref().map(|s| s.key.clone());
    let frame = match run_inner(&rt, &name, &req, &tx, session).await {
        Ok(f) => f,
        Err(e) => ExecFrame::Error { error: e.into() },
    };
    if let Some(k) = key {
        rt.sessions().forget(&k);
    }
    let _ = tx.send(frame).await;
}

async fn run_inner(
    rt: &Arc<Runtime>,
    name: &str,
    req: &ExecRequest,
    tx: &mpsc::Sender<ExecFrame>,
    session: Option<SessionStdin>,
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
        .stdin(if stdin_data.is_some() || session.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
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
    match (session, child.stdin.take()) {
        (Some(s), Some(stdin)) => {
            inodes.extend(pipe_inode(&stdin));
            tokio::spawn(feed(stdin, stdin_data, s.rx));
        }
        (None, Some(mut stdin)) => {
            inodes.extend(pipe_inode(&stdin));
            if let Some(data) = stdin_data {
                tokio::spawn(async move {
                    let _ = stdin.write_all(&data).await;
                    let _ = stdin.shutdown().await;
                });
            }
        }
        _ => {}
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
