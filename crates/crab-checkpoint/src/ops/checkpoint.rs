//! [`Checkpointer::checkpoint`]: the fs / process / full / skip checkpoint of a live sandbox
//! (freeze, CRIU dump with the filesystem snapshot taken in its post-dump notification, publish).

use super::*;

impl Checkpointer {
    /// Take a checkpoint of `sandbox` and publish it as a new restore point. (It reports no
    /// progress: it runs as an engine job, inside a turn or behind `crab checkpoint`'s answer,
    /// and its stages are timed in the manifest instead.)
    pub fn checkpoint(&self, sandbox: &str, req: CheckpointRequest) -> Result<Manifest> {
        let started = Instant::now();
        let lock = self.lock(sandbox);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.rt.record(sandbox).map_err(sandbox_err(sandbox))?;
        let store = self.store(sandbox)?;
        let _held = store.lock()?;
        let lock_us = us(started.elapsed());
        let parent = match store.newest() {
            Ok(m) => Some(m),
            Err(CheckpointError::NoPoints { .. }) => None,
            Err(e) => return Err(e),
        };
        let turn = req.turn.unwrap_or_else(|| parent.as_ref().map_or(0, |p| p.turn + 1));
        let mut draft = Draft::new(req.kind, turn);
        draft.timings.lock_us = Some(lock_us);
        draft.conversation_offset = req.conversation_offset;
        draft.started = Some(started);
        draft.sandbox_meta = serde_json::to_value(&rec).unwrap_or_default();
        let alive = Self::alive(&rec);
        let rootfs = self.rt.state().sandbox_rootfs(sandbox);
        let cg = self.rt.cgroup(sandbox);
        let mut staging = store.begin();

        match req.kind {
            CheckpointKind::Skip => {}
            CheckpointKind::Fs => {
                let t0 = Instant::now();
                let frozen = if alive && self.cfg.freeze_fs_snapshots {
                    Some(Freeze::new(&cg, sandbox)?)
                } else {
                    None
                };
                let t1 = Instant::now();
                let snap = staging.snapshot_fs(&rootfs);
                draft.timings.fs_snapshot_us = Some(us(t1.elapsed()));
                if let Some(f) = frozen {
                    f.thaw()?;
                    draft.timings.frozen_us = Some(us(t0.elapsed()));
                }
                snap?;
                if parent.as_ref().is_some_and(|p| p.procs.is_none()) {
                    draft.no_procs = true;
                }
            }
            CheckpointKind::Process | CheckpointKind::Full => {
                if !alive {
                    return Err(CheckpointError::Sandbox {
                        sandbox: sandbox.to_owned(),
                        message: format!(
                            "its init {} is gone, so there are no processes to checkpoint; take an fs checkpoint or restore it",
                            rec.init_pid
                        ),
                    });
                }
                let criu = self.criu()?;
                let images = staging.proc_dir()?;
                let image_name = images
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let log = self.log_dir(sandbox)?.join(format!("{image_name}-dump.log"));
                let mut opts =
                    DumpOpts::new(i32::try_from(rec.init_pid).unwrap_or(i32::MAX), &images, &log);
                opts.log_level = self.cfg.criu_log_level;
                opts.leave_running = true;
                opts.track_mem = self.cfg.track_mem;
                opts.tcp_established = true;
                // A connection still in a listen queue cannot be dumped; rather than fail the
                // checkpoint, leave it out (its client sees a reset after a restore).
                opts.tcp_skip_in_flight = true;
                opts.ext_unix_sk = true;
                opts.file_locks = true;
                opts.network_lock = Some(NetworkLockMethod::Nftables);
                let use_freezer = self.cfg.cgroup_freezer;
                if use_freezer {
                    opts.freeze_cgroup = Some(cg.v2.clone());
                }
                opts.manage_cgroups = Some(CgroupMode::Ignore);
                if !rec.profile.privileged {
                    // The masked directories' empty tmpfs: re-created by the restore, not
                    // archived with tar (see `profile::MASKED_MOUNT_KEY`).
                    opts.external.extend(crab_sandbox::profile::masked_dump_externals());
                }
                if rec.profile.userns.is_some() {
                    // The host's device nodes bound into its /dev (and over masked files).
                    opts.external
                        .extend(crab_sandbox::profile::device_dump_externals(rec.init_pid));
                }
                let full = req.kind == CheckpointKind::Full;
                let fs_path = if full { Some(staging.fs_path()) } else { None };
                let mut snap_us = None;
                let mut snap_err = None;
                let mut staging_fallback = false;
                let fs = self.fs.clone();
                // Freeze the cgroup ourselves: CRIU then finds it frozen and skips its own
                // freeze loop (which polls every 100 ms), and leaves it frozen for us to thaw.
                let t0 = Instant::now();
                let frozen = if use_freezer { Some(Freeze::new(&cg, sandbox)?) } else { None };
                let stats = criu.dump_with(&opts, |n| {
                    if n.phase == phase::POST_DUMP {
                        if let Some(dst) = &fs_path {
                            let t = Instant::now();
                            if let Err(e) = fs.snapshot(&rootfs, dst, true) {
                                snap_err = Some(CheckpointError::io("snapshot", dst, e));
                                return Err("filesystem snapshot failed".into());
                            }
                            snap_us = Some(us(t.elapsed()));
                        }
                    }
                    Ok(())
                });
                let dump_us = us(t0.elapsed());
                if let Some(f) = frozen {
                    f.thaw()?;
                }
                if let Some(e) = snap_err {
                    return Err(e);
                }
                let stats = match stats {
                    Ok(s) => s,
                    Err(e) => {
                        // A CRIU that died (killed, timed out) cannot unlock the network it
                        // locked: do it, or the sandbox stays offline until the next start.
                        if rec.net != crab_common::api::NetMode::Host {
                            drop_criu_network_locks(sandbox, rec.init_pid);
                        }
                        // The sandbox's processes cannot be dumped (a mount CRIU refuses,
                        // say): publish its files at least, saying why processes are missing.
                        let reason = format!("CRIU could not dump the processes: {e}");
                        tracing::warn!(sandbox, error = %e, "dump failed; publishing the filesystem only");
                        staging.discard_proc()?;
                        if let Some(p) = &fs_path {
                            if self.fs.is_snapshot(p) {
                                self.fs
                                    .delete(p)
                                    .map_err(|e| CheckpointError::io("delete", p, e))?;
                            }
                        }
                        let frozen = if self.cfg.freeze_fs_snapshots {
                            Some(Freeze::new(&cg, sandbox)?)
                        } else {
                            None
                        };
                        let t1 = Instant::now();
                        let snap = staging.snapshot_fs(&rootfs);
                        draft.timings.fs_snapshot_us = Some(us(t1.elapsed()));
                        if let Some(f) = frozen {
                            f.thaw()?;
                        }
                        snap?;
                        draft.kind = PointKind::FS;
                        draft.no_procs = true;
                        draft.procs_missing = Some(reason);
                        staging_fallback = true;
                        crab_criu::DumpStats::default()
                    }
                };
                draft.timings.dump_us = Some(dump_us);
                if !staging_fallback {
                    draft.timings.fs_snapshot_us = snap_us;
                    // Our freeze spans the whole dump; CRIU's own figure otherwise.
                    draft.timings.frozen_us = if use_freezer {
                        Some(us(t0.elapsed()))
                    } else {
                        stats.frozen_time.map(us)
                    };
                    draft.root_pid = opts.pid;
                    draft.criu_version = self.criu_version(&criu);
                }
            }
        }
        if staging_has_fs(draft.kind) {
            // Simple quotas charge every extent to the subvolume that allocated it: the growth
            // of the live root's count since the previous snapshot is what this turn wrote.
            let written = crab_sandbox::quota::exclusive_bytes(&rootfs);
            draft.fs_written_bytes = written;
            draft.fs_delta_bytes = written.map(|now| {
                now.saturating_sub(
                    parent
                        .as_ref()
                        .and_then(|p| p.fs.as_ref())
                        .and_then(|f| f.written_bytes)
                        .unwrap_or(0),
                )
            });
        }
        let m = staging.publish(draft)?;
        tracing::info!(
            sandbox,
            point = %m.id,
            kind = m.kind.as_str(),
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "checkpoint published"
        );
        Ok(m)
    }
}
