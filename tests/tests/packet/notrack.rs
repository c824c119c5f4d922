//! Flows kept off the kernel's conntrack (the programs' `notrack`, the
//! agent's raw-table rule): a flow to a pod backend that the kernel does
//! not source-NAT carries the notrack mark on every forward packet and is
//! tracked with `FLAG_NOTRACK`; a hairpin (masqueraded by the kernel)
//! carries the SNAT mark only; a backend outside the pod networks (a
//! node's address), or a node without pod networks, gets no mark. The
//! real traffic under a node firewall that drops invalid packets is
//! `bulk.rs`'s.

use proxy_common::conntrack::FLAG_NOTRACK;

use super::*;
use crate::api::{POD_CIDR, set_pod_cidrs};

const SNAT_MARK: u32 = 0x4000;
const NOTRACK_MARK: u32 = 0x2000;

/// The seed Services, both marks configured, `pod_networks` written.
fn harness(pod_networks: &[&str]) -> Harness {
    let options = LoadOptions {
        snat_mark: SNAT_MARK,
        notrack_mark: NOTRACK_MARK,
        ..LoadOptions::default()
    };
    let h = Harness::seeded_with(options);
    set_pod_cidrs(&h, pod_networks);
    h
}

/// A ClusterIP Service of the seed's ports with the one endpoint `backend`.
fn one_endpoint(h: &mut Harness, backend: Ipv4Addr) {
    h.sync(&ServicePort {
        name: SEED_TCP.into(),
        protocol: Protocol::Tcp,
        cluster_ip: CLUSTER_IP.into(),
        port: SERVICE_PORT,
        endpoints: vec![Endpoint::ready(backend, BACKEND_PORT)],
        ..ServicePort::default()
    });
}

/// The flags of the forward entry of the flow from `client`.
fn forward_flags(h: &Harness, client: SocketAddrV4) -> u8 {
    let entries = h.conntrack();
    let forward = entries
        .iter()
        .find(|(k, v)| !v.is_reply() && k.saddr() == *client.ip() && k.sport() == client.port());
    forward
        .unwrap_or_else(|| panic!("no forward entry of {client}: {entries:?}"))
        .1
        .flags
}

#[test]
fn a_pods_flow_to_a_pod_carries_the_notrack_mark() {
    if !require_root("a_pods_flow_to_a_pod_carries_the_notrack_mark") {
        return;
    }
    let mut h = harness(&[POD_CIDR]);
    let from = client(&mut h);
    let (out, mark) = h.run_tc_marked(Prog::TcIngress, &Frame::tcp(from, cluster_ip(), SYN).build());
    assert_eq!(out.code, TC_ACT_OK);
    assert!(BACKEND_IPS.contains(dnat_dst(&out).ip()), "DNATed: {}", dnat_dst(&out));
    assert_eq!(mark, NOTRACK_MARK, "the first packet");
    assert_ne!(forward_flags(&h, from) & FLAG_NOTRACK, 0);
    let (out, mark) = h.run_tc_marked(Prog::TcIngress, &Frame::tcp(from, cluster_ip(), ACK).build());
    assert_eq!((out.code, mark), (TC_ACT_OK, NOTRACK_MARK), "a later packet");
}

#[test]
fn a_hairpin_carries_the_snat_mark_only() {
    if !require_root("a_hairpin_carries_the_snat_mark_only") {
        return;
    }
    let mut h = harness(&[POD_CIDR]);
    let backend = BACKEND_IPS[0];
    one_endpoint(&mut h, backend);
    let from = addr(backend, h.next_port());
    let (out, mark) = h.run_tc_marked(Prog::TcIngress, &Frame::tcp(from, cluster_ip(), SYN).build());
    assert_eq!((out.code, dnat_dst(&out).ip()), (TC_ACT_OK, &backend));
    assert_eq!(mark, SNAT_MARK, "masqueraded by the kernel, so tracked by it");
    assert_eq!(forward_flags(&h, from) & (FLAG_NOTRACK | FLAG_SNAT), FLAG_SNAT);
}

#[test]
fn backends_outside_the_pod_networks_get_no_mark() {
    if !require_root("backends_outside_the_pod_networks_get_no_mark") {
        return;
    }
    // A host-network endpoint: its replies pass the kernel's hooks.
    let mut h = harness(&[POD_CIDR]);
    one_endpoint(&mut h, NODE_IP);
    let from = client(&mut h);
    let (out, mark) = h.run_tc_marked(Prog::TcIngress, &Frame::tcp(from, cluster_ip(), SYN).build());
    assert_eq!((out.code, dnat_dst(&out).ip(), mark), (TC_ACT_OK, &NODE_IP, 0));
    assert_eq!(forward_flags(&h, from) & FLAG_NOTRACK, 0);

    // Without pod networks no backend is known to be a pod.
    let mut h = harness(&[]);
    let from = client(&mut h);
    let (out, mark) = h.run_tc_marked(Prog::TcIngress, &Frame::tcp(from, cluster_ip(), SYN).build());
    assert_eq!((out.code, mark), (TC_ACT_OK, 0));
    assert!(BACKEND_IPS.contains(dnat_dst(&out).ip()));
    assert_eq!(forward_flags(&h, from) & FLAG_NOTRACK, 0);
}

#[test]
fn xdp_passes_the_notrack_mark_to_tc_both_ways() {
    if !require_root("xdp_passes_the_notrack_mark_to_tc_both_ways") {
        return;
    }
    let mut h = harness(&[POD_CIDR]);
    let from = external(&mut h);
    let out = h.run(Prog::XdpUplink, &Frame::tcp(from, node_port(), SYN).build());
    assert_eq!((out.code, out.xdp_mark()), (XDP_PASS, Some(NOTRACK_MARK)));
    let backend = dnat_dst(&out.without_meta());
    assert!(BACKEND_IPS.contains(backend.ip()), "DNATed by XDP: {backend}");
    // The backend's reply, reverse-NATed by XDP (a backend on another
    // node answers through the uplink), goes up the stack: marked too.
    let out = h.run(Prog::XdpUplink, &Frame::tcp(backend, from, SYN | ACK).build());
    assert_eq!((out.code, out.xdp_mark()), (XDP_PASS, Some(NOTRACK_MARK)));
    match parse_strict(&out.without_meta().frame) {
        Strict::Flow(f) => assert_eq!(f.src, node_port(), "reverse-NATed"),
        other => panic!("the reply does not parse: {other:?}"),
    }
}

#[test]
fn flows_translated_at_tc_egress_stay_tracked() {
    if !require_root("flows_translated_at_tc_egress_stay_tracked") {
        return;
    }
    // The node's own connection: the kernel tracked it untranslated in
    // OUTPUT, and must see its replies to keep that entry right.
    let mut h = harness(&[POD_CIDR]);
    let from = addr(NODE_IP, h.next_port());
    let (out, mark) = h.run_tc_marked(Prog::TcEgress, &Frame::tcp(from, cluster_ip(), SYN).build());
    assert!(BACKEND_IPS.contains(dnat_dst(&out).ip()), "DNATed at egress");
    assert_eq!(mark, 0);
    assert_eq!(forward_flags(&h, from) & FLAG_NOTRACK, 0);
}
