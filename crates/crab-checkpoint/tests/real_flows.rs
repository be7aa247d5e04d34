//! End-to-end checkpoint / restore / fork of real sandboxes (root, btrfs pool, CRIU 4.2.1).
//!
//! These tests open their own [`Runtime`] on the state directory of `make test`
//! (`CRAB_STATE_DIR`, default `/var/lib/crab`, whose `debian` image must exist: `make test`
//! builds it) and use the `crab` binary as the namespace helper (`CRAB_BIN`, default
//! `target/debug/crab`). Every sandbox they create is named `ckt-<pid>-...` and removed at the
//! end. Not run as root, they are skipped with a note on stderr.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crab_checkpoint::{CheckpointError, CheckpointRequest, Checkpointer, Config};
use crab_common::api::{ExecRequest, NetMode, SandboxCreateRequest};
use crab_common::paths::StateDir;
use crab_common::{CheckpointKind, NoProgress, PointKind};
use crab_sandbox::{Runtime, RuntimeConfig};

use crab_testkit::require_root;

/// A [`crab_common::Progress`] that keeps what it was told (`stage NAME`, `advance N`, `message
/// LINE`), in order.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<String>>);

impl Recorder {
    fn stages(&self) -> Vec<String> {
        let v = self.0.lock().unwrap();
        v.iter().filter_map(|e| e.strip_prefix("stage ").map(str::to_string)).collect()
    }
}

impl crab_common::Progress for Recorder {
    fn stage(&self, name: &str, _total: Option<u64>) {
        self.0.lock().unwrap().push(format!("stage {name}"));
    }
    fn advance(&self, done: u64) {
        self.0.lock().unwrap().push(format!("advance {done}"));
    }
    fn message(&self, line: &str) {
        self.0.lock().unwrap().push(format!("message {line}"));
    }
}

fn helper() -> PathBuf {
    std::env::var_os("CRAB_BIN").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/debug/crab"))
    })
}

/// One runtime for all tests, as in a daemon: a second `Runtime::open` on the same state
/// directory discards sandboxes that another one is creating at that moment.
fn runtime() -> Arc<Runtime> {
    static RT: OnceLock<Arc<Runtime>> = OnceLock::new();
    RT.get_or_init(open_runtime).clone()
}

/// Tests take this shared; the one that runs startup recovery (which assumes no operation is
/// in flight) takes it exclusively.
static EXCLUSIVE: RwLock<()> = RwLock::new(());

#[allow(dead_code)] // the guards are held for their Drop
enum Guard {
    Shared(RwLockReadGuard<'static, ()>),
    Exclusive(RwLockWriteGuard<'static, ()>),
}

fn open_runtime() -> Arc<Runtime> {
    let state = StateDir::new(
        std::env::var_os("CRAB_STATE_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(crab_common::paths::DEFAULT_STATE_DIR)),
    );
    let helper = helper();
    assert!(helper.exists(), "{} missing: build the workspace (make build)", helper.display());
    assert!(
        state.image_rootfs("debian").exists(),
        "no debian image in {}: run `make test` (it builds it)",
        state.root().display()
    );
    let rt = Runtime::open(RuntimeConfig {
        state,
        pool_size: crab_sandbox::pool::DEFAULT_POOL_SIZE,
        helper_exe: helper,
    })
    .unwrap();
    Arc::new(rt)
}

/// A sandbox that is removed (with its checkpoints and forks) when dropped.
struct Sb {
    rt: Arc<Runtime>,
    ck: Arc<Checkpointer>,
    name: String,
    extra: Vec<String>,
    _guard: Guard,
}

impl Sb {
    fn new(tag: &str) -> Sb {
        let guard = Guard::Shared(EXCLUSIVE.read().unwrap_or_else(|p| p.into_inner()));
        Sb::with_guard(tag, guard)
    }

    fn new_exclusive(tag: &str) -> Sb {
        let guard = Guard::Exclusive(EXCLUSIVE.write().unwrap_or_else(|p| p.into_inner()));
        Sb::with_guard(tag, guard)
    }

    fn with_net(tag: &str, net: NetMode) -> Sb {
        let guard = Guard::Shared(EXCLUSIVE.read().unwrap_or_else(|p| p.into_inner()));
        Sb::create(tag, guard, net)
    }

    fn with_guard(tag: &str, guard: Guard) -> Sb {
        Sb::create(tag, guard, NetMode::Private)
    }

    fn create(tag: &str, guard: Guard, net: NetMode) -> Sb {
        Sb::create_with(tag, guard, net, false)
    }

    fn create_with(tag: &str, guard: Guard, net: NetMode, privileged: bool) -> Sb {
        let rt = runtime();
        let ck = Arc::new(Checkpointer::new(rt.clone(), Config::default()));
        let name = format!("ckt-{}-{tag}", std::process::id());
        let req = SandboxCreateRequest {
            name: Some(name.clone()),
            net,
            privileged,
            ..SandboxCreateRequest::new("debian")
        };
        rt.create(&req).unwrap();
        Sb { rt, ck, name, extra: Vec::new(), _guard: guard }
    }

    fn sh_in(&self, sb: &str, script: &str) -> (i32, String) {
        let req = ExecRequest {
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            ..Default::default()
        };
        let spec = self.rt.exec_spec(sb, &req).unwrap();
        let out = Command::new(self.rt.helper_exe())
            .arg("__nsexec")
            .arg(serde_json::to_string(&spec).unwrap())
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn sh(&self, script: &str) -> String {
        let (code, out) = self.sh_in(&self.name, script);
        assert_eq!(code, 0, "`{script}` failed: {out}");
        out
    }

    fn write(&self, path: &str, content: &str) {
        let p = self.rt.state().sandbox_rootfs(&self.name).join(path.trim_start_matches('/'));
        std::fs::write(p, content).unwrap();
    }

    fn checkpoint(&self, kind: CheckpointKind) -> crab_checkpoint::Manifest {
        let t = Instant::now();
        let m = self
            .ck
            .checkpoint(
                &self.name,
                CheckpointRequest { kind, turn: None, conversation_offset: None },
            )
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "checkpoint {} {}: {:.1} ms (frozen {:?} us, fs {:?} us, dump {:?} us, hash {:?} us, sync {:?} us), {} bytes",
            m.id,
            kind.as_str(),
            t.elapsed().as_secs_f64() * 1000.0,
            m.timings.frozen_us,
            m.timings.fs_snapshot_us,
            m.timings.dump_us,
            m.timings.hash_us,
            m.timings.sync_us,
            m.size_bytes()
        );
        m
    }

    fn restore(&self, point: Option<&str>) -> crab_checkpoint::RestoreReport {
        let p = Recorder::default();
        let r = self.ck.restore(&self.name, point, &p).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("restore: {r:?}");
        // Every restore reports its stages, in order (`processes`: restored, or a fresh init).
        assert_eq!(p.stages(), ["verify", "filesystem", "processes"], "{r:?}");
        r
    }

    fn kill_all(&self) {
        self.rt.stop(&self.name).unwrap();
    }
}

impl Drop for Sb {
    fn drop(&mut self) {
        if std::env::var_os("CRAB_KEEP_TEST_SANDBOXES").is_some() {
            return;
        }
        for n in self.extra.iter().chain(std::iter::once(&self.name)) {
            let _ = self.rt.remove(n, true);
            let _ = self.ck.remove_all(n);
        }
    }
}

const COUNTER_SERVER: &str = r#"
import http.server
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        b = str(count).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"#;

const TCP_PAIR: &str = r#"
import os, socket, threading, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 9000))
srv.listen(1)
def serve():
    c, _ = srv.accept()
    n = 0
    while True:
        d = c.recv(100)
        if not d:
            break
        n += 1
        c.sendall(b"%d\n" % n)
threading.Thread(target=serve, daemon=True).start()
cl = socket.create_connection(("127.0.0.1", 9000))
f = cl.makefile("rb")
while True:
    try:
        cl.sendall(b"x")
        line = f.readline()
        if not line:
            raise EOFError("closed")
        with open("/tmp/tcp.tmp", "w") as o:
            o.write(line.decode().strip())
        os.rename("/tmp/tcp.tmp", "/tmp/tcp")
    except Exception as e:
        with open("/tmp/tcp", "w") as o:
            o.write("dead %r" % e)
        break
    time.sleep(0.05)
"#;

const GET: &str = "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/\").read().decode())'";

fn start_services(sb: &Sb) {
    sb.write("/root/counter.py", COUNTER_SERVER);
    sb.write("/root/tcp.py", TCP_PAIR);
    sb.sh(
        "setsid python3 /root/counter.py </dev/null >/dev/null 2>&1 & \
         setsid python3 /root/tcp.py </dev/null >/dev/null 2>&1 & \
         for i in $(seq 100); do [ -s /tmp/tcp ] && python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))' 2>/dev/null && break; sleep 0.05; done",
    );
}

fn tcp_count(sb: &Sb) -> u64 {
    let s = sb.sh("cat /tmp/tcp");
    s.parse().unwrap_or_else(|_| panic!("tcp client says {s:?}"))
}

fn wait_tcp_above(sb: &Sb, v: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = tcp_count(sb);
        if now > v {
            return now;
        }
        assert!(Instant::now() < deadline, "tcp counter stuck at {now}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn counter_and_tcp_survive_checkpoint_kill_restore() {
    require_root!();
    let sb = Sb::new("srv");
    start_services(&sb);
    for i in 1..=3 {
        assert_eq!(sb.sh(GET), i.to_string());
    }
    let tcp_before = wait_tcp_above(&sb, 2);
    let m = sb.checkpoint(CheckpointKind::Full);
    assert!(m.procs.is_some() && m.fs.is_some());
    let tcp_at = tcp_count(&sb);
    assert!(tcp_at >= tcp_before);
    // Work after the checkpoint, then lose everything.
    assert_eq!(sb.sh(GET), "4");
    assert_eq!(sb.sh(GET), "5");
    let tcp_late = wait_tcp_above(&sb, tcp_at + 10);
    sb.kill_all();

    let r = sb.restore(None);
    assert!(r.processes_restored);
    // The server's in-memory count is the checkpoint's.
    assert_eq!(sb.sh(GET), "4");
    // The established loopback connection survived and continues from the checkpoint.
    let after = wait_tcp_above(&sb, 0);
    let after = wait_tcp_above(&sb, after);
    assert!(after < tcp_late, "tcp count {after} did not go back (late {tcp_late})");

    // A second checkpoint of the restored sandbox, and a skip point on top.
    sb.checkpoint(CheckpointKind::Full);
    let skip = sb.checkpoint(CheckpointKind::Skip);
    // c1 full, c2 the restore marker, c3 full, c4 skip.
    let kinds: Vec<String> = sb.ck.list(&sb.name).unwrap().into_iter().map(|p| p.kind).collect();
    assert_eq!(kinds, ["full", "restore", "full", "skip"]);
    assert_eq!(sb.sh(GET), "5");
    sb.kill_all();
    sb.restore(Some(&skip.id.to_string()));
    assert_eq!(sb.sh(GET), "5");
}

#[test]
fn rollback_restores_files_and_removes_new_ones() {
    require_root!();
    let sb = Sb::new("fs");
    sb.sh("echo one > /root/a; mkdir -p /root/d; echo keep > /root/d/k");
    let p1 = sb.checkpoint(CheckpointKind::Fs);
    sb.sh("rm /root/a; echo two > /root/b; rm -r /root/d");
    sb.checkpoint(CheckpointKind::Fs);
    let p2 = sb.ck.store(&sb.name).unwrap().newest().unwrap();
    let r = sb.restore(Some(&p1.id.to_string()));
    assert_eq!(sb.sh("cat /root/a; cat /root/d/k; [ ! -e /root/b ] && echo nob"), "one\nkeep\nnob");
    // The rollback is now the newest point: a crash-restore does not resurrect p2's files.
    let newest = sb.ck.store(&sb.name).unwrap().newest().unwrap();
    assert_eq!(newest.id.to_string(), r.marker);
    assert_eq!(
        (newest.kind, newest.parent, newest.fs.clone()),
        (PointKind::Restore, Some(p1.id), p1.fs.clone())
    );
    sb.kill_all();
    sb.restore(None);
    assert_eq!(sb.sh("cat /root/a; [ ! -e /root/b ] && echo nob"), "one\nnob");
    // Forward again to p2.
    sb.restore(Some(&p2.id.to_string()));
    assert_eq!(sb.sh("[ ! -e /root/a ] && cat /root/b"), "two");
    // A skip after the rollback to p1 references p1's snapshot, not p2's.
    sb.restore(Some(&p1.id.to_string()));
    let skip = sb.checkpoint(CheckpointKind::Skip);
    assert_eq!(skip.fs, p1.fs);
}

#[test]
fn fs_only_point_restores_a_fresh_init() {
    require_root!();
    let sb = Sb::new("fresh");
    sb.sh("echo data > /root/f");
    let m = sb.checkpoint(CheckpointKind::Fs);
    assert!(m.procs.is_none(), "first fs point has no process image");
    sb.kill_all();
    let r = sb.restore(None);
    assert!(!r.processes_restored);
    assert_eq!(sb.sh("cat /root/f"), "data");
}

#[test]
fn three_forks_serve_and_diverge() {
    require_root!();
    let mut sb = Sb::new("fork");
    start_services(&sb);
    assert_eq!(sb.sh(GET), "1");
    assert_eq!(sb.sh(GET), "2");
    let m = sb.checkpoint(CheckpointKind::Full);
    let t = Instant::now();
    let p = Recorder::default();
    let branches = sb
        .ck
        .fork(&sb.name, Some(&m.id.to_string()), 3, None, &p)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.stages(), ["verify", "branches"]);
    assert_eq!(p.0.lock().unwrap().last().map(String::as_str), Some("advance 3"));
    eprintln!("fork of 3: {:.1} ms: {branches:?}", t.elapsed().as_secs_f64() * 1000.0);
    sb.extra = branches.iter().map(|b| b.sandbox.clone()).collect();
    assert_eq!(branches.len(), 3);
    let mut ids = Vec::new();
    for (i, b) in branches.iter().enumerate() {
        // Each branch continues from the checkpoint's count and diverges from the others.
        let get = |n: usize| {
            for _ in 0..n {
                sb.sh_in(&b.sandbox, GET);
            }
            sb.sh_in(&b.sandbox, GET).1
        };
        assert_eq!(get(i), (3 + i).to_string(), "branch {}", b.sandbox);
        let (_, host) = sb.sh_in(&b.sandbox, "hostname; cat /etc/hostname; cat /etc/machine-id");
        let lines: Vec<&str> = host.lines().collect();
        assert_eq!(lines[0], b.sandbox, "uts hostname");
        assert_eq!(lines[1], b.sandbox, "/etc/hostname");
        ids.push(lines[2].to_owned());
        // The TCP pair lives on in every branch.
        let (_, tcp) = sb.sh_in(&b.sandbox, "cat /tmp/tcp");
        assert!(tcp.parse::<u64>().is_ok(), "branch tcp: {tcp}");
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "machine-ids are unique");
    // The source is untouched.
    assert_eq!(sb.sh(GET), "3");

    // Each branch has its own first point, independent of the source's store: delete the
    // source with all its points, then roll a branch back to its fork point.
    // The first point is made after the branch answered; listing waits for it. Its tree is the
    // branch's root as it was before anything ran: the branch's hostname and machine-id.
    let b = &branches[2].sandbox;
    assert_eq!(sb.ck.list(b).unwrap().len(), 1, "listing waits for the branch's first point");
    let points = sb.ck.store(b).unwrap().list().unwrap();
    assert_eq!(points.len(), 1);
    assert_eq!(points[0].origin.as_ref().map(|o| o.point), Some(m.id));
    let origin_fs = sb.ck.store(b).unwrap().fs_path(points[0].fs.as_ref().unwrap().id);
    let read = |f: &str| std::fs::read_to_string(origin_fs.join(f)).unwrap();
    assert_eq!(read("etc/hostname").trim(), b.as_str());
    let (_, running_id) = sb.sh_in(b, "cat /etc/machine-id");
    assert_eq!(read("etc/machine-id").trim(), running_id.trim(), "the running branch's machine-id");
    assert!(crab_sandbox::btrfs::is_subvolume(&origin_fs));
    assert!(
        std::fs::write(origin_fs.join("etc/hostname"), "x").is_err(),
        "the first point's tree is read-only"
    );
    sb.rt.remove(&sb.name, true).unwrap();
    sb.ck.remove_all(&sb.name).unwrap();
    sb.sh_in(b, GET);
    sb.rt.stop(b).unwrap();
    let r = sb.ck.restore(b, None, &NoProgress).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.processes_restored);
    assert_eq!(sb.sh_in(b, GET).1, "3", "branch back at the fork point");
    let (_, host) = sb.sh_in(b, "hostname; cat /etc/hostname");
    assert_eq!(host, format!("{b}\n{b}"));
}

#[test]
fn flipped_image_byte_is_refused_and_sandbox_left_alone() {
    require_root!();
    let sb = Sb::new("flip");
    start_services(&sb);
    assert_eq!(sb.sh(GET), "1");
    let m = sb.checkpoint(CheckpointKind::Full);
    let store = sb.ck.store(&sb.name).unwrap();
    let dir = store.proc_dir(m.procs.as_ref().unwrap().id);
    let pages = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("pages-"))
        .unwrap();
    let mut bytes = std::fs::read(&pages).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x04;
    std::fs::write(&pages, &bytes).unwrap();
    let pid_before = sb.rt.record(&sb.name).unwrap().init_pid;
    let err = sb.ck.restore(&sb.name, None, &NoProgress).unwrap_err();
    assert!(matches!(&err, CheckpointError::Corrupt { path, .. } if path == &pages), "{err}");
    assert_eq!(err.to_api().code, crab_common::ErrorCode::CorruptCheckpoint);
    // Nothing was touched: same init, the server still counts on.
    assert_eq!(sb.rt.record(&sb.name).unwrap().init_pid, pid_before);
    assert_eq!(sb.sh(GET), "2");
}

#[test]
fn interrupted_checkpoint_leaves_older_points_restorable() {
    require_root!();
    let sb = Sb::new_exclusive("crash");
    start_services(&sb);
    assert_eq!(sb.sh(GET), "1");
    sb.checkpoint(CheckpointKind::Full);
    assert_eq!(sb.sh(GET), "2");
    // What a daemon killed in the middle of a checkpoint leaves: staged parts, a temp
    // manifest, and the sandbox's cgroup frozen by CRIU's freezer.
    let store = sb.ck.store(&sb.name).unwrap();
    let tmp = store.dir().join("tmp/p000099");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(tmp.join("pages-1.img"), b"partial").unwrap();
    std::fs::write(store.dir().join("points/c000099.manifest.tmp"), b"crab-restore-point 1\n{")
        .unwrap();
    // ... and the network lock of a CRIU killed mid-dump, which drops every packet.
    let pid = sb.rt.record(&sb.name).unwrap().init_pid;
    let nft = |args: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!("nsenter --net=/proc/{pid}/ns/net nft {args}"))
            .output()
            .unwrap()
    };
    assert!(nft("add table inet CRIU-test-lock").status.success());
    assert!(nft(
        "'add chain inet CRIU-test-lock in { type filter hook input priority 0; policy drop; }'"
    )
    .status
    .success());
    sb.rt.cgroup(&sb.name).set_frozen(true).unwrap();

    // A new daemon starts: recovery first.
    let ck2 = Checkpointer::new(sb.rt.clone(), Config::default());
    ck2.recover_sandbox(&sb.name).unwrap();
    assert!(!tmp.exists());
    let tables = String::from_utf8_lossy(&nft("list tables").stdout).into_owned();
    assert!(!tables.contains("CRIU"), "{tables}");
    assert_eq!(sb.sh(GET), "3", "the sandbox was thawed and its network unlocked");
    sb.kill_all();
    let r = ck2.restore(&sb.name, None, &NoProgress).unwrap();
    assert!(r.processes_restored);
    assert_eq!(sb.sh(GET), "2");
}

#[test]
fn prune_keeps_the_newest_points_restorable() {
    require_root!();
    let sb = Sb::new("prune");
    start_services(&sb);
    sb.checkpoint(CheckpointKind::Full);
    sb.checkpoint(CheckpointKind::Fs);
    sb.checkpoint(CheckpointKind::Skip);
    sb.checkpoint(CheckpointKind::Full);
    sb.checkpoint(CheckpointKind::Skip);
    let r = sb.ck.prune(&sb.name, 2).unwrap();
    assert_eq!(r.points.len(), 3);
    assert_eq!(sb.ck.list(&sb.name).unwrap().len(), 2);
    sb.kill_all();
    sb.restore(None);
    assert_eq!(sb.sh(GET), "1");
}

#[test]
fn other_network_modes_checkpoint_and_restore() {
    require_root!();
    for (tag, net) in [("none", NetMode::None), ("host", NetMode::Host)] {
        let sb = Sb::with_net(tag, net);
        sb.sh(
            "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/c.tmp; mv /tmp/c.tmp /tmp/c; sleep 0.05; done' </dev/null >/dev/null 2>&1 & sleep 0.3",
        );
        sb.checkpoint(CheckpointKind::Full);
        let at: u64 = sb.sh("cat /tmp/c").parse().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let late: u64 = sb.sh("cat /tmp/c").parse().unwrap();
        assert!(late > at + 3, "{tag}: counter not running ({at} -> {late})");
        sb.kill_all();
        sb.restore(None);
        std::thread::sleep(Duration::from_millis(300));
        let now: u64 = sb.sh("cat /tmp/c").parse().unwrap();
        assert!(now < late, "{tag}: counter did not go back ({late} -> {now})");
    }
}

/// Not a test on its own: the "daemon" that `daemon_killed_mid_checkpoint...` kills. Takes
/// full checkpoints of `$CRAB_CKPT_CHILD` in a loop until killed.
#[test]
#[ignore]
fn checkpoint_child_helper() {
    let Ok(name) = std::env::var("CRAB_CKPT_CHILD") else { return };
    let ck = Checkpointer::new(runtime(), Config::default());
    if let Ok(ready) = std::env::var("CRAB_CKPT_READY") {
        std::fs::write(ready, b"1").unwrap();
    }
    for _ in 0..50 {
        let t = Instant::now();
        let r = ck.checkpoint(
            &name,
            CheckpointRequest { kind: CheckpointKind::Full, turn: None, conversation_offset: None },
        );
        eprintln!("child checkpoint after {:?}: {:?}", t.elapsed(), r.map(|m| m.id));
    }
}

#[test]
fn daemon_killed_mid_checkpoint_leaves_older_points_restorable() {
    require_root!();
    let sb = Sb::new_exclusive("kill9");
    start_services(&sb);
    assert_eq!(sb.sh(GET), "1");
    sb.checkpoint(CheckpointKind::Full);
    let ready = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    // Kill times after the child starts checkpointing: inside the freeze and dump, the
    // snapshot, the hashing and the publication.
    for (round, delay_ms) in [5u64, 60, 150, 300, 500, 900].into_iter().enumerate() {
        let _ = std::fs::remove_file(&ready);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "checkpoint_child_helper",
                "--ignored",
                "--test-threads=1",
                "--nocapture",
            ])
            .env("CRAB_CKPT_CHILD", &sb.name)
            .env("CRAB_CKPT_READY", &*ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("CRAB_TEST_CHILD_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready.exists() {
            assert!(Instant::now() < deadline, "checkpoint child never got ready");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        // The orphaned criu swrk notices its peer is gone and gives up; give it a moment.
        std::thread::sleep(Duration::from_millis(300));

        // A new daemon: recovery, then every published point must verify.
        let ck = Checkpointer::new(sb.rt.clone(), Config::default());
        ck.recover_sandbox(&sb.name).unwrap();
        let store = ck.store(&sb.name).unwrap();
        let points = store.list().unwrap();
        for m in &points {
            store.verify(m).unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        assert_eq!(
            std::fs::read_dir(store.dir().join("tmp")).unwrap().count(),
            0,
            "round {round}: leftovers in tmp/"
        );
        // The sandbox runs (thawed), then is lost and comes back from the newest point.
        let before: u64 = sb.sh(GET).parse().unwrap();
        sb.kill_all();
        ck.restore(&sb.name, None, &NoProgress).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let after: u64 = sb.sh(GET).parse().unwrap();
        assert!(after <= before, "round {round}: {after} > {before}");
        eprintln!(
            "round {round} (kill after {delay_ms} ms): {} points, GET {before} -> {after}",
            points.len()
        );
    }
}
