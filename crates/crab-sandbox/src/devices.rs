//! The device allowlist as a cgroup-v2 device program: `bpf/devices.bpf.c`
//! (`BPF_PROG_TYPE_CGROUP_DEVICE`), built by libbpf-cargo like the inspector's programs,
//! loaded once per process and attached to every sandbox's cgroup2 directory with the legacy
//! `BPF_PROG_ATTACH` (not a bpf link): the attachment lives as long as the cgroup, so it holds
//! while the daemon is down and needs no pinning. Attaching again (a restore reusing the group)
//! replaces the program. On hybrid hosts the cgroup-v1 `devices` controller enforces the same
//! list as well; on pure cgroup2 hosts this program is the enforcement.

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;

use libbpf_rs::skel::{OpenSkel as _, SkelBuilder as _};
use libbpf_rs::OpenObject;

#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    clippy::unwrap_used,
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unsafe_op_in_unsafe_fn
)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/devices.skel.rs"));
}

/// `BPF_PROG_ATTACH` (`enum bpf_cmd`).
const BPF_PROG_ATTACH: libc::c_long = 8;
/// `BPF_CGROUP_DEVICE` (`enum bpf_attach_type`).
const BPF_CGROUP_DEVICE: u32 = 6;

/// The device program could not be loaded or attached.
#[derive(Debug, thiserror::Error)]
#[error("cgroup device program: {0}")]
pub struct DeviceFilterError(String);

/// The loaded program, shared by every attachment of this process.
static PROG: Mutex<Option<OwnedFd>> = Mutex::new(None);

fn load() -> Result<OwnedFd, DeviceFilterError> {
    let mut obj = MaybeUninit::<OpenObject>::uninit();
    let open = skel::DevicesSkelBuilder::default()
        .open(&mut obj)
        .map_err(|e| DeviceFilterError(format!("open: {e}")))?;
    let loaded = open.load().map_err(|e| DeviceFilterError(format!("load (verifier): {e}")))?;
    // The fd keeps the program alive after the skeleton and its object are gone.
    loaded
        .progs
        .crab_devices
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| DeviceFilterError(format!("dup program fd: {e}")))
}

/// Attach the allowlist program to the cgroup2 directory `cgroup` (replacing one attached
/// before).
pub fn attach(cgroup: &Path) -> Result<(), DeviceFilterError> {
    let mut prog = PROG.lock().unwrap_or_else(|p| p.into_inner());
    if prog.is_none() {
        *prog = Some(load()?);
    }
    let Some(fd) = prog.as_ref() else { return Err(DeviceFilterError("not loaded".into())) };
    let dir = std::fs::File::open(cgroup)
        .map_err(|e| DeviceFilterError(format!("open {}: {e}", cgroup.display())))?;
    // union bpf_attr for BPF_PROG_ATTACH: target_fd, attach_bpf_fd, attach_type, attach_flags
    // (0: one program, replaced by the next attach), then zeroes.
    let mut attr = [0u32; 12];
    attr[0] = dir.as_raw_fd() as u32;
    attr[1] = fd.as_raw_fd() as u32;
    attr[2] = BPF_CGROUP_DEVICE;
    // SAFETY: bpf(2) reads `size_of_val(&attr)` bytes from `attr`, a live, initialized array;
    // both fds stay open for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_ATTACH,
            attr.as_ptr(),
            std::mem::size_of_val(&attr) as libc::c_uint,
        )
    };
    if r < 0 {
        return Err(DeviceFilterError(format!(
            "BPF_PROG_ATTACH to {}: {}",
            cgroup.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The C program's list is the profile's (plus devpts' 136:*).
    #[test]
    fn program_matches_the_profile_list() {
        let src = include_str!("bpf/devices.bpf.c");
        for (name, major, minor) in crate::profile::ALLOWED_DEVICES {
            assert!(src.contains(&format!("{name} {major}:{minor}")), "{name} missing");
            assert!(src.contains(&format!("minor == {minor}")), "{name}: no minor check");
            assert!(src.contains(&format!("major == {major}")), "{name}: no major check");
        }
        assert!(src.contains("major == 136"));
    }
}
