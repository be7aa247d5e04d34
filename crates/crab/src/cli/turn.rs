//! `crab turn` and `crab inspect`: explicit turn boundaries and the current turn's OS effects.

use std::process::ExitCode;

use clap::Args;
use crab_client::{Client, Method};
use crab_common::ApiError;

use super::print_json;
use crate::output::table;

#[derive(Debug, Args)]
pub(super) struct TurnArgs {
    /// Sandbox name.
    sandbox: String,
}

#[derive(Debug, Args)]
pub(super) struct InspectArgs {
    /// Sandbox name.
    sandbox: String,
    /// Also close the turn (as a checkpoint at a turn boundary does).
    #[arg(long)]
    close: bool,
}

pub(super) async fn inspect(
    client: &Client,
    a: InspectArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let InspectArgs { sandbox, close } = a;
    let path = format!("/v1/sandboxes/{sandbox}/inspect");
    let method = if close { Method::POST } else { Method::GET };
    let v: crab_inspector::Verdict = client.call::<(), _>(method, &path, None).await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let kind = serde_json::to_value(v.kind)
        .ok()
        .and_then(|k| k.as_str().map(str::to_string))
        .unwrap_or_default();
    println!(
        "sandbox {} turn {}: {kind}{}",
        v.sandbox,
        v.turn,
        if v.conservative { " (conservative)" } else { "" }
    );
    let rows: Vec<Vec<String>> = v
        .changeset
        .iter()
        .map(|c| {
            let op = match &c.op {
                crab_inspector::ChangeOp::Rename { from } => format!("rename from {from}"),
                other => serde_json::to_value(other)
                    .ok()
                    .and_then(|o| o.get("op").and_then(|x| x.as_str()).map(str::to_string))
                    .unwrap_or_default(),
            };
            vec![op, c.path.clone()]
        })
        .collect();
    if !rows.is_empty() {
        table(&["CHANGE", "PATH"], &rows);
    }
    let p = &v.processes;
    if p.any() {
        println!("processes: born {:?} died {:?} ran {:?}", p.born, p.died, p.ran);
    }
    for r in &v.reasons {
        println!("reason: {r}");
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn turn(client: &Client, a: TurnArgs, json: bool) -> Result<ExitCode, ApiError> {
    let sandbox = a.sandbox;
    let v: serde_json::Value =
        client.call::<(), _>(Method::POST, &format!("/v1/sandboxes/{sandbox}/turns"), None).await?;
    if json {
        print_json(&v);
    } else {
        match v["checkpoint"].as_str().unwrap_or("?") {
            // The sandbox's checkpoint policy is `none`.
            "" => println!("turn {}: no checkpoint (checkpoint policy none)", v["turn"]),
            id => println!("turn {} published as {id}", v["turn"]),
        }
    }
    Ok(ExitCode::SUCCESS)
}
