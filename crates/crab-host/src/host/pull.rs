//! [`Action::PullImage`](crate::Action::PullImage): an image from a registry
//! (`crab_oci::registry`) installed as a Crab image (`crab_sandbox::image::install`), its
//! blobs kept in the host's verified blob cache so an interrupted pull resumes. An image of
//! the same name from the same reference and digest is "already pulled" (no work); one from
//! another digest is swapped only when asked (`replace`).

use crab_common::api::ImagePullRequest;
use crab_common::names;
use crab_common::Progress;
use crab_oci::blobs::BlobStore;
use crab_oci::registry::{self, Credentials, PullOptions, Puller};
use crab_oci::Platform;
use crab_sandbox::image::{self, OciImage};
use crab_sandbox::layers::{LayerBlob, LayerLimits};

use super::{blocking, Host};
use crate::{HostError, Outcome};

impl Host {
    /// Pull `req.reference` and install it (see the module doc).
    pub(super) async fn pull_image(
        &self,
        req: ImagePullRequest,
        progress: Box<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let name = match &req.name {
            Some(n) => n.clone(),
            None => registry::default_name(&req.reference)?,
        };
        names::validate("image", &name)?;
        let platform = req.platform.as_deref().map(str::parse::<Platform>).transpose()?;
        let basic = match (req.username, req.password) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            _ => {
                return Err(HostError::invalid(
                    "a username needs a password and a password a username",
                    "give both (`--username U --password-stdin`) or neither",
                ))
            }
        };
        let puller = Puller::new(PullOptions {
            reference: req.reference.clone(),
            platform,
            insecure: req.insecure,
            credentials: Credentials { basic, source: req.credential_source.clone() },
        })?;
        let store = BlobStore::new(self.state().root().join("cache/blobs"));
        progress.message(&format!("pulling {} as image {name}", puller.reference()));
        progress.stage("manifest", None);
        let resolved = puller.resolve(&store).await?;
        progress.message(&format!(
            "{} is {} ({} layers)",
            resolved.reference,
            resolved.digest,
            resolved.manifest.layers().len()
        ));

        let state = self.state().clone();
        let existing = {
            let (state, name) = (state.clone(), name.clone());
            blocking(move || Ok(image::get(&state, &name).ok())).await?
        };
        if let Some(i) = &existing {
            if i.reference.as_deref() == Some(resolved.reference.as_str())
                && i.digest.as_deref() == Some(resolved.digest.as_str())
            {
                progress.message(&format!(
                    "image {name} is already pulled ({}@{}): nothing to do",
                    resolved.reference, resolved.digest
                ));
                return Ok(Outcome::Image(i.clone()));
            }
            if !req.replace {
                let was = match (&i.reference, &i.digest) {
                    (Some(r), Some(d)) => format!("{r}@{d}"),
                    _ => i.source.clone(),
                };
                return Err(HostError::invalid(
                    format!(
                        "image {name} exists (from {was}); {} is {}",
                        resolved.reference, resolved.digest
                    ),
                    "pass --replace to swap it for the pulled one (its sandboxes keep their \
                     files), or --name to pull it under another name",
                ));
            }
        }

        let img = puller.fetch(&resolved, &store, progress.as_ref()).await?;
        let rt = self.runtime.clone();
        let replace = existing.is_some();
        blocking(move || {
            let oci = OciImage {
                source: format!("pull {}", resolved.reference),
                reference: img.reference.clone(),
                digest: Some(img.digest.clone()),
                config: img.config.clone(),
                layers: img
                    .layers
                    .iter()
                    .map(|l| LayerBlob {
                        digest: l.digest.clone(),
                        diff_id: l.diff_id.clone(),
                        media_type: l.media_type.clone(),
                        path: l.path.clone(),
                    })
                    .collect(),
            };
            if replace {
                rt.forget_image(&name);
            }
            let i = image::install(
                &state,
                &name,
                &oci,
                replace,
                LayerLimits::default(),
                progress.as_ref(),
            )?;
            rt.prepare_image(&name, progress.as_ref());
            progress.message(&format!("pulled {} as image {name}", resolved.reference));
            Ok(Outcome::Image(i))
        })
        .await
    }
}
