//! The repository: opening a `file://` or `s3://` object store, the config, the in-memory
//! index, packing new blobs, locks, reading blobs through the local cache, and listing points.
//!
//! Every byte read back from the remote is checked before use: framed objects by their BLAKE3
//! trailer, blobs by their id (the hash of their plaintext) after decompression bounded by
//! the index's length, pack ranges by their length. A failure names the remote object.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::crypto::{random_bytes, Key};
use crate::error::{RemoteError, Result};
use crate::format::{
    frame, unframe, BlobKind, ChunkerParams, Config, EncryptionInfo, IndexEntry, IndexFile,
    LockRecord, PointRecord, MAX_BLOB,
};
use crate::id::Id;
use crate::tree::WALK_HINT_MAX;

/// A pack is cut once it holds this many stored bytes.
pub const PACK_TARGET: usize = 8 * 1024 * 1024;
/// Unwanted bytes between two wanted blobs of a pack above which they are fetched apart.
pub const PREFETCH_GAP: u64 = 1 << 20;
/// The same for trees fetched ahead ([`Repo::prefetch_trees`]): a few small trees scattered
/// among an image's packs are read apart, not with the file content between them.
pub const TREE_GAP: u64 = 64 << 10;
/// Ranged reads in flight at once while prefetching.
pub const PREFETCH_PARALLEL: usize = 8;
/// Most bytes of trees a point record's walk hint fetches ([`Repo::prefetch_trees`]).
pub const WALK_HINT_BYTES: u64 = 64 << 20;
/// A lock older than this is ignored (its holder is presumed dead).
pub const LOCK_STALE_MS: u64 = 3600 * 1000;

/// How to open a repository.
#[derive(Debug, Clone)]
pub struct RepoOptions {
    /// Key file for encryption at rest (required to open an encrypted repository; given when
    /// creating one, makes it encrypted).
    pub key_file: Option<PathBuf>,
    /// Local blob cache (blobs by id, as stored; verified on every read).
    pub cache_dir: PathBuf,
    /// Upload bandwidth limit, bytes per second (`None`: unlimited).
    pub bandwidth_bps: Option<u64>,
}

pub(crate) use crab_common::clock::now_ms;

use crab_common::sync::lock;

#[derive(Debug, Default)]
struct IndexState {
    /// Index object name → its entries.
    files: HashMap<String, Vec<IndexEntry>>,
    /// Blob id → where it is.
    blobs: HashMap<Id, IndexEntry>,
}

impl IndexState {
    fn rebuild(&mut self) {
        self.blobs.clear();
        for entries in self.files.values() {
            for e in entries {
                self.blobs.insert(e.id, e.clone());
            }
        }
    }
}

/// A held repository lock (release with [`Repo::unlock`]).
#[derive(Debug)]
pub struct LockGuard {
    name: String,
}

/// A content-addressed repository on an object store.
#[derive(Debug)]
pub struct Repo {
    pub(crate) config: Config,
    bandwidth_bps: Option<u64>,
    throttle_next: Mutex<Option<Instant>>,
    index: Mutex<IndexState>,
    /// Chunk lists of files exported before, by path, inode, size, mtime and ctime.
    pub(crate) file_cache: Mutex<HashMap<crate::tree::FileKey, crate::format::Content>>,
    /// Root trees of immutable parts exported before (see `Repo::export_part`), by path and
    /// root ctime, with their logical size.
    pub(crate) part_cache: Mutex<HashMap<(PathBuf, i64), (Id, u64)>>,
    /// Whether the two caches above gained entries since they were last saved
    /// (`crate::cache`: they outlive the daemon in `<cache>/export-cache.json`).
    pub(crate) cache_dirty: std::sync::atomic::AtomicBool,
    /// The store, its key and the local caches (every read and write goes through these;
    /// a download task of its own gets a clone).
    fetcher: Fetcher,
}

/// The store, its key and the local caches, owned: a download that feeds writes runs as a task
/// of its own beside them (`Repo::feed` in `tree.rs`) with a clone.
#[derive(Debug, Clone)]
pub(crate) struct Fetcher {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    key: Option<Key>,
    cache_dir: PathBuf,
    /// Blobs [`Repo::prefetch`] just downloaded, decoded and verified, held for the read that
    /// asks for them so it neither reads them back from the cache nor decodes them twice.
    hot: Arc<Mutex<HotBlobs>>,
    /// Blobs downloaded from the store (not served by a cache) since the repository opened.
    downloaded: Arc<std::sync::atomic::AtomicU64>,
    /// Of those, tree blobs.
    trees_downloaded: Arc<std::sync::atomic::AtomicU64>,
}

/// Runs of wanted blobs, each one ranged read of a pack.
pub(crate) type Runs = Vec<(Id, Vec<IndexEntry>)>;

/// Plaintext of prefetched blobs; each is taken by its first read, at most [`HOT_MAX`]
/// bytes are held, and [`Repo::drop_prefetched`] forgets what no read took.
#[derive(Debug, Default)]
struct HotBlobs {
    bytes: usize,
    blobs: HashMap<Id, Vec<u8>>,
}

/// Bytes of decoded blobs held between a prefetch and the reads it serves.
const HOT_MAX: usize = 256 << 20;

fn open_store(url: &str) -> Result<(Arc<dyn ObjectStore>, String)> {
    let bad =
        |reason: &str| RemoteError::BadUrl { url: url.to_string(), reason: reason.to_string() };
    let parsed = url::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    match parsed.scheme() {
        "file" => {
            let dir = parsed.to_file_path().map_err(|()| bad("not an absolute local path"))?;
            std::fs::create_dir_all(&dir)
                .map_err(RemoteError::io("create remote directory", &dir))?;
            let store =
                object_store::local::LocalFileSystem::new_with_prefix(&dir).map_err(|e| {
                    RemoteError::Store {
                        remote: url.into(),
                        op: "open",
                        object: dir.display().to_string(),
                        source: Box::new(e),
                    }
                })?;
            Ok((Arc::new(store), String::new()))
        }
        "s3" => {
            let bucket =
                parsed.host_str().filter(|b| !b.is_empty()).ok_or_else(|| bad("no bucket"))?;
            let mut b = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
            let endpoint =
                std::env::var("AWS_ENDPOINT_URL").or_else(|_| std::env::var("AWS_ENDPOINT")).ok();
            if let Some(ep) = endpoint {
                if ep.starts_with("http://") {
                    b = b.with_allow_http(true);
                }
                b = b.with_endpoint(ep);
            }
            let store = b.build().map_err(|e| RemoteError::Store {
                remote: url.into(),
                op: "open",
                object: bucket.into(),
                source: Box::new(e),
            })?;
            let prefix = parsed.path().trim_matches('/').to_string();
            Ok((Arc::new(store), prefix))
        }
        other => Err(bad(&format!("scheme {other:?} is not supported"))),
    }
}

impl Repo {
    /// Open the repository at `url`, creating it (its `config`) if it does not exist.
    pub async fn open(url: &str, opts: RepoOptions) -> Result<Repo> {
        let (store, prefix) = open_store(url)?;
        let key = opts.key_file.as_deref().map(Key::load).transpose()?;
        std::fs::create_dir_all(&opts.cache_dir)
            .map_err(RemoteError::io("create cache directory", &opts.cache_dir))?;
        let fetcher = Fetcher {
            store,
            prefix,
            url: url.to_string(),
            key,
            cache_dir: opts.cache_dir,
            hot: Arc::new(Mutex::new(HotBlobs::default())),
            downloaded: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            trees_downloaded: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        let mut repo = Repo {
            config: Config {
                repo_id: String::new(),
                created_at_ms: 0,
                chunker: ChunkerParams::default(),
                zstd_level: 3,
                encryption: None,
            },
            bandwidth_bps: opts.bandwidth_bps.filter(|&b| b > 0),
            throttle_next: Mutex::new(None),
            index: Mutex::new(IndexState::default()),
            file_cache: Mutex::new(HashMap::new()),
            part_cache: Mutex::new(HashMap::new()),
            cache_dirty: std::sync::atomic::AtomicBool::new(false),
            fetcher,
        };
        let config = match repo.read_config().await? {
            Some(c) => c,
            None => {
                let c = Config {
                    repo_id: hex::encode(random_bytes::<16>()?),
                    created_at_ms: now_ms(),
                    chunker: ChunkerParams::default(),
                    zstd_level: 3,
                    encryption: repo.fetcher.key.as_ref().map(|k| EncryptionInfo {
                        cipher: "xchacha20poly1305".into(),
                        key_check: k.check_value(),
                    }),
                };
                let body = serde_json::to_vec_pretty(&c)
                    .map_err(|e| RemoteError::corrupt("config", e.to_string()))?;
                // Create-only: of two hosts initializing at once, both use the first config.
                if repo.put("config", frame("config", &body), PutMode::Create).await? {
                    tracing::info!(url, repo_id = %c.repo_id, encrypted = c.encryption.is_some(), "created remote repository");
                    c
                } else {
                    repo.read_config().await?.ok_or_else(|| RemoteError::Missing {
                        object: repo.object_name("config"),
                        what: "it existed a moment ago".into(),
                    })?
                }
            }
        };
        let c = &config.chunker;
        if c.min == 0 || c.min > c.avg || c.avg > c.max || u64::from(c.max) > MAX_BLOB {
            return Err(RemoteError::corrupt(
                repo.object_name("config"),
                format!("chunker parameters {c:?}"),
            ));
        }
        match (&config.encryption, &repo.fetcher.key) {
            (None, None) => {}
            (Some(_), None) => {
                return Err(RemoteError::Key(format!(
                    "{url} is encrypted: pass its key file (--remote-key FILE)"
                )))
            }
            (None, Some(_)) => {
                return Err(RemoteError::Key(format!("{url} is not encrypted: drop --remote-key")))
            }
            (Some(info), Some(k)) => {
                if info.key_check != k.check_value() {
                    return Err(RemoteError::Key(format!("the key file is not the key of {url}")));
                }
            }
        }
        repo.config = config;
        repo.load_export_cache();
        Ok(repo)
    }

    async fn read_config(&self) -> Result<Option<Config>> {
        let Some(bytes) = self.get_opt("config").await? else { return Ok(None) };
        let payload = unframe("config", &bytes, &self.object_name("config"))?;
        serde_json::from_slice(payload)
            .map(Some)
            .map_err(|e| RemoteError::corrupt(self.object_name("config"), format!("JSON: {e}")))
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.fetcher.url
    }

    /// The local blob cache directory.
    pub fn cache_dir(&self) -> &std::path::Path {
        &self.fetcher.cache_dir
    }

    /// The repository's config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn object_name(&self, rel: &str) -> String {
        object_name(&self.fetcher.prefix, rel)
    }

    fn path(&self, rel: &str) -> Path {
        Path::from(self.object_name(rel))
    }

    fn store_err(
        &self,
        op: &'static str,
        rel: &str,
    ) -> impl FnOnce(object_store::Error) -> RemoteError + '_ {
        let object = self.object_name(rel);
        move |source| RemoteError::Store {
            remote: self.fetcher.url.clone(),
            op,
            object,
            source: Box::new(source),
        }
    }

    async fn throttle(&self, n: usize) {
        let Some(bps) = self.bandwidth_bps else { return };
        let wait = {
            let mut next = lock(&self.throttle_next);
            let now = Instant::now();
            let start = next.map_or(now, |t| t.max(now));
            *next = Some(start + Duration::from_secs_f64(n as f64 / bps as f64));
            start.saturating_duration_since(now)
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Put `bytes` at `rel`. With `PutMode::Create`, returns false when it already existed.
    pub(crate) async fn put(&self, rel: &str, bytes: Vec<u8>, mode: PutMode) -> Result<bool> {
        self.throttle(bytes.len()).await;
        let opts = PutOptions { mode, ..Default::default() };
        match self.fetcher.store.put_opts(&self.path(rel), PutPayload::from(bytes), opts).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(self.store_err("put", rel)(e)),
        }
    }

    pub(crate) async fn get_opt(&self, rel: &str) -> Result<Option<Bytes>> {
        match self.fetcher.store.get(&self.path(rel)).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(self.store_err("get", rel))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.store_err("get", rel)(e)),
        }
    }

    pub(crate) async fn get(&self, rel: &str, what: &str) -> Result<Bytes> {
        self.get_opt(rel).await?.ok_or_else(|| RemoteError::Missing {
            object: self.object_name(rel),
            what: what.to_string(),
        })
    }

    pub(crate) async fn delete(&self, rel: &str) -> Result<()> {
        match self.fetcher.store.delete(&self.path(rel)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.store_err("delete", rel)(e)),
        }
    }

    /// Object names (relative to the repository) under `dir`, with their sizes.
    pub(crate) async fn list(&self, dir: &str) -> Result<Vec<(String, u64)>> {
        Ok(self.list_meta(dir).await?.into_iter().map(|(n, size, _)| (n, size)).collect())
    }

    /// Objects under `dir`, sorted by name: name, size and when the store last wrote it.
    async fn list_meta(&self, dir: &str) -> Result<Vec<(String, u64, i64)>> {
        let base = self.object_name(dir);
        let metas: Vec<object_store::ObjectMeta> = self
            .fetcher
            .store
            .list(Some(&Path::from(base)))
            .try_collect()
            .await
            .map_err(self.store_err("list", dir))?;
        let strip = if self.fetcher.prefix.is_empty() { 0 } else { self.fetcher.prefix.len() + 1 };
        let mut out: Vec<(String, u64, i64)> = metas
            .into_iter()
            .map(|m| {
                let name = m.location.as_ref()[strip..].to_string();
                (name, m.size, m.last_modified.timestamp_millis())
            })
            .collect();
        out.sort();
        Ok(out)
    }

    pub(crate) fn seal_meta<T: Serialize>(&self, kind: &str, body: &T) -> Result<Vec<u8>> {
        let json = serde_json::to_vec_pretty(body)
            .map_err(|e| RemoteError::corrupt(kind, format!("encode: {e}")))?;
        let payload = match &self.fetcher.key {
            Some(k) => k.seal(&json)?,
            None => json,
        };
        Ok(frame(kind, &payload))
    }

    pub(crate) fn open_meta<T: DeserializeOwned>(
        &self,
        kind: &str,
        bytes: &[u8],
        rel: &str,
    ) -> Result<T> {
        let object = self.object_name(rel);
        let payload = unframe(kind, bytes, &object)?;
        let plain;
        let json = match &self.fetcher.key {
            Some(k) => {
                plain = k.open(payload, &object)?;
                &plain[..]
            }
            None => payload,
        };
        serde_json::from_slice(json).map_err(|e| RemoteError::corrupt(object, format!("JSON: {e}")))
    }

    /// The id a blob with this plaintext has in this repository.
    pub(crate) fn blob_id(&self, plain: &[u8]) -> Id {
        blob_id_with(self.fetcher.key.as_ref(), plain)
    }

    pub(crate) fn encode_blob(&self, plain: &[u8]) -> Result<Vec<u8>> {
        let z = zstd::bulk::compress(plain, self.config.zstd_level).map_err(|e| {
            RemoteError::Io { op: "zstd compress", path: PathBuf::new(), source: e }
        })?;
        match &self.fetcher.key {
            Some(k) => k.seal(&z),
            None => Ok(z),
        }
    }

    /// Decode a stored blob and check it is blob `e.id`.
    pub(crate) fn decode_blob(
        &self,
        e: &IndexEntry,
        stored: &[u8],
        object: &str,
    ) -> Result<Vec<u8>> {
        decode_with(self.fetcher.key.as_ref(), e, stored, object)
    }

    // ---- index ----

    /// Load index objects written since the last refresh; forget those deleted (by a prune).
    pub async fn refresh_index(&self) -> Result<()> {
        let names: Vec<String> = self.list("index").await?.into_iter().map(|(n, _)| n).collect();
        let known: HashSet<String> = lock(&self.index).files.keys().cloned().collect();
        let wanted: Vec<String> = names.iter().filter(|n| !known.contains(*n)).cloned().collect();
        let mut fetches = futures::stream::iter(wanted.into_iter().map(|name| async move {
            let bytes = self.get(&name, "index").await?;
            let file: IndexFile = self.open_meta("index", &bytes, &name)?;
            for e in &file.blobs {
                if e.length > MAX_BLOB * 2 || e.raw_length > MAX_BLOB {
                    return Err(RemoteError::corrupt(
                        self.object_name(&name),
                        format!("blob {} is too large", e.id),
                    ));
                }
            }
            Ok((name, file.blobs))
        }))
        .buffer_unordered(PREFETCH_PARALLEL);
        let mut new = Vec::new();
        while let Some(r) = fetches.next().await {
            new.push(r?);
        }
        drop(fetches);
        let live: HashSet<&String> = names.iter().collect();
        let mut st = lock(&self.index);
        st.files.retain(|n, _| live.contains(n));
        st.files.extend(new);
        st.rebuild();
        Ok(())
    }

    pub(crate) fn lookup(&self, id: &Id) -> Option<IndexEntry> {
        lock(&self.index).blobs.get(id).cloned()
    }

    pub(crate) fn index_snapshot(
        &self,
    ) -> (HashMap<String, Vec<IndexEntry>>, HashMap<Id, IndexEntry>) {
        let st = lock(&self.index);
        (st.files.clone(), st.blobs.clone())
    }

    pub(crate) fn add_index_file(&self, name: String, entries: Vec<IndexEntry>) {
        let mut st = lock(&self.index);
        for e in &entries {
            st.blobs.insert(e.id, e.clone());
        }
        st.files.insert(name, entries);
    }

    /// Write an index object for `entries`; returns its name and size.
    pub(crate) async fn write_index(&self, entries: Vec<IndexEntry>) -> Result<(String, u64)> {
        let bytes = self.seal_meta("index", &IndexFile { blobs: entries.clone() })?;
        let name = format!("index/{}", Id::of(&bytes));
        let n = bytes.len() as u64;
        self.put(&name, bytes, PutMode::Create).await?;
        self.add_index_file(name.clone(), entries);
        Ok((name, n))
    }

    // ---- blobs through the cache ----

    fn cache_path(&self, id: &Id) -> PathBuf {
        cache_path(&self.fetcher.cache_dir, id)
    }

    /// The downloads' handle (cloned by a download task of its own).
    pub(crate) fn fetcher(&self) -> &Fetcher {
        &self.fetcher
    }

    /// Blob `id`, from the local cache or its pack. `what` says who needs it (for errors).
    pub(crate) async fn blob(&self, id: &Id, what: &str) -> Result<Vec<u8>> {
        if let Some(plain) = self.hot_blob(id) {
            return Ok(plain);
        }
        let e = match self.lookup(id) {
            Some(e) => e,
            None => {
                self.refresh_index().await?;
                self.lookup(id).ok_or_else(|| RemoteError::Missing {
                    object: format!("blob {id}"),
                    what: format!("{what}; no index lists it"),
                })?
            }
        };
        let cached = self.cache_path(id);
        if let Ok(stored) = std::fs::read(&cached) {
            match self.decode_blob(&e, &stored, &cached.display().to_string()) {
                Ok(plain) => return Ok(plain),
                Err(err) => {
                    tracing::warn!(error = %err, "dropping a bad cache entry");
                    let _ = std::fs::remove_file(&cached);
                }
            }
        }
        let rel = format!("packs/{}", e.pack.fanout());
        let stored = self.fetcher.get_range(&rel, e.offset, e.length, what).await?;
        let plain = self.decode_blob(&e, &stored, &self.object_name(&rel))?;
        self.fetcher.count(std::iter::once(&e));
        cache_put(&self.fetcher.cache_dir, id, &stored);
        Ok(plain)
    }

    /// Download the blobs of `ids` that the cache lacks: one ranged read per run of wanted
    /// blobs in a pack (runs split where more than `PREFETCH_GAP` unwanted bytes lie between),
    /// `PREFETCH_PARALLEL` reads at a time.
    pub(crate) async fn prefetch(&self, ids: &[Id], what: &str) -> Result<()> {
        let runs = self.runs(ids, PREFETCH_GAP, what)?;
        self.fetcher.fetch(runs, what).await
    }

    /// Fetch at once the trees a point record names for its restore
    /// ([`crate::format::PointRecord::walk`], plus the process images' root): untrusted, so
    /// only ids the index lists as trees are fetched, at most [`WALK_HINT_MAX`] of them and
    /// [`WALK_HINT_BYTES`] in all; a failure is left to the walk that reads them (it names
    /// the object).
    pub async fn prefetch_trees(&self, ids: &[Id], what: &str) {
        let mut bytes = 0u64;
        let wanted: Vec<Id> = ids
            .iter()
            .take(WALK_HINT_MAX)
            .filter(|id| {
                self.lookup(id).is_some_and(|e| {
                    bytes = bytes.saturating_add(e.raw_length);
                    e.kind == BlobKind::Tree && bytes <= WALK_HINT_BYTES
                })
            })
            .copied()
            .collect();
        let fetched = match self.runs(&wanted, TREE_GAP, what) {
            Ok(runs) => self.fetcher.fetch(runs, what).await,
            Err(e) => Err(e),
        };
        if let Err(e) = fetched {
            tracing::debug!(error = %e, "prefetching a point's trees failed; its walk reads them");
        }
    }

    /// The ranged reads fetching the blobs of `ids` that neither memory nor the cache holds.
    /// `gap`: unwanted bytes between two wanted blobs above which they are read apart.
    pub(crate) fn runs(&self, ids: &[Id], gap: u64, what: &str) -> Result<Runs> {
        let mut by_pack: HashMap<Id, Vec<IndexEntry>> = HashMap::new();
        let mut seen = HashSet::new();
        for id in ids {
            if !seen.insert(*id)
                || lock(&self.fetcher.hot).blobs.contains_key(id)
                || self.cache_path(id).exists()
            {
                continue;
            }
            let e = self.lookup(id).ok_or_else(|| RemoteError::Missing {
                object: format!("blob {id}"),
                what: format!("{what}; no index lists it"),
            })?;
            by_pack.entry(e.pack).or_default().push(e);
        }
        let mut runs: Runs = Vec::new();
        for (pack, mut entries) in by_pack {
            entries.sort_by_key(|e| e.offset);
            let mut run: Vec<IndexEntry> = Vec::new();
            for e in entries {
                let end = run.last().map(|l| l.offset + l.length);
                if end.is_some_and(|end| e.offset > end.saturating_add(gap)) {
                    runs.push((pack, std::mem::take(&mut run)));
                }
                run.push(e);
            }
            if !run.is_empty() {
                runs.push((pack, run));
            }
        }
        Ok(runs)
    }

    /// A prefetched blob, kept until [`Repo::drop_prefetched`] (a chunk may be read more than
    /// once: two files of one content).
    fn hot_blob(&self, id: &Id) -> Option<Vec<u8>> {
        lock(&self.fetcher.hot).blobs.get(id).cloned()
    }

    /// How many blobs this handle downloaded from the store (cache hits not counted).
    pub fn blobs_downloaded(&self) -> u64 {
        self.fetcher.downloaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many of [`Repo::blobs_downloaded`] were trees.
    pub fn trees_downloaded(&self) -> u64 {
        self.fetcher.trees_downloaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forget the prefetched blobs held in memory (file content among them was not written
    /// to the on-disk cache: a later read fetches it again).
    pub fn drop_prefetched(&self) {
        *lock(&self.fetcher.hot) = HotBlobs::default();
    }

    // ---- locks ----

    /// Take a lock: shared (exporters) or exclusive (prune). Write-then-list: of two racing
    /// conflicting lockers at least one sees the other and backs off.
    pub async fn lock(&self, exclusive: bool) -> Result<LockGuard> {
        let rec = LockRecord {
            exclusive,
            host: crate::host::hostname(),
            pid: std::process::id(),
            created_at_ms: now_ms(),
        };
        let name = format!("locks/{}", hex::encode(random_bytes::<16>()?));
        self.put(&name, self.seal_meta("lock", &rec)?, PutMode::Create).await?;
        let guard = LockGuard { name };
        let now = now_ms();
        for (other, _) in self.list("locks").await? {
            if other == guard.name {
                continue;
            }
            let Some(bytes) = self.get_opt(&other).await? else { continue };
            let theirs: LockRecord = match self.open_meta("lock", &bytes, &other) {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(lock = other, error = %e, "ignoring an unreadable lock");
                    continue;
                }
            };
            if now.saturating_sub(theirs.created_at_ms) > LOCK_STALE_MS {
                continue;
            }
            if exclusive || theirs.exclusive {
                self.unlock(guard).await;
                return Err(RemoteError::Locked {
                    remote: self.fetcher.url.clone(),
                    holder: format!(
                        "{} lock of {} pid {} ({} s old)",
                        if theirs.exclusive { "an exclusive (prune)" } else { "a shared (export)" },
                        theirs.host,
                        theirs.pid,
                        now.saturating_sub(theirs.created_at_ms) / 1000
                    ),
                    stale_s: LOCK_STALE_MS / 1000,
                });
            }
        }
        Ok(guard)
    }

    /// Release a lock (errors are logged: a leftover lock goes stale).
    pub async fn unlock(&self, guard: LockGuard) {
        if let Err(e) = self.delete(&guard.name).await {
            tracing::warn!(lock = guard.name, error = %e, "could not remove a remote lock");
        }
    }

    // ---- points ----

    /// Every point in the remote (of `sandbox`, if given), oldest first.
    pub async fn list_points(&self, sandbox: Option<&str>) -> Result<Vec<PointRecord>> {
        let dir = match sandbox {
            Some(sb) => format!("points/{sb}"),
            None => "points".to_string(),
        };
        let mut out = Vec::new();
        for (name, _) in self.list(&dir).await? {
            let bytes = self.get(&name, "point").await?;
            out.push(self.read_point(&name, &bytes)?);
        }
        out.sort_by(|a, b| {
            (&a.sandbox, a.created_at_ms, &a.point).cmp(&(&b.sandbox, b.created_at_ms, &b.point))
        });
        Ok(out)
    }

    /// The highest point number the remote holds of `sandbox` (`c000007` → 7; one listing,
    /// no record read).
    pub async fn highest_point(&self, sandbox: &str) -> Result<Option<u64>> {
        let prefix = format!("points/{sandbox}/");
        Ok(self
            .list(&format!("points/{sandbox}"))
            .await?
            .iter()
            .filter_map(|(name, _)| name.strip_prefix(&prefix))
            .filter_map(|p| normalize_point(p).parse::<u64>().ok())
            .max())
    }

    /// The sandboxes the remote holds points of (one listing, no record read).
    pub async fn point_sandboxes(&self) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        for (name, _) in self.list("points").await? {
            let mut parts = name.split('/');
            if let (Some("points"), Some(sb), Some(_)) = (parts.next(), parts.next(), parts.next())
            {
                if crab_common::names::validate("sandbox", sb).is_ok() {
                    out.push(sb.to_string());
                }
            }
        }
        out.dedup();
        Ok(out)
    }

    fn read_point(&self, rel: &str, bytes: &[u8]) -> Result<PointRecord> {
        let rec: PointRecord = self.open_meta("point", bytes, rel)?;
        if rel != format!("points/{}/{}", rec.sandbox, rec.point) {
            return Err(RemoteError::corrupt(
                self.object_name(rel),
                format!("record names {}@{}", rec.sandbox, rec.point),
            ));
        }
        Ok(rec)
    }

    /// Point `point` of `sandbox` (the newest when `None`; ids may be abbreviated `c7` / `7`).
    ///
    /// One listing and one record read: the newest is the record the store wrote last (its
    /// own clock, not a host's), ties going to the larger id (`c<digits>` ids grow with every
    /// point a host makes; a sandbox removed and made again starts them over, so the id alone
    /// does not order incarnations). Records whose names are not such ids (none written by
    /// Crab) are looked at only when no id-named record qualifies.
    pub async fn load_point(&self, sandbox: &str, point: Option<&str>) -> Result<PointRecord> {
        let dir = format!("points/{sandbox}");
        let want = point.map(normalize_point);
        let mut best: Option<((i64, u128), String)> = None;
        let mut odd = false;
        for (name, _, written) in self.list_meta(&dir).await? {
            let id = name.rsplit('/').next().unwrap_or_default();
            let n = match id.strip_prefix('c').map(|d| (d, d.parse::<u128>())) {
                Some((d, Ok(n))) if !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()) => n,
                _ => {
                    odd = true;
                    continue;
                }
            };
            let take = match &want {
                Some(w) => normalize_point(id) == *w,
                None => best.as_ref().is_none_or(|(b, _)| (written, n) > *b),
            };
            if take {
                best = Some(((written, n), name));
            }
        }
        let found = match best {
            Some((_, name)) => {
                let bytes = self.get(&name, "point").await?;
                Some(self.read_point(&name, &bytes)?)
            }
            None if odd => {
                let all = self.list_points(Some(sandbox)).await?;
                match &want {
                    None => all.into_iter().last(),
                    Some(w) => all.into_iter().find(|r| normalize_point(&r.point) == *w),
                }
            }
            None => None,
        };
        found.ok_or_else(|| RemoteError::NoPoint {
            what: match point {
                Some(p) => format!("{sandbox}@{p}"),
                None => sandbox.to_string(),
            },
        })
    }

    /// Write `rec` at `points/<sandbox>/<point>`. A record already there is replaced only
    /// when it is of the same point (an export retried, or repeated by a restarted host: same
    /// time taken, same manifest) or unreadable; another point's is never overwritten
    /// ([`RemoteError::PointTaken`]).
    pub(crate) async fn write_point(&self, rec: &PointRecord) -> Result<u64> {
        let rel = format!("points/{}/{}", rec.sandbox, rec.point);
        let bytes = self.seal_meta("point", rec)?;
        let n = bytes.len() as u64;
        if self.put(&rel, bytes.clone(), PutMode::Create).await? {
            return Ok(n);
        }
        if let Some(old) = self.get_opt(&rel).await? {
            if let Ok(theirs) = self.read_point(&rel, &old) {
                if theirs.created_at_ms != rec.created_at_ms || theirs.manifest != rec.manifest {
                    return Err(RemoteError::PointTaken {
                        point: format!("{}@{}", rec.sandbox, rec.point),
                        theirs_ms: theirs.created_at_ms,
                        host: theirs.host.hostname,
                        ours_ms: rec.created_at_ms,
                    });
                }
            }
        }
        self.put(&rel, bytes, PutMode::Overwrite).await?;
        Ok(n)
    }
}

/// `c000007`, `c7` and `7` → `7`.
fn normalize_point(p: &str) -> String {
    let digits = p.strip_prefix('c').unwrap_or(p);
    let trimmed = digits.trim_start_matches('0');
    if trimmed.is_empty() {
        "0".into()
    } else {
        trimmed.into()
    }
}

/// Collects new blobs of one export into packs and, at the end, one index object.
#[derive(Debug)]
pub(crate) struct Packer<'a> {
    repo: &'a Repo,
    buf: Vec<u8>,
    open: Vec<IndexEntry>,
    written: Vec<IndexEntry>,
    pending: HashSet<Id>,
    /// Bytes uploaded so far (packs).
    pub uploaded: u64,
    /// Blobs uploaded / found already present.
    pub new_blobs: u64,
    /// Blobs that were already in the repository (or this export).
    pub dedup_blobs: u64,
    /// Packs written.
    pub packs: u64,
    /// Compute ids only: store nothing (the tree id of a local directory).
    dry: bool,
    /// Asked between steps of an export whether to pause for more urgent work.
    pause: Option<&'a dyn Pause>,
}

/// Lets the owner of an export pause it between its steps (before a file is read, before a
/// pack is uploaded) for more urgent work; crab-host implements it over the engine's
/// background lane, so an export never holds up a turn.
pub trait Pause: Send + Sync + std::fmt::Debug {
    /// Returns when the export may go on.
    fn pause(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

impl<'a> Packer<'a> {
    pub fn new(repo: &'a Repo) -> Packer<'a> {
        Packer {
            repo,
            buf: Vec::new(),
            open: Vec::new(),
            written: Vec::new(),
            pending: HashSet::new(),
            uploaded: 0,
            new_blobs: 0,
            dedup_blobs: 0,
            packs: 0,
            dry: false,
            pause: None,
        }
    }

    /// A packer whose export pauses through `pause` between steps.
    pub fn with_pause(repo: &'a Repo, pause: Option<&'a dyn Pause>) -> Packer<'a> {
        Packer { pause, ..Packer::new(repo) }
    }

    /// Pause here if the export's owner asks to (between steps only).
    pub async fn pause_point(&self) {
        if let Some(p) = self.pause {
            p.pause().await;
        }
    }

    /// A packer that only computes ids (nothing is uploaded or kept).
    pub fn dry(repo: &'a Repo) -> Packer<'a> {
        Packer { dry: true, ..Packer::new(repo) }
    }

    /// Whether blob `id` is stored or about to be.
    pub fn has(&self, id: &Id) -> bool {
        self.pending.contains(id) || self.repo.lookup(id).is_some()
    }

    /// Add a blob; returns its id (uploads nothing when it is already there).
    pub async fn add(&mut self, kind: BlobKind, plain: &[u8]) -> Result<Id> {
        let id = self.repo.blob_id(plain);
        if self.has(&id) {
            self.dedup_blobs += 1;
            return Ok(id);
        }
        if self.dry {
            return Ok(id);
        }
        let stored = self.repo.encode_blob(plain)?;
        if kind == BlobKind::Tree {
            // Kept here too: the walk an export records for its restore
            // (`Repo::walk_hint`) reads this export's trees and those of earlier ones.
            cache_put(&self.repo.fetcher.cache_dir, &id, &stored);
        }
        self.open.push(IndexEntry {
            id,
            kind,
            pack: Id([0; 32]),
            offset: self.buf.len() as u64,
            length: stored.len() as u64,
            raw_length: plain.len() as u64,
        });
        self.buf.extend_from_slice(&stored);
        self.pending.insert(id);
        self.new_blobs += 1;
        if self.buf.len() >= PACK_TARGET {
            self.flush().await?;
        }
        Ok(id)
    }

    /// Add a blob already in stored form (repacking), even though the index lists it.
    pub async fn add_stored(&mut self, mut e: IndexEntry, stored: &[u8]) -> Result<()> {
        if !self.pending.insert(e.id) {
            return Ok(());
        }
        e.offset = self.buf.len() as u64;
        e.length = stored.len() as u64;
        self.buf.extend_from_slice(stored);
        self.open.push(e);
        if self.buf.len() >= PACK_TARGET {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<()> {
        if self.open.is_empty() {
            return Ok(());
        }
        self.pause_point().await;
        let buf = std::mem::take(&mut self.buf);
        let pack = Id::of(&buf);
        let n = buf.len() as u64;
        self.repo.put(&format!("packs/{}", pack.fanout()), buf, PutMode::Create).await?;
        self.uploaded += n;
        self.packs += 1;
        for mut e in self.open.drain(..) {
            e.pack = pack;
            self.written.push(e);
        }
        Ok(())
    }

    /// Write the last pack and the index; returns the bytes uploaded in all and the packs.
    pub async fn finish(mut self) -> Result<(u64, u64)> {
        self.flush().await?;
        if !self.written.is_empty() {
            let (_, n) = self.repo.write_index(std::mem::take(&mut self.written)).await?;
            self.uploaded += n;
        }
        Ok((self.uploaded, self.packs))
    }
}

impl Fetcher {
    /// Download `runs` (`PREFETCH_PARALLEL` reads at a time), decode and verify each blob,
    /// and hold it in memory (up to [`HOT_MAX`]) or the on-disk cache.
    pub(crate) async fn fetch(&self, runs: Runs, what: &str) -> Result<()> {
        let mut fetches =
            futures::stream::iter(runs.into_iter().map(|(pack, entries)| async move {
                let start = entries.iter().map(|e| e.offset).min().unwrap_or(0);
                let end = entries.iter().map(|e| e.offset + e.length).max().unwrap_or(0);
                let rel = format!("packs/{}", pack.fanout());
                let bytes = self.get_range(&rel, start, end - start, what).await?;
                // Decode here so a corrupt pack is reported now, naming it; the read that asks
                // for a blob takes its plaintext from memory. On the blocking pool: the other
                // reads (and the walk of another part beside this one) go on meanwhile.
                let (key, object) = (self.key.clone(), object_name(&self.prefix, &rel));
                let decoded = tokio::task::spawn_blocking(move || {
                    entries
                        .into_iter()
                        .map(|e| {
                            let s = (e.offset - start) as usize;
                            let stored = bytes.slice(s..s + e.length as usize);
                            decode_with(key.as_ref(), &e, &stored, &object)
                                .map(|plain| (e, stored, plain))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .await
                .map_err(|e| RemoteError::Io {
                    op: "decode blobs",
                    path: PathBuf::from(&rel),
                    source: std::io::Error::other(e.to_string()),
                })??;
                self.count(decoded.iter().map(|(e, _, _)| e));
                for (e, stored, plain) in decoded {
                    // File content held in memory is not written to the on-disk cache too
                    // (written once, into its file); trees, read again by later restores, are.
                    let held = put_hot(&self.hot, e.id, plain);
                    if !held || e.kind == BlobKind::Tree {
                        cache_put(&self.cache_dir, &e.id, &stored);
                    }
                }
                Ok::<(), RemoteError>(())
            }))
            .buffer_unordered(PREFETCH_PARALLEL);
        while let Some(r) = fetches.next().await {
            r?;
        }
        Ok(())
    }

    /// Count downloaded blobs (and the trees among them).
    fn count<'e>(&self, blobs: impl Iterator<Item = &'e IndexEntry>) {
        use std::sync::atomic::Ordering::Relaxed;
        for e in blobs {
            self.downloaded.fetch_add(1, Relaxed);
            if e.kind == BlobKind::Tree {
                self.trees_downloaded.fetch_add(1, Relaxed);
            }
        }
    }

    async fn get_range(&self, rel: &str, offset: u64, length: u64, what: &str) -> Result<Bytes> {
        let object = || object_name(&self.prefix, rel);
        let range = offset
            ..offset
                .checked_add(length)
                .ok_or_else(|| RemoteError::corrupt(rel, "range overflows"))?;
        match self.store.get_range(&Path::from(object()), range).await {
            Ok(b) if b.len() as u64 == length => Ok(b),
            Ok(b) => Err(RemoteError::corrupt(
                object(),
                format!("{} bytes at {offset}, index says {length} (truncated pack)", b.len()),
            )),
            Err(object_store::Error::NotFound { .. }) => {
                Err(RemoteError::Missing { object: object(), what: what.to_string() })
            }
            Err(e) => Err(RemoteError::Store {
                remote: self.url.clone(),
                op: "get",
                object: object(),
                source: Box::new(e),
            }),
        }
    }

    /// Forget blob `id` held in memory (its last reader took it).
    pub(crate) fn forget(&self, id: &Id) {
        let mut hot = lock(&self.hot);
        if let Some(b) = hot.blobs.remove(id) {
            hot.bytes -= b.len();
        }
    }
}

/// `rel` under the repository's `prefix`.
fn object_name(prefix: &str, rel: &str) -> String {
    if prefix.is_empty() {
        rel.to_string()
    } else {
        format!("{prefix}/{rel}")
    }
}

fn cache_path(cache_dir: &std::path::Path, id: &Id) -> PathBuf {
    cache_dir.join("blobs").join(id.fanout())
}

fn cache_put(cache_dir: &std::path::Path, id: &Id, stored: &[u8]) {
    let path = cache_path(cache_dir, id);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let res = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, stored))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "could not write the remote blob cache");
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Hold a prefetched blob in `hot` (up to `HOT_MAX`); whether it is held.
fn put_hot(hot: &Mutex<HotBlobs>, id: Id, plain: Vec<u8>) -> bool {
    let mut hot = lock(hot);
    if hot.blobs.contains_key(&id) {
        return true;
    }
    if hot.bytes + plain.len() <= HOT_MAX {
        hot.bytes += plain.len();
        hot.blobs.insert(id, plain);
        return true;
    }
    false
}

/// Decode blob `e` from its stored bytes (`key`: the repository's, when encrypted): open,
/// decompress, and check its length and id. Runs on any thread (a restore decodes on the
/// blocking pool while it goes on fetching).
fn decode_with(key: Option<&Key>, e: &IndexEntry, stored: &[u8], object: &str) -> Result<Vec<u8>> {
    let what = format!("{object} (blob {})", e.id);
    if stored.len() as u64 != e.length {
        return Err(RemoteError::corrupt(
            what,
            format!("{} bytes stored, index says {}", stored.len(), e.length),
        ));
    }
    let opened;
    let z = match &key {
        Some(k) => {
            opened = k.open(stored, &what)?;
            &opened[..]
        }
        None => stored,
    };
    let plain = zstd::bulk::decompress(z, e.raw_length as usize)
        .map_err(|err| RemoteError::corrupt(&what, format!("zstd: {err}")))?;
    if plain.len() as u64 != e.raw_length {
        return Err(RemoteError::corrupt(
            &what,
            format!("{} bytes, index says {}", plain.len(), e.raw_length),
        ));
    }
    if blob_id_with(key, &plain) != e.id {
        return Err(RemoteError::corrupt(what, "content does not hash to its id"));
    }
    Ok(plain)
}

fn blob_id_with(key: Option<&Key>, plain: &[u8]) -> Id {
    match key {
        Some(k) => Id(k.blob_id(plain)),
        None => Id::of(plain),
    }
}
