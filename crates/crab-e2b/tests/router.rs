//! The front door's routing, auth, framing and status codes over a fake host (no sandboxes):
//! what the real SDK test (crates/crab/tests/e2b.rs) relies on, checked byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use crab_common::api::{
    BranchSettings, ExecFrame, ExecRequest, LabelledPoint, ProcInfo, ProcStartRequest, ProcState,
    SandboxCreateRequest, SandboxInfo, SandboxState,
};
use crab_common::files::{FileEntry, FileKind};
use crab_common::life::{Deadline, Life, OnDeadline, Status};
use crab_common::{ApiError, CheckpointKind, ErrorCode};
use crab_e2b::{Backend, Config, E2b, Keys};
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tower::ServiceExt;

/// A host in memory: each sandbox's life as the real host records it, the transition checks
/// the real host asks (`crab_common::life`), labels as the real host keeps them.
#[derive(Debug, Default)]
struct Fake {
    sandboxes: Mutex<BTreeMap<String, FakeSb>>,
    execs: Mutex<Vec<ExecRequest>>,
    starts: Mutex<Vec<ProcStartRequest>>,
    killed: Mutex<Vec<String>>,
    /// (user, path, bytes) of each file written.
    written: Mutex<Vec<(String, String, Vec<u8>)>>,
}

#[derive(Debug, Clone, Default)]
struct FakeSb {
    life: Life,
    labels: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    template: Option<String>,
    deadline: Option<Deadline>,
    points: BTreeMap<String, Vec<String>>,
}

fn gone() -> ApiError {
    ApiError::new(ErrorCode::SandboxNotFound, "gone", "")
}

impl Fake {
    fn names(&self) -> Vec<String> {
        self.sandboxes.lock().unwrap().keys().cloned().collect()
    }
    fn with<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut FakeSb) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        f(self.sandboxes.lock().unwrap().get_mut(name).ok_or_else(gone)?)
    }
}

impl Backend for Fake {
    async fn create(&self, req: SandboxCreateRequest) -> Result<(), ApiError> {
        let deadline = crab_common::api::timeout_of(req.timeout_s, req.on_timeout.as_deref(), 0)?;
        let sb = FakeSb {
            labels: req.labels,
            env: req.env,
            template: req.template,
            deadline,
            ..Default::default()
        };
        self.sandboxes.lock().unwrap().insert(req.name.unwrap(), sb);
        Ok(())
    }
    async fn kill(&self, name: String) -> Result<(), ApiError> {
        self.killed.lock().unwrap().push(name.clone());
        let mut m = self.sandboxes.lock().unwrap();
        let sb = m.get_mut(&name).ok_or_else(gone)?;
        if sb.points.is_empty() {
            m.remove(&name);
        } else {
            sb.life = Life::Retired { why: "kept".into() };
        }
        Ok(())
    }
    async fn exec(
        &self,
        _name: String,
        req: ExecRequest,
    ) -> Result<mpsc::Receiver<ExecFrame>, ApiError> {
        // An envd start's supervisor says its pid first ("7\n").
        let launch = req.cmd.get(3).map(String::as_str) == Some("crab-envd");
        self.execs.lock().unwrap().push(req);
        let (tx, rx) = mpsc::channel(4);
        if launch {
            tx.send(ExecFrame::Stdout { d: "Nwo=".into() }).await.unwrap();
        }
        tx.send(ExecFrame::Stdout { d: "aGkK".into() }).await.unwrap();
        tx.send(ExecFrame::Exit { code: 0, timed_out: false, duration_ms: 1.0 }).await.unwrap();
        Ok(rx)
    }
    async fn checkpoint(&self, _name: String, _kind: CheckpointKind) -> Result<String, ApiError> {
        Ok("c000001".into())
    }
    async fn fork(
        &self,
        name: String,
        _point: Option<String>,
        names: Vec<String>,
        _fs_only: bool,
        branch: BranchSettings,
    ) -> Result<Vec<Result<String, ApiError>>, ApiError> {
        let src = self.with(&name, |s| Ok(s.clone()))?;
        for n in &names {
            let b = FakeSb {
                labels: branch.labels.clone().unwrap_or(src.labels.clone()),
                env: branch.env.clone().unwrap_or(src.env.clone()),
                template: branch.template.clone(),
                deadline: branch.deadline(0)?,
                ..Default::default()
            };
            self.sandboxes.lock().unwrap().insert(n.clone(), b);
        }
        Ok(names.into_iter().map(Ok).collect())
    }
    async fn pause(&self, name: String) -> Result<String, ApiError> {
        self.with(&name, |s| {
            Status { life: &s.life, alive: s.life == Life::Running }.can_pause(&name)?;
            s.life = Life::Paused { point: "c000002".into() };
            Ok("c000002".into())
        })
    }
    async fn resume(&self, name: String, _timeout_s: u64) -> Result<bool, ApiError> {
        self.with(&name, |s| {
            let todo =
                Status { life: &s.life, alive: s.life == Life::Running }.can_resume(&name, true)?;
            s.life = Life::Running;
            Ok(todo)
        })
    }
    async fn set_timeout(
        &self,
        name: String,
        timeout_s: u64,
        _extend_only: bool,
    ) -> Result<(), ApiError> {
        self.with(&name, |s| {
            s.deadline = Some(Deadline::after(0, timeout_s, OnDeadline::Kill)?);
            Ok(())
        })
    }
    async fn status(&self, name: String) -> Result<SandboxState, ApiError> {
        self.with(&name, |s| Ok(Status { life: &s.life, alive: s.life == Life::Running }.state()))
    }
    async fn sandbox(&self, name: String) -> Result<SandboxInfo, ApiError> {
        let state = self.status(name.clone()).await?;
        self.with(&name, |s| {
            let mut info: SandboxInfo = serde_json::from_value(serde_json::json!({
                "name": name, "image": "debian", "state": "running", "created_at": 1_700_000_000u64,
                "init_pid": 1, "processes": 1, "bytes_written": null, "net": "private",
                "hostname": name, "cgroup_id": 0
            }))
            .unwrap();
            info.state = state;
            info.labels = s.labels.clone();
            info.env = s.env.clone();
            info.template = s.template.clone();
            info.deadline = s.deadline;
            Ok(info)
        })
    }
    async fn sandboxes(&self) -> Result<Vec<SandboxInfo>, ApiError> {
        let mut v = Vec::new();
        for n in self.names() {
            v.push(self.sandbox(n).await?);
        }
        Ok(v)
    }
    async fn label(
        &self,
        name: String,
        point: String,
        labels: Vec<String>,
    ) -> Result<(), ApiError> {
        self.with(&name, |s| {
            s.points.entry(point).or_default().extend(labels);
            Ok(())
        })
    }
    async fn labels(&self) -> Result<Vec<LabelledPoint>, ApiError> {
        let m = self.sandboxes.lock().unwrap();
        Ok(m.iter()
            .flat_map(|(n, s)| {
                s.points.iter().map(move |(p, l)| LabelledPoint {
                    sandbox: n.clone(),
                    point: p.clone(),
                    labels: l.clone(),
                    fs_only: false,
                })
            })
            .collect())
    }
    async fn delete_label(&self, label: String) -> Result<(), ApiError> {
        let mut m = self.sandboxes.lock().unwrap();
        let found = m.iter().find_map(|(n, s)| {
            s.points.iter().find(|(_, l)| l.contains(&label)).map(|(p, _)| (n.clone(), p.clone()))
        });
        let Some((n, p)) = found else {
            return Err(ApiError::new(ErrorCode::CheckpointNotFound, "no such label", ""));
        };
        let sb = m.get_mut(&n).unwrap();
        sb.points.remove(&p);
        if sb.points.is_empty() && matches!(sb.life, Life::Retired { .. }) {
            m.remove(&n);
        }
        Ok(())
    }
    async fn images(&self) -> Result<Vec<String>, ApiError> {
        Ok(vec!["debian".into()])
    }
    async fn proc_start(&self, _name: String, req: ProcStartRequest) -> Result<ProcInfo, ApiError> {
        self.starts.lock().unwrap().push(req.clone());
        Ok(proc_info(&req))
    }
    async fn proc_list(&self, _name: String) -> Result<Vec<ProcInfo>, ApiError> {
        Ok(self.starts.lock().unwrap().iter().map(proc_info).collect())
    }
    async fn proc_get(&self, _name: String, sel: String) -> Result<ProcInfo, ApiError> {
        let s = self.starts.lock().unwrap();
        match (sel.as_str(), s.first()) {
            ("pid:7" | "0123456789abcdef", Some(r)) => Ok(proc_info(r)),
            _ => Err(ApiError::new(ErrorCode::ProcessNotFound, "no such process", "")),
        }
    }
    async fn proc_output(
        &self,
        _name: String,
        _id: String,
        _offsets: (u64, u64),
        _follow: bool,
    ) -> Result<mpsc::Receiver<ExecFrame>, ApiError> {
        let (tx, rx) = mpsc::channel(4);
        tx.send(ExecFrame::Stdout { d: "aGkK".into() }).await.unwrap();
        tx.send(ExecFrame::Exit { code: 0, timed_out: false, duration_ms: 1.0 }).await.unwrap();
        Ok(rx)
    }
    async fn proc_stdin(
        &self,
        _name: String,
        _sel: String,
        _data: Vec<u8>,
    ) -> Result<(), ApiError> {
        Ok(())
    }
    async fn proc_close_stdin(&self, _name: String, _sel: String) -> Result<(), ApiError> {
        Ok(())
    }
    async fn proc_signal(
        &self,
        _name: String,
        _sel: String,
        _signal: String,
    ) -> Result<(), ApiError> {
        Ok(())
    }
    async fn file_stat(&self, _n: String, _u: String, path: String) -> Result<FileEntry, ApiError> {
        Ok(entry(&path))
    }
    async fn file_list(
        &self,
        _n: String,
        _u: String,
        path: String,
        _depth: u32,
    ) -> Result<Vec<FileEntry>, ApiError> {
        Ok(vec![entry(&format!("{path}/a"))])
    }
    async fn file_make_dir(
        &self,
        _n: String,
        _u: String,
        path: String,
    ) -> Result<FileEntry, ApiError> {
        Ok(entry(&path))
    }
    async fn file_remove(&self, _n: String, _u: String, path: String) -> Result<(), ApiError> {
        Err(ApiError::new(ErrorCode::NotFound, format!("no such file or directory: {path}"), ""))
    }
    async fn file_rename(
        &self,
        _n: String,
        _u: String,
        _from: String,
        to: String,
    ) -> Result<FileEntry, ApiError> {
        Ok(entry(&to))
    }
    async fn file_read(
        &self,
        _n: String,
        _u: String,
        _path: String,
    ) -> Result<mpsc::Receiver<Result<Vec<u8>, ApiError>>, ApiError> {
        let (tx, rx) = mpsc::channel(2);
        tx.send(Ok(b"hi\n".to_vec())).await.unwrap();
        Ok(rx)
    }
    async fn file_write(
        &self,
        _n: String,
        user: String,
        path: String,
        mut data: mpsc::Receiver<Result<Vec<u8>, ApiError>>,
    ) -> Result<FileEntry, ApiError> {
        let mut got = Vec::new();
        while let Some(c) = data.recv().await {
            got.extend(c?);
        }
        self.written.lock().unwrap().push((user, path.clone(), got));
        Ok(entry(&path))
    }
}

fn quick(r: &ProcStartRequest) -> bool {
    r.cmd.last().is_some_and(|c| c.contains("quick"))
}

/// The one process the fake runs: supervisor pid 7, running (or already ended).
fn proc_info(r: &ProcStartRequest) -> ProcInfo {
    ProcInfo {
        id: "0123456789abcdef".into(),
        pid: Some(7),
        cmd: r.cmd.clone(),
        env: r.env.clone(),
        cwd: r.cwd.clone(),
        user: r.user.clone(),
        tag: r.tag.clone(),
        stdin: r.stdin,
        started_at: 0,
        // A command that ends before its start answered (`… quick`) is listed as exited.
        state: if quick(r) { ProcState::Exited } else { ProcState::Running },
        exit_code: quick(r).then_some(0),
        stdout_bytes: 0,
        stderr_bytes: 0,
        signalled: None,
    }
}

fn entry(path: &str) -> FileEntry {
    FileEntry {
        name: path.rsplit('/').next().unwrap_or("").into(),
        path: path.into(),
        kind: FileKind::File,
        is_symlink: false,
        symlink_target: None,
        size: 3,
        mode: 0o644,
        permissions: "-rw-r--r--".into(),
        owner: "user".into(),
        group: "user".into(),
        modified_s: 1_700_000_000.0,
    }
}

const KEY: &str = "e2b_test";

fn front() -> (Arc<E2b<Fake>>, Arc<Fake>) {
    let digest = hex::encode(Sha256::digest(KEY.as_bytes()));
    let keys = Keys::parse(&digest, "test").unwrap();
    let fake = Arc::new(Fake::default());
    (
        E2b::new(
            fake.clone(),
            Config {
                keys,
                default_image: "debian".into(),
                store: crab_e2b::Store::memory(),
                max_upload: crab_e2b::server::DEFAULT_MAX_UPLOAD,
            },
        ),
        fake,
    )
}

async fn call(e2b: &Arc<E2b<Fake>>, req: Request<Body>) -> (StatusCode, Vec<u8>) {
    let r = e2b.router().oneshot(req).await.unwrap();
    let s = r.status();
    (s, r.into_body().collect().await.unwrap().to_bytes().to_vec())
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

#[tokio::test]
async fn lifecycle_auth_and_envd_stream() {
    let (e2b, fake) = front();
    let post = |uri: &str, key: Option<&str>, body: &str| {
        let mut b = Request::post(uri).header("content-type", "application/json");
        if let Some(k) = key {
            b = b.header("x-api-key", k);
        }
        b.body(Body::from(body.to_string())).unwrap()
    };
    // No key / wrong key: 401 in E2B's error shape.
    let (s, b) = call(&e2b, post("/v2/sandboxes", None, r#"{"templateID":"base"}"#)).await;
    assert_eq!(s, 401);
    assert_eq!(json(&b)["code"], 401);
    let (s, _) = call(&e2b, post("/v2/sandboxes", Some("nope"), r#"{"templateID":"base"}"#)).await;
    assert_eq!(s, 401);
    // Unknown template: 404 naming the images.
    let (s, b) = call(&e2b, post("/v2/sandboxes", Some(KEY), r#"{"templateID":"zzz"}"#)).await;
    assert_eq!(s, 404);
    assert!(json(&b)["message"].as_str().unwrap().contains("debian"));
    // base → the default image.
    let (s, b) = call(
        &e2b,
        post("/v2/sandboxes", Some(KEY), r#"{"templateID":"base","envVars":{"A":"1"}}"#),
    )
    .await;
    assert_eq!(s, 201);
    let created = json(&b);
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    assert_eq!(fake.names(), vec![id.clone()]);
    // The sandbox's environment is the host's (its record), not the front door's.
    assert_eq!(
        fake.with(&id, |s| Ok(s.env.clone())).unwrap(),
        BTreeMap::from([("A".to_string(), "1".to_string())])
    );
    // envd with a wrong token: 401 unauthenticated; unknown sandbox: unavailable, "was not found".
    let stat = |sid: &str, tok: &str| {
        Request::post("/filesystem.Filesystem/Stat")
            .header("content-type", "application/json")
            .header("e2b-sandbox-id", sid)
            .header("x-access-token", tok)
            .body(Body::from(r#"{"path":"/"}"#))
            .unwrap()
    };
    let (s, b) = call(&e2b, stat(&id, "bad")).await;
    assert_eq!((s, json(&b)["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthenticated")));
    // Another sandbox's token: 401 before the host is asked (it learns nothing of which
    // sandboxes exist).
    let (s, _) = call(&e2b, stat("e2b-unknown", &token)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // Start: enveloped start, data, end events, then the end-of-stream envelope.
    let msg = br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"]}}"#;
    let mut framed = vec![0u8];
    framed.extend((msg.len() as u32).to_be_bytes());
    framed.extend(msg);
    let req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .body(Body::from(framed))
        .unwrap();
    let (s, body) = call(&e2b, req).await;
    assert_eq!(s, 200);
    let mut frames = Vec::new();
    let mut rest = &body[..];
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        frames.push((rest[0], json(&rest[5..5 + len])));
        rest = &rest[5 + len..];
    }
    assert!(rest.is_empty());
    assert_eq!(frames[0].1["event"]["start"]["pid"], 7);
    assert_eq!(frames[1].1["event"]["data"]["stdout"], "aGkK");
    assert_eq!(frames[2].1["event"]["end"]["exitCode"], 0);
    assert_eq!(frames[3], (2, serde_json::json!({})));
    // A command that ended before its start answered still streams its output.
    let msg = br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo quick"]}}"#;
    let mut framed = vec![0u8];
    framed.extend((msg.len() as u32).to_be_bytes());
    framed.extend(msg);
    let req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .body(Body::from(framed))
        .unwrap();
    let (s, body) = call(&e2b, req).await;
    assert_eq!(s, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("aGkK") && text.contains("exitCode"), "{text}");
    // The command was started through the host's process service as `user`, in the user's
    // home (the sandbox's own envs are the host's: its record adds them).
    let start = fake.starts.lock().unwrap()[0].clone();
    assert_eq!(start.cmd, ["/bin/bash", "-l", "-c", "echo hi"], "{start:?}");
    assert_eq!(start.user.as_deref(), Some("user"));
    assert_eq!(start.cwd.as_deref(), Some("/home/user"));
    assert!(fake.execs.lock().unwrap().is_empty(), "a start went around the process service");
    // List answers it by its supervisor's pid.
    let list = Request::post("/process.Process/List")
        .header("content-type", "application/json")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .body(Body::from("{}"))
        .unwrap();
    let (s, b) = call(&e2b, list).await;
    assert_eq!(s, 200);
    assert_eq!(json(&b)["processes"][0]["pid"], 7, "{}", String::from_utf8_lossy(&b));
    // Snapshot, then create from it: a fork, not a create.
    let (s, b) = call(&e2b, post(&format!("/sandboxes/{id}/snapshots"), Some(KEY), "{}")).await;
    assert_eq!(s, 201);
    assert_eq!(json(&b)["snapshotID"], format!("{id}:c000001"));
    let body = format!(r#"{{"templateID":"{id}:c000001"}}"#);
    let (s, b) = call(&e2b, post("/v2/sandboxes", Some(KEY), &body)).await;
    assert_eq!(s, 201);
    let branch = json(&b)["sandboxID"].as_str().unwrap().to_string();
    // A fork (which a create from an image never makes): the branch has the snapshot as its
    // template.
    let t = fake.with(&branch, |s| Ok(s.template.clone())).unwrap();
    assert_eq!(t.as_deref(), Some(format!("{id}:c000001").as_str()), "a snapshot create must fork");
    // Pause twice: 204 then 409; connect resumes.
    let (s, _) = call(&e2b, post(&format!("/sandboxes/{id}/pause"), Some(KEY), "{}")).await;
    assert_eq!(s, 204);
    let (s, _) = call(&e2b, post(&format!("/sandboxes/{id}/pause"), Some(KEY), "{}")).await;
    assert_eq!(s, 409);
    let (s, _) = call(&e2b, post(&format!("/v2/sandboxes/{id}/connect"), Some(KEY), "{}")).await;
    assert_eq!(s, 201);
    // Kill: 204, then 404.
    let del = |k: &str| {
        Request::delete(format!("/sandboxes/{id}"))
            .header("x-api-key", k)
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(call(&e2b, del(KEY)).await.0, 204);
    assert_eq!(call(&e2b, del(KEY)).await.0, 404);
    // Its envd, with its own token: unavailable, "was not found" (the SDK's not-running).
    let (s, b) = call(&e2b, stat(&id, &token)).await;
    assert_eq!(s, 503);
    assert!(json(&b)["message"].as_str().unwrap().contains("was not found"));
}

/// A second front door over the same state directory (a daemon restart) knows what the host
/// knows — same token, metadata, deadline, snapshots, since all of them are the host's — and
/// answers 404 for a sandbox the host no longer has (no reconciliation: nothing of it was the
/// front door's).
#[tokio::test]
async fn state_survives_a_restart() {
    let dir = std::env::temp_dir().join(format!("crab-e2b-router-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let digest = hex::encode(Sha256::digest(KEY.as_bytes()));
    let keys = Keys::parse(&digest, "test").unwrap();
    let fake = Arc::new(Fake::default());
    let open = |fake: &Arc<Fake>| {
        let store = crab_e2b::Store::open(&dir).unwrap();
        E2b::new(
            fake.clone(),
            Config {
                keys: keys.clone(),
                default_image: "debian".into(),
                store,
                max_upload: crab_e2b::server::DEFAULT_MAX_UPLOAD,
            },
        )
    };
    let post = |uri: &str, body: &str| {
        Request::post(uri)
            .header("content-type", "application/json")
            .header("x-api-key", KEY)
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let get = |uri: &str| Request::get(uri).header("x-api-key", KEY).body(Body::empty()).unwrap();
    let first = open(&fake);
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (s, b) = call(
            &first,
            post("/v2/sandboxes", r#"{"templateID":"base","timeout":600,"metadata":{"k":"v"}}"#),
        )
        .await;
        assert_eq!(s, 201);
        ids.push(json(&b)["sandboxID"].as_str().unwrap().to_string());
    }
    let (s, snap) = call(&first, post(&format!("/sandboxes/{}/snapshots", ids[0]), "{}")).await;
    assert_eq!(s, 201);
    let snap = json(&snap)["snapshotID"].as_str().unwrap().to_string();
    let (_, before) = call(&first, get(&format!("/sandboxes/{}", ids[0]))).await;
    let before = json(&before);
    assert_eq!(before["metadata"]["k"], "v");
    drop(first);

    let second = open(&fake);
    let (s, after) = call(&second, get(&format!("/sandboxes/{}", ids[0]))).await;
    assert_eq!(s, 200);
    let after = json(&after);
    for k in ["envdAccessToken", "endAt", "startedAt", "metadata", "state"] {
        assert_eq!(before[k], after[k], "{k} changed across the restart");
    }
    let (s, _) =
        call(&second, post("/v2/sandboxes", &format!(r#"{{"templateID":"{snap}"}}"#))).await;
    assert_eq!(s, 201, "the snapshot id was forgotten");
    // The host lost the second sandbox (removed through the CLI): the E2B API says so.
    fake.sandboxes.lock().unwrap().remove(&ids[1]);
    let (s, _) = call(&second, get(&format!("/sandboxes/{}", ids[1]))).await;
    assert_eq!(s, 404);

    // Kill of a sandbox that holds a snapshot: the host retires it (not removed), hidden, its
    // snapshot still makes sandboxes; deleting the last snapshot removes it.
    let del =
        |uri: &str| Request::delete(uri).header("x-api-key", KEY).body(Body::empty()).unwrap();
    let (s, _) = call(&second, del(&format!("/sandboxes/{}", ids[0]))).await;
    assert_eq!(s, 204);
    assert_eq!(*fake.killed.lock().unwrap(), vec![ids[0].clone()]);
    assert!(fake.names().contains(&ids[0]));
    let (s, _) = call(&second, get(&format!("/sandboxes/{}", ids[0]))).await;
    assert_eq!(s, 404);
    let (_, b) = call(&second, get("/v2/sandboxes")).await;
    let listed: Vec<String> = json(&b)
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["sandboxID"].as_str().unwrap().to_string())
        .collect();
    assert!(!listed.contains(&ids[0]), "{listed:?}");
    let (s, _) =
        call(&second, post("/v2/sandboxes", &format!(r#"{{"templateID":"{snap}"}}"#))).await;
    assert_eq!(s, 201);
    let (s, b) = call(&second, get(&format!("/snapshots?sandboxID={}", ids[0]))).await;
    assert_eq!(s, 200);
    assert_eq!(json(&b)[0]["snapshotID"], snap.as_str());
    let (s, _) = call(&second, del("/templates/debian")).await;
    assert_eq!(s, 400, "an image is not a snapshot");
    let (s, _) = call(&second, del(&format!("/templates/{snap}"))).await;
    assert_eq!(s, 204);
    assert!(!fake.names().contains(&ids[0]), "the holder was not removed");
    let (s, _) = call(&second, del(&format!("/templates/{snap}"))).await;
    assert_eq!(s, 404);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A refused upload leaves its body unread: the answer says `Connection: close`, so the client
/// does not send its next request into the socket the server is closing.
#[tokio::test]
async fn a_refused_upload_closes_the_connection() {
    let (e2b, _fake) = front();
    let req = Request::post("/files?path=/tmp/x")
        .header("e2b-sandbox-id", "no-such-sandbox")
        .header("content-type", "multipart/form-data; boundary=b")
        .body(Body::from("--b\r\ncontent-disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\nx\r\n--b--\r\n"))
        .unwrap();
    let r = e2b.router().oneshot(req).await.unwrap();
    assert!(r.status().is_client_error() || r.status().is_server_error(), "{}", r.status());
    assert_eq!(r.headers().get("connection").map(|v| v.to_str().unwrap()), Some("close"));
    // A download is refused the same way but has no body to leave unread.
    let req = Request::get("/files?path=/tmp/x")
        .header("e2b-sandbox-id", "no-such-sandbox")
        .body(Body::empty())
        .unwrap();
    let r = e2b.router().oneshot(req).await.unwrap();
    assert!(!r.status().is_success());
    assert!(r.headers().get("connection").is_none());
}

/// The file calls are codecs over the backend's file service: an entry becomes envd's
/// `EntryInfo` (size as a string, RFC 3339 time), a multipart upload reaches the service as
/// the call's user with each part's bytes, a download is the service's bytes, and a missing
/// path is Connect's `not_found`.
#[tokio::test]
async fn file_calls_go_through_the_file_service() {
    let (e2b, fake) = front();
    let (s, b) = call(
        &e2b,
        Request::post("/v2/sandboxes")
            .header("content-type", "application/json")
            .header("x-api-key", KEY)
            .body(Body::from(r#"{"templateID":"base"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(s, 201);
    let created = json(&b);
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    let rpc = |m: &str, body: &str| {
        Request::post(format!("/filesystem.Filesystem/{m}"))
            .header("content-type", "application/json")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let (s, b) = call(&e2b, rpc("Stat", r#"{"path":"/tmp/f"}"#)).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let e = &json(&b)["entry"];
    assert_eq!(
        (e["name"].as_str(), e["type"].as_str(), e["size"].as_str()),
        (Some("f"), Some("FILE_TYPE_FILE"), Some("3"))
    );
    assert!(e["modifiedTime"].as_str().unwrap().starts_with("2023-11-14T22:13:20"), "{e}");
    let (s, b) = call(&e2b, rpc("ListDir", r#"{"path":"/tmp","depth":1}"#)).await;
    assert_eq!((s, json(&b)["entries"][0]["path"].as_str()), (StatusCode::OK, Some("/tmp/a")));
    let (s, b) = call(&e2b, rpc("Remove", r#"{"path":"/tmp/gone"}"#)).await;
    assert_eq!((s, json(&b)["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    let req = Request::post("/files?path=/tmp/up&username=root")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .header("content-type", "multipart/form-data; boundary=b")
        .body(Body::from("--b\r\ncontent-disposition: form-data; name=\"file\"; filename=\"/tmp/one\"\r\n\r\nabc\r\n--b--\r\n"))
        .unwrap();
    let (s, b) = call(&e2b, req).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&b)[0]["path"], "/tmp/one");
    assert_eq!(
        *fake.written.lock().unwrap(),
        vec![("root".to_string(), "/tmp/one".to_string(), b"abc".to_vec())]
    );
    let req = Request::get("/files?path=/tmp/one")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .body(Body::empty())
        .unwrap();
    let (s, b) = call(&e2b, req).await;
    assert_eq!((s, b.as_slice()), (StatusCode::OK, &b"hi\n"[..]));
}
