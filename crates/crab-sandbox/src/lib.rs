//! The native sandbox runtime.
//!
//! This crate owns everything a sandbox is made of on the host: the btrfs storage pool
//! ([`pool`], [`btrfs`], [`quota`]), images ([`image`], [`archive`], Dockerfile builds and their step store [`build`], shifted into the user-namespace range by [`shift`]), host-side writes inside a root that never leave it ([`inroot`]), cgroups ([`cgroup`]), the
//! single-threaded namespace helpers ([`spawn`]), the registry of sandboxes with create, remove
//! and adoption ([`runtime`]), running commands inside a sandbox ([`exec`]), its background processes ([`procs`]), the file service ([`files`]), the `nat` network mode ([`net`]), and the security
//! profile every sandboxed process runs under ([`profile`], [`seccomp`]).

pub mod account;
pub mod archive;
pub mod btrfs;
pub mod build;
pub mod cgroup;
pub mod devices;
pub mod error;
pub mod exec;
pub mod export;
pub mod files;
pub mod image;
pub mod inroot;
pub mod layers;
pub mod net;
pub mod pool;
pub mod procs;
pub mod profile;
pub mod quota;
pub mod runtime;
pub mod sealed;
pub mod seccomp;
pub mod shift;
pub mod spawn;
pub mod specfd;
pub mod warm;

pub use error::{Result, SandboxError};
pub use runtime::{Runtime, RuntimeConfig, SandboxRecord};
