//! [`Checkpointer::fork`] and its kin: new sandboxes from a point (a local one, files only,
//! or one materialized from a remote store), each claimed, given its own root and incarnated.

use super::*;
use crate::store::StoreLock;

/// Stages and their times, ms.
type Stages = Vec<(String, f64)>;

impl Checkpointer {
    /// Create `count` new sandboxes from a restore point of `sandbox` (newest when `None`),
    /// restored in parallel. Branch names are `names` when given (one per branch), else
    /// `<sandbox>-<point>-<n>`. Reports its stages (`verify`, then `branches` advancing by one
    /// per branch up) to `progress`.
    pub fn fork(
        &self,
        sandbox: &str,
        point: Option<&str>,
        count: usize,
        names: Option<Vec<String>>,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        self.fork_files_or_all(sandbox, point, count, names, ForkOptions::default(), progress)
    }

    /// [`Checkpointer::fork`] with [`ForkOptions`]: with `fs_only`, the branches
    /// get the point's files and a fresh init, not its processes (an E2B filesystem snapshot).
    pub fn fork_files_or_all(
        &self,
        sandbox: &str,
        point: Option<&str>,
        count: usize,
        names: Option<Vec<String>>,
        opts: ForkOptions,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        let store = self.store(sandbox)?;
        self.fork_from(&store, point, count, names, opts, None, progress)
    }

    /// Fork from point `point` of `store`, a store of points materialized from a remote
    /// store ([`Checkpointer::remote_store`]). The branches' records are built from
    /// `template` — the network mode, limits, profile and image the restoring host grants —
    /// and never from the point's own `sandbox_meta`, which is not trusted. The caller has
    /// materialized the point (`crab_remote::local::materialize`), which verified its images
    /// and checked them against the default profile.
    #[allow(clippy::too_many_arguments)]
    pub fn fork_remote(
        &self,
        store: &Arc<Store>,
        point: &str,
        count: usize,
        names: Option<Vec<String>>,
        opts: ForkOptions,
        template: &SandboxRecord,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        self.fork_from(store, Some(point), count, names, opts, Some(template), progress)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fork_from(
        &self,
        store: &Arc<Store>,
        point: Option<&str>,
        count: usize,
        names: Option<Vec<String>>,
        opts: ForkOptions,
        template: Option<&SandboxRecord>,
        progress: &dyn Progress,
    ) -> Result<Vec<ForkBranch>> {
        let sandbox = store.sandbox();
        if count == 0 || count > 256 {
            return Err(CheckpointError::Invalid("--count must be between 1 and 256".into()));
        }
        let mut m = store.resolve(point)?;
        // The point's images are hashed beside the branches' first stages (snapshot, quota,
        // origin point, cgroup); a branch restores processes only once they checked out, and
        // a point that does not check out fails the whole fork (its branches are removed).
        let to_verify = (!opts.verified).then(|| m.clone());
        if to_verify.is_some() {
            progress.stage("verify", None);
        }
        if opts.fs_only {
            m.procs = None;
        }
        let fs = m.fs.clone().ok_or_else(|| {
            CheckpointError::Invalid(format!("restore point {} has no filesystem snapshot", m.id))
        })?;
        let mut src: SandboxRecord = match (template, self.rt.record(sandbox)) {
            (Some(t), _) => t.clone(),
            (None, Ok(r)) => r,
            (None, Err(_)) => serde_json::from_value(m.sandbox_meta.clone()).map_err(|e| {
                CheckpointError::corrupt(
                    &store.manifest_path(m.id),
                    format!("sandbox_meta is not a sandbox record: {e}"),
                )
            })?,
        };
        // A remote point's branches (those with a template): never `--privileged` nor host
        // networking. Its images were checked against the default profile
        // ([`crate::foreign::check`]) when it was materialized, as they were verified.
        if template.is_some() {
            if src.net == NetMode::Host {
                return Err(CheckpointError::Invalid(format!(
                    "point {} of {sandbox} is of a sandbox with host networking, which a remote \
                     point is never given",
                    m.id
                )));
            }
            src.profile.privileged = false;
        }
        let names = match names {
            Some(n) if n.len() == count => n,
            Some(n) => {
                return Err(CheckpointError::Invalid(format!(
                    "{} names given for {count} branches",
                    n.len()
                )))
            }
            // `<sandbox>-<point>-<i>`, skipping the i of branches an earlier fork of the
            // same point made (a second unnamed fork would otherwise collide with the first).
            None => {
                let mut out = Vec::with_capacity(count);
                let mut i = 0usize;
                while out.len() < count {
                    i += 1;
                    let suffix = format!("-{}-{i}", m.id);
                    let keep = crab_common::names::MAX_NAME_LEN.saturating_sub(suffix.len());
                    let n = format!("{}{suffix}", &sandbox[..sandbox.len().min(keep)]);
                    if self.rt.record(&n).is_err() {
                        out.push(n);
                    }
                }
                out
            }
        };
        for n in &names {
            crab_common::names::validate("sandbox", n)
                .map_err(|e| CheckpointError::Invalid(e.message))?;
        }
        let criu = if m.procs.is_some() { Some(self.criu()?) } else { None };
        self.check_room(sandbox, "fork")?;
        let origin = Origin { sandbox: sandbox.to_owned(), point: m.id };
        progress.stage("branches", Some(count as u64));
        let done = std::sync::atomic::AtomicU64::new(0);
        let gate = VerifyGate::default();
        let (results, verified): (Vec<Result<(ForkBranch, PendingOrigin)>>, Result<()>) =
            std::thread::scope(|s| {
                let verifier = to_verify.as_ref().map(|vm| {
                    let (store, gate) = (&store, &gate);
                    s.spawn(move || {
                        // Opened (closed) even if the hashing panics: no branch waits forever.
                        let _shut = GateGuard(gate);
                        let r = store.verify(vm);
                        gate.open(r.is_ok());
                        r
                    })
                });
                if verifier.is_none() {
                    gate.open(true);
                }
                let handles: Vec<_> = names
                    .iter()
                    .map(|name| {
                        let (store, m, fs, src, criu, origin, done, gate) =
                            (&store, &m, &fs, &src, criu.as_ref(), &origin, &done, &gate);
                        s.spawn(move || {
                            let r = self.fork_one(store, m, fs, src, criu, origin, name, gate);
                            if r.is_ok() {
                                let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                                progress.advance(n);
                            }
                            r
                        })
                    })
                    .collect();
                let results = handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(CheckpointError::Invalid("a fork branch panicked".into()))
                        })
                    })
                    .collect();
                let verified = verifier.map_or(Ok(()), |v| {
                    v.join().unwrap_or_else(|_| {
                        Err(CheckpointError::Invalid("verification thread panicked".into()))
                    })
                });
                (results, verified)
            });
        let mut out = Vec::new();
        let mut pending = Vec::new();
        // A point that did not verify is the error, whatever its branches then said.
        let mut first_err = verified.err();
        for r in results {
            match r {
                Ok((b, p)) => {
                    out.push(b);
                    pending.push(p);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            // All or nothing: remove the branches that did come up (no first points made).
            for p in pending {
                p.discard();
            }
            for b in &out {
                if let Err(e) = self.rt.remove(&b.sandbox, true) {
                    tracing::warn!(sandbox = %b.sandbox, error = %e, "cannot remove fork branch");
                }
                if let Err(e) = self.remove_all(&b.sandbox) {
                    tracing::warn!(sandbox = %b.sandbox, error = %e, "cannot remove points of fork branch");
                }
            }
            return Err(e);
        }
        // The source's tree is what the first points are made from: its store's lock, when
        // free now (the source may be checkpointing), keeps its points from being removed
        // until they are made.
        let source_held = match store.try_lock() {
            Ok(held) => held,
            Err(e) => {
                tracing::warn!(sandbox, error = %e, "cannot lock the fork's source points");
                None
            }
        };
        self.make_origins(pending, source_held);
        Ok(out)
    }

    /// Make and publish the branches' first points on a thread of their own, one after the
    /// other, after the branches answered: each holds its branch's store lock, so nothing
    /// else checkpoints, restores or removes that branch before it is done, and listing its
    /// points waits for it ([`Checkpointer::origin_settled`]).
    fn make_origins(&self, pending: Vec<PendingOrigin>, source_held: Option<StoreLock>) {
        if pending.is_empty() {
            return;
        }
        let origins = self.origins.clone();
        let gates: Vec<(String, Arc<VerifyGate>)> = {
            let mut map = origins.lock().unwrap_or_else(|p| p.into_inner());
            pending
                .iter()
                .map(|p| {
                    let g = Arc::new(VerifyGate::default());
                    map.insert(p.name().to_owned(), g.clone());
                    (p.name().to_owned(), g)
                })
                .collect()
        };
        let run = move || {
            for (p, (name, gate)) in pending.into_iter().zip(gates) {
                let t = Instant::now();
                match p.publish() {
                    Ok(o) => {
                        tracing::info!(sandbox = %name, point = %o.id, ms = ms(t.elapsed()), "fork branch's first point published")
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %name, error = %e, "the fork branch's first point could not be made; it has no restore point until its next checkpoint")
                    }
                }
                let mut map = origins.lock().unwrap_or_else(|p| p.into_inner());
                if map.get(&name).is_some_and(|g| Arc::ptr_eq(g, &gate)) {
                    map.remove(&name);
                }
                drop(map);
                gate.open(true);
            }
            drop(source_held);
        };
        // The closure is moved into the thread, or run here when no thread can be made.
        let run = std::sync::Arc::new(Mutex::new(Some(run)));
        let theirs = run.clone();
        let spawned =
            std::thread::Builder::new().name("crab-fork-origins".into()).spawn(move || {
                if let Some(f) = theirs.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    f();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread for the fork branches' first points; making them now");
            if let Some(f) = run.lock().unwrap_or_else(|p| p.into_inner()).take() {
                f();
            }
        }
    }

    /// Wait until `sandbox`'s first point, when it is a fork branch whose point is still
    /// being made, is published (or failed).
    pub(super) fn origin_settled(&self, sandbox: &str) {
        let gate = self.origins.lock().unwrap_or_else(|p| p.into_inner()).get(sandbox).cloned();
        if let Some(g) = gate {
            let _ = g.wait();
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fork_one(
        &self,
        store: &Store,
        m: &Manifest,
        fs: &crate::manifest::FsPart,
        src: &SandboxRecord,
        criu: Option<&Criu>,
        origin: &Origin,
        name: &str,
        gate: &VerifyGate,
    ) -> Result<(ForkBranch, PendingOrigin)> {
        let t = Instant::now();
        let state = self.rt.state();
        if self.rt.record(name).is_ok() {
            return Err(CheckpointError::Invalid(format!(
                "a sandbox named {name:?} already exists"
            )));
        }
        let lock = self.lock(name);
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let branch = self.store(name)?;
        let held = branch.lock()?;
        if !branch.point_ids()?.is_empty() {
            return Err(CheckpointError::Invalid(format!(
                "restore points of an earlier sandbox named {name:?} exist in {}; remove them or pick another name",
                branch.dir().display()
            )));
        }
        // Claim the name with a directory that holds a record from its first moment, of a
        // sandbox not running yet: a runtime opened meanwhile on this state directory (another
        // process, a restarted daemon) adopts it, where a directory without a record would be
        // discarded as a half-created sandbox, deleting the root and killing the restore in
        // the branch's cgroup under our feet.
        let dir = state.sandbox_dir(name);
        let mut rec = SandboxRecord {
            format: src.format,
            name: name.to_owned(),
            image: src.image.clone(),
            created_at: now_ms() / 1000,
            init_pid: 0,
            init_start: 0,
            net: src.net,
            hostname: name.to_owned(),
            limits: src.limits.clone(),
            cgroup: Some(self.rt.new_cgroup_rel(name)),
            profile: src.profile,
            nat: None,
            held: None,
            // A branch checkpoints like its source, and carries its labels and environment;
            // it runs, with no deadline and no labelled points of its own.
            checkpoint_policy: src.checkpoint_policy,
            harness: src.harness.clone(),
            life: crab_common::life::Life::Running,
            deadline_ms: None,
            on_deadline: src.on_deadline,
            labels: src.labels.clone(),
            env: src.env.clone(),
            template: src.template.clone(),
            point_labels: Default::default(),
            image_config: src.image_config.clone(),
        };
        crab_sandbox::runtime::claim_dir(state, &rec).map_err(sandbox_err(name))?;
        let result = self.fork_into(store, &branch, m, fs, src, criu, &mut rec, gate);
        match result {
            Ok((pid, stages, origin_of)) => {
                tracing::info!(sandbox = name, from = %origin.sandbox, point = %origin.point, "fork branch up");
                let b = ForkBranch {
                    sandbox: name.to_owned(),
                    init_pid: pid,
                    ms: ms(t.elapsed()),
                    stages,
                };
                Ok((b, PendingOrigin { branch, held, parts: origin_of }))
            }
            Err(e) => {
                tracing::warn!(sandbox = name, error = %e, "fork branch failed; removing it");
                self.rt.nat().release(name);
                let cg = self.rt.cgroup(name);
                if let Err(e) = cg.destroy() {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove cgroup of failed branch");
                }
                let rootfs = state.sandbox_rootfs(name);
                if let Err(e) = self.fs.delete(&rootfs) {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove root of failed branch");
                }
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove directory of failed branch");
                }
                // Its points go; its CRIU log stays, since the error names it.
                if let Err(e) = branch.remove_all() {
                    tracing::warn!(sandbox = name, error = %e, "cannot remove points of failed branch");
                }
                drop(held);
                self.stores.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
                Err(e)
            }
        }
    }

    /// Build branch `rec.name` (whose directory exists) from point `m` of `store`: its root,
    /// its cgroup, its processes; then record it as running. Returns its init's pid, the time
    /// of each of those stages (ms) and what its first point is made from, after it answered
    /// ([`PendingOrigin`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fork_into(
        &self,
        store: &Store,
        branch: &Store,
        m: &Manifest,
        fs: &crate::manifest::FsPart,
        src: &SandboxRecord,
        criu: Option<&Criu>,
        rec: &mut SandboxRecord,
        gate: &VerifyGate,
    ) -> Result<(u32, Stages, OriginParts)> {
        let name = rec.name.clone();
        let name = name.as_str();
        let state = self.rt.state();
        let rootfs = state.sandbox_rootfs(name);
        let mut clock = crab_common::stats::StageClock::starting(Instant::now());
        let source_fs = store.fs_path(fs.id);
        self.fs
            .snapshot(&source_fs, &rootfs, false)
            .map_err(|e| CheckpointError::io("snapshot", &rootfs, e))?;
        clock.mark("snapshot");
        // A branch inherits its source's disk quota (its record carries `src.limits`).
        self.rt.limit_disk(&rootfs, &src.limits).map_err(sandbox_err(name))?;
        clock.mark("quota");
        let machine_id = new_machine_id();
        personalize_as(&rootfs, name, src.profile.userns, &machine_id)
            .map_err(sandbox_err(name))?;
        clock.mark("personalize");
        let mut meta = src.clone();
        meta.name = name.to_owned();
        meta.hostname = name.to_owned();
        meta.cgroup = rec.cgroup.clone();
        // The restore reads its own set of links to the images (a prune of the source cannot
        // pull them away); the branch's first point links to these, and removes them.
        let imgs = match &m.procs {
            Some(p) if criu.is_some() => {
                let dir = branch.tmp_dir().join(format!("{}.restore", p.id));
                link_images(&store.proc_dir(p.id), &dir, p)?;
                Some(dir)
            }
            _ => None,
        };
        clock.mark("image_links");
        let parts = OriginParts { source_fs, m: m.clone(), meta, machine_id, imgs };
        let (pid, proc_stages) = self
            .fork_processes(name, m, src, criu, parts.imgs.as_deref(), gate, &rootfs)
            .inspect_err(|_| parts.remove_links())?;
        for (stage, ms) in proc_stages {
            clock.add(stage, ms);
        }
        clock.restart();
        let recorded = (|| {
            rec.init_start = process_start_time(pid).ok_or_else(|| CheckpointError::Sandbox {
                sandbox: name.to_owned(),
                message: format!("the restored init {pid} died right after the restore"),
            })?;
            rec.init_pid = pid;
            rec.created_at = now_ms() / 1000;
            self.rt.update(rec.clone()).map_err(sandbox_err(name))
        })();
        if let Err(e) = recorded {
            parts.remove_links();
            return Err(e);
        }
        clock.mark("record");
        Ok((pid, clock.into_stages(), parts))
    }

    /// A branch's cgroup, address and processes (CRIU's restore from `imgs`, else a fresh
    /// init), once `gate` says the point verified; its init's pid and the stages' times.
    #[allow(clippy::too_many_arguments)]
    fn fork_processes(
        &self,
        name: &str,
        m: &Manifest,
        src: &SandboxRecord,
        criu: Option<&Criu>,
        imgs: Option<&Path>,
        gate: &VerifyGate,
        rootfs: &Path,
    ) -> Result<(u32, Vec<(String, f64)>)> {
        let mut clock = crab_common::stats::StageClock::starting(Instant::now());
        let cg = self.rt.cgroup(name);
        cg.create_for(&src.limits, &src.profile).map_err(cg_err(name))?;
        clock.mark("cgroup");
        if src.net == NetMode::Nat {
            // The branch's own address, from its source's range.
            let range = src.nat.as_ref().map(|l| l.range.as_str());
            self.rt.nat().allocate(name, range).map_err(sandbox_err(name))?;
        }
        let waited = std::time::Instant::now();
        gate.wait()?;
        clock.add("wait_verify", waited.elapsed().as_secs_f64() * 1e3);
        clock.restart();
        let pid = match (&m.procs, criu, imgs) {
            (Some(p), Some(criu), Some(imgs)) => {
                let log =
                    self.log_dir(name)?.join(format!("fork-{}-{}-restore.log", m.sandbox, p.id));
                let paths = cgroup_paths(&cg);
                let cgroups = std::iter::once(paths.v2).chain(paths.v1).collect();
                let mut opts = self.restore_opts(imgs, log, rootfs, cgroups, &src.profile, src.net);
                opts.external.extend(self.masked_external(name, &src.profile)?);
                let net = self.restore_net(name, src.net, &src.profile, &mut opts)?;
                let r = criu.restore_with(&opts, |n| {
                    net.hook(&n)?;
                    if n.phase == phase::POST_RESTORE {
                        if let Some(pid) = n.pid {
                            set_hostname_of(pid, name)?;
                        }
                    }
                    Ok(())
                })?;
                let pid = u32::try_from(r.pid).unwrap_or(0);
                net.finish(pid)?;
                pid
            }
            _ => {
                self.rt
                    .start_init(name, src.net, &src.limits, src.profile)
                    .map_err(sandbox_err(name))?
                    .0
            }
        };
        clock.mark("processes");
        Ok((pid, clock.into_stages()))
    }
}

/// Hard links in `dir` (made here) to the image files of `p` in `src`.
fn link_images(src: &Path, dir: &Path, p: &crate::manifest::ProcPart) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| CheckpointError::io("remove", dir, e))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io("mkdir", dir, e))?;
    for f in &p.files {
        crate::manifest::check_image_name(&f.name)
            .map_err(|why| CheckpointError::corrupt(src, why))?;
        let (from, to) = (src.join(&f.name), dir.join(&f.name));
        std::fs::hard_link(&from, &to).map_err(|e| CheckpointError::io("link", &to, e))?;
    }
    Ok(())
}

/// Whether a fork's source point verified, for the branches that wait on it before their
/// processes are restored from its images.
#[derive(Default, Debug)]
pub(super) struct VerifyGate {
    state: Mutex<Option<bool>>,
    cv: std::sync::Condvar,
}

impl VerifyGate {
    /// Give the verdict (the first one given stands).
    fn open(&self, ok: bool) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.is_none() {
            *st = Some(ok);
        }
        self.cv.notify_all();
    }

    /// Wait for the verdict: Ok when the point checked out.
    fn wait(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while st.is_none() {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match *st {
            Some(true) => Ok(()),
            _ => Err(CheckpointError::Invalid(
                "the source point did not verify; no processes were restored".into(),
            )),
        }
    }
}

/// Says "did not verify" when dropped before a verdict (a panicking verifier).
struct GateGuard<'a>(&'a VerifyGate);

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        self.0.open(false);
    }
}

/// What a fork branch's first point is made from once the branch runs: its source point's
/// tree, personalized as the branch's root was before anything ran in it, and the links to
/// the images its processes were restored from.
pub(super) struct OriginParts {
    source_fs: PathBuf,
    m: Manifest,
    meta: SandboxRecord,
    machine_id: String,
    imgs: Option<PathBuf>,
}

impl OriginParts {
    fn remove_links(&self) {
        if let Some(dir) = &self.imgs {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!(path = %dir.display(), error = %e, "cannot remove a fork's image links");
            }
        }
    }
}

/// A fork branch's first point, to be made after the branch answered, with its store's lock
/// held from the fork on (nothing checkpoints, restores or removes the branch before).
pub(super) struct PendingOrigin {
    branch: Arc<Store>,
    held: StoreLock,
    parts: OriginParts,
}

impl PendingOrigin {
    /// Make and publish the point: a writable snapshot of the source's tree personalized
    /// exactly as the branch's root was (same name, same machine-id) and sealed read-only —
    /// not a snapshot of the branch's root, which its processes now write to — and hard
    /// links to the images, their hashes carried over; one syncfs, the manifest. These btrfs
    /// commits and that flush slowed a CRIU restore beside them by about 30 ms, and cost 10–15
    /// ms before it: after the answer they delay neither.
    fn publish(self) -> Result<Manifest> {
        let PendingOrigin { branch, held, parts } = self;
        let name = parts.meta.name.as_str();
        let made = (|| {
            let mut staging = branch.begin();
            staging.snapshot_fs_edited(&parts.source_fs, |dst| {
                personalize_as(dst, name, parts.meta.profile.userns, &parts.machine_id)
                    .map_err(sandbox_err(name))
            })?;
            let draft =
                origin_draft_from(&mut staging, parts.imgs.as_deref(), &parts.m, &parts.meta)?;
            staging.publish(draft)
        })();
        parts.remove_links();
        drop(held);
        made
    }

    /// Give it up (a fork whose other branches failed: this branch is removed).
    fn discard(self) {
        self.parts.remove_links();
    }

    fn name(&self) -> &str {
        &self.parts.meta.name
    }
}

/// The draft of a point equal to point `m` of `src_store`, in `staging` (whose filesystem
/// snapshot the caller took): hard links to `m`'s image files (immutable once published),
/// whose hashes are carried over, `m` as its origin, `meta` as its sandbox's record. A
/// replaced sandbox's first point is made so.
pub(super) fn origin_draft(
    staging: &mut crate::store::Staging<'_>,
    src_store: &Store,
    m: &Manifest,
    meta: &SandboxRecord,
) -> Result<Draft> {
    let dir = m.procs.as_ref().map(|p| src_store.proc_dir(p.id));
    origin_draft_from(staging, dir.as_deref(), m, meta)
}

/// [`origin_draft`] with `m`'s image files in `src_dir` (its own directory, or links to it).
fn origin_draft_from(
    staging: &mut crate::store::Staging<'_>,
    src_dir: Option<&Path>,
    m: &Manifest,
    meta: &SandboxRecord,
) -> Result<Draft> {
    let procs = m.procs.as_ref().zip(src_dir);
    let mut draft =
        Draft::new(if procs.is_some() { PointKind::FULL } else { PointKind::FS }, m.turn);
    if let Some((p, src_dir)) = procs {
        let dir = staging.proc_dir()?;
        for f in &p.files {
            let (from, to) = (src_dir.join(&f.name), dir.join(&f.name));
            std::fs::hard_link(&from, &to).map_err(|e| CheckpointError::io("link", &to, e))?;
        }
        draft.trusted_files = Some(p.files.clone());
        draft.root_pid = p.root_pid;
        draft.criu_version = p.criu_version.clone();
    } else {
        draft.no_procs = true;
    }
    draft.conversation_offset = m.conversation_offset;
    draft.origin = Some(Origin { sandbox: m.sandbox.clone(), point: m.id });
    draft.sandbox_meta = serde_json::to_value(meta).unwrap_or_default();
    Ok(draft)
}
