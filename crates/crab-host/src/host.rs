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
    /// Ready-made root filesystems kept per recently used image (`crab daemon --warm-roots`).
    pub warm_roots: usize,
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
}

use crab_common::sync::lock;

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

/// Bit of `CAP_SYS_RESOURCE` in a capability mask.
const CAP_SYS_RESOURCE: u32 = 24;

/// This process's effective capability mask (`CapEff` of `/proc/self/status`), read once.
fn cap_eff() -> Option<u64> {
    static CAPS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *CAPS.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_string();
        u64::from_str_radix(&hex, 16).ok()
    })
}

/// Whether the daemon holds `CAP_SYS_RESOURCE`, which CRIU needs to read the rlimits of a
/// process of another uid (`prlimit(2)`); unknown counts as held (CRIU then says).
fn has_sys_resource() -> bool {
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
fn dump_preflight(rt: &Runtime, name: &str) -> Result<(), HostError> {
    if has_sys_resource() {
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
        "run the daemon where its capability set includes CAP_SYS_RESOURCE (a host or container that does not drop it), or run that process as root, or take a filesystem checkpoint (--kind fs; E2B: mode=\"filesystem\"); the sandbox was left running, untouched",
    )))
}

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
        if !has_sys_resource() {
            tracing::warn!(
                cap_eff = format!("{:016x}", cap_eff().unwrap_or(0)),
                "the daemon lacks CAP_SYS_RESOURCE: CRIU cannot dump sandboxes that run non-root processes (full/process checkpoints, pause and live forks of them answer host_capability_missing)"
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
            Some(o) => Some(Arc::new(RemoteTier::open(&opts.state, o).await.map_err(|e| {
                let mut h = remote_error(e);
                h.0.message = format!("opening the remote store {}: {}", o.url, h.0.message);
                h
            })?)),
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
        });
        hooks.set_host(Arc::downgrade(&host));
        if let Some(t) = &host.remote {
            tracing::info!(url = t.repo.url(), "exporting restore points to the remote store");
            tokio::spawn(t.clone().run(Arc::downgrade(&host)));
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
                    Ok(Outcome::Image(i))
                })
                .await
            }
            Action::ImportImage { req, progress } => {
                let state = self.state().clone();
                let rt = self.runtime.clone();
                blocking(move || {
                    rt.forget_image(&req.name);
                    let path = PathBuf::from(&req.path);
                    Ok(Outcome::Image(image::import(&state, &req.name, &path, progress.as_ref())?))
                })
                .await
            }
            Action::RemoveImage { name } => {
                let state = self.state().clone();
                let rt = self.runtime.clone();
                blocking(move || {
                    image::remove(&state, &name)?;
                    rt.forget_image(&name);
                    Ok(Outcome::Removed { removed: true })
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
                tokio::spawn(crab_sandbox::exec::run(self.runtime.clone(), name, req, tx, session));
                Ok(Outcome::Exec(rx))
            }
            Action::ExecAttach { name, session } => {
                self.runtime.record(&name)?;
                let (tx, rx) = tokio::sync::mpsc::channel(64);
                tokio::spawn(crab_sandbox::exec::attach(self.runtime.clone(), name, session, tx));
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
                            let remote = h.remote.as_ref().map(|t| t.state(&name, &p.id));
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
            Action::RemotePrune { keep_last } => {
                let t = self.tier()?;
                Ok(Outcome::RemotePruned(t.repo.prune(keep_last).await.map_err(remote_error)?))
            }
            Action::RemoteWait { sandbox, point, timeout } => {
                let t = self.tier()?;
                Ok(Outcome::Durable(t.wait_durable(&sandbox, &point, timeout).await?))
            }
            Action::FromRemote(req) => self.from_remote(req, Arc::new(NoProgress)).await,
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
        let rt = self.runtime.clone();
        let info = blocking(move || Ok(rt.create(&req)?)).await?;
        self.attach(&info.name);
        self.open_sandbox_proxy(&info.name).await;
        Ok(Outcome::Sandbox(Box::new(info)))
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
        Ok(Outcome::Removed { removed: true })
    }

    /// Close the inspector's turn for `name` and decide the checkpoint kind (the policy's).
    fn decide(&self, name: &str) -> Decision {
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
    fn submit(
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
        Ok(Arc::new(JobTicket::new(self.engine.clone(), handle, b.sandbox.clone())))
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
    fn point_offset(&self, name: &str, point: Option<&str>) -> Result<Option<u64>, HostError> {
        let store = self.checkpointer.store(name)?;
        Ok(store.resolve(point)?.conversation_offset)
    }

    pub(crate) async fn restore(
        self: &Arc<Self>,
        name: String,
        checkpoint: Option<String>,
        progress: Arc<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        let t0 = std::time::Instant::now();
        let h = self.clone();
        let n = name.clone();
        let (report, offset, t_attach) = blocking(move || {
            h.runtime.record(&n)?;
            let offset = h.point_offset(&n, checkpoint.as_deref())?;
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
    async fn fork_live(
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
        let t0 = std::time::Instant::now();
        let mut clock = crab_common::stats::StageClock::starting(t0);
        progress.stage("load_point", None);
        progress.message(&format!("remote point {}", req.source));
        let rec = t.repo.load_point(&sb, point.as_deref()).await.map_err(remote_error)?;
        clock.mark("load_point");
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
        let grant = crate::remote::Grant { net: req.net.unwrap_or_default(), limits };
        // Remote points live in a store of their own, never in a local sandbox's.
        let store = self.checkpointer.remote_store(&sb)?;
        let (repo, rec2, fs_only) = (t.repo.clone(), rec.clone(), req.fs_only);
        let state = self.state().clone();
        let handle = tokio::runtime::Handle::current();
        let grant2 = grant.clone();
        let mat_store = store.clone();
        progress.stage("materialize", None);
        let mat = tokio::task::spawn_blocking(move || {
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
        .map_err(remote_error)?;
        let template =
            crate::remote::admit_meta(&mat.manifest.sandbox_meta, &grant).map_err(|refusal| {
                remote_error(crab_remote::RemoteError::Refused {
                    point: format!("{}@{}", rec.sandbox, rec.point),
                    refusal,
                })
            })?;
        clock.restart();
        for (stage, ms) in &mat.stages {
            clock.add(format!("materialize_{stage}"), *ms);
        }
        let fetch_ms = t0.elapsed().as_secs_f64() * 1e3;
        let h = self.clone();
        let (pid, count, names, fs_only) =
            (rec.point.clone(), req.count, req.names.clone(), req.fs_only);
        let branches = blocking(move || {
            // The materialization verified the images it wrote (or found) and checked them
            // against the default profile; the branches are built from the host's grant
            // (`template`), never the point's meta.
            let opts = crab_checkpoint::ForkOptions { fs_only, verified: true };
            let b = h.checkpointer.fork_remote(
                &store,
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
        .await?;
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

    async fn conversation(
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

    async fn turn(self: &Arc<Self>, name: String) -> Result<Outcome, HostError> {
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

/// Milliseconds from `a` to `b`.
fn ms_between(a: std::time::Instant, b: std::time::Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1e3
}
