//! The host's lifecycle actions — the one owner of a sandbox's life. Each reads the sandbox's
//! recorded [`Life`] and its init's liveness, asks the transition check
//! (`crab_common::life::Status::can_*`), does the step, and records the new life, under the
//! sandbox's lifecycle lock so two steps on one sandbox never interleave: stop, start, pause,
//! resume, retire, kill (retire when labelled points must outlive it, else remove), the labels
//! of restore points (E2B's snapshots), and the one deadline watchdog (`on_deadline: pause |
//! kill`). Front doors translate into these; none keeps a state of its own.

use std::sync::Arc;
use std::time::Duration;

use crab_common::api::{BranchSettings, LabelDeleted, LabelledPoint, SandboxState, SandboxStatus};
use crab_common::clock::now_ms;
use crab_common::life::{Deadline, Life, OnDeadline, Status, TimeoutSet};
use crab_common::sync::lock;
use crab_common::{CheckpointKind, ErrorCode};

use crate::host::blocking;
use crate::parking::Decline;
use crate::{Action, Host, HostError, Lifecycle, Outcome};

/// How often the deadline watchdog looks (deadlines fire within this of their time).
pub const WATCHDOG_PERIOD: Duration = Duration::from_secs(1);

/// The longest a label may be, in bytes.
const MAX_LABEL: usize = 200;

/// The label that keeps a sandbox from ever being parked by the engine (`crab.park=never`;
/// `crab sandbox create --no-park` sets it).
pub const NO_PARK_LABEL: &str = "crab.park";

fn conflict(e: crab_common::ApiError) -> HostError {
    HostError(e)
}

/// A label usable as an E2B snapshot id or name: printable ASCII without spaces, 1..=200 bytes.
fn check_label(l: &str) -> Result<(), HostError> {
    if l.is_empty() || l.len() > MAX_LABEL || !l.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(HostError::invalid(
            format!("invalid label {l:?}"),
            format!("a label is 1..={MAX_LABEL} printable ASCII characters without spaces"),
        ));
    }
    Ok(())
}

/// A sandbox's life as an older front door kept it, handed to [`Host::adopt`] once (the
/// E2B front door's `<state>/e2b/` files of format ≤ 2).
#[derive(Debug, Clone, Default)]
pub struct Adopted {
    /// Its life (`running`, `paused` with its point, `retired`).
    pub life: Life,
    /// Labels (E2B metadata).
    pub labels: std::collections::BTreeMap<String, String>,
    /// Environment.
    pub env: std::collections::BTreeMap<String, String>,
    /// What it was made from.
    pub template: Option<String>,
    /// Its deadline, ms since the epoch.
    pub deadline_ms: Option<u64>,
    /// What its deadline does.
    pub on_deadline: OnDeadline,
    /// Labelled points (point id → labels); points that are gone are dropped.
    pub point_labels: std::collections::BTreeMap<String, Vec<String>>,
}

impl Host {
    /// Take over a sandbox's life as an older front door recorded it (a state-directory
    /// migration, run once at start before any front door serves): the record gets its life,
    /// labels, environment, template, deadline and labelled points.
    pub async fn adopt(self: &Arc<Self>, name: String, a: Adopted) -> Result<(), HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let h = self.clone();
        blocking(move || {
            let store = h.checkpointer().store(&name)?;
            let points: std::collections::BTreeMap<String, Vec<String>> = a
                .point_labels
                .into_iter()
                .filter(|(p, _)| store.resolve(Some(p)).is_ok())
                .collect();
            let life = match a.life {
                Life::Paused { point } if store.resolve(Some(&point)).is_err() => Life::Stopped,
                l => l,
            };
            h.runtime().edit(&name, |r| {
                r.life = life;
                r.labels = a.labels;
                r.env = a.env;
                r.template = a.template;
                r.deadline_ms = a.deadline_ms;
                r.on_deadline = a.on_deadline;
                for (p, ls) in points {
                    let mine = r.point_labels.entry(p).or_default();
                    for l in ls {
                        if !mine.contains(&l) {
                            mine.push(l);
                        }
                    }
                }
            })?;
            Ok(())
        })
        .await
    }

    /// The lock that serializes lifecycle steps on sandbox `name`.
    pub(crate) fn life_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.life_locks).entry(name.to_string()).or_default().clone()
    }

    /// Forget `name`'s lifecycle lock (it was removed).
    pub(crate) fn drop_life_lock(&self, name: &str) {
        lock(&self.life_locks).remove(name);
    }

    /// `name`'s recorded life and whether its init lives (one record, one `/proc` stat).
    pub(crate) fn status_of(&self, name: &str) -> Result<(Life, bool), HostError> {
        Ok(self.runtime().status(name)?)
    }

    /// Record `life` for `name`. A deadline belongs to a run: one that is not running has
    /// none (what its deadlines do stays); one brought back whose deadline passed meanwhile
    /// loses it (a caller giving a new timeout sets it after).
    pub(crate) fn set_life(&self, name: &str, life: Life) -> Result<(), HostError> {
        let now = now_ms();
        self.runtime().edit(name, |r| {
            if life != Life::Running || r.deadline_ms.is_some_and(|d| d <= now) {
                r.deadline_ms = None;
            }
            r.life = life;
        })?;
        Ok(())
    }

    /// [`Action::Status`].
    pub(crate) fn status(&self, name: String) -> Result<Outcome, HostError> {
        let (life, alive) = self.status_of(&name)?;
        let state = Status { life: &life, alive }.state();
        Ok(Outcome::Status(SandboxStatus { name, state }))
    }

    /// [`Action::Stop`]: a point of what it holds (with `checkpoint`), then every process
    /// killed; its life is `stopped`. A sandbox not running is recorded stopped (a paused
    /// one's pause point stays an ordinary point).
    pub(crate) async fn stop(
        self: &Arc<Self>,
        name: String,
        checkpoint: bool,
    ) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let (life, alive) = self.status_of(&name)?;
        if !alive {
            if matches!(life, Life::Running | Life::Paused { .. } | Life::Parked { .. }) {
                self.set_life(&name, Life::Stopped)?;
            }
            let state = Status { life: &self.status_of(&name)?.0, alive }.state();
            return Ok(Outcome::Lifecycle(Lifecycle { sandbox: name, point: None, state }));
        }
        let point = if checkpoint {
            match self.checkpoint(name.clone(), None, None, None).await? {
                Outcome::Taken(t) => Some(t.point.id),
                _ => None,
            }
        } else {
            None
        };
        self.halt(&name).await?;
        self.set_life(&name, Life::Stopped)?;
        tracing::info!(sandbox = %name, point = ?point, "sandbox stopped");
        Ok(Outcome::Lifecycle(Lifecycle { sandbox: name, point, state: SandboxState::Stopped }))
    }

    /// Kill every process of `name` (inspector and in-sandbox proxy detached first).
    async fn halt(self: &Arc<Self>, name: &str) -> Result<(), HostError> {
        self.detach(name);
        self.close_sandbox_proxy(name).await;
        let rt = self.runtime().clone();
        let n = name.to_string();
        blocking(move || Ok(rt.stop(&n)?)).await?;
        self.policy().clear(name);
        Ok(())
    }

    /// [`Action::Retire`]: every process killed, no checkpoint; its life is `retired` (`why`).
    pub(crate) async fn retire(
        self: &Arc<Self>,
        name: String,
        why: String,
    ) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        self.retire_locked(&name, why).await?;
        Ok(Outcome::Lifecycle(Lifecycle {
            sandbox: name,
            point: None,
            state: SandboxState::Retired,
        }))
    }

    async fn retire_locked(self: &Arc<Self>, name: &str, why: String) -> Result<(), HostError> {
        let (life, alive) = self.status_of(name)?;
        if !(Status { life: &life, alive }).can_retire() {
            return Ok(());
        }
        self.halt(name).await?;
        self.set_life(name, Life::Retired { why })?;
        tracing::info!(sandbox = %name, "sandbox stopped and kept for its restore points");
        Ok(())
    }

    /// [`Action::Start`]: [`Action::Resume`] with `ensure` (a running sandbox is left alone).
    pub(crate) async fn start(self: &Arc<Self>, name: String) -> Result<Outcome, HostError> {
        self.resume(name, true, None).await
    }

    /// [`Action::Pause`].
    pub(crate) async fn pause(self: &Arc<Self>, name: String) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let (life, alive) = self.status_of(&name)?;
        Status { life: &life, alive }.can_pause(&name).map_err(conflict)?;
        if let (Life::Parked { point }, false) = (&life, alive) {
            let point = point.clone();
            self.set_life(&name, Life::Paused { point: point.clone() })?;
            return Ok(Outcome::Lifecycle(Lifecycle {
                sandbox: name,
                point: Some(point),
                state: SandboxState::Paused,
            }));
        }
        let taken = self.checkpoint(name.clone(), Some(CheckpointKind::Full), None, None).await?;
        // Stopping processes that the point does not hold would lose them: refuse instead.
        let point = crate::host::full_point(&taken, "pause")?;
        self.halt(&name).await?;
        self.set_life(&name, Life::Paused { point: point.clone() })?;
        tracing::info!(sandbox = %name, %point, "paused");
        Ok(Outcome::Lifecycle(Lifecycle {
            sandbox: name,
            point: Some(point),
            state: SandboxState::Paused,
        }))
    }

    /// [`Action::Resume`] (and [`Action::Start`]).
    pub(crate) async fn resume(
        self: &Arc<Self>,
        name: String,
        ensure: bool,
        timeout: Option<TimeoutSet>,
    ) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let (life, alive) = self.status_of(&name)?;
        if let (Life::Parked { .. }, false) = (&life, alive) {
            // Resuming a parked sandbox is waking it: its conversation stays as it is.
            let point = self.wake_locked(&name).await?;
            if let Some(t) = timeout {
                self.set_deadline(&name, t)?;
            }
            let state = SandboxState::Running;
            return Ok(Outcome::Lifecycle(Lifecycle { sandbox: name, point, state }));
        }
        let todo = Status { life: &life, alive }.can_resume(&name, ensure).map_err(conflict)?;
        let point = if todo {
            let from = match &life {
                Life::Paused { point } | Life::Parked { point } => Some(point.clone()),
                _ => None,
            };
            match self.restore(name.clone(), from, Arc::new(crab_common::NoProgress)).await? {
                Outcome::Restored(r) => Some(r.point),
                _ => None,
            }
        } else {
            None
        };
        if let Some(t) = timeout {
            self.set_deadline(&name, t)?;
        }
        if todo {
            tracing::info!(sandbox = %name, point = ?point, "resumed");
        }
        Ok(Outcome::Lifecycle(Lifecycle { sandbox: name, point, state: SandboxState::Running }))
    }

    /// [`Action::Park`]: every process of a running sandbox stopped (its memory freed) after
    /// a restore point that holds them — `point` when the caller has one taken with nothing run
    /// since (the engine at a turn boundary), else a `full` point now — and its life `parked`
    /// with that point. Parking a parked sandbox answers its park point.
    ///
    /// With `idle_only` (the policy) it refuses while a client is connected; by hand it cuts
    /// them off. Either way a call that needs the sandbox running and comes while the park is
    /// in progress waits for it, then wakes the sandbox ([`Host::ensure_awake`]).
    pub(crate) async fn park(
        self: &Arc<Self>,
        name: String,
        point: Option<String>,
        idle_only: bool,
    ) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let (life, alive) = self.status_of(&name)?;
        if let (Life::Parked { point }, false) = (&life, alive) {
            let point = Some(point.clone());
            return Ok(Outcome::Lifecycle(Lifecycle {
                sandbox: name,
                point,
                state: SandboxState::Parked,
            }));
        }
        Status { life: &life, alive }.can_exec(&name, "park").map_err(conflict)?;
        let _parking = self.clients.begin_park(&name, idle_only).map_err(|n| {
            conflict(crab_common::ApiError::new(
                crab_common::ErrorCode::Conflict,
                format!("{name} has {n} client(s) connected (a command's stream, an attached session, a followed output)"),
                "park it once they are done, or by hand: `crab sandbox park` cuts them off",
            ))
        })?;
        let point = match point {
            Some(p) => p,
            None => {
                let taken =
                    self.checkpoint(name.clone(), Some(CheckpointKind::Full), None, None).await?;
                // Stopping processes that the point does not hold would lose them.
                crate::host::full_point(&taken, "park")?
            }
        };
        let rt = self.runtime().clone();
        let n = name.clone();
        let held = blocking(move || Ok(rt.cgroup(&n).memory_bytes().unwrap_or(0))).await?;
        self.halt(&name).await?;
        self.set_life(&name, Life::Parked { point: point.clone() })?;
        // Counted here, where it parks (parking a parked sandbox answers above, uncounted).
        self.parking.parked(&name, held);
        tracing::info!(sandbox = %name, %point, "parked");
        self.verify_while_parked(&name, &point);
        Ok(Outcome::Lifecycle(Lifecycle {
            sandbox: name,
            point: Some(point),
            state: SandboxState::Parked,
        }))
    }

    /// Hash the images of the point `name` is parked at once they have settled, while it sits
    /// parked: its wake then finds them verified (`Store::verify` remembers the hash of a file
    /// that had settled when it was hashed) instead of hashing a fresh dump's images in front
    /// of its answer. Nothing depends on it: a wake that comes first verifies as before, and a
    /// point that fails here fails its wake, which reports it.
    fn verify_while_parked(self: &Arc<Self>, name: &str, point: &str) {
        let (h, n, p) = (self.clone(), name.to_string(), point.to_string());
        tokio::spawn(async move {
            let settle = crab_checkpoint::store::SETTLED + Duration::from_millis(50);
            tokio::time::sleep(settle).await;
            if h.parked_at(&n).as_deref() != Some(p.as_str()) {
                return;
            }
            let t = std::time::Instant::now();
            let (h2, n2, p2) = (h.clone(), n.clone(), p.clone());
            let r = blocking(move || {
                let store = h2.checkpointer().store(&n2)?;
                let m = store.resolve(Some(&p2))?;
                Ok(store.verify(&m)?)
            })
            .await;
            match r {
                Ok(()) => {
                    tracing::debug!(sandbox = %n, point = %p, ms = t.elapsed().as_secs_f64() * 1e3, "parked point verified ahead of its wake")
                }
                Err(e) => {
                    tracing::info!(sandbox = %n, point = %p, error = %e.0.message, "parked point did not verify; its wake will say why")
                }
            }
        });
    }

    /// The point `name` is parked at, if it is parked.
    pub(crate) fn parked_at(&self, name: &str) -> Option<String> {
        match self.runtime().record(name).ok()?.life {
            Life::Parked { point } => Some(point),
            _ => None,
        }
    }

    /// Whether `name` is recorded parked (the in-memory record).
    pub(crate) fn is_parked(&self, name: &str) -> bool {
        self.runtime().record(name).is_ok_and(|r| matches!(r.life, Life::Parked { .. }))
    }

    /// Whether `name`'s user asked that it never park (label `crab.park=never`).
    pub(crate) fn never_parks(&self, name: &str) -> bool {
        self.runtime()
            .record(name)
            .is_ok_and(|r| r.labels.get(NO_PARK_LABEL).is_some_and(|v| v == "never"))
    }

    /// The turn-boundary decision (`crab daemon --memory-budget`), once the turn's point
    /// `point` of `name` is published and its agent waits for the LLM: park when the running
    /// sandboxes' memory exceeds the budget and this sandbox's expected wait (its own history)
    /// exceeds the expected wake cost by the policy's margin, and no client is connected to it
    /// (a running command's stream, a followed output) — from `point` when that holds its
    /// processes, else after a full dump when the wait pays for that too. Never fails: a park
    /// that does not happen leaves the sandbox running, as it was.
    pub(crate) async fn maybe_park(
        self: &Arc<Self>,
        name: &str,
        point: &str,
        started: std::time::Instant,
        streams: bool,
    ) {
        let Some(pol) = self.park_policy.clone() else {
            return;
        };
        // The wake's timing takes the cost a wake can be expected to take; whether parking
        // pays, what a wake costs at least (a crowded first turn's slow wakes would stop all
        // parking, and with it the measuring of new wakes).
        // Of wakes that ran as this one will: beside a process dump, while one runs now.
        let crowded = self.engine().running_dumps() > 0;
        let cost = self.parking.wake_cost_ms(name, crowded);
        let floor = self.parking.wake_cost_floor_ms(name, crowded);
        // A streamed answer's head comes early enough to wake from when its answers (this
        // sandbox's, else the host's) go on long enough after it: nine in ten outlast the
        // wake cost by `HEAD_LEAD_MARGIN`.
        let known = self.parking.answer_lead_ms(name);
        let expected = self.parking.expected_wait_ms(name);
        // Nothing known yet on this host (its first answers): a streamed answer's head wakes
        // it all the same, and its end waits for the wake, which delays it only when the
        // answer is shorter than a wake — if its point holds its processes (no dump to pay).
        let cold = streams && known.is_none() && expected.is_none();
        let lead = known
            .filter(|&lead| streams && lead >= crate::parking::HEAD_LEAD_MARGIN * cost)
            .or(cold.then_some(0.0));
        if expected.is_none() && lead.is_none() {
            self.parking.declined(Decline::NoHistory);
            return;
        }
        // How long it can be expected to stay parked: from now (the turn's checkpoint took
        // its share of the wait: a first turn's full dump, six at once, can take most of it)
        // until its wake, twice the wake cost before the expected wait's end — or, left to
        // the head, that much before the lead's.
        let wait = expected.unwrap_or(0.0) + lead.unwrap_or(0.0);
        let parked_ms = wait - 2.0 * cost - started.elapsed().as_secs_f64() * 1e3;
        if !cold && parked_ms < pol.margin * floor {
            self.parking.declined(Decline::WaitTooShort);
            return;
        }
        let rt = self.runtime().clone();
        let in_use = blocking(move || {
            Ok(rt.names().iter().map(|n| rt.cgroup(n).memory_bytes().unwrap_or(0)).sum::<u64>())
        })
        .await
        .unwrap_or(0);
        if in_use <= pol.budget_bytes {
            self.parking.declined(Decline::UnderBudget);
            return;
        }
        // Checked again, atomically with marking the park in progress, by `park` itself.
        let clients = self.clients.count(name);
        if clients > 0 {
            tracing::info!(sandbox = %name, clients, "not parked: clients are connected to it");
            self.parking.declined(Decline::Clients);
            return;
        }
        let holds = self
            .checkpointer()
            .store(name)
            .ok()
            .and_then(|s| s.resolve(Some(point)).ok())
            .is_some_and(|m| m.procs.is_some() && m.procs_missing.is_none());
        let from = if holds {
            Some(point.to_string())
        } else if !cold && parked_ms >= pol.margin * (floor + crate::parking::DUMP_MS) {
            None
        } else {
            self.parking.declined(Decline::DumpNotWorthIt);
            return;
        };
        let parked_at = match self.park(name.to_string(), from, true).await {
            Ok(Outcome::Lifecycle(l)) => {
                tracing::info!(sandbox = %name, expected_wait_ms = wait, wake_ms = cost, wake_floor_ms = floor, in_use, "parked at the turn boundary");
                l.point
            }
            Ok(_) => None,
            Err(e) => {
                tracing::info!(sandbox = %name, error = %e, "not parked");
                self.parking.declined(Decline::ParkFailed);
                return;
            }
        };
        // An answer that streams on long enough after its head: its head and body go out,
        // its end waits for the wake, which the head times (`ParkTicket::head_released`) — it
        // stays parked until the model is nearly done writing.
        if parked_at.is_some() && lead.is_some() {
            self.parking.head_parked();
            return;
        }
        // Else wake it ahead of the answer: by the expected wait (three in four answers come
        // later) less twice the wake cost, it is back before the agent can notice; an answer
        // that comes sooner wakes it itself.
        let ahead = std::time::Duration::from_secs_f64((wait - 2.0 * cost).max(0.0) / 1e3);
        self.wake_later(name, parked_at, started + ahead, true);
    }

    /// Wake `name` at `when` if it is still parked at `at` then (not woken by its answer or a
    /// call meanwhile, nor parked again at a later turn): a wake `ahead` of the answer (counted
    /// as one), else one timed from a streamed answer's head.
    pub(crate) fn wake_later(
        self: &Arc<Self>,
        name: &str,
        at: Option<String>,
        when: std::time::Instant,
        ahead: bool,
    ) {
        let (h, n) = (self.clone(), name.to_string());
        tokio::spawn(async move {
            tokio::time::sleep_until(when.into()).await;
            if at.is_none() || h.parked_at(&n) != at {
                return;
            }
            if ahead {
                h.parking.prewoke();
            }
            if let Err(e) = h.ensure_awake(&n).await {
                let what =
                    if ahead { "ahead of the answer" } else { "timed from the answer's head" };
                tracing::warn!(sandbox = %n, error = %e, "the wake {what} failed");
            }
        });
    }

    /// How many sandboxes are parked now (in-memory records).
    pub(crate) fn parked_count(&self) -> usize {
        let rt = self.runtime();
        rt.names()
            .iter()
            .filter(|n| rt.record(n).is_ok_and(|r| matches!(r.life, Life::Parked { .. })))
            .count()
    }

    /// The parking counters.
    pub(crate) fn parking(&self) -> &crate::parking::Parking {
        &self.parking
    }

    /// [`Action::Wake`]: a parked sandbox back from its park point, in place, its
    /// conversation kept (its agent carries on); any other is left as it is. Answers the
    /// point it woke from, if it woke.
    pub(crate) async fn wake(self: &Arc<Self>, name: String) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let point = self.wake_locked(&name).await?;
        let (life, alive) = self.status_of(&name)?;
        let state = Status { life: &life, alive }.state();
        Ok(Outcome::Lifecycle(Lifecycle { sandbox: name, point, state }))
    }

    /// Wake `name` if it is parked, before an action that needs it running: cheap when it is
    /// not (the in-memory record). The caller waits for the restore; it never sees the
    /// sandbox parked.
    ///
    /// A park in progress (its halt may be under way) is waited for through the lifecycle
    /// lock it holds, then woken from: the caller holds a [`crate::parking::Client`] from
    /// before this check, so a park that began after it saw the client (and, from the policy,
    /// refused) — never both missed.
    pub(crate) async fn ensure_awake(self: &Arc<Self>, name: &str) -> Result<(), HostError> {
        let parked =
            self.runtime().record(name).is_ok_and(|r| matches!(r.life, Life::Parked { .. }));
        if !parked && !self.clients.parking(name) {
            return Ok(());
        }
        let l = self.life_lock(name);
        let _g = l.lock().await;
        self.wake_locked(name).await.map(|_| ())
    }

    /// The wake itself, under `name`'s lifecycle lock. A restore that fails leaves the
    /// sandbox stopped (never half-restored: the checkpointer rolls its own work back) and
    /// says so, naming the point.
    async fn wake_locked(self: &Arc<Self>, name: &str) -> Result<Option<String>, HostError> {
        let (life, alive) = self.status_of(name)?;
        let Life::Parked { point } = life else {
            return Ok(None);
        };
        if alive {
            // Brought back through another door meanwhile.
            self.set_life(name, Life::Running)?;
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        let crowded = self.engine().running_dumps() > 0;
        let r = self
            .restore_in_place(
                name.to_string(),
                Some(point.clone()),
                Arc::new(crab_common::NoProgress),
                false,
            )
            .await;
        match r {
            Ok(_) => {
                let crowded = crowded || self.engine().running_dumps() > 0;
                self.parking().woke(name, t0.elapsed(), crowded);
                tracing::info!(sandbox = %name, %point, ms = t0.elapsed().as_secs_f64() * 1e3, "woke");
                Ok(Some(point))
            }
            Err(e) => {
                self.parking().wake_failed(name);
                if let Err(e2) = self.set_life(name, Life::Stopped) {
                    tracing::warn!(sandbox = %name, error = %e2, "could not record the failed wake");
                }
                let mut api = e.into_api();
                api.message = format!(
                    "waking parked sandbox {name} from its point {point} failed, so it is stopped: {}",
                    api.message
                );
                if api.hint.is_empty() {
                    api.hint = format!(
                        "restore it from another point (`crab checkpoints {name}`, `crab restore {name} --checkpoint ID`) or remove it"
                    );
                }
                Err(HostError(api))
            }
        }
    }

    /// [`Action::Kill`].
    pub(crate) async fn kill(self: &Arc<Self>, name: String) -> Result<Outcome, HostError> {
        let l = self.life_lock(&name);
        let g = l.lock().await;
        let labelled = !self.runtime().record(&name)?.point_labels.is_empty();
        if labelled {
            let why = "killed while it holds labelled restore points (E2B snapshots); deleting \
                       its last one (Sandbox.delete_snapshot, DELETE /v1/labels/LABEL) removes it"
                .to_string();
            self.retire_locked(&name, why).await?;
            return Ok(Outcome::Lifecycle(Lifecycle {
                sandbox: name,
                point: None,
                state: SandboxState::Retired,
            }));
        }
        drop(g);
        self.remove(name, true).await
    }

    /// Apply a deadline change to `name` (a running sandbox's; others have none).
    pub(crate) fn set_deadline(&self, name: &str, t: TimeoutSet) -> Result<(), HostError> {
        let now = now_ms();
        let mut err = None;
        self.runtime().edit(name, |r| match t.apply(r.deadline_ms, now) {
            Ok(d) => {
                r.deadline_ms = d;
                if let Some(on) = t.on {
                    r.on_deadline = on;
                }
            }
            Err(e) => err = Some(e),
        })?;
        match err {
            Some(e) => Err(HostError(e)),
            None => Ok(()),
        }
    }

    /// Give branches just made their settings (labels, environment, template, deadline).
    pub(crate) fn settle_branches(
        &self,
        names: &[String],
        s: &BranchSettings,
    ) -> Result<(), HostError> {
        if s.is_empty() {
            return Ok(());
        }
        let deadline = s.deadline(now_ms())?;
        let empty = Default::default();
        crab_common::life::check_meta(
            s.labels.as_ref().unwrap_or(&empty),
            s.env.as_ref().unwrap_or(&empty),
        )?;
        for n in names {
            self.runtime().edit(n, |r| {
                if let Some(l) = &s.labels {
                    r.labels = l.clone();
                }
                if let Some(e) = &s.env {
                    r.env = e.clone();
                }
                if s.template.is_some() {
                    r.template = s.template.clone();
                }
                r.deadline_ms = deadline.map(|d| d.at_ms);
                if let Some(d) = deadline {
                    r.on_deadline = d.on;
                }
            })?;
        }
        Ok(())
    }

    /// [`Action::LabelPoint`].
    pub(crate) async fn label_point(
        self: &Arc<Self>,
        name: String,
        point: String,
        labels: Vec<String>,
    ) -> Result<Outcome, HostError> {
        if labels.is_empty() {
            return Err(HostError::invalid("no label given", "give at least one label"));
        }
        for l in &labels {
            check_label(l)?;
        }
        let h = self.clone();
        blocking(move || {
            // The point exists (an unknown id is `checkpoint_not_found`).
            h.checkpointer().store(&name)?.resolve(Some(&point))?;
            let _g = lock(&h.label_lock);
            for r in h.runtime().records() {
                for (l, p) in r.labels_of_points() {
                    if labels.iter().any(|x| x == l) && !(r.name == name && p == point) {
                        return Err(HostError(crab_common::ApiError::new(
                            ErrorCode::NameConflict,
                            format!("label {l:?} already names point {p} of sandbox {}", r.name),
                            "pick another label, or delete that one first",
                        )));
                    }
                }
            }
            h.runtime().edit(&name, |r| {
                let mine = r.point_labels.entry(point.clone()).or_default();
                for l in &labels {
                    if !mine.contains(l) {
                        mine.push(l.clone());
                    }
                }
            })?;
            Ok(Outcome::Labels(vec![h.labelled(&name, &point)?]))
        })
        .await
    }

    /// The labelled point `point` of `name` as listed.
    fn labelled(&self, name: &str, point: &str) -> Result<LabelledPoint, HostError> {
        let labels =
            self.runtime().record(name)?.point_labels.get(point).cloned().unwrap_or_default();
        let m = self.checkpointer().store(name)?.resolve(Some(point))?;
        let fs_only = m.procs_missing.is_some()
            || m.procs.is_none()
            || m.kind == crab_common::PointKind::Checkpoint(CheckpointKind::Fs);
        Ok(LabelledPoint { sandbox: name.to_string(), point: point.to_string(), labels, fs_only })
    }

    /// [`Action::Labels`].
    pub(crate) async fn labels(self: &Arc<Self>) -> Result<Outcome, HostError> {
        let h = self.clone();
        blocking(move || {
            let mut out = Vec::new();
            for r in h.runtime().records() {
                for p in r.point_labels.keys() {
                    match h.labelled(&r.name, p) {
                        Ok(l) => out.push(l),
                        // A labelled point that is gone (pruned) is not listed.
                        Err(e) => tracing::debug!(sandbox = %r.name, point = %p, error = %e.0.message, "labelled point unreadable"),
                    }
                }
            }
            out.sort_by(|a, b| (&a.sandbox, &a.point).cmp(&(&b.sandbox, &b.point)));
            Ok(Outcome::Labels(out))
        })
        .await
    }

    /// [`Action::DeleteLabel`].
    pub(crate) async fn delete_label(
        self: &Arc<Self>,
        label: String,
    ) -> Result<Outcome, HostError> {
        let found = self.runtime().records().into_iter().find_map(|r| {
            r.labels_of_points()
                .find(|(l, _)| *l == label)
                .map(|(_, p)| (r.name.clone(), p.to_string()))
        });
        let Some((name, point)) = found else {
            return Err(HostError(crab_common::ApiError::new(
                ErrorCode::CheckpointNotFound,
                format!("no restore point is labelled {label:?}"),
                "list labelled points with GET /v1/labels",
            )));
        };
        let l = self.life_lock(&name);
        let g = l.lock().await;
        let rec = self.runtime().edit(&name, |r| {
            r.point_labels.remove(&point);
        })?;
        let last = rec.point_labels.is_empty() && matches!(rec.life, Life::Retired { .. });
        drop(g);
        if last {
            match self.remove(name.clone(), true).await {
                Ok(_) => {}
                Err(e) if e.0.code == ErrorCode::SandboxNotFound => {}
                Err(e) => return Err(e),
            }
            tracing::info!(sandbox = %name, %label, "last labelled point deleted: its retired sandbox is removed");
        }
        Ok(Outcome::LabelDeleted(LabelDeleted { sandbox: name, point, sandbox_removed: last }))
    }

    /// Start the one deadline watchdog: every [`WATCHDOG_PERIOD`] a running sandbox whose
    /// deadline passed is paused or killed (a failed pause kills it). Deadlines are absolute
    /// and persisted, so a restarted daemon fires what came due while it was down.
    pub(crate) fn spawn_watchdog(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut t = tokio::time::interval(WATCHDOG_PERIOD);
            loop {
                t.tick().await;
                let Some(h) = weak.upgrade() else { return };
                for (name, d) in h.runtime().due(now_ms()) {
                    // One firing per sandbox at a time: a slow pause is not fired again by the
                    // next tick.
                    if !lock(&h.firing).insert(name.clone()) {
                        continue;
                    }
                    let h = h.clone();
                    tokio::spawn(async move {
                        h.clone().fire(name.clone(), d).await;
                        lock(&h.firing).remove(&name);
                    });
                }
            }
        });
    }

    async fn fire(self: Arc<Self>, name: String, d: Deadline) {
        // Fired once: the deadline goes first (a failing step is not retried every second).
        let mut mine = false;
        if let Err(e) = self.runtime().edit(&name, |r| {
            if r.deadline_ms == Some(d.at_ms) && r.life == Life::Running {
                r.deadline_ms = None;
                mine = true;
            }
        }) {
            tracing::warn!(sandbox = %name, error = %e, "deadline: cannot clear it");
            return;
        }
        if !mine {
            // Changed meanwhile (a new deadline, a pause through another door).
            return;
        }
        if d.on == OnDeadline::Pause {
            tracing::info!(sandbox = %name, "deadline: pausing");
            match self.execute(Action::Pause { name: name.clone() }).await {
                Ok(_) => return,
                // Gone, or not running any more (paused or stopped through another door):
                // nothing left to do.
                Err(e) if matches!(e.0.code, ErrorCode::SandboxNotFound | ErrorCode::Conflict) => {
                    return
                }
                Err(e) => {
                    tracing::warn!(sandbox = %name, error = %e.0.message, "deadline: pause failed; killing")
                }
            }
        } else {
            tracing::info!(sandbox = %name, "deadline: killing");
        }
        match self.execute(Action::Kill { name: name.clone() }).await {
            Ok(_) => {}
            Err(e) if e.0.code == ErrorCode::SandboxNotFound => {}
            Err(e) => {
                tracing::warn!(sandbox = %name, error = %e.0.message, "deadline: kill failed")
            }
        }
    }
}
