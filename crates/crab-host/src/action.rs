//! [`Action`]: everything a front door can ask of the host, typed; [`Outcome`]: what it
//! answers. Front doors translate their requests into an `Action` (the HTTP API in
//! `crab daemon`; later an E2B-compatible API, an SDK) and render the `Outcome`.

use serde::Serialize;
use tokio::sync::mpsc;

use crab_checkpoint::{ForkBranch, PointSummary, RestoreReport};
pub use crab_common::api::Lifecycle;
use crab_common::api::{
    CheckpointCreateRequest, ExecFrame, ExecRequest, ForkRequest, ImageBuildRequest,
    ImageImportRequest, ImageInfo, ImagePullRequest, LabelDeleted, LabelledPoint,
    SandboxCreateRequest, SandboxInfo, SandboxStatus, SandboxUpdateRequest, VersionInfo,
};
use crab_common::life::TimeoutSet;
use crab_common::CheckpointKind;
use crab_common::Progress;
use crab_coordinator::{LogRecord, SandboxProxyStats};
use crab_engine::EngineStats;
use crab_inspector::Verdict;

use crate::remote::{Durable, FromRemote, FromRemoteReport, PointState};
use crate::HostError;

/// What a front door asks of the host.
pub enum Action {
    /// The host's version and state directory.
    Version,
    /// List images.
    ListImages,
    /// Build an image from a recipe, reporting progress.
    BuildImage {
        /// Recipe and name.
        req: ImageBuildRequest,
        /// Where progress goes.
        progress: Box<dyn Progress>,
    },
    /// Start building an image from a Dockerfile (`req.dockerfile`, `req.name`) in the
    /// background as build `id` (the caller's; unique on the host); answers at once
    /// ([`Outcome::BuildStarted`]). Its state and log: [`Action::BuildStatus`].
    BuildStart {
        /// The build's id.
        id: String,
        /// Dockerfile, context and image name.
        req: ImageBuildRequest,
    },
    /// A background build's state and up to `max` log lines from `offset`; a build that was
    /// running when the daemon stopped answers `error` ("the daemon restarted during the
    /// build").
    BuildStatus {
        /// The build's id.
        id: String,
        /// Log lines already seen.
        offset: u64,
        /// Most lines to answer (1..=1000).
        max: usize,
    },
    /// Make an image of a sandbox's files (now, or at a restore point), reporting progress.
    CommitImage {
        /// Source (`SB` or `SB@POINT`) and name.
        req: crab_common::api::ImageCommitRequest,
        /// Where progress goes.
        progress: Box<dyn Progress>,
    },
    /// Import a root filesystem, reporting progress.
    ImportImage {
        /// Name and source path.
        req: ImageImportRequest,
        /// Where progress goes.
        progress: Box<dyn Progress>,
    },
    /// Pull an image from a registry, reporting progress.
    PullImage {
        /// Reference, name, platform, credentials.
        req: ImagePullRequest,
        /// Where progress goes.
        progress: Box<dyn Progress>,
    },
    /// Push an image to a registry, reporting progress.
    PushImage {
        /// Image, reference, credentials.
        req: crab_common::api::ImagePushRequest,
        /// Where progress goes.
        progress: Box<dyn Progress>,
    },
    /// Remove an image.
    RemoveImage {
        /// Image name.
        name: String,
    },
    /// List sandboxes.
    ListSandboxes,
    /// Describe one sandbox.
    GetSandbox {
        /// Sandbox name.
        name: String,
    },
    /// Create and start a sandbox (tracked by the inspector, with an in-sandbox LLM proxy).
    Create(SandboxCreateRequest),
    /// Change settings of a sandbox (its checkpoint policy); answers the updated sandbox.
    Update {
        /// Sandbox name.
        name: String,
        /// The settings to change.
        req: SandboxUpdateRequest,
    },
    /// Remove a sandbox, its restore points and its proxy state.
    Remove {
        /// Sandbox name.
        name: String,
        /// Kill whatever runs in it.
        force: bool,
    },
    /// Stop a sandbox like `docker stop`: publish a restore point of what it holds now
    /// (`checkpoint`, the turn policy's kind), then kill every process in it. Its files, record
    /// and restore points stay; [`Action::Start`] brings it back. A stopped sandbox is a no-op.
    Stop {
        /// Sandbox name.
        name: String,
        /// Take a checkpoint first (`docker stop`); `false` kills at once (`docker kill`).
        checkpoint: bool,
    },
    /// Keep a sandbox only for its restore points (E2B's kill of a sandbox whose snapshots
    /// live on): every process is killed, no checkpoint is taken, its files, record and points
    /// stay, and its record says why (`held`; `crab sandbox ls` shows `snapshot holder`).
    /// `Remove` deletes it; a restore or start clears the mark.
    Retire {
        /// Sandbox name.
        name: String,
        /// Why it is kept (shown by `crab sandbox inspect`).
        why: String,
    },
    /// Start a stopped (dead) sandbox from its newest restore point; a running one is left
    /// alone.
    Start {
        /// Sandbox name.
        name: String,
    },
    /// Run a command in a sandbox; the outcome is the stream of its frames.
    Exec {
        /// Sandbox name.
        name: String,
        /// Command, environment, timeout, stdin.
        req: ExecRequest,
    },
    /// Stream the output of an exec session that came back with a restore, and take over its
    /// stdin; the outcome is the stream of its frames.
    ExecAttach {
        /// Sandbox name.
        name: String,
        /// The exec's `stdin_session`.
        session: String,
    },
    /// Feed the stdin of an exec started with `stdin_session`.
    ExecStdin {
        /// Sandbox name.
        name: String,
        /// The exec's `stdin_session`.
        session: String,
        /// Bytes to write.
        data: Vec<u8>,
        /// Close its stdin after them.
        eof: bool,
    },
    /// Start a background process (`crab exec -d`): detached, under a supervisor in the
    /// sandbox; answers it as listed ([`Outcome::Proc`]).
    ProcStart {
        /// Sandbox name.
        name: String,
        /// Command, environment, cwd, user, tag, stdin.
        req: crab_common::api::ProcStartRequest,
    },
    /// List a sandbox's background processes.
    ProcList {
        /// Sandbox name.
        name: String,
    },
    /// Describe one background process (`id`, `tag:NAME` or `pid:N`).
    ProcGet {
        /// Sandbox name.
        name: String,
        /// Process id.
        id: String,
    },
    /// Stream a background process's output from `offsets` (bytes of stdout, stderr already
    /// seen), then with `follow` until it ends; the outcome is a stream of exec frames.
    ProcOutput {
        /// Sandbox name.
        name: String,
        /// Process id.
        id: String,
        /// Bytes of stdout and of stderr to skip.
        offsets: (u64, u64),
        /// Keep streaming until the process ends.
        follow: bool,
    },
    /// Write to a background process's stdin.
    ProcStdin {
        /// Sandbox name.
        name: String,
        /// Process id.
        id: String,
        /// Bytes to write.
        data: Vec<u8>,
    },
    /// Close a background process's stdin.
    ProcCloseStdin {
        /// Sandbox name.
        name: String,
        /// Process id.
        id: String,
    },
    /// Signal a background process (its command's process group).
    ProcSignal {
        /// Sandbox name.
        name: String,
        /// Process id.
        id: String,
        /// Signal name or number.
        signal: String,
    },
    /// The inspector's verdict on the current turn; `close` also closes the turn.
    Inspect {
        /// Sandbox name.
        name: String,
        /// Close the turn (as a checkpoint does).
        close: bool,
    },
    /// Take a checkpoint now (urgent), of the given kind or the turn policy's (`None`).
    Checkpoint {
        /// Sandbox name.
        name: String,
        /// Explicit kind; `None` asks the inspector (`auto`).
        kind: Option<CheckpointKind>,
        /// Turn number to record.
        turn: Option<u64>,
        /// Conversation offset to record.
        conversation_offset: Option<u64>,
    },
    /// List a sandbox's restore points.
    ListCheckpoints {
        /// Sandbox name.
        name: String,
    },
    /// Remove all but the newest `keep_last` restore points.
    Prune {
        /// Sandbox name.
        name: String,
        /// How many to keep.
        keep_last: usize,
    },
    /// Run `action` reporting its stages to `progress` (a front door streaming them to its
    /// client): `Restore`, `Fork` and `FromRemote` report; any other action is refused
    /// (`invalid_request`), as is a nested `WithProgress`.
    WithProgress {
        /// The action.
        action: Box<Action>,
        /// Where its stages go.
        progress: Box<dyn Progress>,
    },
    /// Restore a sandbox in place (the newest point when `checkpoint` is `None`).
    Restore {
        /// Sandbox name.
        name: String,
        /// Restore point id.
        checkpoint: Option<String>,
    },
    /// Create new sandboxes from a restore point.
    Fork {
        /// Source sandbox.
        name: String,
        /// Point, count, branch names.
        req: ForkRequest,
    },
    /// Fork the sandbox as it is now: a `full` restore point, then one branch per name in
    /// `req.names` from it (E2B's fork; `Fork` forks an existing point). `req.checkpoint` is
    /// ignored.
    ForkLive {
        /// Source sandbox.
        name: String,
        /// Branch names and settings.
        req: ForkRequest,
    },
    /// Pause a running sandbox: a `full` restore point, then every process is stopped (its
    /// memory freed; files and record stay); its life is `paused` with that point and its
    /// deadline is cleared. `conflict` unless it runs.
    Pause {
        /// Sandbox name.
        name: String,
    },
    /// Park a running sandbox: a `full` restore point, then every process stopped (memory
    /// freed); its life is `parked`, and any action that needs it running wakes it first.
    Park {
        /// Sandbox name.
        name: String,
    },
    /// Wake a parked sandbox (restore its park point in place, its conversation kept); any
    /// other sandbox is left as it is.
    Wake {
        /// Sandbox name.
        name: String,
    },
    /// Bring a sandbox back: a paused one from its pause point (in place), a stopped or dead
    /// one from its newest point. A running one: `conflict`, or nothing with `ensure`.
    Resume {
        /// Sandbox name.
        name: String,
        /// Make it run whatever it is (E2B's `connect`).
        ensure: bool,
        /// A new deadline.
        timeout: Option<TimeoutSet>,
    },
    /// Kill, as E2B means it: a sandbox with labelled restore points is retired (they outlive
    /// it), any other is removed with its points.
    Kill {
        /// Sandbox name.
        name: String,
    },
    /// The cheap state of one sandbox (its record and one `/proc` stat).
    Status {
        /// Sandbox name.
        name: String,
    },
    /// Give restore point `point` of `name` labels, each unique on the host (E2B snapshot ids
    /// and names).
    LabelPoint {
        /// Sandbox name.
        name: String,
        /// Point id.
        point: String,
        /// Labels.
        labels: Vec<String>,
    },
    /// Drop every label of the point labelled `label`; the last labelled point of a retired
    /// sandbox removes it.
    DeleteLabel {
        /// One of the point's labels.
        label: String,
    },
    /// Every labelled point on the host.
    Labels,
    /// The sandbox's conversation log, up to a restore point's offset.
    Conversation {
        /// Sandbox name.
        name: String,
        /// Restore point id.
        at: Option<String>,
    },
    /// Mark a turn boundary; answers once the turn's restore point is published.
    Turn {
        /// Sandbox name.
        name: String,
    },
    /// The sandbox's declared harness changed its own state: the next decided checkpoint
    /// dumps the processes (the turn policy's harness rule).
    HarnessChanged {
        /// Sandbox name.
        name: String,
    },
    /// Prometheus text of the proxy and the engine.
    Metrics,
    /// The live view of `crab top`.
    Top,
    /// The remote store's points (of one sandbox, or all).
    RemoteList {
        /// Only this sandbox's.
        sandbox: Option<String>,
    },
    /// Verify every object the remote's points reference.
    RemoteCheck,
    /// Remove all but the newest `keep_last` points per sandbox from the remote.
    RemotePrune {
        /// How many to keep per sandbox.
        keep_last: usize,
    },
    /// Answer once a local point is durable in the remote.
    RemoteWait {
        /// Sandbox.
        sandbox: String,
        /// Point id.
        point: String,
        /// How long to wait.
        timeout: std::time::Duration,
    },
    /// Build sandboxes from a point in the remote store (this host needs nothing else).
    FromRemote(FromRemote),
    /// Change (or, empty, only show) the sandboxes whose newest remote points this host keeps
    /// materialized: `crab remote follow`.
    Follow(crate::follow::FollowRequest),
    /// Replace what sandbox `name` holds — files, processes, conversation — by a point of
    /// another sandbox, or of the remote store, in place and under its lifecycle lock: it
    /// keeps its name, record, limits and profile, and nothing of it is touched before every
    /// check passed (a failure after its processes were stopped puts its files back, with a
    /// fresh init). Inspect's snapshot restore.
    Replace {
        /// The sandbox replaced.
        name: String,
        /// `SB@POINT`: the point.
        source: String,
        /// The point is in the remote store (materialized here first).
        remote: bool,
        /// Its files and conversation only, a fresh init instead of its processes.
        fs_only: bool,
    },
    /// A file operation inside a sandbox (read, write, stat, list, mkdir, remove, rename, tar
    /// out, tar in), run there as `user` (root when `None`).
    Files {
        /// Sandbox name.
        name: String,
        /// The account inside the sandbox.
        user: Option<String>,
        /// The operation.
        op: crab_sandbox::files::FileOp,
    },
}

impl std::fmt::Debug for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Action {
    /// The action's name (for logs).
    /// The sandbox this action needs running, if any: the host wakes it first when it is
    /// parked (commands, files, background processes, verdicts, checkpoints, a live fork).
    pub fn needs_running(&self) -> Option<&str> {
        match self {
            Action::Exec { name, .. }
            | Action::ExecAttach { name, .. }
            | Action::ExecStdin { name, .. }
            | Action::ProcStart { name, .. }
            | Action::ProcList { name }
            | Action::ProcGet { name, .. }
            | Action::ProcOutput { name, .. }
            | Action::ProcStdin { name, .. }
            | Action::ProcCloseStdin { name, .. }
            | Action::ProcSignal { name, .. }
            | Action::Inspect { name, .. }
            | Action::Checkpoint { name, .. }
            | Action::Turn { name, .. }
            | Action::ForkLive { name, .. }
            | Action::Files { name, .. } => Some(name),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Action::Version => "version",
            Action::ListImages => "list_images",
            Action::BuildImage { .. } => "build_image",
            Action::BuildStart { .. } => "build_start",
            Action::BuildStatus { .. } => "build_status",
            Action::ImportImage { .. } => "import_image",
            Action::CommitImage { .. } => "commit_image",
            Action::PullImage { .. } => "pull_image",
            Action::PushImage { .. } => "push_image",
            Action::RemoveImage { .. } => "remove_image",
            Action::ListSandboxes => "list_sandboxes",
            Action::GetSandbox { .. } => "get_sandbox",
            Action::Create(_) => "create",
            Action::Update { .. } => "update",
            Action::Remove { .. } => "remove",
            Action::Stop { .. } => "stop",
            Action::Retire { .. } => "retire",
            Action::Start { .. } => "start",
            Action::Exec { .. } => "exec",
            Action::ExecStdin { .. } => "exec_stdin",
            Action::ExecAttach { .. } => "exec_attach",
            Action::ProcStart { .. } => "proc_start",
            Action::ProcList { .. } => "proc_list",
            Action::ProcGet { .. } => "proc_get",
            Action::ProcOutput { .. } => "proc_output",
            Action::ProcStdin { .. } => "proc_stdin",
            Action::ProcCloseStdin { .. } => "proc_close_stdin",
            Action::ProcSignal { .. } => "proc_signal",
            Action::Inspect { .. } => "inspect",
            Action::Checkpoint { .. } => "checkpoint",
            Action::ListCheckpoints { .. } => "list_checkpoints",
            Action::Prune { .. } => "prune",
            Action::WithProgress { action, .. } => action.name(),
            Action::Restore { .. } => "restore",
            Action::Fork { .. } => "fork",
            Action::ForkLive { .. } => "fork_live",
            Action::Pause { .. } => "pause",
            Action::Park { .. } => "park",
            Action::Wake { .. } => "wake",
            Action::Resume { .. } => "resume",
            Action::Kill { .. } => "kill",
            Action::Status { .. } => "status",
            Action::LabelPoint { .. } => "label_point",
            Action::DeleteLabel { .. } => "delete_label",
            Action::Labels => "labels",
            Action::Conversation { .. } => "conversation",
            Action::Turn { .. } => "turn",
            Action::HarnessChanged { .. } => "harness_changed",
            Action::Metrics => "metrics",
            Action::Top => "top",
            Action::RemoteList { .. } => "remote_list",
            Action::RemoteCheck => "remote_check",
            Action::RemotePrune { .. } => "remote_prune",
            Action::RemoteWait { .. } => "remote_wait",
            Action::FromRemote(_) => "from_remote",
            Action::Follow(_) => "remote_follow",
            Action::Replace { .. } => "replace",
            Action::Files { .. } => "files",
        }
    }

    /// A checkpoint action from the API's request: `kind` is `auto` (or absent), `skip`, `fs`,
    /// `process` or `full`.
    pub fn checkpoint(name: String, req: CheckpointCreateRequest) -> Result<Action, HostError> {
        let kind = match req.kind.as_deref().unwrap_or("auto") {
            "auto" => None,
            other => Some(other.parse::<CheckpointKind>().map_err(|_| {
                HostError::invalid(
                    format!("unknown checkpoint kind {other:?}"),
                    "use auto, skip, fs, process or full",
                )
            })?),
        };
        Ok(Action::Checkpoint {
            name,
            kind,
            turn: req.turn,
            conversation_offset: req.conversation_offset,
        })
    }
}

/// Answer of [`Action::Checkpoint`].
#[derive(Debug, Clone, Serialize)]
pub struct Taken {
    /// The published restore point.
    pub point: PointSummary,
    /// The inspector's verdict when the kind was `auto`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
    /// Why the kind is what it is (e.g. `inspector unavailable: ...`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// Time the job waited in the engine's queue, ms.
    pub queue_ms: f64,
}

/// One restore point as `crab checkpoints` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct PointView {
    /// The point.
    #[serde(flatten)]
    pub point: PointSummary,
    /// Its export state, when the host has a remote store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<PointState>,
}

/// Answer of [`Action::Prune`]: the ids removed.
#[derive(Debug, Clone, Serialize)]
pub struct Pruned {
    /// Restore points.
    pub points: Vec<String>,
    /// Process images.
    pub procs: Vec<String>,
    /// Filesystem snapshots.
    pub fs: Vec<String>,
}

/// Answer of [`Action::Turn`].
#[derive(Debug, Clone, Serialize)]
pub struct TurnMarked {
    /// The turn's number.
    pub turn: u64,
    /// Its published restore point.
    pub checkpoint: String,
}

/// Answer of [`Action::HarnessChanged`].
#[derive(Debug, Clone, Serialize)]
pub struct HarnessMarked {
    /// The sandbox.
    pub sandbox: String,
    /// Its next decided checkpoint dumps the processes (always true).
    pub next_checkpoint_dumps: bool,
}

/// Answer of [`Action::Top`].
#[derive(Debug, Clone, Serialize)]
pub struct TopView {
    /// The proxy's per-sandbox counters.
    pub proxy: Vec<SandboxProxyStats>,
    /// The engine's queue and per-sandbox stats.
    pub engine: EngineStats,
    /// Where the exposed time of the newest turns went, stage by stage (largest first).
    pub held_stages: Vec<crab_common::stats::StageSummary>,
    /// Parked sandboxes, parks and wakes.
    pub parking: crate::parking::ParkingStats,
}

/// What an action answers. Serializes as the API's response body (untagged); [`Outcome::Exec`]
/// and [`Outcome::Metrics`] are rendered by the front door (a stream, plain text).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Outcome {
    /// Version.
    Version(VersionInfo),
    /// Images.
    Images(Vec<ImageInfo>),
    /// One image.
    Image(ImageInfo),
    /// An image built from a Dockerfile, with its steps.
    Built(Box<crab_common::api::ImageBuildReport>),
    /// An image pushed to a registry.
    Pushed(Box<crab_common::api::ImagePushReport>),
    /// A background build started: its id.
    BuildStarted(String),
    /// A background build's state and log lines.
    BuildStatus(Box<crab_common::api::BuildJobStatus>),
    /// Sandboxes.
    Sandboxes(Vec<SandboxInfo>),
    /// One sandbox.
    Sandbox(Box<SandboxInfo>),
    /// Something was removed.
    Removed {
        /// Always true.
        removed: bool,
        /// For an image: the sandboxes made from it, which keep working (their files are
        /// their own snapshots, their points theirs).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        used_by: Vec<String>,
    },
    /// The frames of a running command.
    #[serde(skip)]
    Exec(mpsc::Receiver<ExecFrame>),
    /// Bytes written to an exec session's stdin.
    StdinWritten(crab_common::api::StdinWritten),
    /// One background process.
    Proc(Box<crab_common::api::ProcInfo>),
    /// Background processes.
    Procs(Vec<crab_common::api::ProcInfo>),
    /// A verdict.
    Verdict(Box<Verdict>),
    /// A checkpoint taken.
    Taken(Box<Taken>),
    /// Restore points.
    Points(Vec<PointView>),
    /// Pruned ids.
    Pruned(Pruned),
    /// A restore.
    Restored(RestoreReport),
    /// Fork branches.
    Forked(Vec<ForkBranch>),
    /// A sandbox stopped, started, paused, resumed, retired or killed.
    Lifecycle(Lifecycle),
    /// One sandbox's state.
    Status(SandboxStatus),
    /// Labelled points.
    Labels(Vec<LabelledPoint>),
    /// A point's labels dropped.
    LabelDeleted(LabelDeleted),
    /// Conversation records.
    Conversation(Vec<LogRecord>),
    /// A turn marked.
    Turn(TurnMarked),
    /// A harness change recorded.
    HarnessMarked(HarnessMarked),
    /// Prometheus text.
    #[serde(skip)]
    Metrics(String),
    /// `crab top`.
    Top(Box<TopView>),
    /// The remote's points.
    RemotePoints(Vec<crab_remote::PointRecord>),
    /// `crab remote check`.
    RemoteChecked(crab_remote::CheckReport),
    /// `crab remote prune`.
    RemotePruned(crab_remote::PruneReport),
    /// A point is durable.
    Durable(Durable),
    /// Sandboxes built from the remote.
    FromRemote(Box<FromRemoteReport>),
    /// `crab remote follow`.
    Follow(crate::follow::FollowReport),
    /// What a file operation answered (an entry, entries, done, or a byte stream the front
    /// door renders).
    Files(crab_sandbox::files::FileAnswer),
}
