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
use crab_sandbox::runtime::{cgroup_paths, install_init, personalize, process_start_time};
use crab_sandbox::{btrfs, Runtime, SandboxRecord};

use crate::error::{CheckpointError, Result};
use crate::manifest::{Manifest, Origin};
use crate::snapfs::SnapshotFs;
use crate::store::{now_ms, Draft, PruneReport, Store};

/// [`SnapshotFs`] on the btrfs pool: subvolume snapshots through `crab_sandbox::btrfs`.
#[derive(Debug, Default, Clone, Copy)]
pub struct BtrfsSnapshots;

impl SnapshotFs for BtrfsSnapshots {
    fn snapshot(&self, src: &Path, dst: &Path, readonly: bool) -> std::io::Result<()> {
        btrfs::snapshot(src, dst, readonly).map_err(|e| std::io::Error::other(e.to_string()))
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
    /// The caller has just verified the point (one it materialized from a remote store and
    /// checked with [`Store::verify_and_sync`]): its images are not hashed a second time.
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
    /// That time by stage (snapshot, quota, origin_point, cgroup, processes, record), ms.
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

/// Set the hostname of the UTS namespace of `pid`, from a short-lived thread (setns affects
/// only the calling thread).
/// Whether a restore lets CRIU create the sandbox's network namespace empty and sets it up
/// itself (`lo` up, unprivileged ping) instead of replaying the dumped one: for `private`
/// sandboxes under the default profile. Without `CAP_NET_ADMIN` their namespace can only be
/// what the starter made (`lo` up, the ping sysctl), and replaying it costs CRIU eight runs of
/// `ip`/`iptables` (≈ 100 ms of a 300 ms restore under load, measured from CRIU's log). `nat`
/// sandboxes (a veth) and `--privileged` ones (which may have configured anything) are replayed.
fn fresh_netns(net: NetMode, profile: &crab_sandbox::profile::SecurityProfile) -> bool {
    net == NetMode::Private && !profile.privileged
}

/// The `setup-namespaces` part of a restore hook: set up the empty network namespace CRIU made.
fn set_up_fresh_netns(n: &crab_criu::Notify, fresh: bool) -> std::result::Result<(), String> {
    if fresh && n.phase == phase::SETUP_NAMESPACES {
        let pid = n.pid.ok_or("setup-namespaces without the root task's pid")?;
        crab_sandbox::spawn::set_up_private_netns(pid as u32, true)?;
    }
    Ok(())
}

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

    /// Take a checkpoint of `sandbox` and publish it as a new restore point. (It reports no
    /// progress: it runs as an engine job, inside a turn or behind `crab checkpoint`'s answer,
    /// and its stages are timed in the manifest instead.)
    pub fn checkpoint(&self, sandbox: &str, req: CheckpointRequest) -> Result<Manifest> {
        let started = Instant::now();
        let lock = self.lock(sandbox);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.rt.record(sandbox).map_err(sandbox_err(sandbox))?;
        let store = self.store(sandbox)?;
        let _held = store.lock()?;
        let lock_us = us(started.elapsed());
        let parent = match store.newest() {
            Ok(m) => Some(m),
            Err(CheckpointError::NoPoints { .. }) => None,
            Err(e) => return Err(e),
        };
        let turn = req.turn.unwrap_or_else(|| parent.as_ref().map_or(0, |p| p.turn + 1));
        let mut draft = Draft::new(req.kind, turn);
        draft.timings.lock_us = Some(lock_us);
        draft.conversation_offset = req.conversation_offset;
        draft.started = Some(started);
        draft.sandbox_meta = serde_json::to_value(&rec).unwrap_or_default();
        let alive = Self::alive(&rec);
        let rootfs = self.rt.state().sandbox_rootfs(sandbox);
        let cg = self.rt.cgroup(sandbox);
        let mut staging = store.begin();

        match req.kind {
            CheckpointKind::Skip => {}
            CheckpointKind::Fs => {
                let t0 = Instant::now();
                let frozen = if alive && self.cfg.freeze_fs_snapshots {
                    Some(Freeze::new(&cg, sandbox)?)
                } else {
                    None
                };
                let t1 = Instant::now();
                let snap = staging.snapshot_fs(&rootfs);
                draft.timings.fs_snapshot_us = Some(us(t1.elapsed()));
                if let Some(f) = frozen {
                    f.thaw()?;
                    draft.timings.frozen_us = Some(us(t0.elapsed()));
                }
                snap?;
                if parent.as_ref().is_some_and(|p| p.procs.is_none()) {
                    draft.no_procs = true;
                }
            }
            CheckpointKind::Process | CheckpointKind::Full => {
                if !alive {
                    return Err(CheckpointError::Sandbox {
                        sandbox: sandbox.to_owned(),
                        message: format!(
                            "its init {} is gone, so there are no processes to checkpoint; take an fs checkpoint or restore it",
                            rec.init_pid
                        ),
                    });
                }
                let criu = self.criu()?;
                let images = staging.proc_dir()?;
                let image_name = images
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let log = self.log_dir(sandbox)?.join(format!("{image_name}-dump.log"));
                let mut opts =
                    DumpOpts::new(i32::try_from(rec.init_pid).unwrap_or(i32::MAX), &images, &log);
                opts.log_level = self.cfg.criu_log_level;
                opts.leave_running = true;
                opts.track_mem = self.cfg.track_mem;
                opts.tcp_established = true;
                // A connection still in a listen queue cannot be dumped; rather than fail the
                // checkpoint, leave it out (its client sees a reset after a restore).
                opts.tcp_skip_in_flight = true;
                opts.ext_unix_sk = true;
                opts.file_locks = true;
                opts.network_lock = Some(NetworkLockMethod::Nftables);
                let use_freezer = self.cfg.cgroup_freezer;
                if use_freezer {
                    opts.freeze_cgroup = Some(cg.v2.clone());
                }
                opts.manage_cgroups = Some(CgroupMode::Ignore);
                if !rec.profile.privileged {
                    // The masked directories' empty tmpfs: re-created by the restore, not
                    // archived with tar (see `profile::MASKED_MOUNT_KEY`).
                    opts.external.extend(crab_sandbox::profile::masked_dump_externals());
                }
                let full = req.kind == CheckpointKind::Full;
                let fs_path = if full { Some(staging.fs_path()) } else { None };
                let mut snap_us = None;
                let mut snap_err = None;
                let mut staging_fallback = false;
                let fs = self.fs.clone();
                // Freeze the cgroup ourselves: CRIU then finds it frozen and skips its own
                // freeze loop (which polls every 100 ms), and leaves it frozen for us to thaw.
                let t0 = Instant::now();
                let frozen = if use_freezer { Some(Freeze::new(&cg, sandbox)?) } else { None };
                let stats = criu.dump_with(&opts, |n| {
                    if n.phase == phase::POST_DUMP {
                        if let Some(dst) = &fs_path {
                            let t = Instant::now();
                            if let Err(e) = fs.snapshot(&rootfs, dst, true) {
                                snap_err = Some(CheckpointError::io("snapshot", dst, e));
                                return Err("filesystem snapshot failed".into());
                            }
                            snap_us = Some(us(t.elapsed()));
                        }
                    }
                    Ok(())
                });
                let dump_us = us(t0.elapsed());
                if let Some(f) = frozen {
                    f.thaw()?;
                }
                if let Some(e) = snap_err {
                    return Err(e);
                }
                let stats = match stats {
                    Ok(s) => s,
                    Err(e) => {
                        // A CRIU that died (killed, timed out) cannot unlock the network it
                        // locked: do it, or the sandbox stays offline until the next start.
                        if rec.net != crab_common::api::NetMode::Host {
                            drop_criu_network_locks(sandbox, rec.init_pid);
                        }
                        // The sandbox's processes cannot be dumped (a mount CRIU refuses,
                        // say): publish its files at least, saying why processes are missing.
                        let reason = format!("CRIU could not dump the processes: {e}");
                        tracing::warn!(sandbox, error = %e, "dump failed; publishing the filesystem only");
                        staging.discard_proc()?;
                        if let Some(p) = &fs_path {
                            if self.fs.is_snapshot(p) {
                                self.fs
                                    .delete(p)
                                    .map_err(|e| CheckpointError::io("delete", p, e))?;
                            }
                        }
                        let frozen = if self.cfg.freeze_fs_snapshots {
                            Some(Freeze::new(&cg, sandbox)?)
                        } else {
                            None
                        };
                        let t1 = Instant::now();
                        let snap = staging.snapshot_fs(&rootfs);
                        draft.timings.fs_snapshot_us = Some(us(t1.elapsed()));
                        if let Some(f) = frozen {
                            f.thaw()?;
                        }
                        snap?;
                        draft.kind = PointKind::FS;
                        draft.no_procs = true;
                        draft.procs_missing = Some(reason);
                        staging_fallback = true;
                        crab_criu::DumpStats::default()
                    }
                };
                draft.timings.dump_us = Some(dump_us);
                if !staging_fallback {
                    draft.timings.fs_snapshot_us = snap_us;
                    // Our freeze spans the whole dump; CRIU's own figure otherwise.
                    draft.timings.frozen_us = if use_freezer {
                        Some(us(t0.elapsed()))
                    } else {
                        stats.frozen_time.map(us)
                    };
                    draft.root_pid = opts.pid;
                    draft.criu_version = self.criu_version(&criu);
                }
            }
        }
        if staging_has_fs(draft.kind) {
            // Simple quotas charge every extent to the subvolume that allocated it: the growth
            // of the live root's count since the previous snapshot is what this turn wrote.
            let written = crab_sandbox::quota::exclusive_bytes(&rootfs);
            draft.fs_written_bytes = written;
            draft.fs_delta_bytes = written.map(|now| {
                now.saturating_sub(
                    parent
                        .as_ref()
                        .and_then(|p| p.fs.as_ref())
                        .and_then(|f| f.written_bytes)
                        .unwrap_or(0),
                )
            });
        }
        let m = staging.publish(draft)?;
        tracing::info!(
            sandbox,
            point = %m.id,
            kind = m.kind.as_str(),
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "checkpoint published"
        );
        Ok(m)
    }

    /// The restore points of `sandbox`, oldest first, unusable ones included (kind `corrupt`).
    pub fn list(&self, sandbox: &str) -> Result<Vec<PointSummary>> {
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

    fn restore_opts(
        &self,
        images: &Path,
        log: PathBuf,
        root: &Path,
        cgroups: Vec<PathBuf>,
        profile: &crab_sandbox::profile::SecurityProfile,
        net: NetMode,
    ) -> RestoreOpts {
        let mut o = RestoreOpts::new(images, log);
        if fresh_netns(net, profile) {
            // See `fresh_netns`: CRIU makes the namespace empty, the hook sets it up.
            o.empty_ns = libc::CLONE_NEWNET as u32;
        }
        o.log_level = self.cfg.criu_log_level;
        o.root = Some(root.to_path_buf());
        // The init must outlive the daemon, as a freshly started one does: let it be
        // re-parented away from us when `criu swrk` exits.
        o.sibling = false;
        o.tcp_established = true;
        o.ext_unix_sk = true;
        o.file_locks = true;
        // CRIU's network lock keeps packets from outside away from TCP connections while they
        // are half restored. A namespace CRIU makes empty for this restore (`fresh_netns`)
        // has only `lo` and no way in — no interface, and no task of it runs before the
        // restore completes — so the lock guards nothing there; it cost an nftables table
        // added and removed through libnftables, 15–35 ms of CRIU's restore under load
        // (its log, issue 15). Replayed namespaces (`nat`, `--privileged`) keep it.
        o.network_lock = Some(if fresh_netns(net, profile) {
            NetworkLockMethod::Skip
        } else {
            NetworkLockMethod::Nftables
        });
        o.manage_cgroups = Some(CgroupMode::Ignore);
        o.join_cgroups = cgroups;
        // The default profile gives every sandbox its own cgroup namespace; CRIU does not
        // restore it with unmanaged cgroups, so criu swrk makes one after joining the groups.
        o.cgroup_ns = !profile.privileged;
        o
    }

    /// The `external` entry a restore or fork of `sandbox` needs for its masked directories:
    /// dumps declare them external (`profile::MASKED_MOUNT_KEY`), and they come back as
    /// read-only binds of the daemon's empty tmpfs, mounted here if it is not. Unused by
    /// images dumped before that, which still hold the tmpfs. None for `--privileged`.
    fn masked_external(
        &self,
        sandbox: &str,
        profile: &crab_sandbox::profile::SecurityProfile,
    ) -> Result<Option<String>> {
        if profile.privileged {
            return Ok(None);
        }
        let src = self.rt.state().masked();
        crab_sandbox::profile::ensure_masked_source(&src).map_err(sandbox_err(sandbox))?;
        Ok(Some(crab_sandbox::profile::masked_restore_external(&src)))
    }

    /// Restore `sandbox` in place to `point` (newest when `None`): filesystem first, then
    /// processes. Verification happens before anything is touched: a corrupt or missing file
    /// refuses the restore and leaves the sandbox as it was. Reports its stages (`verify`,
    /// `filesystem`, `processes`) to `progress`.
    pub fn restore(
        &self,
        sandbox: &str,
        point: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<RestoreReport> {
        let started = Instant::now();
        let mut stages = crab_common::stats::StageClock::starting(started);
        let lock = self.lock(sandbox);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.rt.record(sandbox).map_err(sandbox_err(sandbox))?;
        let store = self.store(sandbox)?;
        let _held = store.lock()?;
        let m = store.resolve(point)?;
        stages.mark("lock");
        progress.stage("verify", None);
        progress.message(&format!("restore point {} (turn {}, {})", m.id, m.turn, m.kind.as_str()));
        let fs = m.fs.as_ref().ok_or_else(|| {
            CheckpointError::Invalid(format!("restore point {} has no filesystem snapshot", m.id))
        })?;
        let criu = if m.procs.is_some() { Some(self.criu()?) } else { None };
        // Can CRIU bring the point's processes back? A tree spanning two namespaces of a kind
        // (a point of an older daemon, whose execs after a restore stayed outside the
        // restored init's time namespace) fails in CRIU after the sandbox's processes were
        // stopped: refuse it now, with the sandbox untouched.
        if let Some(p) = &m.procs {
            let dir = store.proc_dir(p.id);
            crab_criu::images::check_shared_namespaces(&dir).map_err(|e| {
                CheckpointError::corrupt(
                    &dir,
                    format!(
                        "restore point {} cannot be restored with its processes ({e}); nothing \
                         was stopped: restore another point",
                        m.id
                    ),
                )
            })?;
        }
        let t_fs = Instant::now();
        let dir = self.rt.state().sandbox_dir(sandbox);
        let rootfs = self.rt.state().sandbox_rootfs(sandbox);
        let staged = dir.join("rootfs.restoring");
        let old = dir.join("rootfs.old");
        for p in [&staged, &old] {
            if p.exists() {
                self.fs.delete(p).map_err(|e| CheckpointError::io("delete", p, e))?;
            }
        }
        // Verification (hashing the images) and the writable snapshot of F_k overlap: neither
        // touches the sandbox, and a failed verification discards the snapshot.
        let src = store.fs_path(fs.id);
        let (verified, snap) = std::thread::scope(|scope| {
            let v = scope.spawn(|| {
                let t = Instant::now();
                store.verify(&m).map(|()| ms(t.elapsed()))
            });
            let snap = self.fs.snapshot(&src, &staged, false);
            let verified = v.join().unwrap_or_else(|_| {
                Err(CheckpointError::Invalid("verification thread panicked".into()))
            });
            (verified, snap)
        });
        let verify_ms = match verified {
            Ok(ms) => ms,
            Err(e) => {
                if staged.exists() {
                    if let Err(d) = self.fs.delete(&staged) {
                        tracing::warn!(path = %staged.display(), error = %d, "cannot discard the staged root");
                    }
                }
                return Err(e);
            }
        };
        snap.map_err(|e| CheckpointError::io("snapshot", &staged, e))?;
        stages.mark("snapshot");
        // Every precondition is checked while the sandbox still runs: the init goes into the
        // staged root (a write that needs space), and the pool must keep room for the swap,
        // the cgroup and CRIU's work. A failure here leaves the sandbox untouched.
        // The sandbox's disk quota goes with it onto the staged root (a new subvolume), before
        // anything is written there.
        let pre = self
            .rt
            .limit_disk(&staged, &rec.limits)
            .and_then(|()| install_init(&staged))
            .map_err(sandbox_err(sandbox))
            .and_then(|()| self.check_room(sandbox, "restore"));
        if let Err(e) = pre {
            if let Err(d) = self.fs.delete(&staged) {
                tracing::warn!(path = %staged.display(), error = %d, "cannot discard the staged root");
            }
            return Err(e);
        }
        stages.mark("prepare");
        progress.stage("filesystem", None);
        // Point of no return for the processes: stop what runs, swap the roots. The replaced
        // root is kept until the new processes run, so a failure can put the files back.
        let stopped = self.rt.stop(sandbox).map_err(sandbox_err(sandbox));
        stages.mark("stop");
        let swapped = stopped
            .and_then(|()| {
                std::fs::rename(&rootfs, &old)
                    .map_err(|e| CheckpointError::io("rename", &rootfs, e))
            })
            .and_then(|()| {
                std::fs::rename(&staged, &rootfs)
                    .map_err(|e| CheckpointError::io("rename", &staged, e))
            });
        stages.mark("swap");
        let fs_ms = ms(t_fs.elapsed());
        progress.stage("processes", None);
        let t_p = Instant::now();
        let started_procs = swapped
            .and_then(|()| self.restore_procs(sandbox, &m, criu.as_ref(), &store, &rootfs, &rec));
        let (pid, restored) = match started_procs {
            Ok(v) => v,
            Err(e) => return Err(self.roll_back_restore(sandbox, &m, &mut rec, e)),
        };
        stages.mark("criu");
        rec.init_pid = pid;
        rec.init_start = process_start_time(pid).unwrap_or(0);
        // Not fsynced: a restore changes only the init's pid and start time (and a `nat`
        // sandbox's host end), which a host crash makes stale whichever record survives —
        // the sandbox is dead after it either way. Atomic for readers and daemon restarts.
        if let Err(e) = self.rt.update_lazy(rec.clone()).map_err(sandbox_err(sandbox)) {
            return Err(self.roll_back_restore(sandbox, &m, &mut rec, e));
        }
        stages.mark("record");
        // The live sandbox is now point m: say so with a new newest point referencing m's
        // parts, so that the next checkpoint builds on m and a crash-restore of "the newest"
        // does not resurrect the abandoned future.
        let mut marker = Draft::new(PointKind::Restore, m.turn);
        marker.base = Some(m.id);
        marker.conversation_offset = m.conversation_offset;
        marker.no_procs = m.procs.is_none();
        marker.sandbox_meta = m.sandbox_meta.clone();
        let marker = store.begin().publish(marker)?;
        stages.mark("marker");
        // The replaced root goes after the answer: deleting a subvolume is a btrfs
        // transaction the caller need not wait for. Under the sandbox's lock, so the next
        // operation on it (which may make a new `rootfs.old`) waits for it.
        self.delete_later(sandbox, old);
        let report = RestoreReport {
            sandbox: sandbox.to_owned(),
            point: m.id.to_string(),
            marker: marker.id.to_string(),
            init_pid: pid,
            processes_restored: restored,
            verify_ms,
            fs_ms,
            procs_ms: ms(t_p.elapsed()),
            total_ms: ms(started.elapsed()),
            stages: stages.into_stages().into_iter().map(|(name, ms)| Stage { name, ms }).collect(),
        };
        tracing::info!(
            sandbox,
            point = %m.id,
            ms = report.total_ms,
            stages = %report
                .stages
                .iter()
                .map(|s| format!("{} {:.1}", s.name, s.ms))
                .collect::<Vec<_>>()
                .join(", "),
            "sandbox restored"
        );
        Ok(report)
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

    /// The processes of a restore whose root is in place: CRIU's images of `m`, or a fresh
    /// init when `m` has none. Returns the init's pid and whether processes were restored.
    fn restore_procs(
        &self,
        sandbox: &str,
        m: &Manifest,
        criu: Option<&Criu>,
        store: &Store,
        rootfs: &Path,
        rec: &SandboxRecord,
    ) -> Result<(u32, bool)> {
        let cg = self.rt.cgroup(sandbox);
        let (pid, restored) = match (&m.procs, criu) {
            (Some(p), Some(criu)) => {
                cg.create_for(&rec.limits, &rec.profile).map_err(cg_err(sandbox))?;
                // criu swrk joins this cgroup: frozen, it would hang there.
                ensure_thawed(&cg, sandbox)?;
                let log = self.log_dir(sandbox)?.join(format!("{}-restore-{}.log", p.id, now_ms()));
                let paths = cgroup_paths(&cg);
                let cgroups = std::iter::once(paths.v2).chain(paths.v1).collect();
                let mut opts = self.restore_opts(
                    &store.proc_dir(p.id),
                    log,
                    rootfs,
                    cgroups,
                    &rec.profile,
                    rec.net,
                );
                opts.external.extend(self.masked_external(sandbox, &rec.profile)?);
                let fresh_net = fresh_netns(rec.net, &rec.profile);
                if rec.net == NetMode::Nat {
                    // CRIU recreates eth0's veth pair with a new host end; wired below.
                    opts.external.push(
                        self.rt
                            .nat()
                            .prepare_restore(sandbox, None)
                            .map_err(sandbox_err(sandbox))?,
                    );
                }
                // Exec sessions' pipes to the daemon come back as new pipes it holds (the
                // client re-attaches): without them a restored shell would read end-of-file
                // and its children write into pipes nobody reads.
                let wiring = self.rt.sessions().prepare_restore(sandbox).unwrap_or_else(|e| {
                    tracing::warn!(sandbox, error = %e, "exec sessions not re-wired");
                    Default::default()
                });
                for (key, fd) in &wiring.inherit {
                    opts.inherit_fd.push(crab_criu::InheritFd {
                        key: key.clone(),
                        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
                    });
                }
                let hostname = rec.hostname.clone();
                let r = criu.restore_with(&opts, |n| {
                    set_up_fresh_netns(&n, fresh_net)?;
                    // A branch restored to its origin point carries its source's UTS name.
                    if n.phase == phase::POST_RESTORE {
                        if let Some(pid) = n.pid {
                            set_hostname_of(pid, &hostname)?;
                        }
                    }
                    Ok(())
                })?;
                let pid = u32::try_from(r.pid).unwrap_or(0);
                if !wiring.inherit.is_empty() {
                    let pids = cg.pids().unwrap_or_default();
                    let n = self.rt.sessions().finish_restore(sandbox, wiring, &pids);
                    tracing::debug!(sandbox, sessions = n, "exec sessions re-wired");
                }
                if rec.net == NetMode::Nat {
                    self.rt.nat().finish_restore(sandbox, pid).map_err(sandbox_err(sandbox))?;
                }
                (pid, true)
            }
            _ => {
                let (pid, _) = self
                    .rt
                    .start_init(sandbox, rec.net, &rec.limits, rec.profile)
                    .map_err(sandbox_err(sandbox))?;
                (pid, false)
            }
        };
        if process_start_time(pid).is_none() {
            return Err(CheckpointError::Sandbox {
                sandbox: sandbox.to_owned(),
                message: format!("the restored init {pid} died right after the restore"),
            });
        }
        Ok((pid, restored))
    }

    /// A restore failed after the sandbox's processes were stopped: kill what the attempt
    /// left, put the previous root back, start a fresh init on it and record that. The error
    /// returned says what failed, what state the sandbox is in and what to run.
    fn roll_back_restore(
        &self,
        sandbox: &str,
        m: &Manifest,
        rec: &mut SandboxRecord,
        cause: CheckpointError,
    ) -> CheckpointError {
        tracing::warn!(sandbox, point = %m.id, error = %cause, "restore failed after stopping the sandbox; rolling back");
        let dir = self.rt.state().sandbox_dir(sandbox);
        let rootfs = self.rt.state().sandbox_rootfs(sandbox);
        let old = dir.join("rootfs.old");
        let staged = dir.join("rootfs.restoring");
        let put_back = (|| -> Result<(u32, u64)> {
            self.rt.stop(sandbox).map_err(sandbox_err(sandbox))?;
            if old.exists() {
                if rootfs.exists() {
                    self.fs
                        .delete(&rootfs)
                        .map_err(|e| CheckpointError::io("delete", &rootfs, e))?;
                }
                std::fs::rename(&old, &rootfs)
                    .map_err(|e| CheckpointError::io("rename", &old, e))?;
            }
            if staged.exists() {
                if let Err(e) = self.fs.delete(&staged) {
                    tracing::warn!(path = %staged.display(), error = %e, "cannot discard the staged root");
                }
            }
            ensure_thawed(&self.rt.cgroup(sandbox), sandbox)?;
            self.rt
                .start_init(sandbox, rec.net, &rec.limits, rec.profile)
                .map_err(sandbox_err(sandbox))
        })();
        let message = match put_back {
            Ok((pid, start)) => {
                rec.init_pid = pid;
                rec.init_start = start;
                match self.rt.update(rec.clone()) {
                    Ok(()) => format!(
                        "restore to point {} failed after the sandbox's processes were stopped: {cause}. \
                         The sandbox runs again on its files as they were before the restore, with a \
                         fresh init (the processes it had are gone); fix the cause and run \
                         `crab restore {sandbox} {}` again",
                        m.id, m.id
                    ),
                    Err(e) => format!(
                        "restore to point {} failed after the sandbox's processes were stopped: {cause}; \
                         its previous files are back and a fresh init {pid} runs, but its record could \
                         not be written ({e}): run `crab restore {sandbox} {}` again",
                        m.id, m.id
                    ),
                }
            }
            Err(e) => format!(
                "restore to point {} failed after the sandbox's processes were stopped: {cause}; \
                 putting it back also failed ({e}). It is stopped, its record kept: run \
                 `crab restore {sandbox} {}` to retry, or `crab sandbox rm --force {sandbox}`",
                m.id, m.id
            ),
        };
        tracing::error!(sandbox, "{message}");
        CheckpointError::Sandbox { sandbox: sandbox.to_owned(), message }
    }

    /// Create `count` new sandboxes from a restore point of `sandbox` (newest when `None`),
    /// restored in parallel. Branch names are `names` when given (one per branch), else
    /// `<sandbox>-<point>-<n>`. Reports its stages (`verify`, then `branches` advancing by one
    /// per branch up) to `progress`.
    pub fn fork(
        &self,
        sandbox: &str,
        point: Option<&str>,
        count: usize,
        names: Option<Vec<String>>,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        self.fork_files_or_all(sandbox, point, count, names, ForkOptions::default(), progress)
    }

    /// [`Checkpointer::fork`] with [`ForkOptions`]: with `fs_only`, the branches
    /// get the point's files and a fresh init, not its processes (an E2B filesystem snapshot).
    pub fn fork_files_or_all(
        &self,
        sandbox: &str,
        point: Option<&str>,
        count: usize,
        names: Option<Vec<String>>,
        opts: ForkOptions,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        let store = self.store(sandbox)?;
        self.fork_from(&store, point, count, names, opts, None, progress)
    }

    /// Fork from point `point` of `store`, a store of points materialized from a remote
    /// store ([`Checkpointer::remote_store`]). The branches' records are built from
    /// `template` — the network mode, limits, profile and image the restoring host grants —
    /// and never from the point's own `sandbox_meta`, which is not trusted. The caller has
    /// materialized the point (`crab_remote::local::materialize`), which verified its images
    /// and checked them against the default profile.
    #[allow(clippy::too_many_arguments)]
    pub fn fork_remote(
        &self,
        store: &Arc<Store>,
        point: &str,
        count: usize,
        names: Option<Vec<String>>,
        opts: ForkOptions,
        template: &SandboxRecord,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        self.fork_from(store, Some(point), count, names, opts, Some(template), progress)
    }

    #[allow(clippy::too_many_arguments)]
    fn fork_from(
        &self,
        store: &Arc<Store>,
        point: Option<&str>,
        count: usize,
        names: Option<Vec<String>>,
        opts: ForkOptions,
        template: Option<&SandboxRecord>,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        let sandbox = store.sandbox();
        if count == 0 || count > 256 {
            return Err(CheckpointError::Invalid("--count must be between 1 and 256".into()));
        }
        let mut m = store.resolve(point)?;
        if !opts.verified {
            progress.stage("verify", None);
            store.verify(&m)?;
        }
        if opts.fs_only {
            m.procs = None;
        }
        let fs = m.fs.clone().ok_or_else(|| {
            CheckpointError::Invalid(format!("restore point {} has no filesystem snapshot", m.id))
        })?;
        let mut src: SandboxRecord = match (template, self.rt.record(sandbox)) {
            (Some(t), _) => t.clone(),
            (None, Ok(r)) => r,
            (None, Err(_)) => serde_json::from_value(m.sandbox_meta.clone()).map_err(|e| {
                CheckpointError::corrupt(
                    &store.manifest_path(m.id),
                    format!("sandbox_meta is not a sandbox record: {e}"),
                )
            })?,
        };
        // A remote point's branches (those with a template): never `--privileged` nor host
        // networking. Its images were checked against the default profile
        // ([`crate::foreign::check`]) when it was materialized, as they were verified.
        if template.is_some() {
            if src.net == NetMode::Host {
                return Err(CheckpointError::Invalid(format!(
                    "point {} of {sandbox} is of a sandbox with host networking, which a remote \
                     point is never given",
                    m.id
                )));
            }
            src.profile.privileged = false;
        }
        let names = match names {
            Some(n) if n.len() == count => n,
            Some(n) => {
                return Err(CheckpointError::Invalid(format!(
                    "{} names given for {count} branches",
                    n.len()
                )))
            }
            // `<sandbox>-<point>-<i>`, skipping the i of branches an earlier fork of the
            // same point made (a second unnamed fork would otherwise collide with the first).
            None => {
                let mut out = Vec::with_capacity(count);
                let mut i = 0usize;
                while out.len() < count {
                    i += 1;
                    let suffix = format!("-{}-{i}", m.id);
                    let keep = crab_common::names::MAX_NAME_LEN.saturating_sub(suffix.len());
                    let n = format!("{}{suffix}", &sandbox[..sandbox.len().min(keep)]);
                    if self.rt.record(&n).is_err() {
                        out.push(n);
                    }
                }
                out
            }
        };
        for n in &names {
            crab_common::names::validate("sandbox", n)
                .map_err(|e| CheckpointError::Invalid(e.message))?;
        }
        let criu = if m.procs.is_some() { Some(self.criu()?) } else { None };
        self.check_room(sandbox, "fork")?;
        let origin = Origin { sandbox: sandbox.to_owned(), point: m.id };
        progress.stage("branches", Some(count as u64));
        let done = std::sync::atomic::AtomicU64::new(0);
        let results: Vec<Result<ForkBranch>> = std::thread::scope(|s| {
            let handles: Vec<_> = names
                .iter()
                .map(|name| {
                    let (store, m, fs, src, criu, origin, done) =
                        (&store, &m, &fs, &src, criu.as_ref(), &origin, &done);
                    s.spawn(move || {
                        let r = self.fork_one(store, m, fs, src, criu, origin, name);
                        if r.is_ok() {
                            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                            progress.advance(n);
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CheckpointError::Invalid("a fork branch panicked".into()))
                    })
                })
                .collect()
        });
        let mut out = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(b) => out.push(b),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            // All or nothing: remove the branches that did come up.
            for b in &out {
                if let Err(e) = self.rt.remove(&b.sandbox, true) {
                    tracing::warn!(sandbox = %b.sandbox, error = %e, "cannot remove fork branch");
                }
                if let Err(e) = self.remove_all(&b.sandbox) {
                    tracing::warn!(sandbox = %b.sandbox, error = %e, "cannot remove points of fork branch");
                }
            }
            return Err(e);
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn fork_one(
        &self,
        store: &Store,
        m: &Manifest,
        fs: &crate::manifest::FsPart,
        src: &SandboxRecord,
        criu: Option<&Criu>,
        origin: &Origin,
        name: &str,
    ) -> Result<ForkBranch> {
        let t = Instant::now();
        let state = self.rt.state();
        if self.rt.record(name).is_ok() {
            return Err(CheckpointError::Invalid(format!(
                "a sandbox named {name:?} already exists"
            )));
        }
        let lock = self.lock(name);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let branch = self.store(name)?;
        let held = branch.lock()?;
        if !branch.point_ids()?.is_empty() {
            return Err(CheckpointError::Invalid(format!(
                "restore points of an earlier sandbox named {name:?} exist in {}; remove them or pick another name",
                branch.dir().display()
            )));
        }
        // Claim the name with a directory that holds a record from its first moment, of a
        // sandbox not running yet: a runtime opened meanwhile on this state directory (another
        // process, a restarted daemon) adopts it, where a directory without a record would be
        // discarded as a half-created sandbox, deleting the root and killing the restore in
        // the branch's cgroup under our feet.
        let dir = state.sandbox_dir(name);
        let mut rec = SandboxRecord {
            format: src.format,
            name: name.to_owned(),
            image: src.image.clone(),
            created_at: now_ms() / 1000,
            init_pid: 0,
            init_start: 0,
            net: src.net,
            hostname: name.to_owned(),
            limits: src.limits.clone(),
            cgroup: Some(self.rt.new_cgroup_rel(name)),
            profile: src.profile,
            nat: None,
            held: None,
            // A branch checkpoints like its source, and carries its labels and environment;
            // it runs, with no deadline and no labelled points of its own.
            checkpoint_policy: src.checkpoint_policy,
            harness: src.harness.clone(),
            life: crab_common::life::Life::Running,
            deadline_ms: None,
            on_deadline: src.on_deadline,
            labels: src.labels.clone(),
            env: src.env.clone(),
            template: src.template.clone(),
            point_labels: Default::default(),
        };
        crab_sandbox::runtime::claim_dir(state, &rec).map_err(sandbox_err(name))?;
        let result = self.fork_into(store, &branch, m, fs, src, criu, &mut rec);
        match result {
            Ok((pid, stages)) => {
                tracing::info!(sandbox = name, from = %origin.sandbox, point = %origin.point, "fork branch up");
                Ok(ForkBranch {
                    sandbox: name.to_owned(),
                    init_pid: pid,
                    ms: ms(t.elapsed()),
                    stages,
                })
            }
            Err(e) => {
                tracing::warn!(sandbox = name, error = %e, "fork branch failed; removing it");
                self.rt.nat().release(name);
                let cg = self.rt.cgroup(name);
                if let Err(e) = cg.destroy() {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove cgroup of failed branch");
                }
                let rootfs = state.sandbox_rootfs(name);
                if let Err(e) = self.fs.delete(&rootfs) {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove root of failed branch");
                }
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove directory of failed branch");
                }
                // Its points go; its CRIU log stays, since the error names it.
                if let Err(e) = branch.remove_all() {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove points of failed branch");
                }
                drop(held);
                self.stores.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
                Err(e)
            }
        }
    }

    /// Give a fork branch its own first restore point, equal to the source point: a read-only
    /// snapshot of the branch's fresh (personalized, not yet running) root and hard links to
    /// the source's image files (immutable once published), whose hashes are carried over. The
    /// branch's points then never depend on the source's store.
    fn publish_origin(
        &self,
        branch: &Store,
        src_store: &Store,
        m: &Manifest,
        rootfs: &Path,
        meta: &SandboxRecord,
    ) -> Result<Manifest> {
        let mut staging = branch.begin();
        staging.snapshot_fs(rootfs)?;
        let mut draft =
            Draft::new(if m.procs.is_some() { PointKind::FULL } else { PointKind::FS }, m.turn);
        if let Some(p) = &m.procs {
            let dir = staging.proc_dir()?;
            let src_dir = src_store.proc_dir(p.id);
            for f in &p.files {
                let (from, to) = (src_dir.join(&f.name), dir.join(&f.name));
                std::fs::hard_link(&from, &to).map_err(|e| CheckpointError::io("link", &to, e))?;
            }
            draft.trusted_files = Some(p.files.clone());
            draft.root_pid = p.root_pid;
            draft.criu_version = p.criu_version.clone();
        } else {
            draft.no_procs = true;
        }
        draft.conversation_offset = m.conversation_offset;
        draft.origin = Some(Origin { sandbox: m.sandbox.clone(), point: m.id });
        draft.sandbox_meta = serde_json::to_value(meta).unwrap_or_default();
        staging.publish(draft)
    }

    /// Build branch `rec.name` (whose directory exists) from point `m` of `store`: its root,
    /// its first restore point, its cgroup, its processes; then record it as running. Returns
    /// its init's pid and the time of each of those stages, ms.
    #[allow(clippy::too_many_arguments)]
    fn fork_into(
        &self,
        store: &Store,
        branch: &Store,
        m: &Manifest,
        fs: &crate::manifest::FsPart,
        src: &SandboxRecord,
        criu: Option<&Criu>,
        rec: &mut SandboxRecord,
    ) -> Result<(u32, Vec<(String, f64)>)> {
        let name = rec.name.clone();
        let name = name.as_str();
        let state = self.rt.state();
        let rootfs = state.sandbox_rootfs(name);
        let mut clock = crab_common::stats::StageClock::starting(Instant::now());
        self.fs
            .snapshot(&store.fs_path(fs.id), &rootfs, false)
            .map_err(|e| CheckpointError::io("snapshot", &rootfs, e))?;
        clock.mark("snapshot");
        // A branch inherits its source's disk quota (its record carries `src.limits`).
        self.rt.limit_disk(&rootfs, &src.limits).map_err(sandbox_err(name))?;
        clock.mark("quota");
        personalize(&rootfs, name).map_err(sandbox_err(name))?;
        let mut meta = src.clone();
        meta.name = name.to_owned();
        meta.hostname = name.to_owned();
        meta.cgroup = rec.cgroup.clone();
        let first = self.publish_origin(branch, store, m, &rootfs, &meta)?;
        clock.mark("origin_point");
        let cg = self.rt.cgroup(name);
        cg.create_for(&src.limits, &src.profile).map_err(cg_err(name))?;
        clock.mark("cgroup");
        if src.net == NetMode::Nat {
            // The branch's own address, from its source's range.
            let range = src.nat.as_ref().map(|l| l.range.as_str());
            self.rt.nat().allocate(name, range).map_err(sandbox_err(name))?;
        }
        let pid = match (&first.procs, criu) {
            (Some(p), Some(criu)) => {
                let log =
                    self.log_dir(name)?.join(format!("fork-{}-{}-restore.log", m.sandbox, p.id));
                let paths = cgroup_paths(&cg);
                let cgroups = std::iter::once(paths.v2).chain(paths.v1).collect();
                // The branch's own hard links: a prune of the source cannot pull the image
                // away in the middle of the restore.
                let mut opts = self.restore_opts(
                    &branch.proc_dir(p.id),
                    log,
                    &rootfs,
                    cgroups,
                    &src.profile,
                    src.net,
                );
                opts.external.extend(self.masked_external(name, &src.profile)?);
                let fresh_net = fresh_netns(src.net, &src.profile);
                if src.net == NetMode::Nat {
                    opts.external.push(
                        self.rt.nat().prepare_restore(name, None).map_err(sandbox_err(name))?,
                    );
                }
                let r = criu.restore_with(&opts, |n| {
                    set_up_fresh_netns(&n, fresh_net)?;
                    if n.phase == phase::POST_RESTORE {
                        if let Some(pid) = n.pid {
                            set_hostname_of(pid, name)?;
                        }
                    }
                    Ok(())
                })?;
                let pid = u32::try_from(r.pid).unwrap_or(0);
                if src.net == NetMode::Nat {
                    self.rt.nat().finish_restore(name, pid).map_err(sandbox_err(name))?;
                }
                pid
            }
            _ => {
                self.rt
                    .start_init(name, src.net, &src.limits, src.profile)
                    .map_err(sandbox_err(name))?
                    .0
            }
        };
        clock.mark("processes");
        rec.init_start = process_start_time(pid).ok_or_else(|| CheckpointError::Sandbox {
            sandbox: name.to_owned(),
            message: format!("the restored init {pid} died right after the restore"),
        })?;
        rec.init_pid = pid;
        rec.created_at = now_ms() / 1000;
        self.rt.update(rec.clone()).map_err(sandbox_err(name))?;
        clock.mark("record");
        Ok((pid, clock.into_stages()))
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
