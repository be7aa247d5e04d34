//! E2B template builds: what the SDK's `Template.build` (and `Template().from_dockerfile(…)`,
//! which the SDK parses client-side into the same steps) calls, translated into one
//! background Dockerfile build on the host (`Backend::build_start`, `build_status`). The
//! template is the Crab image named by the template's name; `Sandbox.create(name)` then
//! creates sandboxes of it as of any image.
//!
//! * `POST /v3/templates` names the template and hands out a build id (nothing is kept).
//! * `GET /templates/{id}/files/{hash}` answers whether a COPY's files (the SDK's tar of them,
//!   named by its hash) are here, else an upload URL on this listener with a token derived
//!   from the front door's secret (HMAC of template and hash): no state per upload.
//! * `PUT /templates/{id}/files/{hash}/upload?token=…` streams the tar to
//!   `<state>/e2b/templates/<id>/files/<hash>.tar`, at most `--max-upload` bytes.
//! * `POST /v2/templates/{id}/builds/{build}` turns the steps into a Dockerfile ([`translate`]):
//!   each uploaded tar is a `FROM scratch` stage that `ADD`s it (the builder's own, bounded
//!   and contained, archive unpacking), each COPY a `COPY --from` of that stage; RUN, ENV,
//!   WORKDIR, USER as themselves. A step Crab cannot honour is refused there, naming it.
//! * `GET /templates/{id}/builds/{build}/status?logsOffset=N` is the host build's state and
//!   log lines in E2B's shapes (`building`, `ready`, `error` with the reason).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use crab_common::api::BuildJobState;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio_stream::StreamExt;

use crate::auth::{ct_eq, random_hex};
use crate::backend::Backend;
use crate::server::{RestError, Shared};

/// Most log entries one status call answers (E2B's page).
pub const LOGS_PER_CALL: usize = 100;
/// The comment that opens each E2B step's lines in the translated Dockerfile (what a build
/// error's Dockerfile line is mapped back through: [`step_of_line`]).
pub const STEP_MARK: &str = "# e2b step ";
/// The SDK's default base image (`Template().from_base_image()`).
pub const E2B_BASE_IMAGE: &str = "e2bdev/base";
/// Most steps a template may have.
pub const MAX_STEPS: usize = 1_000;

/// `POST /v3/templates` (`TemplateBuildRequestV3`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BuildRequest {
    /// `name` or `name:tag`.
    pub name: Option<String>,
    /// Extra tags.
    pub tags: Option<Vec<String>>,
    /// Older SDKs' alias.
    pub alias: Option<String>,
}

/// Its answer (`TemplateRequestResponseV3`).
#[derive(Debug, Clone, Serialize)]
pub struct BuildRequested {
    /// The template (the Crab image).
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// The build id the SDK triggers and polls.
    #[serde(rename = "buildID")]
    pub build_id: String,
    /// Always `false`.
    pub public: bool,
    /// The name.
    pub names: Vec<String>,
    /// Tags (none: Crab images have one version).
    pub tags: Vec<String>,
    /// The name again (older SDKs read aliases).
    pub aliases: Vec<String>,
}

/// One step (`TemplateStep`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Step {
    /// `RUN`, `COPY`, `ENV`, `WORKDIR`, `USER`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// COPY: the hash of its files' tar.
    pub files_hash: Option<String>,
    /// Run it again instead of using the cache.
    pub force: Option<bool>,
}

/// `POST /v2/templates/{id}/builds/{build}` (`TemplateBuildStartV2`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BuildStart {
    /// Base image (a Crab image name, or what `FROM` resolves).
    pub from_image: Option<String>,
    /// Base template (a Crab image).
    pub from_template: Option<String>,
    /// Registry credentials (refused).
    pub from_image_registry: Option<serde_json::Value>,
    /// Rebuild everything.
    pub force: Option<bool>,
    /// The steps.
    pub steps: Vec<Step>,
    /// Start command (refused).
    pub start_cmd: Option<String>,
    /// Ready command (refused).
    pub ready_cmd: Option<String>,
}

/// A build the host can run: the Dockerfile, the uploads it reads, whether to skip the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translated {
    /// The Dockerfile's text.
    pub dockerfile: String,
    /// The files hashes whose tars the build context must hold (`<hash>.tar`).
    pub files: Vec<String>,
    /// Run every step again.
    pub no_cache: bool,
}

/// A step Crab refuses: the step (E2B's numbering: 1 is the first step after the base, as
/// the SDK's `reason.step`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The step (`None`: the template as a whole).
    pub step: Option<usize>,
    /// Why, and what to do instead.
    pub message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.step {
            Some(n) => write!(f, "step {n}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

fn refuse(step: Option<usize>, message: impl Into<String>) -> Refused {
    Refused { step, message: message.into() }
}

/// A Dockerfile word inside double quotes (`"`, `\` and `$` escaped); `None` when it holds a
/// line break or NUL (a Dockerfile line cannot carry one).
fn quoted(s: &str) -> Option<String> {
    if s.contains(['\n', '\r', '\0']) {
        return None;
    }
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        if matches!(c, '"' | '\\' | '$') {
            o.push('\\');
        }
        o.push(c);
    }
    o.push('"');
    Some(o)
}

/// A JSON array (the exec form of RUN and the JSON form of COPY: any character survives).
fn json_array(items: &[&str]) -> String {
    serde_json::to_string(items).unwrap_or_else(|_| "[]".into())
}

/// A user (`name` or `name:group`) fit for `USER` and `--chown`.
fn check_user(u: &str) -> bool {
    !u.is_empty()
        && u.len() <= 65
        && !u.starts_with('-')
        && u.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

/// A files hash: hex, at most 128 characters.
pub fn check_hash(h: &str) -> bool {
    !h.is_empty() && h.len() <= 128 && h.chars().all(|c| c.is_ascii_hexdigit())
}

/// The stage that holds upload `hash`'s files.
fn stage_of(hash: &str) -> String {
    format!("e2b-files-{}", &hash[..hash.len().min(16)])
}

/// The E2B template `req` as a Dockerfile over the uploaded tars (module doc). Every step is
/// checked; the first that Crab cannot honour is refused.
pub fn translate(req: &BuildStart) -> Result<Translated, Refused> {
    if req.from_image_registry.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(refuse(
            None,
            "registry credentials (from_image with username/password, from_aws_registry, from_gcp_registry) are not supported by Crab's E2B template builds: pull the image with `crab image pull` (which reads the host's registry credentials) and use from_image(NAME)",
        ));
    }
    if req.start_cmd.is_some() || req.ready_cmd.is_some() {
        return Err(refuse(
            None,
            "set_start_cmd/set_ready_cmd (and a Dockerfile's CMD/ENTRYPOINT, which the SDK turns into a start command) are not supported by Crab's E2B template builds: Crab images record no start command for new sandboxes; start the process after Sandbox.create with commands.run(cmd, background=True)",
        ));
    }
    if req.steps.len() > MAX_STEPS {
        return Err(refuse(None, format!("more than {MAX_STEPS} steps")));
    }
    let base = match (&req.from_template, &req.from_image) {
        (Some(t), _) if !t.is_empty() => t.clone(),
        (_, Some(i)) if !i.is_empty() => i.clone(),
        _ => {
            return Err(refuse(
                None,
                "the template names no base: use from_image(NAME) with a Crab image or a registry reference, or from_template(NAME)",
            ))
        }
    };
    if base.is_empty()
        || base.len() > 512
        || base.chars().any(|c| c.is_whitespace() || c.is_control())
        || base.starts_with('-')
    {
        return Err(refuse(None, format!("base image {base:?} is not an image reference")));
    }
    let mut no_cache = req.force == Some(true);
    let mut files: Vec<String> = Vec::new();
    // The step that first copies each upload (its stage's failures are that step's).
    let mut first_copy: Vec<usize> = Vec::new();
    let mut body = String::new();
    // The user subsequent steps run as (`None`: the base image's).
    let mut user: Option<String> = None;
    for (i, s) in req.steps.iter().enumerate() {
        let n = Some(i + 1);
        no_cache |= s.force == Some(true);
        body.push_str(&format!("{STEP_MARK}{}\n", i + 1));
        let arg = |k: usize| s.args.get(k).map(String::as_str).unwrap_or("");
        let line_of = |what: &str, v: &str| {
            quoted(v)
                .map(|_| ())
                .ok_or_else(|| refuse(n, format!("{} {what} {v:?} holds a line break", s.kind)))
        };
        match s.kind.as_str() {
            "RUN" => {
                let cmd = arg(0);
                if cmd.is_empty() {
                    return Err(refuse(n, "RUN without a command"));
                }
                let run = format!("RUN {}\n", json_array(&["/bin/sh", "-c", cmd]));
                match s.args.get(1).filter(|u| !u.is_empty()) {
                    Some(u) if Some(u) != user.as_ref() => {
                        if !check_user(u) {
                            return Err(refuse(n, format!("RUN as user {u:?}: not a user name")));
                        }
                        body.push_str(&format!("USER {u}\n{run}USER {}\n", user.as_deref().unwrap_or("root")));
                    }
                    _ => body.push_str(&run),
                }
            }
            "COPY" => {
                let (src, dest, owner, mode) = (arg(0), arg(1), arg(2), arg(3));
                if src.is_empty() || dest.is_empty() {
                    return Err(refuse(n, "COPY needs a source and a destination"));
                }
                let Some(hash) = s.files_hash.as_deref().filter(|h| check_hash(h)) else {
                    return Err(refuse(n, "COPY without a valid filesHash (the SDK sends one)"));
                };
                let mut flags = format!("--from={}", stage_of(hash));
                if !owner.is_empty() {
                    if !check_user(owner) {
                        return Err(refuse(n, format!("COPY owner {owner:?}: not a user name")));
                    }
                    flags.push_str(&format!(" --chown={owner}"));
                }
                if !mode.is_empty() {
                    if !(mode.len() <= 5 && mode.chars().all(|c| ('0'..='7').contains(&c))) {
                        return Err(refuse(n, format!("COPY mode {mode:?}: not an octal mode")));
                    }
                    flags.push_str(&format!(" --chmod={mode}"));
                }
                if !files.iter().any(|f| f == hash) {
                    files.push(hash.to_string());
                    first_copy.push(i + 1);
                }
                body.push_str(&format!("COPY {flags} {}\n", json_array(&[src, dest])));
            }
            "ENV" => {
                if s.args.is_empty() || s.args.len() % 2 != 0 {
                    return Err(refuse(n, "ENV needs name, value pairs"));
                }
                let mut kv = Vec::new();
                for p in s.args.chunks(2) {
                    let (k, v) = (&p[0], &p[1]);
                    if k.is_empty()
                        || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        || k.starts_with(|c: char| c.is_ascii_digit())
                    {
                        return Err(refuse(n, format!("ENV name {k:?}: use letters, digits and _")));
                    }
                    line_of("value", v)?;
                    kv.push(format!("{k}={}", quoted(v).unwrap_or_default()));
                }
                body.push_str(&format!("ENV {}\n", kv.join(" ")));
            }
            "WORKDIR" => {
                let d = arg(0);
                if d.is_empty() {
                    return Err(refuse(n, "WORKDIR without a path"));
                }
                line_of("path", d)?;
                body.push_str(&format!("WORKDIR {}\n", quoted(d).unwrap_or_default()));
            }
            "USER" => {
                let u = arg(0);
                if !check_user(u) {
                    return Err(refuse(n, format!("USER {u:?}: not a user name")));
                }
                body.push_str(&format!("USER {u}\n"));
                user = Some(u.to_string());
            }
            other => {
                return Err(refuse(
                    n,
                    format!("step type {other:?} is not supported by Crab's E2B template builds (RUN, COPY, ENV, WORKDIR and USER are)"),
                ))
            }
        }
    }
    let mut dockerfile = String::from("# An E2B template, translated by Crab's E2B front door.\n");
    for (h, n) in files.iter().zip(&first_copy) {
        dockerfile
            .push_str(&format!("{STEP_MARK}{n}\nFROM scratch AS {}\nADD {h}.tar /\n", stage_of(h)));
    }
    dockerfile.push_str(&format!("{STEP_MARK}base\nFROM {base}\n"));
    dockerfile.push_str(&body);
    Ok(Translated { dockerfile, files, no_cache })
}

/// The E2B step (`base`, or its number) of a build error that names its Dockerfile line
/// (`… (Dockerfile line N) …`, as the builder says), read from the translated `dockerfile`.
pub fn step_of_line(dockerfile: &str, error: &str) -> Option<String> {
    let at = error.find("(Dockerfile line ")? + "(Dockerfile line ".len();
    let digits: String = error[at..].chars().take_while(char::is_ascii_digit).collect();
    let line: usize = digits.parse().ok()?;
    dockerfile
        .lines()
        .take(line)
        .filter_map(|l| l.strip_prefix(STEP_MARK))
        .last()
        .map(str::to_string)
}

// ---------------------------------------------------------------------------------------------
// Routes

/// `<state>/e2b/templates/<id>`, or why template builds cannot be served.
fn template_dir<B: Backend>(e2b: &Shared<B>, id: &str) -> Result<PathBuf, RestError> {
    crab_common::names::validate("template", id).map_err(|e| RestError::new(400, e.message))?;
    let dir = e2b.cfg().store.dir().ok_or_else(|| {
        RestError::new(
            503,
            "template builds need the E2B front door's state directory, which this daemon could not open (see its log)",
        )
    })?;
    Ok(dir.join("templates").join(id))
}

fn upload_token<B: Backend>(e2b: &Shared<B>, id: &str, hash: &str) -> String {
    e2b.cfg().store.token(&format!("template-upload/{id}/{hash}"))
}

/// The template's name without its tag (`name:tag` → `name`; only the default tag exists).
fn template_name(name: &str) -> Result<String, RestError> {
    let (base, tag) = match name.split_once(':') {
        Some((b, t)) => (b, Some(t)),
        None => (name, None),
    };
    if let Some(t) = tag {
        if !matches!(t, "" | "latest" | "default") {
            return Err(RestError::new(
                400,
                format!("template tag {t:?}: Crab templates are images with one version; build under another name instead"),
            ));
        }
    }
    crab_common::names::validate("template", base).map_err(|e| RestError::new(400, e.message))?;
    Ok(base.to_string())
}

pub(crate) async fn request_build<B: Backend>(
    State(e2b): State<Shared<B>>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let req: BuildRequest = crate::server::body(&raw)?;
    let Some(name) = req.name.or(req.alias).filter(|n| !n.is_empty()) else {
        return Err(RestError::new(400, "name is required (Template.build(template, name))"));
    };
    let id = template_name(&name)?;
    if req.tags.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(RestError::new(
            400,
            "template tags are not supported: Crab templates are images with one version",
        ));
    }
    template_dir(&e2b, &id)?;
    let out = BuildRequested {
        template_id: id.clone(),
        build_id: format!("b{}", random_hex(12)),
        public: false,
        names: vec![id.clone()],
        tags: Vec::new(),
        aliases: vec![id],
    };
    Ok((StatusCode::ACCEPTED, Json(out)).into_response())
}

pub(crate) async fn alias<B: Backend>(
    State(e2b): State<Shared<B>>,
    UrlPath(alias): UrlPath<String>,
) -> Result<Response, RestError> {
    if e2b.backend.images().await?.contains(&alias) {
        return Ok(Json(serde_json::json!({"templateID": alias, "public": false})).into_response());
    }
    Err(RestError::new(404, format!("template {alias:?} not found")))
}

pub(crate) async fn files_link<B: Backend>(
    State(e2b): State<Shared<B>>,
    UrlPath((id, hash)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, RestError> {
    if !check_hash(&hash) {
        return Err(RestError::new(400, format!("files hash {hash:?} is not hex")));
    }
    let dir = template_dir(&e2b, &id)?;
    let present = tokio::fs::metadata(dir.join("files").join(format!("{hash}.tar"))).await.is_ok();
    let body = if present {
        serde_json::json!({"present": true})
    } else {
        // The SDK uploads to where it reached this front door.
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
        if host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '[' | ']'))
        {
            return Err(RestError::new(400, "a Host header is needed to answer an upload URL"));
        }
        let token = upload_token(&e2b, &id, &hash);
        serde_json::json!({
            "present": false,
            "url": format!("http://{host}/templates/{id}/files/{hash}/upload?token={token}"),
        })
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

fn too_big(limit: u64) -> RestError {
    RestError::new(
        413,
        format!("the template's files exceed the {limit}-byte upload limit of Crab's E2B front door (raise it with `crab daemon --max-upload SIZE`)"),
    )
}

/// `PUT …/upload?token=`: the COPY's tar, streamed to disk (never whole in memory), at most
/// `--max-upload` bytes, then renamed into place.
pub(crate) async fn upload<B: Backend>(
    State(e2b): State<Shared<B>>,
    UrlPath((id, hash)): UrlPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    req: Request,
) -> Result<Response, RestError> {
    if !check_hash(&hash) {
        return Err(RestError::new(400, format!("files hash {hash:?} is not hex")));
    }
    let dir = template_dir(&e2b, &id)?;
    let token = q.get("token").map(String::as_str).unwrap_or("");
    if !ct_eq(token.as_bytes(), upload_token(&e2b, &id, &hash).as_bytes()) {
        return Err(RestError::new(
            401,
            "invalid upload token: upload to the URL GET /templates/{id}/files/{hash} answered",
        ));
    }
    let limit = e2b.cfg().max_upload;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_big(limit));
    }
    let files = dir.join("files");
    tokio::fs::create_dir_all(&files)
        .await
        .map_err(|e| RestError::new(500, format!("cannot create {}: {e}", files.display())))?;
    let part = files.join(format!(".{hash}.part-{}", random_hex(6)));
    let r = write_upload(&part, req.into_body().into_data_stream(), limit).await;
    if let Err(e) = r {
        let _ = tokio::fs::remove_file(&part).await;
        return Err(e);
    }
    let dest = files.join(format!("{hash}.tar"));
    tokio::fs::rename(&part, &dest)
        .await
        .map_err(|e| RestError::new(500, format!("cannot store {}: {e}", dest.display())))?;
    tracing::info!(template = %id, hash = %hash, "E2B template files uploaded");
    Ok(StatusCode::OK.into_response())
}

async fn write_upload(
    path: &Path,
    mut body: axum::body::BodyDataStream,
    limit: u64,
) -> Result<(), RestError> {
    let io = |e: std::io::Error| RestError::new(500, format!("writing {}: {e}", path.display()));
    let mut f = tokio::fs::File::create(path).await.map_err(io)?;
    let mut total = 0u64;
    while let Some(c) = body.next().await {
        let b =
            c.map_err(|e| RestError::new(400, format!("the upload did not arrive whole: {e}")))?;
        total += b.len() as u64;
        if total > limit {
            return Err(too_big(limit));
        }
        f.write_all(&b).await.map_err(io)?;
    }
    f.sync_all().await.map_err(io)?;
    Ok(())
}

pub(crate) async fn trigger<B: Backend>(
    State(e2b): State<Shared<B>>,
    UrlPath((id, build)): UrlPath<(String, String)>,
    raw: Bytes,
) -> Result<Response, RestError> {
    let dir = template_dir(&e2b, &id)?;
    crab_common::names::validate("build", &build).map_err(|e| RestError::new(400, e.message))?;
    let mut req: BuildStart = serde_json::from_slice(&raw)
        .map_err(|e| RestError::new(400, format!("malformed template build: {e}")))?;
    // E2B's base image (`from_base_image()`, and a Template() that names no base) is the
    // front door's default image, as E2B's `base` template is, unless an image has its name.
    if let Some(b) = req.from_image.as_deref() {
        let plain = b.strip_suffix(":latest").unwrap_or(b);
        if plain == E2B_BASE_IMAGE && !e2b.backend.images().await?.iter().any(|i| i == plain) {
            req.from_image = Some(e2b.cfg().default_image.clone());
        }
    }
    let t = translate(&req).map_err(|r| RestError::new(400, format!("template {id}: {r}")))?;
    let files = dir.join("files");
    for h in &t.files {
        if tokio::fs::metadata(files.join(format!("{h}.tar"))).await.is_err() {
            return Err(RestError::new(
                400,
                format!("template {id}: the files of hash {h} were never uploaded (GET /templates/{id}/files/{h} answers where)"),
            ));
        }
    }
    tokio::fs::create_dir_all(&files)
        .await
        .map_err(|e| RestError::new(500, format!("cannot create {}: {e}", files.display())))?;
    let builds = dir.join("builds");
    tokio::fs::create_dir_all(&builds)
        .await
        .map_err(|e| RestError::new(500, format!("cannot create {}: {e}", builds.display())))?;
    let dockerfile = builds.join(format!("{build}.Dockerfile"));
    tokio::fs::write(&dockerfile, &t.dockerfile)
        .await
        .map_err(|e| RestError::new(500, format!("cannot write {}: {e}", dockerfile.display())))?;
    e2b.backend.build_start(build.clone(), id.clone(), dockerfile, files, t.no_cache).await?;
    tracing::info!(template = %id, build = %build, "E2B template build started");
    Ok(StatusCode::ACCEPTED.into_response())
}

fn rfc3339_ms(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
}

pub(crate) async fn status<B: Backend>(
    State(e2b): State<Shared<B>>,
    UrlPath((id, build)): UrlPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, RestError> {
    let offset: u64 = match q.get("logsOffset") {
        Some(o) => {
            o.parse().map_err(|_| RestError::new(400, format!("invalid logsOffset {o:?}")))?
        }
        None => 0,
    };
    let limit: usize = match q.get("limit") {
        Some(l) => l
            .parse()
            .ok()
            .filter(|n| (1..=LOGS_PER_CALL).contains(n))
            .ok_or_else(|| RestError::new(400, format!("limit must be 1..={LOGS_PER_CALL}")))?,
        None => LOGS_PER_CALL,
    };
    crab_common::names::validate("build", &build).map_err(|_| {
        RestError::new(404, format!("build {build:?} of template {id:?} not found"))
    })?;
    let s = match e2b.backend.build_status(build.clone(), offset, limit).await {
        Ok(s) if s.image == id => s,
        Ok(_) | Err(_) => {
            return Err(RestError::new(
                404,
                format!("build {build:?} of template {id:?} not found"),
            ))
        }
    };
    let entry = |l: &crab_common::api::BuildLogLine| {
        serde_json::json!({
            "timestamp": rfc3339_ms(l.at_ms),
            "level": if l.level == "error" { "error" } else { "info" },
            "message": l.message,
        })
    };
    let entries: Vec<serde_json::Value> = s.lines.iter().map(entry).collect();
    let status = match s.state {
        BuildJobState::Building => "building",
        BuildJobState::Ready => "ready",
        BuildJobState::Error => "error",
    };
    let mut out = serde_json::json!({
        "templateID": id,
        "buildID": build,
        "status": status,
        "logEntries": entries,
        "logs": [],
    });
    if s.state == BuildJobState::Error {
        let message = s.error.unwrap_or_else(|| "the build failed".into());
        // The step as the SDK numbers it (it points its traceback at that call).
        let step = match template_dir(&e2b, &id) {
            Ok(dir) => {
                let df = dir.join("builds").join(format!("{build}.Dockerfile"));
                let text = tokio::fs::read_to_string(&df).await.unwrap_or_default();
                step_of_line(&text, &message)
            }
            Err(_) => None,
        };
        out["reason"] = match step {
            Some(step) => serde_json::json!({
                "message": format!("E2B step {step}: {message}"),
                "step": step,
            }),
            None => serde_json::json!({"message": message}),
        };
    }
    Ok(Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> Step {
        Step {
            kind: kind.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_chain_becomes_a_dockerfile() {
        let mut copy = step("COPY", &["file.txt", "/app/file.txt", "", "0755"]);
        copy.files_hash = Some("ab12".into());
        let req = BuildStart {
            from_image: Some("debian".into()),
            steps: vec![
                step("RUN", &["echo built > /built"]),
                copy,
                step("ENV", &["A", "x \"y\" $z", "B", "2"]),
                step("WORKDIR", &["/app"]),
                step("RUN", &["id -un > /who", "nobody"]),
                step("USER", &["user"]),
            ],
            ..Default::default()
        };
        let t = translate(&req).unwrap();
        assert_eq!(t.files, vec!["ab12".to_string()]);
        assert!(!t.no_cache);
        let want = "# An E2B template, translated by Crab's E2B front door.\n\
            # e2b step 2\nFROM scratch AS e2b-files-ab12\nADD ab12.tar /\n\
            # e2b step base\nFROM debian\n\
            # e2b step 1\nRUN [\"/bin/sh\",\"-c\",\"echo built > /built\"]\n\
            # e2b step 2\nCOPY --from=e2b-files-ab12 --chmod=0755 [\"file.txt\",\"/app/file.txt\"]\n\
            # e2b step 3\nENV A=\"x \\\"y\\\" \\$z\" B=\"2\"\n\
            # e2b step 4\nWORKDIR \"/app\"\n\
            # e2b step 5\nUSER nobody\nRUN [\"/bin/sh\",\"-c\",\"id -un > /who\"]\nUSER root\n\
            # e2b step 6\nUSER user\n";
        assert_eq!(t.dockerfile, want);
        // A build error's Dockerfile line maps back to the E2B step.
        let err = |l: usize| format!("step 9/9 RUN x (Dockerfile line {l}) failed: exit 1");
        assert_eq!(step_of_line(want, &err(3)).as_deref(), Some("2"));
        assert_eq!(step_of_line(want, &err(6)).as_deref(), Some("base"));
        assert_eq!(step_of_line(want, &err(16)).as_deref(), Some("5"));
        assert_eq!(step_of_line(want, "no line named"), None);
    }

    #[test]
    fn refusals_name_the_step() {
        let mut req = BuildStart { from_image: Some("debian".into()), ..Default::default() };
        req.steps = vec![step("RUN", &["true"]), step("ARG", &["X"])];
        let r = translate(&req).unwrap_err();
        assert_eq!(r.step, Some(2));
        assert!(r.to_string().contains("\"ARG\""), "{r}");
        req.steps = vec![step("ENV", &["A", "line\nbreak"])];
        assert_eq!(translate(&req).unwrap_err().step, Some(1));
        req.steps = vec![step("USER", &["root\nRUN evil"])];
        assert_eq!(translate(&req).unwrap_err().step, Some(1));
        req.steps = vec![step("COPY", &["a", "/b"])];
        assert!(translate(&req).unwrap_err().message.contains("filesHash"));
        req.steps = Vec::new();
        req.start_cmd = Some("sleep 1".into());
        assert!(translate(&req).unwrap_err().message.contains("set_start_cmd"));
        req.start_cmd = None;
        req.from_image = Some("debian\nRUN evil".into());
        assert!(translate(&req).is_err());
        req.from_image = None;
        assert!(translate(&req).unwrap_err().message.contains("base"));
    }

    #[test]
    fn names_and_hashes() {
        assert_eq!(template_name("env:latest").unwrap(), "env");
        assert!(template_name("env:v2").is_err());
        assert!(template_name("../x").is_err());
        assert!(check_hash("00ff"));
        assert!(!check_hash("../x"));
    }
}
