//! Checkpoint routes: take (`auto` asks the inspector), list, prune, restore in place, fork.
//!
//! A checkpoint goes through the host engine like the proxy's turn boundaries, submitted
//! urgent because a client is waiting. The inspector's turn is closed when a checkpoint is
//! decided, so a failed checkpoint would lose the turn's changeset: the daemon then remembers
//! the sandbox and makes its next `auto` checkpoint a `full` one. A restore or fork re-attaches
//! the sandboxes to the inspector, rewinds (or copies) the conversation log to the point's
//! offset, and re-opens the in-sandbox proxy endpoint in the new network namespace.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::Response;
use serde::Serialize;

use crab_checkpoint::PointSummary;
use crab_common::api::{CheckpointCreateRequest, ForkRequest, PruneRequest, RestoreRequest};
use crab_common::ApiError;
use crab_engine::JobKind;

use super::api::{blocking, err, ok, parse};
use super::turns::job_error;
use super::Daemon;

/// Answer of `POST .../checkpoints`.
#[derive(Debug, Serialize)]
struct Taken {
    point: PointSummary,
    /// The inspector's verdict when the kind was `auto`.
    #[serde(skip_serializing_if = "Option::is_none")]
    verdict: Option<crab_inspector::Verdict>,
    /// Why the kind is what it is (e.g. `inspector unavailable: ...`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    reasons: Vec<String>,
    /// Time the job waited in the engine's queue, ms.
    queue_ms: f64,
}

fn body_or_default<T: serde::de::DeserializeOwned + Default>(body: &Bytes) -> Result<T, ApiError> {
    if body.is_empty() {
        Ok(T::default())
    } else {
        parse(body)
    }
}

pub async fn create(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: CheckpointCreateRequest = match body_or_default(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    if let Err(e) = d.runtime.record(&name) {
        return err(e.into());
    }
    let explicit: Option<JobKind> = match req.kind.as_deref().unwrap_or("auto") {
        "auto" => None,
        "skip" => Some(JobKind::Skip),
        "fs" => Some(JobKind::Fs),
        "process" => Some(JobKind::Process),
        "full" => Some(JobKind::Full),
        other => {
            return err(ApiError::invalid(
                format!("unknown checkpoint kind {other:?}"),
                "use auto, skip, fs, process or full",
            ))
        }
    };
    let d2 = d.clone();
    let n = name.clone();
    // An explicit kind also closes the inspector's turn: its changes are in this checkpoint.
    let decided = blocking(move || Ok(d2.decide_kind(&n, false))).await;
    let (auto_kind, reasons, verdict) = match decided {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let (kind, reasons, verdict) = match explicit {
        Some(k) => (k, Vec::new(), None),
        None => (auto_kind, reasons, verdict),
    };
    let handle = d.submit(&name, kind, req.turn, req.conversation_offset);
    d.engine().promote(handle.id());
    match handle.wait().await {
        Ok(f) => match serde_json::from_value::<PointSummary>(f.outcome.detail) {
            Ok(point) => {
                let mut reasons = reasons;
                if let Some(why) = &point.procs_missing {
                    reasons.push(format!("filesystem only, processes missing: {why}"));
                }
                if let Some(t) = &d.remote {
                    t.kick();
                }
                ok(&Taken { point, verdict, reasons, queue_ms: f.queue_wait.as_secs_f64() * 1e3 })
            }
            Err(e) => err(ApiError::internal(format!("undecodable checkpoint summary: {e}"))),
        },
        Err(e) => {
            d.set_force_full(&name);
            let api = match &e {
                crab_engine::JobError::Failed { message, .. } => job_error(message),
                other => ApiError::internal(other.to_string()),
            };
            err(api)
        }
    }
}

pub async fn list(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    match blocking(move || {
        d.runtime.record(&name).map_err(ApiError::from)?;
        let points = d.checkpointer.list(&name).map_err(|e| e.to_api())?;
        // With --remote, each point also says whether it is local, exporting or durable.
        let mut out = Vec::with_capacity(points.len());
        for p in points {
            let mut v = serde_json::to_value(&p).map_err(|e| ApiError::internal(e.to_string()))?;
            if let (Some(t), Some(obj)) = (&d.remote, v.as_object_mut()) {
                let st = t.state(&name, &p.id);
                let st = match st {
                    Some(s) => serde_json::to_value(s).unwrap_or_default(),
                    None => serde_json::json!({"state": "local"}),
                };
                obj.insert("remote".into(), st);
            }
            out.push(v);
        }
        Ok(out)
    })
    .await
    {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

pub async fn prune(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: PruneRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    match blocking(move || {
        d.runtime.record(&name).map_err(ApiError::from)?;
        let r = d.checkpointer.prune(&name, req.keep_last).map_err(|e| e.to_api())?;
        let ids = |v: Vec<String>| serde_json::Value::from(v);
        Ok(serde_json::json!({
            "points": ids(r.points.iter().map(|p| p.to_string()).collect()),
            "procs": ids(r.procs.iter().map(|p| p.to_string()).collect()),
            "fs": ids(r.fs.iter().map(|p| p.to_string()).collect()),
        }))
    })
    .await
    {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

/// The conversation offset recorded by a restore point (`None`: the newest).
fn point_offset(d: &Daemon, name: &str, point: Option<&str>) -> Result<Option<u64>, ApiError> {
    let store = d.checkpointer.store(name).map_err(|e| e.to_api())?;
    let m = store.resolve(point).map_err(|e| e.to_api())?;
    Ok(m.conversation_offset)
}

pub async fn restore(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: RestoreRequest = match body_or_default(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let d2 = d.clone();
    let n = name.clone();
    let res = blocking(move || {
        d2.runtime.record(&n).map_err(ApiError::from)?;
        let offset = point_offset(&d2, &n, req.checkpoint.as_deref())?;
        d2.detach(&n);
        let r = d2.checkpointer.restore(&n, req.checkpoint.as_deref()).map_err(|e| e.to_api());
        // Whatever happened, the sandbox's (possibly new) cgroup is tracked again.
        d2.attach(&n);
        d2.clear_force_full(&n);
        r.map(|r| (r, offset))
    })
    .await;
    match res {
        Ok((report, offset)) => {
            if let Some(off) = offset {
                // Replay: the agent's re-sent requests up to the point are answered from the log.
                if let Err(e) = d.coordinator.restored(&name, off, true).await {
                    tracing::warn!(sandbox = %name, error = %e, "could not rewind the conversation log");
                }
            }
            d.open_sandbox_proxy(&name).await;
            ok(&report)
        }
        Err(e) => err(e),
    }
}

pub async fn fork(State(d): State<Arc<Daemon>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ForkRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    let d2 = d.clone();
    let n = name.clone();
    let res = blocking(move || {
        let offset = point_offset(&d2, &n, req.checkpoint.as_deref())?;
        let branches = d2
            .checkpointer
            .fork(&n, req.checkpoint.as_deref(), req.count, req.names)
            .map_err(|e| e.to_api())?;
        for b in &branches {
            d2.attach(&b.sandbox);
        }
        Ok((branches, offset))
    })
    .await;
    match res {
        Ok((branches, offset)) => {
            for b in &branches {
                if let Some(off) = offset {
                    if let Err(e) = d.coordinator.forked(&name, &b.sandbox, off).await {
                        tracing::warn!(sandbox = %b.sandbox, error = %e, "could not copy the conversation log");
                    }
                }
                d.open_sandbox_proxy(&b.sandbox).await;
            }
            ok(&branches)
        }
        Err(e) => err(e),
    }
}

/// `GET /v1/sandboxes/{name}/conversation?at=CKPT`.
pub async fn conversation(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if let Err(e) = d.runtime.record(&name) {
        return err(e.into());
    }
    let offset = match q.get("at") {
        Some(at) => {
            let d2 = d.clone();
            let n = name.clone();
            let at = at.clone();
            match blocking(move || point_offset(&d2, &n, Some(&at))).await {
                Ok(Some(o)) => Some(o),
                Ok(None) => {
                    return err(ApiError::invalid(
                        format!("restore point {:?} of {name} records no conversation offset", q.get("at")),
                        "points taken outside the LLM proxy have none; pick one taken at a turn boundary",
                    ))
                }
                Err(e) => return err(e),
            }
        }
        None => None,
    };
    match d.coordinator.conversation(&name, offset).await {
        Ok(records) => ok(&records),
        Err(e) => err(ApiError::internal(e.to_string())),
    }
}

/// `POST /v1/sandboxes/{name}/turns`: mark a turn boundary explicitly; answers when the turn's
/// restore point is published.
pub async fn turn(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    if let Err(e) = d.runtime.record(&name) {
        return err(e.into());
    }
    match d.coordinator.begin_turn(&name).await {
        Ok((turn, ticket)) => {
            ticket.promote();
            match ticket.wait_published().await {
                Ok(p) => ok(&serde_json::json!({ "turn": turn, "checkpoint": p.checkpoint_id })),
                Err(m) => err(job_error(&m)),
            }
        }
        Err(e) => err(ApiError::internal(e.to_string())),
    }
}
