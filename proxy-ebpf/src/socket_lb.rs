//! Socket-level load balancing of the node's own traffic to its node ports
//! and to external and load balancer frontends (cgroup `sock_addr` hooks).
//!
//! Why at the socket: a process on the node that connects to one of the
//! node's own addresses sends through `lo`, where no tc or XDP program
//! runs, so `NODE_IP:NODEPORT` would be refused. Rewriting the destination
//! when the socket connects (TCP, connected UDP) or sends (unconnected UDP)
//! sends the traffic straight to a backend on the normal path, with no
//! packet rewrite and no conntrack entry; the peer address is rewritten
//! back when the process asks for it (`getpeername`, `recvmsg`), so it sees
//! the frontend it addressed.
//!
//! The programs are attached to a cgroup (the agent's choice, by default
//! the root of the cgroup v2 hierarchy), which holds processes of every
//! network namespace: they act only on sockets of the node's namespace
//! (`bpf_get_netns_cookie` against the cookie the agent wrote) and leave
//! every other socket alone. ClusterIPs are left to the tc path (it keeps
//! kube-proxy's source address and its session affinity); so are frontends
//! with source ranges (the tc path checks them) and frontends without
//! backends (the kernel and the tc path reject as before).

use aya_ebpf::{
    EbpfContext,
    bindings::BPF_F_NO_PREALLOC,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{cgroup_sock_addr, map},
    maps::{Array, HashMap, LruHashMap},
    programs::SockAddrContext,
};
use proxy_common::{
    BackendSlotKey, RevNat, ServiceKey, ServiceValue,
    maps::BACKEND_SLOTS_MAX,
    proto,
    service::{FLAG_EXTERNAL_LOCAL, FLAG_NODE_PORT, FLAG_SOURCE_RANGES, FLAGS_EXTERNAL},
    socket_lb::{NODE_ADDRS_MAX, SOCK_REV_NAT_MAX, SockLbConfig, SockRevKey},
};

use crate::{
    maps::SERVICES,
    select::{random_backend, slot_id},
};

#[map(name = "XP_SOCK_CFG")]
static SOCK_CONFIG: Array<SockLbConfig> = Array::pinned(1, 0);

/// The node's addresses that take node ports (`nodePortAddresses`, and
/// `127.0.0.1` with `localhostNodePorts`), kept current by the agent.
#[map(name = "XP_NODE_ADDRS")]
static NODE_ADDRS: HashMap<u32, u32> = HashMap::pinned(NODE_ADDRS_MAX, BPF_F_NO_PREALLOC);

#[map(name = "XP_SOCK_REV")]
static SOCK_REV_NAT: LruHashMap<SockRevKey, RevNat> = LruHashMap::pinned(SOCK_REV_NAT_MAX, 0);

/// A cgroup `sock_addr` program lets the call go on with 1 (0 fails it
/// with EPERM, which these programs never do).
pub const PROCEED: i32 = 1;

#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    translate(&ctx);
    PROCEED
}

/// Unconnected UDP: each datagram's destination.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    translate(&ctx);
    PROCEED
}

/// UDP: the source of a received datagram.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    translate_back(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeer4(ctx: SockAddrContext) -> i32 {
    translate_back(&ctx);
    PROCEED
}

/// The socket call's protocol as the services maps key it: TCP or UDP,
/// `None` for others.
#[inline(always)]
pub fn protocol(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: the kernel passes a valid `bpf_sock_addr`; a 4-byte load.
    match unsafe { (*ctx.sock_addr).protocol } {
        p if p == u32::from(proto::TCP) => Some(proto::TCP),
        p if p == u32::from(proto::UDP) => Some(proto::UDP),
        _ => None,
    }
}

/// The port the socket call names, network byte order.
#[inline(always)]
pub fn port_be(ctx: &SockAddrContext) -> u16 {
    // SAFETY: as in `protocol`. The port is in network byte order in the
    // low 16 bits.
    unsafe { (*ctx.sock_addr).user_port as u16 }
}

/// The destination and protocol a socket call names, as the services map
/// keys them. `None` for other protocols.
#[inline(always)]
fn destination(ctx: &SockAddrContext) -> Option<ServiceKey> {
    let proto = protocol(ctx)?;
    Some(ServiceKey {
        // SAFETY: as in `protocol`.
        addr_be: unsafe { (*ctx.sock_addr).user_ip4 },
        port_be: port_be(ctx),
        proto,
        _pad: 0,
    })
}

/// Whether the socket lives in the node's network namespace (the cookie
/// in IPv4's config map serves both families).
#[inline(always)]
pub fn in_node_netns(ctx: &SockAddrContext) -> Option<SockLbConfig> {
    let config = *SOCK_CONFIG.get(0)?;
    // SAFETY: the helper only reads the program's own context.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    (config.netns_cookie != 0 && cookie == config.netns_cookie).then_some(config)
}

/// The socket's cookie, which keys the reverse translation maps.
#[inline(always)]
pub fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: the helper only reads the program's own context.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

#[inline(always)]
fn translate(ctx: &SockAddrContext) -> Option<()> {
    let (addr_be, port_be) = translate4(ctx, &destination(ctx)?)?;
    set_address(ctx, addr_be, port_be);
    Some(())
}

#[inline(always)]
fn translate_back(ctx: &SockAddrContext) -> Option<()> {
    let frontend = translate_back4(ctx, &destination(ctx)?)?;
    set_address(ctx, frontend.addr_be, frontend.port_be);
    Some(())
}

/// The backend a destination that is a node port on a node address, or an
/// external or load balancer frontend, is rewritten to, with the frontend
/// remembered for [`translate_back4`]. Also IPv6's for IPv4-mapped
/// addresses (`socket_lb6`).
#[inline(always)]
pub fn translate4(ctx: &SockAddrContext, dest: &ServiceKey) -> Option<(u32, u16)> {
    let config = in_node_netns(ctx)?;
    let svc = frontend(dest, &config)?;
    let (_, backend) = random_backend(&node_run(&svc))?;
    let frontend = RevNat {
        addr_be: dest.addr_be,
        port_be: dest.port_be,
        _pad: 0,
    };
    let key = SockRevKey {
        cookie: socket_cookie(ctx),
        addr_be: backend.addr_be,
        port_be: backend.port_be,
        _pad: 0,
    };
    // Without its reverse entry a UDP reply would come from an address the
    // process never addressed: better not translate at all.
    SOCK_REV_NAT.insert(key, frontend, 0).ok()?;
    Some((backend.addr_be, backend.port_be))
}

/// The frontend this socket addressed, if `peer` is the backend it was
/// translated to.
#[inline(always)]
pub fn translate_back4(ctx: &SockAddrContext, peer: &ServiceKey) -> Option<RevNat> {
    in_node_netns(ctx)?;
    let key = SockRevKey {
        cookie: socket_cookie(ctx),
        addr_be: peer.addr_be,
        port_be: peer.port_be,
        _pad: 0,
    };
    // SAFETY: copied out at once, as in `lookup::frontend`.
    unsafe { SOCK_REV_NAT.get(key).copied() }
}

/// Rewrites the address the socket call names (destination or peer).
#[inline(always)]
fn set_address(ctx: &SockAddrContext, addr_be: u32, port_be: u16) {
    // SAFETY: user_ip4 and user_port are writable 4-byte fields of the
    // context in these hooks.
    unsafe {
        (*ctx.sock_addr).user_ip4 = addr_be;
        (*ctx.sock_addr).user_port = u32::from(port_be);
    }
}

/// The frontend the node's socket addresses, if it is one this hook
/// translates (see [`translated_frontend`]).
#[inline(always)]
fn frontend(dest: &ServiceKey, config: &SockLbConfig) -> Option<ServiceValue> {
    // SAFETY: copied out at once, as in `lookup::frontend`.
    let on_node_addr = unsafe { NODE_ADDRS.get(dest.addr_be).is_some() };
    // SAFETY: as above.
    let own = unsafe { SERVICES.get(dest).copied() };
    translated_frontend(own, on_node_addr, || {
        if config.anchor_be == 0 {
            return None;
        }
        let anchored = ServiceKey {
            addr_be: config.anchor_be,
            ..*dest
        };
        // SAFETY: as above.
        unsafe { SERVICES.get(anchored).copied() }
    })
}

/// Of either family: the frontend (`own`, the destination's own, if any)
/// that the socket programs translate: any frontend on a node address (its
/// own, e.g. an external IP the node holds, or else the node port on the
/// anchor node IP, from `anchored`), and an external frontend (node port,
/// external IP, load balancer IP) elsewhere. ClusterIPs and frontends with
/// source ranges stay with the tc path.
#[inline(always)]
pub fn translated_frontend(
    own: Option<ServiceValue>,
    on_node_addr: bool,
    anchored: impl FnOnce() -> Option<ServiceValue>,
) -> Option<ServiceValue> {
    let svc = match own {
        Some(svc) if on_node_addr || svc.flags & (FLAGS_EXTERNAL | FLAG_EXTERNAL_LOCAL) != 0 => svc,
        Some(_) => return None,
        None if on_node_addr => {
            let svc = anchored()?;
            if svc.flags & FLAG_NODE_PORT == 0 {
                return None;
            }
            svc
        }
        None => return None,
    };
    (svc.flags & FLAG_SOURCE_RANGES == 0).then_some(svc)
}

/// The run of slots the node's own traffic picks from. kube-proxy
/// short-circuits the node's own traffic to an `externalTrafficPolicy:
/// Local` frontend to every endpoint (its cluster chain): here the whole
/// backend set, whose size the frontend does not carry.
#[inline(always)]
pub fn node_run(svc: &ServiceValue) -> ServiceValue {
    if svc.flags & FLAG_EXTERNAL_LOCAL == 0 {
        return *svc;
    }
    ServiceValue {
        backend_offset: 0,
        backend_count: set_size(svc),
        ..*svc
    }
}

/// How many slots the frontend's backend set has: slots are numbered
/// `0..n` without gaps (user space writes a set whole under a fresh id), so
/// a binary search over the slots map finds `n` in at most 21 lookups (of
/// the chunk holding each slot probed).
#[inline(always)]
fn set_size(svc: &ServiceValue) -> u32 {
    // Every slot of the frontend's own run exists.
    let mut low = svc.backend_offset.saturating_add(svc.backend_count);
    let mut high = BACKEND_SLOTS_MAX;
    for _ in 0..21 {
        if low >= high {
            break;
        }
        let mid = low + (high - low).div_ceil(2);
        let key = BackendSlotKey {
            backend_set: svc.backend_set,
            slot: mid - 1,
        };
        if slot_id(&key).is_some() {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}
