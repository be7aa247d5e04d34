//! The scheduler: one [`Engine`] per host orders every sandbox's checkpoint jobs.
//!
//! Rules, applied each time something changes (submit, promote, finish, bandwidth refill):
//!
//! * A sandbox has at most one job running, and its queued jobs start in submission order. A
//!   checkpoint submitted while the sandbox already has a queued (not started) checkpoint merges
//!   into it (kinds merge, changesets merge, the turn range widens) and shares its completion.
//!   Restores never merge, and a checkpoint never merges across a queued restore.
//! * Promoting a job (or submitting it urgent, as restores are) also promotes the jobs of its
//!   sandbox queued before it, since they must run first.
//! * Urgent jobs (a response is waiting on them) start before normal ones, except that after
//!   `urgent_burst` urgent starts in a row while a startable normal job waited, that normal job
//!   starts next: normal work is delayed by a bounded amount, never starved.
//! * At most `workers` jobs run at once, of which at most `max_concurrent_dumps` dump processes.
//! * Non-skip jobs draw on a disk-bandwidth token bucket charged after the fact with the bytes a
//!   job reports; while the bucket is in debt only skip jobs start, and a timer wakes the
//!   scheduler when it refills.
//!
//! * Host work that is not a sandbox's job (exports to the durable tier) runs in the background
//!   lane (`background.rs`): one task at a time, granted while no urgent job is queued or
//!   running and no dump runs, told to pause when one appears. Each scheduling pass publishes
//!   that condition to the lane.
//!
//! Executors run on tokio's blocking pool; a panicking executor fails its job, not the engine.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crab_common::CheckpointKind;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::background::{BackgroundPermit, Lane};
use crate::job::{
    Changeset, ErasedExecutor, ExecError, Executor, Finished, Job, JobError, JobId, JobOp, JobSpec,
};
use crate::metrics::{gauge, JobRecord, Metrics, SandboxStats};

/// Scheduler limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Jobs running at once.
    pub workers: usize,
    /// Process dumps (CRIU) running at once.
    pub max_concurrent_dumps: usize,
    /// Disk bandwidth budget in bytes per second; `None` for no limit.
    pub disk_bytes_per_sec: Option<u64>,
    /// Token bucket depth in bytes (how much may be written in a burst).
    pub disk_burst_bytes: u64,
    /// Urgent starts in a row, while a normal job waits, before that normal job goes next.
    pub urgent_burst: u32,
    /// Finished jobs kept for [`Engine::recent_jobs`].
    pub history: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            workers: 4,
            max_concurrent_dumps: 1,
            disk_bytes_per_sec: None,
            disk_burst_bytes: 256 << 20,
            urgent_burst: 4,
            history: 4096,
        }
    }
}

/// Why an engine could not be made.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// [`Engine::new`] was called outside a tokio runtime.
    #[error("the checkpoint engine must be created inside a tokio runtime")]
    NoRuntime,
    /// A limit was zero.
    #[error("engine config: {0} must be at least 1")]
    BadConfig(&'static str),
}

type Slot = Option<Result<Finished, JobError>>;

/// Completion handle of a submitted job. Coalesced submissions get handles of the merged job.
#[derive(Debug, Clone)]
pub struct JobHandle {
    id: JobId,
    rx: watch::Receiver<Slot>,
}

impl JobHandle {
    /// The job's id (the merged job's id when the submission coalesced).
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The result if the job has finished.
    pub fn try_result(&self) -> Option<Result<Finished, JobError>> {
        self.rx.borrow().clone()
    }

    /// Wait until the job has finished (its restore point is published, or it failed).
    pub async fn wait(&self) -> Result<Finished, JobError> {
        let mut rx = self.rx.clone();
        let res = match rx.wait_for(Option::is_some).await {
            Ok(v) => match &*v {
                Some(r) => r.clone(),
                None => Err(JobError::EngineGone { job: self.id }),
            },
            Err(_) => Err(JobError::EngineGone { job: self.id }),
        };
        res
    }
}

/// Snapshot of the engine for `crab top`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Jobs in the normal queue.
    pub queued_normal: usize,
    /// Jobs in the urgent queue.
    pub queued_urgent: usize,
    /// Jobs running.
    pub running: usize,
    /// Process dumps running.
    pub running_dumps: usize,
    /// Background work (exports) holding the engine's background lane.
    #[serde(default)]
    pub background_running: usize,
    /// Background work waiting for the lane (behind urgent work or a dump).
    #[serde(default)]
    pub background_waiting: usize,
    /// Times background work paused for urgent work that arrived while it ran.
    #[serde(default)]
    pub background_yields: u64,
    /// Per sandbox: aggregates plus what it has queued and running now.
    pub sandboxes: Vec<SandboxView>,
}

/// One sandbox in [`EngineStats`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxView {
    /// Name.
    pub sandbox: String,
    /// Kind of its queued job, if any.
    pub queued: Option<CheckpointKind>,
    /// Whether the queued job is urgent.
    pub queued_urgent: bool,
    /// Kind of its running job, if any.
    pub running: Option<CheckpointKind>,
    /// Aggregates.
    pub stats: SandboxStats,
}

/// The host-wide checkpoint scheduler. Cheap to clone.
pub struct Engine<P: Changeset> {
    shared: Arc<Shared<P>>,
}

impl<P: Changeset> Clone for Engine<P> {
    fn clone(&self) -> Self {
        Engine { shared: self.shared.clone() }
    }
}

impl<P: Changeset> std::fmt::Debug for Engine<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("config", &self.shared.cfg).finish_non_exhaustive()
    }
}

struct Shared<P> {
    cfg: EngineConfig,
    exec: Arc<dyn ErasedExecutor<P>>,
    rt: tokio::runtime::Handle,
    state: Mutex<State<P>>,
    lane: Arc<Lane>,
}

struct Queued<P> {
    job: Job<P>,
    submitted: Instant,
    urgent: bool,
    tx: watch::Sender<Slot>,
}

struct Running {
    op: JobOp,
    sandbox: String,
    kind: CheckpointKind,
    first_turn: u64,
    turn: u64,
    submissions: u32,
    submitted: Instant,
    started: Instant,
    urgent: bool,
    tx: watch::Sender<Slot>,
}

struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.last = now;
    }

    /// Time until the bucket is out of debt.
    fn wait_time(&self) -> Duration {
        if self.tokens > 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((-self.tokens + 1.0) / self.rate)
        }
    }
}

struct State<P> {
    next_id: u64,
    queued: HashMap<JobId, Queued<P>>,
    normal: VecDeque<JobId>,
    urgent: VecDeque<JobId>,
    /// The queued checkpoint a new checkpoint of the sandbox may merge into (none once a
    /// restore is queued behind it).
    queued_by_sandbox: HashMap<String, JobId>,
    /// Queued jobs of each sandbox in submission order; only the front may start.
    order: HashMap<String, VecDeque<JobId>>,
    running: HashMap<JobId, Running>,
    busy: HashSet<String>,
    dumps: usize,
    streak: u32,
    bucket: Option<Bucket>,
    wake_pending: bool,
    metrics: Metrics,
}

enum Pick {
    Start(JobId),
    WaitBandwidth(Duration),
    Idle,
}

impl<P> State<P> {
    fn startable(&self, cfg: &EngineConfig, id: JobId, bw_ok: bool) -> bool {
        let Some(q) = self.queued.get(&id) else { return false };
        self.order.get(&q.job.sandbox).and_then(|o| o.front()) == Some(&id)
            && !self.busy.contains(&q.job.sandbox)
            && (!q.job.kind.dumps_processes() || self.dumps < cfg.max_concurrent_dumps)
            && (q.job.kind == CheckpointKind::Skip || bw_ok)
    }

    fn pick(&mut self, cfg: &EngineConfig, now: Instant) -> Pick {
        if self.running.len() >= cfg.workers {
            return Pick::Idle;
        }
        let bw_ok = match &mut self.bucket {
            Some(b) => {
                b.refill(now);
                b.tokens > 0.0
            }
            None => true,
        };
        let u = self.urgent.iter().position(|id| self.startable(cfg, *id, bw_ok));
        let n = self.normal.iter().position(|id| self.startable(cfg, *id, bw_ok));
        let id = match (u, n) {
            (Some(_), Some(n)) if self.streak >= cfg.urgent_burst => {
                self.streak = 0;
                self.metrics.starvation_breaks += 1;
                self.normal.remove(n)
            }
            (Some(u), Some(_)) => {
                self.streak += 1;
                self.urgent.remove(u)
            }
            (Some(u), None) => self.urgent.remove(u),
            (None, Some(n)) => {
                self.streak = 0;
                self.normal.remove(n)
            }
            (None, None) => {
                if !bw_ok {
                    let blocked = self.urgent.iter().chain(self.normal.iter()).any(|id| {
                        self.startable(cfg, *id, true)
                            && self
                                .queued
                                .get(id)
                                .is_some_and(|q| q.job.kind != CheckpointKind::Skip)
                    });
                    if blocked {
                        if let Some(b) = &self.bucket {
                            return Pick::WaitBandwidth(b.wait_time());
                        }
                    }
                }
                return Pick::Idle;
            }
        };
        match id {
            Some(id) => Pick::Start(id),
            None => Pick::Idle,
        }
    }
}

use crab_common::sync::lock;

impl<P: Changeset> Engine<P> {
    /// A new engine running jobs with `exec`. Must be called inside a tokio runtime, which it
    /// uses for its blocking workers and timers.
    pub fn new<X: Executor<P>>(cfg: EngineConfig, exec: Arc<X>) -> Result<Self, EngineError> {
        let exec: Arc<dyn ErasedExecutor<P>> = exec;
        let rt = tokio::runtime::Handle::try_current().map_err(|_| EngineError::NoRuntime)?;
        if cfg.workers == 0 {
            return Err(EngineError::BadConfig("workers"));
        }
        if cfg.max_concurrent_dumps == 0 {
            return Err(EngineError::BadConfig("max_concurrent_dumps"));
        }
        if cfg.disk_bytes_per_sec == Some(0) {
            return Err(EngineError::BadConfig("disk_bytes_per_sec"));
        }
        let bucket = cfg.disk_bytes_per_sec.map(|rate| Bucket {
            rate: rate as f64,
            burst: cfg.disk_burst_bytes.max(1) as f64,
            tokens: cfg.disk_burst_bytes.max(1) as f64,
            last: Instant::now(),
        });
        let state = State {
            next_id: 1,
            queued: HashMap::new(),
            normal: VecDeque::new(),
            urgent: VecDeque::new(),
            queued_by_sandbox: HashMap::new(),
            order: HashMap::new(),
            running: HashMap::new(),
            busy: HashSet::new(),
            dumps: 0,
            streak: 0,
            bucket,
            wake_pending: false,
            metrics: Metrics::default(),
        };
        Ok(Engine {
            shared: Arc::new(Shared { cfg, exec, rt, state: Mutex::new(state), lane: Lane::new() }),
        })
    }

    /// The engine's limits.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    /// Wait for the background lane: normal-priority host work that is not a sandbox's job
    /// (an export to the durable tier). It is granted to one task at a time, once no urgent
    /// job is queued or running and no process dump runs; the work then calls
    /// [`BackgroundPermit::yield_to_urgent`] between its steps. `what` is for the logs.
    pub async fn background(&self, what: &str) -> BackgroundPermit {
        self.shared.lane.acquire(what).await
    }

    /// Hold background work (exports) off while work the engine does not run but a caller
    /// waits for runs — a restore or fork from the remote store, a wake: the export pauses
    /// at its next step and goes on when the hold drops.
    pub fn hold_background(&self) -> crate::background::LaneHold {
        self.shared.lane.hold()
    }

    /// Queue a job. If the sandbox already has a queued job that has not started, the two merge
    /// and the returned handle is the merged job's.
    pub fn submit(&self, spec: JobSpec<P>) -> JobHandle {
        let handle = {
            let mut st = lock(&self.shared.state);
            let coalesce_into = match spec.op {
                JobOp::Checkpoint => st.queued_by_sandbox.get(&spec.sandbox).copied(),
                JobOp::Restore => None,
            };
            st.metrics.on_submit(&spec.sandbox, spec.op, spec.kind, coalesce_into.is_some());
            match coalesce_into.and_then(|id| st.queued.get_mut(&id).map(|q| (id, q))) {
                Some((id, q)) => {
                    q.job.kind = q.job.kind.merge(spec.kind);
                    q.job.payload.merge(spec.payload);
                    q.job.first_turn = q.job.first_turn.min(spec.turn);
                    q.job.turn = q.job.turn.max(spec.turn);
                    q.job.submissions += 1;
                    let promote = spec.urgent && !q.urgent;
                    let rx = q.tx.subscribe();
                    tracing::debug!(job = %id, sandbox = %spec.sandbox, kind = %q.job.kind, turn = q.job.turn, "coalesced checkpoint job");
                    if promote {
                        promote_locked(&mut st, id);
                    }
                    JobHandle { id, rx }
                }
                None => {
                    let id = JobId(st.next_id);
                    st.next_id += 1;
                    let (tx, rx) = watch::channel(None);
                    let job = Job {
                        id,
                        op: spec.op,
                        sandbox: spec.sandbox.clone(),
                        kind: spec.kind,
                        payload: spec.payload,
                        first_turn: spec.turn,
                        turn: spec.turn,
                        submissions: 1,
                    };
                    st.queued.insert(
                        id,
                        Queued { job, submitted: Instant::now(), urgent: spec.urgent, tx },
                    );
                    st.order.entry(spec.sandbox.clone()).or_default().push_back(id);
                    match spec.op {
                        JobOp::Checkpoint => {
                            st.queued_by_sandbox.insert(spec.sandbox, id);
                        }
                        JobOp::Restore => {
                            st.queued_by_sandbox.remove(&spec.sandbox);
                        }
                    }
                    if spec.urgent {
                        // Jobs of the sandbox queued before it must run first: promote them too.
                        promote_locked(&mut st, id);
                        st.urgent.push_back(id);
                    } else {
                        st.normal.push_back(id);
                    }
                    JobHandle { id, rx }
                }
            }
        };
        pump(&self.shared);
        handle
    }

    /// Move a queued job to the urgent queue (its agent's response is waiting). Returns whether
    /// the job is still known (queued or running); promoting a running or urgent job is a no-op.
    pub fn promote(&self, id: JobId) -> bool {
        let known = {
            let mut st = lock(&self.shared.state);
            if st.queued.contains_key(&id) {
                promote_locked(&mut st, id);
                true
            } else if let Some(r) = st.running.get_mut(&id) {
                r.urgent = true;
                true
            } else {
                false
            }
        };
        pump(&self.shared);
        known
    }

    /// Record how long a response was held waiting on job `id` (the exposed latency).
    pub fn record_exposed(&self, id: JobId, sandbox: &str, held: Duration) {
        lock(&self.shared.state).metrics.on_exposed(id, sandbox, held);
    }

    /// Recently finished jobs, oldest first (at most `n`).
    pub fn recent_jobs(&self, n: usize) -> Vec<JobRecord> {
        let st = lock(&self.shared.state);
        let skip = st.metrics.recent.len().saturating_sub(n);
        st.metrics.recent.iter().skip(skip).cloned().collect()
    }

    /// Process dumps running now (what crowds a restore beside them: their writes, hashing
    /// and `syncfs` on the same pool and cores).
    pub fn running_dumps(&self) -> usize {
        lock(&self.shared.state).dumps
    }

    /// A snapshot for `crab top`.
    pub fn stats(&self) -> EngineStats {
        let st = lock(&self.shared.state);
        let mut sandboxes: Vec<SandboxView> = st
            .metrics
            .sandboxes
            .iter()
            .map(|(name, s)| {
                let q = st.queued_by_sandbox.get(name).and_then(|id| st.queued.get(id));
                SandboxView {
                    sandbox: name.clone(),
                    queued: q.map(|q| q.job.kind),
                    queued_urgent: q.is_some_and(|q| q.urgent),
                    running: st.running.values().find(|r| &r.sandbox == name).map(|r| r.kind),
                    stats: s.clone(),
                }
            })
            .collect();
        sandboxes.sort_by(|a, b| a.sandbox.cmp(&b.sandbox));
        let lane = self.shared.lane.stats();
        EngineStats {
            queued_normal: st.normal.len(),
            queued_urgent: st.urgent.len(),
            running: st.running.len(),
            running_dumps: st.dumps,
            background_running: lane.running,
            background_waiting: lane.waiting,
            background_yields: lane.yields,
            sandboxes,
        }
    }

    /// Prometheus text exposition of the engine's counters, histograms and gauges.
    pub fn metrics_text(&self) -> String {
        let st = lock(&self.shared.state);
        let mut out = String::new();
        st.metrics.render(&mut out);
        gauge(
            &mut out,
            "crab_engine_queue_normal",
            "Jobs in the normal queue.",
            st.normal.len() as u64,
        );
        gauge(
            &mut out,
            "crab_engine_queue_urgent",
            "Jobs in the urgent queue.",
            st.urgent.len() as u64,
        );
        gauge(&mut out, "crab_engine_running", "Jobs running.", st.running.len() as u64);
        gauge(&mut out, "crab_engine_running_dumps", "Process dumps running.", st.dumps as u64);
        let lane = self.shared.lane.stats();
        gauge(
            &mut out,
            "crab_engine_background_running",
            "Background work (exports) holding the background lane.",
            lane.running as u64,
        );
        gauge(
            &mut out,
            "crab_engine_background_waiting",
            "Background work waiting behind urgent work or a dump.",
            lane.waiting as u64,
        );
        let _ = writeln!(
            out,
            "# HELP crab_engine_background_yields_total Pauses of background work for urgent work.\n# TYPE crab_engine_background_yields_total counter\ncrab_engine_background_yields_total {}\n# HELP crab_engine_background_granted_total Background lane grants.\n# TYPE crab_engine_background_granted_total counter\ncrab_engine_background_granted_total {}",
            lane.yields, lane.granted
        );
        if let Some(b) = &st.bucket {
            let _ = writeln!(
                out,
                "# HELP crab_engine_disk_tokens_bytes Disk bandwidth tokens left (negative: in debt).\n# TYPE crab_engine_disk_tokens_bytes gauge\ncrab_engine_disk_tokens_bytes {}",
                b.tokens
            );
        }
        out
    }
}

fn promote_locked<P>(st: &mut State<P>, id: JobId) {
    let Some(sandbox) = st.queued.get(&id).map(|q| q.job.sandbox.clone()) else { return };
    // Promote the job and every job of its sandbox queued before it (they must run first).
    let ahead: Vec<JobId> = st
        .order
        .get(&sandbox)
        .map(|o| {
            let n = o.iter().position(|x| *x == id).map_or(0, |p| p + 1);
            o.iter().take(n).copied().collect()
        })
        .unwrap_or_default();
    for jid in ahead {
        let Some(q) = st.queued.get_mut(&jid) else { continue };
        if q.urgent {
            continue;
        }
        q.urgent = true;
        st.normal.retain(|x| *x != jid);
        st.urgent.push_back(jid);
        st.metrics.promotions += 1;
        tracing::debug!(job = %jid, "promoted job to urgent");
    }
}

/// Start whatever may start now.
fn pump<P: Changeset>(shared: &Arc<Shared<P>>) {
    let mut st = lock(&shared.state);
    loop {
        match st.pick(&shared.cfg, Instant::now()) {
            Pick::Start(id) => start(shared, &mut st, id),
            Pick::WaitBandwidth(d) => {
                if !st.wake_pending {
                    st.wake_pending = true;
                    let sh = shared.clone();
                    shared.rt.spawn(async move {
                        tokio::time::sleep(d).await;
                        lock(&sh.state).wake_pending = false;
                        pump(&sh);
                    });
                }
                break;
            }
            Pick::Idle => break,
        }
    }
    let busy = !st.urgent.is_empty() || st.dumps > 0 || st.running.values().any(|r| r.urgent);
    shared.lane.publish(busy);
}

fn start<P: Changeset>(shared: &Arc<Shared<P>>, st: &mut State<P>, id: JobId) {
    let Some(q) = st.queued.remove(&id) else { return };
    if st.queued_by_sandbox.get(&q.job.sandbox) == Some(&id) {
        st.queued_by_sandbox.remove(&q.job.sandbox);
    }
    if let Some(o) = st.order.get_mut(&q.job.sandbox) {
        o.retain(|x| *x != id);
        if o.is_empty() {
            st.order.remove(&q.job.sandbox);
        }
    }
    let job = q.job;
    st.busy.insert(job.sandbox.clone());
    if job.kind.dumps_processes() {
        st.dumps += 1;
    }
    st.running.insert(
        id,
        Running {
            op: job.op,
            sandbox: job.sandbox.clone(),
            kind: job.kind,
            first_turn: job.first_turn,
            turn: job.turn,
            submissions: job.submissions,
            submitted: q.submitted,
            started: Instant::now(),
            urgent: q.urgent,
            tx: q.tx,
        },
    );
    tracing::debug!(job = %id, sandbox = %job.sandbox, kind = %job.kind, turn = job.turn, "starting checkpoint job");
    let sh = shared.clone();
    shared.rt.spawn_blocking(move || {
        let exec = sh.exec.clone();
        let res = std::panic::catch_unwind(AssertUnwindSafe(|| ErasedExecutor::run(&*exec, &job)));
        finish(&sh, id, res);
    });
}

fn finish<P: Changeset>(
    shared: &Arc<Shared<P>>,
    id: JobId,
    res: std::thread::Result<Result<crate::JobOutcome, ExecError>>,
) {
    {
        let mut st = lock(&shared.state);
        let Some(r) = st.running.remove(&id) else { return };
        st.busy.remove(&r.sandbox);
        if r.kind.dumps_processes() {
            st.dumps = st.dumps.saturating_sub(1);
        }
        let now = Instant::now();
        let queue_wait = r.started.saturating_duration_since(r.submitted);
        let run_time = now.saturating_duration_since(r.started);
        let result = match res {
            Ok(Ok(outcome)) => Ok(Finished {
                job: id,
                op: r.op,
                sandbox: r.sandbox.clone(),
                kind: r.kind,
                turn: r.turn,
                outcome,
                queue_wait,
                run_time,
                started_at: Some(r.started),
                finished_at: Some(now),
            }),
            Ok(Err(source)) => Err(JobError::Failed {
                job: id,
                op: r.op,
                sandbox: r.sandbox.clone(),
                kind: r.kind,
                turn: r.turn,
                message: source.to_string(),
                source,
            }),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_string());
                Err(JobError::Panicked { job: id, sandbox: r.sandbox.clone(), message })
            }
        };
        let bytes = result.as_ref().map(|f| f.outcome.bytes).unwrap_or(0);
        if let Some(b) = &mut st.bucket {
            b.refill(now);
            b.tokens -= bytes as f64;
        }
        if let Err(e) = &result {
            tracing::warn!(error = %e, "engine job failed");
        }
        let rec = JobRecord {
            job: id,
            op: r.op,
            sandbox: r.sandbox.clone(),
            kind: r.kind,
            first_turn: r.first_turn,
            turn: r.turn,
            submissions: r.submissions,
            urgent: r.urgent,
            queue_wait_ms: queue_wait.as_secs_f64() * 1e3,
            run_ms: run_time.as_secs_f64() * 1e3,
            bytes,
            exposed_ms: None,
            error: result.as_ref().err().map(|e| e.to_string()),
        };
        let history = shared.cfg.history;
        st.metrics.on_finish(rec, history);
        r.tx.send_replace(Some(result));
    }
    pump(shared);
}
