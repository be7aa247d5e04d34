//! Builds `crab-init`, the static pid-1 reaper that every sandbox runs, and exposes its path to
//! the crate through `CRAB_INIT_BIN` so it can be embedded with `include_bytes!`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("crab-init");
    println!("cargo:rerun-if-changed=src/init/init.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args(["-static", "-Os", "-s", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg("src/init/init.c")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("building crab-init with {cc} failed ({s}); install gcc and libc6-dev"),
        Err(e) => panic!("cannot run {cc} to build crab-init: {e}; install gcc and libc6-dev"),
    }
    println!("cargo:rustc-env=CRAB_INIT_BIN={}", out.display());
}
