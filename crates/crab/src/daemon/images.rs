//! Image routes: list, build (debootstrap or a Dockerfile, streamed progress), import, commit
//! (an image of a sandbox's files), pull (from a registry), push (to one), remove.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;

use crab_common::api::{
    ImageBuildRequest, ImageCommitRequest, ImageImportRequest, ImagePullRequest, ImagePushRequest,
};
use crab_host::{Action, Host};

use super::api::{err, long_operation, parse, render};

pub async fn list(State(h): State<Arc<Host>>) -> Response {
    render(h.execute(Action::ListImages).await)
}

pub async fn build(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: ImageBuildRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    long_operation(h, move |progress| Action::BuildImage { req, progress })
}

pub async fn import(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: ImageImportRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    long_operation(h, move |progress| Action::ImportImage { req, progress })
}

pub async fn commit(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: ImageCommitRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    long_operation(h, move |progress| Action::CommitImage { req, progress })
}

pub async fn pull(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: ImagePullRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    long_operation(h, move |progress| Action::PullImage { req, progress })
}

pub async fn push(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: ImagePushRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    long_operation(h, move |progress| Action::PushImage { req, progress })
}

pub async fn remove(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::RemoveImage { name }).await)
}
