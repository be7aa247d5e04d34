//! `crab bench lifecycle`: what a checkpoint, a restore and a fork cost through the daemon, on a
//! sandbox that holds real state — a Python HTTP server and a shell loop writing a counter every
//! 100 ms (the workload of the checkpoint crate's former `#[ignore]` benchmarks, now measured
//! the way a user sees it: API round trips). Per round, interleaved: an `fs` checkpoint, a
//! `full` checkpoint, an in-place restore of that full point (checked: the server answers and
//! the counter moves on). Then one fork of `fork_count` branches from the newest full point.
//! With `big_mib`, a second sandbox holding a process with that much touched memory is
//! checkpointed `full` once more (the 1 GiB case of issue 4). With `compare_privileged`, a
//! `--privileged` twin runs the same rounds interleaved (order alternating), to measure what
//! the default security profile costs checkpoints and restores.

use std::time::Instant;

use serde::Serialize;

use crab_client::{Client, Method};
use crab_common::ApiError;

use crate::replay::sandbox::{self as sbx, checkpoint, sh_ok};
use crate::stats::Summary;

/// Options of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleOptions {
    /// Image of the sandboxes.
    pub image: String,
    /// Measured rounds.
    pub rounds: usize,
    /// Branches of the fork.
    pub fork_count: usize,
    /// Also checkpoint a process with this much memory (MiB; 0 = no).
    pub big_mib: usize,
    /// Run the rounds on a `--privileged` twin too, interleaved.
    pub compare_privileged: bool,
}

impl Default for LifecycleOptions {
    fn default() -> Self {
        LifecycleOptions {
            image: "debian".into(),
            rounds: 10,
            fork_count: 8,
            big_mib: 0,
            compare_privileged: false,
        }
    }
}

/// The rounds of the `--privileged` twin, and the default profile's ratios to them (p50).
#[derive(Debug, Clone, Serialize)]
pub struct PrivilegedRounds {
    /// `fs` checkpoints of the twin.
    pub checkpoint_fs_ms: Summary,
    /// `full` checkpoints of the twin.
    pub checkpoint_full_ms: Summary,
    /// In-place restores of the twin.
    pub restore_ms: Summary,
    /// Default-profile full checkpoint p50 / twin's.
    pub full_ratio_p50: f64,
    /// Default-profile restore p50 / twin's.
    pub restore_ratio_p50: f64,
}

/// Results of [`run`] (ms).
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleReport {
    /// The options.
    pub options: LifecycleOptions,
    /// `fs` checkpoint round trips.
    pub checkpoint_fs_ms: Summary,
    /// `full` checkpoint round trips.
    pub checkpoint_full_ms: Summary,
    /// Bytes of one `full` point (median).
    pub full_point_bytes: u64,
    /// In-place restore of a `full` point, until the API answers.
    pub restore_ms: Summary,
    /// One fork of `fork_count` branches from a `full` point.
    pub fork_ms: f64,
    /// `full` checkpoint of the `big_mib` process, when asked for.
    pub big_full_ms: Option<f64>,
    /// The `--privileged` twin's rounds, when asked for.
    pub privileged: Option<PrivilegedRounds>,
}

/// What the rounds of one sandbox measured (ms, bytes).
#[derive(Default)]
struct Rounds {
    fs: Vec<f64>,
    full: Vec<f64>,
    restore: Vec<f64>,
    bytes: Vec<u64>,
}

/// One round on `sb`: an `fs` checkpoint, a `full` one, an in-place restore of it, checked.
async fn round(
    client: &Client,
    sb: &str,
    round: usize,
    turn: &mut usize,
    r: &mut Rounds,
) -> Result<(), ApiError> {
    sh_ok(client, sb, &format!("echo {round} > /root/round"), 10.0).await?;
    let t = Instant::now();
    checkpoint(client, sb, "fs", *turn, 0).await?;
    r.fs.push(ms(t));
    *turn += 1;
    let t = Instant::now();
    let p = checkpoint(client, sb, "full", *turn, 0).await?;
    r.full.push(ms(t));
    r.bytes.push(p.size_bytes);
    *turn += 1;
    let t = Instant::now();
    client
        .call::<_, serde_json::Value>(
            Method::POST,
            &format!("/v1/sandboxes/{sb}/restore"),
            Some(&serde_json::json!({ "checkpoint": p.id })),
        )
        .await?;
    r.restore.push(ms(t));
    sh_ok(client, sb, CHECK, 20.0).await.map_err(|e| {
        ApiError::internal(format!("after restore {round} of {sb}, the sandbox lost state: {e}"))
    })?;
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

const SERVICES: &str = "cd /tmp && setsid python3 -m http.server 8000 --bind 127.0.0.1 </dev/null >/dev/null 2>&1 & \
     setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/loop; sleep 0.1; done' </dev/null >/dev/null 2>&1 & \
     for i in $(seq 100); do python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:8000/\")' 2>/dev/null && exit 0; sleep 0.1; done; exit 1";

const CHECK: &str = "python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:8000/\")' && a=$(cat /tmp/loop) && sleep 0.3 && b=$(cat /tmp/loop) && [ \"$b\" -gt \"$a\" ]";

/// Run the benchmark. Sandboxes it creates are removed, pass or fail.
pub async fn run(client: &Client, opts: &LifecycleOptions) -> Result<LifecycleReport, ApiError> {
    let tag = format!("bench-life-{}", std::process::id());
    let mut made: Vec<String> = Vec::new();
    let result = measure(client, opts, &tag, &mut made).await;
    for name in made {
        if let Err(e) = sbx::remove(client, &name).await {
            tracing::warn!(sandbox = name, error = %e, "could not remove a bench sandbox");
        }
    }
    result
}

async fn measure(
    client: &Client,
    opts: &LifecycleOptions,
    tag: &str,
    made: &mut Vec<String>,
) -> Result<LifecycleReport, ApiError> {
    if opts.rounds == 0 || opts.fork_count == 0 {
        return Err(ApiError::invalid("rounds and fork count must be ≥ 1", "--rounds 10 --fork 8"));
    }
    let sb = format!("{tag}-srv");
    sbx::create(client, &opts.image, &sb).await?;
    made.push(sb.clone());
    sh_ok(client, &sb, SERVICES, 30.0).await?;
    let twin = if opts.compare_privileged {
        let p = format!("{tag}-priv");
        sbx::create_with(client, &opts.image, &p, None, true).await?;
        made.push(p.clone());
        sh_ok(client, &p, SERVICES, 30.0).await?;
        Some(p)
    } else {
        None
    };
    let (mut main, mut other) = (Rounds::default(), Rounds::default());
    let (mut turn, mut twin_turn) = (1usize, 1usize);
    for i in 0..opts.rounds {
        let twin_first = i % 2 == 1;
        if let (Some(p), true) = (&twin, twin_first) {
            round(client, p, i, &mut twin_turn, &mut other).await?;
        }
        round(client, &sb, i, &mut turn, &mut main).await?;
        if let (Some(p), false) = (&twin, twin_first) {
            round(client, p, i, &mut twin_turn, &mut other).await?;
        }
    }
    let names: Vec<String> = (0..opts.fork_count).map(|i| format!("{tag}-f{i}")).collect();
    let t = Instant::now();
    let forked = sbx::fork(client, &sb, None, &names).await;
    let fork_ms = ms(t);
    // Whatever the answer, remove every branch that exists.
    made.extend(names.iter().cloned());
    forked?;
    for n in &names {
        sh_ok(client, n, CHECK, 20.0)
            .await
            .map_err(|e| ApiError::internal(format!("fork branch {n} lost state: {e}")))?;
    }
    let big_full_ms = if opts.big_mib > 0 {
        let big = format!("{tag}-big");
        sbx::create(client, &opts.image, &big).await?;
        made.push(big.clone());
        let script = format!(
            "setsid python3 -c 'import time; b=bytearray({} * 1048576); [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; open(\"/tmp/ready\",\"w\").close(); time.sleep(1e6)' </dev/null >/dev/null 2>&1 & \
             for i in $(seq 600); do [ -e /tmp/ready ] && exit 0; sleep 0.1; done; exit 1",
            opts.big_mib
        );
        sh_ok(client, &big, &script, 90.0).await?;
        let t = Instant::now();
        checkpoint(client, &big, "full", 1, 0).await?;
        Some(ms(t))
    } else {
        None
    };
    main.bytes.sort_unstable();
    let (full, restore) = (Summary::of(&main.full), Summary::of(&main.restore));
    let privileged = twin.map(|_| {
        let (pf, pr) = (Summary::of(&other.full), Summary::of(&other.restore));
        PrivilegedRounds {
            checkpoint_fs_ms: Summary::of(&other.fs),
            full_ratio_p50: full.p50 / pf.p50,
            restore_ratio_p50: restore.p50 / pr.p50,
            checkpoint_full_ms: pf,
            restore_ms: pr,
        }
    });
    Ok(LifecycleReport {
        options: opts.clone(),
        checkpoint_fs_ms: Summary::of(&main.fs),
        checkpoint_full_ms: full,
        full_point_bytes: main.bytes.get(main.bytes.len() / 2).copied().unwrap_or(0),
        restore_ms: restore,
        fork_ms,
        big_full_ms,
        privileged,
    })
}
