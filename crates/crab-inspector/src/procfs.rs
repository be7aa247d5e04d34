//! Small /proc and cgroupfs readers used at attach and verdict time: the processes of a cgroup
//! tree, a cgroup's level, a process's file mappings and its scheduler state.

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::InspectorError;

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

fn io_err(syscall: &'static str, path: &Path, source: std::io::Error) -> InspectorError {
    InspectorError::Io { syscall, path: path.to_path_buf(), source }
}

/// The cgroup id (inode number) of a cgroup v2 directory and its level below the hierarchy's
/// root (the root is level 0).
pub(crate) fn cgroup_id_and_level(dir: &Path) -> Result<(u64, u32), InspectorError> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| InspectorError::NotCgroup2 { path: dir.to_path_buf() })?;
    // SAFETY: statfs is given a valid NUL-terminated path and a zeroed, properly sized buffer.
    let (rc, sfs) = unsafe {
        let mut sfs: libc::statfs = std::mem::zeroed();
        (libc::statfs(c.as_ptr(), &mut sfs), sfs)
    };
    if rc != 0 {
        return Err(io_err("statfs", dir, std::io::Error::last_os_error()));
    }
    #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every target
    if sfs.f_type as i64 != CGROUP2_SUPER_MAGIC {
        return Err(InspectorError::NotCgroup2 { path: dir.to_path_buf() });
    }
    let md = fs::metadata(dir).map_err(|e| io_err("stat", dir, e))?;
    let dev = md.dev();
    let mut level = 0u32;
    let mut cur: PathBuf = dir.to_path_buf();
    while let Some(parent) = cur.parent() {
        match fs::metadata(parent) {
            Ok(pm) if pm.dev() == dev => {
                level += 1;
                cur = parent.to_path_buf();
            }
            _ => break,
        }
    }
    Ok((md.ino(), level))
}

/// All pids (tgids) in the cgroup and its descendants.
pub(crate) fn cgroup_tree_pids(dir: &Path) -> Result<Vec<u32>, InspectorError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let procs = d.join("cgroup.procs");
        match fs::read_to_string(&procs) {
            Ok(s) => out.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("read", &procs, e)),
        }
        let rd = match fs::read_dir(&d) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("readdir", &d, e)),
        };
        for ent in rd.flatten() {
            if ent.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(ent.path());
            }
        }
    }
    Ok(out)
}

/// What a process has mapped from files.
#[derive(Debug, Default)]
pub(crate) struct Mappings {
    /// (major, minor, inode) of every file mapping.
    pub inodes: HashSet<(u64, u64, u64)>,
    /// A mapped file has been deleted (maps says "(deleted)").
    pub deleted: Vec<String>,
    /// Shared writable mappings of real files.
    pub shared_writable: Vec<String>,
}

fn special(path: &str) -> bool {
    path.starts_with("/dev/")
        || path.starts_with("/memfd:")
        || path.starts_with("/SYSV")
        || path.starts_with("/proc/")
        || path.starts_with("/sys/")
        || path.starts_with("/anon_hugepage")
}

/// Parses /proc/<pid>/maps; `None` when the process is gone.
pub(crate) fn mappings(pid: u32) -> Option<Mappings> {
    let s = fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut m = Mappings::default();
    for line in s.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(_range), Some(perms), Some(_off), Some(dev), Some(ino)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let ino: u64 = ino.parse().unwrap_or(0);
        if ino == 0 {
            continue;
        }
        let path: String = it.collect::<Vec<_>>().join(" ");
        if special(&path) {
            continue;
        }
        let mut dv = dev.split(':');
        let major = dv.next().and_then(|x| u64::from_str_radix(x, 16).ok()).unwrap_or(0);
        let minor = dv.next().and_then(|x| u64::from_str_radix(x, 16).ok()).unwrap_or(0);
        m.inodes.insert((major, minor, ino));
        if path.ends_with(" (deleted)") {
            m.deleted.push(path.clone());
        }
        let pb = perms.as_bytes();
        if pb.get(1) == Some(&b'w') && pb.get(3) == Some(&b's') {
            m.shared_writable.push(path);
        }
    }
    Some(m)
}

/// The state letter of /proc/<pid>/stat (R, S, D, Z...), `None` when gone.
pub(crate) fn state(pid: u32) -> Option<char> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = s.rfind(')')?;
    s[after + 1..].trim_start().chars().next()
}
