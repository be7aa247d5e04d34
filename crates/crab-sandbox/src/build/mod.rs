//! Dockerfile builds (`crab image build -f Dockerfile CONTEXT --name N`) and the step store.
//!
//! **Steps.** [`dockerfile::parse`] refuses what the builder cannot run before anything runs.
//! Instructions that only set configuration (ENV, ARG, USER, ENTRYPOINT, CMD, EXPOSE, LABEL,
//! SHELL, MAINTAINER, STOPSIGNAL) change the stage's [`ImageDefaults`]; the ones that change files
//! (RUN, COPY, ADD, WORKDIR) each make a *step*: a read-only btrfs subvolume
//! `<pool>/layers/build-<key>` (next to the OCI layers of [`crate::layers`]), a snapshot of its
//! parent's with the step applied, its record `build-<key>.json` written last. A RUN runs in
//! a real sandbox made from the parent tree ([`Runtime::create_on`]): the normal isolation
//! profile and user namespace, `nat` networking, as the stage's USER (the exec path's account
//! switch) in its WORKDIR with its ENV and ARGs; its output goes to the [`Progress`] line by
//! line; the sandbox's files become the step and the sandbox is removed. COPY and ADD write into a snapshot on the host side
//! through [`InRoot`] (every path resolved inside the tree, nothing written through a symlink out
//! of it) and read the context the same way (a symlink in the context is copied as a link,
//! never followed out of it); `.dockerignore` is honoured with the `ignore` crate's gitignore
//! matcher, each pattern anchored at the context's root as Docker anchors them.
//!
//! **Cache keys.** A step's key is the SHA-256 of its parent's key and everything the step's
//! result depends on: the instruction with its variables expanded, the ENV and ARG values and
//! USER/WORKDIR/SHELL a RUN runs with, for COPY the content hash (paths, modes, link targets,
//! SHA-256 of the bytes) of every file it copies, or the key of the stage it copies from, and
//! the user-namespace range the build's sandboxes run in (step trees are kept in that id space,
//! so a RUN needs no shift; the image is shifted back to image ids once at the end). The first
//! key of a stage is its base image's identity (name, creation time, digest) or `scratch`. A
//! step whose key has a complete record is a cache hit: no sandbox starts.
//!
//! **The image.** The last stage's tree becomes the image through [`image::from_tree`] (a
//! snapshot, ids shifted back, Crab's init, read-only, record last) with the Dockerfile's
//! configuration as its defaults and its steps listed in its record. Builds run one at a time
//! on a host; steps no image lists are deleted after each successful build and each image
//! removal ([`collect_unused`]). A failed step names itself and its line, the exit code and the
//! last output lines; its sandbox and staging trees are removed and no image appears (the
//! steps before it stay cached).

mod context;
pub mod dockerfile;
mod store;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use base64::Engine;
use sha2::{Digest, Sha256};

use crab_common::api::{
    BuildStep, ExecFrame, ExecRequest, IdRange, ImageDefaults, ImageInfo, NetMode,
    SandboxCreateRequest, SecurityProfile,
};
use crab_common::Progress;

use crate::error::{Result, SandboxError};
use crate::inroot::InRoot;
use crate::layers::hex;
use crate::{image, runtime, shift, Runtime};

use context::{
    can_unpack, is_archive, is_dir_in, normalize, unpack_into, Context, Entry, EntryKind,
};
use dockerfile::Instruction;
use store::{collect_locked, step_done, step_id, step_path, StepRecord, Work};
pub use store::{collect_unused, recover};

/// The label every build sandbox carries (its value: the image being built), by which
/// [`recover`] finds the ones a daemon stopped mid-build left.
pub const BUILD_LABEL: &str = "crab.build";

/// Builds run one at a time (and the collection of unused steps waits for none).
pub(super) static BUILDING: Mutex<()> = Mutex::new(());

/// Bytes of one output line shown before it is cut.
const MAX_LINE: usize = 4096;
/// Bytes of one RUN's output streamed to the progress; past it only the tail is kept.
const MAX_STREAMED: usize = 4 << 20;
/// Output lines a failed RUN's error repeats.
const TAIL_LINES: usize = 15;
/// Entries of a build context (or a stage tree COPY --from reads).
pub(super) const MAX_ENTRIES: usize = 1 << 20;
/// Bytes of a Dockerfile.
const MAX_DOCKERFILE: u64 = 4 << 20;
/// PATH of a stage whose base sets none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The shell of RUN's shell form unless SHELL says otherwise.
const DEFAULT_SHELL: [&str; 2] = ["/bin/sh", "-c"];

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildSpec {
    /// Image name.
    pub name: String,
    /// The Dockerfile (a host path).
    pub dockerfile: PathBuf,
    /// The context directory (a host path).
    pub context: PathBuf,
    /// `--build-arg` values.
    pub build_args: BTreeMap<String, String>,
    /// Run every step again.
    pub no_cache: bool,
    /// What a `FROM` naming a registry reference (`python:3.12`) builds on: the local image
    /// the host resolves it to (pulling it on first use); `None` refuses such a `FROM`.
    pub resolve_from: Option<FromResolver>,
}

/// Resolves a `FROM` registry reference to a local image name, or says why not.
#[derive(Clone)]
pub struct FromResolver(pub Arc<ResolveFn>);

/// A reference in, a local image name (or why not) out.
pub type ResolveFn = dyn Fn(&str) -> std::result::Result<String, String> + Send + Sync;

impl std::fmt::Debug for FromResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FromResolver")
    }
}

fn sha(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    hex(&h.finalize())
}

/// A build sandbox, removed (forcefully) on drop.
struct BuildSandbox<'a> {
    rt: &'a Runtime,
    name: String,
}

impl Drop for BuildSandbox<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.rt.remove(&self.name, true) {
            tracing::warn!(sandbox = %self.name, error = %e, "cannot remove a build sandbox");
        }
    }
}

/// A stage's state while it is built.
#[derive(Debug, Clone)]
struct Stage {
    alias: Option<String>,
    /// Its current tree (read-only, in the build's id space); `None`: empty (`scratch`).
    tree: Option<PathBuf>,
    /// Key of its current tree.
    key: String,
    config: ImageDefaults,
    /// ARGs in scope (name → value).
    args: BTreeMap<String, String>,
    /// Whether this stage set CMD itself (ENTRYPOINT resets an inherited one).
    cmd_set: bool,
    /// Its steps, bottom first.
    steps: Vec<String>,
    /// Name of the image it started from (recorded on its build sandboxes).
    base: String,
}

impl Stage {
    /// Variables for substitution: ARGs, then ENV over them.
    fn vars(&self) -> BTreeMap<String, String> {
        let mut v = self.args.clone();
        for kv in &self.config.env {
            if let Some((k, val)) = kv.split_once('=') {
                v.insert(k.to_string(), val.to_string());
            }
        }
        v
    }

    fn set_env(&mut self, k: &str, v: &str) {
        self.config.env.retain(|e| e.split_once('=').map(|x| x.0) != Some(k));
        self.config.env.push(format!("{k}={v}"));
    }

    fn workdir(&self) -> String {
        self.config.workdir.clone().unwrap_or_else(|| "/".into())
    }

    fn shell(&self) -> Vec<String> {
        if self.config.shell.is_empty() {
            DEFAULT_SHELL.iter().map(|s| s.to_string()).collect()
        } else {
            self.config.shell.clone()
        }
    }
}

/// One build.
struct Builder<'a> {
    rt: &'a Arc<Runtime>,
    handle: &'a tokio::runtime::Handle,
    spec: &'a BuildSpec,
    progress: &'a dyn Progress,
    ids: Option<IdRange>,
    context: Option<Context>,
    stages: Vec<Stage>,
    global_args: BTreeMap<String, String>,
    used_args: HashSet<String>,
}

/// Build image `spec.name` from a Dockerfile (see the module doc). Answers the image and every
/// instruction's step. The caller shifts the image for new sandboxes afterwards
/// ([`Runtime::prepare_image`]).
pub fn build(
    rt: &Arc<Runtime>,
    handle: &tokio::runtime::Handle,
    spec: &BuildSpec,
    progress: &dyn Progress,
) -> Result<(ImageInfo, Vec<BuildStep>)> {
    crab_common::names::validate("image", &spec.name)
        .map_err(|e| SandboxError::Invalid(e.message))?;
    if let Some((_, _, source)) = image::made_of(rt.state(), &spec.name) {
        if !source.starts_with("build -f ") {
            return Err(SandboxError::NameTaken { kind: "image", name: spec.name.clone() });
        }
    }
    let f = fs::File::open(&spec.dockerfile).map_err(SandboxError::io("open", &spec.dockerfile))?;
    let mut text = String::new();
    f.take(MAX_DOCKERFILE + 1)
        .read_to_string(&mut text)
        .map_err(SandboxError::io("read", &spec.dockerfile))?;
    if text.len() as u64 > MAX_DOCKERFILE {
        return Err(SandboxError::Invalid(format!(
            "{} is larger than {} MiB; a Dockerfile is a recipe, not a data file",
            spec.dockerfile.display(),
            MAX_DOCKERFILE >> 20
        )));
    }
    let instrs = dockerfile::parse(&text)?;
    let meta = fs::metadata(&spec.context).map_err(SandboxError::io("stat", &spec.context))?;
    if !meta.is_dir() {
        return Err(SandboxError::Invalid(format!(
            "the build context {} is not a directory",
            spec.context.display()
        )));
    }
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    let mut b = Builder {
        rt,
        handle,
        spec,
        progress,
        ids: rt.userns(),
        context: None,
        stages: Vec::new(),
        global_args: BTreeMap::new(),
        used_args: HashSet::new(),
    };
    let n = instrs.len();
    let mut report = Vec::with_capacity(n);
    for (i, ins) in instrs.iter().enumerate() {
        let text = show(ins);
        progress.stage(&format!("step {}/{n} {text}", i + 1), None);
        let cached = b.step(ins, &format!("step {}/{n} {text}", i + 1))?;
        if cached == Some(true) {
            progress.message("cached");
        }
        report.push(BuildStep { index: i + 1, line: ins.line, instruction: text, cached });
    }
    for a in spec.build_args.keys() {
        if !b.used_args.contains(a) {
            progress.message(&format!("warning: --build-arg {a} is not an ARG of this Dockerfile"));
        }
    }
    let mut last = b.stages.pop().ok_or_else(|| SandboxError::Invalid("no stage".into()))?;
    // Every stage's steps stay cached while the image exists (a multi-stage build's builder
    // stage too), the last stage's own last.
    let mut steps: Vec<String> = Vec::new();
    for s in b.stages.iter().chain(std::iter::once(&last)) {
        for id in &s.steps {
            steps.retain(|x| x != id);
            steps.push(id.clone());
        }
    }
    last.steps = steps;
    let source = format!("build -f {}", spec.dockerfile.display());
    let state = rt.state();
    // With --no-cache the steps were made again: the image is too.
    if !last.steps.is_empty() && !spec.no_cache {
        if let Some((steps, config, src)) = image::made_of(state, &spec.name) {
            if steps == last.steps && config == last.config && src == source {
                progress.message(&format!("image {} is up to date", spec.name));
                collect_locked(state);
                return Ok((image::get(state, &spec.name)?, report));
            }
        }
    }
    progress.stage("image", None);
    let ids = b.ids;
    let finish = move |p: &Path| -> Result<()> {
        match ids {
            Some(r) => shift::unshift_tree(p, r),
            None => Ok(()),
        }
    };
    let info = image::from_tree(
        state,
        &spec.name,
        last.tree.as_deref(),
        source,
        last.config,
        last.steps,
        true,
        &finish,
    )?;
    collect_locked(state);
    Ok((info, report))
}

fn shorten(s: &str) -> String {
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() > 80 {
        format!("{}…", one.chars().take(79).collect::<String>())
    } else {
        one
    }
}

/// An instruction as shown in steps and messages: keyword, flags, arguments.
fn show(ins: &Instruction) -> String {
    let flags: Vec<String> = ins
        .flags
        .iter()
        .map(|(k, v)| if v.is_empty() { format!("--{k}") } else { format!("--{k}={v}") })
        .collect();
    let mut parts = vec![ins.keyword.clone()];
    parts.extend(flags);
    parts.push(ins.args.clone());
    shorten(&parts.join(" "))
}

fn step_err(what: &str, ins: &Instruction, detail: impl Into<String>) -> SandboxError {
    SandboxError::BuildStep { step: what.to_string(), line: ins.line, detail: detail.into() }
}

impl Builder<'_> {
    fn stage(&mut self, ins: &Instruction) -> Result<&mut Stage> {
        self.stages.last_mut().ok_or_else(|| step_err(&ins.keyword, ins, "no FROM before it"))
    }

    /// Run one instruction; `Some(cached)` for the ones that make a step.
    fn step(&mut self, ins: &Instruction, what: &str) -> Result<Option<bool>> {
        let allowed: &[&str] = match ins.keyword.as_str() {
            "FROM" => &["platform"],
            "COPY" => &["chown", "chmod", "from", "link"],
            "ADD" => &["chown", "chmod", "link"],
            _ => &[],
        };
        if let Some((f, _)) = ins.flags.iter().find(|(f, _)| !allowed.contains(&f.as_str())) {
            return Err(step_err(
                what,
                ins,
                format!("{} --{f} is not supported; remove the flag", ins.keyword),
            ));
        }
        match ins.keyword.as_str() {
            "FROM" => self.from(ins, what).map(|()| None),
            "ARG" => self.arg(ins).map(|()| None),
            "ENV" => {
                let st = self.stage(ins)?;
                for (k, v) in dockerfile::pairs(&ins.args, &st.vars(), true)? {
                    st.set_env(&k, &v);
                }
                Ok(None)
            }
            "LABEL" => {
                let st = self.stage(ins)?;
                for (k, v) in dockerfile::pairs(&ins.args, &st.vars(), true)? {
                    st.config.labels.insert(k, v);
                }
                Ok(None)
            }
            "MAINTAINER" => {
                let st = self.stage(ins)?;
                st.config.labels.insert("maintainer".into(), ins.args.trim().to_string());
                Ok(None)
            }
            "STOPSIGNAL" => {
                self.progress.message("STOPSIGNAL is accepted and ignored (Crab images keep none)");
                self.stage(ins).map(|_| None)
            }
            "USER" => {
                let st = self.stage(ins)?;
                let w = dockerfile::words(&ins.args, &st.vars())?;
                if w.len() != 1 {
                    return Err(step_err(what, ins, "USER takes one user[:group]"));
                }
                st.config.user = Some(w[0].clone());
                Ok(None)
            }
            "EXPOSE" => {
                let st = self.stage(ins)?;
                for p in dockerfile::words(&ins.args, &st.vars())? {
                    let p = if p.contains('/') { p } else { format!("{p}/tcp") };
                    if !st.config.exposed_ports.contains(&p) {
                        st.config.exposed_ports.push(p);
                    }
                }
                Ok(None)
            }
            "SHELL" => {
                let st = self.stage(ins)?;
                let Some(sh) = dockerfile::json_form(&ins.args).filter(|v| !v.is_empty()) else {
                    return Err(step_err(
                        what,
                        ins,
                        "SHELL takes the JSON form: SHELL [\"/bin/bash\", \"-c\"]",
                    ));
                };
                st.config.shell = sh;
                Ok(None)
            }
            "ENTRYPOINT" | "CMD" => {
                let st = self.stage(ins)?;
                let argv = match dockerfile::json_form(&ins.args) {
                    Some(v) => v,
                    None => {
                        let mut v = st.shell();
                        v.push(ins.args.clone());
                        v
                    }
                };
                if ins.keyword == "CMD" {
                    st.config.cmd = argv;
                    st.cmd_set = true;
                } else {
                    st.config.entrypoint = argv;
                    if !st.cmd_set {
                        st.config.cmd.clear();
                    }
                }
                Ok(None)
            }
            "WORKDIR" => self.workdir(ins, what).map(Some),
            "RUN" => self.run(ins, what).map(Some),
            "COPY" | "ADD" => self.copy(ins, what).map(Some),
            other => Err(step_err(what, ins, format!("{other} is not supported"))),
        }
    }

    fn arg(&mut self, ins: &Instruction) -> Result<()> {
        let in_stage = !self.stages.is_empty();
        let vars = match self.stages.last() {
            Some(st) => st.vars(),
            None => self.global_args.clone(),
        };
        for w in dockerfile::words(&ins.args, &vars)? {
            let (k, default) = match w.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (w.clone(), None),
            };
            if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(SandboxError::Invalid(format!(
                    "Dockerfile line {}: {k:?} is not an ARG name",
                    ins.line
                )));
            }
            let value = match self.spec.build_args.get(&k) {
                Some(v) => {
                    self.used_args.insert(k.clone());
                    Some(v.clone())
                }
                None if in_stage && default.is_none() => self.global_args.get(&k).cloned(),
                None => default,
            };
            if in_stage {
                if let Some(st) = self.stages.last_mut() {
                    st.args.insert(k, value.unwrap_or_default());
                }
            } else {
                self.global_args.insert(k, value.unwrap_or_default());
            }
        }
        Ok(())
    }

    fn from(&mut self, ins: &Instruction, what: &str) -> Result<()> {
        let w = dockerfile::words(&ins.args, &self.global_args)?;
        let (name, alias) = match w.as_slice() {
            [n] => (n.clone(), None),
            [n, as_, a] if as_.eq_ignore_ascii_case("as") => (n.clone(), Some(a.to_lowercase())),
            _ => return Err(step_err(what, ins, "FROM takes IMAGE [AS NAME]")),
        };
        if let Some((_, p)) = ins.flags.iter().find(|(f, _)| f == "platform") {
            if p != "linux/amd64" && !p.is_empty() {
                return Err(step_err(
                    what,
                    ins,
                    format!("--platform={p}: this builder makes linux/amd64 images only"),
                ));
            }
        }
        let is_stage = self.stages.iter().any(|s| s.alias.as_deref() == Some(&name.to_lowercase()));
        // A registry reference, or (as Docker does) a bare name no local image has: `:latest`.
        let reference = !is_stage
            && name != "scratch"
            && (name.contains([':', '/', '@'])
                || matches!(image::get(self.rt.state(), &name), Err(SandboxError::NoImage(_))));
        let name = match &self.spec.resolve_from {
            Some(r) if reference => {
                let name =
                    if name.contains([':', '/', '@']) { name } else { format!("{name}:latest") };
                let local =
                    (r.0)(&name).map_err(|e| step_err(what, ins, format!("FROM {name}: {e}")))?;
                self.progress.message(&format!("FROM {name}: image {local}"));
                local
            }
            _ => name,
        };
        let state = self.rt.state();
        let stage = if let Some(prev) =
            self.stages.iter().find(|s| s.alias.as_deref() == Some(&name.to_lowercase()))
        {
            Stage { alias, args: BTreeMap::new(), cmd_set: false, ..prev.clone() }
        } else if name == "scratch" {
            Stage {
                alias,
                tree: None,
                key: sha(&["scratch", &ids_text(self.ids)]),
                config: ImageDefaults::default(),
                args: BTreeMap::new(),
                cmd_set: false,
                steps: Vec::new(),
                base: "scratch".into(),
            }
        } else {
            let info = match image::get(state, &name) {
                Ok(i) => i,
                Err(SandboxError::NoImage(_)) => {
                    return Err(step_err(
                        what,
                        ins,
                        format!(
                            "FROM {name}: no Crab image of that name; name one (`crab image ls`), bring it in \
                             (`crab image import`), or name a registry reference with its tag \
                             (`FROM {name}:latest`), which the daemon pulls on first use"
                        ),
                    ))
                }
                Err(e) => return Err(e),
            };
            let profile = SecurityProfile { privileged: false, userns: self.ids };
            let root = self.rt.image_root_for(&name, &profile)?;
            let digest = info.digest.clone().unwrap_or_default();
            Stage {
                alias,
                tree: Some(root),
                key: sha(&[
                    "image",
                    &name,
                    &info.created_at.to_string(),
                    &info.size_bytes.to_string(),
                    &digest,
                    &ids_text(self.ids),
                ]),
                config: info.config.clone(),
                args: BTreeMap::new(),
                cmd_set: false,
                // The base's own layers (OCI chain ids, or its build's steps): the image shares
                // their data, and `image ls` counts it as shared.
                steps: image::made_of(state, &name).map(|m| m.0).unwrap_or_default(),
                base: name.clone(),
            }
        };
        let mut stage = stage;
        // As BuildKit does: a base without PATH gets the default one (RUN needs it, and
        // `ENV PATH=/x:$PATH` extends it).
        if !stage.config.env.iter().any(|e| e.starts_with("PATH=")) {
            stage.config.env.insert(0, format!("PATH={DEFAULT_PATH}"));
        }
        self.stages.push(stage);
        Ok(())
    }

    /// Look up step `key` or make it with `make` (given a writable copy of the parent's
    /// tree, or `None` when `make` builds its own); returns whether it was cached.
    fn cached_or(
        &mut self,
        ins: &Instruction,
        key: String,
        make: impl FnOnce(&mut Self) -> Result<Work>,
    ) -> Result<bool> {
        let state = self.rt.state().clone();
        let st = self.stage(ins)?;
        let parent = st.key.clone();
        let hit = !self.spec.no_cache && step_done(&state, &key);
        if !hit {
            let work = make(self)?;
            let rec = StepRecord {
                format: 1,
                key: key.clone(),
                parent,
                instruction: show(ins),
                created_at: crab_common::clock::now_s(),
            };
            work.commit(&state, &key, &rec)?;
        }
        let st = self.stage(ins)?;
        st.tree = Some(step_path(&state, &key));
        st.key = key.clone();
        st.steps.push(step_id(&key));
        Ok(hit)
    }

    fn workdir(&mut self, ins: &Instruction, what: &str) -> Result<bool> {
        let st = self.stage(ins)?;
        let w = dockerfile::words(&ins.args, &st.vars())?;
        if w.len() != 1 {
            return Err(step_err(what, ins, "WORKDIR takes one path"));
        }
        let dir = Path::new(&st.workdir()).join(&w[0]);
        let dir =
            normalize(&dir).ok_or_else(|| step_err(what, ins, "WORKDIR may not climb above /"))?;
        st.config.workdir = Some(format!("/{}", dir.display()));
        let key = sha(&[&st.key, "WORKDIR", &dir.to_string_lossy()]);
        let parent = st.tree.clone();
        let owner = self.owner(0, 0);
        self.cached_or(ins, key, |b| {
            let state = b.rt.state();
            let work = Work::new(state, parent.as_deref())?;
            InRoot::open(work.path())?.owned_by(Some(owner)).dir(&dir, true, false)?;
            Ok(work)
        })
    }

    /// Host owner of in-image ids (shifted into the build's range).
    fn owner(&self, uid: u32, gid: u32) -> (u32, u32) {
        match self.ids {
            Some(r) => {
                let f = |base: u32, id: u32| {
                    base + if id < r.count { id } else { 65534.min(r.count - 1) }
                };
                (f(r.uid, uid), f(r.gid, gid))
            }
            None => (uid, gid),
        }
    }

    fn run(&mut self, ins: &Instruction, what: &str) -> Result<bool> {
        let st = self.stage(ins)?.clone();
        let Some(parent) = st.tree.clone() else {
            return Err(step_err(
                what,
                ins,
                "RUN needs a shell, and a stage FROM scratch has no files yet; COPY one in first",
            ));
        };
        let argv: Vec<String> = match dockerfile::json_form(&ins.args) {
            Some(v) if ins.heredocs.is_empty() => v,
            _ => {
                let mut script = ins.args.clone();
                let only = ins.heredocs.len() == 1 && {
                    let t = ins.args.trim().trim_start_matches("<<").trim_start_matches('-');
                    t.trim_matches(|c| c == '"' || c == '\'') == ins.heredocs[0].name
                };
                if only {
                    script = ins.heredocs[0].body.clone();
                } else {
                    for h in &ins.heredocs {
                        script.push('\n');
                        script.push_str(&h.body);
                        script.push_str(&h.name);
                    }
                }
                let mut v = st.shell();
                v.push(script);
                v
            }
        };
        if argv.is_empty() {
            return Err(step_err(what, ins, "RUN needs a command"));
        }
        let mut env: Vec<String> = Vec::new();
        for (k, v) in &st.args {
            env.push(format!("{k}={v}"));
        }
        for kv in &st.config.env {
            let k = kv.split_once('=').map_or(kv.as_str(), |x| x.0);
            env.retain(|e| e.split_once('=').map(|x| x.0) != Some(k));
            env.push(kv.clone());
        }
        let user = st.config.user.clone().filter(|u| !u.is_empty());
        let cmd = argv;
        let workdir = st.workdir();
        let key = sha(&[
            &st.key,
            "RUN",
            &serde_json::to_string(&cmd).unwrap_or_default(),
            &env.join("\0"),
            &workdir,
            user.as_deref().unwrap_or("root"),
        ]);
        let req = ExecRequest {
            cmd,
            env,
            workdir: Some(workdir),
            timeout_s: None,
            stdin_b64: None,
            stdin_session: None,
            user,
        };
        let base = st.base.clone();
        self.cached_or(ins, key, |b| b.run_in_sandbox(ins, what, &parent, &base, req))
    }

    fn run_in_sandbox(
        &self,
        ins: &Instruction,
        what: &str,
        parent: &Path,
        base: &str,
        req: ExecRequest,
    ) -> Result<Work> {
        let state = self.rt.state();
        let name = format!("build-{:08x}", runtime::rand_u32());
        let mut create = SandboxCreateRequest::new(base);
        create.name = Some(name.clone());
        create.net = NetMode::Nat;
        create.checkpoint_policy = Some("none".into());
        create.labels.insert(BUILD_LABEL.into(), self.spec.name.clone());
        self.rt.create_on(&create, parent)?;
        let sb = BuildSandbox { rt: self.rt, name: name.clone() };
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        self.handle.spawn(crate::exec::run(self.rt.clone(), name.clone(), req, tx, None));
        let mut lines = Lines::new(self.progress);
        let mut exit = None;
        while let Some(f) = rx.blocking_recv() {
            match f {
                ExecFrame::Stdout { d } | ExecFrame::Stderr { d } => {
                    let b = base64::engine::general_purpose::STANDARD.decode(d).unwrap_or_default();
                    lines.push(&b);
                }
                ExecFrame::Exit { code, .. } => exit = Some(code),
                ExecFrame::Error { error } => {
                    return Err(step_err(what, ins, format!("{}; {}", error.message, error.hint)))
                }
            }
        }
        lines.flush();
        let code = exit.unwrap_or(-1);
        if code != 0 {
            let tail: Vec<String> = lines.tail.into_iter().collect();
            return Err(step_err(
                what,
                ins,
                format!(
                    "the command exited with code {code}; its last output lines:\n{}",
                    if tail.is_empty() { "(none)".to_string() } else { tail.join("\n") }
                ),
            ));
        }
        // Whatever it left running is stopped before its files are taken.
        self.rt.stop(&name)?;
        let work = Work::new(state, Some(&state.sandbox_rootfs(&name)))?;
        drop(sb);
        unpersonalize(parent, work.path())?;
        Ok(work)
    }

    fn copy(&mut self, ins: &Instruction, what: &str) -> Result<bool> {
        let st = self.stage(ins)?.clone();
        let vars = st.vars();
        let add = ins.keyword == "ADD";
        let flag = |n: &str| ins.flags.iter().find(|(f, _)| f == n).map(|(_, v)| v.clone());
        let mut words = match dockerfile::json_form(&ins.args) {
            Some(v) => v,
            None => dockerfile::words(&ins.args, &vars)?,
        };
        if words.len() < 2 {
            return Err(step_err(
                what,
                ins,
                format!("{} needs a source and a destination", ins.keyword),
            ));
        }
        let dest = words.pop().unwrap_or_default();
        let dest_dir_form = dest.ends_with('/') || words.len() > 1;
        let dest = normalize(&Path::new(&st.workdir()).join(&dest))
            .ok_or_else(|| step_err(what, ins, "the destination may not climb above /"))?;
        // Where the sources come from.
        let from = flag("from");
        let (src_root, src_key): (Option<PathBuf>, Option<String>) = match &from {
            None => (None, None),
            Some(f) => {
                let f = dockerfile::words(f, &vars)?.join("");
                let by_alias =
                    self.stages.iter().find(|s| s.alias.as_deref() == Some(&f.to_lowercase()));
                let by_index = f.parse::<usize>().ok().and_then(|i| self.stages.get(i));
                match by_alias.or(by_index) {
                    Some(s) => (s.tree.clone(), Some(s.key.clone())),
                    None => {
                        let info = image::get(self.rt.state(), &f).map_err(|_| {
                            step_err(
                                what,
                                ins,
                                format!(
                                    "--from={f}: no earlier stage and no Crab image of that name"
                                ),
                            )
                        })?;
                        let profile = SecurityProfile { privileged: false, userns: self.ids };
                        let root = self.rt.image_root_for(&f, &profile)?;
                        (Some(root), Some(sha(&["image", &f, &info.created_at.to_string()])))
                    }
                }
            }
        };
        let mut items: Vec<Item> = Vec::new();
        let mut hash = Sha256::new();
        for w in &words {
            if let Some(h) = w
                .strip_prefix("<<")
                .map(|n| n.trim_start_matches('-').trim_matches(|c| c == '"' || c == '\''))
            {
                let Some(doc) = ins.heredocs.iter().find(|d| d.name == h) else {
                    return Err(step_err(what, ins, format!("no heredoc named {h}")));
                };
                let body = if doc.expand {
                    dockerfile::expand(&doc.body, &vars)?
                } else {
                    doc.body.clone()
                };
                hash.update(b"heredoc\0");
                hash.update(h.as_bytes());
                hash.update(body.as_bytes());
                items.push(Item {
                    rel: PathBuf::from(h),
                    to_dir: true,
                    kind: ItemKind::Inline(body.into_bytes()),
                    mode: 0o644,
                });
                continue;
            }
            if add && (w.contains("://") || w.starts_with("git@")) {
                return Err(step_err(what, ins, format!("ADD {w}: URLs are not fetched; download it in a RUN step (curl) or into the context first")));
            }
            let entries: Vec<Entry> = match &src_root {
                None if from.is_some() => {
                    return Err(step_err(
                        what,
                        ins,
                        "--from names a stage with no files (FROM scratch and nothing copied)",
                    ));
                }
                None => {
                    if self.context.is_none() {
                        self.progress.message("reading the build context");
                        self.context = Some(Context::read(&self.spec.context)?);
                    }
                    let ctx = self
                        .context
                        .as_ref()
                        .ok_or_else(|| SandboxError::Other("no context".into()))?;
                    ctx.select(w).map_err(|e| step_err(what, ins, e))?
                }
                Some(root) => {
                    Context::walk(root, None)?.select(w).map_err(|e| step_err(what, ins, e))?
                }
            };
            let root = src_root.clone().unwrap_or_else(|| self.spec.context.clone());
            for e in entries {
                let archive = add && e.kind == EntryKind::File && is_archive(&e.rel);
                if archive && !can_unpack(&e.rel) {
                    return Err(step_err(what, ins, format!(
                        "ADD {}: only .tar, .tar.gz/.tgz and .tar.zst archives are unpacked; COPY it and unpack it in a RUN step (tar -x)",
                        e.rel.display()
                    )));
                }
                hash.update(e.rel.to_string_lossy().as_bytes());
                hash.update(e.mode.to_le_bytes());
                match &e.kind {
                    EntryKind::Symlink(t) => hash.update(t.to_string_lossy().as_bytes()),
                    EntryKind::File if src_key.is_none() => {
                        let mut f = InRoot::open(&root)?.open_regular(&e.rel).ok_or_else(|| {
                            step_err(
                                what,
                                ins,
                                format!(
                                    "{} is not a regular file of the context any more",
                                    e.rel.display()
                                ),
                            )
                        })?;
                        std::io::copy(&mut f, &mut hash)
                            .map_err(SandboxError::io("read", root.join(&e.rel)))?;
                    }
                    _ => {}
                }
                items.push(Item {
                    rel: e.dest_rel.clone(),
                    to_dir: e.to_dir,
                    mode: e.mode,
                    kind: match e.kind {
                        EntryKind::Dir => ItemKind::Dir,
                        EntryKind::Symlink(t) => ItemKind::Symlink(t),
                        EntryKind::File if archive => {
                            ItemKind::Archive(root.clone(), e.rel.clone())
                        }
                        EntryKind::File => ItemKind::File(root.clone(), e.rel.clone()),
                    },
                });
            }
        }
        let chown =
            flag("chown").map(|c| dockerfile::words(&c, &vars).map(|w| w.join(""))).transpose()?;
        let chmod =
            match flag("chmod") {
                Some(m) => Some(u32::from_str_radix(&m, 8).map_err(|_| {
                    step_err(what, ins, format!("--chmod={m} is not an octal mode"))
                })?),
                None => None,
            };
        let key = sha(&[
            &st.key,
            &ins.keyword,
            &dest.to_string_lossy(),
            &(dest_dir_form as u8).to_string(),
            chown.as_deref().unwrap_or(""),
            &chmod.map(|m| m.to_string()).unwrap_or_default(),
            src_key.as_deref().unwrap_or("context"),
            &words.join("\0"),
            &hex(&hash.finalize()),
        ]);
        let parent = st.tree.clone();
        self.cached_or(ins, key, |b| {
            let state = b.rt.state();
            let work = Work::new(state, parent.as_deref())?;
            let tree = InRoot::open(work.path())?;
            let (uid, gid) = match &chown {
                Some(c) => lookup_owner(&tree, c).map_err(|e| step_err(what, ins, e))?,
                None => (0, 0),
            };
            let owner = b.owner(uid, gid);
            let tree = tree.owned_by(Some(owner));
            let dest_is_dir =
                dest_dir_form || dest.as_os_str().is_empty() || is_dir_in(&tree, &dest);
            for it in &items {
                let target = if it.rel.as_os_str().is_empty() || (it.to_dir && !dest_is_dir) {
                    dest.clone()
                } else {
                    dest.join(&it.rel)
                };
                let mode = chmod.unwrap_or(it.mode);
                match &it.kind {
                    ItemKind::Dir => {
                        if target.as_os_str().is_empty() {
                            continue;
                        }
                        tree.mkdir_mode(&target, mode)?
                    }
                    ItemKind::Symlink(t) => tree.symlink(&target, t)?,
                    ItemKind::Inline(bytes) => tree.write(&target, bytes, mode)?,
                    ItemKind::Archive(root, rel) => {
                        let f = InRoot::open(root)?.open_regular(rel).ok_or_else(|| {
                            step_err(
                                what,
                                ins,
                                format!(
                                    "{} is not a regular file any more",
                                    root.join(rel).display()
                                ),
                            )
                        })?;
                        let _ = nix::fcntl::fcntl(
                            std::os::fd::AsRawFd::as_raw_fd(&f),
                            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
                        );
                        unpack_into(&tree, &dest, f).map_err(|e| {
                            step_err(what, ins, format!("ADD {}: {e}", rel.display()))
                        })?
                    }
                    ItemKind::File(root, rel) => {
                        let mut f = InRoot::open(root)?.open_regular(rel).ok_or_else(|| {
                            step_err(
                                what,
                                ins,
                                format!(
                                    "{} is not a regular file any more",
                                    root.join(rel).display()
                                ),
                            )
                        })?;
                        // Nonblocking was for the open; the copy may block.
                        let _ = nix::fcntl::fcntl(
                            std::os::fd::AsRawFd::as_raw_fd(&f),
                            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
                        );
                        tree.write_from(&target, &mut f, mode)?
                    }
                }
            }
            if !dest.as_os_str().is_empty() && (dest_is_dir || items.iter().any(|i| !i.to_dir)) {
                tree.dir(&dest, true, false)?;
            }
            Ok(work)
        })
    }
}

fn ids_text(ids: Option<IdRange>) -> String {
    ids.map_or_else(|| "host".into(), |r| format!("{}:{}:{}", r.uid, r.gid, r.count))
}

/// In-image uid and gid of `user[:group]` (names looked up in the tree's `/etc/passwd` and
/// `/etc/group`, read inside the tree and bounded).
fn lookup_owner(tree: &InRoot, spec: &str) -> std::result::Result<(u32, u32), String> {
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let find = |file: &str, name: &str| -> Option<(u32, u32)> {
        let text = tree.read_bounded(Path::new(file), 8 << 20)?;
        String::from_utf8_lossy(&text).lines().find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() >= 3 && f[0] == name).then(|| {
                let id = f[2].parse().ok()?;
                let gid = f.get(3).and_then(|x| x.parse().ok()).unwrap_or(id);
                Some((id, gid))
            })?
        })
    };
    let (uid, ugid) = match u.parse::<u32>() {
        Ok(n) => (n, find("etc/passwd", u).map_or(n, |x| x.1)),
        Err(_) => find("etc/passwd", u)
            .ok_or_else(|| format!("--chown: no user {u:?} in the image's /etc/passwd"))?,
    };
    let gid = match g {
        None => ugid,
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => find("etc/group", g)
                .map(|x| x.0)
                .ok_or_else(|| format!("--chown: no group {g:?} in the image's /etc/group"))?,
        },
    };
    Ok((uid, gid))
}

/// Put back the per-sandbox files the build sandbox's start wrote (`/etc/hostname`,
/// `/etc/machine-id`): the parent's, or none when it had none.
fn unpersonalize(parent: &Path, work: &Path) -> Result<()> {
    let from = InRoot::open(parent)?;
    for f in ["etc/hostname", "etc/machine-id"] {
        let rel = Path::new(f);
        match from.open_regular(rel) {
            Some(mut file) => {
                let m = file.metadata().map_err(SandboxError::io("stat", parent.join(f)))?;
                let mut b = Vec::new();
                (&mut file)
                    .take(1 << 20)
                    .read_to_end(&mut b)
                    .map_err(SandboxError::io("read", parent.join(f)))?;
                InRoot::open(work)?.owned_by(Some((m.uid(), m.gid()))).write(
                    rel,
                    &b,
                    m.permissions().mode() & 0o7777,
                )?;
            }
            None => InRoot::open(work)?.remove_file(rel)?,
        }
    }
    Ok(())
}

/// A RUN's output, cut into lines for the progress, the last ones kept for an error.
struct Lines<'a> {
    progress: &'a dyn Progress,
    buf: Vec<u8>,
    tail: VecDeque<String>,
    /// Bytes streamed so far.
    streamed: usize,
}

impl<'a> Lines<'a> {
    fn new(progress: &'a dyn Progress) -> Self {
        Lines { progress, buf: Vec::new(), tail: VecDeque::new(), streamed: 0 }
    }

    fn push(&mut self, b: &[u8]) {
        for &c in b {
            if c == b'\n' || self.buf.len() >= MAX_LINE {
                self.emit();
            }
            if c != b'\n' {
                self.buf.push(c);
            }
        }
    }

    fn emit(&mut self) {
        let line = String::from_utf8_lossy(&self.buf).trim_end_matches('\r').to_string();
        self.buf.clear();
        if self.streamed < MAX_STREAMED {
            self.streamed += line.len() + 1;
            self.progress.message(&line);
            if self.streamed >= MAX_STREAMED {
                self.progress.message(&format!(
                    "[output clipped: the step printed more than {} MiB; only its last lines are kept]",
                    MAX_STREAMED >> 20
                ));
            }
        }
        if self.tail.len() == TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(line);
    }

    fn flush(&mut self) {
        if !self.buf.is_empty() {
            self.emit();
        }
    }
}

/// What one COPY source entry becomes.
struct Item {
    /// Path under the destination (empty: the destination itself).
    rel: PathBuf,
    /// A single file source: it *is* the destination unless that is a directory.
    to_dir: bool,
    mode: u32,
    kind: ItemKind,
}

enum ItemKind {
    Dir,
    Symlink(PathBuf),
    /// A local archive ADD unpacks into the destination: its tree's root and its path there.
    Archive(PathBuf, PathBuf),
    /// The root of the tree it is in (a context or a stage) and its path there (read inside it).
    File(PathBuf, PathBuf),
    Inline(Vec<u8>),
}
