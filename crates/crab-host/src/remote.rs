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
use crab_common::api::{HarnessSpec, Limits, NetMode, SecurityProfile};
use crab_common::{ApiError, CheckpointPolicy, ErrorCode};
use crab_remote::{Refusal, RemoteError, Repo, RepoOptions};
use crab_sandbox::runtime::SandboxRecord;

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
    /// Sandboxes whose newest points this host keeps materialized (`--follow`), added to
    /// the saved follow set.
    pub follow: Vec<String>,
    /// Follow every sandbox of the remote that does not run here (`--follow-all`).
    pub follow_all: bool,
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
    /// The new sandboxes' network mode (the caller's `--network`); this host's default,
    /// `private`, when absent. Never the point's own.
    #[serde(default)]
    pub net: Option<NetMode>,
    /// The new sandboxes' limits (the caller's `--memory`, `--pids`, `--cpus`, `--disk`);
    /// a disk limit absent here is the daemon's `--default-disk`. Never the point's own.
    #[serde(default)]
    pub limits: Option<Limits>,
}

fn one() -> usize {
    1
}

/// What this host grants a sandbox built from a remote point: the caller's flags, else the
/// host's defaults. A remote point decides none of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Network mode.
    pub net: NetMode,
    /// Limits (disk, memory, pids, cpu).
    pub limits: Limits,
    /// This host's user-namespace range (`crab daemon --userns-base`): the only one a point
    /// may run in besides the host's own.
    pub userns: Option<crab_common::api::IdRange>,
}

/// How much a network mode opens: `none` < `private` < `nat` < `host`.
fn net_rank(n: NetMode) -> u8 {
    match n {
        NetMode::None => 0,
        NetMode::Private => 1,
        NetMode::Nat => 2,
        NetMode::Host => 3,
    }
}

fn net_name(n: NetMode) -> &'static str {
    match n {
        NetMode::None => "none",
        NetMode::Private => "private",
        NetMode::Nat => "nat",
        NetMode::Host => "host",
    }
}

fn refusal(field: &str, reason: String, fix: impl Into<String>) -> Refusal {
    Refusal { field: field.to_string(), reason, fix: fix.into() }
}

/// Judge the `sandbox_meta` of a remote point's manifest (untrusted: anyone who can write the
/// store can forge it) against what this host grants, and return the record template the new
/// sandboxes are built from. The point may not ask for a privileged profile, a network mode
/// opening more than `grant.net`, or a limit looser than one `grant.limits` sets: each is
/// refused naming the field. What the new sandboxes get is `grant` and the default profile,
/// whatever the point says; from the point only its image name (checked as a name), its
/// checkpoint policy and its harness declaration (checked as at create) are kept.
pub fn admit_meta(meta: &serde_json::Value, grant: &Grant) -> Result<SandboxRecord, Refusal> {
    use serde_json::Value;
    let obj = meta.as_object().ok_or_else(|| {
        refusal(
            "sandbox_meta",
            "its sandbox_meta is not a JSON object".into(),
            "export the point again from its host",
        )
    })?;
    let get = |path: &[&str]| path.iter().try_fold(meta, |v, k| v.get(k)).filter(|v| !v.is_null());
    // Profile: only the default one.
    match get(&["profile", "privileged"]) {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            return Err(refusal(
                "sandbox_meta.profile.privileged",
                "the point asks for a privileged profile (sandbox_meta.profile.privileged); \
                 this host restores remote points with the default profile only"
                    .into(),
                "restore a point of a sandbox created without --privileged",
            ))
        }
        Some(v) => {
            return Err(refusal(
                "sandbox_meta.profile.privileged",
                format!("sandbox_meta.profile.privileged is {v}, not a boolean"),
                "export the point again from its host",
            ))
        }
    }
    // User namespace: none (a point of a `--userns host` sandbox, or of one from before user
    // namespaces: today's default profile) or exactly this host's range, whose ids the point's
    // files and process images carry (checked again in the images, `foreign::check`).
    let userns = match get(&["profile", "userns"]) {
        None => None,
        Some(v) => {
            let asked: crab_common::api::IdRange =
                serde_json::from_value(v.clone()).map_err(|_| {
                    refusal(
                        "sandbox_meta.profile.userns",
                        format!("sandbox_meta.profile.userns is {v}, not an id range"),
                        "export the point again from its host",
                    )
                })?;
            if Some(asked) != grant.userns {
                return Err(refusal(
                    "sandbox_meta.profile.userns",
                    format!(
                        "the point's files and processes belong to the user-namespace range {asked} (sandbox_meta.profile.userns); this host runs sandboxes in {}",
                        grant.userns.map_or("the host's user namespace".to_string(), |r| r.to_string())
                    ),
                    format!("restore it on a host whose daemon runs with --userns-base {}", asked.uid),
                ));
            }
            Some(asked)
        }
    };
    if let Some(p) = obj.get("profile").and_then(Value::as_object) {
        if let Some(k) = p.keys().find(|k| !matches!(k.as_str(), "privileged" | "userns")) {
            return Err(refusal(
                "sandbox_meta.profile",
                format!(
                    "the point asks for a profile setting {k:?} (sandbox_meta.profile.{k}) this \
                     host does not know; it restores remote points with the default profile only"
                ),
                "restore it on a host whose crab knows that setting",
            ));
        }
    }
    // Network: at most what is granted.
    if let Some(v) = get(&["net"]) {
        let asked: NetMode = v.as_str().and_then(|s| s.parse().ok()).ok_or_else(|| {
            refusal(
                "sandbox_meta.net",
                format!("sandbox_meta.net is {v}, not a network mode"),
                "export the point again from its host",
            )
        })?;
        if net_rank(asked) > net_rank(grant.net) {
            return Err(refusal(
                "sandbox_meta.net",
                format!(
                    "the point asks for network {} (sandbox_meta.net); this host restores it with \
                     network {} (the caller's --network, else the host's default)",
                    net_name(asked),
                    net_name(grant.net)
                ),
                format!("pass --network {} to grant it that network", net_name(asked)),
            ));
        }
    }
    // Limits: none looser than a granted one.
    let limits: [(&str, &str, Option<u64>); 4] = [
        ("memory_bytes", "--memory", grant.limits.memory_bytes),
        ("pids_max", "--pids", grant.limits.pids_max),
        ("cpu_millis", "--cpus", grant.limits.cpu_millis),
        ("disk_bytes", "--disk", grant.limits.disk_bytes),
    ];
    for (key, flag, granted) in limits {
        let Some(v) = get(&["limits", key]) else { continue };
        let field = format!("sandbox_meta.limits.{key}");
        let asked = v.as_u64().ok_or_else(|| {
            refusal(&field, format!("{field} is {v}, not a number"), "export the point again")
        })?;
        if let Some(g) = granted.filter(|g| asked > *g) {
            return Err(refusal(
                &field,
                format!(
                    "the point asks for {key} {asked} ({field}); this host restores it with \
                     {g} (the caller's {flag}, else the host's default)"
                ),
                format!("pass {flag} with a value of at least the point's to grant it"),
            ));
        }
    }
    // Names: the image's must be a name; the sandboxes' are the caller's or generated here.
    let image = match get(&["image"]) {
        None => String::new(),
        Some(v) => {
            let name = v.as_str().filter(|n| crab_common::names::validate("image", n).is_ok());
            name.ok_or_else(|| {
                refusal(
                    "sandbox_meta.image",
                    format!("sandbox_meta.image {v} is not an image name"),
                    "export the point again from its host",
                )
            })?
            .to_string()
        }
    };
    let checkpoint_policy: CheckpointPolicy = match get(&["checkpoint_policy"]) {
        None => CheckpointPolicy::default(),
        Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
            refusal(
                "sandbox_meta.checkpoint_policy",
                format!("sandbox_meta.checkpoint_policy {v} is not auto, full, fs or none"),
                "export the point again from its host",
            )
        })?,
    };
    let harness: HarnessSpec = match get(&["harness"]) {
        None => HarnessSpec::default(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| e.to_string())
            .and_then(|h| {
                crab_inspector::harness::Harness::compile(&h).map(|_| h).map_err(|e| e.to_string())
            })
            .map_err(|e| {
                refusal(
                    "sandbox_meta.harness",
                    format!("sandbox_meta.harness is not a valid harness declaration: {e}"),
                    "export the point again from its host",
                )
            })?,
    };
    Ok(SandboxRecord {
        format: crab_sandbox::runtime::RECORD_FORMAT,
        name: String::new(),
        image,
        created_at: 0,
        init_pid: 0,
        init_start: 0,
        net: grant.net,
        hostname: String::new(),
        limits: grant.limits.clone(),
        profile: SecurityProfile { privileged: false, userns },
        cgroup: None,
        nat: None,
        held: None,
        checkpoint_policy,
        harness,
        life: crab_common::life::Life::Running,
        deadline_ms: None,
        on_deadline: Default::default(),
        labels: Default::default(),
        env: Default::default(),
        template: None,
        point_labels: Default::default(),
        // Filled from this host's image of that name by the caller (a point's metadata is not
        // trusted to say which account its commands run as).
        image_config: Default::default(),
    })
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
    /// materialization's own stages (`materialize_index`, `…_manifest`, `…_room`, `…_fs_and_procs`
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

/// A point's identity: its sandbox, its id and when it was taken. The id alone is not one: a
/// sandbox made again under a removed one's name numbers its points from `c000001` again.
type PointKey = (String, String, u64);

/// The host's remote tier.
#[derive(Debug)]
pub struct RemoteTier {
    /// The repository.
    pub repo: Arc<Repo>,
    /// The standby follower (`crab remote follow`).
    pub follower: Arc<crate::follow::Follower>,
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
        // The user-namespace copies first: on a host whose sandboxes run in user namespaces
        // (the default), their points are made of those.
        let copies = crab_sandbox::shift::current_copies(state, image).into_iter();
        for userns in copies.map(|(r, _)| Some(r)).chain(std::iter::once(None)) {
            if let Err(e) =
                crab_remote::local::local_image_tree_for(repo, state, image, userns).await
            {
                tracing::warn!(image, error = %e, "cannot hash a local image");
            }
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
        RemoteError::PointTaken { .. } => ApiError::new(
            ErrorCode::Conflict,
            msg,
            "the point stays local: give sandboxes names that no other sandbox on the remote \
             had (`crab remote ls` lists them)",
        ),
        RemoteError::Preflight { .. } => {
            ApiError::new(ErrorCode::HostUnsupported, msg, "add --fs-only")
        }
        RemoteError::Refused { refusal, .. } => {
            ApiError::new(ErrorCode::InvalidRequest, msg, refusal.fix)
        }
        RemoteError::PoolFull { .. } => ApiError::new(
            ErrorCode::PoolFull,
            msg,
            "free room in the pool (remove sandboxes or restore points) or restart the daemon \
             with a larger --pool-size",
        ),
        RemoteError::Io { ref source, .. } if source.kind() == std::io::ErrorKind::StorageFull => {
            ApiError::new(
                ErrorCode::PoolFull,
                msg,
                "free room in the pool (remove sandboxes or restore points) or restart the \
                 daemon with a larger --pool-size",
            )
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
    ) -> Result<RemoteTier, HostError> {
        let follower = Arc::new(crate::follow::Follower::open(state, &o.follow, o.follow_all)?);
        let repo = Repo::open(
            &o.url,
            RepoOptions {
                key_file: o.key_file.clone(),
                cache_dir: state.root().join("remote-cache"),
                bandwidth_bps: o.bandwidth_bps,
            },
        )
        .await
        .map_err(|e| {
            let mut h = remote_error(e);
            h.0.message = format!("opening the remote store {}: {}", o.url, h.0.message);
            h
        })?;
        Ok(RemoteTier {
            repo: Arc::new(repo),
            follower,
            states: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
            changed: tokio::sync::watch::channel(0).0,
        })
    }

    /// A new point may be waiting.
    pub fn kick(&self) {
        self.wake.notify_one();
    }

    /// The export state of `sandbox`'s `point` taken at `created_at_ms` — with `None` (no
    /// local point of that name), of whichever point of that name the remote holds.
    pub fn state(&self, sandbox: &str, point: &str, created_at_ms: Option<u64>) -> PointState {
        let states = lock(&self.states);
        match created_at_ms {
            Some(c) => states.get(&(sandbox.to_string(), point.to_string(), c)),
            None => states.iter().find(|((s, p, _), _)| s == sandbox && p == point).map(|(_, v)| v),
        }
        .map(|s| s.0.clone())
        .unwrap_or(PointState::Local)
    }

    fn set(&self, key: PointKey, st: PointState, retry_at: Option<Instant>) {
        lock(&self.states).insert(key, (st, retry_at));
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
                let pending = match states.get(&(name.clone(), m.id.to_string(), m.created_at_ms)) {
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
                        (r.sandbox, r.point, r.created_at_ms),
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
            let key: PointKey = (sb.clone(), point.clone(), m.created_at_ms);
            let attempts = match self.state(&sb, &point, Some(m.created_at_ms)) {
                PointState::Failed { attempts, .. } => attempts,
                _ => 0,
            };
            self.set(key.clone(), PointState::Exporting, None);
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
                Ok(rep) => {
                    tracing::info!(
                        sandbox = sb,
                        point,
                        uploaded_bytes = rep.uploaded_bytes,
                        read_bytes = rep.read_bytes,
                        walked_entries = rep.walked_entries,
                        ms = rep.elapsed_ms,
                        "point exported"
                    );
                    self.set(key, PointState::Durable { uploaded_bytes: rep.uploaded_bytes }, None)
                }
                Err(e) => {
                    let attempts = attempts + 1;
                    let backoff = Duration::from_secs((1u64 << attempts.min(6)).min(60));
                    tracing::warn!(sandbox = sb, point, attempts, retry_in_s = backoff.as_secs(), error = %e, "export failed");
                    self.set(
                        key,
                        PointState::Failed { error: e.to_string(), attempts },
                        Some(Instant::now() + backoff),
                    );
                }
            }
        }
    }

    /// Wait until `sandbox`'s `point` (taken at `created_at_ms` when it is local) is durable
    /// (or `timeout`).
    pub async fn wait_durable(
        &self,
        sandbox: &str,
        point: &str,
        created_at_ms: Option<u64>,
        timeout: Duration,
    ) -> Result<Durable, HostError> {
        let mut rx = self.changed.subscribe();
        self.kick();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.state(sandbox, point, created_at_ms) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> Grant {
        Grant { net: NetMode::Private, limits: Limits::default(), userns: None }
    }

    /// What the exporter writes: the source sandbox's whole record.
    fn exported() -> serde_json::Value {
        serde_json::json!({
            "format": 3, "name": "sb", "image": "debian", "created_at": 1, "init_pid": 42,
            "init_start": 7, "net": "private", "hostname": "sb",
            "limits": {"memory_bytes": null, "pids_max": null, "cpu_millis": null},
            "profile": {"privileged": false}, "cgroup": "crab-x/sb",
            "checkpoint_policy": "fs", "harness": {"cmd": ["^python agent"]}
        })
    }

    fn refused(meta: serde_json::Value, g: &Grant) -> Refusal {
        match admit_meta(&meta, g) {
            Ok(r) => panic!("{meta} admitted as {r:?}"),
            Err(r) => r,
        }
    }

    #[test]
    fn an_exported_record_is_admitted_with_the_hosts_grant() {
        let g = Grant {
            net: NetMode::None,
            limits: Limits { memory_bytes: Some(1 << 30), ..Default::default() },
            userns: None,
        };
        let mut meta = exported();
        meta["net"] = "none".into();
        let r = admit_meta(&meta, &g).expect("admitted");
        assert_eq!((r.net, r.limits, r.profile), (g.net, g.limits, SecurityProfile::default()));
        assert_eq!((r.image.as_str(), r.checkpoint_policy), ("debian", CheckpointPolicy::Fs));
        assert_eq!(r.harness.cmd, vec!["^python agent".to_string()]);
        assert_eq!((r.cgroup, r.nat, r.format), (None, None, crab_sandbox::runtime::RECORD_FORMAT));
        // A point asking for less than the grant gets the grant, not what it asked for.
        let r = admit_meta(&exported(), &grant()).expect("admitted");
        assert_eq!(r.net, NetMode::Private);
    }

    #[test]
    fn what_the_host_does_not_grant_is_refused_naming_the_field() {
        let bare = serde_json::json!({"profile": {"privileged": true}, "net": "host"});
        let r = refused(bare, &grant());
        assert_eq!(r.field, "sandbox_meta.profile.privileged");
        assert!(r.reason.contains("asks for a privileged profile"), "{}", r.reason);
        assert!(r.reason.contains("default profile only"), "{}", r.reason);
        for (net, ok_with) in [("host", NetMode::Host), ("nat", NetMode::Nat)] {
            let mut m = exported();
            m["net"] = net.into();
            let r = refused(m.clone(), &grant());
            assert_eq!(r.field, "sandbox_meta.net");
            assert!(r.reason.contains(&format!("network {net}")), "{}", r.reason);
            assert!(r.fix.contains(&format!("--network {net}")), "{}", r.fix);
            // The caller's flag grants it.
            assert!(admit_meta(&m, &Grant { net: ok_with, ..grant() }).is_ok());
        }
        let tight = Grant {
            net: NetMode::Private,
            limits: Limits {
                memory_bytes: Some(1 << 30),
                pids_max: Some(64),
                cpu_millis: Some(500),
                disk_bytes: Some(1 << 30),
            },
            userns: None,
        };
        for (key, v) in [
            ("memory_bytes", 2u64 << 30),
            ("pids_max", 65),
            ("cpu_millis", 501),
            ("disk_bytes", 2 << 30),
        ] {
            let mut m = exported();
            m["limits"][key] = v.into();
            assert_eq!(refused(m, &tight).field, format!("sandbox_meta.limits.{key}"));
        }
        let mut m = exported();
        m["profile"]["seccomp"] = "unconfined".into();
        assert_eq!(refused(m, &grant()).field, "sandbox_meta.profile");
        let mut m = exported();
        m["image"] = "../../etc".into();
        assert_eq!(refused(m, &grant()).field, "sandbox_meta.image");
        let mut m = exported();
        m["harness"] = serde_json::json!({"cmd": ["("]});
        assert_eq!(refused(m, &grant()).field, "sandbox_meta.harness");
        assert_eq!(refused(serde_json::json!("x"), &grant()).field, "sandbox_meta");
    }
}
