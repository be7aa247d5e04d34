//! The E2B front door's HTTP server: one axum router for the REST control plane (API key) and
//! envd (routed by `E2b-Sandbox-Id`, authorised by the sandbox's `X-Access-Token`), the
//! front door's own state (tokens, metadata, timeouts, snapshots, the processes started through
//! envd) — persisted through [`Store`] so a daemon restart keeps it, and reconciled against the
//! host's sandboxes — and the timeout watchdog. Every lifecycle step is one [`Backend`] call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use crab_common::api::{ExecFrame, ExecRequest, NetMode, SandboxCreateRequest};
use crab_common::{ApiError, CheckpointKind, ErrorCode};
use tokio::sync::{mpsc, oneshot};

use crate::auth::{ct_eq, random_hex, Keys};
use crate::backend::Backend;
use crate::connect::{self, CallKind, Code, ConnectError};
use crate::envd::{self, DataEvent, EndEvent, EventResponse, ProcessConfig, ProcessEvent};
use crate::rest::{self, ApiErrorBody};
use crate::shell::{self, FsFailure};
use crate::store::{SandboxFile, Store, StoredSnapshot, StoredState};

/// The envd protocol version Crab answers as (the SDK enables features by it: default user,
/// octet-stream uploads, file metadata).
pub const ENVD_VERSION: &str = "0.5.7";
/// Default sandbox timeout, seconds (E2B's).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Largest upload through `POST /files`.
pub const MAX_UPLOAD: usize = 100 << 20;
/// Largest sandbox timeout (E2B's Pro limit, 24 h).
pub const MAX_TIMEOUT_S: u64 = 86_400;

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
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
    next_pid: AtomicU32,
    /// Serialises pause, resume and kill of this sandbox.
    lifecycle: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct Life {
    state: RunState,
    end_at: SystemTime,
    /// The restore point a pause took (what `connect` restores).
    pause_point: Option<String>,
}

/// A process started through envd: its output fans out to every connected stream; it lives
/// until it exits or is killed, whether or not a client is connected.
#[derive(Debug)]
struct Proc {
    pid: u32,
    tag: Option<String>,
    config: ProcessConfig,
    subs: Mutex<Vec<mpsc::UnboundedSender<ProcessEvent>>>,
    ended: Mutex<bool>,
    kill: Mutex<Option<oneshot::Sender<()>>>,
}

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
            .route("/filesystem.Filesystem/{method}", post(filesystem::<B>))
            .route("/files", get(download::<B>).post(upload::<B>))
            .layer(DefaultBodyLimit::max(MAX_UPLOAD));
        Router::new()
            .route("/health", get(|| async { StatusCode::NO_CONTENT }))
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
                procs: Mutex::new(HashMap::new()),
                next_pid: AtomicU32::new(1),
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
            next_pid: AtomicU32::new(1),
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
        for p in lock(&sb.procs).drain().map(|(_, p)| p).collect::<Vec<_>>() {
            p.kill();
        }
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

    async fn do_pause(&self, sb: &Arc<Sb>) -> Result<(), RestError> {
        let _g = sb.lifecycle.lock().await;
        if lock(&sb.life).state == RunState::Paused {
            return Err(RestError::new(409, format!("sandbox {} is already paused", sb.id)));
        }
        for p in lock(&sb.procs).drain().map(|(_, p)| p).collect::<Vec<_>>() {
            // The processes survive in the pause point; their envd streams do not (as in E2B).
            p.detach();
        }
        let point = self.backend.pause(sb.id.clone()).await?;
        {
            let mut l = lock(&sb.life);
            l.state = RunState::Paused;
            l.pause_point = Some(point);
        }
        self.persist(sb);
        Ok(())
    }
}

impl Proc {
    fn kill(&self) {
        if let Some(k) = lock(&self.kill).take() {
            let _ = k.send(());
        }
    }

    /// End every stream without killing the process (its exec stream is gone: pause).
    fn detach(&self) {
        self.kill();
    }

    fn subscribe(&self) -> Option<mpsc::UnboundedReceiver<ProcessEvent>> {
        let (tx, rx) = mpsc::unbounded_channel();
        if *lock(&self.ended) {
            return None;
        }
        lock(&self.subs).push(tx);
        Some(rx)
    }

    fn publish(&self, ev: ProcessEvent) {
        lock(&self.subs).retain(|s| s.send(ev.clone()).is_ok());
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
                image,
                name: Some(id.clone()),
                net,
                nat_range: None,
                limits: Default::default(),
                privileged: false,
                checkpoint_policy: None,
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

fn detail_of(sb: &Sb, with_token: bool) -> rest::Detail {
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
        state: match l.state {
            RunState::Running => "running".into(),
            RunState::Paused | RunState::Killed => "paused".into(),
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
    let mut all: Vec<rest::Detail> = lock(&e2b.sandboxes)
        .values()
        .filter(|sb| lock(&sb.life).state != RunState::Killed)
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
        if let Some(point) = point {
            e2b.backend.resume(sb.id.clone(), point).await?;
            {
                let mut l = lock(&sb.life);
                l.state = RunState::Running;
                l.end_at = SystemTime::now() + Duration::from_secs(timeout);
            }
            e2b.persist(&sb);
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
        paused
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

/// The sandbox an envd call is for, checked against its access token.
fn envd_sandbox<B: Backend>(e2b: &E2b<B>, headers: &HeaderMap) -> Result<Arc<Sb>, ConnectError> {
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
            format!("sandbox {id} is paused; resume it with Sandbox.connect()"),
        ));
    }
    Ok(sb)
}

fn call_user(headers: &HeaderMap) -> Result<String, ConnectError> {
    shell::user_from_basic(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()))
        .map_err(|m| ConnectError::new(Code::InvalidArgument, m))
}

/// What a command printed, collected.
struct Ran {
    code: i32,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

async fn run_collect<B: Backend>(
    e2b: &E2b<B>,
    sb: &Sb,
    user: &str,
    argv: Vec<String>,
    stdin: Option<&[u8]>,
) -> Result<Ran, ApiError> {
    let (cmd, env) = shell::as_user(user, &[], argv);
    let req = ExecRequest {
        cmd,
        env,
        workdir: Some("/".into()),
        timeout_s: Some(120.0),
        stdin_b64: stdin.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
    };
    let mut rx = e2b.backend.exec(sb.id.clone(), req).await?;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let b64 = base64::engine::general_purpose::STANDARD;
    while let Some(f) = rx.recv().await {
        match f {
            ExecFrame::Stdout { d } => stdout.extend(b64.decode(d).unwrap_or_default()),
            ExecFrame::Stderr { d } => stderr.extend(b64.decode(d).unwrap_or_default()),
            ExecFrame::Exit { code, timed_out, .. } => {
                if timed_out {
                    return Err(ApiError::new(
                        ErrorCode::Timeout,
                        "the filesystem operation timed out",
                        "",
                    ));
                }
                return Ok(Ran { code, stdout, stderr });
            }
            ExecFrame::Error { error } => return Err(error),
        }
    }
    Err(ApiError::internal("the command's stream ended without an exit status"))
}

fn fs_error(r: &Ran, path: &str) -> ConnectError {
    match FsFailure::from_code(r.code) {
        Some(FsFailure::NotFound) => {
            ConnectError::new(Code::NotFound, format!("path {path} does not exist"))
        }
        Some(FsFailure::AlreadyExists) => {
            ConnectError::new(Code::AlreadyExists, format!("path {path} already exists"))
        }
        Some(FsFailure::PermissionDenied) => {
            ConnectError::new(Code::PermissionDenied, format!("permission denied: {path}"))
        }
        Some(FsFailure::NotADirectory) => {
            ConnectError::new(Code::InvalidArgument, format!("path {path} is not a directory"))
        }
        Some(FsFailure::IsADirectory) => {
            ConnectError::new(Code::InvalidArgument, format!("path {path} is a directory"))
        }
        None => ConnectError::new(
            Code::Internal,
            format!("{path}: exit {}: {}", r.code, String::from_utf8_lossy(&r.stderr).trim()),
        ),
    }
}

async fn filesystem<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    match filesystem_call(&e2b, &method, &headers, &raw).await {
        Ok(r) => r,
        Err(e) => {
            if connect::call_kind(&headers) == Some(CallKind::Stream) {
                e.stream_response()
            } else {
                e.unary_response()
            }
        }
    }
}

async fn filesystem_call<B: Backend>(
    e2b: &E2b<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    if connect::call_kind(headers) != Some(CallKind::Unary) {
        return Err(unsupported(method, headers));
    }
    let sb = envd_sandbox(e2b, headers)?;
    let user = call_user(headers)?;
    let one = |r: Ran, path: &str| -> Result<envd::EntryInfo, ConnectError> {
        if r.code != 0 {
            return Err(fs_error(&r, path));
        }
        shell::parse_entries(&r.stdout)
            .map_err(|m| ConnectError::new(Code::Internal, m))?
            .pop()
            .ok_or_else(|| ConnectError::new(Code::Internal, format!("{path}: no entry listed")))
    };
    match method {
        "Stat" | "MakeDir" | "Remove" | "ListDir" => {
            let req: envd::PathRequest = connect::decode_json(raw)?;
            let path = shell::absolute(&req.path, &user);
            let argv = match method {
                "Stat" => shell::stat(&path),
                "MakeDir" => shell::make_dir(&path),
                "Remove" => shell::remove(&path),
                _ => shell::list(&path, req.depth),
            };
            let r = run_collect(e2b, &sb, &user, argv, None).await.map_err(api_to_connect)?;
            match method {
                "Remove" => {
                    if r.code != 0 {
                        return Err(fs_error(&r, &path));
                    }
                    Ok(connect::unary_ok(&serde_json::json!({})))
                }
                "ListDir" => {
                    if r.code != 0 {
                        return Err(fs_error(&r, &path));
                    }
                    let entries = shell::parse_entries(&r.stdout).map_err(|m| ConnectError::new(Code::Internal, m))?;
                    Ok(connect::unary_ok(&envd::ListDirResponse { entries }))
                }
                _ => Ok(connect::unary_ok(&envd::EntryResponse { entry: one(r, &path)? })),
            }
        }
        "Move" => {
            let req: envd::MoveRequest = connect::decode_json(raw)?;
            let (src, dst) = (shell::absolute(&req.source, &user), shell::absolute(&req.destination, &user));
            let r = run_collect(e2b, &sb, &user, shell::rename(&src, &dst), None).await.map_err(api_to_connect)?;
            if r.code == 44 {
                return Err(fs_error(&r, &src));
            }
            Ok(connect::unary_ok(&envd::EntryResponse { entry: one(r, &dst)? }))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not supported by Crab's E2B front door (docs/e2b.md)"),
        )),
    }
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

fn find_proc(sb: &Sb, sel: Option<&envd::ProcessSelector>) -> Result<Arc<Proc>, ConnectError> {
    let procs = lock(&sb.procs);
    let found = match sel {
        Some(envd::ProcessSelector { pid: Some(pid), .. }) => procs.get(pid).cloned(),
        Some(envd::ProcessSelector { tag: Some(tag), .. }) => {
            procs.values().find(|p| p.tag.as_deref() == Some(tag.as_str())).cloned()
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
    e2b: &E2b<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    if connect::call_kind(headers) != Some(CallKind::Unary) {
        return Err(unsupported(method, headers));
    }
    let sb = envd_sandbox(e2b, headers)?;
    match method {
        "List" => {
            let processes = lock(&sb.procs)
                .values()
                .map(|p| envd::ProcessInfo {
                    config: p.config.clone(),
                    pid: p.pid,
                    tag: p.tag.clone(),
                })
                .collect();
            Ok(connect::unary_ok(&envd::ListResponse { processes }))
        }
        "SendSignal" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            match req.signal {
                Some(9) | Some(15) => {}
                other => {
                    return Err(ConnectError::new(
                        Code::InvalidArgument,
                        format!("signal {other:?} is not supported; use SIGKILL or SIGTERM"),
                    ))
                }
            }
            let p = find_proc(&sb, req.process.as_ref())?;
            p.kill();
            Ok(connect::unary_ok(&serde_json::json!({})))
        }
        "SendInput" | "CloseStdin" | "Update" => {
            let req: envd::SelectRequest = connect::decode_json(raw)?;
            find_proc(&sb, req.process.as_ref())?;
            Err(ConnectError::new(
                Code::Unimplemented,
                format!("process.Process/{method}: Crab runs E2B commands with stdin closed and without a PTY; pass input in the command (e.g. a here-document)"),
            ))
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not supported by Crab's E2B front door"),
        )),
    }
}

async fn process_stream<B: Backend>(
    e2b: &E2b<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    let sb = envd_sandbox(e2b, headers)?;
    let (proc_, events) = if method == "Start" {
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
        let req =
            ExecRequest { cmd, env, workdir: Some(workdir), timeout_s: None, stdin_b64: None };
        let rx = e2b.backend.exec(sb.id.clone(), req).await.map_err(api_to_connect)?;
        let pid = sb.next_pid.fetch_add(1, Ordering::Relaxed);
        let (ktx, krx) = oneshot::channel();
        let p = Arc::new(Proc {
            pid,
            tag,
            config,
            subs: Mutex::new(Vec::new()),
            ended: Mutex::new(false),
            kill: Mutex::new(Some(ktx)),
        });
        let events = p
            .subscribe()
            .ok_or_else(|| ConnectError::new(Code::Internal, "process ended at once"))?;
        lock(&sb.procs).insert(pid, p.clone());
        tokio::spawn(pump(sb.clone(), p.clone(), rx, krx));
        (p, events)
    } else {
        let req: envd::SelectRequest = connect::decode_stream_request(raw)?;
        let p = find_proc(&sb, req.process.as_ref())?;
        let events = p.subscribe().ok_or_else(|| {
            ConnectError::new(Code::NotFound, format!("process {} has ended", p.pid))
        })?;
        (p, events)
    };
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs);
    let deadline = connect::timeout_ms(headers).map(Duration::from_millis);
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(stream_events(proc_.pid, events, tx, keepalive, deadline));
    Ok(connect::stream_head(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))))
}

/// Forward a process's events to one client stream: the start event, then what happens, until
/// the end event, the deadline, or the client leaving.
async fn stream_events(
    pid: u32,
    mut events: mpsc::UnboundedReceiver<ProcessEvent>,
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
                Some(ev) => {
                    let end = matches!(ev, ProcessEvent::End(_));
                    if tx.send(Ok(send(ev))).await.is_err() {
                        return;
                    }
                    if end {
                        let _ = tx.send(Ok(connect::end_stream(None))).await;
                        return;
                    }
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

/// Own a process's exec stream: fan its frames out as envd events until it exits or is killed.
async fn pump(
    sb: Arc<Sb>,
    p: Arc<Proc>,
    mut rx: mpsc::Receiver<ExecFrame>,
    mut kill: oneshot::Receiver<()>,
) {
    let end = loop {
        tokio::select! {
            f = rx.recv() => match f {
                Some(ExecFrame::Stdout { d }) => p.publish(ProcessEvent::Data(DataEvent::Stdout(d))),
                Some(ExecFrame::Stderr { d }) => p.publish(ProcessEvent::Data(DataEvent::Stderr(d))),
                Some(ExecFrame::Exit { code, .. }) => {
                    break EndEvent { exit_code: code, exited: true, status: format!("exit status {code}"), error: None };
                }
                Some(ExecFrame::Error { error }) => {
                    let msg = if error.hint.is_empty() { error.message } else { format!("{} ({})", error.message, error.hint) };
                    break EndEvent { exit_code: -1, exited: false, status: "error".into(), error: Some(msg) };
                }
                None => break EndEvent { exit_code: -1, exited: false, status: "error".into(), error: Some("the exec stream ended without an exit status".into()) },
            },
            _ = &mut kill => {
                // Dropping the exec stream kills the command and whatever holds its output.
                drop(rx);
                break EndEvent { exit_code: -1, exited: false, status: "signal: killed".into(), error: None };
            }
        }
    };
    *lock(&p.ended) = true;
    p.publish(ProcessEvent::End(end));
    lock(&p.subs).clear();
    lock(&sb.procs).remove(&p.pid);
}

// ---------------------------------------------------------------------------------------------
// /files

#[derive(Debug, serde::Deserialize)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

fn envd_rest_error(e: ConnectError) -> RestError {
    let status = match e.code {
        Code::Unavailable => 502,
        other => other.http_status().as_u16(),
    };
    RestError::new(status, e.message)
}

fn file_user(q: &FileQuery, headers: &HeaderMap) -> Result<String, ConnectError> {
    match &q.username {
        Some(u) if !u.is_empty() => {
            shell::check_user(u).map_err(|m| ConnectError::new(Code::InvalidArgument, m))?;
            Ok(u.clone())
        }
        _ => call_user(headers),
    }
}

async fn download<B: Backend>(
    State(e2b): State<Shared<B>>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Result<Response, RestError> {
    let sb = envd_sandbox(&e2b, &headers).map_err(envd_rest_error)?;
    let user = file_user(&q, &headers).map_err(envd_rest_error)?;
    let path = shell::absolute(
        q.path.as_deref().ok_or_else(|| RestError::new(400, "path is required"))?,
        &user,
    );
    let r = run_collect(&e2b, &sb, &user, shell::read(&path), None).await?;
    if r.code != 0 {
        return Err(envd_rest_error(fs_error(&r, &path)));
    }
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], r.stdout).into_response())
}

async fn upload<B: Backend>(
    State(e2b): State<Shared<B>>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Result<Response, RestError> {
    let headers = req.headers().clone();
    let sb = envd_sandbox(&e2b, &headers).map_err(envd_rest_error)?;
    let user = file_user(&q, &headers).map_err(envd_rest_error)?;
    let too_big = || {
        RestError::new(413, format!("upload exceeds the {MAX_UPLOAD}-byte limit of Crab's E2B front door; split it or copy it with a command"))
    };
    let ct =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    if headers.get(header::CONTENT_ENCODING).is_some() {
        return Err(RestError::new(
            400,
            "compressed uploads are not supported; upload without gzip",
        ));
    }
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let mut mp = Multipart::from_request(req, &())
            .await
            .map_err(|e| RestError::new(400, format!("malformed multipart body: {e}")))?;
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_big()),
                Err(e) => {
                    return Err(RestError::new(400, format!("malformed multipart body: {e}")))
                }
            };
            let name = field.file_name().map(str::to_string).or_else(|| q.path.clone());
            let data = match field.bytes().await {
                Ok(b) => b,
                Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_big()),
                Err(e) => {
                    return Err(RestError::new(400, format!("malformed multipart body: {e}")))
                }
            };
            let path = name.ok_or_else(|| {
                RestError::new(400, "a file part has no file name and the request no path")
            })?;
            files.push((path, data));
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| RestError::new(400, "path is required for an octet-stream upload"))?;
        let data = match Bytes::from_request(req, &()).await {
            Ok(b) => b,
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(too_big()),
            Err(e) => return Err(RestError::new(400, format!("reading the upload: {e}"))),
        };
        files.push((path, data));
    }
    if files.is_empty() {
        return Err(RestError::new(400, "no file in the upload"));
    }
    let mut out = Vec::new();
    for (path, data) in files {
        let path = shell::absolute(&path, &user);
        let r = run_collect(&e2b, &sb, &user, shell::write(&path), Some(&data)).await?;
        if r.code != 0 {
            return Err(envd_rest_error(fs_error(&r, &path)));
        }
        let name = path.rsplit('/').next().unwrap_or("").to_string();
        out.push(serde_json::json!({"name": name, "type": "file", "path": path}));
    }
    Ok(Json(out).into_response())
}
