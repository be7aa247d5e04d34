//! Images made by the host from more than a recipe: Dockerfile builds
//! ([`Action::BuildImage`] with a `dockerfile`, [`crab_sandbox::build`]) and images of a
//! sandbox's files ([`Action::CommitImage`]: its current files, or a restore point's filesystem
//! snapshot). Either way the new image is shifted for new sandboxes afterwards, as builds and
//! imports are.

use std::path::PathBuf;
use std::sync::Arc;

use crab_common::api::{ImageBuildReport, ImageBuildRequest, ImageCommitRequest};
use crab_common::Progress;
use crab_sandbox::{build, image, shift};

use crate::host::blocking;
use crate::{Host, HostError, Outcome};

/// A host path given in a request: absolute.
fn abs(what: &str, p: &str) -> Result<PathBuf, HostError> {
    let p = PathBuf::from(p);
    if !p.is_absolute() {
        return Err(HostError::invalid(
            format!("the {what} path {} is not absolute", p.display()),
            "give the daemon an absolute path (the CLI resolves relative ones)",
        ));
    }
    Ok(p)
}

impl Host {
    /// Build image `req.name` from the Dockerfile `req.dockerfile`.
    pub(crate) async fn build_dockerfile(
        self: &Arc<Self>,
        req: ImageBuildRequest,
        progress: Box<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let Some(name) = req.name.clone() else {
            return Err(HostError::invalid(
                "a Dockerfile build needs the image's name",
                "give --name NAME",
            ));
        };
        let dockerfile = abs("Dockerfile", req.dockerfile.as_deref().unwrap_or_default())?;
        let context = match &req.context {
            Some(c) => abs("context", c)?,
            None => dockerfile.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/")),
        };
        let spec = build::BuildSpec {
            name: name.clone(),
            dockerfile,
            context,
            build_args: req.build_args.clone(),
            no_cache: req.no_cache,
            // `FROM python:3.12`: the image the host resolves it to, pulled on first use.
            resolve_from: Some(build::FromResolver(Arc::new({
                let (host, handle) = (self.clone(), tokio::runtime::Handle::current());
                move |r: &str| {
                    handle
                        .block_on(host.resolve_image(r))
                        .map_err(|e| format!("{} ({})", e.0.message, e.0.hint))
                }
            }))),
        };
        let rt = self.runtime.clone();
        let handle = tokio::runtime::Handle::current();
        blocking(move || {
            let (image, steps) = build::build(&rt, &handle, &spec, progress.as_ref())?;
            // A replaced image's ready roots are stale.
            rt.forget_image(&name);
            rt.prepare_image(&name, progress.as_ref());
            Ok(Outcome::Built(Box::new(ImageBuildReport { image, steps })))
        })
        .await
    }

    /// Make image `req.name` of sandbox `SB`'s current files or of its point `SB@POINT`'s,
    /// with the defaults of the sandbox's image (its record's copy of them, which outlives the
    /// image); the sandbox is not touched.
    pub(crate) async fn commit_image(
        self: &Arc<Self>,
        req: ImageCommitRequest,
        progress: Box<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let (sb, point) = match req.source.split_once('@') {
            Some((s, p)) => (s.to_string(), Some(p.to_string())),
            None => (req.source.clone(), None),
        };
        crab_common::names::validate("sandbox", &sb)?;
        let rec = self.runtime.record(&sb)?;
        // No restore or remove of the sandbox while its files are taken.
        let l = self.life_lock(&sb);
        let _g = l.lock().await;
        let h = self.clone();
        blocking(move || {
            let state = h.state().clone();
            let src = match &point {
                Some(p) => {
                    let store = h.checkpointer().store(&sb)?;
                    let m = store.resolve(Some(p))?;
                    let fs = m.fs.ok_or_else(|| {
                        HostError::invalid(
                            format!("point {sb}@{} has no filesystem snapshot", m.id),
                            "commit a point taken with a filesystem snapshot, or the sandbox itself",
                        )
                    })?;
                    store.fs_path(fs.id)
                }
                None => state.sandbox_rootfs(&sb),
            };
            progress.stage("commit", None);
            let source = match &point {
                Some(p) => format!("commit {sb}@{p}"),
                None => format!("commit {sb}"),
            };
            let ids = rec.profile.userns;
            let finish = move |p: &std::path::Path| -> crab_sandbox::Result<()> {
                match ids {
                    Some(r) => shift::unshift_tree(p, r),
                    None => Ok(()),
                }
            };
            // A btrfs snapshot of the live root is one instant of it (as a crash would leave it).
            let info = image::from_tree(
                &state,
                &req.name,
                Some(&src),
                source,
                rec.image_config.clone(),
                Vec::new(),
                false,
                &finish,
            )?;
            h.runtime.forget_image(&req.name);
            h.runtime.prepare_image(&req.name, progress.as_ref());
            Ok(Outcome::Image(info))
        })
        .await
    }
}
