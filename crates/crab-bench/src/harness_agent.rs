//! `crab bench harness-agent`: the verdict mix of an agent that runs *inside* its sandbox, with
//! and without harness exclusion (`--harness-cmd`), side by side on the same commands.
//!
//! A scripted stand-in for mini-swe-agent run inside the sandbox (agents.md): a Python process
//! (`/opt/agent/agent.py`) that keeps its conversation in memory — every command and its
//! output, the whole history re-serialized each turn as an agent sends it to its LLM — and runs
//! each command of a real trajectory in a fresh `bash -c`, as mini-swe-agent's local
//! environment does. The driver marks each turn boundary with `POST .../turns` (what Crab's
//! proxy does at the agent's LLM request; the sandbox's policy is `auto`), then hands the agent
//! its next command through its exec session's stdin and waits for the agent's answer line.
//! Two sandboxes per trajectory run the same turns interleaved: one declares the agent as its
//! harness (`^python3 /opt/agent/agent\.py`), one does not.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde::Serialize;
use serde_json::{json, Value};

use crab_client::Client;
use crab_common::api::{ExecFrame, HarnessSpec, SandboxCreateRequest, SandboxInfo};
use crab_common::ApiError;

use crate::replay::report::Counts;
use crate::replay::{agent, sandbox, trace};

/// The in-sandbox agent.
const AGENT: &str = r#"
import json, subprocess, sys
history = []
for line in sys.stdin:
    cmd = json.loads(line)["cmd"]
    p = subprocess.run(["bash", "-c", cmd], cwd="/root", stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = p.stdout.decode("utf-8", "replace")
    history.append({"role": "assistant", "content": cmd})
    history.append({"role": "tool", "content": out[-10000:]})
    request = json.dumps({"model": "m", "messages": history})
    sys.stdout.write(json.dumps({"rc": p.returncode, "request_bytes": len(request)}) + "\n")
    sys.stdout.flush()
"#;

/// The harness pattern of the arm that declares the agent.
pub const AGENT_HARNESS: &str = r"^python3 /opt/agent/agent\.py$";

/// Options.
#[derive(Debug, Clone)]
pub struct HarnessAgentOptions {
    /// Trajectory files or folders.
    pub traces: Vec<PathBuf>,
    /// At most this many trajectories (0 = all).
    pub limit: usize,
    /// At most this many turns per trajectory (0 = all).
    pub max_turns: usize,
    /// Image.
    pub image: String,
}

/// One arm's verdicts on one trajectory.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ArmRun {
    /// Checkpoints by kind (restore points of the sandbox, the first base included).
    pub checkpoints: Counts,
    /// Bytes of its restore points (each point's `size_bytes`, summed).
    pub bytes: u64,
}

/// One trajectory, both arms.
#[derive(Debug, Clone, Serialize)]
pub struct TrajectoryRun {
    /// Trajectory id.
    pub trajectory: String,
    /// Turns run.
    pub turns: usize,
    /// The agent declared as harness.
    pub excluded: ArmRun,
    /// The agent not declared.
    pub included: ArmRun,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct HarnessAgentReport {
    /// Per trajectory.
    pub runs: Vec<TrajectoryRun>,
    /// Sums, agent declared as harness.
    pub excluded: Counts,
    /// Sums, agent not declared.
    pub included: Counts,
    /// Wall time, s.
    pub wall_s: f64,
}

async fn create(client: &Client, image: &str, name: &str, harness: bool) -> Result<(), ApiError> {
    let req = SandboxCreateRequest {
        name: Some(name.to_string()),
        checkpoint_policy: Some("auto".into()),
        harness: HarnessSpec {
            cmd: if harness { vec![AGENT_HARNESS.into()] } else { Vec::new() },
            paths: Vec::new(),
        },
        ..SandboxCreateRequest::new(image)
    };
    let _: SandboxInfo = client.call(hyper::Method::POST, "/v1/sandboxes", Some(&req)).await?;
    Ok(())
}

/// A sandbox with the agent running in it, and the stream of the agent's answers.
struct Arm {
    name: String,
    session: agent::Session,
    pending: Vec<u8>,
}

async fn start(client: &Client, image: &str, name: &str, harness: bool) -> Result<Arm, ApiError> {
    create(client, image, name, harness).await?;
    let q = crab_common::files::FilesQuery {
        path: Some("/opt/agent/agent.py".into()),
        ..Default::default()
    };
    client.file_write(name, &q, AGENT.as_bytes().to_vec()).await?;
    let mut req = sandbox::exec_request(
        vec!["bash".into(), "-c".into(), "(exec setsid python3 /opt/agent/agent.py) <&0 &".into()],
        Some("/root"),
        None,
    );
    req.stdin_session = Some("agent".into());
    let body = serde_json::to_value(&req)
        .map_err(|e| ApiError::internal(format!("encoding the agent's exec: {e}")))?;
    let session = agent::follow(client, format!("/v1/sandboxes/{name}/exec"), body);
    Ok(Arm { name: name.to_string(), session, pending: Vec::new() })
}

impl Arm {
    /// Hand the agent `cmd` and wait for its answer line.
    async fn step(&mut self, client: &Client, cmd: &str) -> Result<Value, ApiError> {
        let line = format!("{}\n", json!({ "cmd": cmd }));
        let mut tries = 0;
        loop {
            match agent::write_session_stdin(client, &self.name, "agent", line.as_bytes()).await {
                Ok(()) => break,
                Err(e) if tries < 50 && e.message.contains("no open exec session") => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e),
            }
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(150);
        loop {
            if let Some(nl) = self.pending.iter().position(|b| *b == b'\n') {
                let l: Vec<u8> = self.pending.drain(..=nl).collect();
                return serde_json::from_slice(&l)
                    .map_err(|e| ApiError::internal(format!("the agent answered {l:?}: {e}")));
            }
            match tokio::time::timeout_at(deadline, self.session.frames.recv()).await {
                Err(_) => return Err(ApiError::internal("the agent did not answer in 150 s")),
                Ok(Some(ExecFrame::Stdout { d })) => {
                    self.pending.extend(b64.decode(d).unwrap_or_default())
                }
                Ok(Some(ExecFrame::Stderr { d })) => tracing::debug!(
                    stderr = %String::from_utf8_lossy(&b64.decode(d).unwrap_or_default()),
                    "agent"
                ),
                Ok(other) => {
                    return Err(ApiError::internal(format!(
                        "the agent in {} ended: {other:?}",
                        self.name
                    )))
                }
            }
        }
    }

    async fn turn(&self, client: &Client) -> Result<(), ApiError> {
        let _: Value = client
            .call::<(), _>(hyper::Method::POST, &format!("/v1/sandboxes/{}/turns", self.name), None)
            .await?;
        Ok(())
    }

    async fn result(&self, client: &Client) -> Result<ArmRun, ApiError> {
        let mut r = ArmRun::default();
        for p in sandbox::list_checkpoints(client, &self.name).await? {
            if r.checkpoints.add(&p.kind) {
                r.bytes += p.size_bytes;
            }
        }
        Ok(r)
    }
}

/// Run the benchmark.
pub async fn run(
    client: &Client,
    opts: &HarnessAgentOptions,
) -> Result<HarnessAgentReport, ApiError> {
    let started = Instant::now();
    let trajs = trace::load_all(&opts.traces, opts.limit)
        .map_err(|e| ApiError::invalid(e.to_string(), "give trajectory files or folders"))?;
    let tag = format!("{:06x}", crab_common::clock::now_ms() & 0xff_ffff);
    let mut runs = Vec::new();
    let (mut excluded, mut included) = (Counts::default(), Counts::default());
    for (i, t) in trajs.iter().enumerate() {
        let names = [format!("ha-{tag}-{i}-on"), format!("ha-{tag}-{i}-off")];
        let res = async {
            let mut on = start(client, &opts.image, &names[0], true).await?;
            let mut off = start(client, &opts.image, &names[1], false).await?;
            let steps: Vec<_> = t
                .steps
                .iter()
                .take(if opts.max_turns == 0 { usize::MAX } else { opts.max_turns })
                .collect();
            for s in &steps {
                for a in [&mut on, &mut off] {
                    // The agent's LLM request is the turn boundary; then it runs the answer.
                    a.turn(client).await?;
                    a.step(client, &s.action).await?;
                }
            }
            for a in [&on, &off] {
                a.turn(client).await?;
            }
            Ok::<_, ApiError>(TrajectoryRun {
                trajectory: t.id.clone(),
                turns: steps.len(),
                excluded: on.result(client).await?,
                included: off.result(client).await?,
            })
        }
        .await;
        for n in &names {
            let _ = sandbox::remove(client, n).await;
        }
        let r = res?;
        excluded.merge(&r.excluded.checkpoints);
        included.merge(&r.included.checkpoints);
        runs.push(r);
    }
    Ok(HarnessAgentReport { runs, excluded, included, wall_s: started.elapsed().as_secs_f64() })
}
