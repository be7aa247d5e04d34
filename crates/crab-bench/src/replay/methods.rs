//! The recovery methods compared side by side, and what each does at a turn boundary and after
//! a fault. No method looks at the trajectory to decide what to checkpoint: `crab` asks the
//! daemon for an `auto` checkpoint (the inspector's verdict), `full` and `fs` take the same kind
//! every turn, `chat` and `restart` take none.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crab_common::ApiError;

/// A recovery method (`--methods`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// No checkpoints and no fault: the reference.
    None,
    /// Inspector-driven checkpoints (`kind: auto`), restore of the newest on a fault.
    Crab,
    /// A full checkpoint (files + processes) every turn.
    Full,
    /// A filesystem snapshot every turn, no process image ("chat+fs").
    Fs,
    /// Conversation only: on a fault the sandbox is re-created from the image and the agent
    /// continues.
    Chat,
    /// On a fault, start the trajectory over in a fresh sandbox.
    Restart,
}

/// What a method does after a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Nothing (the reference never faults).
    Nothing,
    /// Restore the newest checkpoint and roll the conversation back to it.
    RestoreNewest,
    /// Re-create the sandbox, keep the conversation.
    Recreate,
    /// Re-create the sandbox and start the conversation over.
    StartOver,
}

impl Method {
    /// Every method, in report order.
    pub const ALL: [Method; 6] =
        [Method::None, Method::Crab, Method::Full, Method::Fs, Method::Chat, Method::Restart];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Method::None => "none",
            Method::Crab => "crab",
            Method::Full => "full",
            Method::Fs => "fs",
            Method::Chat => "chat",
            Method::Restart => "restart",
        }
    }

    /// The checkpoint kind it requests at every turn boundary, if any.
    pub fn checkpoint_kind(self) -> Option<&'static str> {
        match self {
            Method::Crab => Some("auto"),
            Method::Full => Some("full"),
            Method::Fs => Some("fs"),
            Method::None | Method::Chat | Method::Restart => None,
        }
    }

    /// The checkpoint policy its sandbox gets when the replay goes through the proxy: the
    /// proxy then takes `checkpoint_kind` at every turn (`none` for the methods that take none).
    pub fn checkpoint_policy(self) -> &'static str {
        self.checkpoint_kind().unwrap_or("none")
    }

    /// What it does after a fault.
    pub fn recovery(self) -> Recovery {
        match self {
            Method::None => Recovery::Nothing,
            Method::Crab | Method::Full | Method::Fs => Recovery::RestoreNewest,
            Method::Chat => Recovery::Recreate,
            Method::Restart => Recovery::StartOver,
        }
    }

    /// Parse a comma-separated list (`all` for every method). `none` is always included: it is
    /// the reference the others are compared with.
    pub fn parse_list(s: &str) -> Result<Vec<Method>, ApiError> {
        let mut out = vec![Method::None];
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part == "all" {
                out.extend(Method::ALL);
            } else {
                out.push(part.parse()?);
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Method {
    type Err = ApiError;
    fn from_str(s: &str) -> Result<Self, ApiError> {
        Method::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            ApiError::invalid(
                format!("unknown replay method {s:?}"),
                "use none, crab, full, fs, chat, restart (comma-separated) or all",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists() {
        assert_eq!(Method::parse_list("all").unwrap(), Method::ALL.to_vec());
        assert_eq!(
            Method::parse_list("full, crab").unwrap(),
            vec![Method::None, Method::Crab, Method::Full]
        );
        assert!(Method::parse_list("crab,bogus").is_err());
        assert_eq!(Method::Fs.checkpoint_kind(), Some("fs"));
        assert_eq!(Method::Chat.recovery(), Recovery::Recreate);
        assert_eq!(Method::Crab.checkpoint_policy(), "auto");
        assert_eq!(Method::None.checkpoint_policy(), "none");
        assert_eq!(Method::Restart.checkpoint_policy(), "none");
    }
}
