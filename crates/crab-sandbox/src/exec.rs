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

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
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

type Key = (String, String);

/// Daemon-side ends of a session's pipes re-created for a restore: stdin's write end,
/// stdout's and stderr's read ends, and the new pipes' inodes (stdin, stdout, stderr).
#[derive(Debug)]
pub struct RestoredPipes {
    fds: [OwnedFd; 3],
    inodes: [u64; 3],
}

#[derive(Debug, Default)]
struct SessionsInner {
    /// Open sessions: the registration's id and the feed of their stdin.
    open: HashMap<Key, (u64, mpsc::Sender<StdinChunk>)>,
    /// Id of the next registration.
    next_id: u64,
    /// Inodes of each session's pipes (stdin, stdout, stderr) as a dump would record them,
    /// newest last (a restore may go back to an older point).
    pipes: HashMap<Key, Vec<[u64; 3]>>,
    /// Pipes re-created by a restore, waiting for [`attach`].
    restored: HashMap<Key, RestoredPipes>,
}

/// How many generations of a session's pipes are remembered for restores.
const PIPE_GENERATIONS: usize = 8;

/// The exec sessions of a runtime (streamed stdin). A session's pipes to the daemon survive a
/// restore of its sandbox: before CRIU restores it, [`Sessions::prepare_restore`] makes new
/// pipes standing in for the dumped ones (CRIU's `inherit_fd`), and the client picks up the
/// restored session's output and stdin with [`attach`] (`POST .../exec/{session}/attach`).
#[derive(Debug, Default)]
pub struct Sessions {
    inner: std::sync::Mutex<SessionsInner>,
}

/// The stdin side of a registered session, handed to [`run`].
#[derive(Debug)]
pub struct SessionStdin {
    key: Key,
    id: u64,
    rx: mpsc::Receiver<StdinChunk>,
}

/// New pipes standing in for a sandbox's session pipes during a restore: `inherit` are the
/// sandbox's ends (CRIU `inherit_fd` key, descriptor), kept open until the restore is done.
#[derive(Debug, Default)]
pub struct RestoreWiring {
    /// (`pipe:[INODE]` of the dumped pipe, the new pipe's end for the restored process).
    pub inherit: Vec<(String, OwnedFd)>,
    pending: Vec<(Key, RestoredPipes)>,
}

fn new_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, SessionsInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register session `session` of sandbox `sandbox` (before its exec starts, so a write
    /// sent as soon as the exec's stream answers finds it). Refused when the name is taken.
    pub fn register(&self, sandbox: &str, session: &str) -> Result<SessionStdin> {
        crab_common::names::validate("exec session", session)
            .map_err(|e| SandboxError::Invalid(e.message))?;
        let key = (sandbox.to_string(), session.to_string());
        let mut g = self.lock();
        if g.open.contains_key(&key) || g.restored.contains_key(&key) {
            return Err(SandboxError::Conflict(format!(
                "sandbox {sandbox} already has an exec session {session:?} (open, or restored and waiting for attach); pick another stdin_session name"
            )));
        }
        let (tx, rx) = mpsc::channel(16);
        g.next_id += 1;
        let id = g.next_id;
        g.open.insert(key.clone(), (id, tx));
        // A new session of that name: the pipes of an earlier one are not its own.
        g.pipes.remove(&key);
        Ok(SessionStdin { key, id, rx })
    }

    fn record_pipes(&self, key: &Key, inodes: [u64; 3]) {
        let mut g = self.lock();
        let v = g.pipes.entry(key.clone()).or_default();
        v.push(inodes);
        if v.len() > PIPE_GENERATIONS {
            v.remove(0);
        }
    }

    /// The exec of registration `id` ended: its session is no longer open.
    fn forget(&self, key: &Key, id: u64) {
        let mut g = self.lock();
        if g.open.get(key).is_some_and(|(i, _)| *i == id) {
            g.open.remove(key);
        }
    }

    /// Drop everything about sandbox `sandbox`'s sessions (it was removed).
    pub fn forget_sandbox(&self, sandbox: &str) {
        let mut g = self.lock();
        g.open.retain(|k, _| k.0 != sandbox);
        g.pipes.retain(|k, _| k.0 != sandbox);
        g.restored.retain(|k, _| k.0 != sandbox);
    }

    /// New pipes for every remembered generation of `sandbox`'s session pipes, to hand CRIU
    /// as `inherit_fd` (a key the image does not use is ignored).
    pub fn prepare_restore(&self, sandbox: &str) -> std::io::Result<RestoreWiring> {
        let gens: Vec<(Key, [u64; 3])> = {
            let g = self.lock();
            g.pipes
                .iter()
                .filter(|(k, _)| k.0 == sandbox)
                .flat_map(|(k, v)| v.iter().map(move |i| (k.clone(), *i)))
                .collect()
        };
        let mut w = RestoreWiring::default();
        for (key, [i, o, e]) in gens {
            let (in_r, in_w) = new_pipe()?;
            let (out_r, out_w) = new_pipe()?;
            let (err_r, err_w) = new_pipe()?;
            let inodes = [pipe_inode(&in_r), pipe_inode(&out_r), pipe_inode(&err_r)];
            let [Some(ni), Some(no), Some(ne)] = inodes else {
                return Err(std::io::Error::other("cannot stat a new pipe"));
            };
            w.inherit.push((format!("pipe:[{i}]"), in_r));
            w.inherit.push((format!("pipe:[{o}]"), out_w));
            w.inherit.push((format!("pipe:[{e}]"), err_w));
            w.pending
                .push((key, RestoredPipes { fds: [in_w, out_r, err_r], inodes: [ni, no, ne] }));
        }
        Ok(w)
    }

    /// After a successful restore of `sandbox` (`pids`: its processes, host pids): keep the
    /// re-created pipes some restored process holds for [`attach`], close the others.
    pub fn finish_restore(&self, sandbox: &str, mut w: RestoreWiring, pids: &[u32]) -> usize {
        // The sandbox's ends now belong to the restored processes (or to nobody).
        w.inherit.clear();
        let held: std::collections::HashSet<String> = pids
            .iter()
            .filter_map(|pid| std::fs::read_dir(format!("/proc/{pid}/fd")).ok())
            .flat_map(|d| d.flatten())
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .map(|t| t.to_string_lossy().into_owned())
            .collect();
        let mut g = self.lock();
        let mut n = 0;
        for (key, p) in w.pending {
            let live = p.inodes.iter().any(|i| held.contains(&format!("pipe:[{i}]")));
            if live && key.0 == sandbox {
                let v = g.pipes.entry(key.clone()).or_default();
                v.push(p.inodes);
                if v.len() > PIPE_GENERATIONS {
                    v.remove(0);
                }
                g.open.remove(&key);
                g.restored.insert(key, p);
                n += 1;
            }
        }
        n
    }

    /// The restored pipes of a session, with a newly registered stdin feed.
    fn take_restored(&self, sandbox: &str, session: &str) -> Result<(RestoredPipes, SessionStdin)> {
        let key = (sandbox.to_string(), session.to_string());
        let mut g = self.lock();
        let p = g.restored.remove(&key).ok_or_else(|| {
            SandboxError::Conflict(format!(
                "sandbox {sandbox} has no restored exec session {session:?} to attach to (none was running in the restored point, or it was attached already)"
            ))
        })?;
        let (tx, rx) = mpsc::channel(16);
        g.next_id += 1;
        let id = g.next_id;
        g.open.insert(key.clone(), (id, tx));
        Ok((p, SessionStdin { key, id, rx }))
    }

    /// Write `data` to the stdin of session `session` of `sandbox` (then close it when `eof`);
    /// answers once the bytes are in the pipe. Unknown or ended sessions are refused.
    pub async fn write(
        &self,
        sandbox: &str,
        session: &str,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<usize> {
        let tx = self
            .lock()
            .open
            .get(&(sandbox.to_string(), session.to_string()))
            .map(|(_, tx)| tx.clone());
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
    mut stdin: impl tokio::io::AsyncWrite + Unpin,
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
    let key = session.as_ref().map(|s| (s.key.clone(), s.id));
    let frame = match run_inner(&rt, &name, &req, &tx, session).await {
        Ok(f) => f,
        Err(e) => ExecFrame::Error { error: e.into() },
    };
    if let Some((k, id)) = key {
        rt.sessions().forget(&k, id);
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
    crate::specfd::check_exec_args(&spec.cmd, &spec.env)?;
    let spec_fd = crate::specfd::spec_memfd(&spec)?;
    let start = Instant::now();
    let mut cmd = tokio::process::Command::new(rt.helper_exe());
    let mut child = cmd
        .arg("__nsexec")
        .args(crate::specfd::inheritable(&spec_fd)?)
        .stdin(if stdin_data.is_some() || session.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(SandboxError::io("run helper", rt.helper_source()))?;
    drop(spec_fd);
    let out = child.stdout.take().ok_or_else(|| SandboxError::Other("no stdout pipe".into()))?;
    let err = child.stderr.take().ok_or_else(|| SandboxError::Other("no stderr pipe".into()))?;
    let mut inodes: Vec<u64> = [pipe_inode(&out), pipe_inode(&err)].into_iter().flatten().collect();
    let mut feeder = None;
    match (session, child.stdin.take()) {
        (Some(s), Some(stdin)) => {
            if let (Some(i), Some(o), Some(e)) =
                (pipe_inode(&stdin), pipe_inode(&out), pipe_inode(&err))
            {
                rt.sessions().record_pipes(&s.key, [i, o, e]);
            }
            inodes.extend(pipe_inode(&stdin));
            feeder = Some(tokio::spawn(feed(stdin, stdin_data, s.rx)));
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
    let (timed_out, abandoned) = pump(out, err, tx, deadline).await;
    if let Some(f) = feeder {
        // The command's output is done: nothing more is fed to it.
        f.abort();
    }
    if timed_out || abandoned {
        let _ = child.start_kill();
        kill_holders(rt, name, &inodes).await;
        tracing::info!(sandbox = name, timed_out, abandoned, "exec killed");
    }
    let status = child.wait().await.map_err(SandboxError::io("wait", rt.helper_source()))?;
    let code = status.code().unwrap_or(137);
    if abandoned {
        return Err(SandboxError::Other("the client went away; the command was killed".into()));
    }
    Ok(ExecFrame::Exit { code, timed_out, duration_ms: start.elapsed().as_secs_f64() * 1e3 })
}

/// Whatever still holds the exec's pipes dies with it; repeat until nobody does.
async fn kill_holders(rt: &Runtime, name: &str, inodes: &[u64]) {
    let cg = rt.cgroup(name);
    for _ in 0..50 {
        if kill_pipe_holders(&cg, inodes) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Stream `out` and `err` as frames to `tx` until both reach end-of-file, the deadline passes
/// (`timed_out`) or the caller goes away (`abandoned`).
async fn pump(
    mut out: impl tokio::io::AsyncRead + Unpin,
    mut err: impl tokio::io::AsyncRead + Unpin,
    tx: &mpsc::Sender<ExecFrame>,
    deadline: Option<Instant>,
) -> (bool, bool) {
    let sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    let (mut out_open, mut err_open) = (true, true);
    let (mut obuf, mut ebuf) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    let b64 = &base64::engine::general_purpose::STANDARD;
    while out_open || err_open {
        tokio::select! {
            r = out.read(&mut obuf), if out_open => match r {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => if tx.send(ExecFrame::Stdout { d: b64.encode(&obuf[..n]) }).await.is_err() {
                    return (false, true);
                },
            },
            r = err.read(&mut ebuf), if err_open => match r {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => if tx.send(ExecFrame::Stderr { d: b64.encode(&ebuf[..n]) }).await.is_err() {
                    return (false, true);
                },
            },
            _ = &mut sleep => return (true, false),
            _ = tx.closed() => return (false, true),
        }
    }
    (false, false)
}

/// Exit code of an attached session's `exit` frame: its process is not the daemon's child (it
/// came back from a restore), so its status is unknown.
pub const ATTACHED_EXIT_UNKNOWN: i32 = -1;

/// Stream the restored pipes of session `session` of sandbox `name` (see
/// [`Sessions::finish_restore`]) to `tx`, feeding its stdin from a newly registered channel,
/// until the pipes close. The last frame is `Exit` (code [`ATTACHED_EXIT_UNKNOWN`]) or `Error`.
pub async fn attach(rt: Arc<Runtime>, name: String, session: String, tx: mpsc::Sender<ExecFrame>) {
    let start = Instant::now();
    let mut reg = None;
    let frame = match rt.sessions().take_restored(&name, &session) {
        Err(e) => ExecFrame::Error { error: e.into() },
        Ok((pipes, stdin)) => {
            let [stdin_w, out_r, err_r] = pipes.fds;
            let opened = (|| -> std::io::Result<_> {
                Ok((
                    tokio::net::unix::pipe::Sender::from_owned_fd(stdin_w)?,
                    tokio::net::unix::pipe::Receiver::from_owned_fd(out_r)?,
                    tokio::net::unix::pipe::Receiver::from_owned_fd(err_r)?,
                ))
            })();
            match opened {
                Err(e) => ExecFrame::Error {
                    error: SandboxError::Other(format!("attaching exec session {session:?}: {e}"))
                        .into(),
                },
                Ok((w, out, err)) => {
                    reg = Some((stdin.key.clone(), stdin.id));
                    let feeder = tokio::spawn(feed(w, None, stdin.rx));
                    let (timed_out, abandoned) = pump(out, err, &tx, None).await;
                    feeder.abort();
                    if abandoned {
                        kill_holders(&rt, &name, &pipes.inodes).await;
                        ExecFrame::Error {
                            error: SandboxError::Other(
                                "the client went away; the session was killed".into(),
                            )
                            .into(),
                        }
                    } else {
                        ExecFrame::Exit {
                            code: ATTACHED_EXIT_UNKNOWN,
                            timed_out,
                            duration_ms: start.elapsed().as_secs_f64() * 1e3,
                        }
                    }
                }
            }
        }
    };
    if let Some((k, id)) = reg {
        rt.sessions().forget(&k, id);
    }
    let _ = tx.send(frame).await;
}
