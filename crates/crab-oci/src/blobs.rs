//! The blob cache: content-addressed files under `<dir>/sha256/<hex>`, each verified against
//! its digest before it gets its name. A blob being downloaded is `<hex>.partial` (a pull that
//! is interrupted resumes from it); only a complete, verified blob is renamed to `<hex>`, so a
//! present blob is a good one.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{OciError, Result};

/// The hex of a `sha256:` digest, checked (64 lowercase hex digits): other algorithms and
/// malformed digests are refused (a digest becomes a file name).
pub fn sha256_hex(digest: &str) -> Result<&str> {
    let h = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| OciError::Invalid(format!("digest {digest:?} is not a sha256 digest")))?;
    if h.len() != 64 || !h.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        return Err(OciError::Invalid(format!("digest {digest:?} is malformed")));
    }
    Ok(h)
}

/// `sha256:<hex>` of bytes.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// `sha256:<hex>` of a file's bytes.
pub fn digest_of_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(OciError::io("open", path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(OciError::io("read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("sha256:{}", hex(&h.finalize())))
}

/// Check that a file's bytes have `digest`; `what` names the blob in the error.
pub fn verify_file(path: &Path, digest: &str, what: &str) -> Result<()> {
    sha256_hex(digest)?;
    let got = digest_of_file(path)?;
    if got != digest {
        return Err(OciError::Digest { what: what.to_string(), want: digest.to_string(), got });
    }
    Ok(())
}

/// Check that bytes have `digest`.
pub fn verify_bytes(bytes: &[u8], digest: &str, what: &str) -> Result<()> {
    sha256_hex(digest)?;
    let got = digest_of(bytes);
    if got != digest {
        return Err(OciError::Digest { what: what.to_string(), want: digest.to_string(), got });
    }
    Ok(())
}

/// Read a small JSON blob (a manifest, index or config), refusing more than `max` bytes.
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let f = File::open(path).map_err(OciError::io("open", path))?;
    let mut out = Vec::new();
    f.take(max + 1).read_to_end(&mut out).map_err(OciError::io("read", path))?;
    if out.len() as u64 > max {
        return Err(OciError::Invalid(format!(
            "{} is larger than {max} bytes, more than any manifest or config",
            path.display()
        )));
    }
    Ok(out)
}

/// Largest manifest, index or config read.
pub const MAX_JSON: u64 = 4 << 20;

/// A directory of verified blobs.
#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    /// The store under `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        BlobStore { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where blob `digest` lives (whether or not it is there).
    pub fn path(&self, digest: &str) -> Result<PathBuf> {
        Ok(self.dir.join("sha256").join(sha256_hex(digest)?))
    }

    /// Where a download of `digest` accumulates.
    pub fn partial(&self, digest: &str) -> Result<PathBuf> {
        Ok(self.dir.join("sha256").join(format!("{}.partial", sha256_hex(digest)?)))
    }

    /// Whether blob `digest` is present (present blobs were verified when they were stored).
    pub fn has(&self, digest: &str) -> bool {
        self.path(digest).map(|p| p.is_file()).unwrap_or(false)
    }

    /// Open (creating) the partial file of `digest` for appending; returns it and the bytes
    /// it already holds (where a resumed download starts).
    pub fn open_partial(&self, digest: &str) -> Result<(File, u64)> {
        let p = self.partial(digest)?;
        if let Some(d) = p.parent() {
            fs::create_dir_all(d).map_err(OciError::io("create", d))?;
        }
        let f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .map_err(OciError::io("open", &p))?;
        let n = f.metadata().map_err(OciError::io("stat", &p))?.len();
        Ok((f, n))
    }

    /// Verify the partial file of `digest` and give it its name. A mismatch deletes it (the
    /// next pull downloads it again) and fails.
    pub fn commit_partial(&self, digest: &str, what: &str) -> Result<PathBuf> {
        let p = self.partial(digest)?;
        if let Err(e) = verify_file(&p, digest, what) {
            let _ = fs::remove_file(&p);
            return Err(e);
        }
        let dst = self.path(digest)?;
        fs::rename(&p, &dst).map_err(OciError::io("rename", &p))?;
        Ok(dst)
    }

    /// Store bytes as blob `digest` after checking them.
    pub fn put_bytes(&self, digest: &str, bytes: &[u8], what: &str) -> Result<PathBuf> {
        verify_bytes(bytes, digest, what)?;
        let dst = self.path(digest)?;
        if dst.is_file() {
            return Ok(dst);
        }
        let (mut f, _) = self.open_partial(digest)?;
        f.set_len(0).map_err(OciError::io("truncate", self.partial(digest)?))?;
        f.write_all(bytes).map_err(OciError::io("write", self.partial(digest)?))?;
        drop(f);
        self.commit_partial(digest, what)
    }

    /// Bytes of every blob in the store.
    pub fn size(&self) -> u64 {
        let Ok(rd) = fs::read_dir(self.dir.join("sha256")) else { return 0 };
        rd.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum()
    }

    /// Delete every blob (`image prune`-style; images do not need their blobs once applied).
    pub fn clear(&self) -> io::Result<()> {
        match fs::remove_dir_all(self.dir.join("sha256")) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn blobs_are_stored_only_when_they_match() {
        let d = tempfile::tempdir().unwrap();
        let s = BlobStore::new(d.path());
        let good = digest_of(b"hello");
        s.put_bytes(&good, b"hello", "test").unwrap();
        assert!(s.has(&good));
        let bad = digest_of(b"other");
        assert!(matches!(s.put_bytes(&bad, b"hello", "test"), Err(OciError::Digest { .. })));
        assert!(!s.has(&bad));
        assert!(!s.partial(&bad).unwrap().exists());
        assert!(s.path("sha256:../../etc").is_err());
    }
}
