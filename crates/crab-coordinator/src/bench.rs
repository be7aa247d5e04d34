//! `crab bench proxy`: the proxy's overhead per request against a direct call to the same stub
//! upstream, measured side by side in one run (interleaved, alternating which goes first, so
//! machine noise hits all alike). Each proxied request is a new turn (distinct body), so the
//! figure includes attribution, hashing, the boundary hook (an instantly published ticket) and
//! the conversation-log append — with and without fsync, as two interleaved arms.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use crate::config::ProxyConfig;
use crate::proxy::{CoordError, Coordinator};
use crate::stub::{InstantHooks, MemoryDirectory, StubConfig, StubUpstream};

/// Budget from the issue: proxy overhead p50 over a direct call.
pub const OVERHEAD_BUDGET_P50_MS: f64 = 0.5;

/// Options of the proxy benchmark.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProxyBenchOptions {
    /// Measured requests per arm.
    pub iterations: usize,
    /// Unmeasured requests per arm first.
    pub warmup: usize,
    /// Size of each request body (a chat request of about this many bytes).
    pub body_bytes: usize,
    /// Where the conversation logs go (its filesystem decides the fsync cost); a temporary
    /// directory when `None`.
    pub log_dir: Option<PathBuf>,
}

impl Default for ProxyBenchOptions {
    fn default() -> Self {
        ProxyBenchOptions { iterations: 2000, warmup: 200, body_bytes: 4096, log_dir: None }
    }
}

/// Latency summary in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl LatencySummary {
    /// Summarize samples (any order).
    pub fn of(samples: &[f64]) -> LatencySummary {
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let pct = |q: f64| {
            if s.is_empty() {
                return f64::NAN;
            }
            let rank = (q * s.len() as f64).ceil() as usize;
            s[rank.clamp(1, s.len()) - 1]
        };
        let n = s.len();
        LatencySummary {
            n,
            p50: pct(0.5),
            p95: pct(0.95),
            p99: pct(0.99),
            mean: if n == 0 { f64::NAN } else { s.iter().sum::<f64>() / n as f64 },
            min: s.first().copied().unwrap_or(f64::NAN),
            max: s.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// Result of the proxy benchmark.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProxyBenchReport {
    /// The options used.
    pub options: ProxyBenchOptions,
    /// Where the logs were written.
    pub log_dir: String,
    /// Direct POSTs to the stub.
    pub direct: LatencySummary,
    /// Through the proxy, log fsynced (production setting).
    pub proxied: LatencySummary,
    /// Through the proxy, log written without fsync.
    pub proxied_no_fsync: LatencySummary,
    /// Median of per-iteration differences proxied − direct (ms).
    pub overhead_p50_ms: f64,
    /// Median of per-iteration differences proxied-without-fsync − direct (ms).
    pub overhead_no_fsync_p50_ms: f64,
    /// [`OVERHEAD_BUDGET_P50_MS`].
    pub budget_p50_ms: f64,
    /// Whether `overhead_p50_ms` is within the budget.
    pub within_budget: bool,
    /// Turn boundaries the proxy marked (should be warmup + iterations per proxied arm).
    pub boundaries: usize,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Setting up (stub, temp dir, proxy) failed.
    #[error("proxy benchmark set-up failed: {0}")]
    Setup(String),
    /// A request failed.
    #[error("proxy benchmark request to {target} failed: {message}")]
    Request {
        /// `direct` or `proxy`.
        target: &'static str,
        /// What happened.
        message: String,
    },
}

impl From<CoordError> for BenchError {
    fn from(e: CoordError) -> Self {
        BenchError::Setup(e.to_string())
    }
}

type BenchClient = Client<HttpConnector, Full<Bytes>>;

async fn post(
    client: &BenchClient,
    url: &str,
    body: Bytes,
    target: &'static str,
) -> Result<f64, BenchError> {
    let err = |m: String| BenchError::Request { target, message: m };
    let req = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench")
        .body(Full::new(body))
        .map_err(|e| err(e.to_string()))?;
    let t = Instant::now();
    let resp = client.request(req).await.map_err(|e| err(e.to_string()))?;
    let status = resp.status();
    let _ = resp.into_body().collect().await.map_err(|e| err(e.to_string()))?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !status.is_success() {
        return Err(err(format!("status {status}")));
    }
    Ok(ms)
}

/// Run the benchmark (inside a tokio runtime).
pub async fn bench_proxy(opts: ProxyBenchOptions) -> Result<ProxyBenchReport, BenchError> {
    let stub = StubUpstream::start(StubConfig::default())
        .await
        .map_err(|e| BenchError::Setup(format!("starting the stub upstream: {e}")))?;
    let tmp;
    let root = match &opts.log_dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new()
                .prefix("crab-bench-proxy")
                .tempdir()
                .map_err(|e| BenchError::Setup(format!("creating a temporary directory: {e}")))?;
            tmp.path().to_path_buf()
        }
    };
    let mut servers = Vec::new();
    let mut hooks_all = Vec::new();
    for (name, fsync) in [("sync", true), ("nosync", false)] {
        let dir = MemoryDirectory::new(root.join(name), &["bench"]);
        let hooks = InstantHooks::new();
        let cfg = ProxyConfig {
            listen: "127.0.0.1:0".parse().map_err(|_| BenchError::Setup("address".into()))?,
            upstream_openai: stub.url(),
            upstream_anthropic: stub.url(),
            fsync_log: fsync,
            ..Default::default()
        };
        let coord = Coordinator::new(cfg, dir, hooks.clone())?;
        servers.push(coord.bind().await?);
        hooks_all.push(hooks);
    }
    let client: BenchClient = {
        let mut c = HttpConnector::new();
        c.set_nodelay(true);
        Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).build(c)
    };
    let direct_url = format!("{}/v1/chat/completions", stub.url());
    let sync_url = format!("http://{}/s/bench/v1/chat/completions", servers[0].local_addr());
    let nosync_url = format!("http://{}/s/bench/v1/chat/completions", servers[1].local_addr());
    let pad = "x".repeat(opts.body_bytes.saturating_sub(120));
    let body = |i: usize| {
        Bytes::from(format!(
            "{{\"model\":\"stub\",\"messages\":[{{\"role\":\"user\",\"content\":\"turn {i} {pad}\"}}]}}"
        ))
    };
    let (mut d, mut p, mut q) = (Vec::new(), Vec::new(), Vec::new());
    let (mut dp, mut dq) = (Vec::new(), Vec::new());
    for i in 0..opts.warmup + opts.iterations {
        let b = body(i);
        // Rotate the order of the three arms.
        let mut t = [0.0f64; 3];
        for k in 0..3 {
            let arm = (i + k) % 3;
            t[arm] = match arm {
                0 => post(&client, &direct_url, b.clone(), "direct").await?,
                1 => post(&client, &sync_url, b.clone(), "proxy").await?,
                _ => post(&client, &nosync_url, b.clone(), "proxy").await?,
            };
        }
        if i >= opts.warmup {
            d.push(t[0]);
            p.push(t[1]);
            q.push(t[2]);
            dp.push(t[1] - t[0]);
            dq.push(t[2] - t[0]);
        }
    }
    let boundaries = hooks_all[0].boundaries().len();
    for s in servers {
        s.shutdown().await;
    }
    let overhead_p50_ms = LatencySummary::of(&dp).p50;
    Ok(ProxyBenchReport {
        log_dir: root.display().to_string(),
        options: opts,
        direct: LatencySummary::of(&d),
        proxied: LatencySummary::of(&p),
        proxied_no_fsync: LatencySummary::of(&q),
        overhead_p50_ms,
        overhead_no_fsync_p50_ms: LatencySummary::of(&dq).p50,
        budget_p50_ms: OVERHEAD_BUDGET_P50_MS,
        within_budget: overhead_p50_ms <= OVERHEAD_BUDGET_P50_MS,
        boundaries,
    })
}
