//! The node's own traffic in the ebpf mode (issue 12, item 6 and item 1
//! "from the node"): a process on the node reaches its node ports on every
//! node address (one added after the agent started too, and `127.0.0.1`
//! as kube-proxy's default `localhostNodePorts` has it) and the Service's
//! external IPs, over TCP and over connected and unconnected UDP, through
//! the socket programs (`proxy-ebpf/src/socket_lb.rs`); the process sees
//! the address it addressed as its peer. What is no Service's is left
//! alone, and so is every other network namespace of the host: the
//! programs sit on the root cgroup, which holds them all. The links are
//! pinned: the node keeps reaching its node ports after the agent is
//! killed, a restarted agent takes them over, and `xproxy cleanup`
//! removes them.

use std::{
    collections::BTreeSet,
    io,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use proxy_common::socket_lb;
use proxy_userspace::mode::ebpf::socket_lb::read_node_addrs;
use serde_json::{Value, json};
use testbed::{
    agent_bed::{AgentBed, Mode, READY_WITHIN, seed_node_port},
    fixtures::{
        self, NODE_NAME, PortDef, TrafficPolicy, backend_ips, on_node, seed_tcp_udp, service_with, slice_with,
        yaml_documents,
    },
    netns::{self, Netns},
    probe::{
        Checks, NODE_SERVER_PORT, Outcome, PROTOCOLS, Protocol, REQUEST_TIMEOUT, REQUESTS, backend_names,
        expect_all_backends, expect_backends, expect_outcome, is_backend_name, outcome, proto_name,
    },
    topology::{BACKENDS, NODE_IP, TARGET_PORT},
};

/// A Service with external IPs: one nobody holds (the node's packets to
/// it would leave by the default route) and one the node holds on `lo`
/// (its packets to it never leave `lo`).
const EXTERNAL_NAME: &str = "external";
const EXTERNAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);
const EXTERNAL_PORT: u16 = 70;
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 70);
const EXTERNAL_IP_ON_NODE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 71);

/// An `externalTrafficPolicy: Local` NodePort Service with one endpoint on
/// this node and two elsewhere: the node's own traffic goes to all three.
const LOCAL_NAME: &str = "local-only";
const LOCAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 71);
const LOCAL_PORT: u16 = 71;
const LOCAL_NODE_PORT: u16 = 30771;

/// A port on the node's address that is no Service's.
const NO_SERVICE_PORT: u16 = 30799;

/// Added to the node after the agent started.
const LATE_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 77);

fn objects() -> Vec<Value> {
    let mut objects = fixtures::seed_objects_with(&seed_tcp_udp(), &on_node(&backend_ips()));
    let ports = PortDef::tcp_udp(("tcp", "udp"), EXTERNAL_PORT, (TARGET_PORT, TARGET_PORT), None);
    let mut external = service_with(EXTERNAL_NAME, EXTERNAL_CLUSTER_IP, &ports, None);
    external["spec"]["externalIPs"] = json!([EXTERNAL_IP.to_string(), EXTERNAL_IP_ON_NODE.to_string()]);
    objects.push(external);
    objects.push(slice_with(
        "external-1",
        EXTERNAL_NAME,
        &ports,
        &on_node(&backend_ips()),
    ));
    let local = [PortDef::tcp(LOCAL_PORT, TARGET_PORT, Some(LOCAL_NODE_PORT))];
    objects.push(service_with(
        LOCAL_NAME,
        LOCAL_CLUSTER_IP,
        &local,
        Some(TrafficPolicy::Local),
    ));
    let ips = backend_ips();
    objects.push(slice_with(
        "local-only-1",
        LOCAL_NAME,
        &local,
        &[(ips[0], NODE_NAME), (ips[1], "elsewhere"), (ips[2], "elsewhere")],
    ));
    objects
}

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// One datagram from an unconnected socket (`sendto`, `recvfrom`): the
/// answer and the address it came from.
fn udp_unconnected(addr: SocketAddrV4) -> io::Result<(String, SocketAddr)> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    socket.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    socket.send_to(b"hello\n", addr)?;
    let mut buf = [0u8; 2048];
    let (n, from) = socket.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).trim().to_owned(), from))
}

/// Unconnected UDP from the node to `addr`: every backend answers, each
/// answer seemingly from `addr` (the programs' reverse translation).
fn expect_unconnected_udp(node: &Netns, addr: SocketAddrV4) -> Result<String> {
    let answers = node.run_in(|| (0..REQUESTS).map(|_| udp_unconnected(addr)).collect::<Vec<_>>())?;
    let mut seen = BTreeSet::new();
    for answer in answers {
        let (name, from) = answer.with_context(|| format!("an unconnected datagram to {addr}"))?;
        ensure!(is_backend_name(&name), "answered {name:?}");
        ensure!(from == SocketAddr::V4(addr), "{name} answered from {from}, not {addr}");
        seen.insert(name);
    }
    ensure!(seen.len() == BACKENDS.len(), "only {seen:?} answered");
    Ok(format!("{seen:?}, each from {addr}"))
}

/// A TCP connection from the node to `addr`: its peer is `addr` itself.
fn expect_peer_name(node: &Netns, addr: SocketAddrV4) -> Result<String> {
    let peer = node.run_in(|| TcpStream::connect_timeout(&SocketAddr::V4(addr), REQUEST_TIMEOUT)?.peer_addr())??;
    ensure!(peer == SocketAddr::V4(addr), "getpeername says {peer}");
    Ok(format!("peer {peer}"))
}

/// Not answered by a backend (whatever else becomes of it).
fn expect_untranslated(from: &Netns, protocol: Protocol, addr: SocketAddrV4) -> Result<String> {
    let got = outcome(from, protocol, addr, Duration::from_secs(1))?;
    if let Outcome::Answered(name) = &got {
        ensure!(!is_backend_name(name), "translated: answered by {name}");
    }
    Ok(format!("{got:?}"))
}

/// Every way the node reaches its node port and its external IPs.
fn check_from_node(node: &Netns, checks: &mut Checks) {
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for addr in [
            seed_node_port(),
            at(Ipv4Addr::LOCALHOST, fixtures::SEED_NODE_PORT),
            at(EXTERNAL_IP, EXTERNAL_PORT),
            at(EXTERNAL_IP_ON_NODE, EXTERNAL_PORT),
        ] {
            checks.check(
                &format!("{p} node -> {addr} reaches every backend"),
                expect_all_backends(node, protocol, addr),
            );
        }
    }
    for addr in [seed_node_port(), at(EXTERNAL_IP_ON_NODE, EXTERNAL_PORT)] {
        checks.check(
            &format!("unconnected UDP node -> {addr}: every backend, answers from {addr}"),
            expect_unconnected_udp(node, addr),
        );
        checks.check(
            &format!("TCP node -> {addr}: getpeername is {addr}"),
            expect_peer_name(node, addr),
        );
    }
    checks.check(
        "externalTrafficPolicy Local: the node's own traffic reaches every endpoint",
        expect_all_backends(node, Protocol::Tcp, at(NODE_IP, LOCAL_NODE_PORT)),
    );
}

/// What is no Service's, from the node.
fn check_untouched_from_node(node: &Netns, checks: &mut Checks) {
    checks.check(
        "node -> NODE_IP:8080 (no Service's port) reaches the node's own server",
        expect_outcome(
            node,
            Protocol::Tcp,
            at(NODE_IP, NODE_SERVER_PORT),
            &Outcome::Answered("node".into()),
        ),
    );
    for protocol in PROTOCOLS {
        checks.check(
            &format!(
                "{} node -> NODE_IP:{NO_SERVICE_PORT} (no Service) is refused",
                proto_name(protocol)
            ),
            expect_outcome(node, protocol, at(NODE_IP, NO_SERVICE_PORT), &Outcome::Refused),
        );
    }
    checks.check(
        "node -> EXTERNAL_IP on another port is not translated",
        expect_untranslated(node, Protocol::Tcp, at(EXTERNAL_IP, EXTERNAL_PORT + 1)),
    );
}

/// Another namespace of the host holding the node's address and
/// `127.0.0.1` with a server of its own on the node port: its sockets are
/// in the root cgroup too, and must be left alone.
fn check_other_namespace(checks: &mut Checks) -> Result<()> {
    let other = Netns::new("xo")?;
    other.ip(&["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"])?;
    other.serve_tcp(fixtures::SEED_NODE_PORT, "other-ns")?;
    other.serve_udp(fixtures::SEED_NODE_PORT, "other-ns")?;
    for protocol in PROTOCOLS {
        for addr in [seed_node_port(), at(Ipv4Addr::LOCALHOST, fixtures::SEED_NODE_PORT)] {
            checks.check(
                &format!("{} in another namespace -> {addr} stays there", proto_name(protocol)),
                expect_outcome(&other, protocol, addr, &Outcome::Answered("other-ns".into())),
            );
        }
    }
    Ok(())
}

/// An address added to the node after the agent started takes node ports
/// (and leaves the programs' map when it is removed).
fn check_late_address(bed: &AgentBed, checks: &mut Checks) -> Result<()> {
    let node = &bed.topo.node;
    node.ip(&["addr", "add", &format!("{LATE_ADDR}/32"), "dev", &bed.topo.uplink])?;
    let pins = bed.pin_path().to_owned();
    let started = Instant::now();
    netns::wait_for("the added address in the node address map", READY_WITHIN, || {
        let addrs = read_node_addrs(&pins).map_err(|e| format!("{e:#}"))?;
        if addrs.contains(&LATE_ADDR) {
            Ok(())
        } else {
            Err(format!("map holds {addrs:?}"))
        }
    })?;
    eprintln!("the added address was taken after {:?}", started.elapsed());
    for protocol in PROTOCOLS {
        checks.check(
            &format!(
                "{} node -> {LATE_ADDR}:30791 (added after start) reaches every backend",
                proto_name(protocol)
            ),
            expect_all_backends(node, protocol, at(LATE_ADDR, fixtures::SEED_NODE_PORT)),
        );
    }
    node.ip(&["addr", "del", &format!("{LATE_ADDR}/32"), "dev", &bed.topo.uplink])?;
    checks.check(
        "a removed address leaves the node address map",
        netns::wait_for("the removed address to leave the map", READY_WITHIN, || {
            let addrs = read_node_addrs(&pins).map_err(|e| format!("{e:#}"))?;
            if addrs.contains(&LATE_ADDR) {
                Err(format!("map holds {addrs:?}"))
            } else {
                Ok(format!("{addrs:?}"))
            }
        }),
    );
    Ok(())
}

/// The agent killed, restarted, then cleaned up after.
fn check_lifecycle(bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    let node_port = seed_node_port();
    bed.stop_agent(libc::SIGKILL)?;
    checks.check(
        "after kill -9 the node still reaches its node port",
        expect_backends(&bed.topo.node, Protocol::Tcp, node_port, &backend_names(), REQUESTS),
    );
    start(bed)?;
    checks.check(
        "a restarted agent takes the pinned links over: the node still reaches its node port",
        expect_all_backends(&bed.topo.node, Protocol::Tcp, node_port),
    );
    let links = bed.pin_path().join("links").join(socket_lb::PROG_CONNECT4);
    checks.check(
        "one pinned link per socket program",
        std::fs::read_dir(&links)
            .with_context(|| format!("listing {}", links.display()))
            .and_then(|dir| {
                let names: Vec<String> = dir
                    .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                    .collect();
                ensure!(names == ["cgroup"], "pinned: {names:?}");
                Ok(format!("{names:?}"))
            }),
    );
    bed.stop_agent(libc::SIGTERM)?;
    let output = bed.cleanup()?;
    eprintln!("xproxy cleanup:\n{output}");
    for protocol in PROTOCOLS {
        checks.check(
            &format!(
                "{} after xproxy cleanup the node's node port is refused again",
                proto_name(protocol)
            ),
            expect_outcome(&bed.topo.node, protocol, node_port, &Outcome::Refused),
        );
    }
    checks.check(
        "after xproxy cleanup no pin is left",
        if bed.pin_path().join("links").exists() {
            Err(anyhow::anyhow!("{} is still there", bed.pin_path().display()))
        } else {
            Ok("none".into())
        },
    );
    Ok(())
}

fn start(bed: &mut AgentBed) -> Result<()> {
    bed.start_agent_in(Mode::Ebpf.name(), &bed.manifest_args())?;
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(seed_node_port(), READY_WITHIN)?;
    Ok(())
}

#[test]
fn node_reaches_its_node_ports_and_external_ips_in_ebpf_mode() {
    const LABEL: &str = "node_reaches_its_node_ports_and_external_ips_in_ebpf_mode";
    if !Mode::Ebpf.available(LABEL) {
        return;
    }
    let mut bed = AgentBed::new(LABEL).unwrap_or_else(|e| panic!("{LABEL}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(LABEL);
    let steps = |bed: &mut AgentBed, checks: &mut Checks| -> Result<()> {
        bed.topo.node.serve_tcp(NODE_SERVER_PORT, "node")?;
        bed.topo
            .node
            .ip(&["addr", "add", &format!("{EXTERNAL_IP_ON_NODE}/32"), "dev", "lo"])?;
        bed.write_manifest("services.yaml", &yaml_documents(&objects()))?;
        start(bed)?;
        check_from_node(&bed.topo.node, checks);
        check_untouched_from_node(&bed.topo.node, checks);
        checks.check(
            "externalTrafficPolicy Local from outside: only this node's endpoint",
            expect_backends(
                &bed.topo.client,
                Protocol::Tcp,
                at(NODE_IP, LOCAL_NODE_PORT),
                &[BACKENDS[0].0],
                REQUESTS,
            ),
        );
        check_other_namespace(checks)?;
        check_late_address(bed, checks)?;
        check_lifecycle(bed, checks)
    };
    if let Err(e) = steps(&mut bed, &mut checks) {
        panic!(
            "{LABEL}: {e:#}\nchecks failed before: {}\nagent log:\n{}",
            checks.failures(),
            bed.log()
        );
    }
    checks.finish();
}
