//! Restore points of Crab sandboxes.
//!
//! This crate owns checkpoints as data: a restore point `C_i = (P_j, F_k)` is a versioned,
//! self-describing, checksummed manifest ([`manifest`], specified in `docs/format.md`) that
//! references a CRIU process image `P_j` and a read-only filesystem snapshot `F_k`, plus the
//! turn, parent, conversation offset, sizes, timings and the SHA-256 of every image file. The
//! per-sandbox [`store`] stages new parts, publishes points atomically (a half-written
//! checkpoint is never visible), verifies them before a restore, prunes them and discards the
//! leftovers of interrupted work. Filesystem snapshots go through the [`snapfs::SnapshotFs`]
//! trait (btrfs subvolumes in the daemon, plain copies in tests). The [`ops::Checkpointer`]
//! runs the flows on live sandboxes of `crab_sandbox`: checkpoint (skip / fs / process / full),
//! restore in place, fork, prune, and startup recovery. [`foreign`] vets process images this
//! host did not dump (a remote point's) before anything restores them.

pub mod error;
pub mod foreign;
pub mod manifest;
pub mod ops;
pub mod snapfs;
pub mod store;

pub use error::{CheckpointError, Result};
pub use manifest::{FsId, Manifest, PointId, ProcId, Timings};
pub use ops::{
    BtrfsSnapshots, CheckpointRequest, Checkpointer, Config, ForkBranch, ForkOptions, PointSummary,
    RestoreReport, Stage,
};
pub use snapfs::{CopyFs, SnapshotFs};
pub use store::{Draft, PruneReport, RecoveryReport, Staging, Store};
