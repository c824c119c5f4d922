//! Reverse NAT: what a reply's source is rewritten back to.

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

/// Value of the reverse NAT map (key: rev NAT id, `u32`, never 0): the
/// frontend the client originally addressed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct RevNat {
    /// Frontend IPv4 address, network byte order.
    pub addr_be: u32,
    /// Frontend port, network byte order.
    pub port_be: u16,
    pub _pad: u16,
}

impl RevNat {
    pub fn new(addr: Ipv4Addr, port: u16) -> Self {
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            _pad: 0,
        }
    }
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.addr_be.to_ne_bytes())
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

const _: () = assert!(core::mem::size_of::<RevNat>() == 8);
