//! [`Action::PullImage`](crate::Action::PullImage): an image from a registry
//! (`crab_oci::registry`) installed as a Crab image (`crab_sandbox::image::install`), its
//! blobs kept in the host's verified blob cache so an interrupted pull resumes. An image of
//! the same name from the same reference and digest is "already pulled" (no work); one from
//! another digest is swapped only when asked (`replace`).
//!
//! It also owns *pull on first use*: a sandbox asked for with a registry reference
//! (`python:3.12`, `127.0.0.1:5000/app:1`) where an image name belongs gets the local image
//! pulled from that reference, pulling it first when none is there and the daemon's
//! [`PullPolicy`] allows — so every front door (CLI, SDK, E2B templates, `crab docker run`)
//! accepts references the same way.

use std::sync::Arc;

use crab_common::api::{ImageInfo, ImagePullRequest};
use crab_common::names;
use crab_common::Progress;
use crab_oci::blobs::BlobStore;
use crab_oci::registry::{self, Credentials, PullOptions, Puller};
use crab_oci::Platform;
use crab_sandbox::image::{self, OciImage};
use crab_sandbox::layers::{LayerBlob, LayerLimits};

use super::{blocking, Host};
use crate::{HostError, Outcome};

/// Credentials the daemon itself holds for a registry (its user's docker config), by registry
/// host.
pub type CredentialSource = Arc<dyn Fn(&str) -> Option<(String, String)> + Send + Sync>;

/// What `create` does with an image given as a registry reference no local image holds
/// (`crab daemon --pull`, `--insecure-registry`).
#[derive(Clone)]
pub struct PullPolicy {
    /// Pull it (`--pull missing`, the default); `false` refuses with a hint (`--pull never`).
    pub on_create: bool,
    /// Registries (`HOST[:PORT]`) spoken to over plain http (loopback test registries).
    pub insecure: Vec<String>,
    /// The daemon's own credentials for a registry, if any.
    pub credentials: Option<CredentialSource>,
}

impl Default for PullPolicy {
    fn default() -> Self {
        PullPolicy { on_create: true, insecure: Vec::new(), credentials: None }
    }
}

impl std::fmt::Debug for PullPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullPolicy")
            .field("on_create", &self.on_create)
            .field("insecure", &self.insecure)
            .field("credentials", &self.credentials.is_some())
            .finish()
    }
}

/// Whether `image` is a registry reference rather than an image name (image names have no
/// `:`, `/` or `@`).
pub fn is_reference(image: &str) -> bool {
    image.contains([':', '/', '@'])
}

/// The local image that holds `reference` (`whole`: its normalized form), if any.
fn holding(images: &[ImageInfo], whole: &str, digest: Option<&str>) -> Option<String> {
    images
        .iter()
        .find(|i| {
            i.reference.as_deref() == Some(whole)
                && digest.is_none_or(|d| i.digest.as_deref() == Some(d))
        })
        .map(|i| i.name.clone())
}

/// A request's basic credentials: both or neither.
pub(super) fn basic_auth(
    username: Option<String>,
    password: Option<String>,
) -> Result<Option<(String, String)>, HostError> {
    match (username, password) {
        (Some(u), Some(p)) => Ok(Some((u, p))),
        (None, None) => Ok(None),
        _ => Err(HostError::invalid(
            "a username needs a password and a password a username",
            "give both (`--username U --password-stdin`) or neither",
        )),
    }
}

/// Logs a first-use pull's progress (no caller is there to draw it).
struct LogProgress(String);

impl Progress for LogProgress {
    fn stage(&self, name: &str, _total: Option<u64>) {
        tracing::debug!(reference = %self.0, stage = name, "pull on first use");
    }
    fn advance(&self, _done: u64) {}
    fn message(&self, line: &str) {
        tracing::info!(reference = %self.0, "{line}");
    }
}

impl Host {
    /// A pull the daemon makes of its own accord (first use, a remote point's image): its
    /// `--insecure-registry` list and its user's credentials for the reference's registry.
    fn daemon_pull(&self, reference: &str, name: &str, registry: &str) -> ImagePullRequest {
        let creds = self.pulls.credentials.as_ref().and_then(|c| c(registry));
        let source = creds.as_ref().map(|_| "the daemon's ~/.docker/config.json".to_string());
        let (username, password) = creds.map_or((None, None), |(u, p)| (Some(u), Some(p)));
        ImagePullRequest {
            reference: reference.to_string(),
            name: Some(name.to_string()),
            platform: None,
            insecure: self.pulls.insecure.iter().any(|h| h == registry),
            username,
            password,
            credential_source: source,
            replace: false,
        }
    }

    /// The image name a sandbox of `image` starts from: `image` itself when it is a name;
    /// for a registry reference, the local image pulled from it, pulled now when there is none
    /// and the [`PullPolicy`] allows (one first-use pull at a time, so concurrent creates of
    /// one reference pull it once).
    pub(crate) async fn resolve_image(&self, image: &str) -> Result<String, HostError> {
        if !is_reference(image) {
            return Ok(image.to_string());
        }
        let r = registry::parse_reference(image)?;
        let whole = r.whole();
        let digest = r.digest().map(str::to_string);
        let _one = self.pull_lock.lock().await;
        let state = self.state().clone();
        let images = blocking(move || Ok(image::list(&state)?)).await?;
        if let Some(name) = holding(&images, &whole, digest.as_deref()) {
            return Ok(name);
        }
        if !self.pulls.on_create {
            return Err(HostError::invalid(
                format!(
                    "no local image holds {whole}, and this daemon does not pull on create \
                     (crab daemon --pull never)"
                ),
                format!("pull it first: `crab image pull {image}` (or start the daemon with --pull missing)"),
            ));
        }
        let mut name = registry::default_name(image)?;
        if images.iter().any(|i| i.name == name) {
            // The default name holds another image: a name of its own, from the reference.
            let tag = crab_oci::blobs::digest_of(whole.as_bytes());
            let mut base = name.clone();
            base.truncate(names::MAX_NAME_LEN - 13);
            name = format!("{base}-{}", &tag[7..19]);
        }
        let req = self.daemon_pull(image, &name, r.registry());
        tracing::info!(reference = %whole, image = %name, "pulling on first use");
        match self.pull_image(req, Box::new(LogProgress(whole.clone()))).await {
            Ok(_) => Ok(name),
            Err(mut e) => {
                e.0.message = format!("pulling {whole} on first use: {}", e.0.message);
                if e.0.message.contains("plain http") {
                    e.0.hint = format!(
                        "a registry without TLS (a loopback test registry) must be named to the \
                         daemon: `crab daemon --insecure-registry {}` (or pull it yourself: \
                         `crab image pull --insecure {image}`)",
                        r.registry()
                    );
                }
                Err(e)
            }
        }
    }

    /// The base image of remote point `rec`, pulled from its registry when this host has no
    /// image of the point's image name and the point says where it came from (reference and
    /// manifest digest): pulled by digest, under that name, so the restore that follows finds
    /// its base here and fetches only the point's own files from the store. Best effort: a
    /// pull that is not allowed (`--pull never`) or fails is reported through `progress` and
    /// the restore downloads the image's files from the store, as it does for any image. The
    /// point's record is not trusted: the name must be an image name, the reference must parse
    /// and the digest be a sha256; the pulled image serves as the point's base only if its tree
    /// is the one the point names (`crab_remote::local`), and plain http is spoken only to the
    /// daemon's `--insecure-registry` hosts.
    pub(crate) async fn pull_point_image(
        &self,
        rec: &crab_remote::PointRecord,
        progress: &dyn Progress,
    ) -> bool {
        let Some(img) = &rec.image else { return false };
        let (Some(reference), Some(digest)) = (&img.reference, &img.digest) else { return false };
        if names::validate("image", &img.name).is_err()
            || crab_oci::blobs::sha256_hex(digest).is_err()
        {
            return false;
        }
        let Ok(r) = registry::parse_reference(reference) else { return false };
        let _one = self.pull_lock.lock().await;
        let (state, name) = (self.state().clone(), img.name.clone());
        let have = blocking(move || Ok(image::get(&state, &name).ok())).await.ok().flatten();
        if have.is_some() {
            return false;
        }
        if !self.pulls.on_create {
            progress.message(&format!(
                "image {} is not here and this daemon does not pull (--pull never): its files \
                 come from the store",
                img.name
            ));
            return false;
        }
        let by_digest = format!("{}/{}@{digest}", r.registry(), r.repository());
        progress.message(&format!("image {} is not here: pulling {by_digest}", img.name));
        let req = self.daemon_pull(&by_digest, &img.name, r.registry());
        match self.pull_image(req, Box::new(LogProgress(by_digest.clone()))).await {
            Ok(_) => {
                progress.message(&format!("pulled {by_digest} as image {}", img.name));
                true
            }
            Err(e) => {
                tracing::warn!(reference = %by_digest, error = %e.0.message, "could not pull a remote point's image");
                progress.message(&format!(
                    "could not pull {by_digest} ({}): the image's files come from the store",
                    e.0.message
                ));
                false
            }
        }
    }

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
        let basic = basic_auth(req.username, req.password)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn img(name: &str, reference: Option<&str>, digest: Option<&str>) -> ImageInfo {
        ImageInfo {
            name: name.into(),
            source: String::new(),
            created_at: 0,
            size_bytes: 0,
            reference: reference.map(Into::into),
            digest: digest.map(Into::into),
            shared_bytes: 0,
            config: Default::default(),
        }
    }

    #[test]
    fn references_are_told_from_names() {
        for r in ["python:3.12", "127.0.0.1:5000/app:1", "a/b", "x@sha256:00"] {
            assert!(is_reference(r), "{r}");
        }
        for n in ["debian", "python-3.12", "my_image.v2"] {
            assert!(!is_reference(n), "{n}");
        }
    }

    #[test]
    fn the_image_holding_a_reference_is_found_by_reference_and_digest() {
        let images = [
            img("debian", None, None),
            img("app-1", Some("h:1/app:1"), Some("sha256:aa")),
            img("other", Some("h:1/other:1"), Some("sha256:bb")),
        ];
        assert_eq!(holding(&images, "h:1/app:1", None).as_deref(), Some("app-1"));
        assert_eq!(holding(&images, "h:1/app:1", Some("sha256:aa")).as_deref(), Some("app-1"));
        assert_eq!(holding(&images, "h:1/app:1", Some("sha256:cc")), None);
        assert_eq!(holding(&images, "h:1/app:2", None), None);
    }
}
