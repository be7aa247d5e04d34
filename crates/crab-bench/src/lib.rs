//! Crab's benchmarks. Each benchmark talks to the real daemon through [`crab_client`], measures
//! the thing and its baseline side by side in one run (interleaved, so machine noise hits both
//! alike), and returns a report that the CLI prints as a table or JSON. Nothing here prints.
//! [`proxy`] runs the LLM proxy in process against the stub upstream (`crab-testkit`); the
//! inspector's benchmark is the `crab-inspector-bench` binary (its own workload, root only).

pub mod density_memory;
pub mod e2b_health;
pub mod foundation;
pub mod harness_agent;
pub mod images;
pub mod lifecycle;
pub mod proxy;
pub mod remote;
pub mod remote_restore;
pub mod replay;
pub mod stats;

pub use stats::Summary;
