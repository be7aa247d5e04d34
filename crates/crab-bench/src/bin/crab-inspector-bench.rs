//! `crab-inspector-bench`: measures the inspector's costs side by side in one run (root only).
//!
//! 1. Syscall overhead: a loop of 200k small `write(2)`s plus 20k create+unlink, run
//!    (a) outside any sandbox and (b) inside a cgroup, without the BPF programs loaded, then
//!    with them loaded: outside, inside an unregistered cgroup, inside a registered (attached)
//!    cgroup. Repeated for several rounds (load/unload each round), medians and ratios printed.
//! 2. Verdict latency: 64 registered sandboxes, each with an open turn of ~20 file changes;
//!    p50/p95/p99 of `take()` (and `peek()`) on one sandbox after a small turn.
//!
//! Usage: `cargo run --release -p crab-bench --bin crab-inspector-bench [-- --rounds N]`.
//! The same binary is its own workload: `--loop DIR CGROUP_PROCS|-` runs the syscall loop and
//! prints `write_ns create_ns`; `--touch DIR PREFIX N CGROUP_PROCS` creates N files.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use crab_inspector::Inspector;

const WRITES: usize = 200_000;
const CREATES: usize = 20_000;
const SANDBOXES: usize = 64;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("--loop") => child_loop(&args[2..]),
        Some("--touch") => child_touch(&args[2..]),
        Some("--hold") => hold(&args[2..]),
        _ => {
            let rounds = args
                .iter()
                .position(|a| a == "--rounds")
                .and_then(|i| args.get(i + 1))
                .and_then(|s| s.parse().ok())
                .unwrap_or(3);
            run(rounds)
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crab-inspector-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res<T> = Result<T, String>;

fn enter_cgroup(procs: &str) -> Res<()> {
    if procs != "-" {
        fs::write(procs, format!("{}\n", std::process::id()))
            .map_err(|e| format!("write {procs}: {e}"))?;
    }
    Ok(())
}

/// CPU time (user + system) of the calling thread, in ns: less disturbed by other load on the
/// host than wall time, and it includes the BPF programs' time (charged as system time).
fn cpu_ns() -> u128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to the valid pointer given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128
}

/// The workload: 200k 16-byte writes to one file, then 20k create+close+unlink.
fn child_loop(a: &[String]) -> Res<()> {
    let dir = PathBuf::from(a.first().ok_or("--loop DIR PROCS")?);
    enter_cgroup(a.get(1).ok_or("--loop DIR PROCS")?)?;
    let f = fs::File::create(dir.join("w.dat")).map_err(|e| e.to_string())?;
    let buf = [7u8; 16];
    let c0 = cpu_ns();
    let t0 = Instant::now();
    for _ in 0..WRITES {
        use std::os::unix::fs::FileExt as _;
        // pwrite keeps the file small; both are hooked the same way
        f.write_at(&buf, 0).map_err(|e| e.to_string())?;
    }
    let w = t0.elapsed();
    let c1 = cpu_ns();
    let t1 = Instant::now();
    for i in 0..CREATES {
        let p = dir.join(format!("c{}", i % 64));
        fs::File::create(&p).map_err(|e| e.to_string())?;
        fs::remove_file(&p).map_err(|e| e.to_string())?;
    }
    let c = t1.elapsed();
    let c2 = cpu_ns();
    drop(f);
    let _ = fs::remove_file(dir.join("w.dat"));
    println!("{} {} {} {}", w.as_nanos(), c.as_nanos(), c1 - c0, c2 - c1);
    Ok(())
}

fn child_touch(a: &[String]) -> Res<()> {
    let dir = PathBuf::from(a.first().ok_or("--touch DIR PREFIX N PROCS")?);
    let prefix = a.get(1).ok_or("prefix")?;
    let n: usize = a.get(2).and_then(|s| s.parse().ok()).ok_or("n")?;
    enter_cgroup(a.get(3).ok_or("procs")?)?;
    for i in 0..n {
        let mut f =
            fs::File::create(dir.join(format!("{prefix}{i}"))).map_err(|e| e.to_string())?;
        f.write_all(b"x").map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Loads the programs, attaches `--hold SECS CGROUP_DIR...` and waits (for profiling).
fn hold(a: &[String]) -> Res<()> {
    let secs: u64 = a.first().and_then(|s| s.parse().ok()).ok_or("--hold SECS [CGROUP_DIR...]")?;
    let insp = Inspector::load().map_err(|e| e.to_string())?;
    for (i, d) in a.iter().skip(1).enumerate() {
        insp.attach(&format!("h{i}"), Path::new(d)).map_err(|e| e.to_string())?;
    }
    eprintln!("loaded {} programs; holding {secs} s", insp.programs());
    std::thread::sleep(Duration::from_secs(secs));
    for (i, _) in a.iter().skip(1).enumerate() {
        if let Ok(v) = insp.peek(&format!("h{i}")) {
            println!("{}", serde_json::to_string(&v).unwrap_or_default());
        }
    }
    Ok(())
}

fn me() -> Res<PathBuf> {
    std::env::current_exe().map_err(|e| e.to_string())
}

/// (wall writes, wall creates, cpu writes, cpu creates) in ms.
fn loop_once(dir: &Path, procs: Option<&Path>) -> Res<[f64; 4]> {
    let procs = procs.map(|p| p.display().to_string()).unwrap_or_else(|| "-".into());
    let out = Command::new(me()?)
        .arg("--loop")
        .arg(dir)
        .arg(&procs)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("loop failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let s = String::from_utf8_lossy(&out.stdout);
    let mut it = s.split_whitespace().map(|x| x.parse::<f64>().unwrap_or(0.0) / 1e6);
    let mut o = [0.0; 4];
    for v in &mut o {
        *v = it.next().unwrap_or(0.0);
    }
    Ok(o)
}

fn touch(dir: &Path, prefix: &str, n: usize, procs: &Path) -> Res<()> {
    let st = Command::new(me()?)
        .arg("--touch")
        .arg(dir)
        .arg(prefix)
        .arg(n.to_string())
        .arg(procs)
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err("touch child failed".into());
    }
    Ok(())
}

fn cg_root() -> PathBuf {
    if Path::new("/sys/fs/cgroup/unified/cgroup.procs").exists() {
        PathBuf::from("/sys/fs/cgroup/unified")
    } else {
        PathBuf::from("/sys/fs/cgroup")
    }
}

struct Cgroups {
    root: PathBuf,
    groups: Vec<PathBuf>,
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for g in &self.groups {
            let _ = fs::write(g.join("cgroup.kill"), "1");
        }
        std::thread::sleep(Duration::from_millis(50));
        for g in &self.groups {
            let _ = fs::remove_dir(g);
        }
        let _ = fs::remove_dir(&self.root);
    }
}

#[derive(Default)]
struct Series {
    runs: Vec<[f64; 4]>,
}

impl Series {
    fn push(&mut self, r: [f64; 4]) {
        self.runs.push(r);
    }
    /// Medians (or minima) of (writes, creates, total) for wall or CPU time.
    fn med(&self, cpu: bool, min: bool) -> (f64, f64, f64) {
        let o = if cpu { 2 } else { 0 };
        let pick = |v: Vec<f64>| {
            if min {
                v.iter().copied().fold(f64::INFINITY, f64::min)
            } else {
                crab_bench::stats::median(&v)
            }
        };
        let w: Vec<f64> = self.runs.iter().map(|r| r[o]).collect();
        let c: Vec<f64> = self.runs.iter().map(|r| r[o + 1]).collect();
        let t: Vec<f64> = self.runs.iter().map(|r| r[o] + r[o + 1]).collect();
        (pick(w), pick(c), pick(t))
    }
}

fn run(rounds: usize) -> Res<()> {
    let root = cg_root().join(format!("crab-bench-{}", std::process::id()));
    fs::create_dir(&root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
    let mut cgs = Cgroups { root: root.clone(), groups: Vec::new() };
    for i in 0..=SANDBOXES {
        let g = root.join(format!("sb{i}"));
        fs::create_dir(&g).map_err(|e| format!("mkdir {}: {e}", g.display()))?;
        cgs.groups.push(g);
    }
    // sb0..sb63 are registered; sb64 stays unregistered
    let unreg = cgs.groups[SANDBOXES].join("cgroup.procs");
    let attached = cgs.groups[0].join("cgroup.procs");
    let work = std::env::temp_dir().join(format!("crab-bench-{}", std::process::id()));
    fs::create_dir_all(&work).map_err(|e| format!("mkdir {}: {e}", work.display()))?;
    let dir = work.as_path();

    let mut out_nobpf = Series::default();
    let mut in_nobpf = Series::default();
    let mut out_bpf = Series::default();
    let mut in_unreg = Series::default();
    let mut in_att = Series::default();
    let mut load_ms = Vec::new();
    let mut take_ms = Vec::new();
    let mut peek_ms = Vec::new();
    let mut empty_take_ms = Vec::new();
    let mut prog_time = Vec::new();

    // warm-up (page cache, binary)
    loop_once(dir, None)?;
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        out_nobpf.push(loop_once(dir, None)?);
        in_nobpf.push(loop_once(dir, Some(&unreg))?);
        let t = Instant::now();
        let insp = Inspector::load().map_err(|e| e.to_string())?;
        load_ms.push(t.elapsed().as_secs_f64() * 1e3);
        for (i, g) in cgs.groups.iter().take(SANDBOXES).enumerate() {
            insp.attach(&format!("sb{i}"), g).map_err(|e| e.to_string())?;
        }
        out_bpf.push(loop_once(dir, None)?);
        in_unreg.push(loop_once(dir, Some(&unreg))?);
        insp.take("sb0").map_err(|e| e.to_string())?;
        in_att.push(loop_once(dir, Some(&attached))?);
        let v = insp.take("sb0").map_err(|e| e.to_string())?;
        if v.kind != crab_common::CheckpointKind::Fs {
            eprintln!("note: loop turn verdict {:?} ({} changes)", v.kind, v.changeset.len());
        }
        if round + 1 == rounds {
            verdict_latency(&insp, &cgs, dir, &mut take_ms, &mut peek_ms, &mut empty_take_ms)?;
            prog_time = program_time(&insp, dir, &unreg, &attached)?;
        }
        for i in 0..SANDBOXES {
            insp.detach(&format!("sb{i}"));
        }
        drop(insp);
    }

    println!();
    println!(
        "syscall loop: {WRITES} x 16-byte pwrite + {CREATES} x (create, close, unlink); medians of {rounds} rounds, ms"
    );
    for (cpu, min) in [(true, true), (true, false), (false, false)] {
        let (ow, oc, ot) = out_nobpf.med(cpu, min);
        let (iw, ic, it) = in_nobpf.med(cpu, min);
        let (bw, bc, bt) = out_bpf.med(cpu, min);
        let (uw, uc, ut) = in_unreg.med(cpu, min);
        let (aw, ac, at) = in_att.med(cpu, min);
        println!();
        println!(
            "{:<44} {:>9} {:>12} {:>9} {:>8}",
            match (cpu, min) {
                (true, true) => "CPU time (user+sys), minimum of rounds",
                (true, false) => "CPU time (user+sys), median of rounds",
                _ => "wall time, median of rounds",
            },
            "writes",
            "create+unl",
            "total",
            "ratio"
        );
        let row = |name: &str, w: f64, c: f64, t: f64, base: f64| {
            println!("{name:<44} {w:>9.1} {c:>12.1} {t:>9.1} {:>7.3}x", t / base);
        };
        row("outside any sandbox, programs not loaded", ow, oc, ot, ot);
        row("outside any sandbox, programs loaded", bw, bc, bt, ot);
        row("in a cgroup, programs not loaded", iw, ic, it, it);
        row("in an unregistered cgroup, programs loaded", uw, uc, ut, it);
        row("in a registered cgroup (attached)", aw, ac, at, it);
        println!(
            "per-op cost: outside+loaded: write {:+.3} us, create+unlink {:+.2} us; attached: write {:+.3} us, create+unlink {:+.2} us",
            (bw - ow) * 1e3 / WRITES as f64,
            (bc - oc) * 1e3 / CREATES as f64,
            (aw - iw) * 1e3 / WRITES as f64,
            (ac - ic) * 1e3 / CREATES as f64
        );
    }
    println!("load+attach of the BPF object: median {:.0} ms", crab_bench::stats::median(&load_ms));
    println!();
    println!("BPF program time per run (kernel.bpf_stats_enabled, one loop each):");
    for l in &prog_time {
        println!("  {l}");
    }
    let n = take_ms.len();
    let (take, peek, empty_take) = (
        crab_bench::stats::Summary::of(&take_ms),
        crab_bench::stats::Summary::of(&peek_ms),
        crab_bench::stats::Summary::of(&empty_take_ms),
    );
    println!();
    println!("verdict latency, {SANDBOXES} sandboxes registered, each with an open turn of ~20 changes ({n} samples):");
    println!(
        "  take() after a 20-file turn: p50 {:.3} ms  p95 {:.3} ms  p99 {:.3} ms",
        take.p50, take.p95, take.p99
    );
    println!("  peek() on an open 20-file turn: p50 {:.3} ms  p95 {:.3} ms", peek.p50, peek.p95);
    println!(
        "  take() of an empty turn: p50 {:.3} ms  p95 {:.3} ms",
        empty_take.p50, empty_take.p95
    );
    drop(cgs);
    let _ = fs::remove_dir_all(&work);
    Ok(())
}

/// Runs the loop with BPF run statistics on, outside and attached; returns report lines.
fn program_time(insp: &Inspector, dir: &Path, unreg: &Path, attached: &Path) -> Res<Vec<String>> {
    const KNOB: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let before = fs::read_to_string(KNOB).unwrap_or_else(|_| "0".into());
    fs::write(KNOB, "1").map_err(|e| format!("write {KNOB}: {e}"))?;
    let mut lines = Vec::new();
    let snap = || -> Res<Vec<(String, u64, u64)>> {
        Ok(insp
            .program_stats()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|p| (p.name, p.run_count, p.run_time_ns))
            .collect())
    };
    let cases: [(&str, Option<&Path>); 3] = [
        ("outside any sandbox", None),
        ("unregistered cgroup", Some(unreg)),
        ("attached", Some(attached)),
    ];
    for (label, procs) in cases {
        let a = snap()?;
        loop_once(dir, procs)?;
        let b = snap()?;
        let mut parts = Vec::new();
        for ((name, c0, t0), (_, c1, t1)) in a.iter().zip(&b) {
            let (dc, dt) = (c1 - c0, t1 - t0);
            if dc > 1000 {
                parts.push(format!("{name} {:.0} ns x {dc}", dt as f64 / dc as f64));
            }
        }
        lines.push(format!("{label}: {}", parts.join(", ")));
    }
    let _ = fs::write(KNOB, before.trim());
    if let Ok(v) = insp.take("sb0") {
        let _ = v;
    }
    Ok(lines)
}

fn verdict_latency(
    insp: &Inspector,
    cgs: &Cgroups,
    dir: &Path,
    take_ms: &mut Vec<f64>,
    peek_ms: &mut Vec<f64>,
    empty_ms: &mut Vec<f64>,
) -> Res<()> {
    // every sandbox gets an open turn with 20 created files
    for (i, g) in cgs.groups.iter().take(SANDBOXES).enumerate() {
        let d = dir.join(format!("v{i}"));
        fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        insp.take(&format!("sb{i}")).map_err(|e| e.to_string())?;
        touch(&d, "a", 20, &g.join("cgroup.procs"))?;
    }
    for it in 0..256 {
        let i = it % SANDBOXES;
        let name = format!("sb{i}");
        let t = Instant::now();
        let v = insp.peek(&name).map_err(|e| e.to_string())?;
        peek_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let v2 = insp.take(&name).map_err(|e| e.to_string())?;
        take_ms.push(t.elapsed().as_secs_f64() * 1e3);
        if v.changeset.len() != v2.changeset.len() || v2.changeset.len() < 20 {
            eprintln!("note: turn of {name} had {} changes", v2.changeset.len());
        }
        let t = Instant::now();
        insp.take(&name).map_err(|e| e.to_string())?;
        empty_ms.push(t.elapsed().as_secs_f64() * 1e3);
        // refill this sandbox's open turn
        let d = dir.join(format!("v{i}"));
        touch(&d, &format!("r{it}_"), 20, &cgs.groups[i].join("cgroup.procs"))?;
    }
    Ok(())
}
