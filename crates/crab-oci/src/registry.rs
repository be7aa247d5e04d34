//! Pulling images from an OCI Distribution registry with the `oci-client` crate (its reqwest
//! over rustls with the *ring* provider): the manifest (an index resolved to one platform),
//! the config and the layers, each verified against its digest in the [`BlobStore`] before it
//! is used. Layers download in parallel (at most [`PARALLEL`] at once) with byte progress; a
//! blob already in the store is not downloaded again and a `.partial` one resumes with a range
//! request. Anonymous bearer tokens and basic auth (credentials given by the caller) are what
//! the client handles; `http://` is used only for a registry the caller names as insecure.
//! Everything the registry sends is hostile: sizes are bounded by the descriptors, digests
//! are checked, a descriptor's foreign `urls` are never followed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use futures_util::StreamExt;
use oci_client::client::{BlobResponse, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use oci_spec::image::{Descriptor, ImageConfiguration, ImageManifest};
use tokio::io::AsyncWriteExt;

use crab_common::api::ImageDefaults;
use crab_common::Progress;

use crate::blobs::{BlobStore, MAX_JSON};
use crate::config::{self, Document, INDEX_TYPES, MANIFEST_TYPES};
use crate::error::{OciError, Result};
use crate::{Image, Layer, Platform};

/// Layers downloaded at once.
pub const PARALLEL: usize = 4;

/// Config media types Crab reads.
const CONFIG_TYPES: &[&str] =
    &["application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"];

/// Credentials for a registry, and where they came from (named in a refusal).
#[derive(Clone, Default)]
pub struct Credentials {
    /// `(username, password)`, or anonymous.
    pub basic: Option<(String, String)>,
    /// Where they came from: `--username`, `~/.docker/config.json`, … (`None`: anonymous).
    pub source: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.basic.as_ref().map(|b| &b.0))
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// What to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// `[registry/]repository[:tag][@digest]`.
    pub reference: String,
    /// The platform to pick from an index; `None` is linux/amd64, and an image that is not an
    /// index is taken whatever its platform.
    pub platform: Option<Platform>,
    /// Speak plain `http://` to this registry (loopback test registries).
    pub insecure: bool,
    /// Credentials.
    pub credentials: Credentials,
}

/// An image's manifest and config, resolved (nothing downloaded but them).
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The whole reference (`registry/repository:tag`).
    pub reference: String,
    /// The digest of the platform's manifest.
    pub digest: String,
    /// The manifest.
    pub manifest: ImageManifest,
    /// The config's defaults.
    pub config: ImageDefaults,
    /// The config's diff ids, bottom first (as many as the manifest's layers).
    pub diff_ids: Vec<String>,
}

/// A registry connection for one reference.
pub struct Puller {
    client: Client,
    reference: Reference,
    auth: RegistryAuth,
    opts: PullOptions,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller").field("opts", &self.opts).finish_non_exhaustive()
    }
}

/// A client for `reference`'s registry (plain http only when `insecure`) and the auth to
/// present there: what pulls and pushes share.
pub(crate) fn connect(
    reference: &Reference,
    insecure: bool,
    credentials: &Credentials,
) -> (Client, RegistryAuth) {
    let protocol = if insecure {
        ClientProtocol::HttpsExcept(vec![reference.resolve_registry().to_string()])
    } else {
        ClientProtocol::Https
    };
    let client = Client::new(ClientConfig {
        protocol,
        platform_resolver: None,
        connect_timeout: Some(std::time::Duration::from_secs(30)),
        read_timeout: Some(std::time::Duration::from_secs(120)),
        ..Default::default()
    });
    let auth = match &credentials.basic {
        Some((u, p)) => RegistryAuth::Basic(u.clone(), p.clone()),
        None => RegistryAuth::Anonymous,
    };
    (client, auth)
}

/// Parse a reference (`debian:bookworm`, `localhost:5000/a/b:t`, `…@sha256:…`).
pub fn parse_reference(s: &str) -> Result<Reference> {
    Reference::try_from(s).map_err(|e| {
        OciError::Invalid(format!(
            "{s:?} is not an image reference ({e}); write [REGISTRY/]REPOSITORY[:TAG][@DIGEST], \
             e.g. docker.io/library/debian:bookworm or 127.0.0.1:5000/app:1"
        ))
    })
}

/// The image name a pull of `reference` gets by default: the repository's last component,
/// `-`, the tag (or the digest's first 12 hex digits), made to fit image-name rules.
pub fn default_name(reference: &str) -> Result<String> {
    let r = parse_reference(reference)?;
    let last = r.repository().rsplit('/').next().unwrap_or("image");
    let suffix = match (r.tag(), r.digest()) {
        (Some(t), _) => t.to_string(),
        (None, Some(d)) => d.trim_start_matches("sha256:").chars().take(12).collect(),
        (None, None) => "latest".into(),
    };
    let mut n: String = format!("{last}-{suffix}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '-' })
        .collect();
    while n.starts_with(|c: char| !c.is_ascii_alphanumeric()) {
        n.remove(0);
    }
    n.truncate(crab_common::names::MAX_NAME_LEN);
    if n.is_empty() {
        n = "image".into();
    }
    Ok(n)
}

impl Puller {
    /// A client for `opts.reference`.
    pub fn new(opts: PullOptions) -> Result<Self> {
        // reqwest's rustls has no provider of its own here: the workspace's ring one, once
        // per process (a second install is refused, harmlessly).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let reference = parse_reference(&opts.reference)?;
        let (client, auth) = connect(&reference, opts.insecure, &opts.credentials);
        Ok(Puller { client, reference, auth, opts })
    }

    /// The whole reference (`registry/repository:tag`).
    pub fn reference(&self) -> String {
        self.reference.whole()
    }

    fn registry(&self) -> &str {
        self.reference.registry()
    }

    /// Authenticate (a bearer token, or basic credentials remembered), then read the manifest
    /// (resolving an index to the platform) and the config into `store`.
    pub async fn resolve(&self, store: &BlobStore) -> Result<Resolved> {
        self.client
            .auth(&self.reference, &self.auth, RegistryOperation::Pull)
            .await
            .map_err(|e| self.error(e, "signing in to"))?;
        let accept: Vec<&str> = MANIFEST_TYPES.iter().chain(INDEX_TYPES).copied().collect();
        let (mut bytes, mut digest) = self.manifest(&self.reference, &accept).await?;
        store.put_bytes(&digest, &bytes, "manifest")?;
        let manifest = match config::parse_document(&bytes)? {
            Document::Manifest(m) => *m,
            Document::Index(i) => {
                let want = self.opts.platform.clone().unwrap_or_default();
                let d = config::pick_platform(&i, &want)?.digest().to_string();
                crate::blobs::sha256_hex(&d)?;
                let r = self.reference.clone_with_digest(d.clone());
                (bytes, digest) = self.manifest(&r, MANIFEST_TYPES).await?;
                if digest != d {
                    return Err(OciError::Digest { what: "manifest".into(), want: d, got: digest });
                }
                store.put_bytes(&digest, &bytes, "manifest")?;
                match config::parse_document(&bytes)? {
                    Document::Manifest(m) => *m,
                    Document::Index(_) => {
                        return Err(OciError::Invalid(format!(
                            "{}: the index's {want} entry is another index; Crab reads one level",
                            self.reference()
                        )))
                    }
                }
            }
        };
        let cd = manifest.config();
        let ct = cd.media_type().to_string();
        if !CONFIG_TYPES.contains(&ct.as_str()) {
            return Err(OciError::Invalid(format!(
                "{}: the config has media type {ct}, which is not an image config (an artifact \
                 cannot be run)",
                self.reference()
            )));
        }
        if cd.size() > MAX_JSON {
            return Err(OciError::Invalid(format!(
                "{}: the config is {} bytes, more than any image config",
                self.reference(),
                cd.size()
            )));
        }
        let counter = Counter::default();
        let path =
            self.blob(cd, "config".into(), store, &counter, &crab_common::NoProgress).await?;
        let raw = crate::blobs::read_bounded(&path, MAX_JSON)?;
        let (defaults, diff_ids) = config::parse_config(&raw)?;
        if let Some(want) = &self.opts.platform {
            let c: ImageConfiguration = serde_json::from_slice(&raw)
                .map_err(|e| OciError::Invalid(format!("the image config is malformed: {e}")))?;
            let (os, arch) = (c.os().to_string(), c.architecture().to_string());
            if os != want.os || arch != want.arch {
                return Err(OciError::Platform {
                    wanted: want.to_string(),
                    have: format!("{os}/{arch}"),
                });
            }
        }
        if diff_ids.len() != manifest.layers().len() {
            return Err(OciError::Invalid(format!(
                "{}: the manifest lists {} layers but the config's rootfs.diff_ids has {}; the \
                 image is malformed",
                self.reference(),
                manifest.layers().len(),
                diff_ids.len()
            )));
        }
        Ok(Resolved { reference: self.reference(), digest, manifest, config: defaults, diff_ids })
    }

    /// Download the layers of a resolved image that `store` lacks ([`PARALLEL`] at once,
    /// `progress` counting bytes) and answer the image.
    pub async fn fetch(
        &self,
        r: &Resolved,
        store: &BlobStore,
        progress: &dyn Progress,
    ) -> Result<Image> {
        let layers = r.manifest.layers();
        let missing: u64 =
            layers.iter().filter(|l| !store.has(l.digest().as_ref())).map(|l| l.size()).sum();
        let n = layers.len();
        let cached = layers.iter().filter(|l| store.has(l.digest().as_ref())).count();
        progress.message(&format!(
            "{} layer(s), {cached} already here, {} to download",
            n,
            human(missing)
        ));
        progress.stage("download", Some(missing));
        let counter = Counter::default();
        // The futures collected first (a stream's `map` closure in the future's type makes it
        // not `Send` for every lifetime).
        let mut downloads = Vec::with_capacity(n);
        for (i, d) in layers.iter().enumerate() {
            downloads.push(self.blob(d, format!("layer {}/{n}", i + 1), store, &counter, progress));
        }
        // Every download runs to its end before a failure is answered: the layers that could
        // be finished are, and the next pull does not fetch them again.
        let results: Vec<Result<PathBuf>> =
            futures_util::stream::iter(downloads).buffered(PARALLEL).collect().await;
        let paths = results.into_iter().collect::<Result<Vec<PathBuf>>>()?;
        progress.advance(counter.done.load(Ordering::Relaxed));
        Ok(Image {
            reference: Some(r.reference.clone()),
            digest: r.digest.clone(),
            config: r.config.clone(),
            layers: layers
                .iter()
                .zip(&r.diff_ids)
                .zip(paths)
                .map(|((d, diff), path)| Layer {
                    digest: d.digest().to_string(),
                    diff_id: diff.clone(),
                    media_type: d.media_type().to_string(),
                    path,
                })
                .collect(),
        })
    }

    /// A manifest's bytes and digest (checked by the client against the reference's digest
    /// or the registry's header), bounded.
    async fn manifest(&self, r: &Reference, accept: &[&str]) -> Result<(Vec<u8>, String)> {
        let (bytes, digest) = self
            .client
            .pull_manifest_raw(r, &self.auth, accept)
            .await
            .map_err(|e| self.error(e, "reading the manifest of"))?;
        if bytes.len() as u64 > MAX_JSON {
            return Err(OciError::Invalid(format!(
                "{}: the manifest is {} bytes, more than any manifest",
                self.reference(),
                bytes.len()
            )));
        }
        Ok((bytes.to_vec(), digest))
    }

    /// One blob into the store (unless there), resumed from its `.partial`; verified.
    async fn blob(
        &self,
        d: &Descriptor,
        what: String,
        store: &BlobStore,
        counter: &Counter,
        progress: &dyn Progress,
    ) -> Result<PathBuf> {
        let digest = d.digest().to_string();
        if store.has(&digest) {
            return store.path(&digest);
        }
        let size = d.size();
        for attempt in 0..2 {
            let (f, mut have) = store.open_partial(&digest)?;
            let ppath = store.partial(&digest)?;
            if have > size || attempt > 0 {
                f.set_len(0).map_err(OciError::io("truncate", &ppath))?;
                have = 0;
            }
            let resumed = have;
            counter.add(have, progress);
            if have < size {
                if have > 0 {
                    progress.message(&format!("{what}: resuming at byte {have} of {size}"));
                }
                let desc = OciDescriptor {
                    media_type: d.media_type().to_string(),
                    digest: digest.clone(),
                    size: i64::try_from(size).unwrap_or(i64::MAX),
                    // Foreign URLs are never followed.
                    urls: None,
                    annotations: None,
                    artifact_type: None,
                };
                let resp = self
                    .client
                    .pull_blob_stream_partial(&self.reference, &desc, have, None)
                    .await
                    .map_err(|e| self.error(e, &format!("downloading {what} ({digest}) of")))?;
                let mut stream = match resp {
                    BlobResponse::Partial(s) => s,
                    BlobResponse::Full(s) => {
                        // No range support: from the start.
                        counter.sub(have);
                        f.set_len(0).map_err(OciError::io("truncate", &ppath))?;
                        have = 0;
                        s
                    }
                };
                let mut out = tokio::fs::File::from_std(f);
                let mut cut = None;
                while let Some(chunk) = stream.next().await {
                    let chunk = match chunk {
                        Ok(c) => c,
                        Err(e) => {
                            cut = Some(e);
                            break;
                        }
                    };
                    if have + chunk.len() as u64 > size {
                        drop(out);
                        let _ = std::fs::remove_file(&ppath);
                        return Err(OciError::Invalid(format!(
                            "{}: {what} ({digest}) is larger than the {size} bytes its \
                             descriptor says; the registry or the image is corrupt",
                            self.reference()
                        )));
                    }
                    out.write_all(&chunk).await.map_err(OciError::io("write", &ppath))?;
                    have += chunk.len() as u64;
                    counter.add(chunk.len() as u64, progress);
                }
                out.flush().await.map_err(OciError::io("write", &ppath))?;
                drop(out);
                if have < size {
                    let why =
                        cut.map(|e| e.to_string()).unwrap_or_else(|| "the stream ended".into());
                    return Err(OciError::Registry {
                        message: format!(
                            "downloading {what} ({digest}) of {} from {} was cut off at byte \
                             {have} of {size}: {why}",
                            self.reference(),
                            self.registry()
                        ),
                        hint: "pull again: finished blobs are kept and this one resumes".into(),
                        auth: false,
                    });
                }
            }
            match store.commit_partial(&digest, &what) {
                Ok(p) => return Ok(p),
                // A resumed download may have joined two versions of a partial: once more
                // from the start.
                Err(OciError::Digest { .. }) if resumed > 0 && attempt == 0 => {
                    counter.sub(size);
                    progress.message(&format!("{what}: resumed bytes did not check out, again"));
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        Err(OciError::Invalid(format!("{what} ({digest}) could not be downloaded")))
    }

    /// An `oci-client` error as an [`OciError`] naming the reference, the registry and what
    /// to do.
    fn error(&self, e: OciDistributionError, doing: &str) -> OciError {
        describe(
            e,
            &ErrorContext {
                reference: self.reference(),
                registry: self.registry().to_string(),
                source: self.opts.credentials.source.clone(),
                insecure: self.opts.insecure,
                verb: "pull",
            },
            doing,
        )
    }
}

/// What an error message names: the reference, the registry, where credentials came from,
/// and which command (`pull`, `push`) its hints suggest.
pub(crate) struct ErrorContext {
    pub reference: String,
    pub registry: String,
    pub source: Option<String>,
    pub insecure: bool,
    pub verb: &'static str,
}

/// An `oci-client` error as an [`OciError`] naming the reference, the registry and what to do.
pub(crate) fn describe(e: OciDistributionError, cx: &ErrorContext, doing: &str) -> OciError {
    let reference = cx.reference.clone();
    let registry = cx.registry.clone();
    let verb = cx.verb;
    let creds = match &cx.source {
        Some(s) => format!("credentials from {s}"),
        None => "no credentials (anonymous)".to_string(),
    };
    let auth_hint = if cx.source.is_some() {
        format!(
            "check the username and password (`crab image {verb} --username U \
             --password-stdin`, or `docker login` for ~/.docker/config.json)"
        )
    } else {
        format!(
            "give credentials: `crab image {verb} --username U --password-stdin …`, or \
             `docker login {registry}` (read from ~/.docker/config.json)"
        )
    };
    let refused = |why: String| OciError::Registry {
        message: format!("registry {registry} refused {doing} {reference}: {why} ({creds})"),
        hint: auth_hint.clone(),
        auth: true,
    };
    let unknown = |why: String| OciError::Registry {
        message: format!("{reference}: no such image or tag in registry {registry} ({why})"),
        hint: "check the repository and tag (`skopeo list-tags docker://REPOSITORY` lists tags)"
            .into(),
        auth: false,
    };
    let other = |why: String| OciError::Registry {
        message: format!("{doing} {reference} at {registry} failed: {why}"),
        hint: format!("check the reference and the registry; `crab image {verb}` again resumes"),
        auth: false,
    };
    match e {
        OciDistributionError::UnauthorizedError { .. } => refused("not authorized".into()),
        OciDistributionError::AuthenticationFailure(m) => {
            refused(format!("authentication failed: {}", m.trim()))
        }
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|x| &x.code).collect();
            if codes.iter().any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                refused(envelope.to_string())
            } else if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::NotFound
                        | OciErrorCode::BlobUnknown
                )
            }) {
                unknown(envelope.to_string())
            } else {
                other(envelope.to_string())
            }
        }
        OciDistributionError::ServerError { code: 401 | 403, message, .. } => {
            refused(format!("HTTP 40x: {}", message.trim()))
        }
        OciDistributionError::ServerError { code: 404, .. }
        | OciDistributionError::ImageManifestNotFoundError(_) => unknown("HTTP 404".into()),
        OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
            expected,
            actual,
        }) => OciError::Digest {
            what: format!("manifest of {reference}"),
            want: expected,
            got: actual,
        },
        OciDistributionError::RequestError(re) => {
            if let Some(st) = re.status() {
                if st.as_u16() == 401 || st.as_u16() == 403 {
                    return refused(format!("HTTP {st}"));
                }
            }
            let mut chain = re.to_string();
            let mut src = std::error::Error::source(&re);
            while let Some(s) = src {
                chain.push_str(": ");
                chain.push_str(&s.to_string());
                src = s.source();
            }
            let tls_to_plain = !cx.insecure
                && (chain.contains("InvalidContentType")
                    || chain.contains("corrupt message")
                    || chain.contains("record overflow")
                    || chain.contains("HTTP/1"));
            if tls_to_plain {
                OciError::Registry {
                    message: format!(
                        "registry {registry} did not answer TLS while {doing} {reference} \
                         ({chain}); it seems to serve plain http"
                    ),
                    hint: format!(
                        "a registry without TLS (a loopback test registry) must be named: \
                         `crab image {verb} --insecure …`"
                    ),
                    auth: false,
                }
            } else if re.is_connect() || re.is_timeout() {
                OciError::Registry {
                    message: format!(
                        "registry {registry} is unreachable while {doing} {reference}: {chain}"
                    ),
                    hint: "check the registry's address and the network; a registry serving \
                           plain http must be named with --insecure"
                        .into(),
                    auth: false,
                }
            } else {
                other(chain)
            }
        }
        e => other(e.to_string()),
    }
}

/// `12.3 MB`.
fn human(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20))
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

/// Bytes done over every parallel download, reported to a [`Progress`] now and then.
#[derive(Debug, Default)]
struct Counter {
    done: AtomicU64,
    last: Mutex<u64>,
}

impl Counter {
    fn add(&self, n: u64, progress: &dyn Progress) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if done >= *last + (1 << 20) {
            *last = done;
            progress.advance(done);
        }
    }

    fn sub(&self, n: u64) {
        let _ = self
            .done
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| Some(d.saturating_sub(n)));
    }
}

/// Pull `opts.reference` into `store`: [`Puller::resolve`] then [`Puller::fetch`].
pub async fn pull(opts: PullOptions, store: &BlobStore, progress: &dyn Progress) -> Result<Image> {
    let p = Puller::new(opts)?;
    progress.stage("manifest", None);
    let r = p.resolve(store).await?;
    p.fetch(&r, store, progress).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn default_names_fit_the_rules() {
        assert_eq!(default_name("debian:bookworm").unwrap(), "debian-bookworm");
        assert_eq!(default_name("127.0.0.1:5000/a/b/app:1.2").unwrap(), "app-1.2");
        assert_eq!(default_name("python").unwrap(), "python-latest");
        let d = format!("x@sha256:{}", "ab".repeat(32));
        assert_eq!(default_name(&d).unwrap(), "x-abababababab");
        for r in ["debian:bookworm", "a/b__c:t_1"] {
            crab_common::names::validate("image", &default_name(r).unwrap()).unwrap();
        }
        assert!(parse_reference("UPPER/case:x y").is_err());
    }
}
