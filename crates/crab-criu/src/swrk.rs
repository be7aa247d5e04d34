//! One `criu swrk` session: spawn, request, notify loop, final response, reaping.
//!
//! This module owns the transport: a `SOCK_SEQPACKET` socket pair whose one end is inherited by
//! `criu swrk <fd>`, one protobuf message per packet in each direction, descriptors passed by
//! CRIU with `SCM_RIGHTS` (orphan pty masters), a receive timeout after which CRIU is killed,
//! and the translation of CRIU's answers into [`crate::CriuError`]s carrying the log path.
//! While waiting for an answer it also watches `criu swrk` itself: the tasks CRIU forked for a
//! restore inherit its end of the socket and may outlive it, so a CRIU that died (killed with
//! its cgroup, by the OOM killer) is noticed by its exit, not by the end of the stream.
//! CRIU opens the images and work directories through `/proc/<caller>/fd/<n>`, so this module
//! keeps those descriptors open for the duration of the call.

use std::fs::File;
use std::io::{IoSliceMut, Read as _};
use std::os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    recv, recvmsg, send, setsockopt, socketpair, sockopt, AddressFamily, ControlMessageOwned,
    MsgFlags, SockFlag, SockType,
};
use nix::sys::time::TimeVal;
use prost::Message as _;

use crate::error::{CriuError, LogTail, Result};
use crate::rpc::{self, ReqType};
use crate::{Criu, CriuVersion, DumpOpts, DumpStats, HookResult, Notify, RestoreOpts, Restored};

/// The caller's notify hook.
pub(crate) type Hook<'a> = &'a mut dyn FnMut(Notify) -> HookResult;

/// Most bytes of CRIU's stderr kept for error messages.
const STDERR_KEEP: usize = 2048;
/// Most descriptors accepted with one message.
const MAX_FDS: usize = 16;
/// How often, while waiting for CRIU, we check that `criu swrk` is still alive (ms).
const CHILD_CHECK_MS: u16 = 100;

/// A running `criu swrk` and our end of its socket.
struct Session {
    op: &'static str,
    log: PathBuf,
    sock: OwnedFd,
    child: Option<Child>,
    stderr: Option<JoinHandle<String>>,
    timeout: Duration,
    /// Pid of the `criu swrk` process (for the observer).
    pid: u32,
}

/// Directories CRIU reads through our descriptors.
struct Dirs {
    images: File,
    work: File,
    log_name: String,
}

fn io_err(
    op: &'static str,
    syscall: &'static str,
    path: &Path,
    log: Option<&Path>,
    source: impl Into<std::io::Error>,
) -> CriuError {
    CriuError::Io {
        op,
        syscall,
        path: path.to_path_buf(),
        log: log.map(Path::to_path_buf),
        source: source.into(),
    }
}

fn open_dir(op: &'static str, path: &Path, log: Option<&Path>) -> Result<File> {
    let f = File::open(path).map_err(|e| io_err(op, "open", path, log, e))?;
    let meta = f.metadata().map_err(|e| io_err(op, "fstat", path, log, e))?;
    if !meta.is_dir() {
        return Err(io_err(
            op,
            "open",
            path,
            log,
            std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        ));
    }
    Ok(f)
}

impl Dirs {
    fn open(op: &'static str, images: &Path, log: &Path) -> Result<Dirs> {
        let log_name = log
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| CriuError::InvalidOpts {
                op,
                detail: format!("log path {} has no UTF-8 file name", log.display()),
            })?
            .to_owned();
        let work_path = match log.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let work = open_dir(op, work_path, Some(log))?;
        let images = open_dir(op, images, Some(log))?;
        Ok(Dirs { images, work, log_name })
    }

    fn opts(&self, log_level: i32) -> rpc::Opts {
        rpc::Opts {
            images_dir_fd: self.images.as_raw_fd(),
            work_dir_fd: Some(self.work.as_raw_fd()),
            log_file: Some(self.log_name.clone()),
            log_level: Some(log_level),
            ..Default::default()
        }
    }
}

fn duration_us(us: Option<u32>) -> Option<Duration> {
    us.map(|u| Duration::from_micros(u64::from(u)))
}

impl Session {
    /// Start `criu swrk`, with `inherit` descriptors of ours left open in it.
    fn start(criu: &Criu, op: &'static str, log: &Path, inherit: &[RawFd]) -> Result<Session> {
        Session::start_in(criu, op, log, inherit, &[], false, 0)
    }

    /// Start `criu swrk`, with `inherit` descriptors of ours left open in it, after it joined
    /// the cgroups whose directories are `cgroups` (and, with `cgroup_ns`, unshared a cgroup
    /// namespace rooted there), at `nice` (0: ours; a nice it may not take is left as ours).
    fn start_in(
        criu: &Criu,
        op: &'static str,
        log: &Path,
        inherit: &[RawFd],
        cgroups: &[PathBuf],
        cgroup_ns: bool,
        nice: i32,
    ) -> Result<Session> {
        let bin = criu.path();
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(|e| io_err(op, "socketpair", bin, Some(log), e))?;
        let timeout = criu.timeout();
        let tv = TimeVal::new(
            i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            i64::from(timeout.subsec_micros()),
        );
        setsockopt(&ours, sockopt::ReceiveTimeout, &tv)
            .map_err(|e| io_err(op, "setsockopt(SO_RCVTIMEO)", bin, Some(log), e))?;

        let their_raw = theirs.as_raw_fd();
        let mut keep: Vec<RawFd> = Vec::with_capacity(inherit.len() + 1);
        keep.push(their_raw);
        keep.extend_from_slice(inherit);
        // Opened here, written in the child: "0" moves the writing process itself.
        let mut procs_files = Vec::with_capacity(cgroups.len());
        for dir in cgroups {
            let p = dir.join("cgroup.procs");
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .map_err(|e| io_err(op, "open", &p, Some(log), e))?;
            procs_files.push(f);
        }
        let procs_fds: Vec<RawFd> = procs_files.iter().map(|f| f.as_raw_fd()).collect();
        let private_run = match criu.private_run() {
            Some(dir) => {
                Some(std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|_| {
                    CriuError::InvalidOpts { op, detail: format!("bad path {}", dir.display()) }
                })?)
            }
            None => None,
        };
        let mut cmd = Command::new(bin);
        cmd.arg("swrk")
            .arg(their_raw.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and only calls write(2),
        // setpriority(2), unshare(2), mount(2) and fcntl(2), which are async-signal-safe; it
        // reads `procs_fds`, `private_run` and `keep`, allocated before the fork, without
        // allocating.
        unsafe {
            cmd.pre_exec(move || {
                // Best effort: without CAP_SYS_NICE it runs at our priority, as before.
                if nice != 0 {
                    libc::setpriority(libc::PRIO_PROCESS, 0, nice);
                }
                for &fd in &procs_fds {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if cgroup_ns && libc::unshare(libc::CLONE_NEWCGROUP) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(dir) = &private_run {
                    let none = std::ptr::null();
                    if libc::unshare(libc::CLONE_NEWNS) != 0
                        || libc::mount(
                            none,
                            c"/".as_ptr(),
                            none,
                            libc::MS_REC | libc::MS_SLAVE,
                            std::ptr::null(),
                        ) != 0
                        || libc::mount(
                            dir.as_ptr(),
                            c"/run".as_ptr(),
                            none,
                            libc::MS_BIND,
                            std::ptr::null(),
                        ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                for &fd in &keep {
                    if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        drop(procs_files);
        let mut child = spawned.map_err(|e| io_err(op, "spawn", bin, Some(log), e))?;
        drop(theirs);
        let stderr = child.stderr.take().and_then(|mut pipe| {
            std::thread::Builder::new()
                .name("criu-stderr".into())
                .spawn(move || {
                    let mut buf = Vec::new();
                    let _ = pipe.read_to_end(&mut buf);
                    let start = buf.len().saturating_sub(STDERR_KEEP);
                    String::from_utf8_lossy(&buf[start..]).trim().to_owned()
                })
                .ok()
        });
        tracing::debug!(op, pid = child.id(), log = %log.display(), "criu swrk started");
        // Before any request: whoever watches sandboxes must know this process acts on them.
        crate::observer::notify(child.id(), true);
        let pid = child.id();
        Ok(Session {
            op,
            log: log.to_path_buf(),
            sock: ours,
            child: Some(child),
            stderr,
            timeout,
            pid,
        })
    }

    fn send(&self, req: &rpc::Req) -> Result<()> {
        let bytes = req.encode_to_vec();
        send(self.sock.as_raw_fd(), &bytes, MsgFlags::MSG_NOSIGNAL)
            .map_err(|e| io_err(self.op, "send", &self.log, Some(&self.log), e))?;
        Ok(())
    }

    /// Wait until a message (or the end) can be read. `false` when `criu swrk` exited without
    /// anything left to read: the tasks it had forked for a restore may survive it holding its
    /// end of the socket, so its exit, not the end of the stream, says it is gone.
    fn wait_readable(&mut self) -> Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let deadline = Instant::now() + self.timeout;
        loop {
            let ready = {
                let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
                match poll(&mut fds, PollTimeout::from(CHILD_CHECK_MS)) {
                    Ok(n) => n > 0,
                    Err(nix::errno::Errno::EINTR) => false,
                    Err(e) => return Err(io_err(self.op, "poll", &self.log, Some(&self.log), e)),
                }
            };
            if ready {
                return Ok(true);
            }
            let exited = match self.child.as_mut() {
                Some(c) => matches!(c.try_wait(), Ok(Some(_))),
                None => true,
            };
            if exited {
                // What it sent before exiting is queued already.
                let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
                let left = poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0);
                if !left {
                    tracing::debug!(
                        op = self.op,
                        "criu swrk exited; not waiting for its forked tasks to close the socket"
                    );
                }
                return Ok(left);
            }
            if Instant::now() >= deadline {
                return Err(self.timed_out());
            }
        }
    }

    /// Receive one message; `None` when CRIU closed its end or exited.
    fn recv(&mut self) -> Result<Option<(rpc::Resp, Vec<OwnedFd>)>> {
        if !self.wait_readable()? {
            return Ok(None);
        }
        let fd = self.sock.as_raw_fd();
        let peek = recv(fd, &mut [], MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC);
        let len = match peek {
            Ok(0) => return Ok(None),
            Ok(n) => n,
            Err(nix::errno::Errno::EAGAIN) => return Err(self.timed_out()),
            Err(e) => return Err(io_err(self.op, "recv", &self.log, Some(&self.log), e)),
        };
        let mut buf = vec![0u8; len];
        let mut fds = Vec::new();
        {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
            let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(|e| io_err(self.op, "recvmsg", &self.log, Some(&self.log), e))?;
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        for r in raw {
                            // SAFETY: SCM_RIGHTS gave us a fresh descriptor that nothing
                            // else owns.
                            fds.push(unsafe { OwnedFd::from_raw_fd(r) });
                        }
                    }
                }
            }
            if msg.bytes != len {
                return Err(CriuError::Protocol {
                    op: self.op,
                    detail: format!("short message: {} of {len} bytes", msg.bytes),
                    log: self.log.clone(),
                });
            }
        }
        let resp = rpc::Resp::decode(buf.as_slice()).map_err(|e| CriuError::Protocol {
            op: self.op,
            detail: format!("undecodable criu_resp ({len} bytes): {e}"),
            log: self.log.clone(),
        })?;
        Ok(Some((resp, fds)))
    }

    fn timed_out(&mut self) -> CriuError {
        self.kill();
        CriuError::Timeout { op: self.op, secs: self.timeout.as_secs(), log: self.log.clone() }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Wait for CRIU to exit; returns a description of an abnormal exit.
    fn finish(&mut self) -> Option<String> {
        self.finish_status().map(|(desc, _)| desc)
    }

    /// Wait for CRIU to exit; returns a description of an abnormal exit and whether a signal
    /// ended it (then its log stops mid-way and says nothing about why).
    fn finish_status(&mut self) -> Option<(String, bool)> {
        use std::os::unix::process::ExitStatusExt as _;
        let mut child = self.child.take()?;
        match child.wait() {
            Ok(st) if st.success() => None,
            Ok(st) => match st.signal() {
                Some(sig) => {
                    let name = nix::sys::signal::Signal::try_from(sig)
                        .map(|s| s.as_str().to_owned())
                        .unwrap_or_else(|_| sig.to_string());
                    Some((format!("criu swrk was killed by {name}"), true))
                }
                None => Some((format!("criu swrk exited with {st}"), false)),
            },
            Err(e) => Some((format!("waiting for criu swrk failed: {e}"), false)),
        }
    }

    /// A notify hook refused a phase: wait for CRIU to give up and name the hook's reason.
    fn hook_failed(&mut self, phase: String, reason: String) -> CriuError {
        self.finish();
        CriuError::Hook { op: self.op, phase, reason, log: self.log.clone() }
    }

    fn stderr(&mut self) -> String {
        self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default()
    }

    fn failed(&mut self, errno: Option<i32>, errmsg: Option<String>) -> CriuError {
        // Close our end so a CRIU still waiting on us exits, then collect what it said.
        let exit = self.finish_status();
        let tail = LogTail::read(&self.log);
        // A CRIU killed by a signal (its cgroup killed, the OOM killer) stops logging mid-way:
        // the signal is the news. Otherwise CRIU's cr_errmsg is the *first* error it logged,
        // often a benign one; the log's last specific error says more.
        let errmsg = match (exit, tail.headline(), errmsg) {
            (Some((killed, true)), _, _) => Some(killed),
            (_, Some(h), _) => Some(h.to_owned()),
            (_, None, Some(m)) => Some(m),
            (e, None, None) => e.map(|(d, _)| d),
        };
        if let Some(m) = &errmsg {
            tracing::warn!(op = self.op, log = %self.log.display(), error = %m, "criu failed");
        }
        CriuError::Failed {
            op: self.op,
            log: self.log.clone(),
            errno: errno.filter(|&e| e != 0),
            errmsg,
            tail,
            stderr: self.stderr(),
        }
    }

    /// Send `req` and serve NOTIFY messages until the answer of type `expect` arrives. A
    /// successful answer is returned; failure becomes an error.
    fn call(
        &mut self,
        req: &rpc::Req,
        expect: ReqType,
        mut hook: Option<Hook<'_>>,
    ) -> Result<rpc::Resp> {
        self.send(req)?;
        let mut hook_error: Option<(String, String)> = None;
        loop {
            let Some((resp, fds)) = self.recv()? else {
                if let Some((phase, reason)) = hook_error {
                    return Err(self.hook_failed(phase, reason));
                }
                return Err(self.failed(
                    None,
                    Some("criu swrk closed the connection without an answer".into()),
                ));
            };
            if resp.r#type == ReqType::Notify as i32 {
                let n = resp.notify.unwrap_or_default();
                let phase = n.script.unwrap_or_default();
                tracing::debug!(op = self.op, phase = %phase, pid = ?n.pid, "criu notify");
                let verdict = match hook.as_mut() {
                    Some(h) => h(Notify { phase: phase.clone(), pid: n.pid, fds }),
                    None => Ok(()),
                };
                let ok = verdict.is_ok();
                if let Err(e) = verdict {
                    tracing::warn!(op = self.op, phase = %phase, error = %e, "notify hook failed; CRIU will abort");
                    hook_error.get_or_insert((phase, e.to_string()));
                }
                self.send(&rpc::Req {
                    r#type: ReqType::Notify as i32,
                    notify_success: Some(ok),
                    ..Default::default()
                })?;
                continue;
            }
            if resp.r#type != expect as i32 {
                let detail = format!("expected a {expect:?} answer, got type {}", resp.r#type);
                self.kill();
                return Err(CriuError::Protocol { op: self.op, detail, log: self.log.clone() });
            }
            if !resp.success {
                if let Some((phase, reason)) = hook_error {
                    return Err(self.hook_failed(phase, reason));
                }
                return Err(self.failed(resp.cr_errno, resp.cr_errmsg.clone()));
            }
            if let Some(exit) = self.finish() {
                tracing::warn!(op = self.op, log = %self.log.display(), "{exit} after a successful answer");
            }
            return Ok(resp);
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.kill();
        crate::observer::notify(self.pid, false);
    }
}

pub(crate) fn version(criu: &Criu) -> Result<CriuVersion> {
    // VERSION takes no options, so CRIU writes no log; errors name the binary instead.
    let log = criu.path().to_path_buf();
    let mut s = Session::start(criu, "version", &log, &[])?;
    let req = rpc::Req { r#type: ReqType::Version as i32, ..Default::default() };
    let resp = s.call(&req, ReqType::Version, None)?;
    let v = resp.version.ok_or_else(|| CriuError::Protocol {
        op: "version",
        detail: "VERSION answer without a version".into(),
        log: log.clone(),
    })?;
    Ok(CriuVersion {
        major: v.major_number,
        minor: v.minor_number,
        sublevel: v.sublevel.unwrap_or(0),
        name: v.name,
        gitid: v.gitid,
    })
}

pub(crate) fn check(criu: &Criu, log: &Path) -> Result<()> {
    let op = "check";
    let work = log.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dirs = Dirs::open(op, work, log)?;
    let mut s = Session::start(criu, op, log, &[])?;
    let req = rpc::Req {
        r#type: ReqType::Check as i32,
        opts: Some(dirs.opts(crate::DEFAULT_LOG_LEVEL)),
        ..Default::default()
    };
    s.call(&req, ReqType::Check, None)?;
    Ok(())
}

/// CRIU writes `stats-dump` / `stats-restore` into its work directory (the log's directory).
/// Move it next to the log as `<log>.stats` so that it belongs to this operation, and decode it.
fn take_stats(log: &Path, name: &str) -> Option<rpc::StatsEntry> {
    let dir = log.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let src = dir.join(name);
    let mut dst = log.as_os_str().to_owned();
    dst.push(".stats");
    let dst = PathBuf::from(dst);
    let at = if std::fs::rename(&src, &dst).is_ok() { dst } else { src };
    std::fs::read(at).ok().and_then(|b| rpc::decode_stats_image(&b))
}

fn bool_opt(b: bool) -> Option<bool> {
    b.then_some(true)
}

pub(crate) fn dump(criu: &Criu, o: &DumpOpts, hook: Option<Hook<'_>>) -> Result<DumpStats> {
    let op = "dump";
    if o.pid <= 0 {
        return Err(CriuError::InvalidOpts {
            op,
            detail: format!("pid {} is not a process", o.pid),
        });
    }
    let dirs = Dirs::open(op, &o.images_dir, &o.log_path)?;
    let opts = rpc::Opts {
        pid: Some(o.pid),
        leave_running: bool_opt(o.leave_running),
        tcp_established: bool_opt(o.tcp_established),
        tcp_skip_in_flight: bool_opt(o.tcp_skip_in_flight),
        ext_unix_sk: bool_opt(o.ext_unix_sk),
        file_locks: bool_opt(o.file_locks),
        shell_job: bool_opt(o.shell_job),
        link_remap: bool_opt(o.link_remap),
        notify_scripts: bool_opt(hook.is_some()),
        network_lock: o.network_lock.map(|m| m as i32),
        external: o.external.clone(),
        freeze_cgroup: o.freeze_cgroup.as_ref().map(|p| p.to_string_lossy().into_owned()),
        manage_cgroups_mode: o.manage_cgroups.map(|m| m as i32),
        ghost_limit: o.ghost_limit,
        skip_mnt: o.skip_mnt.clone(),
        enable_fs: o.enable_fs.clone(),
        timeout: o.freeze_timeout_s,
        track_mem: bool_opt(o.track_mem),
        ..dirs.opts(o.log_level)
    };
    let started = Instant::now();
    let mut s = Session::start(criu, op, &o.log_path, &[])?;
    let req = rpc::Req { r#type: ReqType::Dump as i32, opts: Some(opts), ..Default::default() };
    s.call(&req, ReqType::Dump, hook)?;
    let wall = started.elapsed();
    drop(s);

    let mut stats = DumpStats { wall, ..Default::default() };
    let entries = std::fs::read_dir(&o.images_dir)
        .map_err(|e| io_err(op, "readdir", &o.images_dir, Some(&o.log_path), e))?;
    for entry in entries.flatten() {
        if let Ok(meta) = entry.metadata() {
            if meta.is_file() {
                stats.image_bytes += meta.len();
                stats.image_files += 1;
            }
        }
    }
    if let Some(d) = take_stats(&o.log_path, "stats-dump").and_then(|e| e.dump) {
        stats.freezing_time = duration_us(d.freezing_time);
        stats.frozen_time = duration_us(d.frozen_time);
        stats.memdump_time = duration_us(d.memdump_time);
        stats.memwrite_time = duration_us(d.memwrite_time);
        stats.pages_written = d.pages_written;
    }
    tracing::debug!(op, pid = o.pid, ?stats, "criu dump done");
    Ok(stats)
}

pub(crate) fn restore(criu: &Criu, o: &RestoreOpts, hook: Option<Hook<'_>>) -> Result<Restored> {
    let op = "restore";
    let dirs = Dirs::open(op, &o.images_dir, &o.log_path)?;
    let opts = rpc::Opts {
        root: o.root.as_ref().map(|p| p.to_string_lossy().into_owned()),
        rst_sibling: bool_opt(o.sibling),
        inherit_fd: o
            .inherit_fd
            .iter()
            .map(|i| rpc::InheritFd { key: i.key.clone(), fd: i.fd })
            .collect(),
        tcp_established: bool_opt(o.tcp_established),
        tcp_close: bool_opt(o.tcp_close),
        ext_unix_sk: bool_opt(o.ext_unix_sk),
        file_locks: bool_opt(o.file_locks),
        shell_job: bool_opt(o.shell_job),
        notify_scripts: bool_opt(hook.is_some()),
        network_lock: o.network_lock.map(|m| m as i32),
        external: o.external.clone(),
        manage_cgroups_mode: o.manage_cgroups.map(|m| m as i32),
        join_ns: o
            .join_ns
            .iter()
            .map(|(ns, file)| rpc::JoinNamespace {
                ns: ns.clone(),
                ns_file: file.clone(),
                extra_opt: None,
            })
            .collect(),
        orphan_pts_master: bool_opt(o.orphan_pts_master),
        weak_sysctls: bool_opt(o.weak_sysctls),
        lsm_profile: o.lsm_profile.clone(),
        empty_ns: (o.empty_ns != 0).then_some(o.empty_ns),
        ..dirs.opts(o.log_level)
    };
    let inherit: Vec<RawFd> = o.inherit_fd.iter().map(|i| i.fd).collect();
    let started = Instant::now();
    let mut s =
        Session::start_in(criu, op, &o.log_path, &inherit, &o.join_cgroups, o.cgroup_ns, o.nice)?;
    let req = rpc::Req { r#type: ReqType::Restore as i32, opts: Some(opts), ..Default::default() };
    let resp = s.call(&req, ReqType::Restore, hook)?;
    let wall = started.elapsed();
    drop(s);
    let pid = resp.restore.map(|r| r.pid).ok_or_else(|| CriuError::Protocol {
        op,
        detail: "RESTORE answer without a pid".into(),
        log: o.log_path.clone(),
    })?;
    let mut out = Restored { pid, wall, forking_time: None, restore_time: None };
    if let Some(r) = take_stats(&o.log_path, "stats-restore").and_then(|e| e.restore) {
        out.forking_time = duration_us(r.forking_time);
        out.restore_time = duration_us(r.restore_time);
    }
    tracing::debug!(op, pid, ?wall, "criu restore done");
    Ok(out)
}
