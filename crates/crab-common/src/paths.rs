//! The layout of Crab's state directory.
//!
//! ```text
//! <state>/                 default /var/lib/crab (CRAB_STATE_DIR, --state-dir)
//!   crab.sock              the daemon's API socket (mode 0600)
//!   daemon.pid             pid of the running daemon
//!   pool.img               sparse btrfs image, only when <state> is not on btrfs
//!   logs/                  CRIU and build logs
//!   masked/                an empty read-only tmpfs: the source of restored sandboxes' masked dirs
//!   pool/                  btrfs: a loop mount of pool.img, or a directory when <state> is btrfs
//!     images/<name>        read-only subvolume: the image's root filesystem
//!     images/<name>.json   image record
//!     sandboxes/<name>/    one directory per sandbox
//!       rootfs             writable subvolume, a snapshot of the image
//!       sandbox.json       sandbox record
//!     checkpoints/<name>/  restore points of a sandbox (see docs/format.md)
//!     tmp/                 staging area; anything here at daemon start is a leftover
//! ```
//!
//! Host-wide objects a daemon creates (cgroups today; nftables tables and the like for anyone
//! who adds them) carry the state directory's [`StateDir::instance`] name, so two daemons on one
//! host never touch each other's sandboxes even when their sandbox names are equal.

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
    /// Points of `sandbox` materialized from a remote store: a namespace of their own, apart
    /// from every local sandbox's [`StateDir::checkpoints`], so a remote point never becomes a
    /// point of a local sandbox that happens to bear its sandbox's name.
    pub fn remote_points(&self, sandbox: &str) -> PathBuf {
        self.pool().join("remote-points").join(sandbox)
    }
    /// Staging area for work in progress; cleared at daemon start.
    pub fn tmp(&self) -> PathBuf {
        self.pool().join("tmp")
    }
    /// An empty read-only tmpfs the daemon mounts here: restored and forked sandboxes get
    /// their masked `/proc` directories as read-only binds of it (`crab_sandbox::profile`).
    pub fn masked(&self) -> PathBuf {
        self.root.join("masked")
    }
}

impl StateDir {
    /// The name of the daemon instance that owns this state directory: its last path component
    /// (lower-cased, other characters than `[a-z0-9-]` dropped, at most 24 characters) and 8 hex
    /// digits of an FNV-1a hash of the absolute path, e.g. `crab-harden-1f3a9c0e` for
    /// `/var/lib/crab-harden`. Stable across restarts; distinct for distinct directories.
    pub fn instance(&self) -> String {
        let abs = std::fs::canonicalize(&self.root).unwrap_or_else(|_| {
            if self.root.is_absolute() {
                self.root.clone()
            } else {
                std::env::current_dir().map(|d| d.join(&self.root)).unwrap_or(self.root.clone())
            }
        });
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in abs.as_os_str().as_encoded_bytes() {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let base: String = abs
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default()
            .chars()
            .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .take(24)
            .collect();
        let base = if base.is_empty() { "root".to_string() } else { base };
        format!("{base}-{:08x}", (hash ^ (hash >> 32)) as u32)
    }

    /// The cgroup (relative to each hierarchy's root) under which this daemon's sandboxes live:
    /// `crab-<instance>`.
    pub fn cgroup_parent(&self) -> String {
        format!("crab-{}", self.instance())
    }
}

impl Default for StateDir {
    fn default() -> Self {
        StateDir::new(DEFAULT_STATE_DIR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_differ_per_directory_and_are_stable() {
        let a = StateDir::new("/var/lib/crab-a").instance();
        let b = StateDir::new("/var/lib/crab-b").instance();
        assert_ne!(a, b);
        assert!(a.starts_with("crab-a-"), "{a}");
        assert_eq!(a, StateDir::new("/var/lib/crab-a").instance());
        assert_eq!(
            StateDir::new("/x/Weird Name!").cgroup_parent().len(),
            "crab-weirdname-".len() + 8
        );
    }
}
