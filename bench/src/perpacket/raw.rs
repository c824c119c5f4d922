//! The bpf(2) commands this module needs beyond what aya offers, from the
//! shared `bpf-sys` layer: BPF_PROG_TEST_RUN on any program descriptor (so
//! baselines and the real programs are timed through the very same call),
//! and opening a pinned object (the agent's).

pub use bpf_sys::{obj::obj_get, test_run::prog_test_run as test_run};

/// The pass-only baselines are the test bed's.
pub use testbed::netns::bpf::{Pass as PassProgram, load_pass};
