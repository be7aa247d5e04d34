//! The host's side of the sandbox file service: [`Action::Files`] checks the sandbox exists and
//! hands the operation to `crab_sandbox::files`, which runs it inside the sandbox as the
//! requested user (nothing on the host is opened by a path the sandbox chose). One service for
//! every front door: the daemon's `/v1/sandboxes/{name}/files…` routes (and through them
//! `crab docker cp` and the SDK's `sb.files`), and E2B's `/files` and envd filesystem.
//!
//! [`Action::Files`]: crate::Action::Files

use std::sync::Arc;

use crab_sandbox::files::FileOp;

use crate::{Host, HostError, Outcome};

impl Host {
    /// Run file operation `op` in sandbox `name` as `user` (root when `None`).
    pub(crate) async fn files(
        self: &Arc<Self>,
        name: String,
        user: Option<String>,
        op: FileOp,
    ) -> Result<Outcome, HostError> {
        // Unknown sandboxes are refused before anything starts (`sandbox_not_found`).
        self.runtime().record(&name)?;
        tracing::debug!(sandbox = %name, op = op.name(), "file operation");
        let answer =
            crab_sandbox::files::run(self.runtime().clone(), &name, user.as_deref(), op).await?;
        Ok(Outcome::Files(answer))
    }
}
