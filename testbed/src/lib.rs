//! A simulated cluster in network namespaces, shared by the integration
//! tests, `cargo xtask demo` and the benchmarks.
//!
//! - [`privileged`]: root checks, unique names, bpffs pin directories;
//! - [`netns`]: namespaces, veths, servers that answer with a name, clients;
//! - [`bulk`]: a server and a client that move many bytes and check them;
//! - [`topology`]: a node with pods behind veths and a client outside;
//! - [`two_node`]: two nodes with pods on a shared segment, a client outside.
//!
//! Everything lives in namespaces created here, under unique names, and is
//! removed on drop, also when a test panics.

pub mod agent;
pub mod bulk;
pub mod netns;
pub mod privileged;
pub mod topology;
pub mod two_node;
