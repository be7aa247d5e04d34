//! A process-wide observer of the `criu swrk` processes this crate starts.
//!
//! CRIU acts inside the processes it dumps (its parasite runs in them, and the system calls it
//! interrupts restart afterwards). Whoever watches those processes — Crab's eBPF inspector —
//! must know which host process is CRIU so as not to mistake its work for the sandbox's. The
//! observer is told a swrk's pid right after it is spawned, before any request is sent, and
//! again when the session ends.

use std::sync::OnceLock;

/// Called with `(pid, true)` when a `criu swrk` starts and `(pid, false)` when it is gone.
pub type Observer = Box<dyn Fn(u32, bool) + Send + Sync>;

static OBSERVER: OnceLock<Observer> = OnceLock::new();

/// Install the observer (once per process). Returns false when one was installed already.
pub fn set(observer: Observer) -> bool {
    OBSERVER.set(observer).is_ok()
}

pub(crate) fn notify(pid: u32, started: bool) {
    if let Some(o) = OBSERVER.get() {
        o(pid, started);
    }
}
