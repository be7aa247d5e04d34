//! What the E2B front door keeps on disk: the per-daemon secret (`<state>/e2b/token-secret`,
//! mode 0600) from which each sandbox's envd access token is derived (HMAC-SHA256 of the
//! sandbox id), so no token is stored. Nothing else: a sandbox's life (run state, deadline,
//! metadata, environment, template, snapshots) is the host's, in its record, and its envd
//! processes are the host's process service's. Older daemons kept one JSON file per E2B
//! sandbox under `<state>/e2b/sandboxes/` (formats 1 and 2); [`Store::load`] reads them so
//! the daemon hands them to the host once and deletes them. The old format is documented in
//! `docs/format.md` ("E2B front-door state"); the old
//! per-daemon secret (`<state>/e2b/token-secret`, mode 0600) from which each sandbox's envd
//! access token is derived (HMAC-SHA256 of the sandbox id), so no token is stored. The format is
//! documented in `docs/format.md` ("E2B front-door state").

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The newest version of an older daemon's sandbox file (2 added `processes` and `gc`).
pub const FORMAT: u32 = 2;

/// The oldest sandbox file version this crab reads.
pub const OLDEST_FORMAT: u32 = 1;

/// The run state of an E2B sandbox as persisted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoredState {
    /// Running.
    Running,
    /// Paused (processes stopped; `pause_point` restores them).
    Paused,
    /// Killed through E2B while it still held snapshots: its processes are stopped, it is
    /// hidden from the E2B API, and its restore points stay until its last snapshot is deleted.
    Killed,
}

/// One E2B snapshot: a restore point of its source sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSnapshot {
    /// The id `Sandbox.create` accepts (`<sandbox>:<point>`).
    pub id: String,
    /// The Crab restore point.
    pub point: String,
    /// A filesystem snapshot (sandboxes made from it get files, not processes).
    pub fs_only: bool,
    /// Names given at creation (also accepted as templates).
    #[serde(default)]
    pub names: Vec<String>,
}

/// One E2B sandbox as an older daemon persisted it (`<state>/e2b/sandboxes/<id>.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxFile {
    /// Its format version (1 or 2).
    pub format: u32,
    /// The sandbox id (the Crab sandbox name).
    pub id: String,
    /// The template it was created from.
    #[serde(default)]
    pub template: String,
    /// E2B metadata.
    #[serde(default)]
    pub metadata: HashMap<String, String>,
    /// The environment of every command.
    #[serde(default)]
    pub envs: HashMap<String, String>,
    /// Creation time, ms since the epoch.
    #[serde(default)]
    pub started_at_ms: u64,
    /// When the timeout fires, ms since the epoch.
    #[serde(default)]
    pub end_at_ms: u64,
    /// Pause (not kill) at the timeout.
    #[serde(default)]
    pub auto_pause: bool,
    /// Run state.
    pub state: StoredState,
    /// The restore point a pause took.
    #[serde(default)]
    pub pause_point: Option<String>,
    /// Snapshots taken of it.
    #[serde(default)]
    pub snapshots: Vec<StoredSnapshot>,
    /// Processes started through envd (format 2): not carried over — they keep running in the
    /// sandbox, but the host's process service does not know them.
    #[serde(default)]
    pub processes: Vec<serde_json::Value>,
}

/// Why the state directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was done.
        op: &'static str,
        /// On what.
        path: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The secret file is not 32 bytes.
    #[error(
        "{path} is not a 32-byte secret (it holds {len} bytes); remove it to make a new one (every E2B access token changes)"
    )]
    BadSecret {
        /// The file.
        path: String,
        /// Its length.
        len: usize,
    },
    /// An atomic write failed.
    #[error(transparent)]
    Write(#[from] crab_common::fsutil::AtomicWriteError),
    /// A record could not be encoded.
    #[error("encoding {0}: {1}")]
    Encode(String, serde_json::Error),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { op, path: path.display().to_string(), source }
}

/// Where the front door's state lives, and the token secret.
#[derive(Clone)]
pub struct Store {
    dir: Option<PathBuf>,
    secret: [u8; 32],
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl Store {
    /// State in memory only (tests): tokens from a fresh random secret, nothing written.
    pub fn memory() -> Store {
        let mut secret = [0u8; 32];
        if let Err(e) = getrandom::getrandom(&mut secret) {
            tracing::error!(error = %e, "getrandom failed; E2B tokens are unusable");
        }
        Store { dir: None, secret }
    }

    /// State under `dir` (created, mode 0700), with its secret (created on first use, 0600).
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod", dir))?;
        let path = dir.join("token-secret");
        let secret = match std::fs::read(&path) {
            Ok(b) => b.as_slice().try_into().map_err(|_| StoreError::BadSecret {
                path: path.display().to_string(),
                len: b.len(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut s = [0u8; 32];
                getrandom::getrandom(&mut s).map_err(|e| StoreError::Io {
                    op: "getrandom for",
                    path: path.display().to_string(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                // create_new: two daemons can never race to different secrets on one state dir
                // (the pid lock already prevents it), and an existing file is never replaced.
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(io("creating", &path))?;
                f.write_all(&s).map_err(io("writing", &path))?;
                f.sync_all().map_err(io("fsync", &path))?;
                crab_common::fsutil::fsync_dir(dir)?;
                s
            }
            Err(e) => return Err(io("reading", &path)(e)),
        };
        Ok(Store { dir: Some(dir.to_path_buf()), secret })
    }

    /// Its directory (`None`: in memory only).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Sandbox `id`'s envd access token: HMAC-SHA256(secret, id), hex.
    pub fn token(&self, id: &str) -> String {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.secret) else {
            // HMAC takes keys of any length; unreachable, but never hand out a fixed token.
            return String::new();
        };
        mac.update(b"crab-e2b-envd-token/v1\0");
        mac.update(id.as_bytes());
        hex::encode(&mac.finalize().into_bytes()[..24])
    }

    fn file(&self, id: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join("sandboxes").join(format!("{id}.json")))
    }

    /// Delete sandbox `id`'s file (absent is fine).
    pub fn delete(&self, id: &str) -> Result<(), StoreError> {
        let Some(path) = self.file(id) else { return Ok(()) };
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    /// Every readable sandbox file an older daemon left. A file that cannot be read, does not
    /// parse, has another format version or names another id is logged (with what to do) and
    /// skipped — left in place, untouched — so one bad file never costs the others.
    pub fn load(&self) -> Vec<SandboxFile> {
        let Some(dir) = self.dir.as_ref().map(|d| d.join("sandboxes")) else { return Vec::new() };
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot list the E2B state; no E2B sandbox is restored");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            match parse_file(&path) {
                Ok(f) => out.push(f),
                Err(why) => tracing::error!(
                    file = %path.display(),
                    "an older daemon's E2B state file skipped: {why}; the other sandboxes are migrated. Fix or remove the file and restart the daemon (the sandbox itself is untouched: `crab sandbox ls`)"
                ),
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }
}

fn parse_file(path: &Path) -> Result<SandboxFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("reading it: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("not JSON ({e})"))?;
    match v.get("format").and_then(|f| f.as_u64()) {
        Some(n) if (u64::from(OLDEST_FORMAT)..=u64::from(FORMAT)).contains(&n) => {}
        Some(n) => {
            return Err(format!(
                "format version {n} is not one this crab reads ({OLDEST_FORMAT}..={FORMAT}; written by another crab version)"
            ))
        }
        None => return Err("it has no format version".into()),
    }
    let f: SandboxFile =
        serde_json::from_value(v).map_err(|e| format!("not an E2B sandbox record ({e})"))?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    if stem != f.id {
        return Err(format!("it names sandbox {:?}, not {stem:?}", f.id));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sample(id: &str) -> serde_json::Value {
        serde_json::json!({
            "format": 2, "id": id, "template": "base", "metadata": {"k": "v"}, "envs": {},
            "started_at_ms": 1, "end_at_ms": 2, "auto_pause": true, "state": "killed",
            "pause_point": null,
            "snapshots": [{"id": format!("{id}:c1"), "point": "c1", "fs_only": false, "names": ["n"]}],
            "processes": [{"pid": 7, "cmd": "/bin/bash", "dir": "/run/crab-envd/ab12"}],
            "gc": ["/run/crab-envd/cd34"]
        })
    }

    #[test]
    fn older_files_load_and_bad_files_are_skipped_not_fatal() {
        let d = std::env::temp_dir().join(format!("crab-e2b-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let s = Store::open(&d).unwrap();
        std::fs::create_dir_all(d.join("sandboxes")).unwrap();
        let mode = std::fs::metadata(d.join("token-secret")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let put = |id: &str, v: &serde_json::Value| {
            std::fs::write(d.join(format!("sandboxes/{id}.json")), serde_json::to_vec(v).unwrap())
                .unwrap()
        };
        put("e2b-a", &sample("e2b-a"));
        std::fs::write(d.join("sandboxes/e2b-c.json"), b"{not json").unwrap();
        // A version-1 file (no process table) loads too.
        let mut v1 = sample("e2b-v1");
        v1["format"] = 1.into();
        v1.as_object_mut().unwrap().remove("processes");
        v1.as_object_mut().unwrap().remove("gc");
        put("e2b-v1", &v1);
        std::fs::write(d.join("sandboxes/e2b-d.json"), br#"{"format": 99, "id": "e2b-d"}"#)
            .unwrap();
        put("e2b-x", &sample("e2b-other"));
        let got = s.load();
        assert_eq!(got.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(), ["e2b-a", "e2b-v1"]);
        assert_eq!(got[0].state, StoredState::Killed);
        assert_eq!(got[0].snapshots[0].names, ["n"]);
        assert_eq!(got[0].metadata["k"], "v");
        s.delete("e2b-v1").unwrap();
        s.delete("e2b-v1").unwrap();
        // The bad files are left for inspection.
        assert!(d.join("sandboxes/e2b-c.json").exists());
        assert_eq!(s.load().len(), 1);
        // Tokens survive a reopen (same secret), differ per sandbox and per secret.
        let again = Store::open(&d).unwrap();
        assert_eq!(s.token("e2b-a"), again.token("e2b-a"));
        assert_ne!(s.token("e2b-a"), s.token("e2b-b"));
        assert_ne!(s.token("e2b-a"), Store::memory().token("e2b-a"));
        assert_eq!(s.token("e2b-a").len(), 48);
        std::fs::write(d.join("token-secret"), b"short").unwrap();
        assert!(matches!(Store::open(&d), Err(StoreError::BadSecret { .. })));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
