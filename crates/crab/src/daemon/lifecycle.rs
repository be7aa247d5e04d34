//! Lifecycle routes beyond create/stop/start/remove: pause, resume, park, wake, kill (E2B's: retire when
//! labelled points must outlive it, else remove), replace (by another sandbox's point or a
//! remote one, in place), the cheap status of one sandbox, and the labels of restore points. Each parses, calls one host action and renders it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;

use crab_common::api::{LabelRequest, ReplaceRequest, ResumeRequest};
use crab_host::{Action, Host};

use super::api::{err, parse, parse_or_default, render};

/// `POST /v1/sandboxes/{name}/pause`.
pub async fn pause(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Pause { name }).await)
}

/// `POST /v1/sandboxes/{name}/park`.
pub async fn park(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Park { name }).await)
}

/// `POST /v1/sandboxes/{name}/wake`.
pub async fn wake(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Wake { name }).await)
}

/// `POST /v1/sandboxes/{name}/resume`.
pub async fn resume(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ResumeRequest = match parse_or_default(&body) {
        Ok(r) => r,
        Err(e) => return err(e.into_api()),
    };
    let timeout =
        match crab_host::timeout_set(req.timeout_s, req.on_timeout.as_deref(), req.extend_only) {
            Ok(t) => t,
            Err(e) => return err(e.into_api()),
        };
    render(h.execute(Action::Resume { name, ensure: req.ensure, timeout }).await)
}

/// `POST /v1/sandboxes/{name}/kill`.
pub async fn kill(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Kill { name }).await)
}

/// `GET /v1/sandboxes/{name}/status`.
pub async fn status(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Status { name }).await)
}

/// `POST /v1/sandboxes/{name}/checkpoints/{id}/labels`.
pub async fn label(
    State(h): State<Arc<Host>>,
    Path((name, point)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let req: LabelRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::LabelPoint { name, point, labels: req.labels }).await)
}

/// `GET /v1/labels`.
pub async fn labels(State(h): State<Arc<Host>>) -> Response {
    render(h.execute(Action::Labels).await)
}

/// `DELETE /v1/labels/{label}`.
pub async fn delete_label(State(h): State<Arc<Host>>, Path(label): Path<String>) -> Response {
    render(h.execute(Action::DeleteLabel { label }).await)
}

/// `POST /v1/sandboxes/{name}/replace`.
pub async fn replace(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: ReplaceRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let a = Action::Replace { name, source: req.source, remote: req.remote, fs_only: req.fs_only };
    render(h.execute(a).await)
}
