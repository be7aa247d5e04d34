//! Percentile summaries of latency samples, shared by every benchmark (Crab's own and the
//! coordinator's), so that all reports compute percentiles the same way (nearest rank).

use serde::{Deserialize, Serialize};

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

/// Nearest-rank percentile of sorted samples (`q` in 0..=1).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Summary {
    /// Summarize samples (any order).
    pub fn of(samples: &[f64]) -> Summary {
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len();
        let mean = if n == 0 { f64::NAN } else { s.iter().sum::<f64>() / n as f64 };
        Summary {
            n,
            p50: percentile(&s, 0.5),
            p95: percentile(&s, 0.95),
            p99: percentile(&s, 0.99),
            mean,
            min: s.first().copied().unwrap_or(f64::NAN),
            max: s.last().copied().unwrap_or(f64::NAN),
        }
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

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!(s.p50, 50.0);
        assert_eq!(s.p95, 95.0);
        assert_eq!(s.p99, 99.0);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 100.0);
        assert_eq!(Summary::of(&[3.0]).p99, 3.0);
    }
}
