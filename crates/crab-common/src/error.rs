//! The error taxonomy of Crab's API.
//!
//! Every failure that crosses the daemon's API is an [`ApiError`]: a stable machine-readable
//! [`ErrorCode`], a one-sentence message naming what failed, and a hint naming the fix. The code
//! maps to an HTTP status; the CLI prints `error: <message>` and `hint: <hint>`.

use serde::{Deserialize, Serialize};

/// Stable error codes. Their `snake_case` names are part of the API and never change meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request was malformed (bad JSON, bad name, bad flag combination).
    InvalidRequest,
    /// The named sandbox does not exist.
    SandboxNotFound,
    /// The named image does not exist.
    ImageNotFound,
    /// The named checkpoint does not exist.
    CheckpointNotFound,
    /// The named background process does not exist in that sandbox.
    ProcessNotFound,
    /// A sandbox or image with that name already exists.
    NameConflict,
    /// The object is in a state that does not allow the operation (e.g. removing a running
    /// sandbox without `--force`).
    Conflict,
    /// An archive or directory to import contains an unsafe entry.
    UnsafeArchive,
    /// The host lacks something Crab needs (btrfs, cgroup2, BPF, CRIU, root).
    HostUnsupported,
    /// The daemon lacks a capability the operation needs on this sandbox (e.g.
    /// `CAP_SYS_RESOURCE`, without which CRIU cannot dump a non-root process); the sandbox is
    /// left as it was.
    HostCapabilityMissing,
    /// The storage pool is full.
    PoolFull,
    /// A checkpoint's files failed verification.
    CorruptCheckpoint,
    /// CRIU failed; the message names its log file.
    CriuFailed,
    /// A command ran past its timeout.
    Timeout,
    /// An upstream service (LLM endpoint) failed.
    Upstream,
    /// A request body is larger than the server accepts.
    TooLarge,
    /// A client did not send its request (head or body) in time.
    RequestTimeout,
    /// A bound is reached (connections, request bytes in memory); retry shortly.
    Busy,
    /// A path inside a sandbox does not exist (the file service).
    NotFound,
    /// A path inside a sandbox exists already (the file service's mkdir).
    AlreadyExists,
    /// The sandbox's user may not do that to a path inside it (the file service).
    PermissionDenied,
    /// Anything else; the message says what.
    Internal,
}

impl ErrorCode {
    /// The HTTP status this code maps to.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::UnsafeArchive => 400,
            ErrorCode::SandboxNotFound
            | ErrorCode::ImageNotFound
            | ErrorCode::CheckpointNotFound
            | ErrorCode::ProcessNotFound
            | ErrorCode::NotFound => 404,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NameConflict | ErrorCode::Conflict | ErrorCode::AlreadyExists => 409,
            ErrorCode::CorruptCheckpoint => 422,
            ErrorCode::Timeout => 504,
            ErrorCode::Upstream => 502,
            ErrorCode::TooLarge => 413,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::Busy => 503,
            ErrorCode::HostUnsupported | ErrorCode::HostCapabilityMissing => 501,
            ErrorCode::PoolFull => 507,
            ErrorCode::CriuFailed | ErrorCode::Internal => 500,
        }
    }

    /// The stable string form (`sandbox_not_found`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::SandboxNotFound => "sandbox_not_found",
            ErrorCode::ImageNotFound => "image_not_found",
            ErrorCode::CheckpointNotFound => "checkpoint_not_found",
            ErrorCode::ProcessNotFound => "process_not_found",
            ErrorCode::NameConflict => "name_conflict",
            ErrorCode::Conflict => "conflict",
            ErrorCode::UnsafeArchive => "unsafe_archive",
            ErrorCode::HostUnsupported => "host_unsupported",
            ErrorCode::HostCapabilityMissing => "host_capability_missing",
            ErrorCode::PoolFull => "pool_full",
            ErrorCode::CorruptCheckpoint => "corrupt_checkpoint",
            ErrorCode::CriuFailed => "criu_failed",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Upstream => "upstream",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::Busy => "busy",
            ErrorCode::NotFound => "not_found",
            ErrorCode::AlreadyExists => "already_exists",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::Internal => "internal",
        }
    }
}

/// An error as the API returns it: code, message (what failed) and hint (the fix).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// One sentence naming what failed.
    pub message: String,
    /// What to do about it; empty when there is nothing useful to say.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hint: String,
}

impl ApiError {
    /// A new error with a code, message and hint.
    pub fn new(code: ErrorCode, message: impl Into<String>, hint: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), hint: hint.into() }
    }

    /// An internal error with no particular hint.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::Internal, message, "")
    }

    /// Invalid request.
    pub fn invalid(message: impl Into<String>, hint: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InvalidRequest, message, hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_json() {
        let e = ApiError::new(
            ErrorCode::SandboxNotFound,
            "no sandbox named x",
            "run `crab sandbox ls`",
        );
        let s = serde_json::to_string(&e).unwrap();
        assert!(s.contains("\"sandbox_not_found\""));
        let back: ApiError = serde_json::from_str(&s).unwrap();
        assert_eq!(back, e);
        assert_eq!(back.code.http_status(), 404);
        assert_eq!(back.code.as_str(), "sandbox_not_found");
    }
}
