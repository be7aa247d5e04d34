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
        mut on_frame: impl FnMut(F),
    ) -> Result<(), ApiError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| ApiError::internal(format!("encoding request: {e}")))?;
        let mut resp = self.send(Method::POST, path, Some(body)).await?.into_body();
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

/// The whole body of a response.
async fn body_bytes(resp: hyper::Response<hyper::body::Incoming>) -> Result<Bytes, ApiError> {
    Ok(resp
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiError::internal(format!("reading the daemon's answer: {e}")))?
        .to_bytes())
}
