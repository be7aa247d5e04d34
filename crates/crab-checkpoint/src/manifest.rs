//! The restore-point manifest: its contents, its on-disk encoding, and atomic publication.
//!
//! A restore point `C_i = (P_j, F_k)` is one manifest file `points/<C_i>.manifest`. It is
//! self-describing and integrity-checked (the format is specified in `docs/format.md`):
//!
//! ```text
//! crab-restore-point 1\n          magic and format version
//! { ...JSON body... }\n           the Manifest, pretty-printed
//! sha256 <64 hex digits>\n        SHA-256 of every byte above this line
//! ```
//!
//! [`encode`] / [`decode`] own that encoding; [`write_atomic`] publishes a file so that a crash
//! at any point leaves either the old state or the complete new file (temp file, `fsync`,
//! `rename`, `fsync` of the directory).

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crab_common::PointKind;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::error::{CheckpointError, Result};

/// First word of every manifest.
pub const MAGIC: &str = "crab-restore-point";
/// The format version this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
/// File-name suffix of manifests.
pub const MANIFEST_SUFFIX: &str = ".manifest";

macro_rules! seq_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl $name {
            /// The letter ids of this kind start with.
            pub const PREFIX: char = $prefix;
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}{:06}", $prefix, self.0)
            }
        }

        impl FromStr for $name {
            type Err = String;
            /// Accepts `c000007`, `c7` and `7`.
            fn from_str(s: &str) -> Result<Self, String> {
                let digits = s.strip_prefix($prefix).unwrap_or(s);
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(format!(
                        "{s:?} is not an id of the form {}000123",
                        $prefix
                    ));
                }
                digits.parse().map($name).map_err(|e| format!("{s:?}: {e}"))
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                if !s.starts_with($prefix) {
                    return Err(serde::de::Error::custom(format!(
                        "id {s:?} does not start with {:?}",
                        $prefix
                    )));
                }
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

seq_id!(
    /// Id of a restore point `C_i` (`c000007`).
    PointId,
    'c'
);
seq_id!(
    /// Id of a process image `P_j` (`p000003`).
    ProcId,
    'p'
);
seq_id!(
    /// Id of a filesystem snapshot `F_k` (`f000004`).
    FsId,
    'f'
);

/// A filesystem snapshot `F_k`: the read-only subvolume `fs/<id>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsPart {
    /// Its id.
    pub id: FsId,
    /// When it was taken, milliseconds since the epoch.
    pub created_at_ms: u64,
    /// Bytes changed since the previous snapshot, when known.
    pub delta_bytes: Option<u64>,
    /// btrfs generation of the snapshot, when known.
    pub generation: Option<u64>,
    /// Bytes the sandbox's live root had written in all (its simple-quota count) when the
    /// snapshot was taken; the next snapshot's `delta_bytes` is the growth of this count.
    #[serde(default)]
    pub written_bytes: Option<u64>,
}

/// One file of a process image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageFile {
    /// File name inside the image directory (no `/`).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the contents, lower-case hex.
    pub sha256: String,
}

/// Longest file name of a process image file, bytes (the kernel's `NAME_MAX`).
pub const MAX_IMAGE_NAME: usize = 255;

/// Check that `name` can name a file *inside* a process image directory: one normal path
/// component (not empty, not `.` or `..`, no `/`, no NUL, at most [`MAX_IMAGE_NAME`] bytes).
/// A manifest read from elsewhere (a remote store) is checked with this before any of its
/// names is joined to a path.
pub fn check_image_name(name: &str) -> std::result::Result<(), String> {
    let shown: String = name.chars().take(80).collect();
    if name.is_empty() || name == "." || name == ".." {
        return Err(format!("image file name {shown:?} is not a file name"));
    }
    if name.len() > MAX_IMAGE_NAME {
        return Err(format!(
            "image file name {shown:?}… is {} bytes long (at most {MAX_IMAGE_NAME})",
            name.len()
        ));
    }
    if name.bytes().any(|b| b == b'/' || b == 0) {
        return Err(format!(
            "image file name {shown:?} is not a single path component (it holds `/` or NUL)"
        ));
    }
    Ok(())
}

/// A process image `P_j`: the CRIU image directory `procs/<id>/`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcPart {
    /// Its id.
    pub id: ProcId,
    /// When it was taken, milliseconds since the epoch.
    pub created_at_ms: u64,
    /// Host pid of the dumped root task (the sandbox's init) at dump time.
    pub root_pid: i32,
    /// CRIU version that wrote it.
    pub criu_version: String,
    /// Every file of the image directory, sorted by name.
    pub files: Vec<ImageFile>,
    /// Total bytes of `files`.
    pub bytes: u64,
}

/// Where a forked sandbox's first point came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// Source sandbox.
    pub sandbox: String,
    /// Source restore point.
    pub point: PointId,
}

/// Wall times of the checkpoint that published this point, in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    /// Time the sandbox's processes were frozen.
    pub frozen_us: Option<u64>,
    /// The filesystem snapshot.
    pub fs_snapshot_us: Option<u64>,
    /// The CRIU dump (RPC round trip).
    pub dump_us: Option<u64>,
    /// Hashing the image files.
    pub hash_us: Option<u64>,
    /// Making the image files durable (`syncfs`).
    #[serde(default)]
    pub sync_us: Option<u64>,
    /// Waiting for the sandbox's checkpoint lock and its store's lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_us: Option<u64>,
    /// Making the new parts' directory entries durable (`fsync` of `procs/` and `fs/`; only
    /// of the ones that got a new part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir_sync_us: Option<u64>,
    /// Start of the checkpoint to the manifest's publication.
    pub total_us: Option<u64>,
}

/// A restore point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Its id `C_i`.
    pub id: PointId,
    /// The sandbox it belongs to.
    pub sandbox: String,
    /// Agent turn number.
    pub turn: u64,
    /// What this point newly captured (`skip`, `fs`, `process`, `full`), or `restore` for the
    /// marker a restore publishes.
    pub kind: PointKind,
    /// The previous point of this sandbox, if any.
    pub parent: Option<PointId>,
    /// For the first point of a forked sandbox: where it was forked from.
    #[serde(default)]
    pub origin: Option<Origin>,
    /// Publication time, milliseconds since the epoch.
    pub created_at_ms: u64,
    /// Offset of the conversation log at this turn (filled by the coordinator).
    pub conversation_offset: Option<u64>,
    /// The filesystem snapshot `F_k` (absent only for a sandbox never snapshotted).
    pub fs: Option<FsPart>,
    /// The process image `P_j` (absent: restore starts the sandbox fresh on `F_k`).
    pub procs: Option<ProcPart>,
    /// Timings of the checkpoint.
    pub timings: Timings,
    /// What the runtime needs to rebuild the sandbox (network mode, limits, hostname...).
    /// Opaque to this crate.
    #[serde(default)]
    pub sandbox_meta: serde_json::Value,
    /// Why a checkpoint asked to include processes has none (CRIU could not dump them, e.g. a
    /// bpffs or debugfs mount it refuses): the point holds the filesystem only, and a restore
    /// starts a fresh init on it. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procs_missing: Option<String>,
}

impl Manifest {
    /// Bytes of the parts this point references (process image plus filesystem delta).
    pub fn size_bytes(&self) -> u64 {
        self.procs.as_ref().map_or(0, |p| p.bytes)
            + self.fs.as_ref().and_then(|f| f.delta_bytes).unwrap_or(0)
    }
}

/// Hex of a SHA-256 digest.
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Encode a manifest in the on-disk format.
pub fn encode(m: &Manifest) -> Vec<u8> {
    let mut out = format!("{MAGIC} {FORMAT_VERSION}\n").into_bytes();
    // Serializing plain data structs with string keys cannot fail.
    let body = serde_json::to_vec_pretty(m).unwrap_or_default();
    out.extend_from_slice(&body);
    out.push(b'\n');
    let digest = Sha256::digest(&out);
    out.extend_from_slice(format!("sha256 {}\n", hex(&digest)).as_bytes());
    out
}

/// Decode and verify a manifest read from `path` (used in error messages).
pub fn decode(bytes: &[u8], path: &Path) -> Result<Manifest> {
    let bad = |reason: String| CheckpointError::corrupt(path, reason);
    let header_end = bytes
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| bad("no header line (empty or truncated file)".into()))?;
    let header =
        std::str::from_utf8(&bytes[..header_end]).map_err(|_| bad("header is not UTF-8".into()))?;
    let (magic, version) = header.split_once(' ').unwrap_or((header, ""));
    if magic != MAGIC {
        return Err(bad(format!("bad magic {magic:?}, expected {MAGIC:?}")));
    }
    let version: u32 =
        version.parse().map_err(|_| bad(format!("bad format version {version:?}")))?;
    if version == 0 || version > FORMAT_VERSION {
        return Err(bad(format!(
            "format version {version} is not supported (this build reads 1..={FORMAT_VERSION})"
        )));
    }
    // The trailer is the last line: "sha256 <hex>\n".
    let without_nl =
        bytes.strip_suffix(b"\n").ok_or_else(|| bad("truncated: no final newline".into()))?;
    let trailer_start = without_nl.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
    if trailer_start <= header_end {
        return Err(bad("truncated: no checksum line".into()));
    }
    let trailer = std::str::from_utf8(&without_nl[trailer_start..])
        .map_err(|_| bad("checksum line is not UTF-8".into()))?;
    let expected = trailer
        .strip_prefix("sha256 ")
        .ok_or_else(|| bad(format!("truncated: last line {trailer:?} is not a checksum")))?;
    let covered = &bytes[..trailer_start];
    let actual = hex(&Sha256::digest(covered));
    if actual != expected {
        return Err(bad(format!(
            "checksum mismatch: file says {expected}, contents hash to {actual}"
        )));
    }
    let body = &covered[header_end + 1..];
    serde_json::from_slice(body).map_err(|e| bad(format!("body does not parse: {e}")))
}

/// Read and verify the manifest at `path`.
pub fn read(path: &Path) -> Result<Manifest> {
    let bytes = std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            CheckpointError::corrupt(path, "manifest is missing")
        } else {
            CheckpointError::io("read", path, e)
        }
    })?;
    decode(&bytes, path)
}

fn atomic_err(e: crab_common::fsutil::AtomicWriteError) -> CheckpointError {
    CheckpointError::io(e.op, &e.path, e.source)
}

/// fsync a directory.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    crab_common::fsutil::fsync_dir(dir).map_err(atomic_err)
}

/// Write `bytes` to `path` atomically and durably ([`crab_common::fsutil::write_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    crab_common::fsutil::write_atomic(path, bytes).map_err(atomic_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            id: PointId(7),
            sandbox: "sb1".into(),
            turn: 7,
            kind: PointKind::FULL,
            parent: Some(PointId(6)),
            origin: None,
            created_at_ms: 1_700_000_000_000,
            conversation_offset: None,
            fs: Some(FsPart {
                id: FsId(3),
                created_at_ms: 1,
                delta_bytes: Some(4096),
                generation: Some(12),
                written_bytes: Some(8192),
            }),
            procs: Some(ProcPart {
                id: ProcId(2),
                created_at_ms: 1,
                root_pid: 42,
                criu_version: "4.2.1".into(),
                files: vec![ImageFile { name: "core-1.img".into(), size: 3, sha256: "ab".into() }],
                bytes: 3,
            }),
            timings: Timings { total_us: Some(1000), ..Default::default() },
            sandbox_meta: serde_json::json!({"net": "private"}),
            procs_missing: None,
        }
    }

    #[test]
    fn ids_print_and_parse() {
        assert_eq!(PointId(7).to_string(), "c000007");
        assert_eq!("c000007".parse::<PointId>(), Ok(PointId(7)));
        assert_eq!("7".parse::<PointId>(), Ok(PointId(7)));
        assert_eq!("c12".parse::<PointId>(), Ok(PointId(12)));
        assert!("p7".parse::<PointId>().is_err());
        assert!("".parse::<PointId>().is_err());
        assert!("c-1".parse::<PointId>().is_err());
        assert_eq!(ProcId(3).to_string(), "p000003");
        assert_eq!(FsId(1_234_567).to_string(), "f1234567");
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let bytes = encode(&m);
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with("crab-restore-point 1\n{"));
        assert!(text.lines().last().unwrap().starts_with("sha256 "));
        assert_eq!(decode(&bytes, Path::new("x")).unwrap(), m);
    }

    /// Manifests already on disk spell the kind as one lower-case word (docs/format.md).
    #[test]
    fn kind_spelling_is_the_persisted_one() {
        for (kind, word) in [
            (PointKind::SKIP, "skip"),
            (PointKind::FS, "fs"),
            (PointKind::PROCESS, "process"),
            (PointKind::FULL, "full"),
            (PointKind::Restore, "restore"),
        ] {
            let m = Manifest { kind, ..sample() };
            let bytes = encode(&m);
            let text = String::from_utf8(bytes.clone()).unwrap();
            assert!(text.contains(&format!("\"kind\": \"{word}\"")), "{text}");
            assert_eq!(decode(&bytes, Path::new("x")).unwrap().kind, kind);
        }
    }

    #[test]
    fn every_single_byte_flip_is_detected() {
        let bytes = encode(&sample());
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            assert!(decode(&b, Path::new("x")).is_err(), "flip at byte {i} not detected");
        }
    }

    #[test]
    fn truncation_is_detected() {
        let bytes = encode(&sample());
        for len in 0..bytes.len() {
            let err = decode(&bytes[..len], Path::new("/p/c000007.manifest")).unwrap_err();
            assert!(err.to_string().contains("/p/c000007.manifest"), "{err}");
        }
    }

    #[test]
    fn refuses_bad_magic_and_future_versions() {
        let text = String::from_utf8(encode(&sample())).unwrap();
        let future = text.replacen("crab-restore-point 1", "crab-restore-point 2", 1);
        let err = decode(future.as_bytes(), Path::new("x")).unwrap_err().to_string();
        assert!(err.contains("format version 2"), "{err}");
        let other = text.replacen("crab-restore-point", "something-else", 1);
        let err = decode(other.as_bytes(), Path::new("x")).unwrap_err().to_string();
        assert!(err.contains("bad magic"), "{err}");
    }

    #[test]
    fn write_atomic_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c000001.manifest");
        write_atomic(&p, &encode(&sample())).unwrap();
        assert_eq!(read(&p).unwrap(), sample());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec!["c000001.manifest".to_string()]);
    }
}
