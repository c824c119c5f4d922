//! Backend slots and backends.
//!
//! `(backend set, slot) -> backend id -> (ip, port)`: an endpoint shared by
//! several Service ports is one backend entry, and affinity entries and
//! Maglev tables name backends by a 4-byte id.

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

/// Key of the backend slots map; the value is a backend id (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct BackendSlotKey {
    /// [`crate::ServiceValue::backend_set`].
    pub backend_set: u32,
    /// `0..backend_count`.
    pub slot: u32,
}

/// Value of the backends array (index: backend id, `u32`, never 0); an
/// entry of protocol 0 is no backend (an array has every index).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Backend {
    /// Endpoint IPv4 address, network byte order.
    pub addr_be: u32,
    /// Endpoint port (the Service's targetPort resolved), network byte order.
    pub port_be: u16,
    /// IP protocol number.
    pub proto: u8,
    /// `FLAG_*` bits below.
    pub flags: u8,
}

impl Backend {
    pub fn new(addr: Ipv4Addr, port: u16, proto: u8) -> Self {
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            proto,
            flags: 0,
        }
    }
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.addr_be.to_ne_bytes())
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
    /// Whether the entry holds a backend (an array's unwritten or cleared
    /// entry is all zeros).
    pub fn is_present(&self) -> bool {
        self.proto != 0
    }
}

/// The endpoint is terminating: existing flows keep it, new flows avoid it.
pub const FLAG_TERMINATING: u8 = 1 << 0;
/// The endpoint runs on this node.
pub const FLAG_LOCAL: u8 = 1 << 1;

const _: () = assert!(core::mem::size_of::<BackendSlotKey>() == 8);
const _: () = assert!(core::mem::size_of::<Backend>() == 8);
