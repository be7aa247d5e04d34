//! Layers: OCI image layers applied once each, as read-only btrfs subvolumes keyed by chain id.
//!
//! The containers/storage btrfs driver is the model: layer *n* is a snapshot of layer *n − 1*
//! with layer *n*'s tar applied, stored under `<pool>/layers/<chain-id hex>` and named by its
//! OCI chain id (`ChainID(L₀) = DiffID(L₀)`, `ChainID(Lₙ) = sha256(ChainID(Lₙ₋₁) + " " +
//! DiffID(Lₙ))`), so images on one base store the base once. A layer is applied in a staging
//! subvolume under the pool's `tmp/` and becomes visible only once complete: read-only, renamed
//! into place, its record (`<chain hex>.json`) written last.
//!
//! Layers are hostile input. Every entry is checked before anything is written: no absolute
//! names or `..`, nothing written through a symlink (of this layer or a lower one) or into a
//! non-directory, hard links only to files already inside the layer's tree, symlinks that do not
//! climb above the root (the same rules as [`crate::archive`]'s root-filesystem imports), and
//! bounded entry counts, path lengths and unpacked bytes. A refusal names the entry and why; the
//! staging subvolume is deleted and no layer appears. Whiteouts (`.wh.NAME`) delete `NAME` from
//! the layers below; an opaque marker (`.wh..wh..opq`) hides a directory's lower contents. The
//! uncompressed stream is hashed as it is applied and must equal the layer's diff id.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufReader, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crab_common::paths::StateDir;
use crab_common::Progress;

use crate::error::{Result, SandboxError};
use crate::{btrfs, runtime};

/// One layer blob of an image, as fetched or imported (bottom layer first in an image).
#[derive(Debug, Clone)]
pub struct LayerBlob {
    /// Digest of the blob as stored (`sha256:…`; of the compressed bytes).
    pub digest: String,
    /// Digest of the uncompressed tar (`sha256:…`, the config's `rootfs.diff_ids` entry).
    pub diff_id: String,
    /// Media type (`application/vnd.oci.image.layer.v1.tar+gzip`, Docker's, …).
    pub media_type: String,
    /// The blob's bytes on this host (already verified against `digest`).
    pub path: PathBuf,
}

/// Limits on one layer.
#[derive(Debug, Clone, Copy)]
pub struct LayerLimits {
    /// Entries per layer.
    pub max_entries: u64,
    /// Uncompressed bytes per layer (the tar stream, headers included).
    pub max_bytes: u64,
    /// Bytes of one entry's path.
    pub max_path: usize,
}

impl Default for LayerLimits {
    fn default() -> Self {
        LayerLimits { max_entries: 4 << 20, max_bytes: 64 << 30, max_path: 4096 }
    }
}

/// A compressed blob of a layer's tar: the one it was installed from, or one `image push`
/// generated from its tree (in the host's blob cache while it is there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    /// Digest of the blob (`sha256:…`).
    pub digest: String,
    /// Its media type.
    pub media_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// Digest of the uncompressed tar (the diff id the blob unpacks to).
    pub diff_id: String,
}

/// The record format this build writes (2: with the optional `blob`).
pub const LAYER_RECORD_FORMAT: u32 = 2;

/// The persisted record of a layer (`<pool>/layers/<chain hex>.json`). Format 1: chain id,
/// diff id, parent, bytes, time. Format 2 adds `blob`, the compressed blob the layer came
/// from (or that `image push` generated from it); a format-1 record reads without it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerRecord {
    /// Format of this record (1 or 2).
    pub format: u32,
    /// Chain id (`sha256:…`).
    pub chain_id: String,
    /// Diff id of the layer's own tar.
    pub diff_id: String,
    /// Chain id of the layer below, if any.
    pub parent: Option<String>,
    /// Bytes of file contents this layer's tar wrote.
    pub diff_bytes: u64,
    /// Seconds since the epoch.
    pub created_at: u64,
    /// The layer's compressed blob, when known (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob: Option<BlobRef>,
}

/// The chain ids of a stack of diff ids (bottom first).
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let id = match out.last() {
            None => d.clone(),
            Some(parent) => {
                format!("sha256:{}", hex(&Sha256::digest(format!("{parent} {d}").as_bytes())))
            }
        };
        out.push(id);
    }
    out
}

/// Lowercase hex of bytes.
pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// The hex part of a `sha256:` digest, checked (64 lowercase hex digits).
pub fn sha256_hex(digest: &str) -> Result<&str> {
    let h = digest.strip_prefix("sha256:").ok_or_else(|| {
        SandboxError::Invalid(format!("digest {digest:?} is not a sha256 digest"))
    })?;
    if h.len() != 64 || !h.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        return Err(SandboxError::Invalid(format!("digest {digest:?} is malformed")));
    }
    Ok(h)
}

/// Directory of all layers.
pub fn layers_dir(state: &StateDir) -> PathBuf {
    state.pool().join("layers")
}

/// The subvolume of layer `chain` (whether or not it exists).
pub fn layer_path(state: &StateDir, chain: &str) -> Result<PathBuf> {
    Ok(layers_dir(state).join(sha256_hex(chain)?))
}

fn record_path(state: &StateDir, chain: &str) -> Result<PathBuf> {
    Ok(layers_dir(state).join(format!("{}.json", sha256_hex(chain)?)))
}

/// The record of layer `chain` when the layer is complete.
pub fn record(state: &StateDir, chain: &str) -> Option<LayerRecord> {
    let b = fs::read(record_path(state, chain).ok()?).ok()?;
    let r: LayerRecord = serde_json::from_slice(&b).ok()?;
    (r.chain_id == chain
        && r.format <= LAYER_RECORD_FORMAT
        && btrfs::is_subvolume(&layer_path(state, chain).ok()?))
    .then_some(r)
}

/// Remember `blob` as the compressed blob of layer `chain` (a blob `image push` generated from
/// its tree). Only an existing record is rewritten (atomically); a layer deleted meanwhile is
/// left alone.
pub fn set_blob(state: &StateDir, chain: &str, blob: BlobRef) -> Result<()> {
    let Some(mut rec) = record(state, chain) else { return Ok(()) };
    rec.format = LAYER_RECORD_FORMAT;
    rec.blob = Some(blob);
    let bytes = serde_json::to_vec_pretty(&rec).map_err(|e| SandboxError::Other(e.to_string()))?;
    runtime::write_atomic(&record_path(state, chain)?, &bytes)
}

/// Apply `layers` (bottom first) as a chain, reusing every layer already stored; returns the
/// chain ids and the path of the top layer's subvolume.
pub fn apply_all(
    state: &StateDir,
    layers: &[LayerBlob],
    limits: LayerLimits,
    progress: &dyn Progress,
) -> Result<(Vec<String>, PathBuf)> {
    if layers.is_empty() {
        return Err(SandboxError::Invalid("the image has no layers".into()));
    }
    let dir = layers_dir(state);
    fs::create_dir_all(&dir).map_err(SandboxError::io("create", &dir))?;
    let diff_ids: Vec<String> = layers.iter().map(|l| l.diff_id.clone()).collect();
    let chains = chain_ids(&diff_ids);
    let mut parent: Option<&str> = None;
    for (i, (l, chain)) in layers.iter().zip(&chains).enumerate() {
        if record(state, chain).is_some() {
            progress.message(&format!(
                "layer {}/{}: {} already stored",
                i + 1,
                layers.len(),
                short(chain)
            ));
        } else {
            progress
                .stage(&format!("layer {}/{} {}", i + 1, layers.len(), short(&l.diff_id)), None);
            apply_one(state, chain, parent, l, limits, progress)?;
        }
        parent = Some(chain);
    }
    let top = layer_path(state, chains.last().map(String::as_str).unwrap_or_default())?;
    Ok((chains, top))
}

fn short(d: &str) -> &str {
    let h = d.strip_prefix("sha256:").unwrap_or(d);
    &h[..h.len().min(12)]
}

/// Delete the layers in `chains` that no image in `keep` uses (the image's own chain ids
/// after it is removed), top first. Errors are logged: a leftover layer costs only disk.
pub fn release(state: &StateDir, chains: &[String], keep: &HashSet<String>) {
    for c in chains.iter().rev() {
        if keep.contains(c) {
            continue;
        }
        let (Ok(rec), Ok(sub)) = (record_path(state, c), layer_path(state, c)) else { continue };
        let _ = fs::remove_file(&rec);
        if sub.exists() {
            if let Err(e) = btrfs::remove_tree(&sub) {
                tracing::warn!(layer = %c, error = %e, "cannot delete an unused layer");
            }
        }
    }
}

/// A staging subvolume, deleted on drop unless taken.
struct LayerStaging(Option<PathBuf>);

impl Drop for LayerStaging {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = btrfs::set_readonly(&p, false);
            if let Err(e) = btrfs::remove_tree(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove a layer's staging subvolume");
            }
        }
    }
}

fn apply_one(
    state: &StateDir,
    chain: &str,
    parent: Option<&str>,
    blob: &LayerBlob,
    limits: LayerLimits,
    progress: &dyn Progress,
) -> Result<()> {
    let hex = sha256_hex(chain)?;
    let staging = state.tmp().join(format!("layer-{}-{:08x}", &hex[..12], runtime::rand_u32()));
    match parent {
        Some(p) => btrfs::snapshot(&layer_path(state, p)?, &staging, false)?,
        None => btrfs::create_subvolume(&staging)?,
    }
    let mut guard = LayerStaging(Some(staging.clone()));
    let diff_bytes = unpack_layer(blob, &staging, parent.is_none(), limits, progress)?;
    let dst = layer_path(state, chain)?;
    if dst.exists() {
        // A leftover without a record (a crash between rename and record): replace it.
        let _ = btrfs::set_readonly(&dst, false);
        btrfs::remove_tree(&dst).map_err(SandboxError::io("delete subvolume", &dst))?;
    }
    // Rename first: a read-only subvolume cannot be moved (its `..` entry would change).
    fs::rename(&staging, &dst).map_err(SandboxError::io("rename", &staging))?;
    guard.0 = Some(dst.clone());
    btrfs::set_readonly(&dst, true)?;
    let size = fs::metadata(&blob.path).map(|m| m.len()).ok();
    let rec = LayerRecord {
        format: LAYER_RECORD_FORMAT,
        chain_id: chain.to_string(),
        diff_id: blob.diff_id.clone(),
        parent: parent.map(str::to_string),
        diff_bytes,
        created_at: crab_common::clock::now_s(),
        blob: size.map(|size| BlobRef {
            digest: blob.digest.clone(),
            media_type: blob.media_type.clone(),
            size,
            diff_id: blob.diff_id.clone(),
        }),
    };
    let bytes = serde_json::to_vec_pretty(&rec).map_err(|e| SandboxError::Other(e.to_string()))?;
    runtime::write_atomic(&record_path(state, chain)?, &bytes)?;
    guard.0 = None;
    Ok(())
}

/// A reader that hashes and counts what passes through it, refusing past a byte limit.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    n: u64,
    max: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.hash.update(&buf[..k]);
        self.n += k as u64;
        if self.n > self.max {
            return Err(io::Error::other(format!(
                "the layer unpacks to more than {} bytes",
                self.max
            )));
        }
        Ok(k)
    }
}

fn decompressor(blob: &LayerBlob) -> Result<Box<dyn Read>> {
    let mut f = File::open(&blob.path).map_err(SandboxError::io("open", &blob.path))?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic).map_err(SandboxError::io("read", &blob.path))?;
    let f = BufReader::with_capacity(
        1 << 20,
        File::open(&blob.path).map_err(SandboxError::io("open", &blob.path))?,
    );
    if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        return Ok(Box::new(flate2::read::MultiGzDecoder::new(f)));
    }
    if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        let d = zstd::stream::read::Decoder::with_buffer(f)
            .map_err(SandboxError::io("zstd stream", &blob.path))?;
        return Ok(Box::new(d));
    }
    if blob.media_type.ends_with("+gzip")
        || blob.media_type.ends_with(".gzip")
        || blob.media_type.ends_with("+zstd")
    {
        return Err(SandboxError::Invalid(format!(
            "layer {} is said to be {} but its bytes are not",
            blob.digest, blob.media_type
        )));
    }
    Ok(Box::new(f))
}

fn refuse(blob: &LayerBlob, entry: &Path, why: impl Into<String>) -> SandboxError {
    SandboxError::UnsafeEntry {
        source_path: PathBuf::from(format!("layer {}", blob.digest)),
        entry: entry.display().to_string(),
        why: why.into(),
    }
}

/// The normal components of an entry path, or why it is refused.
fn normalize(p: &Path, max: usize) -> std::result::Result<PathBuf, &'static str> {
    if p.as_os_str().len() > max {
        return Err("has a path longer than the limit");
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::Prefix(_) => return Err("has an absolute path"),
            Component::ParentDir => return Err("has a `..` component"),
            Component::CurDir => {}
            Component::Normal(n) => out.push(n),
        }
    }
    Ok(out)
}

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// Unpack one layer tar onto `root` (a writable snapshot of the layer below); returns the
/// bytes of file contents written.
pub(crate) fn unpack_layer(
    blob: &LayerBlob,
    root: &Path,
    bottom: bool,
    limits: LayerLimits,
    progress: &dyn Progress,
) -> Result<u64> {
    let mut reader =
        Hashing { inner: decompressor(blob)?, hash: Sha256::new(), n: 0, max: limits.max_bytes };
    let bad = |e: io::Error| {
        SandboxError::Invalid(format!("layer {} is not a readable tar stream: {e}", blob.digest))
    };
    let mut written: HashSet<PathBuf> = HashSet::new();
    let mut times = DirTimes::default();
    if bottom {
        // A new subvolume's root was made now; the layer's tree must not depend on when.
        times.0.insert(PathBuf::new(), (0, 0));
    }
    let mut content = 0u64;
    {
        let mut ar = tar::Archive::new(&mut reader);
        for (i, entry) in ar.entries().map_err(bad)?.enumerate() {
            if i as u64 >= limits.max_entries {
                return Err(SandboxError::Invalid(format!(
                    "layer {} has more than {} entries",
                    blob.digest, limits.max_entries
                )));
            }
            let mut entry = entry.map_err(bad)?;
            let raw = entry.path().map_err(bad)?.into_owned();
            let rel = normalize(&raw, limits.max_path).map_err(|why| refuse(blob, &raw, why))?;
            if !rel.as_os_str().is_empty() {
                times.touch(root, rel.parent().unwrap_or(Path::new("")));
            }
            content += apply_entry(blob, root, &raw, &rel, &mut entry, &mut written, &mut times)?;
            if entry.header().entry_type() == tar::EntryType::Directory
                && !rel.as_os_str().is_empty()
            {
                // Its own time, set again at the end (its entries change it meanwhile).
                times.0.insert(rel.clone(), (entry.header().mtime().unwrap_or(0) as i64, 0));
            }
            if i % 512 == 0 {
                progress.advance(reader_count(&entry));
            }
        }
    }
    times.restore(root);
    // The rest of the stream (the tar's end blocks) belongs to the digest too.
    io::copy(&mut reader, &mut io::sink()).map_err(bad)?;
    let got = format!("sha256:{}", hex(&reader.hash.finalize()));
    if got != blob.diff_id {
        return Err(SandboxError::Invalid(format!(
            "layer {} unpacks to {got}, not the diff id {} its image config names; the image \
             is corrupt or was tampered with",
            blob.digest, blob.diff_id
        )));
    }
    Ok(content)
}

fn reader_count<R: Read>(e: &tar::Entry<'_, R>) -> u64 {
    e.raw_header_position()
}

/// The modification times directories end a layer with, so that applying a layer gives the
/// same tree whenever and wherever it is applied (a remote point's base image is recognized by
/// its tree, `crab_remote`): a directory the layer declares keeps the tar's time, one it only
/// changes keeps its time from the layer below, one made for a missing parent gets 0.
#[derive(Default)]
struct DirTimes(HashMap<PathBuf, (i64, i64)>);

impl DirTimes {
    /// `dir` (relative) is about to change: remember its time first, unless already known.
    fn touch(&mut self, root: &Path, dir: &Path) {
        if !self.0.contains_key(dir) {
            if let Ok(m) = fs::symlink_metadata(root.join(dir)) {
                if m.is_dir() {
                    self.0.insert(dir.to_path_buf(), (m.mtime(), m.mtime_nsec()));
                }
            }
        }
    }

    /// Set every remembered time (directories since removed or replaced are skipped).
    fn restore(&self, root: &Path) {
        for (dir, (sec, nsec)) in &self.0 {
            let p = root.join(dir);
            if !fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            set_times(&p, *sec, *nsec);
        }
    }
}

/// Set `p`'s access and modification times (not following a symlink there); best effort.
pub(crate) fn set_times(p: &Path, sec: i64, nsec: i64) {
    let ts = libc::timespec { tv_sec: sec as libc::time_t, tv_nsec: nsec as _ };
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return };
    // SAFETY: `c` is a valid NUL-terminated path and the timespecs live for the call.
    unsafe {
        libc::utimensat(libc::AT_FDCWD, c.as_ptr(), [ts, ts].as_ptr(), libc::AT_SYMLINK_NOFOLLOW)
    };
}

/// Check that every parent of `rel` under `root` is a real directory, creating missing ones.
fn check_parents(
    blob: &LayerBlob,
    root: &Path,
    raw: &Path,
    rel: &Path,
    times: &mut DirTimes,
) -> Result<()> {
    let Some(parent) = rel.parent() else { return Ok(()) };
    let mut at = root.to_path_buf();
    let mut shown = PathBuf::new();
    for c in parent.components() {
        at.push(c);
        shown.push(c);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refuse(
                    blob,
                    raw,
                    format!("would be written through the symlink {}", shown.display()),
                ))
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(refuse(
                    blob,
                    raw,
                    format!("has a parent {} that is not a directory", shown.display()),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                times.touch(root, shown.parent().unwrap_or(Path::new("")));
                times.0.insert(shown.clone(), (0, 0));
                fs::create_dir(&at).map_err(SandboxError::io("mkdir", &at))?;
                fs::set_permissions(&at, fs::Permissions::from_mode(0o755))
                    .map_err(SandboxError::io("chmod", &at))?;
            }
            Err(e) => return Err(SandboxError::io("stat", &at)(e)),
        }
    }
    Ok(())
}

/// Remove whatever is at `p` (not following a symlink there).
fn remove_any(p: &Path) -> Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p).map_err(SandboxError::io("remove", p)),
        Ok(_) => fs::remove_file(p).map_err(SandboxError::io("remove", p)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SandboxError::io("stat", p)(e)),
    }
}

/// Whether a relative symlink at `link` pointing to `target` stays inside the root.
fn symlink_stays_inside(link: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return true;
    }
    let mut depth: i64 = link.components().count() as i64 - 1;
    for c in target.components() {
        match c {
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            Component::Normal(_) => depth += 1,
            _ => {}
        }
    }
    true
}

/// Apply one entry; returns the bytes of content written.
fn apply_entry<R: Read>(
    blob: &LayerBlob,
    root: &Path,
    raw: &Path,
    rel: &Path,
    entry: &mut tar::Entry<'_, R>,
    written: &mut HashSet<PathBuf>,
    times: &mut DirTimes,
) -> Result<u64> {
    use tar::EntryType as T;
    if rel.as_os_str().is_empty() {
        return Ok(0); // the root itself: its owner and mode are the sandbox's to set
    }
    check_parents(blob, root, raw, rel, times)?;
    let name = rel.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let parent = rel.parent().unwrap_or(Path::new(""));
    if name == OPAQUE {
        // Hide everything the layers below put in this directory; keep this layer's own.
        let dir = root.join(parent);
        let rd = fs::read_dir(&dir).map_err(SandboxError::io("list", &dir))?;
        for e in rd {
            let e = e.map_err(SandboxError::io("list", &dir))?;
            if !written.contains(&parent.join(e.file_name())) {
                remove_any(&e.path())?;
            }
        }
        return Ok(0);
    }
    if let Some(hidden) = name.strip_prefix(WHITEOUT) {
        if hidden.is_empty() || hidden == "." || hidden == ".." || hidden.contains('/') {
            return Err(refuse(blob, raw, "is a malformed whiteout"));
        }
        remove_any(&root.join(parent).join(hidden))?;
        return Ok(0);
    }
    let dst = root.join(rel);
    let kind = entry.header().entry_type();
    let existing = fs::symlink_metadata(&dst).ok();
    let mut content = 0;
    match kind {
        T::Directory => {
            if existing.as_ref().is_some_and(|m| !m.is_dir()) {
                remove_any(&dst)?;
            }
            if existing.as_ref().is_none_or(|m| !m.is_dir()) {
                fs::create_dir(&dst).map_err(SandboxError::io("mkdir", &dst))?;
            }
        }
        T::Regular | T::Continuous | T::GNUSparse => {
            remove_any(&dst)?;
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o600)
                .open(&dst)
                .map_err(SandboxError::io("create", &dst))?;
            content = io::copy(entry, &mut f).map_err(|e| {
                SandboxError::Invalid(format!(
                    "layer {}: reading {}: {e}",
                    blob.digest,
                    raw.display()
                ))
            })?;
        }
        T::Symlink => {
            let target = entry
                .link_name()
                .map_err(|e| refuse(blob, raw, format!("has an unreadable link name: {e}")))?
                .ok_or_else(|| refuse(blob, raw, "is a symlink without a target"))?
                .into_owned();
            if !symlink_stays_inside(rel, &target) {
                return Err(refuse(
                    blob,
                    raw,
                    format!("is a symlink to {} which leaves the root", target.display()),
                ));
            }
            remove_any(&dst)?;
            std::os::unix::fs::symlink(&target, &dst).map_err(SandboxError::io("symlink", &dst))?;
        }
        T::Link => {
            let target = entry
                .link_name()
                .map_err(|e| refuse(blob, raw, format!("has an unreadable link name: {e}")))?
                .ok_or_else(|| refuse(blob, raw, "is a hard link without a target"))?
                .into_owned();
            let trel = normalize(&target, 4096).map_err(|_| {
                refuse(
                    blob,
                    raw,
                    format!("is a hard link to {} outside the root", target.display()),
                )
            })?;
            check_parents(blob, root, raw, &trel, times)?;
            let src = root.join(&trel);
            match fs::symlink_metadata(&src) {
                Ok(m) if m.is_dir() => {
                    return Err(refuse(
                        blob,
                        raw,
                        format!("is a hard link to the directory {}", trel.display()),
                    ))
                }
                Ok(_) => {}
                Err(_) => {
                    return Err(refuse(
                        blob,
                        raw,
                        format!("is a hard link to {}, which does not exist", trel.display()),
                    ))
                }
            }
            if src != dst {
                remove_any(&dst)?;
                fs::hard_link(&src, &dst).map_err(SandboxError::io("link", &dst))?;
            }
            written.insert(rel.to_path_buf());
            return Ok(0); // the link shares the target's inode and metadata
        }
        T::Char | T::Block | T::Fifo => {
            remove_any(&dst)?;
            let mode = entry.header().mode().unwrap_or(0o600) & 0o7777;
            let (fmt, dev) = match kind {
                T::Char | T::Block => {
                    let major = entry.header().device_major().ok().flatten().unwrap_or(0);
                    let minor = entry.header().device_minor().ok().flatten().unwrap_or(0);
                    let fmt = if kind == T::Char { libc::S_IFCHR } else { libc::S_IFBLK };
                    (fmt, libc::makedev(major, minor))
                }
                _ => (libc::S_IFIFO, 0),
            };
            let c = std::ffi::CString::new(dst.as_os_str().as_encoded_bytes())
                .map_err(|_| refuse(blob, raw, "has a NUL in its path"))?;
            // SAFETY: `c` is a valid NUL-terminated path; mknod reads nothing else.
            if unsafe { libc::mknod(c.as_ptr(), fmt | mode, dev) } != 0 {
                return Err(SandboxError::io("mknod", &dst)(io::Error::last_os_error()));
            }
        }
        T::XGlobalHeader => return Ok(0),
        other => {
            return Err(refuse(blob, raw, format!("has an unsupported entry type {other:?}")));
        }
    }
    set_metadata(blob, raw, &dst, entry, kind)?;
    written.insert(rel.to_path_buf());
    Ok(content)
}

/// Owner, mode (set-id bits included), mtime and extended attributes of a written entry, none
/// of them followed through a symlink.
fn set_metadata<R: Read>(
    blob: &LayerBlob,
    raw: &Path,
    dst: &Path,
    entry: &mut tar::Entry<'_, R>,
    kind: tar::EntryType,
) -> Result<()> {
    let h = entry.header();
    let uid = h.uid().map_err(|e| refuse(blob, raw, format!("has a bad uid: {e}")))?;
    let gid = h.gid().map_err(|e| refuse(blob, raw, format!("has a bad gid: {e}")))?;
    let (uid, gid) = (u32::try_from(uid), u32::try_from(gid));
    let (Ok(uid), Ok(gid)) = (uid, gid) else {
        return Err(refuse(blob, raw, "has an owner id above 2³²"));
    };
    let mode = h.mode().map_err(|e| refuse(blob, raw, format!("has a bad mode: {e}")))? & 0o7777;
    let mtime = h.mtime().unwrap_or(0);
    std::os::unix::fs::lchown(dst, Some(uid), Some(gid))
        .map_err(SandboxError::io("lchown", dst))?;
    if kind != tar::EntryType::Symlink {
        // After the chown, which clears set-id bits.
        fs::set_permissions(dst, fs::Permissions::from_mode(mode))
            .map_err(SandboxError::io("chmod", dst))?;
    }
    if let Ok(Some(exts)) = entry.pax_extensions() {
        for ext in exts.flatten() {
            let Ok(key) = ext.key() else { continue };
            if let Some(attr) = key.strip_prefix("SCHILY.xattr.") {
                // Only the namespaces a sandbox's files carry; `trusted.*` and the like would
                // be the host's to interpret.
                if attr.starts_with("user.") || attr.starts_with("security.capability") {
                    xattr::set(dst, attr, ext.value_bytes())
                        .map_err(SandboxError::io("setxattr", dst))?;
                }
            }
        }
    }
    let ts = libc::timespec { tv_sec: mtime as libc::time_t, tv_nsec: 0 };
    let times = [ts, ts];
    let c = std::ffi::CString::new(dst.as_os_str().as_encoded_bytes())
        .map_err(|_| refuse(blob, raw, "has a NUL in its path"))?;
    // SAFETY: `c` is a valid path and `times` two timespecs, both live for the call.
    unsafe {
        libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW)
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn chain_ids_follow_the_oci_rule() {
        let a = format!("sha256:{}", "a".repeat(64));
        let b = format!("sha256:{}", "b".repeat(64));
        let c = chain_ids(&[a.clone(), b.clone()]);
        assert_eq!(c[0], a);
        let want = format!("sha256:{}", hex(&Sha256::digest(format!("{a} {b}").as_bytes())));
        assert_eq!(c[1], want);
    }

    #[test]
    fn entry_paths_are_normalized_or_refused() {
        assert_eq!(normalize(Path::new("./etc/passwd"), 100).unwrap(), PathBuf::from("etc/passwd"));
        assert!(normalize(Path::new("/etc"), 100).is_err());
        assert!(normalize(Path::new("a/../../b"), 100).is_err());
        assert!(normalize(Path::new(&"a".repeat(200)), 100).is_err());
    }

    /// A layer blob (plain tar) of `entries`: (path, dir?, mtime), owned by the caller.
    fn blob(dir: &Path, n: &str, entries: &[(&str, bool, u64)]) -> LayerBlob {
        let mut b = tar::Builder::new(Vec::new());
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        for (path, is_dir, mtime) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(if *is_dir {
                tar::EntryType::Directory
            } else {
                tar::EntryType::Regular
            });
            h.set_mode(0o755);
            h.set_uid(uid.into());
            h.set_gid(gid.into());
            h.set_mtime(*mtime);
            h.set_size(0);
            b.append_data(&mut h, path, io::empty()).unwrap();
        }
        let bytes = b.into_inner().unwrap();
        let path = dir.join(n);
        fs::write(&path, &bytes).unwrap();
        let d = format!("sha256:{}", hex(&Sha256::digest(&bytes)));
        LayerBlob { digest: d.clone(), diff_id: d, media_type: String::new(), path }
    }

    fn mtime(p: &Path) -> i64 {
        fs::symlink_metadata(p).unwrap().mtime()
    }

    #[test]
    fn directory_times_do_not_depend_on_when_a_layer_is_applied() {
        let t = std::env::temp_dir().join(format!("crab-layer-times-{}", std::process::id()));
        let _ = fs::remove_dir_all(&t);
        fs::create_dir_all(&t).unwrap();
        let lower =
            blob(&t, "l1", &[("a", true, 1000), ("a/f", false, 2000), ("b/c/g", false, 3000)]);
        let upper =
            blob(&t, "l2", &[("a/h", false, 4000), ("a/.wh.f", false, 0), ("b/c/i", false, 5000)]);
        let lim = LayerLimits::default();
        let mut roots = Vec::new();
        for k in 0..2 {
            let r = t.join(format!("root{k}"));
            fs::create_dir(&r).unwrap();
            unpack_layer(&lower, &r, true, lim, &crab_common::NoProgress).unwrap();
            assert_eq!((mtime(&r), mtime(&r.join("a")), mtime(&r.join("b/c"))), (0, 1000, 0));
            assert_eq!(mtime(&r.join("b")), 0);
            std::thread::sleep(std::time::Duration::from_millis(1100));
            unpack_layer(&upper, &r, false, lim, &crab_common::NoProgress).unwrap();
            assert!(!r.join("a/f").exists() && r.join("a/h").exists());
            // Changed by the upper layer, which does not declare them: the lower's times.
            assert_eq!((mtime(&r), mtime(&r.join("a")), mtime(&r.join("b/c"))), (0, 1000, 0));
            roots.push(r);
        }
        let _ = fs::remove_dir_all(&t);
    }

    #[test]
    fn format_1_records_load_without_a_blob() {
        let a = format!("sha256:{}", "a".repeat(64));
        let v = format!(
            r#"{{"format":1,"chain_id":"{a}","diff_id":"{a}","parent":null,"diff_bytes":1,"created_at":2}}"#
        );
        let r: LayerRecord = serde_json::from_str(&v).unwrap();
        assert!(r.blob.is_none());
        assert!(!serde_json::to_string(&r).unwrap().contains("blob"));
        let with = LayerRecord {
            format: LAYER_RECORD_FORMAT,
            blob: Some(BlobRef {
                digest: a.clone(),
                media_type: "application/vnd.oci.image.layer.v1.tar+gzip".into(),
                size: 3,
                diff_id: a.clone(),
            }),
            ..r
        };
        let back: LayerRecord =
            serde_json::from_str(&serde_json::to_string(&with).unwrap()).unwrap();
        assert_eq!(back.blob, with.blob);
    }

    #[test]
    fn digests_are_checked() {
        assert!(sha256_hex(&format!("sha256:{}", "0".repeat(64))).is_ok());
        assert!(sha256_hex("sha256:../../x").is_err());
        assert!(sha256_hex(&format!("sha512:{}", "0".repeat(64))).is_err());
    }
}
