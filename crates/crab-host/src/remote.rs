//! The durable tier of a host (`crab daemon --remote URL`): a background exporter that copies
//! every published restore point into the remote repository (`crab-remote`), the per-point
//! export state shown by `crab checkpoints`, and the host's remote actions (`crab remote
//! ls|check|prune|wait`, create/fork `--from-remote`).
//!
//! When it has nothing to export it hashes the host's images into their remote tree ids (once
//! per image), so a point made on an identical image is restored by patching a snapshot of
//! the local image with what differs instead of downloading the whole tree.
//!
//! The exporter runs one export at a time, oldest point first, in the engine's background lane
//! (`Engine::background`): it starts only while no urgent turn work is queued or running and no
//! dump runs, and pauses between files and packs while such work appears. A failed
//! export (remote down, full, locked by a prune) is retried with exponential backoff up to a
//! minute; a point is reported durable only after its record is in the remote, which is written
//! after everything it references. A restarted host asks the remote which points it holds.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crab_checkpoint::ForkBranch;
use crab_common::{ApiError, ErrorCode};
use crab_remote::{RemoteError, Repo, RepoOptions};

use crate::{Host, HostError};

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

/// Export state of one local point, as `crab checkpoints` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum PointState {
    /// Only in the local pool so far.
    Local,
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

/// What [`crate::Action::FromRemote`] asks: sandboxes built from a remote point.
#[derive(Debug, Clone, Deserialize)]
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

/// Answer of [`crate::Action::FromRemote`].
#[derive(Debug, Clone, Serialize)]
pub struct FromRemoteReport {
    /// `SB@POINT` restored from.
    pub source: String,
    /// False when every part was already local.
    pub downloaded: bool,
    /// The local image the filesystem was patched from (only what differs from it was
    /// downloaded); none when the whole tree was downloaded.
    pub base_image: Option<String>,
    /// Time to fetch and materialize the point, ms.
    pub fetch_ms: f64,
    /// Total time, ms.
    pub total_ms: f64,
    /// Files and conversation only.
    pub fs_only: bool,
    /// Where the time went: (stage, ms) in order — `load_point`, `preflight`, the
    /// materialization's own stages (`materialize_index`, `…_manifest`, `…_fs_and_procs`
    /// followed by `…_fs` and `…_procs`, which ran side by side within it, `…_verify`,
    /// `…_conversation`), `fork` and `attach`.
    pub stages: Vec<(String, f64)>,
    /// The new sandboxes.
    pub branches: Vec<ForkBranch>,
}

/// Answer of [`crate::Action::RemoteWait`].
#[derive(Debug, Clone, Serialize)]
pub struct Durable {
    /// Sandbox.
    pub sandbox: String,
    /// Point id.
    pub point: String,
    /// Bytes its export uploaded.
    pub uploaded_bytes: u64,
}

/// (sandbox, point).
type PointKey = (String, String);

/// The host's remote tier.
#[derive(Debug)]
pub struct RemoteTier {
    /// The repository.
    pub repo: Arc<Repo>,
    states: Mutex<HashMap<PointKey, (PointState, Option<Instant>)>>,
    wake: tokio::sync::Notify,
    changed: tokio::sync::watch::Sender<u64>,
}

/// How often an idle exporter loads the index objects other hosts wrote (one LIST, then only
/// the new objects).
const INDEX_REFRESH: Duration = Duration::from_secs(30);

/// The engine's background lane as the pause of an export.
#[derive(Debug)]
struct LanePause(crab_engine::BackgroundPermit);

impl crab_remote::Pause for LanePause {
    fn pause(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if self.0.yield_to_urgent().await {
                tracing::debug!("export resumed after urgent work");
            }
        })
    }
}

/// Hash every local image whose tree id is not known yet (see
/// [`crab_remote::local::local_image_tree`]).
async fn hash_images(repo: &Repo, state: &crab_common::paths::StateDir) {
    let Ok(rd) = std::fs::read_dir(state.images()) else { return };
    for de in rd.flatten() {
        let name = de.file_name().to_string_lossy().into_owned();
        let Some(image) = name.strip_suffix(".json") else { continue };
        if let Err(e) = crab_remote::local::local_image_tree(repo, state, image).await {
            tracing::warn!(image, error = %e, "cannot hash a local image");
        }
    }
}

/// The API error of a remote failure: its code and the fix.
pub fn remote_error(e: RemoteError) -> HostError {
    let msg = e.to_string();
    HostError(match e {
        RemoteError::Corrupt { .. } | RemoteError::Missing { .. } => ApiError::new(
            ErrorCode::CorruptCheckpoint,
            msg,
            "run `crab remote check` to list every damaged object",
        ),
        RemoteError::Untrusted { .. } => ApiError::new(
            ErrorCode::CorruptCheckpoint,
            msg,
            "nothing was restored and no local point was made: the point's process images were \
             altered after the dump, or it was taken by a --privileged sandbox or a daemon with \
             another seccomp filter; restore its files only with --fs-only",
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
    })
}

use crab_common::sync::lock;

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

    /// The export state of `sandbox`'s `point`.
    pub fn state(&self, sandbox: &str, point: &str) -> PointState {
        lock(&self.states)
            .get(&(sandbox.to_string(), point.to_string()))
            .map(|s| s.0.clone())
            .unwrap_or(PointState::Local)
    }

    fn set(&self, sandbox: &str, point: &str, st: PointState, retry_at: Option<Instant>) {
        lock(&self.states).insert((sandbox.to_string(), point.to_string()), (st, retry_at));
        self.changed.send_modify(|n| *n += 1);
    }

    /// The next point to export: the oldest local point of any sandbox not durable, not being
    /// exported and not waiting for a retry.
    fn next(&self, h: &Host) -> Option<(Arc<crab_checkpoint::Store>, crab_checkpoint::Manifest)> {
        let now = Instant::now();
        let states = lock(&self.states).clone();
        let mut best: Option<(Arc<crab_checkpoint::Store>, crab_checkpoint::Manifest)> = None;
        for name in h.runtime().names() {
            let Ok(store) = h.checkpointer().store(&name) else { continue };
            let Ok(points) = store.list() else { continue };
            for m in points {
                let pending = match states.get(&(name.clone(), m.id.to_string())) {
                    None | Some((PointState::Local, _)) => true,
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

    /// The exporter: runs until the host goes away.
    pub async fn run(self: Arc<Self>, host: Weak<Host>) {
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
        // Keep the repository's index loaded while idle (new index objects only), so a restore
        // from the remote on this host does not start by reading every index object there is.
        let mut index_loaded: Option<Instant> = None;
        loop {
            let Some(h) = host.upgrade() else { return };
            let engine = h.engine().clone();
            drop(h);
            // Exports are the engine's background work: granted once no urgent job is queued
            // or running and no dump runs, paused between steps while one is.
            let permit = engine.background("export").await;
            let Some(h) = host.upgrade() else { return };
            let this = self.clone();
            let h2 = h.clone();
            let next = tokio::task::spawn_blocking(move || this.next(&h2)).await.ok().flatten();
            let Some((store, m)) = next else {
                // Idle: learn the tree ids of this host's images (once per image), so a
                // restore from the remote patches a local image instead of downloading it.
                let (repo, state) = (self.repo.clone(), h.state().clone());
                drop(h);
                let refresh = index_loaded.is_none_or(|t| t.elapsed() >= INDEX_REFRESH);
                let handle = tokio::runtime::Handle::current();
                let refreshed = tokio::task::spawn_blocking(move || {
                    handle.block_on(async {
                        let res = match refresh {
                            true => repo.refresh_index().await.map(|()| true),
                            false => Ok(false),
                        };
                        hash_images(&repo, &state).await;
                        res
                    })
                })
                .await;
                match refreshed {
                    Ok(Ok(true)) => index_loaded = Some(Instant::now()),
                    Ok(Ok(false)) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "cannot refresh the remote's index"),
                    Err(e) => tracing::warn!(error = %e, "the idle exporter's task died"),
                }
                drop(permit);
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                }
                continue;
            };
            let (sb, point) = (store.sandbox().to_string(), m.id.to_string());
            let attempts = match self.state(&sb, &point) {
                PointState::Failed { attempts, .. } => attempts,
                _ => 0,
            };
            self.set(&sb, &point, PointState::Exporting, None);
            let src = crab_remote::local::export_source(h.state(), &store, &m);
            drop(h);
            let repo = self.repo.clone();
            let handle = tokio::runtime::Handle::current();
            let res = match src {
                Ok(src) => tokio::task::spawn_blocking(move || {
                    let pause = LanePause(permit);
                    handle.block_on(repo.export_point_with(&src, Some(&pause)))
                })
                .await
                .unwrap_or_else(|e| Err(RemoteError::Key(format!("export task died: {e}")))),
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
    ) -> Result<Durable, HostError> {
        let mut rx = self.changed.subscribe();
        self.kick();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.state(sandbox, point) {
                PointState::Durable { uploaded_bytes } => {
                    return Ok(Durable {
                        sandbox: sandbox.to_string(),
                        point: point.to_string(),
                        uploaded_bytes,
                    })
                }
                PointState::Failed { error, attempts } if attempts >= 3 => {
                    return Err(HostError(ApiError::new(
                        ErrorCode::Upstream,
                        format!(
                            "{sandbox}@{point} is not durable after {attempts} attempts: {error}"
                        ),
                        "the point stays local and its export is retried; check the remote",
                    )))
                }
                _ => {}
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return Err(HostError(ApiError::new(
                    ErrorCode::Timeout,
                    format!("{sandbox}@{point} is not durable after {} s", timeout.as_secs()),
                    "its export goes on in the background",
                )));
            }
        }
    }
}
