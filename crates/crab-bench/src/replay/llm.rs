//! The replay LLM: an OpenAI-compatible chat-completions server (in-process, tokio + hyper) that
//! answers each request with the trajectory's next action as a `bash` tool call, after that
//! turn's latency.
//!
//! Which trajectory a request belongs to comes from the run key the agent sends as the request's
//! `user` field (or the `x-crab-replay-run` header; both pass through Crab's proxy untouched);
//! which turn it is comes from the conversation: the number of `assistant` messages already in
//! it. So a run that starts over (method `restart`) or rolls its conversation back (a restore)
//! gets the right action without the server keeping per-run state. The answer carries the time
//! the server itself spent (`x-replay-llm-ms`), which lets the agent tell the LLM's wait from the
//! time it waited on anything else (Crab's exposed latency).
//!
//! The server listens on a fixed address (default `127.0.0.1:7439`) so that the daemon can be
//! started with `--upstream-openai http://127.0.0.1:7439`. It also holds the small HTTP client
//! the agent uses to reach it (directly or through the proxy).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::{json, Value};

use crab_common::{ApiError, ErrorCode};

use super::rng::Rng;
use super::trace::Trajectory;

/// Default listen address of the replay LLM.
pub const DEFAULT_LLM_ADDR: &str = "127.0.0.1:7439";

/// Median LLM latency of the recorded mini-swe-agent runs, used when no trajectory loaded has
/// any recorded latency to draw from.
pub const FALLBACK_LATENCY_S: f64 = 4.6;

/// How long the replay LLM takes per turn (`--llm-latency`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "mode", content = "value", rename_all = "lowercase")]
pub enum LlmLatency {
    /// The recorded `llm_latency_s`; missing values drawn from the recorded distribution.
    Recorded,
    /// This many seconds every turn.
    Fixed(f64),
    /// The recorded (or drawn) latency times this factor.
    Scale(f64),
}

impl FromStr for LlmLatency {
    type Err = ApiError;
    fn from_str(s: &str) -> Result<Self, ApiError> {
        let bad = || {
            ApiError::invalid(
                format!("bad --llm-latency {s:?}"),
                "use recorded, fixed:SECONDS or scale:FACTOR (e.g. scale:0.05)",
            )
        };
        let num = |v: &str| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
        match s.split_once(':') {
            None if s == "recorded" => Ok(LlmLatency::Recorded),
            Some(("fixed", v)) => num(v).map(LlmLatency::Fixed).ok_or_else(bad),
            Some(("scale", v)) => num(v).map(LlmLatency::Scale).ok_or_else(bad),
            _ => Err(bad()),
        }
    }
}

/// What the replay LLM answers for one trajectory: the actions and each turn's latency.
#[derive(Debug, Clone)]
pub struct Script {
    /// Action of each turn.
    pub actions: Vec<String>,
    /// Latency of each turn.
    pub latency: Vec<Duration>,
}

/// Every recorded latency (seconds) of the loaded trajectories: the distribution missing values
/// are drawn from.
pub fn latency_pool(trajs: &[Trajectory]) -> Vec<f64> {
    trajs
        .iter()
        .flat_map(|t| t.steps.iter().filter_map(|s| s.llm_latency_s))
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect()
}

/// The script of `traj`: its actions, and latencies per `mode` (missing ones drawn from `pool`
/// with a generator seeded by `seed` and the trajectory id, so every method sees the same).
pub fn script(traj: &Trajectory, mode: LlmLatency, pool: &[f64], seed: u64) -> Script {
    let mut rng = Rng::new(seed, &traj.id);
    let mut latency = Vec::with_capacity(traj.steps.len());
    for s in &traj.steps {
        let drawn = if pool.is_empty() { FALLBACK_LATENCY_S } else { pool[rng.below(pool.len())] };
        let rec = s.llm_latency_s.filter(|x| x.is_finite() && *x >= 0.0).unwrap_or(drawn);
        let secs = match mode {
            LlmLatency::Recorded => rec,
            LlmLatency::Fixed(v) => v,
            LlmLatency::Scale(f) => rec * f,
        };
        latency.push(Duration::from_secs_f64(secs.clamp(0.0, 3600.0)));
    }
    Script { actions: traj.steps.iter().map(|s| s.action.clone()).collect(), latency }
}

type Runs = Arc<Mutex<HashMap<String, Arc<Script>>>>;

/// The running replay LLM. Dropping it stops the server.
#[derive(Debug)]
pub struct ReplayLlm {
    addr: SocketAddr,
    runs: Runs,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReplayLlm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ReplayLlm {
    /// Listen on `addr` and serve until dropped.
    pub async fn start(addr: SocketAddr) -> Result<ReplayLlm, ApiError> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            ApiError::new(
                ErrorCode::Conflict,
                format!("the replay LLM cannot listen on {addr}: {e}"),
                "another replay may be running; pass another --llm-listen address (and start the daemon with --upstream-openai pointing at it)",
            )
        })?;
        let addr = listener.local_addr().map_err(|e| ApiError::internal(e.to_string()))?;
        let runs: Runs = Arc::default();
        let served = runs.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let runs = served.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(runs.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(ReplayLlm { addr, runs, task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL (`http://host:port/v1`) for direct access.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Answer requests with run key `run` from `script`.
    pub fn register(&self, run: &str, script: Arc<Script>) {
        if let Ok(mut m) = self.runs.lock() {
            m.insert(run.to_string(), script);
        }
    }

    /// Forget run `run`.
    pub fn unregister(&self, run: &str) {
        if let Ok(mut m) = self.runs.lock() {
            m.remove(run);
        }
    }
}

fn json_response(status: StatusCode, body: &Value, llm_ms: f64) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = hyper::header::HeaderValue::from_str(&format!("{llm_ms:.3}")) {
        h.insert("x-replay-llm-ms", v);
    }
    r
}

fn openai_error(status: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    json_response(status, &json!({"error": {"message": msg, "type": "invalid_request_error"}}), 0.0)
}

async fn handle(runs: Runs, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let t0 = Instant::now();
    if req.method() != hyper::Method::POST || !req.uri().path().ends_with("/chat/completions") {
        return Ok(openai_error(
            StatusCode::NOT_FOUND,
            "the replay LLM serves POST /v1/chat/completions only",
        ));
    }
    let header_run =
        req.headers().get("x-crab-replay-run").and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(openai_error(StatusCode::BAD_REQUEST, &format!("reading body: {e}"))),
    };
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return Ok(openai_error(StatusCode::BAD_REQUEST, &format!("body is not JSON: {e}")))
        }
    };
    let run = body.get("user").and_then(|u| u.as_str()).map(str::to_string).or(header_run);
    let Some(run) = run else {
        return Ok(openai_error(
            StatusCode::BAD_REQUEST,
            "no run key: set `user` or x-crab-replay-run",
        ));
    };
    let script = runs.lock().ok().and_then(|m| m.get(&run).cloned());
    let Some(script) = script else {
        return Ok(openai_error(StatusCode::NOT_FOUND, &format!("unknown replay run {run:?}")));
    };
    let turn = body
        .get("messages")
        .and_then(|m| m.as_array())
        .map(|m| {
            m.iter().filter(|x| x.get("role").and_then(|r| r.as_str()) == Some("assistant")).count()
        })
        .unwrap_or(0);
    if let Some(d) = script.latency.get(turn) {
        tokio::time::sleep(*d).await;
    }
    let message = match script.actions.get(turn) {
        Some(action) => json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": format!("call_{turn}"),
                "type": "function",
                "function": {"name": "bash", "arguments": json!({"command": action}).to_string()},
            }],
        }),
        None => json!({"role": "assistant", "content": "The trajectory is complete."}),
    };
    let finish = if turn < script.actions.len() { "tool_calls" } else { "stop" };
    let answer = json!({
        "id": format!("replay-{run}-{turn}"),
        "object": "chat.completion",
        "created": 0,
        "model": "crab-replay",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    });
    Ok(json_response(StatusCode::OK, &answer, t0.elapsed().as_secs_f64() * 1e3))
}

/// An answer of [`post_json`].
#[derive(Debug)]
pub struct HttpAnswer {
    /// Status code.
    pub status: u16,
    /// Value of `x-replay-llm-ms`, when present.
    pub llm_ms: Option<f64>,
    /// Crab's proxy's breakdown of the time it added (`x-crab-held`), when present.
    pub held: Option<crab_common::stats::Breakdown>,
    /// Body.
    pub body: Bytes,
    /// When the answer's head arrived (its body was read after).
    pub head: std::time::Instant,
}

/// POST a JSON body to an `http://host:port/path` URL (one connection per request).
pub async fn post_json(
    url: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<HttpAnswer, ApiError> {
    let upstream = |m: String| {
        ApiError::new(ErrorCode::Upstream, m, "is the replay LLM (or the proxy) listening?")
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| ApiError::invalid(format!("only http:// URLs are supported: {url}"), ""))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let stream = tokio::net::TcpStream::connect(hostport)
        .await
        .map_err(|e| upstream(format!("connecting to {hostport}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| upstream(format!("HTTP handshake with {hostport}: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut b = Request::builder()
        .method(hyper::Method::POST)
        .uri(path)
        .header("host", hostport)
        .header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| ApiError::internal(format!("building request to {url}: {e}")))?;
    let resp = send.send_request(req).await.map_err(|e| upstream(format!("POST {url}: {e}")))?;
    let head = std::time::Instant::now();
    let status = resp.status().as_u16();
    let llm_ms = resp
        .headers()
        .get("x-replay-llm-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let held = resp
        .headers()
        .get(crab_coordinator::HELD_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(crab_common::stats::parse_breakdown);
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| upstream(format!("reading answer of {url}: {e}")))?
        .to_bytes();
    Ok(HttpAnswer { status, llm_ms, held, body, head })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::{Family, Step, TraceSource};

    fn traj() -> Trajectory {
        let step = |turn: u32, action: &str, lat: Option<f64>| Step {
            turn,
            call: 0,
            kind: "shell".into(),
            action: action.into(),
            thought_chars: None,
            observation_chars: None,
            llm_latency_s: lat,
            exec_s: None,
            returncode: None,
            shell_state: false,
        };
        Trajectory {
            id: "t".into(),
            path: "t.jsonl".into(),
            family: Family::Project,
            steps: vec![step(0, "echo a", None), step(1, "echo \"b\"", Some(0.2))],
            shell_state: false,
            source: TraceSource { repo: "project".into(), commit: None },
        }
    }

    #[test]
    fn latency_modes() {
        assert_eq!("recorded".parse::<LlmLatency>().unwrap(), LlmLatency::Recorded);
        assert_eq!("fixed:0.5".parse::<LlmLatency>().unwrap(), LlmLatency::Fixed(0.5));
        assert_eq!("scale:0.05".parse::<LlmLatency>().unwrap(), LlmLatency::Scale(0.05));
        assert!("scale:-1".parse::<LlmLatency>().is_err());
        assert!("fast".parse::<LlmLatency>().is_err());
        let t = traj();
        let s = script(&t, LlmLatency::Recorded, &[1.0], 3);
        assert_eq!(s.latency, vec![Duration::from_secs(1), Duration::from_millis(200)]);
        let s = script(&t, LlmLatency::Scale(0.5), &[], 3);
        assert_eq!(s.latency[0], Duration::from_secs_f64(FALLBACK_LATENCY_S * 0.5));
        assert_eq!(s.latency[1], Duration::from_millis(100));
    }

    #[tokio::test]
    async fn serves_tool_calls_by_conversation_length() {
        let llm = ReplayLlm::start("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let t = traj();
        llm.register("r1", Arc::new(script(&t, LlmLatency::Fixed(0.0), &[], 1)));
        let url = format!("{}/chat/completions", llm.base_url());
        let mut msgs = vec![json!({"role": "user", "content": "go"})];
        let a = post_json(&url, &[], &json!({"model": "m", "user": "r1", "messages": msgs}))
            .await
            .unwrap();
        assert_eq!(a.status, 200);
        assert!(a.llm_ms.is_some());
        let v: Value = serde_json::from_slice(&a.body).unwrap();
        let args =
            v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap();
        assert_eq!(serde_json::from_str::<Value>(args).unwrap()["command"], "echo a");
        msgs.push(v["choices"][0]["message"].clone());
        msgs.push(json!({"role": "tool", "tool_call_id": "call_0", "content": "a"}));
        let a = post_json(&url, &[("x-crab-replay-run", "r1")], &json!({"messages": msgs}))
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&a.body).unwrap();
        let args =
            v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap();
        assert_eq!(serde_json::from_str::<Value>(args).unwrap()["command"], "echo \"b\"");
        let a = post_json(&url, &[], &json!({"user": "nope", "messages": []})).await.unwrap();
        assert_eq!(a.status, 404);
    }
}
