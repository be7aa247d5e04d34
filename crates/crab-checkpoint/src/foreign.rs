//! Process images this host did not dump: vetted before CRIU may restore them.
//!
//! CRIU restores each task's capability sets, ids, securebits, `no_new_privs`, seccomp
//! filters and namespaces exactly as its images say. Images this host dumped say what the
//! profile gave the dumped processes; images from a remote store (`crab-remote`'s
//! materialization of a point) say whatever whoever wrote the store wanted. [`check`] holds
//! such a directory to the default profile (`crab_sandbox::profile`: Docker's default
//! capabilities minus `NET_RAW`, `no_new_privs`, this daemon's compiled seccomp filters in
//! every thread's chain, the sandbox's own pid/mount/uts/ipc/network namespaces, and a user
//! namespace exactly when the admitted point runs in one, mapping exactly this host's range
//! (a time namespace of its own is allowed: a restore gives one), the starter's mount table with its masked and read-only paths;
//! `--privileged` and host networking are never granted to such a point) with `crab_criu::images::check_dir`, which names the task, the field and the value it
//! refuses.

use std::path::Path;

use crab_criu::images::{
    Checked, IdRange, MountPolicy, MountRule, NsPolicy, Policy, UsernsMap, FSTYPE_DEVPTS,
    FSTYPE_DEVTMPFS, FSTYPE_PROC, FSTYPE_TMPFS,
};

use crate::error::{CheckpointError, Result};

/// The ids a restored task of a `--userns host` sandbox may run as: any (they are host ids).
pub const SANDBOX_IDS: IdRange = IdRange::Any;

/// The policy of the default profile (what a sandbox restored from foreign images runs with),
/// in the user namespace `userns` (`None`: the host's, for points of `--userns host`
/// sandboxes and of sandboxes from before user namespaces).
pub fn default_policy(userns: Option<crab_common::api::IdRange>) -> Result<Policy> {
    let caps =
        crab_sandbox::profile::DEFAULT_CAPS.iter().fold(0u64, |m, c| m | (1u64 << c.index()));
    let seccomp =
        crab_sandbox::seccomp::compiled().and_then(|c| c.program_bytes()).map_err(|e| {
            CheckpointError::Invalid(format!("cannot compile this host's seccomp filter: {e}"))
        })?;
    Ok(Policy {
        caps,
        // In a user namespace CRIU's images hold the ids as seen inside it.
        ids: match userns {
            Some(r) => IdRange::Range { first: 0, count: r.count },
            None => SANDBOX_IDS,
        },
        no_new_privs: true,
        secbits: 0,
        seccomp,
        namespaces: NsPolicy {
            own_net: true,
            userns: userns.map(|r| UsernsMap { uid: r.uid, gid: r.gid, count: r.count }),
        },
        mounts: Some(default_mounts(userns.is_some())),
    })
}

/// The mount table the default profile's starter makes (`profile::restrict_mounts`): `/proc`,
/// `/dev` (tmpfs) with `devpts` and `/dev/shm`, every masked path under `/proc` (a `/dev/null`
/// bind from `/dev`'s tmpfs for a file, a read-only tmpfs — or the `crab-masked` external
/// mount — for a directory) and every read-only path under `/proc` (`/sys` is not mounted).
/// Masked and read-only paths this kernel has must be there (the preflight already requires
/// the dumping host's kernel release).
///
/// User-namespaced (`userns`), `/dev`'s device nodes and the masked files are the host's device
/// nodes bound there, each the external mount `crab-dev-<name>`
/// (`profile::DEVICE_MOUNT_PREFIX`).
pub fn default_mounts(userns: bool) -> MountPolicy {
    use crab_sandbox::profile::{
        ALLOWED_DEVICES, DEVICE_MOUNT_PREFIX, MASKED_DIRS, MASKED_MOUNT_KEY, MASKED_PATHS,
        READONLY_PATHS,
    };
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
        ext_key: None,
    })
    .collect();
    let null_key = format!("{DEVICE_MOUNT_PREFIX}null");
    if userns {
        for (name, ..) in ALLOWED_DEVICES.iter().filter(|d| d.0 != "ptmx") {
            rules.push(MountRule {
                path: format!("/dev/{name}"),
                fstype: FSTYPE_DEVTMPFS,
                readonly: false,
                required: false,
                external: true,
                ext_key: Some(format!("{DEVICE_MOUNT_PREFIX}{name}")),
            });
        }
    }
    for p in MASKED_PATHS.iter().filter(|p| p.starts_with("/proc/")) {
        let dir = MASKED_DIRS.contains(p);
        let bound_null = userns && !dir;
        rules.push(MountRule {
            path: (*p).into(),
            fstype: if bound_null { FSTYPE_DEVTMPFS } else { FSTYPE_TMPFS },
            readonly: dir,
            required: here(p),
            external: dir || bound_null,
            ext_key: bound_null.then(|| null_key.clone()),
        });
    }
    for p in READONLY_PATHS.iter().filter(|p| p.starts_with("/proc/")) {
        rules.push(MountRule {
            path: (*p).into(),
            fstype: FSTYPE_PROC,
            readonly: true,
            required: here(p),
            external: false,
            ext_key: None,
        });
    }
    MountPolicy { rules, ext_key: MASKED_MOUNT_KEY.into() }
}

/// Check the CRIU images in `dir` against the default profile in user namespace `userns`
/// (see [`default_policy`]); refused images are a [`CheckpointError::Untrusted`].
pub fn check(dir: &Path, userns: Option<crab_common::api::IdRange>) -> Result<Checked> {
    let policy = default_policy(userns)?;
    crab_criu::images::check_dir(dir, &policy)
        .map_err(|source| CheckpointError::Untrusted { dir: dir.to_path_buf(), source })
}
