//! Packet tests of the real programs through BPF_PROG_TEST_RUN.
//!
//! Each case is {description, input frame from the builder, expected verdict,
//! expected output frame}. Expected frames come from `frame::Frame` (headers
//! and checksums written by etherparse), never from xproxy's own code. Every
//! case also checks the verdict counters: exactly one verdict gains one
//! packet and the input's length in bytes.
//!
//! Each test loads its own data path (fresh pin directory, empty conntrack)
//! and gives every case its own client port, so cases never share a flow.

use std::net::{Ipv4Addr, SocketAddrV4};

use proxy_common::{
    CtKey, CtTimeouts, Verdict, VerdictCounter,
    conntrack::{FLAG_FIN_FORWARD, FLAG_FIN_REPLY, FLAG_HANDED_TO_TC, FLAG_SNAT, FLAG_STATEFUL, state},
    proto,
    service::{FLAG_EXTERNAL_LOCAL, FLAG_INTERNAL_LOCAL, FLAG_NEEDS_SNAT, FLAG_NODE_PORT},
    stats::ct_stat,
};
use proxy_userspace::{
    mode::ebpf::{
        LoadOptions,
        conntrack::{self, CtSettings},
    },
    model::{Endpoint, Protocol, ServicePort, TrafficPolicy},
};
use testbed::{
    frame::{
        ETHERTYPE_QINQ, ETHERTYPE_VLAN, Frame, L4, Net, Strict, check, diff, expected_port_unreachable, expected_rst,
        fragments, hex, parse_strict, reassemble_udp, tcp_flags::*,
    },
    privileged::require_root,
    testrun::*,
};

// Issue 12's Service fields, beside this file (a test target's root looks
// for modules next to itself).
#[path = "packet/api.rs"]
mod api;
// Issue 15's Maglev, beside it.
#[path = "packet/maglev.rs"]
mod maglev;
// Issue 13's IPv6, beside it.
#[path = "packet/ipv6.rs"]
mod ipv6;
// Issue 13's SCTP, beside it.
#[path = "packet/notrack.rs"]
mod notrack;
#[path = "packet/sctp.rs"]
mod sctp;

#[derive(Clone, Debug)]
enum Expect {
    /// Passed on untouched and counted under this verdict.
    Pass(Verdict),
    /// Passed on untouched, counted once under one of these verdicts (the
    /// specification does not say which).
    PassCountedAsOneOf(&'static [Verdict]),
    /// `frame` with its destination replaced by one of `backends`.
    Dnat {
        frame: Frame,
        backends: Vec<SocketAddrV4>,
        verdict: Verdict,
    },
    /// `frame` with its source replaced by `frontend`.
    RevNat { frame: Frame, frontend: SocketAddrV4 },
    /// Answered with exactly this frame.
    Reject(Vec<u8>),
    /// Dropped untouched, counted under this verdict.
    Drop(Verdict),
}

#[derive(Clone, Debug)]
struct Case {
    desc: String,
    input: Vec<u8>,
    expect: Expect,
}

impl Case {
    fn new(desc: impl Into<String>, input: Vec<u8>, expect: Expect) -> Self {
        Self {
            desc: desc.into(),
            input,
            expect,
        }
    }

    fn pass(desc: impl Into<String>, frame: &Frame, verdict: Verdict) -> Self {
        Self::new(desc, frame.build(), Expect::Pass(verdict))
    }

    fn dnat(desc: impl Into<String>, frame: Frame, backends: &[SocketAddrV4], verdict: Verdict) -> Self {
        let input = frame.build();
        Self::new(
            desc,
            input,
            Expect::Dnat {
                frame,
                backends: backends.to_vec(),
                verdict,
            },
        )
    }

    fn drop(desc: impl Into<String>, frame: &Frame, verdict: Verdict) -> Self {
        Self::new(desc, frame.build(), Expect::Drop(verdict))
    }

    fn rev_nat(desc: impl Into<String>, frame: Frame, frontend: SocketAddrV4) -> Self {
        let input = frame.build();
        Self::new(desc, input, Expect::RevNat { frame, frontend })
    }

    /// A no-backend Service's answer, computed from the input.
    fn reject(desc: impl Into<String>, frame: &Frame) -> Self {
        let input = frame.build();
        let Strict::Flow(flow) = parse_strict(&input) else {
            panic!("reject case input must be a valid flow")
        };
        let answer = if flow.is_tcp() {
            expected_rst(&input, &flow)
        } else {
            expected_port_unreachable(&input, &flow)
        };
        Self::new(desc, input, Expect::Reject(answer))
    }
}

/// An RST to a Service without backends passes untouched; the spec names no
/// verdict for it: reject_no_backend or a pass verdict.
const RST_TO_EMPTY_VERDICTS: &[Verdict] = &[
    Verdict::RejectNoBackend,
    Verdict::PassNotService,
    Verdict::PassNotIpv4OrL4,
    Verdict::PassMalformed,
];

/// The verdicts whose counters moved, with the packets and bytes gained.
fn verdicts_gained(before: &[VerdictCounter], after: &[VerdictCounter]) -> Vec<(Verdict, u64, u64)> {
    Verdict::ALL
        .iter()
        .map(|&v| {
            let (b, a) = (before[v as usize], after[v as usize]);
            (v, a.packets - b.packets, a.bytes - b.bytes)
        })
        .filter(|(_, p, b)| *p != 0 || *b != 0)
        .collect()
}

/// Runs one case through one program and checks code, output and counters.
/// Returns the output (for follow-up cases that need the chosen backend), or
/// None if the kernel refused the frame before the program ran (see
/// `kernel_may_refuse`).
fn try_case(h: &mut Harness, prog: Prog, case: &Case) -> Option<Output> {
    let before = h.counts();
    let out = match h.try_run(prog, &case.input) {
        Ok(out) => out,
        Err(e) if errno(&e) == Some(libc::EINVAL) && kernel_may_refuse(prog, &case.input) => return None,
        Err(e) => panic!(
            "test_run of {} refused {}: {e:#?}\ncase: {}",
            prog.name(),
            hex(&case.input),
            case.desc
        ),
    };
    let after = h.counts();
    let ctx = format!(
        "\ncase: {} via {}\ninput:  {}\noutput: {}\ncode: {}",
        case.desc,
        prog.name(),
        hex(&case.input),
        hex(&out.frame),
        out.code
    );
    let changed = verdicts_gained(&before, &after);
    let counted = |verdict: Verdict| {
        assert_eq!(
            changed,
            vec![(verdict, 1, case.input.len() as u64)],
            "counters: want one {} packet of {} bytes{ctx}",
            verdict.name(),
            case.input.len()
        );
    };
    let untouched = || {
        assert_eq!(out.code, prog.pass(), "want pass{ctx}");
        assert!(
            out.frame == case.input,
            "want the input untouched; differs at {}{ctx}",
            diff(&case.input, &out.frame)
        );
    };
    match &case.expect {
        Expect::Pass(verdict) => {
            untouched();
            counted(*verdict);
        }
        Expect::PassCountedAsOneOf(verdicts) => {
            untouched();
            assert!(
                changed.len() == 1
                    && verdicts.contains(&changed[0].0)
                    && changed[0].1 == 1
                    && changed[0].2 == case.input.len() as u64,
                "counters: want one packet under one of {verdicts:?}, got {changed:?}{ctx}"
            );
        }
        Expect::Dnat {
            frame,
            backends,
            verdict,
        } => {
            assert!(
                prog.dnat_code_ok(out.code),
                "want the pass{} code after DNAT{ctx}",
                if prog == Prog::TcEgress { "/redirect" } else { "" }
            );
            let chosen = match parse_strict(&out.frame) {
                Strict::Flow(f) => f.dst,
                other => panic!("output does not parse: {other:?}{ctx}"),
            };
            assert!(
                backends.contains(&chosen),
                "new destination {chosen} is not one of {backends:?}{ctx}"
            );
            let want = frame.clone().with_dst(chosen).build();
            assert!(
                out.frame == want,
                "want {}\ndiffers at {}{ctx}",
                hex(&want),
                diff(&want, &out.frame)
            );
            check(&out.frame).unwrap_or_else(|e| panic!("checksums: {e}{ctx}"));
            counted(*verdict);
        }
        Expect::RevNat { frame, frontend } => {
            assert_eq!(out.code, prog.pass(), "want pass after reverse NAT{ctx}");
            let want = frame.clone().with_src(*frontend).build();
            assert!(
                out.frame == want,
                "want {}\ndiffers at {}{ctx}",
                hex(&want),
                diff(&want, &out.frame)
            );
            check(&out.frame).unwrap_or_else(|e| panic!("checksums: {e}{ctx}"));
            counted(Verdict::RevNat);
        }
        Expect::Reject(want) => {
            assert_eq!(out.code, prog.reject(), "want the reject code{ctx}");
            assert!(
                out.frame == *want,
                "want {}\ndiffers at {}{ctx}",
                hex(want),
                diff(want, &out.frame)
            );
            check(&out.frame).unwrap_or_else(|e| panic!("checksums: {e}{ctx}"));
            counted(Verdict::RejectNoBackend);
        }
        Expect::Drop(verdict) => {
            assert_eq!(out.code, prog.drop(), "want the drop code{ctx}");
            assert!(
                out.frame == case.input,
                "want the input untouched; differs at {}{ctx}",
                diff(&case.input, &out.frame)
            );
            counted(*verdict);
        }
    }
    Some(out)
}

/// [`try_case`] for frames the kernel always takes.
fn run_case(h: &mut Harness, prog: Prog, case: &Case) -> Output {
    try_case(h, prog, case).unwrap_or_else(|| panic!("the kernel refused {} for {}", case.desc, prog.name()))
}

/// The backend a DNATed output frame was sent to.
fn dnat_dst(out: &Output) -> SocketAddrV4 {
    match parse_strict(&out.frame) {
        Strict::Flow(f) => f.dst,
        other => panic!("DNAT output does not parse: {other:?}"),
    }
}

fn client(h: &mut Harness) -> SocketAddrV4 {
    SocketAddrV4::new(CLIENT_IP, h.next_port())
}

fn external(h: &mut Harness) -> SocketAddrV4 {
    SocketAddrV4::new(EXTERNAL_IP, h.next_port())
}

fn addr(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// TCP options of a Linux SYN: MSS, SACK permitted, timestamps, NOP, window scale.
const SYN_OPTIONS: [u8; 20] = [2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0x12, 0x34, 0, 0, 0, 0, 1, 3, 3, 7];

#[test]
fn test_run_refuses_frames_shorter_than_ethernet() {
    if !require_root("test_run_refuses_frames_shorter_than_ethernet") {
        return;
    }
    let mut h = Harness::seeded();
    let syn = Frame::tcp(addr(CLIENT_IP, 40000), cluster_ip(), SYN).build();
    for prog in Prog::ALL {
        for len in 0..14 {
            match h.try_run(prog, &syn[..len]) {
                Err(e) => assert_eq!(
                    errno(&e),
                    Some(libc::EINVAL),
                    "{} with {len} bytes: {e:#?}",
                    prog.name()
                ),
                Ok(out) => panic!("{} accepted a {len}-byte frame: {out:?}", prog.name()),
            }
        }
        // 14 bytes is the first length every program type takes, unless
        // (tc, recent kernels) the ether type promises an IP header.
        let arp = Frame::arp_request(CLIENT_IP, CLUSTER_IP).build();
        run_case(
            &mut h,
            prog,
            &Case::new(
                "bare ARP Ethernet header",
                arp[..14].to_vec(),
                Expect::Pass(Verdict::PassNotIpv4OrL4),
            ),
        );
        let ipv4 = Case::new(
            "bare IPv4 Ethernet header",
            syn[..14].to_vec(),
            Expect::Pass(Verdict::PassMalformed),
        );
        let ran = try_case(&mut h, prog, &ipv4).is_some();
        assert!(ran || prog != Prog::XdpUplink, "XDP must take 14 bytes");
    }
}

/// New flows to the ClusterIP: TCP and UDP, with and without payload,
/// options, padding and UDP checksum; then a second packet of each flow.
#[test]
fn cluster_ip_dnat() {
    if !require_root("cluster_ip_dnat") {
        return;
    }
    let mut h = Harness::seeded();
    let backends = seed_backends();
    let svc = cluster_ip();
    for prog in Prog::ALL {
        let mut cases = vec![
            Case::dnat(
                "TCP SYN",
                Frame::tcp(client(&mut h), svc, SYN),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP SYN with options, TTL 7, id 0xbeef, tos 0xb8",
                Frame::tcp(client(&mut h), svc, SYN)
                    .with_tcp(|t| t.options = SYN_OPTIONS.to_vec())
                    .with_ip(|ip| {
                        ip.ttl = 7;
                        ip.id = 0xbeef;
                        ip.tos = 0xb8;
                    }),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP PSH|ACK with payload opening a flow (no SYN seen)",
                Frame::tcp(client(&mut h), svc, PSH | ACK).with_tcp(|t| t.payload = b"GET / HTTP/1.1\r\n\r\n".to_vec()),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP SYN with odd-length payload (TFO)",
                Frame::tcp(client(&mut h), svc, SYN).with_tcp(|t| t.payload = b"abc".to_vec()),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP FIN|ACK",
                Frame::tcp(client(&mut h), svc, FIN | ACK),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP RST to a Service with backends",
                Frame::tcp(client(&mut h), svc, RST),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP SYN padded to 60 bytes with zeros",
                Frame::tcp(client(&mut h), svc, SYN).with_padding(&[0; 6]),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP ACK padded with garbage",
                Frame::tcp(client(&mut h), svc, ACK).with_padding(&[0xaa, 0x55, 0xff, 0x01, 0x02, 0x03, 0x04, 0x05]),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "UDP with payload",
                Frame::udp(client(&mut h), svc, b"query"),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "UDP without payload",
                Frame::udp(client(&mut h), svc, b""),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "UDP with checksum 0 (none)",
                Frame::udp(client(&mut h), svc, b"no checksum").with_udp(|u| u.zero_checksum = true),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "UDP with 1 byte payload padded to 60 bytes with garbage",
                Frame::udp(client(&mut h), svc, b"x").with_padding(&[0xee; 17]),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "UDP 1400 bytes, DF clear, id 0",
                Frame::udp(client(&mut h), svc, &[0x5a; 1400 - 28]).with_ip(|ip| {
                    ip.df = false;
                    ip.id = 0;
                }),
                &backends,
                Verdict::DnatNew,
            ),
            Case::dnat(
                "TCP to the TCP-only Service",
                Frame::tcp(client(&mut h), addr(TCP_ONLY_IP, TCP_ONLY_PORT), SYN),
                &[TCP_ONLY_BACKEND],
                Verdict::DnatNew,
            ),
        ];
        // Many source ports: every backend gets chosen at least once.
        for _ in 0..30 {
            cases.push(Case::dnat(
                "TCP SYN (spread)",
                Frame::tcp(client(&mut h), svc, SYN),
                &backends,
                Verdict::DnatNew,
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for case in &cases {
            let out = run_case(&mut h, prog, case);
            let backend = dnat_dst(&out);
            seen.insert(backend);
            // The next packet of the same flow: same backend, "established".
            let Expect::Dnat { frame, .. } = &case.expect else {
                unreachable!()
            };
            let next = match &frame.ip().l4 {
                L4::Tcp(_) => frame.clone().with_tcp(|t| {
                    t.flags = ACK;
                    t.seq = t.seq.wrapping_add(1);
                    t.ack = 0x2000_0001;
                    t.payload = b"more".to_vec();
                }),
                _ => frame.clone().with_udp(|u| u.payload = b"second".to_vec()),
            };
            let desc = format!("{} / next packet of the flow", case.desc);
            run_case(
                &mut h,
                prog,
                &Case::dnat(desc, next, &[backend], Verdict::DnatEstablished),
            );
        }
        assert_eq!(
            seen.len(),
            4,
            "{}: 44 new flows should reach all 3 seed backends and the TCP-only one: {seen:?}",
            prog.name()
        );
    }
}

/// Conntrack holds the forward entry (client -> frontend) and the reply entry
/// (backend -> client) that proxy-common documents.
#[test]
fn dnat_creates_forward_and_reply_conntrack_entries() {
    if !require_root("dnat_creates_forward_and_reply_conntrack_entries") {
        return;
    }
    let mut h = Harness::seeded();
    let cli = client(&mut h);
    let out = run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat(
            "TCP SYN",
            Frame::tcp(cli, cluster_ip(), SYN),
            &seed_backends(),
            Verdict::DnatNew,
        ),
    );
    let backend = dnat_dst(&out);
    let keys: Vec<CtKey> = h.conntrack().into_iter().map(|(k, _)| k).collect();
    let forward = CtKey::new(*cli.ip(), cli.port(), CLUSTER_IP, SERVICE_PORT, proto::TCP);
    let reply = CtKey::new(*backend.ip(), backend.port(), *cli.ip(), cli.port(), proto::TCP);
    assert!(keys.contains(&forward), "no forward entry {forward:?} in {keys:?}");
    assert!(keys.contains(&reply), "no reply entry {reply:?} in {keys:?}");
    assert_eq!(keys.len(), 2, "{keys:?}");
}

#[test]
fn node_port_dnat_and_reply() {
    if !require_root("node_port_dnat_and_reply") {
        return;
    }
    let mut h = Harness::seeded();
    let backends = seed_backends();
    for prog in Prog::ALL {
        for udp in [false, true] {
            let src = external(&mut h);
            let frame = if udp {
                Frame::udp(src, node_port(), b"ping")
            } else {
                Frame::tcp(src, node_port(), SYN)
            };
            let out = run_case(
                &mut h,
                prog,
                &Case::dnat(format!("NodePort, udp={udp}"), frame, &backends, Verdict::DnatNew),
            );
            let backend = dnat_dst(&out);
            if prog == Prog::TcEgress {
                continue; // replies are tested through xdp_uplink and tc_ingress
            }
            let reply = if udp {
                Frame::udp(backend, src, b"pong")
            } else {
                Frame::tcp(backend, src, SYN | ACK)
            };
            run_case(
                &mut h,
                prog,
                &Case::rev_nat(format!("NodePort reply, udp={udp}"), reply, node_port()),
            );
        }
    }
    for prog in Prog::ALL {
        let src = external(&mut h);
        let cases = [
            Case::pass(
                "node IP, service port (not the node port)",
                &Frame::tcp(src, addr(NODE_IP, SERVICE_PORT), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "ClusterIP, node port",
                &Frame::tcp(src, addr(CLUSTER_IP, NODE_PORT), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "another node IP, node port",
                &Frame::tcp(src, addr(Ipv4Addr::new(192, 168, 50, 11), NODE_PORT), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "node IP, node port + 1",
                &Frame::udp(src, addr(NODE_IP, NODE_PORT + 1), b"x"),
                Verdict::PassNotService,
            ),
        ];
        for case in &cases {
            run_case(&mut h, prog, case);
        }
    }
}

#[test]
fn replies_are_reverse_nated() {
    if !require_root("replies_are_reverse_nated") {
        return;
    }
    let mut h = Harness::seeded();
    let backends = seed_backends();
    let svc = cluster_ip();
    for forward_prog in Prog::ALL {
        for reply_prog in [Prog::XdpUplink, Prog::TcIngress] {
            for udp in [false, true] {
                let cli = client(&mut h);
                let frame = if udp {
                    Frame::udp(cli, svc, b"q")
                } else {
                    Frame::tcp(cli, svc, SYN)
                };
                let out = run_case(
                    &mut h,
                    forward_prog,
                    &Case::dnat("forward", frame, &backends, Verdict::DnatNew),
                );
                let backend = dnat_dst(&out);
                let label = format!("udp={udp}, forward via {}", forward_prog.name());
                let (reply, reply_zero) = if udp {
                    let r = Frame::udp(backend, cli, b"answer");
                    (r.clone(), Some(r.with_udp(|u| u.zero_checksum = true)))
                } else {
                    (
                        Frame::tcp(backend, cli, SYN | ACK).with_tcp(|t| t.options = SYN_OPTIONS.to_vec()),
                        None,
                    )
                };
                run_case(
                    &mut h,
                    reply_prog,
                    &Case::rev_nat(format!("reply, {label}"), reply, svc),
                );
                if let Some(r) = reply_zero {
                    run_case(
                        &mut h,
                        reply_prog,
                        &Case::rev_nat(format!("reply with checksum 0, {label}"), r, svc),
                    );
                }
                // The same backend to another client port, and another backend
                // to this client: no flow, no rewrite.
                let other = backends.iter().find(|b| **b != backend).expect("3 backends");
                let untracked = [
                    (
                        Frame::tcp(backend, addr(*cli.ip(), cli.port() + 10_000), ACK),
                        "untracked client port",
                    ),
                    (Frame::tcp(*other, cli, ACK), "another backend of the Service"),
                    (
                        Frame::tcp(addr(*backend.ip(), 81), cli, ACK),
                        "backend IP, another port",
                    ),
                ];
                for (frame, what) in untracked {
                    let frame = if udp {
                        Frame::udp(frame.src(), frame.dst(), b"x")
                    } else {
                        frame
                    };
                    run_case(
                        &mut h,
                        reply_prog,
                        &Case::pass(format!("{what}, {label}"), &frame, Verdict::PassNotService),
                    );
                }
            }
        }
    }
}

/// The port filter lets a backend port's packets through to conntrack (they
/// may be replies); one of no flow looks a frontend up only if its
/// destination port is a frontend's. So a backend's answer to a client it
/// has no Service flow with passes untouched, and a backend that connects
/// to a Service from its target port still opens a flow like any client.
#[test]
fn a_backend_ports_packets_of_no_flow_open_flows_only_to_frontends() {
    if !require_root("a_backend_ports_packets_of_no_flow_open_flows_only_to_frontends") {
        return;
    }
    let mut h = Harness::seeded();
    let backends = seed_backends();
    // A backend of its own per program: each opens a flow of its own.
    for (prog, from_target_port) in Prog::ALL.into_iter().zip(backends.iter().copied()) {
        let peer = client(&mut h);
        run_case(
            &mut h,
            prog,
            &Case::pass(
                "a backend's answer to a pod it has no Service flow with",
                &Frame::tcp(from_target_port, peer, ACK),
                Verdict::PassNotService,
            ),
        );
        run_case(
            &mut h,
            prog,
            &Case::dnat(
                "a backend's connection from its target port to the Service",
                Frame::tcp(from_target_port, cluster_ip(), SYN),
                &backends,
                Verdict::DnatNew,
            ),
        );
    }
    assert_eq!(Prog::ALL.len(), backends.len(), "a backend per program");
}

/// A TCP flow keeps its backend while the Service's backend set is
/// replaced, also when its backend left the set: its conntrack entries hold
/// the backend's address (kube-proxy's conntrack entries outlive its rules
/// likewise; UDP flows are another matter, see
/// [`udp_flows_of_a_removed_backend_move_tcp_flows_stay`]). New flows only
/// use the new set.
#[test]
fn established_flows_keep_their_backend_across_set_changes() {
    if !require_root("established_flows_keep_their_backend_across_set_changes") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let svc = cluster_ip();
    let progs = [Prog::XdpUplink, Prog::TcIngress, Prog::TcEgress];
    // 24 flows, 8 through each program.
    let mut flows = Vec::new();
    for i in 0..24 {
        let prog = progs[i % 3];
        let frame = Frame::tcp(client(&mut h), svc, SYN);
        let out = run_case(&mut h, prog, &Case::dnat("SYN", frame.clone(), &seed, Verdict::DnatNew));
        flows.push((prog, frame, dnat_dst(&out)));
    }
    let ack = |f: &Frame| f.clone().with_tcp(|t| t.flags = ACK);

    // 1. Grow: the old three plus 20 new endpoints (a new backend set).
    let fresh: Vec<SocketAddrV4> = (0..20).map(|i| addr(Ipv4Addr::new(10, 244, 2, 10 + i), 80)).collect();
    let mut grown = seed.clone();
    grown.extend(&fresh);
    h.sync(&service(
        SEED_TCP,
        Protocol::Tcp,
        CLUSTER_IP,
        SERVICE_PORT,
        Some(NODE_PORT),
        &grown,
    ));
    for (prog, frame, backend) in &flows {
        run_case(
            &mut h,
            *prog,
            &Case::dnat(
                "ACK after the set grew",
                ack(frame),
                &[*backend],
                Verdict::DnatEstablished,
            ),
        );
    }
    let mut new_flow_backends = std::collections::BTreeSet::new();
    for prog in progs {
        for _ in 0..10 {
            let case = Case::dnat(
                "new flow after growth",
                Frame::tcp(client(&mut h), svc, SYN),
                &grown,
                Verdict::DnatNew,
            );
            let out = run_case(&mut h, prog, &case);
            new_flow_backends.insert(dnat_dst(&out));
        }
    }
    assert!(
        new_flow_backends.iter().any(|b| fresh.contains(b)),
        "30 new flows never reached the 20 new backends: {new_flow_backends:?}"
    );

    // 2. Shrink: keep only the first seed backend plus the new ones. Every
    // flow goes on to its backend, kept or not; new flows use the new set.
    let kept = seed[0];
    let mut shrunk = vec![kept];
    shrunk.extend(&fresh);
    h.sync(&service(
        SEED_TCP,
        Protocol::Tcp,
        CLUSTER_IP,
        SERVICE_PORT,
        Some(NODE_PORT),
        &shrunk,
    ));
    assert_eq!(h.delete_stale_udp_flows(), 0, "TCP flows are never stale");
    let mut on_removed = 0;
    for (prog, frame, backend) in &flows {
        let what = if *backend == kept {
            "ACK, backend kept"
        } else {
            on_removed += 1;
            "ACK, backend removed"
        };
        run_case(
            &mut h,
            *prog,
            &Case::dnat(what, ack(frame), &[*backend], Verdict::DnatEstablished),
        );
    }
    assert!(
        on_removed > 0 && on_removed < flows.len(),
        "24 random flows should not all have picked one backend"
    );
    for prog in progs {
        let case = Case::dnat(
            "new flow after shrinking",
            Frame::tcp(client(&mut h), svc, SYN),
            &shrunk,
            Verdict::DnatNew,
        );
        run_case(&mut h, prog, &case);
    }
}

/// After a backend leaves, the agent deletes the conntrack entries of the
/// UDP flows on it (kube-proxy does so for UDP): their next packets pick a
/// remaining backend, and the old backend's late replies are no longer
/// reverse-NATed. UDP flows on other backends and TCP flows on it stay.
#[test]
fn udp_flows_of_a_removed_backend_move_tcp_flows_stay() {
    if !require_root("udp_flows_of_a_removed_backend_move_tcp_flows_stay") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let svc = cluster_ip();
    let mut flows = Vec::new();
    for i in 0..24 {
        let udp = i % 2 == 0;
        let frame = if udp {
            Frame::udp(client(&mut h), svc, b"q")
        } else {
            Frame::tcp(client(&mut h), svc, SYN)
        };
        let out = run_case(
            &mut h,
            Prog::TcIngress,
            &Case::dnat("first packet", frame.clone(), &seed, Verdict::DnatNew),
        );
        flows.push((udp, frame, dnat_dst(&out)));
    }
    let gone = flows[0].2;
    let remaining: Vec<SocketAddrV4> = seed.iter().copied().filter(|b| *b != gone).collect();
    for (name, protocol) in [(SEED_TCP, Protocol::Tcp), (SEED_UDP, Protocol::Udp)] {
        h.sync(&service(
            name,
            protocol,
            CLUSTER_IP,
            SERVICE_PORT,
            Some(NODE_PORT),
            &remaining,
        ));
    }
    let udp_on_gone = flows.iter().filter(|(udp, _, b)| *udp && *b == gone).count() as u64;
    assert_eq!(h.delete_stale_udp_flows(), 2 * udp_on_gone, "both entries of each");
    for (udp, frame, backend) in &flows {
        let next = if *udp {
            frame.clone().with_udp(|u| u.payload = b"again".to_vec())
        } else {
            frame.clone().with_tcp(|t| t.flags = ACK)
        };
        let case = if *udp && *backend == gone {
            Case::dnat("UDP, backend removed", next, &remaining, Verdict::DnatNew)
        } else {
            Case::dnat("backend kept, or TCP", next, &[*backend], Verdict::DnatEstablished)
        };
        run_case(&mut h, Prog::TcIngress, &case);
    }
}

/// The stale-flow sweep reads the conntrack map in batches: more flows
/// than one batch holds are all judged, none twice.
#[test]
fn stale_udp_flows_are_found_across_read_batches() {
    if !require_root("stale_udp_flows_are_found_across_read_batches") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let svc = cluster_ip();
    // Two entries a flow: 6,000 entries, more than a batch of 4,096.
    const FLOWS: usize = 3_000;
    for _ in 0..FLOWS {
        let frame = Frame::udp(client(&mut h), svc, b"q").build();
        let out = h.run(Prog::TcIngress, &frame);
        assert_eq!(out.code, Prog::TcIngress.pass(), "a UDP flow through the ClusterIP");
    }
    let tcp = Frame::tcp(client(&mut h), svc, SYN);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("TCP SYN", tcp, &seed, Verdict::DnatNew),
    );
    let udp_entries = |h: &Harness| h.conntrack().iter().filter(|(k, _)| k.proto == proto::UDP).count();
    assert_eq!(udp_entries(&h), 2 * FLOWS, "every flow is tracked");
    assert_eq!(h.delete_stale_udp_flows(), 0, "nothing left its Service yet");
    h.remove(&service(
        SEED_UDP,
        Protocol::Udp,
        CLUSTER_IP,
        SERVICE_PORT,
        Some(NODE_PORT),
        &seed,
    ));
    assert_eq!(h.delete_stale_udp_flows(), 2 * FLOWS as u64);
    assert_eq!(udp_entries(&h), 0);
    assert_eq!(h.conntrack().len(), 2, "the TCP flow stays");
}

/// kube-proxy's semantics for a deleted Service: established TCP flows go
/// on (both ways), UDP flows are deleted and their next packets pass
/// untranslated (nothing is addressed to the ClusterIP any more).
#[test]
fn a_deleted_services_tcp_flows_go_on_and_udp_flows_stop() {
    if !require_root("a_deleted_services_tcp_flows_go_on_and_udp_flows_stop") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let svc = cluster_ip();
    let (tcp, udp) = (
        Frame::tcp(client(&mut h), svc, SYN),
        Frame::udp(client(&mut h), svc, b"q"),
    );
    let tcp_backend = dnat_dst(&run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("TCP SYN", tcp.clone(), &seed, Verdict::DnatNew),
    ));
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("UDP", udp.clone(), &seed, Verdict::DnatNew),
    );
    for (name, protocol) in [(SEED_TCP, Protocol::Tcp), (SEED_UDP, Protocol::Udp)] {
        h.remove(&service(
            name,
            protocol,
            CLUSTER_IP,
            SERVICE_PORT,
            Some(NODE_PORT),
            &seed,
        ));
    }
    assert_eq!(h.delete_stale_udp_flows(), 2, "the UDP flow's two entries");
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat(
            "TCP ACK after the Service left",
            tcp.clone().with_tcp(|t| t.flags = ACK),
            &[tcp_backend],
            Verdict::DnatEstablished,
        ),
    );
    let reply = Frame::tcp(tcp_backend, tcp.src(), SYN | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("TCP reply after the Service left", reply, svc),
    );
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::pass(
            "UDP after the Service left",
            &udp.with_udp(|u| u.payload = b"again".to_vec()),
            Verdict::PassNotService,
        ),
    );
}

/// Forward entries (client -> frontend) and reply entries (backend ->
/// client) share one key space. The same tuple can be both only if a
/// client's source is a frontend: here a pod 10.244.0.11 talks from port
/// 80 to the NodePort (forward tuple 10.244.0.11:80 -> NODE_IP:30791), then
/// a hostNetwork process talks from NODE_IP:30791 to a one-backend Service
/// whose backend is that pod (reply tuple: the same). The second flow is
/// not tracked (passed untranslated, counted as an error) rather than
/// overwrite the first one's pin.
#[test]
fn forward_and_reply_entries_do_not_collide() {
    if !require_root("forward_and_reply_entries_do_not_collide") {
        return;
    }
    let pod = addr(BACKEND_IPS[0], BACKEND_PORT);
    let single = addr(Ipv4Addr::new(10, 96, 0, 40), 53);
    // The tuples are fixed by construction: a fresh data path per program.
    for prog in [Prog::TcIngress, Prog::XdpUplink, Prog::TcEgress] {
        let mut h = Harness::seeded();
        h.sync(&service(
            "default/single:dns",
            Protocol::Udp,
            *single.ip(),
            single.port(),
            None,
            &[pod],
        ));
        // 1. The pod's flow to the NodePort, pinned to some backend.
        let y = Frame::udp(pod, node_port(), b"first");
        let out = run_case(
            &mut h,
            prog,
            &Case::dnat("pod -> NodePort", y.clone(), &seed_backends(), Verdict::DnatNew),
        );
        let pinned = dnat_dst(&out);
        // 2. The node's flow from NODE_IP:30791 to the one-backend Service.
        let x = Frame::udp(node_port(), single, b"from the node");
        run_case(
            &mut h,
            prog,
            &Case::pass("node:30791 -> single, not tracked", &x, Verdict::Error),
        );
        // 3. The pod's flow goes on: still established, still its backend.
        let next = y.with_udp(|u| u.payload = b"second".to_vec());
        run_case(
            &mut h,
            prog,
            &Case::dnat("pod -> NodePort again", next, &[pinned], Verdict::DnatEstablished),
        );
    }
}

/// The node's own connection to a Service from a port in the NodePort
/// range gets its replies, addressed to `NODE_IP:30791`, reverse-NATed:
/// the programs look the packet's own tuple up in conntrack before they
/// look for a frontend, so the reply is not taken for a new NodePort flow.
/// (The test bed still reserves the NodePort range, as Kubernetes advises.)
#[test]
fn replies_to_a_node_port_numbered_source_port_are_replies() {
    if !require_root("replies_to_a_node_port_numbered_source_port_are_replies") {
        return;
    }
    let mut h = Harness::seeded();
    for (protocol, frame) in [
        (Protocol::Tcp, Frame::tcp(node_port(), cluster_ip(), SYN)),
        (Protocol::Udp, Frame::udp(node_port(), cluster_ip(), b"q")),
    ] {
        // The node's own traffic leaves through the uplink's tc egress.
        let out = run_case(
            &mut h,
            Prog::TcEgress,
            &Case::dnat(
                format!("{protocol:?} from NODE_IP:30791 to the ClusterIP"),
                frame,
                &seed_backends(),
                Verdict::DnatNew,
            ),
        );
        let backend = dnat_dst(&out);
        let reply = match protocol {
            Protocol::Tcp => Frame::tcp(backend, node_port(), SYN | ACK),
            Protocol::Udp => Frame::udp(backend, node_port(), b"a"),
            Protocol::Sctp => unreachable!("the seed has TCP and UDP ports"),
        };
        for prog in [Prog::XdpUplink, Prog::TcIngress] {
            run_case(
                &mut h,
                prog,
                &Case::rev_nat(
                    format!("{protocol:?} reply to NODE_IP:30791"),
                    reply.clone(),
                    cluster_ip(),
                ),
            );
        }
    }
}

/// Conntrack entries an older agent's programs wrote (reply keys told
/// apart by a direction byte, values with ids only) are rewritten at start
/// (`legacy_ct`): the flow goes on both ways.
#[test]
fn an_older_agents_conntrack_entries_are_migrated() {
    if !require_root("an_older_agents_conntrack_entries_are_migrated") {
        return;
    }
    let mut h = Harness::seeded();
    let syn = Frame::tcp(client(&mut h), cluster_ip(), SYN);
    let out = run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("SYN", syn.clone(), &seed_backends(), Verdict::DnatNew),
    );
    let backend = dnat_dst(&out);
    // Turn the two entries into what the older programs wrote.
    let mut ct = pinned_conntrack(&h);
    for (key, mut value) in h.conntrack() {
        ct.remove(&key).expect("delete");
        let mut old_key = key;
        old_key._pad[0] = u8::from(value.is_reply());
        (value.nat_addr_be, value.nat_port_be) = (0, 0);
        // TCP flag bits where the state is now, jiffies for a timestamp.
        value.flags &= !FLAG_STATEFUL;
        value.state = 0b1001;
        value.last_seen_ns = 4_295_000_000;
        ct.insert(old_key, value, 0).expect("insert");
    }
    let migrated = proxy_userspace::mode::ebpf::legacy_ct::migrate(h.pin_dir()).expect("migrate");
    assert_eq!(migrated, 2);
    let now = proxy_userspace::mode::ebpf::conntrack::now_ns();
    for (key, value) in h.conntrack() {
        assert!(value.flags & FLAG_STATEFUL != 0, "{key:?} migrated: {value:?}");
        assert_eq!(value.state, state::TCP_ESTABLISHED, "{key:?}");
        assert!(now - value.last_seen_ns < 5_000_000_000, "{key:?} seen now: {value:?}");
    }
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat(
            "ACK after the upgrade",
            syn.clone().with_tcp(|t| t.flags = ACK),
            &[backend],
            Verdict::DnatEstablished,
        ),
    );
    let reply = Frame::tcp(backend, syn.src(), SYN | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("reply after the upgrade", reply, cluster_ip()),
    );
}

/// An older agent kept the backends in a hash map (`XP_BACKENDS`) under
/// ids that only grew, and one slot per entry (`XP_SLOTS`). At start both
/// are carried over into today's maps (`old_maps`) before the programs are
/// attached, so the backend sets the older agent wrote serve new flows
/// before the first sync; a backend id the array cannot hold is left out,
/// and the old maps are unpinned.
#[test]
fn an_older_agents_backends_and_slots_are_carried_over() {
    use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData};
    use bpf_sys::obj::{MAP_F_NO_PREALLOC, MAP_TYPE_HASH, MapSpec, map_create, obj_pin};
    use proxy_common::{Backend, BackendSlotKey, SlotChunk, SlotChunkKey, maps};
    use proxy_userspace::mode::ebpf::old_maps::{CarriedOver, carry_over};

    if !require_root("an_older_agents_backends_and_slots_are_carried_over") {
        return;
    }
    let mut h = Harness::seeded();
    let old_map = |name: &str, key_size: u32, value_size: u32| {
        let fd = map_create(&MapSpec {
            map_type: MAP_TYPE_HASH,
            key_size,
            value_size,
            max_entries: 1024,
            flags: MAP_F_NO_PREALLOC,
            name,
        })
        .expect("an old-style map");
        obj_pin(std::os::fd::AsFd::as_fd(&fd), &h.pin_dir().join(name)).expect("pinned as the older agent did");
        fd
    };
    // The seed's slots, one per entry in the old map, none in today's.
    let chunks_pin = MapData::from_pin(h.pin_dir().join(maps::BACKEND_SLOTS)).expect("pinned slots");
    let mut chunks: BpfHashMap<MapData, SlotChunkKey, SlotChunk> =
        BpfHashMap::try_from(Map::from_map_data(chunks_pin).expect("a map")).expect("a hash map");
    let seeded: Vec<(SlotChunkKey, SlotChunk)> = chunks.iter().map(|e| e.expect("a chunk")).collect();
    let old_slots = old_map(maps::OLD_BACKEND_SLOTS, 8, 4);
    let mut slots = 0;
    for (key, chunk) in &seeded {
        for (index, id) in (0u32..).zip(chunk.ids).filter(|(_, id)| *id != 0) {
            let slot = BackendSlotKey {
                backend_set: key.backend_set,
                slot: key.chunk * 16 + index,
            };
            // SAFETY: the map was created with these key and value sizes.
            unsafe { bpf_sys::map::update_elem(std::os::fd::AsFd::as_fd(&old_slots), &slot, &id) }.expect("old slot");
            slots += 1;
        }
        chunks.remove(key).expect("today's chunk gone");
    }
    let array_pin = MapData::from_pin(h.pin_dir().join(maps::BACKENDS)).expect("pinned backends");
    let mut array: Array<MapData, Backend> =
        Array::try_from(Map::from_map_data(array_pin).expect("a map")).expect("an array");
    // The seed's few backends have the lowest ids.
    let held: Vec<(u32, Backend)> = (1..64)
        .filter_map(|id| Some((id, array.get(&id, 0).ok().filter(Backend::is_present)?)))
        .collect();
    assert!(!held.is_empty(), "the seed has backends");
    let old = old_map(maps::OLD_BACKENDS, 4, 8);
    let past_the_array = maps::BACKENDS_MAX + 5;
    let stray = [(
        past_the_array,
        Backend::new(Ipv4Addr::new(10, 244, 9, 9), 80, proto::TCP),
    )];
    for (id, backend) in held.iter().chain(&stray) {
        // SAFETY: the map was created with these key and value sizes.
        unsafe { bpf_sys::map::update_elem(std::os::fd::AsFd::as_fd(&old), id, backend) }.expect("old entry");
        if *id < maps::BACKENDS_MAX {
            array
                .set(
                    *id,
                    Backend {
                        addr_be: 0,
                        port_be: 0,
                        proto: 0,
                        flags: 0,
                    },
                    0,
                )
                .expect("cleared");
        }
    }
    let syn = |h: &mut Harness| Frame::tcp(client(h), cluster_ip(), SYN);
    let counts = h.counts();
    let frame = syn(&mut h);
    h.try_run(Prog::TcIngress, &frame.build()).expect("test run");
    let gained = verdicts_gained(&counts, &h.counts());
    assert!(
        gained.iter().all(|(v, ..)| *v != Verdict::DnatNew),
        "without its backends no new flow is translated: {gained:?}"
    );

    let done = carry_over(h.pin_dir()).expect("carried over");
    assert_eq!(
        done,
        Some(CarriedOver {
            backends: held.len() as u64,
            left_out: 1,
            slots,
        })
    );
    for name in [maps::OLD_BACKENDS, maps::OLD_BACKEND_SLOTS] {
        assert!(!h.pin_dir().join(name).exists(), "{name} is unpinned");
    }
    for (id, backend) in &held {
        assert_eq!(array.get(id, 0).expect("entry"), *backend, "backend {id} is back");
    }
    for (key, chunk) in &seeded {
        assert_eq!(
            chunks.get(key, 0).expect("chunk"),
            *chunk,
            "slots of set {} are back",
            key.backend_set
        );
    }
    let frame = syn(&mut h);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("SYN after the carry-over", frame, &seed_backends(), Verdict::DnatNew),
    );
    assert_eq!(carry_over(h.pin_dir()).expect("nothing to do"), None);
}

/// A removed backend's id must not send its flows to whatever backend later
/// gets the same id (here: another Service's): a TCP flow goes on to its
/// own backend, whose address its conntrack entry holds.
#[test]
fn flows_of_a_removed_backend_never_reach_another_services_backend() {
    if !require_root("flows_of_a_removed_backend_never_reach_another_services_backend") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let svc = cluster_ip();
    let mut flows = Vec::new();
    for _ in 0..12 {
        let frame = Frame::tcp(client(&mut h), svc, SYN);
        let out = run_case(
            &mut h,
            Prog::TcIngress,
            &Case::dnat("SYN", frame.clone(), &seed, Verdict::DnatNew),
        );
        flows.push((frame, dnat_dst(&out)));
    }
    // Remove the backend of the first flow; then another Service gets a new
    // backend (the freed id is the smallest free one).
    let gone = flows[0].1;
    let remaining: Vec<SocketAddrV4> = seed.iter().copied().filter(|b| *b != gone).collect();
    sync_seed_tcp(&mut h, &remaining);
    let intruder = addr(Ipv4Addr::new(10, 244, 9, 99), 9999);
    h.sync(&service(
        "default/other:http",
        Protocol::Tcp,
        Ipv4Addr::new(10, 96, 0, 99),
        80,
        None,
        &[intruder],
    ));
    for (frame, backend) in &flows {
        let input = frame.clone().with_tcp(|t| t.flags = ACK).build();
        let out = h.run(Prog::TcIngress, &input);
        let dst = dnat_dst(&out);
        assert_eq!(dst, *backend, "flow changed backend; input {}", hex(&input));
    }
}

#[test]
fn traffic_not_for_a_service_passes_untouched() {
    if !require_root("traffic_not_for_a_service_passes_untouched") {
        return;
    }
    let mut h = Harness::seeded();
    for prog in Prog::ALL {
        let c = client(&mut h);
        let cases = [
            Case::pass(
                "TCP to an unknown IP",
                &Frame::tcp(c, addr(Ipv4Addr::new(8, 8, 8, 8), 443), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "UDP to an unknown IP",
                &Frame::udp(c, addr(Ipv4Addr::new(10, 96, 0, 11), 88), b"x"),
                Verdict::PassNotService,
            ),
            Case::pass(
                "TCP to ClusterIP, another port",
                &Frame::tcp(c, addr(CLUSTER_IP, 89), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "UDP to ClusterIP, the backend port",
                &Frame::udp(c, addr(CLUSTER_IP, BACKEND_PORT), b"x"),
                Verdict::PassNotService,
            ),
            Case::pass(
                "UDP to a TCP-only Service port",
                &Frame::udp(c, addr(TCP_ONLY_IP, TCP_ONLY_PORT), b"x"),
                Verdict::PassNotService,
            ),
            Case::pass(
                "TCP to a backend directly",
                &Frame::tcp(c, seed_backends()[0], SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "TCP from the ClusterIP (source is a frontend)",
                &Frame::tcp(cluster_ip(), c, SYN | ACK),
                Verdict::PassNotService,
            ),
            Case::pass(
                "TCP to the node IP, SSH",
                &Frame::tcp(c, addr(NODE_IP, 22), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "TCP to the empty Service, another port",
                &Frame::tcp(c, addr(EMPTY_IP, 81), SYN),
                Verdict::PassNotService,
            ),
        ];
        for case in &cases {
            run_case(&mut h, prog, case);
        }
    }
    assert!(
        h.conntrack().is_empty(),
        "non-Service traffic created flows: {:?}",
        h.conntrack()
    );
}

#[test]
fn other_protocols_pass_untouched() {
    if !require_root("other_protocols_pass_untouched") {
        return;
    }
    let mut h = Harness::seeded();
    let raw = |proto: u8| {
        // Bytes that read like ports 40000 -> 88 if taken for TCP/UDP.
        Frame::tcp(addr(CLIENT_IP, 40000), cluster_ip(), SYN).with_ip(|ip| ip.proto = Some(proto))
    };
    let ethertype = |t: u16| {
        let mut f = Frame::udp(addr(CLIENT_IP, 40000), cluster_ip(), b"x");
        let bytes = f.build()[14..].to_vec();
        f.net = Net::Raw {
            ether_type: t,
            payload: bytes,
        };
        f
    };
    let cases = [
        Case::pass(
            "ARP who-has ClusterIP",
            &Frame::arp_request(CLIENT_IP, CLUSTER_IP),
            Verdict::PassNotIpv4OrL4,
        ),
        // Not for an IPv6 Service (none is programmed): the IPv6 path's miss.
        Case::pass("IPv6 UDP", &Frame::ipv6_udp(cluster_ip()), Verdict::PassNotService),
        Case::pass(
            "ICMP echo to ClusterIP",
            &Frame::icmp_echo(CLIENT_IP, CLUSTER_IP),
            Verdict::PassNotIpv4OrL4,
        ),
        Case::pass(
            "ICMP echo to the empty Service",
            &Frame::icmp_echo(CLIENT_IP, EMPTY_IP),
            Verdict::PassNotIpv4OrL4,
        ),
        // Parsed as SCTP (ports where TCP has them): no SCTP Service there.
        Case::pass(
            "SCTP-numbered packet with TCP-like bytes to ClusterIP",
            &raw(132),
            Verdict::PassNotService,
        ),
        Case::pass("GRE-numbered packet to ClusterIP", &raw(47), Verdict::PassNotIpv4OrL4),
        Case::pass(
            "IPv4 packet under the IPv6 ether type (padded to 54 bytes)",
            &ethertype(0x86dd).with_padding(&[0; 20]),
            // Version 4 where IPv6 must have 6.
            Verdict::PassMalformed,
        ),
        Case::pass(
            "IPv4 packet under an 802.3 length field",
            &ethertype(0x0040),
            Verdict::PassNotIpv4OrL4,
        ),
        Case::pass(
            "IPv4 packet under ether type 0x9100 (old QinQ)",
            &ethertype(0x9100),
            Verdict::PassNotIpv4OrL4,
        ),
    ];
    for prog in Prog::ALL {
        for case in &cases {
            run_case(&mut h, prog, case);
        }
    }
    assert!(h.conntrack().is_empty(), "{:?}", h.conntrack());
}

#[test]
fn no_backends_answers_rst_and_port_unreachable() {
    if !require_root("no_backends_answers_rst_and_port_unreachable") {
        return;
    }
    let mut h = Harness::seeded();
    let empty = addr(EMPTY_IP, EMPTY_PORT);
    let empty_np = addr(NODE_IP, EMPTY_NODE_PORT);
    for prog in Prog::ALL {
        let mut cases = vec![
            Case::reject("SYN -> RST|ACK, ack = seq + 1", &Frame::tcp(client(&mut h), empty, SYN)),
            Case::reject(
                "SYN with options and payload -> ack = seq + len + 1",
                &Frame::tcp(client(&mut h), empty, SYN).with_tcp(|t| {
                    t.options = SYN_OPTIONS.to_vec();
                    t.payload = b"fast open".to_vec();
                    t.seq = 0xffff_fffe;
                }),
            ),
            Case::reject(
                "ACK with payload -> RST, seq = ack",
                &Frame::tcp(client(&mut h), empty, PSH | ACK).with_tcp(|t| t.payload = b"data".to_vec()),
            ),
            Case::reject(
                "FIN|ACK -> RST, seq = ack",
                &Frame::tcp(client(&mut h), empty, FIN | ACK).with_tcp(|t| t.ack = 0xdead_beef),
            ),
            Case::reject(
                "FIN with payload, no ACK -> ack = seq + len + 1",
                &Frame::tcp(client(&mut h), empty, FIN | PSH).with_tcp(|t| t.payload = b"bye".to_vec()),
            ),
            Case::reject(
                "SYN|FIN -> ack = seq + 2",
                &Frame::tcp(client(&mut h), empty, SYN | FIN),
            ),
            Case::reject("no flags -> RST|ACK, ack = seq", &Frame::tcp(client(&mut h), empty, 0)),
            Case::reject(
                "SYN with TTL 3, tos, id, padding -> fixed header fields",
                &Frame::tcp(client(&mut h), empty, SYN)
                    .with_ip(|ip| {
                        ip.ttl = 3;
                        ip.tos = 0x10;
                        ip.id = 77;
                        ip.df = false;
                    })
                    .with_padding(&[0xab; 6]),
            ),
            Case::reject(
                "SYN to the empty Service's NodePort -> RST from the node IP",
                &Frame::tcp(external(&mut h), empty_np, SYN),
            ),
            Case::reject("UDP -> port unreachable", &Frame::udp(client(&mut h), empty, b"query")),
            Case::reject(
                "UDP without payload (frame grows to 70)",
                &Frame::udp(client(&mut h), empty, b""),
            ),
            Case::reject(
                "UDP with checksum 0",
                &Frame::udp(client(&mut h), empty, b"q").with_udp(|u| u.zero_checksum = true),
            ),
            Case::reject(
                "UDP with 1000 bytes payload, TTL 1 -> quotes 28 bytes",
                &Frame::udp(client(&mut h), empty, &[7; 1000]).with_ip(|ip| ip.ttl = 1),
            ),
            Case::reject(
                "UDP padded to 60 bytes",
                &Frame::udp(client(&mut h), empty, b"x").with_padding(&[0x11; 17]),
            ),
            Case::reject(
                "UDP to the empty Service's NodePort -> ICMP from the node IP",
                &Frame::udp(external(&mut h), empty_np, b"x"),
            ),
        ];
        cases.push(Case::new(
            "RST to the empty Service passes",
            Frame::tcp(client(&mut h), empty, RST).build(),
            Expect::PassCountedAsOneOf(RST_TO_EMPTY_VERDICTS),
        ));
        cases.push(Case::new(
            "RST|ACK to the empty Service passes",
            Frame::tcp(client(&mut h), empty, RST | ACK).build(),
            Expect::PassCountedAsOneOf(RST_TO_EMPTY_VERDICTS),
        ));
        for case in &cases {
            run_case(&mut h, prog, case);
        }
    }
}

/// Frames that a lax parser would translate or answer, each with one flaw.
fn malformed_cases(h: &mut Harness) -> Vec<Case> {
    let m = Verdict::PassMalformed;
    let mut cases = Vec::new();
    for (label, dst) in [("service", cluster_ip()), ("empty service", addr(EMPTY_IP, EMPTY_PORT))] {
        let syn = |h: &mut Harness| Frame::tcp(client(h), dst, SYN);
        let udp = |h: &mut Harness| Frame::udp(client(h), dst, b"payload!");
        for ihl in 0..5 {
            cases.push(Case::pass(
                format!("{label}: IHL {ihl}"),
                &syn(h).with_ip(|ip| ip.ihl = Some(ihl)),
                m,
            ));
            cases.push(Case::pass(
                format!("{label}: UDP, IHL {ihl}"),
                &udp(h).with_ip(|ip| ip.ihl = Some(ihl)),
                m,
            ));
        }
        cases.push(Case::pass(
            format!("{label}: IHL 6 without options"),
            &syn(h).with_ip(|ip| ip.ihl = Some(6)),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: IHL 15 without options"),
            &syn(h).with_ip(|ip| ip.ihl = Some(15)),
            m,
        ));
        for version in [0, 5, 6, 15] {
            cases.push(Case::pass(
                format!("{label}: version {version}"),
                &syn(h).with_ip(|ip| ip.version = Some(version)),
                m,
            ));
        }
        cases.push(Case::pass(
            format!("{label}: IP options (4 x NOP)"),
            &syn(h).with_ip(|ip| ip.options = vec![1; 4]),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: UDP, IP options (record route)"),
            &udp(h).with_ip(|ip| ip.options = vec![7, 7, 4, 0, 0, 0, 0, 0]),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: IP options (40 bytes)"),
            &syn(h).with_ip(|ip| ip.options = vec![1; 40]),
            m,
        ));
        let len = |f: &Frame| f.build().len() as u16 - 14;
        let s = syn(h);
        let too_big = len(&s) + 1;
        cases.push(Case::pass(
            format!("{label}: tot_len one beyond the frame"),
            &s.with_ip(|ip| ip.tot_len = Some(too_big)),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: tot_len 65535"),
            &syn(h).with_ip(|ip| ip.tot_len = Some(65535)),
            m,
        ));
        let u = udp(h);
        let too_big = len(&u) + 1;
        cases.push(Case::pass(
            format!("{label}: UDP, tot_len one beyond the frame"),
            &u.with_ip(|ip| ip.tot_len = Some(too_big)),
            m,
        ));
        for tot_len in [0, 19, 20, 39] {
            cases.push(Case::pass(
                format!("{label}: TCP, tot_len {tot_len}"),
                &syn(h).with_ip(|ip| ip.tot_len = Some(tot_len)),
                m,
            ));
        }
        for tot_len in [0, 19, 20, 27] {
            cases.push(Case::pass(
                format!("{label}: UDP, tot_len {tot_len}"),
                &udp(h).with_ip(|ip| ip.tot_len = Some(tot_len)),
                m,
            ));
        }
        // A valid TCP header followed by padding that tot_len excludes, but
        // tot_len cuts into the header.
        cases.push(Case::pass(
            format!("{label}: TCP, tot_len 39 with the frame padded"),
            &syn(h).with_ip(|ip| ip.tot_len = Some(39)).with_padding(&[0; 20]),
            m,
        ));
        for doff in 0..5 {
            cases.push(Case::pass(
                format!("{label}: TCP data offset {doff}"),
                &syn(h).with_tcp(|t| t.data_offset = Some(doff)),
                m,
            ));
        }
        cases.push(Case::pass(
            format!("{label}: TCP data offset 6, no options"),
            &syn(h).with_tcp(|t| t.data_offset = Some(6)),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: TCP data offset 15, 20 bytes options"),
            &syn(h).with_tcp(|t| {
                t.options = SYN_OPTIONS.to_vec();
                t.data_offset = Some(15);
            }),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: TCP data offset 10, options cut by tot_len, frame padded"),
            &syn(h)
                .with_tcp(|t| t.options = SYN_OPTIONS.to_vec())
                .with_ip(|ip| ip.tot_len = Some(20 + 36)),
            m,
        ));
        // A later fragment whose first was not seen: never taken for the
        // ports its payload happens to hold (see `fragments_*` for the rest).
        let untracked = Verdict::PassFragmentUntracked;
        for off in [1, 185, 8191] {
            cases.push(Case::pass(
                format!("{label}: fragment offset {off}, first unseen"),
                &syn(h).with_ip(|ip| ip.frag_offset = off),
                untracked,
            ));
            cases.push(Case::pass(
                format!("{label}: UDP, fragment offset {off}, first unseen"),
                &udp(h).with_ip(|ip| ip.frag_offset = off),
                untracked,
            ));
        }
        cases.push(Case::pass(
            format!("{label}: MF and offset, first unseen"),
            &syn(h).with_ip(|ip| {
                ip.mf = true;
                ip.frag_offset = 2;
            }),
            untracked,
        ));
        cases.push(Case::pass(
            format!("{label}: 802.1Q"),
            &syn(h).with_vlan(ETHERTYPE_VLAN, 100),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: UDP, 802.1Q VLAN 0"),
            &udp(h).with_vlan(ETHERTYPE_VLAN, 0),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: QinQ 802.1ad + 802.1Q"),
            &syn(h).with_vlan(ETHERTYPE_QINQ, 10).with_vlan(ETHERTYPE_VLAN, 20),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: 802.1Q + 802.1Q"),
            &udp(h).with_vlan(ETHERTYPE_VLAN, 10).with_vlan(ETHERTYPE_VLAN, 20),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: 802.1ad only"),
            &syn(h).with_vlan(ETHERTYPE_QINQ, 30),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: TCP source port 0"),
            &syn(h).with_tcp(|t| t.sport = 0),
            m,
        ));
        cases.push(Case::pass(
            format!("{label}: UDP source port 0"),
            &udp(h).with_udp(|u| u.sport = 0),
            m,
        ));
        // "Lengths consistent": the UDP length field covers its header and
        // stays within the IPv4 payload (8 + 8 bytes here).
        for length in [0, 7, 17, 0xffff] {
            cases.push(Case::pass(
                format!("{label}: UDP length field {length}"),
                &udp(h).with_udp(|u| u.length = Some(length)),
                m,
            ));
        }
    }
    let c = client(h);
    cases.push(Case::pass(
        "TCP to ClusterIP port 0",
        &Frame::tcp(c, addr(CLUSTER_IP, 0), SYN),
        m,
    ));
    cases.push(Case::pass(
        "UDP to ClusterIP port 0",
        &Frame::udp(c, addr(CLUSTER_IP, 0), b"x"),
        m,
    ));
    cases.push(Case::pass(
        "UDP to the node IP, port 0",
        &Frame::udp(c, addr(NODE_IP, 0), b"x"),
        m,
    ));
    cases
}

#[test]
fn malformed_frames_pass_untouched() {
    if !require_root("malformed_frames_pass_untouched") {
        return;
    }
    let mut h = Harness::seeded();
    let cases = malformed_cases(&mut h);
    for prog in Prog::ALL {
        for case in &cases {
            run_case(&mut h, prog, case);
        }
    }
    assert!(
        h.conntrack().is_empty(),
        "malformed frames created flows: {:?}",
        h.conntrack()
    );
}

/// Every prefix of valid frames, from 14 bytes (the shortest the kernel
/// takes) to one byte short.
#[test]
fn every_truncation_passes_untouched() {
    if !require_root("every_truncation_passes_untouched") {
        return;
    }
    let mut h = Harness::seeded();
    let c = addr(CLIENT_IP, 40000);
    let frames = [
        (
            "SYN with options and payload to the ClusterIP",
            Frame::tcp(c, cluster_ip(), SYN).with_tcp(|t| {
                t.options = SYN_OPTIONS.to_vec();
                t.payload = b"0123456789".to_vec();
            }),
        ),
        ("plain SYN to the ClusterIP", Frame::tcp(c, cluster_ip(), SYN)),
        ("UDP to the NodePort", Frame::udp(c, node_port(), b"0123456789")),
        (
            "SYN to the empty Service",
            Frame::tcp(c, addr(EMPTY_IP, EMPTY_PORT), SYN),
        ),
        (
            "UDP to the empty Service",
            Frame::udp(c, addr(EMPTY_IP, EMPTY_PORT), b"abc"),
        ),
    ];
    let (mut runs, mut refused) = (0, 0);
    for prog in Prog::ALL {
        for (what, frame) in &frames {
            let full = frame.build();
            for len in 14..full.len() {
                let case = Case::new(
                    format!("{what}, first {len} of {} bytes", full.len()),
                    full[..len].to_vec(),
                    Expect::Pass(Verdict::PassMalformed),
                );
                if try_case(&mut h, prog, &case).is_some() {
                    runs += 1;
                } else {
                    refused += 1;
                }
            }
        }
    }
    println!("{runs} truncated frames passed untouched; the kernel refused {refused} (tc, IPv4 header under 20 bytes)");
    assert!(
        h.conntrack().is_empty(),
        "truncated frames created flows: {:?}",
        h.conntrack()
    );
}

/// Counters after a known mix add up to exactly what was sent.
#[test]
fn counters_match_what_was_sent() {
    if !require_root("counters_match_what_was_sent") {
        return;
    }
    let mut h = Harness::seeded();
    let mut want = [(0u64, 0u64); Verdict::COUNT as usize];
    let mut send = |h: &mut Harness, prog: Prog, frame: Vec<u8>, verdict: Verdict| -> Output {
        want[verdict as usize].0 += 1;
        want[verdict as usize].1 += frame.len() as u64;
        h.run(prog, &frame)
    };
    for prog in Prog::ALL {
        for i in 0..5u16 {
            let c = client(&mut h);
            let syn = Frame::tcp(c, cluster_ip(), SYN).with_tcp(|t| t.payload = vec![0; usize::from(i)]);
            send(&mut h, prog, syn.build(), Verdict::DnatNew);
            send(
                &mut h,
                prog,
                syn.with_tcp(|t| t.flags = ACK).build(),
                Verdict::DnatEstablished,
            );
            let other = addr(Ipv4Addr::new(1, 1, 1, 1), 53);
            send(
                &mut h,
                prog,
                Frame::udp(c, other, &vec![1; usize::from(i)]).build(),
                Verdict::PassNotService,
            );
            send(
                &mut h,
                prog,
                Frame::icmp_echo(CLIENT_IP, CLUSTER_IP).build(),
                Verdict::PassNotIpv4OrL4,
            );
            let frag = Frame::udp(client(&mut h), cluster_ip(), &[3; 64]).with_ip(|ip| ip.frag_offset = 100);
            send(&mut h, prog, frag.build(), Verdict::PassFragmentUntracked);
            let empty = Frame::udp(client(&mut h), addr(EMPTY_IP, EMPTY_PORT), &vec![2; usize::from(i)]);
            send(&mut h, prog, empty.build(), Verdict::RejectNoBackend);
        }
    }
    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        for _ in 0..3 {
            let c = client(&mut h);
            let out = send(
                &mut h,
                prog,
                Frame::udp(c, cluster_ip(), b"q").build(),
                Verdict::DnatNew,
            );
            send(
                &mut h,
                prog,
                Frame::udp(dnat_dst(&out), c, b"answer").build(),
                Verdict::RevNat,
            );
        }
    }
    let got: Vec<(Verdict, u64, u64)> = h
        .counts()
        .iter()
        .zip(Verdict::ALL)
        .map(|(c, v)| (v, c.packets, c.bytes))
        .collect();
    let want: Vec<(Verdict, u64, u64)> = want.iter().zip(Verdict::ALL).map(|(w, v)| (v, w.0, w.1)).collect();
    assert_eq!(got, want, "verdict counters (verdict, packets, bytes)");
}

/// The builder's own frames are what the tables assume (no kernel needed).
#[test]
fn builder_frames_are_valid() {
    let c = addr(CLIENT_IP, 40000);
    for f in [
        Frame::tcp(c, cluster_ip(), SYN).with_tcp(|t| t.options = SYN_OPTIONS.to_vec()),
        Frame::udp(c, node_port(), b"x").with_padding(&[0xee; 17]),
        Frame::icmp_echo(CLIENT_IP, CLUSTER_IP),
    ] {
        let bytes = f.build();
        check(&bytes).unwrap_or_else(|e| panic!("{e}: {}", hex(&bytes)));
    }
    assert!(matches!(
        parse_strict(
            &Frame::tcp(c, cluster_ip(), SYN)
                .with_ip(|ip| ip.options = vec![1; 4])
                .build()
        ),
        Strict::Malformed(_)
    ));
}

/// The SNAT fallback at XDP: flows whose replies would not come back
/// through this node (NodePort to a backend on another node, a pod
/// reaching itself) are DNATed by XDP itself, which leaves the SNAT mark in
/// the packet's metadata for tc ingress to copy into the skb, where the
/// kernel's masquerade rule finds it; tc ingress then passes the packet
/// as it is.
#[test]
fn xdp_translates_flows_needing_snat_and_leaves_the_mark_to_tc() {
    if !require_root("xdp_translates_flows_needing_snat_and_leaves_the_mark_to_tc") {
        return;
    }
    const SNAT_MARK: u32 = 0x4000;
    let mut h = Harness::with_snat_mark(vec![NODE_IP], SNAT_MARK);
    h.maps.set_topology(Some("this-node".into()), false);
    let remote: Vec<Endpoint> = BACKEND_IPS
        .iter()
        .map(|ip| Endpoint {
            node_name: Some("other-node".into()),
            ..Endpoint::ready(*ip, 80)
        })
        .collect();
    h.sync(&ServicePort {
        name: "default/remote:http".into(),
        protocol: Protocol::Tcp,
        cluster_ip: CLUSTER_IP.into(),
        port: SERVICE_PORT,
        node_port: Some(NODE_PORT),
        endpoints: remote,
        ..ServicePort::default()
    });
    // (new, established) translations counted since `before`.
    let dnats = |h: &Harness, before: &[VerdictCounter]| {
        let grew = |v: Verdict| h.counts()[v as usize].packets - before[v as usize].packets;
        (
            grew(Verdict::DnatNew),
            grew(Verdict::DnatEstablished),
            grew(Verdict::PassToTc),
        )
    };

    let to_node_port = Frame::tcp(external(&mut h), node_port(), SYN).build();
    let before = h.counts();
    let out = h.run(Prog::XdpUplink, &to_node_port);
    assert_eq!((out.code, out.xdp_mark()), (XDP_PASS, Some(SNAT_MARK)));
    let out = out.without_meta();
    let picked = *dnat_dst(&out).ip();
    assert!(BACKEND_IPS.contains(&picked), "DNATed by XDP: {picked}");
    check(&out.frame).expect("valid checksums after DNAT");
    assert_eq!(dnats(&h, &before), (1, 0, 0), "a new flow, not left to tc");
    let tracked = h.conntrack();
    let forward = tracked.iter().find(|(_, v)| !v.is_reply()).map(|(_, v)| v.flags);
    assert_eq!(
        forward.map(|f| (f & FLAG_SNAT, f & FLAG_HANDED_TO_TC)),
        Some((FLAG_SNAT, 0)),
        "tracked for SNAT, by XDP: {tracked:?}"
    );
    // tc ingress behind it sees the translated packet, which is no
    // frontend's: untouched, with the mark XDP left (the skb's mark is
    // copied from the metadata; a test run carries none in).
    let (behind, mark) = h.run_tc_marked(Prog::TcIngress, &out.frame);
    assert_eq!((behind.code, &behind.frame, mark), (TC_ACT_OK, &out.frame, 0));

    // Later packets of the flow: marked and DNATed by XDP, as established.
    let before = h.counts();
    let out = h.run(Prog::XdpUplink, &to_node_port);
    assert_eq!(out.xdp_mark(), Some(SNAT_MARK));
    assert_eq!(dnat_dst(&out.without_meta()).ip(), &picked);
    assert_eq!(dnats(&h, &before), (0, 1, 0));

    // ClusterIP traffic to a remote backend needs no SNAT: no mark.
    let to_cluster_ip = Frame::tcp(external(&mut h), cluster_ip(), SYN).build();
    let out = h.run(Prog::XdpUplink, &to_cluster_ip);
    assert_eq!(out.xdp_mark(), None);
    assert!(BACKEND_IPS.contains(dnat_dst(&out).ip()), "XDP DNATs ClusterIP traffic");

    // Hairpin: a backend reaching its own Service is marked whichever
    // backend it gets; send until one flow is self-directed.
    let own = BACKEND_IPS[0];
    let mut to_itself = 0;
    for _ in 0..64 {
        let frame = Frame::tcp(SocketAddrV4::new(own, h.next_port()), cluster_ip(), SYN).build();
        let out = h.run(Prog::XdpUplink, &frame);
        if dnat_dst(&out.without_meta()).ip() == &own {
            assert_eq!(out.xdp_mark(), Some(SNAT_MARK), "a hairpin must be masqueraded");
            to_itself += 1;
        }
    }
    assert!(to_itself > 0, "no hairpin flow in 64 tries");
}

// ---------------------------------------------------------------------------
// Traffic policies (externalTrafficPolicy / internalTrafficPolicy: Local).

const THIS_NODE: &str = "this-node";
const OTHER_NODE: &str = "other-node";
const LOCAL_TCP: &str = "default/local:http";
const LOCAL_UDP: &str = "default/local:dns";

/// The seed backends, `BACKEND_IPS[i]` on `nodes[i]`.
fn backends_on(nodes: [&str; 3]) -> Vec<Endpoint> {
    endpoints_on(&BACKEND_IPS, nodes)
}

/// Endpoints `ips[i]`:[`BACKEND_PORT`] on `nodes[i]` (either family).
fn endpoints_on<A: Copy + Into<std::net::IpAddr>>(ips: &[A; 3], nodes: [&str; 3]) -> Vec<Endpoint> {
    ips.iter()
        .zip(nodes)
        .map(|(ip, node)| Endpoint {
            node_name: Some(node.into()),
            ..Endpoint::ready(*ip, BACKEND_PORT)
        })
        .collect()
}

/// The seed Service's addresses (TCP and UDP) with `endpoints` and the
/// given policies, on a node named [`THIS_NODE`].
fn sync_policy_service(h: &mut Harness, endpoints: Vec<Endpoint>, external: TrafficPolicy, internal: TrafficPolicy) {
    h.maps.set_topology(Some(THIS_NODE.into()), false);
    for (name, protocol) in [(LOCAL_TCP, Protocol::Tcp), (LOCAL_UDP, Protocol::Udp)] {
        h.sync(&ServicePort {
            name: name.into(),
            protocol,
            cluster_ip: CLUSTER_IP.into(),
            port: SERVICE_PORT,
            node_port: Some(NODE_PORT),
            endpoints: endpoints.clone(),
            external_policy: external,
            internal_policy: internal,
            ..ServicePort::default()
        });
    }
}

/// The backends a frontend picks from, as the maps hold them.
fn frontend_backends(h: &Harness, to: SocketAddrV4, proto: u8) -> (u32, Vec<Ipv4Addr>) {
    let value = h
        .maps
        .frontend(*to.ip(), to.port(), proto)
        .unwrap_or_else(|| panic!("no frontend {to}"));
    let backends = h.maps.backend_set(&value).expect("reading the backend set");
    (value.flags, backends.iter().map(proxy_common::Backend::addr).collect())
}

fn new_flow(h: &mut Harness, from: fn(&mut Harness) -> SocketAddrV4, to: SocketAddrV4, protocol: Protocol) -> Frame {
    let src = from(h);
    match protocol {
        Protocol::Tcp => Frame::tcp(src, to, SYN),
        Protocol::Udp => Frame::udp(src, to, b"q"),
        Protocol::Sctp => Frame::sctp(src, to, 0, &testbed::frame::SCTP_INIT_CHUNK),
    }
}

/// The backends `count` new flows from `from` to `to` through `prog`
/// reached (every one must be DNATed to one of `allowed`).
fn reached(
    h: &mut Harness,
    prog: Prog,
    from: fn(&mut Harness) -> SocketAddrV4,
    to: SocketAddrV4,
    allowed: &[SocketAddrV4],
    count: usize,
) -> std::collections::BTreeSet<SocketAddrV4> {
    let mut seen = std::collections::BTreeSet::new();
    for protocol in [Protocol::Tcp, Protocol::Udp] {
        for _ in 0..count {
            let frame = new_flow(h, from, to, protocol);
            let out = run_case(h, prog, &Case::dnat("new flow", frame, allowed, Verdict::DnatNew));
            seen.insert(dnat_dst(&out));
        }
    }
    seen
}

/// externalTrafficPolicy: Local: the node-port frontends pick from this
/// node's backend only and keep the client's address (no SNAT: XDP DNATs
/// them itself, tc marks nothing), though the SNAT fallback is on and the
/// same flows to another node's backend would be masqueraded; the
/// ClusterIP frontends still pick from every backend.
#[test]
fn external_local_node_port_picks_local_backends_without_snat() {
    if !require_root("external_local_node_port_picks_local_backends_without_snat") {
        return;
    }
    let mut h = Harness::with_snat_mark(vec![NODE_IP], 0x4000);
    let nodes = [OTHER_NODE, THIS_NODE, OTHER_NODE];
    sync_policy_service(&mut h, backends_on(nodes), TrafficPolicy::Local, TrafficPolicy::Cluster);
    let local = addr(BACKEND_IPS[1], BACKEND_PORT);

    for p in [proto::TCP, proto::UDP] {
        assert_eq!(
            frontend_backends(&h, node_port(), p),
            (FLAG_NODE_PORT | FLAG_EXTERNAL_LOCAL, vec![BACKEND_IPS[1]]),
            "the node port's frontend holds this node's backend only"
        );
        let (flags, mut all) = frontend_backends(&h, cluster_ip(), p);
        all.sort();
        assert_eq!((flags, all), (0, BACKEND_IPS.to_vec()), "the ClusterIP's holds all");
    }

    for prog in [Prog::XdpUplink, Prog::TcIngress] {
        let seen = reached(&mut h, prog, external, node_port(), &[local], 16);
        assert_eq!(seen, [local].into(), "{}", prog.name());
    }
    let tracked = h.conntrack();
    assert!(!tracked.is_empty());
    assert!(
        tracked.iter().all(|(_, v)| v.flags & FLAG_SNAT == 0),
        "no node-port flow may be marked for SNAT: {tracked:?}"
    );

    // ClusterIP traffic is not external: every backend, local or not.
    let seen = reached(&mut h, Prog::TcIngress, client, cluster_ip(), &seed_backends(), 40);
    assert_eq!(seen.len(), 3, "{seen:?}");

    // The status read-back says so.
    let status = proxy_userspace::dump::render_services(&h.maps.snapshot().expect("snapshot"));
    assert!(
        status.contains(&format!(
            "TCP  {NODE_IP}:{NODE_PORT} NodePort (Local: this node's endpoints)\n  -> {local} "
        )),
        "{status}"
    );
}

/// externalTrafficPolicy: Local on a node without a local backend: new
/// node-port flows are dropped (XDP_DROP / TC_ACT_SHOT, no RST or ICMP
/// answer), counted as drop_no_local_backend; the ClusterIP still reaches
/// the other node's backends; a Local Service without any endpoint is
/// rejected as before.
#[test]
fn external_local_without_local_backends_drops() {
    if !require_root("external_local_without_local_backends_drops") {
        return;
    }
    let mut h = Harness::with_snat_mark(vec![NODE_IP], 0x4000);
    sync_policy_service(
        &mut h,
        backends_on([OTHER_NODE; 3]),
        TrafficPolicy::Local,
        TrafficPolicy::Cluster,
    );
    assert_eq!(
        frontend_backends(&h, node_port(), proto::TCP),
        (FLAG_NODE_PORT | FLAG_EXTERNAL_LOCAL, vec![])
    );
    for prog in Prog::ALL {
        for protocol in [Protocol::Tcp, Protocol::Udp] {
            let frame = new_flow(&mut h, external, node_port(), protocol);
            run_case(
                &mut h,
                prog,
                &Case::drop("new flow to a Local node port", &frame, Verdict::DropNoLocalBackend),
            );
        }
        let c = client(&mut h);
        let frame = Frame::tcp(c, node_port(), SYN);
        run_case(
            &mut h,
            prog,
            &Case::drop("a pod's flow to it too", &frame, Verdict::DropNoLocalBackend),
        );
    }
    assert!(h.conntrack().is_empty(), "dropped flows are not tracked");
    let seen = reached(&mut h, Prog::TcIngress, client, cluster_ip(), &seed_backends(), 40);
    assert_eq!(seen.len(), 3, "{seen:?}");
    let status = proxy_userspace::dump::render_services(&h.maps.snapshot().expect("snapshot"));
    assert!(
        status.contains(&format!(
            "TCP  {NODE_IP}:{NODE_PORT} NodePort (Local, no endpoint on this node: drop)\n"
        )),
        "{status}"
    );

    // No endpoint anywhere: rejected, whatever the policy (like kube-proxy).
    sync_policy_service(&mut h, vec![], TrafficPolicy::Local, TrafficPolicy::Local);
    assert_eq!(frontend_backends(&h, node_port(), proto::TCP), (FLAG_NODE_PORT, vec![]));
    for prog in Prog::ALL {
        let to_node_port = Frame::tcp(external(&mut h), node_port(), SYN);
        run_case(&mut h, prog, &Case::reject("node port, no endpoints", &to_node_port));
        let to_cluster_ip = Frame::udp(client(&mut h), cluster_ip(), b"q");
        run_case(&mut h, prog, &Case::reject("ClusterIP, no endpoints", &to_cluster_ip));
    }
}

/// internalTrafficPolicy: Local: the ClusterIP picks from this node's
/// backend only, and drops without one; the node port (Cluster) still
/// reaches every backend.
#[test]
fn internal_local_cluster_ip_picks_local_backends_or_drops() {
    if !require_root("internal_local_cluster_ip_picks_local_backends_or_drops") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    let nodes = [THIS_NODE, OTHER_NODE, OTHER_NODE];
    sync_policy_service(&mut h, backends_on(nodes), TrafficPolicy::Cluster, TrafficPolicy::Local);
    let local = addr(BACKEND_IPS[0], BACKEND_PORT);
    assert_eq!(
        frontend_backends(&h, cluster_ip(), proto::UDP),
        (FLAG_INTERNAL_LOCAL, vec![BACKEND_IPS[0]])
    );
    for prog in Prog::ALL {
        let seen = reached(&mut h, prog, client, cluster_ip(), &[local], 8);
        assert_eq!(seen, [local].into(), "{}", prog.name());
    }
    let seen = reached(&mut h, Prog::XdpUplink, external, node_port(), &seed_backends(), 40);
    assert_eq!(seen.len(), 3, "the node port is not internal: {seen:?}");

    sync_policy_service(
        &mut h,
        backends_on([OTHER_NODE; 3]),
        TrafficPolicy::Cluster,
        TrafficPolicy::Local,
    );
    for prog in Prog::ALL {
        for protocol in [Protocol::Tcp, Protocol::Udp] {
            let frame = new_flow(&mut h, client, cluster_ip(), protocol);
            run_case(
                &mut h,
                prog,
                &Case::drop("ClusterIP, no local backend", &frame, Verdict::DropNoLocalBackend),
            );
        }
    }
}

/// masqueradeAll leaves the Local node port alone (the client's address is
/// the point of the policy), as kube-proxy does; a backend reaching itself
/// through it is still masqueraded (hairpin), else its reply would skip
/// the reverse NAT.
#[test]
fn external_local_keeps_the_source_under_masquerade_all_but_not_for_hairpin() {
    if !require_root("external_local_keeps_the_source_under_masquerade_all_but_not_for_hairpin") {
        return;
    }
    let mut h = Harness::with_snat_mark(vec![NODE_IP], 0x4000);
    sync_policy_service(
        &mut h,
        backends_on([THIS_NODE, OTHER_NODE, OTHER_NODE]),
        TrafficPolicy::Local,
        TrafficPolicy::Cluster,
    );
    h.maps.set_topology(Some(THIS_NODE.into()), true);
    for (name, protocol) in [(LOCAL_TCP, Protocol::Tcp), (LOCAL_UDP, Protocol::Udp)] {
        h.sync(&ServicePort {
            name: name.into(),
            protocol,
            cluster_ip: CLUSTER_IP.into(),
            port: SERVICE_PORT,
            node_port: Some(NODE_PORT),
            endpoints: backends_on([THIS_NODE, OTHER_NODE, OTHER_NODE]),
            external_policy: TrafficPolicy::Local,
            internal_policy: TrafficPolicy::Cluster,
            ..ServicePort::default()
        });
    }
    let (np_flags, _) = frontend_backends(&h, node_port(), proto::TCP);
    assert_eq!(np_flags & FLAG_NEEDS_SNAT, 0, "node port: {np_flags:#x}");
    let (cip_flags, _) = frontend_backends(&h, cluster_ip(), proto::TCP);
    assert_ne!(cip_flags & FLAG_NEEDS_SNAT, 0, "ClusterIP: {cip_flags:#x}");

    let local = addr(BACKEND_IPS[0], BACKEND_PORT);
    let outside = Frame::tcp(external(&mut h), node_port(), SYN);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("from outside", outside, &[local], Verdict::DnatNew),
    );
    let hairpin = Frame::tcp(addr(BACKEND_IPS[0], h.next_port()), node_port(), SYN);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("from the backend itself", hairpin, &[local], Verdict::DnatNew),
    );
    let snat_of = |h: &Harness, src: Ipv4Addr| {
        h.conntrack()
            .iter()
            .find(|(k, v)| !v.is_reply() && k.saddr() == src)
            .map(|(_, v)| v.flags & FLAG_SNAT != 0)
    };
    assert_eq!(snat_of(&h, EXTERNAL_IP), Some(false), "the client's address is kept");
    assert_eq!(snat_of(&h, BACKEND_IPS[0]), Some(true), "hairpin is masqueraded");
}

// ---------------------------------------------------------------------------
// Conntrack states and timeouts (proxy_common::conntrack).

/// The states of the flow `client -> frontend` (its two entries).
fn flow_states(h: &Harness, client: SocketAddrV4) -> Vec<u8> {
    let key_is_flows = |k: &CtKey| {
        (k.saddr(), k.sport()) == (*client.ip(), client.port())
            || (k.daddr(), k.dport()) == (*client.ip(), client.port())
    };
    h.conntrack()
        .into_iter()
        .filter(|(k, _)| key_is_flows(k))
        .map(|(_, v)| v.state)
        .collect()
}

/// The harness's conntrack map, to write entries as programs left them.
fn pinned_conntrack(h: &Harness) -> aya::maps::HashMap<aya::maps::MapData, CtKey, proxy_common::CtValue> {
    let path = h.pin_dir().join(proxy_common::maps::CONNTRACK);
    let data = aya::maps::MapData::from_pin(&path).expect("pinned conntrack");
    aya::maps::HashMap::try_from(aya::maps::Map::from_map_data(data).expect("a map")).expect("a hash map")
}

/// The seed's TCP port, now with `backends` only.
fn sync_seed_tcp(h: &mut Harness, backends: &[SocketAddrV4]) {
    h.sync(&service(
        SEED_TCP,
        Protocol::Tcp,
        CLUSTER_IP,
        SERVICE_PORT,
        Some(NODE_PORT),
        backends,
    ));
}

/// Opens a TCP flow through tc ingress; returns its SYN and backend.
fn open_tcp(h: &mut Harness, to: SocketAddrV4, backends: &[SocketAddrV4]) -> (Frame, SocketAddrV4) {
    let syn = Frame::tcp(client(h), to, SYN);
    let out = run_case(
        h,
        Prog::TcIngress,
        &Case::dnat("SYN", syn.clone(), backends, Verdict::DnatNew),
    );
    (syn, dnat_dst(&out))
}

/// The flow's FIN each way (client first), as in a normal close.
fn close_tcp(h: &mut Harness, syn: &Frame, backend: SocketAddrV4) {
    let fin = syn.clone().with_tcp(|t| t.flags = FIN | ACK);
    run_case(
        h,
        Prog::TcIngress,
        &Case::dnat("client FIN", fin, &[backend], Verdict::DnatEstablished),
    );
    let reply_fin = Frame::tcp(backend, syn.src(), FIN | ACK);
    run_case(h, Prog::TcIngress, &Case::rev_nat("backend FIN", reply_fin, syn.dst()));
}

#[test]
fn tcp_flows_move_through_the_kernels_states() {
    if !require_root("tcp_flows_move_through_the_kernels_states") {
        return;
    }
    let mut h = Harness::seeded();
    let (syn, backend) = open_tcp(&mut h, cluster_ip(), &seed_backends());
    let client = syn.src();
    assert_eq!(flow_states(&h, client), [state::TCP_SYN_SENT; 2]);
    let syn_ack = Frame::tcp(backend, client, SYN | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("SYN-ACK", syn_ack, cluster_ip()),
    );
    assert_eq!(flow_states(&h, client), [state::TCP_ESTABLISHED; 2]);
    let fin = syn.clone().with_tcp(|t| t.flags = FIN | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("client FIN", fin.clone(), &[backend], Verdict::DnatEstablished),
    );
    assert_eq!(flow_states(&h, client), [state::TCP_FIN_WAIT; 2]);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("FIN again", fin, &[backend], Verdict::DnatEstablished),
    );
    assert_eq!(
        flow_states(&h, client),
        [state::TCP_FIN_WAIT; 2],
        "a retransmitted FIN closes nothing"
    );
    let reply_fin = Frame::tcp(backend, client, FIN | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("backend FIN", reply_fin, cluster_ip()),
    );
    assert_eq!(flow_states(&h, client), [state::TCP_TIME_WAIT; 2]);

    let (syn, backend) = open_tcp(&mut h, cluster_ip(), &seed_backends());
    let rst = Frame::tcp(backend, syn.src(), RST | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("backend RST", rst, cluster_ip()),
    );
    assert_eq!(flow_states(&h, syn.src()), [state::TCP_CLOSE; 2]);
}

/// A client port reused for a new connection (ports wrap within seconds
/// under load) must not follow the old connection to its backend, which
/// may have left the Service since: the new SYN gets a fresh pick among
/// the current endpoints, as the kernel's conntrack gives a SYN in
/// TIME_WAIT or CLOSE a new connection. A retransmitted SYN of a live flow
/// keeps its backend.
#[test]
fn a_syn_on_a_closed_flows_tuple_picks_a_current_backend() {
    if !require_root("a_syn_on_a_closed_flows_tuple_picks_a_current_backend") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let (syn, backend) = open_tcp(&mut h, cluster_ip(), &seed);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("SYN again", syn.clone(), &[backend], Verdict::DnatEstablished),
    );
    let (reset_syn, reset_backend) = open_tcp(&mut h, cluster_ip(), &seed);
    let rst = reset_syn.clone().with_tcp(|t| t.flags = RST | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("client RST", rst, &[reset_backend], Verdict::DnatEstablished),
    );
    close_tcp(&mut h, &syn, backend);
    // Both backends leave; only the third one is left.
    let remaining: Vec<SocketAddrV4> = seed
        .iter()
        .copied()
        .filter(|b| *b != backend && *b != reset_backend)
        .collect();
    sync_seed_tcp(&mut h, &remaining);
    for (what, frame, old) in [
        ("SYN after TIME_WAIT", syn, state::TCP_TIME_WAIT),
        ("SYN after RST", reset_syn, state::TCP_CLOSE),
    ] {
        run_case(
            &mut h,
            Prog::TcIngress,
            &Case::dnat(what, frame.clone(), &remaining, Verdict::DnatNew),
        );
        // The new flow's two entries, and the old flow's reply entry: late
        // segments of the old connection are still reverse-NATed until it
        // times out.
        let mut states = flow_states(&h, frame.src());
        states.sort();
        assert_eq!(states, [state::TCP_SYN_SENT, state::TCP_SYN_SENT, old], "{what}");
    }
}

/// Each side's FIN handled on its own CPU at the same moment: the programs
/// set both FIN flags (atomically), but the state byte may keep the
/// FIN_WAIT one CPU wrote. Such a flow is closed all the same: a SYN on its
/// tuple picks a current backend (the churn test once saw a reused tuple
/// follow its old flow to a pod that had left the Service).
#[test]
fn a_flow_with_both_fins_is_closed_whatever_its_state_byte_says() {
    if !require_root("a_flow_with_both_fins_is_closed_whatever_its_state_byte_says") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let (syn, backend) = open_tcp(&mut h, cluster_ip(), &seed);
    let mut ct = pinned_conntrack(&h);
    for (key, mut value) in h.conntrack() {
        value.flags |= FLAG_FIN_FORWARD | FLAG_FIN_REPLY;
        value.state = state::TCP_FIN_WAIT;
        ct.insert(key, value, 0).expect("rewrite");
    }
    let remaining: Vec<SocketAddrV4> = seed.iter().copied().filter(|b| *b != backend).collect();
    sync_seed_tcp(&mut h, &remaining);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("SYN on the tuple", syn, &remaining, Verdict::DnatNew),
    );
}

/// The failure the seed scenario once showed: a client connects directly
/// to a pod from a port an earlier, closed Service flow to that pod used.
/// The pod's SYN-ACK is no Service's reply and must leave untranslated
/// (it would reach the client from the Service's address); a late segment
/// of the closed flow itself is still reverse-NATed, so the backend's
/// address never leaks to the client.
#[test]
fn a_backends_syn_ack_on_a_closed_flows_tuple_is_not_the_flows() {
    if !require_root("a_backends_syn_ack_on_a_closed_flows_tuple_is_not_the_flows") {
        return;
    }
    let mut h = Harness::seeded();
    let (syn, backend) = open_tcp(&mut h, cluster_ip(), &seed_backends());
    let client = syn.src();
    let syn_ack = Frame::tcp(backend, client, SYN | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("SYN-ACK", syn_ack.clone(), cluster_ip()),
    );
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("SYN-ACK again (the ACK was lost)", syn_ack.clone(), cluster_ip()),
    );
    close_tcp(&mut h, &syn, backend);
    let late = Frame::tcp(backend, client, ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("late segment after close", late, cluster_ip()),
    );
    // The direct connection: the client's SYN to the pod is no Service's.
    let direct_syn = Frame::tcp(client, backend, SYN);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::pass("direct SYN", &direct_syn, Verdict::PassNotService),
    );
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::pass("the pod's SYN-ACK", &syn_ack, Verdict::PassNotService),
    );
    let direct_ack = Frame::tcp(backend, client, ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::pass("the pod's next segment", &direct_ack, Verdict::PassNotService),
    );
}

/// Timeouts of `seconds` for every state (seconds: slack for a loaded machine).
fn short_timeouts(seconds: u32) -> LoadOptions {
    LoadOptions {
        conntrack: CtSettings {
            timeouts: CtTimeouts {
                seconds: [seconds; state::COUNT],
            },
            ..CtSettings::default()
        },
        ..LoadOptions::default()
    }
}

/// A UDP flow idle past its timeout both ways is over: the next datagram
/// from its tuple gets a fresh pick. Replies alone keep it alive; so does
/// any TCP segment of an idle connection (only a SYN starts over).
#[test]
fn idle_flows_start_over_only_with_a_packet_that_opens_one() {
    if !require_root("idle_flows_start_over_only_with_a_packet_that_opens_one") {
        return;
    }
    let mut h = Harness::with_options(vec![NODE_IP], short_timeouts(3));
    for svc in seed_services() {
        h.sync(&svc);
    }
    let seed = seed_backends();
    let dns = addr(CLUSTER_IP, SERVICE_PORT);
    let idle_udp = Frame::udp(client(&mut h), dns, b"q");
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("idle UDP flow", idle_udp.clone(), &seed, Verdict::DnatNew),
    );
    let streamed = Frame::udp(client(&mut h), dns, b"q");
    let out = run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("streamed UDP flow", streamed.clone(), &seed, Verdict::DnatNew),
    );
    let stream_backend = dnat_dst(&out);
    let (idle_tcp, tcp_backend) = open_tcp(&mut h, cluster_ip(), &seed);
    // Replies every 0.4 s keep the stream's reply entry fresh (at most a
    // second stale: LAST_SEEN_GRANULARITY_NS) while its forward way idles.
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_millis(4300) {
        let reply = Frame::udp(stream_backend, streamed.src(), b"a");
        run_case(&mut h, Prog::TcIngress, &Case::rev_nat("streamed reply", reply, dns));
        std::thread::sleep(std::time::Duration::from_millis(400));
    }
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("idle UDP flow, later", idle_udp, &seed, Verdict::DnatNew),
    );
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat(
            "streamed flow, later",
            streamed,
            &[stream_backend],
            Verdict::DnatEstablished,
        ),
    );
    let ack = idle_tcp.clone().with_tcp(|t| t.flags = ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("idle TCP, a segment", ack, &[tcp_backend], Verdict::DnatEstablished),
    );
}

/// The agent's sweep deletes flows idle past their timeout and counts
/// them; live flows stay.
#[test]
fn the_sweep_deletes_expired_flows_and_counts_them() {
    if !require_root("the_sweep_deletes_expired_flows_and_counts_them") {
        return;
    }
    let options = short_timeouts(2);
    let mut h = Harness::seeded_with(options);
    let seed = seed_backends();
    for _ in 0..5 {
        open_tcp(&mut h, cluster_ip(), &seed);
    }
    let sweep = conntrack::sweep(h.pin_dir(), &options.conntrack.timeouts).expect("sweep");
    assert_eq!((sweep.entries, sweep.expired), (10, 0), "nothing is idle yet");
    std::thread::sleep(std::time::Duration::from_millis(3100));
    let (live, _) = open_tcp(&mut h, cluster_ip(), &seed);
    let sweep = conntrack::sweep(h.pin_dir(), &options.conntrack.timeouts).expect("sweep");
    assert_eq!((sweep.entries, sweep.expired), (12, 10));
    assert_eq!(flow_states(&h, live.src()).len(), 2, "the live flow stays");
    assert_eq!(h.conntrack().len(), 2);
    let counts = proxy_userspace::server::metrics::read_conntrack_counts(h.pin_dir())
        .expect("counters")
        .expect("the data path has conntrack counters");
    assert_eq!(counts.get(ct_stat::INSERTED), 12);
    assert_eq!(counts.get(ct_stat::EXPIRED), 10);
    assert_eq!(counts.get(ct_stat::LIVE), 2);
    assert_eq!(counts.get(ct_stat::EVICTED), 0);
    // Both tables' room: XP_CT's and XP_CT6's.
    let settings = CtSettings::default();
    assert_eq!(counts.max_entries, settings.entries + settings.entries6);
}

// ---------------------------------------------------------------------------
// IPv4 fragments (proxy-ebpf's `fragments`).

/// Runs `frame` through `prog`: exactly `verdict` gains one packet.
fn run_counted(h: &mut Harness, prog: Prog, frame: &[u8], verdict: Verdict, what: &str) -> Output {
    let before = h.counts();
    let out = h.run(prog, frame);
    let after = h.counts();
    let changed = verdicts_gained(&before, &after);
    assert_eq!(
        changed,
        [(verdict, 1, frame.len() as u64)],
        "{what} via {}",
        prog.name()
    );
    out
}

/// A UDP datagram of `len` payload bytes from `src` to `dst`, with an IP
/// id of its own, in fragments of at most 1,480 bytes (MTU 1,500).
fn fragmented(h: &mut Harness, src: SocketAddrV4, dst: SocketAddrV4, len: usize) -> Vec<Vec<u8>> {
    let payload: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let id = h.next_port();
    let datagram = Frame::udp(src, dst, &payload).with_ip(|ip| ip.id = id);
    fragments(&datagram, 1480).iter().map(Frame::build).collect()
}

/// Runs fragments through `prog`, the first counted as `first`, the rest
/// as `rest`; returns the outputs.
fn run_fragments(h: &mut Harness, prog: Prog, frames: &[Vec<u8>], first: Verdict, rest: Verdict) -> Vec<Vec<u8>> {
    frames
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let verdict = if i == 0 { first } else { rest };
            let out = run_counted(h, prog, f, verdict, &format!("fragment {i}"));
            assert!(
                prog.dnat_code_ok(out.code),
                "fragment {i} via {}: code {}",
                prog.name(),
                out.code
            );
            out.frame
        })
        .collect()
}

/// Runs a new flow's first fragment twice (a duplicate is translated
/// alike), then the later ones; returns the outputs, the first's once.
fn first_twice_then_the_rest(h: &mut Harness, prog: Prog, frames: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let first = run_counted(h, prog, &frames[0], Verdict::DnatNew, "the first");
    let again = run_counted(h, prog, &frames[0], Verdict::DnatEstablished, "the first again");
    assert_eq!(first.frame, again.frame, "a duplicate is translated alike");
    let mut out = vec![first.frame];
    for (i, later) in frames[1..].iter().enumerate() {
        let what = format!("fragment {} after the first", i + 1);
        out.push(run_counted(h, prog, later, Verdict::DnatEstablished, &what).frame);
    }
    out
}

/// A 4,000-byte datagram to the ClusterIP and a 3,000-byte answer, each in
/// fragments, through every program: both arrive whole and translated
/// (checked by reassembling them and verifying the UDP checksum over the
/// whole datagram, with etherparse).
#[test]
fn fragmented_datagrams_are_translated_whole() {
    if !require_root("fragmented_datagrams_are_translated_whole") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    for prog in Prog::ALL {
        let c = client(&mut h);
        let request = fragmented(&mut h, c, cluster_ip(), 4000);
        assert_eq!(request.len(), 3);
        let out = run_fragments(&mut h, prog, &request, Verdict::DnatNew, Verdict::DnatEstablished);
        let (src, backend) = reassemble_udp(&out).unwrap_or_else(|e| panic!("request via {}: {e}", prog.name()));
        assert_eq!(src, c);
        assert!(seed.contains(&backend), "{backend} is no backend");
        let answer = fragmented(&mut h, backend, c, 3000);
        let out = run_fragments(&mut h, prog, &answer, Verdict::RevNat, Verdict::RevNat);
        let (src, dst) = reassemble_udp(&out).unwrap_or_else(|e| panic!("answer via {}: {e}", prog.name()));
        assert_eq!((src, dst), (cluster_ip(), c), "via {}", prog.name());
    }
    // The largest datagram, to a NodePort from outside, at XDP.
    let e = external(&mut h);
    let request = fragmented(&mut h, e, node_port(), 65_507);
    assert_eq!(request.len(), 45);
    let out = run_fragments(
        &mut h,
        Prog::XdpUplink,
        &request,
        Verdict::DnatNew,
        Verdict::DnatEstablished,
    );
    let (_, backend) = reassemble_udp(&out).expect("a 64 KiB datagram");
    assert!(seed.contains(&backend));
}

/// Fragments in every order: later ones before their first pass untouched
/// (never translated as port 0; the receiver's reassembly then waits for
/// the rest and drops the datagram, as it would drop a lost one); after
/// the first, they are translated; a duplicated first fragment is
/// translated alike; without a first, none is.
#[test]
fn fragments_in_any_order_are_never_taken_for_port_0() {
    if !require_root("fragments_in_any_order_are_never_taken_for_port_0") {
        return;
    }
    let mut h = Harness::seeded();
    let untracked = Verdict::PassFragmentUntracked;
    for prog in Prog::ALL {
        let c = client(&mut h);
        let frames = fragmented(&mut h, c, cluster_ip(), 4000);
        for (i, later) in frames[1..].iter().enumerate() {
            let out = run_counted(
                &mut h,
                prog,
                later,
                untracked,
                &format!("fragment {} before the first", i + 1),
            );
            assert_eq!((out.code, &out.frame), (prog.pass(), later), "untouched");
        }
        let out = first_twice_then_the_rest(&mut h, prog, &frames);
        reassemble_udp(&out).unwrap_or_else(|e| panic!("via {}: {e}", prog.name()));

        let other = client(&mut h);
        let lost_first = fragmented(&mut h, other, cluster_ip(), 4000);
        for later in &lost_first[1..] {
            let out = run_counted(&mut h, prog, later, untracked, "its first lost");
            assert_eq!(&out.frame, later);
        }
    }
}

// ---------------------------------------------------------------------------
// ICMP errors of translated flows (proxy-ebpf's `icmp_error`).

/// The IPv4 packet of a frame (no VLAN tag).
fn ip_packet(frame: &[u8]) -> &[u8] {
    &frame[14..]
}

/// Runs an ICMP error through `prog` and checks the outcome: counted as
/// `icmp_error`, every checksum right (etherparse), the outer addresses
/// `outer`, and the quote exactly `quote` (the packet as its sender sent
/// it before any translation).
fn check_icmp_error(h: &mut Harness, prog: Prog, error: &Frame, outer: (Ipv4Addr, Ipv4Addr), quote: &[u8], what: &str) {
    let out = run_counted(h, prog, &error.build(), Verdict::IcmpError, what);
    assert!(
        out.code == prog.pass() || out.code == TC_ACT_REDIRECT,
        "{what} via {}: code {}",
        prog.name(),
        out.code
    );
    let checked = check(&out.frame).unwrap_or_else(|e| panic!("{what} via {}: {e}\n{}", prog.name(), hex(&out.frame)));
    assert_eq!(
        (
            Ipv4Addr::from(checked.ip.source),
            Ipv4Addr::from(checked.ip.destination)
        ),
        outer,
        "{what} via {}: outer addresses",
        prog.name()
    );
    let inner = &out.frame[14 + 20 + 8..];
    assert_eq!(hex(inner), hex(quote), "{what} via {}: the quote", prog.name());
}

/// Errors about a client's packet (sent by the backend or a router behind
/// the DNAT) reach the client about the packet it sent; errors about a
/// reply (sent by a router towards the frontend, as path MTU discovery
/// does) reach the backend about the packet it sent. The quote is cut
/// where ICMP senders cut it: 8 bytes of L4 (no TCP checksum) or more.
#[test]
fn icmp_errors_of_translated_flows_are_translated() {
    if !require_root("icmp_errors_of_translated_flows_are_translated") {
        return;
    }
    use etherparse::{Icmpv4Type, icmpv4::DestUnreachableHeader, icmpv4::TimeExceededCode};
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let port_unreachable = Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port);
    let frag_needed =
        Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded { next_hop_mtu: 1400 });
    let ttl = Icmpv4Type::TimeExceeded(TimeExceededCode::TtlExceededInTransit);
    let router = Ipv4Addr::new(10, 244, 9, 9);
    for prog in [Prog::TcIngress, Prog::XdpUplink] {
        // A UDP request the backend refuses: the client gets the refusal
        // from the Service's address, about its request to the Service.
        let c = client(&mut h);
        let request = Frame::udp(c, cluster_ip(), b"query").build();
        let dnat = run_counted(&mut h, prog, &request, Verdict::DnatNew, "request").frame;
        let backend = dnat_dst(&Output {
            code: 0,
            frame: dnat.clone(),
        });
        assert!(seed.contains(&backend));
        let error = Frame::icmp_error(*backend.ip(), *c.ip(), port_unreachable.clone(), ip_packet(&dnat));
        check_icmp_error(
            &mut h,
            prog,
            &error,
            (CLUSTER_IP, *c.ip()),
            ip_packet(&request),
            "port unreachable",
        );
        // A router's error keeps the router's address outside.
        let error = Frame::icmp_error(router, *c.ip(), ttl.clone(), ip_packet(&dnat));
        check_icmp_error(
            &mut h,
            prog,
            &error,
            (router, *c.ip()),
            ip_packet(&request),
            "time exceeded",
        );

        // TCP, quoted with 8 bytes of TCP (no checksum) and whole.
        let c = client(&mut h);
        let syn = Frame::tcp(c, cluster_ip(), SYN).build();
        let dnat = run_counted(&mut h, prog, &syn, Verdict::DnatNew, "SYN").frame;
        let backend = dnat_dst(&Output {
            code: 0,
            frame: dnat.clone(),
        });
        for len in [28, ip_packet(&dnat).len()] {
            let error = Frame::icmp_error(*backend.ip(), *c.ip(), frag_needed.clone(), &ip_packet(&dnat)[..len]);
            let what = format!("frag-needed quoting {len} bytes");
            check_icmp_error(
                &mut h,
                prog,
                &error,
                (CLUSTER_IP, *c.ip()),
                &ip_packet(&syn)[..len],
                &what,
            );
        }
        // A short quote in a frame with a link-layer trailer: the trailer
        // is no part of the quote, whatever bytes sit where a TCP
        // checksum would (found by the fuzz).
        let trailer = [0xab; 10];
        let error = Frame::icmp_error(*backend.ip(), *c.ip(), frag_needed.clone(), &ip_packet(&dnat)[..28])
            .with_padding(&trailer);
        let quote_and_trailer = [&ip_packet(&syn)[..28], &trailer[..]].concat();
        let what = "frag-needed quoting 28 bytes, a 10-byte trailer";
        check_icmp_error(&mut h, prog, &error, (CLUSTER_IP, *c.ip()), &quote_and_trailer, what);

        // Path MTU discovery through a NodePort: the reply left the node as
        // NODE_IP:30791 -> client; a router's frag-needed about it comes
        // back to NODE_IP and must reach the backend, about its own reply.
        let e = external(&mut h);
        let syn = Frame::tcp(e, node_port(), SYN).build();
        let out = run_counted(&mut h, prog, &syn, Verdict::DnatNew, "NodePort SYN");
        let backend = dnat_dst(&out);
        let reply = Frame::tcp(backend, e, SYN | ACK)
            .with_tcp(|t| t.payload = vec![7; 40])
            .build();
        let rev = run_counted(&mut h, prog, &reply, Verdict::RevNat, "SYN-ACK").frame;
        let error = Frame::icmp_error(router, NODE_IP, frag_needed.clone(), ip_packet(&rev));
        check_icmp_error(
            &mut h,
            prog,
            &error,
            (router, *backend.ip()),
            ip_packet(&reply),
            "frag-needed for a reply",
        );
    }
    // About a flow nobody tracks, or not an error: not ours.
    let stranger = Frame::udp(addr(EXTERNAL_IP, 5000), addr(Ipv4Addr::new(10, 244, 0, 11), 80), b"x").build();
    let error = Frame::icmp_error(
        Ipv4Addr::new(10, 244, 0, 11),
        EXTERNAL_IP,
        port_unreachable,
        ip_packet(&stranger),
    );
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::pass("an error about no flow", &error, Verdict::PassNotService),
    );
    let echo = Frame::icmp_echo(CLIENT_IP, CLUSTER_IP);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::pass("an echo request", &echo, Verdict::PassNotIpv4OrL4),
    );
}

/// kube-proxy drops what its conntrack finds INVALID (kubernetes issue
/// 74839): an out-of-window segment would skip the NAT and reach the
/// client from the backend's address, and the client's RST would kill
/// the connection. The programs keep no TCP window: every segment of a
/// tracked flow is translated, whatever its sequence numbers.
#[test]
fn out_of_window_segments_are_still_translated() {
    if !require_root("out_of_window_segments_are_still_translated") {
        return;
    }
    let mut h = Harness::seeded();
    for prog in [Prog::TcIngress, Prog::XdpUplink] {
        let (syn, backend) = open_tcp(&mut h, cluster_ip(), &seed_backends());
        let syn_ack = Frame::tcp(backend, syn.src(), SYN | ACK);
        run_case(&mut h, prog, &Case::rev_nat("SYN-ACK", syn_ack, cluster_ip()));
        for seq in [0x8000_0000u32, 0xffff_fff0, 1] {
            let late = Frame::tcp(backend, syn.src(), ACK).with_tcp(|t| {
                t.seq = seq;
                t.payload = vec![9; 100];
            });
            run_case(
                &mut h,
                prog,
                &Case::rev_nat(format!("reply, seq {seq:#x}"), late, cluster_ip()),
            );
            let odd = syn.clone().with_tcp(|t| {
                t.flags = ACK;
                t.seq = seq;
                t.ack = seq ^ 0x5555_5555;
            });
            let case = Case::dnat(
                format!("request, seq {seq:#x}"),
                odd,
                &[backend],
                Verdict::DnatEstablished,
            );
            run_case(&mut h, prog, &case);
        }
    }
}

/// After a client reopened a closed flow's tuple to another backend, the
/// old flow's reply entry stays (its late segments are still reverse-NATed)
/// but is no longer the new flow's partner: a late RST of the old
/// connection must not close the new one (found by the fuzz).
#[test]
fn a_closed_flows_late_rst_leaves_the_flow_reopened_on_its_tuple_alone() {
    if !require_root("a_closed_flows_late_rst_leaves_the_flow_reopened_on_its_tuple_alone") {
        return;
    }
    let mut h = Harness::seeded();
    let seed = seed_backends();
    let only = |h: &mut Harness, backend: SocketAddrV4| {
        h.sync(&service(
            SEED_TCP,
            Protocol::Tcp,
            CLUSTER_IP,
            SERVICE_PORT,
            Some(NODE_PORT),
            &[backend],
        ));
    };
    only(&mut h, seed[0]);
    let (syn, old) = open_tcp(&mut h, cluster_ip(), &seed[..1]);
    close_tcp(&mut h, &syn, old);
    only(&mut h, seed[2]);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("reopened", syn.clone(), &seed[2..], Verdict::DnatNew),
    );
    let late_rst = Frame::tcp(old, syn.src(), RST | ACK);
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::rev_nat("the old connection's late RST", late_rst, cluster_ip()),
    );
    let mut states = flow_states(&h, syn.src());
    states.sort();
    assert_eq!(
        states,
        [state::TCP_SYN_SENT, state::TCP_SYN_SENT, state::TCP_CLOSE],
        "the new flow's entries untouched, the old reply entry closed"
    );
    run_case(
        &mut h,
        Prog::TcIngress,
        &Case::dnat("SYN retransmitted", syn, &seed[2..], Verdict::DnatEstablished),
    );
}
