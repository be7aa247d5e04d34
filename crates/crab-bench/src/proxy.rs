//! `crab bench proxy`: the proxy's overhead per request against a direct call to the same stub
//! upstream, measured side by side in one run (interleaved, alternating which goes first, so
//! machine noise hits all alike). Each proxied request is a new turn (distinct body), so the
//! figure includes attribution, hashing, the boundary hook (an instantly published ticket) and
//! the conversation-log append — with and without fsync, as two interleaved arms — and a
//! fourth arm with the proxy's bounds switched off ([`ProxyConfig::unbounded`]: no connection
//! caps, no header or body timeouts, no memory budgets), so their cost is measured side by side
//! against [`BOUNDS_BUDGET_RATIO`].

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use crab_common::CheckpointKind;
use crab_coordinator::{Boundary, CoordError, Coordinator, ProxyConfig};
use crab_testkit::engine::EngineHooks;
use crab_testkit::upstream::{InstantHooks, MemoryDirectory, StubConfig, StubUpstream};

/// Budget from the issue: proxy overhead p50 over a direct call.
pub const OVERHEAD_BUDGET_P50_MS: f64 = 0.5;

/// Budget from the hostile-sandbox issue: the bounded proxy's p50 latency within this factor
/// of the same proxy without bounds.
pub const BOUNDS_BUDGET_RATIO: f64 = 1.1;

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

/// Latency summary in milliseconds (the shared nearest-rank summary).
pub type LatencySummary = crab_common::stats::Summary;

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
    /// Through the proxy with its bounds off (log fsynced): the baseline of the bounds' cost.
    pub proxied_unbounded: LatencySummary,
    /// Median of per-iteration ratios proxied / proxied-unbounded.
    pub bounds_ratio_p50: f64,
    /// [`BOUNDS_BUDGET_RATIO`].
    pub bounds_budget_ratio: f64,
    /// Whether `bounds_ratio_p50` is within [`BOUNDS_BUDGET_RATIO`].
    pub bounds_within_budget: bool,
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
    for (name, fsync, bounded) in
        [("sync", true, true), ("nosync", false, true), ("unbounded", true, false)]
    {
        let dir = MemoryDirectory::new(root.join(name), &["bench"]);
        let hooks = InstantHooks::new();
        let cfg = ProxyConfig {
            listen: "127.0.0.1:0".parse().map_err(|_| BenchError::Setup("address".into()))?,
            upstream_openai: stub.url(),
            upstream_anthropic: stub.url(),
            fsync_log: fsync,
            ..Default::default()
        };
        let cfg = if bounded { cfg } else { cfg.unbounded() };
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
    let unbounded_url = format!("http://{}/s/bench/v1/chat/completions", servers[2].local_addr());
    let pad = "x".repeat(opts.body_bytes.saturating_sub(120));
    let body = |i: usize| {
        Bytes::from(format!(
            "{{\"model\":\"stub\",\"messages\":[{{\"role\":\"user\",\"content\":\"turn {i} {pad}\"}}]}}"
        ))
    };
    let (mut d, mut p, mut q, mut u) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut dp, mut dq, mut pu) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..opts.warmup + opts.iterations {
        let b = body(i);
        // Rotate the order of the four arms.
        let mut t = [0.0f64; 4];
        for k in 0..4 {
            let arm = (i + k) % 4;
            t[arm] = match arm {
                0 => post(&client, &direct_url, b.clone(), "direct").await?,
                1 => post(&client, &sync_url, b.clone(), "proxy").await?,
                2 => post(&client, &nosync_url, b.clone(), "proxy").await?,
                _ => post(&client, &unbounded_url, b.clone(), "proxy").await?,
            };
        }
        if i >= opts.warmup {
            d.push(t[0]);
            p.push(t[1]);
            q.push(t[2]);
            u.push(t[3]);
            dp.push(t[1] - t[0]);
            dq.push(t[2] - t[0]);
            if t[3] > 0.0 {
                pu.push(t[1] / t[3]);
            }
        }
    }
    let boundaries = hooks_all[0].boundaries().len();
    for s in servers {
        s.shutdown().await;
    }
    // Paired differences (may be negative) and ratios are not latencies: exact medians.
    let overhead_p50_ms = crate::stats::median(&dp);
    let bounds_ratio_p50 = crate::stats::median(&pu);
    Ok(ProxyBenchReport {
        log_dir: root.display().to_string(),
        options: opts,
        direct: LatencySummary::of(&d),
        proxied: LatencySummary::of(&p),
        proxied_no_fsync: LatencySummary::of(&q),
        proxied_unbounded: LatencySummary::of(&u),
        bounds_ratio_p50,
        bounds_budget_ratio: BOUNDS_BUDGET_RATIO,
        bounds_within_budget: bounds_ratio_p50 <= BOUNDS_BUDGET_RATIO,
        overhead_p50_ms,
        overhead_no_fsync_p50_ms: crate::stats::median(&dq),
        budget_p50_ms: OVERHEAD_BUDGET_P50_MS,
        within_budget: overhead_p50_ms <= OVERHEAD_BUDGET_P50_MS,
        boundaries,
    })
}

// ---------------------------------------------------------------------------------------------
// Turn benchmark: many sandboxes' agents against the real engine and proxy.
// ---------------------------------------------------------------------------------------------

/// Simulated cost of a checkpoint job per kind, in milliseconds (not time-scaled: these are
/// the measured costs on this host class: btrfs snapshot ≈ 10–35 ms, CRIU dump ≈ 85–105 ms).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobCosts {
    /// Skip: publish a manifest pointing at old parts.
    pub skip_ms: f64,
    /// Filesystem snapshot.
    pub fs_ms: f64,
    /// Process dump.
    pub process_ms: f64,
    /// Both.
    pub full_ms: f64,
}

impl Default for JobCosts {
    fn default() -> Self {
        JobCosts { skip_ms: 1.0, fs_ms: 20.0, process_ms: 100.0, full_ms: 120.0 }
    }
}

/// Options of [`bench_turns`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TurnBenchOptions {
    /// Concurrent sandboxes (agents).
    pub sandboxes: usize,
    /// Turns per sandbox.
    pub turns: usize,
    /// LLM latency samples in milliseconds (e.g. [`load_llm_latencies`] of the mini-swe-agent
    /// traces); sandbox `i` turn `t` uses sample `(i * 7919 + t) % len`. Empty: 4600 ms.
    pub llm_latency_ms: Vec<f64>,
    /// Tool-call time between turns in milliseconds.
    pub exec_ms: f64,
    /// Factor applied to LLM latency and tool time (not to checkpoint costs), to keep runs
    /// short; below 1 the result is pessimistic (less time to hide checkpoints in).
    pub time_scale: f64,
    /// Checkpoint cost per kind.
    pub job_costs: JobCosts,
    /// Verdict mix: weights of skip, fs, process, full.
    pub verdict_mix: [f64; 4],
    /// Every other request streams when true.
    pub streams: bool,
    /// Engine limits.
    pub engine: crab_engine::EngineConfig,
    /// fsync the conversation log (production: true).
    pub fsync_log: bool,
}

impl Default for TurnBenchOptions {
    fn default() -> Self {
        TurnBenchOptions {
            sandboxes: 16,
            turns: 8,
            llm_latency_ms: Vec::new(),
            exec_ms: 250.0,
            time_scale: 0.1,
            job_costs: JobCosts::default(),
            verdict_mix: [0.6, 0.3, 0.05, 0.05],
            streams: true,
            engine: crab_engine::EngineConfig::default(),
            fsync_log: true,
        }
    }
}

/// Result of [`bench_turns`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TurnBenchReport {
    /// Options used (latency samples elided to their count).
    pub sandboxes: usize,
    /// Turns per sandbox.
    pub turns: usize,
    /// Number of LLM latency samples used.
    pub latency_samples: usize,
    /// Time scale used.
    pub time_scale: f64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
    /// Exposed latency per turn (held time, zeros included), ms.
    pub exposed: LatencySummary,
    /// Fraction of turns whose response was held at all.
    pub held_fraction: f64,
    /// Turn latency seen by the agent (request to end of response) minus the model's latency, ms.
    /// Includes the stub's timer rounding (~1 ms), streaming of the SSE responses and host
    /// load; the proxy's own cost is what [`bench_proxy`] measures.
    pub agent_overhead: LatencySummary,
    /// Jobs submitted per kind (skip, fs, process, full).
    pub verdicts: [u64; 4],
    /// Submissions merged into a queued job.
    pub coalesced: u64,
    /// Budget: exposed p95 ≤ 20 ms.
    pub p95_within_budget: bool,
    /// Budget: exposed median 0.
    pub median_zero: bool,
}

/// Read every `llm_latency_s` (non-null) from the `*.jsonl` trace files under `dir`, in ms.
pub fn load_llm_latencies(dir: &std::path::Path) -> std::io::Result<Vec<f64>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    let mut files = Vec::new();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "jsonl") {
                files.push(p);
            }
        }
    }
    files.sort();
    for f in files {
        for line in std::fs::read_to_string(&f)?.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                if let Some(s) = v.get("llm_latency_s").and_then(|x| x.as_f64()) {
                    out.push(s * 1e3);
                }
            }
        }
    }
    Ok(out)
}

struct SleepExecutor(JobCosts);

impl crab_engine::Executor<()> for SleepExecutor {
    type Error = std::convert::Infallible;
    fn run(
        &self,
        job: &crab_engine::Job<()>,
    ) -> Result<crab_engine::JobOutcome, std::convert::Infallible> {
        let ms = match job.kind {
            CheckpointKind::Skip => self.0.skip_ms,
            CheckpointKind::Fs => self.0.fs_ms,
            CheckpointKind::Process => self.0.process_ms,
            CheckpointKind::Full => self.0.full_ms,
        };
        std::thread::sleep(Duration::from_secs_f64(ms.max(0.0) / 1e3));
        Ok(crab_engine::JobOutcome {
            checkpoint_id: format!("{}-{}", job.sandbox, job.turn),
            bytes: 0,
            stages: vec![crab_engine::Stage::new(
                "sleep",
                Duration::from_secs_f64(ms.max(0.0) / 1e3),
            )],
        })
    }
}

/// The verdict mix as a deterministic pseudo-random kind per (sandbox, turn).
fn mixed_verdict(mix: [f64; 4]) -> impl Fn(&Boundary) -> CheckpointKind + Send + Sync + 'static {
    move |b: &Boundary| {
        let mut x: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in b.sandbox.bytes().chain(b.turn.to_le_bytes()) {
            x = (x ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
        let total: f64 = mix.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let mut r = (x >> 11) as f64 / (1u64 << 53) as f64 * total;
        for (k, w) in CheckpointKind::ALL.into_iter().zip(mix) {
            if r < w {
                return k;
            }
            r -= w;
        }
        CheckpointKind::Full
    }
}

/// Many agents against the real engine (with a sleeping executor) and the real proxy (with
/// a stub upstream delaying each answer by a trace latency): how long are responses held?
pub async fn bench_turns(opts: TurnBenchOptions) -> Result<TurnBenchReport, BenchError> {
    let stub = StubUpstream::start(StubConfig { stream_events: 20, ..Default::default() })
        .await
        .map_err(|e| BenchError::Setup(format!("starting the stub upstream: {e}")))?;
    let tmp = tempfile::Builder::new()
        .prefix("crab-bench-turns")
        .tempdir()
        .map_err(|e| BenchError::Setup(format!("creating a temporary directory: {e}")))?;
    let names: Vec<String> = (0..opts.sandboxes).map(|i| format!("sb{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let dir = MemoryDirectory::new(tmp.path(), &refs);
    let engine = crab_engine::Engine::new(
        opts.engine.clone(),
        std::sync::Arc::new(SleepExecutor(opts.job_costs.clone())),
    )
    .map_err(|e| BenchError::Setup(e.to_string()))?;
    let hooks = EngineHooks::new(engine.clone(), mixed_verdict(opts.verdict_mix));
    let cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().map_err(|_| BenchError::Setup("address".into()))?,
        upstream_openai: stub.url(),
        upstream_anthropic: stub.url(),
        fsync_log: opts.fsync_log,
        ..Default::default()
    };
    let coord = Coordinator::new(cfg, dir, hooks)?;
    let server = coord.bind().await?;
    let base = format!("http://{}", server.local_addr());
    let lat =
        if opts.llm_latency_ms.is_empty() { vec![4600.0] } else { opts.llm_latency_ms.clone() };
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let url = format!("{base}/s/{name}/v1/chat/completions");
        let lat = lat.clone();
        let o = opts.clone();
        tasks.push(tokio::spawn(async move {
            let mut overhead = Vec::new();
            for t in 0..o.turns {
                let model_ms = lat[(i * 7919 + t) % lat.len()] * o.time_scale;
                let stream = o.streams && (i + t) % 2 == 1;
                let body = format!(
                    "{{\"model\":\"stub\",\"stream\":{stream},\"messages\":[{{\"role\":\"user\",\"content\":\"sb {i} turn {t}\"}}]}}"
                );
                let req = Request::builder()
                    .method(Method::POST)
                    .uri(&url)
                    .header("content-type", "application/json")
                    .header(crab_testkit::upstream::DELAY_HEADER, format!("{}", model_ms.round() as u64))
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| BenchError::Request { target: "proxy", message: e.to_string() })?;
                let start = Instant::now();
                let resp = client
                    .request(req)
                    .await
                    .map_err(|e| BenchError::Request { target: "proxy", message: e.to_string() })?;
                let _ = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| BenchError::Request { target: "proxy", message: e.to_string() })?;
                overhead.push(start.elapsed().as_secs_f64() * 1e3 - model_ms.round());
                let exec = Duration::from_secs_f64(o.exec_ms * o.time_scale / 1e3);
                tokio::time::sleep(exec).await;
            }
            Ok::<_, BenchError>(overhead)
        }));
    }
    let mut overhead = Vec::new();
    for t in tasks {
        overhead.extend(t.await.map_err(|e| BenchError::Setup(e.to_string()))??);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    server.shutdown().await;
    let held = coord.held_samples_ms();
    let exposed = LatencySummary::of(&held);
    let stats = engine.stats();
    let mut verdicts = [0u64; 4];
    let mut coalesced = 0;
    for s in &stats.sandboxes {
        for (i, k) in CheckpointKind::ALL.iter().enumerate() {
            verdicts[i] += s.stats.submitted.get(k.as_str()).copied().unwrap_or(0);
        }
        coalesced += s.stats.coalesced;
    }
    Ok(TurnBenchReport {
        sandboxes: opts.sandboxes,
        turns: opts.turns,
        latency_samples: lat.len(),
        time_scale: opts.time_scale,
        wall_s,
        held_fraction: held.iter().filter(|h| **h > 0.0).count() as f64 / held.len().max(1) as f64,
        p95_within_budget: exposed.p95 <= 20.0,
        median_zero: exposed.p50 == 0.0,
        exposed,
        agent_overhead: LatencySummary::of(&overhead),
        verdicts,
        coalesced,
    })
}
