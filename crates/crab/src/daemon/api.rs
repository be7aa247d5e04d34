//! The HTTP routes of the daemon and the plumbing every handler shares: JSON bodies with typed
//! errors, streamed NDJSON responses, a [`Progress`] that forwards to a stream, and [`render`],
//! which turns a host [`Outcome`] into a response. Handlers parse a request into an
//! [`crab_host::Action`], call [`Host::execute`], and render; none imports another's module.

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

use crab_common::api::ProgressFrame;
use crab_common::{ApiError, Progress};
use crab_host::{Action, Host, HostError, Outcome};

use super::{checkpoints, files, images, inspect, lifecycle, procs, remote, sandboxes};

/// `crab daemon --max-upload`: the largest body a route streams into a sandbox (a file, a tar,
/// an exec's stdin), handed to the handlers as an extension.
#[derive(Debug, Clone, Copy)]
pub struct UploadLimit(pub u64);

impl UploadLimit {
    /// The 413 of a body past the limit, naming it and the flag that raises it.
    pub fn too_large(&self) -> ApiError {
        ApiError::new(
            crab_common::ErrorCode::TooLarge,
            format!(
                "the request body is larger than the daemon's upload limit of {} bytes",
                self.0
            ),
            "raise it with `crab daemon --max-upload SIZE` (e.g. 8G), or send the data in parts",
        )
    }

    /// Refuse at once a body whose `Content-Length` passes the limit.
    pub fn check_declared(&self, headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
        let declared = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        match declared {
            Some(n) if n > self.0 => Err(self.too_large()),
            _ => Ok(()),
        }
    }
}

/// The daemon's routes; `max_upload` bounds the bodies they stream into sandboxes.
pub fn router(d: Arc<Host>, max_upload: u64) -> Router {
    Router::new()
        .route("/v1/version", get(version))
        .route("/v1/images", get(images::list))
        .route("/v1/images/build", post(images::build))
        .route("/v1/images/import", post(images::import))
        .route("/v1/images/commit", post(images::commit))
        .route("/v1/images/pull", post(images::pull))
        .route("/v1/images/push", post(images::push))
        .route("/v1/images/{name}", delete(images::remove))
        .route("/v1/sandboxes", get(sandboxes::list).post(sandboxes::create))
        .route(
            "/v1/sandboxes/{name}",
            get(sandboxes::get).delete(sandboxes::remove).patch(sandboxes::update),
        )
        .route("/v1/sandboxes/{name}/exec", post(sandboxes::exec))
        .route("/v1/sandboxes/{name}/exec/{session}/stdin", post(sandboxes::exec_stdin))
        .route("/v1/sandboxes/{name}/exec/{session}/attach", post(sandboxes::exec_attach))
        .route("/v1/sandboxes/{name}/procs", get(procs::list).post(procs::start))
        .route("/v1/sandboxes/{name}/procs/{id}", get(procs::get))
        .route("/v1/sandboxes/{name}/procs/{id}/output", get(procs::output))
        .route("/v1/sandboxes/{name}/procs/{id}/stdin", post(procs::stdin))
        .route("/v1/sandboxes/{name}/procs/{id}/close-stdin", post(procs::close_stdin))
        .route("/v1/sandboxes/{name}/procs/{id}/signal", post(procs::signal))
        .route("/v1/sandboxes/{name}/stop", post(sandboxes::stop))
        .route("/v1/sandboxes/{name}/start", post(sandboxes::start))
        .route("/v1/sandboxes/{name}/pause", post(lifecycle::pause))
        .route("/v1/sandboxes/{name}/park", post(lifecycle::park))
        .route("/v1/sandboxes/{name}/wake", post(lifecycle::wake))
        .route("/v1/sandboxes/{name}/resume", post(lifecycle::resume))
        .route("/v1/sandboxes/{name}/kill", post(lifecycle::kill))
        .route("/v1/sandboxes/{name}/replace", post(lifecycle::replace))
        .route("/v1/sandboxes/{name}/status", get(lifecycle::status))
        .route("/v1/sandboxes/{name}/checkpoints/{id}/labels", post(lifecycle::label))
        .route("/v1/labels", get(lifecycle::labels))
        .route("/v1/labels/{label}", delete(lifecycle::delete_label))
        .route(
            "/v1/sandboxes/{name}/files",
            get(files::read).put(files::write).delete(files::remove),
        )
        .route("/v1/sandboxes/{name}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{name}/files/list", get(files::list))
        .route("/v1/sandboxes/{name}/files/mkdir", post(files::mkdir))
        .route("/v1/sandboxes/{name}/files/rename", post(files::rename))
        .route("/v1/sandboxes/{name}/files/tar", get(files::tar_out).put(files::tar_in))
        .route("/v1/sandboxes/{name}/inspect", get(inspect::peek).post(inspect::close))
        .route("/v1/sandboxes/{name}/checkpoints", get(checkpoints::list).post(checkpoints::create))
        .route("/v1/sandboxes/{name}/checkpoints/prune", post(checkpoints::prune))
        .route("/v1/sandboxes/{name}/restore", post(checkpoints::restore))
        .route("/v1/sandboxes/{name}/fork", post(checkpoints::fork))
        .route("/v1/sandboxes/{name}/conversation", get(checkpoints::conversation))
        .route("/v1/sandboxes/{name}/turns", post(checkpoints::turn))
        .route("/v1/sandboxes/{name}/harness/changed", post(checkpoints::harness_changed))
        .route("/v1/metrics", get(metrics))
        .route("/metrics", get(metrics))
        .route("/v1/top", get(top))
        .route("/v1/remote/points", get(remote::ls))
        .route("/v1/remote/check", post(remote::check))
        .route("/v1/remote/prune", post(remote::prune))
        .route("/v1/remote/wait", get(remote::wait))
        .route("/v1/remote/restore", post(remote::restore))
        .route("/v1/remote/follow", get(remote::follow_status).post(remote::follow))
        .fallback(not_found)
        .layer(axum::Extension(UploadLimit(max_upload)))
        .with_state(d)
}

async fn version(axum::extract::State(h): axum::extract::State<Arc<Host>>) -> Response {
    render(h.execute(Action::Version).await)
}

async fn metrics(axum::extract::State(h): axum::extract::State<Arc<Host>>) -> Response {
    render(h.execute(Action::Metrics).await)
}

async fn top(axum::extract::State(h): axum::extract::State<Arc<Host>>) -> Response {
    render(h.execute(Action::Top).await)
}

/// The response for what the host answered: JSON, an NDJSON stream (exec) or Prometheus text.
pub fn render(r: Result<Outcome, HostError>) -> Response {
    match r {
        Ok(Outcome::Exec(rx)) => ndjson(rx),
        Ok(Outcome::Metrics(text)) => {
            ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
                .into_response()
        }
        Ok(o) => ok(&o),
        Err(e) => err(e.into_api()),
    }
}

/// Decode a JSON request body into `T`; an empty body is `T::default()`.
pub fn parse_or_default<T: DeserializeOwned + Default>(body: &Bytes) -> Result<T, HostError> {
    if body.is_empty() {
        Ok(T::default())
    } else {
        Ok(parse(body)?)
    }
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
/// A `StdinWrite` body (`{"d": base64, "eof": ..}`) and its decoded bytes.
pub fn parse_stdin(body: &Bytes) -> Result<(crab_common::api::StdinWrite, Vec<u8>), ApiError> {
    use base64::Engine as _;
    let req: crab_common::api::StdinWrite = parse(body)?;
    let data = base64::engine::general_purpose::STANDARD.decode(&req.d).map_err(|e| {
        ApiError::invalid(format!("d is not base64: {e}"), "send the bytes base64-encoded in \"d\"")
    })?;
    Ok((req, data))
}

pub fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!("malformed request body: {e}"),
            "send a JSON object as documented in docs/api.md",
        )
    })
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

/// Whether the client asked for progress (`?progress=true` or `?progress=1`).
pub fn wants_progress(q: &std::collections::HashMap<String, String>) -> bool {
    q.get("progress").is_some_and(|v| v == "true" || v == "1")
}

/// Answer `action`: with `progress`, as a stream of its stages ending in the answer
/// ([`long_operation`] over [`Action::WithProgress`]); else the one plain JSON answer (clients
/// that do not ask — the SDK, scripts — see no difference).
pub async fn maybe_streamed(h: Arc<Host>, action: Action, progress: bool) -> Response {
    if progress {
        long_operation(h, move |progress| Action::WithProgress {
            action: Box::new(action),
            progress,
        })
    } else {
        render(h.execute(action).await)
    }
}

/// Run a long action that reports progress (`make` builds it around the progress sink),
/// streaming the progress and then the outcome.
pub fn long_operation(
    h: Arc<Host>,
    make: impl FnOnce(Box<dyn Progress>) -> Action + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::unbounded_channel();
    let progress = Box::new(StreamProgress(tx.clone()));
    tokio::spawn(async move {
        let frame =
            match h.execute(make(progress)).await.map_err(HostError::into_api).and_then(|o| {
                serde_json::to_value(o)
                    .map_err(|e| ApiError::internal(format!("encoding result: {e}")))
            }) {
                Ok(result) => ProgressFrame::Done { result },
                Err(error) => ProgressFrame::Error { error },
            };
        let _ = tx.send(frame);
    });
    ndjson_response(Body::from_stream(UnboundedReceiverStream::new(rx).map(line::<ProgressFrame>)))
}
