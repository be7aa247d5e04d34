//! `crab checkpoint`, `crab checkpoints [prune]`, `crab restore`, `crab fork`: restore points.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use crab_client::{Client, Method};
use crab_common::api::{CheckpointCreateRequest, ForkRequest, PruneRequest, RestoreRequest};
use crab_common::ApiError;

use super::print_json;
use crate::output::{age, human_bytes, table};

#[derive(Debug, Args)]
pub(super) struct CheckpointArgs {
    /// Sandbox name.
    sandbox: String,
    /// auto (ask the inspector), fs, process, full or skip.
    #[arg(long, default_value = "auto")]
    kind: String,
    /// Return only once the point is durable in the daemon's --remote store.
    #[arg(long)]
    durable: bool,
}

#[derive(Debug, Args)]
pub(super) struct RestoreArgs {
    /// Sandbox name.
    sandbox: String,
    /// Restore point id (c000007, c7 or 7).
    checkpoint: Option<String>,
}

#[derive(Debug, Args)]
pub(super) struct ForkArgs {
    /// Sandbox name.
    #[arg(required_unless_present = "from_remote", conflicts_with = "from_remote")]
    sandbox: Option<String>,
    /// Fork from a point in the daemon's --remote store instead: SB or SB@POINT.
    #[arg(long, value_name = "SB[@POINT]")]
    from_remote: Option<String>,
    /// With --from-remote: files and conversation only (fresh inits, no processes).
    #[arg(long, requires = "from_remote")]
    fs_only: bool,
    /// Restore point id (the newest when absent).
    checkpoint: Option<String>,
    /// Number of branches.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Names of the branches, comma-separated (one per branch).
    #[arg(long, value_delimiter = ',')]
    names: Vec<String>,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(super) struct CheckpointsArgs {
    #[command(subcommand)]
    cmd: Option<CheckpointsCmd>,
    /// Sandbox name.
    sandbox: Option<String>,
}

#[derive(Debug, Subcommand)]
enum CheckpointsCmd {
    /// Remove old restore points (parts still referenced by kept points are kept).
    Prune {
        /// Sandbox name.
        sandbox: String,
        /// How many of the newest points to keep.
        #[arg(long)]
        keep_last: usize,
    },
}

fn ms_ago(created_at_ms: u64) -> String {
    age(created_at_ms / 1000)
}

pub(super) async fn checkpoint(
    client: &Client,
    a: CheckpointArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let CheckpointArgs { sandbox, kind, durable } = a;
    let req = CheckpointCreateRequest { kind: Some(kind), turn: None, conversation_offset: None };
    let v: serde_json::Value = client
        .call(Method::POST, &format!("/v1/sandboxes/{sandbox}/checkpoints"), Some(&req))
        .await?;
    let mut v = v;
    if durable {
        let point = v["point"]["id"].as_str().unwrap_or_default().to_string();
        let up = super::remote::wait_durable(client, &sandbox, &point).await?;
        v["durable"] = serde_json::json!({ "uploaded_bytes": up });
    }
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let p = &v["point"];
    println!(
        "{} turn {} {} ({}, {}, {:.1} ms)",
        p["id"].as_str().unwrap_or("?"),
        p["turn"],
        p["kind"].as_str().unwrap_or("?"),
        p["parts"].as_str().unwrap_or(""),
        human_bytes(p["size_bytes"].as_u64().unwrap_or(0)),
        p["took_ms"].as_f64().unwrap_or(0.0)
    );
    if let Some(up) = v["durable"]["uploaded_bytes"].as_u64() {
        println!("durable in the remote ({} uploaded)", human_bytes(up));
    }
    if let Some(rs) = v["reasons"].as_array() {
        for r in rs {
            println!("reason: {}", r.as_str().unwrap_or(""));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn checkpoints(
    client: &Client,
    a: CheckpointsArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    if let Some(CheckpointsCmd::Prune { sandbox, keep_last }) = a.cmd {
        let v: serde_json::Value = client
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{sandbox}/checkpoints/prune"),
                Some(&PruneRequest { keep_last }),
            )
            .await?;
        if json {
            print_json(&v);
        } else {
            let n = |k: &str| v[k].as_array().map(|a| a.len()).unwrap_or(0);
            println!(
                "removed {} restore points, {} process images, {} filesystem snapshots",
                n("points"),
                n("procs"),
                n("fs")
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let sandbox =
        a.sandbox.ok_or_else(|| ApiError::invalid("which sandbox?", "crab checkpoints SANDBOX"))?;
    let raw: Vec<serde_json::Value> = client
        .call::<(), _>(Method::GET, &format!("/v1/sandboxes/{sandbox}/checkpoints"), None)
        .await?;
    if json {
        print_json(&raw);
        return Ok(ExitCode::SUCCESS);
    }
    let remote_col = |r: &serde_json::Value| -> String {
        match r["state"].as_str() {
            Some("durable") => {
                format!("durable ({})", human_bytes(r["uploaded_bytes"].as_u64().unwrap_or(0)))
            }
            Some("failed") => format!("local (export failed x{})", r["attempts"]),
            Some(s) => s.to_string(),
            None => String::new(),
        }
    };
    let with_remote = raw.iter().any(|p| p.get("remote").is_some());
    let remotes: Vec<String> = raw.iter().map(|p| remote_col(&p["remote"])).collect();
    let v: Vec<crab_checkpoint::PointSummary> = raw
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<_, _>>()
        .map_err(|e| ApiError::internal(format!("undecodable point: {e}")))?;
    let rows: Vec<Vec<String>> = v
        .iter()
        .map(|p| {
            vec![
                p.id.clone(),
                p.turn.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
                p.kind.clone(),
                p.parts.clone(),
                human_bytes(p.size_bytes),
                p.took_ms.map(|t| format!("{t:.1} ms")).unwrap_or_else(|| "-".into()),
                ms_ago(p.created_at_ms),
                p.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    if with_remote {
        let rows: Vec<Vec<String>> = rows
            .into_iter()
            .zip(remotes)
            .map(|(mut r, m)| {
                r.insert(r.len() - 1, m);
                r
            })
            .collect();
        table(&["ID", "TURN", "KIND", "PARTS", "SIZE", "TOOK", "AGE", "REMOTE", "ERROR"], &rows);
        return Ok(ExitCode::SUCCESS);
    }
    table(&["ID", "TURN", "KIND", "PARTS", "SIZE", "TOOK", "AGE", "ERROR"], &rows);
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn restore(
    client: &Client,
    a: RestoreArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let RestoreArgs { sandbox, checkpoint } = a;
    let t = std::time::Instant::now();
    let v: crab_checkpoint::RestoreReport = super::staged_op(
        client,
        &format!("/v1/sandboxes/{sandbox}/restore"),
        &RestoreRequest { checkpoint },
        json,
    )
    .await?;
    if json {
        print_json(&v);
    } else {
        // What the caller waited for (the API round trip, the daemon's work around the
        // checkpointer included), then the checkpointer's own share.
        println!(
            "restored {} to {} in {:.1} ms (checkpointer {:.1} ms; {})",
            v.sandbox,
            v.point,
            t.elapsed().as_secs_f64() * 1e3,
            v.total_ms,
            if v.processes_restored {
                "files and processes"
            } else {
                "files; processes started fresh"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn fork(client: &Client, a: ForkArgs, json: bool) -> Result<ExitCode, ApiError> {
    let ForkArgs { sandbox, from_remote, fs_only, checkpoint, count, names } = a;
    if let Some(src) = from_remote {
        return super::remote::from_remote(
            client,
            src,
            names,
            count,
            fs_only,
            super::remote::Grant::default(),
            json,
        )
        .await;
    }
    let sandbox = sandbox.unwrap_or_default();
    let req = ForkRequest {
        checkpoint,
        count,
        names: if names.is_empty() { None } else { Some(names) },
        fs_only: false,
        branch: Default::default(),
    };
    let v: Vec<crab_checkpoint::ForkBranch> =
        super::staged_op(client, &format!("/v1/sandboxes/{sandbox}/fork"), &req, json).await?;
    if json {
        print_json(&v);
    } else {
        for b in &v {
            println!("{}", b.sandbox);
        }
    }
    Ok(ExitCode::SUCCESS)
}
