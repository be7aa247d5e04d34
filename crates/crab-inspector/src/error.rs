//! The inspector's error type: every failure names the operation, the object (path, map,
//! program, sandbox) and, through [`InspectorError::to_api`], the fix.

use std::path::PathBuf;

use crab_common::{ApiError, ErrorCode};

/// Errors of [`crate::Inspector`].
#[derive(Debug, thiserror::Error)]
pub enum InspectorError {
    /// Not running as root (loading BPF programs needs CAP_BPF + CAP_PERFMON + CAP_SYS_ADMIN).
    #[error("the inspector needs root to load BPF programs (running as uid {uid})")]
    NotRoot {
        /// Effective uid of the process.
        uid: u32,
    },
    /// Opening, loading or attaching the BPF object failed.
    #[error("BPF {stage} failed{}: {source}", what.as_deref().map(|w| format!(" for {w}")).unwrap_or_default())]
    Bpf {
        /// open, load, attach, map update...
        stage: &'static str,
        /// The program or map concerned.
        what: Option<String>,
        /// libbpf's error.
        source: libbpf_rs::Error,
    },
    /// A BPF map syscall failed.
    #[error("{syscall} on BPF map {map} failed: {source}")]
    MapSyscall {
        /// bpf(2) command (BPF_MAP_LOOKUP_BATCH...).
        syscall: &'static str,
        /// Map name.
        map: &'static str,
        /// errno.
        source: std::io::Error,
    },
    /// A filesystem call on a cgroup or /proc path failed.
    #[error("{syscall} {path} failed: {source}")]
    Io {
        /// The call (stat, read...).
        syscall: &'static str,
        /// The path.
        path: PathBuf,
        /// errno.
        source: std::io::Error,
    },
    /// The directory is not a cgroup v2 directory.
    #[error("{path} is not a cgroup v2 directory")]
    NotCgroup2 {
        /// The path given.
        path: PathBuf,
    },
    /// The sandbox is not attached.
    #[error("sandbox {0:?} is not attached to the inspector")]
    NotAttached(String),
    /// The sandbox is already attached.
    #[error("sandbox {0:?} is already attached to the inspector")]
    AlreadyAttached(String),
    /// All sandbox slots are in use.
    #[error("the inspector tracks at most {max} sandboxes at once")]
    TooManySandboxes {
        /// The limit.
        max: usize,
    },
    /// All muted-tracer slots are in use.
    #[error("at most {max} CRIU processes can be muted at once")]
    TooManyTracers {
        /// The limit.
        max: usize,
    },
    /// The inspector's state lock was poisoned by a panic.
    #[error("the inspector's state lock was poisoned by an earlier panic")]
    Poisoned,
}

impl InspectorError {
    /// The API form of this error, with a hint naming the fix.
    pub fn to_api(&self) -> ApiError {
        let (code, hint) = match self {
            InspectorError::NotRoot { .. } => {
                (ErrorCode::HostUnsupported, "run the daemon as root")
            }
            InspectorError::Bpf { .. } => (
                ErrorCode::HostUnsupported,
                "the kernel must support BPF tracepoints, BTF and cgroup v2 (Linux >= 5.15)",
            ),
            InspectorError::NotCgroup2 { .. } => (
                ErrorCode::HostUnsupported,
                "give the sandbox's directory in the cgroup2 hierarchy (e.g. /sys/fs/cgroup/unified/crab/NAME)",
            ),
            InspectorError::NotAttached(_) => {
                (ErrorCode::SandboxNotFound, "attach the sandbox to the inspector first")
            }
            InspectorError::AlreadyAttached(_) => {
                (ErrorCode::Conflict, "detach the sandbox before attaching it again")
            }
            InspectorError::TooManyTracers { .. } => {
                (ErrorCode::Conflict, "unmute CRIU processes that have finished")
            }
            InspectorError::TooManySandboxes { .. } => {
                (ErrorCode::Conflict, "detach sandboxes that are no longer running")
            }
            InspectorError::MapSyscall { .. }
            | InspectorError::Io { .. }
            | InspectorError::Poisoned => (ErrorCode::Internal, "see the daemon log"),
        };
        ApiError::new(code, self.to_string(), hint)
    }
}
