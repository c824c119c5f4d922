//! Socket-level load balancing for the node's own traffic: the maps of the
//! cgroup `sock_addr` programs (`proxy-ebpf/src/socket_lb.rs`).
//!
//! The node's own connections to its node ports, and to external and load
//! balancer IPs that are its own addresses, go through `lo` and never pass
//! the tc and XDP programs. These programs rewrite the destination when the
//! socket connects (or, for unconnected UDP, sends) and the peer address
//! back when it asks (`getpeername`, `recvmsg`). They are attached to a
//! cgroup, not a network namespace, so they act only on sockets of the
//! namespace whose cookie [`SockLbConfig`] holds.
//!
//! IPv6 has maps of its own beside these (`XP_NODE_ADDRS6`,
//! `XP_SOCK_REV6`, `XP_SOCK_CFG6` for its anchor), as the packet path's
//! (`crate::ipv6`): [`SockLbConfig`] keeps the layout earlier agents
//! pinned, and its netns cookie serves both families.

use core::net::{Ipv4Addr, Ipv6Addr};

use bytemuck::{Pod, Zeroable};

use crate::ipv6::{Addr6, addr6_be, ipv6_of};

/// Map names (also the pin file names, at most 15 bytes).
pub const SOCK_CONFIG: &str = "XP_SOCK_CFG";
pub const NODE_ADDRS: &str = "XP_NODE_ADDRS";
pub const SOCK_REV_NAT: &str = "XP_SOCK_REV";
pub const SOCK_CONFIG6: &str = "XP_SOCK_CFG6";
pub const NODE_ADDRS6: &str = "XP_NODE_ADDRS6";
pub const SOCK_REV_NAT6: &str = "XP_SOCK_REV6";

/// Local addresses that take node ports: a node has few.
pub const NODE_ADDRS_MAX: u32 = 1024;
/// Translated sockets remembered for their reverse translation; least
/// recently used first out (a closed socket's entry is never used again:
/// socket cookies are not reused).
pub const SOCK_REV_NAT_MAX: u32 = 65_536;

/// Program names (the entry points of `proxy-ebpf/src/socket_lb.rs`).
pub const PROG_CONNECT4: &str = "sock_connect4";
pub const PROG_SENDMSG4: &str = "sock_sendmsg4";
pub const PROG_RECVMSG4: &str = "sock_recvmsg4";
pub const PROG_GETPEERNAME4: &str = "sock_getpeer4";
/// The IPv6 ones (`proxy-ebpf/src/socket_lb6.rs`).
pub const PROG_CONNECT6: &str = "sock_connect6";
pub const PROG_SENDMSG6: &str = "sock_sendmsg6";
pub const PROG_RECVMSG6: &str = "sock_recvmsg6";
pub const PROG_GETPEERNAME6: &str = "sock_getpeer6";
/// Every socket program, in the order the agent attaches them (the
/// translations last, so no socket is translated before its reverse
/// translation is in place; IPv6's connect translates IPv4-mapped
/// addresses through IPv4's maps, so it comes after IPv4's reverse
/// programs too).
pub const PROGRAMS: [&str; 8] = [
    PROG_RECVMSG4,
    PROG_GETPEERNAME4,
    PROG_RECVMSG6,
    PROG_GETPEERNAME6,
    PROG_SENDMSG4,
    PROG_CONNECT4,
    PROG_SENDMSG6,
    PROG_CONNECT6,
];

/// The only element of the config map (an array of one).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockLbConfig {
    /// The node's network namespace cookie (`SO_NETNS_COOKIE`); 0 = act on
    /// no socket.
    pub netns_cookie: u64,
    /// A node IP that has a frontend for every node port, network byte
    /// order: node ports on local addresses without frontends of their own
    /// (added after the agent started, `127.0.0.1`) are looked up on it.
    /// 0 = none.
    pub anchor_be: u32,
    pub _pad: u32,
}

impl SockLbConfig {
    pub fn new(netns_cookie: u64, anchor: Option<Ipv4Addr>) -> Self {
        Self {
            netns_cookie,
            anchor_be: anchor.map_or(0, |ip| u32::from_ne_bytes(ip.octets())),
            _pad: 0,
        }
    }
}

/// The only element of the IPv6 config map (an array of one): the IPv6
/// node IP that has a frontend for every node port, as
/// [`SockLbConfig::anchor_be`]; all zeros = none.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockLbConfig6 {
    pub anchor_be: Addr6,
}

impl SockLbConfig6 {
    pub fn new(anchor: Option<Ipv6Addr>) -> Self {
        Self {
            anchor_be: anchor.map_or([0; 4], addr6_be),
        }
    }
}

/// Key of the node address map: a local IPv4 address in network byte
/// order (`u32`, as [`crate::ServiceKey::addr_be`]); the value is
/// [`NODE_ADDR_PRESENT`].
pub const NODE_ADDR_PRESENT: u32 = 1;

/// Key of the reverse translation map: a socket and the backend it was
/// sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRevKey {
    /// The socket's cookie (`bpf_get_socket_cookie`).
    pub cookie: u64,
    /// Backend IPv4 address, network byte order.
    pub addr_be: u32,
    /// Backend port, network byte order.
    pub port_be: u16,
    pub _pad: u16,
}

/// Value of the reverse translation map: the frontend the socket addressed.
pub type SockRevValue = crate::RevNat;

/// Key of the IPv6 node address map (`XP_NODE_ADDRS6`): a local IPv6
/// address in the programs' form ([`crate::ipv6`]); the value is
/// [`NODE_ADDR_PRESENT`].
pub type NodeAddr6 = Addr6;

/// Key of the IPv6 reverse translation map, as [`SockRevKey`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRev6Key {
    /// The socket's cookie (`bpf_get_socket_cookie`).
    pub cookie: u64,
    /// Backend IPv6 address, network byte order.
    pub addr_be: Addr6,
    /// Backend port, network byte order.
    pub port_be: u16,
    pub _pad: [u8; 6],
}

/// Value of the IPv6 reverse translation map: the frontend the socket
/// addressed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SockRev6Value {
    /// Frontend IPv6 address, network byte order.
    pub addr_be: Addr6,
    /// Frontend port, network byte order.
    pub port_be: u16,
    pub _pad: u16,
}

impl SockRev6Value {
    pub fn addr(&self) -> Ipv6Addr {
        ipv6_of(self.addr_be)
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

const _: () = assert!(core::mem::size_of::<SockLbConfig>() == 16);
const _: () = assert!(core::mem::size_of::<SockRevKey>() == 16);
const _: () = assert!(core::mem::size_of::<SockLbConfig6>() == 16);
const _: () = assert!(core::mem::size_of::<SockRev6Key>() == 32);
const _: () = assert!(core::mem::size_of::<SockRev6Value>() == 20);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_holds_the_anchor_in_packet_order() {
        let config = SockLbConfig::new(7, Some(Ipv4Addr::new(172, 30, 0, 2)));
        let bytes: [u8; 16] = bytemuck::cast(config);
        assert_eq!(bytes[8..12], [172, 30, 0, 2]);
        assert_eq!(SockLbConfig::new(7, None).anchor_be, 0);
    }

    #[test]
    fn config6_holds_the_anchor_in_packet_order() {
        let anchor: Ipv6Addr = "fd00:30::2".parse().expect("an address");
        let bytes: [u8; 16] = bytemuck::cast(SockLbConfig6::new(Some(anchor)));
        assert_eq!(bytes, anchor.octets());
        assert_eq!(SockLbConfig6::new(None).anchor_be, [0; 4]);
    }

    #[test]
    fn names_fit_the_kernel_limit() {
        let maps = [
            SOCK_CONFIG,
            NODE_ADDRS,
            SOCK_REV_NAT,
            SOCK_CONFIG6,
            NODE_ADDRS6,
            SOCK_REV_NAT6,
        ];
        for name in PROGRAMS.into_iter().chain(maps) {
            assert!(name.len() <= 15, "{name}");
        }
    }
}
