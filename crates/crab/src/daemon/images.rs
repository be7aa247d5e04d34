//! Image routes: list, build (debootstrap, streamed progress), import, remove.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;

use crab_common::api::{ImageBuildRequest, ImageImportRequest};
use crab_common::ApiError;
use crab_sandbox::image;

use super::api::{blocking, err, long_operation, ok, parse};
use super::Daemon;

pub async fn list(State(d): State<Arc<Daemon>>) -> Response {
    let state = d.runtime.state().clone();
    match blocking(move || image::list(&state).map_err(ApiError::from)).await {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

pub async fn build(State(d): State<Arc<Daemon>>, body: Bytes) -> Response {
    let req: ImageBuildRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    if req.distro != "debian" {
        return err(ApiError::invalid(
            format!("unknown distro {:?}", req.distro),
            "the only recipe is `debian` (bookworm); use `crab image import` for anything else",
        ));
    }
    let state = d.runtime.state().clone();
    let name = req.name.clone().unwrap_or_else(|| req.distro.clone());
    long_operation(move |p| {
        image::build_debian(&state, &name, &req.include, p).map_err(ApiError::from)
    })
}

pub async fn import(State(d): State<Arc<Daemon>>, body: Bytes) -> Response {
    let req: ImageImportRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let state = d.runtime.state().clone();
    long_operation(move |p| {
        image::import(&state, &req.name, &PathBuf::from(&req.path), p).map_err(ApiError::from)
    })
}

pub async fn remove(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    let state = d.runtime.state().clone();
    match blocking(move || image::remove(&state, &name).map_err(ApiError::from)).await {
        Ok(()) => ok(&serde_json::json!({"removed": true})),
        Err(e) => err(e),
    }
}
