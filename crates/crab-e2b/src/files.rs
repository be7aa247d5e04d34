//! E2B's file calls — envd's `filesystem.Filesystem` RPCs (`Stat`, `ListDir`, `MakeDir`,
//! `Move`, `Remove`) and the `/files` download and upload (`GET`, `POST` multipart or
//! octet-stream) — as a codec over the host's one file service: each call is one
//! [`Backend`](crate::Backend) `file_*` method (the sandbox file service, run inside the sandbox
//! as the call's user), its answer rendered as envd's `EntryInfo`s or bytes, its `ApiError`
//! mapped to the Connect code the SDK expects. No file is moved here, and no path is resolved
//! here. An upload streams to the sandbox as it arrives (never held whole), bounded by
//! [`Config::max_upload`](crate::Config) (`crab daemon --max-upload`): a declared length over
//! it is refused before a byte is written, an undeclared one when it passes it.
//!
//! It is a child module of `server` (declared there) so that it shares the server's envd
//! sandbox lookup and access-token check without widening their visibility.

use std::time::{Duration, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use crab_common::files::{FileEntry, FileKind};
use crab_common::{ApiError, ErrorCode};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::{call_user, envd_rest_error, envd_sandbox, unsupported, RestError, Shared};
use crate::backend::Backend;
use crate::connect::{self, CallKind, Code, ConnectError};
use crate::envd::{self, EntryInfo, FileType};
use crate::user;

/// envd's `EntryInfo` of a file service entry.
fn entry_info(e: FileEntry) -> EntryInfo {
    let modified = UNIX_EPOCH + Duration::from_secs_f64(e.modified_s.max(0.0));
    EntryInfo {
        name: e.name,
        kind: match (e.kind, e.is_symlink) {
            (FileKind::File, _) => FileType::File,
            (FileKind::Dir, _) => FileType::Directory,
            (FileKind::Other, true) => FileType::Symlink,
            (FileKind::Other, false) => FileType::Unspecified,
        },
        path: e.path,
        size: i64::try_from(e.size).unwrap_or(i64::MAX),
        mode: e.mode,
        permissions: e.permissions,
        owner: e.owner,
        group: e.group,
        modified_time: humantime::format_rfc3339_nanos(modified).to_string(),
        symlink_target: e.symlink_target,
        is_symlink: e.is_symlink,
    }
}

/// The Connect error of a file service failure: the sandbox's death as E2B tells it, a
/// path's problem by its code, anything else as the host said.
async fn fs_error<B: Backend>(e2b: &Shared<B>, sb: &str, e: ApiError) -> ConnectError {
    let code = match e.code {
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::AlreadyExists => Code::AlreadyExists,
        ErrorCode::PermissionDenied => Code::PermissionDenied,
        ErrorCode::InvalidRequest => Code::InvalidArgument,
        ErrorCode::TooLarge => Code::ResourceExhausted,
        ErrorCode::Timeout => Code::DeadlineExceeded,
        _ => return e2b.exec_failed(sb, e).await,
    };
    let msg = if e.hint.is_empty() { e.message } else { format!("{} ({})", e.message, e.hint) };
    ConnectError::new(code, msg)
}

pub(super) async fn filesystem<B: Backend>(
    State(e2b): State<Shared<B>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    match filesystem_call(&e2b, &method, &headers, &raw).await {
        Ok(r) => r,
        Err(e) => {
            if connect::call_kind(&headers) == Some(CallKind::Stream) {
                e.stream_response()
            } else {
                e.unary_response()
            }
        }
    }
}

async fn filesystem_call<B: Backend>(
    e2b: &Shared<B>,
    method: &str,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ConnectError> {
    if connect::call_kind(headers) != Some(CallKind::Unary) {
        return Err(unsupported(method, headers));
    }
    let sb = envd_sandbox(e2b, headers).await?;
    let user = call_user(headers)?;
    let (be, id) = (&e2b.backend, sb.to_string());
    let entry = |e: FileEntry| connect::unary_ok(&envd::EntryResponse { entry: entry_info(e) });
    let r = match method {
        "Stat" | "MakeDir" | "Remove" | "ListDir" => {
            let req: envd::PathRequest = connect::decode_json(raw)?;
            match method {
                "Stat" => be.file_stat(id, user, req.path).await.map(entry),
                "MakeDir" => be.file_make_dir(id, user, req.path).await.map(entry),
                "Remove" => be
                    .file_remove(id, user, req.path)
                    .await
                    .map(|()| connect::unary_ok(&serde_json::json!({}))),
                _ => be.file_list(id, user, req.path, req.depth.max(1)).await.map(|v| {
                    let entries = v.into_iter().map(entry_info).collect();
                    connect::unary_ok(&envd::ListDirResponse { entries })
                }),
            }
        }
        "Move" => {
            let req: envd::MoveRequest = connect::decode_json(raw)?;
            be.file_rename(id, user, req.source, req.destination).await.map(entry)
        }
        other => {
            return Err(ConnectError::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{other} is not supported by Crab's E2B front door (docs/e2b.md)"),
            ))
        }
    };
    match r {
        Ok(r) => Ok(r),
        Err(e) => Err(fs_error(e2b, &sb, e).await),
    }
}

// ---------------------------------------------------------------------------------------------
// /files

#[derive(Debug, serde::Deserialize)]
pub(super) struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

fn file_user(q: &FileQuery, headers: &HeaderMap) -> Result<String, ConnectError> {
    match &q.username {
        Some(u) if !u.is_empty() => {
            user::check_user(u).map_err(|m| ConnectError::new(Code::InvalidArgument, m))?;
            Ok(u.clone())
        }
        _ => call_user(headers),
    }
}

pub(super) async fn download<B: Backend>(
    State(e2b): State<Shared<B>>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Result<Response, RestError> {
    let sb = envd_sandbox(&e2b, &headers).await.map_err(envd_rest_error)?;
    let user = file_user(&q, &headers).map_err(envd_rest_error)?;
    let path = q.path.ok_or_else(|| RestError::new(400, "path is required"))?;
    let rx = match e2b.backend.file_read(sb.to_string(), user, path).await {
        Ok(rx) => rx,
        Err(e) => return Err(envd_rest_error(fs_error(&e2b, &sb, e).await)),
    };
    let body = Body::from_stream(
        ReceiverStream::new(rx)
            .map(|c| c.map(Bytes::from).map_err(|e| std::io::Error::other(e.message))),
    );
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

/// `POST /files`. A refused upload is answered with `Connection: close`: its body may be
/// partly or wholly unread (the sandbox is checked before it is read), so the server cannot
/// reuse the connection, and a client that did would send its next request into a socket
/// being closed ("connection closed before message completed").
pub(super) async fn upload<B: Backend>(
    state: State<Shared<B>>,
    query: Query<FileQuery>,
    req: Request,
) -> Response {
    match upload_files(state, query, req).await {
        Ok(r) => r,
        Err(e) => {
            let mut r = e.into_response();
            r.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            r
        }
    }
}

fn too_big(limit: u64) -> RestError {
    RestError::new(
        413,
        format!("upload exceeds the {limit}-byte limit of Crab's E2B front door (raise it with `crab daemon --max-upload SIZE`), or split it"),
    )
}

/// Where an upload's bytes come from.
enum Source<'a, 'b> {
    /// A multipart field, read as it is written.
    Field(&'a mut axum::extract::multipart::Field<'b>),
    /// A raw (octet-stream) body, read as it arrives, at most `limit` bytes.
    Stream(axum::body::BodyDataStream, u64),
}

/// Write one file through the file service, feeding it as the upload's bytes arrive.
async fn write_one<B: Backend>(
    e2b: &Shared<B>,
    sb: &str,
    user: &str,
    path: String,
    src: Source<'_, '_>,
) -> Result<serde_json::Value, RestError> {
    let (tx, rx) = mpsc::channel(8);
    let write = e2b.backend.file_write(sb.to_string(), user.to_string(), path, rx);
    let limit = e2b.cfg.max_upload;
    let feed = async move {
        match src {
            Source::Stream(mut s, limit) => {
                let mut total = 0u64;
                while let Some(c) = s.next().await {
                    let b = match c {
                        Ok(b) => b,
                        Err(e) => {
                            let m = format!("the upload did not arrive whole: {e}");
                            let _ = tx.send(Err(ApiError::invalid(m.clone(), ""))).await;
                            return Err(RestError::new(400, m));
                        }
                    };
                    total += b.len() as u64;
                    if total > limit {
                        // Ends the write as failed: the program is killed before its stdin closes.
                        let _ = tx.send(Err(ApiError::invalid("upload too large", ""))).await;
                        return Err(too_big(limit));
                    }
                    if tx.send(Ok(b.to_vec())).await.is_err() {
                        return Ok(()); // the write ended (failed): its answer says why
                    }
                }
                Ok(())
            }
            Source::Field(f) => loop {
                match f.chunk().await {
                    Ok(Some(b)) => {
                        if tx.send(Ok(b.to_vec())).await.is_err() {
                            return Ok(()); // the write ended (failed): its answer says why
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        let e = malformed(e, limit);
                        let _ = tx.send(Err(ApiError::invalid(e.1.clone(), ""))).await;
                        return Err(e);
                    }
                }
            },
        }
    };
    let (written, fed) = tokio::join!(write, feed);
    fed?;
    let entry = match written {
        Ok(e) => e,
        Err(e) => return Err(envd_rest_error(fs_error(e2b, sb, e).await)),
    };
    Ok(serde_json::json!({"name": entry.name, "type": "file", "path": entry.path}))
}

fn malformed(e: axum::extract::multipart::MultipartError, limit: u64) -> RestError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        too_big(limit)
    } else {
        RestError::new(400, format!("malformed multipart body: {e}"))
    }
}

async fn upload_files<B: Backend>(
    State(e2b): State<Shared<B>>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Result<Response, RestError> {
    let headers = req.headers().clone();
    let sb = envd_sandbox(&e2b, &headers).await.map_err(envd_rest_error)?;
    let user = file_user(&q, &headers).map_err(envd_rest_error)?;
    let ct =
        headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    if headers.get(header::CONTENT_ENCODING).is_some() {
        return Err(RestError::new(
            400,
            "compressed uploads are not supported; upload without gzip",
        ));
    }
    let limit = e2b.cfg.max_upload;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        // Refused before a byte is written.
        return Err(too_big(limit));
    }
    let mut out = Vec::new();
    if ct.starts_with("multipart/form-data") {
        let mut mp = Multipart::from_request(req, &())
            .await
            .map_err(|e| RestError::new(400, format!("malformed multipart body: {e}")))?;
        while let Some(mut field) = mp.next_field().await.map_err(|e| malformed(e, limit))? {
            let path =
                field.file_name().map(str::to_string).or_else(|| q.path.clone()).ok_or_else(
                    || RestError::new(400, "a file part has no file name and the request no path"),
                )?;
            out.push(write_one(&e2b, &sb, &user, path, Source::Field(&mut field)).await?);
        }
    } else {
        let path = q
            .path
            .clone()
            .ok_or_else(|| RestError::new(400, "path is required for an octet-stream upload"))?;
        // Streamed as it arrives; one over the limit (an undeclared length) fails the write.
        let body = req.into_body().into_data_stream();
        out.push(write_one(&e2b, &sb, &user, path, Source::Stream(body, limit)).await?);
    }
    if out.is_empty() {
        return Err(RestError::new(400, "no file in the upload"));
    }
    Ok(Json(out).into_response())
}
