//! Background-process routes (`crab exec -d`, `crab ps`, `crab logs`, `crab signal`): start,
//! list, describe, output (NDJSON exec frames, replayed from offsets and optionally followed),
//! stdin, close-stdin, signal. Each parses, calls `Host::execute`, renders.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::Response;

use crab_common::api::{ProcSignalRequest, ProcStartRequest};
use crab_common::ApiError;
use crab_host::{Action, Host};

use super::api::{err, parse, parse_or_default, parse_stdin, render};

/// `POST /v1/sandboxes/{name}/procs`.
pub async fn start(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ProcStartRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::ProcStart { name, req }).await)
}

/// `GET /v1/sandboxes/{name}/procs`.
pub async fn list(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::ProcList { name }).await)
}

/// `GET /v1/sandboxes/{name}/procs/{id}` (`id` or `tag:NAME`).
pub async fn get(State(h): State<Arc<Host>>, Path((name, id)): Path<(String, String)>) -> Response {
    render(h.execute(Action::ProcGet { name, id }).await)
}

fn number(q: &HashMap<String, String>, key: &str) -> Result<u64, ApiError> {
    match q.get(key) {
        None => Ok(0),
        Some(v) => v.parse().map_err(|_| {
            ApiError::invalid(
                format!("{key}={v:?} is not a byte offset"),
                "give the number of bytes of that stream already read (0 replays everything)",
            )
        }),
    }
}

/// `GET /v1/sandboxes/{name}/procs/{id}/output?follow=1&stdout_offset=N&stderr_offset=M`.
pub async fn output(
    State(h): State<Arc<Host>>,
    Path((name, id)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let follow = q.get("follow").is_some_and(|v| v == "true" || v == "1");
    let offsets = match (number(&q, "stdout_offset"), number(&q, "stderr_offset")) {
        (Ok(o), Ok(e)) => (o, e),
        (Err(e), _) | (_, Err(e)) => return err(e),
    };
    render(h.execute(Action::ProcOutput { name, id, offsets, follow }).await)
}

/// `POST /v1/sandboxes/{name}/procs/{id}/stdin` (`{"d": base64}`; `"eof": true` also closes it).
pub async fn stdin(
    State(h): State<Arc<Host>>,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let (req, data) = match parse_stdin(&body) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    if !data.is_empty() || !req.eof {
        let r = h.execute(Action::ProcStdin { name: name.clone(), id: id.clone(), data }).await;
        if !req.eof || r.is_err() {
            return render(r);
        }
    }
    render(h.execute(Action::ProcCloseStdin { name, id }).await)
}

/// `POST /v1/sandboxes/{name}/procs/{id}/close-stdin`.
pub async fn close_stdin(
    State(h): State<Arc<Host>>,
    Path((name, id)): Path<(String, String)>,
) -> Response {
    render(h.execute(Action::ProcCloseStdin { name, id }).await)
}

/// `POST /v1/sandboxes/{name}/procs/{id}/signal` (`{"signal": "TERM"}`; empty body: TERM).
pub async fn signal(
    State(h): State<Arc<Host>>,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let req: ProcSignalRequest = match parse_or_default(&body) {
        Ok(r) => r,
        Err(e) => return err(e.into_api()),
    };
    render(h.execute(Action::ProcSignal { name, id, signal: req.signal }).await)
}
