//! OCI images for Crab, up to the point where their layers are applied.
//!
//! This crate reads what an image *is* — manifests, indexes and configs (with `oci-spec`'s
//! types), the blobs they name — from wherever it comes: an OCI image layout (directory or
//! tar), a `docker save` archive, or a registry. Every blob is verified against its digest
//! before it is used, and everything read is treated as hostile (bounded sizes, checked
//! names). The result is an [`Image`]: its config's defaults and its layer blobs on this host,
//! bottom first, which `crab_sandbox::layers` applies. Nothing here touches the pool.

pub mod blobs;
pub mod config;
pub mod error;
pub mod layout;
pub mod push;
pub mod registry;

pub use error::{OciError, Result};

use std::path::PathBuf;

use crab_common::api::ImageDefaults;

/// One layer of an [`Image`], its blob on this host.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Digest of the blob (`sha256:…`).
    pub digest: String,
    /// The config's diff id for it (digest of the uncompressed tar).
    pub diff_id: String,
    /// Media type.
    pub media_type: String,
    /// Where its verified bytes are.
    pub path: PathBuf,
}

/// An image ready to install: config defaults and layers (bottom first).
#[derive(Debug, Clone)]
pub struct Image {
    /// Registry reference (when pulled) or the tag an archive names.
    pub reference: Option<String>,
    /// Digest of its manifest.
    pub digest: String,
    /// The config's defaults.
    pub config: ImageDefaults,
    /// Layers, bottom first.
    pub layers: Vec<Layer>,
}

/// The platform to pick from an index: `os/arch[/variant]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    /// `linux`.
    pub os: String,
    /// `amd64`, `arm64`, ….
    pub arch: String,
    /// `v8`, … when given.
    pub variant: Option<String>,
}

impl Default for Platform {
    fn default() -> Self {
        Platform { os: "linux".into(), arch: "amd64".into(), variant: None }
    }
}

impl std::str::FromStr for Platform {
    type Err = OciError;

    fn from_str(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok =
            |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        match parts.as_slice() {
            [os, arch] if ok(os) && ok(arch) => {
                Ok(Platform { os: os.to_string(), arch: arch.to_string(), variant: None })
            }
            [os, arch, v] if ok(os) && ok(arch) && ok(v) => Ok(Platform {
                os: os.to_string(),
                arch: arch.to_string(),
                variant: Some(v.to_string()),
            }),
            _ => Err(OciError::Invalid(format!(
                "platform {s:?} is not OS/ARCH[/VARIANT] (e.g. linux/amd64)"
            ))),
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.arch)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}
