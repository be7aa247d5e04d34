//! The Connect protocol's JSON codec as envd speaks it: unary calls (`application/json` in and
//! out, errors as `{"code","message"}` with the code's HTTP status) and server streams
//! (`application/connect+json`: each message in a 5-byte envelope — one flags byte, a
//! big-endian `u32` length — and a final end-of-stream envelope, flag `0x02`, carrying `{}` or
//! `{"error":{..}}`; stream errors travel in that envelope with HTTP 200).

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Content type of unary JSON calls.
pub const UNARY_JSON: &str = "application/json";
/// Content type of streaming JSON calls.
pub const STREAM_JSON: &str = "application/connect+json";
/// Envelope flag: the message is compressed (we never accept it: no `Connect-Content-Encoding`).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Largest request message we read (envd's requests are small; uploads use `/files`).
pub const MAX_MESSAGE: usize = 4 << 20;

/// A Connect error code (the protocol's lower-snake-case names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The call was cancelled.
    Canceled,
    /// Unknown failure.
    Unknown,
    /// Bad request.
    InvalidArgument,
    /// The deadline passed.
    DeadlineExceeded,
    /// No such entity.
    NotFound,
    /// It exists already.
    AlreadyExists,
    /// Not allowed.
    PermissionDenied,
    /// Out of a resource.
    ResourceExhausted,
    /// Not in a state that allows it.
    FailedPrecondition,
    /// Not implemented by this server.
    Unimplemented,
    /// Server bug or failure.
    Internal,
    /// The service is not reachable (the sandbox is gone).
    Unavailable,
    /// No valid credentials.
    Unauthenticated,
}

impl Code {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect spec's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error: a code and a message naming the problem (and the fix, where there is one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ConnectError {
    /// The code.
    pub code: Code,
    /// What went wrong.
    pub message: String,
}

impl ConnectError {
    /// An error with `code`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError { code, message: message.into() }
    }

    /// The error as JSON (`{"code","message"}`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// A unary error response.
    pub fn unary_response(&self) -> Response {
        let mut r = (self.code.http_status(), axum::Json(self.to_json())).into_response();
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON));
        r
    }

    /// A stream response that carries only this error in its end-of-stream envelope.
    pub fn stream_response(&self) -> Response {
        let body = end_stream(Some(self));
        stream_head(Body::from(body))
    }
}

/// The kind of call a request is, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `application/json`.
    Unary,
    /// `application/connect+json`.
    Stream,
}

/// Which kind of call `headers` announce; `None` for a codec we do not speak (binary protobuf).
pub fn call_kind(headers: &HeaderMap) -> Option<CallKind> {
    let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let ct = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    match ct.as_str() {
        UNARY_JSON => Some(CallKind::Unary),
        STREAM_JSON => Some(CallKind::Stream),
        _ => None,
    }
}

/// The `Connect-Timeout-Ms` deadline of a call, if any.
pub fn timeout_ms(headers: &HeaderMap) -> Option<u64> {
    headers.get("connect-timeout-ms")?.to_str().ok()?.trim().parse().ok().filter(|ms| *ms > 0)
}

/// Frame one message.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    b.put_slice(payload);
    b.freeze()
}

/// Frame one streamed message.
pub fn message<T: Serialize>(msg: &T) -> Bytes {
    let payload = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    envelope(0, &payload)
}

/// The end-of-stream envelope: `{}` or `{"error":{..}}`.
pub fn end_stream(err: Option<&ConnectError>) -> Bytes {
    let body = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.to_json()}),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// The head of a successful stream response around `body`.
pub fn stream_head(body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON));
    r
}

/// Decode the single enveloped message of a server-stream request.
pub fn decode_stream_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let bad = |m: String| ConnectError::new(Code::InvalidArgument, m);
    if body.len() < 5 {
        return Err(bad(format!(
            "malformed Connect envelope: {} bytes, a stream request needs a 5-byte header \
             (flags, big-endian length) before its JSON message",
            body.len()
        )));
    }
    let flags = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(bad(
            "compressed Connect messages are not supported; send them uncompressed".into()
        ));
    }
    if len > MAX_MESSAGE {
        return Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes exceeds the {MAX_MESSAGE}-byte limit"),
        ));
    }
    if body.len() - 5 != len {
        return Err(bad(format!(
            "malformed Connect envelope: header says {len} bytes, {} follow",
            body.len() - 5
        )));
    }
    decode_json(&body[5..])
}

/// Decode a unary JSON request message.
pub fn decode_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let body = if body.is_empty() { b"{}".as_slice() } else { body };
    serde_json::from_slice(body).map_err(|e| {
        ConnectError::new(Code::InvalidArgument, format!("malformed JSON message: {e}"))
    })
}

/// A unary success response.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    let mut r = (StatusCode::OK, axum::Json(msg)).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip() {
        let framed = message(&serde_json::json!({"process": {"cmd": "ls"}}));
        assert_eq!(framed[0], 0);
        let len = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
        assert_eq!(len, framed.len() - 5);
        let v: serde_json::Value = decode_stream_request(&framed).expect("decodes");
        assert_eq!(v["process"]["cmd"], "ls");
    }

    #[test]
    fn malformed_envelopes_are_invalid_argument() {
        for bad in [&b""[..], b"\x00\x00", b"\x00\x00\x00\x00\x09{}", b"\x01\x00\x00\x00\x02{}"] {
            let e = decode_stream_request::<serde_json::Value>(bad).expect_err("refused");
            assert_eq!(e.code, Code::InvalidArgument, "{bad:?}: {e}");
        }
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        let e = decode_stream_request::<serde_json::Value>(&huge).expect_err("refused");
        assert_eq!(e.code, Code::ResourceExhausted);
    }

    #[test]
    fn end_stream_carries_the_error() {
        let e = ConnectError::new(Code::NotFound, "no process with pid 7");
        let b = end_stream(Some(&e));
        assert_eq!(b[0], FLAG_END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&b[5..]).expect("json");
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(end_stream(None)[5..], b"{}"[..]);
    }

    #[test]
    fn codes_map_to_connect_statuses() {
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::AlreadyExists.http_status(), 409);
        assert_eq!(Code::Unimplemented.http_status(), 501);
        assert_eq!(Code::Unavailable.http_status(), 503);
    }

    #[test]
    fn content_types() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
        assert_eq!(call_kind(&h), Some(CallKind::Stream));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
        assert_eq!(call_kind(&h), Some(CallKind::Unary));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/proto"));
        assert_eq!(call_kind(&h), None);
    }
}
