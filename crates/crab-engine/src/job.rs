//! Jobs: what a checkpoint job is (sandbox, kind, changeset payload, turns covered), how two
//! queued jobs of one sandbox merge, what an executor reports back, and the error a waiter sees.

use std::sync::Arc;
use std::time::Duration;

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
