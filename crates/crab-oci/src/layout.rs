//! Images on disk: an OCI image layout (directory or tar) and a `docker save` archive.
//!
//! [`read`] tells them apart from a plain root filesystem (which it leaves to the caller by
//! answering `None`): a layout has `oci-layout` and `index.json` at its top, a `docker save`
//! archive a `manifest.json` array. A tar is unpacked into a scratch directory the caller owns
//! first — regular files and directories only, names checked, symlinks (older `docker save`
//! archives link duplicate layers) resolved inside the archive into hard links. Every blob is
//! checked against its digest; the layers' diff ids are checked later, as they are applied.

use std::fs::{self, File};
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use oci_spec::image::{Descriptor, ImageIndex, ImageManifest};

use crate::blobs::{self, read_bounded, verify_bytes, verify_file, MAX_JSON};
use crate::config::{self, Document};
use crate::error::{OciError, Result};
use crate::{Image, Layer, Platform};

/// What kind of image source a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An OCI image layout.
    OciLayout,
    /// A `docker save` archive.
    DockerSave,
}

/// Most entries an image archive may have.
const MAX_ARCHIVE_ENTRIES: u64 = 1 << 20;

/// Read the image at `path` (a layout or `docker save` directory or tar), or `None` when it
/// is neither (a root filesystem). A tar is unpacked under `scratch` (made here, removed by
/// the caller once the image is installed).
pub fn read(path: &Path, platform: &Platform, scratch: &Path) -> Result<Option<Image>> {
    let meta = fs::metadata(path).map_err(OciError::io("stat", path))?;
    let dir = if meta.is_dir() {
        path.to_path_buf()
    } else {
        if sniff_tar(path)?.is_none() {
            return Ok(None);
        }
        unpack(path, scratch)?;
        scratch.to_path_buf()
    };
    match kind_of_dir(&dir) {
        Some(Kind::OciLayout) => read_layout(&dir, platform).map(Some),
        Some(Kind::DockerSave) => read_docker_save(&dir).map(Some),
        None => Ok(None),
    }
}

fn kind_of_dir(dir: &Path) -> Option<Kind> {
    if dir.join("oci-layout").is_file() && dir.join("index.json").is_file() {
        return Some(Kind::OciLayout);
    }
    let m = dir.join("manifest.json");
    if m.is_file() {
        let b = read_bounded(&m, MAX_JSON).ok()?;
        if serde_json::from_slice::<serde_json::Value>(&b).ok()?.is_array() {
            return Some(Kind::DockerSave);
        }
    }
    None
}

fn open_maybe_gzip(path: &Path) -> Result<Box<dyn Read>> {
    let mut f = File::open(path).map_err(OciError::io("open", path))?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic).map_err(OciError::io("read", path))?;
    let r = BufReader::new(File::open(path).map_err(OciError::io("open", path))?);
    Ok(if n == 2 && magic == [0x1f, 0x8b] {
        Box::new(flate2::read::GzDecoder::new(r))
    } else {
        Box::new(r)
    })
}

/// The kind of image archive a tar is, from its top-level names (`None`: not one, or not a
/// tar at all).
pub fn sniff_tar(path: &Path) -> Result<Option<Kind>> {
    let mut ar = tar::Archive::new(open_maybe_gzip(path)?);
    let Ok(entries) = ar.entries() else { return Ok(None) };
    let (mut layout, mut index, mut manifest) = (false, false, false);
    for (i, e) in entries.enumerate() {
        let Ok(e) = e else { return Ok(None) };
        let Ok(p) = e.path() else { continue };
        let name: PathBuf = p.components().filter(|c| matches!(c, Component::Normal(_))).collect();
        match name.to_str() {
            Some("oci-layout") => layout = true,
            Some("index.json") => index = true,
            Some("manifest.json") => manifest = true,
            _ => {}
        }
        // A root filesystem shows itself early; an image archive has no such directories.
        if name.components().count() == 1
            && ["etc", "usr", "bin", "lib", "var"].iter().any(|d| name == Path::new(d))
        {
            return Ok(None);
        }
        if i as u64 > MAX_ARCHIVE_ENTRIES {
            break;
        }
    }
    Ok(if layout && index {
        Some(Kind::OciLayout)
    } else if manifest {
        Some(Kind::DockerSave)
    } else {
        None
    })
}

fn safe_rel(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Unpack an image archive into `dst`: regular files and directories with checked names;
/// symlinks resolved inside the archive into hard links, anything else refused.
fn unpack(path: &Path, dst: &Path) -> Result<()> {
    fs::create_dir_all(dst).map_err(OciError::io("create", dst))?;
    let mut ar = tar::Archive::new(open_maybe_gzip(path)?);
    let bad = |e: std::io::Error| {
        OciError::Invalid(format!("{} is not a readable tar archive: {e}", path.display()))
    };
    let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
    for (i, e) in ar.entries().map_err(bad)?.enumerate() {
        if i as u64 >= MAX_ARCHIVE_ENTRIES {
            return Err(OciError::Invalid(format!(
                "{} has more than {MAX_ARCHIVE_ENTRIES} entries, more than an image archive",
                path.display()
            )));
        }
        let mut e = e.map_err(bad)?;
        let raw = e.path().map_err(bad)?.into_owned();
        let Some(rel) = safe_rel(&raw) else {
            if raw.components().all(|c| matches!(c, Component::CurDir)) {
                continue;
            }
            return Err(OciError::Invalid(format!(
                "{}: entry {} has an absolute path or a `..` component",
                path.display(),
                raw.display()
            )));
        };
        let to = dst.join(&rel);
        let kind = e.header().entry_type();
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(OciError::io("create", parent))?;
        }
        if kind.is_dir() {
            fs::create_dir_all(&to).map_err(OciError::io("create", &to))?;
        } else if kind.is_file() {
            let mut f = File::create(&to).map_err(OciError::io("create", &to))?;
            std::io::copy(&mut e, &mut f).map_err(bad)?;
        } else if kind.is_symlink() {
            let target = e.link_name().map_err(bad)?.map(|t| t.into_owned()).unwrap_or_default();
            let base = rel.parent().map(Path::to_path_buf).unwrap_or_default();
            let joined = normalize_within(&base.join(&target)).ok_or_else(|| {
                OciError::Invalid(format!(
                    "{}: entry {} links to {}, outside the archive",
                    path.display(),
                    raw.display(),
                    target.display()
                ))
            })?;
            links.push((rel, joined));
        } else if kind.is_hard_link() || matches!(kind, tar::EntryType::XGlobalHeader) {
            if kind.is_hard_link() {
                let target =
                    e.link_name().map_err(bad)?.map(|t| t.into_owned()).unwrap_or_default();
                let t = safe_rel(&target).ok_or_else(|| {
                    OciError::Invalid(format!(
                        "{}: entry {} is a hard link outside the archive",
                        path.display(),
                        raw.display()
                    ))
                })?;
                links.push((rel, t));
            }
        } else {
            return Err(OciError::Invalid(format!(
                "{}: entry {} is a {kind:?}, which an image archive does not hold",
                path.display(),
                raw.display()
            )));
        }
    }
    for (link, target) in links {
        let from = dst.join(&target);
        let to = dst.join(&link);
        let m = fs::symlink_metadata(&from).map_err(OciError::io("stat", &from))?;
        if !m.is_file() {
            return Err(OciError::Invalid(format!(
                "{}: {} links to {}, which is not a file in the archive",
                path.display(),
                link.display(),
                target.display()
            )));
        }
        let _ = fs::remove_file(&to);
        fs::hard_link(&from, &to).map_err(OciError::io("link", &to))?;
    }
    Ok(())
}

/// `..`-resolve a relative path lexically; `None` when it climbs out.
fn normalize_within(p: &Path) -> Option<PathBuf> {
    let mut out: Vec<&std::ffi::OsStr> = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop()?;
            }
            _ => return None,
        }
    }
    Some(out.iter().collect())
}

/// Where blob `digest` lives in a layout.
fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf> {
    Ok(dir.join("blobs/sha256").join(blobs::sha256_hex(digest)?))
}

/// A small JSON blob of a layout, checked against its descriptor.
fn json_blob(dir: &Path, d: &Descriptor, what: &str) -> Result<Vec<u8>> {
    let digest = d.digest().to_string();
    let p = blob_path(dir, &digest)?;
    if !p.is_file() {
        return Err(OciError::Invalid(format!("the layout lacks the {what} blob {digest}")));
    }
    let b = read_bounded(&p, MAX_JSON)?;
    verify_bytes(&b, &digest, what)?;
    Ok(b)
}

fn read_layout(dir: &Path, platform: &Platform) -> Result<Image> {
    let header = read_bounded(&dir.join("oci-layout"), 4096)?;
    let v: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| OciError::Invalid(format!("oci-layout is not JSON: {e}")))?;
    if v.get("imageLayoutVersion").and_then(|x| x.as_str()) != Some("1.0.0") {
        return Err(OciError::Invalid(format!(
            "oci-layout says version {}, Crab reads 1.0.0",
            v.get("imageLayoutVersion").unwrap_or(&serde_json::Value::Null)
        )));
    }
    let top = read_bounded(&dir.join("index.json"), MAX_JSON)?;
    let Document::Index(index) = config::parse_document(&top)? else {
        return Err(OciError::Invalid("index.json is not an image index".into()));
    };
    let chosen = choose_top(&index, platform)?;
    let reference = chosen.annotations().as_ref().and_then(|a| {
        a.get("io.containerd.image.name").or_else(|| a.get("org.opencontainers.image.ref.name"))
    });
    let reference = reference.cloned();
    // Follow nested indexes down to one manifest (bounded depth).
    let mut desc = chosen.clone();
    for _ in 0..4 {
        let bytes = json_blob(dir, &desc, "manifest")?;
        match config::parse_document(&bytes)? {
            Document::Index(i) => desc = config::pick_platform(&i, platform)?.clone(),
            Document::Manifest(m) => {
                return image_of(dir, &m, desc.digest().to_string(), reference);
            }
        }
    }
    Err(OciError::Invalid("the layout's indexes nest more than 4 deep".into()))
}

/// The top index's entry to read: the only one, or the platform's.
fn choose_top<'a>(index: &'a ImageIndex, platform: &Platform) -> Result<&'a Descriptor> {
    match index.manifests().as_slice() {
        [] => Err(OciError::Invalid("the layout's index.json lists no image".into())),
        [one] => Ok(one),
        many => {
            if many.iter().any(|d| d.platform().is_some()) {
                return config::pick_platform(index, platform);
            }
            let names: Vec<String> = many
                .iter()
                .map(|d| {
                    d.annotations()
                        .as_ref()
                        .and_then(|a| a.get("org.opencontainers.image.ref.name").cloned())
                        .unwrap_or_else(|| d.digest().to_string())
                })
                .collect();
            Err(OciError::Invalid(format!(
                "the layout holds {} images ({}); import a layout holding one (e.g. `skopeo copy \
                 oci:DIR:TAG oci:NEWDIR`)",
                many.len(),
                names.join(", ")
            )))
        }
    }
}

fn image_of(
    dir: &Path,
    m: &ImageManifest,
    digest: String,
    reference: Option<String>,
) -> Result<Image> {
    config::check_manifest(m)?;
    let cfg = json_blob(dir, m.config(), "config")?;
    let (defaults, diff_ids) = config::parse_config(&cfg)?;
    if diff_ids.len() != m.layers().len() {
        return Err(OciError::Invalid(format!(
            "the manifest lists {} layers but the config {} diff ids",
            m.layers().len(),
            diff_ids.len()
        )));
    }
    let mut layers = Vec::new();
    for (i, (l, diff_id)) in m.layers().iter().zip(diff_ids).enumerate() {
        let ld = l.digest().to_string();
        let p = blob_path(dir, &ld)?;
        if !p.is_file() {
            return Err(OciError::Invalid(format!("the layout lacks layer {} ({ld})", i + 1)));
        }
        verify_file(&p, &ld, &format!("layer {}", i + 1))?;
        layers.push(Layer { digest: ld, diff_id, media_type: l.media_type().to_string(), path: p });
    }
    Ok(Image { reference, digest, config: defaults, layers })
}

#[derive(serde::Deserialize)]
struct SaveEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

/// The sha256 hex a `docker save` file name carries (`<hex>.json`, `blobs/sha256/<hex>`).
fn named_digest(rel: &Path) -> Option<String> {
    let name = rel.file_name()?.to_str()?;
    let hex = name.strip_suffix(".json").unwrap_or(name);
    blobs::sha256_hex(&format!("sha256:{hex}")).ok().map(|h| format!("sha256:{h}"))
}

fn read_docker_save(dir: &Path) -> Result<Image> {
    let b = read_bounded(&dir.join("manifest.json"), MAX_JSON)?;
    let entries: Vec<SaveEntry> = serde_json::from_slice(&b)
        .map_err(|e| OciError::Invalid(format!("manifest.json is malformed: {e}")))?;
    let e = match entries.as_slice() {
        [one] => one,
        [] => return Err(OciError::Invalid("manifest.json lists no image".into())),
        many => {
            let tags: Vec<String> =
                many.iter().flat_map(|e| e.repo_tags.clone().unwrap_or_default()).collect();
            return Err(OciError::Invalid(format!(
                "the archive holds {} images ({}); `docker save` one image per archive",
                many.len(),
                tags.join(", ")
            )));
        }
    };
    let rel = |s: &str| {
        safe_rel(Path::new(s)).ok_or_else(|| {
            OciError::Invalid(format!("manifest.json names {s:?}, outside the archive"))
        })
    };
    let cfg_rel = rel(&e.config)?;
    let cfg = read_bounded(&dir.join(&cfg_rel), MAX_JSON)?;
    let digest = blobs::digest_of(&cfg);
    if let Some(named) = named_digest(&cfg_rel) {
        if named != digest {
            return Err(OciError::Digest { what: "config".into(), want: named, got: digest });
        }
    }
    let (defaults, diff_ids) = config::parse_config(&cfg)?;
    if diff_ids.len() != e.layers.len() {
        return Err(OciError::Invalid(format!(
            "manifest.json lists {} layers but the config {} diff ids",
            e.layers.len(),
            diff_ids.len()
        )));
    }
    let mut layers = Vec::new();
    for (i, (l, diff_id)) in e.layers.iter().zip(diff_ids).enumerate() {
        let lr = rel(l)?;
        let p = dir.join(&lr);
        let m = fs::symlink_metadata(&p).map_err(OciError::io("stat", &p))?;
        if !m.is_file() {
            return Err(OciError::Invalid(format!("layer {} ({l}) is not a file", i + 1)));
        }
        let ld = blobs::digest_of_file(&p)?;
        if let Some(named) = named_digest(&lr) {
            if named != ld {
                return Err(OciError::Digest {
                    what: format!("layer {}", i + 1),
                    want: named,
                    got: ld,
                });
            }
        }
        let mut magic = [0u8; 2];
        let gz = File::open(&p).and_then(|mut f| f.read_exact(&mut magic)).is_ok()
            && magic == [0x1f, 0x8b];
        let media_type = if gz {
            "application/vnd.docker.image.rootfs.diff.tar.gzip"
        } else {
            "application/vnd.docker.image.rootfs.diff.tar"
        };
        layers.push(Layer { digest: ld, diff_id, media_type: media_type.into(), path: p });
    }
    let reference = e.repo_tags.as_ref().and_then(|t| t.first().cloned());
    Ok(Image { reference, digest, config: defaults, layers })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn archive_links_stay_inside() {
        assert_eq!(
            normalize_within(Path::new("a/../b/layer.tar")),
            Some(PathBuf::from("b/layer.tar"))
        );
        assert_eq!(normalize_within(Path::new("a/../../x")), None);
        assert_eq!(normalize_within(Path::new("/etc/passwd")), None);
        assert_eq!(safe_rel(Path::new("./blobs/sha256/x")), Some(PathBuf::from("blobs/sha256/x")));
        assert_eq!(safe_rel(Path::new("../x")), None);
    }

    #[test]
    fn docker_save_names_carry_digests() {
        let h = "a".repeat(64);
        assert_eq!(named_digest(Path::new(&format!("{h}.json"))), Some(format!("sha256:{h}")));
        assert_eq!(
            named_digest(Path::new(&format!("blobs/sha256/{h}"))),
            Some(format!("sha256:{h}"))
        );
        assert_eq!(named_digest(Path::new("abc/layer.tar")), None);
    }
}
