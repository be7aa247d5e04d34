//! The proxy and turn benchmarks run (tiny sizes): their reports have the shape the CLI prints.
#![allow(clippy::unwrap_used)]

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_runs() {
    let rep = crab_bench::proxy::bench_proxy(crab_bench::proxy::ProxyBenchOptions {
        iterations: 60,
        warmup: 10,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(rep.direct.n, 60);
    assert_eq!(rep.boundaries, 70);
    assert!(rep.proxied.p50 > 0.0 && rep.direct.p50 > 0.0);
    if std::env::var_os("CRAB_PRINT_BENCH").is_some() {
        println!("{}", serde_json::to_string_pretty(&rep).unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_turn_benchmark_runs() {
    use crab_bench::proxy::{bench_turns, TurnBenchOptions};
    let rep = bench_turns(TurnBenchOptions {
        sandboxes: 4,
        turns: 3,
        llm_latency_ms: vec![1000.0, 3000.0],
        time_scale: 0.05,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(rep.exposed.n, 12);
    assert_eq!(rep.verdicts.iter().sum::<u64>(), 12);
}
