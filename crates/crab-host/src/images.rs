//! Installing OCI images: from `crab_oci`'s verified [`crab_oci::Image`] (a layout, a `docker
//! save` archive, a registry pull) to a Crab image — layers applied once each by
//! `crab_sandbox::layers`, then the user-namespace copy made — one path for every source.

use std::path::Path;

use crab_common::api::ImageInfo;
use crab_common::paths::StateDir;
use crab_common::Progress;
use crab_sandbox::image::{self, OciImage};
use crab_sandbox::layers::{LayerBlob, LayerLimits};
use crab_sandbox::runtime::Runtime;

use crate::error::HostError;

impl From<crab_oci::OciError> for HostError {
    fn from(e: crab_oci::OciError) -> Self {
        HostError(e.to_api())
    }
}

/// Install `img` as image `name` (source shown as `source`), then make its user-namespace copy.
pub fn install_oci(
    state: &StateDir,
    rt: &Runtime,
    name: &str,
    img: crab_oci::Image,
    source: String,
    replace: bool,
    progress: &dyn Progress,
) -> Result<ImageInfo, HostError> {
    let spec = OciImage {
        source,
        reference: img.reference,
        digest: Some(img.digest),
        config: img.config,
        layers: img
            .layers
            .into_iter()
            .map(|l| LayerBlob {
                digest: l.digest,
                diff_id: l.diff_id,
                media_type: l.media_type,
                path: l.path,
            })
            .collect(),
    };
    rt.forget_image(name);
    let info = image::install(state, name, &spec, replace, LayerLimits::default(), progress)?;
    rt.prepare_image(name, progress);
    Ok(info)
}

/// `crab image import`: an OCI layout or `docker save` archive (directory or tar) becomes an
/// OCI image; anything else is a root filesystem, imported as before.
pub fn import(
    state: &StateDir,
    rt: &Runtime,
    name: &str,
    path: &Path,
    platform: Option<&str>,
    progress: &dyn Progress,
) -> Result<ImageInfo, HostError> {
    let platform: crab_oci::Platform = match platform {
        Some(p) => p.parse()?,
        None => crab_oci::Platform::default(),
    };
    crab_common::names::validate("image", name)?;
    let scratch =
        state.tmp().join(format!("import-{name}-{:08x}", crab_sandbox::runtime::rand_u32()));
    let _cleanup = RemoveOnDrop(&scratch);
    progress.stage("read", None);
    match crab_oci::layout::read(path, &platform, &scratch)? {
        Some(img) => {
            if state.image_record(name).exists() {
                return Err(crab_sandbox::SandboxError::NameTaken {
                    kind: "image",
                    name: name.to_string(),
                }
                .into());
            }
            let source = format!("import {}", path.display());
            install_oci(state, rt, name, img, source, false, progress)
        }
        None => {
            rt.forget_image(name);
            let i = image::import(state, name, path, progress)?;
            rt.prepare_image(name, progress);
            Ok(i)
        }
    }
}

/// Removes a scratch directory when dropped.
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if self.0.exists() {
            if let Err(e) = std::fs::remove_dir_all(self.0) {
                tracing::warn!(path = %self.0.display(), error = %e, "cannot remove an import's scratch directory");
            }
        }
    }
}
