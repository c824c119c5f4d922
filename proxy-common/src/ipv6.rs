//! The IPv6 maps' keys and values: the IPv4 ones with 16-byte addresses.
//!
//! IPv6 has maps of its own (`XP_SERVICES6`, `XP_BACKENDS6`, `XP_CT6`)
//! rather than a family field in the IPv4 keys. A shared layout would
//! widen every IPv4 key to hold an IPv6 address: the conntrack entry (key
//! and value) from 40 to 80 bytes, 88 to 128 with the kernel's element
//! header, which in the preallocated LRU map of 524,288 entries is 20 MiB
//! more (44 to 64 MiB) whether or not the node carries any IPv6, and every
//! IPv4 packet's lookups would hash 40-byte keys instead of 16-byte ones
//! (the kernel's jhash walks the key in 12-byte rounds: one round becomes
//! three, on every lookup of the hot path). Apart, the IPv4 path's keys and
//! memory stay as they were, and its code all but so: the bench's
//! per-packet comparison of the object before and after (2026-12-04, 99
//! rounds) moved every IPv4 case by less than its noise (-43 to +7 ns
//! medians, 10 ns steps); an IPv6 packet costs one ether type test more. What
//! carries no address is shared: [`crate::ServiceValue`] (the frontend's
//! backend set, flags, affinity), the backend slots (`XP_SLOTS`: backend
//! ids, one id space for both families), the reverse NAT ids, the port
//! filter and the counters.
//!
//! Addresses are `[u32; 4]`: the 16 bytes as they are in the packet, each
//! 4 in a native integer (network byte order, as every `*_be` field), so
//! that the programs load, compare and checksum them as words.

use core::net::Ipv6Addr;

use bytemuck::{Pod, Zeroable};

use crate::conntrack::FLAG_REPLY;

/// An IPv6 address as the programs hold it (see the module doc).
pub type Addr6 = [u32; 4];

/// The programs' form of `addr`.
pub fn addr6_be(addr: Ipv6Addr) -> Addr6 {
    let o = addr.octets();
    let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
    [word(0), word(4), word(8), word(12)]
}

/// The address the programs' form `words` holds.
pub fn ipv6_of(words: Addr6) -> Ipv6Addr {
    let mut octets = [0u8; 16];
    for (chunk, word) in octets.chunks_exact_mut(4).zip(words) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(octets)
}

/// Key of `XP_SERVICES6` (value: [`crate::ServiceValue`]): an IPv6
/// frontend, as [`crate::ServiceKey`] is an IPv4 one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Service6Key {
    /// Frontend IPv6 address (ClusterIP, node IP, ...), network byte order.
    pub addr_be: Addr6,
    /// Frontend port (service port or node port), network byte order.
    pub port_be: u16,
    /// IP protocol number, see [`crate::proto`].
    pub proto: u8,
    pub _pad: u8,
}

impl Service6Key {
    pub fn new(addr: Ipv6Addr, port: u16, proto: u8) -> Self {
        Self {
            addr_be: addr6_be(addr),
            port_be: port.to_be(),
            proto,
            _pad: 0,
        }
    }
    pub fn addr(&self) -> Ipv6Addr {
        ipv6_of(self.addr_be)
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// Value of `XP_BACKENDS6` (key: backend id, `u32`, never 0, from the
/// same id space as `XP_BACKENDS_ARR`'s): an IPv6 endpoint, as
/// [`crate::Backend`] is an IPv4 one (the same `FLAG_*` bits).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Backend6 {
    /// Endpoint IPv6 address, network byte order.
    pub addr_be: Addr6,
    /// Endpoint port (the Service's targetPort resolved), network byte order.
    pub port_be: u16,
    /// IP protocol number.
    pub proto: u8,
    /// [`crate::backend`]'s `FLAG_*` bits.
    pub flags: u8,
}

impl Backend6 {
    pub fn new(addr: Ipv6Addr, port: u16, proto: u8) -> Self {
        Self {
            addr_be: addr6_be(addr),
            port_be: port.to_be(),
            proto,
            flags: 0,
        }
    }
    pub fn addr(&self) -> Ipv6Addr {
        ipv6_of(self.addr_be)
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// Key of `XP_CT6`: an IPv6 packet's tuple, as [`crate::CtKey`] (two
/// entries a flow, forward and reply, in one key space).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtKey6 {
    /// Source IPv6 address, network byte order.
    pub saddr_be: Addr6,
    /// Destination IPv6 address, network byte order.
    pub daddr_be: Addr6,
    /// Source port, network byte order.
    pub sport_be: u16,
    /// Destination port, network byte order.
    pub dport_be: u16,
    /// IP protocol number.
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl CtKey6 {
    pub fn new(saddr: Ipv6Addr, sport: u16, daddr: Ipv6Addr, dport: u16, proto: u8) -> Self {
        Self {
            saddr_be: addr6_be(saddr),
            daddr_be: addr6_be(daddr),
            sport_be: sport.to_be(),
            dport_be: dport.to_be(),
            proto,
            _pad: [0; 3],
        }
    }
}

/// Value of `XP_CT6`: [`crate::CtValue`]'s fields at the same offsets
/// (the programs' atomic OR on `flags` relies on its place), the address
/// apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtValue6 {
    /// As [`crate::CtValue::backend_id`].
    pub backend_id: u32,
    /// As [`crate::CtValue::rev_nat_id`].
    pub rev_nat_id: u32,
    /// As [`crate::CtValue::last_seen_ns`].
    pub last_seen_ns: u64,
    /// [`crate::conntrack`]'s `FLAG_*` bits.
    pub flags: u8,
    /// The flow's state, one of [`crate::conntrack::state`].
    pub state: u8,
    /// As [`crate::CtValue::nat_port_be`].
    pub nat_port_be: u16,
    pub _pad: u32,
    /// The address the packet is rewritten to, network byte order: the
    /// backend's (forward entry) or the frontend's (reply entry).
    pub nat_addr_be: Addr6,
}

impl CtValue6 {
    pub fn nat(&self) -> (Ipv6Addr, u16) {
        (ipv6_of(self.nat_addr_be), u16::from_be(self.nat_port_be))
    }
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }
}

/// Key of `XP_AFFINITY6` (value: [`crate::AffinityValue`]): a Service
/// port and an IPv6 client, as [`crate::AffinityKey`] is an IPv4 one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct AffinityKey6 {
    /// As [`crate::AffinityKey::affinity_id`].
    pub affinity_id: u32,
    /// Client IPv6 address, network byte order.
    pub client_be: Addr6,
}

/// The key of the flow's other entry, as [`crate::conntrack::partner_key`].
#[inline(always)]
pub fn partner_key6(key: &CtKey6, value: &CtValue6) -> CtKey6 {
    if value.flags & FLAG_REPLY != 0 {
        CtKey6 {
            saddr_be: key.daddr_be,
            daddr_be: value.nat_addr_be,
            sport_be: key.dport_be,
            dport_be: value.nat_port_be,
            proto: key.proto,
            _pad: [0; 3],
        }
    } else {
        CtKey6 {
            saddr_be: value.nat_addr_be,
            daddr_be: key.saddr_be,
            sport_be: value.nat_port_be,
            dport_be: key.sport_be,
            proto: key.proto,
            _pad: [0; 3],
        }
    }
}

const _: () = assert!(core::mem::size_of::<Service6Key>() == 20);
const _: () = assert!(core::mem::size_of::<Backend6>() == 20);
const _: () = assert!(core::mem::size_of::<CtKey6>() == 40);
const _: () = assert!(core::mem::size_of::<CtValue6>() == 40);
const _: () = assert!(core::mem::size_of::<AffinityKey6>() == 20);
// The programs OR into `flags` as the lowest byte of an aligned u64, as
// in `CtValue` (see proxy-ebpf's conntrack).
const _: () = assert!(core::mem::offset_of!(CtValue6, flags) == core::mem::offset_of!(crate::CtValue, flags));
const _: () = assert!(core::mem::offset_of!(CtValue6, flags) % 8 == 0);
const _: () = assert!(core::mem::align_of::<CtValue6>() == 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_keep_packet_order() {
        let addr: Ipv6Addr = "fd00:10:96::a".parse().expect("an address");
        let key = Service6Key::new(addr, 88, crate::proto::TCP);
        let bytes: [u8; 20] = bytemuck::cast(key);
        assert_eq!(&bytes[..16], &addr.octets());
        assert_eq!(&bytes[16..], &[0, 88, 6, 0]);
        assert_eq!((key.addr(), key.port()), (addr, 88));
    }

    #[test]
    fn partner_of_forward_is_the_reply_tuple() {
        let client: Ipv6Addr = "fd00::1".parse().expect("an address");
        let vip: Ipv6Addr = "fd00:10:96::a".parse().expect("an address");
        let backend: Ipv6Addr = "fd00:10:244::5".parse().expect("an address");
        let forward = CtKey6::new(client, 40000, vip, 88, crate::proto::TCP);
        let value = CtValue6 {
            nat_addr_be: addr6_be(backend),
            nat_port_be: 80u16.to_be(),
            ..Zeroable::zeroed()
        };
        let reply = CtKey6::new(backend, 80, client, 40000, crate::proto::TCP);
        assert_eq!(partner_key6(&forward, &value), reply);
        let back = CtValue6 {
            flags: FLAG_REPLY,
            nat_addr_be: addr6_be(vip),
            nat_port_be: 88u16.to_be(),
            ..value
        };
        assert_eq!(partner_key6(&reply, &back), forward);
    }
}
