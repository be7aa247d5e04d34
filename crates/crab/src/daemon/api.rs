//! The HTTP routes of the daemon and the plumbing every handler shares: JSON bodies with typed
//! errors, streamed NDJSON responses, and a [`Progress`] that forwards to a stream.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tokio_stream::StreamExt;

use crab_common::api::{FeatureStatus, Features, ProgressFrame, VersionInfo, API_VERSION};
use crab_common::{ApiError, Progress};

use super::{checkpoints, images, inspect, remote, sandboxes, Daemon};

/// The daemon's routes.
pub fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/v1/version", get(version))
        .route("/v1/images", get(images::list))
        .route("/v1/images/build", post(images::build))
        .route("/v1/images/import", post(images::import))
        .route("/v1/images/{name}", delete(images::remove))
        .route("/v1/sandboxes", get(sandboxes::list).post(sandboxes::create))
        .route("/v1/sandboxes/{name}", get(sandboxes::get).delete(sandboxes::remove))
        .route("/v1/sandboxes/{name}/exec", post(sandboxes::exec))
        .route("/v1/sandboxes/{name}/inspect", get(inspect::peek).post(inspect::close))
        .route("/v1/sandboxes/{name}/checkpoints", get(checkpoints::list).post(checkpoints::create))
        .route("/v1/sandboxes/{name}/checkpoints/prune", post(checkpoints::prune))
        .route("/v1/sandboxes/{name}/restore", post(checkpoints::restore))
        .route("/v1/sandboxes/{name}/fork", post(checkpoints::fork))
        .route("/v1/sandboxes/{name}/conversation", get(checkpoints::conversation))
        .route("/v1/sandboxes/{name}/turns", post(checkpoints::turn))
        .route("/v1/remote/points", get(remote::ls))
        .route("/v1/remote/check", post(remote::check))
        .route("/v1/remote/prune", post(remote::prune))
        .route("/v1/remote/wait", get(remote::wait))
        .route("/v1/remote/restore", post(remote::restore))
        .route("/v1/metrics", get(metrics))
        .route("/metrics", get(metrics))
        .route("/v1/top", get(top))
        .fallback(not_found)
        .with_state(d)
}

async fn version(axum::extract::State(d): axum::extract::State<Arc<Daemon>>) -> Response {
    // Runs `criu swrk` once: off the async threads.
    let criu = blocking(|| Ok(criu_status().clone())).await.ok();
    ok(&VersionInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        api: API_VERSION,
        state_dir: d.runtime.state().root().display().to_string(),
        pid: std::process::id(),
        features: Features {
            soft_dirty: Some(FeatureStatus {
                available: d.soft_dirty.available,
                reason: d.soft_dirty.reason.clone(),
            }),
            criu,
            remote: Some(match &d.remote {
                Some(t) => FeatureStatus { available: true, reason: t.repo.url().to_string() },
                None => FeatureStatus {
                    available: false,
                    reason: "no --remote store configured".into(),
                },
            }),
        },
        proxy_listen: Some(d.coordinator.config().listen.to_string()),
    })
}

/// Whether CRIU is installed and answers (asked once, on the first `GET /v1/version`).
fn criu_status() -> &'static FeatureStatus {
    static STATUS: std::sync::OnceLock<FeatureStatus> = std::sync::OnceLock::new();
    STATUS.get_or_init(|| {
        match crab_criu::Criu::locate().and_then(|c| c.version().map(|v| (c, v))) {
            Ok((c, v)) => FeatureStatus {
                available: true,
                reason: format!("criu {v} at {}", c.path().display()),
            },
            Err(e) => FeatureStatus { available: false, reason: e.to_string() },
        }
    })
}

async fn metrics(axum::extract::State(d): axum::extract::State<Arc<Daemon>>) -> Response {
    let mut text = d.coordinator.metrics_text();
    text.push_str(&d.engine().metrics_text());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn top(axum::extract::State(d): axum::extract::State<Arc<Daemon>>) -> Response {
    ok(&serde_json::json!({
        "proxy": d.coordinator.stats(),
        "engine": d.engine().stats(),
    }))
}

async fn not_found(uri: axum::http::Uri) -> Response {
    err(ApiError::invalid(format!("no API route {uri}"), "see docs/api.md for the routes"))
        .into_response_with(StatusCode::NOT_FOUND)
}

trait WithStatus {
    fn into_response_with(self, s: StatusCode) -> Response;
}
impl WithStatus for Response {
    fn into_response_with(mut self, s: StatusCode) -> Response {
        *self.status_mut() = s;
        self
    }
}

/// A JSON 200 response.
pub fn ok<T: Serialize>(v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(b) => ([(axum::http::header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => err(ApiError::internal(format!("encoding response: {e}"))),
    }
}

/// An error response with the status its code maps to.
pub fn err(e: ApiError) -> Response {
    if e.code.http_status() >= 500 {
        tracing::warn!(code = e.code.as_str(), message = %e.message, "request failed");
    } else {
        tracing::info!(code = e.code.as_str(), message = %e.message, "request refused");
    }
    let status =
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = serde_json::to_vec(&e).unwrap_or_default();
    (status, [(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Decode a JSON request body into `T`, with a 400 naming the problem.
pub fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!("malformed request body: {e}"),
            "send a JSON object as documented in docs/api.md",
        )
    })
}

/// Run a blocking runtime call off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("handler panicked: {e}"))))
}

/// A streamed NDJSON response fed from a bounded channel.
pub fn ndjson<T: Serialize + Send + 'static>(rx: mpsc::Receiver<T>) -> Response {
    let stream = ReceiverStream::new(rx).map(line::<T>);
    ndjson_response(Body::from_stream(stream))
}

fn line<T: Serialize>(v: T) -> Result<Bytes, Infallible> {
    let mut b = serde_json::to_vec(&v).unwrap_or_default();
    b.push(b'\n');
    Ok(Bytes::from(b))
}

fn ndjson_response(body: Body) -> Response {
    Response::builder()
        .header(axum::http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(body)
        .unwrap_or_else(|e| err(ApiError::internal(e.to_string())))
}

/// A [`Progress`] that forwards to a stream of [`ProgressFrame`]s.
#[derive(Debug)]
pub struct StreamProgress(mpsc::UnboundedSender<ProgressFrame>);

impl Progress for StreamProgress {
    fn stage(&self, name: &str, total: Option<u64>) {
        let _ = self.0.send(ProgressFrame::Stage { name: name.to_string(), total });
    }
    fn advance(&self, done: u64) {
        let _ = self.0.send(ProgressFrame::Advance { done });
    }
    fn message(&self, line: &str) {
        let _ = self.0.send(ProgressFrame::Message { line: line.to_string() });
    }
}

/// Run a long blocking operation, streaming its progress and then its result.
pub fn long_operation<T: Serialize + 'static>(
    f: impl FnOnce(&dyn Progress) -> Result<T, ApiError> + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::task::spawn_blocking(move || {
        let p = StreamProgress(tx.clone());
        let frame = match f(&p).and_then(|v| {
            serde_json::to_value(v).map_err(|e| ApiError::internal(format!("encoding result: {e}")))
        }) {
            Ok(result) => ProgressFrame::Done { result },
            Err(error) => ProgressFrame::Error { error },
        };
        let _ = tx.send(frame);
    });
    ndjson_response(Body::from_stream(UnboundedReceiverStream::new(rx).map(line::<ProgressFrame>)))
}
