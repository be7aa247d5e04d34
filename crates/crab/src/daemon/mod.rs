//! `crab daemon`: owns the runtime and serves the JSON API on `<state>/crab.sock`.
//!
//! Start-up checks the host (root, btrfs, cgroup2), mounts the pool, adopts the sandboxes whose
//! init survived, takes an exclusive lock on `<state>/daemon.pid` (one daemon per state
//! directory), and binds the socket with mode 0600 so only root can reach it. Sandboxes are
//! separate process trees: they keep running while the daemon is down.
//!
//! It also runs the host engine (one scheduler for every sandbox's checkpoint work) and the LLM
//! proxy: on `--proxy-listen` (loopback only) for agents on the host, and on `127.0.0.1:7431`
//! inside each sandbox's own network namespace for agents that run in their sandbox.

mod api;
mod checkpoints;
mod images;
mod inspect;
pub mod remote;
mod sandboxes;
pub mod serve;
mod turns;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Context};

use crab_checkpoint::Checkpointer;
use crab_common::api::SandboxState;
use crab_common::paths::StateDir;
use crab_common::ApiError;
use crab_coordinator::{bind_in_netns, Coordinator, ProxyConfig, ProxyServer};
use crab_engine::{Engine, EngineConfig};
use crab_inspector::Inspector;
use crab_sandbox::{Runtime, RuntimeConfig};

/// Options of `crab daemon`.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    /// State directory.
    pub state: StateDir,
    /// Size of a new sparse pool image.
    pub pool_size: u64,
    /// The LLM proxy's configuration (listen address, upstreams).
    pub proxy: ProxyConfig,
    /// Engine tunables.
    pub engine: EngineConfig,
    /// The durable tier (`--remote`), if any.
    pub remote: Option<remote::RemoteOptions>,
}

/// Where agents inside a sandbox reach the proxy (in the sandbox's own network namespace).
pub const IN_SANDBOX_PROXY: &str = "127.0.0.1:7431";

/// Shared state of the daemon's handlers.
#[derive(Debug)]
pub struct Daemon {
    /// The sandbox runtime.
    pub runtime: Arc<Runtime>,
    /// The eBPF inspector, or why it could not be loaded.
    pub inspector: Result<Arc<Inspector>, ApiError>,
    /// Checkpoint, restore and fork.
    pub checkpointer: Arc<Checkpointer>,
    /// Sandboxes whose last checkpoint failed: their next `auto` checkpoint is `full`.
    force_full: Mutex<HashSet<String>>,
    /// The host-wide checkpoint scheduler.
    engine: Engine<turns::Payload>,
    /// The LLM proxy.
    pub coordinator: Arc<Coordinator>,
    /// Proxy endpoints inside sandboxes' network namespaces.
    sandbox_proxies: Mutex<HashMap<String, ProxyServer>>,
    /// Whether soft-dirty page tracking works on this kernel (probed at start-up).
    pub soft_dirty: crab_criu::soft_dirty::SoftDirty,
    /// The durable tier and its exporter (`--remote`).
    pub remote: Option<Arc<remote::RemoteTier>>,
}

impl Daemon {
    /// The inspector, or the error explaining why this host has none.
    pub fn inspector(&self) -> Result<&Arc<Inspector>, ApiError> {
        self.inspector.as_ref().map_err(Clone::clone)
    }

    /// Start tracking a sandbox's turns (no-op without an inspector; failures are logged: the
    /// verdict of an untracked sandbox is refused, never guessed).
    pub fn attach(&self, name: &str) {
        if let Ok(i) = &self.inspector {
            let cg = self.runtime.cgroup(name);
            match i.attach(name, &cg.v2) {
                Ok(h) => tracing::debug!(sandbox = name, key = h.key, "inspector attached"),
                Err(e) => tracing::warn!(sandbox = name, error = %e, "inspector attach failed"),
            }
        }
    }

    /// (Re)open the proxy endpoint inside sandbox `name`'s network namespace, replacing an old
    /// one (after a restore the namespace is new). Sandboxes on the host network use the host
    /// listener.
    pub async fn open_sandbox_proxy(&self, name: &str) {
        self.close_sandbox_proxy(name).await;
        let Ok(rec) = self.runtime.record(name) else { return };
        if rec.net == crab_common::api::NetMode::Host {
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
                self.sandbox_proxies
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(name.to_string(), server);
            }
            Err(e) => tracing::warn!(sandbox = name, error = %e, "no in-sandbox LLM proxy"),
        }
    }

    /// Close sandbox `name`'s in-namespace proxy endpoint.
    pub async fn close_sandbox_proxy(&self, name: &str) {
        let old = self.sandbox_proxies.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
        if let Some(server) = old {
            server.shutdown().await;
        }
    }

    /// Remember that `name`'s last checkpoint failed.
    pub fn set_force_full(&self, name: &str) {
        self.force_full.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string());
    }

    /// Whether `name`'s next checkpoint must be full (and forget it).
    pub fn take_force_full(&self, name: &str) -> bool {
        self.force_full.lock().unwrap_or_else(|p| p.into_inner()).remove(name)
    }

    /// Forget a pending forced full checkpoint (after a restore).
    pub fn clear_force_full(&self, name: &str) {
        self.take_force_full(name);
    }

    /// Stop tracking a sandbox.
    pub fn detach(&self, name: &str) {
        if let Ok(i) = &self.inspector {
            i.detach(name);
        }
    }
}

/// Run the daemon until SIGINT or SIGTERM.
pub async fn run(mut opts: DaemonOptions) -> anyhow::Result<()> {
    let state = opts.state.clone();
    // Size every connection cap by the descriptors this process has, so no flood of
    // connections (a hostile sandbox's, to its in-sandbox proxy) can take the ones the API and
    // the checkpoint work need.
    let fds = crab_coordinator::FdBudget::of_process();
    let proxy_cap = if opts.proxy.max_connections == 0 {
        fds.proxy_connections
    } else {
        opts.proxy.max_connections.min(fds.proxy_connections)
    };
    opts.proxy.max_connections = proxy_cap;
    opts.proxy.max_sandbox_connections =
        opts.proxy.max_sandbox_connections.min((proxy_cap / 4).max(8));
    let exe = std::env::current_exe().context("locating the crab binary")?;
    std::fs::create_dir_all(state.root())
        .with_context(|| format!("creating {}", state.root().display()))?;
    let _lock = lock_pid_file(&state.pid_file())?;
    let cfg = RuntimeConfig { state: state.clone(), pool_size: opts.pool_size, helper_exe: exe };
    let runtime = tokio::task::spawn_blocking(move || Runtime::open(cfg))
        .await
        .context("runtime start-up panicked")?
        .map_err(|e| {
            let api: crab_common::ApiError = e.into();
            anyhow::anyhow!(
                "{}{}",
                api.message,
                if api.hint.is_empty() { String::new() } else { format!(" (hint: {})", api.hint) }
            )
        })?;
    let inspector = tokio::task::spawn_blocking(Inspector::load)
        .await
        .context("inspector start-up panicked")?
        .map(Arc::new)
        .map_err(|e| {
            tracing::warn!(error = %e, "the eBPF inspector is unavailable; verdicts will be refused");
            e.to_api()
        });
    if let Ok(i) = &inspector {
        // CRIU works inside the processes it dumps; tell the inspector which process it is, so
        // a dump does not make the next turn look like the sandbox's processes ran.
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
    let soft_dirty = crab_criu::soft_dirty::probe();
    tracing::info!(
        available = soft_dirty.available,
        reason = %soft_dirty.reason,
        "soft-dirty page tracking"
    );
    let runtime = Arc::new(runtime);
    let checkpointer = Arc::new(Checkpointer::new(runtime.clone(), Default::default()));
    let cp = checkpointer.clone();
    tokio::task::spawn_blocking(move || cp.recover())
        .await
        .context("checkpoint recovery panicked")?
        .map_err(|e| anyhow::anyhow!("recovering checkpoints: {e}"))?;
    let engine =
        Engine::new(opts.engine.clone(), Arc::new(turns::CheckpointExecutor(checkpointer.clone())))
            .map_err(|e| anyhow::anyhow!("starting the engine: {e}"))?;
    let hooks = Arc::new(turns::Hooks(OnceLock::new()));
    let coordinator = Coordinator::new(
        opts.proxy.clone(),
        Arc::new(turns::SandboxDir(runtime.clone())),
        hooks.clone(),
    )
    .map_err(|e| anyhow::anyhow!("configuring the LLM proxy: {e}"))?;
    let remote = match &opts.remote {
        Some(o) => Some(Arc::new(
            remote::RemoteTier::open(&state, o)
                .await
                .map_err(|e| anyhow::anyhow!("opening the remote store {}: {e}", o.url))?,
        )),
        None => None,
    };
    let daemon = Arc::new(Daemon {
        runtime,
        inspector,
        checkpointer,
        force_full: Mutex::new(HashSet::new()),
        engine,
        coordinator,
        sandbox_proxies: Mutex::new(HashMap::new()),
        soft_dirty,
        remote,
    });
    if let Some(t) = &daemon.remote {
        tracing::info!(url = t.repo.url(), "exporting restore points to the remote store");
        tokio::spawn(t.clone().run(Arc::downgrade(&daemon)));
    }
    let _ = hooks.0.set(Arc::downgrade(&daemon));
    let proxy = daemon
        .coordinator
        .bind()
        .await
        .map_err(|e| anyhow::anyhow!("starting the LLM proxy on {}: {e}", opts.proxy.listen))?;
    for s in daemon.runtime.list() {
        if s.state == SandboxState::Running {
            daemon.attach(&s.name);
            daemon.open_sandbox_proxy(&s.name).await;
        }
    }
    let sock = state.socket();
    match std::fs::remove_file(&sock) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("removing stale socket {}", sock.display()))
        }
    }
    // Bind with a restrictive umask so the socket is never reachable by others, even briefly.
    // SAFETY: umask only changes this process's file-creation mask.
    let old = unsafe { libc::umask(0o177) };
    let listener = tokio::net::UnixListener::bind(&sock);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = listener.with_context(|| format!("binding {}", sock.display()))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod {}", sock.display()))?;
    tracing::info!(
        socket = %sock.display(),
        proxy = %proxy.local_addr(),
        sandboxes = daemon.runtime.names().len(),
        "crab daemon ready"
    );
    let app = api::router(daemon.clone());
    // On SIGTERM/SIGINT stop accepting, let in-flight requests finish for a moment, then go:
    // a long exec stream must not keep the daemon (and its state-directory lock) alive.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let limits = serve::ApiLimits::new(fds.api_connections);
    let server = tokio::spawn(serve::serve(listener, app, limits, stop_rx));
    shutdown_signal().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    match tokio::time::timeout(std::time::Duration::from_secs(2), server).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e).context("the API server task failed"),
        Err(_) => tracing::warn!("in-flight requests did not finish within 2 s; leaving anyway"),
    }
    let _ = std::fs::remove_file(&sock);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), proxy.shutdown()).await;
    tracing::info!("crab daemon stopped; sandboxes keep running");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Hold an exclusive `flock` on the pid file for the daemon's lifetime.
fn lock_pid_file(path: &PathBuf) -> anyhow::Result<std::fs::File> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let other = std::fs::read_to_string(path).unwrap_or_default();
        bail!(
            "another crab daemon (pid {}) already serves this state directory; stop it first or use another --state-dir",
            other.trim()
        );
    }
    f.set_len(0)?;
    writeln!(f, "{}", std::process::id())?;
    Ok(f)
}
