//! The export caches kept across daemon restarts (`<cache>/export-cache.json`).
//!
//! An export skips rereading a file whose path, inode, size, mtime and ctime match one it
//! exported before (the file cache), and skips walking an immutable part — a read-only
//! snapshot, a published image directory — whose path and root ctime match (the part cache).
//! Both lived only in the daemon's memory, so the first export of each sandbox after a restart
//! read its whole tree again (480 MiB for a debian sandbox). They are now saved after an export
//! that added to them and loaded when the repository is opened.
//!
//! The file is JSON (format 1, `docs/format.md` "Export cache") followed by a line holding the
//! BLAKE3 of the JSON: a file that does not check out, is of another format or of another
//! repository (`repo_id`), is ignored with a warning — the cache only saves work, and every
//! hit is still checked against the repository's index (a chunk or tree the repository no
//! longer holds is read again). It is written to a temporary name and renamed. At most
//! [`MAX_FILES`] file entries are kept.

use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use crate::error::{RemoteError, Result};
use crate::format::Content;
use crate::id::Id;
use crate::repo::Repo;
use crate::tree::FileKey;

/// The cache file's name in the repository's cache directory.
pub const FILE: &str = "export-cache.json";
/// Its format.
pub const FORMAT: u32 = 1;
/// Most file entries saved (≈ 200 bytes each).
pub const MAX_FILES: usize = 1 << 20;

#[derive(Serialize, Deserialize)]
struct Saved {
    format: u32,
    repo_id: String,
    files: Vec<SavedFile>,
    parts: Vec<SavedPart>,
}

/// A file cache entry; `rel` is the path's bytes in hex (paths need not be UTF-8).
#[derive(Serialize, Deserialize)]
struct SavedFile {
    rel: String,
    ino: u64,
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
    content: Content,
}

/// A part cache entry; `path` in hex as above.
#[derive(Serialize, Deserialize)]
struct SavedPart {
    path: String,
    ctime_ns: i64,
    tree: Id,
    logical: u64,
}

fn path_hex(p: &std::path::Path) -> String {
    hex::encode(p.as_os_str().as_bytes())
}

fn hex_path(s: &str) -> Option<PathBuf> {
    hex::decode(s).ok().map(|b| PathBuf::from(std::ffi::OsString::from_vec(b)))
}

impl Repo {
    /// Fill the caches from the saved file, if it is sound and this repository's.
    pub(crate) fn load_export_cache(&self) {
        let path = self.cache_dir().join(FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the export cache");
                return;
            }
        };
        let saved = match decode(&bytes) {
            Ok(s) if s.repo_id == self.config().repo_id => s,
            Ok(s) => {
                tracing::info!(path = %path.display(), theirs = s.repo_id, "the export cache is another repository's; ignored");
                return;
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), why, "the export cache is unusable; ignored");
                return;
            }
        };
        let (nf, np) = (saved.files.len(), saved.parts.len());
        {
            let mut files = self.file_cache.lock().unwrap_or_else(|p| p.into_inner());
            for f in saved.files {
                let Some(rel) = hex_path(&f.rel) else { continue };
                let key = FileKey {
                    rel,
                    ino: f.ino,
                    size: f.size,
                    mtime_ns: f.mtime_ns,
                    ctime_ns: f.ctime_ns,
                };
                files.entry(key).or_insert(f.content);
            }
        }
        {
            let mut parts = self.part_cache.lock().unwrap_or_else(|p| p.into_inner());
            for p in saved.parts {
                let Some(dir) = hex_path(&p.path) else { continue };
                parts.entry((dir, p.ctime_ns)).or_insert((p.tree, p.logical));
            }
        }
        tracing::info!(files = nf, parts = np, "export cache loaded");
    }

    /// Save the caches when an export added to them since the last save.
    pub fn save_export_cache(&self) -> Result<()> {
        if !self.cache_dirty.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let files: Vec<SavedFile> = {
            let files = self.file_cache.lock().unwrap_or_else(|p| p.into_inner());
            files
                .iter()
                .take(MAX_FILES)
                .map(|(k, c)| SavedFile {
                    rel: path_hex(&k.rel),
                    ino: k.ino,
                    size: k.size,
                    mtime_ns: k.mtime_ns,
                    ctime_ns: k.ctime_ns,
                    content: c.clone(),
                })
                .collect()
        };
        let parts: Vec<SavedPart> = {
            let parts = self.part_cache.lock().unwrap_or_else(|p| p.into_inner());
            parts
                .iter()
                .map(|((dir, ctime_ns), (tree, logical))| SavedPart {
                    path: path_hex(dir),
                    ctime_ns: *ctime_ns,
                    tree: *tree,
                    logical: *logical,
                })
                .collect()
        };
        let saved = Saved { format: FORMAT, repo_id: self.config().repo_id.clone(), files, parts };
        let path = self.cache_dir().join(FILE);
        let mut body = serde_json::to_vec(&saved)
            .map_err(|e| RemoteError::corrupt(path.display().to_string(), e.to_string()))?;
        let sum = Id::of(&body).to_string();
        body.push(b'\n');
        body.extend_from_slice(sum.as_bytes());
        body.push(b'\n');
        let tmp = self.cache_dir().join(format!("{FILE}.tmp-{}", std::process::id()));
        let written = std::fs::write(&tmp, &body)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(RemoteError::io("write export cache", &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
            // Try again after the next export.
            self.cache_dirty.store(true, Ordering::Release);
        }
        written
    }
}

/// The saved caches of `bytes` (JSON, a newline, its BLAKE3 in hex, a newline).
fn decode(bytes: &[u8]) -> std::result::Result<Saved, String> {
    let trimmed = bytes.strip_suffix(b"\n").ok_or("no final newline (cut short)")?;
    let at = trimmed.iter().rposition(|&b| b == b'\n').ok_or("no checksum line")?;
    let (body, sum) = (&trimmed[..at], &trimmed[at + 1..]);
    let want = Id::of(body).to_string();
    if sum != want.as_bytes() {
        return Err("its checksum does not match its contents".into());
    }
    let saved: Saved = serde_json::from_slice(body).map_err(|e| format!("JSON: {e}"))?;
    if saved.format != FORMAT {
        return Err(format!("format {} (this build reads {FORMAT})", saved.format));
    }
    Ok(saved)
}

/// The number of file and part entries of a saved cache file (for tests and tools).
pub fn count(bytes: &[u8]) -> std::result::Result<(usize, usize), String> {
    decode(bytes).map(|s| (s.files.len(), s.parts.len()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test
    use super::*;

    #[test]
    fn decode_refuses_what_does_not_check_out() {
        let saved = Saved { format: FORMAT, repo_id: "r".into(), files: vec![], parts: vec![] };
        let body = serde_json::to_vec(&saved).unwrap();
        let mut ok = body.clone();
        ok.push(b'\n');
        ok.extend_from_slice(Id::of(&body).to_string().as_bytes());
        ok.push(b'\n');
        assert_eq!(count(&ok), Ok((0, 0)));
        let mut flipped = ok.clone();
        flipped[2] ^= 1;
        assert!(decode(&flipped).is_err_and(|e| e.contains("checksum")));
        assert!(decode(&ok[..ok.len() - 1]).is_err(), "cut short");
    }
}
