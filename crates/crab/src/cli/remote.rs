//! `crab remote …` (ls, check, prune, follow, key-gen) and the `--from-remote` paths of `crab sandbox
//! create` and `crab fork`: the durable tier as the daemon's `--remote` sees it.

use std::process::ExitCode;

use clap::Subcommand;
use crab_client::{Client, Method};
use crab_common::ApiError;

use super::print_json;
use crate::output::{age, human_bytes, table};

#[derive(Debug, Subcommand)]
pub(super) enum RemoteCmd {
    /// List the points the remote holds (of one sandbox, or all).
    Ls {
        /// Sandbox name.
        sandbox: Option<String>,
    },
    /// Read and verify every object of the remote; exit 1 naming each damaged one.
    Check,
    /// Keep the newest N points of every sandbox; delete what no kept point references.
    Prune {
        /// Points to keep per sandbox (≥ 1).
        #[arg(long)]
        keep_last: usize,
    },
    /// Standby: keep the newest remote points of these sandboxes (or, with --all, of every
    /// sandbox not running here) materialized on this host, so a failover (`crab sandbox
    /// create --from-remote SB`) is a local restore. Without arguments: what is followed and
    /// held.
    Follow {
        /// Sandboxes to follow (or, with --stop, to stop following).
        sandboxes: Vec<String>,
        /// Follow every sandbox of the remote store that does not run on this host (with
        /// --stop: stop doing so).
        #[arg(long)]
        all: bool,
        /// Stop following the named sandboxes (or, with --all, every sandbox).
        #[arg(long)]
        stop: bool,
    },
    /// Write a new random key file for `crab daemon --remote-key FILE` (mode 0600).
    KeyGen {
        /// Where to write it (must not exist).
        path: std::path::PathBuf,
    },
}

pub(super) async fn run(client: &Client, c: RemoteCmd, json: bool) -> Result<ExitCode, ApiError> {
    match c {
        RemoteCmd::Ls { sandbox } => {
            let path = match &sandbox {
                Some(s) => format!("/v1/remote/points?sandbox={s}"),
                None => "/v1/remote/points".into(),
            };
            let v: Vec<crab_remote::PointRecord> =
                client.call::<(), _>(Method::GET, &path, None).await?;
            if json {
                print_json(&v);
                return Ok(ExitCode::SUCCESS);
            }
            let rows: Vec<Vec<String>> = v
                .iter()
                .map(|r| {
                    vec![
                        r.sandbox.clone(),
                        r.point.clone(),
                        r.turn.to_string(),
                        r.kind.clone(),
                        human_bytes(r.size_bytes),
                        human_bytes(r.uploaded_bytes),
                        r.host.hostname.clone(),
                        age(r.exported_at_ms / 1000),
                    ]
                })
                .collect();
            table(
                &["SANDBOX", "POINT", "TURN", "KIND", "SIZE", "UPLOADED", "HOST", "EXPORTED"],
                &rows,
            );
            Ok(ExitCode::SUCCESS)
        }
        RemoteCmd::Check => {
            let r: crab_remote::CheckReport =
                client.call::<(), _>(Method::POST, "/v1/remote/check", None).await?;
            if json {
                print_json(&r);
            } else {
                println!(
                    "{} packs, {} blobs, {} points verified ({} read); {} problems",
                    r.packs,
                    r.blobs,
                    r.points,
                    human_bytes(r.bytes),
                    r.errors.len()
                );
                for e in &r.errors {
                    println!("error: {e}");
                }
            }
            Ok(if r.errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        RemoteCmd::Prune { keep_last } => {
            let body = serde_json::json!({ "keep_last": keep_last });
            let r: crab_remote::PruneReport =
                client.call(Method::POST, "/v1/remote/prune", Some(&body)).await?;
            if json {
                print_json(&r);
            } else {
                println!(
                    "removed {} points, kept {}; deleted {} packs, repacked {}, freed {}",
                    r.removed_points.len(),
                    r.kept_points,
                    r.deleted_packs,
                    r.repacked_packs,
                    human_bytes(r.freed_bytes)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        RemoteCmd::Follow { sandboxes, all, stop } => {
            if stop && sandboxes.is_empty() && !all {
                return Err(ApiError::invalid(
                    "--stop names nothing to stop following",
                    "crab remote follow --stop SB… (or --stop --all)",
                ));
            }
            let body = serde_json::json!({
                "sandboxes": sandboxes,
                "all": if all { Some(!stop) } else { None },
                "stop": stop,
            });
            let r: crab_host::follow::FollowReport =
                client.call(Method::POST, "/v1/remote/follow", Some(&body)).await?;
            if json {
                print_json(&r);
                return Ok(ExitCode::SUCCESS);
            }
            if r.all {
                println!("following every sandbox of the remote store not running here");
            }
            let rows: Vec<Vec<String>> = r
                .sandboxes
                .iter()
                .map(|s| {
                    let state = match (&s.error, &s.point, &s.remote_point) {
                        (Some(e), _, _) => format!("error: {e}"),
                        (None, Some(p), Some(rp)) if p == rp => "up to date".into(),
                        (None, _, Some(_)) => "fetching".into(),
                        (None, _, None) => "no remote point yet".into(),
                    };
                    vec![
                        s.sandbox.clone(),
                        s.point.clone().unwrap_or_else(|| "-".into()),
                        s.remote_point.clone().unwrap_or_else(|| "-".into()),
                        s.materialized_at_ms.map_or("-".into(), |t| age(t / 1000)),
                        s.materialize_ms.map_or("-".into(), |ms| format!("{ms:.0} ms")),
                        state,
                    ]
                })
                .collect();
            table(&["SANDBOX", "HELD", "REMOTE NEWEST", "FETCHED", "TOOK", "STATE"], &rows);
            Ok(ExitCode::SUCCESS)
        }
        RemoteCmd::KeyGen { path } => {
            crab_remote::Key::generate(&path)
                .map_err(|e| ApiError::invalid(e.to_string(), "pick a new path"))?;
            println!("{}", path.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What the caller grants sandboxes built from a remote point (`None`/unset: the daemon's
/// defaults).
#[derive(Debug, Default)]
pub(super) struct Grant {
    /// `--network`.
    pub net: Option<crab_common::api::NetMode>,
    /// `--memory`, `--pids`, `--cpus`, `--disk`.
    pub limits: crab_common::api::Limits,
}

/// `crab sandbox create --from-remote` / `crab fork --from-remote`.
pub(super) async fn from_remote(
    client: &Client,
    source: String,
    names: Vec<String>,
    count: usize,
    fs_only: bool,
    grant: Grant,
    json: bool,
) -> Result<ExitCode, ApiError> {
    let mut body = serde_json::json!({
        "source": source,
        "names": if names.is_empty() { None } else { Some(names) },
        "count": count,
        "fs_only": fs_only,
    });
    if let Some(net) = grant.net {
        body["net"] = serde_json::to_value(net).unwrap_or_default();
    }
    if grant.limits != crab_common::api::Limits::default() {
        body["limits"] = serde_json::to_value(&grant.limits).unwrap_or_default();
    }
    let v: serde_json::Value = super::staged_op(client, "/v1/remote/restore", &body, json).await?;
    if json {
        print_json(&v);
    } else if let Some(bs) = v["branches"].as_array() {
        for b in bs {
            println!("{}", b["sandbox"].as_str().unwrap_or("?"));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Wait until a point is durable (`crab checkpoint --durable`).
pub(super) async fn wait_durable(
    client: &Client,
    sandbox: &str,
    point: &str,
) -> Result<u64, ApiError> {
    let v: serde_json::Value = client
        .call::<(), _>(
            Method::GET,
            &format!("/v1/remote/wait?sandbox={sandbox}&point={point}"),
            None,
        )
        .await?;
    Ok(v["uploaded_bytes"].as_u64().unwrap_or(0))
}
