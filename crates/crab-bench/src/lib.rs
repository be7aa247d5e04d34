//! Crab's benchmarks. Each benchmark talks to the real daemon through [`crab_client`], measures
//! the thing and its baseline side by side in one run (interleaved, so machine noise hits both
//! alike), and returns a report that the CLI prints as a table or JSON. Nothing here prints.

pub mod foundation;
pub mod replay;
pub mod stats;

pub use stats::Summary;
