//! Reading and vetting CRIU's process images before they are restored.
//!
//! A restore hands CRIU a directory of images and CRIU gives every restored task exactly the
//! credentials and seccomp filters those images describe: the capability sets, ids, securebits
//! and `no_new_privs` of `core-<tid>.img` (`thread_core.creds`), the filter chains of
//! `seccomp.img`, the namespaces the ids of `ids-<pid>.img` say the tasks had (compared with
//! `inventory.img`'s `root_ids`), and the mounts of `mountpoints-<mnt_ns_id>.img`. Images this
//! host dumped itself describe what the profile gave the dumped tasks; images from anywhere
//! else (a remote store) can say anything. [`check_dir`] reads a directory's images the way
//! `criu restore` will — `pstree.img` for the tasks and their threads, each task's
//! `ids-<pid>.img`, each thread's `core-<tid>.img`, `seccomp.img`, `inventory.img`, the mount
//! table — and refuses, naming the task (its pid in the images) or the mountpoint, the field
//! and its value, any thread whose credentials exceed a [`Policy`] or whose seccomp chain does
//! not hold each of the policy's filters byte for byte, any mount the [`MountPolicy`] does not
//! name, and any image layout CRIU would read differently (the
//! pre-thread-creds `creds-<pid>.img`, the per-task `old_seccomp_*` fields, a filter chain
//! that loops). The format: every image but `inventory.img` begins with two little-endian u32
//! magics (`IMG_COMMON_MAGIC`, then the image type's; `inventory.img` has only its own), then
//! entries of a u32 length and a protobuf message (`images/*.proto` of CRIU 4.2). The message
//! structs below are hand-written `prost` mirrors of just the fields the check reads, with
//! CRIU's field numbers (unknown fields are skipped on decode); every field is `optional`
//! here so that an absent required field is seen, not defaulted.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// `IMG_COMMON_MAGIC` (`criu/include/magic.h`).
pub const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// `INVENTORY_MAGIC`.
pub const INVENTORY_MAGIC: u32 = 0x5831_3116;
/// `PSTREE_MAGIC`.
pub const PSTREE_MAGIC: u32 = 0x5027_3030;
/// `CORE_MAGIC`.
pub const CORE_MAGIC: u32 = 0x5505_3847;
/// `IDS_MAGIC` (`ids-<pid>.img`: a task's namespace ids, what a restore reads them from).
pub const IDS_MAGIC: u32 = 0x5443_2030;
/// `MNTS_MAGIC` (`mountpoints-<mnt_ns_id>.img`: a mount namespace's mount table).
pub const MNTS_MAGIC: u32 = 0x5556_3928;
/// `fstype.PROC` (`images/mnt.proto`).
pub const FSTYPE_PROC: u32 = 1;
/// `fstype.TMPFS`.
pub const FSTYPE_TMPFS: u32 = 5;
/// `fstype.DEVPTS`.
pub const FSTYPE_DEVPTS: u32 = 6;
/// `fstype.DEVTMPFS` (a host device node bound into a user-namespaced sandbox's `/dev`).
pub const FSTYPE_DEVTMPFS: u32 = 3;
/// `USERNS_MAGIC` (`userns-<id>.img`: a user namespace's id maps).
pub const USERNS_MAGIC: u32 = 0x5547_4906;
/// `MS_RDONLY`.
pub const MS_RDONLY: u32 = 1;
/// `SECCOMP_MAGIC`.
pub const SECCOMP_MAGIC: u32 = 0x6441_3049;

/// `SECCOMP_MODE_FILTER` (`seccomp_mode.filter` in `core.proto`).
pub const SECCOMP_MODE_FILTER: i32 = 2;
/// `SECCOMP_FILTER_FLAG_TSYNC`.
pub const SECCOMP_FILTER_FLAG_TSYNC: u32 = 1;
/// `SECCOMP_FILTER_FLAG_NEW_LISTENER`: a filter restored with it hands CRIU's restorer a
/// user-notification descriptor; never part of a filter Crab or a sandbox process restores.
pub const SECCOMP_FILTER_FLAG_NEW_LISTENER: u32 = 1 << 3;
/// `TASK_DEAD` (`compel/task-state.h`): a zombie, restored as an exited task.
pub const TASK_DEAD: u32 = 0x2;
/// The securebits the kernel defines (`SECBIT_NOROOT` … `SECBIT_EXEC_DENY_INTERACTIVE_LOCKED`,
/// bits 0–11); anything above is not a securebit and refused.
pub const KNOWN_SECBITS: u32 = 0xfff;

/// `creds_entry` (`images/creds.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CredsEntry {
    /// Real uid.
    #[prost(uint32, optional, tag = "1")]
    pub uid: Option<u32>,
    /// Real gid.
    #[prost(uint32, optional, tag = "2")]
    pub gid: Option<u32>,
    /// Effective uid.
    #[prost(uint32, optional, tag = "3")]
    pub euid: Option<u32>,
    /// Effective gid.
    #[prost(uint32, optional, tag = "4")]
    pub egid: Option<u32>,
    /// Saved uid.
    #[prost(uint32, optional, tag = "5")]
    pub suid: Option<u32>,
    /// Saved gid.
    #[prost(uint32, optional, tag = "6")]
    pub sgid: Option<u32>,
    /// Filesystem uid.
    #[prost(uint32, optional, tag = "7")]
    pub fsuid: Option<u32>,
    /// Filesystem gid.
    #[prost(uint32, optional, tag = "8")]
    pub fsgid: Option<u32>,
    /// Inheritable capabilities, 32-bit words, lowest first.
    #[prost(uint32, repeated, packed = "false", tag = "9")]
    pub cap_inh: Vec<u32>,
    /// Permitted capabilities.
    #[prost(uint32, repeated, packed = "false", tag = "10")]
    pub cap_prm: Vec<u32>,
    /// Effective capabilities.
    #[prost(uint32, repeated, packed = "false", tag = "11")]
    pub cap_eff: Vec<u32>,
    /// Bounding set.
    #[prost(uint32, repeated, packed = "false", tag = "12")]
    pub cap_bnd: Vec<u32>,
    /// Securebits.
    #[prost(uint32, optional, tag = "13")]
    pub secbits: Option<u32>,
    /// Supplementary groups.
    #[prost(uint32, repeated, packed = "false", tag = "14")]
    pub groups: Vec<u32>,
    /// LSM profile.
    #[prost(string, optional, tag = "15")]
    pub lsm_profile: Option<String>,
    /// `no_new_privs` (1 = set).
    #[prost(uint32, optional, tag = "18")]
    pub no_new_privs: Option<u32>,
    /// Ambient capabilities.
    #[prost(uint32, repeated, packed = "false", tag = "19")]
    pub cap_amb: Vec<u32>,
}

/// `seccomp_filter` (`images/seccomp.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SeccompFilter {
    /// The program: `struct sock_filter` array as the kernel returned it.
    #[prost(bytes = "vec", optional, tag = "1")]
    pub filter: Option<Vec<u8>>,
    /// Index of the filter installed before this one.
    #[prost(uint32, optional, tag = "2")]
    pub prev: Option<u32>,
    /// `SECCOMP_FILTER_FLAG_*` it is restored with.
    #[prost(uint32, optional, tag = "3")]
    pub flags: Option<u32>,
}

/// `seccomp_entry`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SeccompEntry {
    /// Every filter of the tree, chained by `prev`.
    #[prost(message, repeated, tag = "1")]
    pub seccomp_filters: Vec<SeccompFilter>,
}

/// `pstree_entry` (`images/pstree.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PstreeEntry {
    /// Pid (in the dumped pid namespace).
    #[prost(uint32, optional, tag = "1")]
    pub pid: Option<u32>,
    /// Parent pid.
    #[prost(uint32, optional, tag = "2")]
    pub ppid: Option<u32>,
    /// Thread ids.
    #[prost(uint32, repeated, packed = "false", tag = "5")]
    pub threads: Vec<u32>,
}

/// `task_kobj_ids_entry` (`images/core.proto`): namespace ids (small numbers CRIU assigns per
/// dump; equal ids = the same namespace).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TaskKobjIdsEntry {
    /// pid namespace.
    #[prost(uint32, optional, tag = "5")]
    pub pid_ns_id: Option<u32>,
    /// net namespace.
    #[prost(uint32, optional, tag = "6")]
    pub net_ns_id: Option<u32>,
    /// ipc namespace.
    #[prost(uint32, optional, tag = "7")]
    pub ipc_ns_id: Option<u32>,
    /// uts namespace.
    #[prost(uint32, optional, tag = "8")]
    pub uts_ns_id: Option<u32>,
    /// mount namespace.
    #[prost(uint32, optional, tag = "9")]
    pub mnt_ns_id: Option<u32>,
    /// user namespace.
    #[prost(uint32, optional, tag = "10")]
    pub user_ns_id: Option<u32>,
    /// cgroup namespace.
    #[prost(uint32, optional, tag = "11")]
    pub cgroup_ns_id: Option<u32>,
    /// time namespace.
    #[prost(uint32, optional, tag = "12")]
    pub time_ns_id: Option<u32>,
}

/// `task_core_entry`: only what the check reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TaskCoreEntry {
    /// `TASK_ALIVE`, `TASK_DEAD`, …
    #[prost(uint32, optional, tag = "1")]
    pub task_state: Option<u32>,
    /// Deprecated per-task seccomp mode; when present CRIU uses it for the thread.
    #[prost(int32, optional, tag = "11")]
    pub old_seccomp_mode: Option<i32>,
    /// Deprecated per-task filter index; likewise.
    #[prost(uint32, optional, tag = "12")]
    pub old_seccomp_filter: Option<u32>,
}

/// `thread_core_entry`: only what the check reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ThreadCoreEntry {
    /// The thread's credentials.
    #[prost(message, optional, tag = "10")]
    pub creds: Option<CredsEntry>,
    /// `seccomp_mode` (0 disabled, 1 strict, 2 filter).
    #[prost(int32, optional, tag = "11")]
    pub seccomp_mode: Option<i32>,
    /// Index into `seccomp.img` of the thread's newest filter.
    #[prost(uint32, optional, tag = "12")]
    pub seccomp_filter: Option<u32>,
}

/// `core_entry`: only what the check reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CoreEntry {
    /// Architecture.
    #[prost(int32, optional, tag = "1")]
    pub mtype: Option<i32>,
    /// Per-task part (the leader's core).
    #[prost(message, optional, tag = "3")]
    pub tc: Option<TaskCoreEntry>,
    /// Namespace (and other kernel object) ids; a restore reads them from `ids-<pid>.img`.
    #[prost(message, optional, tag = "4")]
    pub ids: Option<TaskKobjIdsEntry>,
    /// Per-thread part.
    #[prost(message, optional, tag = "5")]
    pub thread_core: Option<ThreadCoreEntry>,
}

/// `mnt_entry` (`images/mnt.proto`): only what the check reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MntEntry {
    /// `fstype` (`FSTYPE_*`; 0 = unsupported, mounted by `fsname`).
    #[prost(uint32, optional, tag = "1")]
    pub fstype: Option<u32>,
    /// Mount id.
    #[prost(uint32, optional, tag = "2")]
    pub mnt_id: Option<u32>,
    /// Parent mount id.
    #[prost(uint32, optional, tag = "4")]
    pub parent_mnt_id: Option<u32>,
    /// `MS_*` mount flags.
    #[prost(uint32, optional, tag = "5")]
    pub flags: Option<u32>,
    /// The mounted directory of the filesystem.
    #[prost(string, optional, tag = "6")]
    pub root: Option<String>,
    /// Where it is mounted (in the namespace).
    #[prost(string, optional, tag = "7")]
    pub mountpoint: Option<String>,
    /// Source.
    #[prost(string, optional, tag = "8")]
    pub source: Option<String>,
    /// An external mount.
    #[prost(bool, optional, tag = "13")]
    pub ext_mount: Option<bool>,
    /// Filesystem name for `fstype` 0.
    #[prost(string, optional, tag = "14")]
    pub fsname: Option<String>,
    /// The external mount's key.
    #[prost(string, optional, tag = "18")]
    pub ext_key: Option<String>,
}

/// `uid_gid_extent` (`images/userns.proto`): ids `first..first+count` inside are
/// `lower_first..` in the parent namespace.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UidGidExtent {
    /// First id inside.
    #[prost(uint32, required, tag = "1")]
    pub first: u32,
    /// First id outside.
    #[prost(uint32, required, tag = "2")]
    pub lower_first: u32,
    /// How many.
    #[prost(uint32, required, tag = "3")]
    pub count: u32,
}

/// `userns_entry`: a user namespace's `uid_map` and `gid_map`, which a restore writes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UsernsEntry {
    /// `uid_map` lines.
    #[prost(message, repeated, tag = "1")]
    pub uid_map: Vec<UidGidExtent>,
    /// `gid_map` lines.
    #[prost(message, repeated, tag = "2")]
    pub gid_map: Vec<UidGidExtent>,
}

/// `inventory_entry`: only what the check reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InventoryEntry {
    /// Image format version.
    #[prost(uint32, optional, tag = "1")]
    pub img_version: Option<u32>,
    /// The dumping CRIU's own namespace ids: a task namespace equal to one of them was not
    /// the tree's own (a restore puts the tasks into the restoring CRIU's).
    #[prost(message, optional, tag = "3")]
    pub root_ids: Option<TaskKobjIdsEntry>,
}

/// What the tasks of restored images may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Capabilities (bit n = capability n) every set — inheritable, permitted, effective,
    /// bounding, ambient — must stay within.
    pub caps: u64,
    /// The ids (uid/gid, all eight, and supplementary groups) tasks may run as.
    pub ids: IdRange,
    /// `no_new_privs` must be set.
    pub no_new_privs: bool,
    /// Securebits that must be set (the profile's; today none). Bits outside
    /// [`KNOWN_SECBITS`] are refused whatever this says.
    pub secbits: u32,
    /// The seccomp programs every thread's chain must begin with (oldest first), each the
    /// raw `sock_filter` array this host installs; filters installed after them (by the
    /// sandbox's own processes) can only restrict further and are allowed, without
    /// [`SECCOMP_FILTER_FLAG_NEW_LISTENER`].
    pub seccomp: Vec<Vec<u8>>,
    /// Namespaces the tree must have of its own, and which it must not.
    pub namespaces: NsPolicy,
    /// The mount table the tree's mount namespace may have (`None`: not checked).
    pub mounts: Option<MountPolicy>,
}

/// The mount table of a sandbox's mount namespace: its root (which a restore replaces by its
/// own `root`, whatever the image says) and only mounts its [`MountRule`]s name, each at most
/// once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountPolicy {
    /// The mounts allowed besides the root.
    pub rules: Vec<MountRule>,
    /// The only external-mount key allowed (on a rule with `external`).
    pub ext_key: String,
}

/// One mountpoint a sandbox may have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRule {
    /// The mountpoint, exactly as in the image.
    pub path: String,
    /// Its `fstype`.
    pub fstype: u32,
    /// It must be read-only (`MS_RDONLY`).
    pub readonly: bool,
    /// It must be there (a masked or read-only path this kernel has).
    pub required: bool,
    /// It may be the external mount of [`MountPolicy::ext_key`] (or of its own `ext_key`).
    pub external: bool,
    /// The external-mount key it may have instead of the policy's (a device node bound
    /// from the host).
    pub ext_key: Option<String>,
}

/// Ids a restored task may have: pluggable for a coming user-namespace range (sandboxes run
/// as host root today).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdRange {
    /// Any id.
    Any,
    /// `first .. first + count`.
    Range {
        /// First id.
        first: u32,
        /// How many.
        count: u32,
    },
}

impl IdRange {
    /// Whether `id` is in the range.
    pub fn contains(&self, id: u32) -> bool {
        match *self {
            IdRange::Any => true,
            IdRange::Range { first, count } => {
                id >= first && u64::from(id) < u64::from(first) + u64::from(count)
            }
        }
    }
}

/// Namespace rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NsPolicy {
    /// The tree must have its own network namespace (every mode but `host`).
    pub own_net: bool,
    /// `Some`: the tree must have its own user namespace mapping exactly these ids (a
    /// restore writes the images' maps: any other would hand the sandbox other host ids, the
    /// host's root among them); `None`: it must have none.
    pub userns: Option<UsernsMap>,
}

/// One user namespace's maps: ids `0..count` inside are `uid..` / `gid..` on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsernsMap {
    /// Host uid of uid 0 inside.
    pub uid: u32,
    /// Host gid of gid 0 inside.
    pub gid: u32,
    /// How many ids.
    pub count: u32,
}

/// Why images were refused or could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The mount table holds what the policy does not allow.
    #[error("mount {mountpoint}: {field} = {value} is not allowed ({allowed})")]
    Mount {
        /// The mountpoint (in the sandbox).
        mountpoint: String,
        /// The field, as in `mnt_entry` (`flags`, `fstype`, …).
        field: String,
        /// Its value.
        value: String,
        /// What is allowed.
        allowed: String,
    },
    /// A task's images grant what the policy does not allow.
    #[error("task {pid} (thread {tid}): {field} = {value} is not allowed ({allowed})")]
    Refused {
        /// The task's pid in the images.
        pid: u32,
        /// The thread's id (= pid for the leader).
        tid: u32,
        /// The field, as in CRIU's images (`creds.cap_eff`, `seccomp_mode`, …).
        field: String,
        /// Its value.
        value: String,
        /// What is allowed.
        allowed: String,
    },
    /// An image is not what CRIU would read as intended.
    #[error("CRIU image {}: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An image could not be read.
    #[error("read CRIU image {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

impl ImageError {
    fn malformed(path: &Path, reason: impl Into<String>) -> ImageError {
        ImageError::Malformed { path: path.to_path_buf(), reason: reason.into() }
    }
}

/// What a passing check saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checked {
    /// Tasks (pstree entries).
    pub tasks: usize,
    /// Threads whose creds and seccomp were checked (zombies have none).
    pub threads: usize,
    /// Filters in `seccomp.img`.
    pub filters: usize,
}

/// The entries of image `path` (after its magics), each decoded as `M`.
pub fn read_entries<M: prost::Message + Default>(
    path: &Path,
    magic: u32,
) -> Result<Vec<M>, ImageError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| ImageError::Io { path: path.to_path_buf(), source };
    // Images may come from anywhere: a symlink is not followed, a fifo or device not waited
    // on, and no more than `MAX_IMAGE_BYTES` is read.
    let mut f = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(ImageError::malformed(path, "not a regular file"));
    }
    if meta.len() > MAX_IMAGE_BYTES {
        return Err(ImageError::malformed(
            path,
            format!(
                "{} bytes, more than the {MAX_IMAGE_BYTES} an image of creds may have",
                meta.len()
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.by_ref().take(MAX_IMAGE_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    decode_entries(&bytes, magic, path)
}

/// Largest image [`read_entries`] reads (the images it reads — inventory, pstree, ids, core,
/// seccomp, mountpoints — are kilobytes; memory pages are never read here).
const MAX_IMAGE_BYTES: u64 = 64 << 20;

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// The entries of an image's bytes (see [`read_entries`]); `path` names it in errors.
pub fn decode_entries<M: prost::Message + Default>(
    bytes: &[u8],
    magic: u32,
    path: &Path,
) -> Result<Vec<M>, ImageError> {
    let mut at = 0;
    if magic != INVENTORY_MAGIC {
        match u32_at(bytes, 0) {
            Some(IMG_COMMON_MAGIC) => at = 4,
            other => {
                return Err(ImageError::malformed(
                    path,
                    format!("head magic {other:x?}, want {IMG_COMMON_MAGIC:#x}"),
                ))
            }
        }
    }
    match u32_at(bytes, at) {
        Some(m) if m == magic => at += 4,
        other => {
            return Err(ImageError::malformed(path, format!("magic {other:x?}, want {magic:#x}")))
        }
    }
    let mut out = Vec::new();
    while at < bytes.len() {
        let len = u32_at(bytes, at).ok_or_else(|| {
            ImageError::malformed(path, format!("truncated entry size at byte {at}"))
        })? as usize;
        at += 4;
        let body = at.checked_add(len).and_then(|end| bytes.get(at..end)).ok_or_else(|| {
            ImageError::malformed(
                path,
                format!("entry of {len} bytes at byte {at} runs past the end"),
            )
        })?;
        out.push(
            M::decode(body)
                .map_err(|e| ImageError::malformed(path, format!("entry at byte {at}: {e}")))?,
        );
        at += len;
    }
    Ok(out)
}

/// Encode `entries` as an image with `magic` (the inverse of [`decode_entries`]).
pub fn encode_entries<M: prost::Message>(entries: &[M], magic: u32) -> Vec<u8> {
    let mut out = Vec::new();
    if magic != INVENTORY_MAGIC {
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
    }
    out.extend_from_slice(&magic.to_le_bytes());
    for e in entries {
        let body = e.encode_to_vec();
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
    }
    out
}

fn one<M: prost::Message + Default>(path: &Path, magic: u32) -> Result<M, ImageError> {
    let mut v = read_entries::<M>(path, magic)?;
    if v.len() != 1 {
        return Err(ImageError::malformed(path, format!("{} entries, want exactly one", v.len())));
    }
    v.pop().ok_or_else(|| ImageError::malformed(path, "no entry"))
}

/// The capability words of a set as one mask; words beyond the second must be zero (the
/// kernel has fewer than 64 capabilities).
fn cap_mask(words: &[u32]) -> Result<u64, String> {
    let mut m = 0u64;
    for (i, w) in words.iter().enumerate() {
        match i {
            0 => m |= u64::from(*w),
            1 => m |= u64::from(*w) << 32,
            _ if *w != 0 => return Err(format!("{words:x?} (word {i} is not zero)")),
            _ => {}
        }
    }
    Ok(m)
}

/// Whether CRIU can bring back the tree dumped in `dir` as far as its namespaces go: every
/// task shares the root task's (pid, net, ipc, uts, mount, user, cgroup, time). A tree whose
/// tasks span two of a kind — a command started outside a restored init's time namespace by
/// an older daemon — fails in CRIU's restore ("Can't restore sub-task in NS") after the
/// sandbox's processes were stopped; this is read before anything is stopped. Returns the
/// number of tasks.
pub fn check_shared_namespaces(dir: &Path) -> Result<usize, ImageError> {
    let pstree_path = dir.join("pstree.img");
    let tasks = read_entries::<PstreeEntry>(&pstree_path, PSTREE_MAGIC)?;
    let mut root: Option<TaskKobjIdsEntry> = None;
    for (i, task) in tasks.iter().enumerate() {
        let pid = task
            .pid
            .ok_or_else(|| ImageError::malformed(&pstree_path, format!("entry {i} has no pid")))?;
        let ids_path = dir.join(format!("ids-{pid}.img"));
        let ids = match std::fs::metadata(&ids_path) {
            Ok(_) => read_entries::<TaskKobjIdsEntry>(&ids_path, IDS_MAGIC)?.pop(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(ImageError::Io { path: ids_path, source }),
        };
        match (&root, ids) {
            (None, ids) => root = ids,
            (Some(r), Some(ids)) => {
                if let Some((field, value)) = ns_diff(r, &ids) {
                    return Err(ImageError::Refused {
                        pid,
                        tid: pid,
                        field: field.to_string(),
                        value,
                        allowed: "the root task's: CRIU restores one namespace of each kind".into(),
                    });
                }
            }
            (Some(_), None) => {}
        }
    }
    Ok(tasks.len())
}

/// Check the images in `dir` against `policy` (see the module's documentation).
pub fn check_dir(dir: &Path, policy: &Policy) -> Result<Checked, ImageError> {
    let inv_path = dir.join("inventory.img");
    let inventory: InventoryEntry = one(&inv_path, INVENTORY_MAGIC)?;
    let root_ids =
        inventory.root_ids.ok_or_else(|| ImageError::malformed(&inv_path, "no root_ids"))?;
    let pstree_path = dir.join("pstree.img");
    let tasks = read_entries::<PstreeEntry>(&pstree_path, PSTREE_MAGIC)?;
    if tasks.is_empty() {
        return Err(ImageError::malformed(&pstree_path, "no task"));
    }
    let seccomp_path = dir.join("seccomp.img");
    let filters = match std::fs::metadata(&seccomp_path) {
        Ok(_) => one::<SeccompEntry>(&seccomp_path, SECCOMP_MAGIC)?.seccomp_filters,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => return Err(ImageError::Io { path: seccomp_path, source }),
    };
    let mut checked = Checked { tasks: tasks.len(), threads: 0, filters: filters.len() };
    let mut tree_ids: Option<TaskKobjIdsEntry> = None;
    let mut seen = BTreeSet::new();
    for (i, task) in tasks.iter().enumerate() {
        let pid = task
            .pid
            .ok_or_else(|| ImageError::malformed(&pstree_path, format!("entry {i} has no pid")))?;
        if !seen.insert(pid) {
            return Err(ImageError::malformed(&pstree_path, format!("pid {pid} appears twice")));
        }
        // CRIU restores a task without thread ids as one thread of its pid.
        let threads = if task.threads.is_empty() { vec![pid] } else { task.threads.clone() };
        let leader_path = dir.join(format!("core-{pid}.img"));
        let leader: CoreEntry = one(&leader_path, CORE_MAGIC)?;
        let tc = leader
            .tc
            .as_ref()
            .ok_or_else(|| ImageError::malformed(&leader_path, "no task core"))?;
        let refuse = |tid: u32, field: &str, value: String, allowed: &str| ImageError::Refused {
            pid,
            tid,
            field: field.to_string(),
            value,
            allowed: allowed.to_string(),
        };
        if let Some(m) = tc.old_seccomp_mode {
            return Err(refuse(
                pid,
                "tc.old_seccomp_mode",
                m.to_string(),
                "absent (CRIU 4 writes the mode per thread)",
            ));
        }
        if let Some(f) = tc.old_seccomp_filter {
            return Err(refuse(pid, "tc.old_seccomp_filter", f.to_string(), "absent"));
        }
        if dir.join(format!("creds-{pid}.img")).exists() {
            return Err(refuse(
                pid,
                "creds image",
                format!("creds-{pid}.img"),
                "none (creds are per thread in core images)",
            ));
        }
        // Namespaces (from `ids-<pid>.img`, where a restore reads them; a task without one
        // gets its parent's): the root task against the dumping CRIU's, every other task
        // against the root task (no task of a sandbox can make or join another namespace).
        let ids_path = dir.join(format!("ids-{pid}.img"));
        let ids = match std::fs::metadata(&ids_path) {
            Ok(_) => {
                let mut v = read_entries::<TaskKobjIdsEntry>(&ids_path, IDS_MAGIC)?;
                if v.len() > 1 {
                    return Err(ImageError::malformed(&ids_path, "more than one entry"));
                }
                v.pop()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(ImageError::Io { path: ids_path, source }),
        };
        match (&tree_ids, ids) {
            (None, None) => {
                return Err(refuse(pid, "ids", "absent".into(), "the root task's namespace ids"))
            }
            (None, Some(ids)) => {
                check_root_ns(&ids, &root_ids, policy.namespaces)
                    .map_err(|(f, v, a)| refuse(pid, f, v, a))?;
                if let (Some(want), Some(id)) = (policy.namespaces.userns, ids.user_ns_id) {
                    check_userns(dir, id, want)?;
                }
                tree_ids = Some(ids);
            }
            (Some(root), Some(ids)) => {
                if let Some((f, v)) = ns_diff(root, &ids) {
                    return Err(refuse(
                        pid,
                        f,
                        v,
                        "the root task's (a sandbox's tasks share its namespaces)",
                    ));
                }
            }
            // CRIU gives a task without ids its parent's.
            (Some(_), None) => {}
        }
        if tc.task_state == Some(TASK_DEAD) {
            // A zombie is restored as an exited task: it runs no code and holds no creds.
            continue;
        }
        // CRIU's dump of a task whose threads all share the leader's chain keeps the chain on
        // the leader only, every filter of it flagged TSYNC, and the other threads' mode
        // disabled: the leader's installation puts the chain on every thread (and threads
        // cloned after it inherit it). Such a thread is checked through the leader's chain.
        let leader_syncs = leader.thread_core.as_ref().is_some_and(|th| {
            th.seccomp_mode == Some(SECCOMP_MODE_FILTER) && chain_all_tsync(th, &filters)
        });
        for &tid in &threads {
            let core = if tid == pid {
                leader.clone()
            } else {
                one::<CoreEntry>(&dir.join(format!("core-{tid}.img")), CORE_MAGIC)?
            };
            let th = core
                .thread_core
                .as_ref()
                .ok_or_else(|| refuse(tid, "thread_core", "absent".into(), "present"))?;
            let creds = th
                .creds
                .as_ref()
                .ok_or_else(|| refuse(tid, "creds", "absent".into(), "present"))?;
            check_creds(creds, policy).map_err(|(f, v, a)| refuse(tid, f, v, &a))?;
            let synced = tid != pid && leader_syncs && th.seccomp_mode.unwrap_or(0) == 0;
            if !synced {
                check_seccomp(th, &filters, policy).map_err(|(f, v, a)| refuse(tid, f, v, &a))?;
            }
            checked.threads += 1;
        }
    }
    if let (Some(mp), Some(root)) = (&policy.mounts, &tree_ids) {
        check_mounts(dir, root, mp)?;
    }
    Ok(checked)
}

fn mount_err(
    mountpoint: &str,
    field: &str,
    value: String,
    allowed: impl Into<String>,
) -> ImageError {
    ImageError::Mount {
        mountpoint: mountpoint.to_string(),
        field: field.to_string(),
        value,
        allowed: allowed.into(),
    }
}

/// The mount table of the root task's mount namespace against `p`; no other table may be in
/// the directory (every task is in the root task's namespace).
fn check_mounts(dir: &Path, root: &TaskKobjIdsEntry, p: &MountPolicy) -> Result<(), ImageError> {
    let ns = root
        .mnt_ns_id
        .ok_or_else(|| ImageError::malformed(dir, "the root task has no mount namespace id"))?;
    let want = format!("mountpoints-{ns}.img");
    let entries = std::fs::read_dir(dir)
        .map_err(|source| ImageError::Io { path: dir.to_path_buf(), source })?;
    for e in entries {
        let e = e.map_err(|source| ImageError::Io { path: dir.to_path_buf(), source })?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("mountpoints-") && name != want {
            return Err(mount_err(
                "-",
                "image",
                name,
                format!("only {want}, the root task's namespace"),
            ));
        }
    }
    let path = dir.join(&want);
    let mounts = read_entries::<MntEntry>(&path, MNTS_MAGIC)?;
    let mut seen = BTreeSet::new();
    let mut roots = 0;
    for m in &mounts {
        let mp = m
            .mountpoint
            .as_deref()
            .ok_or_else(|| ImageError::malformed(&path, "a mount without a mountpoint"))?;
        if !seen.insert(mp.to_string()) {
            return Err(mount_err(
                mp,
                "mountpoint",
                "mounted twice".into(),
                "one mount per mountpoint",
            ));
        }
        let fstype = m.fstype.unwrap_or(0);
        let flags = m.flags.unwrap_or(0);
        if mp == "/" {
            // The namespace's root: a restore puts its own `root` there, whatever this says.
            roots += 1;
            continue;
        }
        let Some(rule) = p.rules.iter().find(|r| r.path == mp) else {
            return Err(mount_err(
                mp,
                "mountpoint",
                format!("{mp:?} ({} from {:?})", m.fsname.as_deref().unwrap_or("fstype"), m.source),
                "a mountpoint of the profile",
            ));
        };
        let key = rule.ext_key.as_deref().unwrap_or(p.ext_key.as_str());
        if (m.ext_mount == Some(true) || m.ext_key.is_some())
            && !(rule.external && m.ext_key.as_deref() == Some(key))
        {
            return Err(mount_err(
                mp,
                "ext_key",
                format!("{:?}", m.ext_key),
                format!("{key:?} on {mp} only (a masked directory or a device node)"),
            ));
        }
        if rule.ext_key.is_some() && m.ext_key.as_deref() != Some(key) {
            return Err(mount_err(
                mp,
                "ext_key",
                format!("{:?}", m.ext_key),
                format!("{key:?} (the host's device node)"),
            ));
        }
        let (want_type, ro) = (rule.fstype, rule.readonly);
        if fstype != want_type {
            return Err(mount_err(mp, "fstype", fstype.to_string(), format!("{want_type}")));
        }
        if ro && flags & MS_RDONLY == 0 {
            return Err(mount_err(mp, "flags", format!("{flags:#x}"), "MS_RDONLY set"));
        }
    }
    if roots != 1 {
        return Err(mount_err("/", "mountpoint", format!("{roots} root mounts"), "exactly one"));
    }
    if let Some(r) = p.rules.iter().find(|r| r.required && !seen.contains(&r.path)) {
        return Err(mount_err(
            &r.path,
            "mountpoint",
            "absent".into(),
            "present (masked or read-only)",
        ));
    }
    Ok(())
}

type Fault = (&'static str, String, String);

fn check_creds(c: &CredsEntry, p: &Policy) -> Result<(), Fault> {
    for (field, words) in [
        ("creds.cap_inh", &c.cap_inh),
        ("creds.cap_prm", &c.cap_prm),
        ("creds.cap_eff", &c.cap_eff),
        ("creds.cap_bnd", &c.cap_bnd),
        ("creds.cap_amb", &c.cap_amb),
    ] {
        let m = cap_mask(words).map_err(|v| (field, v, format!("a subset of {:#018x}", p.caps)))?;
        if m & !p.caps != 0 {
            return Err((
                field,
                format!("{m:#018x}"),
                format!("a subset of {:#018x} (extra: {:#018x})", p.caps, m & !p.caps),
            ));
        }
    }
    for (field, id) in [
        ("creds.uid", c.uid),
        ("creds.gid", c.gid),
        ("creds.euid", c.euid),
        ("creds.egid", c.egid),
        ("creds.suid", c.suid),
        ("creds.sgid", c.sgid),
        ("creds.fsuid", c.fsuid),
        ("creds.fsgid", c.fsgid),
    ] {
        match id {
            None => return Err((field, "absent".into(), "present".into())),
            Some(id) if !p.ids.contains(id) => {
                return Err((field, id.to_string(), format!("{:?}", p.ids)))
            }
            Some(_) => {}
        }
    }
    if let Some(g) = c.groups.iter().find(|g| !p.ids.contains(**g)) {
        return Err(("creds.groups", g.to_string(), format!("{:?}", p.ids)));
    }
    if p.no_new_privs && c.no_new_privs != Some(1) {
        return Err(("creds.no_new_privs", format!("{:?}", c.no_new_privs), "1".into()));
    }
    let sb = c.secbits.ok_or(("creds.secbits", "absent".to_string(), "present".to_string()))?;
    if sb & !KNOWN_SECBITS != 0 || sb & p.secbits != p.secbits {
        return Err((
            "creds.secbits",
            format!("{sb:#x}"),
            format!("bits {:#x} set, none outside {KNOWN_SECBITS:#x}", p.secbits),
        ));
    }
    Ok(())
}

/// Whether the thread's chain is non-empty, loop-free and flagged TSYNC throughout.
fn chain_all_tsync(th: &ThreadCoreEntry, filters: &[SeccompFilter]) -> bool {
    let mut next = th.seccomp_filter;
    let mut n = 0;
    while let Some(i) = next {
        let Some(f) = filters.get(i as usize) else { return false };
        n += 1;
        if n > filters.len() || f.flags.unwrap_or(0) & SECCOMP_FILTER_FLAG_TSYNC == 0 {
            return false;
        }
        next = f.prev;
    }
    n > 0
}

fn check_seccomp(th: &ThreadCoreEntry, filters: &[SeccompFilter], p: &Policy) -> Result<(), Fault> {
    let mode = th.seccomp_mode.unwrap_or(0);
    if mode != SECCOMP_MODE_FILTER {
        return Err(("seccomp_mode", mode.to_string(), format!("{SECCOMP_MODE_FILTER} (filter)")));
    }
    // The chain, newest first, as CRIU walks it.
    let mut chain = Vec::new();
    let mut next = th.seccomp_filter;
    while let Some(i) = next {
        let f = filters.get(i as usize).ok_or_else(|| {
            (
                "seccomp_filter",
                i.to_string(),
                format!("an index below {} (seccomp.img's filters)", filters.len()),
            )
        })?;
        if chain.len() >= filters.len() {
            return Err(("seccomp_filter", i.to_string(), "a chain without a loop".into()));
        }
        chain.push(f);
        next = f.prev;
    }
    chain.reverse();
    if chain.len() < p.seccomp.len() {
        return Err((
            "seccomp_filter",
            format!("a chain of {} filters", chain.len()),
            format!("a chain beginning with this host's {} filter(s)", p.seccomp.len()),
        ));
    }
    // Every one of this host's filters must be in the chain, each its own entry. Their order
    // does not matter: the kernel runs every filter of a chain and the strictest answer wins,
    // so what the chain holds besides them (filters the sandbox stacked) can only restrict.
    let mut used = vec![false; chain.len()];
    for (i, want) in p.seccomp.iter().enumerate() {
        let found = chain.iter().enumerate().position(|(j, f)| {
            !used[j] && f.filter.as_deref().unwrap_or_default() == want.as_slice()
        });
        let Some(j) = found else {
            let sizes: Vec<usize> =
                chain.iter().map(|f| f.filter.as_deref().unwrap_or_default().len() / 8).collect();
            return Err((
                "seccomp.filter",
                format!("a chain of filters of {sizes:?} instructions, none equal to this host's filter {i}"),
                format!(
                    "this host's compiled filter {i} ({} instructions) byte for byte in the chain",
                    want.len() / 8
                ),
            ));
        };
        used[j] = true;
        // CRIU's dump sets TSYNC on a leader whose threads all share its chain (one
        // installation for all); the filter's own installation had no flags.
        if let Some(fl) = chain[j].flags.filter(|fl| fl & !SECCOMP_FILTER_FLAG_TSYNC != 0) {
            return Err((
                "seccomp.flags",
                format!("{fl:#x}"),
                "0 or SECCOMP_FILTER_FLAG_TSYNC for this host's filter".into(),
            ));
        }
    }
    for f in chain.iter().zip(&used).filter(|(_, u)| !**u).map(|(f, _)| f) {
        if let Some(fl) = f.flags.filter(|fl| fl & SECCOMP_FILTER_FLAG_NEW_LISTENER != 0) {
            return Err((
                "seccomp.flags",
                format!("{fl:#x}"),
                "no SECCOMP_FILTER_FLAG_NEW_LISTENER".into(),
            ));
        }
        if f.filter.as_deref().unwrap_or_default().len() % 8 != 0 {
            return Err((
                "seccomp.filter",
                "a partial instruction".into(),
                "whole sock_filter entries".into(),
            ));
        }
    }
    Ok(())
}

fn ns_pairs(i: &TaskKobjIdsEntry) -> [(&'static str, Option<u32>); 8] {
    [
        ("ids.pid_ns_id", i.pid_ns_id),
        ("ids.net_ns_id", i.net_ns_id),
        ("ids.ipc_ns_id", i.ipc_ns_id),
        ("ids.uts_ns_id", i.uts_ns_id),
        ("ids.mnt_ns_id", i.mnt_ns_id),
        ("ids.user_ns_id", i.user_ns_id),
        ("ids.cgroup_ns_id", i.cgroup_ns_id),
        ("ids.time_ns_id", i.time_ns_id),
    ]
}

fn ns_diff(root: &TaskKobjIdsEntry, ids: &TaskKobjIdsEntry) -> Option<(&'static str, String)> {
    ns_pairs(root)
        .into_iter()
        .zip(ns_pairs(ids))
        .find(|((_, a), (_, b))| a != b)
        .map(|((_, a), (f, b))| (f, format!("{b:?} (the root task's: {a:?})")))
}

fn check_root_ns(
    ids: &TaskKobjIdsEntry,
    criu: &TaskKobjIdsEntry,
    p: NsPolicy,
) -> Result<(), (&'static str, String, &'static str)> {
    let own = |a: Option<u32>, b: Option<u32>| a.is_some() && a != b;
    let shown = |a: Option<u32>, b: Option<u32>| format!("{a:?} (the dumping CRIU's: {b:?})");
    for (field, a, b) in [
        ("ids.pid_ns_id", ids.pid_ns_id, criu.pid_ns_id),
        ("ids.mnt_ns_id", ids.mnt_ns_id, criu.mnt_ns_id),
        ("ids.uts_ns_id", ids.uts_ns_id, criu.uts_ns_id),
        ("ids.ipc_ns_id", ids.ipc_ns_id, criu.ipc_ns_id),
    ] {
        if !own(a, b) {
            return Err((field, shown(a, b), "a namespace of the sandbox's own"));
        }
    }
    if p.own_net && !own(ids.net_ns_id, criu.net_ns_id) {
        return Err((
            "ids.net_ns_id",
            shown(ids.net_ns_id, criu.net_ns_id),
            "a network namespace of the sandbox's own",
        ));
    }
    if !p.own_net && ids.net_ns_id != criu.net_ns_id {
        return Err((
            "ids.net_ns_id",
            shown(ids.net_ns_id, criu.net_ns_id),
            "the host's (host networking)",
        ));
    }
    // A user namespace of its own exactly when the profile makes one (its maps are checked
    // by `check_userns`). A time namespace of its own is fine: CRIU gives a restored init one
    // (its clocks continue), so every point taken after a restore has one; that every task
    // shares the root's is checked with the other namespaces (`ns_diff`).
    if p.userns.is_some() && !own(ids.user_ns_id, criu.user_ns_id) {
        return Err((
            "ids.user_ns_id",
            shown(ids.user_ns_id, criu.user_ns_id),
            "a user namespace of the sandbox's own",
        ));
    }
    if p.userns.is_none() && ids.user_ns_id != criu.user_ns_id {
        return Err((
            "ids.user_ns_id",
            shown(ids.user_ns_id, criu.user_ns_id),
            "the host's (the profile makes no such namespace)",
        ));
    }
    Ok(())
}

/// The maps of user namespace `id` (`userns-<id>.img`) must be exactly `want`'s.
fn check_userns(dir: &Path, id: u32, want: UsernsMap) -> Result<(), ImageError> {
    let path = dir.join(format!("userns-{id}.img"));
    let e: UsernsEntry = one(&path, USERNS_MAGIC)?;
    for (field, map, lower) in
        [("uid_map", &e.uid_map, want.uid), ("gid_map", &e.gid_map, want.gid)]
    {
        let ok = map.len() == 1
            && map[0] == UidGidExtent { first: 0, lower_first: lower, count: want.count };
        if !ok {
            let seen: Vec<String> =
                map.iter().map(|x| format!("{} {} {}", x.first, x.lower_first, x.count)).collect();
            return Err(userns_refused(&path, field, seen.join(", "), lower, want.count));
        }
    }
    Ok(())
}

fn userns_refused(path: &Path, field: &str, seen: String, lower: u32, count: u32) -> ImageError {
    ImageError::Refused {
        pid: 0,
        tid: 0,
        field: format!(
            "{} {field}",
            path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
        ),
        value: format!("[{seen}]"),
        allowed: format!("exactly [0 {lower} {count}], this host's range for sandboxes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            caps: 0xa80405fb,
            ids: IdRange::Any,
            no_new_privs: true,
            secbits: 0,
            seccomp: vec![vec![6, 0, 0, 0, 0, 0, 0xff, 0x7f]],
            namespaces: NsPolicy { own_net: true, userns: None },
            mounts: None,
        }
    }

    fn ids(base: u32) -> TaskKobjIdsEntry {
        TaskKobjIdsEntry {
            pid_ns_id: Some(base),
            net_ns_id: Some(base + 1),
            ipc_ns_id: Some(base + 2),
            uts_ns_id: Some(base + 3),
            mnt_ns_id: Some(base + 4),
            user_ns_id: Some(1),
            cgroup_ns_id: Some(base + 5),
            time_ns_id: Some(2),
        }
    }

    fn creds() -> CredsEntry {
        CredsEntry {
            uid: Some(0),
            gid: Some(0),
            euid: Some(0),
            egid: Some(0),
            suid: Some(0),
            sgid: Some(0),
            fsuid: Some(0),
            fsgid: Some(0),
            cap_inh: vec![0xa80405fb, 0],
            cap_prm: vec![0xa80405fb, 0],
            cap_eff: vec![0xa80405fb, 0],
            cap_bnd: vec![0xa80405fb, 0],
            secbits: Some(0),
            no_new_privs: Some(1),
            ..Default::default()
        }
    }

    /// A one-task image directory, with `core` and `filters` as given.
    fn write(dir: &Path, core: &CoreEntry, filters: &[SeccompFilter]) {
        let inv = InventoryEntry {
            img_version: Some(2),
            root_ids: Some(TaskKobjIdsEntry {
                pid_ns_id: Some(100),
                net_ns_id: Some(101),
                ipc_ns_id: Some(102),
                uts_ns_id: Some(103),
                mnt_ns_id: Some(104),
                user_ns_id: Some(1),
                cgroup_ns_id: Some(105),
                time_ns_id: Some(2),
            }),
        };
        std::fs::write(dir.join("inventory.img"), encode_entries(&[inv], INVENTORY_MAGIC)).unwrap();
        let ps = PstreeEntry { pid: Some(1), ppid: Some(0), threads: vec![1] };
        std::fs::write(dir.join("pstree.img"), encode_entries(&[ps], PSTREE_MAGIC)).unwrap();
        std::fs::write(
            dir.join("core-1.img"),
            encode_entries(std::slice::from_ref(core), CORE_MAGIC),
        )
        .unwrap();
        if let Some(ids) = &core.ids {
            std::fs::write(
                dir.join("ids-1.img"),
                encode_entries(std::slice::from_ref(ids), IDS_MAGIC),
            )
            .unwrap();
        }
        let se = SeccompEntry { seccomp_filters: filters.to_vec() };
        std::fs::write(dir.join("seccomp.img"), encode_entries(&[se], SECCOMP_MAGIC)).unwrap();
    }

    fn good() -> (CoreEntry, Vec<SeccompFilter>) {
        let core = CoreEntry {
            mtype: Some(1),
            tc: Some(TaskCoreEntry { task_state: Some(1), ..Default::default() }),
            ids: Some(ids(10)),
            thread_core: Some(ThreadCoreEntry {
                creds: Some(creds()),
                seccomp_mode: Some(2),
                seccomp_filter: Some(0),
            }),
        };
        (
            core,
            vec![SeccompFilter {
                filter: Some(policy().seccomp[0].clone()),
                prev: None,
                flags: None,
            }],
        )
    }

    fn verdict(core: &CoreEntry, filters: &[SeccompFilter]) -> Result<Checked, ImageError> {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), core, filters);
        check_dir(d.path(), &policy())
    }

    fn refused_field(r: Result<Checked, ImageError>) -> String {
        match r {
            Err(ImageError::Refused { field, .. }) => field,
            other => panic!("not refused: {other:?}"),
        }
    }

    /// Issue 33 #8: a tree whose second task is in another time namespace (a command an
    /// older daemon started outside a restored init's) is refused before a restore stops
    /// anything; one whose tasks share the root's, a time namespace of their own included,
    /// passes, as does a task without an ids image (CRIU gives it its parent's).
    #[test]
    fn a_tree_spanning_two_time_namespaces_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let tasks = [
            PstreeEntry { pid: Some(1), ppid: Some(0), threads: vec![1] },
            PstreeEntry { pid: Some(7), ppid: Some(1), threads: vec![7] },
            PstreeEntry { pid: Some(9), ppid: Some(1), threads: vec![9] },
        ];
        std::fs::write(d.path().join("pstree.img"), encode_entries(&tasks, PSTREE_MAGIC)).unwrap();
        let put = |pid: u32, ids: TaskKobjIdsEntry| {
            std::fs::write(
                d.path().join(format!("ids-{pid}.img")),
                encode_entries(&[ids], IDS_MAGIC),
            )
            .unwrap();
        };
        let own_time = TaskKobjIdsEntry { time_ns_id: Some(77), ..ids(10) };
        put(1, own_time.clone());
        put(7, own_time.clone());
        assert_eq!(check_shared_namespaces(d.path()).unwrap(), 3);
        put(9, ids(10));
        match check_shared_namespaces(d.path()) {
            Err(ImageError::Refused { pid: 9, field, .. }) => assert_eq!(field, "ids.time_ns_id"),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn encoded_images_round_trip_and_a_good_task_passes() {
        let (core, filters) = good();
        let c = verdict(&core, &filters).unwrap();
        assert_eq!(c, Checked { tasks: 1, threads: 1, filters: 1 });
    }

    #[test]
    fn each_widened_field_is_refused_by_name() {
        let (core, filters) = good();
        let with = |f: &dyn Fn(&mut CoreEntry)| {
            let mut c = core.clone();
            f(&mut c);
            refused_field(verdict(&c, &filters))
        };
        assert_eq!(
            with(
                &|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().cap_eff = vec![!0, !0]
            ),
            "creds.cap_eff"
        );
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().cap_bnd =
                vec![!0, 0x1ff]),
            "creds.cap_bnd"
        );
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().cap_amb =
                vec![1 << 21]),
            "creds.cap_amb"
        );
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().cap_prm =
                vec![0, 0, 1]),
            "creds.cap_prm"
        );
        assert_eq!(
            with(
                &|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().no_new_privs = Some(0)
            ),
            "creds.no_new_privs"
        );
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().no_new_privs = None),
            "creds.no_new_privs"
        );
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().creds.as_mut().unwrap().secbits =
                Some(1 << 20)),
            "creds.secbits"
        );
        assert_eq!(with(&|c| c.thread_core.as_mut().unwrap().creds = None), "creds");
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().seccomp_mode = Some(0)),
            "seccomp_mode"
        );
        assert_eq!(with(&|c| c.thread_core.as_mut().unwrap().seccomp_mode = None), "seccomp_mode");
        assert_eq!(
            with(&|c| c.thread_core.as_mut().unwrap().seccomp_filter = Some(7)),
            "seccomp_filter"
        );
        assert_eq!(
            with(&|c| c.tc.as_mut().unwrap().old_seccomp_mode = Some(0)),
            "tc.old_seccomp_mode"
        );
        assert_eq!(with(&|c| c.ids.as_mut().unwrap().net_ns_id = Some(101)), "ids.net_ns_id");
        assert_eq!(with(&|c| c.ids.as_mut().unwrap().user_ns_id = Some(77)), "ids.user_ns_id");
        assert_eq!(with(&|c| c.ids.as_mut().unwrap().mnt_ns_id = Some(104)), "ids.mnt_ns_id");
    }

    #[test]
    fn filter_chains_must_begin_with_this_hosts_filter() {
        let (core, mut filters) = good();
        filters[0].filter = Some(vec![6, 0, 0, 0, 0, 0, 0xff, 0x7f, 6, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(refused_field(verdict(&core, &filters)), "seccomp.filter");
        // A filter of the sandbox's own on top of the host's passes; a loop does not.
        let (mut core, mut filters) = good();
        filters.push(SeccompFilter {
            filter: Some(vec![6, 0, 0, 0, 0, 0, 0, 0]),
            prev: Some(0),
            flags: Some(2),
        });
        core.thread_core.as_mut().unwrap().seccomp_filter = Some(1);
        assert!(verdict(&core, &filters).is_ok());
        filters[0].prev = Some(1);
        assert_eq!(refused_field(verdict(&core, &filters)), "seccomp_filter");
        let (core, mut filters) = good();
        filters[0].flags = Some(SECCOMP_FILTER_FLAG_NEW_LISTENER);
        assert_eq!(refused_field(verdict(&core, &filters)), "seccomp.flags");
        filters[0].flags = Some(SECCOMP_FILTER_FLAG_TSYNC);
        assert!(verdict(&core, &filters).is_ok());
    }

    #[test]
    fn malformed_images_are_errors_not_panics() {
        let p = Path::new("x.img");
        assert!(decode_entries::<CoreEntry>(&[], CORE_MAGIC, p).is_err());
        let mut b = encode_entries(&[CoreEntry::default()], CORE_MAGIC);
        b.extend_from_slice(&1000u32.to_le_bytes());
        assert!(decode_entries::<CoreEntry>(&b, CORE_MAGIC, p).is_err());
        assert!(decode_entries::<CoreEntry>(&b, PSTREE_MAGIC, p).is_err());
    }

    #[test]
    fn id_ranges() {
        assert!(IdRange::Any.contains(u32::MAX));
        let r = IdRange::Range { first: 100_000, count: 65536 };
        assert!(
            r.contains(100_000) && r.contains(165_535) && !r.contains(165_536) && !r.contains(0)
        );
    }
}
