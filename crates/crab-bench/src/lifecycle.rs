//! `crab bench lifecycle`: what a checkpoint, a restore and a fork cost through the daemon, on a
//! sandbox that holds real state — a Python HTTP server and a shell loop writing a counter every
//! 100 ms (the workload of the checkpoint crate's former `#[ignore]` benchmarks, now measured
//! the way a user sees it: API round trips). Per round, interleaved: an `fs` checkpoint, a
//! `full` checkpoint, an in-place restore of that full point (checked: the server answers and
//! the counter moves on). Then one fork of `fork_count` branches from the newest full point.
//! With `big_mib`, a second sandbox holding a process with that much touched memory is
//! checkpointed `full` once more (the 1 GiB case of issue 4).

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
}

impl Default for LifecycleOptions {
    fn default() -> Self {
        LifecycleOptions { image: "debian".into(), rounds: 10, fork_count: 8, big_mib: 0 }
    }
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
    let (mut fs, mut full, mut restore, mut bytes) = (vec![], vec![], vec![], vec![]);
    let mut turn = 1;
    for round in 0..opts.rounds {
        sh_ok(client, &sb, &format!("echo {round} > /root/round"), 10.0).await?;
        let t = Instant::now();
        checkpoint(client, &sb, "fs", turn, 0).await?;
        fs.push(ms(t));
        turn += 1;
        let t = Instant::now();
        let p = checkpoint(client, &sb, "full", turn, 0).await?;
        full.push(ms(t));
        bytes.push(p.size_bytes);
        turn += 1;
        let t = Instant::now();
        client
            .call::<_, serde_json::Value>(
                Method::POST,
                &format!("/v1/sandboxes/{sb}/restore"),
                Some(&serde_json::json!({ "checkpoint": p.id })),
            )
            .await?;
        restore.push(ms(t));
        sh_ok(client, &sb, CHECK, 20.0).await.map_err(|e| {
            ApiError::internal(format!("after restore {round}, the sandbox lost state: {e}"))
        })?;
    }
    let names: Vec<String> = (0..opts.fork_count).map(|i| format!("{tag}-f{i}")).collect();
    let t = Instant::now();
    let forked = client
        .call::<_, serde_json::Value>(
            Method::POST,
            &format!("/v1/sandboxes/{sb}/fork"),
            Some(&serde_json::json!({ "count": opts.fork_count, "names": names })),
        )
        .await;
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
    bytes.sort_unstable();
    Ok(LifecycleReport {
        options: opts.clone(),
        checkpoint_fs_ms: Summary::of(&fs),
        checkpoint_full_ms: Summary::of(&full),
        full_point_bytes: bytes.get(bytes.len() / 2).copied().unwrap_or(0),
        restore_ms: Summary::of(&restore),
        fork_ms,
        big_full_ms,
    })
}
