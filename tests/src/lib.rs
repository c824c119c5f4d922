//! Harness for xproxy's integration tests: privileged set-up, network
//! namespaces, frame builders and BPF_PROG_TEST_RUN helpers.
//!
//! Tests that need root call [`privileged::require_root`] first: without
//! root they are skipped with a message, unless `XPROXY_PRIVILEGED_TESTS=1`
//! (set by `cargo xtask test` as root, hence by CI), where a skip would hide
//! a broken environment and so fails instead.

pub mod agent_harness;
pub mod frame;
pub mod scenario;
pub mod testrun;
pub mod two_node_bed;

// The namespace test bed is shared with `cargo xtask demo` and the benchmarks.
pub use testbed::{bulk, netns, privileged, topology, two_node};
