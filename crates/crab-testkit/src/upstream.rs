//! Test doubles for the LLM proxy, shared by its tests, the proxy benchmarks and the daemon's
//! integration tests: a stub LLM upstream (a real HTTP server with configurable delay, status and SSE
//! streaming, recording what it received), an in-memory [`SandboxDirectory`], and
//! [`InstantHooks`], boundary hooks whose checkpoints are published at once.

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crab_coordinator::convlog::sha256_hex;
use crab_coordinator::{
    Boundary, BoundaryTicket, BoxError, BoxFuture, HookError, ProxyBody, ReadyTicket,
    SandboxDirectory, TurnHooks,
};

fn full(b: impl Into<Bytes>) -> ProxyBody {
    http_body_util::Full::new(b.into()).map_err(|never: Infallible| match never {}).boxed_unsync()
}

/// Request header overriding the stub's head delay for one request, in milliseconds.
pub const DELAY_HEADER: &str = "x-stub-delay-ms";
/// Request header: a streamed answer's events spread over this many ms after its head (the
/// model generating its output).
pub const STREAM_MS_HEADER: &str = "x-stub-stream-ms";
/// Request header overriding the stub's status for one request.
pub const STATUS_HEADER: &str = "x-stub-status";

/// How the stub answers.
#[derive(Debug, Clone, PartialEq)]
pub struct StubConfig {
    /// Delay before the response head (the model "thinking").
    pub delay: Duration,
    /// Status of every response.
    pub status: u16,
    /// Events in a streamed response.
    pub stream_events: usize,
    /// Delay between streamed chunks.
    pub chunk_delay: Duration,
}

impl Default for StubConfig {
    fn default() -> Self {
        StubConfig {
            delay: Duration::ZERO,
            status: 200,
            stream_events: 5,
            chunk_delay: Duration::ZERO,
        }
    }
}

/// A request as the stub received it.
#[derive(Debug, Clone)]
pub struct StubRequest {
    /// Method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Headers, lower-case names.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Bytes,
    /// When it arrived.
    pub at: Instant,
}

impl StubRequest {
    /// First value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Default)]
struct StubState {
    cfg: Mutex<StubConfig>,
    requests: Mutex<Vec<StubRequest>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    crab_common::sync::lock(m)
}

/// A stub LLM upstream on `127.0.0.1:<ephemeral>`.
///
/// Any `POST` whose JSON body has `"stream": true` gets an SSE stream ([`stream_chunks`], or
/// [`messages_stream_chunks`] under `/v1/messages`), its events spread over the request's
/// [`STREAM_MS_HEADER`] after the head; a whole answer with that header comes after the head
/// delay and that time;
/// `.../count_tokens` gets `{"input_tokens": N}`; anything else gets a small JSON completion
/// naming the request body's sha256.
#[derive(Debug)]
pub struct StubUpstream {
    addr: SocketAddr,
    state: Arc<StubState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StubUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The exact chunks of a streamed stub chat completion (`/v1/chat/completions` and every
/// path but `/v1/messages`) with `n` content events: OpenAI's `chat.completion.chunk`s (a role
/// chunk, `n` content deltas [`stream_text`], a finish chunk, a usage chunk, `[DONE]`). Chunk
/// boundaries fall inside events and inside a multi-byte character, so re-chunking bugs show.
pub fn stream_chunks(n: usize) -> Vec<Bytes> {
    let chunk = |rest: &str| {
        format!(
            "data: {{\"id\":\"stub\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"stub\",{rest}}}\n\n"
        )
    };
    let mut all = chunk(r#""choices":[{"index":0,"delta":{"role":"assistant","content":""}}]"#);
    for i in 0..n {
        all += &chunk(&format!(r#""choices":[{{"index":0,"delta":{{"content":"tök{i} "}}}}]"#));
    }
    all += &chunk(r#""choices":[{"index":0,"delta":{},"finish_reason":"stop"}]"#);
    all += &chunk(&format!(
        r#""choices":[],"usage":{{"prompt_tokens":1,"completion_tokens":{n},"total_tokens":{}}}"#,
        n + 1
    ));
    all += "data: [DONE]\n\n";
    split(all.as_bytes())
}

/// The exact chunks of a streamed stub Anthropic message (`/v1/messages`) with `n` text
/// deltas ([`stream_text`]): `message_start`, one text block, `message_delta`, `message_stop`.
pub fn messages_stream_chunks(n: usize) -> Vec<Bytes> {
    let ev = |t: &str, d: &str| {
        let sep = if d.is_empty() { "" } else { "," };
        format!("event: {t}\ndata: {{\"type\":\"{t}\"{sep}{d}}}\n\n")
    };
    let mut all = ev(
        "message_start",
        r#""message":{"id":"msg_stub","type":"message","role":"assistant","model":"stub","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":1,"output_tokens":1}}"#,
    );
    all += &ev("content_block_start", r#""index":0,"content_block":{"type":"text","text":""}"#);
    for i in 0..n {
        all += &ev(
            "content_block_delta",
            &format!(r#""index":0,"delta":{{"type":"text_delta","text":"tök{i} "}}"#),
        );
    }
    all += &ev("content_block_stop", r#""index":0"#);
    all += &ev(
        "message_delta",
        &format!(
            r#""delta":{{"stop_reason":"end_turn","stop_sequence":null}},"usage":{{"output_tokens":{n}}}"#
        ),
    );
    all += &ev("message_stop", "");
    split(all.as_bytes())
}

/// The text of a stub stream with `n` content events, whole.
pub fn stream_text(n: usize) -> String {
    (0..n).map(|i| format!("tök{i} ")).collect()
}

fn split(all: &[u8]) -> Vec<Bytes> {
    all.chunks(61).map(Bytes::copy_from_slice).collect()
}

/// The JSON body the stub answers a non-stream request with.
pub fn completion_body(request_body: &[u8]) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "id": "stub",
            "object": "chat.completion",
            "request_sha256": sha256_hex(request_body),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        })
        .to_string(),
    )
}

impl StubUpstream {
    /// Start it.
    pub async fn start(cfg: StubConfig) -> std::io::Result<StubUpstream> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(StubState { cfg: Mutex::new(cfg), requests: Mutex::new(Vec::new()) });
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let _ = stream.set_nodelay(true);
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        async move { Ok::<_, Infallible>(answer(st, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(StubUpstream { addr, state, task })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Change how it answers.
    pub fn set_config(&self, cfg: StubConfig) {
        *lock(&self.state.cfg) = cfg;
    }

    /// Everything received so far.
    pub fn requests(&self) -> Vec<StubRequest> {
        lock(&self.state.requests).clone()
    }
}

async fn answer(st: Arc<StubState>, req: Request<Incoming>) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let at = Instant::now();
    let headers = parts
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect::<Vec<_>>();
    let path = parts.uri.path_and_query().map(|p| p.to_string()).unwrap_or_default();
    lock(&st.requests).push(StubRequest {
        method: parts.method.to_string(),
        path: path.clone(),
        headers,
        body: body.clone(),
        at,
    });
    let mut cfg = lock(&st.cfg).clone();
    let header = |name: &str| {
        parts.headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(ms) = header(DELAY_HEADER) {
        cfg.delay = Duration::from_millis(ms);
    }
    let spread = header(STREAM_MS_HEADER).map(Duration::from_millis);
    if let Some(s) = header(STATUS_HEADER) {
        cfg.status = u16::try_from(s).unwrap_or(500);
    }
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let streams = json.get("stream").and_then(|v| v.as_bool()) == Some(true);
    // A whole answer comes once the model would have generated all of it.
    if let Some(d) = spread.filter(|_| !streams) {
        cfg.delay += d;
    }
    if !cfg.delay.is_zero() {
        tokio::time::sleep(cfg.delay).await;
    }
    let status = hyper::StatusCode::from_u16(cfg.status).unwrap_or(hyper::StatusCode::OK);
    let mut resp = if path.contains("count_tokens") {
        Response::new(full(format!("{{\"input_tokens\":{}}}", body.len() / 4)))
    } else if streams {
        let chunks = if path.starts_with("/v1/messages") {
            messages_stream_chunks(cfg.stream_events)
        } else {
            stream_chunks(cfg.stream_events)
        };
        let gap = spread.map_or(cfg.chunk_delay, |d| d / chunks.len().max(1) as u32);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        tokio::spawn(async move {
            // Each chunk at its own time from the start: sleeps' overshoot does not add up.
            let t0 = tokio::time::Instant::now();
            for (k, c) in chunks.into_iter().enumerate() {
                if !gap.is_zero() {
                    tokio::time::sleep_until(t0 + gap * (k as u32 + 1)).await;
                }
                if tx.send(Ok(Frame::data(c))).await.is_err() {
                    return;
                }
            }
        });
        let mut r = Response::new(RecvBody { rx }.boxed_unsync());
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        *r.status_mut() = status;
        return r;
    } else {
        Response::new(full(completion_body(&body)))
    };
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A body fed by a channel.
struct RecvBody {
    rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
}

impl hyper::body::Body for RecvBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx.poll_recv(cx)
    }
}

/// A fixed set of sandbox names; logs under `root/<name>/conversation.log`.
#[derive(Debug)]
pub struct MemoryDirectory {
    names: Mutex<HashSet<String>>,
    root: PathBuf,
}

impl MemoryDirectory {
    /// A directory with these sandboxes, logging under `root`.
    pub fn new(root: impl Into<PathBuf>, names: &[&str]) -> Arc<Self> {
        Arc::new(MemoryDirectory {
            names: Mutex::new(names.iter().map(|s| s.to_string()).collect()),
            root: root.into(),
        })
    }

    /// Add a sandbox.
    pub fn add(&self, name: &str) {
        lock(&self.names).insert(name.to_string());
    }
}

impl SandboxDirectory for MemoryDirectory {
    fn exists(&self, name: &str) -> bool {
        lock(&self.names).contains(name)
    }
    fn conversation_log_path(&self, name: &str) -> PathBuf {
        self.root.join(name).join("conversation.log")
    }
}

/// Boundary hooks whose checkpoints are published immediately; they remember each boundary.
#[derive(Debug, Default)]
pub struct InstantHooks {
    boundaries: Mutex<Vec<Boundary>>,
}

impl InstantHooks {
    /// New.
    pub fn new() -> Arc<Self> {
        Arc::new(InstantHooks::default())
    }

    /// Boundaries seen so far.
    pub fn boundaries(&self) -> Vec<Boundary> {
        lock(&self.boundaries).clone()
    }
}

impl TurnHooks for InstantHooks {
    fn on_boundary(
        &self,
        b: Boundary,
    ) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, HookError>> {
        let id = format!("{}-{}", b.sandbox, b.turn);
        lock(&self.boundaries).push(b);
        Box::pin(async move { Ok(ReadyTicket::published(id)) })
    }

    /// Never called: every ticket is published.
    fn checkpoint_failed(&self, _sandbox: &str, _turn: u64, _error: &HookError) {}
}
