//! Background processes of a sandbox: the one service behind `crab exec -d`, `crab ps`,
//! `crab logs`, `crab docker run -d`, the SDK's `sb.commands` and E2B's envd processes.
//!
//! A process started here runs detached under a small POSIX-shell supervisor inside the
//! sandbox (a child of the sandbox's init, in a session of its own), which keeps everything
//! about it in `/run/crab-procs/<id>/` of the sandbox's root: `meta.json` (argv, env, cwd, user,
//! tag, whether it has a stdin, start time), `pid` (the supervisor's pid in the sandbox),
//! `cpid` (the command's), `out` and `err` (everything it printed, in the sandbox's own disk
//! quota), the FIFO `in` held open by a `sleep` whose pid is in `inpid` (its stdin, until
//! closed) and `exit` (its exit status, once it exited). The daemon holds nothing about it: a
//! daemon restart loses nothing, and a checkpoint dumps the supervisor with the sandbox and
//! snapshots the files with its root, so after a restore or in a fork the process is listed,
//! followed and signalled by the same id.
//!
//! Starting, feeding stdin, closing it and signalling run small programs in the sandbox
//! through [`crate::exec`] (as root; the command itself switches user with `setpriv`). Listing
//! and following read the files from the host, resolved inside the sandbox's root
//! ([`InRoot`]: no symlink leaves it, no FIFO blocks), every read bounded and parsed as hostile:
//! a sandbox that forges its supervisor files only lies about its own processes. One sandbox
//! keeps at most [`MAX_PROCS`] of them; ended ones are removed oldest first to make room.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crab_common::api::{ExecFrame, ExecRequest, ProcInfo, ProcStartRequest, ProcState};

use crate::error::{Result, SandboxError};
use crate::inroot::InRoot;
use crate::runtime::{rand_u32, Runtime};

/// Where the processes keep their directories inside the sandbox.
pub const PROCS_DIR: &str = "/run/crab-procs";

/// How many background processes (running or ended and not yet removed) one sandbox keeps.
pub const MAX_PROCS: usize = 64;

/// Entries of [`PROCS_DIR`] read at most (the sandbox may fill it with anything).
const SCAN_MAX: usize = 4 * MAX_PROCS;
/// Bytes of `meta.json` at most: written (argv, env and the rest of a start request) and read.
/// It reaches the launcher on its stdin (not as an argument, which Linux bounds to 128 KiB):
/// room for a command line and environment near `ARG_MAX` (2 MiB), JSON-escaped.
const META_MAX: u64 = 5 << 19;
/// Bytes of `meta.json` one listing reads over all its processes: [`MAX_PROCS`] forged files
/// of [`META_MAX`] would be 160 MiB held at once. Past it a process is listed without what its
/// `meta.json` says (a sandbox that forges them hides only its own command lines).
const LIST_META_BUDGET: u64 = 16 << 20;
/// Bytes of `pid`, `exit` read at most.
const SMALL_MAX: u64 = 32;
/// Bytes of a process's `/proc/<pid>/cmdline` read to recognize a supervisor.
const CMDLINE_MAX: u64 = 4096;
/// Bytes sent in one output frame.
const CHUNK: usize = 64 * 1024;
/// Frames of one stream sent per poll before the other stream gets its turn.
const CHUNKS_PER_TICK: usize = 16;
/// How often a follow looks for new output.
const POLL: Duration = Duration::from_millis(100);
/// Polls between two checks that the supervisor still runs (a walk of the sandbox's cgroup).
const ALIVE_EVERY: u32 = 10;
/// Bytes of one stdin write at most.
pub const STDIN_MAX: usize = 8 * 1024 * 1024;
/// Seconds a helper program (start, stdin, close, signal) may take.
const PROGRAM_TIMEOUT_S: f64 = 60.0;
/// Bytes of a helper program's output kept.
const PROGRAM_OUT_MAX: usize = 64 * 1024;
/// Longest tag.
const TAG_MAX: usize = 256;

/// What the daemon writes in `meta.json` (and reads back as the sandbox left it).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Meta {
    #[serde(default)]
    cmd: Vec<String>,
    #[serde(default)]
    env: Vec<String>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: bool,
    #[serde(default)]
    started_at: u64,
}

/// The supervisor (`$1` its directory, `$2` non-empty for a stdin, then the argv). It records
/// its pid, starts the command in a session of its own with its output appended to `out` and
/// `err`, says its pid on descriptor 4 (the launcher's pipe) and closes it, waits, stops the
/// stdin holder and writes the exit status (atomically: `exit.new` renamed).
const SUPERVISOR: &str = r#"d=$1; in=$2; shift 2
i=/dev/null
if [ -n "$in" ]; then
  mkfifo -m 600 "$d/in" || exit 125
  sleep infinity >"$d/in" </dev/null 4>&- & echo $! >"$d/inpid"
  i=$d/in
fi
echo $$ >"$d/pid"
setsid "$@" <"$i" >>"$d/out" 2>>"$d/err" 4>&- & c=$!
echo $c >"$d/cpid"
echo $$ >&4
exec 4>&-
wait $c; s=$?
[ -n "$in" ] && read k <"$d/inpid" 2>/dev/null && [ -n "$k" ] && kill "$k" 2>/dev/null
echo $s >"$d/exit.new" && mv -f "$d/exit.new" "$d/exit""#;

/// The launcher (`$1` directory, `$2` stdin flag, `$3` cwd, `$4` the ids of ended processes
/// to remove, then the argv; the meta JSON on its stdin): makes the directory, starts the supervisor
/// detached (`setsid`, reparented to the sandbox's init) and prints its pid once the command
/// started. 127: a tool is missing; 120: the working directory does not exist.
const LAUNCH: &str = r#"d=$1; in=$2; cwd=$3; gc=$4; shift 4
for t in setsid mkfifo sleep; do command -v $t >/dev/null 2>&1 || { echo "$t is not installed in this sandbox (background processes need util-linux and coreutils)" >&2; exit 127; }; done
for g in $gc; do rm -rf -- "${d%/*}/$g"; done
mkdir -p -m 700 "${d%/*}" 2>/dev/null
mkdir -m 700 -- "$d" || { echo "cannot create $d in the sandbox" >&2; exit 125; }
{ cat >"$d/meta.json" && : >"$d/out" && : >"$d/err"; } || { echo "cannot write in $d (is the sandbox's disk full?)" >&2; rm -rf -- "$d"; exit 125; }
cd -- "$cwd" 2>/dev/null || { echo "the working directory $cwd does not exist in the sandbox (or is not a directory)" >&2; rm -rf -- "$d"; exit 120; }
p=$( (setsid sh -c "$SUP" crab-proc "$d" "$in" "$@" 4>&1 >/dev/null 2>&1 </dev/null &) )
[ -n "$p" ] && { echo "$p"; exit 0; }
echo "the supervisor did not start" >&2
exit 125"#;

/// Write stdin to the process's stdin (44: it has none, or it was closed). Opened read-write,
/// so it never blocks on a reader that went away.
const SEND_INPUT: &str = r#"[ -p "$1/in" ] && [ -s "$1/inpid" ] || exit 44; exec cat 1<>"$1/in""#;

/// Close the process's stdin: end the `sleep` holding the FIFO open (44: none left).
const CLOSE_INPUT: &str = r#"[ -p "$1/in" ] && read k <"$1/inpid" 2>/dev/null && [ -n "$k" ] || exit 44; kill "$k" 2>/dev/null; : >"$1/inpid""#;

/// Send signal `$2` to the command's process group (else the command); 44: no command pid.
/// The signal is recorded in `signalled` first (so an exit status of 128+N can be told from a
/// command's own `exit 128+N`).
const SIGNAL: &str = r#"read c <"$1/cpid" 2>/dev/null && [ -n "$c" ] || exit 44; echo "$2" >"$1/signalled"; kill -s "$2" -- "-$c" 2>/dev/null || kill -s "$2" "$c" 2>/dev/null; exit 0"#;

/// Whether `id` is a process id this service hands out (16 lowercase hex digits).
pub fn valid_id(id: &str) -> bool {
    id.len() == 16 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn check_id(sandbox: &str, id: &str) -> Result<()> {
    if valid_id(id) {
        Ok(())
    } else {
        Err(SandboxError::NoProcess { sandbox: sandbox.into(), id: id.into() })
    }
}

/// A user name usable on a command line (POSIX portable names).
fn check_user(user: &str) -> Result<()> {
    if user.is_empty()
        || user.len() > 32
        || user.starts_with('-')
        || !user.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
    {
        return Err(SandboxError::Invalid(format!(
            "user {user:?} is not a valid account name (letters, digits, `_`, `-`, `.`; at most 32)"
        )));
    }
    Ok(())
}

fn dir_rel(id: &str) -> PathBuf {
    PathBuf::from(format!("{}/{id}", PROCS_DIR.trim_start_matches('/')))
}

fn dir_abs(id: &str) -> String {
    format!("{PROCS_DIR}/{id}")
}

fn root_of(rt: &Runtime, name: &str) -> Result<InRoot> {
    rt.record(name)?;
    InRoot::open(&rt.state().sandbox_rootfs(name))
}

fn parse_small<T: std::str::FromStr>(root: &InRoot, rel: &Path) -> Option<T> {
    let b = root.read_bounded(rel, SMALL_MAX)?;
    std::str::from_utf8(&b).ok()?.trim().parse().ok()
}

/// A supervisor found running: its cmdline (bounded) and its host pid with its start time.
struct Sup {
    cmdline: Vec<u8>,
    host: (u32, u64),
}

type Sups = std::collections::HashMap<u32, Sup>;

/// The supervisors running in sandbox `name`, by their pid in the sandbox, found by walking
/// its cgroup (`NSpid`, cmdline).
fn supervisors(rt: &Runtime, name: &str) -> Sups {
    let mut out = Sups::new();
    for hp in rt.cgroup(name).pids().unwrap_or_default() {
        let Some(cmdline) = read_host_bounded(&format!("/proc/{hp}/cmdline"), CMDLINE_MAX) else {
            continue;
        };
        if !contains(&cmdline, b"crab-proc\0") {
            continue;
        }
        let Some(status) = read_host_bounded(&format!("/proc/{hp}/status"), 16 * 1024) else {
            continue;
        };
        let status = String::from_utf8_lossy(&status);
        let nspid = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|p| p.parse::<u32>().ok());
        let start = crate::runtime::process_start_time(hp);
        if let (Some(p), Some(start)) = (nspid, start) {
            out.insert(p, Sup { cmdline, host: (hp, start) });
        }
    }
    out
}

fn read_host_bounded(path: &str, max: u64) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path).ok()?.take(max).read_to_end(&mut out).ok()?;
    Some(out)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The supervisor of process `id` (pid `pid` in the sandbox), if it runs: its host pid and
/// start time.
fn running_supervisor(sups: &Sups, id: &str, pid: Option<u32>) -> Option<(u32, u64)> {
    let want = format!("\0{}\0", dir_abs(id));
    pid.and_then(|p| sups.get(&p)).filter(|s| contains(&s.cmdline, want.as_bytes())).map(|s| s.host)
}

fn is_running(sups: &Sups, id: &str, pid: Option<u32>) -> bool {
    running_supervisor(sups, id, pid).is_some()
}

fn file_len(root: &InRoot, rel: &Path) -> u64 {
    root.open_regular(rel).and_then(|f| f.metadata().ok()).map(|m| m.len()).unwrap_or(0)
}

/// Read one process's files (`None`: no such process directory), at most `budget` bytes of its
/// `meta.json` (taken from it). Nothing here is trusted.
fn read_proc(root: &InRoot, sups: &Sups, id: &str, budget: &mut u64) -> Option<ProcInfo> {
    let d = dir_rel(id);
    let meta_bytes = root.read_bounded(&d.join("meta.json"), META_MAX.min(*budget));
    *budget = budget.saturating_sub(meta_bytes.as_ref().map_or(0, |b| b.len() as u64));
    let pid: Option<u32> = parse_small(root, &d.join("pid"));
    if meta_bytes.is_none() && pid.is_none() {
        return None;
    }
    let meta: Meta = meta_bytes.and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    let exit: Option<i32> = parse_small(root, &d.join("exit"));
    let signalled = root
        .read_bounded(&d.join("signalled"), SMALL_MAX)
        .and_then(|b| parse_signal(String::from_utf8_lossy(&b).trim()).ok());
    let state = match exit {
        Some(_) => ProcState::Exited,
        None if is_running(sups, id, pid) => ProcState::Running,
        None => ProcState::Lost,
    };
    Some(ProcInfo {
        id: id.to_string(),
        pid,
        cmd: meta.cmd,
        env: meta.env,
        cwd: meta.cwd,
        user: meta.user,
        tag: meta.tag,
        stdin: meta.stdin,
        started_at: meta.started_at,
        state,
        exit_code: exit,
        stdout_bytes: file_len(root, &d.join("out")),
        stderr_bytes: file_len(root, &d.join("err")),
        signalled,
    })
}

/// The process ids in the sandbox's [`PROCS_DIR`]: at most [`MAX_PROCS`] of the first
/// [`SCAN_MAX`] entries (a sandbox that fills it with more only hides its own processes).
fn ids(root: &InRoot) -> Vec<String> {
    let mut v: Vec<String> = root
        .names(Path::new(PROCS_DIR.trim_start_matches('/')), SCAN_MAX)
        .into_iter()
        .filter(|n| valid_id(n))
        .collect();
    v.sort();
    v.truncate(MAX_PROCS);
    v
}

fn list_in(rt: &Runtime, name: &str, root: &InRoot) -> Vec<ProcInfo> {
    let sups = supervisors(rt, name);
    let mut budget = LIST_META_BUDGET;
    let mut v: Vec<ProcInfo> =
        ids(root).iter().filter_map(|id| read_proc(root, &sups, id, &mut budget)).collect();
    v.sort_by(|a, b| a.started_at.cmp(&b.started_at).then_with(|| a.id.cmp(&b.id)));
    v
}

/// The background processes of sandbox `name`, oldest first (blocking: call off the runtime).
pub fn list(rt: &Runtime, name: &str) -> Result<Vec<ProcInfo>> {
    let root = root_of(rt, name)?;
    Ok(list_in(rt, name, &root))
}

/// Background process `id` of sandbox `name` (blocking).
pub fn info(rt: &Runtime, name: &str, id: &str) -> Result<ProcInfo> {
    check_id(name, id)?;
    let root = root_of(rt, name)?;
    read_proc(&root, &supervisors(rt, name), id, &mut META_MAX.clone())
        .ok_or_else(|| SandboxError::NoProcess { sandbox: name.into(), id: id.into() })
}

/// The running background process of sandbox `name` tagged `tag` (E2B's `Connect` by tag).
pub fn find_tag(rt: &Runtime, name: &str, tag: &str) -> Result<ProcInfo> {
    // Newest first among equals: the running one, else the newest so tagged.
    list(rt, name)?
        .into_iter()
        .rev()
        .filter(|p| p.tag.as_deref() == Some(tag))
        .min_by_key(|p| p.state != ProcState::Running)
        .ok_or_else(|| SandboxError::NoProcess { sandbox: name.into(), id: format!("tag {tag:?}") })
}

/// The background process of sandbox `name` whose supervisor has pid `pid` in the sandbox (E2B's
/// pid): the running one, else the newest that had it.
pub fn find_pid(rt: &Runtime, name: &str, pid: u32) -> Result<ProcInfo> {
    list(rt, name)?
        .into_iter()
        .rev()
        .filter(|p| p.pid == Some(pid))
        .min_by_key(|p| p.state != ProcState::Running)
        .ok_or_else(|| SandboxError::NoProcess { sandbox: name.into(), id: format!("pid {pid}") })
}

/// Resolve a selector: a process id, `tag:NAME` ([`find_tag`]) or `pid:N` ([`find_pid`]).
pub fn select(rt: &Runtime, name: &str, sel: &str) -> Result<ProcInfo> {
    if let Some(tag) = sel.strip_prefix("tag:") {
        return find_tag(rt, name, tag);
    }
    if let Some(pid) = sel.strip_prefix("pid:") {
        let pid = pid
            .parse()
            .map_err(|_| SandboxError::NoProcess { sandbox: name.into(), id: sel.into() })?;
        return find_pid(rt, name, pid);
    }
    info(rt, name, sel)
}

/// The output and exit code of a short helper program run in sandbox `name`.
struct Ran {
    code: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

async fn run_program(rt: &Arc<Runtime>, name: &str, req: ExecRequest) -> Result<Ran> {
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(crate::exec::run(rt.clone(), name.to_string(), req, tx, None));
    let b64 = &base64::engine::general_purpose::STANDARD;
    let mut ran = Ran { code: -1, stdout: Vec::new(), stderr: Vec::new() };
    let keep = |buf: &mut Vec<u8>, d: &str| {
        if let Ok(bytes) = b64.decode(d) {
            let room = PROGRAM_OUT_MAX.saturating_sub(buf.len());
            buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    };
    while let Some(f) = rx.recv().await {
        match f {
            ExecFrame::Stdout { d } => keep(&mut ran.stdout, &d),
            ExecFrame::Stderr { d } => keep(&mut ran.stderr, &d),
            ExecFrame::Exit { code, timed_out, .. } => {
                if timed_out {
                    return Err(SandboxError::Timeout(format!(
                        "a background-process program in sandbox {name} ran past {PROGRAM_TIMEOUT_S} s (is the sandbox overloaded, or does the process not read its stdin?)"
                    )));
                }
                ran.code = code;
                return Ok(ran);
            }
            ExecFrame::Error { error } => return Err(from_exec_error(name, error)),
        }
    }
    Err(SandboxError::Other(format!("sandbox {name}: the exec ended without an exit status")))
}

/// The exec's error as this layer's, keeping its kind (a dead sandbox stays a conflict).
fn from_exec_error(name: &str, e: crab_common::ApiError) -> SandboxError {
    use crab_common::ErrorCode;
    match e.code {
        ErrorCode::SandboxNotFound => SandboxError::NoSandbox(name.to_string()),
        ErrorCode::Conflict => SandboxError::Conflict(e.message),
        ErrorCode::InvalidRequest => SandboxError::Invalid(e.message),
        ErrorCode::Timeout => SandboxError::Timeout(e.message),
        _ => SandboxError::Other(format!("sandbox {name}: {}", e.message)),
    }
}

fn sh(script: &str, args: &[&str]) -> Vec<String> {
    let mut v = vec!["/bin/sh".into(), "-c".into(), script.to_string(), "crab-proc".into()];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

fn validate(req: &ProcStartRequest) -> Result<()> {
    if req.cmd.is_empty() || req.cmd[0].is_empty() {
        return Err(SandboxError::Invalid("a background process needs a command".into()));
    }
    if let Some(u) = &req.user {
        check_user(u)?;
    }
    if let Some(t) = &req.tag {
        if t.is_empty() || t.len() > TAG_MAX || t.chars().any(char::is_control) {
            return Err(SandboxError::Invalid(format!(
                "tag {t:?} must be 1 to {TAG_MAX} bytes without control characters"
            )));
        }
    }
    if let Some(c) = &req.cwd {
        if !c.starts_with('/') {
            return Err(SandboxError::Invalid(format!(
                "cwd {c:?} must be an absolute path inside the sandbox"
            )));
        }
    }
    for kv in &req.env {
        match kv.split_once('=') {
            Some((k, _))
                if !k.is_empty()
                    && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    && !k.as_bytes()[0].is_ascii_digit() => {}
            _ => {
                return Err(SandboxError::Invalid(format!(
                    "environment entry {kv:?} is not KEY=VALUE with KEY of letters, digits and `_`"
                )))
            }
        }
    }
    Ok(())
}

/// The argv the supervisor runs: `cmd` as is for root, else through `setpriv` to `user` with a
/// fresh login environment plus `env`.
fn as_user(user: Option<&str>, env: &[String], cmd: &[String]) -> Vec<String> {
    match user {
        None | Some("root") => cmd.to_vec(),
        Some(u) => {
            let mut v: Vec<String> = vec![
                "setpriv".into(),
                format!("--reuid={u}"),
                format!("--regid={u}"),
                "--init-groups".into(),
                "--reset-env".into(),
                "--".into(),
                "env".into(),
            ];
            v.extend(env.iter().cloned());
            v.extend(cmd.iter().cloned());
            v
        }
    }
}

/// The lock that serializes the starts in sandbox `name` (entries nobody holds are dropped).
fn start_lock(name: &str) -> Arc<tokio::sync::Mutex<()>> {
    type Locks = std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>;
    static LOCKS: std::sync::OnceLock<Locks> = std::sync::OnceLock::new();
    let mut g = LOCKS.get_or_init(Locks::default).lock().unwrap_or_else(|p| p.into_inner());
    g.retain(|_, l| Arc::strong_count(l) > 1);
    g.entry(name.to_string()).or_default().clone()
}

/// Start `req` as a background process of sandbox `name`; answers it as listed.
pub async fn start(rt: Arc<Runtime>, name: String, mut req: ProcStartRequest) -> Result<ProcInfo> {
    // Without an account of its own, the image's `User` (its name or uid part: the supervisor
    // switches through `setpriv` with the account's own groups).
    if req.user.is_none() {
        let r = rt.record(&name)?;
        req.user =
            r.image_config.user.as_deref().and_then(|u| u.split(':').next()).map(str::to_string);
        if req.cwd.is_none() {
            req.cwd = r.image_config.workdir.clone();
        }
    }
    validate(&req)?;
    // One start at a time per sandbox: the cap and the tag are checked, then taken.
    let lock = start_lock(&name);
    let _held = lock.lock().await;
    let (rt2, name2) = (rt.clone(), name.clone());
    let existing = tokio::task::spawn_blocking(move || list(&rt2, &name2))
        .await
        .map_err(|e| SandboxError::Other(format!("listing processes: {e}")))??;
    if let Some(t) = &req.tag {
        if existing.iter().any(|p| p.state == ProcState::Running && p.tag.as_deref() == Some(t)) {
            return Err(SandboxError::Conflict(format!(
                "sandbox {name} already has a running background process tagged {t:?}; pick another tag"
            )));
        }
    }
    // Make room by removing ended processes, oldest first.
    let mut gc: Vec<String> = Vec::new();
    if existing.len() >= MAX_PROCS {
        let need = existing.len() + 1 - MAX_PROCS;
        gc = existing
            .iter()
            .filter(|p| p.state != ProcState::Running)
            .take(need)
            .map(|p| p.id.clone())
            .collect();
        if gc.len() < need {
            return Err(SandboxError::Conflict(format!(
                "sandbox {name} already has {MAX_PROCS} background processes running (the most one sandbox keeps); signal some (`crab signal {name} ID`) or wait for them to end"
            )));
        }
    }
    // Named by the caller's own argument numbers (the launcher adds its own before them).
    crate::specfd::check_exec_args(&req.cmd, &req.env)?;
    let id = format!("{:08x}{:08x}", rand_u32(), rand_u32());
    let meta = Meta {
        cmd: req.cmd.clone(),
        env: req.env.clone(),
        cwd: req.cwd.clone(),
        user: req.user.clone(),
        tag: req.tag.clone(),
        stdin: req.stdin,
        started_at: crab_common::clock::now_s(),
    };
    let meta_json = serde_json::to_string(&meta)
        .map_err(|e| SandboxError::Other(format!("encoding the process's meta: {e}")))?;
    if meta_json.len() as u64 > META_MAX {
        return Err(SandboxError::Invalid(format!(
            "the command, environment, cwd and tag of a background process take {} bytes; at most {META_MAX} (pass large data through a file or its stdin)",
            meta_json.len()
        )));
    }
    // A switched user starts from a fresh login environment: the sandbox's own environment
    // (its record's; root's commands get it from the exec) goes in first, the request's wins.
    let own = rt.record(&name)?.env;
    let mut env: Vec<String> = own
        .iter()
        .filter(|(k, _)| {
            !req.env.iter().any(|kv| kv.split_once('=').is_some_and(|(k2, _)| k2 == *k))
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    env.extend(req.env.iter().cloned());
    let argv = as_user(req.user.as_deref(), &env, &req.cmd);
    let dir = dir_abs(&id);
    let cwd = req.cwd.clone().unwrap_or_else(|| "/".into());
    let mut cmd: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        format!("SUP='{}'\n{LAUNCH}", SUPERVISOR.replace('\'', r"'\''")),
        "crab-proc".into(),
        dir,
        if req.stdin { "1" } else { "" }.into(),
        cwd,
        gc.join(" "),
    ];
    cmd.extend(argv);
    let exec = ExecRequest {
        cmd,
        env: req.env.clone(),
        workdir: Some("/".into()),
        user: Some("root".into()),
        timeout_s: Some(PROGRAM_TIMEOUT_S),
        stdin_b64: Some(base64::engine::general_purpose::STANDARD.encode(meta_json)),
        ..Default::default()
    };
    let ran = run_program(&rt, &name, exec).await?;
    let said = String::from_utf8_lossy(&ran.stderr).trim().to_string();
    match ran.code {
        0 => {}
        120 => return Err(SandboxError::Invalid(said)),
        127 => {
            return Err(SandboxError::Invalid(format!(
                "sandbox {name} cannot run background processes: {said}; use an image with sh, util-linux (setsid, setpriv) and coreutils"
            )))
        }
        c => {
            return Err(SandboxError::Other(format!(
                "sandbox {name}: the background process did not start (exit {c}): {said}"
            )))
        }
    }
    let (rt2, name2, id2) = (rt.clone(), name.clone(), id.clone());
    tokio::task::spawn_blocking(move || info(&rt2, &name2, &id2))
        .await
        .map_err(|e| SandboxError::Other(format!("reading the process back: {e}")))?
}

async fn program_on(
    rt: &Arc<Runtime>,
    name: &str,
    id: &str,
    script: &str,
    extra: &[&str],
    stdin: Option<Vec<u8>>,
) -> Result<i32> {
    let dir = dir_abs(id);
    let mut args = vec![dir.as_str()];
    args.extend_from_slice(extra);
    let req = ExecRequest {
        cmd: sh(script, &args),
        workdir: Some("/".into()),
        user: Some("root".into()),
        timeout_s: Some(PROGRAM_TIMEOUT_S),
        stdin_b64: Some(
            base64::engine::general_purpose::STANDARD.encode(stdin.unwrap_or_default()),
        ),
        ..Default::default()
    };
    let ran = run_program(rt, name, req).await?;
    Ok(ran.code)
}

async fn info_async(rt: &Arc<Runtime>, name: &str, id: &str) -> Result<ProcInfo> {
    let (rt, name, id) = (rt.clone(), name.to_string(), id.to_string());
    tokio::task::spawn_blocking(move || info(&rt, &name, &id))
        .await
        .map_err(|e| SandboxError::Other(format!("reading the process: {e}")))?
}

fn no_stdin(name: &str, id: &str) -> SandboxError {
    SandboxError::Conflict(format!(
        "background process {id} of sandbox {name} has no open stdin (it was started without one, or it was closed)"
    ))
}

/// Write `data` to the stdin of process `id`; answers the bytes written.
pub async fn send_input(
    rt: Arc<Runtime>,
    name: String,
    id: String,
    data: Vec<u8>,
) -> Result<usize> {
    if data.len() > STDIN_MAX {
        return Err(SandboxError::Invalid(format!(
            "{} bytes of stdin in one write; send at most {STDIN_MAX} at a time",
            data.len()
        )));
    }
    let p = info_async(&rt, &name, &id).await?;
    if !p.stdin || p.state != ProcState::Running {
        return Err(no_stdin(&name, &id));
    }
    let n = data.len();
    match program_on(&rt, &name, &id, SEND_INPUT, &[], Some(data)).await? {
        0 => Ok(n),
        44 => Err(no_stdin(&name, &id)),
        c => Err(SandboxError::Other(format!(
            "writing the stdin of background process {id} of sandbox {name} failed (exit {c}); the process stopped reading it"
        ))),
    }
}

/// Close the stdin of process `id` (its reader sees the end of file once it read what was sent).
pub async fn close_input(rt: Arc<Runtime>, name: String, id: String) -> Result<ProcInfo> {
    let p = info_async(&rt, &name, &id).await?;
    if !p.stdin {
        return Err(no_stdin(&name, &id));
    }
    match program_on(&rt, &name, &id, CLOSE_INPUT, &[], None).await? {
        0 => info_async(&rt, &name, &id).await,
        44 => Err(no_stdin(&name, &id)),
        c => Err(SandboxError::Other(format!(
            "closing the stdin of background process {id} of sandbox {name} failed (exit {c})"
        ))),
    }
}

/// A signal name without `SIG` (`TERM`), from a name or a number.
pub fn parse_signal(s: &str) -> Result<String> {
    use std::str::FromStr;
    let bad = || {
        SandboxError::Invalid(format!(
            "unknown signal {s:?}; use a name (TERM, KILL, INT, HUP, USR1, ...) or a number"
        ))
    };
    let sig = match s.trim().parse::<i32>() {
        Ok(n) => nix::sys::signal::Signal::try_from(n).map_err(|_| bad())?,
        Err(_) => {
            let up = s.trim().to_ascii_uppercase();
            let full = if up.starts_with("SIG") { up } else { format!("SIG{up}") };
            nix::sys::signal::Signal::from_str(&full).map_err(|_| bad())?
        }
    };
    Ok(sig.as_str().trim_start_matches("SIG").to_string())
}

/// Send `signal` to process `id` (its command's process group); answers it as listed after.
pub async fn signal(
    rt: Arc<Runtime>,
    name: String,
    id: String,
    signal: String,
) -> Result<ProcInfo> {
    let sig = parse_signal(&signal)?;
    let p = info_async(&rt, &name, &id).await?;
    if p.state != ProcState::Running {
        return Err(SandboxError::Conflict(format!(
            "background process {id} of sandbox {name} is not running ({}); nothing to signal",
            match p.exit_code {
                Some(c) => format!("it exited with {c}"),
                None => "it was lost when its sandbox stopped".into(),
            }
        )));
    }
    match program_on(&rt, &name, &id, SIGNAL, &[&sig], None).await? {
        0 => info_async(&rt, &name, &id).await,
        44 => Err(SandboxError::Conflict(format!(
            "background process {id} of sandbox {name} has not recorded its command's pid; nothing to signal"
        ))),
        c => Err(SandboxError::Other(format!(
            "signalling background process {id} of sandbox {name} failed (exit {c})"
        ))),
    }
}

/// Where a follow of one stream stands.
struct Cursor {
    rel: PathBuf,
    off: u64,
    stdout: bool,
}

impl Cursor {
    /// Send what the file holds past `off` (at most `max_chunks` frames; `None`: all of it).
    /// `Err(())`: the receiver went away.
    async fn drain(
        &mut self,
        root: &InRoot,
        tx: &mpsc::Sender<ExecFrame>,
        max_chunks: Option<usize>,
    ) -> std::result::Result<bool, ()> {
        let Some(mut f) = root.open_regular(&self.rel) else { return Ok(false) };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if len <= self.off || f.seek(SeekFrom::Start(self.off)).is_err() {
            return Ok(false);
        }
        let b64 = &base64::engine::general_purpose::STANDARD;
        let mut buf = vec![0u8; CHUNK];
        let mut n_chunks = 0;
        while self.off < len && max_chunks.is_none_or(|m| n_chunks < m) {
            let want = ((len - self.off) as usize).min(CHUNK);
            let n = match f.read(&mut buf[..want]) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            self.off += n as u64;
            n_chunks += 1;
            let d = b64.encode(&buf[..n]);
            let frame = if self.stdout { ExecFrame::Stdout { d } } else { ExecFrame::Stderr { d } };
            tx.send(frame).await.map_err(|_| ())?;
        }
        Ok(self.off < len)
    }
}

/// Stream the output of process `id` of sandbox `name` to `tx`: what its stdout and stderr
/// hold from `offsets` (bytes already seen of each), then, with `follow`, what they get until
/// it ends. The last frame is `Exit` with its status once it exited, or `Error` (no such
/// process, lost, sandbox gone); a follow-less read of a running process ends without either.
pub async fn output(
    rt: Arc<Runtime>,
    name: String,
    id: String,
    offsets: (u64, u64),
    follow: bool,
    tx: mpsc::Sender<ExecFrame>,
) {
    if let Err(e) = output_inner(&rt, &name, &id, offsets, follow, &tx).await {
        let _ = tx.send(ExecFrame::Error { error: e.into() }).await;
    }
}

async fn output_inner(
    rt: &Arc<Runtime>,
    name: &str,
    id: &str,
    offsets: (u64, u64),
    follow: bool,
    tx: &mpsc::Sender<ExecFrame>,
) -> Result<()> {
    let first = info_async(rt, name, id).await?;
    let d = dir_rel(id);
    let mut out = Cursor { rel: d.join("out"), off: offsets.0, stdout: true };
    let mut err = Cursor { rel: d.join("err"), off: offsets.1, stdout: false };
    let exit_rel = d.join("exit");
    let mut lost = first.state == ProcState::Lost;
    let mut known: Option<(u32, u64)> = None;
    let mut tick: u32 = 0;
    loop {
        // The root is opened anew each time: a restore puts a new one in its place.
        let root = root_of(rt, name)?;
        let exit: Option<i32> = parse_small(&root, &exit_rel);
        let last = exit.is_some() || lost || !follow;
        let gone = |_| SandboxError::Other("the client went away".into());
        let limit = if last { None } else { Some(CHUNKS_PER_TICK) };
        let more_out = out.drain(&root, tx, limit).await.map_err(gone)?;
        let more_err = err.drain(&root, tx, limit).await.map_err(gone)?;
        if let Some(code) = exit {
            let _ = tx.send(ExecFrame::Exit { code, timed_out: false, duration_ms: 0.0 }).await;
            return Ok(());
        }
        if lost {
            return Err(SandboxError::Conflict(format!(
                "background process {id} of sandbox {name} was lost: it left no exit status and its supervisor is gone (the sandbox was stopped, or died, under it)"
            )));
        }
        if !follow {
            return Ok(());
        }
        tick = tick.wrapping_add(1);
        if tick.is_multiple_of(ALIVE_EVERY) {
            // The supervisor's host pid, once found, is checked alone (its start time tells a
            // reused pid); a restore gives it a new one, found again by a walk of the cgroup.
            let still = known
                .is_some_and(|(hp, start)| crate::runtime::process_start_time(hp) == Some(start));
            if !still {
                let (rt2, name2, id2) = (rt.clone(), name.to_string(), id.to_string());
                known = tokio::task::spawn_blocking(move || {
                    let root = root_of(&rt2, &name2)?;
                    let pid = parse_small(&root, &dir_rel(&id2).join("pid"));
                    Ok::<_, SandboxError>(running_supervisor(&supervisors(&rt2, &name2), &id2, pid))
                })
                .await
                .map_err(|e| SandboxError::Other(format!("checking the process: {e}")))??;
            }
            // Not running: one more round reads its exit status or reports it lost.
            lost = known.is_none();
            if lost {
                continue;
            }
        }
        if more_out || more_err {
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = tx.closed() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_signals() {
        assert!(valid_id("0123456789abcdef"));
        assert!(!valid_id("0123456789ABCDEF"));
        assert!(!valid_id("../../etc/passwd"));
        assert!(!valid_id("0123"));
        assert_eq!(parse_signal("term").ok().as_deref(), Some("TERM"));
        assert_eq!(parse_signal("SIGKILL").ok().as_deref(), Some("KILL"));
        assert_eq!(parse_signal("9").ok().as_deref(), Some("KILL"));
        assert!(parse_signal("NOPE").is_err());
        assert!(parse_signal("0; rm -rf /").is_err());
    }

    #[test]
    fn requests_are_checked() {
        let ok = ProcStartRequest { cmd: vec!["sleep".into(), "1".into()], ..Default::default() };
        assert!(validate(&ok).is_ok());
        assert!(validate(&ProcStartRequest::default()).is_err());
        let bad_user = ProcStartRequest { user: Some("a b".into()), ..ok.clone() };
        assert!(validate(&bad_user).is_err());
        let bad_env = ProcStartRequest { env: vec!["1A=x".into()], ..ok.clone() };
        assert!(validate(&bad_env).is_err());
        let bad_cwd = ProcStartRequest { cwd: Some("tmp".into()), ..ok.clone() };
        assert!(validate(&bad_cwd).is_err());
        let bad_tag = ProcStartRequest { tag: Some("a\nb".into()), ..ok };
        assert!(validate(&bad_tag).is_err());
        assert_eq!(as_user(Some("user"), &[], &["id".into()])[0], "setpriv");
        assert_eq!(as_user(None, &[], &["id".into()]), vec!["id".to_string()]);
    }

    /// The supervisor and the helper programs run here with the host's own sh and coreutils:
    /// a start prints the supervisor's pid once the command runs; the output lands in `out`
    /// and `err`, the exit status in `exit`; stdin reaches the command and closing it ends it;
    /// a signal reaches the command and the supervisor records 128+N.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn the_programs_run_detached_and_keep_the_status() {
        use std::process::{Command, Stdio};
        let base = std::env::temp_dir().join(format!("crab-procs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let launch = |d: &Path, stdin: bool, argv: &[&str]| {
            let mut v: Vec<String> = vec![
                "-c".into(),
                format!("SUP='{}'\n{LAUNCH}", SUPERVISOR.replace('\'', r"'\''")),
                "crab-proc".into(),
                d.display().to_string(),
                if stdin { "1" } else { "" }.into(),
                "/".into(),
                String::new(),
            ];
            v.extend(argv.iter().map(|s| s.to_string()));
            // The meta JSON comes on the launcher's stdin.
            let mut c = Command::new("/bin/sh")
                .args(&v)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            {
                use std::io::Write as _;
                c.stdin.take().unwrap().write_all(b"{\"cmd\":[]}").unwrap();
            }
            let o = c.wait_with_output().unwrap();
            assert_eq!(std::fs::read_to_string(d.join("meta.json")).unwrap(), "{\"cmd\":[]}");
            assert_eq!(o.status.code(), Some(0), "{o:?}");
            String::from_utf8(o.stdout).unwrap().trim().parse::<u32>().unwrap()
        };
        let wait_exit = |d: &Path| {
            for _ in 0..600 {
                if let Ok(s) = std::fs::read_to_string(d.join("exit")) {
                    return s.trim().parse::<i32>().unwrap();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            panic!("no exit status in {}", d.display());
        };
        let run = |script: &str, d: &Path, extra: &[&str], input: &[u8]| {
            use std::io::Write;
            let mut args = vec![d.display().to_string()];
            args.extend(extra.iter().map(|s| s.to_string()));
            let argv = sh(script, &args.iter().map(String::as_str).collect::<Vec<_>>());
            let mut c =
                Command::new(&argv[0]).args(&argv[1..]).stdin(Stdio::piped()).spawn().unwrap();
            let _ = c.stdin.take().unwrap().write_all(input);
            c.wait().unwrap().code()
        };
        let d1 = base.join("p1");
        launch(&d1, false, &["sh", "-c", "echo out; echo err >&2; exit 3"]);
        assert_eq!(wait_exit(&d1), 3);
        assert_eq!(std::fs::read_to_string(d1.join("out")).unwrap(), "out\n");
        assert_eq!(std::fs::read_to_string(d1.join("err")).unwrap(), "err\n");
        let d2 = base.join("p2");
        launch(&d2, true, &["sh", "-c", "read l; echo got $l; cat; echo done"]);
        assert_eq!(run(SEND_INPUT, &d2, &[], b"hello\nmore\n"), Some(0));
        assert_eq!(run(CLOSE_INPUT, &d2, &[], b""), Some(0));
        assert_eq!(wait_exit(&d2), 0);
        assert_eq!(std::fs::read_to_string(d2.join("out")).unwrap(), "got hello\nmore\ndone\n");
        assert_eq!(run(SEND_INPUT, &d2, &[], b"late"), Some(44));
        let d3 = base.join("p3");
        launch(&d3, false, &["sleep", "60"]);
        assert_eq!(run(SIGNAL, &d3, &["KILL"], b""), Some(0));
        assert_eq!(wait_exit(&d3), 137);
        let _ = std::fs::remove_dir_all(&base);
    }
}
