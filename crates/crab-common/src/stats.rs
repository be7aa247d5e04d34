//! Latency summaries and distributions, shared by every benchmark (Crab's own and the
//! coordinator's) so that all reports compute percentiles the same way: latency samples go into
//! an HdrHistogram ([`Latencies`], the `hdrhistogram` crate) and percentiles are read from it
//! (nearest rank, at the histogram's resolution). Figures that are not latencies — ratios,
//! signed differences — take the exact nearest-rank [`percentile`] / [`median`] instead.
//! Per-stage breakdowns of a turn's exposed latency ([`Breakdown`], [`stage_summaries`]) live
//! here too.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Significant decimal figures the latency histograms keep (see [`Latencies`]).
pub const SIGNIFICANT_FIGURES: u8 = 3;

/// Summary of a set of samples in milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

/// Exact nearest-rank percentile of sorted samples (`q` in 0..=1), for figures that are not
/// latencies (ratios, signed differences); latencies go through [`Latencies`].
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Exact nearest-rank median of samples in any order (NaN when empty), for figures that are not
/// latencies: ratios, and differences that may be negative.
pub fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, 0.5)
}

/// Latency samples (ms) in an HdrHistogram, for percentiles and a CDF.
///
/// Resolution: a sample is recorded in whole microseconds (rounded to the nearest µs) with
/// [`SIGNIFICANT_FIGURES`] = 3 significant figures: every value below 2.048 ms is kept to the
/// µs; above, a bucket spans at most 1/1024 of its values. A percentile is the midpoint of the
/// bucket holding the nearest-rank sample, so it is within 1/2048 (≈ 0.05 %) + 0.5 µs of that
/// sample, and it is clamped into [min, max]. `n`, `mean`, `min` and `max` are exact. The
/// histogram resizes itself to the largest sample (memory grows with the log of the range).
/// Latencies are not negative: a negative sample is recorded as 0 in the histogram (its exact
/// value still counts in `mean` and `min`); non-finite samples are left out entirely.
#[derive(Debug, Clone)]
pub struct Latencies {
    /// `None` only if the histogram could not be built (it cannot: 3 significant figures is in
    /// the crate's 0..=5); percentiles are then NaN.
    hist: Option<Histogram<u64>>,
    n: usize,
    sum: f64,
    min: f64,
    max: f64,
}

impl Default for Latencies {
    fn default() -> Self {
        Self::new()
    }
}

impl Latencies {
    /// An empty histogram.
    pub fn new() -> Self {
        Latencies {
            hist: Histogram::new(SIGNIFICANT_FIGURES).ok(),
            n: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    /// A histogram of `samples` (ms, any order).
    pub fn of(samples: &[f64]) -> Self {
        let mut l = Self::new();
        for &ms in samples {
            l.record_ms(ms);
        }
        l
    }

    /// Record one sample, in milliseconds.
    pub fn record_ms(&mut self, ms: f64) {
        if !ms.is_finite() {
            return;
        }
        self.n += 1;
        self.sum += ms;
        self.min = self.min.min(ms);
        self.max = self.max.max(ms);
        if let Some(h) = &mut self.hist {
            // `as` saturates: a sample beyond u64 µs (584 000 years) is recorded at the top.
            let us = (ms * 1e3).round().max(0.0) as u64;
            if h.record(us).is_err() {
                h.saturating_record(us);
            }
        }
    }

    /// Number of samples recorded.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether no sample was recorded.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// A histogram value (µs) as ms, at the midpoint of its bucket, within [min, max].
    fn ms_of(&self, h: &Histogram<u64>, us: u64) -> f64 {
        // `+ 0.0` turns a -0.0 into 0.0: reports show no "-0".
        (h.median_equivalent(us) as f64 / 1e3).clamp(self.min, self.max) + 0.0
    }

    /// The `q` quantile (0..=1), ms: the nearest-rank sample at the histogram's resolution
    /// (NaN when empty).
    pub fn quantile_ms(&self, q: f64) -> f64 {
        match &self.hist {
            Some(h) if self.n > 0 => self.ms_of(h, h.value_at_quantile(q)),
            _ => f64::NAN,
        }
    }

    /// The empirical CDF, one `[ms, fraction of samples ≤ ms]` point per distinct histogram
    /// bucket in increasing order, the last at fraction 1 (empty when there are no samples).
    pub fn cdf(&self) -> Vec<[f64; 2]> {
        let Some(h) = self.hist.as_ref().filter(|_| self.n > 0) else { return Vec::new() };
        h.iter_recorded()
            .map(|v| [self.ms_of(h, v.value_iterated_to()), v.quantile_iterated_to()])
            .collect()
    }

    /// n, p50/p95/p99 from the histogram, mean/min/max exact (all NaN when empty).
    pub fn summary(&self) -> Summary {
        if self.n == 0 {
            return Summary {
                n: 0,
                p50: f64::NAN,
                p95: f64::NAN,
                p99: f64::NAN,
                mean: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        Summary {
            n: self.n,
            p50: self.quantile_ms(0.5),
            p95: self.quantile_ms(0.95),
            p99: self.quantile_ms(0.99),
            mean: self.sum / self.n as f64,
            min: self.min,
            max: self.max,
        }
    }
}

impl Summary {
    /// Summarize latency samples (ms, any order) through a [`Latencies`] histogram.
    pub fn of(samples: &[f64]) -> Summary {
        Latencies::of(samples).summary()
    }
}

/// One turn's exposed-latency breakdown: `(stage, ms)` in the order the stages ran.
pub type Breakdown = Vec<(String, f64)>;

/// A breakdown as a header value: `stage=ms,stage=ms` (ms with three decimals).
pub fn breakdown_header(b: &[(String, f64)]) -> String {
    b.iter().map(|(n, ms)| format!("{n}={ms:.3}")).collect::<Vec<_>>().join(",")
}

/// Parse [`breakdown_header`]'s format; malformed entries are left out.
pub fn parse_breakdown(v: &str) -> Breakdown {
    v.split(',')
        .filter_map(|kv| {
            let (k, v) = kv.trim().split_once('=')?;
            Some((k.to_string(), v.parse::<f64>().ok().filter(|x| x.is_finite())?))
        })
        .collect()
}

/// Where the exposed time of many turns went, for one stage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StageSummary {
    /// Stage name.
    pub stage: String,
    /// Turns in which the stage held the agent at all.
    pub turns: usize,
    /// Its per-turn time over *all* turns (a turn without it counts 0 ms), so that its p95
    /// compares with the exposed latency's p95.
    pub ms: Summary,
    /// Its total over all turns, ms.
    pub total_ms: f64,
    /// Its share of all stages' total (0..=1).
    pub share: f64,
}

/// Summarize per-turn breakdowns stage by stage, largest total first.
pub fn stage_summaries<'a>(turns: impl IntoIterator<Item = &'a Breakdown>) -> Vec<StageSummary> {
    let turns: Vec<&Breakdown> = turns.into_iter().collect();
    let mut names: Vec<String> = Vec::new();
    for b in &turns {
        for (n, _) in b.iter() {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    let mut out: Vec<StageSummary> = names
        .into_iter()
        .map(|stage| {
            let per_turn: Vec<f64> = turns
                .iter()
                .map(|b| b.iter().filter(|(n, _)| *n == stage).fold(0.0, |a, (_, v)| a + v))
                .collect();
            let total_ms = per_turn.iter().sum();
            StageSummary {
                turns: per_turn.iter().filter(|v| **v > 0.0).count(),
                ms: Summary::of(&per_turn),
                total_ms,
                share: 0.0,
                stage,
            }
        })
        .collect();
    let all: f64 = out.iter().map(|s| s.total_ms).sum();
    for s in &mut out {
        s.share = if all > 0.0 { s.total_ms / all } else { 0.0 };
    }
    out.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    out
}

/// Times the consecutive stages of one operation: each [`StageClock::mark`] closes the stage
/// that ran since the previous mark (or the start). Stages timed elsewhere (one of two that
/// ran side by side) are added with [`StageClock::add`]; [`StageClock::restart`] moves the
/// clock past time already accounted for that way.
#[derive(Debug, Clone)]
pub struct StageClock {
    at: std::time::Instant,
    done: Vec<(String, f64)>,
}

impl StageClock {
    /// A clock whose first stage began at `at`.
    pub fn starting(at: std::time::Instant) -> Self {
        StageClock { at, done: Vec::new() }
    }

    /// Close the stage that ran since the last mark, naming it `stage`.
    pub fn mark(&mut self, stage: &str) {
        let now = std::time::Instant::now();
        self.done.push((stage.to_owned(), now.duration_since(self.at).as_secs_f64() * 1e3));
        self.at = now;
    }

    /// Record a stage timed elsewhere, in ms, without moving the clock.
    pub fn add(&mut self, stage: impl Into<String>, ms: f64) {
        self.done.push((stage.into(), ms));
    }

    /// Let the next stage begin now (the time since the last mark is not recorded).
    pub fn restart(&mut self) {
        self.at = std::time::Instant::now();
    }

    /// The stages, in order: (name, ms).
    pub fn into_stages(self) -> Vec<(String, f64)> {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[(&str, f64)]) -> Breakdown {
        v.iter().map(|(n, ms)| (n.to_string(), *ms)).collect()
    }

    #[test]
    fn stages_are_summarized_over_all_turns() {
        let turns = vec![
            b(&[("criu_dump", 30.0), ("syncfs", 10.0)]),
            b(&[("syncfs", 2.0), ("convlog_write", 1.0)]),
            b(&[("convlog_write", 1.0)]),
            b(&[]),
        ];
        let s = stage_summaries(&turns);
        let names: Vec<&str> = s.iter().map(|x| x.stage.as_str()).collect();
        assert_eq!(names, ["criu_dump", "syncfs", "convlog_write"], "largest total first");
        let dump = &s[0];
        assert_eq!((dump.turns, dump.ms.n), (1, 4), "a turn without the stage counts 0");
        assert_eq!(dump.ms.p50, 0.0);
        assert_eq!(dump.ms.max, 30.0);
        assert_eq!(s[1].total_ms, 12.0);
        assert_eq!((s[1].ms.p50, s[1].ms.p95), (0.0, 10.0));
        assert!(s[1].ms.p50.is_sign_positive(), "no -0.0 in reports");
        let share: f64 = s.iter().map(|x| x.share).sum();
        assert!((share - 1.0).abs() < 1e-9);
        assert!((s[0].share - 30.0 / 44.0).abs() < 1e-9);
        assert!(stage_summaries(&Vec::new()).is_empty());
    }

    #[test]
    fn breakdown_header_round_trips() {
        let x = b(&[("queue", 1.25), ("criu_dump", 30.0)]);
        let h = breakdown_header(&x);
        assert_eq!(h, "queue=1.250,criu_dump=30.000");
        assert_eq!(parse_breakdown(&h), x);
        assert_eq!(parse_breakdown("a=1,bogus,b=x,c=NaN, d=2"), b(&[("a", 1.0), ("d", 2.0)]));
        assert!(parse_breakdown("").is_empty());
    }

    /// |got - want| within the histogram's resolution (1/2048 of the value + 0.5 µs).
    fn close(got: f64, want: f64) -> bool {
        (got - want).abs() <= want.abs() / 2048.0 + 0.0005 + 1e-12
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert!(close(s.p50, 50.0) && close(s.p95, 95.0) && close(s.p99, 99.0), "{s:?}");
        assert_eq!((s.n, s.min, s.max, s.mean), (100, 1.0, 100.0, 50.5), "exact");
        assert_eq!(Summary::of(&[3.0]).p99, 3.0, "clamped into [min, max]");
        let e = Summary::of(&[]);
        assert!(e.n == 0 && e.p50.is_nan() && e.mean.is_nan() && e.max.is_nan());
    }

    #[test]
    fn below_two_milliseconds_percentiles_are_exact_to_the_microsecond() {
        // 0.001, 0.002, ..., 2.000 ms.
        let v: Vec<f64> = (1..=2000).map(|i| f64::from(i) / 1e3).collect();
        let s = Summary::of(&v);
        assert_eq!((s.p50, s.p95, s.p99), (1.0, 1.9, 1.98));
        assert_eq!(Summary::of(&[0.0004, 0.0006, 1.0]).p50, 0.001, "rounded to the nearest µs");
    }

    #[test]
    fn above_two_milliseconds_a_percentile_is_its_bucket_midpoint() {
        // 123.456 ms falls in a 64 µs bucket [123.456, 123.520): its midpoint is reported.
        let s = Summary::of(&[123.456, 500.0]);
        assert_eq!(s.p50, 123.488);
        assert!(close(s.p50, 123.456));
    }

    #[test]
    fn a_heavy_tail_is_seen_at_p99() {
        let mut v = vec![1.0; 980];
        v.extend([1000.0; 20]);
        let s = Summary::of(&v);
        assert_eq!((s.p50, s.p95), (1.0, 1.0));
        assert_eq!(s.p99, 1000.0);
        assert!(close(s.mean, (980.0 + 20_000.0) / 1000.0));
    }

    #[test]
    fn percentiles_match_exact_nearest_rank_within_resolution() {
        // An exponential distribution (mean 10 ms) by its quantile function, shuffled.
        let n = 10_000;
        let mut v: Vec<f64> =
            (0..n).map(|i| -10.0 * (1.0 - (f64::from(i) + 0.5) / f64::from(n)).ln()).collect();
        v.reverse();
        v.rotate_left(3_333);
        let mut sorted = v.clone();
        sorted.sort_by(f64::total_cmp);
        let s = Summary::of(&v);
        for (got, q) in [(s.p50, 0.5), (s.p95, 0.95), (s.p99, 0.99)] {
            let want = percentile(&sorted, q);
            assert!(close(got, want), "q {q}: {got} vs exact {want}");
        }
        // And the distribution's own quantiles (10 ln 2, 10 ln 100) to within the sampling's 0.2 %.
        assert!((s.p50 / (10.0 * 2f64.ln()) - 1.0).abs() < 2e-3, "{}", s.p50);
        assert!((s.p99 / (10.0 * 100f64.ln()) - 1.0).abs() < 2e-3, "{}", s.p99);
    }

    #[test]
    fn negative_and_non_finite_samples() {
        let s = Summary::of(&[-2.0, 4.0, f64::NAN, f64::INFINITY]);
        assert_eq!((s.n, s.min, s.max, s.mean), (2, -2.0, 4.0, 1.0));
        assert_eq!(s.p50, 0.0, "a negative latency is recorded as 0");
    }

    #[test]
    fn cdf_steps_through_every_bucket() {
        let l = Latencies::of(&[0.2, 0.1, 0.4, 0.3, 0.4]);
        assert_eq!(l.cdf(), vec![[0.1, 0.2], [0.2, 0.4], [0.3, 0.6], [0.4, 1.0]]);
        // Above 2.048 ms a point is its bucket's midpoint: 3 ms is in [3.000, 3.001].
        assert_eq!(Latencies::of(&[1.0, 3.0, 5.0]).cdf()[1], [3.001, 2.0 / 3.0]);
        assert!(Latencies::new().cdf().is_empty());
        let big = Latencies::of(&(1..=10_000).map(f64::from).collect::<Vec<_>>());
        let cdf = big.cdf();
        assert!(cdf.windows(2).all(|w| w[0][0] < w[1][0] && w[0][1] < w[1][1]));
        assert_eq!(cdf.last().map(|p| p[1]), Some(1.0));
        assert!(cdf.len() < 10_000, "samples share buckets above 2 ms: {}", cdf.len());
    }

    #[test]
    fn medians_of_ratios_are_exact() {
        assert_eq!(median(&[1.013, -0.5, 1.02]), 1.013);
        assert_eq!(median(&[2.0, 1.0]), 1.0, "nearest rank");
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn stage_clock_marks_consecutive_stages_and_adds_outside_ones() {
        let t0 = std::time::Instant::now() - std::time::Duration::from_millis(20);
        let mut c = StageClock::starting(t0);
        c.mark("first");
        c.add("beside", 7.5);
        std::thread::sleep(std::time::Duration::from_millis(200));
        c.restart();
        c.mark("second");
        let st = c.into_stages();
        let names: Vec<&str> = st.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["first", "beside", "second"]);
        assert!(st[0].1 >= 20.0, "{st:?}");
        assert_eq!(st[1].1, 7.5);
        assert!(st[2].1 < 200.0, "restart skips the time before it: {st:?}");
    }
}
