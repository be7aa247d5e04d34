//! `crab bench e2b-health`: what E2B's `GET /health` with an `E2b-Sandbox-Id` (the SDK's
//! `is_running()`, called often) costs with 1 sandbox on the host and with N, against what
//! the previous front door did for the same question — list every sandbox (`GET
//! /v1/sandboxes`, which stats each one's cgroup and quota): health and list interleaved
//! with 1 sandbox on the host, then the N−1 others created, then both interleaved again, then
//! `/health` once more with 1 sandbox (the others removed), which shows how much of a
//! difference is the machine drifting rather than the number of sandboxes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use serde::Serialize;

use crab_client::{Client, Method};
use crab_common::api::{SandboxCreateRequest, SandboxInfo};
use crab_common::ApiError;

use crate::stats::Summary;

/// Results of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct HealthReport {
    /// Sandboxes on the host in the "many" arm.
    pub sandboxes: usize,
    /// `/health` for one sandbox with 1 sandbox on the host, ms.
    pub health_1_ms: Summary,
    /// The same with `sandboxes` on the host, ms.
    pub health_n_ms: Summary,
    /// `GET /v1/sandboxes` (the old front door's liveness question) with 1, ms.
    pub list_1_ms: Summary,
    /// The same with `sandboxes`, ms.
    pub list_n_ms: Summary,
    /// `/health` with 1 sandbox again, after the others were removed (how much of a
    /// difference is the machine drifting, not the number of sandboxes), ms.
    pub health_1_after_ms: Summary,
    /// `/health` interleaved with list-all calls, 1 sandbox, ms (a list of many sandboxes
    /// between two calls leaves caches colder for the next).
    pub health_1_mixed_ms: Summary,
    /// The same with `sandboxes`, ms.
    pub health_n_mixed_ms: Summary,
    /// health_n p50 / health_1 p50 (≈ 1: the cost does not grow with the host).
    pub health_ratio_p50: f64,
    /// list_n p50 / list_1 p50.
    pub list_ratio_p50: f64,
}

/// What [`run`] measures.
#[derive(Debug, Clone)]
pub struct HealthOptions<'a> {
    /// Image to create from.
    pub image: &'a str,
    /// Sandboxes in the "many" arm.
    pub sandboxes: usize,
    /// Calls per series.
    pub calls: usize,
    /// The daemon's `--e2b-listen` address.
    pub e2b: &'a str,
}

/// One kept-alive HTTP/1.1 connection to the E2B port.
struct Conn(TcpStream);

impl Conn {
    fn open(addr: &str) -> Result<Conn, ApiError> {
        let s = TcpStream::connect(addr)
            .map_err(|e| ApiError::internal(format!("connecting to the E2B API on {addr}: {e}")))?;
        let _ = s.set_nodelay(true);
        Ok(Conn(s))
    }

    /// `GET /health` for sandbox `id`; ms, and whether it said 204.
    fn health(&mut self, id: &str) -> Result<(f64, bool), ApiError> {
        let t = Instant::now();
        let req = format!("GET /health HTTP/1.1\r\nhost: crab\r\ne2b-sandbox-id: {id}\r\n\r\n");
        self.0.write_all(req.as_bytes()).map_err(|e| ApiError::internal(format!("health: {e}")))?;
        let mut buf = Vec::with_capacity(512);
        let mut b = [0u8; 512];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = self.0.read(&mut b).map_err(|e| ApiError::internal(format!("health: {e}")))?;
            if n == 0 {
                return Err(ApiError::internal("the E2B API closed the connection"));
            }
            buf.extend_from_slice(&b[..n]);
        }
        let ok = buf.starts_with(b"HTTP/1.1 204");
        Ok((t.elapsed().as_secs_f64() * 1e3, ok))
    }
}

/// Measure.
pub async fn run(client: &Client, opts: &HealthOptions<'_>) -> Result<HealthReport, ApiError> {
    let mut made: Vec<String> = Vec::new();
    let r = measure(client, opts, &mut made).await;
    for n in &made {
        let _: Result<serde_json::Value, _> = client
            .call::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{n}?force=true"), None)
            .await;
    }
    r
}

async fn measure(
    client: &Client,
    opts: &HealthOptions<'_>,
    made: &mut Vec<String>,
) -> Result<HealthReport, ApiError> {
    let before: Vec<SandboxInfo> = client.call::<(), _>(Method::GET, "/v1/sandboxes", None).await?;
    if !before.is_empty() {
        return Err(ApiError::invalid(
            format!("the daemon already has {} sandboxes", before.len()),
            "run this benchmark on a daemon without sandboxes (it compares 1 with N)",
        ));
    }
    let create = |name: String| SandboxCreateRequest {
        name: Some(name),
        ..SandboxCreateRequest::new(opts.image)
    };
    let pid = std::process::id();
    let first: SandboxInfo =
        client.call(Method::POST, "/v1/sandboxes", Some(&create(format!("bh-{pid}-0")))).await?;
    made.push(first.name.clone());
    let mut conn = Conn::open(opts.e2b)?;
    let name = first.name.clone();
    let solo = |conn: &mut Conn| -> Result<Vec<f64>, ApiError> {
        let mut v = Vec::with_capacity(opts.calls);
        for _ in 0..opts.calls {
            let (ms, ok) = conn.health(&name)?;
            if !ok {
                return Err(ApiError::internal("/health did not answer 204 for a running sandbox"));
            }
            v.push(ms);
        }
        Ok(v)
    };
    let h1 = solo(&mut conn)?;
    let (mut hl1, mut l1) = (Vec::new(), Vec::new());
    for _ in 0..opts.calls {
        hl1.push(conn.health(&first.name)?.0);
        l1.push(list_all(client).await?);
    }
    for i in 1..opts.sandboxes {
        let s: SandboxInfo = client
            .call(Method::POST, "/v1/sandboxes", Some(&create(format!("bh-{pid}-{i}"))))
            .await?;
        made.push(s.name);
    }
    let hn = solo(&mut conn)?;
    let (mut hln, mut ln) = (Vec::new(), Vec::new());
    for _ in 0..opts.calls {
        hln.push(conn.health(&first.name)?.0);
        ln.push(list_all(client).await?);
    }
    for n in made.drain(1..) {
        let _: serde_json::Value = client
            .call::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{n}?force=true"), None)
            .await?;
    }
    let after = solo(&mut conn)?;
    let s = Summary::of;
    let (h1, hn) = (s(&h1), s(&hn));
    let (l1, ln) = (s(&l1), s(&ln));
    Ok(HealthReport {
        sandboxes: opts.sandboxes,
        health_ratio_p50: hn.p50 / h1.p50,
        list_ratio_p50: ln.p50 / l1.p50,
        health_1_ms: h1,
        health_n_ms: hn,
        health_1_after_ms: s(&after),
        health_1_mixed_ms: s(&hl1),
        health_n_mixed_ms: s(&hln),
        list_1_ms: l1,
        list_n_ms: ln,
    })
}

/// `GET /v1/sandboxes`, ms.
async fn list_all(client: &Client) -> Result<f64, ApiError> {
    let t = Instant::now();
    let _: Vec<SandboxInfo> = client.call::<(), _>(Method::GET, "/v1/sandboxes", None).await?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}
