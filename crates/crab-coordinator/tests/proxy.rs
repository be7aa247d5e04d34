//! The proxy over real HTTP: a stub upstream, fake (or engine-backed) checkpoint tickets, and a
//! hyper client acting as the agent. Order is observed with timestamps.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::watch;

use crab_common::{CheckpointKind, ErrorCode};
use crab_coordinator::{
    Boundary, BoundaryTicket, BoxFuture, Coordinator, HookError, ProxyConfig, ProxyServer,
    Published, TurnHooks, REPLAYED_HEADER,
};
use crab_engine::{Engine, EngineConfig, Job, JobOutcome, JobSpec};
use crab_testkit::engine::EngineHooks;
use crab_testkit::upstream::{
    messages_stream_chunks, stream_chunks, stream_text, MemoryDirectory, StubConfig, StubUpstream,
};

// ---------- fake checkpoint tickets ----------

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Published this long after the boundary.
    After(Duration),
    /// Fails this long after the boundary.
    Fail(Duration),
    /// Never settles.
    Never,
    /// `on_boundary` itself fails (no checkpoint could be started).
    HookErr,
    /// Published at once, its sandbox parked: ready (woken) this long after a stream's head
    /// is released, or at once when a whole answer's gate promotes it.
    Parked(Duration),
}

struct FakeTicket {
    tx: watch::Sender<Option<Result<Published, HookError>>>,
    promoted_at: Mutex<Option<Instant>>,
    published_at: Mutex<Option<Instant>>,
    exposed: Mutex<Vec<Duration>>,
    /// Whether its sandbox is ready (not parked), and how long after a stream's head it wakes.
    ready: Arc<watch::Sender<bool>>,
    wakes_after_head: Option<Duration>,
    ready_at: Arc<Mutex<Option<Instant>>>,
}

impl FakeTicket {
    /// Its sandbox wakes `after` from now (a parked one).
    fn wake(&self, after: Duration) {
        if *self.ready.borrow() {
            return;
        }
        let (ready, at) = (self.ready.clone(), self.ready_at.clone());
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            at.lock().unwrap().get_or_insert_with(Instant::now);
            ready.send_replace(true);
        });
    }
}

impl BoundaryTicket for FakeTicket {
    fn is_published(&self) -> bool {
        self.tx.borrow().is_some() && *self.ready.borrow()
    }
    fn wait_published(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        Box::pin(async move {
            let r = self.wait_checkpoint().await;
            self.wait_ready().await?;
            r
        })
    }
    fn is_checkpointed(&self) -> bool {
        self.tx.borrow().is_some()
    }
    fn wait_checkpoint(&self) -> BoxFuture<'_, Result<Published, HookError>> {
        let mut rx = self.tx.subscribe();
        Box::pin(async move {
            let v = rx
                .wait_for(Option::is_some)
                .await
                .map_err(|e| HookError::internal(e.to_string()))?;
            v.clone().unwrap()
        })
    }
    fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }
    fn wait_ready(&self) -> BoxFuture<'_, Result<(), HookError>> {
        let mut rx = self.ready.subscribe();
        Box::pin(async move {
            rx.wait_for(|r| *r).await.map_err(|e| HookError::internal(e.to_string()))?;
            Ok(())
        })
    }
    fn promote(&self) {
        *self.promoted_at.lock().unwrap() = Some(Instant::now());
        self.wake(Duration::from_millis(100));
    }
    fn head_released(&self) {
        if let Some(d) = self.wakes_after_head {
            self.wake(d);
        }
    }
    fn record_exposed(&self, held: Duration) {
        self.exposed.lock().unwrap().push(held);
    }
}

struct FakeHooks {
    modes: Mutex<Vec<Mode>>,
    default: Mutex<Mode>,
    boundaries: Mutex<Vec<Boundary>>,
    tickets: Mutex<Vec<Arc<FakeTicket>>>,
    /// The failures the proxy reported: (sandbox, turn, code, message).
    failed: Mutex<Vec<(String, u64, ErrorCode, String)>>,
}

impl FakeHooks {
    fn new(default: Mode) -> Arc<Self> {
        Arc::new(FakeHooks {
            modes: Mutex::new(Vec::new()),
            default: Mutex::new(default),
            boundaries: Mutex::new(Vec::new()),
            tickets: Mutex::new(Vec::new()),
            failed: Mutex::new(Vec::new()),
        })
    }
    /// Modes for the next boundaries, in order; then the default.
    fn script(&self, modes: &[Mode]) {
        *self.modes.lock().unwrap() = modes.to_vec();
    }
    fn boundaries(&self) -> Vec<Boundary> {
        self.boundaries.lock().unwrap().clone()
    }
    fn ticket(&self, i: usize) -> Arc<FakeTicket> {
        self.tickets.lock().unwrap()[i].clone()
    }
    /// The reported failures, by turn.
    fn failed(&self) -> Vec<(String, u64, ErrorCode, String)> {
        let mut v = self.failed.lock().unwrap().clone();
        v.sort_by_key(|f| f.1);
        v
    }
}

impl TurnHooks for FakeHooks {
    fn on_boundary(
        &self,
        b: Boundary,
    ) -> BoxFuture<'_, Result<Arc<dyn BoundaryTicket>, HookError>> {
        let mode = {
            let mut m = self.modes.lock().unwrap();
            if m.is_empty() {
                *self.default.lock().unwrap()
            } else {
                m.remove(0)
            }
        };
        let id = format!("{}-{}", b.sandbox, b.turn);
        self.boundaries.lock().unwrap().push(b);
        let (tx, _) = watch::channel(None);
        let wakes_after_head = match mode {
            Mode::Parked(d) => Some(d),
            _ => None,
        };
        let ready = Arc::new(watch::channel(wakes_after_head.is_none()).0);
        let t = Arc::new(FakeTicket {
            tx,
            promoted_at: Mutex::new(None),
            published_at: Mutex::new(None),
            exposed: Mutex::new(Vec::new()),
            ready,
            wakes_after_head,
            ready_at: Arc::new(Mutex::new(None)),
        });
        self.tickets.lock().unwrap().push(t.clone());
        let settle = |t: Arc<FakeTicket>, after: Duration, r: Result<Published, HookError>| {
            if after.is_zero() {
                *t.published_at.lock().unwrap() = Some(Instant::now());
                t.tx.send_replace(Some(r));
            } else {
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    *t.published_at.lock().unwrap() = Some(Instant::now());
                    t.tx.send_replace(Some(r));
                });
            }
        };
        match mode {
            Mode::After(d) => settle(t.clone(), d, Ok(Published { checkpoint_id: id })),
            Mode::Fail(d) => settle(
                t.clone(),
                d,
                Err(HookError::new(ErrorCode::PoolFull, "btrfs snapshot failed: no space", "")),
            ),
            Mode::Never => {}
            Mode::Parked(_) => {
                settle(t.clone(), Duration::ZERO, Ok(Published { checkpoint_id: id }))
            }
            Mode::HookErr => {
                return Box::pin(async {
                    Err(HookError::new(ErrorCode::Busy, "inspector unreachable", ""))
                })
            }
        }
        Box::pin(async move { Ok(t as Arc<dyn BoundaryTicket>) })
    }
    fn checkpoint_failed(&self, sandbox: &str, turn: u64, error: &HookError) {
        self.failed.lock().unwrap().push((
            sandbox.to_string(),
            turn,
            error.code(),
            error.to_string(),
        ));
    }
}

// ---------- harness ----------

struct H {
    stub: StubUpstream,
    coord: Arc<Coordinator>,
    server: ProxyServer,
    _dir: tempfile::TempDir,
    client: Client<HttpConnector, Full<Bytes>>,
}

async fn harness(
    hooks: Arc<dyn TurnHooks>,
    stub_cfg: StubConfig,
    tweak: impl FnOnce(&mut ProxyConfig),
) -> H {
    let stub = StubUpstream::start(stub_cfg).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..16).map(|i| format!("sb{i}")).collect();
    let mut refs: Vec<&str> = names.iter().map(String::as_str).collect();
    refs.extend(["a", "b", "c"]);
    let sandboxes = MemoryDirectory::new(dir.path(), &refs);
    let mut cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream_openai: stub.url(),
        upstream_anthropic: stub.url(),
        ..Default::default()
    };
    tweak(&mut cfg);
    let coord = Coordinator::new(cfg, sandboxes, hooks).unwrap();
    let server = coord.bind().await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    H { stub, coord, server, _dir: dir, client }
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    head_at: Instant,
    first_byte_at: Option<Instant>,
}

impl H {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.server.local_addr())
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Reply {
        let mut b = Request::builder().method(method).uri(self.url(path));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let resp = self.client.request(req).await.unwrap();
        let head_at = Instant::now();
        let status = resp.status();
        let headers = resp.headers().clone();
        let mut body = resp.into_body();
        let mut all = Vec::new();
        let mut first_byte_at = None;
        while let Some(f) = body.frame().await {
            if let Some(d) = f.unwrap().data_ref() {
                if first_byte_at.is_none() && !d.is_empty() {
                    first_byte_at = Some(Instant::now());
                }
                all.extend_from_slice(d);
            }
        }
        Reply { status, headers, body: Bytes::from(all), head_at, first_byte_at }
    }

    async fn chat(&self, sb: &str, body: &str) -> Reply {
        self.send(
            Method::POST,
            &format!("/s/{sb}/v1/chat/completions"),
            &[("authorization", "Bearer sk-secret")],
            body,
        )
        .await
    }
}

fn json(r: &Reply) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap()
}

// ---------- tests ----------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_is_withheld_until_the_checkpoint_publishes() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(250)));
    let h = harness(
        hooks.clone(),
        StubConfig { delay: Duration::from_millis(20), ..Default::default() },
        |_| {},
    )
    .await;
    let t0 = Instant::now();
    let r = h.chat("a", r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    let t = hooks.ticket(0);
    let published = t.published_at.lock().unwrap().unwrap();
    let promoted = t.promoted_at.lock().unwrap().expect("a held ticket is promoted");
    let upstream_at = h.stub.requests()[0].at;
    // Order: request forwarded at once -> head arrives -> promote -> publish -> release.
    assert!(upstream_at < t0 + Duration::from_millis(150), "forwarded immediately");
    assert!(upstream_at < promoted && promoted < published, "promoted while holding");
    assert!(r.head_at >= published, "released only after publication");
    let held = t.exposed.lock().unwrap()[0];
    assert!(held >= Duration::from_millis(150) && held < Duration::from_millis(1000), "{held:?}");
    // The log has the pair, fsynced before release, with the held time.
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert_eq!(conv.len(), 1);
    assert_eq!(conv[0].turn, 1);
    assert_eq!(conv[0].response_body(), r.body.to_vec());
    assert!(conv[0].held_ms >= 150.0);
    let b = &hooks.boundaries()[0];
    assert_eq!((b.sandbox.as_str(), b.turn, b.conversation_offset), ("a", 1, 0));
    // Auth passes through untouched; the sandbox prefix is gone.
    let seen = &h.stub.requests()[0];
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(seen.header("authorization"), Some("Bearer sk-secret"));
    let stats = h.coord.stats();
    assert_eq!((stats[0].turns, stats[0].held), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_done_before_the_response_costs_nothing() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(10)));
    let h = harness(
        hooks.clone(),
        StubConfig { delay: Duration::from_millis(100), ..Default::default() },
        |_| {},
    )
    .await;
    let r = h.chat("a", r#"{"messages":[]}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    let t = hooks.ticket(0);
    assert!(t.promoted_at.lock().unwrap().is_none(), "not promoted");
    assert_eq!(t.exposed.lock().unwrap()[0], Duration::ZERO);
    assert_eq!(h.coord.held_samples_ms(), vec![0.0]);
}

/// Jobs queued in a real engine: the held sandbox's job jumps the queue when its response
/// arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_checkpoint_is_promoted_in_the_engine() {
    struct Exec(Mutex<Vec<String>>);
    impl crab_engine::Executor<()> for Exec {
        type Error = std::convert::Infallible;
        fn run(&self, job: &Job<()>) -> Result<JobOutcome, Self::Error> {
            self.0.lock().unwrap().push(job.sandbox.clone());
            std::thread::sleep(Duration::from_millis(if job.sandbox == "blocker" {
                300
            } else {
                30
            }));
            Ok(JobOutcome {
                checkpoint_id: format!("{}-{}", job.sandbox, job.turn),
                ..Default::default()
            })
        }
    }
    let exec = Arc::new(Exec(Mutex::new(Vec::new())));
    let engine =
        Engine::new(EngineConfig { workers: 1, ..Default::default() }, exec.clone()).unwrap();
    let blocker = engine.submit(JobSpec {
        op: crab_engine::JobOp::Checkpoint,
        sandbox: "blocker".into(),
        kind: CheckpointKind::Full,
        payload: (),
        turn: 1,
        urgent: false,
    });
    while exec.0.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let others: Vec<_> = ["x", "y", "z"]
        .iter()
        .map(|s| {
            engine.submit(JobSpec {
                op: crab_engine::JobOp::Checkpoint,
                sandbox: s.to_string(),
                kind: CheckpointKind::Fs,
                payload: (),
                turn: 1,
                urgent: false,
            })
        })
        .collect();
    let h = harness(
        EngineHooks::new(engine.clone(), |_: &Boundary| CheckpointKind::Fs),
        StubConfig { delay: Duration::from_millis(50), ..Default::default() },
        |_| {},
    )
    .await;
    let r = h.chat("a", r#"{"messages":["slow"]}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    blocker.wait().await.unwrap();
    for o in &others {
        o.wait().await.unwrap();
    }
    assert_eq!(
        *exec.0.lock().unwrap(),
        ["blocker", "a", "x", "y", "z"],
        "a's job was promoted past x, y, z"
    );
    let rec = engine.recent_jobs(10).into_iter().find(|r| r.sandbox == "a").unwrap();
    assert!(rec.urgent);
    assert!(rec.exposed_ms.unwrap() > 100.0, "{rec:?}");
    assert!(engine.metrics_text().contains("crab_engine_promotions_total 1"));
}

/// A held turn's `x-crab-held` breakdown: the job's queue wait behind another sandbox's job and
/// the executor's own stages, adding up to the held time the gate measured, and with the log
/// write to (about) the time the agent waited beyond the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turns_breakdown_adds_up_to_its_exposed_time() {
    struct Exec(Mutex<Vec<String>>);
    impl crab_engine::Executor<()> for Exec {
        type Error = std::convert::Infallible;
        fn run(&self, job: &Job<()>) -> Result<JobOutcome, Self::Error> {
            self.0.lock().unwrap().push(job.sandbox.clone());
            let mut stages = Vec::new();
            for (name, ms) in [("criu_dump", 60), ("syncfs", 30)] {
                let t = Instant::now();
                std::thread::sleep(Duration::from_millis(ms));
                stages.push(crab_engine::Stage::new(name, t.elapsed()));
            }
            Ok(JobOutcome {
                checkpoint_id: format!("{}-{}", job.sandbox, job.turn),
                stages,
                ..Default::default()
            })
        }
    }
    let exec = Arc::new(Exec(Mutex::new(Vec::new())));
    let engine =
        Engine::new(EngineConfig { workers: 1, ..Default::default() }, exec.clone()).unwrap();
    let delay = Duration::from_millis(20);
    let h = harness(
        EngineHooks::new(engine.clone(), |_: &Boundary| CheckpointKind::Full),
        StubConfig { delay, ..Default::default() },
        |_| {},
    )
    .await;
    // A first turn opens a's slot and log (a one-time cost the breakdown does not cover).
    assert_eq!(h.chat("a", r#"{"messages":["warm-up"]}"#).await.status, StatusCode::OK);
    exec.0.lock().unwrap().clear();
    // Another sandbox's job runs first: a's job waits in the queue.
    let blocker = engine.submit(JobSpec::checkpoint("blocker", CheckpointKind::Full, (), 1));
    while exec.0.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let t = Instant::now();
    let r = h.chat("a", r#"{"messages":["held"]}"#).await;
    let exposed_ms = (t.elapsed().saturating_sub(delay)).as_secs_f64() * 1e3;
    assert_eq!(r.status, StatusCode::OK);
    blocker.wait().await.unwrap();
    assert_eq!(*exec.0.lock().unwrap(), ["blocker", "a"]);
    let hv = r.headers.get(crab_coordinator::HELD_HEADER).expect("x-crab-held").to_str().unwrap();
    let b = crab_common::stats::parse_breakdown(hv);
    let get = |n: &str| b.iter().filter(|(k, _)| k == n).map(|(_, v)| v).sum::<f64>();
    let names: Vec<&str> = b.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.last(), Some(&"convlog_write"), "{hv}");
    assert!(get("queue") > 30.0, "waited behind the blocker's 90 ms job: {hv}");
    assert!((55.0..200.0).contains(&get("criu_dump")), "{hv}");
    assert!((25.0..200.0).contains(&get("syncfs")), "{hv}");
    let held: f64 =
        b.iter().filter(|(n, _)| n != "convlog_write" && n != "boundary").map(|(_, v)| v).sum();
    let gate = h.coord.held_samples_ms()[1];
    assert!(
        (held - gate).abs() < 0.1,
        "the held parts add up to the gate's wait: {held} vs {gate}"
    );
    let all: f64 = b.iter().map(|(_, v)| v).sum();
    assert!(
        all <= exposed_ms + 0.5 && exposed_ms - all < 25.0,
        "the breakdown ({all:.1} ms: {hv}) covers the exposed time ({exposed_ms:.1} ms) but HTTP"
    );
    // crab top's view: per sandbox and over the newest turns.
    let stats = h.coord.stats();
    let a = stats.iter().find(|s| s.sandbox == "a").unwrap();
    assert!(a.held_stages_ms["queue"] >= get("queue") - 1e-3, "the header rounds to 1 µs");
    let top = h.coord.held_stages();
    let q = top.iter().find(|s| s.stage == "queue").unwrap();
    assert_eq!((q.ms.n, q.turns), (2, 1), "{top:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_held_before_the_first_byte_and_arrive_byte_exact() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(200)));
    let h = harness(
        hooks.clone(),
        StubConfig {
            stream_events: 40,
            chunk_delay: Duration::from_millis(1),
            ..Default::default()
        },
        |_| {},
    )
    .await;
    let r = h
        .send(
            Method::POST,
            "/s/a/v1/messages",
            &[("x-api-key", "sk-ant"), ("anthropic-version", "2023-06-01")],
            r#"{"stream":true,"messages":[]}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let want: Vec<u8> = messages_stream_chunks(40).concat();
    assert_eq!(r.body.to_vec(), want, "stream byte-exact");
    assert!(r
        .headers
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let published = hooks.ticket(0).published_at.lock().unwrap().unwrap();
    assert!(r.first_byte_at.unwrap() >= published, "no byte before publication");
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert_eq!(conv[0].response.as_deref().map(str::as_bytes), Some(&want[..]));
    assert!(conv[0].stream && conv[0].complete && !conv[0].client_disconnected);
    assert_eq!(conv[0].provider, "anthropic");
    assert_eq!(h.stub.requests()[0].header("x-api-key"), Some("sk-ant"));
}

/// A parked sandbox's answer (the host's parking): a stream's head and body go out once the
/// checkpoint is published, only its end waits for the wake (timed from the head); a whole
/// answer waits for the wake, which its gate starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_sandboxs_stream_flows_and_only_its_end_waits_for_the_wake() {
    let hooks = FakeHooks::new(Mode::Parked(Duration::from_millis(600)));
    let h = harness(
        hooks.clone(),
        StubConfig {
            stream_events: 20,
            chunk_delay: Duration::from_millis(10),
            ..Default::default()
        },
        |_| {},
    )
    .await;
    let r = h.chat("a", r#"{"stream":true,"messages":[]}"#).await;
    let end = Instant::now();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body.to_vec(), stream_chunks(20).concat(), "stream byte-exact");
    let t = hooks.ticket(0);
    let ready = t.ready_at.lock().unwrap().expect("woken");
    assert!(r.first_byte_at.unwrap() < ready, "the head and body flow while it is parked");
    assert!(end >= ready, "the end waits for the wake");
    assert!(t.promoted_at.lock().unwrap().is_none(), "the wake is timed from the head");
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert!(
        conv[0].complete && conv[0].held_ms > 50.0,
        "the end's wait is counted: {}",
        conv[0].held_ms
    );

    // A whole answer: not a byte before the wake, which the gate starts (promote).
    let r = h.chat("a", r#"{"messages":[{"role":"user","content":"2"}]}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    let t = hooks.ticket(1);
    let ready = t.ready_at.lock().unwrap().expect("woken");
    assert!(r.head_at >= ready, "a whole answer waits for the wake");
    assert!(t.promoted_at.lock().unwrap().is_some());
}

/// A whole answer asked of the upstream as a stream (`stream_whole_answers`, on when the host
/// parks): the upstream is asked for a stream, the policy is told an early head comes, the
/// head times the parked sandbox's wake (no promotion), and the agent gets — after the wake —
/// the whole answer assembled from the stream, logged as the whole answer it got; the same
/// for Anthropic's messages. Off, the request goes as the agent sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_is_streamed_upstream_and_assembled_after_the_wake() {
    let hooks = FakeHooks::new(Mode::Parked(Duration::from_millis(300)));
    let stub = StubConfig {
        stream_events: 12,
        chunk_delay: Duration::from_millis(2),
        ..Default::default()
    };
    let h = harness(hooks.clone(), stub, |c| c.stream_whole_answers = true).await;
    let body = r#"{"model":"m","messages":[{"role":"user","content":"1"}]}"#;
    let r = h.chat("a", body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers.get("content-type").unwrap(), "application/json");
    let v = json(&r);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["id"], "stub");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], stream_text(12));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let up: serde_json::Value = serde_json::from_slice(&h.stub.requests()[0].body).unwrap();
    assert_eq!(up["stream"], true, "asked of the upstream as a stream");
    assert_eq!(up["stream_options"]["include_usage"], true, "with its usage");
    assert_eq!(up["messages"][0]["content"], "1");
    assert!(hooks.boundaries()[0].streams, "the policy knows an early head comes");
    let t = hooks.ticket(0);
    let ready = t.ready_at.lock().unwrap().expect("woken");
    assert!(r.head_at >= ready, "the whole answer goes out after the wake");
    assert!(t.promoted_at.lock().unwrap().is_none(), "the wake is timed from the head");
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert!(!conv[0].stream && conv[0].complete);
    assert_eq!(conv[0].request, body, "the log has the agent's request");
    assert_eq!(conv[0].response_body(), r.body.to_vec(), "and the answer the agent got");
    assert!(conv[0].held_ms > 50.0, "the wait for the wake is counted: {}", conv[0].held_ms);

    let r = h
        .send(
            Method::POST,
            "/s/b/v1/messages",
            &[("x-api-key", "sk-ant"), ("anthropic-version", "2023-06-01")],
            r#"{"model":"m","max_tokens":64,"messages":[]}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v = json(&r);
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["content"][0]["text"], stream_text(12));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"]["output_tokens"], 12);
    assert_eq!(v["usage"]["input_tokens"], 1);
    let up: serde_json::Value = serde_json::from_slice(&h.stub.requests()[1].body).unwrap();
    assert_eq!(up["stream"], true);
    assert!(up.get("stream_options").is_none(), "OpenAI's option is not sent to Anthropic");

    // Off (the default when the host does not park): the agent's request as it sent it.
    let h = harness(hooks.clone(), StubConfig::default(), |_| {}).await;
    let r = h.chat("c", body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(h.stub.requests()[0].body, body.as_bytes());
    assert!(!hooks.boundaries()[2].streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_the_same_turn() {
    let hooks = FakeHooks::new(Mode::After(Duration::ZERO));
    let h = harness(hooks.clone(), StubConfig::default(), |_| {}).await;
    h.chat("a", r#"{"m":"A"}"#).await;
    h.chat("a", r#"{"m":"A"}"#).await; // same body
    h.send(
        Method::POST,
        "/s/a/v1/chat/completions",
        &[("x-stainless-retry-count", "1")],
        r#"{"m":"A2"}"#,
    )
    .await; // SDK retry header
    h.send(
        Method::POST,
        "/s/a/v1/chat/completions",
        &[("x-stainless-retry-count", "0")],
        r#"{"m":"B"}"#,
    )
    .await;
    let turns: Vec<u64> = hooks.boundaries().iter().map(|b| b.turn).collect();
    assert_eq!(turns, [1, 2]);
    let conv = h.coord.conversation("a", None).await.unwrap();
    let got: Vec<(u64, bool)> = conv.iter().map(|r| (r.turn, r.retry)).collect();
    assert_eq!(got, [(1, false), (1, true), (1, true), (2, false)]);
    assert_eq!(hooks.boundaries()[1].conversation_offset, 3);
    assert_eq!(h.coord.stats()[0].retries, 2);
    assert_eq!(h.stub.requests().len(), 4, "retries are still forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counting_and_other_paths_are_not_turns() {
    let hooks = FakeHooks::new(Mode::Never);
    let h = harness(hooks.clone(), StubConfig::default(), |_| {}).await;
    let r = h
        .send(
            Method::POST,
            "/s/a/v1/messages/count_tokens",
            &[("x-api-key", "k"), ("anthropic-version", "2023-06-01")],
            r#"{"messages":[]}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(json(&r).get("input_tokens").is_some());
    let r = h
        .send(
            Method::GET,
            "/v1/models?limit=2",
            &[("x-crab-sandbox", "b"), ("authorization", "Bearer z")],
            "",
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let seen = h.stub.requests();
    assert_eq!(seen[1].path, "/v1/models?limit=2");
    assert!(seen[1].header("x-crab-sandbox").is_none(), "attribution header not forwarded");
    assert_eq!(seen[1].header("authorization"), Some("Bearer z"));
    assert!(hooks.boundaries().is_empty(), "no boundary (a Never ticket would have hung)");
    assert!(h.coord.conversation("a", None).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_4xx() {
    let hooks = FakeHooks::new(Mode::After(Duration::ZERO));
    let h = harness(hooks.clone(), StubConfig::default(), |c| c.max_request_bytes = 1024).await;
    let r = h.chat("nope", "{}").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let e = json(&r);
    assert_eq!(e["error"]["code"], "sandbox_not_found");
    assert!(e["error"]["message"].as_str().unwrap().contains("nope"));
    let r = h.send(Method::POST, "/v1/chat/completions", &[], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "no sandbox named");
    let r = h.send(Method::POST, "/s/..bad/v1/chat/completions", &[], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "invalid name");
    let r = h.chat("a", "{not json").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(json(&r)["error"]["message"].as_str().unwrap().contains("not valid JSON"));
    let big = format!("{{\"x\":\"{}\"}}", "y".repeat(4096));
    let r = h.chat("a", &big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(hooks.boundaries().is_empty(), "bad requests mark no boundary");
    assert!(h.stub.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_is_502_and_slow_is_504() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(50)));
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let h = harness(
        hooks.clone(),
        StubConfig { delay: Duration::from_secs(3), ..Default::default() },
        |c| {
            c.upstream_anthropic = format!("http://{dead}");
            c.upstream_timeout = Duration::from_millis(300);
        },
    )
    .await;
    let t = Instant::now();
    let r = h.send(Method::POST, "/s/a/v1/messages", &[], r#"{"messages":[]}"#).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    let msg = json(&r)["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("anthropic") && msg.contains(&dead.to_string()), "{msg}");
    assert!(t.elapsed() >= Duration::from_millis(50), "even errors wait for the checkpoint");
    let r = h.chat("b", r#"{"messages":[]}"#).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(json(&r)["error"]["message"].as_str().unwrap().contains("openai"));
    // The agent's retry after the 502 is the same turn: no checkpoint is lost or doubled.
    let r = h
        .send(
            Method::POST,
            "/s/a/v1/messages",
            &[("x-stainless-retry-count", "1")],
            r#"{"messages":[]}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(hooks.boundaries().len(), 2);
    assert_eq!(h.coord.stats()[0].upstream_errors, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_checkpoint_releases_the_response_and_is_reported_once_typed() {
    let hooks = FakeHooks::new(Mode::After(Duration::ZERO));
    hooks.script(&[Mode::Fail(Duration::from_millis(30)), Mode::Never, Mode::HookErr]);
    let h = harness(hooks.clone(), StubConfig::default(), |c| {
        c.gate_timeout = Duration::from_millis(200)
    })
    .await;
    let r = h.chat("a", r#"{"t":1}"#).await;
    assert_eq!(r.status, StatusCode::OK, "released despite the failure");
    let t = Instant::now();
    let r = h.chat("a", r#"{"t":2}"#).await;
    assert_eq!(r.status, StatusCode::OK, "released after the gate timeout");
    assert!(t.elapsed() >= Duration::from_millis(190));
    let r = h.chat("a", r#"{"t":3}"#).await;
    assert_eq!(r.status, StatusCode::OK, "released although no checkpoint started");
    h.chat("a", r#"{"t":4}"#).await;
    h.chat("a", r#"{"t":5}"#).await;
    // Every turn without a checkpoint is reported through the seam once, with its code (the
    // host's policy makes the next one full); the published ones are not.
    assert_eq!(hooks.boundaries().len(), 5);
    let failed = hooks.failed();
    let seen: Vec<(&str, u64, ErrorCode)> =
        failed.iter().map(|f| (f.0.as_str(), f.1, f.2)).collect();
    assert_eq!(
        seen,
        [("a", 1, ErrorCode::PoolFull), ("a", 2, ErrorCode::Timeout), ("a", 3, ErrorCode::Busy)]
    );
    assert!(failed[0].3.contains("no space"), "{failed:?}");
    assert!(failed[1].3.contains("gate timeout"), "{failed:?}");
    assert!(failed[2].3.contains("starting the checkpoint of turn 3"), "{failed:?}");
    // An explicit turn mark's failure is reported the same way, to its waiter typed.
    hooks.script(&[Mode::HookErr]);
    let (turn, ticket) = h.coord.begin_turn("a").await.unwrap();
    assert_eq!(turn, 6);
    let e = ticket.wait_published().await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::Busy, "{e}");
    assert_eq!(hooks.failed().last().map(|f| (f.1, f.2)), Some((6, ErrorCode::Busy)));
    assert_eq!(hooks.failed().len(), 4, "once per failed turn");
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert!(conv[0].checkpoint_error.as_deref().unwrap().contains("no space"));
    assert!(conv[1].checkpoint_error.as_deref().unwrap().contains("gate timeout"));
    assert!(conv[2].checkpoint_error.as_deref().unwrap().contains("inspector unreachable"));
    assert!(conv[3].checkpoint_error.is_none());
    let s = &h.coord.stats()[0];
    assert_eq!(s.checkpoint_failures, 3);
    assert!(h
        .coord
        .metrics_text()
        .contains("crab_proxy_checkpoint_failures_total{sandbox=\"a\"} 3"));
}

/// The force-full rule lives in the host's `TurnPolicy` alone (here through the testkit's engine
/// hooks, which hold one): the proxy only reports a turn without a checkpoint through the seam —
/// a failed job, a gate that gave up waiting — and the next decided kind is `full`, once,
/// whichever way the turn failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_without_a_checkpoint_makes_the_policys_next_kind_full() {
    struct Exec {
        kinds: Mutex<Vec<(u64, CheckpointKind)>>,
        done: Mutex<Vec<u64>>,
    }
    impl crab_engine::Executor<()> for Exec {
        type Error = std::io::Error;
        fn run(&self, job: &Job<()>) -> Result<JobOutcome, Self::Error> {
            self.kinds.lock().unwrap().push((job.turn, job.kind));
            let r = match job.turn {
                1 => Err(std::io::Error::other("btrfs snapshot failed: no space")),
                3 => {
                    // Published long after the gate gave up on it.
                    std::thread::sleep(Duration::from_millis(600));
                    Ok(JobOutcome::default())
                }
                _ => Ok(JobOutcome::default()),
            };
            self.done.lock().unwrap().push(job.turn);
            r
        }
    }
    let exec = Arc::new(Exec { kinds: Mutex::new(Vec::new()), done: Mutex::new(Vec::new()) });
    let engine =
        Engine::new(EngineConfig { workers: 1, ..Default::default() }, exec.clone()).unwrap();
    let hooks = EngineHooks::new(engine.clone(), |_: &Boundary| CheckpointKind::Fs);
    let h = harness(hooks.clone(), StubConfig::default(), |c| {
        c.gate_timeout = Duration::from_millis(150)
    })
    .await;
    for t in 1..=5 {
        let r = h.chat("a", &format!(r#"{{"t":{t}}}"#)).await;
        assert_eq!(r.status, StatusCode::OK, "turn {t} is released, checkpoint or not");
        if t == 3 {
            // Turn 3's job is still running: let it finish before turn 4 queues behind it.
            while !exec.done.lock().unwrap().contains(&3) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    assert_eq!(
        *exec.kinds.lock().unwrap(),
        [
            (1, CheckpointKind::Fs),
            (2, CheckpointKind::Full),
            (3, CheckpointKind::Fs),
            (4, CheckpointKind::Full),
            (5, CheckpointKind::Fs)
        ],
        "the turn after a failed job and after a gate timeout is full; the one after that is not"
    );
    assert!(!hooks.policy().is_forced("a"));
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert!(conv[0].checkpoint_error.as_deref().unwrap().contains("no space"));
    assert!(conv[2].checkpoint_error.as_deref().unwrap().contains("gate timeout"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_does_not_wedge_anything() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(20)));
    let h = harness(
        hooks.clone(),
        StubConfig {
            stream_events: 30,
            chunk_delay: Duration::from_millis(10),
            ..Default::default()
        },
        |_| {},
    )
    .await;
    let req = Request::builder()
        .method(Method::POST)
        .uri(h.url("/s/a/v1/chat/completions"))
        .body(Full::new(Bytes::from_static(br#"{"stream":true}"#)))
        .unwrap();
    let resp = h.client.request(req).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body); // the agent goes away
                // A client that leaves while its response is held does not wedge the gate either.
    hooks.script(&[Mode::After(Duration::from_millis(300))]);
    let fut = h.chat("b", r#"{"x":1}"#);
    let _ = tokio::time::timeout(Duration::from_millis(50), fut).await;
    let t = Instant::now();
    loop {
        let a = h.coord.conversation("a", None).await.unwrap();
        let b = h.coord.conversation("b", None).await.unwrap();
        if a.len() == 1 && b.len() == 1 {
            assert!(a[0].client_disconnected && a[0].complete);
            assert_eq!(
                a[0].response_body(),
                stream_chunks(30).concat(),
                "the log has the whole stream"
            );
            assert_eq!(b[0].status, 200);
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "log records never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = h.chat("a", r#"{"next":true}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(hooks.boundaries().iter().filter(|b| b.sandbox == "a").count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_logged_responses_are_replayed_then_the_log_diverges() {
    let hooks = FakeHooks::new(Mode::After(Duration::ZERO));
    let h = harness(hooks.clone(), StubConfig::default(), |_| {}).await;
    let a = h.chat("a", r#"{"q":"A"}"#).await;
    let b = h.chat("a", r#"{"q":"B"}"#).await;
    h.chat("a", r#"{"q":"C"}"#).await;
    assert_eq!(h.coord.conversation_offset("a").await.unwrap(), 3);
    // Restore to the point of turn 2 (its boundary recorded offset 1), keeping the log.
    let off = hooks.boundaries()[1].conversation_offset;
    assert_eq!(off, 1);
    h.coord.restored("a", off, true).await.unwrap();
    let upstream_before = h.stub.requests().len();
    let b2 = h.chat("a", r#"{"q":"B"}"#).await;
    assert_eq!(b2.body, b.body, "answered from the log");
    assert_eq!(b2.headers.get(REPLAYED_HEADER).unwrap(), "1");
    assert_eq!(h.stub.requests().len(), upstream_before, "upstream not called");
    // A different request: the logged future (C) is dropped, D becomes turn 3.
    h.chat("a", r#"{"q":"D"}"#).await;
    let conv = h.coord.conversation("a", None).await.unwrap();
    let qs: Vec<(u64, &str)> = conv.iter().map(|r| (r.turn, r.request.as_str())).collect();
    assert_eq!(qs, [(1, r#"{"q":"A"}"#), (2, r#"{"q":"B"}"#), (3, r#"{"q":"D"}"#)]);
    assert_eq!(hooks.boundaries().last().unwrap().turn, 3);
    // Restore without replay cuts the log; the prefix matches the restore point.
    h.coord.restored("a", 1, false).await.unwrap();
    let conv = h.coord.conversation("a", None).await.unwrap();
    assert_eq!(conv.len(), 1);
    assert_eq!(conv[0].response_body(), a.body.to_vec());
    h.chat("a", r#"{"q":"E"}"#).await;
    assert_eq!(hooks.boundaries().last().unwrap().turn, 2);
    // Fork: the new sandbox starts with the prefix.
    h.coord.forked("a", "c", 1).await.unwrap();
    assert_eq!(h.coord.conversation("c", None).await.unwrap().len(), 1);
    h.chat("c", r#"{"q":"F"}"#).await;
    assert_eq!(hooks.boundaries().last().unwrap().turn, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_survives_a_coordinator_restart() {
    let hooks = FakeHooks::new(Mode::After(Duration::ZERO));
    let stub = StubUpstream::start(StubConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = ProxyConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream_openai: stub.url(),
        upstream_anthropic: stub.url(),
        ..Default::default()
    };
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    for round in 0..2 {
        let coord =
            Coordinator::new(cfg.clone(), MemoryDirectory::new(dir.path(), &["a"]), hooks.clone())
                .unwrap();
        let server = coord.bind().await.unwrap();
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}/s/a/v1/responses", server.local_addr()))
            .body(Full::new(Bytes::from(format!("{{\"round\":{round}}}"))))
            .unwrap();
        assert!(client.request(req).await.unwrap().status().is_success());
        server.shutdown().await;
    }
    let turns: Vec<(u64, u64)> =
        hooks.boundaries().iter().map(|b| (b.turn, b.conversation_offset)).collect();
    assert_eq!(turns, [(1, 0), (2, 1)], "turn numbering continues from the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_turns_and_metrics() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(5)));
    let h = harness(hooks.clone(), StubConfig::default(), |_| {}).await;
    let (turn, ticket) = h.coord.begin_turn("a").await.unwrap();
    assert_eq!(turn, 1);
    assert_eq!(ticket.wait_published().await.unwrap().checkpoint_id, "a-1");
    h.chat("a", "{}").await;
    assert_eq!(hooks.boundaries()[1].turn, 2);
    assert!(h.coord.begin_turn("ghost").await.is_err());
    let m = h.coord.metrics_text();
    assert!(m.contains("crab_proxy_turns_total{sandbox=\"a\"} 2"), "{m}");
    assert!(m.contains("crab_proxy_conversation_records{sandbox=\"a\"} 1"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_sandboxes_all_make_progress() {
    let hooks = FakeHooks::new(Mode::After(Duration::from_millis(40)));
    let h = Arc::new(harness(hooks.clone(), StubConfig::default(), |_| {}).await);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            let sb = format!("sb{i}");
            for turn in 0..6 {
                // Model latency varies per sandbox and turn (20..110 ms).
                let delay = (20 + (i * 7 + turn * 13) % 90).to_string();
                let r = h
                    .send(
                        Method::POST,
                        &format!("/s/{sb}/v1/chat/completions"),
                        &[("x-stub-delay-ms", &delay)],
                        &format!("{{\"sb\":{i},\"turn\":{turn}}}"),
                    )
                    .await;
                assert_eq!(r.status, StatusCode::OK);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    for i in 0..16 {
        let conv = h.coord.conversation(&format!("sb{i}"), None).await.unwrap();
        let turns: Vec<u64> = conv.iter().map(|r| r.turn).collect();
        assert_eq!(turns, [1, 2, 3, 4, 5, 6]);
    }
    assert_eq!(hooks.boundaries().len(), 96);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_non_loopback_listeners_and_bad_upstreams() {
    let hooks = FakeHooks::new(Mode::Never);
    let dir = tempfile::tempdir().unwrap();
    let cfg = ProxyConfig { listen: "0.0.0.0:7431".parse().unwrap(), ..Default::default() };
    let e =
        Coordinator::new(cfg, MemoryDirectory::new(dir.path(), &[]), hooks.clone()).unwrap_err();
    assert!(e.to_string().contains("loopback"), "{e}");
    let cfg = ProxyConfig { upstream_openai: "ftp://x".into(), ..Default::default() };
    let e = Coordinator::new(cfg, MemoryDirectory::new(dir.path(), &[]), hooks).unwrap_err();
    assert!(e.to_string().contains("openai"), "{e}");
}

/// https upstreams go through rustls: pointing one at the plain-HTTP stub fails the TLS
/// handshake, which must come back as a 502 naming the upstream (not hang, not 500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstreams_use_tls() {
    let hooks = FakeHooks::new(Mode::After(Duration::ZERO));
    let h = harness(hooks.clone(), StubConfig::default(), |c| {
        c.upstream_openai = c.upstream_openai.replace("http://", "https://");
    })
    .await;
    let r = h.chat("a", "{}").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    let msg = json(&r)["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("https://127.0.0.1"), "{msg}");
}
