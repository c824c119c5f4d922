//! The eBPF data path: XDP and tc programs that DNAT Service traffic using
//! maps pinned under bpffs.

mod loader;
mod maps;
mod object;

pub use loader::{Datapath, Hook};
pub use maps::ServiceMaps;
pub use object::object_bytes;
