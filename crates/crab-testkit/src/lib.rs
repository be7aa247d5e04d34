//! `crab-testkit`: what Crab's tests and benchmarks share, kept out of every product crate
//! (`publish = false`; only dev-dependencies and `crab-bench` use it).
//!
//! * [`upstream`]: a stub LLM upstream (a real HTTP server on loopback with configurable delay,
//!   status and SSE streaming), an in-memory sandbox directory and instantly-publishing turn
//!   hooks — the doubles around the proxy.
//! * [`engine`] (feature `engine`): proxy hooks over a real engine, answering the host's
//!   `JobTicket` — shared by the proxy tests and the proxy benchmark.
//! * [`criu_images`]: a protobuf wire-level editor for forging fields of real CRIU images.
//! * [`daemon`]: runs the real `crab` binary against the real daemon of `CRAB_STATE_DIR`
//!   (started if none answers) and sandboxes that remove themselves when a test ends.
//! * [`oci`]: OCI image fixtures made without Crab (a tiny root filesystem, a layout writer
//!   with hand-built, also hostile, layer tars).
//! * [`privilege`]: the one probe for root-only tests: they fail loudly when
//!   `CRAB_REQUIRE_PRIVILEGED=1` (CI, `make test`) and they cannot run, instead of passing as
//!   "skipped".

pub mod criu_images;
pub mod daemon;
#[cfg(feature = "engine")]
pub mod engine;
pub mod oci;
pub mod privilege;
pub mod upstream;
