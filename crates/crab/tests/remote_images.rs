//! Process images from a remote store are not trusted: before CRIU restores them, every
//! task's creds, seccomp filter chain and namespaces are held to the default profile
//! (`crab_checkpoint::foreign`, `crab_criu::images`).
//!
//! * `real_images_pass_and_each_forged_field_is_refused`: a full point of a real sandbox of
//!   the default image (bash, `sleep`, a python process with three extra threads) passes the
//!   check, and copies of its images with one field forged — on the init, on a child, on a
//!   non-leader thread — are each refused naming the task, the field and the value.
//! * `forged_remote_points_are_refused_end_to_end`: a point exported by a real daemon to a
//!   `file://` remote is forged in the content-addressed store the way an attacker with write
//!   access would (its images patched at the protobuf wire level, its manifest's SHA-256s
//!   recomputed, the whole re-exported as a new point with the export code the daemon uses),
//!   and `crab sandbox create --from-remote` of it is refused with the field named, leaving
//!   the source sandbox running and its points, the local store and the sandbox list as they
//!   were; the same forging with nothing patched restores, so the pipeline itself is sound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crab_checkpoint::{CheckpointError, Store};
use crab_criu::images::{self, ImageError, PstreeEntry};
use crab_testkit::criu_images::{edit_at, edit_image, set, Value};
use crab_testkit::daemon as common;
use crab_testkit::require_root;

/// `BPF_RET | BPF_K` returning `SECCOMP_RET_ALLOW`: a filter that allows everything.
const ALLOW_ALL: [u8; 8] = [0x06, 0, 0, 0, 0, 0, 0xff, 0x7f];

/// The images of a sandbox of the test daemon (the default user-namespace range) against
/// the default profile in that range.
#[allow(clippy::result_large_err)] // the library's own error type, as returned
fn check(dir: &Path) -> crab_checkpoint::Result<images::Checked> {
    let r = crab_common::api::IdRange::at(crab_common::api::IdRange::DEFAULT_BASE).unwrap();
    crab_checkpoint::foreign::check(dir, Some(r))
}

/// Patches an image directory for the task `tid` (its `core-<tid>.img`).
type Patch = Box<dyn Fn(&Path, u32)>;

/// A forgery: what it patches in an image directory, and the field the refusal must name.
struct Forgery {
    name: &'static str,
    field: &'static str,
    patch: Patch,
}

/// Patch `thread_core` (field 5) of `core-<tid>.img`: `path` below it, `tag` set to `values`.
fn patch_core(dir: &Path, tid: u32, path: &[u32], tag: u32, values: Vec<Value>) {
    let mut full = vec![5];
    full.extend_from_slice(path);
    edit_image(&dir.join(format!("core-{tid}.img")), 2, &mut |m| {
        edit_at(m, &full, &mut |f| set(f, tag, values.clone()))
    });
}

/// The mount table image of a directory (one per dump of a sandbox).
fn mount_image(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("mountpoints-"))
        .expect("a mountpoints image")
}

/// Pass each `mnt_entry` of the mount table through `f` (which may drop it: `None`).
fn edit_mounts(
    dir: &Path,
    f: &dyn Fn(Vec<crab_testkit::criu_images::Field>) -> Vec<Vec<crab_testkit::criu_images::Field>>,
) {
    use crab_testkit::criu_images::{encode, parse};
    let path = mount_image(dir);
    let b = std::fs::read(&path).unwrap();
    let mut out = b[..8].to_vec();
    let mut at = 8;
    while at < b.len() {
        let len = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
        for m in f(parse(&b[at + 4..at + 4 + len])) {
            let m = encode(&m);
            out.extend_from_slice(&(m.len() as u32).to_le_bytes());
            out.extend_from_slice(&m);
        }
        at += 4 + len;
    }
    std::fs::write(&path, out).unwrap();
}

fn mountpoint_of(m: &[crab_testkit::criu_images::Field]) -> String {
    m.iter()
        .find_map(|f| match (&f.tag, &f.value) {
            (7, Value::Bytes(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        })
        .unwrap_or_default()
}

/// `/proc/sys` mounted read-write (the red team's `core_pattern` write without any capability).
fn proc_sys_writable(dir: &Path) {
    edit_mounts(dir, &|mut m| {
        if mountpoint_of(&m) == "/proc/sys" {
            let flags = m.iter().find_map(|f| match (f.tag, &f.value) {
                (5, Value::Varint(v)) => Some(*v),
                _ => None,
            });
            set(&mut m, 5, vec![Value::Varint(flags.unwrap() & !1)]);
        }
        vec![m]
    });
}

fn forgeries() -> Vec<Forgery> {
    let all = || vec![Value::Varint(u64::from(u32::MAX)); 2];
    vec![
        Forgery {
            name: "cap_eff all ones",
            field: "creds.cap_eff",
            patch: Box::new(move |d, t| patch_core(d, t, &[10], 11, all())),
        },
        Forgery {
            name: "cap_bnd all ones",
            field: "creds.cap_bnd",
            patch: Box::new(move |d, t| patch_core(d, t, &[10], 12, all())),
        },
        Forgery {
            name: "no_new_privs cleared",
            field: "creds.no_new_privs",
            patch: Box::new(|d, t| patch_core(d, t, &[10], 18, vec![Value::Varint(0)])),
        },
        Forgery {
            name: "seccomp disabled",
            field: "seccomp_mode",
            patch: Box::new(|d, t| patch_core(d, t, &[], 11, vec![Value::Varint(0)])),
        },
        Forgery {
            name: "seccomp filter replaced by allow-all",
            field: "seccomp.filter",
            patch: Box::new(|d, _| {
                edit_image(&d.join("seccomp.img"), 2, &mut |m| {
                    edit_at(m, &[], &mut |entry| {
                        for f in entry.iter_mut().filter(|f| f.tag == 1) {
                            let Value::Bytes(b) = &f.value else { panic!("filter is a message") };
                            f.value = Value::Bytes(edit_at(b, &[], &mut |flt| {
                                set(flt, 1, vec![Value::Bytes(ALLOW_ALL.to_vec())])
                            }));
                        }
                    })
                })
            }),
        },
        Forgery {
            name: "/proc/sys read-write",
            field: "flags",
            patch: Box::new(|d, _| proc_sys_writable(d)),
        },
    ]
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        assert!(e.file_type().unwrap().is_file(), "{} is not a file", e.path().display());
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn store_of(state: &Path, sb: &str) -> Store {
    let state = crab_common::paths::StateDir::new(state);
    Store::open_existing(state.checkpoints(sb), sb, Arc::new(crab_checkpoint::CopyFs))
        .unwrap()
        .expect("the sandbox has a store")
}

/// The image directory of point `point` of `sb` in state directory `state`.
fn images_of(state: &Path, sb: &str, point: &str) -> PathBuf {
    let store = store_of(state, sb);
    let m = store.resolve(Some(point)).unwrap();
    store.proc_dir(m.procs.expect("a process image").id)
}

fn mount_refusal(r: crab_checkpoint::Result<images::Checked>) -> (String, String) {
    match r {
        Err(CheckpointError::Untrusted {
            source: ImageError::Mount { mountpoint, field, .. },
            ..
        }) => (mountpoint, field),
        other => panic!("not refused for a mount: {other:?}"),
    }
}

fn refusal(r: crab_checkpoint::Result<images::Checked>) -> (u32, u32, String, String) {
    match r {
        Err(CheckpointError::Untrusted {
            source: ImageError::Refused { pid, tid, field, value, .. },
            ..
        }) => (pid, tid, field, value),
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn real_images_pass_and_each_forged_field_is_refused() {
    require_root!();
    let sb = common::Sandbox::new("t-rimg");
    sb.sh_ok("nohup sleep 100000 >/dev/null 2>&1 &");
    sb.sh_ok(
        "nohup python3 -c 'import threading,time\n\
         for _ in range(3): threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()\n\
         time.sleep(100000)' >/dev/null 2>&1 &",
    );
    // Until python runs its three extra threads.
    sb.sh_ok(
        "for i in $(seq 200); do for p in $(pgrep python3); do \
         [ $(ls /proc/$p/task | wc -l) -ge 4 ] && exit 0; done; sleep 0.1; done; exit 1",
    );
    let v: serde_json::Value = serde_json::from_str(&common::crab_ok(&[
        "--json",
        "checkpoint",
        &sb.name,
        "--kind",
        "full",
    ]))
    .unwrap();
    let point = v["point"]["id"].as_str().unwrap().to_string();
    let dir = images_of(&common::state_dir(), &sb.name, &point);

    // The real images pass; time the check (it runs before every restore from a remote).
    let checked = check(&dir).unwrap();
    let tasks =
        images::read_entries::<PstreeEntry>(&dir.join("pstree.img"), images::PSTREE_MAGIC).unwrap();
    assert_eq!(checked.tasks, tasks.len());
    assert!(checked.tasks >= 3, "init, sleep, python at least: {checked:?}");
    assert!(checked.threads >= checked.tasks + 3, "python's threads are checked: {checked:?}");
    let n = 50;
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        check(&dir).unwrap();
    }
    let per = t0.elapsed().as_secs_f64() * 1e3 / f64::from(n);
    let bytes: u64 =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    eprintln!(
        "check of a real point: {per:.3} ms per check ({} tasks, {} threads, {} filters; image dir {} files, {bytes} bytes)",
        checked.tasks,
        checked.threads,
        checked.filters,
        std::fs::read_dir(&dir).unwrap().count()
    );

    // Each forgery, on the init (pid 1), on another task and on a non-leader thread.
    let python = tasks.iter().find(|t| t.threads.len() > 1).expect("the python task");
    let (ppid, thread) = (python.pid.unwrap(), python.threads[python.threads.len() - 1]);
    let child = tasks.iter().map(|t| t.pid.unwrap()).find(|p| *p != 1 && *p != ppid).unwrap();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    for (i, f) in forgeries().iter().enumerate() {
        for (pid, tid) in [(1, 1), (child, child), (ppid, thread)] {
            if (f.field == "seccomp.filter" || f.field == "flags") && pid != 1 {
                continue; // one filter / mount table for the whole tree: patched once
            }
            if f.field == "flags" {
                let d = tmp.path().join(format!("{i}-mnt"));
                copy_dir(&dir, &d);
                (f.patch)(&d, tid);
                assert_eq!(mount_refusal(check(&d)), ("/proc/sys".into(), "flags".into()));
                continue;
            }
            if f.field == "seccomp_mode" && tid != pid {
                continue; // already 0 there: CRIU's TSYNC encoding, checked below
            }
            let d = tmp.path().join(format!("{i}-{tid}"));
            copy_dir(&dir, &d);
            (f.patch)(&d, tid);
            let (rp, rt, field, value) = refusal(check(&d));
            assert_eq!(field, f.field, "{}: wrong field ({value})", f.name);
            if f.field != "seccomp.filter" {
                assert_eq!((rp, rt), (pid, tid), "{}: wrong task", f.name);
            }
        }
    }
    // A multi-threaded task's other threads are dumped with seccomp disabled and the
    // leader's chain flagged TSYNC (CRIU restores the chain on all of them from the leader):
    // without the flags, those threads would run unfiltered, and are refused.
    let python_core: images::CoreEntry =
        images::read_entries(&dir.join(format!("core-{thread}.img")), images::CORE_MAGIC)
            .unwrap()
            .remove(0);
    assert_eq!(python_core.thread_core.unwrap().seccomp_mode.unwrap_or(0), 0);
    let d = tmp.path().join("no-tsync");
    copy_dir(&dir, &d);
    edit_image(&d.join("seccomp.img"), 2, &mut |m| {
        edit_at(m, &[], &mut |entry| {
            for f in entry.iter_mut().filter(|f| f.tag == 1) {
                let Value::Bytes(b) = &f.value else { panic!("filter is a message") };
                f.value =
                    Value::Bytes(edit_at(b, &[], &mut |flt| set(flt, 3, vec![Value::Varint(0)])));
            }
        })
    });
    let (pid, tid, field, _) = refusal(check(&d));
    assert_eq!((pid, field.as_str()), (ppid, "seccomp_mode"));
    assert_ne!(tid, ppid);

    // Namespaces: the root task in the dumping CRIU's network namespace (what a sandbox of
    // host networking would be) and in a user namespace are refused too.
    let inv: Vec<images::InventoryEntry> =
        images::read_entries(&dir.join("inventory.img"), images::INVENTORY_MAGIC).unwrap();
    let host_net = inv[0].root_ids.as_ref().unwrap().net_ns_id.unwrap();
    let host_user = inv[0].root_ids.as_ref().unwrap().user_ns_id.unwrap();
    for (tag, value, field) in [(6, host_net, "ids.net_ns_id"), (10, host_user, "ids.user_ns_id")] {
        let d = tmp.path().join(format!("ns-{tag}"));
        copy_dir(&dir, &d);
        edit_image(&d.join("ids-1.img"), 2, &mut |m| {
            edit_at(m, &[], &mut |f| set(f, tag, vec![Value::Varint(u64::from(value))]))
        });
        let (pid, _, got, _) = refusal(check(&d));
        assert_eq!((pid, got.as_str()), (1, field));
    }
    // The user namespace's maps: a restore writes them, so a map onto the host's root (or
    // any id outside this host's range) would make the sandbox's root the host's.
    let userns_img = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("userns-"))
        .expect("a user-namespaced sandbox's point has a userns image");
    for (tag, what) in [(1u32, "uid_map"), (2, "gid_map")] {
        let d = tmp.path().join(format!("userns-{what}"));
        copy_dir(&dir, &d);
        edit_image(&d.join(userns_img.file_name().unwrap()), 2, &mut |m| {
            edit_at(m, &[tag], &mut |ext| set(ext, 2, vec![Value::Varint(0)]))
        });
        let (_, _, got, value) = refusal(check(&d));
        assert!(got.ends_with(what), "{got}");
        assert!(value.contains("0 0 65536"), "{value}");
    }
    // A point of the host's user namespace is held to that mode: refused in a range.
    assert!(crab_checkpoint::foreign::check(&dir, None).is_err());

    // The mount table: /proc/sys left out (the proc mount below it is read-write), or a
    // second procfs mounted elsewhere, is refused.
    let d = tmp.path().join("no-proc-sys");
    copy_dir(&dir, &d);
    edit_mounts(&d, &|m| if mountpoint_of(&m) == "/proc/sys" { vec![] } else { vec![m] });
    assert_eq!(mount_refusal(check(&d)), ("/proc/sys".into(), "mountpoint".into()));
    let d = tmp.path().join("extra-proc");
    copy_dir(&dir, &d);
    edit_mounts(&d, &|m| {
        if mountpoint_of(&m) != "/proc" {
            return vec![m];
        }
        let mut extra = m.clone();
        set(&mut extra, 2, vec![Value::Varint(999_999)]);
        set(&mut extra, 7, vec![Value::Bytes(b"/mnt".to_vec())]);
        vec![m, extra]
    });
    assert_eq!(mount_refusal(check(&d)), ("/mnt".into(), "mountpoint".into()));

    // A `nat` sandbox's point (a replayed network namespace with a veth) passes too.
    let nat = common::Sandbox::with_args("t-rimg-nat", &["--network", "nat"]);
    let v: serde_json::Value = serde_json::from_str(&common::crab_ok(&[
        "--json",
        "checkpoint",
        &nat.name,
        "--kind",
        "full",
    ]))
    .unwrap();
    let nat_dir = images_of(&common::state_dir(), &nat.name, v["point"]["id"].as_str().unwrap());
    check(&nat_dir).unwrap();

    // The untouched copy still passes (the copies are faithful).
    let d = tmp.path().join("same");
    copy_dir(&dir, &d);
    check(&d).unwrap();
}

/// Re-export local point `point` of `sb` on daemon `d` to `remote` as a new point numbered
/// `n` (a new point id and image id, so that the restoring host downloads its images afresh),
/// its images passed through `patch` and its manifest carrying their new SHA-256s: what an
/// attacker who can write the store can do. Returns the new point's id.
fn forge(
    d: &common::OtherDaemon,
    remote: &str,
    sb: &str,
    point: &str,
    n: u64,
    patch: &dyn Fn(&Path, u32),
) -> String {
    forge_as(d, remote, sb, point, n, patch, sb, &|_| {})
}

/// [`forge`], the point put under sandbox name `as_sandbox` with its manifest's sandbox record
/// (`sandbox_meta`, what a fork uses when no local sandbox has that name) passed through `meta`.
#[allow(clippy::too_many_arguments)]
fn forge_as(
    d: &common::OtherDaemon,
    remote: &str,
    sb: &str,
    point: &str,
    n: u64,
    patch: &dyn Fn(&Path, u32),
    as_sandbox: &str,
    meta: &dyn Fn(&mut serde_json::Value),
) -> String {
    let state = crab_common::paths::StateDir::new(&d.state);
    let store = store_of(&d.state, sb);
    let m = store.resolve(Some(point)).unwrap();
    let mut src = crab_remote::local::export_source(&state, &store, &m).unwrap();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let imgs = tmp.path().join("images");
    copy_dir(&store.proc_dir(m.procs.as_ref().unwrap().id), &imgs);
    patch(&imgs, 1);
    let mut m2 = m.clone();
    m2.id = crab_checkpoint::PointId(n);
    m2.sandbox = as_sandbox.to_string();
    meta(&mut m2.sandbox_meta);
    src.sandbox = as_sandbox.to_string();
    let procs = m2.procs.as_mut().unwrap();
    procs.id = crab_checkpoint::ProcId(n);
    procs.bytes = 0;
    for f in &mut procs.files {
        let (size, sha) = crab_checkpoint::store::hash_file(&imgs.join(&f.name)).unwrap();
        (f.size, f.sha256) = (size, sha);
        procs.bytes += size;
    }
    src.point = m2.id.to_string();
    src.manifest = crab_checkpoint::manifest::encode(&m2);
    src.procs_dir = Some(imgs);
    src.immutable_parts = false;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let opts = crab_remote::RepoOptions {
            key_file: None,
            cache_dir: tmp.path().join("cache"),
            bandwidth_bps: None,
        };
        let repo = crab_remote::Repo::open(remote, opts).await.unwrap();
        repo.export_point(&src).await.unwrap();
    });
    m2.id.to_string()
}

fn init_pid(d: &common::OtherDaemon, sb: &str) -> u64 {
    d.json(&["sandbox", "inspect", sb])["init_pid"].as_u64().unwrap()
}

fn status_of(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap()
}

fn status_field<'a>(status: &'a str, key: &str) -> &'a str {
    status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim).unwrap_or("")
}

#[test]
fn forged_remote_points_are_refused_end_to_end() {
    require_root!();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let store_dir = tmp.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let remote = format!("file://{}", store_dir.display());
    let d = common::OtherDaemon::start(
        &tmp.path().join("host"),
        &["--pool-size", "2G", "--remote", &remote],
        &[],
    );
    // A sandbox of an image holding nothing but the daemon's init: one task, dumped for real.
    let root = d.state.join("empty-root");
    std::fs::create_dir_all(&root).unwrap();
    d.crab_ok(&["image", "import", "empty", root.to_str().unwrap()]);
    let sb = common::unique("t-rforge");
    d.crab_ok(&["sandbox", "create", "empty", "--name", &sb]);
    let point = d.json(&["checkpoint", &sb, "--kind", "full", "--durable"])["point"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pid = init_pid(&d, &sb);
    let points = |d: &common::OtherDaemon| -> Vec<String> {
        d.json(&["checkpoints", &sb])
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_str().unwrap().to_string())
            .collect()
    };
    let before = points(&d);
    let sandboxes = |d: &common::OtherDaemon| -> Vec<String> {
        let v = d.json(&["sandbox", "ls"]);
        let mut n: Vec<String> =
            v.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap().to_string()).collect();
        n.sort();
        n
    };

    // Control: forged with nothing changed, the point restores, with the default profile.
    let ok = forge(&d, &remote, &sb, &point, 900_000, &|_, _| {});
    let copy = common::unique("t-rforge-ok");
    let report =
        d.json(&["sandbox", "create", "--from-remote", &format!("{sb}@{ok}"), "--name", &copy]);
    // The materialization ran the check (its own stage, timed).
    let stages = report["stages"].as_array().cloned().unwrap_or_default();
    let check = stages
        .iter()
        .find(|s| s[0] == "materialize_check_images")
        .unwrap_or_else(|| panic!("no check stage in {report}"));
    eprintln!("materialize_check_images of an init-only point: {} ms", check[1]);
    let st = status_of(init_pid(&d, &copy));
    assert_eq!(status_field(&st, "CapEff:"), "00000000a80405fb", "{st}");
    assert_eq!(status_field(&st, "CapBnd:"), "00000000a80405fb", "{st}");
    assert_eq!(status_field(&st, "Seccomp:"), "2", "{st}");
    assert_eq!(status_field(&st, "NoNewPrivs:"), "1", "{st}");
    assert_eq!(d.json(&["sandbox", "inspect", &copy])["profile"]["name"], "default");
    d.crab_ok(&["sandbox", "rm", "-f", &copy]);
    let listed = sandboxes(&d);
    // The control's materialization made a local point of `sb` (c900000): the source's own
    // points are all still there, and this list is what every refusal must leave.
    let after_control = points(&d);
    assert!(before.iter().all(|p| after_control.contains(p)), "{before:?} {after_control:?}");
    let before = after_control;

    for (i, f) in forgeries().iter().enumerate() {
        let forged = forge(&d, &remote, &sb, &point, 900_001 + i as u64, &*f.patch);
        let name = common::unique("t-rforge-bad");
        let out = d.crab(&[
            "sandbox",
            "create",
            "--from-remote",
            &format!("{sb}@{forged}"),
            "--name",
            &name,
        ]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{}: the forged point was restored", f.name);
        eprintln!("{}: {}", f.name, err.trim());
        assert!(err.contains("refusing point"), "{}: {err}", f.name);
        assert!(err.contains(f.field), "{}: the error does not name {}: {err}", f.name, f.field);
        if f.field == "flags" {
            assert!(err.contains("mount /proc/sys"), "{}: {err}", f.name);
        } else if f.field != "seccomp.filter" {
            assert!(err.contains("task 1 "), "{}: the error does not name the task: {err}", f.name);
        }
        // Nothing was made or touched: no branch, no local point, no images left behind; the
        // source runs on with its init and keeps its points.
        assert_eq!(sandboxes(&d), listed, "{}", f.name);
        assert!(!d.crab(&["sandbox", "inspect", &name]).status.success(), "{}", f.name);
        let store = store_of(&d.state, &sb);
        assert!(
            !store.manifest_path(crab_checkpoint::PointId(900_001 + i as u64)).exists(),
            "{}",
            f.name
        );
        assert!(
            !store.proc_dir(crab_checkpoint::ProcId(900_001 + i as u64)).exists(),
            "{}: images left",
            f.name
        );
        assert_eq!(points(&d), before, "{}", f.name);
        assert_eq!(init_pid(&d, &sb), pid, "{}", f.name);
        assert_eq!(d.json(&["sandbox", "inspect", &sb])["state"], "running", "{}", f.name);
    }

    // A remote point's record cannot grant --privileged or host networking: either is refused
    // naming the field (the point's sandbox_meta decides nothing), and nothing is made.
    for (suffix, id, field, forge) in [
        (
            "p",
            900_100u64,
            "sandbox_meta.profile.privileged",
            &(|m: &mut serde_json::Value| {
                m["profile"]["privileged"] = serde_json::Value::Bool(true)
            }) as &dyn Fn(&mut serde_json::Value),
        ),
        ("h", 900_200, "sandbox_meta.net", &|m: &mut serde_json::Value| {
            m["net"] = serde_json::Value::String("host".into())
        }),
    ] {
        let forged_sb = format!("{sb}-{suffix}");
        let fp = forge_as(&d, &remote, &sb, &point, id, &|_, _| {}, &forged_sb, forge);
        let listed = sandboxes(&d);
        let out = d.crab(&["sandbox", "create", "--from-remote", &format!("{forged_sb}@{fp}")]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success() && err.contains(field), "{err}");
        eprintln!("{field}: {}", err.trim());
        assert_eq!(sandboxes(&d), listed);
    }
    d.crab_ok(&["sandbox", "rm", "-f", &sb]);
}
