//! Latency summaries and exact medians: the shared implementation (an HdrHistogram per latency
//! series) lives in [`crab_common::stats`].

pub use crab_common::stats::{median, percentile, Latencies, Summary};
