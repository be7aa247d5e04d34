//! Btrfs subvolume operations through the kernel's ioctls.
//!
//! Crab keeps images, sandbox root filesystems and filesystem checkpoints as btrfs subvolumes.
//! This module issues the ioctls directly (no `btrfs` process per operation): create a
//! subvolume, snapshot one (writable or read-only), delete one, and flip the read-only flag. A
//! snapshot is a constant-time copy-on-write clone, which is what makes sandbox creation and
//! filesystem checkpoints cost milliseconds.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `BTRFS_SUPER_MAGIC` from `linux/magic.h`.
pub const BTRFS_SUPER_MAGIC: i64 = 0x9123_683E;
const BTRFS_IOCTL_MAGIC: u8 = 0x94;
const BTRFS_SUBVOL_RDONLY: u64 = 1 << 1;
const BTRFS_PATH_NAME_MAX: usize = 4087;
const BTRFS_SUBVOL_NAME_MAX: usize = 4039;

/// `struct btrfs_ioctl_vol_args`.
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; BTRFS_PATH_NAME_MAX + 1],
}

/// `struct btrfs_ioctl_vol_args_v2` (the union members we do not use are kept as padding).
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; BTRFS_SUBVOL_NAME_MAX + 1],
}

nix::ioctl_write_ptr!(ioc_subvol_create, BTRFS_IOCTL_MAGIC, 14, VolArgs);
nix::ioctl_write_ptr!(ioc_snap_destroy, BTRFS_IOCTL_MAGIC, 15, VolArgs);
nix::ioctl_write_ptr!(ioc_snap_create_v2, BTRFS_IOCTL_MAGIC, 23, VolArgsV2);
nix::ioctl_read!(ioc_subvol_getflags, BTRFS_IOCTL_MAGIC, 25, u64);
nix::ioctl_write_ptr!(ioc_subvol_setflags, BTRFS_IOCTL_MAGIC, 26, u64);

/// A failed btrfs operation, naming the operation and the path.
#[derive(Debug, thiserror::Error)]
#[error("btrfs {op} of {path}: {source}")]
pub struct BtrfsError {
    /// The operation (`snapshot`, `subvolume create`, ...).
    pub op: &'static str,
    /// The path it acted on.
    pub path: PathBuf,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

impl BtrfsError {
    fn new(op: &'static str, path: &Path, source: impl Into<std::io::Error>) -> Self {
        BtrfsError { op, path: path.to_path_buf(), source: source.into() }
    }

    /// Whether the underlying error is "no space left on device".
    pub fn is_no_space(&self) -> bool {
        self.source.raw_os_error() == Some(libc::ENOSPC)
    }
}

fn split(op: &'static str, path: &Path) -> Result<(File, CString), BtrfsError> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| {
        BtrfsError::new(op, path, std::io::Error::new(std::io::ErrorKind::InvalidInput, "no name"))
    })?;
    let dir = File::open(parent).map_err(|e| BtrfsError::new(op, parent, e))?;
    let name = CString::new(name.as_bytes()).map_err(|_| {
        BtrfsError::new(op, path, std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL"))
    })?;
    Ok((dir, name))
}

fn copy_name(
    dst: &mut [u8],
    name: &CString,
    op: &'static str,
    path: &Path,
) -> Result<(), BtrfsError> {
    let bytes = name.as_bytes();
    if bytes.len() >= dst.len() {
        return Err(BtrfsError::new(
            op,
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "name too long"),
        ));
    }
    dst[..bytes.len()].copy_from_slice(bytes);
    Ok(())
}

/// Whether `path` lives on a btrfs filesystem.
pub fn is_btrfs(path: &Path) -> std::io::Result<bool> {
    let st = nix::sys::statfs::statfs(path)?;
    Ok(st.filesystem_type().0 == BTRFS_SUPER_MAGIC)
}

/// Create an empty subvolume at `path` (its parent must exist).
pub fn create_subvolume(path: &Path) -> Result<(), BtrfsError> {
    let (dir, name) = split("subvolume create", path)?;
    let mut args = VolArgs { fd: 0, name: [0; BTRFS_PATH_NAME_MAX + 1] };
    copy_name(&mut args.name, &name, "subvolume create", path)?;
    // SAFETY: `dir` is an open directory fd and `args` is a properly initialised
    // `btrfs_ioctl_vol_args` that outlives the call.
    unsafe { ioc_subvol_create(dir.as_raw_fd(), &args) }
        .map_err(|e| BtrfsError::new("subvolume create", path, e))?;
    Ok(())
}

/// Snapshot subvolume `src` to the new path `dst`; `readonly` makes a read-only snapshot.
pub fn snapshot(src: &Path, dst: &Path, readonly: bool) -> Result<(), BtrfsError> {
    let source = File::open(src).map_err(|e| BtrfsError::new("snapshot", src, e))?;
    let (dir, name) = split("snapshot", dst)?;
    let mut args = VolArgsV2 {
        fd: i64::from(source.as_raw_fd()),
        transid: 0,
        flags: if readonly { BTRFS_SUBVOL_RDONLY } else { 0 },
        unused: [0; 4],
        name: [0; BTRFS_SUBVOL_NAME_MAX + 1],
    };
    copy_name(&mut args.name, &name, "snapshot", dst)?;
    // SAFETY: `dir` and `source` are open fds; `args` is a fully initialised
    // `btrfs_ioctl_vol_args_v2` living across the call.
    unsafe { ioc_snap_create_v2(dir.as_raw_fd(), &args) }
        .map_err(|e| BtrfsError::new("snapshot", dst, e))?;
    Ok(())
}

/// Delete the subvolume at `path` with everything in it.
pub fn delete_subvolume(path: &Path) -> Result<(), BtrfsError> {
    let (dir, name) = split("subvolume delete", path)?;
    let mut args = VolArgs { fd: 0, name: [0; BTRFS_PATH_NAME_MAX + 1] };
    copy_name(&mut args.name, &name, "subvolume delete", path)?;
    // SAFETY: as in `create_subvolume`.
    unsafe { ioc_snap_destroy(dir.as_raw_fd(), &args) }
        .map_err(|e| BtrfsError::new("subvolume delete", path, e))?;
    Ok(())
}

/// Whether `path` is the root of a subvolume (btrfs gives subvolume roots inode 256).
pub fn is_subvolume(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).map(|m| m.ino() == 256 && m.is_dir()).unwrap_or(false)
}

/// Set or clear the read-only flag of subvolume `path`.
pub fn set_readonly(path: &Path, readonly: bool) -> Result<(), BtrfsError> {
    let f = File::open(path).map_err(|e| BtrfsError::new("set read-only", path, e))?;
    let mut flags: u64 = 0;
    // SAFETY: `f` is an open fd of a subvolume root and `flags` is a valid `u64` out-pointer.
    unsafe { ioc_subvol_getflags(f.as_raw_fd(), &mut flags) }
        .map_err(|e| BtrfsError::new("get flags", path, e))?;
    if readonly {
        flags |= BTRFS_SUBVOL_RDONLY;
    } else {
        flags &= !BTRFS_SUBVOL_RDONLY;
    }
    // SAFETY: as above; the kernel only reads `flags`.
    unsafe { ioc_subvol_setflags(f.as_raw_fd(), &flags) }
        .map_err(|e| BtrfsError::new("set read-only", path, e))?;
    Ok(())
}

/// Delete `path` whether it is a subvolume or a plain tree; missing is fine.
pub fn remove_tree(path: &Path) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    if is_subvolume(path) {
        // A read-only subvolume can be deleted directly by root.
        return delete_subvolume(path).map_err(|e| std::io::Error::other(e.to_string()));
    }
    std::fs::remove_dir_all(path)
}
