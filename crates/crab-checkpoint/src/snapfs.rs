//! The filesystem-snapshot operations restore points need, behind a small trait.
//!
//! This module owns [`SnapshotFs`]: take a (read-only or writable) snapshot of a directory tree,
//! delete one, tell whether one exists. On the btrfs pool it is implemented with subvolume
//! ioctls (the daemon wires in `crab_sandbox::btrfs`); [`CopyFs`] implements it with plain
//! recursive copies, for tests on any filesystem and as the reference semantics.

use std::io;
use std::path::Path;

/// Snapshots of directory trees.
pub trait SnapshotFs: Send + Sync + std::fmt::Debug {
    /// Make `dst` (which must not exist; its parent must) a snapshot of `src`.
    fn snapshot(&self, src: &Path, dst: &Path, readonly: bool) -> io::Result<()>;
    /// Make writable snapshot `path` read-only (a tree edited after its snapshot was taken).
    /// Implementations that do not enforce read-only snapshots do nothing.
    fn seal(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }
    /// Delete a snapshot made by [`SnapshotFs::snapshot`] (or any directory tree).
    fn delete(&self, path: &Path) -> io::Result<()>;
    /// Whether `path` is a snapshot that can be restored from.
    fn is_snapshot(&self, path: &Path) -> bool {
        path.is_dir()
    }
    /// Bytes changed in `snap` since `prev` (both snapshots of the same tree), when the
    /// implementation can tell cheaply.
    fn delta_bytes(&self, _prev: Option<&Path>, _snap: &Path) -> Option<u64> {
        None
    }
}

/// [`SnapshotFs`] by recursive copy (regular files, directories, symlinks; modes kept;
/// read-only snapshots are not enforced).
#[derive(Debug, Default, Clone, Copy)]
pub struct CopyFs;

fn copy_tree(src: &Path, dst: &Path) -> io::Result<u64> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::symlink_metadata(src)?;
    let ft = meta.file_type();
    if ft.is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(src)?, dst)?;
        Ok(0)
    } else if ft.is_dir() {
        std::fs::create_dir(dst)?;
        let mut total = 0;
        for entry in std::fs::read_dir(src)? {
            let entry = entry?;
            total += copy_tree(&entry.path(), &dst.join(entry.file_name()))?;
        }
        std::fs::set_permissions(dst, std::fs::Permissions::from_mode(meta.permissions().mode()))?;
        Ok(total)
    } else if ft.is_file() {
        std::fs::copy(src, dst)
    } else {
        // Device nodes, fifos and sockets are not carried by copies.
        Ok(0)
    }
}

impl SnapshotFs for CopyFs {
    fn snapshot(&self, src: &Path, dst: &Path, _readonly: bool) -> io::Result<()> {
        if dst.exists() {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "snapshot target exists"));
        }
        copy_tree(src, dst).map(|_| ())
    }

    fn delete(&self, path: &Path) -> io::Result<()> {
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
            Ok(_) => std::fs::remove_file(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}
