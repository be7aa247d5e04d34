//! The replay report: per method, recovery correctness, time against the reference, checkpoint
//! counts and traffic, exposed latency and restore time; the trajectories replayed and where
//! they came from; per-trial details. Rendered as JSON (serde), a text table, and an SVG chart
//! drawn with `plotters` (its SVG backend: an exposed-latency CDF and checkpoint bytes per turn,
//! one line per method, and bars of correctness, traffic and wall time). Nothing here prints:
//! the CLI writes what these functions return.

use std::fmt::Write as _;

use plotters::coord::Shift;
use plotters::prelude::*;
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
    /// The same turns' distribution: `[ms, fraction of turns ≤ ms]` per histogram bucket
    /// ([`crate::stats::Latencies::cdf`]), increasing; empty without turns.
    pub exposed_cdf: Vec<[f64; 2]>,
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
    /// The LLM wait of every scripted turn (ms), what exposed latency is a share of.
    pub llm_wait_ms: Summary,
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
        let wait = self.llm_wait_ms.p50;
        if wait > 0.0 {
            let shares: Vec<String> = self
                .methods
                .iter()
                .filter(|r| r.exposed_ms.n > 0)
                .map(|r| format!("{} {:.1}%", r.method, 100.0 * r.exposed_ms.p95 / wait))
                .collect();
            let _ = writeln!(
                s,
                "  median LLM wait {:.0} ms; exposed p95 as a share of it: {}",
                wait,
                shares.join(", ")
            );
        }
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

    /// Mean size (KiB) of each method's checkpoint at the n-th turn boundary of its trial runs
    /// (the runs its row counts), per method with checkpoints: `(row index, points from 1)`.
    pub fn bytes_per_turn(&self) -> Vec<(usize, Vec<(u32, f64)>)> {
        let mut out = Vec::new();
        for (i, r) in self.methods.iter().enumerate() {
            let trial_pass = if r.method == Method::None { "reference-2" } else { "fault" };
            let (mut sum, mut runs): (Vec<f64>, Vec<u32>) = (Vec::new(), Vec::new());
            for t in self.trials.iter().filter(|t| t.method == r.method && t.pass == trial_pass) {
                let sizes = t.checkpoint_kinds.iter().filter_map(|k| {
                    let (kind, bytes) = k.split_once(':')?;
                    let counted = matches!(kind, "skip" | "fs" | "process" | "full");
                    counted.then_some(bytes.parse::<u64>().ok()?)
                });
                for (n, b) in sizes.enumerate() {
                    if n == sum.len() {
                        sum.push(0.0);
                        runs.push(0);
                    }
                    sum[n] += b as f64 / 1024.0;
                    runs[n] += 1;
                }
            }
            if !sum.is_empty() {
                let pts = sum
                    .iter()
                    .zip(&runs)
                    .enumerate()
                    .map(|(n, (s, k))| (n as u32 + 1, s / f64::from(*k)))
                    .collect();
                out.push((i, pts));
            }
        }
        out
    }

    /// An SVG chart: per method, the exposed-latency CDF (log x) and checkpoint KiB per turn
    /// (log y), one line each; below, bars of correct %, checkpoint MB and wall time vs none.
    pub fn svg(&self) -> Result<String, ChartError> {
        let mut buf = String::new();
        {
            let root = SVGBackend::with_string(&mut buf, (1200, 780)).into_drawing_area();
            self.draw(&root)?;
            root.present()?;
        }
        Ok(buf)
    }

    fn draw(&self, root: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), ChartError> {
        root.fill(&WHITE)?;
        let title = format!(
            "Crab replay: {} trajectories, {} fault(s) each",
            self.traces.len(),
            self.faults
        );
        let body = root.titled(&title, ("sans-serif", 18).into_font().style(FontStyle::Bold))?;
        let (body, footer) = body.split_vertically(body.dim_in_pixel().1.saturating_sub(24));
        footer.draw_text(
            &format!("sources: {}", self.trace_sources.join(", ")),
            &("sans-serif", 12).into_font().color(&RGBColor(0x80, 0x80, 0x80)),
            (10, 4),
        )?;
        let (top, bottom) = body.split_vertically(430);
        let (left, right) = top.split_horizontally(600);
        self.draw_cdf(&left)?;
        self.draw_bytes(&right)?;
        let names: Vec<&str> = self.methods.iter().map(|r| r.method.name()).collect();
        let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
        let panels: [(&str, Vec<(f64, String)>); 3] = [
            (
                "recovery correct (%)",
                self.methods
                    .iter()
                    .map(|r| (finite(r.correct_pct), format!("{:.0}%", r.correct_pct)))
                    .collect(),
            ),
            (
                "checkpoint traffic (MB)",
                self.methods
                    .iter()
                    .map(|r| (mb(r.checkpoint_bytes), format!("{:.1}", mb(r.checkpoint_bytes))))
                    .collect(),
            ),
            (
                "wall time vs none (×)",
                self.methods
                    .iter()
                    .map(|r| (finite(r.wall_ratio_vs_none), format!("{:.2}", r.wall_ratio_vs_none)))
                    .collect(),
            ),
        ];
        for (area, (caption, bars)) in bottom.split_evenly((1, 3)).iter().zip(panels) {
            bar_panel(area, caption, &names, &bars)?;
        }
        Ok(())
    }

    fn draw_cdf(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), ChartError> {
        let hi = self
            .methods
            .iter()
            .filter_map(|r| r.exposed_cdf.last())
            .map(|p| p[0])
            .fold(1.0, f64::max)
            * 1.5;
        let mut chart = ChartBuilder::on(area)
            .caption("exposed latency per turn (CDF)", ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((CDF_FLOOR_MS * 0.7..hi).log_scale(), 0.0..1.0)?;
        chart
            .configure_mesh()
            .x_desc(format!("ms beyond the LLM's own time (log; {CDF_FLOOR_MS} and below drawn at {CDF_FLOOR_MS})"))
            .y_desc("fraction of turns")
            .x_label_formatter(&|v| format!("{v}"))
            .draw()?;
        for (i, r) in self.methods.iter().enumerate() {
            if r.exposed_cdf.is_empty() {
                continue;
            }
            let color = color_of(i);
            chart
                .draw_series(LineSeries::new(cdf_steps(&r.exposed_cdf), color.stroke_width(2)))?
                .label(r.method.name())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    }

    fn draw_bytes(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), ChartError> {
        let series = self.bytes_per_turn();
        let turns = series.iter().map(|(_, p)| p.len() as u32).max().unwrap_or(0).max(1);
        let hi =
            series.iter().flat_map(|(_, p)| p.iter().map(|x| x.1)).fold(BYTES_FLOOR_KIB, f64::max)
                * 2.0;
        let mut chart = ChartBuilder::on(area)
            .caption("checkpoint size per turn (mean over trials)", ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0..turns + 1, (BYTES_FLOOR_KIB..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("turn boundary")
            .y_desc(format!("KiB (log; below {BYTES_FLOOR_KIB} drawn at {BYTES_FLOOR_KIB})"))
            .y_label_formatter(&|v| format!("{v}"))
            .draw()?;
        for (i, pts) in &series {
            let color = color_of(*i);
            let pts: Vec<(u32, f64)> =
                pts.iter().map(|&(x, y)| (x, y.max(BYTES_FLOOR_KIB))).collect();
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                .label(self.methods[*i].method.name())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        if !series.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }
        Ok(())
    }
}

/// Exposed latencies at or below this are drawn at it on the CDF's log axis (0 ms is common:
/// the checkpoint hid behind the LLM's own time).
const CDF_FLOOR_MS: f64 = 0.01;

/// Checkpoint sizes below this are drawn at it on the log axis (a `skip` point writes ~0).
const BYTES_FLOOR_KIB: f64 = 1.0;

/// The same color for a method in every panel (by its row).
fn color_of(row: usize) -> RGBColor {
    const COLORS: [RGBColor; 6] = [
        RGBColor(0x88, 0x88, 0x88),
        RGBColor(0xd9, 0x48, 0x0f),
        RGBColor(0x1c, 0x7e, 0xd6),
        RGBColor(0x37, 0xb2, 0x4d),
        RGBColor(0xae, 0x3e, 0xc9),
        RGBColor(0xf5, 0x9f, 0x00),
    ];
    COLORS[row % COLORS.len()]
}

/// A CDF's points as a staircase from 0, x floored at [`CDF_FLOOR_MS`].
fn cdf_steps(cdf: &[[f64; 2]]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(2 * cdf.len());
    let mut below = 0.0;
    for &[ms, frac] in cdf {
        let x = ms.max(CDF_FLOOR_MS);
        out.push((x, below));
        out.push((x, frac));
        below = frac;
    }
    out
}

/// One horizontal bar per method (first on top), scaled to the largest, its label at its end.
fn bar_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    names: &[&str],
    bars: &[(f64, String)],
) -> Result<(), ChartError> {
    let Some(last) = (bars.len() as i32).checked_sub(1).filter(|l| *l >= 0) else { return Ok(()) };
    let max = bars.iter().map(|b| b.0).fold(0.0, f64::max).max(1e-9) * 1.25;
    let row = |i: usize| last - i as i32;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(24)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..max, (0..last).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .y_labels(bars.len())
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(y) | SegmentValue::Exact(y) => usize::try_from(last - *y)
                .ok()
                .and_then(|i| names.get(i))
                .map_or_else(String::new, |n| n.to_string()),
            SegmentValue::Last => String::new(),
        })
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (v, _))| {
        let mut r = Rectangle::new(
            [(0.0, SegmentValue::Exact(row(i))), (*v, SegmentValue::Exact(row(i) + 1))],
            color_of(i).filled(),
        );
        r.set_margin(4, 4, 0, 0);
        r
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (v, label))| {
        EmptyElement::at((*v, SegmentValue::CenterOf(row(i))))
            + Text::new(label.clone(), (4, -6), ("sans-serif", 11).into_font())
    }))?;
    Ok(())
}

/// Drawing the chart failed (plotters' backend error, as text).
#[derive(Debug, thiserror::Error)]
#[error("drawing the replay chart: {0}")]
pub struct ChartError(String);

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for ChartError {
    fn from(e: DrawingAreaErrorKind<E>) -> Self {
        ChartError(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(method: Method, exposed: &[f64], bytes: u64) -> MethodReport {
        MethodReport {
            method,
            trials: 2,
            correct: 2,
            correct_pct: 100.0,
            wall_ratio_vs_none: 1.01,
            overhead_no_fault_ratio: 1.0,
            checkpoints: Counts::default(),
            checkpoint_bytes: bytes,
            exposed_ms: Summary::of(exposed),
            exposed_cdf: crate::stats::Latencies::of(exposed).cdf(),
            exposed_breakdown: Vec::new(),
            restore_ms: Summary::of(&[]),
            errors: 0,
        }
    }

    fn trial(method: Method, pass: &'static str, kinds: &[&str]) -> TrialReport {
        TrialReport {
            trajectory: "t".into(),
            method,
            pass,
            fault_turns: vec![1],
            correct: Some(true),
            wall_ms: 1.0,
            checkpoints: Counts::default(),
            checkpoint_bytes: 0,
            checkpoint_kinds: kinds.iter().map(|k| k.to_string()).collect(),
            diff: None,
            error: None,
        }
    }

    fn report(methods: Vec<MethodReport>, trials: Vec<TrialReport>) -> ReplayReport {
        ReplayReport {
            trace_sources: vec!["project <&> x".into()],
            traces: vec![],
            llm_latency: super::super::llm::LlmLatency::Scale(0.05),
            seed: 1,
            faults: 1,
            fault_daemon: false,
            sandboxes: 2,
            via_proxy: false,
            methods,
            trials,
            llm_wait_ms: Summary::of(&[1000.0]),
            wall_s: 1.0,
        }
    }

    #[test]
    fn bytes_per_turn_averages_the_trial_runs() {
        let r = report(
            vec![row(Method::None, &[0.0], 0), row(Method::Crab, &[1.0], 1)],
            vec![
                trial(Method::Crab, "fault", &["full:2048", "restore:99", "skip:0"]),
                trial(Method::Crab, "fault", &["fs:4096"]),
                trial(Method::Crab, "no-fault", &["full:1048576"]),
                trial(Method::None, "reference-2", &[]),
            ],
        );
        assert_eq!(r.bytes_per_turn(), vec![(1, vec![(1, 3.0), (2, 0.0)])]);
    }

    #[test]
    fn the_chart_has_one_series_per_method() {
        let methods = vec![
            row(Method::None, &[0.0, 0.0, 0.5], 0),
            row(Method::Crab, &[0.0, 1.2, 4.8, 37.0], 3 << 20),
            row(Method::Full, &[30.0, 45.0, 120.0], 40 << 20),
        ];
        let trials = vec![
            trial(Method::Crab, "fault", &["full:40000000", "skip:0", "fs:50000"]),
            trial(Method::Full, "fault", &["full:40000000", "full:41000000", "full:42000000"]),
        ];
        let svg = report(methods, trials).svg().unwrap();
        if let Ok(path) = std::env::var("CRAB_REPLAY_SVG_OUT") {
            std::fs::write(path, &svg).unwrap();
        }
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        assert!(svg.contains("exposed latency per turn (CDF)") && svg.contains("KiB (log"));
        assert!(svg.contains("project &lt;&amp;&gt; x"), "text is escaped");
        // A method's lines are drawn in its color: CDF + legend for all, bytes + legend for the
        // two that checkpoint.
        let lines = |color: &str| {
            svg.lines().filter(|l| l.contains("<polyline") && l.contains(color)).count()
        };
        assert_eq!(lines("#888888"), 2, "none: a CDF and its legend");
        assert_eq!(lines("#D9480F"), 4, "crab: a CDF, bytes per turn, two legends");
        assert_eq!(lines("#1C7ED6"), 4, "full");
        for m in ["none", "crab", "full"] {
            let labels = svg.matches(&format!(">\n{m}\n</text>")).count();
            assert_eq!(
                labels,
                if m == "none" { 4 } else { 5 },
                "{m}: 1 or 2 legends + 3 bar labels"
            );
        }
    }

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
            exposed_cdf: crate::stats::Latencies::of(&[1.0, 2.0]).cdf(),
            exposed_breakdown: crab_common::stats::stage_summaries(&vec![vec![(
                "syncfs".to_string(),
                1.5,
            )]]),
            restore_ms: Summary::of(&[]),
            errors: 0,
        };
        let r = report(vec![row], vec![]);
        assert!(r.table().contains("crab"));
        assert!(r.table().contains("exposed by stage, crab"), "{}", r.table());
        let svg = r.svg().unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["methods"][0]["exposed_ms"]["p99"], 2.0);
        assert_eq!(j["methods"][0]["exposed_cdf"], serde_json::json!([[1.0, 0.5], [2.0, 1.0]]));
        assert!(j["methods"][0]["restore_ms"]["p50"].is_null());
        assert_eq!(j["methods"][0]["exposed_breakdown"][0]["stage"], "syncfs");
        assert_eq!(j["methods"][0]["exposed_breakdown"][0]["ms"]["p95"], 1.5);
    }
}
