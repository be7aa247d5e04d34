//! [`Action::WithProgress`]: the long actions that report their stages to a front door's
//! [`Progress`] (the daemon streams them to the CLI as `ProgressFrame`s when the client asks).
//! Restore reports the checkpointer's `verify`, `filesystem`, `processes`; fork its `verify`
//! and `branches` (one step per branch up); from-remote `load_point`, `materialize`, then the
//! fork's. The actions themselves are the plain ones (`Host::restore`, `fork`, `from_remote`):
//! only where the stages go differs.

use std::sync::Arc;

use crab_common::Progress;

use crate::{Action, Host, HostError, Outcome};

impl Host {
    /// Run `action` reporting its stages to `progress`.
    pub(crate) async fn with_progress(
        self: &Arc<Self>,
        action: Action,
        progress: Arc<dyn Progress>,
    ) -> Result<Outcome, HostError> {
        match action {
            Action::Restore { name, checkpoint } => {
                let l = self.life_lock(&name);
                let _g = l.lock().await;
                self.restore(name, checkpoint, progress).await
            }
            Action::Fork { name, req } => self.fork(name, req, progress).await,
            Action::FromRemote(req) => self.from_remote(req, progress).await,
            other => Err(HostError::invalid(
                format!("{} reports no progress", other.name()),
                "ask for progress on restore, fork and remote restore only",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_progress_wrapper_is_named_after_its_action() {
        let a = Action::WithProgress {
            action: Box::new(Action::Restore { name: "s".into(), checkpoint: None }),
            progress: Box::new(crab_common::NoProgress),
        };
        assert_eq!(a.name(), "restore");
    }
}
