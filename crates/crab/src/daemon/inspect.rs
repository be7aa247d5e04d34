//! Inspector routes: the current turn's verdict (`GET`), and the verdict with the turn closed
//! (`POST`), as a checkpoint does at a turn boundary.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::Response;

use super::api::{blocking, err, ok};
use super::Daemon;

async fn verdict(d: Arc<Daemon>, name: String, close: bool) -> Response {
    if let Err(e) = d.runtime.record(&name) {
        return err(e.into());
    }
    let inspector = match d.inspector() {
        Ok(i) => i.clone(),
        Err(e) => return err(e),
    };
    let res = blocking(move || {
        let v = if close { inspector.take(&name) } else { inspector.peek(&name) };
        v.map_err(|e| e.to_api())
    })
    .await;
    match res {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

pub async fn peek(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    verdict(d, name, false).await
}

pub async fn close(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    verdict(d, name, true).await
}
