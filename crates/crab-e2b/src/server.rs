//! The E2B front door's HTTP server: one axum router for the REST control plane (API key) and
//! envd (routed by `E2b-Sandbox-Id`, authorised by the sandbox's `X-Access-Token`). It holds no
//! lifecycle state: run state, deadline, metadata, environment, template and snapshots are the
//! host's (each call is one [`Backend`] call, and the host's watchdog fires timeouts). What it
//! keeps is the envd process table of each sandbox — persisted through [`Store`] so a daemon
//! restart keeps it — and the per-sandbox access tokens, derived from the store's secret.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use crab_common::api::{BranchSettings, NetMode, SandboxCreateRequest, SandboxInfo, SandboxState};
use crab_common::{ApiError, CheckpointKind, ErrorCode};

use crate::auth::{ct_eq, random_hex, Keys};
use crate::backend::Backend;
use crate::connect::{Code, ConnectError};
use crate::rest::{self, ApiErrorBody};
use crate::store::Store;
use crate::user;

#[path = "files.rs"]
mod files;

/// The envd protocol version Crab answers as (the SDK enables features by it: default user,
/// octet-stream uploads, file metadata).
pub const ENVD_VERSION: &str = "0.5.7";
/// Default sandbox timeout, seconds (E2B's).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Largest request body of an envd RPC (`process.Process`, `filesystem.Filesystem`: JSON).
pub const MAX_RPC_BODY: usize = 100 << 20;
/// Default of [`Config::max_upload`] (`crab daemon --max-upload`).
pub const DEFAULT_MAX_UPLOAD: u64 = 4 << 30;
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
    /// Largest upload through `POST /files` (streamed to the sandbox, never held whole; a
    /// larger one gets a 413 naming `crab daemon --max-upload`).
    pub max_upload: u64,
}

/// The front door: its configuration and the host actions. It keeps no state of a sandbox.
#[derive(Debug)]
pub struct E2b<B> {
    pub(crate) backend: Arc<B>,
    cfg: Config,
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// An E2B-shaped REST error.
#[derive(Debug)]
pub struct RestError(StatusCode, String);

impl RestError {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Self {
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

pub(crate) fn api_to_connect(e: ApiError) -> ConnectError {
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

pub(crate) type Shared<B> = Arc<E2b<B>>;

impl<B: Backend> E2b<B> {
    /// A front door over `backend`.
    pub fn new(backend: Arc<B>, cfg: Config) -> Shared<B> {
        Arc::new(E2b { backend, cfg })
    }

    /// Its configuration.
    pub(crate) fn cfg(&self) -> &Config {
        &self.cfg
    }

    /// [`Config::max_upload`] as a body limit.
    fn upload_limit(&self) -> usize {
        usize::try_from(self.cfg.max_upload).unwrap_or(usize::MAX)
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
            .route("/v3/templates", post(crate::templates::request_build::<B>))
            .route("/templates/aliases/{alias}", get(crate::templates::alias::<B>))
            .route("/templates/{id}/files/{hash}", get(crate::templates::files_link::<B>))
            .route("/v2/templates/{id}/builds/{build}", post(crate::templates::trigger::<B>))
            .route("/templates/{id}/builds/{build}/status", get(crate::templates::status::<B>))
            .route_layer(axum::middleware::from_fn_with_state(self.clone(), api_key::<B>));
        let envd = Router::new()
            .route("/process.Process/{method}", post(crate::process::process::<B>))
            .route("/filesystem.Filesystem/{method}", post(files::filesystem::<B>))
            .route(
                "/files",
                get(files::download::<B>)
                    .post(files::upload::<B>)
                    .layer(DefaultBodyLimit::max(self.upload_limit())),
            )
            .layer(DefaultBodyLimit::max(MAX_RPC_BODY));
        // A template's files: authorised by the upload token in its URL (the SDK sends no API
        // key there), streamed to disk, bounded by --max-upload.
        let uploads = Router::new().route(
            "/templates/{id}/files/{hash}/upload",
            axum::routing::put(crate::templates::upload::<B>)
                .layer(DefaultBodyLimit::max(self.upload_limit())),
        );
        Router::new()
            .route("/health", get(health::<B>))
            .merge(api)
            .merge(envd)
            .merge(uploads)
            .fallback(|| async {
                RestError::new(
                    404,
                    "no such E2B route on this Crab daemon (docs/e2b.md lists what is served)",
                )
            })
            .with_state(self.clone())
    }

    /// Sandbox `id`, which the host must know and not have retired (a retired sandbox is one
    /// E2B killed: not found). One cheap host call.
    async fn sandbox(&self, id: &str) -> Result<(), RestError> {
        match self.backend.status(id.to_string()).await {
            Ok(SandboxState::Retired) => {}
            Ok(_) => return Ok(()),
            Err(e) if e.code == ErrorCode::SandboxNotFound => {}
            Err(e) => return Err(e.into()),
        }
        Err(RestError::new(404, format!("sandbox {id:?} not found")))
    }

    fn created(&self, id: &str, template: &str) -> rest::Created {
        rest::Created {
            template_id: template.to_string(),
            sandbox_id: id.to_string(),
            client_id: "crab".into(),
            envd_version: ENVD_VERSION.into(),
            envd_access_token: self.cfg.store.token(id),
        }
    }

    /// Whether the host runs sandbox `id`'s init (`true` when it cannot tell). One record
    /// and one `/proc` stat on the host, whatever the number of sandboxes.
    async fn alive(&self, id: &str) -> bool {
        match self.backend.status(id.to_string()).await {
            Ok(s) => s == SandboxState::Running,
            Err(e) => e.code != ErrorCode::SandboxNotFound,
        }
    }

    /// An exec in `id` failed with `e`: the sandbox's death (told as E2B tells a sandbox that
    /// is not running), or `e`.
    async fn exec_failed(&self, id: &str, e: ApiError) -> ConnectError {
        if e.code == ErrorCode::SandboxNotFound || !self.alive(id).await {
            return dead_error(id);
        }
        api_to_connect(e)
    }
}

/// What the SDK is told of a sandbox whose init is gone (its message says "was not found", so
/// the SDK raises `SandboxNotRunningException`).
pub(crate) fn dead_error(id: &str) -> ConnectError {
    ConnectError::new(
        Code::Unavailable,
        format!(
            "The sandbox {id} was not found running: its processes ended outside the E2B API (its init is gone: killed, or stopped through Crab); Sandbox.connect() brings it back from its newest restore point, kill() removes it"
        ),
    )
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

pub(crate) fn body<T: serde::de::DeserializeOwned + Default>(
    bytes: &Bytes,
) -> Result<T, RestError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes)
        .map_err(|e| RestError::new(400, format!("malformed JSON body: {e}")))
}

fn new_id() -> String {
    format!("e2b-{}", random_hex(8))
}

/// The E2B metadata, environment, timeout and auto-pause of a new sandbox as host settings.
struct Settings {
    labels: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    timeout_s: u64,
    on_timeout: &'static str,
}

impl Settings {
    fn of(req: &rest::NewSandbox, timeout_s: u64) -> Result<Settings, RestError> {
        if let Some(envs) = &req.env_vars {
            for k in envs.keys() {
                check_env_key(k).map_err(|m| RestError::new(400, m))?;
            }
        }
        Ok(Settings {
            labels: req.metadata.clone().unwrap_or_default().into_iter().collect(),
            env: req.env_vars.clone().unwrap_or_default().into_iter().collect(),
            timeout_s,
            on_timeout: if req.auto_pause.unwrap_or(false) { "pause" } else { "kill" },
        })
    }

    fn branch(self, template: &str) -> BranchSettings {
        BranchSettings {
            labels: Some(self.labels),
            env: Some(self.env),
            template: Some(template.to_string()),
            timeout_s: Some(self.timeout_s),
            on_timeout: Some(self.on_timeout.to_string()),
        }
    }
}

/// The snapshot `id` names (its id or one of its names): the labelled point.
async fn find_snapshot<B: Backend>(
    e2b: &E2b<B>,
    id: &str,
) -> Result<Option<crab_common::api::LabelledPoint>, RestError> {
    Ok(e2b.backend.labels().await?.into_iter().find(|l| l.labels.iter().any(|x| x == id)))
}

async fn create<B: Backend>(
    State(e2b): State<Shared<B>>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let req: rest::NewSandbox = body(&raw)?;
    if req.template_id.is_empty() {
        return Err(RestError::new(
            400,
            "templateID is required (a Crab image name, a registry reference or a snapshot id)",
        ));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    if timeout == 0 || timeout > MAX_TIMEOUT_S {
        return Err(RestError::new(
            400,
            format!("timeout must be 1..={MAX_TIMEOUT_S} seconds, got {timeout}"),
        ));
    }
    let settings = Settings::of(&req, timeout)?;
    let id = new_id();
    if let Some(snap) = find_snapshot(&e2b, &req.template_id).await? {
        let mut r = e2b
            .backend
            .fork(
                snap.sandbox.clone(),
                Some(snap.point.clone()),
                vec![id.clone()],
                snap.fs_only,
                settings.branch(&req.template_id),
            )
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
        } else if req.template_id.contains([':', '/', '@']) {
            // A snapshot id is `<sandbox>:<point>` (`e2b-…:c000001`): one of a sandbox here, or
            // shaped like one (a point id after the colon), is a missing snapshot, not an
            // image to pull.
            if let Some((sb, point)) = req.template_id.split_once(':') {
                let point_shaped = !sb.contains('/')
                    && point
                        .strip_prefix('c')
                        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
                if point_shaped || e2b.backend.sandbox(sb.to_string()).await.is_ok() {
                    return Err(RestError::new(
                        404,
                        format!(
                            "snapshot {:?} not found (sandbox {sb} has no such snapshot)",
                            req.template_id
                        ),
                    ));
                }
            }
            // A registry reference (`python:3.12`): the host uses the image pulled from it,
            // pulling it on first use (or refuses with a hint when the daemon does not pull).
            req.template_id.clone()
        } else if req.template_id == "base" && images.contains(&e2b.cfg.default_image) {
            e2b.cfg.default_image.clone()
        } else {
            return Err(RestError::new(
                404,
                format!(
                    "template {:?} not found: a template is a Crab image ({}), a registry \
                     reference with a tag (`python:3.12`) or a snapshot id",
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
                labels: settings.labels,
                env: settings.env,
                timeout_s: Some(settings.timeout_s),
                on_timeout: Some(settings.on_timeout.to_string()),
                template: Some(req.template_id.clone()),
                ..SandboxCreateRequest::new(image)
            })
            .await?;
    }
    tracing::info!(sandbox = %id, template = %req.template_id, "E2B sandbox created");
    Ok((StatusCode::CREATED, Json(e2b.created(&id, &req.template_id))).into_response())
}

fn check_env_key(k: &str) -> Result<(), String> {
    if k.is_empty() || k.contains('=') || k.contains('\0') {
        return Err(format!("invalid environment variable name {k:?}"));
    }
    Ok(())
}

/// `GET /health`: 204; with an `E2b-Sandbox-Id`, 502 unless that sandbox runs (the SDK's
/// `is_running()` reads a 502 as "not running"). One cheap host call for that sandbox: the
/// cost does not grow with the number of sandboxes.
async fn health<B: Backend>(State(e2b): State<Shared<B>>, headers: HeaderMap) -> Response {
    let Some(id) = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    match e2b.backend.status(id.to_string()).await {
        Ok(SandboxState::Running) => StatusCode::NO_CONTENT.into_response(),
        Ok(SandboxState::Dead) => envd_rest_error(dead_error(id)).into_response(),
        _ => RestError::new(502, format!("The sandbox {id} was not found running")).into_response(),
    }
}

fn rfc3339_ms(ms: u64) -> String {
    rfc3339(UNIX_EPOCH + Duration::from_millis(ms))
}

/// A host sandbox as E2B describes it.
fn detail_of(info: &SandboxInfo, token: Option<String>) -> rest::Detail {
    let started_ms = info.created_at.saturating_mul(1000);
    rest::Detail {
        template_id: info.template.clone().unwrap_or_else(|| info.image.clone()),
        sandbox_id: info.name.clone(),
        client_id: "crab".into(),
        started_at: rfc3339_ms(started_ms),
        // No deadline: E2B's longest.
        end_at: rfc3339_ms(match info.deadline {
            Some(d) => d.at_ms,
            None => crab_common::clock::now_ms() + MAX_TIMEOUT_S * 1000,
        }),
        envd_version: ENVD_VERSION.into(),
        cpu_count: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1),
        memory_mb: info.limits.memory_bytes.map(|b| b >> 20).unwrap_or(512),
        disk_size_mb: info.limits.disk_bytes.map(|b| b >> 20).unwrap_or(1024),
        // A sandbox that exists but does not run (paused, stopped, its init dead) is E2B's
        // "paused": connect brings it back.
        state: if info.state == SandboxState::Running { "running" } else { "paused" }.into(),
        metadata: info.labels.clone().into_iter().collect(),
        envd_access_token: token,
    }
}

async fn detail<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    let info = match e2b.backend.sandbox(id.clone()).await {
        Ok(i) if i.state != SandboxState::Retired => i,
        Ok(_) => return Err(RestError::new(404, format!("sandbox {id:?} not found"))),
        Err(e) if e.code == ErrorCode::SandboxNotFound => {
            return Err(RestError::new(404, format!("sandbox {id:?} not found")))
        }
        Err(e) => return Err(e.into()),
    };
    Ok(Json(detail_of(&info, Some(e2b.cfg.store.token(&id)))).into_response())
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
    let mut all: Vec<rest::Detail> = e2b
        .backend
        .sandboxes()
        .await?
        .iter()
        .filter(|i| i.state != SandboxState::Retired)
        .map(|i| detail_of(i, None))
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
    e2b.sandbox(&id).await?;
    // The host retires it when its snapshots outlive it, else removes it; whatever ran in it
    // is gone, and every envd stream following one of its processes ends with it killed.
    match e2b.backend.kill(id.clone()).await {
        Ok(()) => {}
        Err(e) if e.code == ErrorCode::SandboxNotFound => {}
        Err(e) => return Err(e.into()),
    }
    tracing::info!(sandbox = %id, "E2B sandbox killed");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// An E2B snapshot: a labelled point, its first label the id (`<sandbox>:<point>`), the
/// others its names.
fn snapshot_info(l: &crab_common::api::LabelledPoint) -> rest::SnapshotInfo {
    let mut labels = l.labels.clone();
    let id =
        if labels.is_empty() { format!("{}:{}", l.sandbox, l.point) } else { labels.remove(0) };
    rest::SnapshotInfo { snapshot_id: id, names: labels }
}

async fn list_snapshots<B: Backend>(
    State(e2b): State<Shared<B>>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, RestError> {
    let (offset, limit) = page_params(&q)?;
    let mut all: Vec<rest::SnapshotInfo> = e2b
        .backend
        .labels()
        .await?
        .iter()
        .filter(|l| q.get("sandboxID").is_none_or(|id| &l.sandbox == id))
        .filter(|l| q.get("name").is_none_or(|n| l.labels.contains(n)))
        .map(snapshot_info)
        .collect();
    all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    Ok(page(&all, offset, limit))
}

/// `DELETE /templates/{id}`: what the SDK's `Sandbox.delete_snapshot` calls. The host drops
/// the snapshot's labels; the last snapshot of a killed (retired) sandbox removes it.
async fn delete_template<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    match e2b.backend.delete_label(id.clone()).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT.into_response()),
        Err(e) if e.code == ErrorCode::CheckpointNotFound => {
            let images = e2b.backend.images().await.unwrap_or_default();
            if images.contains(&id) || id == "base" {
                return Err(RestError::new(
                    400,
                    format!("{id:?} is a template (a Crab image), not a snapshot: remove images with `crab image rm`"),
                ));
            }
            Err(RestError::new(404, format!("snapshot {id:?} not found")))
        }
        Err(e) => Err(e.into()),
    }
}

async fn set_timeout<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    e2b.sandbox(&id).await?;
    let req: rest::TimeoutRequest = serde_json::from_slice(&raw)
        .map_err(|e| RestError::new(400, format!("body must be {{\"timeout\": seconds}}: {e}")))?;
    if req.timeout > MAX_TIMEOUT_S {
        return Err(RestError::new(
            400,
            format!("timeout must be at most {MAX_TIMEOUT_S} seconds"),
        ));
    }
    // E2B's setTimeout(0) ends the sandbox at once: the shortest deadline the host keeps.
    e2b.backend.set_timeout(id, req.timeout.max(1), false).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn pause<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    e2b.sandbox(&id).await?;
    let req: rest::PauseRequest = body(&raw)?;
    if req.memory == Some(false) {
        return Err(RestError::new(
            400,
            "a files-only pause is not supported: Crab pauses keep processes (omit mode, or use mode=\"full\")",
        ));
    }
    // Nothing is touched before the host's pause, which checks what it can first (the dump's
    // capability) and leaves the sandbox running when it fails. On success the envd processes
    // live on in the pause point and their streams end saying so.
    e2b.backend.pause(id.clone()).await?;
    tracing::info!(sandbox = %id, "E2B sandbox paused");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `connect` (and `resume`): the host's resume with `ensure` — a paused sandbox from its pause
/// point, a stopped or dead one from its newest point, a running one left alone — and a
/// deadline `timeout` from now that never shortens the current one.
async fn connect_sb<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    e2b.sandbox(&id).await?;
    let req: rest::ConnectRequest = body(&raw)?;
    let timeout = req.timeout.map(|t| t.clamp(1, MAX_TIMEOUT_S)).unwrap_or(DEFAULT_TIMEOUT_S);
    let resumed = e2b.backend.resume(id.clone(), timeout).await?;
    let template = match e2b.backend.sandbox(id.clone()).await {
        Ok(i) => i.template.unwrap_or(i.image),
        Err(_) => String::new(),
    };
    tracing::info!(sandbox = %id, resumed, "E2B connect");
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(e2b.created(&id, &template))).into_response())
}

async fn snapshot<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    e2b.sandbox(&id).await?;
    let req: rest::SnapshotRequest = body(&raw)?;
    if e2b.backend.status(id.clone()).await? == SandboxState::Paused {
        return Err(RestError::new(409, format!("sandbox {id} is paused; connect to it first")));
    }
    let kind = if req.memory.unwrap_or(true) { CheckpointKind::Full } else { CheckpointKind::Fs };
    let point = e2b.backend.checkpoint(id.clone(), kind).await?;
    let snapshot_id = format!("{id}:{point}");
    let names: Vec<String> = req.name.into_iter().collect();
    let mut labels = vec![snapshot_id.clone()];
    labels.extend(names.iter().cloned());
    e2b.backend.label(id.clone(), point, labels).await?;
    tracing::info!(sandbox = %id, snapshot = %snapshot_id, %kind, "E2B snapshot");
    Ok((StatusCode::CREATED, Json(rest::SnapshotInfo { snapshot_id, names })).into_response())
}

async fn fork<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, RestError> {
    e2b.sandbox(&id).await?;
    let req: rest::ForkRequest = body(&raw)?;
    let count = req.count.unwrap_or(1);
    if !(1..=64).contains(&count) {
        return Err(RestError::new(400, format!("count must be 1..=64, got {count}")));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S).clamp(1, MAX_TIMEOUT_S);
    let info = e2b.backend.sandbox(id.clone()).await?;
    if info.state == SandboxState::Paused {
        return Err(RestError::new(409, format!("sandbox {id} is paused; connect to it first")));
    }
    let template = info.template.clone().unwrap_or_else(|| info.image.clone());
    // Branches keep the source's metadata, environment and timeout action, with a fresh
    // timeout.
    let branch = BranchSettings {
        labels: None,
        env: None,
        template: Some(template.clone()),
        timeout_s: Some(timeout),
        on_timeout: Some(info.deadline.map(|d| d.on).unwrap_or_default().to_string()),
    };
    let names: Vec<String> = (0..count).map(|_| new_id()).collect();
    let results = e2b.backend.fork(id.clone(), None, names.clone(), false, branch).await?;
    let mut out = Vec::new();
    for (name, r) in names.into_iter().zip(results) {
        match r {
            Ok(_) => {
                out.push(rest::ForkResult {
                    sandbox: Some(e2b.created(&name, &template)),
                    error: None,
                });
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
pub(crate) async fn envd_sandbox<B: Backend>(
    e2b: &E2b<B>,
    headers: &HeaderMap,
) -> Result<String, ConnectError> {
    let id = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()).ok_or_else(|| {
        ConnectError::new(
            Code::InvalidArgument,
            "missing E2b-Sandbox-Id header: point E2B_SANDBOX_URL at this daemon's E2B listener",
        )
    })?;
    let token = headers.get("x-access-token").and_then(|v| v.to_str().ok()).unwrap_or("");
    // Checked before the host is asked (the token is the id's HMAC): an unauthenticated call
    // learns nothing of which sandboxes exist.
    if !ct_eq(token.as_bytes(), e2b.cfg.store.token(id).as_bytes()) {
        return Err(ConnectError::new(
            Code::Unauthenticated,
            format!("invalid or missing X-Access-Token for sandbox {id}: use the envdAccessToken its create answered"),
        ));
    }
    match e2b.backend.status(id.to_string()).await {
        // Parked: the call itself wakes it (the backend shows it running anyway).
        Ok(SandboxState::Running | SandboxState::Parked) => {}
        Ok(SandboxState::Paused) => {
            return Err(ConnectError::new(
                Code::Unavailable,
                format!("The sandbox {id} was not found running: it is paused; resume it with Sandbox.connect()"),
            ))
        }
        Ok(SandboxState::Retired) => {
            return Err(ConnectError::new(Code::Unavailable, format!("The sandbox {id} was not found")))
        }
        Ok(SandboxState::Dead | SandboxState::Stopped) => return Err(dead_error(id)),
        Err(e) if e.code == ErrorCode::SandboxNotFound => {
            return Err(ConnectError::new(Code::Unavailable, format!("The sandbox {id} was not found")))
        }
        Err(e) => return Err(api_to_connect(e)),
    }
    Ok(id.to_string())
}

pub(crate) fn call_user(headers: &HeaderMap) -> Result<String, ConnectError> {
    user::user_from_basic(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()))
        .map_err(|m| ConnectError::new(Code::InvalidArgument, m))
}

pub(crate) fn unsupported(method: &str, headers: &HeaderMap) -> ConnectError {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("none");
    ConnectError::new(
        Code::InvalidArgument,
        format!("{method}: content type {ct:?} is not served; Crab speaks Connect's JSON codec (application/json, application/connect+json for streams)"),
    )
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
