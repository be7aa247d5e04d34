//! Process images this host did not dump: vetted before CRIU may restore them.
//!
//! CRIU restores each task's capability sets, ids, securebits, `no_new_privs`, seccomp
//! filters and namespaces exactly as its images say. Images this host dumped say what the
//! profile gave the dumped processes; images from a remote store (`crab-remote`'s
//! materialization of a point) say whatever whoever wrote the store wanted. [`check`] holds
//! such a directory to the default profile (`crab_sandbox::profile`: Docker's default
//! capabilities minus `NET_RAW`, `no_new_privs`, this daemon's compiled seccomp filter at the
//! root of every thread's chain, the sandbox's own pid/mount/uts/ipc/network namespaces and no
//! user or time namespace; `--privileged` and host networking are never granted to such a
//! point) with `crab_criu::images::check_dir`, which names the task, the field and the value it
//! refuses.

use std::path::Path;

use crab_criu::images::{Checked, IdRange, NsPolicy, Policy};

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
    })
}

/// Check the CRIU images in `dir` against the default profile; refused images are a
/// [`CheckpointError::Untrusted`].
pub fn check(dir: &Path) -> Result<Checked> {
    let policy = default_policy()?;
    crab_criu::images::check_dir(dir, &policy)
        .map_err(|source| CheckpointError::Untrusted { dir: dir.to_path_buf(), source })
}
