//! Forged remote points against a real daemon (root) with a `file://` remote: the test writes
//! points into the store itself (with the repository code, as any host with write access to
//! the store could), each a manifest whose `sandbox_meta` is a real sandbox's record as the
//! exporter writes it, with one field forged:
//!
//! - a privileged profile, host networking or looser limits are refused naming the field,
//!   before anything is written, while the unmodified record restores fine (item: remote
//!   `sandbox_meta` is not trusted);
//! - a point named after a local sandbox never joins that sandbox's points (`crab
//!   checkpoints` / `crab restore` of the local sandbox do not see it);
//! - a file declared far larger than the pool (one chunk repeated: a sparse file) is refused
//!   as a full pool, and one over the caller's `--disk`, before anything is written.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;
use crab_testkit::require_root;

use std::path::{Path, PathBuf};

use common::{unique, OtherDaemon};
use crab_checkpoint::Manifest;
use crab_remote::{ExportSource, Repo, RepoOptions};

/// Fields drop in order: the daemon (its sandboxes, pool and state) before the directory
/// holding it.
struct Host {
    d: OtherDaemon,
    tmp: tempfile::TempDir,
    url: String,
}

fn host() -> Host {
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    std::fs::create_dir_all(tmp.path().join("store")).unwrap();
    let url = format!("file://{}", tmp.path().join("store").display());
    let d =
        OtherDaemon::start(&tmp.path().join("host"), &["--pool-size", "2G", "--remote", &url], &[]);
    let src = d.state.join("empty-root");
    std::fs::create_dir_all(&src).unwrap();
    d.crab_ok(&["image", "import", "empty", src.to_str().unwrap()]);
    Host { d, tmp, url }
}

impl Host {
    /// A real sandbox with one `fs` point: its name and that point's manifest.
    fn real_point(&self) -> (String, Manifest) {
        let name = unique("t-rhost");
        self.d.crab_ok(&["sandbox", "create", "empty", "--name", &name]);
        let v = self.d.json(&["checkpoint", &name, "--kind", "fs"]);
        let point = v["point"]["id"].as_str().unwrap().to_string();
        let path = crab_common::paths::StateDir::new(&self.d.state)
            .checkpoints(&name)
            .join("points")
            .join(format!("{point}.manifest"));
        (name, crab_checkpoint::manifest::read(&path).unwrap())
    }

    /// Write point `sb@point` into the remote: manifest `m` (its id and sandbox set to
    /// those), the files of `fs`.
    fn forge(&self, sb: &str, point: &str, m: &Manifest, fs: &Path) {
        let mut m = m.clone();
        m.sandbox = sb.to_string();
        m.id = point.parse().unwrap();
        let src = ExportSource {
            sandbox: sb.to_string(),
            point: point.to_string(),
            turn: m.turn,
            kind: "fs".into(),
            created_at_ms: m.created_at_ms,
            manifest: crab_checkpoint::manifest::encode(&m),
            fs_dir: Some(fs.to_path_buf()),
            procs_dir: None,
            criu_version: None,
            conversation: None,
            image: None,
            image_origin: None,
            immutable_parts: false,
        };
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let opts = RepoOptions {
                key_file: None,
                cache_dir: self.tmp.path().join("forger-cache"),
                bandwidth_bps: None,
            };
            let repo = Repo::open(&self.url, opts).await.unwrap();
            repo.export_point(&src).await.unwrap();
        });
    }

    fn files(&self, tag: &str, files: &[(&str, &[u8])]) -> PathBuf {
        let dir = self.tmp.path().join("trees").join(tag);
        std::fs::create_dir_all(&dir).unwrap();
        for (n, data) in files {
            std::fs::write(dir.join(n), data).unwrap();
        }
        dir
    }

    fn sandboxes(&self) -> String {
        self.d.crab_ok(&["sandbox", "ls"])
    }

    /// What the materialization of `sb`'s remote points left in the pool.
    fn remote_parts(&self, sb: &str) -> usize {
        let dir = crab_common::paths::StateDir::new(&self.d.state).remote_points(sb);
        ["fs", "procs", "points"]
            .iter()
            .map(|p| std::fs::read_dir(dir.join(p)).map(|r| r.count()).unwrap_or(0))
            .sum()
    }

    /// `crab sandbox create --from-remote SRC --name NAME ARGS…`, expected to fail: stderr.
    fn refused(&self, src: &str, name: &str, args: &[&str]) -> String {
        let mut a = vec!["sandbox", "create", "--from-remote", src, "--name", name];
        a.extend_from_slice(args);
        let o = self.d.crab(&a);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "{src} was restored: {}", String::from_utf8_lossy(&o.stdout));
        assert!(!self.sandboxes().contains(name), "{name} exists after a refusal: {err}");
        err
    }
}

fn with_meta(m: &Manifest, f: impl FnOnce(&mut serde_json::Value)) -> Manifest {
    let mut m = m.clone();
    f(&mut m.sandbox_meta);
    m
}

#[test]
fn remote_sandbox_meta_cannot_grant_privileges_network_or_limits() {
    require_root!();
    let h = host();
    let (_, real) = h.real_point();
    assert_eq!(real.sandbox_meta["profile"]["privileged"], false, "{}", real.sandbox_meta);
    let tree = h.files("meta", &[("hello.txt", b"from the remote\n")]);
    let base = unique("t-rforge");

    // The real record with one field changed, and the report's exact forged meta.
    let cases: Vec<(&str, Manifest, Vec<&str>, &str)> = vec![
        (
            "priv",
            with_meta(&real, |v| v["profile"]["privileged"] = true.into()),
            vec![],
            "privileged",
        ),
        (
            "bare",
            with_meta(&real, |v| {
                *v = serde_json::json!({"profile":{"privileged":true},"net":"host"})
            }),
            vec![],
            "privileged profile",
        ),
        ("host", with_meta(&real, |v| v["net"] = "host".into()), vec![], "sandbox_meta.net"),
        (
            "nat",
            with_meta(&real, |v| v["net"] = "nat".into()),
            vec!["--network", "private"],
            "network nat",
        ),
        (
            "mem",
            with_meta(&real, |v| v["limits"]["memory_bytes"] = (1u64 << 40).into()),
            vec!["--memory", "256M"],
            "sandbox_meta.limits.memory_bytes",
        ),
        (
            "pids",
            with_meta(&real, |v| v["limits"]["pids_max"] = 100_000.into()),
            vec!["--pids", "64"],
            "sandbox_meta.limits.pids_max",
        ),
    ];
    for (tag, m, args, want) in &cases {
        let sb = format!("{base}-{tag}");
        h.forge(&sb, "c000001", m, &tree);
        let err = h.refused(&sb, &format!("{sb}-copy"), args);
        assert!(err.contains(want), "{tag}: the error does not name {want:?}: {err}");
        assert!(err.contains("nothing was written"), "{tag}: {err}");
        assert_eq!(h.remote_parts(&sb), 0, "{tag}: parts were written before the refusal");
    }

    // The unmodified record (what the exporter writes) restores, with this host's defaults.
    let sb = format!("{base}-ok");
    h.forge(&sb, "c000001", &real, &tree);
    let copy = format!("{sb}-copy");
    h.d.crab_ok(&["sandbox", "create", "--from-remote", &sb, "--name", &copy]);
    let info = h.d.json(&["sandbox", "inspect", &copy]);
    assert_eq!(info["net"], "private", "{info}");
    assert_eq!(info["profile"]["name"], "default", "{info}");
    let root = crab_common::paths::StateDir::new(&h.d.state).sandbox_rootfs(&copy);
    assert_eq!(std::fs::read(root.join("hello.txt")).unwrap(), b"from the remote\n");
    // The point's value is no authority even when it asks for less: a point of a `none`
    // sandbox gets this host's default network …
    let sb = format!("{base}-none");
    h.forge(&sb, "c000001", &with_meta(&real, |v| v["net"] = "none".into()), &tree);
    let copy2 = format!("{sb}-copy");
    h.d.crab_ok(&["sandbox", "create", "--from-remote", &sb, "--name", &copy2]);
    assert_eq!(h.d.json(&["sandbox", "inspect", &copy2])["net"], "private");
    // … and the caller's flag decides.
    let copy3 = format!("{sb}-flag");
    h.d.crab_ok(&[
        "sandbox",
        "create",
        "--from-remote",
        &sb,
        "--name",
        &copy3,
        "--network",
        "none",
    ]);
    assert_eq!(h.d.json(&["sandbox", "inspect", &copy3])["net"], "none");
}

/// The ids of `sandbox`'s restore points on `d`.
fn point_ids(d: &OtherDaemon, sandbox: &str) -> Vec<String> {
    d.json(&["checkpoints", sandbox])
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_remote_point_named_after_a_local_sandbox_never_joins_its_points() {
    require_root!();
    let h = host();
    let (victim, real) = h.real_point();
    let own = point_ids(&h.d, &victim);
    let tree = h.files("inject", &[("injected.txt", b"not yours\n")]);
    h.forge(&victim, "c000042", &real, &tree);

    // Restoring the remote point builds a new sandbox from it …
    let copy = unique("t-rinject");
    h.d.crab_ok(&[
        "sandbox",
        "create",
        "--from-remote",
        &format!("{victim}@c000042"),
        "--name",
        &copy,
    ]);
    // … and the local sandbox's points are what they were: no c000042 to restore it to.
    let after = point_ids(&h.d, &victim);
    assert_eq!(after, own, "the remote point joined {victim}'s points");
    let o = h.d.crab(&["restore", &victim, "c000042"]);
    assert!(!o.status.success(), "crab restore {victim} c000042 restored the injected point");
    let local = crab_common::paths::StateDir::new(&h.d.state).checkpoints(&victim);
    assert!(!local.join("points/c000042.manifest").exists());
    let vroot = crab_common::paths::StateDir::new(&h.d.state).sandbox_rootfs(&victim);
    assert!(!vroot.join("injected.txt").exists());
    // The copy has the remote point's own files (not parts of the local sandbox's that bear the
    // same part ids).
    let root = crab_common::paths::StateDir::new(&h.d.state).sandbox_rootfs(&copy);
    assert_eq!(std::fs::read(root.join("injected.txt")).unwrap(), b"not yours\n");
}

#[test]
fn a_dedup_bomb_is_refused_as_a_full_pool_before_anything_is_written() {
    require_root!();
    let h = host();
    let (_, real) = h.real_point();
    let base = unique("t-rbomb");
    // 3 GiB of zeros in a sparse file: one 1 MiB chunk declared 3,072 times, for a 2 GiB pool.
    let bomb = h.files("bomb", &[]);
    let f = std::fs::File::create(bomb.join("zeros.bin")).unwrap();
    f.set_len(3 << 30).unwrap();
    let sb = format!("{base}-pool");
    h.forge(&sb, "c000001", &real, &bomb);
    let err = h.refused(&sb, &format!("{sb}-copy"), &[]);
    assert!(err.contains("declares") && err.contains("pool"), "{err}");
    assert!(err.contains(&format!("{} bytes", 3u64 << 30)), "{err}");
    assert!(!err.contains("reachable"), "blames the remote: {err}");
    assert_eq!(h.remote_parts(&sb), 0, "parts were written before the refusal");

    // 200 MiB declared, restored with --disk 64M: refused naming the disk limit.
    let small = h.files("small", &[]);
    std::fs::File::create(small.join("zeros.bin")).unwrap().set_len(200 << 20).unwrap();
    let sb = format!("{base}-disk");
    // A point of a sandbox with a disk limit no larger than the one granted here (its meta
    // asking for more is the other test's refusal, not this one's).
    let limited = with_meta(&real, |v| v["limits"]["disk_bytes"] = (64u64 << 20).into());
    h.forge(&sb, "c000001", &limited, &small);
    let err = h.refused(&sb, &format!("{sb}-copy"), &["--disk", "64M"]);
    assert!(err.contains("disk limit"), "{err}");
    assert_eq!(h.remote_parts(&sb), 0, "parts were written before the refusal");
}
