//! One end-to-end suite for every mode: the seed scenario through the real
//! agent (`xproxy run --mode MODE --manifests DIR`) in the node namespace of
//! the test bed (`testbed::topology`), the same steps and the same
//! expectations in ebpf, iptables, nftables and IPVS mode (IPVS where the
//! kernel has it: `cargo xtask vm` runs `modes:ipvs` in its 6.1 guest).
//! Each mode gets a test of its own on a topology of its own, so the modes
//! run in parallel.
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
//!    unreachable, except from the node in the kernel modes: see below).
//! 4. Traffic that is no Service's behaves as in the baseline; the
//!    differences between the modes (below) hold.
//! 5. The mode's own read-back: `xproxy status` (ebpf), `iptables-save`
//!    (the chain walk with kube-proxy's probabilities), `nft list table ip
//!    xproxy` (the verdict maps and chains), `ipvsadm -Ln` (the virtual and
//!    real servers).
//! 6. pod-3 leaves the EndpointSlice in the manifest: the change is
//!    programmed (only pod-1 and pod-2 answer; the read-back shows it), in
//!    a partial sync; a UDP flow that was on pod-3 moves to a remaining
//!    backend (each mode in its own way: below).
//! 7. SIGTERM: the agent exits 0 and the data path stays (requests still
//!    succeed), like kube-proxy's rules.
//! 8. `xproxy cleanup` inside the node namespace removes it: every request
//!    ends as in the baseline, and the read-back finds nothing left.
//!
//! Where the modes differ, the difference is asserted per mode, not
//! skipped (the `Mode` methods below, and the `hairpin_*` tests):
//!
//! | what | ebpf | iptables | nftables | ipvs | kube-proxy (iptables)
//! |---|---|---|---|---|---
//! | hairpin: a backend pod reaches its own Service | works (the programs DNAT and mark, the kernel masquerades) | works (masquerade) | works (masquerade) | works (KUBE-LOOP-BACK masquerade) | works
//! | NodePort from the node itself, `NODE_IP:30791` | refused: the node's own traffic to a local address never passes the programs | answers | answers | answers | answers
//! | NodePort on localhost, `127.0.0.1:30791` | refused | answers (`localhostNodePorts`, `route_localnet=1`) | refused (as kube-proxy's nftables mode) | refused (no virtual server on 127.0.0.1, as kube-proxy's IPVS mode) | answers
//! | source a backend sees of NodePort traffic | the client's (no SNAT: every backend is on this node; one on another node would see the node's) | the node's (masquerade) | the node's (masquerade) | the node's (masquerade) | the node's
//! | source a backend sees of ClusterIP traffic from the node | `NODE_IP` | `NODE_IP` | `NODE_IP` | the node's address towards the pods (the VIP on kube-ipvs0 is the source, masqueraded) | `NODE_IP`
//! | UDP from the node to a Service without endpoints | ECONNREFUSED (the program's ICMP port unreachable) | EPERM at `send` (REJECT drops the node's own packet) | EPERM at `send` | EPERM at `send` | EPERM at `send`
//! | a UDP flow whose endpoint left the Service | moves to a remaining endpoint (the program's own conntrack) | moves (the agent deletes the flow's conntrack entries after the sync) | moves (the same) | moves (`expire_nodest_conn`, and the same deletion) | moves (kube-proxy deletes them too)
//!
//! The differences follow from where each mode translates. The same in every
//! mode (asserted too): a backend sees a ClusterIP request from a pod with
//! the pod's address (no `clusterCIDR` is configured, so nothing is
//! masqueraded as off-cluster traffic).
//!
//! Every stage opens its flows from local ports of its own ([`new_flows`]),
//! so no request is steered by a conntrack entry of an earlier stage; the
//! node answers every refused request (no ICMP rate limit in the test bed).

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use proxy_userspace::{
    mode::{iptables::chains::PortChains, nftables::names},
    model::{Endpoint, Protocol, ServicePort},
};
use serde_json::{Value, json};
use xproxy_tests::{
    agent_harness::{
        AgentBed, DATAPATH_PACKETS, NODE_NAME, READY_WITHIN, backend_ips, frontends, seed_node_port, service, slice,
        yaml_documents,
    },
    netns::{self, Netns, udp_request_from},
    privileged::{self, require_root},
    scenario::{
        Checks, EMPTY_CLUSTER_IP, EMPTY_NODE_PORT, EMPTY_PORT, NODE_SERVER_PORT, Outcome, PROTOCOLS, REQUESTS,
        SEED_CLUSTER_IP, SEED_NODE_PORT, SEED_PORT, check_non_service, expect_all_backends, expect_backends,
        expect_outcome, expect_rejected, fresh_ports, ipvs_virtual_servers, outcome, proto_name,
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

const SEED_FILE: &str = "seed.yaml";
const OTHERS_FILE: &str = "others.yaml";

/// The port names of the two-protocol Services (named, as Kubernetes
/// requires of a Service with more than one port).
fn port_name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp => "http",
        Protocol::Udp => "udp",
    }
}

/// A NodePort Service with the same port over TCP and UDP.
fn two_protocol_service(name: &str, cluster_ip: Ipv4Addr, port: u16, node_port: u16) -> Value {
    let ports: Vec<Value> = PROTOCOLS
        .iter()
        .map(|p| {
            json!({"name": port_name(*p), "port": port, "targetPort": TARGET_PORT,
                   "protocol": proto_name(*p), "nodePort": node_port})
        })
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "nginx"}},
        "spec": {"type": "NodePort", "clusterIP": cluster_ip.to_string(), "ports": ports,
                 "selector": {"app": "nginx"}},
    })
}

/// The seed Service (examples/seed/manifests/nginx.yaml) with a UDP port
/// beside the TCP one, and its EndpointSlice with `backends`.
fn seed_objects(backends: &[Ipv4Addr]) -> Vec<Value> {
    let ports: Vec<Value> = PROTOCOLS
        .iter()
        .map(|p| json!({"name": port_name(*p), "port": TARGET_PORT, "protocol": proto_name(*p)}))
        .collect();
    let endpoints: Vec<Value> = backends
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": NODE_NAME}))
        .collect();
    vec![
        two_protocol_service("nginx-service", SEED_CLUSTER_IP, SEED_PORT, SEED_NODE_PORT),
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "nginx-service-demo", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "nginx-service"}},
            "addressType": "IPv4",
            "ports": ports,
            "endpoints": endpoints,
        }),
    ]
}

/// The Service without endpoints and the one that reports source addresses.
fn other_objects() -> Vec<Value> {
    vec![
        two_protocol_service("empty-service", EMPTY_CLUSTER_IP, EMPTY_PORT, EMPTY_NODE_PORT),
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

/// A seed port as the agent's model has it, for the modes' names.
fn seed_port(protocol: Protocol, backends: &[Ipv4Addr]) -> ServicePort {
    ServicePort {
        name: format!("default/nginx-service:{}", port_name(protocol)),
        protocol,
        cluster_ip: SEED_CLUSTER_IP,
        port: SEED_PORT,
        node_port: Some(SEED_NODE_PORT),
        endpoints: backends.iter().map(|ip| Endpoint::ready(*ip, TARGET_PORT)).collect(),
    }
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

/// pod-1 and pod-2: the seed's endpoints after the change.
fn two_backends() -> Vec<Ipv4Addr> {
    backend_ips()[..2].to_vec()
}

fn two_backend_names() -> Vec<&'static str> {
    BACKENDS[..2].iter().map(|(name, _)| *name).collect()
}

// ---------------------------------------------------------------------------
// The modes and where they differ.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Ebpf,
    Iptables,
    Nftables,
    /// Runs where the kernel has IPVS: in `cargo xtask vm` (`modes:ipvs`).
    Ipvs,
}

/// How a request from the node to a NodePort on one of its own addresses ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeLocal {
    /// Every backend answers.
    Answers,
    /// Refused by the node's kernel: nothing listens there.
    Refused,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::Ipvs => "ipvs",
        }
    }

    /// Whether the mode can run here (else the test is skipped, or fails
    /// where it was demanded: see `privileged`).
    fn available(self, test: &str) -> bool {
        match self {
            Mode::Ipvs => privileged::require_ipvs(test),
            _ => require_root(test),
        }
    }

    /// `NODE_IP:30791` from a process on the node.
    fn node_port_from_node(self) -> NodeLocal {
        match self {
            // The node's traffic to its own address goes through `lo`,
            // where no program is attached (no socket-level hook yet).
            Mode::Ebpf => NodeLocal::Refused,
            // IPVS hooks LOCAL_OUT too: the node's own packets to a virtual
            // server are balanced like any other.
            Mode::Iptables | Mode::Nftables | Mode::Ipvs => NodeLocal::Answers,
        }
    }

    /// `127.0.0.1:30791` from a process on the node.
    fn node_port_on_localhost(self) -> NodeLocal {
        match self {
            Mode::Ebpf => NodeLocal::Refused,
            // kube-proxy's default `iptables.localhostNodePorts: true`.
            Mode::Iptables => NodeLocal::Answers,
            // kube-proxy's nftables mode never answers on 127.0.0.0/8.
            Mode::Nftables => NodeLocal::Refused,
            // Virtual servers exist for the node IPs only (kube-proxy's
            // IPVS mode does not serve node ports on localhost either).
            Mode::Ipvs => NodeLocal::Refused,
        }
    }

    /// How a UDP request from a process on the node to a Service without
    /// endpoints fails.
    fn node_udp_rejection(self) -> io::ErrorKind {
        match self {
            // The program answers with ICMP port unreachable.
            Mode::Ebpf => io::ErrorKind::ConnectionRefused,
            // REJECT in the output path drops the node's own packet: send()
            // fails with EPERM (kube-proxy's rules do the same).
            // In IPVS mode the virtual server without real servers drops
            // the node's own packet the same way.
            Mode::Iptables | Mode::Nftables | Mode::Ipvs => io::ErrorKind::PermissionDenied,
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
        }
    }
}


// ---------------------------------------------------------------------------
// Requests compared with the baseline.

#[derive(Clone, Copy, Debug)]
enum Place {
    Client,
    ClientPod,
    Node,
}

impl Place {
    fn ns(self, topo: &Topology) -> &Netns {
        match self {
            Place::Client => &topo.client,
            Place::ClientPod => &topo.client_pod.ns,
            Place::Node => &topo.node,
        }
    }
}

/// One request of the baseline.
struct Probe {
    from: Place,
    protocol: Protocol,
    addr: SocketAddrV4,
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?} -> {}", proto_name(self.protocol), self.from, self.addr)
    }
}

fn probe(from: Place, protocol: Protocol, addr: SocketAddrV4) -> Probe {
    Probe { from, protocol, addr }
}

/// Requests to the Services, and to what is no Service's.
fn probes() -> (Vec<Probe>, Vec<Probe>) {
    let mut services = Vec::new();
    for protocol in PROTOCOLS {
        for (node_port, cluster_ip) in [
            (seed_node_port(), seed_cluster_ip()),
            (empty_node_port(), empty_cluster_ip()),
        ] {
            services.push(probe(Place::Client, protocol, node_port));
            services.push(probe(Place::ClientPod, protocol, cluster_ip));
            services.push(probe(Place::Node, protocol, cluster_ip));
        }
    }
    let pod = |i: usize| SocketAddrV4::new(BACKENDS[i].1, TARGET_PORT);
    let others = vec![
        probe(
            Place::Client,
            Protocol::Tcp,
            SocketAddrV4::new(NODE_IP, NODE_SERVER_PORT),
        ),
        probe(Place::Client, Protocol::Tcp, pod(0)),
        probe(Place::Client, Protocol::Udp, pod(0)),
        probe(Place::ClientPod, Protocol::Tcp, pod(1)),
        probe(Place::Node, Protocol::Udp, pod(2)),
    ];
    (services, others)
}

/// How long a baseline request waits: long enough for any answer here,
/// short because some get none.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Sends every probe once, all at the same time.
fn observe(topo: &Topology, probes: &[Probe]) -> Result<Vec<Outcome>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = probes
            .iter()
            .map(|p| scope.spawn(move || outcome(p.from.ns(topo), p.protocol, p.addr, PROBE_TIMEOUT)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a probe thread panicked")))
            .collect()
    })
}

/// Ok if every probe ended as in `baseline`; else the ones that did not.
fn same_as(baseline: &[Outcome], topo: &Topology, probes: &[Probe]) -> Result<String> {
    let now = observe(topo, probes)?;
    let differ: Vec<String> = probes
        .iter()
        .zip(baseline.iter().zip(&now))
        .filter(|(_, (before, now))| before != now)
        .map(|(p, (before, now))| format!("{p}: {now:?}, without a proxy {before:?}"))
        .collect();
    ensure!(differ.is_empty(), "\n    {}", differ.join("\n    "));
    Ok(format!("{} requests end as without a proxy", probes.len()))
}

// ---------------------------------------------------------------------------
// The scenario.

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
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for (what, from, addr) in [
            ("client", &topo.client, empty_node_port()),
            ("client pod", &topo.client_pod.ns, empty_cluster_ip()),
            ("node", &topo.node, empty_cluster_ip()),
        ] {
            let kind = match (protocol, what) {
                (Protocol::Udp, "node") => mode.node_udp_rejection(),
                _ => io::ErrorKind::ConnectionRefused,
            };
            checks.check(
                &format!("{p} {what} -> {addr} (no endpoints) fails at once with {kind:?}"),
                expect_rejected(from, protocol, addr, kind),
            );
        }
    }
}

/// The modes' differences (see the table at the top).
fn check_differences(mode: Mode, topo: &Topology, checks: &mut Checks) {
    for (what, addr, expected) in [
        ("node -> NODE_IP:30791", seed_node_port(), mode.node_port_from_node()),
        (
            "node -> 127.0.0.1:30791",
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, SEED_NODE_PORT),
            mode.node_port_on_localhost(),
        ),
    ] {
        let result = match expected {
            NodeLocal::Answers => expect_all_backends(&topo.node, Protocol::Tcp, addr),
            NodeLocal::Refused => expect_outcome(&topo.node, Protocol::Tcp, addr, &Outcome::Refused),
        };
        checks.check(&format!("TCP {what}: {expected:?} in {} mode", mode.name()), result);
    }
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
            CLIENT_POD.1,
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
    let mut seen = std::collections::BTreeMap::new();
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
            if answer == BACKENDS[2].0 {
                return Err("pod-3 still answers".into());
            }
        }
        Ok(())
    })
}

/// Local ports for the flows of [`find_pod3_flow`], outside every range of
/// [`new_flows`].
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
        if answer == BACKENDS[2].0 {
            return Ok(port);
        }
    }
    bail!("no UDP flow from ports {FLOW_PORTS:?} landed on pod-3")
}

/// Makes the client, the client pod and the node open flows from local
/// ports `first..first + 10000` from now on: no request after this shares a
/// 5-tuple (and so a conntrack entry made by an earlier stage) with one
/// before. Each stage of the scenario gets a range of its own.
fn new_flows(topo: &Topology, first: u16) -> Result<()> {
    for ns in [&topo.client, &topo.client_pod.ns, &topo.node] {
        fresh_ports(ns, first)?;
    }
    Ok(())
}

fn seed_scenario(mode: Mode) {
    let label = format!("seed_scenario_{}", mode.name());
    let started = Instant::now();
    let mut bed = AgentBed::new(&label).unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(&label);
    if let Err(e) = seed_steps(mode, &mut bed, &mut checks) {
        panic!("{label}: {e:#}\nchecks failed before: {}", checks.failures());
    }
    checks.finish();
    eprintln!("[{label}] passed in {:.1?}", started.elapsed());
}

fn seed_steps(mode: Mode, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    bed.topo.node.serve_tcp(NODE_SERVER_PORT, "node")?;
    for pod in &bed.topo.backends {
        pod.ns.serve_tcp_peer(SOURCE_TARGET_PORT, pod.name)?;
    }
    new_flows(&bed.topo, 10_000)?;
    let (service_probes, other_probes) = probes();
    let services = service_probes.len();
    let all_probes: Vec<Probe> = service_probes.into_iter().chain(other_probes).collect();
    let baseline = observe(&bed.topo, &all_probes)?;
    // Sanity: without a proxy no Service answers, everything else does.
    for (i, (probe, outcome)) in all_probes.iter().zip(&baseline).enumerate() {
        eprintln!("[{}] without a proxy: {probe}: {outcome:?}", mode.name());
        let answered = matches!(outcome, Outcome::Answered(_));
        ensure!(
            answered == (i >= services),
            "the test bed without a proxy: {probe} ended {outcome:?}"
        );
    }

    new_flows(&bed.topo, 20_000)?;
    start(bed, mode)?;
    let all = xproxy_tests::scenario::backend_names();
    check_seed(&bed.topo, checks, &all);
    check_empty(mode, &bed.topo, checks);
    check_non_service(&bed.topo, checks);
    checks.check(
        "traffic that is no Service's is as without a proxy",
        same_as(&baseline[services..], &bed.topo, &all_probes[services..]),
    );
    check_differences(mode, &bed.topo, checks);
    checks.check(
        &format!("{} read-back of the seed", mode.name()),
        read_back(mode, bed, Stage::Seed),
    );

    // The endpoint change, through the manifest.
    let pod3_flow = find_pod3_flow(&bed.topo)?;
    new_flows(&bed.topo, 30_000)?;
    bed.write_manifest(SEED_FILE, &yaml_documents(&seed_objects(&two_backends())))?;
    wait_pod3_gone(bed)?;
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
                ensure!(answer != BACKENDS[2].0, "still answered by {answer}");
                Ok(format!("answered by {answer}"))
            }),
    );
    checks.check(
        &format!("{} read-back after pod-3 left", mode.name()),
        read_back(mode, bed, Stage::Changed),
    );
    checks.check("the change was a partial sync", {
        let log = bed.log();
        let partial: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("synced") && l.contains("full=false"))
            .collect();
        if partial.is_empty() {
            Err(anyhow::anyhow!("no partial sync in the log:\n{log}"))
        } else {
            Ok(partial.join("\n"))
        }
    });

    // SIGTERM: the data path stays.
    new_flows(&bed.topo, 40_000)?;
    let status = bed.stop_agent(libc::SIGTERM)?;
    ensure!(
        status.success(),
        "the agent exited with {status} on SIGTERM:\n{}",
        bed.log()
    );
    check_seed(&bed.topo, checks, &two_backend_names());
    check_empty(mode, &bed.topo, checks);
    checks.check(
        &format!("{} read-back after SIGTERM", mode.name()),
        read_back(mode, bed, Stage::Stopped),
    );

    // `xproxy cleanup` in the node: every request ends as without a proxy.
    new_flows(&bed.topo, 50_000)?;
    let output = bed.cleanup()?;
    eprintln!("[{}] xproxy cleanup:\n{output}", mode.name());
    checks.check(
        "after xproxy cleanup, every request ends as without a proxy",
        same_as(&baseline, &bed.topo, &all_probes),
    );
    checks.check(
        &format!("{} read-back after cleanup", mode.name()),
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

// ---------------------------------------------------------------------------
// Hairpin: a backend reaching its own Service. When the Service picks the
// pod itself, source and destination are the same address: only a SNAT to
// a node address makes the pod accept the packet and reply through the node.

fn hairpin(mode: Mode) {
    let label = format!("hairpin_{}", mode.name());
    let mut bed = AgentBed::new(&label).unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(&label);
    if let Err(e) = start(&mut bed, mode) {
        panic!("{label}: {e:#}");
    }
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
    checks.finish();
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

fn read_back(mode: Mode, bed: &AgentBed, stage: Stage) -> Result<String> {
    match mode {
        Mode::Ebpf => ebpf_read_back(bed, stage),
        Mode::Iptables => iptables_read_back(bed, stage),
        Mode::Nftables => nftables_read_back(bed, stage),
        Mode::Ipvs => ipvs_read_back(bed, stage),
    }
}

// --- ebpf: `xproxy status`.

fn ebpf_read_back(bed: &AgentBed, stage: Stage) -> Result<String> {
    if stage == Stage::Clean {
        ensure!(
            !bed.pin_path().exists(),
            "{} is still there after cleanup",
            bed.pin_path().display()
        );
        let link = bed.topo.node.ip(&["-d", "link", "show", "dev", &bed.topo.uplink])?;
        ensure!(!link.contains("prog/xdp"), "XDP still on the uplink:\n{link}");
        return Ok("no pins, no XDP on the uplink".into());
    }
    let status = bed.status()?;
    let seen = frontends(&status);
    let n = stage.seed_backends().len();
    let mut expected = std::collections::BTreeMap::new();
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
    Ok(format!(
        "{} frontends as expected, reject_no_backend = {rejected}",
        expected.len()
    ))
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
    if stage == Stage::Clean {
        ensure!(!saved.contains("KUBE-"), "left behind:\n{saved}");
        let again = bed.cleanup()?;
        ensure!(again.contains("no iptables chains"), "a second cleanup:\n{again}");
        return Ok("no KUBE- chain or rule".into());
    }
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
                protocol,
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
    Ok(format!(
        "KUBE-SERVICES -> KUBE-SVC -> {} KUBE-SEP per protocol, probabilities {:?}",
        backends.len(),
        probabilities(backends.len())
    ))
}

// --- nftables: `nft list table ip xproxy`.

/// The body of `chain NAME { ... }` in an `nft list` listing.
fn chain_body<'a>(listing: &'a str, name: &str) -> Option<&'a str> {
    let start = listing.find(&format!("chain {name} {{"))?;
    let body = &listing[start..];
    Some(&body[..body.find("\n\t}")?])
}

fn nftables_read_back(bed: &AgentBed, stage: Stage) -> Result<String> {
    if stage == Stage::Clean {
        let tables = bed.topo.node.exec(&["nft", "list", "tables"])?;
        ensure!(!tables.contains("xproxy"), "left behind:\n{tables}");
        let again = bed.cleanup()?;
        ensure!(
            again.contains("no nftables table of xproxy found"),
            "a second cleanup:\n{again}"
        );
        return Ok("no table ip xproxy".into());
    }
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
    if stage == Stage::Clean {
        ensure!(servers.is_empty(), "virtual servers left behind: {servers:#?}");
        let links = bed.topo.node.ip(&["-o", "link", "show"])?;
        ensure!(!links.contains("kube-ipvs0"), "kube-ipvs0 left behind:\n{links}");
        return Ok("no virtual server, no kube-ipvs0".into());
    }
    let reals: Vec<String> = stage
        .seed_backends()
        .iter()
        .map(|ip| format!("{ip}:{TARGET_PORT} 1"))
        .collect();
    let mut expected = std::collections::BTreeMap::new();
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
