//! `crab image …`: build (the `debian` recipe, or a Dockerfile with `-f`), import, commit (an
//! image of a sandbox's files), pull, push, list and remove images.

use std::process::ExitCode;

use clap::Subcommand;
use crab_client::{Client, Method};
use crab_common::api::{
    ImageBuildReport, ImageBuildRequest, ImageCommitRequest, ImageImportRequest, ImageInfo,
    ProgressFrame,
};
use crab_common::ApiError;

use super::{long_op, print_json};
use crate::output::{age, human_bytes, table};

#[derive(Debug, Subcommand)]
pub(super) enum ImageCmd {
    /// Build an image from a recipe (`debian`: bookworm minbase + python3, git, ...), or from a
    /// Dockerfile: `crab image build -f Dockerfile CONTEXT --name N`.
    Build {
        /// The recipe (`debian`), or with `-f` the build context directory (default: `.`).
        target: Option<String>,
        /// Build from this Dockerfile (FROM names a Crab image; RUN steps run in sandboxes;
        /// unchanged steps come from the cache).
        #[arg(short = 'f', long = "file", value_name = "DOCKERFILE")]
        file: Option<String>,
        /// Image name (default: the recipe's name; required with -f).
        #[arg(long)]
        name: Option<String>,
        /// A Dockerfile ARG's value (repeatable).
        #[arg(long = "build-arg", value_name = "KEY=VALUE")]
        build_arg: Vec<String>,
        /// Run every Dockerfile step again instead of using cached steps.
        #[arg(long)]
        no_cache: bool,
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
    /// Make an image of a sandbox's files: `SB` (now) or `SB@POINT` (a restore point's); the
    /// image keeps the defaults (env, user, workdir, cmd …) of the sandbox's image.
    Commit {
        /// `SB` or `SB@POINT`.
        source: String,
        /// The new image's name.
        name: String,
    },
    /// Pull an image from an OCI registry (Docker Hub when the reference names none).
    Pull(super::image_pull::PullArgs),
    /// Push an image to an OCI registry as an OCI image (layers it was pulled with are sent
    /// as they were; others are made from its files).
    Push(super::image_push::PushArgs),
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
        ImageCmd::Build {
            target,
            file: Some(file),
            name,
            include,
            rebuild_stale,
            build_arg,
            no_cache,
        } => {
            if !include.is_empty() || rebuild_stale {
                return Err(ApiError::invalid(
                    "--include and --rebuild-stale belong to the debian recipe, not to -f builds",
                    "drop them (a Dockerfile installs packages with RUN)",
                ));
            }
            let Some(name) = name else {
                return Err(ApiError::invalid(
                    "a Dockerfile build needs --name",
                    "give --name NAME",
                ));
            };
            let context = target.unwrap_or_else(|| ".".into());
            let abs = |what: &str, p: &str| {
                std::fs::canonicalize(p).map_err(|e| {
                    ApiError::invalid(
                        format!("cannot read the {what} {p}: {e}"),
                        "give an existing path",
                    )
                })
            };
            let mut build_args = std::collections::BTreeMap::new();
            for kv in build_arg {
                let Some((k, v)) = kv.split_once('=') else {
                    return Err(ApiError::invalid(
                        format!("--build-arg {kv:?} is not KEY=VALUE"),
                        "write --build-arg NAME=VALUE",
                    ));
                };
                build_args.insert(k.to_string(), v.to_string());
            }
            let mut req = ImageBuildRequest::debian(Some(name));
            req.distro = String::new();
            req.dockerfile = Some(abs("Dockerfile", &file)?.display().to_string());
            req.context = Some(abs("build context", &context)?.display().to_string());
            req.build_args = build_args;
            req.no_cache = no_cache;
            let v = build_op(client, &req, json).await?;
            if !json {
                let r: ImageBuildReport =
                    serde_json::from_value(v).map_err(|e| ApiError::internal(e.to_string()))?;
                let steps = r.steps.iter().filter(|s| s.cached.is_some()).count();
                let cached = r.steps.iter().filter(|s| s.cached == Some(true)).count();
                eprintln!("{steps} filesystem steps, {cached} from the cache");
                table(IMAGE_HEADER, &image_rows(std::slice::from_ref(&r.image)));
            }
            Ok(ExitCode::SUCCESS)
        }
        ImageCmd::Build {
            target,
            file: None,
            name,
            include,
            rebuild_stale,
            build_arg,
            no_cache,
        } => {
            let Some(distro) = target else {
                return Err(ApiError::invalid(
                    "image build needs a recipe (debian) or -f Dockerfile",
                    "run `crab image build debian`, or `crab image build -f Dockerfile . --name N`",
                ));
            };
            if !build_arg.is_empty() || no_cache {
                return Err(ApiError::invalid(
                    "--build-arg and --no-cache belong to Dockerfile builds",
                    "add -f Dockerfile, or drop them",
                ));
            }
            let mut req = ImageBuildRequest::debian(name);
            req.distro = distro;
            req.include = include;
            req.rebuild_stale = rebuild_stale;
            show_one(long_op(client, "/v1/images/build", &req, json).await?)
        }
        ImageCmd::Commit { source, name } => {
            let req = ImageCommitRequest { source, name };
            show_one(long_op(client, "/v1/images/commit", &req, json).await?)
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
        ImageCmd::Pull(a) => show_one(super::image_pull::pull(client, a, json).await?),
        ImageCmd::Push(a) => {
            super::image_push::push(client, a, json).await?;
            Ok(ExitCode::SUCCESS)
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
            } else if let Some(users) = v["used_by"].as_array().filter(|u| !u.is_empty()) {
                let names: Vec<&str> = users.iter().filter_map(|u| u.as_str()).collect();
                eprintln!(
                    "removed image {name}; {} sandbox(es) made from it keep working (their files \
                     and restore points are their own): {}",
                    names.len(),
                    names.join(", ")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Stream a Dockerfile build: its steps and every output line on stderr (with `--json`, every
/// frame as one JSON line on stdout, the result's `done` frame last); answers the result.
async fn build_op(
    client: &Client,
    req: &ImageBuildRequest,
    json: bool,
) -> Result<serde_json::Value, ApiError> {
    let mut result: Option<Result<serde_json::Value, ApiError>> = None;
    client
        .stream("/v1/images/build", req, |f: ProgressFrame| {
            if json {
                if let Ok(line) = serde_json::to_string(&f) {
                    println!("{line}");
                }
            } else {
                match &f {
                    ProgressFrame::Stage { name, .. } => eprintln!("==> {name}"),
                    ProgressFrame::Message { line } => eprintln!("    {line}"),
                    _ => {}
                }
            }
            match f {
                ProgressFrame::Done { result: r } => result = Some(Ok(r)),
                ProgressFrame::Error { error } => result = Some(Err(error)),
                _ => {}
            }
        })
        .await?;
    result.unwrap_or_else(|| {
        Err(ApiError::internal("the daemon ended the operation without a result"))
    })
}
