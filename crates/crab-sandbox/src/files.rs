//! The sandbox file service: read (streamed out), write (streamed in), stat, list, mkdir,
//! remove, rename, tar out of a path and tar in under a directory — implemented once, here, for
//! every front door (the daemon's `/v1/sandboxes/{name}/files…` routes, `crab docker cp`, the
//! SDK's `sb.files`, E2B's `/files` and envd `filesystem.Filesystem`).
//!
//! **Where the work happens.** Each operation is a small POSIX-shell program run by the exec
//! helper (`__nsexec`) *inside* the sandbox — its mount, pid and other namespaces, its cgroups,
//! its security profile (capabilities, seccomp) — as the requested account (root, or a named
//! one through `setpriv`, so files written belong to it). Every path is therefore resolved by
//! the sandbox's own kernel view, after its `pivot_root`: a symlink the sandbox made
//! (`/tmp/x -> /etc/shadow`, `/tmp/d -> /`) resolves to the *sandbox's* `/etc/shadow` and `/`,
//! never to the host's. The daemon opens no path of the sandbox's choosing.
//!
//! **What comes back is hostile.** A program's exit status says why it failed (43 permission,
//! 44 not found, 45 exists, 46 not a directory, 47 is a directory, 48 no such user); its stdout
//! is read up to a bound ([`MAX_REPLY`]) and parsed field by field (`find -printf`, NUL
//! separated) without trusting counts or encodings; its stderr is kept to a short tail. Data
//! streams (read, tar out) are passed through as bytes, never interpreted; a stream begins only
//! after the program printed its ready line, so a missing path is an error, not an empty file.
//! Writes are bounded ([`MAX_WRITE`]); every operation has a deadline, and whatever still holds
//! the operation's pipes when it is abandoned (timeout, oversize, the client went away) is
//! killed, as the exec path does.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crab_common::api::ExecRequest;
use crab_common::files::{check_user, resolve_path, FileEntry, FileKind, ROOT};
use crab_common::{ApiError, ErrorCode};

use crate::runtime::Runtime;

/// Largest file or archive written into a sandbox in one operation: a backstop; the front
/// doors refuse a body over their configured limit (`crab daemon --max-upload`) first.
pub const MAX_WRITE: u64 = 1 << 40;
/// Largest reply of a describing operation (stat, list, mkdir, rename, write's entry).
pub const MAX_REPLY: usize = 16 << 20;
/// Bytes of a program's stderr kept for an error message.
const STDERR_TAIL: usize = 2048;
/// Deadline of a describing operation.
const SHORT: Duration = Duration::from_secs(60);
/// Deadline of a transfer (read, write, tar in and out).
const LONG: Duration = Duration::from_secs(3600);
/// Longest a transfer may go without a byte moving before it is abandoned (a program that
/// stalls: a hostile sandbox's `cat`, a reader that stopped).
const IDLE: Duration = Duration::from_secs(120);
/// What a streaming program prints before its data.
const READY: &[u8] = b"crab-files:ok\n";

/// Chunks of a byte stream in or out of the service; an `Err` ends it as failed.
pub type Chunks = mpsc::Receiver<Result<Vec<u8>, ApiError>>;

/// One operation of the file service. Paths are as the client gave them: absolute, `~/…`, or
/// relative to the user's home.
#[derive(Debug)]
pub enum FileOp {
    /// A file's bytes, streamed out.
    Read {
        /// The file.
        path: String,
    },
    /// Write a file from a stream (parents made; an existing file is replaced once the whole
    /// stream is in, never left shorter); answers its entry.
    Write {
        /// The file.
        path: String,
        /// Permission bits to set afterwards.
        mode: Option<u32>,
        /// Its bytes.
        data: Chunks,
    },
    /// Describe a path (a symlink itself, with what it points at).
    Stat {
        /// The path.
        path: String,
    },
    /// Describe the entries of a directory, `depth` levels deep (at least 1).
    List {
        /// The directory.
        path: String,
        /// Levels.
        depth: u32,
    },
    /// Make a directory and its parents; `already_exists` when the path exists.
    MakeDir {
        /// The directory.
        path: String,
    },
    /// Remove a file or a tree.
    Remove {
        /// The path.
        path: String,
    },
    /// Rename (making the destination's parents); answers the destination's entry.
    Rename {
        /// The path.
        from: String,
        /// The new path.
        to: String,
    },
    /// A tar of a path (its top member named after it), or of a directory's contents (members
    /// `./…`), streamed out.
    TarOut {
        /// The path.
        path: String,
        /// Archive the directory's contents.
        contents: bool,
        /// Follow symlinks (`tar -h`).
        follow: bool,
    },
    /// Extract a tar stream under a directory (made when missing).
    TarIn {
        /// The directory.
        dir: String,
        /// Keep the archive's owners (root only).
        same_owner: bool,
        /// The archive.
        data: Chunks,
    },
}

impl FileOp {
    /// The operation's name (logs, errors).
    pub fn name(&self) -> &'static str {
        match self {
            FileOp::Read { .. } => "read",
            FileOp::Write { .. } => "write",
            FileOp::Stat { .. } => "stat",
            FileOp::List { .. } => "list",
            FileOp::MakeDir { .. } => "mkdir",
            FileOp::Remove { .. } => "remove",
            FileOp::Rename { .. } => "rename",
            FileOp::TarOut { .. } => "tar out",
            FileOp::TarIn { .. } => "tar in",
        }
    }
}

/// What an operation answers.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum FileAnswer {
    /// One path (stat, mkdir, rename, write).
    Entry(Box<FileEntry>),
    /// A directory's entries (list).
    Entries(Vec<FileEntry>),
    /// Done (remove, tar in).
    Done {
        /// Always true.
        ok: bool,
    },
    /// A byte stream (read, tar out).
    #[serde(skip)]
    Stream(Chunks),
}

/// `find -printf` format of one entry: path, own type, size, octal mode, symbolic mode, owner,
/// group, mtime, link target, the target's type.
const FIND_FMT: &str = r"%p\0%y\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0%Y\0";

const EXISTS: &str = r#"[ -e "$1" ] || [ -L "$1" ] || exit 44; "#;

/// The program (script, arguments) of an operation on resolved paths.
fn program(op: &FileOp, paths: &[String]) -> Result<(String, Vec<String>), ApiError> {
    let p = |i: usize| paths.get(i).cloned().unwrap_or_default();
    Ok(match op {
        FileOp::Read { .. } => (
            r#"[ -e "$1" ] || exit 44; [ -d "$1" ] && exit 47; [ -r "$1" ] || exit 43; printf 'crab-files:ok\n'; exec cat -- "$1""#.into(),
            vec![p(0)],
        ),
        // Into a new hidden file beside the target (`$3`, mode 0600 while it fills), renamed
        // over it once whole: a write cut off — the program killed mid-stream — leaves the old
        // file (or none) as it was, never a shorter one. The new file takes the old one's mode
        // (and, as root, owner) unless a mode is given; a new one gets the umask's. A symlink
        // is written through (the file it names is replaced). Where the user may write the
        // file but not its directory, it is written in place, as before.
        FileOp::Write { mode, .. } => (
            format!(
                r#"mkdir -p -- "$(dirname -- "$1")" 2>/dev/null || exit 43; [ -d "$1" ] && exit 47; f=$1; if [ -L "$f" ]; then f=$(readlink -f -- "$f") || exit 43; [ -d "$f" ] && exit 47; fi; t=$(dirname -- "$f")/$3; if (umask 077; : > "$t") 2>/dev/null; then cat > "$t" 2>/dev/null || {{ rm -f -- "$t"; exit 43; }}; if [ -n "$2" ]; then chmod -- "$2" "$t" || {{ rm -f -- "$t"; exit 43; }}; elif [ -e "$f" ]; then chmod --reference="$f" -- "$t" 2>/dev/null; chown --reference="$f" -- "$t" 2>/dev/null; else chmod -- "$(printf %o $((0666 & ~$(umask))))" "$t"; fi; mv -f -- "$t" "$f" 2>/dev/null || {{ rm -f -- "$t"; exit 43; }}; else cat > "$f" 2>/dev/null || exit 43; if [ -n "$2" ]; then chmod -- "$2" "$f" || exit 43; fi; fi; exec find "$1" -maxdepth 0 -printf '{FIND_FMT}'"#
            ),
            vec![
                p(0),
                mode.map(|m| format!("{:o}", m & 0o7777)).unwrap_or_default(),
                upload_name(),
            ],
        ),
        FileOp::Stat { .. } => {
            (format!(r#"{EXISTS}exec find "$1" -maxdepth 0 -printf '{FIND_FMT}'"#), vec![p(0)])
        }
        FileOp::List { depth, .. } => (
            format!(
                r#"{EXISTS}[ -d "$1" ] || exit 46; [ -r "$1" ] && [ -x "$1" ] || exit 43; exec find "$1" -mindepth 1 -maxdepth "$2" -printf '{FIND_FMT}'"#
            ),
            vec![p(0), (*depth).clamp(1, 64).to_string()],
        ),
        FileOp::MakeDir { .. } => (
            format!(
                r#"{{ [ -e "$1" ] || [ -L "$1" ]; }} && exit 45; mkdir -p -- "$1" 2>/dev/null || exit 43; exec find "$1" -maxdepth 0 -printf '{FIND_FMT}'"#
            ),
            vec![p(0)],
        ),
        FileOp::Remove { .. } => (format!(r#"{EXISTS}rm -rf -- "$1" 2>/dev/null || exit 43"#), vec![p(0)]),
        FileOp::Rename { .. } => (
            format!(
                r#"{EXISTS}mkdir -p -- "$(dirname -- "$2")" 2>/dev/null && mv -fT -- "$1" "$2" 2>/dev/null || exit 43; exec find "$2" -maxdepth 0 -printf '{FIND_FMT}'"#
            ),
            vec![p(0), p(1)],
        ),
        FileOp::TarOut { contents, follow, .. } => {
            let path = p(0);
            let (dir, base) = if *contents {
                (path.clone(), ".".to_string())
            } else if path == "/" {
                return Err(ApiError::invalid(
                    "a tar of a sandbox's whole / is not served",
                    "name a directory, or ask for the contents of / (contents=true)",
                ));
            } else {
                split(&path)
            };
            (
                r#"[ -e "$1" ] || [ -L "$1" ] || exit 44; if [ "$3" = 1 ]; then [ -d "$1" ] || exit 46; fi; [ -r "$1" ] || exit 43; printf 'crab-files:ok\n'; exec tar -c $4 -f - -C "$2" -- "$5""#.into(),
                vec![
                    path,
                    dir,
                    if *contents { "1" } else { "0" }.into(),
                    if *follow { "-h" } else { "" }.into(),
                    base,
                ],
            )
        }
        FileOp::TarIn { same_owner, .. } => (
            r#"mkdir -p -- "$1" 2>/dev/null; [ -e "$1" ] || exit 43; [ -d "$1" ] || exit 46; [ -w "$1" ] || exit 43; exec tar -x $2 -f - -C "$1""#.into(),
            vec![p(0), if *same_owner { "--same-owner" } else { "--no-same-owner" }.into()],
        ),
    })
}

/// The hidden name a write fills before it is renamed over its target.
fn upload_name() -> String {
    use crate::runtime::rand_u32;
    format!(".crab-upload-{:08x}{:08x}", rand_u32(), rand_u32())
}

/// Removes what a killed write left: the hidden file beside the target (`$2`, as the write
/// program named it).
const UPLOAD_CLEANUP: &str =
    r#"f=$1; [ -L "$f" ] && f=$(readlink -f -- "$f"); rm -f -- "$(dirname -- "$f")/$2""#;

/// (parent, last component) of an absolute path other than `/`.
fn split(p: &str) -> (String, String) {
    match p.rsplit_once('/') {
        Some(("", b)) => ("/".into(), b.into()),
        Some((d, b)) => (d.into(), b.into()),
        None => ("/".into(), p.into()),
    }
}

/// argv running `script args…` as `user` (root: as is; another account: through `setpriv`
/// with its uid, primary gid, groups and a fresh login environment; 48 when it does not exist).
fn as_user(user: &str, script: String, args: Vec<String>) -> Vec<String> {
    let mut v = Vec::new();
    if user != ROOT {
        v.extend(
            [
                "/bin/sh",
                "-c",
                r#"u=$1; shift; g=$(id -g -- "$u" 2>/dev/null) && id -u -- "$u" >/dev/null 2>&1 || exit 48; exec setpriv --reuid="$u" --regid="$g" --init-groups --reset-env -- "$@""#,
                "crab-files-user",
                user,
            ]
            .map(String::from),
        );
    }
    v.extend(["/bin/sh".to_string(), "-c".to_string(), script, "crab-files".to_string()]);
    v.extend(args);
    v
}

/// Run `op` in sandbox `name` as `user` (root when `None`).
pub async fn run(
    rt: Arc<Runtime>,
    name: &str,
    user: Option<&str>,
    op: FileOp,
) -> Result<FileAnswer, ApiError> {
    let user = user.filter(|u| !u.is_empty()).unwrap_or(ROOT).to_string();
    check_user(&user)?;
    let paths: Vec<String> = match &op {
        FileOp::Read { path }
        | FileOp::Write { path, .. }
        | FileOp::Stat { path }
        | FileOp::List { path, .. }
        | FileOp::MakeDir { path }
        | FileOp::Remove { path }
        | FileOp::TarOut { path, .. } => vec![resolve_path(path, &user)?],
        FileOp::TarIn { dir, .. } => vec![resolve_path(dir, &user)?],
        FileOp::Rename { from, to } => vec![resolve_path(from, &user)?, resolve_path(to, &user)?],
    };
    let (script, args) = program(&op, &paths)?;
    let upload = matches!(op, FileOp::Write { .. }).then(|| args.get(2).cloned()).flatten();
    let argv = as_user(&user, script, args);
    let ctx = Ctx { rt, name: name.to_string(), user, what: op.name(), path: paths[0].clone() };
    match op {
        FileOp::Read { .. } | FileOp::TarOut { .. } => {
            Ok(FileAnswer::Stream(ctx.stream(argv).await?))
        }
        FileOp::Write { data, .. } => {
            let r = match ctx.collect(argv, Some(data), LONG).await {
                Ok(r) => r,
                Err(e) => {
                    // Killed mid-stream: the target is as it was; remove the half-filled file
                    // beside it (best effort — a hidden `.crab-upload-*` is all that can stay).
                    if let Some(t) = upload {
                        let argv = as_user(
                            &ctx.user,
                            UPLOAD_CLEANUP.to_string(),
                            vec![paths[0].clone(), t],
                        );
                        if let Err(c) = ctx.collect(argv, None, SHORT).await {
                            tracing::debug!(sandbox = ctx.name, error = %c.message, "upload cleanup failed");
                        }
                    }
                    return Err(e);
                }
            };
            Ok(FileAnswer::Entry(Box::new(ctx.one(&r, &paths[0])?)))
        }
        FileOp::TarIn { data, .. } => {
            let r = ctx.collect(argv, Some(data), LONG).await?;
            match r.code {
                0 => Ok(FileAnswer::Done { ok: true }),
                c if ctx.known(c) => Err(ctx.failure(&r, &paths[0])),
                c => Err(ApiError::invalid(
                    format!(
                        "tar -x into {} of sandbox {} failed (exit {c}): {}",
                        paths[0], ctx.name, r.stderr
                    ),
                    "send an uncompressed tar whose members the user may write there",
                )),
            }
        }
        FileOp::Stat { .. } | FileOp::MakeDir { .. } => {
            let r = ctx.collect(argv, None, SHORT).await?;
            Ok(FileAnswer::Entry(Box::new(ctx.one(&r, &paths[0])?)))
        }
        FileOp::Rename { .. } => {
            let r = ctx.collect(argv, None, SHORT).await?;
            if r.code == 44 {
                return Err(ctx.failure(&r, &paths[0]));
            }
            Ok(FileAnswer::Entry(Box::new(ctx.one(&r, &paths[1])?)))
        }
        FileOp::List { .. } => {
            let r = ctx.collect(argv, None, SHORT).await?;
            if r.code != 0 {
                return Err(ctx.failure(&r, &paths[0]));
            }
            Ok(FileAnswer::Entries(parse_entries(&r.stdout).map_err(|m| ctx.garbled(&m))?))
        }
        FileOp::Remove { .. } => {
            let r = ctx.collect(argv, None, SHORT).await?;
            if r.code != 0 {
                return Err(ctx.failure(&r, &paths[0]));
            }
            Ok(FileAnswer::Done { ok: true })
        }
    }
}

/// What a program left: its exit status, stdout (bounded) and the tail of its stderr.
#[derive(Debug)]
struct Ran {
    code: i32,
    stdout: Vec<u8>,
    stderr: String,
}

/// One operation's context (for running its program and naming it in errors).
struct Ctx {
    rt: Arc<Runtime>,
    name: String,
    user: String,
    what: &'static str,
    path: String,
}

/// Kills whatever in the sandbox still holds the operation's pipes when dropped armed.
struct Holders {
    cg: crate::cgroup::SandboxCgroup,
    inodes: Vec<u64>,
    armed: bool,
}

impl Holders {
    fn kill(&self) {
        for _ in 0..50 {
            if crate::exec::kill_pipe_holders(&self.cg, &self.inodes) == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        if self.armed {
            self.kill();
        }
    }
}

fn pipe_inode(fd: &impl AsRawFd) -> Option<u64> {
    std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok().map(|m| m.ino())
}

/// A started program: the helper, its pipes, and the guard of what holds them.
struct Started {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    stdout: tokio::process::ChildStdout,
    stderr: tokio::process::ChildStderr,
    holders: Holders,
}

/// Read up to `limit` bytes; `Err(())` when there were more.
async fn read_bounded(mut r: impl AsyncRead + Unpin, limit: usize) -> Result<Vec<u8>, ()> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return Ok(out),
            Ok(n) if out.len() + n > limit => return Err(()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// Drain `r`, keeping its last [`STDERR_TAIL`] bytes as text.
async fn read_tail(mut r: impl AsyncRead + Unpin) -> String {
    let mut keep: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 8192];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            break;
        }
        keep.extend_from_slice(&buf[..n]);
        if keep.len() > STDERR_TAIL {
            keep.drain(..keep.len() - STDERR_TAIL);
        }
    }
    String::from_utf8_lossy(&keep)
        .trim()
        .chars()
        .filter(|c| !c.is_control() || *c == '\n')
        .collect()
}

/// Feed `data` to `stdin`, at most [`MAX_WRITE`] bytes.
async fn feed(
    stdin: &mut tokio::process::ChildStdin,
    mut data: Chunks,
    what: &str,
) -> Result<(), ApiError> {
    let mut total: u64 = 0;
    while let Some(chunk) = data.recv().await {
        let chunk = chunk?;
        total += chunk.len() as u64;
        if total > MAX_WRITE {
            return Err(ApiError::new(
                ErrorCode::TooLarge,
                format!("{what} is larger than the file service's limit of {MAX_WRITE} bytes"),
                "split it, or copy it in parts",
            ));
        }
        match tokio::time::timeout(IDLE, stdin.write_all(&chunk)).await {
            Ok(Ok(())) => {}
            // The program stopped reading (it failed): its status says why.
            Ok(Err(_)) => return Ok(()),
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::Timeout,
                    format!("{what} was not taken for {} s; the write was killed", IDLE.as_secs()),
                    "check what the sandbox runs",
                ))
            }
        }
    }
    let _ = stdin.shutdown().await;
    Ok(())
}

impl Ctx {
    async fn start(&self, argv: Vec<String>, stdin: bool) -> Result<Started, ApiError> {
        let req = ExecRequest {
            cmd: argv,
            env: vec![format!("HOME={}", crab_common::files::home_of(&self.user))],
            workdir: Some("/".into()),
            // As root: the script itself switches to the account (`as_user`).
            user: Some("root".into()),
            timeout_s: None,
            stdin_b64: stdin.then(String::new),
            stdin_session: None,
        };
        let spec = self.rt.exec_spec(&self.name, &req).map_err(ApiError::from)?;
        let spec_fd = crate::specfd::spec_memfd(&spec).map_err(ApiError::from)?;
        let mut cmd = tokio::process::Command::new(self.rt.helper_exe());
        let mut child = cmd
            .arg("__nsexec")
            .args(crate::specfd::inheritable(&spec_fd).map_err(ApiError::from)?)
            .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                ApiError::internal(format!(
                    "starting the exec helper {}: {e}",
                    self.rt.helper_source().display()
                ))
            })?;
        let missing = || ApiError::internal("the exec helper has no pipes");
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let stderr = child.stderr.take().ok_or_else(missing)?;
        let stdin = child.stdin.take();
        let mut inodes: Vec<u64> =
            [pipe_inode(&stdout), pipe_inode(&stderr)].into_iter().flatten().collect();
        if let Some(i) = &stdin {
            inodes.extend(pipe_inode(i));
        }
        let holders = Holders { cg: self.rt.cgroup(&self.name), inodes, armed: true };
        Ok(Started { child, stdin, stdout, stderr, holders })
    }

    /// Run a describing or writing program to its end: its status, bounded stdout, stderr tail.
    async fn collect(
        &self,
        argv: Vec<String>,
        data: Option<Chunks>,
        deadline: Duration,
    ) -> Result<Ran, ApiError> {
        let mut s = self.start(argv, data.is_some()).await?;
        let out = tokio::spawn(read_bounded(s.stdout, MAX_REPLY));
        let err = tokio::spawn(read_tail(s.stderr));
        let work = async {
            if let (Some(data), Some(mut stdin)) = (data, s.stdin.take()) {
                // On a failure the program is killed before its stdin closes, so a cut-off
                // stream never ends as a shorter file.
                if let Err(e) = feed(&mut stdin, data, &format!("the data for {}", self.path)).await
                {
                    s.holders.kill();
                    drop(stdin);
                    return Err(e);
                }
                drop(stdin);
            }
            let stdout = out
                .await
                .map_err(|e| ApiError::internal(format!("reading the program's output: {e}")))?
                .map_err(|()| {
                    ApiError::new(
                        ErrorCode::TooLarge,
                        format!(
                            "the {} of {} in sandbox {} answered more than {MAX_REPLY} bytes",
                            self.what, self.path, self.name
                        ),
                        "list fewer levels (depth) or a smaller directory",
                    )
                })?;
            let stderr = err.await.unwrap_or_default();
            let status = s
                .child
                .wait()
                .await
                .map_err(|e| ApiError::internal(format!("waiting for the exec helper: {e}")))?;
            Ok::<_, ApiError>(Ran { code: status.code().unwrap_or(137), stdout, stderr })
        };
        let r = match tokio::time::timeout(deadline, work).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::new(
                ErrorCode::Timeout,
                format!(
                    "the {} of {} in sandbox {} did not finish within {} s; it was killed",
                    self.what,
                    self.path,
                    self.name,
                    deadline.as_secs()
                ),
                "check the sandbox is not frozen or out of resources",
            )),
        };
        if let Ok(ran) = &r {
            s.holders.armed = false;
            self.died(ran.code)?;
        }
        r
    }

    /// Start a streaming program; answers its data once it printed its ready line.
    async fn stream(&self, argv: Vec<String>) -> Result<Chunks, ApiError> {
        let Started { mut child, stdin: _, mut stdout, stderr, holders } =
            self.start(argv, false).await?;
        let mut err = Some(tokio::spawn(read_tail(stderr)));
        // The ready line, or the program's end.
        let mut head = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        let ready = tokio::time::timeout(SHORT, async {
            while head.len() < READY.len() {
                match stdout.read(&mut buf).await {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            true
        })
        .await;
        match ready {
            Ok(true) if head.starts_with(READY) => {}
            Ok(_) => {
                let status = child
                    .wait()
                    .await
                    .map_err(|e| ApiError::internal(format!("waiting for the exec helper: {e}")))?;
                let stderr = match err.take() {
                    Some(h) => h.await.unwrap_or_default(),
                    None => String::new(),
                };
                let code = status.code().unwrap_or(137);
                self.died(code)?;
                let ran = Ran { code, stdout: Vec::new(), stderr };
                if code == 0 || !head.is_empty() {
                    return Err(self.garbled("no ready line before its data"));
                }
                return Err(self.failure(&ran, &self.path));
            }
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::Timeout,
                    format!(
                        "the {} of {} in sandbox {} did not start within {} s; it was killed",
                        self.what,
                        self.path,
                        self.name,
                        SHORT.as_secs()
                    ),
                    "check the sandbox is not frozen or out of resources",
                ))
            }
        }
        let (tx, rx) = mpsc::channel(16);
        let first = head[READY.len()..].to_vec();
        let (name, path, what) = (self.name.clone(), self.path.clone(), self.what);
        let alive = self.rt.clone();
        tokio::spawn(async move {
            // The whole guard moves here (not just the field written below).
            let mut holders = holders;
            let pump = async {
                if !first.is_empty() && tx.send(Ok(first)).await.is_err() {
                    return false;
                }
                loop {
                    match tokio::time::timeout(IDLE, stdout.read(&mut buf)).await {
                        Err(_) => {
                            let _ = tx
                                .send(Err(ApiError::new(
                                    ErrorCode::Timeout,
                                    format!("the {what} of {path} in sandbox {name} sent nothing for {} s; it was killed", IDLE.as_secs()),
                                    "check what the sandbox runs",
                                )))
                                .await;
                            return false;
                        }
                        Ok(Ok(0) | Err(_)) => return true,
                        Ok(Ok(n)) => {
                            match tokio::time::timeout(IDLE, tx.send(Ok(buf[..n].to_vec()))).await {
                                Ok(Ok(())) => {}
                                _ => return false,
                            }
                        }
                    }
                }
            };
            let done = matches!(tokio::time::timeout(LONG, pump).await, Ok(true));
            if !done {
                // Abandoned or too slow: the program dies with whatever holds its pipes.
                tracing::info!(sandbox = %name, %path, what, "file stream abandoned; killed");
                return;
            }
            let code = child.wait().await.ok().and_then(|st| st.code()).unwrap_or(137);
            let stderr = match err.take() {
                Some(h) => h.await.unwrap_or_default(),
                None => String::new(),
            };
            holders.armed = false;
            if code != 0 {
                let why = if code == 137 && !sandbox_alive(&alive, &name) {
                    format!("sandbox {name} stopped during the transfer")
                } else {
                    format!("exit {code}: {stderr}")
                };
                tracing::warn!(sandbox = %name, %path, what, %why, "file stream failed");
                let _ = tx
                    .send(Err(ApiError::internal(format!(
                        "the {what} of {path} in sandbox {name} failed part way ({why})"
                    ))))
                    .await;
            }
        });
        Ok(rx)
    }

    /// A program killed (137) because its sandbox stopped.
    fn died(&self, code: i32) -> Result<(), ApiError> {
        if code == 137 && !sandbox_alive(&self.rt, &self.name) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {} stopped during the {} of {}", self.name, self.what, self.path),
                format!("start it (`crab sandbox start {}`) and retry", self.name),
            ));
        }
        Ok(())
    }

    fn known(&self, code: i32) -> bool {
        (43..=48).contains(&code)
    }

    /// The error a program's status means, naming `path`.
    fn failure(&self, r: &Ran, path: &str) -> ApiError {
        let (sb, user) = (&self.name, &self.user);
        match r.code {
            43 => ApiError::new(
                ErrorCode::PermissionDenied,
                format!("permission denied: {user} may not {} {path} in sandbox {sb}", self.what),
                "act as another user (user=root), or change the path's permissions",
            ),
            44 => ApiError::new(
                ErrorCode::NotFound,
                format!("no such file or directory in sandbox {sb}: {path}"),
                "check the path (list its directory)",
            ),
            45 => ApiError::new(
                ErrorCode::AlreadyExists,
                format!("{path} already exists in sandbox {sb}"),
                "pick another path, or remove it first",
            ),
            46 => ApiError::invalid(
                format!("{path} in sandbox {sb} is not a directory"),
                "name a directory",
            ),
            47 => ApiError::invalid(
                format!("{path} in sandbox {sb} is a directory"),
                "name a file (a directory is read with a tar)",
            ),
            48 => ApiError::invalid(
                format!("sandbox {sb} has no user {user:?}"),
                "name an account of the sandbox's /etc/passwd, or root",
            ),
            c => ApiError::internal(format!(
                "the {} of {path} in sandbox {sb} failed (exit {c}): {}",
                self.what, r.stderr
            )),
        }
    }

    /// A reply that does not parse (the sandbox's programs are not what they should be).
    fn garbled(&self, why: &str) -> ApiError {
        ApiError::internal(format!(
            "the {} of {} in sandbox {} answered unreadably ({why})",
            self.what, self.path, self.name
        ))
    }

    /// The one entry a successful program described.
    fn one(&self, r: &Ran, path: &str) -> Result<FileEntry, ApiError> {
        if r.code != 0 {
            return Err(self.failure(r, path));
        }
        let mut v = parse_entries(&r.stdout).map_err(|m| self.garbled(&m))?;
        match (v.pop(), v.is_empty()) {
            (Some(e), true) => Ok(e),
            _ => Err(self.garbled("not exactly one entry")),
        }
    }
}

/// Whether sandbox `name`'s init still runs.
fn sandbox_alive(rt: &Runtime, name: &str) -> bool {
    rt.record(name).is_ok_and(|r| crate::runtime::init_alive(r.init_pid, r.init_start))
}

fn kind(c: &str) -> FileKind {
    match c {
        "f" => FileKind::File,
        "d" => FileKind::Dir,
        _ => FileKind::Other,
    }
}

/// Parse `find -printf FIND_FMT` output (NUL-separated fields, 10 per entry). Untrusted: a
/// field that does not parse is an error, not a default.
pub fn parse_entries(out: &[u8]) -> Result<Vec<FileEntry>, String> {
    if out.is_empty() {
        return Ok(Vec::new());
    }
    let body = out.strip_suffix(b"\0").ok_or("the listing does not end with NUL")?;
    let fields: Vec<String> =
        body.split(|b| *b == 0).map(|f| String::from_utf8_lossy(f).into_owned()).collect();
    if !fields.len().is_multiple_of(10) {
        return Err(format!("{} fields, not a multiple of 10", fields.len()));
    }
    let bad = |what: &str, v: &str| {
        format!("{what} {:?} does not parse", v.chars().take(40).collect::<String>())
    };
    let mut entries = Vec::with_capacity(fields.len() / 10);
    for r in fields.chunks(10) {
        let path = r[0].clone();
        if !path.starts_with('/') {
            return Err(bad("path", &path));
        }
        let is_symlink = r[1] == "l";
        let name = if path == "/" {
            "/".to_string()
        } else {
            path.rsplit('/').next().unwrap_or(&path).to_string()
        };
        let modified_s: f64 = r[7].parse().map_err(|_| bad("mtime", &r[7]))?;
        entries.push(FileEntry {
            name,
            kind: if is_symlink { kind(&r[9]) } else { kind(&r[1]) },
            size: r[2].parse().map_err(|_| bad("size", &r[2]))?,
            mode: u32::from_str_radix(&r[3], 8).map_err(|_| bad("mode", &r[3]))?,
            permissions: r[4].clone(),
            owner: r[5].clone(),
            group: r[6].clone(),
            modified_s: if modified_s.is_finite() { modified_s } else { 0.0 },
            symlink_target: is_symlink.then(|| r[8].clone()),
            is_symlink,
            path,
        });
    }
    Ok(entries)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn listing(fields: &[&str]) -> Vec<u8> {
        fields.iter().flat_map(|f| format!("{f}\0").into_bytes()).collect()
    }

    #[test]
    fn listing_parses() {
        let out = listing(&[
            "/home/user/a.txt",
            "f",
            "5",
            "644",
            "-rw-r--r--",
            "user",
            "user",
            "1700000000.5",
            "",
            "f",
            "/home/user/l",
            "l",
            "4",
            "777",
            "lrwxrwxrwx",
            "user",
            "user",
            "1700000000",
            "/etc",
            "d",
        ]);
        let e = parse_entries(&out).unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(
            (e[0].name.as_str(), e[0].kind, e[0].size, e[0].mode),
            ("a.txt", FileKind::File, 5, 0o644)
        );
        assert_eq!(e[0].modified_s, 1_700_000_000.5);
        assert!(e[1].is_symlink);
        assert_eq!(e[1].kind, FileKind::Dir);
        assert_eq!(e[1].symlink_target.as_deref(), Some("/etc"));
        assert!(parse_entries(b"").unwrap().is_empty());
    }

    /// A hostile reply: wrong field counts, no trailing NUL, non-numbers, relative paths.
    #[test]
    fn garbage_is_refused() {
        assert!(parse_entries(b"a\0b\0").is_err());
        assert!(parse_entries(b"no nul at all").is_err());
        let mut f = ["/x", "f", "5", "644", "-", "u", "g", "1", "", "f"];
        assert!(parse_entries(&listing(&f)).is_ok());
        f[2] = "-5";
        assert!(parse_entries(&listing(&f)).is_err());
        f[2] = "5";
        f[3] = "9z";
        assert!(parse_entries(&listing(&f)).is_err());
        f[3] = "644";
        f[0] = "x";
        assert!(parse_entries(&listing(&f)).is_err());
    }

    #[test]
    fn users_switch_through_setpriv() {
        let a = as_user("root", "true".into(), vec!["x".into()]);
        assert_eq!(a, ["/bin/sh", "-c", "true", "crab-files", "x"]);
        let a = as_user("bob", "true".into(), vec![]);
        assert_eq!(a[4], "bob");
        assert!(a[2].contains("setpriv"));
        assert_eq!(&a[5..], ["/bin/sh", "-c", "true", "crab-files"]);
    }

    /// The programs run here with the host's own sh and coreutils, in a scratch directory:
    /// their statuses mean what [`Ctx::failure`] says.
    #[test]
    fn programs_report_by_status() {
        use std::process::Command;
        let root = std::env::temp_dir().join(format!("crab-files-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let d = root.display().to_string();
        let run = |op: FileOp, paths: &[&str], stdin: &[u8]| {
            use std::io::Write;
            let paths: Vec<String> = paths.iter().map(|p| p.to_string()).collect();
            let (script, args) = program(&op, &paths).unwrap();
            let argv = as_user("root", script, args);
            let mut c = Command::new(&argv[0])
                .args(&argv[1..])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let _ = c.stdin.take().unwrap().write_all(stdin);
            let o = c.wait_with_output().unwrap();
            (o.status.code().unwrap(), o.stdout)
        };
        let (_, rx) = mpsc::channel(1);
        let f = format!("{d}/a/b/f.txt");
        let (c, out) = run(
            FileOp::Write { path: String::new(), mode: Some(0o600), data: rx },
            &[&f],
            b"hello",
        );
        assert_eq!(c, 0);
        let e = parse_entries(&out).unwrap();
        assert_eq!((e[0].size, e[0].mode, e[0].kind), (5, 0o600, FileKind::File));
        // Over an existing file: replaced whole, its mode kept, nothing left beside it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let (c, _) = run(
            FileOp::Write { path: String::new(), mode: None, data: mpsc::channel(1).1 },
            &[&f],
            b"hello!",
        );
        assert_eq!(c, 0);
        let m = std::fs::metadata(&f).unwrap();
        assert_eq!((m.len(), m.permissions().mode() & 0o7777), (6, 0o640));
        let names: Vec<String> = std::fs::read_dir(format!("{d}/a/b"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["f.txt"], "no hidden upload file left");
        std::fs::write(&f, b"hello").unwrap();
        let (c, out) = run(FileOp::Read { path: String::new() }, &[&f], b"");
        assert_eq!((c, out.as_slice()), (0, &b"crab-files:ok\nhello"[..]));
        let missing = format!("{d}/nope");
        assert_eq!(run(FileOp::Read { path: String::new() }, &[&missing], b"").0, 44);
        assert_eq!(run(FileOp::Stat { path: String::new() }, &[&missing], b"").0, 44);
        assert_eq!(run(FileOp::Read { path: String::new() }, &[&d], b"").0, 47);
        assert_eq!(run(FileOp::List { path: String::new(), depth: 1 }, &[&f], b"").0, 46);
        assert_eq!(run(FileOp::MakeDir { path: String::new() }, &[&d], b"").0, 45);
        let (c, out) = run(FileOp::List { path: String::new(), depth: 3 }, &[&d], b"");
        assert_eq!(c, 0);
        assert_eq!(parse_entries(&out).unwrap().len(), 3, "a, a/b, a/b/f.txt");
        let to = format!("{d}/c/g.txt");
        let (c, out) =
            run(FileOp::Rename { from: String::new(), to: String::new() }, &[&f, &to], b"");
        assert_eq!(c, 0);
        assert_eq!(parse_entries(&out).unwrap()[0].path, to);
        let (c, out) = run(
            FileOp::TarOut { path: String::new(), contents: false, follow: false },
            &[&format!("{d}/c")],
            b"",
        );
        assert_eq!(c, 0);
        let tar = out.strip_prefix(READY).unwrap().to_vec();
        let (_, rx) = mpsc::channel(1);
        let (c, _) = run(
            FileOp::TarIn { dir: String::new(), same_owner: false, data: rx },
            &[&format!("{d}/x")],
            &tar,
        );
        assert_eq!(c, 0);
        assert_eq!(std::fs::read(format!("{d}/x/c/g.txt")).unwrap(), b"hello");
        assert_eq!(run(FileOp::Remove { path: String::new() }, &[&format!("{d}/x")], b"").0, 0);
        assert_eq!(run(FileOp::Remove { path: String::new() }, &[&format!("{d}/x")], b"").0, 44);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
