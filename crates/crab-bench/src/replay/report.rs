//! The replay report: per method, recovery correctness, time against the reference, checkpoint
//! counts and traffic, exposed latency and restore time; the trajectories replayed and where
//! they came from; per-trial details. Rendered as JSON (serde), a text table, and a hand-written
//! SVG bar chart. Nothing here prints: the CLI writes what these functions return.

use std::fmt::Write as _;

use serde::Serialize;

use crate::stats::Summary;

use super::compare::Diff;
use super::methods::Method;
use super::trace::{Family, TraceSource};

/// Checkpoints by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Nothing changed: the new restore point reuses the previous parts.
    pub skip: u64,
    /// Filesystem snapshot only.
    pub fs: u64,
    /// Process image only.
    pub process: u64,
    /// Both.
    pub full: u64,
}

impl Counts {
    /// Count one checkpoint of `kind`; other kinds (restore markers, corrupt points) are not
    /// counted. Returns whether it was.
    pub fn add(&mut self, kind: &str) -> bool {
        match kind {
            "skip" => self.skip += 1,
            "fs" => self.fs += 1,
            "process" => self.process += 1,
            "full" => self.full += 1,
            _ => return false,
        }
        true
    }

    /// Add another count.
    pub fn merge(&mut self, o: &Counts) {
        self.skip += o.skip;
        self.fs += o.fs;
        self.process += o.process;
        self.full += o.full;
    }
}

/// One method's row.
#[derive(Debug, Clone, Serialize)]
pub struct MethodReport {
    /// The method.
    pub method: Method,
    /// Trajectories replayed with a fault (for `none`: fault-free, compared with the second
    /// reference run).
    pub trials: usize,
    /// Trials whose final state equals the reference's.
    pub correct: usize,
    /// `100 * correct / trials`.
    pub correct_pct: f64,
    /// Median over trajectories of the run's end-to-end time (fault and recovery included) over
    /// the `none` run's.
    pub wall_ratio_vs_none: f64,
    /// Median over trajectories of a fault-free run's time with this method's checkpointing on,
    /// over the `none` run's (1.0 for methods that take no checkpoints: their fault-free run is
    /// the `none` run).
    pub overhead_no_fault_ratio: f64,
    /// Checkpoints taken in the trials, by kind.
    pub checkpoints: Counts,
    /// Bytes the trials' checkpoints wrote: each distinct process image and filesystem delta
    /// once.
    pub checkpoint_bytes: u64,
    /// Per turn, time the agent waited beyond the LLM's own time (Crab's exposed latency plus
    /// HTTP overhead), ms.
    pub exposed_ms: Summary,
    /// Where the exposed time went, per stage over every turn (through the proxy: its
    /// `x-crab-held` breakdown, plus `unattributed`, the exposed time it does not cover:
    /// HTTP, proxy and scheduling overhead), largest total first. Empty without the proxy.
    pub exposed_breakdown: Vec<crab_common::stats::StageSummary>,
    /// Per fault, time from the fault to a usable sandbox (restore, or re-create + setup), ms.
    pub restore_ms: Summary,
    /// Runs that failed with an error (counted as incorrect).
    pub errors: usize,
}

/// One run of one trajectory with one method.
#[derive(Debug, Clone, Serialize)]
pub struct TrialReport {
    /// Trajectory id.
    pub trajectory: String,
    /// The method.
    pub method: Method,
    /// `reference`, `reference-2`, `fault` or `no-fault`.
    pub pass: &'static str,
    /// Turns after which a fault was injected.
    pub fault_turns: Vec<usize>,
    /// Whether the final state equals the reference's (None for the references and fault-free
    /// passes).
    pub correct: Option<bool>,
    /// End-to-end time, ms.
    pub wall_ms: f64,
    /// Checkpoints of this run, by kind.
    pub checkpoints: Counts,
    /// Bytes they wrote.
    pub checkpoint_bytes: u64,
    /// `kind:bytes` of each checkpoint, in order (one per turn boundary).
    pub checkpoint_kinds: Vec<String>,
    /// Differences from the reference (noise excluded).
    pub diff: Option<Diff>,
    /// The error that ended the run, if any.
    pub error: Option<String>,
}

/// A replayed trajectory.
#[derive(Debug, Clone, Serialize)]
pub struct TraceInfo {
    /// Id.
    pub id: String,
    /// Family.
    pub family: Family,
    /// Number of turns.
    pub turns: usize,
    /// Persistent shell session.
    pub shell_state: bool,
    /// Source repository and commit.
    pub source: TraceSource,
    /// Stand-in `/testbed` (`pkg==ver`), if any.
    pub testbed: Option<String>,
    /// Paths excluded exactly because two fault-free runs differ on them (and fit no pattern).
    pub noisy_paths: usize,
    /// Conversation messages excluded for the same reason.
    pub noisy_messages: usize,
    /// The noise learned from the two fault-free runs: exact paths, path patterns, messages.
    pub noise: Option<super::compare::Noise>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// Trace sources, `repo@commit`, deduplicated.
    pub trace_sources: Vec<String>,
    /// The trajectories.
    pub traces: Vec<TraceInfo>,
    /// `--llm-latency`.
    pub llm_latency: super::llm::LlmLatency,
    /// `--seed`.
    pub seed: u64,
    /// `--faults`.
    pub faults: usize,
    /// `--fault-daemon`.
    pub fault_daemon: bool,
    /// `--sandboxes`.
    pub sandboxes: usize,
    /// Whether the agents reached the LLM through Crab's proxy.
    pub via_proxy: bool,
    /// One row per method.
    pub methods: Vec<MethodReport>,
    /// Every run.
    pub trials: Vec<TrialReport>,
    /// Wall time of the whole replay, s.
    pub wall_s: f64,
}

fn mb(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

impl ReplayReport {
    /// The row of `m`, if it ran.
    pub fn method(&self, m: Method) -> Option<&MethodReport> {
        self.methods.iter().find(|r| r.method == m)
    }

    /// A text table, one row per method.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<8} {:>6} {:>8} {:>6} {:>6} {:>22} {:>10} {:>24} {:>16}",
            "method",
            "trials",
            "correct",
            "wall×",
            "ovh×",
            "ckpt skip/fs/proc/full",
            "ckpt MB",
            "exposed ms p50/p95/p99",
            "restore p50/p95"
        );
        for r in &self.methods {
            let c = &r.checkpoints;
            let _ = writeln!(
                s,
                "{:<8} {:>6} {:>7.0}% {:>6.3} {:>6.3} {:>22} {:>10.1} {:>24} {:>16}",
                r.method.name(),
                r.trials,
                r.correct_pct,
                r.wall_ratio_vs_none,
                r.overhead_no_fault_ratio,
                format!("{}/{}/{}/{}", c.skip, c.fs, c.process, c.full),
                mb(r.checkpoint_bytes),
                format!("{:.1}/{:.1}/{:.1}", r.exposed_ms.p50, r.exposed_ms.p95, r.exposed_ms.p99),
                if r.restore_ms.n == 0 {
                    "-".to_string()
                } else {
                    format!("{:.0}/{:.0}", r.restore_ms.p50, r.restore_ms.p95)
                },
            );
        }
        let _ = writeln!(
            s,
            "{} trajectories ({}), {} fault(s) each{}, llm latency {:?}, seed {}, {} sandboxes, {:.1} s",
            self.traces.len(),
            self.trace_sources.join(", "),
            self.faults,
            if self.fault_daemon { " + daemon" } else { "" },
            self.llm_latency,
            self.seed,
            self.sandboxes,
            self.wall_s
        );
        for r in &self.methods {
            if r.exposed_breakdown.is_empty() {
                continue;
            }
            let parts: Vec<String> = r
                .exposed_breakdown
                .iter()
                .filter(|b| b.total_ms > 0.0)
                .take(6)
                .map(|b| {
                    format!("{} {:.1}/{:.1} ({:.0}%)", b.stage, b.ms.p50, b.ms.p95, 100.0 * b.share)
                })
                .collect();
            let _ = writeln!(
                s,
                "  exposed by stage, {} (ms p50/p95, share): {}",
                r.method.name(),
                if parts.is_empty() { "-".to_string() } else { parts.join(", ") }
            );
        }
        for t in &self.traces {
            let Some(n) = &t.noise else { continue };
            if n.paths.is_empty() && n.patterns.is_empty() && n.messages.is_empty() {
                continue;
            }
            let pats: Vec<&str> = n.patterns.iter().take(6).map(String::as_str).collect();
            let _ = writeln!(
                s,
                "  noise {}: {} exact path(s), {} message(s) excluded, {} generalised; patterns {}{}",
                t.id,
                n.paths.len(),
                n.messages.len(),
                n.fuzzy_messages.len(),
                if pats.is_empty() { "-".to_string() } else { pats.join(" ") },
                if n.patterns.len() > pats.len() { " …" } else { "" }
            );
        }
        s
    }

    /// An SVG bar chart of the table: correct %, checkpoint MB, and time ratio per method.
    pub fn svg(&self) -> String {
        let rows = &self.methods;
        let panel_w = 260.0;
        let bar_h = 18.0;
        let gap = 6.0;
        let left = 70.0;
        let top = 50.0;
        let h = top + rows.len() as f64 * (bar_h + gap) + 40.0;
        let w = left + 3.0 * (panel_w + 30.0) + 10.0;
        let colors = ["#888888", "#d9480f", "#1c7ed6", "#37b24d", "#ae3ec9", "#f59f00"];
        let max_mb = rows.iter().map(|r| mb(r.checkpoint_bytes)).fold(0.0, f64::max).max(1e-9);
        let max_ratio = rows
            .iter()
            .map(|r| if r.wall_ratio_vs_none.is_finite() { r.wall_ratio_vs_none } else { 0.0 })
            .fold(1.0, f64::max);
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="10" y="20" font-size="14" font-weight="bold">Crab replay: {} trajectories, {} fault(s) each</text>"#,
            self.traces.len(),
            self.faults
        );
        let panels: [(&str, BarFn<'_>); 3] = [
            (
                "recovery correct (%)",
                Box::new(|r| (r.correct_pct / 100.0, format!("{:.0}%", r.correct_pct))),
            ),
            (
                "checkpoint traffic (MB)",
                Box::new(move |r| {
                    (mb(r.checkpoint_bytes) / max_mb, format!("{:.1}", mb(r.checkpoint_bytes)))
                }),
            ),
            (
                "wall time vs none (×)",
                Box::new(move |r| {
                    let v =
                        if r.wall_ratio_vs_none.is_finite() { r.wall_ratio_vs_none } else { 0.0 };
                    (v / max_ratio, format!("{v:.2}"))
                }),
            ),
        ];
        for (pi, (title, f)) in panels.iter().enumerate() {
            let x0 = left + pi as f64 * (panel_w + 30.0);
            let _ = writeln!(
                s,
                r#"<text x="{x0:.0}" y="{:.0}" font-weight="bold">{title}</text>"#,
                top - 10.0
            );
            for (i, r) in rows.iter().enumerate() {
                let y = top + i as f64 * (bar_h + gap);
                if pi == 0 {
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.0}" y="{:.0}" text-anchor="end">{}</text>"#,
                        left - 6.0,
                        y + 13.0,
                        r.method.name()
                    );
                }
                let (frac, label) = f(r);
                let frac = if frac.is_finite() { frac.clamp(0.0, 1.0) } else { 0.0 };
                let bw = frac * (panel_w - 50.0);
                let color = colors[i % colors.len()];
                let _ = writeln!(
                    s,
                    r#"<rect x="{x0:.0}" y="{y:.0}" width="{bw:.1}" height="{bar_h}" fill="{color}"/>"#
                );
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.0}">{label}</text>"#,
                    x0 + bw + 4.0,
                    y + 13.0
                );
            }
        }
        let _ = writeln!(
            s,
            r#"<text x="10" y="{:.0}" fill="gray">sources: {}</text>"#,
            h - 12.0,
            xml_escape(&self.trace_sources.join(", "))
        );
        s.push_str("</svg>\n");
        s
    }
}

/// A panel's bar: fraction of the panel's width and label.
type BarFn<'a> = Box<dyn Fn(&MethodReport) -> (f64, String) + 'a>;

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_rendering() {
        let mut c = Counts::default();
        for k in ["skip", "fs", "process", "full", "full"] {
            assert!(c.add(k));
        }
        assert!(!c.add("restore"));
        assert_eq!(c, Counts { skip: 1, fs: 1, process: 1, full: 2 });
        let row = MethodReport {
            method: Method::Crab,
            trials: 2,
            correct: 2,
            correct_pct: 100.0,
            wall_ratio_vs_none: 1.01,
            overhead_no_fault_ratio: 1.0,
            checkpoints: c,
            checkpoint_bytes: 3 << 20,
            exposed_ms: Summary::of(&[1.0, 2.0]),
            exposed_breakdown: crab_common::stats::stage_summaries(&vec![vec![(
                "syncfs".to_string(),
                1.5,
            )]]),
            restore_ms: Summary::of(&[]),
            errors: 0,
        };
        let r = ReplayReport {
            trace_sources: vec!["project".into()],
            traces: vec![],
            llm_latency: super::super::llm::LlmLatency::Scale(0.05),
            seed: 1,
            faults: 1,
            fault_daemon: false,
            sandboxes: 2,
            via_proxy: false,
            methods: vec![row],
            trials: vec![],
            wall_s: 1.0,
        };
        assert!(r.table().contains("crab"));
        assert!(r.table().contains("exposed by stage, crab"), "{}", r.table());
        let svg = r.svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["methods"][0]["exposed_ms"]["p99"], 2.0);
        assert!(j["methods"][0]["restore_ms"]["p50"].is_null());
        assert_eq!(j["methods"][0]["exposed_breakdown"][0]["stage"], "syncfs");
        assert_eq!(j["methods"][0]["exposed_breakdown"][0]["ms"]["p95"], 1.5);
    }
}
