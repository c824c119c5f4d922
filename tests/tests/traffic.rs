//! Datagrams larger than the MTU and ICMP errors through Services, in the
//! ebpf (tc on the uplink, and native XDP), iptables, nftables and IPVS
//! modes (IPVS where the kernel has it: `cargo xtask vm` runs
//! `traffic:ipvs`), on the seed test bed (`testbed::topology`).
//!
//! - Fragments: 4,000- and 60,000-byte UDP datagrams (3 and 41 fragments
//!   at MTU 1,500) from the client pod to a ClusterIP and from the outside
//!   client to a NodePort; the backend echoes each, fragmented too, and
//!   the client must get back exactly what it sent; the same from the
//!   outside client to the Service's LoadBalancer IP and from the client
//!   pod to its external IP.
//! - ICMP errors: a Service whose backends do not listen on the target
//!   port; the backend's kernel answers with port unreachable, which must
//!   reach the client, through the translation, as ECONNREFUSED on its
//!   connected socket (from the client pod via the ClusterIP, from the
//!   outside client via the NodePort and the LoadBalancer IP, from the
//!   client pod via the external IP).
//!
//! - Path MTU discovery: a client two routers away, behind a 1,400-byte
//!   hop, downloads and uploads 16 MiB (`testbed::bulk`, SHA-256 checked)
//!   through a NodePort and a ClusterIP. The first
//!   full-size segments die at the hop, whose frag-needed goes to the
//!   address the client sees (the node's, the ClusterIP); it must reach the
//!   backend, whose TCP then sends smaller segments. Untranslated, the
//!   download stalls for good.
//!
//! ```text
//!   far ── r2 ══(MTU 1,400)══ r1 ── node ── pods
//! ```
//!
//! - IPv6 (ebpf, tc and native XDP; iptables; nftables): the fragments
//!   and port unreachable rows above over IPv6, from the client pod to
//!   the dual-stack Services' IPv6 ClusterIPs and from the outside client
//!   to the node's IPv6 NodePort (ebpf: `ipv6::fragments`,
//!   `ipv6::icmp_error`); and path MTU discovery over IPv6 in every mode
//!   (`pmtud6_*`: the routers' packet too big, ICMPv6, to the node's IPv6
//!   address and the IPv6 ClusterIP, must reach the backend).
//!
//! The modes do not differ here: the kernel modes' conntrack reassembles
//! fragments before NAT and translates ICMP errors of NATed flows; the ebpf
//! mode translates each fragment (`fragments`) and the errors (`icmp_error`).

use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use testbed::{
    agent_bed::{AgentBed, READY_WITHIN},
    bulk::{self, Direction},
    fixtures::{
        NODE_NAME, PortDef, backend_ips, backend_ips6, dual_stack, load_balancer, on_node, service, service_with,
        slice, slice_with, slice6_with, yaml_documents,
    },
    netns::{self, Netns, Server},
    privileged::{require_ipvs, require_root},
    probe::Protocol,
    topology::{NODE_IP, NODE_IP6, POD_CIDR, POD_CIDR6, drop_invalid_forwarding},
};

const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);
const ECHO_PORT: u16 = 7070;
const ECHO_NODE_PORT: u16 = 30770;
const REFUSING_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 71);
const REFUSING_PORT: u16 = 9;
/// Nothing listens there in the pods.
const CLOSED_PORT: u16 = 9999;
const REFUSING_NODE_PORT: u16 = 30771;
/// The Services' LoadBalancer and external IPs: `dgram`'s, `refusing`'s.
const LB_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(203, 0, 113, 70), Ipv4Addr::new(203, 0, 113, 71)];
const EXTERNAL_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(198, 51, 100, 70), Ipv4Addr::new(198, 51, 100, 71)];
/// What the client routes to the node.
const EXTERNAL_NETS: [&str; 2] = ["203.0.113.0/24", "198.51.100.0/24"];
const SIZES: [usize; 2] = [4000, 60_000];
const TIMEOUT: Duration = Duration::from_secs(3);

/// A LoadBalancer Service of `protocol` to `target_port` on every backend
/// pod, with `external` (its LB IP, its external IP), and its
/// EndpointSlice.
fn service_of(
    protocol: &str,
    name: &str,
    (cluster_ip, port, target_port): (Ipv4Addr, u16, u16),
    node_port: u16,
    (lb_ip, external_ip): (Ipv4Addr, Ipv4Addr),
) -> [Value; 2] {
    let mut svc = load_balancer(
        service(name, cluster_ip, port, target_port, Some(node_port)),
        &[(lb_ip, None)],
    );
    svc["spec"]["externalIPs"] = json!([external_ip.to_string()]);
    let mut endpoints = slice(&format!("{name}-1"), name, target_port, &backend_ips());
    svc["spec"]["ports"][0]["protocol"] = json!(protocol);
    endpoints["ports"][0]["protocol"] = json!(protocol);
    [svc, endpoints]
}

/// One `len`-byte datagram to the echo servers behind `to`, echoed intact.
fn echo_once(to: impl Into<SocketAddr>, len: usize) -> io::Result<()> {
    netns::udp_echo_roundtrip(to, len, TIMEOUT)
}

/// What a connected socket's request to `to` ends with.
fn refusal(to: impl Into<SocketAddr>) -> io::Result<String> {
    netns::udp_request(to, TIMEOUT)
}

/// Whether `mode` can run here (IPVS: only where the kernel has it, as in
/// `cargo xtask vm`).
fn available(label: &str, mode: &str) -> bool {
    if mode == "ipvs" {
        require_ipvs(label)
    } else {
        require_root(label)
    }
}

fn traffic(label: &str, mode: &str, extra: &[&str]) {
    on_a_bed(label, mode, extra, run);
}

/// `rows` on a fresh bed with the agent in `mode` (and `extra` arguments).
fn on_a_bed(label: &str, mode: &str, extra: &[&str], rows: fn(&mut AgentBed, &str, &[&str]) -> Result<()>) {
    if !available(label, mode) {
        return;
    }
    let mut bed = AgentBed::new(label).unwrap_or_else(|e| panic!("{label}: test bed: {e:#}"));
    if let Err(e) = rows(&mut bed, mode, extra) {
        panic!("{label}: {e:#}\nagent log:\n{}", bed.log());
    }
}

fn run(bed: &mut AgentBed, mode: &str, extra: &[&str]) -> Result<()> {
    let _echoes: Vec<Server> = bed
        .topo
        .backends
        .iter()
        .map(|pod| Server::udp_echo(&pod.ns, ECHO_PORT))
        .collect::<Result<_>>()?;
    let mut objects = service_of(
        "UDP",
        "dgram",
        (ECHO_IP, ECHO_PORT, ECHO_PORT),
        ECHO_NODE_PORT,
        (LB_IPS[0], EXTERNAL_IPS[0]),
    )
    .to_vec();
    objects.extend(service_of(
        "UDP",
        "refusing",
        (REFUSING_IP, REFUSING_PORT, CLOSED_PORT),
        REFUSING_NODE_PORT,
        (LB_IPS[1], EXTERNAL_IPS[1]),
    ));
    bed.topo.route_to_node(&EXTERNAL_NETS)?;
    bed.write_manifest("traffic.yaml", &yaml_documents(&objects))?;
    let mut args = bed.manifest_args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args.extend(pod_networks());
    drop_invalid_forwarding(&bed.topo.node)?;
    bed.start_agent_in(mode, &args)?;
    bed.wait_first_sync(READY_WITHIN)?;

    let paths = [
        (
            "client pod -> ClusterIP",
            &bed.topo.client_pod.ns,
            ECHO_IP,
            ECHO_PORT,
            REFUSING_IP,
            REFUSING_PORT,
        ),
        (
            "client -> NodePort",
            &bed.topo.client,
            NODE_IP,
            ECHO_NODE_PORT,
            NODE_IP,
            REFUSING_NODE_PORT,
        ),
        (
            "client -> LoadBalancer IP",
            &bed.topo.client,
            LB_IPS[0],
            ECHO_PORT,
            LB_IPS[1],
            REFUSING_PORT,
        ),
        (
            "client pod -> external IP",
            &bed.topo.client_pod.ns,
            EXTERNAL_IPS[0],
            ECHO_PORT,
            EXTERNAL_IPS[1],
            REFUSING_PORT,
        ),
    ];
    for (path, ns, ip, port, refusing_ip, refusing_port) in paths {
        let to = SocketAddrV4::new(ip, port);
        let refusing = SocketAddrV4::new(refusing_ip, refusing_port);
        echoed_and_refused(path, ns, to.into(), refusing.into())?;
    }
    ensure!(bed.agent_alive().is_ok(), "the agent died");
    Ok(())
}

/// Datagrams of every size in [`SIZES`] from `ns` to `to` echoed intact,
/// and a request to `refusing` (whose backends do not listen) refused.
fn echoed_and_refused(path: &str, ns: &Netns, to: SocketAddr, refusing: SocketAddr) -> Result<()> {
    for len in SIZES {
        netns::wait_for(&format!("{path}: a {len}-byte datagram echoed"), READY_WITHIN, || {
            ns.run_in(|| echo_once(to, len))
                .map_err(|e| format!("{e:#}"))?
                .map_err(|e| e.to_string())
        })
        .with_context(|| format!("{path}, {len} bytes"))?;
        // Once programmed, every datagram makes it.
        for _ in 0..5 {
            ns.run_in(|| echo_once(to, len))?
                .with_context(|| format!("{path}: a {len}-byte datagram"))?;
        }
    }
    for _ in 0..3 {
        match ns.run_in(|| refusal(refusing))? {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            other => bail!("{path}: UDP to {refusing}, whose backends do not listen: {other:?}, not ECONNREFUSED"),
        }
    }
    Ok(())
}

/// The pod networks, as a real node's configuration names them: Service
/// flows to pods then take the ebpf mode's notrack path (fragments and
/// ICMP errors included), the path real nodes run. Every test here also
/// gives the node a firewall that drops invalid forwarded packets
/// (`drop_invalid_forwarding`), which loses any half-tracked flow.
fn pod_networks() -> [String; 2] {
    ["--cluster-cidr".to_owned(), format!("{POD_CIDR},{POD_CIDR6}")]
}

// ---------------------------------------------------------------------------
// IPv6.

const ECHO_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x70);
const REFUSING_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x71);

/// A dual-stack Service of `protocol` to `target_port` on every backend
/// pod, and its slices of both families.
fn dual_stack_service_of(
    protocol: Protocol,
    name: &str,
    (ip, ip6): (Ipv4Addr, Ipv6Addr),
    (port, target_port): (u16, u16),
    node_port: u16,
) -> [Value; 3] {
    let ports = [PortDef {
        name: None,
        protocol,
        port,
        target_port,
        node_port: Some(node_port),
    }];
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    [
        dual_stack(service_with(name, ip, &ports, None), ip6),
        slice_with(&format!("{name}-4"), name, &ports, &on_node(&backend_ips())),
        slice6_with(&format!("{name}-6"), name, &ports, &endpoints6),
    ]
}

fn traffic6(label: &str, mode: &str, extra: &[&str]) {
    on_a_bed(label, mode, extra, run6);
}

fn run6(bed: &mut AgentBed, mode: &str, extra: &[&str]) -> Result<()> {
    let _echoes: Vec<Server> = bed
        .topo
        .backends
        .iter()
        .map(|pod| Server::udp_echo(&pod.ns, ECHO_PORT))
        .collect::<Result<_>>()?;
    let mut objects = dual_stack_service_of(
        Protocol::Udp,
        "dgram",
        (ECHO_IP, ECHO_IP6),
        (ECHO_PORT, ECHO_PORT),
        ECHO_NODE_PORT,
    )
    .to_vec();
    objects.extend(dual_stack_service_of(
        Protocol::Udp,
        "refusing",
        (REFUSING_IP, REFUSING_IP6),
        (REFUSING_PORT, CLOSED_PORT),
        REFUSING_NODE_PORT,
    ));
    bed.write_manifest("traffic6.yaml", &yaml_documents(&objects))?;
    let mut args = bed.manifest_args();
    // Beside the IPv4 one the bed passes.
    args.extend(["--node-ip".to_owned(), NODE_IP6.to_string()]);
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args.extend(pod_networks());
    drop_invalid_forwarding(&bed.topo.node)?;
    bed.start_agent_in(mode, &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    let v6 = |ip, port| SocketAddr::from(SocketAddrV6::new(ip, port, 0, 0));
    let paths = [
        (
            "client pod -> IPv6 ClusterIP",
            &bed.topo.client_pod.ns,
            v6(ECHO_IP6, ECHO_PORT),
            v6(REFUSING_IP6, REFUSING_PORT),
        ),
        (
            "client -> IPv6 NodePort",
            &bed.topo.client,
            v6(NODE_IP6, ECHO_NODE_PORT),
            v6(NODE_IP6, REFUSING_NODE_PORT),
        ),
    ];
    for (path, ns, to, refusing) in paths {
        echoed_and_refused(path, ns, to, refusing)?;
    }
    ensure!(bed.agent_alive().is_ok(), "the agent died");
    Ok(())
}

#[test]
fn traffic6_ebpf() {
    traffic6("traffic6_ebpf", "ebpf", &[]);
}

#[test]
fn traffic6_ebpf_native_xdp() {
    traffic6("traffic6_ebpf_native_xdp", "ebpf", &["--xdp", "native"]);
}

#[test]
fn traffic6_iptables() {
    traffic6("traffic6_iptables", "iptables", &[]);
}

#[test]
fn traffic6_nftables() {
    traffic6("traffic6_nftables", "nftables", &[]);
}

// ---------------------------------------------------------------------------
// Path MTU discovery.

const BULK_NODE_PORT: u16 = 30799;
const BULK_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 72);
const BULK_BYTES: u64 = 16 << 20;
const NARROW_MTU: &str = "1400";
const BULK_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x72);

/// Two routers between the node and a far client, the link between them
/// narrow, both families (IPv6's minimum MTU, 1,280, is below the hop's).
/// Dropped in reverse order of creation (namespaces go with their
/// links).
struct FarClient {
    far: Netns,
    _r2: Netns,
    /// The router before the narrow hop: it sends the "too big" errors.
    r1: Netns,
}

impl FarClient {
    fn build(node: &Netns) -> Result<Self> {
        let (r1, r2, far) = (Netns::new("xr1")?, Netns::new("xr2")?, Netns::new("xfar")?);
        let node_if = testbed::privileged::unique_name("nr");
        netns::veth(node, &node_if, &r1, "rw0")?;
        netns::veth(&r1, "re0", &r2, "rw0")?;
        netns::veth(&r2, "re0", &far, "eth0")?;
        for (ns, dev) in [(&r1, "re0"), (&r2, "rw0")] {
            ns.ip(&["link", "set", "dev", dev, "mtu", NARROW_MTU])?;
        }
        for ns in [&r1, &r2] {
            ns.sysctl("net.ipv4.ip_forward", "1")?;
            ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
            testbed::topology::limit_no_icmp(ns)?;
        }
        for (ns, dev, ipv4, ipv6) in [
            (node, node_if.as_str(), "172.29.1.2/24", "fd00:29:1::2/64"),
            (&r1, "rw0", "172.29.1.1/24", "fd00:29:1::1/64"),
            (&r1, "re0", "172.29.2.1/24", "fd00:29:2::1/64"),
            (&r2, "rw0", "172.29.2.2/24", "fd00:29:2::2/64"),
            (&r2, "re0", "172.29.3.1/24", "fd00:29:3::1/64"),
            (&far, "eth0", "172.29.3.2/24", "fd00:29:3::2/64"),
        ] {
            ns.add_addr(dev, ipv4)?;
            ns.add_addr(dev, ipv6)?;
        }
        node.add_route(&["172.29.3.0/24", "via", "172.29.1.1", "dev", &node_if])?;
        node.add_route(&["fd00:29:3::/64", "via", "fd00:29:1::1", "dev", &node_if])?;
        for (route, via) in [("172.29.3.0/24", "172.29.2.2"), ("fd00:29:3::/64", "fd00:29:2::2")] {
            r1.add_route(&[route, "via", via])?;
        }
        for (ns, via) in [
            (&r1, ["172.29.1.2", "fd00:29:1::2"]),
            (&r2, ["172.29.2.1", "fd00:29:2::1"]),
            (&far, ["172.29.3.1", "fd00:29:3::1"]),
        ] {
            for gateway in via {
                ns.add_route(&["default", "via", gateway])?;
            }
        }
        Ok(Self { far, _r2: r2, r1 })
    }
}

/// Which family a path MTU test runs over.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    /// The dual-stack Service's IPv6 ClusterIP and the node's IPv6
    /// NodePort: the hop's packet too big (ICMPv6) must reach the backend.
    V6,
}

fn pmtud(label: &str, mode: &str, family: Family) {
    if !available(label, mode) {
        return;
    }
    let mut bed = AgentBed::new(label).unwrap_or_else(|e| panic!("{label}: test bed: {e:#}"));
    if let Err(e) = run_pmtud(&mut bed, mode, family) {
        panic!("{label}: {e:#}\nagent log:\n{}", bed.log());
    }
}

fn run_pmtud(bed: &mut AgentBed, mode: &str, family: Family) -> Result<()> {
    let _servers: Vec<Server> = bed
        .topo
        .backends
        .iter()
        .map(|pod| bulk::server(&pod.ns, bulk::BULK_PORT, pod.name))
        .collect::<Result<_>>()?;
    let far = FarClient::build(&bed.topo.node)?;
    let mut args = bed.manifest_args();
    let (objects, paths): (Vec<Value>, [(&str, SocketAddr); 2]) = match family {
        Family::V4 => (
            service_of(
                "TCP",
                "bulk",
                (BULK_IP, bulk::BULK_PORT, bulk::BULK_PORT),
                BULK_NODE_PORT,
                (Ipv4Addr::new(203, 0, 113, 72), Ipv4Addr::new(198, 51, 100, 72)),
            )
            .to_vec(),
            [
                ("NodePort", SocketAddrV4::new(NODE_IP, BULK_NODE_PORT).into()),
                ("ClusterIP", SocketAddrV4::new(BULK_IP, bulk::BULK_PORT).into()),
            ],
        ),
        Family::V6 => {
            // Beside the IPv4 one the bed passes.
            args.extend(["--node-ip".to_owned(), NODE_IP6.to_string()]);
            let objects = dual_stack_service_of(
                Protocol::Tcp,
                "bulk",
                (BULK_IP, BULK_IP6),
                (bulk::BULK_PORT, bulk::BULK_PORT),
                BULK_NODE_PORT,
            );
            (
                objects.to_vec(),
                [
                    ("IPv6 NodePort", SocketAddr::new(NODE_IP6.into(), BULK_NODE_PORT)),
                    ("IPv6 ClusterIP", SocketAddr::new(BULK_IP6.into(), bulk::BULK_PORT)),
                ],
            )
        }
    };
    bed.write_manifest("bulk.yaml", &yaml_documents(&objects))?;
    args.extend(pod_networks());
    drop_invalid_forwarding(&bed.topo.node)?;
    bed.start_agent_in(mode, &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    for (path, to) in paths {
        // Fresh connections: each backend learns the path MTU once (three
        // pods, so the first downloads find them all still ignorant).
        for round in 0..4 {
            for direction in Direction::BOTH {
                far.far
                    .run_in(|| bulk::transfer(to, direction, BULK_BYTES))?
                    .with_context(|| format!("far client -> {path} {to}, {direction} {round}"))?;
            }
        }
    }
    // Else the transfers proved nothing about the errors' translation.
    let sent = too_big_sent(&far.r1, family)?;
    ensure!(sent > 0, "the narrow hop's router sent no \"too big\" error");
    Ok(())
}

/// How many "too big" errors `router` sent: ICMPv6 packet too big, or (no
/// finer IPv4 counter) ICMP destination unreachable, frag-needed among them.
fn too_big_sent(router: &Netns, family: Family) -> Result<u64> {
    let (file, counter) = match family {
        Family::V4 => ("/proc/net/snmp", "OutDestUnreachs"),
        Family::V6 => ("/proc/net/snmp6", "Icmp6OutPktTooBigs"),
    };
    // `cat` in the namespace: a thread's /proc/net is its process's.
    let text = router.exec(&["cat", file])?;
    snmp_counter(&text, counter).with_context(|| format!("no {counter} in {file}"))
}

/// `counter` from /proc/net/snmp6 (`name value` lines) or /proc/net/snmp
/// (a line of names, then one of values, both led by `Icmp:`).
fn snmp_counter(text: &str, counter: &str) -> Option<u64> {
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    if let Some(line) = lines.iter().find(|l| l.first() == Some(&counter)) {
        return line.get(1)?.parse().ok();
    }
    let (names, values) = lines.windows(2).find_map(|pair| {
        let named = pair[0].first() == Some(&"Icmp:") && pair[1].first() == Some(&"Icmp:");
        named.then(|| (&pair[0], &pair[1]))
    })?;
    let at = names.iter().position(|name| *name == counter)?;
    values.get(at)?.parse().ok()
}

#[test]
fn pmtud_ebpf() {
    pmtud("pmtud_ebpf", "ebpf", Family::V4);
}

#[test]
fn pmtud6_ebpf() {
    pmtud("pmtud6_ebpf", "ebpf", Family::V6);
}

#[test]
fn pmtud_iptables() {
    pmtud("pmtud_iptables", "iptables", Family::V4);
}

#[test]
fn pmtud6_iptables() {
    pmtud("pmtud6_iptables", "iptables", Family::V6);
}

#[test]
fn pmtud_nftables() {
    pmtud("pmtud_nftables", "nftables", Family::V4);
}

#[test]
fn pmtud6_nftables() {
    pmtud("pmtud6_nftables", "nftables", Family::V6);
}

#[test]
fn pmtud_ipvs() {
    pmtud("pmtud_ipvs", "ipvs", Family::V4);
}

#[test]
fn pmtud6_ipvs() {
    pmtud("pmtud6_ipvs", "ipvs", Family::V6);
}

#[test]
fn traffic_ebpf() {
    traffic("traffic_ebpf", "ebpf", &[]);
}

#[test]
fn traffic_ebpf_native_xdp() {
    traffic("traffic_ebpf_native_xdp", "ebpf", &["--xdp", "native"]);
}

#[test]
fn traffic_iptables() {
    traffic("traffic_iptables", "iptables", &[]);
}

#[test]
fn traffic_nftables() {
    traffic("traffic_nftables", "nftables", &[]);
}

#[test]
fn traffic_ipvs() {
    traffic("traffic_ipvs", "ipvs", &[]);
}
