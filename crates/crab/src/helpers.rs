//! The hidden namespace helpers (`__start-sandbox --spec-fd N`, `__nsexec --spec-fd N`; or the
//! spec's JSON as the argument), shared by the `crab` binary and the small `crab-nsexec` binary
//! the daemon prefers for them. The daemon passes the spec on an inherited descriptor, a sealed memfd
//! (`crab_sandbox::specfd`), so no spec meets the kernel's argument limits.
//!
//! They are dispatched before any thread or async runtime exists, because they unshare
//! namespaces and fork (see `crab_sandbox::spawn`). Their output is a protocol with the daemon:
//! `__start-sandbox` prints the init's host pid on stdout; both print their own failure on
//! stderr, `__nsexec` exits with the command's status or `HELPER_FAILURE`. `__helper-abi` prints
//! the digest of the sources the helpers were built from (`crab_sandbox::spawn::HELPER_ABI`).

use std::process::ExitCode;

/// Run the helper `args[1]` names, or `None` when `args[1]` is not a helper verb.
pub fn dispatch(args: &[String]) -> Option<ExitCode> {
    match args.get(1).map(String::as_str) {
        Some("__start-sandbox") => Some(start(args)),
        Some("__nsexec") => Some(exec(args)),
        Some("__helper-abi") => {
            println!("{}", crab_sandbox::spawn::HELPER_ABI);
            Some(ExitCode::SUCCESS)
        }
        _ => None,
    }
}

/// The helper's spec: on a descriptor (`--spec-fd N`, as the daemon passes it) or the JSON
/// argument itself (`crab_sandbox::specfd`).
fn spec<T: serde::de::DeserializeOwned>(args: &[String]) -> Result<T, String> {
    crab_sandbox::specfd::read_spec(args.get(2..).unwrap_or_default())
}

/// `__start-sandbox SPEC`: prints the init's host pid.
fn start(args: &[String]) -> ExitCode {
    match spec(args).and_then(|s| crab_sandbox::spawn::start_sandbox(&s)) {
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

/// `__nsexec SPEC`: runs the command and exits with its code.
fn exec(args: &[String]) -> ExitCode {
    match spec(args).and_then(|s| crab_sandbox::spawn::exec_in_sandbox(&s)) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("crab: {e}");
            ExitCode::from(crab_sandbox::exec::HELPER_FAILURE as u8)
        }
    }
}
