//! Fuzzes each program with mutated frames against an independent oracle.
//!
//! For each of xdp_uplink, tc_ingress and tc_egress: one data path with the
//! seed Services, then frames until 1,000,000 of them were mutated (about
//! 1,250,000 in all). A frame starts as a valid Service, reply, reject or
//! non-Service frame, or as random bytes, and gets 1 to 3 mutations (bit
//! flips, byte sets, truncation, extension, address and port swaps, header
//! fields set to edge values, VLAN tag insertion) 4 times in 5. Fixed seeds
//! fix the stream of random choices; reply frames are built from the
//! backends the program picked, so their bytes vary between runs.
//!
//! The oracle parses each input with `frame::parse_strict` (etherparse
//! based, the documented malformed-input policy) and keeps its own table of
//! the flows the program translated:
//! - not fully parsed, not TCP/UDP, not for a frontend and not a packet of a
//!   tracked flow: the code is "pass" and the output equals the input;
//! - a packet's own tuple is looked up among the tracked flows first (the
//!   programs' one conntrack key space): a flow's forward tuple is DNATed
//!   to its backend, a reply tuple reverse-NATed, whatever else it is
//!   addressed to;
//! - a new flow whose reply tuple would be another flow's forward tuple is
//!   not tracked: passed untouched, counted as an error;
//! - for a frontend with backends: only the destination address and port and
//!   the two checksums change, the new destination is a backend of that
//!   Service (the same one for every packet of a flow), and both checksums
//!   keep their ones' complement residual (an incremental update, correct
//!   even when the input checksum was wrong); UDP checksum 0 stays 0;
//! - a reply of a tracked flow: only the source and the checksums change,
//!   the source becomes the flow's frontend (tc_egress may instead pass it
//!   untouched: it is scoped to forward traffic);
//! - for a frontend without backends: exactly the RST / ICMP answer (a TCP
//!   RST passes untouched).
//!
//! Frames the kernel refuses for tc before the program runs (see
//! `testrun::kernel_may_refuse`) are counted and skipped. At the end the
//! verdict counters must add up to the oracle's counts; every deviation kind
//! is reported with its count and first example.
//!
//! Environment: `XPROXY_FUZZ_FRAMES` (mutated frames per program, default
//! 1000000), `XPROXY_FUZZ_SEED`. About 55 s for all three in a debug build
//! on 2 cores, 11 s with `--release` (3-5 µs per frame there, test_run included).

use std::{
    collections::{BTreeMap, HashMap},
    net::{Ipv4Addr, SocketAddrV4},
    time::Instant,
};

use proxy_common::{Verdict, proto};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};
use xproxy_tests::{
    frame::{
        ETH_HLEN, Flow, Frame, Strict, diff, expected_port_unreachable, expected_rst, hex, parse_strict, residuals,
        same_checksum, tcp_flags::*,
    },
    privileged::require_root,
    testrun::*,
};

/// Mutated frames per program (unmutated valid frames come on top, about 1 in 5).
const DEFAULT_MUTATED: u64 = 1_000_000;
const DEFAULT_SEED: u64 = 0x7870_726f_7879; // "xproxy"

/// (source, destination, protocol) of a packet.
type Tuple = (SocketAddrV4, SocketAddrV4, u8);

struct Service {
    backends: Vec<SocketAddrV4>,
}

/// What the oracle knows: the Services and the flows the program translated.
#[derive(Default)]
struct Oracle {
    services: HashMap<(SocketAddrV4, u8), Service>,
    /// Forward tuple -> pinned backend.
    flows: HashMap<Tuple, SocketAddrV4>,
    /// Reply tuple (backend -> client) -> frontends it may be rewritten to
    /// (two frontends of one Service can share a backend and a client port).
    replies: HashMap<Tuple, Vec<SocketAddrV4>>,
    /// (client, frontend, backend, proto) of every translated flow, for replies.
    flow_list: Vec<(SocketAddrV4, SocketAddrV4, SocketAddrV4, u8)>,
}

/// What a frame must do.
#[derive(Clone, Debug)]
enum Expect {
    /// Kernel refuses it before the program runs (tc, short IP header).
    Refused,
    Pass(Verdict, &'static str),
    /// TCP RST to a no-backend Service: passed untouched, counted as pass or reject.
    PassRstToEmpty,
    Dnat {
        backends: Vec<SocketAddrV4>,
        pinned: Option<SocketAddrV4>,
        /// A new flow whose reply tuple, for some backend, is a tracked
        /// forward tuple: passing it untouched (untracked) is right too.
        may_collide: bool,
        flow: Flow,
    },
    RevNat {
        frontends: Vec<SocketAddrV4>,
        flow: Flow,
        /// tc_egress: the brief scopes it to forward traffic, so passing a
        /// reply untouched is accepted there too.
        may_pass: bool,
    },
    Reject(Vec<u8>),
}

impl Expect {
    fn class(&self) -> String {
        match self {
            Expect::Refused => "refused by the kernel".into(),
            Expect::Pass(v, why) => format!("{} ({why})", v.name()),
            Expect::PassRstToEmpty => "pass: RST to a Service without backends".into(),
            Expect::Dnat { pinned: None, .. } => "dnat_new".into(),
            Expect::Dnat { pinned: Some(_), .. } => "dnat_established".into(),
            Expect::RevNat { .. } => "rev_nat".into(),
            Expect::Reject(r) if r.len() == 54 => "reject: TCP RST".into(),
            Expect::Reject(_) => "reject: ICMP port unreachable".into(),
        }
    }
}

impl Oracle {
    fn new() -> Self {
        let mut o = Oracle::default();
        for svc in seed_services() {
            let p = svc.protocol.number();
            let backends: Vec<SocketAddrV4> = svc
                .endpoints
                .iter()
                .map(|e| SocketAddrV4::new(e.addr, e.port))
                .collect();
            o.services.insert(
                (SocketAddrV4::new(svc.cluster_ip, svc.port), p),
                Service {
                    backends: backends.clone(),
                },
            );
            if let Some(np) = svc.node_port {
                o.services
                    .insert((SocketAddrV4::new(NODE_IP, np), p), Service { backends });
            }
        }
        o
    }

    fn expect(&self, prog: Prog, input: &[u8]) -> Expect {
        if kernel_may_refuse(prog, input) {
            return Expect::Refused;
        }
        let flow = match parse_strict(input) {
            Strict::Malformed(why) => return Expect::Pass(Verdict::PassMalformed, why),
            Strict::NotIpv4OrL4(why) => return Expect::Pass(Verdict::PassNotIpv4OrL4, why),
            Strict::Flow(f) => f,
        };
        let tuple = (flow.src, flow.dst, flow.proto);
        if let Some(frontends) = self.replies.get(&tuple) {
            return Expect::RevNat {
                frontends: frontends.clone(),
                flow,
                may_pass: prog == Prog::TcEgress,
            };
        }
        match self.services.get(&(flow.dst, flow.proto)) {
            Some(svc) if !svc.backends.is_empty() => Expect::Dnat {
                backends: svc.backends.clone(),
                pinned: self.flows.get(&tuple).copied(),
                may_collide: svc
                    .backends
                    .iter()
                    .any(|b| self.flows.contains_key(&(*b, flow.src, flow.proto))),
                flow,
            },
            Some(_) if flow.is_tcp() && flow.tcp_flags & RST != 0 => Expect::PassRstToEmpty,
            Some(_) if flow.is_tcp() => Expect::Reject(expected_rst(input, &flow)),
            Some(_) => Expect::Reject(expected_port_unreachable(input, &flow)),
            None => Expect::Pass(Verdict::PassNotService, "no frontend, no flow"),
        }
    }

    fn record_dnat(&mut self, flow: &Flow, backend: SocketAddrV4) {
        let tuple = (flow.src, flow.dst, flow.proto);
        if self.flows.insert(tuple, backend).is_none() {
            self.flow_list.push((flow.src, flow.dst, backend, flow.proto));
        }
        let fronts = self.replies.entry((backend, flow.src, flow.proto)).or_default();
        if !fronts.contains(&flow.dst) {
            fronts.push(flow.dst);
        }
    }
}

/// Problems found, by kind: count and the first example.
#[derive(Default)]
struct Findings(BTreeMap<String, (u64, String)>);

impl Findings {
    fn add(&mut self, kind: String, example: impl FnOnce() -> String) {
        let e = self.0.entry(kind).or_insert_with(|| (0, String::new()));
        if e.0 == 0 {
            e.1 = example();
        }
        e.0 += 1;
    }
}

/// Bytes a DNAT may change: IPv4 checksum, destination address, destination
/// port, L4 checksum. A reverse NAT: the same with the source.
fn allowed_offsets(flow: &Flow, dnat: bool) -> [usize; 10] {
    let l4 = flow.l4_offset;
    let c = flow.l4_checksum_offset();
    if dnat {
        [24, 25, 30, 31, 32, 33, l4 + 2, l4 + 3, c, c + 1]
    } else {
        [24, 25, 26, 27, 28, 29, l4, l4 + 1, c, c + 1]
    }
}

/// Checks a translated frame; returns the new address (destination for
/// DNAT, source for reverse NAT) or the problem.
fn check_translation(input: &[u8], out: &[u8], flow: &Flow, dnat: bool) -> Result<SocketAddrV4, String> {
    if out.len() != input.len() {
        return Err("length changed".into());
    }
    let allowed = allowed_offsets(flow, dnat);
    let changed: Vec<usize> = (0..input.len())
        .filter(|&i| input[i] != out[i] && !allowed.contains(&i))
        .collect();
    if !changed.is_empty() {
        return Err(format!(
            "bytes other than address/port/checksums changed at {changed:?}"
        ));
    }
    let Strict::Flow(after) = parse_strict(out) else {
        return Err("output no longer parses".into());
    };
    let (ip_in, l4_in) = residuals(input, flow);
    let (ip_out, l4_out) = residuals(out, &after);
    if !same_checksum(ip_in, ip_out) {
        return Err("IPv4 checksum not updated consistently".into());
    }
    let c = flow.l4_checksum_offset();
    let (csum_in, csum_out) = ([input[c], input[c + 1]], [out[c], out[c + 1]]);
    if !flow.is_tcp() && csum_in == [0, 0] {
        if csum_out != [0, 0] {
            return Err("UDP checksum 0 (none) was changed".into());
        }
    } else {
        if !flow.is_tcp() && csum_out == [0, 0] {
            return Err("UDP checksum became 0 (none) instead of 0xffff".into());
        }
        if !same_checksum(l4_in, l4_out) {
            return Err("L4 checksum not updated consistently".into());
        }
    }
    Ok(if dnat { after.dst } else { after.src })
}

struct Counts {
    /// Frames the program ran (not refused by the kernel), and their bytes.
    ran: u64,
    ran_bytes: u64,
    pass: u64,
    rst_to_empty: u64,
    reply_or_pass: u64,
    by_verdict: [(u64, u64); Verdict::COUNT as usize],
}

/// What a fuzz run found and counted.
struct Tally {
    findings: Findings,
    /// Frames by expected outcome.
    classes: BTreeMap<String, u64>,
    counts: Counts,
}

/// Runs one frame, checks it against the oracle, updates the oracle.
fn run_one(h: &mut Harness, prog: Prog, oracle: &mut Oracle, input: &[u8], tally: &mut Tally) {
    let Tally {
        findings,
        classes,
        counts,
    } = tally;
    let expect = oracle.expect(prog, input);
    *classes.entry(expect.class()).or_default() += 1;
    let out = match h.try_run(prog, input) {
        Ok(out) => out,
        Err(e) if matches!(expect, Expect::Refused) && errno(&e) == Some(libc::EINVAL) => return,
        Err(e) => {
            findings.add(format!("test_run failed: {e}"), || hex(input));
            return;
        }
    };
    let ex = |out: &Output| format!("input {}\noutput {} code {}", hex(input), hex(&out.frame), out.code);
    let len = input.len() as u64;
    counts.ran += 1;
    counts.ran_bytes += len;
    let count = |counts: &mut Counts, v: Verdict| {
        counts.by_verdict[v as usize].0 += 1;
        counts.by_verdict[v as usize].1 += len;
    };
    let untouched = |findings: &mut Findings, what: &str| {
        if out.code != prog.pass() {
            findings.add(format!("{what}: code {} instead of pass", out.code), || ex(&out));
        }
        if out.frame != input {
            findings.add(format!("{what}: frame changed"), || {
                format!("{}\ndiff {}", ex(&out), diff(input, &out.frame))
            });
        }
    };
    match expect {
        Expect::Refused => findings.add("kernel took a frame it may refuse".into(), || ex(&out)),
        Expect::Pass(v, why) => {
            counts.pass += 1;
            count(counts, v);
            untouched(findings, &format!("{} ({why})", v.name()));
        }
        Expect::PassRstToEmpty => {
            counts.rst_to_empty += 1;
            untouched(findings, "RST to a Service without backends");
        }
        Expect::Reject(want) => {
            count(counts, Verdict::RejectNoBackend);
            let what = if want.len() == 54 { "reject TCP" } else { "reject UDP" };
            if out.code != prog.reject() {
                findings.add(
                    format!("{what}: code {} instead of {}", out.code, prog.reject()),
                    || ex(&out),
                );
            }
            if out.frame != want {
                findings.add(format!("{what}: wrong answer frame"), || {
                    format!("{}\nwant   {}\ndiff {}", ex(&out), hex(&want), diff(&want, &out.frame))
                });
            }
        }
        Expect::Dnat {
            backends,
            pinned,
            may_collide,
            flow,
        } => {
            if may_collide && pinned.is_none() && out.code == prog.pass() && out.frame == input {
                // Its reply tuple is another flow's forward tuple: untracked.
                count(counts, Verdict::Error);
                return;
            }
            let verdict = if pinned.is_some() {
                Verdict::DnatEstablished
            } else {
                Verdict::DnatNew
            };
            count(counts, verdict);
            if !prog.dnat_code_ok(out.code) {
                findings.add(format!("dnat: code {}", out.code), || ex(&out));
            }
            match check_translation(input, &out.frame, &flow, true) {
                Err(e) => findings.add(format!("dnat: {e}"), || {
                    format!("{}\ndiff {}", ex(&out), diff(input, &out.frame))
                }),
                Ok(dst) if !backends.contains(&dst) => {
                    findings.add("dnat: destination is not a backend of the Service".into(), || ex(&out))
                }
                Ok(dst) if pinned.is_some_and(|p| p != dst) => findings
                    .add("dnat: flow moved to another backend".into(), || {
                        format!("{}\npinned to {:?}, went to {dst}", ex(&out), pinned)
                    }),
                Ok(dst) => oracle.record_dnat(&flow, dst),
            }
        }
        Expect::RevNat { may_pass: true, .. } if out.code == prog.pass() && out.frame == input => {
            counts.reply_or_pass += 1;
        }
        Expect::RevNat { frontends, flow, .. } => {
            count(counts, Verdict::RevNat);
            if out.code != prog.pass() {
                findings.add(format!("rev_nat: code {}", out.code), || ex(&out));
            }
            match check_translation(input, &out.frame, &flow, false) {
                Err(e) => findings.add(format!("rev_nat: {e}"), || {
                    format!("{}\ndiff {}", ex(&out), diff(input, &out.frame))
                }),
                Ok(src) if !frontends.contains(&src) => {
                    findings.add("rev_nat: source is not the flow's frontend".into(), || ex(&out))
                }
                Ok(_) => {}
            }
        }
    }
}

/// Addresses and ports mutations and base frames draw from.
struct Dict {
    frontends: Vec<(SocketAddrV4, u8)>,
    ips: Vec<Ipv4Addr>,
    ports: Vec<u16>,
    clients: Vec<Ipv4Addr>,
}

impl Dict {
    fn new(oracle: &Oracle) -> Self {
        let mut frontends: Vec<_> = oracle.services.keys().copied().collect();
        frontends.sort();
        let clients: Vec<Ipv4Addr> = (0..8)
            .map(|i| Ipv4Addr::new(10, 244, 1, 5 + i))
            .chain((0..8).map(|i| Ipv4Addr::new(203, 0, 113, 7 + i)))
            .collect();
        let mut ips: Vec<Ipv4Addr> = frontends.iter().map(|(a, _)| *a.ip()).collect();
        ips.extend(BACKEND_IPS);
        ips.extend(&clients);
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
        }
    }

    fn client(&self, rng: &mut StdRng) -> SocketAddrV4 {
        // A small port pool: flows repeat, so "established" gets exercised.
        SocketAddrV4::new(
            *self.clients.choose(rng).expect("clients"),
            40000 + rng.gen_range(0..64),
        )
    }
}

fn random_bytes(rng: &mut StdRng, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    rng.fill(&mut b[..]);
    b
}

fn l4_frame(rng: &mut StdRng, src: SocketAddrV4, dst: SocketAddrV4, proto: u8) -> Frame {
    let n = rng.gen_range(0..48);
    let payload = random_bytes(rng, n);
    let mut f = if proto == proto::TCP {
        let flags = *[
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
        .expect("flags");
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

/// A valid frame of some class.
fn base_frame(rng: &mut StdRng, dict: &Dict, oracle: &Oracle) -> Vec<u8> {
    let roll = rng.gen_range(0..100);
    if roll < 45 {
        // To a frontend (with or without backends).
        let (fe, p) = *dict.frontends.choose(rng).expect("frontends");
        let c = dict.client(rng);
        l4_frame(rng, c, fe, p).build()
    } else if roll < 70 {
        // A reply of a tracked flow (or of a made-up one before there are any).
        match oracle.flow_list.choose(rng) {
            Some(&(client, _, backend, p)) => l4_frame(rng, backend, client, p).build(),
            None => {
                let b = SocketAddrV4::new(BACKEND_IPS[0], BACKEND_PORT);
                let c = dict.client(rng);
                l4_frame(rng, b, c, proto::TCP).build()
            }
        }
    } else if roll < 85 {
        // Not for a Service: a known IP with some port, or anything.
        let dst = SocketAddrV4::new(
            *dict.ips.choose(rng).expect("ips"),
            *dict.ports.choose(rng).expect("ports"),
        );
        let p = if rng.gen_bool(0.5) { proto::TCP } else { proto::UDP };
        let dst = if dst.port() == 0 {
            SocketAddrV4::new(*dst.ip(), 1)
        } else {
            dst
        };
        let c = dict.client(rng);
        l4_frame(rng, c, dst, p).build()
    } else if roll < 90 {
        let dst = *dict.ips.choose(rng).expect("ips");
        match rng.gen_range(0..3) {
            0 => Frame::icmp_echo(*dict.clients.choose(rng).expect("clients"), dst).build(),
            1 => Frame::arp_request(*dict.clients.choose(rng).expect("clients"), dst).build(),
            _ => Frame::ipv6_udp(SocketAddrV4::new(dst, SERVICE_PORT)).build(),
        }
    } else {
        // Random bytes, mostly under the IPv4 ether type.
        let len = rng.gen_range(14..120);
        let mut b = random_bytes(rng, len);
        if rng.gen_bool(0.7) {
            b[12..14].copy_from_slice(&[0x08, 0x00]);
            if b.len() > 14 && rng.gen_bool(0.5) {
                b[14] = 0x45;
            }
        }
        b
    }
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
    // Offsets mostly inside the headers.
    let pos = |rng: &mut StdRng, len: usize| {
        if rng.gen_bool(0.8) {
            rng.gen_range(0..len.min(60))
        } else {
            rng.gen_range(0..len)
        }
    };
    let l4 = ETH_HLEN + 20;
    match rng.gen_range(0..16) {
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
            put_ip(b, at, *dict.ips.choose(rng).expect("ips"));
        }
        9 => {
            let at = l4 + if rng.gen_bool(0.5) { 0 } else { 2 };
            put_u16(b, at, *dict.ports.choose(rng).expect("ports"));
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
        _ => {
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
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn fuzz(prog: Prog) {
    let target: u64 = env_or("XPROXY_FUZZ_FRAMES", DEFAULT_MUTATED);
    let seed: u64 = env_or("XPROXY_FUZZ_SEED", DEFAULT_SEED);
    let mut h = Harness::seeded();
    let mut oracle = Oracle::new();
    let dict = Dict::new(&oracle);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tally = Tally {
        findings: Findings::default(),
        classes: BTreeMap::new(),
        counts: Counts {
            ran: 0,
            ran_bytes: 0,
            pass: 0,
            rst_to_empty: 0,
            reply_or_pass: 0,
            by_verdict: [(0, 0); Verdict::COUNT as usize],
        },
    };
    let (mut frames, mut mutated) = (0u64, 0u64);
    let start = Instant::now();
    let mut run_and_check = std::time::Duration::ZERO;
    while mutated < target {
        frames += 1;
        let mut input = base_frame(&mut rng, &dict, &oracle);
        if rng.gen_bool(0.8) {
            mutated += 1;
            for _ in 0..rng.gen_range(1..=3) {
                mutate(&mut rng, &dict, &mut input);
            }
        }
        let t = Instant::now();
        run_one(&mut h, prog, &mut oracle, &input, &mut tally);
        run_and_check += t.elapsed();
    }
    let elapsed = start.elapsed();

    println!(
        "fuzz {}: {frames} frames ({mutated} mutated), seed {seed:#x}, {:.1} s ({:.2} µs/frame, {:.2} µs in run+check)",
        prog.name(),
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / frames as f64,
        run_and_check.as_secs_f64() * 1e6 / frames as f64
    );
    println!("  frames by expected outcome:");
    for (class, n) in &tally.classes {
        println!("    {n:>9}  {class}");
    }
    println!(
        "  flows tracked by the oracle: {}, reply tuples: {}",
        oracle.flows.len(),
        oracle.replies.len()
    );

    let Tally {
        mut findings, counts, ..
    } = tally;
    // Counters: exact for new and established DNAT and errors; the pass verdicts as one
    // sum (the policy's check order decides which pass verdict a frame with
    // several flaws gets); RSTs to empty Services may count as pass or
    // reject, tc_egress replies as pass or reverse NAT. Every frame the
    // program ran is counted once, with its length.
    let got = h.counts();
    let got_of = |v: Verdict| got[v as usize].packets;
    let want_of = |v: Verdict| counts.by_verdict[v as usize].0;
    println!("  counters (got / oracle):");
    for v in Verdict::ALL {
        println!("    {:<22} {:>9} / {:>9}", v.name(), got_of(v), want_of(v));
    }
    println!(
        "    either pass or reject: {}, either pass or rev_nat: {}",
        counts.rst_to_empty, counts.reply_or_pass
    );
    for v in [Verdict::DnatNew, Verdict::DnatEstablished, Verdict::Error] {
        let (p, b) = counts.by_verdict[v as usize];
        if (got[v as usize].packets, got[v as usize].bytes) != (p, b) {
            findings.add(
                format!(
                    "counter {}: {} packets {} bytes, oracle {p} packets {b} bytes",
                    v.name(),
                    got_of(v),
                    got[v as usize].bytes
                ),
                String::new,
            );
        }
    }
    let got_pass = got_of(Verdict::PassNotService) + got_of(Verdict::PassNotIpv4OrL4) + got_of(Verdict::PassMalformed);
    let extra_reject = got_of(Verdict::RejectNoBackend).checked_sub(want_of(Verdict::RejectNoBackend));
    let extra_rev_nat = got_of(Verdict::RevNat).checked_sub(want_of(Verdict::RevNat));
    let consistent = match (extra_reject, extra_rev_nat) {
        (Some(r), Some(n)) => {
            r <= counts.rst_to_empty
                && n <= counts.reply_or_pass
                && got_pass + r + n == counts.pass + counts.rst_to_empty + counts.reply_or_pass
        }
        _ => false,
    };
    if !consistent {
        findings.add(
            format!(
                "counters: pass {got_pass} reject {} rev_nat {}; oracle pass {} reject {} rev_nat {} (+{} pass-or-reject, +{} pass-or-rev_nat)",
                got_of(Verdict::RejectNoBackend),
                got_of(Verdict::RevNat),
                counts.pass,
                want_of(Verdict::RejectNoBackend),
                want_of(Verdict::RevNat),
                counts.rst_to_empty,
                counts.reply_or_pass
            ),
            String::new,
        );
    }
    let (got_packets, got_bytes) = got.iter().fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes));
    if (got_packets, got_bytes) != (counts.ran, counts.ran_bytes) {
        findings.add(
            format!(
                "counters: {got_packets} packets {got_bytes} bytes in all, but {} frames of {} bytes ran",
                counts.ran, counts.ran_bytes
            ),
            String::new,
        );
    }

    if !findings.0.is_empty() {
        let mut report = format!("fuzz {}: {} kinds of deviation\n", prog.name(), findings.0.len());
        for (kind, (n, example)) in &findings.0 {
            report += &format!("- {kind}: {n} frames\n  {}\n", example.replace('\n', "\n  "));
        }
        panic!("{report}");
    }
}

#[test]
fn fuzz_xdp_uplink() {
    if !require_root("fuzz_xdp_uplink") {
        return;
    }
    fuzz(Prog::XdpUplink);
}

#[test]
fn fuzz_tc_ingress() {
    if !require_root("fuzz_tc_ingress") {
        return;
    }
    fuzz(Prog::TcIngress);
}

#[test]
fn fuzz_tc_egress() {
    if !require_root("fuzz_tc_egress") {
        return;
    }
    fuzz(Prog::TcEgress);
}

/// The oracle's policy parser agrees with hand-made cases (no kernel needed).
#[test]
fn oracle_classifies_the_seed_frames() {
    let oracle = Oracle::new();
    let c = SocketAddrV4::new(CLIENT_IP, 40000);
    let syn = Frame::tcp(c, cluster_ip(), SYN).build();
    assert!(matches!(
        oracle.expect(Prog::XdpUplink, &syn),
        Expect::Dnat { pinned: None, .. }
    ));
    let empty = Frame::udp(c, SocketAddrV4::new(EMPTY_IP, EMPTY_PORT), b"x").build();
    assert!(matches!(oracle.expect(Prog::TcIngress, &empty), Expect::Reject(r) if r.len() == 70));
    let rst = Frame::tcp(c, SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT), RST).build();
    assert!(matches!(oracle.expect(Prog::TcIngress, &rst), Expect::PassRstToEmpty));
    let other = Frame::tcp(c, SocketAddrV4::new(CLUSTER_IP, 89), SYN).build();
    assert!(matches!(
        oracle.expect(Prog::TcIngress, &other),
        Expect::Pass(Verdict::PassNotService, _)
    ));
    assert!(matches!(oracle.expect(Prog::TcIngress, &syn[..20]), Expect::Refused));
    assert!(matches!(
        oracle.expect(Prog::XdpUplink, &syn[..20]),
        Expect::Pass(Verdict::PassMalformed, _)
    ));
}
