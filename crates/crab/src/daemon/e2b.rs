//! The E2B front door's [`Backend`]: each method is one `Host::execute` of one action.

use std::sync::Arc;

use crab_common::api::{ExecFrame, ExecRequest, SandboxCreateRequest};
use crab_common::files::FileEntry;
use crab_common::{ApiError, CheckpointKind};
use crab_e2b::Backend;
use crab_host::{Action, Host, Outcome};
use crab_sandbox::files::{Chunks, FileAnswer, FileOp};
use tokio::sync::mpsc;

/// The host, as the E2B front door sees it.
#[derive(Debug)]
pub struct HostBackend(pub Arc<Host>);

fn unexpected(action: &str) -> ApiError {
    ApiError::internal(format!("the host answered {action} with an unexpected outcome"))
}

impl HostBackend {
    async fn run(&self, a: Action) -> Result<Outcome, ApiError> {
        self.0.execute(a).await.map_err(|e| e.into_api())
    }

    async fn files(&self, name: String, user: String, op: FileOp) -> Result<FileAnswer, ApiError> {
        match self.run(Action::Files { name, user: Some(user), op }).await? {
            Outcome::Files(a) => Ok(a),
            _ => Err(unexpected("files")),
        }
    }

    async fn file_entry(
        &self,
        name: String,
        user: String,
        op: FileOp,
    ) -> Result<FileEntry, ApiError> {
        match self.files(name, user, op).await? {
            FileAnswer::Entry(e) => Ok(*e),
            _ => Err(unexpected("files")),
        }
    }
}

impl Backend for HostBackend {
    async fn create(&self, req: SandboxCreateRequest) -> Result<(), ApiError> {
        self.run(Action::Create(req)).await.map(|_| ())
    }

    async fn remove(&self, name: String) -> Result<(), ApiError> {
        self.run(Action::Remove { name, force: true }).await.map(|_| ())
    }

    async fn retire(&self, name: String) -> Result<(), ApiError> {
        let why = "killed through the E2B API while it holds snapshots; deleting its last \
                   snapshot (Sandbox.delete_snapshot) removes it"
            .to_string();
        self.run(Action::Retire { name, why }).await.map(|_| ())
    }

    async fn exec(
        &self,
        name: String,
        req: ExecRequest,
    ) -> Result<mpsc::Receiver<ExecFrame>, ApiError> {
        match self.run(Action::Exec { name, req }).await? {
            Outcome::Exec(rx) => Ok(rx),
            _ => Err(unexpected("exec")),
        }
    }

    async fn checkpoint(&self, name: String, kind: CheckpointKind) -> Result<String, ApiError> {
        let a =
            Action::Checkpoint { name, kind: Some(kind), turn: None, conversation_offset: None };
        match self.run(a).await? {
            // A memory snapshot that holds no processes is not what was asked for: say so
            // (the files-only point stays published).
            Outcome::Taken(t) => match (&t.point.procs_missing, kind) {
                (Some(why), CheckpointKind::Full) => Err(ApiError::new(
                    crab_common::ErrorCode::CriuFailed,
                    format!(
                        "the memory snapshot holds no processes: {why} (point {} has the files only)",
                        t.point.id
                    ),
                    "take a filesystem snapshot (mode=\"filesystem\") or see the CRIU log named above",
                )),
                _ => Ok(t.point.id.clone()),
            },
            _ => Err(unexpected("checkpoint")),
        }
    }

    async fn fork(
        &self,
        name: String,
        point: Option<String>,
        names: Vec<String>,
        fs_only: bool,
    ) -> Result<Vec<Result<String, ApiError>>, ApiError> {
        let a = match point {
            Some(p) => Action::Fork {
                name,
                req: crab_common::api::ForkRequest {
                    checkpoint: Some(p),
                    count: names.len(),
                    names: Some(names),
                    fs_only,
                },
            },
            None => Action::ForkLive { name, names },
        };
        match self.run(a).await? {
            Outcome::Forked(b) => Ok(b.into_iter().map(|b| Ok(b.sandbox)).collect()),
            _ => Err(unexpected("fork")),
        }
    }

    async fn pause(&self, name: String) -> Result<String, ApiError> {
        match self.run(Action::Pause { name }).await? {
            Outcome::Taken(t) => Ok(t.point.id.clone()),
            _ => Err(unexpected("pause")),
        }
    }

    async fn resume(&self, name: String, point: String) -> Result<(), ApiError> {
        self.run(Action::Restore { name, checkpoint: Some(point) }).await.map(|_| ())
    }

    async fn start(&self, name: String) -> Result<(), ApiError> {
        self.run(Action::Start { name }).await.map(|_| ())
    }

    async fn sandboxes(&self) -> Result<Vec<(String, bool)>, ApiError> {
        match self.run(Action::ListSandboxes).await? {
            Outcome::Sandboxes(v) => Ok(v
                .into_iter()
                .map(|s| (s.name, s.state == crab_common::api::SandboxState::Running))
                .collect()),
            _ => Err(unexpected("list_sandboxes")),
        }
    }

    async fn points(&self, name: String) -> Result<Vec<String>, ApiError> {
        match self.run(Action::ListCheckpoints { name }).await? {
            Outcome::Points(v) => Ok(v.into_iter().map(|p| p.point.id).collect()),
            _ => Err(unexpected("list_checkpoints")),
        }
    }

    async fn images(&self) -> Result<Vec<String>, ApiError> {
        match self.run(Action::ListImages).await? {
            Outcome::Images(v) => Ok(v.into_iter().map(|i| i.name).collect()),
            _ => Err(unexpected("list_images")),
        }
    }

    async fn file_stat(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> Result<FileEntry, ApiError> {
        self.file_entry(name, user, FileOp::Stat { path }).await
    }

    async fn file_list(
        &self,
        name: String,
        user: String,
        path: String,
        depth: u32,
    ) -> Result<Vec<FileEntry>, ApiError> {
        match self.files(name, user, FileOp::List { path, depth }).await? {
            FileAnswer::Entries(v) => Ok(v),
            _ => Err(unexpected("files")),
        }
    }

    async fn file_make_dir(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> Result<FileEntry, ApiError> {
        self.file_entry(name, user, FileOp::MakeDir { path }).await
    }

    async fn file_remove(&self, name: String, user: String, path: String) -> Result<(), ApiError> {
        self.files(name, user, FileOp::Remove { path }).await.map(|_| ())
    }

    async fn file_rename(
        &self,
        name: String,
        user: String,
        from: String,
        to: String,
    ) -> Result<FileEntry, ApiError> {
        self.file_entry(name, user, FileOp::Rename { from, to }).await
    }

    async fn file_read(
        &self,
        name: String,
        user: String,
        path: String,
    ) -> Result<Chunks, ApiError> {
        match self.files(name, user, FileOp::Read { path }).await? {
            FileAnswer::Stream(rx) => Ok(rx),
            _ => Err(unexpected("files")),
        }
    }

    async fn file_write(
        &self,
        name: String,
        user: String,
        path: String,
        data: Chunks,
    ) -> Result<FileEntry, ApiError> {
        self.file_entry(name, user, FileOp::Write { path, mode: None, data }).await
    }
}
