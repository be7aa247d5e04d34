//! Export of one restore point (and, once, its image) and the reading back of its parts.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use object_store::PutMode;

use crate::error::{RemoteError, Result};
use crate::format::{HostFacts, ImageRecord, ImageRef, PointRecord};
use crate::id::Id;
use crate::repo::{now_ms, Packer, Pause, Repo};
use crate::tree::TreeStats;

/// What to export: a local restore point, described without reference to the local store's
/// types (the caller reads them from its manifest).
#[derive(Debug, Clone)]
pub struct ExportSource {
    /// Sandbox.
    pub sandbox: String,
    /// Point id.
    pub point: String,
    /// Turn.
    pub turn: u64,
    /// Kind (`skip`, `fs`, ...).
    pub kind: String,
    /// When it was taken.
    pub created_at_ms: u64,
    /// The manifest file's bytes.
    pub manifest: Vec<u8>,
    /// The filesystem snapshot's root (a read-only subvolume).
    pub fs_dir: Option<PathBuf>,
    /// The CRIU image directory.
    pub procs_dir: Option<PathBuf>,
    /// CRIU version that dumped it.
    pub criu_version: Option<String>,
    /// The conversation log up to the point.
    pub conversation: Option<Vec<u8>>,
    /// The image the sandbox came from: name and root directory.
    pub image: Option<(String, PathBuf)>,
    /// That image's registry reference and manifest digest, when it was pulled.
    pub image_origin: Option<(String, String)>,
    /// `fs_dir` and `procs_dir` never change (a read-only snapshot, a published CRIU image
    /// directory): a part exported before, by path and root ctime, is not walked again.
    /// False for a directory that may change below its root.
    pub immutable_parts: bool,
}

/// What an export did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ExportReport {
    /// The record now in the remote.
    pub record: PointRecord,
    /// Bytes uploaded, all objects included.
    pub uploaded_bytes: u64,
    /// New blobs stored.
    pub new_blobs: u64,
    /// Blobs already present.
    pub dedup_blobs: u64,
    /// Packs written.
    pub packs: u64,
    /// Bytes read from local files.
    pub read_bytes: u64,
    /// Directory entries walked (0 when every part was known from an earlier export).
    #[serde(default)]
    pub walked_entries: u64,
    /// Wall time, ms.
    pub elapsed_ms: u64,
}

/// Where to put the parts of a remote point.
#[derive(Debug, Clone, Default)]
pub struct ImportTarget {
    /// Empty directory for the filesystem snapshot (skipped when `None`).
    pub fs_dir: Option<PathBuf>,
    /// Empty directory for the CRIU images (skipped when `None`).
    pub procs_dir: Option<PathBuf>,
}

/// The small parts of an imported point.
#[derive(Debug, Clone)]
pub struct Imported {
    /// Its record.
    pub record: PointRecord,
    /// The manifest file's bytes.
    pub manifest: Vec<u8>,
    /// The conversation log up to the point.
    pub conversation: Option<Vec<u8>>,
    /// Files materialized.
    pub entries: u64,
    /// Wall time, ms.
    pub elapsed_ms: u64,
}

impl Repo {
    /// Export one point: image (once), filesystem, process images, conversation, manifest;
    /// the point record is written last, so a listed point is complete. Holds a shared lock.
    ///
    /// File IO is blocking: run this on a blocking-capable thread (`spawn_blocking` +
    /// `Handle::block_on`) in a latency-sensitive runtime.
    pub async fn export_point(&self, src: &ExportSource) -> Result<ExportReport> {
        self.export_point_with(src, None).await
    }

    /// [`Repo::export_point`], pausing through `pause` between its steps (before each file
    /// it reads and each pack it uploads).
    pub async fn export_point_with(
        &self,
        src: &ExportSource,
        pause: Option<&dyn Pause>,
    ) -> Result<ExportReport> {
        let guard = self.lock(false).await?;
        let res = self.export_locked(src, pause).await;
        self.unlock(guard).await;
        if res.is_ok() {
            // What this export learned outlives the daemon (`crate::cache`); failing to keep
            // it costs the next daemon's first export a reread, nothing more.
            if let Err(e) = self.save_export_cache() {
                tracing::warn!(error = %e, "cannot save the export cache");
            }
        }
        res
    }

    async fn export_locked(
        &self,
        src: &ExportSource,
        pause: Option<&dyn Pause>,
    ) -> Result<ExportReport> {
        let t0 = std::time::Instant::now();
        self.refresh_index().await?;
        let mut packer = Packer::with_pause(self, pause);
        let mut stats = TreeStats::default();
        let image = match &src.image {
            Some((name, dir)) => {
                let mut i = self.export_image(&mut packer, name, dir, &mut stats).await?;
                if let Some((r, d)) = &src.image_origin {
                    (i.reference, i.digest) = (Some(r.clone()), Some(d.clone()));
                }
                Some(i)
            }
            None => None,
        };
        let mut parts = Vec::new();
        for dir in [&src.fs_dir, &src.procs_dir] {
            parts.push(match dir {
                Some(d) if src.immutable_parts => {
                    Some(self.export_part(&mut packer, d, &mut stats).await?)
                }
                Some(d) => Some(self.export_tree(&mut packer, d, &mut stats).await?),
                None => None,
            });
        }
        let (fs, procs) = (parts[0], parts[1]);
        let conversation = match &src.conversation {
            Some(c) => Some(self.export_bytes(&mut packer, c).await?),
            None => None,
        };
        let manifest = self.export_bytes(&mut packer, &src.manifest).await?;
        let (new_blobs, dedup_blobs) = (packer.new_blobs, packer.dedup_blobs);
        let (uploaded, packs) = packer.finish().await?;
        // The trees a restore over the image reads, so that it fetches them at once. Only a
        // hint: without it a restore walks level by level, as for older records.
        let walk = match (&image, fs) {
            (Some(img), Some(fs)) => {
                match self.walk_hint(&img.tree, &fs, &format!("{} walk", src.sandbox)).await {
                    Ok(w) => Some(w),
                    Err(e) => {
                        tracing::warn!(sandbox = src.sandbox, point = src.point, error = %e, "no restore walk recorded");
                        None
                    }
                }
            }
            _ => None,
        };
        let record = PointRecord {
            sandbox: src.sandbox.clone(),
            point: src.point.clone(),
            turn: src.turn,
            kind: src.kind.clone(),
            created_at_ms: src.created_at_ms,
            exported_at_ms: now_ms(),
            host: HostFacts::local(),
            manifest,
            fs,
            procs,
            criu_version: src.criu_version.clone(),
            conversation,
            image: image.clone(),
            walk,
            size_bytes: stats.logical_bytes
                + src.conversation.as_ref().map_or(0, |c| c.len() as u64)
                + src.manifest.len() as u64,
            uploaded_bytes: uploaded,
        };
        let rec_bytes = self.write_point(&record).await?;
        if let Some(img) = image {
            let rel = format!("images/{}/{}", img.name, img.tree);
            let body =
                ImageRecord { name: img.name.clone(), tree: img.tree, exported_at_ms: now_ms() };
            self.put(&rel, self.seal_meta("image", &body)?, PutMode::Create).await?;
        }
        let report = ExportReport {
            record,
            uploaded_bytes: uploaded + rec_bytes,
            new_blobs,
            dedup_blobs,
            packs,
            read_bytes: stats.read_bytes,
            walked_entries: stats.entries,
            elapsed_ms: t0.elapsed().as_millis() as u64,
        };
        tracing::info!(
            sandbox = src.sandbox,
            point = src.point,
            uploaded = report.uploaded_bytes,
            new_blobs,
            dedup_blobs,
            read = stats.read_bytes,
            ms = report.elapsed_ms,
            "exported restore point"
        );
        Ok(report)
    }

    async fn export_image(
        &self,
        packer: &mut Packer<'_>,
        name: &str,
        dir: &Path,
        stats: &mut TreeStats,
    ) -> Result<ImageRef> {
        // The image's files count once, as the image, not as part of every point.
        let mut own = TreeStats::default();
        let tree = self.export_part(packer, dir, &mut own).await?;
        stats.read_bytes += own.read_bytes;
        stats.entries += own.entries;
        Ok(ImageRef { name: name.into(), tree, reference: None, digest: None })
    }

    /// Export an immutable part (an image root, a read-only filesystem snapshot, a published
    /// CRIU image directory). A part exported before, by path and root ctime, whose root tree
    /// the repository still holds is not walked again: a skip point, which shares its parts
    /// with the point before it, costs its manifest and record only. (Blobs a stored tree
    /// references are kept with it by `prune`, which removes only unreferenced blobs.)
    async fn export_part(
        &self,
        packer: &mut Packer<'_>,
        dir: &Path,
        stats: &mut TreeStats,
    ) -> Result<Id> {
        let m = std::fs::metadata(dir).map_err(RemoteError::io("stat", dir))?;
        let key = (dir.to_path_buf(), m.ctime() * 1_000_000_000 + m.ctime_nsec());
        let cached = self.part_cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied();
        if let Some((tree, logical)) = cached {
            if packer.has(&tree) {
                packer.dedup_blobs += 1;
                stats.logical_bytes += logical;
                return Ok(tree);
            }
        }
        let mut own = TreeStats::default();
        let tree = self.export_tree(packer, dir, &mut own).await?;
        stats.entries += own.entries;
        stats.logical_bytes += own.logical_bytes;
        stats.read_bytes += own.read_bytes;
        self.part_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, (tree, own.logical_bytes));
        self.cache_dirty.store(true, std::sync::atomic::Ordering::Release);
        Ok(tree)
    }

    /// Images exported to the remote: (name, root tree), oldest first.
    pub async fn list_images(&self) -> Result<Vec<ImageRecord>> {
        let mut out = Vec::new();
        for (name, _) in self.list("images").await? {
            let bytes = self.get(&name, "image record").await?;
            let rec: ImageRecord = self.open_meta("image", &bytes, &name)?;
            if name != format!("images/{}/{}", rec.name, rec.tree) {
                return Err(RemoteError::corrupt(
                    self.object_name(&name),
                    "record names another image",
                ));
            }
            out.push(rec);
        }
        out.sort_by_key(|r| r.exported_at_ms);
        Ok(out)
    }

    /// Read a point's parts into `target` (directories must exist and be empty).
    pub async fn import_point(&self, rec: &PointRecord, target: &ImportTarget) -> Result<Imported> {
        let t0 = std::time::Instant::now();
        self.refresh_index().await?;
        let what = format!("point {}@{}", rec.sandbox, rec.point);
        let manifest = self.read_content(&rec.manifest, &format!("{what} manifest")).await?;
        let conversation = match &rec.conversation {
            Some(c) => Some(self.read_content(c, &format!("{what} conversation")).await?),
            None => None,
        };
        let mut entries = 0;
        if let (Some(tree), Some(dir)) = (&rec.fs, &target.fs_dir) {
            entries += self.restore_tree(tree, dir, &format!("{what} filesystem")).await?.entries;
        }
        if let (Some(tree), Some(dir)) = (&rec.procs, &target.procs_dir) {
            entries +=
                self.restore_tree(tree, dir, &format!("{what} process images")).await?.entries;
        }
        Ok(Imported {
            record: rec.clone(),
            manifest,
            conversation,
            entries,
            elapsed_ms: t0.elapsed().as_millis() as u64,
        })
    }

    /// Materialize an exported image tree into the empty directory `dest`.
    pub async fn import_tree(&self, tree: &Id, dest: &Path) -> Result<u64> {
        self.refresh_index().await?;
        Ok(self.restore_tree(tree, dest, &format!("tree {tree}")).await?.entries)
    }

    /// Turn `dest`, a copy of tree `base`, into tree `target`, downloading only what differs
    /// (see `local::materialize`, which does this from a snapshot of a matching local image).
    pub async fn patch_tree_into(&self, base: &Id, target: &Id, dest: &Path) -> Result<u64> {
        self.refresh_index().await?;
        Ok(self.patch_tree(base, target, dest, &format!("tree {target}")).await?.entries)
    }
}
