//! The verdict of a turn: its kind (skip / fs / process / full), the file changeset, the process
//! changes and the reasons, plus the pure rules that turn raw map records into it.

use std::collections::HashMap;

use crab_common::CheckpointKind;
use serde::{Deserialize, Serialize};

use crate::abi::{
    CKey, Change, PathRec, C_CREATED, C_DELETED, C_DIR, C_LINKED, C_META, C_MMAP, C_MODIFIED,
    C_NODE, C_RENAMED, C_SYMLINK, K_INODE, P_P1, P_P1_TRUNC, P_P2, P_P2_TRUNC, P_WALK, P_WALK_FULL,
    P_WALK_IS_FILE,
};

/// The net operation on one path in a turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum ChangeOp {
    /// The path did not exist before the turn (file, directory, symlink, node or hard link).
    Create,
    /// Contents changed (write, truncate, fallocate, shared writable mmap).
    Modify,
    /// The path existed before the turn and is gone.
    Delete,
    /// The path is the target of a rename from `from`.
    Rename {
        /// The source path.
        from: String,
    },
    /// Only metadata changed (mode, owner, xattrs, times).
    Meta,
}

/// The kind of object a change concerns, when known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Device node, fifo or socket made by mknod.
    Node,
    /// Not known (path-based call on an existing object).
    Unknown,
}

/// One entry of a changeset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathChange {
    /// The path, absolute inside the sandbox when it could be resolved; otherwise as the
    /// process gave it (then `exact` is false).
    pub path: String,
    /// The net operation.
    #[serde(flatten)]
    pub op: ChangeOp,
    /// The object kind.
    pub kind: ObjectKind,
    /// Whether `path` is exact (absolute, not truncated).
    pub exact: bool,
    /// Device and inode (kernel encoding of the device) when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inode: Option<(u64, u64)>,
}

/// Changes to the sandbox's process set during a turn.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessChanges {
    /// Processes (tgids) born in the turn and alive at its end.
    pub born: Vec<u32>,
    /// Processes alive at the last checkpoint that died in the turn.
    pub died: Vec<u32>,
    /// Processes alive at the last checkpoint that ran (were scheduled, exec'd or made threads)
    /// in the turn.
    pub ran: Vec<u32>,
    /// Harness processes (the sandbox's declared harness, see `harness.rs`) that ran in the
    /// turn: left out of the verdict, still in every dump.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub harness_ran: Vec<u32>,
    /// Changes under the sandbox's declared harness paths, left out of the changeset.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub harness_path_changes: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl ProcessChanges {
    /// Whether anything changed.
    pub fn any(&self) -> bool {
        !(self.born.is_empty() && self.died.is_empty() && self.ran.is_empty())
    }
}

/// The verdict for one turn of one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Sandbox name.
    pub sandbox: String,
    /// Turn number (increments at each [`crate::Inspector::take`]).
    pub turn: u64,
    /// What the checkpoint must contain.
    pub kind: CheckpointKind,
    /// Net file changes, sorted by path.
    pub changeset: Vec<PathChange>,
    /// Process changes.
    pub processes: ProcessChanges,
    /// Why the verdict is what it is, beyond the changeset and processes (conservative causes,
    /// mapped-file hits...).
    pub reasons: Vec<String>,
    /// True when the inspector could not follow everything: the kind is then `full`.
    pub conservative: bool,
}

/// Inputs gathered for one turn, turned into a [`Verdict`] by [`decide`].
#[derive(Debug, Default)]
pub(crate) struct TurnFacts {
    pub changeset: Vec<PathChange>,
    pub processes: ProcessChanges,
    /// fs changed although no path is known (reason given).
    pub fs_reasons: Vec<String>,
    /// processes changed beyond born/died/ran (reason given).
    pub proc_reasons: Vec<String>,
    /// The inspector could not follow something (reason given).
    pub conservative_reasons: Vec<String>,
}

/// The verdict rules: no change → skip; fs only → fs; processes only → process; both → full;
/// anything conservative → full.
pub(crate) fn decide(sandbox: &str, turn: u64, f: TurnFacts) -> Verdict {
    let fs = !f.changeset.is_empty() || !f.fs_reasons.is_empty();
    let proc_ = f.processes.any() || !f.proc_reasons.is_empty();
    let conservative = !f.conservative_reasons.is_empty();
    let kind = if conservative {
        CheckpointKind::Full
    } else {
        match (fs, proc_) {
            (false, false) => CheckpointKind::Skip,
            (true, false) => CheckpointKind::Fs,
            (false, true) => CheckpointKind::Process,
            (true, true) => CheckpointKind::Full,
        }
    };
    let mut reasons = f.conservative_reasons;
    reasons.extend(f.fs_reasons);
    reasons.extend(f.proc_reasons);
    Verdict {
        sandbox: sandbox.to_string(),
        turn,
        kind,
        changeset: f.changeset,
        processes: f.processes,
        reasons,
        conservative,
    }
}

fn join(base: &[String], rel: &str) -> String {
    let mut parts: Vec<&str> = base.iter().map(String::as_str).collect();
    for c in rel.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

fn normalize_abs(p: &str) -> String {
    join(&[], p)
}

fn kind_of(flags: u32, mode: u32) -> ObjectKind {
    if flags & C_DIR != 0 {
        return ObjectKind::Dir;
    }
    if flags & C_SYMLINK != 0 {
        return ObjectKind::Symlink;
    }
    if flags & C_NODE != 0 {
        return ObjectKind::Node;
    }
    match mode & 0o170000 {
        0o100000 => ObjectKind::File,
        0o040000 => ObjectKind::Dir,
        0o120000 => ObjectKind::Symlink,
        0 => ObjectKind::Unknown,
        _ => ObjectKind::Node,
    }
}

/// Resolves the display path of a record: (path, exact).
fn display_path(key: &CKey, rec: Option<&PathRec>) -> (String, bool) {
    let Some(r) = rec else {
        return (format!("<dev {} ino {}>", key.a, key.b), false);
    };
    if key.kind == K_INODE {
        if r.have & P_WALK != 0 {
            let full = r.have & P_WALK_FULL != 0;
            let p = format!("/{}", r.walk.join("/"));
            return (if full { p } else { format!("...{p}") }, full);
        }
        return (format!("<dev {} ino {}>", key.a, key.b), false);
    }
    if r.have & P_P1 == 0 {
        return ("<unknown>".to_string(), false);
    }
    let trunc = r.have & P_P1_TRUNC != 0;
    if r.have & P_WALK_IS_FILE != 0 {
        // a created file: the walk is of the file itself
        let full = r.have & P_WALK_FULL != 0;
        return (format!("/{}", r.walk.join("/")), full);
    }
    if r.p1.starts_with('/') {
        return (normalize_abs(&r.p1), !trunc);
    }
    if r.have & P_WALK != 0 {
        let full = r.have & P_WALK_FULL != 0;
        return (join(&r.walk, &r.p1), full && !trunc);
    }
    (r.p1.clone(), false)
}

fn rename_from(rec: Option<&PathRec>) -> String {
    let Some(r) = rec else { return String::new() };
    if r.have & P_P2 == 0 {
        return String::new();
    }
    let _ = r.have & P_P2_TRUNC;
    if r.p2.starts_with('/') {
        normalize_abs(&r.p2)
    } else if r.have & P_WALK != 0 {
        // The source's base is assumed to be the target's (true for rename/renameat with the
        // same dirfd, e.g. `mv a b`).
        join(&r.walk, &r.p2)
    } else {
        r.p2.clone()
    }
}

fn op_rank(op: &ChangeOp) -> u8 {
    match op {
        ChangeOp::Delete => 5,
        ChangeOp::Rename { .. } => 4,
        ChangeOp::Modify => 3,
        ChangeOp::Create => 2,
        ChangeOp::Meta => 1,
    }
}

/// Builds the changeset from one turn's (key, change, path record) triples.
///
/// Name records with the same path are merged (the strongest op wins: a path that had a delete
/// or modify record existed before the turn). Inode records fold into a name record of the same
/// inode (a created file is named once); other inode records stand alone.
pub(crate) fn build_changeset(entries: &[(CKey, Change, Option<PathRec>)]) -> Vec<PathChange> {
    let mut by_path: HashMap<String, usize> = HashMap::new();
    let mut named_inodes: HashMap<(u64, u64), usize> = HashMap::new();
    let mut out: Vec<PathChange> = Vec::new();
    let mut order: Vec<&(CKey, Change, Option<PathRec>)> = entries.iter().collect();
    // names first, so that inode records can be folded into them
    order.sort_by_key(|(k, _, _)| k.kind == K_INODE);
    for (key, ch, rec) in order {
        let (path, exact) = display_path(key, rec.as_ref());
        let f = ch.flags;
        let op = if f & C_DELETED != 0 {
            ChangeOp::Delete
        } else if f & C_RENAMED != 0 && f & C_CREATED == 0 {
            ChangeOp::Rename { from: rename_from(rec.as_ref()) }
        } else if f & C_MODIFIED != 0 && f & C_CREATED == 0 {
            ChangeOp::Modify
        } else if f & (C_CREATED | C_LINKED) != 0 {
            ChangeOp::Create
        } else if f & (C_MODIFIED | C_MMAP) != 0 {
            ChangeOp::Modify
        } else if f & C_META != 0 {
            ChangeOp::Meta
        } else {
            ChangeOp::Modify
        };
        let inode = if key.kind == K_INODE {
            Some((key.a, key.b))
        } else if ch.dev != 0 || ch.ino != 0 {
            Some((ch.dev, ch.ino))
        } else {
            None
        };
        if key.kind == K_INODE {
            if let Some(&i) = inode.as_ref().and_then(|ino| named_inodes.get(ino)) {
                let prev: &mut PathChange = &mut out[i];
                if !prev.exact && exact {
                    prev.path = path;
                    prev.exact = true;
                }
                continue;
            }
        }
        if let Some(&i) = by_path.get(&path) {
            let prev: &mut PathChange = &mut out[i];
            if op_rank(&op) > op_rank(&prev.op) {
                prev.op = op;
            }
            if prev.inode.is_none() {
                prev.inode = inode;
            }
            if let Some(ino) = inode {
                named_inodes.entry(ino).or_insert(i);
            }
            continue;
        }
        if let Some(ino) = inode {
            if key.kind != K_INODE {
                named_inodes.entry(ino).or_insert(out.len());
            }
        }
        by_path.insert(path.clone(), out.len());
        out.push(PathChange { path, op, kind: kind_of(f, ch.mode), exact, inode });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        let v = decide("s", 1, TurnFacts::default());
        assert_eq!(v.kind, CheckpointKind::Skip);
        let mut f = TurnFacts::default();
        f.processes.born.push(3);
        assert_eq!(decide("s", 1, f).kind, CheckpointKind::Process);
        let f = TurnFacts { fs_reasons: vec!["x".into()], ..Default::default() };
        assert_eq!(decide("s", 1, f).kind, CheckpointKind::Fs);
        let mut f = TurnFacts { fs_reasons: vec!["x".into()], ..Default::default() };
        f.processes.died.push(3);
        assert_eq!(decide("s", 1, f).kind, CheckpointKind::Full);
        let f = TurnFacts { conservative_reasons: vec!["io_uring".into()], ..Default::default() };
        let v = decide("s", 1, f);
        assert_eq!(v.kind, CheckpointKind::Full);
        assert!(v.conservative);
    }

    #[test]
    fn joins() {
        assert_eq!(join(&["tmp".into(), "a".into()], "./b/../c"), "/tmp/a/c");
        assert_eq!(normalize_abs("/x//y/"), "/x/y");
    }

    #[test]
    fn verdict_round_trips_through_json() {
        let mut f = TurnFacts::default();
        f.changeset.push(PathChange {
            path: "/b".into(),
            op: ChangeOp::Rename { from: "/a".into() },
            kind: ObjectKind::File,
            exact: true,
            inode: Some((1, 2)),
        });
        f.changeset.push(PathChange {
            path: "/c".into(),
            op: ChangeOp::Create,
            kind: ObjectKind::Dir,
            exact: false,
            inode: None,
        });
        f.processes.ran.push(7);
        let v = decide("sb", 3, f);
        let j = serde_json::to_string(&v).unwrap_or_default();
        let back: Verdict = serde_json::from_str(&j).unwrap_or_else(|e| panic!("{e}: {j}"));
        assert_eq!(back, v);
    }

    #[test]
    fn serializes_rename() {
        let c = PathChange {
            path: "/b".into(),
            op: ChangeOp::Rename { from: "/a".into() },
            kind: ObjectKind::Unknown,
            exact: true,
            inode: None,
        };
        let j = serde_json::to_string(&c).unwrap_or_default();
        assert!(j.contains("\"op\":\"rename\"") && j.contains("\"from\":\"/a\""), "{j}");
    }
}
