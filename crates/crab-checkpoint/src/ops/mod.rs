//! Checkpoint, restore, fork and prune of live sandboxes: the flows that tie the sandbox
//! runtime, CRIU and the restore-point store together.
//!
//! * **fs** checkpoint: freeze the sandbox's cgroup, take a read-only btrfs snapshot of its
//!   root, thaw.
//! * **process** / **full** checkpoint: CRIU dumps the tree rooted at the sandbox's init
//!   (stopped by ptrace, or optionally by its cgroup2 freezer; established TCP, external unix
//!   sockets, file locks, nftables network lock, left running); a full checkpoint takes the
//!   filesystem snapshot in CRIU's `post-dump` notification, while the tree is still stopped,
//!   so the pair is consistent.
//! * **skip**: a new point referencing the previous parts.
//! * **restore** in place: verify the point, prepare a writable snapshot of `F_k`, stop the
//!   sandbox, swap the root subvolumes, then CRIU-restores `P_j` into fresh namespaces inside
//!   the sandbox's cgroups (or starts a fresh init when the point has no process image).
//! * **fork**: N new sandboxes from one point, restored in parallel, each with its own root
//!   subvolume, cgroup, namespaces, hostname and machine-id.
//!
//! One file per flow: `checkpoint.rs`, `restore.rs`, `fork.rs`, and `incarnate.rs` for the
//! code restore and fork share (CRIU's restore options, the restore of a point's processes);
//! this file holds the [`Checkpointer`], its stores, recovery, listing and pruning.
//!
//! Operations on one sandbox are serialized (a mutex per sandbox in this process, the store's
//! `flock` across processes); different sandboxes proceed in parallel. Startup recovery skips
//! a sandbox whose lock another process holds: its staged parts are work in flight, not
//! leftovers. A fork branch has a (dead) sandbox record from the moment its directory exists,
//! so a runtime opened meanwhile by another process adopts it instead of discarding it as a
//! half-created sandbox.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crab_common::api::NetMode;
use crab_common::{CheckpointKind, PointKind, Progress};
use crab_criu::{phase, CgroupMode, Criu, DumpOpts, NetworkLockMethod, RestoreOpts};
use crab_sandbox::runtime::{
    cgroup_paths, install_init, new_machine_id, personalize, personalize_as, process_start_time,
};
use crab_sandbox::{btrfs, Runtime, SandboxRecord};

use crate::error::{CheckpointError, Result};
use crate::manifest::{Manifest, Origin};
use crate::snapfs::SnapshotFs;
use crate::store::{now_ms, Draft, PruneReport, Store};

mod checkpoint;
mod fork;
mod incarnate;
mod restore;

/// [`SnapshotFs`] on the btrfs pool: subvolume snapshots through `crab_sandbox::btrfs`.
#[derive(Debug, Default, Clone, Copy)]
pub struct BtrfsSnapshots;

impl SnapshotFs for BtrfsSnapshots {
    fn snapshot(&self, src: &Path, dst: &Path, readonly: bool) -> std::io::Result<()> {
        btrfs::snapshot(src, dst, readonly).map_err(|e| std::io::Error::other(e.to_string()))
    }
    fn seal(&self, path: &Path) -> std::io::Result<()> {
        btrfs::set_readonly(path, true).map_err(|e| std::io::Error::other(e.to_string()))
    }
    fn delete(&self, path: &Path) -> std::io::Result<()> {
        btrfs::remove_tree(path)
    }
    fn is_snapshot(&self, path: &Path) -> bool {
        btrfs::is_subvolume(path)
    }
}

/// Tunables of the flows.
#[derive(Debug, Clone)]
pub struct Config {
    /// CRIU log level of dumps and restores (0..=4). Default 2 (errors and warnings, which
    /// is what error messages quote), or `CRAB_CRIU_LOG_LEVEL`: level 4 costs about 25 ms per
    /// dump and per restore of a small sandbox here.
    pub criu_log_level: i32,
    /// Freeze the cgroup around fs-only snapshots.
    pub freeze_fs_snapshots: bool,
    /// Freeze process dumps with the sandbox's cgroup2 freezer (frozen by us first, so CRIU
    /// skips its own 100 ms polling) instead of CRIU's ptrace seizing. Off by default: on this
    /// kernel about one dump in 20-30 of a restored tree then fails after CRIU's freeze
    /// timeout with "Unseizable non-zombie ... state D" (CRIU issue #1034 looks alike), while
    /// ptrace seizing passed 120 dumps in a row. Both stop the whole tree while the
    /// filesystem snapshot is taken in the `post-dump` notification.
    pub cgroup_freezer: bool,
    /// A tmpfs directory where CRIU keeps its kernel-feature cache when the host's `/run` is
    /// not a tmpfs (see [`Criu::with_kdat_cache_dir`]); `None` lets CRIU probe on every run.
    pub criu_kdat_cache: Option<PathBuf>,
    /// Dump with CRIU's `--track-mem`: the tree's soft-dirty bits are cleared at each dump,
    /// while it is stopped. Only where the kernel has soft-dirty tracking (CRIU refuses it
    /// elsewhere); the host sets it from its start-up probe.
    pub track_mem: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            criu_log_level: std::env::var("CRAB_CRIU_LOG_LEVEL")
                .ok()
                .and_then(|l| l.parse().ok())
                .filter(|l| (0..=4).contains(l))
                .unwrap_or(2),
            freeze_fs_snapshots: true,
            cgroup_freezer: false,
            criu_kdat_cache: Some(PathBuf::from("/dev/shm/crab-criu-run")),
            track_mem: false,
        }
    }
}

/// A checkpoint request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// What to capture.
    pub kind: CheckpointKind,
    /// Turn number; default: the parent's plus one (0 for the first point).
    pub turn: Option<u64>,
    /// Conversation offset, when the caller knows it.
    pub conversation_offset: Option<u64>,
}

/// One row of `crab checkpoints SB`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointSummary {
    /// Point id (`c000007`).
    pub id: String,
    /// Turn.
    pub turn: Option<u64>,
    /// Kind (`skip`, `fs`, `process`, `full`), or `corrupt`.
    pub kind: String,
    /// Parts: `p000002+f000003`, `f000003` for a point without processes.
    pub parts: String,
    /// Bytes of its process image plus filesystem delta.
    pub size_bytes: u64,
    /// Publication time, ms since the epoch.
    pub created_at_ms: u64,
    /// Time the checkpoint took, in ms.
    pub took_ms: Option<f64>,
    /// Why the point is unusable, when it is.
    pub error: Option<String>,
    /// Why processes asked for are missing from the point (it holds the filesystem only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procs_missing: Option<String>,
}

impl PointSummary {
    /// The summary of one manifest.
    pub fn of(m: &Manifest) -> PointSummary {
        let parts =
            [m.procs.as_ref().map(|p| p.id.to_string()), m.fs.as_ref().map(|f| f.id.to_string())]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("+");
        PointSummary {
            id: m.id.to_string(),
            turn: Some(m.turn),
            kind: m.kind.as_str().into(),
            parts,
            size_bytes: m.size_bytes(),
            created_at_ms: m.created_at_ms,
            took_ms: m.timings.total_us.map(|u| u as f64 / 1000.0),
            error: None,
            procs_missing: m.procs_missing.clone(),
        }
    }
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreReport {
    /// Sandbox restored.
    pub sandbox: String,
    /// Point restored.
    pub point: String,
    /// The `restore` point published for it (now the newest).
    pub marker: String,
    /// Host pid of the sandbox's (restored or fresh) init.
    pub init_pid: u32,
    /// Whether processes were restored (false: a fresh init on the restored filesystem).
    pub processes_restored: bool,
    /// Wall time in ms: verification.
    pub verify_ms: f64,
    /// Wall time in ms: filesystem (snapshot, stop, swap).
    pub fs_ms: f64,
    /// Wall time in ms: CRIU restore or fresh start.
    pub procs_ms: f64,
    /// Wall time in ms, total.
    pub total_ms: f64,
    /// Where the time went, in order (ms each; they add up to `total_ms`): `lock` (the
    /// sandbox's and the store's locks, the point resolved), `snapshot` (the writable snapshot
    /// of the point's files, with the verification beside it), `prepare` (quota, init, free
    /// space), `stop` (the old processes killed and reaped), `swap` (the roots renamed),
    /// `criu` (cgroup, `criu swrk` and its notifications, until the tree runs), `record`,
    /// `marker` (the `restore` point published, durable). Absent from older daemons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<Stage>,
}

/// One timed stage of a restore.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    /// What ran.
    pub name: String,
    /// Its wall time in ms.
    pub ms: f64,
}

/// How [`Checkpointer::fork_files_or_all`] treats its point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForkOptions {
    /// The branches get the point's files and a fresh init, not its processes.
    pub fs_only: bool,
    /// The caller has just verified the point: its images are not hashed a second time.
    /// Otherwise they are hashed beside the branches' first stages, and every branch waits
    /// for that before its processes are restored.
    pub verified: bool,
}

/// One branch of a fork.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkBranch {
    /// The new sandbox.
    pub sandbox: String,
    /// Host pid of its init.
    pub init_pid: u32,
    /// Wall time of this branch in ms.
    pub ms: f64,
    /// That time by stage (snapshot, quota, personalize, image_links, cgroup, wait_verify,
    /// processes, record), ms. The branch's first point is made after it answered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<(String, f64)>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Free bytes the pool must have before a restore stops a sandbox or a fork starts: room for
/// the root swap, the new records and cgroups, and CRIU's writes.
pub const MIN_FREE_BYTES: u64 = 64 << 20;

fn sandbox_err(sandbox: &str) -> impl FnOnce(crab_sandbox::SandboxError) -> CheckpointError + '_ {
    move |e| match e {
        crab_sandbox::SandboxError::NoSandbox(n) => CheckpointError::SandboxNotFound(n),
        other => CheckpointError::Runtime { sandbox: sandbox.to_owned(), api: other.into() },
    }
}

fn cg_err(sandbox: &str) -> impl FnOnce(crab_sandbox::cgroup::CgroupError) -> CheckpointError + '_ {
    move |e| CheckpointError::Sandbox { sandbox: sandbox.to_owned(), message: e.to_string() }
}

/// Whether a restore lets CRIU create the sandbox's network namespace empty and sets it up
/// itself (`lo` up, unprivileged ping) instead of replaying the dumped one: for `private`
/// sandboxes under the default profile. Without `CAP_NET_ADMIN` their namespace can only be
/// what the starter made (`lo` up, the ping sysctl), and replaying it costs CRIU eight runs of
/// `ip`/`iptables` (≈ 100 ms of a 300 ms restore under load, measured from CRIU's log). `nat`
/// sandboxes (a veth) and `--privileged` ones (which may have configured anything) are replayed
/// — except a user-namespaced `nat` sandbox's: CRIU cannot make its veth pair from inside the
/// namespace (its usernsd gets `EOPNOTSUPP` from netlink), so the hook attaches a new pair
/// with the lease's address and routes, as a fresh start does, before any socket is restored.
fn fresh_netns(net: NetMode, profile: &crab_sandbox::profile::SecurityProfile) -> bool {
    !profile.privileged
        && (net == NetMode::Private || (net == NetMode::Nat && profile.userns.is_some()))
}

/// Set the hostname of the UTS namespace of `pid`, from a short-lived thread (setns affects
/// only the calling thread).
fn set_hostname_of(pid: i32, name: &str) -> std::result::Result<(), String> {
    crab_sandbox::spawn::in_namespace_of(
        pid as u32,
        "uts",
        nix::sched::CloneFlags::CLONE_NEWUTS,
        || nix::unistd::sethostname(name).map_err(|e| format!("sethostname {name}: {e}")),
    )
}

/// A frozen cgroup, thawed when dropped (errors then only logged) or by [`Freeze::thaw`].
struct Freeze<'a> {
    cg: &'a crab_sandbox::cgroup::SandboxCgroup,
    sandbox: &'a str,
    done: bool,
}

impl<'a> Freeze<'a> {
    fn new(cg: &'a crab_sandbox::cgroup::SandboxCgroup, sandbox: &'a str) -> Result<Freeze<'a>> {
        let f = Freeze { cg, sandbox, done: false };
        cg.set_frozen(true).map_err(cg_err(sandbox))?;
        Ok(f)
    }

    fn thaw(mut self) -> Result<()> {
        self.done = true;
        self.cg.set_frozen(false).map_err(cg_err(self.sandbox))
    }
}

impl Drop for Freeze<'_> {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.cg.set_frozen(false) {
                tracing::error!(sandbox = self.sandbox, error = %e, "cannot thaw the sandbox");
            }
        }
    }
}

/// The checkpoint/restore engine of one daemon.
#[derive(Debug)]
pub struct Checkpointer {
    rt: Arc<Runtime>,
    fs: Arc<dyn SnapshotFs>,
    cfg: Config,
    stores: Mutex<HashMap<String, Arc<Store>>>,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Fork branches whose first point is still being made, after they answered
    /// ([`fork::PendingOrigin`]): listing their points waits for it.
    origins: Arc<Mutex<HashMap<String, Arc<fork::VerifyGate>>>>,
    criu_version: std::sync::OnceLock<String>,
}

impl Checkpointer {
    /// An engine over `rt`'s sandboxes, snapshotting with btrfs.
    pub fn new(rt: Arc<Runtime>, cfg: Config) -> Checkpointer {
        Checkpointer::with_fs(rt, cfg, Arc::new(BtrfsSnapshots))
    }

    /// Whether dumps clear the tree's soft-dirty bits ([`Config::track_mem`]).
    pub fn track_mem(&self) -> bool {
        self.cfg.track_mem
    }

    /// An engine with another snapshot implementation.
    pub fn with_fs(rt: Arc<Runtime>, cfg: Config, fs: Arc<dyn SnapshotFs>) -> Checkpointer {
        Checkpointer {
            rt,
            fs,
            cfg,
            stores: Mutex::new(HashMap::new()),
            locks: Mutex::new(HashMap::new()),
            origins: Arc::default(),
            criu_version: std::sync::OnceLock::new(),
        }
    }

    /// The runtime.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }

    fn criu(&self) -> Result<Criu> {
        let criu = Criu::locate()?;
        Ok(match &self.cfg.criu_kdat_cache {
            Some(dir) => criu.with_kdat_cache_dir(dir),
            None => criu,
        })
    }

    fn criu_version(&self, criu: &Criu) -> String {
        self.criu_version
            .get_or_init(|| criu.version().map(|v| v.to_string()).unwrap_or_default())
            .clone()
    }

    /// The store of `sandbox` (created on first use).
    pub fn store(&self, sandbox: &str) -> Result<Arc<Store>> {
        crab_common::names::validate("sandbox", sandbox)
            .map_err(|e| CheckpointError::Invalid(e.message))?;
        let mut stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = stores.get(sandbox) {
            return Ok(s.clone());
        }
        let s = Arc::new(Store::for_sandbox(self.rt.state(), sandbox, self.fs.clone())?);
        stores.insert(sandbox.to_owned(), s.clone());
        Ok(s)
    }

    /// The store of the points of `sandbox` materialized from a remote store (created on first
    /// use): `<pool>/remote-points/<sandbox>`, never a local sandbox's own store, so a remote
    /// point does not join the points of a local sandbox of the same name.
    pub fn remote_store(&self, sandbox: &str) -> Result<Arc<Store>> {
        crab_common::names::validate("sandbox", sandbox)
            .map_err(|e| CheckpointError::Invalid(e.message))?;
        // `:` is not a name character: these keys never meet a sandbox's.
        let key = format!("remote:{sandbox}");
        let mut stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = stores.get(&key) {
            return Ok(s.clone());
        }
        let dir = self.rt.state().remote_points(sandbox);
        let s = Arc::new(Store::open(dir, sandbox, self.fs.clone())?);
        stores.insert(key, s.clone());
        Ok(s)
    }

    /// The store of `sandbox` if it has one, creating nothing.
    fn existing_store(&self, sandbox: &str) -> Result<Option<Arc<Store>>> {
        if let Some(s) = self.stores.lock().unwrap_or_else(|p| p.into_inner()).get(sandbox) {
            return Ok(Some(s.clone()));
        }
        let dir = self.rt.state().checkpoints(sandbox);
        Ok(Store::open_existing(dir, sandbox, self.fs.clone())?.map(Arc::new))
    }

    fn lock(&self, sandbox: &str) -> Arc<Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(sandbox.to_owned()).or_default().clone()
    }

    fn log_dir(&self, sandbox: &str) -> Result<PathBuf> {
        let dir = self.rt.state().logs().join("criu").join(sandbox);
        std::fs::create_dir_all(&dir).map_err(|e| CheckpointError::io("mkdir", &dir, e))?;
        Ok(dir)
    }

    fn alive(rec: &SandboxRecord) -> bool {
        crab_sandbox::runtime::init_alive(rec.init_pid, rec.init_start)
    }

    /// Startup recovery: discard staged leftovers of every sandbox's checkpoints, finish or
    /// undo interrupted root swaps, and thaw cgroups a killed daemon left frozen. Call once,
    /// before serving requests.
    pub fn recover(&self) -> Result<()> {
        let root = self.rt.state().pool().join("checkpoints");
        if let Ok(rd) = std::fs::read_dir(&root) {
            for entry in rd.flatten() {
                let Ok(name) = entry.file_name().into_string() else { continue };
                if crab_common::names::validate("sandbox", &name).is_err() {
                    continue;
                }
                // Points of sandboxes that no longer exist are kept (a fork may outlive its
                // source); only their leftovers go.
                let lock = self.lock(&name);
                let Ok(_guard) = lock.try_lock() else { continue };
                let recovered = self.existing_store(&name).and_then(|store| {
                    let Some(store) = store else { return Ok(()) };
                    match store.try_lock()? {
                        Some(_held) => store.recover_leftovers().map(drop),
                        None => {
                            tracing::info!(sandbox = %name, "restore points in use by another process; not recovering them");
                            Ok(())
                        }
                    }
                });
                if let Err(e) = recovered {
                    tracing::error!(sandbox = %name, error = %e, "cannot recover the restore points' leftovers; the other sandboxes are recovered, the daemon starts");
                }
            }
        }
        // One sandbox's leftover (a root it made undeletable, a broken store) must never keep
        // the daemon, and so every other sandbox on the host, from starting: each failure is
        // logged with its sandbox and the next is recovered.
        for name in self.rt.names() {
            if let Err(e) = self.recover_sandbox(&name) {
                tracing::error!(sandbox = %name, error = %e, "cannot recover this sandbox's interrupted work; it is left as it is (try `crab restore` or `crab sandbox rm --force`), the daemon starts");
            }
        }
        Ok(())
    }

    /// [`Checkpointer::recover`] for one sandbox: its checkpoint leftovers, an interrupted
    /// root swap, a cgroup left frozen, a CRIU network lock. Does nothing (logged) while an
    /// operation on the sandbox is in flight, in this process or another: what it would
    /// repair is that operation's work in progress.
    pub fn recover_sandbox(&self, name: &str) -> Result<()> {
        let lock = self.lock(name);
        let _guard = match lock.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                tracing::info!(sandbox = %name, "an operation is in flight; not recovering");
                return Ok(());
            }
        };
        // Without a store directory no checkpoint or restore of the sandbox was under way (and
        // opening the store would create one for a sandbox that may be going away).
        let mut _held = None;
        if let Some(store) = self.existing_store(name)? {
            let Some(held) = store.try_lock()? else {
                tracing::info!(sandbox = %name, "restore points in use by another process (or just removed); not recovering");
                return Ok(());
            };
            _held = Some(held);
            store.recover_leftovers()?;
            // A fork branch claims its name with a record whose init is 0 and holds its store's
            // lock until its init runs: such a record seen here (the lock is ours now) is a
            // branch whose fork was interrupted (`kill -9` of the daemon). It never ran and
            // nobody was given it: it goes, with its origin point.
            if self.rt.record(name).is_ok_and(|r| r.init_pid == 0) {
                tracing::warn!(sandbox = %name, "removing the branch of an interrupted fork");
                self.rt.remove(name, true).map_err(sandbox_err(name))?;
                store.remove_all()?;
                self.stores.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
                return Ok(());
            }
        }
        let dir = self.rt.state().sandbox_dir(name);
        let rootfs = self.rt.state().sandbox_rootfs(name);
        let old = dir.join("rootfs.old");
        let staged = dir.join("rootfs.restoring");
        if !rootfs.exists() && old.exists() {
            tracing::warn!(sandbox = %name, "interrupted restore: putting the old root back");
            std::fs::rename(&old, &rootfs).map_err(|e| CheckpointError::io("rename", &old, e))?;
        }
        for p in [old, staged] {
            if p.exists() {
                // A restore's deferred deletion of its replaced root (`delete_later`) may
                // remove it between the check and here: gone is what we want.
                if let Err(e) = self.fs.delete(&p) {
                    if p.exists() {
                        return Err(CheckpointError::io("delete", &p, e));
                    }
                }
            }
        }
        ensure_thawed(&self.rt.cgroup(name), name)?;
        if let Ok(rec) = self.rt.record(name) {
            if rec.net != crab_common::api::NetMode::Host && Self::alive(&rec) {
                drop_criu_network_locks(name, rec.init_pid);
            }
        }
        Ok(())
    }

    /// The restore points of `sandbox`, oldest first, unusable ones included (kind `corrupt`).
    pub fn list(&self, sandbox: &str) -> Result<Vec<PointSummary>> {
        self.origin_settled(sandbox);
        let store = self.store(sandbox)?;
        Ok(store
            .list_all()?
            .into_iter()
            .map(|(id, m)| match m {
                Ok(m) => PointSummary::of(&m),
                Err(e) => PointSummary {
                    id: id.to_string(),
                    turn: None,
                    kind: "corrupt".into(),
                    parts: String::new(),
                    size_bytes: 0,
                    created_at_ms: 0,
                    took_ms: None,
                    error: Some(e.to_string()),
                    procs_missing: None,
                },
            })
            .collect())
    }

    /// Keep the newest `keep_last` points of `sandbox`; the CRIU logs of the process images
    /// removed go too.
    pub fn prune(&self, sandbox: &str, keep_last: usize) -> Result<PruneReport> {
        let lock = self.lock(sandbox);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let store = self.store(sandbox)?;
        let _held = store.lock()?;
        let report = store.prune(keep_last)?;
        let dir = self.rt.state().logs().join("criu").join(sandbox);
        if !report.procs.is_empty() {
            if let Ok(rd) = std::fs::read_dir(&dir) {
                for entry in rd.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if report.procs.iter().any(|p| name.starts_with(&format!("{p}-"))) {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
        }
        Ok(report)
    }

    /// Delete every restore point of `sandbox` and its CRIU logs (when it is removed).
    pub fn remove_all(&self, sandbox: &str) -> Result<()> {
        let lock = self.lock(sandbox);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let store = self.store(sandbox)?;
        let held = store.lock()?;
        store.remove_all()?;
        drop(held);
        self.stores.lock().unwrap_or_else(|p| p.into_inner()).remove(sandbox);
        let logs = self.rt.state().logs().join("criu").join(sandbox);
        match std::fs::remove_dir_all(&logs) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CheckpointError::io("remove", &logs, e)),
        }
    }

    /// Delete `path` (a replaced root subvolume) on a thread of its own, once it holds the
    /// lock of `sandbox`: after the current operation on it, before the next one.
    fn delete_later(&self, sandbox: &str, path: PathBuf) {
        let lock = self.lock(sandbox);
        let fs = self.fs.clone();
        let spawned = std::thread::Builder::new().name("crab-delete-root".into()).spawn(move || {
            let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
            if fs.is_snapshot(&path) || path.exists() {
                if let Err(e) = fs.delete(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot delete the replaced root");
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to delete the replaced root; it is deleted by the next restore");
        }
    }

    /// Refuse `what` unless the pool has room for it: [`MIN_FREE_BYTES`] free.
    fn check_room(&self, sandbox: &str, what: &str) -> Result<()> {
        let free = crab_sandbox::pool::free_bytes(self.rt.state()).map_err(sandbox_err(sandbox))?;
        if free < MIN_FREE_BYTES {
            return Err(CheckpointError::Io {
                op: "check free space for",
                path: self.rt.state().pool(),
                source: std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!(
                        "{what} of {sandbox} needs {} MiB free in the pool, {} MiB are; nothing was changed",
                        MIN_FREE_BYTES >> 20,
                        free >> 20
                    ),
                ),
            });
        }
        Ok(())
    }
}

/// Delete the nftables tables (`inet CRIU-<run id>`) with which a CRIU killed in the middle
/// of a dump left the sandbox's network namespace locked. Best effort: failures are logged.
fn drop_criu_network_locks(sandbox: &str, init_pid: u32) {
    let netns = format!("--net=/proc/{init_pid}/ns/net");
    let out = std::process::Command::new("nsenter")
        .args([netns.as_str(), "nft", "list", "tables"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    let Ok(out) = out else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut words = line.split_whitespace();
        let (Some("table"), Some(family), Some(table)) = (words.next(), words.next(), words.next())
        else {
            continue;
        };
        if !table.starts_with("CRIU") {
            continue;
        }
        tracing::warn!(sandbox, table, "removing a network lock left by an interrupted CRIU dump");
        let ok = std::process::Command::new("nsenter")
            .args([netns.as_str(), "nft", "delete", "table", family, table])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            tracing::error!(sandbox, table, "cannot remove a CRIU network lock");
        }
    }
}

/// Thaw the sandbox's cgroup if something (an interrupted checkpoint) left it frozen.
fn ensure_thawed(cg: &crab_sandbox::cgroup::SandboxCgroup, sandbox: &str) -> Result<()> {
    let frozen = std::fs::read_to_string(cg.v2.join("cgroup.freeze"))
        .map(|s| s.trim() == "1")
        .unwrap_or(false);
    if frozen {
        tracing::warn!(sandbox, "thawing a cgroup left frozen by an interrupted checkpoint");
        cg.set_frozen(false).map_err(cg_err(sandbox))?;
    }
    Ok(())
}

fn staging_has_fs(kind: PointKind) -> bool {
    kind.new_fs()
}
