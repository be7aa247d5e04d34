//! Bounds on what clients of the proxy (and of the daemon's API) may hold: connection gates
//! (per listener and process-wide), a byte budget for request bodies held in memory, a deadline
//! on reading a request body, the answer a refused connection gets, and the process's
//! file-descriptor budget that sizes the gates so a flood of connections can never take the
//! descriptors the daemon's own API and its checkpoint work need.
//!
//! Every sandbox is treated as hostile: code in one can open connections to its in-sandbox
//! proxy endpoint as fast as the kernel lets it, send headers a byte at a time, or announce a
//! huge body and never send it. Each of those now costs it a bounded share of the daemon.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::proxy::BoxError;

/// A cap on concurrent connections. `0` means no cap.
#[derive(Debug, Clone)]
pub struct ConnGate {
    sem: Option<Arc<Semaphore>>,
    limit: usize,
}

impl ConnGate {
    /// A gate admitting at most `limit` connections at once (`0` = unlimited).
    pub fn new(limit: usize) -> ConnGate {
        let limit = limit.min(Semaphore::MAX_PERMITS);
        ConnGate { sem: (limit > 0).then(|| Arc::new(Semaphore::new(limit))), limit }
    }

    /// Admit one connection, or `None` when the gate is full. The permit is the connection's
    /// place: drop it when the connection ends.
    pub fn try_enter(&self) -> Option<ConnPermit> {
        match &self.sem {
            None => Some(ConnPermit(None)),
            Some(s) => s.clone().try_acquire_owned().ok().map(|p| ConnPermit(Some(p))),
        }
    }

    /// The cap (`0` = unlimited).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Connections admitted now.
    pub fn in_use(&self) -> usize {
        self.sem.as_ref().map_or(0, |s| self.limit - s.available_permits())
    }
}

/// A connection's place in a [`ConnGate`].
#[derive(Debug)]
pub struct ConnPermit(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// Longest a request waits for room in a [`ByteBudget`] before it is refused as busy (the
/// requests holding it are the sandbox's own, or the whole proxy is saturated).
pub const BUDGET_WAIT: Duration = Duration::from_secs(2);

/// Bytes of request bodies held in memory at once, counted in KiB. `0` means no budget.
#[derive(Debug, Clone)]
pub struct ByteBudget {
    sem: Option<Arc<Semaphore>>,
    limit_bytes: usize,
}

/// Bytes held against one or more [`ByteBudget`]s; released on drop.
#[derive(Debug, Default)]
pub struct BodyHold(Vec<OwnedSemaphorePermit>);

impl BodyHold {
    fn add(&mut self, p: Option<OwnedSemaphorePermit>) {
        if let Some(p) = p {
            self.0.push(p);
        }
    }
}

impl ByteBudget {
    /// A budget of `limit_bytes` (`0` = unlimited).
    pub fn new(limit_bytes: usize) -> ByteBudget {
        let kib = limit_bytes.div_ceil(1024).min(Semaphore::MAX_PERMITS);
        ByteBudget { sem: (kib > 0).then(|| Arc::new(Semaphore::new(kib))), limit_bytes }
    }

    /// The budget in bytes (`0` = unlimited).
    pub fn limit(&self) -> usize {
        self.limit_bytes
    }

    /// Hold `bytes` more (rounded up to KiB), waiting until `deadline` (at most
    /// [`BUDGET_WAIT`]) for others to release theirs; `false` if that time passed first (or the
    /// amount exceeds the whole budget).
    async fn reserve(&self, bytes: usize, deadline: Option<Instant>, hold: &mut BodyHold) -> bool {
        let Some(sem) = &self.sem else { return true };
        let kib = bytes.div_ceil(1024);
        let Ok(n) = u32::try_from(kib) else { return false };
        if kib > self.limit_bytes.div_ceil(1024) {
            return false;
        }
        let wait = Instant::now() + BUDGET_WAIT;
        let until = deadline.map_or(wait, |d| d.min(wait));
        let acquire = sem.clone().acquire_many_owned(n);
        let got = tokio::time::timeout_at(until, acquire).await.ok().and_then(Result::ok);
        match got {
            Some(p) => {
                hold.add(Some(p));
                true
            }
            None => false,
        }
    }
}

/// Why a request body could not be read within the proxy's bounds.
#[derive(Debug)]
pub enum BodyReadError {
    /// Larger than the per-request limit (bytes).
    TooLarge(usize),
    /// Not complete within the body-read timeout.
    Timeout(Duration),
    /// The memory budget for request bodies stayed exhausted until the timeout.
    Busy,
    /// The connection failed while reading.
    Read(String),
}

/// Read a whole request body of at most `limit` bytes before `timeout`, holding its size
/// against every budget in `budgets`: a body of known length (`Content-Length`) reserves all of
/// it at once before its first byte is read, so two large bodies never each hold half of a
/// budget while waiting for the other's half (one reads, the other waits its turn); a body
/// of unknown length reserves as it arrives.
pub async fn read_body<B>(
    body: B,
    limit: usize,
    timeout: Option<Duration>,
    budgets: &[&ByteBudget],
) -> Result<(Bytes, BodyHold), BodyReadError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    use http_body_util::BodyExt;
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut body = body;
    let mut hold = BodyHold::default();
    let mut buf: Vec<u8> = Vec::new();
    let mut first: Option<Bytes> = None;
    let mut reserved = 0usize;
    if let Some(n) = body.size_hint().exact() {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        if n > limit {
            return Err(BodyReadError::TooLarge(limit));
        }
        reserve_all(budgets, n, deadline, timeout, &mut hold).await?;
        reserved = n;
    }
    loop {
        let next = body.frame();
        let frame = match deadline {
            Some(d) => match tokio::time::timeout_at(d, next).await {
                Ok(f) => f,
                Err(_) => return Err(BodyReadError::Timeout(timeout.unwrap_or_default())),
            },
            None => next.await,
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| BodyReadError::Read(e.to_string()))?;
        let Ok(data) = frame.into_data() else { continue };
        let total = buf.len() + first.as_ref().map_or(0, Bytes::len) + data.len();
        if total > limit {
            return Err(BodyReadError::TooLarge(limit));
        }
        if total > reserved {
            reserve_all(budgets, total - reserved, deadline, timeout, &mut hold).await?;
            reserved = total;
        }
        // One frame (the usual case for a small body) is kept as is, without a copy.
        match first.take() {
            None if buf.is_empty() => first = Some(data),
            Some(f) => {
                buf.extend_from_slice(&f);
                buf.extend_from_slice(&data);
            }
            None => buf.extend_from_slice(&data),
        }
    }
    Ok((first.unwrap_or_else(|| Bytes::from(buf)), hold))
}

/// Hold `bytes` more against every budget (see [`ByteBudget::reserve`]).
async fn reserve_all(
    budgets: &[&ByteBudget],
    bytes: usize,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
    hold: &mut BodyHold,
) -> Result<(), BodyReadError> {
    for b in budgets {
        if !b.reserve(bytes, deadline, hold).await {
            return Err(if deadline.is_some_and(|d| Instant::now() >= d) {
                BodyReadError::Timeout(timeout.unwrap_or_default())
            } else {
                BodyReadError::Busy
            });
        }
    }
    Ok(())
}

/// A request body that fails once `deadline` passes before its end (a streamed body that a
/// client sends a byte at a time cannot hold the upstream connection forever).
pub struct DeadlineBody<B> {
    inner: B,
    sleep: Option<Pin<Box<Sleep>>>,
    timeout: Duration,
}

impl<B> std::fmt::Debug for DeadlineBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadlineBody").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl<B> DeadlineBody<B> {
    /// `inner` must end within `timeout` from now (`None`: no deadline).
    pub fn new(inner: B, timeout: Option<Duration>) -> DeadlineBody<B> {
        DeadlineBody {
            inner,
            sleep: timeout.map(|t| Box::pin(tokio::time::sleep(t))),
            timeout: timeout.unwrap_or_default(),
        }
    }
}

/// A request body whose client must keep it coming: the time spent *waiting for the client*
/// (polled, nothing there) may not pass `base` plus one second per `rate` bytes received so
/// far. Time the consumer spends not reading (a command that takes its stdin slowly, a disk)
/// does not count, so a large upload into a slow sandbox is never cut off, while a client that
/// trickles a body is, at about `base`. The daemon's API socket and E2B port read every body
/// through one (`--http-body-timeout`).
pub struct PacedBody<B> {
    inner: B,
    base: Duration,
    rate: u64,
    received: u64,
    waited: Duration,
    pending_since: Option<Instant>,
    sleep: Pin<Box<Sleep>>,
}

impl<B> std::fmt::Debug for PacedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacedBody")
            .field("base", &self.base)
            .field("received", &self.received)
            .field("waited", &self.waited)
            .finish_non_exhaustive()
    }
}

impl<B> PacedBody<B> {
    /// `inner`, its client allowed `base` of waiting plus one second per `rate` bytes it sent.
    pub fn new(inner: B, base: Duration, rate: u64) -> PacedBody<B> {
        PacedBody {
            inner,
            base,
            rate: rate.max(1),
            received: 0,
            waited: Duration::ZERO,
            pending_since: None,
            sleep: Box::pin(tokio::time::sleep(base)),
        }
    }

    /// The waiting allowed so far.
    fn allowance(&self) -> Duration {
        self.base.saturating_add(Duration::from_secs(self.received / self.rate))
    }
}

impl<B> Body for PacedBody<B>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                if let Some(since) = this.pending_since.take() {
                    this.waited += since.elapsed();
                }
                if let Some(Ok(frame)) = &f {
                    if let Some(d) = frame.data_ref() {
                        use bytes::Buf as _;
                        this.received += d.remaining() as u64;
                    }
                }
                Poll::Ready(f.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => {
                let now = Instant::now();
                let since = *this.pending_since.get_or_insert(now);
                let waited = this.waited + now.duration_since(since);
                let allowed = this.allowance();
                if waited >= allowed {
                    return Poll::Ready(Some(Err(format!(
                        "the request body did not arrive within {:?} (plus 1 s per {} bytes received; {} bytes came)",
                        this.base, this.rate, this.received
                    )
                    .into())));
                }
                this.sleep.as_mut().reset(now + (allowed - waited));
                if this.sleep.as_mut().poll(cx).is_ready() {
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => Poll::Ready(f.map(|r| r.map_err(Into::into))),
            Poll::Pending => {
                let expired = this.sleep.as_mut().is_some_and(|s| s.as_mut().poll(cx).is_ready());
                if expired {
                    this.sleep = None;
                    return Poll::Ready(Some(Err(format!(
                        "the request body did not arrive within {:?}",
                        this.timeout
                    )
                    .into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The raw HTTP/1.1 answer written to a connection refused at accept (a gate is full): a 503
/// with a JSON body, then the connection is closed. `body` is the JSON text.
pub fn refusal_bytes(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nx-crab-error: busy\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// How the process's file descriptors are shared out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FdBudget {
    /// `RLIMIT_NOFILE` (soft) in force, after raising it to the hard limit.
    pub nofile: u64,
    /// Kept for everything but client connections: CRIU sockets and images, exec pipes,
    /// btrfs and cgroup files, BPF maps, logs.
    pub reserved: u64,
    /// Concurrent connections of the daemon's API socket.
    pub api_connections: usize,
    /// Concurrent connections of the E2B port (`--e2b-listen`).
    pub e2b_connections: usize,
    /// Concurrent LLM-proxy connections over all listeners (each may also hold an upstream
    /// connection: two descriptors).
    pub proxy_connections: usize,
}

impl FdBudget {
    /// The split for a descriptor limit of `nofile`: a quarter (at least 64) reserved, an
    /// eighth (at most 1024) for the API, as much again for the E2B port, half of the rest for
    /// proxy connections.
    pub fn for_limit(nofile: u64) -> FdBudget {
        let reserved = (nofile / 4).max(64);
        let api = (nofile / 8).clamp(8, 1024);
        let rest = nofile.saturating_sub(reserved + 2 * api);
        FdBudget {
            nofile,
            reserved,
            api_connections: api as usize,
            e2b_connections: api as usize,
            proxy_connections: (rest / 2).max(16) as usize,
        }
    }

    /// Raise this process's soft `RLIMIT_NOFILE` to its hard limit (logged) and split it.
    pub fn of_process() -> FdBudget {
        let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the struct we pass.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "getrlimit(RLIMIT_NOFILE) failed; assuming 1024 descriptors");
            return FdBudget::for_limit(1024);
        }
        if rl.rlim_cur < rl.rlim_max {
            let raised = libc::rlimit { rlim_cur: rl.rlim_max, rlim_max: rl.rlim_max };
            // SAFETY: setrlimit reads the struct we pass.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                tracing::info!(from = rl.rlim_cur, to = rl.rlim_max, "raised RLIMIT_NOFILE");
                rl.rlim_cur = rl.rlim_max;
            } else {
                tracing::warn!(error = %std::io::Error::last_os_error(), "could not raise RLIMIT_NOFILE");
            }
        }
        let b = FdBudget::for_limit(rl.rlim_cur);
        tracing::info!(
            nofile = b.nofile,
            reserved = b.reserved,
            api = b.api_connections,
            e2b = b.e2b_connections,
            proxy = b.proxy_connections,
            "file descriptor budget"
        );
        b
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use http_body_util::{BodyExt, Full};

    /// A body whose frames never come.
    struct Never;
    impl Body for Never {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }
    }

    #[test]
    fn fd_budget_leaves_room() {
        for n in [256u64, 1024, 1500, 20000, 1 << 20] {
            let b = FdBudget::for_limit(n);
            let used = b.reserved
                + b.api_connections as u64
                + b.e2b_connections as u64
                + 2 * b.proxy_connections as u64;
            assert!(used <= n.max(256 + 16), "{n}: {b:?}");
            assert!(b.reserved >= n / 4, "{n}: {b:?}");
        }
    }

    #[test]
    fn gate_caps_and_releases() {
        let g = ConnGate::new(2);
        let a = g.try_enter().unwrap();
        let _b = g.try_enter().unwrap();
        assert!(g.try_enter().is_none());
        assert_eq!(g.in_use(), 2);
        drop(a);
        assert!(g.try_enter().is_some());
        let open = ConnGate::new(0);
        let held: Vec<_> = (0..10_000).map(|_| open.try_enter().unwrap()).collect();
        assert_eq!(held.len(), 10_000);
    }

    #[tokio::test]
    async fn bodies_are_capped_budgeted_and_timed() {
        let budget = ByteBudget::new(8 << 10);
        let (b, hold) =
            read_body(Full::new(Bytes::from(vec![b'x'; 4096])), 1 << 20, None, &[&budget])
                .await
                .unwrap();
        assert_eq!(b.len(), 4096);
        // Half the budget held: a second 6 KiB body waits, then gives up.
        let r = read_body(
            Full::new(Bytes::from(vec![b'x'; 6 << 10])),
            1 << 20,
            Some(Duration::from_millis(100)),
            &[&budget],
        )
        .await;
        assert!(matches!(r, Err(BodyReadError::Timeout(_)) | Err(BodyReadError::Busy)), "{r:?}");
        drop(hold);
        assert!(read_body(Full::new(Bytes::from(vec![b'x'; 6 << 10])), 1 << 20, None, &[&budget])
            .await
            .is_ok());
        let r = read_body(Full::new(Bytes::from(vec![b'x'; 2048])), 1024, None, &[]).await;
        assert!(matches!(r, Err(BodyReadError::TooLarge(1024))), "{r:?}");
        // A body that never ends.
        let r = read_body(Never, 1024, Some(Duration::from_millis(50)), &[]).await;
        assert!(matches!(r, Err(BodyReadError::Timeout(_))), "{r:?}");
        let d = DeadlineBody::new(Never, Some(Duration::from_millis(50)));
        assert!(d.collect().await.is_err());
    }

    /// `n` frames of 1 KiB, each there at once.
    struct Ready(usize);
    impl Body for Ready {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.0 == 0 {
                return Poll::Ready(None);
            }
            self.0 -= 1;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![0u8; 1024])))))
        }
    }

    /// A client that sends nothing is cut off at the base allowance; a consumer that reads
    /// slowly (a slow command's stdin) is never the client's fault.
    #[tokio::test]
    async fn paced_bodies_count_only_the_wait_for_the_client() {
        let r = PacedBody::new(Never, Duration::from_millis(50), 1 << 20).collect().await;
        let e = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("did not arrive within"), "{e}");
        let mut b = PacedBody::new(Ready(5), Duration::from_millis(20), 1 << 20);
        let mut frames = 0;
        while let Some(f) = b.frame().await {
            f.unwrap();
            frames += 1;
            tokio::time::sleep(Duration::from_millis(40)).await; // the consumer is slow
        }
        assert_eq!(frames, 5);
    }

    /// A body that arrives in `n` frames of `chunk` bytes, one every 10 ms, and says its
    /// length up front (`Content-Length`), as an HTTP client sends a large JSON request.
    struct Slow {
        left: usize,
        chunk: usize,
        tick: Pin<Box<Sleep>>,
    }

    impl Body for Slow {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            if self.tick.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let n = self.chunk.min(self.left);
            self.left -= n;
            let next = tokio::time::Instant::now() + Duration::from_millis(10);
            self.tick.as_mut().reset(next);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; n])))))
        }
        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.left as u64)
        }
    }

    /// Two bodies of 30 of a 32 KiB budget, arriving interleaved: before, each held half and
    /// waited for the other's, and both were refused; now the first reserves its whole length
    /// and passes, the second waits for it.
    #[tokio::test]
    async fn two_large_bodies_do_not_deadlock() {
        let budget = ByteBudget::new(32 << 10);
        let slow = || Slow {
            left: 30 << 10,
            chunk: 2 << 10,
            tick: Box::pin(tokio::time::sleep(Duration::ZERO)),
        };
        let read = |b: Slow| {
            let budget = budget.clone();
            async move {
                let r = read_body(b, 1 << 20, Some(Duration::from_secs(10)), &[&budget]).await;
                // Hold it a moment, as the proxy does while it forwards the request.
                tokio::time::sleep(Duration::from_millis(50)).await;
                r.map(|(b, _hold)| b.len())
            }
        };
        let (a, b) = tokio::join!(read(slow()), read(slow()));
        let ok = [&a, &b].iter().filter(|r| matches!(r, Ok(n) if *n == 30 << 10)).count();
        assert_eq!(ok, 2, "both pass, one after the other: {a:?} {b:?}");
    }
}
