//! Crab's durable tier: a content-addressed repository of restore points on an object store
//! (`file:///dir` or `s3://bucket/prefix`, through the `object_store` crate), modelled on
//! restic's: files cut into content-defined chunks (FastCDC), named by BLAKE3, compressed with
//! zstd, optionally encrypted (XChaCha20-Poly1305), stored in immutable packs listed by index
//! objects; one record per exported point, written last; locks for `prune`; `check`.
//! The format is versioned and specified in `docs/format.md` ("Remote repository").
//!
//! The API is narrow: [`Repo::open`], [`Repo::export_point`], [`Repo::list_points`],
//! [`Repo::load_point`], [`Repo::import_point`] ([`Repo::export_point_with`] pauses through a [`Pause`] for more urgent work), [`Repo::check`], [`Repo::prune`], and
//! [`preflight`] before restoring processes elsewhere.

pub mod cache;
pub mod crypto;
pub mod error;
pub mod format;
pub mod host;
pub mod id;
pub mod local;
pub mod maint;
pub mod point;
pub mod repo;
pub mod tree;

pub use crypto::Key;
pub use error::{Refusal, RemoteError, Result};
pub use format::{HostFacts, PointRecord};
pub use host::preflight;
pub use id::Id;
pub use maint::{CheckReport, PruneReport};
pub use point::{ExportReport, ExportSource, ImportTarget, Imported};
pub use repo::{Pause, Repo, RepoOptions};
