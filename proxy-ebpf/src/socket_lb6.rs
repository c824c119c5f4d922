//! The node's own IPv6 connections to its node ports and to external and
//! load balancer frontends: `socket_lb`'s programs for IPv6 sockets, on
//! the IPv6 maps (`XP_SERVICES6`, `XP_BACKENDS6`) and maps of their own
//! (`XP_NODE_ADDRS6`, `XP_SOCK_REV6`, the anchor in `XP_SOCK_CFG6`), with
//! `socket_lb`'s netns check and frontend policy.
//!
//! IPv4-mapped addresses (`::ffff:a.b.c.d`): a dual-stack IPv6 socket
//! that connects to an IPv4 address runs these hooks, not IPv4's (the
//! kernel hands `connect` to IPv4 only after the IPv6 hook), and
//! `getpeername`/`recvmsg` on it show the peer mapped too. So they are
//! translated through IPv4's maps (`socket_lb::translate4`), the backend
//! written back mapped: such a socket reaches `NODE_IP:NODEPORT` as an
//! IPv4 socket does. (An unconnected datagram to a mapped address runs
//! IPv4's `sendmsg4` itself.)
//!
//! `[::1]` takes no node port: kube-proxy's `localhostNodePorts` is
//! IPv4's alone, and the agent never writes it into `XP_NODE_ADDRS6`.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::{cgroup_sock_addr, map},
    maps::{Array, HashMap, LruHashMap},
    programs::SockAddrContext,
};
use proxy_common::{
    Service6Key, ServiceKey, ServiceValue,
    ipv6::Addr6,
    socket_lb::{NODE_ADDRS_MAX, SOCK_REV_NAT_MAX, SockLbConfig6, SockRev6Key, SockRev6Value},
};

use crate::{
    maps::{BACKENDS6, SERVICES6},
    select::random_id,
    socket_lb::{
        PROCEED, in_node_netns, node_run, port_be, protocol, socket_cookie, translate_back4, translate4,
        translated_frontend,
    },
};

#[map(name = "XP_SOCK_CFG6")]
static SOCK_CONFIG6: Array<SockLbConfig6> = Array::pinned(1, 0);

/// The node's IPv6 addresses that take node ports (`nodePortAddresses`),
/// kept current by the agent.
#[map(name = "XP_NODE_ADDRS6")]
static NODE_ADDRS6: HashMap<Addr6, u32> = HashMap::pinned(NODE_ADDRS_MAX, BPF_F_NO_PREALLOC);

#[map(name = "XP_SOCK_REV6")]
static SOCK_REV_NAT6: LruHashMap<SockRev6Key, SockRev6Value> = LruHashMap::pinned(SOCK_REV_NAT_MAX, 0);

#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    translate(&ctx);
    PROCEED
}

/// Unconnected UDP: each datagram's destination.
#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    translate(&ctx);
    PROCEED
}

/// UDP: the source of a received datagram.
#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    translate_back(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn sock_getpeer6(ctx: SockAddrContext) -> i32 {
    translate_back(&ctx);
    PROCEED
}

/// `::ffff:0:0/96`'s first three words, network byte order.
const MAPPED_PREFIX: [u32; 3] = [0, 0, u32::from_be(0xffff)];

/// The IPv4 address an IPv4-mapped one holds.
#[inline(always)]
fn mapped_ipv4(addr: &Addr6) -> Option<u32> {
    // Word by word: a slice comparison would call `memcmp`, which BPF lacks.
    let is_mapped = addr[0] == MAPPED_PREFIX[0] && addr[1] == MAPPED_PREFIX[1] && addr[2] == MAPPED_PREFIX[2];
    is_mapped.then_some(addr[3])
}

#[inline(always)]
fn mapped(addr_be: u32) -> Addr6 {
    [MAPPED_PREFIX[0], MAPPED_PREFIX[1], MAPPED_PREFIX[2], addr_be]
}

/// The address and protocol the socket call names, as the IPv6 services
/// map keys them. `None` for other protocols.
#[inline(always)]
fn destination(ctx: &SockAddrContext) -> Option<Service6Key> {
    Some(Service6Key {
        addr_be: address(ctx),
        port_be: port_be(ctx),
        proto: protocol(ctx)?,
        _pad: 0,
    })
}

/// The IPv4 key of an IPv4-mapped destination.
#[inline(always)]
fn as_ipv4(dest: &Service6Key) -> Option<ServiceKey> {
    Some(ServiceKey {
        addr_be: mapped_ipv4(&dest.addr_be)?,
        port_be: dest.port_be,
        proto: dest.proto,
        _pad: 0,
    })
}

#[inline(always)]
fn translate(ctx: &SockAddrContext) -> Option<()> {
    let dest = destination(ctx)?;
    let (addr_be, port_be) = match as_ipv4(&dest) {
        Some(dest4) => translate4(ctx, &dest4).map(|(addr, port)| (mapped(addr), port))?,
        None => translate6(ctx, &dest)?,
    };
    set_address(ctx, &addr_be, port_be);
    Some(())
}

#[inline(always)]
fn translate_back(ctx: &SockAddrContext) -> Option<()> {
    let peer = destination(ctx)?;
    let (addr_be, port_be) = match as_ipv4(&peer) {
        Some(peer4) => translate_back4(ctx, &peer4).map(|f| (mapped(f.addr_be), f.port_be))?,
        None => translate_back6(ctx, &peer).map(|f| (f.addr_be, f.port_be))?,
    };
    set_address(ctx, &addr_be, port_be);
    Some(())
}

/// As `socket_lb::translate4`, on the IPv6 maps.
#[inline(always)]
fn translate6(ctx: &SockAddrContext, dest: &Service6Key) -> Option<(Addr6, u16)> {
    in_node_netns(ctx)?;
    let svc = frontend(dest)?;
    let id = random_id(&node_run(&svc))?;
    // SAFETY: copied out at once, as in `lookup::frontend`.
    let backend = unsafe { BACKENDS6.get(id).copied()? };
    let key = SockRev6Key {
        cookie: socket_cookie(ctx),
        addr_be: backend.addr_be,
        port_be: backend.port_be,
        _pad: [0; 6],
    };
    let frontend = SockRev6Value {
        addr_be: dest.addr_be,
        port_be: dest.port_be,
        _pad: 0,
    };
    // As IPv4's: no translation without its reverse entry.
    SOCK_REV_NAT6.insert(key, frontend, 0).ok()?;
    Some((backend.addr_be, backend.port_be))
}

/// As `socket_lb::translate_back4`, on the IPv6 map.
#[inline(always)]
fn translate_back6(ctx: &SockAddrContext, peer: &Service6Key) -> Option<SockRev6Value> {
    in_node_netns(ctx)?;
    let key = SockRev6Key {
        cookie: socket_cookie(ctx),
        addr_be: peer.addr_be,
        port_be: peer.port_be,
        _pad: [0; 6],
    };
    // SAFETY: copied out at once, as in `lookup::frontend`.
    unsafe { SOCK_REV_NAT6.get(key).copied() }
}

/// The IPv6 frontend the node's socket addresses, if it is one these
/// hooks translate (`socket_lb::translated_frontend`'s policy).
#[inline(always)]
fn frontend(dest: &Service6Key) -> Option<ServiceValue> {
    // SAFETY: copied out at once, as in `lookup::frontend`.
    let on_node_addr = unsafe { NODE_ADDRS6.get(dest.addr_be).is_some() };
    // SAFETY: as above.
    let own = unsafe { SERVICES6.get(dest).copied() };
    translated_frontend(own, on_node_addr, || {
        let anchor = SOCK_CONFIG6.get(0)?.anchor_be;
        if anchor[0] | anchor[1] | anchor[2] | anchor[3] == 0 {
            return None;
        }
        let anchored = Service6Key {
            addr_be: anchor,
            ..*dest
        };
        // SAFETY: as above.
        unsafe { SERVICES6.get(anchored).copied() }
    })
}

/// The IPv6 address the socket call names, word by word: the context
/// allows 4-byte loads of `user_ip6` at constant offsets (volatile, so
/// LLVM neither merges two into one 8-byte load nor loops over them).
#[inline(always)]
fn address(ctx: &SockAddrContext) -> Addr6 {
    // SAFETY: the kernel passes a valid `bpf_sock_addr`; each is a 4-byte
    // context load of a `user_ip6` word.
    unsafe {
        let words = &raw const (*ctx.sock_addr).user_ip6;
        let word = |i| core::ptr::read_volatile(&raw const (*words)[i]);
        [word(0), word(1), word(2), word(3)]
    }
}

/// Rewrites the address the socket call names (destination or peer),
/// word by word as [`address`] reads it.
#[inline(always)]
fn set_address(ctx: &SockAddrContext, addr_be: &Addr6, port_be: u16) {
    // SAFETY: user_ip6 and user_port are writable fields of the context in
    // these hooks; each store is 4 bytes.
    unsafe {
        let words = &raw mut (*ctx.sock_addr).user_ip6;
        core::ptr::write_volatile(&raw mut (*words)[0], addr_be[0]);
        core::ptr::write_volatile(&raw mut (*words)[1], addr_be[1]);
        core::ptr::write_volatile(&raw mut (*words)[2], addr_be[2]);
        core::ptr::write_volatile(&raw mut (*words)[3], addr_be[3]);
        (*ctx.sock_addr).user_port = u32::from(port_be);
    }
}
