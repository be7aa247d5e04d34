//! The routes behind `crab remote ls|check|prune|wait|follow` and create/fork `--from-remote`: each
//! parses its request into a host remote action and renders the outcome (the exporter and the
//! export states live in `crab_host::remote`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::Response;
use serde::Deserialize;

use crab_host::follow::FollowRequest;
use crab_host::remote::FromRemote;
use crab_host::{Action, Host};

use super::api::{err, maybe_streamed, parse, render, wants_progress};

/// `GET /v1/remote/points?sandbox=SB`.
pub async fn ls(State(h): State<Arc<Host>>, Query(q): Query<HashMap<String, String>>) -> Response {
    render(h.execute(Action::RemoteList { sandbox: q.get("sandbox").cloned() }).await)
}

/// `POST /v1/remote/check`.
pub async fn check(State(h): State<Arc<Host>>) -> Response {
    render(h.execute(Action::RemoteCheck).await)
}

/// Body of `POST /v1/remote/prune`.
#[derive(Debug, Deserialize)]
pub struct PruneBody {
    keep_last: usize,
}

/// `POST /v1/remote/prune {"keep_last": N}`.
pub async fn prune(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    match parse::<PruneBody>(&body) {
        Ok(req) => render(h.execute(Action::RemotePrune { keep_last: req.keep_last }).await),
        Err(e) => err(e),
    }
}

/// Query of `GET /v1/remote/wait`.
#[derive(Debug, Deserialize)]
pub struct WaitQuery {
    sandbox: String,
    point: String,
    #[serde(default)]
    timeout_s: Option<u64>,
}

/// `GET /v1/remote/wait?sandbox=SB&point=P[&timeout_s=S]`: answers once the point is durable.
pub async fn wait(State(h): State<Arc<Host>>, Query(q): Query<WaitQuery>) -> Response {
    let timeout = Duration::from_secs(q.timeout_s.unwrap_or(600));
    render(h.execute(Action::RemoteWait { sandbox: q.sandbox, point: q.point, timeout }).await)
}

/// `GET /v1/remote/follow`: what this host follows and holds.
pub async fn follow_status(State(h): State<Arc<Host>>) -> Response {
    render(h.execute(Action::Follow(FollowRequest::default())).await)
}

/// `POST /v1/remote/follow {"sandboxes": [..], "all": bool, "stop": bool}`.
pub async fn follow(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    match parse::<FollowRequest>(&body) {
        Ok(req) => render(h.execute(Action::Follow(req)).await),
        Err(e) => err(e),
    }
}

/// `POST /v1/remote/restore[?progress=true]`: build sandboxes from a remote point (create =
/// one branch).
pub async fn restore(
    State(h): State<Arc<Host>>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    match parse::<FromRemote>(&body) {
        Ok(req) => maybe_streamed(h, Action::FromRemote(req), wants_progress(&q)).await,
        Err(e) => err(e),
    }
}
