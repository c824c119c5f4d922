//! The frames the fuzz runs: seeds, mutated 4 times in 5.
//!
//! A seed is a valid frame of some class (to a frontend, a reply of a
//! tracked flow, not for a Service, another protocol, random bytes), or a
//! sequence: a datagram to a Service (or a tracked flow's reply) in
//! fragments, in order, shuffled, with a fragment twice or the first
//! missing; a later fragment alone (of a recent datagram, of any earlier
//! one, of one never sent); an ICMP error quoting a recently translated
//! packet (a backend's port unreachable about a DNATed packet, a router's
//! frag-needed about a reverse-NATed reply, time exceeded) or a random
//! tuple. A mutated seed has one of its frames changed 1 to 3 times (bit
//! flips, byte sets, truncation, extension, address and port swaps, header
//! fields set to edge values, VLAN tags, the quote of an ICMP error).
//! Reply and ICMP seeds are built from the flows the program translated,
//! so their bytes depend on its random picks. One seed in
//! [`IPV6_SHARE`] is IPv6's (`generator6`), mutated at IPv6 offsets or
//! as IPv4's.

use std::{
    collections::VecDeque,
    net::{Ipv4Addr, SocketAddrV4},
};

use etherparse::{
    Icmpv4Type,
    icmpv4::{DestUnreachableHeader, TimeExceededCode},
};
use proxy_common::proto;
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
use testbed::{
    frame::{ETH_HLEN, Frame, fragments, icmp_offsets::*, tcp_flags::*},
    testrun::*,
};

use crate::{
    generator6::{Generator6, is_ipv6, mutate6},
    oracle::Oracle,
};

/// The share of seeds that are IPv6 frames (of the same frame budget:
/// the run time stays IPv4's alone).
const IPV6_SHARE: f64 = 1.0 / 3.0;

/// Addresses and ports seeds and mutations draw from.
struct Dict {
    frontends: Vec<(SocketAddrV4, u8)>,
    ips: Vec<Ipv4Addr>,
    ports: Vec<u16>,
    clients: Vec<Ipv4Addr>,
    /// Routers that send ICMP errors about packets passing them.
    routers: Vec<Ipv4Addr>,
}

impl Dict {
    fn new(oracle: &Oracle) -> Self {
        let frontends = oracle.frontends();
        let clients: Vec<Ipv4Addr> = (0..8)
            .map(|i| Ipv4Addr::new(10, 244, 1, 5 + i))
            .chain((0..8).map(|i| Ipv4Addr::new(203, 0, 113, 7 + i)))
            .collect();
        let routers = vec![Ipv4Addr::new(10, 244, 9, 9), Ipv4Addr::new(198, 51, 100, 1)];
        let mut ips: Vec<Ipv4Addr> = frontends.iter().map(|(a, _)| *a.ip()).collect();
        ips.extend(BACKEND_IPS);
        ips.extend(&clients);
        ips.extend(&routers);
        ips.extend([
            Ipv4Addr::new(8, 8, 8, 8),
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::BROADCAST,
            *TCP_ONLY_BACKEND.ip(),
        ]);
        let ports = vec![
            SERVICE_PORT,
            NODE_PORT,
            BACKEND_PORT,
            EMPTY_PORT,
            EMPTY_NODE_PORT,
            TCP_ONLY_PORT,
            0,
            1,
            65535,
            8443,
        ];
        Self {
            frontends,
            ips,
            ports,
            clients,
            routers,
        }
    }

    fn client(&self, rng: &mut StdRng) -> SocketAddrV4 {
        // A small port pool: flows repeat, so "established" gets exercised.
        SocketAddrV4::new(
            *self.clients.choose(rng).expect("clients"),
            40000 + rng.gen_range(0..64),
        )
    }

    fn ip(&self, rng: &mut StdRng) -> Ipv4Addr {
        *self.ips.choose(rng).expect("ips")
    }

    fn port(&self, rng: &mut StdRng) -> u16 {
        *self.ports.choose(rng).expect("ports")
    }
}

/// Seeds and mutations, from one seeded random stream.
pub struct Generator {
    rng: StdRng,
    dict: Dict,
    /// The rest of the current seed's frames, and whether each is mutated.
    queue: VecDeque<(Vec<u8>, bool)>,
    /// One later fragment of every datagram sent in fragments, oldest first.
    later_fragments: Vec<Vec<u8>>,
    v6: Generator6,
}

impl Generator {
    pub fn new(seed: u64, oracle: &Oracle) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            dict: Dict::new(oracle),
            queue: VecDeque::new(),
            later_fragments: Vec::new(),
            v6: Generator6::new(oracle),
        }
    }

    /// The next frame to run, and whether it was mutated.
    pub fn next(&mut self, oracle: &Oracle) -> (Vec<u8>, bool) {
        if self.queue.is_empty() {
            let frames = self.seed(oracle);
            let mutated = self.rng.gen_bool(0.8).then(|| self.rng.gen_range(0..frames.len()));
            for (i, mut frame) in frames.into_iter().enumerate() {
                if mutated == Some(i) {
                    for _ in 0..self.rng.gen_range(1..=3) {
                        if is_ipv6(&frame) && self.rng.gen_bool(0.5) {
                            mutate6(&mut self.rng, &self.v6.dict, &mut frame);
                        } else {
                            mutate(&mut self.rng, &self.dict, &mut frame);
                        }
                    }
                }
                self.queue.push_back((frame, mutated == Some(i)));
            }
        }
        self.queue.pop_front().expect("a seed has a frame")
    }

    /// A seed: one frame, or a sequence (fragments).
    fn seed(&mut self, oracle: &Oracle) -> Vec<Vec<u8>> {
        if self.rng.gen_bool(IPV6_SHARE) {
            return self.v6.seed(&mut self.rng, oracle);
        }
        match self.rng.gen_range(0..100) {
            0..38 => vec![self.for_a_frontend()],
            38..58 => vec![self.reply(oracle)],
            58..70 => vec![self.not_for_a_service()],
            70..74 => vec![self.other_protocol()],
            74..82 => vec![self.random_bytes()],
            82..89 => self.fragmented(oracle),
            89..92 => vec![self.later_fragment_alone()],
            _ => vec![self.icmp_error(oracle)],
        }
    }

    /// To a frontend (with or without backends).
    fn for_a_frontend(&mut self) -> Vec<u8> {
        let (fe, p) = *self.dict.frontends.choose(&mut self.rng).expect("frontends");
        let c = self.dict.client(&mut self.rng);
        l4_frame(&mut self.rng, c, fe, p, 0..48).build()
    }

    /// A recently translated flow's (client, frontend, backend, protocol),
    /// or a made-up one before there are any.
    fn recent_flow(&mut self, oracle: &Oracle) -> (SocketAddrV4, SocketAddrV4, SocketAddrV4, u8) {
        let recent = &oracle.flow_list[oracle.flow_list.len().saturating_sub(64)..];
        match recent.choose(&mut self.rng) {
            Some(flow) => *flow,
            None => (
                self.dict.client(&mut self.rng),
                cluster_ip(),
                SocketAddrV4::new(BACKEND_IPS[0], BACKEND_PORT),
                proto::TCP,
            ),
        }
    }

    /// A reply of a tracked flow (or of a made-up one before there are any).
    fn reply(&mut self, oracle: &Oracle) -> Vec<u8> {
        let (client, _, backend, p) = match oracle.flow_list.choose(&mut self.rng) {
            Some(flow) => *flow,
            None => self.recent_flow(oracle),
        };
        l4_frame(&mut self.rng, backend, client, p, 0..48).build()
    }

    /// Not for a Service: a known IP with some port, or anything.
    fn not_for_a_service(&mut self) -> Vec<u8> {
        let port = self.dict.port(&mut self.rng).max(1);
        let dst = SocketAddrV4::new(self.dict.ip(&mut self.rng), port);
        let p = if self.rng.gen_bool(0.5) { proto::TCP } else { proto::UDP };
        let c = self.dict.client(&mut self.rng);
        l4_frame(&mut self.rng, c, dst, p, 0..48).build()
    }

    fn other_protocol(&mut self) -> Vec<u8> {
        let dst = self.dict.ip(&mut self.rng);
        let src = *self.dict.clients.choose(&mut self.rng).expect("clients");
        match self.rng.gen_range(0..3) {
            0 => Frame::icmp_echo(src, dst).build(),
            1 => Frame::arp_request(src, dst).build(),
            _ => Frame::ipv6_udp(SocketAddrV4::new(dst, SERVICE_PORT)).build(),
        }
    }

    /// Random bytes, mostly under the IPv4 ether type.
    fn random_bytes(&mut self) -> Vec<u8> {
        let len = self.rng.gen_range(14..120);
        let mut b = random_bytes(&mut self.rng, len);
        if self.rng.gen_bool(0.7) {
            b[12..14].copy_from_slice(&[0x08, 0x00]);
            if b.len() > 14 && self.rng.gen_bool(0.5) {
                b[14] = 0x45;
            }
        }
        b
    }

    /// A datagram to a frontend, or a reply of a tracked flow, in 2 to 5
    /// fragments, in some order.
    fn fragmented(&mut self, oracle: &Oracle) -> Vec<Vec<u8>> {
        let (src, dst, p) = if self.rng.gen_bool(0.75) {
            let (fe, p) = *self.dict.frontends.choose(&mut self.rng).expect("frontends");
            (self.dict.client(&mut self.rng), fe, p)
        } else {
            let (client, _, backend, p) = self.recent_flow(oracle);
            (backend, client, p)
        };
        let datagram = l4_frame(&mut self.rng, src, dst, p, 16..160).with_padding(&[]);
        // 2 to 5 pieces of a multiple of 8 bytes, the first mostly big
        // enough for the L4 header.
        let l4_len = l4_len(&datagram.build());
        let most = (l4_len - 1) / 8;
        let header = if self.rng.gen_bool(0.9) { 28 } else { 8 };
        let least = l4_len.div_ceil(5 * 8).max(header / 8 + 1).min(most);
        let chunk = 8 * self.rng.gen_range(least..=most);
        let mut pieces: Vec<Vec<u8>> = fragments(&datagram, chunk).iter().map(Frame::build).collect();
        if let Some(later) = pieces[1..].choose(&mut self.rng) {
            self.later_fragments.push(later.clone());
        }
        self.reorder(&mut pieces);
        pieces
    }

    /// In order, shuffled, one fragment twice, or the first lost.
    fn reorder(&mut self, pieces: &mut Vec<Vec<u8>>) {
        match self.rng.gen_range(0..20) {
            0..8 => {}
            8..14 => pieces.shuffle(&mut self.rng),
            14..17 => {
                let twice = pieces[0].clone();
                let at = self.rng.gen_range(1..=pieces.len());
                pieces.insert(at, twice);
            }
            17..19 => {
                let i = self.rng.gen_range(1..pieces.len());
                let twice = pieces[i].clone();
                pieces.push(twice);
                pieces.shuffle(&mut self.rng);
            }
            _ => {
                pieces.remove(0);
            }
        }
    }

    /// A later fragment alone: of a recent datagram, of any earlier one,
    /// or of a datagram never sent.
    fn later_fragment_alone(&mut self) -> Vec<u8> {
        let sent = self.later_fragments.len();
        match self.rng.gen_range(0..3) {
            0 if sent > 0 => self.later_fragments[self.rng.gen_range(sent.saturating_sub(32)..sent)].clone(),
            1 if sent > 0 => self.later_fragments[self.rng.gen_range(0..sent)].clone(),
            _ => {
                let (fe, p) = *self.dict.frontends.choose(&mut self.rng).expect("frontends");
                let c = self.dict.client(&mut self.rng);
                let datagram = l4_frame(&mut self.rng, c, fe, p, 40..80).with_padding(&[]);
                fragments(&datagram, 32)[1].build()
            }
        }
    }

    /// An ICMP error quoting a packet of a recent flow, either way, or of
    /// a random tuple.
    fn icmp_error(&mut self, oracle: &Oracle) -> Vec<u8> {
        let (client, frontend, backend, p) = self.recent_flow(oracle);
        let router = *self.dict.routers.choose(&mut self.rng).expect("routers");
        let (src, dst, quoted) = match self.rng.gen_range(0..10) {
            // The backend, or a router behind the DNAT, about a DNATed packet.
            0..4 => {
                let from = if self.rng.gen_bool(0.6) { *backend.ip() } else { router };
                (from, *client.ip(), l4_frame(&mut self.rng, client, backend, p, 0..48))
            }
            // A router about a reverse-NATed reply, towards the frontend.
            4..7 => {
                let to = if self.rng.gen_bool(0.8) { *frontend.ip() } else { router };
                (router, to, l4_frame(&mut self.rng, frontend, client, p, 0..48))
            }
            _ => self.stray_quote(),
        };
        let quote = quoted.build();
        let ip_len = 20 + l4_len(&quote);
        let keep = match self.rng.gen_range(0..4) {
            0 => 20 + 4,
            1 => 20 + 8,
            2 => ip_len,
            _ => self.rng.gen_range(24..=ip_len),
        };
        let mut error = Frame::icmp_error(
            src,
            dst,
            self.error_type(),
            &quote[ETH_HLEN..ETH_HLEN + keep.min(ip_len)],
        );
        if self.rng.gen_bool(0.1) {
            let n = self.rng.gen_range(1..24);
            error = error.with_padding(&random_bytes(&mut self.rng, n));
        }
        error.build()
    }

    /// An ICMP error's addresses and quoted packet, all drawn at random.
    fn stray_quote(&mut self) -> (Ipv4Addr, Ipv4Addr, Frame) {
        let p = if self.rng.gen_bool(0.5) { proto::TCP } else { proto::UDP };
        let a = SocketAddrV4::new(self.dict.ip(&mut self.rng), self.dict.port(&mut self.rng).max(1));
        let b = self.dict.client(&mut self.rng);
        let (qsrc, qdst) = if self.rng.gen_bool(0.5) { (a, b) } else { (b, a) };
        let quoted = l4_frame(&mut self.rng, qsrc, qdst, p, 0..48);
        (self.dict.ip(&mut self.rng), self.dict.ip(&mut self.rng), quoted)
    }

    fn error_type(&mut self) -> Icmpv4Type {
        match self.rng.gen_range(0..4) {
            0 => Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port),
            1 => Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Host),
            2 => Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded {
                next_hop_mtu: *[576u16, 1280, 1400, 1450].choose(&mut self.rng).expect("MTUs"),
            }),
            _ => Icmpv4Type::TimeExceeded(TimeExceededCode::TtlExceededInTransit),
        }
    }
}

/// The L4 length of a built IPv4 frame (its total length less the header).
fn l4_len(frame: &[u8]) -> usize {
    usize::from(u16::from_be_bytes([frame[ETH_HLEN + 2], frame[ETH_HLEN + 3]])) - 20
}

pub fn random_bytes(rng: &mut StdRng, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    rng.fill(&mut b[..]);
    b
}

/// A TCP segment (flags of every kind) or UDP datagram with a payload of
/// a length in `payload`, random header fields, sometimes padded.
fn l4_frame(
    rng: &mut StdRng,
    src: SocketAddrV4,
    dst: SocketAddrV4,
    proto: u8,
    payload: std::ops::Range<usize>,
) -> Frame {
    let n = rng.gen_range(payload);
    let payload = random_bytes(rng, n);
    let mut f = if proto == proto::TCP {
        let flags = tcp_flags(rng);
        Frame::tcp(src, dst, flags).with_tcp(|t| {
            t.seq = rng.r#gen();
            t.ack = rng.r#gen();
            t.window = rng.r#gen();
            t.payload = payload;
            if rng.gen_bool(0.3) {
                t.options = vec![2, 4, 5, 0xb4, 1, 3, 3, 7];
            }
        })
    } else {
        Frame::udp(src, dst, &payload).with_udp(|u| u.zero_checksum = rng.gen_bool(0.15))
    };
    f = f.with_ip(|ip| {
        ip.ttl = rng.r#gen();
        ip.id = rng.r#gen();
        ip.tos = rng.r#gen();
        ip.df = rng.gen_bool(0.7);
    });
    if rng.gen_bool(0.15) {
        let n = rng.gen_range(1..20);
        let pad = random_bytes(rng, n);
        f = f.with_padding(&pad);
    }
    f
}

/// TCP flags of every kind a segment may carry.
pub fn tcp_flags(rng: &mut StdRng) -> u8 {
    *[
        SYN,
        ACK,
        PSH | ACK,
        FIN | ACK,
        RST,
        RST | ACK,
        SYN | ACK,
        0,
        FIN,
        URG | ACK,
    ]
    .choose(rng)
    .expect("flags")
}

const INTERESTING: [u8; 14] = [0, 1, 0x45, 0x46, 0x40, 0x20, 0x3f, 6, 17, 1, 0x50, 0x60, 0x80, 0xff];

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    if at + 2 <= b.len() {
        b[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
}

fn put_ip(b: &mut [u8], at: usize, ip: Ipv4Addr) {
    if at + 4 <= b.len() {
        b[at..at + 4].copy_from_slice(&ip.octets());
    }
}

/// Applies one random mutation.
fn mutate(rng: &mut StdRng, dict: &Dict, b: &mut Vec<u8>) {
    // Offsets mostly inside the headers (an ICMP error's quote included).
    let pos = |rng: &mut StdRng, len: usize| {
        if rng.gen_bool(0.8) {
            rng.gen_range(0..len.min(66))
        } else {
            rng.gen_range(0..len)
        }
    };
    let l4 = ETH_HLEN + 20;
    match rng.gen_range(0..20) {
        0 | 1 => {
            let i = pos(rng, b.len());
            b[i] ^= 1 << rng.gen_range(0..8);
        }
        2 => {
            let i = pos(rng, b.len());
            b[i] = rng.r#gen();
        }
        3 => {
            let i = pos(rng, b.len());
            b[i] = *INTERESTING.choose(rng).expect("values");
        }
        4 => {
            let n = rng.gen_range(14..=b.len());
            b.truncate(n);
        }
        5 => {
            let n = rng.gen_range(1..32);
            b.extend(random_bytes(rng, n));
        }
        6 => {
            // Swap source and destination address.
            if b.len() >= 34 {
                let (s, d): ([u8; 4], [u8; 4]) = (b[26..30].try_into().expect("4"), b[30..34].try_into().expect("4"));
                b[26..30].copy_from_slice(&d);
                b[30..34].copy_from_slice(&s);
            }
        }
        7 => {
            // Swap ports.
            if b.len() >= l4 + 4 {
                let (s, d) = ([b[l4], b[l4 + 1]], [b[l4 + 2], b[l4 + 3]]);
                b[l4..l4 + 2].copy_from_slice(&d);
                b[l4 + 2..l4 + 4].copy_from_slice(&s);
            }
        }
        8 => {
            let at = if rng.gen_bool(0.5) { 26 } else { 30 };
            put_ip(b, at, dict.ip(rng));
        }
        9 => {
            let at = l4 + if rng.gen_bool(0.5) { 0 } else { 2 };
            put_u16(b, at, dict.port(rng));
        }
        10 => {
            // Version / IHL nibbles.
            if b.len() > 14 {
                b[14] = if rng.gen_bool(0.5) {
                    0x40 | rng.gen_range(0..16)
                } else {
                    (rng.gen_range(0..16) << 4) | 5
                };
            }
        }
        11 => {
            // Total length: near the truth or anything.
            let truth = b.len().saturating_sub(14) as i64;
            let v = if rng.gen_bool(0.7) {
                (truth + rng.gen_range(-30..8)).clamp(0, 65535) as u16
            } else {
                rng.r#gen()
            };
            put_u16(b, 16, v);
        }
        12 => {
            // Flags and fragment offset.
            let v: u16 = match rng.gen_range(0..4) {
                0 => 0x2000,
                1 => rng.gen_range(1..0x2000),
                2 => 0x4000,
                _ => rng.r#gen(),
            };
            put_u16(b, 20, v);
        }
        13 => {
            if b.len() > 23 {
                b[23] = *[6u8, 17, 1, 0, 47, 132, 255].choose(rng).expect("protos");
            }
        }
        14 => {
            // TCP data offset nibble.
            if b.len() > l4 + 12 {
                b[l4 + 12] = (rng.gen_range(0..16) << 4) | (b[l4 + 12] & 0x0f);
            }
        }
        15 => {
            if rng.gen_bool(0.5) {
                // Insert a VLAN tag.
                let tpid: u16 = if rng.gen_bool(0.5) { 0x8100 } else { 0x88a8 };
                let tag = [(tpid >> 8) as u8, tpid as u8, 0, rng.r#gen()];
                b.splice(12..12, tag);
            } else {
                let t: u16 = *[0x0800u16, 0x8100, 0x88a8, 0x86dd, 0x0806, 0x9100, 0x0040]
                    .choose(rng)
                    .expect("types");
                put_u16(b, 12, t);
            }
        }
        16 => {
            // An ICMP error's quoted addresses.
            let at = INNER_IP + if rng.gen_bool(0.5) { 12 } else { 16 };
            put_ip(b, at, dict.ip(rng));
        }
        17 => {
            // An ICMP error's quoted ports.
            let at = INNER_L4 + if rng.gen_bool(0.5) { 0 } else { 2 };
            put_u16(b, at, dict.port(rng));
        }
        18 => {
            // A byte of an ICMP error's quoted IPv4 header.
            if b.len() > INNER_L4 {
                b[rng.gen_range(INNER_IP..INNER_L4)] = *INTERESTING.choose(rng).expect("values");
            }
        }
        _ => {
            // ICMP type and code.
            if b.len() > ICMP + 1 {
                b[ICMP + rng.gen_range(0..2)] = *[3u8, 11, 0, 8, 4, 5, 12, 255].choose(rng).expect("types");
            }
        }
    }
}
