//! Runs the proxy benchmark and prints its JSON report:
//! `cargo run --release -p crab-coordinator --example bench_proxy [iterations] [log_dir]`.

use crab_coordinator::bench::{bench_proxy, ProxyBenchOptions};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut opts = ProxyBenchOptions::default();
    if let Some(n) = args.next() {
        opts.iterations = n.parse()?;
    }
    opts.log_dir = args.next().map(Into::into);
    let report = bench_proxy(opts).await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
