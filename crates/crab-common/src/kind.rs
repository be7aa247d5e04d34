//! The checkpoint kind: what a checkpoint captures. One type from the inspector's verdict
//! through the engine's job to the restore point it publishes ([`CheckpointKind`]), and the
//! kind a restore point records ([`PointKind`]: a checkpoint's kind, or the marker a restore
//! publishes). The lower-case spellings (`skip`, `fs`, `process`, `full`, `restore`) are part of
//! the persisted manifest format and of the API's JSON (`docs/format.md`, `docs/api.md`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What a checkpoint must capture (the inspector's verdict) and captures (the engine's job, the
/// checkpointer's request). Ordered `skip < fs < process < full`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointKind {
    /// Nothing recovery-relevant changed: publish a restore point that reuses the parent's parts.
    Skip,
    /// Files changed, processes did not: a new filesystem snapshot; the process image is the
    /// parent's.
    Fs,
    /// Processes changed, files did not: a new process image (CRIU); the filesystem snapshot is
    /// the parent's.
    Process,
    /// Both (or unsure): a new filesystem snapshot and a new process image, under one freeze.
    Full,
}

/// An unknown kind name (from a request or a manifest).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown checkpoint kind {name:?}; use {expected}")]
pub struct UnknownKind {
    /// What was given.
    pub name: String,
    /// What would have been accepted.
    pub expected: &'static str,
}

impl CheckpointKind {
    /// All kinds, in metric order (the order of [`CheckpointKind::index`]).
    pub const ALL: [CheckpointKind; 4] =
        [CheckpointKind::Skip, CheckpointKind::Fs, CheckpointKind::Process, CheckpointKind::Full];

    /// The kind that covers both `self` and `other`: `full > process, fs > skip`, and
    /// `fs + process = full`.
    pub fn merge(self, other: CheckpointKind) -> CheckpointKind {
        match (self, other) {
            (CheckpointKind::Fs, CheckpointKind::Process)
            | (CheckpointKind::Process, CheckpointKind::Fs) => CheckpointKind::Full,
            (a, b) => a.max(b),
        }
    }

    /// Whether it dumps processes (and so counts against the CRIU dump limit).
    pub fn dumps_processes(self) -> bool {
        matches!(self, CheckpointKind::Process | CheckpointKind::Full)
    }

    /// Whether it takes a filesystem snapshot.
    pub fn snapshots_fs(self) -> bool {
        matches!(self, CheckpointKind::Fs | CheckpointKind::Full)
    }

    /// Lower-case name (`skip`, `fs`, `process`, `full`).
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointKind::Skip => "skip",
            CheckpointKind::Fs => "fs",
            CheckpointKind::Process => "process",
            CheckpointKind::Full => "full",
        }
    }

    /// Position in [`CheckpointKind::ALL`] (for per-kind counters).
    pub fn index(self) -> usize {
        match self {
            CheckpointKind::Skip => 0,
            CheckpointKind::Fs => 1,
            CheckpointKind::Process => 2,
            CheckpointKind::Full => 3,
        }
    }
}

impl fmt::Display for CheckpointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CheckpointKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, UnknownKind> {
        CheckpointKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| UnknownKind {
            name: s.to_string(),
            expected: "skip, fs, process or full",
        })
    }
}

/// A sandbox's checkpoint policy: what its turn boundaries (the LLM proxy's, `crab turn`) take.
/// Persisted in the sandbox record and shown by `crab sandbox ls/inspect`; set by `crab sandbox
/// create --checkpoint-policy` and `crab sandbox update --checkpoint-policy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointPolicy {
    /// The inspector's verdict decides (skip, fs, process or full; the default).
    #[default]
    Auto,
    /// A full checkpoint (files and processes) every turn.
    Full,
    /// A filesystem snapshot every turn, never a process image.
    Fs,
    /// No checkpoint: the gate passes at once (the baseline of the replay benchmark).
    None,
}

impl CheckpointPolicy {
    /// Every policy.
    pub const ALL: [CheckpointPolicy; 4] = [
        CheckpointPolicy::Auto,
        CheckpointPolicy::Full,
        CheckpointPolicy::Fs,
        CheckpointPolicy::None,
    ];

    /// The accepted spellings, for error messages.
    pub const EXPECTED: &'static str = "auto, full, fs or none";

    /// Lower-case name (`auto`, `full`, `fs`, `none`).
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointPolicy::Auto => "auto",
            CheckpointPolicy::Full => "full",
            CheckpointPolicy::Fs => "fs",
            CheckpointPolicy::None => "none",
        }
    }

    /// The kind it takes at every turn (`None` for `auto`, which asks the inspector, and for
    /// `none`, which takes nothing).
    pub fn fixed_kind(self) -> Option<CheckpointKind> {
        match self {
            CheckpointPolicy::Full => Some(CheckpointKind::Full),
            CheckpointPolicy::Fs => Some(CheckpointKind::Fs),
            CheckpointPolicy::Auto | CheckpointPolicy::None => None,
        }
    }
}

impl fmt::Display for CheckpointPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown checkpoint policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown checkpoint policy {0:?}; use auto, full, fs or none")]
pub struct UnknownPolicy(pub String);

impl FromStr for CheckpointPolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        CheckpointPolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// What a restore point records: the kind of the checkpoint that published it, or `restore` for
/// the marker every restore publishes (it captures nothing new and references the restored
/// point's parts, so that the newest point always describes the live sandbox). Serialized as
/// one lower-case word, like [`CheckpointKind`] plus `restore`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PointKind {
    /// Published by a checkpoint of this kind.
    Checkpoint(CheckpointKind),
    /// Published by a restore.
    Restore,
}

impl PointKind {
    /// A skip point (shorthand for tests and callers).
    pub const SKIP: PointKind = PointKind::Checkpoint(CheckpointKind::Skip);
    /// An fs point.
    pub const FS: PointKind = PointKind::Checkpoint(CheckpointKind::Fs);
    /// A process point.
    pub const PROCESS: PointKind = PointKind::Checkpoint(CheckpointKind::Process);
    /// A full point.
    pub const FULL: PointKind = PointKind::Checkpoint(CheckpointKind::Full);

    /// The checkpoint kind, `None` for a restore marker.
    pub fn checkpoint(self) -> Option<CheckpointKind> {
        match self {
            PointKind::Checkpoint(k) => Some(k),
            PointKind::Restore => None,
        }
    }

    /// Whether the point newly captured a process image.
    pub fn new_procs(self) -> bool {
        self.checkpoint().is_some_and(CheckpointKind::dumps_processes)
    }

    /// Whether the point newly captured a filesystem snapshot.
    pub fn new_fs(self) -> bool {
        self.checkpoint().is_some_and(CheckpointKind::snapshots_fs)
    }

    /// Lower-case name (`skip`, `fs`, `process`, `full`, `restore`).
    pub fn as_str(self) -> &'static str {
        match self {
            PointKind::Checkpoint(k) => k.as_str(),
            PointKind::Restore => "restore",
        }
    }
}

impl From<CheckpointKind> for PointKind {
    fn from(k: CheckpointKind) -> Self {
        PointKind::Checkpoint(k)
    }
}

impl fmt::Display for PointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PointKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, UnknownKind> {
        if s == "restore" {
            return Ok(PointKind::Restore);
        }
        s.parse().map(PointKind::Checkpoint).map_err(|_| UnknownKind {
            name: s.to_string(),
            expected: "skip, fs, process, full or restore",
        })
    }
}

impl Serialize for PointKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for PointKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_spelling_is_pinned() {
        for (p, s) in [
            (CheckpointPolicy::Auto, "auto"),
            (CheckpointPolicy::Full, "full"),
            (CheckpointPolicy::Fs, "fs"),
            (CheckpointPolicy::None, "none"),
        ] {
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{s}\""));
            assert_eq!(s.parse::<CheckpointPolicy>().unwrap(), p);
        }
        let e = "process".parse::<CheckpointPolicy>().unwrap_err().to_string();
        assert!(e.contains("\"process\"") && e.contains("auto, full, fs or none"), "{e}");
        assert_eq!(CheckpointPolicy::default(), CheckpointPolicy::Auto);
    }

    /// The spellings are persisted (manifests) and public (API JSON): pin them.
    #[test]
    fn serde_spelling_is_pinned() {
        let pairs = [
            (CheckpointKind::Skip, "\"skip\""),
            (CheckpointKind::Fs, "\"fs\""),
            (CheckpointKind::Process, "\"process\""),
            (CheckpointKind::Full, "\"full\""),
        ];
        for (k, json) in pairs {
            assert_eq!(serde_json::to_string(&k).unwrap(), json);
            assert_eq!(serde_json::from_str::<CheckpointKind>(json).unwrap(), k);
            let p = PointKind::from(k);
            assert_eq!(serde_json::to_string(&p).unwrap(), json);
            assert_eq!(serde_json::from_str::<PointKind>(json).unwrap(), p);
            assert_eq!(k.to_string(), json.trim_matches('"'));
            assert_eq!(json.trim_matches('"').parse::<CheckpointKind>(), Ok(k));
        }
        assert_eq!(serde_json::to_string(&PointKind::Restore).unwrap(), "\"restore\"");
        assert_eq!(serde_json::from_str::<PointKind>("\"restore\"").unwrap(), PointKind::Restore);
        assert_eq!("restore".parse::<PointKind>(), Ok(PointKind::Restore));
        // A restore marker is not something a checkpoint can be asked for.
        assert!(serde_json::from_str::<CheckpointKind>("\"restore\"").is_err());
        let e = "restore".parse::<CheckpointKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown checkpoint kind \"restore\"; use skip, fs, process or full"
        );
        assert!(serde_json::from_str::<PointKind>("\"Full\"").is_err());
        assert!("bogus".parse::<PointKind>().is_err());
    }

    #[test]
    fn kinds_merge_and_order() {
        use CheckpointKind::*;
        assert_eq!(Skip.merge(Skip), Skip);
        assert_eq!(Skip.merge(Fs), Fs);
        assert_eq!(Process.merge(Skip), Process);
        assert_eq!(Fs.merge(Process), Full);
        assert_eq!(Process.merge(Fs), Full);
        assert_eq!(Full.merge(Skip), Full);
        assert_eq!(Fs.merge(Fs), Fs);
        for (i, k) in CheckpointKind::ALL.into_iter().enumerate() {
            assert_eq!(k.index(), i);
        }
        assert!(Skip < Fs && Fs < Process && Process < Full);
    }

    #[test]
    fn point_parts() {
        assert!(PointKind::FULL.new_procs() && PointKind::FULL.new_fs());
        assert!(PointKind::PROCESS.new_procs() && !PointKind::PROCESS.new_fs());
        assert!(!PointKind::FS.new_procs() && PointKind::FS.new_fs());
        assert!(!PointKind::SKIP.new_procs() && !PointKind::SKIP.new_fs());
        assert!(!PointKind::Restore.new_procs() && !PointKind::Restore.new_fs());
        assert_eq!(PointKind::Restore.checkpoint(), None);
    }
}
