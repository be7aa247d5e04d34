//! Foundation benchmarks (issue "Foundation"): sandbox create latency, and `crab exec true`
//! against running `true` on the host, interleaved in one run.

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
) -> Result<FoundationReport, ApiError> {
    let mut create = Vec::with_capacity(creates);
    let mut made: Vec<String> = Vec::new();
    let result = async {
        for i in 0..creates {
            let req = SandboxCreateRequest {
                image: image.to_string(),
                name: Some(format!("bench-create-{}-{i}", std::process::id())),
                net: Default::default(),
                limits: Default::default(),
            };
            let t = Instant::now();
            let s: SandboxInfo = client.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
            create.push(ms(t));
            made.push(s.name);
        }
        let sb =
            made.first().cloned().ok_or_else(|| ApiError::invalid("creates must be ≥ 1", ""))?;
        let (mut exec, mut host) = (Vec::new(), Vec::new());
        for _ in 0..execs {
            let t = Instant::now();
            let st = Command::new(crab_exe)
                .arg("--state-dir")
                .arg(state_dir)
                .args(["exec", &sb, "--", "true"])
                .stdin(Stdio::null())
                .status()
                .map_err(|e| ApiError::internal(format!("running {}: {e}", crab_exe.display())))?;
            exec.push(ms(t));
            if !st.success() {
                return Err(ApiError::internal(format!("crab exec true failed: {st}")));
            }
            let t = Instant::now();
            Command::new("true")
                .stdin(Stdio::null())
                .status()
                .map_err(|e| ApiError::internal(format!("running true: {e}")))?;
            host.push(ms(t));
        }
        let (e, h) = (Summary::of(&exec), Summary::of(&host));
        Ok(FoundationReport {
            create_ms: Summary::of(&create),
            exec_overhead_p50_ms: e.p50 - h.p50,
            exec_true_ms: e,
            host_true_ms: h,
        })
    }
    .await;
    for name in made {
        let _: Result<serde_json::Value, _> = client
            .call::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{name}?force=true"), None)
            .await;
    }
    result
}
