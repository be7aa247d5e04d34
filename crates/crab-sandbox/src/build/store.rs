//! The step store: each Dockerfile step that changes files is a read-only btrfs subvolume
//! `<pool>/layers/build-<key>` with its record `build-<key>.json` written last (a step without
//! its record is not a step), made in a work subvolume under the pool's `tmp/` ([`Work`]) and
//! renamed into place; the steps no image lists are collected after builds and image removals;
//! what a daemon stopped mid-build left is removed at the next start ([`recover`]).

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crab_common::paths::StateDir;

use super::{BUILDING, BUILD_LABEL};
use crate::error::{Result, SandboxError};
use crate::layers::layers_dir;
use crate::{btrfs, image, runtime, Runtime};

/// The persisted record of a step (`<pool>/layers/build-<key>.json`, format 1).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StepRecord {
    pub(super) format: u32,
    pub(super) key: String,
    pub(super) parent: String,
    pub(super) instruction: String,
    pub(super) created_at: u64,
}

/// The id of a step (as image records list it): `build-<key hex>`.
pub(super) fn step_id(key: &str) -> String {
    format!("build-{key}")
}

pub(super) fn step_path(state: &StateDir, key: &str) -> PathBuf {
    layers_dir(state).join(step_id(key))
}

pub(super) fn step_record_path(state: &StateDir, key: &str) -> PathBuf {
    layers_dir(state).join(format!("{}.json", step_id(key)))
}

/// Whether step `key` is complete (record and read-only subvolume).
pub(super) fn step_done(state: &StateDir, key: &str) -> bool {
    let Ok(b) = fs::read(step_record_path(state, key)) else { return false };
    serde_json::from_slice::<StepRecord>(&b).is_ok_and(|r| r.key == key)
        && btrfs::is_subvolume(&step_path(state, key))
}

/// Delete the steps no image lists (and leftovers without a record). Skipped while a build
/// runs (the build collects at its end). Errors are logged: a leftover costs only disk.
pub fn collect_unused(state: &StateDir) {
    let Ok(_one) = BUILDING.try_lock() else { return };
    collect_locked(state);
}

pub(super) fn collect_locked(state: &StateDir) {
    let keep = match image::all_layers(state) {
        Ok(k) => k,
        Err(e) => return tracing::warn!(error = %e, "cannot list images; build steps kept"),
    };
    let Ok(rd) = fs::read_dir(layers_dir(state)) else { return };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if !n.starts_with("build-") {
            continue;
        }
        let id = n.strip_suffix(".json").unwrap_or(&n);
        if keep.contains(id) {
            continue;
        }
        if n.ends_with(".json") {
            let _ = fs::remove_file(e.path());
        } else {
            let _ = btrfs::set_readonly(&e.path(), false);
            if let Err(err) = btrfs::remove_tree(&e.path()) {
                tracing::warn!(path = %e.path().display(), error = %err, "cannot delete an unused build step");
            }
        }
    }
}

/// At daemon start: remove what builds the last daemon stopped mid-way left (build sandboxes,
/// work trees under `tmp/`) and the steps no image lists. Errors are logged.
pub fn recover(rt: &Runtime) {
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    for r in rt.records() {
        if r.labels.contains_key(BUILD_LABEL) {
            tracing::info!(sandbox = %r.name, "removing a build sandbox an interrupted build left");
            if let Err(e) = rt.remove(&r.name, true) {
                tracing::warn!(sandbox = %r.name, error = %e, "cannot remove a leftover build sandbox");
            }
        }
    }
    let tmp = rt.state().tmp();
    if let Ok(rd) = fs::read_dir(&tmp) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("build-step-") {
                let _ = btrfs::set_readonly(&e.path(), false);
                if let Err(err) = btrfs::remove_tree(&e.path()) {
                    tracing::warn!(path = %e.path().display(), error = %err, "cannot remove a leftover build work tree");
                }
            }
        }
    }
    collect_locked(rt.state());
}

/// A writable subvolume under the pool's `tmp/`, deleted on drop unless taken.
pub(super) struct Work(Option<PathBuf>);

impl Work {
    pub(super) fn new(state: &StateDir, parent: Option<&Path>) -> Result<Work> {
        let p = state.tmp().join(format!("build-step-{:08x}", runtime::rand_u32()));
        match parent {
            Some(src) => btrfs::snapshot(src, &p, false)?,
            None => btrfs::create_subvolume(&p)?,
        }
        Ok(Work(Some(p)))
    }

    pub(super) fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new("/nonexistent"))
    }

    /// Make it step `key`: read-only, renamed into the step store, its record written last.
    pub(super) fn commit(
        mut self,
        state: &StateDir,
        key: &str,
        rec: &StepRecord,
    ) -> Result<PathBuf> {
        let dir = layers_dir(state);
        fs::create_dir_all(&dir).map_err(SandboxError::io("create", &dir))?;
        let dst = step_path(state, key);
        let _ = fs::remove_file(step_record_path(state, key));
        if dst.exists() {
            // --no-cache, or a leftover without a record: replaced.
            let _ = btrfs::set_readonly(&dst, false);
            btrfs::remove_tree(&dst).map_err(SandboxError::io("delete subvolume", &dst))?;
        }
        let src = self.0.take().unwrap_or_default();
        // Rename first: a read-only subvolume cannot be moved.
        if let Err(e) = fs::rename(&src, &dst) {
            self.0 = Some(src.clone());
            return Err(SandboxError::io("rename", &src)(e));
        }
        self.0 = Some(dst.clone());
        btrfs::set_readonly(&dst, true)?;
        let bytes =
            serde_json::to_vec_pretty(rec).map_err(|e| SandboxError::Other(e.to_string()))?;
        runtime::write_atomic(&step_record_path(state, key), &bytes)?;
        self.0 = None;
        Ok(dst)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = btrfs::set_readonly(&p, false);
            if let Err(e) = btrfs::remove_tree(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove a build step's work tree");
            }
        }
    }
}
