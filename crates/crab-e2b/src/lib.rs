//! The E2B-compatible front door: what the unmodified `e2b` Python SDK 2.x calls when
//! `E2B_API_URL` and `E2B_SANDBOX_URL` point at `crab daemon --e2b-listen` — E2B's REST control
//! plane (sandboxes, timeouts, pause/connect, snapshots, fork) and envd's Connect RPCs
//! (`process.Process`, `filesystem.Filesystem`) plus `/files` and `/health`, on one plain
//! HTTP/1.1 port. It is a codec that keeps no state of a sandbox: every call is one
//! [`Backend`] call, which the daemon implements over the host layer's actions (a sandbox's
//! life, deadline, metadata and snapshots are the host's record; its processes and files the
//! host's process and file services). `server` is the REST control plane, `process` and
//! `files` envd's RPCs, `templates` E2B's template builds (translated into one background
//! Dockerfile build on the host), `user` who a call runs as. The protocol is documented in `docs/e2b.md`.

pub mod auth;
pub mod backend;
pub mod connect;
pub mod envd;
pub mod process;
pub mod rest;
pub mod server;
pub mod store;
pub mod templates;
pub mod user;

pub use auth::{Keys, KeysError};
pub use backend::Backend;
pub use server::{Config, E2b};
pub use store::Store;
