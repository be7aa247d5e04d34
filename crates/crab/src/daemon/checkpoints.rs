//! Checkpoint routes: take (`auto` asks the inspector), list, prune, restore in place, fork.
//!
//! The inspector's turn is closed when a checkpoint is taken, so a failed checkpoint would lose
//! the turn's changeset: the daemon then remembers the sandbox and makes its next `auto`
//! checkpoint a `full` one. A restore or fork re-attaches the sandboxes to the inspector, whose
//! process baseline then starts from the restored tree.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;
use serde::Serialize;

use crab_checkpoint::{CheckpointRequest, Kind, PointSummary};
use crab_common::api::{CheckpointCreateRequest, ForkRequest, PruneRequest, RestoreRequest};
use crab_common::ApiError;

use super::api::{blocking, err, ok, parse};
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
}

fn to_kind(k: crab_inspector::VerdictKind) -> Kind {
    match k {
        crab_inspector::VerdictKind::Skip => Kind::Skip,
        crab_inspector::VerdictKind::Fs => Kind::Fs,
        crab_inspector::VerdictKind::Process => Kind::Process,
        crab_inspector::VerdictKind::Full => Kind::Full,
    }
}

/// Decide the kind of a checkpoint and take it (blocking). Used by the route and by the turn
/// protocol of the LLM proxy.
pub fn take_checkpoint(
    d: &Daemon,
    name: &str,
    req: &CheckpointCreateRequest,
) -> Result<(PointSummary, Option<crab_inspector::Verdict>, Vec<String>), ApiError> {
    d.runtime.record(name).map_err(ApiError::from)?;
    let mut reasons = Vec::new();
    let mut verdict = None;
    let requested = req.kind.as_deref().unwrap_or("auto");
    let kind = if requested == "auto" {
        match d.inspector() {
            Ok(i) => {
                let v = i.take(name).map_err(|e| e.to_api())?;
                let mut k = to_kind(v.kind);
                if d.take_force_full(name) && k != Kind::Full {
                    reasons.push("the previous checkpoint failed: taking a full one".into());
                    k = Kind::Full;
                }
                verdict = Some(v);
                k
            }
            Err(e) => {
                reasons.push(format!(
                    "inspector unavailable ({}): taking a full checkpoint",
                    e.message
                ));
                Kind::Full
            }
        }
    } else {
        let k: Kind = requested
            .parse()
            .map_err(|m: String| ApiError::invalid(m, "use auto, skip, fs, process or full"))?;
        if let Ok(i) = d.inspector() {
            // An explicit checkpoint also ends the inspector's turn.
            let _ = i.take(name);
        }
        k
    };
    let creq =
        CheckpointRequest { kind, turn: req.turn, conversation_offset: req.conversation_offset };
    match d.checkpointer.checkpoint(name, creq) {
        Ok(m) => Ok((PointSummary::of(&m), verdict, reasons)),
        Err(e) => {
            d.set_force_full(name);
            Err(e.to_api())
        }
    }
}

pub async fn create(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: CheckpointCreateRequest = if body.is_empty() {
        CheckpointCreateRequest::default()
    } else {
        match parse(&body) {
            Ok(r) => r,
            Err(e) => return err(e),
        }
    };
    match blocking(move || take_checkpoint(&d, &name, &req)).await {
        Ok((point, verdict, reasons)) => ok(&Taken { point, verdict, reasons }),
        Err(e) => err(e),
    }
}

pub async fn list(State(d): State<Arc<Daemon>>, Path(name): Path<String>) -> Response {
    match blocking(move || {
        d.runtime.record(&name).map_err(ApiError::from)?;
        d.checkpointer.list(&name).map_err(|e| e.to_api())
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

pub async fn restore(
    State(d): State<Arc<Daemon>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: RestoreRequest = if body.is_empty() {
        RestoreRequest::default()
    } else {
        match parse(&body) {
            Ok(r) => r,
            Err(e) => return err(e),
        }
    };
    match blocking(move || {
        d.runtime.record(&name).map_err(ApiError::from)?;
        d.detach(&name);
        let r = d.checkpointer.restore(&name, req.checkpoint.as_deref()).map_err(|e| e.to_api());
        // Whatever happened, the sandbox's (possibly new) cgroup is tracked again.
        d.attach(&name);
        d.clear_force_full(&name);
        r
    })
    .await
    {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}

pub async fn fork(State(d): State<Arc<Daemon>>, Path(name): Path<String>, body: Bytes) -> Response {
    let req: ForkRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return err(e),
    };
    match blocking(move || {
        let branches = d
            .checkpointer
            .fork(&name, req.checkpoint.as_deref(), req.count, req.names)
            .map_err(|e| e.to_api())?;
        for b in &branches {
            d.attach(&b.sandbox);
        }
        Ok(branches)
    })
    .await
    {
        Ok(v) => ok(&v),
        Err(e) => err(e),
    }
}
