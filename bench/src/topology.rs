//! The bench's cluster: an outside client, a node, [`PODS`] backend pods
//! and a client pod, in network namespaces, built from the testbed's pieces.
//!
//! ```text
//!   client ns              node ns (ip_forward=1)               pod nss
//!   172.30.0.1 ── veth ── 172.30.0.2     np* ═ eth0 pod-0 10.244.0.11, answers on 10.160.0.0/16
//!   10.128.0.0/9 via node                ...
//!                                        np* ═ eth0 pod-9 10.244.0.20, answers on 10.169.0.0/16
//!                                        np* ═ eth0 client-pod 10.244.0.100
//! ```
//!
//! Each backend pod answers on its primary address and on every address of
//! its /16 (a `local` route in the pod, like AnyIP), so all endpoints of
//! every Service are real and distinct. One multi-threaded server
//! ([`PodServers`]) serves port 80 in every backend pod.
//!
//! IPv6 as on the testbed's bed: the client link has `fd00:30::1` and
//! `fd00:30::2`, every pod its `pod_ipv6` address (`fd00:244::b` for
//! 10.244.0.11, the client pod `fd00:244::64`): what the dual-stack last
//! Service's IPv6 rows go through.

use std::net::Ipv4Addr;

use anyhow::{Context, Result};
use testbed::{
    netns::Netns,
    topology::{POD_GATEWAY, POD_GATEWAY6, Pod, add_pod, link_client, link_client_ipv6, node_ns},
};

use crate::{
    server::PodServers,
    services::{PODS, TARGET_PORT, endpoint_block},
};

const POD_NAMES: [&str; PODS] = [
    "pod-0", "pod-1", "pod-2", "pod-3", "pod-4", "pod-5", "pod-6", "pod-7", "pod-8", "pod-9",
];
const CLIENT_POD: (&str, Ipv4Addr) = ("client-pod", Ipv4Addr::new(10, 244, 0, 100));
/// What the client routes through the node: the pods and their endpoint blocks.
const CLIENT_ROUTE: &str = "10.128.0.0/9";
/// Threads of the pods' server: as many as the machine has CPUs, at most 4.
pub fn server_workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().min(4))
}

/// A backend pod's primary address.
pub fn pod_ip(pod: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 0, 11 + pod as u8)
}

pub fn pod_name(pod: usize) -> &'static str {
    POD_NAMES[pod]
}

/// Field order is drop order: the server (its sockets keep namespaces
/// alive) before the pods, the pods before the node.
pub struct BenchTopology {
    _servers: PodServers,
    _pods: Vec<Pod>,
    pub client_pod: Pod,
    pub node: Netns,
    pub client: Netns,
}

impl BenchTopology {
    pub fn build() -> Result<Self> {
        let client = Netns::new("bc")?;
        // As the testbed's node: forwarding on, no reverse-path filter
        // (rev-NATed replies come in on pod veths), no ICMP rate limit.
        let node = node_ns("bn")?;

        let (client_if, uplink) = link_client(&client, &node, CLIENT_ROUTE)?;
        link_client_ipv6(&client, &client_if, &node, &uplink)?;

        let servers = PodServers::new(server_workers())?;
        let mut pods = Vec::with_capacity(PODS);
        for (k, name) in POD_NAMES.iter().enumerate() {
            let mut pod = add_pod(&node, POD_GATEWAY, name, pod_ip(k))?;
            pod.add_ipv6(&node, POD_GATEWAY6)?;
            let (block, len) = endpoint_block(k);
            let cidr = format!("{block}/{len}");
            pod.ns
                .ip(&["route", "add", "local", &cidr, "dev", "lo"])
                .with_context(|| format!("{name}: answering on {cidr}"))?;
            node.add_route(&[&cidr, "dev", &pod.node_if])?;
            servers.serve(&pod.ns, TARGET_PORT, name)?;
            pods.push(pod);
        }
        let mut client_pod = add_pod(&node, POD_GATEWAY, CLIENT_POD.0, CLIENT_POD.1)?;
        client_pod.add_ipv6(&node, POD_GATEWAY6)?;
        Ok(Self {
            _servers: servers,
            _pods: pods,
            client_pod,
            node,
            client,
        })
    }
}

/// The pod network a CNI's masquerade rule keeps its hands off.
const POD_NETWORK: &str = "10.244.0.0/16";
/// The nftables table holding [`CniMasquerade`]'s rule.
const CNI_TABLE: &str = "bench-cni-masquerade";

/// A CNI's masquerade rule in the node's nat table (flannel, Calico's
/// natOutgoing and kindnet install one: pods' traffic leaving the pod
/// network is masqueraded), for as long as the value lives.
///
/// The flows the baseline measures stay inside the pod network or come from
/// outside, so the rule rewrites none of them; what it changes is that a nat
/// chain makes the kernel track every flow. It is an nftables table of its
/// own rather than an iptables rule because deleting the table turns the
/// kernel's conntrack off again (an emptied iptables nat table stays
/// registered), so rounds with and without it can alternate on one node.
pub struct CniMasquerade<'a> {
    node: &'a Netns,
    removed: bool,
}

impl<'a> CniMasquerade<'a> {
    pub fn install(node: &'a Netns) -> Result<Self> {
        node.exec(&["nft", "add", "table", "ip", CNI_TABLE])
            .context("the CNI masquerade table")?;
        let rule = Self { node, removed: false };
        node.exec(&[
            "nft",
            "add",
            "chain",
            "ip",
            CNI_TABLE,
            "postrouting",
            "{ type nat hook postrouting priority srcnat; }",
        ])
        .context("the CNI masquerade chain")?;
        node.exec(&[
            "nft",
            "add",
            "rule",
            "ip",
            CNI_TABLE,
            "postrouting",
            "ip",
            "saddr",
            POD_NETWORK,
            "ip",
            "daddr",
            "!=",
            POD_NETWORK,
            "masquerade",
        ])
        .context("the CNI masquerade rule")?;
        Ok(rule)
    }

    /// Deletes the table; an error here means the next rounds would not be
    /// on a bare node.
    pub fn remove(mut self) -> Result<()> {
        self.removed = true;
        self.node
            .exec(&["nft", "delete", "table", "ip", CNI_TABLE])
            .map(drop)
            .context("removing the CNI masquerade table")
    }
}

impl Drop for CniMasquerade<'_> {
    /// On an error path only (the node namespace goes soon after anyway).
    fn drop(&mut self) {
        if !self.removed {
            let _ = self.node.exec(&["nft", "delete", "table", "ip", CNI_TABLE]);
        }
    }
}
