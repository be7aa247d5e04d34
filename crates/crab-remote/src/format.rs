//! The repository's persisted objects (documented in `docs/format.md`, "Remote repository"):
//! the framing every metadata object shares (magic + version header, payload, BLAKE3 trailer),
//! the config, index, point and lock bodies, and the tree blobs.

use serde::{Deserialize, Serialize};

use crate::error::{RemoteError, Result};
use crate::id::Id;

/// Version of every framed object this build writes; it reads `1..=FORMAT_VERSION`.
pub const FORMAT_VERSION: u32 = 2;

const TRAILER_TAG: &[u8] = b"\nblake3 ";
/// `\nblake3 ` + 64 hex + `\n`.
const TRAILER_LEN: usize = 8 + 64 + 1;

/// Frame `payload` as object kind `kind` (`config`, `index`, `point`, `lock`, `image`).
pub fn frame(kind: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = format!("crab-remote-{kind} {FORMAT_VERSION}\n").into_bytes();
    out.extend_from_slice(payload);
    let sum = blake3::hash(&out);
    out.extend_from_slice(TRAILER_TAG);
    out.extend_from_slice(sum.to_hex().as_bytes());
    out.push(b'\n');
    out
}

/// Check the framing of `bytes` (object key `object`) and return its payload.
pub fn unframe<'a>(kind: &str, bytes: &'a [u8], object: &str) -> Result<&'a [u8]> {
    let bad = |reason: String| RemoteError::corrupt(object, reason);
    let nl = bytes.iter().position(|&b| b == b'\n').ok_or_else(|| bad("no header line".into()))?;
    let header =
        std::str::from_utf8(&bytes[..nl]).map_err(|_| bad("header is not UTF-8".into()))?;
    let magic = format!("crab-remote-{kind}");
    let (m, v) = header
        .split_once(' ')
        .ok_or_else(|| bad(format!("header {header:?} is not `{magic} VERSION`")))?;
    if m != magic {
        return Err(bad(format!("magic {m:?}, expected {magic:?}")));
    }
    let version: u32 = v.parse().map_err(|_| bad(format!("version {v:?} is not a number")))?;
    if version == 0 || version > FORMAT_VERSION {
        return Err(bad(format!(
            "format version {version}; this build reads 1..={FORMAT_VERSION} (upgrade crab)"
        )));
    }
    if bytes.len() < nl + 1 + TRAILER_LEN {
        return Err(bad("truncated: no trailer".into()));
    }
    let body_end = bytes.len() - TRAILER_LEN;
    let trailer = &bytes[body_end..];
    if &trailer[..8] != TRAILER_TAG || trailer[TRAILER_LEN - 1] != b'\n' {
        return Err(bad("trailer is not `blake3 HEX`".into()));
    }
    let want =
        std::str::from_utf8(&trailer[8..8 + 64]).map_err(|_| bad("trailer is not hex".into()))?;
    let got = blake3::hash(&bytes[..body_end]);
    if got.to_hex().as_str() != want {
        return Err(bad(format!(
            "checksum mismatch (trailer {}, content {})",
            &want[..12],
            &got.to_hex()[..12]
        )));
    }
    Ok(&bytes[nl + 1..body_end])
}

/// Chunker parameters (bytes), fixed per repository.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChunkerParams {
    /// FastCDC minimum chunk size.
    pub min: u32,
    /// Average.
    pub avg: u32,
    /// Maximum.
    pub max: u32,
}

impl Default for ChunkerParams {
    fn default() -> Self {
        ChunkerParams { min: 64 * 1024, avg: 256 * 1024, max: 1024 * 1024 }
    }
}

/// `config`: written once when the repository is created; never encrypted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    /// Random id of the repository.
    pub repo_id: String,
    /// Creation time, ms since the epoch.
    pub created_at_ms: u64,
    /// Content-defined chunking parameters.
    pub chunker: ChunkerParams,
    /// zstd level used for blobs.
    pub zstd_level: i32,
    /// `null`, or how blobs and metadata are encrypted.
    pub encryption: Option<EncryptionInfo>,
}

/// Encryption of a repository.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EncryptionInfo {
    /// `xchacha20poly1305`.
    pub cipher: String,
    /// Keyed BLAKE3 of a fixed string: tells a wrong key from corrupt data.
    pub key_check: String,
}

/// What a blob holds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum BlobKind {
    /// File content (one chunk).
    Data,
    /// A directory listing ([`Tree`]).
    Tree,
}

/// One blob's place in a pack.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexEntry {
    /// Blob id.
    pub id: Id,
    /// What it holds.
    pub kind: BlobKind,
    /// Pack it is in.
    pub pack: Id,
    /// Byte offset in the pack.
    pub offset: u64,
    /// Stored length (compressed, sealed).
    pub length: u64,
    /// Plaintext length.
    pub raw_length: u64,
}

/// `index/<id>`: the blobs of some packs.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct IndexFile {
    /// Entries, in pack order.
    pub blobs: Vec<IndexEntry>,
}

/// A file's content: its chunks in order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Content {
    /// Total plaintext size.
    pub size: u64,
    /// Data blob ids, in order.
    pub chunks: Vec<Id>,
}

/// What the point was taken on: checked before its processes are restored elsewhere.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct HostFacts {
    /// Host name of the exporting daemon.
    pub hostname: String,
    /// `uname -r`.
    pub kernel: String,
    /// `uname -m`.
    pub machine: String,
    /// The CPU flags of `/proc/cpuinfo` (sorted).
    pub cpu_flags: Vec<String>,
}

/// The image a point's sandbox was created from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageRef {
    /// Local image name.
    pub name: String,
    /// Root tree of the image's files (its identity).
    pub tree: Id,
    /// The registry reference it was pulled from, for an OCI image (a host without the image
    /// pulls it from there instead of downloading its tree from the store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// Its manifest's digest (`sha256:…`), with `reference`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// `points/<sandbox>/<point>`: one exported restore point; it exists only when every object
/// it references does (it is written last).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PointRecord {
    /// Sandbox.
    pub sandbox: String,
    /// Local point id (`c000007`).
    pub point: String,
    /// Agent turn.
    pub turn: u64,
    /// `skip` / `fs` / `process` / `full` / `restore`.
    pub kind: String,
    /// When the point was taken (ms since the epoch).
    pub created_at_ms: u64,
    /// When its export completed.
    pub exported_at_ms: u64,
    /// Where it was taken.
    pub host: HostFacts,
    /// The local manifest file, byte for byte.
    pub manifest: Content,
    /// Root tree of the filesystem snapshot.
    pub fs: Option<Id>,
    /// Tree of the CRIU image directory.
    pub procs: Option<Id>,
    /// CRIU version that dumped `procs`.
    pub criu_version: Option<String>,
    /// The conversation log up to the point.
    pub conversation: Option<Content>,
    /// The image the sandbox was created from.
    pub image: Option<ImageRef>,
    /// The tree objects a restore over `image` reads (both sides of every directory that
    /// differs from the image's, then every tree of the directories the image lacks), top
    /// levels first, at most [`crate::tree::WALK_HINT_MAX`]: fetched at once instead of one
    /// round trip per level. Only a hint (ids the index does not list as trees are
    /// ignored); absent from older records and points without an image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub walk: Option<Vec<Id>>,
    /// Logical size of the point (files + images + log), bytes.
    pub size_bytes: u64,
    /// Bytes this export uploaded (new packs, index, this record).
    pub uploaded_bytes: u64,
}

/// `locks/<id>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LockRecord {
    /// `shared` (exporters, restorers) or `exclusive` (prune).
    pub exclusive: bool,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// When taken.
    pub created_at_ms: u64,
}

/// `images/<name>/<tree>`: an image exported once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageRecord {
    /// Image name.
    pub name: String,
    /// Root tree.
    pub tree: Id,
    /// Export time.
    pub exported_at_ms: u64,
}

/// What a tree entry is.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Character device.
    Char,
    /// Block device.
    Block,
    /// Named pipe.
    Fifo,
}

/// One entry of a directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Entry {
    /// File name (UTF-8), or `name_hex` for other bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// File name bytes in hex when not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name_hex: Option<String>,
    /// Kind.
    pub kind: EntryKind,
    /// Permission bits (`& 0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, ns since the epoch.
    pub mtime_ns: i64,
    /// Regular file: its content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// Directory: its tree blob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subtree: Option<Id>,
    /// Symlink target bytes, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_hex: Option<String>,
    /// Device number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdev: Option<u64>,
    /// Extended attributes in the `user.` namespace, sorted by name (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xattrs: Option<Vec<Xattr>>,
    /// Regular file that is another name of an earlier file of the same tree (a hard link):
    /// that file's path from the tree's root, hex (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_hex: Option<String>,
}

/// One extended attribute.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Xattr {
    /// Its full name (`user.…`).
    pub name: String,
    /// Its value, hex.
    pub value_hex: String,
}

/// Extended attributes carried: only this namespace (see `docs/format.md`).
pub const XATTR_PREFIX: &str = "user.";
/// At most this many extended attributes per entry.
pub const XATTR_MAX_COUNT: usize = 64;
/// Longest extended attribute name, bytes (the kernel's `XATTR_NAME_MAX`).
pub const XATTR_MAX_NAME: usize = 255;
/// Largest extended attribute value, bytes (the kernel's `XATTR_SIZE_MAX`).
pub const XATTR_MAX_VALUE: usize = 65536;
/// Largest sum of an entry's extended attribute values, bytes.
pub const XATTR_MAX_TOTAL: usize = 256 * 1024;

/// A directory listing, entries sorted by name bytes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Tree {
    /// Entries.
    pub entries: Vec<Entry>,
}

impl Entry {
    /// The name's bytes; validated: non-empty, at most [`MAX_NAME`] bytes, no `/` or NUL, not
    /// `.` or `..`.
    pub fn name_bytes(&self, object: &str) -> Result<Vec<u8>> {
        let bytes = match (&self.name, &self.name_hex) {
            (Some(n), None) => n.as_bytes().to_vec(),
            (None, Some(h)) => hex::decode(h).map_err(|_| {
                RemoteError::corrupt(object, format!("entry name_hex {h:?} is not hex"))
            })?,
            _ => {
                return Err(RemoteError::corrupt(
                    object,
                    "entry has neither or both of name and name_hex",
                ))
            }
        };
        if bytes.is_empty()
            || bytes.len() > MAX_NAME
            || bytes == b"."
            || bytes == b".."
            || bytes.iter().any(|&b| b == b'/' || b == 0)
        {
            return Err(RemoteError::corrupt(
                object,
                format!(
                    "entry name {:?} is not a plain file name",
                    String::from_utf8_lossy(&bytes)
                ),
            ));
        }
        Ok(bytes)
    }

    /// Set the name from raw bytes.
    pub fn set_name(&mut self, bytes: &[u8]) {
        match std::str::from_utf8(bytes) {
            Ok(s) => self.name = Some(s.to_string()),
            Err(_) => self.name_hex = Some(hex::encode(bytes)),
        }
    }
}

/// Longest entry name, bytes (the kernel's `NAME_MAX`).
pub const MAX_NAME: usize = 255;

/// Sanity bound on a single blob (chunks are ≤ `chunker.max`; trees of huge directories more).
pub const MAX_BLOB: u64 = 256 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_single_byte_change_and_truncation_is_detected() {
        let framed = frame("point", b"{\"a\":1}");
        assert_eq!(unframe("point", &framed, "x").expect("ok"), b"{\"a\":1}");
        for i in 0..framed.len() {
            let mut bad = framed.clone();
            bad[i] ^= 0x01;
            assert!(unframe("point", &bad, "x").is_err(), "flip at {i} accepted");
            assert!(unframe("point", &framed[..i], "x").is_err(), "truncation at {i} accepted");
        }
        let err = unframe("index", &framed, "points/a/b").expect_err("wrong kind");
        assert!(err.to_string().contains("points/a/b"), "{err}");
    }

    #[test]
    fn newer_version_is_refused() {
        let mut v2 = b"crab-remote-point 3\n{}".to_vec();
        let sum = blake3::hash(&v2);
        v2.extend_from_slice(b"\nblake3 ");
        v2.extend_from_slice(sum.to_hex().as_bytes());
        v2.push(b'\n');
        let err = unframe("point", &v2, "p").expect_err("v3");
        assert!(err.to_string().contains("version 3"), "{err}");
    }

    #[test]
    fn version_1_objects_are_still_read() {
        let mut v1 = b"crab-remote-point 1\n{}".to_vec();
        let sum = blake3::hash(&v1);
        v1.extend_from_slice(b"\nblake3 ");
        v1.extend_from_slice(sum.to_hex().as_bytes());
        v1.push(b'\n');
        assert_eq!(unframe("point", &v1, "p").expect("v1"), b"{}");
    }

    #[test]
    fn names_are_validated() {
        let mut e = Entry {
            name: None,
            name_hex: None,
            kind: EntryKind::File,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_ns: 0,
            content: None,
            subtree: None,
            target_hex: None,
            rdev: None,
            xattrs: None,
            link_hex: None,
        };
        let long = "x".repeat(MAX_NAME + 1);
        for bad in ["", ".", "..", "a/b", "../x", "/etc", "a\0b", &long] {
            e.name = Some(bad.into());
            assert!(e.name_bytes("t").is_err(), "{bad:?} accepted");
        }
        e.name = Some("ok.txt".into());
        assert_eq!(e.name_bytes("t").expect("ok"), b"ok.txt");
    }
}
