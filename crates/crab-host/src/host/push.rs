//! [`Action::PushImage`](crate::Action::PushImage): a Crab image uploaded to a registry as an
//! OCI image (`crab_oci::push`). The registry is reached and the credentials tried first, so
//! an unreachable registry or a refused password changes nothing here. Each layer's blob is
//! the one it was installed from when the host's blob cache still has it (a pulled image
//! pushes back with its own digests, and a registry that has them is not sent them again);
//! otherwise it is made from the layer's tree (`crab_sandbox::export`) into the blob cache and
//! remembered (in the layer's record, or for an image's own files under
//! `<state>/cache/blobs/generated/<key>.json`), so a second push makes nothing again.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crab_common::api::{ImagePushReport, ImagePushRequest, PushedBlob};
use crab_common::paths::StateDir;
use crab_common::Progress;
use crab_oci::blobs::BlobStore;
use crab_oci::push::{self, PushBlob, PushOptions, Pusher};
use crab_oci::registry::Credentials;
use crab_sandbox::export::{self, LAYER_MEDIA_TYPE};
use crab_sandbox::image::{self, PushLayer};
use crab_sandbox::layers::{self, BlobRef, LayerLimits};

use super::{blocking, Host};
use crate::{HostError, Outcome};

/// Top-level names of an image's tree that are Crab's, not the image's.
const NOT_PUSHED: &[&str] = &[".crab"];

/// A layer ready to upload.
#[derive(Debug, Clone)]
struct Ready {
    blob: PushBlob,
    diff_id: String,
    path: PathBuf,
    origin: &'static str,
    what: String,
}

/// What `cache/blobs/generated/<key>.json` remembers of an image's own files (format 1):
/// the blob made of them, or `None` when they do not differ from the layers below.
#[derive(Debug, Serialize, Deserialize)]
struct GeneratedRecord {
    format: u32,
    blob: Option<BlobRef>,
}

impl Host {
    /// Push image `req.name` to `req.reference` (see the module doc).
    pub(super) async fn push_image(
        &self,
        req: ImagePushRequest,
        progress: Box<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let state = self.state().clone();
        // The image first: an unknown one is named before any registry is asked.
        let (defaults, plan, created) = {
            let (state, name) = (state.clone(), req.name.clone());
            blocking(move || {
                let (d, p) = image::push_source(&state, &name)?;
                let created = image::get(&state, &name)?.created_at;
                Ok((d, p, created))
            })
            .await?
        };
        let basic = super::pull::basic_auth(req.username, req.password)?;
        let pusher = Pusher::new(PushOptions {
            reference: req.reference.clone(),
            insecure: req.insecure,
            credentials: Credentials { basic, source: req.credential_source.clone() },
        })?;
        let reference = pusher.reference();
        progress.message(&format!("pushing image {} to {reference}", req.name));
        progress.stage("registry", None);
        pusher.check().await?;

        progress.stage("layers", None);
        let ready = {
            let (state, progress_name) = (state.clone(), req.name.clone());
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
            let job = blocking(move || {
                prepare(&state, &plan, &tx).map_err(|e| {
                    tracing::warn!(image = %progress_name, error = %e, "cannot prepare an image's layers to push");
                    HostError::from(e)
                })
            });
            tokio::pin!(job);
            loop {
                tokio::select! {
                    r = &mut job => {
                        while let Ok(m) = rx.try_recv() {
                            progress.message(&m);
                        }
                        break r?;
                    }
                    Some(m) = rx.recv() => progress.message(&m),
                }
            }
        };

        let diff_ids: Vec<String> = ready.iter().map(|r| r.diff_id.clone()).collect();
        let config_bytes = push::image_config(&defaults, &diff_ids, &push::rfc3339(created))?;
        let config = PushBlob {
            digest: crab_oci::blobs::digest_of(&config_bytes),
            size: config_bytes.len() as u64,
            media_type: push::CONFIG_MEDIA_TYPE.into(),
        };
        let total: u64 = ready.iter().map(|r| r.blob.size).sum();
        progress.stage("upload", Some(total));
        let mut layers = Vec::with_capacity(ready.len());
        let mut base = 0;
        for r in &ready {
            let uploaded =
                pusher.push_file(&r.blob, &r.path, &r.what, base, progress.as_ref()).await?;
            base += r.blob.size;
            progress.message(&format!(
                "{} {} ({}, {} bytes): {}",
                r.what,
                short(&r.blob.digest),
                r.origin,
                r.blob.size,
                if uploaded { "uploaded" } else { "already in the registry" }
            ));
            layers.push(PushedBlob {
                digest: r.blob.digest.clone(),
                size: r.blob.size,
                media_type: r.blob.media_type.clone(),
                origin: r.origin.into(),
                uploaded,
            });
        }
        let config_uploaded = pusher.push_bytes(&config.digest, config_bytes).await?;
        progress.stage("manifest", None);
        let manifest = push::image_manifest(
            &config,
            &ready.iter().map(|r| r.blob.clone()).collect::<Vec<_>>(),
        )?;
        let digest = pusher.push_manifest(manifest).await?;
        progress.message(&format!("pushed image {} to {reference}@{digest}", req.name));
        Ok(Outcome::Pushed(Box::new(ImagePushReport {
            name: req.name,
            reference,
            digest,
            config: PushedBlob {
                digest: config.digest,
                size: config.size,
                media_type: config.media_type,
                origin: "config".into(),
                uploaded: config_uploaded,
            },
            layers,
        })))
    }
}

fn short(d: &str) -> &str {
    let h = d.strip_prefix("sha256:").unwrap_or(d);
    &h[..h.len().min(12)]
}

fn store(state: &StateDir) -> BlobStore {
    BlobStore::new(state.root().join("cache/blobs"))
}

fn generated_record(state: &StateDir, key: &str) -> PathBuf {
    state.root().join("cache/blobs/generated").join(format!("{key}.json"))
}

/// Every layer's blob: the known one when the cache has it, else made now (messages on `tx`).
fn prepare(
    state: &StateDir,
    plan: &[PushLayer],
    tx: &tokio::sync::mpsc::UnboundedSender<String>,
) -> crab_sandbox::Result<Vec<Ready>> {
    let store = store(state);
    let mut out = Vec::with_capacity(plan.len());
    for l in plan {
        let mut known = l.known.clone();
        let origin = "stored";
        if let Some(key) = &l.key {
            if let Ok(b) = std::fs::read(generated_record(state, key)) {
                if let Ok(r) = serde_json::from_slice::<GeneratedRecord>(&b) {
                    match r.blob {
                        None if r.format == 1 => continue, // no difference: no layer
                        b => known = b,
                    }
                }
            }
        }
        // The stored blob, when the cache has it with the size recorded.
        let cached = known.filter(|b| {
            store
                .path(&b.digest)
                .ok()
                .and_then(|p| std::fs::metadata(p).ok())
                .is_some_and(|m| m.is_file() && m.len() == b.size)
        });
        if let Some(b) = cached {
            let path = store
                .path(&b.digest)
                .map_err(|e| crab_sandbox::SandboxError::Other(e.to_string()))?;
            let _ = tx.send(format!(
                "{}: {} ({origin} blob, {} bytes)",
                l.what,
                short(&b.digest),
                b.size
            ));
            out.push(Ready {
                blob: PushBlob {
                    digest: b.digest,
                    size: b.size,
                    media_type: push::oci_layer_type(&b.media_type),
                },
                diff_id: b.diff_id,
                path,
                origin,
                what: l.what.clone(),
            });
            continue;
        }
        let _ = tx.send(format!("{}: making its tar from the tree", l.what));
        let dir = store.dir().join("sha256");
        std::fs::create_dir_all(&dir).map_err(crab_sandbox::SandboxError::io("create", &dir))?;
        let tmp = dir.join(format!("generated-{:08x}.partial", crab_sandbox::runtime::rand_u32()));
        let g = export::write_layer(
            &l.tree,
            l.below.as_deref(),
            if l.chain.is_none() { NOT_PUSHED } else { &[] },
            &tmp,
            LayerLimits::default(),
        );
        let g = match g {
            Ok(g) => g,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let blob = BlobRef {
            digest: g.digest.clone(),
            media_type: LAYER_MEDIA_TYPE.into(),
            size: g.size,
            diff_id: g.diff_id.clone(),
        };
        if g.entries == 0 && l.chain.is_none() {
            // The image's files are its layers': nothing more to push.
            let _ = std::fs::remove_file(&tmp);
            remember(state, l, None)?;
            let _ = tx.send(format!("{}: the same as the layers below", l.what));
            continue;
        }
        let path =
            store.path(&g.digest).map_err(|e| crab_sandbox::SandboxError::Other(e.to_string()))?;
        std::fs::rename(&tmp, &path).map_err(crab_sandbox::SandboxError::io("rename", &tmp))?;
        remember(state, l, Some(blob.clone()))?;
        let _ = tx.send(format!(
            "{}: {} ({} entries, {} bytes)",
            l.what,
            short(&g.digest),
            g.entries,
            g.size
        ));
        out.push(Ready {
            blob: PushBlob { digest: g.digest, size: g.size, media_type: LAYER_MEDIA_TYPE.into() },
            diff_id: g.diff_id,
            path,
            origin: "generated",
            what: l.what.clone(),
        });
    }
    if out.is_empty() {
        return Err(crab_sandbox::SandboxError::Invalid("the image has no files to push".into()));
    }
    Ok(out)
}

/// Remember a generated blob: in the layer's record, or for an image's own files in the
/// blob cache's `generated/` directory.
fn remember(state: &StateDir, l: &PushLayer, blob: Option<BlobRef>) -> crab_sandbox::Result<()> {
    match (&l.chain, &l.key) {
        (Some(chain), _) => match blob {
            Some(b) => layers::set_blob(state, chain, b),
            None => Ok(()),
        },
        (None, Some(key)) => {
            let p = generated_record(state, key);
            if let Some(d) = p.parent() {
                std::fs::create_dir_all(d).map_err(crab_sandbox::SandboxError::io("create", d))?;
            }
            let bytes = serde_json::to_vec_pretty(&GeneratedRecord { format: 1, blob })
                .map_err(|e| crab_sandbox::SandboxError::Other(e.to_string()))?;
            crab_sandbox::runtime::write_atomic(&p, &bytes)
        }
        (None, None) => Ok(()),
    }
}
