//! Parking's policy and record: when the engine parks a sandbox at a turn boundary
//! ([`ParkPolicy`], the inputs it weighs: each sandbox's recent LLM waits, the measured wake
//! cost), and how many sandboxes the host parked and woke, how long wakes took, which failed,
//! how many answers waited for a wake — what `crab top` shows (`GET /v1/top`'s `parking`). The
//! lifecycle steps themselves (park, wake, waking before an action) are `lifecycle.rs`'s; the
//! turn-boundary decision and the answer's wake are `host/turns.rs`'s.

use std::collections::{BTreeMap, HashMap, VecDeque};
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
    /// Memory each parked sandbox held when it parked, bytes (what parking freed).
    freed: HashMap<String, u64>,
    wakes: u64,
    wake_failures: u64,
    wake_ms: Latencies,
    /// Per sandbox, its newest wake times, ms, for the policy's cost estimates: of wakes
    /// while no process dump ran...
    wake_times: HashMap<String, VecDeque<f64>>,
    /// ... and of wakes beside one (a first turn's: its dumps' writes, hashing and `syncfs`
    /// on the same pool and cores made them 2–4 times as long).
    crowded_wakes: HashMap<String, VecDeque<f64>>,
    /// Per sandbox, its newest LLM waits (boundary to answer), ms.
    waits: HashMap<String, VecDeque<f64>>,
    /// Per sandbox, how long its newest answers took from their head to their end, ms (a
    /// stream's generation time; about zero for buffered answers).
    leads: HashMap<String, VecDeque<f64>>,
    /// Parks whose wake was left to the answer's head (no wake ahead of it).
    head_parks: u64,
    /// Answers held until their sandbox woke.
    answer_wakes: u64,
    /// Wakes started ahead of the answer (at the expected wait less the wake cost).
    prewakes: u64,
    /// Turn boundaries the policy did not park at, by why.
    declined: BTreeMap<&'static str, u64>,
}

/// Why the policy left a sandbox running at a turn boundary (`crab top`'s `declined`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decline {
    /// No wait and no streamed answer seen yet, by it or the host: nothing to predict from.
    NoHistory,
    /// The wait left after the checkpoint and the wake is under the margin times the cost.
    WaitTooShort,
    /// The running sandboxes' memory is within the budget.
    UnderBudget,
    /// A client is connected to it (a command's stream, an attached session).
    Clients,
    /// Its point lacks its processes and the wait does not pay for a dump as well.
    DumpNotWorthIt,
    /// The park itself failed (the sandbox stays running; the daemon's log says why).
    ParkFailed,
}

impl Decline {
    /// Its name in `crab top --json`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoHistory => "no_history",
            Self::WaitTooShort => "wait_too_short",
            Self::UnderBudget => "under_budget",
            Self::Clients => "clients",
            Self::DumpNotWorthIt => "dump_not_worth_it",
            Self::ParkFailed => "park_failed",
        }
    }
}

/// The clients connected to each sandbox now: a command's output stream, an attached
/// session, a followed background process's output, any call that needs it running while it
/// runs. The policy never parks a sandbox that has one — halting it would cut them off (a
/// command the agent left running while it waits for the LLM, a harness following a server's
/// log). A park in progress is marked here under the same lock as the count, so a client that
/// connects after the policy's check sees it and waits for the park, then wakes the sandbox.
#[derive(Debug, Default)]
pub struct Clients(Mutex<HashMap<String, Conns>>);

/// One sandbox's entry in [`Clients`].
#[derive(Debug, Default)]
struct Conns {
    clients: usize,
    parking: bool,
}

/// One connected client of a sandbox; dropping it disconnects it.
#[derive(Debug)]
pub struct Client {
    clients: std::sync::Arc<Clients>,
    sandbox: String,
}

/// A park in progress ([`Clients::begin_park`]); dropping it ends it.
#[derive(Debug)]
pub struct ParkInProgress {
    clients: std::sync::Arc<Clients>,
    sandbox: String,
}

impl Clients {
    /// A client of `sandbox` connects.
    pub fn connect(self: &std::sync::Arc<Self>, sandbox: &str) -> Client {
        lock(&self.0).entry(sandbox.to_string()).or_default().clients += 1;
        Client { clients: self.clone(), sandbox: sandbox.to_string() }
    }

    /// How many clients `sandbox` has now.
    pub fn count(&self, sandbox: &str) -> usize {
        lock(&self.0).get(sandbox).map_or(0, |c| c.clients)
    }

    /// Mark a park of `sandbox` in progress — with `idle_only`, only if no client is
    /// connected (else `Err(count)`).
    pub fn begin_park(
        self: &std::sync::Arc<Self>,
        sandbox: &str,
        idle_only: bool,
    ) -> Result<ParkInProgress, usize> {
        let mut g = lock(&self.0);
        let c = g.entry(sandbox.to_string()).or_default();
        if idle_only && c.clients > 0 {
            return Err(c.clients);
        }
        c.parking = true;
        Ok(ParkInProgress { clients: self.clone(), sandbox: sandbox.to_string() })
    }

    /// Whether a park of `sandbox` is in progress.
    pub fn parking(&self, sandbox: &str) -> bool {
        lock(&self.0).get(sandbox).is_some_and(|c| c.parking)
    }

    fn update(&self, sandbox: &str, f: impl FnOnce(&mut Conns)) {
        let mut g = lock(&self.0);
        if let Some(c) = g.get_mut(sandbox) {
            f(c);
            if c.clients == 0 && !c.parking {
                g.remove(sandbox);
            }
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.clients.update(&self.sandbox, |c| c.clients = c.clients.saturating_sub(1));
    }
}

impl Drop for ParkInProgress {
    fn drop(&mut self) {
        self.clients.update(&self.sandbox, |c| c.parking = false);
    }
}

/// When the engine parks a sandbox at a turn boundary (`crab daemon --memory-budget`).
#[derive(Debug, Clone)]
pub struct ParkPolicy {
    /// Park only while the running sandboxes' memory exceeds this, bytes.
    pub budget_bytes: u64,
    /// The expected wait must be this many times the expected wake cost.
    pub margin: f64,
}

/// Waits and wakes remembered per sandbox / host for the estimates.
const HISTORY: usize = 16;
/// Waits a sandbox must have shown before the policy trusts its estimate.
pub const MIN_WAITS: usize = 3;
/// The wake cost assumed before any wake was measured, ms (a small sandbox's restore).
pub const DEFAULT_WAKE_MS: f64 = 100.0;
/// A streamed answer's head times the wake when nine in ten of the sandbox's recent answers
/// (its own, else the host's) went on after their head for at least this many wake costs: a
/// wake started at the head is back within about one cost, and this leaves it half as much
/// again. With two, a sandbox's second turn — timed by the host's first, crowded wakes (about
/// 300 ms beside six dumps) — or answers of 190–250 ms made it wake ahead of the answer
/// instead, running from a low quantile of its waits to their end: seconds of its memory.
pub const HEAD_LEAD_MARGIN: f64 = 1.5;
/// How much of the shortest recent answer a wake timed from a streamed head may take before
/// it must be back: half, so an answer shorter than any seen yet (with few answers seen, one
/// in several is) waits for the rest of a wake at most — a wake timed to be back by the
/// shortest itself held each such answer for a whole wake and more (150–180 ms against a
/// 125 ms answer), which set the exposed p95.
pub const HEAD_WAKE_SHARE: f64 = 0.5;
/// What a full dump at the boundary is assumed to add when the turn's point lacks the
/// processes, ms.
pub const DUMP_MS: f64 = 150.0;

/// What `crab top` shows of parking.
#[derive(Debug, Clone, Serialize)]
pub struct ParkingStats {
    /// Sandboxes parked now.
    pub parked: usize,
    /// Parks since the daemon started.
    pub parks: u64,
    /// Memory the sandboxes parked now held when they parked (parked since the daemon
    /// started), bytes.
    pub freed_bytes: u64,
    /// Wakes since the daemon started.
    pub wakes: u64,
    /// Wakes whose restore failed (the sandbox was left stopped).
    pub wake_failures: u64,
    /// How long wakes took, ms.
    pub wake_ms: Summary,
    /// LLM answers the proxy held until their sandbox woke.
    pub answer_wakes: u64,
    /// Wakes the host started ahead of the answer (the sandbox was back before it came).
    pub prewakes: u64,
    /// Parks whose wake was left to the answer's head: the sandbox's answers stream long
    /// enough after it for the wake to finish first, so no wake ahead of it was scheduled.
    pub head_parks: u64,
    /// Turn boundaries of parkable sandboxes the policy left running, by why
    /// ([`Decline::as_str`]).
    pub declined: BTreeMap<&'static str, u64>,
}

impl Parking {
    /// `sandbox` parked, freeing the `bytes` of memory it held.
    pub fn parked(&self, sandbox: &str, bytes: u64) {
        let mut g = lock(&self.inner);
        g.parks += 1;
        g.freed.insert(sandbox.to_string(), bytes);
    }

    /// `sandbox` woke, its restore taking `took` — `crowded` when a process dump ran at its
    /// start or end.
    pub fn woke(&self, sandbox: &str, took: Duration, crowded: bool) {
        let ms = took.as_secs_f64() * 1e3;
        let mut g = lock(&self.inner);
        g.freed.remove(sandbox);
        g.wakes += 1;
        g.wake_ms.record_ms(ms);
        let times = if crowded { &mut g.crowded_wakes } else { &mut g.wake_times };
        remember(times.entry(sandbox.to_string()).or_default(), ms);
    }

    /// A wake started ahead of the answer.
    pub fn prewoke(&self) {
        lock(&self.inner).prewakes += 1;
    }

    /// An LLM answer was held until its sandbox woke.
    pub fn answer_woke(&self) {
        lock(&self.inner).answer_wakes += 1;
    }

    /// `sandbox`'s agent waited `ms` for an LLM answer.
    pub fn record_wait(&self, sandbox: &str, ms: f64) {
        remember(lock(&self.inner).waits.entry(sandbox.to_string()).or_default(), ms);
    }

    /// `sandbox`'s newest answer ended `ms` after its head arrived.
    pub fn record_lead(&self, sandbox: &str, ms: f64) {
        remember(lock(&self.inner).leads.entry(sandbox.to_string()).or_default(), ms);
    }

    /// How long `sandbox`'s answers can be expected to go on after their head: the 10th
    /// percentile of its newest [`HISTORY`] (nine in ten were longer), once it has shown
    /// [`MIN_WAITS`] of them; before that, the same of every sandbox's newest answers on this
    /// host (like [`Parking::expected_wait_ms`]'s prior). A streamed answer's head comes when
    /// the model starts writing; a wake started then is back before the end when this exceeds
    /// the wake cost.
    pub fn answer_lead_ms(&self, sandbox: &str) -> Option<f64> {
        let mut v = own_or_hosts(&lock(&self.inner).leads, sandbox);
        (v.len() >= MIN_WAITS).then(|| quantile(&mut v, 0.10))
    }

    /// The shortest of the answers [`Parking::answer_lead_ms`] looks at, ms: how late a wake
    /// timed from a streamed head may start and still be back before the end of every one of
    /// them (the p10 is for whether to leave the wake to the head at all; a wake timed from it
    /// is late for one answer in ten).
    pub fn answer_lead_floor_ms(&self, sandbox: &str) -> Option<f64> {
        let v = own_or_hosts(&lock(&self.inner).leads, sandbox);
        (v.len() >= MIN_WAITS).then(|| shortest(&v))
    }

    /// The policy left a sandbox running at a turn boundary, for `why`.
    pub fn declined(&self, why: Decline) {
        *lock(&self.inner).declined.entry(why.as_str()).or_default() += 1;
    }

    /// A park left its wake to the answer's head.
    pub fn head_parked(&self) {
        lock(&self.inner).head_parks += 1;
    }

    /// Forget `sandbox` (removed).
    pub fn forget(&self, sandbox: &str) {
        let mut g = lock(&self.inner);
        g.waits.remove(sandbox);
        g.leads.remove(sandbox);
        g.wake_times.remove(sandbox);
        g.crowded_wakes.remove(sandbox);
        g.freed.remove(sandbox);
    }

    /// The wait `sandbox`'s agent can be expected to leave it idle: the 25th percentile of its
    /// newest waits (a cautious guess: three in four waits were longer), once it has shown
    /// [`MIN_WAITS`] of them; before that, the same of every sandbox's newest waits on this
    /// host (a prior: agents on one host tend to share a model), once there are
    /// [`MIN_WAITS`] of those.
    pub fn expected_wait_ms(&self, sandbox: &str) -> Option<f64> {
        let mut v = own_or_hosts(&lock(&self.inner).waits, sandbox);
        (v.len() >= MIN_WAITS).then(|| quantile(&mut v, 0.25))
    }

    /// What `sandbox`'s next wake is expected to take, for timing it: the median of its newest
    /// [`HISTORY`] wakes once it has woken [`MIN_WAITS`] times, before that of every sandbox's
    /// on this host, else [`DEFAULT_WAKE_MS`] — of the wakes that ran as this one will, beside
    /// a process dump or not (`crowded`, whether one runs now; see [`Parking::wake_samples`]).
    pub fn wake_cost_ms(&self, sandbox: &str, crowded: bool) -> f64 {
        let mut v = self.wake_samples(sandbox, crowded);
        if v.is_empty() {
            return DEFAULT_WAKE_MS;
        }
        quantile(&mut v, 0.5)
    }

    /// The wake times the estimates of `sandbox`'s next wake look at: those of wakes that ran
    /// beside a process dump when one runs now (`crowded`), else of those that did not; with
    /// none of those, beside a dump, the others (a wake costs at least that), and without a
    /// dump, none ([`DEFAULT_WAKE_MS`]). A first turn's wakes all run beside its dumps; judged
    /// by them once the dumps are over, every later park looked too dear to pay, so none
    /// happened and no other wake was ever measured: on this host that left a whole run
    /// with 2 parks in 72 boundaries (session 34).
    fn wake_samples(&self, sandbox: &str, crowded: bool) -> Vec<f64> {
        let g = lock(&self.inner);
        let (like, unlike) = if crowded {
            (&g.crowded_wakes, &g.wake_times)
        } else {
            (&g.wake_times, &g.crowded_wakes)
        };
        let v = own_or_hosts(like, sandbox);
        if v.is_empty() && crowded {
            return own_or_hosts(unlike, sandbox);
        }
        v
    }

    /// What a wake of `sandbox` costs at least — the fastest of the wakes
    /// [`Parking::wake_cost_ms`] looks at, else [`DEFAULT_WAKE_MS`] —, for whether parking it
    /// pays. The slower wakes ran beside other work: a first turn's six wakes run beside six
    /// dumps and their hashing, three to four times as long as one alone. Judged by their
    /// median, the policy would find no wait long enough, park no more, measure no new wake,
    /// and keep that stale cost for good.
    pub fn wake_cost_floor_ms(&self, sandbox: &str, crowded: bool) -> f64 {
        let v = self.wake_samples(sandbox, crowded);
        if v.is_empty() {
            return DEFAULT_WAKE_MS;
        }
        shortest(&v)
    }

    /// `sandbox`'s wake failed (it is stopped: its memory stays free).
    pub fn wake_failed(&self, sandbox: &str) {
        let mut g = lock(&self.inner);
        g.freed.remove(sandbox);
        g.wake_failures += 1;
    }

    /// The counters, with `parked` sandboxes parked now.
    pub fn stats(&self, parked: usize) -> ParkingStats {
        let g = lock(&self.inner);
        ParkingStats {
            parked,
            parks: g.parks,
            freed_bytes: g.freed.values().sum(),
            wakes: g.wakes,
            wake_failures: g.wake_failures,
            wake_ms: g.wake_ms.summary(),
            answer_wakes: g.answer_wakes,
            prewakes: g.prewakes,
            head_parks: g.head_parks,
            declined: g.declined.clone(),
        }
    }
}

/// `sandbox`'s own samples of `per_sandbox` once it has [`MIN_WAITS`] of them, else every
/// sandbox's on this host (a prior: agents on one host tend to share a model).
fn own_or_hosts(per_sandbox: &HashMap<String, VecDeque<f64>>, sandbox: &str) -> Vec<f64> {
    match per_sandbox.get(sandbox) {
        Some(own) if own.len() >= MIN_WAITS => own.iter().copied().collect(),
        _ => per_sandbox.values().flat_map(|h| h.iter().copied()).collect(),
    }
}

/// Keep `ms` among the newest [`HISTORY`] of `h`.
fn remember(h: &mut VecDeque<f64>, ms: f64) {
    if h.len() == HISTORY {
        h.pop_front();
    }
    h.push_back(ms);
}

/// The smallest of `v` (infinite when empty).
fn shortest(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The `p` quantile of `v` (sorted here).
fn quantile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    crab_common::stats::percentile(v, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expected_wait_is_a_low_quantile_of_enough_waits() {
        let p = Parking::default();
        p.record_wait("a", 4000.0);
        p.record_wait("a", 100.0);
        assert_eq!(p.expected_wait_ms("a"), None, "two waits are not enough");
        // A sandbox without waits of its own borrows the host's.
        p.record_wait("c", 3000.0);
        assert_eq!(p.expected_wait_ms("b"), Some(100.0), "the host's prior");
        p.forget("c");
        p.record_wait("a", 5000.0);
        p.record_wait("a", 6000.0);
        let e = p.expected_wait_ms("a").unwrap();
        assert!((100.0..4100.0).contains(&e), "{e}");
        for _ in 0..HISTORY {
            p.record_wait("a", 7000.0);
        }
        assert_eq!(p.expected_wait_ms("a"), Some(7000.0), "old waits age out");
    }

    #[test]
    fn the_answer_lead_is_a_low_quantile_of_its_own_answers_or_the_hosts() {
        let p = Parking::default();
        p.record_lead("a", 900.0);
        p.record_lead("a", 1200.0);
        assert_eq!(p.answer_lead_ms("a"), None, "two answers are not enough");
        p.record_lead("a", 40.0);
        let l = p.answer_lead_ms("a").unwrap();
        assert!(l < 900.0, "a short answer pulls it down: {l}");
        assert_eq!(p.answer_lead_ms("b"), Some(l), "the host's answers are the prior");
        for _ in 0..HISTORY {
            p.record_lead("a", 2000.0);
        }
        assert_eq!(p.answer_lead_ms("a"), Some(2000.0), "old answers age out");
        p.record_lead("b", 10.0);
        assert_eq!(p.answer_lead_ms("a"), Some(2000.0), "its own answers, once it has enough");
        p.forget("a");
        p.forget("b");
        assert_eq!(p.answer_lead_ms("a"), None);
    }

    #[test]
    fn the_answer_lead_floor_is_the_shortest_recent_answer() {
        let p = Parking::default();
        p.record_lead("a", 900.0);
        p.record_lead("a", 1200.0);
        assert_eq!(p.answer_lead_floor_ms("a"), None, "two answers are not enough");
        p.record_lead("a", 300.0);
        assert_eq!(p.answer_lead_floor_ms("a"), Some(300.0));
        assert_eq!(p.answer_lead_floor_ms("b"), Some(300.0), "the host's answers are the prior");
        for _ in 0..HISTORY {
            p.record_lead("a", 2000.0);
        }
        assert_eq!(p.answer_lead_floor_ms("a"), Some(2000.0), "old answers age out");
        p.record_lead("b", 10.0);
        assert_eq!(p.answer_lead_floor_ms("a"), Some(2000.0), "its own, once it has enough");
        assert_eq!(p.answer_lead_floor_ms("b"), Some(10.0), "b has one: the host's");
    }

    #[test]
    fn declined_parks_are_counted_by_why() {
        let p = Parking::default();
        assert!(p.stats(0).declined.is_empty());
        p.declined(Decline::WaitTooShort);
        p.declined(Decline::WaitTooShort);
        p.declined(Decline::Clients);
        let d = p.stats(0).declined;
        assert_eq!(d.get("wait_too_short"), Some(&2));
        assert_eq!(d.get("clients"), Some(&1));
        assert_eq!(d.len(), 2, "{d:?}");
        let names = [
            Decline::NoHistory,
            Decline::WaitTooShort,
            Decline::UnderBudget,
            Decline::Clients,
            Decline::DumpNotWorthIt,
            Decline::ParkFailed,
        ]
        .map(Decline::as_str);
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "two reasons share a name: {names:?}");
    }

    #[test]
    fn clients_are_counted_until_they_go() {
        let c = std::sync::Arc::new(Clients::default());
        let a = c.connect("a");
        let a2 = c.connect("a");
        let b = c.connect("b");
        assert_eq!((c.count("a"), c.count("b"), c.count("z")), (2, 1, 0));
        drop(a);
        assert_eq!(c.count("a"), 1);
        drop((a2, b));
        assert_eq!((c.count("a"), c.count("b")), (0, 0));
        assert!(lock(&c.0).is_empty(), "nothing kept for sandboxes without clients");
    }

    #[test]
    fn a_park_and_a_client_always_see_each_other() {
        let c = std::sync::Arc::new(Clients::default());
        // A client first: the policy's park is refused, a park by hand is not.
        let a = c.connect("a");
        assert_eq!(c.begin_park("a", true).err(), Some(1));
        assert!(!c.parking("a"), "a refused park left its mark");
        let by_hand = c.begin_park("a", false).expect("a park by hand");
        assert!(c.parking("a"));
        drop((a, by_hand));
        assert!(lock(&c.0).is_empty());
        // The park first: a client connecting meanwhile sees it in progress, until it ends.
        let p = c.begin_park("b", true).expect("no client yet");
        let late = c.connect("b");
        assert!(c.parking("b"), "the late client does not see the park");
        drop(p);
        assert!(!c.parking("b"));
        assert_eq!(c.count("b"), 1);
        drop(late);
        assert!(lock(&c.0).is_empty(), "nothing kept once both are gone");
    }

    #[test]
    fn the_wake_cost_is_measured_once_there_are_wakes() {
        let p = Parking::default();
        assert_eq!(p.wake_cost_ms("a", false), DEFAULT_WAKE_MS);
        assert_eq!(p.wake_cost_floor_ms("a", false), DEFAULT_WAKE_MS);
        p.parked("a", 300);
        p.parked("b", 200);
        assert_eq!(p.stats(2).freed_bytes, 500);
        p.woke("a", Duration::from_millis(40), false);
        assert_eq!(p.stats(1).freed_bytes, 200, "a woke: its memory is back in use");
        p.woke("b", Duration::from_millis(60), false);
        p.woke("c", Duration::from_millis(50), false);
        assert!((p.wake_cost_ms("z", false) - 50.0).abs() < 1.0, "{}", p.wake_cost_ms("z", false));
        assert!((p.wake_cost_floor_ms("z", false) - 40.0).abs() < 1.0, "the host's fastest");
        assert_eq!(p.stats(2).wakes, 3);
    }

    #[test]
    fn wakes_beside_dumps_time_only_wakes_beside_dumps() {
        let p = Parking::default();
        // A first turn: six wakes beside six dumps.
        for (i, ms) in [700, 900, 1000, 650, 800, 1050].into_iter().enumerate() {
            p.woke(&format!("s{i}"), Duration::from_millis(ms), true);
        }
        // The dumps are over: nothing measured alone yet, so the prior, not the crowd.
        assert_eq!(p.wake_cost_ms("s0", false), DEFAULT_WAKE_MS);
        assert_eq!(p.wake_cost_floor_ms("s0", false), DEFAULT_WAKE_MS);
        // While dumps run, the crowded ones are the estimate.
        assert!((p.wake_cost_ms("s0", true) - 800.0).abs() < 1.0, "{}", p.wake_cost_ms("s0", true));
        assert!((p.wake_cost_floor_ms("s0", true) - 650.0).abs() < 1.0);
        // A wake alone, measured: it times the later wakes without dumps.
        p.woke("s0", Duration::from_millis(220), false);
        assert!((p.wake_cost_ms("s1", false) - 220.0).abs() < 1.0);
        assert!((p.wake_cost_ms("s1", true) - 800.0).abs() < 1.0, "still the crowd beside dumps");
        // Beside a dump with no crowded wake measured, the lone ones (a wake costs at least
        // that); forgetting a sandbox drops both of its kinds.
        let q = Parking::default();
        q.woke("a", Duration::from_millis(200), false);
        assert!((q.wake_cost_floor_ms("a", true) - 200.0).abs() < 1.0);
        q.woke("a", Duration::from_millis(900), true);
        q.forget("a");
        assert_eq!(q.wake_cost_ms("a", true), DEFAULT_WAKE_MS);
    }

    #[test]
    fn a_sandbox_is_timed_by_its_own_wakes_once_it_has_some() {
        let p = Parking::default();
        // A first turn's wakes, all at once beside their dumps: slow.
        for (n, ms) in [("a", 900), ("b", 1000), ("c", 700)] {
            p.woke(n, Duration::from_millis(ms), false);
        }
        assert!((p.wake_cost_ms("a", false) - 900.0).abs() < 1.0, "the host's median first");
        assert!((p.wake_cost_floor_ms("a", false) - 700.0).abs() < 1.0);
        // Then its own, alone.
        p.woke("a", Duration::from_millis(250), false);
        p.woke("a", Duration::from_millis(230), false);
        assert!(
            (p.wake_cost_floor_ms("a", false) - 230.0).abs() < 1.0,
            "{}",
            p.wake_cost_floor_ms("a", false)
        );
        assert!(
            (p.wake_cost_ms("a", false) - 250.0).abs() < 1.0,
            "its own median: {}",
            p.wake_cost_ms("a", false)
        );
        assert!(
            (p.wake_cost_ms("b", false) - 700.0).abs() < 1.0,
            "b has one: the host's, {}",
            p.wake_cost_ms("b", false)
        );
        p.forget("a");
        assert!((p.wake_cost_floor_ms("z", false) - 700.0).abs() < 1.0, "a's wakes went with it");
    }
}
