//! The E2B front door's [`Backend`]: each method is one `Host::execute` of one action.

use std::sync::Arc;

use crab_common::api::{
    BranchSettings, ExecFrame, ExecRequest, ForkRequest, LabelledPoint, ProcInfo, ProcStartRequest,
    SandboxCreateRequest, SandboxInfo, SandboxState, SandboxUpdateRequest,
};
use crab_common::files::FileEntry;
use crab_common::life::TimeoutSet;
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

    async fn kill(&self, name: String) -> Result<(), ApiError> {
        self.run(Action::Kill { name }).await.map(|_| ())
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
        branch: BranchSettings,
    ) -> Result<Vec<Result<String, ApiError>>, ApiError> {
        let live = point.is_none();
        let req = ForkRequest {
            checkpoint: point,
            count: names.len(),
            names: Some(names),
            fs_only,
            branch,
        };
        let a = if live { Action::ForkLive { name, req } } else { Action::Fork { name, req } };
        match self.run(a).await? {
            Outcome::Forked(b) => Ok(b.into_iter().map(|b| Ok(b.sandbox)).collect()),
            _ => Err(unexpected("fork")),
        }
    }

    async fn pause(&self, name: String) -> Result<String, ApiError> {
        match self.run(Action::Pause { name }).await? {
            Outcome::Lifecycle(l) => l.point.ok_or_else(|| unexpected("pause")),
            _ => Err(unexpected("pause")),
        }
    }

    async fn resume(&self, name: String, timeout_s: u64) -> Result<bool, ApiError> {
        let timeout = Some(TimeoutSet { timeout_s, on: None, extend_only: true });
        match self.run(Action::Resume { name, ensure: true, timeout }).await? {
            Outcome::Lifecycle(l) => Ok(l.point.is_some()),
            _ => Err(unexpected("resume")),
        }
    }

    async fn set_timeout(
        &self,
        name: String,
        timeout_s: u64,
        extend_only: bool,
    ) -> Result<(), ApiError> {
        let req =
            SandboxUpdateRequest { timeout_s: Some(timeout_s), extend_only, ..Default::default() };
        self.run(Action::Update { name, req }).await.map(|_| ())
    }

    async fn status(&self, name: String) -> Result<SandboxState, ApiError> {
        match self.run(Action::Status { name }).await? {
            Outcome::Status(s) => Ok(as_e2b_sees(s.state)),
            _ => Err(unexpected("status")),
        }
    }

    async fn sandbox(&self, name: String) -> Result<SandboxInfo, ApiError> {
        match self.run(Action::GetSandbox { name }).await? {
            Outcome::Sandbox(mut s) => {
                s.state = as_e2b_sees(s.state);
                Ok(*s)
            }
            _ => Err(unexpected("get_sandbox")),
        }
    }

    async fn sandboxes(&self) -> Result<Vec<SandboxInfo>, ApiError> {
        match self.run(Action::ListSandboxes).await? {
            Outcome::Sandboxes(mut v) => {
                for s in &mut v {
                    s.state = as_e2b_sees(s.state);
                }
                Ok(v)
            }
            _ => Err(unexpected("list_sandboxes")),
        }
    }

    async fn label(
        &self,
        name: String,
        point: String,
        labels: Vec<String>,
    ) -> Result<(), ApiError> {
        self.run(Action::LabelPoint { name, point, labels }).await.map(|_| ())
    }

    async fn labels(&self) -> Result<Vec<LabelledPoint>, ApiError> {
        match self.run(Action::Labels).await? {
            Outcome::Labels(v) => Ok(v),
            _ => Err(unexpected("labels")),
        }
    }

    async fn delete_label(&self, label: String) -> Result<(), ApiError> {
        self.run(Action::DeleteLabel { label }).await.map(|_| ())
    }

    async fn proc_start(&self, name: String, req: ProcStartRequest) -> Result<ProcInfo, ApiError> {
        match self.run(Action::ProcStart { name, req }).await? {
            Outcome::Proc(p) => Ok(*p),
            _ => Err(unexpected("proc_start")),
        }
    }

    async fn proc_list(&self, name: String) -> Result<Vec<ProcInfo>, ApiError> {
        match self.run(Action::ProcList { name }).await? {
            Outcome::Procs(v) => Ok(v),
            _ => Err(unexpected("proc_list")),
        }
    }

    async fn proc_get(&self, name: String, sel: String) -> Result<ProcInfo, ApiError> {
        match self.run(Action::ProcGet { name, id: sel }).await? {
            Outcome::Proc(p) => Ok(*p),
            _ => Err(unexpected("proc_get")),
        }
    }

    async fn proc_output(
        &self,
        name: String,
        id: String,
        offsets: (u64, u64),
        follow: bool,
    ) -> Result<mpsc::Receiver<ExecFrame>, ApiError> {
        match self.run(Action::ProcOutput { name, id, offsets, follow }).await? {
            Outcome::Exec(rx) => Ok(rx),
            _ => Err(unexpected("proc_output")),
        }
    }

    async fn proc_stdin(&self, name: String, sel: String, data: Vec<u8>) -> Result<(), ApiError> {
        self.run(Action::ProcStdin { name, id: sel, data }).await.map(|_| ())
    }

    async fn proc_close_stdin(&self, name: String, sel: String) -> Result<(), ApiError> {
        self.run(Action::ProcCloseStdin { name, id: sel }).await.map(|_| ())
    }

    async fn proc_signal(&self, name: String, sel: String, signal: String) -> Result<(), ApiError> {
        self.run(Action::ProcSignal { name, id: sel, signal }).await.map(|_| ())
    }

    async fn build_start(
        &self,
        id: String,
        image: String,
        dockerfile: std::path::PathBuf,
        context: std::path::PathBuf,
        no_cache: bool,
    ) -> Result<(), ApiError> {
        let req = crab_common::api::ImageBuildRequest {
            dockerfile: Some(dockerfile.display().to_string()),
            context: Some(context.display().to_string()),
            no_cache,
            ..crab_common::api::ImageBuildRequest::debian(Some(image))
        };
        match self.run(Action::BuildStart { id, req }).await? {
            Outcome::BuildStarted(_) => Ok(()),
            _ => Err(unexpected("build_start")),
        }
    }

    async fn build_status(
        &self,
        id: String,
        offset: u64,
        max: usize,
    ) -> Result<crab_common::api::BuildJobStatus, ApiError> {
        match self.run(Action::BuildStatus { id, offset, max }).await? {
            Outcome::BuildStatus(s) => Ok(*s),
            _ => Err(unexpected("build_status")),
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

/// Hand the sandboxes' life that an older daemon's E2B front door kept in its own files
/// (`<state>/e2b/sandboxes/*.json` of format ≤ 2: run state, pause point, deadline, metadata,
/// environment, template, snapshots) to the host once, then delete each file (the processes
/// it listed are not carried over). Runs at every start, E2B served or not; a file whose
/// sandbox is gone is deleted; one the host cannot take is left as it was (and logged), to be
/// tried again at the next start.
pub async fn migrate(host: &Arc<Host>, dir: &std::path::Path) {
    if !dir.join("sandboxes").is_dir() {
        return;
    }
    let store = match crab_e2b::Store::open(dir) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot open the E2B front-door state to migrate it");
            return;
        }
    };
    for f in store.load() {
        use crab_common::life::{Life, OnDeadline};
        use crab_e2b::store::StoredState;
        let life = match (f.state, &f.pause_point) {
            (StoredState::Paused, Some(p)) => Life::Paused { point: p.clone() },
            (StoredState::Paused, None) => Life::Stopped,
            (StoredState::Killed, _) => Life::Retired {
                why: "killed through the E2B API while it holds snapshots; deleting its last \
                      snapshot (Sandbox.delete_snapshot) removes it"
                    .into(),
            },
            _ => Life::Running,
        };
        let running = life == Life::Running;
        let adopted = crab_host::Adopted {
            life,
            labels: f.metadata.clone().into_iter().collect(),
            env: f.envs.clone().into_iter().collect(),
            template: (!f.template.is_empty()).then(|| f.template.clone()),
            deadline_ms: (running && f.end_at_ms > 0).then_some(f.end_at_ms),
            on_deadline: if f.auto_pause { OnDeadline::Pause } else { OnDeadline::Kill },
            point_labels: f
                .snapshots
                .iter()
                .map(|s| {
                    let mut l = vec![s.id.clone()];
                    l.extend(s.names.iter().cloned());
                    (s.point.clone(), l)
                })
                .collect(),
        };
        match host.adopt(f.id.clone(), adopted).await {
            Ok(()) => {
                if !f.processes.is_empty() {
                    tracing::warn!(sandbox = %f.id, processes = f.processes.len(), "E2B processes started by the previous version are not carried over: they keep running in the sandbox, but commands.list() no longer shows them");
                }
                match store.delete(&f.id) {
                    Ok(()) => {
                        tracing::info!(sandbox = %f.id, "E2B front-door state migrated into the sandbox's record")
                    }
                    Err(e) => {
                        tracing::error!(sandbox = %f.id, error = %e, "E2B state migrated, but its file could not be deleted; it is migrated again at the next start")
                    }
                }
            }
            Err(e) if e.0.code == crab_common::ErrorCode::SandboxNotFound => {
                tracing::info!(sandbox = %f.id, "E2B state of a sandbox that no longer exists: deleted");
                if let Err(e) = store.delete(&f.id) {
                    tracing::warn!(sandbox = %f.id, error = %e, "cannot delete its E2B state file");
                }
            }
            Err(e) => {
                tracing::error!(sandbox = %f.id, error = %e.0.message, "cannot migrate the E2B state of the sandbox into its record; its file is kept, tried again at the next start")
            }
        }
    }
}

/// A parked sandbox is running as far as E2B is concerned: any call to it wakes it first, so
/// an E2B client never sees it parked (listing it `paused` would make the SDK resume it).
fn as_e2b_sees(s: SandboxState) -> SandboxState {
    match s {
        SandboxState::Parked => SandboxState::Running,
        s => s,
    }
}
