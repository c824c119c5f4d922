//! Two simulated nodes on a shared L2 segment, pods on both, and a client
//! outside them.
//!
//! ```text
//!                      segment ns (xs*): bridge br0, no address
//!        ┌──────────────────────────┬──────────────────────────────┐
//!   sc* (port)                 sp* (port, XDP_PASS)           sp* (port, XDP_PASS)
//!    ║                          ║                              ║
//!   cu* client ns (xc*)        nu* node-a ns (xn*)            nu* node-b ns (xn*)
//!   CLIENT_IP 172.31.0.1       172.31.0.2                     172.31.0.3
//!   10.244.1.0/24 via .2       10.244.2.0/24 via .3           10.244.1.0/24 via .2
//!   10.244.2.0/24 via .3       default via .1                 default via .1
//!                              np* 10.244.1.1/32 ═ pod nss:   np* 10.244.2.1/32 ═ pod nss:
//!                                a-1 10.244.1.11                b-1 10.244.2.11
//!                                a-2 10.244.1.12                b-2 10.244.2.12
//!                                a-client 10.244.1.14
//! ```
//!
//! Each node is wired like the one-node test bed ([`crate::topology`]): pods
//! behind veths as the CNI `ptp` plugin makes them (a /32, a link route to the
//! node's gateway address that every node-side veth carries, a route per pod
//! on the node), forwarding on, reverse path filtering off. Each node reaches
//! the other's pod CIDR through the other node's uplink address, as a CNI
//! with host routes does. The node's default route is the client (the
//! "router"), so the node's own traffic to a ClusterIP leaves by the uplink.
//!
//! Backends answer with their pod name on TCP and UDP [`TARGET_PORT`], and
//! with their name and the source address they see on TCP [`PEER_PORT`].
//! `a-client` is not a backend.
//!
//! Every link carries IPv6 too: `fd00:31::1`, `::2`, `::3` on the segment,
//! each pod [`pod_ipv6`] of its IPv4 address (`fd00:244::1:b` for a-1)
//! behind its node's gateway of the same mapping, each node's pods in a
//! /112 ([`NodeSpec::pod_cidr6`]) routed like the IPv4 /24s.
//!
//! The addresses differ from the one-node test bed's, and every namespace
//! and interface name is unique ([`unique_name`]), so both test beds run in
//! parallel. Everything is removed on drop, also when a test panics.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result};

use crate::{
    netns::{self, Netns},
    privileged::unique_name,
    topology::{Offloads, Pod, add_pod, node_ns, pod_ipv6},
};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(172, 31, 0, 1);
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x31, 0, 0, 0, 0, 0, 1);
/// The segment's IPv6 prefix length.
pub const SEGMENT_PREFIX6: u8 = 64;
/// The segment's prefix length.
pub const SEGMENT_PREFIX: u8 = 24;
/// The port backends answer on with their name (TCP and UDP).
pub const TARGET_PORT: u16 = 80;
/// The TCP port backends answer on with their name and the client address
/// they see (`a-1 172.31.0.2`): what a backend sees of source NAT.
pub const PEER_PORT: u16 = 81;

/// One node's fixed facts: its name (the `nodeName` of its endpoints and
/// the agent's `--hostname-override`), addresses and pods.
#[derive(Clone, Copy, Debug)]
pub struct NodeSpec {
    pub name: &'static str,
    pub ip: Ipv4Addr,
    pub ip6: Ipv6Addr,
    pub pod_cidr: &'static str,
    /// The node's pods' IPv6 addresses ([`pod_ipv6`] of the /24).
    pub pod_cidr6: &'static str,
    /// The address every node-side pod veth carries: the pods' gateway.
    pub gateway: Ipv4Addr,
    /// Pods that serve their name (backends).
    pub backends: &'static [(&'static str, Ipv4Addr)],
    /// Pods that serve nothing (clients inside the cluster).
    pub clients: &'static [(&'static str, Ipv4Addr)],
}

pub const NODE_A: NodeSpec = NodeSpec {
    name: "node-a",
    ip: Ipv4Addr::new(172, 31, 0, 2),
    ip6: Ipv6Addr::new(0xfd00, 0x31, 0, 0, 0, 0, 0, 2),
    pod_cidr: "10.244.1.0/24",
    pod_cidr6: "fd00:244::1:0/112",
    gateway: Ipv4Addr::new(10, 244, 1, 1),
    backends: &[
        ("a-1", Ipv4Addr::new(10, 244, 1, 11)),
        ("a-2", Ipv4Addr::new(10, 244, 1, 12)),
    ],
    clients: &[("a-client", Ipv4Addr::new(10, 244, 1, 14))],
};

pub const NODE_B: NodeSpec = NodeSpec {
    name: "node-b",
    ip: Ipv4Addr::new(172, 31, 0, 3),
    ip6: Ipv6Addr::new(0xfd00, 0x31, 0, 0, 0, 0, 0, 3),
    pod_cidr: "10.244.2.0/24",
    pod_cidr6: "fd00:244::2:0/112",
    gateway: Ipv4Addr::new(10, 244, 2, 1),
    backends: &[
        ("b-1", Ipv4Addr::new(10, 244, 2, 11)),
        ("b-2", Ipv4Addr::new(10, 244, 2, 12)),
    ],
    clients: &[],
};

pub const NODES: [NodeSpec; 2] = [NODE_A, NODE_B];

/// One node: its namespace, uplink and pods. Field order is drop order:
/// pods before the node.
pub struct Node {
    pub backends: Vec<Pod>,
    pub clients: Vec<Pod>,
    pub spec: NodeSpec,
    pub ns: Netns,
    /// The node's end of its link to the segment; carries `spec.ip`.
    pub uplink: String,
    /// The segment's end of that link: a port of the bridge.
    pub segment_port: String,
}

impl Node {
    pub fn name(&self) -> &'static str {
        self.spec.name
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.spec.ip
    }

    pub fn ip6(&self) -> Ipv6Addr {
        self.spec.ip6
    }

    /// The node-side ends of every pod's veth.
    pub fn pod_ifs(&self) -> Vec<String> {
        self.backends
            .iter()
            .chain(&self.clients)
            .map(|p| p.node_if.clone())
            .collect()
    }

    /// A pod of this node by name.
    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.backends.iter().chain(&self.clients).find(|p| p.name == name)
    }
}

/// The whole test bed. Field order is drop order: the nodes (pods first),
/// the client, then the segment.
pub struct TwoNodes {
    pub nodes: [Node; 2],
    pub client: Netns,
    pub client_if: String,
    /// The segment's end of the client's link: a port of the bridge.
    pub client_port: String,
    pub segment: Netns,
}

impl TwoNodes {
    /// Builds the namespaces, the bridge, links, addresses, routes and the
    /// backends' servers, with `offloads` on every veth end.
    pub fn build(offloads: Offloads) -> Result<Self> {
        let segment = Netns::new("xs")?;
        segment.ip(&["link", "add", "br0", "type", "bridge", "forward_delay", "0"])?;
        segment.ip(&["link", "set", "br0", "up"])?;

        let client = Netns::new("xc")?;
        let client_if = unique_name("cu");
        let client_port = attach_to_segment(&segment, &client, &client_if, "sc")?;
        client.add_addr(&client_if, &format!("{CLIENT_IP}/{SEGMENT_PREFIX}"))?;
        client.add_addr(&client_if, &format!("{CLIENT_IP6}/{SEGMENT_PREFIX6}"))?;
        for spec in NODES {
            // The client reaches pods directly (traffic that is no Service's).
            client.add_route(&[spec.pod_cidr, "via", &spec.ip.to_string(), "dev", &client_if])?;
            client.add_route(&[spec.pod_cidr6, "via", &spec.ip6.to_string(), "dev", &client_if])?;
        }

        let node_a = build_node(&segment, NODE_A, &NODE_B).context("building node-a")?;
        let node_b = build_node(&segment, NODE_B, &NODE_A).context("building node-b")?;
        offloads.apply(&client, &client_if)?;
        offloads.apply(&segment, &client_port)?;
        for node in [&node_a, &node_b] {
            offloads.apply(&node.ns, &node.uplink)?;
            offloads.apply(&segment, &node.segment_port)?;
            for pod in node.backends.iter().chain(&node.clients) {
                offloads.apply(&node.ns, &pod.node_if)?;
                offloads.apply(&pod.ns, "eth0")?;
            }
        }
        Ok(Self {
            nodes: [node_a, node_b],
            client,
            client_if,
            client_port,
            segment,
        })
    }

    pub fn node_a(&self) -> &Node {
        &self.nodes[0]
    }

    pub fn node_b(&self) -> &Node {
        &self.nodes[1]
    }

    /// Every backend pod of both nodes, node-a's first.
    pub fn backends(&self) -> impl Iterator<Item = &Pod> {
        self.nodes.iter().flat_map(|n| n.backends.iter())
    }

    /// The node running pod `name`, and the pod.
    pub fn find_pod(&self, name: &str) -> Option<(&Node, &Pod)> {
        self.nodes.iter().find_map(|n| Some((n, n.pod(name)?)))
    }
}

/// A veth from `ns` (end `ns_if`, up) to a new port of the segment's bridge
/// (end named `port_prefix` + a unique suffix); returns the port's name.
fn attach_to_segment(segment: &Netns, ns: &Netns, ns_if: &str, port_prefix: &str) -> Result<String> {
    let port = unique_name(port_prefix);
    netns::veth(segment, &port, ns, ns_if)?;
    segment.ip(&["link", "set", &port, "master", "br0"])?;
    Ok(port)
}

/// A node namespace on the segment with its pods; `other` is the node whose
/// pod CIDR it routes through that node's uplink address.
fn build_node(segment: &Netns, spec: NodeSpec, other: &NodeSpec) -> Result<Node> {
    let ns = node_ns("xn")?;
    // A NodePort flow to the other node's pod leaves by the interface it
    // came in on: no ICMP redirects to the client for that.
    ns.sysctl("net.ipv4.conf.all.send_redirects", "0")?;
    ns.sysctl("net.ipv4.conf.default.send_redirects", "0")?;

    let uplink = unique_name("nu");
    let segment_port = attach_to_segment(segment, &ns, &uplink, "sp")?;
    // What the uplink's XDP program sends back with XDP_TX (RST, ICMP)
    // lands on the bridge port's ring: see `Netns::attach_xdp_pass`.
    segment.ethtool_k(&segment_port, "gro", true)?;
    segment.attach_xdp_pass(&segment_port)?;
    ns.add_addr(&uplink, &format!("{}/{SEGMENT_PREFIX}", spec.ip))?;
    ns.add_route(&["default", "via", &CLIENT_IP.to_string(), "dev", &uplink])?;
    ns.add_route(&[other.pod_cidr, "via", &other.ip.to_string(), "dev", &uplink])?;
    ns.add_addr(&uplink, &format!("{}/{SEGMENT_PREFIX6}", spec.ip6))?;
    ns.add_route(&["::/0", "via", &CLIENT_IP6.to_string(), "dev", &uplink])?;
    ns.add_route(&[other.pod_cidr6, "via", &other.ip6.to_string(), "dev", &uplink])?;

    let gateway6 = pod_ipv6(spec.gateway);
    let mut backends = Vec::new();
    for &(name, ip) in spec.backends {
        let mut pod = add_pod(&ns, spec.gateway, name, ip)?;
        pod.add_ipv6(&ns, gateway6)?;
        pod.ns.serve_tcp(TARGET_PORT, name)?;
        pod.ns.serve_udp(TARGET_PORT, name)?;
        pod.ns.serve_tcp_peer(PEER_PORT, name)?;
        backends.push(pod);
    }
    let mut clients = Vec::new();
    for &(name, ip) in spec.clients {
        let mut pod = add_pod(&ns, spec.gateway, name, ip)?;
        pod.add_ipv6(&ns, gateway6)?;
        clients.push(pod);
    }
    Ok(Node {
        backends,
        clients,
        spec,
        ns,
        uplink,
        segment_port,
    })
}
