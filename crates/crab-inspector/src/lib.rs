//! crab-inspector: eBPF tracking of what each sandbox's turn did to the OS, and the per-turn
//! checkpoint verdict (skip / fs / process / full).
//!
//! BPF programs on syscall and scheduler tracepoints (`src/bpf/inspector.bpf.c`) attribute
//! events to sandboxes by cgroup v2 id and keep the *net* effect of the current turn in kernel
//! maps; [`Inspector::take`] reads one sandbox's turn at the boundary and resets it. See
//! this crate's `README.md` for what is covered and how the verdict is decided.

mod abi;
mod error;
pub mod harness;
mod inspector;
mod maps;
mod pool;
mod procfs;
mod verdict;

#[allow(
    warnings,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    clippy::unwrap_used,
    missing_debug_implementations,
    rust_2018_idioms,
    unsafe_op_in_unsafe_fn
)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/inspector.skel.rs"));
}

pub use error::InspectorError;
pub use inspector::{Inspector, ProgramStats, SandboxHandle, TurnStats};
pub use verdict::{ChangeOp, ObjectKind, PathChange, ProcessChanges, Verdict};
