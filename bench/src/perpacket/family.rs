//! What differs between the IPv4 and the IPv6 cases: the addresses of the
//! seed Service and the node, how a frame is built and read, and which
//! conntrack map a flow lands in. The cases themselves are shared.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::{Result, bail};
use proxy_common::{CtKey, CtKey6, proto};
use proxy_userspace::model::{Endpoint, IPV6_SUFFIX, Protocol, ServicePort};
use serde::Serialize;
use testbed::{
    frame::{Frame, Frame6, Strict, check, check6, parse_strict},
    testrun::{BACKEND_IPS, BACKEND_PORT, CLUSTER_IP, NODE_IP, NODE_PORT, SEED_TCP, SERVICE_PORT},
};

/// The seed Service's IPv6 twin: its ClusterIP, the node's address and
/// the backends (the IPv4 ones' last octet, in the pod network).
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa);
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x50, 0, 0, 0, 0x10);
/// Other IPv6 hosts (clients, pods that are no backend) take their IPv4
/// counterpart's address in the low 32 bits of this /96.
const HOSTS6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x6, 0, 0, 0, 0, 0, 0);

#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    pub fn of(addr: SocketAddr) -> Self {
        if addr.is_ipv4() { Family::Ipv4 } else { Family::Ipv6 }
    }

    /// The address of `v4`'s counterpart in this family.
    pub fn host(self, v4: Ipv4Addr) -> IpAddr {
        match self {
            Family::Ipv4 => v4.into(),
            Family::Ipv6 => Ipv6Addr::from(u128::from(HOSTS6) | u128::from(u32::from(v4))).into(),
        }
    }

    pub fn node_ip(self) -> IpAddr {
        match self {
            Family::Ipv4 => NODE_IP.into(),
            Family::Ipv6 => NODE_IP6.into(),
        }
    }

    pub fn node_port(self) -> SocketAddr {
        SocketAddr::new(self.node_ip(), NODE_PORT)
    }

    pub fn cluster_ip(self) -> SocketAddr {
        match self {
            Family::Ipv4 => SocketAddr::new(CLUSTER_IP.into(), SERVICE_PORT),
            Family::Ipv6 => SocketAddr::new(CLUSTER_IP6.into(), SERVICE_PORT),
        }
    }

    /// The seed Service's backends in this family.
    pub fn backends(self) -> Vec<SocketAddr> {
        let ip = |v4: Ipv4Addr| match self {
            Family::Ipv4 => IpAddr::from(v4),
            Family::Ipv6 => IpAddr::from(backend_ip6(v4)),
        };
        BACKEND_IPS
            .iter()
            .map(|v4| SocketAddr::new(ip(*v4), BACKEND_PORT))
            .collect()
    }
}

/// `10.244.0.11` is `fd00:10:244::b`.
fn backend_ip6(v4: Ipv4Addr) -> Ipv6Addr {
    let [_, _, _, host] = v4.octets();
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, host.into())
}

/// The node's addresses of both families (NodePorts are programmed on them).
pub fn node_ips() -> Vec<IpAddr> {
    Family::ALL.iter().map(|f| f.node_ip()).collect()
}

/// The seed Service's TCP port in IPv6: ClusterIP and NodePort as the
/// IPv4 one's, three backends.
pub fn seed_service6() -> ServicePort {
    ServicePort {
        name: format!("{SEED_TCP}{IPV6_SUFFIX}"),
        protocol: Protocol::Tcp,
        cluster_ip: CLUSTER_IP6.into(),
        port: SERVICE_PORT,
        node_port: Some(NODE_PORT),
        endpoints: (Family::Ipv6.backends().iter())
            .map(|b| Endpoint::ready(b.ip(), b.port()))
            .collect(),
        ..ServicePort::default()
    }
}

/// A TCP segment with `flags` from `src` to `dst`, no payload, as an
/// Ethernet frame of their family.
pub fn tcp_frame(src: SocketAddr, dst: SocketAddr, flags: u8) -> Vec<u8> {
    match (src, dst) {
        (SocketAddr::V4(src), SocketAddr::V4(dst)) => Frame::tcp(src, dst, flags).build(),
        (SocketAddr::V6(src), SocketAddr::V6(dst)) => Frame6::tcp(src, dst, flags).build(),
        _ => panic!("a frame from {src} to {dst}: one family each end"),
    }
}

/// Source and destination of a TCP or UDP frame of either family whose
/// checksums are right.
pub fn checked_ends(frame: &[u8]) -> Result<(SocketAddr, SocketAddr)> {
    let (ends, checked) = match parse_strict(frame) {
        Strict::Flow(flow) => ((flow.src.into(), flow.dst.into()), check(frame).map(drop)),
        Strict::Ipv6Flow(flow) => ((flow.src.into(), flow.dst.into()), check6(frame).map(drop)),
        other => bail!("not a flow: {other:?}"),
    };
    if let Err(e) = checked {
        bail!("the checksums are wrong: {e}");
    }
    Ok(ends)
}

/// A conntrack key of either family's map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowKey {
    V4(CtKey),
    V6(CtKey6),
}

impl FlowKey {
    /// The key of TCP packets from `src` to `dst`.
    pub fn tcp(src: SocketAddr, dst: SocketAddr) -> Result<Self> {
        Ok(match (src, dst) {
            (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                FlowKey::V4(CtKey::new(*s.ip(), s.port(), *d.ip(), d.port(), proto::TCP))
            }
            (SocketAddr::V6(s), SocketAddr::V6(d)) => {
                FlowKey::V6(CtKey6::new(*s.ip(), s.port(), *d.ip(), d.port(), proto::TCP))
            }
            _ => bail!("a flow from {src} to {dst}: one family each end"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_hosts_and_backends_mirror_the_ipv4_ones() {
        let client = Family::Ipv6.host(Ipv4Addr::new(198, 18, 0, 1));
        assert_eq!(client, "fd00:6::c612:1".parse::<IpAddr>().expect("an address"));
        assert_eq!(
            Family::Ipv4.host(Ipv4Addr::LOCALHOST),
            IpAddr::from(Ipv4Addr::LOCALHOST)
        );
        let backends = Family::Ipv6.backends();
        assert_eq!(backends[0], "[fd00:10:244::b]:80".parse().expect("an address"));
        assert!(backends.iter().all(|b| Family::of(*b) == Family::Ipv6));
        let svc = seed_service6();
        assert_eq!(svc.cluster_ip, IpAddr::from(CLUSTER_IP6));
        assert_eq!(svc.endpoints.len(), 3);
    }

    #[test]
    fn frames_of_either_family_read_back() {
        for family in Family::ALL {
            let (src, dst) = (
                SocketAddr::new(family.host(Ipv4Addr::new(10, 0, 0, 1)), 1234),
                family.cluster_ip(),
            );
            let frame = tcp_frame(src, dst, testbed::frame::tcp_flags::SYN);
            assert_eq!(checked_ends(&frame).expect("a flow"), (src, dst), "{family:?}");
        }
        let mut broken = tcp_frame(Family::Ipv6.node_port(), Family::Ipv6.cluster_ip(), 0);
        let last = broken.len() - 1;
        broken[last] ^= 1;
        assert!(checked_ends(&broken).is_err());
        assert!(FlowKey::tcp(Family::Ipv4.node_port(), Family::Ipv6.node_port()).is_err());
    }
}
