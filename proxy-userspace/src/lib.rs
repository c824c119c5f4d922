//! The xproxy agent as a library: the binary `xproxy` and the integration
//! tests use the same code to program the data path.

pub mod mode;
pub mod model;
