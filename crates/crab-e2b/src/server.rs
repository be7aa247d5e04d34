//! The E2B front door's HTTP server: one axum router for the REST control plane (API key) and
//! envd (routed by `E2b-Sandbox-Id`, authorised by the sandbox's `X-Access-Token`), the
//! front door's own state (tokens, metadata, timeouts, snapshots, the processes started through
//! envd) — persisted through [`Store`] so a daemon restart keeps it, and reconciled against the
//! host's sandboxes — and the timeout watchdog. Every lifecycle step is one [`Backend`] call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use crab_common::api::{ExecFrame, ExecRequest, NetMode, SandboxCreateRequest};
use crab_common::{ApiError, CheckpointKind, ErrorCode};
use tokio::sync::mpsc;

use crate::auth::{ct_eq, random_hex, Keys};
use crate::backend::Backend;
use crate::connect::{self, CallKind, Code, ConnectError};
use crate::envd::{self, DataEvent, EndEvent, EventResponse, ProcessConfig, ProcessEvent};
use crate::rest::{self, ApiErrorBody};
use crate::shell;
use crate::store::{SandboxFile, Store, StoredEnd, StoredProcess, StoredSnapshot, StoredState};

#[path = "files.rs"]
mod files;

/// The envd protocol version Crab answers as (the SDK enables features by it: default user,
/// octet-stream uploads, file metadata).
pub const ENVD_VERSION: &str = "0.5.7";
/// Default sandbox timeout, seconds (E2B's).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Largest upload through `POST /files`.
pub const MAX_UPLOAD: usize = 100 << 20;
/// Largest sandbox timeout (E2B's Pro limit, 24 h).
pub const MAX_TIMEOUT_S: u64 = 86_400;
/// How many ended envd processes a sandbox remembers (for `Connect` by pid after the end).
pub const ENDED_KEPT: usize = 32;

/// How the front door is configured.
#[derive(Debug, Clone)]
pub struct Config {
    /// Accepted API keys.
    pub keys: Keys,
    /// The image behind E2B's default template `base` when no image is named `base`.
    pub default_image: String,
    /// Where the front door's state persists (and the secret its access tokens derive from).
    pub store: Store,
}

/// The front door: its configuration, the host actions, and what it remembers per sandbox.
#[derive(Debug)]
pub struct E2b<B> {
    backend: Arc<B>,
    cfg: Config,
    sandboxes: Mutex<HashMap<String, Arc<Sb>>>,
    snapshots: Mutex<HashMap<String, Snapshot>>,
}

#[derive(Debug, Clone)]
struct Snapshot {
    /// Its id (`<sandbox>:<point>`).
    id: String,
    /// Names given at creation.
    names: Vec<String>,
    sandbox: String,
    point: String,
    /// A filesystem snapshot: sandboxes made from it get its files, not its processes.
    fs_only: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunState {
    Running,
    Paused,
    /// Killed while it held snapshots: hidden, processes stopped, restore points kept.
    Killed,
}

/// One E2B sandbox: a Crab sandbox plus what E2B adds to it.
#[derive(Debug)]
struct Sb {
    id: String,
    template: String,
    token: String,
    metadata: HashMap<String, String>,
    envs: HashMap<String, String>,
    started_at: SystemTime,
    auto_pause: bool,
    /// When this front door learnt of it (reconciliation leaves younger ones alone).
    known_since: Instant,
    life: Mutex<Life>,
    /// envd processes by pid: running ones and the last [`ENDED_KEPT`] that ended.
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
    /// Sandbox directories of processes reported ended, removed by the next start.
    gc: Mutex<Vec<String>>,
    /// A lifecycle step in progress that ends exec streams (what a stream's end means).
    step: Mutex<Step>,
    /// The host says its init is gone (it died, or was stopped, outside the E2B API).
    dead: AtomicBool,
    /// Serialises pause, resume and kill of this sandbox.
    lifecycle: tokio::sync::Mutex<()>,
}

/// A lifecycle step that stops a sandbox's processes, so that the exec streams of its envd
/// processes end without the processes having ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    None,
    Pausing,
    Killing,
}

#[derive(Debug)]
struct Life {
    state: RunState,
    end_at: SystemTime,
    /// The restore point a pause took (what `connect` restores).
    pause_point: Option<String>,
}

/// A process started through envd. It runs in the sandbox under a supervisor of its own
/// (`shell::launch`), detached from any exec stream; while one is attached (the start's, or a
/// `shell::follow` after a restart or a resume) its output fans out to every connected stream.
#[derive(Debug)]
struct Proc {
    /// The supervisor's pid in the sandbox.
    pid: u32,
    tag: Option<String>,
    config: ProcessConfig,
    /// Its directory in the sandbox.
    dir: String,
    subs: Mutex<Vec<mpsc::UnboundedSender<Result<ProcessEvent, ConnectError>>>>,
    st: Mutex<ProcState>,
}

#[derive(Debug, Default)]
struct ProcState {
    /// How it ended; `None` while it runs.
    ended: Option<EndEvent>,
    /// When it ended (orders the ended ones, the oldest forgotten first).
    ended_seq: u64,
    /// An exec stream follows it (and `gen` is that stream's).
    attached: bool,
    /// Bumped whenever the attached stream is given up (pause, kill): a pump of an older
    /// generation that ends says nothing.
    gen: u64,
    /// The signal the front door sent it.
    signalled: Option<i32>,
    /// The exit status its stream reported while a pause was in progress (used when a
    /// re-attach after a refused pause finds no status in the sandbox).
    seen: Option<i32>,
}

static ENDED_SEQ: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn from_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// An E2B-shaped REST error.
#[derive(Debug)]
pub struct RestError(StatusCode, String);

impl RestError {
    fn new(status: u16, message: impl Into<String>) -> Self {
        RestError(
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            message.into(),
        )
    }
}

impl From<ApiError> for RestError {
    fn from(e: ApiError) -> Self {
        let msg = if e.hint.is_empty() { e.message } else { format!("{} ({})", e.message, e.hint) };
        RestError::new(e.code.http_status(), msg)
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let body = ApiErrorBody { code: self.0.as_u16(), message: self.1 };
        (self.0, Json(body)).into_response()
    }
}

fn api_to_connect(e: ApiError) -> ConnectError {
    let code = match e.code {
        ErrorCode::InvalidRequest | ErrorCode::UnsafeArchive => Code::InvalidArgument,
        ErrorCode::SandboxNotFound => Code::Unavailable,
        ErrorCode::ImageNotFound | ErrorCode::CheckpointNotFound => Code::NotFound,
        ErrorCode::NameConflict => Code::AlreadyExists,
        ErrorCode::Conflict => Code::FailedPrecondition,
        ErrorCode::Timeout => Code::DeadlineExceeded,
        ErrorCode::PoolFull => Code::ResourceExhausted,
        ErrorCode::HostUnsupported => Code::Unimplemented,
        ErrorCode::HostCapabilityMissing => Code::FailedPrecondition,
        _ => Code::Internal,
    };
    let msg = if e.hint.is_empty() { e.message } else { format!("{} ({})", e.message, e.hint) };
    ConnectError::new(code, msg)
}

type Shared<B> = Arc<E2b<B>>;

impl<B: Backend> E2b<B> {
    /// A front door over `backend`.
    pub fn new(backend: Arc<B>, cfg: Config) -> Shared<B> {
        Arc::new(E2b {
            backend,
            cfg,
            sandboxes: Mutex::new(HashMap::new()),
            snapshots: Mutex::new(HashMap::new()),
        })
    }

    /// The router (serve it with `axum::serve`).
    pub fn router(self: &Shared<B>) -> Router {
        let api = Router::new()
            .route("/sandboxes", post(create::<B>).get(list::<B>))
            .route("/v2/sandboxes", post(create::<B>).get(list::<B>))
            .route("/sandboxes/{id}", get(detail::<B>).delete(kill::<B>))
            .route("/sandboxes/{id}/timeout", post(set_timeout::<B>))
            .route("/sandboxes/{id}/pause", post(pause::<B>))
            .route("/sandboxes/{id}/resume", post(connect_sb::<B>))
            .route("/sandboxes/{id}/connect", post(connect_sb::<B>))
            .route("/v2/sandboxes/{id}/connect", post(connect_sb::<B>))
            .route("/sandboxes/{id}/snapshots", post(snapshot::<B>))
            .route("/sandboxes/{id}/fork", post(fork::<B>))
            .route("/snapshots", get(list_snapshots::<B>))
            .route("/templates/{id}", axum::routing::delete(delete_template::<B>))
            .route_layer(axum::middleware::from_fn_with_state(self.clone(), api_key::<B>));
        let envd = Router::new()
            .route("/process.Process/{method}", post(process::<B>))
            .route("/filesystem.Filesystem/{method}", post(files::filesystem::<B>))
            .route("/files", get(files::download::<B>).post(files::upload::<B>))
            .layer(DefaultBodyLimit::max(MAX_UPLOAD));
        Router::new()
            .route("/health", get(health::<B>))
            .merge(api)
            .merge(envd)
            .fallback(|| async {
                RestError::new(
                    404,
                    "no such E2B route on this Crab daemon (docs/e2b.md lists what is served)",
                )
            })
            .with_state(self.clone())
    }

    /// Kill or pause sandboxes whose timeout passed (call every second or so).
    pub async fn expire(self: &Shared<B>) {
        let now = SystemTime::now();
        let due: Vec<Arc<Sb>> = lock(&self.sandboxes)
            .values()
            .filter(|s| {
                let l = lock(&s.life);
                l.state == RunState::Running && l.end_at <= now
            })
            .cloned()
            .collect();
        for sb in due {
            if sb.auto_pause {
                tracing::info!(sandbox = %sb.id, "E2B timeout: pausing");
                if let Err(e) = self.do_pause(&sb).await {
                    tracing::warn!(sandbox = %sb.id, error = %e.1, "E2B timeout: pause failed; killing");
                    let _ = self.do_kill(&sb).await;
                }
            } else {
                tracing::info!(sandbox = %sb.id, "E2B timeout: killing");
                if let Err(e) = self.do_kill(&sb).await {
                    tracing::warn!(sandbox = %sb.id, error = %e.1, "E2B timeout: kill failed");
                }
            }
        }
    }

    /// Run [`E2b::expire`] every `period` until the front door is dropped.
    pub fn spawn_watchdog(self: &Shared<B>, period: Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut t = tokio::time::interval(period);
            let mut n: u64 = 0;
            loop {
                t.tick().await;
                let Some(me) = weak.upgrade() else { return };
                me.expire().await;
                n += 1;
                // Sandboxes removed through the CLI disappear from the E2B API too.
                if n.is_multiple_of(10) {
                    me.reconcile(false).await;
                }
            }
        });
    }

    fn sandbox(&self, id: &str) -> Result<Arc<Sb>, RestError> {
        lock(&self.sandboxes)
            .get(id)
            .filter(|s| lock(&s.life).state != RunState::Killed)
            .cloned()
            .ok_or_else(|| RestError::new(404, format!("sandbox {id:?} not found")))
    }

    /// What sandbox `sb` persists as.
    fn file_of(&self, sb: &Sb) -> SandboxFile {
        let (state, end_at, pause_point) = {
            let l = lock(&sb.life);
            (l.state, l.end_at, l.pause_point.clone())
        };
        let mut snapshots: Vec<StoredSnapshot> = lock(&self.snapshots)
            .iter()
            .filter(|(k, s)| s.sandbox == sb.id && **k == s.id)
            .map(|(_, s)| StoredSnapshot {
                id: s.id.clone(),
                point: s.point.clone(),
                fs_only: s.fs_only,
                names: s.names.clone(),
            })
            .collect();
        snapshots.sort_by(|a, b| a.id.cmp(&b.id));
        SandboxFile {
            format: crate::store::FORMAT,
            id: sb.id.clone(),
            template: sb.template.clone(),
            metadata: sb.metadata.clone(),
            envs: sb.envs.clone(),
            started_at_ms: ms(sb.started_at),
            end_at_ms: ms(end_at),
            auto_pause: sb.auto_pause,
            state: match state {
                RunState::Running => StoredState::Running,
                RunState::Paused => StoredState::Paused,
                RunState::Killed => StoredState::Killed,
            },
            pause_point,
            snapshots,
            processes: {
                let mut v: Vec<StoredProcess> =
                    lock(&sb.procs).values().map(|p| p.stored()).collect();
                v.sort_by_key(|p| p.pid);
                v
            },
            gc: lock(&sb.gc).clone(),
        }
    }

    /// Write `sb`'s state file. A failure is logged, not answered: the sandbox works on, but a
    /// daemon restart would forget it.
    fn persist(&self, sb: &Sb) {
        if let Err(e) = self.cfg.store.save(&self.file_of(sb)) {
            tracing::error!(sandbox = %sb.id, error = %e, "cannot persist the E2B state of the sandbox; a daemon restart will forget it (check the state directory's disk)");
        }
    }

    /// Drop every trace of sandbox `id` from the front door (memory and state file).
    fn forget(&self, id: &str) {
        lock(&self.sandboxes).remove(id);
        lock(&self.snapshots).retain(|_, s| s.sandbox != id);
        if let Err(e) = self.cfg.store.delete(id) {
            tracing::error!(sandbox = %id, error = %e, "cannot delete the E2B state file; remove it by hand");
        }
    }

    fn insert_snapshot(&self, snap: Snapshot) {
        let mut m = lock(&self.snapshots);
        for n in &snap.names {
            m.insert(n.clone(), snap.clone());
        }
        m.insert(snap.id.clone(), snap);
    }

    /// Load the persisted state (call once, before serving): every readable sandbox file
    /// becomes an E2B sandbox again, with its token (derived, not stored), absolute deadline,
    /// snapshots and run state; then reconcile it with the host's sandboxes and points.
    pub async fn restore_state(self: &Shared<B>) {
        let files = self.cfg.store.load();
        let n = files.len();
        for f in files {
            let sb = Arc::new(Sb {
                id: f.id.clone(),
                template: f.template,
                token: self.cfg.store.token(&f.id),
                metadata: f.metadata,
                envs: f.envs,
                started_at: from_ms(f.started_at_ms),
                auto_pause: f.auto_pause,
                known_since: Instant::now(),
                life: Mutex::new(Life {
                    state: match f.state {
                        StoredState::Running => RunState::Running,
                        StoredState::Paused => RunState::Paused,
                        StoredState::Killed => RunState::Killed,
                    },
                    end_at: from_ms(f.end_at_ms),
                    pause_point: f.pause_point,
                }),
                procs: Mutex::new(
                    f.processes
                        .into_iter()
                        .map(|p| (p.pid, Arc::new(Proc::from_stored(p))))
                        .collect(),
                ),
                gc: Mutex::new(f.gc),
                step: Mutex::new(Step::None),
                dead: AtomicBool::new(false),
                lifecycle: tokio::sync::Mutex::new(()),
            });
            for s in f.snapshots {
                self.insert_snapshot(Snapshot {
                    id: s.id,
                    names: s.names,
                    sandbox: f.id.clone(),
                    point: s.point,
                    fs_only: s.fs_only,
                });
            }
            lock(&self.sandboxes).insert(f.id, sb);
        }
        if n > 0 {
            self.reconcile(true).await;
            // Follow again the envd processes that ran when the daemon stopped; one that ended
            // meanwhile is reported ended (with its exit status, which its supervisor kept).
            let running: Vec<Arc<Sb>> = lock(&self.sandboxes)
                .values()
                .filter(|s| {
                    lock(&s.life).state == RunState::Running && !s.dead.load(Ordering::Relaxed)
                })
                .cloned()
                .collect();
            for sb in &running {
                self.reattach(sb).await;
            }
            tracing::info!(
                loaded = n,
                kept = lock(&self.sandboxes).len(),
                "E2B front-door state restored"
            );
        }
    }

    /// Match what the front door remembers with the host: a sandbox gone from the host (removed
    /// through the CLI) is forgotten; a paused one that runs again (restored through the CLI)
    /// is running; with `points`, snapshots whose restore point is gone are dropped, and a
    /// killed snapshot holder left without snapshots is removed.
    pub async fn reconcile(self: &Shared<B>, points: bool) {
        if lock(&self.sandboxes).is_empty() {
            return;
        }
        let asked = Instant::now();
        let host: HashMap<String, bool> = match self.backend.sandboxes().await {
            Ok(v) => v.into_iter().collect(),
            Err(e) => {
                tracing::warn!(error = %e.message, "E2B reconcile: cannot list the host's sandboxes");
                return;
            }
        };
        let known: Vec<Arc<Sb>> =
            lock(&self.sandboxes).values().filter(|s| s.known_since < asked).cloned().collect();
        for sb in known {
            // One busy with a lifecycle step is looked at next time.
            let Ok(_g) = sb.lifecycle.try_lock() else { continue };
            let Some(&running) = host.get(&sb.id) else {
                tracing::info!(sandbox = %sb.id, "E2B sandbox no longer exists on the host (removed outside the E2B API); forgetting it");
                self.forget(&sb.id);
                continue;
            };
            let mut changed = false;
            {
                let mut l = lock(&sb.life);
                if l.state == RunState::Paused && running {
                    l.state = RunState::Running;
                    l.pause_point = None;
                    changed = true;
                }
                sb.dead.store(l.state == RunState::Running && !running, Ordering::Relaxed);
            }
            if points {
                let has = lock(&self.snapshots).values().any(|s| s.sandbox == sb.id);
                if has {
                    match self.backend.points(sb.id.clone()).await {
                        Ok(p) => {
                            let mut m = lock(&self.snapshots);
                            let before = m.len();
                            m.retain(|k, s| {
                                let keep = s.sandbox != sb.id || p.contains(&s.point);
                                if !keep && *k == s.id {
                                    tracing::warn!(sandbox = %sb.id, snapshot = %s.id, "E2B snapshot dropped: its restore point is gone");
                                }
                                keep
                            });
                            changed |= m.len() != before;
                        }
                        Err(e) => {
                            tracing::warn!(sandbox = %sb.id, error = %e.message, "E2B reconcile: cannot list restore points")
                        }
                    }
                }
            }
            // A killed holder whose last snapshot is gone (deleted while a removal failed,
            // or its point pruned) has nothing left to keep.
            let holds = lock(&self.snapshots).values().any(|s| s.sandbox == sb.id);
            if lock(&sb.life).state == RunState::Killed && !holds {
                match self.backend.remove(sb.id.clone()).await {
                    Ok(()) => self.forget(&sb.id),
                    Err(e) if e.code == ErrorCode::SandboxNotFound => self.forget(&sb.id),
                    Err(e) => {
                        tracing::warn!(sandbox = %sb.id, error = %e.message, "E2B reconcile: cannot remove a killed sandbox without snapshots")
                    }
                }
                continue;
            }
            if changed {
                self.persist(&sb);
            }
        }
    }

    /// Delete snapshot `id` (an id or a name); the last one of a killed sandbox removes it.
    async fn delete_snapshot(&self, id: &str) -> Result<(), RestError> {
        let snap = lock(&self.snapshots)
            .get(id)
            .cloned()
            .ok_or_else(|| RestError::new(404, format!("snapshot {id:?} not found")))?;
        let sb = lock(&self.sandboxes).get(&snap.sandbox).cloned();
        let Some(sb) = sb else {
            lock(&self.snapshots).retain(|_, s| s.id != snap.id);
            return Ok(());
        };
        let _g = sb.lifecycle.lock().await;
        lock(&self.snapshots).retain(|_, s| s.id != snap.id);
        let holds = lock(&self.snapshots).values().any(|s| s.sandbox == sb.id);
        if lock(&sb.life).state == RunState::Killed && !holds {
            match self.backend.remove(sb.id.clone()).await {
                Ok(()) => {}
                Err(e) if e.code == ErrorCode::SandboxNotFound => {}
                Err(e) => {
                    // Forgotten as a snapshot all the same; the watchdog retries the removal.
                    self.persist(&sb);
                    return Err(e.into());
                }
            }
            self.forget(&sb.id);
            tracing::info!(sandbox = %sb.id, snapshot = %snap.id, "last E2B snapshot deleted: its killed sandbox is removed");
        } else {
            // The restore point stays a Crab point of a live sandbox (`crab checkpoints`).
            self.persist(&sb);
            tracing::info!(sandbox = %sb.id, snapshot = %snap.id, "E2B snapshot deleted");
        }
        Ok(())
    }

    fn created(&self, sb: &Sb) -> rest::Created {
        rest::Created {
            template_id: sb.template.clone(),
            sandbox_id: sb.id.clone(),
            client_id: "crab".into(),
            envd_version: ENVD_VERSION.into(),
            envd_access_token: sb.token.clone(),
        }
    }

    fn register(
        &self,
        id: String,
        template: String,
        req: &rest::NewSandbox,
        timeout_s: u64,
    ) -> Arc<Sb> {
        let now = SystemTime::now();
        let sb = Arc::new(Sb {
            id: id.clone(),
            template,
            token: self.cfg.store.token(&id),
            metadata: req.metadata.clone().unwrap_or_default(),
            envs: req.env_vars.clone().unwrap_or_default(),
            started_at: now,
            auto_pause: req.auto_pause.unwrap_or(false),
            known_since: Instant::now(),
            life: Mutex::new(Life {
                state: RunState::Running,
                end_at: now + Duration::from_secs(timeout_s),
                pause_point: None,
            }),
            procs: Mutex::new(HashMap::new()),
            gc: Mutex::new(Vec::new()),
            step: Mutex::new(Step::None),
            dead: AtomicBool::new(false),
            lifecycle: tokio::sync::Mutex::new(()),
        });
        lock(&self.sandboxes).insert(id, sb.clone());
        self.persist(&sb);
        sb
    }

    /// Kill: the sandbox goes; if it holds snapshots, it is only stopped and hidden (a
    /// snapshot outlives its sandbox, as in E2B) until its last snapshot is deleted.
    async fn do_kill(&self, sb: &Arc<Sb>) -> Result<(), RestError> {
        let _g = sb.lifecycle.lock().await;
        *lock(&sb.step) = Step::Killing;
        let r = self.do_kill_locked(sb).await;
        *lock(&sb.step) = Step::None;
        if r.is_ok() {
            // Whatever ran in it is gone: every stream ends with the process killed.
            for p in lock(&sb.procs).drain().map(|(_, p)| p).collect::<Vec<_>>() {
                p.give_up(Ok(killed_end()));
            }
        }
        r
    }

    async fn do_kill_locked(&self, sb: &Arc<Sb>) -> Result<(), RestError> {
        let holds = lock(&self.snapshots).values().any(|s| s.sandbox == sb.id);
        if holds {
            return match self.backend.retire(sb.id.clone()).await {
                Ok(()) => {
                    {
                        let mut l = lock(&sb.life);
                        l.state = RunState::Killed;
                        l.pause_point = None;
                    }
                    self.persist(sb);
                    Ok(())
                }
                Err(e) if e.code == ErrorCode::SandboxNotFound => {
                    self.forget(&sb.id);
                    Ok(())
                }
                Err(e) => Err(e.into()),
            };
        }
        let r = self.backend.remove(sb.id.clone()).await;
        self.forget(&sb.id);
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.code == ErrorCode::SandboxNotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Pause: nothing is touched before the host's pause, which checks what it can first
    /// (the dump's capability) and leaves the sandbox running when it fails. On success the
    /// envd processes live on in the pause point; their streams end (E2B's streams do not
    /// survive a pause either). On failure they were never stopped: their streams go on, and
    /// one whose exec stream ended while the pause was under way is followed again.
    async fn do_pause(self: &Shared<B>, sb: &Arc<Sb>) -> Result<(), RestError> {
        let _g = sb.lifecycle.lock().await;
        if lock(&sb.life).state == RunState::Paused {
            return Err(RestError::new(409, format!("sandbox {} is already paused", sb.id)));
        }
        *lock(&sb.step) = Step::Pausing;
        let r = self.backend.pause(sb.id.clone()).await;
        match r {
            Ok(point) => {
                {
                    let mut l = lock(&sb.life);
                    l.state = RunState::Paused;
                    l.pause_point = Some(point);
                }
                *lock(&sb.step) = Step::None;
                let paused = ConnectError::new(
                    Code::Unavailable,
                    format!(
                        "sandbox {} was paused; the process is kept in its pause point: after Sandbox.connect() commands.list() shows it again and commands.connect(pid) follows it",
                        sb.id
                    ),
                );
                for p in lock(&sb.procs).values() {
                    p.give_up(Err(paused.clone()));
                }
                self.persist(sb);
                Ok(())
            }
            Err(e) => {
                *lock(&sb.step) = Step::None;
                self.reattach(sb).await;
                Err(e.into())
            }
        }
    }

    /// Whether the host runs sandbox `id`'s init (`true` when it cannot tell); records it.
    async fn alive(&self, sb: &Sb) -> bool {
        let alive = match self.backend.sandboxes().await {
            Ok(v) => v.iter().find(|(n, _)| *n == sb.id).is_none_or(|(_, r)| *r),
            Err(_) => true,
        };
        sb.dead.store(!alive, Ordering::Relaxed);
        alive
    }

    /// An exec in `sb` failed with `e`: the sandbox's death (told as E2B tells a sandbox that
    /// is not running), or `e`.
    async fn exec_failed(&self, sb: &Sb, e: ApiError) -> ConnectError {
        if e.code == ErrorCode::SandboxNotFound || !self.alive(sb).await {
            return dead_error(&sb.id);
        }
        api_to_connect(e)
    }

    /// Follow every running envd process of `sb` that no exec stream follows (after a daemon
    /// restart, a resume, a refused pause). Returns once each is followed or found ended.
    async fn reattach(self: &Shared<B>, sb: &Arc<Sb>) {
        let todo: Vec<Arc<Proc>> = lock(&sb.procs)
            .values()
            .filter(|p| {
                let st = lock(&p.st);
                st.ended.is_none() && !st.attached
            })
            .cloned()
            .collect();
        let mut set = tokio::task::JoinSet::new();
        for p in todo {
            let (me, sb) = (self.clone(), sb.clone());
            set.spawn(async move { me.attach(&sb, &p).await });
        }
        while set.join_next().await.is_some() {}
    }

    /// Attach an exec stream to envd process `p` (`shell::follow`): it streams the output from
    /// now on and ends with its exit status; or its header says the process already ended.
    async fn attach(self: &Shared<B>, sb: &Arc<Sb>, p: &Arc<Proc>) {
        let gen = {
            let mut st = lock(&p.st);
            if st.ended.is_some() || st.attached {
                return;
            }
            st.attached = true;
            st.gen
        };
        let req = ExecRequest {
            cmd: shell::follow(&p.dir, p.pid),
            workdir: Some("/".into()),
            ..Default::default()
        };
        let head = exec_header(&*self.backend, sb.id.clone(), req).await;
        match head {
            Ok((h, rx, pending)) if h.running => {
                tokio::spawn(pump(self.clone(), sb.clone(), p.clone(), rx, pending, gen));
            }
            Ok((h, _, _)) => {
                let (seen, signalled) = {
                    let st = lock(&p.st);
                    (st.seen, st.signalled)
                };
                let end = match h.status.or(seen) {
                    Some(code) => exit_end(code, signalled),
                    None => EndEvent {
                        exit_code: -1,
                        exited: false,
                        status: "unknown".into(),
                        error: Some("the process ended while no exec stream followed it (a daemon restart or a pause) and left no exit status".into()),
                    },
                };
                self.end_proc(sb, p, gen, Ok(end));
            }
            Err(f) => {
                lock(&p.st).attached = false;
                let why = f.error.map(|e| e.message).unwrap_or(f.stderr);
                tracing::warn!(sandbox = %sb.id, pid = p.pid, error = %why, "cannot follow an envd process");
            }
        }
    }

    /// Record that `p` ended (as of stream generation `gen`) — persisted before any stream
    /// hears of it, so a `List` after the end never shows it — then tell its streams.
    fn end_proc(&self, sb: &Sb, p: &Proc, gen: u64, how: Result<EndEvent, ConnectError>) {
        let end = match &how {
            Ok(e) => e.clone(),
            Err(e) => EndEvent {
                exit_code: -1,
                exited: false,
                status: "unknown".into(),
                error: Some(e.message.clone()),
            },
        };
        {
            let mut st = lock(&p.st);
            if st.gen != gen || st.ended.is_some() {
                return;
            }
            st.ended = Some(end);
            st.ended_seq = ENDED_SEQ.fetch_add(1, Ordering::Relaxed);
            st.attached = false;
        }
        lock(&sb.gc).push(p.dir.clone());
        {
            let mut procs = lock(&sb.procs);
            let mut ended: Vec<(u64, u32)> = procs
                .values()
                .filter_map(|q| {
                    let st = lock(&q.st);
                    st.ended.as_ref().map(|_| (st.ended_seq, q.pid))
                })
                .collect();
            if ended.len() > ENDED_KEPT {
                ended.sort_unstable();
                for (_, pid) in &ended[..ended.len() - ENDED_KEPT] {
                    procs.remove(pid);
                }
            }
        }
        self.persist(sb);
        p.finish(how);
    }

    /// `p`'s exec stream (generation `gen`) ended with `last`: the process ended, or a pause
    /// or a kill of the sandbox is under way, or the sandbox died.
    async fn stream_ended(&self, sb: &Sb, p: &Proc, gen: u64, last: Result<i32, ApiError>) {
        if lock(&p.st).gen != gen {
            return;
        }
        match *lock(&sb.step) {
            Step::Killing => return self.end_proc(sb, p, gen, Ok(killed_end())),
            // Stopped with the sandbox, or ending by itself: said after the pause (a refused
            // pause follows it again; a resumed sandbox too).
            Step::Pausing => {
                let mut st = lock(&p.st);
                st.attached = false;
                st.seen = last.as_ref().ok().copied();
                return;
            }
            Step::None => {}
        }
        if lock(&sb.life).state == RunState::Paused {
            lock(&p.st).attached = false;
            return;
        }
        let signalled = lock(&p.st).signalled;
        let end = match last {
            Ok(code) if signalled.is_some() || !(code == 137 || code == 255) => {
                Ok(exit_end(code, signalled))
            }
            // Killed or without a status: was it the sandbox that died?
            last => {
                if !self.alive(sb).await {
                    Err(dead_error(&sb.id))
                } else {
                    match last {
                        Ok(code) => Ok(exit_end(code, signalled)),
                        Err(e) => {
                            let msg = if e.hint.is_empty() {
                                e.message
                            } else {
                                format!("{} ({})", e.message, e.hint)
                            };
                            Ok(EndEvent {
                                exit_code: -1,
                                exited: false,
                                status: "error".into(),
                                error: Some(msg),
                            })
                        }
                    }
                }
            }
        };
        self.end_proc(sb, p, gen, end);
    }
}

/// What the SDK is told of a sandbox whose init is gone (its message says "was not found", so
/// the SDK raises `SandboxNotRunningException`).
fn dead_error(id: &str) -> ConnectError {
    ConnectError::new(
        Code::Unavailable,
        format!(
            "The sandbox {id} was not found running: its processes ended outside the E2B API (its init is gone: killed, or stopped through Crab); Sandbox.connect() brings it back from its newest restore point, kill() removes it"
        ),
    )
}

/// The end of a process killed with the sandbox.
fn killed_end() -> EndEvent {
    EndEvent { exit_code: -1, exited: false, status: "signal: killed".into(), error: None }
}

/// The end of a process whose supervisor reported `code`; a process the front door signalled
/// and that died of it ends as Go's envd reports a signal.
fn exit_end(code: i32, signalled: Option<i32>) -> EndEvent {
    match signalled {
        Some(sig) if code == 128 + sig || code == 255 => EndEvent {
            exit_code: -1,
            exited: false,
            status: if sig == 9 { "signal: killed".into() } else { "signal: terminated".into() },
            error: None,
        },
        _ => EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
    }
}

/// The header line of a `shell::launch` / `shell::follow` stream.
#[derive(Debug)]
struct Header {
    pid: u32,
    running: bool,
    /// `follow`'s exit status of an ended process, when it left one.
    status: Option<i32>,
}

/// Why no header came.
#[derive(Debug)]
struct HeaderFail {
    /// The exec's exit code.
    code: Option<i32>,
    /// What it printed on stderr.
    stderr: String,
    /// The exec's own failure.
    error: Option<ApiError>,
}

/// Run `req` in sandbox `id` and read its header line ([`read_header`]); a failure to start
/// the exec is a [`HeaderFail`] with the exec's error.
async fn exec_header<B: Backend>(
    backend: &B,
    id: String,
    req: ExecRequest,
) -> Result<(Header, mpsc::Receiver<ExecFrame>, Vec<ExecFrame>), HeaderFail> {
    match backend.exec(id, req).await {
        Ok(rx) => read_header(rx).await,
        Err(e) => Err(HeaderFail { code: None, stderr: String::new(), error: Some(e) }),
    }
}

/// Read the header line off `rx`; answers it, the stream, and the frames that came with it
/// (stderr, and stdout after the header's newline), in order.
async fn read_header(
    mut rx: mpsc::Receiver<ExecFrame>,
) -> Result<(Header, mpsc::Receiver<ExecFrame>, Vec<ExecFrame>), HeaderFail> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut line: Vec<u8> = Vec::new();
    let mut pending = Vec::new();
    let mut stderr = Vec::new();
    loop {
        match rx.recv().await {
            Some(ExecFrame::Stdout { d }) => {
                let bytes = b64.decode(&d).unwrap_or_default();
                line.extend_from_slice(&bytes);
                if let Some(nl) = line.iter().position(|b| *b == b'\n') {
                    let rest = line.split_off(nl + 1);
                    if !rest.is_empty() {
                        pending.push(ExecFrame::Stdout { d: b64.encode(&rest) });
                    }
                    let text = String::from_utf8_lossy(&line).trim().to_string();
                    let mut w = text.split_whitespace();
                    let pid = w.next().and_then(|p| p.parse::<u32>().ok());
                    let word = w.next();
                    let status = w.next().and_then(|c| c.parse::<i32>().ok());
                    return match pid {
                        Some(pid) if pid > 0 => Ok((
                            Header { pid, running: word != Some("ended"), status },
                            rx,
                            pending,
                        )),
                        _ => Err(HeaderFail {
                            code: None,
                            stderr: format!("bad envd header {text:?}"),
                            error: None,
                        }),
                    };
                }
                if line.len() > 256 {
                    return Err(HeaderFail {
                        code: None,
                        stderr: "no envd header line".into(),
                        error: None,
                    });
                }
            }
            Some(ExecFrame::Stderr { d }) => {
                stderr.extend(b64.decode(&d).unwrap_or_default());
                pending.push(ExecFrame::Stderr { d });
            }
            Some(ExecFrame::Exit { code, .. }) => {
                return Err(HeaderFail {
                    code: Some(code),
                    stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
                    error: None,
                })
            }
            Some(ExecFrame::Error { error }) => {
                return Err(HeaderFail { code: None, stderr: String::new(), error: Some(error) })
            }
            None => {
                return Err(HeaderFail {
                    code: None,
                    stderr: "the exec stream ended before the process started".into(),
                    error: None,
                })
            }
        }
    }
}

impl Proc {
    fn from_stored(p: StoredProcess) -> Proc {
        Proc {
            pid: p.pid,
            tag: p.tag,
            config: ProcessConfig { cmd: p.cmd, args: p.args, envs: p.envs, cwd: p.cwd },
            dir: p.dir,
            subs: Mutex::new(Vec::new()),
            st: Mutex::new(ProcState {
                ended: p.ended.map(|e| EndEvent {
                    exit_code: e.exit_code,
                    exited: e.exited,
                    status: e.status,
                    error: e.error,
                }),
                ..Default::default()
            }),
        }
    }

    fn stored(&self) -> StoredProcess {
        let st = lock(&self.st);
        StoredProcess {
            pid: self.pid,
            tag: self.tag.clone(),
            cmd: self.config.cmd.clone(),
            args: self.config.args.clone(),
            envs: self.config.envs.clone(),
            cwd: self.config.cwd.clone(),
            dir: self.dir.clone(),
            ended: st.ended.as_ref().map(|e| StoredEnd {
                exit_code: e.exit_code,
                exited: e.exited,
                status: e.status.clone(),
                error: e.error.clone(),
            }),
        }
    }

    fn running(&self) -> bool {
        lock(&self.st).ended.is_none()
    }

    fn subscribe(&self) -> Option<mpsc::UnboundedReceiver<Result<ProcessEvent, ConnectError>>> {
        let (tx, rx) = mpsc::unbounded_channel();
        if !self.running() {
            return None;
        }
        lock(&self.subs).push(tx);
        Some(rx)
    }

    fn publish(&self, ev: ProcessEvent) {
        lock(&self.subs).retain(|s| s.send(Ok(ev.clone())).is_ok());
    }

    /// Tell every stream how it ended (an end event, or an error end of stream) and close them.
    fn finish(&self, how: Result<EndEvent, ConnectError>) {
        let subs = std::mem::take(&mut *lock(&self.subs));
        for s in subs {
            let _ = s.send(how.clone().map(ProcessEvent::End));
        }
    }

    /// Give up the attached exec stream (a pause stopped it, or the sandbox was killed):
    /// `Ok(end)` records the process ended; `Err(e)` keeps it running, unattached. Its streams
    /// are told either way.
    fn give_up(&self, how: Result<EndEvent, ConnectError>) {
        {
            let mut st = lock(&self.st);
            if st.ended.is_some() {
                return;
            }
            st.gen += 1;
            st.attached = false;
            if let Ok(end) = &how {
                st.ended = Some(end.clone());
            }
        }
        self.finish(how);
    }
}

// ---------------------------------------------------------------------------------------------
// Control plane

async fn api_key<B: Backend>(
    State(e2b): State<Shared<B>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    match key {
        Some(k) if e2b.cfg.keys.accepts(k) => next.run(req).await,
        Some(_) => {
            RestError::new(401, "invalid X-API-Key: it matches none of the --e2b-keys digests")
                .into_response()
        }
        None => RestError::new(
            401,
            "missing X-API-Key header: set E2B_API_KEY to a key whose SHA-256 is in --e2b-keys",
        )
        .into_response(),
    }
}

fn body<T: serde::de::DeserializeOwned + Default>(bytes: &Bytes) -> Result<T, RestError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes)
        .map_err(|e| RestError::new(400, format!("malformed JSON body: {e}")))
}

fn new_id() -> String {
    format!("e2b-{}", random_hex(8))
}

async fn create<B: Backend>(
    State(e2b): State<Shared<B>>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let req: rest::NewSandbox = body(&raw)?;
    if req.template_id.is_empty() {
        return Err(RestError::new(
            400,
            "templateID is required (a Crab image name or a snapshot id)",
        ));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    if timeout == 0 || timeout > MAX_TIMEOUT_S {
        return Err(RestError::new(
            400,
            format!("timeout must be 1..={MAX_TIMEOUT_S} seconds, got {timeout}"),
        ));
    }
    if let Some(envs) = &req.env_vars {
        for k in envs.keys() {
            check_env_key(k).map_err(|m| RestError::new(400, m))?;
        }
    }
    let id = new_id();
    let snap = lock(&e2b.snapshots).get(&req.template_id).cloned();
    if let Some(snap) = snap {
        let mut r = e2b
            .backend
            .fork(snap.sandbox.clone(), Some(snap.point.clone()), vec![id.clone()], snap.fs_only)
            .await?;
        match r.pop() {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => return Err(RestError::new(500, "the fork answered no branch")),
        }
    } else {
        let images = e2b.backend.images().await?;
        let image = if images.contains(&req.template_id) {
            req.template_id.clone()
        } else if req.template_id == "base" && images.contains(&e2b.cfg.default_image) {
            e2b.cfg.default_image.clone()
        } else {
            return Err(RestError::new(
                404,
                format!(
                    "template {:?} not found: a template is a Crab image ({}) or a snapshot id",
                    req.template_id,
                    if images.is_empty() {
                        "none built; run `crab image build debian`".into()
                    } else {
                        images.join(", ")
                    }
                ),
            ));
        };
        // E2B's default is internet access; Crab's default network is private (loopback only):
        // `allow_internet_access=True` asks for the NAT network, `False` for none.
        let net = match req.allow_internet_access {
            Some(true) => NetMode::Nat,
            Some(false) => NetMode::None,
            None => NetMode::Private,
        };
        e2b.backend
            .create(SandboxCreateRequest {
                name: Some(id.clone()),
                net,
                ..SandboxCreateRequest::new(image)
            })
            .await?;
    }
    let sb = e2b.register(id, req.template_id.clone(), &req, timeout);
    tracing::info!(sandbox = %sb.id, template = %sb.template, "E2B sandbox created");
    Ok((StatusCode::CREATED, Json(e2b.created(&sb))).into_response())
}

fn check_env_key(k: &str) -> Result<(), String> {
    if k.is_empty() || k.contains('=') || k.contains('\0') {
        return Err(format!("invalid environment variable name {k:?}"));
    }
    Ok(())
}

/// `GET /health`: 204; with an `E2b-Sandbox-Id`, 502 unless that sandbox runs (the SDK's
/// `is_running()` reads a 502 as "not running").
async fn health<B: Backend>(State(e2b): State<Shared<B>>, headers: HeaderMap) -> Response {
    let Some(id) = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    let sb =
        lock(&e2b.sandboxes).get(id).filter(|s| lock(&s.life).state == RunState::Running).cloned();
    match sb {
        Some(sb) if e2b.alive(&sb).await => StatusCode::NO_CONTENT.into_response(),
        Some(_) => envd_rest_error(dead_error(id)).into_response(),
        None => {
            RestError::new(502, format!("The sandbox {id} was not found running")).into_response()
        }
    }
}

/// What the host says runs: sandbox name → its init is alive.
async fn host_running<B: Backend>(e2b: &E2b<B>) -> HashMap<String, bool> {
    match e2b.backend.sandboxes().await {
        Ok(v) => v.into_iter().collect(),
        Err(e) => {
            tracing::warn!(error = %e.message, "cannot list the host's sandboxes; E2B states as last known");
            HashMap::new()
        }
    }
}

/// Record what the host said of `sb` (a sandbox the host does not list is left as it was).
fn note_host(sb: &Sb, host: &HashMap<String, bool>) {
    if let Some(&running) = host.get(&sb.id) {
        sb.dead.store(!running && lock(&sb.life).state == RunState::Running, Ordering::Relaxed);
    }
}

fn detail_of(sb: &Sb, with_token: bool) -> rest::Detail {
    let dead = sb.dead.load(Ordering::Relaxed);
    let l = lock(&sb.life);
    rest::Detail {
        template_id: sb.template.clone(),
        sandbox_id: sb.id.clone(),
        client_id: "crab".into(),
        started_at: rfc3339(sb.started_at),
        end_at: rfc3339(l.end_at),
        envd_version: ENVD_VERSION.into(),
        cpu_count: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1),
        memory_mb: 512,
        disk_size_mb: 1024,
        // A sandbox whose init died outside the E2B API is not running: E2B's word for a
        // sandbox that exists but does not run is "paused" (connect brings it back).
        state: match l.state {
            RunState::Running if !dead => "running".into(),
            RunState::Running | RunState::Paused | RunState::Killed => "paused".into(),
        },
        metadata: sb.metadata.clone(),
        envd_access_token: with_token.then(|| sb.token.clone()),
    }
}

async fn detail<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    note_host(&sb, &host_running(&e2b).await);
    Ok(Json(detail_of(&sb, true)).into_response())
}

async fn list<B: Backend>(
    State(e2b): State<Shared<B>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, RestError> {
    let filter: Vec<(String, String)> = match q.get("metadata") {
        Some(m) => serde_urlencoded::from_str(m).map_err(|e| {
            RestError::new(400, format!("metadata filter must be k=v&k2=v2 (URL-encoded): {e}"))
        })?,
        None => Vec::new(),
    };
    let states: Vec<&str> = q.get("state").map(|s| s.split(',').collect()).unwrap_or_default();
    for s in &states {
        if !matches!(*s, "running" | "paused") {
            return Err(RestError::new(400, format!("unknown state {s:?}; use running or paused")));
        }
    }
    let (offset, limit) = page_params(&q)?;
    let host = host_running(&e2b).await;
    let mut all: Vec<rest::Detail> = lock(&e2b.sandboxes)
        .values()
        .filter(|sb| lock(&sb.life).state != RunState::Killed)
        .inspect(|sb| note_host(sb, &host))
        .map(|sb| detail_of(sb, false))
        .filter(|d| filter.iter().all(|(k, v)| d.metadata.get(k) == Some(v)))
        .filter(|d| states.is_empty() || states.contains(&d.state.as_str()))
        .filter(|d| q.get("template").is_none_or(|t| &d.template_id == t))
        .collect();
    all.sort_by(|a, b| a.started_at.cmp(&b.started_at).then(a.sandbox_id.cmp(&b.sandbox_id)));
    Ok(page(&all, offset, limit))
}

/// A list route's paging: `nextToken` (an offset) and `limit` (1..=1000, default 100).
fn page_params(q: &HashMap<String, String>) -> Result<(usize, usize), RestError> {
    let limit: usize = match q.get("limit") {
        Some(l) => l
            .parse()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| RestError::new(400, format!("limit must be 1..=1000, got {l:?}")))?,
        None => 100,
    };
    let offset: usize = match q.get("nextToken") {
        Some(t) => {
            t.parse().map_err(|_| RestError::new(400, format!("invalid nextToken {t:?}")))?
        }
        None => 0,
    };
    Ok((offset, limit))
}

/// One page of `all` as JSON, with `x-next-token` when more follow.
fn page<T: serde::Serialize + Clone>(all: &[T], offset: usize, limit: usize) -> Response {
    let page: Vec<T> = all.iter().skip(offset).take(limit).cloned().collect();
    let mut r = Json(page).into_response();
    if offset + limit < all.len() {
        if let Ok(v) = (offset + limit).to_string().parse() {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    r
}

async fn kill<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    e2b.do_kill(&sb).await?;
    tracing::info!(sandbox = %id, "E2B sandbox killed");
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list_snapshots<B: Backend>(
    State(e2b): State<Shared<B>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, RestError> {
    let (offset, limit) = page_params(&q)?;
    let mut all: Vec<rest::SnapshotInfo> = lock(&e2b.snapshots)
        .iter()
        .filter(|(k, s)| **k == s.id)
        .map(|(_, s)| s)
        .filter(|s| q.get("sandboxID").is_none_or(|id| &s.sandbox == id))
        .filter(|s| q.get("name").is_none_or(|n| &s.id == n || s.names.contains(n)))
        .map(|s| rest::SnapshotInfo { snapshot_id: s.id.clone(), names: s.names.clone() })
        .collect();
    all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    Ok(page(&all, offset, limit))
}

/// `DELETE /templates/{id}`: what the SDK's `Sandbox.delete_snapshot` calls.
async fn delete_template<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    if !lock(&e2b.snapshots).contains_key(&id) {
        let images = e2b.backend.images().await.unwrap_or_default();
        if images.contains(&id) || id == "base" {
            return Err(RestError::new(
                400,
                format!("{id:?} is a template (a Crab image), not a snapshot: remove images with `crab image rm`"),
            ));
        }
    }
    e2b.delete_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn set_timeout<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    let req: rest::TimeoutRequest = serde_json::from_slice(&raw)
        .map_err(|e| RestError::new(400, format!("body must be {{\"timeout\": seconds}}: {e}")))?;
    if req.timeout > MAX_TIMEOUT_S {
        return Err(RestError::new(
            400,
            format!("timeout must be at most {MAX_TIMEOUT_S} seconds"),
        ));
    }
    lock(&sb.life).end_at = SystemTime::now() + Duration::from_secs(req.timeout);
    e2b.persist(&sb);
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn pause<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    let req: rest::PauseRequest = body(&raw)?;
    if req.memory == Some(false) {
        return Err(RestError::new(
            400,
            "a files-only pause is not supported: Crab pauses keep processes (omit mode, or use mode=\"full\")",
        ));
    }
    e2b.do_pause(&sb).await?;
    tracing::info!(sandbox = %id, "E2B sandbox paused");
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn connect_sb<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    let req: rest::ConnectRequest = body(&raw)?;
    let timeout = req.timeout.map(|t| t.min(MAX_TIMEOUT_S)).unwrap_or(DEFAULT_TIMEOUT_S);
    let resumed = {
        let _g = sb.lifecycle.lock().await;
        let point = {
            let l = lock(&sb.life);
            if l.state == RunState::Paused {
                l.pause_point.clone()
            } else {
                None
            }
        };
        let paused = point.is_some();
        // Running in the front door's eyes, but its init is gone (it died or was stopped
        // outside the E2B API): brought back like `crab sandbox start` (its newest point).
        let dead = !paused && lock(&sb.life).state == RunState::Running && !e2b.alive(&sb).await;
        if let Some(point) = point {
            e2b.backend.resume(sb.id.clone(), point).await?;
            {
                let mut l = lock(&sb.life);
                l.state = RunState::Running;
                l.end_at = SystemTime::now() + Duration::from_secs(timeout);
            }
            e2b.persist(&sb);
            e2b.reattach(&sb).await;
        } else if dead {
            e2b.backend.start(sb.id.clone()).await?;
            sb.dead.store(false, Ordering::Relaxed);
            {
                let mut l = lock(&sb.life);
                let new = SystemTime::now() + Duration::from_secs(timeout);
                if new > l.end_at {
                    l.end_at = new;
                }
            }
            e2b.persist(&sb);
            e2b.reattach(&sb).await;
        } else if req.timeout.is_some() {
            {
                let mut l = lock(&sb.life);
                let new = SystemTime::now() + Duration::from_secs(timeout);
                if new > l.end_at {
                    l.end_at = new;
                }
            }
            e2b.persist(&sb);
        }
        paused || dead
    };
    tracing::info!(sandbox = %id, resumed, "E2B connect");
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(e2b.created(&sb))).into_response())
}

async fn snapshot<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    let req: rest::SnapshotRequest = body(&raw)?;
    if lock(&sb.life).state == RunState::Paused {
        return Err(RestError::new(409, format!("sandbox {id} is paused; connect to it first")));
    }
    let kind = if req.memory.unwrap_or(true) { CheckpointKind::Full } else { CheckpointKind::Fs };
    let point = e2b.backend.checkpoint(id.clone(), kind).await?;
    let snapshot_id = format!("{id}:{point}");
    let names: Vec<String> = req.name.into_iter().collect();
    e2b.insert_snapshot(Snapshot {
        id: snapshot_id.clone(),
        names: names.clone(),
        sandbox: id.clone(),
        point,
        fs_only: kind == CheckpointKind::Fs,
    });
    e2b.persist(&sb);
    tracing::info!(sandbox = %id, snapshot = %snapshot_id, %kind, "E2B snapshot");
    Ok((StatusCode::CREATED, Json(rest::SnapshotInfo { snapshot_id, names })).into_response())
}

async fn fork<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let sb = e2b.sandbox(&id)?;
    let req: rest::ForkRequest = body(&raw)?;
    let count = req.count.unwrap_or(1);
    if !(1..=64).contains(&count) {
        return Err(RestError::new(400, format!("count must be 1..=64, got {count}")));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S).clamp(1, MAX_TIMEOUT_S);
    if lock(&sb.life).state == RunState::Paused {
        return Err(RestError::new(409, format!("sandbox {id} is paused; connect to it first")));
    }
    let names: Vec<String> = (0..count).map(|_| new_id()).collect();
    let results = e2b.backend.fork(id.clone(), None, names.clone(), false).await?;
    let mut out = Vec::new();
    for (name, r) in names.into_iter().zip(results) {
        match r {
            Ok(_) => {
                let child = rest::NewSandbox {
                    template_id: sb.template.clone(),
                    metadata: Some(sb.metadata.clone()),
                    env_vars: Some(sb.envs.clone()),
                    auto_pause: Some(sb.auto_pause),
                    ..Default::default()
                };
                let c = e2b.register(name, sb.template.clone(), &child, timeout);
                out.push(rest::ForkResult { sandbox: Some(e2b.created(&c)), error: None });
            }
            Err(e) => {
                let RestError(s, m) = e.into();
                out.push(rest::ForkResult {
                    sandbox: None,
                    error: Some(ApiErrorBody { code: s.as_u16(), message: m }),
                });
            }
        }
    }
    tracing::info!(sandbox = %id, count, "E2B fork");
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

// ---------------------------------------------------------------------------------------------
// envd

/// The sandbox an envd call is for, checked against its access token, and running.
async fn envd_sandbox<B: Backend>(
    e2b: &E2b<B>,
    headers: &HeaderMap,
) -> Result<Arc<Sb>, ConnectError> {
    let id = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()).ok_or_else(|| {
        ConnectError::new(
            Code::InvalidArgument,
            "missing E2b-Sandbox-Id header: point E2B_SANDBOX_URL at this daemon's E2B listener",
        )
    })?;
    let sb = lock(&e2b.sandboxes)
        .get(id)
        .filter(|s| lock(&s.life).state != RunState::Killed)
        .cloned()
        .ok_or_else(|| {
            ConnectError::new(Code::Unavailable, format!("The sandbox {id} was not found"))
        })?;
    let token = headers.get("x-access-token").and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ct_eq(token.as_bytes(), sb.token.as_bytes()) {
        return Err(ConnectError::new(
            Code::Unauthenticated,
            format!("invalid or missing X-Access-Token for sandbox {id}: use the envdAccessToken its create answered"),
        ));
    }
    if lock(&sb.life).state == RunState::Paused {
        return Err(ConnectError::new(
            Code::Unavailable,
            format!("The sandbox {id} was not found running: it is paused; resume it with Sandbox.connect()"),
        ));
    }
    // Known dead: asked again (it may have been restored through Crab since).
    if sb.dead.load(Ordering::Relaxed) && !e2b.alive(&sb).await {
        return Err(dead_error(id));
    }
    Ok(sb)
}

fn call_user(headers: &HeaderMap) -> Result<String, ConnectError> {
    shell::user_from_basic(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()))
        .map_err(|m| ConnectError::new(Code::InvalidArgument, m))
}

/// What a command printed on stderr, collected, and its status (its stdout is not read).
struct Ran {
    code: i32,
    stderr: Vec<u8>,
}

async fn run_collect<B: Backend>(
    e2b: &E2b<B>,
    sb: &Sb,
    user: &str,
    argv: Vec<String>,
    stdin: Option<&[u8]>,
) -> Result<Ran, ConnectError> {
    let (cmd, env) = shell::as_user(user, &[], argv);
    let req = ExecRequest {
        cmd,
        env,
        workdir: Some("/".into()),
        timeout_s: Some(120.0),
        stdin_b64: stdin.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
        stdin_session: None,
    };
    let mut rx = match e2b.backend.exec(sb.id.clone(), req).await {
        Ok(rx) => rx,
        Err(e) => return Err(e2b.exec_failed(sb, e).await),
    };
    let mut stderr = Vec::new();
    let b64 = base64::engine::general_purpose::STANDARD;
    while let Some(f) = rx.recv().await {
        match f {
            ExecFrame::Stdout { .. } => {}
            ExecFrame::Stderr { d } => stderr.extend(b64.decode(d).unwrap_or_default()),
            ExecFrame::Exit { code, timed_out, .. } => {
                if timed_out {
                    return Err(ConnectError::new(
                        Code::DeadlineExceeded,
                        "the filesystem operation timed out",
                    ));
                }
                // Killed: by the sandbox's death?
                if code == 137 && !e2b.alive(sb).await {
                    return Err(dead_error(&sb.id));
                }
                return Ok(Ran { code, stderr });
            }
            ExecFrame::Error { error } => return Err(e2b.exec_failed(sb, error).await),
        }
    }
    Err(ConnectError::new(Code::Internal, "the command's stream ended without an exit status"))
}

fn unsupported(method: &str, headers: &HeaderMap) -> ConnectError {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("none");
    ConnectError::new(
        Code::InvalidArgument,
        format!("{method}: content type {ct:?} is not served; Crab speaks Connect's JSON codec (application/json, application/connect+json for streams)"),
    )
}

async fn process<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let stream = connect::call_kind(&headers) == Some(CallKind::Stream);
    let r = match method.as_str() {
        "Start" | "Connect" if stream => process_stream(&e2b, &method, &headers, &raw).await,
        "Start" | "Connect" => Err(unsupported(&method, &headers)),
        _ if stream => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{method} (a streaming call) is not supported by Crab's E2B front door"),
        )),
        _ => process_unary(&e2b, &method, &headers, &raw).await,
    };
    match r {
        Ok(r) => r,
        Err(e) if stream => e.stream_response(),
        Err(e) => e.unary_response(),
    }
}

/// The process `sel` names: by pid (running, or among the last ended), or by tag (running).
fn find_proc(sb: &Sb, sel: Option<&envd::ProcessSelector>) -> Result<Arc<Proc>, ConnectError> {
    let procs = lock(&sb.procs);
    let found = match sel {
        Some(envd::ProcessSelector { pid: Some(pid), .. }) => procs.get(pid).cloned(),
        Some(envd::ProcessSelector { tag: Some(tag), .. }) => {
            procs.values().find(|p| p.tag.as_deref() == Some(tag.as_str()) && p.running()).cloned()
        }
        _ => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "process selector (pid or tag) is required",
            ))
        }
    };
    found.ok_or_else(|| ConnectError::new(Code::NotFound, format!("process {sel:?} not found")))
}

async fn process_unary<B: Backend>(
    e2b: &Shared<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    if connect::call_kind(headers) != Some(CallKind::Unary) {
        return Err(unsupported(method, headers));
    }
    let sb = envd_sandbox(e2b, headers).await?;
    match method {
        "List" => {
            let mut processes: Vec<envd::ProcessInfo> = lock(&sb.procs)
                .values()
                .filter(|p| p.running())
                .map(|p| envd::ProcessInfo {
                    config: p.config.clone(),
                    pid: p.pid,
                    tag: p.tag.clone(),
                })
                .collect();
            processes.sort_by_key(|p| p.pid);
            Ok(connect::unary_ok(&envd::ListResponse { processes }))
        }
        "SendSignal" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            let (sig, name) = match req.signal {
                Some(9) => (9, "KILL"),
                Some(15) => (15, "TERM"),
                other => {
                    return Err(ConnectError::new(
                        Code::InvalidArgument,
                        format!("signal {other:?} is not supported; use SIGKILL or SIGTERM"),
                    ))
                }
            };
            let p = find_proc(&sb, req.process.as_ref())?;
            if !p.running() {
                return Err(ConnectError::new(
                    Code::NotFound,
                    format!("process {} has ended", p.pid),
                ));
            }
            lock(&p.st).signalled = Some(sig);
            let r = run_collect(e2b, &sb, "root", shell::signal(&p.dir, name), None).await?;
            if r.code == 44 {
                return Err(ConnectError::new(
                    Code::NotFound,
                    format!("process {} has no command left to signal", p.pid),
                ));
            }
            // One no stream follows (after a restart or a resume) is followed now, so that
            // its end is recorded.
            if !lock(&p.st).attached {
                let (e2b, sb, p) = (e2b.clone(), sb.clone(), p.clone());
                tokio::spawn(async move { e2b.attach(&sb, &p).await });
            }
            Ok(connect::unary_ok(&serde_json::json!({})))
        }
        "SendInput" | "CloseStdin" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            let p = find_proc(&sb, req.process.as_ref())?;
            if !p.running() {
                return Err(ConnectError::new(
                    Code::NotFound,
                    format!("process {} has ended", p.pid),
                ));
            }
            let r = if method == "SendInput" {
                let data = input_bytes(req.input.as_ref())?;
                run_collect(e2b, &sb, "root", shell::send_input(&p.dir), Some(&data)).await?
            } else {
                run_collect(e2b, &sb, "root", shell::close_input(&p.dir), None).await?
            };
            match r.code {
                0 => Ok(connect::unary_ok(&serde_json::json!({}))),
                44 => Err(ConnectError::new(
                    Code::FailedPrecondition,
                    format!("process {} has no stdin: start it with stdin=True (its stdin is closed once close_stdin is called)", p.pid),
                )),
                c => Err(ConnectError::new(
                    Code::Internal,
                    format!("{method} of process {}: exit {c}: {}", p.pid, String::from_utf8_lossy(&r.stderr).trim()),
                )),
            }
        }
        "Update" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            find_proc(&sb, req.process.as_ref())?;
            Err(ConnectError::new(
                Code::Unimplemented,
                "process.Process/Update (a PTY's size) is not supported: Crab runs E2B commands without a PTY",
            ))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not supported by Crab's E2B front door"),
        )),
    }
}

/// `SendInput`'s bytes: `{"input": {"stdin": base64}}` (a `pty` input is refused).
fn input_bytes(input: Option<&serde_json::Value>) -> Result<Vec<u8>, ConnectError> {
    let bad = |m: &str| ConnectError::new(Code::InvalidArgument, m.to_string());
    let v = input.ok_or_else(|| bad("input is required"))?;
    if v.get("pty").is_some() {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "PTY input is not supported: Crab runs E2B commands without a PTY",
        ));
    }
    let s = v
        .get("stdin")
        .and_then(|s| s.as_str())
        .ok_or_else(|| bad("input.stdin (base64) is required"))?;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| bad(&format!("input.stdin is not base64: {e}")))
}

type Events = mpsc::UnboundedReceiver<Result<ProcessEvent, ConnectError>>;

/// `Start`: the command runs under its supervisor (`shell::launch`); the start event goes out
/// once the supervisor said its pid. `Connect`: a stream of a running process's output from
/// now on, or, for one that ended, its end.
async fn process_stream<B: Backend>(
    e2b: &Shared<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    let sb = envd_sandbox(e2b, headers).await?;
    let (pid, events): (u32, Events) = if method == "Start" {
        let req: envd::StartRequest = connect::decode_stream_request(raw)?;
        if req.pty.is_some() {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "PTYs are not supported by Crab's E2B front door; use commands.run",
            ));
        }
        let tag = req.tag.clone();
        let config = req
            .process
            .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "process is required"))?;
        if config.cmd.is_empty() {
            return Err(ConnectError::new(Code::InvalidArgument, "process.cmd is empty"));
        }
        let user = call_user(headers)?;
        let mut envs: Vec<(String, String)> =
            sb.envs.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (k, v) in &config.envs {
            check_env_key(k).map_err(|m| ConnectError::new(Code::InvalidArgument, m))?;
            envs.retain(|(k2, _)| k2 != k);
            envs.push((k.clone(), v.clone()));
        }
        let mut argv = vec![config.cmd.clone()];
        argv.extend(config.args.iter().cloned());
        let (cmd, env) = shell::as_user(&user, &envs, argv);
        let workdir =
            config.cwd.clone().filter(|c| !c.is_empty()).unwrap_or_else(|| shell::home_of(&user));
        let dir = format!("{}/{}", shell::ENVD_DIR, random_hex(8));
        let gc = std::mem::take(&mut *lock(&sb.gc));
        let req = ExecRequest {
            cmd: shell::launch(&dir, &gc, req.stdin == Some(true), cmd),
            env,
            workdir: Some(workdir),
            ..Default::default()
        };
        let head = exec_header(&*e2b.backend, sb.id.clone(), req).await;
        let (h, rx, pending) = match head {
            Ok(x) => x,
            Err(f) => {
                lock(&sb.gc).extend(gc);
                return Err(match (f.error, f.code) {
                    (Some(e), _) => e2b.exec_failed(&sb, e).await,
                    (None, Some(126 | 127)) => ConnectError::new(Code::InvalidArgument, f.stderr),
                    (None, Some(137)) if !e2b.alive(&sb).await => dead_error(&sb.id),
                    (None, code) => ConnectError::new(
                        Code::Internal,
                        format!("the process did not start (exit {code:?}): {}", f.stderr),
                    ),
                });
            }
        };
        let p = Arc::new(Proc {
            pid: h.pid,
            tag,
            config,
            dir,
            subs: Mutex::new(Vec::new()),
            st: Mutex::new(ProcState { attached: true, ..Default::default() }),
        });
        let events = p
            .subscribe()
            .ok_or_else(|| ConnectError::new(Code::Internal, "process ended at once"))?;
        lock(&sb.procs).insert(p.pid, p.clone());
        e2b.persist(&sb);
        tokio::spawn(pump(e2b.clone(), sb.clone(), p.clone(), rx, pending, 0));
        (p.pid, events)
    } else {
        let req: envd::SelectRequest = connect::decode_stream_request(raw)?;
        let p = find_proc(&sb, req.process.as_ref())?;
        let events = match p.subscribe() {
            Some(ev) => {
                if !lock(&p.st).attached {
                    e2b.attach(&sb, &p).await;
                }
                ev
            }
            None => {
                // Ended: its end, as the stream would have told it.
                let (tx, rx) = mpsc::unbounded_channel();
                if let Some(end) = lock(&p.st).ended.clone() {
                    let _ = tx.send(Ok(ProcessEvent::End(end)));
                }
                rx
            }
        };
        (p.pid, events)
    };
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs);
    let deadline = connect::timeout_ms(headers).map(Duration::from_millis);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(stream_events(pid, events, tx, keepalive, deadline));
    Ok(connect::stream_head(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))))
}

/// Forward a process's events to one client stream: the start event, then what happens, until
/// the end event (or an error end of stream), the deadline, or the client leaving.
async fn stream_events(
    pid: u32,
    mut events: Events,
    tx: mpsc::Sender<Result<Bytes, std::convert::Infallible>>,
    keepalive: Option<Duration>,
    deadline: Option<Duration>,
) {
    let send = |ev: ProcessEvent| connect::message(&EventResponse { event: ev });
    if tx.send(Ok(send(ProcessEvent::Start { pid }))).await.is_err() {
        return;
    }
    let sleep = tokio::time::sleep(deadline.unwrap_or(Duration::from_secs(u64::MAX / 4)));
    tokio::pin!(sleep);
    let mut ping = tokio::time::interval(keepalive.unwrap_or(Duration::from_secs(3600)));
    ping.tick().await;
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(Ok(ev)) => {
                    let end = matches!(ev, ProcessEvent::End(_));
                    if tx.send(Ok(send(ev))).await.is_err() {
                        return;
                    }
                    if end {
                        let _ = tx.send(Ok(connect::end_stream(None))).await;
                        return;
                    }
                }
                Some(Err(e)) => {
                    let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                    return;
                }
                None => {
                    let e = ConnectError::new(Code::Unavailable, "the process's output stream ended (the sandbox was paused or killed)");
                    let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                    return;
                }
            },
            _ = ping.tick(), if keepalive.is_some() => {
                if tx.send(Ok(send(ProcessEvent::Keepalive {}))).await.is_err() {
                    return;
                }
            }
            _ = &mut sleep, if deadline.is_some() => {
                let e = ConnectError::new(Code::DeadlineExceeded, "the stream's timeout passed; the process keeps running (connect to it again by pid)");
                let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                return;
            }
            _ = tx.closed() => return,
        }
    }
}

/// Own the exec stream attached to `p` (generation `gen`): fan its output out as envd
/// events; when it ends, say what that means ([`E2b::stream_ended`]). The process itself does
/// not depend on this stream: a client leaving, or the stream ending, never kills it.
async fn pump<B: Backend>(
    e2b: Shared<B>,
    sb: Arc<Sb>,
    p: Arc<Proc>,
    mut rx: mpsc::Receiver<ExecFrame>,
    pending: Vec<ExecFrame>,
    gen: u64,
) {
    let mut pending = pending.into_iter();
    let last = loop {
        let f = match pending.next() {
            Some(f) => Some(f),
            None => rx.recv().await,
        };
        match f {
            Some(ExecFrame::Stdout { d }) => p.publish(ProcessEvent::Data(DataEvent::Stdout(d))),
            Some(ExecFrame::Stderr { d }) => p.publish(ProcessEvent::Data(DataEvent::Stderr(d))),
            Some(ExecFrame::Exit { code, .. }) => break Ok(code),
            Some(ExecFrame::Error { error }) => break Err(error),
            None => break Err(ApiError::internal("the exec stream ended without an exit status")),
        }
    };
    drop(rx);
    e2b.stream_ended(&sb, &p, gen, last).await;
}

// ---------------------------------------------------------------------------------------------
// /files

fn envd_rest_error(e: ConnectError) -> RestError {
    let status = match e.code {
        Code::Unavailable => 502,
        other => other.http_status().as_u16(),
    };
    RestError::new(status, e.message)
}
