//! What the E2B front door remembers across daemon restarts: one versioned JSON file per E2B
//! sandbox under `<state>/e2b/sandboxes/` holding its envd process table (format 3), written
//! atomically — a sandbox's life (run state, deadline, metadata, environment, template,
//! snapshots) is the host's, in its record; files of format ≤ 2 also held those, and the
//! daemon hands them to the host once ([`SandboxFile::legacy`]) and rewrites the file — and the
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

/// Version of a sandbox file (2 added `processes` and `gc`; 3 keeps only them, the lifecycle
/// fields moved to the host's record; version 1 and 2 files still load, for migration).
pub const FORMAT: u32 = 3;

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

/// How an envd process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredEnd {
    /// Its exit code (`-1` when killed by a signal).
    pub exit_code: i32,
    /// Whether it exited by itself.
    pub exited: bool,
    /// `exit status N`, `signal: killed`, or why it is unknown.
    pub status: String,
    /// What failed, when something did.
    #[serde(default)]
    pub error: Option<String>,
}

/// One process started through envd (`process.Process/Start`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredProcess {
    /// Its pid in the sandbox (the supervisor's; what the SDK selects it by).
    pub pid: u32,
    /// Its tag, if the start gave one.
    #[serde(default)]
    pub tag: Option<String>,
    /// The program.
    pub cmd: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// The environment the start added.
    #[serde(default)]
    pub envs: HashMap<String, String>,
    /// The working directory the start asked for.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Its directory in the sandbox (`/run/crab-envd/<hex>`: output, exit status).
    pub dir: String,
    /// How it ended; `None` while it runs.
    #[serde(default)]
    pub ended: Option<StoredEnd>,
}

/// One E2B sandbox as persisted (`<state>/e2b/sandboxes/<id>.json`). Format 3 writes `format`,
/// `id`, `processes` and `gc`; the other fields are read from format ≤ 2 files only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxFile {
    /// [`FORMAT`].
    pub format: u32,
    /// The sandbox id (the Crab sandbox name).
    pub id: String,
    /// Format ≤ 2: the template it was created from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub template: String,
    /// Format ≤ 2: E2B metadata.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub metadata: HashMap<String, String>,
    /// Format ≤ 2: the environment of every command.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub envs: HashMap<String, String>,
    /// Format ≤ 2: creation time, ms since the epoch.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub started_at_ms: u64,
    /// Format ≤ 2: when the timeout fires, ms since the epoch.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub end_at_ms: u64,
    /// Format ≤ 2: pause (not kill) at the timeout.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause: bool,
    /// Format ≤ 2: run state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<StoredState>,
    /// Format ≤ 2: the restore point a pause took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_point: Option<String>,
    /// Format ≤ 2: snapshots taken of it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<StoredSnapshot>,
    /// Processes started through envd: those running, and the last ones that ended (so a
    /// `Connect` by pid still gets their end).
    #[serde(default)]
    pub processes: Vec<StoredProcess>,
    /// Directories in the sandbox of processes reported ended, removed at the next start.
    #[serde(default)]
    pub gc: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl SandboxFile {
    /// A format-3 file: sandbox `id`'s envd process table.
    pub fn processes_of(id: &str, processes: Vec<StoredProcess>, gc: Vec<String>) -> SandboxFile {
        SandboxFile {
            format: FORMAT,
            id: id.to_string(),
            template: String::new(),
            metadata: HashMap::new(),
            envs: HashMap::new(),
            started_at_ms: 0,
            end_at_ms: 0,
            auto_pause: false,
            state: None,
            pause_point: None,
            snapshots: Vec::new(),
            processes,
            gc,
        }
    }

    /// Whether this file still holds a sandbox's life (format ≤ 2), for the host to adopt.
    pub fn legacy(&self) -> bool {
        self.format < FORMAT
    }
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
        let sandboxes = dir.join("sandboxes");
        std::fs::create_dir_all(&sandboxes).map_err(io("creating", &sandboxes))?;
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

    /// Write sandbox `f`'s file (atomically; nothing in memory-only mode).
    pub fn save(&self, f: &SandboxFile) -> Result<(), StoreError> {
        let Some(path) = self.file(&f.id) else { return Ok(()) };
        let bytes =
            serde_json::to_vec_pretty(f).map_err(|e| StoreError::Encode(f.id.clone(), e))?;
        crab_common::fsutil::write_atomic(&path, &bytes)?;
        Ok(())
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

    /// Every readable sandbox file. A file that cannot be read, does not parse, has another
    /// format version or names another id is logged (with what to do) and skipped — left in
    /// place, untouched — so one bad file never costs the others.
    pub fn load(&self) -> Vec<SandboxFile> {
        let Some(dir) = self.dir.as_ref().map(|d| d.join("sandboxes")) else { return Vec::new() };
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
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
                    "E2B state file skipped: {why}; the other sandboxes are restored. Fix or remove the file and restart the daemon (the sandbox itself is untouched: `crab sandbox ls`)"
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

    fn sample(id: &str) -> SandboxFile {
        SandboxFile {
            format: FORMAT,
            id: id.into(),
            template: "base".into(),
            metadata: HashMap::from([("k".into(), "v".into())]),
            envs: HashMap::new(),
            started_at_ms: 1,
            end_at_ms: 2,
            auto_pause: true,
            state: Some(StoredState::Killed),
            pause_point: None,
            snapshots: vec![StoredSnapshot {
                id: format!("{id}:c1"),
                point: "c1".into(),
                fs_only: false,
                names: vec!["n".into()],
            }],
            processes: vec![StoredProcess {
                pid: 7,
                tag: None,
                cmd: "/bin/bash".into(),
                args: vec!["-l".into(), "-c".into(), "sleep 9".into()],
                envs: HashMap::new(),
                cwd: Some("/tmp".into()),
                dir: "/run/crab-envd/ab12".into(),
                ended: Some(StoredEnd {
                    exit_code: 3,
                    exited: true,
                    status: "exit status 3".into(),
                    error: None,
                }),
            }],
            gc: vec!["/run/crab-envd/cd34".into()],
        }
    }

    #[test]
    fn round_trip_and_bad_files_are_skipped_not_fatal() {
        let d = std::env::temp_dir().join(format!("crab-e2b-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let s = Store::open(&d).unwrap();
        let mode = std::fs::metadata(d.join("token-secret")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        s.save(&sample("e2b-a")).unwrap();
        s.save(&sample("e2b-b")).unwrap();
        std::fs::write(d.join("sandboxes/e2b-c.json"), b"{not json").unwrap();
        // A version-1 file (no process table) still loads.
        let mut v1 = serde_json::to_value(sample("e2b-v1")).unwrap();
        v1["format"] = 1.into();
        v1.as_object_mut().unwrap().remove("processes");
        v1.as_object_mut().unwrap().remove("gc");
        std::fs::write(d.join("sandboxes/e2b-v1.json"), serde_json::to_vec(&v1).unwrap()).unwrap();
        std::fs::write(d.join("sandboxes/e2b-d.json"), br#"{"format": 99, "id": "e2b-d"}"#)
            .unwrap();
        let got = s.load();
        let mut old = sample("e2b-v1");
        old.format = 1;
        old.processes.clear();
        old.gc.clear();
        assert_eq!(got, vec![sample("e2b-a"), sample("e2b-b"), old]);
        s.delete("e2b-v1").unwrap();
        // The bad files are left for inspection.
        assert!(d.join("sandboxes/e2b-c.json").exists());
        // Tokens survive a reopen (same secret), differ per sandbox and per secret.
        let again = Store::open(&d).unwrap();
        assert_eq!(s.token("e2b-a"), again.token("e2b-a"));
        assert_ne!(s.token("e2b-a"), s.token("e2b-b"));
        assert_ne!(s.token("e2b-a"), Store::memory().token("e2b-a"));
        assert_eq!(s.token("e2b-a").len(), 48);
        s.delete("e2b-a").unwrap();
        s.delete("e2b-a").unwrap();
        assert_eq!(s.load().len(), 1);
        std::fs::write(d.join("token-secret"), b"short").unwrap();
        assert!(matches!(Store::open(&d), Err(StoreError::BadSecret { .. })));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
