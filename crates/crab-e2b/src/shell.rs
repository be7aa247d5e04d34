//! How an envd call becomes a command in the sandbox: the user switch (`setpriv` to E2B's
//! `user` account unless the call asks for root), and the small POSIX-shell programs behind the
//! filesystem calls, whose `find -printf` output (NUL-separated) is parsed into `EntryInfo`s.
//! Their exit codes say why they failed (see [`FsFailure`]). envd's processes are the host's
//! background-process service's (`crab_sandbox::procs`, see [`crate::process`]).

use std::time::{Duration, UNIX_EPOCH};

use crate::envd::{EntryInfo, FileType};

/// The account commands run as when the call names none (E2B's templates' default user).
pub const DEFAULT_USER: &str = "user";

/// `find -printf` format of one entry: path, own type, size, octal mode, symbolic mode, owner,
/// group, mtime, link target, the target's type.
const FIND_FMT: &str = r"%p\0%y\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0%Y\0";

/// The user an envd call runs as: `Authorization: Basic base64("name:")`, else [`DEFAULT_USER`].
pub fn user_from_basic(header: Option<&str>) -> Result<String, String> {
    use base64::Engine;
    let Some(h) = header else { return Ok(DEFAULT_USER.to_string()) };
    let b64 = h
        .strip_prefix("Basic ")
        .ok_or_else(|| "Authorization must be `Basic base64(user:)`".to_string())?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| "Authorization: the Basic credentials are not base64".to_string())?;
    let s = String::from_utf8(raw).map_err(|_| "Authorization: user is not UTF-8".to_string())?;
    let user = s.split(':').next().unwrap_or("").to_string();
    check_user(&user)?;
    Ok(if user.is_empty() { DEFAULT_USER.to_string() } else { user })
}

/// A user name usable on a command line (POSIX portable names).
pub fn check_user(user: &str) -> Result<(), String> {
    if user.len() > 32
        || !user.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        || user.starts_with('-')
    {
        return Err(format!("invalid user name {user:?}"));
    }
    Ok(())
}

/// The home directory of `user` (E2B's convention: `/root` or `/home/<user>`).
pub fn home_of(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// An absolute path: relative ones are taken from the user's home (as envd does).
pub fn absolute(path: &str, user: &str) -> String {
    let p = if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() || path == "~" {
        home_of(user)
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{}/{rest}", home_of(user))
    } else {
        format!("{}/{path}", home_of(user))
    };
    if p.len() > 1 {
        p.trim_end_matches('/').to_string()
    } else {
        p
    }
}

/// argv that runs `argv` as `user` with `envs` (for root: as is; the envs go in the exec's
/// own environment). Other users get a fresh login environment (`setpriv --reset-env`: HOME,
/// USER, SHELL, PATH from their passwd entry) plus `envs`.
pub fn as_user(
    user: &str,
    envs: &[(String, String)],
    argv: Vec<String>,
) -> (Vec<String>, Vec<String>) {
    let kv: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if user == "root" {
        let mut env = vec!["HOME=/root".to_string(), "USER=root".to_string()];
        env.extend(kv);
        return (argv, env);
    }
    let mut cmd: Vec<String> = [
        "setpriv",
        &format!("--reuid={user}"),
        &format!("--regid={user}"),
        "--init-groups",
        "--reset-env",
        "--",
        "env",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    cmd.extend(kv);
    cmd.extend(argv);
    (cmd, Vec::new())
}

/// Why a filesystem program failed, from its exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsFailure {
    /// 43.
    PermissionDenied,
    /// 44.
    NotFound,
    /// 45.
    AlreadyExists,
    /// 46.
    NotADirectory,
    /// 47.
    IsADirectory,
}

impl FsFailure {
    /// From an exit code.
    pub fn from_code(code: i32) -> Option<FsFailure> {
        Some(match code {
            43 => FsFailure::PermissionDenied,
            44 => FsFailure::NotFound,
            45 => FsFailure::AlreadyExists,
            46 => FsFailure::NotADirectory,
            47 => FsFailure::IsADirectory,
            _ => return None,
        })
    }
}

fn sh(script: &str, args: &[&str]) -> Vec<String> {
    let mut v =
        vec!["/bin/sh".to_string(), "-c".to_string(), script.to_string(), "crab-e2b".to_string()];
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

const EXISTS: &str = r#"[ -e "$1" ] || [ -L "$1" ] || exit 44; "#;

/// Describe one path.
pub fn stat(path: &str) -> Vec<String> {
    sh(&format!(r#"{EXISTS}exec find "$1" -maxdepth 0 -printf '{FIND_FMT}'"#), &[path])
}

/// List a directory `depth` levels deep.
pub fn list(path: &str, depth: u32) -> Vec<String> {
    let d = depth.max(1).to_string();
    sh(
        &format!(
            r#"{EXISTS}[ -d "$1" ] || exit 46; [ -r "$1" ] && [ -x "$1" ] || exit 43; exec find "$1" -mindepth 1 -maxdepth "$2" -printf '{FIND_FMT}'"#
        ),
        &[path, &d],
    )
}

/// Make a directory and its parents; 45 when it exists.
pub fn make_dir(path: &str) -> Vec<String> {
    sh(
        &format!(
            r#"{{ [ -e "$1" ] || [ -L "$1" ]; }} && exit 45; mkdir -p -- "$1" 2>/dev/null || exit 43; exec find "$1" -maxdepth 0 -printf '{FIND_FMT}'"#
        ),
        &[path],
    )
}

/// Remove a file or a tree.
pub fn remove(path: &str) -> Vec<String> {
    sh(&format!(r#"{EXISTS}rm -rf -- "$1" 2>/dev/null || exit 43"#), &[path])
}

/// Rename, making the destination's parents.
pub fn rename(src: &str, dst: &str) -> Vec<String> {
    sh(
        &format!(
            r#"{EXISTS}mkdir -p -- "$(dirname -- "$2")" 2>/dev/null && mv -fT -- "$1" "$2" 2>/dev/null || exit 43; exec find "$2" -maxdepth 0 -printf '{FIND_FMT}'"#
        ),
        &[src, dst],
    )
}

/// Print a file's bytes.
pub fn read(path: &str) -> Vec<String> {
    sh(
        r#"[ -e "$1" ] || exit 44; [ -d "$1" ] && exit 47; [ -r "$1" ] || exit 43; exec cat -- "$1""#,
        &[path],
    )
}

/// Write stdin to a file (making its parents), then describe it.
pub fn write(path: &str) -> Vec<String> {
    sh(
        &format!(
            r#"mkdir -p -- "$(dirname -- "$1")" 2>/dev/null || exit 43; [ -d "$1" ] && exit 47; cat > "$1" 2>/dev/null || exit 43; exec find "$1" -maxdepth 0 -printf '{FIND_FMT}'"#
        ),
        &[path],
    )
}

fn kind(c: &str) -> FileType {
    match c {
        "f" => FileType::File,
        "d" => FileType::Directory,
        "l" | "N" | "L" => FileType::Symlink,
        _ => FileType::Unspecified,
    }
}

/// Parse `find -printf FIND_FMT` output.
pub fn parse_entries(out: &[u8]) -> Result<Vec<EntryInfo>, String> {
    let text = String::from_utf8_lossy(out);
    let fields: Vec<&str> = text.split('\0').collect();
    // A trailing NUL leaves one empty field after the last record.
    let n = fields.len().saturating_sub(1);
    if !n.is_multiple_of(10) {
        return Err(format!("unexpected listing output ({n} fields)"));
    }
    let mut entries = Vec::with_capacity(n / 10);
    for r in fields[..n].chunks(10) {
        let path = r[0].to_string();
        let own = r[1];
        let is_symlink = own == "l";
        let name = if path == "/" {
            "/".to_string()
        } else {
            path.rsplit('/').next().unwrap_or(&path).to_string()
        };
        let mtime: f64 = r[7].parse().unwrap_or(0.0);
        let modified = UNIX_EPOCH + Duration::from_secs_f64(mtime.max(0.0));
        entries.push(EntryInfo {
            name,
            kind: if is_symlink { kind(r[9]) } else { kind(own) },
            path,
            size: r[2].parse().unwrap_or(0),
            mode: u32::from_str_radix(r[3], 8).unwrap_or(0),
            permissions: r[4].to_string(),
            owner: r[5].to_string(),
            group: r[6].to_string(),
            modified_time: humantime::format_rfc3339_nanos(modified).to_string(),
            symlink_target: is_symlink.then(|| r[8].to_string()),
            is_symlink,
        });
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_user() {
        assert_eq!(user_from_basic(None).as_deref(), Ok("user"));
        assert_eq!(user_from_basic(Some("Basic cm9vdDo=")).as_deref(), Ok("root"));
        assert!(user_from_basic(Some("Bearer x")).is_err());
        // "a b:" has a space: refused rather than passed to setpriv.
        assert!(user_from_basic(Some("Basic YSBiOg==")).is_err());
    }

    #[test]
    fn paths_are_absolute() {
        assert_eq!(absolute("x/y", "user"), "/home/user/x/y");
        assert_eq!(absolute("~/a/", "root"), "/root/a");
        assert_eq!(absolute("/", "user"), "/");
        assert_eq!(absolute("", "user"), "/home/user");
    }

    #[test]
    fn users_switch_with_setpriv() {
        let (argv, env) = as_user("user", &[("A".into(), "1".into())], vec!["id".into()]);
        assert_eq!(argv[0], "setpriv");
        assert!(argv.contains(&"A=1".to_string()));
        assert_eq!(argv.last().map(String::as_str), Some("id"));
        assert!(env.is_empty());
        let (argv, env) = as_user("root", &[("A".into(), "1".into())], vec!["id".into()]);
        assert_eq!(argv, vec!["id".to_string()]);
        assert!(env.contains(&"A=1".to_string()));
    }

    /// The envd programs run here with the host's own sh and coreutils: a start says its pid,
    /// then the output (stdout and stderr apart), and ends with the exit status; a follow of a
    /// running process streams from now on and ends with its status; a signal reaches the
    /// command, not the supervisor, which records the status; a follow of an ended process says
    /// so with its status.
    #[test]
    fn listing_parses() {
        let fields = [
            "/home/user/a.txt",
            "f",
            "5",
            "644",
            "-rw-r--r--",
            "user",
            "user",
            "1700000000.5",
            "",
            "f",
            "/home/user/l",
            "l",
            "4",
            "777",
            "lrwxrwxrwx",
            "user",
            "user",
            "1700000000",
            "/etc",
            "d",
        ];
        let out: Vec<u8> = fields.iter().flat_map(|f| format!("{f}\0").into_bytes()).collect();
        let out = out.as_slice();
        let e = parse_entries(out).expect("parses");
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].name, "a.txt");
        assert_eq!(e[0].kind, FileType::File);
        assert_eq!(e[0].size, 5);
        assert_eq!(e[0].mode, 0o644);
        assert!(e[0].modified_time.starts_with("2023-11-14T22:13:20"), "{}", e[0].modified_time);
        assert!(e[1].is_symlink);
        assert_eq!(e[1].kind, FileType::Directory);
        assert_eq!(e[1].symlink_target.as_deref(), Some("/etc"));
        assert!(parse_entries(b"a\0b\0").is_err());
        assert!(parse_entries(b"").expect("empty").is_empty());
    }
}
