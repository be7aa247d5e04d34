//! `crab-coordinator`: the LLM reverse proxy that knows turns.
//!
//! An agent points its OpenAI or Anthropic base URL at `http://127.0.0.1:7431/s/<sandbox>/v1`
//! (or sends `X-Crab-Sandbox`). Each chat request is a turn boundary: the [`Coordinator`] calls
//! [`TurnHooks::on_boundary`] (inspector verdict + engine job, implemented by the daemon),
//! forwards the request at once, and holds the upstream response until the turn's
//! [`BoundaryTicket`] is published, so the checkpoint hides behind the model's thinking time.
//! Every request/response pair goes into the sandbox's [`ConversationLog`] before release.
//! [`stub`] is a small configurable upstream for tests and [`bench`] measures the proxy's
//! overhead against it.

pub mod bench;
mod config;
pub mod convlog;
mod hooks;
mod netns;
mod proxy;
pub mod stub;

pub use config::{ConfigError, ProxyConfig, DEFAULT_LISTEN};
pub use convlog::{ConversationLog, LogError, LogRecord};
pub use hooks::{
    Boundary, BoundaryTicket, BoxFuture, EngineTicket, Provider, Published, ReadyTicket,
    SandboxDirectory, TurnHooks,
};
pub use netns::{bind_in_netns, NetnsError};
pub use proxy::{
    BoxError, CoordError, Coordinator, ProxyBody, ProxyServer, SandboxProxyStats, REPLAYED_HEADER,
    RETRY_HEADER, SANDBOX_HEADER,
};
