//! A sandbox's points made into running sandboxes again: restore in place, fork of a point
//! (or of the sandbox as it is now), and new sandboxes from a point in the remote store —
//! each re-attached to the inspector, its conversation log rewound or copied, its in-sandbox
//! proxy endpoint opened.

use super::*;

impl Host {
    pub(crate) async fn restore(
        self: &Arc<Self>,
        name: String,
        checkpoint: Option<String>,
        progress: Arc<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        self.restore_in_place(name, checkpoint, progress, true).await
    }

    /// Restore `name` in place from `checkpoint`; `rewind_log`: its conversation goes back to
    /// the point as well (a restore), or stays as it is (a parked sandbox woken: its agent
    /// carries on from where it waited).
    pub(crate) async fn restore_in_place(
        self: &Arc<Self>,
        name: String,
        checkpoint: Option<String>,
        progress: Arc<dyn Progress>,
        rewind_log: bool,
    ) -> Result<Outcome, HostError> {
        // Exports (the background lane) pause while the caller waits for this (a wake too).
        let _hold = self.engine.hold_background();
        let t0 = std::time::Instant::now();
        let h = self.clone();
        let n = name.clone();
        let (report, offset, t_attach) = blocking(move || {
            h.runtime.record(&n)?;
            let offset = if rewind_log { h.point_offset(&n, checkpoint.as_deref())? } else { None };
            h.detach(&n);
            let r = h.checkpointer.restore(&n, checkpoint.as_deref(), progress.as_ref());
            let t_attach = std::time::Instant::now();
            // Whatever happened, the sandbox's (possibly new) cgroup is tracked again.
            h.attach(&n);
            h.policy.clear(&n);
            let r = r?;
            // It runs again (no longer paused, stopped or only a holder of restore points).
            h.set_life(&n, crab_common::life::Life::Running)?;
            Ok((r, offset, t_attach))
        })
        .await?;
        let t_log = std::time::Instant::now();
        if let Some(off) = offset {
            // Replay: the agent's re-sent requests up to the point are answered from the log.
            if let Err(e) = self.coordinator.restored(&name, off, true).await {
                tracing::warn!(sandbox = %name, error = %e, "could not rewind the conversation log");
            }
        }
        let t_proxy = std::time::Instant::now();
        self.open_sandbox_proxy(&name).await;
        // The host's share around the checkpointer (issue 15's end-to-end budget).
        tracing::info!(
            sandbox = %name,
            checkpointer_ms = report.total_ms,
            attach_ms = ms_between(t_attach, t_log),
            log_ms = ms_between(t_log, t_proxy),
            proxy_ms = t_proxy.elapsed().as_secs_f64() * 1e3,
            total_ms = t0.elapsed().as_secs_f64() * 1e3,
            "restore answered"
        );
        Ok(Outcome::Restored(report))
    }

    /// A `full` point of `name` now, then branches `names` from it.
    pub(super) async fn fork_live(
        self: &Arc<Self>,
        name: String,
        req: crab_common::api::ForkRequest,
    ) -> Result<Outcome, HostError> {
        let names = req.names.clone().unwrap_or_default();
        if names.is_empty() {
            return Err(HostError::invalid(
                "a fork needs at least one branch",
                "ask for count >= 1",
            ));
        }
        let taken = self.checkpoint(name.clone(), Some(CheckpointKind::Full), None, None).await?;
        let point = full_point(&taken, "fork")?;
        let req = crab_common::api::ForkRequest {
            checkpoint: Some(point),
            count: names.len(),
            names: Some(names),
            fs_only: false,
            branch: req.branch,
        };
        self.fork(name, req, Arc::new(NoProgress)).await
    }

    pub(crate) async fn fork(
        self: &Arc<Self>,
        name: String,
        req: crab_common::api::ForkRequest,
        progress: Arc<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let _hold = self.engine.hold_background();
        let h = self.clone();
        let n = name.clone();
        // Bad branch settings are refused before anything is made.
        req.branch.deadline(crab_common::clock::now_ms())?;
        let (branches, offset) = blocking(move || {
            let offset = h.point_offset(&n, req.checkpoint.as_deref())?;
            let branches = h.checkpointer.fork_files_or_all(
                &n,
                req.checkpoint.as_deref(),
                req.count,
                req.names,
                crab_checkpoint::ForkOptions { fs_only: req.fs_only, verified: false },
                progress.as_ref(),
            )?;
            let names: Vec<String> = branches.iter().map(|b| b.sandbox.clone()).collect();
            if let Err(e) = h.settle_branches(&names, &req.branch) {
                tracing::warn!(error = %e.0.message, "fork branches: settings not applied");
            }
            for b in &branches {
                h.attach(&b.sandbox);
            }
            Ok((branches, offset))
        })
        .await?;
        for b in &branches {
            if let Some(off) = offset {
                if let Err(e) = self.coordinator.forked(&name, &b.sandbox, off).await {
                    tracing::warn!(sandbox = %b.sandbox, error = %e, "could not copy the conversation log");
                }
            }
            self.open_sandbox_proxy(&b.sandbox).await;
        }
        Ok(Outcome::Forked(branches))
    }

    pub(crate) async fn from_remote(
        self: &Arc<Self>,
        req: FromRemote,
        progress: Arc<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let t = self.tier()?;
        let (sb, point) = match req.source.split_once('@') {
            Some((s, p)) => (s.to_string(), Some(p.to_string())),
            None => (req.source.clone(), None),
        };
        crab_common::names::validate("sandbox", &sb)?;
        // Exports (the background lane) pause while the caller waits for this.
        let _hold = self.engine.hold_background();
        let t0 = std::time::Instant::now();
        let mut clock = crab_common::stats::StageClock::starting(t0);
        progress.stage("load_point", None);
        progress.message(&format!("remote point {}", req.source));
        let rec = t.repo.load_point(&sb, point.as_deref()).await.map_err(remote_error)?;
        clock.mark("load_point");
        if self.pull_point_image(&rec, progress.as_ref()).await {
            clock.mark("image_pull");
        }
        if !req.fs_only {
            let criu = blocking(|| Ok(criu_version())).await?;
            crab_remote::preflight(&rec, &crab_remote::HostFacts::local(), criu.as_deref())
                .map_err(remote_error)?;
            clock.mark("preflight");
        }
        // What the new sandboxes get is this host's decision (the caller's flags, else its
        // defaults); the point's sandbox_meta may ask for no more (checked before anything is
        // written, and again on the manifest as materialized).
        let limits = crab_sandbox::runtime::with_defaults(
            &req.limits.clone().unwrap_or_default(),
            &self.runtime.default_limits(),
        );
        crab_sandbox::runtime::validate_limits(&limits)?;
        let grant = crate::remote::Grant {
            net: req.net.unwrap_or_default(),
            limits,
            userns: self.runtime.userns(),
        };
        // Remote points live in a store of their own, never in a local sandbox's.
        let store = self.checkpointer.remote_store(&sb)?;
        let fs_only = req.fs_only;
        let mut fetch_ms = 0.0;
        progress.stage("materialize", None);
        // A local copy that fails its check in the fork (its images' SHA-256s are hashed there,
        // beside the branches' first stages) is discarded and fetched once more.
        let mut attempt = 0;
        let (mat, branches) = loop {
            attempt += 1;
            let mat = self.materialize_remote(&t.repo, &rec, &store, fs_only, &grant).await?;
            let mut template = crate::remote::admit_meta(&mat.manifest.sandbox_meta, &grant)
                .map_err(|refusal| {
                    remote_error(crab_remote::RemoteError::Refused {
                        point: format!("{}@{}", rec.sandbox, rec.point),
                        refusal,
                    })
                })?;
            template.image_config = crab_sandbox::image::defaults_of(self.state(), &template.image);
            if attempt == 1 {
                clock.restart();
                for (stage, ms) in &mat.stages {
                    clock.add(format!("materialize_{stage}"), *ms);
                }
                fetch_ms = t0.elapsed().as_secs_f64() * 1e3;
            }
            let h = self.clone();
            let (pid, count, names) = (rec.point.clone(), req.count, req.names.clone());
            let (fork_store, progress) = (store.clone(), progress.clone());
            let forked = blocking(move || {
                // The branches are built from the host's grant (`template`), never the point's
                // meta; the materialization checked the images against the default profile.
                let opts = crab_checkpoint::ForkOptions { fs_only, verified: false };
                let b = h.checkpointer.fork_remote(
                    &fork_store,
                    &pid,
                    count,
                    names,
                    opts,
                    &template,
                    progress.as_ref(),
                )?;
                for x in &b {
                    h.attach(&x.sandbox);
                }
                Ok(b)
            })
            .await;
            match forked {
                Ok(b) => {
                    // The copy's bytes are flushed off the caller's path (the branches' first
                    // points, which link to its images, are made after they answered).
                    let (flush_store, point) = (store.clone(), rec.point.clone());
                    tokio::task::spawn_blocking(move || {
                        if let Err(e) = crab_remote::local::flush(&flush_store, &point) {
                            tracing::warn!(point = %point, error = %e, "cannot flush a materialized point");
                        }
                    });
                    break (mat, b);
                }
                Err(e) if e.0.code == crab_common::ErrorCode::CorruptCheckpoint => {
                    let id = mat.manifest.id;
                    if let Ok(local) = store.load(id) {
                        tracing::warn!(point = %req.source, error = %e.0.message, "the local copy of a remote point failed its check; discarding it");
                        crab_remote::local::discard(&store, &local);
                    }
                    if mat.fetched || attempt > 1 {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        };
        clock.mark("fork");
        // The first branch's own split (the branches run side by side).
        if let Some(b) = branches.first() {
            for (stage, ms) in &b.stages {
                clock.add(format!("fork_{stage}"), *ms);
            }
        }
        for b in &branches {
            if let (Some(log), Some(off)) = (&mat.conversation, mat.manifest.conversation_offset) {
                let path = self.state().sandbox_dir(&b.sandbox).join("conversation.log");
                match std::fs::write(&path, log) {
                    Ok(()) => {
                        if let Err(e) = self.coordinator.restored(&b.sandbox, off, true).await {
                            tracing::warn!(sandbox = %b.sandbox, error = %e, "could not rewind the conversation log");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %b.sandbox, path = %path.display(), error = %e, "could not write the conversation log")
                    }
                }
            }
            self.open_sandbox_proxy(&b.sandbox).await;
        }
        clock.mark("attach");
        Ok(Outcome::FromRemote(Box::new(FromRemoteReport {
            source: format!("{}@{}", rec.sandbox, rec.point),
            downloaded: mat.fetched,
            base_image: mat.base_image.clone(),
            fetch_ms,
            total_ms: t0.elapsed().as_secs_f64() * 1e3,
            fs_only: req.fs_only,
            stages: clock.into_stages(),
            branches,
        })))
    }

    /// Make remote point `rec` local in `store` (a store of remote points), admitted by
    /// `grant`: see [`crab_remote::local::materialize`].
    pub(crate) async fn materialize_remote(
        self: &Arc<Self>,
        repo: &Arc<crab_remote::Repo>,
        rec: &crab_remote::PointRecord,
        store: &Arc<crab_checkpoint::Store>,
        fs_only: bool,
        grant: &crate::remote::Grant,
    ) -> Result<crab_remote::local::Materialized, HostError> {
        let (repo, rec2, mat_store) = (repo.clone(), rec.clone(), store.clone());
        let state = self.state().clone();
        let handle = tokio::runtime::Handle::current();
        let grant2 = grant.clone();
        tokio::task::spawn_blocking(move || {
            let disk_limit = grant2.limits.disk_bytes;
            let check = move |m: &crab_checkpoint::Manifest| {
                crate::remote::admit_meta(&m.sandbox_meta, &grant2).map(drop).map_err(|refusal| {
                    crab_remote::RemoteError::Refused {
                        point: format!("{}@{}", m.sandbox, m.id),
                        refusal,
                    }
                })
            };
            let admission = crab_remote::local::Admission { check: &check, disk_limit };
            handle.block_on(crab_remote::local::materialize(
                &repo, &state, &mat_store, &rec2, fs_only, &admission,
            ))
        })
        .await
        .map_err(|e| HostError::internal(format!("materializing a remote point panicked: {e}")))?
        .map_err(remote_error)
    }
}

impl Host {
    /// [`Action::Replace`].
    pub(super) async fn replace(
        self: &Arc<Self>,
        name: String,
        source: String,
        remote: bool,
        fs_only: bool,
    ) -> Result<Outcome, HostError> {
        let Some((sb, point)) = source.split_once('@') else {
            return Err(HostError::invalid(
                format!("replace source {source:?} names no point"),
                "give SB@POINT",
            ));
        };
        let (sb, point) = (sb.to_string(), point.to_string());
        crab_common::names::validate("sandbox", &sb)?;
        if sb == name && !remote {
            return Err(HostError::invalid(
                format!("sandbox {name} cannot be replaced by its own point"),
                format!("restore it instead: `crab restore {name} {point}`"),
            ));
        }
        let l = self.life_lock(&name);
        let _g = l.lock().await;
        let target = self.runtime().record(&name)?;
        // The point's store and conversation, everything fetched and checked before the
        // sandbox is touched.
        let (store, conversation) = if remote {
            let t = self.tier()?;
            let rec = t.repo.load_point(&sb, Some(&point)).await.map_err(remote_error)?;
            self.pull_point_image(&rec, &crab_common::NoProgress).await;
            if !fs_only {
                let criu = blocking(|| Ok(criu_version())).await?;
                crab_remote::preflight(&rec, &crab_remote::HostFacts::local(), criu.as_deref())
                    .map_err(remote_error)?;
            }
            // The point may ask for no more than the sandbox it replaces has.
            let grant = crate::remote::Grant {
                net: target.net,
                limits: target.limits.clone(),
                userns: target.profile.userns,
            };
            let store = self.checkpointer().remote_store(&sb)?;
            let mat = self.materialize_remote(&t.repo, &rec, &store, fs_only, &grant).await?;
            (store, mat.conversation.map(|log| (log, mat.manifest.conversation_offset)))
        } else {
            (self.checkpointer().store(&sb)?, None)
        };
        let h = self.clone();
        let (n, p) = (name.clone(), point.clone());
        let (report, offset) = blocking(move || {
            let offset = store.resolve(Some(&p))?.conversation_offset;
            h.detach(&n);
            let r = h.checkpointer().restore_from(&n, &store, &p, fs_only, &NoProgress);
            h.attach(&n);
            h.policy().clear(&n);
            let r = r?;
            h.set_life(&n, crab_common::life::Life::Running)?;
            if remote {
                // Its origin point flushed the pool (a point without processes: the snapshot
                // of its files did).
                crab_remote::local::mark_flushed(&store, &p);
            }
            Ok((r, offset))
        })
        .await?;
        // Its conversation: the point's, up to the point.
        match (conversation, offset) {
            (Some((log, Some(off))), _) => {
                let path = self.state().sandbox_dir(&name).join("conversation.log");
                self.coordinator.forget(&name);
                match std::fs::write(&path, log) {
                    Ok(()) => {
                        if let Err(e) = self.coordinator.restored(&name, off, true).await {
                            tracing::warn!(sandbox = %name, error = %e, "could not rewind the conversation log");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %name, path = %path.display(), error = %e, "could not write the conversation log")
                    }
                }
            }
            (None, Some(off)) if !remote => {
                if let Err(e) = self.coordinator.forked(&sb, &name, off).await {
                    tracing::warn!(sandbox = %name, from = %sb, error = %e, "could not copy the conversation log");
                }
            }
            _ => {}
        }
        self.open_sandbox_proxy(&name).await;
        tracing::info!(sandbox = %name, %source, remote, fs_only, "sandbox replaced");
        Ok(Outcome::Restored(report))
    }
}

/// Milliseconds from `a` to `b`.
fn ms_between(a: std::time::Instant, b: std::time::Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1e3
}
