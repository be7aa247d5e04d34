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
    sandbox: String,
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
    let CheckpointArgs { sandbox, kind } = a;
    let req = CheckpointCreateRequest { kind: Some(kind), turn: None, conversation_offset: None };
    let v: serde_json::Value = client
        .call(Method::POST, &format!("/v1/sandboxes/{sandbox}/checkpoints"), Some(&req))
        .await?;
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
    let v: Vec<crab_checkpoint::PointSummary> = client
        .call::<(), _>(Method::GET, &format!("/v1/sandboxes/{sandbox}/checkpoints"), None)
        .await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
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
    table(&["ID", "TURN", "KIND", "PARTS", "SIZE", "TOOK", "AGE", "ERROR"], &rows);
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn restore(
    client: &Client,
    a: RestoreArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let RestoreArgs { sandbox, checkpoint } = a;
    let v: crab_checkpoint::RestoreReport = client
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{sandbox}/restore"),
            Some(&RestoreRequest { checkpoint }),
        )
        .await?;
    if json {
        print_json(&v);
    } else {
        println!(
            "restored {} to {} in {:.1} ms ({})",
            v.sandbox,
            v.point,
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
    let ForkArgs { sandbox, checkpoint, count, names } = a;
    let req =
        ForkRequest { checkpoint, count, names: if names.is_empty() { None } else { Some(names) } };
    let v: Vec<crab_checkpoint::ForkBranch> =
        client.call(Method::POST, &format!("/v1/sandboxes/{sandbox}/fork"), Some(&req)).await?;
    if json {
        print_json(&v);
    } else {
        for b in &v {
            println!("{}", b.sandbox);
        }
    }
    Ok(ExitCode::SUCCESS)
}
