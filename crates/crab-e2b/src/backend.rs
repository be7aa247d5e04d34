//! [`Backend`]: the host actions the E2B front door translates into — one method per action,
//! implemented by the daemon over `crab_host::Host::execute`. The front door never chains
//! lifecycle steps and keeps no lifecycle state: a create from a snapshot is one fork, a pause
//! one pause action, a connect one resume; state, deadlines, metadata and snapshots are read
//! back from the host.

use std::future::Future;

use crab_common::api::{
    BranchSettings, ExecFrame, ExecRequest, LabelledPoint, ProcInfo, ProcStartRequest,
    SandboxCreateRequest, SandboxInfo, SandboxState,
};
use crab_common::files::FileEntry;
use crab_common::{ApiError, CheckpointKind};
use tokio::sync::mpsc;

/// What the front door asks of the host.
pub trait Backend: Send + Sync + 'static {
    /// Create and start a sandbox (with its metadata, environment and deadline).
    fn create(
        &self,
        req: SandboxCreateRequest,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Kill: retired when labelled points (snapshots) must outlive it, else removed.
    fn kill(&self, name: String) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Run a command; the receiver yields its frames and dropping it kills the command.
    fn exec(
        &self,
        name: String,
        req: ExecRequest,
    ) -> impl Future<Output = Result<mpsc::Receiver<ExecFrame>, ApiError>> + Send;
    /// Take a restore point of `kind` (`full` or `fs`) now; answers its id.
    fn checkpoint(
        &self,
        name: String,
        kind: CheckpointKind,
    ) -> impl Future<Output = Result<String, ApiError>> + Send;
    /// New sandboxes `names` from restore point `point` of `name` — files only with `fs_only`
    /// — or, when `point` is `None`, from a `full` point of the sandbox as it is now, with
    /// `branch`'s settings; answers, per name, the branch or why it failed.
    fn fork(
        &self,
        name: String,
        point: Option<String>,
        names: Vec<String>,
        fs_only: bool,
        branch: BranchSettings,
    ) -> impl Future<Output = Result<Vec<Result<String, ApiError>>, ApiError>> + Send;
    /// Pause: a `full` restore point, then the sandbox's processes stop (memory freed).
    fn pause(&self, name: String) -> impl Future<Output = Result<String, ApiError>> + Send;
    /// Make it run (resume a paused one, start a stopped or dead one, leave a running one),
    /// with a deadline `timeout_s` from now that never shortens a later one; answers whether
    /// it was brought back.
    fn resume(
        &self,
        name: String,
        timeout_s: u64,
    ) -> impl Future<Output = Result<bool, ApiError>> + Send;
    /// Set its deadline `timeout_s` from now (`extend_only`: never shorten it).
    fn set_timeout(
        &self,
        name: String,
        timeout_s: u64,
        extend_only: bool,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Its state (cheap: one record, one `/proc` stat).
    fn status(&self, name: String) -> impl Future<Output = Result<SandboxState, ApiError>> + Send;
    /// Describe it.
    fn sandbox(&self, name: String) -> impl Future<Output = Result<SandboxInfo, ApiError>> + Send;
    /// Every sandbox on the host.
    fn sandboxes(&self) -> impl Future<Output = Result<Vec<SandboxInfo>, ApiError>> + Send;
    /// Give restore point `point` of `name` labels (a snapshot's id and names).
    fn label(
        &self,
        name: String,
        point: String,
        labels: Vec<String>,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Every labelled point (snapshot).
    fn labels(&self) -> impl Future<Output = Result<Vec<LabelledPoint>, ApiError>> + Send;
    /// Drop the labels of the point labelled `label` (the last one of a retired sandbox
    /// removes it).
    fn delete_label(&self, label: String) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Start building image `image` from `dockerfile` with context `context` in the
    /// background as build `id` (an E2B template build).
    fn build_start(
        &self,
        id: String,
        image: String,
        dockerfile: std::path::PathBuf,
        context: std::path::PathBuf,
        no_cache: bool,
    ) -> impl Future<Output = Result<(), ApiError>> + Send {
        let _ = (id, image, dockerfile, context, no_cache);
        async { Err(ApiError::invalid("this host runs no background builds", "")) }
    }
    /// Build `id`'s state and up to `max` log lines from `offset`.
    fn build_status(
        &self,
        id: String,
        offset: u64,
        max: usize,
    ) -> impl Future<Output = Result<crab_common::api::BuildJobStatus, ApiError>> + Send {
        let _ = (offset, max);
        async move { Err(ApiError::invalid(format!("no build {id:?}"), "")) }
    }
    /// Names of the images (E2B templates).
    fn images(&self) -> impl Future<Output = Result<Vec<String>, ApiError>> + Send;
    /// Start a background process (the host's one process service).
    fn proc_start(
        &self,
        name: String,
        req: ProcStartRequest,
    ) -> impl Future<Output = Result<ProcInfo, ApiError>> + Send;
    /// Every background process of `name` (running, and ended ones not removed yet).
    fn proc_list(
        &self,
        name: String,
    ) -> impl Future<Output = Result<Vec<ProcInfo>, ApiError>> + Send;
    /// One background process, by id, `pid:N` or `tag:T`.
    fn proc_get(
        &self,
        name: String,
        sel: String,
    ) -> impl Future<Output = Result<ProcInfo, ApiError>> + Send;
    /// Its output from `offsets` (bytes of stdout, stderr already seen), following it with
    /// `follow`, as exec frames (the last an `Exit`, or an `Error` when it was lost).
    fn proc_output(
        &self,
        name: String,
        id: String,
        offsets: (u64, u64),
        follow: bool,
    ) -> impl Future<Output = Result<mpsc::Receiver<ExecFrame>, ApiError>> + Send;
    /// Write to its stdin.
    fn proc_stdin(
        &self,
        name: String,
        sel: String,
        data: Vec<u8>,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Close its stdin.
    fn proc_close_stdin(
        &self,
        name: String,
        sel: String,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Send it `signal` (`KILL`, `TERM`).
    fn proc_signal(
        &self,
        name: String,
        sel: String,
        signal: String,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    // The sandbox file service (`crab_sandbox::files`): each call runs inside sandbox `name` as
    // `user`; paths are as the client gave them (absolute, `~/…`, or from the user's home).
    /// Describe a path.
    fn file_stat(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> impl Future<Output = Result<FileEntry, ApiError>> + Send;
    /// The entries of a directory, `depth` levels deep.
    fn file_list(
        &self,
        name: String,
        user: String,
        path: String,
        depth: u32,
    ) -> impl Future<Output = Result<Vec<FileEntry>, ApiError>> + Send;
    /// Make a directory and its parents (`already_exists` when it exists).
    fn file_make_dir(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> impl Future<Output = Result<FileEntry, ApiError>> + Send;
    /// Remove a file or a tree.
    fn file_remove(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Rename `from` to `to`; the new path's entry.
    fn file_rename(
        &self,
        name: String,
        user: String,
        from: String,
        to: String,
    ) -> impl Future<Output = Result<FileEntry, ApiError>> + Send;
    /// A file's bytes, as a stream of chunks (an `Err` ends it as failed).
    fn file_read(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> impl Future<Output = Result<mpsc::Receiver<Result<Vec<u8>, ApiError>>, ApiError>> + Send;
    /// Write a file from `data` as it arrives (parents made); its entry.
    fn file_write(
        &self,
        name: String,
        user: String,
        path: String,
        data: mpsc::Receiver<Result<Vec<u8>, ApiError>>,
    ) -> impl Future<Output = Result<FileEntry, ApiError>> + Send;
}
