//! Two nodes, each running its own agent: the two-node test bed
//! (`testbed::two_node`: a client, node-a with pods a-1, a-2 and a-client,
//! node-b with pods b-1, b-2, all on one L2 segment) with `xproxy run --mode
//! MODE --hostname-override node-a|node-b` in each node, both fed the same
//! manifests, whose EndpointSlices list pods of both nodes with their
//! `nodeName`. The same steps in ebpf, iptables and nftables mode, a test
//! (and a test bed) per mode, so the modes run in parallel; ebpf twice, with
//! checksum offload on and off (the programs rewrite checksums themselves).
//!
//! The scenario ([`scenario_steps`]):
//! 1. Before the agents start, what every request does without a proxy (the
//!    baseline); pods reach pods on the other node directly.
//! 2. NodePort on node-a, and on node-b, from the outside client: every
//!    backend of both nodes answers, TCP and UDP, and half the flows (within
//!    5 standard deviations) go to the other node: the backends are picked
//!    evenly, wherever they run. A backend on the other node is reached only
//!    through source NAT to the entry node (its replies must come back
//!    through the entry node to be un-NATed).
//! 3. The source address backends see of NodePort traffic: a remote backend
//!    the entry node's IP, a local one what the mode gives it (below).
//! 4. ClusterIP from a pod on node-a (a-client) and from a backend on node-b
//!    (b-2): every backend of both nodes answers, TCP and UDP; backends see
//!    the client pod's own address (no SNAT between pods).
//! 5. Hairpin: a-1 (and b-1) through a Service whose only endpoint is itself
//!    is answered by itself, TCP and UDP, and sees the node's pod gateway as
//!    the source (the SNAT that makes the hairpin work).
//! 6. The `Local` traffic policies ([`check_external_local`],
//!    [`check_internal_local`]), kube-proxy's behaviour in every mode:
//!    - `externalTrafficPolicy: Local`, backends on both nodes: the client
//!      through node-a's NodePort reaches only node-a's backends, through
//!      node-b's only node-b's, TCP and UDP, and they see the client's own
//!      address; the same Service's ClusterIP still reaches all four from a
//!      pod (the policy is about external traffic only).
//!    - `externalTrafficPolicy: Local`, backends on node-a only: node-a's
//!      NodePort reaches them; node-b's drops the client's requests, TCP and
//!      UDP (no answer at all: not refused), and a pod's on node-b too (no
//!      `clusterCIDR` is configured, so pod traffic cannot be told apart and
//!      is not short-circuited); the node's own request (below) differs.
//!    - `internalTrafficPolicy: Local`: the ClusterIP from a-client reaches
//!      only node-a's backends, from b-2 only node-b's; a Service whose
//!      backends all run on node-a drops b-2's requests and answers
//!      a-client's.
//! 7. Datagrams to a backend on the other node ([`check_remote_datagrams`]):
//!    4,000- and 60,000-byte UDP datagrams (fragments at MTU 1,500) from the
//!    client through node-a's NodePort (DNAT and masquerade on node-a) and
//!    from a-client through the ClusterIP come back from b-1's echo server
//!    intact, and a datagram to a Service whose b-1 port is closed ends as
//!    ECONNREFUSED at the client: the port unreachable crossed node-a's
//!    translation back. The same over IPv6 (both Services are dual-stack):
//!    through node-a's IPv6 NodePort and the IPv6 ClusterIPs, fragment
//!    headers and ICMPv6 errors crossing node-a.
//! 8. IPv6 ([`check_ipv6`]): `spread` is dual-stack (an IPv6 ClusterIP and
//!    an IPv6 EndpointSlice of the same four pods): the client through
//!    either node's IPv6 NodePort, and a-client and b-2 through the IPv6
//!    ClusterIP, reach every backend of both nodes, TCP and UDP; a remote
//!    backend is reached through the entry node's IPv6 masquerade
//!    (ip6tables, `ip6` nftables table; ebpf: the programs' DNAT and the
//!    ip6tables SNAT rule).
//! 9. SIGTERM to both agents, `xproxy cleanup` on both nodes: no pins, no
//!    programs on any interface, no chain or table of xproxy's in either
//!    node, and every request ends as in the baseline.
//!
//! Where the modes differ, the difference is asserted per mode
//! ([`Mode::local_node_port_source`], [`Mode::own_local_node_port`]):
//!
//! | what                                                  | ebpf                       | iptables                   | nftables                   | kube-proxy (iptables)
//! |-------------------------------------------------------|----------------------------|----------------------------|----------------------------|----------------------
//! | NodePort: source a backend on the OTHER node sees      | the entry node's IP (the programs DNAT and mark, the kernel masquerades) | the entry node's IP (masquerade) | the entry node's IP | the entry node's IP
//! | NodePort: source a backend on the entry node sees      | the client's (DNAT only: its replies pass the entry node anyway) | the entry node's pod gateway (masquerade) | the same as iptables | the node's (masquerade)
//! | NodePort with `externalTrafficPolicy: Local`           | this node's backends only, the client's source kept; none here: dropped | the same (KUBE-EXT -> KUBE-SVL; DROP in KUBE-EXTERNAL-SERVICES) | the same (external-… -> local-…; drop-external-chain) | the same
//! | the node's own request to its NodePort with `Local` and no backend on it | short-circuited by the socket programs: answered by the other node's backends, which see the node's IP (the socket leaves from it) | short-circuited: answered by the other node's backends, which see the node's IP (masquerade) | the same | the same as iptables
//!
//! The same in every mode (asserted): the client reaches every backend
//! through the NodePort of either node; pod-to-pod Service traffic keeps the
//! pod's address across nodes; hairpin works on both nodes; the `Local`
//! policies (step 6, but for the node's own request); fragmented datagrams
//! and port unreachables to the other node's backend (step 7); cleanup
//! leaves nothing.
//!
//! Every stage opens its flows from local ports of its own ([`new_flows`]),
//! so no request is steered by a conntrack entry of an earlier stage.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use aya::programs::{SchedClassifier, TcAttachType};
use serde_json::Value;
use testbed::{
    agent_bed::{READY_WITHIN, frontends},
    fixtures::{PortDef, TrafficPolicy, dual_stack, service_with, slice_with, slice6_with, yaml_documents},
    netns::{self, Netns},
    privileged::require_root,
    probe::{
        self, Checks, Outcome, PROBE_TIMEOUT, PROTOCOLS, Protocol, expect_backends, expect_outcome, fresh_ports,
        outcome, proto_name, request,
    },
    topology::Offloads,
    two_node::{CLIENT_IP, NODE_A, NODE_B, Node, PEER_PORT, TARGET_PORT, TwoNodes},
    two_node_bed::{TwoNodeBed, endpoints_of},
};

// ---------------------------------------------------------------------------
// The Services.

const BACKENDS: [&str; 4] = ["a-1", "a-2", "b-1", "b-2"];
const NODE_A_BACKENDS: [&str; 2] = ["a-1", "a-2"];

/// Requests per "every backend answers" check: with 4 equally likely
/// backends, the chance that one never answers 80 requests is
/// 4 * (3/4)^80 < 1e-9.
const REQUESTS: usize = 80;
/// Requests per "always the same backend" check.
const HAIRPIN_REQUESTS: usize = 10;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Every backend of both nodes, TCP and UDP on [`TARGET_PORT`].
const SPREAD_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 80);
const SPREAD_PORT: u16 = 80;
const SPREAD_NODE_PORT: u16 = 30880;
/// Every backend of both nodes, TCP on [`PEER_PORT`]: the answer names the
/// source the backend saw.
const SOURCE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 81);
const SOURCE_PORT: u16 = 81;
const SOURCE_NODE_PORT: u16 = 30881;
/// a-1 only (hairpin-a) and b-1 only (hairpin-b): TCP to [`PEER_PORT`],
/// UDP to [`TARGET_PORT`].
const HAIRPIN_A_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 82);
const HAIRPIN_B_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 83);
const HAIRPIN_PORT: u16 = 82;
/// `externalTrafficPolicy: Local`, every backend of both nodes: TCP to
/// [`PEER_PORT`], UDP to [`TARGET_PORT`].
const LOCAL_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 84);
const LOCAL_PORT: u16 = 84;
const LOCAL_NODE_PORT: u16 = 30884;
/// `externalTrafficPolicy: Local`, node-a's backends only (so node-b has no
/// local endpoint): TCP to [`PEER_PORT`], UDP to [`TARGET_PORT`].
const LOCAL_A_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 85);
const LOCAL_A_PORT: u16 = 85;
const LOCAL_A_NODE_PORT: u16 = 30885;
/// `internalTrafficPolicy: Local` (a ClusterIP Service), every backend of
/// both nodes: TCP and UDP to [`TARGET_PORT`].
const ITP_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 86);
const ITP_PORT: u16 = 86;
/// `internalTrafficPolicy: Local`, node-a's backends only.
const ITP_A_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 87);
const ITP_A_PORT: u16 = 87;

/// b-1 only, UDP to [`ECHO_PORT`] (an echo server the step starts).
const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 88);
const ECHO_SERVICE_PORT: u16 = 88;
const ECHO_NODE_PORT: u16 = 30888;
const ECHO_PORT: u16 = 7070;
/// b-1 only, UDP to a port nothing listens on.
const REFUSING_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 89);
const REFUSING_PORT: u16 = 89;
const REFUSING_NODE_PORT: u16 = 30889;
const CLOSED_PORT: u16 = 9999;
/// `spread`'s IPv6 ClusterIP (it is dual-stack: [`check_ipv6`]).
const SPREAD_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 1, 0x80);
/// `echo-b`'s and `refusing-b`'s IPv6 ClusterIPs (both dual-stack:
/// [`check_remote_datagrams`]).
const ECHO_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 1, 0x88);
const REFUSING_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 1, 0x89);
/// Datagram sizes: 3 and 41 fragments at MTU 1,500.
const DATAGRAM_SIZES: [usize; 2] = [4000, 60_000];

const MANIFEST: &str = "services.yaml";

fn tcp_udp(port: u16, tcp_target: u16, udp_target: u16, node_port: Option<u16>) -> [PortDef; 2] {
    PortDef::tcp_udp(("tcp", "udp"), port, (tcp_target, udp_target), node_port)
}

/// Every Service above with its EndpointSlice.
fn objects(topo: &TwoNodes) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut add = |name: &str, ip, ports: &[PortDef], policy, pods: &[&str]| -> Result<()> {
        out.push(service_with(name, ip, ports, Some(policy)));
        out.push(slice_with(
            &format!("{name}-1"),
            name,
            ports,
            &endpoints_of(topo, pods)?,
        ));
        Ok(())
    };
    let spread = tcp_udp(SPREAD_PORT, TARGET_PORT, TARGET_PORT, Some(SPREAD_NODE_PORT));
    add("spread", SPREAD_IP, &spread, TrafficPolicy::Cluster, &BACKENDS)?;
    let source = [PortDef {
        name: Some("tcp"),
        protocol: Protocol::Tcp,
        port: SOURCE_PORT,
        target_port: PEER_PORT,
        node_port: Some(SOURCE_NODE_PORT),
    }];
    add("source-ip", SOURCE_IP, &source, TrafficPolicy::Cluster, &BACKENDS)?;
    let hairpin = tcp_udp(HAIRPIN_PORT, PEER_PORT, TARGET_PORT, None);
    add("hairpin-a", HAIRPIN_A_IP, &hairpin, TrafficPolicy::Cluster, &["a-1"])?;
    add("hairpin-b", HAIRPIN_B_IP, &hairpin, TrafficPolicy::Cluster, &["b-1"])?;
    let local = tcp_udp(LOCAL_PORT, PEER_PORT, TARGET_PORT, Some(LOCAL_NODE_PORT));
    add("local", LOCAL_IP, &local, TrafficPolicy::Local, &BACKENDS)?;
    let local_a = tcp_udp(LOCAL_A_PORT, PEER_PORT, TARGET_PORT, Some(LOCAL_A_NODE_PORT));
    add("local-a", LOCAL_A_IP, &local_a, TrafficPolicy::Local, &NODE_A_BACKENDS)?;
    let itp = tcp_udp(ITP_PORT, TARGET_PORT, TARGET_PORT, None);
    add("itp", ITP_IP, &itp, TrafficPolicy::Cluster, &BACKENDS)?;
    let itp_a = tcp_udp(ITP_A_PORT, TARGET_PORT, TARGET_PORT, None);
    add("itp-a", ITP_A_IP, &itp_a, TrafficPolicy::Cluster, &NODE_A_BACKENDS)?;
    let udp = |name, port, target_port, node_port| PortDef {
        name: Some(name),
        protocol: Protocol::Udp,
        port,
        target_port,
        node_port: Some(node_port),
    };
    let echo = [udp("echo", ECHO_SERVICE_PORT, ECHO_PORT, ECHO_NODE_PORT)];
    add("echo-b", ECHO_IP, &echo, TrafficPolicy::Cluster, &["b-1"])?;
    let refusing = [udp("refusing", REFUSING_PORT, CLOSED_PORT, REFUSING_NODE_PORT)];
    add("refusing-b", REFUSING_IP, &refusing, TrafficPolicy::Cluster, &["b-1"])?;
    for svc in out.iter_mut().filter(|o| o["kind"] == "Service") {
        match svc["metadata"]["name"].as_str() {
            Some(n) if n.starts_with("itp") => svc["spec"]["internalTrafficPolicy"] = serde_json::json!("Local"),
            Some("spread") => *svc = dual_stack(svc.take(), SPREAD_IP6),
            Some("echo-b") => *svc = dual_stack(svc.take(), ECHO_IP6),
            Some("refusing-b") => *svc = dual_stack(svc.take(), REFUSING_IP6),
            _ => {}
        }
    }
    out.push(slice6_with(
        "spread-6",
        "spread",
        &spread,
        &endpoints6_of(topo, &BACKENDS)?,
    ));
    for (name, ports) in [("echo-b", &echo), ("refusing-b", &refusing)] {
        out.push(slice6_with(
            &format!("{name}-6"),
            name,
            ports,
            &endpoints6_of(topo, &["b-1"])?,
        ));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The modes and where they differ.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Ebpf,
    Iptables,
    Nftables,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        }
    }

    /// The source a backend on the entry node itself sees of NodePort
    /// traffic from the client.
    fn local_node_port_source(self, entry: &Node) -> Ipv4Addr {
        match self {
            // DNAT only: the backend's replies pass the entry node anyway.
            Mode::Ebpf => CLIENT_IP,
            // KUBE-EXT / external-* chains mark every NodePort flow for
            // masquerade: the address of the interface towards the pod.
            Mode::Iptables | Mode::Nftables => entry.spec.gateway,
        }
    }

    /// What the node's own request to its NodePort of a Service with
    /// `externalTrafficPolicy: Local` and no backend on it ends as: the
    /// answering backend and the source it saw, or `None` if refused.
    fn own_local_node_port(self, node: &Node) -> Option<Ipv4Addr> {
        match self {
            // The socket programs connect the node's own socket to any
            // backend (kube-proxy's short-circuit); it leaves from the
            // node's address on the route to the other node.
            Mode::Ebpf => Some(node.ip()),
            // kube-proxy's short-circuit: masqueraded, to any backend.
            Mode::Iptables | Mode::Nftables => Some(node.ip()),
        }
    }
}

/// The source `backend` sees of NodePort traffic from the client that
/// entered at `entry`: the entry node's IP if the backend runs on the other
/// node, else what the mode gives a local backend.
fn node_port_source(mode: Mode, topo: &TwoNodes, entry: &Node, backend: &str) -> Ipv4Addr {
    if node_of(topo, backend) == entry.name() {
        mode.local_node_port_source(entry)
    } else {
        entry.ip()
    }
}

// ---------------------------------------------------------------------------
// Requests.

fn node_port(node: &Node, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(node.ip(), port)
}

fn addr(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// `count` TCP requests from `from` to a Service whose backends answer
/// "NAME SOURCE": (backend, the source it saw), once per backend that
/// answered; every answer must be well-formed and from one of `backends`,
/// and every one of `backends` must have answered.
fn sources_seen(from: &Netns, to: SocketAddrV4, backends: &[&str], count: usize) -> Result<BTreeMap<String, Ipv4Addr>> {
    let answers = from.run_in(|| {
        (0..count)
            .map(|_| netns::tcp_request(to, REQUEST_TIMEOUT))
            .collect::<Vec<_>>()
    })?;
    let mut seen: BTreeMap<String, Ipv4Addr> = BTreeMap::new();
    for answer in answers {
        let answer = answer.with_context(|| format!("a request to {to}"))?;
        let (name, ip) = answer
            .split_once(' ')
            .with_context(|| format!("answer {answer:?} is not \"NAME SOURCE\""))?;
        let ip: Ipv4Addr = ip.parse().with_context(|| format!("answer {answer:?}"))?;
        ensure!(backends.contains(&name), "{name} answered, not one of {backends:?}");
        if let Some(before) = seen.insert(name.to_owned(), ip) {
            ensure!(before == ip, "{name} saw {before} once and {ip} another time");
        }
    }
    let missing: Vec<&&str> = backends.iter().filter(|b| !seen.contains_key(**b)).collect();
    ensure!(
        missing.is_empty(),
        "{missing:?} never answered {count} requests: {seen:?}"
    );
    Ok(seen)
}

/// Checks that every backend in `seen` saw the source `expected(backend)`.
fn expect_sources(seen: &BTreeMap<String, Ipv4Addr>, expected: impl Fn(&str) -> Ipv4Addr) -> Result<String> {
    let wrong: Vec<String> = seen
        .iter()
        .filter(|(name, ip)| expected(name) != **ip)
        .map(|(name, ip)| format!("{name} saw {ip}, expected {}", expected(name)))
        .collect();
    ensure!(wrong.is_empty(), "{}", wrong.join("; "));
    Ok(format!("{seen:?}"))
}

/// `(IPv6 address, nodeName)` of each of `pods`.
fn endpoints6_of(topo: &TwoNodes, pods: &[&str]) -> Result<Vec<(Ipv6Addr, &'static str)>> {
    pods.iter()
        .map(|name| {
            let (node, pod) = topo.find_pod(name).with_context(|| format!("no pod {name}"))?;
            let ip6 = pod.ip6.with_context(|| format!("pod {name} has no IPv6 address"))?;
            Ok((ip6, node.name()))
        })
        .collect()
}

/// The node running backend `name`.
fn node_of(topo: &TwoNodes, name: &str) -> &'static str {
    topo.find_pod(name).map_or("?", |(node, _)| node.name())
}

/// `count` requests from `from` to `to`, every one answered by `only`.
fn expect_always(from: &Netns, protocol: Protocol, to: SocketAddrV4, only: &str, count: usize) -> Result<String> {
    expect_backends(from, protocol, to, &[only], count)
}

/// Makes the client and every pod and node open flows from local ports
/// `first..first + 10000` from now on (see `probe::fresh_ports`).
fn new_flows(topo: &TwoNodes, first: u16) -> Result<()> {
    fresh_ports(&topo.client, first)?;
    for node in &topo.nodes {
        fresh_ports(&node.ns, first)?;
        for pod in node.backends.iter().chain(&node.clients) {
            fresh_ports(&pod.ns, first)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The baseline: requests compared before the agents and after cleanup.

#[derive(Clone, Copy, Debug)]
enum Place {
    Client,
    Pod(&'static str),
}

type Probe = probe::Probe<Place>;

fn place_ns(topo: &TwoNodes, place: Place) -> Result<&Netns> {
    match place {
        Place::Client => Ok(&topo.client),
        Place::Pod(name) => Ok(&topo.find_pod(name).with_context(|| format!("no pod {name}"))?.1.ns),
    }
}

fn pod_addr(topo: &TwoNodes, name: &str, port: u16) -> Result<SocketAddrV4> {
    let (_, pod) = topo.find_pod(name).with_context(|| format!("no pod {name}"))?;
    Ok(SocketAddrV4::new(pod.ip, port))
}

fn pod_addr6(topo: &TwoNodes, name: &str, port: u16) -> Result<SocketAddr> {
    let (_, pod) = topo.find_pod(name).with_context(|| format!("no pod {name}"))?;
    let ip6 = pod.ip6.with_context(|| format!("pod {name} has no IPv6 address"))?;
    Ok(SocketAddr::new(ip6.into(), port))
}

fn probes(topo: &TwoNodes) -> Result<Vec<Probe>> {
    let mut out = Vec::new();
    let probe = |from, protocol, to, service| Probe {
        from,
        protocol,
        to,
        service,
    };
    for protocol in PROTOCOLS {
        for node in &topo.nodes {
            out.push(probe(
                Place::Client,
                protocol,
                node_port(node, SPREAD_NODE_PORT).into(),
                true,
            ));
        }
        out.push(probe(
            Place::Pod("a-client"),
            protocol,
            addr(SPREAD_IP, SPREAD_PORT).into(),
            true,
        ));
        out.push(probe(
            Place::Pod("a-1"),
            protocol,
            addr(HAIRPIN_A_IP, HAIRPIN_PORT).into(),
            true,
        ));
    }
    // Pod addresses directly, also across nodes: the test bed's routing.
    for (from, protocol, to) in [
        (Place::Client, Protocol::Tcp, "a-1"),
        (Place::Client, Protocol::Udp, "b-1"),
        (Place::Pod("a-client"), Protocol::Tcp, "b-2"),
        (Place::Pod("b-1"), Protocol::Udp, "a-2"),
    ] {
        out.push(probe(from, protocol, pod_addr(topo, to, TARGET_PORT)?.into(), false));
    }
    // The same over IPv6: the bed routes both families.
    for (from, protocol, to) in [
        (Place::Client, Protocol::Udp, "a-2"),
        (Place::Client, Protocol::Tcp, "b-1"),
        (Place::Pod("a-client"), Protocol::Udp, "b-2"),
        (Place::Pod("b-2"), Protocol::Tcp, "a-1"),
    ] {
        out.push(probe(from, protocol, pod_addr6(topo, to, TARGET_PORT)?, false));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The scenario.

fn scenario(mode: Mode, offloads: Offloads) {
    let label = format!("two_node_{}{}", mode.name(), offloads.suffix());
    let started = Instant::now();
    let mut bed =
        TwoNodeBed::new(&label, offloads).unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(&label);
    if let Err(e) = scenario_steps(mode, &mut bed, &mut checks) {
        panic!("{label}: {e:#}\nchecks failed before: {}", checks.failures());
    }
    checks.finish();
    eprintln!("[{label}] passed in {:.1?}", started.elapsed());
}

fn scenario_steps(mode: Mode, bed: &mut TwoNodeBed, checks: &mut Checks) -> Result<()> {
    // 1. The baseline.
    new_flows(&bed.topo, 10_000)?;
    let baseline = probe::Baseline::take(mode.name(), probes(&bed.topo)?, |p| place_ns(&bed.topo, p))?;

    new_flows(&bed.topo, 20_000)?;
    start(bed, mode)?;
    check_node_ports(bed, checks);
    if mode == Mode::Ebpf {
        check_masquerade_ports(bed, checks);
    }
    check_node_port_sources(mode, bed, checks);
    check_cluster_ip(bed, checks);
    check_hairpin(bed, checks);
    check_external_local(mode, bed, checks);
    check_internal_local(bed, checks);
    check_remote_datagrams(bed, checks)?;
    check_ipv6(bed, checks);
    if mode == Mode::Ebpf {
        for i in 0..bed.topo.nodes.len() {
            checks.check(
                &format!("ebpf read-back on {}", bed.topo.nodes[i].name()),
                ebpf_read_back(bed, i),
            );
        }
    }

    // 9. Both agents stop; `xproxy cleanup` on both nodes removes everything.
    bed.stop_agents()?;
    new_flows(&bed.topo, 50_000)?;
    for i in 0..bed.topo.nodes.len() {
        let output = bed.cleanup(i)?;
        eprintln!(
            "[{}] xproxy cleanup on {}:\n{output}",
            mode.name(),
            bed.topo.nodes[i].name()
        );
    }
    for i in 0..bed.topo.nodes.len() {
        checks.check(
            &format!("nothing of xproxy's is left on {}", bed.topo.nodes[i].name()),
            nothing_left(bed, i),
        );
    }
    checks.check(
        "after xproxy cleanup on both nodes, every request ends as without a proxy",
        baseline.same(|p| place_ns(&bed.topo, p)),
    );
    Ok(())
}

/// Writes the manifests, starts an agent per node, and returns once both
/// have synced and both NodePorts answer.
fn start(bed: &mut TwoNodeBed, mode: Mode) -> Result<()> {
    bed.write_manifest(MANIFEST, &yaml_documents(&objects(&bed.topo)?))?;
    bed.start_agents(mode.name())?;
    bed.wait_first_syncs(READY_WITHIN)?;
    for i in 0..bed.topo.nodes.len() {
        let to = node_port(&bed.topo.nodes[i], SPREAD_NODE_PORT);
        netns::wait_for(&format!("{to} to answer from the client"), READY_WITHIN, || {
            bed.agent_alive(i)?;
            let answer = bed
                .topo
                .client
                .tcp_request(to, Duration::from_millis(500))
                .map_err(|e| format!("{e:#}"))?
                .map_err(|e| e.to_string())?;
            if BACKENDS.contains(&answer.as_str()) {
                Ok(())
            } else {
                Err(format!("answered {answer:?}"))
            }
        })?;
    }
    Ok(())
}

/// Step 2: NodePort on either node reaches every backend of both nodes, each
/// about as often: half the flows cross to the other node.
fn check_node_ports(bed: &TwoNodeBed, checks: &mut Checks) {
    for node in &bed.topo.nodes {
        for protocol in PROTOCOLS {
            let to = node_port(node, SPREAD_NODE_PORT);
            checks.check(
                &format!(
                    "{} client -> {to} (NodePort on {}) reaches {BACKENDS:?}, {SPREAD_REQUESTS:?} of \
                     {SPREAD_SAMPLE} on the other node",
                    proto_name(protocol),
                    node.name()
                ),
                answer_counts(&bed.topo.client, protocol, to, SPREAD_SAMPLE)
                    .and_then(|counts| expect_spread(&bed.topo, node, &counts)),
            );
        }
    }
}

/// The node port range the agents run with (`--node-port-range`'s default).
const NODE_PORT_RANGE: std::ops::RangeInclusive<u16> = 30000..=32767;

/// ebpf only, after step 2: the kernel masquerades the flows the programs
/// sent to the other node to source ports above the node port range, read
/// back from both the rules and the kernel's conntrack table. A port in the
/// range would let the programs take the backend's reply for a new
/// connection to that node port (it happened: one flow in a few thousand).
fn check_masquerade_ports(bed: &TwoNodeBed, checks: &mut Checks) {
    for node in &bed.topo.nodes {
        checks.check(
            &format!(
                "{}: flows to the other node's backends are masqueraded to ports above {NODE_PORT_RANGE:?}",
                node.name()
            ),
            masquerade_ports(node),
        );
    }
}

fn masquerade_ports(node: &Node) -> Result<String> {
    let rules = node.ns.exec(&["iptables-save", "-t", "nat"])?;
    for protocol in ["tcp", "udp"] {
        let rule = format!("-p {protocol} -j MASQUERADE --to-ports 32768-65535 --random-fully");
        ensure!(rules.contains(&rule), "no rule {rule:?} in:\n{rules}");
    }
    let table = node.ns.exec(&["conntrack", "-L"])?;
    let node_ip = format!("dst={}", node.ip());
    // The reply tuple (the second `src= dst= sport= dport=`) of a
    // masqueraded flow goes to the node's IP, at the port it picked.
    let picked: Vec<u16> = table
        .lines()
        .filter_map(|line| {
            let tuples: Vec<&str> = line
                .split_whitespace()
                .filter(|w| ["src=", "dst=", "sport=", "dport="].iter().any(|k| w.starts_with(k)))
                .collect();
            let reply = tuples.get(4..8)?;
            (reply[1] == node_ip).then(|| reply[3].strip_prefix("dport=")?.parse().ok())?
        })
        .collect();
    ensure!(
        picked.len() >= 100,
        "only {} masqueraded flows in:\n{table}",
        picked.len()
    );
    let inside: Vec<&u16> = picked.iter().filter(|p| **p <= *NODE_PORT_RANGE.end()).collect();
    ensure!(
        inside.is_empty(),
        "masqueraded to ports {inside:?} (of {})",
        picked.len()
    );
    Ok(format!(
        "{} flows, every port above {}",
        picked.len(),
        NODE_PORT_RANGE.end()
    ))
}

/// Requests per check of how evenly a NodePort spreads its flows.
const SPREAD_SAMPLE: usize = 400;
/// How many of [`SPREAD_SAMPLE`] flows must go to the other node's two
/// backends (of four). Uniform picks put 200 there (standard deviation 10):
/// outside these bounds is 5 standard deviations off (p < 1e-6). A data
/// path that favoured local backends 3:1 (200 +- 8.7 -> 100) fails.
const SPREAD_REQUESTS: std::ops::RangeInclusive<usize> = 150..=250;

/// Sends `count` requests from `from` to `to`; every one must be answered.
/// Returns the answers counted by answer.
fn answer_counts(from: &Netns, protocol: Protocol, to: SocketAddrV4, count: usize) -> Result<BTreeMap<String, usize>> {
    let answers = from.run_in(|| -> Result<Vec<String>> {
        let mut answers = Vec::with_capacity(count);
        for i in 0..count {
            let answer = request(protocol, to, REQUEST_TIMEOUT)
                .with_context(|| format!("request {} of {count} ({} answered before)", i + 1, answers.len()))?;
            answers.push(answer);
        }
        Ok(answers)
    })??;
    let mut counts = BTreeMap::new();
    for answer in answers {
        *counts.entry(answer).or_default() += 1;
    }
    Ok(counts)
}

/// Every answer is a backend's, every backend answered, and the other
/// node's backends got [`SPREAD_REQUESTS`] of them.
fn expect_spread(topo: &TwoNodes, entry: &Node, counts: &BTreeMap<String, usize>) -> Result<String> {
    let strangers: Vec<&String> = counts.keys().filter(|a| !BACKENDS.contains(&a.as_str())).collect();
    ensure!(
        strangers.is_empty(),
        "answers {strangers:?} are no backend's: {counts:?}"
    );
    let silent: Vec<&&str> = BACKENDS.iter().filter(|b| !counts.contains_key(**b)).collect();
    ensure!(silent.is_empty(), "{silent:?} never answered: {counts:?}");
    let remote: usize = counts
        .iter()
        .filter(|(name, _)| node_of(topo, name) != entry.name())
        .map(|(_, n)| n)
        .sum();
    ensure!(
        SPREAD_REQUESTS.contains(&remote),
        "{remote} of {} flows went to the other node, expected {SPREAD_REQUESTS:?}: {counts:?}",
        counts.values().sum::<usize>()
    );
    Ok(format!("{counts:?}, {remote} on the other node"))
}

/// Step 3: The source backends see of NodePort traffic, through either node.
fn check_node_port_sources(mode: Mode, bed: &TwoNodeBed, checks: &mut Checks) {
    let topo = &bed.topo;
    for entry in &topo.nodes {
        let to = node_port(entry, SOURCE_NODE_PORT);
        let expected = |backend: &str| node_port_source(mode, topo, entry, backend);
        checks.check(
            &format!(
                "client -> {to} (NodePort on {}): remote backends see {}, local ones {}",
                entry.name(),
                entry.ip(),
                mode.local_node_port_source(entry)
            ),
            sources_seen(&topo.client, to, &BACKENDS, REQUESTS).and_then(|seen| expect_sources(&seen, expected)),
        );
    }
}

/// Step 4: ClusterIP from pods on either node reaches both nodes' backends,
/// which see the pod's own address.
fn check_cluster_ip(bed: &TwoNodeBed, checks: &mut Checks) {
    let topo = &bed.topo;
    for from in ["a-client", "b-2"] {
        let Some((node, pod)) = topo.find_pod(from) else {
            checks.check(&format!("pod {from}"), Err(anyhow::anyhow!("no such pod")));
            continue;
        };
        for protocol in PROTOCOLS {
            let to = addr(SPREAD_IP, SPREAD_PORT);
            checks.check(
                &format!(
                    "{} {from} (on {}) -> {to} reaches {BACKENDS:?}",
                    proto_name(protocol),
                    node.name()
                ),
                expect_backends(&pod.ns, protocol, to, &BACKENDS, REQUESTS),
            );
        }
    }
    let Some((_, client)) = topo.find_pod("a-client") else {
        return;
    };
    let to = addr(SOURCE_IP, SOURCE_PORT);
    checks.check(
        &format!("a-client -> {to}: every backend sees {} (no SNAT)", client.ip),
        sources_seen(&client.ns, to, &BACKENDS, REQUESTS).and_then(|seen| expect_sources(&seen, |_| client.ip)),
    );
}

/// Step 8: the dual-stack `spread` over IPv6, NodePort from the client on
/// both nodes and ClusterIP from pods on both nodes: every backend of both
/// nodes answers.
fn check_ipv6(bed: &TwoNodeBed, checks: &mut Checks) {
    let topo = &bed.topo;
    for protocol in PROTOCOLS {
        for node in &topo.nodes {
            let to = SocketAddr::new(node.ip6().into(), SPREAD_NODE_PORT);
            checks.check(
                &format!(
                    "{} client -> {to} (IPv6 NodePort on {}) reaches {BACKENDS:?}",
                    proto_name(protocol),
                    node.name()
                ),
                expect_backends(&topo.client, protocol, to, &BACKENDS, REQUESTS),
            );
        }
        for from in ["a-client", "b-2"] {
            let to = SocketAddr::new(SPREAD_IP6.into(), SPREAD_PORT);
            let what = format!(
                "{} {from} -> {to} (IPv6 ClusterIP) reaches {BACKENDS:?}",
                proto_name(protocol)
            );
            let result = match topo.find_pod(from) {
                Some((_, pod)) => expect_backends(&pod.ns, protocol, to, &BACKENDS, REQUESTS),
                None => Err(anyhow::anyhow!("no pod {from}")),
            };
            checks.check(&what, result);
        }
    }
}

/// Step 7: fragmented datagrams and ICMP errors to a backend on the other
/// node, through node-a's NodePort (masqueraded) and the ClusterIP, over
/// both families.
fn check_remote_datagrams(bed: &TwoNodeBed, checks: &mut Checks) -> Result<()> {
    let topo = &bed.topo;
    let (_, b1) = topo.find_pod("b-1").context("no pod b-1")?;
    let _echo = netns::Server::udp_echo(&b1.ns, ECHO_PORT)?;
    let (_, client_pod) = topo.find_pod("a-client").context("no pod a-client")?;
    let node_a = topo.node_a();
    let v6 = |ip: Ipv6Addr, port| SocketAddr::new(ip.into(), port);
    let paths: [(&str, &Netns, SocketAddr, SocketAddr); 4] = [
        (
            "client -> node-a's NodePort",
            &topo.client,
            node_port(node_a, ECHO_NODE_PORT).into(),
            node_port(node_a, REFUSING_NODE_PORT).into(),
        ),
        (
            "a-client -> ClusterIP",
            &client_pod.ns,
            addr(ECHO_IP, ECHO_SERVICE_PORT).into(),
            addr(REFUSING_IP, REFUSING_PORT).into(),
        ),
        (
            "client -> node-a's IPv6 NodePort",
            &topo.client,
            v6(node_a.ip6(), ECHO_NODE_PORT),
            v6(node_a.ip6(), REFUSING_NODE_PORT),
        ),
        (
            "a-client -> IPv6 ClusterIP",
            &client_pod.ns,
            v6(ECHO_IP6, ECHO_SERVICE_PORT),
            v6(REFUSING_IP6, REFUSING_PORT),
        ),
    ];
    for (path, from, echo, refusing) in paths {
        for len in DATAGRAM_SIZES {
            checks.check(
                &format!("{path} -> b-1: {len}-byte datagrams echoed intact"),
                echoed(from, echo, len),
            );
        }
        checks.check(
            &format!("{path} -> b-1's closed port: ECONNREFUSED"),
            refused(from, refusing),
        );
    }
    Ok(())
}

/// Five `len`-byte datagrams from `from` to the echo servers behind `to`,
/// each echoed intact (the first may wait for b-1's server to bind).
fn echoed(from: &Netns, to: SocketAddr, len: usize) -> Result<String> {
    netns::wait_for(&format!("a {len}-byte echo via {to}"), READY_WITHIN, || {
        from.run_in(|| netns::udp_echo_roundtrip(to, len, REQUEST_TIMEOUT))
            .map_err(|e| format!("{e:#}"))?
            .map_err(|e| e.to_string())
    })?;
    for n in 1..=5 {
        from.run_in(|| netns::udp_echo_roundtrip(to, len, REQUEST_TIMEOUT))?
            .with_context(|| format!("datagram {n}"))?;
    }
    Ok("6 echoed".into())
}

/// Three datagrams from `from` to `to`, whose backend does not listen:
/// each must end as ECONNREFUSED (the port unreachable translated back).
fn refused(from: &Netns, to: SocketAddr) -> Result<String> {
    for n in 1..=3 {
        match from.udp_request(to, REQUEST_TIMEOUT)? {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            other => bail!("datagram {n}: {other:?}, not ECONNREFUSED"),
        }
    }
    Ok("3 refused".into())
}

/// Step 5: A backend reaching its own Service is answered by itself.
fn check_hairpin(bed: &TwoNodeBed, checks: &mut Checks) {
    for (pod_name, ip, spec) in [("a-1", HAIRPIN_A_IP, NODE_A), ("b-1", HAIRPIN_B_IP, NODE_B)] {
        let Some((_, pod)) = bed.topo.find_pod(pod_name) else {
            checks.check(&format!("pod {pod_name}"), Err(anyhow::anyhow!("no such pod")));
            continue;
        };
        let to = addr(ip, HAIRPIN_PORT);
        checks.check(
            &format!("UDP {pod_name} -> {to} (its own Service) is answered by itself"),
            expect_always(&pod.ns, Protocol::Udp, to, pod_name, HAIRPIN_REQUESTS),
        );
        checks.check(
            &format!(
                "TCP {pod_name} -> {to} (its own Service) is answered by itself, from its gateway {}",
                spec.gateway
            ),
            sources_seen(&pod.ns, to, &[pod_name], HAIRPIN_REQUESTS)
                .and_then(|seen| expect_sources(&seen, |_| spec.gateway)),
        );
    }
}

/// Sends `count` requests from `from` to `to` at the same time; every one
/// must get no answer at all within [`PROBE_TIMEOUT`] (dropped: a refusal
/// or an answer fails the check).
fn expect_dropped(from: &Netns, protocol: Protocol, to: SocketAddrV4, count: usize) -> Result<String> {
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..count)
            .map(|_| scope.spawn(move || outcome(from, protocol, to, PROBE_TIMEOUT)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a request thread panicked")))
            .collect::<Result<_>>()
    })?;
    let other: Vec<&Outcome> = outcomes.iter().filter(|o| **o != Outcome::NoAnswer).collect();
    ensure!(other.is_empty(), "not dropped: {other:?}");
    Ok(format!("{count} requests got no answer"))
}

/// Requests per "dropped" check (each waits [`PROBE_TIMEOUT`], all at once).
const DROPPED_REQUESTS: usize = 4;

/// Step 6, external: NodePorts of `externalTrafficPolicy: Local` Services
/// reach the entry node's backends only, which see the client's address;
/// a node without one drops; the ClusterIP is not affected.
fn check_external_local(mode: Mode, bed: &TwoNodeBed, checks: &mut Checks) {
    let topo = &bed.topo;
    for entry in &topo.nodes {
        let to = node_port(entry, LOCAL_NODE_PORT);
        let local: Vec<&str> = entry.backends.iter().map(|p| p.name).collect();
        checks.check(
            &format!(
                "TCP client -> {to} (Local, NodePort on {}): only {local:?} answer, and see {CLIENT_IP}",
                entry.name()
            ),
            sources_seen(&topo.client, to, &local, REQUESTS).and_then(|seen| expect_sources(&seen, |_| CLIENT_IP)),
        );
        checks.check(
            &format!("UDP client -> {to} (Local): only {local:?} answer"),
            expect_backends(&topo.client, Protocol::Udp, to, &local, REQUESTS),
        );
    }
    let Some((_, a_client)) = topo.find_pod("a-client") else {
        checks.check("pod a-client", Err(anyhow::anyhow!("no such pod")));
        return;
    };
    checks.check(
        &format!(
            "UDP a-client -> {} (ClusterIP of the Local NodePort Service) reaches {BACKENDS:?}",
            addr(LOCAL_IP, LOCAL_PORT)
        ),
        expect_backends(
            &a_client.ns,
            Protocol::Udp,
            addr(LOCAL_IP, LOCAL_PORT),
            &BACKENDS,
            REQUESTS,
        ),
    );

    let (node_a, node_b) = (topo.node_a(), topo.node_b());
    let to = node_port(node_a, LOCAL_A_NODE_PORT);
    checks.check(
        &format!("TCP client -> {to} (Local, node-a's backends only): {NODE_A_BACKENDS:?} answer, see {CLIENT_IP}"),
        sources_seen(&topo.client, to, &NODE_A_BACKENDS, REQUESTS)
            .and_then(|seen| expect_sources(&seen, |_| CLIENT_IP)),
    );
    let to = node_port(node_b, LOCAL_A_NODE_PORT);
    for protocol in PROTOCOLS {
        checks.check(
            &format!(
                "{} client -> {to} (Local, no backend on node-b): dropped, not refused",
                proto_name(protocol)
            ),
            expect_dropped(&topo.client, protocol, to, DROPPED_REQUESTS),
        );
    }
    if let Some((_, b_1)) = topo.find_pod("b-1") {
        checks.check(
            &format!("TCP b-1 -> {to} (a pod on node-b, not told apart without clusterCIDR): dropped"),
            expect_dropped(&b_1.ns, Protocol::Tcp, to, DROPPED_REQUESTS),
        );
    }
    let expected = mode.own_local_node_port(node_b);
    checks.check(
        &format!(
            "TCP node-b -> {to} (its own NodePort, Local, no backend on it) in {} mode: {}",
            mode.name(),
            match expected {
                Some(source) => format!("{NODE_A_BACKENDS:?} answer, see {source}"),
                None => "refused".into(),
            }
        ),
        match expected {
            Some(source) => sources_seen(&node_b.ns, to, &NODE_A_BACKENDS, REQUESTS)
                .and_then(|seen| expect_sources(&seen, |_| source)),
            None => expect_outcome(&node_b.ns, Protocol::Tcp, to, &Outcome::Refused),
        },
    );
}

/// Step 6, internal: `internalTrafficPolicy: Local` ClusterIPs reach the
/// client pod's node's backends only; none there: dropped.
fn check_internal_local(bed: &TwoNodeBed, checks: &mut Checks) {
    let topo = &bed.topo;
    for from in ["a-client", "b-2"] {
        let Some((node, pod)) = topo.find_pod(from) else {
            checks.check(&format!("pod {from}"), Err(anyhow::anyhow!("no such pod")));
            continue;
        };
        let local: Vec<&str> = node.backends.iter().map(|p| p.name).collect();
        let to = addr(ITP_IP, ITP_PORT);
        for protocol in PROTOCOLS {
            checks.check(
                &format!(
                    "{} {from} (on {}) -> {to} (internalTrafficPolicy: Local) reaches only {local:?}",
                    proto_name(protocol),
                    node.name()
                ),
                expect_backends(&pod.ns, protocol, to, &local, REQUESTS),
            );
        }
        let to = addr(ITP_A_IP, ITP_A_PORT);
        let check = if node.name() == NODE_A.name {
            expect_backends(&pod.ns, Protocol::Tcp, to, &NODE_A_BACKENDS, REQUESTS)
        } else {
            expect_dropped(&pod.ns, Protocol::Tcp, to, DROPPED_REQUESTS).and_then(|tcp| {
                Ok(format!(
                    "{tcp}; UDP: {}",
                    expect_dropped(&pod.ns, Protocol::Udp, to, DROPPED_REQUESTS)?
                ))
            })
        };
        checks.check(
            &format!(
                "{from} -> {to} (internalTrafficPolicy: Local, backends on node-a only): {}",
                if node.name() == NODE_A.name {
                    "node-a's backends answer"
                } else {
                    "dropped, TCP and UDP"
                }
            ),
            check,
        );
    }
}

// ---------------------------------------------------------------------------
// Read-backs.

/// Node `i`'s `xproxy status`: its own node IP carries the NodePorts, with
/// the backends of both nodes (of this node only for `Local` ones, none for
/// node-b's `local-a`, marked as dropping); the other node's IP carries
/// none.
fn ebpf_read_back(bed: &TwoNodeBed, i: usize) -> Result<String> {
    let node = &bed.topo.nodes[i];
    let other = &bed.topo.nodes[1 - i];
    let status = bed.status(i)?;
    let seen = frontends(&status);
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for (frontend, kind) in [
            (format!("{p} {}", addr(SPREAD_IP, SPREAD_PORT)), "ClusterIP"),
            (format!("{p} {}", node_port(node, SPREAD_NODE_PORT)), "NodePort"),
        ] {
            let got = seen.get(&frontend).map(|(k, n)| (k.as_str(), *n));
            ensure!(
                got == Some((kind, BACKENDS.len())),
                "{frontend}: expected {kind} with {} backends, got {got:?}:\n{status}",
                BACKENDS.len()
            );
        }
    }
    let local_a = if node.name() == NODE_A.name {
        NODE_A_BACKENDS.len()
    } else {
        0
    };
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for (to, backends) in [
            (node_port(node, LOCAL_NODE_PORT), node.backends.len()),
            (node_port(node, LOCAL_A_NODE_PORT), local_a),
        ] {
            let frontend = format!("{p} {to}");
            let got = seen.get(&frontend).map(|(k, n)| (k.as_str(), *n));
            ensure!(
                got == Some(("NodePort", backends)),
                "{frontend}: expected NodePort with {backends} backends, got {got:?}:\n{status}"
            );
            let marked = if backends == 0 {
                "drop"
            } else {
                "Local: this node's endpoints"
            };
            ensure!(
                status
                    .lines()
                    .any(|l| l.starts_with(&format!("{p:<4} {to} NodePort")) && l.contains(marked)),
                "{frontend} is not marked {marked:?}:\n{status}"
            );
        }
    }
    let foreign: Vec<&String> = seen.keys().filter(|k| k.contains(&other.ip().to_string())).collect();
    ensure!(
        foreign.is_empty(),
        "{} programs frontends on {}'s address: {foreign:?}",
        node.name(),
        other.name()
    );
    Ok(format!("{} frontends, none on {}", seen.len(), other.ip()))
}

/// Names of the tc programs attached to `iface` in `ns`, both directions:
/// tcx links (kernels from 6.6) and clsact filters (older kernels).
fn tc_programs(ns: &Netns, iface: &str) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for (attach, direction) in [(TcAttachType::Ingress, "ingress"), (TcAttachType::Egress, "egress")] {
        // A kernel without tcx fails the query: it has only filters.
        if let Ok((_, infos)) = ns.run_in(|| SchedClassifier::query_tcx(iface, attach))? {
            names.extend(
                infos
                    .iter()
                    .map(|i| format!("{} (tcx)", i.name_as_str().unwrap_or("?"))),
            );
        }
        let filters = ns.exec(&["tc", "filter", "show", "dev", iface, direction])?;
        names.extend(
            filters
                .lines()
                .filter(|l| l.contains(" bpf "))
                .map(|l| format!("{} (filter)", l.trim())),
        );
    }
    Ok(names)
}

/// After `xproxy cleanup`: no pins, no XDP or tc program on the uplink or a
/// pod interface, no iptables chain (KUBE-*, XPROXY-*), no nftables table.
fn nothing_left(bed: &TwoNodeBed, i: usize) -> Result<String> {
    let node = &bed.topo.nodes[i];
    let pins = bed.pin_path(i);
    ensure!(!pins.exists(), "{} is still there", pins.display());
    let link = node.ns.ip(&["-d", "link", "show", "dev", &node.uplink])?;
    ensure!(!link.contains("prog/xdp"), "XDP still on the uplink:\n{link}");
    for iface in std::iter::once(node.uplink.clone()).chain(node.pod_ifs()) {
        let names = tc_programs(&node.ns, &iface)?;
        ensure!(names.is_empty(), "tc programs left on {iface}: {names:?}");
    }
    let saved = node.ns.exec(&["iptables-save"])?;
    ensure!(
        !saved.contains("KUBE-") && !saved.contains("XPROXY-"),
        "iptables rules left:\n{saved}"
    );
    let tables = node.ns.exec(&["nft", "list", "tables"])?;
    ensure!(!tables.contains("xproxy"), "nftables tables left:\n{tables}");
    Ok("no pins, programs, chains or tables".into())
}

// ---------------------------------------------------------------------------
// One test per mode.

#[test]
fn two_node_ebpf() {
    if !require_root("two_node_ebpf") {
        return;
    }
    scenario(Mode::Ebpf, Offloads::On);
}

/// The programs rewrite checksums in both of the kernel's states: partial
/// (above, local traffic over veths) and full (here).
#[test]
fn two_node_ebpf_tx_off() {
    if !require_root("two_node_ebpf_tx_off") {
        return;
    }
    scenario(Mode::Ebpf, Offloads::TxOff);
}

#[test]
fn two_node_iptables() {
    if !require_root("two_node_iptables") {
        return;
    }
    scenario(Mode::Iptables, Offloads::On);
}

#[test]
fn two_node_nftables() {
    if !require_root("two_node_nftables") {
        return;
    }
    scenario(Mode::Nftables, Offloads::On);
}

// ---------------------------------------------------------------------------
// The agent's mode-independent Service features on two nodes: health check
// node ports and topology hints (issue 12, items 4 and 5), the same in
// every mode: both are decided before a mode sees the state (health checks
// read the desired state, topology narrows `EndpointSets` for every mode).

/// `type: LoadBalancer`, `externalTrafficPolicy: Local`, node-a's backends
/// only: node-a's health check answers 200 with 2, node-b's 503 with 0.
const LB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 90);
const LB_PORT: u16 = 90;
const LB_NODE_PORT: u16 = 30890;
const HEALTH_CHECK_PORT: u16 = 32090;
/// Zone hints on every endpoint (each its node's zone): each node's pods
/// reach their zone's backends only.
const ZONAL_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 91);
const ZONAL_PORT: u16 = 91;
/// Zone hints on all but b-2: ignored, every backend.
const PARTLY_HINTED_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 92);
const PARTLY_HINTED_PORT: u16 = 92;
const AGENT_FEATURES: &str = "agent-features.yaml";

fn zone_of(node: &str) -> &'static str {
    if node == NODE_A.name { "zone-a" } else { "zone-b" }
}

/// This bed's Node objects (what the manifests source reads a node's zone
/// from), node-a in `zone_a`.
fn nodes(zone_a: &str) -> Vec<Value> {
    [(NODE_A.name, zone_a), (NODE_B.name, zone_of(NODE_B.name))]
        .into_iter()
        .map(|(name, zone)| {
            serde_json::json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}}})
        })
        .collect()
}

/// The Services of this scenario; the load balancer only `with_lb`.
fn agent_feature_objects(topo: &TwoNodes, zone_a: &str, with_lb: bool) -> Result<Vec<Value>> {
    let mut out = nodes(zone_a);
    if with_lb {
        let lb = [PortDef::tcp(LB_PORT, PEER_PORT, Some(LB_NODE_PORT))];
        let mut svc = service_with("lb-a", LB_IP, &lb, Some(TrafficPolicy::Local));
        svc["spec"]["type"] = serde_json::json!("LoadBalancer");
        svc["spec"]["healthCheckNodePort"] = serde_json::json!(HEALTH_CHECK_PORT);
        out.push(svc);
        out.push(slice_with(
            "lb-a-1",
            "lb-a",
            &lb,
            &endpoints_of(topo, &NODE_A_BACKENDS)?,
        ));
    }
    for (name, ip, port, unhinted) in [
        ("zonal", ZONAL_IP, ZONAL_PORT, None),
        ("partly-hinted", PARTLY_HINTED_IP, PARTLY_HINTED_PORT, Some("b-2")),
    ] {
        let ports = [PortDef::tcp(port, TARGET_PORT, None)];
        out.push(service_with(name, ip, &ports, None));
        let mut slice = slice_with(&format!("{name}-1"), name, &ports, &endpoints_of(topo, &BACKENDS)?);
        let unhinted_ip = unhinted
            .map(|pod| pod_addr(topo, pod, 0))
            .transpose()?
            .map(|a| a.ip().to_string());
        for endpoint in slice["endpoints"].as_array_mut().into_iter().flatten() {
            let zone = zone_of(endpoint["nodeName"].as_str().unwrap_or_default());
            endpoint["zone"] = serde_json::json!(zone);
            if endpoint["addresses"][0].as_str() != unhinted_ip.as_deref() {
                endpoint["hints"] = serde_json::json!({"forZones": [{"name": zone}]});
            }
        }
        out.push(slice);
    }
    Ok(out)
}

/// `GET /` on `to` from the outside client: status, headers (lowercase)
/// and body.
fn health_check(topo: &TwoNodes, to: SocketAddrV4) -> Result<(u16, String, Value)> {
    let url = format!("http://{to}/");
    let out = netns::run(topo.client.command("curl")?.args(["-s", "-i", "--max-time", "2", &url]))?;
    let (head, body) = out
        .split_once("\r\n\r\n")
        .with_context(|| format!("not HTTP: {out:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    let body = serde_json::from_str(body).with_context(|| format!("not JSON: {body:?}"))?;
    Ok((status, head.to_ascii_lowercase(), body))
}

fn expect_health_check(topo: &TwoNodes, node: &Node, status: u16, local: u64) -> Result<String> {
    let (got, head, body) = health_check(topo, node_port(node, HEALTH_CHECK_PORT))?;
    ensure!(got == status, "status {got}, expected {status}: {body}");
    ensure!(body["localEndpoints"] == local, "localEndpoints not {local}: {body}");
    ensure!(
        body["service"] == serde_json::json!({"namespace": "default", "name": "lb-a"}),
        "{body}"
    );
    for header in [
        "content-type: application/json".to_string(),
        "x-content-type-options: nosniff".to_string(),
        format!("x-load-balancing-endpoint-weight: {local}"),
    ] {
        ensure!(head.contains(&header), "no {header:?} in {head}");
    }
    Ok(format!("{status} {body}"))
}

fn agent_features(mode: Mode) {
    let label = format!("two_node_agent_features_{}", mode.name());
    let mut bed = TwoNodeBed::new(&label, Offloads::On).unwrap_or_else(|e| panic!("{label}: test bed: {e:#}"));
    let mut checks = Checks::new(&label);
    if let Err(e) = agent_feature_steps(mode, &mut bed, &mut checks) {
        panic!("{label}: {e:#}\nchecks failed before: {}", checks.failures());
    }
    checks.finish();
}

fn agent_feature_steps(mode: Mode, bed: &mut TwoNodeBed, checks: &mut Checks) -> Result<()> {
    let write = |bed: &TwoNodeBed, zone_a: &str, with_lb: bool| -> Result<()> {
        let objects = agent_feature_objects(&bed.topo, zone_a, with_lb)?;
        bed.write_manifest(AGENT_FEATURES, &yaml_documents(&objects))?;
        Ok(())
    };
    write(bed, "zone-a", true)?;
    bed.start_agents(mode.name())?;
    bed.wait_first_syncs(READY_WITHIN)?;
    let topo = &bed.topo;
    let (node_a, node_b) = (topo.node_a(), topo.node_b());

    // Health check node ports: the listener opens after the sync.
    netns::wait_for("node-a's health check node port", READY_WITHIN, || {
        health_check(topo, node_port(node_a, HEALTH_CHECK_PORT)).map_err(|e| format!("{e:#}"))
    })?;
    checks.check(
        "node-a's health check node port: 200, 2 local endpoints",
        expect_health_check(topo, node_a, 200, 2),
    );
    checks.check(
        "node-b's health check node port: 503, no local endpoint",
        expect_health_check(topo, node_b, 503, 0),
    );

    // Zone hints: each node's pods reach their zone's backends.
    let (_, a_client) = topo.find_pod("a-client").context("pod a-client")?;
    let (_, b_2) = topo.find_pod("b-2").context("pod b-2")?;
    let zonal = addr(ZONAL_IP, ZONAL_PORT);
    checks.check(
        &format!("a-client -> {zonal} (zone hints, node-a in zone-a): only {NODE_A_BACKENDS:?}"),
        expect_backends(&a_client.ns, Protocol::Tcp, zonal, &NODE_A_BACKENDS, REQUESTS),
    );
    checks.check(
        &format!("b-2 -> {zonal} (zone hints, node-b in zone-b): only b-1 and b-2"),
        expect_backends(&b_2.ns, Protocol::Tcp, zonal, &["b-1", "b-2"], REQUESTS),
    );
    let partly = addr(PARTLY_HINTED_IP, PARTLY_HINTED_PORT);
    checks.check(
        &format!("a-client -> {partly} (b-2 has no hint: hints ignored): {BACKENDS:?}"),
        expect_backends(&a_client.ns, Protocol::Tcp, partly, &BACKENDS, REQUESTS),
    );

    // node-a moves to zone-b and the load balancer goes: its pods follow
    // the new zone, and both health check ports close.
    write(bed, "zone-b", false)?;
    let a_client_ns = &a_client.ns;
    let moved = netns::wait_for("a-client to reach zone-b's backends", READY_WITHIN, || {
        expect_backends(a_client_ns, Protocol::Tcp, zonal, &["b-1", "b-2"], REQUESTS).map_err(|e| format!("{e:#}"))
    });
    checks.check(
        "a-client -> zonal after node-a moved to zone-b: only b-1 and b-2",
        moved,
    );
    for node in [node_a, node_b] {
        let to = node_port(node, HEALTH_CHECK_PORT);
        let closed = netns::wait_for(&format!("{to} to close"), READY_WITHIN, || {
            match topo
                .client
                .tcp_request(to, REQUEST_TIMEOUT)
                .map_err(|e| format!("{e:#}"))?
            {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok("refused".to_string()),
                other => Err(format!("still open: {other:?}")),
            }
        });
        checks.check(
            &format!("{}'s health check node port closes with the Service", node.name()),
            closed,
        );
    }
    bed.stop_agents()?;
    Ok(())
}

#[test]
fn two_node_agent_features_iptables() {
    if !require_root("two_node_agent_features_iptables") {
        return;
    }
    agent_features(Mode::Iptables);
}

#[test]
fn two_node_agent_features_ebpf() {
    if !require_root("two_node_agent_features_ebpf") {
        return;
    }
    agent_features(Mode::Ebpf);
}

#[test]
fn two_node_agent_features_nftables() {
    if !require_root("two_node_agent_features_nftables") {
        return;
    }
    agent_features(Mode::Nftables);
}
