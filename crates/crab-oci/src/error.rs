//! [`OciError`]: what reading an image failed with, each naming the problem and what to do.

use std::path::PathBuf;

use crab_common::{ApiError, ErrorCode};

/// Result with [`OciError`].
pub type Result<T, E = OciError> = std::result::Result<T, E>;

/// Why reading an image failed.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The input is not a well-formed image (bad JSON, missing blob, wrong media type, …).
    #[error("{0}")]
    Invalid(String),
    /// A blob's bytes do not match its digest.
    #[error("{what} has digest {got}, not the {want} it is named by; the image is corrupt or was tampered with")]
    Digest {
        /// What the blob is (`config`, `layer 2`, `manifest`).
        what: String,
        /// The digest it should have.
        want: String,
        /// The digest its bytes have.
        got: String,
    },
    /// No manifest for the wanted platform.
    #[error("the image has no manifest for {wanted} (it has: {have})")]
    Platform {
        /// The platform asked for.
        wanted: String,
        /// The platforms the index lists.
        have: String,
    },
    /// A file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The operation.
        op: &'static str,
        /// Its path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The registry refused or failed.
    #[error("{message}")]
    Registry {
        /// What happened.
        message: String,
        /// What to do.
        hint: String,
        /// Whether credentials were missing or refused.
        auth: bool,
    },
}

impl OciError {
    /// An I/O error constructor for `map_err`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| OciError::Io { op, path, source }
    }

    /// The API error to render.
    pub fn to_api(&self) -> ApiError {
        match self {
            OciError::Invalid(_) | OciError::Digest { .. } => ApiError::new(
                ErrorCode::InvalidRequest,
                self.to_string(),
                "check the image source; nothing was installed",
            ),
            OciError::Platform { .. } => ApiError::new(
                ErrorCode::InvalidRequest,
                self.to_string(),
                "pick one of them with --platform OS/ARCH",
            ),
            OciError::Io { .. } => ApiError::internal(self.to_string()),
            OciError::Registry { message, hint, .. } => {
                ApiError::new(ErrorCode::Upstream, message.clone(), hint.clone())
            }
        }
    }
}
