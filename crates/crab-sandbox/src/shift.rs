//! Images shifted once into the sandboxes' user-namespace range.
//!
//! A user-namespaced sandbox sees host uid `base + n` as uid `n`; an image's files, owned by
//! their in-image ids (root's by 0), would appear there as owned by the unmapped "nobody".
//! Rather than shift every sandbox's root (a walk of the whole tree on each create) or rely on
//! idmapped mounts (which CRIU 4.2 neither dumps nor restores: a restored root would come back
//! unshifted), each image gets one shifted copy per range: a btrfs snapshot of the image whose
//! every entry is `lchown`ed by the range's base, made read-only and kept under
//! `<pool>/shifted/`. Sandboxes of that range are snapshots of it, as sandboxes of the host's
//! range are snapshots of the image itself, so a create costs the same one ioctl either way,
//! and every later point is a snapshot of an already shifted tree.
//!
//! Ids the range does not map (≥ 65536) become the namespace's `nobody` (65534), never a host
//! id outside the range. `chown` clears set-id bits and file capabilities; both are put back
//! (a sandbox's `no_new_privs` makes neither grant anything, but `ls -l` and package managers
//! see the image as built). A shifted copy is named after the image and the identity of its
//! build (its record's modification time) and of the shift's own version, so a rebuilt or
//! re-imported image is shifted afresh and the old copy deleted; removing an image removes its
//! copies.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crab_common::api::IdRange;
use crab_common::paths::StateDir;

use crate::btrfs;
use crate::error::{Result, SandboxError};

/// Directory of shifted images, under the pool.
pub fn dir(state: &StateDir) -> PathBuf {
    state.pool().join("shifted")
}

/// Serializes the making of shifted copies (two creates of one new image shift it once).
static SHIFTING: Mutex<()> = Mutex::new(());

fn prefix(image: &str, ids: IdRange) -> String {
    format!("{image}@{}:{}:{}@", ids.uid, ids.gid, ids.count)
}

/// The root subvolume sandboxes of `ids` are made from: the shifted copy of `image` (whose
/// own root is `image_root`), made now if there is none for this build of the image.
pub fn rootfs_for(
    state: &StateDir,
    image: &str,
    image_root: &Path,
    ids: IdRange,
) -> Result<PathBuf> {
    let rec = state.image_record(image);
    let key = build_key(state, image)
        .ok_or_else(|| SandboxError::io("stat", &rec)(std::io::ErrorKind::NotFound.into()))?;
    let dst = dir(state).join(format!("{}{key}", prefix(image, ids)));
    if btrfs::is_subvolume(&dst) {
        return Ok(dst);
    }
    let _one = SHIFTING.lock().unwrap_or_else(|p| p.into_inner());
    if btrfs::is_subvolume(&dst) {
        return Ok(dst);
    }
    let d = dir(state);
    fs::create_dir_all(&d).map_err(SandboxError::io("mkdir", &d))?;
    let work = state.tmp().join(format!("shift-{image}-{:08x}", crate::runtime::rand_u32()));
    btrfs::snapshot(image_root, &work, false)?;
    let made = shift_tree(&work, ids)
        .and_then(|()| fs::rename(&work, &dst).map_err(SandboxError::io("rename", &work)))
        .and_then(|()| btrfs::set_readonly(&dst, true).map_err(Into::into));
    if let Err(e) = made {
        let _ = btrfs::remove_tree(&work);
        let _ = btrfs::set_readonly(&dst, false);
        let _ = btrfs::remove_tree(&dst);
        return Err(e);
    }
    // Older builds' copies for this range are never used again.
    for old in copies(state, image) {
        if old != dst
            && old.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix(image, ids)))
        {
            forget_copy(&old);
        }
    }
    Ok(dst)
}

/// Version of what [`shift_tree`] does, part of every copy's name: a copy an older version made
/// (2: hard links shifted once; 1 shifted them once per name, making them `nobody`'s) is made
/// again.
const SHIFT_VERSION: u32 = 2;

fn build_key(state: &StateDir, image: &str) -> Option<String> {
    let m = fs::metadata(state.image_record(image)).ok()?;
    Some(format!("v{SHIFT_VERSION}.{}.{:09}", m.mtime(), m.mtime_nsec()))
}

/// The shifted copy of `image` for `ids` of the image's current build, if it was made.
pub fn existing(state: &StateDir, image: &str, ids: IdRange) -> Option<PathBuf> {
    let dst = dir(state).join(format!("{}{}", prefix(image, ids), build_key(state, image)?));
    btrfs::is_subvolume(&dst).then_some(dst)
}

/// The shifted copies of `image`'s current build: their ranges and roots.
pub fn current_copies(state: &StateDir, image: &str) -> Vec<(IdRange, PathBuf)> {
    let Some(key) = build_key(state, image) else { return Vec::new() };
    let mut out = Vec::new();
    for p in copies(state, image) {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut parts = name.splitn(3, '@').skip(1);
        let (Some(range), Some(k)) = (parts.next(), parts.next()) else { continue };
        let ids: Vec<u32> = range.split(':').filter_map(|x| x.parse().ok()).collect();
        if k == key && ids.len() == 3 && btrfs::is_subvolume(&p) {
            out.push((IdRange { uid: ids[0], gid: ids[1], count: ids[2] }, p));
        }
    }
    out
}

/// Every shifted copy of `image`.
fn copies(state: &StateDir, image: &str) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(dir(state)) else { return Vec::new() };
    let want = format!("{image}@");
    rd.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&want))
        .map(|e| e.path())
        .collect()
}

fn forget_copy(p: &Path) {
    let _ = btrfs::set_readonly(p, false);
    if let Err(e) = btrfs::remove_tree(p) {
        tracing::warn!(path = %p.display(), error = %e, "cannot delete a stale shifted image");
    }
}

/// Delete every shifted copy of `image` (it is removed or replaced).
pub fn forget(state: &StateDir, image: &str) {
    for p in copies(state, image) {
        forget_copy(&p);
    }
}

/// The host id of an in-image id: shifted into the range, or the range's `nobody`.
fn shifted(base: u32, count: u32, id: u32) -> u32 {
    const NOBODY: u32 = 65534;
    base + if id < count { id } else { NOBODY.min(count - 1) }
}

/// `lchown` every entry under `root` (itself included) into `ids`, keeping set-id bits and
/// file capabilities. Symlinks are never followed; mount points are not crossed (a fresh
/// snapshot has none). An inode with several names (a hard link: `perl` and `perl5.36.0`,
/// `gzip` and `gunzip`) is shifted once — shifted again, its already shifted owner would be
/// past the range and become `nobody`, who could then write it.
pub fn shift_tree(root: &Path, ids: IdRange) -> Result<()> {
    map_tree(root, |uid, gid| (shifted(ids.uid, ids.count, uid), shifted(ids.gid, ids.count, gid)))
}

/// The reverse of [`shift_tree`]: every entry under `root` owned by the range's ids gets the
/// in-image id again (what a sandbox of the range made becomes the image's), the host's root
/// stays root (directories the daemon made), any other id becomes `nobody` (65534). For trees
/// sandboxes wrote that become images again (`crab image build`'s steps, `image commit`).
pub fn unshift_tree(root: &Path, ids: IdRange) -> Result<()> {
    map_tree(root, |uid, gid| {
        (unshifted(ids.uid, ids.count, uid), unshifted(ids.gid, ids.count, gid))
    })
}

/// The in-image id of host id `id` of a range.
fn unshifted(base: u32, count: u32, id: u32) -> u32 {
    const NOBODY: u32 = 65534;
    if id >= base && id - base < count {
        id - base
    } else if id == 0 {
        0
    } else {
        NOBODY
    }
}

fn map_tree(root: &Path, f: impl Fn(u32, u32) -> (u32, u32)) -> Result<()> {
    let dev = fs::symlink_metadata(root).map_err(SandboxError::io("stat", root))?.dev();
    let mut stack = vec![root.to_path_buf()];
    let mut linked = std::collections::HashSet::new();
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).map_err(SandboxError::io("stat", &p))?;
        if m.is_dir() && m.dev() == dev {
            for e in fs::read_dir(&p).map_err(SandboxError::io("list", &p))? {
                stack.push(e.map_err(SandboxError::io("list", &p))?.path());
            }
        }
        if !m.is_dir() && m.nlink() > 1 && !linked.insert(m.ino()) {
            continue;
        }
        let (uid, gid) = f(m.uid(), m.gid());
        if (uid, gid) != (m.uid(), m.gid()) {
            shift_one(&p, &m, uid, gid)?;
        }
    }
    Ok(())
}

fn shift_one(p: &Path, m: &fs::Metadata, uid: u32, gid: u32) -> Result<()> {
    const CAPS: &str = "security.capability";
    let caps = if m.is_file() { xattr::get(p, CAPS).ok().flatten() } else { None };
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).map_err(SandboxError::io("chown", p))?;
    if m.is_file() || m.is_dir() {
        let mode = m.permissions().mode();
        if mode & 0o6000 != 0 {
            fs::set_permissions(p, fs::Permissions::from_mode(mode & 0o7777))
                .map_err(SandboxError::io("chmod", p))?;
        }
    }
    if let Some(c) = caps {
        xattr::set(p, CAPS, &c).map_err(SandboxError::io("set security.capability on", p))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test
    use super::*;

    /// Needs root (chown to other ids); skipped otherwise, as the crate's other unit tests
    /// that touch ownership are (the integration tests run it for real, through a create).
    #[test]
    fn hard_links_are_shifted_once_and_set_id_bits_kept() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var_os("CRAB_REQUIRE_PRIVILEGED").is_none(),
                "needs root (CRAB_REQUIRE_PRIVILEGED)"
            );
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        fs::write(&a, "x").unwrap();
        fs::hard_link(&a, d.path().join("b")).unwrap();
        fs::set_permissions(&a, fs::Permissions::from_mode(0o4755)).unwrap();
        std::os::unix::fs::lchown(&a, Some(0), Some(0)).unwrap();
        fs::set_permissions(&a, fs::Permissions::from_mode(0o4755)).unwrap();
        let ids = IdRange { uid: 100_000, gid: 200_000, count: 65536 };
        shift_tree(d.path(), ids).unwrap();
        for n in ["a", "b"] {
            let m = fs::symlink_metadata(d.path().join(n)).unwrap();
            assert_eq!((m.uid(), m.gid()), (100_000, 200_000), "{n}");
            assert_eq!(m.permissions().mode() & 0o7777, 0o4755, "{n}");
        }
    }

    #[test]
    fn unmapped_ids_become_the_namespace_nobody() {
        assert_eq!(shifted(1000, 65536, 0), 1000);
        assert_eq!(shifted(1000, 65536, 1000), 2000);
        assert_eq!(shifted(1000, 65536, 65535), 66535);
        assert_eq!(shifted(1000, 65536, 65536), 1000 + 65534);
        assert_eq!(shifted(1000, 65536, u32::MAX), 1000 + 65534);
        assert_eq!(unshifted(1000, 65536, 2000), 1000);
        assert_eq!(unshifted(1000, 65536, 0), 0);
        assert_eq!(unshifted(1000, 65536, 500), 65534);
    }
}
