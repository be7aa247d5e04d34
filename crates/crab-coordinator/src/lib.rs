//! `crab-coordinator`: the LLM reverse proxy that knows turns.
//!
//! An agent points its OpenAI or Anthropic base URL at `http://127.0.0.1:7431/s/<sandbox>/v1`
//! (or sends `X-Crab-Sandbox`). Each chat request is a turn boundary: the [`Coordinator`] calls
//! [`TurnHooks::on_boundary`] (inspector verdict + engine job, implemented by the daemon),
//! forwards the request at once, and holds the upstream response until the turn's
//! [`BoundaryTicket`] is published, so the checkpoint hides behind the model's thinking time.
//! Every request/response pair goes into the sandbox's [`ConversationLog`] before release.
//! The proxy knows nothing of the engine or the inspector: the host implements the hooks.
//! [`limits`] bounds what one client (a hostile sandbox) can hold: connections per sandbox
//! endpoint and in all, header and body read time, request bytes in memory, sized by the
//! process's file-descriptor budget. (Its stub upstream lives in `crab-testkit`, its
//! benchmarks in `crab-bench`.)
//!
//! # Wiring it into the daemon
//!
//! 1. Implement [`SandboxDirectory`] (`exists`, `conversation_log_path`) over the runtime.
//! 2. Implement [`TurnHooks::on_boundary`]: read the inspector's verdict for
//!    `boundary.sandbox`, start the turn's checkpoint (recording
//!    `boundary.conversation_offset` in the restore point), and return a [`BoundaryTicket`] on
//!    it (`crab-host` submits an engine job and returns a `JobTicket`). Implement
//!    [`TurnHooks::checkpoint_failed`]: the proxy reports there every turn that got no
//!    checkpoint (`crab-host` makes the next one full); errors cross typed ([`HookError`]).
//! 3. `let coord = Coordinator::new(ProxyConfig { listen, upstream_openai, upstream_anthropic,
//!    ..Default::default() }, directory, hooks)?; let server = coord.bind().await?;` — and
//!    `server.shutdown().await` on exit. For agents inside a sandbox:
//!    `coord.serve_sandbox(TcpListener::from_std(bind_in_netns("/proc/<pid>/ns/net",
//!    "127.0.0.1:7431")?)?, name)`, again after restore and fork.
//! 4. After a restore call [`Coordinator::restored`], after a fork [`Coordinator::forked`];
//!    serve `crab conversation` from [`Coordinator::conversation`], `POST
//!    /sandboxes/{id}/turns` from [`Coordinator::begin_turn`], `/metrics` from
//!    [`Coordinator::metrics_text`] + `Engine::metrics_text`, `crab top` from
//!    [`Coordinator::stats`] + `Engine::stats`.

pub mod assemble;
mod config;
pub mod convlog;
mod hooks;
pub mod limits;
pub mod listener;
mod netns;
mod proxy;

pub use config::{ConfigError, ProxyConfig, DEFAULT_LISTEN};
pub use convlog::{ConversationLog, LogError, LogRecord};
pub use hooks::{
    Boundary, BoundaryTicket, BoxFuture, HookError, Provider, Published, ReadyTicket,
    SandboxDirectory, TurnHooks,
};
pub use limits::FdBudget;
pub use netns::{bind_in_netns, NetnsError};
pub use proxy::{
    BoxError, CoordError, Coordinator, ProxyBody, ProxyServer, SandboxProxyStats, HELD_HEADER,
    REPLAYED_HEADER, RETRY_HEADER, SANDBOX_HEADER,
};
