//! The bridge between the local tier (a sandbox's `crab-checkpoint` store) and the remote:
//! what to export for a local point, and the materialization of a remote point as a local
//! point of a store of the same sandbox name (a read-only subvolume for its filesystem, its
//! CRIU images, its manifest byte for byte), from which the ordinary fork builds sandboxes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::FutureExt;

use crab_checkpoint::{Manifest, Store};
use crab_common::paths::StateDir;

use std::os::unix::fs::MetadataExt;

use crate::error::{RemoteError, Result};
use crate::format::PointRecord;
use crate::id::Id;
use crate::point::ExportSource;
use crate::repo::Repo;

/// What to export for point `m` of `store`: its snapshot, images, manifest file, the
/// sandbox's conversation log, and the image it was created from (when still here).
pub fn export_source(state: &StateDir, store: &Store, m: &Manifest) -> Result<ExportSource> {
    let mpath = store.manifest_path(m.id);
    let manifest = std::fs::read(&mpath).map_err(RemoteError::io("read manifest", &mpath))?;
    let log = state.sandbox_dir(store.sandbox()).join("conversation.log");
    let conversation = match std::fs::read(&log) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(RemoteError::Io { op: "read conversation log", path: log, source: e })
        }
    };
    // The image the point's tree is diffed against: the image itself, or for a
    // user-namespaced sandbox its copy shifted into the sandbox's range (`crab_sandbox::shift`),
    // whose owners are the point's.
    let userns: Option<crab_common::api::IdRange> = m
        .sandbox_meta
        .get("profile")
        .and_then(|p| p.get("userns"))
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    let image = m
        .sandbox_meta
        .get("image")
        .and_then(|v| v.as_str())
        .filter(|n| crab_common::names::validate("image", n).is_ok())
        .and_then(|n| image_dir(state, n, userns).map(|d| (n.to_string(), d)))
        .filter(|(_, dir)| dir.is_dir());
    // Where that image came from, for a pulled one: a host without it pulls it from there.
    let image_origin = image.as_ref().and_then(|(n, _)| {
        let i = crab_sandbox::image::get(state, n).ok()?;
        Some((i.reference?, i.digest?))
    });
    Ok(ExportSource {
        sandbox: store.sandbox().to_string(),
        point: m.id.to_string(),
        turn: m.turn,
        kind: m.kind.as_str().to_string(),
        created_at_ms: m.created_at_ms,
        manifest,
        fs_dir: m.fs.as_ref().map(|f| store.fs_path(f.id)),
        procs_dir: m.procs.as_ref().map(|p| store.proc_dir(p.id)),
        criu_version: m.procs.as_ref().map(|p| p.criu_version.clone()),
        conversation,
        image,
        image_origin,
        // Published parts: a read-only snapshot and an image directory nothing writes again.
        immutable_parts: true,
    })
}

/// A remote point made local.
#[derive(Debug, Clone)]
pub struct Materialized {
    /// Its manifest, as now in the local store.
    pub manifest: Manifest,
    /// The conversation log it carried.
    pub conversation: Option<Vec<u8>>,
    /// False when every part was already local (nothing downloaded).
    pub fetched: bool,
    /// The local image the filesystem was patched from (only what differs from it was
    /// downloaded), when its tree id is the point's image's.
    pub base_image: Option<String>,
    /// Wall time, ms.
    pub elapsed_ms: u64,
    /// Where that time went: (stage, ms), in order (`index`, `manifest`, `room` — the
    /// process images' declared bytes checked —, `fs_and_procs` — the wall time of the
    /// filesystem, the images and the conversation, fetched side by side, followed by `fs`
    /// (`fs_room`, `fs_subvolume`, `fs_tree`, `fs_seal`) and `procs` —, `verify` (names,
    /// kinds, sizes), `check_images`, `manifest_write`); for a copy already here,
    /// `check_images` and `conversation`.
    pub stages: Vec<(String, f64)>,
}

fn remove_any(path: &Path) {
    if crab_sandbox::btrfs::is_subvolume(path) {
        let _ = crab_sandbox::btrfs::set_readonly(path, false);
        let _ = crab_sandbox::btrfs::delete_subvolume(path);
    } else if path.exists() {
        let _ = std::fs::remove_dir_all(path);
    }
}

/// Suffix of the marker a materialized point carries (`points/<id>.unflushed`, holding the
/// boot id it was written in) until its bytes are known to be on disk.
const UNFLUSHED: &str = "unflushed";

fn unflushed_path(store: &Store, point: &str) -> PathBuf {
    store.dir().join("points").join(format!("{point}.{UNFLUSHED}"))
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`); empty when unreadable.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Record that `point`'s materialized bytes are not flushed yet: the marker is written and
/// fsynced before the manifest, so a manifest that survives a crash has its marker too.
fn mark_unflushed(store: &Store, point: &str) -> Result<()> {
    let path = unflushed_path(store, point);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&path)?;
        std::io::Write::write_all(&mut f, boot_id().as_bytes())?;
        f.sync_all()
    };
    write().map_err(RemoteError::io("write marker", &path))
}

/// Whether `point`'s local copy was written in an earlier boot and never flushed: after a
/// host crash its files may be torn.
fn unflushed_before_boot(store: &Store, point: &str) -> bool {
    match std::fs::read_to_string(unflushed_path(store, point)) {
        Ok(b) => b.trim() != boot_id() || b.trim().is_empty(),
        Err(_) => false,
    }
}

/// `point`'s materialized bytes are on disk (the caller flushed the pool after they were
/// written: a fork's origin point does, and [`flush`]): its marker goes.
pub fn mark_flushed(store: &Store, point: &str) {
    let path = unflushed_path(store, point);
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a materialized point's marker");
        }
    }
}

/// Flush the pool holding `store` and mark `point` flushed (a standby's background work).
pub fn flush(store: &Store, point: &str) -> Result<()> {
    store.sync().map_err(|e| RemoteError::Io {
        op: "syncfs",
        path: store.dir().to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    mark_flushed(store, point);
    Ok(())
}

/// Remove the local copy of point `m` (its manifest first, so nothing refers to the parts
/// while they go), keeping the parts another local point of the store refers to (a point
/// shares its parent's filesystem or images when it did not change them): it is fetched
/// again by the next materialization.
pub fn discard(store: &Store, m: &Manifest) {
    let mpath = store.dir().join("points").join(format!("{}.manifest", m.id));
    if let Err(e) = std::fs::remove_file(&mpath) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %mpath.display(), error = %e, "cannot remove a materialized manifest");
        }
    }
    let others = store.list().unwrap_or_default();
    if let Some(p) = &m.procs {
        if !others.iter().any(|o| o.procs.as_ref().is_some_and(|q| q.id == p.id)) {
            remove_any(&store.proc_dir(p.id));
        }
    }
    if let Some(f) = &m.fs {
        if !others.iter().any(|o| o.fs.as_ref().is_some_and(|g| g.id == f.id)) {
            remove_any(&store.fs_path(f.id));
        }
    }
    mark_flushed(store, &m.id.to_string());
}

/// The conversation log `c` (index refreshed once when the local index lacks it).
async fn read_conversation(repo: &Repo, c: &crate::format::Content, what: &str) -> Result<Vec<u8>> {
    let what = format!("{what} conversation");
    match repo.read_content(c, &what).await {
        Ok(b) => Ok(b),
        Err(_) => {
            repo.refresh_index().await?;
            repo.read_content(c, &what).await
        }
    }
}

/// What the restoring host lets a remote point be: checked before anything is written.
pub struct Admission<'a> {
    /// Refuses what the point's manifest asks for beyond what the host grants (its
    /// `sandbox_meta`: profile, network, limits, image name).
    pub check: &'a (dyn Fn(&Manifest) -> Result<()> + Send + Sync),
    /// The disk quota of the sandboxes to be built from it: a point whose filesystem would
    /// write more is refused.
    pub disk_limit: Option<u64>,
}

impl std::fmt::Debug for Admission<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").field("disk_limit", &self.disk_limit).finish_non_exhaustive()
    }
}

/// Check what a remote manifest names before any of it is joined to a path: its id and
/// sandbox are the record's, and every process image file name is one plain path component.
pub fn check_remote_manifest(m: &Manifest, rec: &PointRecord, object: &str) -> Result<()> {
    if m.id.to_string() != rec.point || m.sandbox != rec.sandbox {
        return Err(RemoteError::corrupt(
            object,
            format!(
                "its manifest is of {}@{}, not of {}@{}",
                m.sandbox, m.id, rec.sandbox, rec.point
            ),
        ));
    }
    if let Some(p) = &m.procs {
        let mut seen = std::collections::HashSet::new();
        for f in &p.files {
            crab_checkpoint::manifest::check_image_name(&f.name)
                .map_err(|why| RemoteError::corrupt(object, format!("its manifest's {why}")))?;
            if !seen.insert(f.name.as_str()) {
                return Err(RemoteError::corrupt(
                    object,
                    format!("its manifest lists image file {:?} twice", f.name),
                ));
            }
        }
    }
    Ok(())
}

/// Make remote point `rec` a local point of `store` (which must be a store of
/// `rec.sandbox`'s points materialized from remotes, never a local sandbox's own store),
/// downloading only what is missing. With `fs_only` the process images are left out and the
/// local manifest records none (a fork then starts a fresh init). Before anything is written
/// the manifest's names are checked, `admission` is asked, and the bytes its trees declare
/// are checked against the pool's free space and `admission.disk_limit`.
pub async fn materialize(
    repo: &Repo,
    state: &StateDir,
    store: &Store,
    rec: &PointRecord,
    fs_only: bool,
    admission: &Admission<'_>,
) -> Result<Materialized> {
    let res = materialize_inner(repo, state, store, rec, fs_only, admission).await;
    repo.drop_prefetched();
    res
}

async fn materialize_inner(
    repo: &Repo,
    state: &StateDir,
    store: &Store,
    rec: &PointRecord,
    fs_only: bool,
    admission: &Admission<'_>,
) -> Result<Materialized> {
    let t0 = std::time::Instant::now();
    let digits = rec.point.strip_prefix('c').unwrap_or("");
    if store.sandbox() != rec.sandbox
        || digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(RemoteError::corrupt(
            repo.object_name(&format!("points/{}/{}", rec.sandbox, rec.point)),
            "the record's point id is not c<digits>",
        ));
    }
    let mpath = store.dir().join("points").join(format!("{}.manifest", rec.point));
    let _lock = store.lock().map_err(|e| RemoteError::Io {
        op: "lock store",
        path: store.dir().to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let object = repo.object_name(&format!("points/{}/{}", rec.sandbox, rec.point));
    let what = format!("point {}@{}", rec.sandbox, rec.point);
    // Process images from the remote are held to the default profile before the point
    // becomes local (and again when one already here is used): `crab_checkpoint::foreign`.
    let vet = |m: &Manifest| -> Result<()> {
        match (&m.procs, fs_only) {
            // The user namespace the admission let the point have (`admission.check`: none,
            // or this host's range).
            (Some(p), false) => crab_checkpoint::foreign::check(
                &store.proc_dir(p.id),
                m.sandbox_meta
                    .get("profile")
                    .and_then(|p| p.get("userns"))
                    .and_then(|v| serde_json::from_value(v.clone()).ok()),
            )
            .map(|_| ())
            .map_err(|e| RemoteError::Untrusted { point: what.clone(), reason: e.to_string() }),
            _ => Ok(()),
        }
    };
    if let Ok(mut local) = crab_checkpoint::manifest::read(&mpath) {
        if unflushed_before_boot(store, &rec.point) {
            tracing::warn!(point = %what, "the local copy was written before the host went down and never flushed; fetching it again");
            discard(store, &local);
        } else if check_remote_manifest(&local, rec, &object).is_ok()
            && store.check_shape(&local).is_ok()
            && (fs_only || local.procs.is_some() == rec.procs.is_some())
        {
            let mut stages = crab_common::stats::StageClock::starting(std::time::Instant::now());
            (admission.check)(&local)?;
            vet(&local)?;
            stages.mark("check_images");
            let conversation = match &rec.conversation {
                Some(c) => Some(read_conversation(repo, c, &what).await?),
                None => None,
            };
            stages.mark("conversation");
            if fs_only {
                local.procs = None;
            }
            return Ok(Materialized {
                manifest: local,
                conversation,
                fetched: false,
                base_image: None,
                elapsed_ms: t0.elapsed().as_millis() as u64,
                stages: stages.into_stages(),
            });
        }
    }
    let mut stages = crab_common::stats::StageClock::starting(std::time::Instant::now());
    repo.refresh_index().await?;
    stages.mark("index");
    // The trees the filesystem's walk reads (the exporter's list of them) are fetched from
    // now on, all at once — not one round trip per level —, beside the manifest and the rest
    // (a shared future: whoever polls it moves it on; the filesystem's part waits for it);
    // the process images' root tree beside the manifest.
    let (manifest_what, trees_what) = (format!("{what} manifest"), format!("{what} trees"));
    let fs_trees: Vec<Id> = rec.walk.iter().flatten().copied().collect();
    let fs_trees_fetch = repo.prefetch_trees(&fs_trees, &trees_what).boxed().shared();
    let procs_root: Vec<Id> = rec.procs.into_iter().filter(|_| !fs_only).collect();
    let head = async {
        futures::join!(
            repo.read_content(&rec.manifest, &manifest_what),
            repo.prefetch_trees(&procs_root, &trees_what)
        )
        .0
    };
    let bytes = match futures::future::select(std::pin::pin!(head), fs_trees_fetch.clone()).await {
        futures::future::Either::Left((bytes, _)) => bytes?,
        futures::future::Either::Right(((), head)) => head.await?,
    };
    let mut m = crab_checkpoint::manifest::decode(&bytes, &mpath)
        .map_err(|e| RemoteError::corrupt(&object, e.to_string()))?;
    check_remote_manifest(&m, rec, &object)?;
    (admission.check)(&m)?;
    stages.mark("manifest");
    // What is to be written, from the trees' declared sizes, against the room there is —
    // before anything is written (a chunk declared thousands of times is a file that large).
    // The process images' bytes (one small tree) against the room there is, before they are
    // written; the filesystem's (a walk of what differs from the local image) in its own
    // part, beside the images' download, against the room left.
    let procs_need = match (fs_only, &m.procs, &rec.procs) {
        (false, Some(p), Some(tree)) if !store.proc_dir(p.id).exists() => {
            repo.tree_write_bytes(tree, &what).await?
        }
        _ => 0,
    };
    check_room(state, &what, 0, procs_need, None, &rec.image)?;
    stages.mark("room");
    // The filesystem, the process images and the conversation are fetched at the same
    // time: their downloads overlap (each part's file writes run between the others' network
    // waits).
    let fs_part = async {
        let t = std::time::Instant::now();
        fs_trees_fetch.await;
        let fs_job = match (&m.fs, &rec.fs) {
            (Some(fs), Some(tree)) if !store.fs_path(fs.id).exists() => {
                let base = match &rec.image {
                    Some(img) => matching_image(repo, state, &img.name, &img.tree).await,
                    None => None,
                };
                let need = match &base {
                    Some((_, base_tree)) => repo.patch_write_bytes(base_tree, tree, &what).await?,
                    None => repo.tree_write_bytes(tree, &what).await?,
                };
                check_room(state, &what, need, procs_need, admission.disk_limit, &rec.image)?;
                Some((fs.id, *tree, base))
            }
            _ => None,
        };
        let room_ms = t.elapsed().as_secs_f64() * 1e3;
        // (room, snapshot or new subvolume, patch or download, rename and seal), ms
        let mut split = (room_ms, 0.0, 0.0, 0.0);
        let mut base_image = None;
        if let Some((fs_id, tree, base)) = &fs_job {
            let (fs_id, tree) = (*fs_id, tree);
            let dst = store.fs_path(fs_id);
            let tmp = store.dir().join("fs").join(format!("{fs_id}.importing"));
            remove_any(&tmp);
            let made = match &base {
                Some((dir, _)) => crab_sandbox::btrfs::snapshot(dir, &tmp, false),
                None => crab_sandbox::btrfs::create_subvolume(&tmp),
            };
            made.map_err(|e| RemoteError::Io {
                op: "create subvolume",
                path: tmp.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            split.1 = t.elapsed().as_secs_f64() * 1e3 - split.0;
            let fs_what = format!("{what} filesystem");
            let res = match &base {
                Some((_, base_tree)) => repo.patch_tree(base_tree, tree, &tmp, &fs_what).await,
                None => repo.restore_tree(tree, &tmp, &fs_what).await,
            };
            if let Err(e) = res {
                remove_any(&tmp);
                return Err(e);
            }
            split.2 = t.elapsed().as_secs_f64() * 1e3 - split.0 - split.1;
            std::fs::rename(&tmp, &dst).map_err(RemoteError::io("rename", &tmp))?;
            crab_sandbox::btrfs::set_readonly(&dst, true).map_err(|e| RemoteError::Io {
                op: "set read-only",
                path: dst.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            base_image = base.as_ref().and(rec.image.as_ref().map(|i| i.name.clone()));
            split.3 = t.elapsed().as_secs_f64() * 1e3 - split.0 - split.1 - split.2;
        }
        Ok::<_, RemoteError>((base_image, t.elapsed().as_secs_f64() * 1e3, split))
    };
    let procs_part = async {
        let t = std::time::Instant::now();
        if let (false, Some(p), Some(tree)) = (fs_only, &m.procs, &rec.procs) {
            let dst = store.proc_dir(p.id);
            if !dst.exists() {
                let tmp: PathBuf = store.dir().join("tmp").join(format!("{}.importing", p.id));
                remove_any(&tmp);
                std::fs::create_dir_all(&tmp).map_err(RemoteError::io("mkdir", &tmp))?;
                let res = repo.restore_tree(tree, &tmp, &format!("{what} process images")).await;
                if let Err(e) = res {
                    remove_any(&tmp);
                    return Err(e);
                }
                std::fs::rename(&tmp, &dst).map_err(RemoteError::io("rename", &tmp))?;
                return Ok((t.elapsed().as_secs_f64() * 1e3, true));
            }
        }
        Ok::<_, RemoteError>((t.elapsed().as_secs_f64() * 1e3, false))
    };
    let conversation_part = async {
        match &rec.conversation {
            Some(c) => repo.read_content(c, &format!("{what} conversation")).await.map(Some),
            None => Ok(None),
        }
    };
    let (fs_res, procs_res, conv_res) = futures::join!(fs_part, procs_part, conversation_part);
    let fetched_procs =
        |res: &std::result::Result<(f64, bool), RemoteError>| matches!(res, Ok((_, true)));
    if fs_res.is_err() || conv_res.is_err() {
        // What this call downloaded goes with its failure: a retry starts clean.
        if let (true, Some(p)) = (fetched_procs(&procs_res), &m.procs) {
            remove_any(&store.proc_dir(p.id));
        }
    }
    let ((base_image, fs_ms, fs_split), (procs_ms, procs_fetched), conversation) =
        (fs_res?, procs_res?, conv_res?);
    if fs_only {
        m.procs = None;
    }
    // The parts ran side by side: their own times, and the wall time as `fs_and_procs`.
    stages.mark("fs_and_procs");
    stages.add("fs", fs_ms);
    stages.add("fs_room", fs_split.0);
    stages.add("fs_subvolume", fs_split.1);
    stages.add("fs_tree", fs_split.2);
    stages.add("fs_seal", fs_split.3);
    stages.add("procs", procs_ms);
    // Every chunk was checked against its BLAKE3 id as it arrived; here the image files'
    // names, kinds and sizes against the manifest (so that the policy check below reads only
    // regular files of the recorded sizes). Their SHA-256s, recorded by the dumping host, are
    // checked before a process is restored from them: a fork hashes them beside its first
    // stages. Nothing is flushed: the remote holds the durable copy; the point carries an
    // `unflushed` marker (this boot's id) until a fork's origin point or the follower flushes
    // the pool, and a copy whose marker names an earlier boot is fetched again.
    if let Err(e) = store.check_shape(&m) {
        if let (true, Some(p)) = (procs_fetched, &m.procs) {
            remove_any(&store.proc_dir(p.id));
        }
        return Err(RemoteError::corrupt(format!("{what} (as materialized)"), e.to_string()));
    }
    stages.mark("verify");
    if let Err(e) = vet(&m) {
        if let (true, Some(p)) = (procs_fetched, &m.procs) {
            remove_any(&store.proc_dir(p.id));
        }
        return Err(e);
    }
    stages.mark("check_images");
    let out = if fs_only { crab_checkpoint::manifest::encode(&m) } else { bytes };
    mark_unflushed(store, &rec.point)?;
    crab_checkpoint::manifest::write_atomic(&mpath, &out).map_err(|e| RemoteError::Io {
        op: "write manifest",
        path: mpath.clone(),
        source: std::io::Error::other(e.to_string()),
    })?;
    stages.mark("manifest_write");
    Ok(Materialized {
        manifest: m,
        conversation,
        fetched: true,
        base_image,
        elapsed_ms: t0.elapsed().as_millis() as u64,
        stages: stages.into_stages(),
    })
}

/// Refuse a materialization whose declared bytes (`fs` of the filesystem, `procs` of the
/// process images) exceed the pool's free space less its reserve, or whose filesystem bytes
/// exceed the new sandboxes' disk limit.
fn check_room(
    state: &StateDir,
    what: &str,
    fs: u64,
    procs: u64,
    disk_limit: Option<u64>,
    image: &Option<crate::format::ImageRef>,
) -> Result<()> {
    if let Some(limit) = disk_limit.filter(|l| fs > *l) {
        let fix = match image {
            Some(i) => format!(
                "restore it with a larger --disk, or make image {:?} (the point's, byte for byte) \
                 available here so that only what differs from it is written",
                i.name
            ),
            None => "restore it with a larger --disk".to_string(),
        };
        return Err(RemoteError::Refused {
            point: what.trim_start_matches("point ").to_string(),
            refusal: crate::error::Refusal {
                field: "disk limit".into(),
                reason: format!(
                    "its filesystem declares {fs} bytes to write, more than the new sandbox's \
                     disk limit of {limit} bytes"
                ),
                fix,
            },
        });
    }
    let free = crab_sandbox::pool::free_bytes(state).map_err(|e| RemoteError::Io {
        op: "statvfs",
        path: state.pool(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let reserve = crab_checkpoint::ops::MIN_FREE_BYTES;
    let need = fs.saturating_add(procs);
    if need > 0 && need.saturating_add(reserve) > free {
        return Err(RemoteError::PoolFull {
            point: what.trim_start_matches("point ").to_string(),
            need,
            free,
            reserve,
        });
    }
    Ok(())
}

/// The stamps being computed, by path: a hash of one image runs once at a time.
static HASHING: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
> = std::sync::LazyLock::new(Default::default);

/// What [`local_image_tree`] keeps per image: the tree id and what it was computed for.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ImageTreeStamp {
    repo_id: String,
    record: String,
    ctime_ns: i64,
    tree: Id,
}

/// The root of local image `name` (`userns`: its copy shifted into that range, when made).
fn image_dir(
    state: &StateDir,
    name: &str,
    userns: Option<crab_common::api::IdRange>,
) -> Option<PathBuf> {
    match userns {
        None => Some(state.image_rootfs(name)),
        Some(ids) => crab_sandbox::shift::existing(state, name, ids),
    }
}

/// The tree id local image `name` has in `repo` (None when there is no such image here),
/// hashed from its files once and kept in `<cache>/images/NAME.json`, keyed by the
/// repository, the image's record and its root's ctime (images are read-only subvolumes; a
/// rebuild writes a new record).
pub async fn local_image_tree(repo: &Repo, state: &StateDir, name: &str) -> Result<Option<Id>> {
    local_image_tree_for(repo, state, name, None).await
}

/// Where the repository cache in `cache_dir` keeps the tree id of image `name` (or of its
/// copy shifted into `userns`): `<cache>/images/NAME[@UID:GID:COUNT].json`.
pub fn image_stamp_path(
    cache_dir: &Path,
    name: &str,
    userns: Option<crab_common::api::IdRange>,
) -> PathBuf {
    let file = match userns {
        None => format!("{name}.json"),
        Some(r) => format!("{name}@{}:{}:{}.json", r.uid, r.gid, r.count),
    };
    cache_dir.join("images").join(file)
}

/// [`local_image_tree`] of the image's copy shifted into `userns` (`<cache>/images/NAME@UID:GID:COUNT.json`).
pub async fn local_image_tree_for(
    repo: &Repo,
    state: &StateDir,
    name: &str,
    userns: Option<crab_common::api::IdRange>,
) -> Result<Option<Id>> {
    if crab_common::names::validate("image", name).is_err() {
        return Ok(None);
    }
    let Some(dir) = image_dir(state, name, userns) else { return Ok(None) };
    let (Ok(meta), Ok(record)) = (std::fs::metadata(&dir), std::fs::read(state.image_record(name)))
    else {
        return Ok(None);
    };
    let stamp = ImageTreeStamp {
        repo_id: repo.config().repo_id.clone(),
        record: Id::of(&record).to_string(),
        ctime_ns: meta.ctime().saturating_mul(1_000_000_000).saturating_add(meta.ctime_nsec()),
        tree: Id([0; 32]),
    };
    let path = image_stamp_path(repo.cache_dir(), name, userns);
    let cached = || {
        std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<ImageTreeStamp>(&b).ok())
            .filter(|o| {
                o.repo_id == stamp.repo_id
                    && o.record == stamp.record
                    && o.ctime_ns == stamp.ctime_ns
            })
            .map(|o| o.tree)
    };
    if let Some(tree) = cached() {
        return Ok(Some(tree));
    }
    // One hash of an image at a time: a restore that needs the tree id while the idle
    // exporter hashes the same image waits for that hash instead of making a second one.
    let hashing = {
        let mut all = crab_common::sync::lock(&HASHING);
        all.entry(path.clone()).or_default().clone()
    };
    let _one = hashing.lock().await;
    if let Some(tree) = cached() {
        return Ok(Some(tree));
    }
    let t0 = std::time::Instant::now();
    let tree = repo.local_tree_id(&dir).await?;
    tracing::info!(image = name, %tree, ms = t0.elapsed().as_millis() as u64, "hashed a local image");
    let stamp = ImageTreeStamp { tree, ..stamp };
    let res = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&path, serde_json::to_vec(&stamp).unwrap_or_default()));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "could not keep a local image's tree id");
    }
    Ok(Some(tree))
}

/// The local image `name` when its tree id is `want` (so its files are, byte for byte and
/// with every owner, mode and time, the point's image's): its root and that id.
async fn matching_image(
    repo: &Repo,
    state: &StateDir,
    name: &str,
    want: &Id,
) -> Option<(PathBuf, Id)> {
    // The image itself, then each of its shifted copies (a user-namespaced point's tree is
    // one of those).
    let ranges = std::iter::once(None)
        .chain(crab_sandbox::shift::current_copies(state, name).into_iter().map(|(r, _)| Some(r)));
    let mut seen = Vec::new();
    for userns in ranges {
        match local_image_tree_for(repo, state, name, userns).await {
            Ok(Some(t)) if t == *want => return image_dir(state, name, userns).map(|d| (d, t)),
            Ok(Some(t)) => seen.push(t.to_string()),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(image = name, error = %e, "cannot hash a local image");
            }
        }
    }
    if !seen.is_empty() {
        tracing::info!(image = name, local = ?seen, point = %want, "the local image differs from the point's; downloading the whole tree");
    }
    None
}
