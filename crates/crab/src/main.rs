//! The `crab` binary: command-line client, `crab daemon`, and the hidden namespace helpers.
//!
//! The helpers (`__start-sandbox`, `__nsexec`) are dispatched first, before any thread or async
//! runtime exists, because they unshare namespaces and fork. Everything else is the CLI, a thin
//! client of the daemon's API (see `client`), or the daemon itself (see `daemon`).

mod cli;
mod daemon;
mod output;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("__start-sandbox") => return helper_start(&args),
        Some("__nsexec") => return helper_exec(&args),
        _ => {}
    }
    cli::main()
}

fn helper_spec<T: serde::de::DeserializeOwned>(args: &[String]) -> Result<T, String> {
    let json = args.get(2).ok_or("missing spec argument")?;
    serde_json::from_str(json).map_err(|e| format!("bad spec: {e}"))
}

/// `crab __start-sandbox SPEC`: prints the init's host pid.
fn helper_start(args: &[String]) -> ExitCode {
    let res = helper_spec(args).and_then(|s| crab_sandbox::spawn::start_sandbox(&s));
    match res {
        Ok(pid) => {
            println!("{pid}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `crab __nsexec SPEC`: runs the command and exits with its code.
fn helper_exec(args: &[String]) -> ExitCode {
    match helper_spec(args).and_then(|s| crab_sandbox::spawn::exec_in_sandbox(&s)) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("crab: {e}");
            ExitCode::from(crab_sandbox::exec::HELPER_FAILURE as u8)
        }
    }
}
