//! The LLM reverse proxy: attribution of each request to a sandbox, turn boundaries, response
//! gating on the turn's checkpoint, the conversation log, and pass-through of everything else.
//!
//! A turn request (`POST /v1/chat/completions`, `/v1/responses`, `/v1/messages`) is read whole
//! (up to `max_request_bytes`, within `body_read_timeout`, its bytes held against the sandbox's
//! and the proxy's memory budgets), hashed, and classified: a replay (after a restore, its response
//! is in the log), a retry (same body as the previous request, or `x-stainless-retry-count` > 0:
//! same turn, same ticket), or a new boundary ([`TurnHooks::on_boundary`]). It is forwarded at
//! once. When the upstream's response head arrives the gate waits for the ticket (promoting it
//! first if it is still pending); a buffered response is logged and fsynced before release, a
//! stream is released head-first and passed through frame by frame, its log record written
//! before the final chunk. A stream's gate waits only for the checkpoint: what else its end
//! must wait for (the host's wake of a parked sandbox, [`BoundaryTicket::wait_ready`]) holds
//! back only the newest frame, so the agent reads the answer as it comes and gets its end once
//! the sandbox is ready. With `stream_whole_answers` (the daemon's `--stream-whole-answers`,
//! on when it parks) a chat request asking for a whole answer is forwarded as a stream, so its
//! head comes early (the policy is told so, and the head times a parked sandbox's wake like a
//! stream's); the agent gets the whole answer assembled from the stream ([`crate::assemble`])
//! once the sandbox is ready, and the log records that answer, as the agent got it. Each
//! request runs in its own task, so a client that goes away never cancels a gate or a log
//! write.
//!
//! Connections are admitted through [`crate::limits::ConnGate`]s — one per in-sandbox endpoint
//! (`max_sandbox_connections`) and one over all listeners (`max_connections`); a connection
//! past either gets a JSON 503 and is closed at once, so a sandbox flooding its endpoint holds
//! at most its cap of the daemon's descriptors. A client that does not finish a request head
//! within `header_read_timeout` (or sits idle that long between requests) is disconnected.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crab_common::ErrorCode;

use crate::assemble::AssembleError;
use crate::config::{ConfigError, ProxyConfig, Upstream};
use crate::convlog::{sha256_hex, ConversationLog, LogError, LogRecord};
use crate::hooks::{
    Boundary, BoundaryTicket, DeferredTicket, HookError, Provider, ReadyTicket, ReportingTicket,
    SandboxDirectory, TurnHooks,
};
use crate::limits::{read_body, BodyHold, BodyReadError, ByteBudget, ConnGate, DeadlineBody};

/// Error type of proxied bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body type of proxied requests and responses.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Header naming the sandbox when the path has no `/s/<sandbox>` prefix.
pub const SANDBOX_HEADER: &str = "x-crab-sandbox";
/// Header the OpenAI and Anthropic SDKs set on retries.
pub const RETRY_HEADER: &str = "x-stainless-retry-count";
/// Header set on responses answered from the conversation log.
pub const REPLAYED_HEADER: &str = "x-crab-replayed";
/// Header set on every proxied turn response: where the time the proxy added went,
/// `stage=ms,...` ([`crab_common::stats::breakdown_header`]): the held time by stage — `boundary`
/// (the part of the turn boundary that the gate still waited for: the fsync of the previous
/// answer's log record, the verdict and the job submission, which run beside the forwarded
/// request), then the turn's checkpoint job's (`queue`, `setup`, `lock`, `freeze_snapshot`,
/// `criu_dump`, `hash`, `syncfs`, `dir_fsync`, `manifest_publish`, `engine_other`,
/// `gate_wakeup`), then `convlog_write` (the conversation-log record written before release,
/// fsynced at the next boundary; not on streams, whose record is written before their last
/// chunk).
pub const HELD_HEADER: &str = "x-crab-held";

/// Failures of the coordinator's own API (not of proxied requests, which become HTTP answers).
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listen address could not be bound.
    #[error("binding the LLM proxy on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Error.
        source: std::io::Error,
    },
    /// Invalid sandbox name.
    #[error("{0}")]
    BadName(String),
    /// No such sandbox.
    #[error("no sandbox named {0:?}")]
    UnknownSandbox(String),
    /// The conversation log failed.
    #[error(transparent)]
    Log(#[from] LogError),
    /// A blocking task died.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Per-sandbox counters of the proxy (for `crab top` and `/metrics`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxProxyStats {
    /// Sandbox.
    pub sandbox: String,
    /// Current turn number.
    pub turn: u64,
    /// Records in its conversation log.
    pub conversation_offset: u64,
    /// Requests proxied (all kinds).
    pub requests: u64,
    /// Turn boundaries marked.
    pub turns: u64,
    /// Retries recognised (same turn).
    pub retries: u64,
    /// Requests answered from the conversation log.
    pub replays: u64,
    /// Requests that were not turns (token counting, model lists, ...).
    pub non_turn: u64,
    /// Responses actually held for a checkpoint.
    pub held: u64,
    /// Total milliseconds held.
    pub held_ms_total: f64,
    /// Longest hold in milliseconds.
    pub held_ms_max: f64,
    /// Checkpoints that failed or could not be started.
    pub checkpoint_failures: u64,
    /// Upstream failures (unreachable, timed out, broken stream).
    pub upstream_errors: u64,
    /// Conversation-log write failures.
    pub log_errors: u64,
    /// The last failure.
    pub last_error: Option<String>,
    /// Connections to its in-sandbox endpoint refused because a connection cap was reached.
    #[serde(default)]
    pub refused_connections: u64,
    /// Requests refused for their body: too large, too slow, or no memory budget left.
    #[serde(default)]
    pub refused_requests: u64,
    /// Where its turns' exposed time went: total ms per stage (see [`HELD_HEADER`]).
    #[serde(default)]
    pub held_stages_ms: std::collections::BTreeMap<String, f64>,
}

struct TurnState {
    turn: u64,
    last_hash: Option<String>,
    ticket: Option<Arc<dyn BoundaryTicket>>,
    /// After a restore with replay: index of the next log record a request may be answered from.
    replay_cursor: Option<u64>,
}

struct Slot {
    name: String,
    log: Arc<Mutex<ConversationLog>>,
    turn: tokio::sync::Mutex<TurnState>,
    stats: Mutex<SandboxProxyStats>,
    /// Turn-request bytes this sandbox has in memory.
    bodies: ByteBudget,
}

impl Slot {
    fn stats(&self) -> MutexGuard<'_, SandboxProxyStats> {
        lock(&self.stats)
    }
    fn fail(&self, what: &str, msg: &str) {
        let mut s = self.stats();
        match what {
            "checkpoint" => s.checkpoint_failures += 1,
            "upstream" => s.upstream_errors += 1,
            _ => s.log_errors += 1,
        }
        s.last_error = Some(format!("{what}: {msg}"));
    }
}

use crab_common::sync::lock;

use crab_common::clock::now_ms;

/// What a gate waits for: the answer's release whole ([`BoundaryTicket::wait_published`]), or
/// a stream's head, its end held apart ([`BoundaryTicket::wait_checkpoint`]).
#[derive(Debug, Clone, Copy)]
enum Until {
    Ready,
    Checkpoint,
}

/// Whether a turn request asks for a stream (`"stream": true`; anything else is whole).
#[derive(serde::Deserialize)]
struct StreamFlag {
    #[serde(default)]
    stream: Option<serde_json::Value>,
}

/// The shape of a chat stream the proxy can make whole ([`crate::assemble`]).
#[derive(Debug, Clone, Copy)]
enum StreamShape {
    /// `/v1/chat/completions`.
    OpenAiChat,
    /// `/v1/messages`.
    AnthropicMessages,
}

impl StreamShape {
    fn of(path: &str) -> Option<StreamShape> {
        match path {
            "/v1/chat/completions" => Some(StreamShape::OpenAiChat),
            "/v1/messages" => Some(StreamShape::AnthropicMessages),
            _ => None,
        }
    }

    /// The request body asking for a stream (`"stream": true`; OpenAI's usage comes in a
    /// last chunk only when asked for), or `None` when the body is not a JSON object.
    fn streamed_request(self, body: &[u8]) -> Option<Bytes> {
        let mut v: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(body).ok()?;
        v.insert("stream".into(), serde_json::Value::Bool(true));
        if matches!(self, StreamShape::OpenAiChat) && !v.contains_key("stream_options") {
            v.insert("stream_options".into(), serde_json::json!({"include_usage": true}));
        }
        serde_json::to_vec(&v).ok().map(Bytes::from)
    }

    fn assemble(
        self,
        events: &[crate::assemble::SseEvent],
    ) -> Result<serde_json::Value, AssembleError> {
        match self {
            StreamShape::OpenAiChat => crate::assemble::openai_chat(events),
            StreamShape::AnthropicMessages => crate::assemble::anthropic_message(events),
        }
    }
}

/// The head of a stream the proxy makes into a whole answer.
struct StreamedAnswer {
    shape: StreamShape,
    status: StatusCode,
    headers: HeaderMap,
    head_at: Instant,
    up_name: String,
}

#[derive(Debug, Clone, Default)]
struct GateInfo {
    held: Duration,
    error: Option<HookError>,
    /// Where the held time went, by stage.
    stages: Vec<(String, f64)>,
}

enum Decision {
    Replay(Box<LogRecord>),
    Forward { turn: u64, ticket: Arc<dyn BoundaryTicket>, retry: bool },
}

/// The coordinator: owns the proxy, the per-sandbox turn state and conversation logs.
pub struct Coordinator {
    cfg: ProxyConfig,
    openai: Upstream,
    anthropic: Upstream,
    client: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    dir: Arc<dyn SandboxDirectory>,
    hooks: Arc<dyn TurnHooks>,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    held_samples: Mutex<VecDeque<f64>>,
    /// The newest turns' breakdowns (for `crab top`).
    breakdowns: Mutex<VecDeque<crab_common::stats::Breakdown>>,
    /// Connections over all listeners.
    conns: ConnGate,
    /// Turn-request bytes in memory over all sandboxes.
    bodies: ByteBudget,
    /// Connections refused at accept, per in-sandbox endpoint name ("" = host listeners).
    refused: Mutex<HashMap<String, u64>>,
    refused_total: AtomicU64,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("listen", &self.cfg.listen)
            .field("upstream_openai", &self.openai.url)
            .field("upstream_anthropic", &self.anthropic.url)
            .finish_non_exhaustive()
    }
}

/// A running proxy listener.
#[derive(Debug)]
pub struct ProxyServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl ProxyServer {
    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting connections (requests in flight finish on their own).
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Coordinator {
    /// A coordinator with the given configuration, sandbox directory and boundary hooks.
    pub fn new(
        cfg: ProxyConfig,
        dir: Arc<dyn SandboxDirectory>,
        hooks: Arc<dyn TurnHooks>,
    ) -> Result<Arc<Self>, CoordError> {
        let openai = Upstream::parse("openai", &cfg.upstream_openai)?;
        let anthropic = Upstream::parse("anthropic", &cfg.upstream_anthropic)?;
        if !cfg.allow_remote && !cfg.listen.ip().is_loopback() {
            return Err(ConfigError::NotLoopback(cfg.listen).into());
        }
        let conn = connector(&[&openai, &anthropic])?;
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(64)
            .build(conn);
        Ok(Arc::new(Coordinator {
            openai,
            anthropic,
            client,
            dir,
            hooks,
            slots: Mutex::new(HashMap::new()),
            held_samples: Mutex::new(VecDeque::new()),
            breakdowns: Mutex::new(VecDeque::new()),
            conns: ConnGate::new(cfg.max_connections),
            bodies: ByteBudget::new(cfg.max_buffered_bytes),
            refused: Mutex::new(HashMap::new()),
            refused_total: AtomicU64::new(0),
            cfg,
        }))
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.cfg
    }

    /// Bind the configured listen address and serve on it.
    pub async fn bind(self: &Arc<Self>) -> Result<ProxyServer, CoordError> {
        let addr = self.cfg.listen;
        let listener =
            TcpListener::bind(addr).await.map_err(|source| CoordError::Bind { addr, source })?;
        self.serve(listener)
    }

    /// Serve on an already bound listener.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> Result<ProxyServer, CoordError> {
        self.serve_inner(listener, None)
    }

    /// Serve one sandbox's private endpoint (e.g. a listener opened inside its network
    /// namespace with [`crate::bind_in_netns`]): every request on it is attributed to `sandbox`;
    /// a `/s/<sandbox>/` prefix naming it is accepted and stripped, one naming another sandbox is
    /// refused (403), and `X-Crab-Sandbox` is ignored.
    pub fn serve_sandbox(
        self: &Arc<Self>,
        listener: TcpListener,
        sandbox: &str,
    ) -> Result<ProxyServer, CoordError> {
        crab_common::names::validate("sandbox", sandbox)
            .map_err(|e| CoordError::BadName(e.message))?;
        self.serve_inner(listener, Some(Arc::from(sandbox)))
    }

    fn serve_inner(
        self: &Arc<Self>,
        listener: TcpListener,
        fixed: Option<Arc<str>>,
    ) -> Result<ProxyServer, CoordError> {
        let addr = listener
            .local_addr()
            .map_err(|source| CoordError::Bind { addr: self.cfg.listen, source })?;
        let (stop, mut stopped) = oneshot::channel::<()>();
        let me = self.clone();
        // In-sandbox endpoints have a cap of their own; host listeners share the global one.
        let local =
            ConnGate::new(if fixed.is_some() { self.cfg.max_sandbox_connections } else { 0 });
        tracing::info!(%addr, sandbox = fixed.as_deref().unwrap_or("*"), "LLM proxy listening");
        let bounds = crate::listener::Bounds {
            gates: vec![local.clone(), me.conns.clone()],
            header_read_timeout: me.cfg.header_read_timeout,
            drain: false,
            name: "llm-proxy",
        };
        let svc = {
            let (me, fixed) = (me.clone(), fixed.clone());
            hyper::service::service_fn(move |req| {
                let me = me.clone();
                let fixed = fixed.clone();
                async move { Ok::<_, Infallible>(me.handle_for(req, fixed).await) }
            })
        };
        let mut last_warn: Option<Instant> = None;
        let refuse = move |stream: &tokio::net::TcpStream, gate: usize| {
            me.refuse(stream, fixed.as_deref(), gate == 0, &local, &mut last_warn);
        };
        let task =
            tokio::spawn(crate::listener::serve(listener, bounds, svc, refuse, async move {
                let _ = (&mut stopped).await;
            }));
        Ok(ProxyServer { addr, stop: Some(stop), task })
    }

    /// Answer a connection past a cap with a JSON 503 and close it (it never gets a task).
    fn refuse(
        &self,
        stream: &tokio::net::TcpStream,
        sandbox: Option<&str>,
        local_full: bool,
        local: &ConnGate,
        last_warn: &mut Option<Instant>,
    ) {
        let (message, hint) = if local_full {
            (
                format!(
                    "sandbox {:?} has {} connections open to the LLM proxy, its limit",
                    sandbox.unwrap_or(""),
                    local.limit()
                ),
                "close idle connections (or reuse them: keep-alive) and retry",
            )
        } else {
            (
                format!("the LLM proxy has {} connections open, its limit", self.conns.limit()),
                "retry shortly",
            )
        };
        let body = error_json(ErrorCode::Busy, &message, hint).to_string();
        let _ = stream.try_write(&crate::limits::refusal_bytes(&body));
        self.refused_total.fetch_add(1, Ordering::Relaxed);
        *lock(&self.refused).entry(sandbox.unwrap_or("").to_string()).or_insert(0) += 1;
        if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
            *last_warn = Some(Instant::now());
            tracing::warn!(sandbox = sandbox.unwrap_or("*"), %message, "LLM proxy refused connections (security event when it is one sandbox)");
        }
    }

    /// Handle one request (what the listener calls; public for embedding in another server).
    pub async fn handle(self: &Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        self.handle_for(req, None).await
    }

    async fn handle_for(
        self: &Arc<Self>,
        req: Request<Incoming>,
        fixed: Option<Arc<str>>,
    ) -> Response<ProxyBody> {
        let me = self.clone();
        // Own task: a client that disconnects drops this future, not the gate or the log write.
        match tokio::spawn(async move { me.route(req, fixed).await }).await {
            Ok(r) => r,
            Err(e) => error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Internal,
                format!("the LLM proxy's request handler failed: {e}"),
                "",
            ),
        }
    }

    async fn route(
        self: Arc<Self>,
        req: Request<Incoming>,
        fixed: Option<Arc<str>>,
    ) -> Response<ProxyBody> {
        let requested_at = now_ms();
        let attributed = match &fixed {
            Some(sb) => attribute_fixed(&req, sb),
            None => attribute(&req),
        };
        let (sandbox, path_and_query) = match attributed {
            Ok(x) => x,
            Err(r) => return *r,
        };
        if let Err(e) = crab_common::names::validate("sandbox", &sandbox) {
            return error_response(StatusCode::BAD_REQUEST, e.code, e.message, &e.hint);
        }
        if !self.dir.exists(&sandbox) {
            return error_response(
                StatusCode::NOT_FOUND,
                ErrorCode::SandboxNotFound,
                format!("no sandbox named {sandbox:?}"),
                "check the sandbox in the base URL (/s/<sandbox>/...) or X-Crab-Sandbox; `crab sandbox ls` lists them",
            );
        }
        let path = path_and_query.split('?').next().unwrap_or("").to_string();
        let provider = if path.starts_with("/v1/messages")
            || req.headers().contains_key("anthropic-version")
        {
            Provider::Anthropic
        } else {
            Provider::OpenAi
        };
        let is_turn = req.method() == Method::POST
            && matches!(path.as_str(), "/v1/chat/completions" | "/v1/responses" | "/v1/messages");
        let slot = match self.slot(&sandbox).await {
            Ok(s) => s,
            Err(e) => {
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ErrorCode::Internal,
                    e.to_string(),
                    "",
                )
            }
        };
        slot.stats().requests += 1;
        if is_turn {
            self.turn_request(slot, provider, path_and_query, req, requested_at).await
        } else {
            slot.stats().non_turn += 1;
            self.passthrough(slot, provider, path_and_query, req).await
        }
    }

    fn upstream(&self, p: Provider) -> &Upstream {
        match p {
            Provider::OpenAi => &self.openai,
            Provider::Anthropic => &self.anthropic,
        }
    }

    async fn slot(&self, name: &str) -> Result<Arc<Slot>, CoordError> {
        if let Some(s) = lock(&self.slots).get(name) {
            return Ok(s.clone());
        }
        let path = self.dir.conversation_log_path(name);
        let log = tokio::task::spawn_blocking(move || ConversationLog::open(path))
            .await
            .map_err(|e| CoordError::Internal(e.to_string()))??;
        let state = TurnState {
            turn: log.last_turn(),
            last_hash: log.last_request_sha256().map(str::to_string),
            ticket: None,
            replay_cursor: None,
        };
        let slot = Arc::new(Slot {
            name: name.to_string(),
            log: Arc::new(Mutex::new(log)),
            stats: Mutex::new(SandboxProxyStats {
                sandbox: name.to_string(),
                turn: state.turn,
                ..Default::default()
            }),
            turn: tokio::sync::Mutex::new(state),
            bodies: ByteBudget::new(if self.cfg.max_sandbox_buffered_bytes == 0 {
                0
            } else {
                self.cfg.max_sandbox_buffered_bytes.max(self.cfg.max_request_bytes)
            }),
        });
        Ok(lock(&self.slots).entry(name.to_string()).or_insert(slot).clone())
    }

    async fn slot_checked(&self, sandbox: &str) -> Result<Arc<Slot>, CoordError> {
        crab_common::names::validate("sandbox", sandbox)
            .map_err(|e| CoordError::BadName(e.message))?;
        if !self.dir.exists(sandbox) {
            return Err(CoordError::UnknownSandbox(sandbox.to_string()));
        }
        self.slot(sandbox).await
    }

    async fn with_log<T: Send + 'static>(
        slot: &Slot,
        f: impl FnOnce(&mut ConversationLog) -> Result<T, LogError> + Send + 'static,
    ) -> Result<T, CoordError> {
        let log = slot.log.clone();
        tokio::task::spawn_blocking(move || f(&mut lock(&log)))
            .await
            .map_err(|e| CoordError::Internal(e.to_string()))?
            .map_err(CoordError::from)
    }

    async fn decide(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        hash: &str,
        retry_header: bool,
        provider: Provider,
        path: &str,
        streams: bool,
    ) -> Decision {
        let mut st = slot.turn.lock().await;
        if let Some(cursor) = st.replay_cursor {
            let h = hash.to_string();
            let same_as_last = st.last_hash.as_deref() == Some(hash) && cursor > 0;
            let res = Self::with_log(slot, move |log| {
                let hit = match log.request_sha256_at(cursor) {
                    Some((rh, ok)) if rh == h && ok => Some(cursor),
                    _ if same_as_last => Some(cursor - 1),
                    _ => None,
                };
                match hit {
                    Some(i) => Ok(Some((i, log.read(i)?, log.offset()))),
                    None => {
                        // The agent diverged from the logged future: drop it.
                        log.truncate_to(cursor)?;
                        Ok(None)
                    }
                }
            })
            .await;
            match res {
                Ok(Some((i, rec, len))) => {
                    st.replay_cursor = if i + 1 < len { Some(i + 1) } else { None };
                    st.turn = rec.turn;
                    slot.stats().turn = rec.turn;
                    st.last_hash = Some(hash.to_string());
                    st.ticket = None;
                    slot.stats().replays += 1;
                    return Decision::Replay(Box::new(rec));
                }
                Ok(None) => st.replay_cursor = None,
                Err(e) => {
                    tracing::warn!(sandbox = %slot.name, error = %e, "conversation replay failed; forwarding instead");
                    slot.fail("log", &e.to_string());
                    st.replay_cursor = None;
                }
            }
        }
        let retry = st.last_hash.as_deref() == Some(hash) || (retry_header && st.ticket.is_some());
        if retry {
            slot.stats().retries += 1;
            let ticket = st.ticket.clone().unwrap_or_else(|| ReadyTicket::published(""));
            return Decision::Forward { turn: st.turn, ticket, retry: true };
        }
        st.turn += 1;
        let turn = st.turn;
        // The boundary (verdict, job submission) runs beside the forwarded request: the agent
        // runs nothing while it waits for the LLM, so the sandbox is the same whenever the
        // verdict is taken, and the gate holds the answer until the checkpoint is published.
        let (deferred, tx) = DeferredTicket::new();
        let ticket = ReportingTicket::wrap(deferred.clone(), self.hooks.clone(), &slot.name, turn);
        let (me, bslot, bpath) = (self.clone(), slot.clone(), path.to_string());
        tokio::spawn(async move {
            let t0 = Instant::now();
            let real = me.boundary(&bslot, turn, provider, &bpath, streams).await;
            deferred.settle(&tx, real, t0, Instant::now());
        });
        st.last_hash = Some(hash.to_string());
        st.ticket = Some(ticket.clone());
        Decision::Forward { turn, ticket, retry: false }
    }

    /// The turn's boundary: the log made durable, then the hooks' ticket (or a settled failed
    /// one). Its callers hand out the ticket wrapped in a [`ReportingTicket`], so whatever
    /// fails is reported through [`TurnHooks::checkpoint_failed`] before a waiter sees it.
    async fn boundary(
        &self,
        slot: &Arc<Slot>,
        turn: u64,
        provider: Provider,
        path: &str,
        streams: bool,
    ) -> Arc<dyn BoundaryTicket> {
        // The records the turn's point will reference (every one before this request) become
        // durable first: the point is published only after them (invariant 1).
        if self.cfg.fsync_log && lock(&slot.log).has_unsynced() {
            if let Err(e) = Self::with_log(slot, |log| log.sync()).await {
                tracing::warn!(sandbox = %slot.name, turn, error = %e, "could not make the conversation log durable; no checkpoint this turn");
                slot.fail("log", &e.to_string());
                return ReadyTicket::failed(HookError::internal(format!(
                    "making the conversation log durable before turn {turn}'s checkpoint: {e}"
                )));
            }
        }
        let conversation_offset = lock(&slot.log).offset();
        let b = Boundary {
            sandbox: slot.name.clone(),
            turn,
            conversation_offset,
            provider,
            path: path.to_string(),
            streams,
        };
        {
            let mut s = slot.stats();
            s.turns += 1;
            s.turn = turn;
        }
        match self.hooks.on_boundary(b).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(sandbox = %slot.name, turn, error = %e, "could not start the turn's checkpoint");
                // Settled failure: the gate counts it, logs it with the turn and releases at once.
                ReadyTicket::failed(e.context(format!("starting the checkpoint of turn {turn}")))
            }
        }
    }

    async fn gate(
        &self,
        slot: &Slot,
        turn: u64,
        ticket: &Arc<dyn BoundaryTicket>,
        until: Until,
    ) -> GateInfo {
        let t0 = Instant::now();
        let settled = match until {
            Until::Ready => ticket.is_published(),
            Until::Checkpoint => ticket.is_checkpointed(),
        };
        let wait = || match until {
            Until::Ready => ticket.wait_published(),
            Until::Checkpoint => ticket.wait_checkpoint(),
        };
        let (held, res) = if settled {
            (false, wait().await)
        } else {
            ticket.promote();
            let r = match tokio::time::timeout(self.cfg.gate_timeout, wait()).await {
                Ok(r) => r,
                Err(_) => {
                    let e = HookError::new(
                        ErrorCode::Timeout,
                        format!(
                            "checkpoint not published within the gate timeout ({:?})",
                            self.cfg.gate_timeout
                        ),
                        "the response was released without its checkpoint; raise the proxy's gate timeout if checkpoints take this long",
                    );
                    // The ticket itself may still publish (or fail: reported then): the turn's
                    // response went out without it all the same.
                    self.hooks.checkpoint_failed(&slot.name, turn, &e);
                    Err(e)
                }
            };
            (true, r)
        };
        let woke = Instant::now();
        let held_d = if held { woke - t0 } else { Duration::ZERO };
        ticket.record_exposed(held_d);
        let stages = if held { ticket.held_breakdown(t0, woke) } else { Vec::new() };
        let ms = held_d.as_secs_f64() * 1e3;
        {
            let mut s = slot.stats();
            if held {
                s.held += 1;
            }
            s.held_ms_total += ms;
            s.held_ms_max = s.held_ms_max.max(ms);
        }
        {
            let mut h = lock(&self.held_samples);
            h.push_back(ms);
            while h.len() > 65536 {
                h.pop_front();
            }
        }
        let error = res.err();
        if let Some(e) = &error {
            tracing::warn!(sandbox = %slot.name, turn, error = %e, "turn checkpoint failed; releasing the response");
            slot.fail("checkpoint", &e.to_string());
        }
        GateInfo { held: held_d, error, stages }
    }

    /// Count a turn's breakdown (its held stages plus the log write) for `crab top`.
    fn record_breakdown(&self, slot: &Slot, b: &[(String, f64)]) {
        {
            let mut s = slot.stats();
            for (n, ms) in b {
                *s.held_stages_ms.entry(n.clone()).or_insert(0.0) += ms;
            }
        }
        let mut d = lock(&self.breakdowns);
        d.push_back(b.to_vec());
        while d.len() > 4096 {
            d.pop_front();
        }
    }

    /// Where the exposed time of the newest turns (up to 4096) went, stage by stage.
    pub fn held_stages(&self) -> Vec<crab_common::stats::StageSummary> {
        let d = lock(&self.breakdowns);
        crab_common::stats::stage_summaries(d.iter())
    }

    async fn turn_request(
        self: Arc<Self>,
        slot: Arc<Slot>,
        provider: Provider,
        path_and_query: String,
        req: Request<Incoming>,
        requested_at: u64,
    ) -> Response<ProxyBody> {
        let (parts, body) = req.into_parts();
        let limit = self.cfg.max_request_bytes;
        let declared = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            slot.stats().refused_requests += 1;
            return too_large(limit);
        }
        let (body, hold) =
            match read_body(body, limit, self.cfg.body_read_timeout, &[&slot.bodies, &self.bodies])
                .await
            {
                Ok(x) => x,
                Err(e) => {
                    slot.stats().refused_requests += 1;
                    return body_error(e, &slot.name);
                }
            };
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&body) {
            return error_response(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidRequest,
                format!("the request body is not valid JSON: {e}"),
                "send the provider's JSON request body",
            );
        }
        let streams = serde_json::from_slice::<StreamFlag>(&body)
            .ok()
            .and_then(|f| f.stream)
            .is_some_and(|v| v.as_bool() == Some(true));
        let path = path_and_query.split('?').next().unwrap_or("").to_string();
        // A whole answer asked of the upstream as a stream (its head wakes a parked sandbox
        // early); the agent gets it whole, assembled.
        let early = if !streams && self.cfg.stream_whole_answers {
            StreamShape::of(&path).and_then(|shape| Some((shape, shape.streamed_request(&body)?)))
        } else {
            None
        };
        let hash = sha256_hex(&body);
        let retry_header = parts
            .headers
            .get(RETRY_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0);
        let (turn, ticket, retry) = match self
            .decide(&slot, &hash, retry_header, provider, &path, streams || early.is_some())
            .await
        {
            Decision::Replay(rec) => {
                tracing::debug!(sandbox = %slot.name, turn = rec.turn, "answered from the conversation log");
                return replay_response(&rec);
            }
            Decision::Forward { turn, ticket, retry } => (turn, ticket, retry),
        };
        tracing::debug!(sandbox = %slot.name, turn, retry, %path, "turn request");
        let upstream = self.upstream(provider).clone();
        let upstream_req = match &early {
            Some((_, streamed)) => {
                // Another body, and one the proxy must read: no stale length, no encoding.
                let mut h = parts.headers.clone();
                h.remove(CONTENT_LENGTH);
                h.remove(hyper::header::ACCEPT_ENCODING);
                build_upstream_request(
                    &upstream,
                    &parts.method,
                    &path_and_query,
                    &h,
                    full(streamed.clone()),
                )
            }
            None => build_upstream_request(
                &upstream,
                &parts.method,
                &path_and_query,
                &parts.headers,
                full(body.clone()),
            ),
        };
        let upstream_req = match upstream_req {
            Ok(r) => r,
            Err(resp) => return *resp,
        };
        let sent =
            tokio::time::timeout(self.cfg.upstream_timeout, self.client.request(upstream_req))
                .await;
        let resp = match sent {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let msg = format!(
                    "upstream {} ({}) failed: {}",
                    upstream.provider,
                    upstream.url,
                    error_chain(&e)
                );
                slot.fail("upstream", &msg);
                self.gate(&slot, turn, &ticket, Until::Ready).await;
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    ErrorCode::Upstream,
                    msg,
                    &format!("check that --upstream-{} is reachable", upstream.provider),
                );
            }
            Err(_) => {
                let msg = format!(
                    "upstream {} ({}) sent no response within {:?}",
                    upstream.provider, upstream.url, self.cfg.upstream_timeout
                );
                slot.fail("upstream", &msg);
                self.gate(&slot, turn, &ticket, Until::Ready).await;
                return error_response(StatusCode::GATEWAY_TIMEOUT, ErrorCode::Timeout, msg, "");
            }
        };
        let head_at = Instant::now();
        let (rparts, rbody) = resp.into_parts();
        let is_stream = rparts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.trim_start().starts_with("text/event-stream"));
        let mut rec = LogRecord {
            turn,
            provider: provider.as_str().to_string(),
            method: parts.method.to_string(),
            path: path_and_query.clone(),
            request_sha256: hash,
            request: String::from_utf8_lossy(&body).into_owned(),
            status: rparts.status.as_u16(),
            response_headers: loggable_headers(&rparts.headers),
            response: None,
            response_b64: None,
            stream: is_stream,
            complete: false,
            client_disconnected: false,
            retry,
            requested_at_ms: requested_at,
            responded_at_ms: 0,
            held_ms: 0.0,
            checkpoint_error: None,
        };
        let mut headers = rparts.headers.clone();
        strip_hop_by_hop(&mut headers);
        if let Some((shape, _)) = early.filter(|_| is_stream && rparts.status.is_success()) {
            let up_name = format!("upstream {} ({})", upstream.provider, upstream.url);
            let answer = StreamedAnswer { shape, status: rparts.status, headers, head_at, up_name };
            return self.assembled_answer(&slot, turn, &ticket, answer, rbody, rec, hold).await;
        }
        if !is_stream {
            let max = self.cfg.max_response_bytes;
            let idle = self.cfg.stream_idle_timeout;
            let collect =
                async move { tokio::time::timeout(idle, Limited::new(rbody, max).collect()).await };
            let (gi, collected) =
                tokio::join!(self.gate(&slot, turn, &ticket, Until::Ready), collect);
            let bytes = match collected {
                Ok(Ok(c)) => c.to_bytes(),
                Ok(Err(e)) => {
                    let msg = format!(
                        "upstream {} ({}) broke off its response: {e}",
                        upstream.provider, upstream.url
                    );
                    slot.fail("upstream", &msg);
                    return error_response(StatusCode::BAD_GATEWAY, ErrorCode::Upstream, msg, "");
                }
                Err(_) => {
                    let msg = format!(
                        "upstream {} ({}) stalled while sending its response",
                        upstream.provider, upstream.url
                    );
                    slot.fail("upstream", &msg);
                    return error_response(
                        StatusCode::GATEWAY_TIMEOUT,
                        ErrorCode::Timeout,
                        msg,
                        "",
                    );
                }
            };
            ticket.answer_done(head_at.elapsed());
            rec.complete = true;
            rec.set_response_body(&bytes);
            rec.held_ms = gi.held.as_secs_f64() * 1e3;
            rec.checkpoint_error = gi.error.map(|e| e.to_string());
            rec.responded_at_ms = now_ms();
            let t_log = Instant::now();
            self.append_log(&slot, rec).await;
            let mut stages = gi.stages;
            stages.push(("convlog_write".into(), t_log.elapsed().as_secs_f64() * 1e3));
            self.record_breakdown(&slot, &stages);
            drop(hold);
            let mut resp = Response::new(full(bytes));
            *resp.status_mut() = rparts.status;
            *resp.headers_mut() = headers;
            set_held_header(resp.headers_mut(), &stages);
            return resp;
        }
        // Stream: a pump task reads upstream into a channel from now on; the head is released
        // after the gate (the turn's checkpoint); the log record is written before the body's
        // end is. Until the ticket is checkpointed and ready (its sandbox may park, or is
        // parked: the wake is under way or timed from the head) the pump keeps the newest frame
        // back, so whatever ends the answer (`[DONE]`, `message_stop`, the last chunk) goes out
        // only once it is.
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(64);
        let (gate_tx, gate_rx) = oneshot::channel::<GateInfo>();
        let hold: BodyHold = hold;
        let me = self.clone();
        let pslot = slot.clone();
        let idle = self.cfg.stream_idle_timeout;
        let up_name = format!("upstream {} ({})", upstream.provider, upstream.url);
        let pticket = ticket.clone();
        tokio::spawn(async move {
            let mut body = rbody;
            let mut buf = Vec::new();
            let mut disconnected = false;
            let mut complete = false;
            let mut kept: Option<Frame<Bytes>> = None;
            loop {
                match tokio::time::timeout(idle, body.frame()).await {
                    Ok(None) => {
                        complete = true;
                        break;
                    }
                    Ok(Some(Ok(frame))) => {
                        if let Some(d) = frame.data_ref() {
                            buf.extend_from_slice(d);
                        }
                        // Before the checkpoint is settled its sandbox may yet park (the
                        // gate holds these frames anyway).
                        let out = if pticket.is_checkpointed() && pticket.is_ready() {
                            [kept.take(), Some(frame)]
                        } else {
                            [kept.replace(frame), None]
                        };
                        for f in out.into_iter().flatten() {
                            if !disconnected && tx.send(Ok(f)).await.is_err() {
                                disconnected = true;
                            }
                        }
                    }
                    Ok(Some(Err(e))) => {
                        let msg = format!("{up_name} broke off its stream: {e}");
                        pslot.fail("upstream", &msg);
                        if let Some(f) = kept.take() {
                            let _ = tx.send(Ok(f)).await;
                        }
                        let _ = tx.send(Err(msg.into())).await;
                        break;
                    }
                    Err(_) => {
                        let msg = format!("{up_name} stream was silent for {idle:?}");
                        pslot.fail("upstream", &msg);
                        if let Some(f) = kept.take() {
                            let _ = tx.send(Ok(f)).await;
                        }
                        let _ = tx.send(Err(msg.into())).await;
                        break;
                    }
                }
            }
            if complete {
                pticket.answer_done(head_at.elapsed());
            }
            let gi = gate_rx.await.unwrap_or_default();
            let ended = until_ready(pticket.as_ref(), &pslot.name, turn).await;
            rec.complete = complete;
            rec.client_disconnected = disconnected;
            rec.set_response_body(&buf);
            rec.held_ms = (gi.held + ended).as_secs_f64() * 1e3;
            rec.checkpoint_error = gi.error.map(|e| e.to_string());
            rec.responded_at_ms = now_ms();
            me.append_log(&pslot, rec).await;
            if let Some(f) = kept {
                if !disconnected {
                    let _ = tx.send(Ok(f)).await;
                }
            }
            drop(hold);
            drop(tx);
        });
        let gi = self.gate(&slot, turn, &ticket, Until::Checkpoint).await;
        ticket.head_released();
        let stages = gi.stages.clone();
        self.record_breakdown(&slot, &stages);
        let _ = gate_tx.send(gi);
        let mut resp = Response::new(ChannelBody { rx }.boxed_unsync());
        *resp.status_mut() = rparts.status;
        *resp.headers_mut() = headers;
        set_held_header(resp.headers_mut(), &stages);
        resp
    }

    /// A whole answer the upstream streamed ([`ProxyConfig::stream_whole_answers`]): the gate
    /// waits for the turn's checkpoint beside the stream, then the head times a parked
    /// sandbox's wake; the answer assembled from the stream's events goes out once the sandbox
    /// is ready, logged as the whole answer the agent got (a replay gives the same bytes).
    #[allow(clippy::too_many_arguments)]
    async fn assembled_answer(
        &self,
        slot: &Arc<Slot>,
        turn: u64,
        ticket: &Arc<dyn BoundaryTicket>,
        answer: StreamedAnswer,
        rbody: Incoming,
        mut rec: LogRecord,
        hold: BodyHold,
    ) -> Response<ProxyBody> {
        let StreamedAnswer { shape, status, mut headers, head_at, up_name } = answer;
        let (max, idle) = (self.cfg.max_response_bytes, self.cfg.stream_idle_timeout);
        let gate = async {
            let gi = self.gate(slot, turn, ticket, Until::Checkpoint).await;
            ticket.head_released();
            gi
        };
        let collect = async move {
            let mut body = rbody;
            let mut buf = Vec::new();
            loop {
                match tokio::time::timeout(idle, body.frame()).await {
                    Ok(None) => return Ok((buf, Instant::now())),
                    Ok(Some(Ok(frame))) => {
                        if let Some(d) = frame.data_ref() {
                            if buf.len() + d.len() > max {
                                return Err((
                                    StatusCode::BAD_GATEWAY,
                                    format!("streamed more than the proxy's {max} bytes of answer"),
                                ));
                            }
                            buf.extend_from_slice(d);
                        }
                    }
                    Ok(Some(Err(e))) => {
                        return Err((StatusCode::BAD_GATEWAY, format!("broke off its stream: {e}")))
                    }
                    Err(_) => {
                        return Err((
                            StatusCode::GATEWAY_TIMEOUT,
                            format!("stream was silent for {idle:?}"),
                        ))
                    }
                }
            }
        };
        let (gi, collected) = tokio::join!(gate, collect);
        let (buf, ended_at) = match collected {
            Ok(b) => b,
            Err((code, what)) => {
                let msg = format!("{up_name} {what}");
                slot.fail("upstream", &msg);
                let kind = if code == StatusCode::GATEWAY_TIMEOUT {
                    ErrorCode::Timeout
                } else {
                    ErrorCode::Upstream
                };
                return error_response(code, kind, msg, "");
            }
        };
        // The answer's lead: from its head to its end, not to the checkpoint it waited for.
        ticket.answer_done(ended_at.saturating_duration_since(head_at));
        let events = crate::assemble::sse_events(&buf);
        let (status, body) = match shape.assemble(&events) {
            Ok(v) => (status, v),
            // The error the stream carried, as the upstream answers it to a whole request.
            Err(AssembleError::Upstream { status, body }) => {
                (StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY), body)
            }
            Err(e) => {
                let msg = format!("{up_name} streamed an answer that cannot be made whole: {e}");
                slot.fail("upstream", &msg);
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    ErrorCode::Upstream,
                    msg,
                    "to forward whole requests as they are, start the daemon with --stream-whole-answers off",
                );
            }
        };
        let bytes = Bytes::from(body.to_string());
        let ended = until_ready(ticket.as_ref(), &slot.name, turn).await;
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.remove(CONTENT_LENGTH);
        headers.remove(hyper::header::CACHE_CONTROL);
        rec.status = status.as_u16();
        rec.response_headers = loggable_headers(&headers);
        rec.stream = false;
        rec.complete = true;
        rec.set_response_body(&bytes);
        rec.held_ms = (gi.held + ended).as_secs_f64() * 1e3;
        rec.checkpoint_error = gi.error.map(|e| e.to_string());
        rec.responded_at_ms = now_ms();
        let t_log = Instant::now();
        self.append_log(slot, rec).await;
        let mut stages = gi.stages;
        stages.push(("convlog_write".into(), t_log.elapsed().as_secs_f64() * 1e3));
        self.record_breakdown(slot, &stages);
        drop(hold);
        let mut resp = Response::new(full(bytes));
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        set_held_header(resp.headers_mut(), &stages);
        resp
    }

    /// Append a turn's record. It is written before the answer is released but fsynced at the
    /// sandbox's next turn boundary (see [`Coordinator::boundary`]), before any restore point
    /// can reference it, so the fsync waits inside the next LLM call instead of in front of
    /// the agent.
    async fn append_log(&self, slot: &Slot, rec: LogRecord) {
        let res = Self::with_log(slot, move |log| log.append_unsynced(&rec)).await;
        match res {
            Ok(n) => slot.stats().conversation_offset = n,
            Err(e) => {
                tracing::error!(sandbox = %slot.name, error = %e, "conversation log append failed");
                slot.fail("log", &e.to_string());
            }
        }
    }

    async fn passthrough(
        self: Arc<Self>,
        slot: Arc<Slot>,
        provider: Provider,
        path_and_query: String,
        req: Request<Incoming>,
    ) -> Response<ProxyBody> {
        let (parts, body) = req.into_parts();
        let upstream = self.upstream(provider).clone();
        let body = DeadlineBody::new(body, self.cfg.body_read_timeout).boxed_unsync();
        let upstream_req = match build_upstream_request(
            &upstream,
            &parts.method,
            &path_and_query,
            &parts.headers,
            body,
        ) {
            Ok(r) => r,
            Err(resp) => return *resp,
        };
        match tokio::time::timeout(self.cfg.upstream_timeout, self.client.request(upstream_req))
            .await
        {
            Ok(Ok(resp)) => {
                let (mut rparts, rbody) = resp.into_parts();
                strip_hop_by_hop(&mut rparts.headers);
                Response::from_parts(rparts, rbody.map_err(BoxError::from).boxed_unsync())
            }
            Ok(Err(e)) => {
                let msg = format!(
                    "upstream {} ({}) failed: {}",
                    upstream.provider,
                    upstream.url,
                    error_chain(&e)
                );
                slot.fail("upstream", &msg);
                error_response(StatusCode::BAD_GATEWAY, ErrorCode::Upstream, msg, "")
            }
            Err(_) => {
                let msg = format!(
                    "upstream {} ({}) sent no response within {:?}",
                    upstream.provider, upstream.url, self.cfg.upstream_timeout
                );
                slot.fail("upstream", &msg);
                error_response(StatusCode::GATEWAY_TIMEOUT, ErrorCode::Timeout, msg, "")
            }
        }
    }

    // ----- API for the daemon -----

    /// Mark a turn boundary explicitly (`POST /sandboxes/{id}/turns`): same bookkeeping as an
    /// LLM request, without one. Returns the ticket to wait on.
    pub async fn begin_turn(
        &self,
        sandbox: &str,
    ) -> Result<(u64, Arc<dyn BoundaryTicket>), CoordError> {
        let slot = self.slot_checked(sandbox).await?;
        let mut st = slot.turn.lock().await;
        st.turn += 1;
        let turn = st.turn;
        let ticket = self.boundary(&slot, turn, Provider::OpenAi, "", false).await;
        let ticket = ReportingTicket::wrap(ticket, self.hooks.clone(), sandbox, turn);
        st.ticket = Some(ticket.clone());
        st.last_hash = None;
        Ok((turn, ticket))
    }

    /// Current conversation-log offset of a sandbox (record count).
    pub async fn conversation_offset(&self, sandbox: &str) -> Result<u64, CoordError> {
        let slot = self.slot_checked(sandbox).await?;
        let n = lock(&slot.log).offset();
        Ok(n)
    }

    /// The conversation of a sandbox up to `offset` (all of it when `None`).
    pub async fn conversation(
        &self,
        sandbox: &str,
        offset: Option<u64>,
    ) -> Result<Vec<LogRecord>, CoordError> {
        let slot = self.slot_checked(sandbox).await?;
        Self::with_log(&slot, move |log| {
            let n = offset.unwrap_or(log.offset());
            log.read_until(n)
        })
        .await
    }

    /// The sandbox was restored to a point that recorded conversation offset `offset`.
    /// With `replay`, the log is kept and the agent's re-sent requests are answered from it in
    /// order until one differs (then the rest is dropped); without, the log is cut at `offset`.
    pub async fn restored(
        &self,
        sandbox: &str,
        offset: u64,
        replay: bool,
    ) -> Result<(), CoordError> {
        let slot = self.slot_checked(sandbox).await?;
        let mut st = slot.turn.lock().await;
        let (turn, last_hash, len) = Self::with_log(&slot, move |log| {
            if offset > log.offset() {
                return Err(LogError::OffsetOutOfRange {
                    path: log.path().to_path_buf(),
                    offset,
                    len: log.offset(),
                });
            }
            if !replay {
                log.truncate_to(offset)?;
            }
            let turn = if offset == 0 { 0 } else { log.turn_at(offset - 1).unwrap_or(0) };
            let hash = if offset == 0 {
                None
            } else {
                log.request_sha256_at(offset - 1).map(|(h, _)| h.to_string())
            };
            Ok((turn, hash, log.offset()))
        })
        .await?;
        st.turn = turn;
        slot.stats().turn = turn;
        st.last_hash = last_hash;
        st.ticket = None;
        st.replay_cursor = if replay && offset < len { Some(offset) } else { None };
        slot.stats().conversation_offset = if replay { len } else { offset };
        Ok(())
    }

    /// A fork `dst` of `src` at conversation offset `offset`: `dst`'s log becomes the prefix.
    pub async fn forked(&self, src: &str, dst: &str, offset: u64) -> Result<(), CoordError> {
        let s = self.slot_checked(src).await?;
        crab_common::names::validate("sandbox", dst).map_err(|e| CoordError::BadName(e.message))?;
        let dst_path = self.dir.conversation_log_path(dst);
        lock(&self.slots).remove(dst);
        Self::with_log(&s, move |log| log.copy_prefix_to(offset, &dst_path).map(|_| ())).await
    }

    /// Forget a removed sandbox's in-memory state (its log file stays where it is).
    pub fn forget(&self, sandbox: &str) {
        lock(&self.slots).remove(sandbox);
    }

    /// Per-sandbox counters.
    pub fn stats(&self) -> Vec<SandboxProxyStats> {
        let slots: Vec<Arc<Slot>> = lock(&self.slots).values().cloned().collect();
        let mut v: Vec<SandboxProxyStats> = slots
            .iter()
            .map(|s| {
                let mut st = s.stats().clone();
                st.conversation_offset = lock(&s.log).offset();
                st.refused_connections = lock(&self.refused).get(&s.name).copied().unwrap_or(0);
                st
            })
            .collect();
        v.sort_by(|a, b| a.sandbox.cmp(&b.sandbox));
        v
    }

    /// Held times (ms) of the most recent responses, including zeros for ones not held.
    pub fn held_samples_ms(&self) -> Vec<f64> {
        lock(&self.held_samples).iter().copied().collect()
    }

    /// Prometheus text of the proxy's per-sandbox counters.
    pub fn metrics_text(&self) -> String {
        let stats = self.stats();
        let mut out = String::new();
        let series: [Series; 12] = [
            ("crab_proxy_requests_total", "counter", "Requests proxied.", |s| s.requests as f64),
            ("crab_proxy_turns_total", "counter", "Turn boundaries marked.", |s| s.turns as f64),
            ("crab_proxy_retries_total", "counter", "Retries recognised as the same turn.", |s| {
                s.retries as f64
            }),
            (
                "crab_proxy_replays_total",
                "counter",
                "Requests answered from the conversation log.",
                |s| s.replays as f64,
            ),
            ("crab_proxy_held_total", "counter", "Responses held for a checkpoint.", |s| {
                s.held as f64
            }),
            ("crab_proxy_held_seconds_total", "counter", "Time responses were held.", |s| {
                s.held_ms_total / 1e3
            }),
            (
                "crab_proxy_checkpoint_failures_total",
                "counter",
                "Turn checkpoints that failed.",
                |s| s.checkpoint_failures as f64,
            ),
            ("crab_proxy_upstream_errors_total", "counter", "Upstream failures.", |s| {
                s.upstream_errors as f64
            }),
            ("crab_proxy_log_errors_total", "counter", "Conversation-log write failures.", |s| {
                s.log_errors as f64
            }),
            ("crab_proxy_conversation_records", "gauge", "Records in the conversation log.", |s| {
                s.conversation_offset as f64
            }),
            (
                "crab_proxy_refused_connections_total",
                "counter",
                "Connections to the sandbox's endpoint refused at a connection cap.",
                |s| s.refused_connections as f64,
            ),
            (
                "crab_proxy_refused_requests_total",
                "counter",
                "Requests refused for their body (too large, too slow, no memory budget).",
                |s| s.refused_requests as f64,
            ),
        ];
        for (name, kind, help, f) in series {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for s in &stats {
                let _ = writeln!(out, "{name}{{sandbox=\"{}\"}} {}", s.sandbox, f(s));
            }
        }
        let _ = writeln!(
            out,
            "# HELP crab_proxy_connections Open LLM-proxy connections (all listeners).\n# TYPE crab_proxy_connections gauge\ncrab_proxy_connections {}",
            self.conns.in_use()
        );
        let _ = writeln!(
            out,
            "# HELP crab_proxy_connections_refused_total Connections refused at a connection cap (all listeners).\n# TYPE crab_proxy_connections_refused_total counter\ncrab_proxy_connections_refused_total {}",
            self.refused_total.load(Ordering::Relaxed)
        );
        out
    }
}

type Series = (&'static str, &'static str, &'static str, fn(&SandboxProxyStats) -> f64);

/// The upstream connector: plain TCP for http://, rustls (ring, system roots) for https://.
fn connector(upstreams: &[&Upstream]) -> Result<HttpsConnector<HttpConnector>, ConfigError> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    http.set_connect_timeout(Some(Duration::from_secs(10)));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = match HttpsConnectorBuilder::new()
        .with_provider_and_native_roots(provider.clone())
    {
        Ok(b) => b,
        Err(e) => {
            if let Some(u) = upstreams.iter().find(|u| u.is_https()) {
                return Err(ConfigError::NoTlsRoots {
                    provider: u.provider,
                    reason: e.to_string(),
                });
            }
            // Only http:// upstreams: TLS is never used, an empty root store will do.
            let cfg = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ConfigError::NoTlsRoots { provider: "any", reason: e.to_string() })?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth();
            HttpsConnectorBuilder::new().with_tls_config(cfg)
        }
    };
    Ok(builder.https_or_http().enable_http1().wrap_connector(http))
}

/// An early answer instead of a forwarded request.
type Reject = Box<Response<ProxyBody>>;

/// `(sandbox, path_and_query)` on a sandbox's private endpoint.
fn attribute_fixed<B>(req: &Request<B>, sandbox: &str) -> Result<(String, String), Reject> {
    let uri = req.uri();
    let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    let path = match uri.path().strip_prefix("/s/") {
        Some(rest) => {
            let (name, tail) = rest.split_once('/').unwrap_or((rest, ""));
            if name != sandbox {
                return Err(Box::new(error_response(
                    StatusCode::FORBIDDEN,
                    ErrorCode::InvalidRequest,
                    format!("this endpoint belongs to sandbox {sandbox:?}, not {name:?}"),
                    "inside a sandbox, use the base URL without /s/<sandbox>",
                )));
            }
            format!("/{tail}")
        }
        None => uri.path().to_string(),
    };
    Ok((sandbox.to_string(), format!("{path}{query}")))
}

/// `(sandbox, path_and_query)` from `/s/<sandbox>/...` or the `X-Crab-Sandbox` header.
fn attribute<B>(req: &Request<B>) -> Result<(String, String), Reject> {
    let uri = req.uri();
    let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    if let Some(rest) = uri.path().strip_prefix("/s/") {
        let (name, tail) = rest.split_once('/').unwrap_or((rest, ""));
        return Ok((name.to_string(), format!("/{tail}{query}")));
    }
    match req.headers().get(SANDBOX_HEADER).map(|v| v.to_str()) {
        Some(Ok(name)) => Ok((name.trim().to_string(), format!("{}{query}", uri.path()))),
        Some(Err(_)) => Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            "the X-Crab-Sandbox header is not text".into(),
            "",
        ))),
        None => Err(Box::new(error_response(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            format!("no sandbox named in request {}", uri.path()),
            "use the base URL http://<proxy>/s/<sandbox>/v1 or send X-Crab-Sandbox: <sandbox>",
        ))),
    }
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

fn strip_hop_by_hop(h: &mut HeaderMap) {
    let drop: Vec<HeaderName> = h.keys().filter(|k| is_hop_by_hop(k)).cloned().collect();
    for k in drop {
        h.remove(k);
    }
}

/// An answer's end waits for its sandbox to be ready (a parked one woken); a wake that fails
/// left it stopped with its error (the agent's next call says so), and the answer goes out.
/// How long it waited.
async fn until_ready(ticket: &dyn BoundaryTicket, sandbox: &str, turn: u64) -> Duration {
    if ticket.is_ready() {
        return Duration::ZERO;
    }
    let t = Instant::now();
    if let Err(e) = ticket.wait_ready().await {
        tracing::warn!(sandbox, turn, error = %e, "the sandbox did not wake for its answer's end");
    }
    t.elapsed()
}

fn loggable_headers(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .filter(|(k, _)| !is_hop_by_hop(k) && *k != "set-cookie" && *k != CONTENT_LENGTH)
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect()
}

fn build_upstream_request(
    upstream: &Upstream,
    method: &Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: ProxyBody,
) -> Result<Request<ProxyBody>, Reject> {
    let uri = upstream.uri_for(path_and_query).map_err(|e| {
        Box::new(error_response(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            format!("cannot forward path {path_and_query:?}: {e}"),
            "",
        ))
    })?;
    let mut req = Request::new(body);
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri;
    let h = req.headers_mut();
    for (k, v) in headers {
        if is_hop_by_hop(k) || k == hyper::header::HOST || k == SANDBOX_HEADER {
            continue;
        }
        h.append(k.clone(), v.clone());
    }
    if let Ok(host) = HeaderValue::from_str(upstream.authority.as_str()) {
        h.insert(hyper::header::HOST, host);
    }
    Ok(req)
}

fn replay_response(rec: &LogRecord) -> Response<ProxyBody> {
    let mut resp = Response::new(full(rec.response_body()));
    *resp.status_mut() = StatusCode::from_u16(rec.status).unwrap_or(StatusCode::OK);
    let h = resp.headers_mut();
    for (k, v) in &rec.response_headers {
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
            h.append(k, v);
        }
    }
    h.insert(REPLAYED_HEADER, HeaderValue::from_static("1"));
    resp
}

pub(crate) fn full(b: impl Into<Bytes>) -> ProxyBody {
    Full::new(b.into()).map_err(|never: Infallible| match never {}).boxed_unsync()
}

fn too_large(limit: usize) -> Response<ProxyBody> {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::TooLarge,
        format!("the request body exceeds the proxy's limit of {limit} bytes"),
        "shorten the conversation or raise the proxy's max_request_bytes",
    )
}

fn body_error(e: BodyReadError, sandbox: &str) -> Response<ProxyBody> {
    match e {
        BodyReadError::TooLarge(limit) => too_large(limit),
        BodyReadError::Timeout(t) => error_response(
            StatusCode::REQUEST_TIMEOUT,
            ErrorCode::RequestTimeout,
            format!("the request body did not arrive within {t:?}"),
            "send the whole body at once",
        ),
        BodyReadError::Busy => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Busy,
            format!(
                "sandbox {sandbox:?} (or the proxy as a whole) has its budget of request bytes in memory in use"
            ),
            "wait for the requests in flight to finish, then retry",
        ),
        BodyReadError::Read(m) => error_response(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            format!("reading the request body failed: {m}"),
            "",
        ),
    }
}

/// Put a turn's breakdown on its response ([`HELD_HEADER`]).
fn set_held_header(h: &mut HeaderMap, stages: &[(String, f64)]) {
    if let Ok(v) = HeaderValue::from_str(&crab_common::stats::breakdown_header(stages)) {
        h.insert(HeaderName::from_static(HELD_HEADER), v);
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let _ = write!(s, ": {c}");
        cur = c.source();
    }
    s
}

/// An error body that is both the project's `ApiError` (top-level `code`, `message`, `hint`)
/// and the shape both SDK families parse (`{"type":"error","error":{...}}`).
fn error_json(code: ErrorCode, message: &str, hint: &str) -> serde_json::Value {
    serde_json::json!({
        "code": code.as_str(),
        "message": message,
        "hint": hint,
        "type": "error",
        "error": {"type": code.as_str(), "code": code.as_str(), "message": message, "hint": hint},
    })
}

/// An error answer ([`error_json`]) with its status.
pub(crate) fn error_response(
    status: StatusCode,
    code: ErrorCode,
    message: String,
    hint: &str,
) -> Response<ProxyBody> {
    let body = error_json(code, &message, hint);
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp.headers_mut().insert("x-crab-error", HeaderValue::from_static(code.as_str()));
    resp
}

/// A response body fed by a channel.
struct ChannelBody {
    rx: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx.poll_recv(cx)
    }
}
