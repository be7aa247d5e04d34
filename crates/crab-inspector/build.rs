//! Build script: compiles `src/bpf/inspector.bpf.c` with clang and generates the libbpf-rs
//! skeleton (`$OUT_DIR/inspector.skel.rs`). `vmlinux.h` is vendored next to the C source so the
//! build needs neither bpftool nor `/sys/kernel/btf/vmlinux`.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "src/bpf/inspector.bpf.c";

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"))
        .join("inspector.skel.rs");
    let manifest = PathBuf::from(
        env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR is set by cargo"),
    );
    let bpf_dir = manifest.join("src/bpf");
    SkeletonBuilder::new()
        .source(SRC)
        .clang_args([
            std::ffi::OsString::from("-I"),
            bpf_dir.into_os_string(),
            std::ffi::OsString::from("-Wno-compare-distinct-pointer-types"),
            std::ffi::OsString::from("-mcpu=v3"),
        ])
        .build_and_generate(&out)
        .expect("building the BPF object (clang) and its skeleton failed");
    println!("cargo:rerun-if-changed={SRC}");
    println!("cargo:rerun-if-changed=src/bpf/vmlinux.h");
    println!("cargo:rerun-if-changed=src/bpf/inspector.h");
}
