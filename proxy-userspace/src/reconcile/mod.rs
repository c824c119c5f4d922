//! From desired state to data path: `diff` computes what to change (pure),
//! `runner` decides when (coalescing, periodic full syncs, retries).

pub mod diff;
pub mod runner;

pub use diff::{diff, diff_of};
