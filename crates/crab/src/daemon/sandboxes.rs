//! Sandbox routes: create, list, describe, update (checkpoint policy), remove, stop, start, exec
//! (streamed), an exec session's stdin — a JSON write, or a raw body streamed into the
//! command's stdin pipe as it arrives (any size up to `crab daemon --max-upload`, never held
//! whole).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Extension, FromRequest, Path, Query, Request, State};
use axum::http::header;
use axum::response::Response;
use tokio_stream::StreamExt;

use crab_common::api::{
    ExecRequest, SandboxCreateRequest, SandboxUpdateRequest, StdinWritten, StopRequest,
};
use crab_common::ApiError;
use crab_host::{Action, Host, HostError, Outcome};

use super::api::{err, parse, parse_or_default, parse_stdin, render, UploadLimit};

/// Bytes of a streamed stdin body handed to the command per write (the body's frames are
/// gathered up to this, so a 1 GiB stdin is a few thousand writes, and at most this much of it
/// is in the daemon at once).
const STDIN_WRITE: usize = 1 << 20;

pub async fn list(State(h): State<Arc<Host>>) -> Response {
    render(h.execute(Action::ListSandboxes).await)
}

pub async fn get(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::GetSandbox { name }).await)
}

pub async fn create(State(h): State<Arc<Host>>, body: Bytes) -> Response {
    let req: SandboxCreateRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::Create(req)).await)
}

pub async fn update(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: SandboxUpdateRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::Update { name, req }).await)
}

pub async fn remove(
    State(h): State<Arc<Host>>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let force = q.get("force").is_some_and(|v| v == "true" || v == "1");
    render(h.execute(Action::Remove { name, force }).await)
}

pub async fn exec(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ExecRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    render(h.execute(Action::Exec { name, req }).await)
}

/// `?eof=true` of a streamed stdin body.
#[derive(Debug, serde::Deserialize)]
pub struct StdinQuery {
    #[serde(default)]
    eof: bool,
}

/// `POST /v1/sandboxes/{name}/exec/{session}/stdin`: feed an exec session's stdin — a JSON
/// [`StdinWrite`](crab_common::api::StdinWrite), or (`Content-Type:
/// application/octet-stream`) the raw body, streamed into the pipe as it arrives, then closed
/// with `?eof=true`.
pub async fn exec_stdin(
    State(h): State<Arc<Host>>,
    Path((name, session)): Path<(String, String)>,
    Query(q): Query<StdinQuery>,
    Extension(limit): Extension<UploadLimit>,
    req: Request,
) -> Response {
    let raw = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/octet-stream"));
    if raw {
        return render(stream_stdin(&h, name, session, q.eof, limit, req).await);
    }
    let body = match Bytes::from_request(req, &()).await {
        Ok(b) => b,
        Err(e) => return axum::response::IntoResponse::into_response(e),
    };
    let (req, data) = match parse_stdin(&body) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    render(h.execute(Action::ExecStdin { name, session, data, eof: req.eof }).await)
}

/// Feed `req`'s body to the session's stdin in writes of up to [`STDIN_WRITE`] bytes, each
/// taken by the command before the next is read (the pipe's pace is the body's), then close it
/// when `eof`. Answers the bytes written.
async fn stream_stdin(
    h: &Arc<Host>,
    name: String,
    session: String,
    eof: bool,
    limit: UploadLimit,
    req: Request,
) -> Result<Outcome, HostError> {
    limit.check_declared(req.headers())?;
    let mut body = req.into_body().into_data_stream();
    let mut written = 0usize;
    let mut buf: Vec<u8> = Vec::with_capacity(STDIN_WRITE);
    let mut total = 0u64;
    loop {
        let next = body.next().await;
        let end = next.is_none();
        if let Some(c) = next {
            let c = c.map_err(|e| {
                ApiError::new(
                    crab_common::ErrorCode::RequestTimeout,
                    format!(
                        "the stdin body did not arrive whole ({written} bytes were written): {e}"
                    ),
                    "send the whole body at once",
                )
            })?;
            total += c.len() as u64;
            if total > limit.0 {
                return Err(limit.too_large().into());
            }
            buf.extend_from_slice(&c);
        }
        if buf.len() >= STDIN_WRITE || (end && (!buf.is_empty() || eof)) {
            let data = std::mem::replace(&mut buf, Vec::with_capacity(STDIN_WRITE));
            let close = end && eof;
            let out = h
                .execute(Action::ExecStdin {
                    name: name.clone(),
                    session: session.clone(),
                    data,
                    eof: close,
                })
                .await?;
            if let Outcome::StdinWritten(w) = out {
                written += w.written;
            }
        }
        if end {
            return Ok(Outcome::StdinWritten(StdinWritten { written, eof }));
        }
    }
}

/// `POST /v1/sandboxes/{name}/exec/{session}/attach`: the output stream of a restored exec
/// session (and its stdin, through `.../stdin`).
pub async fn exec_attach(
    State(h): State<Arc<Host>>,
    Path((name, session)): Path<(String, String)>,
) -> Response {
    render(h.execute(Action::ExecAttach { name, session }).await)
}

pub async fn stop(State(h): State<Arc<Host>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: StopRequest = match parse_or_default(&body) {
        Ok(r) => r,
        Err(e) => return err(e.into_api()),
    };
    render(h.execute(Action::Stop { name, checkpoint: req.checkpoint }).await)
}

pub async fn start(State(h): State<Arc<Host>>, Path(name): Path<String>) -> Response {
    render(h.execute(Action::Start { name }).await)
}
