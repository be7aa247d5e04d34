//! How a namespace helper's spec travels from the daemon to the helper: as JSON in a sealed
//! memfd the helper inherits under the number its command line names (`__nsexec --spec-fd N`,
//! `__start-sandbox --spec-fd N`; [`inheritable`]), not as an argument.
//!
//! An argument is bounded by the kernel twice: one string by `MAX_ARG_STRLEN` (128 KiB) and all
//! of `argv` + `envp` by `ARG_MAX` (a quarter of the stack limit), so an exec whose own command
//! line neared 128 KiB failed with `Argument list too long` before it reached the sandbox. A
//! memfd has no such bound; it is sealed against writes, growth and shrinking before the helper
//! starts, and the helper reads it whole and closes it before it forks into the sandbox, so the
//! sandbox never sees it. stdin, stdout and stderr stay the command's own.
//!
//! The command the helper finally `execve`s inside the sandbox is still bounded by the same
//! kernel limits ([`check_exec_args`] names them before anything starts).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::error::{Result, SandboxError};

/// The helper argument that says the spec is on a descriptor (followed by its number).
pub const SPEC_FD_ARG: &str = "--spec-fd";
/// Largest spec a helper reads (a generous bound: a command line is at most `ARG_MAX`).
pub const MAX_SPEC: u64 = 64 << 20;
/// The kernel's limit on one argument or environment string, its NUL included
/// (`MAX_ARG_STRLEN`, 32 pages).
pub const MAX_ARG_STRLEN: usize = 32 * 4096;
/// The kernel's bound on `argv` + `envp` (their strings and pointers, and the program's path)
/// at `execve` for a process with this one's stack limit, which a sandbox's commands inherit:
/// a quarter of `RLIMIT_STACK`, at most 6 MiB, at least 128 KiB (`ARG_MAX`; 2 MiB for the
/// usual 8 MiB stack).
pub fn arg_max() -> usize {
    let mut r = libc::rlimit { rlim_cur: 8 << 20, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass; on failure it stays the default.
    unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut r) };
    let stack = usize::try_from(r.rlim_cur).unwrap_or(usize::MAX);
    (stack / 4).clamp(MAX_ARG_STRLEN, (8 << 20) / 4 * 3)
}

/// `MFD_NOEXEC_SEAL` (Linux 6.3): the memfd can never be made executable.
const MFD_NOEXEC_SEAL: libc::c_uint = 0x0008;

/// A sealed memfd holding `spec` as JSON, positioned at its start, close-on-exec (hand it to a
/// helper with [`install`]).
pub fn spec_memfd(spec: &impl serde::Serialize) -> Result<OwnedFd> {
    let json = serde_json::to_vec(spec)
        .map_err(|e| SandboxError::Other(format!("encoding the helper's spec: {e}")))?;
    let name = c"crab-spec";
    let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create with a NUL-terminated name and flag bits only.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), base | MFD_NOEXEC_SEAL) };
    if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // Kernels before 6.3 know no MFD_NOEXEC_SEAL.
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), base) };
    }
    if fd < 0 {
        return Err(SandboxError::Host {
            what: format!("memfd_create for a helper's spec: {}", std::io::Error::last_os_error()),
            hint: "the daemon needs memfds (Linux 3.17+); check the descriptor limit".into(),
        });
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    let mut file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let io = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| SandboxError::Host {
            what: format!("{what} a helper's spec memfd: {e}"),
            hint: "the host is out of memory or descriptors".into(),
        }
    };
    file.write_all(&json).map_err(io("writing"))?;
    file.seek(SeekFrom::Start(0)).map_err(io("rewinding"))?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on a descriptor we own, integer arguments only.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io("sealing")(std::io::Error::last_os_error()));
    }
    Ok(OwnedFd::from(file))
}

/// Make `fd` inheritable by the next child spawned and return the `--spec-fd N` arguments that
/// name it; drop the [`OwnedFd`] right after the spawn.
///
/// No `pre_exec` closure moves it to a fixed number: a command with one is started with
/// `fork` of the whole daemon instead of `posix_spawn` (`CLONE_VFORK`), which cost ≈ 0.6 ms
/// per exec here (release build, 60 `crab exec SB -- true` in a row: 5.7–6.0 ms before the
/// spec moved to a descriptor, 6.4–6.9 ms with the closure). The descriptor keeps its own
/// number instead. A child another thread spawns in that window may inherit it too: only host
/// tools (CRIU, `ip`, `nft`) and namespace helpers, which close every descriptor above 2
/// before anything of a sandbox runs (`spawn::close_fds_above_2`).
pub fn inheritable(fd: &OwnedFd) -> Result<[String; 2]> {
    // SAFETY: fcntl with integer arguments on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) } < 0 {
        return Err(SandboxError::Host {
            what: format!(
                "clearing close-on-exec of a helper's spec memfd: {}",
                std::io::Error::last_os_error()
            ),
            hint: "the host is out of descriptors".into(),
        });
    }
    Ok([SPEC_FD_ARG.to_string(), fd.as_raw_fd().to_string()])
}

/// In the helper: the spec from `args` — `--spec-fd N` (read descriptor N whole, then close
/// it) or, as older daemons and tests pass it, the JSON itself.
pub fn read_spec<T: serde::de::DeserializeOwned>(
    args: &[String],
) -> std::result::Result<T, String> {
    let first = args.first().ok_or("missing spec argument")?;
    if first != SPEC_FD_ARG {
        return serde_json::from_str(first).map_err(|e| format!("bad spec: {e}"));
    }
    let fd: RawFd = args
        .get(1)
        .and_then(|n| n.parse().ok())
        .filter(|n| *n > 2)
        .ok_or("--spec-fd needs a descriptor number above 2")?;
    // SAFETY: the daemon handed this descriptor to us for this purpose; nothing else owns it.
    // It is closed when `file` drops, before the helper forks into the sandbox.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let mut json = Vec::new();
    file.take(MAX_SPEC + 1)
        .read_to_end(&mut json)
        .map_err(|e| format!("reading the spec from descriptor {fd}: {e}"))?;
    if json.len() as u64 > MAX_SPEC {
        return Err(format!("the spec on descriptor {fd} is larger than {MAX_SPEC} bytes"));
    }
    serde_json::from_slice(&json).map_err(|e| format!("bad spec: {e}"))
}

/// Refuse a command the kernel would refuse at `execve` with `E2BIG` ("Argument list too
/// long"), naming the limit it passes and what to do instead: one argument or environment
/// string of [`MAX_ARG_STRLEN`] bytes or more, or all of them past [`ARG_MAX`].
pub fn check_exec_args(cmd: &[String], env: &[String]) -> Result<()> {
    let hint = "pass large data through stdin (exec's stdin / `crab exec -i`) or write it to a file in the sandbox (the file API) and pass its path";
    for (what, list) in [("argument", cmd), ("environment variable", env)] {
        if let Some((i, s)) = list.iter().enumerate().find(|(_, s)| s.len() + 1 > MAX_ARG_STRLEN) {
            let name = if what == "argument" {
                format!("{what} {i} of `{}`", cmd.first().map(String::as_str).unwrap_or_default())
            } else {
                format!("{what} {}", s.split('=').next().unwrap_or_default())
            };
            return Err(SandboxError::Invalid(format!(
                "{name} is {} bytes; Linux limits one argument or environment string to {} bytes (MAX_ARG_STRLEN, 128 KiB) at execve — {hint}",
                s.len(),
                MAX_ARG_STRLEN - 1
            )));
        }
    }
    let pointer = std::mem::size_of::<usize>();
    // The program's resolved path is copied too: room for the longest one.
    let total: usize =
        cmd.iter().chain(env).map(|s| s.len() + 1 + pointer).sum::<usize>() + 2 * pointer + 4096;
    let limit = arg_max();
    if total > limit {
        return Err(SandboxError::Invalid(format!(
            "the command's arguments and environment take {total} bytes; Linux limits them to {limit} bytes at execve (ARG_MAX: a quarter of the stack limit, at most 6 MiB) — {hint}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn a_spec_travels_through_a_sealed_memfd() {
        let spec = vec!["x".repeat(1 << 20)];
        let fd = spec_memfd(&spec).unwrap();
        let mut w =
            File::options().write(true).open(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert!(w.write_all(b"[]").is_err(), "a spec memfd must be sealed against writes");
        let dup = fd.try_clone().unwrap();
        let raw = dup.as_raw_fd();
        std::mem::forget(dup); // read_spec takes ownership of the number
        let back: Vec<String> = read_spec(&[SPEC_FD_ARG.into(), raw.to_string()]).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn json_in_the_argument_still_works() {
        let back: Vec<u32> = read_spec(&["[1,2]".into()]).unwrap();
        assert_eq!(back, vec![1, 2]);
    }

    #[test]
    fn e2big_commands_are_refused_naming_the_limit() {
        let big = "a".repeat(MAX_ARG_STRLEN);
        let e = check_exec_args(&["sh".into(), big.clone()], &[]).unwrap_err().to_string();
        assert!(
            e.contains("MAX_ARG_STRLEN") && e.contains("argument 1") && e.contains("stdin"),
            "{e}"
        );
        let e = check_exec_args(&["true".into()], &[format!("BIG={big}")]).unwrap_err().to_string();
        assert!(e.contains("environment variable BIG"), "{e}");
        let many: Vec<String> = (0..60).map(|_| "a".repeat(120 << 10)).collect();
        let e = check_exec_args(&many, &[]).unwrap_err().to_string();
        assert!(e.contains("ARG_MAX"), "{e}");
        let ok: Vec<String> = (0..8).map(|_| "a".repeat(120 << 10)).collect();
        check_exec_args(&ok, &[format!("E={}", "b".repeat(100 << 10))]).unwrap();
    }
}
