//! Accounts inside a sandbox: an OCI `User` (`name`, `uid`, `name:group`, `uid:gid`) resolved
//! against the sandbox's own `/etc/passwd` and `/etc/group`, the way runc does, and the switch
//! to it. Runs in the exec helper once it is in the sandbox's namespaces: the files are the
//! sandbox's (hostile): read only when they are regular files, bounded, and what they say only
//! picks ids inside the sandbox's user namespace.

use std::ffi::CString;
use std::io::Read;

/// Largest `/etc/passwd` or `/etc/group` read.
const MAX_DB: u64 = 4 << 20;

/// Most supplementary groups set.
const MAX_GROUPS: usize = 64;

/// A resolved account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups (from `/etc/group` membership).
    pub groups: Vec<u32>,
    /// Home directory (`/` when the account has no passwd entry).
    pub home: String,
}

impl Account {
    /// Become this account: groups, then gid, then uid (which drops every capability).
    pub fn switch(&self) -> Result<(), String> {
        let groups: Vec<nix::unistd::Gid> =
            self.groups.iter().map(|g| nix::unistd::Gid::from_raw(*g)).collect();
        nix::unistd::setgroups(&groups).map_err(|e| format!("setgroups for the account: {e}"))?;
        let g = nix::unistd::Gid::from_raw(self.gid);
        nix::unistd::setresgid(g, g, g).map_err(|e| format!("setresgid({}): {e}", self.gid))?;
        let u = nix::unistd::Uid::from_raw(self.uid);
        nix::unistd::setresuid(u, u, u).map_err(|e| format!("setresuid({}): {e}", self.uid))
    }
}

/// Read a small regular file of the sandbox (not a FIFO or device: opened non-blocking and
/// checked), bounded; a missing file reads as empty.
fn read_db(path: &str) -> Result<String, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
        Err(e) => return Err(format!("cannot read {path}: {e}")),
    };
    let m = f.metadata().map_err(|e| format!("cannot stat {path}: {e}"))?;
    if !m.is_file() {
        return Err(format!("{path} is not a regular file"));
    }
    let mut s = Vec::new();
    f.take(MAX_DB).read_to_end(&mut s).map_err(|e| format!("cannot read {path}: {e}"))?;
    Ok(String::from_utf8_lossy(&s).into_owned())
}

/// Resolve `spec` against this process's `/etc/passwd` and `/etc/group`.
pub fn resolve(spec: &str) -> Result<Account, String> {
    let passwd = read_db("/etc/passwd")?;
    let group = read_db("/etc/group")?;
    resolve_in(spec, &passwd, &group)
}

/// [`resolve`] over the files' contents.
pub fn resolve_in(spec: &str, passwd: &str, group: &str) -> Result<Account, String> {
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    if u.is_empty() || u.contains('\0') {
        return Err(format!("user {spec:?} is malformed (NAME, UID, NAME:GROUP or UID:GID)"));
    }
    // passwd: name:x:uid:gid:gecos:home:shell
    let entry = passwd.lines().map(|l| l.split(':').collect::<Vec<_>>()).find(|f| {
        f.len() >= 7
            && (f[0] == u
                || (u.parse::<u32>().is_ok() && f[2].parse::<u32>().ok() == u.parse().ok()))
    });
    let (uid, mut gid, name, home) = match (&entry, u.parse::<u32>()) {
        (Some(f), _) => {
            let uid =
                f[2].parse::<u32>().map_err(|_| format!("/etc/passwd has a bad uid for {u}"))?;
            let gid =
                f[3].parse::<u32>().map_err(|_| format!("/etc/passwd has a bad gid for {u}"))?;
            (uid, gid, Some(f[0].to_string()), f[5].to_string())
        }
        // A numeric uid needs no entry (runc: gid 0, home /).
        (None, Ok(uid)) => (uid, 0, None, "/".to_string()),
        (None, Err(_)) => {
            return Err(format!("unable to find user {u}: no matching entries in /etc/passwd"))
        }
    };
    // group: name:x:gid:member,member
    let groups: Vec<Vec<&str>> =
        group.lines().map(|l| l.split(':').collect::<Vec<_>>()).filter(|f| f.len() >= 4).collect();
    if let Some(g) = g {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => {
                groups.iter().find(|f| f[0] == g).and_then(|f| f[2].parse().ok()).ok_or_else(
                    || format!("unable to find group {g}: no matching entries in /etc/group"),
                )?
            }
        };
    }
    let mut supp = vec![gid];
    if let Some(n) = &name {
        for f in &groups {
            if f[3].split(',').any(|m| m == n) {
                if let Ok(id) = f[2].parse::<u32>() {
                    if !supp.contains(&id) && supp.len() < MAX_GROUPS {
                        supp.push(id);
                    }
                }
            }
        }
    }
    let home =
        if home.is_empty() || CString::new(home.clone()).is_err() { "/".into() } else { home };
    Ok(Account { uid, gid, groups: supp, home })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nweb:x:33:33::/var/www:/usr/sbin/nologin\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\nweb:x:33:\naudio:x:29:user,web\n";

    #[test]
    fn names_and_ids_resolve_like_runc() {
        let a = resolve_in("user", PASSWD, GROUP).unwrap();
        assert_eq!((a.uid, a.gid, a.home.as_str()), (1000, 1000, "/home/user"));
        assert_eq!(a.groups, vec![1000, 29]);
        let a = resolve_in("1000:33", PASSWD, GROUP).unwrap();
        assert_eq!((a.uid, a.gid), (1000, 33));
        let a = resolve_in("web:audio", PASSWD, GROUP).unwrap();
        assert_eq!((a.uid, a.gid), (33, 29));
        let a = resolve_in("4242", PASSWD, GROUP).unwrap();
        assert_eq!((a.uid, a.gid, a.home.as_str()), (4242, 0, "/"));
        assert!(resolve_in("nobody-here", PASSWD, GROUP)
            .unwrap_err()
            .contains("unable to find user"));
        assert!(resolve_in("user:nogroup", PASSWD, GROUP)
            .unwrap_err()
            .contains("unable to find group"));
        assert!(resolve_in(":1", PASSWD, GROUP).is_err());
    }
}
