//! IPv6 through the real programs (issue 13 item 1, first increment):
//! ClusterIP and NodePort DNAT of TCP and UDP with checksums checked by
//! etherparse, replies reverse-NATed, conntrack read back from `XP_CT6`,
//! extension headers walked up to the limit and passed beyond it,
//! fragments translated whole (`ipv6_fragments`), neighbour discovery and
//! non-Service traffic untouched, and
//! every truncation of a Service packet passed as malformed. A frontend
//! without backends answers as IPv4's: a RST, or an ICMPv6 port
//! unreachable quoting up to the minimum MTU (compared byte for byte with
//! etherparse's, checksums checked); a `Local` one without local backends
//! drops.
//!
//! The agent does not write IPv6 Service ports yet (`ServiceMaps` is
//! IPv4's): these tests write the three IPv6 maps and the backend slots
//! directly, in the layout the agent writes for IPv4 (a backend set of
//! slots -> backend ids; each frontend a run of it). The seed's IPv4
//! Services stay programmed, which sets the port filter's bits for the
//! same ports (88, 30791 and 80).

use std::net::{Ipv6Addr, SocketAddrV6};

use aya::maps::{HashMap as BpfHashMap, MapData};
use proxy_common::{
    Backend6, CtKey6, CtValue6, Service6Key, ServiceValue, SlotChunk, SlotChunkKey,
    ipv6::{addr6_be, ipv6_of},
    maps as map_names,
};
use proxy_userspace::mode::ebpf::open_pinned;
use testbed::frame::{
    ETH_HLEN, Ext6, Frame6, IPV6_MIN_MTU, MAC_CLIENT, MAC_NODE, Strict, check6, expected_port_unreachable6,
    expected_rst6,
};

use super::*;

mod ipv6_conntrack;
mod ipv6_fragments;
mod ipv6_icmp_errors;

/// Source ranges and the pod networks, through the agent's writer.
mod ipv6_api;

const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa);
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x50, 0, 0, 0, 0x10);
const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 5);
const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 7);
/// A ClusterIP without endpoints (port `EMPTY_PORT`; also a NodePort
/// without endpoints on `EMPTY_NODE_PORT`), and one whose internal
/// traffic policy is `Local` with no endpoint on this node (`SERVICE_PORT`).
const EMPTY_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x14);
const LOCAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x15);
const BACKEND_IPS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xb),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xc),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0xd),
];

/// Ids far above what the agent hands out for the seed's IPv4 ports.
const SET: u32 = 0x7000_0001;
const FIRST_BACKEND_ID: u32 = 0x7000_0010;
const FIRST_REV_NAT_ID: u32 = 0x7000_0100;

fn v6(ip: Ipv6Addr, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(ip, port, 0, 0)
}

fn backends6() -> Vec<SocketAddrV6> {
    BACKEND_IPS6.iter().map(|ip| v6(*ip, BACKEND_PORT)).collect()
}

fn pinned<K: aya::Pod, V: aya::Pod>(h: &Harness, name: &str) -> BpfHashMap<MapData, K, V> {
    open_pinned(h.pin_dir(), name).unwrap_or_else(|e| panic!("opening {name}: {e:#}"))
}

/// The seed harness plus an IPv6 seed: ClusterIP [fd00:10:96::a]:88 and
/// NodePort [fd00:192:168:50::10]:30791, TCP and UDP, to three backends
/// on port 80; and frontends without backends (`EMPTY_IP6`, `LOCAL_IP6`).
fn seeded6() -> Harness {
    seeded6_on(Harness::seeded())
}

/// [`seeded6`]'s IPv6 frontends added to `h`.
fn seeded6_on(h: Harness) -> Harness {
    let mut slots: BpfHashMap<MapData, SlotChunkKey, SlotChunk> = pinned(&h, map_names::BACKEND_SLOTS);
    let mut backends: BpfHashMap<MapData, u32, Backend6> = pinned(&h, map_names::BACKENDS6);
    let mut services: BpfHashMap<MapData, Service6Key, ServiceValue> = pinned(&h, map_names::SERVICES6);
    let mut rev_nat_id = FIRST_REV_NAT_ID;
    for (proto_index, proto) in [proto::TCP, proto::UDP].into_iter().enumerate() {
        let set = SET + proto_index as u32;
        let mut chunk = SlotChunk { ids: [0; 16] };
        for (slot, ip) in BACKEND_IPS6.iter().enumerate() {
            let id = FIRST_BACKEND_ID + (proto_index * 3 + slot) as u32;
            backends
                .insert(id, Backend6::new(*ip, BACKEND_PORT, proto), 0)
                .expect("backend");
            chunk.ids[slot] = id;
        }
        let key = SlotChunkKey {
            backend_set: set,
            chunk: 0,
        };
        slots.insert(key, chunk, 0).expect("slots");
        // (address, port, flags, backends): the last three without any.
        let frontends = [
            (CLUSTER_IP6, SERVICE_PORT, 0, 3),
            (NODE_IP6, NODE_PORT, FLAG_NODE_PORT, 3),
            (EMPTY_IP6, EMPTY_PORT, 0, 0),
            (NODE_IP6, EMPTY_NODE_PORT, FLAG_NODE_PORT, 0),
            (LOCAL_IP6, SERVICE_PORT, FLAG_INTERNAL_LOCAL, 0),
        ];
        for (addr, port, flags, backend_count) in frontends {
            let value = ServiceValue {
                backend_set: set,
                backend_count,
                rev_nat_id,
                flags,
                affinity_timeout_s: 0,
                backend_offset: 0,
            };
            services
                .insert(Service6Key::new(addr, port, proto), value, 0)
                .expect("frontend");
            rev_nat_id += 1;
        }
    }
    h
}

fn client6(h: &mut Harness) -> SocketAddrV6 {
    v6(CLIENT_IP6, h.next_port())
}

fn external6(h: &mut Harness) -> SocketAddrV6 {
    v6(EXTERNAL_IP6, h.next_port())
}

/// Runs `frame` through `prog`; checks that it was counted once as
/// `verdict`.
fn run6(h: &mut Harness, prog: Prog, frame: &[u8], verdict: Verdict, what: &str) -> Output {
    run_counted(h, prog, frame, verdict, what)
}

/// A passed, untouched frame.
fn assert_passed(h: &mut Harness, prog: Prog, frame: &[u8], verdict: Verdict, what: &str) {
    let out = run6(h, prog, frame, verdict, what);
    assert_eq!(out.code, prog.pass(), "{what} via {}: want pass", prog.name());
    assert!(
        out.frame == frame,
        "{what} via {}: want it untouched; differs at {}",
        prog.name(),
        diff(frame, &out.frame)
    );
}

/// Runs a new flow's first packet: DNATed to one of the backends, every
/// byte but the destination and the checksum as sent, the checksum valid.
/// Returns the backend.
fn assert_dnat(h: &mut Harness, prog: Prog, frame: &Frame6, what: &str) -> SocketAddrV6 {
    let out = run6(h, prog, &frame.build(), Verdict::DnatNew, what);
    let ctx = format!("{what} via {}: output {}", prog.name(), hex(&out.frame));
    assert!(prog.dnat_code_ok(out.code), "code {}: {ctx}", out.code);
    let checked = check6(&out.frame).unwrap_or_else(|e| panic!("{e}: {ctx}"));
    assert!(
        backends6().contains(&checked.dst),
        "{} is no backend: {ctx}",
        checked.dst
    );
    let want = frame.clone().with_dst(checked.dst).build();
    assert!(out.frame == want, "differs at {}: {ctx}", diff(&want, &out.frame));
    checked.dst
}

/// Runs a backend's reply: its source rewritten to `frontend`, the rest as
/// sent, the checksum valid.
fn assert_rev_nat(h: &mut Harness, prog: Prog, reply: &Frame6, frontend: SocketAddrV6, what: &str) {
    let out = run6(h, prog, &reply.build(), Verdict::RevNat, what);
    let ctx = format!("{what} via {}: output {}", prog.name(), hex(&out.frame));
    assert_eq!(out.code, prog.pass(), "{ctx}");
    check6(&out.frame).unwrap_or_else(|e| panic!("{e}: {ctx}"));
    let want = reply.clone().with_src(frontend).build();
    assert!(out.frame == want, "differs at {}: {ctx}", diff(&want, &out.frame));
}

/// The backend's answer to `request` (sent to `backend`).
fn reply_of(request: &Frame6, backend: SocketAddrV6, flags: u8) -> Frame6 {
    let reply = match &request.l4 {
        L4::Tcp(_) => Frame6::tcp(backend, request.src(), flags),
        _ => Frame6::udp(backend, request.src(), b"answer"),
    };
    Frame6 {
        eth_src: MAC_NODE,
        eth_dst: MAC_CLIENT,
        ..reply
    }
}

fn conntrack6(h: &Harness) -> Vec<(CtKey6, CtValue6)> {
    let map: BpfHashMap<MapData, CtKey6, CtValue6> = pinned(h, map_names::CONNTRACK6);
    map.iter().map(|entry| entry.expect("reading XP_CT6")).collect()
}

#[test]
fn ipv6_cluster_ip_and_node_port_flows_are_translated_both_ways() {
    if !require_root("ipv6_cluster_ip_and_node_port_flows_are_translated_both_ways") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let node_port = v6(NODE_IP6, NODE_PORT);
    for prog in Prog::ALL {
        let flows = [
            (
                "TCP SYN to the ClusterIP",
                Frame6::tcp(client6(&mut h), cluster, SYN),
                cluster,
            ),
            (
                "TCP SYN to the NodePort",
                Frame6::tcp(external6(&mut h), node_port, SYN),
                node_port,
            ),
            (
                "UDP to the ClusterIP",
                Frame6::udp(client6(&mut h), cluster, b"query"),
                cluster,
            ),
            (
                "UDP to the NodePort",
                Frame6::udp(external6(&mut h), node_port, b"query"),
                node_port,
            ),
        ];
        for (what, first, frontend) in flows {
            let backend = assert_dnat(&mut h, prog, &first, what);
            let is_tcp = matches!(first.l4, L4::Tcp(_));
            let answer = reply_of(&first, backend, SYN | ACK);
            assert_rev_nat(&mut h, prog, &answer, frontend, &format!("{what}: reply"));
            // The flow's next packet keeps its backend.
            let mut next = first.clone();
            if is_tcp {
                next.tcp_mut().flags = ACK;
            }
            let out = run6(&mut h, prog, &next.build(), Verdict::DnatEstablished, what);
            let checked = check6(&out.frame).unwrap_or_else(|e| panic!("{what}, second packet: {e}"));
            assert_eq!(checked.dst, backend, "{what}: the second packet's backend");

            let entries = conntrack6(&h);
            let src = first.src();
            let proto = if is_tcp { proto::TCP } else { proto::UDP };
            let find = |key: CtKey6| entries.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
            let fwd = find(CtKey6::new(
                *src.ip(),
                src.port(),
                *frontend.ip(),
                frontend.port(),
                proto,
            ))
            .unwrap_or_else(|| panic!("{what}: no forward entry in {entries:?}"));
            assert_eq!(fwd.nat(), (*backend.ip(), backend.port()), "{what}: forward entry");
            assert!(!fwd.is_reply());
            let rev = find(CtKey6::new(*backend.ip(), backend.port(), *src.ip(), src.port(), proto))
                .unwrap_or_else(|| panic!("{what}: no reply entry in {entries:?}"));
            assert_eq!(rev.nat(), (*frontend.ip(), frontend.port()), "{what}: reply entry");
            assert!(rev.is_reply());
        }
    }
    // No IPv4 flow was made of any of it.
    assert!(h.conntrack().is_empty(), "{:?}", h.conntrack());
}

#[test]
fn ipv6_extension_headers_are_walked_up_to_the_limit() {
    if !require_root("ipv6_extension_headers_are_walked_up_to_the_limit") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let atomic = Ext6::Fragment {
        offset: 0,
        more: false,
        id: 1,
    };
    let first = Ext6::Fragment {
        offset: 0,
        more: true,
        id: 2,
    };
    let translated: [(&str, Vec<Ext6>); 6] = [
        ("hop-by-hop", vec![Ext6::HopByHop { units: 1 }]),
        ("a long destination options header", vec![Ext6::DestOpts { units: 32 }]),
        ("routing, no segments left", vec![Ext6::Routing { units: 3 }]),
        ("an atomic fragment", vec![atomic]),
        ("a first fragment (see `fragments` for the rest)", vec![first]),
        (
            "four headers, the limit",
            vec![
                Ext6::HopByHop { units: 1 },
                Ext6::Routing { units: 1 },
                atomic,
                Ext6::DestOpts { units: 2 },
            ],
        ),
    ];
    for prog in Prog::ALL {
        for (what, ext) in &translated {
            for syn_or_udp in [true, false] {
                let frame = if syn_or_udp {
                    Frame6::tcp(client6(&mut h), cluster, SYN)
                } else {
                    Frame6::udp(client6(&mut h), cluster, b"q")
                }
                .with_ext(ext);
                let backend = assert_dnat(&mut h, prog, &frame, what);
                let reply = reply_of(&frame, backend, SYN | ACK).with_ext(ext);
                assert_rev_nat(&mut h, prog, &reply, cluster, &format!("{what}: reply"));
            }
        }
        let five = [
            Ext6::HopByHop { units: 1 },
            Ext6::DestOpts { units: 1 },
            Ext6::Routing { units: 1 },
            atomic,
            Ext6::DestOpts { units: 1 },
        ];
        let passed = [
            (
                "five headers, past the limit",
                Frame6::tcp(client6(&mut h), cluster, SYN).with_ext(&five),
                Verdict::PassMalformed,
            ),
            (
                "a later fragment, its first unseen",
                Frame6::udp(client6(&mut h), cluster, b"q").with_ext(&[Ext6::Fragment {
                    offset: 185,
                    more: false,
                    id: 3,
                }]),
                Verdict::PassFragmentUntracked,
            ),
            (
                "a first fragment before destination options",
                Frame6::udp(client6(&mut h), cluster, b"q").with_ext(&[
                    Ext6::Fragment {
                        offset: 0,
                        more: true,
                        id: 4,
                    },
                    Ext6::DestOpts { units: 1 },
                ]),
                Verdict::PassFragmentUntracked,
            ),
        ];
        for (what, frame, verdict) in passed {
            assert_passed(&mut h, prog, &frame.build(), verdict, what);
        }
    }
}

#[test]
fn ipv6_neighbour_discovery_and_other_traffic_pass_untouched() {
    if !require_root("ipv6_neighbour_discovery_and_other_traffic_pass_untouched") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let c = client6(&mut h);
    let echo = Frame6 {
        l4: L4::Raw {
            proto: 58,
            bytes: vec![128, 0, 0, 0, 0, 1, 0, 1],
        },
        ..Frame6::tcp(c, cluster, SYN)
    };
    let cases = [
        (
            "neighbour solicitation for the ClusterIP",
            Frame6::neighbour_solicitation(CLIENT_IP6, CLUSTER_IP6),
            Verdict::PassNotIpv4OrL4,
        ),
        ("ICMPv6 echo to the ClusterIP", echo, Verdict::PassNotIpv4OrL4),
        (
            "TCP to the ClusterIP on a port no Service uses",
            Frame6::tcp(c, v6(CLUSTER_IP6, 9), SYN),
            Verdict::PassNotService,
        ),
        (
            "TCP to an address no Service has, on a Service's port",
            Frame6::tcp(c, v6(EXTERNAL_IP6, SERVICE_PORT), SYN),
            Verdict::PassNotService,
        ),
        (
            "a mid-stream segment of no tracked flow to a backend port",
            Frame6::tcp(c, v6(BACKEND_IPS6[0], BACKEND_PORT), ACK),
            Verdict::PassNotService,
        ),
        (
            "a backend port's answer to a client with no flow",
            Frame6::tcp(v6(BACKEND_IPS6[0], BACKEND_PORT), c, ACK),
            Verdict::PassNotService,
        ),
    ];
    for prog in Prog::ALL {
        for (what, frame, verdict) in &cases {
            assert_passed(&mut h, prog, &frame.build(), *verdict, what);
        }
    }
    assert!(conntrack6(&h).is_empty(), "{:?}", conntrack6(&h));
}

/// Runs `request` to a frontend without backends: answered with exactly
/// `want` (the reject code, checksums valid), counted reject_no_backend.
fn assert_answered(h: &mut Harness, prog: Prog, request: &Frame6, want: &[u8], what: &str) {
    let out = run6(h, prog, &request.build(), Verdict::RejectNoBackend, what);
    let ctx = format!("{what} via {}: output {}", prog.name(), hex(&out.frame));
    assert_eq!(out.code, prog.reject(), "want the reject code: {ctx}");
    check6(&out.frame).unwrap_or_else(|e| panic!("{e}: {ctx}"));
    assert!(
        out.frame == want,
        "want {}\ndiffers at {}: {ctx}",
        hex(want),
        diff(want, &out.frame)
    );
}

#[test]
fn ipv6_no_backends_answers_rst_and_port_unreachable_or_drops_if_local() {
    if !require_root("ipv6_no_backends_answers_rst_and_port_unreachable_or_drops_if_local") {
        return;
    }
    let two_ext = [Ext6::HopByHop { units: 1 }, Ext6::DestOpts { units: 2 }];
    let (empty, empty_np) = (v6(EMPTY_IP6, EMPTY_PORT), v6(NODE_IP6, EMPTY_NODE_PORT));
    let mut h = seeded6();
    // Quote lengths (40 + 8 + payload) that take every piece the program
    // sums the quote in: 1023 has bits 1 to 512, 1231 has 1024; 1232 fits
    // exactly, 1233 and more are cut to 1232.
    let quote_lens = [48, 49, 50, 1023, 1231, 1232, 1233, 1500];
    let mut answered = 0;
    for prog in Prog::ALL {
        let mut tcp = vec![
            (
                "SYN -> RST|ACK, ack = seq + 1",
                Frame6::tcp(client6(&mut h), empty, SYN),
            ),
            (
                "SYN behind extension headers -> RST without them",
                Frame6::tcp(client6(&mut h), empty, SYN).with_ext(&two_ext),
            ),
            (
                "SYN to the empty NodePort -> RST from the node IP",
                Frame6::tcp(external6(&mut h), empty_np, SYN),
            ),
            (
                "SYN|FIN -> ack = seq + 2",
                Frame6::tcp(client6(&mut h), empty, SYN | FIN),
            ),
            ("no flags -> RST|ACK, ack = seq", Frame6::tcp(client6(&mut h), empty, 0)),
        ];
        let mut with_options = Frame6::tcp(client6(&mut h), empty, SYN);
        let t = with_options.tcp_mut();
        t.options = SYN_OPTIONS.to_vec();
        t.payload = b"fast open".to_vec();
        t.seq = 0xffff_fffe;
        tcp.push((
            "SYN with options and payload -> ack = seq + len + 1, wrapped",
            with_options,
        ));
        let mut data = Frame6::tcp(client6(&mut h), empty, PSH | ACK);
        data.tcp_mut().payload = b"data".to_vec();
        data.tcp_mut().ack = 0xdead_beef;
        tcp.push(("ACK with payload -> RST, seq = ack", data));
        for (what, request) in &tcp {
            assert_answered(&mut h, prog, request, &expected_rst6(request), what);
            answered += 1;
        }

        let mut udp = vec![
            (
                "UDP behind extension headers -> quoted with them".to_string(),
                Frame6::udp(client6(&mut h), empty, b"query").with_ext(&two_ext),
            ),
            (
                "UDP to the empty NodePort -> from the node IP".to_string(),
                Frame6::udp(external6(&mut h), empty_np, b"q"),
            ),
        ];
        for quote_len in quote_lens {
            let payload: Vec<u8> = (0..quote_len - 48).map(|i| (i * 13 % 251) as u8).collect();
            udp.push((
                format!("UDP, a quote of {quote_len} bytes"),
                Frame6::udp(client6(&mut h), empty, &payload),
            ));
        }
        for (what, request) in &udp {
            let want = expected_port_unreachable6(request);
            assert!(
                want.len() - ETH_HLEN <= IPV6_MIN_MTU,
                "{what}: the expected error is too long"
            );
            assert_answered(&mut h, prog, request, &want, what);
            answered += 1;
        }

        // A `Local` frontend without local backends drops, as IPv4's.
        let local = v6(LOCAL_IP6, SERVICE_PORT);
        for (what, request) in [
            ("TCP SYN to a Local frontend", Frame6::tcp(client6(&mut h), local, SYN)),
            ("UDP to a Local frontend", Frame6::udp(client6(&mut h), local, b"query")),
        ] {
            let frame = request.build();
            let out = run6(&mut h, prog, &frame, Verdict::DropNoLocalBackend, what);
            assert_eq!(out.code, prog.drop(), "{what} via {}: want the drop code", prog.name());
            assert!(out.frame == frame, "{what} via {}: want it untouched", prog.name());
        }
        for flags in [RST, RST | ACK] {
            let rst = Frame6::tcp(client6(&mut h), empty, flags).build();
            assert_passed(
                &mut h,
                prog,
                &rst,
                Verdict::RejectNoBackend,
                "a RST to the empty frontend",
            );
        }
    }
    println!("{answered} IPv6 packets to frontends without backends answered");
    let entries = conntrack6(&h);
    assert!(
        entries.is_empty(),
        "rejected and dropped flows are not tracked: {entries:?}"
    );
}

#[test]
fn every_ipv6_truncation_passes_untouched() {
    if !require_root("every_ipv6_truncation_passes_untouched") {
        return;
    }
    let mut h = seeded6();
    let c = client6(&mut h);
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let frames = [
        ("SYN with options and payload", Frame6::tcp(c, cluster, SYN)),
        (
            "UDP behind two extension headers",
            Frame6::udp(c, v6(NODE_IP6, NODE_PORT), b"0123456789")
                .with_ext(&[Ext6::HopByHop { units: 1 }, Ext6::DestOpts { units: 2 }]),
        ),
        // Not answered either: only a whole packet is rejected.
        (
            "SYN to a frontend without backends",
            Frame6::tcp(c, v6(EMPTY_IP6, EMPTY_PORT), SYN),
        ),
        (
            "UDP to a frontend without backends",
            Frame6::udp(c, v6(EMPTY_IP6, EMPTY_PORT), b"0123456789"),
        ),
    ];
    let (mut runs, mut refused) = (0, 0);
    for prog in Prog::ALL {
        for (what, frame) in &frames {
            let mut frame = frame.clone();
            if let L4::Tcp(tcp) = &mut frame.l4 {
                tcp.options = SYN_OPTIONS.to_vec();
                tcp.payload = b"0123456789".to_vec();
            }
            let full = frame.build();
            assert!(matches!(parse_strict(&full), Strict::Ipv6Flow(_)), "{what}");
            for len in 14..full.len() {
                let cut = &full[..len];
                if kernel_may_refuse(prog, cut) {
                    refused += 1;
                    continue;
                }
                assert!(matches!(parse_strict(cut), Strict::Malformed(_)), "{what}: {len} bytes");
                assert_passed(
                    &mut h,
                    prog,
                    cut,
                    Verdict::PassMalformed,
                    &format!("{what}, first {len} bytes"),
                );
                runs += 1;
            }
        }
    }
    println!("{runs} truncated IPv6 frames passed untouched; the kernel refused {refused} (tc, under 54 bytes)");
    assert!(
        conntrack6(&h).is_empty(),
        "truncated frames created flows: {:?}",
        conntrack6(&h)
    );
}

#[test]
fn ipv6_builder_frames_are_valid() {
    let c = v6(CLIENT_IP6, 40000);
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    for ext in [vec![], vec![Ext6::HopByHop { units: 2 }, Ext6::Routing { units: 1 }]] {
        for frame in [
            Frame6::tcp(c, cluster, SYN).with_ext(&ext),
            Frame6::udp(c, cluster, b"abc").with_ext(&ext),
        ] {
            let bytes = frame.build();
            let checked = check6(&bytes).unwrap_or_else(|e| panic!("{e}: {}", hex(&bytes)));
            assert_eq!((checked.src, checked.dst), (c, cluster));
            let Strict::Ipv6Flow(flow) = parse_strict(&bytes) else {
                panic!("not a flow: {}", hex(&bytes))
            };
            assert_eq!((flow.src, flow.dst, flow.l4_offset), (c, cluster, checked.l4_offset));
        }
    }
    assert_eq!(ipv6_of(addr6_be(CLUSTER_IP6)), CLUSTER_IP6);
}

/// `XP_CT6` is sized from the conntrack settings (a quarter of `XP_CT`'s
/// entries) and the agent's sweep deletes its flows idle past their
/// timeout, counting them with `XP_CT`'s; a live flow stays.
#[test]
fn the_sweep_deletes_expired_ipv6_flows_and_xp_ct6_is_sized_by_the_settings() {
    if !require_root("the_sweep_deletes_expired_ipv6_flows_and_xp_ct6_is_sized_by_the_settings") {
        return;
    }
    let options = short_timeouts(2);
    let mut h = seeded6_on(Harness::seeded_with(options));
    let table = h.pin_dir().join(map_names::CONNTRACK6);
    let size = aya::maps::MapInfo::from_pin(&table)
        .expect("XP_CT6's info")
        .max_entries();
    assert_eq!(size, options.conntrack.entries6);
    assert_eq!(size, options.conntrack.entries / 4);
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    for _ in 0..3 {
        let first = Frame6::udp(client6(&mut h), cluster, b"query");
        assert_dnat(&mut h, Prog::TcIngress, &first, "UDP to the ClusterIP");
    }
    let sweep = conntrack::sweep(h.pin_dir(), &options.conntrack.timeouts).expect("sweep");
    assert_eq!((sweep.entries, sweep.expired), (6, 0), "nothing is idle yet");
    std::thread::sleep(std::time::Duration::from_millis(3100));
    let live = Frame6::udp(client6(&mut h), cluster, b"query");
    assert_dnat(&mut h, Prog::TcIngress, &live, "a live UDP flow");
    let sweep = conntrack::sweep(h.pin_dir(), &options.conntrack.timeouts).expect("sweep");
    assert_eq!((sweep.entries, sweep.expired), (8, 6));
    let left = conntrack6(&h);
    assert_eq!(left.len(), 2, "the live flow's entries stay: {left:?}");
    assert!(left.iter().any(|(k, _)| k.sport_be == live.src().port().to_be()));
    let counts = proxy_userspace::server::metrics::read_conntrack_counts(h.pin_dir())
        .expect("counters")
        .expect("the data path has conntrack counters");
    assert_eq!(counts.get(ct_stat::EXPIRED), 6);
    assert_eq!(counts.get(ct_stat::LIVE), 2);
}
