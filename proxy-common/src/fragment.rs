//! IPv4 fragments: only a datagram's first fragment carries the L4 ports,
//! so the programs remember them, keyed by what every fragment of the
//! datagram shares (RFC 791: source, destination, protocol, IP id), and
//! translate the later fragments as the flow those ports name. An LRU
//! hash: a datagram's entry is needed for a few milliseconds, and the next
//! datagram with the same id (65,536 datagrams later) overwrites it.
//!
//! IPv6 fragments likewise, in a map of their own ([`Frag6Key`]): the
//! fragment header's 32-bit id with the 16-byte addresses (RFC 8200 4.5).

use bytemuck::{Pod, Zeroable};

/// Key of the fragments map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FragKey {
    /// Source IPv4 address, network byte order.
    pub saddr_be: u32,
    /// Destination IPv4 address, network byte order.
    pub daddr_be: u32,
    /// IP identification, network byte order.
    pub id_be: u16,
    /// IP protocol number.
    pub proto: u8,
    pub _pad: u8,
}

/// Value: the first fragment's ports, network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FragPorts {
    pub sport_be: u16,
    pub dport_be: u16,
}

/// Key of the IPv6 fragments map (value: [`FragPorts`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Frag6Key {
    /// Source IPv6 address, network byte order.
    pub saddr_be: [u32; 4],
    /// Destination IPv6 address, network byte order.
    pub daddr_be: [u32; 4],
    /// The fragment header's identification, network byte order.
    pub id_be: u32,
    /// The upper-layer protocol (the fragment header's next header).
    pub proto: u8,
    pub _pad: [u8; 3],
}

const _: () = assert!(core::mem::size_of::<FragKey>() == 12);
const _: () = assert!(core::mem::size_of::<Frag6Key>() == 40);
const _: () = assert!(core::mem::size_of::<FragPorts>() == 4);
