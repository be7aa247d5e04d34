//! Per-sandbox write accounting with btrfs simple quotas.
//!
//! Simple quotas (kernel ≥ 6.7) charge every extent to the subvolume that allocated it, and
//! unlike full qgroups they cost nothing at snapshot time. The "exclusive" figure of a sandbox's
//! root subvolume is then the bytes its own writes allocated and still hold: the "bytes written"
//! column of `crab sandbox ls`. When the kernel refuses simple quotas, Crab reports no figure
//! rather than a made-up one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

const BTRFS_IOCTL_MAGIC: u8 = 0x94;
const BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA: u64 = 4;
const BTRFS_FIRST_FREE_OBJECTID: u64 = 256;

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    rest: [u8; 992],
}

nix::ioctl_readwrite!(ioc_quota_ctl, BTRFS_IOCTL_MAGIC, 40, QuotaCtlArgs);
nix::ioctl_readwrite!(ioc_ino_lookup, BTRFS_IOCTL_MAGIC, 18, InoLookupArgs);
nix::ioctl_read!(ioc_fs_info, BTRFS_IOCTL_MAGIC, 31, FsInfoArgs);

/// `struct btrfs_qgroup_limit`.
#[repr(C)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_qgroup_limit_args`.
#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

const BTRFS_QGROUP_LIMIT_MAX_RFER: u64 = 1 << 0;
const BTRFS_QGROUP_LIMIT_MAX_EXCL: u64 = 1 << 1;

nix::ioctl_read!(ioc_qgroup_limit, BTRFS_IOCTL_MAGIC, 43, QgroupLimitArgs);

/// Limit the bytes subvolume `path` may allocate to `bytes` (`None`: no limit), on its level-0
/// qgroup. With simple quotas every extent is charged to the subvolume that wrote it, so the
/// limit bounds what the sandbox's own writes hold — including data its checkpoints still
/// reference after it deleted it — and a write past it fails with EDQUOT.
pub fn set_limit(path: &Path, bytes: Option<u64>) -> std::io::Result<()> {
    let f = File::open(path)?;
    let (flags, max) = match bytes {
        Some(b) => (BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL, b),
        None => (BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL, u64::MAX),
    };
    let mut args = QgroupLimitArgs {
        // 0: the qgroup of the subvolume the fd is on.
        qgroupid: 0,
        lim: QgroupLimit { flags, max_rfer: max, max_excl: max, rsv_rfer: 0, rsv_excl: 0 },
    };
    // SAFETY: `f` is an open fd on a btrfs subvolume; `args` is a valid
    // `btrfs_ioctl_qgroup_limit_args` that the kernel only reads.
    unsafe { ioc_qgroup_limit(f.as_raw_fd(), &mut args) }.map(|_| ()).map_err(std::io::Error::from)
}

fn fsid(f: &File) -> Option<String> {
    let mut args = FsInfoArgs { max_id: 0, num_devices: 0, fsid: [0; 16], rest: [0; 992] };
    // SAFETY: `f` is an open fd on btrfs; `args` is a zeroed `btrfs_ioctl_fs_info_args`.
    unsafe { ioc_fs_info(f.as_raw_fd(), &mut args) }.ok()?;
    let h: Vec<String> = args.fsid.iter().map(|b| format!("{b:02x}")).collect();
    let h = h.concat();
    Some(format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]))
}

fn sysfs_quota(pool: &Path) -> Option<std::path::PathBuf> {
    let f = File::open(pool).ok()?;
    Some(Path::new("/sys/fs/btrfs").join(fsid(&f)?).join("qgroups"))
}

/// Turn simple quotas on for the filesystem holding `pool`; true when they are on.
pub fn enable(pool: &Path) -> bool {
    if sysfs_quota(pool).is_some_and(|p| p.is_dir()) {
        return true;
    }
    let Ok(f) = File::open(pool) else { return false };
    let mut args = QuotaCtlArgs { cmd: BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, status: 0 };
    // SAFETY: `f` is an open fd on the btrfs pool; `args` is a valid `btrfs_ioctl_quota_ctl_args`.
    match unsafe { ioc_quota_ctl(f.as_raw_fd(), &mut args) } {
        Ok(_) => {
            tracing::info!(pool = %pool.display(), "enabled btrfs simple quotas");
            true
        }
        Err(e) => {
            tracing::warn!(pool = %pool.display(), error = %e, "btrfs simple quotas unavailable; no per-sandbox byte counts");
            false
        }
    }
}

/// The subvolume id of the subvolume at `path`.
pub fn subvolume_id(path: &Path) -> Option<u64> {
    let f = File::open(path).ok()?;
    let mut args =
        InoLookupArgs { treeid: 0, objectid: BTRFS_FIRST_FREE_OBJECTID, name: [0; 4080] };
    // SAFETY: `f` is an open fd on btrfs; `args` is a valid `btrfs_ioctl_ino_lookup_args`.
    unsafe { ioc_ino_lookup(f.as_raw_fd(), &mut args) }.ok()?;
    Some(args.treeid)
}

/// Bytes allocated by subvolume `path` itself (its simple-quota "exclusive" count).
pub fn exclusive_bytes(path: &Path) -> Option<u64> {
    let id = subvolume_id(path)?;
    let dir = sysfs_quota(path)?.join(format!("0_{id}"));
    std::fs::read_to_string(dir.join("exclusive")).ok()?.trim().parse().ok()
}
