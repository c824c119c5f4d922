//! The oracle: what a program must do with a frame, from the frame's
//! policy parse (`frame::parse_strict`, etherparse based), the seed
//! Services, and the oracle's own records of the flows (`conntrack`) and
//! of the first fragments' ports (`fragments`) the program must hold.
//!
//! [`Oracle::expect`] only reads; what the frame does to the records is
//! applied after the run ([`Oracle::ran`], [`Oracle::new_flow`]), once the
//! output has told the program's random pick of a backend, or whether the
//! kernel's LRU had evicted a fragment's ports.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddrV4, SocketAddrV6},
};

use proxy_common::Verdict;
use proxy_userspace::model::ServicePort;
use testbed::{
    frame::{
        Flow, Flow6, IcmpError, IcmpError6, LaterFragment, LaterFragment6, Strict, expected_port_unreachable,
        expected_port_unreachable6_of, expected_rst, expected_rst6_of, parse_strict, tcp_flags::RST,
    },
    testrun::{NODE_IP, Prog, kernel_may_refuse, seed_services},
};

use crate::{
    conntrack::{Conntrack, Lookup, Tuple},
    fragments::{FragKey, FragMemory},
    ipv6::{Fake4, NODE_IP6, POD_CIDR6, Policy6, THIS_NODE, inside, policy6, seed6_services},
};

/// What a frame must do.
#[derive(Clone, Debug)]
pub enum Expect {
    /// The kernel refuses it before the program runs (tc, short IP header).
    Refused,
    /// Passed untouched under this verdict.
    Pass(Verdict, &'static str),
    /// A TCP RST to a Service without backends: passed untouched, counted
    /// as pass or reject.
    PassRstToEmpty,
    /// Answered with this frame (RST or ICMP port unreachable).
    Reject(Vec<u8>),
    /// Dropped untouched under this verdict (an IPv6 client outside the
    /// source ranges, or outside a `Local` frontend's node).
    Drop(Verdict, &'static str),
    /// A packet of a tracked flow: DNATed to `nat` (forward) or
    /// reverse-NATed to it (reply).
    Tracked {
        packet: Packet,
        reply: bool,
        nat: SocketAddrV4,
    },
    /// The first packet of a new flow to a Service with backends: DNATed to
    /// one of `backends`, or (a backend in `colliding`) left untracked.
    New {
        flow: Flow,
        backends: Vec<SocketAddrV4>,
        colliding: Vec<SocketAddrV4>,
        /// It opens a new flow on a closed flow's tuple.
        reopens: bool,
        /// An IPv6 packet (`flow` then has [`Fake4`] addresses).
        six: Option<Flow6>,
    },
    /// An ICMP error about a tracked flow's packet: translated as the
    /// entry (reply or forward) it names says.
    IcmpError {
        error: IcmpError,
        reply: bool,
        nat: SocketAddrV4,
    },
    /// An ICMPv6 error about a tracked flow's packet, likewise.
    Icmp6Error {
        error: IcmpError6,
        reply: bool,
        nat: SocketAddrV6,
    },
}

/// The packet a translation rewrites.
#[derive(Clone, Copy, Debug)]
pub enum Packet {
    /// A whole datagram or a first fragment: addresses, ports, checksums.
    Full(Flow),
    /// An IPv6 one.
    Full6(Flow6),
    /// A later fragment (its ports were its first's): addresses only. Its
    /// datagram's key, which the kernel may have evicted.
    Later(FragKey),
    /// An IPv6 one.
    Later6(FragKey),
}

/// What the frame does to the oracle's records, whatever the outcome.
#[derive(Clone, Copy, Debug, Default)]
pub struct Effects {
    /// A first fragment's key and ports, remembered.
    pub remember: Option<(FragKey, (u16, u16))>,
    /// The conntrack lookup of this tuple with these TCP flags (moves a
    /// flow's state on, or removes a closed flow's entry).
    pub lookup: Option<(Tuple, u8)>,
    /// A later fragment's key, looked up.
    pub fragment_lookup: Option<FragKey>,
}

/// An expectation and the frame's effects.
#[derive(Clone, Debug)]
pub struct Prediction {
    pub expect: Expect,
    pub effects: Effects,
}

impl Prediction {
    /// A frame that changes nothing in the records.
    fn only(expect: Expect) -> Self {
        Self {
            expect,
            effects: Effects::default(),
        }
    }
}

impl Expect {
    /// The frame's class, for the report.
    pub fn class(&self) -> String {
        match self {
            Expect::Refused => "refused by the kernel".into(),
            Expect::Pass(v, why) => format!("{} ({why})", v.name()),
            Expect::PassRstToEmpty => "pass: RST to a Service without backends".into(),
            Expect::New { six: Some(f), .. } if f.first_fragment => "IPv6 dnat_new (first fragment)".into(),
            Expect::New { six: Some(_), .. } => "IPv6 dnat_new".into(),
            Expect::New { flow, .. } if flow.first_fragment => "dnat_new (first fragment)".into(),
            Expect::New { reopens: true, .. } => "dnat_new (on a closed flow's tuple)".into(),
            Expect::New { .. } => "dnat_new".into(),
            Expect::Tracked { packet, reply, .. } => {
                let verdict = if *reply { "rev_nat" } else { "dnat_established" };
                match packet {
                    Packet::Full(f) if f.first_fragment => format!("{verdict} (first fragment)"),
                    Packet::Full(_) => verdict.into(),
                    Packet::Full6(_) => format!("IPv6 {verdict}"),
                    Packet::Later(..) => format!("{verdict} (later fragment, or its ports evicted)"),
                    Packet::Later6(..) => format!("IPv6 {verdict} (later fragment, or its ports evicted)"),
                }
            }
            Expect::IcmpError { reply: true, .. } => "icmp_error (towards the client)".into(),
            Expect::IcmpError { reply: false, .. } => "icmp_error (towards the backend)".into(),
            Expect::Icmp6Error { reply: true, .. } => "IPv6 icmp_error (towards the client)".into(),
            Expect::Icmp6Error { reply: false, .. } => "IPv6 icmp_error (towards the backend)".into(),
            Expect::Reject(r) if r.len() == 54 => "reject: TCP RST".into(),
            Expect::Reject(r) if r.len() == 74 => "reject: IPv6 TCP RST".into(),
            Expect::Reject(r) if r[12..14] == [0x86, 0xdd] => "reject: ICMPv6 port unreachable".into(),
            Expect::Reject(_) => "reject: ICMP port unreachable".into(),
            Expect::Drop(v, why) => format!("{} ({why})", v.name()),
        }
    }
}

/// What the oracle knows: the Services and its records.
pub struct Oracle {
    /// Frontend (address, port, protocol) -> backends.
    services: HashMap<(SocketAddrV4, u8), Vec<SocketAddrV4>>,
    /// The port filter: frontends' ports and backends' ports, any protocol.
    frontend_ports: HashSet<u16>,
    backend_ports: HashSet<u16>,
    pub conntrack: Conntrack,
    /// Entries the program's conntrack table holds with room to spare
    /// (the model has no eviction: a run must stay below).
    conntrack_room: usize,
    pub fragments: FragMemory,
    /// The same of IPv6 datagrams (`XP_FRAGS6`).
    pub fragments6: FragMemory,
    /// (client, frontend, backend, proto) of every new flow translated, oldest first.
    pub flow_list: Vec<(SocketAddrV4, SocketAddrV4, SocketAddrV4, u8)>,
    /// The same of the IPv6 flows.
    pub flow_list6: Vec<(SocketAddrV6, SocketAddrV6, SocketAddrV6, u8)>,
    /// IPv6 addresses as the records key them.
    pub fake: Fake4,
    /// IPv6 frontends' source ranges and `Local` policy, by fake frontend.
    policies6: HashMap<(SocketAddrV4, u8), Policy6>,
}

impl Oracle {
    /// The seed Services on a data path whose conntrack table has
    /// `conntrack_entries` entries, on a kernel with `possible_cpus`.
    pub fn new(possible_cpus: usize, conntrack_entries: usize) -> Self {
        let mut o = Oracle {
            services: HashMap::new(),
            frontend_ports: HashSet::new(),
            backend_ports: HashSet::new(),
            conntrack: Conntrack::default(),
            // An LRU map evicts only when full; each CPU's local lists may
            // hold up to 128 free nodes (see `fragments`).
            conntrack_room: conntrack_entries.saturating_sub(128 * possible_cpus),
            fragments: FragMemory::new(possible_cpus),
            fragments6: FragMemory::new(possible_cpus),
            flow_list: Vec::new(),
            flow_list6: Vec::new(),
            fake: Fake4::default(),
            policies6: HashMap::new(),
        };
        for svc in seed_services().iter().chain(&seed6_services()) {
            o.add_service(svc);
        }
        o
    }

    /// An address as the records key it: an IPv6 one by its fake.
    fn key_addr(&self, ip: IpAddr, port: u16) -> SocketAddrV4 {
        match ip {
            IpAddr::V4(v4) => SocketAddrV4::new(v4, port),
            IpAddr::V6(v6) => self.fake.addr(SocketAddrV6::new(v6, port, 0, 0)),
        }
    }

    /// A Service port's frontends (ClusterIP, node port on the node's
    /// address of its family, external and load balancer IPs) and their
    /// backends, and the port filter's ports.
    fn add_service(&mut self, svc: &ServicePort) {
        let p = svc.protocol.number();
        let backends: Vec<SocketAddrV4> = svc.endpoints.iter().map(|e| self.key_addr(e.addr, e.port)).collect();
        let local: Vec<SocketAddrV4> = (svc.endpoints.iter())
            .filter(|e| e.node_name.as_deref().is_none_or(|n| n == THIS_NODE))
            .map(|e| self.key_addr(e.addr, e.port))
            .collect();
        self.backend_ports.extend(backends.iter().map(SocketAddrV4::port));
        self.frontend_ports.insert(svc.port);
        let node_ip = if svc.cluster_ip.is_ipv4() {
            IpAddr::V4(NODE_IP)
        } else {
            IpAddr::V6(NODE_IP6)
        };
        let mut frontends = vec![(svc.cluster_ip, svc.port)];
        if let Some(np) = svc.node_port {
            self.frontend_ports.insert(np);
            frontends.push((node_ip, np));
        }
        let external = svc.external_ips.iter().chain(&svc.load_balancer_ips);
        frontends.extend(external.map(|ip| (*ip, svc.port)));
        for (ip, port) in frontends {
            let key = (self.key_addr(ip, port), p);
            self.services.insert(key, backends.clone());
            if let IpAddr::V6(v6) = ip {
                self.policies6.insert(key, policy6(svc, v6, local.clone()));
            }
        }
    }

    /// Frontends, sorted (for the frame generator).
    pub fn frontends(&self) -> Vec<(SocketAddrV4, u8)> {
        let mut f: Vec<_> = (self.services.keys())
            .filter(|(a, _)| self.fake.real(*a).is_none())
            .copied()
            .collect();
        f.sort();
        f
    }

    /// The IPv6 frontends, sorted.
    pub fn frontends6(&self) -> Vec<(SocketAddrV6, u8)> {
        let mut f: Vec<_> = (self.services.keys())
            .filter_map(|(a, p)| Some((self.fake.real(*a)?, *p)))
            .collect();
        f.sort();
        f
    }

    /// The port filter: could a packet with these ports be Service traffic?
    fn may_be_service(&self, src: SocketAddrV4, dst: SocketAddrV4) -> bool {
        self.frontend_ports.contains(&dst.port()) || self.backend_ports.contains(&src.port())
    }

    pub fn expect(&self, prog: Prog, input: &[u8]) -> Prediction {
        if kernel_may_refuse(prog, input) {
            return Prediction::only(Expect::Refused);
        }
        match parse_strict(input) {
            Strict::Malformed(why) => Prediction::only(Expect::Pass(Verdict::PassMalformed, why)),
            Strict::NotIpv4OrL4(why) => Prediction::only(Expect::Pass(Verdict::PassNotIpv4OrL4, why)),
            Strict::Ipv6Flow(flow) => self.expect_flow6(input, flow),
            Strict::Ipv6Fragment => Prediction::only(Expect::Pass(
                Verdict::PassFragmentUntracked,
                "IPv6 fragment not before TCP/UDP",
            )),
            Strict::Ipv6LaterFragment(f) => self.expect_later6(f),
            Strict::Icmp6Error(e) => Prediction::only(self.expect_icmp6_error(e)),
            Strict::Flow(flow) => self.expect_flow(input, flow),
            Strict::LaterFragment(f) => self.expect_later(f),
            Strict::IcmpError(e) => Prediction::only(self.expect_icmp_error(e)),
        }
    }

    /// A whole datagram or first fragment.
    fn expect_flow(&self, input: &[u8], flow: Flow) -> Prediction {
        self.flow_prediction(input, flow, None)
    }

    /// [`Self::expect_flow`] of `flow`, or of `six` (`flow` its faked form).
    fn flow_prediction(&self, input: &[u8], flow: Flow, six: Option<Flow6>) -> Prediction {
        if !self.may_be_service(flow.src, flow.dst) {
            return Prediction::only(Expect::Pass(Verdict::PassNotService, "port filter"));
        }
        let tuple = (flow.src, flow.dst, flow.proto);
        let remember = flow.first_fragment.then(|| {
            // `XP_FRAGS6`'s key has the fragment header's 32-bit id.
            let id = six.map_or(u32::from(flow.ip_id), |f| f.frag_id);
            let key = (*flow.src.ip(), *flow.dst.ip(), id, flow.proto);
            (key, (flow.src.port(), flow.dst.port()))
        });
        let lookup = self.conntrack.find(&tuple, flow.tcp_flags);
        let expect = match lookup {
            Lookup::Hit { reply, nat } => Expect::Tracked {
                packet: six.map_or(Packet::Full(flow), Packet::Full6),
                reply,
                nat,
            },
            Lookup::Miss | Lookup::Reopens => {
                let removed = (lookup == Lookup::Reopens).then_some(tuple);
                self.untracked(input, flow, removed, six)
            }
        };
        Prediction {
            expect,
            effects: Effects {
                remember,
                lookup: Some((tuple, flow.tcp_flags)),
                fragment_lookup: None,
            },
        }
    }

    /// A packet no flow tracks (any more): a new flow, an answer, or not ours.
    fn untracked(&self, input: &[u8], flow: Flow, removed: Option<Tuple>, six: Option<Flow6>) -> Expect {
        let key = (flow.dst, flow.proto);
        let backends = match (self.services.get(&key), self.policies6.get(&key), six) {
            (Some(backends), Some(policy), Some(f6)) => match self.apply6(policy, &f6, backends) {
                Ok(backends) => Some(backends),
                Err((verdict, why)) => return Expect::Drop(verdict, why),
            },
            (backends, ..) => backends.cloned(),
        };
        match backends {
            Some(backends) if !backends.is_empty() => Expect::New {
                flow,
                colliding: backends
                    .iter()
                    .copied()
                    .filter(|b| self.conntrack.collides(flow.src, *b, flow.proto, removed))
                    .collect(),
                backends,
                reopens: removed.is_some(),
                six,
            },
            Some(_) if flow.is_tcp() && flow.tcp_flags & RST != 0 => Expect::PassRstToEmpty,
            Some(_) => Expect::Reject(match six {
                Some(f6) if flow.is_tcp() => expected_rst6_of(input, &f6),
                Some(f6) => expected_port_unreachable6_of(input, &f6),
                None if flow.is_tcp() => expected_rst(input, &flow),
                None => expected_port_unreachable(input, &flow),
            }),
            None if removed.is_some() => Expect::Pass(Verdict::PassNotService, "opens a closed flow's reply tuple"),
            None => Expect::Pass(Verdict::PassNotService, "no frontend, no flow"),
        }
    }

    /// A later fragment: its first's ports, if remembered, and the flow
    /// they name, if tracked.
    fn expect_later(&self, f: LaterFragment) -> Prediction {
        let key = (f.src, f.dst, u32::from(f.ip_id), f.proto);
        self.later_of_key(key, f.proto, Packet::Later(key), &self.fragments)
    }

    /// A later fragment of the datagram `key` (its addresses, as the
    /// records key them), its protocol `proto`, its first fragment's
    /// ports looked up in `memory`.
    fn later_of_key(&self, key: FragKey, proto: u8, packet: Packet, memory: &FragMemory) -> Prediction {
        let untracked = |why| Expect::Pass(Verdict::PassFragmentUntracked, why);
        let mut effects = Effects {
            fragment_lookup: Some(key),
            ..Effects::default()
        };
        let Some(ports) = memory.ports(&key) else {
            let expect = untracked("no first fragment seen");
            return Prediction { expect, effects };
        };
        let tuple = (
            SocketAddrV4::new(key.0, ports.0),
            SocketAddrV4::new(key.1, ports.1),
            proto,
        );
        if !self.may_be_service(tuple.0, tuple.1) {
            let expect = Expect::Pass(Verdict::PassNotService, "port filter");
            return Prediction { expect, effects };
        }
        effects.lookup = Some((tuple, 0));
        let expect = match self.conntrack.find(&tuple, 0) {
            Lookup::Hit { reply, nat } => Expect::Tracked { packet, reply, nat },
            Lookup::Miss | Lookup::Reopens => untracked("its flow is not tracked"),
        };
        Prediction { expect, effects }
    }

    /// An ICMP error: its tuple is the quoted one reversed (the direction
    /// it travels); the entry there, if any, decides, unchanged.
    fn expect_icmp_error(&self, e: IcmpError) -> Expect {
        let tuple = (e.quoted_dst, e.quoted_src, e.quoted_proto);
        if !self.may_be_service(tuple.0, tuple.1) {
            return Expect::Pass(Verdict::PassNotService, "ICMP error: port filter");
        }
        match self.conntrack.related(&tuple) {
            Some(entry) => Expect::IcmpError {
                error: e,
                reply: entry.reply,
                nat: entry.nat,
            },
            None => Expect::Pass(Verdict::PassNotService, "ICMP error about no tracked flow"),
        }
    }

    /// An IPv6 new flow through its frontend's policies: dropped if its
    /// source is outside the ranges, else the backends it may reach (a
    /// `Local` frontend: this node's, pods every one; none: dropped).
    fn apply6(
        &self,
        policy: &Policy6,
        flow: &Flow6,
        backends: &[SocketAddrV4],
    ) -> Result<Vec<SocketAddrV4>, (Verdict, &'static str)> {
        let client = *flow.src.ip();
        if !policy.ranges.is_empty() && !policy.ranges.iter().any(|r| inside(*r, client)) {
            return Err((Verdict::DropSourceRange, "outside the source ranges"));
        }
        match &policy.local {
            Some(local) if !inside(POD_CIDR6, client) => {
                if local.is_empty() && !backends.is_empty() {
                    return Err((Verdict::DropNoLocalBackend, "no local backend"));
                }
                Ok(local.clone())
            }
            _ => Ok(backends.to_vec()),
        }
    }

    /// An IPv6 whole datagram or first fragment, as [`Self::expect_flow`]
    /// with its addresses faked.
    fn expect_flow6(&self, input: &[u8], f6: Flow6) -> Prediction {
        let flow = Flow {
            proto: f6.proto,
            src: self.fake.addr(f6.src),
            dst: self.fake.addr(f6.dst),
            l4_offset: f6.l4_offset,
            tot_len: f6.end,
            tcp_flags: f6.tcp_flags,
            seq: f6.seq,
            ack: f6.ack,
            payload_len: f6.payload_len,
            udp_checksum: 0,
            ip_id: 0,
            first_fragment: f6.first_fragment,
        };
        self.flow_prediction(input, flow, Some(f6))
    }

    /// A later IPv6 fragment, as [`Self::expect_later`] with `XP_FRAGS6`.
    fn expect_later6(&self, f: LaterFragment6) -> Prediction {
        let key = (self.fake.ip(f.src), self.fake.ip(f.dst), f.id, f.proto);
        self.later_of_key(key, f.proto, Packet::Later6(key), &self.fragments6)
    }

    /// The first fragments' memory `key` is in: IPv6's for a fake address.
    pub fn fragments_of(&self, key: &FragKey) -> &FragMemory {
        if self.fake.real(SocketAddrV4::new(key.0, 0)).is_some() {
            &self.fragments6
        } else {
            &self.fragments
        }
    }

    pub fn fragments_of_mut(&mut self, key: &FragKey) -> &mut FragMemory {
        if self.fake.real(SocketAddrV4::new(key.0, 0)).is_some() {
            &mut self.fragments6
        } else {
            &mut self.fragments
        }
    }

    /// An ICMPv6 error, as [`Self::expect_icmp_error`].
    fn expect_icmp6_error(&self, e: IcmpError6) -> Expect {
        let tuple = (
            self.fake.addr(e.quoted_dst),
            self.fake.addr(e.quoted_src),
            e.quoted_proto,
        );
        if !self.may_be_service(tuple.0, tuple.1) {
            return Expect::Pass(Verdict::PassNotService, "ICMPv6 error: port filter");
        }
        match self.conntrack.related(&tuple) {
            Some(entry) => Expect::Icmp6Error {
                error: e,
                reply: entry.reply,
                nat: self
                    .fake
                    .real(entry.nat)
                    .expect("an IPv6 flow's entry names IPv6 addresses"),
            },
            None => Expect::Pass(Verdict::PassNotService, "ICMPv6 error about no tracked flow"),
        }
    }

    /// The frame ran: applies its effects. `lookup` is false when the
    /// program showed it had lost a later fragment's ports (no lookup then).
    pub fn ran(&mut self, effects: &Effects, lookup: bool) {
        if let Some((key, ports)) = effects.remember {
            self.fragments_of_mut(&key).remember(key, ports);
        }
        if let Some(key) = effects.fragment_lookup {
            self.fragments_of_mut(&key).looked_up(&key);
        }
        if let (Some((tuple, flags)), true) = (effects.lookup, lookup) {
            self.conntrack.look_up(&tuple, flags);
        }
    }

    /// The program translated a new flow to `backend`.
    pub fn new_flow(&mut self, flow: &Flow, backend: SocketAddrV4) {
        let tuple = (flow.src, flow.dst, flow.proto);
        assert!(
            self.conntrack.create(&tuple, backend),
            "the oracle cannot track a flow it expected the program to track"
        );
        match (
            self.fake.real(flow.src),
            self.fake.real(flow.dst),
            self.fake.real(backend),
        ) {
            (Some(client), Some(frontend), Some(backend)) => {
                self.flow_list6.push((client, frontend, backend, flow.proto));
            }
            _ => self.flow_list.push((flow.src, flow.dst, backend, flow.proto)),
        }
        assert!(
            self.conntrack.len() < self.conntrack_room,
            "the fuzz outgrew its conntrack table ({} entries): load the data path with more",
            self.conntrack.len()
        );
    }
}
