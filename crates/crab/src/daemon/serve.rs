//! The API server on `<state>/crab.sock` and the E2B port, on the same bounded listener as the
//! LLM proxy (`crab_coordinator::listener`): at most
//! `max_connections` connections at once (sized by the daemon's file-descriptor budget; one
//! past it gets a JSON 503 and is closed), a header-read timeout (also the idle limit of a
//! kept-alive connection), a deadline on the time spent waiting for a request body's client
//! (`--http-body-timeout`, plus a second per MiB received, so a 1 GiB upload into a slow
//! command has time and a trickle does not: `PacedBody`), a
//! size cap on bodies read whole (JSON; streamed bodies — files, tars, stdin — are bounded by
//! `--max-upload` in their routes), and every error the HTTP layer makes itself (413, 408, a
//! body that failed to arrive) answered as the JSON `ApiError`. On shutdown it stops accepting
//! and asks each connection to finish its request in flight.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::service::TowerToHyperService;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crab_common::{ApiError, ErrorCode};
use crab_coordinator::limits::{refusal_bytes, ConnGate, PacedBody};
use crab_coordinator::listener;

/// Largest API request body read whole (a JSON request: an exec's `stdin_b64` of up to ~48 MiB
/// travels base64-encoded in it; larger stdin streams, as files do).
pub const API_MAX_BODY: usize = 64 << 20;
/// Past the base body deadline, a client must keep its body coming at this rate: each this many
/// bytes received buys one more second of waiting for it (`PacedBody`; time the route spends
/// not reading — a slow command's stdin — does not count).
pub const MIN_BODY_RATE: u64 = 1 << 20;

/// Bounds of the API server.
#[derive(Debug, Clone, Copy)]
pub struct ApiLimits {
    /// Concurrent connections.
    pub max_connections: usize,
    /// Longest a client may take to send a request head, or sit idle between requests.
    pub header_read_timeout: Duration,
    /// Longest a client may take to send a request body.
    pub body_read_timeout: Duration,
    /// Largest request body.
    pub max_body_bytes: usize,
}

impl ApiLimits {
    /// `max_connections` connections with the daemon's timeouts.
    pub fn new(max_connections: usize, http: &super::HttpOptions) -> ApiLimits {
        ApiLimits {
            max_connections,
            header_read_timeout: http.header_timeout,
            body_read_timeout: http.body_timeout,
            max_body_bytes: API_MAX_BODY,
        }
    }
}

/// Serve `app` on `listener` until `stop` turns true; returns once every connection ended.
pub async fn serve(
    listener: UnixListener,
    app: Router,
    limits: ApiLimits,
    stop: watch::Receiver<bool>,
) {
    let app = bounded(app.layer(axum::middleware::map_response(json_errors)), &limits);
    let gate = ConnGate::new(limits.max_connections);
    let bounds = listener::Bounds {
        gates: vec![gate.clone()],
        header_read_timeout: Some(limits.header_read_timeout),
        drain: true,
        name: "api",
    };
    let limit = gate.limit();
    let refuse = refuser::<UnixListener>("API", move || {
        let e = ApiError::new(
            ErrorCode::Busy,
            format!("the daemon has {limit} API connections open, its limit"),
            "retry shortly; close idle clients",
        );
        serde_json::to_string(&e).unwrap_or_default()
    });
    let svc = TowerToHyperService::new(app);
    listener::serve(listener, bounds, svc, refuse, stopped(stop)).await;
}

/// Serve the E2B-compatible `app` on `listener` with the same bounds as the API socket (its
/// own connection cap, from the descriptor budget), until `stop` turns true. A connection past
/// the cap gets E2B's error shape (`{"code": 503, "message"}`).
pub async fn serve_e2b(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ApiLimits,
    stop: watch::Receiver<bool>,
) {
    let app = bounded(app, &limits);
    let gate = ConnGate::new(limits.max_connections);
    let bounds = listener::Bounds {
        gates: vec![gate.clone()],
        header_read_timeout: Some(limits.header_read_timeout),
        drain: true,
        name: "e2b",
    };
    let limit = gate.limit();
    let refuse = refuser::<tokio::net::TcpListener>("E2B", move || {
        let m = format!("the E2B API has {limit} connections open, its limit; retry shortly");
        serde_json::json!({ "code": 503, "message": m }).to_string()
    });
    let svc = TowerToHyperService::new(app);
    listener::serve(listener, bounds, svc, refuse, stopped(stop)).await;
}

/// What a connection past the cap gets: a 503 with `body()` (JSON), then closed; a warning in
/// the log at most every 5 s.
fn refuser<L: listener::Accept>(
    what: &'static str,
    body: impl Fn() -> String + Send,
) -> impl FnMut(&L::Stream, usize) + Send {
    let mut last_warn: Option<std::time::Instant> = None;
    move |stream, _gate| {
        L::try_write(stream, &refusal_bytes(&body()));
        if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
            last_warn = Some(std::time::Instant::now());
            tracing::warn!(door = what, "connections refused at the cap");
        }
    }
}

/// `app` with the body deadline and the body-size cap of `limits`.
fn bounded(app: Router, limits: &ApiLimits) -> Router {
    let body_timeout = limits.body_read_timeout;
    app.layer(axum::middleware::map_request(move |req: Request| async move {
        req.map(|b| Body::new(PacedBody::new(b, body_timeout, MIN_BODY_RATE)))
    }))
    .layer(DefaultBodyLimit::max(limits.max_body_bytes))
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Answers the HTTP layer made itself (body too large, body read failed or timed out) are
/// plain text; turn every non-JSON error answer into the JSON `ApiError` its status means.
async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.contains("json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let text = match resp.into_body().collect().await {
        Ok(b) => String::from_utf8_lossy(&b.to_bytes()).trim().to_string(),
        Err(e) => e.to_string(),
    };
    let (code, hint) = match status {
        StatusCode::PAYLOAD_TOO_LARGE => (
            ErrorCode::TooLarge,
            format!("JSON request bodies are limited to {API_MAX_BODY} bytes; stream large stdin (an exec's stdin_session and an application/octet-stream body to .../exec/SESSION/stdin) and files (PUT .../files) instead"),
        ),
        StatusCode::REQUEST_TIMEOUT => (ErrorCode::RequestTimeout, String::new()),
        _ if text.contains("did not arrive within") => {
            (ErrorCode::RequestTimeout, "send the whole request body at once".to_string())
        }
        s if s.is_client_error() => (ErrorCode::InvalidRequest, String::new()),
        _ => (ErrorCode::Internal, String::new()),
    };
    let e = ApiError::new(code, if text.is_empty() { status.to_string() } else { text }, hint);
    let status = StatusCode::from_u16(code.http_status()).unwrap_or(status);
    let body = serde_json::to_vec(&e).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}
