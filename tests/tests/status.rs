//! `xproxy status` in every kernel-rule mode: the mode's writer programs a
//! known set of Service ports in a fresh network namespace, connections
//! from the namespace itself go through the real kernel path (DNAT and
//! conntrack; the endpoints are behind a veth nothing answers on, so the flows stay
//! open, unanswered), and the status read-back must list exactly the
//! programmed frontends and backends with those flows counted on them.
//!
//! | mode | read back from | flows from
//! |---|---|---
//! | iptables | `iptables-save` | the kernel's conntrack table
//! | nftables | `nft -j list table ip xproxy` | the kernel's conntrack table
//! | ipvs | IPVS over netlink, `ipset save` | IPVS's connection counters (`cargo xtask vm`)
//!
//! The ebpf mode's read-back is the pinned maps' snapshot, and the
//! userspace mode's its portal rules: both are checked through the real
//! agent by `modes.rs` (step 5), every mode there through `xproxy status`.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    time::Duration,
};

use proxy_userspace::{
    cmd::status::{self, table::Table},
    config::Mode,
    mode::{
        Dataplane,
        iptables::{self, IptablesMode, SystemIptables},
        ipvs::{IpvsMode, IpvsOptions, node_ips::NodePortAddresses, rules::RuleOptions as IpvsRuleOptions},
        nftables::{NftablesMode, SystemNft},
    },
    model::{Endpoint, Protocol, ServicePort},
};
use testbed::{
    netns::Netns,
    privileged::{require_ipvs, require_root},
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);
const SEED_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
const DNS_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 89);
const SEED_NODE_PORT: u16 = 30791;
const EMPTY_NODE_PORT: u16 = 30792;

fn pod(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 0, last)
}

/// The seed Service (TCP, three endpoints, a NodePort), DNS (UDP, one
/// endpoint) and a NodePort Service without endpoints.
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
    ];
    ports.into_iter().map(|p| (p.name.clone(), p)).collect()
}

/// A node namespace whose default route leads into a veth whose peer has
/// no address: translated packets leave and nothing answers.
fn node() -> Netns {
    let ns = Netns::new("xst").expect("a namespace");
    let cidr = format!("{NODE_IP}/24");
    for args in [
        &["link", "add", "d0", "type", "veth", "peer", "name", "d1"][..],
        &["addr", "add", &cidr, "dev", "d0"],
        &["link", "set", "d0", "up"],
        &["link", "set", "d1", "up"],
        &["route", "add", "default", "dev", "d0"],
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
fn open_flows(ns: &Netns, tcp_to: &[(Ipv4Addr, u16)], udp: usize) -> Vec<UdpSocket> {
    ns.run_in(|| {
        for &(ip, port) in tcp_to {
            let addr = SocketAddr::V4(SocketAddrV4::new(ip, port));
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

/// `(frontend, backends)`: what the table must list, with `node_port_addr`
/// standing for the mode's NodePort frontends.
fn expected(node_port_addr: Ipv4Addr) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for port in desired().values() {
        let backends: Vec<String> = port
            .endpoints
            .iter()
            .map(|e| format!("{}:{}", e.addr, e.port))
            .collect();
        out.insert(
            format!("{} {}:{} ClusterIP", port.protocol, port.cluster_ip, port.port),
            backends.clone(),
        );
        if let Some(node_port) = port.node_port {
            out.insert(
                format!("{} {node_port_addr}:{node_port} NodePort", port.protocol),
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
                .filter_map(|b| b.addr.map(|(a, p)| format!("{a}:{p}")))
                .collect();
            backends.sort();
            (format!("{} {}:{} {}", f.proto, f.addr, f.port, f.kind.name()), backends)
        })
        .collect()
}

/// Flows summed over a frontend's backends.
fn flows(table: &Table, proto: Protocol, addr: Ipv4Addr, port: u16) -> u64 {
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
    assert_eq!(
        listed(&before),
        expected(Ipv4Addr::UNSPECIFIED),
        "\n{}",
        before.render()
    );
    assert_eq!(flows(&before, Protocol::Tcp, SEED_IP, 88), 0, "\n{}", before.render());

    let _sockets = open_flows(&ns, &[(SEED_IP, 88), (SEED_IP, 88), (NODE_IP, SEED_NODE_PORT)], 3);
    let after = read_back(&ns, mode);
    let text = after.render();
    assert_eq!(flows(&after, Protocol::Tcp, SEED_IP, 88), 2, "\n{text}");
    assert_eq!(
        flows(&after, Protocol::Tcp, Ipv4Addr::UNSPECIFIED, SEED_NODE_PORT),
        1,
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

    // A mode found by itself, as `xproxy status` without `--mode` does.
    let found = ns
        .run_in(|| status::detect(std::path::Path::new("/nonexistent")))
        .expect("entering the namespace")
        .expect("detecting the mode");
    assert_eq!(found, Some(mode));
}

#[test]
fn iptables_status() {
    if !require_root("iptables_status") {
        return;
    }
    let mut mode = IptablesMode::new(iptables::RuleOptions::default(), Box::new(SystemIptables::default()));
    rules_read_back(Mode::Iptables, &mut mode);
}

#[test]
fn nftables_status() {
    if !require_root("nftables_status") {
        return;
    }
    let mut mode = NftablesMode::new(
        proxy_userspace::mode::nftables::Options::default(),
        Box::new(SystemNft::default()),
    );
    rules_read_back(Mode::Nftables, &mut mode);
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
        node_ports: NodePortAddresses::Fixed(vec![NODE_IP.into()]),
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
    assert_eq!(listed(&before), expected(NODE_IP), "\n{}", before.render());

    let _sockets = open_flows(&ns, &[(SEED_IP, 88), (SEED_IP, 88), (NODE_IP, SEED_NODE_PORT)], 3);
    let after = read_back(&ns, Mode::Ipvs);
    let text = after.render();
    assert_eq!(flows(&after, Protocol::Tcp, SEED_IP, 88), 2, "\n{text}");
    assert_eq!(flows(&after, Protocol::Tcp, NODE_IP, SEED_NODE_PORT), 1, "\n{text}");
    let dns = after.find(Protocol::Udp, DNS_IP, 53).expect("DNS listed");
    assert_eq!(dns.backends[0].flows, Some(3), "\n{text}");
    let found = ns
        .run_in(|| status::detect(std::path::Path::new("/nonexistent")))
        .expect("entering the namespace")
        .expect("detecting the mode");
    assert_eq!(found, Some(Mode::Ipvs));
    let _ = ns.run_in(proxy_userspace::mode::ipvs::cleanup);
}
