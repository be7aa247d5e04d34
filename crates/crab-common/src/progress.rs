//! Progress reporting for long operations.
//!
//! Libraries call a [`Progress`] they are handed; they never print. The daemon forwards progress
//! events to the client as frames of a streamed response ([`crate::api::ProgressFrame`]) and only
//! the CLI draws them.

/// Receives progress of a long operation. Implementations must be cheap and never block.
pub trait Progress: Send + Sync {
    /// A new stage begins (`"debootstrap"`, `"snapshot"`, ...). `total` is the number of units
    /// the stage will take, when known.
    fn stage(&self, name: &str, total: Option<u64>);
    /// `done` units of the current stage are complete.
    fn advance(&self, done: u64);
    /// A free-form line of detail (e.g. the package being unpacked).
    fn message(&self, line: &str);
}

/// A [`Progress`] that discards everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn stage(&self, _name: &str, _total: Option<u64>) {}
    fn advance(&self, _done: u64) {}
    fn message(&self, _line: &str) {}
}
