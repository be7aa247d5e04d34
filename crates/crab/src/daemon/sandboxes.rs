//! Sandbox routes: create, list, describe, remove, exec (streamed).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::Response;
use tokio::sync::mpsc;

use crab_common::api::{ExecRequest, SandboxCreateRequest};
use crab_common::ApiError;

use super::api::{blocking, err, ndjson, ok, parse};
use super::Daemon;

pub async fn list(State(d): State<Arc<Daemon>>) -> Response {
    let rt = d.runtime.clone();
    match blocking(move || Ok(rt.list())).await {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

pub async fn get(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    let rt = d.runtime.clone();
    match blocking(move || rt.get(&name).map_err(ApiError::from)).await {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

pub async fn create(State(d): State<Arc<Daemon>>, body: Bytes) -> Response {
    let req: SandboxCreateRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let rt = d.runtime.clone();
    match blocking(move || rt.create(&req).map_err(ApiError::from)).await {
        Ok(v) => {
            d.attach(&v.name);
            d.open_sandbox_proxy(&v.name).await;
            ok(&v)
        }
        Err(e) => err(e),
    }
}

pub async fn remove(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let force = q.get("force").is_some_and(|v| v == "true" || v == "1");
    let d2 = d.clone();
    let n = name.clone();
    let res = blocking(move || {
        d2.runtime.remove(&n, force).map_err(ApiError::from)?;
        // The sandbox is gone: so are its restore points.
        d2.checkpointer.remove_all(&n).map_err(|e| e.to_api())
    });
    match res.await {
        Ok(()) => {
            d.detach(&name);
            d.close_sandbox_proxy(&name).await;
            d.coordinator.forget(&name);
            ok(&serde_json::json!({"removed": true}))
        }
        Err(e) => err(e),
    }
}

pub async fn exec(State(d): State<Arc<Daemon>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ExecRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    // Refuse unknown sandboxes with a plain 404 rather than inside the stream.
    if let Err(e) = d.runtime.record(&name) {
        return err(e.into());
    }
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(crab_sandbox::exec::run(d.runtime.clone(), name, req, tx));
    ndjson(rx)
}
