//! Hostile remote points against `local::materialize` (no root, no daemon): manifests whose
//! image file names leave the image directory, image files that are symlinks, and a chunk
//! declared many times over a sandbox's disk limit. Each is refused naming the problem,
//! before any host file is read or anything is written.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crab_checkpoint::manifest::{FsPart, ImageFile, ProcPart};
use crab_checkpoint::{CopyFs, FsId, Manifest, PointId, ProcId, Store, Timings};
use crab_common::paths::StateDir;
use crab_common::PointKind;
use crab_remote::local::{materialize, Admission};
use crab_remote::{ExportSource, RemoteError, Repo, RepoOptions};

struct Fx {
    dir: tempfile::TempDir,
}

impl Fx {
    fn new() -> Fx {
        Fx { dir: tempfile::tempdir().unwrap() }
    }
    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join(rel)
    }
    async fn repo(&self, cache: &str) -> Repo {
        let url = format!("file://{}", self.path("repo").display());
        std::fs::create_dir_all(self.path("repo")).unwrap();
        Repo::open(
            &url,
            RepoOptions { key_file: None, cache_dir: self.path(cache), bandwidth_bps: None },
        )
        .await
        .unwrap()
    }
    /// The restoring host's state directory (its pool a plain directory) and its store of
    /// remote points of `sb1`.
    fn target(&self) -> (StateDir, Store) {
        let state = StateDir::new(self.path("state"));
        std::fs::create_dir_all(state.pool()).unwrap();
        let store = Store::open(state.remote_points("sb1"), "sb1", Arc::new(CopyFs)).unwrap();
        (state, store)
    }
}

fn manifest(fs: bool, files: Vec<ImageFile>) -> Manifest {
    let bytes = files.iter().map(|f| f.size).sum();
    Manifest {
        id: PointId(1),
        sandbox: "sb1".into(),
        turn: 1,
        kind: PointKind::FULL,
        parent: None,
        origin: None,
        created_at_ms: 1,
        conversation_offset: None,
        fs: fs.then_some(FsPart {
            id: FsId(1),
            created_at_ms: 1,
            delta_bytes: None,
            generation: None,
            written_bytes: None,
        }),
        procs: (!files.is_empty()).then(|| ProcPart {
            id: ProcId(1),
            created_at_ms: 1,
            root_pid: 1,
            criu_version: "4.2".into(),
            files,
            bytes,
        }),
        timings: Timings::default(),
        sandbox_meta: serde_json::json!({"net": "private"}),
        procs_missing: None,
    }
}

/// Export a forged point `sb1@c000001`: manifest `m`, process images from `procs`, files
/// from `fs`.
async fn forge(repo: &Repo, m: &Manifest, procs: Option<&Path>, fs: Option<&Path>) {
    let src = ExportSource {
        sandbox: "sb1".into(),
        point: "c000001".into(),
        turn: 1,
        kind: "full".into(),
        created_at_ms: 1,
        manifest: crab_checkpoint::manifest::encode(m),
        fs_dir: fs.map(Path::to_path_buf),
        procs_dir: procs.map(Path::to_path_buf),
        criu_version: Some("4.2".into()),
        conversation: None,
        image: None,
        image_origin: None,
        immutable_parts: false,
    };
    repo.export_point(&src).await.unwrap();
}

fn allow_all(_: &Manifest) -> Result<(), RemoteError> {
    Ok(())
}

async fn restore(fx: &Fx, disk_limit: Option<u64>) -> Result<(), RemoteError> {
    let repo = fx.repo("cache-restore").await;
    let (state, store) = fx.target();
    let rec = repo.load_point("sb1", None).await.unwrap();
    let admission = Admission { check: &allow_all, disk_limit };
    materialize(&repo, &state, &store, &rec, false, &admission).await.map(drop)
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    crab_checkpoint::manifest::hex(&sha2::Sha256::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_file_names_leaving_the_image_directory_are_refused_before_any_read() {
    for evil in ["../../etc/shadow", "../../dev/zero", "/etc/passwd", "a/../../b", "x\0y", ".."] {
        let fx = Fx::new();
        let repo = fx.repo("cache-export").await;
        std::fs::create_dir_all(fx.path("procs")).unwrap();
        std::fs::write(fx.path("procs/core-1.img"), b"core").unwrap();
        let files = vec![
            ImageFile { name: "core-1.img".into(), size: 4, sha256: sha256_hex(b"core") },
            ImageFile { name: evil.into(), size: 1, sha256: "0".repeat(64) },
        ];
        forge(&repo, &manifest(false, files), Some(&fx.path("procs")), None).await;
        let t0 = Instant::now();
        let err = restore(&fx, None).await.expect_err("a path-escaping image name was accepted");
        // `../../dev/zero` used to be hashed forever.
        assert!(t0.elapsed() < Duration::from_secs(20), "{evil:?}: took {:?}", t0.elapsed());
        let msg = err.to_string();
        assert!(matches!(err, RemoteError::Corrupt { .. }), "{evil:?}: {msg}");
        assert!(msg.contains("image file name"), "{evil:?}: {msg}");
        // Nothing of a host file in the message: neither its size nor its SHA-256.
        if let Ok(shadow) = std::fs::read("/etc/shadow") {
            assert!(!msg.contains(&sha256_hex(&shadow)), "{msg}");
            assert!(!msg.contains(&format!("size is {}", shadow.len())), "{msg}");
        }
        // Nothing was written into the store.
        let (_, store) = fx.target();
        assert!(!store.proc_dir(ProcId(1)).exists(), "{evil:?}: images were written");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_file_that_is_a_symlink_to_a_host_file_is_not_read() {
    let fx = Fx::new();
    let repo = fx.repo("cache-export").await;
    std::fs::create_dir_all(fx.path("procs")).unwrap();
    let secret = fx.path("host-secret");
    std::fs::write(&secret, b"host secret bytes").unwrap();
    std::os::unix::fs::symlink(&secret, fx.path("procs/core-1.img")).unwrap();
    let files = vec![ImageFile { name: "core-1.img".into(), size: 1, sha256: "0".repeat(64) }];
    forge(&repo, &manifest(false, files), Some(&fx.path("procs")), None).await;
    let msg = restore(&fx, None).await.expect_err("a symlinked image was accepted").to_string();
    assert!(msg.contains("symbolic link"), "{msg}");
    assert!(!msg.contains(&sha256_hex(b"host secret bytes")), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_declared_many_times_over_the_disk_limit_is_refused_before_writing() {
    let fx = Fx::new();
    let repo = fx.repo("cache-export").await;
    // 64 MiB of one repeated 1 MiB block: a handful of distinct chunks, 64 MiB declared.
    let block: Vec<u8> =
        (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::create_dir_all(fx.path("root")).unwrap();
    let mut data = Vec::with_capacity(64 << 20);
    for _ in 0..64 {
        data.extend_from_slice(&block);
    }
    std::fs::write(fx.path("root/bomb.bin"), &data).unwrap();
    drop(data);
    forge(&repo, &manifest(true, Vec::new()), None, Some(&fx.path("root"))).await;
    let err = restore(&fx, Some(16 << 20)).await.expect_err("the bomb was accepted");
    let msg = err.to_string();
    assert!(
        matches!(&err, RemoteError::Refused { refusal, .. } if refusal.field == "disk limit"),
        "{msg}"
    );
    assert!(msg.contains(&format!("{} bytes", 64u64 << 20)), "{msg}");
    assert!(msg.contains("nothing was written"), "{msg}");
    let (_, store) = fx.target();
    assert_eq!(std::fs::read_dir(store.dir().join("fs")).unwrap().count(), 0, "fs written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_file_that_is_a_fifo_is_refused_without_blocking() {
    let fx = Fx::new();
    let repo = fx.repo("cache-export").await;
    std::fs::create_dir_all(fx.path("procs")).unwrap();
    let c =
        std::ffi::CString::new(fx.path("procs/core-1.img").into_os_string().into_encoded_bytes())
            .unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
    let files = vec![ImageFile { name: "core-1.img".into(), size: 1, sha256: "0".repeat(64) }];
    forge(&repo, &manifest(false, files), Some(&fx.path("procs")), None).await;
    // On a worker of its own, so that a verification blocked in open(2) cannot stall the
    // timeout.
    let task = tokio::spawn(async move { restore(&fx, None).await.map_err(|e| e.to_string()) });
    let res = tokio::time::timeout(Duration::from_secs(20), task).await;
    let msg = res.expect("verifying a fifo blocked").unwrap().expect_err("a fifo was accepted");
    assert!(msg.contains("not a regular file"), "{msg}");
}
