//! Connection tracking: an LRU hash keyed by the 5-tuple as seen in a packet.
//!
//! Each translated flow has two entries in one key space, so that a packet
//! needs one lookup of its own tuple whichever way it goes. The forward
//! entry is keyed by the client's tuple `client -> frontend` and holds the
//! backend to DNAT to; the reply entry is keyed by the backend's reply
//! tuple `backend -> client` and holds the frontend to rewrite the source
//! back to. [`FLAG_REPLY`] in the value says which of the two it is.
//!
//! The same five numbers can be one flow's forward tuple and another flow's
//! reply tuple only if a client uses a frontend's address and port as its
//! source (the node connecting from a NodePort-numbered port to a pod that
//! connects to that NodePort). Entries are inserted without overwriting
//! (BPF_NOEXIST): the second flow is then not tracked, and neither loses
//! its pin.

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtKey {
    /// Source IPv4 address, network byte order.
    pub saddr_be: u32,
    /// Destination IPv4 address, network byte order.
    pub daddr_be: u32,
    /// Source port, network byte order.
    pub sport_be: u16,
    /// Destination port, network byte order.
    pub dport_be: u16,
    /// IP protocol number.
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl CtKey {
    pub fn new(saddr: Ipv4Addr, sport: u16, daddr: Ipv4Addr, dport: u16, proto: u8) -> Self {
        Self {
            saddr_be: u32::from_ne_bytes(saddr.octets()),
            daddr_be: u32::from_ne_bytes(daddr.octets()),
            sport_be: sport.to_be(),
            dport_be: dport.to_be(),
            proto,
            _pad: [0; 3],
        }
    }
    pub fn saddr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.saddr_be.to_ne_bytes())
    }
    pub fn daddr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.daddr_be.to_ne_bytes())
    }
    pub fn sport(&self) -> u16 {
        u16::from_be(self.sport_be)
    }
    pub fn dport(&self) -> u16 {
        u16::from_be(self.dport_be)
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtValue {
    /// Backend the flow was pinned to (backends map key), for read-back
    /// only: the programs translate with [`Self::nat_addr_be`].
    pub backend_id: u32,
    /// Frontend the flow was addressed to (reverse NAT map key), likewise.
    pub rev_nat_id: u32,
    /// `bpf_jiffies64()` of the last packet (the kernel's tick counter, HZ
    /// a second: a clock read costs some 35 ns a packet, this one nothing),
    /// refreshed at most every [`LAST_SEEN_GRANULARITY_JIFFIES`] so that
    /// busy flows do not bounce the entry's cache line.
    pub last_seen_jiffies: u64,
    /// `FLAG_*` bits below.
    pub flags: u8,
    /// TCP flags seen so far in this direction (`TCP_*` bits below).
    pub tcp_seen: u8,
    /// The port the packet is rewritten to, network byte order: the
    /// backend's (forward entry, destination) or the frontend's (reply
    /// entry, source). Kept here so a tracked packet needs no other lookup.
    pub nat_port_be: u16,
    /// The address the packet is rewritten to, network byte order, likewise.
    pub nat_addr_be: u32,
}

impl CtValue {
    /// The address and port the entry rewrites to (see the fields).
    pub fn nat(&self) -> (Ipv4Addr, u16) {
        (
            Ipv4Addr::from(self.nat_addr_be.to_ne_bytes()),
            u16::from_be(self.nat_port_be),
        )
    }
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }
}

/// This is the reply entry (`backend -> client`): reverse NAT to the frontend.
pub const FLAG_REPLY: u8 = 1 << 0;
/// The flow's packets carry the SNAT mark: the kernel masquerades them.
pub const FLAG_SNAT: u8 = 1 << 1;
/// Forward entry only: the XDP hook picked the backend but could not mark
/// the packet (no skb) and left it to the tc hook, which translates it,
/// counts the flow as new and clears the flag.
pub const FLAG_HANDED_TO_TC: u8 = 1 << 2;

pub const TCP_SYN: u8 = 1 << 0;
pub const TCP_FIN: u8 = 1 << 1;
pub const TCP_RST: u8 = 1 << 2;
pub const TCP_ACK: u8 = 1 << 3;

/// How stale `last_seen_jiffies` may get before a packet refreshes it:
/// 0.1 s to 1 s, depending on the kernel's HZ.
pub const LAST_SEEN_GRANULARITY_JIFFIES: u64 = 100;

const _: () = assert!(core::mem::size_of::<CtKey>() == 16);
const _: () = assert!(core::mem::size_of::<CtValue>() == 24);
const _: () = assert!(core::mem::offset_of!(CtValue, nat_addr_be) == 20);
