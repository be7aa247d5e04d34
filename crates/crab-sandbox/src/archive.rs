//! Safety checks and unpacking for image imports.
//!
//! An imported root filesystem may not reach outside itself: no absolute entry paths, no `..`
//! components, no hard link to a path outside the archive, and no relative symlink whose target
//! climbs above the root, and no entry at or under a path an earlier entry made a symlink.
//! Absolute symlink targets are fine: inside a sandbox they resolve against the sandbox's own
//! root, and the daemon's own writes into a root never follow them ([`crate::inroot`]). Every
//! refusal names the offending entry.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use crab_common::Progress;

use crate::error::{Result, SandboxError};

fn unsafe_entry(src: &Path, entry: &str, why: &str) -> SandboxError {
    SandboxError::UnsafeEntry {
        source_path: src.to_path_buf(),
        entry: entry.to_string(),
        why: why.to_string(),
    }
}

/// Depth-check a path relative to the root: `Err` when it is absolute or has `..`.
fn check_entry_path(src: &Path, p: &Path) -> Result<()> {
    let shown = p.display().to_string();
    for c in p.components() {
        match c {
            Component::RootDir | Component::Prefix(_) => {
                return Err(unsafe_entry(src, &shown, "has an absolute path"))
            }
            Component::ParentDir => return Err(unsafe_entry(src, &shown, "has a `..` component")),
            Component::CurDir | Component::Normal(_) => {}
        }
    }
    Ok(())
}

/// Whether a relative symlink at `link` (relative to the root) pointing to `target` stays inside.
fn symlink_stays_inside(link: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return true;
    }
    let mut depth: i64 = link
        .parent()
        .map(|p| p.components().filter(|c| matches!(c, Component::Normal(_))).count() as i64)
        .unwrap_or(0);
    for c in target.components() {
        match c {
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            Component::Normal(_) => depth += 1,
            _ => {}
        }
    }
    true
}

/// Check every entry of a directory tree.
pub fn check_dir(root: &Path) -> Result<()> {
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let rd = std::fs::read_dir(&dir).map_err(SandboxError::io("list", &dir))?;
        for e in rd {
            let e = e.map_err(SandboxError::io("list", &dir))?;
            let rel_path = rel.join(e.file_name());
            let ft = e.file_type().map_err(SandboxError::io("stat", e.path()))?;
            if ft.is_symlink() {
                let target =
                    std::fs::read_link(e.path()).map_err(SandboxError::io("readlink", e.path()))?;
                if !symlink_stays_inside(&rel_path, &target) {
                    return Err(unsafe_entry(
                        root,
                        &rel_path.display().to_string(),
                        &format!("is a symlink to {} which leaves the root", target.display()),
                    ));
                }
            } else if ft.is_dir() {
                stack.push(rel_path);
            }
        }
    }
    Ok(())
}

fn open_tar(path: &Path) -> Result<Box<dyn Read>> {
    let mut f = File::open(path).map_err(SandboxError::io("open", path))?;
    let mut magic = [0u8; 6];
    let n = f.read(&mut magic).map_err(SandboxError::io("read", path))?;
    let f = File::open(path).map_err(SandboxError::io("open", path))?;
    let r = BufReader::new(f);
    if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        return Ok(Box::new(flate2::read::GzDecoder::new(r)));
    }
    if n >= 4 && magic[..4] == [0x28, 0xb5, 0x2f, 0xfd]
        || n >= 6 && magic == [0xfd, b'7', b'z', b'X', b'Z', 0]
    {
        return Err(SandboxError::Invalid(format!(
            "{} is zstd/xz compressed; decompress it first or use a plain or gzip tar",
            path.display()
        )));
    }
    Ok(Box::new(r))
}

/// Check every entry of a tar archive; returns the number of entries.
pub fn check_tar(path: &Path) -> Result<u64> {
    let mut ar = tar::Archive::new(open_tar(path)?);
    let mut n = 0;
    let bad = |e: std::io::Error| {
        SandboxError::Invalid(format!("{} is not a readable tar archive: {e}", path.display()))
    };
    // Symlinks seen so far: a later entry at or under one would be written through it.
    let mut links: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
    for entry in ar.entries().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        let p = entry.path().map_err(bad)?.into_owned();
        check_entry_path(path, &p)?;
        let norm: PathBuf = p.components().filter(|c| matches!(c, Component::Normal(_))).collect();
        if let Some(l) = norm.ancestors().find(|a| links.contains(*a)) {
            return Err(unsafe_entry(
                path,
                &p.display().to_string(),
                &format!(
                    "would be written through the symlink {} earlier in the archive",
                    l.display()
                ),
            ));
        }
        let kind = entry.header().entry_type();
        if kind.is_symlink() {
            links.insert(norm);
        }
        if let Some(target) = entry.link_name().map_err(bad)? {
            let shown = p.display().to_string();
            if kind.is_hard_link() {
                check_entry_path(path, &target).map_err(|_| {
                    unsafe_entry(
                        path,
                        &shown,
                        &format!("is a hard link to {} outside the root", target.display()),
                    )
                })?;
            } else if kind.is_symlink() && !symlink_stays_inside(&p, &target) {
                return Err(unsafe_entry(
                    path,
                    &shown,
                    &format!("is a symlink to {} which leaves the root", target.display()),
                ));
            }
        }
        n += 1;
    }
    Ok(n)
}

/// Unpack a checked archive into `dst`, preserving modes, owners and xattrs.
pub fn unpack_tar(path: &Path, dst: &Path, progress: &dyn Progress) -> Result<()> {
    let mut ar = tar::Archive::new(open_tar(path)?);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(true);
    ar.set_unpack_xattrs(true);
    ar.set_overwrite(true);
    let bad = |e: std::io::Error| SandboxError::Other(format!("unpacking {}: {e}", path.display()));
    for (i, entry) in ar.entries().map_err(bad)?.enumerate() {
        let mut entry = entry.map_err(bad)?;
        entry.unpack_in(dst).map_err(bad)?;
        if i % 256 == 0 {
            progress.advance(i as u64);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlink_escape_rules() {
        assert!(symlink_stays_inside(Path::new("usr/bin/x"), Path::new("/etc/alternatives/x")));
        assert!(symlink_stays_inside(Path::new("usr/bin/x"), Path::new("../lib/x")));
        assert!(symlink_stays_inside(Path::new("usr/bin/x"), Path::new("../../etc/x")));
        assert!(!symlink_stays_inside(Path::new("usr/bin/x"), Path::new("../../../etc/x")));
        assert!(!symlink_stays_inside(Path::new("x"), Path::new("../x")));
        assert!(!symlink_stays_inside(Path::new("a/x"), Path::new("b/../../../x")));
    }

    #[test]
    fn entry_paths() {
        let src = Path::new("a.tar");
        assert!(check_entry_path(src, Path::new("etc/passwd")).is_ok());
        assert!(check_entry_path(src, Path::new("./etc")).is_ok());
        assert!(check_entry_path(src, Path::new("/etc/passwd")).is_err());
        assert!(check_entry_path(src, Path::new("etc/../../x")).is_err());
    }
}
