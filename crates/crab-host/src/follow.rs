//! Standbys: `crab remote follow SB…` (and `crab daemon --follow SB`, `--follow-all`) keep
//! the newest durable point of named sandboxes — or of every sandbox in the remote store that
//! does not run here — materialized on this host as it is exported elsewhere, so that a
//! failover (`crab sandbox create --from-remote SB`) finds it local and is a local fork.
//!
//! The follow set is kept in `<state>/remote-follow.json` (format 1, `docs/format.md`), so a
//! restarted standby goes on following. Every [`POLL`] (or at once when the set changes) the
//! follower asks the remote for each followed sandbox's newest point (one listing, one record
//! read) and, when it is not the one held here, materializes it exactly as a restore would
//! (`crab_remote::local::materialize`: checked, admitted, only what differs from the local
//! image downloaded), flushes the pool in the background (the copy is then complete after a
//! host crash too) and discards the older copies of that sandbox. A point whose metadata this
//! host would refuse to any caller (a privileged profile, another user-namespace range) is
//! reported, not fetched. Nothing here trusts the remote more than a restore does: the
//! failover checks the copy again (its admission, its images against the default profile,
//! their SHA-256s beside the fork).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crab_common::api::{Limits, NetMode};
use crab_common::sync::lock;

use crate::{Host, HostError};

/// How often the follower asks the remote for new points.
pub const POLL: Duration = Duration::from_secs(1);
/// Format of `remote-follow.json`.
pub const FORMAT: u32 = 1;
const FILE: &str = "remote-follow.json";

/// The persisted follow set.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FollowSet {
    /// [`FORMAT`].
    pub format: u32,
    /// Follow every sandbox of the remote store that has no sandbox of that name here.
    #[serde(default)]
    pub all: bool,
    /// Followed sandboxes.
    #[serde(default)]
    pub sandboxes: BTreeSet<String>,
}

/// A change to the follow set (`POST /v1/remote/follow`); an empty one only reports.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct FollowRequest {
    /// Sandboxes to follow (or, with `stop`, to stop following).
    #[serde(default)]
    pub sandboxes: Vec<String>,
    /// Follow (true) or stop following (false) every sandbox of the remote.
    #[serde(default)]
    pub all: Option<bool>,
    /// Stop following `sandboxes`.
    #[serde(default)]
    pub stop: bool,
}

/// What the follower holds for one sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FollowStatus {
    /// The sandbox.
    pub sandbox: String,
    /// The point held here, ready for a failover.
    pub point: Option<String>,
    /// The newest point the remote had at the last look.
    pub remote_point: Option<String>,
    /// When the held point was materialized (ms since the epoch).
    pub materialized_at_ms: Option<u64>,
    /// How long its materialization took, ms.
    pub materialize_ms: Option<f64>,
    /// Whether it downloaded anything (false: every part was already here).
    pub downloaded: bool,
    /// The last failure (remote unreachable, refused point), if the last look failed.
    pub error: Option<String>,
}

/// Answer of `crab remote follow`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FollowReport {
    /// Every sandbox of the remote is followed.
    pub all: bool,
    /// Per followed sandbox (and, with `all`, each one seen in the remote).
    pub sandboxes: Vec<FollowStatus>,
}

/// The follower of a host with a remote store.
#[derive(Debug)]
pub struct Follower {
    path: PathBuf,
    set: Mutex<FollowSet>,
    status: Mutex<BTreeMap<String, FollowStatus>>,
    wake: tokio::sync::Notify,
}

impl Follower {
    /// The follower of state directory `state`, its set loaded (a missing file: nothing
    /// followed), plus `extra` sandboxes and `all` from the daemon's flags (saved).
    pub fn open(
        state: &crab_common::paths::StateDir,
        extra: &[String],
        all: bool,
    ) -> Result<Follower, HostError> {
        let path = state.root().join(FILE);
        let mut set = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice::<FollowSet>(&b).map_err(|e| {
                HostError::invalid(
                    format!("{} is not a follow set: {e}", path.display()),
                    "fix or remove it (it lists the sandboxes this host follows)",
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => FollowSet::default(),
            Err(e) => return Err(HostError::internal(format!("reading {}: {e}", path.display()))),
        };
        if set.format > FORMAT {
            return Err(HostError::invalid(
                format!(
                    "{} is of format {}, newer than this crab's {FORMAT}",
                    path.display(),
                    set.format
                ),
                "run the newer crab, or remove the file",
            ));
        }
        set.format = FORMAT;
        for s in extra {
            crab_common::names::validate("sandbox", s)?;
            set.sandboxes.insert(s.clone());
        }
        set.all |= all;
        let f = Follower {
            path,
            set: Mutex::new(set),
            status: Mutex::new(BTreeMap::new()),
            wake: tokio::sync::Notify::new(),
        };
        if !extra.is_empty() || all {
            f.save()?;
        }
        Ok(f)
    }

    fn save(&self) -> Result<(), HostError> {
        let set = lock(&self.set).clone();
        let bytes = serde_json::to_vec_pretty(&set)
            .map_err(|e| HostError::internal(format!("encoding the follow set: {e}")))?;
        crab_common::fsutil::write_atomic(&self.path, &bytes)
            .map_err(|e| HostError::internal(format!("writing {}: {e}", self.path.display())))
    }

    /// Apply `req` (saved before it answers) and report.
    pub fn change(&self, req: &FollowRequest) -> Result<FollowReport, HostError> {
        for s in &req.sandboxes {
            crab_common::names::validate("sandbox", s)?;
        }
        let changed = !req.sandboxes.is_empty() || req.all.is_some();
        if changed {
            let old = lock(&self.set).clone();
            {
                let mut set = lock(&self.set);
                for s in &req.sandboxes {
                    if req.stop {
                        set.sandboxes.remove(s);
                    } else {
                        set.sandboxes.insert(s.clone());
                    }
                }
                if let Some(a) = req.all {
                    set.all = a;
                }
            }
            if let Err(e) = self.save() {
                *lock(&self.set) = old;
                return Err(e);
            }
            if req.stop {
                let mut st = lock(&self.status);
                for s in &req.sandboxes {
                    st.remove(s);
                }
            }
            self.wake.notify_one();
        }
        Ok(self.report())
    }

    /// The follow set and what is held.
    pub fn report(&self) -> FollowReport {
        let set = lock(&self.set).clone();
        let status = lock(&self.status).clone();
        let mut out: Vec<FollowStatus> = Vec::new();
        for s in &set.sandboxes {
            out.push(
                status
                    .get(s)
                    .cloned()
                    .unwrap_or_else(|| FollowStatus { sandbox: s.clone(), ..Default::default() }),
            );
        }
        if set.all {
            for (s, st) in &status {
                if !set.sandboxes.contains(s) {
                    out.push(st.clone());
                }
            }
        }
        FollowReport { all: set.all, sandboxes: out }
    }

    fn set_status(&self, sandbox: &str, f: impl FnOnce(&mut FollowStatus)) {
        let mut st = lock(&self.status);
        let e = st
            .entry(sandbox.to_string())
            .or_insert_with(|| FollowStatus { sandbox: sandbox.to_string(), ..Default::default() });
        f(e);
    }

    /// The follower's loop: runs until the host goes away.
    pub async fn run(self: Arc<Self>, host: Weak<Host>) {
        // What a restart left held: the newest copy in each followed sandbox's store.
        if let Some(h) = host.upgrade() {
            let names = lock(&self.set).sandboxes.clone();
            for sb in names {
                if let Some(m) =
                    h.checkpointer().remote_store(&sb).ok().and_then(|s| s.newest().ok())
                {
                    self.set_status(&sb, |s| s.point = Some(m.id.to_string()));
                }
            }
        }
        loop {
            let Some(h) = host.upgrade() else { return };
            self.pass(&h).await;
            drop(h);
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = self.wake.notified() => {}
            }
        }
    }

    /// One look at every followed sandbox.
    async fn pass(&self, h: &Arc<Host>) {
        let Some(t) = h.remote() else { return };
        let set = lock(&self.set).clone();
        let mut targets = set.sandboxes.clone();
        if set.all {
            match t.repo.point_sandboxes().await {
                Ok(all) => {
                    // Not the sandboxes this host runs (its own exports).
                    targets.extend(all.into_iter().filter(|s| h.runtime().record(s).is_err()))
                }
                Err(e) => tracing::warn!(error = %e, "follow: cannot list the remote's sandboxes"),
            }
        }
        for sb in targets {
            if let Err(e) = self.follow_one(h, &t.repo, &sb).await {
                tracing::warn!(sandbox = %sb, error = %e.0.message, "follow: cannot hold the newest point");
                self.set_status(&sb, |s| s.error = Some(e.0.message.clone()));
            }
        }
    }

    async fn follow_one(
        &self,
        h: &Arc<Host>,
        repo: &Arc<crab_remote::Repo>,
        sb: &str,
    ) -> Result<(), HostError> {
        let rec = match repo.load_point(sb, None).await {
            Ok(r) => r,
            Err(crab_remote::RemoteError::NoPoint { .. }) => {
                self.set_status(sb, |s| {
                    s.remote_point = None;
                    s.error = None;
                });
                return Ok(());
            }
            Err(e) => return Err(crate::remote::remote_error(e)),
        };
        let held = lock(&self.status).get(sb).and_then(|s| s.point.clone());
        self.set_status(sb, |s| s.remote_point = Some(rec.point.clone()));
        if held.as_deref() == Some(rec.point.as_str()) {
            self.set_status(sb, |s| s.error = None);
            return Ok(());
        }
        // An image from a registry the point names is pulled now, not at the failover.
        h.pull_point_image(&rec, &crab_common::NoProgress).await;
        // The most a caller of this host could grant a remote point (the failover checks the
        // copy against its own grant again).
        let grant = crate::remote::Grant {
            net: NetMode::Nat,
            limits: Limits::default(),
            userns: h.runtime().userns(),
        };
        let store = h.checkpointer().remote_store(sb)?;
        let t = std::time::Instant::now();
        let mat = h.materialize_remote(repo, &rec, &store, false, &grant).await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let (st, point) = (store.clone(), rec.point.clone());
        crate::host::blocking(move || {
            crab_remote::local::flush(&st, &point).map_err(crate::remote::remote_error)?;
            // Older copies go (their parts stay while the newest shares them).
            for m in st.list().unwrap_or_default() {
                if m.id.to_string() != point {
                    crab_remote::local::discard(&st, &m);
                }
            }
            Ok(())
        })
        .await?;
        tracing::info!(sandbox = sb, point = %rec.point, ms, downloaded = mat.fetched, "follow: newest point held");
        self.set_status(sb, |s| {
            s.point = Some(rec.point.clone());
            s.materialized_at_ms = Some(crab_common::clock::now_ms());
            s.materialize_ms = Some(ms);
            s.downloaded = mat.fetched;
            s.error = None;
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn follower(dir: &std::path::Path) -> Follower {
        let state = crab_common::paths::StateDir::new(dir);
        Follower::open(&state, &[], false).expect("open")
    }

    #[test]
    fn the_follow_set_is_saved_and_reloaded() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = follower(d.path());
        let r = f
            .change(&FollowRequest {
                sandboxes: vec!["a".into(), "b".into()],
                ..Default::default()
            })
            .expect("follow");
        assert_eq!(r.sandboxes.iter().map(|s| s.sandbox.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        f.change(&FollowRequest { sandboxes: vec!["a".into()], stop: true, ..Default::default() })
            .expect("stop");
        f.change(&FollowRequest { all: Some(true), ..Default::default() }).expect("all");
        let again = follower(d.path());
        let set = lock(&again.set).clone();
        assert!(set.all);
        assert_eq!(set.sandboxes.into_iter().collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn bad_names_and_files_are_refused() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = follower(d.path());
        let e = f
            .change(&FollowRequest { sandboxes: vec!["../x".into()], ..Default::default() })
            .expect_err("a bad name was followed");
        assert!(e.0.message.contains("../x"), "{}", e.0.message);
        std::fs::write(d.path().join(FILE), b"{not json").expect("write");
        let state = crab_common::paths::StateDir::new(d.path());
        let e = Follower::open(&state, &[], false).expect_err("a broken file was read");
        assert!(e.0.message.contains("not a follow set"), "{}", e.0.message);
    }
}
