//! Inspector routes: the current turn's verdict (`GET`), and the verdict with the turn closed
//! (`POST`), as a checkpoint does at a turn boundary.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::Response;

use crab_host::{Action, Host};

use super::api::render;

pub async fn peek(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Inspect { name, close: false }).await)
}

pub async fn close(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Inspect { name, close: true }).await)
}
