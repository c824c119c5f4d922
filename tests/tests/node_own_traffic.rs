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
//! removes them. The same over IPv6 (issue 13): the node's IPv6 sockets
//! reach its IPv6 node port and IPv6 external IPs, a dual-stack socket
//! its IPv4 node port through an IPv4-mapped address, `[::1]` takes no
//! node port (kube-proxy's `localhostNodePorts` is IPv4's), and the maps
//! the agent writes read back.

use std::{
    collections::BTreeSet,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use proxy_common::socket_lb;
use proxy_userspace::mode::ebpf::{
    Datapath,
    socket_lb::{read_node_addrs, read_node_addrs6, read_sock_rev6, write_node_addresses},
};
use serde_json::{Value, json};
use testbed::{
    agent_bed::{AgentBed, Mode, READY_WITHIN, seed_node_port},
    fixtures::{
        self, NODE_NAME, PortDef, TrafficPolicy, backend_ips, backend_ips6, dual_stack, on_node, seed_tcp_udp,
        service_with, slice_with, slice6_with, yaml_documents,
    },
    netns::{self, Netns},
    privileged::{PinDir, require_root},
    probe::{
        Checks, NODE_SERVER_PORT, Outcome, PROTOCOLS, Protocol, REQUEST_TIMEOUT, REQUESTS, backend_names,
        expect_all_backends, expect_backends, expect_outcome, is_backend_name, outcome, proto_name,
    },
    topology::{BACKENDS, NODE_IP, NODE_IP6, TARGET_PORT},
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
/// answer and the address it came from. An IPv6 socket for an IPv6
/// address (an IPv4-mapped one too: a dual-stack socket).
fn udp_unconnected(addr: SocketAddr) -> io::Result<(String, SocketAddr)> {
    let any: SocketAddr = match addr {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(any)?;
    socket.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    socket.send_to(b"hello\n", addr)?;
    let mut buf = [0u8; 2048];
    let (n, from) = socket.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).trim().to_owned(), from))
}

/// Unconnected UDP from the node to `addr`: every backend answers, each
/// answer seemingly from `addr` (the programs' reverse translation).
fn expect_unconnected_udp(node: &Netns, addr: impl Into<SocketAddr>) -> Result<String> {
    let addr = addr.into();
    let answers = node.run_in(|| (0..REQUESTS).map(|_| udp_unconnected(addr)).collect::<Vec<_>>())?;
    let mut seen = BTreeSet::new();
    for answer in answers {
        let (name, from) = answer.with_context(|| format!("an unconnected datagram to {addr}"))?;
        ensure!(is_backend_name(&name), "answered {name:?}");
        ensure!(from == addr, "{name} answered from {from}, not {addr}");
        seen.insert(name);
    }
    ensure!(seen.len() == BACKENDS.len(), "only {seen:?} answered");
    Ok(format!("{seen:?}, each from {addr}"))
}

/// A TCP connection from the node to `addr`: its peer is `addr` itself.
fn expect_peer_name(node: &Netns, addr: impl Into<SocketAddr>) -> Result<String> {
    let addr = addr.into();
    let peer = node.run_in(|| TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)?.peer_addr())??;
    ensure!(peer == addr, "getpeername says {peer}");
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
    check_no_service_on(node, NODE_IP.into(), checks);
    checks.check(
        "node -> EXTERNAL_IP on another port is not translated",
        expect_untranslated(node, Protocol::Tcp, at(EXTERNAL_IP, EXTERNAL_PORT + 1)),
    );
}

/// The node's own server and a port nobody serves, on the node's address
/// `node_ip`: left alone.
fn check_no_service_on(node: &Netns, node_ip: IpAddr, checks: &mut Checks) {
    let to = |port| SocketAddr::new(node_ip, port);
    checks.check(
        &format!(
            "node -> {} (no Service's port) reaches the node's own server",
            to(NODE_SERVER_PORT)
        ),
        expect_outcome(
            node,
            Protocol::Tcp,
            to(NODE_SERVER_PORT),
            &Outcome::Answered("node".into()),
        ),
    );
    for protocol in PROTOCOLS {
        checks.check(
            &format!(
                "{} node -> {} (no Service) is refused",
                proto_name(protocol),
                to(NO_SERVICE_PORT)
            ),
            expect_outcome(node, protocol, to(NO_SERVICE_PORT), &Outcome::Refused),
        );
    }
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
    start(bed, &[])?;
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
    check_cleanup(bed, checks, &[node_port.into()])
}

/// The agent stopped and `xproxy cleanup` run: the node's node ports at
/// `node_ports` are refused again (the socket programs are detached) and
/// no pin is left.
fn check_cleanup(bed: &mut AgentBed, checks: &mut Checks, node_ports: &[SocketAddr]) -> Result<()> {
    bed.stop_agent(libc::SIGTERM)?;
    let output = bed.cleanup()?;
    eprintln!("xproxy cleanup:\n{output}");
    for (protocol, node_port) in PROTOCOLS
        .into_iter()
        .flat_map(|p| node_ports.iter().map(move |a| (p, *a)))
    {
        checks.check(
            &format!(
                "{} after xproxy cleanup the node's {node_port} is refused again",
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

/// Starts the agent with the bed's manifests and `extra` arguments.
fn start(bed: &mut AgentBed, extra: &[String]) -> Result<()> {
    let mut args = bed.manifest_args();
    args.extend_from_slice(extra);
    bed.start_agent_in(Mode::Ebpf.name(), &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(seed_node_port(), READY_WITHIN)?;
    Ok(())
}

/// Runs `steps` on a fresh bed whose node serves its own port
/// [`NODE_SERVER_PORT`] and holds `on_lo` on `lo`, the manifests `objects`
/// written; panics with the agent's log if a step fails.
fn on_a_bed(
    label: &str,
    (objects, on_lo): (&[Value], &str),
    steps: impl FnOnce(&mut AgentBed, &mut Checks) -> Result<()>,
) {
    if !Mode::Ebpf.available(label) {
        return;
    }
    let mut bed = AgentBed::new(label).unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(label);
    let all_steps = |bed: &mut AgentBed, checks: &mut Checks| -> Result<()> {
        bed.topo.node.serve_tcp(NODE_SERVER_PORT, "node")?;
        bed.topo.node.add_addr("lo", on_lo)?;
        bed.write_manifest("services.yaml", &yaml_documents(objects))?;
        steps(bed, checks)
    };
    if let Err(e) = all_steps(&mut bed, &mut checks) {
        panic!(
            "{label}: {e:#}\nchecks failed before: {}\nagent log:\n{}",
            checks.failures(),
            bed.log()
        );
    }
    checks.finish();
}

#[test]
fn node_reaches_its_node_ports_and_external_ips_in_ebpf_mode() {
    let on_lo = format!("{EXTERNAL_IP_ON_NODE}/32");
    on_a_bed(
        "node_reaches_its_node_ports_and_external_ips_in_ebpf_mode",
        (&objects(), &on_lo),
        |bed, checks| {
            start(bed, &[])?;
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
        },
    );
}

// ---------------------------------------------------------------------------
// IPv6 (issue 13): the node's IPv6 sockets (`proxy-ebpf/src/socket_lb6.rs`).

/// A dual-stack Service with IPv6 external IPs: one nobody holds and one
/// the node holds on `lo`.
const EXTERNAL6_NAME: &str = "external6";
const EXTERNAL6_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 72);
const EXTERNAL6_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x72);
const EXTERNAL6_PORT: u16 = 72;
const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x198, 0x51, 0, 0, 0, 0, 0x72);
const EXTERNAL_IP6_ON_NODE: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0, 0, 0, 0, 0, 0x72);

fn objects6() -> Vec<Value> {
    let mut objects = fixtures::seed_objects_dual_stack(&seed_tcp_udp());
    let ports = PortDef::tcp_udp(("tcp", "udp"), EXTERNAL6_PORT, (TARGET_PORT, TARGET_PORT), None);
    let mut external = dual_stack(
        service_with(EXTERNAL6_NAME, EXTERNAL6_CLUSTER_IP, &ports, None),
        EXTERNAL6_CLUSTER_IP6,
    );
    external["spec"]["externalIPs"] = json!([EXTERNAL_IP6.to_string(), EXTERNAL_IP6_ON_NODE.to_string()]);
    objects.push(external);
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    objects.push(slice6_with("external6-6", EXTERNAL6_NAME, &ports, &endpoints6));
    objects
}

fn at6(ip: Ipv6Addr, port: u16) -> SocketAddr {
    SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0))
}

/// `[NODE_IP6]:NODEPORT`.
fn node_port6() -> SocketAddr {
    at6(NODE_IP6, fixtures::SEED_NODE_PORT)
}

/// `NODE_IP:NODEPORT` as a dual-stack IPv6 socket names it.
fn node_port_mapped() -> SocketAddr {
    at6(NODE_IP.to_ipv6_mapped(), fixtures::SEED_NODE_PORT)
}

/// Every way the node's IPv6 sockets reach its node port and external IPs.
fn check_from_node6(node: &Netns, checks: &mut Checks) {
    let on_node = at6(EXTERNAL_IP6_ON_NODE, EXTERNAL6_PORT);
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for addr in [
            node_port6(),
            on_node,
            at6(EXTERNAL_IP6, EXTERNAL6_PORT),
            node_port_mapped(),
        ] {
            checks.check(
                &format!("{p} node -> {addr} reaches every backend"),
                expect_all_backends(node, protocol, addr),
            );
        }
    }
    for addr in [node_port6(), on_node, node_port_mapped()] {
        checks.check(
            &format!("unconnected UDP node -> {addr}: every backend, answers from {addr}"),
            expect_unconnected_udp(node, addr),
        );
        checks.check(
            &format!("TCP node -> {addr}: getpeername is {addr}"),
            expect_peer_name(node, addr),
        );
    }
}

/// What is no Service's, from the node's IPv6 sockets.
fn check_untouched_from_node6(node: &Netns, checks: &mut Checks) {
    check_no_service_on(node, NODE_IP6.into(), checks);
    for protocol in PROTOCOLS {
        // kube-proxy's localhostNodePorts is IPv4's.
        checks.check(
            &format!(
                "{} node -> [::1]:NODEPORT is refused, as kube-proxy's",
                proto_name(protocol)
            ),
            expect_outcome(
                node,
                protocol,
                at6(Ipv6Addr::LOCALHOST, fixtures::SEED_NODE_PORT),
                &Outcome::Refused,
            ),
        );
    }
}

/// Another namespace holding the node's addresses with a server of its own
/// on the node port: its IPv6 sockets are left alone.
fn check_other_namespace6(checks: &mut Checks) -> Result<()> {
    let other = Netns::new("xo6")?;
    other.add_addr("lo", &format!("{NODE_IP6}/128"))?;
    other.ip(&["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"])?;
    other.serve_tcp(fixtures::SEED_NODE_PORT, "other-ns")?;
    other.serve_udp(fixtures::SEED_NODE_PORT, "other-ns")?;
    for protocol in PROTOCOLS {
        for addr in [node_port6(), node_port_mapped()] {
            checks.check(
                &format!("{} in another namespace -> {addr} stays there", proto_name(protocol)),
                expect_outcome(&other, protocol, addr, &Outcome::Answered("other-ns".into())),
            );
        }
    }
    Ok(())
}

/// The IPv6 maps the agent and the programs wrote, read back.
fn check_maps6(bed: &AgentBed, checks: &mut Checks) {
    let pins = bed.pin_path();
    checks.check(
        "XP_NODE_ADDRS6 holds the node's IPv6 addresses, not ::1 nor link-local ones",
        read_node_addrs6(pins).and_then(|addrs| {
            ensure!(
                addrs.contains(&NODE_IP6) && addrs.contains(&EXTERNAL_IP6_ON_NODE),
                "{addrs:?}"
            );
            ensure!(
                addrs.iter().all(|a| !a.is_loopback() && !a.is_unicast_link_local()),
                "{addrs:?}"
            );
            Ok(format!("{addrs:?}"))
        }),
    );
    checks.check(
        "XP_SOCK_REV6 remembers every backend the node port was translated to",
        read_sock_rev6(pins).and_then(|entries| {
            let backends: BTreeSet<SocketAddrV6> = backend_ips6()
                .into_iter()
                .map(|ip| SocketAddrV6::new(ip, TARGET_PORT, 0, 0))
                .collect();
            for (_, backend, _) in &entries {
                ensure!(backends.contains(backend), "translated to {backend}, no backend");
            }
            let to_node_port: BTreeSet<SocketAddrV6> = entries
                .iter()
                .filter(|(_, _, frontend)| SocketAddr::V6(*frontend) == node_port6())
                .map(|(_, backend, _)| *backend)
                .collect();
            ensure!(to_node_port == backends, "node port translated to {to_node_port:?}");
            Ok(format!("{} entries", entries.len()))
        }),
    );
}

#[test]
fn node_reaches_its_ipv6_node_ports_and_external_ips_in_ebpf_mode() {
    let on_lo = format!("{EXTERNAL_IP6_ON_NODE}/128");
    on_a_bed(
        "node_reaches_its_ipv6_node_ports_and_external_ips_in_ebpf_mode",
        (&objects6(), &on_lo),
        |bed, checks| {
            // Beside the IPv4 one the bed passes.
            start(bed, &["--node-ip".to_owned(), NODE_IP6.to_string()])?;
            check_from_node6(&bed.topo.node, checks);
            check_untouched_from_node6(&bed.topo.node, checks);
            check_maps6(bed, checks);
            check_other_namespace6(checks)?;
            check_cleanup(bed, checks, &[node_port6(), node_port_mapped()])
        },
    );
}

/// The agent's writer of the node address maps: each holds exactly the
/// last set written, read back from the kernel.
#[test]
fn node_address_maps_hold_exactly_what_is_written() {
    if !require_root("node_address_maps_hold_exactly_what_is_written") {
        return;
    }
    let pins = PinDir::new();
    Datapath::load(pins.path()).expect("programs pass the verifier");
    let v4 = |ips: &[[u8; 4]]| ips.iter().map(|o| Ipv4Addr::from(*o)).collect::<BTreeSet<_>>();
    let v6 = |ips: &[&str]| {
        ips.iter()
            .map(|i| i.parse().expect("ip"))
            .collect::<BTreeSet<Ipv6Addr>>()
    };
    for (four, six) in [
        (
            v4(&[[172, 30, 0, 2], [127, 0, 0, 1]]),
            v6(&["fd00:30::2", "fd00:192::72"]),
        ),
        (
            v4(&[[127, 0, 0, 1], [10, 1, 0, 5]]),
            v6(&["fd00:192::72", "2001:db8::1"]),
        ),
        (v4(&[]), v6(&[])),
    ] {
        write_node_addresses(pins.path(), &four, &six).expect("writing the node address maps");
        assert_eq!(read_node_addrs(pins.path()).expect("XP_NODE_ADDRS"), four);
        assert_eq!(read_node_addrs6(pins.path()).expect("XP_NODE_ADDRS6"), six);
    }
}
