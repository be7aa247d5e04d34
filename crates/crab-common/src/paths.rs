//! The layout of Crab's state directory.
//!
//! ```text
//! <state>/                 default /var/lib/crab (CRAB_STATE_DIR, --state-dir)
//!   crab.sock              the daemon's API socket (mode 0600)
//!   daemon.pid             pid of the running daemon
//!   pool.img               sparse btrfs image, only when <state> is not on btrfs
//!   logs/                  CRIU and build logs
//!   pool/                  btrfs: a loop mount of pool.img, or a directory when <state> is btrfs
//!     images/<name>        read-only subvolume: the image's root filesystem
//!     images/<name>.json   image record
//!     sandboxes/<name>/    one directory per sandbox
//!       rootfs             writable subvolume, a snapshot of the image
//!       sandbox.json       sandbox record
//!     checkpoints/<name>/  restore points of a sandbox (see docs/format.md)
//!     tmp/                 staging area; anything here at daemon start is a leftover
//! ```

use std::path::{Path, PathBuf};

/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/crab";

/// Paths inside one state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// Layout rooted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        StateDir { root: root.into() }
    }

    /// The state directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// The API socket.
    pub fn socket(&self) -> PathBuf {
        self.root.join("crab.sock")
    }
    /// The daemon's pid file.
    pub fn pid_file(&self) -> PathBuf {
        self.root.join("daemon.pid")
    }
    /// The sparse pool image (used when the state directory is not on btrfs).
    pub fn pool_image(&self) -> PathBuf {
        self.root.join("pool.img")
    }
    /// The btrfs pool mount point.
    pub fn pool(&self) -> PathBuf {
        self.root.join("pool")
    }
    /// Log directory.
    pub fn logs(&self) -> PathBuf {
        self.root.join("logs")
    }
    /// Directory of image subvolumes and records.
    pub fn images(&self) -> PathBuf {
        self.pool().join("images")
    }
    /// An image's root filesystem subvolume.
    pub fn image_rootfs(&self, name: &str) -> PathBuf {
        self.images().join(name)
    }
    /// An image's record.
    pub fn image_record(&self, name: &str) -> PathBuf {
        self.images().join(format!("{name}.json"))
    }
    /// Directory of sandboxes.
    pub fn sandboxes(&self) -> PathBuf {
        self.pool().join("sandboxes")
    }
    /// One sandbox's directory.
    pub fn sandbox_dir(&self, name: &str) -> PathBuf {
        self.sandboxes().join(name)
    }
    /// A sandbox's writable root subvolume.
    pub fn sandbox_rootfs(&self, name: &str) -> PathBuf {
        self.sandbox_dir(name).join("rootfs")
    }
    /// A sandbox's record.
    pub fn sandbox_record(&self, name: &str) -> PathBuf {
        self.sandbox_dir(name).join("sandbox.json")
    }
    /// Directory of a sandbox's restore points.
    pub fn checkpoints(&self, sandbox: &str) -> PathBuf {
        self.pool().join("checkpoints").join(sandbox)
    }
    /// Staging area for work in progress; cleared at daemon start.
    pub fn tmp(&self) -> PathBuf {
        self.pool().join("tmp")
    }
}

impl Default for StateDir {
    fn default() -> Self {
        StateDir::new(DEFAULT_STATE_DIR)
    }
}
