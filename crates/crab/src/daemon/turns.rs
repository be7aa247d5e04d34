//! The glue between the LLM proxy, the host engine, the inspector and the checkpointer.
//!
//! * [`CheckpointExecutor`] is the engine's [`Executor`]: it publishes a restore point of the
//!   job's (merged) kind through the [`Checkpointer`].
//! * [`Hooks`] is the proxy's [`TurnHooks`]: at a turn boundary it closes the inspector's turn,
//!   maps the verdict to a job kind (full when the previous checkpoint failed or the inspector is
//!   missing), submits the job and hands the proxy a ticket to gate the response on.
//! * [`SandboxDir`] tells the proxy which sandboxes exist and where their conversation logs live
//!   (`<pool>/sandboxes/<name>/conversation.log`, next to the root subvolume).
//!
//! Explicit checkpoints from the API go through the same engine (submitted urgent), so one
//! scheduler orders all of a host's checkpoint work.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use crab_checkpoint::{CheckpointRequest, Checkpointer, Kind, PointSummary};
use crab_common::ApiError;
use crab_coordinator::{
    Boundary, BoundaryTicket, BoxFuture, EngineTicket, SandboxDirectory, TurnHooks,
};
use crab_engine::{Engine, Executor, Job, JobKind, JobOutcome, JobSpec};

use super::Daemon;

/// The payload of a checkpoint job: what the restore point records besides its parts.
pub type Payload = serde_json::Value;

fn kind_of(k: JobKind) -> Kind {
    match k {
        JobKind::Skip => Kind::Skip,
        JobKind::Fs => Kind::Fs,
        JobKind::Process => Kind::Process,
        JobKind::Full => Kind::Full,
    }
}

/// Map an inspector verdict to a job kind.
pub fn job_kind(k: crab_inspector::VerdictKind) -> JobKind {
    match k {
        crab_inspector::VerdictKind::Skip => JobKind::Skip,
        crab_inspector::VerdictKind::Fs => JobKind::Fs,
        crab_inspector::VerdictKind::Process => JobKind::Process,
        crab_inspector::VerdictKind::Full => JobKind::Full,
    }
}

/// Runs checkpoint jobs for the engine.
#[derive(Debug)]
pub struct CheckpointExecutor(pub Arc<Checkpointer>);

impl Executor<Payload> for CheckpointExecutor {
    fn run(&self, job: &Job<Payload>) -> Result<JobOutcome, String> {
        let encode = |api: ApiError| serde_json::to_string(&api).unwrap_or(api.message);
        // The first restore point of a sandbox is its base: it must hold the filesystem (there
        // is no earlier snapshot to reference); processes only when the turn needs them.
        let first = self
            .0
            .store(&job.sandbox)
            .and_then(|s| s.point_ids())
            .map_err(|e| encode(e.to_api()))?
            .is_empty();
        let req = CheckpointRequest {
            kind: if first { kind_of(job.kind.merge(JobKind::Fs)) } else { kind_of(job.kind) },
            turn: job.payload.get("turn").and_then(|t| t.as_u64()),
            conversation_offset: job.payload.get("conversation_offset").and_then(|o| o.as_u64()),
        };
        let m = self.0.checkpoint(&job.sandbox, req).map_err(|e| encode(e.to_api()))?;
        let summary = PointSummary::of(&m);
        let bytes = if req.kind == Kind::Skip { 0 } else { summary.size_bytes };
        Ok(JobOutcome {
            checkpoint_id: summary.id.clone(),
            bytes,
            detail: serde_json::to_value(&summary).unwrap_or_default(),
        })
    }
}

/// Decode an executor's error string back into the API error it came from.
/// The engine may have wrapped it in a sentence ("checkpoint job-3 of sandbox x ... failed: {..}").
pub fn job_error(message: &str) -> ApiError {
    message
        .find('{')
        .and_then(|i| serde_json::from_str::<ApiError>(&message[i..]).ok())
        .unwrap_or_else(|| ApiError::internal(message))
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

/// The proxy's turn hooks (the daemon is set once it exists).
#[derive(Debug)]
pub struct Hooks(pub OnceLock<Weak<Daemon>>);

impl Daemon {
    /// Close the inspector's turn for `name` and decide the checkpoint kind: the verdict's,
    /// or full when asked, when the last checkpoint failed, or without an inspector.
    pub fn decide_kind(
        &self,
        name: &str,
        force_full: bool,
    ) -> (JobKind, Vec<String>, Option<crab_inspector::Verdict>) {
        let mut reasons = Vec::new();
        let forced = self.take_force_full(name) || force_full;
        match self.inspector() {
            Ok(i) => match i.take(name) {
                Ok(mut v) => {
                    if let Ok(rec) = self.runtime.record(name) {
                        if ignore_init(&mut v, rec.init_pid) {
                            reasons.push("only the sandbox's init ran (it reaps orphans; it has no state to save)".into());
                        }
                    }
                    let mut k = job_kind(v.kind);
                    if forced && k != JobKind::Full {
                        reasons.push("the previous checkpoint failed: taking a full one".into());
                        k = JobKind::Full;
                    }
                    (k, reasons, Some(v))
                }
                Err(e) => {
                    reasons.push(format!("no verdict ({e}): taking a full checkpoint"));
                    (JobKind::Full, reasons, None)
                }
            },
            Err(e) => {
                reasons.push(format!(
                    "inspector unavailable ({}): taking a full checkpoint",
                    e.message
                ));
                (JobKind::Full, reasons, None)
            }
        }
    }

    /// Submit a checkpoint job to the engine.
    pub fn submit(
        &self,
        name: &str,
        kind: JobKind,
        turn: Option<u64>,
        offset: Option<u64>,
    ) -> crab_engine::JobHandle {
        let payload = serde_json::json!({ "turn": turn, "conversation_offset": offset });
        self.engine.submit(JobSpec::checkpoint(name, kind, payload, turn.unwrap_or(0)))
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<Payload> {
        &self.engine
    }
}

impl TurnHooks for Hooks {
    fn on_boundary(&self, b: Boundary) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, String>> {
        Box::pin(async move {
            let d = self.0.get().and_then(Weak::upgrade).ok_or("the daemon is not running")?;
            let name = b.sandbox.clone();
            let d2 = d.clone();
            let (kind, reasons, _) =
                tokio::task::spawn_blocking(move || d2.decide_kind(&name, b.force_full))
                    .await
                    .map_err(|e| format!("verdict task failed: {e}"))?;
            if !reasons.is_empty() {
                tracing::info!(sandbox = %b.sandbox, ?reasons, "turn boundary");
            }
            let handle = d.submit(&b.sandbox, kind, Some(b.turn), Some(b.conversation_offset));
            let ticket: Arc<dyn BoundaryTicket> =
                Arc::new(EngineTicket::new(d.engine.clone(), handle, b.sandbox.clone()));
            Ok(ticket)
        })
    }
}

/// The sandbox's init (`/.crab/init`) wakes up to reap every orphan, so the inspector often sees
/// it run; but its memory holds nothing a restore could lose (a fixed reaper loop), so its
/// running alone never calls for a process dump. When the verdict's only process change is
/// "init ran" (nothing born or died, no other reason, not conservative), drop the process part.
/// Returns whether the verdict changed.
pub fn ignore_init(v: &mut crab_inspector::Verdict, init_pid: u32) -> bool {
    use crab_inspector::VerdictKind;
    let p = &v.processes;
    let only_init = p.born.is_empty() && p.died.is_empty() && p.ran == [init_pid];
    if v.conservative || !only_init || !v.reasons.is_empty() {
        return false;
    }
    v.processes.ran.clear();
    v.kind = match v.kind {
        VerdictKind::Full => VerdictKind::Fs,
        VerdictKind::Process => VerdictKind::Skip,
        other => other,
    };
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_inspector::{ProcessChanges, Verdict, VerdictKind};

    fn verdict(kind: VerdictKind, ran: Vec<u32>, born: Vec<u32>) -> Verdict {
        Verdict {
            sandbox: "s".into(),
            turn: 1,
            kind,
            changeset: Vec::new(),
            processes: ProcessChanges { born, died: Vec::new(), ran },
            reasons: Vec::new(),
            conservative: false,
        }
    }

    #[test]
    fn init_alone_does_not_need_a_dump() {
        let mut v = verdict(VerdictKind::Process, vec![7], vec![]);
        assert!(ignore_init(&mut v, 7));
        assert_eq!(v.kind, VerdictKind::Skip);
        let mut v = verdict(VerdictKind::Full, vec![7], vec![]);
        assert!(ignore_init(&mut v, 7));
        assert_eq!(v.kind, VerdictKind::Fs);
    }

    #[test]
    fn anything_else_keeps_the_dump() {
        for mut v in [
            verdict(VerdictKind::Process, vec![7, 8], vec![]),
            verdict(VerdictKind::Process, vec![8], vec![]),
            verdict(VerdictKind::Process, vec![7], vec![9]),
        ] {
            assert!(!ignore_init(&mut v, 7));
            assert_eq!(v.kind, VerdictKind::Process);
        }
        let mut v = verdict(VerdictKind::Full, vec![7], vec![]);
        v.conservative = true;
        assert!(!ignore_init(&mut v, 7));
        let mut v = verdict(VerdictKind::Process, vec![7], vec![]);
        v.reasons.push("pid 7 maps a changed file".into());
        assert!(!ignore_init(&mut v, 7));
    }
}
