//! Errors of the sandbox runtime and their mapping to API errors.
//!
//! Each variant names what failed (the path, the syscall, the command) and converts into a
//! [`crab_common::ApiError`] with a stable code and a hint that names the fix.

use std::path::PathBuf;

use crab_common::{ApiError, ErrorCode};

use crate::btrfs::BtrfsError;
use crate::cgroup::CgroupError;

/// Result alias of this crate.
pub type Result<T, E = SandboxError> = std::result::Result<T, E>;

/// What went wrong in the sandbox runtime.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// Not running as root.
    #[error("crab must run as root (euid is {0})")]
    NotRoot(u32),
    /// Something the host lacks.
    #[error("{what}")]
    Host {
        /// What is missing.
        what: String,
        /// How to get it.
        hint: String,
    },
    /// No such sandbox.
    #[error("no sandbox named {0:?}")]
    NoSandbox(String),
    /// No such background process in that sandbox.
    #[error("sandbox {sandbox:?} has no background process {id}")]
    NoProcess {
        /// The sandbox.
        sandbox: String,
        /// The process id asked for.
        id: String,
    },
    /// No such image.
    #[error("no image named {0:?}")]
    NoImage(String),
    /// Name taken.
    #[error("a {kind} named {name:?} already exists")]
    NameTaken {
        /// `sandbox` or `image`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// Operation not allowed in the current state.
    #[error("{0}")]
    Conflict(String),
    /// A bad request.
    #[error("{0}")]
    Invalid(String),
    /// An unsafe entry in an archive or directory to import.
    #[error("refusing to import {source_path}: entry {entry:?} {why}")]
    UnsafeEntry {
        /// The archive or directory.
        source_path: PathBuf,
        /// The entry.
        entry: String,
        /// Why it is unsafe.
        why: String,
    },
    /// The pool is out of space.
    #[error("the storage pool at {0} is full")]
    PoolFull(PathBuf),
    /// A btrfs ioctl failed.
    #[error(transparent)]
    Btrfs(#[from] BtrfsError),
    /// A cgroup operation failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// An I/O operation on a path failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An external command failed.
    #[error("{cmd} failed: {detail}")]
    Command {
        /// The command line.
        cmd: String,
        /// Exit status and the tail of its output or log.
        detail: String,
    },
    /// A command timed out.
    #[error("{0}")]
    Timeout(String),
    /// A Dockerfile step failed (its command exited non-zero, or its input was refused).
    #[error("{step} (Dockerfile line {line}) failed: {detail}")]
    BuildStep {
        /// `step 3/9 RUN make` (the instruction, shortened).
        step: String,
        /// Its line in the Dockerfile.
        line: usize,
        /// The exit code and the last output lines, or why it was refused.
        detail: String,
    },
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

impl SandboxError {
    /// Helper to build an [`SandboxError::Io`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| {
            if source.raw_os_error() == Some(libc::ENOSPC) {
                SandboxError::PoolFull(path)
            } else {
                SandboxError::Io { op, path, source }
            }
        }
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> ApiError {
        let msg = e.to_string();
        match e {
            SandboxError::NotRoot(_) => {
                ApiError::new(ErrorCode::HostUnsupported, msg, "run crab as root (sudo crab ...)")
            }
            SandboxError::Host { hint, .. } => ApiError::new(ErrorCode::HostUnsupported, msg, hint),
            SandboxError::NoSandbox(_) => {
                ApiError::new(ErrorCode::SandboxNotFound, msg, "list sandboxes with `crab sandbox ls`")
            }
            SandboxError::NoProcess { ref sandbox, .. } => ApiError::new(
                ErrorCode::ProcessNotFound,
                msg.clone(),
                format!("list its background processes with `crab ps {sandbox}`"),
            ),
            SandboxError::NoImage(_) => ApiError::new(
                ErrorCode::ImageNotFound,
                msg,
                "list images with `crab image ls`; build the default one with `crab image build debian`",
            ),
            SandboxError::NameTaken { .. } => {
                ApiError::new(ErrorCode::NameConflict, msg, "choose another --name or remove the old one")
            }
            SandboxError::Conflict(_) => ApiError::new(ErrorCode::Conflict, msg, ""),
            SandboxError::Invalid(_) => ApiError::new(ErrorCode::InvalidRequest, msg, ""),
            SandboxError::UnsafeEntry { .. } => ApiError::new(
                ErrorCode::UnsafeArchive,
                msg,
                "remove or fix that entry; images may not contain absolute paths, `..` or links leaving the root",
            ),
            SandboxError::PoolFull(_) => ApiError::new(
                ErrorCode::PoolFull,
                msg,
                "remove sandboxes, images or checkpoints, or restart the daemon with a larger --pool-size",
            ),
            SandboxError::Btrfs(ref b) if b.is_no_space() => ApiError::new(
                ErrorCode::PoolFull,
                msg,
                "remove sandboxes, images or checkpoints, or use a larger --pool-size",
            ),
            SandboxError::Timeout(_) => ApiError::new(ErrorCode::Timeout, msg, ""),
            SandboxError::BuildStep { .. } => ApiError::new(
                ErrorCode::InvalidRequest,
                msg,
                "fix that step of the Dockerfile; the steps before it are cached for the next build",
            ),
            SandboxError::Btrfs(_)
            | SandboxError::Cgroup(_)
            | SandboxError::Io { .. }
            | SandboxError::Command { .. }
            | SandboxError::Other(_) => ApiError::internal(msg),
        }
    }
}
