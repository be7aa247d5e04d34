//! A sandbox's life as the host owns it: the one lifecycle state every front door reads
//! ([`Life`], persisted in the sandbox record), what a caller sees of it ([`Status`]: the
//! recorded life and whether the sandbox's init is alive), the transition checks in one place
//! (youki's `can_*` style: each answers `conflict` naming the state and the way out), and the
//! deadline a sandbox may carry ([`Deadline`]: at an absolute time, pause or kill it).

use serde::{Deserialize, Serialize};

use crate::api::SandboxState;
use crate::{ApiError, ErrorCode};

/// The lifecycle state the host records for a sandbox (`sandbox.json`'s `life`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Life {
    /// Started (or restored, resumed, forked) and not stopped since. Its init may still have
    /// died on its own: [`Status`] says `dead` then.
    #[default]
    Running,
    /// Stopped by `crab sandbox stop` / `docker stop`/`kill`: no process; files, record and
    /// points kept. `start` or `resume` brings it back from its newest point.
    Stopped,
    /// Paused: a `full` point of everything it held, then every process stopped (memory
    /// freed). `resume` restores `point` in place.
    Paused {
        /// The pause point.
        point: String,
    },
    /// Parked by the host while its agent waits (`crab sandbox park`): every process stopped
    /// (memory freed) after `point`, a restore point that holds them. Any call that needs it
    /// running — an exec, a file operation, a checkpoint, the LLM answer it waits for — wakes
    /// it first (restores `point` in place), so callers see it parked only in listings.
    Parked {
        /// The point it wakes from.
        point: String,
    },
    /// Kept only for its labelled restore points (E2B's kill of a sandbox whose snapshots live
    /// on): no process, hidden from E2B; deleting its last labelled point removes it.
    Retired {
        /// Why it is kept.
        why: String,
    },
}

/// What a sandbox is, as callers see it: its recorded [`Life`] and whether its init lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status<'a> {
    /// The recorded state.
    pub life: &'a Life,
    /// Its init is alive.
    pub alive: bool,
}

impl Status<'_> {
    /// The state shown to callers: a live init is `running` whatever the record says (a
    /// restore through another door brought it back); a recorded `running` whose init is gone
    /// (killed from outside, the host rebooted) is `dead`.
    pub fn state(&self) -> SandboxState {
        if self.alive {
            return SandboxState::Running;
        }
        match self.life {
            Life::Running => SandboxState::Dead,
            Life::Stopped => SandboxState::Stopped,
            Life::Paused { .. } => SandboxState::Paused,
            Life::Parked { .. } => SandboxState::Parked,
            Life::Retired { .. } => SandboxState::Retired,
        }
    }

    fn refuse(&self, name: &str, what: &str, hint: &str) -> ApiError {
        ApiError::new(
            ErrorCode::Conflict,
            format!("cannot {what} sandbox {name}: it is {}", self.state().as_str()),
            hint,
        )
    }

    /// Pause: only a running sandbox.
    pub fn can_pause(&self, name: &str) -> Result<(), ApiError> {
        match self.state() {
            // A parked one's point holds everything: it becomes its pause point.
            SandboxState::Running | SandboxState::Parked => Ok(()),
            SandboxState::Paused => Err(self.refuse(
                name,
                "pause",
                &format!("it is already paused; `crab sandbox resume {name}` brings it back"),
            )),
            _ => Err(self.refuse(
                name,
                "pause",
                &format!("only a running sandbox pauses; `crab sandbox resume {name}` starts it"),
            )),
        }
    }

    /// Resume: a paused, stopped or dead sandbox (a retired one is kept for its points: a
    /// fork of one of them is the way back). A running one is refused unless `ensure` (make it
    /// run whatever it is: E2B's `connect`), which answers `false` (nothing to do).
    pub fn can_resume(&self, name: &str, ensure: bool) -> Result<bool, ApiError> {
        match self.state() {
            SandboxState::Running if ensure => Ok(false),
            SandboxState::Running => Err(self.refuse(
                name,
                "resume",
                "it runs already; nothing to resume",
            )),
            SandboxState::Retired => Err(self.refuse(
                name,
                "resume",
                &format!(
                    "it is kept only for its labelled restore points; fork one of them (`crab fork {name} --checkpoint ID`) or remove it"
                ),
            )),
            SandboxState::Paused
            | SandboxState::Parked
            | SandboxState::Stopped
            | SandboxState::Dead => Ok(true),
        }
    }

    /// Run a command, take a checkpoint, fork it as it is now: its processes must run.
    pub fn can_exec(&self, name: &str, what: &str) -> Result<(), ApiError> {
        match self.state() {
            SandboxState::Running => Ok(()),
            SandboxState::Paused => Err(self.refuse(
                name,
                what,
                &format!("resume it first: `crab sandbox resume {name}`"),
            )),
            SandboxState::Parked => Err(self.refuse(
                name,
                what,
                &format!("wake it first: `crab sandbox wake {name}`"),
            )),
            SandboxState::Retired => Err(self.refuse(
                name,
                what,
                "it is kept only for its labelled restore points; fork one of them",
            )),
            SandboxState::Stopped | SandboxState::Dead => Err(self.refuse(
                name,
                what,
                &format!("start it from its newest restore point: `crab sandbox resume {name}` (or remove it)"),
            )),
        }
    }

    /// Retire: anything not retired yet (a retired one answers `false`: nothing to do).
    pub fn can_retire(&self) -> bool {
        !matches!(self.life, Life::Retired { .. }) || self.alive
    }
}

/// What happens to a running sandbox when its deadline passes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDeadline {
    /// Kill it (`Action::Kill`: retired when labelled points must outlive it, else removed).
    #[default]
    Kill,
    /// Pause it (a failed pause kills it).
    Pause,
}

impl OnDeadline {
    /// The accepted values, for messages.
    pub const EXPECTED: &'static str = "pause or kill";
}

impl std::str::FromStr for OnDeadline {
    type Err = ApiError;
    fn from_str(s: &str) -> Result<Self, ApiError> {
        match s {
            "kill" => Ok(OnDeadline::Kill),
            "pause" => Ok(OnDeadline::Pause),
            _ => Err(ApiError::invalid(
                format!("on_timeout {s:?} is not an action"),
                format!("use {}", Self::EXPECTED),
            )),
        }
    }
}

impl std::fmt::Display for OnDeadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnDeadline::Kill => "kill",
            OnDeadline::Pause => "pause",
        })
    }
}

/// A running sandbox's deadline as callers see it: at `at_ms` (ms since the epoch; absolute,
/// so a daemon restart does not extend it) the host's one watchdog pauses or kills it. It
/// fires once: firing clears the time (the record's `deadline_ms`); what it does (`on`, the
/// record's `on_deadline`) is the sandbox's and stays for its next deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deadline {
    /// When, in ms since the epoch.
    pub at_ms: u64,
    /// What then.
    #[serde(default)]
    pub on: OnDeadline,
}

/// The longest timeout a sandbox may be given (one day, as E2B's).
pub const MAX_TIMEOUT_S: u64 = 86_400;

impl Deadline {
    /// `timeout_s` seconds from `now_ms`; refused outside 1..=[`MAX_TIMEOUT_S`].
    pub fn after(now_ms: u64, timeout_s: u64, on: OnDeadline) -> Result<Deadline, ApiError> {
        if timeout_s == 0 || timeout_s > MAX_TIMEOUT_S {
            return Err(ApiError::invalid(
                format!("timeout must be 1..={MAX_TIMEOUT_S} seconds, got {timeout_s}"),
                "give a timeout in seconds within one day, or none",
            ));
        }
        Ok(Deadline { at_ms: now_ms + timeout_s * 1000, on })
    }
}

/// A change of deadline (`crab sandbox update --timeout`, E2B's `setTimeout` and `connect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeoutSet {
    /// Seconds from now; `0` clears the deadline.
    pub timeout_s: u64,
    /// What it does; `None` keeps the current deadline's action (else `kill`).
    pub on: Option<OnDeadline>,
    /// Never bring a later current deadline closer (E2B's `connect`).
    pub extend_only: bool,
}

impl TimeoutSet {
    /// The deadline (ms since the epoch) after this change of `current`, at `now_ms`.
    pub fn apply(&self, current: Option<u64>, now_ms: u64) -> Result<Option<u64>, ApiError> {
        if self.timeout_s == 0 {
            return Ok(None);
        }
        let new = Deadline::after(now_ms, self.timeout_s, OnDeadline::Kill)?.at_ms;
        Ok(Some(match current {
            Some(c) if self.extend_only && c > new => c,
            _ => new,
        }))
    }
}

/// Most bytes a sandbox's labels and environment may hold together (they live in its record,
/// which every lifecycle step rewrites).
pub const MAX_META_BYTES: usize = 64 << 10;

/// Check labels and environment for a record: keys non-empty, no NUL anywhere, environment
/// names without `=`, at most [`MAX_META_BYTES`] in all.
pub fn check_meta(
    labels: &std::collections::BTreeMap<String, String>,
    env: &std::collections::BTreeMap<String, String>,
) -> Result<(), ApiError> {
    let mut total = 0;
    for (what, m) in [("label", labels), ("environment variable", env)] {
        for (k, v) in m {
            total += k.len() + v.len();
            if k.is_empty() || k.contains('\0') || v.contains('\0') {
                return Err(ApiError::invalid(
                    format!("invalid {what} {k:?}: names are non-empty and nothing holds NUL"),
                    "fix the name or value",
                ));
            }
            if what != "label" && k.contains('=') {
                return Err(ApiError::invalid(
                    format!("invalid environment variable name {k:?}: it holds '='"),
                    "name it without '='",
                ));
            }
        }
    }
    if total > MAX_META_BYTES {
        return Err(ApiError::invalid(
            format!("labels and environment hold {total} bytes; at most {MAX_META_BYTES} are kept"),
            "keep large data in the sandbox's files",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(life: &Life, alive: bool) -> SandboxState {
        Status { life, alive }.state()
    }

    #[test]
    fn shown_state() {
        let paused = Life::Paused { point: "p".into() };
        let retired = Life::Retired { why: "w".into() };
        assert_eq!(st(&Life::Running, true), SandboxState::Running);
        assert_eq!(st(&Life::Running, false), SandboxState::Dead);
        assert_eq!(st(&Life::Stopped, false), SandboxState::Stopped);
        assert_eq!(st(&paused, false), SandboxState::Paused);
        assert_eq!(st(&retired, false), SandboxState::Retired);
        // A live init wins over the record.
        assert_eq!(st(&paused, true), SandboxState::Running);
    }

    #[test]
    fn transitions() {
        let paused = Life::Paused { point: "p".into() };
        let retired = Life::Retired { why: "w".into() };
        let running = Status { life: &Life::Running, alive: true };
        let dead = Status { life: &Life::Running, alive: false };
        let stopped = Status { life: &Life::Stopped, alive: false };
        let paused = Status { life: &paused, alive: false };
        let retired = Status { life: &retired, alive: false };

        assert!(running.can_pause("a").is_ok());
        for s in [dead, stopped, paused, retired] {
            let e = s.can_pause("a").unwrap_err();
            assert_eq!(e.code, ErrorCode::Conflict, "{s:?}");
        }
        assert!(paused.can_pause("a").unwrap_err().hint.contains("already paused"));

        assert!(!running.can_resume("a", true).unwrap());
        assert_eq!(running.can_resume("a", false).unwrap_err().code, ErrorCode::Conflict);
        for s in [dead, stopped, paused] {
            assert!(s.can_resume("a", false).unwrap(), "{s:?}");
        }
        assert_eq!(retired.can_resume("a", true).unwrap_err().code, ErrorCode::Conflict);

        assert!(running.can_exec("a", "exec in").is_ok());
        assert_eq!(paused.can_exec("a", "exec in").unwrap_err().code, ErrorCode::Conflict);
        assert_eq!(dead.can_exec("a", "exec in").unwrap_err().code, ErrorCode::Conflict);

        assert!(running.can_retire() && stopped.can_retire() && paused.can_retire());
        assert!(!retired.can_retire());
    }

    #[test]
    fn record_format() {
        let j = serde_json::to_value(Life::Paused { point: "p1".into() }).unwrap();
        assert_eq!(j, serde_json::json!({"state": "paused", "point": "p1"}));
        let l: Life = serde_json::from_value(serde_json::json!({"state": "running"})).unwrap();
        assert_eq!(l, Life::Running);
        let d: Deadline = serde_json::from_value(serde_json::json!({"at_ms": 5})).unwrap();
        assert_eq!(d.on, OnDeadline::Kill);
        assert!(Deadline::after(0, 0, OnDeadline::Kill).is_err());
        assert!(Deadline::after(0, MAX_TIMEOUT_S + 1, OnDeadline::Kill).is_err());
        assert_eq!(Deadline::after(1, 2, OnDeadline::Pause).unwrap().at_ms, 2001);
        assert_eq!("pause".parse::<OnDeadline>().unwrap(), OnDeadline::Pause);
        assert!("stop".parse::<OnDeadline>().is_err());
    }

    #[test]
    fn timeout_changes() {
        let cur = Some(100_000);
        let set = |t, extend_only| TimeoutSet { timeout_s: t, on: None, extend_only };
        assert_eq!(set(0, false).apply(cur, 0).unwrap(), None);
        // Shorter, not extend-only: brought closer.
        assert_eq!(set(10, false).apply(cur, 0).unwrap(), Some(10_000));
        // Extend-only keeps the later deadline.
        assert_eq!(set(10, true).apply(cur, 0).unwrap(), Some(100_000));
        assert_eq!(set(200, true).apply(cur, 0).unwrap(), Some(200_000));
        assert_eq!(set(5, true).apply(None, 0).unwrap(), Some(5_000));
        assert!(set(MAX_TIMEOUT_S + 1, false).apply(None, 0).is_err());
    }

    #[test]
    fn meta_checks() {
        use std::collections::BTreeMap;
        let m = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        let none = BTreeMap::new();
        assert!(check_meta(&m("a=b", "x"), &none).is_ok());
        assert!(check_meta(&none, &m("A", "x=y")).is_ok());
        assert!(check_meta(&none, &m("A=B", "x")).is_err());
        assert!(check_meta(&m("", "x"), &none).is_err());
        assert!(check_meta(&m("a", "x\0"), &none).is_err());
        assert!(check_meta(&m("a", &"x".repeat(MAX_META_BYTES)), &none).is_err());
    }
}
