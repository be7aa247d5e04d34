//! The durable tier in the daemon (`crab daemon --remote URL`): a background exporter that
//! copies every published restore point into the remote repository (`crab-remote`), the
//! per-point export state shown by `crab checkpoints`, and the routes behind `crab remote
//! ls|check|prune|wait` and `--from-remote` create/fork.
//!
//! The exporter runs one export at a time, oldest point first, and yields while the engine has
//! urgent turn work queued or a dump running (exports are normal-priority work). A failed
//! export (remote down, full, locked by a prune) is retried with exponential backoff up to a
//! minute; a point is reported durable only after its record is in the remote, which is written
//! after everything it references. A restarted daemon asks the remote which points it holds.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::Response;
use serde::{Deserialize, Serialize};

use crab_common::{ApiError, ErrorCode};
use crab_remote::{RemoteError, Repo, RepoOptions};

use super::api::{blocking, err, ok, parse};
use super::Daemon;

/// `--remote` and its companions.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// `file:///dir` or `s3://bucket/prefix`.
    pub url: String,
    /// Key file for encryption at rest.
    pub key_file: Option<PathBuf>,
    /// Upload budget, bytes per second.
    pub bandwidth_bps: Option<u64>,
}

/// Export state of one local point.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum PointState {
    /// Being uploaded now.
    Exporting,
    /// In the remote.
    Durable {
        /// Bytes its export uploaded.
        uploaded_bytes: u64,
    },
    /// The last attempt failed; retried later.
    Failed {
        /// Why.
        error: String,
        /// Attempts so far.
        attempts: u32,
    },
}

/// (sandbox, point).
type PointKey = (String, String);

/// The daemon's remote tier.
#[derive(Debug)]
pub struct RemoteTier {
    /// The repository.
    pub repo: Arc<Repo>,
    states: Mutex<HashMap<PointKey, (PointState, Option<Instant>)>>,
    wake: tokio::sync::Notify,
    changed: tokio::sync::watch::Sender<u64>,
}

pub fn api_error(e: RemoteError) -> ApiError {
    let msg = e.to_string();
    match e {
        RemoteError::Corrupt { .. } | RemoteError::Missing { .. } => ApiError::new(
            ErrorCode::CorruptCheckpoint,
            msg,
            "run `crab remote check` to list every damaged object",
        ),
        RemoteError::NoPoint { .. } => {
            ApiError::new(ErrorCode::CheckpointNotFound, msg, "crab remote ls")
        }
        RemoteError::Locked { .. } => ApiError::new(ErrorCode::Conflict, msg, "retry later"),
        RemoteError::Preflight { .. } => {
            ApiError::new(ErrorCode::HostUnsupported, msg, "add --fs-only")
        }
        RemoteError::BadUrl { .. } | RemoteError::Key(_) => {
            ApiError::invalid(msg, "check --remote / --remote-key")
        }
        _ => ApiError::new(
            ErrorCode::Upstream,
            msg,
            "is the remote reachable? the daemon retries exports by itself",
        ),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RemoteTier {
    /// Open the repository (creating it when new).
    pub async fn open(
        state: &crab_common::paths::StateDir,
        o: &RemoteOptions,
    ) -> Result<RemoteTier, RemoteError> {
        let repo = Repo::open(
            &o.url,
            RepoOptions {
                key_file: o.key_file.clone(),
                cache_dir: state.root().join("remote-cache"),
                bandwidth_bps: o.bandwidth_bps,
            },
        )
        .await?;
        Ok(RemoteTier {
            repo: Arc::new(repo),
            states: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
            changed: tokio::sync::watch::channel(0).0,
        })
    }

    /// A new point may be waiting.
    pub fn kick(&self) {
        self.wake.notify_one();
    }

    /// The export state of `sandbox`'s `point` (`None`: local only so far).
    pub fn state(&self, sandbox: &str, point: &str) -> Option<PointState> {
        lock(&self.states).get(&(sandbox.to_string(), point.to_string())).map(|s| s.0.clone())
    }

    fn set(&self, sandbox: &str, point: &str, st: PointState, retry_at: Option<Instant>) {
        lock(&self.states).insert((sandbox.to_string(), point.to_string()), (st, retry_at));
        self.changed.send_modify(|n| *n += 1);
    }

    /// The next point to export: the oldest local point of any sandbox not durable, not being
    /// exported and not waiting for a retry.
    fn next(&self, d: &Daemon) -> Option<(Arc<crab_checkpoint::Store>, crab_checkpoint::Manifest)> {
        let now = Instant::now();
        let states = lock(&self.states).clone();
        let mut best: Option<(Arc<crab_checkpoint::Store>, crab_checkpoint::Manifest)> = None;
        for name in d.runtime.names() {
            let Ok(store) = d.checkpointer.store(&name) else { continue };
            let Ok(points) = store.list() else { continue };
            for m in points {
                let pending = match states.get(&(name.clone(), m.id.to_string())) {
                    None => true,
                    Some((PointState::Failed { .. }, at)) => at.is_none_or(|t| t <= now),
                    Some(_) => false,
                };
                if pending && best.as_ref().is_none_or(|(_, b)| m.created_at_ms < b.created_at_ms) {
                    best = Some((store.clone(), m));
                }
            }
        }
        best
    }

    /// The exporter: runs until the daemon goes away.
    pub async fn run(self: Arc<Self>, d: Weak<Daemon>) {
        match self.repo.list_points(None).await {
            Ok(recs) => {
                for r in recs {
                    self.set(
                        &r.sandbox,
                        &r.point,
                        PointState::Durable { uploaded_bytes: r.uploaded_bytes },
                        None,
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the remote's points; exporting everything")
            }
        }
        loop {
            let Some(daemon) = d.upgrade() else { return };
            let stats = daemon.engine().stats();
            if stats.queued_urgent > 0 || stats.running_dumps > 0 {
                drop(daemon);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            let this = self.clone();
            let d2 = daemon.clone();
            let next = tokio::task::spawn_blocking(move || this.next(&d2)).await.ok().flatten();
            let Some((store, m)) = next else {
                drop(daemon);
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                }
                continue;
            };
            let (sb, point) = (store.sandbox().to_string(), m.id.to_string());
            let attempts = match self.state(&sb, &point) {
                Some(PointState::Failed { attempts, .. }) => attempts,
                _ => 0,
            };
            self.set(&sb, &point, PointState::Exporting, None);
            let src = crab_remote::local::export_source(daemon.runtime.state(), &store, &m);
            drop(daemon);
            let repo = self.repo.clone();
            let handle = tokio::runtime::Handle::current();
            let res = match src {
                Ok(src) => {
                    tokio::task::spawn_blocking(move || handle.block_on(repo.export_point(&src)))
                        .await
                        .unwrap_or_else(|e| Err(RemoteError::Key(format!("export task died: {e}"))))
                }
                Err(e) => Err(e),
            };
            match res {
                Ok(rep) => self.set(
                    &sb,
                    &point,
                    PointState::Durable { uploaded_bytes: rep.uploaded_bytes },
                    None,
                ),
                Err(e) => {
                    let attempts = attempts + 1;
                    let backoff = Duration::from_secs((1u64 << attempts.min(6)).min(60));
                    tracing::warn!(sandbox = sb, point, attempts, retry_in_s = backoff.as_secs(), error = %e, "export failed");
                    self.set(
                        &sb,
                        &point,
                        PointState::Failed { error: e.to_string(), attempts },
                        Some(Instant::now() + backoff),
                    );
                }
            }
        }
    }

    /// Wait until `sandbox`'s `point` is durable (or `timeout`).
    pub async fn wait_durable(
        &self,
        sandbox: &str,
        point: &str,
        timeout: Duration,
    ) -> Result<u64, ApiError> {
        let mut rx = self.changed.subscribe();
        self.kick();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.state(sandbox, point) {
                Some(PointState::Durable { uploaded_bytes }) => return Ok(uploaded_bytes),
                Some(PointState::Failed { error, attempts }) if attempts >= 3 => {
                    return Err(ApiError::new(
                        ErrorCode::Upstream,
                        format!(
                            "{sandbox}@{point} is not durable after {attempts} attempts: {error}"
                        ),
                        "the point stays local and its export is retried; check the remote",
                    ))
                }
                _ => {}
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(ApiError::new(
                    ErrorCode::Timeout,
                    format!("{sandbox}@{point} is not durable after {} s", timeout.as_secs()),
                    "its export goes on in the background",
                ));
            }
        }
    }
}

fn tier(d: &Daemon) -> Result<&Arc<RemoteTier>, ApiError> {
    d.remote.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "this daemon has no remote store",
            "start it with `crab daemon --remote URL`",
        )
    })
}

/// `GET /v1/remote/points?sandbox=SB`.
pub async fn ls(
    State(d): State<Arc<Daemon>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let t = match tier(&d) {
        Ok(t) => t,
        Err(e) => return err(e),
    };
    match t.repo.list_points(q.get("sandbox").map(String::as_str)).await {
        Ok(v) => ok(&v),
        Err(e) => err(api_error(e)),
    }
}

/// `POST /v1/remote/check`.
pub async fn check(State(d): State<Arc<Daemon>>) -> Response {
    let t = match tier(&d) {
        Ok(t) => t.clone(),
        Err(e) => return err(e),
    };
    let handle = tokio::runtime::Handle::current();
    match tokio::task::spawn_blocking(move || handle.block_on(t.repo.check())).await {
        Ok(Ok(v)) => ok(&v),
        Ok(Err(e)) => err(api_error(e)),
        Err(e) => err(ApiError::internal(e.to_string())),
    }
}

/// Body of `POST /v1/remote/prune`.
#[derive(Debug, Deserialize)]
pub struct PruneBody {
    keep_last: usize,
}

/// `POST /v1/remote/prune {"keep_last": N}`.
pub async fn prune(State(d): State<Arc<Daemon>>, body: Bytes) -> Response {
    let req: PruneBody = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let t = match tier(&d) {
        Ok(t) => t,
        Err(e) => return err(e),
    };
    match t.repo.prune(req.keep_last).await {
        Ok(v) => ok(&v),
        Err(e) => err(api_error(e)),
    }
}

/// Query of `GET /v1/remote/wait`.
#[derive(Debug, Deserialize)]
pub struct WaitQuery {
    sandbox: String,
    point: String,
    #[serde(default)]
    timeout_s: Option<u64>,
}

/// `GET /v1/remote/wait?sandbox=SB&point=P[&timeout_s=S]`: answers once the point is durable.
pub async fn wait(State(d): State<Arc<Daemon>>, Query(q): Query<WaitQuery>) -> Response {
    let t = match tier(&d) {
        Ok(t) => t,
        Err(e) => return err(e),
    };
    let timeout = Duration::from_secs(q.timeout_s.unwrap_or(600));
    match t.wait_durable(&q.sandbox, &q.point, timeout).await {
        Ok(uploaded_bytes) => ok(
            &serde_json::json!({"sandbox": q.sandbox, "point": q.point, "uploaded_bytes": uploaded_bytes}),
        ),
        Err(e) => err(e),
    }
}

/// Body of `POST /v1/remote/restore`.
#[derive(Debug, Deserialize)]
pub struct FromRemote {
    /// `SB` or `SB@POINT`.
    pub source: String,
    /// Branch names (one per branch).
    #[serde(default)]
    pub names: Option<Vec<String>>,
    /// Number of sandboxes.
    #[serde(default = "one")]
    pub count: usize,
    /// Restore files and conversation only.
    #[serde(default)]
    pub fs_only: bool,
}

fn one() -> usize {
    1
}

/// `POST /v1/remote/restore`: build sandboxes from a remote point (create = one branch).
pub async fn restore(State(d): State<Arc<Daemon>>, body: Bytes) -> Response {
    let req: FromRemote = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    match restore_inner(&d, req).await {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

async fn restore_inner(d: &Arc<Daemon>, req: FromRemote) -> Result<serde_json::Value, ApiError> {
    let t = tier(d)?.clone();
    let (sb, point) = match req.source.split_once('@') {
        Some((s, p)) => (s.to_string(), Some(p.to_string())),
        None => (req.source.clone(), None),
    };
    crab_common::names::validate("sandbox", &sb)?;
    let t0 = Instant::now();
    let rec = t.repo.load_point(&sb, point.as_deref()).await.map_err(api_error)?;
    if !req.fs_only {
        let criu =
            crab_criu::Criu::locate().ok().and_then(|c| c.version().ok()).map(|v| v.to_string());
        crab_remote::preflight(&rec, &crab_remote::HostFacts::local(), criu.as_deref())
            .map_err(api_error)?;
    }
    let store = d.checkpointer.store(&sb).map_err(|e| e.to_api())?;
    let (repo, rec2, fs_only) = (t.repo.clone(), rec.clone(), req.fs_only);
    let handle = tokio::runtime::Handle::current();
    let mat = tokio::task::spawn_blocking(move || {
        handle.block_on(crab_remote::local::materialize(&repo, &store, &rec2, fs_only))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
    .map_err(api_error)?;
    let fetch_ms = t0.elapsed().as_secs_f64() * 1e3;
    let d2 = d.clone();
    let (sb2, pid, count, names) = (sb.clone(), rec.point.clone(), req.count, req.names.clone());
    let branches = blocking(move || {
        let b = d2.checkpointer.fork(&sb2, Some(&pid), count, names).map_err(|e| e.to_api())?;
        for x in &b {
            d2.attach(&x.sandbox);
        }
        Ok(b)
    })
    .await?;
    for b in &branches {
        if let (Some(log), Some(off)) = (&mat.conversation, mat.manifest.conversation_offset) {
            let path = d.runtime.state().sandbox_dir(&b.sandbox).join("conversation.log");
            match std::fs::write(&path, log) {
                Ok(()) => {
                    if let Err(e) = d.coordinator.restored(&b.sandbox, off, true).await {
                        tracing::warn!(sandbox = %b.sandbox, error = %e, "could not rewind the conversation log");
                    }
                }
                Err(e) => {
                    tracing::warn!(sandbox = %b.sandbox, error = %e, "could not write the conversation log")
                }
            }
        }
        d.open_sandbox_proxy(&b.sandbox).await;
    }
    Ok(serde_json::json!({
        "source": format!("{}@{}", rec.sandbox, rec.point),
        "downloaded": mat.fetched,
        "fetch_ms": fetch_ms,
        "total_ms": t0.elapsed().as_secs_f64() * 1e3,
        "fs_only": req.fs_only,
        "branches": branches,
    }))
}
