//! One simulated node with pods, and a client outside it.
//!
//! ```text
//!   client ns                node ns (ip_forward=1)                  pod nss
//!   CLIENT_IP ── cu* ═══ nu* ── NODE_IP          np*  10.244.0.1/32 ═ eth0 pod-1 10.244.0.11
//!   gro on (*),                                       np*  10.244.0.1/32 ═ eth0 pod-2 10.244.0.12
//!   XDP_PASS     default via CLIENT_IP            np*  10.244.0.1/32 ═ eth0 pod-3 10.244.0.13
//!                                                 np*  10.244.0.1/32 ═ eth0 client-pod 10.244.0.14
//! ```
//!
//! (*) but with [`Offloads::Off`], which turns GRO off on every veth end.
//!
//! Every link carries IPv6 too (ULA, duplicate address detection off):
//! [`CLIENT_IP6`] and [`NODE_IP6`] on the client link, [`POD_GATEWAY6`] on
//! each node-side pod veth, [`pod_ipv6`] of its IPv4 address in each pod.
//!
//! Pods are wired like the CNI `ptp` plugin: a /32 address, a link route to
//! the gateway address that every node-side veth carries, and a route per
//! pod on the node. Backends answer with their pod name on TCP and UDP
//! [`TARGET_PORT`]. The client pod is not a backend: a backend reaching its
//! own Service is hairpin traffic, which needs SNAT.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result};

use crate::{
    netns::{self, Netns},
    privileged::unique_name,
};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 1);
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);
/// The address every node-side pod veth carries: the pods' gateway.
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 1);
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The port backends listen on (TCP and UDP).
pub const TARGET_PORT: u16 = 80;
pub const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("pod-1", Ipv4Addr::new(10, 244, 0, 11)),
    ("pod-2", Ipv4Addr::new(10, 244, 0, 12)),
    ("pod-3", Ipv4Addr::new(10, 244, 0, 13)),
];
pub const CLIENT_POD: (&str, Ipv4Addr) = ("client-pod", Ipv4Addr::new(10, 244, 0, 14));

pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 1);
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 2);
/// The pods' IPv6 gateway, on every node-side pod veth.
pub const POD_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 1);
pub const POD_CIDR6: &str = "fd00:244::/64";

/// A pod's IPv6 address: `10.244.A.B` is `fd00:244::A:B` (hex: pod-1,
/// 10.244.0.11, is `fd00:244::b`; the two-node bed's a-1, 10.244.1.11,
/// `fd00:244::1:b`). Gateways map the same way.
pub fn pod_ipv6(ip: Ipv4Addr) -> Ipv6Addr {
    let [_, _, a, b] = ip.octets();
    Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, a.into(), b.into())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offloads {
    /// veth defaults: checksum offload and TSO on (local TCP/UDP leaves as
    /// CHECKSUM_PARTIAL, TCP in GSO super packets of up to 64 KB), GRO off
    /// but where the test bed turns it on.
    On,
    /// `ethtool -K <veth> tx off` on every veth end: full checksums, and
    /// with them no TSO: the stack's GSO packets are segmented as they
    /// leave a veth (after its tc egress hook, which still sees them whole).
    TxOff,
    /// `tx off` and `gro off` on every veth end: as [`Offloads::TxOff`],
    /// and no veth builds super packets from what it receives.
    Off,
}

impl Offloads {
    /// Sets these offloads on the veth end `dev` in `ns`.
    pub fn apply(self, ns: &Netns, dev: &str) -> Result<()> {
        ns.ethtool_k(dev, "tx", self == Offloads::On)?;
        if self == Offloads::Off {
            ns.ethtool_k(dev, "gro", false)?;
        }
        Ok(())
    }

    /// What a test label ends with: "" for the defaults.
    pub fn suffix(self) -> &'static str {
        match self {
            Offloads::On => "",
            Offloads::TxOff => "_tx_off",
            Offloads::Off => "_offloads_off",
        }
    }
}

/// One pod: its namespace and the node-side end of its veth.
pub struct Pod {
    pub name: &'static str,
    pub ip: Ipv4Addr,
    /// Set by [`Pod::add_ipv6`] (the one-node bed's pods have one).
    pub ip6: Option<Ipv6Addr>,
    pub node_if: String,
    pub ns: Netns,
}

/// The namespaces and links; no data path. Field order is drop order: pods
/// before the node, whose deletion removes the remaining veth ends.
pub struct Topology {
    pub backends: Vec<Pod>,
    pub client_pod: Pod,
    pub node: Netns,
    pub uplink: String,
    pub client: Netns,
    pub client_if: String,
}

/// A node namespace (named `prefix` and a unique suffix): forwarding on,
/// reverse path filtering off, no ICMP rate limit. Every bed's nodes, the
/// bench's too, are made so.
pub fn node_ns(prefix: &str) -> Result<Netns> {
    let node = Netns::new(prefix)?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    // Replies the programs rev-NAT (source = a ClusterIP) arrive on a pod
    // veth although the route back to a ClusterIP is the uplink: strict
    // reverse path filtering would drop them. Do not inherit the host's
    // setting; be explicit (eBPF proxies run nodes with it off, too).
    node.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
    node.sysctl("net.ipv4.conf.default.rp_filter", "0")?;
    node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    // The node's kernel answers a closed port, and the kernel modes'
    // REJECT rules answer a Service without endpoints, with ICMP errors
    // that are rate-limited per destination (a burst of 6, then 1/s)
    // and in all (icmp_msgs_per_sec, a burst of 50; on older kernels
    // one budget for every namespace, so tests running side by side
    // spend each other's): a refused UDP probe would sometimes end with
    // no answer instead. No ICMP type is rate-limited here
    // (`icmp_ratemask` 0 lifts both limits). The programs' own
    // rejections are not limited.
    limit_no_icmp(&node)?;
    Ok(node)
}

/// Lifts the kernel's ICMP rate limits in `ns` (see [`node_ns`]).
pub fn limit_no_icmp(ns: &Netns) -> Result<()> {
    ns.sysctl("net.ipv4.icmp_ratelimit", "0")?;
    ns.sysctl("net.ipv4.icmp_ratemask", "0")?;
    ns.sysctl("net.ipv6.icmp.ratelimit", "0")
}

/// The client's link to the node: a veth pair, [`CLIENT_IP`] and [`NODE_IP`]
/// on its ends, the node's default route via the client (node processes
/// reach ClusterIPs through the uplink) and the client's route to
/// `client_route` via the node. Returns (client end, node end: the uplink).
pub fn link_client(client: &Netns, node: &Netns, client_route: &str) -> Result<(String, String)> {
    let client_if = unique_name("cu");
    let uplink = unique_name("nu");
    netns::veth(client, &client_if, node, &uplink)?;
    client.add_addr(&client_if, &format!("{CLIENT_IP}/24"))?;
    node.add_addr(&uplink, &format!("{NODE_IP}/24"))?;
    node.add_route(&["default", "via", &CLIENT_IP.to_string(), "dev", &uplink])?;
    client.add_route(&[client_route, "via", &NODE_IP.to_string(), "dev", &client_if])?;
    // What the uplink's XDP program sends back with XDP_TX (RST, ICMP)
    // lands on the client end's ring; GRO gives that end a ring, but only
    // an XDP program there makes the kernel poll it at once (see
    // `Netns::attach_xdp_pass`). A physical uplink has neither problem.
    client.ethtool_k(&client_if, "gro", true)?;
    client.attach_xdp_pass(&client_if)?;
    Ok((client_if, uplink))
}

impl Topology {
    /// Builds the namespaces, links, addresses, routes and the backends'
    /// servers.
    pub fn build(offloads: Offloads) -> Result<Self> {
        let client = Netns::new("xc")?;
        let node = node_ns("xn")?;

        // Lets the client reach pods directly (traffic that is no Service's).
        let (client_if, uplink) = link_client(&client, &node, POD_CIDR)?;
        link_client_ipv6(&client, &client_if, &node, &uplink)?;

        let mut backends = Vec::new();
        for (name, ip) in BACKENDS {
            let mut pod = add_pod(&node, POD_GATEWAY, name, ip)?;
            pod.add_ipv6(&node, POD_GATEWAY6)?;
            pod.ns.serve_tcp(TARGET_PORT, name)?;
            pod.ns.serve_udp(TARGET_PORT, name)?;
            backends.push(pod);
        }
        let mut client_pod = add_pod(&node, POD_GATEWAY, CLIENT_POD.0, CLIENT_POD.1)?;
        client_pod.add_ipv6(&node, POD_GATEWAY6)?;

        offloads.apply(&client, &client_if)?;
        offloads.apply(&node, &uplink)?;
        for pod in backends.iter().chain([&client_pod]) {
            offloads.apply(&node, &pod.node_if)?;
            offloads.apply(&pod.ns, "eth0")?;
        }
        Ok(Self {
            backends,
            client_pod,
            node,
            uplink,
            client,
            client_if,
        })
    }

    /// Routes `nets` from the client to the node (a Service's LoadBalancer
    /// and external IPs, which no network of the bed holds).
    pub fn route_to_node(&self, nets: &[&str]) -> Result<()> {
        for net in nets {
            let via = if net.contains(':') {
                NODE_IP6.to_string()
            } else {
                NODE_IP.to_string()
            };
            self.client.add_route(&[net, "via", &via, "dev", &self.client_if])?;
        }
        Ok(())
    }

    /// The node-side ends of every pod's veth.
    pub fn pod_ifs(&self) -> Vec<String> {
        self.backends
            .iter()
            .chain([&self.client_pod])
            .map(|p| p.node_if.clone())
            .collect()
    }
}

/// A pod namespace behind a veth from `node`, wired like CNI `ptp` with
/// `gateway` as the node-side address.
pub fn add_pod(node: &Netns, gateway: Ipv4Addr, name: &'static str, ip: Ipv4Addr) -> Result<Pod> {
    let ns = Netns::new("xp")?;
    let node_if = unique_name("np");
    netns::veth(node, &node_if, &ns, "eth0")?;
    ns.add_addr("eth0", &format!("{ip}/32"))?;
    ns.add_route(&[&gateway.to_string(), "dev", "eth0", "scope", "link"])?;
    ns.add_route(&["default", "via", &gateway.to_string(), "dev", "eth0"])?;
    node.add_addr(&node_if, &format!("{gateway}/32"))?;
    node.add_route(&[&format!("{ip}/32"), "dev", &node_if])?;
    // A pod answers a closed port with an ICMP error, limited per
    // destination as the node's are (see `node_ns`). Refused requests
    // land on backends at random; when too many land on one, its error
    // is not sent (the pod's OutRateLimitHost counts it) and the probe
    // sees a timeout instead of ECONNREFUSED.
    limit_no_icmp(&ns)?;
    Ok(Pod {
        name,
        ip,
        ip6: None,
        node_if,
        ns,
    })
}

/// IPv6 on the client link made by [`link_client`]: [`CLIENT_IP6`] and
/// [`NODE_IP6`], the node's default route via the client and the
/// client's route to [`POD_CIDR6`] via the node.
pub fn link_client_ipv6(client: &Netns, client_if: &str, node: &Netns, uplink: &str) -> Result<()> {
    client.add_addr(client_if, &format!("{CLIENT_IP6}/64"))?;
    node.add_addr(uplink, &format!("{NODE_IP6}/64"))?;
    node.add_route(&["::/0", "via", &CLIENT_IP6.to_string(), "dev", uplink])?;
    client.add_route(&[POD_CIDR6, "via", &NODE_IP6.to_string(), "dev", client_if])
}

impl Pod {
    /// Gives the pod its IPv6 address ([`pod_ipv6`]), wired like the IPv4
    /// one: a /128, a link route to `gateway` (on the node-side veth;
    /// [`POD_GATEWAY6`] on the one-node bed) and the default route via it;
    /// the node's route to the /128.
    pub fn add_ipv6(&mut self, node: &Netns, gateway: Ipv6Addr) -> Result<()> {
        let ip6 = pod_ipv6(self.ip);
        let gateway = gateway.to_string();
        self.ns.add_addr("eth0", &format!("{ip6}/128"))?;
        self.ns.add_route(&[&gateway, "dev", "eth0"])?;
        self.ns.add_route(&["::/0", "via", &gateway, "dev", "eth0"])?;
        node.add_addr(&self.node_if, &format!("{gateway}/128"))?;
        node.add_route(&[&format!("{ip6}/128"), "dev", &self.node_if])?;
        self.ip6 = Some(ip6);
        Ok(())
    }
}

/// Gives `node` a firewall that drops forwarded packets the kernel's
/// conntrack finds invalid, in both families, as Calico's rules, many host
/// firewalls and kube-proxy's own iptables mode do: a mode that lets the
/// kernel track half a flow (replies passing its hooks by) loses that
/// flow's packets to it.
pub fn drop_invalid_forwarding(node: &Netns) -> Result<()> {
    for tool in ["iptables", "ip6tables"] {
        node.exec(&[
            tool,
            "-A",
            "FORWARD",
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID",
            "-j",
            "DROP",
        ])
        .with_context(|| format!("{tool}: the INVALID drop rule"))?;
    }
    Ok(())
}
