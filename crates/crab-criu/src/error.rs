//! Errors of the CRIU driver, and reading the tail of a CRIU log for them.
//!
//! Every failure of an operation names the operation, what failed (the syscall, the path) and,
//! once CRIU has been started, the path of that operation's CRIU log together with its last
//! `Error (` lines, so that a message alone is enough to start debugging.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Result of this crate.
pub type Result<T, E = CriuError> = std::result::Result<T, E>;

/// The last relevant lines of a CRIU log, for error messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogTail(pub Vec<String>);

impl fmt::Display for LogTail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(" (no error lines in the log)");
        }
        for line in &self.0 {
            write!(f, "\n  {line}")?;
        }
        Ok(())
    }
}

/// How many `Error (` lines an error message carries.
const TAIL_LINES: usize = 8;

impl LogTail {
    /// The most specific error: the last error line that is neither noise (see `is_noise`)
    /// nor CRIU's generic "Dumping FAILED." / "Restoring FAILED." summary, without its
    /// timestamp prefix. `None` when the tail holds no such line (e.g. CRIU was killed).
    pub fn headline(&self) -> Option<&str> {
        self.0.iter().rev().find(|l| is_error(l) && !is_noise(l) && !l.contains("FAILED.")).map(
            |l| {
                let l = l.trim_start();
                match l.strip_prefix('(').and_then(|r| r.split_once(") ")) {
                    Some((_, rest)) => rest.trim_start(),
                    None => l,
                }
            },
        )
    }

    /// Read the last `Error (` lines of the log at `path` (or, when it has none, its last few
    /// lines), leaving out lines CRIU logs but ignores (see `is_noise`). A missing or
    /// unreadable log gives an empty tail.
    pub fn read(path: &Path) -> LogTail {
        let Ok(file) = std::fs::File::open(path) else {
            return LogTail::default();
        };
        let mut errors = std::collections::VecDeque::new();
        let mut last = std::collections::VecDeque::new();
        for line in BufReader::new(file).lines() {
            let Ok(line) = line else { break };
            if is_error(&line) && !is_noise(&line) {
                if errors.len() == TAIL_LINES {
                    errors.pop_front();
                }
                errors.push_back(line.clone());
            }
            if is_noise(&line) {
                continue;
            }
            if last.len() == 4 {
                last.pop_front();
            }
            last.push_back(line);
        }
        LogTail(if errors.is_empty() { last.into() } else { errors.into() })
    }
}

fn is_error(line: &str) -> bool {
    line.contains("Error (") || line.contains("Error:")
}

/// Error lines CRIU 4.2 logs on every run here and then ignores: it cannot raise its own
/// `RLIMIT_NOFILE` in a container, it probes for legacy iptables tools before using nftables,
/// after a failure its nftables unlock complains about rules it never added, and on every
/// restore of a network namespace `ip addr restore` prints the kernel's "address already
/// assigned" for the loopback addresses that bringing `lo` up created (iproute2 treats
/// `EEXIST` as success there, and so does CRIU).
pub fn is_noise(line: &str) -> bool {
    const NOISE: [&str; 6] = [
        "RLIMIT_NOFILE",
        "iptables-",
        "ip6tables-",
        "-legacy-",
        "Could not process rule",
        "ddress already assigned",
    ];
    NOISE.iter().any(|n| line.contains(n))
}

/// What can go wrong when driving CRIU.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    /// No usable CRIU binary.
    #[error(
        "CRIU binary not found at {} ({source}){}",
        path.display(),
        if *from_env { " (set by CRAB_CRIU)" } else { "" }
    )]
    NotFound {
        /// Where it was looked for.
        path: PathBuf,
        /// Whether the path came from `CRAB_CRIU`.
        from_env: bool,
        /// Why it is unusable.
        source: std::io::Error,
    },

    /// A system call or file operation failed before or around CRIU's own work.
    #[error("CRIU {op}: {syscall} {} failed: {source}{}", path.display(), log_suffix(log))]
    Io {
        /// The operation (`dump`, `restore`, ...).
        op: &'static str,
        /// The failing call (`open`, `socketpair`, `send`, ...).
        syscall: &'static str,
        /// The path it concerned (the CRIU binary for process calls).
        path: PathBuf,
        /// The operation's CRIU log, when CRIU had been told about it.
        log: Option<PathBuf>,
        /// The error.
        source: std::io::Error,
    },

    /// CRIU reported failure (or died) during an operation.
    #[error(
        "CRIU {op} failed{}{}; log: {}; last log lines:{tail}{}",
        errno.map(|e| format!(" (errno {e}: {})", std::io::Error::from_raw_os_error(e))).unwrap_or_default(),
        errmsg.as_deref().map(|m| format!(": {m}")).unwrap_or_default(),
        log.display(),
        if stderr.is_empty() { String::new() } else { format!("\n  stderr: {stderr}") }
    )]
    Failed {
        /// The operation.
        op: &'static str,
        /// The operation's CRIU log.
        log: PathBuf,
        /// `cr_errno` of the response.
        errno: Option<i32>,
        /// `cr_errmsg` of the response, or how CRIU died.
        errmsg: Option<String>,
        /// Last `Error (` lines of the log.
        tail: LogTail,
        /// What CRIU printed on stderr (before its log was open), trimmed.
        stderr: String,
    },

    /// The caller's notify hook refused to continue at a phase; CRIU aborted.
    #[error(
        "CRIU {op}: the hook for phase {phase:?} failed: {reason}; log: {}",
        log.display()
    )]
    Hook {
        /// The operation.
        op: &'static str,
        /// The notify action name (`post-dump`, `setup-namespaces`, ...).
        phase: String,
        /// The hook's error, rendered.
        reason: String,
        /// The operation's CRIU log.
        log: PathBuf,
    },

    /// CRIU did not answer in time; it was killed.
    #[error("CRIU {op} gave no answer within {secs} s and was killed; log: {}", log.display())]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The timeout in seconds.
        secs: u64,
        /// The operation's CRIU log.
        log: PathBuf,
    },

    /// CRIU's answer did not follow the protocol.
    #[error("CRIU {op}: protocol error: {detail}; log: {}", log.display())]
    Protocol {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
        /// The operation's CRIU log.
        log: PathBuf,
    },

    /// The options were invalid.
    #[error("CRIU {op}: invalid options: {detail}")]
    InvalidOpts {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
}

fn log_suffix(log: &Option<PathBuf>) -> String {
    log.as_ref().map(|l| format!("; log: {}", l.display())).unwrap_or_default()
}

impl CriuError {
    /// The CRIU log file of the failed operation, when there is one.
    pub fn log_path(&self) -> Option<&Path> {
        match self {
            CriuError::NotFound { .. } | CriuError::InvalidOpts { .. } => None,
            CriuError::Io { log, .. } => log.as_deref(),
            CriuError::Failed { log, .. }
            | CriuError::Hook { log, .. }
            | CriuError::Timeout { log, .. }
            | CriuError::Protocol { log, .. } => Some(log),
        }
    }

    /// What the operator should do about it.
    pub fn hint(&self) -> String {
        match self {
            CriuError::NotFound { .. } => {
                "install CRIU 4.2.1 with `make setup` (or `scripts/install-criu.sh`), or point \
                 CRAB_CRIU at a criu binary"
                    .into()
            }
            CriuError::Failed { log, .. }
            | CriuError::Timeout { log, .. }
            | CriuError::Protocol { log, .. }
            | CriuError::Hook { log, .. } => {
                format!("read the CRIU log {}", log.display())
            }
            CriuError::Io { .. } | CriuError::InvalidOpts { .. } => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_skips_noise_and_headline_is_specific() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        std::fs::write(
            &log,
            "(00.001) Version: 4.2.1\n\
             (00.002) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n\
             Error (criu/util.c:642): execvp(\"iptables-save\", ...) failed: No such file or directory\n\
             Error: ipv4: Address already assigned.\n\
             Error: ipv6: address already assigned.\n\
             (00.003) Error (criu/sk-inet.c:185): inet: In-flight connection (l) for 52875\n\
             (00.004) Error (criu/cr-dump.c:1975): Dumping FAILED.\n",
        )
        .unwrap();
        let tail = LogTail::read(&log);
        assert_eq!(tail.0.len(), 2, "{tail:?}");
        assert_eq!(
            tail.headline(),
            Some("Error (criu/sk-inet.c:185): inet: In-flight connection (l) for 52875")
        );
        assert_eq!(LogTail::read(&dir.path().join("missing")), LogTail::default());
        // A log of only noise (CRIU killed early) has neither tail nor headline.
        std::fs::write(
            &log,
            "Error: ipv6: address already assigned.\n     1: Error (criu/util.c:1723): ip6tables-restore -V failed\n",
        )
        .unwrap();
        let tail = LogTail::read(&log);
        assert_eq!(tail, LogTail::default());
        assert_eq!(tail.headline(), None);
    }
}
