//! The API server on `<state>/crab.sock`, bounded like the LLM proxy: at most
//! `max_connections` connections at once (sized by the daemon's file-descriptor budget; one
//! past it gets a JSON 503 and is closed), a header-read timeout (also the idle limit of a
//! kept-alive connection), a deadline on reading a request body, a body-size cap, and every
//! error the HTTP layer makes itself (413, 408, a body that failed to arrive) answered as the
//! JSON `ApiError`. On shutdown it stops accepting and asks each connection to finish its
//! request in flight.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crab_common::{ApiError, ErrorCode};
use crab_coordinator::limits::{refusal_bytes, ConnGate, DeadlineBody};

/// Largest API request body: an `exec -i` stdin of up to ~48 MiB travels base64-encoded in it.
pub const API_MAX_BODY: usize = 64 << 20;

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
    /// The defaults for `max_connections` connections.
    pub fn new(max_connections: usize) -> ApiLimits {
        ApiLimits {
            max_connections,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(120),
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
    let body_timeout = limits.body_read_timeout;
    let app = app
        .layer(axum::middleware::map_response(json_errors))
        .layer(axum::middleware::map_request(move |req: Request| async move {
            req.map(|b| Body::new(DeadlineBody::new(b, Some(body_timeout))))
        }))
        .layer(DefaultBodyLimit::max(limits.max_body_bytes));
    let gate = ConnGate::new(limits.max_connections);
    let mut conns = tokio::task::JoinSet::new();
    let mut stopping = stop.clone();
    let mut last_warn: Option<std::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = stopped(&mut stopping) => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE/ENFILE: the descriptors are gone for now; back off instead of spinning.
                tracing::warn!(error = %e, "API accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        let Some(permit) = gate.try_enter() else {
            let e = ApiError::new(
                ErrorCode::Busy,
                format!("the daemon has {} API connections open, its limit", gate.limit()),
                "retry shortly; close idle clients",
            );
            let _ =
                stream.try_write(&refusal_bytes(&serde_json::to_string(&e).unwrap_or_default()));
            if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                last_warn = Some(std::time::Instant::now());
                tracing::warn!(limit = gate.limit(), "API connections refused at the cap");
            }
            continue;
        };
        let svc = TowerToHyperService::new(app.clone());
        let mut stop = stop.clone();
        conns.spawn(async move {
            let _permit = permit;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let res = tokio::select! {
                r = conn.as_mut() => r,
                () = stopped(&mut stop) => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = res {
                tracing::debug!(error = %e, "API connection ended with an error");
            }
        });
    }
    while conns.join_next().await.is_some() {}
}

async fn stopped(rx: &mut watch::Receiver<bool>) {
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
        StatusCode::PAYLOAD_TOO_LARGE => {
            (ErrorCode::TooLarge, format!("API request bodies are limited to {API_MAX_BODY} bytes"))
        }
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
