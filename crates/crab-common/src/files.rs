//! The vocabulary of the sandbox file service (`crab_sandbox::files`) that every front door
//! speaks: a path's description ([`FileEntry`]), the query of the daemon's
//! `/v1/sandboxes/{name}/files…` routes ([`FilesQuery`]), and how a path given by a client
//! becomes the absolute path the service resolves inside the sandbox ([`resolve_path`]: `~` and
//! relative paths from the user's home, as E2B's envd does; no NUL; bounded length) and which
//! account names are accepted ([`check_user`]).

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// Longest path the file service accepts (Linux's `PATH_MAX`).
pub const MAX_PATH: usize = 4096;

/// The account a file operation runs as when the caller names none.
pub const ROOT: &str = "root";

/// What a path is (a symlink is described by what it points at, with
/// [`FileEntry::is_symlink`] set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// Anything else (device, socket, FIFO, a dangling symlink).
    Other,
}

/// One path inside a sandbox, as the file service describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Last component (`/` for the root).
    pub name: String,
    /// Absolute path inside the sandbox.
    pub path: String,
    /// What it is (a symlink: what it points at).
    pub kind: FileKind,
    /// Whether it is a symlink.
    pub is_symlink: bool,
    /// A symlink's target, as stored (never followed on the host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (e.g. `0o644`).
    pub mode: u32,
    /// Symbolic mode (`-rw-r--r--`).
    pub permissions: String,
    /// Owner's name (or uid when it has none).
    pub owner: String,
    /// Group's name (or gid).
    pub group: String,
    /// Modification time, seconds since the epoch.
    pub modified_s: f64,
}

/// Query parameters of the file routes (each route reads the ones it documents).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilesQuery {
    /// The path (absolute, `~/…`, or relative to the user's home).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The account inside the sandbox (default root); files written are owned by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `list`: how many levels deep (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
    /// write: permission bits to set, octal (`755`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// rename: the new path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// tar out: archive the directory's contents (members `./…`) instead of the path itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contents: Option<bool>,
    /// tar out: follow symlinks (`tar -h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<bool>,
    /// tar in: keep the archive's owners (root only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_owner: Option<bool>,
}

/// An account name usable on a command line (POSIX portable names, at most 32 bytes).
pub fn check_user(user: &str) -> Result<(), ApiError> {
    if user.is_empty()
        || user.len() > 32
        || !user.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
        || user.starts_with('-')
    {
        return Err(ApiError::invalid(
            format!("invalid user name {user:?}"),
            "name an account of the sandbox (letters, digits, `_`, `-`, `.`; at most 32)",
        ));
    }
    Ok(())
}

/// The home directory of `user` (envd's convention: `/root` or `/home/<user>`).
pub fn home_of(user: &str) -> String {
    if user == ROOT {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// The absolute path the service resolves inside the sandbox: `~`, `~/…` and relative paths are
/// taken from `user`'s home (as envd does); a trailing `/` is dropped. Refused: a NUL byte, a
/// path longer than [`MAX_PATH`].
pub fn resolve_path(path: &str, user: &str) -> Result<String, ApiError> {
    if path.contains('\0') {
        return Err(ApiError::invalid(
            format!("path {:?} holds a NUL byte", path.replace('\0', "\\0")),
            "pass a path without NUL",
        ));
    }
    let p = if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() || path == "~" {
        home_of(user)
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{}/{rest}", home_of(user))
    } else {
        format!("{}/{path}", home_of(user))
    };
    if p.len() > MAX_PATH {
        return Err(ApiError::invalid(
            format!("path is {} bytes long; the limit is {MAX_PATH}", p.len()),
            "pass a shorter path",
        ));
    }
    let t = p.trim_end_matches('/');
    Ok(if t.is_empty() { "/".into() } else { t.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_like_envd() {
        let r = |p: &str, u: &str| resolve_path(p, u).ok();
        assert_eq!(r("x/y", "user").as_deref(), Some("/home/user/x/y"));
        assert_eq!(r("~/a/", "root").as_deref(), Some("/root/a"));
        assert_eq!(r("~", "bob").as_deref(), Some("/home/bob"));
        assert_eq!(r("/", "user").as_deref(), Some("/"));
        assert_eq!(r("///", "user").as_deref(), Some("/"));
        assert_eq!(r("", "user").as_deref(), Some("/home/user"));
        assert!(resolve_path("/a\0b", "root").is_err());
        assert!(resolve_path(&"a".repeat(MAX_PATH + 1), "root").is_err());
    }

    #[test]
    fn users_are_plain_names() {
        assert!(check_user("user").is_ok());
        assert!(check_user("www-data").is_ok());
        for bad in ["", "-x", "a b", "a:b", "a/b", &"u".repeat(33)] {
            assert!(check_user(bad).is_err(), "{bad:?}");
        }
    }
}
