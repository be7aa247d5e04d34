//! The one atomic, durable file write every persisted record goes through: `<path>.tmp`, fsync,
//! rename over `path`, fsync of the directory. A failed directory fsync is an error (the rename
//! may not survive a crash), never ignored. [`write_replace`] is the same without the fsyncs,
//! for records whose loss in a host crash loses nothing the crash does not lose anyway.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Which step of [`write_atomic`] failed, on which path.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct AtomicWriteError {
    /// The operation (`create`, `write`, `fsync`, `rename`, `open`).
    pub op: &'static str,
    /// The path it worked on.
    pub path: PathBuf,
    /// The I/O error.
    #[source]
    pub source: std::io::Error,
}

fn io<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> AtomicWriteError + 'a {
    move |source| AtomicWriteError { op, path: path.to_path_buf(), source }
}

/// fsync a directory.
pub fn fsync_dir(dir: &Path) -> Result<(), AtomicWriteError> {
    let f = std::fs::File::open(dir).map_err(io("open", dir))?;
    f.sync_all().map_err(io("fsync", dir))
}

/// Write `bytes` to `path` atomically (readers see the old or the new content, never a torn
/// one) but not durably: no fsync, so after a host crash the old content (or nothing) may be
/// back. On btrfs the next transaction commit (any snapshot makes one) and on ext4's ordered
/// journal the next fsync on the filesystem commit this rename too.
pub fn write_replace(path: &Path, bytes: &[u8]) -> Result<(), AtomicWriteError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("rename", &tmp))
}

/// Write `bytes` to `path` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), AtomicWriteError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io("rename", &tmp))?;
    fsync_dir(dir)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn writes_and_leaves_no_temp() {
        let d = std::env::temp_dir().join(format!("crab-fsutil-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("rec.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert!(!d.join("rec.json.tmp").exists());
        let e = write_atomic(&d.join("missing/rec.json"), b"x").unwrap_err();
        assert_eq!(e.op, "create");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
