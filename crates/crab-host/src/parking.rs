//! Parking's record: how many sandboxes the host parked and woke, how long wakes took and
//! which failed — what `crab top` shows of it (`GET /v1/top`'s `parking`). The lifecycle
//! steps themselves (park, wake, waking before an action) are `lifecycle.rs`'s.

use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use crab_common::stats::{Latencies, Summary};
use crab_common::sync::lock;

/// Counters of the host's parking.
#[derive(Debug, Default)]
pub struct Parking {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    parks: u64,
    wakes: u64,
    wake_failures: u64,
    wake_ms: Latencies,
}

/// What `crab top` shows of parking.
#[derive(Debug, Clone, Serialize)]
pub struct ParkingStats {
    /// Sandboxes parked now.
    pub parked: usize,
    /// Parks since the daemon started.
    pub parks: u64,
    /// Wakes since the daemon started.
    pub wakes: u64,
    /// Wakes whose restore failed (the sandbox was left stopped).
    pub wake_failures: u64,
    /// How long wakes took, ms.
    pub wake_ms: Summary,
}

impl Parking {
    /// A sandbox was parked.
    pub fn parked(&self) {
        lock(&self.inner).parks += 1;
    }

    /// A sandbox woke, its restore taking `took`.
    pub fn woke(&self, took: Duration) {
        let mut g = lock(&self.inner);
        g.wakes += 1;
        g.wake_ms.record_ms(took.as_secs_f64() * 1e3);
    }

    /// A wake's restore failed.
    pub fn wake_failed(&self) {
        lock(&self.inner).wake_failures += 1;
    }

    /// The counters, with `parked` sandboxes parked now.
    pub fn stats(&self, parked: usize) -> ParkingStats {
        let g = lock(&self.inner);
        ParkingStats {
            parked,
            parks: g.parks,
            wakes: g.wakes,
            wake_failures: g.wake_failures,
            wake_ms: g.wake_ms.summary(),
        }
    }
}
