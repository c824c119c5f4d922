//! The port filter: a bitmap of the ports Service traffic can use, so that
//! the programs let everything else pass without a hash lookup.
//!
//! A packet can be Service traffic only if its destination port is some
//! frontend's port (a request: service port or node port) or its source
//! port is some backend's port (a reply). The map is an ARRAY of
//! [`PortBits`], one element per 64 port numbers, whatever the protocol;
//! the verifier inlines an ARRAY lookup (no helper call). Bits are only
//! ever set: a flow may outlive its Service or backend (TCP keeps its
//! translation, see `proxy-userspace`'s stale_flows), and a stale bit only
//! costs that port's packets a lookup.

use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct PortBits {
    /// Bit `port % 64` set: `port` is a frontend's port.
    pub frontend: u64,
    /// Bit `port % 64` set: `port` is a backend's port.
    pub backend: u64,
}

/// Elements of the map: 65536 ports, 64 an element.
pub const PORT_WORDS: u32 = 1024;

/// The element index and the bit of `port` (host order).
#[inline(always)]
pub fn slot(port: u16) -> (u32, u64) {
    (u32::from(port >> 6), 1u64 << (port & 63))
}

const _: () = assert!(core::mem::size_of::<PortBits>() == 16);
