//! One end-to-end suite for every mode: the seed scenario through the real
//! agent (`xproxy run --mode MODE --manifests DIR`) in the node namespace of
//! the test bed (`testbed::topology`), the same steps and the same
//! expectations in ebpf, iptables, nftables, userspace and IPVS mode (IPVS
//! where the kernel has it: `cargo xtask vm` runs `modes:ipvs` in its 6.1
//! guest). Each mode gets a test of its own on a topology of its own, so
//! the modes run in parallel.
//!
//! The scenario ([`seed_scenario`]):
//! 1. Before the agent starts, what every request does without a proxy:
//!    the baseline.
//! 2. The seed Service (`nginx-service`, 88 -> 80, NodePort 30791; here with
//!    a UDP port beside the TCP one) over TCP and UDP: from the client via
//!    `NODE_IP:30791`, from the client pod and from the node via
//!    `CLUSTER_IP:88`; every request is answered, all three pods answer.
//! 3. A Service without endpoints fails at once from the same three
//!    places (TCP: ECONNREFUSED; UDP: ECONNREFUSED after an ICMP port
//!    unreachable, except from the node in the rule-based modes: see below).
//! 4. Traffic that is no Service's behaves as in the baseline; the
//!    differences between the modes (below) hold.
//! 5. The mode's own read-back: `xproxy status` (every mode: the table
//!    of frontends and backends, the mode found by itself), `iptables-save`
//!    (iptables: the chain walk with kube-proxy's probabilities; userspace:
//!    the KUBE-PORTALS-* / KUBE-NODEPORT-* rules redirect to ports the
//!    agent listens on, REJECT for the Service without endpoints), `nft
//!    list table ip xproxy` (the verdict maps and chains), `ipvsadm -Ln`
//!    (the virtual and real servers).
//! 6. pod-3 leaves the EndpointSlice in the manifest: the change is
//!    programmed (only pod-1 and pod-2 answer; the read-back shows it), in
//!    a partial sync; a UDP flow that was on pod-3 moves to a remaining
//!    backend (each mode in its own way: below).
//! 7. SIGTERM: the agent exits 0; the kernel modes' data path stays
//!    (requests still succeed), like kube-proxy's rules; the userspace
//!    mode's goes with the agent (requests end as in the baseline).
//! 8. `xproxy cleanup` inside the node namespace removes it: every request
//!    ends as in the baseline, and the read-back finds nothing left.
//!
//! Beside it: `hairpin_*` (a backend reaches its own Service);
//! [`userspace_long_lived_flows_and_sigkill`] for what only the userspace
//! mode has (flows and connections across the endpoint change, a sync that
//! writes nothing, rules a killed agent leaves behind); and
//! [`switching_modes_with_cleanup_between`]: one test bed, the agent in
//! every available mode in turn with `xproxy cleanup` between, where each
//! mode behaves as on a bed of its own (no double translation) and each
//! cleanup leaves nothing behind.
//!
//! Where the modes differ, the difference is asserted per mode, not
//! skipped (the `Mode` methods below, and the `hairpin_*` tests). "The
//! node's address towards the pods" is `POD_GATEWAY`.
//!
//! | what | ebpf | iptables | nftables | ipvs | userspace | kube-proxy (iptables)
//! |---|---|---|---|---|---|---
//! | hairpin: a backend pod reaches its own Service | works (the programs DNAT and mark, the kernel masquerades) | works (masquerade) | works (masquerade) | works (KUBE-LOOP-BACK masquerade) | works (the agent connects to the pod from the node) | works
//! | NodePort from the node itself, `NODE_IP:30791` | answers (socket programs on the root cgroup, for the node's network namespace only, rewrite the destination at connect/sendmsg; any node address, also one added later) | answers | answers | answers | answers (OUTPUT DNAT to the agent on 127.0.0.1) | answers
//! | NodePort on localhost, `127.0.0.1:30791` | answers (`localhostNodePorts`, default true, as kube-proxy's iptables mode; no `route_localnet` needed: the socket never sends to 127.0.0.1) | answers (`localhostNodePorts`, `route_localnet=1`) | refused (as kube-proxy's nftables mode) | refused (no virtual server on 127.0.0.1, as kube-proxy's IPVS mode) | answers (the same DNAT; no `route_localnet` needed) | answers
//! | source a backend sees of NodePort traffic | the client's (no SNAT: every backend is on this node; one on another node would see the node's) | the node's (masquerade) | the node's (masquerade) | the node's (masquerade) | the node's (the agent's own connection) | the node's
//! | source a backend sees of ClusterIP traffic from a pod | the pod's | the pod's | the pod's | the pod's | the node's address towards the pods (the agent's own connection) | the pod's
//! | source a backend sees of ClusterIP traffic from the node | `NODE_IP` | `NODE_IP` | `NODE_IP` | the node's address towards the pods (the VIP on kube-ipvs0 is the source, masqueraded) | the node's address towards the pods (the agent's own connection) | `NODE_IP`
//! | UDP from the node to a Service without endpoints: ClusterIP | ECONNREFUSED (the program's ICMP port unreachable) | EPERM at `send` (REJECT drops the node's own packet) | EPERM at `send` | EPERM at `send` | EPERM at `send` (REJECT in OUTPUT) | EPERM at `send`
//! | ... and its NodePort, `NODE_IP:30792` | ECONNREFUSED (the socket programs leave a frontend without backends alone; nothing listens) | ECONNREFUSED (rejected in INPUT, after the packet left: the ICMP error comes back) | EPERM at `send` (the endpoints check is in the output hook too) | EPERM at `send` (virtual server on `NODE_IP` without real servers) | EPERM at `send` (REJECT in OUTPUT) | ECONNREFUSED (KUBE-EXTERNAL-SERVICES is in INPUT)
//! | a UDP flow whose endpoint left the Service | moves (the agent deletes the flow's entries from the programs' conntrack after the sync) | moves (the agent deletes the flow's conntrack entries after the sync) | moves (the same) | moves (`expire_nodest_conn`, and the same deletion) | moves (its session is closed at once; the next datagram opens one to a remaining endpoint) | moves (kube-proxy deletes them too)
//! | the data path after SIGTERM | stays (pinned programs and maps) | stays (the rules) | stays (the table) | stays (virtual servers, rules, ipsets) | gone with the agent (it removes its rules); after SIGKILL the rules refuse Service requests until `xproxy cleanup` | stays
//!
//! The differences follow from where each mode translates: the userspace
//! mode is the only one where the backend's peer is the agent itself. No
//! `clusterCIDR` is configured, so the kernel modes masquerade nothing as
//! off-cluster traffic and a pod's ClusterIP request keeps its source.
//!
//! Every stage opens its flows from local ports of its own ([`Stages`]),
//! so no request is steered by a conntrack entry of an earlier stage; the
//! node answers every refused request (no ICMP rate limit in the test bed).

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use aya::programs::{SchedClassifier, TcAttachType};
use proxy_userspace::{
    mode::{ebpf::snat, iptables::chains::PortChains, nftables::names},
    model::{Endpoint, ServicePort},
};
use serde_json::Value;
use testbed::{
    agent_bed::{
        AgentBed, DATAPATH_PACKETS, EchoClients, KERNEL_WRITES, Mode, READY_WITHIN, frontends, ipvs_virtual_servers,
        on_own_bed, seed_node_port,
    },
    fixtures::{
        self, EMPTY_CLUSTER_IP, EMPTY_NODE_PORT, EMPTY_PORT, PortDef, SEED_CLUSTER_IP, SEED_NODE_PORT, SEED_PORT,
        backend_ips, on_node, ports, seed_tcp_udp, service, service_with, slice, with_app, yaml_documents,
    },
    netns::{self, Netns, udp_request_from},
    privileged::require_root,
    probe::{
        self, Checks, NODE_SERVER_PORT, Outcome, PROTOCOLS, Place, Protocol, REQUESTS, Stages, backend_names,
        check_non_service, expect_all_backends, expect_backends, expect_outcome, expect_rejected, proto_name,
    },
    topology::{BACKENDS, CLIENT_IP, CLIENT_POD, NODE_IP, POD_GATEWAY, TARGET_PORT, Topology},
};

// ---------------------------------------------------------------------------
// The Services.

/// A Service whose backends answer with the client address they see
/// (beside the seed and the Service without endpoints of `scenario`).
const SOURCE_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 81);
const SOURCE_PORT: u16 = 81;
const SOURCE_TARGET_PORT: u16 = 81;
const SOURCE_NODE_PORT: u16 = 30781;

/// An echo Service for long-lived connections (the userspace-only test).
const ECHO_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const ECHO_PORT: u16 = 7;
const ECHO_TARGET_PORT: u16 = 7007;

const SEED_FILE: &str = "seed.yaml";
const OTHERS_FILE: &str = "others.yaml";
const ECHO_FILE: &str = "echo.yaml";

/// The port names of the two-protocol Services (named, as Kubernetes
/// requires of a Service with more than one port).
fn port_name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp => "http",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// The seed Service (examples/seed/manifests/nginx.yaml) with a UDP port
/// beside the TCP one, and its EndpointSlice with `backends`.
fn seed_objects(backends: &[Ipv4Addr]) -> Vec<Value> {
    fixtures::seed_objects_with(&seed_tcp_udp(), &on_node(backends))
}

/// The Service without endpoints and the one that reports source addresses.
fn other_objects() -> Vec<Value> {
    vec![
        with_app(
            service_with(
                fixtures::EMPTY_NAME,
                EMPTY_CLUSTER_IP,
                &PortDef::tcp_udp(
                    ("http", "udp"),
                    EMPTY_PORT,
                    (TARGET_PORT, TARGET_PORT),
                    Some(EMPTY_NODE_PORT),
                ),
                None,
            ),
            "nginx",
        ),
        service(
            "source-ip",
            SOURCE_CLUSTER_IP,
            SOURCE_PORT,
            SOURCE_TARGET_PORT,
            Some(SOURCE_NODE_PORT),
        ),
        slice("source-ip-1", "source-ip", SOURCE_TARGET_PORT, &backend_ips()),
    ]
}

fn echo_objects(backends: &[Ipv4Addr]) -> Vec<Value> {
    vec![
        service("echo", ECHO_CLUSTER_IP, ECHO_PORT, ECHO_TARGET_PORT, None),
        slice("echo-1", "echo", ECHO_TARGET_PORT, backends),
    ]
}

/// A seed port as the agent's model has it, for the modes' names.
fn seed_port(protocol: Protocol, backends: &[Ipv4Addr]) -> ServicePort {
    ports::seed_port(
        &format!("default/nginx-service:{}", port_name(protocol)),
        protocol,
        backends,
    )
}

fn seed_cluster_ip() -> SocketAddrV4 {
    SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT)
}

fn empty_node_port() -> SocketAddrV4 {
    SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT)
}

fn empty_cluster_ip() -> SocketAddrV4 {
    SocketAddrV4::new(EMPTY_CLUSTER_IP, EMPTY_PORT)
}

fn on_localhost(addr: SocketAddrV4) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, addr.port())
}

/// pod-1 and pod-2: the seed's endpoints after the change.
fn two_backends() -> Vec<Ipv4Addr> {
    backend_ips()[..2].to_vec()
}

fn two_backend_names() -> Vec<&'static str> {
    BACKENDS[..2].iter().map(|(name, _)| *name).collect()
}

const POD3: &str = BACKENDS[2].0;

// ---------------------------------------------------------------------------
// The modes and where they differ.

/// How a request from the node to a NodePort on one of its own addresses ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeLocal {
    /// Every backend answers.
    Answers,
    /// Refused by the node's kernel: nothing listens there.
    Refused,
}

/// What becomes of the data path when the agent exits on SIGTERM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AfterSigterm {
    /// It stays as the agent left it, like kube-proxy's rules.
    Stays,
    /// It goes with the agent: requests end as without a proxy.
    Gone,
}

/// Where the modes differ (the table at the top). IPVS runs where the
/// kernel has it: `cargo xtask vm` runs `modes:ipvs`.
trait Differences {
    fn node_port_from_node(self) -> NodeLocal;
    fn node_port_on_localhost(self) -> NodeLocal;
    fn node_udp_rejection(self) -> io::ErrorKind;
    fn node_udp_node_port_rejection(self) -> io::ErrorKind;
    fn pod_cluster_ip_source(self) -> Ipv4Addr;
    fn node_cluster_ip_source(self) -> Ipv4Addr;
    fn node_port_source(self) -> Ipv4Addr;
    fn after_sigterm(self) -> AfterSigterm;
}

impl Differences for Mode {
    /// `NODE_IP:30791` from a process on the node.
    fn node_port_from_node(self) -> NodeLocal {
        match self {
            // IPVS hooks LOCAL_OUT too: the node's own packets to a virtual
            // server are balanced like any other. The userspace mode's
            // OUTPUT rule DNATs them to its listener on 127.0.0.1. The
            // ebpf mode's socket programs rewrite the destination at
            // connect / sendmsg (its packets through `lo` pass no tc program).
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Ipvs | Mode::Userspace => NodeLocal::Answers,
        }
    }

    /// `127.0.0.1:30791` from a process on the node.
    fn node_port_on_localhost(self) -> NodeLocal {
        match self {
            // kube-proxy's default `iptables.localhostNodePorts: true`
            // (the ebpf mode follows it: its socket programs take
            // 127.0.0.1 as a node address).
            Mode::Ebpf | Mode::Iptables => NodeLocal::Answers,
            // kube-proxy's nftables mode never answers on 127.0.0.0/8.
            Mode::Nftables => NodeLocal::Refused,
            // Virtual servers exist for the node IPs only (kube-proxy's
            // IPVS mode does not serve node ports on localhost either).
            Mode::Ipvs => NodeLocal::Refused,
            // The same OUTPUT DNAT as for `NODE_IP`: the packet never
            // leaves `lo`, so no `route_localnet` is needed.
            Mode::Userspace => NodeLocal::Answers,
        }
    }

    /// How a UDP request from a process on the node to a Service without
    /// endpoints fails.
    fn node_udp_rejection(self) -> io::ErrorKind {
        match self {
            // The program answers with ICMP port unreachable.
            Mode::Ebpf => io::ErrorKind::ConnectionRefused,
            // REJECT in the output path drops the node's own packet: send()
            // fails with EPERM (kube-proxy's rules do the same; so do the
            // userspace mode's, in OUTPUT too). In IPVS mode the virtual
            // server without real servers drops the node's own packet the
            // same way.
            Mode::Iptables | Mode::Nftables | Mode::Ipvs | Mode::Userspace => io::ErrorKind::PermissionDenied,
        }
    }

    /// How a UDP request from a process on the node to a NodePort without
    /// endpoints on the node's address fails.
    fn node_udp_node_port_rejection(self) -> io::ErrorKind {
        match self {
            // The socket programs leave a frontend without backends
            // alone: nothing listens, the kernel answers with ICMP port
            // unreachable.
            Mode::Ebpf => io::ErrorKind::ConnectionRefused,
            // As kube-proxy's rules: NodePorts without endpoints are
            // rejected in INPUT (KUBE-EXTERNAL-SERVICES), after the packet
            // left the socket, so the ICMP error comes back.
            Mode::Iptables => io::ErrorKind::ConnectionRefused,
            // Rejected in the output path like a ClusterIP: the
            // endpoints-check of filter-output, the virtual server on
            // NODE_IP, KUBE-PORTALS-REJECT in OUTPUT.
            Mode::Nftables | Mode::Ipvs | Mode::Userspace => io::ErrorKind::PermissionDenied,
        }
    }

    /// The source address a backend sees of ClusterIP traffic from a pod.
    fn pod_cluster_ip_source(self) -> Ipv4Addr {
        match self {
            // DNAT only: nothing is masqueraded without a clusterCIDR.
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Ipvs => CLIENT_POD.1,
            // The agent ends the pod's connection and opens its own from
            // the node: the route to the pod picks the node's address on
            // the pods' side.
            Mode::Userspace => POD_GATEWAY,
        }
    }

    /// The source address a backend sees of ClusterIP traffic from the node.
    fn node_cluster_ip_source(self) -> Ipv4Addr {
        match self {
            // The route to a Service address picks the node's address.
            Mode::Ebpf | Mode::Iptables | Mode::Nftables => NODE_IP,
            // kube-ipvs0 holds every ClusterIP, so the node's connection
            // leaves from the ClusterIP itself; the constant rules
            // masquerade such traffic (KUBE-CLUSTER-IP src,dst), as
            // kube-proxy's do: the backend sees the node's address on the
            // pods' side.
            Mode::Ipvs => POD_GATEWAY,
            // The agent's own connection, as for a pod.
            Mode::Userspace => POD_GATEWAY,
        }
    }

    /// The source address a backend sees of NodePort traffic from the client.
    fn node_port_source(self) -> Ipv4Addr {
        match self {
            // DNAT only: the backends are on this node, so replies come
            // back through it without SNAT.
            Mode::Ebpf => CLIENT_IP,
            // KUBE-EXT / external-* chains mark for masquerade: the address
            // of the interface towards the pod (the pods' gateway).
            Mode::Iptables | Mode::Nftables => POD_GATEWAY,
            // KUBE-NODE-PORT marks for masquerade the same way.
            Mode::Ipvs => POD_GATEWAY,
            // The agent's own connection, as for a pod.
            Mode::Userspace => POD_GATEWAY,
        }
    }

    fn after_sigterm(self) -> AfterSigterm {
        match self {
            // Pinned programs and maps, rules, a table, virtual servers:
            // the kernel keeps forwarding without the agent.
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Ipvs => AfterSigterm::Stays,
            // The agent is the data path: it removes its rules on the way
            // out, which would otherwise send traffic to closed ports.
            Mode::Userspace => AfterSigterm::Gone,
        }
    }
}

// ---------------------------------------------------------------------------
// Requests compared with the baseline.

type Probe = probe::Probe<Place>;

fn probe(from: Place, protocol: Protocol, to: SocketAddrV4, service: bool) -> Probe {
    Probe {
        from,
        protocol,
        to: to.into(),
        service,
    }
}

/// Requests to the Services, and to what is no Service's.
fn probes() -> Vec<Probe> {
    let mut services = Vec::new();
    for protocol in PROTOCOLS {
        for (node_port, cluster_ip) in [
            (seed_node_port(), seed_cluster_ip()),
            (empty_node_port(), empty_cluster_ip()),
        ] {
            services.push(probe(Place::Client, protocol, node_port, true));
            services.push(probe(Place::ClientPod, protocol, cluster_ip, true));
            services.push(probe(Place::Node, protocol, cluster_ip, true));
            services.push(probe(Place::Node, protocol, node_port, true));
            services.push(probe(Place::Node, protocol, on_localhost(node_port), true));
        }
    }
    let pod = |i: usize| SocketAddrV4::new(BACKENDS[i].1, TARGET_PORT);
    let others = [
        probe(
            Place::Client,
            Protocol::Tcp,
            SocketAddrV4::new(NODE_IP, NODE_SERVER_PORT),
            false,
        ),
        probe(Place::Client, Protocol::Tcp, pod(0), false),
        probe(Place::Client, Protocol::Udp, pod(0), false),
        probe(Place::ClientPod, Protocol::Tcp, pod(1), false),
        probe(Place::Node, Protocol::Udp, pod(2), false),
    ];
    services.into_iter().chain(others).collect()
}

/// What every probe does without a proxy.
struct Baseline(probe::Baseline<Place>);

impl Baseline {
    /// Starts the servers the probes and checks expect besides the pods',
    /// then records every probe's outcome from the first stage's ports.
    fn take(label: &str, bed: &AgentBed, stages: &mut Stages) -> Result<Self> {
        bed.topo.node.serve_tcp(NODE_SERVER_PORT, "node")?;
        for pod in &bed.topo.backends {
            pod.ns.serve_tcp_peer(SOURCE_TARGET_PORT, pod.name)?;
        }
        stages.next(&bed.topo)?;
        Ok(Self(probe::Baseline::take(label, probes(), |p| Ok(p.ns(&bed.topo)))?))
    }

    /// Ok if every probe ends as without a proxy.
    fn same(&self, topo: &Topology) -> Result<String> {
        self.0.same(|p| Ok(p.ns(topo)))
    }

    /// Ok if the probes to what is no Service's end as without a proxy.
    fn same_beside_services(&self, topo: &Topology) -> Result<String> {
        self.0.same_beside_services(|p| Ok(p.ns(topo)))
    }
}

// ---------------------------------------------------------------------------
// The checks.

/// Starts the agent in `mode` on a test bed with the seed and the other
/// Services in its manifest directory; returns once it answers.
fn start(bed: &mut AgentBed, mode: Mode) -> Result<()> {
    bed.write_manifest(SEED_FILE, &yaml_documents(&seed_objects(&backend_ips())))?;
    bed.write_manifest(OTHERS_FILE, &yaml_documents(&other_objects()))?;
    bed.start_agent_in(mode.name(), &bed.manifest_args())?;
    // One sync programs every Service.
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(seed_node_port(), READY_WITHIN)?;
    Ok(())
}

/// Stops the agent with SIGTERM; it must exit 0.
fn stop(bed: &mut AgentBed) -> Result<()> {
    let status = bed.stop_agent(libc::SIGTERM)?;
    ensure!(
        status.success(),
        "the agent exited with {status} on SIGTERM:\n{}",
        bed.log()
    );
    Ok(())
}

/// Every seed check from the three places, answered by `backends`.
fn check_seed(topo: &Topology, checks: &mut Checks, backends: &[&str]) {
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for (what, from, addr) in [
            ("client", &topo.client, seed_node_port()),
            ("client pod", &topo.client_pod.ns, seed_cluster_ip()),
            ("node", &topo.node, seed_cluster_ip()),
        ] {
            checks.check(
                &format!("{p} {what} -> {addr} reaches {backends:?}"),
                expect_backends(from, protocol, addr, backends, REQUESTS),
            );
        }
    }
}

fn check_empty(mode: Mode, topo: &Topology, checks: &mut Checks) {
    let refused = io::ErrorKind::ConnectionRefused;
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        // How UDP fails; TCP is refused from everywhere.
        for (what, from, addr, udp) in [
            ("client", &topo.client, empty_node_port(), refused),
            ("client pod", &topo.client_pod.ns, empty_cluster_ip(), refused),
            ("node", &topo.node, empty_cluster_ip(), mode.node_udp_rejection()),
            (
                "node",
                &topo.node,
                empty_node_port(),
                mode.node_udp_node_port_rejection(),
            ),
        ] {
            let kind = if protocol == Protocol::Udp { udp } else { refused };
            checks.check(
                &format!("{p} {what} -> {addr} (no endpoints) fails at once with {kind:?}"),
                expect_rejected(from, protocol, addr, kind),
            );
        }
    }
}

/// The modes' differences (see the table at the top).
fn check_differences(mode: Mode, topo: &Topology, checks: &mut Checks) {
    for protocol in PROTOCOLS {
        for (what, addr, expected) in [
            ("node -> NODE_IP:30791", seed_node_port(), mode.node_port_from_node()),
            (
                "node -> 127.0.0.1:30791",
                on_localhost(seed_node_port()),
                mode.node_port_on_localhost(),
            ),
        ] {
            let result = match expected {
                NodeLocal::Answers => expect_all_backends(&topo.node, protocol, addr),
                NodeLocal::Refused => expect_outcome(&topo.node, protocol, addr, &Outcome::Refused),
            };
            let p = proto_name(protocol);
            checks.check(&format!("{p} {what}: {expected:?} in {} mode", mode.name()), result);
        }
    }
    check_sources(mode, topo, checks);
}

/// The source address every backend sees, from the three places.
fn check_sources(mode: Mode, topo: &Topology, checks: &mut Checks) {
    for (what, from, addr, source) in [
        (
            "client -> NodePort",
            &topo.client,
            SocketAddrV4::new(NODE_IP, SOURCE_NODE_PORT),
            mode.node_port_source(),
        ),
        (
            "client pod -> ClusterIP",
            &topo.client_pod.ns,
            SocketAddrV4::new(SOURCE_CLUSTER_IP, SOURCE_PORT),
            mode.pod_cluster_ip_source(),
        ),
        (
            "node -> ClusterIP",
            &topo.node,
            SocketAddrV4::new(SOURCE_CLUSTER_IP, SOURCE_PORT),
            mode.node_cluster_ip_source(),
        ),
    ] {
        checks.check(
            &format!("{what}: every backend sees the source {source}"),
            sources_seen(from, addr).and_then(|seen| {
                ensure!(
                    seen.iter().all(|(_, ip)| *ip == source),
                    "backends saw {seen:?}, expected {source} in {} mode",
                    mode.name()
                );
                Ok(format!("{seen:?}"))
            }),
        );
    }
}

/// TCP requests to the source-reporting Service until every backend has
/// answered: (backend, the source address it saw).
fn sources_seen(from: &Netns, addr: SocketAddrV4) -> Result<Vec<(String, Ipv4Addr)>> {
    let answers = from.run_in(|| {
        (0..REQUESTS)
            .map(|_| netns::tcp_request(addr, Duration::from_secs(2)))
            .collect::<Vec<_>>()
    })?;
    let mut seen = BTreeMap::new();
    for answer in answers {
        let answer = answer.with_context(|| format!("a request to {addr}"))?;
        let (name, ip) = answer
            .split_once(' ')
            .with_context(|| format!("answer {answer:?} is not \"NAME SOURCE\""))?;
        let ip: Ipv4Addr = ip.parse().with_context(|| format!("answer {answer:?}"))?;
        seen.insert(name.to_owned(), ip);
    }
    ensure!(
        seen.len() == BACKENDS.len(),
        "only {seen:?} answered {REQUESTS} requests"
    );
    Ok(seen.into_iter().collect())
}

/// Waits until the client's requests no longer reach pod-3.
fn wait_pod3_gone(bed: &mut AgentBed) -> Result<()> {
    netns::wait_for("pod-3 to leave the seed's backends", READY_WITHIN, || {
        bed.agent_alive()?;
        // The chance that 30 requests miss pod-3 while it is still a
        // backend is (2/3)^30 < 1e-5; the strict check follows anyway.
        for _ in 0..30 {
            let answer = bed
                .topo
                .client
                .tcp_request(seed_node_port(), Duration::from_secs(1))
                .map_err(|e| format!("{e:#}"))?
                .map_err(|e| e.to_string())?;
            if answer == POD3 {
                return Err("pod-3 still answers".into());
            }
        }
        Ok(())
    })
}

/// Local ports for the flows of [`find_pod3_flow`], outside every range of
/// [`Stages`] ([`testbed::probe::STAGE_PORTS`]).
const FLOW_PORTS: std::ops::RangeInclusive<u16> = 61_001..=61_040;

/// From the client pod, UDP flows from fixed local ports to the seed's
/// ClusterIP until one lands on pod-3; returns its port. The chance that
/// 40 flows miss pod-3 is (2/3)^40 < 1e-7.
fn find_pod3_flow(topo: &Topology) -> Result<u16> {
    for port in FLOW_PORTS {
        let answer = topo
            .client_pod
            .ns
            .run_in(|| udp_request_from(port, seed_cluster_ip(), Duration::from_secs(2)))?
            .with_context(|| format!("UDP from port {port} to {}", seed_cluster_ip()))?;
        if answer == POD3 {
            return Ok(port);
        }
    }
    bail!("no UDP flow from ports {FLOW_PORTS:?} landed on pod-3")
}

/// Waits for a partial sync in the agent's log (the sync logs after its
/// last step, which may come after the traffic already changed); Ok with
/// the partial syncs.
fn partial_sync(bed: &AgentBed) -> Result<String> {
    netns::wait_for("a partial sync in the agent's log", Duration::from_secs(10), || {
        let log = bed.log();
        let partial: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("synced") && l.contains("full=false"))
            .collect();
        if partial.is_empty() {
            Err(format!("none in\n{log}"))
        } else {
            Ok(partial.join("\n"))
        }
    })
}

// ---------------------------------------------------------------------------
// The scenario.

fn seed_scenario(mode: Mode) {
    let label = format!("seed_scenario_{}", mode.name());
    on_own_bed(&label, |bed, checks| seed_steps(mode, &label, bed, checks));
}

fn seed_steps(mode: Mode, label: &str, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    // Baseline, seed, endpoint change, SIGTERM, cleanup.
    let mut stages = Stages::new(5);
    let baseline = Baseline::take(label, bed, &mut stages)?;

    stages.next(&bed.topo)?;
    start(bed, mode)?;
    check_seed(&bed.topo, checks, &backend_names());
    check_empty(mode, &bed.topo, checks);
    check_non_service(&bed.topo, checks);
    checks.check(
        "traffic that is no Service's is as without a proxy",
        baseline.same_beside_services(&bed.topo),
    );
    check_differences(mode, &bed.topo, checks);
    checks.check(
        &format!("{} read-back of the seed", mode.name()),
        read_back(mode, bed, Stage::Seed),
    );

    // The endpoint change, through the manifest.
    let pod3_flow = find_pod3_flow(&bed.topo)?;
    stages.next(&bed.topo)?;
    bed.write_manifest(SEED_FILE, &yaml_documents(&seed_objects(&two_backends())))?;
    wait_pod3_gone(bed)?;
    // New connections leave pod-3 as soon as the rules change; the kernel
    // modes delete pod-3's UDP conntrack entries after that, as the sync's
    // last step, and log the sync when done. The flow check below waits
    // for that line, or it may run in between (seen: nftables, 2026-12-05).
    checks.check("the change was a partial sync", partial_sync(bed));
    check_seed(&bed.topo, checks, &two_backend_names());
    // The flow's next packet goes to a remaining backend in every mode,
    // each in its own way (the table at the top).
    checks.check(
        "a UDP flow that was on pod-3 moves to a remaining backend",
        bed.topo
            .client_pod
            .ns
            .run_in(|| udp_request_from(pod3_flow, seed_cluster_ip(), Duration::from_secs(2)))
            .and_then(|answer| {
                let answer = answer.with_context(|| format!("UDP from port {pod3_flow} again"))?;
                ensure!(answer != POD3, "still answered by {answer}");
                Ok(format!("answered by {answer}"))
            }),
    );
    checks.check(
        &format!("{} read-back after pod-3 left", mode.name()),
        read_back(mode, bed, Stage::Changed),
    );

    // SIGTERM: the data path stays, or goes with the agent.
    stages.next(&bed.topo)?;
    stop(bed)?;
    match mode.after_sigterm() {
        AfterSigterm::Stays => {
            check_seed(&bed.topo, checks, &two_backend_names());
            check_empty(mode, &bed.topo, checks);
            checks.check(
                &format!("{} read-back after SIGTERM", mode.name()),
                read_back(mode, bed, Stage::Stopped),
            );
        }
        AfterSigterm::Gone => {
            checks.check(
                "after SIGTERM, every request ends as without a proxy",
                baseline.same(&bed.topo),
            );
            checks.check(
                &format!("after SIGTERM, nothing of the {} mode is left", mode.name()),
                leftovers(mode, bed),
            );
        }
    }

    clean_up(mode, bed, &baseline, &mut stages, checks)
}

/// `xproxy cleanup` in the node, from a stage of its own: every request
/// ends as without a proxy, and the read-back of `mode` finds nothing left.
fn clean_up(mode: Mode, bed: &AgentBed, baseline: &Baseline, stages: &mut Stages, checks: &mut Checks) -> Result<()> {
    stages.next(&bed.topo)?;
    let output = bed.cleanup()?;
    eprintln!("[{}] xproxy cleanup:\n{output}", mode.name());
    checks.check(
        "after xproxy cleanup, every request ends as without a proxy",
        baseline.same(&bed.topo),
    );
    checks.check(
        &format!("after xproxy cleanup, the {} read-back finds nothing", mode.name()),
        read_back(mode, bed, Stage::Clean),
    );
    Ok(())
}

#[test]
fn seed_scenario_ebpf() {
    if !Mode::Ebpf.available("seed_scenario_ebpf") {
        return;
    }
    seed_scenario(Mode::Ebpf);
}

#[test]
fn seed_scenario_iptables() {
    if !Mode::Iptables.available("seed_scenario_iptables") {
        return;
    }
    seed_scenario(Mode::Iptables);
}

#[test]
fn seed_scenario_nftables() {
    if !Mode::Nftables.available("seed_scenario_nftables") {
        return;
    }
    seed_scenario(Mode::Nftables);
}

#[test]
fn seed_scenario_ipvs() {
    if !Mode::Ipvs.available("seed_scenario_ipvs") {
        return;
    }
    seed_scenario(Mode::Ipvs);
}

#[test]
fn seed_scenario_userspace() {
    if !Mode::Userspace.available("seed_scenario_userspace") {
        return;
    }
    seed_scenario(Mode::Userspace);
}

// ---------------------------------------------------------------------------
// Hairpin: a backend reaching its own Service. When the Service picks the
// pod itself, source and destination are the same address: only a SNAT to
// a node address makes the pod accept the packet and reply through the node.

fn hairpin(mode: Mode) {
    let label = format!("hairpin_{}", mode.name());
    on_own_bed(&label, |bed, checks| {
        start(bed, mode)?;
        for protocol in PROTOCOLS {
            checks.check(
                &format!(
                    "{} pod-1 -> {} reaches every backend, itself too",
                    proto_name(protocol),
                    seed_cluster_ip()
                ),
                expect_all_backends(&bed.topo.backends[0].ns, protocol, seed_cluster_ip()),
            );
        }
        Ok(())
    });
}

#[test]
fn hairpin_ebpf() {
    if !Mode::Ebpf.available("hairpin_ebpf") {
        return;
    }
    hairpin(Mode::Ebpf);
}

#[test]
fn hairpin_iptables() {
    if !Mode::Iptables.available("hairpin_iptables") {
        return;
    }
    hairpin(Mode::Iptables);
}

#[test]
fn hairpin_nftables() {
    if !Mode::Nftables.available("hairpin_nftables") {
        return;
    }
    hairpin(Mode::Nftables);
}

#[test]
fn hairpin_ipvs() {
    if !Mode::Ipvs.available("hairpin_ipvs") {
        return;
    }
    hairpin(Mode::Ipvs);
}

#[test]
fn hairpin_userspace() {
    if !Mode::Userspace.available("hairpin_userspace") {
        return;
    }
    hairpin(Mode::Userspace);
}

// ---------------------------------------------------------------------------
// Switching modes: one test bed, every available mode in turn, `xproxy
// cleanup` between.

#[test]
fn switching_modes_with_cleanup_between() {
    const LABEL: &str = "switching_modes_with_cleanup_between";
    if !require_root(LABEL) {
        return;
    }
    let modes: Vec<Mode> = Mode::ALL.into_iter().filter(|m| m.available(LABEL)).collect();
    on_own_bed(LABEL, |bed, checks| {
        // The baseline, then each mode running and cleaned up.
        let mut stages = Stages::new(1 + 2 * modes.len());
        let baseline = Baseline::take(LABEL, bed, &mut stages)?;
        let mut previous = None;
        for &mode in &modes {
            switch_to(mode, previous, bed, &baseline, &mut stages, checks)?;
            previous = Some(mode);
        }
        Ok(())
    });
}

/// Runs the agent in `mode` on a bed `previous` ran on and was cleaned up
/// from: it answers as on a bed of its own, with its own source addresses
/// (a leftover of `previous` would translate too: a second DNAT, a
/// masquerade); then SIGTERM and `xproxy cleanup` leave nothing of `mode`
/// and every request ends as without a proxy.
fn switch_to(
    mode: Mode,
    previous: Option<Mode>,
    bed: &mut AgentBed,
    baseline: &Baseline,
    stages: &mut Stages,
    checks: &mut Checks,
) -> Result<()> {
    let run = match previous {
        Some(previous) => format!("{} after {}", mode.name(), previous.name()),
        None => mode.name().to_owned(),
    };
    stages.next(&bed.topo)?;
    start(bed, mode).with_context(|| format!("starting {run}"))?;
    let mut ran = Checks::new(format!("switching: {run}"));
    check_seed(&bed.topo, &mut ran, &backend_names());
    check_empty(mode, &bed.topo, &mut ran);
    check_differences(mode, &bed.topo, &mut ran);
    ran.check(&format!("{} read-back", mode.name()), read_back(mode, bed, Stage::Seed));
    stop(bed).with_context(|| format!("stopping {run}"))?;

    clean_up(mode, bed, baseline, stages, &mut ran)?;
    checks.check(
        &run,
        if ran.passed() {
            Ok("every check passed".into())
        } else {
            Err(anyhow::anyhow!("\n  {}", ran.failures()))
        },
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// What only the userspace mode has: the agent is the data path.

/// The userspace mode's endpoint change while UDP flows and TCP connections
/// are open: the flows on pod-3 move and the others stay, the connections
/// (some to pod-3) keep exchanging, and the sync writes nothing to the
/// kernel. Then SIGKILL: the agent cannot take its rules along, so they
/// send Service traffic to ports nobody listens on (refused) until `xproxy
/// cleanup`.
#[test]
fn userspace_long_lived_flows_and_sigkill() {
    const LABEL: &str = "userspace_long_lived_flows_and_sigkill";
    if !Mode::Userspace.available(LABEL) {
        return;
    }
    on_own_bed(LABEL, |bed, checks| {
        // Baseline, the agent, the endpoint change, SIGKILL, cleanup.
        let mut stages = Stages::new(5);
        let baseline = Baseline::take(LABEL, bed, &mut stages)?;
        for pod in &bed.topo.backends {
            pod.ns.serve_tcp_echo(ECHO_TARGET_PORT)?;
        }
        stages.next(&bed.topo)?;
        bed.write_manifest(ECHO_FILE, &yaml_documents(&echo_objects(&backend_ips())))?;
        start(bed, Mode::Userspace)?;
        let listeners = userspace_listeners(&bed.topo.node)?;

        stages.next(&bed.topo)?;
        endpoint_change(bed, checks, &listeners)?;

        stages.next(&bed.topo)?;
        bed.stop_agent(libc::SIGKILL)?;
        checks.check(
            "after SIGKILL the rules are still there, and nobody listens",
            after_sigkill(&bed.topo.node, &listeners),
        );
        for protocol in PROTOCOLS {
            checks.check(
                &format!(
                    "after SIGKILL {} client -> {} is refused",
                    proto_name(protocol),
                    seed_node_port()
                ),
                expect_rejected(
                    &bed.topo.client,
                    protocol,
                    seed_node_port(),
                    io::ErrorKind::ConnectionRefused,
                ),
            );
        }

        clean_up(Mode::Userspace, bed, &baseline, &mut stages, checks)
    });
}

/// pod-3 leaves the seed and the echo Service while UDP flows and TCP
/// connections are open.
fn endpoint_change(bed: &mut AgentBed, checks: &mut Checks, listeners: &Listeners) -> Result<()> {
    let echo = SocketAddrV4::new(ECHO_CLUSTER_IP, ECHO_PORT);
    let connections = EchoClients::start(&bed.topo.client_pod.ns, echo, 6, 0, Duration::from_millis(100))?;
    let opened = Instant::now();
    let flows = UdpFlows::start(&bed.topo.client_pod.ns, seed_cluster_ip(), 6);
    flows.wait_answers(opened, 5)?;
    let echo_on_pod3 = established_to(&bed.topo.backends[2].ns, ECHO_TARGET_PORT)?;
    let writes_before = bed.metrics()?.value(KERNEL_WRITES);

    let changed = Instant::now();
    bed.write_manifest(SEED_FILE, &yaml_documents(&seed_objects(&two_backends())))?;
    bed.write_manifest(ECHO_FILE, &yaml_documents(&echo_objects(&two_backends())))?;
    wait_pod3_gone(bed)?;
    let gone = Instant::now();
    flows.wait_answers(gone, 10)?;
    let flows = flows.stop();
    checks.check(
        "UDP flows on pod-3 moved, the others stayed",
        check_flows(&flows, changed, gone),
    );
    checks.check(
        "TCP connections to pod-3 outlive its leaving",
        established_to(&bed.topo.backends[2].ns, ECHO_TARGET_PORT).and_then(|still| {
            ensure!(echo_on_pod3 > 0, "no echo connection was on pod-3");
            ensure!(
                still == echo_on_pod3,
                "pod-3 had {echo_on_pod3} echo connections, now {still}"
            );
            Ok(format!("{still} connections to pod-3 still established"))
        }),
    );
    let outcomes = connections.stop();
    checks.check("every long-lived TCP connection kept exchanging", {
        let failed: Vec<_> = outcomes.iter().filter(|o| o.error.is_some()).collect();
        ensure!(failed.is_empty(), "{failed:?}");
        Ok(format!(
            "{} connections, {} exchanges",
            outcomes.len(),
            outcomes.iter().map(|o| o.exchanges).sum::<u64>()
        ))
    });
    checks.check(
        "the endpoint change wrote nothing to the kernel",
        bed.metrics().and_then(|m| {
            let after = m.value(KERNEL_WRITES);
            ensure!(
                after.is_some() && after == writes_before,
                "{KERNEL_WRITES} {writes_before:?} -> {after:?}"
            );
            Ok(format!("{KERNEL_WRITES} stays {after:?}"))
        }),
    );
    checks.check(
        "rules and listeners unchanged",
        userspace_listeners(&bed.topo.node).and_then(|now| {
            ensure!(now == *listeners, "listeners {listeners:?} -> {now:?}");
            Ok(format!("{now:?}"))
        }),
    );
    Ok(())
}

/// Established TCP connections to local port `port` in `ns`.
fn established_to(ns: &Netns, port: u16) -> Result<usize> {
    let listing = ns.exec(&["ss", "-H", "-tn", "state", "established"])?;
    let local = format!(":{port} ");
    Ok(listing.lines().filter(|l| l.contains(&local)).count())
}

/// A killed agent's rules: as it left them, pointing at its listener
/// ports, where nothing listens any more.
fn after_sigkill(node: &Netns, listeners: &Listeners) -> Result<String> {
    let rules = userspace_rules(node)?;
    ensure!(
        rules == *listeners,
        "the rules point at {rules:?}, before at {listeners:?}"
    );
    for (protocol, port) in &rules {
        ensure!(
            listening(node, *protocol, *port).is_none(),
            "still listening on {protocol:?} {port}"
        );
    }
    Ok(format!("the rules point at {rules:?}, closed"))
}

/// How often a flow sends: well inside the userspace mode's 250 ms UDP
/// idle timeout, so its session lives on unless the agent closes it.
const FLOW_INTERVAL: Duration = Duration::from_millis(20);

/// Answers of one flow, with when they came.
type Answers = Vec<(Instant, Result<String, String>)>;

/// UDP flows from one namespace to one address, each from one socket (one
/// session in the agent), sending until stopped.
struct UdpFlows {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Answers>>,
    answers: Vec<Arc<Mutex<Answers>>>,
}

impl UdpFlows {
    fn start(ns: &Netns, addr: SocketAddrV4, count: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut answers = Vec::new();
        for _ in 0..count {
            let path: PathBuf = ns.path().to_owned();
            let stop = stop.clone();
            let log = Arc::new(Mutex::new(Answers::new()));
            answers.push(log.clone());
            threads.push(std::thread::spawn(move || udp_flow(&path, addr, &stop, &log)));
        }
        Self { stop, threads, answers }
    }

    /// Waits until every flow has `n` answers after `since`.
    fn wait_answers(&self, since: Instant, n: usize) -> Result<()> {
        netns::wait_for("answers on every UDP flow", Duration::from_secs(10), || {
            for (i, log) in self.answers.iter().enumerate() {
                let got = log
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .iter()
                    .filter(|(at, r)| *at >= since && r.is_ok())
                    .count();
                if got < n {
                    return Err(format!("flow {i} has {got} answers"));
                }
            }
            Ok(())
        })
    }

    fn stop(self) -> Vec<Answers> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| vec![(Instant::now(), Err("panicked".into()))])
            })
            .collect()
    }
}

fn udp_flow(ns: &Path, addr: SocketAddrV4, stop: &AtomicBool, log: &Mutex<Answers>) -> Answers {
    let record = |result: Result<String, String>| {
        log.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((Instant::now(), result));
    };
    let socket = netns::enter(ns)
        .map_err(|e| format!("{e:#}"))
        .and_then(|()| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string()))
        .and_then(|s| {
            s.connect(addr)
                .and_then(|()| s.set_read_timeout(Some(Duration::from_secs(1))))
                .map(|()| s)
                .map_err(|e| e.to_string())
        });
    match socket {
        Ok(socket) => {
            let mut buf = [0u8; 512];
            while !stop.load(Ordering::Relaxed) {
                let answer = socket
                    .send(b"hello\n")
                    .and_then(|_| socket.recv(&mut buf))
                    .map(|n| String::from_utf8_lossy(&buf[..n]).trim().to_owned())
                    .map_err(|e| e.to_string());
                record(answer);
                std::thread::sleep(FLOW_INTERVAL);
            }
        }
        Err(e) => record(Err(e)),
    }
    std::mem::take(&mut *log.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// The backends a flow's answers name in `[from, to)`.
fn answered_by(answers: &Answers, from: Instant, to: Instant) -> Vec<String> {
    let mut names: Vec<String> = answers
        .iter()
        .filter(|(at, _)| *at >= from && *at < to)
        .filter_map(|(_, r)| r.as_ref().ok().cloned())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Flows on pod-3 went to pod-1/pod-2 after `gone`; the others kept their
/// backend throughout; before `changed` every flow had one backend.
fn check_flows(flows: &[Answers], changed: Instant, gone: Instant) -> Result<String> {
    let end = Instant::now() + Duration::from_secs(3600);
    let start = flows
        .iter()
        .filter_map(|f| f.first().map(|(at, _)| *at))
        .min()
        .context("no flow answered")?;
    let mut moved = 0;
    let mut report = Vec::new();
    for (i, flow) in flows.iter().enumerate() {
        let before = answered_by(flow, start, changed);
        let after = answered_by(flow, gone, end);
        ensure!(
            before.len() == 1,
            "flow {i} had more than one backend before the change: {before:?}"
        );
        if before[0] == POD3 {
            ensure!(
                after.len() == 1 && after[0] != POD3,
                "flow {i} on pod-3 did not move to one remaining backend: {after:?}"
            );
            moved += 1;
        } else {
            ensure!(after == before, "flow {i} on {before:?} changed to {after:?}");
        }
        let errors = flow.iter().filter(|(_, r)| r.is_err()).count();
        report.push(format!("{} -> {} ({errors} lost)", before[0], after.join(",")));
    }
    ensure!(moved > 0, "no flow was on pod-3: {report:?}");
    Ok(report.join(", "))
}

// ---------------------------------------------------------------------------
// Each mode's own read-back of what it programmed.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// The seed with three backends, the empty Service.
    Seed,
    /// pod-3 left the seed.
    Changed,
    /// The agent stopped: still programmed as in `Changed`.
    Stopped,
    /// After `xproxy cleanup`: nothing left.
    Clean,
}

impl Stage {
    fn seed_backends(self) -> Vec<Ipv4Addr> {
        match self {
            Stage::Seed => backend_ips(),
            Stage::Changed | Stage::Stopped => two_backends(),
            Stage::Clean => Vec::new(),
        }
    }
}

/// What `mode` programmed at `stage`; at [`Stage::Clean`], that nothing is
/// left and a second cleanup finds nothing to remove.
fn read_back(mode: Mode, bed: &AgentBed, stage: Stage) -> Result<String> {
    if stage == Stage::Clean {
        let left = leftovers(mode, bed)?;
        return Ok(format!("{left}; {}", cleanup_again(mode, bed)?));
    }
    let own = match mode {
        Mode::Ebpf => return ebpf_read_back(bed, stage),
        Mode::Iptables => iptables_read_back(bed, stage),
        Mode::Nftables => nftables_read_back(bed, stage),
        Mode::Ipvs => ipvs_read_back(bed, stage),
        // Endpoint changes never touch its rules: the same at every stage.
        Mode::Userspace => userspace_listeners(&bed.topo.node)
            .map(|listeners| format!("the rules redirect to the agent's listeners {listeners:?}")),
    }?;
    Ok(format!("{own}; {}", status_read_back(mode, bed, stage)?))
}

/// Step 5 beside the mode's own tool: `xproxy status`, finding the mode
/// by itself, lists the seed and empty Services' frontends with their
/// backends (the userspace mode: the agent's listener).
fn status_read_back(mode: Mode, bed: &AgentBed, stage: Stage) -> Result<String> {
    let status = bed.status()?;
    ensure!(
        status.starts_with(&format!("Mode: {}\n", mode.name())),
        "xproxy status found another mode:\n{status}"
    );
    let seen = frontends(&status);
    let n = match mode {
        Mode::Userspace => 1,
        _ => stage.seed_backends().len(),
    };
    // The rule-based modes match NodePorts on every local address; IPVS
    // has a virtual server per node IP.
    let node_ip = match mode {
        Mode::Ebpf | Mode::Ipvs => NODE_IP,
        _ => Ipv4Addr::UNSPECIFIED,
    };
    let mut expected = BTreeMap::new();
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        expected.insert(format!("{p} {}", seed_cluster_ip()), ("ClusterIP", n));
        expected.insert(format!("{p} {node_ip}:{}", seed_node_port().port()), ("NodePort", n));
        expected.insert(format!("{p} {}", empty_cluster_ip()), ("ClusterIP", 0));
        expected.insert(format!("{p} {node_ip}:{}", empty_node_port().port()), ("NodePort", 0));
    }
    for (frontend, (kind, backends)) in &expected {
        let got = seen.get(frontend).map(|(k, b)| (k.as_str(), *b));
        ensure!(
            got == Some((*kind, *backends)),
            "xproxy status: {frontend}: expected {kind} with {backends} backends, got {got:?}:\n{status}"
        );
    }
    Ok(format!("xproxy status lists {} frontends as expected", expected.len()))
}

/// Ok if nothing `mode` installs is left in the node (reads only).
fn leftovers(mode: Mode, bed: &AgentBed) -> Result<String> {
    match mode {
        Mode::Ebpf => ebpf_leftovers(bed),
        Mode::Iptables => {
            let saved = bed.topo.node.exec(&["iptables-save"])?;
            ensure!(!saved.contains("KUBE-"), "left behind:\n{saved}");
            Ok("no KUBE- chain or rule".into())
        }
        Mode::Nftables => {
            let tables = bed.topo.node.exec(&["nft", "list", "tables"])?;
            ensure!(!tables.contains("xproxy"), "left behind:\n{tables}");
            Ok("no table ip xproxy".into())
        }
        Mode::Ipvs => ipvs_leftovers(bed),
        Mode::Userspace => userspace_leftovers(&bed.topo.node),
    }
}

/// Runs `xproxy cleanup` once more: it must remove nothing, and say so
/// for `mode` where it does.
fn cleanup_again(mode: Mode, bed: &AgentBed) -> Result<String> {
    let again = bed.cleanup()?;
    let did = ["removed", "deleted", "detached"];
    let removing: Vec<&str> = again.lines().filter(|l| did.iter().any(|d| l.contains(d))).collect();
    ensure!(removing.is_empty(), "a second cleanup still removed {removing:#?}");
    let nothing = match mode {
        Mode::Ebpf => Some("nothing pinned"),
        Mode::Iptables => Some("no iptables chains"),
        Mode::Nftables => Some("no nftables table of xproxy found"),
        // It logs only what it removed.
        Mode::Ipvs => None,
        Mode::Userspace => Some("no userspace mode chains found"),
    };
    if let Some(nothing) = nothing {
        ensure!(
            again.contains(nothing),
            "a second cleanup does not say {nothing:?}:\n{again}"
        );
    }
    Ok("a second cleanup finds nothing".into())
}

// --- ebpf: `xproxy status`.

fn ebpf_read_back(bed: &AgentBed, stage: Stage) -> Result<String> {
    let status = bed.status()?;
    let seen = frontends(&status);
    let n = stage.seed_backends().len();
    let mut expected = BTreeMap::new();
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        expected.insert(format!("{p} {}", seed_cluster_ip()), ("ClusterIP", n));
        expected.insert(format!("{p} {}", seed_node_port()), ("NodePort", n));
        expected.insert(format!("{p} {}", empty_cluster_ip()), ("ClusterIP", 0));
        expected.insert(format!("{p} {}", empty_node_port()), ("NodePort", 0));
    }
    for (frontend, (kind, backends)) in &expected {
        let got = seen.get(frontend).map(|(k, b)| (k.as_str(), *b));
        ensure!(
            got == Some((*kind, *backends)),
            "{frontend}: expected {kind} with {backends} backends, got {got:?}:\n{status}"
        );
    }
    let rejected = status
        .lines()
        .find_map(|l| l.trim().strip_prefix("reject_no_backend"))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .with_context(|| format!("no reject_no_backend counter in\n{status}"))?;
    // 6 refused requests per check_empty (the UDP ones perhaps retried).
    ensure!(rejected >= 6, "reject_no_backend = {rejected}:\n{status}");
    if stage == Stage::Seed {
        let metrics = bed.metrics()?;
        let counted = metrics.labeled(DATAPATH_PACKETS, "verdict=\"reject_no_backend\"");
        ensure!(
            counted.is_some_and(|c| c >= 6.0),
            "{DATAPATH_PACKETS}{{verdict=\"reject_no_backend\"}} = {counted:?}"
        );
    }
    // What the cleanup read-back must find gone.
    let attached = attached_programs(&bed.topo)?;
    let mut ifaces = bed.topo.pod_ifs();
    ifaces.push(bed.topo.uplink.clone());
    for iface in &ifaces {
        ensure!(
            attached.iter().any(|(on, _)| on == iface),
            "no program on {iface}: {attached:#?}"
        );
    }
    Ok(format!(
        "{} frontends as expected, reject_no_backend = {rejected}, {} programs attached",
        expected.len(),
        attached.len()
    ))
}

/// No pins, no program on the node's interfaces, no SNAT fallback rules.
fn ebpf_leftovers(bed: &AgentBed) -> Result<String> {
    ensure!(
        !bed.pin_path().exists(),
        "{} is still there after cleanup",
        bed.pin_path().display()
    );
    let link = bed.topo.node.ip(&["-d", "link", "show", "dev", &bed.topo.uplink])?;
    ensure!(!link.contains("prog/xdp"), "XDP still on the uplink:\n{link}");
    let attached = attached_programs(&bed.topo)?;
    ensure!(attached.is_empty(), "programs still attached: {attached:#?}");
    let nat = bed.topo.node.exec(&["iptables-save", "-t", "nat"])?;
    ensure!(!nat.contains(snat::CHAIN), "the SNAT fallback is left:\n{nat}");
    Ok("no pins, no program attached, no SNAT fallback rules".into())
}

/// Every program attached to the node's interfaces, as (interface, what):
/// XDP and tc filters as `bpftool net show` lists them ("NAME(INDEX) ..."),
/// tcx links (which it does not list) by a query per interface and
/// direction.
fn attached_programs(topo: &Topology) -> Result<Vec<(String, String)>> {
    let shown = topo.node.exec(&["bpftool", "net", "show"])?;
    // Section headers ("xdp:", "tc:", ...) end with a colon.
    let mut found: Vec<(String, String)> = shown
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.ends_with(':'))
        .map(|l| (l.split('(').next().unwrap_or(l).to_owned(), l.to_owned()))
        .collect();
    let mut ifaces = topo.pod_ifs();
    ifaces.push(topo.uplink.clone());
    for iface in ifaces {
        for attach in [TcAttachType::Ingress, TcAttachType::Egress] {
            // Kernels without tcx: the filters bpftool lists are all there is.
            if let Ok((_, programs)) = topo.node.run_in(|| SchedClassifier::query_tcx(&iface, attach))? {
                found.extend(programs.iter().map(|p| {
                    let name = p.name_as_str().unwrap_or("?");
                    (iface.clone(), format!("tcx {attach:?}: {name}"))
                }));
            }
        }
    }
    Ok(found)
}

// --- iptables: `iptables-save`.

/// The probabilities kube-proxy writes for n endpoints, as iptables-save
/// prints them; the last jump has none.
fn probabilities(n: usize) -> &'static [&'static str] {
    match n {
        2 => &["0.50000000000"],
        3 => &["0.33333333349", "0.50000000000"],
        _ => &[],
    }
}

fn iptables_read_back(bed: &AgentBed, stage: Stage) -> Result<String> {
    let saved = bed.topo.node.exec(&["iptables-save"])?;
    let lines: Vec<&str> = saved.lines().collect();
    let find = |needle: &str| -> Result<&str> {
        lines
            .iter()
            .copied()
            .find(|l| l.contains(needle))
            .with_context(|| format!("no rule with {needle:?} in\n{saved}"))
    };
    let backends = stage.seed_backends();
    for protocol in PROTOCOLS {
        let port = seed_port(protocol, &backends);
        let chains = PortChains::of(&port);
        let p = proto_name(protocol).to_lowercase();
        // KUBE-SERVICES -> KUBE-SVC; KUBE-NODEPORTS -> KUBE-EXT -> KUBE-SVC.
        let entry = find(&format!("-A KUBE-SERVICES -d {SEED_CLUSTER_IP}/32 -p {p} "))?;
        ensure!(entry.ends_with(&format!("-j {}", chains.svc)), "{entry}");
        find(&format!("-m {p} --dport {SEED_NODE_PORT} -j {}", chains.ext))?;
        find(&format!("-A {} -j {}", chains.ext, chains.svc))?;
        // KUBE-SVC -> one KUBE-SEP per endpoint, with kube-proxy's spread.
        let dispatch: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with(&format!("-A {} ", chains.svc)) && l.contains("-j KUBE-SEP-"))
            .collect();
        ensure!(
            dispatch.len() == backends.len(),
            "expected {} KUBE-SEP jumps in {}: {dispatch:#?}",
            backends.len(),
            chains.svc
        );
        for (i, rule) in dispatch.iter().enumerate() {
            match probabilities(backends.len()).get(i) {
                Some(p) => ensure!(rule.contains(&format!("--probability {p} ")), "{rule}"),
                None => ensure!(!rule.contains("--probability"), "{rule}"),
            }
        }
        for ep in &port.endpoints {
            let sep = proxy_userspace::mode::iptables::chains::sep_chain(
                &port.name,
                protocol.into(),
                &format!("{}:{}", ep.addr, ep.port),
            );
            find(&format!("-A {sep} -p {p} ")).and_then(|rule| {
                ensure!(
                    rule.ends_with(&format!("-j DNAT --to-destination {}:{}", ep.addr, ep.port)),
                    "{rule}"
                );
                Ok(rule)
            })?;
        }
        find(&format!(
            "\"default/empty-service:{} has no endpoints\"",
            port_name(protocol)
        ))?;
    }
    let gone = format!("--to-destination {}:{TARGET_PORT}", BACKENDS[2].1);
    if stage != Stage::Seed {
        ensure!(!saved.contains(&gone), "pod-3 is still a seed destination:\n{saved}");
    }
    find("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES")?;
    find("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES")?;
    find("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE")?;
    let counted = if stage == Stage::Seed {
        rule_count_metrics(bed)?
    } else {
        String::new()
    };
    Ok(format!(
        "KUBE-SERVICES -> KUBE-SVC -> {} KUBE-SEP per protocol, probabilities {:?}{counted}",
        backends.len(),
        probabilities(backends.len())
    ))
}

/// After the first (full) sync, kube-proxy's rule count per table equals
/// the KUBE-* rules `iptables-save` and `ip6tables-save` show there (the
/// mode's IPv4 and IPv6 rules added up): those in KUBE-* chains and the
/// jumps into them (every KUBE-* chain in the bed is the agent's).
fn rule_count_metrics(bed: &AgentBed) -> Result<String> {
    let metrics = bed.metrics()?;
    let mut counts = Vec::new();
    for table in ["filter", "nat"] {
        let saved = bed.topo.node.exec(&["iptables-save", "-t", table])?
            + &bed.topo.node.exec(&["ip6tables-save", "-t", table])?;
        let rules = saved
            .lines()
            .filter(|l| l.starts_with("-A KUBE-") || (l.starts_with("-A ") && l.contains(" -j KUBE-")))
            .count();
        let shown = metrics.labeled(
            "kubeproxy_sync_proxy_rules_iptables_total",
            &format!("table=\"{table}\""),
        );
        ensure!(
            shown == Some(rules as f64),
            "kubeproxy_sync_proxy_rules_iptables_total{{table={table:?}}} is {shown:?}, iptables-save shows {rules} rules:\n{saved}"
        );
        counts.push(format!("{table} {rules}"));
    }
    Ok(format!("; rule counts in the metrics: {}", counts.join(", ")))
}

// --- nftables: `nft list table ip xproxy`.

/// The body of `chain NAME { ... }` in an `nft list` listing.
fn chain_body<'a>(listing: &'a str, name: &str) -> Option<&'a str> {
    let start = listing.find(&format!("chain {name} {{"))?;
    let body = &listing[start..];
    Some(&body[..body.find("\n\t}")?])
}

fn nftables_read_back(bed: &AgentBed, stage: Stage) -> Result<String> {
    let listing = bed.topo.node.exec(&["nft", "list", "table", "ip", "xproxy"])?;
    let backends = stage.seed_backends();
    let mut needles = vec!["map service-ips {".to_owned(), "map service-nodeports {".to_owned()];
    for protocol in PROTOCOLS {
        let port = seed_port(protocol, &backends);
        let p = proto_name(protocol).to_lowercase();
        let svc = names::service_chain(&port);
        needles.push(format!("{SEED_CLUSTER_IP} . {p} . {SEED_PORT} : goto {svc}"));
        needles.push(format!(
            "{p} . {SEED_NODE_PORT} : goto {}",
            names::external_chain(&port)
        ));
        needles.push(format!(
            "{EMPTY_CLUSTER_IP} . {p} . {EMPTY_PORT} comment \"default/empty-service:{}\" : goto reject-chain",
            port_name(protocol)
        ));
        let body = chain_body(&listing, &svc).with_context(|| format!("no chain {svc} in\n{listing}"))?;
        let dispatch = format!("numgen random mod {} vmap {{", backends.len());
        ensure!(body.contains(&dispatch), "{svc} lacks {dispatch:?}:\n{body}");
        for ep in &port.endpoints {
            let chain = names::endpoint_chain(&port, ep);
            let body = chain_body(&listing, &chain).with_context(|| format!("no chain {chain} in\n{listing}"))?;
            let dnat = format!("dnat to {}:{}", ep.addr, ep.port);
            ensure!(body.contains(&dnat), "{chain} lacks {dnat:?}:\n{body}");
        }
        if stage != Stage::Seed {
            let gone = names::endpoint_chain(&port, &Endpoint::ready(BACKENDS[2].1, TARGET_PORT));
            ensure!(!listing.contains(&gone), "{gone} is still there:\n{listing}");
        }
    }
    needles.push("masquerade fully-random".into());
    for needle in &needles {
        ensure!(listing.contains(needle.as_str()), "no {needle:?} in\n{listing}");
    }
    Ok(format!(
        "verdict maps and chains for {} endpoints per protocol ({} lines)",
        backends.len(),
        listing.lines().count()
    ))
}

// --- ipvs: `ipvsadm -Ln`.

fn ipvs_read_back(bed: &AgentBed, stage: Stage) -> Result<String> {
    let servers = ipvs_virtual_servers(&bed.topo.node.exec(&["ipvsadm", "-Ln"])?);
    let reals: Vec<String> = stage
        .seed_backends()
        .iter()
        .map(|ip| format!("{ip}:{TARGET_PORT} 1"))
        .collect();
    let mut expected = BTreeMap::new();
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        expected.insert(format!("{p} {} rr", seed_cluster_ip()), reals.clone());
        expected.insert(format!("{p} {} rr", seed_node_port()), reals.clone());
        expected.insert(format!("{p} {} rr", empty_cluster_ip()), Vec::new());
        expected.insert(format!("{p} {} rr", empty_node_port()), Vec::new());
    }
    for (server, want) in &expected {
        let got = servers.get(server);
        ensure!(
            got == Some(want),
            "{server}: expected real servers {want:?}, got {got:?} in {servers:#?}"
        );
    }
    Ok(format!("{} virtual servers as expected", expected.len()))
}

/// No virtual server, no kube-ipvs0, none of the constant rules or ipsets.
fn ipvs_leftovers(bed: &AgentBed) -> Result<String> {
    let node = &bed.topo.node;
    let servers = ipvs_virtual_servers(&node.exec(&["ipvsadm", "-Ln"])?);
    ensure!(servers.is_empty(), "virtual servers left behind: {servers:#?}");
    let links = node.ip(&["-o", "link", "show"])?;
    ensure!(!links.contains("kube-ipvs0"), "kube-ipvs0 left behind:\n{links}");
    let saved = node.exec(&["iptables-save"])?;
    ensure!(!saved.contains("KUBE-"), "rules left behind:\n{saved}");
    let sets = node.exec(&["ipset", "list", "-n"])?;
    ensure!(sets.trim().is_empty(), "ipsets left behind:\n{sets}");
    Ok("no virtual server, no kube-ipvs0, no KUBE- rule, no ipset".into())
}

// --- userspace: `iptables-save` and the agent's sockets.

/// The listener port of each seed protocol, as the rules name it.
type Listeners = BTreeMap<Protocol, u16>;

/// The userspace mode's chains (and the jumps into them).
const USERSPACE_CHAINS: [&str; 5] = [
    "KUBE-PORTALS-CONTAINER",
    "KUBE-PORTALS-HOST",
    "KUBE-NODEPORT-CONTAINER",
    "KUBE-NODEPORT-HOST",
    "KUBE-PORTALS-REJECT",
];

fn comment(text: &str) -> String {
    format!("-m comment --comment \"{text}\"")
}

/// [`userspace_rules`], and the agent listens on the ports they name.
fn userspace_listeners(node: &Netns) -> Result<Listeners> {
    let listeners = userspace_rules(node)?;
    for (protocol, port) in &listeners {
        ensure!(
            listening(node, *protocol, *port).is_some_and(|owner| owner.contains("\"xproxy\"")),
            "the agent does not listen on {protocol:?} {port}"
        );
    }
    Ok(listeners)
}

/// `ss`'s line of the socket listening on `port` in `node`, if any.
fn listening(node: &Netns, protocol: Protocol, port: u16) -> Option<String> {
    let flag = if protocol == Protocol::Tcp { "-t" } else { "-u" };
    let sockets = node.exec(&["ss", "-H", "-ln", "-p", flag]).ok()?;
    let local = format!("0.0.0.0:{port} ");
    sockets.lines().find(|l| l.contains(&local)).map(str::to_owned)
}

/// Checks the rules of the seed, the Service without endpoints and the
/// jumps in `iptables-save`; returns the ports the seed's rules redirect to.
fn userspace_rules(node: &Netns) -> Result<Listeners> {
    let saved = node.exec(&["iptables-save"])?;
    let has = |line: &str| -> Result<()> {
        ensure!(saved.lines().any(|l| l == line), "no line\n  {line}\nin\n{saved}");
        Ok(())
    };
    let mut listeners = Listeners::new();
    for protocol in PROTOCOLS {
        let p = proto_name(protocol).to_lowercase();
        let seed = comment(&format!("default/nginx-service:{}", port_name(protocol)));
        let prefix = format!(
            "-A KUBE-PORTALS-CONTAINER -d {SEED_CLUSTER_IP}/32 -p {p} {seed} -m {p} --dport {SEED_PORT} -j REDIRECT --to-ports "
        );
        let listener: u16 = saved
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .with_context(|| format!("no {prefix}... in\n{saved}"))?
            .parse()
            .context("the REDIRECT port")?;
        let dnat = format!("-j DNAT --to-destination 127.0.0.1:{listener}");
        has(&format!(
            "-A KUBE-PORTALS-HOST -d {SEED_CLUSTER_IP}/32 -p {p} {seed} -m {p} --dport {SEED_PORT} {dnat}"
        ))?;
        has(&format!(
            "-A KUBE-NODEPORT-CONTAINER -p {p} {seed} -m {p} --dport {SEED_NODE_PORT} -j REDIRECT --to-ports {listener}"
        ))?;
        has(&format!(
            "-A KUBE-NODEPORT-HOST -p {p} {seed} -m {p} --dport {SEED_NODE_PORT} {dnat}"
        ))?;
        let empty = comment(&format!(
            "default/empty-service:{} has no endpoints",
            port_name(protocol)
        ));
        let reject = "-j REJECT --reject-with icmp-port-unreachable";
        has(&format!(
            "-A KUBE-PORTALS-REJECT -d {EMPTY_CLUSTER_IP}/32 -p {p} {empty} -m {p} --dport {EMPTY_PORT} {reject}"
        ))?;
        has(&format!(
            "-A KUBE-PORTALS-REJECT -p {p} -m addrtype --dst-type LOCAL {empty} -m {p} --dport {EMPTY_NODE_PORT} {reject}"
        ))?;
        listeners.insert(protocol, listener);
    }
    let portals = comment("handle ClusterIPs; NOTE: this must be before the NodePort rules");
    let node_ports = comment("handle service NodePorts; NOTE: this must be the last rule in the chain");
    let without = comment("kubernetes services without endpoints");
    has(&format!("-A PREROUTING {portals} -j KUBE-PORTALS-CONTAINER"))?;
    has(&format!("-A OUTPUT {portals} -j KUBE-PORTALS-HOST"))?;
    has(&format!(
        "-A PREROUTING -m addrtype --dst-type LOCAL {node_ports} -j KUBE-NODEPORT-CONTAINER"
    ))?;
    has(&format!(
        "-A OUTPUT -m addrtype --dst-type LOCAL {node_ports} -j KUBE-NODEPORT-HOST"
    ))?;
    for chain in ["INPUT", "FORWARD", "OUTPUT"] {
        has(&format!(
            "-A {chain} -m conntrack --ctstate NEW {without} -j KUBE-PORTALS-REJECT"
        ))?;
    }
    ensure!(
        !saved.contains("KUBE-SERVICES"),
        "the iptables mode's chains are not this mode's:\n{saved}"
    );
    Ok(listeners)
}

/// Nothing of the userspace mode is left in `iptables-save`.
fn userspace_leftovers(node: &Netns) -> Result<String> {
    let saved = node.exec(&["iptables-save"])?;
    for chain in USERSPACE_CHAINS {
        ensure!(!saved.contains(chain), "{chain} left behind:\n{saved}");
    }
    Ok("no KUBE-PORTALS / KUBE-NODEPORT chain or jump".into())
}
