//! The seams between the proxy and the rest of Crab: which sandboxes exist
//! ([`SandboxDirectory`]), what happens at a turn boundary ([`TurnHooks`]), and the handle on the
//! turn's checkpoint that gates the response ([`BoundaryTicket`]). The host implements all
//! three (`crab-host`: a ticket is an engine job); [`ReadyTicket`] is a ticket that is already
//! settled.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// The previous checkpoint failed (or could not be submitted): take a full one.
    pub force_full: bool,
    /// Conversation-log offset at the boundary: the restore point of this turn records it, so
    /// a restore returns the conversation that matches the sandbox state.
    pub conversation_offset: u64,
    /// API of the request.
    pub provider: Provider,
    /// Request path (without the `/s/<sandbox>` prefix); empty for explicit turn marks.
    pub path: String,
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
    /// Wait until the checkpoint is published; `Err` names what failed.
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, String>>;
    /// A response is waiting on this checkpoint: make it urgent.
    fn promote(&self);
    /// How long a response was held on this checkpoint (zero when not held).
    fn record_exposed(&self, _held: Duration) {}
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
    /// checkpoint could be started: the response is released ungated and the next boundary gets
    /// `force_full`.
    fn on_boundary(
        &self,
        boundary: Boundary,
    ) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, String>>;
}

/// A ticket that is already settled.
#[derive(Debug, Clone)]
pub struct ReadyTicket(Result<Published, String>);

impl ReadyTicket {
    /// Published already (e.g. nothing to do).
    pub fn published(checkpoint_id: impl Into<String>) -> Arc<dyn BoundaryTicket> {
        Arc::new(ReadyTicket(Ok(Published { checkpoint_id: checkpoint_id.into() })))
    }
    /// Failed already.
    pub fn failed(message: impl Into<String>) -> Arc<dyn BoundaryTicket> {
        Arc::new(ReadyTicket(Err(message.into())))
    }
}

impl BoundaryTicket for ReadyTicket {
    fn is_published(&self) -> bool {
        true
    }
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, String>> {
        let r = self.0.clone();
        Box::pin(async move { r })
    }
    fn promote(&self) {}
}
