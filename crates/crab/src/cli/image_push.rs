//! `crab image push NAME REF`: the request for `POST /v1/images/push`, with the credentials
//! read here as `image pull` reads them (`--username` + `--password-stdin`, else the caller's
//! `~/.docker/config.json`); the daemon prepares the layers and uploads them. Prints the
//! reference and manifest digest pushed (`--json`: the whole report).

use clap::Args;
use crab_client::Client;
use crab_common::api::{ImagePushReport, ImagePushRequest};
use crab_common::ApiError;

use super::image_pull::credentials;
use super::{long_op, print_json};

#[derive(Debug, Args)]
pub(super) struct PushArgs {
    /// The Crab image to push.
    name: String,
    /// `[REGISTRY/]REPOSITORY[:TAG]` to push to (tag `latest` when none is named).
    reference: String,
    /// Speak plain http to the reference's registry (a loopback test registry).
    #[arg(long)]
    insecure: bool,
    /// Registry username (the password is read from stdin with --password-stdin).
    #[arg(long, requires = "password_stdin")]
    username: Option<String>,
    /// Read the registry password from stdin.
    #[arg(long, requires = "username")]
    password_stdin: bool,
}

pub(super) async fn push(client: &Client, a: PushArgs, json: bool) -> Result<(), ApiError> {
    let reference = crab_oci::registry::parse_reference(&a.reference).map_err(|e| e.to_api())?;
    let (username, password, credential_source) =
        credentials(a.username, reference.registry(), "push")?;
    let req = ImagePushRequest {
        name: a.name,
        reference: a.reference,
        insecure: a.insecure,
        username,
        password,
        credential_source,
    };
    let v = long_op(client, "/v1/images/push", &req, json).await?;
    let report: ImagePushReport =
        serde_json::from_value(v).map_err(|e| ApiError::internal(e.to_string()))?;
    if json {
        print_json(&report);
    } else {
        let sent = report.layers.iter().filter(|l| l.uploaded).count();
        println!(
            "pushed {} to {}@{} ({} layer(s), {sent} uploaded, {} already there)",
            report.name,
            report.reference,
            report.digest,
            report.layers.len(),
            report.layers.len() - sent
        );
    }
    Ok(())
}
