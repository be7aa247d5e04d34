//! The host's side of the seams of the engine and the proxy.
//!
//! * [`CheckpointExecutor`] is the engine's [`Executor`]: it publishes a restore point of the
//!   job's (merged) kind through the [`Checkpointer`], applying the turn policy's base rule, and
//!   reports a failure to the [`TurnPolicy`] (the next checkpoint is full); its typed
//!   [`HostError`] reaches every waiter through the engine.
//! * [`Hooks`] is the proxy's [`TurnHooks`]: at a turn boundary it closes the inspector's turn,
//!   asks the [`TurnPolicy`] for the kind, submits the job with the verdict's changeset, and hands
//!   the proxy a [`JobTicket`] to gate the response on; a turn the proxy reports failed goes to
//!   the [`TurnPolicy`] too. Errors cross as [`HookError`] (the [`HostError`]'s code, message
//!   and hint unchanged, both ways).
//! * [`SandboxDir`] tells the proxy which sandboxes exist and where their conversation logs live
//!   (`<pool>/sandboxes/<name>/conversation.log`, next to the root subvolume).

use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use crab_checkpoint::{CheckpointRequest, Checkpointer};
use crab_common::CheckpointKind;
use crab_coordinator::{
    Boundary, BoundaryTicket, BoxFuture, HookError, Published, SandboxDirectory, TurnHooks,
};
use crab_engine::{Changeset, Engine, Executor, Job, JobHandle, JobOutcome, Stage};
use crab_inspector::PathChange;

use crate::{Host, HostError, TurnPolicy};

/// What a checkpoint job carries: what its restore point records besides its parts, and the
/// inspector's changeset of the turns it covers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Payload {
    /// Turn number to record.
    pub turn: Option<u64>,
    /// Conversation-log offset to record.
    pub conversation_offset: Option<u64>,
    /// The paths the covered turns changed (as the inspector saw them).
    pub changeset: Vec<PathChange>,
}

impl Changeset for Payload {
    /// A later turn's point wins (its turn and offset); the changesets add up.
    fn merge(&mut self, later: Self) {
        if later.turn.is_some() {
            self.turn = later.turn;
        }
        if later.conversation_offset.is_some() {
            self.conversation_offset = later.conversation_offset;
        }
        for c in later.changeset {
            if !self.changeset.contains(&c) {
                self.changeset.push(c);
            }
        }
    }
}

/// Runs checkpoint jobs for the engine.
#[derive(Debug)]
pub struct CheckpointExecutor {
    checkpointer: Arc<Checkpointer>,
    policy: Arc<TurnPolicy>,
}

impl CheckpointExecutor {
    /// An executor publishing through `checkpointer`, reporting failures to `policy`.
    pub fn new(checkpointer: Arc<Checkpointer>, policy: Arc<TurnPolicy>) -> Self {
        CheckpointExecutor { checkpointer, policy }
    }

    fn publish(&self, job: &Job<Payload>) -> Result<JobOutcome, HostError> {
        let t0 = Instant::now();
        let first = self.checkpointer.store(&job.sandbox)?.point_ids()?.is_empty();
        let kind = TurnPolicy::base(job.kind, first);
        let req = CheckpointRequest {
            kind,
            turn: job.payload.turn,
            conversation_offset: job.payload.conversation_offset,
        };
        tracing::debug!(
            sandbox = %job.sandbox,
            %kind,
            changed_paths = job.payload.changeset.len(),
            "checkpoint job"
        );
        let t_call = Instant::now();
        let r = self.checkpointer.checkpoint(&job.sandbox, req);
        if kind.dumps_processes() {
            // Policy rule 6: armed when this dump cleared the bits (where the kernel has them);
            // a failed dump may have cleared them with no image taken.
            let armed = matches!(&r, Ok(m) if self.checkpointer.track_mem() && m.procs.is_some());
            self.policy.soft_dirty_dumped(&job.sandbox, armed);
        }
        let m = r?;
        let call = t_call.elapsed();
        let stages = stages(&m.timings, kind, call, t0.elapsed());
        let summary = crab_checkpoint::PointSummary::of(&m);
        let bytes = if kind == CheckpointKind::Skip { 0 } else { summary.size_bytes };
        Ok(JobOutcome { checkpoint_id: summary.id, bytes, stages })
    }
}

/// The stages of a checkpoint job in the order they ran, from the manifest's timings, the
/// checkpoint call's duration `call` and the executor's `total`: `setup` (the store listing,
/// the parent's manifest, quota figures: what the others leave), `lock` (the sandbox's
/// checkpoint lock and its store's), the capture (`freeze_snapshot` for an fs point: freeze,
/// btrfs snapshot, thaw; `criu_dump` for a process or full one: CRIU's freeze, dump and, for
/// full, the snapshot under it), the image files' `hash` and `syncfs` (they overlap: the longer
/// one is charged), `dir_fsync` (the new parts' directory entries) and `manifest_publish`
/// (the manifest's write, fsync, rename and directory fsync).
fn stages(
    t: &crab_checkpoint::Timings,
    kind: CheckpointKind,
    call: Duration,
    total: Duration,
) -> Vec<Stage> {
    let d = |us: Option<u64>| Duration::from_micros(us.unwrap_or(0));
    let lock = d(t.lock_us);
    let capture = match kind {
        CheckpointKind::Skip => None,
        CheckpointKind::Fs => Some(("freeze_snapshot", d(t.frozen_us.or(t.fs_snapshot_us)))),
        CheckpointKind::Process | CheckpointKind::Full => Some(("criu_dump", d(t.dump_us))),
    };
    let (hash, sync) = (d(t.hash_us), d(t.sync_us));
    let hash_sync = if sync >= hash { ("syncfs", sync) } else { ("hash", hash) };
    let dir = d(t.dir_sync_us);
    let manifest = call.saturating_sub(d(t.total_us));
    let timed = lock + capture.map_or(Duration::ZERO, |c| c.1) + hash_sync.1 + dir + manifest;
    let mut v = vec![Stage::new("setup", total.saturating_sub(timed)), Stage::new("lock", lock)];
    if let Some((name, dur)) = capture {
        v.push(Stage::new(name, dur));
    }
    if !hash_sync.1.is_zero() {
        v.push(Stage::new(hash_sync.0, hash_sync.1));
    }
    v.push(Stage::new("dir_fsync", dir));
    v.push(Stage::new("manifest_publish", manifest));
    v
}

impl Executor<Payload> for CheckpointExecutor {
    type Error = HostError;

    fn run(&self, job: &Job<Payload>) -> Result<JobOutcome, HostError> {
        // A panic is a failure too (the engine turns it into the job's error).
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.publish(job)));
        if !matches!(r, Ok(Ok(_))) {
            // The inspector's turn was closed when this job was decided: its changes are
            // only safe in a full checkpoint now. The policy's record, whoever waits.
            self.policy.failed(&job.sandbox);
        }
        r.unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

/// The proxy's view of the sandboxes.
#[derive(Debug)]
pub struct SandboxDir(pub Arc<crab_sandbox::Runtime>);

impl SandboxDirectory for SandboxDir {
    fn exists(&self, name: &str) -> bool {
        self.0.record(name).is_ok()
    }
    fn conversation_log_path(&self, name: &str) -> PathBuf {
        self.0.state().sandbox_dir(name).join("conversation.log")
    }
}

/// The proxy's turn hooks over the host's [`TurnPolicy`] (the host is set once it exists).
#[derive(Debug)]
pub struct Hooks {
    host: OnceLock<Weak<Host>>,
    policy: Arc<TurnPolicy>,
}

impl Hooks {
    /// Hooks reporting failed turns to `policy` (the host's).
    pub fn new(policy: Arc<TurnPolicy>) -> Self {
        Hooks { host: OnceLock::new(), policy }
    }

    /// The host whose boundaries these are (set once; later calls are ignored).
    pub fn set_host(&self, host: Weak<Host>) {
        let _ = self.host.set(host);
    }
}

impl TurnHooks for Hooks {
    fn on_boundary(
        &self,
        b: Boundary,
    ) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, HookError>> {
        Box::pin(async move {
            let host = self.host.get().and_then(Weak::upgrade).ok_or_else(|| {
                HookError::internal("the host is not running (the daemon is starting or stopping)")
            })?;
            Ok(host.boundary(&b).await?)
        })
    }

    fn checkpoint_failed(&self, sandbox: &str, turn: u64, error: &HookError) {
        tracing::debug!(sandbox, turn, code = ?error.code(), "turn without a checkpoint: the next one is full");
        self.policy.failed(sandbox);
    }
}

/// The typed error of a failed job: the executor's own [`HostError`], or the engine's (a
/// panic, a shutdown) as an internal one.
pub fn job_error(e: &crab_engine::JobError) -> HostError {
    e.source_as::<HostError>().cloned().unwrap_or_else(|| HostError::internal(e.to_string()))
}

/// An engine job as a boundary ticket: waiting waits for the job, promoting promotes it, and the
/// held time goes into the engine's exposed-latency metrics. Generic over the engine's payload
/// (the host's is [`Payload`]; the turn benchmark's is `()`).
pub struct JobTicket<P: crab_engine::Changeset = Payload> {
    engine: Engine<P>,
    handle: JobHandle,
    sandbox: String,
}

impl<P: crab_engine::Changeset> std::fmt::Debug for JobTicket<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobTicket").field("job", &self.handle.id()).finish_non_exhaustive()
    }
}

impl<P: crab_engine::Changeset> JobTicket<P> {
    /// Wrap the handle of a job submitted for `sandbox`.
    pub fn new(engine: Engine<P>, handle: JobHandle, sandbox: impl Into<String>) -> Self {
        JobTicket { engine, handle, sandbox: sandbox.into() }
    }
}

impl<P: crab_engine::Changeset> BoundaryTicket for JobTicket<P> {
    fn is_published(&self) -> bool {
        self.handle.try_result().is_some()
    }
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        Box::pin(async move {
            self.handle
                .wait()
                .await
                .map(|f| Published { checkpoint_id: f.outcome.checkpoint_id })
                .map_err(|e| job_error(&e).into())
        })
    }
    fn promote(&self) {
        self.engine.promote(self.handle.id());
    }
    fn record_exposed(&self, held: Duration) {
        self.engine.record_exposed(self.handle.id(), &self.sandbox, held);
    }
    fn held_breakdown(&self, gate_start: Instant, woke: Instant) -> Vec<(String, f64)> {
        match self.handle.try_result() {
            Some(Ok(f)) => f.held_breakdown(gate_start, woke),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_common::{ApiError, ErrorCode};
    use crab_inspector::{ProcessChanges, Verdict};

    fn skip() -> Result<Verdict, String> {
        Ok(Verdict {
            sandbox: "s".into(),
            turn: 1,
            kind: CheckpointKind::Skip,
            changeset: Vec::new(),
            processes: ProcessChanges::default(),
            reasons: Vec::new(),
            conservative: false,
        })
    }

    /// The proxy's door: a turn it reports failed makes the policy's next decision full, once;
    /// the policy keeps the record, not the caller.
    #[test]
    fn a_reported_turn_makes_the_next_decided_checkpoint_full_once() {
        let policy = Arc::new(TurnPolicy::new());
        let hooks = Hooks::new(policy.clone());
        let e = HookError::new(ErrorCode::Timeout, "checkpoint not published in time", "");
        hooks.checkpoint_failed("s", 3, &e);
        assert!(policy.is_forced("s"));
        assert!(!policy.is_forced("t"), "per sandbox");
        let d = policy.decide("s", skip(), None);
        assert_eq!(d.kind, CheckpointKind::Full, "{d:?}");
        assert!(d.reasons[0].contains("previous checkpoint failed"), "{d:?}");
        assert_eq!(policy.decide("s", skip(), None).kind, CheckpointKind::Skip, "consumed");
        // reported twice (a job failure and a gate timeout of one turn): still one full point
        hooks.checkpoint_failed("s", 4, &e);
        hooks.checkpoint_failed("s", 4, &e);
        assert_eq!(policy.decide("s", skip(), None).kind, CheckpointKind::Full);
        assert_eq!(policy.decide("s", skip(), None).kind, CheckpointKind::Skip);
    }

    /// Errors cross the seam typed, both ways, with nothing lost; a host that is not running
    /// answers a boundary with a typed error (no checkpoint started: the proxy reports it).
    #[tokio::test]
    async fn errors_cross_the_seam_typed() {
        let h =
            HostError(ApiError::new(ErrorCode::PoolFull, "no space for sandbox s", "free some"));
        let k: HookError = h.clone().into();
        assert_eq!((k.code(), k.0.hint.as_str()), (ErrorCode::PoolFull, "free some"));
        assert_eq!(HostError::from(k), h);
        let hooks = Hooks::new(Arc::new(TurnPolicy::new()));
        let b = Boundary {
            sandbox: "s".into(),
            turn: 1,
            conversation_offset: 0,
            provider: crab_coordinator::Provider::OpenAi,
            path: String::new(),
            streams: false,
        };
        let e = hooks.on_boundary(b).await.err().map(|e| (e.code(), e.to_string()));
        assert!(matches!(&e, Some((ErrorCode::Internal, m)) if m.contains("not running")), "{e:?}");
    }

    /// An engine failure that is not the executor's (a panic) is typed too: internal, with the
    /// engine's words.
    #[test]
    fn a_job_error_keeps_the_executors_type() {
        let h = HostError(ApiError::new(ErrorCode::CriuFailed, "dump failed", "see criu.log"));
        let e = crab_engine::JobError::Failed {
            job: crab_engine::JobId(1),
            op: crab_engine::JobOp::Checkpoint,
            sandbox: "s".into(),
            kind: CheckpointKind::Full,
            turn: 1,
            message: h.to_string(),
            source: Arc::new(h.clone()),
        };
        assert_eq!(job_error(&e), h);
        let p = crab_engine::JobError::Panicked {
            job: crab_engine::JobId(2),
            sandbox: "s".into(),
            message: "boom".into(),
        };
        assert_eq!(job_error(&p).code(), ErrorCode::Internal);
        assert!(job_error(&p).to_string().contains("boom"));
    }
}
