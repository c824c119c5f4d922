//! The userspace mode end to end: the real agent (`xproxy run --mode
//! userspace --manifests DIR`) in the node namespace of the test bed, the
//! seed scenario of `modes.rs` with this mode's own read-back and its
//! differences, each asserted:
//!
//! 1. Without a proxy: the baseline of every request.
//! 2. The seed Service (88 -> 80, NodePort 30791, TCP and UDP) from the
//!    client via `NODE_IP:30791`, from the client pod and from the node via
//!    `CLUSTER_IP:88`: every request answered, by all three pods. A
//!    Service without endpoints fails at once from the same places.
//! 3. The differences (table below), hairpin included, and traffic that is
//!    no Service's as in the baseline.
//! 4. `iptables-save`: the KUBE-PORTALS-* / KUBE-NODEPORT-* rules point at
//!    ports the agent listens on (`ss`), the REJECT rules of the Service
//!    without endpoints, the jumps.
//! 5. pod-3 leaves the seed's and the echo Service's EndpointSlices:
//!    only pod-1 and pod-2 answer new requests; UDP flows that were on
//!    pod-3 move, the others stay; long-lived TCP connections (some to
//!    pod-3) keep exchanging; the rules and listener ports are unchanged
//!    and the sync wrote nothing to the kernel.
//! 6. SIGTERM: the agent exits 0 and takes its rules along: every request
//!    ends as without a proxy.
//! 7. A second agent killed with SIGKILL leaves its rules pointing at
//!    ports nobody listens on: Service requests are refused; `xproxy
//!    cleanup` removes them and everything ends as without a proxy.
//!
//! | what                                             | userspace
//! |--------------------------------------------------|----------
//! | hairpin: a backend pod reaches its own Service    | works (the agent connects to the pod from the node)
//! | NodePort from the node itself, `NODE_IP:30791`    | answers (OUTPUT DNAT to 127.0.0.1)
//! | NodePort on localhost, `127.0.0.1:30791`          | answers (the same rule; no `route_localnet` needed)
//! | source a backend sees                             | the node's address towards the pod (`POD_GATEWAY`), for every client: NodePort, pod and node alike
//! | UDP from the node to a Service without endpoints  | EPERM at `send` (REJECT in OUTPUT, as the iptables mode)
//! | a UDP flow whose endpoint left the Service        | moves: its session is closed at once, the next datagram opens one to a remaining endpoint
//! | data path after SIGTERM                           | gone with the agent (rules removed); after SIGKILL: Service requests refused until `xproxy cleanup` or a restart
//!
//! Every stage opens its flows from local ports of its own
//! ([`new_flows`]), so no request is steered by a conntrack entry of an
//! earlier stage.

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use proxy_userspace::model::Protocol;
use serde_json::{Value, json};
use xproxy_tests::{
    agent_harness::{
        AgentBed, EchoClients, KERNEL_WRITES, NODE_NAME, READY_WITHIN, backend_ips, seed_node_port, service, slice,
        yaml_documents,
    },
    netns::{self, Netns},
    privileged::require_root,
    scenario::{
        Checks, EMPTY_CLUSTER_IP, EMPTY_NODE_PORT, EMPTY_PORT, NODE_SERVER_PORT, Outcome, PROTOCOLS, REQUESTS,
        SEED_CLUSTER_IP, SEED_NODE_PORT, SEED_PORT, backend_names, check_non_service, expect_all_backends,
        expect_backends, expect_rejected, fresh_ports, outcome, proto_name,
    },
    topology::{BACKENDS, NODE_IP, POD_GATEWAY, TARGET_PORT, Topology},
};

const MODE: &str = "userspace";

// ---------------------------------------------------------------------------
// The Services.

/// A Service whose backends answer with the client address they see.
const SOURCE_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 81);
const SOURCE_PORT: u16 = 81;
const SOURCE_TARGET_PORT: u16 = 81;
const SOURCE_NODE_PORT: u16 = 30781;

/// An echo Service for long-lived connections.
const ECHO_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const ECHO_PORT: u16 = 7;
const ECHO_TARGET_PORT: u16 = 7007;

const SEED_FILE: &str = "seed.yaml";
const ECHO_FILE: &str = "echo.yaml";
const OTHERS_FILE: &str = "others.yaml";

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

/// The seed Service with a UDP port beside the TCP one, and its
/// EndpointSlice with `backends`.
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

fn echo_objects(backends: &[Ipv4Addr]) -> Vec<Value> {
    vec![
        service("echo", ECHO_CLUSTER_IP, ECHO_PORT, ECHO_TARGET_PORT, None),
        slice("echo-1", "echo", ECHO_TARGET_PORT, backends),
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

fn seed_cluster_ip() -> SocketAddrV4 {
    SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT)
}

fn empty_node_port() -> SocketAddrV4 {
    SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT)
}

fn empty_cluster_ip() -> SocketAddrV4 {
    SocketAddrV4::new(EMPTY_CLUSTER_IP, EMPTY_PORT)
}

fn two_backends() -> Vec<Ipv4Addr> {
    backend_ips()[..2].to_vec()
}

fn two_backend_names() -> Vec<&'static str> {
    BACKENDS[..2].iter().map(|(name, _)| *name).collect()
}

const POD3: &str = BACKENDS[2].0;

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

/// Requests to the Services (first), then to what is no Service's.
fn probes() -> (Vec<Probe>, Vec<Probe>) {
    let mut services = Vec::new();
    for protocol in PROTOCOLS {
        for (node_port, cluster_ip) in [
            (seed_node_port(), seed_cluster_ip()),
            (empty_node_port(), empty_cluster_ip()),
        ] {
            for (from, addr) in [
                (Place::Client, node_port),
                (Place::ClientPod, cluster_ip),
                (Place::Node, cluster_ip),
                (Place::Node, SocketAddrV4::new(Ipv4Addr::LOCALHOST, node_port.port())),
            ] {
                services.push(Probe { from, protocol, addr });
            }
        }
    }
    let pod = |i: usize| SocketAddrV4::new(BACKENDS[i].1, TARGET_PORT);
    let others = vec![
        Probe {
            from: Place::Client,
            protocol: Protocol::Tcp,
            addr: SocketAddrV4::new(NODE_IP, NODE_SERVER_PORT),
        },
        Probe {
            from: Place::Client,
            protocol: Protocol::Udp,
            addr: pod(0),
        },
        Probe {
            from: Place::ClientPod,
            protocol: Protocol::Tcp,
            addr: pod(1),
        },
        Probe {
            from: Place::Node,
            protocol: Protocol::Udp,
            addr: pod(2),
        },
    ];
    (services, others)
}

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

/// Ok if every probe ended as in `baseline`.
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

/// Each stage's flows come from local ports `first..first + 10000`.
fn new_flows(topo: &Topology, first: u16) -> Result<()> {
    for ns in [&topo.client, &topo.client_pod.ns, &topo.node] {
        fresh_ports(ns, first)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The checks.

fn start(bed: &mut AgentBed) -> Result<()> {
    bed.start_agent_in(MODE, &bed.manifest_args())?;
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(seed_node_port(), READY_WITHIN)?;
    Ok(())
}

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

fn check_empty(topo: &Topology, checks: &mut Checks) {
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for (what, from, addr) in [
            ("client", &topo.client, empty_node_port()),
            ("client pod", &topo.client_pod.ns, empty_cluster_ip()),
            ("node", &topo.node, empty_cluster_ip()),
            ("node", &topo.node, empty_node_port()),
        ] {
            // REJECT in OUTPUT drops the node's own datagram: send() fails.
            let kind = match (protocol, what) {
                (Protocol::Udp, "node") => io::ErrorKind::PermissionDenied,
                _ => io::ErrorKind::ConnectionRefused,
            };
            checks.check(
                &format!("{p} {what} -> {addr} (no endpoints) fails at once with {kind:?}"),
                expect_rejected(from, protocol, addr, kind),
            );
        }
    }
}

/// The rows of the table at the top that differ between the modes.
fn check_differences(topo: &Topology, checks: &mut Checks) {
    for protocol in PROTOCOLS {
        for (what, addr) in [
            ("node -> NODE_IP:30791", seed_node_port()),
            (
                "node -> 127.0.0.1:30791",
                SocketAddrV4::new(Ipv4Addr::LOCALHOST, SEED_NODE_PORT),
            ),
        ] {
            checks.check(
                &format!("{} {what} answers", proto_name(protocol)),
                expect_all_backends(&topo.node, protocol, addr),
            );
        }
        checks.check(
            &format!(
                "hairpin: {} pod-1 -> {} reaches every backend, itself too",
                proto_name(protocol),
                seed_cluster_ip()
            ),
            expect_all_backends(&topo.backends[0].ns, protocol, seed_cluster_ip()),
        );
    }
    for (what, from, addr) in [
        (
            "client -> NodePort",
            &topo.client,
            SocketAddrV4::new(NODE_IP, SOURCE_NODE_PORT),
        ),
        (
            "client pod -> ClusterIP",
            &topo.client_pod.ns,
            SocketAddrV4::new(SOURCE_CLUSTER_IP, SOURCE_PORT),
        ),
        (
            "node -> ClusterIP",
            &topo.node,
            SocketAddrV4::new(SOURCE_CLUSTER_IP, SOURCE_PORT),
        ),
    ] {
        checks.check(
            &format!("{what}: every backend sees the node's address towards it, {POD_GATEWAY}"),
            sources_seen(from, addr).and_then(|seen| {
                ensure!(seen.iter().all(|(_, ip)| *ip == POD_GATEWAY), "backends saw {seen:?}");
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

// ---------------------------------------------------------------------------
// Read-back: `iptables-save` and the agent's sockets.

/// The listener port of each seed protocol, as the rules name it.
type Listeners = BTreeMap<&'static str, u16>;

fn comment(text: &str) -> String {
    format!("-m comment --comment \"{text}\"")
}

/// Checks the rules of the seed, the Service without endpoints and the
/// jumps in `iptables-save`, and that the agent listens on the ports the
/// rules redirect to; returns those ports.
fn read_back(node: &Netns) -> Result<Listeners> {
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
        let sockets = node.exec(&[
            "ss",
            "-H",
            "-ln",
            "-p",
            if protocol == Protocol::Tcp { "-t" } else { "-u" },
        ])?;
        ensure!(
            sockets
                .lines()
                .any(|l| l.contains(&format!("0.0.0.0:{listener} ")) && l.contains("\"xproxy\"")),
            "the agent does not listen on {p} {listener}:\n{sockets}"
        );
        listeners.insert(proto_name(protocol), listener);
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

/// Nothing of the mode is left in `iptables-save`.
fn read_back_clean(node: &Netns) -> Result<String> {
    let saved = node.exec(&["iptables-save"])?;
    for chain in [
        "KUBE-PORTALS-CONTAINER",
        "KUBE-PORTALS-HOST",
        "KUBE-NODEPORT-CONTAINER",
        "KUBE-NODEPORT-HOST",
        "KUBE-PORTALS-REJECT",
    ] {
        ensure!(!saved.contains(chain), "{chain} left behind:\n{saved}");
    }
    Ok("no KUBE-PORTALS / KUBE-NODEPORT chain or jump".into())
}

// ---------------------------------------------------------------------------
// UDP flows that keep sending across the endpoint change.

/// How often a flow sends: well inside the 250 ms idle timeout, so its
/// session lives on unless the agent closes it.
const FLOW_INTERVAL: Duration = Duration::from_millis(20);

/// Answers of one flow, with when they came.
type Answers = Vec<(Instant, Result<String, String>)>;

/// UDP flows from the client pod to the seed's ClusterIP, each from one
/// socket (one session in the agent), sending until stopped.
struct UdpFlows {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Answers>>,
    answers: Vec<Arc<std::sync::Mutex<Answers>>>,
}

impl UdpFlows {
    fn start(ns: &Netns, addr: SocketAddrV4, count: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut answers = Vec::new();
        for _ in 0..count {
            let path: PathBuf = ns.path().to_owned();
            let stop = stop.clone();
            let log = Arc::new(std::sync::Mutex::new(Answers::new()));
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
                    .unwrap_or_else(|e| e.into_inner())
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

fn udp_flow(ns: &std::path::Path, addr: SocketAddrV4, stop: &AtomicBool, log: &std::sync::Mutex<Answers>) -> Answers {
    let record = |result: Result<String, String>| {
        log.lock()
            .unwrap_or_else(|e| e.into_inner())
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
    std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()))
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
        .flat_map(|f| f.first().map(|(at, _)| *at))
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
// The scenario.

#[test]
fn seed_scenario_userspace() {
    const LABEL: &str = "seed_scenario_userspace";
    if !require_root(LABEL) {
        return;
    }
    let started = Instant::now();
    let mut bed = AgentBed::new(LABEL).unwrap_or_else(|e| panic!("{LABEL}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(LABEL);
    if let Err(e) = seed_steps(&mut bed, &mut checks) {
        panic!("{LABEL}: {e:#}\nchecks failed before: {}", checks.failures());
    }
    checks.finish();
    eprintln!("[{LABEL}] passed in {:.1?}", started.elapsed());
}

fn seed_steps(bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    bed.topo.node.serve_tcp(NODE_SERVER_PORT, "node")?;
    for pod in &bed.topo.backends {
        pod.ns.serve_tcp_peer(SOURCE_TARGET_PORT, pod.name)?;
        pod.ns.serve_tcp_echo(ECHO_TARGET_PORT)?;
    }
    new_flows(&bed.topo, 10_000)?;
    let (service_probes, other_probes) = probes();
    let services = service_probes.len();
    let all_probes: Vec<Probe> = service_probes.into_iter().chain(other_probes).collect();
    let baseline = observe(&bed.topo, &all_probes)?;
    for (i, (probe, outcome)) in all_probes.iter().zip(&baseline).enumerate() {
        eprintln!("[{MODE}] without a proxy: {probe}: {outcome:?}");
        let answered = matches!(outcome, Outcome::Answered(_));
        ensure!(
            answered == (i >= services),
            "the test bed without a proxy: {probe} ended {outcome:?}"
        );
    }

    // The agent, the seed, the differences.
    new_flows(&bed.topo, 20_000)?;
    bed.write_manifest(SEED_FILE, &yaml_documents(&seed_objects(&backend_ips())))?;
    bed.write_manifest(ECHO_FILE, &yaml_documents(&echo_objects(&backend_ips())))?;
    bed.write_manifest(OTHERS_FILE, &yaml_documents(&other_objects()))?;
    start(bed)?;
    check_seed(&bed.topo, checks, &backend_names());
    check_empty(&bed.topo, checks);
    check_non_service(&bed.topo, checks);
    checks.check(
        "traffic that is no Service's is as without a proxy",
        same_as(&baseline[services..], &bed.topo, &all_probes[services..]),
    );
    check_differences(&bed.topo, checks);
    let listeners = read_back(&bed.topo.node);
    let shown = listeners
        .as_ref()
        .map(|l| format!("listeners {l:?}"))
        .map_err(|e| anyhow::anyhow!("{e:#}"));
    checks.check("iptables-save and the agent's sockets", shown);
    let listeners = listeners.unwrap_or_default();

    endpoint_change(bed, checks, &listeners)?;

    // SIGTERM: the agent takes its data path along.
    new_flows(&bed.topo, 40_000)?;
    let status = bed.stop_agent(libc::SIGTERM)?;
    ensure!(
        status.success(),
        "the agent exited with {status} on SIGTERM:\n{}",
        bed.log()
    );
    checks.check("after SIGTERM no rule is left", read_back_clean(&bed.topo.node));
    checks.check(
        "after SIGTERM every request ends as without a proxy",
        same_as(&baseline, &bed.topo, &all_probes),
    );

    // SIGKILL: the rules stay and refuse until `xproxy cleanup`.
    new_flows(&bed.topo, 50_000)?;
    start(bed)?;
    bed.stop_agent(libc::SIGKILL)?;
    checks.check(
        "after SIGKILL the rules are still there",
        read_back_rules_only(&bed.topo.node),
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
    // The baseline's ports again (the last range is used up): its
    // conntrack entries carry no NAT, as none may after the cleanup.
    new_flows(&bed.topo, 10_000)?;
    let output = bed.cleanup()?;
    eprintln!("[{MODE}] xproxy cleanup:\n{output}");
    checks.check("cleanup removed the chains", read_back_clean(&bed.topo.node));
    checks.check(
        "after xproxy cleanup every request ends as without a proxy",
        same_as(&baseline, &bed.topo, &all_probes),
    );
    let again = bed.cleanup()?;
    checks.check(
        "a second cleanup finds nothing",
        if again.contains("no userspace mode chains found") {
            Ok("nothing to remove".into())
        } else {
            Err(anyhow::anyhow!("a second cleanup:\n{again}"))
        },
    );
    Ok(())
}

/// The chains of a killed agent: present, pointing at a port.
fn read_back_rules_only(node: &Netns) -> Result<String> {
    let saved = node.exec(&["iptables-save"])?;
    let redirects = saved
        .lines()
        .filter(|l| l.starts_with("-A KUBE-PORTALS-CONTAINER ") && l.contains("-j REDIRECT"))
        .count();
    ensure!(redirects >= 2, "expected the seed's REDIRECT rules:\n{saved}");
    Ok(format!("{redirects} REDIRECT rules"))
}

/// pod-3 leaves the seed and the echo Service while UDP flows and TCP
/// connections are open.
fn endpoint_change(bed: &mut AgentBed, checks: &mut Checks, listeners: &Listeners) -> Result<()> {
    new_flows(&bed.topo, 30_000)?;
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
    check_seed(&bed.topo, checks, &two_backend_names());
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
        if failed.is_empty() {
            Ok(format!(
                "{} connections, {} exchanges",
                outcomes.len(),
                outcomes.iter().map(|o| o.exchanges).sum::<u64>()
            ))
        } else {
            Err(anyhow::anyhow!("{failed:?}"))
        }
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
        read_back(&bed.topo.node).and_then(|now| {
            ensure!(now == *listeners, "listeners {listeners:?} -> {now:?}");
            Ok(format!("{now:?}"))
        }),
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
    Ok(())
}

/// Established TCP connections to local port `port` in `ns`.
fn established_to(ns: &Netns, port: u16) -> Result<usize> {
    let listing = ns.exec(&["ss", "-H", "-tn", "state", "established"])?;
    let local = format!(":{port} ");
    Ok(listing.lines().filter(|l| l.contains(&local)).count())
}

/// Waits until the client's requests no longer reach pod-3.
fn wait_pod3_gone(bed: &mut AgentBed) -> Result<()> {
    netns::wait_for("pod-3 to leave the seed's backends", READY_WITHIN, || {
        bed.agent_alive()?;
        // 30 requests in turn over the remaining backends never reach pod-3.
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
