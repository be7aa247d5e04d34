//! Scheduler behaviour with fake executors: FIFO order, promotion, the starvation bound,
//! coalescing, the dump-concurrency limit, the bandwidth bucket, failure propagation, metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crab_common::CheckpointKind;
use crab_engine::{
    Changeset, Engine, EngineConfig, Executor, Job, JobError, JobHandle, JobOutcome, JobSpec,
};

/// The fake's typed payload: written paths and born pids, merged like the host's changeset.
#[derive(Debug, Clone, Default, PartialEq)]
struct Changes {
    written: Vec<String>,
    born: Vec<u32>,
}

impl Changeset for Changes {
    fn merge(&mut self, later: Self) {
        for w in later.written {
            if !self.written.contains(&w) {
                self.written.push(w);
            }
        }
        self.born.extend(later.born);
    }
}

fn written(paths: &[&str]) -> Changes {
    Changes { written: paths.iter().map(|p| p.to_string()).collect(), born: vec![] }
}

type Started = (String, CheckpointKind, u64, u64, Changes);

/// Records every job it runs; jobs of sandbox "blocker" wait until `release()`.
#[derive(Default)]
struct Fake {
    started: Mutex<Vec<Started>>,
    released: Mutex<bool>,
    cv: Condvar,
    running: AtomicUsize,
    max_running: AtomicUsize,
    dumps: AtomicUsize,
    max_dumps: AtomicUsize,
    sleep: Duration,
    bytes: u64,
}

impl Fake {
    fn with(sleep: Duration, bytes: u64) -> Arc<Self> {
        Arc::new(Fake { sleep, bytes, ..Default::default() })
    }
    fn release(&self) {
        *self.released.lock().unwrap() = true;
        self.cv.notify_all();
    }
    fn order(&self) -> Vec<String> {
        self.started.lock().unwrap().iter().map(|s| s.0.clone()).collect()
    }
    fn wait_started(&self, n: usize) {
        let t = Instant::now();
        while self.started.lock().unwrap().len() < n {
            assert!(t.elapsed() < Duration::from_secs(5), "jobs did not start");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The fake executor's typed error.
#[derive(Debug, PartialEq)]
struct FakeError(String);

impl std::fmt::Display for FakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FakeError {}

impl Executor<Changes> for Fake {
    type Error = FakeError;
    fn run(&self, job: &Job<Changes>) -> Result<JobOutcome, FakeError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        if job.kind.dumps_processes() {
            let d = self.dumps.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_dumps.fetch_max(d, Ordering::SeqCst);
        }
        self.started.lock().unwrap().push((
            job.sandbox.clone(),
            job.kind,
            job.first_turn,
            job.turn,
            job.payload.clone(),
        ));
        if job.sandbox == "blocker" {
            let mut r = self.released.lock().unwrap();
            while !*r {
                r = self.cv.wait(r).unwrap();
            }
        }
        std::thread::sleep(self.sleep);
        if job.kind.dumps_processes() {
            self.dumps.fetch_sub(1, Ordering::SeqCst);
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
        if job.sandbox.starts_with("bad") {
            return Err(FakeError(format!("btrfs snapshot of {} failed: no space", job.sandbox)));
        }
        if job.sandbox.starts_with("panic") {
            panic!("executor bug");
        }
        Ok(JobOutcome {
            checkpoint_id: format!("{}-{}", job.sandbox, job.turn),
            bytes: self.bytes,
            ..Default::default()
        })
    }
}

fn spec(sb: &str, kind: CheckpointKind, turn: u64) -> JobSpec<Changes> {
    JobSpec::checkpoint(sb, kind, Changes::default(), turn)
}

fn one_worker(k: u32) -> EngineConfig {
    EngineConfig { workers: 1, urgent_burst: k, ..Default::default() }
}

async fn wait_all(hs: &[JobHandle]) {
    for h in hs {
        tokio::time::timeout(Duration::from_secs(10), h.wait())
            .await
            .expect("job finished in time")
            .expect("job succeeded");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_jobs_run_in_submission_order() {
    let fake = Fake::with(Duration::ZERO, 0);
    let eng = Engine::new(one_worker(4), fake.clone()).unwrap();
    let b = eng.submit(spec("blocker", CheckpointKind::Fs, 1));
    fake.wait_started(1);
    let hs: Vec<_> =
        (0..5).map(|i| eng.submit(spec(&format!("s{i}"), CheckpointKind::Fs, 1))).collect();
    fake.release();
    wait_all(&[b]).await;
    wait_all(&hs).await;
    assert_eq!(fake.order(), ["blocker", "s0", "s1", "s2", "s3", "s4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promoted_job_overtakes_normal_ones() {
    let fake = Fake::with(Duration::ZERO, 0);
    let eng = Engine::new(one_worker(4), fake.clone()).unwrap();
    let b = eng.submit(spec("blocker", CheckpointKind::Fs, 1));
    fake.wait_started(1);
    let hs: Vec<_> =
        (0..4).map(|i| eng.submit(spec(&format!("s{i}"), CheckpointKind::Fs, 1))).collect();
    assert!(eng.promote(hs[3].id()));
    assert!(eng.promote(hs[2].id()));
    let st = eng.stats();
    assert_eq!((st.queued_normal, st.queued_urgent, st.running), (2, 2, 1));
    fake.release();
    wait_all(&[b]).await;
    wait_all(&hs).await;
    assert_eq!(fake.order(), ["blocker", "s3", "s2", "s0", "s1"]);
    // Promoting a finished job reports it unknown.
    assert!(!eng.promote(hs[0].id()));
    assert!(eng.metrics_text().contains("crab_engine_promotions_total 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urgent_work_cannot_starve_normal_work_beyond_the_bound() {
    let fake = Fake::with(Duration::ZERO, 0);
    let eng = Engine::new(one_worker(2), fake.clone()).unwrap();
    let b = eng.submit(spec("blocker", CheckpointKind::Fs, 1));
    fake.wait_started(1);
    let mut hs = Vec::new();
    for i in 0..3 {
        hs.push(eng.submit(spec(&format!("n{i}"), CheckpointKind::Fs, 1)));
    }
    for i in 0..6 {
        hs.push(
            eng.submit(JobSpec { urgent: true, ..spec(&format!("u{i}"), CheckpointKind::Fs, 1) }),
        );
    }
    fake.release();
    wait_all(&[b]).await;
    wait_all(&hs).await;
    assert_eq!(
        fake.order(),
        ["blocker", "u0", "u1", "n0", "u2", "u3", "n1", "u4", "u5", "n2"],
        "after 2 urgent starts, one waiting normal job runs"
    );
    assert!(eng.metrics_text().contains("crab_engine_starvation_breaks_total 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_jobs_of_a_sandbox_coalesce() {
    let fake = Fake::with(Duration::ZERO, 7);
    let eng = Engine::new(EngineConfig::default(), fake.clone()).unwrap();
    // "blocker" is running, so its later submissions queue behind it and merge.
    let first = eng.submit(spec("blocker", CheckpointKind::Skip, 1));
    fake.wait_started(1);
    let h2 =
        eng.submit(JobSpec { payload: written(&["/a"]), ..spec("blocker", CheckpointKind::Fs, 2) });
    let h3 = eng.submit(JobSpec {
        payload: Changes { born: vec![42], ..written(&["/b"]) },
        ..spec("blocker", CheckpointKind::Process, 3)
    });
    let h4 = eng.submit(spec("blocker", CheckpointKind::Skip, 4));
    assert_eq!(h2.id(), h3.id());
    assert_eq!(h3.id(), h4.id());
    assert_ne!(first.id(), h2.id());
    let st = eng.stats();
    assert_eq!(st.sandboxes[0].queued, Some(CheckpointKind::Full));
    assert_eq!(st.sandboxes[0].running, Some(CheckpointKind::Skip));
    fake.release();
    wait_all(&[first.clone(), h2.clone(), h3.clone(), h4.clone()]).await;
    let started = fake.started.lock().unwrap().clone();
    assert_eq!(started.len(), 2, "three submissions ran as one job");
    let (_, kind, first_turn, turn, payload) = &started[1];
    assert_eq!((*kind, *first_turn, *turn), (CheckpointKind::Full, 2, 4));
    assert_eq!(payload, &Changes { born: vec![42], ..written(&["/a", "/b"]) });
    let done = h2.wait().await.unwrap();
    assert_eq!(done.outcome.checkpoint_id, "blocker-4");
    assert_eq!(h4.wait().await.unwrap(), done);
    let s = &eng.stats().sandboxes[0].stats;
    assert_eq!((s.coalesced, s.completed, s.bytes, s.last_turn), (2, 2, 14, Some(4)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_dumps_are_limited_but_fs_work_runs_alongside() {
    let fake = Fake::with(Duration::from_millis(40), 0);
    let cfg = EngineConfig { workers: 4, max_concurrent_dumps: 1, ..Default::default() };
    let eng = Engine::new(cfg, fake.clone()).unwrap();
    let mut hs = Vec::new();
    for i in 0..4 {
        hs.push(eng.submit(spec(
            &format!("p{i}"),
            if i % 2 == 0 { CheckpointKind::Process } else { CheckpointKind::Full },
            1,
        )));
        hs.push(eng.submit(spec(&format!("f{i}"), CheckpointKind::Fs, 1)));
    }
    wait_all(&hs).await;
    assert_eq!(fake.max_dumps.load(Ordering::SeqCst), 1);
    assert!(fake.max_running.load(Ordering::SeqCst) >= 2, "fs jobs ran next to a dump");
    assert!(fake.max_running.load(Ordering::SeqCst) <= 4);

    let fake2 = Fake::with(Duration::from_millis(40), 0);
    let cfg = EngineConfig { workers: 8, max_concurrent_dumps: 2, ..Default::default() };
    let eng = Engine::new(cfg, fake2.clone()).unwrap();
    let hs: Vec<_> =
        (0..6).map(|i| eng.submit(spec(&format!("p{i}"), CheckpointKind::Full, 1))).collect();
    wait_all(&hs).await;
    assert_eq!(fake2.max_dumps.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_bucket_delays_writes_but_not_skips() {
    // 100 kB/s, 1 kB burst; each job reports 20 kB, so after the first the bucket owes ~19 kB
    // (~190 ms) before the next non-skip job may start.
    let fake = Fake::with(Duration::ZERO, 20_000);
    let cfg = EngineConfig {
        disk_bytes_per_sec: Some(100_000),
        disk_burst_bytes: 1_000,
        ..Default::default()
    };
    let eng = Engine::new(cfg, fake.clone()).unwrap();
    eng.submit(spec("a", CheckpointKind::Fs, 1)).wait().await.unwrap();
    let t = Instant::now();
    let skip = eng.submit(spec("b", CheckpointKind::Skip, 1));
    let fs = eng.submit(spec("c", CheckpointKind::Fs, 1));
    skip.wait().await.unwrap();
    let skip_at = t.elapsed();
    fs.wait().await.unwrap();
    let fs_at = t.elapsed();
    assert!(skip_at < Duration::from_millis(100), "skip waited {skip_at:?}");
    assert!(fs_at >= Duration::from_millis(150), "fs started after {fs_at:?}");
    assert!(fs_at < Duration::from_secs(2), "fs started after {fs_at:?}");
    assert!(eng.metrics_text().contains("crab_engine_disk_tokens_bytes"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_and_panics_reach_every_waiter() {
    let fake = Fake::with(Duration::ZERO, 0);
    let eng = Engine::new(EngineConfig::default(), fake.clone()).unwrap();
    let bad = eng.submit(spec("bad1", CheckpointKind::Fs, 3));
    let boom = eng.submit(spec("panic1", CheckpointKind::Full, 1));
    let good = eng.submit(spec("good", CheckpointKind::Fs, 1));
    match bad.wait().await {
        Err(e @ JobError::Failed { .. }) => {
            let typed = e.source_as::<FakeError>().expect("the executor's own error type");
            assert!(typed.0.contains("no space"), "{typed:?}");
            let JobError::Failed { sandbox, turn, message, kind, .. } = e else { unreachable!() };
            assert_eq!((sandbox.as_str(), turn, kind), ("bad1", 3, CheckpointKind::Fs));
            assert!(message.contains("no space"));
        }
        other => panic!("expected failure, got {other:?}"),
    }
    let err = boom.wait().await.unwrap_err();
    assert!(matches!(err, JobError::Panicked { .. }), "{err:?}");
    assert!(err.to_string().contains("executor bug"), "{err}");
    good.wait().await.unwrap();
    // The engine still works after a panic (the dump slot was returned).
    eng.submit(spec("panic2", CheckpointKind::Process, 1)).wait().await.unwrap_err();
    eng.submit(spec("after", CheckpointKind::Process, 1)).wait().await.unwrap();
    let text = eng.metrics_text();
    assert!(text.contains("crab_engine_jobs_failed_total{kind=\"fs\"} 1"), "{text}");
    assert!(text.contains("crab_engine_jobs_failed_total{kind=\"full\"} 1"), "{text}");
    assert!(text.contains("crab_engine_running_dumps 0"), "{text}");
    let recent = eng.recent_jobs(10);
    assert_eq!(recent.len(), 5);
    assert!(recent.iter().any(|r| r.sandbox == "bad1" && r.error.is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exposed_latency_and_job_metrics_are_recorded() {
    let fake = Fake::with(Duration::from_millis(5), 123);
    let eng = Engine::new(EngineConfig::default(), fake.clone()).unwrap();
    let h = eng.submit(spec("m", CheckpointKind::Fs, 1));
    let done = h.wait().await.unwrap();
    assert!(done.run_time >= Duration::from_millis(5));
    eng.record_exposed(h.id(), "m", Duration::from_millis(3));
    let rec = &eng.recent_jobs(1)[0];
    assert_eq!(rec.bytes, 123);
    assert!(rec.run_ms >= 5.0);
    assert!(rec.exposed_ms.unwrap() >= 3.0);
    let text = eng.metrics_text();
    assert!(text.contains("crab_engine_exposed_latency_seconds_count 1"), "{text}");
    assert!(text.contains("crab_engine_bytes_total 123"), "{text}");
    assert!(text.contains("crab_engine_jobs_submitted_total{kind=\"fs\"} 1"), "{text}");
    let s = &eng.stats().sandboxes[0].stats;
    assert_eq!(s.held, 1);
    assert_eq!(s.submitted.get("fs"), Some(&1));
}

#[test]
fn engine_needs_a_runtime_and_sane_limits() {
    let fake = Fake::with(Duration::ZERO, 0);
    assert!(Engine::<Changes>::new(EngineConfig::default(), fake.clone()).is_err());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _g = rt.enter();
    let bad = EngineConfig { max_concurrent_dumps: 0, ..Default::default() };
    assert!(Engine::<Changes>::new(bad, fake).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_keep_per_sandbox_order_and_never_coalesce() {
    let fake = Fake::with(Duration::ZERO, 0);
    let eng = Engine::new(one_worker(4), fake.clone()).unwrap();
    let b = eng.submit(spec("blocker", CheckpointKind::Fs, 1));
    fake.wait_started(1);
    // Queued behind the running job: checkpoint, restore, checkpoint, checkpoint.
    let c1 = eng.submit(spec("blocker", CheckpointKind::Fs, 2));
    let r = eng.submit(JobSpec::restore("blocker", CheckpointKind::Full, written(&["ckpt-1"])));
    let c2 = eng.submit(spec("blocker", CheckpointKind::Process, 3));
    let c3 = eng.submit(spec("blocker", CheckpointKind::Fs, 4));
    assert_ne!(c1.id(), c2.id(), "no merge across a restore");
    assert_eq!(c2.id(), c3.id(), "merge after it");
    // The urgent restore drags c1 (queued before it) into the urgent queue with it.
    let o = eng.submit(spec("other", CheckpointKind::Fs, 1));
    fake.release();
    wait_all(&[b, c1, r.clone(), c2, o]).await;
    let started = fake.started.lock().unwrap().clone();
    let seq: Vec<(String, CheckpointKind, u64)> =
        started.iter().map(|s| (s.0.clone(), s.1, s.3)).collect();
    assert_eq!(
        seq,
        [
            ("blocker".to_string(), CheckpointKind::Fs, 1),
            ("blocker".to_string(), CheckpointKind::Fs, 2),
            ("blocker".to_string(), CheckpointKind::Full, 0),
            ("blocker".to_string(), CheckpointKind::Full, 4),
            ("other".to_string(), CheckpointKind::Fs, 1),
        ]
    );
    let done = r.wait().await.unwrap();
    assert_eq!(done.op, crab_engine::JobOp::Restore);
    assert!(eng.metrics_text().contains("crab_engine_restores_total 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_work_waits_behind_urgent_work_and_yields_to_it() {
    let fake = Fake::with(Duration::ZERO, 0);
    let eng = Engine::new(EngineConfig::default(), fake.clone()).unwrap();
    // Nothing urgent: granted at once.
    let p = tokio::time::timeout(Duration::from_secs(2), eng.background("export 1"))
        .await
        .expect("an idle engine grants the lane");
    assert!(!p.should_yield());
    assert!(!p.yield_to_urgent().await);
    assert_eq!(eng.stats().background_running, 1);
    // One task at a time: a second request waits for the first permit.
    let second = {
        let eng = eng.clone();
        tokio::spawn(async move { eng.background("export 2").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!second.is_finished(), "the lane holds one task at a time");
    assert_eq!(eng.stats().background_waiting, 1);
    drop(p);
    let p2 = tokio::time::timeout(Duration::from_secs(2), second)
        .await
        .expect("the lane is free again")
        .unwrap();
    // An urgent job running (the blocker, submitted urgent): the holder is told to yield and
    // waits until it is done.
    let mut urgent = spec("blocker", CheckpointKind::Fs, 1);
    urgent.urgent = true;
    let b = eng.submit(urgent);
    fake.wait_started(1);
    assert!(p2.should_yield());
    let yielding = tokio::spawn(async move {
        let waited = p2.yield_to_urgent().await;
        (waited, p2)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!yielding.is_finished(), "background work paused while urgent work runs");
    // A new request is not granted while the urgent job runs either.
    let third = {
        let eng = eng.clone();
        tokio::spawn(async move { eng.background("export 3").await })
    };
    fake.release();
    wait_all(&[b]).await;
    let (waited, p2) = tokio::time::timeout(Duration::from_secs(2), yielding)
        .await
        .expect("resumed after the urgent job")
        .unwrap();
    assert!(waited);
    assert!(eng.stats().background_yields >= 1);
    drop(p2);
    let _p3 = tokio::time::timeout(Duration::from_secs(2), third)
        .await
        .expect("granted once the urgent job is done")
        .unwrap();
    assert!(eng.metrics_text().contains("crab_engine_background_yields_total 1"));
    // A normal (not urgent) fs job does not hold background work up.
    let n = eng.submit(spec("s1", CheckpointKind::Fs, 1));
    wait_all(&[n]).await;
}
