//! The restore points of one sandbox on disk: staging, publication, listing, verification,
//! pruning and crash recovery.
//!
//! ```text
//! <pool>/checkpoints/<sandbox>/
//!   points/<C_i>.manifest   published restore points (see manifest.rs, docs/format.md)
//!   procs/<P_j>/            CRIU image directories
//!   fs/<F_k>                read-only snapshots of the sandbox's root (btrfs subvolumes)
//!   tmp/                    staging; anything here when the daemon starts is a leftover
//!   lock                    flock(2) of whoever operates on the store (see [`StoreLock`])
//! ```
//!
//! A checkpoint stages its process image under `tmp/` and takes its snapshot directly at
//! `fs/<id>` (read-only subvolumes cannot be moved between directories), then
//! [`Staging::publish`] hashes the image files, makes them durable, renames the image into
//! `procs/`, and finally writes the manifest atomically. Until that last rename the point does not exist; a crash before it
//! leaves only leftovers, which [`Store::recover_leftovers`] removes (staged parts, temp
//! manifests, and published parts that no manifest references).
//!
//! Several processes may work on one state directory at once (a daemon, a second tool, a
//! restarted daemon recovering while the old one's last CRIU run ends): every operation holds
//! the store's [`StoreLock`], and recovery skips a store whose lock is held, so it never
//! discards another process's staged parts as leftovers.
//!
//! [`Store::verify`] hashes an image file once per process while the file stays unchanged (its
//! inode, size and change times: `VERIFIED`), so waking a parked sandbox again from the same
//! images does not read them twice.

use std::collections::BTreeSet;
use std::io::Read;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crab_common::PointKind;
use sha2::{Digest as _, Sha256};

use crate::error::{CheckpointError, Result};
use crate::manifest::{
    self, FsId, FsPart, ImageFile, Manifest, Origin, PointId, ProcId, ProcPart, Timings,
    MANIFEST_SUFFIX,
};
use crate::snapfs::SnapshotFs;

/// How long start-up recovery waits for an orphaned writer to leave a staged leftover.
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub use crab_common::clock::now_ms;

fn us(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// An exclusive `flock(2)` on a store's `lock` file, held for the duration of an operation
/// that stages, publishes or deletes parts. It excludes other processes (and other
/// [`Store`] instances); the kernel releases it when the holder dies, so a crashed daemon
/// never leaves a store locked. Released on drop.
#[derive(Debug)]
pub struct StoreLock {
    _file: std::fs::File,
}

fn flock(file: &std::fs::File, op: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock(2) on a descriptor we own; it only takes or drops an advisory lock.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What a new restore point should record, besides its staged parts.
#[derive(Debug, Clone)]
pub struct Draft {
    /// What the checkpoint captured; must agree with the staged parts.
    pub kind: PointKind,
    /// Agent turn number.
    pub turn: u64,
    /// Conversation offset, when known.
    pub conversation_offset: Option<u64>,
    /// Host pid of the dumped root task (with a staged process image).
    pub root_pid: i32,
    /// CRIU version (with a staged process image).
    pub criu_version: String,
    /// Filesystem delta since the previous snapshot (with a staged snapshot).
    pub fs_delta_bytes: Option<u64>,
    /// btrfs generation of the snapshot (with a staged snapshot).
    pub fs_generation: Option<u64>,
    /// Bytes the live root had written in all when the snapshot was taken.
    pub fs_written_bytes: Option<u64>,
    /// Leave the process image out instead of inheriting the parent's (the sandbox has no
    /// process worth restoring; restore starts it fresh).
    pub no_procs: bool,
    /// Why processes asked for are not in the point ([`Manifest::procs_missing`]).
    pub procs_missing: Option<String>,
    /// Where a forked sandbox came from.
    pub origin: Option<Origin>,
    /// Timings measured by the caller (`hash_us` and `total_us` are filled in by publish).
    pub timings: Timings,
    /// When the checkpoint started, for `total_us`.
    pub started: Option<Instant>,
    /// Opaque runtime data needed to rebuild the sandbox.
    pub sandbox_meta: serde_json::Value,
    /// The point to build on (parent, inherited parts); default: the newest.
    pub base: Option<PointId>,
    /// Names, sizes and hashes of the staged image files when they are already known (hard
    /// links to a verified image): publish then checks names and sizes instead of re-hashing.
    pub trusted_files: Option<Vec<ImageFile>>,
}

impl Draft {
    /// A draft of `kind` at `turn` with everything else empty.
    pub fn new(kind: impl Into<PointKind>, turn: u64) -> Draft {
        let kind = kind.into();
        Draft {
            kind,
            turn,
            conversation_offset: None,
            root_pid: 0,
            criu_version: String::new(),
            fs_delta_bytes: None,
            fs_generation: None,
            fs_written_bytes: None,
            no_procs: false,
            procs_missing: None,
            origin: None,
            timings: Timings::default(),
            started: None,
            sandbox_meta: serde_json::Value::Null,
            base: None,
            trusted_files: None,
        }
    }
}

/// What [`Store::prune`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Restore points removed.
    pub points: Vec<PointId>,
    /// Process images removed.
    pub procs: Vec<ProcId>,
    /// Filesystem snapshots removed.
    pub fs: Vec<FsId>,
}

/// What [`Store::recover_leftovers`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Paths removed.
    pub removed: Vec<PathBuf>,
}

/// The file of [`Store::number_points_after`] in a store's directory: a decimal point number.
const POINT_FLOOR: &str = "point-floor";

#[derive(Debug, Default)]
struct Counters {
    point: u64,
    proc: u64,
    fs: u64,
}

/// The restore points of one sandbox.
#[derive(Debug)]
pub struct Store {
    sandbox: String,
    dir: PathBuf,
    fs: Arc<dyn SnapshotFs>,
    counters: Mutex<Counters>,
}

fn parse_seq(name: &str, prefix: char, suffix: &str) -> Option<u64> {
    let rest = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    rest.parse().ok()
}

fn list_names(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(CheckpointError::io("readdir", dir, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| CheckpointError::io("readdir", dir, e))?;
        if let Ok(name) = entry.file_name().into_string() {
            out.push(name);
        }
    }
    out.sort();
    Ok(out)
}

/// SHA-256 and size of a file.
pub fn hash_file(path: &Path) -> Result<(u64, String)> {
    let f = std::fs::File::open(path).map_err(|e| CheckpointError::io("open", path, e))?;
    hash_reader(f, path)
}

/// SHA-256 and size of everything `r` (reading `path`, for errors) yields.
fn hash_reader(mut r: impl Read, path: &Path) -> Result<(u64, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = r.read(&mut buf).map_err(|e| CheckpointError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    Ok((size, manifest::hex(&h.finalize())))
}

/// [`hash_file`] of `path` only when it is a regular file (opened with `O_NOFOLLOW`, so a
/// symlink is refused, and checked to be a regular file, so no device or fifo is read), read
/// no further than `max + 1` bytes: `(bytes read, SHA-256 of them)`, or `None` when there is no
/// such file. A size past `max` shows as `max + 1`.
pub fn hash_regular_file(path: &Path, max: u64) -> Result<Option<(u64, String)>> {
    let Some((f, _)) = open_regular(path)? else { return Ok(None) };
    hash_reader(f.take(max.saturating_add(1)), path).map(Some)
}

/// `path` opened for reading when it is a regular file (`O_NOFOLLOW`: a symlink is refused;
/// checked to be a regular file: no device or fifo is read), with its metadata; `None` when it
/// does not exist.
fn open_regular(path: &Path) -> Result<Option<(std::fs::File, std::fs::Metadata)>> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(CheckpointError::corrupt(path, "image file is a symbolic link"))
        }
        Err(e) => return Err(CheckpointError::io("open", path, e)),
    };
    let meta = f.metadata().map_err(|e| CheckpointError::io("stat", path, e))?;
    if !meta.is_file() {
        return Err(CheckpointError::corrupt(path, "image file is not a regular file"));
    }
    Ok(Some((f, meta)))
}

/// What identifies an image file's bytes without reading them: its inode, size and change
/// times. Any write, truncation, rename or attribute change through the kernel gives the
/// inode a new `ctime`; a removed file's inode number reused by a new file comes with one too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt as _;
        FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// How long before a hash began a file must last have changed for the hash to be remembered:
/// far above the kernel's timestamp granularity (a clock tick), so a change after the hash
/// can never carry the same `ctime` as the one the hash saw.
pub const SETTLED: std::time::Duration = std::time::Duration::from_millis(250);
/// Hashes remembered at most (the map is emptied when full).
const VERIFIED_MAX: usize = 16_384;

/// The image files this process has hashed, by `(dev, inode)`: their stamp then and their
/// `(size, SHA-256)`. Process images are immutable once published, and a parked sandbox is
/// woken again and again from the same files (every turn's point shares the unchanged
/// processes' images): a file whose stamp is unchanged since a hash of it is not read again.
/// Bit rot under an unchanged stamp is btrfs's to catch (data checksums, `EIO` on read, which
/// CRIU then reports).
static VERIFIED: std::sync::LazyLock<Mutex<VerifiedFiles>> =
    std::sync::LazyLock::new(Mutex::default);

/// `(dev, inode)` → the file's stamp when it was hashed, and its SHA-256.
type VerifiedFiles = std::collections::HashMap<(u64, u64), (FileStamp, String)>;

/// [`hash_regular_file`] for a published image file, answered from [`VERIFIED`] when the file
/// is unchanged since this process last hashed it.
fn hash_image_file(path: &Path, max: u64) -> Result<Option<(u64, String)>> {
    let Some((f, meta)) = open_regular(path)? else { return Ok(None) };
    let stamp = FileStamp::of(&meta);
    let key = (stamp.dev, stamp.ino);
    if let Some((seen, sha)) = crab_common::sync::lock(&VERIFIED).get(&key) {
        if *seen == stamp {
            return Ok(Some((stamp.size, sha.clone())));
        }
    }
    let began = std::time::SystemTime::now();
    let (size, sha) = hash_reader((&f).take(max.saturating_add(1)), path)?;
    let after = f.metadata().ok().map(|m| FileStamp::of(&m));
    let changed_at = std::time::UNIX_EPOCH
        + std::time::Duration::new(
            u64::try_from(stamp.ctime.0).unwrap_or(0),
            u32::try_from(stamp.ctime.1).unwrap_or(0),
        );
    let settled = began.duration_since(changed_at).is_ok_and(|d| d >= SETTLED);
    if after == Some(stamp) && size == stamp.size && settled {
        let mut g = crab_common::sync::lock(&VERIFIED);
        if g.len() >= VERIFIED_MAX {
            g.clear();
        }
        g.insert(key, (stamp, sha.clone()));
    }
    Ok(Some((size, sha)))
}

/// The size of `path`, a regular file (no symbolic link followed), with an empty hash; None
/// when it does not exist.
fn regular_size(path: &Path) -> Result<Option<(u64, String)>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_file() => Ok(Some((m.len(), String::new()))),
        Ok(m) if m.file_type().is_symlink() => {
            Err(CheckpointError::corrupt(path, "image file is a symbolic link"))
        }
        Ok(_) => Err(CheckpointError::corrupt(path, "image file is not a regular file")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CheckpointError::io("stat", path, e)),
    }
}

fn syncfs(dir: &Path) -> Result<()> {
    let f = std::fs::File::open(dir).map_err(|e| CheckpointError::io("open", dir, e))?;
    // SAFETY: syncfs(2) on a descriptor we own; it only flushes.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(CheckpointError::io("syncfs", dir, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// `work`, with (when `sync`) one `syncfs` of the filesystem holding `dir` running beside it on
/// a thread of its own: `work`'s result and the flush's time in µs (0 without one). A failure
/// of `work` comes first, then the flush's.
fn beside_syncfs<T>(dir: &Path, sync: bool, work: impl FnOnce() -> Result<T>) -> Result<(T, u64)> {
    std::thread::scope(|scope| {
        let flush = sync.then(|| {
            scope.spawn(|| {
                let t = Instant::now();
                syncfs(dir).map(|()| us(t.elapsed()))
            })
        });
        let out = work();
        let flushed = match flush {
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(CheckpointError::Invalid("the syncfs thread panicked".into()))
            }),
            None => Ok(0),
        };
        Ok((out?, flushed?))
    })
}

impl Store {
    fn create_dirs(dir: &Path) -> Result<()> {
        for sub in ["points", "procs", "fs", "tmp"] {
            let p = dir.join(sub);
            std::fs::create_dir_all(&p).map_err(|e| CheckpointError::io("mkdir", &p, e))?;
        }
        Ok(())
    }

    /// Open (creating its directories) the store at `dir` for `sandbox`.
    pub fn open(dir: impl Into<PathBuf>, sandbox: &str, fs: Arc<dyn SnapshotFs>) -> Result<Store> {
        let dir = dir.into();
        Store::create_dirs(&dir)?;
        let store = Store {
            sandbox: sandbox.to_owned(),
            dir,
            fs,
            counters: Mutex::new(Counters::default()),
        };
        store.rescan()?;
        Ok(store)
    }

    /// Open the store at `dir` for `sandbox` if it exists, creating nothing (for recovery,
    /// which must not bring back the store of a sandbox being removed).
    pub fn open_existing(
        dir: impl Into<PathBuf>,
        sandbox: &str,
        fs: Arc<dyn SnapshotFs>,
    ) -> Result<Option<Store>> {
        let dir = dir.into();
        if !dir.is_dir() {
            return Ok(None);
        }
        let store = Store {
            sandbox: sandbox.to_owned(),
            dir,
            fs,
            counters: Mutex::new(Counters::default()),
        };
        store.rescan()?;
        Ok(Some(store))
    }

    /// The store of `sandbox` in a state directory.
    pub fn for_sandbox(
        state: &crab_common::paths::StateDir,
        sandbox: &str,
        fs: Arc<dyn SnapshotFs>,
    ) -> Result<Store> {
        Store::open(state.checkpoints(sandbox), sandbox, fs)
    }

    fn rescan(&self) -> Result<()> {
        let mut c = Counters::default();
        for name in list_names(&self.points_dir())? {
            let seq = parse_seq(&name, PointId::PREFIX, MANIFEST_SUFFIX)
                .or_else(|| parse_seq(&name, PointId::PREFIX, ".manifest.tmp"));
            c.point = c.point.max(seq.unwrap_or(0));
        }
        for dir in [self.procs_dir(), self.tmp_dir()] {
            for name in list_names(&dir)? {
                c.proc = c.proc.max(parse_seq(&name, ProcId::PREFIX, "").unwrap_or(0));
            }
        }
        for dir in [self.fs_dir(), self.tmp_dir()] {
            for name in list_names(&dir)? {
                c.fs = c.fs.max(parse_seq(&name, FsId::PREFIX, "").unwrap_or(0));
            }
        }
        // Numbered after the points an earlier sandbox of this name left in a remote store.
        let floor = self.dir.join(POINT_FLOOR);
        match std::fs::read_to_string(&floor) {
            Ok(t) => match t.trim().parse::<u64>() {
                Ok(n) => c.point = c.point.max(n),
                Err(e) => {
                    tracing::warn!(path = %floor.display(), error = %e, "ignoring an unreadable point floor")
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CheckpointError::io("read", &floor, e)),
        }
        let mut guard = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        guard.point = guard.point.max(c.point);
        guard.proc = guard.proc.max(c.proc);
        guard.fs = guard.fs.max(c.fs);
        Ok(())
    }

    /// Number this store's next points after `n` (`c<n+1>` on), persistently: the points an
    /// earlier sandbox of this name left in a remote store keep their ids there. Never lowers
    /// the numbering.
    pub fn number_points_after(&self, n: u64) -> Result<()> {
        let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        if n <= c.point {
            return Ok(());
        }
        let path = self.dir.join(POINT_FLOOR);
        crab_common::fsutil::write_atomic(&path, format!("{n}\n").as_bytes())
            .map_err(|e| CheckpointError::io(e.op, &e.path, e.source))?;
        c.point = n;
        Ok(())
    }

    fn lock_file(&self) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("lock"))
    }

    /// Take the store's lock, waiting while another process (or another `Store` of this
    /// sandbox) holds it. A store directory that someone else removed meanwhile (all points
    /// of the sandbox deleted) is created again, empty.
    pub fn lock(&self) -> Result<StoreLock> {
        let path = self.dir.join("lock");
        let file = match self.lock_file() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Store::create_dirs(&self.dir)?;
                self.lock_file()
            }
            r => r,
        }
        .map_err(|e| CheckpointError::io("open", &path, e))?;
        let t = Instant::now();
        if let Err(e) = flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(CheckpointError::io("flock", &self.dir.join("lock"), e));
            }
            tracing::info!(sandbox = %self.sandbox, "restore points in use by another process; waiting");
            flock(&file, libc::LOCK_EX)
                .map_err(|e| CheckpointError::io("flock", &self.dir.join("lock"), e))?;
            tracing::info!(sandbox = %self.sandbox, waited_ms = t.elapsed().as_millis() as u64, "got the restore points' lock");
        }
        Ok(StoreLock { _file: file })
    }

    /// Take the store's lock if nobody holds it; `None` when someone does, or when the store
    /// directory is gone (someone removed the sandbox's points meanwhile).
    ///
    /// It never creates the lock file: a store whose lock file is missing was never locked
    /// (so nothing of it is staged) or is being removed, and creating the file then would
    /// put an entry back into a directory its remover is deleting (its `rmdir` would fail
    /// and the removed sandbox's store would stay behind).
    pub fn try_lock(&self) -> Result<Option<StoreLock>> {
        let existing = std::fs::OpenOptions::new().write(true).open(self.dir.join("lock"));
        let file = match existing {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(CheckpointError::io("open", &self.dir.join("lock"), e)),
        };
        match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => Ok(Some(StoreLock { _file: file })),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(None),
            Err(e) => Err(CheckpointError::io("flock", &self.dir.join("lock"), e)),
        }
    }

    /// The sandbox's name.
    pub fn sandbox(&self) -> &str {
        &self.sandbox
    }
    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The snapshot implementation.
    pub fn snapshot_fs(&self) -> &Arc<dyn SnapshotFs> {
        &self.fs
    }
    fn points_dir(&self) -> PathBuf {
        self.dir.join("points")
    }
    fn procs_dir(&self) -> PathBuf {
        self.dir.join("procs")
    }
    fn fs_dir(&self) -> PathBuf {
        self.dir.join("fs")
    }
    pub(crate) fn tmp_dir(&self) -> PathBuf {
        self.dir.join("tmp")
    }
    /// Path of a point's manifest.
    pub fn manifest_path(&self, id: PointId) -> PathBuf {
        self.points_dir().join(format!("{id}{MANIFEST_SUFFIX}"))
    }
    /// Directory of a process image.
    pub fn proc_dir(&self, id: ProcId) -> PathBuf {
        self.procs_dir().join(id.to_string())
    }
    /// Path of a filesystem snapshot.
    pub fn fs_path(&self, id: FsId) -> PathBuf {
        self.fs_dir().join(id.to_string())
    }

    /// Ids of the published manifests, oldest first (not verified).
    pub fn point_ids(&self) -> Result<Vec<PointId>> {
        let mut ids: Vec<PointId> = list_names(&self.points_dir())?
            .iter()
            .filter_map(|n| parse_seq(n, PointId::PREFIX, MANIFEST_SUFFIX))
            .map(PointId)
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Every published point, oldest first, each decoded and checksum-verified or the error
    /// that makes it unusable.
    pub fn list_all(&self) -> Result<Vec<(PointId, Result<Manifest>)>> {
        Ok(self.point_ids()?.into_iter().map(|id| (id, self.load(id))).collect())
    }

    /// The usable points, oldest first; unusable manifests are skipped with a warning.
    pub fn list(&self) -> Result<Vec<Manifest>> {
        let mut out = Vec::new();
        for (id, m) in self.list_all()? {
            match m {
                Ok(m) => out.push(m),
                Err(e) => {
                    tracing::warn!(sandbox = %self.sandbox, point = %id, error = %e, "skipping unusable restore point")
                }
            }
        }
        Ok(out)
    }

    /// Load and checksum-verify one point's manifest.
    pub fn load(&self, id: PointId) -> Result<Manifest> {
        let path = self.manifest_path(id);
        if !path.exists() {
            return Err(CheckpointError::NotFound {
                sandbox: self.sandbox.clone(),
                id: id.to_string(),
            });
        }
        let m = manifest::read(&path)?;
        if m.id != id || m.sandbox != self.sandbox {
            return Err(CheckpointError::corrupt(
                &path,
                format!("manifest describes {}/{}, not {}/{id}", m.sandbox, m.id, self.sandbox),
            ));
        }
        Ok(m)
    }

    /// The newest usable point.
    pub fn newest(&self) -> Result<Manifest> {
        self.list()?
            .pop()
            .ok_or_else(|| CheckpointError::NoPoints { sandbox: self.sandbox.clone() })
    }

    /// Resolve a user-given id (`c000007`, `c7`, `7`) or, with `None`, the newest point.
    pub fn resolve(&self, id: Option<&str>) -> Result<Manifest> {
        match id {
            None => self.newest(),
            Some(s) => {
                let id = s.parse::<PointId>().map_err(CheckpointError::Invalid)?;
                self.load(id)
            }
        }
    }

    /// Verify everything a restore of `m` reads: every image file present with the recorded
    /// size and SHA-256, no extra file in the image directory, the filesystem snapshot present.
    pub fn verify(&self, m: &Manifest) -> Result<()> {
        self.check_files(m, true)
    }

    /// [`Store::verify`] without hashing: every image file present, a regular file of the
    /// recorded size, no extra file, the filesystem snapshot present. For parts whose bytes
    /// were checked as they were written (a point materialized from a remote store, each chunk
    /// checked against its BLAKE3 id); their SHA-256s are checked before a process is restored
    /// from them (a fork verifies beside its first stages).
    pub fn check_shape(&self, m: &Manifest) -> Result<()> {
        self.check_files(m, false)
    }

    fn check_files(&self, m: &Manifest, hash: bool) -> Result<()> {
        if let Some(p) = &m.procs {
            let dir = self.proc_dir(p.id);
            // Every name is checked before any is joined to a path: a manifest from elsewhere
            // (a remote store) naming `../../etc/shadow` must not make this read a host file.
            let mut expected: BTreeSet<&str> = BTreeSet::new();
            for f in &p.files {
                crate::manifest::check_image_name(&f.name)
                    .map_err(|why| CheckpointError::corrupt(&dir, why))?;
                if !expected.insert(f.name.as_str()) {
                    return Err(CheckpointError::corrupt(
                        &dir,
                        format!("image file {:?} is listed twice", f.name),
                    ));
                }
            }
            if !dir.is_dir() {
                return Err(CheckpointError::corrupt(&dir, "process image directory is missing"));
            }
            for name in list_names(&dir)? {
                if !expected.contains(name.as_str()) {
                    return Err(CheckpointError::corrupt(
                        &dir.join(&name),
                        "file is not part of the recorded process image",
                    ));
                }
            }
            for f in &p.files {
                let path = dir.join(&f.name);
                // A regular file of the directory itself (no symlink followed, no device
                // read), hashed no further than one byte past its recorded size.
                let found =
                    if hash { hash_image_file(&path, f.size)? } else { regular_size(&path)? };
                let (size, sha) = match found {
                    Some(hashed) => hashed,
                    None => return Err(CheckpointError::corrupt(&path, "image file is missing")),
                };
                if size > f.size {
                    return Err(CheckpointError::corrupt(
                        &path,
                        format!("file is larger than the manifest's {} bytes", f.size),
                    ));
                }
                if size != f.size {
                    return Err(CheckpointError::corrupt(
                        &path,
                        format!("size is {size} bytes, the manifest says {}", f.size),
                    ));
                }
                if hash && sha != f.sha256 {
                    return Err(CheckpointError::corrupt(
                        &path,
                        format!("SHA-256 is {sha}, the manifest says {}", f.sha256),
                    ));
                }
            }
        }
        if let Some(f) = &m.fs {
            let path = self.fs_path(f.id);
            if !self.fs.is_snapshot(&path) {
                return Err(CheckpointError::corrupt(&path, "filesystem snapshot is missing"));
            }
        }
        Ok(())
    }

    /// Flush the filesystem holding the store (`syncfs`).
    pub fn sync(&self) -> Result<()> {
        syncfs(&self.dir)
    }

    /// Begin a checkpoint: new parts are staged under `tmp/` until [`Staging::publish`].
    pub fn begin(&self) -> Staging<'_> {
        Staging { store: self, proc: None, fs: None, published: false }
    }

    /// Remove leftovers of interrupted work: everything under `tmp/`, temporary manifests, and
    /// parts that no manifest references. Call with the store's [`StoreLock`] held (staged parts
    /// of an operation in flight look exactly like leftovers). When some manifest is
    /// unreadable, unreferenced parts are kept (they might belong to it) and a warning is
    /// logged.
    pub fn recover_leftovers(&self) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let tmp = self.tmp_dir();
        for name in list_names(&tmp)? {
            let p = tmp.join(&name);
            self.delete_settled(&p).map_err(|e| CheckpointError::io("delete", &p, e))?;
            report.removed.push(p);
        }
        for name in list_names(&self.points_dir())? {
            if name.ends_with(".tmp") {
                let p = self.points_dir().join(&name);
                std::fs::remove_file(&p).map_err(|e| CheckpointError::io("unlink", &p, e))?;
                report.removed.push(p);
            }
        }
        let all = self.list_all()?;
        if all.iter().any(|(_, m)| m.is_err()) {
            tracing::warn!(sandbox = %self.sandbox, "unreadable manifests present; keeping unreferenced parts");
        } else {
            let manifests: Vec<Manifest> = all.into_iter().filter_map(|(_, m)| m.ok()).collect();
            let (procs, fs) = self.delete_unreferenced(&manifests)?;
            report.removed.extend(procs.into_iter().map(|id| self.proc_dir(id)));
            report.removed.extend(fs.into_iter().map(|id| self.fs_path(id)));
        }
        if !report.removed.is_empty() {
            tracing::info!(sandbox = %self.sandbox, removed = report.removed.len(), "discarded checkpoint leftovers");
        }
        self.rescan()?;
        Ok(report)
    }

    /// Delete a staged leftover. A CRIU orphaned by a killed daemon may still be writing into
    /// it for a moment (it gives up once it notices its peer is gone), so "directory not
    /// empty" is retried for up to [`SETTLE_TIMEOUT`] before it is an error.
    fn delete_settled(&self, p: &Path) -> std::io::Result<()> {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            match self.fs.delete(p) {
                Err(e)
                    if e.kind() == std::io::ErrorKind::DirectoryNotEmpty
                        && Instant::now() < deadline =>
                {
                    tracing::debug!(path = %p.display(), "leftover still being written; retrying its removal");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                r => return r,
            }
        }
    }

    /// Delete the process images and filesystem snapshots no manifest in `kept` references;
    /// returns their ids (used by pruning and by start-up recovery).
    fn delete_unreferenced(&self, kept: &[Manifest]) -> Result<(Vec<ProcId>, Vec<FsId>)> {
        let (procs, fs) = self.unreferenced(kept)?;
        for p in
            procs.iter().map(|id| self.proc_dir(*id)).chain(fs.iter().map(|id| self.fs_path(*id)))
        {
            self.fs.delete(&p).map_err(|e| CheckpointError::io("delete", &p, e))?;
        }
        Ok((procs, fs))
    }

    /// Parts on disk that none of `kept` references.
    fn unreferenced(&self, kept: &[Manifest]) -> Result<(Vec<ProcId>, Vec<FsId>)> {
        let used_p: BTreeSet<ProcId> =
            kept.iter().filter_map(|m| m.procs.as_ref().map(|p| p.id)).collect();
        let used_f: BTreeSet<FsId> =
            kept.iter().filter_map(|m| m.fs.as_ref().map(|f| f.id)).collect();
        let procs = list_names(&self.procs_dir())?
            .iter()
            .filter_map(|n| parse_seq(n, ProcId::PREFIX, "").map(ProcId))
            .filter(|id| !used_p.contains(id))
            .collect();
        let fs = list_names(&self.fs_dir())?
            .iter()
            .filter_map(|n| parse_seq(n, FsId::PREFIX, "").map(FsId))
            .filter(|id| !used_f.contains(id))
            .collect();
        Ok((procs, fs))
    }

    /// Keep the newest `keep_last` points (at least one) and delete the others, then every
    /// part no kept point references. Unreadable manifests count as points (oldest first) and
    /// are removed when outside the window; while one is kept, no part is deleted.
    pub fn prune(&self, keep_last: usize) -> Result<PruneReport> {
        if keep_last == 0 {
            return Err(CheckpointError::Invalid(
                "--keep-last must be at least 1 (the newest point is always kept)".into(),
            ));
        }
        let all = self.list_all()?;
        let cut = all.len().saturating_sub(keep_last);
        let mut report = PruneReport::default();
        // Manifests first: once a point is gone, its parts are merely unreferenced.
        for (id, _) in &all[..cut] {
            let p = self.manifest_path(*id);
            std::fs::remove_file(&p).map_err(|e| CheckpointError::io("unlink", &p, e))?;
            report.points.push(*id);
        }
        manifest::fsync_dir(&self.points_dir())?;
        let kept = &all[cut..];
        if kept.iter().any(|(_, m)| m.is_err()) {
            tracing::warn!(sandbox = %self.sandbox, "an unreadable manifest is kept; not deleting parts");
            return Ok(report);
        }
        let kept: Vec<Manifest> =
            kept.iter().filter_map(|(_, m)| m.as_ref().ok().cloned()).collect();
        let (procs, fs) = self.delete_unreferenced(&kept)?;
        report.procs.extend(procs);
        report.fs.extend(fs);
        Ok(report)
    }

    /// Delete every restore point and part of this sandbox, and the store's directory.
    pub fn remove_all(&self) -> Result<()> {
        for sub in [self.tmp_dir(), self.fs_dir()] {
            for name in list_names(&sub)? {
                let p = sub.join(name);
                self.fs.delete(&p).map_err(|e| CheckpointError::io("delete", &p, e))?;
            }
        }
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CheckpointError::io("remove", &self.dir, e)),
        }
    }

    fn next_point(&self) -> PointId {
        let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        c.point += 1;
        PointId(c.point)
    }
    fn next_proc(&self) -> ProcId {
        let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        c.proc += 1;
        ProcId(c.proc)
    }
    fn next_fs(&self) -> FsId {
        let mut c = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        c.fs += 1;
        FsId(c.fs)
    }
}

/// A checkpoint in progress: staged parts under `tmp/`. Dropped unpublished, it deletes them.
#[derive(Debug)]
pub struct Staging<'a> {
    store: &'a Store,
    proc: Option<(ProcId, PathBuf)>,
    fs: Option<(FsId, PathBuf)>,
    published: bool,
}

impl Staging<'_> {
    /// Create (once) and return the staged process-image directory, for CRIU to dump into.
    pub fn proc_dir(&mut self) -> Result<PathBuf> {
        if let Some((_, p)) = &self.proc {
            return Ok(p.clone());
        }
        let id = self.store.next_proc();
        let p = self.store.tmp_dir().join(id.to_string());
        std::fs::create_dir(&p).map_err(|e| CheckpointError::io("mkdir", &p, e))?;
        self.proc = Some((id, p.clone()));
        Ok(p)
    }

    /// Drop the staged process image (a dump that failed half-way), so that the checkpoint can
    /// still publish its filesystem part.
    pub fn discard_proc(&mut self) -> Result<()> {
        if let Some((_, p)) = self.proc.take() {
            match std::fs::remove_dir_all(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(CheckpointError::io("remove", &p, e)),
            }
        }
        Ok(())
    }

    /// The path (not yet existing) at which to take the staged filesystem snapshot. It is
    /// its final place, `fs/<id>`: btrfs cannot move a read-only subvolume to another
    /// directory. Until the manifest is published it is merely unreferenced, which
    /// [`Store::recover_leftovers`] and [`Store::prune`] clean up.
    pub fn fs_path(&mut self) -> PathBuf {
        if let Some((_, p)) = &self.fs {
            return p.clone();
        }
        let id = self.store.next_fs();
        let p = self.store.fs_path(id);
        self.fs = Some((id, p.clone()));
        p
    }

    /// Take the staged filesystem snapshot of `src` (read-only).
    pub fn snapshot_fs(&mut self, src: &Path) -> Result<PathBuf> {
        let dst = self.fs_path();
        self.store
            .fs
            .snapshot(src, &dst, true)
            .map_err(|e| CheckpointError::io("snapshot", &dst, e))?;
        Ok(dst)
    }

    /// Stage the filesystem snapshot as a writable snapshot of `src` that `edit` changes before
    /// it is sealed read-only: a tree that differs from `src` in a few files (a fork branch's
    /// first point, made from its source point's tree after the branch runs, since the
    /// branch's own root is then no longer as it was). Discarded with the staging when
    /// anything fails.
    pub fn snapshot_fs_edited(
        &mut self,
        src: &Path,
        edit: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<PathBuf> {
        let dst = self.fs_path();
        self.store
            .fs
            .snapshot(src, &dst, false)
            .map_err(|e| CheckpointError::io("snapshot", &dst, e))?;
        edit(&dst)?;
        self.store.fs.seal(&dst).map_err(|e| CheckpointError::io("set read-only", &dst, e))?;
        Ok(dst)
    }

    /// Publish the restore point: hash and sync the staged image, move the staged parts into
    /// place, then write the manifest atomically. Parts not staged are inherited from the
    /// newest point (the parent), except the process image when `draft.no_procs`.
    pub fn publish(mut self, draft: Draft) -> Result<Manifest> {
        let store = self.store;
        let parent = match draft.base {
            Some(id) => Some(store.load(id)?),
            None => match store.newest() {
                Ok(m) => Some(m),
                Err(CheckpointError::NoPoints { .. }) => None,
                Err(e) => return Err(e),
            },
        };
        let has_proc = self.proc.is_some();
        let has_fs = self.fs.as_ref().is_some_and(|(_, p)| store.fs.is_snapshot(p));
        let (need_proc, need_fs) = (draft.kind.new_procs(), draft.kind.new_fs());
        if need_proc != has_proc || need_fs != has_fs {
            return Err(CheckpointError::Invalid(format!(
                "a {} checkpoint needs {}a process image and {}a filesystem snapshot staged",
                draft.kind.as_str(),
                if need_proc { "" } else { "no " },
                if need_fs { "" } else { "no " },
            )));
        }
        if !(need_proc || need_fs) && parent.is_none() {
            return Err(CheckpointError::Invalid(format!(
                "a {} point needs an earlier restore point to reference",
                draft.kind.as_str()
            )));
        }

        // Image files must be durable before a manifest can point at them: one syncfs of the
        // pool, overlapped with hashing them (both only read what CRIU wrote).
        let ((procs, hash_us), sync_us) = beside_syncfs(&store.dir, self.proc.is_some(), || {
            let hash_start = Instant::now();
            let procs = match &self.proc {
                Some((id, dir)) => {
                    let mut files = Vec::new();
                    let mut bytes = 0;
                    let names = list_names(dir)?;
                    match &draft.trusted_files {
                        Some(known) => {
                            let mut known = known.clone();
                            known.sort_by(|a, b| a.name.cmp(&b.name));
                            if known.iter().map(|f| &f.name).ne(names.iter()) {
                                return Err(CheckpointError::corrupt(
                                    dir,
                                    "staged image files differ from the ones given",
                                ));
                            }
                            for f in known {
                                let path = dir.join(&f.name);
                                let meta = std::fs::metadata(&path)
                                    .map_err(|e| CheckpointError::io("stat", &path, e))?;
                                if meta.len() != f.size {
                                    return Err(CheckpointError::corrupt(
                                        &path,
                                        format!("size is {}, expected {}", meta.len(), f.size),
                                    ));
                                }
                                bytes += f.size;
                                files.push(f);
                            }
                        }
                        None => {
                            for name in names {
                                let (size, sha256) = hash_file(&dir.join(&name))?;
                                bytes += size;
                                files.push(ImageFile { name, size, sha256 });
                            }
                        }
                    }
                    Some(ProcPart {
                        id: *id,
                        created_at_ms: now_ms(),
                        root_pid: draft.root_pid,
                        criu_version: draft.criu_version.clone(),
                        files,
                        bytes,
                    })
                }
                None if draft.no_procs => None,
                None => parent.as_ref().and_then(|p| p.procs.clone()),
            };
            Ok((procs, us(hash_start.elapsed())))
        })?;
        let fs = match &self.fs {
            Some((id, _)) => Some(FsPart {
                id: *id,
                created_at_ms: now_ms(),
                delta_bytes: draft.fs_delta_bytes,
                generation: draft.fs_generation,
                written_bytes: draft.fs_written_bytes,
            }),
            None => parent.as_ref().and_then(|p| p.fs.clone()),
        };

        if let Some((id, src)) = &self.proc {
            let dst = store.proc_dir(*id);
            std::fs::rename(src, &dst).map_err(|e| CheckpointError::io("rename", src, e))?;
        }
        // From here on the parts live in procs/ and fs/; a failure below leaves them
        // unreferenced, for recover_leftovers or prune.
        let (new_proc, new_fs) = (self.proc.take().is_some(), self.fs.take().is_some());
        // Only a directory that got a new entry needs its fsync: a skip point (and the part a
        // point reuses) adds nothing there, and every earlier point synced its own entries.
        let t_dir = Instant::now();
        if new_proc {
            manifest::fsync_dir(&store.procs_dir())?;
        }
        if new_fs {
            manifest::fsync_dir(&store.fs_dir())?;
        }
        let dir_sync_us = us(t_dir.elapsed());

        let mut timings = draft.timings.clone();
        timings.hash_us = Some(hash_us);
        timings.sync_us = Some(sync_us);
        timings.dir_sync_us = Some(dir_sync_us);
        let id = store.next_point();
        let mut m = Manifest {
            id,
            sandbox: store.sandbox.clone(),
            turn: draft.turn,
            kind: draft.kind,
            parent: parent.as_ref().map(|p| p.id),
            origin: draft.origin.clone(),
            created_at_ms: now_ms(),
            conversation_offset: draft.conversation_offset,
            fs,
            procs,
            timings,
            sandbox_meta: draft.sandbox_meta.clone(),
            procs_missing: draft.procs_missing.clone(),
        };
        m.timings.total_us = draft.started.map(|s| us(s.elapsed()));
        manifest::write_atomic(&store.manifest_path(id), &manifest::encode(&m))?;
        self.published = true;
        tracing::debug!(sandbox = %store.sandbox, point = %id, kind = m.kind.as_str(), "restore point published");
        Ok(m)
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if self.published {
            return;
        }
        if let Some((_, p)) = self.proc.take() {
            if let Err(e) = self.store.fs.delete(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot discard staged process image");
            }
        }
        if let Some((_, p)) = self.fs.take() {
            if p.exists() {
                if let Err(e) = self.store.fs.delete(&p) {
                    tracing::warn!(path = %p.display(), error = %e, "cannot discard staged snapshot");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_file_is_hashed_again_once_it_changed_and_only_then() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pages-1.img");
        std::fs::write(&p, b"first bytes").unwrap();
        // A file that changed just now is hashed but not remembered (its ctime could be the
        // next change's too).
        let first = hash_image_file(&p, 100).unwrap().unwrap();
        assert_eq!(first, hash_file(&p).unwrap());
        let key = {
            use std::os::unix::fs::MetadataExt as _;
            let m = std::fs::metadata(&p).unwrap();
            (m.dev(), m.ino())
        };
        assert!(!crab_common::sync::lock(&VERIFIED).contains_key(&key), "remembered too soon");
        std::thread::sleep(SETTLED + std::time::Duration::from_millis(50));
        assert_eq!(hash_image_file(&p, 100).unwrap().unwrap(), first);
        assert!(crab_common::sync::lock(&VERIFIED).contains_key(&key), "a settled file's hash");
        assert_eq!(hash_image_file(&p, 100).unwrap().unwrap(), first);
        // Same size, other bytes: a write changes the stamp, so the new bytes are hashed.
        std::fs::write(&p, b"other bytes").unwrap();
        let second = hash_image_file(&p, 100).unwrap().unwrap();
        assert_eq!(second, hash_file(&p).unwrap());
        assert_ne!(second.1, first.1, "a changed image file answered from the remembered hash");
        // Too long for the manifest: never answered from memory as fitting.
        std::thread::sleep(SETTLED + std::time::Duration::from_millis(50));
        assert_eq!(hash_image_file(&p, 100).unwrap().unwrap(), second);
        assert_eq!(hash_image_file(&p, 4).unwrap().unwrap().0, 11, "its real size");
    }
}
