//! OCI image fixtures made without Crab: a tiny root filesystem (a shell and a few coreutils
//! with their libraries, copied from the host) and an OCI image layout writer whose layers are
//! tars built entry by entry — including entries no honest tool writes (absolute names, `..`,
//! links out, writes through symlinks), for the hostile-layer tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// `sha256:<hex>` of bytes.
pub fn digest(b: &[u8]) -> String {
    let h = Sha256::digest(b);
    format!("sha256:{}", h.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

/// OCI chain ids of diff ids (bottom first).
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for d in diff_ids {
        let id = match out.last() {
            None => d.clone(),
            Some(p) => digest(format!("{p} {d}").as_bytes()),
        };
        out.push(id);
    }
    out
}

/// The host programs a tiny root holds (resolved from the host's `PATH`).
pub const TINY_PROGRAMS: &[&str] = &["sh", "cat", "ls", "stat", "id", "mkdir", "rm", "ln"];

/// Make a tiny merged-usr root filesystem at `dst`: `TINY_PROGRAMS` with their shared
/// libraries, `/etc/passwd` (root, `app` 1000) and `/etc/group`.
pub fn tiny_root(dst: &Path) {
    for d in ["usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "root", "home/app"] {
        fs::create_dir_all(dst.join(d)).unwrap();
    }
    for (l, t) in
        [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/bin")]
    {
        let _ = std::os::unix::fs::symlink(t, dst.join(l));
    }
    let mut libs: Vec<PathBuf> = Vec::new();
    for p in TINY_PROGRAMS {
        let src = which(p);
        fs::copy(&src, dst.join("usr/bin").join(p)).unwrap();
        let out = Command::new("ldd").arg(&src).output().unwrap();
        for tok in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if tok.starts_with('/') && !libs.iter().any(|l| l == Path::new(tok)) {
                libs.push(PathBuf::from(tok));
            }
        }
    }
    for l in libs {
        // Keep the library's directory under usr/ (the host's /lib* may be symlinks too).
        let rel = l.strip_prefix("/").unwrap();
        let rel =
            if rel.starts_with("usr") { rel.to_path_buf() } else { Path::new("usr").join(rel) };
        let to = dst.join(rel);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(&l, &to).unwrap();
    }
    fs::write(
        dst.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
    )
    .unwrap();
    fs::write(dst.join("etc/group"), "root:x:0:\napp:x:1000:\nextra:x:2000:app\n").unwrap();
    std::os::unix::fs::chown(dst.join("home/app"), Some(1000), Some(1000)).unwrap();
}

fn which(p: &str) -> PathBuf {
    for d in ["/usr/bin", "/bin", "/usr/sbin"] {
        let c = Path::new(d).join(p);
        if c.exists() {
            return fs::canonicalize(c).unwrap();
        }
    }
    panic!("{p} not found on the host");
}

/// A layer written into a layout.
#[derive(Debug, Clone)]
pub struct LayerDesc {
    /// Blob digest.
    pub digest: String,
    /// Digest of the uncompressed tar.
    pub diff_id: String,
    /// Blob size.
    pub size: u64,
    /// Media type.
    pub media_type: String,
}

/// One tar entry of a hand-built layer.
#[derive(Debug, Clone)]
pub enum Entry {
    /// A directory.
    Dir(&'static str),
    /// A regular file with contents, mode, owner.
    File(String, Vec<u8>, u32, u32),
    /// A symlink `name → target`.
    Symlink(String, String),
    /// A hard link `name → target`.
    Link(String, String),
    /// A file carrying a `user.*` xattr (PAX `SCHILY.xattr.`).
    XattrFile(String, Vec<u8>, String, Vec<u8>),
}

/// A tar of `entries`, names written verbatim (no sanitizing: hostile names stay hostile).
pub fn tar_of(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_ustar();
        let (name, data, kind, mode, uid, link): (
            String,
            Vec<u8>,
            tar::EntryType,
            u32,
            u32,
            Option<String>,
        ) = match e {
            Entry::Dir(n) => (n.to_string(), vec![], tar::EntryType::Directory, 0o755, 0, None),
            Entry::File(n, d, m, u) => {
                (n.clone(), d.clone(), tar::EntryType::Regular, *m, *u, None)
            }
            Entry::Symlink(n, t) => {
                (n.clone(), vec![], tar::EntryType::Symlink, 0o777, 0, Some(t.clone()))
            }
            Entry::Link(n, t) => {
                (n.clone(), vec![], tar::EntryType::Link, 0o644, 0, Some(t.clone()))
            }
            Entry::XattrFile(n, d, k, v) => {
                let key = format!("SCHILY.xattr.{k}");
                b.append_pax_extensions([(key.as_str(), v.as_slice())]).unwrap();
                (n.clone(), d.clone(), tar::EntryType::Regular, 0o644, 0, None)
            }
        };
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid as u64);
        h.set_gid(uid as u64);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        {
            let raw = h.as_ustar_mut().unwrap();
            raw.name = [0; 100];
            raw.name[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(l) = &link {
                raw.linkname = [0; 100];
                raw.linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
        }
        h.set_cksum();
        b.append(&h, data.as_slice()).unwrap();
    }
    b.into_inner().unwrap()
}

/// A tar of a directory tree (symlinks kept as links, owners and modes kept).
pub fn tar_of_dir(root: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    b.append_dir_all(".", root).unwrap();
    b.into_inner().unwrap()
}

/// An OCI image layout being written at `dir`.
#[derive(Debug)]
pub struct Layout {
    /// Its directory.
    pub dir: PathBuf,
}

impl Layout {
    /// Start a layout at `dir` (created).
    pub fn new(dir: &Path) -> Self {
        fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout { dir: dir.to_path_buf() }
    }

    /// Store a blob; returns its digest.
    pub fn blob(&self, bytes: &[u8]) -> String {
        let d = digest(bytes);
        fs::write(self.dir.join("blobs/sha256").join(&d[7..]), bytes).unwrap();
        d
    }

    /// Store a layer tar (gzip-compressed when `gzip`).
    pub fn layer(&self, tar: &[u8], gzip: bool) -> LayerDesc {
        let diff_id = digest(tar);
        let (bytes, media_type) = if gzip {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(tar).unwrap();
            (e.finish().unwrap(), "application/vnd.oci.image.layer.v1.tar+gzip")
        } else {
            (tar.to_vec(), "application/vnd.oci.image.layer.v1.tar")
        };
        LayerDesc {
            digest: self.blob(&bytes),
            diff_id,
            size: bytes.len() as u64,
            media_type: media_type.into(),
        }
    }

    /// Store a config + manifest for `layers` (`config` is the config's `config` object);
    /// returns the manifest's descriptor (with a platform for `arch`).
    pub fn image(&self, layers: &[LayerDesc], config: Value, arch: &str) -> Value {
        let cfg = json!({
            "architecture": arch, "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>()},
        });
        let cfg_bytes = serde_json::to_vec(&cfg).unwrap();
        let cfg_digest = self.blob(&cfg_bytes);
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg_bytes.len()},
            "layers": layers.iter().map(|l| json!({"mediaType": l.media_type, "digest": l.digest, "size": l.size})).collect::<Vec<_>>(),
        });
        let m = serde_json::to_vec(&manifest).unwrap();
        json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": self.blob(&m), "size": m.len(),
            "platform": {"architecture": arch, "os": "linux"},
        })
    }

    /// Write `index.json` listing `manifests`.
    pub fn index(&self, manifests: &[Value]) {
        let i = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests});
        fs::write(self.dir.join("index.json"), serde_json::to_vec(&i).unwrap()).unwrap();
    }
}
