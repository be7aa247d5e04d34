//! [`Checkpointer::restore`]: a sandbox restored in place from one of its points (verify,
//! prepare the root, stop, swap the roots, incarnate), and the roll-back when that fails.

use super::*;

impl Checkpointer {
    /// Restore `sandbox` in place to `point` (newest when `None`): filesystem first, then
    /// processes. Verification happens before anything is touched: a corrupt or missing file
    /// refuses the restore and leaves the sandbox as it was. Reports its stages (`verify`,
    /// `filesystem`, `processes`) to `progress`.
    pub fn restore(
        &self,
        sandbox: &str,
        point: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<RestoreReport> {
        self.restore_impl(sandbox, None, point, false, progress)
    }

    /// Replace what `sandbox` holds by point `point` of another store `src` (another
    /// sandbox's points, or points materialized from a remote store), in place: the same
    /// verification, preparation and roll-back as [`Checkpointer::restore`] — nothing is
    /// touched before every check passed, and a failure after the processes were stopped puts
    /// the sandbox's own files back — with the root personalized for `sandbox` (hostname,
    /// machine-id), the processes given its hostname, and a first point of its own published
    /// equal to `point` (its origin) once they run. `fs_only`: the point's files and a fresh
    /// init, not its processes. The sandbox keeps its name, record, limits and profile.
    pub fn restore_from(
        &self,
        sandbox: &str,
        src: &Arc<Store>,
        point: &str,
        fs_only: bool,
        progress: &dyn Progress,
    ) -> Result<RestoreReport> {
        self.restore_impl(sandbox, Some(src), Some(point), fs_only, progress)
    }

    fn restore_impl(
        &self,
        sandbox: &str,
        src: Option<&Arc<Store>>,
        point: Option<&str>,
        fs_only: bool,
        progress: &dyn Progress,
    ) -> Result<RestoreReport> {
        let started = Instant::now();
        let mut stages = crab_common::stats::StageClock::starting(started);
        let lock = self.lock(sandbox);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.rt.record(sandbox).map_err(sandbox_err(sandbox))?;
        let own = self.store(sandbox)?;
        let foreign = src.filter(|s| !Arc::ptr_eq(s, &own));
        // Two stores' locks are taken in the order of their directories, so two replaces of
        // each other's sandboxes at once cannot wait on each other.
        let (_held, _held_src) = match foreign {
            None => (own.lock()?, None),
            Some(s) if s.dir() < own.dir() => {
                let a = s.lock()?;
                (own.lock()?, Some(a))
            }
            Some(s) => {
                let b = own.lock()?;
                let a = s.lock()?;
                (b, Some(a))
            }
        };
        let store = foreign.unwrap_or(&own).clone();
        let mut m = store.resolve(point)?;
        if fs_only {
            m.procs = None;
        }
        // Another store's point carries its sandbox's ids (its files' owners, its processes'
        // user namespace): it can replace only a sandbox of the same user-namespace mode.
        if foreign.is_some() {
            let theirs: Option<crab_common::api::IdRange> = m
                .sandbox_meta
                .get("profile")
                .and_then(|p| p.get("userns"))
                .and_then(|v| serde_json::from_value(v.clone()).ok());
            if theirs != rec.profile.userns {
                let shown = |r: Option<crab_common::api::IdRange>| {
                    r.map_or("the host's user namespace".to_string(), |r| r.to_string())
                };
                return Err(CheckpointError::Invalid(format!(
                    "restore point {} runs in {} and sandbox {sandbox} in {}: a point can replace only a sandbox of its own user-namespace mode (fork the point instead, which makes a sandbox of its mode)",
                    m.id,
                    shown(theirs),
                    shown(rec.profile.userns)
                )));
            }
        }
        stages.mark("lock");
        progress.stage("verify", None);
        progress.message(&format!("restore point {} (turn {}, {})", m.id, m.turn, m.kind.as_str()));
        let fs = m.fs.as_ref().ok_or_else(|| {
            CheckpointError::Invalid(format!("restore point {} has no filesystem snapshot", m.id))
        })?;
        let criu = if m.procs.is_some() { Some(self.criu()?) } else { None };
        // Can CRIU bring the point's processes back? A tree spanning two namespaces of a kind
        // (a point of an older daemon, whose execs after a restore stayed outside the
        // restored init's time namespace) fails in CRIU after the sandbox's processes were
        // stopped: refuse it now, with the sandbox untouched.
        if let Some(p) = &m.procs {
            let dir = store.proc_dir(p.id);
            crab_criu::images::check_shared_namespaces(&dir).map_err(|e| {
                CheckpointError::corrupt(
                    &dir,
                    format!(
                        "restore point {} cannot be restored with its processes ({e}); nothing \
                         was stopped: restore another point",
                        m.id
                    ),
                )
            })?;
        }
        let t_fs = Instant::now();
        let dir = self.rt.state().sandbox_dir(sandbox);
        let rootfs = self.rt.state().sandbox_rootfs(sandbox);
        let staged = dir.join("rootfs.restoring");
        let old = dir.join("rootfs.old");
        for p in [&staged, &old] {
            if p.exists() {
                self.fs.delete(p).map_err(|e| CheckpointError::io("delete", p, e))?;
            }
        }
        // Verification (hashing the images) and the writable snapshot of F_k overlap: neither
        // touches the sandbox, and a failed verification discards the snapshot.
        let src = store.fs_path(fs.id);
        let (verified, snap) = std::thread::scope(|scope| {
            let v = scope.spawn(|| {
                let t = Instant::now();
                store.verify(&m).map(|()| ms(t.elapsed()))
            });
            let snap = self.fs.snapshot(&src, &staged, false);
            let verified = v.join().unwrap_or_else(|_| {
                Err(CheckpointError::Invalid("verification thread panicked".into()))
            });
            (verified, snap)
        });
        let verify_ms = match verified {
            Ok(ms) => ms,
            Err(e) => {
                if staged.exists() {
                    if let Err(d) = self.fs.delete(&staged) {
                        tracing::warn!(path = %staged.display(), error = %d, "cannot discard the staged root");
                    }
                }
                return Err(e);
            }
        };
        snap.map_err(|e| CheckpointError::io("snapshot", &staged, e))?;
        stages.mark("snapshot");
        // Another store's point: the root becomes this sandbox's (its hostname and
        // machine-id), and that root, before anything runs in it, is the sandbox's first point
        // of its own (published once the processes run; dropped, with its staged snapshot,
        // when anything fails).
        let mut origin = None;
        if foreign.is_some() {
            let staged_origin = personalize(&staged, sandbox, rec.profile.userns)
                .map_err(sandbox_err(sandbox))
                .and_then(|()| {
                    let mut o = own.begin();
                    o.snapshot_fs(&staged)?;
                    Ok(o)
                });
            match staged_origin {
                Ok(o) => origin = Some(o),
                Err(e) => {
                    if let Err(d) = self.fs.delete(&staged) {
                        tracing::warn!(path = %staged.display(), error = %d, "cannot discard the staged root");
                    }
                    return Err(e);
                }
            }
            stages.mark("origin");
        }
        // Every precondition is checked while the sandbox still runs: the init goes into the
        // staged root (a write that needs space), and the pool must keep room for the swap,
        // the cgroup and CRIU's work. A failure here leaves the sandbox untouched.
        // The sandbox's disk quota goes with it onto the staged root (a new subvolume), before
        // anything is written there.
        let pre = self
            .rt
            .limit_disk(&staged, &rec.limits)
            .and_then(|()| install_init(&staged))
            .map_err(sandbox_err(sandbox))
            .and_then(|()| self.check_room(sandbox, "restore"));
        if let Err(e) = pre {
            if let Err(d) = self.fs.delete(&staged) {
                tracing::warn!(path = %staged.display(), error = %d, "cannot discard the staged root");
            }
            return Err(e);
        }
        stages.mark("prepare");
        progress.stage("filesystem", None);
        // Point of no return for the processes: stop what runs, swap the roots. The replaced
        // root is kept until the new processes run, so a failure can put the files back.
        let stopped = self.rt.stop(sandbox).map_err(sandbox_err(sandbox));
        stages.mark("stop");
        let swapped = stopped
            .and_then(|()| {
                std::fs::rename(&rootfs, &old)
                    .map_err(|e| CheckpointError::io("rename", &rootfs, e))
            })
            .and_then(|()| {
                std::fs::rename(&staged, &rootfs)
                    .map_err(|e| CheckpointError::io("rename", &staged, e))
            });
        stages.mark("swap");
        let fs_ms = ms(t_fs.elapsed());
        progress.stage("processes", None);
        let t_p = Instant::now();
        let started_procs = swapped
            .and_then(|()| self.restore_procs(sandbox, &m, criu.as_ref(), &store, &rootfs, &rec));
        let (pid, restored) = match started_procs {
            Ok(v) => v,
            Err(e) => return Err(self.roll_back_restore(sandbox, &m, &mut rec, e)),
        };
        stages.mark("criu");
        rec.init_pid = pid;
        rec.init_start = process_start_time(pid).unwrap_or(0);
        // Not fsynced: a restore changes only the init's pid and start time (and a `nat`
        // sandbox's host end), which a host crash makes stale whichever record survives —
        // the sandbox is dead after it either way. Atomic for readers and daemon restarts; the
        // rest of the record is taken as it is now (another door may have changed it).
        let set = self.rt.set_init(sandbox, rec.init_pid, rec.init_start, true);
        if let Err(e) = set.map_err(sandbox_err(sandbox)) {
            return Err(self.roll_back_restore(sandbox, &m, &mut rec, e));
        }
        stages.mark("record");
        // The live sandbox is now point m: say so with a new newest point referencing m's
        // parts, so that the next checkpoint builds on m and a crash-restore of "the newest"
        // does not resurrect the abandoned future.
        let marker = match origin {
            Some(mut o) => {
                let draft = super::fork::origin_draft(&mut o, &store, &m, &rec)?;
                o.publish(draft)?
            }
            None => {
                let mut marker = Draft::new(PointKind::Restore, m.turn);
                marker.base = Some(m.id);
                marker.conversation_offset = m.conversation_offset;
                marker.no_procs = m.procs.is_none();
                marker.sandbox_meta = m.sandbox_meta.clone();
                store.begin().publish(marker)?
            }
        };
        stages.mark("marker");
        // The replaced root goes after the answer: deleting a subvolume is a btrfs
        // transaction the caller need not wait for. Under the sandbox's lock, so the next
        // operation on it (which may make a new `rootfs.old`) waits for it.
        self.delete_later(sandbox, old);
        let report = RestoreReport {
            sandbox: sandbox.to_owned(),
            point: m.id.to_string(),
            marker: marker.id.to_string(),
            init_pid: pid,
            processes_restored: restored,
            verify_ms,
            fs_ms,
            procs_ms: ms(t_p.elapsed()),
            total_ms: ms(started.elapsed()),
            stages: stages.into_stages().into_iter().map(|(name, ms)| Stage { name, ms }).collect(),
        };
        tracing::info!(
            sandbox,
            point = %m.id,
            ms = report.total_ms,
            stages = %report
                .stages
                .iter()
                .map(|s| format!("{} {:.1}", s.name, s.ms))
                .collect::<Vec<_>>()
                .join(", "),
            "sandbox restored"
        );
        Ok(report)
    }

    /// A restore failed after the sandbox's processes were stopped: kill what the attempt
    /// left, put the previous root back, start a fresh init on it and record that. The error
    /// returned says what failed, what state the sandbox is in and what to run.
    pub(super) fn roll_back_restore(
        &self,
        sandbox: &str,
        m: &Manifest,
        rec: &mut SandboxRecord,
        cause: CheckpointError,
    ) -> CheckpointError {
        tracing::warn!(sandbox, point = %m.id, error = %cause, "restore failed after stopping the sandbox; rolling back");
        let dir = self.rt.state().sandbox_dir(sandbox);
        let rootfs = self.rt.state().sandbox_rootfs(sandbox);
        let old = dir.join("rootfs.old");
        let staged = dir.join("rootfs.restoring");
        let put_back = (|| -> Result<(u32, u64)> {
            self.rt.stop(sandbox).map_err(sandbox_err(sandbox))?;
            if old.exists() {
                if rootfs.exists() {
                    self.fs
                        .delete(&rootfs)
                        .map_err(|e| CheckpointError::io("delete", &rootfs, e))?;
                }
                std::fs::rename(&old, &rootfs)
                    .map_err(|e| CheckpointError::io("rename", &old, e))?;
            }
            if staged.exists() {
                if let Err(e) = self.fs.delete(&staged) {
                    tracing::warn!(path = %staged.display(), error = %e, "cannot discard the staged root");
                }
            }
            ensure_thawed(&self.rt.cgroup(sandbox), sandbox)?;
            self.rt
                .start_init(sandbox, rec.net, &rec.limits, rec.profile)
                .map_err(sandbox_err(sandbox))
        })();
        let message = match put_back {
            Ok((pid, start)) => {
                rec.init_pid = pid;
                rec.init_start = start;
                match self.rt.set_init(sandbox, pid, start, false) {
                    Ok(()) => format!(
                        "restore to point {} failed after the sandbox's processes were stopped: {cause}. \
                         The sandbox runs again on its files as they were before the restore, with a \
                         fresh init (the processes it had are gone); fix the cause and run \
                         `crab restore {sandbox} {}` again",
                        m.id, m.id
                    ),
                    Err(e) => format!(
                        "restore to point {} failed after the sandbox's processes were stopped: {cause}; \
                         its previous files are back and a fresh init {pid} runs, but its record could \
                         not be written ({e}): run `crab restore {sandbox} {}` again",
                        m.id, m.id
                    ),
                }
            }
            Err(e) => format!(
                "restore to point {} failed after the sandbox's processes were stopped: {cause}; \
                 putting it back also failed ({e}). It is stopped, its record kept: run \
                 `crab restore {sandbox} {}` to retry, or `crab sandbox rm --force {sandbox}`",
                m.id, m.id
            ),
        };
        tracing::error!(sandbox, "{message}");
        CheckpointError::Sandbox { sandbox: sandbox.to_owned(), message }
    }
}
