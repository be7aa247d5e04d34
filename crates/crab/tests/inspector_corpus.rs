//! The inspector's accuracy corpus (`tests/corpus/turns.txt`), replayed in real sandboxes
//! through the real daemon: every case must get a verdict that includes what it changed (zero
//! false negatives); verdicts that include more are false positives, counted and printed.
//!
//! Runs without the libtest harness so its report is printed even when it passes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crab_testkit::daemon as common;

use std::time::Duration;

use common::{crab, crab_ok, Sandbox};

#[derive(Debug, Default, Clone)]
struct Case {
    name: String,
    expect: String,
    settle: f64,
    setup: String,
    turn: String,
    /// Run in a `--privileged` sandbox (a turn whose syscalls the default profile refuses).
    privileged: bool,
}

fn parse(text: &str) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut cur: Option<Case> = None;
    let mut section = "";
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("=== ") {
            cases.extend(cur.take());
            cur = Some(Case { name: name.trim().to_string(), ..Default::default() });
            section = "";
            continue;
        }
        let Some(c) = cur.as_mut() else { continue };
        match line {
            "--- setup" => section = "setup",
            "--- turn" => section = "turn",
            _ if section.is_empty() => {
                if let Some(v) = line.strip_prefix("expect:") {
                    c.expect = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("settle:") {
                    c.settle = v.trim().parse().unwrap();
                } else if let Some(v) = line.strip_prefix("privileged:") {
                    c.privileged = v.trim() == "yes";
                }
            }
            _ => {
                let buf = if section == "setup" { &mut c.setup } else { &mut c.turn };
                buf.push_str(line);
                buf.push('\n');
            }
        }
    }
    cases.extend(cur);
    cases
}

fn parts(kind: &str) -> (bool, bool) {
    match kind {
        "skip" => (false, false),
        "fs" => (true, false),
        "process" => (false, true),
        "full" => (true, true),
        other => panic!("unknown verdict kind {other:?}"),
    }
}

fn close_turn(sb: &Sandbox) -> serde_json::Value {
    serde_json::from_str(&crab_ok(&["inspect", &sb.name, "--close", "--json"])).unwrap()
}

fn main() {
    let cases = parse(include_str!("corpus/turns.txt"));
    assert!(cases.len() >= 60, "the corpus must have at least 60 cases, has {}", cases.len());
    common::ensure_daemon();
    let (mut fneg, mut fpos, mut exact) = (Vec::new(), Vec::new(), 0);
    println!("{:<48} {:<8} {:<8} reasons", "case", "expect", "verdict");
    for c in &cases {
        let sb = if c.privileged {
            Sandbox::with_args("t-corpus", &["--privileged"])
        } else {
            Sandbox::new("t-corpus")
        };
        if !c.setup.is_empty() {
            let (o, e, code) = sb.sh(&c.setup);
            assert_eq!(code, 0, "setup of {:?} failed: {o}{e}", c.name);
        }
        std::thread::sleep(Duration::from_secs_f64(c.settle));
        close_turn(&sb);
        let out = crab(&["exec", &sb.name, "--", "sh", "-c", &c.turn]);
        assert_ne!(out.status.code(), Some(125), "turn of {:?} could not run: {out:?}", c.name);
        let v = close_turn(&sb);
        let kind = v["kind"].as_str().unwrap().to_string();
        let (ef, ep) = parts(&c.expect);
        let (af, ap) = parts(&kind);
        let reasons = v["reasons"].as_array().map(|r| r.len()).unwrap_or(0);
        let first_reason = v["reasons"].get(0).and_then(|r| r.as_str()).unwrap_or("").to_string();
        println!("{:<48} {:<8} {:<8} {reasons} {first_reason}", c.name, c.expect, kind);
        if (ef && !af) || (ep && !ap) {
            fneg.push(format!("{}: expected {}, got {kind}: {v}", c.name, c.expect));
        } else if kind != c.expect {
            fpos.push(c.name.clone());
        } else {
            exact += 1;
        }
    }
    let negatives = cases.iter().filter(|c| c.expect != "full").count();
    println!(
        "\ninspector corpus: {} cases, {exact} exact, {} false positives ({:.1} % of the {negatives} cases that could have one), {} false negatives",
        cases.len(),
        fpos.len(),
        100.0 * fpos.len() as f64 / negatives.max(1) as f64,
        fneg.len()
    );
    for f in &fpos {
        println!("  false positive: {f}");
    }
    if !fneg.is_empty() {
        for f in &fneg {
            println!("  FALSE NEGATIVE: {f}");
        }
        println!("1 failed, 0 passed");
        std::process::exit(1);
    }
    println!("1 passed, 0 failed");
}
