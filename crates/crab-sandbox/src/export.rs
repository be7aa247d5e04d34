//! Layer tars made from trees, for `crab image push`: the difference between a tree and the
//! tree below it (or a whole tree) as an OCI layer — a tar, gzip-compressed — written to a
//! file while its diff id (SHA-256 of the tar) and digest (SHA-256 of the gzip) are computed.
//!
//! The differ is the naive one of containers/storage: both trees are walked (sorted, without
//! following symlinks) and an entry is in the layer when it is new or differs in type, mode
//! (set-id bits included), owner, size (not for directories), mtime, device number, symlink
//! target or extended attributes (`user.*`, `security.capability`: the namespaces a layer
//! carries). Every directory above a changed entry is in the layer too (so its owner and mode
//! are kept), and an entry gone from the tree becomes an OCI whiteout `.wh.NAME`. Names of one
//! inode within the layer are hard links to its first name; owners are numeric; device nodes
//! and FIFOs are kept, sockets skipped. Bounded: entries, tar bytes and path lengths as
//! [`LayerLimits`] says. File contents are compared by size and mtime, not by bytes (as
//! containers/storage does): a file rewritten with the same size within the same nanosecond
//! would be missed, which no snapshot-based step produces.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, Metadata};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Result, SandboxError};
use crate::layers::{hex, LayerLimits};

/// The media type of a generated layer.
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// What [`write_layer`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// `sha256:` of the uncompressed tar.
    pub diff_id: String,
    /// `sha256:` of the gzip stream (the blob).
    pub digest: String,
    /// Bytes of the blob.
    pub size: u64,
    /// Entries in the tar (whiteouts included; 0: the trees do not differ).
    pub entries: u64,
}

/// Write the layer that turns `old` (`None`: an empty tree) into `new`, gzip-compressed, to
/// `out` (created, replaced if there). Top-level names in `exclude` (Crab's `.crab`) are left
/// out of both trees. The file is synced before this returns.
pub fn write_layer(
    new: &Path,
    old: Option<&Path>,
    exclude: &[&str],
    out: &Path,
    limits: LayerLimits,
) -> Result<Generated> {
    let f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(out)
        .map_err(SandboxError::io("create", out))?;
    let blob = Hashing::new(BufWriter::with_capacity(1 << 20, f), u64::MAX);
    let gz = flate2::write::GzEncoder::new(blob, flate2::Compression::default());
    let tar_out = Hashing::new(gz, limits.max_bytes);
    let mut d = Differ {
        new: new.to_path_buf(),
        old: old.map(Path::to_path_buf),
        exclude: exclude.iter().map(|s| s.to_string()).collect(),
        tar: tar::Builder::new(tar_out),
        emitted_dirs: HashSet::new(),
        links: HashMap::new(),
        entries: 0,
        limits,
    };
    let root_old = d.old.as_ref().is_some_and(|o| o.is_dir());
    d.dir(Path::new(""), root_old)?;
    let entries = d.entries;
    let tar_out = d.tar.into_inner().map_err(SandboxError::io("write", out))?;
    let diff_id = format!("sha256:{}", hex(&tar_out.hash.clone().finalize()));
    let blob = tar_out.inner.finish().map_err(SandboxError::io("write", out))?;
    let (digest, size) = (format!("sha256:{}", hex(&blob.hash.clone().finalize())), blob.n);
    let f = blob.inner.into_inner().map_err(|e| SandboxError::io("write", out)(e.into_error()))?;
    f.sync_all().map_err(SandboxError::io("fsync", out))?;
    Ok(Generated { diff_id, digest, size, entries })
}

/// A writer that hashes and counts what passes through it, refusing past a byte limit.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    n: u64,
    max: u64,
}

impl<W> Hashing<W> {
    fn new(inner: W, max: u64) -> Self {
        Hashing { inner, hash: Sha256::new(), n: 0, max }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.hash.update(&buf[..k]);
        self.n += k as u64;
        if self.n > self.max {
            return Err(io::Error::other(format!(
                "the layer's tar is larger than the limit of {} bytes",
                self.max
            )));
        }
        Ok(k)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

type TarOut = Hashing<flate2::write::GzEncoder<Hashing<BufWriter<File>>>>;

struct Differ {
    new: PathBuf,
    old: Option<PathBuf>,
    exclude: Vec<String>,
    tar: tar::Builder<TarOut>,
    emitted_dirs: HashSet<PathBuf>,
    /// (dev, ino) of a multiply-linked file → the first name written in this layer.
    links: HashMap<(u64, u64), PathBuf>,
    entries: u64,
    limits: LayerLimits,
}

/// The xattrs a layer carries, sorted.
fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(names) = xattr::list(p) else { return out };
    for n in names {
        let n = n.to_string_lossy().into_owned();
        if n.starts_with("user.") || n == "security.capability" {
            if let Ok(Some(v)) = xattr::get(p, &n) {
                out.push((n, v));
            }
        }
    }
    out.sort();
    out
}

fn lstat(p: &Path) -> Result<Option<Metadata>> {
    match fs::symlink_metadata(p) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(SandboxError::io("stat", p)(e)),
    }
}

/// Sorted names in a directory.
fn names(dir: &Path) -> Result<Vec<std::ffi::OsString>> {
    let mut v = Vec::new();
    for e in fs::read_dir(dir).map_err(SandboxError::io("list", dir))? {
        v.push(e.map_err(SandboxError::io("list", dir))?.file_name());
    }
    v.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(v)
}

/// Whether the entry changed between `o` and `n` (both lstat'ed at `op`/`np`).
fn differs(np: &Path, n: &Metadata, op: &Path, o: &Metadata) -> bool {
    if n.mode() != o.mode()
        || n.uid() != o.uid()
        || n.gid() != o.gid()
        || n.rdev() != o.rdev()
        || n.mtime() != o.mtime()
        || n.mtime_nsec() != o.mtime_nsec()
        || (!n.is_dir() && n.size() != o.size())
    {
        return true;
    }
    if n.file_type().is_symlink() && fs::read_link(np).ok() != fs::read_link(op).ok() {
        return true;
    }
    xattrs(np) != xattrs(op)
}

/// One PAX record: `LEN KEY=VALUE\n`, LEN counting itself.
fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let body = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key.as_bytes());
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

impl Differ {
    fn count(&mut self, rel: &Path) -> Result<()> {
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(SandboxError::Invalid(format!(
                "the layer would have more than {} entries (at {})",
                self.limits.max_entries,
                rel.display()
            )));
        }
        if rel.as_os_str().len() > self.limits.max_path {
            return Err(SandboxError::Invalid(format!(
                "{} has a path longer than {} bytes",
                rel.display(),
                self.limits.max_path
            )));
        }
        Ok(())
    }

    fn werr(&self, rel: &Path) -> impl FnOnce(io::Error) -> SandboxError {
        let p = self.new.join(rel);
        move |e| SandboxError::Invalid(format!("writing the layer entry {}: {e}", p.display()))
    }

    /// Compare directory `rel` of the new tree with the old tree's (`old_dir`: the old tree
    /// has a directory there).
    fn dir(&mut self, rel: &Path, old_dir: bool) -> Result<()> {
        let ndir = self.new.join(rel);
        let new_names = names(&ndir)?;
        let top = rel.as_os_str().is_empty();
        let excluded: Vec<Vec<u8>> = if top {
            self.exclude.iter().map(|x| x.as_bytes().to_vec()).collect()
        } else {
            Vec::new()
        };
        let skip = |n: &std::ffi::OsStr| excluded.iter().any(|x| x.as_slice() == n.as_bytes());
        if old_dir {
            if let Some(old) = self.old.clone() {
                let odir = old.join(rel);
                let have: HashSet<&[u8]> = new_names.iter().map(|n| n.as_bytes()).collect();
                let gone: Vec<_> = names(&odir)?
                    .into_iter()
                    .filter(|n| !have.contains(n.as_bytes()) && !skip(n))
                    .collect();
                for n in gone {
                    self.whiteout(rel, &n)?;
                }
            }
        }
        for n in new_names {
            if skip(&n) {
                continue;
            }
            let crel = rel.join(&n);
            let np = self.new.join(&crel);
            let Some(nm) = lstat(&np)? else { continue };
            let om = match (&self.old, old_dir) {
                (Some(o), true) => {
                    let op = o.join(&crel);
                    lstat(&op)?.map(|m| (op, m))
                }
                _ => None,
            };
            let changed = match &om {
                None => true,
                Some((op, om)) => differs(&np, &nm, op, om),
            };
            if nm.is_dir() {
                if changed {
                    self.parents(rel)?;
                    self.emit(&crel, &nm)?;
                    self.emitted_dirs.insert(crel.clone());
                }
                let below = om.as_ref().is_some_and(|(_, m)| m.is_dir());
                self.dir(&crel, below)?;
            } else if changed {
                if nm.file_type().is_socket() {
                    continue;
                }
                self.parents(rel)?;
                self.emit(&crel, &nm)?;
            }
        }
        Ok(())
    }

    /// Write every directory from the top down to `rel` not yet in the layer.
    fn parents(&mut self, rel: &Path) -> Result<()> {
        let mut at = PathBuf::new();
        for c in rel.components() {
            at.push(c);
            if self.emitted_dirs.contains(&at) {
                continue;
            }
            let p = self.new.join(&at);
            let m = lstat(&p)?.ok_or_else(|| {
                SandboxError::Invalid(format!("{} vanished while the layer was made", p.display()))
            })?;
            self.emit(&at, &m)?;
            self.emitted_dirs.insert(at.clone());
        }
        Ok(())
    }

    fn whiteout(&mut self, rel: &Path, name: &std::ffi::OsStr) -> Result<()> {
        self.parents(rel)?;
        let mut wh = std::ffi::OsString::from(".wh.");
        wh.push(name);
        let p = rel.join(wh);
        self.count(&p)?;
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(0);
        h.set_mtime(0);
        let e = self.werr(&p);
        self.tar.append_data(&mut h, &p, io::empty()).map_err(e)
    }

    /// Write one entry of the new tree.
    fn emit(&mut self, rel: &Path, m: &Metadata) -> Result<()> {
        use tar::EntryType as T;
        self.count(rel)?;
        let p = self.new.join(rel);
        let ft = m.file_type();
        let mut h = tar::Header::new_gnu();
        h.set_mode(m.mode() & 0o7777);
        h.set_uid(u64::from(m.uid()));
        h.set_gid(u64::from(m.gid()));
        h.set_mtime(u64::try_from(m.mtime()).unwrap_or(0));
        h.set_size(0);
        // Names of one inode after the first are links to it (they share its metadata).
        if !ft.is_dir() && m.nlink() > 1 {
            let key = (m.dev(), m.ino());
            if let Some(first) = self.links.get(&key).cloned() {
                h.set_entry_type(T::Link);
                let e = self.werr(rel);
                return self.tar.append_link(&mut h, rel, &first).map_err(e);
            }
            self.links.insert(key, rel.to_path_buf());
        }
        let xa = if ft.is_symlink() { Vec::new() } else { xattrs(&p) };
        if !xa.is_empty() {
            let mut body = Vec::new();
            for (k, v) in &xa {
                pax_record(&mut body, &format!("SCHILY.xattr.{k}"), v);
            }
            let mut x = tar::Header::new_ustar();
            x.set_entry_type(T::XHeader);
            x.set_mode(0o644);
            x.set_size(body.len() as u64);
            let name = format!(
                "PaxHeaders.0/{}",
                rel.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
            );
            let name: String = name.chars().take(99).collect();
            x.set_path(&name).map_err(self.werr(rel))?;
            x.set_cksum();
            let e = self.werr(rel);
            self.tar.append(&x, body.as_slice()).map_err(e)?;
        }
        let e = self.werr(rel);
        if ft.is_dir() {
            h.set_entry_type(T::Directory);
            self.tar.append_data(&mut h, rel, io::empty()).map_err(e)
        } else if ft.is_file() {
            h.set_entry_type(T::Regular);
            h.set_size(m.size());
            let f = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&p)
                .map_err(SandboxError::io("open", &p))?;
            let meta = f.metadata().map_err(SandboxError::io("stat", &p))?;
            if meta.len() != m.size() || meta.ino() != m.ino() {
                return Err(SandboxError::Invalid(format!(
                    "{} changed while the layer was made",
                    p.display()
                )));
            }
            self.tar.append_data(&mut h, rel, f.take(m.size())).map_err(e)
        } else if ft.is_symlink() {
            h.set_entry_type(T::Symlink);
            let target = fs::read_link(&p).map_err(SandboxError::io("readlink", &p))?;
            self.tar.append_link(&mut h, rel, &target).map_err(e)
        } else if ft.is_char_device() || ft.is_block_device() {
            h.set_entry_type(if ft.is_char_device() { T::Char } else { T::Block });
            let dev = m.rdev();
            h.set_device_major(libc::major(dev)).map_err(self.werr(rel))?;
            h.set_device_minor(libc::minor(dev)).map_err(self.werr(rel))?;
            self.tar.append_data(&mut h, rel, io::empty()).map_err(e)
        } else if ft.is_fifo() {
            h.set_entry_type(T::Fifo);
            self.tar.append_data(&mut h, rel, io::empty()).map_err(e)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn pax_records_count_their_own_length() {
        let mut v = Vec::new();
        pax_record(&mut v, "SCHILY.xattr.user.a", b"b");
        let s = String::from_utf8(v.clone()).unwrap();
        let (len, _) = s.split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), v.len());
        let mut w = Vec::new();
        pax_record(&mut w, "k", &[b'x'; 93]); // 99 or 100 bytes: the length's digits change
        let s = String::from_utf8(w.clone()).unwrap();
        assert_eq!(s.split_once(' ').unwrap().0.parse::<usize>().unwrap(), w.len());
    }

    /// What a tree holds, by path: type, mode, owner, size, mtime, link target, xattrs, bytes.
    fn snapshot(root: &Path) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let mut stack = vec![PathBuf::new()];
        let mut inodes: HashMap<u64, String> = HashMap::new();
        while let Some(rel) = stack.pop() {
            for n in names(&root.join(&rel)).unwrap() {
                let r = rel.join(&n);
                let p = root.join(&r);
                let m = fs::symlink_metadata(&p).unwrap();
                let mut d = format!("{:o} {}:{} {:?}", m.mode(), m.uid(), m.gid(), xattrs(&p));
                if m.is_file() {
                    d += &format!(" {} {:?}", m.mtime(), fs::read(&p).unwrap());
                    if m.nlink() > 1 {
                        let first = inodes.entry(m.ino()).or_insert(r.display().to_string());
                        d += &format!(" inode-of {first}");
                    }
                } else if m.file_type().is_symlink() {
                    d += &format!(" -> {}", fs::read_link(&p).unwrap().display());
                } else if m.is_dir() {
                    stack.push(r.clone());
                }
                out.insert(r.display().to_string(), d);
            }
        }
        out
    }

    fn unpack(gz: &Path, g: &Generated, onto: &Path) {
        let blob = crate::layers::LayerBlob {
            digest: g.digest.clone(),
            diff_id: g.diff_id.clone(),
            media_type: LAYER_MEDIA_TYPE.into(),
            path: gz.to_path_buf(),
        };
        crate::layers::unpack_layer(
            &blob,
            onto,
            false,
            LayerLimits::default(),
            &crab_common::NoProgress,
        )
        .unwrap();
    }

    #[test]
    fn a_diff_applied_to_the_old_tree_gives_the_new_one() {
        let t = tempfile::tempdir().unwrap();
        let (old, new, out) = (t.path().join("old"), t.path().join("new"), t.path().join("o"));
        for d in [&old, &out] {
            fs::create_dir_all(d.join("etc/sub")).unwrap();
            fs::write(d.join("etc/keep"), "same").unwrap();
            fs::write(d.join("etc/gone"), "bye").unwrap();
            fs::write(d.join("etc/sub/gone-too"), "bye").unwrap();
            fs::write(d.join("etc/changed"), "v1").unwrap();
            fs::create_dir_all(d.join("dir-to-file")).unwrap();
            fs::write(d.join("dir-to-file/x"), "x").unwrap();
            std::os::unix::fs::symlink("keep", d.join("etc/link")).unwrap();
        }
        // The old tree's times, so the unchanged entries compare equal.
        let cp = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", old.display()))
            .arg(&new)
            .status();
        assert!(cp.unwrap().success());
        let cp = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", old.display()))
            .arg(&out)
            .status();
        assert!(cp.unwrap().success());
        fs::remove_file(new.join("etc/gone")).unwrap();
        fs::remove_dir_all(new.join("etc/sub")).unwrap();
        fs::write(new.join("etc/changed"), "version 2").unwrap();
        fs::remove_dir_all(new.join("dir-to-file")).unwrap();
        fs::write(new.join("dir-to-file"), "now a file").unwrap();
        fs::remove_file(new.join("etc/link")).unwrap();
        std::os::unix::fs::symlink("changed", new.join("etc/link")).unwrap();
        fs::create_dir_all(new.join("app/deep")).unwrap();
        fs::write(new.join("app/deep/hl1"), "linked").unwrap();
        fs::hard_link(new.join("app/deep/hl1"), new.join("app/hl2")).unwrap();
        fs::write(new.join("app/suid"), "s").unwrap();
        fs::set_permissions(new.join("app/suid"), fs::Permissions::from_mode(0o4755)).unwrap();
        fs::write(new.join("app/x"), "x").unwrap();
        xattr::set(new.join("app/x"), "user.crab", b"value").unwrap();
        fs::create_dir_all(new.join(".crab")).unwrap();
        fs::write(new.join(".crab/init"), "init").unwrap();
        let root = nix::unistd::geteuid().is_root();
        if root {
            std::os::unix::fs::lchown(new.join("app/deep"), Some(1000), Some(1001)).unwrap();
            std::os::unix::fs::lchown(new.join("app/deep/hl1"), Some(1000), Some(1000)).unwrap();
            fs::set_permissions(new.join("app/suid"), fs::Permissions::from_mode(0o4755)).unwrap();
        }
        let gz = t.path().join("layer.tar.gz");
        let g = write_layer(&new, Some(&old), &[".crab"], &gz, LayerLimits::default()).unwrap();
        assert!(g.entries > 0);
        assert_eq!(g.size, fs::metadata(&gz).unwrap().len());
        // The same trees give the same bytes.
        let gz2 = t.path().join("layer2.tar.gz");
        let g2 = write_layer(&new, Some(&old), &[".crab"], &gz2, LayerLimits::default()).unwrap();
        assert_eq!(g, g2);
        unpack(&gz, &g, &out);
        let mut want = snapshot(&new);
        want.retain(|k, _| !k.starts_with(".crab"));
        assert_eq!(snapshot(&out), want);
        // Whiteouts, not copies, for what went away; unchanged files are not in the layer.
        let mut names = Vec::new();
        let f = flate2::read::GzDecoder::new(File::open(&gz).unwrap());
        for e in tar::Archive::new(f).entries().unwrap() {
            names.push(e.unwrap().path().unwrap().display().to_string());
        }
        assert!(names.contains(&"etc/.wh.gone".to_string()), "{names:?}");
        assert!(names.contains(&"etc/.wh.sub".to_string()), "{names:?}");
        assert!(!names.iter().any(|n| n == "etc/keep" || n.starts_with(".crab")), "{names:?}");
        // No difference: no entries.
        let g3 = write_layer(&new, Some(&new), &[], &t.path().join("e"), LayerLimits::default())
            .unwrap();
        assert_eq!(g3.entries, 0);
        // A whole tree.
        let whole = t.path().join("whole");
        fs::create_dir_all(&whole).unwrap();
        let g4 = write_layer(&new, None, &[".crab"], &gz, LayerLimits::default()).unwrap();
        unpack(&gz, &g4, &whole);
        assert_eq!(snapshot(&whole), want);
    }
}
