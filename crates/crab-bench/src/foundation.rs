//! Foundation benchmarks (issue "Foundation"): sandbox create latency, and `crab exec true`
//! against running `true` on the host, interleaved in one run. With `compare_privileged`, the
//! same loops also create and exec in `--privileged` sandboxes (no security profile),
//! interleaved, to measure what the default profile costs.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::Serialize;

use crab_client::{Client, Method};
use crab_common::api::{SandboxCreateRequest, SandboxInfo};
use crab_common::ApiError;

use crate::stats::Summary;

/// Results of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct FoundationReport {
    /// `POST /v1/sandboxes` round trips (snapshot + cgroup + namespaces + init), ms.
    pub create_ms: Summary,
    /// `crab exec SB -- true` as a whole CLI invocation, ms.
    pub exec_true_ms: Summary,
    /// `true` spawned directly on the host, ms (same loop, interleaved).
    pub host_true_ms: Summary,
    /// `exec_true_ms.p50 - host_true_ms.p50`.
    pub exec_overhead_p50_ms: f64,
    /// The same in `--privileged` sandboxes, when asked for.
    pub privileged: Option<PrivilegedComparison>,
}

/// Default profile vs `--privileged`, measured interleaved in the same run.
#[derive(Debug, Clone, Serialize)]
pub struct PrivilegedComparison {
    /// Creates of privileged sandboxes, ms.
    pub create_ms: Summary,
    /// `crab exec true` in a privileged sandbox, ms.
    pub exec_true_ms: Summary,
    /// Default-profile create p50 / privileged create p50.
    pub create_ratio_p50: f64,
    /// Default-profile exec p50 - privileged exec p50, ms.
    pub exec_delta_p50_ms: f64,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Run the benchmark: `creates` sandbox creations, `execs` exec/host pairs.
pub async fn run(
    client: &Client,
    crab_exe: &Path,
    state_dir: &Path,
    image: &str,
    creates: usize,
    execs: usize,
    compare_privileged: bool,
) -> Result<FoundationReport, ApiError> {
    let mut create = Vec::with_capacity(creates);
    let mut create_priv = Vec::with_capacity(creates);
    let mut made: Vec<String> = Vec::new();
    let mut made_priv: Vec<String> = Vec::new();
    let result = async {
        for i in 0..creates {
            let kinds: &[bool] = if compare_privileged { &[false, true] } else { &[false] };
            for &privileged in kinds {
                let tag = if privileged { "p" } else { "d" };
                let req = SandboxCreateRequest {
                    image: image.to_string(),
                    name: Some(format!("bench-create-{}-{tag}{i}", std::process::id())),
                    net: Default::default(),
                    nat_range: None,
                    limits: Default::default(),
                    privileged,
                    checkpoint_policy: None,
                };
                let t = Instant::now();
                let s: SandboxInfo = client.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
                if privileged {
                    create_priv.push(ms(t));
                    made_priv.push(s.name);
                } else {
                    create.push(ms(t));
                    made.push(s.name);
                }
            }
        }
        let sb =
            made.first().cloned().ok_or_else(|| ApiError::invalid("creates must be ≥ 1", ""))?;
        let exec_true = |sb: &str| -> Result<f64, ApiError> {
            let t = Instant::now();
            let st = Command::new(crab_exe)
                .arg("--state-dir")
                .arg(state_dir)
                .args(["exec", sb, "--", "true"])
                .stdin(Stdio::null())
                .status()
                .map_err(|e| ApiError::internal(format!("running {}: {e}", crab_exe.display())))?;
            let took = ms(t);
            if !st.success() {
                return Err(ApiError::internal(format!("crab exec true failed: {st}")));
            }
            Ok(took)
        };
        let (mut exec, mut exec_priv, mut host) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..execs {
            exec.push(exec_true(&sb)?);
            if let Some(p) = made_priv.first() {
                exec_priv.push(exec_true(p)?);
            }
            let t = Instant::now();
            Command::new("true")
                .stdin(Stdio::null())
                .status()
                .map_err(|e| ApiError::internal(format!("running true: {e}")))?;
            host.push(ms(t));
        }
        let (e, h) = (Summary::of(&exec), Summary::of(&host));
        let c = Summary::of(&create);
        let privileged = compare_privileged.then(|| {
            let (pc, pe) = (Summary::of(&create_priv), Summary::of(&exec_priv));
            PrivilegedComparison {
                create_ratio_p50: c.p50 / pc.p50,
                exec_delta_p50_ms: e.p50 - pe.p50,
                create_ms: pc,
                exec_true_ms: pe,
            }
        });
        Ok(FoundationReport {
            create_ms: c,
            exec_overhead_p50_ms: e.p50 - h.p50,
            exec_true_ms: e,
            host_true_ms: h,
            privileged,
        })
    }
    .await;
    for name in made.into_iter().chain(made_priv) {
        let _: Result<serde_json::Value, _> = client
            .call::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{name}?force=true"), None)
            .await;
    }
    result
}
