//! Process images this host did not dump: vetted before CRIU may restore them.
//!
//! CRIU restores each task's capability sets, ids, securebits, `no_new_privs`, seccomp
//! filters and namespaces exactly as its images say. Images this host dumped say what the
//! profile gave the dumped processes; images from a remote store (`crab-remote`'s
//! materialization of a point) say whatever whoever wrote the store wanted. [`check`] holds
//! such a directory to the default profile (`crab_sandbox::profile`: Docker's default
//! capabilities minus `NET_RAW`, `no_new_privs`, this daemon's compiled seccomp filters in
//! every thread's chain, the sandbox's own pid/mount/uts/ipc/network namespaces and no user
//! namespace (a time namespace of its own is allowed: a restore gives one), the starter's mount table with its masked and read-only paths;
//! `--privileged` and host networking are never granted to such a point) with `crab_criu::images::check_dir`, which names the task, the field and the value it
//! refuses.

use std::path::Path;

use crab_criu::images::{
    Checked, IdRange, MountPolicy, MountRule, NsPolicy, Policy, FSTYPE_DEVPTS, FSTYPE_PROC,
    FSTYPE_TMPFS,
};

use crate::error::{CheckpointError, Result};

/// The ids a restored task may run as. Sandboxes run as host root today, so any id; a
/// user-namespace range goes here.
pub const SANDBOX_IDS: IdRange = IdRange::Any;

/// The policy of the default profile (what a sandbox restored from foreign images runs with).
pub fn default_policy() -> Result<Policy> {
    let caps =
        crab_sandbox::profile::DEFAULT_CAPS.iter().fold(0u64, |m, c| m | (1u64 << c.index()));
    let seccomp =
        crab_sandbox::seccomp::compiled().and_then(|c| c.program_bytes()).map_err(|e| {
            CheckpointError::Invalid(format!("cannot compile this host's seccomp filter: {e}"))
        })?;
    Ok(Policy {
        caps,
        ids: SANDBOX_IDS,
        no_new_privs: true,
        secbits: 0,
        seccomp,
        namespaces: NsPolicy { own_net: true },
        mounts: Some(default_mounts()),
    })
}

/// The mount table the default profile's starter makes (`profile::restrict_mounts`): `/proc`,
/// `/dev` (tmpfs) with `devpts` and `/dev/shm`, every masked path under `/proc` (a `/dev/null`
/// bind from `/dev`'s tmpfs for a file, a read-only tmpfs — or the `crab-masked` external
/// mount — for a directory) and every read-only path under `/proc` (`/sys` is not mounted).
/// Masked and read-only paths this kernel has must be there (the preflight already requires
/// the dumping host's kernel release).
pub fn default_mounts() -> MountPolicy {
    use crab_sandbox::profile::{MASKED_DIRS, MASKED_MOUNT_KEY, MASKED_PATHS, READONLY_PATHS};
    let here = |p: &str| std::fs::symlink_metadata(p).is_ok();
    let mut rules: Vec<MountRule> = [
        ("/proc", FSTYPE_PROC),
        ("/dev", FSTYPE_TMPFS),
        ("/dev/pts", FSTYPE_DEVPTS),
        ("/dev/shm", FSTYPE_TMPFS),
    ]
    .into_iter()
    .map(|(path, fstype)| MountRule {
        path: path.into(),
        fstype,
        readonly: false,
        required: false,
        external: false,
    })
    .collect();
    for p in MASKED_PATHS.iter().filter(|p| p.starts_with("/proc/")) {
        let dir = MASKED_DIRS.contains(p);
        rules.push(MountRule {
            path: (*p).into(),
            fstype: FSTYPE_TMPFS,
            readonly: dir,
            required: here(p),
            external: dir,
        });
    }
    for p in READONLY_PATHS.iter().filter(|p| p.starts_with("/proc/")) {
        rules.push(MountRule {
            path: (*p).into(),
            fstype: FSTYPE_PROC,
            readonly: true,
            required: here(p),
            external: false,
        });
    }
    MountPolicy { rules, ext_key: MASKED_MOUNT_KEY.into() }
}

/// Check the CRIU images in `dir` against the default profile; refused images are a
/// [`CheckpointError::Untrusted`].
pub fn check(dir: &Path) -> Result<Checked> {
    let policy = default_policy()?;
    crab_criu::images::check_dir(dir, &policy)
        .map_err(|source| CheckpointError::Untrusted { dir: dir.to_path_buf(), source })
}
