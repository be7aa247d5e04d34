//! Percentile summaries: the shared implementation lives in [`crab_common::stats`].

pub use crab_common::stats::{percentile, Summary};
