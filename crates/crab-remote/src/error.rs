//! Errors of the remote store. Every variant names the object, file or URL it concerns, and
//! corrupt or missing remote data always names the remote object (pack, index, point, blob).

use std::path::PathBuf;

/// Result of this crate.
pub type Result<T, E = RemoteError> = std::result::Result<T, E>;

/// What can go wrong with the remote store.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The `--remote` URL cannot be used.
    #[error("remote URL {url:?}: {reason} (use file:///absolute/dir or s3://bucket/prefix)")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The object store refused or failed an operation (after its own retries).
    #[error("remote {remote}: {op} {object}: {source}")]
    Store {
        /// The repository URL.
        remote: String,
        /// `get`, `put`, `list`, `delete`.
        op: &'static str,
        /// The object key.
        object: String,
        /// The backend's error.
        source: Box<object_store::Error>,
    },

    /// A remote object failed verification: its bytes are not what its name or the index
    /// promises. Nothing read from it is used.
    #[error("corrupt remote object {object}: {reason}")]
    Corrupt {
        /// The object key (and blob id where it applies).
        object: String,
        /// What is wrong.
        reason: String,
    },

    /// A remote object that a point references does not exist.
    #[error("missing remote object {object}: {what}")]
    Missing {
        /// The object key or blob id.
        object: String,
        /// Who needed it.
        what: String,
    },

    /// The named point is not in the remote.
    #[error("the remote has no point {what}; list what it holds with `crab remote ls`")]
    NoPoint {
        /// `sandbox@point` or `sandbox`.
        what: String,
    },

    /// A local file-system operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The operation.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },

    /// Another process holds a conflicting lock on the repository.
    #[error("remote {remote} is locked by {holder}; retry later (a lock older than {stale_s} s is ignored)")]
    Locked {
        /// The repository URL.
        remote: String,
        /// Who holds it (kind, host, pid, age).
        holder: String,
        /// Age after which a lock is stale.
        stale_s: u64,
    },

    /// The encryption key is missing, malformed or not this repository's.
    #[error("remote key: {0}")]
    Key(String),

    /// A remote point asks for something this host does not grant (a privileged profile,
    /// another network, looser limits, more bytes than the new sandbox's disk limit); refused
    /// before anything was written.
    #[error("remote point {point} refused: {}; nothing was written", refusal.reason)]
    Refused {
        /// `sandbox@point`.
        point: String,
        /// What was refused.
        refusal: Refusal,
    },

    /// Materializing a remote point would write more than the pool has room for; refused
    /// before anything was written.
    #[error("remote point {point} declares {need} bytes to write, the pool has {free} bytes free and keeps {reserve} of them free; nothing was written")]
    PoolFull {
        /// `sandbox@point`.
        point: String,
        /// Bytes its trees declare to be written.
        need: u64,
        /// Bytes free in the pool.
        free: u64,
        /// Bytes the pool keeps free.
        reserve: u64,
    },

    /// The point cannot be restored on this host (kernel, CRIU, CPU flags, image).
    #[error("cannot restore processes of {point} on this host: {mismatch}; use --fs-only to restore its files and conversation only")]
    Preflight {
        /// `sandbox@point`.
        point: String,
        /// What differs.
        mismatch: String,
    },

    /// The remote holds another point under this point's name (`points/<sandbox>/<id>`): one
    /// of an earlier sandbox of the same name, or another host's. It is never overwritten.
    #[error("the remote already holds {point} of another sandbox of that name (taken at {theirs_ms} ms since the epoch on {host:?}; this one at {ours_ms}); it is not overwritten")]
    PointTaken {
        /// `sandbox@point`.
        point: String,
        /// When the remote's point was taken.
        theirs_ms: u64,
        /// The host that exported it.
        host: String,
        /// When this point was taken.
        ours_ms: u64,
    },

    /// The point's process images would give their tasks more than the default profile
    /// (`crab_checkpoint::foreign`): refused before the point became local or anything ran.
    #[error("refusing {point}: {reason}")]
    Untrusted {
        /// `point sandbox@point`.
        point: String,
        /// The task, field and value refused.
        reason: String,
    },
}

/// What a refused remote point asked for, and what this host grants instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The manifest field (`sandbox_meta.profile.privileged`, `sandbox_meta.net`, …) or the
    /// quantity (`disk limit`) that was refused.
    pub field: String,
    /// What the point asks for and what this host grants.
    pub reason: String,
    /// How the caller can restore it anyway, when it can.
    pub fix: String,
}

impl RemoteError {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> RemoteError {
        let path = path.into();
        move |source| RemoteError::Io { op, path, source }
    }

    pub(crate) fn corrupt(object: impl Into<String>, reason: impl Into<String>) -> RemoteError {
        RemoteError::Corrupt { object: object.into(), reason: reason.into() }
    }
}
