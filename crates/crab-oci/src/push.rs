//! Pushing images to an OCI Distribution registry with the `oci-client` crate: the image's
//! config (an OCI image config made from Crab's [`ImageDefaults`]) and manifest (an OCI image
//! manifest v1) made here, its layer blobs uploaded from files (streamed in the client's chunked
//! upload, never a whole blob in memory), each skipped when the registry already has it.
//! Credentials and `http://` as for pulls ([`crate::registry`]); errors name the reference,
//! the registry and what to do.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use oci_spec::image::{
    ConfigBuilder, DescriptorBuilder, HistoryBuilder, ImageConfigurationBuilder,
    ImageManifestBuilder, MediaType, RootFsBuilder,
};
use tokio::io::AsyncReadExt;

use crab_common::api::ImageDefaults;
use crab_common::Progress;

use crate::blobs::digest_of;
use crate::error::{OciError, Result};
use crate::registry::{describe, parse_reference, Credentials, ErrorContext};

/// The media type of the manifests Crab pushes.
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// The media type of the configs Crab pushes.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";

/// Where to push.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// `[registry/]repository[:tag]` (no digest: a push names a tag).
    pub reference: String,
    /// Speak plain `http://` to this registry (loopback test registries).
    pub insecure: bool,
    /// Credentials.
    pub credentials: Credentials,
}

/// One blob to push.
#[derive(Debug, Clone)]
pub struct PushBlob {
    /// `sha256:…`.
    pub digest: String,
    /// Bytes.
    pub size: u64,
    /// Media type in the manifest.
    pub media_type: String,
}

/// A registry connection for one reference to push to.
pub struct Pusher {
    client: Client,
    reference: Reference,
    auth: RegistryAuth,
    opts: PushOptions,
}

impl std::fmt::Debug for Pusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pusher").field("opts", &self.opts).finish_non_exhaustive()
    }
}

/// The OCI media type for a layer blob's media type (Docker's name the same bytes).
pub fn oci_layer_type(media_type: &str) -> String {
    match media_type {
        "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
            "application/vnd.oci.image.layer.v1.tar+gzip".into()
        }
        "application/vnd.docker.image.rootfs.diff.tar" => {
            "application/vnd.oci.image.layer.v1.tar".into()
        }
        other => other.to_string(),
    }
}

/// An OCI image config of `defaults` with these layers' diff ids (bottom first); Docker's
/// `Shell`, which the OCI config does not define, is kept as `config.Shell` (as Docker writes
/// it; readers ignore fields they do not know). `created` is RFC 3339.
pub fn image_config(
    defaults: &ImageDefaults,
    diff_ids: &[String],
    created: &str,
) -> Result<Vec<u8>> {
    let bad =
        |e: oci_spec::OciSpecError| OciError::Invalid(format!("making the image config: {e}"));
    let mut cfg = ConfigBuilder::default();
    if !defaults.env.is_empty() {
        cfg = cfg.env(defaults.env.clone());
    }
    if let Some(w) = &defaults.workdir {
        cfg = cfg.working_dir(w.clone());
    }
    if let Some(u) = &defaults.user {
        cfg = cfg.user(u.clone());
    }
    if !defaults.entrypoint.is_empty() {
        cfg = cfg.entrypoint(defaults.entrypoint.clone());
    }
    if !defaults.cmd.is_empty() {
        cfg = cfg.cmd(defaults.cmd.clone());
    }
    if !defaults.labels.is_empty() {
        cfg = cfg.labels(
            defaults.labels.clone().into_iter().collect::<std::collections::HashMap<_, _>>(),
        );
    }
    if !defaults.exposed_ports.is_empty() {
        cfg = cfg.exposed_ports(defaults.exposed_ports.clone());
    }
    let history: Vec<_> = diff_ids
        .iter()
        .map(|_| {
            HistoryBuilder::default()
                .created(created.to_string())
                .created_by("crab image push".to_string())
                .build()
        })
        .collect::<std::result::Result<_, _>>()
        .map_err(bad)?;
    let c = ImageConfigurationBuilder::default()
        .created(created.to_string())
        .architecture(oci_spec::image::Arch::Amd64)
        .os(oci_spec::image::Os::Linux)
        .config(cfg.build().map_err(bad)?)
        .rootfs(
            RootFsBuilder::default()
                .typ("layers".to_string())
                .diff_ids(diff_ids.to_vec())
                .build()
                .map_err(bad)?,
        )
        .history(history)
        .build()
        .map_err(bad)?;
    let mut v = serde_json::to_value(&c)
        .map_err(|e| OciError::Invalid(format!("making the image config: {e}")))?;
    if !defaults.shell.is_empty() {
        if let Some(obj) = v.get_mut("config").and_then(|c| c.as_object_mut()) {
            obj.insert("Shell".into(), serde_json::json!(defaults.shell));
        }
    }
    serde_json::to_vec(&v).map_err(|e| OciError::Invalid(format!("making the image config: {e}")))
}

/// An OCI image manifest of a config and layers (bottom first).
pub fn image_manifest(config: &PushBlob, layers: &[PushBlob]) -> Result<Vec<u8>> {
    let bad = |e: oci_spec::OciSpecError| OciError::Invalid(format!("making the manifest: {e}"));
    let desc = |b: &PushBlob| -> Result<oci_spec::image::Descriptor> {
        let digest: oci_spec::image::Digest =
            b.digest.parse().map_err(|e| OciError::Invalid(format!("digest {}: {e}", b.digest)))?;
        DescriptorBuilder::default()
            .media_type(MediaType::from(b.media_type.as_str()))
            .digest(digest)
            .size(b.size)
            .build()
            .map_err(bad)
    };
    let m = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(desc(config)?)
        .layers(layers.iter().map(desc).collect::<Result<Vec<_>>>()?)
        .build()
        .map_err(bad)?;
    serde_json::to_vec(&m).map_err(|e| OciError::Invalid(format!("making the manifest: {e}")))
}

/// RFC 3339 UTC time of seconds since the epoch (`2026-12-04T14:00:00Z`).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, (rem % 3600) / 60, rem % 60)
}

impl Pusher {
    /// A client for `opts.reference` (refused when it names a digest: a push names a tag).
    pub fn new(opts: PushOptions) -> Result<Self> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let reference = parse_reference(&opts.reference)?;
        if reference.digest().is_some() {
            return Err(OciError::Invalid(format!(
                "{} names a digest; a push names a tag: [REGISTRY/]REPOSITORY[:TAG]",
                opts.reference
            )));
        }
        let (client, auth) = crate::registry::connect(&reference, opts.insecure, &opts.credentials);
        Ok(Pusher { client, reference, auth, opts })
    }

    /// The whole reference (`registry/repository:tag`).
    pub fn reference(&self) -> String {
        self.reference.whole()
    }

    fn error(&self, e: oci_client::errors::OciDistributionError, doing: &str) -> OciError {
        describe(
            e,
            &ErrorContext {
                reference: self.reference(),
                registry: self.reference.registry().to_string(),
                source: self.opts.credentials.source.clone(),
                insecure: self.opts.insecure,
                verb: "push",
            },
            doing,
        )
    }

    /// Sign in for pushing and make one request, so an unreachable registry or refused
    /// credentials are found before anything is prepared.
    pub async fn check(&self) -> Result<()> {
        for op in [RegistryOperation::Push, RegistryOperation::Pull] {
            self.client
                .auth(&self.reference, &self.auth, op)
                .await
                .map_err(|e| self.error(e, "signing in to push"))?;
        }
        self.has(&digest_of(b"")).await.map(|_| ())
    }

    /// Whether the repository already has blob `digest`.
    pub async fn has(&self, digest: &str) -> Result<bool> {
        self.client.blob_exists(&self.reference, digest).await.map_err(|e| self.error(e, "pushing"))
    }

    /// Upload small bytes (a config) as blob `digest` unless the registry has it; answers
    /// whether it was uploaded.
    pub async fn push_bytes(&self, digest: &str, bytes: Vec<u8>) -> Result<bool> {
        if self.has(digest).await? {
            return Ok(false);
        }
        self.client
            .push_blob(&self.reference, bytes, digest)
            .await
            .map_err(|e| self.error(e, "uploading the config of"))?;
        Ok(true)
    }

    /// Upload the file `path` as blob `b` unless the registry has it, streamed in chunks,
    /// `progress` advanced to `base` + the bytes sent; answers whether it was uploaded.
    pub async fn push_file(
        &self,
        b: &PushBlob,
        path: &Path,
        what: &str,
        base: u64,
        progress: &dyn Progress,
    ) -> Result<bool> {
        if self.has(&b.digest).await? {
            return Ok(false);
        }
        let f = tokio::fs::File::open(path).await.map_err(OciError::io("open", path))?;
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let size = b.size;
        let stream = futures_util::stream::try_unfold(f, move |mut f| {
            let counter = counter.clone();
            async move {
                let mut buf = vec![0u8; 4 << 20];
                let mut n = 0;
                while n < buf.len() {
                    let k = f.read(&mut buf[n..]).await?;
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                if n == 0 {
                    return Ok(None);
                }
                buf.truncate(n);
                let total = counter.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
                if total > size {
                    return Err(oci_client::errors::OciDistributionError::GenericError(Some(
                        "the blob's file grew while it was uploaded".into(),
                    )));
                }
                Ok(Some((bytes::Bytes::from(buf), f)))
            }
        });
        let upload = self.client.push_blob_stream(&self.reference, stream, &b.digest, Some(size));
        tokio::pin!(upload);
        let r = loop {
            tokio::select! {
                r = &mut upload => break r,
                _ = tokio::time::sleep(std::time::Duration::from_millis(500)) => {
                    progress.advance(base + sent.load(Ordering::Relaxed));
                }
            }
        };
        r.map_err(|e| self.error(e, &format!("uploading {what} ({}) of", b.digest)))?;
        progress.advance(base + size);
        Ok(true)
    }

    /// Put the manifest under the reference's tag; answers its digest.
    pub async fn push_manifest(&self, bytes: Vec<u8>) -> Result<String> {
        let digest = digest_of(&bytes);
        let ct = MANIFEST_MEDIA_TYPE
            .parse()
            .map_err(|e| OciError::Invalid(format!("manifest media type: {e}")))?;
        self.client
            .push_manifest_raw(&self.reference, bytes, ct)
            .await
            .map_err(|e| self.error(e, "putting the manifest of"))?;
        Ok(digest)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_400_000), "2026-12-04T16:00:00Z");
    }

    #[test]
    fn the_config_reads_back_as_the_same_defaults() {
        let d = ImageDefaults {
            env: vec!["A=b".into(), "PATH=/usr/bin".into()],
            workdir: Some("/app".into()),
            user: Some("1000:1000".into()),
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["echo hi".into()],
            labels: [("x".to_string(), "y".to_string())].into_iter().collect(),
            exposed_ports: vec!["8080/tcp".into()],
            shell: vec!["/bin/bash".into(), "-c".into()],
        };
        let ids = vec![digest_of(b"a"), digest_of(b"b")];
        let raw = image_config(&d, &ids, "2026-01-01T00:00:00Z").unwrap();
        let (back, back_ids) = crate::config::parse_config(&raw).unwrap();
        assert_eq!(back, d);
        assert_eq!(back_ids, ids);
        let cfg = PushBlob {
            digest: digest_of(&raw),
            size: raw.len() as u64,
            media_type: CONFIG_MEDIA_TYPE.into(),
        };
        let l = PushBlob {
            digest: digest_of(b"l"),
            size: 1,
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip".into(),
        };
        let m = image_manifest(&cfg, &[l]).unwrap();
        match crate::config::parse_document(&m).unwrap() {
            crate::config::Document::Manifest(m) => assert_eq!(m.layers().len(), 1),
            crate::config::Document::Index(_) => panic!("an index"),
        }
        assert!(Pusher::new(PushOptions {
            reference: format!("127.0.0.1:1/x@{}", digest_of(b"m")),
            insecure: true,
            credentials: Credentials::default(),
        })
        .is_err());
    }
}
