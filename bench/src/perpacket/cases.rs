//! The measured cases: which packets each one sends, how they are set up
//! and what the program must do with every one of them.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::BorrowedFd,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use proxy_common::{CtKey, Verdict, proto};
use proxy_userspace::model::{ServicePort, SourceRange};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};
use serde::Serialize;
use testbed::{
    frame::{Frame, Strict, check, parse_strict, tcp_flags},
    testrun::{NODE_IP, Prog, cluster_ip, node_port, seed_backends, service},
};

use super::{
    bed::Bed,
    raw::{self, PassProgram},
};

/// What a case measures.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The first packet of a flow never seen: lookup, backend selection,
    /// two conntrack inserts, DNAT. A fresh client address or port each call.
    NewFlow,
    /// The next packet of one tracked flow, again and again (caches warm).
    Established,
    /// Next packets of many tracked flows in shuffled order (conntrack cold).
    EstablishedWorkingSet,
    /// A backend's reply of one tracked flow, reverse-NATed.
    Reply,
    /// Replies of many tracked flows in shuffled order.
    ReplyWorkingSet,
    /// A packet to no Service that is no reply either: passed untouched.
    Miss,
    /// Such packets of many different flows (the conntrack lookup every
    /// packet that is no Service's gets, in case it is a reply, cold).
    MissWorkingSet,
    /// A new flow of a client a ClientIP affinity Service remembers: its
    /// backend of before, the entry's time moved on.
    AffinityHit,
    /// A new flow of a client never seen: a random backend, remembered
    /// (an LRU insert).
    AffinityMiss,
}

impl Kind {
    /// The verdict every packet of the case must be counted under.
    pub fn verdict(self) -> Verdict {
        match self {
            Kind::NewFlow | Kind::AffinityHit | Kind::AffinityMiss => Verdict::DnatNew,
            Kind::Established | Kind::EstablishedWorkingSet => Verdict::DnatEstablished,
            Kind::Reply | Kind::ReplyWorkingSet => Verdict::RevNat,
            Kind::Miss | Kind::MissWorkingSet => Verdict::PassNotService,
        }
    }

    /// Issue 5's targets (net ns per packet): established flows (either
    /// direction) 40, new flows 100; none for misses.
    pub fn target_ns(self) -> Option<f64> {
        match self {
            Kind::NewFlow | Kind::AffinityHit | Kind::AffinityMiss => Some(100.0),
            Kind::Established | Kind::EstablishedWorkingSet | Kind::Reply | Kind::ReplyWorkingSet => Some(40.0),
            Kind::Miss | Kind::MissWorkingSet => None,
        }
    }

    fn label(self, working_set: usize) -> String {
        match self {
            Kind::NewFlow => "new flow".into(),
            Kind::Established => "established".into(),
            Kind::EstablishedWorkingSet => format!("established, {} flows", thousands(working_set)),
            Kind::Reply => "reply (rev-NAT)".into(),
            Kind::ReplyWorkingSet => format!("reply (rev-NAT), {} flows", thousands(working_set)),
            Kind::Miss => "miss (no Service)".into(),
            Kind::MissWorkingSet => format!("miss (no Service), {} flows", thousands(working_set)),
            Kind::AffinityHit => "new flow, affinity hit".into(),
            Kind::AffinityMiss => "new flow, affinity miss".into(),
        }
    }
}

fn thousands(n: usize) -> String {
    if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}

/// Which frontend the case's flows were addressed to.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Frontend {
    NodePort,
    ClusterIp,
    /// The ClusterIP of a Service with ClientIP affinity ([`api_services`]).
    AffinityClusterIp,
    /// A load balancer IP with loadBalancerSourceRanges ([`api_services`]).
    LoadBalancerIp,
    /// The ClusterIP of a Service that selects Maglev ([`api_services`]).
    MaglevClusterIp,
    None,
}

impl Frontend {
    fn addr(self) -> Option<SocketAddrV4> {
        match self {
            Frontend::NodePort => Some(node_port()),
            Frontend::ClusterIp => Some(cluster_ip()),
            Frontend::AffinityClusterIp => Some(SocketAddrV4::new(AFFINITY_IP, 88)),
            Frontend::LoadBalancerIp => Some(SocketAddrV4::new(LB_IP, 88)),
            Frontend::MaglevClusterIp => Some(SocketAddrV4::new(MAGLEV_IP, 88)),
            Frontend::None => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Frontend::NodePort => "NodePort",
            Frontend::ClusterIp => "ClusterIP",
            Frontend::AffinityClusterIp => "ClusterIP, ClientIP affinity",
            Frontend::LoadBalancerIp => "LB IP, 4 source ranges",
            Frontend::MaglevClusterIp => "ClusterIP, Maglev",
            Frontend::None => "-",
        }
    }
}

/// The ClusterIP of the affinity Service and the LB IP of the source
/// ranges one.
const AFFINITY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
/// The ClusterIP of the Maglev Service (issue 15).
const MAGLEV_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 60);

/// Besides the seed Services: one with ClientIP affinity (3 h), one with
/// a load balancer IP whose source ranges hold the uplink's clients
/// (198.18.0.0/15, checked last of four ranges in no particular order:
/// the trie's depth, not the list's order, sets the cost).
pub fn api_services() -> Vec<ServicePort> {
    let backends = seed_backends();
    let affinity = ServicePort {
        affinity: Some(Duration::from_secs(10_800)),
        ..service("bench/affinity:http", tcp(), AFFINITY_IP, 88, None, &backends)
    };
    let ranges = [
        ([10, 0, 0, 0], 8),
        ([172, 16, 0, 0], 12),
        ([192, 168, 0, 0], 16),
        ([198, 18, 0, 0], 15),
    ];
    let load_balancer = ServicePort {
        load_balancer_ips: vec![LB_IP.into()],
        source_ranges: (ranges.iter())
            .map(|(a, len)| SourceRange {
                addr: Ipv4Addr::from(*a).into(),
                prefix_len: *len,
            })
            .collect(),
        ..service(
            "bench/lb:http",
            tcp(),
            Ipv4Addr::new(10, 96, 0, 50),
            88,
            None,
            &backends,
        )
    };
    let maglev = ServicePort {
        lb_algorithm: Some(proxy_userspace::model::LbAlgorithm::Maglev),
        ..service("bench/maglev:http", tcp(), MAGLEV_IP, 88, None, &backends)
    };
    vec![affinity, load_balancer, maglev]
}

fn tcp() -> proxy_userspace::model::Protocol {
    proxy_userspace::model::Protocol::Tcp
}

/// Which loaded data path a case runs in. The uplink's and the pods' flows
/// live in separate maps so that each working set is exactly what it says
/// and the conntrack map stays far from full (where the LRU evicts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// xdp_uplink, clients outside the node.
    Uplink,
    /// tc_ingress and tc_egress of pods, clients in pods.
    Pods,
}

impl Side {
    pub const ALL: [Side; 2] = [Side::Uplink, Side::Pods];
}

/// What the program must have done with one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// DNATed to one of the seed backends, source unchanged.
    DnatToAny,
    /// DNATed to this backend (the flow's own), source unchanged.
    DnatTo(SocketAddrV4),
    /// Source rewritten to this frontend, destination unchanged.
    SourceIs(SocketAddrV4),
    /// Passed on byte for byte.
    Untouched,
}

struct Packet {
    frame: Vec<u8>,
    expect: Expect,
}

/// Hands out client addresses no other flow of the same data path uses:
/// `/24` blocks of a range, 60000 ports per address.
pub struct Clients {
    first_block: Ipv4Addr,
    next_block: u32,
}

/// One block's worth of fresh `(address, port)` pairs.
struct FlowSource {
    base: u32,
    next: u32,
}

const PORTS_PER_ADDR: u32 = 60_000;
const FIRST_PORT: u32 = 1024;

impl Clients {
    /// External clients come from 198.18.0.0/15 (RFC 2544, for benchmarks),
    /// pods from 10.244.128.0/17 (away from the seed backends).
    pub fn new(side: Side) -> Self {
        let first_block = match side {
            Side::Uplink => Ipv4Addr::new(198, 18, 0, 0),
            Side::Pods => Ipv4Addr::new(10, 244, 128, 0),
        };
        Self {
            first_block,
            next_block: 0,
        }
    }

    fn block(&mut self) -> FlowSource {
        let base = u32::from(self.first_block) + (self.next_block << 8);
        self.next_block += 1;
        FlowSource { base, next: 0 }
    }
}

impl FlowSource {
    fn next(&mut self) -> SocketAddrV4 {
        let i = self.next;
        self.next += 1;
        assert!(i / PORTS_PER_ADDR < 256, "a client block ran out of addresses");
        let ip = Ipv4Addr::from(self.base + i / PORTS_PER_ADDR);
        SocketAddrV4::new(ip, (FIRST_PORT + i % PORTS_PER_ADDR) as u16)
    }
}

/// Where packets come from and in what order.
enum Feed {
    /// A new flow's first packet every call: built per batch.
    Fresh {
        clients: FlowSource,
        frontend: SocketAddrV4,
    },
    /// A new flow's first packet every call, each from a client address
    /// not seen for a long while (a cycle through 100.64.0.0/10, far more
    /// addresses than the affinity map keeps).
    FreshClients { next: u32, frontend: SocketAddrV4 },
    /// Prepared packets, sent in order and from the start again when done.
    Cycle { next: usize },
}

/// The client addresses of [`Feed::FreshClients`]: 100.64.0.0/10.
const FRESH_CLIENTS: (u32, u32) = (0x6440_0000, 1 << 22);

/// One case, ready to run batches of calls.
pub struct Case {
    pub side: Side,
    pub prog: Prog,
    pub kind: Kind,
    pub frontend: Frontend,
    pub label: String,
    /// The return code every call must give.
    pub code: u32,
    pub baseline: PassProgram,
    feed: Feed,
    packets: Vec<Packet>,
    /// Indexes into `packets` of the current batch.
    batch: Vec<usize>,
    /// Conntrack entries the current batch created (new flows only).
    created: Vec<CtKey>,
}

/// A pair of test runs: the baseline's and the program's, in ns.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub baseline_ns: u32,
    pub gross_ns: u32,
}

impl Case {
    fn new(side: Side, prog: Prog, kind: Kind, frontend: Frontend, working_set: usize, feed: Feed) -> Self {
        let label = match frontend {
            Frontend::None => kind.label(working_set),
            f => format!("{} ({})", kind.label(working_set), f.label()),
        };
        Self {
            side,
            prog,
            kind,
            frontend,
            label,
            code: prog.pass(),
            baseline: match prog {
                Prog::XdpUplink => PassProgram::Xdp,
                Prog::TcIngress | Prog::TcEgress => PassProgram::Tc,
            },
            feed,
            packets: Vec::new(),
            batch: Vec::new(),
            created: Vec::new(),
        }
    }

    fn cycled(mut self, packets: Vec<Packet>) -> Self {
        self.packets = packets;
        self
    }

    /// Picks (or builds) the packets of the next batch of `calls`.
    fn prepare(&mut self, calls: usize) {
        self.batch.clear();
        match &mut self.feed {
            Feed::Fresh { clients, frontend } => {
                self.packets.clear();
                for i in 0..calls {
                    let frame = Frame::tcp(clients.next(), *frontend, tcp_flags::SYN).build();
                    self.packets.push(Packet {
                        frame,
                        expect: Expect::DnatToAny,
                    });
                    self.batch.push(i);
                }
            }
            Feed::FreshClients { next, frontend } => {
                self.packets.clear();
                for i in 0..calls {
                    let ip = Ipv4Addr::from(FRESH_CLIENTS.0 + *next % FRESH_CLIENTS.1);
                    *next = next.wrapping_add(1);
                    let frame = Frame::tcp(SocketAddrV4::new(ip, 1024), *frontend, tcp_flags::SYN).build();
                    self.packets.push(Packet {
                        frame,
                        expect: Expect::DnatToAny,
                    });
                    self.batch.push(i);
                }
            }
            Feed::Cycle { next } => {
                for _ in 0..calls {
                    self.batch.push(*next);
                    *next = (*next + 1) % self.packets.len();
                }
            }
        }
    }

    /// Runs a batch of `calls` packets, each through `baseline` and then the
    /// program, checking every result; returns the kernel's timings. Flows
    /// a batch of new flows opened are removed again afterwards, so every
    /// batch meets conntrack as the cases' set-up left it.
    pub fn run_batch(&mut self, bed: &mut Bed, baseline: BorrowedFd<'_>, calls: usize) -> Result<Vec<Timing>> {
        let timings = self.time_batch(bed, baseline, calls)?;
        bed.forget(&self.created)?;
        self.created.clear();
        Ok(timings)
    }

    fn time_batch(&mut self, bed: &Bed, baseline: BorrowedFd<'_>, calls: usize) -> Result<Vec<Timing>> {
        self.prepare(calls);
        let prog = bed.fd(self.prog)?;
        let mut out = vec![0u8; OUT_BUF_LEN];
        let mut timings = Vec::with_capacity(calls);
        for &i in &self.batch {
            let packet = &self.packets[i];
            let base = raw::test_run(baseline, &packet.frame, &mut out)
                .with_context(|| format!("test run of the {} baseline", self.baseline.name()))?;
            ensure!(
                base.code == self.baseline.code(),
                "the {} baseline returned {}",
                self.baseline.name(),
                base.code
            );
            let run = raw::test_run(prog, &packet.frame, &mut out)
                .with_context(|| format!("test run of {} for {}", self.prog.name(), self.label))?;
            ensure!(
                run.code == self.code,
                "{} returned {} for {} (want {}): not the path to time",
                self.prog.name(),
                run.code,
                self.label,
                self.code
            );
            let out = &out[..run.out_len.min(out.len())];
            check_output(&packet.frame, out, packet.expect)
                .with_context(|| format!("{} on a {} packet", self.prog.name(), self.label))?;
            if matches!(self.kind, Kind::NewFlow | Kind::AffinityHit | Kind::AffinityMiss) {
                self.created.extend(conntrack_keys(&packet.frame, out)?);
            }
            timings.push(Timing {
                baseline_ns: base.duration_ns,
                gross_ns: run.duration_ns,
            });
        }
        Ok(timings)
    }
}

/// Large enough for any frame here.
const OUT_BUF_LEN: usize = 2048;

fn check_output(input: &[u8], out: &[u8], expect: Expect) -> Result<()> {
    if expect == Expect::Untouched {
        ensure!(out == input, "the packet was changed");
        return Ok(());
    }
    ensure!(out.len() == input.len(), "length {} -> {}", input.len(), out.len());
    if let Err(e) = check(out) {
        bail!("the rewritten packet's checksums are wrong: {e}");
    }
    let (Strict::Flow(before), Strict::Flow(after)) = (parse_strict(input), parse_strict(out)) else {
        bail!("the output is no longer a valid flow");
    };
    match expect {
        Expect::DnatToAny => ensure!(
            after.src == before.src && seed_backends().contains(&after.dst),
            "{} -> {} became {} -> {}, want a seed backend",
            before.src,
            before.dst,
            after.src,
            after.dst
        ),
        Expect::DnatTo(backend) => ensure!(
            after.src == before.src && after.dst == backend,
            "{} -> {} became {} -> {}, want the flow's backend {backend}",
            before.src,
            before.dst,
            after.src,
            after.dst
        ),
        Expect::SourceIs(frontend) => ensure!(
            after.src == frontend && after.dst == before.dst,
            "{} -> {} became {} -> {}, want the source {frontend}",
            before.src,
            before.dst,
            after.src,
            after.dst
        ),
        Expect::Untouched => unreachable!("handled above"),
    }
    Ok(())
}

/// The forward and reply conntrack keys of the flow whose first packet was
/// `input`, DNATed into `output`.
fn conntrack_keys(input: &[u8], output: &[u8]) -> Result<[CtKey; 2]> {
    let (Strict::Flow(before), Strict::Flow(after)) = (parse_strict(input), parse_strict(output)) else {
        bail!("not a flow");
    };
    let (client, frontend, backend) = (before.src, before.dst, after.dst);
    Ok([
        CtKey::new(*client.ip(), client.port(), *frontend.ip(), frontend.port(), proto::TCP),
        CtKey::new(*backend.ip(), backend.port(), *client.ip(), client.port(), proto::TCP),
    ])
}

/// Opens a flow from `client` to `frontend` through `prog` and returns the
/// backend chosen: the client's SYN, then the backend's SYN-ACK, so that
/// conntrack has the flow established (its first answer moves the state
/// of both entries, which no later packet of the cases does).
fn open_flow(bed: &Bed, prog: Prog, client: SocketAddrV4, frontend: SocketAddrV4) -> Result<SocketAddrV4> {
    let backend = send_syn(bed, prog, client, frontend)?;
    let syn_ack = Frame::tcp(backend, client, tcp_flags::SYN | tcp_flags::ACK).build();
    let mut out = vec![0u8; OUT_BUF_LEN];
    let run = raw::test_run(bed.fd(prog)?, &syn_ack, &mut out)
        .with_context(|| format!("answering a flow through {}", prog.name()))?;
    ensure!(run.code != prog.drop(), "{} dropped a SYN-ACK", prog.name());
    check_output(&syn_ack, &out[..run.out_len], Expect::SourceIs(frontend))?;
    Ok(backend)
}

/// The client's SYN through `prog`; returns the backend it was sent to.
fn send_syn(bed: &Bed, prog: Prog, client: SocketAddrV4, frontend: SocketAddrV4) -> Result<SocketAddrV4> {
    let frame = Frame::tcp(client, frontend, tcp_flags::SYN).build();
    let mut out = vec![0u8; OUT_BUF_LEN];
    let run = raw::test_run(bed.fd(prog)?, &frame, &mut out)
        .with_context(|| format!("opening a flow through {}", prog.name()))?;
    ensure!(
        run.code == prog.pass(),
        "{} returned {} for a new flow",
        prog.name(),
        run.code
    );
    check_output(&frame, &out[..run.out_len], Expect::DnatToAny)?;
    match parse_strict(&out[..run.out_len]) {
        Strict::Flow(flow) => Ok(flow.dst),
        _ => bail!("the DNATed packet does not parse"),
    }
}

/// The next packet of an open flow (an ACK, as after the handshake).
fn next_packet(client: SocketAddrV4, frontend: SocketAddrV4, backend: SocketAddrV4) -> Packet {
    Packet {
        frame: Frame::tcp(client, frontend, tcp_flags::ACK).build(),
        expect: Expect::DnatTo(backend),
    }
}

/// The backend's reply of an open flow.
fn reply_packet(client: SocketAddrV4, frontend: SocketAddrV4, backend: SocketAddrV4) -> Packet {
    Packet {
        frame: Frame::tcp(backend, client, tcp_flags::ACK).build(),
        expect: Expect::SourceIs(frontend),
    }
}

/// A fixed seed: every run sends the working set in the same shuffled order.
const SHUFFLE_SEED: u64 = 5;

/// Opens `count` flows through `prog`; returns (client, backend) of each.
fn open_flows(
    bed: &Bed,
    prog: Prog,
    clients: &mut Clients,
    frontend: SocketAddrV4,
    count: usize,
) -> Result<Vec<(SocketAddrV4, SocketAddrV4)>> {
    let mut source = clients.block();
    (0..count)
        .map(|_| {
            let client = source.next();
            open_flow(bed, prog, client, frontend).map(|backend| (client, backend))
        })
        .collect()
}

fn shuffled(mut packets: Vec<Packet>, seed: u64) -> Vec<Packet> {
    packets.shuffle(&mut StdRng::seed_from_u64(seed));
    packets
}

/// Builds every case, opening the flows the established and reply cases
/// need in `beds` (indexed like [`Side::ALL`]).
pub fn build(beds: &[Bed; 2], working_set: usize, progress: &dyn Fn(&str)) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    let uplink = &beds[0];
    let pods = &beds[1];

    let mut clients = Clients::new(Side::Uplink);
    let xdp = Prog::XdpUplink;
    for frontend in [Frontend::NodePort, Frontend::ClusterIp] {
        let addr = frontend.addr().context("a Service frontend")?;
        let feed = Feed::Fresh {
            clients: clients.block(),
            frontend: addr,
        };
        cases.push(Case::new(Side::Uplink, xdp, Kind::NewFlow, frontend, working_set, feed));
        let flow = open_flows(uplink, xdp, &mut clients, addr, 1)?;
        let packets = flow.iter().map(|(c, b)| next_packet(*c, addr, *b)).collect();
        let case = Case::new(Side::Uplink, xdp, Kind::Established, frontend, working_set, cycle());
        cases.push(case.cycled(packets));
    }
    cases.extend(api_cases(&mut clients, working_set)?);
    progress(&format!("per-packet: opening {working_set} flows through xdp_uplink"));
    let np = node_port();
    let flows = open_flows(uplink, xdp, &mut clients, np, working_set)?;
    let packets = flows.iter().map(|(c, b)| next_packet(*c, np, *b)).collect();
    let case = Case::new(
        Side::Uplink,
        xdp,
        Kind::EstablishedWorkingSet,
        Frontend::NodePort,
        working_set,
        cycle(),
    );
    cases.push(case.cycled(shuffled(packets, SHUFFLE_SEED)));
    // SSH to the node: the uplink's everyday traffic that is no Service's.
    let ssh = SocketAddrV4::new(NODE_IP, 22);
    cases.push(miss_case(Side::Uplink, xdp, working_set, &mut clients, ssh, 1));
    cases.push(miss_case(
        Side::Uplink,
        xdp,
        working_set,
        &mut clients,
        ssh,
        working_set,
    ));

    let mut clients = Clients::new(Side::Pods);
    let (ingress, egress) = (Prog::TcIngress, Prog::TcEgress);
    let svc = cluster_ip();
    let feed = Feed::Fresh {
        clients: clients.block(),
        frontend: svc,
    };
    cases.push(Case::new(
        Side::Pods,
        ingress,
        Kind::NewFlow,
        Frontend::ClusterIp,
        working_set,
        feed,
    ));
    let flow = open_flows(pods, ingress, &mut clients, svc, 1)?;
    let packets = flow.iter().map(|(c, b)| next_packet(*c, svc, *b)).collect();
    let case = Case::new(
        Side::Pods,
        ingress,
        Kind::Established,
        Frontend::ClusterIp,
        working_set,
        cycle(),
    );
    cases.push(case.cycled(packets));
    let replies = flow.iter().map(|(c, b)| reply_packet(*c, svc, *b)).collect();
    let case = Case::new(
        Side::Pods,
        egress,
        Kind::Reply,
        Frontend::ClusterIp,
        working_set,
        cycle(),
    );
    cases.push(case.cycled(replies));

    progress(&format!("per-packet: opening {working_set} flows through tc_ingress"));
    let flows = open_flows(pods, ingress, &mut clients, svc, working_set)?;
    let packets = flows.iter().map(|(c, b)| next_packet(*c, svc, *b)).collect();
    let case = Case::new(
        Side::Pods,
        ingress,
        Kind::EstablishedWorkingSet,
        Frontend::ClusterIp,
        working_set,
        cycle(),
    );
    cases.push(case.cycled(shuffled(packets, SHUFFLE_SEED)));
    let replies = flows.iter().map(|(c, b)| reply_packet(*c, svc, *b)).collect();
    let case = Case::new(
        Side::Pods,
        egress,
        Kind::ReplyWorkingSet,
        Frontend::ClusterIp,
        working_set,
        cycle(),
    );
    cases.push(case.cycled(shuffled(replies, SHUFFLE_SEED + 1)));

    // A pod talking to another pod directly, and the node to a pod.
    let other_pod = SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, 50), 8080);
    cases.push(miss_case(Side::Pods, ingress, working_set, &mut clients, other_pod, 1));
    cases.push(miss_case(
        Side::Pods,
        ingress,
        working_set,
        &mut clients,
        other_pod,
        working_set,
    ));
    let node_to_pod = Frame::tcp(SocketAddrV4::new(NODE_IP, 40000), other_pod, tcp_flags::ACK).build();
    let packet = Packet {
        frame: node_to_pod,
        expect: Expect::Untouched,
    };
    cases.push(Case::new(Side::Pods, egress, Kind::Miss, Frontend::None, working_set, cycle()).cycled(vec![packet]));
    Ok(cases)
}

/// New flows through xdp_uplink to the [`api_services`], beside the plain
/// ClusterIP's: an affinity hit (one client, a new port each time), an
/// affinity miss (a new client each time), a source range check and a
/// Maglev pick.
fn api_cases(clients: &mut Clients, working_set: usize) -> Result<Vec<Case>> {
    let xdp = Prog::XdpUplink;
    let affinity = Frontend::AffinityClusterIp.addr().context("a frontend")?;
    let lb = Frontend::LoadBalancerIp.addr().context("a frontend")?;
    let hit = Feed::Fresh {
        clients: clients.block(),
        frontend: affinity,
    };
    let miss = Feed::FreshClients {
        next: 0,
        frontend: affinity,
    };
    let ranges = Feed::Fresh {
        clients: clients.block(),
        frontend: lb,
    };
    let maglev = Feed::Fresh {
        clients: clients.block(),
        frontend: Frontend::MaglevClusterIp.addr().context("a frontend")?,
    };
    let case = |kind, frontend, feed| Case::new(Side::Uplink, xdp, kind, frontend, working_set, feed);
    Ok(vec![
        case(Kind::AffinityHit, Frontend::AffinityClusterIp, hit),
        case(Kind::AffinityMiss, Frontend::AffinityClusterIp, miss),
        case(Kind::NewFlow, Frontend::LoadBalancerIp, ranges),
        case(Kind::NewFlow, Frontend::MaglevClusterIp, maglev),
    ])
}

fn cycle() -> Feed {
    Feed::Cycle { next: 0 }
}

/// Packets of `flows` different clients to `dst`, which is no Service.
fn miss_case(
    side: Side,
    prog: Prog,
    working_set: usize,
    clients: &mut Clients,
    dst: SocketAddrV4,
    flows: usize,
) -> Case {
    let mut source = clients.block();
    let packets = (0..flows)
        .map(|_| Packet {
            frame: Frame::tcp(source.next(), dst, tcp_flags::ACK).build(),
            expect: Expect::Untouched,
        })
        .collect();
    let kind = if flows == 1 { Kind::Miss } else { Kind::MissWorkingSet };
    Case::new(side, prog, kind, Frontend::None, working_set, cycle()).cycled(packets)
}
