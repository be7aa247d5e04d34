//! Jobs: what a checkpoint job is (sandbox, kind, changeset payload, turns covered), how two
//! queued jobs of one sandbox merge, what an executor reports back, and the error a waiter sees.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crab_common::CheckpointKind;
use serde::{Deserialize, Serialize};

/// Engine-wide job id. Coalesced submissions share the id of the job they merged into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "job-{}", self.0)
    }
}

/// What a job does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobOp {
    /// Take a checkpoint (coalesces with the sandbox's queued checkpoint).
    #[default]
    Checkpoint,
    /// Restore (or fork from) a checkpoint: never coalesces; `kind` says which parts it
    /// restores (process/full ones count against the CRIU limit).
    Restore,
}

impl JobOp {
    /// `checkpoint` or `restore`.
    pub fn as_str(self) -> &'static str {
        match self {
            JobOp::Checkpoint => "checkpoint",
            JobOp::Restore => "restore",
        }
    }
}

/// A job payload (the inspector's changeset) that can absorb a later one when two queued jobs
/// of a sandbox coalesce.
pub trait Changeset: Send + Sync + 'static {
    /// Fold `later` (the changeset of a later turn) into `self`.
    fn merge(&mut self, later: Self);
}

impl Changeset for () {
    fn merge(&mut self, _later: Self) {}
}

/// What a caller submits.
#[derive(Debug, Clone)]
pub struct JobSpec<P> {
    /// Checkpoint or restore.
    pub op: JobOp,
    /// Sandbox name.
    pub sandbox: String,
    /// Verdict.
    pub kind: CheckpointKind,
    /// Changeset.
    pub payload: P,
    /// Turn number whose boundary this checkpoint captures.
    pub turn: u64,
    /// Start in the urgent queue (a response is already waiting).
    pub urgent: bool,
}

impl<P> JobSpec<P> {
    /// A checkpoint of `sandbox` at the boundary of `turn` (normal priority).
    pub fn checkpoint(
        sandbox: impl Into<String>,
        kind: CheckpointKind,
        payload: P,
        turn: u64,
    ) -> Self {
        JobSpec {
            op: JobOp::Checkpoint,
            sandbox: sandbox.into(),
            kind,
            payload,
            turn,
            urgent: false,
        }
    }

    /// A restore of `sandbox` (urgent: someone waits for it). `payload` names what to restore.
    pub fn restore(sandbox: impl Into<String>, kind: CheckpointKind, payload: P) -> Self {
        JobSpec {
            op: JobOp::Restore,
            sandbox: sandbox.into(),
            kind,
            payload,
            turn: 0,
            urgent: true,
        }
    }
}

/// A job as the executor sees it. After coalescing it covers turns `first_turn..=turn`, and its
/// restore point is the one of `turn`.
#[derive(Debug, Clone)]
pub struct Job<P> {
    /// Id.
    pub id: JobId,
    /// Checkpoint or restore.
    pub op: JobOp,
    /// Sandbox name.
    pub sandbox: String,
    /// Merged verdict.
    pub kind: CheckpointKind,
    /// Merged changeset.
    pub payload: P,
    /// Earliest turn covered.
    pub first_turn: u64,
    /// Latest turn covered: the restore point to publish.
    pub turn: u64,
    /// Number of submissions merged into this job (1 when none were).
    pub submissions: u32,
}

/// What an executor reports for a finished job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOutcome {
    /// Id of the published restore point.
    pub checkpoint_id: String,
    /// Bytes written to disk (charged to the bandwidth budget).
    pub bytes: u64,
    /// Where the run's time went, stage by stage in the order they ran (e.g. `lock`,
    /// `criu_dump`, `syncfs`, `manifest_publish`); empty when the executor does not say.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<Stage>,
}

/// One stage of a job's run, as its executor timed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// Stage name.
    pub name: String,
    /// Its duration, microseconds.
    pub us: u64,
}

impl Stage {
    /// A stage `name` that took `d`.
    pub fn new(name: impl Into<String>, d: Duration) -> Self {
        Stage { name: name.into(), us: u64::try_from(d.as_micros()).unwrap_or(u64::MAX) }
    }
}

/// An executor's typed error, shared by every waiter of the job. Downcast it
/// (`JobError::source_as::<E>()`) to get the executor's own error type back.
pub type ExecError = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Runs jobs (checkpoints and restores; see [`Job::op`]). Called on a blocking thread; may take
/// as long as the work takes.
pub trait Executor<P>: Send + Sync + 'static {
    /// What a failed job reports; waiters get it back through [`JobError::source_as`].
    type Error: std::error::Error + Send + Sync + 'static;
    /// Do the checkpoint and publish its restore point; return what was written, or the error
    /// naming what failed.
    fn run(&self, job: &Job<P>) -> Result<JobOutcome, Self::Error>;
}

/// The engine's view of an executor: its error type erased.
pub(crate) trait ErasedExecutor<P>: Send + Sync + 'static {
    fn run(&self, job: &Job<P>) -> Result<JobOutcome, ExecError>;
}

impl<P, X: Executor<P>> ErasedExecutor<P> for X {
    fn run(&self, job: &Job<P>) -> Result<JobOutcome, ExecError> {
        Executor::run(self, job).map_err(|e| Arc::new(e) as ExecError)
    }
}

/// An executor made of a closure (for tests and simulations).
pub struct FnExecutor<F>(pub F);

impl<F> std::fmt::Debug for FnExecutor<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnExecutor")
    }
}

impl<P, E, F> Executor<P> for FnExecutor<F>
where
    E: std::error::Error + Send + Sync + 'static,
    F: Fn(&Job<P>) -> Result<JobOutcome, E> + Send + Sync + 'static,
{
    type Error = E;
    fn run(&self, job: &Job<P>) -> Result<JobOutcome, E> {
        (self.0)(job)
    }
}

/// A finished job as its waiters see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finished {
    /// Job id.
    pub job: JobId,
    /// Checkpoint or restore.
    pub op: JobOp,
    /// Sandbox.
    pub sandbox: String,
    /// Kind actually run (after coalescing).
    pub kind: CheckpointKind,
    /// Latest turn covered.
    pub turn: u64,
    /// What the executor reported.
    pub outcome: JobOutcome,
    /// Time from first submission to start.
    pub queue_wait: Duration,
    /// Time the executor ran.
    pub run_time: Duration,
    /// When the job started (not serialized: an instant of this process).
    #[serde(skip)]
    pub started_at: Option<Instant>,
    /// When it finished and its waiters were told.
    #[serde(skip)]
    pub finished_at: Option<Instant>,
}

impl Finished {
    /// Where a gate's wait on this job went: the gate waited from `gate_start` until it woke at
    /// `woke`; the job's timeline is its queue wait, the executor's stages in order
    /// ([`JobOutcome::stages`]; what they leave of the run time is `engine_other`), then
    /// `gate_wakeup` (from the job's end until the gate ran). Each stage is charged the part of
    /// it that overlapped the wait, so the parts add up to the wait (`woke - gate_start`) as
    /// long as the job was submitted before the gate started. Stages of zero overlap are left
    /// out; times are in milliseconds.
    pub fn held_breakdown(&self, gate_start: Instant, woke: Instant) -> Vec<(String, f64)> {
        let (Some(started), Some(finished)) = (self.started_at, self.finished_at) else {
            return Vec::new();
        };
        let submitted = started.checked_sub(self.queue_wait).unwrap_or(started);
        let mut spans: Vec<(&str, Instant, Instant)> = vec![("queue", submitted, started)];
        let mut t = started;
        for st in &self.outcome.stages {
            let end = (t + Duration::from_micros(st.us)).min(finished);
            spans.push((&st.name, t, end));
            t = end;
        }
        spans.push(("engine_other", t, finished));
        spans.push(("gate_wakeup", finished, woke.max(finished)));
        let mut out: Vec<(String, f64)> = Vec::new();
        for (name, a, b) in spans {
            let a = a.max(gate_start);
            let b = b.min(woke);
            if b <= a {
                continue;
            }
            let ms = (b - a).as_secs_f64() * 1e3;
            match out.iter_mut().find(|(n, _)| n == name) {
                Some((_, v)) => *v += ms,
                None => out.push((name.to_string(), ms)),
            }
        }
        out
    }
}

/// Why a job did not publish.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    /// The executor reported a failure.
    #[error("{} {job} of sandbox {sandbox} (turn {turn}, {kind}) failed: {message}", op.as_str())]
    Failed {
        /// Job id.
        job: JobId,
        /// Checkpoint or restore.
        op: JobOp,
        /// Sandbox.
        sandbox: String,
        /// Kind.
        kind: CheckpointKind,
        /// Latest turn covered.
        turn: u64,
        /// The executor's error, as text.
        message: String,
        /// The executor's error itself.
        #[source]
        source: ExecError,
    },
    /// The executor panicked.
    #[error("job {job} of sandbox {sandbox} crashed the executor: {message}")]
    Panicked {
        /// Job id.
        job: JobId,
        /// Sandbox.
        sandbox: String,
        /// Panic message, as far as it could be recovered.
        message: String,
    },
    /// The engine went away before the job finished.
    #[error("the checkpoint engine shut down before {job} finished")]
    EngineGone {
        /// Job id.
        job: JobId,
    },
}

impl JobError {
    /// The executor's own error, when the job failed with one of type `E`.
    pub fn source_as<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            JobError::Failed { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(queue_ms: u64, stages: &[(&str, u64)], run_ms: u64) -> (Finished, Instant) {
        let t0 = Instant::now();
        let started = t0 + Duration::from_millis(queue_ms);
        let f = Finished {
            job: JobId(1),
            op: JobOp::Checkpoint,
            sandbox: "s".into(),
            kind: CheckpointKind::Full,
            turn: 1,
            outcome: JobOutcome {
                checkpoint_id: "c1".into(),
                bytes: 0,
                stages: stages
                    .iter()
                    .map(|(n, ms)| Stage { name: n.to_string(), us: ms * 1000 })
                    .collect(),
            },
            queue_wait: Duration::from_millis(queue_ms),
            run_time: Duration::from_millis(run_ms),
            started_at: Some(started),
            finished_at: Some(started + Duration::from_millis(run_ms)),
        };
        (f, t0)
    }

    fn get(b: &[(String, f64)], name: &str) -> f64 {
        b.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or(0.0)
    }

    #[test]
    fn a_wait_is_charged_to_the_stages_it_overlapped() {
        // Submitted at 0; queue 0..10; lock 10..12; criu_dump 12..42; syncfs 42..50; the rest
        // of the run 50..55 (engine_other); the gate ran from 30 and woke at 57.
        let (f, t0) = finished(10, &[("lock", 2), ("criu_dump", 30), ("syncfs", 8)], 45);
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let b = f.held_breakdown(ms(30), ms(57));
        let names: Vec<&str> = b.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["criu_dump", "syncfs", "engine_other", "gate_wakeup"]);
        assert!((get(&b, "criu_dump") - 12.0).abs() < 1e-6);
        assert!((get(&b, "syncfs") - 8.0).abs() < 1e-6);
        assert!((get(&b, "engine_other") - 5.0).abs() < 1e-6);
        assert!((get(&b, "gate_wakeup") - 2.0).abs() < 1e-6);
        let sum: f64 = b.iter().map(|(_, v)| v).sum();
        assert!((sum - 27.0).abs() < 1e-6, "the parts add up to the wait: {sum}");
    }

    #[test]
    fn a_gate_that_waited_from_the_start_sees_the_queue() {
        let (f, t0) = finished(20, &[("freeze_snapshot", 5)], 5);
        let b = f.held_breakdown(t0, t0 + Duration::from_millis(25));
        assert!((get(&b, "queue") - 20.0).abs() < 1e-6);
        assert!((get(&b, "freeze_snapshot") - 5.0).abs() < 1e-6);
        assert_eq!(get(&b, "gate_wakeup"), 0.0);
        // Stages longer than the run are clipped to it (no time is counted twice).
        let (f, t0) = finished(0, &[("a", 10), ("b", 10)], 12);
        let b = f.held_breakdown(t0, t0 + Duration::from_millis(12));
        assert!((get(&b, "a") - 10.0).abs() < 1e-6 && (get(&b, "b") - 2.0).abs() < 1e-6);
        let sum: f64 = b.iter().map(|(_, v)| v).sum();
        assert!((sum - 12.0).abs() < 1e-6);
    }

    #[test]
    fn no_instants_no_breakdown() {
        let (mut f, t0) = finished(1, &[], 1);
        f.started_at = None;
        assert!(f.held_breakdown(t0, t0 + Duration::from_millis(5)).is_empty());
    }
}
