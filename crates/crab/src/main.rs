//! The `crab` binary: command-line client, `crab daemon`, and the hidden namespace helpers.
//!
//! The helpers (`__start-sandbox`, `__nsexec`, see `helpers`) are dispatched first, before any
//! thread or async runtime exists, because they unshare namespaces and fork. Everything else is
//! the CLI, a thin client of the daemon's API (see `client`), or the daemon itself (see
//! `daemon`).

mod cli;
mod daemon;
mod helpers;
mod output;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = helpers::dispatch(&args) {
        return code;
    }
    cli::main()
}
