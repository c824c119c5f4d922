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

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

/// Map names (also the pin file names, at most 15 bytes).
pub const SOCK_CONFIG: &str = "XP_SOCK_CFG";
pub const NODE_ADDRS: &str = "XP_NODE_ADDRS";
pub const SOCK_REV_NAT: &str = "XP_SOCK_REV";

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
/// Every socket program, in the order the agent attaches them (the
/// translation last, so no socket is translated before its reverse
/// translation is in place).
pub const PROGRAMS: [&str; 4] = [PROG_RECVMSG4, PROG_GETPEERNAME4, PROG_SENDMSG4, PROG_CONNECT4];

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

const _: () = assert!(core::mem::size_of::<SockLbConfig>() == 16);
const _: () = assert!(core::mem::size_of::<SockRevKey>() == 16);

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
    fn names_fit_the_kernel_limit() {
        for name in PROGRAMS.into_iter().chain([SOCK_CONFIG, NODE_ADDRS, SOCK_REV_NAT]) {
            assert!(name.len() <= 15, "{name}");
        }
    }
}
