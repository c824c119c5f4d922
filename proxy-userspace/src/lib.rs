//! The xproxy agent as a library: the binary `xproxy` and the integration
//! tests use the same code to program the data path.

pub mod agent;
pub mod cmd;
pub mod config;
pub mod dump;
pub mod mode;
pub mod model;
pub mod reconcile;
pub mod server;
pub mod source;
pub mod sys;
