//! The pool of sandbox keys and their inner BPF maps, kept off the create path.
//!
//! Every update of an array-of-maps waits for an RCU grace period (the kernel's
//! `maybe_wait_bpf_programs`, ~15 ms here), and a sandbox needs five (two change maps, two path
//! maps, one process map). Done at attach time that is 60–80 ms of every `crab sandbox create`.
//! Instead, a key's inner maps are installed once, ahead of time, by a background thread that
//! keeps [`READY_TARGET`] keys ready; a detached sandbox's maps stay installed, are emptied and
//! go back to the pool. Attaching then costs no outer-map update at all.
//!
//! Correctness does not depend on the pool: BPF attributes nothing to a key until its cgroup id
//! is in `cgmap`, which attach writes only after it has taken an installed, empty set of maps,
//! so a sandbox's first syscall after attach already lands in the maps attach reads.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use libbpf_rs::MapHandle;

use crate::abi::{CHANGE_SIZE, CKEY_SIZE, MAX_CHANGES, MAX_PROCS, PREC_SIZE, PROC_SIZE};
use crate::error::InspectorError;
use crate::maps;

/// Keys kept ready (installed, empty) by the background refiller, unless [`POOL_ENV`] says
/// otherwise.
pub(crate) const READY_TARGET: usize = 16;

/// Environment variable overriding [`READY_TARGET`] (`0` turns the pool off: every attach
/// installs its own maps, as before the pool; for A/B measurements and small hosts).
pub(crate) const POOL_ENV: &str = "CRAB_INSPECTOR_POOL";

fn ready_target() -> usize {
    match std::env::var(POOL_ENV) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "{POOL_ENV} is not a number; using {READY_TARGET}");
            READY_TARGET
        }),
        Err(_) => READY_TARGET,
    }
}

/// One key's inner maps: changes and path records per turn slot, and its processes.
#[derive(Debug)]
pub(crate) struct SandboxMaps {
    pub changes: [MapHandle; 2],
    pub paths: [MapHandle; 2],
    pub procs: MapHandle,
}

impl SandboxMaps {
    fn create() -> Result<SandboxMaps, InspectorError> {
        let changes =
            || maps::create_inner("crab_changes", CKEY_SIZE, CHANGE_SIZE, MAX_CHANGES, true);
        let paths = || maps::create_inner("crab_paths", CKEY_SIZE, PREC_SIZE, MAX_CHANGES, true);
        Ok(SandboxMaps {
            changes: [changes()?, changes()?],
            paths: [paths()?, paths()?],
            procs: maps::create_inner("crab_procs", 4, PROC_SIZE, MAX_PROCS, true)?,
        })
    }

    /// Deletes every element (records a previous owner of the key, or a BPF handler still in
    /// flight when it was detached, may have left).
    pub fn clear(&self) -> Result<(), InspectorError> {
        for (m, name) in [
            (&self.changes[0], "changes"),
            (&self.changes[1], "changes"),
            (&self.paths[0], "paths"),
            (&self.paths[1], "paths"),
            (&self.procs, "procs"),
        ] {
            let d = maps::dump(m, name)?;
            maps::delete_all(m, name, &d)?;
        }
        Ok(())
    }
}

/// The outer array-of-maps the inner maps are installed into.
#[derive(Debug)]
pub(crate) struct Outer {
    pub changes_of: MapHandle,
    pub paths_of: MapHandle,
    pub procs_of: MapHandle,
}

impl Outer {
    fn dup(&self) -> Result<Outer, InspectorError> {
        let d = |m: &MapHandle, name: &'static str| {
            MapHandle::try_from(m).map_err(|e| InspectorError::MapSyscall {
                syscall: "dup",
                map: name,
                source: std::io::Error::other(e.to_string()),
            })
        };
        Ok(Outer {
            changes_of: d(&self.changes_of, "changes_of")?,
            paths_of: d(&self.paths_of, "paths_of")?,
            procs_of: d(&self.procs_of, "procs_of")?,
        })
    }

    /// Creates a key's maps and points the outer slots at them. The five updates run on five
    /// threads: concurrent waiters share one RCU grace period.
    pub fn install(&self, key: u32) -> Result<SandboxMaps, InspectorError> {
        let sm = SandboxMaps::create()?;
        let jobs: [(&MapHandle, &'static str, u32, &MapHandle); 5] = [
            (&self.changes_of, "changes_of", key * 2, &sm.changes[0]),
            (&self.changes_of, "changes_of", key * 2 + 1, &sm.changes[1]),
            (&self.paths_of, "paths_of", key * 2, &sm.paths[0]),
            (&self.paths_of, "paths_of", key * 2 + 1, &sm.paths[1]),
            (&self.procs_of, "procs_of", key, &sm.procs),
        ];
        let results: Vec<Result<(), InspectorError>> = std::thread::scope(|s| {
            let hs: Vec<_> = jobs
                .iter()
                .map(|&(outer, name, idx, inner)| {
                    s.spawn(move || maps::set_inner(outer, name, idx, inner))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(Err(InspectorError::Poisoned))).collect()
        });
        for r in results {
            r?;
        }
        Ok(sm)
    }
}

#[derive(Debug)]
struct State {
    /// Keys with no maps of their own installed (their outer slots are empty or stale).
    free: Vec<u32>,
    /// Keys whose maps are installed and empty, ready to attach: taken from the back, where
    /// detached keys go (reused first); the refiller adds at the front.
    ready: VecDeque<(u32, SandboxMaps)>,
    /// The refiller failed: it waits for the next take before trying again.
    failed: bool,
    stop: bool,
    /// Keys to keep ready.
    target: usize,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

/// Free keys and ready maps, with the background refiller.
#[derive(Debug)]
pub(crate) struct KeyPool {
    shared: Arc<Shared>,
    outer: Outer,
    refiller: Option<JoinHandle<()>>,
}

impl KeyPool {
    /// A pool of keys `0..n` (taken lowest first) and its refiller thread.
    pub fn new(n: u32, outer: Outer) -> Result<KeyPool, InspectorError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                free: (0..n).rev().collect(),
                ready: VecDeque::new(),
                failed: false,
                stop: false,
                target: ready_target(),
            }),
            cv: Condvar::new(),
        });
        let bg_outer = outer.dup()?;
        let bg = shared.clone();
        let refiller = std::thread::Builder::new()
            .name("crab-inspector-pool".into())
            .spawn(move || refill(&bg, &bg_outer))
            .map_err(|e| InspectorError::MapSyscall {
                syscall: "thread spawn",
                map: "pool",
                source: e,
            })?;
        Ok(KeyPool { shared, outer, refiller: Some(refiller) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A key with installed, empty maps: from the ready pool when it has one (no outer-map
    /// update), else installed now. `None` when every key is in use.
    pub fn take(&self) -> Result<Option<(u32, SandboxMaps)>, InspectorError> {
        let mut st = self.lock();
        st.failed = false;
        self.shared.cv.notify_all();
        if let Some((key, sm)) = st.ready.pop_back() {
            drop(st);
            if let Err(e) = sm.clear() {
                self.put_ready(key, sm);
                return Err(e);
            }
            return Ok(Some((key, sm)));
        }
        let Some(key) = st.free.pop() else { return Ok(None) };
        drop(st);
        tracing::debug!(key, "inspector key pool empty: installing maps on the create path");
        match self.outer.install(key) {
            Ok(sm) => Ok(Some((key, sm))),
            Err(e) => {
                self.lock().free.push(key);
                Err(e)
            }
        }
    }

    /// Returns a key whose maps are still installed (a detach, or a failed attach): emptied
    /// here, then ready again. If emptying fails the key goes back to `free` and is
    /// re-installed with fresh maps when next needed.
    pub fn put_ready(&self, key: u32, sm: SandboxMaps) {
        match sm.clear() {
            Ok(()) => self.lock().ready.push_back((key, sm)),
            Err(e) => {
                tracing::warn!(key, error = %e, "could not empty a key's maps: re-installing later");
                self.lock().free.push(key);
            }
        }
    }
}

impl Drop for KeyPool {
    fn drop(&mut self) {
        self.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(h) = self.refiller.take() {
            let _ = h.join();
        }
    }
}

/// Keys the refiller installs at once (their outer-map updates share grace periods).
const REFILL_BATCH: usize = 4;

fn refill(shared: &Shared, outer: &Outer) {
    loop {
        let keys: Vec<u32> = {
            let mut st = shared.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            loop {
                if st.stop {
                    return;
                }
                let want = st.target.saturating_sub(st.ready.len()).min(REFILL_BATCH);
                if !st.failed && want > 0 && !st.free.is_empty() {
                    let n = want.min(st.free.len());
                    let at = st.free.len() - n;
                    break st.free.split_off(at);
                }
                st = shared.cv.wait(st).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let results: Vec<(u32, Result<SandboxMaps, InspectorError>)> = std::thread::scope(|s| {
            let hs: Vec<_> = keys.iter().map(|&k| (k, s.spawn(move || outer.install(k)))).collect();
            hs.into_iter()
                .map(|(k, h)| (k, h.join().unwrap_or(Err(InspectorError::Poisoned))))
                .collect()
        });
        let mut st = shared.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, r) in results {
            match r {
                Ok(sm) => st.ready.push_front((key, sm)),
                Err(e) => {
                    tracing::warn!(key, error = %e, "inspector pool refill failed");
                    st.free.push(key);
                    st.failed = true;
                }
            }
        }
    }
}
