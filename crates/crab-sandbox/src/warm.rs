//! Ready-made root filesystems: a few writable snapshots of each recently used image, made in
//! the background, so a sandbox create renames one into place instead of snapshotting on the
//! caller's time.
//!
//! A btrfs snapshot is taken inside a transaction commit, which writes out the pool's dirty
//! metadata and the superblock: 15–100 ms on a busy disk here, the largest single step of a
//! create once its records stopped being fsynced. Renaming a ready subvolume within the pool
//! costs microseconds. Each ready root is tagged with the identity of the image it was taken
//! from (the image subvolume's device number and its record's modification time), so a
//! rebuilt, re-imported or removed image never hands out an old root: a stale one is deleted,
//! and the create snapshots inline as before. Ready roots live under `<pool>/tmp/warm-*`
//! (never shown as sandboxes); a daemon start deletes any a previous run left.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crab_common::paths::StateDir;

use crate::btrfs;

/// What identifies one build of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ImageKey {
    dev: u64,
    record_mtime_ns: i128,
}

fn image_key(state: &StateDir, image: &str, root: &Path) -> Option<ImageKey> {
    let dev = std::fs::metadata(root).ok()?.dev();
    let m = std::fs::metadata(state.image_record(image)).ok()?;
    Some(ImageKey {
        dev,
        record_mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

#[derive(Debug)]
struct Ready {
    path: PathBuf,
    key: ImageKey,
}

/// The ready roots of one daemon.
#[derive(Debug)]
pub struct WarmRoots {
    state: StateDir,
    /// Ready roots kept per image (0 = off).
    target: std::sync::atomic::AtomicUsize,
    ready: Mutex<HashMap<String, Vec<Ready>>>,
    refilling: Mutex<HashSet<String>>,
}

const PREFIX: &str = "warm-";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl WarmRoots {
    /// An empty set (off until [`WarmRoots::set_target`]); deletes ready roots a previous
    /// daemon left in `<pool>/tmp`.
    pub fn new(state: &StateDir) -> Arc<Self> {
        if let Ok(entries) = std::fs::read_dir(state.tmp()) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(PREFIX) {
                    if let Err(err) = btrfs::remove_tree(&e.path()) {
                        tracing::warn!(path = %e.path().display(), error = %err, "cannot delete a stale ready root");
                    }
                }
            }
        }
        Arc::new(WarmRoots {
            state: state.clone(),
            target: std::sync::atomic::AtomicUsize::new(0),
            ready: Mutex::new(HashMap::new()),
            refilling: Mutex::new(HashSet::new()),
        })
    }

    /// Keep `n` ready roots per recently used image (0 turns it off and drops the ready ones).
    pub fn set_target(self: &Arc<Self>, n: usize) {
        self.target.store(n, std::sync::atomic::Ordering::Relaxed);
        if n == 0 {
            let all: Vec<Ready> = lock(&self.ready).drain().flat_map(|(_, v)| v).collect();
            discard(all);
        }
    }

    fn target(&self) -> usize {
        self.target.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Put a ready root of `image` (whose subvolume is `root`) at `dst`, if one of the image's
    /// current build is ready; `false` means the caller snapshots itself. Either way the image
    /// is (re)filled in the background.
    pub fn take(self: &Arc<Self>, image: &str, root: &Path, dst: &Path) -> bool {
        if self.target() == 0 {
            return false;
        }
        let key = image_key(&self.state, image, root);
        let (hit, stale) = {
            let mut ready = lock(&self.ready);
            let list = ready.entry(image.to_string()).or_default();
            let (fresh, stale): (Vec<Ready>, Vec<Ready>) =
                list.drain(..).partition(|r| Some(&r.key) == key.as_ref());
            *list = fresh;
            (list.pop(), stale)
        };
        discard(stale);
        let used = match hit {
            Some(r) => match std::fs::rename(&r.path, dst) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(from = %r.path.display(), to = %dst.display(), error = %e, "cannot move a ready root into place; snapshotting");
                    discard(vec![r]);
                    false
                }
            },
            None => false,
        };
        if let Some(key) = key {
            self.refill(image, root, key);
        }
        used
    }

    /// Snapshot `root` in the background until `image` has the target number ready.
    fn refill(self: &Arc<Self>, image: &str, root: &Path, key: ImageKey) {
        if !lock(&self.refilling).insert(image.to_string()) {
            return;
        }
        let name = image.to_string();
        let (me, image, root) = (self.clone(), image.to_string(), root.to_path_buf());
        let spawned = std::thread::Builder::new().name("crab-warm".into()).spawn(move || {
            loop {
                let have = lock(&me.ready).get(&image).map_or(0, Vec::len);
                if have >= me.target() {
                    break;
                }
                let path = me.state.tmp().join(format!(
                    "{PREFIX}{image}-{:08x}",
                    crate::runtime::rand_u32()
                ));
                if let Err(e) = btrfs::snapshot(&root, &path, false) {
                    tracing::warn!(image, error = %e, "cannot make a ready root; creates snapshot inline");
                    let _ = btrfs::remove_tree(&path);
                    break;
                }
                lock(&me.ready).entry(image.clone()).or_default().push(Ready { path, key: key.clone() });
            }
            lock(&me.refilling).remove(&image);
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the ready-root thread");
            lock(&self.refilling).remove(&name);
        }
    }

    /// Delete the ready roots of `image` (one being refilled right now may still land; the
    /// build tag drops it at its first use).
    pub fn forget(&self, image: &str) {
        let gone = lock(&self.ready).remove(image).unwrap_or_default();
        discard(gone);
    }

    /// How many ready roots `image` has now.
    pub fn ready(&self, image: &str) -> usize {
        lock(&self.ready).get(image).map_or(0, Vec::len)
    }
}

fn discard(roots: Vec<Ready>) {
    for r in roots {
        if let Err(e) = btrfs::remove_tree(&r.path) {
            tracing::warn!(path = %r.path.display(), error = %e, "cannot delete a ready root");
        }
    }
}
