//! `crab conversation`: a sandbox's recorded LLM conversation, up to a restore point.

use std::process::ExitCode;

use clap::Args;
use crab_client::{Client, Method};
use crab_common::ApiError;

use super::print_json;

#[derive(Debug, Args)]
pub(super) struct ConversationArgs {
    /// Sandbox name.
    sandbox: String,
    /// Restore point id: the conversation as it was at that point.
    #[arg(long)]
    at: Option<String>,
}

pub(super) async fn run(
    client: &Client,
    a: ConversationArgs,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let ConversationArgs { sandbox, at } = a;
    let path = match &at {
        Some(a) => format!("/v1/sandboxes/{sandbox}/conversation?at={a}"),
        None => format!("/v1/sandboxes/{sandbox}/conversation"),
    };
    let v: Vec<crab_coordinator::LogRecord> =
        client.call::<(), _>(Method::GET, &path, None).await?;
    if json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    for r in &v {
        println!("--- turn {} {} {} -> {}", r.turn, r.method, r.path, r.status);
        println!(">>> {}", r.request);
        if let Some(resp) = &r.response {
            println!("<<< {resp}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
