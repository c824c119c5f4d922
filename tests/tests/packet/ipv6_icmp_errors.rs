//! ICMPv6 errors of translated flows (proxy-ebpf's `ipv6::icmp_error`):
//! each output compared byte for byte with the error the other end must
//! see (built afresh around the packet as that end sent or saw it, the
//! ICMPv6 checksum by etherparse), so the quote's addresses, ports and
//! L4 checksum and the outer address and checksum are all checked.

use etherparse::{
    Icmpv6Type,
    icmpv6::{DestUnreachableCode, ParameterProblemCode, ParameterProblemHeader, TimeExceededCode},
};

use super::*;

/// A router between the node and the client.
const ROUTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x50, 0, 0, 0, 1);

/// The IPv6 packet of a frame, from its header on.
fn packet(frame: &[u8]) -> &[u8] {
    &frame[ETH_HLEN..]
}

/// Runs `error` through `prog`: counted as icmp_error, passed on, and
/// exactly `want` (whose checksums are valid).
fn assert_translated(h: &mut Harness, prog: Prog, error: &Frame6, want: &Frame6, what: &str) {
    let out = run6(h, prog, &error.build(), Verdict::IcmpError, what);
    let ctx = format!("{what} via {}: output {}", prog.name(), hex(&out.frame));
    assert!(prog.dnat_code_ok(out.code), "code {}: {ctx}", out.code);
    check6(&out.frame).unwrap_or_else(|e| panic!("{e}: {ctx}"));
    let want = want.build();
    assert!(
        out.frame == want,
        "want {}\ndiffers at {}: {ctx}",
        hex(&want),
        diff(&want, &out.frame)
    );
}

fn error_types() -> [(&'static str, Icmpv6Type); 4] {
    [
        (
            "port unreachable",
            Icmpv6Type::DestinationUnreachable(DestUnreachableCode::Port),
        ),
        ("packet too big", Icmpv6Type::PacketTooBig { mtu: 1400 }),
        (
            "time exceeded",
            Icmpv6Type::TimeExceeded(TimeExceededCode::HopLimitExceeded),
        ),
        (
            "parameter problem",
            Icmpv6Type::ParameterProblem(ParameterProblemHeader {
                code: ParameterProblemCode::ErroneousHeaderField,
                pointer: 40,
            }),
        ),
    ]
}

/// Errors about a client's packet (from its backend, or a router behind
/// the DNAT) reach the client as about the packet it sent, from the
/// frontend where the backend sent it; errors about a reply (a router's
/// packet too big to the frontend address the client saw) reach the
/// backend as about the reply it sent. TCP and UDP, quotes cut after 8
/// bytes of L4 (no TCP checksum) or whole.
#[test]
fn ipv6_icmp_errors_of_translated_flows_are_translated() {
    if !require_root("ipv6_icmp_errors_of_translated_flows_are_translated") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let node_port = v6(NODE_IP6, NODE_PORT);
    let mut translated = 0;
    for prog in Prog::ALL {
        for (name, icmp_type) in error_types() {
            for (c, frontend, tcp) in [
                (client6(&mut h), cluster, false),
                (client6(&mut h), cluster, true),
                (external6(&mut h), node_port, false),
            ] {
                let request = if tcp {
                    Frame6::tcp(c, frontend, SYN)
                } else {
                    Frame6::udp(c, frontend, b"a query of some length")
                };
                let backend = assert_dnat(&mut h, prog, &request, name);
                let dnat = request.clone().with_dst(backend).build();
                let sent = request.build();
                for quote_len in [48, packet(&dnat).len()] {
                    let what = format!("{name} from the backend, {quote_len} bytes of {frontend}");
                    let error = Frame6::icmp6_error(*backend.ip(), *c.ip(), icmp_type, &packet(&dnat)[..quote_len]);
                    let want = Frame6::icmp6_error(*frontend.ip(), *c.ip(), icmp_type, &packet(&sent)[..quote_len]);
                    assert_translated(&mut h, prog, &error, &want, &what);
                    let what = format!("{name} from a router, {quote_len} bytes of {frontend}");
                    let error = Frame6::icmp6_error(ROUTER_IP6, *c.ip(), icmp_type, &packet(&dnat)[..quote_len]);
                    let want = Frame6::icmp6_error(ROUTER_IP6, *c.ip(), icmp_type, &packet(&sent)[..quote_len]);
                    assert_translated(&mut h, prog, &error, &want, &what);
                    translated += 2;
                }
                // The backend's reply as it sent it and as the client saw it.
                let reply = reply_of(&request, backend, SYN | ACK);
                let seen = reply.clone().with_src(frontend).build();
                let what = format!("{name} about a reply from {frontend}");
                let error = Frame6::icmp6_error(ROUTER_IP6, *frontend.ip(), icmp_type, packet(&seen));
                let want = Frame6::icmp6_error(ROUTER_IP6, *backend.ip(), icmp_type, packet(&reply.build()));
                assert_translated(&mut h, prog, &error, &want, &what);
                translated += 1;
            }
        }
    }
    println!("{translated} ICMPv6 errors translated");
}

/// Errors quoting no tracked flow, a quote with an extension header, one
/// too short for the ports, and informational ICMPv6 pass untouched.
#[test]
fn ipv6_icmp_errors_of_other_packets_pass_untouched() {
    if !require_root("ipv6_icmp_errors_of_other_packets_pass_untouched") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let unreachable = Icmpv6Type::DestinationUnreachable(DestUnreachableCode::Port);
    for prog in Prog::ALL {
        let c = client6(&mut h);
        let untracked = Frame6::udp(client6(&mut h), v6(BACKEND_IPS6[0], BACKEND_PORT), b"q").build();
        let request = Frame6::udp(c, cluster, b"q");
        let backend = assert_dnat(&mut h, prog, &request, "a flow");
        let behind_ext = request
            .clone()
            .with_dst(backend)
            .with_ext(&[Ext6::DestOpts { units: 1 }])
            .build();
        let dnat = request.with_dst(backend).build();
        let cases = [
            (
                "about an untracked packet",
                Frame6::icmp6_error(BACKEND_IPS6[0], *c.ip(), unreachable, packet(&untracked)),
                Verdict::PassNotService,
            ),
            (
                "quoting an extension header",
                Frame6::icmp6_error(*backend.ip(), *c.ip(), unreachable, packet(&behind_ext)),
                Verdict::PassNotIpv4OrL4,
            ),
            (
                "quoting 3 bytes of L4",
                Frame6::icmp6_error(*backend.ip(), *c.ip(), unreachable, &packet(&dnat)[..43]),
                Verdict::PassNotIpv4OrL4,
            ),
            (
                "an echo reply",
                Frame6::icmp6_error(
                    *backend.ip(),
                    *c.ip(),
                    Icmpv6Type::EchoReply(etherparse::IcmpEchoHeader { id: 1, seq: 1 }),
                    &[],
                ),
                Verdict::PassNotIpv4OrL4,
            ),
        ];
        for (what, frame, verdict) in &cases {
            assert_passed(&mut h, prog, &frame.build(), *verdict, what);
        }
    }
}
