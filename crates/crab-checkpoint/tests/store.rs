//! Tests of the restore-point store on a plain filesystem ([`CopyFs`]): publication of every
//! kind, parent links and inherited parts, verification of corrupt / missing / extra files,
//! crash leftovers, prune with shared parts, id continuity across reopen.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::sync::Arc;

use crab_checkpoint::manifest::{self, Origin};
use crab_checkpoint::{CheckpointError, CopyFs, Draft, PointId, Store};
use crab_common::{CheckpointKind, PointKind};

fn open(dir: &Path) -> Store {
    Store::open(dir.join("checkpoints/sb1"), "sb1", Arc::new(CopyFs)).unwrap()
}

fn rootfs(dir: &Path, content: &str) -> std::path::PathBuf {
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/state"), content).unwrap();
    root
}

/// Stage a fake CRIU image and/or a snapshot of `root`, then publish.
fn checkpoint(
    store: &Store,
    kind: CheckpointKind,
    turn: u64,
    root: &Path,
) -> crab_checkpoint::Manifest {
    let mut st = store.begin();
    if matches!(kind, CheckpointKind::Full | CheckpointKind::Process) {
        let d = st.proc_dir().unwrap();
        std::fs::write(d.join("inventory.img"), format!("inv {turn}")).unwrap();
        std::fs::write(d.join("pages-1.img"), vec![turn as u8; 10_000]).unwrap();
    }
    if matches!(kind, CheckpointKind::Full | CheckpointKind::Fs) {
        st.snapshot_fs(root).unwrap();
    }
    let mut draft = Draft::new(kind, turn);
    draft.root_pid = 42;
    draft.criu_version = "4.2.1".into();
    st.publish(draft).unwrap()
}

#[test]
fn publish_every_kind_and_inherit_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");

    assert!(matches!(store.newest(), Err(CheckpointError::NoPoints { .. })));
    // A skip with nothing to reference is refused.
    let err = store.begin().publish(Draft::new(CheckpointKind::Skip, 0)).unwrap_err();
    assert!(matches!(err, CheckpointError::Invalid(_)), "{err}");

    let c1 = checkpoint(&store, CheckpointKind::Full, 1, &root);
    assert_eq!(c1.id, PointId(1));
    assert_eq!(c1.parent, None);
    let p1 = c1.procs.clone().unwrap();
    let f1 = c1.fs.clone().unwrap();
    assert_eq!(p1.files.len(), 2);
    assert_eq!(p1.bytes, 10_000 + 5);
    assert!(c1.timings.hash_us.is_some());

    let c2 = checkpoint(&store, CheckpointKind::Skip, 2, &root);
    assert_eq!(c2.parent, Some(c1.id));
    assert_eq!(c2.procs, c1.procs);
    assert_eq!(c2.fs, c1.fs);

    std::fs::write(root.join("etc/state"), "v3").unwrap();
    let c3 = checkpoint(&store, CheckpointKind::Fs, 3, &root);
    assert_eq!(c3.procs.as_ref().unwrap().id, p1.id, "fs checkpoint keeps the process image");
    assert_ne!(c3.fs.as_ref().unwrap().id, f1.id);

    let c4 = checkpoint(&store, CheckpointKind::Process, 4, &root);
    assert_eq!(c4.fs, c3.fs, "process checkpoint keeps the filesystem snapshot");
    assert_ne!(c4.procs.as_ref().unwrap().id, p1.id);

    let ids: Vec<_> = store.list().unwrap().iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![PointId(1), PointId(2), PointId(3), PointId(4)]);
    for m in store.list().unwrap() {
        store.verify(&m).unwrap();
    }
    // The snapshot keeps the content of its time.
    let f3 = store.fs_path(c3.fs.unwrap().id);
    assert_eq!(std::fs::read_to_string(f3.join("etc/state")).unwrap(), "v3");
    let f1p = store.fs_path(f1.id);
    assert_eq!(std::fs::read_to_string(f1p.join("etc/state")).unwrap(), "v1");
    assert_eq!(store.resolve(None).unwrap().id, PointId(4));
    assert_eq!(store.resolve(Some("2")).unwrap().id, PointId(2));
    assert_eq!(store.resolve(Some("c000003")).unwrap().id, PointId(3));
    assert!(matches!(store.resolve(Some("c9")), Err(CheckpointError::NotFound { .. })));
    assert!(matches!(store.resolve(Some("x")), Err(CheckpointError::Invalid(_))));
}

#[test]
fn kind_must_match_staged_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    let mut st = store.begin();
    st.snapshot_fs(&root).unwrap();
    let err = st.publish(Draft::new(CheckpointKind::Full, 1)).unwrap_err();
    assert!(matches!(err, CheckpointError::Invalid(_)));
    // The failed staging was discarded.
    assert_eq!(std::fs::read_dir(store.dir().join("tmp")).unwrap().count(), 0);
}

#[test]
fn fs_only_point_without_processes() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    checkpoint(&store, CheckpointKind::Full, 1, &root);
    let mut st = store.begin();
    st.snapshot_fs(&root).unwrap();
    let mut d = Draft::new(CheckpointKind::Fs, 2);
    d.no_procs = true;
    d.origin = Some(Origin { sandbox: "other".into(), point: PointId(9) });
    let m = st.publish(d).unwrap();
    assert!(m.procs.is_none());
    assert_eq!(store.load(m.id).unwrap(), m);
}

#[test]
fn flipped_missing_and_extra_image_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    let m = checkpoint(&store, CheckpointKind::Full, 1, &root);
    let dir = store.proc_dir(m.procs.as_ref().unwrap().id);
    let pages = dir.join("pages-1.img");

    // One flipped byte.
    let mut bytes = std::fs::read(&pages).unwrap();
    bytes[4321] ^= 0x40;
    std::fs::write(&pages, &bytes).unwrap();
    let err = store.verify(&m).unwrap_err();
    assert!(matches!(&err, CheckpointError::Corrupt { path, .. } if path == &pages), "{err}");
    assert!(err.to_string().contains("pages-1.img"));
    assert_eq!(err.to_api().code, crab_common::ErrorCode::CorruptCheckpoint);
    bytes[4321] ^= 0x40;
    std::fs::write(&pages, &bytes).unwrap();
    store.verify(&m).unwrap();

    // Truncated.
    std::fs::write(&pages, &bytes[..100]).unwrap();
    assert!(store.verify(&m).unwrap_err().to_string().contains("size is 100"));
    std::fs::write(&pages, &bytes).unwrap();

    // Extra file.
    std::fs::write(dir.join("core-99.img"), b"x").unwrap();
    assert!(store.verify(&m).unwrap_err().to_string().contains("core-99.img"));
    std::fs::remove_file(dir.join("core-99.img")).unwrap();

    // Missing file.
    std::fs::remove_file(dir.join("inventory.img")).unwrap();
    assert!(store.verify(&m).unwrap_err().to_string().contains("missing"));

    // Missing snapshot.
    let m2 = checkpoint(&store, CheckpointKind::Full, 2, &root);
    std::fs::remove_dir_all(store.fs_path(m2.fs.as_ref().unwrap().id)).unwrap();
    assert!(store.verify(&m2).unwrap_err().to_string().contains("snapshot is missing"));
}

#[test]
fn corrupt_manifest_is_refused_by_name_and_skipped_by_newest() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    checkpoint(&store, CheckpointKind::Full, 1, &root);
    let m2 = checkpoint(&store, CheckpointKind::Skip, 2, &root);
    let path = store.manifest_path(m2.id);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let err = store.load(m2.id).unwrap_err();
    assert!(matches!(&err, CheckpointError::Corrupt { path: p, .. } if p == &path), "{err}");
    assert_eq!(store.newest().unwrap().id, PointId(1));
    let all = store.list_all().unwrap();
    assert_eq!(all.len(), 2);
    assert!(all[1].1.is_err());
    // A manifest copied under another id is refused too.
    std::fs::copy(store.manifest_path(PointId(1)), store.manifest_path(PointId(5))).unwrap();
    assert!(store.load(PointId(5)).unwrap_err().to_string().contains("not sb1/c000005"));
}

#[test]
fn leftovers_of_a_crash_are_discarded_and_older_points_survive() {
    let tmp = tempfile::tempdir().unwrap();
    let root = rootfs(tmp.path(), "v1");
    {
        let store = open(tmp.path());
        checkpoint(&store, CheckpointKind::Full, 1, &root);
        // A checkpoint that "crashed" at each stage: staged parts in tmp/ (leaked on purpose
        // as a killed daemon would), parts moved but no manifest, a half-written manifest.
        let mut st = store.begin();
        let d = st.proc_dir().unwrap();
        std::fs::write(d.join("pages-1.img"), b"partial").unwrap();
        st.snapshot_fs(&root).unwrap();
        std::mem::forget(st);
        std::fs::create_dir(store.dir().join("procs/p000007")).unwrap();
        std::fs::write(store.dir().join("points/c000009.manifest.tmp"), b"crab-restore-po")
            .unwrap();
    }
    let store = open(tmp.path());
    let report = store.recover_leftovers().unwrap();
    assert_eq!(report.removed.len(), 4, "{report:?}");
    assert_eq!(std::fs::read_dir(store.dir().join("tmp")).unwrap().count(), 0);
    let m = store.newest().unwrap();
    assert_eq!(m.id, PointId(1));
    store.verify(&m).unwrap();
    // Ids are never reused, even those of discarded leftovers.
    let m2 = checkpoint(&store, CheckpointKind::Full, 2, &root);
    assert_eq!(m2.id, PointId(10));
    assert!(m2.procs.unwrap().id.0 > 7);
}

#[test]
fn prune_keeps_parts_referenced_by_kept_points() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    let c1 = checkpoint(&store, CheckpointKind::Full, 1, &root); // p1 f1
    let _c2 = checkpoint(&store, CheckpointKind::Full, 2, &root); // p2 f2
    let _c3 = checkpoint(&store, CheckpointKind::Fs, 3, &root); // p2 f3
    let _c4 = checkpoint(&store, CheckpointKind::Skip, 4, &root); // p2 f3
    assert!(store.prune(0).is_err());
    let r = store.prune(2).unwrap();
    assert_eq!(r.points, vec![PointId(1), PointId(2)]);
    assert_eq!(r.procs, vec![c1.procs.unwrap().id]);
    assert_eq!(r.fs.len(), 2, "{r:?}");
    let left = store.list().unwrap();
    assert_eq!(left.len(), 2);
    for m in &left {
        store.verify(m).unwrap();
    }
    // Nothing more to prune.
    assert_eq!(store.prune(2).unwrap(), Default::default());
    let r = store.prune(1).unwrap();
    assert_eq!(r.points, vec![PointId(3)]);
    assert!(r.procs.is_empty() && r.fs.is_empty(), "{r:?}");
}

#[test]
fn manifest_file_is_self_describing_text() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    let m = checkpoint(&store, CheckpointKind::Full, 1, &root);
    let text = std::fs::read_to_string(store.manifest_path(m.id)).unwrap();
    assert!(text.starts_with(&format!("{} {}\n", manifest::MAGIC, manifest::FORMAT_VERSION)));
    assert!(text.contains("\"sha256\""));
    assert!(text.contains("\"kind\": \"full\""));
    store.remove_all().unwrap();
    assert!(!store.dir().exists());
}

#[test]
fn restore_marker_builds_on_an_older_base() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let root = rootfs(tmp.path(), "v1");
    let c1 = checkpoint(&store, CheckpointKind::Full, 1, &root);
    std::fs::write(root.join("etc/state"), "v2").unwrap();
    let c2 = checkpoint(&store, CheckpointKind::Full, 2, &root);
    // Restored to c1: the marker references c1's parts and becomes the newest point.
    let mut d = Draft::new(PointKind::Restore, c1.turn);
    d.base = Some(c1.id);
    let m = store.begin().publish(d).unwrap();
    assert_eq!(
        (m.parent, m.procs.clone(), m.fs.clone()),
        (Some(c1.id), c1.procs.clone(), c1.fs.clone())
    );
    assert_eq!(store.newest().unwrap().id, m.id);
    // A skip now inherits c1's parts through the marker, not c2's.
    let s = checkpoint(&store, CheckpointKind::Skip, 2, &root);
    assert_eq!(s.fs, c1.fs);
    assert_ne!(s.fs, c2.fs);
    // A restore point cannot carry new parts.
    let mut st = store.begin();
    st.snapshot_fs(&root).unwrap();
    assert!(st.publish(Draft::new(PointKind::Restore, 3)).is_err());
}

/// Recovery's `try_lock` never creates the lock file: during a removal (the remover holds the
/// lock and is deleting the directory) it must not put an entry back, or the removed
/// sandbox's store would stay behind.
#[test]
fn try_lock_creates_nothing_in_a_store_being_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let lock = store.dir().join("lock");
    assert!(store.try_lock().unwrap().is_none(), "no lock file yet: nothing to recover");
    assert!(!lock.exists(), "try_lock created {}", lock.display());

    let held = store.lock().unwrap();
    assert!(store.try_lock().unwrap().is_none(), "held elsewhere");
    // The remover unlinks the lock file before the directory goes.
    std::fs::remove_file(&lock).unwrap();
    assert!(store.try_lock().unwrap().is_none());
    assert!(!lock.exists(), "try_lock brought the lock file back");
    drop(held);
    store.remove_all().unwrap();
    assert!(!store.dir().exists());

    let again = open(tmp.path());
    drop(again.lock().unwrap());
    assert!(again.try_lock().unwrap().is_some(), "an existing, free lock is taken");
}
