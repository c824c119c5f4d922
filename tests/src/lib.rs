//! Harness for xproxy's integration tests: privileged set-up, network
//! namespaces, frame builders and BPF_PROG_TEST_RUN helpers.

pub mod privileged;
