//! `crab-nsexec`: the namespace helpers alone (`__start-sandbox SPEC`, `__nsexec SPEC`), in a
//! binary a fraction of `crab`'s size.
//!
//! The daemon starts one helper per sandbox start and per exec; `crab` itself is a 140 MB
//! binary whose dynamic relocations and libraries cost milliseconds at every start. When this
//! binary sits next to `crab` (the same directory, as `cargo build` and the install put it), the
//! daemon runs the helpers with it; otherwise with `crab` itself, which still understands the
//! same verbs.

#[path = "../helpers.rs"]
mod helpers;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    helpers::dispatch(&args).unwrap_or_else(|| {
        eprintln!(
            "crab-nsexec: crab's namespace helper, started by `crab daemon` with `__start-sandbox SPEC` or `__nsexec SPEC`; run `crab` instead"
        );
        ExitCode::from(2)
    })
}
