//! Manifests, indexes and configs: parsed with `oci-spec` (which reads Docker's schema-2
//! manifests and manifest lists as well, their shape being the same), checked, and turned
//! into what Crab keeps — an image config's defaults and its layers' diff ids.

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest};

use crab_common::api::ImageDefaults;

use crate::error::{OciError, Result};
use crate::Platform;

/// Media types of image manifests Crab reads.
pub const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// Media types of indexes (manifest lists).
pub const INDEX_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

/// Layer media types Crab applies.
pub const LAYER_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
];

/// What a manifest-or-index document is.
#[derive(Debug)]
pub enum Document {
    /// One image's manifest.
    Manifest(Box<ImageManifest>),
    /// An index of manifests (one per platform, or nested indexes).
    Index(Box<ImageIndex>),
}

/// Parse a manifest or an index (told apart by `mediaType`, else by `manifests` vs `layers`).
pub fn parse_document(bytes: &[u8]) -> Result<Document> {
    let v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| OciError::Invalid(format!("the manifest is not JSON: {e}")))?;
    let mt = v.get("mediaType").and_then(|m| m.as_str()).unwrap_or_default();
    if mt == "application/vnd.docker.distribution.manifest.v1+json"
        || mt == "application/vnd.docker.distribution.manifest.v1+prettyjws"
        || v.get("schemaVersion").and_then(|s| s.as_u64()) == Some(1)
    {
        return Err(OciError::Invalid(
            "the image has a Docker schema-1 manifest, which is deprecated and unsupported; \
             push it again with a current tool (it then gets a schema-2 or OCI manifest)"
                .into(),
        ));
    }
    let is_index = INDEX_TYPES.contains(&mt) || (mt.is_empty() && v.get("manifests").is_some());
    if is_index {
        let i: ImageIndex = serde_json::from_value(v)
            .map_err(|e| OciError::Invalid(format!("the image index is malformed: {e}")))?;
        return Ok(Document::Index(Box::new(i)));
    }
    if !mt.is_empty() && !MANIFEST_TYPES.contains(&mt) {
        return Err(OciError::Invalid(format!(
            "the manifest has media type {mt}, which is not an image (artifacts and other \
             kinds cannot be run)"
        )));
    }
    let m: ImageManifest = serde_json::from_value(v)
        .map_err(|e| OciError::Invalid(format!("the image manifest is malformed: {e}")))?;
    check_manifest(&m)?;
    Ok(Document::Manifest(Box::new(m)))
}

/// Refuse manifests whose layers Crab cannot apply (non-distributable ones, artifacts).
pub fn check_manifest(m: &ImageManifest) -> Result<()> {
    if m.layers().is_empty() {
        return Err(OciError::Invalid("the image manifest lists no layers".into()));
    }
    for (i, l) in m.layers().iter().enumerate() {
        let mt = l.media_type().to_string();
        if !LAYER_TYPES.contains(&mt.as_str()) {
            return Err(OciError::Invalid(format!(
                "layer {} ({}) has media type {mt}, which Crab does not apply (it applies \
                 tar, tar+gzip and tar+zstd layers; non-distributable layers are refused)",
                i + 1,
                l.digest()
            )));
        }
    }
    Ok(())
}

/// The descriptor of `platform`'s manifest in an index.
pub fn pick_platform<'a>(index: &'a ImageIndex, platform: &Platform) -> Result<&'a Descriptor> {
    let mut have = Vec::new();
    for d in index.manifests() {
        let Some(p) = d.platform() else { continue };
        let (os, arch) = (p.os().to_string(), p.architecture().to_string());
        let variant = p.variant().clone();
        have.push(match &variant {
            Some(v) => format!("{os}/{arch}/{v}"),
            None => format!("{os}/{arch}"),
        });
        if os == platform.os
            && arch == platform.arch
            && (platform.variant.is_none() || platform.variant == variant)
        {
            return Ok(d);
        }
    }
    // An index without platforms (an OCI layout's top index) holding exactly one manifest.
    if have.is_empty() && index.manifests().len() == 1 {
        return index
            .manifests()
            .first()
            .ok_or_else(|| OciError::Invalid("the image index is empty".into()));
    }
    Err(OciError::Platform {
        wanted: platform.to_string(),
        have: if have.is_empty() { "none".into() } else { have.join(", ") },
    })
}

/// From a config blob: the defaults and the diff ids (bottom first).
pub fn parse_config(bytes: &[u8]) -> Result<(ImageDefaults, Vec<String>)> {
    let c: ImageConfiguration = serde_json::from_slice(bytes)
        .map_err(|e| OciError::Invalid(format!("the image config is malformed: {e}")))?;
    let diff_ids: Vec<String> = c.rootfs().diff_ids().clone();
    for d in &diff_ids {
        crate::blobs::sha256_hex(d)?;
    }
    let mut out = ImageDefaults::default();
    if let Some(cfg) = c.config() {
        out.env = cfg.env().clone().unwrap_or_default();
        out.workdir = cfg.working_dir().clone().filter(|w| !w.is_empty());
        out.user = cfg.user().clone().filter(|u| !u.is_empty());
        out.entrypoint = cfg.entrypoint().clone().unwrap_or_default();
        out.cmd = cfg.cmd().clone().unwrap_or_default();
        out.labels = cfg.labels().clone().unwrap_or_default().into_iter().collect();
        let mut ports = cfg.exposed_ports().clone().unwrap_or_default();
        ports.sort();
        out.exposed_ports = ports;
    }
    // Docker's `SHELL` is not in the OCI config; Docker writes it as `config.Shell`.
    let raw: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
    if let Some(sh) = raw.pointer("/config/Shell").and_then(|s| s.as_array()) {
        out.shell = sh.iter().filter_map(|x| x.as_str().map(str::to_string)).collect();
    }
    if let Some(w) = &out.workdir {
        if !w.starts_with('/') {
            out.workdir = Some(format!("/{w}"));
        }
    }
    Ok((out, diff_ids))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const CONFIG: &str = r#"{"architecture":"amd64","os":"linux",
      "config":{"User":"1000:1000","Env":["PATH=/usr/bin","A=b"],"WorkingDir":"/app",
        "Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"],"Labels":{"x":"y"},
        "ExposedPorts":{"8080/tcp":{}},"Shell":["/bin/bash","-c"]},
      "rootfs":{"type":"layers","diff_ids":["sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]}}"#;

    #[test]
    fn config_defaults_are_read() {
        let (d, ids) = parse_config(CONFIG.as_bytes()).unwrap();
        assert_eq!(ids.len(), 1);
        assert_eq!(d.user.as_deref(), Some("1000:1000"));
        assert_eq!(d.workdir.as_deref(), Some("/app"));
        assert_eq!(d.env, vec!["PATH=/usr/bin", "A=b"]);
        assert_eq!(d.run_argv(&[]), vec!["/bin/sh", "-c", "echo hi"]);
        assert_eq!(d.exposed_ports, vec!["8080/tcp"]);
        assert_eq!(d.shell, vec!["/bin/bash", "-c"]);
        assert_eq!(d.labels.get("x").map(String::as_str), Some("y"));
    }

    #[test]
    fn bad_diff_ids_and_schema1_are_refused() {
        let bad = CONFIG.replace("sha256:aaaa", "sha256:../a");
        assert!(parse_config(bad.as_bytes()).is_err());
        assert!(parse_document(br#"{"schemaVersion":1,"fsLayers":[]}"#).is_err());
    }
}
