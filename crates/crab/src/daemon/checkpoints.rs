//! Checkpoint routes: take (`auto` asks the inspector), list, prune, restore in place, fork,
//! the conversation up to a point, and explicit turn marks. What each does (the turn policy,
//! the restore and fork chains) is the host's: see `crab_host::Host::execute`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::Response;

use crab_common::api::{CheckpointCreateRequest, ForkRequest, PruneRequest, RestoreRequest};
use crab_host::{Action, Host};

use super::api::{err, maybe_streamed, parse, parse_or_default, render, wants_progress};

pub async fn create(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let action = parse_or_default::<CheckpointCreateRequest>(&body)
        .and_then(|req| Action::checkpoint(name, req));
    match action {
        Ok(a) => render(h.execute(a).await),
        Err(e) => err(e.into_api()),
    }
}

pub async fn list(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::ListCheckpoints { name }).await)
}

pub async fn prune(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    match parse::<PruneRequest>(&body) {
        Ok(req) => render(h.execute(Action::Prune { name, keep_last: req.keep_last }).await),
        Err(e) => err(e),
    }
}

/// `POST /v1/sandboxes/{name}/restore[?progress=true]`.
pub async fn restore(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    match parse_or_default::<RestoreRequest>(&body) {
        Ok(req) => {
            let action = Action::Restore { name, checkpoint: req.checkpoint };
            maybe_streamed(h, action, wants_progress(&q)).await
        }
        Err(e) => err(e.into_api()),
    }
}

/// `POST /v1/sandboxes/{name}/fork[?progress=true]`.
pub async fn fork(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    match parse::<ForkRequest>(&body) {
        Ok(req) => maybe_streamed(h, Action::Fork { name, req }, wants_progress(&q)).await,
        Err(e) => err(e),
    }
}

/// `GET /v1/sandboxes/{name}/conversation?at=CKPT`.
pub async fn conversation(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    render(h.execute(Action::Conversation { name, at: q.get("at").cloned() }).await)
}

/// `POST /v1/sandboxes/{name}/turns`: mark a turn boundary explicitly; answers when the turn's
/// restore point is published.
pub async fn turn(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Turn { name }).await)
}

/// `POST /v1/sandboxes/{name}/harness/changed`: the sandbox's declared harness changed its own
/// state (a persistent shell's `cd`, `export`, job); its next decided checkpoint dumps.
pub async fn harness_changed(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::HarnessChanged { name }).await)
}
