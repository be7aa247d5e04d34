//! [`Host`]: start-up (runtime, inspector, checkpoint recovery, engine, LLM proxy, adoption of
//! surviving sandboxes) and [`Host::execute`], the one place every lifecycle chain lives:
//!
//! * create: runtime create → inspector attach → in-sandbox proxy endpoint;
//! * remove: runtime remove → restore points removed → inspector detach → proxy endpoint
//!   closed → proxy state forgotten;
//! * checkpoint / turn: inspector verdict → [`TurnPolicy`] → engine job (urgent when a client
//!   waits) → executor publishes;
//! * restore: inspector detach → checkpointer restore → attach (whatever happened) → policy
//!   forgets a pending failure → conversation log rewound to the point → proxy endpoint
//!   reopened in the new network namespace;
//! * fork: checkpointer fork → each branch attached → its conversation log copied → its proxy
//!   endpoint opened;
//! * from a remote point: fetch and materialize it into the local store → fork from it, as
//!   above, with the conversation log the point carried.
//!
//! Split by flow: this file opens the host and dispatches every action (`execute`), creates
//! and removes sandboxes and keeps their inspector and proxy attachments; `turns.rs` takes
//! restore points (turn boundaries, explicit checkpoints, the conversation); `incarnations.rs`
//! makes points into running sandboxes (restore, fork, from the remote); a sandbox's life is
//! `../lifecycle.rs`, its processes and files `../procs.rs` and `../files.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crab_checkpoint::{Checkpointer, PointSummary};
use crab_common::api::{FeatureStatus, Features, NetMode, SandboxState, VersionInfo, API_VERSION};
use crab_common::paths::StateDir;
use crab_common::ApiError;
use crab_common::{CheckpointKind, CheckpointPolicy, NoProgress, Progress};
use crab_coordinator::{
    bind_in_netns, Boundary, BoundaryTicket, Coordinator, ProxyConfig, ProxyServer, ReadyTicket,
};
use crab_engine::{Engine, EngineConfig, JobHandle, JobSpec};
use crab_inspector::Inspector;
use crab_sandbox::{image, Runtime, RuntimeConfig};

use crate::glue::{CheckpointExecutor, Hooks, JobTicket, Payload, SandboxDir};
use crate::remote::{remote_error, FromRemote, FromRemoteReport, RemoteOptions, RemoteTier};
use crate::{
    Action, Decision, HarnessMarked, HostError, Outcome, PointView, Pruned, Taken, TopView,
    TurnMarked, TurnPolicy,
};

mod incarnations;
mod pull;
pub use pull::{is_reference, CredentialSource, PullPolicy};
mod push;
mod turns;

pub(crate) use turns::full_point;
use turns::{cap_eff, has_sys_resource};

/// Where agents inside a sandbox reach the proxy (in the sandbox's own network namespace).
pub const IN_SANDBOX_PROXY: &str = "127.0.0.1:7431";

/// How to open a [`Host`].
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// State directory.
    pub state: StateDir,
    /// Size of a new sparse pool image.
    pub pool_size: u64,
    /// The `crab` binary; the namespace helpers (`__start-sandbox`, `__nsexec`) run from the
    /// small `crab-nsexec` beside it when that was built from the same sources, else from it.
    pub helper_exe: PathBuf,
    /// The LLM proxy's configuration (listen address, upstreams).
    pub proxy: ProxyConfig,
    /// Engine tunables.
    pub engine: EngineConfig,
    /// The durable tier (`--remote`), if any.
    pub remote: Option<RemoteOptions>,
    /// Default address range of `nat` sandboxes (`crab daemon --nat-range`); `None` keeps
    /// [`crab_sandbox::net::DEFAULT_NAT_RANGE`].
    pub nat_range: Option<String>,
    /// Limits of sandboxes created without their own (`crab daemon --default-memory`,
    /// `--default-pids`, `--default-disk`; `crab_sandbox::runtime::DEFAULT_LIMITS` by default).
    pub default_limits: crab_common::api::Limits,
    /// Remount cgroup2 with `favordynmods` if it lacks it (`crab daemon
    /// --no-cgroup-favordynmods` turns this off).
    pub cgroup_favordynmods: bool,
    /// The user-namespace range of new sandboxes (`crab daemon --userns-base`; `None`:
    /// `crab daemon --userns host`, the host's own).
    pub userns: Option<crab_common::api::IdRange>,
    /// Ready-made root filesystems kept per recently used image (`crab daemon --warm-roots`).
    pub warm_roots: usize,
    /// Images given as registry references (`crab daemon --pull`, `--insecure-registry`).
    pub pulls: PullPolicy,
    /// Parking at turn boundaries (`crab daemon --memory-budget`); `None`: only by hand.
    pub park: Option<crate::parking::ParkPolicy>,
}

/// Everything one machine runs for Crab, behind [`Host::execute`].
#[derive(Debug)]
pub struct Host {
    pub(crate) runtime: Arc<Runtime>,
    inspector: Result<Arc<Inspector>, ApiError>,
    checkpointer: Arc<Checkpointer>,
    policy: Arc<TurnPolicy>,
    engine: Engine<Payload>,
    coordinator: Arc<Coordinator>,
    proxy: Mutex<Option<ProxyServer>>,
    sandbox_proxies: Mutex<HashMap<String, ProxyServer>>,
    /// Whether soft-dirty page tracking works on this kernel (probed at start-up).
    soft_dirty: crab_criu::soft_dirty::SoftDirty,
    /// Whether cgroup2 has `favordynmods` (set at start-up unless turned off), and why (not).
    favordynmods: FeatureStatus,
    /// Whether the namespace helpers run from the small `crab-nsexec`, and which binary.
    helper: FeatureStatus,
    /// The durable tier and its exporter (`--remote`).
    remote: Option<Arc<RemoteTier>>,
    /// Per-sandbox locks serializing lifecycle steps (`lifecycle.rs`).
    pub(crate) life_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Serializes label changes (a label is unique on the host).
    pub(crate) label_lock: Mutex<()>,
    /// Sandboxes whose deadline is being fired (the watchdog fires one at a time).
    pub(crate) firing: Mutex<std::collections::HashSet<String>>,
    /// What `create` does with a registry reference.
    pulls: PullPolicy,
    /// One pull on first use at a time.
    pull_lock: tokio::sync::Mutex<()>,
    /// Background Dockerfile builds (`build_jobs.rs`).
    pub(crate) build_jobs: crate::build_jobs::Jobs,
    /// Parks and wakes (`crab top`).
    pub(crate) parking: crate::parking::Parking,
    /// Clients connected to each sandbox now (the policy never parks one that has any).
    pub(crate) clients: Arc<crate::parking::Clients>,
    /// When the engine parks sandboxes at turn boundaries.
    pub(crate) park_policy: Option<crate::parking::ParkPolicy>,
}

use crab_common::sync::lock;

/// Bit of `CAP_SYS_RESOURCE` in a capability mask.
const CAP_SYS_RESOURCE: u32 = 24;

/// How long a create waits for the remote's listing of its name ([`Host::number_after_remote`]).
const REMOTE_NUMBERING_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Run a blocking call off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, HostError> + Send + 'static,
) -> Result<T, HostError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(HostError::internal(format!("host task panicked: {e}"))))
}

impl Host {
    /// Open the host: the runtime (pool mounted, surviving sandboxes adopted), the inspector
    /// (or why there is none), checkpoint recovery, the engine, and the LLM proxy on
    /// `opts.proxy.listen`; every running sandbox is tracked and gets its in-sandbox proxy.
    pub async fn open(opts: HostOptions) -> Result<Arc<Host>, HostError> {
        let (helper_exe, small, reason) = crab_sandbox::spawn::choose_helper(&opts.helper_exe);
        if small {
            tracing::info!(helper = %reason, "namespace helpers: the small binary");
        } else {
            tracing::warn!(%reason, "namespace helpers run from crab itself (a few ms more per exec and start)");
        }
        let helper = FeatureStatus { available: small, reason };
        let cfg =
            RuntimeConfig { state: opts.state.clone(), pool_size: opts.pool_size, helper_exe };
        let runtime = blocking(move || Runtime::open(cfg).map_err(HostError::from)).await?;
        if let Some(r) = &opts.nat_range {
            runtime.nat().set_default_range(r).map_err(|e| {
                HostError::invalid(
                    format!("--nat-range: {e}"),
                    "pass a private IPv4 network, e.g. --nat-range 10.213.0.0/16",
                )
            })?;
        }
        runtime.set_default_limits(&opts.default_limits).map_err(|e| {
            let e: ApiError = e.into();
            HostError::invalid(
                format!("--default-memory/--default-pids/--default-disk: {}", e.message),
                e.hint,
            )
        })?;
        runtime.set_userns(opts.userns).map_err(|e| {
            HostError::internal(format!(
                "cannot open the state directory to the user-namespace range: {e}"
            ))
        })?;
        if !has_sys_resource() {
            tracing::warn!(
                cap_eff = format!("{:016x}", cap_eff().unwrap_or(0)),
                "the daemon lacks CAP_SYS_RESOURCE: CRIU cannot dump --userns host sandboxes that run non-root processes (full/process checkpoints, pause and live forks of them answer host_capability_missing)"
            );
        }
        let inspector = tokio::task::spawn_blocking(Inspector::load)
            .await
            .map_err(|e| HostError::internal(format!("inspector start-up panicked: {e}")))?
            .map(Arc::new)
            .map_err(|e| {
                tracing::warn!(error = %e, "the eBPF inspector is unavailable; verdicts will be refused");
                e.to_api()
            });
        if let Ok(i) = &inspector {
            // CRIU works inside the processes it dumps; tell the inspector which process it is,
            // so a dump does not make the next turn look like the sandbox's processes ran.
            let i = i.clone();
            crab_criu::observer::set(Box::new(move |pid, started| {
                if started {
                    if let Err(e) = i.mute_tracer(pid) {
                        tracing::debug!(pid, error = %e, "could not mute a criu process");
                    }
                } else {
                    i.unmute_tracer(pid);
                }
            }));
        }
        runtime.set_warm_roots(opts.warm_roots);
        // Build sandboxes and work trees a daemon stopped mid-build left.
        crab_sandbox::build::recover(&runtime);
        let (available, reason) = runtime.tune_cgroup_migrations(opts.cgroup_favordynmods);
        if available {
            tracing::info!(%reason, "cgroup migrations: favordynmods");
        } else {
            tracing::warn!(%reason, "cgroup migrations may wait for RCU grace periods (up to 6-27 ms per exec, start and restore)");
        }
        let favordynmods = FeatureStatus { available, reason };
        let soft_dirty = crab_criu::soft_dirty::probe();
        tracing::info!(
            available = soft_dirty.available,
            reason = %soft_dirty.reason,
            "soft-dirty page tracking"
        );
        let runtime = Arc::new(runtime);
        // Where soft-dirty works, every dump clears the bits (CRIU's --track-mem), so the
        // next turn can tell processes that ran from processes that changed (policy rule 6).
        let config =
            crab_checkpoint::Config { track_mem: soft_dirty.available, ..Default::default() };
        let checkpointer = Arc::new(Checkpointer::new(runtime.clone(), config));
        let cp = checkpointer.clone();
        blocking(move || {
            cp.recover().map_err(|e| {
                let mut api = e.to_api();
                api.message = format!("recovering checkpoints: {}", api.message);
                HostError(api)
            })
        })
        .await?;
        let policy = Arc::new(TurnPolicy::new());
        let exec = CheckpointExecutor::new(checkpointer.clone(), policy.clone());
        let engine = Engine::new(opts.engine.clone(), Arc::new(exec))
            .map_err(|e| HostError::internal(format!("starting the engine: {e}")))?;
        let hooks = Arc::new(Hooks::new(policy.clone()));
        let coordinator = Coordinator::new(
            opts.proxy.clone(),
            Arc::new(SandboxDir(runtime.clone())),
            hooks.clone(),
        )
        .map_err(|e| HostError::internal(format!("configuring the LLM proxy: {e}")))?;
        let remote = match &opts.remote {
            Some(o) => Some(Arc::new(RemoteTier::open(&opts.state, o).await?)),
            None => None,
        };
        let host = Arc::new(Host {
            runtime,
            inspector,
            checkpointer,
            policy,
            engine,
            coordinator,
            proxy: Mutex::new(None),
            sandbox_proxies: Mutex::new(HashMap::new()),
            soft_dirty,
            favordynmods,
            helper,
            remote,
            life_locks: Mutex::new(HashMap::new()),
            label_lock: Mutex::new(()),
            firing: Mutex::new(std::collections::HashSet::new()),
            parking: crate::parking::Parking::default(),
            clients: Arc::default(),
            park_policy: opts.park,
            pulls: opts.pulls.clone(),
            pull_lock: tokio::sync::Mutex::new(()),
            build_jobs: crate::build_jobs::Jobs::default(),
        });
        hooks.set_host(Arc::downgrade(&host));
        if let Some(t) = &host.remote {
            tracing::info!(url = t.repo.url(), "exporting restore points to the remote store");
            tokio::spawn(t.clone().run(Arc::downgrade(&host)));
            tokio::spawn(t.follower.clone().run(Arc::downgrade(&host)));
            // A restore from the remote compares CRIU's version: asked now, not on the first
            // restore's path.
            tokio::task::spawn_blocking(criu_version);
        }
        let proxy = host.coordinator.bind().await.map_err(|e| {
            HostError::internal(format!("starting the LLM proxy on {}: {e}", opts.proxy.listen))
        })?;
        *lock(&host.proxy) = Some(proxy);
        for s in host.runtime.list() {
            if s.state == SandboxState::Running {
                host.attach(&s.name);
                host.open_sandbox_proxy(&s.name).await;
            }
        }
        host.spawn_watchdog();
        Ok(host)
    }

    /// The state directory.
    pub fn state(&self) -> &StateDir {
        self.runtime.state()
    }

    /// Where the host-side LLM proxy listens.
    pub fn proxy_addr(&self) -> Option<SocketAddr> {
        lock(&self.proxy).as_ref().map(|p| p.local_addr())
    }

    /// Number of sandboxes.
    pub fn sandbox_count(&self) -> usize {
        self.runtime.names().len()
    }

    /// Stop the host-side LLM proxy (sandboxes keep running).
    pub async fn shutdown(&self) {
        let proxy = lock(&self.proxy).take();
        if let Some(p) = proxy {
            p.shutdown().await;
        }
        self.runtime.release_cgroup_parent();
    }

    /// The turn policy.
    pub fn policy(&self) -> &TurnPolicy {
        &self.policy
    }

    /// The durable tier, when the host has one (`--remote`).
    pub fn remote(&self) -> Option<&Arc<RemoteTier>> {
        self.remote.as_ref()
    }

    pub(crate) fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    pub(crate) fn checkpointer(&self) -> &Arc<Checkpointer> {
        &self.checkpointer
    }

    pub(crate) fn engine(&self) -> &Engine<Payload> {
        &self.engine
    }

    /// The remote tier, or the error a host without one answers.
    fn tier(&self) -> Result<Arc<RemoteTier>, HostError> {
        self.remote.clone().ok_or_else(|| {
            HostError::invalid(
                "this daemon has no remote store",
                "start it with `crab daemon --remote URL`",
            )
        })
    }

    /// Do what a front door asked.
    pub async fn execute(self: &Arc<Self>, action: Action) -> Result<Outcome, HostError> {
        tracing::debug!(action = action.name(), "execute");
        // A client from before the wake check until the action is done: a park cannot halt
        // the sandbox under it (see `ensure_awake`).
        let _client = action.needs_running().map(|name| self.clients.connect(name));
        if let Some(name) = action.needs_running() {
            self.ensure_awake(name).await?;
        }
        match action {
            Action::Version => Ok(Outcome::Version(VersionInfo {
                version: env!("CARGO_PKG_VERSION").to_string(),
                api: API_VERSION,
                state_dir: self.state().root().display().to_string(),
                pid: std::process::id(),
                features: Features {
                    soft_dirty: Some(FeatureStatus {
                        available: self.soft_dirty.available,
                        reason: self.soft_dirty.reason.clone(),
                    }),
                    // Runs `criu swrk` once: off the async threads.
                    criu: blocking(|| Ok(criu_status().clone())).await.ok(),
                    remote: Some(match &self.remote {
                        Some(t) => {
                            FeatureStatus { available: true, reason: t.repo.url().to_string() }
                        }
                        None => FeatureStatus {
                            available: false,
                            reason: "no --remote store configured".into(),
                        },
                    }),
                    cgroup_favordynmods: Some(self.favordynmods.clone()),
                    namespace_helper: Some(self.helper.clone()),
                },
                proxy_listen: Some(self.coordinator.config().listen.to_string()),
            })),
            Action::ListImages => {
                let state = self.state().clone();
                blocking(move || Ok(Outcome::Images(image::list(&state)?))).await
            }
            Action::BuildImage { req, progress } if req.dockerfile.is_some() => {
                self.build_dockerfile(req, progress).await
            }
            Action::CommitImage { req, progress } => self.commit_image(req, progress).await,
            Action::BuildStart { id, req } => self.build_start(id, req).await,
            Action::BuildStatus { id, offset, max } => self.build_status(id, offset, max).await,
            Action::BuildImage { req, progress } => {
                if req.distro != "debian" {
                    return Err(HostError::invalid(
                        format!("unknown distro {:?}", req.distro),
                        "the only recipe is `debian` (bookworm); use `crab image import` for anything else",
                    ));
                }
                let state = self.state().clone();
                let name = req.name.clone().unwrap_or_else(|| req.distro.clone());
                let rt = self.runtime.clone();
                blocking(move || {
                    // A rebuilt image's ready roots are stale (they would be dropped at the next
                    // create anyway); drop them now.
                    rt.forget_image(&name);
                    let i = image::build_debian(
                        &state,
                        &name,
                        &req.include,
                        req.rebuild_stale,
                        progress.as_ref(),
                    )?;
                    rt.prepare_image(&name, progress.as_ref());
                    Ok(Outcome::Image(i))
                })
                .await
            }
            Action::ImportImage { req, progress } => {
                let state = self.state().clone();
                let rt = self.runtime.clone();
                blocking(move || {
                    let path = PathBuf::from(&req.path);
                    let i = crate::images::import(
                        &state,
                        &rt,
                        &req.name,
                        &path,
                        req.platform.as_deref(),
                        progress.as_ref(),
                    )?;
                    Ok(Outcome::Image(i))
                })
                .await
            }
            Action::PullImage { req, progress } => self.pull_image(req, progress).await,
            Action::PushImage { req, progress } => self.push_image(req, progress).await,
            Action::RemoveImage { name } => {
                let state = self.state().clone();
                let rt = self.runtime.clone();
                blocking(move || {
                    image::remove(&state, &name)?;
                    rt.forget_image(&name);
                    let used_by = rt
                        .records()
                        .into_iter()
                        .filter(|r| r.image == name)
                        .map(|r| r.name)
                        .collect();
                    Ok(Outcome::Removed { removed: true, used_by })
                })
                .await
            }
            Action::ListSandboxes => {
                let rt = self.runtime.clone();
                blocking(move || Ok(Outcome::Sandboxes(rt.list()))).await
            }
            Action::GetSandbox { name } => {
                let rt = self.runtime.clone();
                blocking(move || Ok(Outcome::Sandbox(Box::new(rt.get(&name)?)))).await
            }
            Action::Create(req) => self.create(req).await,
            Action::Update { name, req } => {
                let policy =
                    crab_common::api::parse_checkpoint_policy(req.checkpoint_policy.as_deref())?;
                let timeout =
                    timeout_set(req.timeout_s, req.on_timeout.as_deref(), req.extend_only)?;
                let h = self.clone();
                blocking(move || {
                    if let Some(t) = timeout {
                        h.set_deadline(&name, t)?;
                    }
                    if let Some(p) = policy {
                        let old = h.runtime.record(&name)?.checkpoint_policy;
                        h.runtime.set_checkpoint_policy(&name, p)?;
                        // Under `fs` or `none` the newest point's process image (if any) may be
                        // older than the processes: the first auto checkpoint after is full.
                        if matches!(old, CheckpointPolicy::Fs | CheckpointPolicy::None)
                            && p == CheckpointPolicy::Auto
                        {
                            h.policy.force_full(&name);
                        }
                        tracing::info!(sandbox = %name, from = %old, to = %p, "checkpoint policy set");
                    }
                    Ok(Outcome::Sandbox(Box::new(h.runtime.get(&name)?)))
                })
                .await
            }
            Action::Remove { name, force } => {
                let l = self.life_lock(&name);
                let _g = l.lock().await;
                self.remove(name, force).await
            }
            Action::Stop { name, checkpoint } => self.stop(name, checkpoint).await,
            Action::Retire { name, why } => self.retire(name, why).await,
            Action::Start { name } => self.start(name).await,
            Action::Exec { name, req } => {
                // Unknown sandboxes are refused before the stream starts.
                self.runtime.record(&name)?;
                // A streamed stdin is registered before the stream answers, so a write sent
                // as soon as it does finds it.
                let session = match &req.stdin_session {
                    Some(s) => Some(self.runtime.sessions().register(&name, s)?),
                    None => None,
                };
                let (tx, rx) = tokio::sync::mpsc::channel(64);
                let client = self.clients.connect(&name);
                let rt = self.runtime.clone();
                tokio::spawn(async move {
                    crab_sandbox::exec::run(rt, name, req, tx, session).await;
                    drop(client);
                });
                Ok(Outcome::Exec(rx))
            }
            Action::ExecAttach { name, session } => {
                self.runtime.record(&name)?;
                let (tx, rx) = tokio::sync::mpsc::channel(64);
                let client = self.clients.connect(&name);
                let rt = self.runtime.clone();
                tokio::spawn(async move {
                    crab_sandbox::exec::attach(rt, name, session, tx).await;
                    drop(client);
                });
                Ok(Outcome::Exec(rx))
            }
            Action::ExecStdin { name, session, data, eof } => {
                let written = self.runtime.sessions().write(&name, &session, data, eof).await?;
                Ok(Outcome::StdinWritten(crab_common::api::StdinWritten { written, eof }))
            }
            Action::ProcStart { name, req } => self.proc_start(name, req).await,
            Action::ProcList { name } => self.proc_list(name).await,
            Action::ProcGet { name, id } => self.proc_get(name, id).await,
            Action::ProcOutput { name, id, offsets, follow } => {
                self.proc_output(name, id, offsets, follow).await
            }
            Action::ProcStdin { name, id, data } => self.proc_stdin(name, id, data).await,
            Action::ProcCloseStdin { name, id } => self.proc_close_stdin(name, id).await,
            Action::ProcSignal { name, id, signal } => self.proc_signal(name, id, signal).await,
            Action::Inspect { name, close } => {
                self.runtime.record(&name)?;
                let inspector = self.inspector()?.clone();
                blocking(move || {
                    let v = if close { inspector.take(&name) } else { inspector.peek(&name) };
                    Ok(Outcome::Verdict(Box::new(v?)))
                })
                .await
            }
            Action::ForkLive { name, req } => self.fork_live(name, req).await,
            Action::Pause { name } => self.pause(name).await,
            Action::Park { name } => self.park(name, None, false).await,
            Action::Wake { name } => self.wake(name).await,
            Action::Resume { name, ensure, timeout } => self.resume(name, ensure, timeout).await,
            Action::Kill { name } => self.kill(name).await,
            Action::Status { name } => self.status(name),
            Action::LabelPoint { name, point, labels } => {
                self.label_point(name, point, labels).await
            }
            Action::DeleteLabel { label } => self.delete_label(label).await,
            Action::Labels => self.labels().await,
            Action::Checkpoint { name, kind, turn, conversation_offset } => {
                self.checkpoint(name, kind, turn, conversation_offset).await
            }
            Action::ListCheckpoints { name } => {
                let h = self.clone();
                blocking(move || {
                    h.runtime.record(&name)?;
                    let points = h.checkpointer.list(&name)?;
                    // With --remote, each point also says whether it is local, exporting or
                    // durable.
                    let views = points
                        .into_iter()
                        .map(|p| {
                            let remote = h
                                .remote
                                .as_ref()
                                .map(|t| t.state(&name, &p.id, Some(p.created_at_ms)));
                            PointView { point: p, remote }
                        })
                        .collect();
                    Ok(Outcome::Points(views))
                })
                .await
            }
            Action::Prune { name, keep_last } => {
                let h = self.clone();
                blocking(move || {
                    h.runtime.record(&name)?;
                    let r = h.checkpointer.prune(&name, keep_last)?;
                    Ok(Outcome::Pruned(Pruned {
                        points: r.points.iter().map(|p| p.to_string()).collect(),
                        procs: r.procs.iter().map(|p| p.to_string()).collect(),
                        fs: r.fs.iter().map(|p| p.to_string()).collect(),
                    }))
                })
                .await
            }
            Action::Restore { name, checkpoint } => {
                let l = self.life_lock(&name);
                let _g = l.lock().await;
                self.restore(name, checkpoint, Arc::new(NoProgress)).await
            }
            Action::Fork { name, req } => self.fork(name, req, Arc::new(NoProgress)).await,
            Action::Conversation { name, at } => self.conversation(name, at).await,
            Action::Turn { name } => self.turn(name).await,
            Action::HarnessChanged { name } => {
                self.runtime.record(&name)?;
                self.policy.harness_changed(&name);
                Ok(Outcome::HarnessMarked(HarnessMarked {
                    sandbox: name,
                    next_checkpoint_dumps: true,
                }))
            }
            Action::Metrics => {
                let mut text = self.coordinator.metrics_text();
                text.push_str(&self.engine.metrics_text());
                Ok(Outcome::Metrics(text))
            }
            Action::Top => Ok(Outcome::Top(Box::new(TopView {
                proxy: self.coordinator.stats(),
                engine: self.engine.stats(),
                held_stages: self.coordinator.held_stages(),
                parking: self.parking.stats(self.parked_count()),
            }))),
            Action::RemoteList { sandbox } => {
                let t = self.tier()?;
                let v = t.repo.list_points(sandbox.as_deref()).await.map_err(remote_error)?;
                Ok(Outcome::RemotePoints(v))
            }
            Action::RemoteCheck => {
                let t = self.tier()?;
                // The check reads every object: off the async threads.
                let handle = tokio::runtime::Handle::current();
                let r = tokio::task::spawn_blocking(move || handle.block_on(t.repo.check()))
                    .await
                    .map_err(|e| HostError::internal(format!("remote check panicked: {e}")))?
                    .map_err(remote_error)?;
                Ok(Outcome::RemoteChecked(r))
            }
            Action::Follow(req) => Ok(Outcome::Follow(self.tier()?.follower.change(&req)?)),
            Action::RemotePrune { keep_last } => {
                let t = self.tier()?;
                Ok(Outcome::RemotePruned(t.repo.prune(keep_last).await.map_err(remote_error)?))
            }
            Action::RemoteWait { sandbox, point, timeout } => {
                let t = self.tier()?;
                // The local point of that name, if any: a point of an earlier sandbox of the
                // same name that the remote holds is not this one.
                let h = self.clone();
                let (s, p) = (sandbox.clone(), point.clone());
                let created = blocking(move || {
                    // (No store is opened, so none is made, for a sandbox not on this host.)
                    if h.runtime.record(&s).is_err() {
                        return Ok(None);
                    }
                    Ok(h.checkpointer.store(&s).ok().and_then(|st| st.resolve(Some(&p)).ok()))
                })
                .await?
                .map(|m| m.created_at_ms);
                Ok(Outcome::Durable(t.wait_durable(&sandbox, &point, created, timeout).await?))
            }
            Action::FromRemote(req) => self.from_remote(req, Arc::new(NoProgress)).await,
            Action::Replace { name, source, remote, fs_only } => {
                self.replace(name, source, remote, fs_only).await
            }
            Action::Files { name, user, op } => self.files(name, user, op).await,
            Action::WithProgress { action, progress } => {
                self.with_progress(*action, progress.into()).await
            }
        }
    }

    async fn create(
        self: &Arc<Self>,
        req: crab_common::api::SandboxCreateRequest,
    ) -> Result<Outcome, HostError> {
        // A bad harness declaration is refused before anything is created.
        crab_inspector::harness::Harness::compile(&req.harness).map_err(|e| {
            HostError(ApiError::new(
                crab_common::ErrorCode::InvalidRequest,
                e.0,
                "fix or drop --harness-cmd / --harness-path",
            ))
        })?;
        let mut req = req;
        req.image = self.resolve_image(&req.image).await?;
        let rt = self.runtime.clone();
        let info = blocking(move || Ok(rt.create(&req)?)).await?;
        self.number_after_remote(&info.name).await;
        self.attach(&info.name);
        self.open_sandbox_proxy(&info.name).await;
        Ok(Outcome::Sandbox(Box::new(info)))
    }

    /// With a remote store: a new sandbox numbers its points after those an earlier sandbox
    /// of its name left there, so its exports do not collide with them (the remote never
    /// overwrites another point's record: such an export would fail). A remote that does not
    /// answer within a few seconds is not waited for (a collision then shows as a failed
    /// export).
    async fn number_after_remote(&self, name: &str) {
        let Some(t) = &self.remote else { return };
        let highest = tokio::time::timeout(REMOTE_NUMBERING_WAIT, t.repo.highest_point(name)).await;
        let n = match highest {
            Ok(Ok(Some(n))) => n,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                tracing::warn!(sandbox = name, error = %e, "cannot list the remote's points of this name; numbering from 1");
                return;
            }
            Err(_) => {
                tracing::warn!(
                    sandbox = name,
                    "the remote did not list its points of this name in time; numbering from 1"
                );
                return;
            }
        };
        let numbered = match self.checkpointer.store(name) {
            Ok(s) => s.number_points_after(n),
            Err(e) => Err(e),
        };
        match numbered {
            Ok(()) => tracing::info!(
                sandbox = name,
                after = n,
                "points numbered after the remote's of this name"
            ),
            Err(e) => {
                tracing::warn!(sandbox = name, error = %e, "cannot number points after the remote's")
            }
        }
    }

    pub(crate) async fn remove(
        self: &Arc<Self>,
        name: String,
        force: bool,
    ) -> Result<Outcome, HostError> {
        let h = self.clone();
        let n = name.clone();
        blocking(move || {
            h.runtime.remove(&n, force)?;
            // The sandbox is gone: so are its restore points.
            Ok(h.checkpointer.remove_all(&n)?)
        })
        .await?;
        self.detach(&name);
        self.runtime.sessions().forget_sandbox(&name);
        self.close_sandbox_proxy(&name).await;
        self.coordinator.forget(&name);
        self.policy.clear(&name);
        self.drop_life_lock(&name);
        self.parking.forget(&name);
        Ok(Outcome::Removed { removed: true, used_by: Vec::new() })
    }

    /// The inspector, or the error explaining why this host has none.
    fn inspector(&self) -> Result<&Arc<Inspector>, HostError> {
        self.inspector.as_ref().map_err(|e| HostError(e.clone()))
    }

    /// Start tracking a sandbox's turns (no-op without an inspector; failures are logged: the
    /// verdict of an untracked sandbox is refused, never guessed).
    fn attach(&self, name: &str) {
        if let Ok(i) = &self.inspector {
            let cg = self.runtime.cgroup(name);
            match i.attach(name, &cg.v2) {
                Ok(h) => tracing::debug!(sandbox = name, key = h.key, "inspector attached"),
                Err(e) => {
                    tracing::warn!(sandbox = name, error = %e, "inspector attach failed");
                    return;
                }
            }
            // The record's harness (validated at create; a record edited into a bad one
            // declares none, which only costs checkpoints).
            let spec = self.runtime.record(name).map(|r| r.harness).unwrap_or_default();
            if !spec.is_empty() {
                match crab_inspector::harness::Harness::compile(&spec) {
                    Ok(h) => {
                        if let Err(e) = i.set_harness(name, Some(h)) {
                            tracing::warn!(sandbox = name, error = %e, "harness not set");
                        }
                    }
                    Err(e) => tracing::warn!(sandbox = name, error = %e, "harness ignored"),
                }
            }
        }
    }

    /// Stop tracking a sandbox.
    pub(crate) fn detach(&self, name: &str) {
        if let Ok(i) = &self.inspector {
            i.detach(name);
        }
    }

    /// (Re)open the proxy endpoint inside sandbox `name`'s network namespace, replacing an old
    /// one (after a restore the namespace is new). Sandboxes on the host network use the host
    /// listener.
    async fn open_sandbox_proxy(&self, name: &str) {
        self.close_sandbox_proxy(name).await;
        let Ok(rec) = self.runtime.record(name) else { return };
        if rec.net == NetMode::Host {
            return;
        }
        let ns = PathBuf::from(format!("/proc/{}/ns/net", rec.init_pid));
        let Ok(addr) = IN_SANDBOX_PROXY.parse::<SocketAddr>() else { return };
        let bound = tokio::task::spawn_blocking(move || bind_in_netns(&ns, addr)).await;
        let listener = match bound {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                return tracing::warn!(sandbox = name, error = %e, "no in-sandbox LLM proxy")
            }
            Err(e) => return tracing::warn!(sandbox = name, error = %e, "no in-sandbox LLM proxy"),
        };
        let served = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| e.to_string())
            .and_then(|l| self.coordinator.serve_sandbox(l, name).map_err(|e| e.to_string()));
        match served {
            Ok(server) => {
                lock(&self.sandbox_proxies).insert(name.to_string(), server);
            }
            Err(e) => tracing::warn!(sandbox = name, error = %e, "no in-sandbox LLM proxy"),
        }
    }

    /// Close sandbox `name`'s in-namespace proxy endpoint.
    pub(crate) async fn close_sandbox_proxy(&self, name: &str) {
        let old = lock(&self.sandbox_proxies).remove(name);
        if let Some(server) = old {
            server.shutdown().await;
        }
    }
}

/// The installed CRIU's version, asked once (a CRIU session costs milliseconds; the preflight
/// of every restore from the remote needs it). `None` when CRIU does not answer.
/// A deadline change from a request's fields (`None`: no change asked); front doors parse
/// their `timeout_s`/`on_timeout`/`extend_only` with it.
pub fn timeout_set(
    timeout_s: Option<u64>,
    on_timeout: Option<&str>,
    extend_only: bool,
) -> Result<Option<crab_common::life::TimeoutSet>, HostError> {
    let on = on_timeout.map(str::parse).transpose()?;
    Ok(match (timeout_s, on) {
        (None, None) => None,
        (Some(t), on) => Some(crab_common::life::TimeoutSet { timeout_s: t, on, extend_only }),
        // Only the action changes: the current deadline's time is kept by asking for no
        // later one than it (a sandbox without a deadline gets none).
        (None, Some(_)) => {
            return Err(HostError::invalid(
                "on_timeout needs a timeout",
                "give timeout_s (--timeout) with it",
            ))
        }
    })
}

fn criu_version() -> Option<String> {
    static VERSION: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    VERSION
        .get_or_init(|| {
            crab_criu::Criu::locate().ok().and_then(|c| c.version().ok()).map(|v| v.to_string())
        })
        .clone()
}

/// Whether CRIU is installed and answers (asked once, on the first [`Action::Version`]).
fn criu_status() -> &'static FeatureStatus {
    static STATUS: std::sync::OnceLock<FeatureStatus> = std::sync::OnceLock::new();
    STATUS.get_or_init(|| {
        match crab_criu::Criu::locate().and_then(|c| c.version().map(|v| (c, v))) {
            Ok((c, v)) => FeatureStatus {
                available: true,
                reason: format!("criu {v} at {}", c.path().display()),
            },
            Err(e) => FeatureStatus { available: false, reason: e.to_string() },
        }
    })
}
