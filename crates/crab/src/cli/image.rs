//! `crab image …`: build, import, list and remove images.

use std::process::ExitCode;

use clap::Subcommand;
use crab_client::{Client, Method};
use crab_common::api::{ImageBuildRequest, ImageImportRequest, ImageInfo};
use crab_common::ApiError;

use super::{long_op, print_json};
use crate::output::{age, human_bytes, table};

#[derive(Debug, Subcommand)]
pub(super) enum ImageCmd {
    /// Build an image from a recipe (only `debian`: bookworm minbase + python3, git, ...).
    Build {
        /// Recipe.
        distro: String,
        /// Image name (default: the recipe's name).
        #[arg(long)]
        name: Option<String>,
        /// Extra packages, comma-separated.
        #[arg(long, value_delimiter = ',')]
        include: Vec<String>,
        /// If an image of that name was built from another recipe (other packages, an older
        /// build step), rebuild it and swap it in once complete instead of refusing.
        #[arg(long)]
        rebuild_stale: bool,
    },
    /// Import an image: an OCI image layout or a `docker save` archive (directory or tar,
    /// its config and layers kept), or a root filesystem (directory or tar).
    Import {
        /// Image name.
        name: String,
        /// Directory or .tar / .tar.gz.
        path: String,
        /// For a layout holding an index: the platform to pick (OS/ARCH[/VARIANT]).
        #[arg(long)]
        platform: Option<String>,
    },
    /// List images.
    Ls,
    /// Remove an image.
    Rm {
        /// Image name.
        name: String,
    },
}

const IMAGE_HEADER: &[&str] = &["NAME", "REFERENCE", "DIGEST", "SIZE", "SHARED", "AGE", "SOURCE"];

fn image_rows(images: &[ImageInfo]) -> Vec<Vec<String>> {
    images
        .iter()
        .map(|i| {
            let digest = i
                .digest
                .as_deref()
                .map(|d| d.strip_prefix("sha256:").unwrap_or(d).chars().take(12).collect())
                .unwrap_or_else(|| "-".into());
            vec![
                i.name.clone(),
                i.reference.clone().unwrap_or_else(|| "-".into()),
                digest,
                human_bytes(i.size_bytes),
                human_bytes(i.shared_bytes),
                age(i.created_at),
                i.source.clone(),
            ]
        })
        .collect()
}

pub(super) async fn run(client: &Client, c: ImageCmd, json: bool) -> Result<ExitCode, ApiError> {
    let show_one = |v: serde_json::Value| -> Result<ExitCode, ApiError> {
        let info: ImageInfo =
            serde_json::from_value(v).map_err(|e| ApiError::internal(e.to_string()))?;
        if json {
            print_json(&info);
        } else {
            table(IMAGE_HEADER, &image_rows(std::slice::from_ref(&info)));
        }
        Ok(ExitCode::SUCCESS)
    };
    match c {
        ImageCmd::Build { distro, name, include, rebuild_stale } => {
            let req = ImageBuildRequest { distro, name, include, rebuild_stale };
            show_one(long_op(client, "/v1/images/build", &req, json).await?)
        }
        ImageCmd::Import { name, path, platform } => {
            let abs = std::fs::canonicalize(&path).map_err(|e| {
                ApiError::invalid(
                    format!("cannot read {path}: {e}"),
                    "give an existing directory or tar archive",
                )
            })?;
            let req = ImageImportRequest { name, path: abs.display().to_string(), platform };
            show_one(long_op(client, "/v1/images/import", &req, json).await?)
        }
        ImageCmd::Ls => {
            let v: Vec<ImageInfo> = client.call::<(), _>(Method::GET, "/v1/images", None).await?;
            if json {
                print_json(&v);
            } else {
                table(IMAGE_HEADER, &image_rows(&v));
            }
            Ok(ExitCode::SUCCESS)
        }
        ImageCmd::Rm { name } => {
            let v: serde_json::Value =
                client.call::<(), _>(Method::DELETE, &format!("/v1/images/{name}"), None).await?;
            if json {
                print_json(&v);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
