//! Everything the CLI draws: tables, human sizes and ages, error sentences, progress (bars by
//! `indicatif`). Only this module (and the CLI) print; libraries report progress through
//! [`crab_common::Progress`] and this module draws it.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;

use crab_common::api::ProgressFrame;
use crab_common::{ApiError, Progress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Print an error as one sentence plus the fix.
pub fn print_error(e: &ApiError) {
    eprintln!("error: {}", e.message);
    if !e.hint.is_empty() {
        eprintln!("hint: {}", e.hint);
    }
}

/// `1.2 GiB`-style sizes.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// `3m`, `2h`-style age of a unix timestamp.
pub fn age(created_at: u64) -> String {
    let now = crab_common::clock::now_s();
    let s = now.saturating_sub(created_at);
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// Print rows as an aligned table with a header.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.len());
            }
        }
    }
    let fmt = |cells: Vec<String>| {
        let mut line = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                line.push_str(c);
            } else {
                line.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        line
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", fmt(header.iter().map(|s| s.to_string()).collect()));
    for r in rows {
        let _ = writeln!(out, "{}", fmt(r.clone()));
    }
}

/// Draws progress ([`ProgressFrame`]s from the daemon, or a library's [`Progress`] calls) on
/// stderr. On a terminal: a `==> stage` line per stage, then an `indicatif` bar (a spinner when
/// the stage has no total) with the latest message beside it. When stderr is not a terminal the
/// bar's draw target is hidden and plain lines are written instead: one per stage, one per new
/// kind of message, the count at each tenth of the total. Under `--json` nothing is drawn.
#[derive(Debug)]
pub struct ProgressDrawer {
    mode: DrawMode,
    state: Mutex<DrawState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrawMode {
    /// `--json`: nothing on stderr.
    Quiet,
    /// Not a terminal: lines, no bar.
    Lines,
    /// A terminal: the indicatif bar.
    Bar,
}

#[derive(Debug, Default)]
struct DrawState {
    /// The current stage's bar (hidden draw target unless [`DrawMode::Bar`]).
    bar: Option<ProgressBar>,
    last_verb: String,
    total: Option<u64>,
    /// Last tenth of the total printed ([`DrawMode::Lines`]).
    tenth: u64,
}

/// The bar of a stage of `total` units (a spinner when unknown), drawn on stderr or nowhere.
fn stage_bar(total: Option<u64>, visible: bool) -> ProgressBar {
    let target = if visible { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let style = stage_style(total.is_some()).unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::with_draw_target(total, target).with_style(style)
}

/// `[#####.....] 5/10 message` with a total, `⠁ message` without.
fn stage_style(has_total: bool) -> Result<ProgressStyle, indicatif::style::TemplateError> {
    let template = if has_total {
        "    [{bar:30}] {pos}/{len} {wide_msg}"
    } else {
        "    {spinner} {wide_msg}"
    };
    Ok(ProgressStyle::with_template(template)?.progress_chars("##."))
}

impl ProgressDrawer {
    /// A drawer for stderr; `quiet` (`--json`) draws nothing.
    pub fn new(quiet: bool) -> Self {
        let mode = if quiet {
            DrawMode::Quiet
        } else if std::io::stderr().is_terminal() {
            DrawMode::Bar
        } else {
            DrawMode::Lines
        };
        ProgressDrawer { mode, state: Mutex::new(DrawState::default()) }
    }

    /// Draw one frame.
    pub fn draw(&self, f: &ProgressFrame) {
        if self.mode == DrawMode::Quiet {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let lines = self.mode == DrawMode::Lines;
        match f {
            ProgressFrame::Stage { name, total } => {
                if let Some(b) = st.bar.take() {
                    b.finish_and_clear();
                }
                eprintln!("==> {name}");
                *st = DrawState {
                    bar: Some(stage_bar(*total, self.mode == DrawMode::Bar)),
                    total: *total,
                    ..Default::default()
                };
            }
            ProgressFrame::Message { line } => {
                if lines {
                    let verb = line.split_whitespace().next().unwrap_or("").to_string();
                    if verb != st.last_verb {
                        eprintln!("    {line}");
                        st.last_verb = verb;
                    }
                } else {
                    let bar = st.bar.get_or_insert_with(|| stage_bar(None, true));
                    let mut l = line.clone();
                    l.truncate(l.floor_char_boundary(100));
                    bar.set_message(l);
                }
            }
            ProgressFrame::Advance { done } => {
                if let Some(b) = &st.bar {
                    b.set_position(*done);
                }
                if let (true, Some(total)) = (lines, st.total) {
                    let tenth = (done * 10).checked_div(total).unwrap_or(10);
                    if tenth > st.tenth {
                        st.tenth = tenth;
                        eprintln!("    {done}/{total}");
                    }
                }
            }
            ProgressFrame::Done { .. } | ProgressFrame::Error { .. } => {
                if let Some(b) = st.bar.take() {
                    b.finish_and_clear();
                }
            }
        }
    }
}

/// A library's long operation draws through the same drawer (`crab bench replay`, `remote`).
impl Progress for ProgressDrawer {
    fn stage(&self, name: &str, total: Option<u64>) {
        self.draw(&ProgressFrame::Stage { name: name.to_string(), total });
    }
    fn advance(&self, done: u64) {
        self.draw(&ProgressFrame::Advance { done });
    }
    fn message(&self, line: &str) {
        self.draw(&ProgressFrame::Message { line: line.to_string() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_and_hidden_drawers_draw_no_bar() {
        let d = ProgressDrawer::new(true);
        d.stage("snapshot", Some(10));
        d.advance(5);
        assert!(d.state.lock().unwrap().bar.is_none(), "--json: no bar at all");
        let d = ProgressDrawer { mode: DrawMode::Lines, state: Mutex::new(DrawState::default()) };
        d.stage("snapshot", Some(10));
        d.advance(5);
        d.message("unpacking x");
        let st = d.state.lock().unwrap();
        let bar = st.bar.as_ref().unwrap();
        assert!(bar.is_hidden(), "not a terminal: hidden draw target");
        assert_eq!((bar.position(), bar.length(), st.tenth), (5, Some(10), 5));
        drop(st);
        d.draw(&ProgressFrame::Done { result: serde_json::Value::Null });
        assert!(d.state.lock().unwrap().bar.is_none());
        assert!(stage_style(true).is_ok() && stage_style(false).is_ok(), "templates parse");
    }
}
