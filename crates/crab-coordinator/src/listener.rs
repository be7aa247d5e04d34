//! The one bounded listener every HTTP door of the daemon is served by — the API socket, the
//! LLM proxy (its host listener and each in-sandbox endpoint) and the E2B port: an accept loop
//! that admits a connection only through every one of its [`ConnGate`]s (a connection past any
//! of them is answered by the caller's `refuse` — a JSON 503 — and closed, never given a task),
//! a header-read timeout (also the idle limit of a kept-alive connection), backing off when
//! `accept` fails (EMFILE: the descriptors are gone for now), and a stop that either drops the
//! connections or asks each to finish the request in flight. The body deadline and size cap are
//! the service's own layers ([`crate::limits::DeadlineBody`]); the gates are sized from the
//! process's [`crate::limits::FdBudget`].

use std::future::Future;
use std::time::Duration;

use hyper::body::{Body, Incoming};
use hyper::service::Service;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::limits::{ConnGate, ConnPermit};

/// A listening socket the bounded loop accepts from.
pub trait Accept: Send + 'static {
    /// A connection.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection.
    fn accept_one(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
    /// Write `bytes` without waiting (a refusal; what does not fit is dropped).
    fn try_write(stream: &Self::Stream, bytes: &[u8]);
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    async fn accept_one(&self) -> std::io::Result<TcpStream> {
        let (s, _) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
    fn try_write(stream: &TcpStream, bytes: &[u8]) {
        let _ = stream.try_write(bytes);
    }
}

impl Accept for UnixListener {
    type Stream = UnixStream;
    async fn accept_one(&self) -> std::io::Result<UnixStream> {
        let (s, _) = self.accept().await?;
        Ok(s)
    }
    fn try_write(stream: &UnixStream, bytes: &[u8]) {
        let _ = stream.try_write(bytes);
    }
}

/// How a listener is bounded.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// Every gate a connection must pass (e.g. its endpoint's and the process-wide one).
    pub gates: Vec<ConnGate>,
    /// Longest a client may take to send a request head, or sit idle between requests.
    pub header_read_timeout: Option<Duration>,
    /// On stop, let each connection finish its request in flight (else drop them).
    pub drain: bool,
    /// For logs.
    pub name: &'static str,
}

/// Serve `svc` (one clone per connection) on `listener` within `bounds` until `stop` resolves.
/// A connection refused at gate `i` is handed to `refuse(&stream, i)`, which answers it.
/// Returns once stopped (and, with `drain`, once every connection ended).
pub async fn serve<L, S, B>(
    listener: L,
    bounds: Bounds,
    svc: S,
    mut refuse: impl FnMut(&L::Stream, usize) + Send,
    stop: impl Future<Output = ()> + Send,
) where
    L: Accept,
    S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            () = &mut stop => break,
            a = listener.accept_one() => a,
        };
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(listener = bounds.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        let mut permits: Vec<ConnPermit> = Vec::with_capacity(bounds.gates.len());
        let mut refused = None;
        for (i, g) in bounds.gates.iter().enumerate() {
            match g.try_enter() {
                Some(p) => permits.push(p),
                None => {
                    refused = Some(i);
                    break;
                }
            }
        }
        if let Some(i) = refused {
            drop(permits);
            refuse(&stream, i);
            continue;
        }
        let svc = svc.clone();
        let mut stopped = stop_rx.clone();
        let (header_timeout, name) = (bounds.header_read_timeout, bounds.name);
        conns.spawn(async move {
            let _permits = permits;
            let mut b = hyper::server::conn::http1::Builder::new();
            b.keep_alive(true).timer(TokioTimer::new());
            if let Some(t) = header_timeout {
                b.header_read_timeout(t);
            }
            let conn = b.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let res = tokio::select! {
                r = conn.as_mut() => r,
                () = until_true(&mut stopped) => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = res {
                tracing::debug!(listener = name, error = %e, "connection ended with an error");
            }
        });
    }
    if bounds.drain {
        let _ = stop_tx.send(true);
        while conns.join_next().await.is_some() {}
    } else {
        conns.detach_all();
    }
}

async fn until_true(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Every gate is a cap: a connection past the second is refused by the caller's answer,
    /// and a slot freed by a closed connection admits the next.
    #[tokio::test]
    async fn every_gate_bounds_and_refusals_are_answered() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let svc = hyper::service::service_fn(|_req: Request<Incoming>| async {
            Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                bytes::Bytes::from_static(b"ok"),
            )))
        });
        let bounds = Bounds {
            gates: vec![ConnGate::new(8), ConnGate::new(1)],
            header_read_timeout: Some(Duration::from_secs(5)),
            drain: true,
            name: "test",
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            l,
            bounds,
            svc,
            |s: &TcpStream, i| TcpListener::try_write(s, format!("refused at {i}").as_bytes()),
            async {
                let _ = rx.await;
            },
        ));
        let mut first = TcpStream::connect(addr).await.unwrap();
        first.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 256];
        let n = first.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).ends_with("ok"));
        let mut second = TcpStream::connect(addr).await.unwrap();
        let mut s = String::new();
        second.read_to_string(&mut s).await.unwrap();
        assert_eq!(s, "refused at 1");
        drop(first);
        let mut ok = false;
        for _ in 0..50 {
            let mut third = TcpStream::connect(addr).await.unwrap();
            third
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut s = String::new();
            let _ = third.read_to_string(&mut s).await;
            if s.ends_with("ok") {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(ok, "the freed slot never admitted a connection");
        let _ = tx.send(());
        task.await.unwrap();
    }
}
