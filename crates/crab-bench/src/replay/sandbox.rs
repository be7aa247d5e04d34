//! What the replay does to sandboxes: create and remove them, run commands through the exec
//! API, checkpoint and restore them through the daemon's routes, and inject faults (kill -9 of
//! every process in the sandbox's cgroup, and optionally of the daemon) from the host.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};

use crab_client::{Client, Method};
use crab_common::api::{ExecFrame, ExecRequest, SandboxCreateRequest, SandboxInfo, VersionInfo};
use crab_common::{ApiError, ErrorCode};

/// Output of one command.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    /// stdout, then stderr: each stream in order, never interleaved by arrival (the two
    /// pipes' frames arrive in an order that varies from run to run).
    pub output: Vec<u8>,
    /// stdout alone.
    pub stdout: Vec<u8>,
    /// stderr alone.
    pub stderr: Vec<u8>,
    /// Exit code (124 when the timeout fired).
    pub code: i32,
    /// Whether the timeout fired.
    pub timed_out: bool,
    /// Wall time as measured here, ms.
    pub ms: f64,
}

/// Create a sandbox `name` from `image` (private network).
pub async fn create(client: &Client, image: &str, name: &str) -> Result<SandboxInfo, ApiError> {
    create_with(client, image, name, None, false).await
}

/// Create a sandbox `name` from `image` (private network) with checkpoint policy `policy`
/// (`auto`, `full`, `fs`, `none`; the daemon's default when `None`).
pub async fn create_with_policy(
    client: &Client,
    image: &str,
    name: &str,
    policy: Option<&str>,
) -> Result<SandboxInfo, ApiError> {
    create_with(client, image, name, policy, false).await
}

/// Create a sandbox `name` from `image` (private network), with `policy` and `--privileged`
/// when asked.
pub async fn create_with(
    client: &Client,
    image: &str,
    name: &str,
    policy: Option<&str>,
    privileged: bool,
) -> Result<SandboxInfo, ApiError> {
    let req = SandboxCreateRequest {
        name: Some(name.to_string()),
        privileged,
        checkpoint_policy: policy.map(str::to_string),
        // The persistent session's shell is the instrument's (see `agent`): declared, and a
        // turn that changed its state asks for a dump (`full` through the API, or
        // `POST .../harness/changed` before the request through the proxy).
        harness: crab_common::api::HarnessSpec {
            cmd: vec![super::agent::SESSION_HARNESS.into()],
            paths: Vec::new(),
        },
        ..SandboxCreateRequest::new(image)
    };
    client.call(Method::POST, "/v1/sandboxes", Some(&req)).await
}

/// `POST /v1/sandboxes/{name}/harness/changed`: the session's shell changed its state.
pub async fn harness_changed(client: &Client, name: &str) -> Result<(), ApiError> {
    let _: Value = client
        .call::<(), _>(Method::POST, &format!("/v1/sandboxes/{name}/harness/changed"), None)
        .await?;
    Ok(())
}

/// Remove sandbox `name` (forcefully); a missing sandbox is fine.
pub async fn remove(client: &Client, name: &str) -> Result<(), ApiError> {
    let r: Result<Value, ApiError> = client
        .call::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{name}?force=true"), None)
        .await;
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.code == ErrorCode::SandboxNotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// `GET /v1/sandboxes/{name}`.
pub async fn info(client: &Client, name: &str) -> Result<SandboxInfo, ApiError> {
    client.call::<(), _>(Method::GET, &format!("/v1/sandboxes/{name}"), None).await
}

/// The daemon's version record (its pid and state directory).
pub async fn version(client: &Client) -> Result<VersionInfo, ApiError> {
    let v: VersionInfo = client.call::<(), _>(Method::GET, "/v1/version", None).await?;
    let _ = DAEMON_STATE.set(crab_common::paths::StateDir::new(&v.state_dir));
    Ok(v)
}

/// The request of `cmd` in `workdir` with the replay's environment.
pub fn exec_request(cmd: Vec<String>, workdir: Option<&str>, stdin: Option<&[u8]>) -> ExecRequest {
    ExecRequest {
        cmd,
        env: vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            "HOME=/root".into(),
            "LANG=C.UTF-8".into(),
            "PAGER=cat".into(),
            "GIT_PAGER=cat".into(),
        ],
        workdir: workdir.map(str::to_string),
        user: None,
        timeout_s: None,
        stdin_b64: stdin.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
        stdin_session: None,
    }
}

/// Run `cmd` in sandbox `name`.
pub async fn exec(
    client: &Client,
    name: &str,
    cmd: Vec<String>,
    workdir: Option<&str>,
    stdin: Option<&[u8]>,
    timeout_s: f64,
) -> Result<ExecOutput, ApiError> {
    let mut req = exec_request(cmd, workdir, stdin);
    req.timeout_s = Some(timeout_s);
    let t = Instant::now();
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut exit: Option<(i32, bool)> = None;
    let mut err: Option<ApiError> = None;
    let b64 = base64::engine::general_purpose::STANDARD;
    client
        .stream(&format!("/v1/sandboxes/{name}/exec"), &req, |f: ExecFrame| match f {
            ExecFrame::Stdout { d } => {
                if let Ok(bytes) = b64.decode(d) {
                    stdout.extend_from_slice(&bytes);
                }
            }
            ExecFrame::Stderr { d } => {
                if let Ok(bytes) = b64.decode(d) {
                    stderr.extend_from_slice(&bytes);
                }
            }
            ExecFrame::Exit { code, timed_out, .. } => exit = Some((code, timed_out)),
            ExecFrame::Error { error } => err = Some(error),
        })
        .await?;
    if let Some(e) = err {
        if e.code != ErrorCode::Timeout {
            return Err(e);
        }
        exit = Some((124, true));
    }
    let (code, timed_out) = exit.ok_or_else(|| {
        ApiError::internal(format!("exec in sandbox {name} ended without an exit frame"))
    })?;
    let output = merge(&stdout, &stderr);
    Ok(ExecOutput { output, stdout, stderr, code, timed_out, ms: t.elapsed().as_secs_f64() * 1e3 })
}

/// A command's observation: its stdout, then its stderr's lines in sorted order. The streams
/// are never interleaved by arrival, and within stderr the order of lines is not the command's
/// either: every process of a pipeline writes it at once (`find … | tr …` reporting errors),
/// in whatever order the scheduler runs them, so two fault-free runs disagree on it.
pub fn merge(stdout: &[u8], stderr: &[u8]) -> Vec<u8> {
    let mut output = stdout.to_vec();
    let mut lines: Vec<&[u8]> = stderr.split_inclusive(|&b| b == b'\n').collect();
    lines.sort_unstable();
    for l in lines {
        output.extend_from_slice(l);
        if l.last() != Some(&b'\n') {
            output.push(b'\n');
        }
    }
    output
}

/// `sh -c script` in the sandbox; fails unless it exits 0.
pub async fn sh_ok(
    client: &Client,
    name: &str,
    script: &str,
    timeout_s: f64,
) -> Result<Vec<u8>, ApiError> {
    let out = exec(
        client,
        name,
        vec!["sh".into(), "-c".into(), script.into()],
        Some("/"),
        None,
        timeout_s,
    )
    .await?;
    if out.code != 0 {
        return Err(ApiError::internal(format!(
            "setup command {script:?} in sandbox {name} exited {}: {}",
            out.code,
            String::from_utf8_lossy(&out.output)
        )));
    }
    Ok(out.output)
}

/// A restore point as `POST /v1/sandboxes/{name}/checkpoints` answers it.
#[derive(Debug, Clone, Deserialize)]
pub struct PointSummary {
    /// Checkpoint id (`c7`).
    pub id: String,
    /// `skip`, `fs`, `process` or `full`.
    pub kind: String,
    /// Bytes written for this checkpoint.
    #[serde(default)]
    pub size_bytes: u64,
    /// Time the daemon took, ms.
    #[serde(default)]
    pub took_ms: Option<f64>,
}

/// Take a checkpoint of kind `kind` (`auto`, `fs`, `full`) at turn `turn`, recording the
/// agent's conversation length. The daemon answers the point (bare, or as `{"point": ..}`).
pub async fn checkpoint(
    client: &Client,
    name: &str,
    kind: &str,
    turn: usize,
    conversation_offset: usize,
) -> Result<PointSummary, ApiError> {
    let body = json!({"kind": kind, "turn": turn, "conversation_offset": conversation_offset});
    let v: Value = client
        .call(Method::POST, &format!("/v1/sandboxes/{name}/checkpoints"), Some(&body))
        .await?;
    let point = v.get("point").cloned().unwrap_or(v);
    serde_json::from_value(point.clone())
        .map_err(|e| ApiError::internal(format!("undecodable checkpoint answer {point}: {e}")))
}

/// The restore points of `name`, oldest first (`GET /v1/sandboxes/{name}/checkpoints`).
pub async fn list_checkpoints(client: &Client, name: &str) -> Result<Vec<PointSummary>, ApiError> {
    let v: Value = client
        .call::<(), _>(Method::GET, &format!("/v1/sandboxes/{name}/checkpoints"), None)
        .await?;
    let list = v.get("points").cloned().unwrap_or(v);
    serde_json::from_value(list.clone())
        .map_err(|e| ApiError::internal(format!("undecodable checkpoint list {list}: {e}")))
}

/// Restore the newest checkpoint of `name` in place; returns the daemon's report.
pub async fn restore(client: &Client, name: &str) -> Result<Value, ApiError> {
    client
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{name}/restore"),
            Some(&json!({"checkpoint": null})),
        )
        .await
}

/// Fork sandbox `name` into the branches `names` from point `checkpoint` (its newest when
/// `None`).
pub async fn fork(
    client: &Client,
    name: &str,
    checkpoint: Option<&str>,
    names: &[String],
) -> Result<Value, ApiError> {
    client
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{name}/fork"),
            Some(&json!({"checkpoint": checkpoint, "count": names.len(), "names": names})),
        )
        .await
}

/// Checkpoint traffic of sandbox `name`: the bytes of its distinct parts, read from the
/// manifests of its store on the host (`<pool>/checkpoints/<name>/points/*.manifest`, see
/// `docs/format.md`): each process image's `bytes` plus each filesystem snapshot's
/// `delta_bytes`, counted once however many points share them. (A point's own `size_bytes`
/// counts the parts it references, so summing those would count a reused snapshot again at
/// every skip or process turn.)
pub fn store_traffic(checkpoints_dir: &Path) -> Result<u64, ApiError> {
    let dir = checkpoints_dir.join("points");
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(ApiError::internal(format!("reading {}: {e}", dir.display()))),
    };
    let mut procs = std::collections::BTreeMap::new();
    let mut fs = std::collections::BTreeMap::new();
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "manifest") {
            continue;
        }
        let text = std::fs::read_to_string(&p)
            .map_err(|e| ApiError::internal(format!("reading {}: {e}", p.display())))?;
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() < 3 {
            continue;
        }
        let body = lines[1..lines.len() - 1].join("\n");
        let Ok(m) = serde_json::from_str::<Value>(&body) else { continue };
        if let Some(id) = m["procs"]["id"].as_str() {
            procs.insert(id.to_string(), m["procs"]["bytes"].as_u64().unwrap_or(0));
        }
        if let Some(id) = m["fs"]["id"].as_str() {
            fs.insert(id.to_string(), m["fs"]["delta_bytes"].as_u64().unwrap_or(0));
        }
    }
    Ok(procs.values().sum::<u64>() + fs.values().sum::<u64>())
}

/// The cgroup2 mount point (from `/proc/self/mountinfo`).
pub fn cgroup2_root() -> Result<PathBuf, ApiError> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| ApiError::internal(format!("reading /proc/self/mountinfo: {e}")))?;
    for line in text.lines() {
        let Some((pre, post)) = line.split_once(" - ") else { continue };
        if post.split_whitespace().next() == Some("cgroup2") {
            if let Some(mp) = pre.split_whitespace().nth(4) {
                return Ok(PathBuf::from(mp));
            }
        }
    }
    Err(ApiError::new(
        ErrorCode::HostUnsupported,
        "no cgroup2 hierarchy is mounted",
        "mount cgroup2",
    ))
}

/// The state directory of the daemon the benchmark drives (set by [`version`]).
static DAEMON_STATE: std::sync::OnceLock<crab_common::paths::StateDir> = std::sync::OnceLock::new();

/// The cgroup2 directory of sandbox `name`: `crab-<instance>/<name>` of the daemon that
/// [`version`] answered for (else of `$CRAB_STATE_DIR` or the default state directory).
pub fn cgroup_dir(name: &str) -> Result<PathBuf, ApiError> {
    let state = DAEMON_STATE.get().cloned().unwrap_or_else(|| {
        std::env::var_os("CRAB_STATE_DIR")
            .map(crab_common::paths::StateDir::new)
            .unwrap_or_default()
    });
    Ok(cgroup2_root()?.join(state.cgroup_parent()).join(name))
}

/// Every pid in the cgroup `dir` and its descendants.
pub fn pids_in(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                out.extend(pids_in(&e.path()));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn sigkill(pid: u32) {
    if let Ok(p) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// The fault: kill -9 every process of sandbox `name` (all pids of its cgroup, recursively),
/// repeating until the cgroup is empty. Returns how many processes were killed.
pub async fn kill_all(name: &str) -> Result<usize, ApiError> {
    let dir = cgroup_dir(name)?;
    let start = Instant::now();
    let mut killed = std::collections::BTreeSet::new();
    loop {
        let pids = pids_in(&dir);
        if pids.is_empty() {
            return Ok(killed.len());
        }
        for p in pids {
            sigkill(p);
            killed.insert(p);
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(ApiError::internal(format!(
                "processes of sandbox {name} survive kill -9 for 10 s ({})",
                dir.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The daemon fault: kill -9 the daemon, start it again with the same command line, and wait
/// until it answers.
pub async fn kill_and_restart_daemon(client: &Client) -> Result<(), ApiError> {
    let v = version(client).await?;
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", v.pid))
        .map_err(|e| ApiError::internal(format!("reading the daemon's command line: {e}")))?;
    let argv: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let (exe, args) = argv
        .split_first()
        .ok_or_else(|| ApiError::internal("the daemon has an empty command line"))?;
    let exe =
        std::fs::read_link(format!("/proc/{}/exe", v.pid)).unwrap_or_else(|_| PathBuf::from(exe));
    sigkill(v.pid);
    let gone = Instant::now();
    while Path::new(&format!("/proc/{}", v.pid)).exists()
        && gone.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(Path::new(&v.state_dir).join("logs/daemon.log"))
        .map_err(|e| ApiError::internal(format!("opening the daemon log: {e}")))?;
    let log2 = log.try_clone().map_err(|e| ApiError::internal(e.to_string()))?;
    std::process::Command::new("setsid")
        .arg("-f")
        .arg(&exe)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2)
        .status()
        .map_err(|e| {
            ApiError::internal(format!("restarting the daemon ({}): {e}", exe.display()))
        })?;
    let start = Instant::now();
    loop {
        if version(client).await.is_ok() {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(ApiError::internal(
                "the daemon did not come back within 30 s of the daemon fault",
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_lines_are_merged_in_one_order_whatever_their_arrival() {
        let a = merge(b"out\n", b"tr: bad range\nfind: no dir\n");
        let b = merge(b"out\n", b"find: no dir\ntr: bad range\n");
        assert_eq!(a, b);
        assert_eq!(a, b"out\nfind: no dir\ntr: bad range\n");
        assert_eq!(merge(b"o", b""), b"o");
        assert_eq!(merge(b"", b"e"), b"e\n");
    }

    #[test]
    fn traffic_counts_each_part_once() {
        let dir = tempfile::tempdir().unwrap();
        let points = dir.path().join("points");
        std::fs::create_dir_all(&points).unwrap();
        let m = |id: &str, procs: &str, fs: &str| {
            format!(
                "crab-restore-point 1\n{{\"id\": \"{id}\", \"procs\": {procs}, \"fs\": {fs}}}\nsha256 00\n"
            )
        };
        let p1 = r#"{"id": "p000001", "bytes": 1000}"#;
        let p2 = r#"{"id": "p000002", "bytes": 10}"#;
        let f1 = r#"{"id": "f000001", "delta_bytes": 500}"#;
        std::fs::write(points.join("c000001.manifest"), m("c000001", p1, f1)).unwrap();
        std::fs::write(points.join("c000002.manifest"), m("c000002", p1, f1)).unwrap();
        std::fs::write(points.join("c000003.manifest"), m("c000003", p2, f1)).unwrap();
        std::fs::write(points.join("c000004.manifest"), m("c000004", "null", f1)).unwrap();
        assert_eq!(store_traffic(dir.path()).unwrap(), 1510);
        assert_eq!(store_traffic(&dir.path().join("none")).unwrap(), 0);
    }
}
