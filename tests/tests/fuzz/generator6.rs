//! The fuzz's IPv6 frames: seeds to the IPv6 frontends (TCP of every
//! flag, UDP, SCTP; behind hop-by-hop, routing, destination options and
//! fragment headers, a first fragment among them), replies of tracked
//! IPv6 flows, frames for no Service, extension header chains deeper than
//! the programs walk, neighbour discovery and echo, later fragments of no
//! datagram sent, and ICMPv6 errors (destination unreachable, packet too
//! big, time exceeded, parameter problem) quoting a recent flow's packet
//! either way or a random tuple; and their mutations at IPv6 offsets
//! (header fields, lengths, next headers, extension headers inserted,
//! fragment fields, the ICMPv6 quote).
//!
//! Datagrams to a frontend or replies go in fragments too (in order,
//! shuffled, the first lost), each with an id of its own; later
//! fragments alone come from another id range (no first seen).

use std::net::{Ipv6Addr, SocketAddrV6};

use etherparse::{
    IcmpEchoHeader, Icmpv6Type,
    icmpv6::{DestUnreachableCode, ParameterProblemCode, ParameterProblemHeader, TimeExceededCode},
};
use proxy_common::proto;
use rand::{Rng, rngs::StdRng, seq::SliceRandom};
use testbed::{
    frame::{ETH_HLEN, Ext6, Frame6, L4, SCTP_INIT_CHUNK, fragments6},
    testrun::*,
};

use crate::{
    generator::{random_bytes, tcp_flags},
    ipv6::{BACKEND_IPS6, NODE_IP6, clients6},
    oracle::Oracle,
};

/// Offsets in an IPv6 frame without extension headers.
const PAYLOAD_LEN: usize = ETH_HLEN + 4;
const NEXT_HEADER: usize = ETH_HLEN + 6;
const SRC: usize = ETH_HLEN + 8;
const DST: usize = ETH_HLEN + 24;
const L4_OFF: usize = ETH_HLEN + 40;
/// An ICMPv6 error's quoted IPv6 header and L4 header.
const INNER_IP6: usize = L4_OFF + 8;
const INNER_L4_6: usize = INNER_IP6 + 40;

/// Ids of datagrams sent in fragments (first fragments), and of later
/// fragments alone: apart, so no later fragment finds a first's ports.
const FIRST_IDS: u32 = 0x0000_0001;
const LATER_IDS: u32 = 0xa5a5_0000;

/// Addresses and ports the IPv6 seeds and mutations draw from.
pub struct Dict6 {
    frontends: Vec<(SocketAddrV6, u8)>,
    clients: Vec<Ipv6Addr>,
    routers: Vec<Ipv6Addr>,
    ips: Vec<Ipv6Addr>,
    ports: Vec<u16>,
}

impl Dict6 {
    fn new(oracle: &Oracle) -> Self {
        let frontends = oracle.frontends6();
        let clients = clients6();
        let routers = vec![
            Ipv6Addr::new(0xfd00, 0x10, 0x244, 9, 0, 0, 0, 9),
            Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 1),
        ];
        let mut ips: Vec<Ipv6Addr> = frontends.iter().map(|(a, _)| *a.ip()).collect();
        ips.extend(BACKEND_IPS6);
        ips.extend(&clients);
        ips.extend(&routers);
        ips.extend([NODE_IP6, Ipv6Addr::UNSPECIFIED, Ipv6Addr::LOCALHOST]);
        ips.sort();
        ips.dedup();
        let ports = vec![
            SERVICE_PORT,
            NODE_PORT,
            BACKEND_PORT,
            EMPTY_NODE_PORT,
            0,
            1,
            65535,
            8443,
        ];
        Self {
            frontends,
            clients,
            routers,
            ips,
            ports,
        }
    }

    fn client(&self, rng: &mut StdRng) -> SocketAddrV6 {
        // A small port pool, as IPv4's: flows repeat.
        let ip = *self.clients.choose(rng).expect("clients");
        SocketAddrV6::new(ip, 40000 + rng.gen_range(0..64), 0, 0)
    }

    fn ip(&self, rng: &mut StdRng) -> Ipv6Addr {
        *self.ips.choose(rng).expect("ips")
    }
}

/// The IPv6 half of the generator (its random stream is the caller's).
pub struct Generator6 {
    pub dict: Dict6,
    first_ids: u32,
    later_ids: u32,
}

impl Generator6 {
    pub fn new(oracle: &Oracle) -> Self {
        Self {
            dict: Dict6::new(oracle),
            first_ids: FIRST_IDS,
            later_ids: LATER_IDS,
        }
    }

    /// One IPv6 seed: a frame, or a datagram's fragments.
    pub fn seed(&mut self, rng: &mut StdRng, oracle: &Oracle) -> Vec<Vec<u8>> {
        let frame = match rng.gen_range(0..100) {
            0..36 => self.for_a_frontend(rng),
            36..54 => self.reply(rng, oracle),
            54..62 => self.not_for_a_service(rng),
            62..70 => self.other(rng),
            70..74 => self.too_deep(rng),
            74..82 => return self.fragmented(rng, oracle),
            _ => self.icmp_error(rng, oracle),
        };
        vec![frame]
    }

    /// A datagram to a frontend, or a reply of a tracked flow, in 2 or
    /// more fragments: in order, shuffled, or the first lost.
    fn fragmented(&mut self, rng: &mut StdRng, oracle: &Oracle) -> Vec<Vec<u8>> {
        let (src, dst, p) = if rng.gen_bool(0.75) {
            let (fe, p) = *self.dict.frontends.choose(rng).expect("IPv6 frontends");
            (self.dict.client(rng), fe, p)
        } else {
            let (client, _, backend, p) = self.recent_flow(rng, oracle);
            (backend, client, p)
        };
        let p = if p == proto::SCTP { proto::UDP } else { p };
        let datagram = l4_frame6(rng, src, dst, p, 24..160);
        let l4_len = datagram.build().len() - L4_OFF;
        let chunk = 8 * rng.gen_range(1..=(l4_len - 1) / 8);
        self.first_ids += 1;
        let mut pieces: Vec<Vec<u8>> = (fragments6(&datagram, chunk, self.first_ids).iter())
            .map(Frame6::build)
            .collect();
        match rng.gen_range(0..10) {
            0..5 => {}
            5..8 => pieces.shuffle(rng),
            _ => {
                pieces.remove(0);
            }
        }
        pieces
    }

    fn for_a_frontend(&mut self, rng: &mut StdRng) -> Vec<u8> {
        let (fe, p) = *self.dict.frontends.choose(rng).expect("IPv6 frontends");
        let c = self.dict.client(rng);
        let frame = l4_frame6(rng, c, fe, p, 0..48);
        self.with_ext_headers(rng, frame).build()
    }

    /// A recently translated IPv6 flow's (client, frontend, backend,
    /// protocol), or a made-up one before there are any.
    fn recent_flow(&self, rng: &mut StdRng, oracle: &Oracle) -> (SocketAddrV6, SocketAddrV6, SocketAddrV6, u8) {
        let list = &oracle.flow_list6;
        match list[list.len().saturating_sub(64)..].choose(rng) {
            Some(flow) => *flow,
            None => (
                self.dict.client(rng),
                SocketAddrV6::new(crate::ipv6::CLUSTER_IP6, SERVICE_PORT, 0, 0),
                SocketAddrV6::new(BACKEND_IPS6[0], BACKEND_PORT, 0, 0),
                proto::TCP,
            ),
        }
    }

    fn reply(&mut self, rng: &mut StdRng, oracle: &Oracle) -> Vec<u8> {
        let (client, _, backend, p) = match oracle.flow_list6.choose(rng) {
            Some(flow) => *flow,
            None => self.recent_flow(rng, oracle),
        };
        let frame = l4_frame6(rng, backend, client, p, 0..48);
        self.with_ext_headers(rng, frame).build()
    }

    fn not_for_a_service(&mut self, rng: &mut StdRng) -> Vec<u8> {
        let port = (*self.dict.ports.choose(rng).expect("ports")).max(1);
        let dst = SocketAddrV6::new(self.dict.ip(rng), port, 0, 0);
        let p = *[proto::TCP, proto::UDP, proto::SCTP].choose(rng).expect("protocols");
        let c = self.dict.client(rng);
        l4_frame6(rng, c, dst, p, 0..48).build()
    }

    /// Neighbour discovery, echo, "no next header", a later fragment alone.
    fn other(&mut self, rng: &mut StdRng) -> Vec<u8> {
        let (src, dst) = (self.dict.client(rng), self.dict.ip(rng));
        match rng.gen_range(0..4) {
            0 => Frame6::neighbour_solicitation(*src.ip(), dst).build(),
            1 => {
                let echo = Icmpv6Type::EchoRequest(IcmpEchoHeader {
                    id: rng.r#gen(),
                    seq: 1,
                });
                Frame6::icmp6_error(*src.ip(), dst, echo, &random_bytes(rng, 16)).build()
            }
            2 => {
                let mut f = Frame6::udp(src, SocketAddrV6::new(dst, SERVICE_PORT, 0, 0), b"none");
                f.l4 = L4::Raw {
                    proto: 59,
                    bytes: random_bytes(rng, 8),
                };
                f.build()
            }
            _ => {
                let (fe, p) = *self.dict.frontends.choose(rng).expect("IPv6 frontends");
                self.later_ids += 1;
                let offset = rng.gen_range(1..200);
                let later = Ext6::Fragment {
                    offset,
                    more: rng.gen_bool(0.5),
                    id: self.later_ids,
                };
                l4_frame6(rng, src, fe, p, 8..40).with_ext(&[later]).build()
            }
        }
    }

    /// A Service packet behind more extension headers than the programs walk.
    fn too_deep(&mut self, rng: &mut StdRng) -> Vec<u8> {
        let (fe, p) = *self.dict.frontends.choose(rng).expect("IPv6 frontends");
        let c = self.dict.client(rng);
        let n = rng.gen_range(5..8);
        let ext: Vec<Ext6> = (0..n).map(|_| plain_ext(rng)).collect();
        l4_frame6(rng, c, fe, p, 0..24).with_ext(&ext).build()
    }

    /// Up to three extension headers, mostly none; among them a first
    /// fragment's header (with an id of its own) or an atomic one.
    fn with_ext_headers(&mut self, rng: &mut StdRng, frame: Frame6) -> Frame6 {
        if rng.gen_bool(0.6) {
            return frame;
        }
        let mut ext: Vec<Ext6> = (0..rng.gen_range(0..=2)).map(|_| plain_ext(rng)).collect();
        if rng.gen_bool(0.5) {
            self.first_ids += 1;
            // Right before the L4 header, else the programs leave it.
            ext.push(Ext6::Fragment {
                offset: 0,
                more: rng.gen_bool(0.7),
                id: self.first_ids,
            });
        }
        frame.with_ext(&ext)
    }

    /// An ICMPv6 error quoting a packet of a recent flow, either way, or
    /// of a random tuple.
    fn icmp_error(&mut self, rng: &mut StdRng, oracle: &Oracle) -> Vec<u8> {
        let (client, frontend, backend, p) = self.recent_flow(rng, oracle);
        let router = *self.dict.routers.choose(rng).expect("routers");
        let (src, dst, quoted) = match rng.gen_range(0..10) {
            0..4 => {
                let from = if rng.gen_bool(0.6) { *backend.ip() } else { router };
                (from, *client.ip(), l4_frame6(rng, client, backend, p, 0..48))
            }
            4..7 => {
                let to = if rng.gen_bool(0.8) { *frontend.ip() } else { router };
                (router, to, l4_frame6(rng, frontend, client, p, 0..48))
            }
            _ => {
                let a = SocketAddrV6::new(self.dict.ip(rng), *self.dict.ports.choose(rng).expect("ports"), 0, 0);
                let b = self.dict.client(rng);
                let (qsrc, qdst) = if rng.gen_bool(0.5) { (a, b) } else { (b, a) };
                let quoted = l4_frame6(rng, qsrc, qdst, proto::UDP, 0..48);
                (self.dict.ip(rng), self.dict.ip(rng), quoted)
            }
        };
        let quoted = if rng.gen_bool(0.1) {
            quoted.with_ext(&[plain_ext(rng)])
        } else {
            quoted
        };
        let quote = quoted.build();
        let whole = quote.len() - ETH_HLEN;
        let keep = match rng.gen_range(0..4) {
            0 => 40 + 4,
            1 => 40 + 8,
            2 => whole,
            _ => rng.gen_range(44..=whole.max(44)),
        };
        let quote = &quote[ETH_HLEN..ETH_HLEN + keep.min(whole)];
        Frame6::icmp6_error(src, dst, error_type6(rng), quote).build()
    }
}

fn plain_ext(rng: &mut StdRng) -> Ext6 {
    let units = rng.gen_range(1..=3);
    match rng.gen_range(0..4) {
        0 => Ext6::HopByHop { units },
        1 => Ext6::Routing { units },
        2 => Ext6::DestOpts { units },
        _ => Ext6::Fragment {
            offset: 0,
            more: false,
            id: rng.r#gen(),
        },
    }
}

fn error_type6(rng: &mut StdRng) -> Icmpv6Type {
    match rng.gen_range(0..5) {
        0 => Icmpv6Type::DestinationUnreachable(DestUnreachableCode::Port),
        1 => Icmpv6Type::DestinationUnreachable(DestUnreachableCode::NoRoute),
        2 => Icmpv6Type::PacketTooBig {
            mtu: *[1280u32, 1400, 1450].choose(rng).expect("MTUs"),
        },
        3 => Icmpv6Type::TimeExceeded(TimeExceededCode::HopLimitExceeded),
        _ => Icmpv6Type::ParameterProblem(ParameterProblemHeader {
            code: ParameterProblemCode::ErroneousHeaderField,
            pointer: rng.gen_range(0..48),
        }),
    }
}

/// A TCP segment (flags of every kind), UDP datagram or SCTP packet
/// with a payload of a length in `payload`, random header fields.
fn l4_frame6(rng: &mut StdRng, src: SocketAddrV6, dst: SocketAddrV6, p: u8, payload: std::ops::Range<usize>) -> Frame6 {
    let n = rng.gen_range(payload);
    let payload = random_bytes(rng, n);
    let mut f = match p {
        proto::TCP => {
            let mut f = Frame6::tcp(src, dst, tcp_flags(rng));
            let t = f.tcp_mut();
            t.seq = rng.r#gen();
            t.ack = rng.r#gen();
            t.window = rng.r#gen();
            t.payload = payload;
            if rng.gen_bool(0.3) {
                t.options = vec![2, 4, 5, 0xa0, 1, 3, 3, 7];
            }
            f
        }
        proto::SCTP => Frame6::sctp(src, dst, rng.r#gen(), &SCTP_INIT_CHUNK),
        _ => Frame6::udp(src, dst, &payload),
    };
    f.hop_limit = rng.r#gen();
    f
}

fn put_ip6(b: &mut [u8], at: usize, ip: Ipv6Addr) {
    if at + 16 <= b.len() {
        b[at..at + 16].copy_from_slice(&ip.octets());
    }
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    if at + 2 <= b.len() {
        b[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
}

/// Applies one mutation at an IPv6 offset (the generic ones, bit flips,
/// truncation and so on, are `generator::mutate`'s).
pub fn mutate6(rng: &mut StdRng, dict: &Dict6, b: &mut Vec<u8>) {
    match rng.gen_range(0..12) {
        0 => {
            // Swap the addresses.
            if b.len() >= L4_OFF {
                let src: [u8; 16] = b[SRC..DST].try_into().expect("16 bytes");
                b.copy_within(DST..L4_OFF, SRC);
                b[DST..L4_OFF].copy_from_slice(&src);
            }
        }
        1 => put_ip6(b, if rng.gen_bool(0.5) { SRC } else { DST }, dict.ip(rng)),
        2 => {
            let at = L4_OFF + if rng.gen_bool(0.5) { 0 } else { 2 };
            put_u16(b, at, *dict.ports.choose(rng).expect("ports"));
        }
        3 => {
            // Payload length: near the truth or anything.
            let truth = b.len().saturating_sub(L4_OFF) as i64;
            let v = if rng.gen_bool(0.7) {
                (truth + rng.gen_range(-30..8)).clamp(0, 65535) as u16
            } else {
                rng.r#gen()
            };
            put_u16(b, PAYLOAD_LEN, v);
        }
        4 => {
            if b.len() > NEXT_HEADER {
                b[NEXT_HEADER] = *[0u8, 43, 44, 60, 58, 6, 17, 132, 59, 50, 255]
                    .choose(rng)
                    .expect("next headers");
            }
        }
        5 | 6 => insert_ext_header(rng, b),
        7 => {
            // A fragment header's offset and more-fragments bits, wherever
            // the first extension header is one.
            if b.len() > L4_OFF + 4 && b[NEXT_HEADER] == 44 {
                let v: u16 = *[0x0001, 0x0008, 0x0009, 0x0000, rng.r#gen()]
                    .choose(rng)
                    .expect("fields");
                put_u16(b, L4_OFF + 2, v);
            }
        }
        8 => put_ip6(b, INNER_IP6 + if rng.gen_bool(0.5) { 8 } else { 24 }, dict.ip(rng)),
        9 => {
            let at = INNER_L4_6 + if rng.gen_bool(0.5) { 0 } else { 2 };
            put_u16(b, at, *dict.ports.choose(rng).expect("ports"));
        }
        10 => {
            // ICMPv6 type and code.
            if b.len() > L4_OFF + 1 {
                b[L4_OFF + rng.gen_range(0..2)] = *[1u8, 2, 3, 4, 5, 0, 128, 129, 135, 136, 255]
                    .choose(rng)
                    .expect("types");
            }
        }
        _ => {
            // The quoted header's version, payload length or next header.
            let at = INNER_IP6 + *[0usize, 4, 5, 6].choose(rng).expect("fields");
            if b.len() > at {
                b[at] = rng.r#gen();
            }
        }
    }
}

/// Inserts an 8-byte destination options (or hop-by-hop, or routing)
/// header right after the IPv6 header, the payload length grown with it:
/// repeated, the chain outgrows the programs' walk.
fn insert_ext_header(rng: &mut StdRng, b: &mut Vec<u8>) {
    if b.len() < L4_OFF {
        return;
    }
    let kind = *[60u8, 0, 43].choose(rng).expect("kinds");
    let header = if kind == 43 {
        [b[NEXT_HEADER], 0, 253, 0, 0, 0, 0, 0]
    } else {
        [b[NEXT_HEADER], 0, 1, 4, 0, 0, 0, 0]
    };
    b.splice(L4_OFF..L4_OFF, header);
    b[NEXT_HEADER] = kind;
    let len = u16::from_be_bytes([b[PAYLOAD_LEN], b[PAYLOAD_LEN + 1]]);
    put_u16(b, PAYLOAD_LEN, len.wrapping_add(8));
}

/// Whether a frame is IPv6 by its ether type.
pub fn is_ipv6(b: &[u8]) -> bool {
    b.len() >= ETH_HLEN && b[12..14] == [0x86, 0xdd]
}
