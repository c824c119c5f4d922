//! The services map: one entry per frontend a packet can be addressed to.
//!
//! A Service port becomes several frontends: its ClusterIP, and for a NodePort
//! Service every node IP with the node port. All frontends of one Service port
//! share one backend set; each uses a contiguous run of its slots, so that a
//! frontend with a `Local` traffic policy can use this node's backends only.

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

/// Key: where the packet is going.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct ServiceKey {
    /// Frontend IPv4 address (ClusterIP, node IP, ...), network byte order.
    pub addr_be: u32,
    /// Frontend port (service port or node port), network byte order.
    pub port_be: u16,
    /// IP protocol number, see [`crate::proto`].
    pub proto: u8,
    pub _pad: u8,
}

impl ServiceKey {
    pub fn new(addr: Ipv4Addr, port: u16, proto: u8) -> Self {
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            proto,
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

/// Value: which backends serve the frontend, and how.
///
/// Backend sets are swapped whole: user space writes a new set under a fresh
/// `backend_set` id, then replaces this value in one map update (a hash map
/// update is atomic for readers), then deletes the old set. A packet thus
/// sees either the old set or the new one, never a mix or a half-written one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct ServiceValue {
    /// Id of the backend set in use: the first half of [`crate::BackendSlotKey`].
    pub backend_set: u32,
    /// Number of slots this frontend picks from (slots `backend_offset..
    /// backend_offset + backend_count`); 0 means the frontend has no usable
    /// endpoint: new flows are dropped if a `*_LOCAL` flag is set, else
    /// rejected.
    pub backend_count: u32,
    /// Reverse NAT entry replies are rewritten with (this frontend's address).
    pub rev_nat_id: u32,
    /// `FLAG_*` bits below.
    pub flags: u32,
    /// ClientIP session affinity timeout in seconds; 0 = no affinity.
    pub affinity_timeout_s: u32,
    /// The first slot of the set this frontend picks from. The set holds
    /// this node's backends (for `Local` policies) first, then the others.
    pub backend_offset: u32,
}

/// The frontend is a node IP with a node port (not a ClusterIP).
pub const FLAG_NODE_PORT: u32 = 1 << 0;
/// An external frontend ([`FLAGS_EXTERNAL`]) with externalTrafficPolicy=Local: its slots are this
/// node's backends only, flows keep the client's address (no SNAT), and
/// with no slot new flows are dropped (not rejected). Set only while the
/// Service has usable endpoints somewhere: one with none is rejected.
pub const FLAG_EXTERNAL_LOCAL: u32 = 1 << 1;
/// sessionAffinity=ClientIP (timeout in `affinity_timeout_s`): a client's
/// new flows go to the backend of its last one (see [`crate::affinity`]).
pub const FLAG_AFFINITY_CLIENT_IP: u32 = 1 << 2;
/// loadBalancerSourceRanges restrict who may use the frontend (a load
/// balancer IP): a new flow from a source outside every range of the
/// source ranges map under the frontend's `rev_nat_id` is dropped.
pub const FLAG_SOURCE_RANGES: u32 = 1 << 3;
/// Translated flows must also be source-NATed by the kernel fallback.
pub const FLAG_NEEDS_SNAT: u32 = 1 << 4;
/// A ClusterIP frontend with internalTrafficPolicy=Local: its slots are
/// this node's backends only; with none new flows are dropped. Set only
/// while the Service has usable endpoints somewhere, like
/// [`FLAG_EXTERNAL_LOCAL`].
pub const FLAG_INTERNAL_LOCAL: u32 = 1 << 5;
/// The frontend is an external IP or a load balancer IP on the Service's
/// port: external traffic as a node port is (`FLAG_EXTERNAL_LOCAL` applies,
/// flows to other nodes' backends are source-NATed), but not a node IP.
pub const FLAG_EXTERNAL_ADDR: u32 = 1 << 6;
/// New flows pick their backend from the backend set's Maglev table
/// (see [`crate::maglev`]) rather than at random; set only on frontends
/// whose run of slots the table was built for. A high bit, apart from the
/// policy flags above, which grow from bit 0.
pub const FLAG_MAGLEV: u32 = 1 << 16;
/// Either kind of external frontend (node port, external or LB IP).
pub const FLAGS_EXTERNAL: u32 = FLAG_NODE_PORT | FLAG_EXTERNAL_ADDR;
/// Either `Local` policy flag: an empty frontend drops instead of rejecting.
pub const FLAGS_LOCAL: u32 = FLAG_EXTERNAL_LOCAL | FLAG_INTERNAL_LOCAL;

const _: () = assert!(core::mem::size_of::<ServiceKey>() == 8);
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 24);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_holds_address_and_port_in_packet_order() {
        let key = ServiceKey::new(Ipv4Addr::new(10, 96, 0, 10), 88, crate::proto::TCP);
        let bytes: [u8; 8] = bytemuck::cast(key);
        assert_eq!(bytes, [10, 96, 0, 10, 0, 88, 6, 0]);
        assert_eq!((key.addr(), key.port()), (Ipv4Addr::new(10, 96, 0, 10), 88));
    }
}
