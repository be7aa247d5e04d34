//! [`TurnPolicy`]: what a turn's checkpoint contains. The one place that maps an inspector
//! verdict to a checkpoint kind and that remembers which sandboxes' last checkpoint failed.
//!
//! The rules, in order:
//! 1. The inspector's verdict decides (`skip`, `fs`, `process`, `full`); without a verdict (no
//!    inspector on this host, or the sandbox is untracked) the kind is `full`: never guessed.
//! 2. The init-only rule: the sandbox's init (`/.crab/init`) wakes up to reap orphans, so the
//!    inspector often sees it run; its memory holds nothing a restore could lose, so "only init
//!    ran" never calls for a process dump ([`ignore_init`]).
//! 3. Force-full after a failure: the inspector's turn is closed when a checkpoint is decided,
//!    so a failed checkpoint loses that turn's changeset; the next checkpoint of the sandbox is
//!    then `full`. The failure is stored here and nowhere else: it is reported by the engine's
//!    executor (a job failed, whichever door submitted it) and by the proxy through the typed
//!    seam (`TurnHooks::checkpoint_failed`: a turn's log could not be made durable, its
//!    boundary failed, or its gate timed out); a restore forgets it. Callers never pass a
//!    "force" of their own: [`TurnPolicy::decide`] and [`TurnPolicy::decide_kind`] apply it.
//! 4. The base rule: a sandbox's first restore point must hold the filesystem (there is no
//!    earlier snapshot to reference), so it is at least `fs` ([`TurnPolicy::base`]).
//! 5. The harness rule: a declared harness's running never calls for a dump (the inspector
//!    leaves it out), but a harness that holds state — a persistent shell whose `cd`, `export`
//!    or job changed — can say so (`POST /v1/sandboxes/{name}/harness/changed`); the next
//!    decided checkpoint then dumps the processes ([`TurnPolicy::harness_changed`]).
//! 6. The soft-dirty rule, only where the kernel tracks soft-dirty pages (`crab version --json`
//!    → `features.soft_dirty`; not on these hosts' kernels): dumps then clear the bits
//!    (CRIU's `--track-mem`), and a verdict whose only process change is that processes ran
//!    drops the dump when none of them wrote a page since the sandbox's last dump
//!    ([`ignore_quiet`]). Armed per sandbox by a dump that succeeded with the bits cleared;
//!    disarmed by a failed one and by a restore (its processes' pages are all freshly written).

use std::collections::HashSet;
use std::sync::Mutex;

use crab_common::sync::lock;
use crab_common::CheckpointKind;
use crab_inspector::Verdict;

/// The kind decided for a checkpoint, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Kind of the checkpoint to take.
    pub kind: CheckpointKind,
    /// Why the kind differs from the plain verdict's (empty when it does not).
    pub reasons: Vec<String>,
    /// The inspector's verdict, when there was one.
    pub verdict: Option<Verdict>,
}

/// The turn policy (see the module documentation).
#[derive(Debug, Default)]
pub struct TurnPolicy {
    /// Sandboxes whose last checkpoint failed: their next decided checkpoint is `full`.
    force_full: Mutex<HashSet<String>>,
    /// Sandboxes whose harness said its state changed: their next decided checkpoint dumps.
    harness_changed: Mutex<HashSet<String>>,
    /// Sandboxes whose last dump cleared the soft-dirty bits of all their processes.
    soft_dirty_armed: Mutex<HashSet<String>>,
}

impl TurnPolicy {
    /// A policy with no failures recorded.
    pub fn new() -> Self {
        TurnPolicy::default()
    }

    /// Rule 6: `sandbox`'s dump just succeeded with its processes' soft-dirty bits cleared
    /// (`armed`), or a dump of it failed (not armed: the bits may be cleared with no image
    /// taken).
    pub fn soft_dirty_dumped(&self, sandbox: &str, armed: bool) {
        if armed {
            lock(&self.soft_dirty_armed).insert(sandbox.to_string());
        } else {
            lock(&self.soft_dirty_armed).remove(sandbox);
        }
    }

    /// Remember that `sandbox`'s declared harness changed its own state (rule 5): its next
    /// decided checkpoint dumps the processes.
    pub fn harness_changed(&self, sandbox: &str) {
        lock(&self.harness_changed).insert(sandbox.to_string());
    }

    /// Remember that `sandbox`'s last checkpoint failed (or could not be started).
    pub fn failed(&self, sandbox: &str) {
        lock(&self.force_full).insert(sandbox.to_string());
    }

    /// Force `sandbox`'s next decided checkpoint full (e.g. after its checkpoint policy went
    /// from `fs` or `none` back to `auto`: its newest process image may be stale).
    pub fn force_full(&self, sandbox: &str) {
        lock(&self.force_full).insert(sandbox.to_string());
    }

    /// Forget a pending forced full checkpoint and a pending harness change (after a restore,
    /// or once taken: the harness's state is then the restored point's).
    pub fn clear(&self, sandbox: &str) {
        lock(&self.force_full).remove(sandbox);
        lock(&self.harness_changed).remove(sandbox);
        lock(&self.soft_dirty_armed).remove(sandbox);
    }

    /// Whether `sandbox`'s next checkpoint is forced full.
    pub fn is_forced(&self, sandbox: &str) -> bool {
        lock(&self.force_full).contains(sandbox)
    }

    /// Decide the kind of `sandbox`'s checkpoint from the inspector's `verdict` (or why there
    /// is none). `init_pid` is the sandbox's init (for the init-only rule). Consumes a recorded
    /// failure and a recorded harness change.
    pub fn decide(
        &self,
        sandbox: &str,
        verdict: Result<Verdict, String>,
        init_pid: Option<u32>,
    ) -> Decision {
        self.decide_with(sandbox, verdict, init_pid, None)
    }

    /// Rule 3 alone, for a checkpoint whose content is chosen without a verdict (the proxy's
    /// test hooks and benchmark pick `kind` themselves): `full` when `sandbox`'s last
    /// checkpoint failed (consumed), else `kind`.
    pub fn decide_kind(&self, sandbox: &str, kind: CheckpointKind) -> CheckpointKind {
        if lock(&self.force_full).remove(sandbox) {
            CheckpointKind::Full
        } else {
            kind
        }
    }

    /// [`TurnPolicy::decide`] with rule 6: `dirty` gives the pages a (host) pid wrote since
    /// its bits were last cleared (`None`: unknown), passed only where soft-dirty works; used
    /// only when `sandbox`'s last dump armed it.
    pub fn decide_with(
        &self,
        sandbox: &str,
        verdict: Result<Verdict, String>,
        init_pid: Option<u32>,
        dirty: Option<&dyn Fn(u32) -> Option<usize>>,
    ) -> Decision {
        let forced = lock(&self.force_full).remove(sandbox);
        let harness = lock(&self.harness_changed).remove(sandbox);
        let mut reasons = Vec::new();
        match verdict {
            Ok(mut v) => {
                if let Some(pid) = init_pid {
                    if ignore_init(&mut v, pid) {
                        reasons.push(
                            "only the sandbox's init ran (it reaps orphans; it has no state to save)"
                                .into(),
                        );
                    }
                }
                if let Some(dirty) =
                    dirty.filter(|_| lock(&self.soft_dirty_armed).contains(sandbox))
                {
                    if ignore_quiet(&mut v, dirty) {
                        reasons.push(
                            "its processes ran but wrote no page since the last dump (soft-dirty)"
                                .into(),
                        );
                    }
                }
                let mut kind = v.kind;
                if harness && !kind.dumps_processes() {
                    reasons.push("the sandbox's harness said its state changed".into());
                    kind = kind.merge(CheckpointKind::Process);
                }
                if forced && kind != CheckpointKind::Full {
                    reasons.push("the previous checkpoint failed: taking a full one".into());
                    kind = CheckpointKind::Full;
                }
                Decision { kind, reasons, verdict: Some(v) }
            }
            Err(why) => {
                reasons.push(format!("{why}: taking a full checkpoint"));
                Decision { kind: CheckpointKind::Full, reasons, verdict: None }
            }
        }
    }

    /// The base rule: the first restore point of a sandbox holds its filesystem.
    pub fn base(kind: CheckpointKind, first_point: bool) -> CheckpointKind {
        if first_point {
            kind.merge(CheckpointKind::Fs)
        } else {
            kind
        }
    }
}

/// The init-only rule: when the verdict's only process change is "init ran" (nothing born or
/// died, no other reason, not conservative), drop the process part. Returns whether the verdict
/// changed.
pub fn ignore_init(v: &mut Verdict, init_pid: u32) -> bool {
    let p = &v.processes;
    let only_init = p.born.is_empty() && p.died.is_empty() && p.ran == [init_pid];
    if v.conservative || !only_init || !v.reasons.is_empty() {
        return false;
    }
    drop_process_part(v);
    true
}

/// The verdict without its process part: nothing ran, and the kind keeps only its files.
fn drop_process_part(v: &mut Verdict) {
    v.processes.ran.clear();
    v.kind = match v.kind {
        CheckpointKind::Full => CheckpointKind::Fs,
        CheckpointKind::Process => CheckpointKind::Skip,
        other => other,
    };
}

/// Rule 6: when the verdict's only process change is that processes ran (nothing born or died,
/// no other reason, not conservative) and `dirty` says every one of them wrote no page since
/// the last dump cleared its soft-dirty bits, drop the process part. A pid whose pages cannot
/// be read (gone, too large) keeps the dump. Returns whether the verdict changed.
pub fn ignore_quiet(v: &mut Verdict, dirty: &dyn Fn(u32) -> Option<usize>) -> bool {
    let p = &v.processes;
    let only_ran = p.born.is_empty() && p.died.is_empty() && !p.ran.is_empty();
    if v.conservative || !only_ran || !v.reasons.is_empty() || !v.kind.dumps_processes() {
        return false;
    }
    if !p.ran.iter().all(|&pid| dirty(pid) == Some(0)) {
        return false;
    }
    drop_process_part(v);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_inspector::ProcessChanges;

    fn verdict(kind: CheckpointKind, ran: Vec<u32>, born: Vec<u32>) -> Verdict {
        Verdict {
            sandbox: "s".into(),
            turn: 1,
            kind,
            changeset: Vec::new(),
            processes: ProcessChanges { born, died: Vec::new(), ran, ..Default::default() },
            reasons: Vec::new(),
            conservative: false,
        }
    }

    #[test]
    fn init_alone_does_not_need_a_dump() {
        let mut v = verdict(CheckpointKind::Process, vec![7], vec![]);
        assert!(ignore_init(&mut v, 7));
        assert_eq!(v.kind, CheckpointKind::Skip);
        let mut v = verdict(CheckpointKind::Full, vec![7], vec![]);
        assert!(ignore_init(&mut v, 7));
        assert_eq!(v.kind, CheckpointKind::Fs);
    }

    #[test]
    fn anything_else_keeps_the_dump() {
        for mut v in [
            verdict(CheckpointKind::Process, vec![7, 8], vec![]),
            verdict(CheckpointKind::Process, vec![8], vec![]),
            verdict(CheckpointKind::Process, vec![7], vec![9]),
        ] {
            assert!(!ignore_init(&mut v, 7));
            assert_eq!(v.kind, CheckpointKind::Process);
        }
        let mut v = verdict(CheckpointKind::Full, vec![7], vec![]);
        v.conservative = true;
        assert!(!ignore_init(&mut v, 7));
        let mut v = verdict(CheckpointKind::Process, vec![7], vec![]);
        v.reasons.push("pid 7 maps a changed file".into());
        assert!(!ignore_init(&mut v, 7));
    }

    #[test]
    fn the_verdict_decides() {
        let p = TurnPolicy::new();
        for k in CheckpointKind::ALL {
            let d = p.decide("s", Ok(verdict(k, vec![], vec![])), Some(1));
            assert_eq!(d.kind, k);
            assert!(d.reasons.is_empty());
            assert_eq!(d.verdict.map(|v| v.kind), Some(k));
        }
    }

    #[test]
    fn a_harness_change_dumps_the_next_decided_checkpoint_once() {
        let p = TurnPolicy::new();
        p.harness_changed("s");
        let d = p.decide("s", Ok(verdict(CheckpointKind::Skip, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Process, "{d:?}");
        assert!(d.reasons[0].contains("harness"), "{d:?}");
        // consumed: the next one is the verdict's again; a file change and a harness change
        // make a full point
        let d = p.decide("s", Ok(verdict(CheckpointKind::Skip, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Skip);
        p.harness_changed("s");
        let d = p.decide("s", Ok(verdict(CheckpointKind::Fs, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Full);
        // another sandbox's change is not this one's; a restore forgets it
        p.harness_changed("t");
        let d = p.decide("s", Ok(verdict(CheckpointKind::Skip, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Skip);
        p.clear("t");
        let d = p.decide("t", Ok(verdict(CheckpointKind::Skip, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Skip);
    }

    /// Pagemaps recorded on a soft-dirty kernel (see `crab_criu::soft_dirty`'s tests): entries
    /// of a process that wrote nothing since the clear, and of one that wrote a page.
    fn recorded_dirty(pid: u32) -> Option<usize> {
        const CLEAN: u64 = 0xa100_0000_0012_3456;
        const WRITTEN: u64 = 0xa180_0000_0012_3456;
        let pagemap: &[u64] = match pid {
            10 => &[CLEAN, CLEAN, 0],
            11 => &[CLEAN, WRITTEN],
            _ => return None, // gone
        };
        Some(crab_criu::soft_dirty::dirty_pages(pagemap))
    }

    #[test]
    fn soft_dirty_drops_a_dump_of_processes_that_wrote_nothing_once_armed() {
        let p = TurnPolicy::new();
        let quiet = verdict(CheckpointKind::Process, vec![10], vec![]);
        // not armed (no dump cleared the bits yet): the dump stays
        let d = p.decide_with("s", Ok(quiet.clone()), None, Some(&recorded_dirty));
        assert_eq!(d.kind, CheckpointKind::Process, "{d:?}");
        p.soft_dirty_dumped("s", true);
        let d = p.decide_with("s", Ok(quiet.clone()), None, Some(&recorded_dirty));
        assert_eq!(d.kind, CheckpointKind::Skip, "{d:?}");
        assert!(d.reasons[0].contains("soft-dirty"), "{d:?}");
        // with file changes too: full becomes fs
        let d = p.decide_with(
            "s",
            Ok(verdict(CheckpointKind::Full, vec![10], vec![])),
            None,
            Some(&recorded_dirty),
        );
        assert_eq!(d.kind, CheckpointKind::Fs, "{d:?}");
        // a written page, a pid that cannot be read, a birth: the dump stays
        for v in [
            verdict(CheckpointKind::Process, vec![10, 11], vec![]),
            verdict(CheckpointKind::Process, vec![12], vec![]),
            verdict(CheckpointKind::Process, vec![10], vec![13]),
        ] {
            let d = p.decide_with("s", Ok(v), None, Some(&recorded_dirty));
            assert_eq!(d.kind, CheckpointKind::Process, "{d:?}");
        }
        // without soft-dirty (no reader), or disarmed by a failed dump or a restore
        let d = p.decide_with("s", Ok(quiet.clone()), None, None);
        assert_eq!(d.kind, CheckpointKind::Process);
        p.soft_dirty_dumped("s", false);
        let d = p.decide_with("s", Ok(quiet.clone()), None, Some(&recorded_dirty));
        assert_eq!(d.kind, CheckpointKind::Process);
        p.soft_dirty_dumped("s", true);
        p.clear("s");
        let d = p.decide_with("s", Ok(quiet), None, Some(&recorded_dirty));
        assert_eq!(d.kind, CheckpointKind::Process);
    }

    #[test]
    fn no_verdict_is_full_never_a_guess() {
        let d = TurnPolicy::new().decide("s", Err("inspector unavailable".into()), None);
        assert_eq!(d.kind, CheckpointKind::Full);
        assert!(d.verdict.is_none());
        assert!(d.reasons[0].contains("inspector unavailable"));
    }

    #[test]
    fn init_only_rule_applies_through_decide() {
        let p = TurnPolicy::new();
        let d = p.decide("s", Ok(verdict(CheckpointKind::Process, vec![7], vec![])), Some(7));
        assert_eq!(d.kind, CheckpointKind::Skip);
        assert_eq!(d.reasons.len(), 1);
    }

    #[test]
    fn a_failure_forces_the_next_checkpoint_full_once() {
        let p = TurnPolicy::new();
        p.failed("s");
        assert!(p.is_forced("s"));
        assert!(!p.is_forced("t"), "a failure is per sandbox");
        let d = p.decide("s", Ok(verdict(CheckpointKind::Skip, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Full);
        assert!(d.reasons[0].contains("previous checkpoint failed"));
        let d = p.decide("s", Ok(verdict(CheckpointKind::Skip, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Skip, "the failure is consumed by one decision");
        // the verdict-less form follows the same rule from the same record
        p.failed("s");
        assert_eq!(p.decide_kind("s", CheckpointKind::Fs), CheckpointKind::Full);
        assert_eq!(p.decide_kind("s", CheckpointKind::Fs), CheckpointKind::Fs, "consumed");
    }

    #[test]
    fn a_restore_forgets_the_failure() {
        let p = TurnPolicy::new();
        p.failed("s");
        p.clear("s");
        let d = p.decide("s", Ok(verdict(CheckpointKind::Fs, vec![], vec![])), None);
        assert_eq!(d.kind, CheckpointKind::Fs);
    }

    #[test]
    fn the_first_point_is_the_base() {
        assert_eq!(TurnPolicy::base(CheckpointKind::Skip, true), CheckpointKind::Fs);
        assert_eq!(TurnPolicy::base(CheckpointKind::Process, true), CheckpointKind::Full);
        assert_eq!(TurnPolicy::base(CheckpointKind::Full, true), CheckpointKind::Full);
        assert_eq!(TurnPolicy::base(CheckpointKind::Skip, false), CheckpointKind::Skip);
        assert_eq!(TurnPolicy::base(CheckpointKind::Process, false), CheckpointKind::Process);
    }
}
