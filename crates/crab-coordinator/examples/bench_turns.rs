//! Runs the turn benchmark and prints its JSON report:
//! `cargo run --release -p crab-coordinator --example bench_turns [traces_dir] [time_scale] [sandboxes] [turns]`.

use crab_coordinator::bench::{bench_turns, load_llm_latencies, TurnBenchOptions};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut opts = TurnBenchOptions::default();
    if let Some(dir) = args.next() {
        opts.llm_latency_ms = load_llm_latencies(dir.as_ref())?;
    }
    if let Some(s) = args.next() {
        opts.time_scale = s.parse()?;
    }
    if let Some(s) = args.next() {
        opts.sandboxes = s.parse()?;
    }
    if let Some(s) = args.next() {
        opts.turns = s.parse()?;
    }
    opts.fsync_log = std::env::var_os("NO_FSYNC").is_none();
    let report = bench_turns(opts).await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
