//! Types shared by every Crab crate.
//!
//! This crate owns the vocabulary the other crates speak: validated names ([`names`]), the
//! on-disk layout of the state directory ([`paths`]), a sandbox's [`life`] (its lifecycle state, the transition checks, its deadline), the checkpoint [`kind`] that inspector
//! verdicts, engine jobs and restore points share, the stable error codes of the daemon's API
//! ([`error`]), the request and response bodies of that API ([`api`]), the file service's vocabulary ([`files`]), and the [`progress`] trait
//! through which long operations report what they are doing (only the CLI draws it), and the
//! latency [`stats`] every benchmark reports with (an HdrHistogram per series); and the three helpers every crate shares
//! instead of copying: the poison-tolerant [`sync::lock`], the wall clock [`clock::now_ms`], and
//! the atomic durable write [`fsutil::write_atomic`] (its only I/O).

pub mod api;
pub mod clock;
pub mod error;
pub mod files;
pub mod fsutil;
pub mod kind;
pub mod life;
pub mod names;
pub mod paths;
pub mod progress;
pub mod stats;
pub mod sync;

pub use error::{ApiError, ErrorCode};
pub use kind::{CheckpointKind, CheckpointPolicy, PointKind};
pub use progress::{NoProgress, Progress};
