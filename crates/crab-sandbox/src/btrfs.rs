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

/// Delete the subvolume at `path` with everything in it, nested subvolumes included.
///
/// A subvolume holding another one cannot be deleted (`ENOTEMPTY`); sandboxes cannot make
/// nested subvolumes (their seccomp filter refuses the ioctls), but a root from before that
/// rule, or an image, may hold some: they are found and deleted first, depth first, through
/// directory descriptors opened with `O_NOFOLLOW` (a symlink in the tree is never followed).
pub fn delete_subvolume(path: &Path) -> Result<(), BtrfsError> {
    let (dir, name) = split("subvolume delete", path)?;
    match destroy(&dir, &name, path) {
        Err(e) if e.source.raw_os_error() == Some(libc::ENOTEMPTY) => {
            let top = open_dir_at(dir.as_raw_fd(), &name)
                .map_err(|e| BtrfsError::new("subvolume delete", path, e))?;
            delete_nested(&top, path, 0)?;
            destroy(&dir, &name, path)
        }
        r => r,
    }
}

/// `BTRFS_IOC_SNAP_DESTROY` of `name` in `dir`.
fn destroy(dir: &impl AsRawFd, name: &CString, path: &Path) -> Result<(), BtrfsError> {
    let mut args = VolArgs { fd: 0, name: [0; BTRFS_PATH_NAME_MAX + 1] };
    copy_name(&mut args.name, name, "subvolume delete", path)?;
    // SAFETY: as in `create_subvolume`.
    unsafe { ioc_snap_destroy(dir.as_raw_fd(), &args) }
        .map_err(|e| BtrfsError::new("subvolume delete", path, e))?;
    Ok(())
}

/// Deepest directory nesting [`delete_nested`] walks.
const MAX_NESTED_DEPTH: usize = 4096;

fn open_dir_at(dir: i32, name: &CString) -> std::io::Result<File> {
    // SAFETY: openat with a valid directory fd and a NUL-terminated name; the returned fd is
    // owned by the `File` below.
    let fd = unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Delete every subvolume beneath the directory `dir` (at `path`, for messages).
fn delete_nested(dir: &File, path: &Path, depth: usize) -> Result<(), BtrfsError> {
    use std::os::unix::fs::MetadataExt;
    if depth > MAX_NESTED_DEPTH {
        return Err(BtrfsError::new(
            "subvolume delete",
            path,
            std::io::Error::other(format!("directories nested deeper than {MAX_NESTED_DEPTH}")),
        ));
    }
    // Listed through the descriptor (`/proc/self/fd/N` names the directory already open), so
    // a rename in the tree meanwhile cannot redirect the walk.
    let listed = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    let fail = |e: std::io::Error| BtrfsError::new("subvolume delete (list nested)", path, e);
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(&listed).map_err(fail)? {
        let entry = entry.map_err(fail)?;
        if entry.file_type().map_err(fail)?.is_dir() {
            let name = CString::new(entry.file_name().as_bytes()).map_err(|_| {
                fail(std::io::Error::new(std::io::ErrorKind::InvalidData, "NUL in a name"))
            })?;
            dirs.push(name);
        }
    }
    for name in dirs {
        let child_path = path.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
        let child = match open_dir_at(dir.as_raw_fd(), &name) {
            Ok(c) => c,
            // Replaced meanwhile by something else (a symlink, a file), or gone.
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP | libc::ENOENT)) =>
            {
                continue
            }
            Err(e) => return Err(BtrfsError::new("subvolume delete", &child_path, e)),
        };
        delete_nested(&child, &child_path, depth + 1)?;
        let is_subvol = child
            .metadata()
            .map(|m| m.ino() == 256)
            .map_err(|e| BtrfsError::new("stat", &child_path, e))?;
        drop(child);
        if is_subvol {
            destroy(dir, &name, &child_path)?;
        }
    }
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
