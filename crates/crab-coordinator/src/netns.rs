//! Listening sockets inside a sandbox's network namespace, so an agent that runs *inside* its
//! sandbox reaches the proxy at a fixed loopback address (e.g. `http://127.0.0.1:7431/v1`)
//! without any host networking. The socket is created by a short-lived thread that enters the
//! namespace, binds, and exits; the socket stays in that namespace and is served by the
//! daemon's runtime like any other. A restored or forked sandbox has a new namespace, so the
//! daemon binds again after restore and fork.

use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// Why a socket could not be opened inside a namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened.
    #[error("opening network namespace {path}: {source}")]
    Open {
        /// e.g. `/proc/<pid>/ns/net`.
        path: PathBuf,
        /// Error.
        source: std::io::Error,
    },
    /// `setns` failed (needs CAP_SYS_ADMIN).
    #[error("entering network namespace {path}: {source}")]
    Enter {
        /// Namespace file.
        path: PathBuf,
        /// Error.
        source: nix::Error,
    },
    /// Binding failed (address in use, or `lo` is down in that namespace).
    #[error("binding {addr} inside network namespace {path}: {source}")]
    Bind {
        /// Namespace file.
        path: PathBuf,
        /// Address.
        addr: SocketAddr,
        /// Error.
        source: std::io::Error,
    },
    /// The helper thread died.
    #[error("the thread binding inside network namespace {0} panicked")]
    Thread(PathBuf),
}

/// Bind `addr` inside the network namespace at `netns` (e.g. `/proc/<init pid>/ns/net`) and
/// return a non-blocking listener ready for [`tokio::net::TcpListener::from_std`].
pub fn bind_in_netns(netns: &Path, addr: SocketAddr) -> Result<std::net::TcpListener, NetnsError> {
    let path = netns.to_path_buf();
    let p = path.clone();
    std::thread::Builder::new()
        .name("crab-netns-bind".into())
        .spawn(move || {
            let f =
                File::open(&p).map_err(|source| NetnsError::Open { path: p.clone(), source })?;
            nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|source| NetnsError::Enter { path: p.clone(), source })?;
            let l = std::net::TcpListener::bind(addr)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .map_err(|source| NetnsError::Bind { path: p.clone(), addr, source })?;
            Ok(l)
        })
        .map_err(|_| NetnsError::Thread(path.clone()))?
        .join()
        .map_err(|_| NetnsError::Thread(path))?
}
