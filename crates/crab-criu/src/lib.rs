//! CRIU driven through its RPC interface.
//!
//! This crate owns everything Crab knows about talking to CRIU: finding the binary
//! ([`Criu::locate`]: `CRAB_CRIU`, else `/opt/crab/criu/bin/criu`), starting `criu swrk <fd>`
//! on one end of a `SOCK_SEQPACKET` socket pair, and exchanging `criu_req` / `criu_resp`
//! protobuf messages ([`rpc`]) for [`Criu::version`], [`Criu::check`], [`Criu::dump`] and
//! [`Criu::restore`]. With a hook (`*_with`), CRIU's NOTIFY messages (`pre-dump`, `post-dump`,
//! `network-lock`, `setup-namespaces`, `post-restore`, ...) are handed to the caller between
//! phases and answered with its verdict. Every operation writes its own CRIU log file, whose
//! path (and last `Error (` lines) every error carries. One `criu swrk` process serves one
//! operation; the crate keeps no state between operations, so concurrent operations from
//! several threads are fine.

mod error;
pub mod images;
pub mod observer;
pub mod rpc;
pub mod soft_dirty;
mod swrk;

use std::os::fd::{OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use error::{CriuError, LogTail, Result};
pub use rpc::{CgMode, NetworkLockMethod};

/// Environment variable naming the CRIU binary.
pub const CRIU_ENV: &str = "CRAB_CRIU";
/// Where `scripts/install-criu.sh` puts CRIU.
pub const DEFAULT_CRIU_PATH: &str = "/opt/crab/criu/bin/criu";
/// Default log level of dumps and restores (4 = debug: the logs are what one debugs with).
pub const DEFAULT_LOG_LEVEL: i32 = 4;
/// Default time CRIU may take to answer before it is killed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Names of the NOTIFY actions CRIU sends when `notify_scripts` is on (the action-script
/// names of `criu --action-script`).
pub mod phase {
    /// Before the tree is frozen for a dump.
    pub const PRE_DUMP: &str = "pre-dump";
    /// After a dump, before the tree is resumed (with `leave_running`) or killed.
    pub const POST_DUMP: &str = "post-dump";
    /// The network of the tree has been locked.
    pub const NETWORK_LOCK: &str = "network-lock";
    /// The network of the tree is about to be unlocked.
    pub const NETWORK_UNLOCK: &str = "network-unlock";
    /// Before a restore starts.
    pub const PRE_RESTORE: &str = "pre-restore";
    /// The restored root task's namespaces exist (pid given): set up veths, cgroups here.
    pub const SETUP_NAMESPACES: &str = "setup-namespaces";
    /// After the namespaces were set up.
    pub const POST_SETUP_NAMESPACES: &str = "post-setup-namespaces";
    /// Before restored tasks resume.
    pub const PRE_RESUME: &str = "pre-resume";
    /// After restored tasks resumed.
    pub const POST_RESUME: &str = "post-resume";
    /// The restore is complete (pid given).
    pub const POST_RESTORE: &str = "post-restore";
    /// A restored orphan pty master is passed (with its descriptor).
    pub const ORPHAN_PTS_MASTER: &str = "orphan-pts-master";
}

/// One NOTIFY message from CRIU, handed to the caller's hook.
#[derive(Debug)]
pub struct Notify {
    /// The action name (see [`phase`]).
    pub phase: String,
    /// The pid the action concerns, when CRIU gives one (the restored root task).
    pub pid: Option<i32>,
    /// Descriptors CRIU passed along (only `orphan-pts-master`); the hook may take them.
    pub fds: Vec<OwnedFd>,
}

/// What a notify hook returns: `Err` makes CRIU abort the operation.
pub type HookResult = std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// How CRIU handles the tree's cgroups (`manage_cgroups_mode`).
pub type CgroupMode = CgMode;

/// Options of a dump. Build with [`DumpOpts::new`] and adjust fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpOpts {
    /// Root of the process tree (host pid).
    pub pid: i32,
    /// Existing, empty directory to write the images to.
    pub images_dir: PathBuf,
    /// CRIU log file of this dump. Its directory must exist and is CRIU's work directory: CRIU
    /// also writes `stats-dump` there, which is moved to `<log_path>.stats`. Operations that run
    /// concurrently should use different directories.
    pub log_path: PathBuf,
    /// Log level 0..=4.
    pub log_level: i32,
    /// Keep the tree running after the dump (otherwise CRIU kills it).
    pub leave_running: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
    /// Skip TCP connections not yet accepted.
    pub tcp_skip_in_flight: bool,
    /// Allow unix sockets whose peer is outside the tree.
    pub ext_unix_sk: bool,
    /// Dump file locks.
    pub file_locks: bool,
    /// The tree is a shell job (session leader outside it).
    pub shell_job: bool,
    /// Allow link remapping of deleted-but-open files.
    pub link_remap: bool,
    /// Network lock method; `None` leaves CRIU's default (iptables, absent here).
    pub network_lock: Option<NetworkLockMethod>,
    /// External resources (`mnt[/path]:key`, `net[inode]:key`, ...).
    pub external: Vec<String>,
    /// Cgroup to freeze the tree with instead of ptrace (a cgroup-v2 directory or a v1 freezer
    /// directory).
    pub freeze_cgroup: Option<PathBuf>,
    /// Cgroup management mode; `None` leaves CRIU's default.
    pub manage_cgroups: Option<CgroupMode>,
    /// Largest deleted-but-open file carried in the images.
    pub ghost_limit: Option<u32>,
    /// Mount points to skip.
    pub skip_mnt: Vec<String>,
    /// File systems to allow.
    pub enable_fs: Vec<String>,
    /// Seconds CRIU may take to freeze the tree.
    pub freeze_timeout_s: Option<u32>,
    /// Clear the tree's soft-dirty bits at the dump, while it is stopped (CRIU's
    /// `--track-mem`): a page written after this dump then shows the bit. Only where the
    /// kernel has soft-dirty tracking ([`soft_dirty::probe`]); CRIU refuses it elsewhere.
    pub track_mem: bool,
}

impl DumpOpts {
    /// Defaults: leave nothing running, nftables network lock, debug log, no TCP.
    pub fn new(pid: i32, images_dir: impl Into<PathBuf>, log_path: impl Into<PathBuf>) -> Self {
        DumpOpts {
            pid,
            images_dir: images_dir.into(),
            log_path: log_path.into(),
            log_level: DEFAULT_LOG_LEVEL,
            leave_running: false,
            tcp_established: false,
            tcp_skip_in_flight: false,
            ext_unix_sk: false,
            file_locks: false,
            shell_job: false,
            link_remap: false,
            network_lock: Some(NetworkLockMethod::Nftables),
            external: Vec::new(),
            freeze_cgroup: None,
            manage_cgroups: None,
            ghost_limit: None,
            skip_mnt: Vec::new(),
            enable_fs: Vec::new(),
            freeze_timeout_s: None,
            track_mem: false,
        }
    }
}

/// A descriptor of the caller that replaces a restored file (`--inherit-fd fd[N]:key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InheritFd {
    /// CRIU's key of the file (`pipe:[1234]`, `tty[...]`, a path).
    pub key: String,
    /// The caller's descriptor; it must stay open for the duration of the restore.
    pub fd: RawFd,
}

/// Options of a restore. Build with [`RestoreOpts::new`] and adjust fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreOpts {
    /// Directory holding the images.
    pub images_dir: PathBuf,
    /// CRIU log file of this restore; as for [`DumpOpts::log_path`] (`stats-restore`).
    pub log_path: PathBuf,
    /// Log level 0..=4.
    pub log_level: i32,
    /// Root directory of the restored tree (needed when it had its own mount namespace).
    pub root: Option<PathBuf>,
    /// Restore the root task as a child of the caller (`rst_sibling`) instead of `criu swrk`
    /// (whose orphans go to the nearest subreaper or init).
    pub sibling: bool,
    /// Descriptors substituted for restored files.
    pub inherit_fd: Vec<InheritFd>,
    /// Restore established TCP connections.
    pub tcp_established: bool,
    /// Close restored TCP connections instead of reviving them.
    pub tcp_close: bool,
    /// Allow external unix sockets.
    pub ext_unix_sk: bool,
    /// Restore file locks.
    pub file_locks: bool,
    /// The tree is a shell job.
    pub shell_job: bool,
    /// Network lock method (must match the dump's).
    pub network_lock: Option<NetworkLockMethod>,
    /// External resources.
    pub external: Vec<String>,
    /// Cgroup management mode; `None` leaves CRIU's default.
    pub manage_cgroups: Option<CgroupMode>,
    /// Namespaces to join instead of restoring: `(kind, path)` such as `("net",
    /// "/proc/42/ns/net")`.
    pub join_ns: Vec<(String, String)>,
    /// Namespaces CRIU creates empty instead of restoring their contents (clone flags, e.g.
    /// `CLONE_NEWNET`: a new network namespace without the dumped links, addresses, routes,
    /// rules, iptables and sysctls; the caller sets it up at `setup-namespaces`). 0: none.
    pub empty_ns: u32,
    /// Cgroup directories (v2 and/or v1) that `criu swrk` joins before it starts, so that the
    /// restored tree, which it forks, starts in them. Use with `manage_cgroups:
    /// Some(CgroupMode::Ignore)` to place a restored tree in cgroups other than the dumped ones
    /// (a fork into a new sandbox).
    pub join_cgroups: Vec<PathBuf>,
    /// Unshare a cgroup namespace in `criu swrk` right after it joined `join_cgroups`, so the
    /// restored tree's cgroup root is the group it joined. CRIU does not restore a dumped
    /// tree's cgroup namespace when cgroups are not managed (`CgroupMode::Ignore`).
    pub cgroup_ns: bool,
    /// Restore orphan pty masters and pass them to the hook.
    pub orphan_pts_master: bool,
    /// Do not fail on sysctls that cannot be set.
    pub weak_sysctls: bool,
    /// LSM profile of the restored tree.
    pub lsm_profile: Option<String>,
    /// The nice value `criu swrk` runs at (0: the caller's), and with it the tasks it forks
    /// while they restore themselves (their memory is read in then); each restored task sets
    /// its own dumped nice back before it resumes. Negative makes a restore someone waits for
    /// win the CPU from background work such as dumps; it needs `CAP_SYS_NICE`, and without
    /// it the restore runs at the caller's priority.
    pub nice: i32,
}

impl RestoreOpts {
    /// Defaults: root task a child of the caller, nftables, debug log.
    pub fn new(images_dir: impl Into<PathBuf>, log_path: impl Into<PathBuf>) -> Self {
        RestoreOpts {
            images_dir: images_dir.into(),
            log_path: log_path.into(),
            log_level: DEFAULT_LOG_LEVEL,
            root: None,
            sibling: true,
            inherit_fd: Vec::new(),
            tcp_established: false,
            tcp_close: false,
            ext_unix_sk: false,
            file_locks: false,
            shell_job: false,
            network_lock: Some(NetworkLockMethod::Nftables),
            external: Vec::new(),
            manage_cgroups: None,
            join_ns: Vec::new(),
            empty_ns: 0,
            join_cgroups: Vec::new(),
            cgroup_ns: false,
            orphan_pts_master: false,
            weak_sysctls: false,
            lsm_profile: None,
            nice: 0,
        }
    }
}

/// CRIU's version, from a VERSION request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CriuVersion {
    /// Major number.
    pub major: i32,
    /// Minor number.
    pub minor: i32,
    /// Sub-level (the `1` of 4.2.1).
    pub sublevel: i32,
    /// Release name, when given.
    pub name: Option<String>,
    /// Git id of a development build.
    pub gitid: Option<String>,
}

impl std::fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.sublevel)
    }
}

/// What a dump cost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DumpStats {
    /// Wall time of the whole RPC, CRIU start included.
    pub wall: Duration,
    /// Total bytes of the image files written.
    pub image_bytes: u64,
    /// Number of image files written.
    pub image_files: u64,
    /// Time CRIU took to freeze the tree (from `stats-dump`).
    pub freezing_time: Option<Duration>,
    /// Time the tree stayed frozen (from `stats-dump`).
    pub frozen_time: Option<Duration>,
    /// Time to collect memory (from `stats-dump`).
    pub memdump_time: Option<Duration>,
    /// Time to write memory (from `stats-dump`).
    pub memwrite_time: Option<Duration>,
    /// Pages written (from `stats-dump`).
    pub pages_written: Option<u64>,
}

/// The result of a restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// Host pid of the restored root task. With [`RestoreOpts::sibling`] it is a child of the
    /// calling process, which must reap it.
    pub pid: i32,
    /// Wall time of the whole RPC.
    pub wall: Duration,
    /// Time CRIU spent forking the tree (from `stats-restore`, when written).
    pub forking_time: Option<Duration>,
    /// Time of CRIU's restore proper (from `stats-restore`, when written).
    pub restore_time: Option<Duration>,
}

fn is_tmpfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
        .unwrap_or(false)
}

/// A located CRIU binary.
#[derive(Debug, Clone)]
pub struct Criu {
    bin: PathBuf,
    timeout: Duration,
    private_run: Option<PathBuf>,
}

impl Criu {
    /// Find CRIU: `$CRAB_CRIU`, else [`DEFAULT_CRIU_PATH`]. Fails with a hint naming `make
    /// setup` when the binary is missing or not executable.
    pub fn locate() -> Result<Criu> {
        match std::env::var_os(CRIU_ENV) {
            Some(p) if !p.is_empty() => Criu::at_path(PathBuf::from(p), true),
            _ => Criu::at_path(PathBuf::from(DEFAULT_CRIU_PATH), false),
        }
    }

    /// Use the binary at `path`.
    pub fn at(path: impl Into<PathBuf>) -> Result<Criu> {
        Criu::at_path(path.into(), false)
    }

    fn at_path(bin: PathBuf, from_env: bool) -> Result<Criu> {
        use std::os::unix::fs::PermissionsExt as _;
        let meta = std::fs::metadata(&bin).map_err(|source| CriuError::NotFound {
            path: bin.clone(),
            from_env,
            source,
        })?;
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            return Err(CriuError::NotFound {
                path: bin,
                from_env,
                source: std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "not an executable file",
                ),
            });
        }
        Ok(Criu { bin, timeout: DEFAULT_TIMEOUT, private_run: None })
    }

    /// Let CRIU keep its kernel-feature cache between runs on a host whose `/run` is not a
    /// tmpfs (CRIU only caches `/run/criu.kdat` on tmpfs and otherwise re-probes the kernel on
    /// every run, about 40 ms here). `criu swrk` then runs in a private mount namespace with
    /// `dir` (created if needed; it must be on a tmpfs, e.g. under `/dev/shm`) bind-mounted over
    /// `/run`. Only for trees that have their own mount namespace, such as sandboxes: CRIU
    /// compares the tree's mount namespace with its own. Does nothing when `/run` already is a
    /// tmpfs or `dir` is not one (logged).
    pub fn with_kdat_cache_dir(mut self, dir: impl Into<PathBuf>) -> Criu {
        let dir = dir.into();
        if is_tmpfs(Path::new("/run")) {
            return self;
        }
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "no CRIU kdat cache directory");
            return self;
        }
        if !is_tmpfs(&dir) {
            tracing::warn!(dir = %dir.display(), "CRIU kdat cache directory is not on a tmpfs; not used");
            return self;
        }
        self.private_run = Some(dir);
        self
    }

    pub(crate) fn private_run(&self) -> Option<&Path> {
        self.private_run.as_deref()
    }

    /// The same binary with another answer timeout (per operation).
    pub fn with_timeout(mut self, timeout: Duration) -> Criu {
        self.timeout = timeout;
        self
    }

    /// The binary's path.
    pub fn path(&self) -> &Path {
        &self.bin
    }

    /// Ask CRIU its version.
    pub fn version(&self) -> Result<CriuVersion> {
        swrk::version(self)
    }

    /// Run CRIU's kernel-support check (`criu check`); the log goes to `log_path`.
    pub fn check(&self, log_path: &Path) -> Result<()> {
        swrk::check(self, log_path)
    }

    /// Dump a process tree.
    pub fn dump(&self, opts: &DumpOpts) -> Result<DumpStats> {
        swrk::dump(self, opts, None)
    }

    /// Dump a process tree, calling `hook` at each phase CRIU notifies (see [`phase`]). An
    /// `Err` from the hook aborts the dump (the tree is resumed).
    pub fn dump_with(
        &self,
        opts: &DumpOpts,
        mut hook: impl FnMut(Notify) -> HookResult,
    ) -> Result<DumpStats> {
        swrk::dump(self, opts, Some(&mut hook))
    }

    /// Restore a process tree.
    pub fn restore(&self, opts: &RestoreOpts) -> Result<Restored> {
        swrk::restore(self, opts, None)
    }

    /// Restore a process tree, calling `hook` at each phase CRIU notifies (see [`phase`]). An
    /// `Err` from the hook aborts the restore (CRIU kills what it restored so far).
    pub fn restore_with(
        &self,
        opts: &RestoreOpts,
        mut hook: impl FnMut(Notify) -> HookResult,
    ) -> Result<Restored> {
        swrk::restore(self, opts, Some(&mut hook))
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }
}
