//! The host layer: [`Host`] owns everything one machine runs for Crab (the sandbox runtime, the
//! eBPF inspector, the checkpointer, the host-wide checkpoint engine and the LLM proxy) and
//! answers every front door through one entry point, [`Host::execute`], which takes a typed
//! [`Action`] and returns an [`Outcome`] or a [`HostError`] that keeps the API's error code.
//!
//! This is the one place that answers "what happens at a turn, a restore, a fork, a remove":
//! the daemon's HTTP handlers (and any later front door) only parse a request into an
//! [`Action`], call `execute`, and render the [`Outcome`]. The turn policy (verdict → kind, the
//! base rule, the init-only rule, force-full after a failure) is [`TurnPolicy`]; the engine's
//! executor, the proxy's turn hooks and sandbox directory live in [`glue`]; the durable tier
//! (`--remote`: exporter, export states, restores from the remote) in [`remote`], its standby
//! follower in [`follow`]; the handlers of
//! the background-process service in `procs`.

#![forbid(unsafe_code)]

mod action;
mod build;
mod build_jobs;
mod error;
mod files;
pub mod follow;
pub mod glue;
mod host;
pub mod images;
mod lifecycle;
mod parking;
mod policy;
mod procs;
mod progress;
pub mod remote;

pub use action::{
    Action, HarnessMarked, Lifecycle, Outcome, PointView, Pruned, Taken, TopView, TurnMarked,
};
pub use error::HostError;
pub use host::{
    is_reference, timeout_set, CredentialSource, Host, HostOptions, PullPolicy, IN_SANDBOX_PROXY,
};
pub use lifecycle::Adopted;
pub use parking::{ParkPolicy, ParkingStats};
pub use policy::{Decision, TurnPolicy};
