//! The host's handlers of the background-process service ([`crab_sandbox::procs`]): start,
//! list, describe, stream the output of, feed, close the stdin of and signal a sandbox's
//! detached processes. The state lives in the sandbox (so a daemon restart, a restore and a
//! fork keep it); these handlers hold none, they only run the service off the async runtime.

use std::sync::Arc;

use crab_common::api::{ProcInfo, ProcStartRequest, StdinWritten};
use crab_sandbox::{procs, Runtime};

use crate::host::Host;
use crate::{HostError, Outcome};

async fn blocking<T: Send + 'static>(
    rt: &Arc<Runtime>,
    f: impl FnOnce(&Runtime) -> Result<T, crab_sandbox::SandboxError> + Send + 'static,
) -> Result<T, HostError> {
    let rt = rt.clone();
    tokio::task::spawn_blocking(move || f(&rt))
        .await
        .unwrap_or_else(|e| {
            Err(crab_sandbox::SandboxError::Other(format!("host task panicked: {e}")))
        })
        .map_err(HostError::from)
}

impl Host {
    /// The id a selector names: an id as is, `tag:NAME` and `pid:N` looked up.
    async fn proc_id(&self, name: &str, id: String) -> Result<String, HostError> {
        if procs::valid_id(&id) {
            return Ok(id);
        }
        let name = name.to_string();
        Ok(blocking(&self.runtime, move |rt| procs::select(rt, &name, &id)).await?.id)
    }

    /// `Action::ProcStart`.
    pub(crate) async fn proc_start(
        &self,
        name: String,
        req: ProcStartRequest,
    ) -> Result<Outcome, HostError> {
        let sandbox = name.clone();
        let p = procs::start(self.runtime.clone(), name, req).await?;
        tracing::info!(%sandbox, process = %p.id, "background process started");
        Ok(Outcome::Proc(Box::new(p)))
    }

    /// `Action::ProcList`.
    pub(crate) async fn proc_list(&self, name: String) -> Result<Outcome, HostError> {
        let v: Vec<ProcInfo> = blocking(&self.runtime, move |rt| procs::list(rt, &name)).await?;
        Ok(Outcome::Procs(v))
    }

    /// `Action::ProcGet`; `id` may also be `tag:NAME` or `pid:N` (the running process with
    /// that tag, or whose supervisor has that pid in the sandbox: E2B's selectors).
    pub(crate) async fn proc_get(&self, name: String, id: String) -> Result<Outcome, HostError> {
        let p = blocking(&self.runtime, move |rt| procs::select(rt, &name, &id)).await?;
        Ok(Outcome::Proc(Box::new(p)))
    }

    /// `Action::ProcOutput`: the stream of its output frames.
    pub(crate) async fn proc_output(
        &self,
        name: String,
        id: String,
        offsets: (u64, u64),
        follow: bool,
    ) -> Result<Outcome, HostError> {
        // Unknown sandboxes and processes are refused before the stream starts.
        let id = self.proc_id(&name, id).await?;
        let (n, i) = (name.clone(), id.clone());
        blocking(&self.runtime, move |rt| procs::info(rt, &n, &i)).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        // A follower is a client of the sandbox until its stream ends.
        let client = self.clients.connect(&name);
        let rt = self.runtime.clone();
        tokio::spawn(async move {
            procs::output(rt, name, id, offsets, follow, tx).await;
            drop(client);
        });
        Ok(Outcome::Exec(rx))
    }

    /// `Action::ProcStdin`.
    pub(crate) async fn proc_stdin(
        &self,
        name: String,
        id: String,
        data: Vec<u8>,
    ) -> Result<Outcome, HostError> {
        let id = self.proc_id(&name, id).await?;
        let written = procs::send_input(self.runtime.clone(), name, id, data).await?;
        Ok(Outcome::StdinWritten(StdinWritten { written, eof: false }))
    }

    /// `Action::ProcCloseStdin`.
    pub(crate) async fn proc_close_stdin(
        &self,
        name: String,
        id: String,
    ) -> Result<Outcome, HostError> {
        let id = self.proc_id(&name, id).await?;
        let p = procs::close_input(self.runtime.clone(), name, id).await?;
        Ok(Outcome::Proc(Box::new(p)))
    }

    /// `Action::ProcSignal`.
    pub(crate) async fn proc_signal(
        &self,
        name: String,
        id: String,
        signal: String,
    ) -> Result<Outcome, HostError> {
        let id = self.proc_id(&name, id).await?;
        let p = procs::signal(self.runtime.clone(), name, id, signal).await?;
        Ok(Outcome::Proc(Box::new(p)))
    }
}
