//! The security profile every process entering a sandbox runs under (at least Docker's default).
//!
//! Two halves, applied by the single-threaded helpers in [`crate::spawn`]:
//!
//! * [`restrict_mounts`] — run by the sandbox's pid 1 after it pivoted into its root and before
//!   it execs `crab-init`: masks `/proc` files and directories that leak host state
//!   ([`MASKED_PATHS`]) and makes kernel-tunable paths read-only ([`READONLY_PATHS`]). These are
//!   mounts inside the sandbox's mount namespace, so CRIU dumps and restores them with the rest
//!   of the mount tree and every later process (exec, restore, fork) sees them.
//! * [`restrict_process`] — run by the starter's child and by `__nsexec`'s child right before
//!   `execve`: capability sets reduced to [`DEFAULT_CAPS`] (bounding, permitted, effective,
//!   inheritable; ambient empty), `no_new_privs`, and the seccomp filter of [`crate::seccomp`]
//!   (Docker's default profile, EPERM on refusal). Children inherit all three; CRIU dumps and
//!   restores creds and seccomp filters per task, so restored and forked processes keep them.
//!
//! The cgroup namespace and the device allowlist belong to the starter and [`crate::cgroup`].
//! A sandbox created `--privileged` skips all of this (documented as unsafe).

use caps::{CapSet, Capability, CapsHashSet};
use nix::mount::{mount, MsFlags};

pub use crab_common::api::{ProfileReport, SecurityProfile};

/// Docker's default capability list minus `NET_RAW` (see `docs/architecture.md`: raw sockets
/// allow ARP/IP spoofing on a nat sandbox's veth and the kernel's raw-socket attack surface;
/// `ping` keeps working through ICMP datagram sockets, enabled by `net.ipv4.ping_group_range`
/// in the sandbox's network namespace).
pub const DEFAULT_CAPS: [Capability; 13] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_MKNOD,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// Paths hidden from the sandbox: a file gets `/dev/null` bound over it, a directory an empty
/// read-only tmpfs (Docker's and runc's list). Paths the kernel does not have are skipped.
pub const MASKED_PATHS: [&str; 10] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
];

/// The directories of [`MASKED_PATHS`] (an empty read-only tmpfs at start; see
/// [`MASKED_MOUNT_KEY`] for how a checkpoint carries them).
pub const MASKED_DIRS: [&str; 4] = ["/proc/acpi", "/proc/asound", "/proc/scsi", "/sys/firmware"];

/// The CRIU external-mount key of the masked directories. A dump declares every one of
/// [`MASKED_DIRS`] external under this key ([`masked_dump_externals`]), so CRIU neither archives
/// nor re-creates their (empty) tmpfs — which it does by running `tar` and `gzip`, ≈ 10–20 ms a
/// mount under load — and a restore or fork binds the daemon's own empty read-only tmpfs
/// ([`ensure_masked_source`]) there instead, read-only, `nosuid,nodev,noexec` as dumped.
/// Images dumped before this still hold the tmpfs and restore as they did.
pub const MASKED_MOUNT_KEY: &str = "crab-masked";

/// The `external` entries of a dump of a default-profile sandbox: `mnt[<dir>]:crab-masked`.
pub fn masked_dump_externals() -> Vec<String> {
    MASKED_DIRS.iter().map(|d| format!("mnt[{d}]:{MASKED_MOUNT_KEY}")).collect()
}

/// The `external` entry of a restore: `mnt[crab-masked]:<source>`.
pub fn masked_restore_external(source: &std::path::Path) -> String {
    format!("mnt[{MASKED_MOUNT_KEY}]:{}", source.display())
}

/// The CRIU external-mount key of the host device node bound at `/dev/<name>` in a
/// user-namespaced sandbox (no device node can be made inside one, so the starter binds the
/// host's, `crate::spawn`), and at the masked files bound from `/dev/null`: a dump declares
/// each such mount external under `crab-dev-<name>` ([`device_dump_externals`]), and a restore
/// binds the host's node again ([`device_restore_externals`]).
pub const DEVICE_MOUNT_PREFIX: &str = "crab-dev-";

/// The `external` entries of a dump of user-namespaced sandbox whose init is `init_pid`: one
/// per mount of its mount table (`/proc/<init_pid>/mountinfo`, read bounded) whose source is
/// a host device node of [`ALLOWED_DEVICES`] (`/dev/null`, and the masked files bound from it).
pub fn device_dump_externals(init_pid: u32) -> Vec<String> {
    use std::io::Read;
    let path = format!("/proc/{init_pid}/mountinfo");
    let mut text = String::new();
    let read = std::fs::File::open(&path)
        .and_then(|f| f.take(1 << 20).read_to_string(&mut text).map(drop));
    if let Err(e) = read {
        tracing::warn!(path, error = %e, "cannot read the sandbox's mount table");
        return Vec::new();
    }
    let mut out = Vec::new();
    for line in text.lines() {
        // id parent major:minor root mountpoint ...
        let f: Vec<&str> = line.split(' ').collect();
        let (Some(root), Some(at)) = (f.get(3), f.get(4)) else { continue };
        let Some(dev) = root.strip_prefix('/') else { continue };
        if !ALLOWED_DEVICES.iter().any(|d| d.0 == dev && d.0 != "ptmx") {
            continue;
        }
        let devtmpfs = line.split(" - ").nth(1).is_some_and(|t| t.starts_with("devtmpfs "));
        let at_device = at.strip_prefix("/dev/").is_some_and(|n| n == dev);
        let masked = MASKED_PATHS.contains(at) && !MASKED_DIRS.contains(at);
        if devtmpfs && (at_device || masked) {
            out.push(format!("mnt[{at}]:{DEVICE_MOUNT_PREFIX}{dev}"));
        }
    }
    out
}

/// The `external` entries of a restore of a user-namespaced sandbox: every allowed device's
/// key bound to the host's node (`mnt[crab-dev-null]:/dev/null`, …).
pub fn device_restore_externals() -> Vec<String> {
    ALLOWED_DEVICES
        .iter()
        .filter(|d| d.0 != "ptmx")
        .map(|d| format!("mnt[{DEVICE_MOUNT_PREFIX}{}]:/dev/{}", d.0, d.0))
        .collect()
}

/// Make `dir` an empty read-only tmpfs (`mode=555`, `nosuid,nodev,noexec`) unless it already
/// is a mount point. Its superblock is read-only, so nothing — not the daemon, not a sandbox
/// holding a bind of it — can add an entry; sandboxes may share it.
pub fn ensure_masked_source(dir: &std::path::Path) -> crate::Result<()> {
    use crate::SandboxError;
    use std::os::unix::fs::MetadataExt;
    std::fs::create_dir_all(dir).map_err(SandboxError::io("mkdir", dir))?;
    let parent = dir.parent().unwrap_or(dir);
    let (d, p) = (
        std::fs::metadata(dir).map_err(SandboxError::io("stat", dir))?,
        std::fs::metadata(parent).map_err(SandboxError::io("stat", parent))?,
    );
    if d.dev() != p.dev() {
        return Ok(());
    }
    mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=555,size=4k"),
    )
    .map_err(|e| SandboxError::io("mount an empty read-only tmpfs on", dir)(e.into()))
}

/// Paths bound read-only over themselves (Docker's list). `/sys` is not mounted in a sandbox.
pub const READONLY_PATHS: [&str; 5] =
    ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// Device nodes a sandbox may open (`/dev` is a fresh tmpfs holding only these, and the cgroup
/// device controller enforces the same list): (name, major, minor).
pub const ALLOWED_DEVICES: [(&str, u32, u32); 7] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
    ("ptmx", 5, 2),
];

/// The profile report of `p`.
pub fn report(p: &SecurityProfile) -> ProfileReport {
    if p.privileged {
        return ProfileReport {
            name: "privileged".into(),
            capabilities: vec!["ALL".into()],
            seccomp: "none".into(),
            no_new_privs: false,
            masked_paths: Vec::new(),
            readonly_paths: Vec::new(),
            cgroup_namespace: false,
            devices: vec!["all".into()],
            user_namespace: userns_report(p),
        };
    }
    let mut devices: Vec<String> =
        ALLOWED_DEVICES.iter().map(|(n, ma, mi)| format!("c {ma}:{mi} {n}")).collect();
    devices.push("c 136:* pts".into());
    ProfileReport {
        name: "default".into(),
        capabilities: DEFAULT_CAPS.iter().map(|c| c.to_string()).collect(),
        seccomp: format!(
            "docker-default ({} syscalls allowed, others EPERM; socket/personality/clone \
             argument-filtered, clone3 ENOSYS)",
            crate::seccomp::allowed_count()
        ),
        no_new_privs: true,
        masked_paths: MASKED_PATHS.iter().map(|s| s.to_string()).collect(),
        readonly_paths: READONLY_PATHS.iter().map(|s| s.to_string()).collect(),
        cgroup_namespace: true,
        devices,
        user_namespace: userns_report(p),
    }
}

fn userns_report(p: &SecurityProfile) -> String {
    match p.userns {
        Some(r) => r.to_string(),
        None => "host (uid 0 inside is the host's root)".into(),
    }
}

fn err<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> String {
    let what = what.into();
    move |e| format!("{what}: {e}")
}

/// Mask and make read-only the paths of the default profile. Runs in the sandbox's mount
/// namespace after `pivot_root` (paths are the sandbox's).
pub fn restrict_mounts() -> Result<(), String> {
    for p in MASKED_PATHS {
        let Ok(meta) = std::fs::symlink_metadata(p) else { continue };
        if meta.is_dir() {
            mount(
                Some("tmpfs"),
                p,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("mode=555"),
            )
            .map_err(err(format!("mask {p} (tmpfs)")))?;
        } else {
            mount(Some("/dev/null"), p, None::<&str>, MsFlags::MS_BIND, None::<&str>)
                .map_err(err(format!("mask {p} (bind /dev/null)")))?;
        }
    }
    for p in READONLY_PATHS {
        if std::fs::symlink_metadata(p).is_err() {
            continue;
        }
        mount(Some(p), p, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
            .map_err(err(format!("bind {p}")))?;
        mount(
            None::<&str>,
            p,
            None::<&str>,
            MsFlags::MS_BIND
                | MsFlags::MS_REMOUNT
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(err(format!("remount {p} read-only")))?;
    }
    Ok(())
}

/// The host gids a sandbox of profile `p` lets open ICMP echo sockets (`ping` without
/// `NET_RAW`): every gid of its user namespace (shown inside as `0 65535`: CRIU then dumps and
/// restores a range it can write there), or every gid for one in the host's; none for
/// `--privileged` (it has `NET_RAW`).
pub fn ping_range(p: &SecurityProfile) -> Option<(u32, u32)> {
    match (p.privileged, p.userns) {
        (true, _) => None,
        (false, Some(r)) => Some((r.gid, r.gid + (r.count - 1))),
        (false, None) => Some((0, 2147483647)),
    }
}

/// Allow unprivileged ICMP echo sockets for host gids `range` in the calling thread's network
/// namespace (written from the host's user namespace). Best effort: a kernel without the
/// sysctl just keeps ping root-only.
pub fn allow_ping(range: (u32, u32)) {
    let _ =
        std::fs::write("/proc/sys/net/ipv4/ping_group_range", format!("{} {}", range.0, range.1));
}

/// Drop every capability outside `keep` from the bounding set, including ones newer than the
/// `caps` crate knows (the kernel's `cap_last_cap` may be higher).
fn drop_bounding(keep: &CapsHashSet) -> Result<(), String> {
    let keep_idx: Vec<u8> = keep.iter().map(|c| c.index()).collect();
    for cap in 0..64u8 {
        // SAFETY: prctl with integer arguments only.
        let has = unsafe { libc::prctl(libc::PR_CAPBSET_READ, libc::c_ulong::from(cap), 0, 0, 0) };
        if has != 1 || keep_idx.contains(&cap) {
            continue; // < 0: past the kernel's last capability
        }
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) } != 0 {
            return Err(format!(
                "prctl(PR_CAPBSET_DROP, {cap}): {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Drop capabilities, set `no_new_privs` and install the seccomp filter, in that order (the
/// bounding set first, while `CAP_SETPCAP` is held; the filter before the last capset, which
/// the filter allows). Called right before `execve`, in a single-threaded process.
pub fn restrict_process(
    p: &SecurityProfile,
    filters: Option<&crate::seccomp::CompiledFilters>,
) -> Result<(), String> {
    if p.privileged {
        return Ok(());
    }
    let keep: CapsHashSet = DEFAULT_CAPS.iter().copied().collect();
    caps::clear(None, CapSet::Ambient).map_err(err("clear ambient capabilities"))?;
    drop_bounding(&keep)?;
    caps::set(None, CapSet::Inheritable, &keep).map_err(err("set inheritable capabilities"))?;
    // `install` sets no_new_privs before installing the filter.
    crate::seccomp::install(filters).map_err(err("install seccomp filter"))?;
    caps::set(None, CapSet::Effective, &keep).map_err(err("set effective capabilities"))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(err("set permitted capabilities"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_dirs_are_masked_paths() {
        for d in MASKED_DIRS {
            assert!(MASKED_PATHS.contains(&d), "{d} is not in MASKED_PATHS");
        }
        assert_eq!(masked_dump_externals()[0], "mnt[/proc/acpi]:crab-masked");
        assert_eq!(
            masked_restore_external(std::path::Path::new("/var/lib/crab/masked")),
            "mnt[crab-masked]:/var/lib/crab/masked"
        );
    }
}
