//! Errors of checkpoint, restore, fork and prune, and their mapping to the API's error codes.
//!
//! Every variant names what failed: the file or directory, the restore point, the CRIU log. A
//! corrupt or partial checkpoint is always [`CheckpointError::Corrupt`] naming the offending
//! file, so that the API can answer `corrupt_checkpoint` and refuse the restore.

use std::path::{Path, PathBuf};

use crab_common::{ApiError, ErrorCode};

/// Result of this crate.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// What can go wrong with restore points.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file-system operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The operation (`open`, `rename`, `fsync`, `snapshot`...).
        op: &'static str,
        /// The path it concerned.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },

    /// The named restore point does not exist.
    #[error("sandbox {sandbox} has no restore point {id}")]
    NotFound {
        /// Sandbox.
        sandbox: String,
        /// The id asked for.
        id: String,
    },

    /// The sandbox has no restore point at all.
    #[error("sandbox {sandbox} has no restore points")]
    NoPoints {
        /// Sandbox.
        sandbox: String,
    },

    /// A manifest or image file failed verification (missing, truncated, wrong hash, bad
    /// magic or version).
    #[error("corrupt checkpoint: {}: {reason}", path.display())]
    Corrupt {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// Process images that did not come from this host would give their tasks more than the
    /// profile the sandbox runs with (see [`crate::foreign`]); nothing was restored.
    #[error("process images {} refused: {source}", dir.display())]
    Untrusted {
        /// The image directory.
        dir: PathBuf,
        /// The task, field and value refused.
        source: crab_criu::images::ImageError,
    },

    /// CRIU failed (the message names its log).
    #[error(transparent)]
    Criu(#[from] crab_criu::CriuError),

    /// The named sandbox does not exist.
    #[error("no sandbox named {0:?}")]
    SandboxNotFound(String),

    /// The sandbox runtime failed; `api` keeps its code (a full pool stays `pool_full`).
    #[error("sandbox {sandbox}: {}", api.message)]
    Runtime {
        /// Sandbox.
        sandbox: String,
        /// The runtime's error, as the API reports it.
        api: ApiError,
    },

    /// Something about the sandbox failed outside the runtime (its cgroup, its init).
    #[error("sandbox {sandbox}: {message}")]
    Sandbox {
        /// Sandbox.
        sandbox: String,
        /// What failed.
        message: String,
    },

    /// The request cannot be served as asked.
    #[error("{0}")]
    Invalid(String),
}

impl CheckpointError {
    /// An [`CheckpointError::Io`] for `path`.
    pub fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        CheckpointError::Io { op, path: path.to_path_buf(), source }
    }

    /// A [`CheckpointError::Corrupt`] for `path`.
    pub fn corrupt(path: &Path, reason: impl Into<String>) -> Self {
        CheckpointError::Corrupt { path: path.to_path_buf(), reason: reason.into() }
    }

    /// The API form of this error: stable code, message, hint.
    pub fn to_api(&self) -> ApiError {
        let msg = self.to_string();
        match self {
            CheckpointError::NotFound { sandbox, .. } | CheckpointError::NoPoints { sandbox } => {
                ApiError::new(
                    ErrorCode::CheckpointNotFound,
                    msg,
                    format!("list them with `crab checkpoints {sandbox}`"),
                )
            }
            CheckpointError::Corrupt { .. } => ApiError::new(
                ErrorCode::CorruptCheckpoint,
                msg,
                "the sandbox was left as it was; restore an older point (`crab checkpoints SB`)",
            ),
            CheckpointError::Untrusted { .. } => ApiError::new(
                ErrorCode::CorruptCheckpoint,
                msg,
                "nothing was restored: the point's process images were altered after the dump, or it \
                 was taken by a --privileged sandbox or a daemon with another seccomp filter; \
                 restore its files only (--fs-only)",
            ),
            CheckpointError::Criu(e) => match e {
                crab_criu::CriuError::NotFound { .. } => {
                    ApiError::new(ErrorCode::HostUnsupported, msg, e.hint())
                }
                _ => ApiError::new(ErrorCode::CriuFailed, msg, e.hint()),
            },
            CheckpointError::Invalid(_) => ApiError::invalid(msg, ""),
            CheckpointError::SandboxNotFound(_) => {
                ApiError::new(ErrorCode::SandboxNotFound, msg, "list them with `crab sandbox ls`")
            }
            CheckpointError::Io { source, .. }
                if source.raw_os_error() == Some(libc::ENOSPC)
                    || source.kind() == std::io::ErrorKind::StorageFull =>
            {
                ApiError::new(
                    ErrorCode::PoolFull,
                    msg,
                    "prune restore points (`crab checkpoints prune SB --keep-last N`)",
                )
            }
            CheckpointError::Runtime { api, .. } => ApiError::new(api.code, msg, api.hint.clone()),
            CheckpointError::Io { .. } | CheckpointError::Sandbox { .. } => ApiError::internal(msg),
        }
    }
}
