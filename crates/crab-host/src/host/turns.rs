//! A sandbox's restore points taken: a turn boundary (the inspector's verdict → the turn
//! policy → an engine job the proxy's gate waits for), an explicit checkpoint (after the
//! dump's capability pre-check), `Action::Turn` and the conversation log up to a point.

use super::*;

/// The id of the `full` point a checkpoint answered, or why it holds no processes (a dump that
/// fell back to the filesystem), as a `criu_failed` error saying what was not done.
pub(crate) fn full_point(o: &Outcome, what: &str) -> Result<String, HostError> {
    match o {
        Outcome::Taken(t) => match &t.point.procs_missing {
            None => Ok(t.point.id.clone()),
            Some(why) => Err(HostError(ApiError::new(
                crab_common::ErrorCode::CriuFailed,
                format!(
                    "no {what}: the processes could not be dumped ({why}); restore point {} holds the files only",
                    t.point.id
                ),
                "the sandbox was left running as it was",
            ))),
        },
        _ => Err(HostError::internal("the checkpoint answered no restore point")),
    }
}

/// This process's effective capability mask (`CapEff` of `/proc/self/status`), read once.
pub(super) fn cap_eff() -> Option<u64> {
    static CAPS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *CAPS.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_string();
        u64::from_str_radix(&hex, 16).ok()
    })
}

/// Whether the daemon holds `CAP_SYS_RESOURCE`, which CRIU needs to read the rlimits of a
/// process of another uid (`prlimit(2)`); unknown counts as held (CRIU then says).
pub(super) fn has_sys_resource() -> bool {
    cap_eff().is_none_or(|c| c & (1 << CAP_SYS_RESOURCE) != 0)
}

/// The first process of `pids` whose real, effective or saved uid or gid is not root:
/// `(pid, uid, gid, command)`.
fn first_non_root(pids: &[u32]) -> Option<(u32, String, String, String)> {
    for &pid in pids {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue; // gone meanwhile
        };
        let field = |k: &str| -> Vec<String> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.split_whitespace().take(3).map(str::to_string).collect())
                .unwrap_or_default()
        };
        let (uids, gids) = (field("Uid:"), field("Gid:"));
        if uids.iter().chain(gids.iter()).any(|id| id != "0") {
            let name = field("Name:").into_iter().next().unwrap_or_default();
            let uid = uids.first().cloned().unwrap_or_default();
            let gid = gids.first().cloned().unwrap_or_default();
            return Some((pid, uid, gid, name));
        }
    }
    None
}

/// Refuse a process dump CRIU cannot do on this host — a non-root process in the sandbox and
/// no `CAP_SYS_RESOURCE` ("Can't get rlimit") — with the cause and the fix, before anything
/// of the sandbox is touched.
pub(super) fn dump_preflight(rt: &Runtime, name: &str) -> Result<(), HostError> {
    if has_sys_resource() {
        return Ok(());
    }
    // In a user namespace of the daemon's making, the daemon (its owner) holds every
    // capability, CAP_SYS_RESOURCE included, whatever its own set lacks.
    if rt.record(name).is_ok_and(|r| r.profile.userns.is_some()) {
        return Ok(());
    }
    let pids = rt.cgroup(name).pids().unwrap_or_default();
    let Some((pid, uid, gid, comm)) = first_non_root(&pids) else { return Ok(()) };
    Err(HostError(ApiError::new(
        crab_common::ErrorCode::HostCapabilityMissing,
        format!(
            "cannot dump the processes of sandbox {name:?}: process {pid} ({comm}) runs as uid {uid} gid {gid}, and this crab daemon lacks CAP_SYS_RESOURCE (CapEff {:016x}), which CRIU needs to read a non-root process's rlimits",
            cap_eff().unwrap_or(0)
        ),
        "this sandbox runs in the host's user namespace (--userns host or --privileged, or created before user namespaces): recreate it with the default --userns private, or run the daemon where its capability set includes CAP_SYS_RESOURCE (a host or container that does not drop it), or run that process as root, or take a filesystem checkpoint (--kind fs; E2B: mode=\"filesystem\"); the sandbox was left running, untouched",
    )))
}

impl Host {
    /// Close the inspector's turn for `name` and decide the checkpoint kind (the policy's).
    pub(super) fn decide(&self, name: &str) -> Decision {
        let verdict = match self.inspector() {
            Ok(i) => i.take(name).map_err(|e| format!("no verdict ({e})")),
            Err(e) => Err(format!("inspector unavailable ({})", e.0.message)),
        };
        let init_pid = self.runtime.record(name).ok().map(|r| r.init_pid);
        // Rule 6 (soft-dirty) only where the kernel tracks written pages.
        let read = |pid: u32| crab_criu::soft_dirty::process_dirty_pages(pid).ok();
        let dirty: Option<&dyn Fn(u32) -> Option<usize>> =
            if self.soft_dirty.available { Some(&read) } else { None };
        self.policy.decide_with(name, verdict, init_pid, dirty)
    }

    /// Submit a checkpoint job for `name` carrying `decision`'s changeset.
    pub(super) fn submit(
        &self,
        name: &str,
        kind: CheckpointKind,
        verdict: Option<&crab_inspector::Verdict>,
        turn: Option<u64>,
        conversation_offset: Option<u64>,
    ) -> JobHandle {
        let payload = Payload {
            turn,
            conversation_offset,
            changeset: verdict.map(|v| v.changeset.clone()).unwrap_or_default(),
        };
        self.engine.submit(JobSpec::checkpoint(name, kind, payload, turn.unwrap_or(0)))
    }

    /// A turn boundary seen by the proxy: decide, submit, and return the ticket to gate on.
    pub(crate) async fn boundary(
        self: &Arc<Self>,
        b: &Boundary,
    ) -> Result<Arc<dyn BoundaryTicket>, HostError> {
        let policy = self.runtime.record(&b.sandbox)?.checkpoint_policy;
        if policy == CheckpointPolicy::None {
            // No checkpoint, and the inspector's turn stays open: its changes accumulate into
            // the verdict of the next turn that does checkpoint (after a policy change), so
            // nothing is skipped that changed meanwhile.
            return Ok(ReadyTicket::published(""));
        }
        // A sandbox parked (by hand, or still parked from the last boundary): nothing ran in
        // it since its park point, which is this turn's point too — no dump of a sandbox
        // without processes, no wake.
        if let Some(point) = self.parked_at(&b.sandbox) {
            return Ok(ReadyTicket::published(point));
        }
        let h = self.clone();
        let name = b.sandbox.clone();
        let d = blocking(move || Ok(h.decide(&name))).await?;
        // A fixed policy takes its kind whatever the verdict (the turn is closed all the same:
        // its changes are in this checkpoint). `fs` stays `fs` after a failure: a snapshot
        // holds every file, whatever the lost changeset said; the processes it never holds.
        let kind = policy.fixed_kind().unwrap_or(d.kind);
        if !d.reasons.is_empty() && policy == CheckpointPolicy::Auto {
            tracing::info!(sandbox = %b.sandbox, reasons = ?d.reasons, "turn boundary");
        }
        let handle = self.submit(
            &b.sandbox,
            kind,
            d.verdict.as_ref(),
            Some(b.turn),
            Some(b.conversation_offset),
        );
        let ticket = Arc::new(JobTicket::new(self.engine.clone(), handle, b.sandbox.clone()));
        if self.park_policy.is_none() || self.never_parks(&b.sandbox) {
            return Ok(ticket);
        }
        // Parking is on: once the point publishes, decide whether to park while the agent
        // waits; the gate sees the ticket published only once that is decided and the sandbox
        // is awake.
        let (tx, rx) = tokio::sync::watch::channel(false);
        let (h, t, name, streams) = (self.clone(), ticket.clone(), b.sandbox.clone(), b.streams);
        let started = std::time::Instant::now();
        tokio::spawn(async move {
            if let Ok(p) = t.wait_published().await {
                h.maybe_park(&name, &p.checkpoint_id, started, streams).await;
            }
            let _ = tx.send(true);
        });
        Ok(Arc::new(ParkTicket {
            inner: ticket,
            host: Arc::downgrade(self),
            sandbox: b.sandbox.clone(),
            started: std::time::Instant::now(),
            decided: rx,
        }))
    }

    pub(crate) async fn checkpoint(
        self: &Arc<Self>,
        name: String,
        kind: Option<CheckpointKind>,
        turn: Option<u64>,
        conversation_offset: Option<u64>,
    ) -> Result<Outcome, HostError> {
        self.runtime.record(&name)?;
        if matches!(kind, Some(CheckpointKind::Full | CheckpointKind::Process)) {
            // Before anything is touched (the turn stays open, nothing is frozen).
            let rt = self.runtime.clone();
            let n = name.clone();
            blocking(move || dump_preflight(&rt, &n)).await?;
        }
        let h = self.clone();
        let n = name.clone();
        // An explicit kind also closes the inspector's turn: its changes are in this checkpoint.
        let d = blocking(move || Ok(h.decide(&n))).await?;
        let explicit = kind.is_some();
        let handle = self.submit(
            &name,
            kind.unwrap_or(d.kind),
            d.verdict.as_ref(),
            turn,
            conversation_offset,
        );
        let (reasons, verdict) = if explicit { (Vec::new(), None) } else { (d.reasons, d.verdict) };
        self.engine.promote(handle.id());
        // A failure is in the policy already (the executor's): the next one is full.
        let f = handle.wait().await.map_err(|e| crate::glue::job_error(&e))?;
        let h = self.clone();
        let id = f.outcome.checkpoint_id.clone();
        let n = name.clone();
        let point = blocking(move || {
            let m = h.checkpointer.store(&n)?.resolve(Some(&id))?;
            Ok(PointSummary::of(&m))
        })
        .await?;
        let queue_ms = f.queue_wait.as_secs_f64() * 1e3;
        let mut reasons = reasons;
        if let Some(why) = &point.procs_missing {
            reasons.push(format!("filesystem only, processes missing: {why}"));
        }
        if let Some(t) = &self.remote {
            t.kick();
        }
        Ok(Outcome::Taken(Box::new(Taken { point, verdict, reasons, queue_ms })))
    }

    /// The conversation offset recorded by a restore point (`None`: the newest).
    pub(super) fn point_offset(
        &self,
        name: &str,
        point: Option<&str>,
    ) -> Result<Option<u64>, HostError> {
        let store = self.checkpointer.store(name)?;
        Ok(store.resolve(point)?.conversation_offset)
    }

    pub(super) async fn conversation(
        self: &Arc<Self>,
        name: String,
        at: Option<String>,
    ) -> Result<Outcome, HostError> {
        self.runtime.record(&name)?;
        let offset = match at {
            Some(at) => {
                let h = self.clone();
                let n = name.clone();
                let a = at.clone();
                match blocking(move || h.point_offset(&n, Some(&a))).await? {
                    Some(o) => Some(o),
                    None => {
                        return Err(HostError::invalid(
                            format!("restore point {:?} of {name} records no conversation offset", Some(at)),
                            "points taken outside the LLM proxy have none; pick one taken at a turn boundary",
                        ))
                    }
                }
            }
            None => None,
        };
        let records = self
            .coordinator
            .conversation(&name, offset)
            .await
            .map_err(|e| HostError::internal(e.to_string()))?;
        Ok(Outcome::Conversation(records))
    }

    pub(super) async fn turn(self: &Arc<Self>, name: String) -> Result<Outcome, HostError> {
        self.runtime.record(&name)?;
        let (turn, ticket) = self
            .coordinator
            .begin_turn(&name)
            .await
            .map_err(|e| HostError::internal(e.to_string()))?;
        ticket.promote();
        match ticket.wait_published().await {
            Ok(p) => Ok(Outcome::Turn(TurnMarked { turn, checkpoint: p.checkpoint_id })),
            Err(e) => Err(e.into()),
        }
    }
}

/// A turn's ticket when the host may park the sandbox at this boundary (`crab daemon
/// --memory-budget`): the checkpoint job's ticket, plus the parking decision taken once the
/// point publishes. The proxy's gate sees it published only when that decision is made and the
/// sandbox is awake, so an LLM answer never reaches the agent of a parked sandbox: waiting on
/// it wakes the sandbox first, and promoting it (the gate does when the answer's head arrives
/// while the ticket is unsettled) starts that wake at once. Waiting also records how long the
/// agent waited for its answer (the policy's history).
pub(crate) struct ParkTicket {
    inner: Arc<JobTicket>,
    host: std::sync::Weak<Host>,
    sandbox: String,
    started: std::time::Instant,
    decided: tokio::sync::watch::Receiver<bool>,
}

impl ParkTicket {
    fn parked(&self) -> Option<Arc<Host>> {
        let h = self.host.upgrade()?;
        h.is_parked(&self.sandbox).then_some(h)
    }
}

impl BoundaryTicket for ParkTicket {
    fn is_published(&self) -> bool {
        self.inner.is_published() && *self.decided.borrow() && self.parked().is_none()
    }

    fn wait_published(
        &self,
    ) -> crab_coordinator::BoxFuture<
        '_,
        Result<crab_coordinator::Published, crab_coordinator::HookError>,
    > {
        Box::pin(async move {
            let r = self.wait_checkpoint().await;
            self.wait_ready().await?;
            r
        })
    }

    fn is_checkpointed(&self) -> bool {
        self.inner.is_published() && *self.decided.borrow()
    }

    fn wait_checkpoint(
        &self,
    ) -> crab_coordinator::BoxFuture<
        '_,
        Result<crab_coordinator::Published, crab_coordinator::HookError>,
    > {
        Box::pin(async move {
            if let Some(h) = self.host.upgrade() {
                h.parking.record_wait(&self.sandbox, self.started.elapsed().as_secs_f64() * 1e3);
            }
            let r = self.inner.wait_published().await;
            let mut d = self.decided.clone();
            let _ = d.wait_for(|v| *v).await;
            r
        })
    }

    fn is_ready(&self) -> bool {
        self.parked().is_none()
    }

    fn wait_ready(
        &self,
    ) -> crab_coordinator::BoxFuture<'_, Result<(), crab_coordinator::HookError>> {
        Box::pin(async move {
            if let Some(h) = self.parked() {
                h.parking.answer_woke();
                h.ensure_awake(&self.sandbox).await?;
            }
            Ok(())
        })
    }

    /// A parked sandbox's streamed answer: its end waits for the wake, so the wake starts as
    /// late as is safe — it is back (within twice its cost) by half the shortest of the
    /// sandbox's recent answers, [`crate::parking::HEAD_WAKE_SHARE`] — and at once without
    /// that history.
    fn head_released(&self) {
        let Some(h) = self.parked() else {
            return;
        };
        let cost = h.parking.wake_cost_ms(&self.sandbox, h.engine().running_dumps() > 0);
        let lead = h.parking.answer_lead_floor_ms(&self.sandbox).unwrap_or(0.0);
        let delay = (lead * crate::parking::HEAD_WAKE_SHARE - 2.0 * cost).max(0.0);
        let delay = std::time::Duration::from_secs_f64(delay / 1e3);
        let at = h.parked_at(&self.sandbox);
        h.wake_later(&self.sandbox, at, std::time::Instant::now() + delay, false);
    }

    fn promote(&self) {
        self.inner.promote();
        if let Some(h) = self.parked() {
            let n = self.sandbox.clone();
            tokio::spawn(async move {
                if let Err(e) = h.ensure_awake(&n).await {
                    tracing::warn!(sandbox = %n, error = %e, "the early wake failed");
                }
            });
        }
    }

    fn record_exposed(&self, held: std::time::Duration) {
        self.inner.record_exposed(held);
    }

    fn answer_done(&self, head_to_end: std::time::Duration) {
        if let Some(h) = self.host.upgrade() {
            h.parking.record_lead(&self.sandbox, head_to_end.as_secs_f64() * 1e3);
        }
    }

    fn held_breakdown(
        &self,
        gate_start: std::time::Instant,
        woke: std::time::Instant,
    ) -> Vec<(String, f64)> {
        self.inner.held_breakdown(gate_start, woke)
    }
}
