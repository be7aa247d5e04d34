//! The namespace helper as a sealed in-memory copy, so no process that enters a sandbox runs
//! from a host file a sandbox could overwrite.
//!
//! Every sandbox start and exec runs the helper (`crab-nsexec`, else `crab`), which forks into
//! the sandbox's pid namespace before it execs the sandbox's init or command. Were it run from
//! its file on the host, a process inside could open `/proc/<pid>/exe` of that child (or of a
//! `#!/proc/self/exe` script the sandbox makes the exec run) and rewrite the host binary, which
//! the next exec runs as host root (runc's CVE-2019-5736). Two walls, so one mistake does not
//! reopen it: the helper makes itself non-dumpable until its `execve`
//! ([`crate::spawn`]), and the daemon runs it from a memfd holding a copy of the binary, sealed
//! against writes, growth, shrinking and further seals ([`SealedExe`]): `/proc/<pid>/exe` of a
//! helper is that memfd, which no one can write. runc does the same (`memfd` + seals).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::error::{Result, SandboxError};

/// `MFD_EXEC` (Linux 6.3): ask for an executable memfd on hosts whose `vm.memfd_noexec` would
/// otherwise make it non-executable.
const MFD_EXEC: libc::c_uint = 0x0010;
/// `F_SEAL_EXEC` (Linux 6.3): the mode bits cannot change.
const F_SEAL_EXEC: libc::c_int = 0x0020;

/// A sealed, executable in-memory copy of a binary, run through `/proc/self/fd/N` by this
/// process and its children (the descriptor is close-on-exec: the path is resolved by
/// `execve` before the descriptor closes, as glibc's `fexecve` does; a binary, not a script).
#[derive(Debug)]
pub struct SealedExe {
    fd: OwnedFd,
    path: PathBuf,
    source: PathBuf,
}

impl SealedExe {
    /// Copy `src` into a new memfd and seal it.
    pub fn copy(src: &Path) -> Result<Self> {
        let mut input = File::open(src).map_err(SandboxError::io("open helper binary", src))?;
        let fd = memfd(c"crab-helper")?;
        let mut file = File::from(fd);
        std::io::copy(&mut input, &mut file)
            .map_err(SandboxError::io("copy helper binary into a memfd", src))?;
        let seals = libc::F_SEAL_SEAL
            | libc::F_SEAL_SHRINK
            | libc::F_SEAL_GROW
            | libc::F_SEAL_WRITE
            | libc::F_SEAL_FUTURE_WRITE;
        add_seals(&file, seals | F_SEAL_EXEC)
            .or_else(|_| add_seals(&file, seals))
            .map_err(SandboxError::io("seal the helper memfd (F_ADD_SEALS)", src))?;
        let fd = OwnedFd::from(file);
        let path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        Ok(SealedExe { fd, path, source: src.to_path_buf() })
    }

    /// The path to run it by (valid in this process and in its children until they exec).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The binary it was copied from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The seals in force (`F_GET_SEALS`).
    pub fn seals(&self) -> std::io::Result<libc::c_int> {
        // SAFETY: fcntl on a descriptor we own, integer arguments only.
        let r = unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_GET_SEALS) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }
}

fn memfd(name: &std::ffi::CStr) -> Result<OwnedFd> {
    let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create with a NUL-terminated name and flag bits only.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), base | MFD_EXEC) };
    if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // Kernels before 6.3 know no MFD_EXEC (their memfds are executable).
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), base) };
    }
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(SandboxError::Host {
            what: format!("memfd_create for the sealed namespace helper: {e}"),
            hint: "the daemon runs its helper from an executable memfd; allow executable memfds (`sysctl vm.memfd_noexec=0`)".into(),
        });
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn add_seals(f: &File, seals: libc::c_int) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, integer arguments only.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test
    use super::*;
    use std::io::Write;

    #[test]
    fn a_sealed_copy_runs_and_cannot_be_written() {
        let sealed = SealedExe::copy(Path::new("/bin/true")).unwrap();
        let seals = sealed.seals().unwrap();
        for s in [libc::F_SEAL_WRITE, libc::F_SEAL_GROW, libc::F_SEAL_SHRINK, libc::F_SEAL_SEAL] {
            assert_eq!(seals & s, s, "seal {s:#x} missing from {seals:#x}");
        }
        // It runs by its path, as the daemon's helpers do.
        let st = std::process::Command::new(sealed.path()).status().unwrap();
        assert!(st.success());
        // Opened again through /proc (as /proc/<pid>/exe would be), it refuses every write.
        let mut w = File::options().write(true).open(sealed.path()).unwrap();
        let e = w.write_all(b"\x7fELF-payload").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert!(w.set_len(0).is_err(), "truncating a sealed memfd must fail");
        let back = std::fs::read(sealed.path()).unwrap();
        assert_eq!(back, std::fs::read("/bin/true").unwrap());
    }
}
