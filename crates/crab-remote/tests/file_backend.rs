//! The repository against the `file://` backend: round trips of a point (tree, process
//! images, conversation, manifest), dedup across points, corrupt and missing chunks refused
//! naming the object, check, prune under the lock, encryption.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crab_remote::{ExportSource, ImportTarget, Key, RemoteError, Repo, RepoOptions};

fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn make_tree(root: &Path) {
    std::fs::create_dir_all(root.join("etc/sub")).expect("mkdir");
    std::fs::write(root.join("etc/hosts"), b"127.0.0.1 localhost\n").expect("write");
    std::fs::write(root.join("empty"), b"").expect("write");
    std::fs::write(root.join("big.bin"), noise(1, 3 * 1024 * 1024 + 17)).expect("write");
    std::fs::write(root.join("etc/sub/mid.bin"), noise(2, 300 * 1024)).expect("write");
    std::fs::set_permissions(root.join("etc/hosts"), std::fs::Permissions::from_mode(0o4755))
        .expect("chmod");
    std::os::unix::fs::symlink("../etc/hosts", root.join("etc/sub/link")).expect("symlink");
    std::os::unix::fs::symlink("/nonexistent/target", root.join("dangling")).expect("symlink");
    nix_mkfifo(&root.join("fifo"));
}

fn nix_mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("cstring");
    // SAFETY: valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o640) }, 0, "mkfifo");
}

/// path → (kind, mode, uid, gid, mtime, content or link target)
fn describe(root: &Path) -> BTreeMap<PathBuf, (String, u32, u32, i64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for de in std::fs::read_dir(&dir).expect("readdir") {
            let p = de.expect("entry").path();
            let m = std::fs::symlink_metadata(&p).expect("stat");
            let rel = p.strip_prefix(root).expect("rel").to_path_buf();
            let (kind, data) = if m.is_dir() {
                stack.push(p.clone());
                ("dir", vec![])
            } else if m.file_type().is_symlink() {
                (
                    "link",
                    std::fs::read_link(&p).expect("readlink").into_os_string().into_encoded_bytes(),
                )
            } else if m.is_file() {
                ("file", std::fs::read(&p).expect("read"))
            } else {
                ("other", vec![])
            };
            let mode = if kind == "link" { 0 } else { m.mode() & 0o7777 };
            out.insert(rel, (kind.to_string(), mode, m.uid(), m.mtime(), data));
        }
    }
    out
}

struct Fixture {
    dir: tempfile::TempDir,
    url: String,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("file://{}/repo", dir.path().display());
        Fixture { dir, url }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    async fn repo(&self, cache: &str) -> Repo {
        Repo::open(
            &self.url,
            RepoOptions { key_file: None, cache_dir: self.path(cache), bandwidth_bps: None },
        )
        .await
        .expect("open repo")
    }

    fn source(&self, point: &str, fs: &Path) -> ExportSource {
        ExportSource {
            sandbox: "sb1".into(),
            point: point.into(),
            turn: 3,
            kind: "full".into(),
            created_at_ms: 1000 + point.len() as u64,
            manifest: format!("manifest of {point}\n").into_bytes(),
            fs_dir: Some(fs.to_path_buf()),
            procs_dir: Some(self.path("procs")),
            criu_version: Some("4.2.1".into()),
            conversation: Some(b"CRABCONV 1\nhello".to_vec()),
            image: None,
            image_origin: None,
            immutable_parts: false,
        }
    }
}

fn setup(fx: &Fixture) -> PathBuf {
    let root = fx.path("root");
    make_tree(&root);
    std::fs::create_dir_all(fx.path("procs")).expect("mkdir");
    std::fs::write(fx.path("procs/pages-1.img"), noise(9, 2 * 1024 * 1024)).expect("write");
    std::fs::write(fx.path("procs/core-1.img"), b"core").expect("write");
    root
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_round_trips_through_a_fresh_cache() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = fx.repo("cache-a").await;
    let rep = repo.export_point(&fx.source("c000001", &root)).await.expect("export");
    assert!(rep.uploaded_bytes > 3 * 1024 * 1024, "uploaded {}", rep.uploaded_bytes);

    // Another "host": a new Repo with an empty cache.
    let other = fx.repo("cache-b").await;
    let points = other.list_points(None).await.expect("ls");
    assert_eq!(points.len(), 1);
    let rec = other.load_point("sb1", Some("c1")).await.expect("load by short id");
    std::fs::create_dir(fx.path("out-fs")).expect("mkdir");
    std::fs::create_dir(fx.path("out-procs")).expect("mkdir");
    let imp = other
        .import_point(
            &rec,
            &ImportTarget {
                fs_dir: Some(fx.path("out-fs")),
                procs_dir: Some(fx.path("out-procs")),
            },
        )
        .await
        .expect("import");
    assert_eq!(imp.manifest, b"manifest of c000001\n");
    assert_eq!(imp.conversation.as_deref(), Some(&b"CRABCONV 1\nhello"[..]));
    assert_eq!(describe(&root), describe(&fx.path("out-fs")));
    assert_eq!(describe(&fx.path("procs")), describe(&fx.path("out-procs")));
    let fifo = std::fs::symlink_metadata(fx.path("out-fs/fifo")).expect("fifo");
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&fifo.file_type()));
    let check = other.check().await.expect("check");
    assert!(check.errors.is_empty(), "{:?}", check.errors);
    assert_eq!(check.points, 1);
}

/// A tree of many download windows (`FEED_WINDOW`): a file larger than a window, the same
/// content in two files far apart (its chunks are read twice, downloaded once), hard links;
/// the restore downloads ahead of its writes and comes back byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_of_many_download_windows_restores_exactly() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let window = crab_remote::tree::FEED_WINDOW as usize;
    std::fs::create_dir_all(root.join("a/deep/er")).expect("mkdir");
    std::fs::create_dir_all(root.join("z")).expect("mkdir");
    std::fs::write(root.join("a/huge.bin"), noise(21, window + window / 2 + 7)).expect("write");
    for i in 0..6u64 {
        std::fs::write(root.join(format!("a/deep/er/f{i}")), noise(30 + i, window / 3))
            .expect("write");
    }
    let twin = noise(40, window / 2);
    std::fs::write(root.join("a/twin"), &twin).expect("write");
    std::fs::write(root.join("z/twin"), &twin).expect("write");
    std::fs::hard_link(root.join("a/deep/er/f0"), root.join("z/link")).expect("link");
    let out = export_and_import_fs(&fx, &root, "out").await;
    assert_eq!(ino(&out.join("a/deep/er/f0")).0, ino(&out.join("z/link")).0);
}

/// A sandbox removed and made again starts its point ids over: the newest point is the one
/// the store wrote last, not the largest id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newest_point_is_the_last_written_not_the_largest_id() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = fx.repo("cache-a").await;
    for p in ["c000001", "c000009"] {
        repo.export_point(&fx.source(p, &root)).await.expect("export");
    }
    assert_eq!(repo.load_point("sb1", None).await.expect("newest").point, "c000009");
    // The store's clock orders records written in different milliseconds.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    repo.export_point(&fx.source("c000002", &root)).await.expect("export");
    let other = fx.repo("cache-b").await;
    assert_eq!(other.load_point("sb1", None).await.expect("newest").point, "c000002");
    assert_eq!(other.load_point("sb1", Some("9")).await.expect("by id").point, "c000009");
}

/// A point record is never overwritten by another point of the same name (an earlier
/// sandbox of that name, another host's): that export fails naming both, and the remote keeps
/// the first. The same point exported again (a retry, a restarted host) is written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_point_under_a_taken_name_is_refused_and_the_first_is_kept() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = fx.repo("cache").await;
    let first = repo.export_point(&fx.source("c000001", &root)).await.expect("export");
    let again =
        repo.export_point(&fx.source("c000001", &root)).await.expect("the same point again");
    assert_eq!(again.record.created_at_ms, first.record.created_at_ms);
    // A new sandbox of the same name: its own c000001, taken later.
    let mut other = fx.source("c000001", &root);
    other.created_at_ms += 5000;
    other.manifest = b"manifest of the second sandbox's c000001\n".to_vec();
    let err = fx.repo("cache-b").await.export_point(&other).await.expect_err("overwrote it");
    assert!(matches!(err, RemoteError::PointTaken { .. }), "{err}");
    assert!(err.to_string().contains("sb1@c000001"), "{err}");
    let kept = fx.repo("cache-c").await.load_point("sb1", Some("c000001")).await.expect("load");
    assert_eq!(kept.created_at_ms, first.record.created_at_ms, "the first point was replaced");
    assert_eq!(kept.manifest, first.record.manifest);
    // The remote's numbering, for the next sandbox of that name.
    assert_eq!(repo.highest_point("sb1").await.expect("list"), Some(1));
    assert_eq!(repo.highest_point("nobody").await.expect("list"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unchanged_tree_uploads_only_a_manifest() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = fx.repo("cache").await;
    let first = repo.export_point(&fx.source("c000001", &root)).await.expect("export 1");
    let second = repo.export_point(&fx.source("c000002", &root)).await.expect("export 2");
    // Only the new manifest blob (its pack + index entry) and the point record.
    assert!(second.uploaded_bytes < 4096, "second export uploaded {} bytes", second.uploaded_bytes);
    assert_eq!(second.new_blobs, 1, "only the manifest is new");
    assert_eq!(second.read_bytes, 0, "no unchanged file is read again");
    // A third point on another Repo (another host, no file cache) still dedups by content.
    std::fs::write(root.join("etc/sub/new.txt"), b"one new file").expect("write");
    let other = fx.repo("cache2").await;
    let third = other.export_point(&fx.source("c000003", &root)).await.expect("export 3");
    assert!(third.uploaded_bytes < 8192, "third export uploaded {} bytes", third.uploaded_bytes);
    assert!(first.uploaded_bytes > 100 * third.uploaded_bytes);
}

/// Issue 32: what an export learned survives the daemon. A new `Repo` on the same cache
/// directory (a restarted daemon) neither rereads unchanged files nor walks known immutable
/// parts; a cache file that does not check out is ignored (the export reads everything, and
/// is right).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_repo_remembers_what_it_exported() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let first =
        fx.repo("cache").await.export_point(&fx.source("c000001", &root)).await.expect("ok");
    assert!(first.read_bytes > 3 * 1024 * 1024, "{}", first.read_bytes);
    let saved = std::fs::read(fx.path("cache").join(crab_remote::cache::FILE)).expect("ok");
    let (files, _) = crab_remote::cache::count(&saved).expect("ok");
    assert!(files >= 5, "{files} file entries saved");
    // A restarted daemon: a new Repo on the same cache directory.
    let again =
        fx.repo("cache").await.export_point(&fx.source("c000002", &root)).await.expect("ok");
    assert_eq!(again.read_bytes, 0, "no unchanged file is read again after a reopen");
    assert_eq!(again.record.fs, first.record.fs);
    // Immutable parts: not even walked.
    let mut a = fx.source("c000003", &root);
    a.immutable_parts = true;
    let walked = fx.repo("cache").await.export_point(&a).await.expect("ok");
    assert!(walked.walked_entries > 0);
    let mut b = fx.source("c000004", &root);
    b.immutable_parts = true;
    let skipped = fx.repo("cache").await.export_point(&b).await.expect("ok");
    assert_eq!((skipped.walked_entries, skipped.read_bytes), (0, 0));
    assert_eq!(skipped.record.fs, walked.record.fs);
    // A damaged cache file is ignored: everything is read again, and the tree is the same.
    let path = fx.path("cache").join(crab_remote::cache::FILE);
    let mut bytes = std::fs::read(&path).expect("ok");
    bytes[10] ^= 0x20;
    std::fs::write(&path, &bytes).expect("ok");
    let cold = fx.repo("cache").await.export_point(&fx.source("c000005", &root)).await.expect("ok");
    assert_eq!(cold.read_bytes, first.read_bytes);
    assert_eq!(cold.record.fs, first.record.fs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immutable_parts_exported_before_are_not_walked_again() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = fx.repo("cache").await;
    let mut src = fx.source("c000001", &root);
    src.immutable_parts = true;
    let first = repo.export_point(&src).await.expect("export 1");
    assert!(first.walked_entries > 0);
    // A skip point: the same snapshot and image directory as the point before.
    let mut skip = fx.source("c000002", &root);
    skip.immutable_parts = true;
    let second = repo.export_point(&skip).await.expect("export 2");
    assert_eq!(second.walked_entries, 0, "known immutable parts are not walked");
    assert_eq!(second.read_bytes, 0);
    assert_eq!(second.record.fs, first.record.fs, "same tree as the point before");
    assert_eq!(second.record.procs, first.record.procs);
    assert_eq!(second.record.size_bytes, first.record.size_bytes, "sizes still counted");
    assert!(second.uploaded_bytes < 4096, "uploaded {} bytes", second.uploaded_bytes);
    // Another Repo (another host) has no such knowledge: it walks, and finds the same trees.
    let other = fx.repo("cache2").await;
    let mut third = fx.source("c000003", &root);
    third.immutable_parts = true;
    let third = other.export_point(&third).await.expect("export 3");
    assert!(third.walked_entries > 0);
    assert_eq!(third.record.fs, first.record.fs);
    // A mutable part is always walked, so a change below its root is seen.
    std::fs::write(root.join("etc/sub/changed.txt"), b"changed below the root").expect("write");
    let fourth = repo.export_point(&fx.source("c000004", &root)).await.expect("export 4");
    assert!(fourth.walked_entries > 0);
    assert_ne!(fourth.record.fs, first.record.fs, "the change is exported");
}

fn pack_files(fx: &Fixture) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in std::fs::read_dir(fx.path("repo/packs")).expect("packs") {
        for f in std::fs::read_dir(d.expect("d").path()).expect("fanout") {
            out.push(f.expect("f").path());
        }
    }
    out.sort_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0));
    out
}

/// Export `root` as point c1 of sb1 through cache `cache-a`, import its filesystem through a
/// fresh cache into `out`, and check it came back byte for byte; returns `out`.
async fn export_and_import_fs(fx: &Fixture, root: &Path, out: &str) -> PathBuf {
    let repo = fx.repo("cache-a").await;
    repo.export_point(&fx.source("c000001", root)).await.expect("export");
    let other = fx.repo("cache-b").await;
    let rec = other.load_point("sb1", None).await.expect("load");
    let out = fx.path(out);
    std::fs::create_dir(&out).expect("mkdir");
    other
        .import_point(&rec, &ImportTarget { fs_dir: Some(out.clone()), procs_dir: None })
        .await
        .expect("import");
    assert_eq!(describe(root), describe(&out));
    out
}

async fn import_fresh(fx: &Fixture, cache: &str) -> Result<(), RemoteError> {
    let repo = fx.repo(cache).await;
    let rec = repo.load_point("sb1", None).await?;
    let out = fx.path(&format!("out-{cache}"));
    std::fs::create_dir(&out).expect("mkdir");
    repo.import_point(&rec, &ImportTarget { fs_dir: Some(out), procs_dir: None }).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_chunk_is_refused_naming_the_object() {
    let fx = Fixture::new();
    let root = setup(&fx);
    fx.repo("cache").await.export_point(&fx.source("c000001", &root)).await.expect("export");
    let packs = pack_files(&fx);
    let biggest = packs.last().expect("a pack").clone();
    let mut bytes = std::fs::read(&biggest).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&biggest, &bytes).expect("write");
    let name = biggest.file_name().expect("name").to_string_lossy().to_string();

    let err = import_fresh(&fx, "c1").await.expect_err("corrupt pack accepted");
    assert!(matches!(err, RemoteError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains(&name), "error does not name the pack: {err}");
    let check = fx.repo("c2").await.check().await.expect("check runs");
    assert!(check.errors.iter().any(|e| e.contains(&name)), "{:?}", check.errors);
    assert!(check.errors.iter().any(|e| e.contains("sb1@c000001")), "{:?}", check.errors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_chunk_is_refused_naming_the_object() {
    let fx = Fixture::new();
    let root = setup(&fx);
    fx.repo("cache").await.export_point(&fx.source("c000001", &root)).await.expect("export");
    let gone = pack_files(&fx).last().expect("a pack").clone();
    std::fs::remove_file(&gone).expect("rm");
    let name = gone.file_name().expect("name").to_string_lossy().to_string();
    let err = import_fresh(&fx, "c1").await.expect_err("missing pack accepted");
    assert!(matches!(err, RemoteError::Missing { .. }), "{err}");
    assert!(err.to_string().contains(&name), "{err}");
    let check = fx.repo("c2").await.check().await.expect("check runs");
    assert!(
        check.errors.iter().any(|e| e.contains(&name) && e.contains("missing")),
        "{:?}",
        check.errors
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keeps_the_newest_and_frees_the_rest() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = fx.repo("cache").await;
    repo.export_point(&fx.source("c000001", &root)).await.expect("export 1");
    // Replace the big file: its old chunks are referenced by c000001 only.
    std::fs::write(root.join("big.bin"), noise(77, 3 * 1024 * 1024)).expect("write");
    let mut src = fx.source("c000002", &root);
    src.created_at_ms += 10;
    repo.export_point(&src).await.expect("export 2");
    let before: u64 =
        pack_files(&fx).iter().map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)).sum();

    // A concurrent exporter's shared lock blocks prune.
    let held = repo.lock(false).await.expect("shared lock");
    let err = repo.prune(1).await.expect_err("prune under a shared lock");
    assert!(matches!(err, RemoteError::Locked { .. }), "{err}");
    // ... and a prune's exclusive lock blocks an export.
    repo.unlock(held).await;
    let excl = repo.lock(true).await.expect("exclusive");
    let err =
        repo.export_point(&fx.source("c000009", &root)).await.expect_err("export under prune");
    assert!(matches!(err, RemoteError::Locked { .. }), "{err}");
    repo.unlock(excl).await;

    let rep = repo.prune(1).await.expect("prune");
    assert_eq!(rep.removed_points, vec!["sb1@c000001".to_string()]);
    assert!(rep.freed_bytes > 2 * 1024 * 1024, "freed {}", rep.freed_bytes);
    let after: u64 =
        pack_files(&fx).iter().map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)).sum();
    assert!(after < before - 2 * 1024 * 1024, "{before} -> {after}");
    let check = fx.repo("c3").await.check().await.expect("check");
    assert!(check.errors.is_empty(), "{:?}", check.errors);
    import_fresh(&fx, "c4").await.expect("kept point restores");
    assert_eq!(describe(&root), describe(&fx.path("out-c4")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_repository_needs_its_key() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let key = fx.path("key");
    Key::generate(&key).expect("keygen");
    let opts = |cache: &str, key: Option<PathBuf>| RepoOptions {
        key_file: key,
        cache_dir: fx.path(cache),
        bandwidth_bps: None,
    };
    let repo = Repo::open(&fx.url, opts("c", Some(key.clone()))).await.expect("create encrypted");
    repo.export_point(&fx.source("c000001", &root)).await.expect("export");
    // No plaintext of the files in any pack.
    for p in pack_files(&fx) {
        let bytes = std::fs::read(p).expect("read");
        assert!(!bytes.windows(9).any(|w| w == b"localhost"), "plaintext in a pack");
    }
    let err = Repo::open(&fx.url, opts("c2", None)).await.expect_err("no key");
    assert!(err.to_string().contains("encrypted"), "{err}");
    let other = fx.path("other-key");
    Key::generate(&other).expect("keygen");
    let err = Repo::open(&fx.url, opts("c3", Some(other))).await.expect_err("wrong key");
    assert!(err.to_string().contains("not the key"), "{err}");
    let again = Repo::open(&fx.url, opts("c4", Some(key))).await.expect("right key");
    let rec = again.load_point("sb1", None).await.expect("load");
    std::fs::create_dir(fx.path("out")).expect("mkdir");
    again
        .import_point(&rec, &ImportTarget { fs_dir: Some(fx.path("out")), procs_dir: None })
        .await
        .expect("import");
    assert_eq!(describe(&root), describe(&fx.path("out")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_limit_slows_uploads() {
    let fx = Fixture::new();
    let root = setup(&fx);
    let repo = Repo::open(
        &fx.url,
        RepoOptions {
            key_file: None,
            cache_dir: fx.path("c"),
            bandwidth_bps: Some(2 * 1024 * 1024),
        },
    )
    .await
    .expect("open");
    let t0 = std::time::Instant::now();
    let rep = repo.export_point(&fx.source("c000001", &root)).await.expect("export");
    // ~5.3 MB in one pack at 2 MiB/s: the pack goes at once, the index after it waits ~2.6 s.
    assert!(rep.uploaded_bytes > 5 * 1024 * 1024, "{}", rep.uploaded_bytes);
    assert!(
        t0.elapsed().as_secs_f64() >= 2.0,
        "{:?} for {} bytes",
        t0.elapsed(),
        rep.uploaded_bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_the_image_is_patched_into_the_point_downloading_only_the_difference() {
    let fx = Fixture::new();
    let image = setup(&fx);
    // The point's tree: the image with a changed file, a new file and directory, a removed
    // file, a removed directory, a file turned into a directory and a changed mode.
    let point = fx.path("point");
    copy_tree(&image, &point);
    std::fs::write(point.join("etc/sub/mid.bin"), noise(3, 300 * 1024)).expect("write");
    std::fs::create_dir_all(point.join("new/deeper")).expect("mkdir");
    std::fs::write(point.join("new/deeper/file"), b"new").expect("write");
    std::fs::remove_file(point.join("dangling")).expect("rm");
    std::fs::remove_file(point.join("empty")).expect("rm");
    std::fs::create_dir(point.join("empty")).expect("mkdir");
    std::fs::set_permissions(point.join("etc/hosts"), std::fs::Permissions::from_mode(0o600))
        .expect("chmod");
    std::fs::remove_dir_all(point.join("etc/sub")).ok();
    std::fs::create_dir_all(point.join("etc/sub")).expect("mkdir");
    std::fs::write(point.join("etc/sub/mid.bin"), noise(4, 300 * 1024)).expect("write");
    std::fs::hard_link(point.join("new/deeper/file"), point.join("etc/sub/link-to-new"))
        .expect("link");
    xattr::set(point.join("new/deeper/file"), "user.crab", b"x").expect("xattr");
    let repo = fx.repo("cache-a").await;
    let mut src = fx.source("c000001", &point);
    src.image = Some(("img".into(), image.clone()));
    repo.export_point(&src).await.expect("export");

    let other = fx.repo("cache-b").await;
    let rec = other.load_point("sb1", None).await.expect("load");
    let (base, target) = (rec.image.expect("image").tree, rec.fs.expect("fs"));
    assert_eq!(other.local_tree_id(&image).await.expect("hash image"), base);
    let dest = fx.path("patched");
    copy_tree(&image, &dest);
    other.patch_tree_into(&base, &target, &dest).await.expect("patch");
    assert_eq!(describe(&point), describe(&dest));
    assert_eq!(other.local_tree_id(&dest).await.expect("hash"), target);
    assert_eq!(ino(&dest.join("new/deeper/file")).0, ino(&dest.join("etc/sub/link-to-new")).0);
    assert_eq!(
        xattr::get(dest.join("etc/sub/link-to-new"), "user.crab").expect("get").as_deref(),
        Some(&b"x"[..])
    );
    // big.bin (3 MiB, unchanged) was not downloaded: far fewer blobs than the whole tree.
    let patched_blobs = other.blobs_downloaded();
    std::fs::create_dir(fx.path("full")).expect("mkdir");
    let fresh = fx.repo("cache-c").await;
    fresh.import_tree(&target, &fx.path("full")).await.expect("full import");
    let full_blobs = fresh.blobs_downloaded();
    assert!(patched_blobs + 3 <= full_blobs, "patched {patched_blobs} blobs, full {full_blobs}");
}

/// The exporter records the trees a restore over the image reads (both sides of each level
/// that differs, every tree of a new directory): fetched at once, they leave the patch no tree
/// to download, and they are no more than a restore without them downloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorded_walk_is_every_tree_a_patch_reads_and_no_more() {
    let fx = Fixture::new();
    let image = setup(&fx);
    let point = fx.path("point");
    copy_tree(&image, &point);
    std::fs::write(point.join("etc/sub/mid.bin"), noise(3, 300 * 1024)).expect("write");
    std::fs::create_dir_all(point.join("new/deeper/still")).expect("mkdir");
    std::fs::write(point.join("new/deeper/still/file"), b"new").expect("write");
    let repo = fx.repo("cache-a").await;
    let mut src = fx.source("c000001", &point);
    src.image = Some(("img".into(), image.clone()));
    repo.export_point(&src).await.expect("export");

    let patch = |cache: &'static str, hint: bool| {
        let (fx, image, point) = (&fx, &image, &point);
        async move {
            let other = fx.repo(cache).await;
            let rec = other.load_point("sb1", None).await.expect("load");
            let walk = rec.walk.clone().expect("the export records a walk");
            other.refresh_index().await.expect("index");
            if hint {
                other.prefetch_trees(&walk, "test").await;
            }
            let hinted = other.trees_downloaded();
            let dest = fx.path(&format!("patched-{cache}"));
            copy_tree(image, &dest);
            let (base, target) = (rec.image.expect("image").tree, rec.fs.expect("fs"));
            other.patch_tree_into(&base, &target, &dest).await.expect("patch");
            assert_eq!(describe(point), describe(&dest));
            (walk, hinted, other.trees_downloaded(), other.blobs_downloaded())
        }
    };
    let (walk, hinted, trees, blobs) = patch("cache-b", true).await;
    // root, etc, etc/sub on both sides, then new, new/deeper, new/deeper/still.
    assert_eq!(walk.len(), 9, "{walk:?}");
    assert_eq!(hinted, walk.len() as u64, "the hint fetched its trees");
    assert_eq!(trees, hinted, "the patch found every tree it read already fetched");
    let (_, none, trees_plain, blobs_plain) = patch("cache-c", false).await;
    assert_eq!(none, 0);
    assert_eq!(trees_plain, trees, "the hint named no tree the patch does not read");
    assert_eq!(blobs_plain, blobs);

    // The list is untrusted: ids the index does not list, data blobs, and whatever lies past
    // `WALK_HINT_MAX` are not fetched.
    let other = fx.repo("cache-d").await;
    let rec = other.load_point("sb1", None).await.expect("load");
    other.refresh_index().await.expect("index");
    let root = rec.fs.expect("fs");
    let mut hostile = vec![crab_remote::Id([7; 32])];
    hostile.extend(rec.manifest.chunks.iter().copied());
    hostile.extend(std::iter::repeat_n(root, crab_remote::tree::WALK_HINT_MAX));
    hostile.extend(walk);
    other.prefetch_trees(&hostile, "test").await;
    assert_eq!(other.trees_downloaded(), 1, "the root, once");
    assert_eq!(other.blobs_downloaded(), 1, "no data blob");
}

/// `cp -a src dst`.
fn copy_tree(src: &Path, dst: &Path) {
    let (s, d) = (src.to_str().expect("utf8"), dst.to_str().expect("utf8"));
    assert!(std::process::Command::new("cp").args(["-a", s, d]).status().expect("cp").success());
}

/// `(inode, nlink)` of a path.
fn ino(p: &Path) -> (u64, u64) {
    let m = std::fs::symlink_metadata(p).expect("stat");
    (m.ino(), m.nlink())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_links_and_user_xattrs_come_back_and_other_namespaces_do_not() {
    let fx = Fixture::new();
    let root = setup(&fx);
    std::fs::write(root.join("etc/linked"), b"one inode, two names\n").expect("write");
    std::fs::hard_link(root.join("etc/linked"), root.join("etc/sub/also-linked")).expect("link");
    xattr::set(root.join("etc/linked"), "user.crab.note", b"kept").expect("user xattr");
    xattr::set(root.join("etc"), "user.crab.dir", b"on a directory").expect("dir xattr");
    // Root only: a namespace the remote must not carry.
    let trusted = xattr::set(root.join("etc/linked"), "trusted.crab", b"dropped").is_ok();
    let out = export_and_import_fs(&fx, &root, "out-fs").await;
    let (a, b) = (ino(&out.join("etc/linked")), ino(&out.join("etc/sub/also-linked")));
    assert_eq!(a.0, b.0, "the two names share one inode");
    assert_eq!(a.1, 2);
    assert_eq!(
        xattr::get(out.join("etc/sub/also-linked"), "user.crab.note").expect("get").as_deref(),
        Some(&b"kept"[..])
    );
    assert_eq!(
        xattr::get(out.join("etc"), "user.crab.dir").expect("get").as_deref(),
        Some(&b"on a directory"[..])
    );
    if trusted {
        assert_eq!(xattr::get(out.join("etc/linked"), "trusted.crab").expect("get"), None);
    }
    // The point's tree restored onto a copy of an older tree keeps the links too.
    let other = fx.repo("cache-b").await;
    let rec = other.load_point("sb1", None).await.expect("load");
    assert_eq!(other.local_tree_id(&out).await.expect("hash"), rec.fs.expect("fs"));
}
