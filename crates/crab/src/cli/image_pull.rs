//! `crab image pull REF`: the request for `POST /v1/images/pull`, with the credentials read
//! here, on the caller's side (`--username` + `--password-stdin`, else the caller's
//! `~/.docker/config.json` `auths` or credential helper via `docker_credential`); the daemon
//! pulls, verifies and installs.

use std::io::Read;

use clap::Args;
use crab_client::Client;
use crab_common::api::ImagePullRequest;
use crab_common::ApiError;

use super::long_op;

#[derive(Debug, Args)]
pub(super) struct PullArgs {
    /// `[REGISTRY/]REPOSITORY[:TAG][@DIGEST]` (Docker Hub when no registry is named).
    reference: String,
    /// Image name (default: the repository's last component, `-`, the tag).
    #[arg(long)]
    name: Option<String>,
    /// Platform to pick from a multi-platform image: `OS/ARCH[/VARIANT]` (default linux/amd64).
    #[arg(long)]
    platform: Option<String>,
    /// Speak plain http to the reference's registry (a loopback test registry).
    #[arg(long)]
    insecure: bool,
    /// Registry username (the password is read from stdin with --password-stdin).
    #[arg(long, requires = "password_stdin")]
    username: Option<String>,
    /// Read the registry password from stdin.
    #[arg(long, requires = "username")]
    password_stdin: bool,
    /// Swap out an existing image of that name pulled from another digest.
    #[arg(long)]
    replace: bool,
}

/// Credentials for `registry` from the caller's docker config (`auths`, a credential helper).
pub(super) fn docker_config_credentials(registry: &str) -> Option<(String, String)> {
    let keys: Vec<String> = if registry == "docker.io" || registry == "index.docker.io" {
        vec!["https://index.docker.io/v1/".into(), "docker.io".into()]
    } else {
        vec![registry.to_string(), format!("https://{registry}")]
    };
    keys.iter().find_map(|k| match docker_credential::get_credential(k) {
        Ok(docker_credential::DockerCredential::UsernamePassword(u, p)) => Some((u, p)),
        _ => None,
    })
}

/// `(username, password, source)` of a request; all `None`: anonymous.
pub(super) type Creds = (Option<String>, Option<String>, Option<String>);

/// `--username` with the password from stdin, else the caller's docker config for `registry`,
/// else anonymous. `verb` names the command in hints.
pub(super) fn credentials(
    username: Option<String>,
    registry: &str,
    verb: &str,
) -> Result<Creds, ApiError> {
    if let Some(u) = username {
        let mut p = String::new();
        std::io::stdin().take(64 << 10).read_to_string(&mut p).map_err(|e| {
            ApiError::invalid(
                format!("reading the password from stdin: {e}"),
                format!(
                    "pipe it in: `echo \"$PASSWORD\" | crab image {verb} --username U --password-stdin …`"
                ),
            )
        })?;
        let p = p.trim_end_matches(['\n', '\r']).to_string();
        Ok((Some(u), Some(p), Some("--username/--password-stdin".to_string())))
    } else if let Some((u, p)) = docker_config_credentials(registry) {
        Ok((Some(u), Some(p), Some("~/.docker/config.json".to_string())))
    } else {
        Ok((None, None, None))
    }
}

pub(super) async fn pull(
    client: &Client,
    a: PullArgs,
    json: bool,
) -> Result<serde_json::Value, ApiError> {
    let reference = crab_oci::registry::parse_reference(&a.reference).map_err(|e| e.to_api())?;
    let (username, password, credential_source) =
        credentials(a.username, reference.registry(), "pull")?;
    let req = ImagePullRequest {
        reference: a.reference,
        name: a.name,
        platform: a.platform,
        insecure: a.insecure,
        username,
        password,
        credential_source,
        replace: a.replace,
    };
    long_op(client, "/v1/images/pull", &req, json).await
}
