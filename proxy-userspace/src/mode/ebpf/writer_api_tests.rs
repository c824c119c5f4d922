//! The Service writer's part of issue 12 on maps in memory: external and
//! load balancer IP frontends, source range entries and ClientIP affinity
//! (flags, timeout, backend set members, entries forgotten), the Service
//! port entries of external frontends (affinity id, pods' short-circuit),
//! read back from the maps.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use proxy_common::{
    AffinityKey, AffinityValue, FrontendPort, MemberKey, ServiceValue, SourceRangeKey, proto,
    service::{FLAG_AFFINITY_CLIENT_IP, FLAG_EXTERNAL_ADDR, FLAG_EXTERNAL_LOCAL, FLAG_NODE_PORT, FLAG_SOURCE_RANGES},
};

use super::{LbMaps, MemoryMaps, ServiceMaps};
use crate::model::{Endpoint, ServicePort, SourceRange, TrafficPolicy};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const THIS_NODE: &str = "node-a";
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);

fn ep(last: u8, node: &str) -> Endpoint {
    Endpoint {
        node_name: Some(node.into()),
        ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 8080)
    }
}

/// A LoadBalancer Service port with an external IP, two endpoints (one on
/// this node) and the given source ranges.
fn lb_port(source_ranges: Vec<SourceRange>) -> ServicePort {
    ServicePort {
        name: "default/lb:http".into(),
        cluster_ip: CLUSTER_IP.into(),
        port: 80,
        node_port: Some(30080),
        endpoints: vec![ep(1, THIS_NODE), ep(2, "node-b")],
        external_ips: vec![EXTERNAL_IP.into()],
        load_balancer_ips: vec![LB_IP.into()],
        source_ranges,
        ..ServicePort::default()
    }
}

fn range(a: u8, b: u8, c: u8, d: u8, prefix_len: u8) -> SourceRange {
    SourceRange {
        addr: Ipv4Addr::new(a, b, c, d).into(),
        prefix_len,
    }
}

fn writer(maps: MemoryMaps) -> ServiceMaps<MemoryMaps> {
    let mut writer = ServiceMaps::on(maps, vec![NODE_IP.into()]).expect("the maps read back");
    writer.set_topology(Some(THIS_NODE.into()), false);
    writer
}

fn sync(w: &mut ServiceMaps<MemoryMaps>, port: &ServicePort) {
    w.sync_service(port).expect("sync");
}

fn frontend(w: &ServiceMaps<MemoryMaps>, addr: Ipv4Addr, port: u16) -> ServiceValue {
    w.frontend(addr, port, proto::TCP)
        .unwrap_or_else(|| panic!("no frontend {addr}:{port}"))
}

/// The source range entries in the maps, as (frontend id, network).
fn range_entries(w: &ServiceMaps<MemoryMaps>) -> BTreeSet<(u32, String)> {
    let keys = w.maps().source_range_keys().expect("source ranges");
    keys.iter()
        .map(|k: &SourceRangeKey| (k.rev_nat_id(), format!("{}/{}", k.addr(), k.range_len())))
        .collect()
}

fn set_of(entries: &[(u32, &str)]) -> BTreeSet<(u32, String)> {
    entries.iter().map(|(id, n)| (*id, (*n).to_owned())).collect()
}

#[test]
fn external_and_load_balancer_ips_are_external_frontends_on_the_service_port() {
    let mut w = writer(MemoryMaps::new());
    let mut port = lb_port(vec![]);
    sync(&mut w, &port);
    let cluster = frontend(&w, CLUSTER_IP, 80);
    for ip in [EXTERNAL_IP, LB_IP] {
        let value = frontend(&w, ip, 80);
        assert_eq!(value.flags, FLAG_EXTERNAL_ADDR, "{ip}");
        assert_eq!(value.backend_set, cluster.backend_set, "{ip} shares the port's set");
        assert_eq!(value.backend_count, 2);
        assert_eq!(
            w.frontend(ip, 30080, proto::TCP),
            None,
            "only the Service's port on {ip}"
        );
        assert_eq!(
            w.frontend(ip, 80, proto::UDP),
            None,
            "only the Service's protocol on {ip}"
        );
    }
    assert_eq!(frontend(&w, NODE_IP, 30080).flags, FLAG_NODE_PORT);

    // externalTrafficPolicy: Local reaches them as the node port.
    port.external_policy = TrafficPolicy::Local;
    sync(&mut w, &port);
    for (ip, p, kind) in [
        (EXTERNAL_IP, 80, FLAG_EXTERNAL_ADDR),
        (LB_IP, 80, FLAG_EXTERNAL_ADDR),
        (NODE_IP, 30080, FLAG_NODE_PORT),
    ] {
        let value = frontend(&w, ip, p);
        assert_eq!(value.flags, kind | FLAG_EXTERNAL_LOCAL, "{ip}:{p}");
        let backends = w.backend_set(&value).expect("backends");
        assert_eq!(
            backends.iter().map(proxy_common::Backend::addr).collect::<Vec<_>>(),
            [Ipv4Addr::new(10, 244, 0, 1)]
        );
    }
    assert_eq!(
        frontend(&w, CLUSTER_IP, 80).backend_count,
        2,
        "the ClusterIP is not external"
    );

    // An address taken out of the Service is no frontend any more.
    port.external_ips.clear();
    sync(&mut w, &port);
    assert_eq!(w.frontend(EXTERNAL_IP, 80, proto::TCP), None);

    // A restarted agent adopts every frontend: the same sync writes nothing.
    let mut again = writer(w.maps().clone());
    let before = again.writes();
    sync(&mut again, &port);
    assert_eq!(again.writes(), before);
    again.remove_port(&port).expect("remove");
    assert!(again.maps().services().expect("services").is_empty());
}

#[test]
fn source_ranges_restrict_the_load_balancer_ips_only() {
    let mut w = writer(MemoryMaps::new());
    let mut port = lb_port(vec![range(203, 0, 113, 0, 24), range(10, 0, 0, 0, 8)]);
    sync(&mut w, &port);
    let lb = frontend(&w, LB_IP, 80);
    assert_eq!(lb.flags, FLAG_EXTERNAL_ADDR | FLAG_SOURCE_RANGES);
    for (ip, p) in [(EXTERNAL_IP, 80), (NODE_IP, 30080), (CLUSTER_IP, 80)] {
        assert_eq!(
            frontend(&w, ip, p).flags & FLAG_SOURCE_RANGES,
            0,
            "{ip}:{p} is not filtered"
        );
    }
    let id = lb.rev_nat_id;
    assert_eq!(
        range_entries(&w),
        set_of(&[(id, "10.0.0.0/8"), (id, "203.0.113.0/24"), (id, "198.51.100.2/32")]),
        "the ranges and the LB IP itself, under the LB frontend's id"
    );

    // A changed list writes and deletes the difference only.
    port.source_ranges = vec![range(203, 0, 113, 0, 24), range(192, 168, 0, 0, 16)];
    let before = w.writes();
    sync(&mut w, &port);
    assert_eq!(w.writes() - before, 2, "one range written, one deleted");
    assert_eq!(
        range_entries(&w),
        set_of(&[(id, "192.168.0.0/16"), (id, "203.0.113.0/24"), (id, "198.51.100.2/32")])
    );

    // Adopted by a restarted agent; gone with the list, then the Service.
    let mut w = writer(w.maps().clone());
    let before = w.writes();
    sync(&mut w, &port);
    assert_eq!(w.writes(), before, "adopted as they are");
    port.source_ranges.clear();
    sync(&mut w, &port);
    assert_eq!(frontend(&w, LB_IP, 80).flags & FLAG_SOURCE_RANGES, 0);
    assert!(range_entries(&w).is_empty());
    port.source_ranges = vec![range(203, 0, 113, 0, 24)];
    sync(&mut w, &port);
    assert_eq!(range_entries(&w).len(), 2);
    w.retain(&[]).expect("retain nothing");
    assert!(range_entries(&w).is_empty());
}

/// The IPv6 source range entries in the maps, as (frontend id, network).
fn range6_entries(w: &ServiceMaps<MemoryMaps>) -> BTreeSet<(u32, String)> {
    let keys = w.maps().source_range6_keys().expect("IPv6 source ranges");
    keys.iter()
        .map(|k| (k.rev_nat_id(), format!("{}/{}", k.addr(), k.range_len())))
        .collect()
}

fn range6(text: &str) -> SourceRange {
    let (addr, len) = text.split_once('/').expect("a CIDR");
    SourceRange::new(addr.parse().expect("an address"), len.parse().expect("a length")).expect("a range")
}

/// The IPv6 half of [`lb_port`]: its ranges go to the IPv6 trie, under
/// its own LB frontend's id, and leave the IPv4 trie alone; a port
/// without ranges of its family is not filtered (the model keeps a
/// port's own family's ranges only, as kube-proxy).
#[test]
fn ipv6_source_ranges_go_to_the_ipv6_trie() {
    let lb6: Ipv6Addr = "2001:db8:78::5".parse().expect("address");
    let mut w = writer(MemoryMaps::new());
    let v4 = lb_port(vec![range(203, 0, 113, 0, 24)]);
    let mut v6 = ServicePort {
        name: "default/lb:http (IPv6)".into(),
        cluster_ip: Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 1).into(),
        endpoints: vec![Endpoint::ready(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 1), 8080)],
        external_ips: Vec::new(),
        load_balancer_ips: vec![lb6.into()],
        source_ranges: vec![range6("2001:db8:79::/64")],
        ..lb_port(Vec::new())
    };
    sync(&mut w, &v4);
    sync(&mut w, &v6);
    let lb = w.frontend(lb6, 80, proto::TCP).expect("the IPv6 LB frontend");
    assert_ne!(lb.flags & FLAG_SOURCE_RANGES, 0);
    let id = lb.rev_nat_id;
    assert_eq!(
        range6_entries(&w),
        set_of(&[(id, "2001:db8:79::/64"), (id, "2001:db8:78::5/128")])
    );
    let v4_id = frontend(&w, LB_IP, 80).rev_nat_id;
    assert_eq!(
        range_entries(&w),
        set_of(&[(v4_id, "203.0.113.0/24"), (v4_id, "198.51.100.2/32")])
    );

    // Adopted by a restarted agent as they are; gone with the list.
    let mut w = writer(w.maps().clone());
    let before = w.writes();
    sync(&mut w, &v4);
    sync(&mut w, &v6);
    assert_eq!(w.writes(), before, "adopted as they are");
    v6.source_ranges.clear();
    sync(&mut w, &v6);
    let lb = w.frontend(lb6, 80, proto::TCP).expect("the IPv6 LB frontend");
    assert_eq!(lb.flags & FLAG_SOURCE_RANGES, 0, "no range of its family: open");
    assert!(range6_entries(&w).is_empty());
    assert_eq!(range_entries(&w).len(), 2, "IPv4's stay");

    // Adopted again, then gone with the Services.
    v6.source_ranges = vec![range6("2001:db8:79::/64")];
    sync(&mut w, &v6);
    let mut w = writer(w.maps().clone());
    w.retain(&[]).expect("retain nothing");
    assert!(range6_entries(&w).is_empty() && range_entries(&w).is_empty());
}

/// A frontend's members, as (backend address, slot).
fn members(w: &ServiceMaps<MemoryMaps>, value: &ServiceValue) -> BTreeSet<(Ipv4Addr, u32)> {
    let maps = w.maps();
    (maps.members().into_iter())
        .filter(|(k, _)| k.backend_set == value.backend_set)
        .map(|(k, slot)| {
            let backend = maps.backend(k.backend_id).expect("read").expect("the member's backend");
            (backend.addr(), slot)
        })
        .collect()
}

fn client_entry(affinity_id: u32, last: u8) -> (AffinityKey, AffinityValue) {
    let key = AffinityKey {
        affinity_id,
        client_be: u32::from_ne_bytes([203, 0, 113, last]),
    };
    let value = AffinityValue {
        backend_id: 1,
        _pad: 0,
        last_seen_ns: 0,
    };
    (key, value)
}

#[test]
fn affinity_sets_flag_timeout_and_members_and_forgets_clients_when_off() {
    let mut w = writer(MemoryMaps::new());
    let mut port = ServicePort {
        affinity: Some(Duration::from_secs(30)),
        ..lb_port(vec![])
    };
    sync(&mut w, &port);
    for (ip, p) in [(CLUSTER_IP, 80), (NODE_IP, 30080), (LB_IP, 80), (EXTERNAL_IP, 80)] {
        let value = frontend(&w, ip, p);
        assert_ne!(value.flags & FLAG_AFFINITY_CLIENT_IP, 0, "{ip}:{p}");
        assert_eq!(value.affinity_timeout_s, 30, "{ip}:{p}");
    }
    let cluster = frontend(&w, CLUSTER_IP, 80);
    let slots: Vec<Ipv4Addr> = w
        .backend_set(&cluster)
        .expect("set")
        .iter()
        .map(proxy_common::Backend::addr)
        .collect();
    let want: BTreeSet<(Ipv4Addr, u32)> = slots.iter().copied().zip(0..).collect();
    assert_eq!(members(&w, &cluster), want, "every backend of the set, at its slot");

    // A backend leaves: the new set's members no longer name it.
    port.endpoints.pop();
    sync(&mut w, &port);
    let cluster = frontend(&w, CLUSTER_IP, 80);
    assert_eq!(members(&w, &cluster), [(Ipv4Addr::new(10, 244, 0, 1), 0)].into());
    assert_eq!(w.maps().members().len(), 1, "the old set's members went with it");

    // The programs remembered clients; switching affinity off forgets
    // them (and only them), and the members go.
    let lb = frontend(&w, LB_IP, 80);
    let other = client_entry(9999, 1);
    w.maps().remember_clients(&[
        client_entry(cluster.rev_nat_id, 1),
        client_entry(lb.rev_nat_id, 2),
        other,
    ]);
    port.affinity = None;
    sync(&mut w, &port);
    let cluster = frontend(&w, CLUSTER_IP, 80);
    assert_eq!(
        (cluster.flags & FLAG_AFFINITY_CLIENT_IP, cluster.affinity_timeout_s),
        (0, 0)
    );
    assert!(w.maps().members().is_empty());
    assert_eq!(w.maps().affinity_entries(), vec![other]);

    // On again: members back, a new timeout.
    port.affinity = Some(Duration::from_secs(10_800));
    sync(&mut w, &port);
    let cluster = frontend(&w, CLUSTER_IP, 80);
    assert_eq!(cluster.affinity_timeout_s, 10_800);
    assert_eq!(members(&w, &cluster).len(), 1);

    // Adopted with its members; removing the port forgets its clients.
    let mut w = writer(w.maps().clone());
    let before = w.writes();
    sync(&mut w, &port);
    assert_eq!(w.writes(), before, "adopted with its members");
    w.maps().remember_clients(&[client_entry(cluster.rev_nat_id, 3)]);
    w.remove_port(&port).expect("remove");
    assert!(w.maps().members().is_empty());
    assert_eq!(w.maps().affinity_entries(), vec![other]);
    let gone = MemberKey {
        backend_set: cluster.backend_set,
        backend_id: 1,
    };
    assert!(!w.maps().member_keys().expect("members").contains(&gone));
}

/// The Service port entries by frontend address, read back from the maps.
fn service_ports(w: &ServiceMaps<MemoryMaps>) -> BTreeMap<Ipv4Addr, FrontendPort> {
    let by_id: BTreeMap<u32, FrontendPort> = w.maps().service_ports().expect("service ports").into_iter().collect();
    (w.maps().services().expect("services").iter())
        .filter_map(|(key, value)| Some((key.addr(), *by_id.get(&value.rev_nat_id)?)))
        .collect()
}

#[test]
fn external_frontends_share_the_ports_affinity_id_and_cluster_run() {
    let mut w = writer(MemoryMaps::new());
    let mut port = lb_port(vec![]);
    sync(&mut w, &port);
    assert!(service_ports(&w).is_empty(), "Cluster policy, no affinity: no entry");

    // Affinity: every external frontend names the ClusterIP's id.
    port.affinity = Some(Duration::from_secs(30));
    sync(&mut w, &port);
    let cluster = frontend(&w, CLUSTER_IP, 80);
    let entries = service_ports(&w);
    assert_eq!(
        entries.keys().copied().collect::<BTreeSet<_>>(),
        [NODE_IP, EXTERNAL_IP, LB_IP].into(),
        "the external frontends, not the ClusterIP"
    );
    for (ip, entry) in &entries {
        assert_eq!(entry.affinity_id, cluster.rev_nat_id, "{ip}");
        assert!(!entry.short_circuits(), "{ip}: no Local policy");
    }

    // externalTrafficPolicy: Local: the Cluster run of the same set, seen
    // as the ClusterIP is (no Local, no external flag).
    port.external_policy = TrafficPolicy::Local;
    sync(&mut w, &port);
    let cluster = frontend(&w, CLUSTER_IP, 80);
    for (ip, entry) in service_ports(&w) {
        let local = w
            .frontend(ip, if ip == NODE_IP { 30080 } else { 80 }, proto::TCP)
            .expect("frontend");
        assert_eq!(local.backend_count, 1, "{ip}: this node's endpoint only");
        let short = entry.cluster;
        assert!(entry.short_circuits(), "{ip}");
        assert_eq!(short.backend_set, local.backend_set, "{ip}: the frontend's own set");
        assert_eq!(
            short.rev_nat_id, local.rev_nat_id,
            "{ip}: its flows count under the frontend"
        );
        assert_eq!(short.flags, FLAG_AFFINITY_CLIENT_IP, "{ip}: only affinity is left");
        assert_eq!(short.affinity_timeout_s, 30);
        let every: BTreeSet<Ipv4Addr> = (w.backend_set(&short).expect("backends").iter())
            .map(proxy_common::Backend::addr)
            .collect();
        assert_eq!(
            every,
            [Ipv4Addr::new(10, 244, 0, 1), Ipv4Addr::new(10, 244, 0, 2)].into(),
            "{ip}"
        );
        assert_eq!(entry.affinity_id, cluster.rev_nat_id);
    }

    // Adopted as written; affinity off keeps the short-circuit only.
    let mut w = writer(w.maps().clone());
    let before = w.writes();
    sync(&mut w, &port);
    assert_eq!(w.writes(), before, "adopted with its Service port entries");
    port.affinity = None;
    sync(&mut w, &port);
    assert!(
        service_ports(&w)
            .values()
            .all(|e| e.affinity_id == 0 && e.short_circuits())
    );

    // Removing the external IP, then the port, deletes their entries.
    port.external_ips.clear();
    sync(&mut w, &port);
    assert_eq!(service_ports(&w).len(), 2, "the node port and the LB IP");
    w.remove_port(&port).expect("remove");
    assert!(w.maps().service_ports().expect("service ports").is_empty());
}

#[test]
fn service_port_entries_no_frontend_uses_are_deleted_at_the_full_sync() {
    let ids_in = |maps: &MemoryMaps| -> BTreeSet<u32> {
        let entries = maps.service_ports().expect("entries");
        entries.iter().map(|(id, _)| *id).collect()
    };
    let maps = MemoryMaps::new();
    let mut w = writer(maps.clone());
    let port = ServicePort {
        affinity: Some(Duration::from_secs(30)),
        ..lb_port(vec![])
    };
    sync(&mut w, &port);
    let ids = ids_in(&maps);
    w.remove_port(&port).expect("remove");
    // An agent that died halfway left an entry under an id no frontend has.
    maps.leave_service_ports(&[(7777, bytemuck::Zeroable::zeroed())]);
    let mut again = writer(maps.clone());
    assert!(ids_in(&maps).contains(&7777), "kept until the full sync");
    again.retain(&[&port]).expect("full sync");
    sync(&mut again, &port);
    let now = ids_in(&maps);
    assert!(!now.contains(&7777), "the leftover went");
    assert_eq!(now.len(), ids.len(), "the port's own are back");
}

#[test]
fn a_node_port_among_the_masquerade_ports_is_named() {
    let mut port = lb_port(vec![]);
    let snat_ports = super::snat::ports_outside(&(30000..=32767));
    port.node_port = Some(30080);
    assert_eq!(super::node_port_among_snat_ports(&port, &snat_ports), None);
    port.node_port = Some(40080);
    let reason = super::node_port_among_snat_ports(&port, &snat_ports).expect("40080 is masqueraded to");
    assert!(reason.contains("--node-port-range"), "{reason}");
    port.node_port = None;
    assert_eq!(super::node_port_among_snat_ports(&port, &snat_ports), None);
}

/// SCTP is translated only where no port changes (its CRC32c covers the
/// ports), in either family; TCP and UDP always.
#[test]
fn sctp_ports_are_translated_only_where_the_port_stays() {
    use crate::model::Protocol;
    let same = ServicePort {
        protocol: Protocol::Sctp,
        port: 8080,
        node_port: None,
        ..lb_port(vec![])
    };
    assert!(super::programs_translate(&same), "every endpoint on 8080");
    let ipv6 = ServicePort {
        cluster_ip: "fd00:96::1".parse::<std::net::IpAddr>().expect("ip"),
        ..same.clone()
    };
    assert!(
        super::programs_translate(&ipv6),
        "the IPv6 path rewrites the address as IPv4's"
    );
    let empty = ServicePort {
        endpoints: vec![],
        ..same.clone()
    };
    assert!(super::programs_translate(&empty), "rejected, not translated");
    let target = ServicePort {
        port: 80,
        ..same.clone()
    };
    assert!(!super::programs_translate(&target), "80 -> 8080");
    let node_port = ServicePort {
        node_port: Some(30080),
        ..same.clone()
    };
    assert!(!super::programs_translate(&node_port), "30080 -> 8080");
    for protocol in [Protocol::Tcp, Protocol::Udp] {
        assert!(super::programs_translate(&ServicePort {
            protocol,
            ..target.clone()
        }));
    }
}

#[test]
fn node_ports_answer_on_every_local_address_or_those_in_node_port_addresses() {
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    let local = [
        ip("10.0.0.2"),
        ip("127.0.0.1"),
        ip("10.244.1.1"),
        ip("192.168.5.5"),
        ip("10.0.0.2"),
        ip("::1"),
        ip("fe80::1"),
        ip("fd00:30::2"),
    ];
    assert_eq!(
        super::node_port_ips(local, None),
        [ip("10.0.0.2"), ip("10.244.1.1"), ip("192.168.5.5"), ip("fd00:30::2")],
        "every address but loopback and IPv6 link-local, once each"
    );
    let cidrs = [
        "10.0.0.0/24".parse().expect("cidr"),
        "127.0.0.0/8".parse().expect("cidr"),
        "fe80::/10".parse().expect("cidr"),
        "fd00:30::/64".parse().expect("cidr"),
    ];
    assert_eq!(
        super::node_port_ips(local, Some(&cidrs)),
        [ip("10.0.0.2"), ip("127.0.0.1"), ip("fd00:30::2")],
        "only those inside the CIDRs, never a link-local one"
    );
}
