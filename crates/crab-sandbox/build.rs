//! Builds `crab-init`, the static pid-1 reaper that every sandbox runs, and exposes its path to
//! the crate through `CRAB_INIT_BIN` so it can be embedded with `include_bytes!`; and the
//! cgroup device BPF program with its libbpf-rs skeleton.

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
    build_device_program();
}

/// Compile `src/bpf/devices.bpf.c` (clang) and generate its libbpf-rs skeleton
/// (`$OUT_DIR/devices.skel.rs`).
fn build_device_program() {
    const SRC: &str = "src/bpf/devices.bpf.c";
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("devices.skel.rs");
    libbpf_cargo::SkeletonBuilder::new()
        .source(SRC)
        .build_and_generate(&out)
        .expect("building the cgroup device BPF program (clang) and its skeleton failed");
    println!("cargo:rerun-if-changed={SRC}");
}
