//! The btrfs storage pool under the state directory.
//!
//! When the state directory is already on btrfs, the pool is the plain directory
//! `<state>/pool`. Otherwise Crab keeps a sparse file `<state>/pool.img`, formats it btrfs once
//! and loop-mounts it at `<state>/pool`; after a reboot the same call mounts the existing file
//! again, so nothing is lost. The loop mount is `nosuid,nodev`. Everything Crab stores (images, sandboxes, checkpoints) lives in the
//! pool as subvolumes and small JSON records.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crab_common::paths::StateDir;

use crate::btrfs;
use crate::error::{Result, SandboxError};

/// Default size of a new sparse pool file: 32 GiB.
pub const DEFAULT_POOL_SIZE: u64 = 32 << 30;

/// How the pool is provided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The state directory is on btrfs already.
    Native,
    /// A loop-mounted sparse image.
    LoopFile,
}

/// Make sure the pool exists and is mounted; create its directories.
pub fn ensure(state: &StateDir, size: u64) -> Result<PoolKind> {
    require_root()?;
    fs::create_dir_all(state.root()).map_err(SandboxError::io("create", state.root()))?;
    fs::set_permissions(state.root(), fs::Permissions::from_mode(0o700))
        .map_err(SandboxError::io("chmod", state.root()))?;
    fs::create_dir_all(state.logs()).map_err(SandboxError::io("create", state.logs()))?;
    let pool = state.pool();
    fs::create_dir_all(&pool).map_err(SandboxError::io("create", &pool))?;
    let kind = if is_btrfs(state.root())? {
        PoolKind::Native
    } else {
        if !is_btrfs(&pool)? {
            mount_loop(state, size)?;
        } else {
            harden_mount(&pool);
        }
        PoolKind::LoopFile
    };
    for dir in [state.images(), state.sandboxes(), state.pool().join("checkpoints"), state.tmp()] {
        fs::create_dir_all(&dir).map_err(SandboxError::io("create", &dir))?;
    }
    Ok(kind)
}

fn is_btrfs(p: &Path) -> Result<bool> {
    btrfs::is_btrfs(p).map_err(SandboxError::io("statfs", p))
}

/// Fail unless the effective uid is 0.
pub fn require_root() -> Result<()> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 {
        return Err(SandboxError::NotRoot(euid));
    }
    Ok(())
}

fn btrfs_supported() -> bool {
    let has = || {
        fs::read_to_string("/proc/filesystems")
            .map(|s| s.lines().any(|l| l.trim_end().ends_with("btrfs")))
            .unwrap_or(false)
    };
    if has() {
        return true;
    }
    let _ = Command::new("modprobe").arg("btrfs").status();
    has()
}

fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| SandboxError::Command {
        cmd: shown.clone(),
        detail: format!("could not start: {e}"),
    })?;
    if !out.status.success() {
        return Err(SandboxError::Command {
            cmd: shown,
            detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()),
        });
    }
    Ok(())
}

/// Options of the pool's loop mount. `nosuid,nodev`: a set-uid binary or a device node that a
/// sandbox or an imported image leaves in the pool grants nothing on the host (sandboxes run as
/// root and get their `/dev` from a fresh tmpfs, so they need neither).
const MOUNT_OPTS: &str = "loop,noatime,nosuid,nodev";

/// Add `nosuid,nodev` to a pool mounted by an older daemon (best effort: logged, not fatal).
fn harden_mount(pool: &Path) {
    let Ok(st) = nix::sys::statvfs::statvfs(pool) else { return };
    let flags = st.flags();
    use nix::sys::statvfs::FsFlags;
    if flags.contains(FsFlags::ST_NOSUID) && flags.contains(FsFlags::ST_NODEV) {
        return;
    }
    match run(Command::new("mount").args(["-o", "remount,nosuid,nodev"]).arg(pool)) {
        Ok(()) => tracing::info!(pool = %pool.display(), "remounted the pool nosuid,nodev"),
        Err(e) => {
            tracing::warn!(pool = %pool.display(), error = %e, "could not remount the pool nosuid,nodev")
        }
    }
}

fn mount_loop(state: &StateDir, size: u64) -> Result<()> {
    if !btrfs_supported() {
        return Err(SandboxError::Host {
            what: "this kernel has no btrfs support (not in /proc/filesystems, modprobe failed)"
                .into(),
            hint: "load the btrfs module or put the state directory on a btrfs filesystem".into(),
        });
    }
    let img = state.pool_image();
    if !img.exists() {
        if which("mkfs.btrfs").is_none() {
            return Err(SandboxError::Host {
                what: "mkfs.btrfs is not installed".into(),
                hint: "install btrfs-progs (`make setup` does it)".into(),
            });
        }
        let tmp = img.with_extension("img.new");
        let f = fs::File::create(&tmp).map_err(SandboxError::io("create", &tmp))?;
        f.set_len(size).map_err(SandboxError::io("truncate", &tmp))?;
        drop(f);
        run(Command::new("mkfs.btrfs").args(["-q", "-f", "-L", "crab-pool"]).arg(&tmp))?;
        fs::rename(&tmp, &img).map_err(SandboxError::io("rename", &tmp))?;
        tracing::info!(path = %img.display(), size, "created btrfs pool image");
    }
    run(Command::new("mount").args(["-t", "btrfs", "-o", MOUNT_OPTS]).arg(&img).arg(state.pool()))?;
    tracing::info!(pool = %state.pool().display(), "mounted btrfs pool");
    Ok(())
}

/// Look a program up in `PATH`.
pub fn which(prog: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path).map(|d| d.join(prog)).find(|p| p.is_file())
}

/// Free bytes in the pool, from `statvfs`.
pub fn free_bytes(state: &StateDir) -> Result<u64> {
    let st = nix::sys::statvfs::statvfs(&state.pool()).map_err(|e| SandboxError::Io {
        op: "statvfs",
        path: state.pool(),
        source: e.into(),
    })?;
    Ok(st.blocks_available() * st.fragment_size())
}
