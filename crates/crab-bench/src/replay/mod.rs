//! The replay benchmark: real agent trajectories replayed in real sandboxes through the real
//! daemon, with faults injected, each recovery method side by side.
//!
//! For every trajectory it runs a fault-free reference (`none`), each method with `faults`
//! faults at seeded turns (the same turns for every method), each checkpointing method once more
//! without a fault (its overhead), and last a second fault-free reference that starts at least a
//! minute after the first, only to learn what legitimately differs between runs (see
//! [`compare`]). A run is: a fresh sandbox (plus the stand-in `/testbed` of [`testbed`] for
//! SWE-bench traces and the persistent shell for `shell_state` traces), then the replay agent
//! ([`agent`]) talking to the replay LLM ([`llm`]) turn by turn. At each turn boundary a
//! checkpointing method asks the daemon for a checkpoint (`POST
//! /v1/sandboxes/{name}/checkpoints`, kind `auto`/`full`/`fs`) *concurrently* with the LLM
//! request, and the agent runs the next command only when both are done — the gating Crab's
//! proxy does — so the time the checkpoint adds beyond the LLM's own time is the exposed
//! latency. A fault is kill -9 of every process of the sandbox (and with `fault_daemon` of the
//! daemon, which is then started again) right after a turn's command; recovery is per
//! [`methods::Recovery`]. At the end the sandbox's state is captured and compared with the
//! reference ([`compare`]). Runs go `sandboxes` at a time.
//!
//! With `proxy` set (`http://127.0.0.1:7431`), every method reaches the LLM through Crab's
//! proxy (`<proxy>/s/<sandbox>/v1`) — the transparent path of the design; the daemon must then
//! run with `--upstream-openai http://<llm_listen>`. Each run's sandbox is created with its
//! method's checkpoint policy ([`Method::checkpoint_policy`]: `crab` → `auto`, `full`, `fs`,
//! and `none` for `none`, `chat` and `restart`), so the proxy takes that checkpoint at each
//! request and gates the answer on it, and exposed latency and wall time compare like for like:
//! `none` through the proxy (the gate passes at once) is the baseline.

pub mod agent;
pub mod compare;
pub mod llm;
pub mod methods;
pub mod report;
pub mod rng;
pub mod sandbox;
pub mod testbed;
pub mod trace;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::Value;

use crab_client::Client;
use crab_common::paths::StateDir;
use crab_common::{ApiError, Progress};

use crate::stats::Summary;

pub use llm::LlmLatency;
pub use methods::Method;
pub use report::ReplayReport;

use compare::State;
use methods::Recovery;
use report::{Counts, MethodReport, TraceInfo, TrialReport};
use trace::{Family, Trajectory};

/// Least time between the starts of a trajectory's two reference runs.
const REFERENCE_GAP: std::time::Duration = std::time::Duration::from_secs(63);

/// Options of [`run`].
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Trajectory files or folders holding them.
    pub traces: Vec<PathBuf>,
    /// Methods to compare (`none` is always run: it is the reference).
    pub methods: Vec<Method>,
    /// Concurrent sandboxes.
    pub sandboxes: usize,
    /// At most this many trajectories (0 = all).
    pub limit: usize,
    /// Seed of fault turns and drawn latencies.
    pub seed: u64,
    /// LLM latency per turn.
    pub llm_latency: LlmLatency,
    /// Faults per trajectory (0 = none: every pass is fault-free).
    pub faults: usize,
    /// Also kill -9 the daemon at each fault (and start it again). Forces one sandbox at a time.
    pub fault_daemon: bool,
    /// Image of the sandboxes.
    pub image: String,
    /// Where the replay LLM listens.
    pub llm_listen: SocketAddr,
    /// Base URL of Crab's LLM proxy (`http://127.0.0.1:7431`); `None` = agents call the replay
    /// LLM directly.
    pub proxy: Option<String>,
    /// Build the stand-in `/testbed` for SWE-bench traces.
    pub testbed: bool,
    /// Cache of sdists and prepared trees.
    pub cache_dir: PathBuf,
    /// Timeout of one command, s.
    pub exec_timeout_s: f64,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            traces: vec![PathBuf::from("examples/traces")],
            methods: Method::ALL.to_vec(),
            sandboxes: 2,
            limit: 0,
            seed: 1,
            llm_latency: LlmLatency::Recorded,
            faults: 1,
            fault_daemon: false,
            image: "debian".into(),
            llm_listen: SocketAddr::from(([127, 0, 0, 1], 7439)),
            proxy: None,
            testbed: true,
            cache_dir: PathBuf::from(testbed::DEFAULT_CACHE),
            exec_timeout_s: 120.0,
        }
    }
}

/// Which pass of a trajectory a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Pass {
    Reference,
    Reference2,
    Fault,
    NoFault,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Reference => "reference",
            Pass::Reference2 => "reference-2",
            Pass::Fault => "fault",
            Pass::NoFault => "no-fault",
        }
    }
}

#[derive(Debug, Clone)]
struct Job {
    traj: usize,
    method: Method,
    pass: Pass,
    faults: BTreeSet<usize>,
}

#[derive(Debug, Default)]
struct RunResult {
    wall_ms: f64,
    exposed: Vec<f64>,
    /// Per turn through the proxy: where its exposed time went.
    breakdowns: Vec<crab_common::stats::Breakdown>,
    restore: Vec<f64>,
    counts: Counts,
    bytes: u64,
    kinds: Vec<String>,
    state: Option<State>,
    error: Option<String>,
}

#[derive(Debug)]
struct Ctx {
    client: Client,
    llm: llm::ReplayLlm,
    state_dir: StateDir,
    opts: ReplayOptions,
    trajs: Vec<Arc<Trajectory>>,
    scripts: Vec<Arc<llm::Script>>,
    testbeds: HashMap<usize, PathBuf>,
    serial: AtomicUsize,
    run_tag: String,
    /// When each trajectory's first reference started its first turn.
    ref_started: Mutex<HashMap<usize, std::time::SystemTime>>,
}

/// Run the replay benchmark.
pub async fn run(
    opts: &ReplayOptions,
    client: &Client,
    progress: &dyn Progress,
) -> Result<ReplayReport, ApiError> {
    let started = Instant::now();
    let mut opts = opts.clone();
    if opts.fault_daemon {
        opts.sandboxes = 1;
    }
    opts.sandboxes = opts.sandboxes.max(1);
    let mut methods = opts.methods.clone();
    methods.push(Method::None);
    methods.sort();
    methods.dedup();
    opts.methods = methods.clone();

    progress.stage("load trajectories", None);
    let trajs = trace::load_all(&opts.traces, opts.limit)?;
    if trajs.is_empty() {
        return Err(ApiError::invalid(
            format!("no trajectories found in {:?}", opts.traces),
            "pass trajectory files (*.jsonl) or folders holding them",
        ));
    }
    let pool = llm::latency_pool(&trajs);
    let scripts: Vec<Arc<llm::Script>> = trajs
        .iter()
        .map(|t| Arc::new(llm::script(t, opts.llm_latency, &pool, opts.seed)))
        .collect();

    let version = sandbox::version(client).await?;
    let state_dir = StateDir::new(&version.state_dir);

    let (testbeds, testbed_names) = if opts.testbed {
        prepare_testbeds(&trajs, &opts.cache_dir, progress).await?
    } else {
        (HashMap::new(), HashMap::new())
    };

    let llm = llm::ReplayLlm::start(opts.llm_listen).await?;

    // The jobs, trajectory by trajectory so that a trajectory's runs share machine conditions.
    let mut jobs = VecDeque::new();
    for (i, t) in trajs.iter().enumerate() {
        let mut rng = rng::Rng::new(opts.seed, &format!("faults:{}", t.id));
        let n = t.steps.len();
        let mut faults = BTreeSet::new();
        while faults.len() < opts.faults.min(n) {
            faults.insert(rng.below(n));
        }
        jobs.push_back(Job {
            traj: i,
            method: Method::None,
            pass: Pass::Reference,
            faults: BTreeSet::new(),
        });
        for m in methods.iter().copied().filter(|m| *m != Method::None) {
            jobs.push_back(Job { traj: i, method: m, pass: Pass::Fault, faults: faults.clone() });
            if m.checkpoint_kind().is_some() && !faults.is_empty() {
                jobs.push_back(Job {
                    traj: i,
                    method: m,
                    pass: Pass::NoFault,
                    faults: BTreeSet::new(),
                });
            }
        }
    }
    // The second references go last, and each starts its first turn at least a minute after the
    // first reference's: wall-clock output (`ls -la` times, `date`) then differs between the two
    // and is learned as noise, instead of depending on whether a trial crossed a minute. Each
    // also starts with its sandbox's pid counter moved on ([`PID_SHIFT`]): a pid a command prints
    // (`echo $!`) then differs between the two as it does after any recovery.
    for i in 0..trajs.len() {
        jobs.push_back(Job {
            traj: i,
            method: Method::None,
            pass: Pass::Reference2,
            faults: BTreeSet::new(),
        });
    }
    let total = jobs.len();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        llm,
        state_dir,
        opts: opts.clone(),
        trajs: trajs.into_iter().map(Arc::new).collect(),
        scripts,
        testbeds,
        serial: AtomicUsize::new(0),
        ref_started: Mutex::default(),
        run_tag: format!("{:x}", std::process::id() ^ (started.elapsed().subsec_nanos())),
    });

    progress.stage("replay", Some(total as u64));
    let queue = Arc::new(Mutex::new(jobs));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Job, RunResult)>();
    let mut workers = Vec::new();
    for _ in 0..opts.sandboxes.min(total) {
        let (ctx, queue, tx) = (ctx.clone(), queue.clone(), tx.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let job = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some(job) = job else { break };
                let r = run_one(&ctx, &job).await;
                if tx.send((job, r)).is_err() {
                    break;
                }
            }
        }));
    }
    drop(tx);
    let mut results: BTreeMap<(usize, Method, Pass), RunResult> = BTreeMap::new();
    let mut done = 0u64;
    while let Some((job, r)) = rx.recv().await {
        done += 1;
        let t = &ctx.trajs[job.traj];
        progress.message(&format!(
            "{} {} {}: {:.1} s{}",
            t.id,
            job.method,
            job.pass.name(),
            r.wall_ms / 1e3,
            r.error.as_deref().map(|e| format!(" — error: {e}")).unwrap_or_default()
        ));
        progress.advance(done);
        results.insert((job.traj, job.method, job.pass), r);
    }
    for w in workers {
        let _ = w.await;
    }
    Ok(aggregate(&ctx, &methods, &results, &testbed_names, started))
}

/// The stand-in `/testbed` tarballs of the SWE-bench trajectories among `trajs` (index →
/// tarball, index → `pkg==version`), prepared from PyPI sdists into `cache_dir`; a project
/// that cannot be prepared gets none (its commands then fail alike in every run).
pub(crate) async fn prepare_testbeds(
    trajs: &[Trajectory],
    cache_dir: &std::path::Path,
    progress: &dyn Progress,
) -> Result<(HashMap<usize, PathBuf>, HashMap<usize, String>), ApiError> {
    let mut testbeds = HashMap::new();
    let mut testbed_names = HashMap::new();
    let wanted: Vec<(usize, &str, &str)> = trajs
        .iter()
        .enumerate()
        .filter(|(_, t)| t.family == Family::MiniSweAgent)
        .filter_map(|(i, t)| testbed::project_for(&t.id).map(|(p, v)| (i, p, v)))
        .collect();
    progress.stage("stand-in /testbed", Some(wanted.len() as u64));
    let mut done_proj: HashMap<(&str, &str), PathBuf> = HashMap::new();
    let mut failed: BTreeSet<(&str, &str)> = BTreeSet::new();
    for (n, (i, p, v)) in wanted.iter().enumerate() {
        #[allow(clippy::map_entry)] // the insert is after an await
        if !done_proj.contains_key(&(*p, *v)) && !failed.contains(&(*p, *v)) {
            progress.message(&format!("preparing /testbed: {p}=={v}"));
            let cache = cache_dir.to_path_buf();
            let (pp, vv) = (p.to_string(), v.to_string());
            let tar = tokio::task::spawn_blocking(move || testbed::prepared(&cache, &pp, &vv))
                .await
                .map_err(|e| ApiError::internal(format!("preparing /testbed: {e}")))?;
            match tar {
                Ok(tar) => {
                    done_proj.insert((*p, *v), tar);
                }
                // Optional: without it the commands fail the same way in every run.
                Err(e) => {
                    failed.insert((*p, *v));
                    progress.message(&format!(
                        "no stand-in /testbed for {p}=={v} (an empty one instead): {}",
                        e.message
                    ));
                }
            }
        }
        if let Some(tar) = done_proj.get(&(*p, *v)) {
            testbeds.insert(*i, tar.clone());
            testbed_names.insert(*i, format!("{p}=={v}"));
        }
        progress.advance(n as u64 + 1);
    }
    Ok((testbeds, testbed_names))
}

fn aggregate(
    ctx: &Ctx,
    methods: &[Method],
    results: &BTreeMap<(usize, Method, Pass), RunResult>,
    testbed_names: &HashMap<usize, String>,
    started: Instant,
) -> ReplayReport {
    let mut trials = Vec::new();
    let mut traces = Vec::new();
    let mut noises = HashMap::new();
    for (i, t) in ctx.trajs.iter().enumerate() {
        let a = results.get(&(i, Method::None, Pass::Reference));
        let b = results.get(&(i, Method::None, Pass::Reference2));
        let noise = match (a.and_then(|r| r.state.as_ref()), b.and_then(|r| r.state.as_ref())) {
            (Some(a), Some(b)) => Some(compare::learn(a, b)),
            _ => None,
        };
        traces.push(TraceInfo {
            id: t.id.clone(),
            family: t.family,
            turns: t.steps.len(),
            shell_state: t.shell_state,
            source: t.source.clone(),
            testbed: testbed_names.get(&i).cloned(),
            noisy_paths: noise.as_ref().map(|n| n.paths.len()).unwrap_or(0),
            noisy_messages: noise.as_ref().map(|n| n.messages.len()).unwrap_or(0),
            noise: noise.clone(),
        });
        noises.insert(i, noise);
    }
    let mut rows = Vec::new();
    for &m in methods {
        let (mut n, mut correct, mut errors) = (0usize, 0usize, 0usize);
        let (mut wall_ratios, mut ovh_ratios) = (Vec::new(), Vec::new());
        let (mut exposed, mut restore) = (Vec::new(), Vec::new());
        let mut breakdowns = Vec::new();
        let mut counts = Counts::default();
        let mut bytes = 0u64;
        for (i, t) in ctx.trajs.iter().enumerate() {
            let reference = results.get(&(i, Method::None, Pass::Reference));
            let ref_state = reference.and_then(|r| r.state.as_ref());
            let ref_wall = reference.map(|r| r.wall_ms).unwrap_or(f64::NAN);
            let noise = noises.get(&i).and_then(|n| n.as_ref());
            let trial_pass = if m == Method::None { Pass::Reference2 } else { Pass::Fault };
            for pass in [Pass::Reference, Pass::Reference2, Pass::Fault, Pass::NoFault] {
                let Some(r) = results.get(&(i, m, pass)) else { continue };
                exposed.extend(&r.exposed);
                breakdowns.extend(r.breakdowns.iter().cloned());
                let is_trial = pass == trial_pass;
                let (is_correct, diff) = if is_trial {
                    match (ref_state, r.state.as_ref(), noise) {
                        (Some(a), Some(s), Some(noise)) => {
                            let d = compare::compare(a, s, noise);
                            (Some(d.is_equal()), Some(d))
                        }
                        _ => (Some(false), None),
                    }
                } else {
                    (None, None)
                };
                if is_trial {
                    n += 1;
                    if is_correct == Some(true) {
                        correct += 1;
                    }
                    if r.error.is_some() {
                        errors += 1;
                    }
                    counts.merge(&r.counts);
                    bytes += r.bytes;
                    restore.extend(&r.restore);
                    if m != Method::None {
                        wall_ratios.push(r.wall_ms / ref_wall);
                    }
                }
                if pass == Pass::NoFault
                    || (pass == Pass::Fault && r.restore.is_empty() && ctx.opts.faults == 0)
                {
                    ovh_ratios.push(r.wall_ms / ref_wall);
                }
                trials.push(TrialReport {
                    trajectory: t.id.clone(),
                    method: m,
                    pass: pass.name(),
                    fault_turns: if pass == Pass::Fault { fault_turns(ctx, i) } else { vec![] },
                    correct: is_correct,
                    wall_ms: r.wall_ms,
                    checkpoints: r.counts.clone(),
                    checkpoint_bytes: r.bytes,
                    checkpoint_kinds: r.kinds.clone(),
                    diff,
                    error: r.error.clone(),
                });
            }
        }
        let exposed_hist = crate::stats::Latencies::of(&exposed);
        let wall_ratio = if m == Method::None { 1.0 } else { crate::stats::median(&wall_ratios) };
        let ovh =
            if m.checkpoint_kind().is_none() { 1.0 } else { crate::stats::median(&ovh_ratios) };
        rows.push(MethodReport {
            method: m,
            trials: n,
            correct,
            correct_pct: if n == 0 { 0.0 } else { 100.0 * correct as f64 / n as f64 },
            wall_ratio_vs_none: wall_ratio,
            overhead_no_fault_ratio: ovh,
            checkpoints: counts,
            checkpoint_bytes: bytes,
            exposed_ms: exposed_hist.summary(),
            exposed_cdf: exposed_hist.cdf(),
            exposed_breakdown: crab_common::stats::stage_summaries(&breakdowns),
            restore_ms: Summary::of(&restore),
            errors,
        });
    }
    let mut sources: Vec<String> = ctx
        .trajs
        .iter()
        .map(|t| match &t.source.commit {
            Some(c) => format!("{}@{}", t.source.repo, c),
            None => t.source.repo.clone(),
        })
        .collect();
    sources.sort();
    sources.dedup();
    ReplayReport {
        trace_sources: sources,
        traces,
        llm_latency: ctx.opts.llm_latency,
        seed: ctx.opts.seed,
        faults: ctx.opts.faults,
        fault_daemon: ctx.opts.fault_daemon,
        sandboxes: ctx.opts.sandboxes,
        via_proxy: ctx.opts.proxy.is_some(),
        methods: rows,
        trials,
        llm_wait_ms: Summary::of(
            &ctx.scripts
                .iter()
                .flat_map(|s| s.latency.iter().map(|d| d.as_secs_f64() * 1e3))
                .collect::<Vec<_>>(),
        ),
        wall_s: started.elapsed().as_secs_f64(),
    }
}

/// A turn's proxy breakdown completed with `unattributed`: the part of the `exposed` time the
/// proxy's stages do not cover (HTTP and scheduling overhead; 0 when they cover it all).
pub fn with_unattributed(b: &[(String, f64)], exposed: f64) -> crab_common::stats::Breakdown {
    let mut b = b.to_vec();
    let covered: f64 = b.iter().map(|(_, ms)| ms).sum();
    b.push(("unattributed".into(), (exposed - covered).max(0.0)));
    b
}

fn fault_turns(ctx: &Ctx, traj: usize) -> Vec<usize> {
    let t = &ctx.trajs[traj];
    let mut rng = rng::Rng::new(ctx.opts.seed, &format!("faults:{}", t.id));
    let n = t.steps.len();
    let mut faults = BTreeSet::new();
    while faults.len() < ctx.opts.faults.min(n) {
        faults.insert(rng.below(n));
    }
    faults.into_iter().collect()
}

/// Processes the second reference's sandbox forks (and reaps) before its trajectory starts, so
/// its pids differ from the first reference's (a fresh pid namespace allocates them in order).
const PID_SHIFT: usize = 37;

/// Create the sandbox and its environment for a trajectory: `/testbed`, the working directory,
/// the persistent shell. Through the proxy, the sandbox gets `method`'s checkpoint policy;
/// `shift_pids` (the second reference) moves its pid counter on first.
async fn setup(
    ctx: &Ctx,
    traj: usize,
    name: &str,
    method: Method,
    shift_pids: bool,
) -> Result<(), ApiError> {
    let t = &ctx.trajs[traj];
    let policy = ctx.opts.proxy.as_ref().map(|_| method.checkpoint_policy());
    sandbox::create_with_policy(&ctx.client, &ctx.opts.image, name, policy).await?;
    if shift_pids {
        let burn = format!("i=0; while [ $i -lt {PID_SHIFT} ]; do /bin/true; i=$((i+1)); done");
        sandbox::sh_ok(&ctx.client, name, &burn, 30.0).await?;
    }
    if let Some(tar) = ctx.testbeds.get(&traj) {
        let (tar, root) = (tar.clone(), ctx.state_dir.sandbox_rootfs(name));
        tokio::task::spawn_blocking(move || testbed::install(&tar, &root))
            .await
            .map_err(|e| ApiError::internal(format!("installing /testbed: {e}")))??;
    }
    let wd = t.family.workdir();
    sandbox::sh_ok(&ctx.client, name, &format!("mkdir -p '{wd}'"), 30.0).await?;
    if t.shell_state {
        agent::start_session(&ctx.client, name, wd).await?;
    }
    Ok(())
}

/// A checkpoint of `kind`. A sandbox's first restore point must be a base: when the daemon
/// refuses an `auto` checkpoint that came out as a skip with nothing to skip from, take a full
/// one (what the daemon itself should do; then this never triggers).
pub(crate) async fn take_checkpoint(
    client: &Client,
    name: &str,
    kind: &str,
    turn: usize,
    offset: usize,
) -> Result<sandbox::PointSummary, ApiError> {
    match sandbox::checkpoint(client, name, kind, turn, offset).await {
        Err(e) if kind == "auto" && e.message.contains("needs an earlier restore point") => {
            sandbox::checkpoint(client, name, "full", turn, offset).await
        }
        r => r,
    }
}

async fn run_one(ctx: &Ctx, job: &Job) -> RunResult {
    let serial = ctx.serial.fetch_add(1, Ordering::Relaxed);
    // The name is the sandbox's hostname, which commands print (`hostname`, a prompt): it must
    // not say which method ran, or every run would differ from the references by that word.
    // The serial differs from run to run like a pid, and is learned as such.
    let name = format!("rp-{}-{serial}", ctx.run_tag);
    tracing::debug!(sandbox = %name, method = job.method.name(), pass = job.pass.name(), "replay run");
    let script = ctx.scripts[job.traj].clone();
    ctx.llm.register(&name, script);
    let mut r = RunResult::default();
    let res = replay(ctx, job, &name, &mut r).await;
    if let Err(e) = res {
        r.error = Some(format!("{} ({})", e.message, e.code.as_str()));
    }
    ctx.llm.unregister(&name);
    agent::end_session(&name).await;
    let _ = sandbox::remove(&ctx.client, &name).await;
    r
}

/// Wait until the first reference of `traj` started at least [`REFERENCE_GAP`] ago.
async fn wait_for_reference_gap(ctx: &Ctx, traj: usize) {
    loop {
        let first = ctx.ref_started.lock().ok().and_then(|m| m.get(&traj).copied());
        let wait = match first {
            Some(t) => REFERENCE_GAP.saturating_sub(t.elapsed().unwrap_or_default()),
            // The first reference has not been picked up yet (more workers than jobs ahead).
            None => std::time::Duration::from_millis(200),
        };
        if wait.is_zero() {
            break;
        }
        tokio::time::sleep(wait).await;
    }
}

async fn replay(ctx: &Ctx, job: &Job, name: &str, r: &mut RunResult) -> Result<(), ApiError> {
    let t = &ctx.trajs[job.traj];
    let client = &ctx.client;
    let wd = t.family.workdir();
    // Through the proxy, every method's sandbox has its checkpoint policy and the proxy takes
    // that checkpoint at each request (and gates the answer on it; `none` passes at once);
    // without one, methods call the LLM directly and checkpoint explicitly beside the request.
    let via_proxy = ctx.opts.proxy.is_some();
    let checkpoints = job.method.checkpoint_kind().is_some();
    let url = match &ctx.opts.proxy {
        Some(p) if via_proxy => {
            format!("{}/s/{name}/v1/chat/completions", p.trim_end_matches('/'))
        }
        _ => format!("{}/chat/completions", ctx.llm.base_url()),
    };
    // Files changed since (a margin before) this moment are never taken from the hash cache.
    let fresh_after = i64::try_from(crab_common::clock::now_s()).unwrap_or(i64::MAX) - 2;
    if job.pass == Pass::Reference {
        if let Ok(mut m) = ctx.ref_started.lock() {
            m.insert(job.traj, std::time::SystemTime::now());
        }
    }
    setup(ctx, job.traj, name, job.method, job.pass == Pass::Reference2).await?;
    if job.pass == Pass::Reference2 {
        wait_for_reference_gap(ctx, job.traj).await;
    }
    let t0 = Instant::now();
    let mut conv: Vec<Value> = agent::initial_conversation(&t.id, wd);
    let mut points: Vec<usize> = Vec::new();
    let mut pending = job.faults.clone();
    let n = t.steps.len();
    loop {
        let turn = agent::turns_in(&conv);
        if turn >= n {
            break;
        }
        let tb = Instant::now();
        // The session's shell is the sandbox's harness: a turn that changed its state (a
        // `cd`, an `export`, a job) asks for a dump itself — `full` instead of `auto` through
        // the API, or, through the proxy where the daemon decides, by saying so first.
        let auto = job.method.checkpoint_kind() == Some("auto");
        let changed = auto && t.shell_state && agent::take_state_changed(name).await;
        let kind = match job.method.checkpoint_kind() {
            _ if via_proxy => None,
            Some("auto") if changed => Some("full"),
            k => k,
        };
        if via_proxy && changed {
            sandbox::harness_changed(client, name).await?;
        }
        let (answer, point) = tokio::join!(agent::ask(&url, name, &conv), async {
            match kind {
                Some(k) => Some(take_checkpoint(client, name, k, turn, conv.len()).await),
                None => None,
            }
        });
        let waited = tb.elapsed().as_secs_f64() * 1e3;
        let answer = answer?;
        if let Some(point) = point {
            let point = point?;
            r.counts.add(&point.kind);
            r.kinds.push(format!("{}:{}", point.kind, point.size_bytes));
            points.push(conv.len());
        } else if via_proxy && checkpoints {
            points.push(conv.len());
        }
        let exposed = (waited - answer.llm_ms).max(0.0);
        r.exposed.push(exposed);
        if let Some(b) = &answer.held {
            r.breakdowns.push(with_unattributed(b, exposed));
        }
        let Some(command) = answer.command.clone() else {
            return Err(ApiError::internal(format!(
                "the LLM answered turn {turn} without a tool call"
            )));
        };
        conv.push(answer.message.clone());
        let obs =
            agent::execute(client, name, &command, wd, t.shell_state, ctx.opts.exec_timeout_s)
                .await?;
        conv.push(agent::tool_message(&answer.call_id, &obs));
        if pending.remove(&turn) {
            sandbox::kill_all(name).await?;
            if ctx.opts.fault_daemon {
                sandbox::kill_and_restart_daemon(client).await?;
            }
            let tr = Instant::now();
            match job.method.recovery() {
                Recovery::Nothing => {}
                Recovery::RestoreNewest => {
                    sandbox::restore(client, name).await?;
                    let len = points.last().copied().ok_or_else(|| {
                        ApiError::internal("a fault before any checkpoint: nothing to restore")
                    })?;
                    conv.truncate(len);
                }
                Recovery::Recreate => {
                    sandbox::remove(client, name).await?;
                    setup(ctx, job.traj, name, job.method, false).await?;
                }
                Recovery::StartOver => {
                    sandbox::remove(client, name).await?;
                    setup(ctx, job.traj, name, job.method, false).await?;
                    conv = agent::initial_conversation(&t.id, wd);
                    points.clear();
                }
            }
            r.restore.push(tr.elapsed().as_secs_f64() * 1e3);
        }
    }
    r.wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    if via_proxy && checkpoints {
        for p in sandbox::list_checkpoints(client, name).await? {
            r.counts.add(&p.kind);
            r.kinds.push(format!("{}:{}", p.kind, p.size_bytes));
        }
    }
    if checkpoints {
        r.bytes = sandbox::store_traffic(&ctx.state_dir.checkpoints(name))?;
    }
    r.state =
        Some(compare::capture(name, &ctx.state_dir.sandbox_rootfs(name), fresh_after, conv).await?);
    Ok(())
}
