//! [`Backend`]: the host actions the E2B front door translates into — one method per action,
//! implemented by the daemon over `crab_host::Host::execute`. The front door never chains
//! lifecycle steps: a create from a snapshot is one fork, a pause one pause action.

use std::future::Future;

use crab_common::api::{ExecFrame, ExecRequest, SandboxCreateRequest};
use crab_common::files::FileEntry;
use crab_common::{ApiError, CheckpointKind};
use tokio::sync::mpsc;

/// What the front door asks of the host.
pub trait Backend: Send + Sync + 'static {
    /// Create and start a sandbox.
    fn create(
        &self,
        req: SandboxCreateRequest,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Remove a sandbox (killing what runs in it) and its restore points.
    fn remove(&self, name: String) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Keep a sandbox only for its restore points (E2B's kill of a sandbox whose snapshots
    /// live on): its processes are killed, its points stay, the host marks it a holder.
    fn retire(&self, name: String) -> impl Future<Output = Result<(), ApiError>> + Send;
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
    /// — or, when `point` is `None`, from a `full` point of the sandbox as it is now; answers,
    /// per name, the branch or why it failed.
    fn fork(
        &self,
        name: String,
        point: Option<String>,
        names: Vec<String>,
        fs_only: bool,
    ) -> impl Future<Output = Result<Vec<Result<String, ApiError>>, ApiError>> + Send;
    /// Pause: a `full` restore point, then the sandbox's processes stop (memory freed).
    fn pause(&self, name: String) -> impl Future<Output = Result<String, ApiError>> + Send;
    /// Resume a paused sandbox in place from its pause point, processes included.
    fn resume(
        &self,
        name: String,
        point: String,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Start a sandbox whose init is gone, from its newest restore point (`crab sandbox start`).
    fn start(&self, name: String) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Every sandbox on the host: its name and whether its init is alive.
    fn sandboxes(&self) -> impl Future<Output = Result<Vec<(String, bool)>, ApiError>> + Send;
    /// The ids of sandbox `name`'s restore points.
    fn points(&self, name: String) -> impl Future<Output = Result<Vec<String>, ApiError>> + Send;
    /// Names of the images (E2B templates).
    fn images(&self) -> impl Future<Output = Result<Vec<String>, ApiError>> + Send;
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
