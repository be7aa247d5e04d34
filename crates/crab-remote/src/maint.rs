//! `check` (read and verify every object) and `prune --keep-last N` (drop old points and the
//! packs only they used), under the repository's exclusive lock so that no exporter on any
//! host can be relying on a blob that prune removes.

use std::collections::{HashMap, HashSet};

use crate::error::{RemoteError, Result};
use crate::format::PointRecord;
use crate::id::Id;
use crate::repo::Repo;

/// What `check` found.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct CheckReport {
    /// Packs read.
    pub packs: u64,
    /// Blobs verified.
    pub blobs: u64,
    /// Points whose references all resolve.
    pub points: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Every problem, naming the object.
    pub errors: Vec<String>,
}

/// What `prune` did.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct PruneReport {
    /// Points removed (`sandbox@point`).
    pub removed_points: Vec<String>,
    /// Points kept.
    pub kept_points: u64,
    /// Packs deleted.
    pub deleted_packs: u64,
    /// Packs whose live blobs were copied into new packs.
    pub repacked_packs: u64,
    /// Bytes freed (net of what repacking wrote).
    pub freed_bytes: u64,
}

impl Repo {
    /// Blobs a point references (its trees walked).
    async fn point_blobs(&self, rec: &PointRecord) -> Result<HashSet<Id>> {
        let what = format!("point {}@{}", rec.sandbox, rec.point);
        let mut out: HashSet<Id> = rec.manifest.chunks.iter().copied().collect();
        if let Some(c) = &rec.conversation {
            out.extend(c.chunks.iter().copied());
        }
        for root in [rec.fs, rec.procs, rec.image.as_ref().map(|i| i.tree)].into_iter().flatten() {
            let (trees, data) = self.tree_blobs(&root, &what).await?;
            out.extend(trees);
            out.extend(data);
        }
        Ok(out)
    }

    /// Read every pack and verify every blob in it; check that every point's references
    /// resolve. Problems are collected (each naming its object), not fatal.
    pub async fn check(&self) -> Result<CheckReport> {
        let guard = self.lock(false).await?;
        let res = self.check_locked().await;
        self.unlock(guard).await;
        res
    }

    async fn check_locked(&self) -> Result<CheckReport> {
        let mut rep = CheckReport::default();
        // Points first, then the index: a point's record is written after its index, so every
        // point listed here has its index in the refresh below (an export running meanwhile
        // adds points this check does not look at, never half-indexed ones).
        let points = self.list_points(None).await?;
        self.refresh_index().await?;
        let (files, blobs) = self.index_snapshot();
        let mut by_pack: HashMap<Id, Vec<crate::format::IndexEntry>> = HashMap::new();
        for entries in files.values() {
            for e in entries {
                by_pack.entry(e.pack).or_default().push(e.clone());
            }
        }
        let listed: HashSet<String> =
            self.list("packs").await?.into_iter().map(|(n, _)| n).collect();
        let mut bad_blobs = HashSet::new();
        for (pack, entries) in &by_pack {
            let rel = format!("packs/{}", pack.fanout());
            let object = self.object_name(&rel);
            if !listed.contains(&rel) {
                rep.errors.push(format!(
                    "missing remote object {object}: {} blobs of the index are in it",
                    entries.len()
                ));
                bad_blobs.extend(entries.iter().map(|e| e.id));
                continue;
            }
            let bytes = self.get(&rel, "check").await?;
            rep.packs += 1;
            rep.bytes += bytes.len() as u64;
            if Id::of(&bytes) != *pack {
                rep.errors.push(format!(
                    "corrupt remote object {object}: content does not hash to its name"
                ));
            }
            for e in entries {
                let end = e.offset.checked_add(e.length).filter(|&end| end <= bytes.len() as u64);
                let res = match end {
                    Some(end) => self
                        .decode_blob(e, &bytes[e.offset as usize..end as usize], &object)
                        .map(|_| ()),
                    None => Err(RemoteError::corrupt(
                        &object,
                        format!("blob {} lies past the pack's end", e.id),
                    )),
                };
                match res {
                    Ok(()) => rep.blobs += 1,
                    Err(err) => {
                        bad_blobs.insert(e.id);
                        rep.errors.push(err.to_string());
                    }
                }
            }
        }
        for rec in points {
            match self.point_blobs(&rec).await {
                Ok(ids) => {
                    let missing: Vec<&Id> = ids
                        .iter()
                        .filter(|id| !blobs.contains_key(id) || bad_blobs.contains(id))
                        .collect();
                    if missing.is_empty() {
                        rep.points += 1;
                    } else {
                        rep.errors.push(format!(
                            "point {}@{}: {} referenced blobs missing or corrupt (first: {})",
                            rec.sandbox,
                            rec.point,
                            missing.len(),
                            missing[0]
                        ));
                    }
                }
                Err(e) => rep.errors.push(format!("point {}@{}: {e}", rec.sandbox, rec.point)),
            }
        }
        Ok(rep)
    }

    /// Keep the newest `keep_last` points of every sandbox (and every image); delete the
    /// others and every pack no kept object references. Takes the exclusive lock: refused
    /// while any export or restore holds the shared one.
    pub async fn prune(&self, keep_last: usize) -> Result<PruneReport> {
        if keep_last == 0 {
            return Err(RemoteError::NoPoint {
                what: "--keep-last 0 (keep at least one point per sandbox)".into(),
            });
        }
        let guard = self.lock(true).await?;
        let res = self.prune_locked(keep_last).await;
        self.unlock(guard).await;
        res
    }

    async fn prune_locked(&self, keep_last: usize) -> Result<PruneReport> {
        let mut rep = PruneReport::default();
        self.refresh_index().await?;
        let mut by_sb: HashMap<String, Vec<PointRecord>> = HashMap::new();
        for rec in self.list_points(None).await? {
            by_sb.entry(rec.sandbox.clone()).or_default().push(rec);
        }
        let mut keep = Vec::new();
        let mut drop = Vec::new();
        for (_, mut recs) in by_sb {
            // list_points sorts oldest first
            let cut = recs.len().saturating_sub(keep_last);
            drop.extend(recs.drain(..cut));
            keep.extend(recs);
        }
        let mut live: HashSet<Id> = HashSet::new();
        for rec in &keep {
            live.extend(self.point_blobs(rec).await?);
        }
        for img in self.list_images().await? {
            let (trees, data) = self.tree_blobs(&img.tree, &format!("image {}", img.name)).await?;
            live.extend(trees);
            live.extend(data);
        }
        // 1. Points go first: a crash after this leaves only unreferenced packs.
        for rec in &drop {
            self.delete(&format!("points/{}/{}", rec.sandbox, rec.point)).await?;
            rep.removed_points.push(format!("{}@{}", rec.sandbox, rec.point));
        }
        rep.kept_points = keep.len() as u64;
        // 2. Packs whose every blob is live stay as they are; packs with live and dead blobs
        //    are repacked (their live blobs copied, verified, into new packs + a new index).
        let (files, _) = self.index_snapshot();
        let mut live_bytes: HashMap<Id, (u64, u64)> = HashMap::new();
        for e in files.values().flatten() {
            let t = live_bytes.entry(e.pack).or_default();
            if live.contains(&e.id) {
                t.0 += e.length;
            }
            t.1 += e.length;
        }
        let whole: HashSet<Id> =
            live_bytes.iter().filter(|(_, (l, t))| l == t).map(|(p, _)| *p).collect();
        let mut repack: HashMap<Id, Vec<crate::format::IndexEntry>> = HashMap::new();
        let mut kept_entries = Vec::new();
        let mut seen = HashSet::new();
        for e in files.values().flatten() {
            if !live.contains(&e.id) || !seen.insert(e.id) {
                continue;
            }
            if whole.contains(&e.pack) {
                kept_entries.push(e.clone());
            } else {
                repack.entry(e.pack).or_default().push(e.clone());
            }
        }
        let mut packer = crate::repo::Packer::new(self);
        for (pack, entries) in &repack {
            let rel = format!("packs/{}", pack.fanout());
            let bytes = self.get(&rel, "prune (repack)").await?;
            let object = self.object_name(&rel);
            for e in entries {
                let end = e.offset.checked_add(e.length).filter(|&end| end <= bytes.len() as u64);
                let Some(end) = end else {
                    return Err(RemoteError::corrupt(
                        &object,
                        format!("blob {} lies past the pack's end", e.id),
                    ));
                };
                let stored = &bytes[e.offset as usize..end as usize];
                self.decode_blob(e, stored, &object)?;
                packer.add_stored(e.clone(), stored).await?;
            }
        }
        let repacked = packer.finish().await?;
        rep.repacked_packs = repack.len() as u64;
        let (files_now, _) = self.index_snapshot();
        let new_from_repack: HashSet<String> =
            files_now.keys().filter(|n| !files.contains_key(*n)).cloned().collect();
        let new_name = if kept_entries.is_empty() {
            None
        } else {
            Some(self.write_index(kept_entries).await?.0)
        };
        // 3. The old index objects go; then every pack no new index lists (dead, repacked, or
        //    never indexed: leftovers of an interrupted export, which cannot be in flight
        //    under the exclusive lock).
        for name in files.keys() {
            if Some(name) != new_name.as_ref() && !new_from_repack.contains(name) {
                self.delete(name).await?;
            }
        }
        self.refresh_index().await?;
        let (_, blobs_now) = self.index_snapshot();
        let listed: HashSet<Id> = blobs_now.values().map(|e| e.pack).collect();
        for (name, size) in self.list("packs").await? {
            let id = name.rsplit('/').next().and_then(Id::parse);
            if id.is_some_and(|id| listed.contains(&id)) {
                continue;
            }
            self.delete(&name).await?;
            rep.deleted_packs += 1;
            rep.freed_bytes += size;
        }
        rep.freed_bytes = rep.freed_bytes.saturating_sub(repacked.0);
        self.refresh_index().await?;
        tracing::info!(
            removed = rep.removed_points.len(),
            packs = rep.deleted_packs,
            freed = rep.freed_bytes,
            "pruned the remote"
        );
        Ok(rep)
    }
}
