//! Foundation benchmarks (issue "Foundation"): sandbox create latency, and `crab exec true`
//! against running `true` on the host, interleaved in one run. With `compare_privileged`, the
//! same loops also create and exec in `--privileged` sandboxes (no security profile),
//! interleaved, to measure what the default profile costs. With a `gap`, every create and exec
//! waits that long first, as an agent's commands do (seconds apart); with a favordynmods
//! switch, each create and exec is also measured with cgroup2's `favordynmods` off,
//! interleaved with the "on" ones (the switch is restored afterwards).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    /// The pause before each create and exec, ms.
    pub gap_ms: u64,
    /// Creates and execs with cgroup2's `favordynmods` off (the main figures had it on),
    /// when asked for.
    pub favordynmods_off: Option<FavordynmodsComparison>,
}

/// cgroup2 `favordynmods` on (the main figures) vs off, interleaved in the same run.
#[derive(Debug, Clone, Serialize)]
pub struct FavordynmodsComparison {
    /// Creates with it off, ms.
    pub create_ms: Summary,
    /// `crab exec true` with it off, ms.
    pub exec_true_ms: Summary,
    /// Off create p50 / on create p50.
    pub create_ratio_p50: f64,
    /// Off exec p50 - on exec p50, ms.
    pub exec_delta_p50_ms: f64,
}

/// Turns cgroup2's `favordynmods` on or off (the CLI passes the runtime's switch).
pub type FavordynmodsSwitch<'a> = &'a (dyn Fn(bool) -> Result<(), String> + Sync);

/// What [`run`] measures.
pub struct FoundationOptions<'a> {
    /// Image to create from.
    pub image: &'a str,
    /// Sandbox creations (per arm).
    pub creates: usize,
    /// exec/host pairs (per arm).
    pub execs: usize,
    /// Also measure `--privileged` sandboxes.
    pub compare_privileged: bool,
    /// Pause before each create and exec.
    pub gap: Duration,
    /// Also measure with `favordynmods` off, through this switch.
    pub favordynmods: Option<FavordynmodsSwitch<'a>>,
}

impl std::fmt::Debug for FoundationOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FoundationOptions")
            .field("image", &self.image)
            .field("creates", &self.creates)
            .field("execs", &self.execs)
            .field("compare_privileged", &self.compare_privileged)
            .field("gap", &self.gap)
            .field("favordynmods", &self.favordynmods.is_some())
            .finish()
    }
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

/// Run the benchmark.
pub async fn run(
    client: &Client,
    crab_exe: &Path,
    state_dir: &Path,
    o: &FoundationOptions<'_>,
) -> Result<FoundationReport, ApiError> {
    let (image, creates, execs, compare_privileged) =
        (o.image, o.creates, o.execs, o.compare_privileged);
    let switch = |on: bool| -> Result<(), ApiError> {
        match o.favordynmods {
            Some(f) => f(on).map_err(|e| ApiError::internal(format!("favordynmods switch: {e}"))),
            None => Ok(()),
        }
    };
    // Arms of one iteration: (privileged, favordynmods on), alternating the order.
    let arms = |i: usize| -> Vec<(bool, bool)> {
        let mut v = vec![(false, true)];
        if compare_privileged {
            v.push((true, true));
        }
        if o.favordynmods.is_some() {
            v.push((false, false));
        }
        if i % 2 == 1 {
            v.reverse();
        }
        v
    };
    let mut create_off = Vec::new();
    let mut exec_off = Vec::new();
    let mut create = Vec::with_capacity(creates);
    let mut create_priv = Vec::with_capacity(creates);
    let mut made: Vec<String> = Vec::new();
    let mut made_priv: Vec<String> = Vec::new();
    let result = async {
        for i in 0..creates {
            for (privileged, on) in arms(i) {
                switch(on)?;
                let tag = match (privileged, on) {
                    (true, _) => "p",
                    (false, true) => "d",
                    (false, false) => "o",
                };
                let req = SandboxCreateRequest {
                    name: Some(format!("bench-create-{}-{tag}{i}", std::process::id())),
                    privileged,
                    ..SandboxCreateRequest::new(image)
                };
                tokio::time::sleep(o.gap).await;
                let t = Instant::now();
                let s: SandboxInfo = client.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
                let took = ms(t);
                if privileged {
                    create_priv.push(took);
                    made_priv.push(s.name);
                } else if on {
                    create.push(took);
                    made.push(s.name);
                } else {
                    create_off.push(took);
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
        for i in 0..execs {
            for (privileged, on) in arms(i) {
                switch(on)?;
                tokio::time::sleep(o.gap).await;
                match (privileged, on) {
                    (true, _) => {
                        if let Some(p) = made_priv.first() {
                            exec_priv.push(exec_true(p)?);
                        }
                    }
                    (false, true) => exec.push(exec_true(&sb)?),
                    (false, false) => exec_off.push(exec_true(&sb)?),
                }
            }
            switch(true)?;
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
        let favordynmods_off = o.favordynmods.is_some().then(|| {
            let (oc, oe) = (Summary::of(&create_off), Summary::of(&exec_off));
            FavordynmodsComparison {
                create_ratio_p50: oc.p50 / c.p50,
                exec_delta_p50_ms: oe.p50 - e.p50,
                create_ms: oc,
                exec_true_ms: oe,
            }
        });
        Ok(FoundationReport {
            gap_ms: o.gap.as_millis() as u64,
            favordynmods_off,
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
