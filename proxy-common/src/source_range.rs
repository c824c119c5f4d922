//! loadBalancerSourceRanges: which clients may use a load balancer IP.
//!
//! One LPM trie for every frontend, keyed by `(frontend id, client
//! address)`: the id takes the first 32 bits of every prefix, so a lookup
//! with the full 64 bits matches only the frontend's own ranges, and the
//! longest-prefix match finds whether any of them holds the client in one
//! lookup, however many ranges a Service lists. A trie per frontend
//! (map-in-map) would cost a map per Service; a hash of exact sources
//! cannot hold networks.

use core::net::{Ipv4Addr, Ipv6Addr};

use bytemuck::{Pod, Zeroable};

use crate::ipv6::{Addr6, addr6_be, ipv6_of};

/// The bits of a key's prefix that name the frontend.
pub const ID_BITS: u32 = 32;

/// Key of the source ranges map, laid out as the kernel's
/// `struct bpf_lpm_trie_key` (prefix length, then the data the prefix
/// covers, in the order its bits are matched). The value is a `u8` (1).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SourceRangeKey {
    /// Bits matched: [`ID_BITS`] plus the range's prefix length.
    pub prefix_len: u32,
    /// The frontend's [`crate::ServiceValue::rev_nat_id`], network byte
    /// order (the trie matches bits from the first byte on).
    pub rev_nat_id_be: u32,
    /// Network (or, for a lookup, client) IPv4 address, network byte order.
    pub addr_be: u32,
}

impl SourceRangeKey {
    /// The entry allowing `addr/prefix_len` to reach frontend `rev_nat_id`.
    pub fn range(rev_nat_id: u32, addr: Ipv4Addr, prefix_len: u8) -> Self {
        Self {
            prefix_len: ID_BITS + u32::from(prefix_len.min(32)),
            rev_nat_id_be: rev_nat_id.to_be(),
            addr_be: u32::from_ne_bytes(addr.octets()),
        }
    }
    pub fn rev_nat_id(&self) -> u32 {
        u32::from_be(self.rev_nat_id_be)
    }
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.addr_be.to_ne_bytes())
    }
    /// The range's own prefix length (without the id's bits).
    pub fn range_len(&self) -> u8 {
        // At most 32 by construction; a corrupt entry reads as /32.
        u8::try_from(self.prefix_len.saturating_sub(ID_BITS).min(32)).unwrap_or(32)
    }
}

/// The data of a lookup key (the kernel's key without its prefix length),
/// for the programs' `LpmTrie<SourceRangeData, u8>`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SourceRangeData {
    /// As [`SourceRangeKey::rev_nat_id_be`].
    pub rev_nat_id_be: u32,
    /// The client's IPv4 address, network byte order.
    pub addr_be: u32,
}

/// Key of the IPv6 source ranges map (`XP_SRC_RANGES6`): [`SourceRangeKey`]
/// with a 16-byte address. A trie of its own, as IPv6's other maps (see
/// `crate::ipv6`): in IPv4's every key would grow from 12 to 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SourceRange6Key {
    /// Bits matched: [`ID_BITS`] plus the range's prefix length.
    pub prefix_len: u32,
    /// As [`SourceRangeKey::rev_nat_id_be`].
    pub rev_nat_id_be: u32,
    /// Network (or, for a lookup, client) IPv6 address, network byte order.
    pub addr_be: Addr6,
}

impl SourceRange6Key {
    /// The entry allowing `addr/prefix_len` to reach frontend `rev_nat_id`.
    pub fn range(rev_nat_id: u32, addr: Ipv6Addr, prefix_len: u8) -> Self {
        Self {
            prefix_len: ID_BITS + u32::from(prefix_len.min(128)),
            rev_nat_id_be: rev_nat_id.to_be(),
            addr_be: addr6_be(addr),
        }
    }
    pub fn rev_nat_id(&self) -> u32 {
        u32::from_be(self.rev_nat_id_be)
    }
    pub fn addr(&self) -> Ipv6Addr {
        ipv6_of(self.addr_be)
    }
    /// The range's own prefix length (without the id's bits).
    pub fn range_len(&self) -> u8 {
        // At most 128 by construction; a corrupt entry reads as /128.
        u8::try_from(self.prefix_len.saturating_sub(ID_BITS).min(128)).unwrap_or(128)
    }
}

/// The data of an IPv6 lookup key, as [`SourceRangeData`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SourceRange6Data {
    /// As [`SourceRangeKey::rev_nat_id_be`].
    pub rev_nat_id_be: u32,
    /// The client's IPv6 address, network byte order.
    pub addr_be: Addr6,
}

const _: () = assert!(core::mem::size_of::<SourceRangeKey>() == 12);
const _: () = assert!(core::mem::size_of::<SourceRangeData>() == 8);
const _: () = assert!(core::mem::size_of::<SourceRange6Key>() == 24);
const _: () = assert!(core::mem::size_of::<SourceRange6Data>() == 20);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_key_is_the_id_then_the_network_in_packet_order() {
        let key = SourceRangeKey::range(0x0102_0304, Ipv4Addr::new(203, 0, 113, 0), 24);
        let bytes: [u8; 12] = bytemuck::cast(key);
        assert_eq!(bytes, [56, 0, 0, 0, 1, 2, 3, 4, 203, 0, 113, 0]);
        assert_eq!(
            (key.rev_nat_id(), key.addr(), key.range_len()),
            (0x0102_0304, Ipv4Addr::new(203, 0, 113, 0), 24)
        );
    }

    #[test]
    fn an_ipv6_range_key_is_the_id_then_the_network_in_packet_order() {
        let net: Ipv6Addr = "2001:db8:1::".parse().expect("address");
        let key = SourceRange6Key::range(0x0102_0304, net, 48);
        let bytes: [u8; 24] = bytemuck::cast(key);
        let mut want = [0u8; 24];
        want[..8].copy_from_slice(&[80, 0, 0, 0, 1, 2, 3, 4]);
        want[8..].copy_from_slice(&net.octets());
        assert_eq!(bytes, want);
        assert_eq!((key.rev_nat_id(), key.addr(), key.range_len()), (0x0102_0304, net, 48));
    }
}
