//! A simulated cluster in network namespaces, shared by the integration
//! tests, the agent's end-to-end tests, `cargo xtask demo` and the
//! benchmarks.
//!
//! - [`privileged`]: root checks, unique names, bpffs pin directories;
//! - [`netns`]: namespaces, veths, servers that answer with a name, clients;
//! - [`bulk`]: a server and a client that move many bytes and check them;
//! - [`topology`]: a node with pods behind veths and a client outside;
//!   [`two_node`]: two such nodes on a shared segment;
//! - [`fixtures`]: the seed Service and the other API objects the beds
//!   serve, built once;
//! - [`probe`]: requests from inside a namespace and what they must
//!   observe (answers counted per backend, rejections, outcomes compared
//!   with a baseline);
//! - [`agent`]: an `xproxy` process in a node namespace.
//!
//! With the feature `agent`: [`agent_bed`] (one node) and
//! [`two_node_bed`] (two), the beds that run the real agent on their
//! nodes. With `progs`: [`testrun`] and [`frame`], the programs through
//! BPF_PROG_TEST_RUN without the agent.
//!
//! Everything lives in namespaces created here, under unique names, and is
//! removed on drop, also when a test panics.

pub mod agent;
pub mod bulk;
pub mod fixtures;
pub mod netns;
pub mod privileged;
pub mod probe;
pub mod topology;
pub mod two_node;

#[cfg(feature = "agent")]
pub mod agent_bed;
#[cfg(feature = "agent")]
pub mod two_node_bed;

#[cfg(feature = "progs")]
pub mod frame;
#[cfg(feature = "progs")]
pub mod testrun;
