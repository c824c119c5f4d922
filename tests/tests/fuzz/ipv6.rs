//! The fuzz's IPv6 Services and how the oracle models them.
//!
//! Beside the IPv4 seed, the data path gets IPv6 Service ports written by
//! the agent's own writer: a ClusterIP with three backends (TCP and UDP,
//! also on a NodePort of the node's IPv6 address; SCTP where the port
//! stays), a ClusterIP and NodePort without endpoints (reject paths), a
//! load balancer IP with loadBalancerSourceRanges (`XP_SRC_RANGES6`) and
//! two external IPs with `externalTrafficPolicy: Local`, where only pods
//! (`XP_POD_CIDRS6`) reach other nodes' endpoints (one with an endpoint on
//! this node, one without: the outside is dropped there).
//!
//! The oracle's flow model (`conntrack`) is family-blind: it keys tuples
//! of `SocketAddrV4`. IPv6 addresses enter it through [`Fake4`], a
//! one-to-one map onto 240.6.0.0/16 (addresses no IPv4 seed or
//! dictionary uses), so the same rules track both families; the programs'
//! separate tables (`XP_CT`, `XP_CT6`) never meet because the fake
//! addresses never do.

use std::{
    cell::RefCell,
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6},
};

use proxy_userspace::model::{Endpoint, Protocol, ServicePort, SourceRange, TrafficPolicy};
use testbed::testrun::{BACKEND_PORT, EMPTY_NODE_PORT, EMPTY_PORT, NODE_PORT, SERVICE_PORT};

pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x50, 0, 0, 0, 0x10);
pub const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa);
const EMPTY_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x14);
const RANGED_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x1e);
const LOCAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x28);
/// The load balancer IP with source ranges, and the external IP of the
/// `Local` Service.
const LB_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x20);
const LOCAL_EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);
/// A `Local` Service with no endpoint on this node: its ClusterIP and
/// external IP.
const ELSEWHERE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x32);
const ELSEWHERE_EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x30);
pub const BACKEND_IPS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xb),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xc),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xd),
];
/// The source range: the outside clients' /64 (`ALLOWED_CLIENTS6`).
const RANGE6: (Ipv6Addr, u8) = (Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0), 64);
/// The pod network (a dual `clusterCIDR`'s IPv6 half): pods and backends.
pub const POD_CIDR6: (Ipv6Addr, u8) = (Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0), 56);
/// Node names: the `Local` Service's middle endpoint is this node's.
pub const THIS_NODE: &str = "this-node";
const OTHER_NODE: &str = "other-node";

/// Pods, outside clients in the source range, and outside clients not.
pub fn clients6() -> Vec<Ipv6Addr> {
    let pods = (0..8).map(|i| Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 5 + i));
    let inside = (0..6).map(|i| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 7 + i));
    let outside = (0..4).map(|i| Ipv6Addr::new(0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 1 + i));
    pods.chain(inside).chain(outside).collect()
}

fn endpoints6(nodes: [&str; 3], port: u16) -> Vec<Endpoint> {
    BACKEND_IPS6
        .iter()
        .zip(nodes)
        .map(|(ip, node)| Endpoint {
            node_name: Some(node.into()),
            ..Endpoint::ready(*ip, port)
        })
        .collect()
}

fn port6(name: &str, protocol: Protocol, cluster_ip: Ipv6Addr, port: u16, endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: format!("fuzz6/{name}"),
        protocol,
        cluster_ip: cluster_ip.into(),
        port,
        endpoints,
        ..ServicePort::default()
    }
}

/// The IPv6 Service ports (see the module doc), on a node named
/// [`THIS_NODE`] with [`NODE_IP6`].
pub fn seed6_services() -> Vec<ServicePort> {
    let everywhere = || endpoints6([THIS_NODE; 3], BACKEND_PORT);
    let mut out = Vec::new();
    for (name, protocol) in [("seed:http", Protocol::Tcp), ("seed:dns", Protocol::Udp)] {
        out.push(ServicePort {
            node_port: Some(NODE_PORT),
            ..port6(name, protocol, CLUSTER_IP6, SERVICE_PORT, everywhere())
        });
    }
    // SCTP is translated only where the port stays.
    out.push(port6(
        "seed:sctp",
        Protocol::Sctp,
        CLUSTER_IP6,
        BACKEND_PORT,
        endpoints6([THIS_NODE; 3], BACKEND_PORT),
    ));
    for (name, protocol) in [("empty:http", Protocol::Tcp), ("empty:dns", Protocol::Udp)] {
        out.push(ServicePort {
            node_port: Some(EMPTY_NODE_PORT),
            ..port6(name, protocol, EMPTY_IP6, EMPTY_PORT, Vec::new())
        });
    }
    out.push(ServicePort {
        load_balancer_ips: vec![LB_IP6.into()],
        source_ranges: vec![SourceRange {
            addr: RANGE6.0.into(),
            prefix_len: RANGE6.1,
        }],
        ..port6("ranged:http", Protocol::Tcp, RANGED_IP6, SERVICE_PORT, everywhere())
    });
    for (name, cluster_ip, external_ip, nodes) in [
        (
            "local:http",
            LOCAL_IP6,
            LOCAL_EXTERNAL_IP6,
            [OTHER_NODE, THIS_NODE, OTHER_NODE],
        ),
        ("elsewhere:http", ELSEWHERE_IP6, ELSEWHERE_EXTERNAL_IP6, [OTHER_NODE; 3]),
    ] {
        out.push(ServicePort {
            external_ips: vec![external_ip.into()],
            external_policy: TrafficPolicy::Local,
            ..port6(
                name,
                Protocol::Tcp,
                cluster_ip,
                SERVICE_PORT,
                endpoints6(nodes, BACKEND_PORT),
            )
        });
    }
    out
}

/// Whether `addr` is inside `net`.
pub fn inside((net, prefix_len): (Ipv6Addr, u8), addr: Ipv6Addr) -> bool {
    let mask = u128::MAX.checked_shl(128 - u32::from(prefix_len)).unwrap_or(0);
    u128::from(net) & mask == u128::from(addr) & mask
}

/// What an IPv6 frontend does to a new flow beyond picking a backend.
#[derive(Clone, Debug, Default)]
pub struct Policy6 {
    /// loadBalancerSourceRanges: the ranges a client must be in (the load
    /// balancer IP itself is always let in, as kube-proxy's).
    pub ranges: Vec<(Ipv6Addr, u8)>,
    /// `Local` external traffic: the backends of this node (pods, by
    /// `XP_POD_CIDRS6`, still reach every one).
    pub local: Option<Vec<SocketAddrV4>>,
}

/// The frontend's policies of `svc`'s IPv6 frontend `frontend`, with
/// `local` its backends on this node.
pub fn policy6(svc: &ServicePort, frontend: Ipv6Addr, local: Vec<SocketAddrV4>) -> Policy6 {
    let is_lb_ip = svc.load_balancer_ips.contains(&IpAddr::V6(frontend));
    let external = frontend != ipv6_of(svc.cluster_ip).unwrap_or(Ipv6Addr::UNSPECIFIED);
    let mut ranges = Vec::new();
    if is_lb_ip && !svc.source_ranges.is_empty() {
        ranges.extend((svc.source_ranges.iter()).filter_map(|r| Some((ipv6_of(r.addr)?, r.prefix_len))));
        ranges.push((frontend, 128));
    }
    let local = (external && svc.external_policy == TrafficPolicy::Local).then_some(local);
    Policy6 { ranges, local }
}

pub fn ipv6_of(ip: IpAddr) -> Option<Ipv6Addr> {
    match ip {
        IpAddr::V6(v6) => Some(v6),
        IpAddr::V4(_) => None,
    }
}

/// The one-to-one map of IPv6 addresses onto 240.6.0.0/16 the oracle's
/// family-blind records key them by (see the module doc). Grows as
/// addresses come, behind `&self` (the oracle's predictions only read).
#[derive(Default)]
pub struct Fake4 {
    map: RefCell<(HashMap<Ipv6Addr, Ipv4Addr>, Vec<Ipv6Addr>)>,
}

const FAKE_NET: u32 = 0xf006_0000;

impl Fake4 {
    pub fn ip(&self, ip: Ipv6Addr) -> Ipv4Addr {
        let mut map = self.map.borrow_mut();
        let (to4, to6) = &mut *map;
        if let Some(fake) = to4.get(&ip) {
            return *fake;
        }
        let n = u32::try_from(to6.len()).expect("few addresses");
        assert!(n < 1 << 16, "more IPv6 addresses than 240.6.0.0/16 holds");
        let fake = Ipv4Addr::from(FAKE_NET | n);
        to4.insert(ip, fake);
        to6.push(ip);
        fake
    }

    pub fn addr(&self, a: SocketAddrV6) -> SocketAddrV4 {
        SocketAddrV4::new(self.ip(*a.ip()), a.port())
    }

    /// The IPv6 address `fake` stands for, if it is a fake one.
    pub fn real(&self, fake: SocketAddrV4) -> Option<SocketAddrV6> {
        let n = u32::from(*fake.ip()).checked_sub(FAKE_NET).filter(|n| *n < 1 << 16)?;
        let ip = *self.map.borrow().1.get(n as usize)?;
        Some(SocketAddrV6::new(ip, fake.port(), 0, 0))
    }
}
