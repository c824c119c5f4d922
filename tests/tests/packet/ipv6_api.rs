//! Issue 13's IPv6 side of `api`'s source-range and pod-CIDR tests, with
//! the Service written by the agent's own writer (`ServiceMaps`): a new
//! flow to an IPv6 load balancer IP with loadBalancerSourceRanges is
//! looked up in `XP_SRC_RANGES6` (inside a range: translated; outside:
//! dropped and counted `drop_source_range`), and a pod's flow to a
//! `Local` Service's IPv6 external frontend is short-circuited through
//! `XP_POD_CIDRS6` to every endpoint (the outside gets this node's only).

use std::{collections::BTreeSet, net::IpAddr};

use proxy_common::ipv6::ipv6_of;
use proxy_userspace::model::SourceRange;

use super::*;
use crate::api::{POD_CIDR, external_local_on_this_node, set_pod_cidrs};

/// An external IP and a load balancer IP of the IPv6 Service.
const EXTERNAL_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);
const LB_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x20);
/// The range `EXTERNAL_IP6` is in, and a client outside it.
const ALLOWED6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0);
const OUTSIDER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 0x99);
/// The IPv6 pod network `CLIENT_IP6` is in, as a dual `clusterCIDR` gives it.
const POD_CIDR6: &str = "fd00:10:244::/56";

/// A TCP Service port of IPv6 addresses: ClusterIP `CLUSTER_IP6`, an
/// external IP and a load balancer IP, all on `SERVICE_PORT`.
fn lb_service6(endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: "default/lb6:http".into(),
        protocol: Protocol::Tcp,
        cluster_ip: CLUSTER_IP6.into(),
        port: SERVICE_PORT,
        endpoints,
        external_ips: vec![EXTERNAL_ADDR6.into()],
        load_balancer_ips: vec![LB_IP6.into()],
        ..ServicePort::default()
    }
}

fn range6(addr: Ipv6Addr, prefix_len: u8) -> SourceRange {
    SourceRange {
        addr: addr.into(),
        prefix_len,
    }
}

fn from6(ip: Ipv6Addr, h: &mut Harness) -> SocketAddrV6 {
    v6(ip, h.next_port())
}

/// A new flow's SYN from `src` to `to`: DNATed (as [`assert_dnat`]
/// checks) to one of `allowed`. Returns the backend.
fn dnat_to_one_of(
    h: &mut Harness,
    prog: Prog,
    src: SocketAddrV6,
    to: SocketAddrV6,
    allowed: &[SocketAddrV6],
    what: &str,
) -> SocketAddrV6 {
    let backend = assert_dnat(h, prog, &Frame6::tcp(src, to, SYN), what);
    assert!(
        allowed.contains(&backend),
        "{what} via {}: {src} -> {to} reached {backend}, not one of {allowed:?}",
        prog.name()
    );
    backend
}

/// A new flow's SYN from `src` to `to`: dropped untouched, counted as `verdict`.
fn assert_dropped6(h: &mut Harness, prog: Prog, src: SocketAddrV6, to: SocketAddrV6, verdict: Verdict, what: &str) {
    let frame = Frame6::tcp(src, to, SYN).build();
    let out = run6(h, prog, &frame, verdict, what);
    assert_eq!(out.code, prog.drop(), "{what} via {}: want the drop code", prog.name());
    assert!(out.frame == frame, "{what} via {}: want it untouched", prog.name());
}

/// Whether `XP_CT6` tracks a flow from `client` to `to`'s address.
fn tracked6(h: &Harness, client: Ipv6Addr, to: Ipv6Addr) -> Vec<CtValue6> {
    let entries = conntrack6(h).into_iter();
    entries
        .filter(|(k, _)| ipv6_of(k.saddr_be) == client && ipv6_of(k.daddr_be) == to)
        .map(|(_, v)| v)
        .collect()
}

#[test]
fn ipv6_source_ranges_drop_outsiders_on_load_balancer_ips_only() {
    if !require_root("ipv6_source_ranges_drop_outsiders_on_load_balancer_ips_only") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    let mut svc = ServicePort {
        source_ranges: vec![range6(ALLOWED6, 64)],
        ..lb_service6(endpoints_on(&BACKEND_IPS6, [THIS_NODE; 3]))
    };
    h.sync(&svc);
    let backends = backends6();
    let lb = v6(LB_IP6, SERVICE_PORT);
    for prog in Prog::ALL {
        let src = external6(&mut h);
        dnat_to_one_of(&mut h, prog, src, lb, &backends, "inside the range");
        let src = from6(LB_IP6, &mut h);
        dnat_to_one_of(&mut h, prog, src, lb, &backends, "from the LB IP itself");
        let src = from6(OUTSIDER_IP6, &mut h);
        assert_dropped6(&mut h, prog, src, lb, Verdict::DropSourceRange, "outside every range");
        let src = client6(&mut h);
        assert_dropped6(
            &mut h,
            prog,
            src,
            lb,
            Verdict::DropSourceRange,
            "a pod outside the ranges",
        );
        // Not filtered: the external IP, the ClusterIP.
        for to in [v6(EXTERNAL_ADDR6, SERVICE_PORT), v6(CLUSTER_IP6, SERVICE_PORT)] {
            let src = from6(OUTSIDER_IP6, &mut h);
            dnat_to_one_of(&mut h, prog, src, to, &backends, "unfiltered frontend");
        }
    }
    assert!(
        tracked6(&h, OUTSIDER_IP6, LB_IP6).is_empty(),
        "a dropped flow is not tracked"
    );

    // The list changes: the outsider's network is in, the old one out.
    svc.source_ranges = vec![range6(OUTSIDER_IP6, 48)];
    h.sync(&svc);
    let src = from6(OUTSIDER_IP6, &mut h);
    dnat_to_one_of(&mut h, Prog::XdpUplink, src, lb, &backends, "now inside");
    let src = external6(&mut h);
    assert_dropped6(
        &mut h,
        Prog::XdpUplink,
        src,
        lb,
        Verdict::DropSourceRange,
        "now outside",
    );
    // An IPv4 range admits no IPv6 client.
    svc.source_ranges = vec![SourceRange {
        addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        prefix_len: 0,
    }];
    h.sync(&svc);
    let src = external6(&mut h);
    assert_dropped6(
        &mut h,
        Prog::TcIngress,
        src,
        lb,
        Verdict::DropSourceRange,
        "only an IPv4 range",
    );
    // No ranges: everyone.
    svc.source_ranges.clear();
    h.sync(&svc);
    let src = from6(OUTSIDER_IP6, &mut h);
    dnat_to_one_of(&mut h, Prog::XdpUplink, src, lb, &backends, "no ranges");
}

/// How flows from `client_ip` to `to` end: the backends 30 new flows
/// reached (each one of `allowed`) and whether any was marked for SNAT.
fn outcome_from6(
    h: &mut Harness,
    prog: Prog,
    client_ip: Ipv6Addr,
    to: SocketAddrV6,
    allowed: &[SocketAddrV6],
) -> (BTreeSet<SocketAddrV6>, bool) {
    let seen = (0..30)
        .map(|_| {
            let src = from6(client_ip, h);
            dnat_to_one_of(h, prog, src, to, allowed, "new flow")
        })
        .collect();
    let snat = tracked6(h, client_ip, *to.ip())
        .iter()
        .any(|v| v.flags & FLAG_SNAT != 0);
    (seen, snat)
}

#[test]
fn ipv6_pods_reach_every_endpoint_of_a_local_external_frontend() {
    if !require_root("ipv6_pods_reach_every_endpoint_of_a_local_external_frontend") {
        return;
    }
    let (mut h, svc) = external_local_on_this_node(lb_service6(endpoints_on(
        &BACKEND_IPS6,
        [OTHER_NODE, THIS_NODE, OTHER_NODE],
    )));
    let local_only = [v6(BACKEND_IPS6[1], BACKEND_PORT)];
    let local: BTreeSet<SocketAddrV6> = local_only.into();
    let all = backends6();
    let every: BTreeSet<SocketAddrV6> = all.iter().copied().collect();
    let frontends = [v6(EXTERNAL_ADDR6, SERVICE_PORT), v6(LB_IP6, SERVICE_PORT)];

    // Without clusterCIDR pods cannot be told apart: external clients.
    for to in frontends {
        let (seen, _) = outcome_from6(&mut h, Prog::TcIngress, CLIENT_IP6, to, &local_only);
        assert_eq!(seen, local, "no pod CIDR: a pod to {to}");
    }
    // An IPv4 pod network alone does not make an IPv6 source a pod.
    set_pod_cidrs(&h, &[POD_CIDR]);
    let (seen, _) = outcome_from6(&mut h, Prog::TcIngress, CLIENT_IP6, frontends[1], &local_only);
    assert_eq!(seen, local, "IPv4 pod CIDR only: a pod to {}", frontends[1]);

    set_pod_cidrs(&h, &[POD_CIDR, POD_CIDR6]);
    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        for to in frontends {
            let (seen, snat) = outcome_from6(&mut h, prog, CLIENT_IP6, to, &all);
            assert_eq!(seen, every, "{}: a pod to {to} reaches every endpoint", prog.name());
            assert!(!snat, "{}: a pod's flow to {to} keeps its source", prog.name());
            let (seen, snat) = outcome_from6(&mut h, prog, EXTERNAL_IP6, to, &local_only);
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
    let lb = h
        .maps
        .frontend(LB_IP6, SERVICE_PORT, proto::TCP)
        .expect("the LB IP frontend");
    assert!(
        tracked6(&h, CLIENT_IP6, LB_IP6)
            .iter()
            .any(|v| !v.is_reply() && v.rev_nat_id == lb.rev_nat_id),
        "a pod's flow to the LB IP is tracked under its frontend"
    );

    // The policy back to Cluster: nothing short-circuited, a pod's flow to
    // another node's backend masqueraded like everyone's.
    h.sync(&ServicePort {
        external_policy: TrafficPolicy::Cluster,
        ..svc.clone()
    });
    for to in frontends {
        let (seen, snat) = outcome_from6(&mut h, Prog::TcIngress, CLIENT_IP6, to, &all);
        assert_eq!(seen, every, "Cluster: a pod to {to}");
        assert!(
            snat,
            "Cluster: external traffic to other nodes' backends is masqueraded"
        );
    }
    // XDP masquerades the outside's flows to other nodes' backends the
    // same way: it DNATs them itself and leaves the SNAT mark in the
    // metadata for tc ingress; a flow to this node's backend keeps its
    // source (no mark).
    let local = local_only[0];
    let mut marked = 0;
    for to in frontends.into_iter().cycle().take(20) {
        let frame = Frame6::tcp(external6(&mut h), to, SYN).build();
        let out = run6(&mut h, Prog::XdpUplink, &frame, Verdict::DnatNew, "XDP, Cluster");
        let checked = check6(&out.without_meta().frame).unwrap_or_else(|e| panic!("XDP to {to}: {e}"));
        assert!(backends6().contains(&checked.dst), "XDP to {to}: {}", checked.dst);
        let want = (checked.dst != local).then_some(0x4000);
        assert_eq!(
            (out.code, out.xdp_mark()),
            (XDP_PASS, want),
            "XDP to {to} via {}",
            checked.dst
        );
        marked += usize::from(want.is_some());
    }
    assert!(marked > 0, "no flow to another node's backend in 20");

    // No endpoint on this node: the outside is dropped, pods still served.
    h.sync(&ServicePort {
        endpoints: endpoints_on(&BACKEND_IPS6, [OTHER_NODE; 3]),
        ..svc
    });
    let to = v6(LB_IP6, SERVICE_PORT);
    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        let src = external6(&mut h);
        assert_dropped6(&mut h, prog, src, to, Verdict::DropNoLocalBackend, "the outside");
    }
    let (seen, _) = outcome_from6(&mut h, Prog::TcIngress, CLIENT_IP6, to, &all);
    assert_eq!(seen, every, "a pod, with no endpoint on this node");
}
