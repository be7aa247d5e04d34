//! `crab-engine`: the host-wide checkpoint scheduler.
//!
//! Every co-located sandbox's checkpoint work goes through one [`Engine`]: a normal and an urgent
//! queue, promotion of a job whose agent's LLM response is already waiting, a bound on how long
//! urgent work may keep normal work waiting, a limit on concurrent process dumps, a token bucket
//! on disk bandwidth, and coalescing of a sandbox's queued jobs. What a job *does* is behind the
//! [`Executor`] trait (crab-host implements it over the checkpointer), with a typed payload
//! ([`Changeset`]) and a typed error; callers get a [`JobHandle`] to await
//! publication. Work of the host that is not a sandbox's job (exports to the durable tier)
//! runs in the engine's background lane ([`Engine::background`]), behind urgent work. Metrics
//! come out as [`Engine::stats`] (for `crab top`) and
//! [`Engine::metrics_text`] (Prometheus).

mod background;
mod engine;
mod job;
mod metrics;

pub use background::{BackgroundPermit, LaneHold};
pub use engine::{Engine, EngineConfig, EngineError, EngineStats, JobHandle, SandboxView};
pub use job::{
    Changeset, ExecError, Executor, Finished, FnExecutor, Job, JobError, JobId, JobOp, JobOutcome,
    JobSpec, Stage,
};
pub use metrics::{JobRecord, SandboxStats};
