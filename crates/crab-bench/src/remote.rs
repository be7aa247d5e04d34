//! `crab bench remote`: what the durable tier uploads for real agent trajectories, side by
//! side in one run, for three ways of making every turn durable:
//!
//! - `crab`: the turn-aware points (`auto`: skip / fs / process / full as the inspector
//!   decides) exported through the content-addressed store — what `crab daemon --remote`
//!   uploads;
//! - `full-dedup`: a `full` point at every turn, through the same store (deduplicated);
//! - `full-export`: a `full` point at every turn uploaded whole — its filesystem and every CRIU
//!   image as one tar + zstd (level 3), which is what a naïve per-turn snapshot to object
//!   storage does. Measured by streaming exactly that archive and counting its bytes.
//!
//! Each trajectory is replayed twice (methods `crab` and `full`): its commands in a fresh
//! sandbox through the daemon, a checkpoint at every turn boundary as the replay benchmark
//! takes them; no LLM (bytes do not depend on its latency). After a run, its points are
//! exported in order into that method's repository (one per method, shared by all runs of
//! the method, so chunks deduplicate across turns and sandboxes as on a host) with the same
//! code the daemon's exporter runs (`crab_remote::local::export_source` + `Repo::export_point`),
//! then the sandbox is removed. The export rate is compared with the turn rate the recorded
//! trajectories would produce at `sandboxes` concurrent agents (recorded LLM latency + command
//! time per turn), so "export keeps up" is a measured ratio, not a claim.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crab_checkpoint::{BtrfsSnapshots, Store};
use crab_client::Client;
use crab_common::paths::StateDir;
use crab_common::{ApiError, Progress};
use crab_remote::{Repo, RepoOptions};

use crate::replay::trace::{self, Trajectory};
use crate::replay::{agent, sandbox, take_checkpoint, testbed};
use crate::stats::Summary;

/// Options of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct RemoteBenchOptions {
    /// Trajectory files or folders.
    pub traces: Vec<PathBuf>,
    /// At most this many trajectories (0 = all).
    pub limit: usize,
    /// Concurrent sandboxes.
    pub sandboxes: usize,
    /// Image of the sandboxes.
    pub image: String,
    /// Where the per-method repositories go: `file:///dir` or `s3://bucket/prefix`
    /// (`<url>/crab`, `<url>/full`); they must be new. `None`: a fresh directory under
    /// `/var/tmp`, deleted afterwards.
    pub remote: Option<String>,
    /// Build the stand-in `/testbed` for SWE-bench trajectories.
    pub testbed: bool,
    /// Cache of sdists and prepared trees.
    pub cache_dir: PathBuf,
    /// Timeout of one command, s.
    pub exec_timeout_s: f64,
}

/// One method's totals.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MethodBytes {
    /// Points taken.
    pub points: u64,
    /// Points by kind.
    pub kinds: BTreeMap<String, u64>,
    /// Bytes the content-addressed store uploaded (all objects).
    pub uploaded_bytes: u64,
    /// Bytes read from local files by the exports.
    pub read_bytes: u64,
    /// Wall time of the exports, s.
    pub export_s: f64,
    /// Per point export wall time, ms (none when nothing was exported).
    pub export_ms: Option<Summary>,
    /// Bytes of the whole-point tar + zstd archives (for `full` only).
    pub full_export_bytes: u64,
    /// Wall time of the replays (commands + checkpoints), s.
    pub replay_s: f64,
    /// Runs that failed (named).
    pub errors: Vec<String>,
}

/// A method's totals and every point's export time, ms.
type PerMethod = (MethodBytes, Vec<f64>);

impl MethodBytes {
    /// Add one run's figures (everything but `export_ms`, summarised at the end).
    fn absorb(&mut self, run: MethodBytes) {
        self.points += run.points;
        for (k, v) in run.kinds {
            *self.kinds.entry(k).or_default() += v;
        }
        self.uploaded_bytes += run.uploaded_bytes;
        self.read_bytes += run.read_bytes;
        self.export_s += run.export_s;
        self.full_export_bytes += run.full_export_bytes;
        self.replay_s += run.replay_s;
        self.errors.extend(run.errors);
    }
}

/// Result of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct RemoteBenchReport {
    /// The options.
    pub options: RemoteBenchOptions,
    /// Trajectories replayed.
    pub trajectories: Vec<String>,
    /// Turn-aware points through the store.
    pub crab: MethodBytes,
    /// `full` points through the store (`full-dedup`) and whole (`full-export`).
    pub full: MethodBytes,
    /// `crab.uploaded_bytes / full.full_export_bytes`.
    pub crab_vs_full_export: f64,
    /// `full.uploaded_bytes / full.full_export_bytes`.
    pub full_dedup_vs_full_export: f64,
    /// Median recorded turn time of the trajectories (LLM latency + command), s.
    pub recorded_turn_s: f64,
    /// Points per second `sandboxes` agents produce at the recorded turn time.
    pub demand_points_per_s: f64,
    /// Points per second the `crab` exports sustained (one exporter, as in the daemon).
    pub crab_export_points_per_s: f64,
    /// What else was running (load average at the start and the end).
    pub load: String,
}

/// `io::Write` that counts and drops.
struct Count(u64);

impl Write for Count {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes of `fs/` + `procs/` of one point as a tar + zstd (level 3) archive.
fn full_export_size(fs: Option<&Path>, procs: Option<&Path>) -> Result<u64, ApiError> {
    let err =
        |what: &str, e: std::io::Error| ApiError::internal(format!("full-export {what}: {e}"));
    let enc = zstd::stream::write::Encoder::new(Count(0), 3).map_err(|e| err("zstd", e))?;
    let mut tar = tar::Builder::new(enc);
    tar.follow_symlinks(false);
    if let Some(fs) = fs {
        append_tree(&mut tar, fs, Path::new("fs"))
            .map_err(|e| err(&fs.display().to_string(), e))?;
    }
    if let Some(p) = procs {
        tar.append_dir_all("procs", p).map_err(|e| err(&p.display().to_string(), e))?;
    }
    let enc = tar.into_inner().map_err(|e| err("tar", e))?;
    let count = enc.finish().map_err(|e| err("zstd", e))?;
    Ok(count.0)
}

/// Append the tree at `dir` as `name/…`: regular files, directories and symlinks (what a
/// rootfs tar carries; sockets and device nodes are headers only).
fn append_tree<W: Write>(
    tar: &mut tar::Builder<W>,
    dir: &Path,
    name: &Path,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let mut stack = vec![(dir.to_path_buf(), name.to_path_buf())];
    while let Some((d, n)) = stack.pop() {
        tar.append_dir(&n, &d)?;
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let (p, rel) = (e.path(), n.join(e.file_name()));
            let t = e.file_type()?;
            if t.is_dir() {
                stack.push((p, rel));
            } else if t.is_file() || t.is_symlink() {
                tar.append_path_with_name(&p, &rel)?;
            } else if t.is_fifo() || t.is_char_device() || t.is_block_device() {
                let mut h = tar::Header::new_gnu();
                h.set_size(0);
                h.set_entry_type(tar::EntryType::Fifo);
                tar.append_data(&mut h, &rel, std::io::empty())?;
            }
        }
    }
    Ok(())
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

struct RunOut {
    kinds: Vec<String>,
    replay_s: f64,
}

/// Replay `t`'s commands in sandbox `name`, a checkpoint of `kind` at every turn boundary.
async fn replay_one(
    client: &Client,
    state: &StateDir,
    opts: &RemoteBenchOptions,
    t: &Trajectory,
    testbed: Option<&PathBuf>,
    name: &str,
    kind: &str,
) -> Result<RunOut, ApiError> {
    sandbox::create(client, &opts.image, name).await?;
    if let Some(tar) = testbed {
        let (tar, root) = (tar.clone(), state.sandbox_rootfs(name));
        tokio::task::spawn_blocking(move || testbed::install(&tar, &root))
            .await
            .map_err(|e| ApiError::internal(format!("installing /testbed: {e}")))??;
    }
    let wd = t.family.workdir();
    sandbox::sh_ok(client, name, &format!("mkdir -p '{wd}'"), 30.0).await?;
    if t.shell_state {
        agent::start_session(client, name, wd).await?;
    }
    let t0 = Instant::now();
    let mut kinds = Vec::new();
    for (turn, step) in t.steps.iter().enumerate() {
        // The session's shell is the sandbox's harness: a turn that changed its state asks
        // for a dump itself (see replay::agent::take_state_changed).
        let kind = if kind == "auto" && t.shell_state && agent::take_state_changed(name).await {
            "full"
        } else {
            kind
        };
        let p = take_checkpoint(client, name, kind, turn, 2 * turn + 2).await?;
        kinds.push(p.kind);
        agent::execute(client, name, &step.action, wd, t.shell_state, opts.exec_timeout_s).await?;
    }
    Ok(RunOut { kinds, replay_s: t0.elapsed().as_secs_f64() })
}

/// Export every point of `name` (oldest first) into `repo`; with `whole`, also measure the
/// point as one archive.
async fn export_all(
    repo: &Repo,
    state: &StateDir,
    name: &str,
    whole: bool,
    into: &mut MethodBytes,
    export_ms: &mut Vec<f64>,
) -> Result<(), ApiError> {
    let store = Store::open_existing(state.checkpoints(name), name, Arc::new(BtrfsSnapshots))
        .map_err(|e| ApiError::internal(format!("opening {name}'s store: {e}")))?
        .ok_or_else(|| ApiError::internal(format!("{name} has no checkpoint store")))?;
    let mut points = store.list().map_err(|e| ApiError::internal(e.to_string()))?;
    points.sort_by_key(|m| m.created_at_ms);
    for m in points {
        let src = crab_remote::local::export_source(state, &store, &m)
            .map_err(|e| ApiError::internal(format!("export source of {name}@{}: {e}", m.id)))?;
        let t0 = Instant::now();
        let rep = repo
            .export_point(&src)
            .await
            .map_err(|e| ApiError::internal(format!("exporting {name}@{}: {e}", m.id)))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        export_ms.push(ms);
        into.export_s += ms / 1e3;
        into.uploaded_bytes += rep.uploaded_bytes;
        into.read_bytes += rep.read_bytes;
        if whole {
            let (fs, procs) = (src.fs_dir.clone(), src.procs_dir.clone());
            let n = tokio::task::spawn_blocking(move || {
                full_export_size(fs.as_deref(), procs.as_deref())
            })
            .await
            .map_err(|e| ApiError::internal(format!("full-export task: {e}")))??;
            into.full_export_bytes += n;
        }
    }
    Ok(())
}

/// Run the benchmark.
pub async fn run(
    opts: &RemoteBenchOptions,
    client: &Client,
    progress: &dyn Progress,
) -> Result<RemoteBenchReport, ApiError> {
    let load0 = load_avg();
    let trajs = trace::load_all(&opts.traces, opts.limit)
        .map_err(|e| ApiError::invalid(e.to_string(), "pass trajectory files or folders"))?;
    if trajs.is_empty() {
        return Err(ApiError::invalid(
            format!("no trajectories found in {:?}", opts.traces),
            "pass trajectory files (*.jsonl) or folders holding them",
        ));
    }
    let version = sandbox::version(client).await?;
    let state = StateDir::new(&version.state_dir);
    let scratch = match &opts.remote {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("crab-bench-remote-")
                .tempdir_in("/var/tmp")
                .map_err(|e| ApiError::internal(format!("a scratch directory in /var/tmp: {e}")))?,
        ),
    };
    let remote = match (&opts.remote, &scratch) {
        (Some(r), _) => r.clone(),
        (None, Some(d)) => format!("file://{}", d.path().display()),
        (None, None) => return Err(ApiError::internal("no remote and no scratch directory")),
    };
    let (testbeds, _) = if opts.testbed {
        crate::replay::prepare_testbeds(&trajs, &opts.cache_dir, progress).await?
    } else {
        Default::default()
    };
    let open = |sub: &str| {
        let url = format!("{}/{sub}", remote.trim_end_matches('/'));
        let cache = state.root().join(format!("bench-remote-cache-{sub}-{}", std::process::id()));
        async move {
            let repo = Repo::open(
                &url,
                RepoOptions { key_file: None, cache_dir: cache.clone(), bandwidth_bps: None },
            )
            .await
            .map_err(|e| {
                ApiError::invalid(format!("{url}: {e}"), "give a new, writable --remote")
            })?;
            if !repo
                .list_points(None)
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .is_empty()
            {
                return Err(ApiError::invalid(
                    format!("{url} already holds points"),
                    "give a new --remote location: the figures must start from an empty store",
                ));
            }
            Ok::<_, ApiError>((repo, cache))
        }
    };
    let (crab_repo, crab_cache) = open("crab").await?;
    let (full_repo, full_cache) = open("full").await?;
    let repos = Arc::new([tokio::sync::Mutex::new(crab_repo), tokio::sync::Mutex::new(full_repo)]);
    // Per method (0 = crab, 1 = full): its totals and every point's export time.
    let results: Arc<tokio::sync::Mutex<[PerMethod; 2]>> = Arc::default();

    // Jobs: (trajectory, method 0 = crab / 1 = full), `sandboxes` at a time.
    let jobs: Vec<(usize, usize)> =
        (0..trajs.len()).flat_map(|i| [(i, 0usize), (i, 1usize)]).collect();
    progress.stage("replay + export", Some(jobs.len() as u64));
    let sem = Arc::new(tokio::sync::Semaphore::new(opts.sandboxes.max(1)));
    let trajs = Arc::new(trajs);
    let testbeds = Arc::new(testbeds);
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tag = format!("{:x}", std::process::id());
    let mut handles = Vec::new();
    for (n, (i, method)) in jobs.into_iter().enumerate() {
        let (sem, trajs, testbeds, repos, results, done) = (
            sem.clone(),
            trajs.clone(),
            testbeds.clone(),
            repos.clone(),
            results.clone(),
            done.clone(),
        );
        let (client, state, opts, tag) = (client.clone(), state.clone(), opts.clone(), tag.clone());
        handles.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            let t = &trajs[i];
            let (label, kind) = if method == 0 { ("crab", "auto") } else { ("full", "full") };
            let name = format!("rb-{tag}-{n}-{label}");
            let run = replay_one(&client, &state, &opts, t, testbeds.get(&i), &name, kind).await;
            let mut local = MethodBytes::default();
            let mut ms = Vec::new();
            let res = match run {
                Ok(out) => {
                    local.points = out.kinds.len() as u64;
                    for k in out.kinds {
                        *local.kinds.entry(k).or_default() += 1;
                    }
                    local.replay_s = out.replay_s;
                    let repo = repos[method].lock().await;
                    export_all(&repo, &state, &name, method == 1, &mut local, &mut ms).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = res {
                local.errors.push(format!("{} ({label}): {}", t.id, e.message));
            }
            agent::end_session(&name).await;
            let _ = sandbox::remove(&client, &name).await;
            let (into, into_ms) = &mut results.lock().await[method];
            into.absorb(local);
            into_ms.extend(ms);
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }));
    }
    for h in handles {
        let n = h.await.map_err(|e| ApiError::internal(format!("a run panicked: {e}")))?;
        progress.advance(n + 1);
    }
    for c in [crab_cache, full_cache] {
        let _ = std::fs::remove_dir_all(c);
    }
    drop(scratch);
    let [crab, full] = Arc::try_unwrap(results)
        .map_err(|_| ApiError::internal("runs still hold the results"))?
        .into_inner()
        .map(|(mut m, ms)| {
            m.export_ms = (!ms.is_empty()).then(|| Summary::of(&ms));
            m
        });

    let turn_s: Vec<f64> = trajs
        .iter()
        .flat_map(|t| t.steps.iter())
        .filter_map(|s| Some(s.llm_latency_s? + s.exec_s.unwrap_or(0.0)))
        .collect();
    let recorded_turn_s = crate::stats::median(&turn_s);
    let ratio = |a: u64, b: u64| if b == 0 { f64::NAN } else { a as f64 / b as f64 };
    Ok(RemoteBenchReport {
        trajectories: trajs.iter().map(|t| t.id.clone()).collect(),
        crab_vs_full_export: ratio(crab.uploaded_bytes, full.full_export_bytes),
        full_dedup_vs_full_export: ratio(full.uploaded_bytes, full.full_export_bytes),
        recorded_turn_s,
        demand_points_per_s: opts.sandboxes as f64 / recorded_turn_s,
        crab_export_points_per_s: if crab.export_s > 0.0 {
            crab.points as f64 / crab.export_s
        } else {
            f64::NAN
        },
        load: format!("load average {load0} at the start, {} at the end", load_avg()),
        options: opts.clone(),
        crab,
        full,
    })
}
