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
mod e2b;
mod files;
mod images;
mod inspect;
mod lifecycle;
mod procs;
mod remote;
mod sandboxes;
pub mod serve;

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use anyhow::{bail, Context};

use crab_common::paths::StateDir;
use crab_coordinator::ProxyConfig;
use crab_engine::EngineConfig;
use crab_host::remote::RemoteOptions;
use crab_host::{Host, HostOptions};

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
    pub remote: Option<RemoteOptions>,
    /// Default address range of `nat` sandboxes (`--nat-range`).
    pub nat_range: String,
    /// The E2B-compatible API (`--e2b-listen`), if any.
    pub e2b: Option<E2bOptions>,
    /// `--default-memory`, `--default-pids`, `--default-disk`: the limits of sandboxes created
    /// without their own.
    pub default_limits: crab_common::api::Limits,
    /// Remount cgroup2 with `favordynmods` at start (off with `--no-cgroup-favordynmods`).
    pub cgroup_favordynmods: bool,
    /// The user-namespace range of new sandboxes (`None`: the host's).
    pub userns: Option<crab_common::api::IdRange>,
    /// `--warm-roots`: ready-made root filesystems per recently used image.
    pub warm_roots: usize,
    /// `--pull`, `--insecure-registry`: images given as registry references.
    pub pulls: crab_host::PullPolicy,
    /// `--memory-budget`: parking at turn boundaries.
    pub park: Option<crab_host::ParkPolicy>,
    /// Bounds of the API socket's and the E2B port's requests.
    pub http: HttpOptions,
}

/// `--max-upload`, `--http-header-timeout`, `--http-body-timeout`: what the API socket and the
/// E2B port let a request take.
#[derive(Debug, Clone, Copy)]
pub struct HttpOptions {
    /// Largest body streamed into a sandbox (file, tar, stdin).
    pub max_upload: u64,
    /// Longest a client may take to send a request head, or sit idle between requests.
    pub header_timeout: std::time::Duration,
    /// Longest the daemon waits for a request body's client (plus 1 s per MiB received).
    pub body_timeout: std::time::Duration,
}

/// Where and for whom the E2B-compatible API is served.
#[derive(Debug, Clone)]
pub struct E2bOptions {
    /// Listen address.
    pub listen: std::net::SocketAddr,
    /// Accepted API keys.
    pub keys: crab_e2b::Keys,
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
    let host = Host::open(HostOptions {
        state: state.clone(),
        pool_size: opts.pool_size,
        helper_exe: exe,
        proxy: opts.proxy.clone(),
        engine: opts.engine.clone(),
        remote: opts.remote.clone(),
        nat_range: Some(opts.nat_range.clone()),
        default_limits: opts.default_limits.clone(),
        cgroup_favordynmods: opts.cgroup_favordynmods,
        userns: opts.userns,
        warm_roots: opts.warm_roots,
        pulls: opts.pulls.clone(),
        park: opts.park.clone(),
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
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
        proxy = ?host.proxy_addr(),
        sandboxes = host.sandbox_count(),
        "crab daemon ready"
    );
    // An older daemon's E2B front door kept sandboxes' life in files of its own: the host
    // takes it over once, before any front door serves.
    e2b::migrate(&host, &state.root().join("e2b")).await;
    // On SIGTERM/SIGINT stop accepting, let in-flight requests finish for a moment, then go:
    // a long exec stream must not keep the daemon (and its state-directory lock) alive.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let e2b_server = match &opts.e2b {
        Some(o) => {
            let l = tokio::net::TcpListener::bind(o.listen)
                .await
                .with_context(|| format!("binding the E2B API on {}", o.listen))?;
            let dir = state.root().join("e2b");
            let store = crab_e2b::Store::open(&dir).unwrap_or_else(|e| {
                tracing::error!(
                    error = %e,
                    "the E2B front-door state cannot be used; serving E2B without persistence this run (fix {} and restart)",
                    dir.display()
                );
                crab_e2b::Store::memory()
            });
            let front = crab_e2b::E2b::new(
                std::sync::Arc::new(e2b::HostBackend(host.clone())),
                crab_e2b::Config {
                    keys: o.keys.clone(),
                    default_image: "debian".into(),
                    store,
                    max_upload: opts.http.max_upload,
                },
            );
            let router = front.router();
            tracing::info!(listen = %o.listen, "E2B-compatible API ready");
            // The API socket's bounds, with a connection cap of its own from the budget; the
            // E2B router bounds its uploads itself (`--max-upload`), streaming them.
            let limits = serve::ApiLimits::new(fds.e2b_connections, &opts.http);
            Some(tokio::spawn(serve::serve_e2b(l, router, limits, stop_rx.clone())))
        }
        None => None,
    };
    let app = api::router(host.clone(), opts.http.max_upload);
    let limits = serve::ApiLimits::new(fds.api_connections, &opts.http);
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
    if let Some(s) = e2b_server {
        s.abort();
    }
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), host.shutdown()).await;
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
