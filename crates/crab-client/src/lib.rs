//! The API client of the Crab daemon: one HTTP/1.1 request per call over the daemon's unix socket.
//!
//! Plain calls decode one JSON document; streaming calls hand each newline-delimited JSON frame
//! to a callback as it arrives. Any non-2xx answer is decoded as an [`ApiError`]. A missing or
//! refusing socket becomes an error that says the daemon is not running and how to start it.

use std::path::PathBuf;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
pub use hyper::Method;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crab_common::api::{ExecFrame, ProcInfo, ProcSignalRequest, ProcStartRequest, StdinWrite};
use crab_common::{ApiError, ErrorCode};

mod files;

/// A client of one daemon.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
}

type Conn = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

impl Client {
    /// A client for the daemon listening on `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client { socket: socket.into() }
    }

    async fn connect(&self) -> Result<Conn, ApiError> {
        let stream = tokio::net::UnixStream::connect(&self.socket).await.map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => "no socket".to_string(),
                std::io::ErrorKind::ConnectionRefused => "nothing listening".to_string(),
                std::io::ErrorKind::PermissionDenied => {
                    return ApiError::new(
                        ErrorCode::HostUnsupported,
                        format!("permission denied on {}", self.socket.display()),
                        "the daemon's socket is root-only: run crab as root",
                    )
                }
                _ => e.to_string(),
            };
            ApiError::new(
                ErrorCode::Internal,
                format!("the crab daemon is not running ({why} at {})", self.socket.display()),
                "start it with `crab daemon` (as root), or pass the right --state-dir",
            )
        })?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ApiError::internal(format!("talking to the daemon: {e}")))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(send)
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ApiError> {
        self.send_typed(method, path, "application/json", body.unwrap_or_default()).await
    }

    async fn send_typed(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ApiError> {
        let mut conn = self.connect().await?;
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "crab")
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ApiError::internal(format!("building request: {e}")))?;
        let resp = conn
            .send_request(req)
            .await
            .map_err(|e| ApiError::internal(format!("the daemon dropped the request: {e}")))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let bytes = body_bytes(resp).await?;
            return Err(serde_json::from_slice::<ApiError>(&bytes).unwrap_or_else(|_| {
                ApiError::internal(format!(
                    "daemon answered {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ))
            }));
        }
        Ok(resp)
    }

    /// A call returning one JSON document.
    pub async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ApiError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| ApiError::internal(format!("encoding request: {e}")))?;
        let bytes = body_bytes(self.send(method, path, body).await?).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::internal(format!("undecodable answer from the daemon: {e}")))
    }

    /// A streaming call: `on_frame` gets each NDJSON frame in order.
    pub async fn stream<B: Serialize, F: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        on_frame: impl FnMut(F),
    ) -> Result<(), ApiError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| ApiError::internal(format!("encoding request: {e}")))?;
        self.stream_with(Method::POST, path, Some(body), on_frame).await
    }

    /// A streaming call of any method (`GET .../output`).
    pub async fn stream_with<F: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        mut on_frame: impl FnMut(F),
    ) -> Result<(), ApiError> {
        let mut resp = self.send(method, path, body).await?.into_body();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(frame) = resp.frame().await {
            let frame =
                frame.map_err(|e| ApiError::internal(format!("the daemon's stream broke: {e}")))?;
            if let Ok(data) = frame.into_data() {
                buf.extend_from_slice(&data);
                while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=pos).collect();
                    let f = serde_json::from_slice(&line[..line.len() - 1]).map_err(|e| {
                        ApiError::internal(format!("undecodable frame from the daemon: {e}"))
                    })?;
                    on_frame(f);
                }
            }
        }
        Ok(())
    }
}

/// The background-process service (`crab exec -d`, `crab ps`, `crab logs`, `crab signal`).
impl Client {
    /// Start a background process in sandbox `name`.
    pub async fn proc_start(
        &self,
        name: &str,
        req: &ProcStartRequest,
    ) -> Result<ProcInfo, ApiError> {
        self.call(Method::POST, &format!("/v1/sandboxes/{name}/procs"), Some(req)).await
    }

    /// The background processes of sandbox `name`.
    pub async fn proc_list(&self, name: &str) -> Result<Vec<ProcInfo>, ApiError> {
        self.call::<(), _>(Method::GET, &format!("/v1/sandboxes/{name}/procs"), None).await
    }

    /// One background process (`id`, or `tag:NAME`).
    pub async fn proc_get(&self, name: &str, id: &str) -> Result<ProcInfo, ApiError> {
        self.call::<(), _>(Method::GET, &format!("/v1/sandboxes/{name}/procs/{id}"), None).await
    }

    /// Its output from `offsets` (bytes of stdout and stderr already seen), then with `follow`
    /// until it ends: `on_frame` gets `Stdout`/`Stderr` frames and finally `Exit` (it exited)
    /// or `Error`; a read without `follow` of a running process ends with neither.
    pub async fn proc_output(
        &self,
        name: &str,
        id: &str,
        offsets: (u64, u64),
        follow: bool,
        on_frame: impl FnMut(ExecFrame),
    ) -> Result<(), ApiError> {
        let path = format!(
            "/v1/sandboxes/{name}/procs/{id}/output?follow={follow}&stdout_offset={}&stderr_offset={}",
            offsets.0, offsets.1
        );
        self.stream_with(Method::GET, &path, None, on_frame).await
    }

    /// Write `data` to the stdin of exec session `session` of sandbox `name` as a raw body
    /// (then close it with `eof`); answers once the bytes are in the command's pipe.
    pub async fn exec_stdin(
        &self,
        name: &str,
        session: &str,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<crab_common::api::StdinWritten, ApiError> {
        let path = format!("/v1/sandboxes/{name}/exec/{session}/stdin?eof={eof}");
        let resp = self.send_typed(Method::POST, &path, "application/octet-stream", data).await?;
        let bytes = body_bytes(resp).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::internal(format!("undecodable answer from the daemon: {e}")))
    }

    /// Write `data` to its stdin (then close it with `eof`).
    pub async fn proc_stdin(
        &self,
        name: &str,
        id: &str,
        data: &[u8],
        eof: bool,
    ) -> Result<serde_json::Value, ApiError> {
        use base64::Engine as _;
        let req = StdinWrite { d: base64::engine::general_purpose::STANDARD.encode(data), eof };
        self.call(Method::POST, &format!("/v1/sandboxes/{name}/procs/{id}/stdin"), Some(&req)).await
    }

    /// Close its stdin.
    pub async fn proc_close_stdin(&self, name: &str, id: &str) -> Result<ProcInfo, ApiError> {
        self.call::<(), _>(
            Method::POST,
            &format!("/v1/sandboxes/{name}/procs/{id}/close-stdin"),
            None,
        )
        .await
    }

    /// Send it `signal` (a name like `TERM` or a number).
    pub async fn proc_signal(
        &self,
        name: &str,
        id: &str,
        signal: &str,
    ) -> Result<ProcInfo, ApiError> {
        let req = ProcSignalRequest { signal: signal.to_string() };
        self.call(Method::POST, &format!("/v1/sandboxes/{name}/procs/{id}/signal"), Some(&req))
            .await
    }
}

/// The whole body of a response.
async fn body_bytes(resp: hyper::Response<hyper::body::Incoming>) -> Result<Bytes, ApiError> {
    Ok(resp
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiError::internal(format!("reading the daemon's answer: {e}")))?
        .to_bytes())
}
