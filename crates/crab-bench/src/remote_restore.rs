//! `crab bench remote-restore`: what a restore from the durable tier costs next to a local
//! restore of the same point, side by side in one run.
//!
//! Host A is a daemon of the benchmark's own (state directory under the scratch directory,
//! `--remote` on a SeaweedFS S3 server the benchmark starts on loopback with
//! `scripts/s3-test-server.sh`, as the tests do). It imports the running daemon's image, runs a
//! sandbox holding a process with `mib` MiB of touched memory, takes one `full` point and makes
//! it durable in S3 (`checkpoint --durable`); the same point is also exported with the
//! daemon's own export code into a `file://` repository. Then, interleaved round by round:
//!
//! - `local restore`: `POST /v1/sandboxes/SB/restore` of that point on host A (in place);
//! - `local fork 1` / `local fork N`: forks of that point on host A;
//! - `file:// create` / `s3 create`: `sandbox create --from-remote SB@POINT` on a host B that
//!   has never seen the point (a fresh daemon with its own state directory, pool, proxy port,
//!   empty blob cache and no image), started before and destroyed after each round;
//! - `file:// fork N` / `s3 fork N`: `fork --from-remote SB@POINT --count N` on such a host;
//!   the call answers once every branch runs.
//!
//! Times are the API call end to end as the client sees it; the daemon's own split (fetch and
//! materialize vs fork) comes from its answer. Every restored sandbox is checked afterwards
//! (the memory-holding process is alive, the file written before the point is there).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};

use crab_checkpoint::{BtrfsSnapshots, Store};
use crab_client::{Client, Method};
use crab_common::paths::StateDir;
use crab_common::ApiError;
use crab_remote::local::image_stamp_path;
use crab_remote::{Repo, RepoOptions};
use crab_testkit::daemon::OtherDaemon;

use crate::replay::sandbox::{self as sbx, sh_ok};
use crate::stats::Summary;

/// Options of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct RemoteRestoreOptions {
    /// Image of the sandbox (taken from the running daemon's state directory).
    pub image: String,
    /// Rounds of every arm.
    pub rounds: usize,
    /// Rounds of the fork arms.
    pub fork_rounds: usize,
    /// Branches of a fork.
    pub fork_count: usize,
    /// MiB of touched memory of the sandbox's process.
    pub mib: usize,
    /// `scripts/s3-test-server.sh` (default: found next to the working directory or the binary).
    pub s3_script: Option<PathBuf>,
    /// Leave out the bare receiving hosts (nothing but the remote: the whole tree is
    /// downloaded, tens of seconds per call); only hosts that have the image are measured.
    pub no_bare: bool,
    /// A `crab` binary of an earlier build (its `crab-nsexec` beside it): S3 receiving hosts
    /// with the image also run it, interleaved with this build's, for a before/after in one
    /// run.
    pub baseline_bin: Option<PathBuf>,
}

/// One remote backend's figures, on receiving hosts with or without the image.
#[derive(Debug, Clone, Serialize)]
pub struct BackendReport {
    /// `file://…` or `s3://…`.
    pub url: String,
    /// The receiving hosts had the sandbox's image (imported, its tree id hashed by the
    /// daemon before the measured call); without, they have nothing but the remote.
    pub with_image: bool,
    /// The receiving host's daemon had run a sandbox (created, checkpointed with CRIU,
    /// removed) and loaded the remote's index while idle before the measured call: a fleet
    /// node that is up, as opposed to a daemon started for the call.
    pub warm: bool,
    /// A standby: the receiving daemon (with the image) followed the sandbox (`crab remote
    /// follow SB`) and held its newest point before the measured call (a failover restore).
    #[serde(default)]
    pub standby: bool,
    /// The receiving daemons ran `--baseline-bin` (the build before), not this one.
    #[serde(default)]
    pub baseline: bool,
    /// Restores that patched the local image instead of downloading the whole tree.
    pub patched_from_image: usize,
    /// Time the receiving daemon took to hash the imported image (once per image and host;
    /// not in the measured calls), ms.
    pub image_hash_ms: Summary,
    /// `sandbox create --from-remote`, end to end, ms.
    pub create_ms: Summary,
    /// Its fetch + materialize part, as the daemon reports it, ms.
    pub create_fetch_ms: Summary,
    /// `fork --from-remote --count N`, end to end (all N running), ms.
    pub fork_ms: Summary,
    /// Its fetch + materialize part, ms.
    pub fork_fetch_ms: Summary,
    /// `sandbox create --from-remote` broken down as the daemon reports it (`stages` of the
    /// answer: load_point, preflight, materialize_*, fork, attach), ms, in the daemon's order.
    pub create_stages_ms: Vec<(String, Summary)>,
}

/// Result of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct RemoteRestoreReport {
    /// The options.
    pub options: RemoteRestoreOptions,
    /// The point restored (`SB@POINT`).
    pub point: String,
    /// Bytes of the point's CRIU images.
    pub proc_bytes: u64,
    /// Bytes of file content in the point's filesystem.
    pub fs_bytes: u64,
    /// Bytes its export to S3 uploaded.
    pub uploaded_bytes: u64,
    /// In-place restore on host A, ms.
    pub local_restore_ms: Summary,
    /// Fork of 1 on host A, ms.
    pub local_fork1_ms: Summary,
    /// Fork of N on host A, ms.
    pub local_fork_ms: Summary,
    /// `file://` and S3, receiving hosts without and with the image.
    pub remotes: Vec<BackendReport>,
    /// p50 of `s3 create` (fresh daemon with the image) / p50 of `local restore` (budget: ≤ 2).
    pub s3_create_vs_local_restore: f64,
    /// The same, on hosts without the image.
    pub s3_create_cold_vs_local_restore: f64,
    /// The same, on warm hosts with the image (see [`BackendReport::warm`]).
    pub s3_create_warm_vs_local_restore: f64,
    /// p50 of `s3 create` (host with the image) / p50 of `local fork 1`.
    pub s3_create_vs_local_fork1: f64,
    /// p50 of `s3 fork N` (host with the image) / p50 of `local fork N`.
    pub s3_fork_vs_local_fork: f64,
    /// p50 of `s3 create` on a standby that followed the sandbox / p50 of `local restore`
    /// (budget: ≤ 1.2).
    pub s3_standby_create_vs_local_restore: f64,
    /// p50 of `s3 fork N` on such a standby / p50 of `local fork N`.
    pub s3_standby_fork_vs_local_fork: f64,
    /// [`RemoteRestoreReport::s3_create_vs_local_restore`] with the baseline build on the
    /// receiving hosts (NaN without `--baseline-bin`).
    pub baseline_s3_create_vs_local_restore: f64,
    /// [`RemoteRestoreReport::s3_fork_vs_local_fork`] with the baseline build.
    pub baseline_s3_fork_vs_local_fork: f64,
    /// Load average before / after.
    pub load_before: String,
    /// Load average after.
    pub load_after: String,
    /// Other heavy processes seen at the start (compilers, other daemons).
    pub others: Vec<String>,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Processes that compete for the CPU: compilers, test binaries, other crab daemons, CRIU.
fn others() -> Vec<String> {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    let me = std::process::id().to_string();
    let Ok(rd) = std::fs::read_dir("/proc") else { return Vec::new() };
    for de in rd.flatten() {
        let pid = de.file_name().to_string_lossy().into_owned();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmd) = std::fs::read(de.path().join("cmdline")) else { continue };
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let Some(argv0) = args.first() else { continue };
        let base = argv0.rsplit('/').next().unwrap_or(argv0).to_string();
        let key = if base == "crab" && args.get(1).map(String::as_str) == Some("daemon") {
            "crab daemon".to_string()
        } else if ["rustc", "cargo", "cc", "ld", "criu", "weed", "debootstrap"]
            .contains(&base.as_str())
        {
            base
        } else {
            continue;
        };
        *counts.entry(key).or_default() += 1;
    }
    counts.into_iter().map(|(k, n)| format!("{n}× {k}")).collect()
}

fn s3_script(opts: &RemoteRestoreOptions) -> Result<PathBuf, ApiError> {
    if let Some(p) = &opts.s3_script {
        return Ok(p.clone());
    }
    let mut tries = vec![PathBuf::from("scripts/s3-test-server.sh")];
    if let Ok(exe) = std::env::current_exe() {
        // target/{debug,release}/crab → the checkout's scripts/.
        if let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            tries.push(root.join("scripts/s3-test-server.sh"));
        }
    }
    tries.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        ApiError::invalid(
            "cannot find scripts/s3-test-server.sh",
            "run from the checkout, or pass --s3-script PATH",
        )
    })
}

/// The S3 server this run started; stopped on drop.
struct S3Server {
    pid: i32,
    env: Vec<(String, String)>,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // Its own process group (setsid), then the process itself.
        let _ = Command::new("kill").args(["--", &format!("-{}", self.pid)]).status();
        let _ = Command::new("kill").arg(self.pid.to_string()).status();
    }
}

fn start_s3(script: &Path, dir: &Path) -> Result<S3Server, ApiError> {
    let base = 23000 + (std::process::id() % 300) as u16 * 12;
    let out = Command::new(script)
        .arg(dir)
        .arg(base.to_string())
        .output()
        .map_err(|e| ApiError::internal(format!("running {}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(ApiError::internal(format!(
            "the S3 test server did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut s = S3Server { pid: 0, env: Vec::new() };
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((k, v)) = l.split_once('=') else { continue };
        if k == "WEED_PID" {
            s.pid = v.parse().unwrap_or(0);
        } else {
            s.env.push((k.to_string(), v.to_string()));
        }
    }
    Ok(s)
}

async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("{what}: {e}")))
}

/// A daemon of the benchmark's own (panics of the test harness become errors), of `bin`
/// (else the build under test).
async fn daemon(
    dir: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    bin: Option<PathBuf>,
) -> Result<Host, ApiError> {
    let what = format!("starting a daemon on {}", dir.display());
    let d = blocking(&what, move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        match &bin {
            Some(b) => OtherDaemon::start_from(b, &dir, &a, &env),
            None => OtherDaemon::start(&dir, &a, &env),
        }
    })
    .await?;
    let client = Client::new(StateDir::new(&d.state).socket());
    Ok(Host { d: Some(d), client })
}

struct Host {
    d: Option<OtherDaemon>,
    client: Client,
}

impl Host {
    fn state(&self) -> PathBuf {
        self.d.as_ref().map(|d| d.state.clone()).unwrap_or_default()
    }

    async fn cli(&self, args: &[&str]) -> Result<String, ApiError> {
        let Some(d) = &self.d else { return Err(ApiError::internal("daemon gone")) };
        let o = d.crab(args);
        if !o.status.success() {
            return Err(ApiError::internal(format!(
                "crab {args:?}: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    async fn destroy(mut self) {
        if let Some(d) = self.d.take() {
            let _ = tokio::task::spawn_blocking(move || d.destroy()).await;
        }
    }
}

const HOLD: &str = "echo before-the-point > /root/state.txt; \
    setsid python3 -c 'import time; b=bytearray(MIB * 1048576); [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; open(\"/tmp/ready\",\"w\").close(); time.sleep(1e6)' </dev/null >/dev/null 2>&1 & \
    echo $! > /tmp/holder; \
    for i in $(seq 600); do [ -e /tmp/ready ] && exit 0; sleep 0.1; done; exit 1";

const CHECK: &str = "kill -0 $(cat /tmp/holder) && grep -q before-the-point /root/state.txt";

async fn check(client: &Client, sb: &str, what: &str) -> Result<(), ApiError> {
    sh_ok(client, sb, CHECK, 20.0)
        .await
        .map(|_| ())
        .map_err(|e| ApiError::internal(format!("{what}: {sb} lost its state: {e}")))
}

/// Run the benchmark. Everything it starts is stopped and removed, pass or fail.
pub async fn run(
    client: &Client,
    opts: &RemoteRestoreOptions,
) -> Result<RemoteRestoreReport, ApiError> {
    if opts.rounds == 0 || opts.fork_rounds == 0 || opts.fork_count == 0 {
        return Err(ApiError::invalid(
            "rounds, fork rounds and fork count must be ≥ 1",
            "--rounds 5 --fork-rounds 3 --fork 8",
        ));
    }
    let version = sbx::version(client).await?;
    let image = StateDir::new(&version.state_dir).image_rootfs(&opts.image);
    if !image.is_dir() {
        return Err(ApiError::invalid(
            format!("the running daemon has no image {:?} ({})", opts.image, image.display()),
            format!("crab image build {}", opts.image),
        ));
    }
    let script = s3_script(opts)?;
    let scratch = tempfile::Builder::new()
        .prefix("crab-bench-rrestore-")
        .tempdir_in("/var/tmp")
        .map_err(|e| ApiError::internal(format!("a scratch directory in /var/tmp: {e}")))?;
    let (load_before, others) = (load_avg(), others());
    let s3dir = scratch.path().join("weed");
    let s3 = {
        let script = script.clone();
        blocking("S3 server", move || start_s3(&script, &s3dir)).await??
    };
    let s3_url = format!("s3://crab/bench-{}", std::process::id());
    let file_url = format!("file://{}", scratch.path().join("file-remote").display());
    let a = daemon(
        scratch.path().join("host-a"),
        ["--pool-size", "8G", "--remote", &s3_url].map(String::from).to_vec(),
        s3.env.clone(),
        None,
    )
    .await?;
    let mut hosts = Vec::new();
    let res = measure(opts, &a, &image, scratch.path(), &s3, &s3_url, &file_url, &mut hosts).await;
    for h in hosts {
        h.destroy().await;
    }
    a.destroy().await;
    drop(s3);
    let mut r = res?;
    r.load_before = load_before;
    r.load_after = load_avg();
    r.others = others;
    Ok(r)
}

/// One measured call on a receiving host.
#[derive(Debug, Clone)]
struct ArmRun {
    total_ms: f64,
    fetch_ms: f64,
    stages: Vec<(String, f64)>,
    patched: bool,
    hash_ms: f64,
}

/// Flush the pool at `pool` and wait for btrfs to finish deleting removed subvolumes.
async fn settle(pool: PathBuf) -> Result<(), ApiError> {
    blocking("settle the pool", move || {
        for args in [&["sync", "-f"][..], &["btrfs", "subvolume", "sync"][..]] {
            let st = Command::new(args[0])
                .args(&args[1..])
                .arg(&pool)
                .stdout(std::process::Stdio::null())
                .status();
            match st {
                Ok(s) if s.success() => {}
                other => {
                    return Err(ApiError::internal(format!(
                        "{} {}: {other:?}",
                        args.join(" "),
                        pool.display()
                    )))
                }
            }
        }
        Ok(())
    })
    .await?
}

/// A receiving host: its remote, whether it has the image, whether it is warm, whether it
/// is a standby following the sandbox, and the binary it runs (None: this build).
#[derive(Debug, Clone)]
struct Variant {
    url: String,
    with_image: bool,
    warm: bool,
    standby: bool,
    bin: Option<PathBuf>,
}

/// On a fresh host B (`--remote v.url`; `with_image`: the image imported and hashed first;
/// `warm`: then one sandbox created, checkpointed `full` and removed):
/// `count` sandboxes from `source`, timed, then checked; B is destroyed afterwards.
#[allow(clippy::too_many_arguments)]
async fn remote_arm(
    opts: &RemoteRestoreOptions,
    v: &Variant,
    dir: PathBuf,
    env: &[(String, String)],
    image: &Path,
    source: &str,
    count: usize,
    hosts: &mut Vec<Host>,
) -> Result<ArmRun, ApiError> {
    let args: Vec<String> = ["--pool-size", "8G", "--remote", &v.url].map(String::from).to_vec();
    let followed = source.split('@').next().unwrap_or_default().to_string();
    let b = daemon(dir, args, env.to_vec(), v.bin.clone()).await?;
    hosts.push(b);
    let Some(b) = hosts.last() else { return Err(ApiError::internal("no host")) };
    let mut hash_ms = f64::NAN;
    if v.with_image {
        b.cli(&["image", "import", &opts.image, &image.display().to_string()]).await?;
        // The idle exporter hashes new images within a few seconds: the image and each of
        // its user-namespace copies (a point of a user-namespaced sandbox is made of one).
        let cache = b.state().join("remote-cache");
        let state_b = StateDir::new(b.state());
        let t = Instant::now();
        let hashed = || {
            let copies = crab_sandbox::shift::current_copies(&state_b, &opts.image);
            let stamp = |userns| image_stamp_path(&cache, &opts.image, userns).exists();
            stamp(None) && copies.iter().all(|(r, _)| stamp(Some(*r)))
        };
        while !hashed() {
            if t.elapsed().as_secs() > 120 {
                return Err(ApiError::internal(format!(
                    "the daemon on {} did not hash image {} within 120 s",
                    b.state().display(),
                    opts.image
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        hash_ms = ms(t);
        // A node that holds the image has it on disk: without this flush the first btrfs
        // snapshot of the just-imported image (the patch's base) waits for its ≈ 500 MB of
        // writeback, seconds that belong to the import, not to a restore.
        settle(b.state().join("pool")).await?;
        if v.warm {
            // The idle exporter loaded the index before it hashed the image (same idle pass).
            let w = "warmup";
            b.cli(&["sandbox", "create", &opts.image, "--name", w]).await?;
            b.cli(&["checkpoint", w, "--kind", "full"]).await?;
            b.cli(&["sandbox", "rm", "--force", w]).await?;
            // What the warm-up left to the kernel (its dump's writeback, the removed
            // sandbox's subvolumes, which btrfs deletes in the background) is done before
            // the measured call, as on a host whose last restore was not a moment ago.
            settle(b.state().join("pool")).await?;
        }
    }
    let mut source = source.to_string();
    if v.standby {
        // A standby of a fleet: it has the image, then follows the sandbox.
        b.cli(&["remote", "follow", &followed]).await?;
        // The follower holds the remote's newest point of the sandbox before the failover,
        // which restores that point: at least the measured one (host A's restores and forks
        // add points that share its parts — a restore marker, a fork's origin).
        let want = source.split('@').nth(1).unwrap_or_default().to_string();
        let t = Instant::now();
        loop {
            let r: Value = b.client.call::<(), _>(Method::GET, "/v1/remote/follow", None).await?;
            let st = r["sandboxes"]
                .as_array()
                .and_then(|v| v.iter().find(|s| s["sandbox"] == followed.as_str()))
                .cloned()
                .unwrap_or_default();
            let held = st["point"].as_str().unwrap_or_default().to_string();
            if !held.is_empty() && st["remote_point"] == held.as_str() && held >= want {
                source = format!("{followed}@{held}");
                break;
            }
            if t.elapsed().as_secs() > 120 {
                return Err(ApiError::internal(format!(
                    "the standby on {} did not hold {source} within 120 s: {r}",
                    b.state().display()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    let source = source.as_str();
    let tag = format!("{}-{}", source.split('@').next().unwrap_or("x"), hosts.len());
    let names: Vec<String> = (0..count).map(|j| format!("{tag}-b{j}")).collect();
    let t = Instant::now();
    let out: Value = b
        .client
        .call(
            Method::POST,
            "/v1/remote/restore",
            Some(&json!({ "source": source, "count": count, "names": names })),
        )
        .await?;
    let total_ms = ms(t);
    for n in &names {
        check(&b.client, n, &format!("from {}", v.url)).await?;
    }
    if let Some(b) = hosts.pop() {
        b.destroy().await;
    }
    Ok(ArmRun {
        total_ms,
        fetch_ms: out["fetch_ms"].as_f64().unwrap_or(f64::NAN),
        stages: serde_json::from_value(out["stages"].clone()).unwrap_or_default(),
        patched: out["base_image"].is_string(),
        hash_ms,
    })
}

/// Per stage (in the order the daemon reports them), the summary over `runs`.
fn stage_summaries(runs: &[ArmRun]) -> Vec<(String, Summary)> {
    let mut names: Vec<String> = Vec::new();
    for r in runs {
        for (n, _) in &r.stages {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    names
        .into_iter()
        .map(|n| {
            let v: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.stages.iter().find(|(m, _)| *m == n).map(|(_, ms)| *ms))
                .collect();
            (n, Summary::of(&v))
        })
        .collect()
}

fn ratio(a: &Summary, b: &Summary) -> f64 {
    if b.p50 > 0.0 {
        a.p50 / b.p50
    } else {
        f64::NAN
    }
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    opts: &RemoteRestoreOptions,
    a: &Host,
    image: &Path,
    scratch: &Path,
    s3: &S3Server,
    s3_url: &str,
    file_url: &str,
    hosts: &mut Vec<Host>,
) -> Result<RemoteRestoreReport, ApiError> {
    a.cli(&["image", "import", &opts.image, &image.display().to_string()]).await?;
    let sb = format!("rr{}", std::process::id());
    sbx::create(&a.client, &opts.image, &sb).await?;
    sh_ok(&a.client, &sb, &HOLD.replace("MIB", &opts.mib.to_string()), 120.0).await?;
    let p = sbx::checkpoint(&a.client, &sb, "full", 1, 0).await?;
    let _: Value = a
        .client
        .call::<(), _>(
            Method::GET,
            &format!("/v1/remote/wait?sandbox={sb}&point={}&timeout_s=600", p.id),
            None,
        )
        .await?;
    // The same point into the file:// remote, with the exporter's own code.
    let state = StateDir::new(a.state());
    let store = Store::open_existing(state.checkpoints(&sb), &sb, Arc::new(BtrfsSnapshots))
        .map_err(|e| ApiError::internal(format!("opening {sb}'s store: {e}")))?
        .ok_or_else(|| ApiError::internal(format!("{sb} has no checkpoint store")))?;
    let m = store
        .list()
        .map_err(|e| ApiError::internal(e.to_string()))?
        .into_iter()
        .find(|m| p.id.parse::<crab_checkpoint::PointId>().ok() == Some(m.id))
        .ok_or_else(|| ApiError::internal(format!("point {} not in {sb}'s store", p.id)))?;
    let point_id = m.id.to_string();
    let proc_bytes = m.procs.as_ref().map_or(0, |p| p.bytes);
    let src = crab_remote::local::export_source(&state, &store, &m)
        .map_err(|e| ApiError::internal(format!("export source: {e}")))?;
    let cache = scratch.join("bench-cache");
    let file_repo =
        Repo::open(file_url, RepoOptions { key_file: None, cache_dir: cache, bandwidth_bps: None })
            .await
            .map_err(|e| ApiError::internal(format!("opening {file_url}: {e}")))?;
    let rep = file_repo
        .export_point(&src)
        .await
        .map_err(|e| ApiError::internal(format!("exporting to {file_url}: {e}")))?;
    let fs_bytes = rep.record.size_bytes.saturating_sub(proc_bytes);
    let s3_rec: Value = a
        .client
        .call::<(), _>(Method::GET, &format!("/v1/remote/points?sandbox={sb}"), None)
        .await?;
    let uploaded_bytes = s3_rec
        .as_array()
        .and_then(|v| v.iter().find(|r| r["point"] == point_id.as_str()))
        .and_then(|r| r["uploaded_bytes"].as_u64())
        .unwrap_or(0);
    let source = format!("{sb}@{point_id}");

    let (mut local_restore, mut local_fork1, mut local_fork) = (vec![], vec![], vec![]);
    // (remote, receiving host has the image)
    let mut variants: Vec<Variant> = [file_url, s3_url]
        .iter()
        .flat_map(|u| {
            [(false, false), (true, false), (true, true)].map(|(with_image, warm)| Variant {
                url: u.to_string(),
                with_image,
                warm,
                standby: false,
                bin: None,
            })
        })
        .filter(|v| v.with_image || !opts.no_bare)
        .collect();
    // A standby that followed the sandbox (S3, with the image).
    variants.push(Variant {
        url: s3_url.to_string(),
        with_image: true,
        warm: false,
        standby: true,
        bin: None,
    });
    // The build before, on the S3 hosts with the image (fresh), interleaved with this one's.
    if let Some(b) = &opts.baseline_bin {
        variants.push(Variant {
            url: s3_url.to_string(),
            with_image: true,
            warm: false,
            standby: false,
            bin: Some(b.clone()),
        });
    }
    let mut arms: Vec<Vec<ArmRun>> = vec![Vec::new(); variants.len()];
    let mut fork_arms: Vec<Vec<ArmRun>> = vec![Vec::new(); variants.len()];
    for round in 0..opts.rounds {
        // Local restore of the point, in place.
        let t = Instant::now();
        let _: Value = a
            .client
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{sb}/restore"),
                Some(&json!({ "checkpoint": point_id })),
            )
            .await?;
        local_restore.push(ms(t));
        check(&a.client, &sb, "local restore").await?;
        // Local fork of 1.
        let name = format!("{sb}-l{round}");
        let t = Instant::now();
        let forked = sbx::fork(&a.client, &sb, Some(&point_id), std::slice::from_ref(&name)).await;
        local_fork1.push(ms(t));
        forked?;
        check(&a.client, &name, "local fork").await?;
        sbx::remove(&a.client, &name).await?;
        // From each remote, on a host that never saw the point.
        for (i, v) in variants.iter().enumerate() {
            let dir = scratch.join(format!("host-b{round}-{i}"));
            let r = remote_arm(opts, v, dir, &s3.env, image, &source, 1, hosts).await?;
            arms[i].push(r);
        }
    }
    for round in 0..opts.fork_rounds {
        let names: Vec<String> =
            (0..opts.fork_count).map(|i| format!("{sb}-lf{round}-{i}")).collect();
        let t = Instant::now();
        let forked = sbx::fork(&a.client, &sb, Some(&point_id), &names).await;
        local_fork.push(ms(t));
        let checked = match forked {
            Ok(_) => {
                let mut r = Ok(());
                for n in &names {
                    r = r.and(check(&a.client, n, "local fork N").await);
                }
                r
            }
            Err(e) => Err(e),
        };
        for n in &names {
            let _ = sbx::remove(&a.client, n).await;
        }
        checked?;
        for (i, v) in variants.iter().enumerate() {
            let dir = scratch.join(format!("host-f{round}-{i}"));
            let r =
                remote_arm(opts, v, dir, &s3.env, image, &source, opts.fork_count, hosts).await?;
            fork_arms[i].push(r);
        }
    }
    let remotes: Vec<BackendReport> = variants
        .iter()
        .zip(arms.iter().zip(&fork_arms))
        .map(|(v, (c, f))| {
            let col = |rs: &[ArmRun], g: fn(&ArmRun) -> f64| {
                Summary::of(&rs.iter().map(g).collect::<Vec<_>>())
            };
            BackendReport {
                url: v.url.clone(),
                with_image: v.with_image,
                warm: v.warm,
                standby: v.standby,
                baseline: v.bin.is_some(),
                patched_from_image: c.iter().chain(f).filter(|r| r.patched).count(),
                image_hash_ms: col(&c.iter().chain(f).cloned().collect::<Vec<_>>(), |r| r.hash_ms),
                create_ms: col(c, |r| r.total_ms),
                create_fetch_ms: col(c, |r| r.fetch_ms),
                fork_ms: col(f, |r| r.total_ms),
                fork_fetch_ms: col(f, |r| r.fetch_ms),
                create_stages_ms: stage_summaries(c),
            }
        })
        .collect();
    let (lr, l1, ln) =
        (Summary::of(&local_restore), Summary::of(&local_fork1), Summary::of(&local_fork));
    let find = |img: bool, warm: bool, standby: bool, baseline: bool| {
        remotes.iter().find(|r| {
            r.url.starts_with("s3:")
                && r.with_image == img
                && r.warm == warm
                && r.standby == standby
                && r.baseline == baseline
        })
    };
    let (s3i, s3c, s3w) = (
        find(true, false, false, false),
        find(false, false, false, false),
        find(true, true, false, false),
    );
    let (s3s, s3b) = (find(true, false, true, false), find(true, false, false, true));
    Ok(RemoteRestoreReport {
        options: opts.clone(),
        point: source,
        proc_bytes,
        fs_bytes,
        uploaded_bytes,
        s3_create_vs_local_restore: s3i.map_or(f64::NAN, |r| ratio(&r.create_ms, &lr)),
        s3_create_cold_vs_local_restore: s3c.map_or(f64::NAN, |r| ratio(&r.create_ms, &lr)),
        s3_create_warm_vs_local_restore: s3w.map_or(f64::NAN, |r| ratio(&r.create_ms, &lr)),
        s3_create_vs_local_fork1: s3i.map_or(f64::NAN, |r| ratio(&r.create_ms, &l1)),
        s3_fork_vs_local_fork: s3i.map_or(f64::NAN, |r| ratio(&r.fork_ms, &ln)),
        s3_standby_create_vs_local_restore: s3s.map_or(f64::NAN, |r| ratio(&r.create_ms, &lr)),
        s3_standby_fork_vs_local_fork: s3s.map_or(f64::NAN, |r| ratio(&r.fork_ms, &ln)),
        baseline_s3_create_vs_local_restore: s3b.map_or(f64::NAN, |r| ratio(&r.create_ms, &lr)),
        baseline_s3_fork_vs_local_fork: s3b.map_or(f64::NAN, |r| ratio(&r.fork_ms, &ln)),
        local_restore_ms: lr,
        local_fork1_ms: l1,
        local_fork_ms: ln,
        remotes,
        load_before: String::new(),
        load_after: String::new(),
        others: Vec::new(),
    })
}
