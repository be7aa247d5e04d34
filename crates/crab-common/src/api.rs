//! Request and response bodies of the daemon's HTTP API.
//!
//! The daemon serves JSON over HTTP/1.1 on a unix socket (`<state>/crab.sock`). Plain requests
//! return one JSON document; long operations (image build, exec) return a stream of
//! newline-delimited JSON frames so that progress and output arrive as they happen. The routes
//! are listed in `docs/api.md`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// Version of this API, reported by `GET /v1/version`.
pub const API_VERSION: u32 = 1;

/// `GET /v1/version`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VersionInfo {
    /// Crate version of the daemon.
    pub version: String,
    /// [`API_VERSION`] of the daemon.
    pub api: u32,
    /// The daemon's state directory.
    pub state_dir: String,
    /// Pid of the daemon.
    pub pid: u32,
    /// Kernel features the daemon probed at start-up (absent from older daemons).
    #[serde(default)]
    pub features: Features,
    /// The LLM proxy's host-side listen address (`--proxy-listen`): agents on the host use
    /// `http://<it>/s/<sandbox>/v1` (absent from older daemons).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_listen: Option<String>,
}

/// Kernel features probed by the daemon at start-up.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// Soft-dirty page tracking (`clear_refs` 4 + the pagemap bit): incremental process dumps
    /// and "ran but dirtied no page" need it.
    pub soft_dirty: Option<FeatureStatus>,
    /// CRIU is installed and answers: process and full points hold processes, and restores
    /// bring them back (the SDK's `restores_processes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criu: Option<FeatureStatus>,
    /// The daemon exports restore points to a `--remote` store (the SDK's `durable`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<FeatureStatus>,
    /// cgroup2 is mounted with `favordynmods`, so joining a sandbox's cgroups (every exec,
    /// start and restore) does not wait for an RCU grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_favordynmods: Option<FeatureStatus>,
    /// The namespace helpers run from the small `crab-nsexec` beside `crab` (available) or
    /// from `crab` itself; the reason names the binary in use and, when it is `crab`, why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_helper: Option<FeatureStatus>,
}

/// Whether one kernel feature works here, and what the probe saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeatureStatus {
    /// The feature works.
    pub available: bool,
    /// What the probe saw (why not, when unavailable).
    pub reason: String,
}

/// An image as listed by `GET /v1/images`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// Image name.
    pub name: String,
    /// Where it came from (`debootstrap bookworm minbase +python3,...`, `import /path`).
    pub source: String,
    /// Creation time, seconds since the epoch.
    pub created_at: u64,
    /// Apparent size of its files in bytes.
    pub size_bytes: u64,
    /// The registry reference it was pulled from (`registry/repo:tag`), for OCI images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// Its manifest's digest (`sha256:…`), for OCI images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Bytes of its layers that other images share (stored once).
    #[serde(default)]
    pub shared_bytes: u64,
    /// What its sandboxes run with unless told otherwise (the OCI config's `Env`,
    /// `WorkingDir`, `User`, `Entrypoint`, `Cmd`, `Labels`, `ExposedPorts`).
    #[serde(default, skip_serializing_if = "ImageDefaults::is_empty")]
    pub config: ImageDefaults,
}

/// What an image's config says its containers run with; a sandbox copies it from its image
/// when made (so it outlives the image) and `exec` uses it where a call gives nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDefaults {
    /// Environment, `KEY=VALUE`, in the config's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Working directory (absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Account commands run as: `name`, `uid`, `name:group` or `uid:gid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Entrypoint argv.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// Default arguments (the command when there is no entrypoint).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// Labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Exposed ports (`8080/tcp`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<String>,
    /// Shell for the shell form of `RUN`/`CMD`/`ENTRYPOINT` (Docker's `SHELL`; default
    /// `/bin/sh -c`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shell: Vec<String>,
}

impl ImageDefaults {
    /// Whether nothing is set (images built by debootstrap or imported from a root tree).
    pub fn is_empty(&self) -> bool {
        *self == ImageDefaults::default()
    }

    /// The argv `docker run IMAGE [ARGS]` runs: the entrypoint followed by `args`, or by
    /// the config's `Cmd` when `args` is empty.
    pub fn run_argv(&self, args: &[String]) -> Vec<String> {
        let mut argv = self.entrypoint.clone();
        if args.is_empty() {
            argv.extend(self.cmd.iter().cloned());
        } else {
            argv.extend(args.iter().cloned());
        }
        argv
    }
}

/// `POST /v1/images/build` (streams [`ProgressFrame`]s, then an [`ImageInfo`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageBuildRequest {
    /// Distribution recipe; only `debian` (bookworm) exists. Not needed with `dockerfile`.
    #[serde(default)]
    pub distro: String,
    /// Image name; defaults to the distro name.
    pub name: Option<String>,
    /// Extra packages on top of the default set.
    #[serde(default)]
    pub include: Vec<String>,
    /// Rebuild (and swap in) an existing image of that name built from another recipe,
    /// instead of refusing it.
    #[serde(default)]
    pub rebuild_stale: bool,
    /// Build from this Dockerfile (a path on the daemon's host) instead of the `distro`
    /// recipe; `distro` is then ignored and `name` is required. Answers an
    /// [`ImageBuildReport`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dockerfile: Option<String>,
    /// The build context directory (a path on the daemon's host) COPY and ADD read from;
    /// default: the Dockerfile's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// `--build-arg` values for the Dockerfile's `ARG`s.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub build_args: BTreeMap<String, String>,
    /// Run every step again (and replace the cached steps) instead of reusing cached ones.
    #[serde(default)]
    pub no_cache: bool,
}

impl ImageBuildRequest {
    /// The `debian` recipe's request for image `name` (default: `debian`).
    pub fn debian(name: Option<String>) -> Self {
        ImageBuildRequest {
            distro: "debian".into(),
            name,
            include: Vec::new(),
            rebuild_stale: false,
            dockerfile: None,
            context: None,
            build_args: BTreeMap::new(),
            no_cache: false,
        }
    }
}

/// One instruction of a Dockerfile build, as the build went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildStep {
    /// 1-based index among the Dockerfile's instructions.
    pub index: usize,
    /// Its line in the Dockerfile.
    pub line: usize,
    /// The instruction (shortened).
    pub instruction: String,
    /// For a step that makes a tree (RUN, COPY, ADD, WORKDIR): whether its snapshot came from
    /// the cache; absent for the steps that only set configuration (ENV, USER, CMD, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached: Option<bool>,
}

/// What a Dockerfile build answers: the image (its fields flattened) and its steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageBuildReport {
    /// The image.
    #[serde(flatten)]
    pub image: ImageInfo,
    /// Every instruction, in order.
    pub steps: Vec<BuildStep>,
}

/// One line of a background build's log ([`BuildJobStatus`]): a step starting, a line a RUN
/// printed, or why the build failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLogLine {
    /// When it was logged (ms since the epoch).
    pub at_ms: u64,
    /// `info` or `error`.
    pub level: String,
    /// The line.
    pub message: String,
}

/// Where a background Dockerfile build is: `building`, `ready` (the image exists) or `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildJobState {
    /// Running.
    Building,
    /// Done: the image is built.
    Ready,
    /// Failed (see [`BuildJobStatus::error`]); no image was made or replaced.
    Error,
}

/// A background Dockerfile build's state and its log lines from an offset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildJobStatus {
    /// The build's id.
    pub id: String,
    /// The image it builds.
    pub image: String,
    /// Where it is.
    pub state: BuildJobState,
    /// Why it failed (with `error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Log lines from `offset` on (at most the number asked for).
    pub lines: Vec<BuildLogLine>,
    /// The offset of `lines[0]` (greater than the one asked for when older lines were dropped
    /// from the host's bounded log).
    pub offset: u64,
}

/// `POST /v1/images/commit` (streams [`ProgressFrame`]s, then an [`ImageInfo`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageCommitRequest {
    /// `SANDBOX` (its current files) or `SANDBOX@POINT` (a restore point's files).
    pub source: String,
    /// The new image's name.
    pub name: String,
}

/// `POST /v1/images/import` (streams [`ProgressFrame`]s, then an [`ImageInfo`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageImportRequest {
    /// Image name.
    pub name: String,
    /// A root filesystem directory or a tar archive (optionally gzip/xz/zstd compressed), as a
    /// path on the daemon's host; or an OCI image layout or `docker save` archive (directory
    /// or tar).
    pub path: String,
    /// For an OCI layout holding an index: the platform to pick (`linux/amd64` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
}

/// `POST /v1/images/pull` (streams [`ProgressFrame`]s, then an [`ImageInfo`]).
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct ImagePullRequest {
    /// `[REGISTRY/]REPOSITORY[:TAG][@DIGEST]` (Docker Hub when no registry is named).
    pub reference: String,
    /// Image name (default: the repository's last component, `-`, the tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `OS/ARCH[/VARIANT]` picked from an index (default `linux/amd64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// Speak plain `http://` to the reference's registry (loopback test registries).
    #[serde(default)]
    pub insecure: bool,
    /// Basic-auth username (the CLI reads `--username` or `~/.docker/config.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Basic-auth password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Where the credentials came from, named when the registry refuses them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_source: Option<String>,
    /// Swap out an image of that name pulled from another digest (or made otherwise).
    #[serde(default)]
    pub replace: bool,
}

impl std::fmt::Debug for ImagePullRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImagePullRequest")
            .field("reference", &self.reference)
            .field("name", &self.name)
            .field("platform", &self.platform)
            .field("insecure", &self.insecure)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("credential_source", &self.credential_source)
            .field("replace", &self.replace)
            .finish()
    }
}

/// `POST /v1/images/push` (streams [`ProgressFrame`]s, then an [`ImagePushReport`]).
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct ImagePushRequest {
    /// The Crab image to push.
    pub name: String,
    /// `[REGISTRY/]REPOSITORY[:TAG]` to push it to (tag `latest` when none is named).
    pub reference: String,
    /// Speak plain `http://` to the reference's registry (loopback test registries).
    #[serde(default)]
    pub insecure: bool,
    /// Basic-auth username (the CLI reads `--username` or `~/.docker/config.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Basic-auth password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Where the credentials came from, named when the registry refuses them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_source: Option<String>,
}

impl std::fmt::Debug for ImagePushRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImagePushRequest")
            .field("name", &self.name)
            .field("reference", &self.reference)
            .field("insecure", &self.insecure)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("credential_source", &self.credential_source)
            .finish()
    }
}

/// One blob of a push.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushedBlob {
    /// `sha256:…`.
    pub digest: String,
    /// Bytes.
    pub size: u64,
    /// Media type.
    pub media_type: String,
    /// How its bytes were had: `stored` (the blob the layer was installed from, or one an
    /// earlier push made, found in the host's blob cache), `generated` (made from the layer's
    /// tree by this push), `config`.
    pub origin: String,
    /// Whether it was uploaded (`false`: the registry already had it).
    pub uploaded: bool,
}

/// What `POST /v1/images/push` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagePushReport {
    /// The image pushed.
    pub name: String,
    /// The whole reference pushed to (`registry/repository:tag`).
    pub reference: String,
    /// The pushed manifest's digest.
    pub digest: String,
    /// The config blob.
    pub config: PushedBlob,
    /// The layers, bottom first.
    pub layers: Vec<PushedBlob>,
}

/// Network mode of a sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetMode {
    /// Own network namespace with `lo` up (default).
    #[default]
    Private,
    /// The host's network namespace.
    Host,
    /// Own network namespace with `lo` down.
    None,
    /// Own network namespace with `lo` up and a veth pair to the host: an address from a
    /// private range, masqueraded egress; the host's own addresses, its loopback services
    /// and other sandboxes are unreachable.
    Nat,
}

impl std::str::FromStr for NetMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "private" => Ok(NetMode::Private),
            "host" => Ok(NetMode::Host),
            "none" => Ok(NetMode::None),
            "nat" => Ok(NetMode::Nat),
            other => Err(format!("unknown network mode {other:?}; use private, nat, none or host")),
        }
    }
}

/// Resource limits of a sandbox, applied through the cgroup controllers the host has.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory limit in bytes.
    pub memory_bytes: Option<u64>,
    /// Maximum number of tasks.
    pub pids_max: Option<u64>,
    /// CPU quota in milli-CPUs (1000 = one core).
    pub cpu_millis: Option<u64>,
    /// Disk quota in bytes (`--disk`): a btrfs qgroup limit on the sandbox's root subvolume,
    /// carried to every root a restore or fork gives it. Past it, writes inside fail with
    /// EDQUOT; the sandbox keeps running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxCreateRequest {
    /// Image to start from.
    pub image: String,
    /// Sandbox name; generated when absent.
    pub name: Option<String>,
    /// Network mode.
    #[serde(default)]
    pub net: NetMode,
    /// With `net: nat`: the private IPv4 range (CIDR) to take the sandbox's address from;
    /// the daemon's `--nat-range` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat_range: Option<String>,
    /// Resource limits.
    #[serde(default)]
    pub limits: Limits,
    /// Opt out of the default security profile (unsafe: sandboxed code can then reach the
    /// host as root).
    #[serde(default)]
    pub privileged: bool,
    /// `host`: run in the host's user namespace, uid 0 inside being the host's root (today's
    /// mode before user namespaces; unsafe, needed only by workloads that must share ids with
    /// the host). Absent or `private`: a user namespace of the daemon's range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userns: Option<String>,
    /// What its turn boundaries checkpoint: `auto` (the inspector's verdict; the default),
    /// `full`, `fs` or `none` ([`crate::CheckpointPolicy`]). A string here so that a bad value
    /// is refused naming the field and the accepted values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_policy: Option<String>,
    /// The sandbox's harness (`crab sandbox create --harness-cmd/--harness-path`): processes and
    /// paths whose activity alone never calls for a checkpoint. Absent: none.
    #[serde(default, skip_serializing_if = "HarnessSpec::is_empty")]
    pub harness: HarnessSpec,
    /// Labels kept in its record (E2B's metadata).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Environment every command in it gets (a command's own `env` wins).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Seconds until its deadline (1..=86400); none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// What its deadline does: `kill` (default) or `pause`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<String>,
    /// What it is made from, as the caller names it (shown back; E2B's template id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
}

impl SandboxCreateRequest {
    /// A request for a sandbox from `image` with every other field at its default (the name
    /// generated, `private` network, no limits, the default profile and checkpoint policy, no
    /// harness): callers set what they need with struct-update syntax.
    pub fn new(image: impl Into<String>) -> Self {
        SandboxCreateRequest {
            image: image.into(),
            name: None,
            net: NetMode::default(),
            nat_range: None,
            limits: Limits::default(),
            privileged: false,
            userns: None,
            checkpoint_policy: None,
            harness: HarnessSpec::default(),
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            timeout_s: None,
            on_timeout: None,
            template: None,
        }
    }
}

/// What a sandbox declares as its harness (an agent, a SWE-ReX server, a session shell running
/// inside it): their running alone never calls for a process dump, and changes under `paths`
/// do not count, while every dump still holds them (docs/architecture.md "Harness exclusion").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HarnessSpec {
    /// Regular expressions (Rust `regex` syntax) matched against a process's command line, its
    /// argv joined by single spaces. A process is harness when one matches the command line
    /// its own exec gave it (not one inherited by a fork).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// Absolute paths inside the sandbox: changes at or beneath one do not count.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
}

impl HarnessSpec {
    /// Nothing declared.
    pub fn is_empty(&self) -> bool {
        self.cmd.is_empty() && self.paths.is_empty()
    }
}

/// `PATCH /v1/sandboxes/{name}`: change settings of an existing sandbox (absent fields stay).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SandboxUpdateRequest {
    /// New checkpoint policy: `auto`, `full`, `fs` or `none`; applies from its next turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_policy: Option<String>,
    /// A new deadline, this many seconds from now (1..=86400); `0` clears it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// What the new deadline does (`kill` or `pause`; with `timeout_s`; absent: the current
    /// deadline's action, else `kill`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<String>,
    /// With `timeout_s`: never bring the deadline closer than it is (E2B's connect).
    #[serde(default)]
    pub extend_only: bool,
}

/// The security profile a sandbox's processes run under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecurityProfile {
    /// `true`: no restrictions beyond the namespaces (`sandbox create --privileged`, unsafe).
    #[serde(default)]
    pub privileged: bool,
    /// The user namespace its processes run in: ids `0..count` inside are `uid..uid+count` /
    /// `gid..gid+count` on the host. Absent: the host's user namespace (`--userns host`, and
    /// every sandbox created before user namespaces), where uid 0 inside is the host's root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userns: Option<IdRange>,
}

/// The host ids a user-namespaced sandbox's ids `0..count` map to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    /// Host uid of uid 0 inside.
    pub uid: u32,
    /// Host gid of gid 0 inside.
    pub gid: u32,
    /// How many ids are mapped (65536: every id a Linux distribution uses).
    pub count: u32,
}

impl IdRange {
    /// Ids every sandbox maps (`0..65536`).
    pub const COUNT: u32 = 65536;
    /// The daemon's default host range: far above the ids `useradd` hands out (≤ 60000) and
    /// the `/etc/subuid` ranges it allocates from 100000 in steps of 65536 for the first
    /// ten thousand users.
    pub const DEFAULT_BASE: u32 = 1_000_000_000;

    /// The range of `count` ids from `base` (uid and gid alike).
    pub fn at(base: u32) -> Result<Self, String> {
        if base == 0 || base.checked_add(Self::COUNT).is_none() {
            return Err(format!(
                "a user-namespace base of {base} cannot hold {} ids above 0 on the host; pick a base between 1 and {}",
                Self::COUNT,
                u32::MAX - Self::COUNT
            ));
        }
        Ok(IdRange { uid: base, gid: base, count: Self::COUNT })
    }

    /// The host uid of `inside`, when it is mapped.
    pub fn host_uid(&self, inside: u32) -> Option<u32> {
        (inside < self.count).then(|| self.uid + inside)
    }

    /// The host gid of `inside`, when it is mapped.
    pub fn host_gid(&self, inside: u32) -> Option<u32> {
        (inside < self.count).then(|| self.gid + inside)
    }

    /// The `uid_map` line (`0 <uid> <count>`).
    pub fn uid_map(&self) -> String {
        format!("0 {} {}\n", self.uid, self.count)
    }

    /// The `gid_map` line (`0 <gid> <count>`).
    pub fn gid_map(&self) -> String {
        format!("0 {} {}\n", self.gid, self.count)
    }
}

impl std::fmt::Display for IdRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "0-{} → uid {}-{}", self.count - 1, self.uid, self.uid + (self.count - 1))?;
        if self.gid != self.uid {
            write!(f, " gid {}-{}", self.gid, self.gid + (self.count - 1))?;
        }
        Ok(())
    }
}

/// Run state of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Its init is alive.
    Running,
    /// Recorded running, but its init is gone (killed from outside, host rebooted);
    /// `crab sandbox resume`, `crab restore` or `rm` it.
    Dead,
    /// Stopped (`crab sandbox stop`, `docker stop`): no process; `resume` starts it again.
    Stopped,
    /// Paused: a `full` point, then every process stopped; `resume` restores that point.
    Paused,
    /// Parked by the host: its processes stopped after a point that holds them; any call
    /// that needs it running wakes it first (`crab sandbox wake` does only that).
    Parked,
    /// Kept only for its labelled restore points (`held` says why).
    Retired,
}

impl SandboxState {
    /// Its name in the API and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Dead => "dead",
            SandboxState::Stopped => "stopped",
            SandboxState::Paused => "paused",
            SandboxState::Parked => "parked",
            SandboxState::Retired => "retired",
        }
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A sandbox as listed by `GET /v1/sandboxes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// Name.
    pub name: String,
    /// Image it was created from.
    pub image: String,
    /// Run state.
    pub state: SandboxState,
    /// Creation time, seconds since the epoch.
    pub created_at: u64,
    /// Host pid of the sandbox's init (pid 1 inside).
    pub init_pid: u32,
    /// Number of processes in the sandbox, init included.
    pub processes: u32,
    /// Memory its processes hold now, bytes (its cgroup's); absent when it runs nothing or
    /// the cgroup does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Bytes written to the sandbox's filesystem since creation and still held by it (btrfs
    /// simple-quota accounting of the sandbox's subvolume); `None` where the pool has no quota
    /// support.
    pub bytes_written: Option<u64>,
    /// Its disk quota (`limits.disk_bytes`), against which `bytes_written` counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_limit_bytes: Option<u64>,
    /// Its resource limits in force (memory, tasks, CPU, disk; a default's value when it was
    /// created without its own; absent fields are unlimited).
    #[serde(default)]
    pub limits: Limits,
    /// Network mode.
    pub net: NetMode,
    /// Hostname inside.
    pub hostname: String,
    /// Id of the sandbox's cgroup v2 (what BPF programs filter on).
    pub cgroup_id: u64,
    /// With `net: nat`: the sandbox's address (on its `eth0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The security profile in force (`crab sandbox inspect`).
    #[serde(default)]
    pub profile: Option<ProfileReport>,
    /// Set while it is stopped and kept only for its restore points (an E2B sandbox killed
    /// while it held snapshots; `crab sandbox ls` shows `snapshot holder`): why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
    /// What its turn boundaries checkpoint (`auto` for older daemons, which had no policy).
    #[serde(default)]
    pub checkpoint_policy: crate::CheckpointPolicy,
    /// Its declared harness (empty: none; older daemons had none).
    #[serde(default, skip_serializing_if = "HarnessSpec::is_empty")]
    pub harness: HarnessSpec,
    /// While paused: the pause point (`resume` restores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_point: Option<String>,
    /// Its deadline, if it has one (`--timeout`/`--on-timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<crate::life::Deadline>,
    /// Its labels (E2B's metadata).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The environment every command in it gets (as `docker inspect` shows a container's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// What it was made from, as its creator named it (an E2B template or snapshot id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Its labelled restore points: point id → labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub point_labels: BTreeMap<String, Vec<String>>,
}

/// Parse the `checkpoint_policy` field of a request: absent is `None`; a bad value is an
/// `invalid_request` error naming the field and the accepted values.
pub fn parse_checkpoint_policy(
    v: Option<&str>,
) -> Result<Option<crate::CheckpointPolicy>, ApiError> {
    match v {
        None => Ok(None),
        Some(s) => s.parse().map(Some).map_err(|_| {
            ApiError::invalid(
                format!("checkpoint_policy {s:?} is not a checkpoint policy"),
                format!("use one of {}", crate::CheckpointPolicy::EXPECTED),
            )
        }),
    }
}

/// What `crab sandbox inspect` shows about the security profile in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileReport {
    /// `default` or `privileged`.
    pub name: String,
    /// Capabilities in the bounding/permitted/effective/inheritable sets (ambient is empty).
    pub capabilities: Vec<String>,
    /// Seccomp filter in force.
    pub seccomp: String,
    /// Whether `no_new_privs` is set.
    pub no_new_privs: bool,
    /// Paths masked (`/dev/null` or an empty read-only tmpfs over them).
    pub masked_paths: Vec<String>,
    /// Paths mounted read-only.
    pub readonly_paths: Vec<String>,
    /// Whether the sandbox has its own cgroup namespace.
    pub cgroup_namespace: bool,
    /// Allowed devices (`c major:minor name`).
    pub devices: Vec<String>,
    /// Its user namespace (`0-65535 → uid …`), or `host` (uid 0 inside is the host's root).
    #[serde(default)]
    pub user_namespace: String,
}

/// `POST /v1/sandboxes/{name}/exec`: streams [`ExecFrame`]s.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    /// argv; the first element is looked up in the sandbox's `PATH`.
    pub cmd: Vec<String>,
    /// Extra environment, `KEY=VALUE`.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory inside the sandbox (default: the image's `WorkingDir`, else `/`).
    pub workdir: Option<String>,
    /// The account to run as (`name`, `uid`, `name:group`, `uid:gid`; default: the image's
    /// `User`, else root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Seconds after which the command and whatever holds its output are killed.
    pub timeout_s: Option<f64>,
    /// Standard input, base64; absent means `/dev/null`.
    pub stdin_b64: Option<String>,
    /// Keep the command's stdin open as a pipe fed through
    /// `POST /v1/sandboxes/{name}/exec/{session}/stdin` while it runs: `session` is a name the
    /// caller picks, unique among the sandbox's open exec sessions. `stdin_b64`, when also
    /// given, is written first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_session: Option<String>,
}

/// `POST /v1/sandboxes/{name}/exec/{session}/stdin`: bytes for the stdin of an exec started
/// with `stdin_session`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinWrite {
    /// The bytes, base64 (absent: none).
    #[serde(default)]
    pub d: String,
    /// Close the command's stdin after them.
    #[serde(default)]
    pub eof: bool,
}

/// The answer to a [`StdinWrite`]: bytes written to the command's stdin pipe, and whether it
/// was closed after them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinWritten {
    /// Bytes written.
    pub written: usize,
    /// Whether stdin was closed after them.
    pub eof: bool,
}

/// `POST /v1/sandboxes/{name}/procs`: start a background process (`crab exec -d`). It runs
/// detached under a supervisor in the sandbox that keeps its output, stdin and exit status in
/// a directory of its own there, so it outlives the request, a daemon restart and a
/// checkpoint/restore/fork.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcStartRequest {
    /// argv; the first element is looked up in the sandbox's `PATH`.
    pub cmd: Vec<String>,
    /// Extra environment, `KEY=VALUE`.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory inside the sandbox (default `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The account it runs as (default root); other accounts need util-linux's `setpriv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A name of the caller's choosing to find it by (E2B's tag), unique among the sandbox's
    /// running processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Give it a stdin fed through `POST .../procs/{id}/stdin` (else `/dev/null`).
    #[serde(default)]
    pub stdin: bool,
}

/// Where a background process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcState {
    /// Its supervisor runs.
    Running,
    /// It ended; `exit_code` says how.
    Exited,
    /// It neither runs nor left an exit status (the sandbox was stopped or died under it).
    Lost,
}

/// A background process of a sandbox. Everything but `id` is read back from the sandbox and
/// is only as true as the sandbox lets it be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    /// Its id (16 hex digits), stable across daemon restarts, restores and forks.
    pub id: String,
    /// Its supervisor's pid inside the sandbox (E2B's pid), when known.
    pub pid: Option<u32>,
    /// argv.
    pub cmd: Vec<String>,
    /// The environment it was given, `KEY=VALUE`.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The account it runs as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The caller's tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Whether it has a stdin fed through the API.
    #[serde(default)]
    pub stdin: bool,
    /// When it started (Unix seconds).
    #[serde(default)]
    pub started_at: u64,
    /// Running, exited or lost.
    pub state: ProcState,
    /// Its exit status once it exited (128+N when a signal N ended it, shell convention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Bytes of stdout kept so far.
    #[serde(default)]
    pub stdout_bytes: u64,
    /// Bytes of stderr kept so far.
    #[serde(default)]
    pub stderr_bytes: u64,
    /// The last signal sent to it through the service (`KILL`, `TERM`, …): an exit code of
    /// 128+N after signal N is that signal, not the command's own `exit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signalled: Option<String>,
}

/// `POST /v1/sandboxes/{name}/procs/{id}/signal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcSignalRequest {
    /// Signal name (`TERM`, `KILL`, `INT`, `HUP`, ... with or without `SIG`) or number.
    pub signal: String,
}

impl Default for ProcSignalRequest {
    fn default() -> Self {
        ProcSignalRequest { signal: "TERM".into() }
    }
}

/// One frame of an exec's streamed response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum ExecFrame {
    /// Bytes on the command's stdout (base64).
    Stdout {
        /// base64 data.
        d: String,
    },
    /// Bytes on the command's stderr (base64).
    Stderr {
        /// base64 data.
        d: String,
    },
    /// The command ended.
    Exit {
        /// Exit code; 128+signal when killed by a signal (shell convention).
        code: i32,
        /// Whether the timeout fired.
        timed_out: bool,
        /// Wall time in milliseconds.
        duration_ms: f64,
    },
    /// The exec failed before or while running.
    Error {
        /// What went wrong.
        error: ApiError,
    },
}

/// One frame of a long operation's streamed response: progress, then a result or an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "lowercase")]
pub enum ProgressFrame {
    /// A stage starts.
    Stage {
        /// Stage name.
        name: String,
        /// Units the stage will take, when known.
        total: Option<u64>,
    },
    /// Units done in the current stage.
    Advance {
        /// Units done.
        done: u64,
    },
    /// A line of detail.
    Message {
        /// The line.
        line: String,
    },
    /// The operation succeeded with this result.
    Done {
        /// The result document.
        result: serde_json::Value,
    },
    /// The operation failed.
    Error {
        /// What went wrong.
        error: ApiError,
    },
}

/// `POST /v1/sandboxes/{name}/checkpoints`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CheckpointCreateRequest {
    /// `auto` (ask the inspector; the default), `skip`, `fs`, `process` or `full`.
    #[serde(default)]
    pub kind: Option<String>,
    /// Turn number; default: the parent's plus one.
    #[serde(default)]
    pub turn: Option<u64>,
    /// Conversation offset to record with the point.
    #[serde(default)]
    pub conversation_offset: Option<u64>,
}

/// `POST /v1/sandboxes/{name}/restore`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RestoreRequest {
    /// Restore point id (`c000007`, `c7` or `7`); the newest when absent.
    #[serde(default)]
    pub checkpoint: Option<String>,
}

/// `POST /v1/sandboxes/{name}/stop`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StopRequest {
    /// Publish a restore point before killing the processes (the default, `docker stop`);
    /// `false` kills at once (`docker kill`).
    #[serde(default = "yes")]
    pub checkpoint: bool,
}

impl Default for StopRequest {
    fn default() -> Self {
        StopRequest { checkpoint: true }
    }
}

fn yes() -> bool {
    true
}

/// `POST /v1/sandboxes/{name}/fork`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ForkRequest {
    /// Restore point id; the newest when absent.
    #[serde(default)]
    pub checkpoint: Option<String>,
    /// Number of branches.
    pub count: usize,
    /// Names of the branches (one per branch); generated when absent.
    #[serde(default)]
    pub names: Option<Vec<String>>,
    /// Files only: the branches start a fresh init instead of the point's processes.
    #[serde(default)]
    pub fs_only: bool,
    /// The branches' own settings (absent: each carries its source's labels and environment,
    /// and no deadline).
    #[serde(default, flatten)]
    pub branch: BranchSettings,
}

/// What fork branches get besides the point: labels, environment, template and a deadline.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchSettings {
    /// Labels instead of the source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Environment instead of the source's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// What they are made from, as the caller names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Seconds until each branch's deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// What the deadline does (`kill` or `pause`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<String>,
}

impl BranchSettings {
    /// Nothing to set.
    pub fn is_empty(&self) -> bool {
        *self == BranchSettings::default()
    }

    /// The deadline these settings give a branch made at `now_ms`.
    pub fn deadline(&self, now_ms: u64) -> Result<Option<crate::life::Deadline>, ApiError> {
        timeout_of(self.timeout_s, self.on_timeout.as_deref(), now_ms)
    }
}

/// The deadline of a request's `timeout_s` and `on_timeout` fields at `now_ms` (an action
/// without a timeout is refused).
pub fn timeout_of(
    timeout_s: Option<u64>,
    on_timeout: Option<&str>,
    now_ms: u64,
) -> Result<Option<crate::life::Deadline>, ApiError> {
    let on = on_timeout.map(str::parse).transpose()?;
    match timeout_s {
        Some(t) => Ok(Some(crate::life::Deadline::after(now_ms, t, on.unwrap_or_default())?)),
        None if on.is_some() => {
            Err(ApiError::invalid("on_timeout needs a timeout", "give timeout_s (--timeout) too"))
        }
        None => Ok(None),
    }
}

/// Answer of the lifecycle routes (stop, start, pause, resume, kill).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// The sandbox.
    pub sandbox: String,
    /// The point published before stopping or pausing, or restored when starting or resuming
    /// (`None`: nothing to do — it was stopped or running already, or stopped without a
    /// checkpoint).
    pub point: Option<String>,
    /// Its state now.
    pub state: SandboxState,
}

/// `GET /v1/sandboxes/{name}/status`: the cheap answer (one record, one `/proc` stat).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxStatus {
    /// Name.
    pub name: String,
    /// Its state.
    pub state: SandboxState,
}

/// `POST /v1/sandboxes/{name}/resume`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ResumeRequest {
    /// A running sandbox is fine (nothing is done) instead of a `conflict`.
    #[serde(default)]
    pub ensure: bool,
    /// A new deadline, seconds from now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// What the deadline does (`kill` or `pause`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<String>,
    /// With `timeout_s`: never bring a later deadline closer.
    #[serde(default)]
    pub extend_only: bool,
}

/// `POST /v1/sandboxes/{name}/replace`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReplaceRequest {
    /// `SB@POINT`: the point that replaces what the sandbox holds.
    pub source: String,
    /// The point is in the daemon's `--remote` store.
    #[serde(default)]
    pub remote: bool,
    /// Its files and conversation only (a fresh init, not its processes).
    #[serde(default)]
    pub fs_only: bool,
}

/// `POST /v1/sandboxes/{name}/checkpoints/{id}/labels`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LabelRequest {
    /// Labels to give the point (each unique on the host).
    pub labels: Vec<String>,
}

/// A labelled restore point (`GET /v1/labels`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelledPoint {
    /// Its sandbox.
    pub sandbox: String,
    /// The point.
    pub point: String,
    /// Its labels.
    pub labels: Vec<String>,
    /// It holds files only (an `fs` point, or a dump that fell back to the files).
    pub fs_only: bool,
}

/// Answer of `DELETE /v1/labels/{label}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelDeleted {
    /// The point's sandbox.
    pub sandbox: String,
    /// The point (it stays, unlabelled).
    pub point: String,
    /// The sandbox was retired and this was its last labelled point: it is removed.
    pub sandbox_removed: bool,
}

/// `POST /v1/sandboxes/{name}/checkpoints/prune`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PruneRequest {
    /// How many of the newest restore points to keep.
    pub keep_last: usize,
}
