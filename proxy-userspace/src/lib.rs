//! The xproxy agent as a library: the binary `xproxy` and the integration
//! tests use the same code to program the data path.

pub mod agent;
pub mod mode;
pub mod reconcile;
pub mod source;
pub mod model;
