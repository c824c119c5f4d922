//! Issue 13's SCTP in the data path, frame by frame: translated where the
//! port stays (addresses only: SCTP's CRC32c covers no IP pseudo-header,
//! so the output's CRC must be the input's, checked by `check`), tracked
//! like UDP, rejected with a port unreachable without endpoints, and a
//! port change the maps should never hold refused rather than half done.

use std::net::{Ipv6Addr, SocketAddrV6};

use proxy_common::sctp::chunk;
use testbed::frame::{Frame6, MAC_CLIENT, MAC_NODE, SCTP_INIT_CHUNK, check6};

use super::*;

/// A ClusterIP Service port whose endpoints listen on its own port.
const SCTP_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 32);
/// One whose endpoints listen on another port.
const REWRITE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 33);
/// The same two over IPv6, with IPv6 endpoints and clients.
const SCTP_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 1, 0x32);
const REWRITE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 1, 0x33);
const BACKEND_IPS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 1, 0xb),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 1, 0xc),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 1, 0xd),
];
const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 1, 5);
/// The Diameter port, a common SCTP Service.
const SCTP_PORT: u16 = 3868;
/// The verification tag of an association under way.
const VTAG: u32 = 0x1234_5678;
/// A DATA chunk with one byte, padded to 4.
const DATA_CHUNK: [u8; 20] = [chunk::DATA, 3, 0, 17, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, b'x', 0, 0, 0];
/// An INIT ACK chunk without parameters.
const INIT_ACK_CHUNK: [u8; 20] = [
    chunk::INIT_ACK,
    0,
    0,
    20,
    0x12,
    0x34,
    0x56,
    0x78,
    0,
    1,
    0,
    0,
    0,
    1,
    0,
    1,
    0,
    0,
    0,
    1,
];

fn sctp_service(name: &str, ip: Ipv4Addr, endpoint_port: u16) -> ServicePort {
    ServicePort {
        name: name.into(),
        protocol: Protocol::Sctp,
        cluster_ip: ip.into(),
        port: SCTP_PORT,
        endpoints: BACKEND_IPS
            .iter()
            .map(|ip| Endpoint::ready(*ip, endpoint_port))
            .collect(),
        ..ServicePort::default()
    }
}

fn sctp_backends() -> Vec<SocketAddrV4> {
    BACKEND_IPS.iter().map(|ip| addr(*ip, SCTP_PORT)).collect()
}

#[test]
fn sctp_on_the_services_port_is_translated_both_ways() {
    if !require_root("sctp_on_the_services_port_is_translated_both_ways") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    h.sync(&sctp_service("default/diameter:sctp", SCTP_IP, SCTP_PORT));
    let backends = sctp_backends();
    let svc = addr(SCTP_IP, SCTP_PORT);
    for forward_prog in Prog::ALL {
        for reply_prog in [Prog::XdpUplink, Prog::TcIngress] {
            let label = format!("forward via {}, reply via {}", forward_prog.name(), reply_prog.name());
            let cli = client(&mut h);
            let init = Frame::sctp(cli, svc, 0, &SCTP_INIT_CHUNK);
            let out = run_case(
                &mut h,
                forward_prog,
                &Case::dnat(format!("INIT, {label}"), init, &backends, Verdict::DnatNew),
            );
            let backend = dnat_dst(&out);
            let init_ack = Frame::sctp(backend, cli, VTAG, &INIT_ACK_CHUNK);
            run_case(
                &mut h,
                reply_prog,
                &Case::rev_nat(format!("INIT ACK, {label}"), init_ack, svc),
            );
            let data = Frame::sctp(cli, svc, VTAG, &DATA_CHUNK);
            run_case(
                &mut h,
                forward_prog,
                &Case::dnat(format!("DATA, {label}"), data, &[backend], Verdict::DnatEstablished),
            );
            // Another client port of the same client is another association.
            let other = Frame::sctp(addr(*cli.ip(), cli.port() + 10_000), svc, VTAG, &DATA_CHUNK);
            let out = run_case(
                &mut h,
                forward_prog,
                &Case::dnat(
                    format!("another client port, {label}"),
                    other,
                    &backends,
                    Verdict::DnatNew,
                ),
            );
            assert!(backends.contains(&dnat_dst(&out)));
        }
    }
    // Tracked as UDP is: both entries of every association, replied once
    // the backend answered.
    let sctp_entries: Vec<_> = h
        .conntrack()
        .into_iter()
        .filter(|(key, _)| key.proto == proto::SCTP)
        .collect();
    assert_eq!(sctp_entries.len(), 2 * 2 * Prog::ALL.len() * 2, "{sctp_entries:?}");
    let replied = sctp_entries
        .iter()
        .filter(|(_, v)| v.state == state::UDP_REPLIED)
        .count();
    assert_eq!(replied, 2 * 2 * Prog::ALL.len(), "{sctp_entries:?}");
}

#[test]
fn sctp_without_endpoints_is_answered_with_port_unreachable() {
    if !require_root("sctp_without_endpoints_is_answered_with_port_unreachable") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    let mut empty = sctp_service("default/empty:sctp", SCTP_IP, SCTP_PORT);
    empty.endpoints.clear();
    h.sync(&empty);
    let to = addr(SCTP_IP, SCTP_PORT);
    for prog in Prog::ALL {
        let init = Frame::sctp(client(&mut h), to, 0, &SCTP_INIT_CHUNK);
        run_case(&mut h, prog, &Case::reject("INIT -> port unreachable", &init));
    }
}

/// The agent never programs an SCTP frontend whose port changes (see the
/// ebpf mode's `programs_translate`); maps that hold one anyway (written
/// here directly) get the packet dropped untouched, never sent on with a
/// CRC32c that no longer matches.
#[test]
fn an_sctp_port_change_is_refused_untouched() {
    if !require_root("an_sctp_port_change_is_refused_untouched") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    h.sync(&sctp_service("default/rewrite:sctp", REWRITE_IP, SCTP_PORT + 1));
    for prog in Prog::ALL {
        let init = Frame::sctp(client(&mut h), addr(REWRITE_IP, SCTP_PORT), 0, &SCTP_INIT_CHUNK);
        run_case(&mut h, prog, &Case::drop("INIT to 3868 -> 3869", &init, Verdict::Error));
    }
}

#[test]
fn sctp_of_other_services_and_short_headers_pass_untouched() {
    if !require_root("sctp_of_other_services_and_short_headers_pass_untouched") {
        return;
    }
    let mut h = Harness::seeded();
    h.sync(&sctp_service("default/diameter:sctp", SCTP_IP, SCTP_PORT));
    let short = |h: &mut Harness| {
        let mut f = Frame::sctp(client(h), addr(SCTP_IP, SCTP_PORT), 0, &[]);
        // 11 of the common header's 12 bytes inside the total length.
        f.ip_mut().tot_len = Some(20 + 11);
        f.with_padding(&[0])
    };
    for prog in Prog::ALL {
        let cases = [
            Case::pass(
                "SCTP to the seed's TCP/UDP ClusterIP port",
                &Frame::sctp(client(&mut h), cluster_ip(), 0, &SCTP_INIT_CHUNK),
                Verdict::PassNotService,
            ),
            Case::pass(
                "SCTP to another port of the SCTP ClusterIP",
                &Frame::sctp(client(&mut h), addr(SCTP_IP, SCTP_PORT + 1), 0, &SCTP_INIT_CHUNK),
                Verdict::PassNotService,
            ),
            Case::pass(
                "TCP to the SCTP Service's port",
                &Frame::tcp(client(&mut h), addr(SCTP_IP, SCTP_PORT), SYN),
                Verdict::PassNotService,
            ),
            Case::pass(
                "SCTP shorter than its common header",
                &short(&mut h),
                Verdict::PassMalformed,
            ),
        ];
        for case in &cases {
            run_case(&mut h, prog, case);
        }
    }
}

fn sctp_service6(name: &str, ip: Ipv6Addr, endpoint_port: u16) -> ServicePort {
    ServicePort {
        name: name.into(),
        protocol: Protocol::Sctp,
        cluster_ip: ip.into(),
        port: SCTP_PORT,
        endpoints: BACKEND_IPS6
            .iter()
            .map(|ip| Endpoint::ready(*ip, endpoint_port))
            .collect(),
        ..ServicePort::default()
    }
}

/// The same over IPv6: the IPv6 path parses SCTP's common header and
/// rewrites the address only (no pseudo-header in the CRC32c, which
/// `check6` checks), both ways, on every program; a port change the maps
/// should never hold is dropped untouched.
#[test]
fn ipv6_sctp_on_the_services_port_is_translated_and_a_port_change_refused() {
    if !require_root("ipv6_sctp_on_the_services_port_is_translated_and_a_port_change_refused") {
        return;
    }
    let mut h = Harness::new(vec![NODE_IP]);
    h.sync(&sctp_service6("default/diameter:sctp (IPv6)", SCTP_IP6, SCTP_PORT));
    h.sync(&sctp_service6(
        "default/rewrite:sctp (IPv6)",
        REWRITE_IP6,
        SCTP_PORT + 1,
    ));
    let v6 = |ip: Ipv6Addr, port| SocketAddrV6::new(ip, port, 0, 0);
    let backends: Vec<SocketAddrV6> = BACKEND_IPS6.iter().map(|ip| v6(*ip, SCTP_PORT)).collect();
    let svc = v6(SCTP_IP6, SCTP_PORT);
    for prog in Prog::ALL {
        let what = format!("IPv6 INIT via {}", prog.name());
        let cli = v6(CLIENT_IP6, h.next_port());
        let init = Frame6::sctp(cli, svc, 0, &SCTP_INIT_CHUNK);
        let out = run_counted(&mut h, prog, &init.build(), Verdict::DnatNew, &what);
        assert!(prog.dnat_code_ok(out.code), "{what}: code {}", out.code);
        let backend = check6(&out.frame).unwrap_or_else(|e| panic!("{what}: {e}")).dst;
        assert!(backends.contains(&backend), "{what}: {backend} is no backend");
        let want = init.clone().with_dst(backend).build();
        assert!(out.frame == want, "{what}: differs at {}", diff(&want, &out.frame));

        let what = format!("IPv6 INIT ACK via {}", Prog::TcIngress.name());
        let init_ack = Frame6 {
            eth_src: MAC_NODE,
            eth_dst: MAC_CLIENT,
            ..Frame6::sctp(backend, cli, VTAG, &INIT_ACK_CHUNK)
        };
        let out = run_counted(&mut h, Prog::TcIngress, &init_ack.build(), Verdict::RevNat, &what);
        assert_eq!(out.code, Prog::TcIngress.pass(), "{what}");
        check6(&out.frame).unwrap_or_else(|e| panic!("{what}: {e}"));
        let want = init_ack.clone().with_src(svc).build();
        assert!(out.frame == want, "{what}: differs at {}", diff(&want, &out.frame));

        let what = format!("IPv6 INIT to 3868 -> 3869 via {}", prog.name());
        let init = Frame6::sctp(
            v6(CLIENT_IP6, h.next_port()),
            v6(REWRITE_IP6, SCTP_PORT),
            0,
            &SCTP_INIT_CHUNK,
        );
        let out = run_counted(&mut h, prog, &init.build(), Verdict::Error, &what);
        assert_eq!(out.code, prog.drop(), "{what}");
    }
}
