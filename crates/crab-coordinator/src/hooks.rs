//! The seams between the proxy and the rest of Crab: which sandboxes exist
//! ([`SandboxDirectory`]), what happens at a turn boundary ([`TurnHooks`]), and the handle on the
//! turn's checkpoint that gates the response ([`BoundaryTicket`]). The host implements all
//! three (`crab-host`: a ticket is an engine job); [`ReadyTicket`] is a ticket that is already
//! settled. What fails crosses the seam typed ([`HookError`]: the host's stable code, message
//! and fix), and every failure the proxy sees is reported back through
//! [`TurnHooks::checkpoint_failed`]: the host alone decides what the next checkpoint takes.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crab_common::{ApiError, ErrorCode};
use serde::{Deserialize, Serialize};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Which LLM API a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// OpenAI-style (`/v1/chat/completions`, `/v1/responses`, everything not Anthropic).
    OpenAi,
    /// Anthropic-style (`/v1/messages`, or any request carrying `anthropic-version`).
    Anthropic,
}

impl Provider {
    /// `openai` or `anthropic`.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }
}

/// Sandboxes the proxy may attribute requests to.
pub trait SandboxDirectory: Send + Sync + 'static {
    /// Whether a sandbox of that (already validated) name exists.
    fn exists(&self, name: &str) -> bool;
    /// Where that sandbox's conversation log lives (e.g. `<state>/sandboxes/<name>/conversation.log`).
    fn conversation_log_path(&self, name: &str) -> PathBuf;
}

/// A turn boundary: an agent's LLM request that starts turn `turn`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Boundary {
    /// Sandbox.
    pub sandbox: String,
    /// Turn number (1 for the first request of a fresh log).
    pub turn: u64,
    /// Conversation-log offset at the boundary: the restore point of this turn records it, so
    /// a restore returns the conversation that matches the sandbox state.
    pub conversation_offset: u64,
    /// API of the request.
    pub provider: Provider,
    /// Request path (without the `/s/<sandbox>` prefix); empty for explicit turn marks.
    pub path: String,
    /// Whether the request asks for a streamed answer (`"stream": true`): its head comes
    /// before its end, early enough to time a parked sandbox's wake from.
    #[serde(default)]
    pub streams: bool,
}

/// Why a turn's checkpoint failed or could not start, as it crosses the seam between the proxy
/// and the host: the host's error (stable code, message, fix) unchanged, or the proxy's own
/// (`timeout` when the gate gave up waiting, `internal` when the boundary's task died).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}", .0.message, if .0.hint.is_empty() { String::new() } else { format!(" (hint: {})", .0.hint) })]
pub struct HookError(pub ApiError);

impl HookError {
    /// A new error with a code, message and hint.
    pub fn new(code: ErrorCode, message: impl Into<String>, hint: impl Into<String>) -> Self {
        HookError(ApiError::new(code, message, hint))
    }

    /// An internal error with no particular hint.
    pub fn internal(message: impl Into<String>) -> Self {
        HookError(ApiError::internal(message))
    }

    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        self.0.code
    }

    /// The same error, its message prefixed with what was being done (`context: message`).
    pub fn context(mut self, context: impl std::fmt::Display) -> Self {
        self.0.message = format!("{context}: {}", self.0.message);
        self
    }
}

impl From<ApiError> for HookError {
    fn from(e: ApiError) -> Self {
        HookError(e)
    }
}

/// What a published checkpoint reports to the gate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Published {
    /// Id of the restore point.
    pub checkpoint_id: String,
}

/// The turn's checkpoint, as the gate sees it.
pub trait BoundaryTicket: Send + Sync + 'static {
    /// Whether the checkpoint has settled (published or failed) already.
    fn is_published(&self) -> bool;
    /// Wait until the checkpoint is published; `Err` says what failed.
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, HookError>>;
    /// A response is waiting on this checkpoint: make it urgent.
    fn promote(&self);
    /// Whether the checkpoint has settled, not counting what only the answer's end waits for
    /// ([`BoundaryTicket::wait_ready`]); the same as `is_published` unless that is more.
    fn is_checkpointed(&self) -> bool {
        self.is_published()
    }
    /// Wait until the checkpoint is published, and for nothing else: a stream's head and body
    /// go out after this, its end after [`BoundaryTicket::wait_ready`] too.
    /// `wait_published` is this and then `wait_ready`.
    fn wait_checkpoint(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        self.wait_published()
    }
    /// Whether the answer's end has nothing more to wait for.
    fn is_ready(&self) -> bool {
        true
    }
    /// What the answer's end waits for after the checkpoint (the host: a parked sandbox's
    /// wake — its agent must never find it parked); nothing by default.
    fn wait_ready(&self) -> BoxFuture<'_, Result<(), HookError>> {
        Box::pin(async { Ok(()) })
    }
    /// A streamed answer's head was released and its end is still to come: the host times a
    /// parked sandbox's wake from it.
    fn head_released(&self) {}
    /// How long a response was held on this checkpoint (zero when not held).
    fn record_exposed(&self, _held: Duration) {}
    /// The answer this checkpoint gated is complete: its last byte came `head_to_end` after its
    /// head arrived (a stream's generation time; about zero for a buffered answer). The host's
    /// parking learns from it whether the head comes early enough to start a wake.
    fn answer_done(&self, _head_to_end: Duration) {}
    /// Where a wait on this (settled) checkpoint went: the gate waited from `gate_start` until
    /// it woke at `woke`; `(stage, ms)` adding up to the wait (empty when unknown).
    fn held_breakdown(&self, _gate_start: Instant, _woke: Instant) -> Vec<(String, f64)> {
        Vec::new()
    }
}

/// What happens at a turn boundary.
pub trait TurnHooks: Send + Sync + 'static {
    /// Ask the inspector for the turn's verdict and submit the checkpoint job; return a ticket
    /// on it. Should return quickly (the request is forwarded after it returns). `Err` means no
    /// checkpoint could be started: the response is released ungated, and the proxy reports
    /// the failure through [`TurnHooks::checkpoint_failed`].
    fn on_boundary(
        &self,
        boundary: Boundary,
    ) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, HookError>>;

    /// Turn `turn` of `sandbox` got no checkpoint: its log could not be made durable, its
    /// boundary failed, or its ticket failed or was not published within the gate timeout
    /// (`error` says which). Called before the turn's waiter (the gate, or the caller of
    /// `Coordinator::begin_turn`) sees the failure; once for the ticket's failure, and once
    /// more each time a gate gives up waiting; never for a turn that published.
    /// The implementer decides what follows (the host's `TurnPolicy` makes the next decided
    /// checkpoint `full`: the failed turn's changes are safe only in one); the proxy keeps no
    /// such rule of its own.
    fn checkpoint_failed(&self, sandbox: &str, turn: u64, error: &HookError);
}

/// A ticket that is already settled.
#[derive(Debug, Clone)]
pub struct ReadyTicket(Result<Published, HookError>);

impl ReadyTicket {
    /// Published already (e.g. nothing to do).
    pub fn published(checkpoint_id: impl Into<String>) -> Arc<dyn BoundaryTicket> {
        Arc::new(ReadyTicket(Ok(Published { checkpoint_id: checkpoint_id.into() })))
    }
    /// Failed already.
    pub fn failed(error: HookError) -> Arc<dyn BoundaryTicket> {
        Arc::new(ReadyTicket(Err(error)))
    }
}

impl BoundaryTicket for ReadyTicket {
    fn is_published(&self) -> bool {
        true
    }
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        let r = self.0.clone();
        Box::pin(async move { r })
    }
    fn promote(&self) {}
}

/// A turn's ticket that reports its failure to the hooks ([`TurnHooks::checkpoint_failed`])
/// once, inside the first wait that sees it, before that waiter goes on: the proxy's one place
/// for a ticket's failure (the gate reports only its own timeout).
pub(crate) struct ReportingTicket {
    inner: Arc<dyn BoundaryTicket>,
    hooks: Arc<dyn TurnHooks>,
    sandbox: String,
    turn: u64,
    reported: std::sync::atomic::AtomicBool,
}

impl ReportingTicket {
    /// `inner`, reporting a failure as turn `turn` of `sandbox`.
    pub(crate) fn wrap(
        inner: Arc<dyn BoundaryTicket>,
        hooks: Arc<dyn TurnHooks>,
        sandbox: &str,
        turn: u64,
    ) -> Arc<dyn BoundaryTicket> {
        Arc::new(ReportingTicket {
            inner,
            hooks,
            sandbox: sandbox.to_string(),
            turn,
            reported: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

impl ReportingTicket {
    /// `r`, its failure reported to the hooks the first time one is seen.
    fn report(&self, r: Result<Published, HookError>) -> Result<Published, HookError> {
        if let Err(e) = &r {
            if !self.reported.swap(true, std::sync::atomic::Ordering::SeqCst) {
                self.hooks.checkpoint_failed(&self.sandbox, self.turn, e);
            }
        }
        r
    }
}

impl BoundaryTicket for ReportingTicket {
    fn is_published(&self) -> bool {
        self.inner.is_published()
    }
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        Box::pin(async move { self.report(self.inner.wait_published().await) })
    }
    fn promote(&self) {
        self.inner.promote();
    }
    fn is_checkpointed(&self) -> bool {
        self.inner.is_checkpointed()
    }
    fn wait_checkpoint(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        Box::pin(async move { self.report(self.inner.wait_checkpoint().await) })
    }
    fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }
    fn wait_ready(&self) -> BoxFuture<'_, Result<(), HookError>> {
        self.inner.wait_ready()
    }
    fn head_released(&self) {
        self.inner.head_released();
    }
    fn record_exposed(&self, held: Duration) {
        self.inner.record_exposed(held);
    }
    fn answer_done(&self, head_to_end: Duration) {
        self.inner.answer_done(head_to_end);
    }
    fn held_breakdown(&self, gate_start: Instant, woke: Instant) -> Vec<(String, f64)> {
        self.inner.held_breakdown(gate_start, woke)
    }
}

/// The ticket of a turn whose boundary ([`TurnHooks::on_boundary`]: the verdict and the job
/// submission) runs beside the forwarded request instead of before it: promotions, waits and
/// the breakdown go to the real ticket once the boundary has produced it. The gate waits for
/// it like for any ticket, so nothing of the turn is released before its checkpoint.
pub(crate) struct DeferredTicket {
    inner: tokio::sync::watch::Receiver<Option<Arc<dyn BoundaryTicket>>>,
    promoted: std::sync::atomic::AtomicBool,
    /// When the boundary ran.
    span: std::sync::Mutex<Option<(Instant, Instant)>>,
}

impl DeferredTicket {
    /// A ticket fed by the returned sender (send the real ticket once the boundary made it).
    pub(crate) fn new() -> (Arc<Self>, tokio::sync::watch::Sender<Option<Arc<dyn BoundaryTicket>>>)
    {
        let (tx, rx) = tokio::sync::watch::channel(None);
        let t = DeferredTicket {
            inner: rx,
            promoted: std::sync::atomic::AtomicBool::new(false),
            span: std::sync::Mutex::new(None),
        };
        (Arc::new(t), tx)
    }

    /// Hand over the real ticket, made by a boundary that ran from `start` to `end`.
    pub(crate) fn settle(
        &self,
        tx: &tokio::sync::watch::Sender<Option<Arc<dyn BoundaryTicket>>>,
        ticket: Arc<dyn BoundaryTicket>,
        start: Instant,
        end: Instant,
    ) {
        *self.span.lock().unwrap_or_else(|p| p.into_inner()) = Some((start, end));
        let _ = tx.send(Some(ticket.clone()));
        // A gate that promoted before the ticket existed: promote it now (twice is harmless).
        if self.promoted.load(std::sync::atomic::Ordering::SeqCst) {
            ticket.promote();
        }
    }

    fn get(&self) -> Option<Arc<dyn BoundaryTicket>> {
        self.inner.borrow().clone()
    }

    /// The real ticket, once the boundary made it.
    async fn settled(&self) -> Result<Arc<dyn BoundaryTicket>, HookError> {
        let mut rx = self.inner.clone();
        let t = match rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            Err(_) => None,
        };
        t.ok_or_else(|| {
            HookError::internal("the turn boundary's task ended without starting a checkpoint")
        })
    }
}

impl BoundaryTicket for DeferredTicket {
    fn is_published(&self) -> bool {
        self.get().is_some_and(|t| t.is_published())
    }
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        Box::pin(async move { self.settled().await?.wait_published().await })
    }
    fn is_checkpointed(&self) -> bool {
        self.get().is_some_and(|t| t.is_checkpointed())
    }
    fn wait_checkpoint(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        Box::pin(async move { self.settled().await?.wait_checkpoint().await })
    }
    fn is_ready(&self) -> bool {
        self.get().is_none_or(|t| t.is_ready())
    }
    fn wait_ready(&self) -> BoxFuture<'_, Result<(), HookError>> {
        Box::pin(async move { self.settled().await?.wait_ready().await })
    }
    fn head_released(&self) {
        if let Some(t) = self.get() {
            t.head_released();
        }
    }
    fn promote(&self) {
        self.promoted.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.get() {
            t.promote();
        }
    }
    fn record_exposed(&self, held: Duration) {
        if let Some(t) = self.get() {
            t.record_exposed(held);
        }
    }
    fn answer_done(&self, head_to_end: Duration) {
        if let Some(t) = self.get() {
            t.answer_done(head_to_end);
        }
    }
    fn held_breakdown(&self, gate_start: Instant, woke: Instant) -> Vec<(String, f64)> {
        let mut v = Vec::new();
        let span = *self.span.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((a, b)) = span {
            // The part of the boundary itself the gate waited for (the upstream answered
            // before the verdict was in).
            let (a, b) = (a.max(gate_start), b.min(woke));
            if b > a {
                v.push(("boundary".to_string(), (b - a).as_secs_f64() * 1e3));
            }
        }
        if let Some(t) = self.get() {
            v.extend(t.held_breakdown(gate_start, woke));
        }
        v
    }
}
