//! Host-side file operations inside a sandbox's (or image's) root filesystem.
//!
//! A sandbox controls every name in its root: `/etc`, `/etc/hostname`, `/tmp` or `/.crab` may
//! be absolute symlinks (made by the sandbox, or shipped in an imported image) that, resolved on
//! the host, point at the host's own files. The daemon therefore never resolves a path in a
//! rootfs with ordinary `open`/`write`: [`InRoot`] holds a directory fd of the root and resolves
//! every directory with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`
//! (nix's binding), so a symlink resolves against the sandbox's root as it would inside the
//! sandbox, never the host's, and `/proc` magic links and mount crossings are refused. Files are
//! written under a fresh name with `O_CREAT | O_EXCL | O_NOFOLLOW` and renamed over the final
//! name, which replaces a symlink there instead of following it.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

use crate::error::{Result, SandboxError};

/// A root filesystem the daemon writes into without leaving it.
#[derive(Debug)]
pub struct InRoot {
    root: PathBuf,
    fd: OwnedFd,
    /// Host uid and gid of what it creates (a user-namespaced sandbox's root: the range's
    /// base); `None`: the daemon's own (host root).
    owner: Option<(u32, u32)>,
}

fn resolve_flags() -> ResolveFlag {
    ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS | ResolveFlag::RESOLVE_NO_XDEV
}

fn errno_io(e: Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

/// The normal components of a path relative to the root (`/etc/x`, `etc/x` and `./etc/x` alike);
/// `..` is refused rather than interpreted.
fn parts(rel: &Path) -> Result<Vec<&std::ffi::OsStr>> {
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(SandboxError::Invalid(format!(
                    "path {} inside a root may not contain `..`",
                    rel.display()
                )))
            }
        }
    }
    Ok(out)
}

impl InRoot {
    /// Open the root directory `root` (a path the daemon owns, e.g. a sandbox's `rootfs`).
    pub fn open(root: &Path) -> Result<Self> {
        let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let fd = nix::fcntl::open(root, flags, Mode::empty())
            .map_err(|e| SandboxError::io("open root", root)(errno_io(e)))?;
        // SAFETY: `open` just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(InRoot { root: root.to_path_buf(), fd, owner: None })
    }

    /// Create every file and directory as host `uid`:`gid` from now on (`None`: as the daemon).
    pub fn owned_by(mut self, owner: Option<(u32, u32)>) -> Self {
        self.owner = owner;
        self
    }

    fn chown_fd(&self, fd: i32, shown: &Path) -> Result<()> {
        let Some((u, g)) = self.owner else { return Ok(()) };
        nix::unistd::fchown(fd, Some(u.into()), Some(g.into()))
            .map_err(|e| SandboxError::io("chown", shown)(errno_io(e)))
    }

    /// The host path of `rel`, for messages only (never opened).
    fn shown(&self, rel: &Path) -> PathBuf {
        self.root.join(rel.strip_prefix("/").unwrap_or(rel))
    }

    /// Resolve `rel` inside the root with `flags` (symlinks resolve against the root).
    fn resolve(&self, rel: &Path, flags: OFlag, mode: Mode) -> std::result::Result<OwnedFd, Errno> {
        let rel = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
        let how =
            OpenHow::new().flags(flags | OFlag::O_CLOEXEC).mode(mode).resolve(resolve_flags());
        let fd = loop {
            match openat2(self.fd.as_raw_fd(), rel, how) {
                // openat2 asks callers to retry when a concurrent rename raced the lookup.
                Err(Errno::EAGAIN) => continue,
                r => break r?,
            }
        };
        // SAFETY: `openat2` just returned this descriptor; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Open directory `rel`, creating missing components (each created inside the directory
    /// that resolved before it, so a symlinked component is followed inside the root only).
    /// `rd` opens the result readable (for `fchmod`), otherwise as an `O_PATH` handle.
    pub fn dir(&self, rel: &Path, create: bool, rd: bool) -> Result<OwnedFd> {
        let comps = parts(rel)?;
        let mut prefix = PathBuf::new();
        let mut parent = self
            .resolve(Path::new("."), OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())
            .map_err(|e| SandboxError::io("open", &self.root)(errno_io(e)))?;
        for (i, c) in comps.iter().enumerate() {
            prefix.push(c);
            if create {
                match nix::sys::stat::mkdirat(
                    Some(parent.as_raw_fd()),
                    *c,
                    Mode::from_bits_truncate(0o755),
                ) {
                    Ok(()) => {
                        if let Some((u, g)) = self.owner {
                            nix::unistd::fchownat(
                                Some(parent.as_raw_fd()),
                                *c,
                                Some(u.into()),
                                Some(g.into()),
                                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                            )
                            .map_err(|e| {
                                SandboxError::io("chown", self.shown(&prefix))(errno_io(e))
                            })?;
                        }
                    }
                    Err(Errno::EEXIST) => {}
                    Err(e) => {
                        return Err(SandboxError::io("mkdir", self.shown(&prefix))(errno_io(e)))
                    }
                }
            }
            let last = i + 1 == comps.len();
            let flags = if last && rd {
                OFlag::O_RDONLY | OFlag::O_DIRECTORY
            } else {
                OFlag::O_PATH | OFlag::O_DIRECTORY
            };
            parent = self.resolve(&prefix, flags, Mode::empty()).map_err(|e| {
                SandboxError::io("open directory", self.shown(&prefix))(errno_io(e))
            })?;
        }
        if comps.is_empty() && rd {
            parent = self
                .resolve(Path::new("."), OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty())
                .map_err(|e| SandboxError::io("open", &self.root)(errno_io(e)))?;
        }
        Ok(parent)
    }

    /// Make directory `rel` (parents resolved inside the root and created) with `mode` exactly.
    /// When its last component is a symlink it is left alone: the sandbox chose it, and
    /// following it could only reach the sandbox's own files or fail.
    pub fn mkdir_mode(&self, rel: &Path, mode: u32) -> Result<()> {
        let comps = parts(rel)?;
        let Some((name, dirs)) = comps.split_last() else {
            return Err(SandboxError::Invalid("cannot chmod the root itself".into()));
        };
        let parent = self.dir(&dirs.iter().collect::<PathBuf>(), true, false)?;
        match nix::sys::stat::mkdirat(
            Some(parent.as_raw_fd()),
            *name,
            Mode::from_bits_truncate(0o755),
        ) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(SandboxError::io("mkdir", self.shown(rel))(errno_io(e))),
        }
        let fd = match nix::fcntl::openat(
            Some(parent.as_raw_fd()),
            *name,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                tracing::debug!(path = %self.shown(rel).display(), "not a directory; left alone");
                return Ok(());
            }
            Err(e) => return Err(SandboxError::io("open directory", self.shown(rel))(errno_io(e))),
        };
        // SAFETY: `openat` just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        self.chown_fd(fd.as_raw_fd(), &self.shown(rel))?;
        nix::sys::stat::fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(mode))
            .map_err(|e| SandboxError::io("chmod", self.shown(rel))(errno_io(e)))
    }

    /// Make sure the top-level entry `name` is a real directory of the root: a symlink or file
    /// of that name is removed first. For directories the daemon owns (`/.crab`).
    pub fn own_dir(&self, name: &str, mode: u32) -> Result<()> {
        let shown = self.shown(Path::new(name));
        let st = nix::sys::stat::fstatat(
            Some(self.fd.as_raw_fd()),
            name,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        );
        match st {
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => return Ok(()),
            Ok(_) => {
                tracing::warn!(path = %shown.display(), "replacing a non-directory the daemon owns");
                nix::unistd::unlinkat(
                    Some(self.fd.as_raw_fd()),
                    name,
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                )
                .map_err(|e| SandboxError::io("unlink", &shown)(errno_io(e)))?;
            }
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(SandboxError::io("stat", &shown)(errno_io(e))),
        }
        match nix::sys::stat::mkdirat(
            Some(self.fd.as_raw_fd()),
            name,
            Mode::from_bits_truncate(mode),
        ) {
            Ok(()) => {}
            Err(Errno::EEXIST) => return Ok(()),
            Err(e) => return Err(SandboxError::io("mkdir", &shown)(errno_io(e))),
        }
        let Some((u, g)) = self.owner else { return Ok(()) };
        nix::unistd::fchownat(
            Some(self.fd.as_raw_fd()),
            name,
            Some(u.into()),
            Some(g.into()),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| SandboxError::io("chown", &shown)(errno_io(e)))
    }

    /// Write `bytes` to file `rel` with `mode`, replacing whatever entry (file or symlink) has
    /// that name; the parent directory is resolved inside the root (and created).
    pub fn write(&self, rel: &Path, bytes: &[u8], mode: u32) -> Result<()> {
        self.write_from(rel, &mut &bytes[..], mode)
    }

    /// Make symlink `rel` pointing at `target` (kept as given, never resolved here), replacing
    /// whatever entry has that name; the parent directory is resolved inside the root.
    pub fn symlink(&self, rel: &Path, target: &Path) -> Result<()> {
        let comps = parts(rel)?;
        let Some((name, dirs)) = comps.split_last() else {
            return Err(SandboxError::Invalid("cannot replace the root itself".into()));
        };
        let dir_rel: PathBuf = dirs.iter().collect();
        let dir = self.dir(&dir_rel, true, false)?;
        let tmp = format!(".{}.crab-{:08x}", name.to_string_lossy(), crate::runtime::rand_u32());
        nix::unistd::symlinkat(target, Some(dir.as_raw_fd()), tmp.as_str()).map_err(|e| {
            SandboxError::io("symlink", self.shown(&dir_rel.join(&tmp)))(errno_io(e))
        })?;
        let done = (|| {
            if let Some((u, g)) = self.owner {
                nix::unistd::fchownat(
                    Some(dir.as_raw_fd()),
                    tmp.as_str(),
                    Some(u.into()),
                    Some(g.into()),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| SandboxError::io("chown", self.shown(rel))(errno_io(e)))?;
            }
            nix::fcntl::renameat(Some(dir.as_raw_fd()), tmp.as_str(), Some(dir.as_raw_fd()), *name)
                .map_err(|e| SandboxError::io("rename", self.shown(rel))(errno_io(e)))
        })();
        if done.is_err() {
            let _ = nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                tmp.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
        done
    }

    /// Remove file or symlink `rel` (its parent resolved inside the root); a missing one is
    /// fine.
    pub fn remove_file(&self, rel: &Path) -> Result<()> {
        let comps = parts(rel)?;
        let Some((name, dirs)) = comps.split_last() else {
            return Err(SandboxError::Invalid("cannot remove the root itself".into()));
        };
        let dir = match self.dir(&dirs.iter().collect::<PathBuf>(), false, false) {
            Ok(d) => d,
            Err(_) => return Ok(()),
        };
        match nix::unistd::unlinkat(
            Some(dir.as_raw_fd()),
            *name,
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        ) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(SandboxError::io("unlink", self.shown(rel))(errno_io(e))),
        }
    }

    /// [`InRoot::write`] from a reader (a file of any size).
    pub fn write_from(&self, rel: &Path, src: &mut dyn Read, mode: u32) -> Result<()> {
        let comps = parts(rel)?;
        let Some((name, dirs)) = comps.split_last() else {
            return Err(SandboxError::Invalid("cannot write the root itself".into()));
        };
        let dir_rel: PathBuf = dirs.iter().collect();
        let dir = self.dir(&dir_rel, true, false)?;
        let tmp = format!(".{}.crab-{:08x}", name.to_string_lossy(), crate::runtime::rand_u32());
        let shown_tmp = self.shown(&dir_rel.join(&tmp));
        let fd = nix::fcntl::openat(
            Some(dir.as_raw_fd()),
            tmp.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(mode),
        )
        .map_err(|e| SandboxError::io("create", &shown_tmp)(errno_io(e)))?;
        // SAFETY: `openat` just returned this descriptor; nothing else owns it.
        let mut f = unsafe { File::from_raw_fd(fd) };
        let written = std::io::copy(src, &mut f)
            .map(drop)
            .map_err(SandboxError::io("write", &shown_tmp))
            .and_then(|()| self.chown_fd(f.as_raw_fd(), &shown_tmp))
            .and_then(|()| {
                // The umask may have narrowed the mode at creation.
                nix::sys::stat::fchmod(f.as_raw_fd(), Mode::from_bits_truncate(mode))
                    .map_err(|e| SandboxError::io("chmod", &shown_tmp)(errno_io(e)))
            })
            .and_then(|()| {
                nix::fcntl::renameat(
                    Some(dir.as_raw_fd()),
                    tmp.as_str(),
                    Some(dir.as_raw_fd()),
                    *name,
                )
                .map_err(|e| SandboxError::io("rename", self.shown(rel))(errno_io(e)))
            });
        if written.is_err() {
            let _ = nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                tmp.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
        written
    }

    /// Open regular file `rel` (resolved inside the root) for reading; `None` when it does not
    /// exist or is not a regular file. Opened non-blocking and without following a final
    /// symlink, so a FIFO or a link the sandbox put there can neither block nor redirect it.
    pub fn open_regular(&self, rel: &Path) -> Option<File> {
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK;
        let fd = self.resolve(rel, flags, Mode::empty()).ok()?;
        let f = File::from(fd);
        f.metadata().ok()?.is_file().then_some(f)
    }

    /// At most `max` bytes of regular file `rel` (see [`InRoot::open_regular`]).
    pub fn read_bounded(&self, rel: &Path, max: u64) -> Option<Vec<u8>> {
        let f = self.open_regular(rel)?;
        let mut out = Vec::new();
        f.take(max).read_to_end(&mut out).ok()?;
        Some(out)
    }

    /// The names in directory `rel` (resolved inside the root), at most `max` of them, in the
    /// order the directory gives; empty when it is missing or not a directory.
    pub fn names(&self, rel: &Path, max: usize) -> Vec<String> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
        let Ok(fd) = self.resolve(rel, flags, Mode::empty()) else { return Vec::new() };
        // `from_fd` owns the descriptor from here (closed on failure too).
        let Ok(mut dir) = nix::dir::Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) else {
            return Vec::new();
        };
        dir.iter()
            .flatten()
            .filter_map(|e| e.file_name().to_str().ok().map(str::to_string))
            .filter(|n| n != "." && n != "..")
            .take(max)
            .collect()
    }

    /// Read regular file `rel` (resolved inside the root); `None` when it does not exist or is
    /// not a regular file.
    pub fn read(&self, rel: &Path) -> Option<Vec<u8>> {
        let fd = self.resolve(rel, OFlag::O_RDONLY | OFlag::O_NOFOLLOW, Mode::empty()).ok()?;
        let mut f = File::from(fd);
        if !f.metadata().ok()?.is_file() {
            return None;
        }
        let mut out = Vec::new();
        f.read_to_end(&mut out).ok()?;
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("crab-inroot-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("tmpdir");
        d
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let base = tmpdir("sym");
        let host = base.join("host");
        std::fs::create_dir_all(&host).expect("host");
        std::fs::write(host.join("canary"), "host").expect("canary");
        let root = base.join("root");
        std::fs::create_dir_all(root.join("etc")).expect("etc");
        // Absolute links to the "host" paths, as a hostile sandbox would make them.
        symlink(host.join("canary"), root.join("etc/hostname")).expect("link");
        symlink(&host, root.join("tmp")).expect("link");
        symlink(&host, root.join(".crab")).expect("link");
        let r = InRoot::open(&root).expect("open");
        r.write(Path::new("/etc/hostname"), b"sb\n", 0o644).expect("write");
        r.mkdir_mode(Path::new("/tmp"), 0o1777).expect("tmp");
        r.own_dir(".crab", 0o755).expect("own");
        r.write(Path::new("/.crab/init"), b"init", 0o755).expect("init");
        assert_eq!(std::fs::read_to_string(host.join("canary")).expect("read"), "host");
        assert_ne!(std::fs::metadata(&host).expect("stat").permissions().mode() & 0o7777, 0o1777);
        assert!(!host.join("init").exists());
        // The symlinked file and the daemon's own directory were replaced; /tmp stays a link.
        assert_eq!(std::fs::read_to_string(root.join("etc/hostname")).expect("read"), "sb\n");
        assert!(root.join(".crab/init").is_file());
        assert!(std::fs::symlink_metadata(root.join("tmp")).expect("lstat").is_symlink());
        // A symlinked directory resolves inside the root: /etc2 -> /inside writes <root>/inside.
        symlink("/inside", root.join("etc2")).expect("link");
        let inside = root.join("inside");
        std::fs::create_dir_all(&inside).expect("inside");
        r.write(Path::new("etc2/canary"), b"sb", 0o644).expect("write via link");
        assert_eq!(std::fs::read_to_string(inside.join("canary")).expect("read"), "sb");
        assert_eq!(std::fs::read_to_string(host.join("canary")).expect("read"), "host");
        assert_eq!(r.read(Path::new(".crab/init")).as_deref(), Some(&b"init"[..]));
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn dot_dot_is_refused() {
        let base = tmpdir("dots");
        let r = InRoot::open(&base).expect("open");
        assert!(r.write(Path::new("../x"), b"", 0o644).is_err());
        let _ = std::fs::remove_dir_all(&base);
    }
}
