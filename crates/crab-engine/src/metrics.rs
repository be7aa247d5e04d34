//! Engine metrics: per-job records (queue wait, run time, bytes, exposed latency), per-sandbox
//! aggregates for `crab top`, and counters and histograms rendered as Prometheus text.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crab_common::CheckpointKind;

use crate::job::{JobId, JobOp};

/// Histogram bucket upper bounds, in seconds.
const BUCKETS: [f64; 13] =
    [0.0005, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// A cumulative histogram in seconds.
#[derive(Debug, Clone, Default)]
pub(crate) struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    pub(crate) fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += s;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", self.counts[i]);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// One finished job, as kept in the engine's recent-jobs ring.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// Id.
    pub job: JobId,
    /// Checkpoint or restore.
    pub op: JobOp,
    /// Sandbox.
    pub sandbox: String,
    /// Kind run (after coalescing).
    pub kind: CheckpointKind,
    /// Earliest turn covered.
    pub first_turn: u64,
    /// Latest turn covered.
    pub turn: u64,
    /// Submissions merged into it.
    pub submissions: u32,
    /// Whether it was promoted to urgent (or submitted urgent).
    pub urgent: bool,
    /// Milliseconds from first submission to start.
    pub queue_wait_ms: f64,
    /// Milliseconds the executor ran.
    pub run_ms: f64,
    /// Bytes written.
    pub bytes: u64,
    /// Milliseconds a response was held on this job (recorded by the coordinator), if any.
    pub exposed_ms: Option<f64>,
    /// The failure, if it failed.
    pub error: Option<String>,
}

/// Aggregates per sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxStats {
    /// Submissions per kind (`skip`, `fs`, `process`, `full`): the verdict mix.
    pub submitted: BTreeMap<String, u64>,
    /// Submissions merged into an already queued job.
    pub coalesced: u64,
    /// Jobs finished successfully.
    pub completed: u64,
    /// Jobs failed.
    pub failed: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Latest turn published.
    pub last_turn: Option<u64>,
    /// Number of responses held (exposed latency > 0 recorded).
    pub held: u64,
    /// Total milliseconds responses were held.
    pub held_ms_total: f64,
    /// Longest hold in milliseconds.
    pub held_ms_max: f64,
}

/// Everything the engine counts.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) submitted: [u64; 4],
    pub(crate) restores_submitted: u64,
    pub(crate) restores_failed: u64,
    pub(crate) coalesced: u64,
    pub(crate) completed: [u64; 4],
    pub(crate) failed: [u64; 4],
    pub(crate) promotions: u64,
    pub(crate) starvation_breaks: u64,
    pub(crate) bytes: u64,
    pub(crate) queue_wait: Histogram,
    pub(crate) run_time: Histogram,
    pub(crate) exposed: Histogram,
    pub(crate) sandboxes: BTreeMap<String, SandboxStats>,
    pub(crate) recent: VecDeque<JobRecord>,
}

impl Metrics {
    pub(crate) fn sandbox(&mut self, name: &str) -> &mut SandboxStats {
        self.sandboxes.entry(name.to_string()).or_default()
    }

    pub(crate) fn on_submit(
        &mut self,
        sandbox: &str,
        op: JobOp,
        kind: CheckpointKind,
        coalesced: bool,
    ) {
        if op == JobOp::Restore {
            self.restores_submitted += 1;
            return;
        }
        self.submitted[kind.index()] += 1;
        if coalesced {
            self.coalesced += 1;
        }
        let s = self.sandbox(sandbox);
        *s.submitted.entry(kind.as_str().to_string()).or_default() += 1;
        if coalesced {
            s.coalesced += 1;
        }
    }

    pub(crate) fn on_finish(&mut self, rec: JobRecord, history: usize) {
        let k = rec.kind.index();
        self.queue_wait.observe(Duration::from_secs_f64(rec.queue_wait_ms / 1e3));
        self.run_time.observe(Duration::from_secs_f64(rec.run_ms / 1e3));
        if rec.op == JobOp::Restore {
            if rec.error.is_some() {
                self.restores_failed += 1;
            }
            self.recent.push_back(rec);
            while self.recent.len() > history.max(1) {
                self.recent.pop_front();
            }
            return;
        }
        let s = self.sandbox(&rec.sandbox);
        if rec.error.is_some() {
            s.failed += 1;
        } else {
            s.completed += 1;
            s.bytes += rec.bytes;
            s.last_turn = Some(s.last_turn.map_or(rec.turn, |t| t.max(rec.turn)));
        }
        if rec.error.is_some() {
            self.failed[k] += 1;
        } else {
            self.completed[k] += 1;
            self.bytes += rec.bytes;
        }
        self.recent.push_back(rec);
        while self.recent.len() > history.max(1) {
            self.recent.pop_front();
        }
    }

    pub(crate) fn on_exposed(&mut self, job: JobId, sandbox: &str, held: Duration) {
        let ms = held.as_secs_f64() * 1e3;
        self.exposed.observe(held);
        if let Some(r) = self.recent.iter_mut().rev().find(|r| r.job == job) {
            r.exposed_ms = Some(r.exposed_ms.unwrap_or(0.0).max(ms));
        }
        let s = self.sandbox(sandbox);
        if ms > 0.0 {
            s.held += 1;
        }
        s.held_ms_total += ms;
        s.held_ms_max = s.held_ms_max.max(ms);
    }

    pub(crate) fn render(&self, out: &mut String) {
        counter_by_kind(
            out,
            "crab_engine_jobs_submitted_total",
            "Checkpoint jobs submitted, by verdict.",
            &self.submitted,
        );
        counter_by_kind(
            out,
            "crab_engine_jobs_completed_total",
            "Checkpoint jobs published, by kind run.",
            &self.completed,
        );
        counter_by_kind(
            out,
            "crab_engine_jobs_failed_total",
            "Checkpoint jobs failed, by kind run.",
            &self.failed,
        );
        counter(
            out,
            "crab_engine_restores_total",
            "Restore jobs submitted.",
            self.restores_submitted,
        );
        counter(
            out,
            "crab_engine_restores_failed_total",
            "Restore jobs failed.",
            self.restores_failed,
        );
        counter(
            out,
            "crab_engine_jobs_coalesced_total",
            "Submissions merged into a queued job of the same sandbox.",
            self.coalesced,
        );
        counter(out, "crab_engine_promotions_total", "Jobs promoted to urgent.", self.promotions);
        counter(
            out,
            "crab_engine_starvation_breaks_total",
            "Normal jobs started ahead of waiting urgent ones by the starvation bound.",
            self.starvation_breaks,
        );
        counter(out, "crab_engine_bytes_total", "Bytes written by checkpoint jobs.", self.bytes);
        self.queue_wait.render(
            out,
            "crab_engine_queue_wait_seconds",
            "Time from submission to start of a job.",
        );
        self.run_time.render(out, "crab_engine_run_seconds", "Time a job ran.");
        self.exposed.render(
            out,
            "crab_engine_exposed_latency_seconds",
            "Time an agent's LLM response was held waiting for its checkpoint.",
        );
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
    let _ = writeln!(out, "{name} {v}");
}

fn counter_by_kind(out: &mut String, name: &str, help: &str, v: &[u64; 4]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
    for k in CheckpointKind::ALL {
        let _ = writeln!(out, "{name}{{kind=\"{k}\"}} {}", v[k.index()]);
    }
}

pub(crate) fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {v}");
}
