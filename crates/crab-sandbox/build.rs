//! Builds `crab-init`, the static pid-1 reaper that every sandbox runs, and exposes its path to
//! the crate through `CRAB_INIT_BIN` so it can be embedded with `include_bytes!`; and the
//! cgroup device BPF program with its libbpf-rs skeleton; and `CRAB_HELPER_ABI`, a digest of the
//! sources the namespace helpers' specs and behaviour come from (this crate's and
//! crab-common's), so the daemon can tell a `crab-nsexec` built from other sources.

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
    helper_abi();
}

/// Digest every file under this crate's and crab-common's `src/` (path and content, in path
/// order) into `CRAB_HELPER_ABI`. Two binaries linked with the same sources agree on it.
fn helper_abi() {
    use std::hash::{Hash, Hasher};
    fn walk(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    for dir in ["src", "../crab-common/src"] {
        println!("cargo:rerun-if-changed={dir}");
        walk(std::path::Path::new(dir), &mut files);
    }
    files.sort();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in &files {
        f.hash(&mut h);
        std::fs::read(f).unwrap_or_default().hash(&mut h);
    }
    println!("cargo:rustc-env=CRAB_HELPER_ABI={:016x}", h.finish());
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
