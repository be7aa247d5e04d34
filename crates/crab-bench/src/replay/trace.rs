//! Trajectory files: one JSON object per tool call (the line schema of
//! `../shared/traces/README.md`), their discovery in directories, and where each came from.
//!
//! A trajectory is replayed turn by turn: line *i* (sorted by `turn`, then `call`) is the action
//! the replay LLM returns for the agent's *i*-th request. The family of a file (mini-swe-agent,
//! InterCode, Terminal-Bench, or written by this project) is taken from its path and decides the
//! working directory and whether a stand-in `/testbed` is needed. Provenance (source repository
//! and commit) comes from the nearest `manifest.json` above the file that lists it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crab_common::ApiError;

/// One line of a trajectory file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// Index of the LLM step.
    pub turn: u32,
    /// Index of the tool call inside the step.
    #[serde(default)]
    pub call: u32,
    /// `shell`, `edit`, `view`, `submit` or `other`.
    #[serde(default)]
    pub kind: String,
    /// The exact command string.
    pub action: String,
    /// Length of the model's text, when known.
    #[serde(default)]
    pub thought_chars: Option<u64>,
    /// Length of what the command printed, when known.
    #[serde(default)]
    pub observation_chars: Option<u64>,
    /// Wall time of the model call that produced this action, when known.
    #[serde(default)]
    pub llm_latency_s: Option<f64>,
    /// Wall time of the command in the source harness, when known.
    #[serde(default)]
    pub exec_s: Option<f64>,
    /// Exit code in the original run, when recorded.
    #[serde(default)]
    pub returncode: Option<i32>,
    /// Whether the command ran in a persistent shell session.
    #[serde(default)]
    pub shell_state: bool,
}

/// Where a trajectory comes from; decides the replay environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// mini-swe-agent on SWE-bench: fresh `bash -c` per command in `/testbed`.
    MiniSweAgent,
    /// InterCode bash tasks (persistent shell, their file system is not available here).
    Intercode,
    /// Terminal-Bench oracle solutions (persistent shell in `/app`).
    TerminalBench,
    /// Written by this project (`examples/traces/`).
    Project,
}

impl Family {
    fn of(path: &Path) -> Family {
        let s = path.to_string_lossy();
        if s.contains("mini-swe-agent") {
            Family::MiniSweAgent
        } else if s.contains("intercode") {
            Family::Intercode
        } else if s.contains("terminal-bench") {
            Family::TerminalBench
        } else {
            Family::Project
        }
    }

    /// Working directory of the agent's commands.
    pub fn workdir(self) -> &'static str {
        match self {
            Family::MiniSweAgent => "/testbed",
            Family::Intercode => "/",
            Family::TerminalBench => "/app",
            Family::Project => "/root",
        }
    }
}

/// Provenance of a trajectory file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceSource {
    /// Source repository (`github.com/SWE-agent/mini-swe-agent`), or `project` for
    /// project-written traces.
    pub repo: String,
    /// Commit of the source, when known.
    pub commit: Option<String>,
}

/// A loaded trajectory.
#[derive(Debug, Clone)]
pub struct Trajectory {
    /// Short unique id: the path relative to the folder it was discovered in, without `.jsonl`.
    pub id: String,
    /// The file.
    pub path: PathBuf,
    /// Family (from the path).
    pub family: Family,
    /// The steps, sorted by `(turn, call)`.
    pub steps: Vec<Step>,
    /// Whether the commands run in one persistent shell session.
    pub shell_state: bool,
    /// Provenance.
    pub source: TraceSource,
}

/// Errors reading trajectory files.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A file or directory could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is not a step.
    #[error("{path}:{line}: not a trajectory step: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The cause.
        source: serde_json::Error,
    },
    /// A file has no steps.
    #[error("{0}: no steps")]
    Empty(PathBuf),
}

impl From<TraceError> for ApiError {
    fn from(e: TraceError) -> Self {
        ApiError::invalid(
            e.to_string(),
            "pass JSON Lines trajectory files (schema in ../shared/traces/README.md) or folders holding them",
        )
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TraceError + '_ {
    move |source| TraceError::Io { path: path.to_path_buf(), source }
}

/// Parse the text of a trajectory file.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Step>, TraceError> {
    let mut steps = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let step: Step = serde_json::from_str(line).map_err(|source| TraceError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })?;
        steps.push(step);
    }
    steps.sort_by_key(|s| (s.turn, s.call));
    if steps.is_empty() {
        return Err(TraceError::Empty(path.to_path_buf()));
    }
    Ok(steps)
}

/// The trajectory files named by `paths`: files as given, folders searched recursively for
/// `*.jsonl`. Each file comes with the id it gets (relative to the folder it was found in).
/// Sorted by id within each folder, folders in the given order, duplicates dropped.
pub fn discover(paths: &[PathBuf]) -> Result<Vec<(String, PathBuf)>, TraceError> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for p in paths {
        let meta = std::fs::metadata(p).map_err(io(p))?;
        if meta.is_dir() {
            let mut found = Vec::new();
            walk(p, &mut found)?;
            found.sort();
            let base = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            for f in found {
                let rel = f.strip_prefix(p).unwrap_or(&f).with_extension("");
                let id = if base.is_empty() {
                    rel.to_string_lossy().into_owned()
                } else {
                    format!("{base}/{}", rel.to_string_lossy())
                };
                if seen.insert(f.clone()) {
                    out.push((id, f));
                }
            }
        } else if seen.insert(p.clone()) {
            let id = p.with_extension("");
            let id = id.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            out.push((id, p.clone()));
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), TraceError> {
    for e in std::fs::read_dir(dir).map_err(io(dir))? {
        let e = e.map_err(io(dir))?;
        let p = e.path();
        let ft = e.file_type().map_err(io(&p))?;
        if ft.is_dir() {
            walk(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "jsonl") {
            out.push(p);
        }
    }
    Ok(())
}

/// Load one trajectory file.
pub fn load(id: &str, path: &Path) -> Result<Trajectory, TraceError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let steps = parse(path, &text)?;
    let family = Family::of(path);
    let shell_state = steps.iter().any(|s| s.shell_state);
    Ok(Trajectory {
        id: id.to_string(),
        path: path.to_path_buf(),
        family,
        steps,
        shell_state,
        source: source_of(path),
    })
}

/// Discover and load trajectories, at most `limit` of them (0 = all).
pub fn load_all(paths: &[PathBuf], limit: usize) -> Result<Vec<Trajectory>, TraceError> {
    let mut found = discover(paths)?;
    if limit > 0 {
        found.truncate(limit);
    }
    found.iter().map(|(id, p)| load(id, p)).collect()
}

/// Provenance of `path`: the nearest `manifest.json` above it that lists it (the shared traces'
/// format: `{"trajectories":[{"file","source_repo","commit"}]}`, or Terminal-Bench's
/// `{"tasks":{name:{"source_repo","source_commit"}}}`); otherwise `project`.
pub fn source_of(path: &Path) -> TraceSource {
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    for dir in abs.ancestors().skip(1) {
        let m = dir.join("manifest.json");
        let Ok(text) = std::fs::read_to_string(&m) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { continue };
        let rel = abs.strip_prefix(dir).unwrap_or(&abs).to_string_lossy().into_owned();
        if let Some(list) = v.get("trajectories").and_then(|t| t.as_array()) {
            for t in list {
                if t.get("file").and_then(|f| f.as_str()) == Some(rel.as_str()) {
                    return TraceSource {
                        repo: str_field(t, "source_repo").unwrap_or_else(|| "unknown".into()),
                        commit: str_field(t, "commit"),
                    };
                }
            }
        }
        if let Some(tasks) = v.get("tasks").and_then(|t| t.as_object()) {
            let stem = abs.file_stem().map(|s| s.to_string_lossy().into_owned());
            if let Some(t) = stem.and_then(|s| tasks.get(&s)) {
                return TraceSource {
                    repo: str_field(t, "source_repo").unwrap_or_else(|| "unknown".into()),
                    commit: str_field(t, "source_commit"),
                };
            }
        }
    }
    TraceSource { repo: "project".into(), commit: None }
}

fn str_field(v: &serde_json::Value, k: &str) -> Option<String> {
    v.get(k).and_then(|x| x.as_str()).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_sorts() {
        let text = r#"{"turn": 1, "call": 0, "kind": "shell", "action": "ls", "llm_latency_s": 2.5, "shell_state": true}

{"turn": 0, "call": 0, "kind": "shell", "action": "pwd", "thought_chars": null, "observation_chars": 3, "llm_latency_s": null, "exec_s": 0.2, "returncode": 0, "shell_state": false}
"#;
        let steps = parse(Path::new("x.jsonl"), text).unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].action, "pwd");
        assert_eq!(steps[1].llm_latency_s, Some(2.5));
        assert!(steps[1].shell_state);
        let err = parse(Path::new("x.jsonl"), "{\"turn\": 0}\n").unwrap_err();
        assert!(err.to_string().contains("x.jsonl:1"), "{err}");
        assert!(matches!(parse(Path::new("e"), "\n"), Err(TraceError::Empty(_))));
    }

    #[test]
    fn discovery_and_provenance() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("mini-swe-agent/run1");
        std::fs::create_dir_all(&run).unwrap();
        let line = r#"{"turn": 0, "action": "ls"}"#;
        std::fs::write(run.join("b.jsonl"), line).unwrap();
        std::fs::write(run.join("a.jsonl"), line).unwrap();
        std::fs::write(run.join("notes.txt"), "x").unwrap();
        std::fs::write(
            dir.path().join("manifest.json"),
            r#"{"trajectories": [{"file": "mini-swe-agent/run1/a.jsonl", "source_repo": "github.com/x/y", "commit": "abc"}]}"#,
        )
        .unwrap();
        let found = discover(&[dir.path().join("mini-swe-agent")]).unwrap();
        let ids: Vec<&str> = found.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, vec!["mini-swe-agent/run1/a", "mini-swe-agent/run1/b"]);
        let all = load_all(&[dir.path().join("mini-swe-agent")], 1).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].family, Family::MiniSweAgent);
        assert_eq!(
            all[0].source,
            TraceSource { repo: "github.com/x/y".into(), commit: Some("abc".into()) }
        );
        assert_eq!(source_of(&run.join("b.jsonl")).repo, "project");
    }

    #[test]
    fn families() {
        assert_eq!(Family::of(Path::new("/t/mini-swe-agent/r/a.jsonl")), Family::MiniSweAgent);
        assert_eq!(Family::of(Path::new("/t/terminal-bench/a.jsonl")), Family::TerminalBench);
        assert_eq!(Family::of(Path::new("examples/traces/a.jsonl")), Family::Project);
    }
}
