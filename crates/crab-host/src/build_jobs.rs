//! Background Dockerfile builds ([`Action::BuildStart`], [`Action::BuildStatus`]): a front door
//! that cannot hold a request open for a whole build (E2B's template builds, which the SDK
//! polls) starts one under an id of its choosing and reads its state and log from an offset.
//! The build is the same as [`Action::BuildImage`] with a `dockerfile` (`build.rs`); its step
//! starts and every line a RUN prints are its log, kept in a bounded ring in memory
//! ([`MAX_LINES`]). Each build's state is also a small file, `<state>/builds/<id>.json`
//! (docs/format.md), so a daemon restart answers a build that was running as failed — "the
//! daemon restarted during the build" — rather than unknown, and a finished one's outcome
//! (without its log) stays readable after the job left memory ([`KEEP_FINISHED`]).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crab_common::api::{BuildJobState, BuildJobStatus, BuildLogLine, ImageBuildRequest};
use crab_common::sync::lock;
use crab_common::{ApiError, ErrorCode, Progress};
use serde::{Deserialize, Serialize};

use crate::{Host, HostError, Outcome};

/// Log lines kept per build (older ones are dropped; offsets keep counting).
pub const MAX_LINES: usize = 10_000;
/// Finished builds kept in memory with their log (older ones answer from their file only).
pub const KEEP_FINISHED: usize = 64;
/// Most lines one status call answers.
pub const MAX_LINES_PER_CALL: usize = 1_000;
/// Build records kept on disk (the oldest beyond these are deleted as builds start).
pub const KEEP_RECORDS: usize = 256;
/// Version of `<state>/builds/<id>.json`.
const FORMAT_VERSION: u32 = 1;

/// The builds the host knows in memory.
#[derive(Debug, Default)]
pub(crate) struct Jobs {
    map: Mutex<HashMap<String, Arc<Job>>>,
    /// Finished ids, oldest first.
    finished: Mutex<VecDeque<String>>,
}

/// One build: its image, state and log.
#[derive(Debug)]
struct Job {
    image: String,
    inner: Mutex<JobState>,
}

#[derive(Debug)]
struct JobState {
    state: BuildJobState,
    error: Option<String>,
    /// Offset of `lines[0]`.
    first: u64,
    lines: VecDeque<BuildLogLine>,
}

impl Job {
    fn push(&self, level: &str, message: &str) {
        let mut s = lock(&self.inner);
        if s.lines.len() == MAX_LINES {
            s.lines.pop_front();
            s.first += 1;
        }
        s.lines.push_back(BuildLogLine {
            at_ms: crab_common::clock::now_ms(),
            level: level.to_string(),
            message: message.to_string(),
        });
    }
}

/// The builder's progress as log lines.
struct JobProgress(Arc<Job>);

impl Progress for JobProgress {
    fn stage(&self, name: &str, _total: Option<u64>) {
        self.0.push("info", name);
    }
    fn advance(&self, _done: u64) {}
    fn message(&self, line: &str) {
        self.0.push("info", line);
    }
}

/// `<state>/builds/<id>.json`.
#[derive(Debug, Serialize, Deserialize)]
struct JobFile {
    version: u32,
    image: String,
    state: BuildJobState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    started_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ended_ms: Option<u64>,
}

fn not_found(id: &str) -> HostError {
    HostError(ApiError::new(
        ErrorCode::InvalidRequest,
        format!("no build {id:?} on this host"),
        "use the id the build's start answered",
    ))
}

impl Host {
    fn build_file(&self, id: &str) -> PathBuf {
        self.state().root().join("builds").join(format!("{id}.json"))
    }

    fn write_build_file(&self, id: &str, f: &JobFile) -> Result<(), HostError> {
        let path = self.build_file(id);
        let dir = path.parent().map(PathBuf::from).unwrap_or_default();
        std::fs::create_dir_all(&dir)
            .map_err(|e| HostError::internal(format!("cannot create {}: {e}", dir.display())))?;
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(f)
            .map_err(|e| HostError::internal(format!("encoding a build record: {e}")))?;
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| HostError::internal(format!("cannot write {}: {e}", path.display())))
    }

    /// Delete the oldest build records beyond [`KEEP_RECORDS`] (never one in memory).
    fn prune_build_files(&self) {
        let dir = self.state().root().join("builds");
        let Ok(rd) = std::fs::read_dir(&dir) else { return };
        let mut all: Vec<(std::time::SystemTime, PathBuf)> = rd
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        if all.len() <= KEEP_RECORDS {
            return;
        }
        all.sort();
        let live: Vec<String> = lock(&self.build_jobs.map).keys().cloned().collect();
        for (_, p) in &all[..all.len() - KEEP_RECORDS] {
            let id = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            if !live.contains(&id) {
                if let Err(e) = std::fs::remove_file(p) {
                    tracing::warn!(path = %p.display(), error = %e, "cannot delete an old build record");
                }
            }
        }
    }

    /// Start building `req` (a Dockerfile build) in the background as build `id`.
    pub(crate) async fn build_start(
        self: &Arc<Self>,
        id: String,
        req: ImageBuildRequest,
    ) -> Result<Outcome, HostError> {
        crab_common::names::validate("build", &id)?;
        let Some(image) = req.name.clone() else {
            return Err(HostError::invalid(
                "a background build needs the image's name",
                "give the request a name",
            ));
        };
        crab_common::names::validate("image", &image)?;
        if req.dockerfile.is_none() {
            return Err(HostError::invalid(
                "a background build builds a Dockerfile",
                "give the request a dockerfile path",
            ));
        }
        let job = Arc::new(Job {
            image: image.clone(),
            inner: Mutex::new(JobState {
                state: BuildJobState::Building,
                error: None,
                first: 0,
                lines: VecDeque::new(),
            }),
        });
        {
            let mut map = lock(&self.build_jobs.map);
            if map.contains_key(&id) || self.build_file(&id).exists() {
                return Err(HostError(ApiError::new(
                    ErrorCode::NameConflict,
                    format!("build {id:?} exists"),
                    "start each build under a new id",
                )));
            }
            map.insert(id.clone(), job.clone());
        }
        let started_ms = crab_common::clock::now_ms();
        let record = JobFile {
            version: FORMAT_VERSION,
            image: image.clone(),
            state: BuildJobState::Building,
            error: None,
            started_ms,
            ended_ms: None,
        };
        if let Err(e) = self.write_build_file(&id, &record) {
            lock(&self.build_jobs.map).remove(&id);
            return Err(e);
        }
        self.prune_build_files();
        let h = self.clone();
        let answer = id.clone();
        tokio::spawn(async move {
            let progress: Box<dyn Progress> = Box::new(JobProgress(job.clone()));
            let r = h.build_dockerfile(req, progress).await;
            let (state, error) = match r {
                Ok(_) => (BuildJobState::Ready, None),
                Err(e) => {
                    let m = e.to_string();
                    job.push("error", &m);
                    (BuildJobState::Error, Some(m))
                }
            };
            tracing::info!(build = %id, image = %job.image, ?state, "background build ended");
            {
                let mut s = lock(&job.inner);
                s.state = state;
                s.error = error.clone();
            }
            let record = JobFile {
                version: FORMAT_VERSION,
                image: job.image.clone(),
                state,
                error,
                started_ms,
                ended_ms: Some(crab_common::clock::now_ms()),
            };
            if let Err(e) = h.write_build_file(&id, &record) {
                tracing::warn!(build = %id, error = %e, "cannot record the build's end");
            }
            let mut fin = lock(&h.build_jobs.finished);
            fin.push_back(id);
            while fin.len() > KEEP_FINISHED {
                if let Some(old) = fin.pop_front() {
                    lock(&h.build_jobs.map).remove(&old);
                }
            }
        });
        Ok(Outcome::BuildStarted(answer))
    }

    /// Build `id`'s state and up to `max` log lines from `offset`.
    pub(crate) async fn build_status(
        self: &Arc<Self>,
        id: String,
        offset: u64,
        max: usize,
    ) -> Result<Outcome, HostError> {
        crab_common::names::validate("build", &id).map_err(|_| not_found(&id))?;
        let max = max.clamp(1, MAX_LINES_PER_CALL);
        let job = lock(&self.build_jobs.map).get(&id).cloned();
        if let Some(job) = job {
            let s = lock(&job.inner);
            let from = offset.max(s.first);
            let skip = usize::try_from(from - s.first).unwrap_or(usize::MAX);
            let lines: Vec<BuildLogLine> = s.lines.iter().skip(skip).take(max).cloned().collect();
            return Ok(Outcome::BuildStatus(Box::new(BuildJobStatus {
                id,
                image: job.image.clone(),
                state: s.state,
                error: s.error.clone(),
                lines,
                offset: from,
            })));
        }
        // Not in memory: its file (a build of an earlier daemon, or one that left memory).
        let path = self.build_file(&id);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_found(&id)),
            Err(e) => {
                return Err(HostError::internal(format!("cannot read {}: {e}", path.display())))
            }
        };
        let f: JobFile = serde_json::from_slice(&bytes).map_err(|e| {
            HostError::internal(format!("{} is not a build record: {e}", path.display()))
        })?;
        if f.version != FORMAT_VERSION {
            return Err(HostError::internal(format!(
                "{} has format version {}, this daemon reads {FORMAT_VERSION}",
                path.display(),
                f.version
            )));
        }
        let (state, error) = match f.state {
            BuildJobState::Building => (
                BuildJobState::Error,
                Some(format!(
                    "the daemon restarted during the build of image {}: start the build again",
                    f.image
                )),
            ),
            s => (s, f.error),
        };
        Ok(Outcome::BuildStatus(Box::new(BuildJobStatus {
            id,
            image: f.image,
            state,
            error,
            lines: Vec::new(),
            offset,
        })))
    }
}
