//! `xproxy status` in every kernel-rule mode: the mode's writer programs a
//! known set of Service ports in a fresh network namespace, connections
//! from the namespace itself go through the real kernel path (DNAT and
//! conntrack; the endpoints are behind a veth nothing answers on, so the flows stay
//! open, unanswered), and the status read-back must list exactly the
//! programmed frontends and backends with those flows counted on them.
//! The seed and the Service without endpoints are dual-stack: their IPv6
//! halves (`ip6tables-save`, `table ip6 xproxy`, IPv6 virtual servers,
//! the IPv6 conntrack table) are listed beside the IPv4 ones.
//!
//! | mode | read back from | flows from
//! |---|---|---
//! | iptables | `iptables-save` | the kernel's conntrack table
//! | nftables | `nft -j list table ip xproxy` | the kernel's conntrack table
//! | ipvs | IPVS over netlink, `ipset save` | IPVS's connection counters (`cargo xtask vm`)
//!
//! The ebpf mode's read-back is the pinned maps' snapshot: `ebpf_status`
//! runs the real agent on the one-node bed with the dual-stack seed and
//! reads `xproxy status` after traffic over both families. The userspace
//! mode's read-back (its portal rules) is checked through the real agent
//! by `modes.rs` (step 5), every mode there through `xproxy status`.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use proxy_userspace::{
    cmd::status::{
        self,
        table::{Table, any_address},
    },
    config::Mode,
    mode::{
        Dataplane,
        dual_stack::DualStack,
        iptables::{self, IptablesMode, NodePortDestinations, SystemIptables},
        ipvs::{IpvsMode, IpvsOptions, node_ips::NodePortAddresses, rules::RuleOptions as IpvsRuleOptions},
        nftables::{self, NftablesMode, SystemNft},
    },
    model::{Endpoint, IPV6_SUFFIX, IpFamily, Protocol, ServicePort},
};
use testbed::{
    agent_bed::{AgentBed, READY_WITHIN, frontends, seed_node_port},
    fixtures::{SEED_CLUSTER_IP, SEED_CLUSTER_IP6, seed_objects_dual_stack, seed_tcp_udp, yaml_documents},
    netns::Netns,
    privileged::{require_ipvs, require_root},
    probe::{self, expect_all_backends},
    topology::{self, BACKENDS, TARGET_PORT, pod_ipv6},
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);
const SEED_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
const DNS_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 89);
const SEED_NODE_PORT: u16 = 30791;
const EMPTY_NODE_PORT: u16 = 30792;
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 2);
const SEED_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x88);
const EMPTY_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x89);

fn pod(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 0, last)
}

fn pod6(last: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, last)
}

/// The seed Service (TCP, three endpoints, a NodePort) and a NodePort
/// Service without endpoints, both dual-stack, and DNS (UDP, one
/// endpoint, IPv4 only).
fn desired() -> BTreeMap<String, ServicePort> {
    let ports = [
        ServicePort {
            name: "default/nginx-service".into(),
            protocol: Protocol::Tcp,
            cluster_ip: SEED_IP.into(),
            port: 88,
            node_port: Some(SEED_NODE_PORT),
            endpoints: (11..=13).map(|i| Endpoint::ready(pod(i), 80)).collect(),
            ..ServicePort::default()
        },
        ServicePort {
            name: "kube-system/dns:dns".into(),
            protocol: Protocol::Udp,
            cluster_ip: DNS_IP.into(),
            port: 53,
            endpoints: vec![Endpoint::ready(pod(21), 5353)],
            ..ServicePort::default()
        },
        ServicePort {
            name: "default/empty-service:http".into(),
            protocol: Protocol::Tcp,
            cluster_ip: EMPTY_IP.into(),
            port: 89,
            node_port: Some(EMPTY_NODE_PORT),
            ..ServicePort::default()
        },
        ServicePort {
            name: format!("default/nginx-service{IPV6_SUFFIX}"),
            protocol: Protocol::Tcp,
            cluster_ip: SEED_IP6.into(),
            port: 88,
            node_port: Some(SEED_NODE_PORT),
            endpoints: (0x11..=0x13).map(|i| Endpoint::ready(pod6(i), 80)).collect(),
            ..ServicePort::default()
        },
        ServicePort {
            name: format!("default/empty-service:http{IPV6_SUFFIX}"),
            protocol: Protocol::Tcp,
            cluster_ip: EMPTY_IP6.into(),
            port: 89,
            node_port: Some(EMPTY_NODE_PORT),
            ..ServicePort::default()
        },
    ];
    ports.into_iter().map(|p| (p.name.clone(), p)).collect()
}

/// A node namespace whose default routes (both families) lead into a
/// veth whose peer has no address: translated packets leave and nothing
/// answers.
fn node() -> Netns {
    let ns = Netns::new("xst").expect("a namespace");
    let cidr = format!("{NODE_IP}/24");
    let cidr6 = format!("{NODE_IP6}/64");
    for args in [
        &["link", "add", "d0", "type", "veth", "peer", "name", "d1"][..],
        &["addr", "add", &cidr, "dev", "d0"],
        // No duplicate address detection: usable at once.
        &["-6", "addr", "add", &cidr6, "dev", "d0", "nodad"],
        &["link", "set", "d0", "up"],
        &["link", "set", "d1", "up"],
        &["route", "add", "default", "dev", "d0"],
        &["-6", "route", "add", "default", "dev", "d0"],
    ] {
        ns.ip(args).unwrap_or_else(|e| panic!("ip {args:?}: {e:#}"));
    }
    ns
}

fn apply(ns: &Netns, mode: &mut dyn Dataplane) {
    ns.run_in(|| mode.apply_full(&desired()))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("{}: full sync: {e:#}", mode.name()));
}

/// Opens flows from the node itself: `tcp` connections to each of
/// `tcp_to` (left half-open: the SYN goes unanswered) and `udp` datagrams
/// from as many sockets to DNS.
fn open_flows(ns: &Netns, tcp_to: &[(IpAddr, u16)], udp: usize) -> Vec<UdpSocket> {
    ns.run_in(|| {
        for &(ip, port) in tcp_to {
            let addr = SocketAddr::new(ip, port);
            // Times out: only the conntrack entry of its SYN matters.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(50));
        }
        (0..udp)
            .map(|_| {
                let socket = UdpSocket::bind("0.0.0.0:0").expect("a UDP socket");
                socket.send_to(b"query", (DNS_IP, 53)).expect("sending to DNS");
                socket
            })
            .collect()
    })
    .expect("entering the namespace")
}

fn read_back(ns: &Netns, mode: Mode) -> Table {
    ns.run_in(|| status::read_back(mode, std::path::Path::new("/nonexistent")))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("{mode:?}: status: {e:#}"))
        .table
}

/// `(frontend, backends)`: what the table must list, with
/// `node_port_addr` of a family standing for the mode's NodePort
/// frontends of that family.
fn expected(node_port_addr: impl Fn(IpFamily) -> IpAddr) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for port in desired().values() {
        let mut backends: Vec<String> = port
            .endpoints
            .iter()
            .map(|e| SocketAddr::new(e.addr, e.port).to_string())
            .collect();
        backends.sort();
        out.insert(
            format!(
                "{} {} ClusterIP",
                port.protocol,
                SocketAddr::new(port.cluster_ip, port.port)
            ),
            backends.clone(),
        );
        if let Some(node_port) = port.node_port {
            let addr = node_port_addr(IpFamily::of(port.cluster_ip));
            out.insert(
                format!("{} {} NodePort", port.protocol, SocketAddr::new(addr, node_port)),
                backends,
            );
        }
    }
    out
}

fn listed(table: &Table) -> BTreeMap<String, Vec<String>> {
    table
        .frontends
        .iter()
        .map(|f| {
            let mut backends: Vec<String> = f
                .backends
                .iter()
                .filter_map(|b| b.addr.map(|(a, p)| SocketAddr::new(a, p).to_string()))
                .collect();
            backends.sort();
            (
                format!("{} {} {}", f.proto, SocketAddr::new(f.addr, f.port), f.kind.name()),
                backends,
            )
        })
        .collect()
}

/// Flows summed over a frontend's backends.
fn flows(table: &Table, proto: Protocol, addr: impl Into<IpAddr>, port: u16) -> u64 {
    let addr = addr.into();
    let frontend = table
        .find(proto, addr, port)
        .unwrap_or_else(|| panic!("{proto} {addr}:{port} is not listed:\n{}", table.render()));
    frontend.backends.iter().map(|b| b.flows.unwrap_or_default()).sum()
}

/// The conntrack-counted modes: the table equals what was programmed,
/// and every flow opened is counted on its frontend.
fn rules_read_back(mode: Mode, dataplane: &mut dyn Dataplane) {
    let ns = node();
    apply(&ns, dataplane);
    let before = read_back(&ns, mode);
    assert_eq!(listed(&before), expected(any_address), "\n{}", before.render());
    assert_eq!(flows(&before, Protocol::Tcp, SEED_IP, 88), 0, "\n{}", before.render());
    assert_eq!(flows(&before, Protocol::Tcp, SEED_IP6, 88), 0, "\n{}", before.render());

    let _sockets = open_flows(&ns, &seed_connections(), 3);
    let after = read_back(&ns, mode);
    let text = after.render();
    assert_eq!(flows(&after, Protocol::Tcp, SEED_IP, 88), 2, "\n{text}");
    assert_eq!(
        flows(&after, Protocol::Tcp, Ipv4Addr::UNSPECIFIED, SEED_NODE_PORT),
        1,
        "\n{text}"
    );
    // The IPv6 half's flows are in the IPv6 conntrack table, each on its
    // own frontend (`::` for the NodePort, not `0.0.0.0`).
    assert_eq!(flows(&after, Protocol::Tcp, SEED_IP6, 88), 1, "\n{text}");
    assert_eq!(
        flows(&after, Protocol::Tcp, Ipv6Addr::UNSPECIFIED, SEED_NODE_PORT),
        2,
        "\n{text}"
    );
    let dns = after.find(Protocol::Udp, DNS_IP, 53).expect("DNS listed");
    assert_eq!(dns.backends[0].flows, Some(3), "\n{text}");
    let empty = after.find(Protocol::Tcp, EMPTY_IP, 89).expect("listed");
    assert!(empty.backends.is_empty() && !empty.local_only, "\n{text}");
    assert!(
        text.contains("TCP  10.96.0.89:89 ClusterIP (no endpoints: reject)"),
        "{text}"
    );
    assert!(
        text.contains("TCP  [fd00:96::89]:89 ClusterIP (no endpoints: reject)"),
        "{text}"
    );
    assert!(
        text.contains("TCP  [fd00:96::88]:88 ClusterIP [default/nginx-service]\n"),
        "{text}"
    );

    // A mode found by itself, as `xproxy status` without `--mode` does.
    let found = ns
        .run_in(|| status::detect(std::path::Path::new("/nonexistent")))
        .expect("entering the namespace")
        .expect("detecting the mode");
    assert_eq!(found, Some(mode));
}

/// TCP connections to open: the seed's ClusterIP twice and its NodePort
/// once over IPv4, its ClusterIP once and its NodePort twice over IPv6
/// (counts that differ per family, so one counted as the other shows).
fn seed_connections() -> Vec<(IpAddr, u16)> {
    vec![
        (SEED_IP.into(), 88),
        (SEED_IP.into(), 88),
        (NODE_IP.into(), SEED_NODE_PORT),
        (SEED_IP6.into(), 88),
        (NODE_IP6.into(), SEED_NODE_PORT),
        (NODE_IP6.into(), SEED_NODE_PORT),
    ]
}

/// The iptables mode's IPv6 half (ip6tables; NodePorts never on `::1`).
fn iptables_v6() -> Box<dyn Dataplane> {
    let opts = iptables::RuleOptions {
        family: IpFamily::V6,
        node_ports: NodePortDestinations::AllLocal { localhost: false },
        ..iptables::RuleOptions::default()
    };
    Box::new(IptablesMode::new(opts, Box::new(SystemIptables::ipv6())))
}

/// The nftables mode's IPv6 half (`table ip6 xproxy`).
fn nftables_v6() -> Box<dyn Dataplane> {
    let opts = nftables::Options {
        family: IpFamily::V6,
        ..nftables::Options::default()
    };
    Box::new(NftablesMode::new(opts, Box::new(SystemNft::default())))
}

#[test]
fn iptables_status() {
    if !require_root("iptables_status") {
        return;
    }
    let v4 = IptablesMode::new(iptables::RuleOptions::default(), Box::new(SystemIptables::default()));
    let mut mode = DualStack::new(vec![Box::new(v4), iptables_v6()]);
    rules_read_back(Mode::Iptables, &mut mode);
}

#[test]
fn nftables_status() {
    if !require_root("nftables_status") {
        return;
    }
    let v4 = NftablesMode::new(nftables::Options::default(), Box::new(SystemNft::default()));
    let mut mode = DualStack::new(vec![Box::new(v4), nftables_v6()]);
    rules_read_back(Mode::Nftables, &mut mode);
}

/// A node with IPv6 Services only: each rule mode is found by its IPv6
/// state alone (`ip6tables-save`, `table ip6 xproxy`), and lists exactly
/// the IPv6 frontends.
#[test]
fn ipv6_only_rules_are_found() {
    if !require_root("ipv6_only_rules_are_found") {
        return;
    }
    for (mode, half) in [(Mode::Iptables, iptables_v6()), (Mode::Nftables, nftables_v6())] {
        let ns = node();
        // DualStack hands the IPv6 half the IPv6 ports only.
        apply(&ns, &mut DualStack::new(vec![half]));
        let found = ns
            .run_in(|| status::detect(std::path::Path::new("/nonexistent")))
            .expect("entering the namespace")
            .expect("detecting the mode");
        assert_eq!(found, Some(mode));
        let table = read_back(&ns, mode);
        let mut ipv6 = expected(any_address);
        ipv6.retain(|frontend, _| frontend.contains('['));
        assert_eq!(listed(&table), ipv6, "{mode:?}:\n{}", table.render());
    }
}

/// IPVS counts its own connections; NodePorts are virtual servers on the
/// node IP. Runs where the kernel has IPVS (`cargo xtask vm --tests status`).
#[test]
fn ipvs_status() {
    if !require_ipvs("ipvs_status") {
        return;
    }
    let ns = node();
    let options = IpvsOptions {
        scheduler: "rr".into(),
        node_ports: NodePortAddresses::Fixed(vec![NODE_IP.into(), NODE_IP6.into()]),
        exclude_cidrs: Vec::new(),
        rules: IpvsRuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: None,
            local_traffic_v6: None,
        },
        timeouts: (900, 120, 300),
        strict_arp: true,
        node_name: None,
    };
    let mut mode = ns
        .run_in(|| IpvsMode::start(options))
        .expect("entering the namespace")
        .expect("starting the IPVS mode");
    apply(&ns, &mut mode);
    let before = read_back(&ns, Mode::Ipvs);
    let node_ip = |family| match family {
        IpFamily::V4 => IpAddr::from(NODE_IP),
        IpFamily::V6 => IpAddr::from(NODE_IP6),
    };
    assert_eq!(listed(&before), expected(node_ip), "\n{}", before.render());

    let _sockets = open_flows(&ns, &seed_connections(), 3);
    let after = read_back(&ns, Mode::Ipvs);
    let text = after.render();
    assert_eq!(flows(&after, Protocol::Tcp, SEED_IP, 88), 2, "\n{text}");
    assert_eq!(flows(&after, Protocol::Tcp, NODE_IP, SEED_NODE_PORT), 1, "\n{text}");
    assert_eq!(flows(&after, Protocol::Tcp, SEED_IP6, 88), 1, "\n{text}");
    assert_eq!(flows(&after, Protocol::Tcp, NODE_IP6, SEED_NODE_PORT), 2, "\n{text}");
    let seed6 = after.find(Protocol::Tcp, SEED_IP6, 88).expect("listed");
    assert_eq!(seed6.kind.name(), "ClusterIP", "\n{text}");
    let dns = after.find(Protocol::Udp, DNS_IP, 53).expect("DNS listed");
    assert_eq!(dns.backends[0].flows, Some(3), "\n{text}");
    let found = ns
        .run_in(|| status::detect(std::path::Path::new("/nonexistent")))
        .expect("entering the namespace")
        .expect("detecting the mode");
    assert_eq!(found, Some(Mode::Ipvs));
    let _ = ns.run_in(proxy_userspace::mode::ipvs::cleanup);
}

/// The backends of `frontend` (`PROTO ADDR:PORT`) in `xproxy status`
/// text, each with its flow count.
fn status_backends(status: &str, frontend: &str) -> Vec<(String, u64)> {
    let heading = |l: &str| l == frontend || l.starts_with(&format!("{frontend} "));
    let mut lines = status.lines().skip_while(|l| !heading(l));
    lines.next();
    lines
        .map_while(|l| l.strip_prefix("  -> "))
        .map(|row| {
            let mut words = row.split_whitespace();
            let addr = words.next().unwrap_or_default().to_owned();
            let flows = words.next().and_then(|n| n.parse().ok()).unwrap_or_else(|| {
                panic!("no flow count in {row:?}:\n{status}");
            });
            (addr, flows)
        })
        .collect()
}

/// The ebpf mode through the real agent with the dual-stack seed (TCP
/// and UDP): `xproxy status` lists the IPv6 ClusterIP and the NodePort
/// on the node's IPv6 address (`XP_SERVICES6`) beside the IPv4 ones, each
/// with the three pods' IPv6 addresses, and counts the flows the
/// programs tracked to them over IPv6.
#[test]
fn ebpf_status() {
    let test = "ebpf_status";
    if !require_root(test) {
        return;
    }
    let mut bed = AgentBed::new(test).expect("building the test bed");
    bed.write_manifest("seed.yaml", &yaml_documents(&seed_objects_dual_stack(&seed_tcp_udp())))
        .expect("writing the manifests");
    let mut args = bed.manifest_args();
    args.extend(["--node-ip".to_owned(), topology::NODE_IP6.to_string()]);
    bed.start_agent_in("ebpf", &args).expect("starting the agent");
    bed.wait_first_sync(READY_WITHIN).expect("the first sync");
    bed.wait_answering(seed_node_port(), READY_WITHIN)
        .expect("the seed answering");
    let cluster6 = SocketAddr::new(SEED_CLUSTER_IP6.into(), 88);
    expect_all_backends(&bed.topo.client_pod.ns, probe::Protocol::Tcp, cluster6)
        .unwrap_or_else(|e| panic!("TCP {cluster6}: {e:#}"));

    let status = bed.status().expect("xproxy status");
    assert!(status.starts_with("Mode: ebpf\n"), "{status}");
    let seen = frontends(&status);
    let node_port6 = SocketAddr::new(topology::NODE_IP6.into(), seed_node_port().port());
    for proto in ["TCP", "UDP"] {
        for (frontend, kind) in [
            (SocketAddr::new(SEED_CLUSTER_IP.into(), 88), "ClusterIP"),
            (cluster6, "ClusterIP"),
            (node_port6, "NodePort"),
        ] {
            let key = format!("{proto} {frontend}");
            assert_eq!(seen.get(&key), Some(&(kind.to_owned(), 3)), "{key}:\n{status}");
        }
    }
    let mut backends = status_backends(&status, &format!("TCP  {cluster6} ClusterIP"));
    backends.sort();
    let mut pods: Vec<String> = BACKENDS
        .iter()
        .map(|(_, ip)| SocketAddr::new(pod_ipv6(*ip).into(), TARGET_PORT).to_string())
        .collect();
    pods.sort();
    let addrs: Vec<&String> = backends.iter().map(|(a, _)| a).collect();
    assert_eq!(addrs, pods.iter().collect::<Vec<_>>(), "\n{status}");
    // Every pod answered a connection to the IPv6 ClusterIP: each has a
    // tracked flow (closed ones stay tracked until they time out).
    assert!(backends.iter().all(|(_, flows)| *flows > 0), "\n{status}");
}
