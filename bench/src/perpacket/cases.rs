//! The measured cases: which packets each one sends, how they are set up
//! and what the program must do with every one of them.

use std::{
    net::{Ipv4Addr, SocketAddr},
    os::fd::BorrowedFd,
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use proxy_common::{Verdict, xdp_mark::XdpMark};
use proxy_userspace::model::{ServicePort, SourceRange};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};
use serde::Serialize;
use testbed::{
    frame::tcp_flags,
    testrun::{Prog, seed_backends, service},
};

use super::{
    bed::Bed,
    family::{Family, FlowKey, checked_ends, tcp_frame},
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
    /// A pod answering from a Service's backend port to clients it has no
    /// Service flow with (pod-to-pod traffic on a target port), many of
    /// them: its source port passes the port filter, so it costs a
    /// conntrack lookup, cold.
    BackendPortMiss,
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
            Kind::Miss | Kind::MissWorkingSet | Kind::BackendPortMiss => Verdict::PassNotService,
        }
    }

    /// Issue 15's targets (net ns per packet): a new flow 150 (Katran's SYN
    /// on this machine kind: 152), an established flow (either direction)
    /// 40, one of a working set 200 (the issue sets it for 1,000,000 flows;
    /// a smaller set is held to it too), a packet that is no Service's 10.
    pub fn target_ns(self) -> Option<f64> {
        match self {
            Kind::NewFlow | Kind::AffinityHit | Kind::AffinityMiss => Some(150.0),
            Kind::Established | Kind::Reply => Some(40.0),
            Kind::EstablishedWorkingSet | Kind::ReplyWorkingSet => Some(200.0),
            Kind::Miss | Kind::MissWorkingSet | Kind::BackendPortMiss => Some(10.0),
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
            Kind::BackendPortMiss => format!(
                "miss from a backend port (no Service), {} flows",
                thousands(working_set)
            ),
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
    /// The frontend's address in `family`; the [`api_services`] are IPv4's.
    fn addr(self, family: Family) -> Option<SocketAddr> {
        let ipv4 = |ip: Ipv4Addr| (family == Family::Ipv4).then(|| SocketAddr::from((ip, 88)));
        match self {
            Frontend::NodePort => Some(family.node_port()),
            Frontend::ClusterIp => Some(family.cluster_ip()),
            Frontend::AffinityClusterIp => ipv4(AFFINITY_IP),
            Frontend::LoadBalancerIp => ipv4(LB_IP),
            Frontend::MaglevClusterIp => ipv4(MAGLEV_IP),
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
    DnatTo(SocketAddr),
    /// Source rewritten to this frontend, destination unchanged.
    SourceIs(SocketAddr),
    /// Passed on byte for byte.
    Untouched,
}

struct Packet {
    frame: Vec<u8>,
    expect: Expect,
}

/// Hands out client addresses no other flow of the same data path uses:
/// `/24` blocks of a range, 60000 ports per address (in IPv6, the
/// range's [`Family::host`] counterparts).
pub struct Clients {
    family: Family,
    first_block: Ipv4Addr,
    next_block: u32,
}

/// One block's worth of fresh `(address, port)` pairs.
struct FlowSource {
    family: Family,
    base: u32,
    next: u32,
}

const PORTS_PER_ADDR: u32 = 60_000;
const FIRST_PORT: u32 = 1024;

impl Clients {
    /// External clients come from 198.18.0.0/15 (RFC 2544, for benchmarks),
    /// pods from 10.244.128.0/17 (away from the seed backends).
    pub fn new(side: Side, family: Family) -> Self {
        let first_block = match side {
            Side::Uplink => Ipv4Addr::new(198, 18, 0, 0),
            Side::Pods => Ipv4Addr::new(10, 244, 128, 0),
        };
        Self {
            family,
            first_block,
            next_block: 0,
        }
    }

    fn block(&mut self) -> FlowSource {
        let base = u32::from(self.first_block) + (self.next_block << 8);
        self.next_block += 1;
        FlowSource {
            family: self.family,
            base,
            next: 0,
        }
    }
}

impl FlowSource {
    fn next(&mut self) -> SocketAddr {
        let i = self.next;
        self.next += 1;
        assert!(i / PORTS_PER_ADDR < 256, "a client block ran out of addresses");
        let ip = self.family.host(Ipv4Addr::from(self.base + i / PORTS_PER_ADDR));
        SocketAddr::new(ip, (FIRST_PORT + i % PORTS_PER_ADDR) as u16)
    }
}

/// Where packets come from and in what order.
enum Feed {
    /// A new flow's first packet every call: built per batch.
    Fresh { clients: FlowSource, frontend: SocketAddr },
    /// A new flow's first packet every call, each from a client address
    /// not seen for a long while (a cycle through 100.64.0.0/10, far more
    /// addresses than the affinity map keeps).
    FreshClients { next: u32, frontend: SocketAddr },
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
    pub family: Family,
    pub label: String,
    /// The return code every call must give.
    pub code: u32,
    pub baseline: PassProgram,
    feed: Feed,
    packets: Vec<Packet>,
    /// Indexes into `packets` of the current batch.
    batch: Vec<usize>,
    /// Conntrack entries the current batch created (new flows only).
    created: Vec<FlowKey>,
}

/// A pair of test runs: the baseline's and the program's, in ns.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub baseline_ns: u32,
    pub gross_ns: u32,
}

impl Case {
    /// A case of `family`'s packets through `prog` (an IPv6 case's label
    /// ends in ", IPv6").
    fn new(family: Family, prog: Prog, kind: Kind, frontend: Frontend, working_set: usize, feed: Feed) -> Self {
        let mut label = match frontend {
            Frontend::None => kind.label(working_set),
            f => format!("{} ({})", kind.label(working_set), f.label()),
        };
        if family == Family::Ipv6 {
            label += ", IPv6";
        }
        Self {
            side: side_of(prog),
            prog,
            kind,
            frontend,
            family,
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
                    let frame = tcp_frame(clients.next(), *frontend, tcp_flags::SYN);
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
                    let frame = tcp_frame(SocketAddr::from((ip, 1024)), *frontend, tcp_flags::SYN);
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
            let out = frame_of(&out[..run.out_len.min(out.len())]);
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

/// A test run's output frame without the metadata XDP may have left in
/// front of it (the test run returns it with the frame).
fn frame_of(out: &[u8]) -> &[u8] {
    XdpMark::split(out).1
}

fn check_output(input: &[u8], out: &[u8], expect: Expect) -> Result<()> {
    if expect == Expect::Untouched {
        ensure!(out == input, "the packet was changed");
        return Ok(());
    }
    ensure!(out.len() == input.len(), "length {} -> {}", input.len(), out.len());
    let (src, dst) = checked_ends(input)?;
    let (new_src, new_dst) = checked_ends(out).context("the rewritten packet")?;
    let (ok, want) = match expect {
        Expect::DnatToAny => (
            new_src == src && Family::of(dst).backends().contains(&new_dst),
            "a seed backend".to_owned(),
        ),
        Expect::DnatTo(backend) => (
            new_src == src && new_dst == backend,
            format!("the flow's backend {backend}"),
        ),
        Expect::SourceIs(frontend) => (new_src == frontend && new_dst == dst, format!("the source {frontend}")),
        Expect::Untouched => unreachable!("handled above"),
    };
    ensure!(ok, "{src} -> {dst} became {new_src} -> {new_dst}, want {want}");
    Ok(())
}

/// The forward and reply conntrack keys of the flow whose first packet was
/// `input`, DNATed into `output`.
fn conntrack_keys(input: &[u8], output: &[u8]) -> Result<[FlowKey; 2]> {
    let ((client, frontend), (_, backend)) = (checked_ends(input)?, checked_ends(output)?);
    Ok([FlowKey::tcp(client, frontend)?, FlowKey::tcp(backend, client)?])
}

/// Opens a flow from `client` to `frontend` through `prog` and returns the
/// backend chosen: the client's SYN, then the backend's SYN-ACK, so that
/// conntrack has the flow established (its first answer moves the state
/// of both entries, which no later packet of the cases does).
fn open_flow(bed: &Bed, prog: Prog, client: SocketAddr, frontend: SocketAddr) -> Result<SocketAddr> {
    let backend = send_syn(bed, prog, client, frontend)?;
    let syn_ack = tcp_frame(backend, client, tcp_flags::SYN | tcp_flags::ACK);
    let mut out = vec![0u8; OUT_BUF_LEN];
    let run = raw::test_run(bed.fd(prog)?, &syn_ack, &mut out)
        .with_context(|| format!("answering a flow through {}", prog.name()))?;
    ensure!(run.code != prog.drop(), "{} dropped a SYN-ACK", prog.name());
    check_output(&syn_ack, frame_of(&out[..run.out_len]), Expect::SourceIs(frontend))?;
    Ok(backend)
}

/// The client's SYN through `prog`; returns the backend it was sent to.
fn send_syn(bed: &Bed, prog: Prog, client: SocketAddr, frontend: SocketAddr) -> Result<SocketAddr> {
    let frame = tcp_frame(client, frontend, tcp_flags::SYN);
    let mut out = vec![0u8; OUT_BUF_LEN];
    let run = raw::test_run(bed.fd(prog)?, &frame, &mut out)
        .with_context(|| format!("opening a flow through {}", prog.name()))?;
    ensure!(
        run.code == prog.pass(),
        "{} returned {} for a new flow",
        prog.name(),
        run.code
    );
    let translated = frame_of(&out[..run.out_len]);
    check_output(&frame, translated, Expect::DnatToAny)?;
    let (_, backend) = checked_ends(translated)?;
    Ok(backend)
}

/// The next packet of an open flow (an ACK, as after the handshake).
fn next_packet(client: SocketAddr, frontend: SocketAddr, backend: SocketAddr) -> Packet {
    Packet {
        frame: tcp_frame(client, frontend, tcp_flags::ACK),
        expect: Expect::DnatTo(backend),
    }
}

/// The backend's reply of an open flow.
fn reply_packet(client: SocketAddr, frontend: SocketAddr, backend: SocketAddr) -> Packet {
    Packet {
        frame: tcp_frame(backend, client, tcp_flags::ACK),
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
    frontend: SocketAddr,
    count: usize,
) -> Result<Vec<(SocketAddr, SocketAddr)>> {
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

/// The data path a program's packets are measured in.
fn side_of(prog: Prog) -> Side {
    match prog {
        Prog::XdpUplink => Side::Uplink,
        Prog::TcIngress | Prog::TcEgress => Side::Pods,
    }
}

/// The programs a side's flows take: the client's way in, and the
/// backend's reply's way out where the side measures it.
type Ways = (Prog, Option<Prog>);
const UPLINK: Ways = (Prog::XdpUplink, None);
const PODS: Ways = (Prog::TcIngress, Some(Prog::TcEgress));

/// Builds every case, opening the flows the established and reply cases
/// need in `beds` (indexed like [`Side::ALL`]): the main kinds in both
/// families, the Service features and the working sets in IPv4.
pub fn build(beds: &[Bed; 2], working_set: usize, progress: &dyn Fn(&str)) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    for family in Family::ALL {
        let mut clients = [Clients::new(Side::Uplink, family), Clients::new(Side::Pods, family)];
        cases.extend(main_kinds(beds, &mut clients, working_set)?);
        if family == Family::Ipv4 {
            cases.extend(api_cases(&mut clients[0], working_set)?);
            cases.extend(working_sets(beds, &mut clients, working_set, progress)?);
        }
    }
    Ok(cases)
}

/// New flows, established flows, replies and misses, one flow each, in
/// the family of `clients` (the uplink's, the pods').
fn main_kinds(beds: &[Bed; 2], clients: &mut [Clients; 2], working_set: usize) -> Result<Vec<Case>> {
    let [uplink, pods] = clients;
    let mut cases = Vec::new();
    for frontend in [Frontend::NodePort, Frontend::ClusterIp] {
        cases.push(new_flow_case(UPLINK.0, uplink, frontend, working_set)?);
        cases.extend(flow_cases(&beds[0], UPLINK, uplink, frontend, 1, working_set)?);
    }
    cases.push(miss_case(UPLINK.0, working_set, uplink, ssh_to_node(uplink.family), 1));
    cases.push(new_flow_case(PODS.0, pods, Frontend::ClusterIp, working_set)?);
    cases.extend(flow_cases(&beds[1], PODS, pods, Frontend::ClusterIp, 1, working_set)?);
    cases.push(miss_case(PODS.0, working_set, pods, other_pod(pods.family), 1));
    cases.push(node_to_pod_case(pods.family, working_set));
    Ok(cases)
}

/// `working_set` flows through each side: their next packets and replies
/// in a shuffled order, and misses of as many flows.
fn working_sets(
    beds: &[Bed; 2],
    clients: &mut [Clients; 2],
    working_set: usize,
    progress: &dyn Fn(&str),
) -> Result<Vec<Case>> {
    let [uplink, pods] = clients;
    let mut cases = Vec::new();
    progress(&format!("per-packet: opening {working_set} flows through xdp_uplink"));
    let np = Frontend::NodePort;
    cases.extend(flow_cases(&beds[0], UPLINK, uplink, np, working_set, working_set)?);
    let ssh = ssh_to_node(uplink.family);
    cases.push(miss_case(UPLINK.0, working_set, uplink, ssh, working_set));
    progress(&format!("per-packet: opening {working_set} flows through tc_ingress"));
    let cip = Frontend::ClusterIp;
    cases.extend(flow_cases(&beds[1], PODS, pods, cip, working_set, working_set)?);
    let pod = other_pod(pods.family);
    cases.push(miss_case(PODS.0, working_set, pods, pod, working_set));
    cases.push(backend_port_miss_case(working_set, pods));
    Ok(cases)
}

/// SSH to the node: the uplink's everyday traffic that is no Service's.
fn ssh_to_node(family: Family) -> SocketAddr {
    SocketAddr::new(family.node_ip(), 22)
}

/// A pod that is no backend, which other pods talk to directly.
fn other_pod(family: Family) -> SocketAddr {
    SocketAddr::new(family.host(Ipv4Addr::new(10, 244, 0, 50)), 8080)
}

/// First packets of flows never seen, from `clients` to `frontend`.
fn new_flow_case(prog: Prog, clients: &mut Clients, frontend: Frontend, working_set: usize) -> Result<Case> {
    let feed = Feed::Fresh {
        clients: clients.block(),
        frontend: frontend.addr(clients.family).context("a Service frontend")?,
    };
    Ok(Case::new(
        clients.family,
        prog,
        Kind::NewFlow,
        frontend,
        working_set,
        feed,
    ))
}

/// Opens `flows` flows from `clients` to `frontend` through `ways.0`; the
/// case of their next packets ([`Kind::Established`] for one flow, else
/// [`Kind::EstablishedWorkingSet`]) and, where `ways.1` is the replies'
/// way out, of the backends' replies. Many flows are sent in a shuffled
/// order.
fn flow_cases(
    bed: &Bed,
    ways: Ways,
    clients: &mut Clients,
    frontend: Frontend,
    flows: usize,
    working_set: usize,
) -> Result<Vec<Case>> {
    let family = clients.family;
    let addr = frontend.addr(family).context("a Service frontend")?;
    let opened = open_flows(bed, ways.0, clients, addr, flows)?;
    let case = |prog, kinds: [Kind; 2], packets, seed| {
        let kind = kinds[usize::from(flows > 1)];
        Case::new(family, prog, kind, frontend, working_set, cycle()).cycled(shuffled(packets, seed))
    };
    let next = opened.iter().map(|(c, b)| next_packet(*c, addr, *b)).collect();
    let established = [Kind::Established, Kind::EstablishedWorkingSet];
    let mut cases = vec![case(ways.0, established, next, SHUFFLE_SEED)];
    if let Some(way_out) = ways.1 {
        let replies = opened.iter().map(|(c, b)| reply_packet(*c, addr, *b)).collect();
        let reply = [Kind::Reply, Kind::ReplyWorkingSet];
        cases.push(case(way_out, reply, replies, SHUFFLE_SEED + 1));
    }
    Ok(cases)
}

/// New flows through xdp_uplink to the [`api_services`], beside the plain
/// ClusterIP's: an affinity hit (one client, a new port each time), an
/// affinity miss (a new client each time), a source range check and a
/// Maglev pick.
fn api_cases(clients: &mut Clients, working_set: usize) -> Result<Vec<Case>> {
    let addr = |frontend: Frontend| frontend.addr(Family::Ipv4).context("an IPv4 frontend");
    let affinity = addr(Frontend::AffinityClusterIp)?;
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
        frontend: addr(Frontend::LoadBalancerIp)?,
    };
    let maglev = Feed::Fresh {
        clients: clients.block(),
        frontend: addr(Frontend::MaglevClusterIp)?,
    };
    let case = |kind, frontend, feed| Case::new(Family::Ipv4, UPLINK.0, kind, frontend, working_set, feed);
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
fn miss_case(prog: Prog, working_set: usize, clients: &mut Clients, dst: SocketAddr, flows: usize) -> Case {
    let mut source = clients.block();
    let packets = (0..flows)
        .map(|_| Packet {
            frame: tcp_frame(source.next(), dst, tcp_flags::ACK),
            expect: Expect::Untouched,
        })
        .collect();
    let kind = if flows == 1 { Kind::Miss } else { Kind::MissWorkingSet };
    Case::new(clients.family, prog, kind, Frontend::None, working_set, cycle()).cycled(packets)
}

/// A backend pod answering, from the Service's target port, `working_set`
/// clients that reached it directly (no Service flow): what its veth's
/// ingress sees of pod-to-pod traffic on a port Services also target.
fn backend_port_miss_case(working_set: usize, clients: &mut Clients) -> Case {
    let backend = clients.family.backends()[0];
    let mut peers = clients.block();
    let packets = (0..working_set)
        .map(|_| Packet {
            frame: tcp_frame(backend, peers.next(), tcp_flags::ACK),
            expect: Expect::Untouched,
        })
        .collect();
    let kind = Kind::BackendPortMiss;
    Case::new(clients.family, PODS.0, kind, Frontend::None, working_set, cycle()).cycled(packets)
}

/// The node talking to a pod on its way out to the pod: no Service's.
fn node_to_pod_case(family: Family, working_set: usize) -> Case {
    let packet = Packet {
        frame: tcp_frame(
            SocketAddr::new(family.node_ip(), 40000),
            other_pod(family),
            tcp_flags::ACK,
        ),
        expect: Expect::Untouched,
    };
    Case::new(family, Prog::TcEgress, Kind::Miss, Frontend::None, working_set, cycle()).cycled(vec![packet])
}
