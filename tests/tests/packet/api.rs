//! Issue 12 in the data path, frame by frame: external and load balancer
//! IPs as frontends (other ports untouched, `externalTrafficPolicy: Local`,
//! pods' traffic to it short-circuited to every endpoint),
//! loadBalancerSourceRanges, and ClientIP session affinity (kept per
//! Service port across its frontends, a hit, expiry, a backend that
//! leaves, switching it off and on).

use std::{collections::BTreeSet, net::Ipv4Addr, time::Duration};

use aya::maps::{HashMap, Map, MapData};
use proxy_common::{AffinityKey, AffinityValue, maps};
use proxy_userspace::{mode::ebpf::pod_cidrs, model::SourceRange};

use super::*;

/// An external IP and a load balancer IP of the seed Service.
const EXTERNAL_ADDR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
/// A client outside `ALLOWED`.
const OUTSIDER_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 99);

/// The seed Service's TCP port as a LoadBalancer Service: node port, an
/// external IP, a load balancer IP.
fn lb_service(endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: LOCAL_TCP.into(),
        protocol: Protocol::Tcp,
        cluster_ip: CLUSTER_IP.into(),
        port: SERVICE_PORT,
        node_port: Some(NODE_PORT),
        endpoints,
        external_ips: vec![EXTERNAL_ADDR.into()],
        load_balancer_ips: vec![LB_IP.into()],
        ..ServicePort::default()
    }
}

fn seed_endpoints() -> Vec<Endpoint> {
    BACKEND_IPS
        .iter()
        .map(|ip| Endpoint::ready(*ip, BACKEND_PORT))
        .collect()
}

fn from(ip: Ipv4Addr, h: &mut Harness) -> SocketAddrV4 {
    SocketAddrV4::new(ip, h.next_port())
}

fn syn_case(desc: &str, src: SocketAddrV4, dst: SocketAddrV4, backends: &[SocketAddrV4]) -> Case {
    Case::dnat(desc, Frame::tcp(src, dst, SYN), backends, Verdict::DnatNew)
}

#[test]
fn external_and_load_balancer_ips_are_translated_on_the_service_port_only() {
    if !require_root("external_and_load_balancer_ips_are_translated_on_the_service_port_only") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    h.sync(&lb_service(seed_endpoints()));
    let backends = seed_backends();
    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        for ip in [EXTERNAL_ADDR, LB_IP] {
            let to = addr(ip, SERVICE_PORT);
            let src = external(&mut h);
            run_case(&mut h, prog, &syn_case("from outside", src, to, &backends));
            let src = client(&mut h);
            run_case(&mut h, prog, &syn_case("from a pod", src, to, &backends));
            // Not the Service's port, not its protocol, not its node port.
            for (desc, frame) in [
                (
                    "another port",
                    Frame::tcp(external(&mut h), addr(ip, SERVICE_PORT + 1), SYN),
                ),
                ("the node port", Frame::tcp(external(&mut h), addr(ip, NODE_PORT), SYN)),
                ("UDP", Frame::udp(external(&mut h), to, b"q")),
            ] {
                run_case(&mut h, prog, &Case::pass(desc, &frame, Verdict::PassNotService));
            }
        }
    }
    // A reply from the backend is rewritten back to the address the
    // client used.
    let src = external(&mut h);
    let out = run_case(
        &mut h,
        Prog::TcIngress,
        &syn_case("new", src, addr(LB_IP, SERVICE_PORT), &backends),
    );
    let backend = dnat_dst(&out);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("reply", Frame::tcp(backend, src, SYN | ACK), addr(LB_IP, SERVICE_PORT)),
    );
}

#[test]
fn external_local_applies_to_load_balancer_and_external_ips() {
    if !require_root("external_local_applies_to_load_balancer_and_external_ips") {
        return;
    }
    let mut h = Harness::with_snat_mark(vec![NODE_IP], 0x4000);
    h.maps.set_topology(Some(THIS_NODE.into()), false);
    let mut svc = ServicePort {
        external_policy: TrafficPolicy::Local,
        ..lb_service(backends_on([OTHER_NODE, THIS_NODE, OTHER_NODE]))
    };
    h.sync(&svc);
    let local = addr(BACKEND_IPS[1], BACKEND_PORT);
    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        for ip in [EXTERNAL_ADDR, LB_IP] {
            let to = addr(ip, SERVICE_PORT);
            for _ in 0..12 {
                let src = external(&mut h);
                run_case(&mut h, prog, &syn_case("to this node's backend", src, to, &[local]));
            }
        }
    }
    assert!(
        h.conntrack().iter().all(|(_, v)| v.flags & FLAG_SNAT == 0),
        "the client's address is kept"
    );
    // The ClusterIP is not external: every backend.
    let seen = reached_from(&mut h, Prog::TcIngress, CLIENT_IP, cluster_ip(), &seed_backends(), 30);
    assert!(seen.len() > 1, "{seen:?}");

    // No backend on this node: dropped, not rejected.
    svc.endpoints = backends_on([OTHER_NODE; 3]);
    h.sync(&svc);
    for prog in Prog::ALL {
        let frame = Frame::tcp(external(&mut h), addr(LB_IP, SERVICE_PORT), SYN);
        run_case(
            &mut h,
            prog,
            &Case::drop("no local backend", &frame, Verdict::DropNoLocalBackend),
        );
    }
}

/// The pod network [`CLIENT_IP`] is in, as `clusterCIDR` gives it.
pub(crate) const POD_CIDR: &str = "10.244.0.0/16";

/// Writes the pod networks the agent writes from `clusterCIDR`.
pub(crate) fn set_pod_cidrs(h: &Harness, cidrs: &[&str]) {
    let cidrs: Vec<_> = cidrs.iter().map(|c| c.parse().expect("a CIDR")).collect();
    pod_cidrs::write(h.pin_dir(), &pod_cidrs::trie_entries(&cidrs)).expect("the pod networks written");
}

/// A data path with the SNAT fallback on, on node [`THIS_NODE`], with
/// `svc` programmed as `externalTrafficPolicy: Local`; returns that too.
pub(crate) fn external_local_on_this_node(svc: ServicePort) -> (Harness, ServicePort) {
    let mut h = Harness::with_snat_mark(vec![NODE_IP], 0x4000);
    h.maps.set_topology(Some(THIS_NODE.into()), false);
    let svc = ServicePort {
        external_policy: TrafficPolicy::Local,
        ..svc
    };
    h.sync(&svc);
    (h, svc)
}

/// How flows from `client_ip` to `to` end: the backends reached (30 new
/// flows) and whether any was marked for SNAT.
fn outcome_from(h: &mut Harness, prog: Prog, client_ip: Ipv4Addr, to: SocketAddrV4) -> (BTreeSet<SocketAddrV4>, bool) {
    let seen = reached_from(h, prog, client_ip, to, &seed_backends(), 30);
    let snat = (h.conntrack().iter())
        .any(|(k, v)| k.saddr() == client_ip && k.daddr() == *to.ip() && v.flags & FLAG_SNAT != 0);
    (seen, snat)
}

#[test]
fn pods_reach_every_endpoint_of_a_local_external_frontend() {
    if !require_root("pods_reach_every_endpoint_of_a_local_external_frontend") {
        return;
    }
    let (mut h, svc) = external_local_on_this_node(lb_service(backends_on([OTHER_NODE, THIS_NODE, OTHER_NODE])));
    let local: BTreeSet<SocketAddrV4> = [addr(BACKEND_IPS[1], BACKEND_PORT)].into();
    let every: BTreeSet<SocketAddrV4> = seed_backends().into_iter().collect();
    let frontends = [
        addr(EXTERNAL_ADDR, SERVICE_PORT),
        addr(LB_IP, SERVICE_PORT),
        node_port(),
    ];

    // Without clusterCIDR pods cannot be told apart: as kube-proxy then,
    // they are external clients.
    for to in frontends {
        let (seen, _) = outcome_from(&mut h, Prog::TcIngress, CLIENT_IP, to);
        assert_eq!(seen, local, "no pod CIDR: a pod to {to}");
    }

    set_pod_cidrs(&h, &[POD_CIDR, "fd00:10:244::/56"]);
    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        for to in frontends {
            let (seen, snat) = outcome_from(&mut h, prog, CLIENT_IP, to);
            assert_eq!(seen, every, "{}: a pod to {to} reaches every endpoint", prog.name());
            assert!(
                !snat,
                "{}: a pod's flow to {to} keeps its source, as kube-proxy's",
                prog.name()
            );
            let (seen, snat) = outcome_from(&mut h, prog, EXTERNAL_IP, to);
            assert_eq!(
                seen,
                local,
                "{}: the outside to {to}: this node's endpoint only",
                prog.name()
            );
            assert!(!snat, "{}: Local keeps the outside client's address", prog.name());
        }
    }
    // A pod's flow counts under the frontend it used (xproxy status).
    let lb = h.maps.frontend(LB_IP, SERVICE_PORT, proto::TCP).expect("frontend");
    assert!(
        (h.conntrack().iter())
            .any(|(k, v)| k.saddr() == CLIENT_IP && k.daddr() == LB_IP && v.rev_nat_id == lb.rev_nat_id)
    );

    // The policy back to Cluster: nothing is short-circuited any more, a
    // pod's flow to another node's backend is masqueraded like everyone's.
    h.sync(&ServicePort {
        external_policy: TrafficPolicy::Cluster,
        ..svc.clone()
    });
    for to in frontends {
        let (seen, snat) = outcome_from(&mut h, Prog::TcIngress, CLIENT_IP, to);
        assert_eq!(seen, every, "Cluster: a pod to {to}");
        assert!(
            snat,
            "Cluster: external traffic to other nodes' backends is masqueraded"
        );
    }

    // No endpoint on this node: the outside is dropped, pods still served.
    h.sync(&ServicePort {
        endpoints: backends_on([OTHER_NODE; 3]),
        ..svc
    });
    let to = addr(LB_IP, SERVICE_PORT);
    let frame = Frame::tcp(external(&mut h), to, SYN);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::drop("the outside", &frame, Verdict::DropNoLocalBackend),
    );
    let (seen, _) = outcome_from(&mut h, Prog::TcIngress, CLIENT_IP, to);
    assert_eq!(seen, every, "a pod, with no endpoint on this node");
}

#[test]
fn source_ranges_drop_outsiders_on_load_balancer_ips_only() {
    if !require_root("source_ranges_drop_outsiders_on_load_balancer_ips_only") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    // The outside client's /24 (with the spaces-free form the model keeps).
    let allowed = SourceRange {
        addr: Ipv4Addr::new(203, 0, 113, 0).into(),
        prefix_len: 24,
    };
    let mut svc = ServicePort {
        source_ranges: vec![allowed],
        ..lb_service(seed_endpoints())
    };
    h.sync(&svc);
    let backends = seed_backends();
    let lb = addr(LB_IP, SERVICE_PORT);
    for prog in Prog::ALL {
        let src = external(&mut h);
        run_case(&mut h, prog, &syn_case("inside the range", src, lb, &backends));
        let src = from(LB_IP, &mut h);
        run_case(&mut h, prog, &syn_case("from the LB IP itself", src, lb, &backends));
        let frame = Frame::tcp(from(OUTSIDER_IP, &mut h), lb, SYN);
        run_case(
            &mut h,
            prog,
            &Case::drop("outside every range", &frame, Verdict::DropSourceRange),
        );
        let frame = Frame::tcp(client(&mut h), lb, SYN);
        run_case(
            &mut h,
            prog,
            &Case::drop("a pod outside the ranges", &frame, Verdict::DropSourceRange),
        );
        // Not filtered: the external IP, the node port, the ClusterIP.
        for to in [addr(EXTERNAL_ADDR, SERVICE_PORT), node_port(), cluster_ip()] {
            let src = from(OUTSIDER_IP, &mut h);
            run_case(&mut h, prog, &syn_case("unfiltered frontend", src, to, &backends));
        }
    }
    assert!(
        !h.conntrack()
            .iter()
            .any(|(k, _)| k.saddr() == OUTSIDER_IP && k.daddr() == LB_IP),
        "a dropped flow is not tracked"
    );

    // The list changes: the outsider's network is in, the old one out.
    svc.source_ranges = vec![SourceRange {
        addr: Ipv4Addr::new(192, 0, 2, 0).into(),
        prefix_len: 24,
    }];
    h.sync(&svc);
    let src = from(OUTSIDER_IP, &mut h);
    run_case(&mut h, Prog::XdpUplink, &syn_case("now inside", src, lb, &backends));
    let frame = Frame::tcp(external(&mut h), lb, SYN);
    run_case(
        &mut h,
        Prog::XdpUplink,
        &Case::drop("now outside", &frame, Verdict::DropSourceRange),
    );
    // No ranges: everyone.
    svc.source_ranges.clear();
    h.sync(&svc);
    let src = external(&mut h);
    run_case(&mut h, Prog::XdpUplink, &syn_case("no ranges", src, lb, &backends));
}

/// The pinned affinity map of the harness.
fn affinity_map(h: &Harness) -> HashMap<MapData, AffinityKey, AffinityValue> {
    let path = h.pin_dir().join(maps::AFFINITY);
    let data = MapData::from_pin(&path).expect("the affinity map is pinned");
    HashMap::try_from(Map::from_map_data(data).expect("a map")).expect("the affinity map's layout")
}

fn affinity_entries(h: &Harness) -> Vec<(AffinityKey, AffinityValue)> {
    affinity_map(h).iter().map(|e| e.expect("reading affinity")).collect()
}

/// The backends new flows from `client_ip` to `to` reached, `count` of
/// them, each DNATed to one of `allowed`.
fn reached_from(
    h: &mut Harness,
    prog: Prog,
    client_ip: Ipv4Addr,
    to: SocketAddrV4,
    allowed: &[SocketAddrV4],
    count: usize,
) -> BTreeSet<SocketAddrV4> {
    (0..count)
        .map(|_| {
            let src = from(client_ip, h);
            dnat_dst(&run_case(h, prog, &syn_case("new flow", src, to, allowed)))
        })
        .collect()
}

fn with_affinity(svc: ServicePort, timeout: Option<Duration>) -> ServicePort {
    ServicePort {
        affinity: timeout,
        ..svc
    }
}

const THREE_HOURS: Option<Duration> = Some(Duration::from_secs(10_800));

#[test]
fn affinity_keeps_a_clients_backend_and_off_spreads_again() {
    if !require_root("affinity_keeps_a_clients_backend_and_off_spreads_again") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    let svc = with_affinity(lb_service(seed_endpoints()), THREE_HOURS);
    h.sync(&svc);
    let backends = seed_backends();
    // One backend for the client through every frontend of the port, as
    // kube-proxy keeps one affinity list per Service port.
    let mut seen = BTreeSet::new();
    for prog in Prog::ALL {
        for to in [
            cluster_ip(),
            node_port(),
            addr(LB_IP, SERVICE_PORT),
            addr(EXTERNAL_ADDR, SERVICE_PORT),
        ] {
            seen.extend(reached_from(&mut h, prog, EXTERNAL_IP, to, &backends, 12));
            assert_eq!(seen.len(), 1, "{} to {to}: {seen:?}", prog.name());
        }
    }
    let cluster = h.maps.frontend(CLUSTER_IP, SERVICE_PORT, proto::TCP).expect("frontend");
    let entries = affinity_entries(&h);
    assert!(
        entries.iter().all(|(k, _)| k.affinity_id == cluster.rev_nat_id),
        "one entry per client, under the ClusterIP's id: {entries:?}"
    );
    // Other clients are spread (each keeping its own).
    let mut firsts = BTreeSet::new();
    for last in 1..=30 {
        let ip = Ipv4Addr::new(203, 0, 113, last);
        firsts.extend(reached_from(&mut h, Prog::TcIngress, ip, cluster_ip(), &backends, 2));
    }
    assert_eq!(firsts.len(), 3, "{firsts:?}");

    // Off: the client's flows spread, and its entries are gone.
    h.sync(&with_affinity(svc.clone(), None));
    assert!(
        !affinity_entries(&h)
            .iter()
            .any(|(k, _)| k.affinity_id == cluster.rev_nat_id),
        "an off frontend's entries are forgotten"
    );
    let seen = reached_from(&mut h, Prog::TcIngress, EXTERNAL_IP, cluster_ip(), &backends, 30);
    assert_eq!(seen.len(), 3, "{seen:?}");

    // On again: sticky again.
    h.sync(&svc);
    let seen = reached_from(&mut h, Prog::TcIngress, EXTERNAL_IP, cluster_ip(), &backends, 12);
    assert_eq!(seen.len(), 1, "{seen:?}");
}

#[test]
fn affinity_expires_after_the_timeout() {
    if !require_root("affinity_expires_after_the_timeout") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    h.sync(&with_affinity(
        lb_service(seed_endpoints()),
        Some(Duration::from_secs(1)),
    ));
    let backends = seed_backends();
    let first = reached_from(&mut h, Prog::XdpUplink, EXTERNAL_IP, cluster_ip(), &backends, 1);
    let map = affinity_map(&h);
    let (key, entry) = affinity_entries(&h)[0];
    assert_eq!(key.client_be, u32::from_ne_bytes(EXTERNAL_IP.octets()));
    assert!(entry.last_seen_ns > 0);
    // Fresh: kept. Idle past the timeout (its clock set back): balanced
    // anew each time, so 30 tries reach more than one backend.
    let kept = reached_from(&mut h, Prog::XdpUplink, EXTERNAL_IP, cluster_ip(), &backends, 5);
    assert_eq!(kept, first);
    let mut seen = BTreeSet::new();
    let mut map = map;
    for _ in 0..30 {
        let idle = AffinityValue {
            last_seen_ns: entry.last_seen_ns.saturating_sub(2_000_000_000),
            ..entry
        };
        map.insert(key, idle, 0).expect("ageing the entry");
        seen.extend(reached_from(
            &mut h,
            Prog::XdpUplink,
            EXTERNAL_IP,
            cluster_ip(),
            &backends,
            1,
        ));
        let renewed = map.get(&key, 0).expect("the entry is written again");
        assert!(
            renewed.last_seen_ns >= entry.last_seen_ns,
            "a miss remembers the new pick"
        );
    }
    assert!(seen.len() > 1, "{seen:?}");
}

#[test]
fn a_backend_that_leaves_releases_its_clients() {
    if !require_root("a_backend_that_leaves_releases_its_clients") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    let mut svc = with_affinity(lb_service(seed_endpoints()), THREE_HOURS);
    h.sync(&svc);
    let backends = seed_backends();
    let kept = reached_from(&mut h, Prog::TcIngress, EXTERNAL_IP, cluster_ip(), &backends, 3);
    let [gone] = kept.iter().copied().collect::<Vec<_>>()[..] else {
        panic!("one backend: {kept:?}")
    };
    // Another backend leaves: the client keeps its own.
    let other = *backends.iter().find(|b| **b != gone).expect("another backend");
    svc.endpoints.retain(|e| e.addr != *other.ip());
    h.sync(&svc);
    let still = reached_from(&mut h, Prog::TcIngress, EXTERNAL_IP, cluster_ip(), &backends, 3);
    assert_eq!(still, kept, "a change elsewhere keeps the client's backend");
    // Its own leaves: a remaining one, kept from then on.
    svc.endpoints.retain(|e| e.addr != *gone.ip());
    h.sync(&svc);
    let left: Vec<SocketAddrV4> = backends.iter().copied().filter(|b| *b != gone && *b != other).collect();
    let now = reached_from(&mut h, Prog::TcIngress, EXTERNAL_IP, cluster_ip(), &left, 5);
    assert_eq!(now.len(), 1, "{now:?}");
    // It comes back: the client stays where it is now.
    svc.endpoints = seed_endpoints();
    h.sync(&svc);
    let after = reached_from(&mut h, Prog::TcIngress, EXTERNAL_IP, cluster_ip(), &backends, 5);
    assert_eq!(after, now);
}
