//! `crab bench density --memory` (issue 31): the memory a host spends on sandboxes whose agents
//! are waiting, with and without parking, side by side in one run on one daemon of the bench's
//! own (`--memory-budget 1`: always over budget, so the policy alone decides; a stub LLM
//! upstream answering after each turn's recorded latency):
//!
//! * **none**: sandboxes labelled `crab.park=never` (Crab's per-turn checkpoints, no parking);
//! * **timer**: the same, and the bench parks a sandbox idle for `--idle-s` (10 s: E2B-style
//!   auto-pause), woken by its next call (the daemon's wake-on-access);
//! * **turn**: parkable sandboxes: the engine parks at the turn boundary and the LLM answer
//!   waits for the wake.
//!
//! Each of `--sandboxes` sandboxes holds a resident process (an idle Python holding
//! `--resident-mb` of touched memory, as a REPL the agent set up earlier) and replays one real
//! trajectory's LLM latencies (× `--llm-scale`), a turn being: an LLM request through the
//! proxy, then a command checking the resident process. Measured per mode: memory of the mode's
//! sandboxes sampled every 100 ms (mean and peak over the run; and per sandbox whose agent is
//! still replaying — a sandbox whose agent is done is what a harness removes, and the run lasts
//! as long as its longest trajectory — → sandboxes per GiB), the agent-visible
//! overhead per turn (answer time beyond the upstream's delay, plus the command's time:
//! p50/p95/p99), wall time, correctness (each turn's command finds the resident process alive
//! with at least 90 % of its memory: it survived every park and wake), and the bytes of the
//! mode's restore points. Of the turn mode, also the least memory a wake started at the
//! answer's head allows ([`HeadBound`]: running only while answers are generated and commands
//! run), against which the policy's own losses show.
//!
//! A turn's recorded latency splits into the time to the head and the generation of the
//! step's output (its thought and action, four characters a token, at `--stream-tps`, leaving
//! the head at least 300 ms). With `--stream` the agents ask for SSE streams, spread over the
//! generation; without, for whole answers, which the stub gives after the head and the
//! generation — and which the bench's daemon, parking, asks of the stub as streams and
//! assembles (`--stream-whole-answers auto`). The overhead is measured at the answer's end
//! (what an agent acting on a whole answer sees) and, for streams, apart at its first byte.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crab_client::{Client, Method};
use crab_common::api::SandboxInfo;
use crab_common::paths::StateDir;
use crab_common::ApiError;
use crab_testkit::daemon::OtherDaemon;
use crab_testkit::upstream::{StubConfig, StubUpstream, DELAY_HEADER, STREAM_MS_HEADER};

use crate::replay::llm::post_json;
use crate::replay::sandbox::exec;
use crate::replay::trace::load_all;
use crate::stats::Summary;

/// What [`run`] measures.
#[derive(Debug, Clone)]
pub struct DensityMemoryOptions {
    /// Trajectories (their `llm_latency_s`).
    pub traces: Vec<PathBuf>,
    /// Sandboxes per mode.
    pub sandboxes: usize,
    /// Turns replayed per sandbox.
    pub turns: usize,
    /// LLM latency scales (1.0, 0.25).
    pub scales: Vec<f64>,
    /// Resident memory of each sandbox's process, MiB.
    pub resident_mb: u64,
    /// The timer baseline's idle time before a pause, s.
    pub idle_s: f64,
    /// Answers stream (else the agents ask for whole answers).
    pub stream: bool,
    /// Tokens per second the stub's answers are generated at, whole or streamed: an answer
    /// comes at its head plus its generation (the daemon streams whole answers from the
    /// stub, `--stream-whole-answers auto` with its memory budget, and assembles them).
    pub tps: f64,
    /// The bench daemon's `--stream-whole-answers` (`auto`: on, since it parks; `off`: whole
    /// answers are asked of the stub whole, the before of that change).
    pub stream_whole_answers: String,
    /// The image the sandboxes are made of (imported from the main daemon's state).
    pub image: String,
    /// The main daemon's state directory (where the image's tree is).
    pub main_state: PathBuf,
    /// Where to write each mode's raw samples and turn times and the bench daemon's log.
    pub raw: Option<PathBuf>,
}

/// One mode at one scale.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// `none`, `timer` or `turn`.
    pub mode: String,
    /// LLM latency scale.
    pub scale: f64,
    /// Sandboxes.
    pub sandboxes: usize,
    /// Turns replayed in all.
    pub turns: usize,
    /// Memory of the mode's sandboxes, mean over the run, MiB.
    pub mem_mean_mib: f64,
    /// Its peak, MiB.
    pub mem_peak_mib: f64,
    /// Sandboxes per GiB at the peak.
    pub per_gib_peak: f64,
    /// Sandboxes per GiB at the mean.
    pub per_gib_mean: f64,
    /// Memory per sandbox whose agent is still replaying its turns, MiB: the memory of those
    /// sandboxes summed over the samples, over their count summed likewise (a sandbox whose
    /// agent is done — a harness would remove it — is counted in neither).
    pub mem_per_agent_mib: f64,
    /// Sandboxes per GiB by that: 1024 / `mem_per_agent_mib`.
    pub per_gib_agents: f64,
    /// Agent-visible overhead per turn, ms.
    pub exposed_ms: Summary,
    /// Of streamed answers: the first byte's delay beyond the upstream's, ms.
    pub first_byte_ms: Option<Summary>,
    /// Wall time of the mode's run, s.
    pub wall_s: f64,
    /// Turns whose heartbeat check passed / all.
    pub correct: usize,
    /// Parks (engine or timer) and wakes the daemon counted during the mode.
    pub parks: u64,
    /// Wakes.
    pub wakes: u64,
    /// How the wakes were timed: `prewakes` (ahead of the answer, by the expected wait),
    /// `head_parks` (parks left to the streamed answer's head), `answer_wakes` (answers held
    /// until their sandbox woke).
    pub wakes_by: BTreeMap<String, u64>,
    /// Where the memory of the sandboxes whose agents replay went, by what the agent was
    /// doing: `first_wait` (its first LLM wait), `wait` (the later ones), `command`.
    pub resident: BTreeMap<String, PhaseMemory>,
    /// Turn boundaries the daemon's policy left a parkable sandbox running at, by why.
    pub declined: BTreeMap<String, u64>,
    /// Bytes of the mode's restore points.
    pub point_bytes: u64,
    /// The turns with the most overhead, worst first (up to 6).
    pub worst: Vec<WorstTurn>,
    /// Of Crab's parking (`turn`): the least its sandboxes can hold with a wake that starts at
    /// the answer's head, as the issue asks — see [`HeadBound`].
    pub head_bound: Option<HeadBound>,
}

/// The least memory turn-boundary parking can get down to when a parked sandbox's wake starts
/// at its answer's head (the first byte; the answer is released once the sandbox is back, so
/// it runs while the answer is generated): each sandbox running through every answer's
/// generation after its head, its commands and the bench's bookkeeping between turns — parked
/// for all the rest of every wait, its dumps and wakes free and instant. What a run measures
/// above it is the first turn's dumps (the sandbox runs until its first point is written),
/// wakes started ahead of the answer, and the parks and wakes themselves.
#[derive(Debug, Clone, Serialize)]
pub struct HeadBound {
    /// The share of the agents' time their sandboxes must run.
    pub running_share: f64,
    /// That share of a running sandbox's memory (the mode's mean during commands), MiB.
    pub mib_per_agent: f64,
}

/// [`HeadBound`] of a mode's turns (`spans`: per sandbox, per turn, [asked, answered, command
/// done] ms; `gen_ms`: per sandbox, per turn, its answer's generation after the head) whose
/// running sandboxes held `running_mib`.
fn head_bound(spans: &[Vec<[f64; 3]>], gen_ms: &[Vec<f64>], running_mib: f64) -> HeadBound {
    let (mut must, mut all) = (0.0, 0.0);
    for (turns, gens) in spans.iter().zip(gen_ms) {
        let (Some(first), Some(last)) = (turns.first(), turns.last()) else { continue };
        all += last[2] - first[0];
        for (t, s) in turns.iter().enumerate() {
            let wait = s[1] - s[0];
            must += gens.get(t).copied().unwrap_or(wait).min(wait);
            must += s[2] - s[1];
            if t > 0 {
                must += s[0] - turns[t - 1][2];
            }
        }
    }
    let running_share = if all > 0.0 { must / all } else { 0.0 };
    HeadBound { running_share, mib_per_agent: running_share * running_mib }
}

/// The memory of the sandboxes while their agents were in one phase of their turns.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseMemory {
    /// Mean memory of a sandbox in it, MiB.
    pub mean_mib: f64,
    /// Its share of the agents' sampled time.
    pub time_share: f64,
    /// Its share of the memory-time the agents' sandboxes held (MiB·s), of all phases.
    pub mem_share: f64,
}

/// One memory sample: its time (ms from the mode's epoch) and every sandbox's memory then.
type Sample = (f64, HashMap<String, u64>);

/// Classify each sample of each sandbox by what its agent was doing then (`spans`: per
/// sandbox, per turn, [asked, answered, command done] in ms from the samples' epoch); the
/// time between a command's end and the next ask (the bench's own bookkeeping) is `other`.
fn where_memory_went(
    names: &[String],
    spans: &[Vec<[f64; 3]>],
    series: &[Sample],
) -> BTreeMap<String, PhaseMemory> {
    let mut acc: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    for (i, n) in names.iter().enumerate() {
        let Some(turns) = spans.get(i) else { continue };
        let (Some(first), Some(last)) = (turns.first(), turns.last()) else { continue };
        for (at, m) in series {
            if *at < first[0] || *at >= last[2] {
                continue;
            }
            let phase = turns
                .iter()
                .enumerate()
                .find_map(|(t, s)| {
                    if *at >= s[0] && *at < s[1] {
                        Some(if t == 0 { "first_wait" } else { "wait" })
                    } else if *at >= s[1] && *at < s[2] {
                        Some("command")
                    } else {
                        None
                    }
                })
                .unwrap_or("other");
            let e = acc.entry(phase.to_string()).or_default();
            e.0 += m.get(n).copied().unwrap_or(0) as f64;
            e.1 += 1;
        }
    }
    let (all_bytes, all_n) = acc.values().fold((0.0, 0), |(b, n), (x, c)| (b + x, n + c));
    acc.into_iter()
        .map(|(k, (b, c))| {
            let pm = PhaseMemory {
                mean_mib: b / c.max(1) as f64 / 1048576.0,
                time_share: c as f64 / all_n.max(1) as f64,
                mem_share: if all_bytes > 0.0 { b / all_bytes } else { 0.0 },
            };
            (k, pm)
        })
        .collect()
}

/// One turn's overhead, and where it went.
#[derive(Debug, Clone, Serialize)]
pub struct WorstTurn {
    /// Which sandbox (its index in the mode).
    pub sandbox: usize,
    /// Which of its turns, from 0.
    pub turn: usize,
    /// Its overhead, ms: the answer beyond the upstream's time, plus the command.
    pub exposed_ms: f64,
    /// The answer beyond the upstream's time, ms.
    pub answer_ms: f64,
    /// The command's time, ms.
    pub command_ms: f64,
    /// The answer's generation after its head, ms.
    pub gen_ms: u64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct DensityMemoryReport {
    /// Every mode at every scale.
    pub modes: Vec<ModeReport>,
    /// Load average before and after.
    pub load: (String, String),
    /// Answers streamed at this many tokens per second (`None`: whole answers).
    pub stream_tps: Option<f64>,
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Run it.
pub async fn run(opts: &DensityMemoryOptions) -> Result<DensityMemoryReport, ApiError> {
    let trajs = load_all(&opts.traces, 0).map_err(|e| ApiError::invalid(e.to_string(), ""))?;
    // Per turn: (recorded latency, its generation when answers stream), s.
    let lat: Vec<Vec<(f64, f64)>> = trajs
        .iter()
        .map(|t| {
            t.steps
                .iter()
                .filter_map(|s| {
                    let l = s.llm_latency_s?;
                    let chars = s.thought_chars.unwrap_or(0) + s.action.len() as u64;
                    let gen = if opts.tps > 0.0 {
                        (chars as f64 / 4.0 / opts.tps).min(l - 0.3).max(0.0)
                    } else {
                        0.0
                    };
                    Some((l, gen))
                })
                .collect::<Vec<_>>()
        })
        .filter(|v: &Vec<(f64, f64)>| v.len() >= opts.turns)
        .take(opts.sandboxes)
        .collect();
    if lat.len() < opts.sandboxes {
        return Err(ApiError::invalid(
            format!(
                "only {} trajectories with {} LLM latencies under {:?}",
                lat.len(),
                opts.turns,
                opts.traces
            ),
            "name the mini-swe-agent traces (they carry llm_latency_s), or ask for fewer turns",
        ));
    }
    let stub = StubUpstream::start(StubConfig::default())
        .await
        .map_err(|e| ApiError::internal(format!("starting the stub upstream: {e}")))?;
    let dir = PathBuf::from("/var/lib").join(format!("crab-bench-park-{}", std::process::id()));
    let up = stub.url();
    let whole = opts.stream_whole_answers.clone();
    let d = tokio::task::spawn_blocking(move || {
        OtherDaemon::start(
            &dir,
            &[
                "--pool-size",
                "16G",
                "--memory-budget",
                "1",
                "--upstream-openai",
                &up,
                "--stream-whole-answers",
                &whole,
            ],
            &[],
        )
    })
    .await
    .map_err(|e| ApiError::internal(format!("starting the bench's daemon: {e}")))?;
    let img = StateDir::new(&opts.main_state).image_rootfs(&opts.image);
    d.crab_ok(&["image", "import", &opts.image, &img.to_string_lossy()]);
    let client = Client::new(StateDir::new(&d.state).socket());
    let before = load_avg();
    let mut modes = Vec::new();
    for &scale in &opts.scales {
        for mode in ["none", "timer", "turn"] {
            modes.push(one_mode(&d, &client, opts, &lat, mode, scale).await?);
        }
    }
    drop(stub);
    if let Some(dir) = &opts.raw {
        let (from, to) = (d.state.join("logs/daemon.log"), dir.join("daemon.log"));
        std::fs::copy(&from, &to).map_err(|e| {
            ApiError::internal(format!("copying {} to {}: {e}", from.display(), to.display()))
        })?;
    }
    Ok(DensityMemoryReport {
        modes,
        load: (before, load_avg()),
        stream_tps: opts.stream.then_some(opts.tps),
    })
}

async fn one_mode(
    d: &OtherDaemon,
    client: &Client,
    opts: &DensityMemoryOptions,
    lat: &[Vec<(f64, f64)>],
    mode: &str,
    scale: f64,
) -> Result<ModeReport, ApiError> {
    let names: Vec<String> =
        (0..opts.sandboxes).map(|i| format!("dm-{mode}-{}-{i}", (scale * 100.0) as u32)).collect();
    // An idle REPL holding its data: it touches every page once, says its pid, then waits
    // (as a kernel the agent set up earlier and is not using this turn).
    let resident = format!(
        "nohup python3 -c 'import os, signal\nd = bytearray({mb} << 20)\nfor i in range(0, len(d), 4096): d[i] = 7\nopen(\"/tmp/pid\", \"w\").write(str(os.getpid()))\nwhile True: signal.pause()\n' >/dev/null 2>&1 &",
        mb = opts.resident_mb
    );
    // A turn's command: the REPL is alive and still holds its memory (VmRSS, kB).
    let check = "p=$(cat /tmp/pid) && kill -0 $p && awk '/VmRSS/{print $2}' /proc/$p/status";
    for n in &names {
        let mut args = vec!["sandbox", "create", &opts.image, "--name", n.as_str()];
        if mode != "turn" {
            args.push("--no-park");
        }
        d.crab_ok(&args);
        let o = exec(client, n, vec!["sh".into(), "-c".into(), resident.clone()], None, None, 30.0)
            .await?;
        if o.code != 0 {
            return Err(ApiError::internal(format!("starting the resident process in {n}")));
        }
    }
    // Resident: wait until each holds its memory.
    let want = opts.resident_mb << 20;
    let t0 = Instant::now();
    loop {
        let mem = memory(client, &names).await?;
        if names.iter().all(|n| mem.get(n).is_some_and(|&b| b >= want)) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(ApiError::internal("the resident processes did not fill their memory"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let top0 = parking_counts(client).await?;
    let stop = Arc::new(AtomicBool::new(false));
    // The sampler: each sample's time and every sandbox's memory then (their sum, and where
    // the memory went, come from it), and apart the memory and count of those whose agent
    // still replays its turns.
    let epoch = Instant::now();
    let series: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let agent_samples: Arc<Mutex<(u64, u64)>> = Arc::default();
    let active: Arc<Mutex<std::collections::HashSet<String>>> =
        Arc::new(Mutex::new(names.iter().cloned().collect()));
    let sampler = {
        let (c, names, stop, agent_samples, active, series) = (
            client.clone(),
            names.clone(),
            stop.clone(),
            agent_samples.clone(),
            active.clone(),
            series.clone(),
        );
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(m) = memory(&c, &names).await {
                    let at = epoch.elapsed().as_secs_f64() * 1e3;
                    let live = crab_common::sync::lock(&active).clone();
                    {
                        let mut a = crab_common::sync::lock(&agent_samples);
                        a.0 += m
                            .iter()
                            .filter(|(n, _)| live.contains(*n))
                            .map(|(_, b)| b)
                            .sum::<u64>();
                        a.1 += live.len() as u64;
                    }
                    crab_common::sync::lock(&series).push((at, m));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // The timer baseline's parker.
    let last_call: Arc<Mutex<HashMap<String, Instant>>> =
        Arc::new(Mutex::new(names.iter().map(|n| (n.clone(), Instant::now())).collect()));
    let timer = (mode == "timer").then(|| {
        let (c, stop, last, idle) =
            (client.clone(), stop.clone(), last_call.clone(), Duration::from_secs_f64(opts.idle_s));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let due: Vec<String> = crab_common::sync::lock(&last)
                    .iter()
                    .filter(|(_, t)| t.elapsed() >= idle)
                    .map(|(n, _)| n.clone())
                    .collect();
                for n in due {
                    let _: Result<serde_json::Value, _> = c
                        .call::<(), _>(Method::POST, &format!("/v1/sandboxes/{n}/park"), None)
                        .await;
                    crab_common::sync::lock(&last)
                        .insert(n, Instant::now() + Duration::from_secs(3600));
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let start = Instant::now();
    let mut agents = Vec::new();
    for (i, n) in names.iter().enumerate() {
        let (c, n, lats, port, last, active) =
            (client.clone(), n.clone(), lat[i].clone(), d.port, last_call.clone(), active.clone());
        let turns = opts.turns;
        let stream = opts.stream;
        let want_kb = opts.resident_mb * 1024 * 9 / 10;
        agents.push(tokio::spawn(async move {
            let mut exposed = Vec::new();
            let mut each = Vec::new();
            let mut first = Vec::new();
            let mut correct = 0usize;
            // Per turn: when it asked, was answered, and its command ended (ms from `epoch`).
            let mut spans = Vec::new();
            let since = |i: Instant| (i - epoch).as_secs_f64() * 1e3;
            for (t, (l, gen)) in lats.iter().take(turns).enumerate() {
                let delay_ms = (l * scale * 1e3).round() as u64;
                let gen_ms = (gen * scale * 1e3).round() as u64;
                let url = format!("http://127.0.0.1:{port}/s/{n}/v1/chat/completions");
                let body = serde_json::json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": format!("{n} turn {t}")}]});
                let (head, spread) = (delay_ms.saturating_sub(gen_ms).to_string(), gen_ms.to_string());
                let headers = [(DELAY_HEADER, head.as_str()), (STREAM_MS_HEADER, spread.as_str())];
                let t0 = Instant::now();
                let a = post_json(&url, &headers, &body).await?;
                let answered = t0.elapsed().as_secs_f64() * 1e3;
                if stream {
                    let head_ms = (a.head - t0).as_secs_f64() * 1e3;
                    first.push((head_ms - delay_ms.saturating_sub(gen_ms) as f64).max(0.0));
                }
                if a.status != 200 {
                    return Err(ApiError::internal(format!("{n} turn {t}: the proxy answered {}", a.status)));
                }
                let t1 = Instant::now();
                let o = exec(&c, &n, vec!["sh".into(), "-c".into(), check.into()], None, None, 60.0)
                    .await?;
                let cmd = t1.elapsed().as_secs_f64() * 1e3;
                spans.push([since(t0), since(t1), since(Instant::now())]);
                crab_common::sync::lock(&last).insert(n.clone(), Instant::now());
                let over = (answered - delay_ms as f64).max(0.0);
                exposed.push(over + cmd);
                each.push(WorstTurn {
                    sandbox: i,
                    turn: t,
                    exposed_ms: over + cmd,
                    answer_ms: over,
                    command_ms: cmd,
                    gen_ms,
                });
                let rss_kb: u64 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap_or(0);
                if o.code == 0 && rss_kb >= want_kb {
                    correct += 1;
                }
            }
            crab_common::sync::lock(&active).remove(&n);
            Ok::<_, ApiError>((exposed, each, first, correct, spans))
        }));
    }
    let mut exposed = Vec::new();
    let mut worst = Vec::new();
    let mut first = Vec::new();
    let mut correct = 0;
    let mut failed = None;
    let mut spans = Vec::new();
    for a in agents {
        match a.await {
            Ok(Ok((e, w, f, c, s))) => {
                spans.push(s);
                exposed.extend(e);
                worst.extend(w);
                first.extend(f);
                correct += c;
            }
            Ok(Err(e)) => failed = Some(e),
            Err(e) => failed = Some(ApiError::internal(format!("an agent task failed: {e}"))),
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    if let Some(t) = timer {
        let _ = t.await;
    }
    let top1 = parking_counts(client).await?;
    // The process images (the filesystem points are snapshots sharing the image's tree).
    let point_bytes =
        names.iter().map(|n| du(&d.state.join("pool/checkpoints").join(n).join("procs"))).sum();
    for n in &names {
        d.crab_ok(&["sandbox", "rm", "-f", n]);
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // The sampler has stopped: its series is the mode's own from here.
    let series = std::mem::take(&mut *crab_common::sync::lock(&series));
    let resident = where_memory_went(&names, &spans, &series);
    let head_bound = (mode == "turn").then(|| {
        let gens: Vec<Vec<f64>> =
            lat.iter().map(|v| v.iter().map(|(_, g)| g * scale * 1e3).collect()).collect();
        head_bound(&spans, &gens, resident.get("command").map_or(0.0, |p| p.mean_mib))
    });
    if let Some(dir) = &opts.raw {
        // Each turn's recorded LLM latency and generation next to the times it took here.
        let raw = serde_json::json!({
            "mode": mode,
            "scale": scale,
            "sandboxes": names,
            "latencies_s": lat,
            "spans_ms": spans,
            "samples": series,
        });
        let path = dir.join(format!("{mode}-{}.json", (scale * 100.0) as u32));
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&path, raw.to_string()))
            .map_err(|e| ApiError::internal(format!("writing {}: {e}", path.display())))?;
    }
    let s: Vec<u64> = series.iter().map(|(_, m)| m.values().sum()).collect();
    let mib = |b: f64| b / 1048576.0;
    let mean = if s.is_empty() { 0.0 } else { s.iter().sum::<u64>() as f64 / s.len() as f64 };
    let peak = s.iter().copied().max().unwrap_or(0) as f64;
    let per_gib = |b: f64| if b > 0.0 { opts.sandboxes as f64 / (b / 1073741824.0) } else { 0.0 };
    let (agent_bytes, agent_count) = *crab_common::sync::lock(&agent_samples);
    let per_agent = if agent_count > 0 { agent_bytes as f64 / agent_count as f64 } else { 0.0 };
    let counters = moved(&top0.0, &top1.0);
    let count = |k: &str| counters.get(k).copied().unwrap_or(0);
    Ok(ModeReport {
        mode: mode.into(),
        scale,
        sandboxes: opts.sandboxes,
        turns: exposed.len(),
        mem_mean_mib: mib(mean),
        mem_peak_mib: mib(peak),
        per_gib_peak: per_gib(peak),
        per_gib_mean: per_gib(mean),
        mem_per_agent_mib: mib(per_agent),
        per_gib_agents: if per_agent > 0.0 { 1073741824.0 / per_agent } else { 0.0 },
        exposed_ms: Summary::of(&exposed),
        first_byte_ms: opts.stream.then(|| Summary::of(&first)),
        wall_s,
        correct,
        parks: count("parks"),
        wakes: count("wakes"),
        wakes_by: ["prewakes", "head_parks", "answer_wakes"]
            .iter()
            .map(|k| (k.to_string(), count(k)))
            .collect(),
        resident,
        declined: moved(&top0.1, &top1.1),
        point_bytes,
        worst: {
            worst.sort_by(|a, b| b.exposed_ms.total_cmp(&a.exposed_ms));
            worst.truncate(6);
            worst
        },
        head_bound,
    })
}

async fn memory(client: &Client, names: &[String]) -> Result<HashMap<String, u64>, ApiError> {
    let v: Vec<SandboxInfo> = client.call::<(), _>(Method::GET, "/v1/sandboxes", None).await?;
    Ok(v.into_iter()
        .filter(|s| names.contains(&s.name))
        .map(|s| (s.name, s.memory_bytes.unwrap_or(0)))
        .collect())
}

/// The daemon's parking counters so far (`/v1/top`'s `parking`: `parks`, `wakes`,
/// `prewakes`, `head_parks`, `answer_wakes`), and its declined parks by why.
async fn parking_counts(
    client: &Client,
) -> Result<(BTreeMap<String, u64>, BTreeMap<String, u64>), ApiError> {
    let v: serde_json::Value = client.call::<(), _>(Method::GET, "/v1/top", None).await?;
    let p = &v["parking"];
    let counts = |o: &serde_json::Value| -> BTreeMap<String, u64> {
        o.as_object()
            .map(|d| d.iter().filter_map(|(k, n)| Some((k.clone(), n.as_u64()?))).collect())
            .unwrap_or_default()
    };
    Ok((counts(p), counts(&p["declined"])))
}

/// What `after` counted beyond `before`, the counters that moved.
fn moved(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, &n)| (k.clone(), n.saturating_sub(before.get(k).copied().unwrap_or(0))))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Bytes of the files under `dir` (hard links counted once).
fn du(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&p) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() && seen.insert((m.dev(), m.ino())) {
                total += m.len();
            }
        }
    }
    total
}

impl DensityMemoryReport {
    /// The table `crab bench density --memory` prints.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:<6} {:>5} {:>4} {:>10} {:>10} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8} {:>6} {:>10}\n",
            "mode", "scale", "sbx", "mean MiB", "peak MiB", "/GiB pk", "MiB/agent", "/GiB", "exp p50", "exp p95", "exp p99", "wall s", "correct", "parks", "wakes", "point MiB"
        );
        for m in &self.modes {
            s.push_str(&format!(
                "{:<6} {:>5.2} {:>4} {:>10.0} {:>10.0} {:>8.2} {:>9.0} {:>8.2} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>3}/{:<3} {:>8} {:>6} {:>10.1}\n",
                m.mode, m.scale, m.sandboxes, m.mem_mean_mib, m.mem_peak_mib, m.per_gib_peak,
                m.mem_per_agent_mib, m.per_gib_agents,
                m.exposed_ms.p50, m.exposed_ms.p95, m.exposed_ms.p99, m.wall_s, m.correct, m.turns,
                m.parks, m.wakes, m.point_bytes as f64 / 1048576.0
            ));
        }
        if let Some(tps) = self.stream_tps {
            s.push_str(&format!(
                "answers streamed at {tps} tokens/s; first-byte delay p50/p95/p99 ms:"
            ));
            for m in &self.modes {
                if let Some(f) = &m.first_byte_ms {
                    s.push_str(&format!(
                        " {} {:.2} {:.1}/{:.1}/{:.1};",
                        m.mode, m.scale, f.p50, f.p95, f.p99
                    ));
                }
            }
            s.push('\n');
        }
        for m in &self.modes {
            s.push_str(&format!(
                "worst turns, {} {:.2} (sandbox/turn: answer + command ms, generation ms):",
                m.mode, m.scale
            ));
            for w in &m.worst {
                s.push_str(&format!(
                    " {}/{}: {:.0}+{:.0} ({});",
                    w.sandbox, w.turn, w.answer_ms, w.command_ms, w.gen_ms
                ));
            }
            s.push('\n');
        }
        for m in &self.modes {
            let by: Vec<String> = m
                .resident
                .iter()
                .map(|(k, p)| {
                    format!(
                        "{k} {:.0} MiB over {:.0}% of the time ({:.0}% of MiB·s)",
                        p.mean_mib,
                        p.time_share * 100.0,
                        p.mem_share * 100.0
                    )
                })
                .collect();
            s.push_str(&format!(
                "memory per sandbox by phase, {} {:.2}: {}\n",
                m.mode,
                m.scale,
                by.join("; ")
            ));
        }
        for m in &self.modes {
            let Some(b) = &m.head_bound else { continue };
            let none = self.modes.iter().find(|o| o.mode == "none" && o.scale == m.scale);
            let times = match none {
                Some(o) if b.mib_per_agent > 0.0 => {
                    format!(" ({:.2}x none's)", o.mem_per_agent_mib / b.mib_per_agent)
                }
                _ => String::new(),
            };
            s.push_str(&format!(
                "at best, {} {:.2}: woken at their answers' head, the sandboxes must run {:.0}% of their agents' time (generation after the head, commands; dumps and wakes free): {:.0} MiB per agent{times}\n",
                m.mode,
                m.scale,
                b.running_share * 100.0,
                b.mib_per_agent
            ));
        }
        for m in self.modes.iter().filter(|m| m.wakes > 0) {
            let n = |k: &str| m.wakes_by.get(k).copied().unwrap_or(0);
            s.push_str(&format!(
                "wakes, {} {:.2}: {} ahead of the answer, {} parks left to the answer's head, {} answers held for a wake\n",
                m.mode,
                m.scale,
                n("prewakes"),
                n("head_parks"),
                n("answer_wakes")
            ));
        }
        for m in self.modes.iter().filter(|m| !m.declined.is_empty()) {
            let why: Vec<String> = m.declined.iter().map(|(k, n)| format!("{k} {n}")).collect();
            s.push_str(&format!(
                "turn boundaries left running, {} {:.2}: {}\n",
                m.mode,
                m.scale,
                why.join(", ")
            ));
        }
        s.push_str(&format!("load average before {}, after {}\n", self.load.0, self.load.1));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_bound_counts_generations_commands_and_gaps() {
        // Two turns: asked at 0, answered at 1000, command to 1100; bookkeeping to 1200,
        // asked again, answered at 4200 (a 500 ms generation), command to 4300.
        let spans = vec![vec![[0.0, 1000.0, 1100.0], [1200.0, 4200.0, 4300.0]]];
        let b = head_bound(&spans, &[vec![300.0, 500.0]], 200.0);
        // Running: the generations 300 + 500, the commands 200, the gap 100.
        assert!((b.running_share - 1100.0 / 4300.0).abs() < 1e-9, "{b:?}");
        assert!((b.mib_per_agent - 200.0 * 1100.0 / 4300.0).abs() < 1e-9, "{b:?}");
        // A generation longer than its wait counts only the wait.
        let b = head_bound(&spans, &[vec![300.0, 9000.0]], 200.0);
        assert!((b.running_share - 3600.0 / 4300.0).abs() < 1e-9, "{b:?}");
    }
}
