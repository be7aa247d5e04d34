//! Proxy hooks over a real [`Engine`] (feature `engine`): each turn boundary submits a
//! checkpoint job whose kind a caller-given function picks (`full` when the host's own
//! [`TurnPolicy`] says so after a failure the proxy reported) and answers the host's own
//! [`JobTicket`] on it — the host's glue without the inspector and the checkpointer. The proxy tests and the proxy benchmark drive the real
//! scheduler (promotion, coalescing, exposed-latency records) through it.

use std::sync::Arc;

use crab_common::CheckpointKind;
use crab_coordinator::{Boundary, BoundaryTicket, BoxFuture, HookError, TurnHooks};
use crab_engine::{Changeset, Engine, JobSpec};
use crab_host::glue::JobTicket;
use crab_host::TurnPolicy;

/// Turn hooks submitting one checkpoint job per boundary to `engine`.
pub struct EngineHooks<P: Changeset, F> {
    engine: Engine<P>,
    verdict: F,
    policy: Arc<TurnPolicy>,
}

impl<P: Changeset, F> std::fmt::Debug for EngineHooks<P, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHooks").finish_non_exhaustive()
    }
}

impl<P, F> EngineHooks<P, F>
where
    P: Changeset + Default,
    F: Fn(&Boundary) -> CheckpointKind + Send + Sync + 'static,
{
    /// Hooks whose jobs have the kind `verdict(boundary)` and a default payload.
    pub fn new(engine: Engine<P>, verdict: F) -> Arc<Self> {
        Arc::new(EngineHooks { engine, verdict, policy: Arc::new(TurnPolicy::new()) })
    }

    /// The policy the reported failures go to.
    pub fn policy(&self) -> &TurnPolicy {
        &self.policy
    }
}

impl<P, F> TurnHooks for EngineHooks<P, F>
where
    P: Changeset + Default,
    F: Fn(&Boundary) -> CheckpointKind + Send + Sync + 'static,
{
    fn on_boundary(
        &self,
        b: Boundary,
    ) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, HookError>> {
        let kind = self.policy.decide_kind(&b.sandbox, (self.verdict)(&b));
        let handle =
            self.engine.submit(JobSpec::checkpoint(&*b.sandbox, kind, P::default(), b.turn));
        let t: Arc<dyn BoundaryTicket> =
            Arc::new(JobTicket::new(self.engine.clone(), handle, b.sandbox));
        Box::pin(async move { Ok(t) })
    }

    fn checkpoint_failed(&self, sandbox: &str, _turn: u64, _error: &HookError) {
        self.policy.failed(sandbox);
    }
}
