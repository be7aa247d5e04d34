//! The sandbox runtime: create, list, remove and adopt native sandboxes.
//!
//! A sandbox is a writable btrfs snapshot of an image, a cgroup, and a process tree rooted in
//! `crab-init` inside fresh namespaces (see [`crate::spawn`]). Its record (`sandbox.json`) is
//! written atomically next to its root subvolume, so a restarted daemon finds every sandbox and
//! adopts the ones whose init is still alive (same pid *and* same start time, so a recycled pid
//! is never mistaken for a sandbox). Creation is all-or-nothing: any failure removes the
//! cgroup, the subvolume and the directory it made.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crab_common::api::{
    ExecRequest, HarnessSpec, IdRange, ImageDefaults, Limits, NetMode, SandboxCreateRequest,
    SandboxInfo, SecurityProfile,
};
use crab_common::life::{Deadline, Life, OnDeadline, Status};
use crab_common::names;
use crab_common::paths::StateDir;
use crab_common::CheckpointPolicy;

use crate::btrfs;
use crate::cgroup::{Hierarchy, SandboxCgroup};
use crate::error::{Result, SandboxError};
use crate::inroot::InRoot;
use crate::net::{Nat, NatLease};
use crate::spawn::{CgroupPaths, ExecSpec, StartSpec, INIT_PATH};

/// The daemon's directory in every root (`/.crab`).
const INIT_DIR: &str = ".crab";
use crate::{image, pool, quota};

/// The static init binary, embedded at build time.
pub static INIT_BINARY: &[u8] = include_bytes!(env!("CRAB_INIT_BIN"));

/// Version of the `sandbox.json` format (2 added `checkpoint_policy`; format-1 records load with
/// the `auto` policy; 3 added `harness`, absent in older records: none; 4 added the host-owned
/// lifecycle — `life`, `deadline`, `labels`, `env`, `template`, `point_labels` — and retired
/// `held`: an older record's `held` loads as `life: retired`).
pub const RECORD_FORMAT: u32 = 5;

/// The persisted record of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// [`RECORD_FORMAT`].
    pub format: u32,
    /// Name.
    pub name: String,
    /// Image it was created from.
    pub image: String,
    /// Creation time (seconds since the epoch).
    pub created_at: u64,
    /// Host pid of its init.
    pub init_pid: u32,
    /// Start time of the init (clock ticks since boot, `/proc/<pid>/stat` field 22).
    pub init_start: u64,
    /// Network mode.
    pub net: NetMode,
    /// Hostname.
    pub hostname: String,
    /// Limits.
    pub limits: Limits,
    /// Security profile (absent in records of older daemons: the default profile).
    #[serde(default)]
    pub profile: SecurityProfile,
    /// Its cgroup, relative to each hierarchy's root (`crab-<instance>/<name>`). Absent in
    /// records written before per-daemon cgroups: those sandboxes live in `crab/<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// With `net: nat`: its address and the host end of its veth pair (see [`crate::net`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat: Option<NatLease>,
    /// Format ≤ 3 only: why a sandbox was kept only for its restore points. Loaded as
    /// `life: retired` ([`SandboxRecord::upgrade`]); never written.
    #[serde(default, skip_serializing)]
    pub held: Option<String>,
    /// What its turn boundaries checkpoint (format 2; absent in format-1 records: `auto`).
    #[serde(default)]
    pub checkpoint_policy: CheckpointPolicy,
    /// Its declared harness (format 3; absent: none).
    #[serde(default, skip_serializing_if = "HarnessSpec::is_empty")]
    pub harness: HarnessSpec,
    /// Its lifecycle state (format 4; older records: `running`, or `retired` when `held`).
    #[serde(default)]
    pub life: Life,
    /// When its deadline is, ms since the epoch (format 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// What its deadlines do (format 4; absent: kill).
    #[serde(default, skip_serializing_if = "is_kill")]
    pub on_deadline: OnDeadline,
    /// Labels (format 4; E2B's metadata).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Environment every command in it gets (format 4; a command's own wins).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// What it was made from as its creator named it (format 4; E2B's template id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Labelled restore points: point id → its labels (format 4; E2B's snapshots). A label
    /// names one point host-wide; labelled points outlive a kill (the sandbox is retired).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub point_labels: BTreeMap<String, Vec<String>>,
    /// Its image's config defaults (user, working directory, environment, entrypoint),
    /// copied at creation so they outlive the image (format 5; absent: none).
    #[serde(default, skip_serializing_if = "ImageDefaults::is_empty")]
    pub image_config: ImageDefaults,
}

/// Options of the runtime.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// State directory.
    pub state: StateDir,
    /// Size of a new pool image.
    pub pool_size: u64,
    /// The `crab` binary to re-execute for the namespace helpers.
    pub helper_exe: PathBuf,
}

/// The sandbox runtime of one daemon.
#[derive(Debug)]
pub struct Runtime {
    cfg: RuntimeConfig,
    hier: Hierarchy,
    quota: bool,
    /// Limits of sandboxes created without their own (`crab daemon --default-memory`,
    /// `--default-pids`, `--default-disk`): [`DEFAULT_LIMITS`] unless the daemon says otherwise.
    default_limits: Mutex<Limits>,
    nat: Nat,
    /// The namespace helper, run from a sealed in-memory copy of `cfg.helper_exe`
    /// (`crate::sealed`: nothing a sandbox can reach runs from a writable host file).
    helper: crate::sealed::SealedExe,
    /// Ready-made root filesystems of recently used images (`crab daemon --warm-roots`).
    warm: Arc<crate::warm::WarmRoots>,
    sandboxes: Mutex<HashMap<String, SandboxRecord>>,
    /// Names being created right now (reserved against clashes).
    creating: Mutex<Vec<String>>,
    /// Open exec sessions (streamed stdin).
    sessions: crate::exec::Sessions,
    /// Serializes [`Runtime::edit`]s (read, change, write of one record never interleave).
    edit_lock: Mutex<()>,
    /// The user-namespace range of new sandboxes (`crab daemon --userns-base`); `None`: the
    /// host's (`crab daemon --userns host`).
    userns: Mutex<Option<IdRange>>,
}

use crab_common::clock::now_s as now;

/// Start time of `pid` in clock ticks since boot, if it exists.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

/// The kernel's `PF_EXITING` task flag (`include/linux/sched.h`): the task is in `do_exit`.
const PF_EXITING: u64 = 0x4;

/// Whether process `pid` with start time `start` exists and has not exited: a dead init stays
/// a zombie until whoever it was re-parented to reaps it, and a zombie sandbox is dead (its
/// namespaces are gone), so the record says so at once rather than a second later. An init
/// that is exiting (`PF_EXITING`: a pid namespace's init waits in `do_exit` for the kernel to
/// kill and reap every other process of its namespace) is dead too: a command killed by that
/// ends before the init is a zombie, and its end must already see the sandbox dead.
pub fn init_alive(pid: u32, start: u64) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let Some(close) = stat.rfind(')') else { return false };
    // Fields from the 3rd (state) on: flags is the 9th, starttime the 22nd.
    let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
    let field = |n: usize| fields.get(n - 3).and_then(|s| s.parse::<u64>().ok());
    if matches!(fields.first().copied(), Some("Z" | "X" | "x") | None) {
        return false;
    }
    if field(9).is_some_and(|flags| flags & PF_EXITING != 0) {
        return false;
    }
    field(22) == Some(start)
}

/// Write `bytes` to `path` atomically and durably ([`crab_common::fsutil::write_atomic`]; a
/// failed directory fsync is an error).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    crab_common::fsutil::write_atomic(path, bytes)
        .map_err(|e| SandboxError::io(e.op, e.path)(e.source))
}

/// Write `bytes` to `path` atomically, not durably ([`crab_common::fsutil::write_replace`]).
fn write_replace(path: &Path, bytes: &[u8]) -> Result<()> {
    crab_common::fsutil::write_replace(path, bytes)
        .map_err(|e| SandboxError::io(e.op, e.path)(e.source))
}

fn is_kill(o: &OnDeadline) -> bool {
    *o == OnDeadline::Kill
}

impl SandboxRecord {
    /// Its deadline as callers see it.
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline_ms.map(|at_ms| Deadline { at_ms, on: self.on_deadline })
    }

    /// Bring a record read from disk to this format in memory: a format ≤ 3 record's `held`
    /// becomes `life: retired` (written back in format 4 by the next save).
    pub fn upgrade(&mut self) {
        if let Some(why) = self.held.take() {
            if self.life == Life::Running {
                self.life = Life::Retired { why };
            }
        }
    }

    /// Its labels, as [`crate::runtime::Runtime::find_label`] compares them: every label of
    /// every labelled point.
    pub fn labels_of_points(&self) -> impl Iterator<Item = (&str, &str)> {
        self.point_labels
            .iter()
            .flat_map(|(p, ls)| ls.iter().map(move |l| (l.as_str(), p.as_str())))
    }

    /// Its cgroup relative to a hierarchy root (`crab/<name>` for records that predate
    /// per-daemon cgroups).
    pub fn cgroup_rel(&self) -> String {
        self.cgroup.clone().unwrap_or_else(|| format!("crab/{}", self.name))
    }
}

impl Runtime {
    /// Open the runtime: check the host, mount the pool, load and adopt existing sandboxes.
    pub fn open(cfg: RuntimeConfig) -> Result<Self> {
        pool::ensure(&cfg.state, cfg.pool_size)?;
        let hier = Hierarchy::detect().map_err(|e| SandboxError::Host {
            what: e.to_string(),
            hint: "mount cgroup2 (e.g. `mount -t cgroup2 none /sys/fs/cgroup/unified`)".into(),
        })?;
        let quota = quota::enable(&cfg.state.pool());
        let nat = Nat::new(&cfg.state.instance());
        let warm = crate::warm::WarmRoots::new(&cfg.state);
        let helper = crate::sealed::SealedExe::copy(&cfg.helper_exe)?;
        let rt = Runtime {
            cfg,
            hier,
            helper,
            quota,
            default_limits: Mutex::new(Limits::default()),
            nat,
            warm,
            sandboxes: Mutex::new(HashMap::new()),
            creating: Mutex::new(Vec::new()),
            sessions: crate::exec::Sessions::default(),
            edit_lock: Mutex::new(()),
            userns: Mutex::new(None),
        };
        rt.set_userns(Some(IdRange::at(IdRange::DEFAULT_BASE).map_err(SandboxError::Invalid)?))?;
        rt.load()?;
        rt.adopt_nat();
        Ok(rt)
    }

    /// Ensure (when `enable`) that cgroup2 has `favordynmods` — see
    /// [`Hierarchy::favordynmods`] — and say whether it is on, and why (not).
    pub fn tune_cgroup_migrations(&self, enable: bool) -> (bool, String) {
        self.hier.favordynmods(enable)
    }

    /// Run new sandboxes in a user namespace mapping `0..65536` to `ids` (`None`: in the
    /// host's, uid 0 inside being the host's root). The state directory stays closed to
    /// others but lets the range's root group through (mode `0710`, group `ids.gid`; Docker's
    /// userns-remap does the same): a sandbox's init, and CRIU restoring one, reach the
    /// sandbox's root subvolume by its host path as that group.
    pub fn set_userns(&self, ids: Option<IdRange>) -> Result<()> {
        if let Some(ids) = ids {
            let root = self.cfg.state.root();
            std::os::unix::fs::chown(root, None, Some(ids.gid))
                .map_err(SandboxError::io("chown", root))?;
            fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o710))
                .map_err(SandboxError::io("chmod", root))?;
        }
        *crab_common::sync::lock(&self.userns) = ids;
        Ok(())
    }

    /// The user-namespace range of new sandboxes.
    pub fn userns(&self) -> Option<IdRange> {
        *crab_common::sync::lock(&self.userns)
    }

    /// The root subvolume sandboxes of `image` under `profile` are snapshots of: the image
    /// itself, or its copy shifted into the profile's user-namespace range ([`crate::shift`]),
    /// made now when there is none yet.
    pub fn image_root_for(&self, image: &str, profile: &SecurityProfile) -> Result<PathBuf> {
        let root = image::rootfs_of(&self.cfg.state, image)?;
        match profile.userns {
            Some(ids) => crate::shift::rootfs_for(&self.cfg.state, image, &root, ids),
            None => Ok(root),
        }
    }

    /// Make image `name`'s copy for new sandboxes now (its shift into the user-namespace
    /// range, [`crate::shift`]), so the first create after a build or import does not pay
    /// for it. A failure is only logged: that create makes the copy, or says why.
    pub fn prepare_image(&self, name: &str, progress: &dyn crab_common::Progress) {
        let Some(ids) = self.userns() else { return };
        progress.message(&format!("shifting image {name} into the user-namespace range {ids}"));
        let profile = SecurityProfile { privileged: false, userns: Some(ids) };
        if let Err(e) = self.image_root_for(name, &profile) {
            tracing::warn!(image = name, error = %e, "cannot shift the image into the user-namespace range");
        }
    }

    /// Keep `n` ready-made root filesystems per recently used image, so creates need no
    /// snapshot of their own (0, the default, turns it off).
    pub fn set_warm_roots(&self, n: usize) {
        self.warm.set_target(n);
    }

    /// Delete the ready roots of image `name` (it is being rebuilt, re-imported or removed).
    pub fn forget_image(&self, name: &str) {
        self.warm.forget(name);
    }

    /// The state directory.
    pub fn state(&self) -> &StateDir {
        &self.cfg.state
    }

    /// The `nat` network state of this daemon (leases, host interfaces, its nftables table).
    pub fn nat(&self) -> &Nat {
        &self.nat
    }

    /// The limits of sandboxes created without their own (a `None` field: unlimited). A disk
    /// default on a host without quotas is refused, unless it is [`DEFAULT_LIMITS`]' own (then
    /// sandboxes get no disk limit, and the daemon's log says why).
    pub fn set_default_limits(&self, limits: &Limits) -> Result<()> {
        validate_limits(limits)?;
        let mut limits = limits.clone();
        if limits.disk_bytes.is_some() && !self.quota {
            if limits.disk_bytes != DEFAULT_LIMITS.disk_bytes {
                return Err(quota_unavailable());
            }
            tracing::warn!("the pool has no quotas: sandboxes get no default disk limit");
            limits.disk_bytes = None;
        }
        *crab_common::sync::lock(&self.default_limits) = limits;
        Ok(())
    }

    /// The limits of sandboxes created without their own.
    pub fn default_limits(&self) -> Limits {
        crab_common::sync::lock(&self.default_limits).clone()
    }

    /// Put `limits.disk_bytes` on the root subvolume `rootfs` (a new sandbox's, or the root a
    /// restore or fork is about to give it), so the quota follows the sandbox to every root.
    pub fn limit_disk(&self, rootfs: &Path, limits: &Limits) -> Result<()> {
        let Some(b) = limits.disk_bytes else { return Ok(()) };
        if !self.quota {
            return Err(quota_unavailable());
        }
        quota::set_limit(rootfs, Some(b))
            .map_err(SandboxError::io("setting the disk quota (BTRFS_IOC_QGROUP_LIMIT) of", rootfs))
    }

    /// Reconcile `nat` networking with the adopted records: leases of live sandboxes are
    /// kept, host interfaces of dead ones and strays are deleted, the table is rebuilt (and
    /// deleted when no `nat` sandbox is left). Failures are logged: they do not stop a daemon
    /// whose other sandboxes are fine.
    fn adopt_nat(&self) {
        let leases: Vec<(String, NatLease, bool)> = self
            .lock()
            .values()
            .filter(|r| r.net == NetMode::Nat)
            .filter_map(|r| r.nat.clone().map(|l| (r.name.clone(), l, self.is_alive(r))))
            .collect();
        let prefix = self.nat.if_prefix();
        let strays = net_links().iter().any(|l| l.starts_with(&prefix));
        if leases.is_empty() && !strays && !nft_table_exists(self.nat.table()) {
            return;
        }
        if let Err(e) = self.nat.adopt(leases) {
            tracing::error!(error = %e, "cannot reconcile nat networking");
        }
    }

    /// When this daemon has no sandboxes left, remove its instance's parent cgroup
    /// (`crab-<instance>`) from every hierarchy, so a stopped daemon leaves no empty groups
    /// behind. Called on shutdown; a sandbox created meanwhile recreates it.
    pub fn release_cgroup_parent(&self) {
        if !self.lock().is_empty() {
            return;
        }
        let n = self.hier.remove_if_empty(&self.cfg.state.cgroup_parent());
        tracing::debug!(removed = n, "released the instance's parent cgroup");
    }

    /// The host's cgroup hierarchy.
    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hier
    }

    fn load(&self) -> Result<()> {
        let dir = self.cfg.state.sandboxes();
        let entries = fs::read_dir(&dir).map_err(SandboxError::io("list", &dir))?;
        let mut map = self.lock();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let rec_path = self.cfg.state.sandbox_record(&name);
            match fs::read(&rec_path).map(|b| serde_json::from_slice::<SandboxRecord>(&b)) {
                Ok(Ok(mut rec)) => {
                    rec.upgrade();
                    let alive = self.is_alive(&rec);
                    tracing::info!(sandbox = %name, pid = rec.init_pid, alive, "adopted sandbox");
                    map.insert(name, rec);
                }
                Ok(Err(e)) => {
                    tracing::warn!(path = %rec_path.display(), error = %e, "unreadable sandbox record; ignored")
                }
                Err(_) => {
                    // A directory without a record is a create that never finished: discard.
                    tracing::warn!(sandbox = %name, "discarding half-created sandbox");
                    self.discard(&name);
                }
            }
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, SandboxRecord>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_alive(&self, rec: &SandboxRecord) -> bool {
        init_alive(rec.init_pid, rec.init_start)
    }

    /// The cgroup path (relative to a hierarchy root) of sandbox `name`: the one its record
    /// names, else this daemon's `crab-<instance>/<name>`.
    pub fn cgroup_rel(&self, name: &str) -> String {
        match self.lock().get(name) {
            Some(rec) => rec.cgroup_rel(),
            None => self.new_cgroup_rel(name),
        }
    }

    /// Where this daemon puts the cgroup of a new sandbox `name`.
    pub fn new_cgroup_rel(&self, name: &str) -> String {
        format!("{}/{name}", self.cfg.state.cgroup_parent())
    }

    /// The cgroup of sandbox `name`.
    pub fn cgroup(&self, name: &str) -> SandboxCgroup {
        self.hier.sandbox(&self.cgroup_rel(name))
    }

    /// The record of sandbox `name`.
    pub fn record(&self, name: &str) -> Result<SandboxRecord> {
        self.lock().get(name).cloned().ok_or_else(|| SandboxError::NoSandbox(name.to_string()))
    }

    /// Names of all sandboxes.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.lock().keys().cloned().collect();
        v.sort();
        v
    }

    fn info(&self, rec: &SandboxRecord) -> SandboxInfo {
        let cg = self.cgroup(&rec.name);
        let alive = self.is_alive(rec);
        let processes = if alive { cg.pids().map(|p| p.len() as u32).unwrap_or(0) } else { 0 };
        let memory_bytes = if alive { cg.memory_bytes() } else { None };
        let bytes_written = if self.quota {
            quota::exclusive_bytes(&self.cfg.state.sandbox_rootfs(&rec.name))
        } else {
            None
        };
        SandboxInfo {
            name: rec.name.clone(),
            image: rec.image.clone(),
            state: Status { life: &rec.life, alive }.state(),
            created_at: rec.created_at,
            init_pid: rec.init_pid,
            processes,
            memory_bytes,
            bytes_written,
            disk_limit_bytes: rec.limits.disk_bytes,
            limits: rec.limits.clone(),
            net: rec.net,
            hostname: rec.hostname.clone(),
            cgroup_id: cg.id().unwrap_or(0),
            address: self.nat.lease(&rec.name).map(|l| l.addr.to_string()),
            profile: Some(crate::profile::report(&rec.profile)),
            held: match &rec.life {
                Life::Retired { why } => Some(why.clone()),
                _ => None,
            },
            checkpoint_policy: rec.checkpoint_policy,
            harness: rec.harness.clone(),
            pause_point: match &rec.life {
                Life::Paused { point } => Some(point.clone()),
                _ => None,
            },
            deadline: rec.deadline(),
            labels: rec.labels.clone(),
            env: rec.env.clone(),
            template: rec.template.clone(),
            point_labels: rec.point_labels.clone(),
        }
    }

    /// Sandbox `name`'s recorded life and whether its init is alive — one record and one
    /// `/proc` stat, whatever the number of sandboxes (no cgroup or quota reads).
    pub fn status(&self, name: &str) -> Result<(Life, bool)> {
        let rec = self.record(name)?;
        let alive = self.is_alive(&rec);
        Ok((rec.life, alive))
    }

    /// Change sandbox `name`'s record with `f` and persist it (durably) when `f` changed it.
    /// The host's lifecycle actions write `life`, `deadline`, labels and env through here.
    pub fn edit(&self, name: &str, f: impl FnOnce(&mut SandboxRecord)) -> Result<SandboxRecord> {
        let _one = self.edit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.record(name)?;
        let before = rec.clone();
        f(&mut rec);
        if rec != before {
            rec.format = RECORD_FORMAT;
            self.update(rec.clone())?;
        }
        Ok(rec)
    }

    /// The running sandboxes whose deadline is at or before `now_ms` (the watchdog's look:
    /// in-memory records only).
    pub fn due(&self, now_ms: u64) -> Vec<(String, Deadline)> {
        self.lock()
            .values()
            .filter(|r| r.life == Life::Running)
            .filter_map(|r| r.deadline().filter(|d| d.at_ms <= now_ms).map(|d| (r.name.clone(), d)))
            .collect()
    }

    /// Record a new init of sandbox `name` (a restore's), changing nothing else of the record
    /// as it is now: a label, deadline or life another door wrote while the restore ran stays.
    /// `lazy`: not fsynced (what a host crash makes stale anyway, see [`Runtime::update_lazy`]).
    pub fn set_init(&self, name: &str, pid: u32, start: u64, lazy: bool) -> Result<()> {
        let _one = self.edit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.record(name)?;
        rec.init_pid = pid;
        rec.init_start = start;
        if lazy {
            self.update_lazy(rec)
        } else {
            self.update(rec)
        }
    }

    /// Every record (for the host's watchdog and label lookups; no `/proc` or cgroup reads).
    pub fn records(&self) -> Vec<SandboxRecord> {
        self.lock().values().cloned().collect()
    }

    /// Describe sandbox `name`.
    pub fn get(&self, name: &str) -> Result<SandboxInfo> {
        let rec = self.record(name)?;
        Ok(self.info(&rec))
    }

    /// Describe every sandbox.
    pub fn list(&self) -> Vec<SandboxInfo> {
        let recs: Vec<SandboxRecord> = self.lock().values().cloned().collect();
        let mut out: Vec<SandboxInfo> = recs.iter().map(|r| self.info(r)).collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    fn reserve(&self, name: &str) -> Result<()> {
        let mut creating = self.creating.lock().unwrap_or_else(|p| p.into_inner());
        if self.lock().contains_key(name)
            || creating.iter().any(|n| n == name)
            || self.cfg.state.sandbox_dir(name).exists()
        {
            return Err(SandboxError::NameTaken { kind: "sandbox", name: name.to_string() });
        }
        creating.push(name.to_string());
        Ok(())
    }

    fn unreserve(&self, name: &str) {
        self.creating.lock().unwrap_or_else(|p| p.into_inner()).retain(|n| n != name);
    }

    fn generate_name(&self) -> String {
        loop {
            let n = format!("sb-{:06x}", rand_u32() & 0xff_ffff);
            if !self.lock().contains_key(&n) && !self.cfg.state.sandbox_dir(&n).exists() {
                return n;
            }
        }
    }

    /// Create and start a sandbox.
    pub fn create(&self, req: &SandboxCreateRequest) -> Result<SandboxInfo> {
        self.create_at(req, None)
    }

    /// Create and start a sandbox whose root is a snapshot of `root` (a read-only subvolume
    /// already in the id space of the sandbox's profile: the image builder's step trees)
    /// instead of its image's; `req.image` is only recorded.
    pub fn create_on(&self, req: &SandboxCreateRequest, root: &Path) -> Result<SandboxInfo> {
        self.create_at(req, Some(root))
    }

    fn create_at(&self, req: &SandboxCreateRequest, root: Option<&Path>) -> Result<SandboxInfo> {
        let name = match &req.name {
            Some(n) => {
                names::validate("sandbox", n).map_err(|e| SandboxError::Invalid(e.message))?;
                n.clone()
            }
            None => self.generate_name(),
        };
        let policy = crab_common::api::parse_checkpoint_policy(req.checkpoint_policy.as_deref())
            .map_err(|e| SandboxError::Invalid(format!("{}; {}", e.message, e.hint)))?
            .unwrap_or_default();
        validate_limits(&req.limits)?;
        let invalid =
            |e: crab_common::ApiError| SandboxError::Invalid(format!("{}; {}", e.message, e.hint));
        crab_common::life::check_meta(&req.labels, &req.env).map_err(invalid)?;
        let deadline = crab_common::api::timeout_of(
            req.timeout_s,
            req.on_timeout.as_deref(),
            crab_common::clock::now_ms(),
        )
        .map_err(invalid)?;
        let limits = with_defaults(&req.limits, &self.default_limits());
        if limits.disk_bytes.is_some() && !self.quota {
            return Err(quota_unavailable());
        }
        if req.nat_range.is_some() && req.net != NetMode::Nat {
            return Err(SandboxError::Invalid(
                "nat_range applies to the nat network mode only; add --network nat or drop --nat-range"
                    .into(),
            ));
        }
        if let Some(r) = &req.nat_range {
            crate::net::parse_range(r)?;
        }
        let userns = match req.userns.as_deref() {
            Some("host") => None,
            // --privileged keeps every host power, the host's ids with them.
            None | Some("private") if req.privileged => None,
            None | Some("private") => self.userns(),
            Some(other) => {
                return Err(SandboxError::Invalid(format!(
                    "unknown user-namespace mode {other:?}; use `private` (the default: root inside is an unprivileged host uid) or `host`"
                )))
            }
        };
        let profile = SecurityProfile { privileged: req.privileged, userns };
        let image_root = match root {
            Some(r) => r.to_path_buf(),
            None => self.image_root_for(&req.image, &profile)?,
        };
        self.reserve(&name)?;
        let result = match req.net {
            NetMode::Nat => self.nat.allocate(&name, req.nat_range.as_deref()).map(drop),
            _ => Ok(()),
        }
        .and_then(|()| {
            self.create_reserved(
                &name,
                &req.image,
                &image_root,
                req.net,
                &limits,
                profile,
                policy,
                &req.harness,
                root.is_none(),
            )
        })
        .and_then(|mut rec| {
            rec.deadline_ms = deadline.map(|d| d.at_ms);
            rec.on_deadline = deadline.map(|d| d.on).unwrap_or_default();
            rec.labels = req.labels.clone();
            rec.env = req.env.clone();
            rec.template = req.template.clone();
            if rec.deadline_ms.is_some()
                || !rec.labels.is_empty()
                || !rec.env.is_empty()
                || rec.template.is_some()
            {
                self.save_lazy(&rec)?;
            }
            Ok(rec)
        });
        if result.is_err() {
            self.discard(&name);
        }
        self.unreserve(&name);
        let rec = result?;
        let info = self.info(&rec);
        self.lock().insert(name, rec);
        Ok(info)
    }

    #[allow(clippy::too_many_arguments)] // create's own step, with what create parsed
    fn create_reserved(
        &self,
        name: &str,
        image: &str,
        image_root: &Path,
        net: NetMode,
        limits: &Limits,
        profile: SecurityProfile,
        checkpoint_policy: CheckpointPolicy,
        harness: &HarnessSpec,
        warm: bool,
    ) -> Result<SandboxRecord> {
        let mut rec = SandboxRecord {
            format: RECORD_FORMAT,
            name: name.to_string(),
            image: image.to_string(),
            created_at: now(),
            init_pid: 0,
            init_start: 0,
            net,
            hostname: name.to_string(),
            limits: limits.clone(),
            profile,
            cgroup: Some(self.new_cgroup_rel(name)),
            nat: None,
            held: None,
            checkpoint_policy,
            harness: harness.clone(),
            life: Life::Running,
            deadline_ms: None,
            on_deadline: OnDeadline::Kill,
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            template: None,
            point_labels: BTreeMap::new(),
            image_config: crate::image::defaults_of(&self.cfg.state, image),
        };
        // The directory appears with a (not yet running) record, so another process opening
        // this state directory sees a dead sandbox rather than a leftover to discard.
        claim_dir(&self.cfg.state, &rec)?;
        let rootfs = self.cfg.state.sandbox_rootfs(name);
        if !(warm && self.warm.take(image, image_root, &rootfs)) {
            btrfs::snapshot(image_root, &rootfs, false)?;
        }
        self.limit_disk(&rootfs, limits)?;
        personalize(&rootfs, name, profile.userns)?;
        let (init_pid, init_start) = self.start_init(name, net, limits, profile)?;
        rec.init_pid = init_pid;
        rec.init_start = init_start;
        // Not fsynced (five fsyncs were most of a create on a busy disk): see `save_lazy`.
        self.save_lazy(&rec)?;
        tracing::info!(sandbox = name, pid = init_pid, "sandbox created");
        Ok(rec)
    }

    /// `rec` with its current `nat` lease (the runtime's, which every new incarnation
    /// updates: callers' copies of a record may predate it).
    fn with_lease(&self, rec: &SandboxRecord) -> SandboxRecord {
        let mut rec = rec.clone();
        if rec.net == NetMode::Nat {
            rec.nat = self.nat.lease(&rec.name).or(rec.nat);
        }
        rec
    }

    /// Persist a record.
    pub fn save(&self, rec: &SandboxRecord) -> Result<()> {
        let rec = self.with_lease(rec);
        let bytes =
            serde_json::to_vec_pretty(&rec).map_err(|e| SandboxError::Other(e.to_string()))?;
        write_atomic(&self.cfg.state.sandbox_record(&rec.name), &bytes)
    }

    /// Persist a new sandbox's record atomically but without fsync. A daemon restart reads it
    /// back (page cache); only a host crash before the pool's next btrfs transaction commit
    /// (every snapshot commits one, so the sandbox's first checkpoint at the latest; else the
    /// commit interval, 30 s by default) can lose it — and with it a sandbox that has no restore point yet, whose processes the
    /// crash kills and whose files had not been synced either.
    fn save_lazy(&self, rec: &SandboxRecord) -> Result<()> {
        let rec = self.with_lease(rec);
        let bytes =
            serde_json::to_vec_pretty(&rec).map_err(|e| SandboxError::Other(e.to_string()))?;
        write_replace(&self.cfg.state.sandbox_record(&rec.name), &bytes)
    }

    /// Replace the in-memory and on-disk record (used after a restore re-creates the init).
    pub fn update(&self, rec: SandboxRecord) -> Result<()> {
        let rec = self.with_lease(&rec);
        self.save(&rec)?;
        self.lock().insert(rec.name.clone(), rec);
        Ok(())
    }

    /// [`Runtime::update`] without fsync ([`crab_common::fsutil::write_replace`]): for what a
    /// host crash makes stale anyway (a restored init's pid and start time).
    pub fn update_lazy(&self, rec: SandboxRecord) -> Result<()> {
        let rec = self.with_lease(&rec);
        self.save_lazy(&rec)?;
        self.lock().insert(rec.name.clone(), rec);
        Ok(())
    }

    /// Create the cgroup and start a fresh init on the sandbox's current root filesystem.
    /// Returns the init's host pid and start time.
    pub fn start_init(
        &self,
        name: &str,
        net: NetMode,
        limits: &Limits,
        profile: SecurityProfile,
    ) -> Result<(u32, u64)> {
        let cg = self.cgroup(name);
        cg.create_for(limits, &profile)?;
        let spec = StartSpec {
            rootfs: self.cfg.state.sandbox_rootfs(name),
            hostname: name.to_string(),
            net,
            cgroup: cgroup_paths(&cg),
            profile,
            seccomp: compiled_filters(&profile)?,
        };
        let spec_fd = crate::specfd::spec_memfd(&spec)?;
        let child = Command::new(self.helper_exe())
            .arg("__start-sandbox")
            .args(crate::specfd::inheritable(&spec_fd)?)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(SandboxError::io("run helper", &self.cfg.helper_exe));
        drop(spec_fd);
        let out = child?
            .wait_with_output()
            .map_err(SandboxError::io("wait for helper", &self.cfg.helper_exe))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(SandboxError::Other(format!(
                "starting the sandbox's init failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let pid: u32 = stdout.trim().parse().map_err(|_| {
            SandboxError::Other(format!("sandbox starter printed {stdout:?} instead of a pid"))
        })?;
        let start = process_start_time(pid).ok_or_else(|| {
            SandboxError::Other(format!("sandbox init {pid} died right after start"))
        })?;
        if net == NetMode::Nat {
            if self.nat.lease(name).is_none() {
                self.nat.allocate(name, None)?;
            }
            if let Err(e) = self.nat.attach(name, pid) {
                if let Err(k) = cg.kill_all() {
                    tracing::warn!(sandbox = name, error = %k, "cannot kill an init left without network");
                }
                return Err(e);
            }
        }
        Ok((pid, start))
    }

    /// Set sandbox `name`'s checkpoint policy (persisted; its next turn boundary uses it).
    pub fn set_checkpoint_policy(&self, name: &str, policy: CheckpointPolicy) -> Result<()> {
        let mut rec = self.record(name)?;
        if rec.checkpoint_policy == policy {
            return Ok(());
        }
        rec.checkpoint_policy = policy;
        rec.format = RECORD_FORMAT;
        self.update(rec)
    }

    /// Kill every process of sandbox `name` (its cgroup), leaving files and record alone.
    pub fn stop(&self, name: &str) -> Result<()> {
        self.cgroup(name).kill_all()?;
        Ok(())
    }

    /// Remove a sandbox. Without `force`, refuse when processes other than its init run.
    pub fn remove(&self, name: &str, force: bool) -> Result<()> {
        let rec = self.record(name)?;
        if !force && self.is_alive(&rec) {
            let n = self.cgroup(name).pids()?.len();
            if n > 1 {
                return Err(SandboxError::Conflict(format!(
                    "sandbox {name:?} has {} running processes besides its init; stop them or use --force",
                    n - 1
                )));
            }
        }
        self.cgroup(name).destroy()?;
        self.nat.release(name);
        self.lock().remove(name);
        self.discard(name);
        tracing::info!(sandbox = name, "sandbox removed");
        Ok(())
    }

    /// Best-effort removal of everything a sandbox owns on the host.
    fn discard(&self, name: &str) {
        self.nat.release(name);
        let cg = self.cgroup(name);
        if let Err(e) = cg.destroy() {
            tracing::warn!(sandbox = name, error = %e, "could not remove cgroup");
        }
        let rootfs = self.cfg.state.sandbox_rootfs(name);
        if let Err(e) = btrfs::remove_tree(&rootfs) {
            tracing::warn!(path = %rootfs.display(), error = %e, "could not delete subvolume");
        }
        let dir = self.cfg.state.sandbox_dir(name);
        if let Err(e) = fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %dir.display(), error = %e, "could not remove sandbox dir");
            }
        }
    }

    /// Build the exec helper's spec for a request.
    pub fn exec_spec(&self, name: &str, req: &ExecRequest) -> Result<ExecSpec> {
        let rec = self.record(name)?;
        Status { life: &rec.life, alive: self.is_alive(&rec) }
            .can_exec(name, "run a command in")
            .map_err(|e| SandboxError::Conflict(format!("{}; {}", e.message, e.hint)))?;
        if req.cmd.is_empty() {
            return Err(SandboxError::Invalid("exec needs a command".into()));
        }
        if let Some(t) = req.timeout_s {
            if !t.is_finite() || t <= 0.0 || t > MAX_EXEC_TIMEOUT_S {
                return Err(SandboxError::Invalid(format!(
                    "timeout_s is {t}; it must be a number of seconds in (0, {MAX_EXEC_TIMEOUT_S}] (leave it out for no timeout)"
                )));
            }
        }
        let ic = &rec.image_config;
        // The account: the call's, else the image's, else root.
        let user = req.user.clone().or_else(|| ic.user.clone()).filter(|u| !u.is_empty());
        let as_root = user.as_deref().is_none_or(|u| u == "root" || u == "0" || u == "0:0");
        let mut env: Vec<String> = vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            format!("HOSTNAME={}", rec.hostname),
        ];
        // Another account's HOME comes from its passwd entry (the helper adds it).
        if as_root {
            env.push("HOME=/root".into());
        }
        // The image's environment, the sandbox's own, then the command's (each wins over the
        // one before).
        let own = rec.env.iter().map(|(k, v)| format!("{k}={v}"));
        for kv in ic.env.iter().cloned().chain(own).chain(req.env.iter().cloned()) {
            let Some((k, _)) = kv.split_once('=') else {
                return Err(SandboxError::Invalid(format!(
                    "environment entry {kv:?} is not KEY=VALUE"
                )));
            };
            env.retain(|e| !e.starts_with(&format!("{k}=")));
            env.push(kv);
        }
        Ok(ExecSpec {
            init_pid: rec.init_pid,
            cgroup: cgroup_paths(&self.cgroup(name)),
            cmd: req.cmd.clone(),
            env,
            workdir: req
                .workdir
                .clone()
                .or_else(|| ic.workdir.clone())
                .unwrap_or_else(|| "/".into()),
            user: if as_root { None } else { user },
            stdin: req.stdin_b64.is_some() || req.stdin_session.is_some(),
            profile: rec.profile,
            seccomp: compiled_filters(&rec.profile)?,
        })
    }

    /// The open exec sessions (streamed stdin).
    pub fn sessions(&self) -> &crate::exec::Sessions {
        &self.sessions
    }

    /// The path to run the namespace helper by: its sealed in-memory copy
    /// (`/proc/self/fd/N`, valid in the daemon and its children).
    pub fn helper_exe(&self) -> &Path {
        self.helper.path()
    }

    /// The helper binary on disk that the sealed copy was made from.
    pub fn helper_source(&self) -> &Path {
        self.helper.source()
    }
}

/// The limits a sandbox gets unless it or the daemon says otherwise: a sandbox is hostile, and
/// without them one could start processes until the host's `pid_max`, take the host's memory,
/// or fill the pool every other sandbox checkpoints into. Raise them per sandbox (`crab
/// sandbox create --memory/--pids/--disk`) or for the daemon (`crab daemon --default-…`).
pub const DEFAULT_LIMITS: Limits = Limits {
    memory_bytes: Some(4 << 30),
    pids_max: Some(1024),
    cpu_millis: None,
    disk_bytes: Some(10 << 30),
};

/// `own` with every limit it does not set taken from `defaults`.
pub fn with_defaults(own: &Limits, defaults: &Limits) -> Limits {
    Limits {
        memory_bytes: own.memory_bytes.or(defaults.memory_bytes),
        pids_max: own.pids_max.or(defaults.pids_max),
        cpu_millis: own.cpu_millis.or(defaults.cpu_millis),
        disk_bytes: own.disk_bytes.or(defaults.disk_bytes),
    }
}

/// Smallest memory limit a sandbox can start with (its init and one command need a few MiB).
pub const MIN_MEMORY_BYTES: u64 = 8 << 20;
/// Smallest disk quota: a root's own metadata and a few files.
pub const MIN_DISK_BYTES: u64 = 64 << 20;
/// Smallest pids limit: the init and one command.
pub const MIN_PIDS: u64 = 2;
/// Smallest CPU quota (milli-CPUs; the kernel's minimum quota is 1 ms per 100 ms period).
pub const MIN_CPU_MILLIS: u64 = 10;
/// Largest CPU quota accepted (milli-CPUs): 1024 cores.
pub const MAX_CPU_MILLIS: u64 = 1_024_000;
/// Longest exec timeout accepted, in seconds (30 days).
pub const MAX_EXEC_TIMEOUT_S: f64 = 30.0 * 86400.0;

/// Refuse limits the kernel would refuse or that could not run a sandbox, naming the field and
/// the allowed range (an `invalid_request`, not an internal error after half a create).
pub fn validate_limits(l: &Limits) -> Result<()> {
    let bad = |field: &str, v: u64, range: String| {
        Err(SandboxError::Invalid(format!("limits.{field} is {v}; allowed: {range}")))
    };
    if let Some(m) = l.memory_bytes {
        if m < MIN_MEMORY_BYTES || m > i64::MAX as u64 {
            return bad("memory_bytes", m, format!("{MIN_MEMORY_BYTES} (8 MiB) to {}", i64::MAX));
        }
    }
    if let Some(p) = l.pids_max {
        if p < MIN_PIDS || p > i32::MAX as u64 {
            return bad("pids_max", p, format!("{MIN_PIDS} to {}", i32::MAX));
        }
    }
    if let Some(d) = l.disk_bytes {
        if !(MIN_DISK_BYTES..=i64::MAX as u64).contains(&d) {
            return bad("disk_bytes", d, format!("{MIN_DISK_BYTES} (64 MiB) to {}", i64::MAX));
        }
    }
    if let Some(c) = l.cpu_millis {
        if !(MIN_CPU_MILLIS..=MAX_CPU_MILLIS).contains(&c) {
            return bad(
                "cpu_millis",
                c,
                format!("{MIN_CPU_MILLIS} to {MAX_CPU_MILLIS} (1000 = one core)"),
            );
        }
    }
    Ok(())
}

/// Create sandbox `rec.name`'s directory atomically with `rec` as its record: the directory is
/// prepared under `<pool>/tmp/` and renamed into place without replacing anything, so it never
/// exists without a record and an existing sandbox (or one being created) keeps its name.
pub fn claim_dir(state: &StateDir, rec: &SandboxRecord) -> Result<()> {
    let name = &rec.name;
    let dir = state.sandbox_dir(name);
    let prep = state.tmp().join(format!("claim-{name}-{:08x}", rand_u32()));
    fs::create_dir(&prep).map_err(SandboxError::io("create", &prep))?;
    let claimed = serde_json::to_vec_pretty(rec)
        .map_err(|e| SandboxError::Other(format!("encoding the record of {name}: {e}")))
        .and_then(|bytes| write_replace(&prep.join("sandbox.json"), &bytes))
        .and_then(|()| {
            nix::fcntl::renameat2(
                None,
                &prep,
                None,
                &dir,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            )
            .map_err(|e| match e {
                nix::errno::Errno::EEXIST | nix::errno::Errno::ENOTEMPTY => {
                    SandboxError::NameTaken { kind: "sandbox", name: name.to_string() }
                }
                e => SandboxError::io("rename", &prep)(std::io::Error::from(e)),
            })
        });
    if let Err(e) = claimed {
        let _ = fs::remove_dir_all(&prep);
        return Err(e);
    }
    // No fsync: the claim guards against another process of this host, not against a crash
    // (after one, a half-made sandbox directory is a dead sandbox or a leftover either way).
    Ok(())
}

/// The seccomp filters a helper installs for `profile` (none when privileged), compiled once
/// per daemon.
fn compiled_filters(profile: &SecurityProfile) -> Result<Option<crate::seccomp::CompiledFilters>> {
    if profile.privileged {
        return Ok(None);
    }
    crate::seccomp::compiled()
        .map(|c| Some(c.clone()))
        .map_err(|e| SandboxError::Other(format!("compiling the seccomp filter: {e}")))
}

/// The cgroup paths a helper joins.
pub fn cgroup_paths(cg: &SandboxCgroup) -> CgroupPaths {
    CgroupPaths { v2: cg.v2.clone(), v1: cg.v1.iter().map(|(_, d)| d.clone()).collect() }
}

/// Per-sandbox files: the init binary, hostname and a fresh machine-id.
///
/// Every write resolves inside `rootfs` ([`InRoot`]): a sandbox or image that made
/// `/etc/hostname`, `/etc/machine-id`, `/tmp` or `/.crab` a symlink cannot make the daemon write
/// or chmod a host file.
pub fn personalize(rootfs: &Path, name: &str, userns: Option<IdRange>) -> Result<()> {
    personalize_as(rootfs, name, userns, &new_machine_id())
}

/// A fresh machine-id (32 hex digits), for [`personalize_as`].
pub fn new_machine_id() -> String {
    format!("{:08x}{:08x}{:08x}{:08x}", rand_u32(), rand_u32(), rand_u32(), rand_u32())
}

/// [`personalize`] with a given machine-id: two trees personalized with the same arguments
/// hold the same files (a fork branch's root and its first point's copy of it).
pub fn personalize_as(
    rootfs: &Path,
    name: &str,
    userns: Option<IdRange>,
    machine_id: &str,
) -> Result<()> {
    if let Some(r) = userns {
        // The root directory itself belongs to the namespace's root (a tree materialized from
        // a remote store gets it from the subvolume the daemon made, the host's root's).
        use std::os::unix::fs::MetadataExt;
        let m = fs::symlink_metadata(rootfs).map_err(SandboxError::io("stat", rootfs))?;
        let inside = |id: u32, base: u32| id >= base && id - base < r.count;
        if !inside(m.uid(), r.uid) || !inside(m.gid(), r.gid) {
            std::os::unix::fs::lchown(rootfs, Some(r.uid), Some(r.gid))
                .map_err(SandboxError::io("chown", rootfs))?;
        }
    }
    let root = InRoot::open(rootfs)?.owned_by(userns.map(|r| (r.uid, r.gid)));
    install_init_in(&root)?;
    root.write(Path::new("etc/hostname"), format!("{name}\n").as_bytes(), 0o644)?;
    root.write(Path::new("etc/machine-id"), format!("{machine_id}\n").as_bytes(), 0o444)?;
    root.mkdir_mode(Path::new("tmp"), 0o1777)?;
    Ok(())
}

/// Put `crab-init` at `/.crab/init` of `rootfs` unless an identical copy is there. `/.crab` is
/// the daemon's: anything but a real directory of that name is replaced.
pub fn install_init(rootfs: &Path) -> Result<()> {
    install_init_in(&InRoot::open(rootfs)?)
}

fn install_init_in(root: &InRoot) -> Result<()> {
    root.own_dir(INIT_DIR, 0o755)?;
    if root.read(Path::new(INIT_PATH)).is_some_and(|b| b == INIT_BINARY) {
        return Ok(());
    }
    root.write(Path::new(INIT_PATH), INIT_BINARY, 0o755)
}

fn net_links() -> Vec<String> {
    fs::read_dir("/sys/class/net")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

fn nft_table_exists(table: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "inet", table])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A random `u32` from the kernel.
pub fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        return std::process::id() ^ (now() as u32);
    }
    u32::from_ne_bytes(b)
}

fn quota_unavailable() -> SandboxError {
    SandboxError::Host {
        what: "disk quotas need btrfs simple quotas on the pool (kernel 6.7 or newer), which this pool refused".into(),
        hint: "drop --disk (and --default-disk), or put the state directory on a newer kernel".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_alive_reads_state_flags_and_start_time() {
        let me = std::process::id();
        let start = process_start_time(me).expect("own start time");
        assert!(init_alive(me, start), "a running process (flags without PF_EXITING) is alive");
        assert!(!init_alive(me, start + 1), "another start time is another process");
        // A zombie (exited, not reaped yet) is dead.
        let mut child = Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        let cstart = process_start_time(pid).expect("child start time");
        let t = std::time::Instant::now();
        while fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
            assert!(t.elapsed().as_secs() < 10, "the child did not become a zombie");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!init_alive(pid, cstart));
        child.wait().expect("reap");
        assert!(!init_alive(pid, cstart), "a reaped process is dead");
    }
}
