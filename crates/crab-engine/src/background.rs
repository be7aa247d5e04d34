//! The engine's background lane: normal-priority host work that is not one sandbox's checkpoint
//! job — the export of published restore points to the durable tier (`crab daemon --remote`).
//!
//! Such work must not take a sandbox's job slot (an upload lasts seconds; the sandbox's next
//! turn must not queue behind it) and must stay behind urgent turn work. So it runs in a lane
//! of its own, one task at a time: a [`BackgroundPermit`] is granted only while no urgent job
//! is queued or running and no process dump runs, and the work calls
//! [`BackgroundPermit::yield_to_urgent`] between its steps (a pack, a file), which waits for
//! as long as urgent work or a dump appeared meanwhile. Waiting is on a watch the scheduler
//! updates whenever its state changes: no polling.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// Shared state of the lane, owned by the engine.
#[derive(Debug)]
pub(crate) struct Lane {
    /// True while urgent work is queued or running, or a dump runs, or a hold is taken.
    busy: watch::Sender<bool>,
    /// The scheduler's own view (urgent work or a dump), without the holds.
    sched_busy: std::sync::atomic::AtomicBool,
    /// Holds taken by work outside the engine that a caller waits for (a restore, a fork).
    holds: AtomicUsize,
    /// One background task at a time.
    slot: Arc<Semaphore>,
    running: AtomicUsize,
    waiting: AtomicUsize,
    yields: AtomicU64,
    granted: AtomicU64,
}

/// Counters of the lane, for `crab top` and the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LaneStats {
    pub running: usize,
    pub waiting: usize,
    pub yields: u64,
    pub granted: u64,
}

impl Lane {
    pub(crate) fn new() -> Arc<Lane> {
        Arc::new(Lane {
            busy: watch::channel(false).0,
            sched_busy: std::sync::atomic::AtomicBool::new(false),
            holds: AtomicUsize::new(0),
            slot: Arc::new(Semaphore::new(1)),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            yields: AtomicU64::new(0),
            granted: AtomicU64::new(0),
        })
    }

    /// The scheduler's view changed: is urgent work (or a dump) in the way now?
    pub(crate) fn publish(&self, busy: bool) {
        self.sched_busy.store(busy, Ordering::SeqCst);
        self.republish();
    }

    fn republish(&self) {
        // Read under the channel's lock: of two racing republishes, the later one to take it
        // sees the newer counts (a dropped hold cannot be overwritten by a stale "busy").
        self.busy.send_if_modified(|b| {
            let busy =
                self.sched_busy.load(Ordering::SeqCst) || self.holds.load(Ordering::SeqCst) > 0;
            let changed = *b != busy;
            *b = busy;
            changed
        });
    }

    pub(crate) fn stats(&self) -> LaneStats {
        LaneStats {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            yields: self.yields.load(Ordering::Relaxed),
            granted: self.granted.load(Ordering::Relaxed),
        }
    }

    /// Hold background work off until the hold drops (see [`crate::Engine::hold_background`]).
    pub(crate) fn hold(self: &Arc<Self>) -> LaneHold {
        self.holds.fetch_add(1, Ordering::SeqCst);
        self.republish();
        LaneHold(self.clone())
    }

    async fn quiet(&self) {
        let mut rx = self.busy.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = rx.wait_for(|busy| !*busy).await;
    }

    /// Wait for the lane (see [`crate::Engine::background`]).
    pub(crate) async fn acquire(self: &Arc<Self>, what: &str) -> BackgroundPermit {
        let waiting = Counted::new(&self.waiting);
        // Never closed: the lane owns the semaphore and never calls `close`.
        let slot = self.slot.clone().acquire_owned().await.ok();
        self.quiet().await;
        drop(waiting);
        self.running.fetch_add(1, Ordering::Relaxed);
        self.granted.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(what, "background lane granted");
        BackgroundPermit { lane: self.clone(), _slot: slot }
    }
}

/// Background work waits (between its steps) while this lives.
#[derive(Debug)]
pub struct LaneHold(Arc<Lane>);

impl Drop for LaneHold {
    fn drop(&mut self) {
        self.0.holds.fetch_sub(1, Ordering::SeqCst);
        self.0.republish();
    }
}

/// Increments a counter for as long as it lives.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Counted(c)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The right to run one piece of background work; the lane is free again when it is dropped.
#[derive(Debug)]
pub struct BackgroundPermit {
    lane: Arc<Lane>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl BackgroundPermit {
    /// Whether urgent work (or a dump) is in the way right now.
    pub fn should_yield(&self) -> bool {
        *self.lane.busy.borrow()
    }

    /// Called by the background work between its steps: returns at once when nothing urgent
    /// is in the way, else waits until it is done (still holding the lane). Returns whether it
    /// waited.
    pub async fn yield_to_urgent(&self) -> bool {
        if !self.should_yield() {
            return false;
        }
        self.lane.yields.fetch_add(1, Ordering::Relaxed);
        self.lane.quiet().await;
        true
    }
}

impl Drop for BackgroundPermit {
    fn drop(&mut self) {
        self.lane.running.fetch_sub(1, Ordering::Relaxed);
    }
}
