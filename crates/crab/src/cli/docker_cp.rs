//! `crab docker cp`: docker's `cp SRC NAME:DST`, `cp NAME:SRC DST` and `-` (a tar stream on
//! stdin or stdout), translated to the daemon's file service (`/v1/sandboxes/{name}/files…`:
//! stat, tar out of a path, tar in under a directory — run inside the sandbox, as the SDK's
//! `sb.files` and the E2B front's `/files` are).
//!
//! Path rules are docker's: a directory is copied *into* an existing directory (as
//! `DST/basename`) or *becomes* a missing one; `SRC/.` copies a directory's contents; a file
//! overwrites a file or lands in a directory; a missing destination's parent must exist. Paths
//! in the sandbox are taken from its `/`. An archive is checked before anything is extracted:
//! a member that is absolute, climbs out with `..`, or (from the sandbox) is not under the
//! copied name is refused with an error naming it, and nothing is written. Extraction on the
//! host goes through `tar::Entry::unpack_in`, which also refuses to write through a symlink
//! out of the destination.

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;

use crab_client::Client;
use crab_common::api::SandboxState;
use crab_common::files::{FileKind, FilesQuery};
use crab_common::{ApiError, ErrorCode};

/// One side of a `cp`.
#[derive(Debug, PartialEq)]
enum End {
    /// `-`: a tar stream on our stdin (source) or stdout (destination).
    Stream,
    /// A host path.
    Local(String),
    /// `NAME:PATH`.
    Sandbox { name: String, path: String },
}

/// docker's reading of an argument: `NAME:PATH` when a `:` comes before any `/` (so a local
/// path with a colon is written `./a:b`).
fn parse_end(s: &str) -> End {
    if s == "-" {
        return End::Stream;
    }
    match s.split_once(':') {
        Some((name, path)) if !name.is_empty() && !name.contains('/') => {
            End::Sandbox { name: name.to_string(), path: path.to_string() }
        }
        _ => End::Local(s.to_string()),
    }
}

/// The options of `crab docker cp`.
pub(super) struct CpOpts {
    /// `-a`: keep the archive's owners (else files belong to the copying side's root).
    pub archive: bool,
    /// `-L`: follow symlinks in the source.
    pub follow: bool,
}

pub(super) async fn cp(
    client: &Client,
    src: &str,
    dst: &str,
    o: CpOpts,
) -> Result<ExitCode, ApiError> {
    match (parse_end(src), parse_end(dst)) {
        (End::Sandbox { name, path }, End::Stream) => {
            let tar = pack_in_sandbox(client, &name, &path, o.follow).await?.0;
            std::io::stdout()
                .write_all(&tar)
                .and_then(|()| std::io::stdout().flush())
                .map_err(|e| ApiError::internal(format!("writing the archive to stdout: {e}")))?;
        }
        (End::Sandbox { name, path }, End::Local(local)) => {
            let (tar, top) = pack_in_sandbox(client, &name, &path, o.follow).await?;
            let contents = path.ends_with("/.");
            unpack_on_host(&tar, &name, &top, contents, Path::new(&local), o.archive)?;
        }
        (End::Stream, End::Sandbox { name, path }) => {
            let mut tar = Vec::new();
            std::io::stdin()
                .read_to_end(&mut tar)
                .map_err(|e| ApiError::invalid(format!("reading the archive on stdin: {e}"), ""))?;
            check_archive(&tar, None, "the archive on stdin")?;
            let dir = sandbox_path(&path);
            ensure_running(client, &name).await?;
            if probe(client, &name, &dir).await? != Probe::Dir {
                return Err(ApiError::invalid(
                    format!("{name}:{dir} is not a directory"),
                    "a tar stream (`-`) is extracted into an existing directory, as with docker",
                ));
            }
            unpack_in_sandbox(client, &name, &tar, &dir, o.archive).await?;
        }
        (End::Local(local), End::Sandbox { name, path }) => {
            copy_in(client, &local, &name, &path, &o).await?;
        }
        (End::Sandbox { .. }, End::Sandbox { .. }) => {
            return Err(ApiError::invalid(
                "copying between two sandboxes is not supported",
                "copy to the host first (`cp A:SRC DIR`), then in (`cp DIR/x B:DST`)",
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                format!("neither {src:?} nor {dst:?} names a sandbox"),
                "one side must be NAME:PATH (e.g. `crab docker cp ./repo mysb:/work`)",
            ))
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A sandbox path: relative ones are from the sandbox's `/` (docker's rule); no trailing `/.`.
fn sandbox_path(p: &str) -> String {
    let p = p.strip_suffix("/.").unwrap_or(p);
    let p = if p.starts_with('/') { p.to_string() } else { format!("/{p}") };
    if p.len() > 1 {
        p.trim_end_matches('/').to_string()
    } else {
        p
    }
}

fn split_path(p: &str) -> (String, String) {
    match p.rsplit_once('/') {
        Some(("", b)) => ("/".into(), b.into()),
        Some((d, b)) => (d.into(), b.into()),
        None => ("/".into(), p.into()),
    }
}

async fn ensure_running(client: &Client, name: &str) -> Result<(), ApiError> {
    let s: crab_common::api::SandboxInfo = client
        .call::<(), _>(crab_client::Method::GET, &format!("/v1/sandboxes/{name}"), None)
        .await?;
    // A parked one is woken by the copy itself.
    if !matches!(s.state, SandboxState::Running | SandboxState::Parked) {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {name:?} is stopped: cp runs tar inside it"),
            format!("start it first (`crab docker start {name}`: its newest restore point)"),
        ));
    }
    Ok(())
}

fn query(path: &str) -> FilesQuery {
    FilesQuery { path: Some(path.to_string()), ..Default::default() }
}

/// What a sandbox path is.
#[derive(Debug, PartialEq)]
enum Probe {
    Dir,
    File,
    /// Absent, and its parent is a directory.
    Missing,
    /// Absent, and so is its parent.
    NoParent,
}

async fn probe(client: &Client, name: &str, path: &str) -> Result<Probe, ApiError> {
    match client.file_stat(name, &query(path)).await {
        Ok(e) if e.kind == FileKind::Dir => Ok(Probe::Dir),
        Ok(_) => Ok(Probe::File),
        Err(e) if e.code == ErrorCode::NotFound => {
            match client.file_stat(name, &query(&split_path(path).0)).await {
                Ok(p) if p.kind == FileKind::Dir => Ok(Probe::Missing),
                Ok(_) => Ok(Probe::NoParent),
                Err(e) if e.code == ErrorCode::NotFound => Ok(Probe::NoParent),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

/// A tar of a sandbox path: the archive and its top member's name (`.` for `SRC/.`).
async fn pack_in_sandbox(
    client: &Client,
    name: &str,
    path: &str,
    follow: bool,
) -> Result<(Vec<u8>, String), ApiError> {
    ensure_running(client, name).await?;
    let contents = path.ends_with("/.");
    let p = sandbox_path(path);
    let base = if contents { ".".to_string() } else { split_path(&p).1 };
    if !contents && p == "/" {
        return Err(ApiError::invalid(
            "copying a sandbox's whole / is not supported",
            "name the directory to copy (or `NAME:/.` for the contents of /)",
        ));
    }
    let q = FilesQuery { contents: Some(contents), follow: Some(follow), ..query(&p) };
    match client.file_tar_out(name, &q).await {
        Ok(tar) => Ok((tar, base)),
        Err(e) if e.code == ErrorCode::NotFound => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("{name}:{p}: no such file or directory"),
            format!("list it with `crab docker exec {name} ls -la {}`", split_path(&p).0),
        )),
        Err(e) if e.code == ErrorCode::InvalidRequest && contents => Err(ApiError::invalid(
            format!("{name}:{p} is not a directory (SRC/. copies a directory's contents)"),
            "drop the trailing /.",
        )),
        Err(e) => Err(e),
    }
}

/// Refuse an archive with a member that is absolute or climbs with `..`, a link whose target
/// does either (hard links) — or, with `top`, a member not under `top`. `what` names the
/// archive in the error.
fn check_archive(tar: &[u8], top: Option<&str>, what: &str) -> Result<(), ApiError> {
    let unsafe_member = |p: &Path, why: &str| {
        ApiError::new(
            ErrorCode::UnsafeArchive,
            format!("{what} holds an unsafe member {:?} ({why}); nothing was copied", p.display()),
            "an archive's members must be relative paths without `..`",
        )
    };
    let bad = |e: std::io::Error| {
        ApiError::invalid(
            format!("{what} is not a valid tar archive: {e}"),
            "give a tar stream (not compressed)",
        )
    };
    let mut ar = tar::Archive::new(tar);
    for entry in ar.entries().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        // The raw bytes: `path()` would already have dropped a leading `/`.
        let raw = entry.path_bytes();
        let path = Path::new(std::str::from_utf8(&raw).unwrap_or("")).to_path_buf();
        if raw.first() == Some(&b'/') {
            return Err(unsafe_member(&path, "absolute"));
        }
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(unsafe_member(&path, "climbs out with .."));
        }
        if let Some(top) = top {
            let first = path.components().find(|c| *c != Component::CurDir);
            let ok = match first {
                None => top == ".",
                Some(c) => top == "." || c.as_os_str() == top,
            };
            if !ok {
                return Err(unsafe_member(&path, &format!("not under the copied {top:?}")));
            }
        }
        if entry.header().entry_type() == tar::EntryType::Link {
            if let Ok(Some(t)) = entry.link_name() {
                if t.is_absolute() || t.components().any(|c| c == Component::ParentDir) {
                    return Err(unsafe_member(&path, "a hard link out of the archive"));
                }
            }
        }
    }
    Ok(())
}

/// Extract the archive of sandbox `name`'s `top` at host path `dst` by docker's rules.
fn unpack_on_host(
    tar: &[u8],
    name: &str,
    top: &str,
    contents: bool,
    dst: &Path,
    archive: bool,
) -> Result<(), ApiError> {
    check_archive(tar, Some(top), &format!("the archive from sandbox {name}"))?;
    let src_is_dir = contents || first_is_dir(tar);
    let io = |what: &str, p: &Path, e: std::io::Error| {
        ApiError::internal(format!("{what} {}: {e}", p.display()))
    };
    let trailing_slash = dst.as_os_str().to_string_lossy().ends_with('/');
    // (directory to extract in, the name the top member gets there; None: keep it).
    let (root, rename): (PathBuf, Option<String>) = match std::fs::metadata(dst) {
        Ok(m) if m.is_dir() => (dst.to_path_buf(), None),
        Ok(_) if src_is_dir => {
            return Err(ApiError::invalid(
                format!("cannot copy a directory onto the file {}", dst.display()),
                "give a directory (existing: copied into it; missing: created)",
            ))
        }
        Ok(_) => file_target(dst)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if trailing_slash && !src_is_dir {
                return Err(ApiError::invalid(
                    format!("the directory {} does not exist", dst.display()),
                    "create it first, or drop the trailing / to name the file",
                ));
            }
            let (parent, base) = file_target(dst)?;
            if !parent.is_dir() {
                return Err(ApiError::invalid(
                    format!("the directory {} does not exist", parent.display()),
                    "create it first (docker cp creates only the last path element)",
                ));
            }
            if contents {
                let d = dst.to_path_buf();
                std::fs::create_dir(&d).map_err(|e| io("creating", &d, e))?;
                (d, None)
            } else {
                (parent, base)
            }
        }
        Err(e) => return Err(io("reading", dst, e)),
    };
    let unpack = |into: &Path| -> Result<(), ApiError> {
        let mut ar = tar::Archive::new(tar);
        ar.set_preserve_permissions(true);
        ar.set_preserve_ownerships(archive);
        ar.set_overwrite(true);
        for entry in ar.entries().map_err(|e| io("reading the archive for", into, e))? {
            let mut entry = entry.map_err(|e| io("reading the archive for", into, e))?;
            let path = entry.path().map_err(|e| io("a member's path for", into, e))?.into_owned();
            // `unpack_in` refuses (false) a member that would land outside `into` through a
            // symlink the archive made earlier.
            if !entry.unpack_in(into).map_err(|e| io("extracting into", into, e))? {
                return Err(ApiError::new(
                    ErrorCode::UnsafeArchive,
                    format!(
                        "the archive from sandbox {name} writes {} outside {} (through a symlink); stopped there",
                        path.display(),
                        into.display()
                    ),
                    "the copied tree holds a symlink out of it: copy what it points at instead",
                ));
            }
        }
        Ok(())
    };
    match rename {
        None => unpack(&root),
        Some(new) => {
            // Extracted beside the destination under its own name, then renamed into place
            // (a file destination is replaced, as docker does).
            let tmp = tempfile::Builder::new()
                .prefix(".crab-cp-")
                .tempdir_in(&root)
                .map_err(|e| io("making a staging directory in", &root, e))?;
            unpack(tmp.path())?;
            let from = tmp.path().join(top);
            let to = root.join(new);
            std::fs::rename(&from, &to)
                .map_err(|e| io(&format!("renaming {} to", from.display()), &to, e))
        }
    }
}

/// (parent directory, file name) of a destination path.
fn file_target(dst: &Path) -> Result<(PathBuf, Option<String>), ApiError> {
    let base = dst.file_name().map(|b| b.to_string_lossy().into_owned()).ok_or_else(|| {
        ApiError::invalid(
            format!("{} names no file", dst.display()),
            "give a path ending in a name",
        )
    })?;
    let parent = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, Some(base)))
}

fn first_is_dir(tar: &[u8]) -> bool {
    let mut ar = tar::Archive::new(tar);
    ar.entries()
        .ok()
        .and_then(|mut es| es.next())
        .and_then(Result::ok)
        .is_some_and(|e| e.header().entry_type() == tar::EntryType::Directory)
}

/// Host → sandbox for a local path.
async fn copy_in(
    client: &Client,
    local: &str,
    name: &str,
    path: &str,
    o: &CpOpts,
) -> Result<(), ApiError> {
    let contents = local.ends_with("/.");
    let src = Path::new(local.strip_suffix("/.").unwrap_or(local));
    let meta = if o.follow { std::fs::metadata(src) } else { std::fs::symlink_metadata(src) };
    let meta = meta.map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("{}: {e}", src.display()),
            "give an existing file or directory on this host",
        )
    })?;
    if contents && !meta.is_dir() {
        return Err(ApiError::invalid(
            format!("{} is not a directory (SRC/. copies a directory's contents)", src.display()),
            "drop the trailing /.",
        ));
    }
    // `.` and `..` are named after what they are.
    let src_name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .or_else(|| {
            std::fs::canonicalize(src)
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        })
        .unwrap_or_else(|| "root".into());
    ensure_running(client, name).await?;
    let dst = sandbox_path(path);
    let trailing_slash = path.ends_with('/') && dst != "/";
    // (directory in the sandbox to extract in, name of the top member; "." for contents).
    let (dir, top) = match probe(client, name, &dst).await? {
        Probe::Dir if contents => (dst.clone(), ".".to_string()),
        Probe::Dir => (dst.clone(), src_name),
        Probe::File if meta.is_dir() => {
            return Err(ApiError::invalid(
                format!("cannot copy a directory onto the file {name}:{dst}"),
                "give a directory (existing: copied into it; missing: created)",
            ))
        }
        Probe::File => split_path(&dst),
        Probe::Missing if trailing_slash && !meta.is_dir() => {
            return Err(ApiError::invalid(
                format!("the directory {name}:{dst} does not exist"),
                "create it first, or drop the trailing / to name the file",
            ))
        }
        Probe::Missing => split_path(&dst),
        Probe::NoParent => {
            return Err(ApiError::invalid(
                format!("the directory {name}:{} does not exist", split_path(&dst).0),
                "create it first (docker cp creates only the last path element)",
            ))
        }
    };
    let tar = pack_local(src, &top, meta.is_dir(), o.follow)?;
    unpack_in_sandbox(client, name, &tar, &dir, o.archive).await
}

/// A tar of a host file or tree, its top member named `top`.
fn pack_local(src: &Path, top: &str, is_dir: bool, follow: bool) -> Result<Vec<u8>, ApiError> {
    let err = |e: std::io::Error| {
        ApiError::invalid(
            format!("archiving {}: {e}", src.display()),
            "check the files are readable",
        )
    };
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(follow);
    if is_dir {
        b.append_dir_all(top, src).map_err(err)?;
    } else {
        b.append_path_with_name(src, top).map_err(err)?;
    }
    b.into_inner().map_err(err)
}

/// Extract `tar` in the sandbox's directory `dir` (the file service's tar in).
async fn unpack_in_sandbox(
    client: &Client,
    name: &str,
    tar: &[u8],
    dir: &str,
    archive: bool,
) -> Result<(), ApiError> {
    let q = FilesQuery { same_owner: Some(archive), ..query(dir) };
    client.file_tar_in(name, &q, tar.to_vec()).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ends_parse_like_docker() {
        assert_eq!(parse_end("-"), End::Stream);
        assert_eq!(parse_end("sb:/a/b"), End::Sandbox { name: "sb".into(), path: "/a/b".into() });
        assert_eq!(parse_end("./a:b"), End::Local("./a:b".into()));
        assert_eq!(parse_end("/x/a:b"), End::Local("/x/a:b".into()));
        assert_eq!(parse_end("file"), End::Local("file".into()));
    }

    #[test]
    fn sandbox_paths_are_from_root() {
        assert_eq!(sandbox_path("work/x/"), "/work/x");
        assert_eq!(sandbox_path("/work/."), "/work");
        assert_eq!(sandbox_path("/"), "/");
        assert_eq!(split_path("/a"), ("/".to_string(), "a".to_string()));
        assert_eq!(split_path("/a/b"), ("/a".to_string(), "b".to_string()));
    }

    fn raw_tar(name: &[u8]) -> Vec<u8> {
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
        h.set_size(1);
        h.set_mode(0o644);
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, &b"x"[..]).unwrap();
        b.into_inner().unwrap()
    }

    #[test]
    fn unsafe_members_are_refused() {
        let e = check_archive(&raw_tar(b"../evil"), None, "t").err().map(|e| e.message);
        assert!(e.is_some_and(|m| m.contains("\"../evil\"") && m.contains("..")));
        let e = check_archive(&raw_tar(b"/etc/evil"), None, "t").err().map(|e| e.message);
        assert!(e.is_some_and(|m| m.contains("absolute")));
        assert!(check_archive(&raw_tar(b"a/ok"), None, "t").is_ok());
        assert!(check_archive(&raw_tar(b"a/ok"), Some("a"), "t").is_ok());
        let e = check_archive(&raw_tar(b"b/other"), Some("a"), "t").err().map(|e| e.message);
        assert!(e.is_some_and(|m| m.contains("not under")));
        let e = check_archive(
            b"not a tar at all, long enough to be read as a header block.....",
            None,
            "t",
        );
        assert!(e.is_err());
    }
}
