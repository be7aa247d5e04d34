//! Everything the CLI draws: tables, human sizes and ages, error sentences, progress lines.
//! Only this module (and the CLI) print.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;

use crab_common::api::ProgressFrame;
use crab_common::ApiError;

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

/// Draws [`ProgressFrame`]s on stderr: one rewritten line on a terminal, a line per stage and
/// per new kind of message otherwise.
#[derive(Debug)]
pub struct ProgressDrawer {
    tty: bool,
    state: Mutex<DrawState>,
}

#[derive(Debug, Default)]
struct DrawState {
    last_verb: String,
    total: Option<u64>,
    /// Last tenth of the total printed (non-tty).
    tenth: u64,
}

fn bar(done: u64, total: u64) -> String {
    let width = 30;
    let filled = (done.min(total) * width as u64).checked_div(total).map_or(width, |f| f as usize);
    format!("[{}{}] {done}/{total}", "#".repeat(filled), ".".repeat(width - filled))
}

impl ProgressDrawer {
    /// A drawer for stderr.
    pub fn new() -> Self {
        ProgressDrawer {
            tty: std::io::stderr().is_terminal(),
            state: Mutex::new(DrawState::default()),
        }
    }

    /// Draw one frame.
    pub fn draw(&self, f: &ProgressFrame) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut err = std::io::stderr().lock();
        match f {
            ProgressFrame::Stage { name, total } => {
                if self.tty {
                    let _ = write!(err, "\r\x1b[2K");
                }
                let _ = writeln!(err, "==> {name}");
                *st = DrawState { total: *total, ..Default::default() };
            }
            ProgressFrame::Message { line } => {
                if self.tty {
                    let mut l = line.clone();
                    l.truncate(100);
                    let _ = write!(err, "\r\x1b[2K    {l}");
                } else {
                    let verb = line.split_whitespace().next().unwrap_or("").to_string();
                    if verb != st.last_verb {
                        let _ = writeln!(err, "    {line}");
                        st.last_verb = verb;
                    }
                }
            }
            ProgressFrame::Advance { done } => {
                if let Some(total) = st.total {
                    if self.tty {
                        let _ = write!(err, "\r\x1b[2K    {}", bar(*done, total));
                    } else {
                        let tenth = (done * 10).checked_div(total).unwrap_or(10);
                        if tenth > st.tenth {
                            st.tenth = tenth;
                            let _ = writeln!(err, "    {}", bar(*done, total));
                        }
                    }
                }
            }
            ProgressFrame::Done { .. } | ProgressFrame::Error { .. } => {
                if self.tty {
                    let _ = writeln!(err, "\r\x1b[2K");
                }
            }
        }
        let _ = err.flush();
    }
}
