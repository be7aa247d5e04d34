//! File routes, `/v1/sandboxes/{name}/files…` (docs/api.md): each parses its query (and body
//! stream) into a `crab_sandbox::files::FileOp`, calls `Host::execute(Action::Files)`, and
//! renders — JSON for entries, the raw bytes for a read or a tar out. Request bodies (a write's
//! file, a tar in's archive) are streamed into the operation as they arrive, never held whole,
//! and bounded by `crab daemon --max-upload` ([`UploadLimit`]): a declared length past it is
//! refused before anything runs, an undeclared one fails the operation when it passes it.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, Query, Request, State};
use axum::http::header;
use axum::response::Response;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crab_common::files::FilesQuery;
use crab_common::ApiError;
use crab_host::{Action, Host, Outcome};
use crab_sandbox::files::{Chunks, FileAnswer, FileOp};

use super::api::{err, render, UploadLimit};

fn path_of(q: &FilesQuery) -> Result<String, ApiError> {
    q.path.clone().ok_or_else(|| {
        ApiError::invalid("the path query parameter is required", "add ?path=/the/path")
    })
}

/// A request body as chunks for the file service (a body that fails to arrive, or passes
/// `limit`, ends them with its error).
fn chunks(body: Body, limit: UploadLimit) -> Chunks {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        let mut s = body.into_data_stream();
        let mut total = 0u64;
        while let Some(c) = s.next().await {
            let item = c.map(|b| b.to_vec()).map_err(|e| {
                ApiError::new(
                    crab_common::ErrorCode::RequestTimeout,
                    format!("the request body did not arrive whole: {e}"),
                    "send the whole body at once",
                )
            });
            total += item.as_ref().map_or(0, |b| b.len() as u64);
            let item = if total > limit.0 { Err(limit.too_large()) } else { item };
            let failed = item.is_err();
            if tx.send(item).await.is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// Run `op` (or answer why it could not be made); a stream answers with `content` as its type.
async fn run(
    h: Arc<Host>,
    name: String,
    q: &FilesQuery,
    op: Result<FileOp, ApiError>,
    content: &str,
) -> Response {
    let op = match op {
        Ok(op) => op,
        Err(e) => return err(e),
    };
    let r = h.execute(Action::Files { name, user: q.user.clone(), op }).await;
    match r {
        Ok(Outcome::Files(FileAnswer::Stream(rx))) => {
            let stream = ReceiverStream::new(rx)
                .map(|c| c.map(Bytes::from).map_err(|e| std::io::Error::other(e.message)));
            Response::builder()
                .header(header::CONTENT_TYPE, content)
                .body(Body::from_stream(stream))
                .unwrap_or_else(|e| err(ApiError::internal(e.to_string())))
        }
        other => render(other),
    }
}

/// `GET .../files?path=`: the file's bytes.
pub async fn read(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = path_of(&q).map(|path| FileOp::Read { path });
    run(h, name, &q, op, "application/octet-stream").await
}

/// `PUT .../files?path=[&mode=644]`: write the body to the file; answers its entry.
pub async fn write(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
    Extension(limit): Extension<UploadLimit>,
    req: Request,
) -> Response {
    let op = (|| {
        limit.check_declared(req.headers())?;
        let mode = match &q.mode {
            Some(m) => {
                Some(u32::from_str_radix(m, 8).ok().filter(|m| *m <= 0o7777).ok_or_else(|| {
                    ApiError::invalid(
                        format!("mode {m:?} is not octal permission bits"),
                        "e.g. mode=644",
                    )
                })?)
            }
            None => None,
        };
        Ok(FileOp::Write { path: path_of(&q)?, mode, data: chunks(req.into_body(), limit) })
    })();
    run(h, name, &q, op, "").await
}

/// `DELETE .../files?path=`: remove a file or a tree.
pub async fn remove(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = path_of(&q).map(|path| FileOp::Remove { path });
    run(h, name, &q, op, "").await
}

/// `GET .../files/stat?path=`: one entry.
pub async fn stat(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = path_of(&q).map(|path| FileOp::Stat { path });
    run(h, name, &q, op, "").await
}

/// `GET .../files/list?path=[&depth=1]`: a directory's entries.
pub async fn list(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = path_of(&q).map(|path| FileOp::List { path, depth: q.depth.unwrap_or(1) });
    run(h, name, &q, op, "").await
}

/// `POST .../files/mkdir?path=`: make a directory and its parents.
pub async fn mkdir(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = path_of(&q).map(|path| FileOp::MakeDir { path });
    run(h, name, &q, op, "").await
}

/// `POST .../files/rename?path=&to=`: rename; answers the new path's entry.
pub async fn rename(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = (|| {
        let to = q.to.clone().ok_or_else(|| {
            ApiError::invalid("the to query parameter is required", "add &to=/the/new/path")
        })?;
        Ok(FileOp::Rename { from: path_of(&q)?, to })
    })();
    run(h, name, &q, op, "").await
}

/// `GET .../files/tar?path=[&contents=true][&follow=true]`: a tar of the path.
pub async fn tar_out(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
) -> Response {
    let op = (|| {
        Ok(FileOp::TarOut {
            path: path_of(&q)?,
            contents: q.contents.unwrap_or(false),
            follow: q.follow.unwrap_or(false),
        })
    })();
    run(h, name, &q, op, "application/x-tar").await
}

/// `PUT .../files/tar?path=DIR[&same_owner=true]`: extract the body (a tar) under DIR.
pub async fn tar_in(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<FilesQuery>,
    Extension(limit): Extension<UploadLimit>,
    req: Request,
) -> Response {
    let op = (|| {
        limit.check_declared(req.headers())?;
        Ok(FileOp::TarIn {
            dir: path_of(&q)?,
            same_owner: q.same_owner.unwrap_or(false),
            data: chunks(req.into_body(), limit),
        })
    })();
    run(h, name, &q, op, "").await
}
