//! Sandbox routes: create, list, describe, update (checkpoint policy), remove, stop, start, exec (streamed), an exec session's stdin.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::Response;

use crab_common::api::{ExecRequest, SandboxCreateRequest, SandboxUpdateRequest, StopRequest};
use crab_host::{Action, Host};

use super::api::{err, parse, parse_or_default, parse_stdin, render};

pub async fn list(State(h): State<Arc<Host>>) -> Response {
    render(h.execute(Action::ListSandboxes).await)
}

pub async fn get(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::GetSandbox { name }).await)
}

pub async fn create(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: SandboxCreateRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::Create(req)).await)
}

pub async fn update(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: SandboxUpdateRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::Update { name, req }).await)
}

pub async fn remove(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let force = q.get("force").is_some_and(|v| v == "true" || v == "1");
    render(h.execute(Action::Remove { name, force }).await)
}

pub async fn exec(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ExecRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::Exec { name, req }).await)
}

/// `POST /v1/sandboxes/{name}/exec/{session}/stdin`: feed an exec session's stdin.
pub async fn exec_stdin(
    State(h): State<Arc<Host>>,
    Path((name, session)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let (req, data) = match parse_stdin(&body) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    render(h.execute(Action::ExecStdin { name, session, data, eof: req.eof }).await)
}

/// `POST /v1/sandboxes/{name}/exec/{session}/attach`: the output stream of a restored exec
/// session (and its stdin, through `.../stdin`).
pub async fn exec_attach(
    State(h): State<Arc<Host>>,
    Path((name, session)): Path<(String, String)>,
) -> Response {
    render(h.execute(Action::ExecAttach { name, session }).await)
}

pub async fn stop(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: StopRequest = match parse_or_default(&body) {
        Ok(r) => r,
        Err(e) => return err(e.into_api()),
    };
    render(h.execute(Action::Stop { name, checkpoint: req.checkpoint }).await)
}

pub async fn start(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Start { name }).await)
}
