//! Bulk transfers through every Service path, in every mode: 64 MiB each
//! way per path, checked by SHA-256 at the receiver (`testbed::bulk`), the
//! real agent (`xproxy run --mode MODE --manifests DIR`) translating. The
//! other suites move a few hundred bytes per connection, which never fills
//! a window, never makes a GSO or GRO super packet and never retransmits:
//! a NodePort download that stalled after ~200 KB in ebpf mode passed them
//! all (issue 11; with that bug back, `bulk_ebpf*` fail 1 to 4 rows each).
//!
//! A test is one mode on one test bed with one set of offloads, so the
//! modes run in parallel; each runs a table of (path, direction) rows, the
//! pod that must serve each row named, and reports every row, a failed one
//! with how many bytes got through at both ends.
//!
//! The one-node test bed (`testbed::topology`), Services whose bulk
//! servers listen on [`BULK_PORT`] in the pods ([`Path`]):
//! - NodePort from the outside client, the backend on the node;
//! - NodePort (the node's address) from a pod;
//! - ClusterIP from a pod;
//! - ClusterIP from the node itself;
//! - hairpin: a backend to the ClusterIP of a Service whose only endpoint
//!   is itself;
//! - NodePort with `externalTrafficPolicy: Local` from the outside client;
//! - a LoadBalancer ingress IP from the outside client, and the same
//!   Service's external IP from a pod (the client routes both to the node);
//! - ClientIP affinity: a ClusterIP with every pod behind it, from a pod:
//!   whichever pod served the first small download must serve every
//!   transfer after it.
//!
//! Each in ebpf, iptables, nftables, IPVS (where the kernel has it: `cargo
//! xtask vm` runs `bulk:ipvs` in its guest) and userspace mode, with the
//! veths' default offloads (`bulk_MODE`) and with `tx off` and `gro off` on
//! every veth end (`bulk_MODE_offloads_off`: full checksums, TCP segmented
//! as it leaves a veth, no GRO); in ebpf mode also with the uplink's
//! program at native XDP (`bulk_ebpf_xdp_native`; asserted attached, and
//! without `--xdp native` asserted not).
//!
//! The nodes are configured as real ones are: the agent knows the pod
//! networks (`--cluster-cidr`, both families), and the node's firewall
//! drops forwarded packets its conntrack finds invalid (Calico's rules,
//! many host firewalls and kube-proxy's iptables mode do), which loses any
//! flow the kernel tracks only half of. In ebpf mode the programs keep the
//! kernel's conntrack off flows to pods that need no SNAT (`notrack`); the
//! one-node tests then read the node's conntrack table back: no entry of
//! the client pod's transfers, the hairpin's (masqueraded) present. Under
//! native XDP too: XDP leaves the mark in the packet's metadata for tc.
//! They also check that the replies to the client pod were handed into it
//! (`bpf_redirect_peer`): the node's end of its veth transmitted next to
//! nothing of the hundreds of MiB its eth0 received.
//!
//! IPv6 ([`Route`]): the Services of the first paths are dual-stack
//! (`fd00:96::80`, `fd00:96::82`, an IPv6 EndpointSlice of the same pod
//! beside the IPv4 one) and the agent is given both node addresses; the
//! same tests run [`IPV6_PATHS`] over IPv6 too, both ways, rows named
//! `... (IPv6)`: NodePort (`Cluster`, `[fd00:30::2]:30880`, and `Local`)
//! from the outside client, ClusterIP (`[fd00:96::80]:80`) from a pod and
//! from the node. The other paths, and the two-node bed, are IPv4 only
//! (fewer rows of more value: CI time). Every mode runs them.
//!
//! The two-node test bed (`testbed::two_node`), a Service whose only
//! endpoint runs on node-b ([`RemotePath`]): NodePort on node-a from the
//! outside client (node-a DNATs and SNATs, the data crosses the segment
//! twice), and its ClusterIP from a pod on node-a; in ebpf, iptables and
//! nftables mode, ebpf and iptables also with offloads off, ebpf also with
//! native XDP.
//!
//! Where the modes differ: nowhere in what arrives. Every row passes in
//! every mode, both ways, with either offloads (asserted; IPVS in the 6.1
//! guest, the others on the 6.18 host and in the guest), the IPv6 rows
//! too. How the bytes get
//! there differs (see `modes.rs` and `two_node.rs` for the addresses a
//! backend sees):
//!
//! | path | ebpf | iptables | nftables | ipvs | userspace
//! |---|---|---|---|---|---
//! | NodePort from the client, backend local | intact (DNAT at the uplink's XDP or tc hook; the reply rev-NATed on the pod's veth and redirected to the uplink: where issue 11 stalled) | intact (DNAT + masquerade) | intact (the same) | intact (the same) | intact (the agent copies every byte between its two connections)
//! | NodePort from a pod | intact (tc on the pod's veth) | intact | intact | intact | intact (copied)
//! | ClusterIP from a pod | intact | intact | intact | intact | intact (copied)
//! | ClusterIP from the node | intact (translated at the uplink's tc egress and redirected to the pod: the node's own GSO packets, whole) | intact | intact | intact | intact (copied)
//! | hairpin | intact (the programs DNAT and mark, the kernel masquerades) | intact | intact | intact | intact (copied)
//! | `externalTrafficPolicy: Local` NodePort | intact | intact | intact | intact | intact (copied)
//! | LoadBalancer IP from the client | intact (the uplink's hook, as a NodePort) | intact | intact | intact (the address bound to `kube-ipvs0`) | not run (the mode serves no LB IP)
//! | external IP from a pod | intact (tc on the pod's veth) | intact | intact | intact | not run (no external IPs)
//! | ClientIP affinity, ClusterIP from a pod | intact, every transfer to the first pod | intact (`-m recent`) | intact (affinity set) | intact (persistence) | intact (the agent's balancer)
//! | IPv6: NodePort from the client, backend local | intact (the IPv6 path of the uplink's hook, `XP_CT6`) | intact (`ip6tables`: DNAT + masquerade) | intact (table `ip6 xproxy`) | intact (IPv6 virtual server on `[fd00:30::2]`) | intact (copied; the IPv6 listener)
//! | IPv6: ClusterIP from a pod | intact (tc on the pod's veth) | intact | intact | intact (`fd00:96::80/128` on `kube-ipvs0`) | intact (copied)
//! | IPv6: ClusterIP from the node | intact (the uplink's tc egress) | intact | intact | intact | intact (copied; DNAT to `[::1]` from OUTPUT)
//! | IPv6: `externalTrafficPolicy: Local` NodePort | intact | intact | intact | intact | intact (copied)
//! | two nodes: NodePort to the other node's backend | intact (DNAT and mark at the uplink, the kernel masquerades and forwards it back out of the uplink) | intact | intact | not run | not run
//! | two nodes: ClusterIP from a pod to the other node's backend | intact | intact | intact | not run | not run

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Instant,
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use testbed::{
    agent_bed::{AgentBed, Mode, READY_WITHIN},
    bulk::{BULK_PORT, Direction, Report},
    fixtures::{
        NODE_NAME, PortDef, TrafficPolicy, dual_stack, load_balancer, on_node, service_with, slice_with, slice6_with,
        yaml_documents,
    },
    netns::{self, Netns},
    probe::{Checks, Protocol},
    topology::{
        BACKENDS, CLIENT_IP, CLIENT_POD, NODE_IP, NODE_IP6, Offloads, POD_CIDR, POD_CIDR6, Topology,
        drop_invalid_forwarding, pod_ipv6,
    },
    two_node::{NODE_A, NODE_B, TwoNodes},
    two_node_bed::TwoNodeBed,
};

/// Bytes per transfer.
const BYTES: u64 = 64 << 20;
/// What a test bed's first transfer moves, to see that the agent is ready.
const PROBE_BYTES: u64 = 1024;
const MANIFEST: &str = "bulk.yaml";

// ---------------------------------------------------------------------------
// The Services.

/// A NodePort Service whose only endpoint is one pod: every Service's
/// port is 80, to the bulk servers' port. With `ip6`, dual-stack: that
/// IPv6 ClusterIP and an IPv6 EndpointSlice of the same pod beside the
/// IPv4 ones.
struct OneEndpoint {
    name: &'static str,
    ip: Ipv4Addr,
    ip6: Option<Ipv6Addr>,
    node_port: u16,
    policy: TrafficPolicy,
}

const SERVICE_PORT: u16 = 80;

/// One node: pod-1 only, dual-stack. Every path but the `Local` one;
/// pod-1 is also the hairpin's client.
const BULK: OneEndpoint = OneEndpoint::new("bulk", Ipv4Addr::new(10, 96, 0, 80), 30880, TrafficPolicy::Cluster)
    .with_ipv6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x80));
const BULK_POD: usize = 0;
/// One node: pod-2 only, `externalTrafficPolicy: Local`, dual-stack.
const LOCAL: OneEndpoint = OneEndpoint::new("bulk-local", Ipv4Addr::new(10, 96, 0, 82), 30882, TrafficPolicy::Local)
    .with_ipv6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x82));
const LOCAL_POD: usize = 1;
/// One node: pod-3 only, a LoadBalancer with [`LB_IP`] and [`EXTERNAL_IP`].
const LB: OneEndpoint = OneEndpoint::new("bulk-lb", Ipv4Addr::new(10, 96, 0, 83), 30883, TrafficPolicy::Cluster);
const LB_POD: usize = 2;
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 83);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 83);
/// What the client routes to the node: [`LB_IP`] and [`EXTERNAL_IP`].
const EXTERNAL_NETS: [&str; 2] = ["203.0.113.0/24", "198.51.100.0/24"];
/// One node: every pod, `sessionAffinity: ClientIP`.
const STICKY: OneEndpoint = OneEndpoint::new(
    "bulk-sticky",
    Ipv4Addr::new(10, 96, 0, 84),
    30884,
    TrafficPolicy::Cluster,
);
/// Two nodes: b-1 (on node-b) only, behind a NodePort on both nodes.
const REMOTE: OneEndpoint = OneEndpoint::new(
    "bulk-remote",
    Ipv4Addr::new(10, 96, 1, 80),
    30980,
    TrafficPolicy::Cluster,
);
const REMOTE_POD: (&str, Ipv4Addr) = NODE_B.backends[0];
/// Two nodes: the client pod on node-a.
const NODE_A_CLIENT: &str = NODE_A.clients[0].0;

impl OneEndpoint {
    const fn new(name: &'static str, ip: Ipv4Addr, node_port: u16, policy: TrafficPolicy) -> Self {
        Self {
            name,
            ip,
            ip6: None,
            node_port,
            policy,
        }
    }

    const fn with_ipv6(self, ip6: Ipv6Addr) -> Self {
        Self { ip6: Some(ip6), ..self }
    }

    /// The Service and its EndpointSlices: `pod` on node `node` (and
    /// [`pod_ipv6`] of it in the IPv6 one, if the Service is dual-stack).
    fn objects(&self, pod: Ipv4Addr, node: &str) -> Vec<Value> {
        let ports = self.ports();
        let service = service_with(self.name, self.ip, &ports, Some(self.policy));
        let slice = slice_with(&format!("{}-1", self.name), self.name, &ports, &[(pod, node)]);
        match self.ip6 {
            None => vec![service, slice],
            Some(ip6) => {
                let slice6 = slice6_with(
                    &format!("{}-v6-1", self.name),
                    self.name,
                    &ports,
                    &[(pod_ipv6(pod), node)],
                );
                vec![dual_stack(service, ip6), slice, slice6]
            }
        }
    }

    fn ports(&self) -> [PortDef; 1] {
        [PortDef {
            name: Some("bulk"),
            protocol: Protocol::Tcp,
            port: SERVICE_PORT,
            target_port: BULK_PORT,
            node_port: Some(self.node_port),
        }]
    }

    /// The ClusterIP of `family` (an IPv6 one only if dual-stack).
    fn cluster_ip(&self, family: Family) -> Result<SocketAddr> {
        let ip = match family {
            Family::V4 => IpAddr::from(self.ip),
            Family::V6 => self
                .ip6
                .with_context(|| format!("{} has no IPv6 ClusterIP", self.name))?
                .into(),
        };
        Ok(SocketAddr::new(ip, SERVICE_PORT))
    }

    fn node_port(&self, node: impl Into<IpAddr>) -> SocketAddr {
        SocketAddr::new(node.into(), self.node_port)
    }
}

fn one_node_objects() -> Vec<Value> {
    let mut objects = Vec::new();
    objects.extend(BULK.objects(BACKENDS[BULK_POD].1, NODE_NAME));
    objects.extend(LOCAL.objects(BACKENDS[LOCAL_POD].1, NODE_NAME));
    // The Service first, then its EndpointSlice.
    let mut lb = LB.objects(BACKENDS[LB_POD].1, NODE_NAME);
    lb[0] = load_balancer(lb[0].take(), &[(LB_IP, None)]);
    lb[0]["spec"]["externalIPs"] = json!([EXTERNAL_IP.to_string()]);
    objects.extend(lb);
    let mut sticky = service_with(STICKY.name, STICKY.ip, &STICKY.ports(), None);
    sticky["spec"]["sessionAffinity"] = json!("ClientIP");
    let every_pod: Vec<Ipv4Addr> = BACKENDS.iter().map(|(_, ip)| *ip).collect();
    let sticky_slice = slice_with("bulk-sticky-1", STICKY.name, &STICKY.ports(), &on_node(&every_pod));
    objects.extend([sticky, sticky_slice]);
    objects
}

// ---------------------------------------------------------------------------
// The paths.

/// A path through the one-node test bed.
#[derive(Clone, Copy, Debug)]
enum Path {
    NodePortFromClient,
    NodePortFromPod,
    ClusterIpFromPod,
    ClusterIpFromNode,
    Hairpin,
    LocalNodePortFromClient,
    LbIpFromClient,
    ExternalIpFromPod,
    StickyClusterIpFromPod,
}

impl Path {
    const ALL: [Path; 9] = [
        Path::NodePortFromClient,
        Path::NodePortFromPod,
        Path::ClusterIpFromPod,
        Path::ClusterIpFromNode,
        Path::Hairpin,
        Path::LocalNodePortFromClient,
        Path::LbIpFromClient,
        Path::ExternalIpFromPod,
        Path::StickyClusterIpFromPod,
    ];

    /// The paths `mode` serves: the userspace mode has no LoadBalancer or
    /// external IPs (as kube-proxy's legacy proxier in this project).
    fn of(mode: Mode) -> Vec<Path> {
        let external = |p: &Path| matches!(p, Path::LbIpFromClient | Path::ExternalIpFromPod);
        Path::ALL
            .into_iter()
            .filter(|p| mode != Mode::Userspace || !external(p))
            .collect()
    }

    /// Where the client runs, what it connects to in `family`, and the pod
    /// that must serve (`sticky`: the pod the affinity path's client was
    /// given first).
    fn ends<'a>(self, family: Family, topo: &'a Topology, sticky: &'a str) -> Result<Ends<'a>> {
        let bulk = &topo.backends[BULK_POD];
        let lb = topo.backends[LB_POD].name;
        let node = family.node_ip();
        let (from, to, server) = match self {
            Path::NodePortFromClient => (&topo.client, BULK.node_port(node), bulk.name),
            Path::NodePortFromPod => (&topo.client_pod.ns, BULK.node_port(node), bulk.name),
            Path::ClusterIpFromPod => (&topo.client_pod.ns, BULK.cluster_ip(family)?, bulk.name),
            Path::ClusterIpFromNode => (&topo.node, BULK.cluster_ip(family)?, bulk.name),
            Path::Hairpin => (&bulk.ns, BULK.cluster_ip(family)?, bulk.name),
            Path::LocalNodePortFromClient => (&topo.client, LOCAL.node_port(node), topo.backends[LOCAL_POD].name),
            Path::LbIpFromClient => (&topo.client, ipv4_only(family, LB_IP)?, lb),
            Path::ExternalIpFromPod => (&topo.client_pod.ns, ipv4_only(family, EXTERNAL_IP)?, lb),
            Path::StickyClusterIpFromPod => (&topo.client_pod.ns, STICKY.cluster_ip(family)?, sticky),
        };
        Ok(Ends { from, to, server })
    }
}

/// `ip` at the Services' port; there is no IPv6 one.
fn ipv4_only(family: Family, ip: Ipv4Addr) -> Result<SocketAddr> {
    if family == Family::V6 {
        bail!("{ip} has no IPv6 counterpart in this test bed");
    }
    Ok(SocketAddr::new(ip.into(), SERVICE_PORT))
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Path::NodePortFromClient => "NodePort from the client",
            Path::NodePortFromPod => "NodePort from a pod",
            Path::ClusterIpFromPod => "ClusterIP from a pod",
            Path::ClusterIpFromNode => "ClusterIP from the node",
            Path::Hairpin => "hairpin (the backend to its own Service)",
            Path::LocalNodePortFromClient => "NodePort, externalTrafficPolicy: Local, from the client",
            Path::LbIpFromClient => "LoadBalancer IP from the client",
            Path::ExternalIpFromPod => "external IP from a pod",
            Path::StickyClusterIpFromPod => "ClientIP affinity: ClusterIP from a pod",
        })
    }
}

/// Which of its addresses a row's client connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    /// The node's address of this family: where its node ports answer.
    fn node_ip(self) -> IpAddr {
        match self {
            Family::V4 => NODE_IP.into(),
            Family::V6 => NODE_IP6.into(),
        }
    }
}

/// The paths with IPv6 rows as well: NodePort (`Cluster` and `Local`)
/// from the outside client, ClusterIP from a pod and from the node. The
/// paths of most value only: each adds 128 MiB (both ways) to every test
/// of a mode, and the IPVS guest emulates its CPU. The other paths run
/// over IPv4 only.
const IPV6_PATHS: [Path; 4] = [
    Path::NodePortFromClient,
    Path::ClusterIpFromPod,
    Path::ClusterIpFromNode,
    Path::LocalNodePortFromClient,
];

/// A [`Path`] in one [`Family`]: a row of the one-node table.
#[derive(Clone, Copy, Debug)]
struct Route {
    path: Path,
    family: Family,
}

impl Route {
    /// Every path `mode` serves over IPv4, then [`IPV6_PATHS`] over IPv6.
    fn of(mode: Mode) -> Vec<Route> {
        let in_family = |family| move |&path| Route { path, family };
        Path::of(mode)
            .iter()
            .map(in_family(Family::V4))
            .chain(IPV6_PATHS.iter().map(in_family(Family::V6)))
            .collect()
    }

    fn ends<'a>(self, topo: &'a Topology, sticky: &'a str) -> Result<Ends<'a>> {
        self.path.ends(self.family, topo, sticky)
    }
}

/// The path's name, marked ` (IPv6)` over IPv6 (as the agent names an
/// IPv6 service port).
impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.family {
            Family::V4 => write!(f, "{}", self.path),
            Family::V6 => write!(f, "{} (IPv6)", self.path),
        }
    }
}

/// A path through the two-node test bed to a backend on node-b.
#[derive(Clone, Copy, Debug)]
enum RemotePath {
    NodePortOnOtherNode,
    ClusterIpFromPodOnOtherNode,
}

impl RemotePath {
    const ALL: [RemotePath; 2] = [RemotePath::NodePortOnOtherNode, RemotePath::ClusterIpFromPodOnOtherNode];

    fn ends(self, topo: &TwoNodes) -> Result<Ends<'_>> {
        let node_a = topo.node_a();
        let (from, to) = match self {
            RemotePath::NodePortOnOtherNode => (&topo.client, REMOTE.node_port(node_a.ip())),
            RemotePath::ClusterIpFromPodOnOtherNode => {
                let pod = node_a.pod(NODE_A_CLIENT).context("no client pod on node-a")?;
                (&pod.ns, REMOTE.cluster_ip(Family::V4)?)
            }
        };
        Ok(Ends {
            from,
            to,
            server: REMOTE_POD.0,
        })
    }
}

impl fmt::Display for RemotePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemotePath::NodePortOnOtherNode => "NodePort on node-a from the client, the backend on node-b",
            RemotePath::ClusterIpFromPodOnOtherNode => "ClusterIP from a pod on node-a, the backend on node-b",
        })
    }
}

/// Where a transfer starts, what it connects to, and the pod that must serve it.
struct Ends<'a> {
    from: &'a Netns,
    to: SocketAddr,
    server: &'a str,
}

// ---------------------------------------------------------------------------
// The modes and how a test bed is set up.

/// How a test bed is set up besides the mode.
#[derive(Clone, Copy, Debug)]
struct Setup {
    offloads: Offloads,
    /// `--xdp native`: the uplink's program at XDP (ebpf mode).
    xdp_native: bool,
}

impl Setup {
    const DEFAULTS: Setup = Setup {
        offloads: Offloads::On,
        xdp_native: false,
    };
    const OFFLOADS_OFF: Setup = Setup {
        offloads: Offloads::Off,
        xdp_native: false,
    };
    const XDP_NATIVE: Setup = Setup {
        offloads: Offloads::On,
        xdp_native: true,
    };

    /// The test's name: `bulk_`, the bed (`two_node_` or nothing), the mode
    /// and what differs from the defaults.
    fn label(self, bed: &str, mode: Mode) -> String {
        let xdp = if self.xdp_native { "_xdp_native" } else { "" };
        format!("bulk_{bed}{}{}{xdp}", mode.name(), self.offloads.suffix())
    }

    /// Whether the uplink `uplink` in `ns` has an XDP program as asked (on
    /// a veth uplink, without `--xdp native` the programs are at tc only).
    fn check_xdp(self, ns: &Netns, uplink: &str) -> Result<String> {
        let link = ns.ip(&["-d", "link", "show", "dev", uplink])?;
        let xdp = link.contains("prog/xdp");
        ensure!(
            xdp == self.xdp_native,
            "XDP on {uplink}: {xdp}, expected {}:\n{link}",
            self.xdp_native
        );
        Ok(format!("XDP on {uplink}: {xdp}"))
    }

    /// The pod networks, as a real node's configuration names them (so
    /// the ebpf mode tells flows between pods apart, see `notrack`), and
    /// `--xdp native` where asked.
    fn agent_args(self) -> Vec<String> {
        let mut args = vec!["--cluster-cidr".into(), format!("{POD_CIDR},{POD_CIDR6}")];
        if self.xdp_native {
            args.extend(["--xdp".into(), "native".into()]);
        }
        args
    }
}

/// The ebpf mode keeps the kernel's conntrack off flows to pods that no
/// one source-NATs (`notrack`): after the rows, the node's conntrack table
/// holds no entry of the client pod's or the outside client's transfers
/// (translated at tc on the pod's veth, at the uplink's tc or XDP hook),
/// while the hairpin (which the kernel masquerades) has its entries, which
/// shows the table was read while the transfers' entries would still be
/// there.
fn check_kernel_conntrack(topo: &Topology) -> Result<String> {
    let table = topo.node.exec(&["cat", "/proc/net/nf_conntrack"])?;
    let of = |client: Ipv4Addr| {
        let src = format!(" src={client} ");
        let dport = format!(" dport={BULK_PORT} ");
        table.lines().filter(|l| l.contains(&src) && l.contains(&dport)).count()
    };
    let (pod, outside, hairpin) = (of(CLIENT_POD.1), of(CLIENT_IP), of(BACKENDS[BULK_POD].1));
    ensure!(
        pod == 0 && outside == 0 && hairpin > 0,
        "kernel conntrack: {pod} entries of the client pod's transfers, {outside} of the outside \
         client's (want none), {hairpin} of the hairpin's (want some):\n{table}"
    );
    Ok(format!(
        "none of the client pod's or the outside client's transfers, {hairpin} of the hairpin's"
    ))
}

/// Replies the programs reverse-translate for a pod of this node are
/// handed into the pod (`bpf_redirect_peer`): the agent lists every pod's
/// veth in `XP_POD_VETHS` (never the uplink), and the client pod's eth0
/// received the rows' downloads (hundreds of MiB) while the node's end of
/// its veth transmitted next to nothing (ARP, and what no Service
/// translated). Through `bpf_redirect_neigh`, as before, the node's end
/// transmits every byte the pod receives.
fn check_replies_into_pod(topo: &Topology, pin_path: &std::path::Path) -> Result<String> {
    let listed = proxy_userspace::mode::ebpf::pod_veths::listed(pin_path)?;
    for pod in topo.backends.iter().chain([&topo.client_pod]) {
        let index = topo.node.ifindex(&pod.node_if)?;
        ensure!(
            listed.contains(&index),
            "{}'s veth {} (ifindex {index}) not in XP_POD_VETHS {listed:?}",
            pod.name,
            pod.node_if
        );
    }
    let uplink = topo.node.ifindex(&topo.uplink)?;
    ensure!(
        !listed.contains(&uplink),
        "the uplink (ifindex {uplink}) is in XP_POD_VETHS"
    );
    let received = counter(&topo.client_pod.ns, "eth0", "rx_bytes")?;
    let sent = counter(&topo.node, &topo.client_pod.node_if, "tx_bytes")?;
    ensure!(
        received > 4 * BYTES && sent < received / 100,
        "the client pod's eth0 received {received} bytes, the node's end of its veth sent {sent}: \
         replies went through the node's end"
    );
    Ok(format!(
        "{} pod veths listed; the client pod received {received} bytes, its veth's node end sent {sent}",
        listed.len()
    ))
}

/// Interface statistic `name` of `dev` in `ns` (sysfs, which `ip netns
/// exec` mounts for the namespace).
fn counter(ns: &Netns, dev: &str, name: &str) -> Result<u64> {
    let text = ns.exec(&["cat", &format!("/sys/class/net/{dev}/statistics/{name}")])?;
    text.trim()
        .parse()
        .with_context(|| format!("{name} of {dev}: {text:?}"))
}

// ---------------------------------------------------------------------------
// The table.

/// One transfer of the table.
struct Row<'a> {
    path: String,
    direction: Direction,
    ends: Ends<'a>,
}

/// Every path, both directions.
fn rows<'a, P: fmt::Display + Copy>(paths: &[P], ends: impl Fn(P) -> Result<Ends<'a>>) -> Result<Vec<Row<'a>>> {
    let mut rows = Vec::new();
    for &path in paths {
        for direction in Direction::BOTH {
            rows.push(Row {
                path: path.to_string(),
                direction,
                ends: ends(path)?,
            });
        }
    }
    Ok(rows)
}

/// Runs every row, each a check of its own; prints the rates of those that
/// passed.
fn run_rows(label: &str, rows: &[Row], checks: &mut Checks) {
    let mut rates = Vec::new();
    for row in rows {
        let what = format!("{}: {} of {BYTES} bytes via {}", row.path, row.direction, row.ends.to);
        let result = transfer(row);
        if let Ok(report) = &result {
            rates.push(format!(
                "{:>9} {:>6.0} MiB/s  {}",
                row.direction.to_string(),
                report.rate() / f64::from(1 << 20),
                row.path
            ));
        }
        checks.check(&what, result.map(|r| r.to_string()));
    }
    eprintln!("[{label}] rates:\n    {}", rates.join("\n    "));
}

/// One transfer of a row; the pod the row names must serve it.
fn transfer(row: &Row) -> Result<Report> {
    let report = row.ends.from.bulk_transfer(row.ends.to, row.direction, BYTES)?;
    ensure!(
        report.pod == row.ends.server,
        "served by {}, not by {}",
        report.pod,
        row.ends.server
    );
    Ok(report)
}

/// A small download along `ends`, for waiting until the agent has
/// programmed the path (see `netns::wait_for`).
fn small_download(ends: &Ends) -> Result<(), String> {
    ends.from
        .bulk_transfer(ends.to, Direction::Download, PROBE_BYTES)
        .map(drop)
        .map_err(|e| format!("{e:#}"))
}

/// The pod that serves a small download along `ends`.
fn first_server(ends: &Ends) -> Result<String> {
    let report = ends.from.bulk_transfer(ends.to, Direction::Download, PROBE_BYTES)?;
    Ok(report.pod)
}

/// Small downloads through the affinity path before the bulk ones: with
/// three pods, a balancer without affinity passes all with odds 3^-10.
const STICKY_PROBES: usize = 10;

/// Whether [`STICKY_PROBES`] small downloads along `ends` all reach its server.
fn kept_server(ends: &Ends) -> Result<String> {
    for n in 1..=STICKY_PROBES {
        let served = first_server(ends)?;
        ensure!(served == ends.server, "download {n} served by {served}");
    }
    Ok(format!("all by {}", ends.server))
}

const READY: &str = "a small download";

/// Runs `steps` with a fresh [`Checks`]; panics with every failed check.
fn checked(label: &str, steps: impl FnOnce(&mut Checks) -> Result<()>) {
    let started = Instant::now();
    let mut checks = Checks::new(label);
    if let Err(e) = steps(&mut checks) {
        panic!("{label}: {e:#}\nchecks failed before: {}", checks.failures());
    }
    checks.finish();
    eprintln!("[{label}] passed in {:.1?}", started.elapsed());
}

// ---------------------------------------------------------------------------
// The test beds.

/// Every [`Path`] both ways on the one-node test bed, the agent in `mode`.
fn one_node(mode: Mode, setup: Setup) {
    let label = setup.label("", mode);
    if !mode.available(&label) {
        return;
    }
    let mut bed = AgentBed::with_offloads(&label, setup.offloads)
        .unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    checked(&label, |checks| {
        for pod in &bed.topo.backends {
            pod.ns.serve_bulk(BULK_PORT, pod.name)?;
        }
        drop_invalid_forwarding(&bed.topo.node)?;
        bed.topo.route_to_node(&EXTERNAL_NETS)?;
        bed.write_manifest(MANIFEST, &yaml_documents(&one_node_objects()))?;
        let mut args = bed.manifest_args();
        // Beside the IPv4 one the bed passes: the IPv6 rows' node ports.
        args.extend(["--node-ip".into(), NODE_IP6.to_string()]);
        args.extend(setup.agent_args());
        bed.start_agent_in(mode.name(), &args)?;
        bed.wait_first_sync(READY_WITHIN)?;
        checks.check("the uplink's hook", setup.check_xdp(&bed.topo.node, &bed.topo.uplink));
        let routes = Route::of(mode);
        for route in &routes {
            netns::wait_for(&format!("{READY}: {route}"), READY_WITHIN, || {
                bed.agent_alive()?;
                small_download(&route.ends(&bed.topo, "any pod").map_err(|e| format!("{e:#}"))?)
            })?;
        }
        let sticky_ends = |server| Path::StickyClusterIpFromPod.ends(Family::V4, &bed.topo, server);
        let sticky = first_server(&sticky_ends("")?)?;
        checks.check(
            &format!("ClientIP affinity: {STICKY_PROBES} small downloads, each by {sticky}"),
            kept_server(&sticky_ends(&sticky)?),
        );
        let rows = rows(&routes, |route| route.ends(&bed.topo, &sticky))?;
        run_rows(&label, &rows, checks);
        if mode == Mode::Ebpf {
            checks.check("the kernel's conntrack", check_kernel_conntrack(&bed.topo));
            checks.check(
                "replies handed into the client pod",
                check_replies_into_pod(&bed.topo, bed.pin_path()),
            );
        }
        Ok(())
    });
}

/// Every [`RemotePath`] both ways on the two-node test bed, both agents in `mode`.
fn two_node(mode: Mode, setup: Setup) {
    let label = setup.label("two_node_", mode);
    if !mode.available(&label) {
        return;
    }
    let mut bed =
        TwoNodeBed::new(&label, setup.offloads).unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    checked(&label, |checks| {
        for pod in bed.topo.backends() {
            pod.ns.serve_bulk(BULK_PORT, pod.name)?;
        }
        for node in &bed.topo.nodes {
            drop_invalid_forwarding(&node.ns)?;
        }
        let objects = REMOTE.objects(REMOTE_POD.1, NODE_B.name);
        bed.write_manifest(MANIFEST, &yaml_documents(&objects))?;
        bed.start_agents_with(mode.name(), &setup.agent_args())?;
        bed.wait_first_syncs(READY_WITHIN)?;
        for node in &bed.topo.nodes {
            let what = format!("{}'s uplink's hook", node.name());
            checks.check(&what, setup.check_xdp(&node.ns, &node.uplink));
        }
        let first = RemotePath::ALL[0].ends(&bed.topo)?;
        netns::wait_for(READY, READY_WITHIN, || small_download(&first))?;
        let rows = rows(&RemotePath::ALL, |path| path.ends(&bed.topo))?;
        run_rows(&label, &rows, checks);
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// One test per mode and setup.

#[test]
fn bulk_ebpf() {
    one_node(Mode::Ebpf, Setup::DEFAULTS);
}

#[test]
fn bulk_ebpf_offloads_off() {
    one_node(Mode::Ebpf, Setup::OFFLOADS_OFF);
}

#[test]
fn bulk_ebpf_xdp_native() {
    one_node(Mode::Ebpf, Setup::XDP_NATIVE);
}

#[test]
fn bulk_iptables() {
    one_node(Mode::Iptables, Setup::DEFAULTS);
}

#[test]
fn bulk_iptables_offloads_off() {
    one_node(Mode::Iptables, Setup::OFFLOADS_OFF);
}

#[test]
fn bulk_nftables() {
    one_node(Mode::Nftables, Setup::DEFAULTS);
}

#[test]
fn bulk_nftables_offloads_off() {
    one_node(Mode::Nftables, Setup::OFFLOADS_OFF);
}

#[test]
fn bulk_ipvs() {
    one_node(Mode::Ipvs, Setup::DEFAULTS);
}

#[test]
fn bulk_ipvs_offloads_off() {
    one_node(Mode::Ipvs, Setup::OFFLOADS_OFF);
}

#[test]
fn bulk_userspace() {
    one_node(Mode::Userspace, Setup::DEFAULTS);
}

#[test]
fn bulk_two_node_ebpf() {
    two_node(Mode::Ebpf, Setup::DEFAULTS);
}

#[test]
fn bulk_two_node_ebpf_offloads_off() {
    two_node(Mode::Ebpf, Setup::OFFLOADS_OFF);
}

#[test]
fn bulk_two_node_ebpf_xdp_native() {
    two_node(Mode::Ebpf, Setup::XDP_NATIVE);
}

#[test]
fn bulk_two_node_iptables() {
    two_node(Mode::Iptables, Setup::DEFAULTS);
}

#[test]
fn bulk_two_node_iptables_offloads_off() {
    two_node(Mode::Iptables, Setup::OFFLOADS_OFF);
}

#[test]
fn bulk_two_node_nftables() {
    two_node(Mode::Nftables, Setup::DEFAULTS);
}
