//! The repository against a real S3 server: SeaweedFS (installed from PyPI by
//! `scripts/install-test-servers.sh`, pinned) started on loopback in a temp dir by
//! `scripts/s3-test-server.sh`, SigV4 credentials, the `object_store` S3 client. Round trip to a
//! second "host" (fresh cache), dedup, conditional-put locks against prune, the server down
//! (export fails, nothing listed durable) and back (the retry succeeds), check and prune.

use std::path::{Path, PathBuf};
use std::process::Command;

use crab_remote::{ExportSource, ImportTarget, RemoteError, Repo, RepoOptions};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Weed {
    dir: PathBuf,
    port: u16,
    pid: i32,
}

impl Weed {
    fn start(dir: &Path, port: u16) -> Weed {
        let out = Command::new(workspace_root().join("scripts/s3-test-server.sh"))
            .arg(dir)
            .arg(port.to_string())
            .output()
            .expect("run scripts/s3-test-server.sh");
        assert!(
            out.status.success(),
            "S3 server did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pid = 0;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let (k, v) = line.split_once('=').expect("KEY=VALUE");
            if k == "WEED_PID" {
                pid = v.parse().expect("pid");
            } else {
                // SAFETY (not unsafe in edition 2021): set before the test's runtime starts.
                std::env::set_var(k, v);
            }
        }
        assert!(pid > 0);
        Weed { dir: dir.to_path_buf(), port, pid }
    }

    fn stop(&mut self) {
        if self.pid > 0 {
            // SAFETY: signals the weed process group this test started.
            unsafe { libc::kill(-self.pid, libc::SIGTERM) };
            for _ in 0..100 {
                // SAFETY: probing a pid we started.
                if unsafe { libc::kill(self.pid, 0) } != 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            // SAFETY: as above.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
            self.pid = 0;
        }
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        self.stop();
    }
}

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

fn source(root: &Path, point: &str, at: u64) -> ExportSource {
    ExportSource {
        sandbox: "sb-s3".into(),
        point: point.into(),
        turn: at,
        kind: "fs".into(),
        created_at_ms: at,
        manifest: format!("manifest {point}\n").into_bytes(),
        fs_dir: Some(root.to_path_buf()),
        procs_dir: None,
        criu_version: None,
        conversation: None,
        image: None,
        image_origin: None,
        immutable_parts: false,
    }
}

fn same_tree(a: &Path, b: &Path) {
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut na: Vec<_> = std::fs::read_dir(a.join(&rel))
            .expect("ls a")
            .map(|e| e.expect("e").file_name())
            .collect();
        let mut nb: Vec<_> = std::fs::read_dir(b.join(&rel))
            .expect("ls b")
            .map(|e| e.expect("e").file_name())
            .collect();
        na.sort();
        nb.sort();
        assert_eq!(na, nb, "entries of {}", rel.display());
        for n in na {
            let r = rel.join(&n);
            let m = std::fs::symlink_metadata(a.join(&r)).expect("stat");
            if m.is_dir() {
                stack.push(r);
            } else if m.is_file() {
                assert_eq!(
                    std::fs::read(a.join(&r)).expect("a"),
                    std::fs::read(b.join(&r)).expect("b"),
                    "{}",
                    r.display()
                );
            }
        }
    }
}

#[test]
fn s3_round_trip_dedup_locks_outage_prune() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A port per test run, away from the daemons' 74xx.
    let port = 17000 + (std::process::id() % 2000) as u16 * 2 % 2000;
    let mut weed = Weed::start(&tmp.path().join("weed"), port);
    let root = tmp.path().join("root");
    std::fs::create_dir_all(root.join("d")).expect("mkdir");
    std::fs::write(root.join("d/big"), noise(3, 2 * 1024 * 1024)).expect("write");
    std::fs::write(root.join("small"), b"hello s3").expect("write");
    let url = format!("s3://crab/run-{}", std::process::id());
    let opts = |c: &str| RepoOptions {
        key_file: None,
        cache_dir: tmp.path().join(c),
        bandwidth_bps: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("rt");
    rt.block_on(async {
        let a = Repo::open(&url, opts("cache-a")).await.expect("open on S3");
        let first = a.export_point(&source(&root, "c000001", 1)).await.expect("export 1");
        assert!(first.uploaded_bytes > 2 * 1024 * 1024);
        let second = a.export_point(&source(&root, "c000002", 2)).await.expect("export 2");
        assert!(second.uploaded_bytes < 4096, "unchanged tree uploaded {}", second.uploaded_bytes);

        // "Host B": its own cache, same bucket.
        let b = Repo::open(&url, opts("cache-b")).await.expect("open B");
        let rec = b.load_point("sb-s3", None).await.expect("newest");
        assert_eq!(rec.point, "c000002");
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).expect("mkdir");
        let imp = b
            .import_point(&rec, &ImportTarget { fs_dir: Some(out.clone()), procs_dir: None })
            .await
            .expect("import");
        assert_eq!(imp.manifest, b"manifest c000002\n");
        same_tree(&root, &out);

        // Conditional-put locks: prune refused while an exporter holds the shared lock.
        let held = b.lock(false).await.expect("shared lock");
        assert!(matches!(a.prune(1).await, Err(RemoteError::Locked { .. })));
        b.unlock(held).await;
    });

    // The server goes down: the export fails, and nothing half-written is listed.
    weed.stop();
    std::fs::write(root.join("d/new"), noise(5, 300 * 1024)).expect("write");
    rt.block_on(async {
        let a = Repo::open(
            &url,
            RepoOptions {
                key_file: None,
                cache_dir: tmp.path().join("cache-c"),
                bandwidth_bps: None,
            },
        )
        .await;
        assert!(a.is_err(), "opening a stopped S3 server succeeded");
    });
    let _weed2 = {
        let w = Weed::start(&weed.dir, weed.port);
        std::mem::forget(weed);
        w
    };
    rt.block_on(async {
        // Right after a restart the server answers 500 until its volumes are back: retry, as
        // the daemon's exporter does.
        let t0 = std::time::Instant::now();
        let a = loop {
            match Repo::open(&url, opts("cache-a")).await {
                Ok(r) => break r,
                Err(e) if t0.elapsed().as_secs() < 60 => {
                    eprintln!("waiting for the restarted server: {e}");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                Err(e) => panic!("reopen: {e}"),
            }
        };
        assert_eq!(
            a.list_points(None).await.expect("ls").len(),
            2,
            "only complete points are listed"
        );
        let third =
            a.export_point(&source(&root, "c000003", 3)).await.expect("export after the outage");
        assert!(third.uploaded_bytes < 400 * 1024, "{}", third.uploaded_bytes);
        let check = a.check().await.expect("check");
        assert!(check.errors.is_empty(), "{:?}", check.errors);
        assert_eq!(check.points, 3);
        let pr = a.prune(1).await.expect("prune");
        assert_eq!(pr.removed_points.len(), 2);
        let check = a.check().await.expect("check after prune");
        assert!(check.errors.is_empty() && check.points == 1, "{check:?}");
    });
}
