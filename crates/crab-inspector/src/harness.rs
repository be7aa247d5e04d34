//! Harness exclusion: the processes and paths a sandbox declares as its harness (an agent, a
//! SWE-ReX server, a persistent session shell running inside it), compiled from the record's
//! [`HarnessSpec`], and the rules that keep them out of a turn's verdict.
//!
//! A harness process that ran is moved from `ran` to `harness_ran`: its running alone never
//! calls for a dump, but it is still in every dump taken for another reason (CRIU dumps the
//! whole tree), so a restore brings it back with the rest. A process is harness only when a
//! pattern matches the command line *its own exec* gave it: a child the harness forks without
//! exec'ing (a `( loop ) &` subshell) shares the command line but is the agent's work, and so
//! is everything the harness execs (its children exec their own command lines). Births and
//! deaths always count.
//!
//! Whether a process's command line is its own is read from the inspector's records: a process
//! born while the sandbox was tracked must have exec'd (its `exec_epoch` set at or after its
//! birth); one that was already there when the sandbox was attached (after a restore or a
//! daemon restart) counts when its parent's command line does not also match (a fork child
//! shares its parent's; an orphaned fork child re-parented to the init would be mistaken for
//! the harness — documented in docs/architecture.md).

use crab_common::api::HarnessSpec;

/// A compiled [`HarnessSpec`].
#[derive(Debug, Clone)]
pub struct Harness {
    cmd: Vec<regex::Regex>,
    paths: Vec<String>,
}

/// A bad harness declaration: what is wrong, to show the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HarnessSpecError(pub String);

impl Harness {
    /// Compile `spec`, refusing a pattern that is not a valid regular expression or a path that
    /// is not absolute.
    pub fn compile(spec: &HarnessSpec) -> Result<Harness, HarnessSpecError> {
        let mut cmd = Vec::new();
        for p in &spec.cmd {
            if p.is_empty() {
                return Err(HarnessSpecError(
                    "harness.cmd has an empty pattern, which would match every process; give a regular expression for the harness's command line, e.g. '^python3 -m swerex'".into(),
                ));
            }
            cmd.push(regex::Regex::new(p).map_err(|e| {
                HarnessSpecError(format!(
                    "harness.cmd pattern {p:?} is not a regular expression: {e}"
                ))
            })?);
        }
        let mut paths = Vec::new();
        for p in &spec.paths {
            if !p.starts_with('/') || p.split('/').any(|c| c == "..") {
                return Err(HarnessSpecError(format!(
                    "harness.paths entry {p:?} is not an absolute path without '..'; give it as seen inside the sandbox, e.g. /opt/agent"
                )));
            }
            let t = p.trim_end_matches('/');
            if t.is_empty() {
                return Err(HarnessSpecError(
                    "harness.paths entry \"/\" would exclude every file; name the harness's own directory".into(),
                ));
            }
            paths.push(t.to_string());
        }
        Ok(Harness { cmd, paths })
    }

    /// Whether `cmdline` (argv joined by spaces) matches a harness pattern.
    pub fn matches_cmdline(&self, cmdline: &str) -> bool {
        self.cmd.iter().any(|r| r.is_match(cmdline))
    }

    /// Whether a change of the exact sandbox path `path` is under a declared harness path.
    pub fn covers_path(&self, path: &str) -> bool {
        self.paths.iter().any(|p| {
            path == p
                || (path.starts_with(p.as_str()) && path.as_bytes().get(p.len()) == Some(&b'/'))
        })
    }

    /// Whether any process pattern is declared.
    pub fn has_cmd(&self) -> bool {
        !self.cmd.is_empty()
    }
}

/// The command line of `pid`, argv joined by single spaces (`None`: gone, or a kernel thread).
pub(crate) fn cmdline(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None;
    }
    let parts: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Some(parts.join(" "))
}

/// The parent of `pid` (`/proc/<pid>/stat` field 4).
pub(crate) fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(1)?.parse().ok()
}

/// What the inspector knows of a process that ran, for [`is_harness`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lineage {
    /// Epoch of its birth (0: present when the sandbox was attached).
    pub born_epoch: u64,
    /// Epoch of its last exec (0: none seen).
    pub exec_epoch: u64,
}

/// The rule of the module doc, with the command lines given: `own` the process's, `parent` its
/// parent's.
pub(crate) fn is_harness_with(
    h: &Harness,
    l: Lineage,
    own: Option<&str>,
    parent: Option<&str>,
) -> bool {
    let Some(own) = own else { return false };
    if !h.matches_cmdline(own) {
        return false;
    }
    if l.born_epoch > 0 {
        // Born while tracked: harness only if it exec'd since its birth.
        return l.exec_epoch >= l.born_epoch;
    }
    if l.exec_epoch > 0 {
        return true;
    }
    // Present at attach: its command line is its own unless its parent's is the same kind.
    !parent.is_some_and(|p| h.matches_cmdline(p))
}

/// [`is_harness_with`], reading the command lines from /proc.
pub(crate) fn is_harness(h: &Harness, pid: u32, l: Lineage) -> bool {
    let own = cmdline(pid);
    let par =
        if l.born_epoch == 0 && l.exec_epoch == 0 { parent(pid).and_then(cmdline) } else { None };
    is_harness_with(h, l, own.as_deref(), par.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(cmd: &[&str], paths: &[&str]) -> Harness {
        Harness::compile(&HarnessSpec {
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            paths: paths.iter().map(|s| s.to_string()).collect(),
        })
        .expect("compiles")
    }

    #[test]
    fn bad_specs_are_refused_naming_the_problem() {
        let e = Harness::compile(&HarnessSpec { cmd: vec!["(".into()], paths: vec![] })
            .expect_err("bad regex");
        assert!(e.0.contains("not a regular expression"), "{e}");
        let e = Harness::compile(&HarnessSpec { cmd: vec!["".into()], paths: vec![] })
            .expect_err("empty");
        assert!(e.0.contains("every process"), "{e}");
        for p in ["rel/dir", "/a/../b", "/"] {
            let e =
                Harness::compile(&HarnessSpec { cmd: vec![], paths: vec![p.into()] }).expect_err(p);
            assert!(e.0.contains("harness.paths"), "{e}");
        }
    }

    #[test]
    fn paths_cover_themselves_and_below_only() {
        let h = h(&[], &["/opt/agent/"]);
        assert!(h.covers_path("/opt/agent"));
        assert!(h.covers_path("/opt/agent/log/x"));
        assert!(!h.covers_path("/opt/agentx"));
        assert!(!h.covers_path("/opt"));
        assert!(!h.covers_path("/root/f"));
    }

    #[test]
    fn only_a_process_whose_own_exec_matches_is_harness() {
        let h = h(&["^crab-session "], &[]);
        let me = Some("crab-session --noprofile --norc");
        // Born while tracked and exec'd: harness.
        assert!(is_harness_with(&h, Lineage { born_epoch: 3, exec_epoch: 3 }, me, None));
        assert!(is_harness_with(&h, Lineage { born_epoch: 3, exec_epoch: 5 }, me, None));
        // A fork of the harness that never exec'd (a `( loop ) &` subshell): not harness.
        assert!(!is_harness_with(&h, Lineage { born_epoch: 4, exec_epoch: 0 }, me, me));
        assert!(!is_harness_with(
            &h,
            Lineage { born_epoch: 4, exec_epoch: 0 },
            me,
            Some("crab-init")
        ));
        // What the harness runs has its own command line.
        assert!(!is_harness_with(
            &h,
            Lineage { born_epoch: 4, exec_epoch: 4 },
            Some("python3 -m http.server"),
            me
        ));
        // Present at attach (restored): harness unless its parent is one too.
        assert!(is_harness_with(
            &h,
            Lineage { born_epoch: 0, exec_epoch: 0 },
            me,
            Some("crab-init")
        ));
        assert!(!is_harness_with(&h, Lineage { born_epoch: 0, exec_epoch: 0 }, me, me));
        // Gone or a kernel thread: not harness.
        assert!(!is_harness_with(&h, Lineage { born_epoch: 0, exec_epoch: 0 }, None, None));
    }
}
